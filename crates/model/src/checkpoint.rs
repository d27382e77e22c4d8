//! Finds and validates a Hugging Face Gemma 4 checkpoint without loading it:
//! safetensors headers are parsed here, every tensor the plan needs is checked
//! for presence, dtype, shape and byte range, and Python then reads tensors
//! lazily, one at a time.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::TextConfig;
use crate::error::InputError;

/// Largest safetensors header we accept (the format's own reference limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// One tensor of a safetensors file: where its bytes are and what they hold.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub file: PathBuf,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Byte position of the tensor's first byte in `file` (header included),
    /// for readers that fetch rows with positioned reads.
    pub offset: u64,
    /// Length of the tensor's data in bytes.
    pub bytes: u64,
}

/// A validated checkpoint: where each needed tensor lives.
#[derive(Clone, Debug, Serialize)]
pub struct Checkpoint {
    pub dir: PathBuf,
    /// `model.` or `model.language_model.`.
    pub prefix: String,
    /// Full tensor name -> file, for the tensors the decoder needs (others skipped).
    pub files: BTreeMap<String, PathBuf>,
    /// The same tensors with their dtype, shape and byte range.
    #[serde(skip)]
    pub tensors: BTreeMap<String, TensorInfo>,
    /// Tensors present but not part of the text decoder (vision, audio, ...).
    pub skipped: usize,
    pub weight_files: Vec<PathBuf>,
}

