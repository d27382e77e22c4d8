//! Synthetic builds: the real plan of the tiny E2B fixture (`chunkforge plan
//! --json`) with small stand-in packages, so that `package`, `verify` and
//! `--onto` run in seconds without a conversion. Shared by tests/release.rs
//! and tests/hostile.rs.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::ok;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A key pair `dir/name.pem`, `dir/name.pub`.
pub fn keys(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let prefix = dir.join(name);
    ok(&["keygen", "--out", s(&prefix)]);
    (
        dir.join(format!("{name}.pem")),
        dir.join(format!("{name}.pub")),
    )
}

/// The real plan (all layouts) of the tiny E2B fixture, computed once.
pub fn plan_json() -> &'static Value {
    static PLAN: OnceLock<Value> = OnceLock::new();
    PLAN.get_or_init(|| {
        let fx = super::fixture("e2b", &[]);
        let out = ok(&["plan", "--hf-dir", s(&fx), "--mode", "all", "--json"]);
        serde_json::from_str(&out).expect("plan --json is JSON")
    })
}

/// The tiny E2B fixture the synthetic builds name as their checkpoint (the
/// side files and hf_model/ of their releases come from it).
pub fn checkpoint_dir() -> PathBuf {
    super::fixture("e2b", &[])
}

pub fn config_sha256() -> String {
    format!(
        "{:x}",
        Sha256::digest(fs::read(checkpoint_dir().join("config.json")).unwrap())
    )
}

/// build.json's and a parity report's `checkpoint.weights` of the single-file
/// checkpoint `dir`, computed here from the format's definition.
pub fn weights_of(dir: &Path) -> Value {
    let file = format!(
        "{:x}",
        Sha256::digest(fs::read(dir.join("model.safetensors")).unwrap())
    );
    let line = format!("model.safetensors\0{file}\n");
    json!({
        "sha256": format!("{:x}", Sha256::digest(line.as_bytes())),
        "files": {"model.safetensors": file},
    })
}

/// Same digest as build.json's `sha256_tree`.
pub fn tree_digest(dir: &Path) -> String {
    let mut lines = Vec::new();
    for e in walkdir::WalkDir::new(dir).sort_by_file_name() {
        let e = e.unwrap();
        if e.file_type().is_file() {
            let rel = e
                .path()
                .strip_prefix(dir)
                .unwrap()
                .to_string_lossy()
                .to_string();
            let d = Sha256::digest(fs::read(e.path()).unwrap());
            lines.push(format!("{rel}\0{d:x}\n"));
        }
    }
    lines.sort();
    format!("{:x}", Sha256::digest(lines.concat().as_bytes()))
}

