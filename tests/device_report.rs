//! `chunkforge device-report`: device logs written the way the runtime (and
//! the seed run book) shows them, turned into verdicts per layout.

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::{run, stderr, stdout, tempdir};
use serde_json::Value;

/// The seed's recorded two-chunk line (2026-04-17, iPhone 17 Pro).
const SEED_TWO_CHUNK: &str = "[Profile-2chunk] emb=0.4ms mask=0.3ms | m1=13.1 m2=17.8 (sum=30.9ms) | predict=31.2ms (31.7 tok/s)";
/// The seed's one-chunk failure, as the OS prints it.
const SEED_ANE_FAILURE: &str =
    "ANE model load has failed for on-device compiled macho. Must re-compile the E5 bundle.";

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    p
}

/// What the merged-layout runtime prints around a decode: load lines, the
/// layout, the KV allocation, the audit of `audit` (name, off, total) with
/// its summary, and two profile lines (the last with `tok_s`).
fn run_log(layout: &str, audit: &[(&str, u64, u64)], profile: &str) -> String {
    let mut s = String::from(
        "Loading model...\n[Load] chunk1 done in 3.1s\n[Load] All 10 chunks loaded in 12.3s (parallel)\n",
    );
    s.push_str(&format!("[Load] Decode layout: {layout}\n"));
    s.push_str("[KV] Allocating IOSurface-backed KV cache buffers (ctx=2048)\n");
    let (mut off, mut total) = (0, 0);
    for (name, o, t) in audit {
        if *o == 0 {
            s.push_str(&format!(
                "[ComputePlan] {name}: all {t} ops on Neural Engine\n"
            ));
        } else {
            s.push_str(&format!(
                "[ComputePlan] {name}: {o}/{t} ops NOT on Neural Engine\n[ComputePlan] {name} fallback | ios18.gather → CPU: {o}\n"
            ));
        }
        off += o;
        total += t;
    }
    if !audit.is_empty() {
        s.push_str(&format!(
            "[ComputePlan] ── summary: {off} non-ANE op(s) out of {total} total across all chunks\n"
        ));
    }
    s.push_str(
        "[Load] ANE prewarm (4 steps) done in 0.42s\nThe transformer is a neural network...\n",
    );
    s.push_str(profile);
    s.push('\n');
    s
}

fn two_chunk(tok: f64, merged2_off: u64) -> String {
    let first = "[Profile-2chunk] emb=0.5ms mask=0.3ms | m1=14.0 m2=18.0 (sum=32.0ms) | predict=32.5ms (30.3 tok/s)";
    run_log(
        "two-chunk",
        &[
            ("chunk1", 0, 812),
            ("chunk2", 0, 700),
            ("chunk3", 0, 990),
            ("chunk4", 0, 1044),
            ("merged_chunk1", 0, 1247),
            ("merged_chunk2", merged2_off, 1683),
        ],
        &format!("{first}\n[Profile-2chunk] emb=0.4ms mask=0.3ms | m1=13.1 m2=17.8 (sum=30.9ms) | predict=31.2ms ({tok:.1} tok/s)"),
    )
}

fn four_chunk(tok: f64) -> String {
    run_log(
        "four-chunk",
        &[("chunk1", 0, 812), ("chunk2", 0, 700), ("chunk3", 0, 990), ("chunk4", 0, 1044)],
        &format!("[Profile] emb=0.4ms mask=0.3ms | c1=7.0 c2=7.1 c3=8.2 c4=9.3 (sum=31.6ms) | predict=31.9ms total=32.3ms ({tok:.1} tok/s)"),
    )
}

fn device_report(args: &[&str]) -> Output {
    let mut a = vec!["device-report"];
    a.extend_from_slice(args);
    run(&a)
}

/// `device-report --json ARGS`: the report, asserting exit 0.
fn json_report(args: &[String]) -> Value {
    let mut a: Vec<&str> = vec!["--json"];
    a.extend(args.iter().map(String::as_str));
    let o = device_report(&a);
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    serde_json::from_slice(&o.stdout).expect("--json prints JSON")
}