fn ck(path: &Path, message: impl Into<String>) -> InputError {
    InputError::Checkpoint {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The float dtypes the decoder's weights may have, and their sizes.
fn dtype_size(dtype: &str) -> Option<u64> {
    match dtype {
        "F32" => Some(4),
        "F16" | "BF16" => Some(2),
        _ => None,
    }
}

/// Bytes per element of every fixed-width safetensors dtype, to check any
/// tensor's byte range (vision and audio tensors too); None for the sub-byte
/// and future ones, whose ranges are then only checked for layout.
fn element_size(dtype: &str) -> Option<u64> {
    match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => Some(1),
        "U16" | "I16" | "F16" | "BF16" => Some(2),
        "U32" | "I32" | "F32" => Some(4),
        "U64" | "I64" | "F64" => Some(8),
        _ => None,
    }
}

/// Parses one safetensors header and checks every entry's byte range against
/// the file, and that the tensors tile its data section.
pub fn read_header(path: &Path) -> Result<BTreeMap<String, TensorInfo>, InputError> {
    let (tensors, layout) = parse_header(path)?;
    layout?;
    Ok(tensors)
}

/// [`read_header`] with the layout verdict returned apart, for a caller with a
/// better explanation to give first: a removed header entry leaves a gap, and
/// "tensor X is missing" says more than "bytes a..b belong to no tensor".
type Parsed = (BTreeMap<String, TensorInfo>, Result<(), InputError>);

fn parse_header(path: &Path) -> Result<Parsed, InputError> {
    let mut f = File::open(path).map_err(|e| InputError::Io {
        path: path.into(),
        action: "open the weights",
        source: e,
    })?;
    let size = f
        .metadata()
        .map_err(|e| InputError::Io {
            path: path.into(),
            action: "stat the weights",
            source: e,
        })?
        .len();
    if size < 8 {
        return Err(ck(
            path,
            format!("file is {size} bytes, too short for a safetensors header (truncated?)"),
        ));
    }
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| InputError::Io {
        path: path.into(),
        action: "read the safetensors header",
        source: e,
    })?;
    let hlen = u64::from_le_bytes(len);
    if hlen > MAX_HEADER {
        return Err(ck(
            path,
            format!("safetensors header claims {hlen} bytes, more than the format's limit of {MAX_HEADER} (100 MiB); not a safetensors file?"),
        ));
    }
    if 8 + hlen > size {
        return Err(ck(
            path,
            format!("safetensors header claims {hlen} bytes but the file has {size} (truncated or not safetensors)"),
        ));
    }
    let mut buf = vec![0u8; hlen as usize];
    f.read_exact(&mut buf).map_err(|e| InputError::Io {
        path: path.into(),
        action: "read the safetensors header",
        source: e,
    })?;
    let header: Members<Entry> = serde_json::from_slice(&buf).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => ck(path, "safetensors header is not a JSON object"),
        _ => ck(path, format!("safetensors header is not valid JSON: {e}")),
    })?;
    if let Some(name) = &header.repeated {
        return Err(ck(
            path,
            format!("{} appears twice in the safetensors header (readers disagree on which copy counts)", entry_label(name)),
        ));
    }
    let data_len = size - 8 - hlen;
    let mut out = BTreeMap::new();
    // (begin, end, name) of every tensor's bytes, for the layout check below.
    let mut spans: Vec<(u64, u64, &str)> = Vec::new();
    for (name, entry) in &header.list {
        if name == "__metadata__" {
            check_metadata(path, entry)?;
            continue;
        }
        let fields = match entry {
            Entry::Object(fields) => fields,
            Entry::Other(kind) => {
                return Err(ck(
                    path,
                    format!("tensor {name}: header entry is {kind}, expected an object with dtype, shape and data_offsets"),
                ))
            }
        };
        if let Some(field) = &fields.repeated {
            return Err(ck(
                path,
                format!("tensor {name}: field `{field}` appears twice in its header entry"),
            ));
        }
        let field = |key: &str| fields.list.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        let dtype = field("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                ck(
                    path,
                    format!("tensor {name}: header entry has no dtype string"),
                )
            })?
            .to_string();
        let shape: Vec<usize> = field("shape")
            .ok_or_else(|| ck(path, format!("tensor {name}: header entry has no shape")))?
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_u64().and_then(|x| usize::try_from(x).ok()))
                    .collect()
            })
            .ok_or_else(|| {
                ck(
                    path,
                    format!(
                        "tensor {name}: shape {} is not a list of non-negative integers",
                        field("shape").map_or(Value::Null, Value::clone)
                    ),
                )
            })?;
        let offs: Vec<u64> = field("data_offsets")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        if offs.len() != 2 || offs[0] > offs[1] {
            return Err(ck(
                path,
                format!("tensor {name}: data_offsets {offs:?} are not [begin, end]"),
            ));
        }
        if offs[1] > data_len {
            return Err(ck(
                path,
                format!(
                    "tensor {name}: data ends at byte {} of the data section, which is only {data_len} bytes (truncated file?)",
                    offs[1]
                ),
            ));
        }
        if let Some(es) = element_size(&dtype) {
            let elems = shape
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
            let want = elems.and_then(|e| e.checked_mul(es));
            if want != Some(offs[1] - offs[0]) {
                return Err(ck(
                    path,
                    format!(
                        "tensor {name}: shape {shape:?} of {dtype} needs {} bytes but data_offsets span {}",
                        want.map_or("overflowing".to_string(), |w| w.to_string()),
                        offs[1] - offs[0]
                    ),
                ));
            }
        }
        spans.push((offs[0], offs[1], name));
        out.insert(
            name.clone(),
            TensorInfo {
                file: path.to_path_buf(),
                dtype,
                shape,
                offset: 8 + hlen + offs[0],
                bytes: offs[1] - offs[0],
            },
        );
    }
    let layout = check_layout(path, &mut spans, data_len);
    Ok((out, layout))
}

fn entry_label(name: &str) -> String {
    if name == "__metadata__" {
        name.to_string()
    } else {
        format!("tensor {name}")
    }
}

/// `__metadata__` is free-form text: an object whose values are all strings.
fn check_metadata(path: &Path, entry: &Entry) -> Result<(), InputError> {
    let bad = |what: String| {
        ck(
            path,
            format!("__metadata__ must be an object mapping strings to strings, but {what}"),
        )
    };
    let fields = match entry {
        Entry::Object(fields) => fields,
        Entry::Other(kind) => return Err(bad(format!("it is {kind}"))),
    };
    if let Some(key) = &fields.repeated {
        return Err(bad(format!("`{key}` appears twice")));
    }
    match fields.list.iter().find(|(_, v)| !v.is_string()) {
        Some((key, v)) => Err(bad(format!("`{key}` is {}", json_kind(v)))),
        None => Ok(()),
    }
}

