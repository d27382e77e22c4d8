//! `package --encoders-from DIR`: the app's multimodal encoder files,
//! carried from an existing bundle (chunkforge converts no encoders). DIR is
//! an upstream bundle in its repository or local layout (the encoders sit at
//! the root in both) or a chunkforge release that carries them. Only the
//! files the app requests are taken ([`downloader::all_encoder_files`]), and
//! each is checked against its list before anything is written:
//!
//! - every file that every entry requires (the branch's list, which cannot
//!   be turned off) is there, non-empty;
//! - a compiled encoder's `model.mil` is text MIL (the iPhone rejects the
//!   binary kind);
//! - a file only some entry requires (main's `vision_video.mlmodelc`) is
//!   carried when present, and its absence is reported, not refused;
//! - what the app binds and reads ([`check_contents`]): each encoder's
//!   function signature in its `model.mil` (inputs, outputs, shapes, dtypes)
//!   against what `ImageProcessor` / `AudioProcessor` feed and read, and the
//!   side files' formats and sizes (`mel_filterbank.bin`,
//!   `audio_config.json`, the projection `.npy` files) against each other,
//!   the text model's hidden size and, where the checkpoint's `config.json`
//!   has them, its `vision_config` and `audio_config`. The first file that
//!   does not fit is named.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use chunkforge_model::plan::Dtype;

use crate::bundle::{mil_functions, MilFunction};
use crate::downloader::{self, EncoderFile, ENTRIES};
use crate::hashing;
use crate::manifest::ContractTensor;

/// The encoder files of one bundle, ready to copy.
pub struct EncoderSources {
    /// (source file, path in the release), in the app's order.
    pub files: Vec<(PathBuf, String)>,
    /// The folders to create in the release.
    pub dirs: Vec<String>,
    /// Encoders some entry requests that the bundle lacks, with the entries.
    pub absent: Vec<(EncoderFile, Vec<String>)>,
}

/// Whether `local` may 404 in every entry's download.
fn optional_everywhere(local: &str) -> bool {
    ENTRIES.iter().all(|e| e.optional_404(local))
}

/// Reads and checks the encoder files of `dir` against the checkpoint whose
/// `config.json` is `config` (the release's `hf_model/config.json`).
pub fn encoder_sources(dir: &Path, config: &Path) -> Result<EncoderSources> {
    let sources = encoder_files(dir)?;
    check_contents(config, &sources)?;
    Ok(sources)
}

/// Reads the encoder files of `dir` against the app's lists.
fn encoder_files(dir: &Path) -> Result<EncoderSources> {
    if !dir.is_dir() {
        bail!(
            "{}: --encoders-from: not a folder (an upstream bundle or release holding vision.mlmodelc, audio.mlmodelc, …)",
            dir.display()
        );
    }
    let mut out = EncoderSources {
        files: Vec::new(),
        dirs: Vec::new(),
        absent: Vec::new(),
    };
    for enc in downloader::all_encoder_files() {
        let needed_by: Vec<String> = ENTRIES
            .iter()
            .filter(|e| e.multimodal.contains(&enc))
            .map(|e| e.client.to_string())
            .collect();
        let everyone = needed_by.len() == ENTRIES.len();
        let present = hashing::entry_in(dir, enc.path)?.is_some();
        if !present && !everyone {
            out.absent.push((enc, needed_by));
            continue;
        }
        for rel in enc.requests() {
            let src = dir.join(&rel);
            // No symlink anywhere on the way: a linked encoder folder or
            // file would carry a file from outside DIR into the release.
            let meta = match hashing::entry_in(dir, &rel)? {
                Some(m) => m,
                None if optional_everywhere(&rel) => continue,
                None => bail!(
                    "{}: --encoders-from: missing; the app requests it ({} encoder{}) and aborts the download without it",
                    src.display(),
                    enc.role,
                    if everyone {
                        ", on every entry".to_string()
                    } else {
                        format!(", on {}", needed_by.join(", "))
                    }
                ),
            };
            if !meta.is_file() {
                bail!("{}: --encoders-from: not a regular file", src.display());
            }
            if meta.len() == 0 && !optional_everywhere(&rel) {
                bail!("{}: --encoders-from: empty", src.display());
            }
            if rel.ends_with(".mlmodelc/model.mil") {
                let text =
                    fs::read(&src).with_context(|| format!("{}: cannot read", src.display()))?;
                if std::str::from_utf8(&text).is_err() {
                    bail!(
                        "{}: --encoders-from: a binary model.mil (as `xcrun coremlcompiler` writes); the iPhone rejects it: recompile with coremltools' get_compiled_model_path()",
                        src.display()
                    );
                }
            }
            if let Some((parent, _)) = rel.rsplit_once('/') {
                if !out.dirs.iter().any(|d| d == parent) {
                    out.dirs.push(parent.to_string());
                }
            }
            out.files.push((src, rel));
        }
    }
    Ok(out)
}

