//! `package --onto DIR`: the run book's workflow (build some packages, put
//! them beside an existing four-chunk folder). The build's packages go into
//! a new release; every file the build lacks (the reference's and the
//! prefill packages, the side files, `hf_model/`) is carried from DIR, an
//! existing chunkforge release (repository or local layout), or an upstream
//! bundle ([`crate::bundle`]: compiled `.mlmodelc`, no manifest).
//!
//! Before anything is written, each carried file is checked against the
//! build, in this order, and the first that disagrees is named:
//! `hf_model/config.json` (the build's config.json digest, and the one DIR's
//! manifest records), `model_config.json` (vocabulary, widths and
//! `context_length` of the build's plan), the side files (the sizes the
//! config implies, and DIR's manifest digests: `ReleaseFolder::check_files`),
//! then each carried package (its contract as DIR's manifest states it,
//! equal to the plan of the build's config at the build's context length;
//! its files equal to DIR's manifest).
//!
//! An upstream bundle records nothing, so it is checked against what its
//! files state: its `hf_model/config.json` must plan the build's model
//! (the same dimensions; the same bytes are not required), `model_config.json`
//! the build's context length, the side files the sizes that config
//! implies, and every carried package's `model.mil` the plan's contract,
//! function by function. Its packages stay compiled in the release (the
//! manifest lists them as `.mlmodelc`); `chunkforge compile` on macOS
//! compiles the build's packages beside them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use chunkforge_model::config::TextConfig;
use chunkforge_model::layouts::{spec, REFERENCE};
use chunkforge_model::plan::{self, FunctionPlan, Functions, Layout, LayoutKind, Mode};

use crate::bundle::{Bundle, MilFunction};
use crate::downloader;
use crate::folder::{FolderKind, ReleaseFolder};
use crate::hashing::{self, FileDigest};
use crate::manifest::{self, Build, ContractTensor, OntoRecord, MANIFEST_FILE};
use crate::paths::HF_MODEL_DIR;
use crate::sidefiles::{self, MadeFrom, SideFileSpec, SIDE_FILES};

/// What DIR is.
pub enum Source {
    /// A chunkforge release: its manifest states every contract and digest.
    Release(Box<ReleaseFolder>),
    /// An upstream bundle: compiled packages, nothing recorded.
    Upstream(Box<Bundle>),
}

/// DIR, checked against a build, and what it carries into the release.
pub struct Onto {
    pub source: Source,
    /// The layouts the build lacks, planned from the build's config at its
    /// context length with DIR's verify K and prefill lengths.
    pub layouts: Vec<Layout>,
    /// The packages carried, by name.
    pub packages: Vec<String>,
    /// RoPE tables an upstream bundle lacks or holds with other values than
    /// its config gives, which the release gets made instead (with the
    /// bundle's row count, if it has one).
    pub remade: Vec<(&'static SideFileSpec, Option<usize>)>,
}

/// The layouts every release needs beside its decode layouts: the
/// reference (the runtime's fallback, prefill's KV source) and the prefill
/// packages.
const CARRIED_LAYOUTS: [LayoutKind; 2] = [REFERENCE, LayoutKind::Prefill];

impl Onto {
    /// Opens DIR and checks every file it would carry against `build`.
    pub fn open(dir: &Path, build: &Build) -> Result<Onto> {
        if dir.join(MANIFEST_FILE).is_file() {
            return Self::open_release(dir, build);
        }
        match Bundle::detect(dir) {
            Some(kind) => Self::open_bundle(Bundle::open(dir, kind)?, build),
            None => bail!(
                "{}: --onto takes a chunkforge release (it has no {MANIFEST_FILE}) or an upstream bundle (it has no {} or chunk1.mlmodelc)",
                dir.display(),
                manifest::package_file("chunk1", true)
            ),
        }
    }

    /// DIR's folder.
    pub fn dir(&self) -> &Path {
        match &self.source {
            Source::Release(f) => &f.dir,
            Source::Upstream(b) => &b.dir,
        }
    }

    /// DIR's `hf_model/config.json`.
    pub fn cfg(&self) -> &TextConfig {
        match &self.source {
            Source::Release(f) => &f.cfg,
            Source::Upstream(b) => &b.cfg,
        }
    }

    /// Whether the carried packages are compiled (an upstream bundle's).
    pub fn compiled(&self) -> bool {
        matches!(self.source, Source::Upstream(_))
    }

    /// Carried package `name`'s folder in the release.
    pub fn release_file(&self, name: &str) -> String {
        manifest::package_file(name, self.compiled())
    }