fn layout<'a>(r: &'a Value, kind: &str) -> &'a Value {
    r["layouts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["layout"] == kind)
        .unwrap_or_else(|| panic!("no {kind} layout in {r:#}"))
}

fn errors(r: &Value) -> Vec<String> {
    r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "error")
        .map(|f| {
            format!(
                "{}:{}: {}",
                f["file"].as_str().unwrap(),
                f["line"],
                f["message"].as_str().unwrap()
            )
        })
        .collect()
}

/// Writes `runs` (file name, text) into a fresh folder; returns the LOG
/// arguments, each labelled with the layout before the file name's dash.
fn logs(tag: &str, runs: &[(&str, String)]) -> (PathBuf, Vec<String>) {
    let dir = tempdir(tag);
    let args = runs
        .iter()
        .map(|(name, text)| {
            let p = write(&dir, name, text);
            let label = name.split('-').next().unwrap();
            format!("{label}={}", s(&p))
        })
        .collect();
    (dir, args)
}

#[test]
fn the_seeds_recorded_runs_are_below_pass_and_dead_on_arrival() {
    // The seed's own lines: a two-chunk run at 31.7 tok/s (three times, as
    // the run book asks), the four-chunk control at ~31, and the one-chunk
    // load that failed on the Neural Engine.
    let seed_two = run_log(
        "two-chunk",
        &[("merged_chunk1", 0, 1247), ("merged_chunk2", 42, 1683)],
        SEED_TWO_CHUNK,
    );
    let one = format!("[Load] chunk1 done in 3.1s\n{SEED_ANE_FAILURE}\nError: model load failed\n");
    let (_dir, args) = logs(
        "seed",
        &[
            ("four-1.log", four_chunk(31.0)),
            ("four-2.log", four_chunk(30.8)),
            ("four-3.log", four_chunk(31.2)),
            ("two-1.log", seed_two.clone()),
            ("two-2.log", seed_two.clone()),
            ("two-3.log", seed_two),
            ("one-1.log", one),
        ],
    );
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = device_report(&a);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("two-chunk: BELOW PASS (31.7 tok/s < 36)\n"),
        "{text}"
    );
    assert!(
        text.contains("one-chunk: DEAD ON ARRIVAL (ANE compile failed)\n"),
        "{text}"
    );
    assert!(
        text.contains("four-chunk: CONTROL (31.0 tok/s)\n"),
        "{text}"
    );
    // The seed's table: +2 % over the four-chunk control.
    assert!(text.contains("+2.3 % vs four-chunk 31.0 tok/s"), "{text}");
    assert!(text.contains("42 of 2930 ops (1.4 %)"), "{text}");
    let r = json_report(&args);
    assert_eq!(layout(&r, "two")["verdict"], "below_pass");
    assert_eq!(layout(&r, "one")["verdict"], "dead_on_arrival");
    assert!(layout(&r, "one")["dead_on_arrival"][0]
        .as_str()
        .unwrap()
        .ends_with("one-1.log:2"));
    assert!(errors(&r).is_empty(), "{:?}", errors(&r));
    // --require pass fails on it.
    let mut req = vec!["--require", "pass"];
    req.extend(a.iter());
    let o = device_report(&req);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("require pass: NOT met"),
        "{}",
        stdout(&o)
    );

    // The same failure in an unlabelled file cannot be charged to a layout.
    let dir = tempdir("seed-unlabelled");
    let p = write(&dir, "x.log", SEED_ANE_FAILURE);
    let r = json_report(&[s(&p).to_string()]);
    assert!(r["layouts"].as_array().unwrap().is_empty());
    assert!(errors(&r)[0].contains("label the file"), "{:?}", errors(&r));
}