/// The app's side of the encoders (ImageProcessor.swift, AudioProcessor.swift
/// and CoreMLLLM.swift at main 72178c6; upstream converts them with
/// `conversion/models/gemma4_vision.py` and `conversion/convert_audio.py`).
mod app {
    /// `ImageProcessor.process` (the still-image encoder, `vision.mlmodelc`):
    /// 2520 patch rows, padded with position ids -1.
    pub const STILL_PATCHES: usize = 2520;
    /// `ImageProcessor.processVideoFrame` (`vision_video.mlmodelc`): 630.
    pub const VIDEO_PATCHES: usize = 630;
    /// Its patch side in pixels (`ps = 16`), where the checkpoint's
    /// `vision_config.patch_size` does not say.
    pub const PATCH_SIZE: usize = 16;
    /// `AudioProcessor`: 512-point FFT (257 bins) into 128 mel bins; the
    /// filter bank is read as 257 x 128 float32.
    pub const FFT_BINS: usize = 257;
    pub const MEL_BINS: usize = 128;
    /// `audio_config.json` defaults (`mel_frames`, `num_tokens`).
    pub const MEL_FRAMES: u64 = 200;
    pub const AUDIO_TOKENS: u64 = 50;
    /// An audio output this wide is used as it is; any other width goes
    /// through the Swift-side projection (`AudioProcessor.process`).
    pub const PROJECTED: usize = 1536;
}

/// What the encoders are checked against.
struct Facts {
    /// The text model's hidden size: every feature row the app injects.
    hidden: usize,
    /// `vision_config.patch_size` (or the app's 16): a patch row is 3 x p x p.
    patch_size: usize,
    /// `vision_config.pooling_kernel_size`, if the checkpoint has one.
    pooling: Option<usize>,
    /// `audio_config.hidden_size` and `output_proj_dims`, if it has them.
    audio_hidden: Option<usize>,
    audio_out: Option<usize>,
}

impl Facts {
    fn of(config: &Path) -> Result<Self> {
        let text =
            fs::read(config).with_context(|| format!("{}: cannot read", config.display()))?;
        let v: Value = serde_json::from_slice(&text)
            .with_context(|| format!("{}: not JSON", config.display()))?;
        let cfg = chunkforge_model::config::TextConfig::from_json(&v, config)?;
        let num = |section: &str, key: &str| {
            v.get(section)
                .and_then(|s| s.get(key))
                .and_then(Value::as_u64)
                .map(|n| n as usize)
        };
        Ok(Facts {
            hidden: cfg.hidden_size,
            patch_size: num("vision_config", "patch_size").unwrap_or(app::PATCH_SIZE),
            pooling: num("vision_config", "pooling_kernel_size"),
            audio_hidden: num("audio_config", "hidden_size"),
            audio_out: num("audio_config", "output_proj_dims"),
        })
    }
}

/// A tensor shape as `[1, 2520, 768]`.
fn shape(s: &[usize]) -> String {
    format!("{s:?}")
}

