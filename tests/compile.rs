//! `chunkforge compile` on Linux (chunkforge's own `.mlmodelc` writer): the
//! default INT4 release becomes complete for the app's main and main-3way
//! downloads, labelled as no device has loaded it, with its run book and
//! distribution.json made again; an FP16 release compiled and materialized
//! runs to transformers' greedy ids; an op without a text form, or a file
//! that is not the one the release signed, is refused by name and the
//! release is kept. The writer's bytes against Apple's compiler and the
//! round trip of every package: python/tests/test_mlmodelc.py.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::{ids, json_file, ok, run, stderr, tempdir, transformers_greedy, SENTENCE, TOKENS};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn key() -> &'static PathBuf {
    static KEY: OnceLock<PathBuf> = OnceLock::new();
    KEY.get_or_init(|| {
        let d = tempdir("compile-keys");
        ok(&["keygen", "--out", s(&d.join("k"))]);
        d.join("k.pem")
    })
}

/// `package` of `build` into a fresh folder, with `extra`.
fn release(build: &Path, tag: &str, extra: &[&str]) -> PathBuf {
    let out = tempdir(&format!("compile-{tag}")).join("release");
    let mut args = vec!["package", s(build), "--key", s(key()), "--output", s(&out)];
    args.extend_from_slice(extra);
    ok(&args);
    out
}

/// Every file of `dir` with its bytes' digest.
fn tree(dir: &Path) -> BTreeMap<String, String> {
    walkdir::WalkDir::new(dir)
        .into_iter()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().is_file())
        .map(|e| {
            let rel = e
                .path()
                .strip_prefix(dir)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            (
                rel,
                format!("{:x}", Sha256::digest(fs::read(e.path()).unwrap())),
            )
        })
        .collect()
}

/// `client-check --json`: (exit code, report).
fn check(dir: &Path, client: &str) -> (i32, Value) {
    let o = run(&[
        "client-check",
        s(dir),
        "--client",
        client,
        "--multimodal",
        "off",
        "--json",
    ]);
    let v: Value =
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(&o)));
    (o.status.code().unwrap(), v)
}

