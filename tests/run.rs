//! `chunkforge run` on real releases of the built-in checkpoint: the folder
//! alone generates exactly transformers' greedy tokens (FP16 packages), in
//! every layout and with speculative verify; INT4 agreement is measured; a
//! missing or damaged side file or tokenizer fails `run` naming it and
//! `verify` reports it.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use common::{
    counting, ids, json_file, ok, run, stderr, stdout, tempdir, transformers_greedy, NEXT,
    SENTENCE, TOKENS,
};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The signing key pair of this file's releases, kept beside them (a release
/// cached by an earlier test run verifies with the key it was signed with).
fn keys() -> &'static (PathBuf, PathBuf) {
    static KEYS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    KEYS.get_or_init(|| {
        let d = common::builds_dir().join("run-keys");
        let (private, public) = (d.join("k.pem"), d.join("k.pub"));
        if !private.exists() || !public.exists() {
            let _ = fs::remove_dir_all(&d);
            fs::create_dir_all(&d).unwrap();
            ok(&["keygen", "--out", s(&d.join("k"))]);
        }
        (private, public)
    })
}

static RELEASE_LOCK: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// A `--layout all` release of `build`, packaged once per test run (the
/// build is cached across runs, the release never: it is what is tested).
fn release_of(build: &Path, tag: &str) -> PathBuf {
    let mut made = RELEASE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let out = build.with_file_name(format!("release-{tag}"));
    if made.insert(tag.to_string()) {
        ok(&[
            "package",
            s(build),
            "--layout",
            "all",
            "--allow-over-ceiling",
            "--key",
            s(&keys().0),
            "--output",
            s(&out),
        ]);
    }
    out
}

/// Where the FP16 build and its release live (shared by this file's tests).
fn fp16_dir() -> PathBuf {
    common::builds_dir().join("default-all-fp16")
}

/// `release --no-quantize` of the built-in checkpoint: build --mode all (kept
/// across test runs and reused), the parity gate, package and sign, once per
/// test run.
fn fp16_release() -> PathBuf {
    let mut made = RELEASE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let out = fp16_dir().join("release");
    if made.insert("fp16".to_string()) {
        let build = fp16_dir().join("build");
        let o = run(&[
            "release",
            "--no-quantize",
            "--layout",
            "all",
            "--allow-over-ceiling",
            "--key",
            s(&keys().0),
            "--output",
            s(&out),
            "--build-dir",
            s(&build),
            "--reuse-build",
            "--eval",
        ]);
        let e = stderr(&o);
        assert!(o.status.success(), "release: {}\n{e}", stdout(&o));
        assert!(e.contains("release 3/3"), "{e}");
        assert!(stdout(&o).contains("PARITY OK"), "{}", stdout(&o));
        // The gate ran every FP16 package's own program through the MIL
        // interpreter: in fp32 it computes the fp32 reference to 0.9999, token
        // for token, in every layout and function.
        let report = json_file(&build.join("parity.json"));
        let programs = report["summary"]["programs"].as_object().unwrap();
        for target in ["four", "three", "two", "one", "verify_qK", "prefill_b512"] {
            let p = &programs[target]["fp32"];
            assert_eq!(p["ok"], true, "{target}: {p}");
            if !matches!(target, "verify_qK" | "prefill_b512") {
                let c = p["min_cos_reference"].as_f64().unwrap();
                assert!(c >= 0.9999, "{target}: {p}");
                assert_eq!(p["top1_reference"], 1.0, "{target}: {p}");
            }
        }
        // The parity report is embedded; the packages are not compiled on Linux.
        let m = json_file(&out.join("manifest.json"));
        assert_eq!(m["parity"]["ok"], true);
        // --eval: what the release costs against its source, in fp16 arithmetic,
        // over the project's text, recorded in the signed manifest.
        let eval = &m["eval"];
        assert_eq!(
            (eval["precision"].as_str(), eval["fp16"].as_bool()),
            (Some("FP16"), Some(true)),
            "{eval}"
        );
        assert_eq!(eval["text"]["name"], "default");
        assert_eq!(eval["fp16_ok"], true);
        assert!(
            eval["fp16_nearest"]["margin_log2"].as_f64().unwrap() > 1.0,
            "{eval}"
        );
        for l in eval["layouts"].as_array().unwrap() {
            assert!(l["top1"].as_f64().unwrap() >= 0.9, "{l}");
        }
        assert_eq!(
            json_file(&build.join("eval.json"))["format"],
            "chunkforge-eval/1"
        );
        assert_eq!(m["compiled"]["mlmodelc"], false);
        assert!(m["compiled"]["note"]
            .as_str()
            .unwrap()
            .contains("not compiled"));
    }
    out
}

