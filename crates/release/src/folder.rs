//! A release folder read the way the app reads it, for `chunkforge run`:
//! `model_config.json`, the side files (each one's size, header and manifest
//! digest checked, so a missing, truncated or altered file fails here naming
//! it, where the app would silently compute garbage), the decode layout picked
//! by file presence with the runtime's rules, and the plan of
//! `hf_model/config.json` at the folder's context length, checked against
//! every package contract `manifest.json` states.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::Value;

use chunkforge_model::config::TextConfig;
use chunkforge_model::plan::{self, FunctionKind, Functions, Layout, LayoutKind, Mode, SlotCopy};

use crate::hashing;
use crate::manifest::{self, MANIFEST_FILE};
use crate::package::{HF_MODEL_DIR, TOKENIZER_FILE};
use crate::runtime_layout;
use crate::sidefiles::{self, SIDE_FILES};
use crate::strict_json;

chunkforge_model::named! {
    /// `run --layout`: which decode layout to run.
    pub enum RunLayout {
        /// By file presence, as the runtime picks: chunk2_3way + chunk3_3way, else
        /// merged_full, else merged_chunk1 + merged_chunk2, else chunk1..4.
        Auto = "auto",
        Four = "four",
        Three = "three",
        Two = "two",
        One = "one",
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct FolderError {
    pub path: PathBuf,
    pub message: String,
}

type Result<T, E = FolderError> = std::result::Result<T, E>;

fn err(path: &Path, message: impl Into<String>) -> FolderError {
    FolderError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// A release folder, opened.
pub struct ReleaseFolder {
    pub dir: PathBuf,
    pub manifest: Value,
    /// `hf_model/config.json`.
    pub cfg: TextConfig,
    /// `model_config.json`'s `context_length`.
    pub context_length: usize,
    /// `model_config.json`'s `eos_token_id` (a number or a list).
    pub eos_token_ids: Vec<i64>,
    /// The scales the runtime reads from `model_config.json` (checked
    /// against the plan of `hf_model/config.json`).
    pub embed_scale: f64,
    pub per_layer_embed_scale: f64,
    /// Manifest `files`: path -> (size, sha256).
    files: BTreeMap<String, (u64, String)>,
}

/// The layouts `run` needs, planned from `hf_model/config.json`.
pub struct RunPlan {
    pub decode: Layout,
    pub four: Layout,
    pub prefill: Layout,
    /// How `decode` was chosen, for the user.
    pub picked_by: &'static str,
}

fn read_json(path: &Path) -> Result<Value> {
    let bytes = fs::read(path).map_err(|e| {
        err(
            path,
            if e.kind() == std::io::ErrorKind::NotFound {
                "missing".to_string()
            } else {
                format!("cannot read: {e}")
            },
        )
    })?;
    strict_json::from_slice(&bytes).map_err(|e| err(path, format!("not valid JSON: {e}")))
}

impl ReleaseFolder {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(err(dir, "not a release folder"));
        }
        let manifest = read_json(&dir.join(MANIFEST_FILE))?;
        let config_path = dir.join(sidefiles::MODEL_CONFIG);
        let config = read_json(&config_path)?;
        let context_length = config
            .get("context_length")
            .and_then(Value::as_u64)
            .ok_or_else(|| err(&config_path, "no context_length (a positive integer)"))?
            as usize;
        let eos_token_ids = match config.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_i64().into_iter().collect(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_i64).collect(),
            _ => Vec::new(),
        };
        let hf = dir.join(HF_MODEL_DIR);
        let cfg = TextConfig::load(&hf).map_err(|e| err(&hf, e.to_string()))?;
        check_model_config(&config, &config_path, &cfg, context_length)?;
        let number = |key: &str| config.get(key).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let mut files = BTreeMap::new();
        for f in manifest
            .get("files")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let (Some(p), Some(size), Some(sha)) = (
                f.get("path").and_then(Value::as_str),
                f.get("size").and_then(Value::as_u64),
                f.get("sha256").and_then(Value::as_str),
            ) {
                files.insert(p.to_string(), (size, sha.to_string()));
            }
        }
        Ok(ReleaseFolder {
            dir: dir.to_path_buf(),
            manifest,
            cfg,
            context_length,
            eos_token_ids,
            embed_scale: number("embed_scale"),
            per_layer_embed_scale: number("per_layer_embed_scale"),
            files,
        })
    }

    /// Checks every side file the runtime reads (size, `.npy` header, the
    /// manifest's size and digest) and the tokenizer when the manifest lists
    /// it; returns the first problem, naming the file.
    pub fn check_files(&self) -> Result<()> {
        let c = &self.cfg;
        let per_layer = c.num_hidden_layers * c.hidden_size_per_layer_input;
        for spec in SIDE_FILES {
            let path = self.dir.join(spec.name);
            let listed = self.files.contains_key(spec.name);
            if !path.exists() {
                if spec.required || listed {
                    return Err(err(
                        &path,
                        format!(
                            "missing ({}; the app would {})",
                            if listed {
                                "manifest.json lists it"
                            } else {
                                "the runtime requires it"
                            },
                            if spec.required {
                                "fail to load the model"
                            } else {
                                "silently compute wrong results without it"
                            }
                        ),
                    ));
                }
                continue;
            }
            let size = fs::metadata(&path)
                .map_err(|e| err(&path, format!("cannot read: {e}")))?
                .len();
            let expected = match spec.name {
                sidefiles::EMBED_Q8 => Some((c.vocab_size * c.hidden_size) as u64),
                sidefiles::EMBED_SCALES => Some(c.vocab_size as u64 * 2),
                sidefiles::PER_LAYER_Q8 => Some((c.vocab_size_per_layer_input * per_layer) as u64),
                sidefiles::PER_LAYER_SCALES => Some(c.vocab_size_per_layer_input as u64 * 2),
                sidefiles::PER_LAYER_PROJECTION => Some((per_layer * c.hidden_size * 2) as u64),
                sidefiles::PER_LAYER_NORM => Some(c.hidden_size_per_layer_input as u64 * 2),
                sidefiles::COS_SLIDING | sidefiles::SIN_SLIDING => {
                    Some(self.check_npy(&path, c.head_dim, size)?)
                }
                sidefiles::COS_FULL | sidefiles::SIN_FULL => {
                    Some(self.check_npy(&path, c.global_head_dim, size)?)
                }
                _ => None,
            };
            if let Some(want) = expected {
                if size != want {
                    return Err(err(
                        &path,
                        format!(
                            "{size} bytes, hf_model/config.json's dimensions need {want} (truncated or from another model)"
                        ),
                    ));
                }
            }
            self.check_digest(spec.name, &path, size)?;
        }
        // Every dimension of the plan comes from hf_model/config.json.
        let config = format!("{HF_MODEL_DIR}/config.json");
        let path = self.dir.join(&config);
        let size = fs::metadata(&path)
            .map_err(|e| err(&path, format!("cannot read: {e}")))?
            .len();
        self.check_digest(&config, &path, size)?;
        let want = self
            .manifest
            .pointer("/model/config_sha256")
            .and_then(Value::as_str);
        let got = hashing::sha256_file(&path).map_err(|e| err(&path, e.to_string()))?;
        if want.is_some_and(|w| w != got) {
            return Err(err(
                &path,
                "not the config the packages were built from (manifest.json's model.config_sha256)",
            ));
        }
        let tokenizer = format!("{HF_MODEL_DIR}/{TOKENIZER_FILE}");
        let path = self.dir.join(&tokenizer);
        if self.files.contains_key(&tokenizer) {
            if !path.is_file() {
                return Err(err(
                    &path,
                    "missing (manifest.json lists it; the app cannot tokenize without it)",
                ));
            }
            let size = fs::metadata(&path)
                .map_err(|e| err(&path, format!("cannot read: {e}")))?
                .len();
            self.check_digest(&tokenizer, &path, size)?;
        }
        Ok(())
    }

    /// Whether the manifest lists the tokenizer (a release made with
    /// `--no-tokenizer` does not).
    pub fn tokenizer(&self) -> Option<PathBuf> {
        let rel = format!("{HF_MODEL_DIR}/{TOKENIZER_FILE}");
        self.files.contains_key(&rel).then(|| self.dir.join(rel))
    }

    fn check_digest(&self, rel: &str, path: &Path, size: u64) -> Result<()> {
        let Some((want_size, want_sha)) = self.files.get(rel) else {
            return Ok(());
        };
        if size != *want_size {
            return Err(err(
                path,
                format!("{size} bytes, manifest.json says {want_size} (truncated or replaced)"),
            ));
        }
        let got = hashing::sha256_file(path).map_err(|e| err(path, e.to_string()))?;
        if &got != want_sha {
            return Err(err(
                path,
                format!("sha256 {got}, manifest.json says {want_sha} (the file changed after packaging)"),
            ));
        }
        Ok(())
    }

    /// A RoPE table's `.npy` header: little-endian fp16, C order, shape
    /// (positions >= context length, head_dim); returns the file size it implies.
    fn check_npy(&self, path: &Path, head_dim: usize, size: u64) -> Result<u64> {
        let mut head = vec![0u8; 4096.min(size as usize)];
        fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut head))
            .map_err(|e| err(path, format!("cannot read: {e}")))?;
        let (header_len, text) = npy_header(&head).ok_or_else(|| {
            err(
                path,
                "not a .npy file of format version 1.0 (what the runtime reads)",
            )
        })?;
        let field = |key: &str| -> Option<&str> {
            let at = text.find(&format!("'{key}':"))? + key.len() + 3;
            Some(text[at..].trim_start())
        };
        let descr_ok = field("descr").is_some_and(|v| v.starts_with("'<f2'"));
        let order_ok = field("fortran_order").is_some_and(|v| v.starts_with("False"));
        let shape = field("shape").and_then(|v| {
            let inner = v.strip_prefix('(')?.split(')').next()?;
            inner
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| s.parse::<usize>().ok())
                .collect::<Option<Vec<usize>>>()
        });
        match shape {
            Some(s) if descr_ok && order_ok && s.len() == 2 && s[1] == head_dim => {
                if s[0] < self.context_length {
                    return Err(err(
                        path,
                        format!(
                            "{} positions, fewer than the context length {} (the runtime would feed rows of zeros past them)",
                            s[0], self.context_length
                        ),
                    ));
                }
                Ok(header_len as u64 + (s[0] * s[1] * 2) as u64)
            }
            _ => Err(err(
                path,
                format!(
                    "not an fp16 (positions, {head_dim}) table: header {}",
                    text.trim()
                ),
            )),
        }
    }

    fn has_package(&self, name: &str) -> bool {
        self.dir.join(format!("{name}.mlpackage")).is_dir()
    }

    /// The manifest's chunk entry of package `name`.
    fn manifest_chunk(&self, name: &str) -> Option<&Value> {
        self.manifest
            .get("chunks")?
            .as_array()?
            .iter()
            .find(|c| c.get("name").and_then(Value::as_str) == Some(name))
    }

    /// The token counts of `name`'s functions of `kind` in the manifest.
    fn function_tokens(&self, name: &str, kind: FunctionKind) -> Vec<usize> {
        self.manifest_chunk(name)
            .and_then(|c| c.get("functions"))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|f| f.get("kind") == Some(&serde_json::json!(kind)))
            .filter_map(|f| f.get("tokens").and_then(Value::as_u64))
            .map(|t| t as usize)
            .collect()
    }

    /// The decode layout to run, the four-chunk layout and the prefill
    /// layout, planned from `hf_model/config.json` at the context length and
    /// checked against the manifest's contracts.
    pub fn plan(&self, want: RunLayout) -> Result<RunPlan> {
        let manifest = self.dir.join(MANIFEST_FILE);
        let (kind, picked_by) = match want {
            RunLayout::Auto => {
                // ChunkedEngine's presence rules; the three-chunk decode also
                // needs four's chunk1, checked with the layout below.
                let kind = runtime_layout::pick(|n| self.has_package(n));
                (kind, "picked by file presence, as the runtime does")
            }
            RunLayout::Four => (LayoutKind::Four, "--layout"),
            RunLayout::Three => (LayoutKind::Three, "--layout"),
            RunLayout::Two => (LayoutKind::Two, "--layout"),
            RunLayout::One => (LayoutKind::One, "--layout"),
        };
        let functions = Functions {
            verify_k: self
                .function_tokens("chunk4", FunctionKind::Verify)
                .first()
                .copied(),
            prefill_lens: self.function_tokens("prefill_chunk1", FunctionKind::Prefill),
        };
        if functions.prefill_lens.is_empty() {
            return Err(err(
                &manifest,
                "no prefill_chunk1..4 with prefill functions: the runtime requires them",
            ));
        }
        let planned = plan::plan(&self.cfg, self.context_length, Mode::All, None, &functions)
            .map_err(|e| err(&manifest, e.to_string()))?;
        let layout = |k: LayoutKind| -> Result<Layout> {
            let l = planned
                .layouts
                .iter()
                .find(|l| l.kind == k)
                .cloned()
                .expect("--mode all plans every layout");
            for c in &l.chunks {
                let pkg = self.dir.join(format!("{}.mlpackage", c.name));
                if !pkg.is_dir() {
                    return Err(err(&pkg, format!("missing: the {k} layout needs it")));
                }
                self.check_chunk(&manifest, c)?;
            }
            Ok(l)
        };
        let four = layout(LayoutKind::Four)?;
        let prefill = layout(LayoutKind::Prefill)?;
        let decode = if kind == LayoutKind::Three {
            self.three(&manifest, &planned, &four)?
        } else {
            let mut decode = layout(kind)?;
            if kind != LayoutKind::Four {
                decode.kv_slot_map = self.slot_map(&manifest, kind)?;
            }
            decode
        };
        Ok(RunPlan {
            decode,
            four,
            prefill,
            picked_by,
        })
    }

    /// The three-chunk decode as the runtime runs it (ChunkedEngine:
    /// `chunk1` + `chunk2_3way` + `chunk3_3way`): four's chunk1, whose
    /// decode contract is the first three-chunk package's, then the other
    /// two; the slot map's copies into the first package go to chunk1.
    fn three(&self, manifest: &Path, planned: &plan::Plan, four: &Layout) -> Result<Layout> {
        let mut three = planned
            .layouts
            .iter()
            .find(|l| l.kind == LayoutKind::Three)
            .cloned()
            .expect("--mode all plans every layout");
        let first = std::mem::replace(&mut three.chunks[0], four.chunks[0].clone());
        if (
            first.first_layer,
            first.last_layer,
            &first.inputs,
            &first.outputs,
        ) != (
            four.chunks[0].first_layer,
            four.chunks[0].last_layer,
            &four.chunks[0].inputs,
            &four.chunks[0].outputs,
        ) {
            return Err(err(
                manifest,
                format!(
                    "{} and {} differ in layers or contract: the runtime's three-chunk decode runs {} first",
                    first.name, four.chunks[0].name, four.chunks[0].name
                ),
            ));
        }
        for c in &three.chunks[1..] {
            let pkg = self.dir.join(format!("{}.mlpackage", c.name));
            if !pkg.is_dir() {
                return Err(err(&pkg, "missing: the three layout needs it"));
            }
            self.check_chunk(manifest, c)?;
        }
        three.kv_slot_map = self.slot_map(manifest, LayoutKind::Three)?;
        for m in &mut three.kv_slot_map {
            if m.to_chunk == first.name {
                m.to_chunk.clone_from(&four.chunks[0].name);
            }
        }
        Ok(three)
    }

    /// The manifest's KV slot map of decode layout `kind`.
    fn slot_map(&self, manifest: &Path, kind: LayoutKind) -> Result<Vec<SlotCopy>> {
        let entry = self
            .manifest
            .get("decode_layouts")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .find(|l| l.get("kind").and_then(Value::as_str) == Some(kind.as_str()))
            .ok_or_else(|| err(manifest, format!("decode_layouts has no {kind} layout")))?;
        serde_json::from_value(entry.get("kv_slot_map").cloned().unwrap_or(Value::Null))
            .map_err(|e| err(manifest, format!("{kind}'s kv_slot_map: {e}")))
    }

    /// The plan's chunk against the manifest's entry for it: layer range,
    /// inputs, outputs and every function's contract.
    fn check_chunk(&self, manifest: &Path, c: &plan::ChunkPlan) -> Result<()> {
        let m = self.manifest_chunk(&c.name).ok_or_else(|| {
            err(
                manifest,
                format!("no entry for {}.mlpackage, which is in the folder", c.name),
            )
        })?;
        // The contract as the manifest states it, written by the same function.
        let contract = |specs: &[plan::TensorSpec]| Value::from(manifest::contract(specs));
        let mut want = vec![
            ("first_layer".to_string(), serde_json::json!(c.first_layer)),
            ("last_layer".to_string(), serde_json::json!(c.last_layer)),
            ("inputs".to_string(), contract(&c.inputs)),
            ("outputs".to_string(), contract(&c.outputs)),
        ];
        let got_functions = m.get("functions").and_then(Value::as_array);
        for f in &c.functions {
            let got = got_functions
                .and_then(|fs| {
                    fs.iter()
                        .find(|g| g.get("name").and_then(Value::as_str) == Some(f.name.as_str()))
                })
                .cloned()
                .unwrap_or(Value::Null);
            for (key, value) in [
                ("kind", serde_json::json!(f.kind)),
                ("tokens", serde_json::json!(f.tokens)),
                ("inputs", contract(&f.inputs)),
                ("outputs", contract(&f.outputs)),
            ] {
                if got.get(key) != Some(&value) {
                    return Err(err(
                        manifest,
                        format!(
                            "{}'s function {} ({key}) is not what hf_model/config.json plans at context length {}",
                            c.name, f.name, self.context_length
                        ),
                    ));
                }
            }
        }
        for (key, value) in want.drain(..) {
            if m.get(&key) != Some(&value) {
                return Err(err(
                    manifest,
                    format!(
                        "{}'s {key} is not what hf_model/config.json plans at context length {}",
                        c.name, self.context_length
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// `model_config.json` against the plan of `hf_model/config.json`: every key
/// the runtime reads must be there and agree (the app takes its dimensions
/// and scales from this file, the packages were built from the other).
fn check_model_config(
    config: &Value,
    path: &Path,
    cfg: &TextConfig,
    context_length: usize,
) -> Result<()> {
    let d = plan::dims(cfg, context_length);
    let types: Vec<String> = cfg
        .layer_types
        .iter()
        .map(|a| format!("{a}_attention"))
        .collect();
    let exact = [
        ("architecture", serde_json::json!("gemma4")),
        ("hidden_size", serde_json::json!(cfg.hidden_size)),
        ("vocab_size", serde_json::json!(cfg.vocab_size)),
        (
            "num_hidden_layers",
            serde_json::json!(cfg.num_hidden_layers),
        ),
        ("num_layers", serde_json::json!(cfg.num_hidden_layers)),
        (
            "per_layer_dim",
            serde_json::json!(cfg.hidden_size_per_layer_input),
        ),
        ("sliding_window", serde_json::json!(cfg.sliding_window)),
        (
            "num_kv_shared_layers",
            serde_json::json!(cfg.num_kv_shared_layers),
        ),
        ("layer_types", serde_json::json!(types)),
    ];
    for (key, want) in exact {
        match config.get(key) {
            None => return Err(err(path, format!("no {key} (the runtime reads it)"))),
            Some(got) if *got != want => {
                return Err(err(
                    path,
                    format!(
                    "{key} is {got}, but the packages were built for {want} (hf_model/config.json)"
                ),
                ))
            }
            _ => {}
        }
    }
    let scales = [
        ("embed_scale", d.embed_scale),
        ("per_layer_embed_scale", d.per_layer_embed_scale),
        (
            "per_layer_model_projection_scale",
            1.0 / (cfg.hidden_size as f64).sqrt(),
        ),
        ("per_layer_input_scale", 1.0 / 2f64.sqrt()),
    ];
    for (key, want) in scales {
        match config.get(key).and_then(Value::as_f64) {
            None => return Err(err(path, format!("no {key} (a number the runtime reads)"))),
            Some(got) if (got - want).abs() > 1e-9 * want.abs() => {
                return Err(err(
                    path,
                    format!("{key} is {got}, but hf_model/config.json's model has {want}"),
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// A `.npy` file's header: (bytes before the data, the header dict's text).
fn npy_header(head: &[u8]) -> Option<(usize, &str)> {
    if head.len() < 10 || &head[..6] != b"\x93NUMPY" {
        return None;
    }
    // Version 1.0 only: the runtime takes the data to start at 10 + the u16
    // header length, which a 2.0 / 3.0 header (u32 length) would shift.
    if head[6] != 1 {
        return None;
    }
    let (len, start) = (u16::from_le_bytes([head[8], head[9]]) as usize, 10);
    let text = std::str::from_utf8(head.get(start..start + len)?).ok()?;
    Some((start + len, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_header_v1() {
        let dict = "{'descr': '<f2', 'fortran_order': False, 'shape': (4, 8), }";
        let mut h = b"\x93NUMPY\x01\x00".to_vec();
        let pad = 64 - (10 + dict.len() + 1) % 64;
        let text = format!("{dict}{}\n", " ".repeat(pad));
        h.extend((text.len() as u16).to_le_bytes());
        h.extend(text.as_bytes());
        let (len, t) = npy_header(&h).unwrap();
        assert_eq!(len % 64, 0);
        assert!(t.contains("(4, 8)"));
        assert!(npy_header(b"not a numpy file").is_none());
    }
}
