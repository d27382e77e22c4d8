//! `chunkforge audit` on a deliberately non-ANE package: every rule reported
//! with the op that breaks it and its severity, the exit codes (errors only),
//! a build folder's packages described by its plan; and real builds whose
//! checkpoints the fixtures do not otherwise vary (every layer scalar 1.0, a
//! prefill longer than the window, E4B's structure) audited without findings.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::{fixture, ok, run, shared_build, stderr, stdout, tempdir};
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
    assert_eq!(f["severity"], "error");
    // No build.json describes it: the layer's kind is unknown.
    assert_eq!(f["layer_kind"], "unknown");
    assert_eq!(report["total"], got.len());
    // A padded last axis costs speed: the one warning; every other rule is an error.
    let severity = |rule: &str| report["severity"][rule].as_str().unwrap().to_string();
    assert_eq!(severity("last-axis-1"), "warning");
    for rule in [
        "op-type",
        "rank",
        "fp32",
        "large-dim",
        "dynamic-shape",
        "compute-plan",
    ] {
        assert_eq!(severity(rule), "error", "{rule}");
    }
    let warnings = got.iter().filter(|(r, _)| r == "last-axis-1").count();
    assert_eq!(report["warnings"], warnings);
    assert_eq!(report["errors"], got.len() - warnings);
    assert_eq!(report["packages"][0]["functions"][0]["name"], "main");
    assert_eq!(
        report["compute_plan"],
        json!({"skipped": "MLComputePlan needs macOS; this is linux"})
    );

    // The human output groups by rule, with the first finding of each.
    let o = run(&["audit", s(&pkg)]);
    assert_eq!(o.status.code(), Some(1));
    let out = stdout(&o);
    for (rule, severity) in [
        ("op-type", "error"),
        ("rank", "error"),
        ("fp32", "error"),
        ("large-dim", "error"),
        ("last-axis-1", "warning"),
        ("dynamic-shape", "error"),
    ] {
        assert!(
            out.lines().any(|l| {
                let mut words = l.split_whitespace();
                words.next() == Some(rule)
                    && words.next() == Some(severity)
                    && l.contains("first: main")
            }),
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

/// A truncated or empty `model.mlmodel` is named by `audit`, `inspect` and
/// `exec`, package and file, with what is wrong with it: protobuf's
/// "DecodeError: ... Wire format was corrupt" named neither (on a build of 13
/// packages nothing said which was broken), and an empty file was "not an ML
/// program (model type None)".
#[test]
fn a_truncated_or_empty_model_spec_is_named_by_audit_inspect_and_exec() {
    let good = bad_package();
    let d = tempdir("spec-cut");
    let spec = "Data/com.apple.CoreML/model.mlmodel";
    for (tag, says) in [
        (
            "half",
            "bytes) is truncated or corrupt, not a Core ML model spec (",
        ),
        ("empty", "is empty (0 bytes): the package has no model spec"),
    ] {
        let pkg = d.join(format!("{tag}.mlpackage"));
        common::copy_tree(&good, &pkg);
        let f = pkg.join(spec);
        let bytes = fs::read(&f).unwrap();
        let keep = if tag == "half" { bytes.len() / 2 } else { 0 };
        fs::remove_file(&f).unwrap();
        fs::write(&f, &bytes[..keep]).unwrap();
        let want = format!("{}: {spec} ", pkg.display());
        let out = d.join("out.npz");
        for args in [
            vec!["audit", s(&pkg)],
            vec!["inspect", s(&pkg)],
            vec!["exec", s(&pkg), "--inputs", s(&f), "--output", s(&out)],
        ] {
            let o = run(&args);
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
            assert!(e.contains(&want) && e.contains(says), "{args:?}: {e}");
            assert!(
                !e.contains("DecodeError: ") && !e.contains("Traceback"),
                "{e}"
            );
        }
    }
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

/// A package whose one finding is a padded last axis: a warning, listed, and
/// `audit` exits 0 (its exit status follows errors only).
#[test]
fn audit_exits_0_on_warnings_alone() {
    const SCRIPT: &str = r#"
import sys
import numpy as np
import coremltools as ct
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

@mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 128), dtype=types.fp16)], opset_version=ct.target.iOS18)
def prog(x):
    w = mb.const(val=np.ones((64, 64, 1, 1), dtype=np.float16), name="layers_0_o_proj_weight")
    h = mb.conv(x=x, weight=w, name="l0_conv")
    return mb.reshape(x=h, shape=[1, 8192, 1], name="l0_column")

ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
           pass_pipeline=ct.PassPipeline.EMPTY).save(sys.argv[1])
