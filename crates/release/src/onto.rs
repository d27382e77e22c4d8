//! `package --onto DIR`: the run book's workflow (build some packages, put
//! them beside an existing four-chunk folder). The build's packages go into
//! a new release; every file the build lacks (the reference's and the
//! prefill packages, the side files, `hf_model/`) is carried from DIR, an
//! existing chunkforge release (repository or local layout), or an upstream
//! bundle ([`crate::bundle`]: compiled `.mlmodelc`, no manifest).
//!
//! A release is carried only once its signature verifies ([`Trust`]: with
//! `--onto-public-key`, else the public key of the key the new release is
//! signed with) and every file against its signed digest, as `verify` does;
//! `--allow-unverified-onto` carries it unverified, each file checked
//! against DIR's own `manifest.json` only, and the new manifest records
//! that (`onto.verified` false). DIR is read only where it holds no
//! symlink and no name that is not a plain path component.
//!
//! Before anything is written, each carried file is checked against the
//! build, in this order, and the first that disagrees is named:
//! `hf_model/config.json` (the build's config.json digest, and the one DIR's
//! manifest records), the weights digest DIR's manifest records (build.json's:
//! the same config.json with other weights is another model), `model_config.json`
//! (vocabulary, widths and `context_length` of the build's plan), the side
//! files (the sizes the config implies, and DIR's manifest digests:
//! `ReleaseFolder::check_files`), `hf_model/`'s other files (DIR's manifest
//! digests), then each carried package (its contract as DIR's manifest
//! states it, equal to the plan of the build's config at the build's context
//! length; its files equal to DIR's manifest). `package` compares each
//! carried file once more as it copies it.
//!
//! An upstream bundle is signed by no one and records nothing, so only what
//! can be checked against the build's config and contracts is carried from
//! it: its packages, each one's `model.mil` stating the plan's contract
//! function by function (their weights cannot be checked, which a note
//! says). Its `hf_model/config.json` must plan the build's model (the same
//! dimensions), its `model_config.json` the build's context length; the
//! side files and `hf_model/` of the release are made from the build's
//! checkpoint, as without `--onto`. Its packages stay compiled in the
//! release (the manifest lists them as `.mlmodelc`); `chunkforge compile` on
//! macOS compiles the build's packages beside them.

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
use crate::paths::{HF_MODEL_DIR, HF_MODEL_FILES};
use crate::sidefiles::{self, SIDE_FILES};
use crate::verify;

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
    /// The SHA-256 (hex) of the public key (PEM) DIR's signature verified
    /// with; None: not verified (`--allow-unverified-onto`, or an upstream
    /// bundle, which has no signature).
    pub verified_key: Option<String>,
}

/// How `package --onto` takes DIR's signature.
pub enum Trust {
    /// Verify it (and every file against its signed digest) with `key`;
    /// `from` says where the key came from, for messages.
    Key {
        key: p256::ecdsa::VerifyingKey,
        from: String,
    },
    /// `--allow-unverified-onto`: carry DIR unverified, each file checked
    /// against DIR's own (unsigned) manifest only.
    Unverified,
}

/// The layouts every release needs beside its decode layouts: the
/// reference (the runtime's fallback, prefill's KV source) and the prefill
/// packages.
const CARRIED_LAYOUTS: [LayoutKind; 2] = [REFERENCE, LayoutKind::Prefill];

impl Onto {
    /// Opens DIR and checks every file it would carry against `build`,
    /// DIR's signature first as `trust` says.
    pub fn open(dir: &Path, build: &Build, trust: &Trust) -> Result<Onto> {
        if dir.join(MANIFEST_FILE).is_file() {
            return Self::open_release(dir, build, trust);
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

    fn open_release(dir: &Path, build: &Build, trust: &Trust) -> Result<Onto> {
        let folder = ReleaseFolder::open(dir)?;
        let verified_key = check_signature(dir, trust)?;
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
        check_weights(dir, &folder, build)?;
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
        check_hf_model(&folder)?;
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
            verified_key,
        };
        for n in &onto.packages {
            onto.check_package_files(n)?;
        }
        Ok(onto)
    }

    /// An upstream bundle against `build`: its config plans the build's
    /// model at the build's context length, and each package it carries
    /// states the plan's contract in its `model.mil`.
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
        let encoders = downloader::all_encoder_files()
            .iter()
            .any(|e| b.dir.join(e.path).exists());
        eprintln!(
            "note: {}: an upstream bundle (no manifest, no signature): only its packages are carried, each checked against the build's contracts through its model.mil (their weights cannot be checked: nothing records them); the side files and hf_model/ are made from the build's checkpoint{}",
            b.dir.display(),
            if encoders {
                "; its encoders only with --encoders-from (nothing checks them)"
            } else {
                ""
            }
        );
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
            verified_key: None,
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

    /// The side files DIR carries: (source, path in the release). An
    /// upstream bundle carries none (they are made from the checkpoint).
    pub fn side_files(&self) -> Vec<(PathBuf, String)> {
        let Source::Release(f) = &self.source else {
            return Vec::new();
        };
        SIDE_FILES
            .iter()
            .map(|s| (f.side_file(s.name), s.repository_path()))
            .filter(|(src, _)| src.is_file())
            .collect()
    }

    /// The size and SHA-256 (hex) DIR's manifest gives the file `src` of
    /// DIR (signed, when DIR was verified): its entry in `files`, found by
    /// its repository path in a local-layout DIR too, or for a package's
    /// weight blob DIR's manifest holds back, the digest its `shares`
    /// record. None for an upstream bundle, which records nothing. `Err`: a
    /// release that gives it none.
    pub fn listed(&self, src: &Path) -> Result<Option<(u64, String)>> {
        let Source::Release(f) = &self.source else {
            return Ok(None);
        };
        let rel = src.strip_prefix(&f.dir).unwrap_or(src).to_string_lossy();
        let m = &f.manifest;
        // A package's file, under its release path or its local name.
        let in_package = m.chunks.iter().find_map(|c| {
            [c.file.clone(), format!("{}.mlpackage", c.name)]
                .iter()
                .find_map(|d| rel.strip_prefix(&format!("{d}/")))
                .map(|inner| (c, inner.to_string()))
        });
        let side = SIDE_FILES
            .iter()
            .find(|s| s.name == rel)
            .map(|s| s.repository_path());
        let found = f
            .listed(&rel)
            .or_else(|| {
                let (c, inner) = in_package.as_ref()?;
                f.listed(&format!("{}/{inner}", c.file))
            })
            .or_else(|| side.and_then(|p| f.listed(&p)))
            .or_else(|| {
                let (c, inner) = in_package.as_ref()?;
                (inner == downloader::PACKAGE_BLOB)
                    .then(|| m.shares.iter().find(|s| s.package == c.name))
                    .flatten()
                    .map(|s| (s.size, s.sha256.clone()))
            });
        match found {
            Some(d) => Ok(Some(d)),
            None => bail!(
                "{}: not listed in {}, so nothing says what it should hold; --onto carries only the files DIR's manifest lists",
                src.display(),
                f.dir.join(MANIFEST_FILE).display()
            ),
        }
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
                verified: self.verified_key.is_some(),
                public_key_sha256: self.verified_key.clone(),
            },
            Source::Upstream(b) => OntoRecord {
                model_id: b.model_name.clone(),
                version: None,
                layout: layout(b.kind).into(),
                upstream: true,
                packages: self.packages.clone(),
                verified: false,
                public_key_sha256: None,
            },
        }
    }
}

