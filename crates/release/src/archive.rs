//! The release as one deterministic zip: entries are the release's files
//! (paths relative to the release folder, no directory entries) in path
//! component order, every timestamp 1980-01-01 00:00:00, mode 0644; weight
//! blobs are stored (they are palettized indices and LUTs that do not
//! deflate, and stored entries can be served with range requests), the rest
//! is deflated. Beside it, `FILE.sha256` in `sha256sum` format.

use std::fs::{self, File};
use std::io::{self, BufWriter};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use zip::write::SimpleFileOptions;
use zip::{CompressionMethod, DateTime, ZipWriter};

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

/// Weight blobs are stored, not deflated.
fn stored(rel: &str) -> bool {
    rel.ends_with(".bin") || rel.split('/').any(|c| c == "weights")
}

/// The options of entry `rel` of `len` bytes: fixed time and mode, weights
/// stored, zip64 fields only for a file that needs them.
pub fn entry_options(rel: &str, len: u64) -> SimpleFileOptions {
    SimpleFileOptions::default()
        .last_modified_time(DateTime::default()) // 1980-01-01 00:00:00, the zip format's epoch
        .unix_permissions(0o644)
        .large_file(len >= u32::MAX as u64)
        .compression_method(if stored(rel) {
            CompressionMethod::Stored
        } else {
            CompressionMethod::Deflated
        })
}

/// Writes the zip of every regular file under `root` to `out`; returns the
/// archive's SHA-256 (hex).
pub fn write(root: &Path, out: &Path) -> Result<String> {
    let tree = hashing::walk(root, &|_| false)?;
    let f = File::create(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let mut z = ZipWriter::new(BufWriter::with_capacity(1 << 20, f));
    for rel in &tree.files {
        let src = root.join(rel);
        let len = fs::metadata(&src)
            .with_context(|| format!("{}: cannot stat", src.display()))?
            .len();
        z.start_file(rel.as_str(), entry_options(rel, len))
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

    #[test]
    fn same_input_same_bytes() {
        let base = std::env::temp_dir().join(format!("cf-zip-{}", std::process::id()));
        let root = base.join("r");
        fs::create_dir_all(root.join("p.mlpackage/weights")).unwrap();
        fs::write(root.join("p.mlpackage/weights/weight.bin"), vec![3u8; 5000]).unwrap();
        fs::write(root.join("manifest.json"), "{}\n").unwrap();
        let a = write(&root, &base.join("a.zip")).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let b = write(&root, &base.join("b.zip")).unwrap();
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
}
