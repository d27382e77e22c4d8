//! `client-check` on Linux releases of the built-in checkpoint (the shared
//! INT4 build, packaged here in well under a second): exactly the compile
//! requests and the width mismatches for main and main-3way, the multimodal
//! files on the branch until `package --encoders-from` carries them, and a
//! removed or differing shared blob, a missing side file and a disagreeing
//! `context_length` failing by name (`compile` itself: tests/compile.rs).

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::{copy_tree, json_file, ok, run, stderr, stdout, tempdir};
use serde_json::Value;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn key() -> &'static PathBuf {
    static KEY: OnceLock<PathBuf> = OnceLock::new();
    KEY.get_or_init(|| {
        let d = tempdir("client-keys");
        ok(&["keygen", "--out", s(&d.join("k"))]);
        d.join("k.pem")
    })
}

/// `package --layout app` of the shared build, with `extra`.
fn release(tag: &str, extra: &[&str]) -> PathBuf {
    let out = tempdir(&format!("client-{tag}")).join("release");
    let build = common::built_all();
    let mut args = vec!["package", s(&build), "--key", s(key()), "--output", s(&out)];
    args.extend_from_slice(extra);
    ok(&args);
    out
}

/// The plain release and the one carrying the encoders, made once.
fn plain() -> &'static PathBuf {
    static R: OnceLock<PathBuf> = OnceLock::new();
    R.get_or_init(|| release("plain", &[]))
}

fn with_encoders() -> &'static PathBuf {
    static R: OnceLock<PathBuf> = OnceLock::new();
    R.get_or_init(|| {
        let enc = common::encoder_bundle();
        release("encoders", &["--encoders-from", s(&enc)])
    })
}

/// `client-check --json` of `dir`: (exit code, report).
fn check(dir: &Path, client: &str, multimodal: &str) -> (i32, Value) {
    let o = run(&[
        "client-check",
        s(dir),
        "--client",
        client,
        "--multimodal",
        multimodal,
        "--json",
    ]);
    let v: Value = serde_json::from_str(&stdout(&o))
        .unwrap_or_else(|e| panic!("{e}: {}\n{}", stdout(&o), stderr(&o)));
    (o.status.code().unwrap(), v)
}

fn with_status(r: &Value, status: &str) -> BTreeSet<String> {
    r["requests"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|q| q["status"] == status)
        .map(|q| q["remote"].as_str().unwrap().to_string())
        .collect()
}

/// The problems as (kind, files).
fn problems(r: &Value) -> Vec<(String, Vec<String>)> {
    r["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let files = p["files"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap().to_string())
                .collect();
            (p["kind"].as_str().unwrap().to_string(), files)
        })
        .collect()
}

/// Every `.mlmodelc` request of an entry: the packages it fetches whole (5
/// files each) and without weights (4).
fn compile_requests(whole: &[&str], meta: &[&str]) -> BTreeSet<String> {
    let files = [
        "weights/weight.bin",
        "coremldata.bin",
        "model.mil",
        "metadata.json",
        "analytics/coremldata.bin",
    ];
    let mut out = BTreeSet::new();
    for (list, skip) in [(whole, 0), (meta, 1)] {
        for p in list {
            for f in &files[skip..] {
                out.insert(format!("{p}.mlmodelc/{f}"));
            }
        }
    }
    out
}

const WIDTHS: [(&str, &[&str]); 3] = [
    ("width", &["hf_model/config.json"]),
    (
        "width",
        &[
            "hf_model/config.json",
            "swa/cos_sliding.npy",
            "swa/sin_sliding.npy",
        ],
    ),
    (
        "width",
        &[
            "hf_model/config.json",
            "swa/cos_full.npy",
            "swa/sin_full.npy",
        ],
    ),
];

fn widths() -> Vec<(String, Vec<String>)> {
    WIDTHS
        .iter()
        .map(|(k, f)| (k.to_string(), f.iter().map(|x| x.to_string()).collect()))
        .collect()
}

const FOUR: [&str; 4] = ["swa/chunk1", "swa/chunk2", "swa/chunk3", "swa/chunk4"];
const PREFILL: [&str; 4] = [
    "prefill/chunk1",
    "prefill/chunk2",
    "prefill/chunk3",
    "prefill/chunk4",
];

