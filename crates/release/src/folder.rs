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

use chunkforge_model::config::TextConfig;
pub use chunkforge_model::layouts::RunLayout;
use chunkforge_model::layouts::{spec, Runtime, REFERENCE};
use chunkforge_model::plan::{self, FunctionKind, Functions, Layout, LayoutKind, Mode, SlotCopy};

use crate::bench::runtime_layout;
use crate::downloader;
use crate::hashing;
use crate::manifest::{self, Manifest, MANIFEST_FILE};
use crate::paths::{HF_MODEL_DIR, TOKENIZER_FILE};
use crate::sidefiles::{self, Expected, ModelConfig, SIDE_FILES};
use crate::sign::SIG_FILE;
use crate::strict_json;

#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct FolderError {
    pub path: PathBuf,
    pub message: String,
}

type Result<T, E = FolderError> = std::result::Result<T, E>;

/// The folder only the app's repository layout has: the reference's (it
/// ships with every release, under `swa/`).
fn repository_mark() -> Option<String> {
    let first = spec(REFERENCE).package_names().into_iter().next()?;
    let path = chunkforge_model::layouts::repository_path(&first)?;
    path.split_once('/').map(|(dir, _)| dir.to_string())
}

fn err(path: &Path, message: impl Into<String>) -> FolderError {
    FolderError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Which of the app's two folder layouts a release folder follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FolderKind {
    /// The app's repository, as `package` writes a release: packages at
    /// their remote paths (`swa/`, `prefill/`), the RoPE tables under `swa/`,
    /// and some weight blobs held once for the packages that share them.
    Repository,
    /// The app's model folder after its download: every package and side
    /// file at the root under its own name (releases made before the
    /// repository layout, and a folder laid out as the app saves it).
    Local,
}

/// Where one package's files are read from, the way the app has them.
#[derive(Clone, Debug, serde::Serialize, schemars::JsonSchema)]
pub struct PackageFiles {
    /// The package folder.
    pub path: PathBuf,
    /// The folder holding the weight blob it reads: its own, or the one of
    /// the package the app's downloader links or copies it from.
    pub weights: PathBuf,
}

/// A release folder, opened.
pub struct ReleaseFolder {
    pub dir: PathBuf,
    pub kind: FolderKind,
    pub manifest: Manifest,
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
    /// Every package of the three layouts, by name.
    pub packages: BTreeMap<String, PackageFiles>,
    /// The download entry whose folder this is, as the runtime loads it.
    pub entry: &'static downloader::Entry,
}

/// `verify`'s rule, applied before anything is read: a release holds no
/// symlinks (one could lead out of the folder, and `run` reads the folder
/// alone, as the app does) and nothing but files and folders (a FIFO would
/// block the read).
pub(crate) fn refuse_links(dir: &Path) -> Result<()> {
    let tree = hashing::walk(dir, &|_| false)
        .map_err(|e| err(&e.path, format!("cannot list: {}", e.source)))?;
    if let Some(b) = tree.bad_names.first() {
        return Err(err(
            &dir.join(&b.path),
            format!(
                "file name {}, so it is not one plain path component (run reads only what the signature can name; verify refuses the folder too)",
                b.why
            ),
        ));
    }
    if let Some(l) = tree.symlinks.first() {
        return Err(err(
            &dir.join(l),
            "is a symlink (releases must not contain symlinks; run reads the release folder alone, \
             and verify refuses the folder too)",
        ));
    }
    if let Some(s) = tree.special.first() {
        return Err(err(&dir.join(s), "is not a regular file"));
    }
    Ok(())
}

/// Why `dir`, handed to `command` (`run`, `verify`), is not a release folder,
/// or None when it looks like one (it has `manifest.json` or `model.sig`;
/// what is wrong inside is then the command's to say). A build folder is
/// told how it becomes a release.
pub fn not_a_release(dir: &Path, command: &str) -> Option<String> {
    // Present in any form (a dangling symlink too): what is wrong with it is
    // the command's to report.
    let present = |name: &str| fs::symlink_metadata(dir.join(name)).is_ok();
    if present(MANIFEST_FILE) || present(SIG_FILE) {
        return None;
    }
    Some(if dir.join("build.json").is_file() {
        format!(
            "a build folder (it has build.json), not a release: `chunkforge {command}` takes a release folder, which `chunkforge package {} --layout LAYOUT --key KEY.pem --output RELEASE` makes from this build (or `chunkforge release` from a checkpoint)",
            dir.display()
        )
    } else {
        format!(
            "not a release folder (no {MANIFEST_FILE}, no {SIG_FILE}): `chunkforge {command}` takes a release folder, made by `chunkforge package` or `chunkforge release`"
        )
    })
}