#[test]
fn three_runs_at_or_above_the_ship_line_ship() {
    let (_dir, args) = logs(
        "ship",
        &[
            ("two-1.log", two_chunk(41.0, 0)),
            ("two-2.log", two_chunk(39.5, 0)),
            ("two-3.log", two_chunk(42.5, 0)),
        ],
    );
    let mut a = vec!["--require".to_string(), "ship".to_string()];
    a.extend(args.iter().cloned());
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let o = device_report(&a);
    let text = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{text}");
    // The median of the three, not the first or the best.
    assert!(
        text.contains("two-chunk: SHIP (41.0 tok/s >= 40)\n"),
        "{text}"
    );
    assert!(text.contains("require ship: met"), "{text}");
    assert!(text.contains("no counted four-chunk run"), "{text}");
    let r = json_report(&args);
    let l = layout(&r, "two");
    assert_eq!(l["tok_s"], serde_json::json!([41.0, 39.5, 42.5]));
    assert_eq!(l["median_tok_s"], 41.0);
    assert!(errors(&r).is_empty(), "{:?}", errors(&r));

    // merged_chunk2's audits differ between runs: the worst counts, and it is an error.
    let (_dir, args) = logs(
        "ship-differ",
        &[
            ("two-1.log", two_chunk(41.0, 0)),
            ("two-2.log", two_chunk(41.0, 12)),
            ("two-3.log", two_chunk(41.0, 0)),
        ],
    );
    let r = json_report(&args);
    assert_eq!(layout(&r, "two")["placement"]["off"], 12);
    assert!(
        errors(&r)
            .iter()
            .any(|e| e.contains("merged_chunk2's audits differ")),
        "{:?}",
        errors(&r)
    );

    // Between pass and ship.
    let (_dir, args) = logs(
        "pass",
        &[
            ("two-1.log", two_chunk(38.0, 0)),
            ("two-2.log", two_chunk(37.1, 0)),
            ("two-3.log", two_chunk(36.0, 0)),
        ],
    );
    let r = json_report(&args);
    assert_eq!(
        layout(&r, "two")["text"],
        "PASS (37.1 tok/s >= 36; ship at 40)"
    );
}

#[test]
fn two_runs_are_incomplete() {
    let (_dir, args) = logs(
        "incomplete",
        &[
            ("two-1.log", two_chunk(41.0, 0)),
            ("two-2.log", two_chunk(42.0, 0)),
        ],
    );
    let r = json_report(&args);
    let l = layout(&r, "two");
    assert_eq!(l["verdict"], "incomplete");
    assert_eq!(l["runs"], 2);
    assert_eq!(
        l["text"],
        "INCOMPLETE: 2 of 3 runs; so far SHIP (41.5 tok/s >= 40)"
    );

    // Three runs without the compute-plan audit are incomplete too.
    let bare = |tok: f64| {
        run_log(
            "two-chunk",
            &[],
            &format!("[Profile-2chunk] emb=0.4ms mask=0.3ms | m1=13.1 m2=17.8 (sum=30.9ms) | predict=31.2ms ({tok:.1} tok/s)"),
        )
    };
    let (_dir, args) = logs(
        "no-audit",
        &[
            ("two-1.log", bare(41.0)),
            ("two-2.log", bare(41.0)),
            ("two-3.log", bare(41.0)),
        ],
    );
    let r = json_report(&args);
    let text = layout(&r, "two")["text"].as_str().unwrap().to_string();
    assert!(
        text.starts_with("INCOMPLETE: no ComputePlan audit of merged_chunk1, merged_chunk2 (launch with COMPUTE_PLAN_AUDIT=1)"),
        "{text}"
    );
}