/// main and main-3way with multimodal off list exactly the compile requests
/// and the three width mismatches (the default checkpoint's head dims are
/// 32/64, the runtime's 256/512); the branch adds the multimodal files it
/// cannot skip; with `--encoders-from` they pass, on every entry.
#[test]
fn linux_release_lists_compile_requests_widths_and_encoders() {
    let rel = plain();
    let cases: [(&str, BTreeSet<String>); 3] = [
        ("main", compile_requests(&FOUR, &PREFILL)),
        (
            "main-3way",
            compile_requests(
                &[
                    "swa/chunk1",
                    "swa/chunk2_3way",
                    "swa/chunk3_3way",
                    "prefill/chunk2",
                    "prefill/chunk3",
                ],
                &["prefill/chunk1", "prefill/chunk4"],
            ),
        ),
        ("branch", compile_requests(&FOUR, &PREFILL)),
    ];
    for (client, want) in &cases {
        let (code, r) = check(rel, client, "off");
        assert_eq!(code, 1, "{client}: {r}");
        assert_eq!(&with_status(&r, "needs-compile"), want, "{client}");
        let mut p = problems(&r);
        let missing = with_status(&r, "missing");
        if *client == "branch" {
            // The branch has no toggle: its seven encoder files (two models'
            // three required files each, five plain files) abort it.
            let want: BTreeSet<String> = [
                "vision.mlmodelc/weights/weight.bin",
                "vision.mlmodelc/coremldata.bin",
                "vision.mlmodelc/model.mil",
                "audio.mlmodelc/weights/weight.bin",
                "audio.mlmodelc/coremldata.bin",
                "audio.mlmodelc/model.mil",
                "mel_filterbank.bin",
                "audio_config.json",
                "output_proj_weight.npy",
                "output_proj_bias.npy",
                "embed_proj_weight.npy",
            ]
            .map(String::from)
            .into();
            assert_eq!(missing, want);
            assert_eq!(with_status(&r, "optional").len(), 4, "{r}");
            let requests: Vec<_> = p.drain(..want.len()).collect();
            assert!(requests.iter().all(|(k, _)| k == "request"), "{requests:?}");
        } else {
            assert!(missing.is_empty(), "{client}: {missing:?}");
            assert!(with_status(&r, "optional").is_empty(), "{client}");
        }
        assert_eq!(p, widths(), "{client}");
    }
    // The three layouts each runtime picks from its download.
    for (client, layout) in [("main", "four"), ("main-3way", "three"), ("branch", "four")] {
        let (_, r) = check(rel, client, "off");
        assert_eq!(r["pick"]["downloaded"], layout, "{client}");
    }
    // With the encoders carried, every multimodal request passes: main with
    // multimodal on too (vision_video included), and they are signed.
    let rel = with_encoders();
    for client in ["main", "main-3way", "branch"] {
        let (_, r) = check(rel, client, "on");
        assert!(with_status(&r, "missing").is_empty(), "{client}: {r}");
        assert_eq!(problems(&r), widths(), "{client}");
        assert!(with_status(&r, "present").contains("vision.mlmodelc/model.mil"));
    }
    let m = json_file(&rel.join("manifest.json"));
    let roles = |path: &str| {
        m["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"] == path)
            .map(|f| f["roles"].clone())
    };
    assert_eq!(
        roles("vision_video.mlmodelc/model.mil"),
        Some(serde_json::json!(["vision"]))
    );
    assert_eq!(
        roles("mel_filterbank.bin"),
        Some(serde_json::json!(["audio"]))
    );
    let pubkey = key().with_extension("pub");
    ok(&["verify", s(rel), "--public-key", s(&pubkey)]);
}

/// `package --onto` a release that carries encoders carries them on, as
/// `--encoders-from` that release would (the run book's workflow keeps the
/// bundle's multimodal files); one without encoders adds none.
#[test]
fn onto_a_release_with_encoders_carries_them() {
    let onto = release("onto-encoders", &["--onto", s(with_encoders())]);
    let (_, r) = check(&onto, "branch", "on");
    assert!(with_status(&r, "missing").is_empty(), "{r}");
    assert!(
        with_status(&r, "present").contains("audio.mlmodelc/model.mil"),
        "{r}"
    );
    let bare = release("onto-plain", &["--onto", s(plain())]);
    assert!(!bare.join("audio.mlmodelc").exists());
    let pubkey = key().with_extension("pub");
    ok(&["verify", s(&onto), "--public-key", s(&pubkey)]);
}