/// The `.mlpackage` folders directly inside `dir` (a build or release
/// folder), sorted by name.
pub fn packages_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".mlpackage") && dir.join(n).is_dir())
        .collect();
    names.sort();
    names
}

impl ReleaseFolder {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(err(
                dir,
                if dir.exists() {
                    "not a folder: `chunkforge run` takes a release folder"
                } else {
                    "does not exist"
                },
            ));
        }
        if let Some(why) = not_a_release(dir, "run") {
            return Err(err(dir, why));
        }
        refuse_links(dir)?;
        let manifest_path = dir.join(MANIFEST_FILE);
        let manifest = Manifest::load(&manifest_path).map_err(|e| err(&manifest_path, e))?;
        let config_path = dir.join(sidefiles::MODEL_CONFIG);
        let config = read_model_config(&config_path)?;
        let hf = dir.join(HF_MODEL_DIR);
        let cfg = TextConfig::load(&hf).map_err(|e| err(&hf, e.to_string()))?;
        check_model_config(&config, &config_path, &cfg)?;
        let files = manifest
            .files
            .iter()
            .map(|f| (f.path.clone(), (f.size, f.sha256.clone())))
            .collect();
        // Every release ships the reference, in the repository under swa/.
        let kind = if repository_mark().is_some_and(|m| dir.join(m).is_dir()) {
            FolderKind::Repository
        } else {
            FolderKind::Local
        };
        Ok(ReleaseFolder {
            dir: dir.to_path_buf(),
            kind,
            manifest,
            cfg,
            context_length: config.context_length,
            eos_token_ids: config.eos_token_id.ids(),
            embed_scale: config.embed_scale,
            per_layer_embed_scale: config.per_layer_embed_scale,
            files,
        })
    }

    /// Checks every side file the runtime reads (size, `.npy` header, the
    /// manifest's size and digest) and the tokenizer when the manifest lists
    /// it; returns the first problem, naming the file.
    pub fn check_files(&self) -> Result<()> {
        let c = &self.cfg;
        for spec in SIDE_FILES {
            let rel = spec.path_in(self.kind == FolderKind::Repository);
            let path = self.dir.join(&rel);
            // The manifest lists repository paths (names alone before the
            // repository layout).
            let key = [spec.repository_path(), spec.name.to_string()]
                .into_iter()
                .find(|k| self.files.contains_key(k))
                .unwrap_or(rel);
            let listed = self.files.contains_key(&key);
            let Some(size) = check_side_file(&path, spec, c, self.context_length, listed)? else {
                continue;
            };
            self.check_digest(&key, &path, size)?;
        }
        // Every dimension of the plan comes from hf_model/config.json.
        let config = format!("{HF_MODEL_DIR}/config.json");
        let path = self.dir.join(&config);
        let size = fs::metadata(&path)
            .map_err(|e| err(&path, format!("cannot read: {e}")))?
            .len();
        self.check_digest(&config, &path, size)?;
        let want = &self.manifest.model.config_sha256;
        let got = hashing::sha256_file(&path).map_err(|e| err(&path, e.to_string()))?;
        if *want != got {
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

    /// The size and SHA-256 (hex) the manifest lists for the release path
    /// `rel` (None: not listed).
    pub fn listed(&self, rel: &str) -> Option<(u64, String)> {
        self.files.get(rel).cloned()
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

    /// The side file `name`'s path in the folder (under `swa/` for the
    /// RoPE tables in the repository layout).
    pub fn side_file(&self, name: &str) -> PathBuf {
        let rel = SIDE_FILES.iter().find(|s| s.name == name).map_or_else(
            || name.to_string(),
            |s| s.path_in(self.kind == FolderKind::Repository),
        );
        self.dir.join(rel)
    }

    /// Package `name`'s folder: at its remote path in the repository
    /// layout (as the manifest lists it), under its name in the local one.
    pub fn package_dir(&self, name: &str) -> PathBuf {
        match self.kind {
            FolderKind::Repository => self.dir.join(
                self.manifest
                    .chunk(name)
                    .map_or_else(|| manifest::package_file(name, false), |c| c.file.clone()),
            ),
            // As the app saves it: compiled, or (an uncompiled release's
            // materialized download) the .mlpackage it would be compiled from.
            FolderKind::Local => {
                let compiled = self.dir.join(format!("{name}.mlmodelc"));
                if compiled.is_dir() {
                    compiled
                } else {
                    self.dir.join(format!("{name}.mlpackage"))
                }
            }
        }
    }

    fn has_package(&self, name: &str) -> bool {
        self.package_dir(name).is_dir()
    }

    /// Where package `name`'s files come from after `entry`'s download: a
    /// package it fetches without its weight blob reads the blob its share
    /// gives it. A missing blob is an error naming it (and its share).
    pub fn package_files(&self, name: &str, entry: &downloader::Entry) -> Result<PackageFiles> {
        let path = self.package_dir(name);
        let from = entry.blob_of(name);
        let source = self.package_dir(from);
        let blob = source.join(downloader::blob_in(&source.to_string_lossy()));
        if !blob.is_file() {
            let why = if from == name {
                "missing: the package's weight blob".to_string()
            } else {
                format!(
                    "missing: the app's {} download gives {name} this blob ({} {})",
                    entry.client,
                    entry.how,
                    path.join(downloader::blob_in(&path.to_string_lossy()))
                        .display()
                )
            };
            return Err(err(&blob, why));
        }
        Ok(PackageFiles {
            path,
            weights: blob.parent().map(Path::to_path_buf).unwrap_or_default(),
        })
    }

    /// The folder of the weight blob that the package folder `package`
    /// (inside this release) reads when it holds none of its own: the blob
    /// of the package some entry's download shares into it (every such pair
    /// is the same bytes: `package` and `verify` check it). None when it
    /// holds its blob, or is not one of the release's packages.
    pub fn shared_weights(&self, package: &Path) -> Option<PathBuf> {
        if package.join(downloader::PACKAGE_BLOB).is_file() {
            return None;
        }
        let target = package.canonicalize().ok()?;
        let name = self
            .manifest
            .chunks
            .iter()
            .map(|c| c.name.as_str())
            .find(|n| self.package_dir(n).canonicalize().ok().as_ref() == Some(&target))?;
        downloader::ENTRIES
            .iter()
            .filter(|e| e.blob_of(name) != name)
            .find_map(|e| self.package_files(name, e).ok())
            .map(|f| f.weights)
    }

    /// The token counts of `name`'s functions of `kind` in the manifest.
    fn function_tokens(&self, name: &str, kind: FunctionKind) -> Vec<usize> {
        self.manifest
            .chunk(name)
            .into_iter()
            .flat_map(|c| &c.functions)
            .filter(|f| f.kind == kind)
            .map(|f| f.tokens)
            .collect()
    }

    /// The decode layout to run, the four-chunk layout and the prefill
    /// layout, planned from `hf_model/config.json` at the context length and
    /// checked against the manifest's contracts, with every package's files
    /// as `runtime`'s download has them (None: the runtime that loads the
    /// layout, main where both do). `RunLayout::Auto` picks by file presence
    /// as `runtime` does (None: either's rules, main's first).
    pub fn plan(&self, want: RunLayout, runtime: Option<Runtime>) -> Result<RunPlan> {
        let manifest = self.dir.join(MANIFEST_FILE);
        let (kind, picked_by) = match want {
            RunLayout::Auto => {
                // ChunkedEngine's presence rules.
                let has = |n: &str| self.has_package(n);
                let kind = match runtime {
                    Some(rt) => runtime_layout::pick_for(rt, has),
                    None => runtime_layout::pick(has),
                };
                (kind, "picked by file presence, as the runtime does")
            }
            RunLayout::Only(kind) => (kind, "--layout"),
        };
        let loads = spec(kind).runtimes();
        let runtime = match runtime {
            Some(rt) if !loads.contains(&rt) => {
                return Err(err(
                    &self.dir,
                    format!(
                        "{} does not load the {kind} layout (it loads {})",
                        rt.describe(),
                        runtime_layout::loaded_by(rt).join(", ")
                    ),
                ))
            }
            Some(rt) => rt,
            None if loads.contains(&Runtime::Main) => Runtime::Main,
            None => loads.first().copied().unwrap_or(Runtime::Main),
        };
        let entry = downloader::entry_for(runtime, kind);
        let planned = self.planned(self.context_length)?;
        let mut packages = BTreeMap::new();
        // `need`: the packages must be there. The reference's are not when
        // decoding with another layout (the plan still gives prefill's
        // caches): the 3-way entry downloads no chunk2..4.
        let mut layout = |k: LayoutKind, need: bool| -> Result<Layout> {
            let l = planned
                .layouts
                .iter()
                .find(|l| l.kind == k)
                .cloned()
                .ok_or_else(|| err(&manifest, format!("no {k} layout in the plan")))?;
            for c in &l.chunks {
                let pkg = self.package_dir(&c.name);
                if !pkg.is_dir() && !need {
                    continue;
                }
                if !pkg.is_dir() {
                    return Err(err(&pkg, format!("missing: the {k} layout needs it")));
                }
                self.check_chunk(&manifest, c)?;
                packages.insert(c.name.clone(), self.package_files(&c.name, entry)?);
            }
            Ok(l)
        };
        let four = layout(REFERENCE, kind == REFERENCE)?;
        let prefill = layout(LayoutKind::Prefill, true)?;
        let mut decode = layout(kind, true)?;
        if kind != REFERENCE {
            decode.kv_slot_map = self.slot_map(&manifest, kind)?;
        }
        Ok(RunPlan {
            decode,
            four,
            prefill,
            picked_by,
            packages,
            entry,
        })
    }

    /// The plan of `hf_model/config.json` at `context_length` for every
    /// layout, with the verify K and prefill lengths the manifest states
    /// for the reference's and the prefill packages.
    pub fn planned(&self, context_length: usize) -> Result<plan::Plan> {
        let manifest = self.dir.join(MANIFEST_FILE);
        let verify = spec(REFERENCE).package_names();
        let prefill = spec(LayoutKind::Prefill).package_names();
        let functions = Functions {
            verify_k: verify.last().and_then(|c| {
                self.function_tokens(c, FunctionKind::Verify)
                    .first()
                    .copied()
            }),
            prefill_lens: prefill
                .first()
                .map(|c| self.function_tokens(c, FunctionKind::Prefill))
                .unwrap_or_default(),
        };
        if functions.prefill_lens.is_empty() {
            return Err(err(
                &manifest,
                format!(
                    "no {} with prefill functions: the runtime requires them",
                    spec(LayoutKind::Prefill).range()
                ),
            ));
        }
        plan::plan(&self.cfg, context_length, Mode::All, None, &functions)
            .map_err(|e| err(&manifest, e.to_string()))
    }

    /// The manifest's KV slot map of decode layout `kind`.
    fn slot_map(&self, manifest: &Path, kind: LayoutKind) -> Result<Vec<SlotCopy>> {
        self.manifest
            .decode_layouts
            .iter()
            .find(|l| l.kind == kind)
            .map(|l| l.kv_slot_map.clone())
            .ok_or_else(|| err(manifest, format!("decode_layouts has no {kind} layout")))
    }

    /// The plan's chunk against the manifest's entry for it: layer range,
    /// inputs, outputs and every function's contract.
    pub fn check_chunk(&self, manifest: &Path, c: &plan::ChunkPlan) -> Result<()> {
        let m = self.manifest.chunk(&c.name).ok_or_else(|| {
            err(
                manifest,
                format!("no entry for {}.mlpackage, which is in the folder", c.name),
            )
        })?;
        let differs = |what: String| {
            err(
                manifest,
                format!(
                    "{}'s {what} is not what hf_model/config.json plans at context length {}",
                    c.name, self.context_length
                ),
            )
        };
        // The contract as the manifest states it, written by the same function.
        for f in &c.functions {
            let got = m.functions.iter().find(|g| g.name == f.name);
            for (key, same) in [
                ("kind", got.is_some_and(|g| g.kind == f.kind)),
                ("tokens", got.is_some_and(|g| g.tokens == f.tokens)),
                (
                    "inputs",
                    got.is_some_and(|g| g.inputs == manifest::contract(&f.inputs)),
                ),
                (
                    "outputs",
                    got.is_some_and(|g| g.outputs == manifest::contract(&f.outputs)),
                ),
            ] {
                if !same {
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
        for (key, same) in [
            ("first_layer", m.first_layer == c.first_layer),
            ("last_layer", m.last_layer == c.last_layer),
            ("inputs", m.inputs == manifest::contract(&c.inputs)),
            ("outputs", m.outputs == manifest::contract(&c.outputs)),
        ] {
            if !same {
                return Err(differs(key.into()));
            }
        }
        Ok(())
    }
}

/// Side file `spec` at `path`, against the sizes `cfg` implies at
/// `context_length`: missing is an error when the runtime requires it or
/// `listed` (the manifest lists it); returns its size (None: absent and
/// optional).
pub fn check_side_file(
    path: &Path,
    spec: &sidefiles::SideFileSpec,
    cfg: &TextConfig,
    context_length: usize,
    listed: bool,
) -> Result<Option<u64>> {
    if !path.exists() {
        if spec.required || listed {
            return Err(err(
                path,
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
        return Ok(None);
    }
    let size = fs::metadata(path)
        .map_err(|e| err(path, format!("cannot read: {e}")))?
        .len();
    let expected = match spec.expected(cfg) {
        Expected::Bytes(n) => Some(n),
        Expected::Npy { head_dim } => Some(check_npy(path, head_dim, size, context_length)?),
        Expected::Contents => None,
    };
    if let Some(want) = expected {
        if size != want {
            return Err(err(
                path,
                format!(
                    "{size} bytes, hf_model/config.json's dimensions need {want} (truncated or from another model)"
                ),
            ));
        }
    }
    Ok(Some(size))
}

/// A RoPE table's `.npy` header: little-endian fp16, C order, shape
/// (positions >= context length, head_dim); returns the file size it implies.
fn check_npy(path: &Path, head_dim: usize, size: u64, context_length: usize) -> Result<u64> {
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
            if s[0] < context_length {
                return Err(err(
                    path,
                    format!(
                        "{} positions, fewer than the context length {} (the runtime would feed rows of zeros past them)",
                        s[0], context_length
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

/// Reads `model_config.json` through its type.
pub(crate) fn read_model_config(path: &Path) -> Result<ModelConfig> {
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
    let v =
        strict_json::from_slice(&bytes).map_err(|e| err(path, format!("not valid JSON: {e}")))?;
    serde_json::from_value(v).map_err(|e| {
        err(
            path,
            format!("not the runtime's model config ({e}; the runtime reads each key)"),
        )
    })
}

/// `model_config.json` against the plan of `hf_model/config.json`: every key
/// the runtime reads must agree (the app takes its dimensions and scales
/// from this file, the packages were built from the other).
pub(crate) fn check_model_config(
    config: &ModelConfig,
    path: &Path,
    cfg: &TextConfig,
) -> Result<()> {
    let want = ModelConfig::of(
        cfg,
        config.context_length,
        &config.model_name,
        config.bos_token_id,
        0,
    );
    // (key, got, want) of each field.
    macro_rules! pairs {
        ($show:expr; $($key:ident),+) => {
            [$((stringify!($key), $show(&config.$key), $show(&want.$key))),+]
        };
    }
    let exact = pairs!(json;
        architecture,
        hidden_size,
        vocab_size,
        num_hidden_layers,
        num_layers,
        per_layer_dim,
        sliding_window,
        num_kv_shared_layers,
        layer_types
    );
    for (key, got, want) in exact {
        if got != want {
            return Err(err(
                path,
                format!(
                    "{key} is {got}, but the packages were built for {want} (hf_model/config.json)"
                ),
            ));
        }
    }
    let scales = pairs!(f64::clone;
        embed_scale,
        per_layer_embed_scale,
        per_layer_model_projection_scale,
        per_layer_input_scale
    );
    for (key, got, want) in scales {
        if (got - want).abs() > 1e-9 * want.abs() || got.is_nan() {
            return Err(err(
                path,
                format!("{key} is {got}, but hf_model/config.json's model has {want}"),
            ));
        }
    }
    Ok(())
}

/// A value as JSON text, for a message.
fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
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