#[test]
fn a_profile_line_of_another_layout_is_an_error_and_not_counted() {
    // The runtime loaded four-chunk but the run printed two-chunk timings.
    let mixed = run_log("four-chunk", &[], SEED_TWO_CHUNK);
    // Labelled two, but merged_chunk* were missing: the runtime loaded four-chunk.
    let mislabelled = four_chunk(31.0);
    let (_dir, args) = logs(
        "mismatch",
        &[("four-1.log", mixed), ("two-1.log", mislabelled)],
    );
    let r = json_report(&args);
    let e = errors(&r);
    assert!(
        e.iter().any(|m| m.contains("four-1.log:8: layout mismatch: a [Profile-2chunk] line in a run whose layout line (line 4) says four-chunk")),
        "{e:?}"
    );
    assert!(
        e.iter()
            .any(|m| m.contains("two-1.log:4: labelled two, but the runtime loaded four-chunk")),
        "{e:?}"
    );
    let four = layout(&r, "four");
    assert_eq!(four["runs"], 0, "{four:#}");
    assert!(r["runs"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["counted"] == false));
    // Nothing counted toward two-chunk: it is not in the report.
    assert!(r["layouts"]
        .as_array()
        .unwrap()
        .iter()
        .all(|l| l["layout"] != "two"));
    // An unlabelled file is read by its layout line; two launches in one file are refused.
    let dir = tempdir("two-launches");
    let p = write(
        &dir,
        "x.log",
        &format!("{}{}", four_chunk(31.0), four_chunk(31.0)),
    );
    let r = json_report(&[s(&p).to_string()]);
    assert!(
        errors(&r)[0].contains("holds 2 layout lines"),
        "{:?}",
        errors(&r)
    );
}

#[test]
fn more_than_five_percent_off_the_neural_engine_is_a_regression() {
    // 200 of 1247 + 1683 ops = 6.8 %, whatever the tok/s.
    let (_dir, args) = logs(
        "ane",
        &[
            ("two-1.log", two_chunk(45.0, 200)),
            ("two-2.log", two_chunk(45.0, 200)),
            ("two-3.log", two_chunk(45.0, 200)),
        ],
    );
    let r = json_report(&args);
    let l = layout(&r, "two");
    assert_eq!(l["verdict"], "ane_regression");
    assert_eq!(
        l["text"],
        "ANE REGRESSION (6.8 % of ops off the Neural Engine > 5 %)"
    );
    // chunk1..4's audit lines (printed too) are not the merged variant's.
    assert_eq!(l["placement"]["total"], 2930);
    // Exactly at the limit is not a regression: 146 / 2930 < 5 %, 147 > 5 %.
    let (_dir, args) = logs(
        "ane-limit",
        &[
            ("two-1.log", two_chunk(45.0, 146)),
            ("two-2.log", two_chunk(45.0, 146)),
            ("two-3.log", two_chunk(45.0, 146)),
        ],
    );
    assert_eq!(layout(&json_report(&args), "two")["verdict"], "ship");
    let (_dir, args) = logs(
        "ane-over",
        &[
            ("two-1.log", two_chunk(45.0, 147)),
            ("two-2.log", two_chunk(45.0, 147)),
            ("two-3.log", two_chunk(45.0, 147)),
        ],
    );
    assert_eq!(
        layout(&json_report(&args), "two")["verdict"],
        "ane_regression"
    );
}

