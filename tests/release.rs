//! Signed releases: keygen, package, verify, and the cross-checks with the
//! independent OpenSSF `model_signing` tool (PyPI model-signing 1.1.1, in its
//! own environment made by scripts/setup-signing.sh).
//!
//! Most tests use a synthetic build folder: the real plan of the tiny E2B
//! fixture (`chunkforge plan --json`) with small stand-in package contents, so
//! they run in seconds. One test packages a real `build --mode all` output
//! (built once, cached under the target dir, ~2 minutes).

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;

use common::synthetic::{
    checkpoint_dir, config_sha256, keys, synthetic_build, tree_digest, weights_of,
};
use common::{copy_tree, fails, killed, ok, run, run_env, stderr, stdout, tempdir};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const WEIGHT: &str = "merged_chunk1.mlpackage/Data/com.apple.CoreML/weights/weight.bin";

/// The side files every release carries beside its packages.
const SIDE_FILES: [&str; 11] = [
    "swa/cos_full.npy",
    "swa/cos_sliding.npy",
    "embed_tokens_per_layer_q8.bin",
    "embed_tokens_per_layer_scales.bin",
    "embed_tokens_q8.bin",
    "embed_tokens_scales.bin",
    "model_config.json",
    "per_layer_norm_weight.bin",
    "per_layer_projection.bin",
    "swa/sin_full.npy",
    "swa/sin_sliding.npy",
];

/// Package `name`'s folder in a release, the app's repository
/// (ModelDownloader.swift's remote paths; merged packages are sideloaded at
/// the root).
fn repo_path(name: &str) -> String {
    match name.strip_prefix("prefill_") {
        Some(n) => format!("prefill/{n}.mlpackage"),
        None if name.starts_with("merged_") => format!("{name}.mlpackage"),
        None => format!("swa/{name}.mlpackage"),
    }
}

/// The weight blob inside a package folder.
const BLOB: &str = "Data/com.apple.CoreML/weights/weight.bin";

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

// ---------------------------------------------------------------- model_signing

fn cache_dir() -> PathBuf {
    chunkforge::cache_dir::cache_dir().unwrap()
}

/// The signing venv's bin folder, set up once per test run by scripts/setup-signing.sh.
fn signing_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/setup-signing.sh");
        let st = Command::new("bash")
            .arg(&script)
            .status()
            .expect("run setup-signing.sh");
        assert!(st.success(), "scripts/setup-signing.sh failed");
        cache_dir().join("signing-venv/bin")
    })
}

fn model_signing(args: &[&str]) -> Output {
    Command::new(signing_bin().join("model_signing"))
        .args(args)
        .output()
        .expect("spawn model_signing")
}

fn ms_verify(dir: &Path, public: &Path) -> Output {
    model_signing(&[
        "verify",
        "key",
        s(dir),
        "--signature",
        s(&dir.join("model.sig")),
        "--public_key",
        s(public),
    ])
}

fn ms_sign(dir: &Path, private: &Path) {
    let _ = fs::remove_file(dir.join("model.sig"));
    let o = model_signing(&[
        "sign",
        "key",
        s(dir),
        "--private_key",
        s(private),
        "--signature",
        s(&dir.join("model.sig")),
    ]);
    assert!(
        o.status.success(),
        "model_signing sign failed: {}",
        stderr(&o)
    );
}

fn cf_verify(dir: &Path, public: &Path) -> Output {
    run(&["verify", s(dir), "--public-key", s(public)])
}

// ---------------------------------------------------------------- fixtures

/// A signed release of a synthetic build (layout two, with a zip) and its keys.
struct Release {
    work: PathBuf,
    dir: PathBuf,
    zip: PathBuf,
    private: PathBuf,
    public: PathBuf,
}

fn release(tag: &str) -> Release {
    let work = tempdir(tag);
    let build = synthetic_build(&work.join("build"), &[], 0);
    let (private, public) = keys(&work, "release");
    let dir = work.join("rel");
    let zip = work.join("rel.zip");
    ok(&[
        "package",
        s(&build),
        "--layout",
        "two",
        "--key",
        s(&private),
        "--output",
        s(&dir),
        "--version",
        "1.2.3",
        "--zip",
        s(&zip),
    ]);
    Release {
        work,
        dir,
        zip,
        private,
        public,
    }
}