/// `--encoders-from` a folder missing a file every entry requires is
/// refused naming it, before anything is written.
#[test]
fn encoders_from_an_incomplete_bundle_is_refused_by_name() {
    let enc = tempdir("client-enc");
    copy_tree(&common::encoder_bundle(), &enc);
    fs::remove_file(enc.join("audio.mlmodelc/coremldata.bin")).unwrap();
    let out = tempdir("client-enc-out").join("release");
    let e = common::fails(&[
        "package",
        s(&common::built_all()),
        "--key",
        s(key()),
        "--output",
        s(&out),
        "--encoders-from",
        s(&enc),
    ]);
    assert!(
        e.contains("audio.mlmodelc/coremldata.bin: --encoders-from: missing"),
        "{e}"
    );
    assert!(!out.exists());
}

/// A copy of the plain release, changed by `edit`.
fn damaged(tag: &str, edit: impl FnOnce(&Path)) -> PathBuf {
    let d = tempdir(&format!("client-{tag}")).join("release");
    copy_tree(plain(), &d);
    edit(&d);
    d
}

fn failing(dir: &Path, client: &str, kind: &str) -> Vec<(String, Vec<String>)> {
    let (code, r) = check(dir, client, "off");
    assert_eq!(code, 1, "{r}");
    let p: Vec<_> = problems(&r)
        .into_iter()
        .filter(|(k, _)| k == kind)
        .collect();
    assert!(!p.is_empty(), "no {kind} problem: {r}");
    p
}

const BLOB: &str = "Data/com.apple.CoreML/weights/weight.bin";

/// A removed shared blob source, a shared pair that differs, a missing
/// required side file and a context_length that disagrees with chunk1 each
/// fail, naming the files.
#[test]
fn broken_shares_side_files_and_context_fail_by_name() {
    let blob = |pkg: &str| format!("{pkg}.mlpackage/{BLOB}");
    // chunk1's blob is what the app links into prefill_chunk1.
    let d = damaged("no-source", |d| {
        fs::remove_file(d.join(blob("swa/chunk1"))).unwrap()
    });
    let p = failing(&d, "main", "share");
    assert_eq!(p[0].1, [blob("swa/chunk1"), blob("prefill/chunk1")]);
    // prefill_chunk2's blob is stored (the 3-way entry fetches it) and
    // main links chunk2's over it: a changed byte makes the pair differ.
    let d = damaged("pair", |d| {
        let f = d.join(blob("prefill/chunk2"));
        let mut b = fs::read(&f).unwrap();
        b[100] ^= 1;
        fs::write(&f, b).unwrap();
    });
    let p = failing(&d, "main", "share");
    assert_eq!(
        p,
        [(
            "share".to_string(),
            vec![blob("swa/chunk2"), blob("prefill/chunk2")]
        )]
    );
    // The 3-way entry fetches prefill_chunk2 with its own blob: no share.
    let (_, r) = check(&d, "main-3way", "off");
    assert!(problems(&r).iter().all(|(k, _)| k != "share"), "{r}");
    // A required side file: the download aborts on it.
    let d = damaged("side", |d| {
        fs::remove_file(d.join("per_layer_projection.bin")).unwrap()
    });
    let p = failing(&d, "branch", "request");
    assert!(
        p.iter().any(|(_, f)| f == &["per_layer_projection.bin"]),
        "{p:?}"
    );
    // context_length below chunk1's causal_mask_full width.
    let d = damaged("ctx", |d| {
        let f = d.join("model_config.json");
        let t = fs::read_to_string(&f).unwrap();
        assert!(t.contains("\"context_length\": 2048"));
        fs::write(
            &f,
            t.replace("\"context_length\": 2048", "\"context_length\": 1024"),
        )
        .unwrap();
    });
    let p = failing(&d, "main-3way", "context");
    assert_eq!(
        p[0].1,
        [
            "model_config.json".to_string(),
            "swa/chunk1.mlpackage".to_string()
        ]
    );
}

