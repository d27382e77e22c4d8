//! `chunkforge verify`: the checks the app's downloader relies on, reported by
//! file name. The signature must verify with the given public key; every file
//! on disk must be exactly the signed list (no changed, missing or extra file,
//! no symlink); every path must be relative and free of `..`; `manifest.json`
//! must agree with the signed list; with `--archive`, the zip must match its
//! digest file and the release, and hold no entry that escapes its folder.
//!
//! A directory signed by `model_signing sign key` (no manifest.json) verifies
//! too: its signature and files are checked the same way. The signature must
//! leave nothing unsigned but itself (and model_signing's default git
//! entries), a manifest.json on disk must be signed, signed paths must stay
//! distinct on a case-insensitive file system, and the signed JSON documents
//! must not repeat a key.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::Result;
use serde_json::Value;

use crate::archive;
use crate::hashing::{self, hex};
use crate::manifest::{self, PredicateSummary, MANIFEST_FILE};
use crate::paths::check_rel_path;
use crate::sign::{self, SIG_FILE};
use crate::strict_json;

/// What `chunkforge verify` checks.
#[derive(Clone, Debug)]
pub struct VerifyArgs {
    /// Release folder (with model.sig).
    pub release_dir: PathBuf,
    /// ECDSA P-256 public key (SubjectPublicKeyInfo PEM).
    pub public_key: PathBuf,
    /// Also check this zip of the release (and FILE.sha256 beside it).
    pub archive: Option<PathBuf>,
}

/// The verdict: what was checked and every problem found.
#[derive(Debug, Default)]
pub struct Report {
    /// The statement's subject name and chunkforge's predicate summary, if any.
    pub model_name: String,
    pub summary: Option<PredicateSummary>,
    pub files: usize,
    pub has_manifest: bool,
    pub problems: Vec<String>,
}

/// What a signature may leave unsigned: `model.sig`, and the git metadata
/// `model_signing sign` puts into `ignore_paths` by default (so folders it
/// signs verify).
const ALLOWED_IGNORES: &[&str] = &[SIG_FILE, ".git", ".gitattributes", ".github", ".gitignore"];

/// True when `rel` is `ig` or lies below it (model_signing's ignore rule).
fn under(rel: &str, ig: &str) -> bool {
    rel == ig || rel.strip_prefix(ig).is_some_and(|r| r.starts_with('/'))
}

pub fn verify(a: &VerifyArgs) -> Result<Report> {
    let dir = &a.release_dir;
    if !dir.is_dir() {
        anyhow::bail!("{}: not a folder", dir.display());
    }
    if let Some(why) = crate::folder::not_a_release(dir, "verify") {
        anyhow::bail!("{}: {why}", dir.display());
    }
    let key = sign::load_public_key(&a.public_key)?;
    Ok(verify_with(dir, &key, a.archive.as_deref()))
}