/// `release` refuses to sign when parity fails, and leaves no folder.
#[test]
fn release_refuses_to_sign_when_parity_fails() {
    fp16_release();
    let out = tempdir("release-fail").join("rel");
    let o = run(&[
        "release",
        "--no-quantize",
        "--layout",
        "two",
        "--key",
        s(&keys().0),
        "--output",
        s(&out),
        "--build-dir",
        s(&fp16_dir().join("build")),
        "--reuse-build",
        "--steps",
        "4",
        "--corrupt-layer",
        "20",
    ]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(stdout(&o).contains("PARITY FAIL"), "{}", stdout(&o));
    assert!(e.contains("parity failed; nothing was signed"), "{e}");
    assert!(!out.exists());
    // A build made with other settings is not reused, nor one made with
    // another conversion option release takes: refused (exit 2) naming it.
    let fp16_build = fp16_dir().join("build");
    let refused = |options: &[&str], says: &str| {
        let mut args = vec!["release", "--layout", "two", "--key", s(&keys().0)];
        args.extend_from_slice(options);
        args.extend([
            "--output",
            s(&out),
            "--build-dir",
            s(&fp16_build),
            "--reuse-build",
        ]);
        let o = run(&args);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{e}");
        assert!(e.contains("--reuse-build") && e.contains(says), "{e}");
    };
    refused(&[], "quantize false");
    refused(
        &["--no-quantize", "--pass-pipeline", "coremltools"],
        "pass pipeline chunkforge (asked coremltools)",
    );
}

/// `run --json` of `release` with `args`.
fn generate(release: &Path, args: &[&str]) -> Value {
    generate_logged(release, args).0
}

/// `run --json` of `release` with `args`: its JSON and its stderr.
fn generate_logged(release: &Path, args: &[&str]) -> (Value, String) {
    let mut a = vec!["run", s(release), "--max-tokens", "16", "--json"];
    a.extend_from_slice(args);
    let o = run(&a);
    assert!(o.status.success(), "{a:?}: {}", stderr(&o));
    let json = serde_json::from_str(&stdout(&o)).expect("run --json prints JSON");
    (json, stderr(&o))
}

/// The low-memory oracle of real-size checks (scripts/oracle_greedy.py:
/// transformers' model with its decoder layers' weights loaded per call and
/// only the called rows of the per-layer table) generates what transformers'
/// own `from_pretrained` + `generate` does.
#[test]
fn low_memory_oracle_generates_what_transformers_does() {
    let build = fp16_dir().join("build");
    fp16_release();
    let checkpoint = checkpoint_of(&build);
    let want = transformers_greedy(&checkpoint, SENTENCE, TOKENS);
    let python = ok(&["doctor", "--venv-python"]).trim().to_string();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/oracle_greedy.py");
    let o = Command::new(python)
        .args([s(&script), s(&checkpoint), SENTENCE, &TOKENS.to_string()])
        .output()
        .expect("run the venv python");
    assert!(o.status.success(), "oracle_greedy.py: {}", stderr(&o));
    let v: Value = serde_json::from_str(stdout(&o).lines().last().unwrap()).unwrap();
    assert_eq!((ids(&v["prompt"]), ids(&v["generated"])), want);
}

fn checkpoint_of(build: &Path) -> PathBuf {
    PathBuf::from(
        json_file(&build.join("build.json"))["checkpoint"]["dir"]
            .as_str()
            .unwrap(),
    )
}

/// The FP16 release alone reproduces transformers' greedy generation token
/// for token: every layout, the one picked by file presence, and speculative
/// decoding through verify_q3.
#[test]
fn fp16_release_generates_transformers_tokens_in_every_layout() {
    let release = fp16_release();
    let (prompt, want) =
        transformers_greedy(&checkpoint_of(&fp16_dir().join("build")), SENTENCE, TOKENS);
    assert_eq!(want.len(), TOKENS, "the checkpoint should not stop early");
    let distinct: std::collections::BTreeSet<_> = want.iter().collect();
    assert!(
        distinct.len() >= 2,
        "a constant continuation would hide a broken KV hand-off: {want:?}"
    );
    let cases: [(&str, &[&str]); 6] = [
        ("auto", &[]),
        ("four", &["--layout", "four"]),
        ("three", &["--layout", "three"]),
        ("two", &["--layout", "two"]),
        ("one", &["--layout", "one"]),
        ("four", &["--speculate", "3"]),
    ];
    for (layout, extra) in cases {
        let mut args = vec!["--prompt", SENTENCE];
        args.extend_from_slice(extra);
        let r = generate(&release, &args);
        // auto: all layouts are present, so the three-chunk one wins, as on the phone.
        let expect = if layout == "auto" { "three" } else { layout };
        assert_eq!(r["layout"], expect, "{extra:?}");
        assert_eq!(
            ids(&r["prompt_ids"]),
            prompt,
            "{extra:?}: the release's tokenizer"
        );
        assert_eq!(
            ids(&r["generated_ids"]),
            want,
            "{extra:?}: tokens vs transformers"
        );
        let margins = r["margins"].as_array().unwrap();
        assert_eq!(margins.len(), TOKENS);
        assert!(
            margins.iter().all(|m| m.as_f64().unwrap() >= 0.0),
            "{margins:?}"
        );
        let text = r["text"].as_str().unwrap();
        assert_counts_on(text, &format!("{extra:?}"));
        if extra.contains(&"--speculate") {
            let sp = &r["speculation"];
            assert_eq!(sp["k"], 3);
            assert!(sp["calls"].as_u64().unwrap() >= 1);
            // Drafts were accepted: verify's rows were committed for more than one token per call.
            assert!(sp["accepted_drafts"].as_u64().unwrap() >= 1, "{sp}");
            // Main's commit: the accepted rows only.
            assert_eq!(sp["commit"], "accepted-rows", "{sp}");
            assert_eq!(sp["stale_rows"], 0, "{sp}");
        }
    }
    // The branch's speculative decode commits as its verifyCandidates does:
    // the whole K_*_out caches copied back after every call (write-through),
    // the position advanced past the accepted tokens only, so every
    // rejected draft's row stays in the window caches.
    let r = generate(
        &release,
        &[
            "--prompt",
            SENTENCE,
            "--runtime",
            "branch",
            "--speculate",
            "3",
        ],
    );
    let sp = &r["speculation"];
    assert_eq!(
        (&r["layout"], &r["download"], &sp["commit"]),
        (
            &Value::from("four"),
            &Value::from("branch"),
            &Value::from("write-through")
        ),
        "{r}"
    );
    let n = |k: &str| sp[k].as_u64().unwrap();
    assert!(n("calls") >= 1, "{sp}");
    assert_eq!(
        n("stale_rows"),
        3 * n("calls") - n("calls") - n("accepted_drafts"),
        "{sp}"
    );
    if n("stale_rows") == 0 {
        assert_eq!(ids(&r["generated_ids"]), want, "no draft rejected: {sp}");
    }
    eprintln!(
        "branch --speculate 3: {} stale rows; tokens {:?} (transformers {:?})",
        n("stale_rows"),
        ids(&r["generated_ids"]),
        want
    );
    // Each runtime build picks its own layout in this folder and reads the
    // weight blobs its download links or copies: main the three-chunk decode
    // from the 3-way entry (prefill_chunk4 <- chunk3_3way), the branch
    // merged_full from its entry (prefill_chunkN <- chunkN).
    for (runtime, layout, chunks, download) in [
        (
            "main",
            "three",
            serde_json::json!(["chunk1", "chunk2_3way", "chunk3_3way"]),
            "main-3way",
        ),
        (
            "branch",
            "one",
            serde_json::json!(["merged_full"]),
            "branch",
        ),
    ] {
        let r = generate(&release, &["--prompt", SENTENCE, "--runtime", runtime]);
        assert_eq!(r["layout"], layout, "{runtime}");
        assert_eq!(r["chunks"], chunks, "{runtime}");
        assert_eq!(r["download"], download, "{runtime}");
        assert_eq!(ids(&r["generated_ids"]), want, "{runtime}");
    }
    // A layout the runtime build does not load is refused before any work.
    let o = run(&[
        "run",
        s(&release),
        "--prompt",
        SENTENCE,
        "--runtime",
        "main",
        "--layout",
        "two",
    ]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("does not load the two layout") && e.contains("three, four"),
        "{e}"
    );
    // --prompt-ids gives the same as the text it encodes.
    let joined = prompt
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let (r, e) = generate_logged(&release, &["--prompt-ids", &joined, "--layout", "two"]);
    assert_eq!(ids(&r["generated_ids"]), want);
    // Progress on stderr (a log here, not a terminal): the prefill call, then
    // each decode step, with the resident memory; stdout stays the JSON.
    let told = |what: &str| e.lines().filter(|l| l.contains(what)).count();
    assert_eq!(told("run: prefill: "), 1, "{e}");
    assert_eq!(told("run: decode: token "), TOKENS - 1, "{e}");
    assert!(
        e.contains("of at most 16 (position ") && e.contains("GiB peak so far"),
        "{e}"
    );
}

/// `text`, a continuation of [`SENTENCE`], is the right count (16 tokens
/// end inside a number: a prefix of it).
fn assert_counts_on(text: &str, what: &str) {
    let want = format!(" {}", counting(NEXT, 20));
    assert!(
        text.len() > 20 && want.starts_with(text),
        "{what}: {text:?} is not the count from {NEXT} ({want:?})"
    );
}

/// The INT4 release continues the synthetic task correctly in every layout
/// (the task's answer, not transformers'), and its tokens are transformers'.
#[test]
fn int4_release_continues_the_count() {
    let build = common::built_all();
    let release = release_of(&build, "int4");
    let (_, want) = transformers_greedy(&checkpoint_of(&build), SENTENCE, TOKENS);
    for layout in ["four", "three", "two", "one"] {
        let r = generate(&release, &["--prompt", SENTENCE, "--layout", layout]);
        assert_counts_on(r["text"].as_str().unwrap(), &format!("INT4 {layout}"));
        assert_eq!(ids(&r["generated_ids"]), want, "INT4 {layout}");
    }
}

/// The free-running gate: the FP16 release generates 64 tokens of the
/// synthetic task greedily, exactly transformers' on the source checkpoint,
/// and the INT4 release passes too (a divergence would pass only at a
/// near-tie). The transcript carries both streams, the margins, versions and
/// the checkpoint's digests, and `device-report` holds a device's tokens to
/// it: the same tokens pass, one changed token fails naming its position,
/// and a log without the tokens line fails.
#[test]
fn free_running_gate_passes_and_device_report_replays_the_transcript() {
    let dir = tempdir("gate");
    let gate = |release: &Path, name: &str| -> Value {
        let transcript = dir.join(format!("{name}.json"));
        let o = run(&[
            "run",
            s(release),
            "--prompt",
            SENTENCE,
            "--max-tokens",
            "64",
            "--against-source",
            "--transcript",
            s(&transcript),
            "--json",
        ]);
        let (out, e) = (stdout(&o), stderr(&o));
        assert_eq!(o.status.code(), Some(0), "{name}: {out}\n{e}");
        let r: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            r["gate"],
            json_file(&transcript),
            "{name}: --json carries the transcript"
        );
        assert!(
            r["text"]
                .as_str()
                .unwrap()
                .starts_with(&format!(" {}", counting(NEXT, 8))),
            "{name}: {}",
            r["text"]
        );
        json_file(&transcript)
    };
    let t = gate(&fp16_release(), "fp16");
    assert_eq!(t["format"], "chunkforge-transcript/1");
    assert_eq!(t["judged"]["pass"], true, "{t}");
    assert_eq!(
        t["judged"]["equal"], 64,
        "FP16: every token transformers': {t}"
    );
    assert!(t["judged"]["divergence"].is_null());
    assert_eq!(t["release"]["ids"], t["source"]["ids"]);
    assert_eq!(t["source"]["margins"].as_array().unwrap().len(), 64);
    assert_eq!(t["near_tie"], 0.1);
    assert!(!t["prompt_ids"].as_array().unwrap().is_empty());
    assert_eq!(
        t["checkpoint"]["weights"]["sha256"].as_str().unwrap().len(),
        64
    );
    assert!(t["tool"]["python"]["transformers"].is_string());
    let int4 = gate(&release_of(&common::built_all(), "int4"), "int4");
    assert_eq!(int4["judged"]["pass"], true, "{int4}");

    // The device's tokens: the FP16 stream, as a device that matched would log them.
    let source: Vec<i64> = ids(&t["source"]["ids"]);
    let log = |name: &str, tokens: &[i64]| {
        let path = dir.join(name);
        let line: Vec<String> = tokens.iter().map(i64::to_string).collect();
        fs::write(
            &path,
            format!(
                "[Load] something\n2026-01-01 12:00:00 app[1] [Gate] tokens: {}\n",
                line.join(" ")
            ),
        )
        .unwrap();
        path
    };
    let transcript = dir.join("fp16.json");
    let report = |logs: &[&Path]| {
        let mut a = vec!["device-report", "--transcript", s(&transcript)];
        a.extend(logs.iter().map(|p| s(p)));
        run(&a)
    };
    let same = log("same.log", &source);
    let o = report(&[&same]);
    assert_eq!(o.status.code(), Some(0), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("PASS: the device's 64 tokens equal transformers'"),
        "{}",
        stdout(&o)
    );
    let mut changed = source.clone();
    changed[10] = (changed[10] + 1) % 1000;
    let other = log("changed.log", &changed);
    let o = report(&[&same, &other]);
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("FAIL: the device parts from transformers at token 10 of 64"),
        "{out}"
    );
    let none = dir.join("none.log");
    fs::write(&none, "[Load] nothing else\n").unwrap();
    let o = report(&[&none]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stdout(&o).contains("no `[Gate] tokens:` line"),
        "{}",
        stdout(&o)
    );
}

