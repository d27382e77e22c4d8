//! Arbitrary bytes as `manifest.json` through the verifier's manifest check
//! (`verify::check_manifest`: JSON parse, format, `manifest::manifest_files`,
//! path safety, duplicates, agreement with a small fixed signed list).

#![no_main]

use std::collections::BTreeMap;

use chunkforge_release::hashing::FileDigest;
use chunkforge_release::manifest;
use chunkforge_release::verify;
use chunkforge_fuzz::scratch;
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

fuzz_target!(|data: &[u8]| {
    let path = scratch().join("manifest.json");
    std::fs::write(&path, data).unwrap();
    let mut signed = BTreeMap::new();
    let mut actual = BTreeMap::new();
    for (name, contents) in [
        ("manifest.json", &b"{}"[..]),
        (
            "chunk1.mlpackage/Manifest.json",
            b"{\"name\": \"chunk1\"}\n",
        ),
        (
            "chunk1.mlpackage/Data/com.apple.CoreML/weights/weight.bin",
            b"w",
        ),
        ("a", b""),
    ] {
        let sha256: [u8; 32] = Sha256::digest(contents).into();
        signed.insert(name.to_string(), sha256);
        actual.insert(
            name.to_string(),
            FileDigest {
                size: contents.len() as u64,
                sha256,
            },
        );
    }
    let mut problems = Vec::new();
    verify::check_manifest(&path, &signed, &actual, &mut problems);
    if let Ok(v) = serde_json::from_slice(data) {
        let _ = manifest::manifest_files(&v);
    }
});
