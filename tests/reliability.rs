//! Crash safety, interrupts and hostile inputs: a killed or failing run never
//! leaves something the runtime would load, and bad input gets a clear error.

mod common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn previous(out: &Path) {
    fs::create_dir_all(out.join("merged_chunk1.mlpackage")).unwrap();
    fs::write(out.join("merged_chunk1.mlpackage/marker"), b"previous").unwrap();
    fs::write(out.join("build.json"), b"{\"previous\": true}").unwrap();
}

/// Visible entries (staging folders are hidden and removed by the next run).
fn visible(out: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with(".chunkforge-staging-"))
        .collect();
    v.sort();
    v
}

fn assert_previous(out: &Path) {
    assert_eq!(visible(out), ["build.json", "merged_chunk1.mlpackage"]);
    assert_eq!(
        fs::read(out.join("merged_chunk1.mlpackage/marker")).unwrap(),
        b"previous"
    );
    assert_eq!(
        fs::read(out.join("build.json")).unwrap(),
        b"{\"previous\": true}"
    );
}

/// `build --mode two` of checkpoint `ck` into `out`.
fn build_two<'a>(ck: &'a Path, out: &'a Path) -> [&'a str; 7] {
    let path = |p: &'a Path| p.to_str().unwrap();
    [
        "build",
        "--hf-dir",
        path(ck),
        "--mode",
        "two",
        "--output",
        path(out),
    ]
}

fn spawn(args: &[&str]) -> std::process::Child {
    Command::new(bin())
        .args(args)
        .env_remove("GEMMA4_HF_DIR")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Spawns `args`, waits for a stderr line containing `cue`, then `delay`
/// seconds more, and returns the child, checked to be still running, and its
/// later stderr lines. Cues rather than fixed sleeps keep the signal inside
/// the phase it is meant for on a machine of any speed.
fn spawn_until(args: &[&str], cue: &str, delay: f64) -> (Child, mpsc::Receiver<String>) {
    let mut child = spawn(args);
    let (tx, rx) = mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(600)) {
            Ok(line) if line.contains(cue) => break,
            Ok(line) => seen.push(line),
            Err(e) => panic!("no `{cue}` on stderr ({e}); saw:\n{}", seen.join("\n")),
        }
    }
    std::thread::sleep(Duration::from_secs_f64(delay));
    assert!(
        child.try_wait().unwrap().is_none(),
        "{args:?} ended before the signal `{cue}` + {delay}s was meant for"
    );
    (child, rx)
}

#[test]
fn sigkill_during_build_leaves_the_previous_result_and_the_next_run_cleans_up() {
    let ck = fixture("e2b", &[]);
    let out = tempdir("kill-build");
    previous(&out);
    let args = build_two(&ck, &out);
    // Early (Python loading the first source chunk), during the conversion of
    // the first package's sources, during its composition, during the
    // conversion of the second's sources (`--mode two` composes both
    // packages from four-chunk programs it converts only for that).
    for (cue, delay) in [
        ("chunk1: load weights", 0.0),
        ("chunk1: convert", 2.0),
        // A composition takes well under a second now (mil_write): at its start.
        ("merged_chunk1: compose", 0.0),
        ("chunk3: convert", 2.0),
    ] {
        let (mut child, _stderr) = spawn_until(&args, cue, delay);
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
        assert_previous(&out);
    }
    let o = run(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        visible(&out),
        [
            "build.json",
            "merged_chunk1.mlpackage",
            "merged_chunk2.mlpackage"
        ]
    );
    let stale: Vec<_> = fs::read_dir(&out)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".chunkforge")
        })
        .collect();
    assert!(
        stale.is_empty(),
        "stale staging folders were not cleaned: {stale:?}"
    );
    assert!(
        !out.join("merged_chunk1.mlpackage/marker").exists(),
        "replaced by the new package"
    );
}

#[test]
fn ctrl_c_stops_cleanly_with_a_message() {
    let ck = fixture("e2b", &[]);
    let out = tempdir("sigint-build");
    previous(&out);
    let (mut child, stderr) = spawn_until(&build_two(&ck, &out), "chunk1: convert", 1.0);
    unsafe_kill(child.id(), "INT");
    assert_eq!(child.wait().unwrap().code(), Some(130));
    let rest: Vec<String> = stderr.into_iter().collect();
    assert!(
        rest.iter().any(|l| l.contains("interrupted")),
        "{}",
        rest.join("\n")
    );
    assert_previous(&out);
    assert!(fs::read_dir(&out).unwrap().all(|e| !e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with(".chunkforge")));
}

/// Processes whose parent is `pid` (from /proc).
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so split after ')'.
        let rest = &stat[stat.rfind(')').unwrap() + 1..];
        let ppid: u32 = rest.split_whitespace().nth(1).unwrap().parse().unwrap();
        if ppid == pid {
            out.push(child);
        }
    }
    out
}