/// [`verify`] of the release folder `dir` with `key` (and the archive
/// `archive`): what `package --onto` checks DIR with.
pub fn verify_with(dir: &Path, key: &p256::ecdsa::VerifyingKey, zip: Option<&Path>) -> Report {
    let mut r = Report::default();
    let p = &mut r.problems;
    let sig_path = dir.join(SIG_FILE);
    // Never open a model.sig that is not a regular file: opening a FIFO blocks
    // until someone writes to it, and a symlink could point anywhere.
    match std::fs::symlink_metadata(&sig_path).map(|m| m.file_type()) {
        Ok(t) if t.is_symlink() => {
            p.push(format!("{SIG_FILE}: is a symlink"));
            return r;
        }
        Ok(t) if !t.is_file() => {
            p.push(format!("{SIG_FILE}: is not a regular file"));
            return r;
        }
        _ => {}
    }
    let v = match sign::verify_bundle(&sig_path, key) {
        Ok(v) => v,
        Err(e) => {
            p.push(e.to_string());
            return r;
        }
    };

    r.model_name = v.model_name.clone();
    r.summary = PredicateSummary::of_predicate(&v.predicate);
    let p = &mut r.problems;
    // The signed list itself: safe, unique paths.
    let mut signed: BTreeMap<String, [u8; 32]> = BTreeMap::new();
    for res in &v.resources {
        if let Err(why) = check_rel_path(&res.name) {
            p.push(format!("{SIG_FILE}: signed path '{}' {why}", res.name));
            continue;
        }
        if signed.insert(res.name.clone(), res.sha256).is_some() {
            p.push(format!(
                "{SIG_FILE}: signed path '{}' is listed twice",
                res.name
            ));
        }
    }
    for (a, b) in manifest::case_collisions(signed.keys().map(String::as_str)) {
        p.push(format!(
            "{SIG_FILE}: signed paths '{a}' and '{b}' are the same on a case-insensitive file system (as on iOS and macOS); one would overwrite the other"
        ));
    }
    // Whatever ignore_paths covers is left unsigned, so it may cover only the
    // signature itself and the git metadata model_signing leaves out by
    // default; anything else (manifest.json above all) would be trusted
    // unsigned.
    for i in &v.ignore_paths {
        if !ALLOWED_IGNORES.contains(&i.as_str()) {
            p.push(format!(
                "{SIG_FILE}: ignore_paths lists '{i}', which would leave it unsigned; only {} may be",
                ALLOWED_IGNORES.join(", ")
            ));
        }
    }
    let ignore = ALLOWED_IGNORES;

    let tree = match hashing::walk(dir, &|rel| ignore.iter().any(|ig| under(rel, ig))) {
        Ok(t) => t,
        Err(e) => {
            p.push(e.to_string());
            return r;
        }
    };
    for l in &tree.symlinks {
        p.push(format!(
            "{l}: is a symlink (releases must not contain symlinks)"
        ));
    }
    for s in &tree.special {
        p.push(format!("{s}: is not a regular file"));
    }
    for b in &tree.bad_names {
        p.push(format!(
            "{}: file name {}, so it is not one plain path component (not hashed: it names no signed file)",
            b.path, b.why
        ));
    }

    let digests = hashing::hash_all(dir, &tree.files);
    let mut actual: BTreeMap<String, hashing::FileDigest> = BTreeMap::new();
    for (rel, d) in tree.files.iter().zip(digests) {
        match d {
            Ok(d) => {
                actual.insert(rel.clone(), d);
            }
            Err(e) => p.push(e.to_string()),
        }
    }
    r.files = actual.len();
    let mut missing = Vec::new();
    for (name, want) in &signed {
        match actual.get(name) {
            Some(d) if d.sha256 != *want => p.push(format!(
                "{name}: changed (sha256 {}, signed {})",
                d.hex(),
                hex(want)
            )),
            Some(_) => {}
            None if tree.symlinks.contains(name) => {}
            None => missing.push(name.clone()),
        }
    }
    let extra: Vec<&String> = actual.keys().filter(|k| !signed.contains_key(*k)).collect();
    // A missing and an extra file with the same contents is a rename; say so.
    let mut explained = BTreeSet::new();
    for m in &missing {
        let renamed_to = extra
            .iter()
            .find(|e| !explained.contains(**e) && actual[**e].sha256 == signed[m]);
        match renamed_to {
            Some(e) => {
                explained.insert((*e).clone());
                p.push(format!(
                    "{m}: missing (renamed to {e}? same contents; {e} is not signed)"
                ));
            }
            None => p.push(format!("{m}: missing (signed, not on disk)")),
        }
    }
    for e in extra {
        if e == MANIFEST_FILE {
            p.push(format!(
                "{MANIFEST_FILE}: is not among the signed files; the signature must cover it"
            ));
        } else if !explained.contains(e) {
            p.push(format!("{e}: extra file (on disk, not in the signature)"));
        }
    }

    // manifest.json must describe exactly the signed files (except itself).
    let mpath = dir.join(MANIFEST_FILE);
    if signed.contains_key(MANIFEST_FILE) || mpath.is_file() {
        r.has_manifest = true;
        // A manifest.json that is a symlink, FIFO or folder is not opened:
        // reading it could block forever (FIFO) or read anything (a symlink
        // to /dev/zero).
        let not_a_file = std::fs::symlink_metadata(&mpath).is_ok_and(|m| !m.file_type().is_file());
        if not_a_file {
            p.push(format!(
                "{MANIFEST_FILE}: is not a regular file, so it was not read"
            ));
        } else {
            check_manifest(&mpath, &signed, &actual, p);
        }
    }

    if let Some(zip) = zip {
        let (entries, mut zp) = archive::check(zip);
        p.append(&mut zp);
        let mut expected: Vec<(String, [u8; 32])> =
            signed.iter().map(|(k, d)| (k.clone(), *d)).collect();
        match hashing::hash_file(&sig_path) {
            Ok(d) => expected.push((SIG_FILE.to_string(), d.sha256)),
            Err(e) => p.push(e.to_string()),
        }
        p.extend(archive::compare(zip, &entries, &expected));
    }
    r
}