/// `eval`: what INT4 and FP16 cost against the source, per layout, over a
/// text of the counting task (`--text`: its right continuation is known, so
/// the source's perplexity says the checkpoint learned it); with `--fp16`
/// the range of every fp16 op output.
/// `package --eval-report` records the figures in the signed manifest, and
/// a report about other packages is refused naming it.
#[test]
fn eval_reports_what_int4_and_fp16_cost_and_the_manifest_records_it() {
    let build = common::built_all();
    let int4 = release_of(&build, "int4");
    let fp16 = fp16_release();
    let dir = tempdir("eval");
    let text = dir.join("count.txt");
    fs::write(&text, counting(186, 40)).unwrap();
    let eval = |release: &Path, name: &str, extra: &[&str]| -> (Value, String) {
        let report = dir.join(format!("{name}.json"));
        let mut a = vec![
            "eval",
            s(release),
            "--text",
            s(&text),
            "--max-tokens",
            "48",
            "--report",
            s(&report),
        ];
        a.extend_from_slice(extra);
        let o = run(&a);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        (json_file(&report), stdout(&o))
    };
    let (q, table) = eval(&int4, "int4", &["--fp16"]);
    let (f, _) = eval(&fp16, "fp16", &[]);
    for (r, precision) in [(&q, "INT4"), (&f, "FP16")] {
        assert_eq!(r["format"], "chunkforge-eval/1");
        assert_eq!(r["precision"], precision);
        assert_eq!(
            (r["tokens"].as_u64(), r["positions"].as_u64()),
            (Some(48), Some(47))
        );
        assert_eq!(r["text"]["name"], s(&text));
        let source = r["source"]["perplexity"].as_f64().unwrap();
        // The trained task: each next token all but certain once the count
        // has started (a model that had not learned it scores near the
        // vocabulary's 1024; on held-out prose this one scores about 240).
        assert!(source > 1.0 && source < 2.0, "{r}");
        let layouts: Vec<&str> = r["layouts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["layout"].as_str().unwrap())
            .collect();
        assert_eq!(layouts, ["four", "three", "two", "one"]);
    }
    for l in q["layouts"].as_array().unwrap() {
        let (kl, kl_max, top1) = (
            l["kl_mean"].as_f64().unwrap(),
            l["kl_max"].as_f64().unwrap(),
            l["top1"].as_f64().unwrap(),
        );
        assert!(kl > 0.0 && kl_max >= kl, "{l}");
        assert!(top1 >= 0.8, "INT4 {l}");
        let disagree = l["disagreements"].as_array().unwrap();
        assert_eq!(
            disagree.len(),
            ((1.0 - top1) * 47.0).round() as usize,
            "{l}"
        );
        assert!(
            table.contains(&format!("\n{:<7}", l["layout"].as_str().unwrap())),
            "{table}"
        );
    }
    for (l, m) in f["layouts"]
        .as_array()
        .unwrap()
        .iter()
        .zip(q["layouts"].as_array().unwrap())
    {
        // FP16 weights in fp32 arithmetic: the source's answers (a disagreement
        // only at a near-tie, which rounding may cross), at a fraction of INT4's cost.
        for d in l["disagreements"].as_array().unwrap() {
            assert!(d["source_margin"].as_f64().unwrap() < 0.1, "FP16 {l}");
        }
        assert!(
            l["kl_mean"].as_f64().unwrap() < m["kl_mean"].as_f64().unwrap() / 10.0,
            "{l} vs INT4 {m}"
        );
    }
    // The fp16 range: the nearest op named with its layer and margin, nothing overflowing.
    let range = &q["fp16_range"];
    assert_eq!(range["ok"], true, "{range}");
    let nearest = &range["closest"][0];
    assert!(nearest["margin_log2"].as_f64().unwrap() > 1.0, "{nearest}");
    assert!(
        !nearest["op"].as_str().unwrap().is_empty()
            && !nearest["layer"].as_str().unwrap().is_empty()
    );
    assert!(range["every"].as_array().unwrap().len() > 1000);
    assert!(
        table.contains("fp16 range: nearest to overflow (65504): "),
        "{table}"
    );
    assert!(f["fp16_range"].is_null());

    // The manifest records the figures; a report of FP16 packages is not the INT4 build's.
    let out = dir.join("release");
    let package = |report: &Path, output: &Path| {
        run(&[
            "package",
            s(&build),
            "--layout",
            "all",
            "--allow-over-ceiling",
            "--key",
            s(&keys().0),
            "--output",
            s(output),
            "--eval-report",
            s(report),
        ])
    };
    let o = package(&dir.join("int4.json"), &out);
    assert!(o.status.success(), "{}", stderr(&o));
    ok(&["verify", s(&out), "--public-key", s(&keys().1)]);
    let m = json_file(&out.join("manifest.json"));
    assert_eq!(m["eval"]["precision"], "INT4");
    assert_eq!(m["eval"]["layouts"].as_array().unwrap().len(), 4);
    assert_eq!(
        m["eval"]["layouts"][0]["perplexity"],
        q["layouts"][0]["perplexity"]
    );
    assert_eq!(m["eval"]["fp16_nearest"], q["fp16_range"]["closest"][0]);
    let refused = dir.join("refused");
    let o = package(&dir.join("fp16.json"), &refused);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("fp16.json: evaluated FP16 packages, the build's are INT4"),
        "{e}"
    );
    assert!(!refused.exists());
}