/// An upstream bundle made from the chunkforge release `rel`: the app's
/// repository with each package compiled (`chunkforge compile`, here
/// chunkforge's own writer) and no manifest, signature or run book, as
/// upstream publishes it.
fn upstream_bundle(rel: &Path, out: &Path) {
    let compiled = out.with_file_name(format!(
        "{}-compiled",
        out.file_name().unwrap().to_string_lossy()
    ));
    copy_tree(rel, &compiled);
    ok(&["compile", s(&compiled), "--key", s(key())]);
    copy_tree(&compiled, out);
    for f in ["manifest.json", "model.sig", "DEVICE_RUNBOOK.md"] {
        fs::remove_file(out.join(f)).unwrap();
    }
}

/// `package --onto` an upstream bundle (compiled packages, no manifest): its
/// packages are checked against the plan through their `model.mil` and stay
/// compiled in the release, signed with the rest; the app's main download
/// of the result finds every file (no compile request, the context check
/// read from chunk1's `model.mil`); `run` executes the carried compiled
/// packages to transformers' greedy ids. A contract or config that
/// disagrees is refused by name.
#[test]
fn package_onto_an_upstream_bundle_keeps_its_compiled_packages() {
    let (four_build, both) = common::onto_builds();
    let work = tempdir("client-upstream");
    let four = work.join("four");
    ok(&[
        "package",
        s(&four_build),
        "--layout",
        "four",
        "--key",
        s(key()),
        "--output",
        s(&four),
    ]);
    let bundle = work.join("bundle");
    upstream_bundle(&four, &bundle);
    let onto = |dir: &Path, out: &Path| {
        run(&[
            "package",
            s(&both),
            "--layout",
            "two",
            "--onto",
            s(dir),
            "--key",
            s(key()),
            "--output",
            s(out),
        ])
    };
    let out = work.join("release");
    let o = onto(&bundle, &out);
    assert!(o.status.success(), "{}", stderr(&o));
    let pubkey = key().with_extension("pub");
    ok(&["verify", s(&out), "--public-key", s(&pubkey)]);
    let m = json_file(&out.join("manifest.json"));
    assert_eq!(m["onto"]["upstream"], true);
    assert_eq!(m["onto"]["layout"], "repository");
    assert!(m["onto"].get("version").is_none());
    assert_eq!(m["compiled"]["mlmodelc"], false);
    for c in m["chunks"].as_array().unwrap() {
        let (name, file) = (c["name"].as_str().unwrap(), c["file"].as_str().unwrap());
        let carried = !name.starts_with("merged_");
        assert_eq!(file.ends_with(".mlmodelc"), carried, "{name}: {file}");
        assert!(c["sha256_tree"].is_string(), "{name}");
    }
    // Only the bundle's packages are carried (nothing signed or recorded
    // them); the side files and hf_model/ come from the build's checkpoint.
    assert_eq!(m["onto"]["verified"], false);
    for f in m["files"].as_array().unwrap() {
        let path = f["path"].as_str().unwrap();
        let carried = path.contains(".mlmodelc/");
        assert_eq!(f["carried"].as_bool().unwrap_or(false), carried, "{path}");
    }
    // The app's main download: every file there, chunk1's model.mil read
    // by the downloader's context check; only the fixture's widths differ
    // from the runtime's hard-coded ones.
    let (_, r) = check(&out, "main", "off");
    assert!(with_status(&r, "needs-compile").is_empty(), "{r}");
    assert!(with_status(&r, "missing").is_empty(), "{r}");
    assert!(with_status(&r, "present").contains("swa/chunk1.mlmodelc/model.mil"));
    assert!(
        problems(&r).iter().all(|(k, _)| k == "width"),
        "{:?}",
        problems(&r)
    );
    // The folder the app's download leaves (local names, blobs linked in)
    // is an upstream bundle in the local layout.
    let local = work.join("local");
    let o = run(&[
        "client-check",
        s(&out),
        "--client",
        "main",
        "--multimodal",
        "off",
        "--materialize",
        s(&local),
    ]);
    assert!(
        local
            .join("prefill_chunk2.mlmodelc/weights/weight.bin")
            .is_file(),
        "{}",
        stderr(&o)
    );
    // Upstream's folders record nothing.
    fs::remove_file(local.join("manifest.json")).unwrap();
    let again = work.join("again");
    let o = onto(&local, &again);
    assert!(o.status.success(), "{}", stderr(&o));
    let m2 = json_file(&again.join("manifest.json"));
    assert_eq!(m2["onto"]["layout"], "local");
    assert_eq!(
        m2["chunks"], m["chunks"],
        "the same packages, whichever layout they came from"
    );
    let o = run(&[
        "run",
        s(&out),
        "--prompt",
        common::SENTENCE,
        "--max-tokens",
        &common::TOKENS.to_string(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let hf = PathBuf::from(
        json_file(&four_build.join("build.json"))["checkpoint"]["dir"]
            .as_str()
            .unwrap(),
    );
    let (_, want) = common::transformers_greedy(&hf, common::SENTENCE, common::TOKENS);
    let r: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        common::ids(&r["generated_ids"]),
        want,
        "carried compiled packages vs transformers"
    );

    // RoPE tables other than the config's (upstream's generator rotates
    // every pair of the full layers) or missing: the release's are made
    // from the checkpoint, as every side file of a bundle's release is.
    let rope = work.join("rope");
    copy_tree(&bundle, &rope);
    let cos = rope.join("swa/cos_full.npy");
    let mut bytes = fs::read(&cos).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    fs::write(&cos, bytes).unwrap();
    fs::remove_file(rope.join("swa/sin_sliding.npy")).unwrap();
    let remade = work.join("remade");
    let o = onto(&rope, &remade);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("only its packages are carried"), "{e}");
    let m3 = json_file(&remade.join("manifest.json"));
    for name in ["swa/cos_full.npy", "swa/sin_sliding.npy"] {
        assert_eq!(
            fs::read(remade.join(name)).unwrap(),
            fs::read(four.join(name)).unwrap(),
            "{name}"
        );
        let f = m3["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"] == name)
            .unwrap();
        assert!(f.get("carried").is_none(), "{name}: {f}");
    }

    // Refusals, naming the file; nothing written.
    let refused = |dir: &Path, names: &Path, what: &str| {
        let bad = work.join("bad");
        let o = onto(dir, &bad);
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{e}");
        assert!(e.contains(&format!("{}: {what}", names.display())), "{e}");
        assert!(!bad.exists());
    };
    let contract = work.join("contract");
    copy_tree(&bundle, &contract);
    let mil = contract.join("prefill/chunk3.mlmodelc/model.mil");
    let text = fs::read_to_string(&mil).unwrap();
    assert!(text.contains("tensor<fp16, [1, 512, "));
    let widened = text.replacen("tensor<fp16, [1, 512, ", "tensor<fp16, [1, 513, ", 1);
    fs::write(&mil, widened).unwrap();
    refused(
        &contract,
        &mil,
        "function prefill_b512's inputs are not what",
    );
    let no_config = work.join("no-config");
    copy_tree(&bundle, &no_config);
    fs::remove_file(no_config.join("hf_model/config.json")).unwrap();
    refused(
        &no_config,
        &no_config.join("hf_model/config.json"),
        "missing",
    );
    let empty = work.join("empty");
    fs::create_dir_all(&empty).unwrap();
    refused(&empty, &empty, "--onto takes a chunkforge release");
}

