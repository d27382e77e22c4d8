//! Inputs the fuzz targets (fuzz/, scripts/fuzz.sh) found, each turned into a
//! test that fails without its fix.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use chunkforge::archive;
use chunkforge::hashing::FileDigest;
use chunkforge::sign;
use chunkforge::verify::{self, Report, VerifyArgs};
use p256::ecdsa::SigningKey;
use p256::pkcs8::{EncodePublicKey, LineEnding};
use sha2::{Digest, Sha256};

fn key() -> SigningKey {
    SigningKey::from_bytes(&[7u8; 32].into()).unwrap()
}

/// A fresh folder with `release/` (returned) and the public key at `key.pub`.
fn workdir(tag: &str) -> (PathBuf, PathBuf) {
    let w = std::env::temp_dir().join(format!("cf-fuzzreg-{}-{tag}", std::process::id()));
    let _ = fs::remove_dir_all(&w);
    fs::create_dir_all(w.join("release")).unwrap();
    let pem = key()
        .verifying_key()
        .to_public_key_pem(LineEnding::LF)
        .unwrap();
    fs::write(w.join("key.pub"), pem).unwrap();
    (w.clone(), w.join("release"))
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o644) },
        0,
        "mkfifo {p:?}"
    );
}

/// Signs `names` (with the digest of their name) into `dir/model.sig`.
fn sign_names(dir: &Path, names: &[&str]) {
    let files: Vec<(String, FileDigest)> = names
        .iter()
        .map(|n| {
            let d = FileDigest {
                size: n.len() as u64,
                sha256: Sha256::digest(n.as_bytes()).into(),
            };
            (n.to_string(), d)
        })
        .collect();
    let st = sign::statement("m", &files, &[sign::SIG_FILE], None);
    fs::write(dir.join(sign::SIG_FILE), sign::sign_bundle(&key(), &st)).unwrap();
}

/// Runs `verify` on a thread; a verifier blocked on a FIFO fails the test
/// after 30 s instead of hanging it.
fn verify_within_30s(work: &Path, dir: &Path) -> Report {
    let args = VerifyArgs {
        release_dir: dir.to_path_buf(),
        public_key: work.join("key.pub"),
        archive: None,
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(verify::verify(&args).map_err(|e| e.to_string()));
    });
    rx.recv_timeout(Duration::from_secs(30))
        .expect("verify blocked for 30 s (opened a FIFO?)")
        .expect("verify returns a report")
}

fn assert_problem(r: &Report, want: &str) {
    assert!(
        r.problems.iter().any(|p| p == want),
        "expected problem {want:?} in {:#?}",
        r.problems
    );
}

/// verify_dir: `model.sig` is a FIFO. verify opened it for reading and
/// blocked forever (libFuzzer timeout).
#[test]
fn fifo_model_sig_is_reported_not_opened() {
    let (work, dir) = workdir("fifo-sig");
    fs::write(dir.join("a"), "a").unwrap();
    mkfifo(&dir.join(sign::SIG_FILE));
    let r = verify_within_30s(&work, &dir);
    assert_eq!(r.problems, ["model.sig: is not a regular file"]);
    fs::remove_dir_all(&work).unwrap();
}

/// verify_dir: a signed `manifest.json` that is a FIFO. The walk reported it,
/// but the manifest check then opened it and blocked forever.
#[test]
fn fifo_manifest_is_reported_not_opened() {
    let (work, dir) = workdir("fifo-manifest");
    fs::write(dir.join("a"), "a").unwrap();
    mkfifo(&dir.join("manifest.json"));
    sign_names(&dir, &["a", "manifest.json"]);
    let r = verify_within_30s(&work, &dir);
    assert_problem(&r, "manifest.json: is not a regular file");
    assert_problem(
        &r,
        "manifest.json: is not a regular file, so it was not read",
    );
    fs::remove_dir_all(&work).unwrap();
}

/// Same through a symlink: `manifest.json` -> a FIFO in the folder (or
/// /dev/zero, or anything) was followed and read.
#[test]
fn symlinked_manifest_is_not_followed() {
    let (work, dir) = workdir("link-manifest");
    fs::write(dir.join("a"), "a").unwrap();
    mkfifo(&dir.join("pipe"));
    std::os::unix::fs::symlink("pipe", dir.join("manifest.json")).unwrap();
    sign_names(&dir, &["a", "manifest.json"]);
    let r = verify_within_30s(&work, &dir);
    assert_problem(
        &r,
        "manifest.json: is a symlink (releases must not contain symlinks)",
    );
    assert_problem(
        &r,
        "manifest.json: is not a regular file, so it was not read",
    );
    fs::remove_dir_all(&work).unwrap();
}

/// zip_archive: an archive with no entries, only the 22-byte end record. Its
/// structure is sound, so the walker accepts it (the target's streaming
/// reader could not read it: a harness bug, fixed in the target); verify must
/// still report every release file as missing from it, never "matches".
#[test]
fn archive_without_entries_reports_every_file_missing() {
    let (work, dir) = workdir("empty-zip");
    fs::write(dir.join("a"), "a").unwrap();
    sign_names(&dir, &["a"]);
    let end = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()))
        .finish()
        .unwrap()
        .into_inner();
    assert_eq!(end.len(), 22);
    let z = work.join("r.zip");
    fs::write(&z, &end).unwrap();
    let digest = chunkforge::hashing::hex(&Sha256::digest(&end));
    fs::write(
        archive::digest_path(&z),
        archive::digest_line(&digest, "r.zip"),
    )
    .unwrap();
    let args = VerifyArgs {
        release_dir: dir,
        public_key: work.join("key.pub"),
        archive: Some(z.clone()),
    };
    let r = verify::verify(&args).unwrap();
    let z = z.display();
    assert_eq!(
        r.problems,
        [
            format!("{z}: missing entry 'a'"),
            format!("{z}: missing entry 'model.sig'")
        ]
    );
    fs::remove_dir_all(&work).unwrap();
}

/// walk_tree's first finding: a top-level folder `i:` (a drive letter to a
/// Windows reader) holding a file named `..\..\..\escaped`. The walk names
/// the folder as the bad name and lists nothing below it, so the backslashed
/// name is never read as a path; refuse_odd refuses the tree naming `i:`.
#[test]
fn a_drive_letter_folder_is_named_and_nothing_below_it_is_listed() {
    let (_w, dir) = workdir("drive-letter");
    fs::create_dir_all(dir.join("i:")).unwrap();
    fs::write(dir.join("i:").join("..\\..\\..\\escaped"), b"x").unwrap();
    fs::write(dir.join("plain.bin"), b"y").unwrap();
    let tree = chunkforge::hashing::walk(&dir, &|_| false).unwrap();
    assert_eq!(tree.files, vec!["plain.bin".to_string()]);
    assert_eq!(tree.bad_names.len(), 1, "{:?}", tree.bad_names);
    assert_eq!(tree.bad_names[0].path, "i:");
    let e = tree.refuse_odd(&dir).unwrap_err().to_string();
    assert!(
        e.contains("release/i:") && e.contains("drive letter"),
        "{e}"
    );
}
