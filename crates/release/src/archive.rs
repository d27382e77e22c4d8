//! The release as one deterministic zip: entries are the release's files
//! (paths relative to the release folder, no directory entries) in path
//! component order, every timestamp 1980-01-01 00:00:00, mode 0644, every
//! entry stored (method 0): the app's iOS extractor (ModelDownloader.swift's
//! `extractZipNative`) copies each entry's `uncompSize` raw bytes from its
//! local header's data offset without inflating, so a deflated entry would
//! arrive corrupted. It reads sizes and offsets as 32-bit and the entry count
//! as 16-bit (no zip64), so an archive it cannot read is refused
//! ([`check_app_extractable`]). Beside it, `FILE.sha256` in `sha256sum` format.
//!
//! The archive is the release as it is (the repository layout), for mirrors
//! and `verify --archive`. The app's own zip route cannot take it
//! ([`app_route`] says why): it aborts any archive over
//! [`downloader::ARCHIVE_LIMIT`] bytes, and after extracting one it looks
//! for `chunk1.mlmodelc/weights/weight.bin` at the folder's root (the local
//! names, compiled), where a release has `swa/chunk1.mlpackage`.

use std::fs::{self, File};
use std::io::{self, BufWriter};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use zip::write::SimpleFileOptions;
use zip::{CompressionMethod, DateTime, ZipWriter};

use crate::downloader;
use crate::hashing::{self, hex};
use crate::zipwalk;

/// `FILE.sha256` for `FILE`.
pub fn digest_path(zip: &Path) -> PathBuf {
    let mut s = zip.as_os_str().to_owned();
    s.push(".sha256");
    PathBuf::from(s)
}

/// One `sha256sum`-style line.
pub fn digest_line(digest: &str, file_name: &str) -> String {
    format!("{digest}  {file_name}\n")
}

/// The options of an entry of `len` bytes: fixed time and mode, stored,
/// zip64 fields only for a file that needs them (which
/// [`check_app_extractable`] refuses first).
pub fn entry_options(len: u64) -> SimpleFileOptions {
    SimpleFileOptions::default()
        .last_modified_time(DateTime::default()) // 1980-01-01 00:00:00, the zip format's epoch
        .unix_permissions(0o644)
        .large_file(len >= u32::MAX as u64)
        .compression_method(CompressionMethod::Stored)
}

/// The largest archive, entry and entry count the app's extractor reads:
/// 32-bit sizes and offsets, a 16-bit count (the end of central directory
/// record's; no zip64). One below each field's largest value: that value
/// (0xFFFF entries, 0xFFFFFFFF bytes) marks a zip64 field, which the
/// writer then emits and the strict reader (`verify --archive`) refuses.
pub const APP_MAX_BYTES: u64 = u32::MAX as u64 - 1;
pub const APP_MAX_ENTRIES: usize = u16::MAX as usize - 1;

/// Bytes a stored archive of `entries` (name, size) takes at the least:
/// per entry a local header (30 bytes + name) and a central directory
/// record (46 + name), then the end record (22).
pub fn stored_size(entries: &[(String, u64)]) -> u64 {
    let headers: u64 = entries.iter().map(|(n, _)| 76 + 2 * n.len() as u64).sum();
    entries.iter().map(|(_, s)| s).sum::<u64>() + headers + 22
}

fn gib(bytes: u64) -> String {
    format!(
        "{:.2} GiB ({bytes} bytes)",
        bytes as f64 / (1u64 << 30) as f64
    )
}

/// Refuses an archive of `entries` (name, size), `bytes` long, that the app's
/// iOS extractor could not unpack (32-bit sizes and offsets, 16-bit count),
/// naming the size. Refused rather than warned: the app would fail or
/// extract garbage, and a consumer that reads zip64 can take the folder.
pub fn check_app_extractable(
    zip: &Path,
    entries: &[(String, u64)],
    bytes: u64,
) -> Result<(), String> {
    let z = zip.display();
    let advice = "publish the release folder file by file (distribution.json lists the files), or leave out --zip";
    if let Some((n, s)) = entries.iter().find(|(_, s)| *s > APP_MAX_BYTES) {
        return Err(format!(
            "{z}: entry '{n}' is {}, over the {} the app's zip extractor reads (32-bit sizes, no zip64); {advice}",
            gib(*s),
            gib(APP_MAX_BYTES)
        ));
    }
    if bytes > APP_MAX_BYTES {
        return Err(format!(
            "{z}: the archive would be {}, over the {} the app's zip extractor reads (32-bit offsets, no zip64); {advice}",
            gib(bytes),
            gib(APP_MAX_BYTES)
        ));
    }
    if entries.len() > APP_MAX_ENTRIES {
        return Err(format!(
            "{z}: {} entries, over the {APP_MAX_ENTRIES} the app's zip extractor reads (a 16-bit count, no zip64); {advice}",
            entries.len()
        ));
    }
    Ok(())
}