/// The shell blocks of a run book, in order.
fn shell_blocks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut block: Option<Vec<&str>> = None;
    for line in text.lines() {
        match (&mut block, line) {
            (None, "```sh") => block = Some(Vec::new()),
            (Some(b), "```") => {
                out.push(b.join("\n"));
                block = None;
            }
            (Some(b), l) => b.push(l),
            (None, _) => {}
        }
    }
    out
}

/// Every shell line of `DEVICE_RUNBOOK.md`, run in order against the
/// release in a temporary folder with the device steps stubbed (`xcrun
/// devicectl` records the folder it would copy): each command succeeds,
/// so every path it names exists; the model folder it makes holds every
/// file the app's own download leaves (`client-check --materialize`), byte
/// for byte, under the local names the runtime reads; and each layout's
/// copy to the device holds the packages that make the runtime pick it. The
/// same for the release compiled (`compile` makes its run book again, with
/// `.mlmodelc` folders).
#[test]
fn every_run_book_line_runs_against_the_release() {
    run_book_lines(plain(), "mlpackage");
    let compiled = tempdir("client-runbook-compiled").join("release");
    copy_tree(plain(), &compiled);
    ok(&["compile", s(&compiled), "--key", s(key())]);
    run_book_lines(&compiled, "mlmodelc");
}