/// Whether `pid` is gone or a zombie (dead, not yet reaped by its new parent).
fn dead(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat[stat.rfind(')').unwrap() + 1..]
            .trim_start()
            .starts_with('Z'),
    }
}

#[test]
fn sigkill_during_a_two_process_build_takes_its_conversion_worker_with_it() {
    let ck = fixture("e2b", &[]);
    let out = tempdir("kill-jobs");
    previous(&out);
    let mut args = build_two(&ck, &out).to_vec();
    args.extend(["--jobs", "2"]);
    let (mut child, _stderr) = spawn_until(&args, ": convert", 0.5);
    let workers = children_of(child.id());
    assert_eq!(workers.len(), 1, "one conversion worker: {workers:?}");
    let _ = child.kill(); // SIGKILL: no handler runs in the build
    let _ = child.wait();
    let t = std::time::Instant::now();
    while !dead(workers[0]) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the worker outlived the build"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_previous(&out);
    let o = run(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let build: serde_json::Value =
        serde_json::from_slice(&fs::read(out.join("build.json")).unwrap()).unwrap();
    assert_eq!(build["processes"], 2);
}

fn unsafe_kill(pid: u32, sig: &str) {
    assert!(Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

#[test]
fn sigkill_during_fixture_leaves_nothing_and_the_rerun_succeeds() {
    let parent = tempdir("kill-fixture");
    let out = parent.join("ckpt");
    for delay in [0.5, 5.0] {
        let mut child = spawn(&["fixture", "--out", out.to_str().unwrap()]);
        std::thread::sleep(Duration::from_secs_f64(delay));
        let _ = child.kill();
        let _ = child.wait();
        // Either nothing, or (the run finished before the kill) the complete checkpoint.
        if out.exists() {
            assert!(
                out.join("config.json").exists(),
                "partial checkpoint at {}",
                out.display()
            );
            let (header, _) = read_safetensors(&out.join("model.safetensors"));
            assert!(
                header.as_object().unwrap().len() > 500,
                "partial checkpoint at {}",
                out.display()
            );
            fs::remove_dir_all(&out).unwrap();
        }
    }
    ok(&["fixture", "--out", out.to_str().unwrap()]);
    assert!(out.join("config.json").exists() && out.join("model.safetensors").exists());
    let names: Vec<String> = fs::read_dir(&parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    assert_eq!(names, ["ckpt"], "stale temporaries were not cleaned");
}

// ---- hostile checkpoints: each a clear error, exit 2, nothing written ----

fn corpus_case(tag: &str, edit: impl FnOnce(&Path), fragment: &str) {
    let ck = copy_checkpoint(&fixture("e2b", &[]), tag);
    edit(&ck);
    let out = tempdir(&format!("{tag}-out"));
    previous(&out);
    let o = run(&build_two(&ck, &out));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{tag}: {err}");
    assert!(
        err.contains(fragment),
        "{tag}: expected `{fragment}` in:\n{err}"
    );
    assert!(
        !err.contains("Traceback") && !err.contains("panicked"),
        "{tag}: {err}"
    );
    // Phase lines (`chunk1: load weights ...`) are progress, not the error:
    // with a conversion worker, the other process's appear too.
    assert!(
        err.lines()
            .filter(|l| !l.trim().is_empty() && !l.ends_with(" ..."))
            .count()
            <= 3,
        "{tag}: one short paragraph:\n{err}"
    );
    assert_previous(&out);
}

fn edit_header(ck: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = ck.join("model.safetensors");
    let (mut h, data) = read_safetensors(&p);
    f(&mut h);
    write_safetensors(&p, &h, &data);
}

fn edit_config(ck: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = ck.join("config.json");
    let mut v = json_file(&p);
    f(&mut v);
    fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
}

/// Config values chunkforge does not implement are refused by plan, build and
/// parity alike (they share one check), naming the field, the value and what
/// is supported; before, each of these built something else and exited 0.
#[test]
fn unimplemented_config_values_are_refused() {
    corpus_case(
        "relu",
        |ck| edit_config(ck, |c| c["hidden_activation"] = json!("relu")),
        "`hidden_activation` is \"relu\"; chunkforge implements only \"gelu_pytorch_tanh\"",
    );
    corpus_case(
        "softcap-string",
        |ck| edit_config(ck, |c| c["final_logit_softcapping"] = json!("30.0")),
        "`final_logit_softcapping` is \"30.0\", expected a number fp16 holds (6.1e-5 to 65504), or null for no capping",
    );
    let ck = copy_checkpoint(&fixture("e2b", &[]), "linear-rope");
    edit_config(&ck, |c| {
        c["rope_parameters"]["sliding_attention"]["rope_type"] = json!("linear")
    });
    let dir = ck.to_str().unwrap();
    for args in [
        vec!["plan", "--hf-dir", dir],
        vec!["parity", "--hf-dir", dir, "--mode", "two", "--steps", "2"],
    ] {
        let o = run(&args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("`rope_parameters.sliding_attention.rope_type` is \"linear\"; chunkforge implements only \"default\""),
            "{args:?}: {err}"
        );
    }
}

/// Puts an infinity into layer 0's q_proj weight of checkpoint `ck`.
fn inf_weight_in_layer_0(ck: &Path) {
    let p = ck.join("model.safetensors");
    let (h, mut data) = read_safetensors(&p);
    let b = h["model.layers.0.self_attn.q_proj.weight"]["data_offsets"][0]
        .as_u64()
        .unwrap() as usize;
    data[b..b + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    write_safetensors(&p, &h, &data);
}

/// Sizes past their bounds are refused by `plan` and `build` alike, naming
/// config.json, the field and the bound (a `sliding_window` of 10^12 passed
/// `plan`, and `build` asked torch for 4 TB, leaving an empty output folder
/// and its lock file; `plan` accepted a `hidden_size` of 2^64-1), as is a key
/// given twice. A refused build leaves nothing behind, not even when only
/// the weights' check during conversion refuses it.
#[test]
fn oversized_configs_are_refused_by_plan_and_build_leaving_nothing() {
    /// (tag, edit of the checkpoint, error fragment, whether `plan` refuses it too)
    type Case<'a> = (&'a str, Box<dyn Fn(&Path)>, &'a str, bool);
    let cases: [Case; 4] = [
        (
            "window-1e12",
            Box::new(|ck| edit_config(ck, |c| c["sliding_window"] = json!(10u64.pow(12)))),
            "config.json: sliding_window=1000000000000 is out of range: chunkforge accepts 1..=131072",
            true,
        ),
        (
            "hidden-2-64",
            Box::new(|ck| edit_config(ck, |c| c["hidden_size"] = json!(u64::MAX))),
            "config.json: hidden_size=18446744073709551615 is out of range: chunkforge accepts 1..=65536",
            true,
        ),
        (
            "duplicate-key",
            Box::new(|ck| {
                let p = ck.join("config.json");
                let text = fs::read_to_string(&p).unwrap();
                let dup = text.replacen("\"sliding_window\"", "\"sliding_window\": 4096, \"sliding_window\"", 1);
                assert_ne!(dup, text);
                fs::write(&p, dup).unwrap();
            }),
            "config.json: duplicate key `sliding_window` in the top-level object",
            true,
        ),
        (
            "inf-weight-fresh",
            Box::new(inf_weight_in_layer_0),
            "weight model.layers.0.self_attn.q_proj.weight has 1 NaN/Inf values",
            false,
        ),
    ];
    for (tag, edit, says, plan_refuses) in cases {
        let ck = copy_checkpoint(&fixture("e2b", &[]), tag);
        edit(&ck);
        let o = run(&["plan", "--hf-dir", ck.to_str().unwrap()]);
        assert_eq!(o.status.success(), !plan_refuses, "{tag}: {}", stderr(&o));
        if plan_refuses {
            assert_eq!(o.status.code(), Some(2));
            assert!(stderr(&o).contains(says), "{tag}: plan: {}", stderr(&o));
        }
        let parent = tempdir(&format!("{tag}-fresh"));
        let out = parent.join("out");
        let o = run(&build_two(&ck, &out));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{tag}: {err}");
        assert!(err.contains(says), "{tag}: build: {err}");
        let left: Vec<_> = fs::read_dir(&parent)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "{tag}: the refused build left {left:?}");
    }
}

#[test]
fn hostile_checkpoint_corpus() {
    corpus_case(
        "zero-byte",
        |ck| fs::write(ck.join("model.safetensors"), b"").unwrap(),
        "file is 0 bytes, too short",
    );
    corpus_case(
        "header-too-long",
        |ck| {
            let p = ck.join("model.safetensors");
            let mut b = fs::read(&p).unwrap();
            b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
            fs::write(&p, b).unwrap();
        },
        "safetensors header claims 1099511627776 bytes",
    );
    corpus_case(
        "header-not-json",
        |ck| {
            let p = ck.join("model.safetensors");
            let mut b = fs::read(&p).unwrap();
            b[8] = b'!';
            fs::write(&p, b).unwrap();
        },
        "safetensors header is not valid JSON",
    );
    corpus_case(
        "offsets-past-end",
        |ck| {
            edit_header(ck, |h| {
                h["model.norm.weight"]["data_offsets"] = json!([0, 1u64 << 33])
            })
        },
        "tensor model.norm.weight: data ends at byte 8589934592",
    );
    corpus_case(
        "offsets-disagree-with-shape",
        |ck| {
            edit_header(ck, |h| {
                let b = h["model.norm.weight"]["data_offsets"][0].as_u64().unwrap();
                h["model.norm.weight"]["data_offsets"] = json!([b, b + 8]);
            })
        },
        "tensor model.norm.weight: shape [64] of F32 needs 256 bytes but data_offsets span 8",
    );
    corpus_case(
        "huge-shape",
        |ck| {
            edit_header(ck, |h| {
                h["model.norm.weight"]["shape"] = json!([1u64 << 40, 1u64 << 40])
            })
        },
        "needs overflowing bytes",
    );
    corpus_case(
        "unsupported-dtype",
        |ck| edit_header(ck, |h| h["model.norm.weight"]["dtype"] = json!("I32")),
        "tensor model.norm.weight has dtype I32, expected F32, F16 or BF16",
    );
    corpus_case(
        "inf-weight",
        inf_weight_in_layer_0,
        "weight model.layers.0.self_attn.q_proj.weight has 1 NaN/Inf values",
    );
    corpus_case(
        "fp16-overflow",
        |ck| {
            let p = ck.join("model.safetensors");
            let (h, mut data) = read_safetensors(&p);
            let b = h["model.layers.1.mlp.up_proj.weight"]["data_offsets"][0]
                .as_u64()
                .unwrap() as usize;
            data[b..b + 4].copy_from_slice(&1e6f32.to_le_bytes());
            write_safetensors(&p, &h, &data);
        },
        "model.layers.1.mlp.up_proj.weight has 1 NaN/Inf values (after conversion to fp16",
    );
    corpus_case(
        "hidden-size-contradicts",
        |ck| edit_config(ck, |c| c["hidden_size"] = json!(96)),
        "config.json implies",
    );
    corpus_case(
        "no-producer",
        |ck| edit_config(ck, |c| c["num_kv_shared_layers"] = json!(33)),
        "num_kv_shared_layers=33 leaves no KV-producing full-attention layer before layer 2",
    );
    corpus_case(
        "layer-types-length",
        |ck| {
            edit_config(ck, |c| {
                c["layer_types"].as_array_mut().unwrap().truncate(30)
            })
        },
        "layer_types has 30 entries but num_hidden_layers is 35",
    );
    corpus_case(
        "config-not-json",
        |ck| fs::write(ck.join("config.json"), b"{ nope").unwrap(),
        "config.json: not valid JSON",
    );
    corpus_case(
        "symlink-loop",
        |ck| {
            fs::remove_file(ck.join("model.safetensors")).unwrap();
            std::os::unix::fs::symlink("model.safetensors.b", ck.join("model.safetensors")).unwrap();
            std::os::unix::fs::symlink("model.safetensors", ck.join("model.safetensors.b")).unwrap();
        },
        "model.safetensors: is a symlink loop (model.safetensors -> model.safetensors.b -> model.safetensors): it never reaches a file",
    );
    corpus_case(
        "dangling-symlink",
        |ck| {
            fs::remove_file(ck.join("model.safetensors")).unwrap();
            std::os::unix::fs::symlink("/nonexistent/blob", ck.join("model.safetensors")).unwrap();
        },
        "is a symlink to /nonexistent/blob, which does not exist",
    );
    corpus_case(
        "index-names-missing-shard",
        |ck| {
            fs::write(ck.join("model.safetensors.index.json"), br#"{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}"#).unwrap()
        },
        "model-00002-of-00002.safetensors: shard listed in model.safetensors.index.json does not exist",
    );
    corpus_case(
        "index-escapes-folder",
        |ck| {
            fs::write(
                ck.join("model.safetensors.index.json"),
                br#"{"weight_map": {"a": "../../etc/passwd"}}"#,
            )
            .unwrap()
        },
        "shard name `../../etc/passwd` is not a plain file name",
    );
}

/// Replaces model.safetensors' header with `header_text` (raw JSON, so it can
/// hold what serde_json would not write, like a repeated name).
fn write_raw_header(ck: &Path, header_text: &str) {
    let p = ck.join("model.safetensors");
    let (_, data) = read_safetensors(&p);
    let mut out = (header_text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header_text.as_bytes());
    out.extend_from_slice(&data);
    fs::write(&p, out).unwrap();
}

/// Edits model.safetensors' raw bytes.
fn edit_data(ck: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let p = ck.join("model.safetensors");
    let mut b = fs::read(&p).unwrap();
    f(&mut b);
    fs::write(&p, b).unwrap();
}

/// The tensor whose bytes come last in the data section.
fn last_tensor(h: &serde_json::Value) -> String {
    h.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .max_by_key(|(_, v)| v["data_offsets"][0].as_u64().unwrap())
        .map(|(k, _)| k.clone())
        .unwrap()
}

#[test]
fn structurally_broken_safetensors_are_named_by_file_and_tensor() {
    let file = "model.safetensors: ";
    corpus_case(
        "header-over-limit",
        |ck| edit_data(ck, |b| b[..8].copy_from_slice(&(200u64 << 20).to_le_bytes())),
        "safetensors header claims 209715200 bytes, more than the format's limit of 104857600 (100 MiB)",
    );
    corpus_case(
        "shared-bytes",
        |ck| {
            edit_header(ck, |h| {
                let norm = h["model.norm.weight"].clone();
                h["model.zz_alias.weight"] = norm;
            })
        },
        "overlap: ",
    );
    corpus_case(
        "trailing-bytes",
        |ck| edit_data(ck, |b| b.extend_from_slice(&[0; 4])),
        "belong to no tensor; the tensors must cover the data section without gaps",
    );
    corpus_case(
        "gap",
        |ck| {
            let p = ck.join("model.safetensors");
            let (mut h, mut data) = read_safetensors(&p);
            let last = last_tensor(&h);
            let o = &mut h[&last]["data_offsets"];
            let (b, e) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
            *o = json!([b + 4, e + 4]);
            data.extend_from_slice(&[0; 4]);
            write_safetensors(&p, &h, &data);
        },
        "belong to no tensor (gap before tensor ",
    );
    corpus_case(
        "repeated-name",
        |ck| {
            let (h, _) = read_safetensors(&ck.join("model.safetensors"));
            let text = serde_json::to_string(&h).unwrap();
            let norm = serde_json::to_string(&h["model.norm.weight"]).unwrap();
            write_raw_header(
                ck,
                &format!("{{\"model.norm.weight\":{norm},{}", &text[1..]),
            );
        },
        &format!("{file}tensor model.norm.weight appears twice in the safetensors header"),
    );
    corpus_case(
        "repeated-field",
        |ck| {
            let (h, _) = read_safetensors(&ck.join("model.safetensors"));
            let text = serde_json::to_string(&h).unwrap().replacen(
                "\"dtype\":\"F32\"",
                "\"dtype\":\"F32\",\"dtype\":\"I32\"",
                1,
            );
            write_raw_header(ck, &text);
        },
        "field `dtype` appears twice in its header entry",
    );
    corpus_case(
        "metadata-not-strings",
        |ck| edit_header(ck, |h| h["__metadata__"] = json!({"format": "pt", "step": 7})),
        &format!("{file}__metadata__ must be an object mapping strings to strings, but `step` is a number"),
    );
    corpus_case(
        "metadata-not-object",
        |ck| edit_header(ck, |h| h["__metadata__"] = json!(["pt"])),
        "__metadata__ must be an object mapping strings to strings, but it is an array",
    );
    corpus_case(
        "entry-not-object",
        |ck| edit_header(ck, |h| h["model.zz.weight"] = json!(5)),
        &format!("{file}tensor model.zz.weight: header entry is a number, expected an object"),
    );
    corpus_case(
        "shape-not-integers",
        |ck| edit_header(ck, |h| h["model.norm.weight"]["shape"] = json!([64, "x"])),
        "tensor model.norm.weight: shape [64,\"x\"] is not a list of non-negative integers",
    );
}

#[test]
fn symlinked_checkpoint_like_the_hugging_face_cache_is_accepted() {
    // snapshots/<rev>/* -> ../../blobs/<sha>, as huggingface_hub lays out its cache.
    let src = fixture("e2b", &[]);
    let root = tempdir("hf-cache");
    let (blobs, snap) = (root.join("blobs"), root.join("snapshots").join("rev"));
    fs::create_dir_all(&blobs).unwrap();
    fs::create_dir_all(&snap).unwrap();
    for name in ["config.json", "model.safetensors"] {
        fs::copy(src.join(name), blobs.join(format!("blob-{name}"))).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/blob-{name}"), snap.join(name)).unwrap();
    }
    let linked = root.join("link");
    std::os::unix::fs::symlink(&snap, &linked).unwrap();
    let text = ok(&[
        "plan",
        "--hf-dir",
        linked.to_str().unwrap(),
        "--mode",
        "two",
    ]);
    assert!(text.contains("merged_chunk1    layers  0-14"), "{text}");
}

#[test]
fn non_utf8_and_overlong_output_paths_are_refused() {
    let ck = fixture("e2b", &[]);
    let base = tempdir("paths");
    let bad = base.join(std::ffi::OsStr::from_bytes(b"out-\xff\xfe"));
    let o = Command::new(bin())
        .args([
            "build",
            "--hf-dir",
            ck.to_str().unwrap(),
            "--mode",
            "two",
            "--output",
        ])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("path is not valid UTF-8"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!bad.exists());
    let long: PathBuf = base.join("x".repeat(300));
    let err = fails(&build_two(&ck, &long));
    assert!(
        err.contains("cannot create the output folder") && err.contains("too long"),
        "{err}"
    );
}

/// Mounts a tmpfs (as root); returns None, with a visible note, where mounting is not allowed.
fn tmpfs(tag: &str, opts: &str) -> Option<PathBuf> {
    let dir = tempdir(tag);
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
        .arg(&dir)
        .status();
    if st.map(|s| s.success()).unwrap_or(false) {
        Some(dir)
    } else {
        eprintln!("NOTE: skipped: cannot mount a tmpfs here (needs root)");
        None
    }
}

fn umount(dir: &Path) {
    let _ = Command::new("umount").arg(dir).status();
}

#[test]
fn read_only_output_folder_is_refused_cleanly() {
    let ck = fixture("e2b", &[]);
    let Some(dir) = tmpfs("ro", "ro,size=1m") else {
        return;
    };
    let err = fails(&build_two(&ck, &dir));
    umount(&dir);
    assert!(
        err.contains("cannot write into the output folder (read-only?)"),
        "{err}"
    );
}

#[test]
fn disk_full_mid_build_publishes_nothing() {
    let ck = fixture("e2b", &[]);
    // Room for the previous result and the first package, not for the second.
    let Some(dir) = tmpfs("full", "size=1200k") else {
        return;
    };
    previous(&dir);
    let started = Instant::now();
    let o = run(&build_two(&ck, &dir));
    let err = stderr(&o);
    let result = std::panic::catch_unwind(|| {
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("No space left on device"), "{err}");
        assert!(!err.contains("Traceback"), "{err}");
        assert_previous(&dir);
        assert!(fs::read_dir(&dir).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(".chunkforge")));
    });
    umount(&dir);
    eprintln!("disk-full case took {:?}", started.elapsed());
    result.unwrap();
}

#[test]
fn fixture_refuses_to_overwrite_a_checkpoint() {
    let ck = copy_checkpoint(&fixture("e2b", &[]), "overwrite");
    let before = fs::read(ck.join("config.json")).unwrap();
    let err = fails(&["fixture", "--out", ck.to_str().unwrap()]);
    assert!(
        err.contains("already exists and is not an empty folder"),
        "{err}"
    );
    assert_eq!(fs::read(ck.join("config.json")).unwrap(), before);
}

#[test]
fn fixture_refuses_a_vocabulary_too_small_for_its_tokenizer() {
    // 4 special tokens + 256 bytes: 259 cannot hold the byte-level tokenizer.
    let parent = tempdir("tiny-vocab");
    let out = parent.join("ckpt");
    let o = run(&[
        "fixture",
        "--out",
        out.to_str().unwrap(),
        "--vocab-size",
        "259",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "--vocab-size 259: the fixture's byte-level tokenizer needs at least 260 tokens"
        ),
        "{err}"
    );
    assert!(!err.contains("Traceback"), "{err}");
    assert_eq!(
        fs::read_dir(&parent).unwrap().count(),
        0,
        "nothing may be left in {}",
        parent.display()
    );
}

#[test]
fn full_size_fixture_that_cannot_fit_is_refused_before_a_shard_is_written() {
    // Room for the tokenizer (18 MB), not for 8.7 GiB of shards.
    let Some(dir) = tmpfs("full-size", "size=64m") else {
        return;
    };
    let out = dir.join("e2b");
    let o = run(&["fixture", "--full-size", "--out", out.to_str().unwrap()]);
    let err = stderr(&o);
    let result = std::panic::catch_unwind(|| {
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("the checkpoint needs 8.7 GiB and the file system has"),
            "{err}"
        );
        assert_eq!(
            fs::read_dir(&dir).unwrap().count(),
            0,
            "nothing may be left"
        );
    });
    umount(&dir);
    result.unwrap();
    let err = fails(&[
        "fixture",
        "--full-size",
        "--vocab-size",
        "512",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(err.contains("cannot be used with"), "{err}");
}

#[test]
fn sigkill_during_keygen_never_leaves_a_partial_key() {
    let dir = tempdir("kill-keygen");
    for i in 0..40u64 {
        let prefix = dir.join(format!("k{i}"));
        let mut child = spawn(&["keygen", "--out", prefix.to_str().unwrap()]);
        // Spread the kill over the process's short life (exec, key generation, writes).
        std::thread::sleep(Duration::from_micros(i * 250));
        let _ = child.kill();
        let _ = child.wait();
        let (pem, public) = (dir.join(format!("k{i}.pem")), dir.join(format!("k{i}.pub")));
        if pem.exists() {
            let text = fs::read_to_string(&pem).unwrap();
            assert!(
                text.ends_with("-----END PRIVATE KEY-----\n"),
                "partial private key: {text:?}"
            );
            assert!(public.exists(), "private key without its public half");
        }
        if public.exists() {
            let text = fs::read_to_string(&public).unwrap();
            assert!(
                text.ends_with("-----END PUBLIC KEY-----\n"),
                "partial public key: {text:?}"
            );
        }
    }
    // Whatever was left behind, a fresh prefix works and an existing one is refused.
    ok(&["keygen", "--out", dir.join("fresh").to_str().unwrap()]);
    let err = fails(&["keygen", "--out", dir.join("fresh").to_str().unwrap()]);
    assert!(
        err.contains("fresh.pem") || err.contains("fresh.pub"),
        "{err}"
    );
}

// ---- the cache folder: never a shared or current folder, never someone else's ----

/// Environment settings: (name, value), None for unset.
type Vars<'a> = Vec<(&'a str, Option<&'a str>)>;

/// `chunkforge setup` and scripts/setup-signing.sh under `vars` (None: unset),
/// both expected to refuse; returns their `error:` lines.
fn cache_refusals(vars: &[(&str, Option<&str>)]) -> (String, String) {
    let with_env = |mut c: Command| {
        for k in ["CHUNKFORGE_CACHE", "XDG_CACHE_HOME", "HOME"] {
            c.env_remove(k);
        }
        for (k, v) in vars {
            if let Some(v) = v {
                c.env(k, v);
            }
        }
        let o = c.output().unwrap();
        assert!(!o.status.success(), "{vars:?}: accepted");
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        err.lines()
            .find(|l| l.starts_with("error: "))
            .unwrap_or_else(|| panic!("{vars:?}: no error line in {err}"))
            .to_string()
    };
    let mut cf = Command::new(bin());
    cf.arg("setup");
    let mut script = Command::new("bash");
    script.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/setup-signing.sh"));
    (with_env(cf), with_env(script))
}

#[test]
fn an_unsafe_or_unplaceable_cache_folder_is_refused_by_chunkforge_and_the_signing_script_alike() {
    let root = tempdir("cache-rules");
    let open = root.join("open");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let group = root.join("group");
    fs::create_dir(&group).unwrap();
    fs::set_permissions(&group, std::os::unix::fs::PermissionsExt::from_mode(0o770)).unwrap();
    let under_open = open.join("cache");
    let cases: Vec<(Vars, String)> = vec![
        (vec![], "HOME is unset".into()),
        (vec![("HOME", Some(""))], "HOME is empty".into()),
        (
            vec![("HOME", Some("")), ("XDG_CACHE_HOME", Some(""))],
            "HOME is empty".into(),
        ),
        (
            vec![("HOME", Some("rel"))],
            "HOME is `rel`, not an absolute path".into(),
        ),
        (
            vec![("CHUNKFORGE_CACHE", Some("")), ("HOME", Some("/root"))],
            "CHUNKFORGE_CACHE is ``, not an absolute path".into(),
        ),
        (
            vec![("CHUNKFORGE_CACHE", Some(open.to_str().unwrap()))],
            format!(
                "{}: refusing to use this cache folder: it is writable by others (mode 0777)",
                open.display()
            ),
        ),
        (
            vec![("CHUNKFORGE_CACHE", Some(group.to_str().unwrap()))],
            "it is writable by its group (mode 0770)".into(),
        ),
        (
            vec![("CHUNKFORGE_CACHE", Some(under_open.to_str().unwrap()))],
            format!(
                "the folder above it, {}, is writable by everyone",
                open.display()
            ),
        ),
    ];
    for (vars, says) in &cases {
        let (cf, script) = cache_refusals(vars);
        assert!(cf.contains(says), "{vars:?}: expected `{says}` in {cf}");
        assert!(
            cf.contains("set CHUNKFORGE_CACHE to an absolute path"),
            "{cf}"
        );
        assert_eq!(
            cf, script,
            "{vars:?}: chunkforge and setup-signing.sh disagree"
        );
    }
    // HOME unset or empty used to mean /tmp/chunkforge or ./.cache: nothing is made here.
    assert!(!Path::new(".cache").exists());
    // Someone else's folder (the tests run as root, which can give it away).
    let theirs = root.join("theirs");
    fs::create_dir(&theirs).unwrap();
    let st = Command::new("chown")
        .arg("4242")
        .arg(&theirs)
        .status()
        .unwrap();
    assert!(st.success(), "chown");
    let (cf, script) = cache_refusals(&[("CHUNKFORGE_CACHE", theirs.to_str())]);
    assert!(
        cf.contains("it belongs to uid 4242, not to you (uid 0)"),
        "{cf}"
    );
    assert_eq!(cf, script);
}

#[test]
fn out_of_range_options_are_refused_while_parsing_naming_the_option() {
    for (args, says) in [
        (
            &["parity", "--tol-cos", "nan"][..],
            "'--tol-cos <TOL_COS>': `nan` is not a finite number",
        ),
        (
            &["parity", "--tol-cos", "1.5"][..],
            "1.5 is out of range: a cosine is between -1 and 1",
        ),
        (
            &["parity", "--tol-cos-int4", "inf"][..],
            "'--tol-cos-int4 <TOL_COS_INT4>': `inf` is not a finite number",
        ),
        (
            &["parity", "--min-top1-int4", "2"][..],
            "'--min-top1-int4 <MIN_TOP1_INT4>': 2 is out of range: a fraction",
        ),
        (
            &["parity", "--max-weight-rel-mse=-0.5"][..],
            "'--max-weight-rel-mse <MAX_WEIGHT_REL_MSE>': -0.5 is negative",
        ),
        (
            &["parity", "--ctx", "1000000000000"][..],
            "'--ctx <CTX>': 1000000000000 is out of range: the context must be 1..=131072",
        ),
        (
            &["build", "--ctx", "131073", "--output", "x"][..],
            "the context must be 1..=131072",
        ),
        (
            &["plan", "--ctx", "0"][..],
            "'--ctx <CTX>': 0 is out of range",
        ),
    ] {
        let o = run(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: expected `{says}` in {err}");
        assert!(
            !err.contains("Error:") && !err.contains("Traceback"),
            "{err}"
        );
    }
}

/// A build's publish (its two packages, then build.json, as one unit) cut by
/// SIGKILL right before each of its steps (the test hook): the next run, even
/// one killed itself before its first rename, reports the stale lock and puts
/// the previous result back exactly, taking away a new package that had no
/// previous version; the run that is not killed publishes the whole build.
/// Each name the next run reports is one the killed run had moved: a
/// previous version put back is "restored", a new package without one
/// "removed" (it was called restored).
#[test]
fn sigkill_at_every_publish_step_of_a_build_is_undone_by_the_next_run() {
    let ck = fixture("e2b", &[]);
    let out = tempdir("kill-steps-build");
    previous(&out);
    let args = build_two(&ck, &out);
    let mut n = 1;
    loop {
        let step = n.to_string();
        let o = run_env(&args, &[("CHUNKFORGE_TEST_KILL_AT_STEP", &step)]);
        if o.status.success() {
            break;
        }
        assert!(killed(&o), "step {n}: {}", stderr(&o));
        let o = run_env(&args, &[("CHUNKFORGE_TEST_KILL_AT_STEP", "1")]);
        let e = stderr(&o);
        assert!(killed(&o), "step {n}, next run: {e}");
        assert!(e.contains("ended without releasing it"), "{e}");
        let said =
            |what: &str, name: &str| e.contains(&format!("{what} {}", out.join(name).display()));
        // Moved before step n: merged_chunk1 (1), merged_chunk2 (2, new), build.json (3).
        assert_eq!(
            said("restored the previous", "merged_chunk1.mlpackage"),
            n > 1,
            "step {n}: {e}"
        );
        assert_eq!(
            said("removed", "merged_chunk2.mlpackage"),
            n > 2,
            "step {n}: {e}"
        );
        assert!(
            !said("restored the previous", "merged_chunk2.mlpackage"),
            "step {n}: {e}"
        );
        assert_eq!(
            said("restored the previous", "build.json"),
            n > 3,
            "step {n}: {e}"
        );
        assert_previous(&out);
        n += 1;
    }
    assert_eq!(
        n - 1,
        4,
        "kill points: two packages, build.json, the commit"
    );
    assert_eq!(
        visible(&out),
        [
            "build.json",
            "merged_chunk1.mlpackage",
            "merged_chunk2.mlpackage"
        ]
    );
    let report = json_file(&out.join("build.json"));
    for c in report["chunks"].as_array().unwrap() {
        let pkg = out.join(c["package"].as_str().unwrap());
        assert_eq!(
            chunkforge::hashing::tree_digest(&pkg).unwrap(),
            c["sha256_tree"].as_str().unwrap(),
            "{} is not the package build.json lists",
            pkg.display()
        );
    }
    let all: Vec<_> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(all.len(), 3, "staging folders left: {all:?}");
}

/// `build --no-wait` into an output folder another build is writing refuses
/// at once, naming the run that holds it, and changes nothing.
#[test]
fn a_second_build_into_one_output_refuses_with_no_wait() {
    let ck = fixture("e2b", &[]);
    let out = tempdir("lock-build");
    previous(&out);
    let args = build_two(&ck, &out);
    let (mut first, _stderr) = spawn_until(&args, "chunk1: load weights", 0.0);
    let mut second = args.to_vec();
    second.push("--no-wait");
    let e = fails(&second);
    assert!(
        e.contains(&format!("pid {}", first.id())) && e.contains("--no-wait"),
        "{e}"
    );
    assert!(first.try_wait().unwrap().is_none(), "the first build ended");
    let _ = first.kill();
    let _ = first.wait();
    assert_previous(&out);
}