/// The tensors' bytes must tile the data section exactly, as the safetensors
/// format requires: no two tensors share a byte (one write would change both),
/// and no byte belongs to none (hidden data the signature covers but no reader sees).
fn check_layout(
    path: &Path,
    spans: &mut [(u64, u64, &str)],
    data_len: u64,
) -> Result<(), InputError> {
    spans.sort_unstable();
    let mut end = 0u64;
    let mut last: Option<&str> = None;
    for &(b, e, name) in spans.iter() {
        if b < end {
            return Err(ck(
                path,
                format!(
                    "tensors {} and {name} overlap: {} ends at byte {end} of the data section, {name} begins at byte {b}; each tensor needs its own bytes",
                    last.unwrap_or("?"),
                    last.unwrap_or("?")
                ),
            ));
        }
        if b > end {
            return Err(ck(
                path,
                format!(
                    "bytes {end}..{b} of the data section belong to no tensor (gap before tensor {name}); the tensors must cover the data section without gaps"
                ),
            ));
        }
        end = e;
        last = Some(name);
    }
    if end != data_len {
        return Err(ck(
            path,
            format!(
                "bytes {end}..{data_len} of the data section (after {}) belong to no tensor; the tensors must cover the data section without gaps",
                last.map_or("the header".to_string(), |n| format!("tensor {n}"))
            ),
        ));
    }
    Ok(())
}