fn run_book_lines(rel: &Path, ext: &str) {
    let text = fs::read_to_string(rel.join("DEVICE_RUNBOOK.md")).unwrap();
    let blocks = shell_blocks(&text);
    let work = tempdir(&format!("client-runbook-{ext}"));
    let (model, stash, stubs) = (work.join("model"), work.join("stash"), work.join("bin"));
    fs::create_dir_all(&stubs).unwrap();
    // The device: `xcrun devicectl device copy to … --source DIR …` lists
    // DIR's root into copies/N (and fails on a DIR that is not there).
    let xcrun = stubs.join("xcrun");
    fs::write(
        &xcrun,
        format!(
            "#!/bin/bash\nset -eu\nsrc=''\nwhile [ $# -gt 0 ]; do [ \"$1\" = --source ] && src=\"$2\"; shift; done\n[ -d \"$src\" ]\nmkdir -p '{0}'\nn=$(ls '{0}' | wc -l)\nls \"$src\" > '{0}'/$n\n",
            work.join("copies").display()
        ),
    )
    .unwrap();
    fs::set_permissions(&xcrun, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let bin_dir = common::bin().parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}:{}",
        stubs.display(),
        bin_dir.display(),
        std::env::var("PATH").unwrap()
    );
    // The verdict reads the device's logs: not run here.
    let runnable: Vec<&String> = blocks
        .iter()
        .filter(|b| !b.starts_with("chunkforge device-report"))
        .collect();
    assert!(runnable.len() >= 4, "{text}");
    for (i, b) in runnable.iter().enumerate() {
        let o = std::process::Command::new("bash")
            .args(["-euo", "pipefail", "-c", b])
            .env("PATH", &path)
            .env("RELEASE", rel)
            .env("PUBLIC_KEY", key().with_extension("pub"))
            .env("MODEL_DIR", &model)
            .env("STASH", &stash)
            .env("DEVICE", "test-device")
            .env("APP_ID", "com.example.test")
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "block {i} failed:\n{b}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    // The model folder holds the app's download of the release, as
    // client-check materializes it, under local names.
    let app = work.join("app");
    let _ = run(&[
        "client-check",
        s(rel),
        "--client",
        "main",
        "--multimodal",
        "off",
        "--materialize",
        s(&app),
    ]);
    let files: Vec<_> = walkdir::WalkDir::new(&app)
        .into_iter()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().is_file())
        .map(|e| e.path().strip_prefix(&app).unwrap().to_path_buf())
        .collect();
    assert!(files.len() > 20, "{files:?}");
    for f in &files {
        assert_eq!(
            fs::read(model.join(f)).unwrap_or_else(|e| panic!("{}: {e}", f.display())),
            fs::read(app.join(f)).unwrap(),
            "{}",
            f.display()
        );
    }
    let blob = if ext == "mlmodelc" {
        "weights/weight.bin"
    } else {
        BLOB
    };
    for f in [
        format!("chunk1.{ext}"),
        format!("chunk2_3way.{ext}"),
        format!("merged_chunk1.{ext}"),
        "cos_full.npy".to_string(),
        format!("prefill_chunk4.{ext}/{blob}"),
    ] {
        assert!(model.join(&f).exists(), "{f}");
    }
    assert!(!model.join("swa").exists());
    // Each copy to the device: the first is the whole folder, then each
    // layout's section in bench order (four-chunk, three-chunk, two-chunk).
    let copies: Vec<BTreeSet<String>> = (0..)
        .map(|n| work.join("copies").join(n.to_string()))
        .take_while(|p| p.exists())
        .map(|p| {
            fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(String::from)
                .collect()
        })
        .collect();
    assert_eq!(copies.len(), 4, "{copies:?}");
    let has = |c: &BTreeSet<String>, p: &str| c.contains(&format!("{p}.{ext}"));
    assert!(copies
        .iter()
        .all(|c| has(c, "chunk1") && has(c, "prefill_chunk1")));
    assert!(!has(&copies[1], "chunk2_3way") && !has(&copies[1], "merged_chunk1"));
    assert!(has(&copies[2], "chunk2_3way") && has(&copies[2], "chunk3_3way"));
    assert!(!has(&copies[3], "chunk2_3way") && has(&copies[3], "merged_chunk2"));
    // Every package is back in the folder after the bench.
    assert!(has(
        &fs::read_dir(&model)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect(),
        "chunk2_3way"
    ));
}