/// Removing or truncating any side file, or the tokenizer, fails `run`
/// naming the file, and `verify` reports it.
#[test]
fn damaged_side_files_fail_run_and_verify_by_name() {
    let release = fp16_release();
    let files = [
        "embed_tokens_q8.bin",
        "embed_tokens_scales.bin",
        "embed_tokens_per_layer_q8.bin",
        "embed_tokens_per_layer_scales.bin",
        "per_layer_projection.bin",
        "per_layer_norm_weight.bin",
        "swa/cos_sliding.npy",
        "swa/sin_sliding.npy",
        "swa/cos_full.npy",
        "swa/sin_full.npy",
        "model_config.json",
        "hf_model/tokenizer.json",
    ];
    let w = tempdir("run-damaged");
    for (i, name) in files.iter().enumerate() {
        for damage in ["remove", "truncate"] {
            let copy = w.join(format!("r{i}-{damage}"));
            copy_dir(&release, &copy);
            let target = copy.join(name);
            // The copy's files are hard links: replace the target, never write through it.
            let bytes = fs::read(&target).unwrap();
            fs::remove_file(&target).unwrap();
            if damage == "truncate" {
                fs::write(&target, &bytes[..bytes.len() - 1]).unwrap();
            }
            let o = run(&["run", s(&copy), "--prompt", SENTENCE, "--max-tokens", "2"]);
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{damage} {name}: {e}");
            assert!(
                e.contains(name),
                "{damage} {name}: run's error names it: {e}"
            );
            assert!(!e.contains("Traceback"), "{e}");
            let o = run(&["verify", s(&copy), "--public-key", s(&keys().1)]);
            let out = format!("{}{}", stdout(&o), stderr(&o));
            assert_eq!(o.status.code(), Some(1), "{damage} {name}: {out}");
            assert!(
                out.contains(name),
                "{damage} {name}: verify names it: {out}"
            );
            fs::remove_dir_all(&copy).unwrap();
        }
    }
}

