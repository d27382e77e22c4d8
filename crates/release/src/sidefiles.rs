//! The files the runtime reads beside the Core ML packages (the side-files
//! table of the upstream runtime's model folder): the INT8 token and
//! per-layer embedding tables with their fp16 row scales, the fp16 per-layer
//! projection and its norm weight, the fp16 RoPE tables of both attention
//! kinds, and `model_config.json`. Every dimension comes from the checkpoint
//! and its config, so any Gemma 4 size works (E2B, E4B, the fixtures).
//!
//! The big tables are streamed: rows are fetched with positioned reads in
//! blocks of a few MiB (never mapped: mapped file pages count as resident
//! memory), each block is converted on all cores, and blocks are written in
//! order on a thread of their own, so reading, converting and writing
//! overlap and memory stays at a few blocks whatever the vocabulary.

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use chunkforge_model::checkpoint::{self, Checkpoint, TensorInfo};
use chunkforge_model::config::{Attention, TextConfig};
use chunkforge_model::plan;
use half::f16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;

chunkforge_model::named! {
    /// What a side file holds.
    pub enum Role {
        /// Embedding tables and the per-layer input path's weights, looked up on the CPU.
        Embedding = "embedding",
        /// cos/sin rows the runtime feeds every chunk per position.
        Rope = "rope",
        /// `model_config.json`.
        Config = "config",
    }
}

/// One file of the set, as the runtime names it: what it is for, whether
/// the runtime needs it, how it is made and so how big it must be. A new side
/// file is a row here (plus its [`MadeFrom`] writer if it is made a new way);
/// `write_side_files` writes the rows in order, the manifest takes its role
/// from it and `run` checks its size by it.
#[derive(Clone, Copy, Debug)]
pub struct SideFileSpec {
    pub name: &'static str,
    pub role: Role,
    /// Whether the runtime refuses to load without it. The others it loads
    /// without and then computes wrong results: missing RoPE tables read as
    /// rows of zeros, a missing per-layer norm weight skips that norm. A
    /// release carries them all the same (`write_side_files` always writes
    /// them; the norm weight whenever the checkpoint has it, which every
    /// Gemma 4 checkpoint does).
    pub required: bool,
    pub made_from: MadeFrom,
    /// Its folder in the app's repository (a release folder), if not the
    /// root: the app fetches the RoPE tables from `swa/` and saves them at
    /// the root of its model folder (ModelDownloader.swift).
    pub repository_dir: Option<&'static str>,
}

/// How a side file is made.
#[derive(Clone, Copy, Debug)]
pub enum MadeFrom {
    /// A checkpoint tensor (its name without the checkpoint's prefix),
    /// converted row by row.
    Tensor {
        tensor: &'static str,
        convert: Convert,
        /// Absent from a checkpoint: skipped (the runtime loads without the file).
        optional: bool,
        /// The runtime looks rows up by token id, so it needs `vocab_size` of them.
        by_token: bool,
    },
    /// The fp16 row scales of the INT8 table of this name (the row before).
    ScalesOf(&'static str),
    /// A RoPE table of one attention kind: (positions, head dim) fp16.
    Rope(Attention, Wave),
    /// `model_config.json` ([`ModelConfig`]).
    ModelConfig,
}

/// The size a side file must have, from `config.json`'s dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expected {
    Bytes(u64),
    /// A `.npy` table of this head dim (its header gives the size).
    Npy {
        head_dim: usize,
    },
    /// Checked by its contents (`model_config.json`).
    Contents,
}

impl SideFileSpec {
    /// Its path in the app's repository (a release folder).
    pub fn repository_path(&self) -> String {
        match self.repository_dir {
            Some(dir) => format!("{dir}/{}", self.name),
            None => self.name.to_string(),
        }
    }

    /// Its path in a folder of the app's repository layout (`repository`)
    /// or of its model folder's (the name alone).
    pub fn path_in(&self, repository: bool) -> String {
        if repository {
            self.repository_path()
        } else {
            self.name.to_string()
        }
    }

    /// The size `cfg` implies for the file.
    pub fn expected(&self, cfg: &TextConfig) -> Expected {
        match self.made_from {
            MadeFrom::Tensor {
                tensor, convert, ..
            } => {
                let (rows, width) = tensor_rows(cfg, tensor);
                Expected::Bytes((rows * width * convert.bytes_per_element()) as u64)
            }
            MadeFrom::ScalesOf(table) => {
                let rows = SIDE_FILES
                    .iter()
                    .find_map(|s| match s.made_from {
                        MadeFrom::Tensor { tensor, .. } if s.name == table => {
                            Some(tensor_rows(cfg, tensor).0)
                        }
                        _ => None,
                    })
                    .unwrap_or(0);
                Expected::Bytes(rows as u64 * 2)
            }
            MadeFrom::Rope(kind, _) => Expected::Npy {
                head_dim: cfg.head_dim_of(kind),
            },
            MadeFrom::ModelConfig => Expected::Contents,
        }
    }
}

/// (rows, width) of decoder tensor `local` as config.json implies it (a
/// 1-D tensor is one row).
fn tensor_rows(cfg: &TextConfig, local: &str) -> (usize, usize) {
    let shapes = checkpoint::expected_tensors(cfg);
    match shapes
        .iter()
        .find(|(name, _)| name == local)
        .map(|s| s.1.as_slice())
    {
        Some([w]) => (1, *w),
        Some([r, w]) => (*r, *w),
        _ => (0, 0),
    }
}

const fn tensor(
    name: &'static str,
    tensor: &'static str,
    convert: Convert,
    optional: bool,
    by_token: bool,
) -> SideFileSpec {
    SideFileSpec {
        name,
        role: Role::Embedding,
        required: !optional,
        made_from: MadeFrom::Tensor {
            tensor,
            convert,
            optional,
            by_token,
        },
        repository_dir: None,
    }
}

const fn scales(name: &'static str, of: &'static str) -> SideFileSpec {
    SideFileSpec {
        name,
        role: Role::Embedding,
        required: true,
        made_from: MadeFrom::ScalesOf(of),
        repository_dir: None,
    }
}

const fn rope(name: &'static str, kind: Attention, wave: Wave) -> SideFileSpec {
    SideFileSpec {
        name,
        role: Role::Rope,
        required: false,
        made_from: MadeFrom::Rope(kind, wave),
        repository_dir: Some("swa"),
    }
}

pub const EMBED_Q8: &str = "embed_tokens_q8.bin";
pub const EMBED_SCALES: &str = "embed_tokens_scales.bin";
pub const PER_LAYER_Q8: &str = "embed_tokens_per_layer_q8.bin";
pub const PER_LAYER_SCALES: &str = "embed_tokens_per_layer_scales.bin";
pub const PER_LAYER_PROJECTION: &str = "per_layer_projection.bin";
pub const PER_LAYER_NORM: &str = "per_layer_norm_weight.bin";
pub const COS_SLIDING: &str = "cos_sliding.npy";
pub const SIN_SLIDING: &str = "sin_sliding.npy";
pub const COS_FULL: &str = "cos_full.npy";
pub const SIN_FULL: &str = "sin_full.npy";
pub const MODEL_CONFIG: &str = "model_config.json";

/// Every side file, in the order they are written.
pub const SIDE_FILES: &[SideFileSpec] = &[
    tensor(
        EMBED_Q8,
        "embed_tokens.weight",
        Convert::Int8PerRow,
        false,
        true,
    ),
    scales(EMBED_SCALES, EMBED_Q8),
    tensor(
        PER_LAYER_Q8,
        "embed_tokens_per_layer.weight",
        Convert::Int8PerRow,
        false,
        true,
    ),
    scales(PER_LAYER_SCALES, PER_LAYER_Q8),
    tensor(
        PER_LAYER_PROJECTION,
        "per_layer_model_projection.weight",
        Convert::Fp16,
        false,
        false,
    ),
    tensor(
        PER_LAYER_NORM,
        "per_layer_projection_norm.weight",
        Convert::Fp16,
        true,
        false,
    ),
    rope(COS_SLIDING, Attention::Sliding, Wave::Cos),
    rope(SIN_SLIDING, Attention::Sliding, Wave::Sin),
    rope(COS_FULL, Attention::Full, Wave::Cos),
    rope(SIN_FULL, Attention::Full, Wave::Sin),
    SideFileSpec {
        name: MODEL_CONFIG,
        role: Role::Config,
        required: true,
        made_from: MadeFrom::ModelConfig,
        repository_dir: None,
    },
];

/// The side file at `path` in a release (its name, or its repository path).
pub fn spec_of(path: &str) -> Option<&'static SideFileSpec> {
    SIDE_FILES
        .iter()
        .find(|f| f.name == path || f.repository_path() == path)
}

