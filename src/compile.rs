//! `chunkforge compile RELEASE --key K` (and `release --compile`): an
//! uncompiled release (`.mlpackage` at the app's remote paths) turned into
//! the final repository the app downloads, on any platform.
//!
//! Each package becomes exactly the files the app requests
//! ([`downloader::MODELC_FILES`]) at `swa/chunk1.mlmodelc/…`; a package whose
//! blob the app links or copies in gets none. Two writers ([`Writer`]):
//!
//! - **chunkforge** (Linux, and any platform): `mil/modelc.py` writes text
//!   `model.mil` (`program(1.3)`), `coremldata.bin`, `metadata.json` and
//!   `analytics/coremldata.bin` from the package's spec file, in the form
//!   Apple's compiler wrote for the `mlmodelc-export` crate's fixtures
//!   (`python/tests/test_mlmodelc.py` matches every one), and refuses any op,
//!   type or value it has no text form for, naming package, function and op.
//!   Each `model.mil` is parsed back and must equal the package's program.
//!   `weights/weight.bin` is the package's blob unchanged: hard-linked, or
//!   copied by the kernel where no link can be made, never read into memory.
//! - **coremltools** (macOS): `get_compiled_model_path()`, Core ML's own
//!   compiler, as upstream does (text MIL; `xcrun coremlcompiler` writes a
//!   binary `model.mil` the iPhone rejects). It stays the reference:
//!   `compile --check` compiles both ways and fails naming the first file
//!   and line or byte where they differ.
//!
//! chunk1's `model.mil` must declare `causal_mask_full` as wide as
//! `model_config.json`'s `context_length`, the way the downloader reads it.
//! The manifest records who compiled (`compiled.by`) and that no device has
//! loaded the result (`compiled.device_verified: false`); `DEVICE_RUNBOOK.md`
//! and `distribution.json` are made again for the compiled layout, every
//! file re-hashed and the folder re-signed; the new folder is staged and
//! renamed over the release.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::client_check::mil_context;
use crate::downloader::{self, COMPILED_BLOB, PACKAGE_BLOB};
use crate::folder::ReleaseFolder;
use crate::hashing::{self, FileDigest};
use crate::manifest::{self, Compiled, Manifest, PredicateSummary, MANIFEST_FILE};
use crate::package::{copy_tree, sign_into, split_output, write_json, write_runbook};
use crate::paths::{DISTRIBUTION_FILE, RUNBOOK_FILE};
use crate::py::calls;
use crate::py::contract::CompileRequest;
use crate::sign::{self, SIG_FILE};
use crate::staging::Staging;
use chunkforge_release::distribution::Distribution;

/// What writes the `.mlmodelc` files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Writer {
    /// chunkforge's own writer (`mil/modelc.py`), on any platform.
    Chunkforge,
    /// Core ML's compiler through coremltools (macOS only).
    Coremltools,
    /// Both, compared file by file; Core ML's files are kept (macOS only).
    Check,
}

impl Writer {
    /// The writer `compile` uses here: Core ML's compiler on macOS (the
    /// reference), chunkforge's elsewhere; `check` asks for both.
    pub fn for_platform(check: bool) -> Writer {
        match (cfg!(target_os = "macos"), check) {
            (_, true) => Writer::Check,
            (true, false) => Writer::Coremltools,
            (false, false) => Writer::Chunkforge,
        }
    }

    /// Its name in the request to Python.
    pub fn name(self) -> &'static str {
        match self {
            Writer::Chunkforge => "chunkforge",
            Writer::Coremltools => "coremltools",
            Writer::Check => "check",
        }
    }

    /// What `manifest.json` says compiled the release.
    fn by(self, coremltools: &str) -> String {
        let version = env!("CARGO_PKG_VERSION");
        match self {
            Writer::Chunkforge => format!(
                "chunkforge {version}: its own .mlmodelc writer (text MIL in the form of coremlc {}), on {}",
                COREMLC_FORM,
                std::env::consts::OS
            ),
            Writer::Coremltools | Writer::Check => format!(
                "Core ML's compiler, through coremltools {coremltools} get_compiled_model_path() (text MIL), by chunkforge {version}{}",
                if self == Writer::Check {
                    "; chunkforge's own writer made the same files (compile --check)"
                } else {
                    ""
                }
            ),
        }
    }
}