/// What kind of JSON value `v` is, for a message ("a string", "null").
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// One JSON object's members in file order, plus the first name given twice.
/// serde_json's own maps keep only the last of a repeated name, so a forged
/// header could show chunkforge one tensor and another reader a different one.
struct Members<T> {
    list: Vec<(String, T)>,
    repeated: Option<String>,
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Members<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Members<T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<T>, A::Error> {
                let mut seen = HashSet::new();
                let mut m = Members {
                    list: Vec::new(),
                    repeated: None,
                };
                while let Some(k) = map.next_key::<String>()? {
                    let v = map.next_value()?;
                    if !seen.insert(k.clone()) {
                        m.repeated.get_or_insert(k);
                        continue;
                    }
                    m.list.push((k, v));
                }
                Ok(m)
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// A header entry: an object's members, or what kind of JSON value it is instead.
enum Entry {
    Object(Members<Value>),
    Other(&'static str),
}

impl<'de> Deserialize<'de> for Entry {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entry;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Entry, A::Error> {
                let m = Members::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(Entry::Object(m))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Entry, A::Error> {
                while seq.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(Entry::Other("an array"))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Entry, E> {
                Ok(Entry::Other("a boolean"))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Entry, E> {
                Ok(Entry::Other("a number"))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Entry, E> {
                Ok(Entry::Other("a number"))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Entry, E> {
                Ok(Entry::Other("a number"))
            }
            fn visit_str<E>(self, _: &str) -> Result<Entry, E> {
                Ok(Entry::Other("a string"))
            }
            fn visit_unit<E>(self) -> Result<Entry, E> {
                Ok(Entry::Other("null"))
            }
        }
        d.deserialize_any(V)
    }
}

/// Why the symlink `p` leads to no file, if it is one that does not: it
/// dangles (naming its target) or it loops (naming the chain, which the OS
/// reports only as "too many levels of symbolic links" and `exists()` as
/// missing). None for a symlink that reaches a file, or a plain name.
pub fn broken_link(p: &Path) -> Option<String> {
    if !p.is_symlink() || p.exists() {
        return None;
    }
    let start = std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    let mut seen = vec![start.clone()];
    // Each link's target, as written.
    let mut chain: Vec<String> = Vec::new();
    let mut at = start;
    while let Ok(target) = std::fs::read_link(&at) {
        chain.push(target.display().to_string());
        let next = at.parent().unwrap_or(Path::new("/")).join(&target);
        if seen.contains(&next) {
            let name = p
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned());
            return Some(format!(
                "is a symlink loop ({name} -> {}): it never reaches a file",
                chain.join(" -> ")
            ));
        }
        // The OS gives up after 40 links on Linux (32 on macOS).
        if seen.len() > 40 {
            return Some(format!(
                "is a chain of more than 40 symlinks ({} -> ...): the system follows no more",
                chain[0]
            ));
        }
        seen.push(next.clone());
        at = next;
    }
    Some(format!(
        "is a symlink to {}, which does not exist",
        chain.join(" -> ")
    ))
}

/// Why the checkpoint file `path` (in the checkpoint folder `dir`), a
/// symlink, is not one chunkforge follows, if it is not: a link must end at
/// a regular file inside `dir`, or, for a Hugging Face cache snapshot
/// (`models--ORG--NAME/snapshots/REV/`, whose every file links into the
/// model's `blobs/`), inside that model's `blobs/` folder. A link anywhere
/// else (a key, a file of another user) would be read into a build and
/// copied into a signed release. None for a plain file or a missing one.
pub fn link_outside(dir: &Path, path: &Path) -> Option<String> {
    if !path.is_symlink() {
        return None;
    }
    let target = path.canonicalize().ok()?;
    if !target.is_file() {
        return Some(format!(
            "is a symlink to {}, which is not a regular file",
            target.display()
        ));
    }
    let home = dir.canonicalize().ok()?;
    let blobs = home
        .parent()
        .filter(|p| p.file_name().is_some_and(|n| n == "snapshots"))
        .and_then(Path::parent)
        .map(|model| model.join("blobs"));
    if target.starts_with(&home) || blobs.as_ref().is_some_and(|b| target.starts_with(b)) {
        return None;
    }
    Some(format!(
        "is a symlink to {}, outside the checkpoint folder{}: chunkforge follows a link only into the folder (or a Hugging Face cache snapshot's blobs/); copy the file in",
        target.display(),
        if blobs.is_some() { " and its cache's blobs/" } else { "" }
    ))
}

/// Every tensor the text decoder needs (without prefix), with its expected shape.
pub fn expected_tensors(cfg: &TextConfig) -> Vec<(String, Vec<usize>)> {
    let h = cfg.hidden_size;
    let n = cfg.num_hidden_layers;
    let p = cfg.hidden_size_per_layer_input;
    let mut t = vec![
        ("embed_tokens.weight".to_string(), vec![cfg.vocab_size, h]),
        (
            "embed_tokens_per_layer.weight".into(),
            vec![cfg.vocab_size_per_layer_input, n * p],
        ),
        ("per_layer_model_projection.weight".into(), vec![n * p, h]),
        ("per_layer_projection_norm.weight".into(), vec![p]),
        ("norm.weight".into(), vec![h]),
    ];
    for i in 0..n {
        let kind = cfg.layer_types[i];
        let hd = cfg.head_dim_of(kind);
        let kvh = cfg.kv_heads_of(kind);
        let w = cfg.mlp_width(i);
        let l = |s: &str| format!("layers.{i}.{s}");
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_per_layer_input_norm",
        ] {
            t.push((l(&format!("{norm}.weight")), vec![h]));
        }
        t.push((l("layer_scalar"), vec![1]));
        t.push((l("mlp.gate_proj.weight"), vec![w, h]));
        t.push((l("mlp.up_proj.weight"), vec![w, h]));
        t.push((l("mlp.down_proj.weight"), vec![h, w]));
        t.push((l("per_layer_input_gate.weight"), vec![p, h]));
        t.push((l("per_layer_projection.weight"), vec![h, p]));
        t.push((
            l("self_attn.q_proj.weight"),
            vec![cfg.num_attention_heads * hd, h],
        ));
        t.push((l("self_attn.q_norm.weight"), vec![hd]));
        t.push((
            l("self_attn.o_proj.weight"),
            vec![h, cfg.num_attention_heads * hd],
        ));
        if cfg.owns_kv(i) {
            t.push((l("self_attn.k_proj.weight"), vec![kvh * hd, h]));
            t.push((l("self_attn.v_proj.weight"), vec![kvh * hd, h]));
            t.push((l("self_attn.k_norm.weight"), vec![hd]));
        }
    }
    t
}

/// Checks that every projection weight's output-channel count is a multiple of
/// the palettization group size, before any conversion work starts.
pub fn check_groupable(
    ckpt: &Checkpoint,
    cfg: &TextConfig,
    group: usize,
) -> Result<(), InputError> {
    for (name, shape) in expected_tensors(cfg) {
        // The per-layer embedding table is looked up on CPU, not a projection.
        if shape.len() != 2 || name == "embed_tokens_per_layer.weight" {
            continue;
        }
        if shape[0] % group != 0 {
            let role = if name == "embed_tokens.weight" {
                " (the tied LM head)"
            } else {
                ""
            };
            return Err(ck(
                &ckpt.dir,
                format!(
                    "weight {}{name}{role} has {} output channels, not a multiple of the INT4 palettization group \
                     size {group}; it cannot be palettized per_grouped_channel (use --no-quantize to keep FP16 weights)",
                    ckpt.prefix, shape[0]
                ),
            ));
        }
    }
    Ok(())
}

/// What `--hf-dir` / GEMMA4_HF_DIR take, for the messages below.
const CHECKPOINT_FOLDER: &str =
    "--hf-dir / GEMMA4_HF_DIR take the folder that holds config.json and the *.safetensors files";

/// Checks a folder named as a checkpoint before anything reads it: it exists,
/// is a folder and holds `config.json`. An empty folder, a file, or a Hugging
/// Face cache root is told what a checkpoint folder is; for a cache root (or
/// one model's cache folder) the error lists the snapshot folders inside,
/// which are the checkpoint folders.
pub fn check_folder(dir: &Path) -> Result<(), InputError> {
    if !dir.exists() {
        return Err(ck(
            dir,
            "checkpoint folder does not exist (--hf-dir / GEMMA4_HF_DIR)",
        ));
    }
    if !dir.is_dir() {
        return Err(ck(
            dir,
            format!("is a file, not a checkpoint folder: {CHECKPOINT_FOLDER}"),
        ));
    }
    // Present in any form: a dangling symlink is for the config reader to name.
    let config = dir.join("config.json");
    if std::fs::symlink_metadata(&config).is_ok() {
        if let Some(why) = link_outside(dir, &config) {
            return Err(ck(&config, why));
        }
        return Ok(());
    }
    let snapshots = hf_cache_snapshots(dir);
    let hint = if snapshots.is_empty() {
        String::new()
    } else {
        let with_config: Vec<String> = snapshots
            .iter()
            .filter(|s| s.join("config.json").is_file())
            .map(|s| s.display().to_string())
            .collect();
        if with_config.is_empty() {
            format!(
                "; this is a Hugging Face cache, but none of its {} snapshot folders holds a config.json (was the download interrupted?)",
                snapshots.len()
            )
        } else {
            format!(
                "; this is a Hugging Face cache: pass one of its snapshot folders, {}",
                with_config.join(", ")
            )
        }
    };
    Err(ck(
        dir,
        format!("no config.json here: is this a checkpoint folder? {CHECKPOINT_FOLDER}{hint}"),
    ))
}

/// The snapshot folders of a Hugging Face cache given at any of its levels:
/// `~/.cache/huggingface`, its `hub/`, one `models--ORG--NAME/` or its
/// `snapshots/` (each snapshot is a checkpoint folder of symlinks into
/// `blobs/`). Sorted; empty when `dir` is none of these.
fn hf_cache_snapshots(dir: &Path) -> Vec<PathBuf> {
    let subdirs = |d: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(d)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect()
    };
    let is_model = |p: &Path| {
        p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("models--"))
    };
    let mut models: Vec<PathBuf> = Vec::new();
    if dir.file_name().is_some_and(|n| n == "snapshots") {
        let mut found = subdirs(dir);
        found.sort();
        return found;
    }
    if dir.join("snapshots").is_dir() {
        models.push(dir.to_path_buf());
    }
    for root in [dir.to_path_buf(), dir.join("hub")] {
        models.extend(subdirs(&root).into_iter().filter(|p| is_model(p)));
    }
    let mut found: Vec<PathBuf> = models
        .iter()
        .flat_map(|m| subdirs(&m.join("snapshots")))
        .collect();
    found.sort();
    found
}

impl Checkpoint {
    /// Finds the weight files of `dir`, reads their headers and checks every
    /// tensor the decoder needs.
    pub fn open(dir: &Path, cfg: &TextConfig) -> Result<Self, InputError> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        for p in [&index, &single] {
            // Hugging Face cache snapshots are symlinks into blobs/: follow them,
            // but name a dangling one or a loop instead of calling the file missing.
            if let Some(why) = broken_link(p).or_else(|| link_outside(dir, p)) {
                return Err(ck(p, why));
            }
        }
        let weight_files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read(&index).map_err(|e| InputError::Io {
                path: index.clone(),
                action: "read the shard index",
                source: e,
            })?;
            let v: Value = serde_json::from_slice(&text)
                .map_err(|e| ck(&index, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| ck(&index, "has no `weight_map` object"))?;
            let mut files: Vec<PathBuf> = Vec::new();
            for f in map.values().filter_map(Value::as_str) {
                if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                    return Err(ck(
                        &index,
                        format!("shard name `{f}` is not a plain file name"),
                    ));
                }
                let p = dir.join(f);
                if !files.contains(&p) {
                    files.push(p);
                }
            }
            files.sort();
            files
        } else if single.exists() {
            vec![single]
        } else {
            return Err(ck(
                dir,
                "no model.safetensors or model.safetensors.index.json (is this a Hugging Face checkpoint directory?)",
            ));
        };
        let mut all = BTreeMap::new();
        let mut layouts = Vec::new();
        for f in &weight_files {
            if let Some(why) = broken_link(f) {
                return Err(ck(
                    f,
                    format!("shard listed in model.safetensors.index.json {why}"),
                ));
            }
            if let Some(why) = link_outside(dir, f) {
                return Err(ck(f, why));
            }
            if !f.exists() {
                return Err(ck(
                    f,
                    "shard listed in model.safetensors.index.json does not exist",
                ));
            }
            let (tensors, layout) = parse_header(f)?;
            layouts.push(layout);
            for (name, info) in tensors {
                if let Some(prev) = all.insert(name.clone(), info) {
                    return Err(ck(
                        f,
                        format!("tensor {name} also appears in {}", prev.file.display()),
                    ));
                }
            }
        }
        let prefix = ["model.language_model.", "model.", ""]
            .into_iter()
            .find(|p| all.contains_key(&format!("{p}embed_tokens.weight")))
            .ok_or_else(|| {
                ck(
                    &weight_files[0],
                    "no embed_tokens.weight under `model.` or `model.language_model.` (not a Gemma 4 text checkpoint?)",
                )
            })?
            .to_string();
        let mut files = BTreeMap::new();
        let mut tensors = BTreeMap::new();
        // Where a missing tensor was looked for, for its error.
        let searched = match weight_files.as_slice() {
            [one] => one
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
            many => format!("the {} shards of model.safetensors.index.json", many.len()),
        };
        for (name, shape) in expected_tensors(cfg) {
            let full = format!("{prefix}{name}");
            let info = all.get(&full).ok_or_else(|| {
                ck(
                    dir,
                    format!(
                        "tensor {full} is missing from {searched} (config.json says the decoder has it)"
                    ),
                )
            })?;
            if dtype_size(&info.dtype).is_none() {
                return Err(ck(
                    &info.file,
                    format!(
                        "tensor {full} has dtype {}, expected F32, F16 or BF16",
                        info.dtype
                    ),
                ));
            }
            if info.shape != shape {
                return Err(ck(
                    &info.file,
                    format!(
                        "tensor {full} has shape {:?}, config.json implies {shape:?}",
                        info.shape
                    ),
                ));
            }
            files.insert(full.clone(), info.file.clone());
            tensors.insert(full, info.clone());
        }
        layouts.into_iter().collect::<Result<(), _>>()?;
        let needed = files.len();
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            prefix,
            skipped: all.len().saturating_sub(needed),
            files,
            tensors,
            weight_files,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A loop is named as one with its chain (the OS says "too many levels
    /// of symbolic links", `exists()` says missing); a dangling chain names
    /// where it ends; a good link or a plain file is not broken.
    #[test]
    fn broken_links_say_whether_they_dangle_or_loop() {
        let d = std::env::temp_dir().join(format!("cf-links-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        symlink("b", d.join("a")).unwrap();
        symlink("a", d.join("b")).unwrap();
        symlink("self", d.join("self")).unwrap();
        symlink("c", d.join("to-c")).unwrap();
        symlink("/nonexistent/blob", d.join("c")).unwrap();
        std::fs::write(d.join("file"), b"x").unwrap();
        symlink("file", d.join("good")).unwrap();
        let why = |n: &str| broken_link(&d.join(n));
        assert_eq!(
            why("a").unwrap(),
            "is a symlink loop (a -> b -> a): it never reaches a file"
        );
        assert_eq!(
            why("self").unwrap(),
            "is a symlink loop (self -> self): it never reaches a file"
        );
        assert_eq!(
            why("to-c").unwrap(),
            "is a symlink to c -> /nonexistent/blob, which does not exist"
        );
        assert_eq!(why("good"), None);
        assert_eq!(why("file"), None);
        assert_eq!(why("missing"), None);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