#[cfg(not(target_os = "macos"))]
#[test]
fn compile_check_needs_macos_and_touches_nothing() {
    let rel = release(&common::built_all(), "check", &[]);
    let before = tree(&rel);
    let o = run(&["compile", s(&rel), "--key", s(key()), "--check"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--check compares chunkforge's .mlmodelc with Core ML's own compiler, which only macOS has"),
        "{}",
        stderr(&o)
    );
    assert_eq!(tree(&rel), before);
}

/// The default release (`package`'s `app` layout of the shared INT4 build)
/// compiled here: signed and verified; every package at its `.mlmodelc`
/// path with text MIL and its own blob (none where the app shares one in);
/// every request of main and main-3way present (only the tiny checkpoint's
/// widths differ from the runtime's); the manifest, run book and
/// distribution.json say what compiled it and that no device has loaded it.
#[test]
fn linux_compile_completes_the_default_release() {
    let build = common::built_all();
    let base = "https://huggingface.co/org/gemma-coreml/resolve/main";
    let rel = release(&build, "default", &["--base-url", base]);
    let before = json_file(&rel.join("manifest.json"));
    let e = ok(&["compile", s(&rel), "--key", s(key())]);
    assert!(e.contains("with chunkforge, re-signed"), "{e}");
    let public = key().with_extension("pub");
    ok(&["verify", s(&rel), "--public-key", s(&public)]);

    let m = json_file(&rel.join("manifest.json"));
    assert_eq!(m["compiled"]["mlmodelc"], true);
    assert_eq!(m["compiled"]["device_verified"], false);
    assert!(
        m["compiled"]["by"]
            .as_str()
            .unwrap()
            .starts_with("chunkforge "),
        "{}",
        m["compiled"]
    );
    let held: Vec<&str> = m["shares"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["stored"] == false)
        .map(|x| x["package"].as_str().unwrap())
        .collect();
    assert!(!held.is_empty());
    for (c, old) in m["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .zip(before["chunks"].as_array().unwrap())
    {
        let name = c["name"].as_str().unwrap();
        let file = c["file"].as_str().unwrap();
        assert_eq!(
            file,
            old["file"]
                .as_str()
                .unwrap()
                .replace(".mlpackage", ".mlmodelc")
        );
        let dir = rel.join(file);
        let mil = fs::read_to_string(dir.join("model.mil")).unwrap();
        assert!(mil.starts_with("program(1.3)\n[buildInfo = "), "{name}");
        for f in [
            "coremldata.bin",
            "metadata.json",
            "analytics/coremldata.bin",
        ] {
            assert!(dir.join(f).is_file(), "{name}: {f}");
        }
        let blob = dir.join("weights/weight.bin");
        if held.contains(&name) {
            assert!(!blob.exists(), "{name} is shared in by the app");
        } else {
            let source = build.join(format!(
                "{name}.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
            ));
            assert_eq!(
                fs::read(&blob).unwrap(),
                fs::read(source).unwrap(),
                "{name}: the package's blob"
            );
        }
    }
    assert!(!tree(&rel).keys().any(|k| k.contains(".mlpackage")));

    let book = fs::read_to_string(rel.join("DEVICE_RUNBOOK.md")).unwrap();
    let first = book
        .find("## First: load every function on the phone")
        .expect("the load step");
    assert!(first < book.find("## Layouts in this release").unwrap());
    assert!(
        book.contains("| chunk1 | `chunk1.mlmodelc` | `decode_q1`, `verify_qK` |"),
        "{book}"
    );
    assert!(book.contains("`prefill_chunk1.mlmodelc`"));
    let dist = json_file(&rel.join("distribution.json"));
    let paths: Vec<&str> = dist["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert!(
        paths.contains(&"swa/chunk1.mlmodelc/model.mil"),
        "{paths:?}"
    );
    assert!(!paths.iter().any(|p| p.contains(".mlpackage")), "{paths:?}");
    let listed: BTreeMap<String, String> = m["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["path"].as_str().unwrap().to_string(),
                f["sha256"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for f in dist["files"].as_array().unwrap() {
        assert_eq!(
            listed[f["path"].as_str().unwrap()],
            f["sha256"].as_str().unwrap()
        );
    }

    for client in ["main", "main-3way"] {
        let (code, r) = check(&rel, client);
        let statuses: Vec<&str> = r["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["status"].as_str().unwrap())
            .collect();
        assert!(
            statuses.iter().all(|st| *st == "present"),
            "{client}: {statuses:?}"
        );
        assert!(statuses.len() >= 40, "{client}");
        let kinds: Vec<&str> = r["problems"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["kind"].as_str().unwrap())
            .collect();
        assert!(
            kinds.iter().all(|k| *k == "width"),
            "{client}: {}",
            r["problems"]
        );
        assert_eq!(
            code, 1,
            "{client}: the tiny checkpoint's widths are not the runtime's"
        );
        let notes = r["notes"].to_string();
        assert!(
            notes.contains("count as present") && notes.contains("device_verified: false"),
            "{notes}"
        );
    }
    // `inspect` and `exec` read a compiled package as the package it came from.
    let chunk1 = rel.join("swa/chunk1.mlmodelc");
    let source = build.join("chunk1.mlpackage");
    let described = |p: &Path| {
        let mut v: Value = serde_json::from_str(&ok(&["inspect", s(p), "--json"])).unwrap();
        v.as_object_mut().unwrap().remove("path");
        v
    };
    assert_eq!(described(&chunk1), described(&source));
    let work = tempdir("compile-exec");
    let python = ok(&["doctor", "--venv-python"]).trim().to_string();
    let inputs = work.join("in.npz");
    let io = described(&source)["functions"][0]["inputs"].to_string();
    let made = Command::new(&python)
        .args([
            "-c",
            "import json, sys, numpy as np\n\
             rng = np.random.default_rng(0)\n\
             ins = json.loads(sys.argv[2])\n\
             np.savez(sys.argv[1], **{t['name']: (rng.standard_normal(t['shape']) * 0.5).astype(np.float16) for t in ins})",
            s(&inputs),
            &io,
        ])
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    for (p, out) in [(&chunk1, "a.npz"), (&source, "b.npz")] {
        ok(&[
            "exec",
            s(p),
            "--inputs",
            s(&inputs),
            "--output",
            s(&work.join(out)),
            "--fp16",
        ]);
    }
    let same = Command::new(&python)
        .args([
            "-c",
            "import sys, numpy as np\n\
             a, b = np.load(sys.argv[1]), np.load(sys.argv[2])\n\
             assert sorted(a.files) == sorted(b.files) and a.files\n\
             assert all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a.files)",
            s(&work.join("a.npz")),
            s(&work.join("b.npz")),
        ])
        .output()
        .unwrap();
    assert!(
        same.status.success(),
        "exec outputs differ: {}",
        String::from_utf8_lossy(&same.stderr)
    );

    let again = run(&["compile", s(&rel), "--key", s(key())]);
    assert_eq!(again.status.code(), Some(2));
    assert!(
        stderr(&again).contains("already compiled"),
        "{}",
        stderr(&again)
    );
}

/// An FP16 four-chunk release (with verify and prefill) compiled here runs,
/// as the folder the app's main download leaves and as the release itself,
/// to transformers' greedy ids.
#[test]
fn compiled_fp16_release_runs_to_transformers_greedy_ids() {
    let (four, _) = common::onto_builds();
    let rel = release(&four, "fp16", &["--layout", "four"]);
    ok(&["compile", s(&rel), "--key", s(key())]);
    let hf = PathBuf::from(
        json_file(&four.join("build.json"))["checkpoint"]["dir"]
            .as_str()
            .unwrap(),
    );
    let (_, want) = transformers_greedy(&hf, SENTENCE, TOKENS);
    let local = rel.with_file_name("main");
    let o = run(&[
        "client-check",
        s(&rel),
        "--client",
        "main",
        "--multimodal",
        "off",
        "--materialize",
        s(&local),
    ]);
    assert!(
        local
            .join("prefill_chunk1.mlmodelc/weights/weight.bin")
            .is_file(),
        "{}",
        stderr(&o)
    );
    for dir in [&local, &rel] {
        let o = run(&[
            "run",
            s(dir),
            "--prompt",
            SENTENCE,
            "--max-tokens",
            &TOKENS.to_string(),
            "--json",
        ]);
        assert!(o.status.success(), "{}: {}", dir.display(), stderr(&o));
        let r: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(r["layout"], "four");
        assert_eq!(
            ids(&r["generated_ids"]),
            want,
            "{}: tokens vs transformers",
            dir.display()
        );
    }
}

/// A package with an op that has no text form here is refused naming the
/// package, the function and the op; a file the release did not sign is
/// refused naming it. Either way the release stays as it was.
#[test]
fn what_compile_cannot_write_or_did_not_sign_is_refused_and_the_release_kept() {
    let rel = release(&common::built_all(), "refused", &[]);
    let spec = "swa/chunk2_3way.mlpackage/Data/com.apple.CoreML/model.mlmodel";
    let python = ok(&["doctor", "--venv-python"]).trim().to_string();
    let script = r#"
import sys
from coremltools.proto import Model_pb2
path = sys.argv[1]
m = Model_pb2.Model()
m.ParseFromString(open(path, "rb").read())
f = m.mlProgram.functions["main"]
op = next(o for o in f.block_specializations[f.opset].operations if o.type == "mul")
op.type = "frobnicate"
open(path, "wb").write(m.SerializeToString())
"#;
    let edited = Command::new(&python)
        .args(["-c", script, s(&rel.join(spec))])
        .output()
        .unwrap();
    assert!(
        edited.status.success(),
        "{}",
        String::from_utf8_lossy(&edited.stderr)
    );

    // Not what the release signed: refused before anything is written.
    let before = tree(&rel);
    let o = run(&["compile", s(&rel), "--key", s(key())]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains(&format!(
            "{}: differs from manifest.json's digest",
            rel.join(spec).display()
        )),
        "{}",
        stderr(&o)
    );
    assert_eq!(tree(&rel), before);

    // Listed as it now is: the writer names the op it cannot write.
    let bytes = fs::read(rel.join(spec)).unwrap();
    let mut m = json_file(&rel.join("manifest.json"));
    for f in m["files"].as_array_mut().unwrap() {
        if f["path"] == spec {
            f["size"] = bytes.len().into();
            f["sha256"] = format!("{:x}", Sha256::digest(&bytes)).into();
        }
    }
    fs::write(
        rel.join("manifest.json"),
        serde_json::to_vec_pretty(&m).unwrap(),
    )
    .unwrap();
    let before = tree(&rel);
    let o = run(&["compile", s(&rel), "--key", s(key())]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("chunk2_3way.mlpackage: function main: op frobnicate")
            && e.contains("op type 'frobnicate'"),
        "{e}"
    );
    assert_eq!(tree(&rel), before);
    assert!(!fs::read_dir(rel.parent().unwrap()).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains("staging")));
}