/// The default function of an encoder's program (`main`, or its only one).
fn signature(path: &Path) -> Result<MilFunction> {
    let text = fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!(
            "{}: --encoders-from: cannot read as text: {e}",
            path.display()
        )
    })?;
    let funcs = mil_functions(&text).map_err(|e| {
        anyhow::anyhow!(
            "{}: --encoders-from: cannot read the model's function signature ({e}); the app binds its inputs by name",
            path.display()
        )
    })?;
    let n = funcs.len();
    funcs
        .into_iter()
        .find(|f| f.name == "main" || n == 1)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{}: --encoders-from: no `main` function among {n}",
                path.display()
            )
        })
}

/// `f`'s inputs are exactly `want` (name, dtype, shape): the app binds these
/// and no others.
fn inputs_are(
    path: &Path,
    f: &MilFunction,
    want: &[(&str, Dtype, Vec<usize>)],
    who: &str,
) -> Result<()> {
    let fail = |m: String| -> Result<()> { bail!("{}: --encoders-from: {m}", path.display()) };
    for (name, dtype, dims) in want {
        match f.inputs.iter().find(|t| t.name == *name) {
            None => fail(format!(
                "declares no input `{name}`; {who} feeds {name} {dtype} {}",
                shape(dims)
            ))?,
            Some(t) if t.dtype != *dtype || t.shape != *dims => fail(format!(
                "input `{name}` is {} {}; {who} feeds {dtype} {}",
                t.dtype,
                shape(&t.shape),
                shape(dims)
            ))?,
            Some(_) => {}
        }
    }
    if let Some(t) = f
        .inputs
        .iter()
        .find(|t| !want.iter().any(|(n, _, _)| *n == t.name))
    {
        fail(format!(
            "declares input `{}`, which {who} does not feed (it feeds {}): the prediction fails",
            t.name,
            want.iter().map(|w| w.0).collect::<Vec<_>>().join(", ")
        ))?;
    }
    Ok(())
}

/// The output `name` of `f`, fp16 (the app reads its rows as UInt16) and
/// `[1, rows, width]`.
fn output<'a>(
    path: &Path,
    f: &'a MilFunction,
    name: &str,
    who: &str,
) -> Result<&'a ContractTensor> {
    let t = f.outputs.iter().find(|t| t.name == name).ok_or_else(|| {
        anyhow::anyhow!(
            "{}: --encoders-from: returns no `{name}` (it returns {}); {who} reads {name}",
            path.display(),
            f.outputs
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    if t.dtype != Dtype::Fp16 || t.shape.len() != 3 || t.shape[0] != 1 {
        bail!(
            "{}: --encoders-from: output `{name}` is {} {}; {who} reads it as fp16 [1, rows, width]",
            path.display(),
            t.dtype,
            shape(&t.shape)
        );
    }
    Ok(t)
}

/// A `.npy` file the app reads as raw fp16 after a version 1.0 header:
/// its shape.
fn npy_fp16(path: &Path) -> Result<Vec<usize>> {
    let bytes = fs::read(path).with_context(|| format!("{}: cannot read", path.display()))?;
    let bad = |m: &str| anyhow::anyhow!("{}: --encoders-from: {m}", path.display());
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" || bytes[6] != 1 {
        return Err(bad(
            "not a .npy file of format version 1.0 (the app takes the data to start at 10 + the header length in bytes 8-9)",
        ));
    }
    let len = 10 + usize::from(u16::from_le_bytes([bytes[8], bytes[9]]));
    let header = bytes
        .get(10..len)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or_else(|| bad("its .npy header is cut short"))?;
    let field = |key: &str| -> Option<&str> {
        let at = header.find(&format!("'{key}':"))? + key.len() + 3;
        Some(header[at..].trim_start())
    };
    if !field("descr").is_some_and(|v| v.starts_with("'<f2'"))
        || !field("fortran_order").is_some_and(|v| v.starts_with("False"))
    {
        return Err(bad(&format!(
            "not a C-order little-endian fp16 array (header {}); the app reads the data as fp16",
            header.trim()
        )));
    }
    let dims = field("shape")
        .and_then(|v| {
            let inner = v.strip_prefix('(')?.split(')').next()?;
            inner
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| s.parse::<usize>().ok())
                .collect::<Option<Vec<usize>>>()
        })
        .ok_or_else(|| bad(&format!("no shape in its header {}", header.trim())))?;
    let want = len + 2 * dims.iter().product::<usize>();
    if bytes.len() != want {
        return Err(bad(&format!(
            "{} bytes, its header's shape {} needs {want} (the app counts the values from the file size)",
            bytes.len(),
            shape(&dims)
        )));
    }
    Ok(dims)
}