/// A copy of `release` whose manifest records chunk `name`'s verify_qK
/// without output `output`, as a release built for one runtime only would.
fn without_verify_output(release: &Path, tag: &str, name: &str, output: &str) -> PathBuf {
    let d = tempdir(&format!("client-{tag}")).join("release");
    copy_tree(release, &d);
    let path = d.join("manifest.json");
    let mut m = json_file(&path);
    let chunk = m["chunks"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == name)
        .unwrap();
    for f in chunk["functions"].as_array_mut().unwrap() {
        if f["kind"] == "verify" {
            f["outputs"]
                .as_array_mut()
                .unwrap()
                .retain(|t| t["name"] != output);
        }
    }
    fs::remove_file(&path).unwrap();
    fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    d
}

/// The branch's verify is write-through: it reads K/V_sliding_out and
/// K/V_full_out from chunk1's and chunk2's verify_qK, force-unwrapped.
/// chunkforge's verify_qK returns them beside main's new rows, and
/// client-check names the one a release lacks, for the runtime that reads it.
#[test]
fn client_check_holds_each_runtime_to_its_verify_contract() {
    let (code, r) = check(with_encoders(), "branch", "on");
    assert!(
        !problems(&r).iter().any(|(k, _)| k == "verify"),
        "{code}: {r}"
    );
    let notes = r["notes"].to_string();
    assert!(notes.contains("write-through"), "{notes}");
    let d = without_verify_output(with_encoders(), "no-wt", "chunk2", "K_full_out");
    let (code, r) = check(&d, "branch", "on");
    assert_eq!(code, 1, "{r}");
    let p: Vec<_> = r["problems"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["kind"] == "verify")
        .collect();
    assert_eq!(p.len(), 1, "{r}");
    assert_eq!(p[0]["files"], serde_json::json!(["swa/chunk2.mlpackage"]));
    let m = p[0]["message"].as_str().unwrap();
    assert!(
        m.contains("returns no K_full_out") && m.contains("crashes"),
        "{m}"
    );
    // Main does not read it: the same release passes main's check.
    let (_, r) = check(&d, "main", "off");
    assert!(!problems(&r).iter().any(|(k, _)| k == "verify"), "{r}");
    // Main's new rows are optionals: a missing one skips the commit.
    let d = without_verify_output(plain(), "no-rows", "chunk1", "new_K_sliding");
    let (_, r) = check(&d, "main", "off");
    let m = r["problems"].to_string();
    assert!(
        m.contains("returns no new_K_sliding") && m.contains("commit is skipped"),
        "{m}"
    );
}

/// Main's safety stop: a download whose bytes pass 1.5 x its list's
/// estimatedSize sum aborts. The release's vision encoder blob is made to
/// weigh exactly the limit (a sparse file), then one byte more: only the
/// second fails, naming the file; the branch has no stop.
#[test]
fn main_aborts_a_download_past_one_and_a_half_times_its_estimate() {
    let d = tempdir("client-size").join("release");
    copy_tree(with_encoders(), &d);
    let (code, r) = check(&d, "main", "on");
    assert!(
        !problems(&r).iter().any(|(k, _)| k == "size"),
        "{code}: {r}"
    );
    let (bytes, limit) = (
        r["download_bytes"].as_u64().unwrap(),
        r["abort_limit"].as_u64().unwrap(),
    );
    // ModelDownloader.swift at 72178c6: its lists' estimates, times 1.5.
    assert_eq!(limit, 7_415_447_437);
    let blob = d.join("vision.mlmodelc/weights/weight.bin");
    let size = fs::metadata(&blob).unwrap().len();
    // A sparse file: its length is what the download counts.
    fs::remove_file(&blob).unwrap();
    let f = fs::File::create(&blob).unwrap();
    f.set_len(size + limit - bytes).unwrap();
    let (_, r) = check(&d, "main", "on");
    assert_eq!(r["download_bytes"].as_u64().unwrap(), limit);
    assert!(!problems(&r).iter().any(|(k, _)| k == "size"), "{r}");
    f.set_len(size + limit - bytes + 1).unwrap();
    let (code, r) = check(&d, "main", "on");
    assert_eq!(code, 1);
    let size_problems: Vec<_> = problems(&r)
        .into_iter()
        .filter(|(k, _)| k == "size")
        .collect();
    assert_eq!(size_problems.len(), 1, "{r}");
    assert_eq!(size_problems[0].1[0], "vision.mlmodelc/weights/weight.bin");
    // Multimodal off does not fetch it; the branch has no stop.
    let (_, r) = check(&d, "main", "off");
    assert!(!problems(&r).iter().any(|(k, _)| k == "size"), "{r}");
    let (_, r) = check(&d, "branch", "on");
    assert!(r["abort_limit"].is_null());
    assert!(!problems(&r).iter().any(|(k, _)| k == "size"), "{r}");
}