/// Checks `manifest.json` at `mpath` against the signed list and the files
/// on disk, appending every problem to `p`. Public for the fuzz targets.
pub fn check_manifest(
    mpath: &Path,
    signed: &BTreeMap<String, [u8; 32]>,
    actual: &BTreeMap<String, hashing::FileDigest>,
    p: &mut Vec<String>,
) {
    let m: Value = match std::fs::read_to_string(mpath)
        .map_err(|e| e.to_string())
        .and_then(|t| strict_json::from_str(&t).map_err(|e| e.to_string()))
    {
        Ok(m) => m,
        Err(e) => {
            p.push(format!("{MANIFEST_FILE}: cannot be read as JSON ({e})"));
            return;
        }
    };
    let format = manifest::LenientManifest::of(&m).format;
    if format != manifest::FORMAT {
        p.push(format!(
            "{MANIFEST_FILE}: format is {format}, expected \"{}\"",
            manifest::FORMAT
        ));
    }
    let (files, mut bad) = manifest::manifest_files(&m);
    p.append(&mut bad);
    let mut listed = BTreeSet::new();
    for (path, size, sha) in &files {
        if let Err(why) = check_rel_path(path) {
            p.push(format!("{MANIFEST_FILE}: file entry '{path}' {why}"));
            continue;
        }
        if !listed.insert(path.as_str()) {
            p.push(format!(
                "{MANIFEST_FILE}: file entry '{path}' is listed twice"
            ));
            continue;
        }
        if path == MANIFEST_FILE || path == SIG_FILE {
            p.push(format!(
                "{MANIFEST_FILE}: lists '{path}', which cannot describe itself"
            ));
            continue;
        }
        match signed.get(path) {
            None => p.push(format!(
                "{MANIFEST_FILE}: lists '{path}', which the signature does not"
            )),
            Some(d) if hex(d) != sha.to_ascii_lowercase() => p.push(format!(
                "{MANIFEST_FILE}: '{path}' has sha256 {sha}, the signature says {}",
                hex(d)
            )),
            Some(_) => {}
        }
        if let Some(a) = actual.get(path) {
            if a.size != *size {
                p.push(format!(
                    "{MANIFEST_FILE}: '{path}' has size {size}, the file has {}",
                    a.size
                ));
            }
        }
    }
    for s in signed.keys() {
        if s != MANIFEST_FILE && !listed.contains(s.as_str()) {
            p.push(format!(
                "{MANIFEST_FILE}: does not list '{s}', which the signature does"
            ));
        }
    }
    check_other_paths(&m, signed, p);
    check_shares(&m, actual, p);
}

/// The manifest's other paths stay in the folder: each `chunks[].file` is
/// its package's folder there ([`manifest::check_package_file`]: never
/// absolute, never `..`) holding signed files, each `shared_blobs[].paths`
/// entry a safe relative path. `run`, `client-check` and `package --onto`
/// read packages where `chunks[].file` says.
fn check_other_paths(m: &Value, signed: &BTreeMap<String, [u8; 32]>, p: &mut Vec<String>) {
    let chunks = m.get("chunks").and_then(Value::as_array);
    for (i, c) in chunks.into_iter().flatten().enumerate() {
        let text = |k: &str| c.get(k).and_then(Value::as_str);
        let (Some(name), Some(file)) = (text("name"), text("file")) else {
            p.push(format!(
                "{MANIFEST_FILE}: chunks[{i}] needs a name and a file"
            ));
            continue;
        };
        match manifest::check_package_file(name, file) {
            Err(e) => p.push(format!("{MANIFEST_FILE}: chunks[{i}].file {e}")),
            Ok(()) => {
                let inside = format!("{file}/");
                if !signed.keys().any(|k| k.starts_with(&inside)) {
                    p.push(format!(
                        "{MANIFEST_FILE}: chunks[{i}].file '{file}' holds no signed file"
                    ));
                }
            }
        }
    }
    let blobs = m.get("shared_blobs").and_then(Value::as_array);
    for (i, b) in blobs.into_iter().flatten().enumerate() {
        let paths = b.get("paths").and_then(Value::as_array);
        for path in paths.into_iter().flatten() {
            let Some(path) = path.as_str() else { continue };
            if let Err(why) = check_rel_path(path) {
                p.push(format!(
                    "{MANIFEST_FILE}: shared_blobs[{i}].paths: '{path}' {why}"
                ));
            } else if !signed.contains_key(path) {
                p.push(format!(
                    "{MANIFEST_FILE}: shared_blobs[{i}].paths: '{path}' is not a signed file"
                ));
            }
        }
    }
}

/// The weight blobs the app's downloader links or copies between packages
/// (the manifest's `shares`): each source must be in the folder with the
/// package's blob's digest, and so must the package's own where the release
/// holds it, or prefill reads another program's weights on the phone. Each
/// problem names both files.
fn check_shares(m: &Value, actual: &BTreeMap<String, hashing::FileDigest>, p: &mut Vec<String>) {
    let (shares, mut bad) = manifest::manifest_shares(m);
    p.append(&mut bad);
    for s in shares {
        let mut pairs = vec![(&s.from_blob, "the app links or copies it")];
        if s.stored {
            pairs.push((&s.blob, "the release holds it"));
        }
        for (path, why) in pairs {
            match actual.get(path) {
                None => p.push(format!(
                    "{} <- {}: the app's downloader gives the first the second's weight blob ({}), and {path} is missing",
                    s.blob, s.from_blob, s.by
                )),
                Some(d) if d.hex() != s.sha256 => p.push(format!(
                    "{} <- {}: {path} ({why}) has sha256 {}, but the blob the app's downloader shares ({}) must be {}",
                    s.blob,
                    s.from_blob,
                    d.hex(),
                    s.by,
                    s.sha256
                )),
                Some(_) => {}
            }
        }
    }
}