    fn open_release(dir: &Path, build: &Build) -> Result<Onto> {
        let folder = ReleaseFolder::open(dir)?;
        let config = dir.join(HF_MODEL_DIR).join("config.json");
        let want = &build.record.checkpoint.config_sha256;
        let got = hashing::sha256_file(&config)?;
        if &got != want || &folder.manifest.model.config_sha256 != want {
            bail!(
                "{}: not the config.json the build was made from (sha256 {got}, {} records {}, build.json {want}); --onto needs a release of the same checkpoint",
                config.display(),
                dir.join(MANIFEST_FILE).display(),
                folder.manifest.model.config_sha256
            );
        }
        let dims = &build.record.plan.dims;
        let ctx = build.record.settings.ctx;
        let model_config = dir.join(sidefiles::MODEL_CONFIG);
        for (what, theirs, ours) in [
            ("context_length", folder.context_length, ctx),
            (
                "vocab_size",
                folder.manifest.dims.vocab_size,
                dims.vocab_size,
            ),
            (
                "hidden_size",
                folder.manifest.dims.hidden_size,
                dims.hidden_size,
            ),
            (
                "num_hidden_layers",
                folder.manifest.dims.num_hidden_layers,
                dims.num_hidden_layers,
            ),
        ] {
            if theirs != ours {
                bail!(
                    "{}: {what} is {theirs}, the build's is {ours}; its packages and side files would not fit the build's",
                    model_config.display()
                );
            }
        }
        if folder.manifest.dims != *dims {
            bail!(
                "{}: the model dimensions (dims) differ from the build's plan",
                dir.join(MANIFEST_FILE).display()
            );
        }
        // Side files: the sizes the config implies, DIR's manifest digests.
        folder.check_files()?;
        let planned = folder.planned(ctx)?;
        let manifest = dir.join(MANIFEST_FILE);
        let (layouts, packages) = carried(build, &planned, |kind, c| {
            let pkg = folder.package_dir(&c.name);
            missing(&pkg, kind, c)?;
            Ok(folder.check_chunk(&manifest, c)?)
        })?;
        let onto = Onto {
            source: Source::Release(Box::new(folder)),
            layouts,
            packages,
            remade: Vec::new(),
        };
        for n in &onto.packages {
            onto.check_package_files(n)?;
        }
        Ok(onto)
    }

    /// An upstream bundle against `build`: its config plans the build's
    /// model at the build's context length, its side files have that
    /// model's sizes, and each package it carries states the plan's
    /// contract in its `model.mil`.
    fn open_bundle(b: Bundle, build: &Build) -> Result<Onto> {
        let ctx = build.record.settings.ctx;
        let config = b.dir.join(HF_MODEL_DIR).join("config.json");
        let model_config = b.dir.join(sidefiles::MODEL_CONFIG);
        if b.context_length != ctx {
            bail!(
                "{}: context_length is {}, the build's is {ctx}; its packages would not fit the build's",
                model_config.display(),
                b.context_length
            );
        }
        // The functions the bundle's packages carry, as the runtime reads
        // them: verify K and prefill N from their hidden_states.
        let reference = spec(REFERENCE).package_names();
        let prefill = spec(LayoutKind::Prefill).package_names();
        let tokens = |name: Option<&String>, kind: &str| -> Result<Vec<usize>> {
            let Some(name) = name else {
                return Ok(Vec::new());
            };
            if !b.package_dir(name).is_dir() {
                return Ok(Vec::new());
            }
            Ok(b.functions(name)?
                .iter()
                .filter(|f| f.name.starts_with(kind))
                .filter_map(|f| f.inputs.iter().find(|t| t.name == "hidden_states"))
                .filter_map(|t| t.shape.get(1).copied())
                .collect())
        };
        let functions = Functions {
            verify_k: tokens(reference.first(), "verify_")?.first().copied(),
            prefill_lens: tokens(prefill.first(), "prefill_")?,
        };
        let planned = plan::plan(&b.cfg, ctx, Mode::All, None, &functions)
            .map_err(|e| anyhow::anyhow!("{}: {e}", config.display()))?;
        if planned.dims != build.record.plan.dims {
            bail!(
                "{}: describes another model than the build's (its dimensions differ from build.json's plan); --onto needs a bundle of the same checkpoint",
                config.display()
            );
        }
        if hashing::sha256_file(&config)? != build.record.checkpoint.config_sha256 {
            eprintln!(
                "note: {}: not byte for byte the build's config.json, but it plans the same model",
                config.display()
            );
        }
        b.check_side_files()?;
        let remade = rope_to_remake(&b)?;
        let (layouts, packages) = carried(build, &planned, |kind, c| {
            let pkg = b.package_dir(&c.name);
            missing(&pkg, kind, c)?;
            check_functions(
                &pkg.join("model.mil"),
                &c.functions,
                &b.functions(&c.name)?,
                ctx,
            )
        })?;
        Ok(Onto {
            source: Source::Upstream(Box::new(b)),
            layouts,
            packages,
            remade,
        })
    }