/// Why the app's zip route (a `ModelInfo` whose `downloadURL` is not a
/// Hugging Face repository's) cannot take an archive of `bytes` bytes whose
/// entries are `names`: it lists any archive at 350,000,000 estimated bytes
/// and aborts past 1.5 times that, and after extracting it finds the model
/// only by [`downloader::ARCHIVE_ROOT_FILE`] at the folder's root, else the
/// download ends in `extractionFailed` (ModelDownloader.swift at 72178c6,
/// `download(_:)`, `finishDownload`). Empty when it can.
pub fn app_route(names: &[String], bytes: u64) -> Vec<String> {
    let mut out = Vec::new();
    if bytes > downloader::ARCHIVE_LIMIT {
        out.push(format!(
            "it is {bytes} bytes, and the app aborts any archive past {} (1.5 x the {} bytes it assumes an archive has)",
            downloader::ARCHIVE_LIMIT,
            downloader::ARCHIVE_ESTIMATE
        ));
    }
    if !names.iter().any(|n| n == downloader::ARCHIVE_ROOT_FILE) {
        out.push(format!(
            "it holds no {} at its root (the release's repository layout, swa/…, and uncompiled packages): after extracting it the app fails with extractionFailed",
            downloader::ARCHIVE_ROOT_FILE
        ));
    }
    out
}

/// Writes the zip of every regular file under `root` to `out` (a temporary
/// name of the archive `shown`, which messages name); returns the
/// archive's SHA-256 (hex). An archive the app could not extract is
/// refused before a byte is written, and checked again once written.
pub fn write(root: &Path, out: &Path, shown: &Path) -> Result<String> {
    let tree = hashing::walk(root, &|_| false)?;
    tree.refuse_odd(root)?;
    let sizes: Vec<(String, u64)> = tree
        .files
        .iter()
        .map(|rel| {
            let p = root.join(rel);
            let len = fs::metadata(&p)
                .with_context(|| format!("{}: cannot stat", p.display()))?
                .len();
            Ok((rel.clone(), len))
        })
        .collect::<Result<_>>()?;
    check_app_extractable(shown, &sizes, stored_size(&sizes)).map_err(anyhow::Error::msg)?;
    let f = File::create(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let mut z = ZipWriter::new(BufWriter::with_capacity(1 << 20, f));
    for (rel, len) in &sizes {
        let src = root.join(rel);
        z.start_file(rel.as_str(), entry_options(*len))
            .with_context(|| format!("{}: cannot add {rel}", out.display()))?;
        let mut r = File::open(&src).with_context(|| format!("{}: cannot open", src.display()))?;
        io::copy(&mut r, &mut z).with_context(|| format!("{}: cannot add {rel}", out.display()))?;
    }
    let w = z
        .finish()
        .with_context(|| format!("{}: cannot finish the archive", out.display()))?;
    w.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("{}: write failed", out.display()))?;
    let written = fs::metadata(out)
        .with_context(|| format!("{}: cannot stat", out.display()))?
        .len();
    check_app_extractable(shown, &sizes, written).map_err(anyhow::Error::msg)?;
    Ok(hashing::hash_file(out)?.hex())
}

pub use crate::zipwalk::Entry;

/// Reads an archive for verification: checks it against `FILE.sha256`, then
/// walks it strictly (`zipwalk`: local headers and central directory agree
/// one to one, only regular files with safe, unique names, sizes and CRCs as
/// declared). Returns the file entries (hashed) and the problems found, each
/// naming the archive and entry.
pub fn check(zip_path: &Path) -> (Vec<Entry>, Vec<String>) {
    let mut problems = Vec::new();
    let z = zip_path.display();
    let sha_path = digest_path(zip_path);
    match fs::read_to_string(&sha_path) {
        Err(e) => problems.push(format!(
            "{}: cannot read the archive digest ({e})",
            sha_path.display()
        )),
        Ok(text) => {
            let want = text
                .split_whitespace()
                .next()
                .unwrap_or("")
                .to_ascii_lowercase();
            match hashing::hash_file(zip_path) {
                Err(e) => {
                    problems.push(e.to_string());
                    return (Vec::new(), problems);
                }
                Ok(d) if d.hex() != want => problems.push(format!(
                    "{z}: SHA-256 is {}, but {} says {want}",
                    d.hex(),
                    sha_path.display()
                )),
                Ok(_) => {}
            }
        }
    }
    let opened = File::open(zip_path).and_then(|f| f.metadata().map(|m| (f, m.len())));
    let (mut file, len) = match opened {
        Ok(f) => f,
        Err(e) => {
            problems.push(format!("{z}: cannot open ({e})"));
            return (Vec::new(), problems);
        }
    };
    let (entries, walk_problems) = zipwalk::walk(&mut file, len);
    problems.extend(walk_problems.into_iter().map(|p| format!("{z}: {p}")));
    (entries, problems)
}

/// The entry names of the archive at `zip_path` if it is one `check` would
/// walk (structure only; contents are not decoded).
pub fn names(zip_path: &Path) -> std::result::Result<Vec<String>, String> {
    let mut f = File::open(zip_path).map_err(|e| e.to_string())?;
    let len = f.metadata().map_err(|e| e.to_string())?.len();
    zipwalk::names(&mut f, len)
}

