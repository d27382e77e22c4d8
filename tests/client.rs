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