/// Checks what the app binds and reads of the encoders `sources` carries
/// (ImageProcessor.swift, AudioProcessor.swift, CoreMLLLM.swift at 72178c6)
/// against the checkpoint's `config.json`; names the first file that does
/// not fit.
fn check_contents(config: &Path, sources: &EncoderSources) -> Result<()> {
    let facts = Facts::of(config)?;
    let carried: BTreeMap<&str, &Path> = sources
        .files
        .iter()
        .map(|(src, rel)| (rel.as_str(), src.as_path()))
        .collect();
    let file = |rel: &str| carried.get(rel).copied();
    let patch = 3 * facts.patch_size * facts.patch_size;
    let hidden = facts.hidden;
    for (model, patches, who) in [
        (
            "vision.mlmodelc",
            app::STILL_PATCHES,
            "ImageProcessor.process",
        ),
        (
            "vision_video.mlmodelc",
            app::VIDEO_PATCHES,
            "ImageProcessor.processVideoFrame",
        ),
    ] {
        let Some(mil) = file(&format!("{model}/model.mil")) else {
            continue;
        };
        let f = signature(mil)?;
        inputs_are(
            mil,
            &f,
            &[
                ("pixel_values", Dtype::Fp32, vec![1, patches, patch]),
                ("pixel_position_ids", Dtype::Int32, vec![1, patches, 2]),
            ],
            who,
        )?;
        let t = output(mil, &f, "image_features", who)?;
        if t.shape[2] != hidden {
            bail!(
                "{}: --encoders-from: image_features rows are {} wide; the app injects them as the text model's embeddings, {hidden} wide (hf_model/config.json's hidden_size)",
                mil.display(),
                t.shape[2]
            );
        }
        if let Some(k) = facts.pooling {
            let want = patches / (k * k);
            if t.shape[1] != want {
                bail!(
                    "{}: --encoders-from: image_features has {} rows; {patches} patches pooled {k} x {k} (config.json's vision_config) give {want}",
                    mil.display(),
                    t.shape[1]
                );
            }
        }
    }
    // audio_config.json: what the app reads of it, with its defaults.
    let mut mel_frames = app::MEL_FRAMES;
    let mut audio_tokens = app::AUDIO_TOKENS;
    if let Some(conf) = file("audio_config.json") {
        let v: Value = serde_json::from_slice(&fs::read(conf)?).map_err(|e| {
            anyhow::anyhow!("{}: --encoders-from: not JSON ({e}); the app reads mel_frames and num_tokens from it", conf.display())
        })?;
        let Some(obj) = v.as_object() else {
            bail!("{}: --encoders-from: not a JSON object", conf.display());
        };
        for (key, slot) in [
            ("mel_frames", &mut mel_frames),
            ("num_tokens", &mut audio_tokens),
        ] {
            match obj.get(key) {
                None => {}
                Some(n) => match n.as_u64().filter(|n| *n > 0) {
                    Some(n) => *slot = n,
                    None => bail!(
                        "{}: --encoders-from: {key} is {n}; the app reads it as a positive integer (`as? Int`), else silently uses its default",
                        conf.display()
                    ),
                },
            }
        }
        for key in ["log_offset", "mel_floor"] {
            if obj.get(key).is_some_and(|n| !n.is_number()) {
                bail!("{}: --encoders-from: {key} is not a number", conf.display());
            }
        }
    }
    if let Some(bank) = file("mel_filterbank.bin") {
        let bytes = fs::read(bank)?;
        let want = 4 * app::FFT_BINS * app::MEL_BINS;
        if bytes.len() != want {
            bail!(
                "{}: --encoders-from: {} bytes; the app reads a {} x {} float32 filter bank ({want} bytes), zeros past a short file",
                bank.display(),
                bytes.len(),
                app::FFT_BINS,
                app::MEL_BINS
            );
        }
        let values = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        // Triangular filters peaking at 1 (the feature extractor's
        // `mel_filter_bank`, no normalisation): every weight in [0, 1].
        if values.clone().any(|x| !(0.0..=1.0).contains(&x)) || values.clone().all(|x| x == 0.0) {
            bail!(
                "{}: --encoders-from: not a mel filter bank: its float32 weights must lie in [0, 1] and not all be zero",
                bank.display()
            );
        }
    }
    // The Swift-side projection (output_proj, then embed_proj): its widths.
    let npy = |name: &str| file(name).map(|p| npy_fp16(p).map(|s| (p, s))).transpose();
    let weight = npy("output_proj_weight.npy")?;
    let bias = npy("output_proj_bias.npy")?;
    let embed = npy("embed_proj_weight.npy")?;
    let mut projection: Option<usize> = None;
    if let (Some((wp, w)), Some((bp, b)), Some((ep, e))) = (&weight, &bias, &embed) {
        let fail =
            |p: &Path, m: String| -> Result<()> { bail!("{}: --encoders-from: {m}", p.display()) };
        if b.len() != 1 {
            fail(
                bp,
                format!(
                    "shape {}; the app takes it as the output_proj bias, one value per output",
                    shape(b)
                ),
            )?;
        }
        let out = b[0];
        if w.len() != 2 || w[0] != out {
            fail(wp, format!("shape {}; output_proj's weight must be ({out}, input width), as many rows as output_proj_bias.npy has values", shape(w)))?;
        }
        if e.len() != 2 || e[1] != out || e[0] != hidden {
            fail(ep, format!("shape {}; embed_proj's weight must be ({hidden}, {out}): to the text model's hidden size from output_proj's width", shape(e)))?;
        }
        if let Some(n) = facts.audio_out.filter(|n| *n != out) {
            fail(
                bp,
                format!("{out} values; config.json's audio_config.output_proj_dims is {n}"),
            )?;
        }
        if let Some(n) = facts.audio_hidden.filter(|n| *n != w[1]) {
            fail(
                wp,
                format!(
                    "input width {}; config.json's audio_config.hidden_size is {n}",
                    w[1]
                ),
            )?;
        }
        projection = Some(w[1]);
    }
    if let Some(mil) = file("audio.mlmodelc/model.mil") {
        let who = "AudioProcessor.process";
        let f = signature(mil)?;
        inputs_are(
            mil,
            &f,
            &[(
                "input_features",
                Dtype::Fp16,
                vec![1, mel_frames as usize, app::MEL_BINS],
            )],
            who,
        )?;
        // The app reads audio_features, else hidden_states, else the first output.
        let name = ["audio_features", "hidden_states"]
            .into_iter()
            .find(|n| f.outputs.iter().any(|t| t.name == *n))
            .or(f.outputs.first().map(|t| t.name.as_str()))
            .unwrap_or("audio_features");
        let t = output(mil, &f, name, who)?;
        if t.shape[1] as u64 != audio_tokens {
            bail!(
                "{}: --encoders-from: {name} has {} rows; audio_config.json's num_tokens (default {}) is {audio_tokens}",
                mil.display(),
                t.shape[1],
                app::AUDIO_TOKENS
            );
        }
        let width = t.shape[2];
        if width == app::PROJECTED {
            if hidden != width {
                bail!(
                    "{}: --encoders-from: {name} is {width} wide, which the app uses as it is, as embeddings of the text model's {hidden} (hf_model/config.json's hidden_size)",
                    mil.display()
                );
            }
        } else {
            match projection {
                None => bail!(
                    "{}: --encoders-from: {name} is {width} wide, not {}: the app projects it in Swift with output_proj_weight.npy, output_proj_bias.npy and embed_proj_weight.npy, which the folder lacks",
                    mil.display(),
                    app::PROJECTED
                ),
                Some(n) if n != width => bail!(
                    "{}: --encoders-from: {name} is {width} wide; output_proj_weight.npy projects {n}-wide rows",
                    mil.display()
                ),
                Some(_) => {}
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, rel: &str, bytes: &[u8]) {
        let p = dir.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, bytes).unwrap();
    }

    /// A .npy 1.0 file of fp16 zeros.
    fn npy(dims: &[usize]) -> Vec<u8> {
        let t: Vec<String> = dims.iter().map(usize::to_string).collect();
        let tuple = if t.len() == 1 {
            format!("({},)", t[0])
        } else {
            format!("({})", t.join(", "))
        };
        let mut dict = format!("{{'descr': '<f2', 'fortran_order': False, 'shape': {tuple}, }}");
        while (10 + dict.len() + 1) % 64 != 0 {
            dict.push(' ');
        }
        dict.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((dict.len() as u16).to_le_bytes());
        out.extend(dict.as_bytes());
        out.resize(out.len() + 2 * dims.iter().product::<usize>(), 0);
        out
    }

    fn mil(inputs: &str, out: &str) -> String {
        format!("program(1.3)\n{{\n    func main<ios18>({inputs}) {{\n            {out} = const()[name = string(\"x\")];\n    }} -> ({});\n}}\n", out.rsplit(' ').next().unwrap())
    }

    /// The app's encoder files for a text model `hidden` wide, as upstream
    /// converts them (the legacy audio model: Swift-side projection).
    fn bundle(dir: &Path, hidden: usize) {
        for (m, n) in [("vision.mlmodelc", 2520), ("vision_video.mlmodelc", 630)] {
            write(dir, &format!("{m}/model.mil"), mil(
                &format!("tensor<fp32, [1, {n}, 768]> pixel_values, tensor<int32, [1, {n}, 2]> pixel_position_ids"),
                &format!("tensor<fp16, [1, {}, {hidden}]> image_features", n / 9),
            ).as_bytes());
        }
        write(
            dir,
            "audio.mlmodelc/model.mil",
            mil(
                "tensor<fp16, [1, 200, 128]> input_features",
                "tensor<fp16, [1, 50, 1024]> hidden_states",
            )
            .as_bytes(),
        );
        for m in ["vision.mlmodelc", "vision_video.mlmodelc", "audio.mlmodelc"] {
            for f in [
                "weights/weight.bin",
                "coremldata.bin",
                "analytics/coremldata.bin",
            ] {
                write(dir, &format!("{m}/{f}"), b"\x01\x02");
            }
        }
        let bank: Vec<u8> = (0..257 * 128)
            .flat_map(|i| ((i % 7) as f32 * 0.01).to_le_bytes())
            .collect();
        write(dir, "mel_filterbank.bin", &bank);
        write(
            dir,
            "audio_config.json",
            br#"{"mel_frames": 200, "num_tokens": 50, "log_offset": 0.001}"#,
        );
        write(dir, "output_proj_weight.npy", &npy(&[1536, 1024]));
        write(dir, "output_proj_bias.npy", &npy(&[1536]));
        write(dir, "embed_proj_weight.npy", &npy(&[hidden, 1536]));
    }

    fn config(dir: &Path, extra: &str) -> PathBuf {
        let p = dir.join(format!("config-{}.json", extra.len()));
        let types: Vec<String> = (0..35)
            .map(|i| {
                if i % 5 == 4 {
                    "\"full_attention\""
                } else {
                    "\"sliding_attention\""
                }
                .to_string()
            })
            .collect();
        fs::write(&p, format!(
            r#"{{"model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 35, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "global_head_dim": 64, "sliding_window": 512, "hidden_size_per_layer_input": 32, "num_kv_shared_layers": 20, "use_double_wide_mlp": true, "final_logit_softcapping": 30.0, "layer_types": [{}]{extra}}}"#,
            types.join(", ")
        )).unwrap();
        p
    }

    #[track_caller]
    fn refused(dir: &Path, cfg: &Path) -> String {
        encoder_sources(dir, cfg)
            .err()
            .expect("refused")
            .to_string()
    }

    #[test]
    fn encoders_are_checked_against_the_apps_list_and_what_it_feeds() {
        let dir = std::env::temp_dir().join(format!("cf-encoders-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let enc = dir.join("bundle");
        bundle(&enc, 64);
        let cfg = config(&dir, "");
        let s = encoder_sources(&enc, &cfg).unwrap();
        // 3 models x 4 files (metadata.json is 404-optional) + 5 plain files.
        assert_eq!(s.files.len(), 3 * 4 + 5);
        assert!(s.absent.is_empty());
        assert!(s.dirs.contains(&"audio.mlmodelc/analytics".to_string()));
        let fix = |rel: &str, bytes: Vec<u8>| write(&enc, rel, &bytes);
        // A stand-in: a text model.mil without a function.
        fix("vision.mlmodelc/model.mil", b"program(1.3)\n{}\n".to_vec());
        let e = refused(&enc, &cfg);
        assert!(e.contains("vision.mlmodelc/model.mil: --encoders-from: cannot read the model's function signature"), "{e}");
        bundle(&enc, 64);
        // What the app feeds: fp32 pixel values, 2520 rows of 768.
        fix("vision.mlmodelc/model.mil", mil(
            "tensor<fp16, [1, 2520, 768]> pixel_values, tensor<int32, [1, 2520, 2]> pixel_position_ids",
            "tensor<fp16, [1, 280, 64]> image_features",
        ).into_bytes());
        let e = refused(&enc, &cfg);
        assert!(
            e.contains(
                "input `pixel_values` is fp16 [1, 2520, 768]; ImageProcessor.process feeds fp32"
            ),
            "{e}"
        );
        // What it reads: rows as wide as the text model's hidden size.
        bundle(&enc, 32);
        let e = refused(&enc, &cfg);
        assert!(
            e.contains("vision.mlmodelc/model.mil") && e.contains("32 wide"),
            "{e}"
        );
        bundle(&enc, 64);
        // The filter bank's size and values.
        fix("mel_filterbank.bin", vec![0x7f; 4 * 257 * 128]);
        let e = refused(&enc, &cfg);
        assert!(
            e.contains("mel_filterbank.bin: --encoders-from: not a mel filter bank"),
            "{e}"
        );
        fix("mel_filterbank.bin", vec![0; 100]);
        assert!(refused(&enc, &cfg).contains("100 bytes"));
        bundle(&enc, 64);
        // audio_config.json and the audio model agree on the frames.
        fix("audio_config.json", br#"{"mel_frames": 300}"#.to_vec());
        let e = refused(&enc, &cfg);
        assert!(
            e.contains("audio.mlmodelc/model.mil") && e.contains("feeds fp16 [1, 300, 128]"),
            "{e}"
        );
        bundle(&enc, 64);
        // The projection, against the checkpoint's audio_config where it has one.
        let e = refused(
            &enc,
            &config(
                &dir,
                r#", "audio_config": {"hidden_size": 1024, "output_proj_dims": 2048}"#,
            ),
        );
        assert!(
            e.contains("output_proj_bias.npy") && e.contains("output_proj_dims is 2048"),
            "{e}"
        );
        fix("embed_proj_weight.npy", npy(&[1536, 1536]));
        let e = refused(&enc, &cfg);
        assert!(
            e.contains("embed_proj_weight.npy") && e.contains("(64, 1536)"),
            "{e}"
        );
        bundle(&enc, 64);
        // A binary model.mil, a missing required file: refused, named.
        fix("audio.mlmodelc/model.mil", vec![0xff, 0xfe, 0x00]);
        let e = refused(&enc, &cfg);
        assert!(
            e.contains("audio.mlmodelc/model.mil") && e.contains("binary"),
            "{e}"
        );
        bundle(&enc, 64);
        fs::remove_file(enc.join("mel_filterbank.bin")).unwrap();
        let e = refused(&enc, &cfg);
        assert!(
            e.contains("mel_filterbank.bin: --encoders-from: missing"),
            "{e}"
        );
        // vision_video (main only) may be absent: reported, not refused.
        bundle(&enc, 64);
        fs::remove_dir_all(enc.join("vision_video.mlmodelc")).unwrap();
        let s = encoder_sources(&enc, &cfg).unwrap();
        assert_eq!(s.absent.len(), 1);
        assert_eq!(s.absent[0].0.path, "vision_video.mlmodelc");
        fs::remove_dir_all(&dir).unwrap();
    }
}