/// Compares archive entries with the release files they must equal:
/// `expected` (path, sha256) for every file of the release, `model.sig` included.
pub fn compare(zip_path: &Path, entries: &[Entry], expected: &[(String, [u8; 32])]) -> Vec<String> {
    let z = zip_path.display();
    let mut problems = Vec::new();
    let want: std::collections::BTreeMap<&str, &[u8; 32]> =
        expected.iter().map(|(p, d)| (p.as_str(), d)).collect();
    let mut seen = std::collections::BTreeSet::new();
    for e in entries {
        if !seen.insert(e.name.as_str()) {
            problems.push(format!("{z}: entry '{}' appears more than once", e.name));
            continue;
        }
        match want.get(e.name.as_str()) {
            None => problems.push(format!(
                "{z}: extra entry '{}' (not a file of the release)",
                e.name
            )),
            Some(d) if **d != e.sha256 => problems.push(format!(
                "{z}: entry '{}' differs from the release (sha256 {}, expected {})",
                e.name,
                hex(&e.sha256),
                hex(*d)
            )),
            Some(_) => {}
        }
    }
    for p in want.keys() {
        if !seen.contains(p) {
            problems.push(format!("{z}: missing entry '{p}'"));
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use zip::ZipArchive;

    /// The app's zip route: 525,000,000 bytes at most, and the local names
    /// of a compiled folder at the root.
    #[test]
    fn the_app_route_takes_a_compiled_folder_of_local_names_under_525_mb() {
        let local = vec![
            "chunk1.mlmodelc/weights/weight.bin".to_string(),
            "cos_full.npy".to_string(),
        ];
        assert!(app_route(&local, 525_000_000).is_empty());
        let why = app_route(&local, 525_000_001);
        assert!(
            why.len() == 1 && why[0].contains("past 525000000"),
            "{why:?}"
        );
        let release =
            vec!["swa/chunk1.mlpackage/Data/com.apple.CoreML/weights/weight.bin".to_string()];
        let why = app_route(&release, 1000);
        assert!(
            why.len() == 1 && why[0].contains("extractionFailed"),
            "{why:?}"
        );
    }

    #[test]
    fn same_input_same_bytes() {
        let base = std::env::temp_dir().join(format!("cf-zip-{}", std::process::id()));
        let root = base.join("r");
        fs::create_dir_all(root.join("p.mlpackage/weights")).unwrap();
        fs::write(root.join("p.mlpackage/weights/weight.bin"), vec![3u8; 5000]).unwrap();
        fs::write(root.join("manifest.json"), "{}\n").unwrap();
        let a = write(&root, &base.join("a.zip"), &base.join("a.zip")).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let b = write(&root, &base.join("b.zip"), &base.join("b.zip")).unwrap();
        assert_eq!(a, b);
        fs::write(digest_path(&base.join("a.zip")), digest_line(&a, "a.zip")).unwrap();
        let (entries, problems) = check(&base.join("a.zip"));
        assert!(problems.is_empty(), "{problems:?}");
        let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["manifest.json", "p.mlpackage/weights/weight.bin"]);
        let ar = ZipArchive::new(File::open(base.join("a.zip")).unwrap()).unwrap();
        let mut ar = ar;
        let f = ar.by_name("p.mlpackage/weights/weight.bin").unwrap();
        assert_eq!(f.compression(), CompressionMethod::Stored);
        drop(f);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn archives_the_apps_extractor_cannot_read_are_refused_naming_the_size() {
        let z = Path::new("r.zip");
        let small = vec![("a".to_string(), 10u64); 3];
        assert!(check_app_extractable(z, &small, stored_size(&small)).is_ok());
        // Just under the 32-bit limit with headers counted; one byte more is over.
        let name = "swa/chunk1.mlpackage/weights/weight.bin".to_string();
        let fits = APP_MAX_BYTES - 76 - 2 * name.len() as u64 - 22;
        let one = vec![(name.clone(), fits)];
        assert_eq!(stored_size(&one), APP_MAX_BYTES);
        assert!(check_app_extractable(z, &one, stored_size(&one)).is_ok());
        let over = vec![(name.clone(), fits), ("b".to_string(), 0)];
        let e = check_app_extractable(z, &over, stored_size(&over)).unwrap_err();
        assert!(
            e.contains("r.zip: the archive would be 4.00 GiB (4294967372 bytes)"),
            "{e}"
        );
        // 0xFFFFFFFF bytes and 0xFFFF entries are the zip64 marks: over.
        let big = vec![(name.clone(), APP_MAX_BYTES + 1)];
        let e = check_app_extractable(z, &big, stored_size(&big)).unwrap_err();
        assert!(
            e.contains(&format!("entry '{name}' is 4.00 GiB (4294967295 bytes)")),
            "{e}"
        );
        let many = vec![("x".to_string(), 0u64); APP_MAX_ENTRIES + 1];
        let e = check_app_extractable(z, &many, stored_size(&many)).unwrap_err();
        assert!(e.contains("65535 entries"), "{e}");
    }
}
