//! The path fields of `manifest.json` (`files[].path`, `chunks[].name` and
//! `.file`, `shared_blobs[].paths`) set to arbitrary strings in a real
//! release's manifest, through `Manifest::load` (what `run`, `client-check`
//! and `package --onto` read a release with), `ReleaseFolder::package_dir`
//! and `verify::check_manifest`. Invariants:
//!
//! - a manifest `load` accepts states only paths that stay in the folder:
//!   each is a safe relative path, each chunk's file its package's folder,
//!   and joined to the folder it has no `..`, root or prefix component;
//! - whatever `load` refuses for a path, `verify` reports a problem for.

#![no_main]

use std::collections::BTreeMap;
use std::path::{Component, Path};

use chunkforge_fuzz::scratch;
use chunkforge_release::hashing::FileDigest;
use chunkforge_release::manifest::{self, Manifest};
use chunkforge_release::paths::check_rel_path;
use chunkforge_release::verify;
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// A string the fuzzer builds, or one of the hostile ones.
#[derive(Arbitrary, Debug)]
enum Text {
    DotDot,
    Absolute,
    Backslash,
    OtherPackage,
    Raw(String),
}

impl Text {
    fn get(&self) -> String {
        match self {
            Text::DotDot => "../outside.mlpackage".into(),
            Text::Absolute => "/etc/chunk1.mlpackage".into(),
            Text::Backslash => "swa\\chunk1.mlpackage".into(),
            Text::OtherPackage => "swa/chunk2.mlpackage".into(),
            Text::Raw(s) => s.clone(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Edit {
    ChunkName(u8, Text),
    ChunkFile(u8, Text),
    FilePath(u8, Text),
    BlobPath(u8, Text),
}

/// A real release's manifest cut to two packages and a few files
/// (`chunkforge_fuzz::RELEASE_MANIFEST`), with a shared blob.
fn base() -> Value {
    let blob = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    let mut v: Value =
        serde_json::from_str(chunkforge_fuzz::RELEASE_MANIFEST).expect("the base manifest is JSON");
    v["shared_blobs"] = json!([{"sha256": blob, "size": 1, "paths": ["swa/chunk1.mlpackage/a", "swa/chunk1.mlpackage/b"]}]);
    v
}

fn edit(v: &mut Value, e: &Edit) {
    let at = |arr: &mut Value, i: u8| -> Option<usize> {
        let n = arr.as_array()?.len();
        (n > 0).then(|| i as usize % n)
    };
    match e {
        Edit::ChunkName(i, t) | Edit::ChunkFile(i, t) => {
            let key = if matches!(e, Edit::ChunkName(..)) {
                "name"
            } else {
                "file"
            };
            if let Some(k) = at(&mut v["chunks"], *i) {
                v["chunks"][k][key] = json!(t.get());
            }
        }
        Edit::FilePath(i, t) => {
            if let Some(k) = at(&mut v["files"], *i) {
                v["files"][k]["path"] = json!(t.get());
            }
        }
        Edit::BlobPath(i, t) => {
            v["shared_blobs"][0]["paths"][(*i % 2) as usize] = json!(t.get());
        }
    }
}

fn stays_inside(p: &Path) -> bool {
    p.components().all(|c| matches!(c, Component::Normal(_)))
}

fuzz_target!(|edits: Vec<Edit>| {
    let mut v = base();
    for e in edits.iter().take(6) {
        edit(&mut v, e);
    }
    let path = scratch().join("manifest.json");
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let loaded = Manifest::load(&path);
    if let Ok(m) = &loaded {
        for c in &m.chunks {
            assert_eq!(manifest::check_package_file(&c.name, &c.file), Ok(()));
            assert!(stays_inside(Path::new(&c.file)), "{:?}", c.file);
            let blob = m.blob_path(&c.name).expect("a chunk's blob path");
            assert!(stays_inside(Path::new(&blob)), "{blob:?}");
        }
        for f in &m.files {
            assert_eq!(check_rel_path(&f.path), Ok(()));
            assert!(stays_inside(Path::new(&f.path)), "{:?}", f.path);
        }
        for b in &m.shared_blobs {
            for p in &b.paths {
                assert!(stays_inside(Path::new(p)), "{p:?}");
            }
        }
    }
    // verify over the same manifest, the files it lists signed as listed.
    let mut signed = BTreeMap::new();
    let mut actual = BTreeMap::new();
    for f in v["files"].as_array().into_iter().flatten() {
        let (Some(p), Some(sha)) = (f["path"].as_str(), f["sha256"].as_str()) else {
            continue;
        };
        let Some(d) = chunkforge_release::hashing::parse_hex32(sha) else {
            continue;
        };
        signed.insert(p.to_string(), d);
        actual.insert(
            p.to_string(),
            FileDigest {
                size: f["size"].as_u64().unwrap_or(0),
                sha256: d,
            },
        );
    }
    let sha: [u8; 32] = Sha256::digest(serde_json::to_vec(&v).unwrap()).into();
    signed.insert("manifest.json".into(), sha);
    let mut problems = Vec::new();
    verify::check_manifest(&path, &signed, &actual, &mut problems);
    if let Err(why) = &loaded {
        let about_paths =
            why.contains("chunks[") || why.contains("files[]") || why.contains("shared_blobs[]");
        if about_paths {
            assert!(
                !problems.is_empty(),
                "load refused ({why}) and verify found nothing"
            );
        }
    }
});
