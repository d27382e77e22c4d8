//! `chunkforge audit` on a deliberately non-ANE package: every rule reported
//! with the op that breaks it, the exit codes, and a build folder's packages
//! described by its plan.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::{ok, run, stderr, stdout, tempdir};
use serde_json::{json, Value};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn bad_package() -> PathBuf {
    let dir = common::builds_dir().join("audit");
    fs::create_dir_all(&dir).unwrap();
    common::non_ane_package(&dir.join("non_ane.mlpackage"))
}

/// (rule, op) of every finding of `--json`.
fn found(report: &Value) -> Vec<(String, String)> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["rule"].as_str().unwrap().to_string(),
                f["op"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

#[test]
fn audit_reports_every_rule_on_a_non_ane_package() {
    let pkg = bad_package();
    let o = run(&["audit", s(&pkg), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let report: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let got = found(&report);
    for (rule, op) in [
        ("op-type", "l0_linear"),
        ("rank", "l0_rank5"),
        ("fp32", "x"),
        ("fp32", "l0_fp32"),
        ("large-dim", "l0_wide"),
        ("last-axis-1", "l0_column"),
        ("dynamic-shape", "n"),
        ("dynamic-shape", "l0_dynamic"),
    ] {
        assert!(
            got.contains(&(rule.to_string(), op.to_string())),
            "{rule} on {op} missing from {got:?}"
        );
    }
    let f = &report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["op"] == "l0_linear")
        .unwrap();
    assert_eq!(f["package"], "non_ane.mlpackage");
    assert_eq!(f["function"], "main");
    assert_eq!(f["op_type"], "linear");
    assert_eq!(f["layer"], "0");
    // No build.json describes it: the layer's kind is unknown.
    assert_eq!(f["layer_kind"], "unknown");
    assert_eq!(report["total"], got.len());
    assert_eq!(report["packages"][0]["functions"][0]["name"], "main");
    assert_eq!(
        report["compute_plan"],
        json!({"skipped": "MLComputePlan needs macOS; this is linux"})
    );

    // The human output groups by rule, with the first finding of each.
    let o = run(&["audit", s(&pkg)]);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    for rule in [
        "op-type",
        "rank",
        "fp32",
        "large-dim",
        "last-axis-1",
        "dynamic-shape",
    ] {
        assert!(
            out.lines()
                .any(|l| l.trim_start().starts_with(rule) && l.contains("first: main")),
            "{rule}: {out}"
        );
    }
    assert!(
        out.contains("compute plan: skipped (MLComputePlan needs macOS; this is linux)"),
        "{out}"
    );
}

#[test]
fn audit_refuses_what_is_neither_a_build_nor_a_package() {
    let d = tempdir("audit-bad");
    for p in [d.join("nothing"), d.clone()] {
        let o = run(&["audit", s(&p)]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(
            e.contains(&format!(
                "{}: neither a build folder (no build.json in it) nor an .mlpackage folder",
                p.display()
            )),
            "{e}"
        );
    }
    // A package folder that is not one.
    let fake = d.join("fake.mlpackage");
    fs::create_dir_all(&fake).unwrap();
    let o = run(&["audit", s(&fake)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("fake.mlpackage: not a readable .mlpackage"),
        "{}",
        stderr(&o)
    );
}

/// A build folder: the packages build.json lists, each layer's kind from its
/// plan; `--print-op-types` lists the op types per layer kind.
#[test]
fn audit_of_a_build_folder_reads_layer_kinds_from_its_plan() {
    let d = tempdir("audit-build");
    let plan: Value = serde_json::from_str(&ok(&["plan", "--mode", "two", "--json"])).unwrap();
    let pkg = d.join("merged_chunk1.mlpackage");
    copy_dir(&bad_package(), &pkg);
    let build = json!({
        "format": "chunkforge-build/1",
        "tool": {"chunkforge": "0.1.0", "python": {}},
        "checkpoint": {"dir": "/nowhere"},
        "request": {"mode": "two"},
        "settings": {"ctx": 2048, "minimum_deployment_target": "iOS18", "compute_precision": "FLOAT16",
                     "compute_units": "CPU_AND_NE", "quantize": false, "palettization": null},
        "plan": plan,
        "chunks": [{"name": "merged_chunk1", "layout": "two", "package": "merged_chunk1.mlpackage",
                    "first_layer": 0, "last_layer": 14, "weight_bytes": 0, "sha256_tree": ""}],
    });
    fs::write(d.join("build.json"), build.to_string()).unwrap();
    let o = run(&["audit", s(&d), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let report: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let linear = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["op"] == "l0_linear")
        .unwrap();
    assert_eq!(linear["package"], "merged_chunk1.mlpackage");
    // Layer 0 of the default checkpoint is a sliding layer with its own KV.
    assert_eq!(linear["layer_kind"], "sliding");
    assert!(linear["detail"].as_str().unwrap().contains("`sliding`"));

    let o = run(&["audit", s(&d), "--print-op-types"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let types: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let sliding: Vec<&str> = types["layer_kinds"]["sliding"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        sliding.contains(&"linear") && sliding.contains(&"tile"),
        "{sliding:?}"
    );
    assert_eq!(types["output_dtypes"]["cast"], json!(["fp16", "fp32"]));

    // A package build.json lists but the folder lacks.
    fs::remove_dir_all(&pkg).unwrap();
    let o = run(&["audit", s(&d)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("merged_chunk1.mlpackage: missing"),
        "{}",
        stderr(&o)
    );
}

fn copy_dir(from: &Path, to: &Path) {
    for e in walkdir::WalkDir::new(from) {
        let e = e.unwrap();
        let dst = to.join(e.path().strip_prefix(from).unwrap());
        if e.file_type().is_dir() {
            fs::create_dir_all(&dst).unwrap();
        } else {
            fs::copy(e.path(), &dst).unwrap();
        }
    }
}
