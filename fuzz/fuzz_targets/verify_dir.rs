//! Arbitrary directory contents through `verify::verify` with a fixed public
//! key. The input decodes into a small tree (files, folders, symlinks, FIFOs,
//! names that are not UTF-8), an optional `manifest.json` (raw bytes, or one
//! generated from the tree and then altered) and a `model.sig` (raw bytes, a
//! signed arbitrary payload, or a valid signature over the tree with
//! resources added or dropped), optionally a zip beside it. The verifier
//! must return Ok or Err, never panic or hang.

#![no_main]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use chunkforge_release::hashing::{self, FileDigest};
use chunkforge_release::manifest::{FORMAT, MANIFEST_FILE};
use chunkforge_release::sign::{self, SIG_FILE};
use chunkforge_release::verify::{self, VerifyArgs};
use chunkforge_fuzz::{public_key_path, scratch, signed_bundle, signing_key};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use serde_json::json;
use sha2::{Digest, Sha256};

/// One path component; the well-known names are offered directly so the
/// fuzzer need not spell them.
#[derive(Arbitrary, Debug)]
enum Name {
    Sig,
    Manifest,
    Pkg,
    Weights,
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Kind {
    File(Vec<u8>),
    Dir,
    Symlink(Vec<u8>),
    Fifo,
}

#[derive(Arbitrary, Debug)]
struct Node {
    path: Vec<Name>,
    kind: Kind,
}

#[derive(Arbitrary, Debug)]
enum ManifestMode {
    Absent,
    Raw(Vec<u8>),
    /// Generated from the files on disk, then: entry `drop` removed, entry
    /// `resize` given another size, `extra` paths added (digest of "").
    Generated {
        drop: Option<u8>,
        resize: Option<(u8, u64)>,
        extra: Vec<String>,
        upper_hex: bool,
    },
}

#[derive(Arbitrary, Debug)]
enum SigMode {
    Absent,
    Raw(Vec<u8>),
    SignedPayload(Vec<u8>),
    /// A valid signature over the tree as written, with file `drop` left out,
    /// `extra` resources added and `ignore` as the signed ignore list.
    SignedTree {
        model_name: String,
        drop: Option<u8>,
        extra: Vec<(String, [u8; 32])>,
        ignore: Vec<String>,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    nodes: Vec<Node>,
    manifest: ManifestMode,
    sig: SigMode,
    /// A zip to check with `--archive`, and whether its `.sha256` is right.
    archive: Option<(Vec<u8>, bool)>,
}

/// A relative path inside the tree from components; `..`, `.`, empty and
/// `/`-containing components are dropped so nothing lands outside the tree.
fn rel_path(names: &[Name]) -> Option<PathBuf> {
    let mut p = PathBuf::new();
    for n in names.iter().take(4) {
        let c: &[u8] = match n {
            Name::Sig => SIG_FILE.as_bytes(),
            Name::Manifest => MANIFEST_FILE.as_bytes(),
            Name::Pkg => b"chunk1.mlpackage",
            Name::Weights => b"weights",
            Name::Raw(b) => b,
        };
        let c: Vec<u8> = c
            .iter()
            .copied()
            .filter(|&b| b != b'/' && b != 0)
            .take(32)
            .collect();
        if c.is_empty() || c == b"." || c == b".." {
            continue;
        }
        p.push(OsStr::from_bytes(&c));
    }
    (!p.as_os_str().is_empty()).then_some(p)
}

/// Whether writing `root/rel` stays inside `root`: no ancestor is a symlink
/// (or a non-folder), and the entry itself is absent or a regular file. Opening
/// a FIFO for writing would block, and following a symlink could write anywhere.
fn safe_to_write(root: &Path, rel: &Path) -> bool {
    let mut p = root.to_path_buf();
    let comps: Vec<_> = rel.components().collect();
    for (i, c) in comps.iter().enumerate() {
        p.push(c);
        let last = i + 1 == comps.len();
        match std::fs::symlink_metadata(&p) {
            Err(_) => return true,
            Ok(m) if last => return m.file_type().is_file(),
            Ok(m) if !m.file_type().is_dir() => return false,
            Ok(_) => {}
        }
    }
    true
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).expect("no NUL in path");
    unsafe {
        libc::mkfifo(c.as_ptr(), 0o644);
    }
}

/// Regular files under `root` (minus model.sig) with their digests.
fn files_on_disk(root: &Path) -> Vec<(String, FileDigest)> {
    let Ok(tree) = hashing::walk(root, &|rel| rel == SIG_FILE) else {
        return Vec::new();
    };
    let digests = hashing::hash_all(root, &tree.files);
    tree.files
        .into_iter()
        .zip(digests)
        .filter_map(|(f, d)| d.ok().map(|d| (f, d)))
        .collect()
}

fn write_tree(root: &Path, inp: &Input) {
    for node in inp.nodes.iter().take(16) {
        let Some(rel) = rel_path(&node.path) else {
            continue;
        };
        if !safe_to_write(root, &rel) {
            continue;
        }
        let p = root.join(&rel);
        if let Some(parent) = p.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        match &node.kind {
            Kind::File(b) => {
                let _ = std::fs::write(&p, b);
            }
            Kind::Dir => {
                let _ = std::fs::create_dir_all(&p);
            }
            Kind::Symlink(t) => {
                let _ = std::os::unix::fs::symlink(OsStr::from_bytes(t), &p);
            }
            Kind::Fifo => mkfifo(&p),
        }
    }

    let mpath = root.join(MANIFEST_FILE);
    let manifest_ok = safe_to_write(root, Path::new(MANIFEST_FILE));
    let sig_ok = safe_to_write(root, Path::new(SIG_FILE));
    match &inp.manifest {
        _ if !manifest_ok => {}
        ManifestMode::Absent => {}
        ManifestMode::Raw(b) => {
            let _ = std::fs::write(&mpath, b);
        }
        ManifestMode::Generated {
            drop,
            resize,
            extra,
            upper_hex,
        } => {
            let mut entries: Vec<serde_json::Value> = files_on_disk(root)
                .into_iter()
                .filter(|(f, _)| f != MANIFEST_FILE)
                .map(|(f, d)| {
                    let h = if *upper_hex {
                        d.hex().to_ascii_uppercase()
                    } else {
                        d.hex()
                    };
                    json!({"path": f, "size": d.size, "sha256": h})
                })
                .collect();
            if let Some((i, size)) = resize {
                if let Some(e) = entries.get_mut(*i as usize) {
                    e["size"] = json!(size);
                }
            }
            if let Some(i) = drop {
                if (*i as usize) < entries.len() {
                    entries.remove(*i as usize);
                }
            }
            let empty = hashing::hex(&Sha256::digest(b""));
            for x in extra.iter().take(4) {
                entries.push(json!({"path": x, "size": 0, "sha256": empty}));
            }
            let m = json!({"format": FORMAT, "files": entries});
            let _ = std::fs::write(&mpath, m.to_string());
        }
    }

    let sig_path = root.join(SIG_FILE);
    match &inp.sig {
        _ if !sig_ok => {}
        SigMode::Absent => {}
        SigMode::Raw(b) => {
            let _ = std::fs::write(&sig_path, b);
        }
        SigMode::SignedPayload(b) => {
            let _ = std::fs::write(&sig_path, signed_bundle(b));
        }
        SigMode::SignedTree {
            model_name,
            drop,
            extra,
            ignore,
        } => {
            let mut files = files_on_disk(root);
            if let Some(i) = drop {
                if (*i as usize) < files.len() {
                    files.remove(*i as usize);
                }
            }
            for (name, sha256) in extra.iter().take(4) {
                files.push((
                    name.clone(),
                    FileDigest {
                        size: 0,
                        sha256: *sha256,
                    },
                ));
            }
            let mut ignore: Vec<&str> = ignore.iter().take(4).map(String::as_str).collect();
            ignore.push(SIG_FILE);
            let st = sign::statement(model_name, &files, &ignore, None);
            let _ = std::fs::write(&sig_path, sign::sign_bundle(signing_key(), &st));
        }
    }
}

fuzz_target!(|inp: Input| {
    static N: AtomicU64 = AtomicU64::new(0);
    let case = scratch().join(format!("case-{}", N.fetch_add(1, Ordering::Relaxed)));
    let root = case.join("release");
    std::fs::create_dir_all(&root).unwrap();
    write_tree(&root, &inp);
    let archive = inp.archive.as_ref().map(|(zip, right_digest)| {
        let z = case.join("release.zip");
        std::fs::write(&z, zip).unwrap();
        let d = if *right_digest {
            hashing::hex(&Sha256::digest(zip))
        } else {
            "0".repeat(64)
        };
        std::fs::write(
            chunkforge_release::archive::digest_path(&z),
            chunkforge_release::archive::digest_line(&d, "release.zip"),
        )
        .unwrap();
        z
    });
    let args = VerifyArgs {
        release_dir: root,
        public_key: public_key_path().to_path_buf(),
        archive,
    };
    let _ = verify::verify(&args);
    let _ = std::fs::remove_dir_all(&case);
});