    /// Every file of carried package `name` is the one DIR's manifest
    /// lists (its contract there is what was checked), and DIR's manifest
    /// lists no file of it that is missing.
    fn check_package_files(&self, name: &str) -> Result<()> {
        let Source::Release(folder) = &self.source else {
            return Ok(());
        };
        let dir = self.package_dir(name);
        let rel = dir
            .strip_prefix(&folder.dir)
            .unwrap_or(&dir)
            .to_string_lossy()
            .into_owned();
        let files = hashing::file_digests(&dir)?;
        let listed: BTreeMap<&str, &crate::manifest::FileEntry> = folder
            .manifest
            .files
            .iter()
            .filter_map(|f| {
                f.path
                    .strip_prefix(&format!("{rel}/"))
                    .map(|r| (r, f))
                    .or_else(|| {
                        // A local-layout release lists the package by name.
                        f.path
                            .strip_prefix(&format!("{name}.mlpackage/"))
                            .map(|r| (r, f))
                    })
            })
            .collect();
        for (r, d) in &files {
            match listed.get(r.as_str()) {
                Some(f) if f.size == d.size && f.sha256 == d.hex() => {}
                Some(_) => bail!(
                    "{}: differs from what {} lists (changed after packaging)",
                    dir.join(r).display(),
                    folder.dir.join(MANIFEST_FILE).display()
                ),
                None => bail!(
                    "{}: not listed in {}",
                    dir.join(r).display(),
                    folder.dir.join(MANIFEST_FILE).display()
                ),
            }
        }
        if let Some(r) = listed.keys().find(|r| !files.contains_key(**r)) {
            bail!(
                "{}: missing ({} lists it)",
                dir.join(r).display(),
                folder.dir.join(MANIFEST_FILE).display()
            );
        }
        Ok(())
    }

    /// Carried package `name`'s folder in DIR.
    pub fn package_dir(&self, name: &str) -> PathBuf {
        match &self.source {
            Source::Release(f) => f.package_dir(name),
            Source::Upstream(b) => b.package_dir(name),
        }
    }

    /// Whether the release's package `name` comes from DIR.
    pub fn carries(&self, name: &str) -> bool {
        self.packages.iter().any(|p| p == name)
    }

    /// The build with the carried layouts added to its plan (in the
    /// layout table's order), so everything downstream (release chunks,
    /// shares, the manifest, the run book) reads one plan.
    pub fn augment(&self, build: &Build) -> Build {
        let mut record = build.record.clone();
        record.plan.layouts.extend(self.layouts.iter().cloned());
        let order = |k: LayoutKind| {
            chunkforge_model::layouts::LAYOUTS
                .iter()
                .position(|l| l.kind == k)
                .unwrap_or(usize::MAX)
        };
        record.plan.layouts.sort_by_key(|l| order(l.kind));
        Build {
            dir: build.dir.clone(),
            record,
        }
    }

    /// The side files DIR carries: (source, path in the release).
    pub fn side_files(&self) -> Vec<(PathBuf, String)> {
        SIDE_FILES
            .iter()
            .map(|s| {
                let src = match &self.source {
                    Source::Release(f) => f.side_file(s.name),
                    Source::Upstream(b) => b.side_file(s.name),
                };
                (src, s.repository_path())
            })
            .filter(|(src, rel)| {
                src.is_file() && !self.remade.iter().any(|(s, _)| s.repository_path() == *rel)
            })
            .collect()
    }

    /// The blob of carried package `name` as built, when DIR holds it only
    /// through a share: a release's manifest records it; in an upstream
    /// bundle it is the blob of `from`, the package the app's download
    /// shares it from.
    pub fn held_blob(&self, name: &str, from: &str) -> Option<FileDigest> {
        let folder = match &self.source {
            Source::Release(f) => f,
            Source::Upstream(b) => {
                let dir = b.package_dir(from);
                return hashing::hash_file(&dir.join(downloader::COMPILED_BLOB)).ok();
            }
        };
        let s = folder.manifest.shares.iter().find(|s| s.package == name)?;
        Some(FileDigest {
            size: s.size,
            sha256: hashing::parse_hex32(&s.sha256)?,
        })
    }

    /// The sha256_tree and weight bytes DIR's manifest records for `name`.
    pub fn chunk_record(&self, name: &str) -> (Option<String>, Option<u64>) {
        let Source::Release(folder) = &self.source else {
            return (None, None);
        };
        folder
            .manifest
            .chunk(name)
            .map_or((None, None), |c| (c.sha256_tree.clone(), c.weight_bytes))
    }

