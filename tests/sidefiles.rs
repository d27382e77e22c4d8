//! `chunkforge side-files` end to end: the files it publishes, and bad
//! checkpoints refused with the tensor and file named, exit 2, and the
//! previous side files left as they were. (Their contents are checked
//! against safetensors, numpy and transformers by python/tests/test_sidefiles.py.)

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use chunkforge::sidefiles::SIDE_FILES;
use common::*;

/// Every entry of `dir` (names starting with '.' included) and its bytes.
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// A good run of side-files into a fresh folder; returns the folder.
fn previous_side_files(tag: &str) -> std::path::PathBuf {
    let out = tempdir(tag).join("side");
    let ck = fixture("e2b", &[]);
    ok(&[
        "side-files",
        "--hf-dir",
        ck.to_str().unwrap(),
        "--ctx",
        "256",
        "--output",
        out.to_str().unwrap(),
    ]);
    out
}

/// Runs side-files on `ck` into `out`, expecting exit 2 and `fragments` in
/// stderr, and `out` exactly as it was.
fn refused(ck: &Path, out: &Path, fragments: &[&str]) {
    let before = contents(out);
    let o = run(&[
        "side-files",
        "--hf-dir",
        ck.to_str().unwrap(),
        "--ctx",
        "256",
        "--output",
        out.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for f in fragments {
        assert!(err.contains(f), "expected `{f}` in:\n{err}");
    }
    assert_eq!(contents(out), before, "the previous side files changed");
}

#[test]
fn publishes_exactly_the_side_files_the_runtime_reads() {
    let out = previous_side_files("side-ok");
    let names: Vec<String> = contents(&out).into_keys().collect();
    let mut want: Vec<String> = SIDE_FILES.iter().map(|s| s.name.to_string()).collect();
    want.sort();
    assert_eq!(names, want);
}

#[test]
fn a_checkpoint_without_the_per_layer_table_is_refused_naming_tensor_and_file() {
    let out = previous_side_files("side-missing");
    let ck = copy_checkpoint(&fixture("e2b", &[]), "side-missing-ck");
    let path = ck.join("model.safetensors");
    let (mut header, data) = read_safetensors(&path);
    header
        .as_object_mut()
        .unwrap()
        .remove("model.embed_tokens_per_layer.weight")
        .expect("the fixture has the table");
    write_safetensors(&path, &header, &data);
    refused(
        &ck,
        &out,
        &[
            &format!("{}:", ck.display()),
            "tensor model.embed_tokens_per_layer.weight is missing from model.safetensors",
        ],
    );
}

#[test]
fn a_value_the_table_cannot_hold_is_refused_naming_row_tensor_and_file() {
    let out = previous_side_files("side-nan");
    let ck = copy_checkpoint(&fixture("e2b", &[]), "side-nan-ck");
    let path = ck.join("model.safetensors");
    let (header, mut data) = read_safetensors(&path);
    // A NaN in row 3, element 5 of the per-layer table (the fixture stores fp32):
    // written after the token table's files, so a half-written set is at stake.
    let t = &header["model.embed_tokens_per_layer.weight"];
    assert_eq!(t["dtype"], "F32");
    let width = t["shape"][1].as_u64().unwrap() as usize;
    let at = t["data_offsets"][0].as_u64().unwrap() as usize + 4 * (3 * width + 5);
    data[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    write_safetensors(&path, &header, &data);
    refused(
        &ck,
        &out,
        &[
            &format!("{}: tensor model.embed_tokens_per_layer.weight: row 3, element 5 is not a finite number", path.display()),
            "embed_tokens_per_layer_q8.bin cannot be written",
        ],
    );
    // Nothing half-written is left beside the output either.
    let parent = out.parent().unwrap();
    let leftovers: Vec<String> = fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("staging") || n.contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn rope_tables_shorter_than_the_context_are_refused() {
    let out = tempdir("side-rope").join("side");
    let o = run(&[
        "side-files",
        "--ctx",
        "4096",
        "--rope-positions",
        "2048",
        "--output",
        out.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--rope-positions 2048 is less than --ctx 4096"),
        "{err}"
    );
    assert!(!out.exists());
}