/// The coremlc build whose text form chunkforge's writer reproduces
/// (`mil/text.py` `COREMLC_BUILD`).
pub const COREMLC_FORM: &str = "3520.5.1";

/// Why `compile --check` cannot run on this platform (None on macOS).
pub fn check_unsupported() -> Option<String> {
    (!cfg!(target_os = "macos")).then(|| {
        format!(
            "--check compares chunkforge's .mlmodelc with Core ML's own compiler, which only macOS has (this is {}); `chunkforge compile` without --check writes the .mlmodelc here with chunkforge's writer",
            std::env::consts::OS
        )
    })
}

/// Whether the release file `rel` (digest `d`) is in the manifest as it is:
/// `compile` signs again only what the release signed.
fn as_listed(m: &Manifest, dir: &Path, rel: &str, d: &FileDigest) -> Result<()> {
    match m.files.iter().find(|f| f.path == rel) {
        Some(f) if f.size == d.size && f.sha256 == d.hex() => Ok(()),
        Some(_) => bail!(
            "{}: differs from manifest.json's digest: compile signs the release again, so it takes only the files the release signed (`chunkforge verify` names every difference)",
            dir.join(rel).display()
        ),
        None => bail!(
            "{}: not in manifest.json: compile signs the release again, so it takes only the files the release signed",
            dir.join(rel).display()
        ),
    }
}

/// `path`'s blob as `to`: a hard link, or where none can be made (another
/// file system) a copy the kernel streams; never read into memory here.
fn link_or_stream(from: &Path, to: &Path) -> Result<()> {
    if let Some(p) = to.parent() {
        fs::create_dir_all(p).with_context(|| format!("{}: cannot create", p.display()))?;
    }
    if fs::hard_link(from, to).is_err() {
        fs::copy(from, to)
            .with_context(|| format!("{}: cannot copy to {}", from.display(), to.display()))?;
    }
    Ok(())
}