    /// What the manifest records about DIR.
    pub fn record(&self) -> OntoRecord {
        let layout = |kind: FolderKind| match kind {
            FolderKind::Repository => "repository",
            FolderKind::Local => "local",
        };
        match &self.source {
            Source::Release(f) => OntoRecord {
                model_id: f.manifest.model.id.clone(),
                version: Some(f.manifest.release.version.clone()),
                layout: layout(f.kind).into(),
                upstream: false,
                packages: self.packages.clone(),
            },
            Source::Upstream(b) => OntoRecord {
                model_id: b.model_name.clone(),
                version: None,
                layout: layout(b.kind).into(),
                upstream: true,
                packages: self.packages.clone(),
            },
        }
    }
}

/// A carried package's functions, as its `model.mil` states them, against
/// the plan's: the same functions, each with the plan's contract.
fn check_functions(
    mil: &Path,
    planned: &[FunctionPlan],
    got: &[MilFunction],
    ctx: usize,
) -> Result<()> {
    let names = |v: Vec<&str>| v.join(", ");
    let want_names: Vec<&str> = planned.iter().map(|f| f.name.as_str()).collect();
    let got_names: Vec<&str> = got.iter().map(|f| f.name.as_str()).collect();
    let (mut w, mut g) = (want_names.clone(), got_names.clone());
    w.sort_unstable();
    g.sort_unstable();
    if w != g {
        bail!(
            "{}: functions {}, the build's config plans {}",
            mil.display(),
            names(got_names),
            names(want_names)
        );
    }
    let show = |t: &ContractTensor| format!("{} {:?} {}", t.name, t.shape, t.dtype);
    for f in planned {
        let g = got.iter().find(|g| g.name == f.name).expect("same names");
        for (what, want, got) in [
            ("inputs", manifest::contract(&f.inputs), &g.inputs),
            ("outputs", manifest::contract(&f.outputs), &g.outputs),
        ] {
            if want != *got {
                let at = want.iter().zip(got.iter()).position(|(a, b)| a != b);
                let detail = match at {
                    Some(i) => format!("{} where the plan has {}", show(&got[i]), show(&want[i])),
                    None => format!("{} tensors where the plan has {}", got.len(), want.len()),
                };
                bail!(
                    "{}: function {}'s {what} are not what the build's config plans at context length {ctx}: {detail}",
                    mil.display(),
                    f.name
                );
            }
        }
    }
    Ok(())
}

/// The RoPE tables of bundle `b` the release must not carry: missing (the
/// runtime would read rows of zeros) or with other values than `b`'s config
/// gives (upstream's main-branch generator rotates every pair of the full
/// layers; transformers rotates the first `partial_rotary_factor` of them).
/// Each is said in a note.
fn rope_to_remake(b: &Bundle) -> Result<Vec<(&'static SideFileSpec, Option<usize>)>> {
    let mut out = Vec::new();
    for spec in SIDE_FILES
        .iter()
        .filter(|s| matches!(s.made_from, MadeFrom::Rope(..)))
    {
        let path = b.side_file(spec.name);
        if !path.is_file() {
            eprintln!(
                "note: {}: missing (the runtime would read rows of zeros); the release gets the table hf_model/config.json gives",
                path.display()
            );
            out.push((spec, None));
            continue;
        }
        let (bad, rows) = sidefiles::rope_mismatch(&b.cfg, spec, &path)?;
        if let Some(row) = bad {
            eprintln!(
                "note: {}: row {row} is not the RoPE hf_model/config.json gives (upstream's generator rotates every pair of the full-attention layers, transformers the first {}% of them); the release gets the config's table, {rows} rows, instead",
                path.display(),
                (b.cfg.partial_rotary_factor_full * 100.0).round()
            );
            out.push((spec, Some(rows)));
        }
    }
    Ok(out)
}

/// The layouts of `planned` the build lacks and the release carries, and
/// their packages by name, each chunk checked by `check` first.
fn carried(
    build: &Build,
    planned: &plan::Plan,
    mut check: impl FnMut(LayoutKind, &plan::ChunkPlan) -> Result<()>,
) -> Result<(Vec<Layout>, Vec<String>)> {
    let mut layouts = Vec::new();
    let mut packages = Vec::new();
    for kind in CARRIED_LAYOUTS {
        if build.layout(kind).is_some() {
            continue;
        }
        let l = planned
            .layouts
            .iter()
            .find(|l| l.kind == kind)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("no {kind} layout in the plan"))?;
        for c in &l.chunks {
            check(kind, c)?;
            packages.push(c.name.clone());
        }
        layouts.push(l);
    }
    Ok((layouts, packages))
}

/// Refuses a carried package DIR does not have.
fn missing(pkg: &Path, kind: LayoutKind, c: &plan::ChunkPlan) -> Result<()> {
    if !pkg.is_dir() {
        bail!(
            "{}: missing: the release needs {} ({}), which the build did not make",
            pkg.display(),
            c.name,
            spec(kind).range()
        );
    }
    Ok(())
}