/// `inspect` on a release's prefill packages stored without a blob (the
/// app's download links or copies chunk1's and chunk4's in) reads the blob
/// their share gives them, as `run` does.
#[test]
fn inspect_reads_a_shared_blob_as_run_does() {
    let rel = plain();
    for (prefill, from) in [
        ("prefill/chunk1", "swa/chunk1"),
        ("prefill/chunk4", "swa/chunk4"),
    ] {
        let pkg = rel.join(format!("{prefill}.mlpackage"));
        assert!(!pkg.join(BLOB).exists(), "{prefill} holds its own blob");
        let shared: Value = serde_json::from_str(&ok(&["inspect", s(&pkg), "--json"])).unwrap();
        let own: Value = serde_json::from_str(&ok(&[
            "inspect",
            s(&rel.join(format!("{from}.mlpackage"))),
            "--json",
        ]))
        .unwrap();
        assert!(
            !shared["palettized"].as_array().unwrap().is_empty(),
            "{prefill}"
        );
        assert_eq!(shared["palettized"], own["palettized"], "{prefill}");
        let text = ok(&["inspect", s(&pkg)]);
        assert!(
            text.contains("weights: ") && text.contains(&format!("{from}.mlpackage")),
            "{text}"
        );
    }
}

/// A stand-in for the encoders (every file the app requests present and
/// non-empty, a text `model.mil` without a function, random side files),
/// which `--encoders-from` once accepted, is refused naming the first file
/// that does not fit what the app feeds and reads; nothing is written.
#[test]
fn encoders_from_a_stand_in_is_refused_by_name() {
    let enc = tempdir("client-stand-in");
    for e in ["vision.mlmodelc", "vision_video.mlmodelc", "audio.mlmodelc"] {
        for f in [
            "weights/weight.bin",
            "coremldata.bin",
            "metadata.json",
            "analytics/coremldata.bin",
        ] {
            let p = enc.join(e).join(f);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(&p, [7u8; 64]).unwrap();
        }
        fs::write(enc.join(e).join("model.mil"), b"program(1.3)\n{}\n").unwrap();
    }
    for f in [
        "mel_filterbank.bin",
        "audio_config.json",
        "output_proj_weight.npy",
        "output_proj_bias.npy",
        "embed_proj_weight.npy",
    ] {
        fs::write(enc.join(f), [7u8; 64]).unwrap();
    }
    let out = tempdir("client-stand-in-out").join("release");
    let e = common::fails(&[
        "package",
        s(&common::built_all()),
        "--key",
        s(key()),
        "--output",
        s(&out),
        "--encoders-from",
        s(&enc),
    ]);
    assert!(
        e.contains("vision.mlmodelc/model.mil: --encoders-from: cannot read the model's function signature"),
        "{e}"
    );
    assert!(!out.exists());
    // Signatures right, side files random: the first that does not fit.
    copy_tree(&common::encoder_bundle(), &enc);
    fs::write(enc.join("mel_filterbank.bin"), [7u8; 64]).unwrap();
    let e = common::fails(&[
        "package",
        s(&common::built_all()),
        "--key",
        s(key()),
        "--output",
        s(&out),
        "--encoders-from",
        s(&enc),
    ]);
    assert!(
        e.contains("mel_filterbank.bin: --encoders-from: 64 bytes"),
        "{e}"
    );
    assert!(!out.exists());
}