/// Compiles the release `dir` in place (staged, renamed when complete) with
/// `writer` and re-signs it with `key`; returns the number of packages compiled.
pub fn compile_release(dir: &Path, key: &Path, writer: Writer, verbose: bool) -> Result<usize> {
    if writer != Writer::Chunkforge {
        if let Some(why) = check_unsupported() {
            bail!("{}: {why}", dir.display());
        }
    }
    let signing_key = sign::load_private_key(key)?;
    let folder = ReleaseFolder::open(dir)?;
    folder.check_files()?;
    let mut m: Manifest = folder.manifest.clone();
    if m.compiled.mlmodelc {
        bail!(
            "{}: already compiled (manifest.json compiled.mlmodelc)",
            dir.display()
        );
    }
    crate::py::env::activate(verbose)?;
    let (parent, name) = split_output(dir)?;
    let staging = Staging::new(&parent)?;
    let root = staging.dir.join(&name);
    fs::create_dir(&root).with_context(|| format!("{}: cannot create", root.display()))?;
    let work = staging.dir.join("packages");
    // Everything but the packages to compile, the manifest, the signature
    // and what is made again for the compiled layout (the run book,
    // distribution.json), as is (packages carried compiled from an upstream
    // bundle with the rest).
    let packages: Vec<String> = m
        .chunks
        .iter()
        .map(|c| c.file.clone())
        .filter(|f| !f.ends_with(".mlmodelc"))
        .collect();
    let tree = hashing::walk(dir, &|r| {
        r == MANIFEST_FILE
            || r == SIG_FILE
            || r == RUNBOOK_FILE
            || r == DISTRIBUTION_FILE
            || packages.iter().any(|p| r.starts_with(&format!("{p}/")))
    })?;
    let sources: Vec<(PathBuf, String)> = tree
        .files
        .iter()
        .map(|r| (dir.join(r), r.clone()))
        .collect();
    let mut files = copy_tree(&root, &sources, &[])?;
    // compile re-signs: only what the release's manifest lists, as it lists it.
    for (rel, d) in &files {
        as_listed(&m, dir, rel, d)?;
    }
    for c in m.chunks.iter().filter(|c| !c.file.ends_with(".mlmodelc")) {
        let pkg = dir.join(&c.file);
        for rel in hashing::walk(&pkg, &|_| false)?.files {
            let path = format!("{}/{rel}", c.file);
            as_listed(&m, dir, &path, &hashing::hash_file(&dir.join(&path))?)?;
        }
    }
    let mut coremltools = String::new();
    for c in &mut m.chunks {
        if c.file.ends_with(".mlmodelc") {
            continue;
        }
        let src = dir.join(&c.file);
        // chunkforge's writer reads the spec alone, from the release. Core
        // ML's compiler gets a copy (coremltools' MLModel(path) rewrites the
        // package's Manifest.json, and the release stays untouched until the
        // new one is published) with the blob linked in: its own, or for a
        // package the release holds without one, its share source's.
        let held = m.shares.iter().find(|s| s.package == c.name && !s.stored);
        let package = if writer == Writer::Chunkforge {
            src.clone()
        } else {
            let from = match held {
                Some(s) => dir
                    .join(manifest::package_file(&s.from, false))
                    .join(PACKAGE_BLOB),
                None => src.join(PACKAGE_BLOB),
            };
            let tmp = work.join(format!("{}.mlpackage", c.name));
            let pkg_tree = hashing::walk(&src, &|r| r == PACKAGE_BLOB)?;
            let pairs: Vec<(PathBuf, String)> = pkg_tree
                .files
                .iter()
                .map(|r| (src.join(r), r.clone()))
                .collect();
            copy_tree(&tmp, &pairs, &[])?;
            link_or_stream(&from, &tmp.join(PACKAGE_BLOB))?;
            tmp
        };
        let file = manifest::package_file(&c.name, true);
        let out = root.join(&file);
        if let Some(p) = out.parent() {
            fs::create_dir_all(p).with_context(|| format!("{}: cannot create", p.display()))?;
        }
        let mut reply = calls::compile_package(
            &CompileRequest {
                package: &package.to_string_lossy(),
                output: &out.to_string_lossy(),
                files: downloader::MODELC_FILES.to_vec(),
                writer: writer.name(),
                name: &c.name,
            },
            verbose,
        )?;
        coremltools = std::mem::take(&mut reply.coremltools);
        if writer == Writer::Chunkforge && held.is_none() {
            // The package's blob, unchanged.
            link_or_stream(&src.join(PACKAGE_BLOB), &out.join(COMPILED_BLOB))?;
            reply.absent.retain(|a| a != COMPILED_BLOB);
            reply.written.push(COMPILED_BLOB.to_string());
        }
        for required in [COMPILED_BLOB, "coremldata.bin", "model.mil"] {
            if reply.absent.iter().any(|a| a == required)
                && !(held.is_some() && required == COMPILED_BLOB)
            {
                bail!(
                    "{}: coremltools' compiled model has no {required}, which the app requests",
                    src.display()
                );
            }
        }
        if held.is_some() && out.join(COMPILED_BLOB).exists() {
            fs::remove_file(out.join(COMPILED_BLOB))
                .with_context(|| format!("{}: cannot remove", out.join(COMPILED_BLOB).display()))?;
        }
        for w in &reply.written {
            if !(held.is_some() && w == COMPILED_BLOB) {
                let rel = format!("{file}/{w}");
                files.push((rel.clone(), hashing::hash_file(&root.join(&rel))?));
            }
        }
        c.file = file;
    }
    // The downloader's context check, on the file it reads.
    let first = &m
        .chunks
        .iter()
        .find(|c| c.name == "chunk1")
        .map(|c| c.file.clone());
    let mil = root
        .join(first.as_deref().unwrap_or("swa/chunk1.mlmodelc"))
        .join("model.mil");
    let text = fs::read(&mil).with_context(|| format!("{}: cannot read", mil.display()))?;
    let text = std::str::from_utf8(&text).map_err(|_| {
        anyhow::anyhow!(
            "{}: not text MIL: the iPhone rejects a binary model.mil",
            mil.display()
        )
    })?;
    match mil_context(text) {
        Some(n) if n == folder.context_length => {}
        got => bail!(
            "{}: causal_mask_full is {got:?} wide, model_config.json's context_length is {}: the downloader would delete the folder",
            mil.display(),
            folder.context_length
        ),
    }
    // The shares now hold between compiled blobs.
    for s in &mut m.shares {
        let from = root
            .join(manifest::package_file(&s.from, true))
            .join(COMPILED_BLOB);
        let d = hashing::hash_file(&from)?;
        let own = root
            .join(manifest::package_file(&s.package, true))
            .join(COMPILED_BLOB);
        if own.is_file() && hashing::hash_file(&own)?.hex() != d.hex() {
            bail!(
                "{} and {}: the compiled blobs differ; the app's download shares one for the other",
                from.display(),
                own.display()
            );
        }
        s.sha256 = d.hex();
        s.size = d.size;
    }
    m.compiled = Compiled {
        mlmodelc: true,
        note: "compiled .mlmodelc at the app's paths; no device has loaded them yet: DEVICE_RUNBOOK.md's first step loads every function on the phone".into(),
        by: Some(writer.by(&coremltools)),
        device_verified: false,
    };
    let base = m.files.iter().find_map(|f| {
        f.url
            .as_deref()
            .and_then(|u| u.strip_suffix(&f.path))
            .map(str::to_string)
    });
    // The run book and distribution.json, made again for the compiled layout.
    files.push(write_runbook(&root, &m)?);
    files.sort_by(|a, b| hashing::cmp_components(&a.0, &b.0));
    if let Some(base) = base.as_deref() {
        let d = Distribution::of(&files, base, &m.release.version, &m.model.id);
        files.push(write_json(&root, DISTRIBUTION_FILE, &d)?);
        files.sort_by(|a, b| hashing::cmp_components(&a.0, &b.0));
    }
    // Files carried from --onto's folder (and still there as they were) stay marked.
    let carried: Vec<(String, String)> = m
        .files
        .iter()
        .filter(|f| f.carried)
        .map(|f| (f.path.clone(), f.sha256.clone()))
        .collect();
    m.list_files(&files, base.as_deref());
    for f in &mut m.files {
        f.carried = carried.iter().any(|(p, h)| *p == f.path && *h == f.sha256);
    }
    let mut text = serde_json::to_string_pretty(&m)?;
    text.push('\n');
    fs::write(root.join(MANIFEST_FILE), &text)?;
    let digest = FileDigest {
        size: text.len() as u64,
        sha256: Sha256::digest(text.as_bytes()).into(),
    };
    let mut signed = files;
    signed.push((MANIFEST_FILE.to_string(), digest));
    let bytes = signed.iter().map(|(_, d)| d.size).sum();
    let summary = PredicateSummary {
        format: manifest::FORMAT.into(),
        model_id: m.model.id.clone(),
        version: m.release.version.clone(),
        layout: m.release.layout,
        packages: m.chunks.iter().map(|c| c.file.clone()).collect(),
        manifest_sha256: digest.hex(),
        files: signed.len(),
        bytes,
    };
    sign_into(&root, &name, &signing_key, &signed, Some(summary))?;
    let _ = fs::remove_dir_all(&work);
    staging.publish(&[(root, dir.to_path_buf())])?;
    staging.finish()?;
    Ok(m.chunks.len())
}