/// DIR's signature and every file against its signed digest, as `verify`
/// checks them, with `trust`'s key; returns the key's SHA-256 (None:
/// `--allow-unverified-onto`, said in a warning).
fn check_signature(dir: &Path, trust: &Trust) -> Result<Option<String>> {
    let (key, from) = match trust {
        Trust::Key { key, from } => (key, from),
        Trust::Unverified => {
            eprintln!(
                "warning: {}: its signature is not verified (--allow-unverified-onto): each carried file is checked against its {MANIFEST_FILE} only, which anyone could have rewritten; the new release's manifest records it as unverified (onto.verified false)",
                dir.display()
            );
            return Ok(None);
        }
    };
    let report = verify::verify_with(dir, key, None);
    if !report.problems.is_empty() {
        let n = report.problems.len();
        let shown: Vec<&str> = report.problems.iter().take(5).map(String::as_str).collect();
        bail!(
            "{}: does not verify with {from} ({n} problem{}: {}{}); --onto carries only a release whose signature and files verify: give the key it was signed with (--onto-public-key PUB), or pass --allow-unverified-onto to carry it unverified (recorded in the manifest)",
            dir.display(),
            if n == 1 { "" } else { "s" },
            shown.join("; "),
            if n > shown.len() { "; ..." } else { "" }
        );
    }
    Ok(Some(crate::sign::key_hint(key)))
}

/// DIR's packages were made from the build's weights: the digest DIR's
/// manifest records (`model.weights_sha256`) is build.json's. The same
/// config.json with other weights (a fine-tune, another seed) is another
/// model, whose packages would compute other tokens beside the build's.
fn check_weights(dir: &Path, folder: &ReleaseFolder, build: &Build) -> Result<()> {
    let manifest = dir.join(MANIFEST_FILE);
    let record = build.dir.join("build.json");
    let want = build.record.checkpoint.weights.as_ref().map(|w| &w.sha256);
    match (folder.manifest.model.weights_sha256.as_ref(), want) {
        (Some(got), Some(want)) if got == want => Ok(()),
        (Some(got), Some(want)) => bail!(
            "{}: model.weights_sha256 is {got}, but {} records the build's weights as {want}: DIR's packages were made from other weights with the same config.json; --onto needs a release of the build's weights",
            manifest.display(),
            record.display()
        ),
        (None, _) => bail!(
            "{}: records no model.weights_sha256 (packaged before chunkforge recorded the weights), so nothing ties its packages to the build's weights; package it again with this chunkforge",
            manifest.display()
        ),
        (_, None) => bail!(
            "{}: records no checkpoint.weights (built before chunkforge recorded them), so DIR's packages cannot be tied to the build's weights; rebuild",
            record.display()
        ),
    }
}

/// Every `hf_model/` file DIR holds that a release ships is listed in its
/// manifest with that size and digest (`check_files` covers config.json
/// and the tokenizer; this, the rest: tokenizer_config.json,
/// generation_config.json, chat_template.jinja, ...).
fn check_hf_model(folder: &ReleaseFolder) -> Result<()> {
    for name in HF_MODEL_FILES {
        let rel = format!("{HF_MODEL_DIR}/{name}");
        let path = folder.dir.join(&rel);
        if !path.is_file() {
            continue;
        }
        let d = hashing::hash_file(&path)?;
        match folder.listed(&rel) {
            Some((size, sha)) if size == d.size && sha == d.hex() => {}
            Some(_) => bail!(
                "{}: differs from what {} lists (changed after packaging)",
                path.display(),
                folder.dir.join(MANIFEST_FILE).display()
            ),
            None => bail!(
                "{}: not listed in {} (added after packaging); --onto carries only the files DIR's manifest lists",
                path.display(),
                folder.dir.join(MANIFEST_FILE).display()
            ),
        }
    }
    Ok(())
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