/// A side file that is a symlink out of the release folder (same contents)
/// fails `run` naming it, as `verify` refuses the folder: `run` promises to
/// read the release folder alone (it followed the link and exited 0).
#[test]
fn run_refuses_symlinks_as_verify_does() {
    let release = fp16_release();
    let w = tempdir("run-symlink");
    for name in [
        "embed_tokens_scales.bin",
        "hf_model/config.json",
        "manifest.json",
    ] {
        let copy = w.join(name.replace('/', "-"));
        copy_dir(&release, &copy);
        let outside = w.join(format!("outside-{}", name.replace('/', "-")));
        fs::copy(copy.join(name), &outside).unwrap();
        fs::remove_file(copy.join(name)).unwrap();
        std::os::unix::fs::symlink(&outside, copy.join(name)).unwrap();
        let o = run(&["run", s(&copy), "--prompt", SENTENCE, "--max-tokens", "2"]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{name}: {e}");
        assert!(
            e.contains(&format!(
                "{}: is a symlink (releases must not contain symlinks",
                copy.join(name).display()
            )),
            "{name}: {e}"
        );
        let o = run(&["verify", s(&copy), "--public-key", s(&keys().1)]);
        let out = format!("{}{}", stdout(&o), stderr(&o));
        assert_eq!(o.status.code(), Some(1), "{name}: {out}");
        assert!(
            out.contains(&format!("{name}: is a symlink")),
            "{name}: {out}"
        );
    }
    fs::remove_dir_all(&w).unwrap();
}

/// A copy of `from` made of hard links.
/// `model_config.json` is what the app reads its dimensions and scales from:
/// a value that disagrees with the packages fails `run` naming the key, even
/// with the manifest entry updated to match.
#[test]
fn model_config_values_are_checked_against_the_packages() {
    let release = fp16_release();
    let w = tempdir("run-config");
    for (key, value) in [
        ("embed_scale", serde_json::json!(1.0)),
        ("sliding_window", serde_json::json!(64)),
        ("hidden_size", serde_json::json!(99)),
    ] {
        let copy = w.join(key);
        copy_dir(&release, &copy);
        let path = copy.join("model_config.json");
        let mut cfg = json_file(&path);
        cfg[key] = value;
        let text = serde_json::to_vec_pretty(&cfg).unwrap();
        fs::remove_file(&path).unwrap();
        fs::write(&path, &text).unwrap();
        let mpath = copy.join("manifest.json");
        let mut m = json_file(&mpath);
        for f in m["files"].as_array_mut().unwrap() {
            if f["path"] == "model_config.json" {
                f["size"] = serde_json::json!(text.len());
                f["sha256"] = serde_json::json!(format!("{:x}", Sha256::digest(&text)));
            }
        }
        fs::remove_file(&mpath).unwrap();
        fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        let o = run(&["run", s(&copy), "--prompt", SENTENCE, "--max-tokens", "2"]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{key}: {e}");
        assert!(
            e.contains("model_config.json") && e.contains(key),
            "{key}: {e}"
        );
    }
    fs::remove_dir_all(&w).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    for e in walkdir::WalkDir::new(from) {
        let e = e.unwrap();
        let rel = e.path().strip_prefix(from).unwrap();
        let dst = to.join(rel);
        if e.file_type().is_dir() {
            fs::create_dir_all(&dst).unwrap();
        } else {
            fs::hard_link(e.path(), &dst).unwrap();
        }
    }
}

/// `package --onto`, the run book's workflow: a `--mode both` build (merged
/// packages only) packaged onto an FP16 four-chunk release of the same
/// checkpoint runs on the branch runtime exactly as transformers generates;
/// the carried files are marked and signed with the rest. A release of
/// another checkpoint, or one whose side file, package or contract
/// disagrees with the build, is refused naming the file, before anything is
/// written.
#[test]
fn package_onto_a_four_chunk_release_runs_the_branch_as_transformers() {
    let hf = checkpoint_of(&common::built_all());
    let (four_build, both) = common::onto_builds();
    let work = tempdir("onto");
    let four = work.join("four");
    let (private, public) = keys();
    ok(&[
        "package",
        s(&four_build),
        "--layout",
        "four",
        "--key",
        s(private),
        "--output",
        s(&four),
    ]);
    let out = work.join("onto");
    let package_onto = |build: &Path, onto: &Path, output: &Path, extra: &[&str]| {
        let mut args = vec![
            "package",
            s(build),
            "--layout",
            "two",
            "--onto",
            s(onto),
            "--key",
            s(private),
            "--output",
            s(output),
        ];
        args.extend_from_slice(extra);
        run(&args)
    };
    let o = package_onto(&both, &four, &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    ok(&["verify", s(&out), "--public-key", s(public)]);

    let m = json_file(&out.join("manifest.json"));
    let carried = [
        "chunk1",
        "chunk2",
        "chunk3",
        "chunk4",
        "prefill_chunk1",
        "prefill_chunk2",
        "prefill_chunk3",
        "prefill_chunk4",
    ];
    assert_eq!(m["onto"]["packages"], serde_json::json!(carried));
    let four_manifest = json_file(&four.join("manifest.json"));
    assert_eq!(m["onto"]["version"], four_manifest["release"]["version"]);
    // Every file but the build's packages and the run book came from DIR,
    // byte for byte.
    for f in m["files"].as_array().unwrap() {
        let path = f["path"].as_str().unwrap();
        let made = path.starts_with("merged_") || path == "DEVICE_RUNBOOK.md";
        assert_eq!(f["carried"].as_bool().unwrap_or(false), !made, "{path}");
        if !made {
            let theirs = four_manifest["files"]
                .as_array()
                .unwrap()
                .iter()
                .find(|g| g["path"] == f["path"])
                .unwrap_or_else(|| panic!("{path}: not in the four-chunk release"));
            assert_eq!(theirs["sha256"], f["sha256"], "{path}");
        }
    }

    let (_, want) = transformers_greedy(&hf, SENTENCE, TOKENS);
    let r = generate(&out, &["--prompt", SENTENCE, "--runtime", "branch"]);
    assert_eq!(r["layout"], "two");
    assert_eq!(r["download"], "branch");
    assert_eq!(ids(&r["generated_ids"]), want, "tokens vs transformers");

    // Refusals, each naming the first file that disagrees; nothing written.
    // A DIR changed after signing does not verify: each change is checked
    // again without the signature (--allow-unverified-onto), against what
    // DIR's manifest and the build say.
    let refused = |build: &Path, onto: &Path, names: &Path, what: &str| {
        let bad = work.join("bad");
        let o = package_onto(build, onto, &bad, &[]);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{e}");
        if onto != four {
            assert!(
                e.contains("does not verify with the public key of --key"),
                "{e}"
            );
            let o = package_onto(build, onto, &bad, &["--allow-unverified-onto"]);
            let e = stderr(&o);
            assert_eq!(o.status.code(), Some(2), "{e}");
            assert!(e.contains(&format!("{}: {what}", names.display())), "{e}");
        } else {
            assert!(e.contains(&format!("{}: {what}", names.display())), "{e}");
        }
        assert!(!bad.exists());
    };
    let e4b = common::fixture(
        "e4b-mm",
        &["--shape", "e4b", "--multimodal", "--shards", "3"],
    );
    let e4b_two = common::shared_build("e4b-two-fp16", &e4b, &["--mode", "two", "--no-quantize"]);
    refused(
        &e4b_two,
        &four,
        &four.join("hf_model/config.json"),
        "not the config.json the build was made from",
    );
    // A side file of another size.
    let side = work.join("side");
    copy_dir(&four, &side);
    let table = side.join("embed_tokens_q8.bin");
    let bytes = fs::read(&table).unwrap();
    fs::remove_file(&table).unwrap();
    fs::write(&table, &bytes[..bytes.len() - 1]).unwrap();
    refused(&both, &side, &table, "");
    // A carried package's file changed after packaging.
    let pkg = work.join("pkg");
    copy_dir(&four, &pkg);
    let spec = pkg.join("swa/chunk3.mlpackage/Data/com.apple.CoreML/model.mlmodel");
    let mut bytes = fs::read(&spec).unwrap();
    bytes.push(0);
    fs::remove_file(&spec).unwrap();
    fs::write(&spec, &bytes).unwrap();
    refused(&both, &pkg, &spec, "differs from what");
    // A contract other than the plan's.
    let contract = work.join("contract");
    copy_dir(&four, &contract);
    let path = contract.join("manifest.json");
    let mut v = json_file(&path);
    let chunk = v["chunks"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == "chunk2")
        .unwrap();
    chunk["inputs"][0]["shape"][0] = 2.into();
    fs::remove_file(&path).unwrap();
    fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    refused(&both, &contract, &path, "chunk2's inputs is not what");
}

/// `client-check --materialize` writes each entry's model folder as the
/// app's download leaves it (local names, shared blobs linked or copied,
/// RoPE tables at the root), and `run` on that folder alone gives
/// transformers' greedy tokens, with the layout that runtime picks there.
#[test]
fn materialized_downloads_generate_transformers_tokens() {
    fp16_release();
    let build = fp16_dir().join("build");
    let (_, want) = transformers_greedy(&checkpoint_of(&build), SENTENCE, TOKENS);
    // The app's default layouts, with an encoder bundle (the branch cannot
    // skip the encoders).
    let dir = tempdir("materialize");
    let release = dir.join("release");
    ok(&[
        "package",
        s(&build),
        "--key",
        s(&keys().0),
        "--output",
        s(&release),
        "--encoders-from",
        s(&common::encoder_bundle()),
    ]);
    for (client, layout, shared) in [
        ("main", "four", "chunk1"),
        ("main-3way", "three", "chunk1"),
        ("branch", "four", "chunk1"),
    ] {
        let out = dir.join(client);
        let o = run(&[
            "client-check",
            s(&release),
            "--client",
            client,
            "--multimodal",
            "off",
            "--materialize",
            s(&out),
        ]);
        // Exit 1: the default checkpoint's widths are not the runtime's.
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert!(out.join("cos_full.npy").is_file() && !out.join("swa").exists());
        let blob = |p: &str| {
            out.join(format!(
                "{p}.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
            ))
        };
        assert_eq!(
            fs::read(blob("prefill_chunk1")).unwrap(),
            fs::read(blob(shared)).unwrap()
        );
        {
            use std::os::unix::fs::MetadataExt;
            let links = fs::metadata(blob("prefill_chunk1")).unwrap().nlink();
            assert_eq!(
                links,
                if client == "branch" { 1 } else { 2 },
                "{client}: link or copy"
            );
        }
        assert_eq!(out.join("vision.mlmodelc").exists(), client == "branch");
        let r = generate(&out, &["--prompt", SENTENCE]);
        assert_eq!(r["layout"], layout, "{client}");
        assert_eq!(
            ids(&r["generated_ids"]),
            want,
            "{client}: tokens vs transformers"
        );
        // The folder is not written twice.
        let o = run(&[
            "client-check",
            s(&release),
            "--client",
            client,
            "--materialize",
            s(&out),
        ]);
        assert_eq!(o.status.code(), Some(2));
        assert!(stderr(&o).contains("already exists"), "{}", stderr(&o));
    }
    let _ = fs::remove_dir_all(&dir);
}