/// A build folder with the real plan and small stand-in packages (or one
/// large weight file in merged_full when `big_mib` > 0). `skip` packages are
/// left out.
pub fn synthetic_build(dir: &Path, skip: &[&str], big_mib: usize) -> PathBuf {
    let plan = plan_json().clone();
    let mut records = Vec::new();
    for l in plan["layouts"].as_array().unwrap() {
        for c in l["chunks"].as_array().unwrap() {
            let name = c["name"].as_str().unwrap();
            if skip.contains(&name) {
                continue;
            }
            let pkg = dir.join(format!("{name}.mlpackage"));
            let data = pkg.join("Data/com.apple.CoreML");
            fs::create_dir_all(data.join("weights")).unwrap();
            fs::write(
                pkg.join("Manifest.json"),
                format!("{{\"name\": \"{name}\"}}\n"),
            )
            .unwrap();
            fs::write(
                data.join("model.mlmodel"),
                format!("spec of {name}\n").repeat(50),
            )
            .unwrap();
            let len = if big_mib > 0 && name == "merged_full" {
                big_mib << 20
            } else {
                40_000
            };
            // Packages the app's downloader shares a weight blob between hold
            // the same bytes, as a real build's do (prefill_chunkN: chunkN's;
            // chunk3_3way: chunk4's); the others differ.
            let blob = match name {
                n if n.starts_with("prefill_") => &n["prefill_".len()..],
                "chunk3_3way" => "chunk4",
                n => n,
            };
            let key = blob
                .bytes()
                .fold(0u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
            let weights: Vec<u8> = (0..len)
                .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[i % 4] ^ key)
                .collect();
            fs::write(data.join("weights/weight.bin"), weights).unwrap();
            if name == "chunk1" {
                // Sorted by path components `w/b` precedes `w.b`, by bytes it
                // follows: model_signing and chunkforge must agree.
                fs::create_dir_all(data.join("w")).unwrap();
                fs::write(data.join("w/b"), "1").unwrap();
                fs::write(data.join("w.b"), "2").unwrap();
            }
            records.push(json!({
                "name": name, "layout": l["kind"], "package": format!("{name}.mlpackage"),
                "first_layer": c["first_layer"], "last_layer": c["last_layer"],
                "weight_bytes": len, "sha256_tree": tree_digest(&pkg),
            }));
        }
    }
    let build = json!({
        "format": "chunkforge-build/1",
        "tool": {"chunkforge": "0.1.0", "python": {"python": "3.11", "torch": "2.11.0", "coremltools": "9.0", "transformers": "5.5.0"}},
        "checkpoint": {"dir": s(&checkpoint_dir()), "architecture": "Gemma4ForCausalLM", "multimodal": false,
                       "config_sha256": config_sha256(), "weights": weights_of(&checkpoint_dir())},
        "request": {"mode": "all"},
        "settings": {"ctx": 2048, "minimum_deployment_target": "iOS18", "compute_precision": "FLOAT16",
                     "compute_units": "CPU_AND_NE", "quantize": true,
                     "palettization": {"nbits": 4, "granularity": "per_grouped_channel", "group_size": 32}},
        "plan": plan,
        "chunks": records,
        "audit": clean_audit(&records),
    });
    fs::write(
        dir.join("build.json"),
        serde_json::to_vec_pretty(&build).unwrap(),
    )
    .unwrap();
    dir.to_path_buf()
}

/// build.json's audit record of `chunks` without findings (a synthetic
/// build's stand-in packages are not programs to audit).
pub fn clean_audit(chunks: &[Value]) -> Value {
    let packages: serde_json::Map<String, Value> = chunks
        .iter()
        .map(|c| (c["package"].as_str().unwrap().to_string(), json!({})))
        .collect();
    json!({
        "format": chunkforge::records::AUDIT_FORMAT, "op_table_sha256": chunkforge::audit::op_table_sha256(),
        "total": 0, "errors": 0, "warnings": 0, "by_rule": {},
        "severity": {"op-type": "error", "rank": "error", "fp32": "error", "last-axis-1": "warning"},
        "packages": packages, "first": [],
        "compute_plan": {"skipped": "a synthetic build"},
    })
}

/// A synthetic build of the layouts `kinds` alone (as `build --mode both`
/// makes `two` and `one`): the plan, the package records and the audit cut
/// to them, the other packages absent.
pub fn synthetic_build_of(dir: &Path, kinds: &[&str]) -> PathBuf {
    let plan = plan_json();
    let kept = |l: &Value| kinds.contains(&l["kind"].as_str().unwrap());
    let names = |keep: bool| -> Vec<String> {
        plan["layouts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| kept(l) == keep)
            .flat_map(|l| l["chunks"].as_array().unwrap().iter())
            .map(|c| c["name"].as_str().unwrap().to_string())
            .collect()
    };
    let (mine, others) = (names(true), names(false));
    let skip: Vec<&str> = others
        .iter()
        .filter(|n| !mine.contains(n))
        .map(String::as_str)
        .collect();
    synthetic_build(dir, &skip, 0);
    let path = dir.join("build.json");
    let mut b: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    b["plan"]["layouts"]
        .as_array_mut()
        .unwrap()
        .retain(|l| kept(l));
    let chunks = b["chunks"].as_array().unwrap().clone();
    b["audit"] = clean_audit(&chunks);
    fs::write(&path, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
    dir.to_path_buf()
}
