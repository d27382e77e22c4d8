//! `chunkforge compile RELEASE --key K` (and `release --compile`): an
//! uncompiled release (Linux: `.mlpackage` at the app's remote paths) turned
//! into the final repository the app downloads, on macOS only.
//!
//! Each package is compiled with coremltools' `get_compiled_model_path()`
//! (text MIL, as upstream does; `xcrun coremlcompiler` writes a binary
//! `model.mil` the iPhone rejects), and exactly the files the app requests
//! ([`downloader::MODELC_FILES`]) are laid out at `swa/chunk1.mlmodelc/…`;
//! a package whose blob the app links or copies in gets none. chunk1's
//! `model.mil` must declare `causal_mask_full` as wide as
//! `model_config.json`'s `context_length`, the way the downloader reads it.
//! The manifest is marked compiled, every file re-hashed and the folder
//! re-signed; the new folder is staged and renamed over the release.
//!
//! THIS PATH CANNOT RUN ON LINUX (Core ML's compiler is part of macOS): there
//! `compile` says so and exits 2 before touching anything. It has not been
//! run on this project's Linux machine; the checks it ends with
//! (`client-check` on the result) are what to run on the Mac.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::client_check::mil_context;
use crate::downloader::{self, COMPILED_BLOB, PACKAGE_BLOB};
use crate::folder::ReleaseFolder;
use crate::hashing::{self, FileDigest};
use crate::manifest::{self, Compiled, Manifest, PredicateSummary, MANIFEST_FILE};
use crate::package::{copy_tree, sign_into, split_output};
use crate::py::calls;
use crate::py::contract::CompileRequest;
use crate::sign::{self, SIG_FILE};
use crate::staging::Staging;

/// Why compiling cannot happen on this platform (None on macOS).
pub fn unsupported() -> Option<String> {
    (!cfg!(target_os = "macos")).then(|| {
        format!(
            "compiling a release needs macOS: coremltools' get_compiled_model_path() calls Core ML's compiler, which only macOS has (this is {}); copy the release to a Mac and run `chunkforge compile RELEASE --key KEY.pem` there",
            std::env::consts::OS
        )
    })
}

/// Compiles the release `dir` in place (staged, renamed when complete) and
/// re-signs it with `key`; returns the number of packages compiled.
pub fn compile_release(dir: &Path, key: &Path, verbose: bool) -> Result<usize> {
    if let Some(why) = unsupported() {
        bail!("{}: {why}", dir.display());
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
    // Everything but the packages to compile, the manifest and the
    // signature, as is (packages carried compiled from an upstream bundle
    // with the rest).
    let packages: Vec<String> = m
        .chunks
        .iter()
        .map(|c| c.file.clone())
        .filter(|f| !f.ends_with(".mlmodelc"))
        .collect();
    let tree = hashing::walk(dir, &|r| {
        r == MANIFEST_FILE
            || r == SIG_FILE
            || packages.iter().any(|p| r.starts_with(&format!("{p}/")))
    })?;
    let sources: Vec<(PathBuf, String)> = tree
        .files
        .iter()
        .map(|r| (dir.join(r), r.clone()))
        .collect();
    let mut files = copy_tree(&root, &sources, &[])?;
    let mut coremltools = String::new();
    for c in &mut m.chunks {
        if c.file.ends_with(".mlmodelc") {
            continue;
        }
        let src = dir.join(&c.file);
        // A package the release holds without its blob (the app shares it
        // in) is compiled from a copy with the blob of the share's source.
        let held = m.shares.iter().find(|s| s.package == c.name && !s.stored);
        let package = match held {
            None => src.clone(),
            Some(s) => {
                let from = dir
                    .join(manifest::package_file(&s.from, false))
                    .join(PACKAGE_BLOB);
                let tmp = work.join(format!("{}.mlpackage", c.name));
                let pkg_tree = hashing::walk(&src, &|_| false)?;
                let mut pairs: Vec<(PathBuf, String)> = pkg_tree
                    .files
                    .iter()
                    .map(|r| (src.join(r), r.clone()))
                    .collect();
                pairs.push((from, PACKAGE_BLOB.to_string()));
                copy_tree(&tmp, &pairs, &[])?;
                tmp
            }
        };
        let file = manifest::package_file(&c.name, true);
        let out = root.join(&file);
        if let Some(p) = out.parent() {
            fs::create_dir_all(p).with_context(|| format!("{}: cannot create", p.display()))?;
        }
        let reply = calls::compile_package(
            &CompileRequest {
                package: &package.to_string_lossy(),
                output: &out.to_string_lossy(),
                files: downloader::MODELC_FILES.to_vec(),
            },
            verbose,
        )?;
        coremltools = reply.coremltools;
        for required in [COMPILED_BLOB, "coremldata.bin", "model.mil"] {
            if reply.absent.iter().any(|a| a == required) {
                bail!(
                    "{}: coremltools' compiled model has no {required}, which the app requests",
                    src.display()
                );
            }
        }
        if held.is_some() {
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
        note: format!(
            "compiled with coremltools {coremltools} get_compiled_model_path() (text MIL) by chunkforge {}",
            env!("CARGO_PKG_VERSION")
        ),
    };
    let base = m.files.iter().find_map(|f| {
        f.url
            .as_deref()
            .and_then(|u| u.strip_suffix(&f.path))
            .map(str::to_string)
    });
    files.sort_by(|a, b| hashing::cmp_components(&a.0, &b.0));
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