#[test]
fn runtime_lines_that_do_not_parse_are_reported_with_file_and_line() {
    let mut text = two_chunk(41.0, 0);
    // The seed's annotated example and its expected-shape template are not runtime output.
    text.push_str("[ComputePlan] merged_chunk2: 42/1683 ops NOT on Neural Engine     ← red flag\n");
    text.push_str("[Profile-2chunk] emb=0.0ms mask=0.0ms | m1=~20 m2=~20 (sum=~40ms) | predict=~40ms (~25 tok/s → target ~45 tok/s)\n");
    text.push_str("[Load] Decode layout: five-chunk\n");
    // Not the runtime's: ignored.
    text.push_str("[ANE/CPU] ANE_wait=1.0ms\nrandom chatter [Load] in the middle\n");
    let dir = tempdir("unparsed");
    let p = write(&dir, "two-1.log", &text);
    let r = json_report(&[s(&p).to_string()]);
    let u: Vec<(u64, String)> = r["unparsed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| {
            (
                u["line"].as_u64().unwrap(),
                u["text"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let n = two_chunk(41.0, 0).lines().count() as u64;
    assert_eq!(
        u.iter().map(|x| x.0).collect::<Vec<_>>(),
        [n + 1, n + 2, n + 3],
        "{u:?}"
    );
    assert!(u[0].1.ends_with("← red flag"));
    let o = device_report(&[s(&p)]);
    let out = stdout(&o);
    assert!(
        out.contains(&format!(
            "two-1.log:{}: [Load] Decode layout: five-chunk",
            n + 3
        )),
        "{out}"
    );
    // --require refuses a report with unparsed runtime lines.
    let o = device_report(&["--require", "pass", s(&p)]);
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn bad_inputs_are_errors_naming_the_file() {
    let dir = tempdir("bad");
    let missing = dir.join("nope.log");
    let o = device_report(&[s(&missing)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains(&format!("{}: missing", missing.display())),
        "{}",
        stderr(&o)
    );
    let o = device_report(&[&format!("two={}", s(&missing))]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("nope.log: missing"), "{}", stderr(&o));
    let o = device_report(&[s(&dir)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("cannot read"), "{}", stderr(&o));

    // A summary the audit lines do not add up to; a run at another context.
    let mut text = two_chunk(41.0, 0).replace("out of 6476 total", "out of 9000 total");
    assert!(text.contains("9000"));
    text = text.replace("ctx=2048", "ctx=8192");
    let p = write(&dir, "two-1.log", &text);
    let r = json_report(&[format!("two={}", s(&p))]);
    assert!(
        errors(&r)
            .iter()
            .any(|e| e.contains("audit lines are missing")),
        "{:?}",
        errors(&r)
    );
    assert_eq!(r["runs"][0]["counted"], false);
    assert!(r["runs"][0]["excluded"]
        .as_str()
        .unwrap()
        .contains("context 8192"));
}

#[test]
fn each_layout_is_compared_with_the_control_on_its_own_runtime_build() {
    // main prints its own layout lines (three-chunk, four-chunk) and is
    // faster than the merged-layout branch: each comparison stays on one build.
    let main_four = four_chunk(32.0).replace(
        "[Load] Decode layout: four-chunk",
        "[Load] 4-chunk decode (legacy bundle, no chunk2_3way/chunk3_3way present)",
    );
    let three = run_log(
        "three-chunk",
        &[("chunk1", 0, 812), ("chunk2_3way", 3, 1690), ("chunk3_3way", 0, 1044)],
        "[Profile] emb=0.4ms mask=0.3ms | c1=7.0 c2=15.1 c3=0.0 c4=9.3 (sum=31.4ms) | predict=31.6ms total=32.0ms (33.6 tok/s)",
    )
    .replace(
        "[Load] Decode layout: three-chunk",
        "[Load] Topology II — 3-chunk default (chunk1 + chunk2_3way[L8-24 merged] + chunk3_3way[L25-34+head])",
    );
    let (_dir, args) = logs(
        "runtimes",
        &[
            ("four-main-1.log", main_four.clone()),
            ("four-main-2.log", main_four.clone()),
            ("four-main-3.log", main_four),
            ("four-merged-1.log", four_chunk(30.0)),
            ("four-merged-2.log", four_chunk(30.0)),
            ("four-merged-3.log", four_chunk(30.0)),
            ("three-1.log", three.clone()),
            ("three-2.log", three.clone()),
            ("three-3.log", three),
            ("two-1.log", two_chunk(33.0, 0)),
            ("two-2.log", two_chunk(33.0, 0)),
            ("two-3.log", two_chunk(33.0, 0)),
        ],
    );
    let r = json_report(&args);
    assert!(errors(&r).is_empty(), "{:?}", errors(&r));
    let three = layout(&r, "three");
    assert_eq!(three["verdict"], "measured");
    assert_eq!(three["runtime"], "main");
    assert_eq!(three["control_tok_s"], 32.0);
    let two = layout(&r, "two");
    assert_eq!(two["runtime"], "merged-layout");
    assert_eq!(two["control_tok_s"], 30.0);
    assert!((two["delta_vs_control"].as_f64().unwrap() - 0.1).abs() < 1e-9);
    assert_eq!(two["verdict"], "below_pass");
}