"#;
    let pkg = tempdir("audit-warning").join("column.mlpackage");
    let o = std::process::Command::new(common::venv_python())
        .args(["-c", SCRIPT])
        .arg(&pkg)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&["audit", s(&pkg)]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{out}{}", stderr(&o));
    assert!(
        out.contains("column.mlpackage: main 2 ops; 1 warning (last-axis-1 1)")
            && out.contains("total: 1 warning (last-axis-1 1) in 1 packages")
            && out.contains("warnings cost speed, not a working package: no errors, exit 0"),
        "{out}"
    );
    let report: Value = serde_json::from_str(&stdout(&run(&["audit", s(&pkg), "--json"]))).unwrap();
    assert_eq!(
        (&report["errors"], &report["warnings"]),
        (&json!(0), &json!(1))
    );
}

/// The window-8 E2B-structure checkpoint with every layer scalar 1.0
/// (transformers' default, and what bf16 rounds a scalar within 0.4 % of 1
/// to): coremltools then drops each `h * 1.0`, so each layer ends in its
/// residual `add`. The 16-token prefill is longer than the window (the
/// sliding layers' band). Its `--mode all` build has no findings, packages
/// without `--allow-audit-findings`, and its programs pass the interpreter's
/// parity, prefill included. E4B's structure (the two-chunk build parity uses)
/// has no findings either.
#[test]
fn unit_layer_scalars_and_a_prefill_past_the_window_audit_clean_and_package() {
    let w8 = fixture("e2b-w8", &["--sliding-window", "8"]);
    let ck = common::unit_scalar_fixture("e2b-w8-unit-scalars", &w8);
    let args = [
        "--mode",
        "all",
        "--prefill-len",
        "16",
        "--no-quantize",
        "--ctx",
        "256",
    ];
    let build = shared_build("w8-unit-scalars-all-fp16", &ck, &args);
    let record = common::json_file(&build.join("build.json"));
    assert_eq!(record["audit"]["total"], 0, "{}", record["audit"]);
    assert_eq!(record["audit"]["packages"].as_object().unwrap().len(), 13);
    let o = run(&["audit", s(&build)]);
    assert!(o.status.success(), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("no findings in 13 packages"),
        "{}",
        stdout(&o)
    );

    let d = tempdir("unit-scalars-release");
    let key = d.join("k");
    ok(&["keygen", "--out", s(&key)]);
    let rel = d.join("rel");
    let o = run(&[
        "package",
        s(&build),
        "--layout",
        "all",
        "--allow-over-ceiling",
        "--key",
        &format!("{}.pem", key.display()),
        "--output",
        s(&rel),
        "--hf-dir",
        s(&ck),
    ]);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    // Neither refused, nor shipped with findings, nor audited again.
    for said in ["audit errors", "audit warnings", "audited its packages"] {
        assert!(!e.contains(said), "{e}");
    }
    assert!(rel.join("model.sig").is_file());

    // The interpreter runs the packages' own programs: the prefill band and
    // the layers without a scalar multiplication compute what the checkpoint does.
    let o = run(&[
        "parity",
        "--hf-dir",
        s(&ck),
        "--mode",
        "all",
        "--prefill-len",
        "16",
        "--prefill",
        "10",
        "--steps",
        "12",
        "--no-oracle",
        "--artifacts",
        s(&build),
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}{}", stderr(&o));
    for line in ["program prefill_b16 fp32", "program one       fp32"] {
        let l = out
            .lines()
            .find(|l| l.starts_with(line))
            .unwrap_or_else(|| panic!("{line}:\n{out}"));
        assert!(
            l.ends_with(" OK") && l.contains("tokens match: true"),
            "{l}"
        );
    }

    let e4b = fixture(
        "e4b-mm",
        &["--shape", "e4b", "--multimodal", "--shards", "3"],
    );
    let e4b_two = shared_build("e4b-two-fp16", &e4b, &["--mode", "two", "--no-quantize"]);
    let audit = &common::json_file(&e4b_two.join("build.json"))["audit"];
    assert_eq!(audit["total"], 0, "{audit}");
}

/// E4B's verify_qK: 4 query heads per KV head (2 at the fixture's widths)
/// fold into the rows of one attention matmul, and its mask with them.
/// Repeated, that mask was a `tile` of chunk3's only full layer, L29, which
/// shares its KV: an op type the device-proven graphs have in no KV-sharing
/// layer, so the full-size E4B build's audit refused it. Concatenated, it
/// audits clean.
#[test]
fn e4b_verify_groups_query_heads_without_tile() {
    let e4b = fixture(
        "e4b-mm",
        &["--shape", "e4b", "--multimodal", "--shards", "3"],
    );
    let four = shared_build(
        "e4b-four-verify-fp16",
        &e4b,
        &["--mode", "four", "--verify-k", "3", "--no-quantize"],
    );
    let build = common::json_file(&four.join("build.json"));
    assert_eq!(build["audit"]["total"], 0, "{}", build["audit"]);
}
