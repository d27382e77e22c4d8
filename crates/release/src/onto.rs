//! `package --onto DIR`: the run book's workflow (build some packages, put
//! them beside an existing four-chunk folder). The build's packages go into
//! a new release; every file the build lacks (the reference's and the
//! prefill packages, the side files, `hf_model/`) is carried from DIR, an
//! existing chunkforge release (repository or local layout).
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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use chunkforge_model::layouts::{spec, REFERENCE};
use chunkforge_model::plan::{Layout, LayoutKind};

use crate::folder::{FolderKind, ReleaseFolder};
use crate::hashing::{self, FileDigest};
use crate::manifest::{Build, OntoRecord, MANIFEST_FILE};
use crate::paths::HF_MODEL_DIR;
use crate::sidefiles::{self, SIDE_FILES};

/// DIR, checked against a build, and what it carries into the release.
pub struct Onto {
    pub folder: ReleaseFolder,
    /// The layouts the build lacks, planned from the build's config at its
    /// context length with DIR's verify K and prefill lengths.
    pub layouts: Vec<Layout>,
    /// The packages carried, by name.
    pub packages: Vec<String>,
}

/// The layouts every release needs beside its decode layouts: the
/// reference (the runtime's fallback, prefill's KV source) and the prefill
/// packages.
const CARRIED_LAYOUTS: [LayoutKind; 2] = [REFERENCE, LayoutKind::Prefill];

impl Onto {
    /// Opens DIR and checks every file it would carry against `build`.
    pub fn open(dir: &Path, build: &Build) -> Result<Onto> {
        if !dir.join(MANIFEST_FILE).is_file() {
            bail!(
                "{}: --onto takes a chunkforge release (no {MANIFEST_FILE} here); an upstream bundle is not read yet: package it from a chunkforge build instead",
                dir.display()
            );
        }
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
                let pkg = folder.package_dir(&c.name);
                if !pkg.is_dir() {
                    bail!(
                        "{}: missing: the release needs {} ({}), which the build did not make",
                        pkg.display(),
                        c.name,
                        spec(kind).range()
                    );
                }
                folder.check_chunk(&dir.join(MANIFEST_FILE), c)?;
                packages.push(c.name.clone());
            }
            layouts.push(l);
        }
        let onto = Onto {
            folder,
            layouts,
            packages,
        };
        for n in &onto.packages {
            onto.check_package_files(n)?;
        }
        Ok(onto)
    }

    /// Every file of carried package `name` is the one DIR's manifest
    /// lists (its contract there is what was checked), and DIR's manifest
    /// lists no file of it that is missing.
    fn check_package_files(&self, name: &str) -> Result<()> {
        let dir = self.package_dir(name);
        let rel = dir
            .strip_prefix(&self.folder.dir)
            .unwrap_or(&dir)
            .to_string_lossy()
            .into_owned();
        let files = hashing::file_digests(&dir)?;
        let listed: BTreeMap<&str, &crate::manifest::FileEntry> = self
            .folder
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
                    self.folder.dir.join(MANIFEST_FILE).display()
                ),
                None => bail!(
                    "{}: not listed in {}",
                    dir.join(r).display(),
                    self.folder.dir.join(MANIFEST_FILE).display()
                ),
            }
        }
        if let Some(r) = listed.keys().find(|r| !files.contains_key(**r)) {
            bail!(
                "{}: missing ({} lists it)",
                dir.join(r).display(),
                self.folder.dir.join(MANIFEST_FILE).display()
            );
        }
        Ok(())
    }

    /// Carried package `name`'s folder in DIR.
    pub fn package_dir(&self, name: &str) -> PathBuf {
        self.folder.package_dir(name)
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
            .map(|s| (self.folder.side_file(s.name), s.repository_path()))
            .filter(|(src, _)| src.is_file())
            .collect()
    }

    /// The blob of carried package `name` as built, when DIR holds it only
    /// through a share (its manifest's record of the share).
    pub fn held_blob(&self, name: &str) -> Option<FileDigest> {
        let s = self
            .folder
            .manifest
            .shares
            .iter()
            .find(|s| s.package == name)?;
        Some(FileDigest {
            size: s.size,
            sha256: hashing::parse_hex32(&s.sha256)?,
        })
    }

    /// The sha256_tree and weight bytes DIR's manifest records for `name`.
    pub fn chunk_record(&self, name: &str) -> (Option<String>, Option<u64>) {
        self.folder
            .manifest
            .chunk(name)
            .map_or((None, None), |c| (c.sha256_tree.clone(), c.weight_bytes))
    }

    /// What the manifest records about DIR.
    pub fn record(&self) -> OntoRecord {
        let m = &self.folder.manifest;
        OntoRecord {
            model_id: m.model.id.clone(),
            version: m.release.version.clone(),
            layout: match self.folder.kind {
                FolderKind::Repository => "repository".into(),
                FolderKind::Local => "local".into(),
            },
            packages: self.packages.clone(),
        }
    }
}