/// The role of the side file at `path`; None for a path no row of
/// [`SIDE_FILES`] names.
pub fn role_of(path: &str) -> Option<Role> {
    spec_of(path).map(|f| f.role)
}

/// What to write, and where.
#[derive(Clone, Copy, Debug)]
pub struct SideFilesRequest<'a> {
    /// The checkpoint folder (for `config.json`'s and `generation_config.json`'s token ids).
    pub hf_dir: &'a Path,
    pub cfg: &'a TextConfig,
    pub checkpoint: &'a Checkpoint,
    /// The packages' full-attention context length (`model_config.json`'s
    /// `context_length`; the runtime refuses packages that disagree with it).
    pub context_length: usize,
    /// Rows of each RoPE table, at least `context_length`: the runtime feeds
    /// rows of zeros for positions past the table's end.
    pub rope_positions: usize,
    pub model_name: &'a str,
    /// An existing folder (the caller's staging folder); each file appears
    /// under its final name only once complete.
    pub dest: &'a Path,
    /// Lay the files out as the app's repository (a release folder: RoPE
    /// tables under `swa/`) instead of its model folder (every file at the
    /// root).
    pub repository: bool,
}

/// One file written.
#[derive(Clone, Debug, Serialize)]
pub struct SideFile {
    /// Relative to the request's `dest`.
    pub path: PathBuf,
    pub bytes: u64,
    pub role: Role,
    pub seconds: f64,
}

/// What `write_side_files` did.
#[derive(Clone, Debug, Serialize)]
pub struct SideFilesReport {
    pub files: Vec<SideFile>,
    /// Tensor bytes read from the checkpoint.
    pub bytes_read: u64,
    pub seconds: f64,
}

impl SideFilesReport {
    pub fn bytes_written(&self) -> u64 {
        self.files.iter().map(|f| f.bytes).sum()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SideFilesError {
    /// A tensor a side file is made from is missing, has an unexpected shape
    /// or dtype, cannot be read, or holds a value the file cannot represent.
    #[error("{}: tensor {tensor}: {message}", file.display())]
    Tensor {
        file: PathBuf,
        tensor: String,
        message: String,
    },
    /// `config.json` / `generation_config.json` hold something the runtime cannot use.
    #[error("{}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    /// A request the runtime could not use (e.g. RoPE tables shorter than the context).
    #[error("{0}")]
    Request(String),
    #[error("{}: could not {action}: {source}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: io::Error,
    },
}

type Result<T, E = SideFilesError> = std::result::Result<T, E>;

/// Source bytes per block read: big enough that each read and write is
/// large, small enough that a few blocks in flight stay a few tens of MiB.
const BLOCK_BYTES: usize = 8 << 20;
/// Blocks in flight per stage (being read, converted, written).
const IN_FLIGHT: usize = 4;

/// The rows made from checkpoint tensors: (row, tensor, convert, optional, by_token).
fn tensor_rows_of_table() -> impl Iterator<Item = (&'static SideFileSpec, TensorRow)> {
    SIDE_FILES.iter().filter_map(|s| match s.made_from {
        MadeFrom::Tensor {
            tensor,
            convert,
            optional,
            by_token,
        } => Some((
            s,
            TensorRow {
                tensor,
                file: s.name,
                convert,
                optional,
                by_token,
            },
        )),
        _ => None,
    })
}

/// A row made from a checkpoint tensor, unpacked.
#[derive(Clone, Copy, Debug)]
struct TensorRow {
    tensor: &'static str,
    file: &'static str,
    convert: Convert,
    optional: bool,
    by_token: bool,
}

/// The checkpoint tensors [`write_side_files`] reads (for `bench side-files`
/// to read the same bytes without converting them).
pub fn source_tensors(ckpt: &Checkpoint) -> Vec<TensorInfo> {
    tensor_rows_of_table()
        .filter_map(|(_, m)| ckpt.tensors.get(&format!("{}{}", ckpt.prefix, m.tensor)))
        .cloned()
        .collect()
}

/// Writes every side file of the checkpoint into `req.dest`, in the order
/// of [`SIDE_FILES`]. Every tensor is checked before anything is written; a
/// failure later (a value a file cannot hold, an I/O error) leaves the files
/// finished so far under their names and none half-written: the caller's
/// staging folder is what keeps them from being published.
pub fn write_side_files(req: &SideFilesRequest) -> Result<SideFilesReport> {
    let started = Instant::now();
    check_request(req)?;
    let cfg = req.cfg;
    // The shapes config.json implies, from the one table the checkpoint is validated with.
    let shapes = checkpoint::expected_tensors(cfg);
    let mut sources: Vec<(TensorRow, Source)> = Vec::new();
    for (_, m) in tensor_rows_of_table() {
        let shape = shapes
            .iter()
            .find(|(name, _)| name == m.tensor)
            .map(|(_, shape)| shape.as_slice())
            .expect("every side-file tensor is a decoder tensor");
        match optional_source(req, m.tensor, shape, m.file)? {
            Some(src) => sources.push((m, src)),
            None if m.optional => {}
            None => return Err(missing(req, &m)),
        }
    }
    for (m, src) in &sources {
        if m.by_token && src.rows < cfg.vocab_size {
            return Err(src.err(format!(
                "{} rows, but vocab_size is {}: the runtime looks up every token id in it",
                src.rows, cfg.vocab_size
            )));
        }
    }
    let config = model_config(req)?;

    let mut report = SideFilesReport {
        files: Vec::new(),
        bytes_read: 0,
        seconds: 0.0,
    };
    let mut buffers = Buffers::default();
    // INT8 tables' row scales, by table, until their own row writes them.
    let mut row_scales: Vec<(&str, Vec<f16>)> = Vec::new();
    for spec in SIDE_FILES {
        crate::staging::stop_if_interrupted();
        let t = Instant::now();
        let rel = spec.path_in(req.repository);
        let target = req.dest.join(&rel);
        // One level below `dest` (`swa/`), never `dest` itself: nothing is
        // made again in a staging folder that Ctrl-C removed.
        if let Some(dir) = target.parent().filter(|d| !d.is_dir()) {
            fs::create_dir(dir).map_err(|source| SideFilesError::Io {
                path: dir.to_path_buf(),
                action: "create the folder",
                source,
            })?;
        }
        let bytes = match spec.made_from {
            MadeFrom::Tensor { .. } => {
                let Some((m, src)) = sources.iter().find(|(m, _)| m.file == spec.name) else {
                    continue; // an optional tensor the checkpoint lacks
                };
                let (bytes, scales) =
                    stream_tensor(src, m.convert, src.block_rows(), &target, &mut buffers)?;
                report.bytes_read += src.info.bytes;
                row_scales.push((spec.name, scales));
                bytes
            }
            MadeFrom::ScalesOf(table) => {
                let Some(at) = row_scales.iter().position(|(n, _)| *n == table) else {
                    continue; // its table was not written
                };
                let (_, scales) = row_scales.swap_remove(at);
                let bytes: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
                write_whole(&target, &[&bytes])?;
                bytes.len() as u64
            }
            MadeFrom::Rope(kind, wave) => {
                RopeTable::of(cfg, kind).write(wave, req.rope_positions, &target)?
            }
            MadeFrom::ModelConfig => {
                let mut text = serde_json::to_vec_pretty(&config).expect("JSON values serialize");
                text.push(b'\n');
                write_whole(&target, &[&text])?;
                text.len() as u64
            }
        };
        report.files.push(SideFile {
            path: PathBuf::from(rel),
            bytes,
            role: spec.role,
            seconds: t.elapsed().as_secs_f64(),
        });
    }
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

fn check_request(req: &SideFilesRequest) -> Result<()> {
    if req.context_length == 0 {
        return Err(SideFilesError::Request(
            "the context length is 0; the runtime needs at least one position".into(),
        ));
    }
    if req.rope_positions < req.context_length {
        return Err(SideFilesError::Request(format!(
            "RoPE tables of {} positions are shorter than the context length {}: the runtime would \
             feed rows of zeros (no rotation) from position {} on; ask for at least {} positions",
            req.rope_positions,
            req.context_length,
            req.rope_positions,
            req.context_length
        )));
    }
    if !req.dest.is_dir() {
        return Err(SideFilesError::Io {
            path: req.dest.to_path_buf(),
            action: "write the side files into it",
            source: io::Error::new(io::ErrorKind::NotFound, "not a folder"),
        });
    }
    Ok(())
}

// ---- reading tensors ---------------------------------------------------

/// The dtypes a side file may be made from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    fn of(name: &str) -> Option<Dtype> {
        match name {
            "F32" => Some(Dtype::F32),
            "F16" => Some(Dtype::F16),
            "BF16" => Some(Dtype::Bf16),
            _ => None,
        }
    }

    fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }

    /// Decodes little-endian elements into `out` (as long as `raw` holds).
    #[inline(always)]
    fn decode(self, raw: &[u8], out: &mut [f32]) {
        match self {
            Dtype::Bf16 => {
                for (o, b) in out.iter_mut().zip(raw.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
                }
            }
            Dtype::F16 => {
                for (o, b) in out.iter_mut().zip(raw.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(raw.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }
}

/// A checkpoint tensor read as rows (a 1-D tensor is one row).
#[derive(Clone, Debug)]
struct Source {
    name: String,
    info: TensorInfo,
    dtype: Dtype,
    rows: usize,
    width: usize,
    /// The side file it becomes (for messages).
    target: &'static str,
}

impl Source {
    fn err(&self, message: String) -> SideFilesError {
        SideFilesError::Tensor {
            file: self.info.file.clone(),
            tensor: self.name.clone(),
            message,
        }
    }

    fn row_bytes(&self) -> usize {
        self.width * self.dtype.size()
    }

    fn block_rows(&self) -> usize {
        (BLOCK_BYTES / self.row_bytes().max(1)).max(1)
    }
}

/// The tensor `local` (without the checkpoint's prefix) checked against the
/// shape config.json implies; None when the checkpoint has no such tensor.
fn optional_source(
    req: &SideFilesRequest,
    local: &str,
    shape: &[usize],
    target: &'static str,
) -> Result<Option<Source>> {
    let name = format!("{}{local}", req.checkpoint.prefix);
    let Some(info) = req.checkpoint.tensors.get(&name) else {
        return Ok(None);
    };
    let bad = |message: String| SideFilesError::Tensor {
        file: info.file.clone(),
        tensor: name.clone(),
        message,
    };
    let dtype = Dtype::of(&info.dtype).ok_or_else(|| {
        bad(format!(
            "dtype {}, but {target} is made from F32, F16 or BF16 weights",
            info.dtype
        ))
    })?;
    if info.shape != shape {
        return Err(bad(format!(
            "shape {:?}, but config.json implies {shape:?} (for {target})",
            info.shape
        )));
    }
    let (rows, width) = match shape {
        [w] => (1, *w),
        [r, w] => (*r, *w),
        _ => unreachable!("side files are made from 1-D and 2-D tensors"),
    };
    if info.bytes != (rows * width * dtype.size()) as u64 {
        return Err(bad(format!(
            "{} bytes, but its shape {shape:?} of {} needs {}",
            info.bytes,
            info.dtype,
            rows * width * dtype.size()
        )));
    }
    Ok(Some(Source {
        name,
        info: info.clone(),
        dtype,
        rows,
        width,
        target,
    }))
}

/// The error for a required tensor the checkpoint lacks. It is in no file:
/// the one file searched is named, or the folder of the shards.
fn missing(req: &SideFilesRequest, m: &TensorRow) -> SideFilesError {
    let ck = req.checkpoint;
    let file = match ck.weight_files.as_slice() {
        [one] => one.clone(),
        _ => ck.dir.clone(),
    };
    SideFilesError::Tensor {
        file,
        tensor: format!("{}{}", ck.prefix, m.tensor),
        message: format!(
            "not in the checkpoint; the runtime's {} is made from it",
            m.file
        ),
    }
}

// ---- converting rows ---------------------------------------------------

/// What one row becomes.
#[derive(Clone, Copy, Debug)]
pub enum Convert {
    /// Symmetric INT8 with one fp16 scale per row, as the runtime dequantizes
    /// it: `value = q * (scale / 127)`.
    Int8PerRow,
    /// The row in fp16 (round to nearest even).
    Fp16,
}

impl Convert {
    /// Bytes per element of the file.
    fn bytes_per_element(self) -> usize {
        match self {
            Convert::Int8PerRow => 1,
            Convert::Fp16 => 2,
        }
    }
}

/// Why a row cannot be written.
#[derive(Debug, PartialEq)]
enum RowProblem {
    /// Index within the row.
    NotFinite(usize),
    /// The row's largest magnitude, above fp16's largest finite value.
    ScaleOverflow(f32),
    /// Index and value of an element fp16 cannot hold.
    Fp16Overflow(usize, f32),
}

impl RowProblem {
    fn describe(&self, row: usize, rows: usize) -> String {
        let at = if rows == 1 {
            String::new()
        } else {
            format!("row {row}, ")
        };
        match self {
            RowProblem::NotFinite(i) => format!("{at}element {i} is not a finite number"),
            RowProblem::ScaleOverflow(m) => format!(
                "row {row}'s largest magnitude {m} exceeds fp16's largest value 65504, so its fp16 scale would be infinite"
            ),
            RowProblem::Fp16Overflow(i, v) => {
                format!("{at}element {i} is {v}, beyond fp16's range (largest 65504)")
            }
        }
    }
}

/// 1.5·2^23: for an f32 `t` of magnitude at most 2^22, `t + ROUND_MAGIC` is
/// exactly `ROUND_MAGIC + round(t)` (ties to even, the default rounding
/// mode, as `torch.round` has it), so the sum's low byte is `round(t)` as a
/// two's-complement int8. Unlike a rounding call per element, it vectorizes.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// One row quantized into `q` (int8 bytes); returns its fp16 scale.
///
/// The rule of the upstream converter (so a runtime reading either gets the
/// same numbers): scale = fp16(max(absmax, 1e-8)); q = round(x · 127 /
/// max(scale, 1e-8)) clamped to ±127, computed in f32 with the fp16-rounded
/// scale, so the stored int8 matches what the runtime multiplies it by. An
/// all-zero row gets scale 0 and q 0.
#[inline(always)]
fn quantize_row(x: &[f32], q: &mut [u8]) -> Result<f16, RowProblem> {
    // Magnitudes compared as bit patterns: with the sign cleared, integer
    // order is numeric order, NaNs and infinities come out on top, and the
    // loop vectorizes.
    let top = x
        .iter()
        .map(|v| (v.to_bits() & 0x7FFF_FFFF) as i32)
        .fold(0, i32::max);
    if top >= 0x7F80_0000 {
        let i = x.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return Err(RowProblem::NotFinite(i));
    }
    let absmax = f32::from_bits(top as u32);
    let scale = f16::from_f32(absmax.max(1e-8));
    if scale.is_infinite() {
        return Err(RowProblem::ScaleOverflow(absmax));
    }
    let inv = 127.0f32 / scale.to_f32().max(1e-8);
    for (o, &v) in q.iter_mut().zip(x) {
        // Clamped before rounding, which is the same as after (±127 are
        // integers); written as compares so they become vector min/max.
        let t = v * inv;
        let t = if t < -127.0 { -127.0 } else { t };
        let t = if t > 127.0 { 127.0 } else { t };
        *o = (t + ROUND_MAGIC).to_bits() as u8;
    }
    Ok(scale)
}

/// One row into fp16 little-endian bytes (round to nearest even), in
/// pieces converted by `half`'s slice conversion (F16C where the CPU has it).
fn fp16_row(x: &[f32], out: &mut [u8]) -> Result<(), RowProblem> {
    use half::slice::HalfFloatSliceExt;
    const PIECE: usize = 64;
    let mut h = [f16::ZERO; PIECE];
    for (p, (xs, os)) in x.chunks(PIECE).zip(out.chunks_mut(2 * PIECE)).enumerate() {
        let h = &mut h[..xs.len()];
        h.convert_from_f32_slice(xs);
        for (j, (o, v)) in os.chunks_exact_mut(2).zip(h.iter()).enumerate() {
            if !v.is_finite() {
                let (i, x) = (p * PIECE + j, xs[j]);
                return Err(if x.is_finite() {
                    RowProblem::Fp16Overflow(i, x)
                } else {
                    RowProblem::NotFinite(i)
                });
            }
            o.copy_from_slice(&v.to_le_bytes());
        }
    }
    Ok(())
}

impl Convert {
    fn out_bytes_per_element(self) -> usize {
        match self {
            Convert::Int8PerRow => 1,
            Convert::Fp16 => 2,
        }
    }

    #[inline(always)]
    fn row(self, x: &[f32], out: &mut [u8]) -> Result<Option<f16>, RowProblem> {
        match self {
            Convert::Int8PerRow => quantize_row(x, out).map(Some),
            Convert::Fp16 => fp16_row(x, out).map(|()| None),
        }
    }
}

/// One source row (`raw`, decoded into the scratch `x`) converted into `out`.
/// The loops are plain Rust that the compiler vectorizes; on x86-64 CPUs
/// with AVX2 the same code is compiled a second time for 8-wide vectors.
fn convert_row(
    dtype: Dtype,
    convert: Convert,
    raw: &[u8],
    x: &mut [f32],
    out: &mut [u8],
) -> Result<Option<f16>, RowProblem> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { convert_row_avx2(dtype, convert, raw, x, out) };
    }
    convert_row_portable(dtype, convert, raw, x, out)
}

#[inline(always)]
fn convert_row_portable(
    dtype: Dtype,
    convert: Convert,
    raw: &[u8],
    x: &mut [f32],
    out: &mut [u8],
) -> Result<Option<f16>, RowProblem> {
    dtype.decode(raw, x);
    convert.row(x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn convert_row_avx2(
    dtype: Dtype,
    convert: Convert,
    raw: &[u8],
    x: &mut [f32],
    out: &mut [u8],
) -> Result<Option<f16>, RowProblem> {
    convert_row_portable(dtype, convert, raw, x, out)
}

/// A block of source rows as read: `rows` rows starting at row `first`.
struct Block {
    first: usize,
    rows: usize,
    bytes: Vec<u8>,
}

/// Block buffers kept from one tensor for the next: fresh memory costs a
/// page fault per 4 KiB, as much as the reads themselves for small tables.
#[derive(Default)]
struct Buffers {
    input: Vec<Vec<u8>>,
    output: Vec<Vec<u8>>,
}

thread_local! {
    /// Each worker's decoded row, reused from row to row (a fresh one per
    /// row or per task would be allocated and zeroed each time).
    static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Converts `src` row by row into the file `out` (written under a temporary
/// name, renamed when complete), `block_rows` rows at a time: one thread
/// reads blocks, this one converts each on all cores, one writes them in
/// order. Returns the bytes written and the rows' scales (Int8PerRow).
fn stream_tensor(
    src: &Source,
    convert: Convert,
    block_rows: usize,
    out: &Path,
    pool: &mut Buffers,
) -> Result<(u64, Vec<f16>)> {
    let file = File::open(&src.info.file).map_err(|e| SideFilesError::Io {
        path: src.info.file.clone(),
        action: "open the weights",
        source: e,
    })?;
    let block_rows = block_rows.max(1);
    let row_bytes = src.row_bytes();
    let out_row = src.width * convert.out_bytes_per_element();
    let partial = Partial::create(out)?;

    let (full_tx, full_rx) = mpsc::sync_channel::<Result<Block>>(IN_FLIGHT);
    let (free_in_tx, free_in_rx) = mpsc::sync_channel::<Vec<u8>>(IN_FLIGHT + 1);
    let (write_tx, write_rx) = mpsc::sync_channel::<Vec<u8>>(IN_FLIGHT);
    let (free_out_tx, free_out_rx) = mpsc::sync_channel::<Vec<u8>>(IN_FLIGHT + 1);
    for _ in 0..=IN_FLIGHT {
        let (i, o) = (pool.input.pop(), pool.output.pop());
        free_in_tx
            .send(i.unwrap_or_default())
            .expect("channel has room");
        free_out_tx
            .send(o.unwrap_or_default())
            .expect("channel has room");
    }

    let (converted, written) = std::thread::scope(|s| {
        let reader = s.spawn(|| read_blocks(src, &file, block_rows, free_in_rx, full_tx));
        let mut sink = &partial.file;
        let writer = s.spawn(move || -> io::Result<u64> {
            let mut total = 0u64;
            for buf in write_rx {
                sink.write_all(&buf)?;
                total += buf.len() as u64;
                // The converter may have stopped: then the buffer is not needed back.
                let _ = free_out_tx.send(buf);
            }
            Ok(total)
        });
        let converted = convert_blocks(
            src,
            convert,
            out_row,
            row_bytes,
            full_rx,
            free_in_tx,
            &free_out_rx,
            write_tx,
        );
        // A reader error reached the converter as a block; panics propagate.
        let free_in_rx = reader.join().expect("reader thread panicked");
        let written = writer.join().expect("writer thread panicked");
        // Every thread is done: the buffers are back (unless one stopped early).
        pool.input.extend(free_in_rx.try_iter());
        pool.output.extend(free_out_rx.try_iter());
        (converted, written)
    });
    let scales = converted?;
    let written = written.map_err(|e| SideFilesError::Io {
        path: partial.path.clone(),
        action: "write",
        source: e,
    })?;
    partial.commit()?;
    Ok((written, scales))
}

/// The reader thread: every block of `src`, in order, into `full`. Returns
/// `free`, where the converter hands the buffers back.
fn read_blocks(
    src: &Source,
    file: &File,
    block_rows: usize,
    free: mpsc::Receiver<Vec<u8>>,
    full: mpsc::SyncSender<Result<Block>>,
) -> mpsc::Receiver<Vec<u8>> {
    let row_bytes = src.row_bytes();
    let mut first = 0;
    while first < src.rows {
        let Ok(mut bytes) = free.recv() else {
            break; // the converter stopped
        };
        let rows = block_rows.min(src.rows - first);
        bytes.resize(rows * row_bytes, 0);
        let at = src.info.offset + (first * row_bytes) as u64;
        let block = file
            .read_exact_at(&mut bytes, at)
            .map(|()| Block { first, rows, bytes })
            .map_err(|e| {
                src.err(format!(
                    "cannot read rows {first}..{} (bytes {at}..{}): {e}",
                    first + rows,
                    at + (rows * row_bytes) as u64
                ))
            });
        let failed = block.is_err();
        if full.send(block).is_err() || failed {
            break;
        }
        first += rows;
    }
    free
}

/// The converting side of [`stream_tensor`]: each block's rows in parallel,
/// the result handed to the writer in order. Returns the scales.
#[allow(clippy::too_many_arguments)]
fn convert_blocks(
    src: &Source,
    convert: Convert,
    out_row: usize,
    row_bytes: usize,
    full: mpsc::Receiver<Result<Block>>,
    free_in: mpsc::SyncSender<Vec<u8>>,
    free_out: &mpsc::Receiver<Vec<u8>>,
    to_write: mpsc::SyncSender<Vec<u8>>,
) -> Result<Vec<f16>> {
    let mut scales = Vec::new();
    let mut done = 0;
    for block in full {
        let block = block?;
        debug_assert_eq!(block.first, done);
        let Ok(mut out) = free_out.recv() else {
            break; // the writer failed; its error is reported
        };
        out.resize(block.rows * out_row, 0);
        let results: Vec<Result<Option<f16>, RowProblem>> = block
            .bytes
            .par_chunks(row_bytes)
            .zip(out.par_chunks_mut(out_row))
            .with_min_len(8)
            .map(|(raw, o)| {
                ROW.with_borrow_mut(|x| {
                    x.resize(src.width, 0.0);
                    convert_row(src.dtype, convert, raw, x, o)
                })
            })
            .collect();
        for (i, r) in results.into_iter().enumerate() {
            let row = block.first + i;
            match r {
                Ok(Some(scale)) => scales.push(scale),
                Ok(None) => {}
                Err(p) => {
                    return Err(src.err(format!(
                        "{}; {} cannot be written",
                        p.describe(row, src.rows),
                        src.target
                    )))
                }
            }
        }
        done += block.rows;
        let _ = free_in.send(block.bytes);
        if to_write.send(out).is_err() {
            break; // the writer failed; its error is reported
        }
    }
    Ok(scales)
}

// ---- writing files -----------------------------------------------------

/// A file being written under a temporary name in its folder; renamed to
/// its final name by [`Partial::commit`], removed if dropped before.
struct Partial {
    file: File,
    path: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl Partial {
    fn create(target: &Path) -> Result<Partial> {
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let path = target.with_file_name(format!(".{name}.partial"));
        let file = File::create(&path).map_err(|e| SideFilesError::Io {
            path: path.clone(),
            action: "create",
            source: e,
        })?;
        Ok(Partial {
            file,
            path,
            target: target.to_path_buf(),
            committed: false,
        })
    }

    fn commit(mut self) -> Result<()> {
        fs::rename(&self.path, &self.target).map_err(|e| SideFilesError::Io {
            path: self.target.clone(),
            action: "move into place",
            source: e,
        })?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Writes `parts` one after another as the file `target`.
fn write_whole(target: &Path, parts: &[&[u8]]) -> Result<u64> {
    let mut partial = Partial::create(target)?;
    let mut total = 0;
    for part in parts {
        partial
            .file
            .write_all(part)
            .map_err(|e| SideFilesError::Io {
                path: partial.path.clone(),
                action: "write",
                source: e,
            })?;
        total += part.len() as u64;
    }
    partial.commit()?;
    Ok(total)
}

// ---- RoPE tables -------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wave {
    Cos,
    Sin,
}

/// The rotary frequencies of one attention kind, as transformers' Gemma 4
/// rotary embedding computes them.
#[derive(Clone, Debug)]
struct RopeTable {
    /// One per pair of the head dim; 0 for pairs that do not rotate.
    inv_freq: Vec<f32>,
}

impl RopeTable {
    /// Sliding layers: plain RoPE over `head_dim`. Full layers: proportional
    /// RoPE over `global_head_dim`: only the first `partial_rotary_factor ·
    /// head_dim / 2` pairs rotate, with exponents over the whole head dim;
    /// the other pairs have frequency 0 (cos 1, sin 0). A factor of 1 is plain RoPE.
    fn of(cfg: &TextConfig, kind: Attention) -> RopeTable {
        match kind {
            Attention::Sliding => RopeTable::new(cfg.head_dim, cfg.rope_theta_sliding, 1.0),
            Attention::Full => RopeTable::new(
                cfg.global_head_dim,
                cfg.rope_theta_full,
                cfg.partial_rotary_factor_full,
            ),
        }
    }

    fn new(head_dim: usize, theta: f64, partial_rotary_factor: f64) -> RopeTable {
        // transformers: int(partial_rotary_factor * head_dim // 2).
        let rotated = ((partial_rotary_factor * head_dim as f64) / 2.0).floor() as usize;
        let pairs = head_dim / 2;
        // In f32 as transformers has it: exponent 2i/d in f32, theta^exponent
        // rounded to f32 (computed in f64 so the f32 is the nearest one),
        // then 1/x in f32.
        let theta = theta as f32;
        let inv_freq = (0..pairs)
            .map(|i| {
                if i >= rotated {
                    return 0.0;
                }
                let exponent = (2 * i) as f32 / head_dim as f32;
                let base = f64::from(theta).powf(f64::from(exponent)) as f32;
                1.0f32 / base
            })
            .collect();
        RopeTable { inv_freq }
    }

    fn head_dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// Row `position` into `out` (fp16 bytes, head_dim values): the angle
    /// `position · inv_freq` in f32, its cos or sin rounded to f32 then fp16
    /// (transformers' path), the pairs' values twice ([freqs, freqs]).
    fn row(&self, wave: Wave, position: usize, out: &mut [u8]) {
        let pairs = self.inv_freq.len();
        let (first, second) = out.split_at_mut(2 * pairs);
        let p = position as f32;
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let angle = f64::from(p * f);
            let v = match wave {
                Wave::Cos => angle.cos(),
                Wave::Sin => angle.sin(),
            } as f32;
            let bytes = f16::from_f32(v).to_le_bytes();
            first[2 * i..2 * i + 2].copy_from_slice(&bytes);
            second[2 * i..2 * i + 2].copy_from_slice(&bytes);
        }
    }

    /// The table of `positions` rows as a `.npy` file ('<f2', C order).
    fn write(&self, wave: Wave, positions: usize, target: &Path) -> Result<u64> {
        self.write_blocks(
            wave,
            positions,
            (BLOCK_BYTES / (2 * self.head_dim())).max(1),
            target,
        )
    }

    /// [`RopeTable::write`], computing `rows_per_block` rows at a time.
    fn write_blocks(
        &self,
        wave: Wave,
        positions: usize,
        rows_per_block: usize,
        target: &Path,
    ) -> Result<u64> {
        let hd = self.head_dim();
        let mut partial = Partial::create(target)?;
        let io_err = |path: &Path, e| SideFilesError::Io {
            path: path.to_path_buf(),
            action: "write",
            source: e,
        };
        let header = npy_header(&[positions, hd]);
        partial
            .file
            .write_all(&header)
            .map_err(|e| io_err(&partial.path, e))?;
        let mut total = header.len() as u64;
        let mut buf = Vec::new();
        let mut first = 0;
        while first < positions {
            let rows = rows_per_block.min(positions - first);
            buf.resize(rows * 2 * hd, 0);
            buf.par_chunks_mut(2 * hd)
                .enumerate()
                .for_each(|(i, out)| self.row(wave, first + i, out));
            partial
                .file
                .write_all(&buf)
                .map_err(|e| io_err(&partial.path, e))?;
            total += buf.len() as u64;
            first += rows;
        }
        partial.commit()?;
        Ok(total)
    }
}

/// A `.npy` version 1.0 header for a C-order little-endian fp16 array of
/// `shape`, byte for byte what `numpy.save` writes: the dict, spare spaces
/// for growing the first axis, padding to a multiple of 64 bytes, a newline.
/// (The runtime reads the header length from bytes 8-9.)
fn npy_header(shape: &[usize]) -> Vec<u8> {
    // repr() of a Python tuple: a 1-tuple keeps its trailing comma.
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let tuple = match dims.as_slice() {
        [one] => format!("({one},)"),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!("{{'descr': '<f2', 'fortran_order': False, 'shape': {tuple}, }}");
    // numpy leaves room for the growth axis (the first) to reach 21 digits.
    const GROWTH_AXIS_MAX_DIGITS: usize = 21;
    if let Some(d) = dims.first() {
        dict.push_str(&" ".repeat(GROWTH_AXIS_MAX_DIGITS.saturating_sub(d.len())));
    }
    // magic (6) + version (2) + length (2) + dict + padding + '\n' ≡ 0 mod 64;
    // numpy pads by 1..=64, never 0.
    let hlen = dict.len() + 1;
    let pad = 64 - (10 + hlen) % 64;
    let mut out = Vec::with_capacity(10 + hlen + pad);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&((hlen + pad) as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.extend(std::iter::repeat_n(b' ', pad));
    out.push(b'\n');
    out
}

// ---- model_config.json -------------------------------------------------

/// transformers' `Gemma4TextConfig` defaults, for a config.json without token ids.
const DEFAULT_BOS: u64 = 2;
const DEFAULT_EOS: u64 = 1;

/// `model_config.json`: the keys the runtime's `ModelConfig` reads (with the
/// names and meanings the upstream converter gives them), plus the
/// structural fields it writes beside them, in this order. The scales are
/// the ones transformers' Gemma 4 text model applies: √hidden_size on the
/// token embedding, √P on the per-layer embedding, hidden_size^-½ on the
/// per-layer projection and 2^-½ on the sum of the two per-layer inputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub model_name: String,
    /// Always `gemma4`.
    pub architecture: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub global_head_dim: usize,
    pub vocab_size: usize,
    /// The packages' full-attention context length.
    pub context_length: usize,
    pub sliding_window: usize,
    pub per_layer_dim: usize,
    pub num_layers: usize,
    pub num_kv_shared_layers: usize,
    /// `sliding_attention` / `full_attention` per layer.
    pub layer_types: Vec<String>,
    pub embed_scale: f64,
    pub per_layer_embed_scale: f64,
    pub per_layer_model_projection_scale: f64,
    pub per_layer_input_scale: f64,
    pub rms_norm_eps: f64,
    pub final_logit_softcapping: Option<f64>,
    pub bos_token_id: u64,
    pub eos_token_id: TokenIds,
}

/// `eos_token_id`: chunkforge writes one id; other writers write a list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u64),
    Many(Vec<u64>),
}

impl TokenIds {
    pub fn ids(&self) -> Vec<i64> {
        match self {
            TokenIds::One(id) => vec![*id as i64],
            TokenIds::Many(ids) => ids.iter().map(|id| *id as i64).collect(),
        }
    }
}

/// The architecture `model_config.json` names.
pub const ARCHITECTURE: &str = "gemma4";

impl ModelConfig {
    /// What the runtime should read for the model `cfg` at `context_length`
    /// (`model_name` and the token ids are the caller's).
    pub fn of(
        cfg: &TextConfig,
        context_length: usize,
        model_name: &str,
        bos_token_id: u64,
        eos_token_id: u64,
    ) -> ModelConfig {
        let dims = plan::dims(cfg, context_length);
        ModelConfig {
            model_name: model_name.into(),
            architecture: ARCHITECTURE.into(),
            hidden_size: cfg.hidden_size,
            num_hidden_layers: cfg.num_hidden_layers,
            num_attention_heads: cfg.num_attention_heads,
            num_key_value_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            global_head_dim: cfg.global_head_dim,
            vocab_size: cfg.vocab_size,
            context_length,
            sliding_window: cfg.sliding_window,
            per_layer_dim: cfg.hidden_size_per_layer_input,
            num_layers: cfg.num_hidden_layers,
            num_kv_shared_layers: cfg.num_kv_shared_layers,
            layer_types: cfg
                .layer_types
                .iter()
                .map(|k| format!("{}_attention", k.as_str()))
                .collect(),
            embed_scale: dims.embed_scale,
            per_layer_embed_scale: dims.per_layer_embed_scale,
            per_layer_model_projection_scale: 1.0 / (cfg.hidden_size as f64).sqrt(),
            per_layer_input_scale: 1.0 / 2f64.sqrt(),
            rms_norm_eps: cfg.rms_norm_eps,
            final_logit_softcapping: cfg.final_logit_softcapping,
            bos_token_id,
            eos_token_id: TokenIds::One(eos_token_id),
        }
    }
}

fn model_config(req: &SideFilesRequest) -> Result<ModelConfig> {
    let (bos, eos) = token_ids(req.hf_dir)?;
    Ok(ModelConfig::of(
        req.cfg,
        req.context_length,
        req.model_name,
        bos,
        eos,
    ))
}

/// (bos, eos) token ids: from config.json's text config, else its top
/// level, else generation_config.json, else transformers' defaults. The
/// runtime reads one integer each; where `eos_token_id` is a list (as
/// generation configs have it) the first entry is the model's own end of
/// sequence (the runtime adds Gemma's end-of-turn id itself).
fn token_ids(hf_dir: &Path) -> Result<(u64, u64)> {
    let config_path = hf_dir.join("config.json");
    let root = read_json(&config_path)?.unwrap_or(Value::Null);
    let generation_path = hf_dir.join("generation_config.json");
    let generation = read_json(&generation_path)?;
    let mut places: Vec<(&Path, &str, &Value)> = Vec::new();
    if let Some(text) = root.get("text_config").filter(|t| t.is_object()) {
        places.push((&config_path, "text_config.", text));
    }
    places.push((&config_path, "", &root));
    if let Some(g) = &generation {
        places.push((&generation_path, "", g));
    }
    let find = |key: &str, list_ok: bool| -> Result<Option<u64>> {
        for (path, prefix, obj) in &places {
            let Some(v) = obj.get(key).filter(|v| !v.is_null()) else {
                continue;
            };
            let bad = || SideFilesError::Config {
                path: path.to_path_buf(),
                message: format!(
                    "`{prefix}{key}` is {v}, expected a token id{}",
                    if list_ok { " or a list of them" } else { "" }
                ),
            };
            let id = match v {
                Value::Array(items) if list_ok => match items.first() {
                    None => continue,
                    Some(first) => first.as_u64().ok_or_else(bad)?,
                },
                _ => v.as_u64().ok_or_else(bad)?,
            };
            return Ok(Some(id));
        }
        Ok(None)
    };
    Ok((
        find("bos_token_id", false)?.unwrap_or(DEFAULT_BOS),
        find("eos_token_id", true)?.unwrap_or(DEFAULT_EOS),
    ))
}

/// A JSON file's contents; None when it does not exist.
fn read_json(path: &Path) -> Result<Option<Value>> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(SideFilesError::Io {
                path: path.to_path_buf(),
                action: "read",
                source: e,
            })
        }
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| SideFilesError::Config {
            path: path.to_path_buf(),
            message: format!("not valid JSON: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chunkforge_model::checkpoint::read_header;
    use serde_json::json;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "chunkforge-sidefiles-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        fs::create_dir_all(&d).unwrap();
        d
    }

    /// The quantization rule written plainly (one division per element,
    /// `round_ties_even`), for the fast loop to be checked against.
    fn reference_quantize(x: &[f32]) -> (u16, Vec<i8>) {
        let absmax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = f16::from_f32(absmax.max(1e-8));
        let s = scale.to_f32().max(1e-8);
        let inv = 127.0f32 / s;
        let q = x
            .iter()
            .map(|v| (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8)
            .collect();
        (scale.to_bits(), q)
    }

    fn quantize(x: &[f32]) -> (u16, Vec<i8>) {
        let mut q = vec![0u8; x.len()];
        let scale = quantize_row(x, &mut q).unwrap();
        (scale.to_bits(), q.into_iter().map(|b| b as i8).collect())
    }

    #[test]
    fn quantizer_follows_the_runtime_rule_on_crafted_rows() {
        // A zero row: scale fp16(1e-8) rounds to 0, every q is 0.
        assert_eq!(quantize(&[0.0; 5]), (0, vec![0; 5]));
        assert_eq!(quantize(&[-0.0, 0.0]), (0, vec![0, 0]));
        // The absmax element maps to ±127, the others in proportion.
        assert_eq!(
            quantize(&[1.0, -0.5, 0.25, 0.0]),
            (f16::from_f32(1.0).to_bits(), vec![127, -64, 32, 0])
        );
        // (-0.5·127 = -63.5 is a tie: to even, -64; 0.25·127 = 31.75 rounds to 32.)
        // An exact tie: scale 127 (fp16-exact), x = k + 0.5.
        let row = [127.0, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5];
        assert_eq!(quantize(&row).1, vec![127, 2, 4, -2, -4, 0, 0]);
        // An absmax fp16 rounds down: x·127/scale exceeds 127 and is clamped.
        let m = 1.000_2f32;
        assert_eq!(f16::from_f32(m).to_f32(), 1.0);
        assert_eq!(quantize(&[m, -m]).1, vec![127, -127]);
        // A tiny row whose scale underflows fp16 to 0: q from the 1e-8 floor, as upstream.
        let row = [1e-9f32, -2e-9];
        let (scale, q) = quantize(&row);
        assert_eq!(scale, 0);
        assert_eq!(q, vec![13, -25]);
        assert_eq!((scale, q), reference_quantize(&row));
    }

    #[test]
    fn quantizer_matches_the_plain_rule_on_random_rows() {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for width in [1, 7, 64, 1536] {
            for scale in [1e-3f32, 0.05, 1.0, 300.0] {
                let row: Vec<f32> = (0..width).map(|_| next() * scale).collect();
                assert_eq!(quantize(&row), reference_quantize(&row), "width {width}");
            }
        }
    }

    #[test]
    fn quantizer_refuses_what_the_runtime_cannot_represent() {
        let mut q = [0u8; 3];
        assert_eq!(
            quantize_row(&[1.0, f32::NAN, 2.0], &mut q),
            Err(RowProblem::NotFinite(1))
        );
        assert_eq!(
            quantize_row(&[f32::NEG_INFINITY, 0.0, 0.0], &mut q),
            Err(RowProblem::NotFinite(0))
        );
        assert_eq!(
            quantize_row(&[70_000.0, 0.0, 1.0], &mut q),
            Err(RowProblem::ScaleOverflow(70_000.0))
        );
        let mut row = vec![1.0f32; 200];
        row[130] = 1e6;
        let mut out = vec![0u8; 400];
        assert_eq!(
            fp16_row(&row, &mut out),
            Err(RowProblem::Fp16Overflow(130, 1e6))
        );
        row[130] = f32::NAN;
        assert_eq!(fp16_row(&row, &mut out), Err(RowProblem::NotFinite(130)));
    }

    #[test]
    fn npy_header_is_numpys() {
        // np.save(f, np.zeros((2048, 256), np.float16)): 128 header bytes.
        let h = npy_header(&[2048, 256]);
        let mut want = b"\x93NUMPY\x01\x00v\x00{'descr': '<f2', 'fortran_order': False, 'shape': (2048, 256), }".to_vec();
        want.resize(127, b' ');
        want.push(b'\n');
        assert_eq!(h.len(), 128);
        assert_eq!(h, want);
        for shape in [[1usize, 512], [131_072, 512], [7, 2], [123_456_789, 64]] {
            let h = npy_header(&shape);
            assert_eq!(h.len() % 64, 0, "{shape:?}");
            assert_eq!(*h.last().unwrap(), b'\n');
            let hlen = u16::from_le_bytes([h[8], h[9]]) as usize;
            assert_eq!(10 + hlen, h.len());
            let text = std::str::from_utf8(&h[10..]).unwrap();
            assert!(text.contains(&format!("'shape': ({}, {}), }}", shape[0], shape[1])));
        }
        assert!(std::str::from_utf8(&npy_header(&[5])[10..])
            .unwrap()
            .contains("'shape': (5,), }"));
    }

    /// A safetensors file holding `rows × width` values of `dtype`, plus
    /// the Source reading it.
    fn tensor_file(dir: &Path, dtype: Dtype, rows: usize, width: usize, values: &[f32]) -> Source {
        let (name, bytes): (&str, Vec<u8>) = match dtype {
            Dtype::F32 => ("F32", values.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Dtype::F16 => (
                "F16",
                values
                    .iter()
                    .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                    .collect(),
            ),
            Dtype::Bf16 => (
                "BF16",
                values
                    .iter()
                    .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                    .collect(),
            ),
        };
        // Another tensor first, so the table does not start at the data section's start.
        let pad = vec![0u8; 12];
        let header = json!({
            "pad": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
            "t": {"dtype": name, "shape": [rows, width], "data_offsets": [12, 12 + bytes.len()]},
        });
        let h = serde_json::to_vec(&header).unwrap();
        let mut file = (h.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(&h);
        file.extend_from_slice(&pad);
        file.extend_from_slice(&bytes);
        let path = dir.join(format!("{name}.safetensors"));
        fs::write(&path, file).unwrap();
        let info = read_header(&path).unwrap().remove("t").unwrap();
        Source {
            name: "t".into(),
            info,
            dtype,
            rows,
            width,
            target: "test.bin",
        }
    }

    #[test]
    fn streamed_blocks_equal_row_by_row_whatever_the_block_size() {
        let dir = temp_dir("blocks");
        let (rows, width) = (10, 7);
        let values: Vec<f32> = (0..rows * width)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.0625 * (1 + i / width) as f32)
            .collect();
        // A zero row in the middle.
        let mut values = values;
        values[4 * width..5 * width].fill(0.0);
        for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            let src = tensor_file(&dir, dtype, rows, width, &values);
            // What each row is, as stored (bf16/fp16 rounding included).
            let stored: Vec<Vec<f32>> = (0..rows)
                .map(|r| {
                    let raw = fs::read(&src.info.file).unwrap();
                    let at = src.info.offset as usize + r * src.row_bytes();
                    let mut x = vec![0f32; width];
                    dtype.decode(&raw[at..at + src.row_bytes()], &mut x);
                    x
                })
                .collect();
            let want_q: Vec<u8> = stored
                .iter()
                .flat_map(|x| reference_quantize(x).1.into_iter().map(|q| q as u8))
                .collect();
            let want_scales: Vec<u16> = stored.iter().map(|x| reference_quantize(x).0).collect();
            assert_eq!(want_scales[4], 0);
            let want_fp16: Vec<u8> = stored
                .iter()
                .flatten()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect();
            // 3 and 4 do not divide 10: the last block is short. The
            // buffers carry over from size to size, as from tensor to tensor.
            let mut pool = Buffers::default();
            for block_rows in [1, 3, 4, 10, 64] {
                let out = dir.join("q.bin");
                let (n, scales) =
                    stream_tensor(&src, Convert::Int8PerRow, block_rows, &out, &mut pool).unwrap();
                assert_eq!(n, (rows * width) as u64);
                assert_eq!(
                    fs::read(&out).unwrap(),
                    want_q,
                    "{dtype:?} blocks of {block_rows}"
                );
                let bits: Vec<u16> = scales.iter().map(|s| s.to_bits()).collect();
                assert_eq!(bits, want_scales);
                let out = dir.join("h.bin");
                stream_tensor(&src, Convert::Fp16, block_rows, &out, &mut pool).unwrap();
                assert_eq!(fs::read(&out).unwrap(), want_fp16);
            }
            // No temporary file is left behind.
            let names: Vec<String> = fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            assert!(names.iter().all(|n| !n.contains("partial")), "{names:?}");
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bad_row_or_a_truncated_file_leaves_no_file_under_the_final_name() {
        let dir = temp_dir("bad");
        let mut values = vec![0.5f32; 6 * 4];
        values[5 * 4 + 2] = f32::INFINITY;
        let src = tensor_file(&dir, Dtype::F32, 6, 4, &values);
        let out = dir.join("q.bin");
        let err = stream_tensor(&src, Convert::Int8PerRow, 2, &out, &mut Buffers::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("tensor t: row 5, element 2 is not a finite number"),
            "{err}"
        );
        assert!(err.contains("F32.safetensors"), "{err}");
        assert!(!out.exists() && !dir.join(".q.bin.partial").exists());
        // The file loses its last bytes after the header was read.
        let src = tensor_file(&dir, Dtype::F32, 6, 4, &[0.25; 24]);
        let f = fs::OpenOptions::new()
            .write(true)
            .open(&src.info.file)
            .unwrap();
        f.set_len(src.info.offset + 5 * 16).unwrap();
        let err = stream_tensor(&src, Convert::Int8PerRow, 4, &out, &mut Buffers::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("tensor t: cannot read rows 4..6"), "{err}");
        assert!(!out.exists() && !dir.join(".q.bin.partial").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    fn f16_at(bytes: &[u8], i: usize) -> f32 {
        f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f32()
    }

    #[test]
    fn rope_rows_rotate_the_configured_pairs() {
        // E2B full layers: 512 dims, factor 0.25: 64 of 256 pairs rotate.
        let full = RopeTable::new(512, 1e6, 0.25);
        assert_eq!(full.head_dim(), 512);
        assert!(full.inv_freq[..64].iter().all(|&f| f > 0.0));
        assert!(full.inv_freq[64..].iter().all(|&f| f == 0.0));
        // Exponents over the whole head dim: pair 1 is theta^(-2/512), not theta^(-2/128).
        assert!((f64::from(full.inv_freq[1]) - 1e6f64.powf(-2.0 / 512.0)).abs() < 1e-7);
        let mut row = vec![0u8; 1024];
        full.row(Wave::Cos, 1000, &mut row);
        for i in 64..256 {
            assert_eq!(f16_at(&row, i), 1.0);
            assert_eq!(f16_at(&row, 256 + i), 1.0);
        }
        full.row(Wave::Sin, 1000, &mut row);
        assert!((64..256).all(|i| f16_at(&row, i) == 0.0));
        // The two halves repeat each other.
        assert_eq!(row[..512], row[512..]);
        // Sliding: every pair rotates; pair 0 has frequency 1.
        let sliding = RopeTable::new(256, 1e4, 1.0);
        assert!(sliding.inv_freq.iter().all(|&f| f > 0.0));
        let mut row = vec![0u8; 512];
        sliding.row(Wave::Sin, 3, &mut row);
        assert_eq!(f16_at(&row, 0), f16::from_f64(3f64.sin()).to_f32());
        sliding.row(Wave::Cos, 0, &mut row);
        assert!((0..256).all(|i| f16_at(&row, i) == 1.0));
    }

    #[test]
    fn rope_file_is_header_then_rows_across_blocks() {
        let dir = temp_dir("rope");
        let t = RopeTable::new(8, 1e4, 1.0);
        let out = dir.join("cos.npy");
        // Blocks of 2 rows: the last block is short.
        let n = t.write_blocks(Wave::Cos, 5, 2, &out).unwrap();
        let bytes = fs::read(&out).unwrap();
        assert_eq!(n, bytes.len() as u64);
        let header = npy_header(&[5, 8]);
        assert_eq!(bytes[..header.len()], header[..]);
        let body = &bytes[header.len()..];
        assert_eq!(body.len(), 5 * 8 * 2);
        let mut row = vec![0u8; 16];
        for p in 0..5 {
            t.row(Wave::Cos, p, &mut row);
            assert_eq!(body[p * 16..(p + 1) * 16], row[..], "position {p}");
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn token_ids_come_from_the_config_then_the_generation_config() {
        let dir = temp_dir("ids");
        let write = |name: &str, v: Value| fs::write(dir.join(name), v.to_string()).unwrap();
        write(
            "config.json",
            json!({"text_config": {"bos_token_id": 5}, "eos_token_id": [7, 106]}),
        );
        assert_eq!(token_ids(&dir).unwrap(), (5, 7));
        write("config.json", json!({"model_type": "gemma4_text"}));
        write(
            "generation_config.json",
            json!({"bos_token_id": 2, "eos_token_id": [1, 106]}),
        );
        assert_eq!(token_ids(&dir).unwrap(), (2, 1));
        fs::remove_file(dir.join("generation_config.json")).unwrap();
        assert_eq!(token_ids(&dir).unwrap(), (DEFAULT_BOS, DEFAULT_EOS));
        write("config.json", json!({"eos_token_id": "1"}));
        let err = token_ids(&dir).unwrap_err().to_string();
        assert!(
            err.contains("config.json: `eos_token_id` is \"1\", expected a token id or a list"),
            "{err}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    /// A two-layer config (sliding, full) at tiny widths.
    fn tiny_config(dir: &Path) -> TextConfig {
        let v = json!({
            "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
            "vocab_size": 6, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
            "global_head_dim": 8, "sliding_window": 4, "hidden_size_per_layer_input": 4,
            "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": 30.0
        });
        fs::write(dir.join("config.json"), v.to_string()).unwrap();
        TextConfig::from_json(&v, &dir.join("config.json")).unwrap()
    }

    /// A checkpoint holding `tensors` (name, rows, width) as F32 values
    /// `row + col/100`, in one file.
    fn tiny_checkpoint(dir: &Path, tensors: &[(&str, usize, usize)]) -> Checkpoint {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for &(name, rows, width) in tensors {
            let begin = data.len();
            for r in 0..rows {
                for c in 0..width {
                    data.extend_from_slice(&(r as f32 + c as f32 / 100.0).to_le_bytes());
                }
            }
            let shape = if rows == 1 {
                json!([width])
            } else {
                json!([rows, width])
            };
            header.insert(
                format!("model.{name}"),
                json!({"dtype": "F32", "shape": shape, "data_offsets": [begin, data.len()]}),
            );
        }
        let h = serde_json::to_vec(&Value::Object(header)).unwrap();
        let path = dir.join("model.safetensors");
        let mut file = (h.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(&h);
        file.extend_from_slice(&data);
        fs::write(&path, file).unwrap();
        let tensors = read_header(&path).unwrap();
        Checkpoint {
            dir: dir.to_path_buf(),
            prefix: "model.".into(),
            files: tensors
                .iter()
                .map(|(k, v)| (k.clone(), v.file.clone()))
                .collect(),
            tensors,
            skipped: 0,
            weight_files: vec![path],
        }
    }

    const TABLES: [(&str, usize, usize); 4] = [
        ("embed_tokens.weight", 6, 8),
        ("embed_tokens_per_layer.weight", 6, 8),
        ("per_layer_model_projection.weight", 8, 8),
        ("per_layer_projection_norm.weight", 1, 4),
    ];

    fn request<'a>(
        dir: &'a Path,
        cfg: &'a TextConfig,
        ck: &'a Checkpoint,
        dest: &'a Path,
    ) -> SideFilesRequest<'a> {
        SideFilesRequest {
            hf_dir: dir,
            cfg,
            checkpoint: ck,
            context_length: 16,
            rope_positions: 20,
            model_name: "tiny",
            dest,
            repository: false,
        }
    }

    /// Every side file of the tiny checkpoint, written into `tag`'s folder:
    /// (the folder, its config, the output folder, the report).
    fn write_all(tag: &str) -> (PathBuf, TextConfig, PathBuf, SideFilesReport) {
        let dir = temp_dir(tag);
        let cfg = tiny_config(&dir);
        let ck = tiny_checkpoint(&dir, &TABLES);
        let dest = dir.join("out");
        fs::create_dir(&dest).unwrap();
        let report = write_side_files(&request(&dir, &cfg, &ck, &dest)).unwrap();
        (dir, cfg, dest, report)
    }

    #[test]
    fn writes_every_side_file_of_a_checkpoint() {
        let (dir, _, dest, report) = write_all("all");
        let names: Vec<&str> = report
            .files
            .iter()
            .map(|f| f.path.to_str().unwrap())
            .collect();
        let all: Vec<&str> = SIDE_FILES.iter().map(|s| s.name).collect();
        assert_eq!(names, all, "every side file, in the table's order");
        for f in &report.files {
            assert_eq!(fs::metadata(dest.join(&f.path)).unwrap().len(), f.bytes);
        }
        let size = |name: &str| fs::metadata(dest.join(name)).unwrap().len();
        assert_eq!((size(EMBED_Q8), size(EMBED_SCALES)), (48, 12));
        assert_eq!((size(PER_LAYER_Q8), size(PER_LAYER_SCALES)), (48, 12));
        assert_eq!((size(PER_LAYER_PROJECTION), size(PER_LAYER_NORM)), (128, 8));
        let header = npy_header(&[20, 4]).len() as u64;
        assert_eq!(size(COS_SLIDING), header + 20 * 4 * 2);
        assert_eq!(
            size(SIN_FULL),
            npy_header(&[20, 8]).len() as u64 + 20 * 8 * 2
        );
        assert_eq!(report.bytes_read, 4 * (48 + 48 + 64 + 4));
        // In the app's repository layout the RoPE tables go under swa/, the
        // same bytes.
        let dir2 = temp_dir("all-repository");
        let cfg2 = tiny_config(&dir2);
        let ck2 = tiny_checkpoint(&dir2, &TABLES);
        let repo = dir2.join("out");
        fs::create_dir(&repo).unwrap();
        let report2 = write_side_files(&SideFilesRequest {
            repository: true,
            ..request(&dir2, &cfg2, &ck2, &repo)
        })
        .unwrap();
        for (f, spec) in report2.files.iter().zip(SIDE_FILES) {
            assert_eq!(f.path.to_str().unwrap(), spec.repository_path());
            assert_eq!(
                fs::read(repo.join(&f.path)).unwrap(),
                fs::read(dest.join(spec.name)).unwrap()
            );
        }
        assert!(repo.join("swa").join(COS_SLIDING).is_file() && !repo.join(COS_SLIDING).exists());
        // Row 0 of the token table is 0.00 .. 0.07: scale fp16(0.07), the last element 127.
        let q = fs::read(dest.join(EMBED_Q8)).unwrap();
        let scales = fs::read(dest.join(EMBED_SCALES)).unwrap();
        assert_eq!(
            f16::from_le_bytes([scales[0], scales[1]]),
            f16::from_f32(0.07)
        );
        assert_eq!((q[0], q[7] as i8), (0, 127));
        let mc: Value =
            serde_json::from_slice(&fs::read(dest.join(MODEL_CONFIG)).unwrap()).unwrap();
        assert_eq!(mc["model_name"], "tiny");
        assert_eq!(mc["context_length"], 16);
        assert_eq!(
            mc["layer_types"],
            json!(["sliding_attention", "full_attention"])
        );
        assert_eq!(
            (mc["bos_token_id"].clone(), mc["eos_token_id"].clone()),
            (json!(2), json!(1))
        );
        assert_eq!(mc["embed_scale"], json!(8f64.sqrt()));
        assert_eq!(mc["per_layer_embed_scale"], json!(2.0));
        assert_eq!(
            mc["per_layer_model_projection_scale"],
            json!(1.0 / 8f64.sqrt())
        );
        assert_eq!(mc["num_layers"], 2);
        assert_eq!(mc["per_layer_dim"], 4);
        fs::remove_dir_all(&dir).unwrap();
        fs::remove_dir_all(&dir2).unwrap();
    }

    /// Each row's size rule is what its writer writes (so `run`'s size
    /// check follows from the row), and each row made from a tensor names
    /// one the checkpoint is validated to have.
    #[test]
    fn every_row_expects_the_size_its_writer_writes() {
        let (dir, cfg, _, report) = write_all("expected");
        let decoder = checkpoint::expected_tensors(&cfg);
        for spec in SIDE_FILES {
            let f = report.files.iter().find(|f| f.path == Path::new(spec.name));
            let written = f.map(|f| f.bytes).unwrap();
            match spec.expected(&cfg) {
                Expected::Bytes(n) => assert_eq!(written, n, "{}", spec.name),
                Expected::Npy { head_dim } => {
                    let rows = (written - npy_header(&[20, head_dim]).len() as u64) / 2;
                    assert_eq!(rows, 20 * head_dim as u64, "{}", spec.name);
                }
                Expected::Contents => assert_eq!(spec.name, MODEL_CONFIG),
            }
            match spec.made_from {
                MadeFrom::Tensor { tensor, .. } => {
                    assert!(decoder.iter().any(|(n, _)| n == tensor), "{tensor}")
                }
                MadeFrom::ScalesOf(table) => assert!(
                    SIDE_FILES.iter().any(|t| t.name == table
                        && matches!(
                            t.made_from,
                            MadeFrom::Tensor {
                                convert: Convert::Int8PerRow,
                                ..
                            }
                        )),
                    "{}: {table} is not an INT8 table",
                    spec.name
                ),
                MadeFrom::Rope(..) | MadeFrom::ModelConfig => {}
            }
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_norm_weight_is_optional_and_the_tables_are_not() {
        let dir = temp_dir("optional");
        let cfg = tiny_config(&dir);
        let dest = dir.join("out");
        fs::create_dir(&dest).unwrap();
        let ck = tiny_checkpoint(&dir, &TABLES[..3]);
        let report = write_side_files(&request(&dir, &cfg, &ck, &dest)).unwrap();
        assert!(report
            .files
            .iter()
            .all(|f| f.path != Path::new(PER_LAYER_NORM)));
        assert!(!dest.join(PER_LAYER_NORM).exists());

        let dest = dir.join("out2");
        fs::create_dir(&dest).unwrap();
        let ck = tiny_checkpoint(&dir, &[TABLES[0], TABLES[2], TABLES[3]]);
        let err = write_side_files(&request(&dir, &cfg, &ck, &dest))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.safetensors: tensor model.embed_tokens_per_layer.weight: not in the checkpoint; the runtime's embed_tokens_per_layer_q8.bin is made from it"),
            "{err}"
        );
        // Refused before anything is written.
        assert_eq!(fs::read_dir(&dest).unwrap().count(), 0);

        let ck = tiny_checkpoint(
            &dir,
            &[
                TABLES[0],
                ("embed_tokens_per_layer.weight", 6, 7),
                TABLES[2],
            ],
        );
        let err = write_side_files(&request(&dir, &cfg, &ck, &dest))
            .unwrap_err()
            .to_string();
        assert!(err.contains("tensor model.embed_tokens_per_layer.weight: shape [6, 7], but config.json implies [6, 8]"), "{err}");

        let mut short = request(&dir, &cfg, &ck, &dest);
        short.rope_positions = 15;
        let err = write_side_files(&short).unwrap_err().to_string();
        assert!(
            err.contains("RoPE tables of 15 positions are shorter than the context length 16"),
            "{err}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }
}