fn manifest(dir: &Path) -> Value {
    serde_json::from_slice(&fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

// ---------------------------------------------------------------- tests

#[test]
fn keygen_writes_private_0600_and_refuses_to_overwrite() {
    let d = tempdir("keygen");
    let (private, public) = keys(&d, "k");
    let pem = fs::read_to_string(&private).unwrap();
    assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----\n"), "{pem}");
    assert_eq!(
        fs::metadata(&private).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert!(fs::read_to_string(&public)
        .unwrap()
        .starts_with("-----BEGIN PUBLIC KEY-----\n"));
    let err = fails(&["keygen", "--out", s(&d.join("k"))]);
    assert!(
        err.contains("k.pem") && err.contains("refusing to overwrite"),
        "{err}"
    );
    assert_eq!(
        fs::read_to_string(&private).unwrap(),
        pem,
        "existing key changed"
    );
    // openssl reads what keygen wrote, as a P-256 key.
    let o = Command::new("openssl")
        .args(["pkey", "-in", s(&private), "-noout", "-text"])
        .output()
        .unwrap();
    assert!(
        o.status.success() && stdout(&o).contains("prime256v1"),
        "{}",
        stdout(&o)
    );
}

#[test]
fn model_signing_accepts_a_chunkforge_release() {
    let r = release("ms-accepts");
    let o = ms_verify(&r.dir, &r.public);
    assert!(
        o.status.success(),
        "model_signing rejected a chunkforge release:\n{}{}",
        stdout(&o),
        stderr(&o)
    );
    let out = stdout(&cf_verify(&r.dir, &r.public));
    assert!(out.starts_with("OK "), "{out}");
    let out = ok(&[
        "verify",
        s(&r.dir),
        "--public-key",
        s(&r.public),
        "--archive",
        s(&r.zip),
    ]);
    assert!(out.contains("archive matches"), "{out}");
}

/// Each tampering, checked by both verifiers; chunkforge must name the file.
#[test]
fn both_verifiers_reject_tampering() {
    let r = release("tamper");
    let (_, wrong_pub) = keys(&r.work, "other");
    type Tamper = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Tamper, &str)> = vec![
        (
            "one byte changed",
            Box::new(|d: &Path| {
                let p = d.join(WEIGHT);
                let mut b = fs::read(&p).unwrap();
                b[1234] ^= 1;
                fs::write(&p, b).unwrap();
            }),
            WEIGHT,
        ),
        (
            "file added",
            Box::new(|d: &Path| fs::write(d.join("swa/chunk2.mlpackage/extra.txt"), "x").unwrap()),
            "swa/chunk2.mlpackage/extra.txt",
        ),
        (
            "file removed",
            Box::new(|d: &Path| {
                fs::remove_file(d.join("swa/chunk3.mlpackage/Manifest.json")).unwrap()
            }),
            "swa/chunk3.mlpackage/Manifest.json",
        ),
        (
            "file renamed",
            Box::new(|d: &Path| {
                fs::rename(
                    d.join("merged_chunk2.mlpackage/Data/com.apple.CoreML/model.mlmodel"),
                    d.join("merged_chunk2.mlpackage/Data/com.apple.CoreML/model2.mlmodel"),
                )
                .unwrap()
            }),
            "merged_chunk2.mlpackage/Data/com.apple.CoreML/model.mlmodel",
        ),
        (
            "manifest edited",
            Box::new(|d: &Path| {
                let mut m = manifest(d);
                m["release"]["version"] = json!("9.9.9");
                fs::write(
                    d.join("manifest.json"),
                    serde_json::to_vec_pretty(&m).unwrap(),
                )
                .unwrap();
            }),
            "manifest.json",
        ),
    ];
    for (what, tamper, name) in cases {
        let d = r.work.join(format!("case-{}", what.replace(' ', "-")));
        copy_tree(&r.dir, &d);
        assert!(
            cf_verify(&d, &r.public).status.success(),
            "{what}: copy should verify before tampering"
        );
        tamper(&d);
        let o = ms_verify(&d, &r.public);
        assert!(!o.status.success(), "{what}: model_signing accepted it");
        let o = cf_verify(&d, &r.public);
        assert!(!o.status.success(), "{what}: chunkforge verify accepted it");
        assert!(
            stderr(&o).contains(name),
            "{what}: message does not name {name}:\n{}",
            stderr(&o)
        );
    }
    // The wrong public key.
    let o = ms_verify(&r.dir, &wrong_pub);
    assert!(!o.status.success(), "model_signing accepted the wrong key");
    let o = cf_verify(&r.dir, &wrong_pub);
    assert!(!o.status.success(), "chunkforge accepted the wrong key");
    assert!(stderr(&o).contains("different key"), "{}", stderr(&o));
}

/// model_signing's signature of the same folder: chunkforge verifies it, and
/// both tools list the same resources with the same subject digest and key hint.
#[test]
fn chunkforge_verifies_model_signing_signatures() {
    let r = release("ms-signed");
    let d = r.work.join("resigned");
    copy_tree(&r.dir, &d);
    let ours: Value = serde_json::from_slice(&fs::read(d.join("model.sig")).unwrap()).unwrap();
    ms_sign(&d, &r.private);
    let o = cf_verify(&d, &r.public);
    assert!(
        o.status.success(),
        "chunkforge rejected a model_signing signature:\n{}",
        stderr(&o)
    );
    let theirs: Value = serde_json::from_slice(&fs::read(d.join("model.sig")).unwrap()).unwrap();
    let st = |b: &Value| -> Value {
        use base64::Engine;
        let p = base64::engine::general_purpose::STANDARD
            .decode(b["dsseEnvelope"]["payload"].as_str().unwrap())
            .unwrap();
        serde_json::from_slice(&p).unwrap()
    };
    let (a, b) = (st(&ours), st(&theirs));
    assert_eq!(a["predicate"]["resources"], b["predicate"]["resources"]);
    assert_eq!(a["subject"][0]["digest"], b["subject"][0]["digest"]);
    assert_eq!(ours["verificationMaterial"], theirs["verificationMaterial"]);
    assert_eq!(
        a["predicate"]["serialization"]["allow_symlinks"],
        json!(false)
    );
    // ...and it still rejects tampering under model_signing's signature.
    fs::write(d.join(WEIGHT), b"replaced").unwrap();
    let o = cf_verify(&d, &r.public);
    assert!(
        !o.status.success() && stderr(&o).contains(WEIGHT),
        "{}",
        stderr(&o)
    );

    // A plain model folder (no manifest.json), with a name that sorts
    // differently by components than by bytes.
    let m = r.work.join("plain");
    fs::create_dir_all(m.join("a")).unwrap();
    fs::write(m.join("a/b"), "1").unwrap();
    fs::write(m.join("a.b"), "2").unwrap();
    fs::write(m.join("a-c"), "3").unwrap();
    ms_sign(&m, &r.private);
    let o = cf_verify(&m, &r.public);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("no manifest.json"), "{}", stdout(&o));
}

/// model_signing 1.1.1 parses `model.sig` strictly (unknown fields, wrong
/// types, a missing publicKey are malformed); chunkforge's verify refuses the
/// same bundles, naming the field, and accepts what model_signing accepts
/// (it accepted a bundle without its publicKey, or with an unknown field in
/// dsseEnvelope). None of these fields is signed: two verifiers must simply
/// not disagree on one folder.
#[test]
fn verify_refuses_the_bundles_model_signing_refuses() {
    let r = release("bundle-shape");
    let sig: Value = serde_json::from_slice(&fs::read(r.dir.join("model.sig")).unwrap()).unwrap();
    type Edit = fn(&mut Value);
    let cases: [(&str, Edit, Option<&str>); 16] = [
        (
            "no publicKey",
            |b| {
                drop(
                    b["verificationMaterial"]
                        .as_object_mut()
                        .unwrap()
                        .remove("publicKey"),
                )
            },
            Some("verificationMaterial has no publicKey"),
        ),
        (
            "field in dsseEnvelope",
            |b| b["dsseEnvelope"]["x"] = json!(1),
            Some("dsseEnvelope has an unexpected field 'x'"),
        ),
        (
            "field in publicKey",
            |b| b["verificationMaterial"]["publicKey"]["x"] = json!(1),
            Some("verificationMaterial.publicKey has an unexpected field 'x'"),
        ),
        (
            "field in verificationMaterial",
            |b| b["verificationMaterial"]["x"] = json!(1),
            Some("verificationMaterial has an unexpected field 'x'"),
        ),
        (
            "field in a signature",
            |b| b["dsseEnvelope"]["signatures"][0]["x"] = json!(1),
            Some("dsseEnvelope.signatures[] has an unexpected field 'x'"),
        ),
        (
            "no verificationMaterial",
            |b| drop(b.as_object_mut().unwrap().remove("verificationMaterial")),
            Some("no verificationMaterial"),
        ),
        (
            "hint a number",
            |b| b["verificationMaterial"]["publicKey"]["hint"] = json!(5),
            Some("verificationMaterial.publicKey.hint is a number, expected a string"),
        ),
        (
            "certificate beside publicKey",
            |b| b["verificationMaterial"]["certificate"] = json!({"rawBytes": "AA=="}),
            Some("holds a publicKey and a certificate"),
        ),
        (
            "tlogEntries null",
            |b| b["verificationMaterial"]["tlogEntries"] = Value::Null,
            Some("verificationMaterial.tlogEntries is null, expected a list"),
        ),
        (
            "signatures empty",
            |b| b["dsseEnvelope"]["signatures"] = json!([]),
            Some("dsseEnvelope.signatures is empty"),
        ),
        // Accepted by both.
        (
            "no hint",
            |b| {
                drop(
                    b["verificationMaterial"]["publicKey"]
                        .as_object_mut()
                        .unwrap()
                        .remove("hint"),
                )
            },
            None,
        ),
        (
            "publicKey rawBytes",
            |b| b["verificationMaterial"]["publicKey"]["rawBytes"] = json!("AA=="),
            None,
        ),
        (
            "no tlogEntries",
            |b| {
                drop(
                    b["verificationMaterial"]
                        .as_object_mut()
                        .unwrap()
                        .remove("tlogEntries"),
                )
            },
            None,
        ),
        (
            "empty timestampVerificationData",
            |b| b["verificationMaterial"]["timestampVerificationData"] = json!({}),
            None,
        ),
        (
            "keyid null",
            |b| b["dsseEnvelope"]["signatures"][0]["keyid"] = Value::Null,
            None,
        ),
        (
            "two signatures",
            |b| {
                let first = b["dsseEnvelope"]["signatures"][0].clone();
                b["dsseEnvelope"]["signatures"]
                    .as_array_mut()
                    .unwrap()
                    .push(first);
            },
            None,
        ),
    ];
    for (i, (what, edit, refused)) in cases.into_iter().enumerate() {
        let d = r.work.join(format!("shape-{i}"));
        copy_tree(&r.dir, &d);
        let mut b = sig.clone();
        edit(&mut b);
        fs::remove_file(d.join("model.sig")).unwrap();
        fs::write(d.join("model.sig"), serde_json::to_vec(&b).unwrap()).unwrap();
        let ms = ms_verify(&d, &r.public);
        let cf = cf_verify(&d, &r.public);
        let said = format!("{}{}", stdout(&cf), stderr(&cf));
        assert_eq!(
            ms.status.success(),
            refused.is_none(),
            "{what}: model_signing: {}",
            stderr(&ms)
        );
        assert_eq!(
            cf.status.success(),
            refused.is_none(),
            "{what}: chunkforge: {said}"
        );
        if let Some(fragment) = refused {
            assert!(
                said.contains("model.sig: ") && said.contains(fragment),
                "{what}: {said}"
            );
        }
        fs::remove_dir_all(&d).unwrap();
    }
}

/// A signature must cover manifest.json and may leave nothing else unsigned:
/// model_signing itself signs a folder with `--ignore-paths manifest.json`,
/// after which an edited manifest (new version, new URLs) used to "agree".
#[test]
fn verify_refuses_signatures_that_leave_the_manifest_unsigned() {
    let r = release("unsigned-manifest");
    let o = model_signing(&[
        "sign",
        "key",
        s(&r.dir),
        "--private_key",
        s(&r.private),
        "--signature",
        s(&r.dir.join("model.sig")),
        "--ignore-paths",
        s(&r.dir.join("manifest.json")),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut m = manifest(&r.dir);
    m["release"]["version"] = json!("6.6.6");
    m["files"][0]["url"] = json!("https://evil.example.com/weights.bin");
    fs::write(
        r.dir.join("manifest.json"),
        serde_json::to_vec_pretty(&m).unwrap(),
    )
    .unwrap();
    let o = cf_verify(&r.dir, &r.public);
    let err = stderr(&o);
    assert!(!o.status.success(), "accepted: {}", stdout(&o));
    assert!(
        err.contains("ignore_paths lists 'manifest.json', which would leave it unsigned"),
        "{err}"
    );
    assert!(
        err.contains("manifest.json: is not among the signed files"),
        "{err}"
    );
}

/// Signed paths that collide on a case-insensitive file system are refused by
/// verify (whoever signed them) and by package.
#[test]
fn case_insensitive_path_collisions_are_refused() {
    let w = tempdir("case");
    let (private, public) = keys(&w, "k");
    let m = w.join("plain");
    fs::create_dir_all(m.join("a")).unwrap();
    fs::write(m.join("a/Weight.bin"), "1").unwrap();
    fs::write(m.join("a/weight.bin"), "2").unwrap();
    ms_sign(&m, &private);
    let o = cf_verify(&m, &public);
    assert!(!o.status.success(), "accepted: {}", stdout(&o));
    assert!(
        stderr(&o).contains(
            "signed paths 'a/Weight.bin' and 'a/weight.bin' are the same on a case-insensitive file system"
        ),
        "{}",
        stderr(&o)
    );

    let build = synthetic_build(&w.join("build"), &[], 0);
    fs::write(
        build.join("chunk3.mlpackage/Data/com.apple.CoreML/Model.mlmodel"),
        "x",
    )
    .unwrap();
    let out = w.join("rel");
    let o = run(&package_args(&build, "four", &private, &out, &[]));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("chunk3.mlpackage/Data/com.apple.CoreML/Model.mlmodel")
            && e.contains("case-insensitive"),
        "{e}"
    );
    assert!(!out.exists());
}

/// Duplicate JSON keys (which a first-wins reader and serde_json's last-wins
/// read differently) are refused in manifest.json, in the bundle's DSSE
/// envelope and in the signed in-toto payload, even when validly signed.
#[test]
fn duplicate_json_keys_are_refused() {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let r = release("dupkeys");
    let key = chunkforge::sign::load_private_key(&r.private).unwrap();

    // manifest.json: a first-wins reader sees version 6.6.6.
    let d = r.work.join("manifest");
    copy_tree(&r.dir, &d);
    let text = fs::read_to_string(d.join("manifest.json")).unwrap();
    let forged = text.replacen(
        "\"version\": \"1.2.3\"",
        "\"version\": \"6.6.6\", \"version\": \"1.2.3\"",
        1,
    );
    assert_ne!(forged, text);
    fs::write(d.join("manifest.json"), forged).unwrap();
    ms_sign(&d, &r.private);
    let o = cf_verify(&d, &r.public);
    assert!(!o.status.success(), "accepted: {}", stdout(&o));
    assert!(
        stderr(&o).contains("duplicate key `version` in `release`"),
        "{}",
        stderr(&o)
    );

    // The envelope: a first-wins reader takes an empty payload.
    let d = r.work.join("envelope");
    copy_tree(&r.dir, &d);
    let text = fs::read_to_string(d.join("model.sig")).unwrap();
    let forged = text.replacen(
        "\"dsseEnvelope\": {",
        "\"dsseEnvelope\": {\"payload\": \"e30=\",",
        1,
    );
    assert_ne!(forged, text);
    fs::write(d.join("model.sig"), forged).unwrap();
    let o = cf_verify(&d, &r.public);
    assert!(!o.status.success(), "accepted: {}", stdout(&o));
    assert!(
        stderr(&o).contains("duplicate key `payload` in `dsseEnvelope`"),
        "{}",
        stderr(&o)
    );

    // The signed payload: a first-wins reader sees an empty resource list.
    let d = r.work.join("payload");
    copy_tree(&r.dir, &d);
    let bundle: Value = serde_json::from_slice(&fs::read(d.join("model.sig")).unwrap()).unwrap();
    let payload = String::from_utf8(
        b64.decode(bundle["dsseEnvelope"]["payload"].as_str().unwrap())
            .unwrap(),
    )
    .unwrap();
    let forged = payload.replacen("\"predicate\": {", "\"predicate\": {\"resources\": [],", 1);
    assert_ne!(forged, payload);
    fs::write(
        d.join("model.sig"),
        chunkforge::sign::sign_payload(&key, forged.as_bytes()),
    )
    .unwrap();
    let o = cf_verify(&d, &r.public);
    assert!(!o.status.success(), "accepted: {}", stdout(&o));
    assert!(
        stderr(&o).contains("duplicate key `resources` in `predicate`"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn verify_rejects_symlinks_naming_them() {
    let r = release("symlink");
    std::os::unix::fs::symlink("/etc/passwd", r.dir.join("swa/chunk1.mlpackage/passwd")).unwrap();
    let o = cf_verify(&r.dir, &r.public);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("swa/chunk1.mlpackage/passwd: is a symlink"),
        "{}",
        stderr(&o)
    );
    // A signed file replaced by a symlink to identical contents is still refused.
    let r = release("symlink2");
    let w = r.dir.join(WEIGHT);
    let copy = r.work.join("weight-copy.bin");
    fs::copy(&w, &copy).unwrap();
    fs::remove_file(&w).unwrap();
    std::os::unix::fs::symlink(&copy, &w).unwrap();
    let o = cf_verify(&r.dir, &r.public);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(&format!("{WEIGHT}: is a symlink")),
        "{}",
        stderr(&o)
    );
}

/// A manifest entry with `..` (or absolute) is refused even when the folder is
/// validly signed afterwards (re-signed here with model_signing).
#[test]
fn verify_rejects_unsafe_manifest_paths() {
    for bad in ["../outside.bin", "/etc/passwd", "chunk1.mlpackage/../../x"] {
        let r = release("dotdot");
        let mut m = manifest(&r.dir);
        m["files"][0]["path"] = json!(bad);
        fs::write(
            r.dir.join("manifest.json"),
            serde_json::to_vec_pretty(&m).unwrap(),
        )
        .unwrap();
        ms_sign(&r.dir, &r.private);
        let o = cf_verify(&r.dir, &r.public);
        assert!(!o.status.success(), "accepted manifest path {bad}");
        assert!(
            stderr(&o).contains(&format!("file entry '{bad}'")),
            "{bad}: {}",
            stderr(&o)
        );
    }
}

/// A weight blob the app's downloader links or copies into another package
/// (the manifest's `shares`) must be there with the digest the package was
/// built with, even in a folder whose manifest and signature are otherwise
/// consistent (re-signed here): each problem names both blobs.
#[test]
fn verify_checks_the_blobs_the_app_shares_naming_both_files() {
    let prefill = format!("prefill/chunk1.mlpackage/{BLOB}");
    let chunk1 = format!("swa/chunk1.mlpackage/{BLOB}");
    // The pair made to differ: chunk1's blob changed, listed and re-signed.
    let r = release("share-differs");
    assert!(
        !r.dir.join(&prefill).exists(),
        "prefill_chunk1's blob is stored once"
    );
    let p = r.dir.join(&chunk1);
    let mut b = fs::read(&p).unwrap();
    b[100] ^= 1;
    fs::write(&p, &b).unwrap();
    let mut m = manifest(&r.dir);
    for f in m["files"].as_array_mut().unwrap() {
        if f["path"] == json!(chunk1) {
            f["sha256"] = json!(format!("{:x}", Sha256::digest(&b)));
        }
    }
    fs::write(
        r.dir.join("manifest.json"),
        serde_json::to_vec_pretty(&m).unwrap(),
    )
    .unwrap();
    ms_sign(&r.dir, &r.private);
    let o = cf_verify(&r.dir, &r.public);
    let e = stderr(&o);
    assert!(!o.status.success(), "{e}");
    assert!(
        e.contains(&format!("{prefill} <- {chunk1}")) && e.contains("main: link, branch: copy"),
        "{e}"
    );
    // The source removed from the folder and the manifest, re-signed.
    let r = release("share-missing");
    fs::remove_file(r.dir.join(&chunk1)).unwrap();
    let mut m = manifest(&r.dir);
    m["files"]
        .as_array_mut()
        .unwrap()
        .retain(|f| f["path"] != json!(chunk1));
    fs::write(
        r.dir.join("manifest.json"),
        serde_json::to_vec_pretty(&m).unwrap(),
    )
    .unwrap();
    ms_sign(&r.dir, &r.private);
    let o = cf_verify(&r.dir, &r.public);
    let e = stderr(&o);
    assert!(!o.status.success(), "{e}");
    assert!(
        e.contains(&format!("{prefill} <- {chunk1}")) && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn verify_archive_digest_and_escaping_entries() {
    let r = release("zip");
    let sha = fs::read_to_string(format!("{}.sha256", r.zip.display())).unwrap();
    let digest = format!("{:x}", Sha256::digest(fs::read(&r.zip).unwrap()));
    assert_eq!(sha, format!("{digest}  rel.zip\n"));

    // Weights are stored, and the archive holds exactly the release's files.
    let mut ar = zip::ZipArchive::new(fs::File::open(&r.zip).unwrap()).unwrap();
    assert_eq!(
        ar.by_name(WEIGHT).unwrap().compression(),
        zip::CompressionMethod::Stored
    );
    let names: Vec<String> = (0..ar.len())
        .map(|i| ar.by_index(i).unwrap().name().to_string())
        .collect();
    assert!(
        names.contains(&"model.sig".to_string()) && names.contains(&"manifest.json".to_string())
    );

    // Rewrite the archive with one extra entry that escapes the target folder.
    let evil = r.work.join("evil.zip");
    {
        let mut w = zip::ZipWriter::new(fs::File::create(&evil).unwrap());
        for i in 0..ar.len() {
            w.raw_copy_file(ar.by_index(i).unwrap()).unwrap();
        }
        w.start_file("../evil.sh", zip::write::SimpleFileOptions::default())
            .unwrap();
        std::io::Write::write_all(&mut w, b"#!/bin/sh\n").unwrap();
        w.finish().unwrap();
    }
    let d = format!("{:x}", Sha256::digest(fs::read(&evil).unwrap()));
    fs::write(
        format!("{}.sha256", evil.display()),
        format!("{d}  evil.zip\n"),
    )
    .unwrap();
    let o = run(&[
        "verify",
        s(&r.dir),
        "--public-key",
        s(&r.public),
        "--archive",
        s(&evil),
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("entry '../evil.sh' would escape the target folder"),
        "{}",
        stderr(&o)
    );

    // A changed archive no longer matches its digest file.
    let mut b = fs::read(&r.zip).unwrap();
    let n = b.len();
    b[n / 2] ^= 0xff;
    fs::write(&r.zip, b).unwrap();
    let o = run(&[
        "verify",
        s(&r.dir),
        "--public-key",
        s(&r.public),
        "--archive",
        s(&r.zip),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("rel.zip: SHA-256 is"), "{}", stderr(&o));
}

/// Writes `bytes` beside the release as `name` with a right `.sha256` and
/// runs `verify --archive` on it, which must fail saying `NAME: want`.
fn verify_archive_refuses(r: &Release, name: &str, bytes: &[u8], want: &str) {
    let z = r.work.join(name);
    fs::write(&z, bytes).unwrap();
    let d = format!("{:x}", Sha256::digest(bytes));
    fs::write(format!("{}.sha256", z.display()), format!("{d}  {name}\n")).unwrap();
    let o = verify_with_archive(r, &z);
    assert!(!o.status.success(), "verify accepted {name}");
    assert!(
        stderr(&o).contains(&format!("{name}: {want}")),
        "{}",
        stderr(&o)
    );
}

/// `verify` of the release with `--archive zip`.
fn verify_with_archive(r: &Release, zip: &Path) -> Output {
    let args = ["verify", s(&r.dir), "--public-key", s(&r.public)];
    run(&[&args[..], &["--archive", s(zip)]].concat())
}

/// The release's zip rewritten: `first` entries, every entry of the real
/// archive copied as is, then `last` entries (a trailing `/` makes a folder).
fn rezip(r: &Release, first: &[(&str, &[u8])], last: &[(&str, &[u8])]) -> Vec<u8> {
    let mut ar = zip::ZipArchive::new(fs::File::open(&r.zip).unwrap()).unwrap();
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let add = |w: &mut zip::ZipWriter<_>, (name, data): &(&str, &[u8])| {
        let o = zip::write::SimpleFileOptions::default();
        match name.strip_suffix('/') {
            Some(dir) => w.add_directory(dir, o).unwrap(),
            None => {
                w.start_file(*name, o).unwrap();
                std::io::Write::write_all(w, data).unwrap();
            }
        }
    };
    first.iter().for_each(|e| add(&mut w, e));
    for i in 0..ar.len() {
        w.raw_copy_file(ar.by_index(i).unwrap()).unwrap();
    }
    last.iter().for_each(|e| add(&mut w, e));
    w.finish().unwrap().into_inner()
}

/// Rewrites the release's archive as `package --zip` wrote archives before
/// every entry was stored: text entries deflated (verify still reads them).
fn deflate_text_entries(r: &Release) {
    let mut ar = zip::ZipArchive::new(fs::File::open(&r.zip).unwrap()).unwrap();
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    for i in 0..ar.len() {
        let mut f = ar.by_index(i).unwrap();
        let name = f.name().to_string();
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut f, &mut data).unwrap();
        let method = if name.ends_with(".bin") {
            zip::CompressionMethod::Stored
        } else {
            zip::CompressionMethod::Deflated
        };
        let o = zip::write::SimpleFileOptions::default().compression_method(method);
        w.start_file(name, o).unwrap();
        std::io::Write::write_all(&mut w, &data).unwrap();
    }
    fs::write(&r.zip, w.finish().unwrap().into_inner()).unwrap();
}

/// Replaces every occurrence of `from` in `b` by `to` (same length).
fn patch_all(b: &mut [u8], from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let mut i = 0;
    while i + from.len() <= b.len() {
        if &b[i..i + from.len()] == from {
            b[i..i + from.len()].copy_from_slice(to);
        }
        i += 1;
    }
}

/// (local header offset, central record offset) of the real archive's `name`.
fn headers_of(r: &Release, name: &str) -> (usize, usize) {
    let mut ar = zip::ZipArchive::new(fs::File::open(&r.zip).unwrap()).unwrap();
    let f = ar.by_name(name).unwrap();
    (f.header_start() as usize, f.central_header_start() as usize)
}

/// A reader that keeps the last entry of a name let an evil *first*
/// `manifest.json` through; an extractor that keeps the first writes it.
#[test]
fn verify_archive_refuses_two_entries_of_one_name() {
    let r = release("zip-dup");
    // The writer refuses a duplicate name, so write a stand-in and rename it.
    let mut b = rezip(&r, &[("manifest.jsoX", b"{\"evil\": true}")], &[]);
    patch_all(&mut b, b"manifest.jsoX", b"manifest.json");
    verify_archive_refuses(
        &r,
        "dup.zip",
        &b,
        "entry 'manifest.json' appears more than once",
    );
}

/// The central directory says `manifest.json`, the local header (what a
/// streaming extractor writes) says `../../evil.js`.
#[test]
fn verify_archive_refuses_local_headers_that_disagree() {
    let r = release("zip-local");
    let mut b = fs::read(&r.zip).unwrap();
    let (local, _) = headers_of(&r, "manifest.json");
    b[local + 30..local + 43].copy_from_slice(b"../../evil.js");
    verify_archive_refuses(
        &r,
        "local.zip",
        &b,
        "entry 'manifest.json': its local header names '../../evil.js'",
    );
}

/// A local entry the central directory never mentions, slipped in before the
/// central directory (whose offset is moved along, so central-directory
/// readers see the release unchanged); a streaming extractor would write it.
#[test]
fn verify_archive_refuses_local_entries_outside_the_directory() {
    let r = release("zip-hidden");
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    w.start_file("evil.sh", zip::write::SimpleFileOptions::default())
        .unwrap();
    std::io::Write::write_all(&mut w, b"#!/bin/sh\n").unwrap();
    let one = w.finish().unwrap().into_inner();
    let cd_of = |b: &[u8]| u32::from_le_bytes(b[b.len() - 6..b.len() - 2].try_into().unwrap());
    let stowaway = &one[..cd_of(&one) as usize];

    let real = fs::read(&r.zip).unwrap();
    let cd = cd_of(&real) as usize;
    let mut b = [&real[..cd], stowaway, &real[cd..]].concat();
    let n = b.len();
    let moved = (cd + stowaway.len()) as u32;
    b[n - 6..n - 2].copy_from_slice(&moved.to_le_bytes());
    let want = format!(
        "{} bytes between the last entry (ends at {cd}) and the central directory are not part of any entry",
        stowaway.len()
    );
    verify_archive_refuses(&r, "hidden.zip", &b, &want);
}

/// Folder entries, one of them named like a release file, were skipped.
#[test]
fn verify_archive_refuses_directory_entries() {
    let r = release("zip-dirs");
    for dir in ["manifest.json/", "chunk1.mlpackage/"] {
        let b = rezip(&r, &[], &[(dir, b"")]);
        verify_archive_refuses(
            &r,
            "dirs.zip",
            &b,
            &format!("entry '{dir}' is a directory entry"),
        );
    }
}

/// Declared sizes that are false (in both headers, so they agree), one
/// smaller and one larger than the data.
#[test]
fn verify_archive_refuses_false_declared_sizes() {
    let r = release("zip-sizes");
    deflate_text_entries(&r);
    let real = fs::read(&r.zip).unwrap();
    let (local, central) = headers_of(&r, "manifest.json");
    let size = u32::from_le_bytes(real[local + 22..local + 26].try_into().unwrap());
    for (declared, want) in [(size + 100, "holds"), (size / 2, "inflates to more than")] {
        let mut b = real.clone();
        b[local + 22..local + 26].copy_from_slice(&declared.to_le_bytes());
        b[central + 24..central + 28].copy_from_slice(&declared.to_le_bytes());
        verify_archive_refuses(
            &r,
            "sizes.zip",
            &b,
            &format!("entry 'manifest.json': {want}"),
        );
    }
}

/// `--zip` replaces only a previous archive of a release (and its digest
/// file), wherever the path points and however it is spelled; refused
/// before anything is written, so the previous release stays.
#[test]
fn package_zip_replaces_only_a_previous_archive() {
    let r = release("zip-out");
    let build = r.work.join("build");
    let package = |out: &Path, zip: &Path| {
        let args = [
            "package",
            s(&build),
            "--layout",
            "two",
            "--key",
            s(&r.private),
        ];
        let mut args = args.to_vec();
        args.extend(["--output", s(out), "--version", "2", "--zip", s(zip)]);
        run(&args)
    };
    // The archive's and its digest file's bytes (None: absent).
    let snapshot = |zip: &Path| {
        let digest = PathBuf::from(format!("{}.sha256", zip.display()));
        (fs::read(zip).ok(), fs::read(digest).ok())
    };
    let refused = |zip: &Path, want: &str| {
        let before = snapshot(zip);
        let o = package(&r.dir, zip);
        assert!(!o.status.success(), "--zip {zip:?} accepted");
        assert!(stderr(&o).contains(want), "--zip {zip:?}: {}", stderr(&o));
        assert!(before == snapshot(zip), "--zip {zip:?} changed");
        assert!(cf_verify(&r.dir, &r.public).status.success());
        assert_eq!(manifest(&r.dir)["release"]["version"], json!("1.2.3"));
    };
    refused(&r.private, "exists and is not a release archive");
    refused(
        &build.join("build.json"),
        "exists and is not a release archive",
    );
    refused(&build, "exists and is not a file");
    refused(
        &build.join("merged_chunk1.mlpackage/rel.zip"),
        "--zip must not be inside a package of the build folder",
    );
    assert!(!build.join("merged_chunk1.mlpackage/rel.zip").exists());
    let link = r.work.join("link.zip");
    std::os::unix::fs::symlink(&r.zip, &link).unwrap();
    refused(&link, "is a symlink");
    // A zip that is a release archive but whose digest file is something else.
    let notes = r.work.join("notes.zip");
    fs::copy(&r.zip, &notes).unwrap();
    fs::write(r.work.join("notes.zip.sha256"), "my notes\n").unwrap();
    refused(&notes, "exists and is not an archive digest file");
    // Inside the release folder, spelled so no string prefix matches.
    let spelled = r.work.join("build/../rel/new.zip");
    refused(&spelled, "--zip must not be inside the release folder");
    let absolute = r.dir.canonicalize().unwrap().join("x.zip");
    let o = package(&r.work.join("build/../rel"), &absolute);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("inside the release folder"),
        "{}",
        stderr(&o)
    );
    assert!(!r.dir.join("x.zip").exists() && !r.dir.join("new.zip").exists());

    // The previous archive itself is replaced.
    let o = package(&r.dir, &r.zip);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = verify_with_archive(&r, &r.zip);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(manifest(&r.dir)["release"]["version"], json!("2"));
}

#[test]
fn same_key_same_inputs_same_release_bytes() {
    let w = tempdir("determinism");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let (private, _) = keys(&w, "k");
    let mut sigs = Vec::new();
    for i in 0..2 {
        let out = w.join(format!("{i}/rel"));
        let zip = w.join(format!("{i}/rel.zip"));
        ok(&[
            "package",
            s(&build),
            "--layout",
            "one",
            "--allow-over-ceiling",
            "--key",
            s(&private),
            "--output",
            s(&out),
            "--zip",
            s(&zip),
        ]);
        sigs.push((
            fs::read(out.join("model.sig")).unwrap(),
            fs::read(&zip).unwrap(),
        ));
    }
    assert!(
        sigs[0].0 == sigs[1].0,
        "model.sig differs between identical runs"
    );
    assert!(sigs[0].1 == sigs[1].1, "zip differs between identical runs");
}

#[test]
fn layouts_ship_the_right_packages() {
    let w = tempdir("layouts");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let (private, public) = keys(&w, "k");
    // Every layout ships chunk1..4 (decode fallback, verify_qK) and the
    // build's prefill_chunk1..4.
    const PREFILL: [&str; 4] = [
        "prefill_chunk1",
        "prefill_chunk2",
        "prefill_chunk3",
        "prefill_chunk4",
    ];
    const FOUR: [&str; 4] = ["chunk1", "chunk2", "chunk3", "chunk4"];
    let with = |first: &[&'static str]| -> Vec<&'static str> {
        let mut v = first.to_vec();
        if !v.contains(&"chunk1") {
            v.extend(FOUR);
        }
        v.extend(PREFILL);
        v
    };
    let expect: [(&str, Vec<&str>); 5] = [
        ("four", with(&FOUR)),
        // The three-chunk decode runs chunk1 itself: no chunk1_3way.
        ("three", with(&["chunk2_3way", "chunk3_3way"])),
        ("two", with(&["merged_chunk1", "merged_chunk2"])),
        ("one", with(&["merged_full"])),
        (
            "all",
            with(&[
                "chunk1",
                "chunk2",
                "chunk3",
                "chunk4",
                "chunk2_3way",
                "chunk3_3way",
                "merged_chunk1",
                "merged_chunk2",
                "merged_full",
            ]),
        ),
    ];
    let build_json: Value =
        serde_json::from_slice(&fs::read(build.join("build.json")).unwrap()).unwrap();
    for (layout, names) in expect {
        let out = w.join(format!("rel-{layout}"));
        let mut args = vec![
            "package",
            s(&build),
            "--layout",
            layout,
            "--key",
            s(&private),
            "--output",
            s(&out),
        ];
        // merged_full (35 layers) is what the branch runtime would pick.
        if names.contains(&"merged_full") {
            let e = fails(&args);
            assert!(
                e.contains("merged_full (35 layers)")
                    && e.contains("fix/2chunk-kv-prefill-transfer")
                    && e.contains("--allow-over-ceiling"),
                "{e}"
            );
            assert!(!out.exists());
            args.push("--allow-over-ceiling");
        }
        ok(&args);
        let m = manifest(&out);
        let got: Vec<&str> = m["chunks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(got, names, "layout {layout}");
        // The release is the app's repository: packages at their remote
        // paths, the RoPE tables under swa/, merged packages at the root.
        let mut entries: Vec<String> = Vec::new();
        for top in fs::read_dir(&out).unwrap() {
            let top = top.unwrap().file_name().to_string_lossy().into_owned();
            if top == "swa" || top == "prefill" {
                for e in fs::read_dir(out.join(&top)).unwrap() {
                    entries.push(format!(
                        "{top}/{}",
                        e.unwrap().file_name().to_string_lossy()
                    ));
                }
            } else {
                entries.push(top);
            }
        }
        entries.sort();
        let mut want: Vec<String> = names.iter().map(|n| repo_path(n)).collect();
        want.extend([
            "manifest.json".into(),
            "model.sig".into(),
            "DEVICE_RUNBOOK.md".into(),
        ]);
        // The runtime's side files and hf_model/ ship with every layout.
        want.extend(SIDE_FILES.iter().map(|f| f.to_string()));
        want.push("hf_model".into());
        want.sort();
        assert_eq!(entries, want, "layout {layout}");
        for n in &names {
            assert_eq!(
                m["chunks"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|c| c["name"] == *n)
                    .unwrap()["file"],
                json!(repo_path(n)),
                "layout {layout}"
            );
        }
        // A weight blob the app links or copies in is stored once: the
        // legacy entries fetch every prefill package without weights/; the
        // 3-way entry fetches prefill_chunk2/3 whole and links
        // prefill_chunk1 <- chunk1, prefill_chunk4 <- chunk3_3way.
        let whole: &[&str] = if names.contains(&"chunk2_3way") {
            &["prefill_chunk2", "prefill_chunk3"]
        } else {
            &[]
        };
        for n in PREFILL {
            assert_eq!(
                out.join(repo_path(n)).join(BLOB).exists(),
                whole.contains(&n),
                "layout {layout}: {n}"
            );
        }
        let shares: Vec<(String, String, bool)> = m["shares"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["package"].as_str().unwrap().to_string(),
                    s["from"].as_str().unwrap().to_string(),
                    s["stored"].as_bool().unwrap(),
                )
            })
            .collect();
        let mut want_shares: Vec<(String, String, bool)> = (1..=4)
            .map(|i| {
                (
                    format!("prefill_chunk{i}"),
                    format!("chunk{i}"),
                    whole.contains(&format!("prefill_chunk{i}").as_str()),
                )
            })
            .collect();
        if !whole.is_empty() {
            want_shares.push(("prefill_chunk4".into(), "chunk3_3way".into(), false));
        }
        assert_eq!(shares, want_shares, "layout {layout}");
        // The KV slot map is copied from the build's plan, never recomputed.
        for l in m["decode_layouts"].as_array().unwrap() {
            let from_plan = build_json["plan"]["layouts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["kind"] == l["kind"])
                .unwrap();
            assert_eq!(l["kv_slot_map"], from_plan["kv_slot_map"]);
        }
        if layout == "two" {
            let roles: BTreeMap<&str, Value> = m["chunks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| (c["name"].as_str().unwrap(), c["roles"].clone()))
                .collect();
            assert_eq!(roles["merged_chunk1"], json!(["decode"]));
            assert_eq!(roles["chunk1"], json!(["decode", "verify"]));
            assert_eq!(roles["prefill_chunk1"], json!(["prefill"]));
            assert_eq!(m["prefill"]["layout"], "prefill");
            assert_eq!(
                m["decode_layouts"][0]["kv_slot_map"]
                    .as_array()
                    .unwrap()
                    .len(),
                15,
                "12 sliding + 3 full slots"
            );
        }
        assert!(cf_verify(&out, &public).status.success());
    }
}

/// Without --layout, a release ships every layout no runtime would pick over
/// the Neural Engine layer ceiling: all but the one-chunk layout.
#[test]
fn the_default_layouts_are_the_ones_within_the_ane_ceiling() {
    let w = tempdir("layout-app");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let (private, public) = keys(&w, "k");
    let out = w.join("rel");
    ok(&[
        "package",
        s(&build),
        "--key",
        s(&private),
        "--output",
        s(&out),
    ]);
    let m = manifest(&out);
    let kinds: Vec<&str> = m["decode_layouts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["four", "three", "two"]);
    assert!(!out.join("merged_full.mlpackage").exists());
    assert!(out.join("merged_chunk2.mlpackage").is_dir());
    assert!(cf_verify(&out, &public).status.success());
}

/// DEVICE_RUNBOOK.md: written by `package`, listed in the manifest (role
/// docs), signed like every other file, the same bytes for the same build,
/// and about the layouts the release holds.
#[test]
fn package_writes_a_signed_device_runbook_of_its_layouts() {
    let w = tempdir("runbook");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let (private, public) = keys(&w, "k");
    let package = |layout: &str, out: &Path| {
        ok(&[
            "package",
            s(&build),
            "--layout",
            layout,
            "--allow-over-ceiling",
            "--key",
            s(&private),
            "--output",
            s(out),
            "--version",
            "2.0.0",
        ]);
        fs::read_to_string(out.join("DEVICE_RUNBOOK.md")).expect("package writes DEVICE_RUNBOOK.md")
    };
    let two = w.join("rel-two");
    let text = package("two", &two);
    let m = manifest(&two);
    let entry = m["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "DEVICE_RUNBOOK.md")
        .expect("the manifest lists DEVICE_RUNBOOK.md");
    assert_eq!(entry["roles"], json!(["docs"]));
    assert_eq!(entry["size"], json!(text.len()));
    assert_eq!(
        entry["sha256"],
        json!(format!("{:x}", Sha256::digest(text.as_bytes())))
    );
    // The layouts of a two-chunk release: the control and two-chunk, no other.
    assert!(text.contains("### four-chunk (control)"), "{text}");
    assert!(text.contains("### two-chunk"), "{text}");
    assert!(!text.contains("### one-chunk") && !text.contains("### three-chunk"));
    assert!(text.contains("[Load] Decode layout: two-chunk"));
    assert!(text.contains("two=two-1.log two=two-2.log two=two-3.log"));
    assert!(text.contains("| two-chunk | 36 | 40 |"));
    assert!(text.contains("# Device run book: e2b 2.0.0"), "{text}");
    // Signed: it verifies, and a changed byte is named.
    assert!(cf_verify(&two, &public).status.success());
    let o = ms_verify(&two, &public);
    assert!(o.status.success(), "model_signing: {}", stderr(&o));
    fs::write(two.join("DEVICE_RUNBOOK.md"), text.replacen("36", "30", 1)).unwrap();
    let o = cf_verify(&two, &public);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("DEVICE_RUNBOOK.md: changed"),
        "{}",
        stderr(&o)
    );
    // The same build and options give the same bytes.
    assert_eq!(package("two", &w.join("rel-two-again")), text);
    // A release of every layout names them all, with the files to move aside.
    let all = package("all", &w.join("rel-all"));
    for l in ["four-chunk", "three-chunk", "two-chunk", "one-chunk"] {
        assert!(all.contains(&format!("### {l}")), "{l}: {all}");
    }
    assert!(all.contains(
        "mv \"$MODEL_DIR/chunk2_3way.mlpackage\" \"$MODEL_DIR/chunk3_3way.mlpackage\" \"$STASH/\""
    ));
    assert!(all.contains("`merged_full` (35)"));
}

#[test]
fn package_errors_name_the_problem() {
    let w = tempdir("errors");
    let build = synthetic_build(&w.join("build"), &["merged_full"], 0);
    let (private, public) = keys(&w, "k");
    let out = w.join("rel");
    let e = fails(&[
        "package",
        s(&build),
        "--layout",
        "one",
        "--allow-over-ceiling",
        "--key",
        s(&private),
        "--output",
        s(&out),
    ]);
    assert!(
        e.contains("merged_full.mlpackage") && e.contains("missing"),
        "{e}"
    );
    assert!(!out.exists());

    let e = fails(&[
        "package",
        s(&build),
        "--layout",
        "two",
        "--key",
        s(&public),
        "--output",
        s(&out),
    ]);
    assert!(e.contains("k.pub") && e.contains("private key"), "{e}");

    let report = w.join("parity.json");
    fs::write(&report, r#"{"steps": []}"#).unwrap();
    let e = fails(&[
        "package",
        s(&build),
        "--layout",
        "two",
        "--key",
        s(&private),
        "--output",
        s(&out),
        "--parity-report",
        s(&report),
    ]);
    assert!(e.contains("parity.json") && e.contains("summary"), "{e}");

    // A report must be about the build's checkpoint (the synthetic build's
    // config digest is SHA-256 of "config").
    fs::write(
        &report,
        parity_report(
            true,
            json!({"ok": true, "line": "PARITY OK across 16 steps (cos >= 0.9999)."}),
        )
        .to_string(),
    )
    .unwrap();
    ok(&[
        "package",
        s(&build),
        "--layout",
        "two",
        "--key",
        s(&private),
        "--output",
        s(&out),
        "--parity-report",
        s(&report),
        "--base-url",
        "https://cdn.example.com/e2b/1/",
    ]);
    let m = manifest(&out);
    assert_eq!(
        m["parity"]["line"],
        json!("PARITY OK across 16 steps (cos >= 0.9999).")
    );
    let f0 = &m["files"][0];
    assert_eq!(
        f0["url"],
        json!(format!(
            "https://cdn.example.com/e2b/1/{}",
            f0["path"].as_str().unwrap()
        ))
    );

    // A package edited after the build no longer matches build.json's sha256_tree.
    fs::write(build.join("chunk2.mlpackage/Manifest.json"), "{}").unwrap();
    let e = fails(&[
        "package",
        s(&build),
        "--layout",
        "two",
        "--key",
        s(&private),
        "--output",
        s(&out),
    ]);
    assert!(
        e.contains("chunk2.mlpackage") && e.contains("sha256_tree"),
        "{e}"
    );
    // ...and the previous release is untouched.
    assert!(cf_verify(&out, &public).status.success());

    // Never replaces a folder that is not a release.
    let notrel = w.join("home");
    fs::create_dir_all(&notrel).unwrap();
    fs::write(notrel.join("precious.txt"), "x").unwrap();
    let e = fails(&[
        "package",
        s(&build),
        "--layout",
        "four",
        "--key",
        s(&private),
        "--output",
        s(&notrel),
    ]);
    assert!(e.contains("not a previous release"), "{e}");
    assert!(notrel.join("precious.txt").exists());

    // Nor stages inside a package it is about to copy.
    fs::write(
        build.join("chunk2.mlpackage/Manifest.json"),
        "{\"name\": \"chunk2\"}\n",
    )
    .unwrap();
    let inside = build.join("chunk1.mlpackage/rel");
    let e = fails(&[
        "package",
        s(&build),
        "--layout",
        "four",
        "--key",
        s(&private),
        "--output",
        s(&inside),
    ]);
    assert!(e.contains("inside a package"), "{e}");
    assert!(
        !build.join("chunk1.mlpackage").read_dir().unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(".chunkforge"))
    );
}

/// `package` ships a build only when its audit has no errors in the
/// packages it ships, or with `--allow-audit-findings`; warnings (a padded
/// last axis: speed, not a working package) are reported and shipped. A
/// build.json without an audit record (an older build), or with one of an
/// older format or op-type table, has its packages audited by `package`.
#[test]
fn package_refuses_audit_errors_and_reports_warnings_in_the_packages_it_ships() {
    let w = tempdir("audit-gate");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let (private, _) = keys(&w, "k");
    let out = w.join("rel");
    let build_json = build.join("build.json");
    let mut b = common::json_file(&build_json);
    b["audit"]["packages"]["merged_chunk1.mlpackage"] =
        json!({"op-type": 3, "fp32": 1, "last-axis-1": 5});
    b["audit"]["packages"]["merged_full.mlpackage"] = json!({"rank": 2});
    b["audit"]["packages"]["chunk1.mlpackage"] = json!({"last-axis-1": 2});
    b["audit"]["total"] = json!(13);
    b["audit"]["errors"] = json!(6);
    b["audit"]["warnings"] = json!(7);
    b["audit"]["by_rule"] = json!({"fp32": 1, "last-axis-1": 7, "op-type": 3, "rank": 2});
    fs::write(&build_json, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
    let o = run(&package_args(&build, "two", &private, &out, &[]));
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains(&format!(
            "{}: the audit found 4 errors in the packages this release ships (fp32 1, op-type 3; in merged_chunk1.mlpackage)",
            build_json.display()
        )) && e.contains("--allow-audit-findings"),
        "{e}"
    );
    assert!(!out.exists());
    // merged_full's findings count only where it ships.
    let e = fails(&package_args(&build, "one", &private, &out, &[]));
    assert!(e.contains("(rank 2; in merged_full.mlpackage)"), "{e}");
    // Warnings alone ship, said so.
    let o = run(&package_args(&build, "four", &private, &out, &[]));
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(
        e.contains("the packages this release ships have 2 audit warnings (last-axis-1 2)")
            && e.contains("; audit warnings: last-axis-1 2"),
        "{e}"
    );
    let o = run(&package_args(
        &build,
        "two",
        &private,
        &out,
        &["--allow-audit-findings"],
    ));
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(
        e.contains("shipping packages with 4 audit errors (fp32 1, op-type 3)")
            && e.contains(
                "with audit errors (fp32 1, op-type 3, --allow-audit-findings); audit warnings: last-axis-1 7"
            ),
        "{e}"
    );

    // No audit record: package audits the packages itself. The synthetic
    // stand-ins are not programs...
    // A record of the previous format (no severities) is stale: audited again.
    b["audit"]["format"] = json!("chunkforge-audit/1");
    fs::write(&build_json, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
    let e = fails(&package_args(&build, "two", &private, &out, &[]));
    assert!(
        e.contains("its audit record is of an older format (no errors and warnings told apart), and auditing its packages failed"),
        "{e}"
    );
    // A record made against another op-type table is stale too.
    b["audit"]["format"] = json!(chunkforge::records::AUDIT_FORMAT);
    b["audit"]["op_table_sha256"] = json!("0".repeat(64));
    fs::write(&build_json, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
    let e = fails(&package_args(&build, "two", &private, &out, &[]));
    assert!(
        e.contains("its audit record was made against another op-type table, and auditing its packages failed"),
        "{e}"
    );
    b.as_object_mut().unwrap().remove("audit");
    fs::write(&build_json, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
    let e = fails(&package_args(&build, "two", &private, &out, &[]));
    assert!(
        e.contains(
            "no audit record (built before `chunkforge audit`), and auditing its packages failed"
        ) && e.contains("not a readable .mlpackage"),
        "{e}"
    );
    // ...real (non-ANE) ones are audited, and refused on what is found.
    let bad = common::non_ane_package(&w.join("non_ane.mlpackage"));
    for c in b["chunks"].as_array_mut().unwrap() {
        let pkg = build.join(c["package"].as_str().unwrap());
        fs::remove_dir_all(&pkg).unwrap();
        copy_tree(&bad, &pkg);
        c["sha256_tree"] = json!(tree_digest(&pkg));
    }
    fs::write(&build_json, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
    let o = run(&package_args(&build, "two", &private, &out, &[]));
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains(
            "no audit record (built before `chunkforge audit`); audited its packages now: audit: "
        ) && e.contains("errors in the packages this release ships (dynamic-shape")
            && e.contains("fp32"),
        "{e}"
    );
    // Its padded last axis is a warning: not among the errors that refuse.
    let refusal = e
        .lines()
        .find(|l| l.contains("this release ships ("))
        .unwrap();
    assert!(!refusal.contains("last-axis-1"), "{refusal}");
    ok(&package_args(
        &build,
        "two",
        &private,
        &out,
        &["--allow-audit-findings"],
    ));
    // build.json is not rewritten.
    assert!(common::json_file(&build_json).get("audit").is_none());
}

/// `package BUILD --layout LAYOUT --key KEY --output OUT` plus `extra`.
fn package_args<'a>(
    build: &'a Path,
    layout: &'a str,
    key: &'a Path,
    out: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        "package",
        s(build),
        "--layout",
        layout,
        "--key",
        s(key),
        "--output",
        s(out),
    ];
    // These releases ship merged_full on purpose (every package of the build).
    if matches!(layout, "all" | "one") {
        args.push("--allow-over-ceiling");
    }
    args.extend(extra);
    args
}

/// A parity report for the synthetic build's checkpoint with one step whose
/// `ok` is `step_ok`, and the given summary.
fn parity_report(step_ok: bool, summary: Value) -> Value {
    json!({
        "format": "chunkforge-parity/1",
        "checkpoint": {"dir": s(&checkpoint_dir()), "config_sha256": config_sha256(),
                       "weights": weights_of(&checkpoint_dir())},
        "prompt_ids": [2],
        "steps": [{"layout": "two", "step": 0, "cos": 1.0, "ref_token": 5, "token": if step_ok { 5 } else { 6 }, "margin": 1.0, "ok": step_ok}],
        "oracle": [], "artifacts": [],
        "summary": summary,
        "tool": {"chunkforge": "0.1.0", "python": {}},
    })
}

/// `package --parity-report` refuses a failed report, a report about another
/// checkpoint and one whose summary contradicts its steps; an explicit flag
/// embeds a failed one, as failed.
#[test]
fn package_refuses_failed_and_foreign_parity_reports() {
    let w = tempdir("parity-reports");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let (private, public) = keys(&w, "k");
    let out = w.join("rel");
    let report = w.join("parity.json");
    let package = |extra: &[&str]| {
        let mut args = vec!["--parity-report", s(&report)];
        args.extend(extra);
        run(&package_args(&build, "two", &private, &out, &args))
    };
    let failed = json!({"ok": false, "steps": 1, "tol_cos": 0.9999, "layouts": ["two"]});
    let cases = [
        (
            parity_report(false, failed.clone()),
            "parity FAILED (summary.ok is false, first: steps[0] (layout two, step 0))",
        ),
        (
            {
                let mut r = parity_report(true, json!({"ok": true}));
                r["checkpoint"]["config_sha256"] = json!(format!("{:x}", Sha256::digest(b"other")));
                r
            },
            "is about another checkpoint: its config.json digest is",
        ),
        (
            parity_report(false, json!({"ok": true})),
            "summary.ok is true but steps[0] (layout two, step 0) failed",
        ),
        (
            parity_report(true, json!({"ok": "yes"})),
            "summary.ok is \"yes\", expected true or false",
        ),
    ];
    for (r, fragment) in cases {
        fs::write(&report, r.to_string()).unwrap();
        let o = package(&[]);
        assert_eq!(o.status.code(), Some(2), "{fragment}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("parity.json") && stderr(&o).contains(fragment),
            "{fragment}: {}",
            stderr(&o)
        );
        assert!(!out.exists());
    }
    // Embedded only on request, and then as failed.
    fs::write(&report, parity_report(false, failed).to_string()).unwrap();
    let o = package(&["--allow-failed-parity"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("parity FAILED"), "{}", stderr(&o));
    assert_eq!(manifest(&out)["parity"]["ok"], json!(false));
    assert!(cf_verify(&out, &public).status.success());
}

/// A parity report made on a checkpoint with the same config.json but other
/// weights (another seed) is refused by `package`, naming the report and the
/// file that differs (only config_sha256 was compared, and
/// `"parity": {"ok": true}` was signed into the manifest); a report made on
/// the build's own checkpoint is accepted. The report identifies its weights
/// and records its folder absolute, as the schema says.
#[test]
fn package_refuses_a_parity_report_about_other_weights() {
    let w = tempdir("parity-weights");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let (private, _) = keys(&w, "k");
    let seed7 = common::fixture("e2b-seed7", &["--seed", "7"]);
    let ours = checkpoint_dir();
    assert_eq!(
        fs::read(seed7.join("config.json")).unwrap(),
        fs::read(ours.join("config.json")).unwrap(),
        "the other seed must have the same config.json"
    );
    let parity = |dir: &Path, report: &Path| {
        // A relative --hf-dir: the report records it absolute.
        let o = Command::new(common::bin())
            .current_dir(dir.parent().unwrap())
            .args(["parity", "--hf-dir"])
            .arg(dir.file_name().unwrap())
            .args([
                "--mode",
                "two",
                "--steps",
                "2",
                "--no-oracle",
                "--report",
                s(report),
            ])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_slice(&fs::read(report).unwrap()).unwrap();
        assert_eq!(
            v["checkpoint"]["dir"],
            json!(s(&std::path::absolute(dir).unwrap()))
        );
        assert_eq!(v["checkpoint"]["weights"], weights_of(dir));
        let o = validate_with("parity/report.schema.json", report);
        assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    };
    let (theirs, good) = (w.join("seed7.json"), w.join("seed0.json"));
    parity(&seed7, &theirs);
    parity(&ours, &good);
    let out = w.join("rel");
    let o = run(&package_args(
        &build,
        "two",
        &private,
        &out,
        &["--parity-report", s(&theirs)],
    ));
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains(&format!(
            "{}: is about other weights than the build's (same config.json): model.safetensors has sha256 {} in the report, {} in build.json",
            theirs.display(),
            weights_of(&seed7)["files"]["model.safetensors"].as_str().unwrap(),
            weights_of(&ours)["files"]["model.safetensors"].as_str().unwrap(),
        )),
        "{e}"
    );
    assert!(!out.exists());
    let o = run(&package_args(
        &build,
        "two",
        &private,
        &out,
        &["--parity-report", s(&good)],
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(manifest(&out)["parity"]["ok"], json!(true));
    // The manifest names the weights the signed parity verdict is about.
    assert_eq!(
        manifest(&out)["model"]["weights_sha256"],
        weights_of(&ours)["sha256"]
    );
    fs::remove_dir_all(&w).unwrap();
}

/// An inconclusive parity report (the reference disagrees with transformers
/// only at an ill-conditioned step) is signed only with
/// --accept-inconclusive-parity, and recorded as inconclusive; one that calls
/// itself inconclusive over a failed check contradicts itself.
#[test]
fn package_signs_inconclusive_parity_only_when_asked() {
    let w = tempdir("parity-inconclusive");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let (private, public) = keys(&w, "k");
    let out = w.join("rel");
    let report = w.join("parity.json");
    let package = |extra: &[&str]| {
        let mut args = vec!["--parity-report", s(&report)];
        args.extend(extra);
        run(&package_args(&build, "two", &private, &out, &args))
    };
    let inconclusive = |step_ok: bool, oracle_verdict: &str| {
        let mut r = parity_report(
            step_ok,
            json!({"ok": false, "verdict": "inconclusive", "steps": 1, "tol_cos": 0.9999, "layouts": ["two"]}),
        );
        r["steps"][0]["verdict"] = json!(if step_ok { "ok" } else { "fail" });
        r["oracle"] = json!([{"step": 0, "hf_token": 7, "ref_token": 5, "cos": 0.91, "margin": 0.01,
            "ok": false, "floor_cos": 0.92, "floor_logit": 0.5, "ill_conditioned": true,
            "verdict": oracle_verdict}]);
        r
    };
    for (r, fragment) in [
        (
            inconclusive(true, "inconclusive"),
            "parity INCONCLUSIVE (oracle[0] (layout reference, step 0))",
        ),
        (
            inconclusive(false, "inconclusive"),
            "summary.verdict is inconclusive but steps[0] (layout two, step 0) failed",
        ),
        (
            inconclusive(true, "fail"),
            "summary.verdict is inconclusive but oracle[0] (layout reference, step 0) failed",
        ),
    ] {
        fs::write(&report, r.to_string()).unwrap();
        let o = package(&[]);
        assert_eq!(o.status.code(), Some(2), "{fragment}: {}", stderr(&o));
        assert!(stderr(&o).contains(fragment), "{fragment}: {}", stderr(&o));
        assert!(!out.exists());
    }
    fs::write(&report, inconclusive(true, "inconclusive").to_string()).unwrap();
    let o = package(&["--accept-inconclusive-parity"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("parity INCONCLUSIVE"), "{}", stderr(&o));
    let m = manifest(&out);
    assert_eq!(m["parity"]["ok"], json!(false));
    assert_eq!(m["parity"]["verdict"], json!("inconclusive"));
    let runbook = fs::read_to_string(out.join("DEVICE_RUNBOOK.md")).unwrap();
    assert!(
        runbook.contains("embeds an INCONCLUSIVE parity report"),
        "{runbook}"
    );
    assert!(cf_verify(&out, &public).status.success());
}

/// SIGKILL at many points of `package`: the output is always the previous
/// release or nothing (the one moment between moving the old one aside and
/// the new one in), never a partial folder, and the next run succeeds and
/// cleans up.
#[test]
fn sigkill_never_leaves_a_half_written_release() {
    let w = tempdir("sigkill");
    let build = synthetic_build(&w.join("build"), &[], 192);
    let (private, public) = keys(&w, "k");
    let parent = w.join("out");
    let out = parent.join("rel");
    let args = |v: &str| -> Vec<String> {
        [
            "package",
            s(&build),
            "--layout",
            "all",
            "--allow-over-ceiling",
            "--key",
            s(&private),
            "--output",
            s(&out),
            "--version",
            v,
            "--zip",
            s(&parent.join("rel.zip")),
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    };
    let t = std::time::Instant::now();
    ok(&args("v1").iter().map(String::as_str).collect::<Vec<_>>());
    let full = t.elapsed();
    let mut seen = BTreeMap::new();
    let mut interrupted = 0;
    // Kill points from the start to well past a full run (the machine's load
    // varies, so later runs may be slower than the timed one).
    for i in 0..15u32 {
        let delay = full.mul_f64(f64::from(i) / 5.0);
        let mut child = Command::new(common::bin())
            .args(args(&format!("v{}", i + 2)))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        child.kill().ok(); // SIGKILL on Unix
        let finished = child.wait().unwrap().success();
        let staging_left = fs::read_dir(&parent).unwrap().any(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(".chunkforge-staging-")
        });
        if !finished && staging_left {
            interrupted += 1;
        }
        let state = if out.exists() {
            let o = cf_verify(&out, &public);
            assert!(
                o.status.success(),
                "after kill at {delay:?}: release is not whole:\n{}",
                stderr(&o)
            );
            let v = manifest(&out)["release"]["version"]
                .as_str()
                .unwrap()
                .to_string();
            if finished {
                assert_eq!(
                    v,
                    format!("v{}", i + 2),
                    "a finished run must leave its own release"
                );
            }
            if v == format!("v{}", i + 2) {
                "new"
            } else {
                "previous"
            }
            .to_string()
        } else {
            "none".to_string()
        };
        *seen.entry(state).or_insert(0) += 1;
    }
    eprintln!("states after SIGKILL: {seen:?}; killed mid-way: {interrupted}");
    assert!(interrupted > 0, "no kill landed inside a run: {seen:?}");
    ok(&args("final").iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(manifest(&out)["release"]["version"], json!("final"));
    assert!(cf_verify(&out, &public).status.success());
    ok(&[
        "verify",
        s(&out),
        "--public-key",
        s(&public),
        "--archive",
        s(&parent.join("rel.zip")),
    ]);
    let left: Vec<String> = fs::read_dir(&parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".chunkforge-staging-"))
        .collect();
    assert!(
        left.is_empty(),
        "stale staging folders after a successful run: {left:?}"
    );
    fs::remove_dir_all(&w).unwrap(); // ~1 GB of test data
}

/// `build --mode all` of the built-in checkpoint, shared with the other test files.
fn real_build() -> PathBuf {
    common::built_all()
}

fn validate_schema(manifest: &Path) -> Output {
    validate_with("manifests/manifest.schema.json", manifest)
}

/// Validates the JSON file `doc` against the repository's schema `schema`.
fn validate_with(schema: &str, doc: &Path) -> Output {
    let schema = Path::new(env!("CARGO_MANIFEST_DIR")).join(schema);
    Command::new(signing_bin().join("python"))
        .args([
            "-c",
            "import json,sys,jsonschema\n\
             s=json.load(open(sys.argv[1])); jsonschema.Draft202012Validator.check_schema(s)\n\
             errs=list(jsonschema.Draft202012Validator(s).iter_errors(json.load(open(sys.argv[2]))))\n\
             [print(e.json_path, e.message) for e in errs]\n\
             sys.exit(1 if errs else 0)",
            s(&schema),
            s(doc),
        ])
        .output()
        .unwrap()
}

#[test]
fn schema_accepts_the_example_and_rejects_unsafe_paths() {
    let ex = Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/example.manifest.json");
    let o = validate_schema(&ex);
    assert!(o.status.success(), "{}", stdout(&o));
    let mut m: Value = serde_json::from_slice(&fs::read(&ex).unwrap()).unwrap();
    m["files"][0]["path"] = json!("../x");
    let bad = tempdir("schema").join("bad.json");
    fs::write(&bad, serde_json::to_vec(&m).unwrap()).unwrap();
    assert!(
        !validate_schema(&bad).status.success(),
        "schema accepted a '..' path"
    );
}

#[test]
fn release_of_a_real_build_all_verifies_and_matches_the_schema() {
    let build = real_build();
    let w = tempdir("real");
    let (private, public) = keys(&w, "k");
    let out = w.join("gemma-e2b-release");
    ok(&[
        "package",
        s(&build),
        "--layout",
        "all",
        "--allow-over-ceiling",
        "--key",
        s(&private),
        "--output",
        s(&out),
        "--version",
        "1.0.0",
        "--base-url",
        "https://example.com/m",
    ]);
    let o = cf_verify(&out, &public);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ms_verify(&out, &public);
    assert!(o.status.success(), "model_signing: {}", stderr(&o));
    let o = validate_schema(&out.join("manifest.json"));
    assert!(o.status.success(), "schema: {}", stdout(&o));
    let m = manifest(&out);
    let b: Value = serde_json::from_slice(&fs::read(build.join("build.json")).unwrap()).unwrap();
    assert_eq!(
        m["tools"]["coremltools"],
        b["tool"]["python"]["coremltools"]
    );
    assert_eq!(
        m["model"]["config_sha256"],
        b["checkpoint"]["config_sha256"]
    );
    // Every package of the build: chunk1..4, prefill_chunk1..4, the three-
    // (chunk1 is four's), two- and one-chunk layouts.
    assert_eq!(m["chunks"].as_array().unwrap().len(), 13);
    let functions = |name: &str| -> Vec<Value> {
        let c = m["chunks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        c["functions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].clone())
            .collect()
    };
    assert_eq!(
        functions("chunk1"),
        [json!("decode_q1"), json!("verify_qK")]
    );
    assert_eq!(functions("prefill_chunk4"), [json!("prefill_b512")]);
    assert_eq!(m["prefill"]["layout"], "prefill");
    // Every file has its roles; the side files and hf_model/ are listed.
    let roles: BTreeMap<String, Value> = m["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["path"].as_str().unwrap().to_string(), f["roles"].clone()))
        .collect();
    assert_eq!(roles["embed_tokens_q8.bin"], json!(["embedding"]));
    assert_eq!(roles["per_layer_projection.bin"], json!(["embedding"]));
    assert_eq!(roles["swa/cos_full.npy"], json!(["rope"]));
    assert_eq!(roles["model_config.json"], json!(["config"]));
    assert_eq!(roles["hf_model/tokenizer.json"], json!(["tokenizer"]));
    assert_eq!(roles["hf_model/config.json"], json!(["tokenizer"]));
    assert_eq!(
        roles["swa/chunk1.mlpackage/Data/com.apple.CoreML/weights/weight.bin"],
        json!(["decode", "verify"])
    );
    assert_eq!(
        roles["prefill/chunk2.mlpackage/Manifest.json"],
        json!(["prefill"])
    );
    assert_eq!(
        roles["merged_full.mlpackage/Data/com.apple.CoreML/model.mlmodel"],
        json!(["decode"])
    );
    assert_eq!(m["compiled"]["mlmodelc"], json!(false));
    // Groups of equal files, each listed with the digest every member has.
    let digest: BTreeMap<&str, &Value> = m["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["path"].as_str().unwrap(), &f["sha256"]))
        .collect();
    for g in m["shared_blobs"].as_array().unwrap() {
        let paths = g["paths"].as_array().unwrap();
        assert!(paths.len() >= 2);
        for p in paths {
            assert_eq!(digest[p.as_str().unwrap()], &g["sha256"]);
        }
    }
    let cfg: Value =
        serde_json::from_slice(&fs::read(out.join("model_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["context_length"], b["settings"]["ctx"]);
}

#[test]
fn bench_hash_compares_the_three_tools() {
    signing_bin();
    let d = tempdir("bench");
    let out = ok(&[
        "bench",
        "hash",
        "--dir",
        s(&d),
        "--big-mib",
        "8",
        "--small-mib",
        "2",
        "--small-count",
        "3",
        "--repeat",
        "1",
    ]);
    for tool in [
        "chunkforge package",
        "openssl dgst -sha256",
        "model_signing sign key",
    ] {
        for data in ["1 x 8 MiB", "3 x 2 MiB"] {
            let line = out
                .lines()
                .find(|l| l.starts_with(data) && l.contains(tool));
            assert!(
                line.is_some_and(|l| l.contains('s') && !l.contains(" - ")),
                "no timing for {tool} on {data}:\n{out}"
            );
        }
    }
    assert_eq!(
        fs::read_dir(&d).unwrap().count(),
        0,
        "bench left data behind"
    );
}

/// Runs openssl with `args`, which must succeed.
fn openssl(args: &[&str]) {
    let o = Command::new("openssl").args(args).output().unwrap();
    assert!(o.status.success(), "openssl {args:?}: {}", stderr(&o));
}

#[test]
fn keys_of_other_kinds_are_named_with_their_own_oid_and_an_empty_key_as_empty() {
    let w = tempdir("foreign-keys");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let p = |n: &str| w.join(n).to_str().unwrap().to_string();
    let genpkey = |name: &str, opts: &[&str]| {
        let mut a = vec!["genpkey"];
        a.extend_from_slice(opts);
        let pem = p(&format!("{name}.pem"));
        a.extend_from_slice(&["-out", &pem]);
        openssl(&a);
        openssl(&[
            "pkey",
            "-in",
            &pem,
            "-pubout",
            "-out",
            &p(&format!("{name}.pub")),
        ]);
    };
    genpkey(
        "p384",
        &["-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-384"],
    );
    genpkey("ed", &["-algorithm", "ed25519"]);
    genpkey(
        "rsa",
        &["-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:1024"],
    );
    openssl(&[
        "ecparam",
        "-name",
        "secp384r1",
        "-genkey",
        "-noout",
        "-out",
        &p("sec1.pem"),
    ]);
    fs::write(w.join("empty.pem"), b"").unwrap();
    fs::write(w.join("empty.pub"), b"").unwrap();
    let cases = [
        ("p384", "an ECDSA key on P-384 (curve OID 1.3.132.0.34)"),
        ("ed", "an Ed25519 key (algorithm OID 1.3.101.112)"),
        ("rsa", "an RSA key (algorithm OID 1.2.840.113549.1.1.1)"),
        ("empty", "the key file is empty (0 bytes)"),
    ];
    let out = w.join("rel");
    // verify reads the key before the signature: any folder with a model.sig
    // will do (one without is not a release, refused before the key).
    let folder = w.join("folder");
    fs::create_dir(&folder).unwrap();
    fs::write(folder.join("model.sig"), "").unwrap();
    for (name, says) in cases {
        let (private, public) = (w.join(format!("{name}.pem")), w.join(format!("{name}.pub")));
        let e = fails(&package_args(&build, "two", &private, &out, &[]));
        assert!(
            e.contains(&format!("{name}.pem: ")) && e.contains(says),
            "{name}.pem: {e}"
        );
        let e = fails(&["verify", s(&folder), "--public-key", s(&public)]);
        assert!(
            e.contains(&format!("{name}.pub: ")) && e.contains(says),
            "{name}.pub: {e}"
        );
        // Neither the OID chunkforge expected nor a PEM decoder's detail.
        assert!(
            !e.contains("NUL byte") && !e.contains("1.2.840.10045.2.1"),
            "{e}"
        );
    }
    let e = fails(&package_args(&build, "two", &w.join("sec1.pem"), &out, &[]));
    assert!(
        e.contains("an ECDSA key on P-384 (curve OID 1.3.132.0.34)"),
        "{e}"
    );
    assert!(!out.exists());
}

#[test]
fn keygen_errors_name_the_users_file_and_the_os_error_once() {
    let w = tempdir("keygen-errors");
    // A "folder" on the way that is a file.
    fs::write(w.join("file"), "x").unwrap();
    let prefix = w.join("file/k");
    let e = fails(&["keygen", "--out", s(&prefix)]);
    assert!(
        e.contains(&format!(
            "{}: could not create",
            w.join("file/k.pub").display()
        )),
        "{e}"
    );
    assert!(!e.contains(".tmp-"), "names the temporary file: {e}");
    assert_eq!(
        e.matches("os error 20").count(),
        1,
        "OS error repeated: {e}"
    );
}

/// The README's `keygen --out keys/release` in a fresh clone: the missing
/// folders are made, private to their owner like the key.
#[test]
fn keygen_makes_the_missing_key_folder() {
    let w = tempdir("keygen-folder");
    let o = run(&["keygen", "--out", s(&w.join("keys/nested/release"))]);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(
        e.contains(&format!(
            "created folder {} (mode 0700)",
            w.join("keys/nested").display()
        )),
        "{e}"
    );
    for d in ["keys", "keys/nested"] {
        assert_eq!(
            fs::metadata(w.join(d)).unwrap().permissions().mode() & 0o777,
            0o700,
            "{d}"
        );
    }
    assert!(
        w.join("keys/nested/release.pem").is_file() && w.join("keys/nested/release.pub").is_file()
    );
    // An existing folder is used as it is, and not reported as made.
    let e = stderr(&run(&["keygen", "--out", s(&w.join("keys/other"))]));
    assert!(!e.contains("created folder"), "{e}");
    assert!(w.join("keys/other.pem").is_file());
}

/// `release` checks every input the build does not decide (the key above
/// all) before it starts the build: a missing key file costs seconds, not a
/// whole build, and leaves no build folder behind.
#[test]
fn release_checks_its_inputs_before_building() {
    let w = tempdir("release-inputs");
    let hf = common::fixture("e2b", &[]);
    let (private, _) = keys(&w, "k");
    let (out, build) = (w.join("rel"), w.join("rel.build"));
    let release = |extra: &[&str]| {
        let mut a = vec![
            "release",
            "--hf-dir",
            s(&hf),
            "--layout",
            "two",
            "--output",
            s(&out),
        ];
        a.extend_from_slice(extra);
        let o = run_env(
            &a,
            &[("CHUNKFORGE_PYTHON_DIR", "/nonexistent/no-python-here")],
        );
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        assert!(!build.exists(), "the build started: {}", stderr(&o));
        stderr(&o)
    };
    let missing = w.join("no-such.pem");
    let e = release(&["--key", s(&missing)]);
    assert!(e.contains(&missing.display().to_string()), "{e}");
    assert!(!e.contains("release 1/3") && !out.exists(), "{e}");
    let e = release(&["--key", s(&private), "--base-url", "ftp://example.com"]);
    assert!(
        e.contains("--base-url") && e.contains("not an http(s) URL"),
        "{e}"
    );
    fs::create_dir_all(out.join("something")).unwrap();
    let e = release(&["--key", s(&private)]);
    assert!(
        e.contains("not a previous release; refusing to replace it"),
        "{e}"
    );
    fs::remove_dir_all(&out).unwrap();
}

#[test]
fn unsafe_model_ids_are_refused_naming_the_option() {
    let w = tempdir("model-id");
    let build = synthetic_build(&w.join("build"), &[], 0);
    let (private, _) = keys(&w, "k");
    let out = w.join("rel");
    let package = |extra: &[&str]| run(&package_args(&build, "two", &private, &out, extra));
    for bad in ["../../etc/passwd", "a/b", "..", "x\ny", "", ".hidden"] {
        let o = package(&["--model-id", bad]);
        assert!(!o.status.success(), "{bad:?} accepted");
        let e = stderr(&o);
        assert!(
            e.contains("--model-id") && e.contains("is not a safe model id"),
            "{bad:?}: {e}"
        );
        assert!(!out.exists());
    }
    // The default, the checkpoint folder's name, is held to the same pattern.
    let bj = build.join("build.json");
    let mut b: Value = serde_json::from_slice(&fs::read(&bj).unwrap()).unwrap();
    b["checkpoint"]["dir"] = json!("/models/gemma 4\u{7}");
    fs::write(&bj, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
    let e = stderr(&package(&[]));
    assert!(
        e.contains("--model-id")
            && e.contains("not a safe model id")
            && e.contains("pass --model-id"),
        "{e}"
    );
    // The checkpoint build.json names is gone now: --hf-dir gives it.
    let o = package(&[
        "--model-id",
        "gemma-4-e2b_it.v1",
        "--hf-dir",
        s(&checkpoint_dir()),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(manifest(&out)["model"]["id"], json!("gemma-4-e2b_it.v1"));
}

/// What `package` publishes, as found: the release's version (checked to
/// verify), the archive's bytes, the digest file's bytes.
type Published = (Option<String>, Option<Vec<u8>>, Option<Vec<u8>>);

fn published(out: &Path, zip: &Path, public: &Path) -> Published {
    let version = out.exists().then(|| {
        let o = cf_verify(out, public);
        assert!(o.status.success(), "release is not whole:\n{}", stderr(&o));
        manifest(out)["release"]["version"]
            .as_str()
            .unwrap()
            .to_string()
    });
    let digest = fs::read(parent_of(zip).join(format!(
        "{}.sha256",
        zip.file_name().unwrap().to_string_lossy()
    )));
    (version, fs::read(zip).ok(), digest.ok())
}

fn parent_of(p: &Path) -> &Path {
    p.parent().unwrap()
}

/// A fresh folder with a synthetic build (`big_mib` as in `synthetic_build`)
/// and keys: (folder, build, private key, public key).
fn scratch(tag: &str, big_mib: usize) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let w = tempdir(tag);
    let build = synthetic_build(&w.join("build"), &[], big_mib);
    let (private, public) = keys(&w, "k");
    (w, build, private, public)
}

/// `package BUILD --layout LAYOUT --key KEY --output OUT --version VERSION`, owned.
fn package_owned(build: &Path, layout: &str, key: &Path, out: &Path, version: &str) -> Vec<String> {
    package_args(build, layout, key, out, &["--version", version])
        .into_iter()
        .map(String::from)
        .collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A publish (release folder, archive, digest file) cut by SIGKILL right
/// before each of its steps (every rename or exchange, and the commit), with
/// the atomic exchange and with the three-rename fallback: nothing is lost,
/// and the next run, even one killed itself, puts the previous release,
/// archive and digest file back byte for byte and reports the stale lock.
#[test]
fn sigkill_at_every_publish_step_is_undone_by_the_next_run() {
    let (w, build, private, public) = scratch("kill-steps", 0);
    let parent = w.join("out");
    let (out, zip) = (parent.join("rel"), parent.join("rel.zip"));
    let args = |v: &str| {
        let mut a = package_owned(&build, "two", &private, &out, v);
        a.extend(["--zip".into(), s(&zip).into()]);
        a
    };
    let mut steps = Vec::new();
    for fallback in [false, true] {
        let tag = if fallback { "fallback" } else { "exchange" };
        ok(&strs(&args(&format!("{tag}-previous"))));
        let before = published(&out, &zip, &public);
        let mut n = 1;
        let new = loop {
            let step = n.to_string();
            let mut env = vec![("CHUNKFORGE_TEST_KILL_AT_STEP", step.as_str())];
            if fallback {
                env.push(("CHUNKFORGE_TEST_NO_EXCHANGE", "1"));
            }
            let new = format!("{tag}-new-{n}");
            let o = run_env(&strs(&args(&new)), &env);
            if o.status.success() {
                break new;
            }
            assert!(killed(&o), "{tag} step {n}: {}", stderr(&o));
            // A release present is whole (`published` verifies it); with the
            // exchange no entry is ever missing.
            let (v, z, d) = published(&out, &zip, &public);
            if !fallback {
                for (what, present) in [
                    ("release", v.is_some()),
                    ("archive", z.is_some()),
                    ("digest file", d.is_some()),
                ] {
                    assert!(present, "{tag} step {n}: the {what} is missing");
                }
            }
            env[0].1 = "1"; // killed before its own first rename
            let o = run_env(&strs(&args("recovering")), &env);
            assert!(killed(&o), "{tag} step {n}, next run: {}", stderr(&o));
            let e = stderr(&o);
            assert!(e.contains("ended without releasing it"), "{e}");
            assert_eq!(
                e.contains("restored the previous"),
                n > 1,
                "{tag} step {n}: {e}"
            );
            assert!(
                published(&out, &zip, &public) == before,
                "{tag}: after a kill at step {n} the next run did not put the previous outputs back"
            );
            n += 1;
        };
        assert_eq!(published(&out, &zip, &public).0, Some(new));
        assert_eq!(
            names_in(&parent),
            [".rel.chunkforge-lock", "rel", "rel.zip", "rel.zip.sha256"],
            "{tag}: temporaries left"
        );
        steps.push(n - 1);
    }
    // Three entries: one exchange each plus the commit; three renames each without.
    assert_eq!(steps, [4, 10], "kill points (exchange, fallback)");
    fs::remove_dir_all(&w).unwrap();
}

/// Spawns chunkforge with `args`, stderr piped.
fn spawn_piped(args: &[String]) -> std::process::Child {
    Command::new(common::bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits until the lock file `lock` names `child` as its holder.
fn wait_for_lock(lock: &Path, child: &std::process::Child) {
    let t = std::time::Instant::now();
    let holder = format!("{}\t", child.id());
    while !fs::read_to_string(lock)
        .unwrap_or_default()
        .starts_with(&holder)
    {
        assert!(
            t.elapsed().as_secs() < 60,
            "{} never took {lock:?}",
            child.id()
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

fn signal(sig: &str, pid: u32) {
    assert!(Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success())
}

/// A second `package` into one --output while the first holds it (stopped
/// with SIGSTOP so the overlap is certain): with --no-wait it refuses naming
/// the first run's pid; without, it says so, waits, and then publishes its
/// own whole release.
#[test]
fn a_second_package_into_one_output_waits_or_refuses() {
    let (w, build, private, public) = scratch("lock", 64);
    let out = w.join("out").join("rel");
    let lock = w.join("out").join(".rel.chunkforge-lock");
    let args = |v: &str| package_owned(&build, "all", &private, &out, v);
    let mut first = spawn_piped(&args("first"));
    wait_for_lock(&lock, &first);
    signal("-STOP", first.id());
    assert!(
        first.try_wait().unwrap().is_none(),
        "the first run finished before it could be stopped"
    );

    let mut refused = args("refused");
    refused.push("--no-wait".into());
    let o = run(&strs(&refused));
    let e = stderr(&o);
    assert!(!o.status.success(), "{e}");
    assert!(
        e.contains(&format!("pid {}", first.id())) && e.contains("--no-wait"),
        "{e}"
    );

    let mut second = spawn_piped(&args("second"));
    let err = std::io::BufReader::new(second.stderr.take().unwrap());
    let mut lines = std::io::BufRead::lines(err);
    let line = lines.next().unwrap().unwrap();
    assert!(
        line.contains("waiting") && line.contains(&format!("pid {}", first.id())),
        "{line}"
    );
    signal("-CONT", first.id());
    assert!(first.wait().unwrap().success());
    assert!(second.wait().unwrap().success());
    assert_eq!(manifest(&out)["release"]["version"], json!("second"));
    assert!(cf_verify(&out, &public).status.success());
    fs::remove_dir_all(&w).unwrap();
}

/// Every file of a release is fsynced before the exchange that publishes it,
/// and the folder holding it after (strace shows the order of the calls).
#[test]
fn package_fsyncs_files_before_publishing_and_the_folder_after() {
    let (w, build, private, _) = scratch("fsync", 0);
    let parent = w.join("out");
    let out = parent.join("rel");
    let args = package_owned(&build, "two", &private, &out, "1");
    ok(&strs(&args));
    let trace = w.join("trace");
    let o = Command::new("strace")
        .args([
            "-f",
            "-qq",
            "-y",
            "-e",
            "trace=fsync,rename,renameat2",
            "-o",
        ])
        .arg(&trace)
        .arg(common::bin())
        .args(args)
        .output()
        .expect("strace (apt install strace)");
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<String> = fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    let parent = parent.canonicalize().unwrap();
    let target = format!("\"{}\"", out.display());
    let publish = lines
        .iter()
        .position(|l| l.contains("RENAME_EXCHANGE") && l.contains(&target))
        .unwrap_or_else(|| panic!("no exchange onto {target}:\n{}", lines.join("\n")));
    let files: Vec<String> = walkdir::WalkDir::new(&out)
        .into_iter()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().is_file())
        .map(|e| e.path().strip_prefix(&out).unwrap().display().to_string())
        .collect();
    assert!(files.len() > 5);
    for f in &files {
        // `-y` shows the path as `fd</path>`; threads split a call across lines.
        let staged = format!("/rel/{f}>");
        assert!(
            lines[..publish].iter().any(|l| l.contains("fsync(")
                && l.contains(".chunkforge-staging-")
                && l.contains(&staged)),
            "{f} not fsynced before the publish"
        );
    }
    let folder = format!("<{}>", parent.display());
    assert!(
        lines[publish..]
            .iter()
            .any(|l| l.contains("fsync(") && l.contains(&folder)),
        "{} not fsynced after the publish",
        parent.display()
    );
    fs::remove_dir_all(&w).unwrap();
}

/// Ctrl-C during `package` exits 130 and leaves its lock released: the
/// lock file goes with the release this run never made (it did not exist
/// before), and the next run does not report it as left by a killed run.
#[test]
fn ctrl_c_during_package_releases_the_lock_cleanly() {
    let (w, build, private, _) = scratch("lock-int", 64);
    let out = w.join("out").join("rel");
    let lock = w.join("out").join(".rel.chunkforge-lock");
    let mut child = spawn_piped(&package_owned(&build, "all", &private, &out, "1"));
    wait_for_lock(&lock, &child);
    signal("-INT", child.id());
    assert_eq!(child.wait().unwrap().code(), Some(130));
    assert_eq!(
        names_in(&w.join("out")),
        Vec::<String>::new(),
        "lock or release left"
    );
    let o = run(&strs(&package_owned(&build, "all", &private, &out, "2")));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        !stderr(&o).contains("ended without releasing"),
        "{}",
        stderr(&o)
    );
    fs::remove_dir_all(&w).unwrap();
}

/// Spawns chunkforge with `args` and `env`; returns the child and its stderr
/// lines as they come.
fn spawn_lines(args: &[String], env: &[(&str, &str)]) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new(common::bin())
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let err = std::io::BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(err).map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// The lines of `rx` up to and including the first containing `cue`.
fn lines_until(rx: &mpsc::Receiver<String>, cue: &str) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(line) => {
                let done = line.contains(cue);
                seen.push(line);
                if done {
                    return seen;
                }
            }
            Err(e) => panic!("no `{cue}` on stderr ({e}); saw:\n{}", seen.join("\n")),
        }
    }
}

/// The runs after a `package` SIGKILLed right after its exchange (its new
/// release in place, uncommitted; the previous one in its staging folder)
/// say what they found and did, checked against the folder each time:
/// - a run interrupted before it undid that publish says the killed run's
///   release is still in place and where the previous one waits (it said
///   "any publish it left half done is undone" and "the output folder holds
///   the previous result"), and it releases its lock, so the run after it
///   does not call it killed (it did when the interrupt came right after the
///   lock was taken);
/// - a run interrupted after it undid it says it put the previous release
///   back (it said nothing).
#[test]
fn the_runs_after_a_kill_say_what_they_found_and_did() {
    let (w, build, private, public) = scratch("after-kill", 0);
    let parent = w.join("out");
    let out = parent.join("rel");
    let lock = parent.join(".rel.chunkforge-lock");
    let args = |v: &str| package_owned(&build, "two", &private, &out, v);
    let version = || published(&out, &parent.join("none.zip"), &public).0;
    ok(&strs(&args("previous")));
    let rel = out.display().to_string();
    for (pause, undone_first) in [("lock", false), ("recovery", true)] {
        // Steps of a one-entry publish: 1 the exchange, 2 the commit.
        let o = run_env(
            &strs(&args("killed")),
            &[("CHUNKFORGE_TEST_KILL_AT_STEP", "2")],
        );
        assert!(killed(&o), "{}", stderr(&o));
        assert_eq!(
            version().as_deref(),
            Some("killed"),
            "uncommitted, in place"
        );

        let (mut child, rx) = spawn_lines(
            &args("interrupted"),
            &[("CHUNKFORGE_TEST_PAUSE_AFTER", pause)],
        );
        let before = lines_until(&rx, &format!("paused after {pause}")).join("\n");
        assert!(before.contains("ended without releasing it"), "{before}");
        assert!(
            !before.contains("undone"),
            "a promise, not a fact: {before}"
        );
        let restored = format!("restored the previous {rel}: the run with pid");
        assert_eq!(before.contains(&restored), undone_first, "{before}");
        let expect = if undone_first { "previous" } else { "killed" };
        assert_eq!(version().as_deref(), Some(expect), "{pause}: {before}");
        signal("-INT", child.id());
        assert_eq!(child.wait().unwrap().code(), Some(130));
        let after: Vec<String> = rx.into_iter().collect();
        let after = after.join("\n");
        assert!(
            after.contains("interrupted: this run's unfinished work is removed"),
            "{after}"
        );
        assert!(after.contains("this run published nothing"), "{after}");
        assert!(!after.contains("holds the previous result"), "{after}");
        let pending = format!("{rel}: holds the uncommitted new version from the run with pid");
        assert_eq!(after.contains(&pending), !undone_first, "{pause}: {after}");
        assert_eq!(
            after.contains(&format!("before that, this run {restored}")),
            undone_first,
            "{pause}: {after}"
        );
        assert_eq!(version().as_deref(), Some(expect), "{pause}: {after}");
        assert_eq!(
            fs::read_to_string(&lock).unwrap(),
            "",
            "{pause}: lock not emptied"
        );

        // The next run (killed before its own first rename) does not call
        // the interrupted run killed, and undoes only what is left.
        let o = run_env(
            &strs(&args("next")),
            &[("CHUNKFORGE_TEST_KILL_AT_STEP", "1")],
        );
        let e = stderr(&o);
        assert!(killed(&o), "{e}");
        assert!(!e.contains("ended without releasing"), "{pause}: {e}");
        assert_eq!(e.contains(&restored), !undone_first, "{pause}: {e}");
        assert_eq!(version().as_deref(), Some("previous"), "{pause}: {e}");
    }
    fs::remove_dir_all(&w).unwrap();
}

/// A previous release that an older chunkforge had moved aside
/// (`.chunkforge-staging-<pid>-old-<name>`) when it was killed is put back by
/// the next run, not deleted (this run is killed before its own first rename).
#[test]
fn a_release_left_aside_by_an_older_version_is_put_back() {
    let (w, build, private, public) = scratch("legacy-aside", 0);
    let parent = w.join("out");
    let out = parent.join("rel");
    ok(&strs(&package_owned(
        &build, "two", &private, &out, "previous",
    )));
    // A pid that has ended: a process of ours, reaped.
    let mut gone = Command::new("true").spawn().unwrap();
    gone.wait().unwrap();
    let aside = parent.join(format!(".chunkforge-staging-{}-old-rel", gone.id()));
    fs::rename(&out, &aside).unwrap();
    let o = run_env(
        &strs(&package_owned(&build, "two", &private, &out, "new")),
        &[("CHUNKFORGE_TEST_KILL_AT_STEP", "1")],
    );
    assert!(killed(&o), "{}", stderr(&o));
    assert!(stderr(&o).contains("restored"), "{}", stderr(&o));
    assert!(!aside.exists());
    assert!(cf_verify(&out, &public).status.success());
    assert_eq!(manifest(&out)["release"]["version"], json!("previous"));
    fs::remove_dir_all(&w).unwrap();
}

/// A publish that fails part-way (an I/O error injected before a step) puts
/// the previous release, archive and digest file back itself and says so,
/// leaving no temporaries; one that fails at the commit keeps its journal,
/// and the next run puts them back.
#[test]
fn a_failed_publish_leaves_the_previous_outputs() {
    let (w, build, private, public) = scratch("fail-steps", 0);
    let parent = w.join("out");
    let (out, zip) = (parent.join("rel"), parent.join("rel.zip"));
    let args = |v: &str| {
        let mut a = package_owned(&build, "two", &private, &out, v);
        a.extend(["--zip".into(), s(&zip).into()]);
        a
    };
    ok(&strs(&args("previous")));
    let before = published(&out, &zip, &public);
    let entries = [".rel.chunkforge-lock", "rel", "rel.zip", "rel.zip.sha256"];
    // Steps with the exchange: release, archive, digest file, commit.
    for n in 1..=4 {
        let step = n.to_string();
        let o = run_env(
            &strs(&args(&format!("new-{n}"))),
            &[("CHUNKFORGE_TEST_FAIL_AT_STEP", &step)],
        );
        let e = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "step {n}: {e}");
        if n < 4 {
            assert!(e.contains("the previous outputs are back in place"), "{e}");
            assert_eq!(names_in(&parent), entries, "step {n}: temporaries left");
        } else {
            assert!(
                e.contains("the next run puts the previous outputs back"),
                "{e}"
            );
            let o = run_env(
                &strs(&args("recovering")),
                &[("CHUNKFORGE_TEST_KILL_AT_STEP", "1")],
            );
            assert!(
                stderr(&o).contains("restored the previous"),
                "{}",
                stderr(&o)
            );
        }
        assert!(
            published(&out, &zip, &public) == before,
            "step {n}: the previous outputs are not all back"
        );
    }
    ok(&strs(&args("final")));
    assert_eq!(names_in(&parent), entries, "temporaries left");
    fs::remove_dir_all(&w).unwrap();
}

/// README "Exit codes": verify exits 0 when the release holds, 1 when it
/// finds problems, 2 when it cannot check at all; usage errors exit 2.
#[test]
fn verify_exit_codes_follow_the_readme_table() {
    let r = release("exit-codes");
    assert_eq!(cf_verify(&r.dir, &r.public).status.code(), Some(0));
    let weight = r
        .dir
        .join("merged_chunk1.mlpackage/Data/com.apple.CoreML/weights/weight.bin");
    let mut bytes = fs::read(&weight).unwrap();
    bytes[0] ^= 1;
    fs::write(&weight, bytes).unwrap();
    let o = cf_verify(&r.dir, &r.public);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("verification FAILED"), "{}", stderr(&o));
    let o = cf_verify(&r.work.join("no-such-release"), &r.public);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = run(&["verify", s(&r.dir)]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "missing --public-key: {}",
        stderr(&o)
    );
}

/// A release is the whole folder: a build without prefill_chunk1..4, a
/// package whose causal_mask_full disagrees with the context length, and a
/// checkpoint without a tokenizer are refused, each naming the problem;
/// --no-tokenizer ships without one on purpose.
#[test]
fn package_refuses_incomplete_folders() {
    let w = tempdir("incomplete");
    let (private, _) = keys(&w, "k");
    let out = w.join("rel");
    let edit = |tag: &str, f: &dyn Fn(&mut Value)| -> PathBuf {
        let build = synthetic_build(&w.join(tag), &[], 0);
        let bj = build.join("build.json");
        let mut b: Value = serde_json::from_slice(&fs::read(&bj).unwrap()).unwrap();
        f(&mut b);
        fs::write(&bj, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
        build
    };
    let no_prefill = edit("no-prefill", &|b| {
        b["plan"]["layouts"]
            .as_array_mut()
            .unwrap()
            .retain(|l| l["kind"] != "prefill");
    });
    let o = run(&package_args(&no_prefill, "two", &private, &out, &[]));
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("no prefill_chunk1..4") && e.contains("build.json"),
        "{e}"
    );
    assert!(!out.exists());

    let bad_mask = edit("bad-mask", &|b| {
        let chunk1 = &mut b["plan"]["layouts"][0]["chunks"][0];
        assert_eq!(chunk1["name"], "chunk1");
        for t in chunk1["functions"][0]["inputs"].as_array_mut().unwrap() {
            if t["name"] == "causal_mask_full" {
                t["shape"][3] = json!(1024);
            }
        }
    });
    let e = stderr(&run(&package_args(&bad_mask, "two", &private, &out, &[])));
    assert!(
        e.contains("chunk1.mlpackage")
            && e.contains("causal_mask_full")
            && e.contains("context_length is 2048"),
        "{e}"
    );
    assert!(!out.exists());

    // A checkpoint without tokenizer.json: refused, unless --no-tokenizer.
    let bare = w.join("bare-checkpoint");
    fs::create_dir_all(&bare).unwrap();
    for f in ["config.json", "model.safetensors"] {
        fs::copy(checkpoint_dir().join(f), bare.join(f)).unwrap();
    }
    let build = synthetic_build(&w.join("bare"), &[], 0);
    let hf = ["--hf-dir", s(&bare)];
    let e = stderr(&run(&package_args(&build, "two", &private, &out, &hf)));
    assert!(
        e.contains(&format!("{}", bare.join("tokenizer.json").display()))
            && e.contains("--no-tokenizer"),
        "{e}"
    );
    assert!(!out.exists());
    let mut args = hf.to_vec();
    args.push("--no-tokenizer");
    ok(&package_args(&build, "two", &private, &out, &args));
    assert!(!out.join("hf_model/tokenizer.json").exists());
    assert!(out.join("hf_model/config.json").exists());
    assert!(out.join("swa/cos_full.npy").exists());
}

/// Extracts `zip` the way the app's iOS extractor does
/// (ModelDownloader.swift's `extractZipNative`): the end record found from
/// the end, then per central directory record `uncompSize` raw bytes copied
/// from its local header's data offset, never inflated. Returns (name,
/// compression method, bytes) per entry.
fn extract_the_apps_way(zip: &Path) -> Vec<(String, u16, Vec<u8>)> {
    let data = fs::read(zip).unwrap();
    let u16_at = |p: usize| u16::from_le_bytes([data[p], data[p + 1]]) as usize;
    let u32_at = |p: usize| u32::from_le_bytes(data[p..p + 4].try_into().unwrap()) as usize;
    let mut eocd = data.len() - 22;
    while data[eocd..eocd + 4] != [0x50, 0x4B, 0x05, 0x06] {
        eocd -= 1;
    }
    let (mut pos, count) = (u32_at(eocd + 16), u16_at(eocd + 10));
    let mut out = Vec::new();
    for _ in 0..count {
        assert_eq!(data[pos..pos + 2], [0x50, 0x4B]);
        let method = u16_at(pos + 10) as u16;
        let size = u32_at(pos + 24);
        let (name_len, extra_len, comment_len) =
            (u16_at(pos + 28), u16_at(pos + 30), u16_at(pos + 32));
        let local = u32_at(pos + 42);
        let name = String::from_utf8(data[pos + 46..pos + 46 + name_len].to_vec()).unwrap();
        let start = local + 30 + u16_at(local + 26) + u16_at(local + 28);
        out.push((name, method, data[start..start + size].to_vec()));
        pos += 46 + name_len + extra_len + comment_len;
    }
    out
}

/// `--zip` stores every entry: extracted the app's way (raw bytes, no
/// inflate) the archive is the folder byte for byte, every file of it and
/// nothing else, and model_signing still verifies the folder.
#[test]
fn zip_extracted_the_apps_way_is_the_release_folder() {
    let r = release("zip-app");
    let entries = extract_the_apps_way(&r.zip);
    let mut on_disk: Vec<String> = walkdir::WalkDir::new(&r.dir)
        .into_iter()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().is_file())
        .map(|e| {
            e.path()
                .strip_prefix(&r.dir)
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    on_disk.sort();
    let mut names: Vec<String> = entries.iter().map(|(n, _, _)| n.clone()).collect();
    names.sort();
    assert_eq!(names, on_disk);
    // Text files too (they deflate well, and were deflated before).
    assert!(names.contains(&"manifest.json".to_string()));
    assert!(names.contains(&"hf_model/tokenizer.json".to_string()));
    for (name, method, bytes) in &entries {
        assert_eq!(*method, 0, "{name}: not stored");
        assert!(
            *bytes == fs::read(r.dir.join(name)).unwrap(),
            "{name}: differs from the folder once extracted the app's way"
        );
    }
    let o = ms_verify(&r.dir, &r.public);
    assert!(o.status.success(), "model_signing: {}", stderr(&o));
    let o = cf_verify(&r.dir, &r.public);
    assert!(o.status.success(), "verify: {}", stderr(&o));
}

/// With `--base-url`, `distribution.json` (upstream build_hf_release.py's
/// per-file format) lists every file of the folder at its repository path
/// with its URL, size and SHA-256 (all but manifest.json, model.sig and
/// itself, which cannot carry their own digests); it is listed in
/// manifest.json, signed, and valid against its schema.
#[test]
fn distribution_json_agrees_with_the_folder() {
    let work = tempdir("distribution");
    let build = synthetic_build(&work.join("build"), &[], 0);
    let (private, public) = keys(&work, "k");
    let out = work.join("rel");
    let base = "https://huggingface.co/org/gemma-coreml/resolve/main";
    ok(&[
        "package",
        s(&build),
        "--layout",
        "two",
        "--key",
        s(&private),
        "--output",
        s(&out),
        "--version",
        "2.0.0",
        "--model-id",
        "gemma-e2b-test",
        "--base-url",
        &format!("{base}/"),
    ]);
    let d: Value =
        serde_json::from_slice(&fs::read(out.join("distribution.json")).unwrap()).unwrap();
    assert_eq!(d["mode"], "per-file");
    assert_eq!(d["version"], "2.0.0");
    // Upstream's model_id: the repository's name, not the release's id.
    assert_eq!(d["model_id"], "gemma-coreml");
    assert_eq!(d["repo"], "org/gemma-coreml");
    assert_eq!(d["branch"], "main");
    let mut want: Vec<String> = walkdir::WalkDir::new(&out)
        .into_iter()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().is_file())
        .map(|e| {
            e.path()
                .strip_prefix(&out)
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|p| !["manifest.json", "model.sig", "distribution.json"].contains(&p.as_str()))
        .collect();
    want.sort();
    let files = d["files"].as_array().unwrap();
    let mut listed: Vec<String> = files
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_string())
        .collect();
    listed.sort();
    assert_eq!(listed, want);
    assert!(listed.contains(&"swa/chunk1.mlpackage/Manifest.json".to_string()));
    assert!(listed.contains(&"swa/cos_full.npy".to_string()));
    let mut total = 0;
    for f in files {
        let path = f["path"].as_str().unwrap();
        let bytes = fs::read(out.join(path)).unwrap();
        assert_eq!(f["size_bytes"], bytes.len(), "{path}");
        assert_eq!(
            f["sha256"],
            format!("{:x}", Sha256::digest(&bytes)),
            "{path}"
        );
        assert_eq!(f["url"], format!("{base}/{path}"), "{path}");
        total += bytes.len();
    }
    assert_eq!(d["total_size"], total);
    let m = manifest(&out);
    let entry = m["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "distribution.json")
        .expect("manifest.json lists distribution.json");
    assert_eq!(entry["roles"], json!(["distribution"]));
    let o = validate_with(
        "manifests/distribution.schema.json",
        &out.join("distribution.json"),
    );
    assert!(o.status.success(), "schema: {}", stdout(&o));
    let o = cf_verify(&out, &public);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = ms_verify(&out, &public);
    assert!(o.status.success(), "model_signing: {}", stderr(&o));
    // Without --base-url there are no URLs, so no distribution manifest.
    let plain = work.join("plain");
    ok(&[
        "package",
        s(&build),
        "--layout",
        "two",
        "--key",
        s(&private),
        "--output",
        s(&plain),
    ]);
    assert!(!plain.join("distribution.json").exists());
}
