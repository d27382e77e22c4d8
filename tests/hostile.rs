//! Hostile inputs (issue 49): every command that takes an input folder is
//! run on it made hostile in three ways (names that are not one plain path
//! component, symlinks out of the folder, manifest paths leaving it), each
//! run confined (`common::run_confined`: the whole file system read-only but
//! the output's folder) and the work area snapshotted before and after, so a
//! write anywhere but the output fails or shows. Then one test per point of
//! the issue: `--onto` verifying DIR's signature and weights, `--hf-dir`'s
//! weights, `--materialize` and `--zip` kept out of their inputs,
//! interrupts, parity on non-finite values, the zip limits, `--base-url`,
//! messages naming the right file, leftovers.
//!
//! Synthetic builds (`common::synthetic`) stand in for real ones: packaging
//! them takes well under a second.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::synthetic::{keys, synthetic_build, synthetic_build_of};
use common::{copy_tree, json_file, ok, run_confined, stderr, stdout, tempdir};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A name that is one component on Linux and four on Windows, and four
/// `..` once a backslash is read as `/`.
const ESCAPE: &str = "..\\..\\..\\..\\escaped";

/// What every hostile input tries to put into a release.
const SECRET: &str = "SECRET-49-do-not-ship";

/// A work area: inputs under `in/` (read-only to a confined command),
/// outputs under `out/` (the only folder it may write besides `tmp/`, its
/// TMPDIR), a secret file beside them.
struct Area {
    work: PathBuf,
    inp: PathBuf,
    out: PathBuf,
    tmp: PathBuf,
    secret: PathBuf,
}

fn area(tag: &str) -> Area {
    let work = tempdir(&format!("hostile-{tag}"));
    let (inp, out, tmp) = (work.join("in"), work.join("out"), work.join("tmp"));
    for d in [&inp, &out, &tmp] {
        fs::create_dir_all(d).unwrap();
    }
    let secret = work.join("secret.txt");
    fs::write(&secret, SECRET).unwrap();
    Area {
        work,
        inp,
        out,
        tmp,
        secret,
    }
}

/// What may stay in TMPDIR after a run: the empty cache folder torch makes
/// when it is imported (`torchinductor_USER`), nothing of chunkforge's.
fn torch_cache(rel: &str) -> bool {
    rel.strip_prefix("tmp/")
        .is_some_and(|n| n.starts_with("torchinductor_") && !n.contains('/'))
}

/// Every entry below `root` by relative path: a file's SHA-256, `dir`, or a
/// link's target.
fn snapshot(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for e in walkdir::WalkDir::new(root).min_depth(1) {
        let e = e.unwrap();
        let rel = e
            .path()
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let what = if e.file_type().is_symlink() {
            format!("link {}", fs::read_link(e.path()).unwrap().display())
        } else if e.file_type().is_dir() {
            "dir".to_string()
        } else {
            format!("{:x}", Sha256::digest(fs::read(e.path()).unwrap()))
        };
        out.insert(rel, what);
    }
    out
}

/// Runs `args` confined to `a.out` and asserts that nothing in the work
/// area changed but what lies under `a.out/<output>` (None: nothing at all).
fn confined(a: &Area, args: &[&str], output: Option<&str>) -> Output {
    let before = snapshot(&a.work);
    let o = run_confined(args, &[&a.tmp, &a.out]);
    let after = snapshot(&a.work);
    // The output, the files named after it (`--zip OUT.zip`, keygen's
    // KEY.pem and KEY.pub) and its lock file (emptied, kept for the next run).
    let allowed = |rel: &str| {
        output.is_some_and(|name| {
            let own = format!("out/{name}");
            rel == own
                || rel.starts_with(&format!("{own}/"))
                || rel.starts_with(&format!("{own}."))
                || rel == format!("out/.{name}.chunkforge-lock")
        })
    };
    let changed: Vec<&String> = before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k) && !allowed(k) && !torch_cache(k))
        .collect();
    assert!(
        changed.is_empty(),
        "chunkforge {args:?} changed {changed:?} outside its output\n{}",
        stderr(&o)
    );
    o
}

/// Asserts a refusal (exit `code`) whose message says every one of `says`.
fn refused(o: &Output, code: i32, says: &[&str], what: &str) {
    let text = format!("{}{}", stdout(o), stderr(o));
    assert_eq!(o.status.code(), Some(code), "{what}: {text}");
    for s in says {
        assert!(text.contains(s), "{what}: expected `{s}` in:\n{text}");
    }
    assert!(
        !text.contains("Read-only file system"),
        "{what}: it tried to write outside its output:\n{text}"
    );
}

/// The inputs the tests make hostile, each made once per area: a synthetic
/// build of every layout, its release (layout two), a build of the merged
/// layouts alone for `--onto`, and the key pair.
struct Inputs {
    build: PathBuf,
    both: PathBuf,
    release: PathBuf,
    private: PathBuf,
    public: PathBuf,
}

fn inputs(a: &Area) -> Inputs {
    let (private, public) = keys(&a.work, "k");
    let build = synthetic_build(&a.inp.join("build"), &[], 0);
    let both = synthetic_build_of(&a.inp.join("both"), &["two", "one"]);
    let release = a.inp.join("release");
    ok(&[
        "package",
        s(&build),
        "--layout",
        "two",
        "--key",
        s(&private),
        "--output",
        s(&release),
    ]);
    Inputs {
        build,
        both,
        release,
        private,
        public,
    }
}

/// `package BUILD --layout two` into `out/rel`, with `extra`.
fn package_args<'a>(
    build: &'a Path,
    key: &'a Path,
    out: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut v = vec![
        "package",
        s(build),
        "--layout",
        "two",
        "--key",
        s(key),
        "--output",
        s(out),
    ];
    v.extend_from_slice(extra);
    v
}

/// Signs the release folder `dir` again as it now is (every file, the
/// manifest as edited), with `key`: a hostile manifest its signer made.
fn resign(dir: &Path, key: &Path) {
    let _ = fs::remove_file(dir.join("model.sig"));
    let files: Vec<(String, chunkforge::hashing::FileDigest)> =
        chunkforge::hashing::file_digests(dir)
            .unwrap()
            .into_iter()
            .collect();
    let mut files = files;
    files.sort_by(|a, b| chunkforge::hashing::cmp_components(&a.0, &b.0));
    let key = chunkforge::sign::load_private_key(key).unwrap();
    let name = dir.file_name().unwrap().to_str().unwrap();
    chunkforge::package::sign_into(dir, name, &key, &files, None).unwrap();
}

fn edit_manifest(dir: &Path, f: impl FnOnce(&mut Value)) {
    let path = dir.join("manifest.json");
    let mut m = json_file(&path);
    f(&mut m);
    fs::write(&path, serde_json::to_string_pretty(&m).unwrap() + "\n").unwrap();
}

/// A `.mlpackage` folder whose Manifest.json names its root item at `item`.
fn package_naming(dir: &Path, item: &str) -> PathBuf {
    let pkg = dir.join("hostile.mlpackage");
    fs::create_dir_all(pkg.join("Data/com.apple.CoreML")).unwrap();
    let manifest = json!({
        "fileFormatVersion": "1.0.0",
        "itemInfoEntries": {"A": {"author": "com.apple.CoreML", "description": "CoreML Model Specification", "name": "model.mlmodel", "path": item}},
        "rootModelIdentifier": "A",
    });
    fs::write(pkg.join("Manifest.json"), manifest.to_string()).unwrap();
    fs::write(pkg.join("Data/com.apple.CoreML/model.mlmodel"), b"spec").unwrap();
    pkg
}

/// The commands that read a build folder's packages without writing: each
/// as (what, args). `pkg` is one package folder of `build`, `ck` the
/// checkpoint, `out` the only writable folder.
fn package_readers(
    build: &Path,
    pkg: &Path,
    ck: &Path,
    out: &Path,
) -> Vec<(&'static str, Vec<String>)> {
    let v = |a: &[&str]| a.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    // exec's inputs: an empty .npz (an empty zip) beside the build.
    let inputs = build.parent().unwrap().join("in.npz");
    if !inputs.exists() {
        let mut eocd = b"PK\x05\x06".to_vec();
        eocd.extend([0u8; 18]);
        fs::write(&inputs, eocd).unwrap();
    }
    vec![
        ("audit", v(&["audit", s(build)])),
        ("inspect", v(&["inspect", s(pkg)])),
        (
            "exec",
            v(&[
                "exec",
                s(pkg),
                "--inputs",
                s(&inputs),
                "--output",
                s(&out.join("o.npz")),
            ]),
        ),
        (
            "parity --artifacts",
            v(&[
                "parity",
                "--hf-dir",
                s(ck),
                "--artifacts",
                s(build),
                "--mode",
                "two",
                "--steps",
                "1",
            ]),
        ),
        (
            "build --check",
            v(&["build", "--hf-dir", s(ck), "--check", s(build)]),
        ),
    ]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

// ------------------------------------------------------------ the three classes

/// A file name that is not one plain path component (here `..\..\..\..\escaped`,
/// a plain file on Linux) in any folder a command walks is refused, naming
/// it, before anything is written: it is never read as the path `../../..`.
#[test]
fn names_that_are_not_plain_components_are_refused_by_every_command_that_walks_a_folder() {
    let a = area("names");
    let i = inputs(&a);
    let plant = |dir: &Path| {
        fs::write(dir.join(ESCAPE), SECRET).unwrap();
    };
    let says = [ESCAPE, "backslash"];

    // package: a build folder's package.
    plant(&i.build.join("merged_chunk1.mlpackage"));
    let rel = a.out.join("rel");
    let o = confined(
        &a,
        &package_args(&i.build, &i.private, &rel, &[]),
        Some("rel"),
    );
    refused(&o, 2, &says, "package");
    assert!(!rel.exists());
    fs::remove_file(i.build.join("merged_chunk1.mlpackage").join(ESCAPE)).unwrap();

    // package --onto: a carried package of the release.
    let onto = a.inp.join("onto");
    copy_tree(&i.release, &onto);
    plant(&onto.join("swa/chunk1.mlpackage"));
    let o = confined(
        &a,
        &package_args(&i.both, &i.private, &rel, &["--onto", s(&onto)]),
        Some("rel"),
    );
    refused(&o, 2, &says, "package --onto");

    // verify: an unsigned `swa\cos_full.npy` holding the signed file's bytes
    // is neither hashed for `swa/cos_full.npy` nor let through.
    let rel2 = a.inp.join("release2");
    copy_tree(&i.release, &rel2);
    fs::copy(
        rel2.join("swa/cos_full.npy"),
        rel2.join("swa\\cos_full.npy"),
    )
    .unwrap();
    let o = confined(
        &a,
        &["verify", s(&rel2), "--public-key", s(&i.public)],
        None,
    );
    refused(&o, 1, &["swa\\cos_full.npy", "backslash"], "verify");

    // run and client-check (--materialize) read the release.
    let o = confined(
        &a,
        &["run", s(&onto), "--prompt", "hi", "--max-tokens", "1"],
        None,
    );
    refused(&o, 2, &says, "run");
    let m = a.out.join("m");
    let o = confined(
        &a,
        &[
            "client-check",
            s(&onto),
            "--client",
            "main",
            "--multimodal",
            "off",
            "--materialize",
            s(&m),
        ],
        Some("m"),
    );
    refused(&o, 2, &says, "client-check --materialize");
    assert!(!m.exists());

    // The package readers: refused before Python reads a byte.
    let pkg = i.build.join("merged_chunk2.mlpackage");
    plant(&pkg);
    let ck = common::synthetic::checkpoint_dir();
    for (what, args) in package_readers(&i.build, &pkg, &ck, &a.out) {
        let o = confined(&a, &strs(&args), None);
        refused(&o, 2, &says, what);
    }
    fs::remove_file(pkg.join(ESCAPE)).unwrap();

    // A checkpoint's shard index naming a shard that is not a plain name.
    let hf = a.inp.join("ckpt");
    copy_tree(&ck, &hf);
    fs::write(
        hf.join("model.safetensors.index.json"),
        json!({"weight_map": {"model.norm.weight": "..\\..\\model.safetensors"}}).to_string(),
    )
    .unwrap();
    let o = confined(
        &a,
        &package_args(&i.build, &i.private, &rel, &["--hf-dir", s(&hf)]),
        Some("rel"),
    );
    refused(
        &o,
        2,
        &["..\\..\\model.safetensors", "not a plain file name"],
        "package --hf-dir",
    );

    // --encoders-from reads the app's encoder files by name alone: a name
    // beside them is not read, and not shipped.
    let enc = a.inp.join("enc");
    copy_tree(&common::encoder_bundle(), &enc);
    plant(&enc.join("vision.mlmodelc"));
    let o = confined(
        &a,
        &package_args(&i.build, &i.private, &rel, &["--encoders-from", s(&enc)]),
        Some("rel"),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!snapshot(&rel).keys().any(|k| k.contains("escaped")));
}

/// A symlink in an input folder is never followed out of it: a build's, a
/// release's or a bundle's (a file, or a folder such as `hf_model/` or an
/// encoder's), a package's; a checkpoint's only into the folder or a
/// Hugging Face snapshot's `blobs/`. Nothing of the secret it points at
/// reaches an output.
#[test]
fn links_out_of_an_input_folder_are_refused_by_every_command() {
    let a = area("links");
    let i = inputs(&a);
    let rel = a.out.join("rel");
    let secret_dir = a.work.join("secret-dir");
    fs::create_dir_all(&secret_dir).unwrap();
    fs::write(secret_dir.join("config.json"), SECRET).unwrap();
    let never_shipped = |what: &str| {
        if rel.exists() {
            for (k, _) in snapshot(&rel) {
                let p = rel.join(&k);
                if p.is_file() {
                    let bytes = fs::read(&p).unwrap();
                    assert!(
                        !bytes.windows(SECRET.len()).any(|w| w == SECRET.as_bytes()),
                        "{what}: the secret reached {k}"
                    );
                }
            }
        }
    };

    // package: a link in a build's package.
    let blob = i
        .build
        .join("merged_chunk1.mlpackage/Data/com.apple.CoreML/extra.bin");
    symlink(&a.secret, &blob).unwrap();
    let o = confined(
        &a,
        &package_args(&i.build, &i.private, &rel, &[]),
        Some("rel"),
    );
    refused(&o, 2, &["extra.bin", "is a symlink"], "package");
    fs::remove_file(&blob).unwrap();

    // package --onto a release: a link in hf_model/.
    let onto = a.inp.join("onto");
    copy_tree(&i.release, &onto);
    symlink(&a.secret, onto.join("hf_model/chat_template.jinja")).unwrap();
    let o = confined(
        &a,
        &package_args(&i.both, &i.private, &rel, &["--onto", s(&onto)]),
        Some("rel"),
    );
    refused(
        &o,
        2,
        &["chat_template.jinja", "is a symlink"],
        "package --onto a release",
    );
    never_shipped("--onto a release");

    // package --onto an upstream bundle whose hf_model/ folder is a link.
    let bundle = a.inp.join("bundle");
    copy_tree(&i.release, &bundle);
    fs::remove_file(bundle.join("manifest.json")).unwrap();
    fs::remove_file(bundle.join("model.sig")).unwrap();
    fs::rename(
        bundle.join("swa/chunk1.mlpackage"),
        bundle.join("swa/chunk1.mlmodelc"),
    )
    .unwrap();
    fs::remove_dir_all(bundle.join("hf_model")).unwrap();
    symlink(&secret_dir, bundle.join("hf_model")).unwrap();
    let o = confined(
        &a,
        &package_args(&i.both, &i.private, &rel, &["--onto", s(&bundle)]),
        Some("rel"),
    );
    refused(
        &o,
        2,
        &["hf_model", "is a symlink"],
        "package --onto a bundle",
    );
    never_shipped("--onto a bundle");

    // --encoders-from: an encoder's folder linked from elsewhere.
    let enc = a.inp.join("enc");
    copy_tree(&common::encoder_bundle(), &enc);
    let moved = a.work.join("vision-elsewhere.mlmodelc");
    fs::rename(enc.join("vision.mlmodelc"), &moved).unwrap();
    fs::write(moved.join("coremldata.bin"), SECRET).unwrap();
    symlink(&moved, enc.join("vision.mlmodelc")).unwrap();
    let o = confined(
        &a,
        &package_args(&i.build, &i.private, &rel, &["--encoders-from", s(&enc)]),
        Some("rel"),
    );
    refused(
        &o,
        2,
        &["vision.mlmodelc", "is a symlink"],
        "--encoders-from",
    );
    never_shipped("--encoders-from");

    // --hf-dir: a tokenizer file linked out of the checkpoint folder.
    let ck = common::synthetic::checkpoint_dir();
    let hf = a.inp.join("ckpt");
    copy_tree(&ck, &hf);
    fs::remove_file(hf.join("tokenizer_config.json")).unwrap();
    symlink(&a.secret, hf.join("tokenizer_config.json")).unwrap();
    let o = confined(
        &a,
        &package_args(&i.build, &i.private, &rel, &["--hf-dir", s(&hf)]),
        Some("rel"),
    );
    refused(
        &o,
        2,
        &["tokenizer_config.json", "outside the checkpoint folder"],
        "--hf-dir",
    );
    never_shipped("--hf-dir");
    // ... and side-files and plan read the checkpoint the same way.
    fs::remove_file(hf.join("config.json")).unwrap();
    symlink(secret_dir.join("config.json"), hf.join("config.json")).unwrap();
    let o = confined(&a, &["plan", "--hf-dir", s(&hf), "--mode", "two"], None);
    refused(
        &o,
        2,
        &["config.json", "outside the checkpoint folder"],
        "plan --hf-dir",
    );
    let side = a.out.join("side");
    let o = confined(
        &a,
        &["side-files", "--hf-dir", s(&hf), "--output", s(&side)],
        Some("side"),
    );
    refused(
        &o,
        2,
        &["config.json", "outside the checkpoint folder"],
        "side-files --hf-dir",
    );
    assert!(!side.exists());

    // verify, run, client-check: a link in the release.
    let linked = a.inp.join("linked");
    copy_tree(&i.release, &linked);
    symlink(&a.secret, linked.join("swa/chunk1.mlpackage/extra")).unwrap();
    let o = confined(
        &a,
        &["verify", s(&linked), "--public-key", s(&i.public)],
        None,
    );
    refused(&o, 1, &["extra", "is a symlink"], "verify");
    let o = confined(
        &a,
        &["run", s(&linked), "--prompt", "hi", "--max-tokens", "1"],
        None,
    );
    refused(&o, 2, &["extra", "is a symlink"], "run");
    let m = a.out.join("m");
    let o = confined(
        &a,
        &[
            "client-check",
            s(&linked),
            "--client",
            "main",
            "--multimodal",
            "off",
            "--materialize",
            s(&m),
        ],
        Some("m"),
    );
    refused(
        &o,
        2,
        &["extra", "is a symlink"],
        "client-check --materialize",
    );
    assert!(!m.exists());

    // The package readers.
    let pkg = i.build.join("merged_chunk2.mlpackage");
    symlink(&a.secret, pkg.join("Data/extra")).unwrap();
    for (what, args) in package_readers(&i.build, &pkg, &ck, &a.out) {
        let o = confined(&a, &strs(&args), None);
        refused(&o, 2, &["extra", "is a symlink"], what);
    }
}

/// Every path a manifest states stays in its folder: `manifest.json`'s
/// `chunks[].file` (signed by the release's own key, so the signature
/// alone does not catch it) for `verify`, `run`, `client-check` and
/// `--onto`; an `.mlpackage`'s `Manifest.json` item path for the commands
/// that read packages.
#[test]
fn manifest_paths_leaving_the_folder_are_refused_by_every_command() {
    let a = area("manifest-paths");
    let i = inputs(&a);
    // A package outside the release, where a hostile chunk file points.
    let outside = a.inp.join("outside.mlpackage");
    copy_tree(&i.release.join("merged_chunk1.mlpackage"), &outside);
    for (tag, file) in [
        ("dotdot", "../outside.mlpackage"),
        ("absolute", s(&outside)),
        ("other", "swa/chunk2.mlpackage"),
    ] {
        let r = a.inp.join(format!("release-{tag}"));
        copy_tree(&i.release, &r);
        edit_manifest(&r, |m| {
            for c in m["chunks"].as_array_mut().unwrap() {
                if c["name"] == "merged_chunk1" {
                    c["file"] = json!(file);
                }
            }
        });
        resign(&r, &i.private);
        let o = confined(&a, &["verify", s(&r), "--public-key", s(&i.public)], None);
        refused(&o, 1, &["chunks[", "file", file], &format!("verify {tag}"));
        let o = confined(
            &a,
            &["run", s(&r), "--prompt", "hi", "--max-tokens", "1"],
            None,
        );
        refused(&o, 2, &["chunks[", file], &format!("run {tag}"));
        let o = confined(
            &a,
            &[
                "client-check",
                s(&r),
                "--client",
                "main",
                "--multimodal",
                "off",
            ],
            None,
        );
        refused(&o, 2, &["chunks[", file], &format!("client-check {tag}"));
        let rel = a.out.join("rel");
        let o = confined(
            &a,
            &package_args(&i.both, &i.private, &rel, &["--onto", s(&r)]),
            Some("rel"),
        );
        refused(&o, 2, &["chunks[", file], &format!("package --onto {tag}"));
    }
    // An .mlpackage whose Manifest.json item leaves the package.
    let ck = common::synthetic::checkpoint_dir();
    for (tag, item) in [
        ("dotdot", "../../../secret.txt".to_string()),
        ("absolute", s(&a.secret).to_string()),
    ] {
        let dir = a.inp.join(format!("pkgs-{tag}"));
        let pkg = package_naming(&dir, &item);
        for (what, args) in package_readers(&dir, &pkg, &ck, &a.out)
            .into_iter()
            .filter(|(w, _)| ["inspect", "exec"].contains(w))
        {
            let o = confined(&a, &strs(&args), None);
            refused(
                &o,
                2,
                &["Manifest.json", "leaves the package"],
                &format!("{what} {tag}"),
            );
        }
    }
}

// ------------------------------------------------------------ each point

/// The manifest of the release `dir`.
fn manifest(dir: &Path) -> Value {
    json_file(&dir.join("manifest.json"))
}

/// `package BOTH --layout two --onto DIR` into a new `out/NAME`, with
/// `extra`: (output, run).
fn onto(a: &Area, i: &Inputs, dir: &Path, name: &str, extra: &[&str]) -> (PathBuf, Output) {
    let out = a.out.join(name);
    let mut args = package_args(&i.both, &i.private, &out, &["--onto", s(dir)]);
    args.extend_from_slice(extra);
    let o = confined(a, &args, Some(name));
    (out, o)
}

/// Point 2: `--onto DIR` carries a release only once its signature and every
/// file verify, with `--onto-public-key` or the key of `--key`; an edited
/// `hf_model/` file, an added one, flipped weight bytes with the manifest
/// made to agree: each refused, nothing written. `--allow-unverified-onto`
/// carries it unverified, each file checked against DIR's own manifest, and
/// the new manifest says so.
#[test]
fn onto_carries_a_release_only_once_it_verifies() {
    let a = area("onto-verify");
    let i = inputs(&a);
    let hint = |public: &Path| {
        let pem = fs::read(public).unwrap();
        format!("{:x}", Sha256::digest(pem))
    };

    // As it was signed: verified with the key of --key.
    let (out, o) = onto(&a, &i, &i.release, "plain", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = manifest(&out);
    assert_eq!(m["onto"]["verified"], true);
    assert_eq!(m["onto"]["public_key_sha256"], json!(hint(&i.public)));
    ok(&["verify", s(&out), "--public-key", s(&i.public)]);

    // Signed by another key than --key's: refused, unless its key is given.
    let (other, other_pub) = keys(&a.work, "other");
    let other_out = a.out.join("other");
    let mut args = package_args(&i.both, &other, &other_out, &["--onto", s(&i.release)]);
    let o = confined(&a, &args, Some("other"));
    refused(
        &o,
        2,
        &[
            "does not verify with the public key of --key",
            "--onto-public-key",
        ],
        "another key",
    );
    args.extend_from_slice(&["--onto-public-key", s(&i.public)]);
    let o = confined(&a, &args, Some("other"));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        manifest(&a.out.join("other"))["onto"]["public_key_sha256"],
        json!(hint(&i.public))
    );
    let _ = other_pub;

    // Edited, added, flipped with the manifest made to agree: refused.
    let edited = a.inp.join("edited");
    copy_tree(&i.release, &edited);
    fs::write(
        edited.join("hf_model/generation_config.json"),
        "{\"temperature\": 9}\n",
    )
    .unwrap();
    let (out, o) = onto(&a, &i, &edited, "edited", &[]);
    refused(
        &o,
        2,
        &[
            "does not verify",
            "hf_model/generation_config.json: changed",
        ],
        "edited",
    );
    assert!(!out.exists());
    let added = a.inp.join("added");
    copy_tree(&i.release, &added);
    fs::write(added.join("hf_model/chat_template.jinja"), "{{ secret }}").unwrap();
    let (_, o) = onto(&a, &i, &added, "added", &[]);
    refused(
        &o,
        2,
        &[
            "does not verify",
            "hf_model/chat_template.jinja: extra file",
        ],
        "added",
    );
    // Changed bytes in a carried package, with DIR's manifest (file digest,
    // package tree) made to agree.
    let flip = |name: &str, file: &str| {
        let dir = a.inp.join(name);
        copy_tree(&i.release, &dir);
        let mut bytes = fs::read(dir.join(file)).unwrap();
        bytes[10] ^= 0xff;
        fs::write(dir.join(file), &bytes).unwrap();
        let sha = format!("{:x}", Sha256::digest(&bytes));
        let tree = common::synthetic::tree_digest(&dir.join("swa/chunk3.mlpackage"));
        edit_manifest(&dir, |m| {
            for f in m["files"].as_array_mut().unwrap() {
                if f["path"] == file {
                    f["sha256"] = json!(sha);
                }
            }
            for c in m["chunks"].as_array_mut().unwrap() {
                if c["name"] == "chunk3" {
                    c["sha256_tree"] = json!(tree);
                }
            }
        });
        dir
    };
    let blob = "swa/chunk3.mlpackage/Data/com.apple.CoreML/weights/weight.bin";
    let flipped = flip("flipped", blob);
    let (_, o) = onto(&a, &i, &flipped, "flipped", &[]);
    refused(
        &o,
        2,
        &["does not verify", &format!("{blob}: changed")],
        "flipped",
    );

    // Unverified on request: the manifest made to agree passes its checks
    // and is recorded as unverified; a file DIR's manifest does not list is
    // still refused. (The blob is shared with prefill_chunk3, whose own
    // copy stayed: the weights' own program is edited instead.)
    let spec = flip(
        "respecced",
        "swa/chunk3.mlpackage/Data/com.apple.CoreML/model.mlmodel",
    );
    let (out, o) = onto(&a, &i, &spec, "unverified", &["--allow-unverified-onto"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("its signature is not verified (--allow-unverified-onto)"));
    let m = manifest(&out);
    assert_eq!(m["onto"]["verified"], false);
    assert!(m["onto"].get("public_key_sha256").is_none());
    let (_, o) = onto(&a, &i, &added, "added2", &["--allow-unverified-onto"]);
    refused(
        &o,
        2,
        &["hf_model/chat_template.jinja: not listed in"],
        "added, unverified",
    );
}

/// Point 3: `--onto` a release of other weights with the same config.json (its
/// manifest's weights digest is not build.json's) is refused, naming both.
#[test]
fn onto_a_release_of_other_weights_is_refused() {
    let a = area("onto-weights");
    let i = inputs(&a);
    let other = a.inp.join("other");
    copy_tree(&i.release, &other);
    edit_manifest(&other, |m| {
        m["model"]["weights_sha256"] = json!("ab".repeat(32))
    });
    resign(&other, &i.private);
    let (out, o) = onto(&a, &i, &other, "rel", &[]);
    refused(
        &o,
        2,
        &[
            "model.weights_sha256 is abab",
            "build.json",
            "other weights",
        ],
        "other weights",
    );
    assert!(!out.exists());
}

/// Point 4: `package --hf-dir` of a checkpoint with the build's config.json and
/// other weights is refused, naming the weights file: its side files would
/// be another model's, beside a parity verdict about the build's.
#[test]
fn hf_dir_of_other_weights_is_refused() {
    let a = area("hf-weights");
    let i = inputs(&a);
    let hf = a.inp.join("ckpt");
    copy_tree(&common::synthetic::checkpoint_dir(), &hf);
    let file = hf.join("model.safetensors");
    let (h, mut data) = common::read_safetensors(&file);
    let at = h["model.norm.weight"]["data_offsets"][0].as_u64().unwrap() as usize;
    let v = f32::from_le_bytes(data[at..at + 4].try_into().unwrap());
    data[at..at + 4].copy_from_slice(&(v * 1.5 + 0.25).to_le_bytes());
    common::write_safetensors(&file, &h, &data);
    let out = a.out.join("rel");
    let o = confined(
        &a,
        &package_args(&i.build, &i.private, &out, &["--hf-dir", s(&hf)]),
        Some("rel"),
    );
    refused(
        &o,
        2,
        &["not the weights", "build.json", "model.safetensors"],
        "other weights",
    );
    assert!(!out.exists());
}

/// An upstream bundle of the synthetic release: compiled packages (text
/// MIL stating each contract), no manifest, no signature.
fn bundle_of(a: &Area, i: &Inputs, name: &str) -> PathBuf {
    let b = a.inp.join(name);
    common::stand_in_bundle(&i.release, &b);
    b
}

/// Points 2, 9 and 14: `--onto` an upstream bundle carries its packages alone (their
/// contracts checked; said in a note, recorded as unverified), the side
/// files and hf_model/ made from the checkpoint: a config.json that differs
/// from the build's in its bytes alone is not shipped, so the manifest's
/// digest holds. A bundle missing a blob it shares into a prefill package
/// names that blob.
#[test]
fn onto_a_bundle_carries_only_what_the_contracts_check() {
    let a = area("onto-bundle");
    let i = inputs(&a);
    let b = bundle_of(&a, &i, "bundle");
    let config = b.join("hf_model/config.json");
    let pretty = serde_json::to_string_pretty(&json_file(&config)).unwrap() + "\n\n";
    fs::write(&config, pretty).unwrap();
    fs::write(b.join("hf_model/chat_template.jinja"), "{{ unchecked }}").unwrap();
    let (out, o) = onto(&a, &i, &b, "rel", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("only its packages are carried"),
        "{}",
        stderr(&o)
    );
    let m = manifest(&out);
    assert_eq!(m["onto"]["upstream"], true);
    assert_eq!(m["onto"]["verified"], false);
    for f in m["files"].as_array().unwrap() {
        let path = f["path"].as_str().unwrap();
        assert_eq!(
            f["carried"].as_bool().unwrap_or(false),
            path.contains(".mlmodelc/"),
            "{path}"
        );
    }
    assert!(!out.join("hf_model/chat_template.jinja").exists());
    let shipped = fs::read(out.join("hf_model/config.json")).unwrap();
    assert_eq!(
        shipped,
        fs::read(common::synthetic::checkpoint_dir().join("config.json")).unwrap()
    );
    assert_eq!(
        m["model"]["config_sha256"],
        json!(format!("{:x}", Sha256::digest(&shipped)))
    );
    ok(&["verify", s(&out), "--public-key", s(&i.public)]);

    // The main download fetches prefill/chunk2 without weights: the bundle
    // holds chunk2's blob for it. Without that blob, that is the file named.
    let gone = bundle_of(&a, &i, "no-blob");
    let blob = gone.join("swa/chunk2.mlmodelc/weights/weight.bin");
    fs::remove_file(&blob).unwrap();
    let (_, o) = onto(&a, &i, &gone, "rel2", &[]);
    refused(
        &o,
        2,
        &[&format!("{}: missing", blob.display())],
        "missing chunk2 blob",
    );
}

/// Point 7: `client-check --materialize` into a folder inside the release,
/// directly or through a symlink, is refused and the release still
/// verifies; outside it, the folder is written whole, nothing left beside.
#[test]
fn materialize_never_writes_into_the_release() {
    let a = area("materialize");
    let i = inputs(&a);
    let r = a.out.join("release");
    copy_tree(&i.release, &r);
    let link = a.out.join("link");
    symlink(&r, &link).unwrap();
    for into in [r.join("sub"), link.join("sub")] {
        let o = run_confined(
            &[
                "client-check",
                s(&r),
                "--client",
                "main",
                "--multimodal",
                "off",
                "--materialize",
                s(&into),
            ],
            &[&a.out],
        );
        refused(&o, 2, &["inside the release"], &into.display().to_string());
    }
    ok(&["verify", s(&r), "--public-key", s(&i.public)]);
    let m = a.out.join("m");
    let o = confined(
        &a,
        &[
            "client-check",
            s(&i.release),
            "--client",
            "main",
            "--multimodal",
            "off",
            "--materialize",
            s(&m),
        ],
        Some("m"),
    );
    assert!(m.join("chunk1.mlpackage").is_dir(), "{}", stderr(&o));
}

/// Point 8: `--zip` or `--output` inside the `--onto` folder is refused: that
/// folder is left as it was.
#[test]
fn outputs_inside_the_onto_folder_are_refused() {
    let a = area("zip-in-onto");
    let i = inputs(&a);
    let dir = a.out.join("dir");
    copy_tree(&i.release, &dir);
    let before = snapshot(&dir);
    let zip = dir.join("x.zip");
    for (extra, says) in [
        (
            vec!["--zip", s(&zip)],
            "--zip must not be inside the --onto folder",
        ),
        (vec![], "--output must not be inside the --onto folder"),
    ] {
        let out = if extra.is_empty() {
            dir.join("rel")
        } else {
            a.out.join("rel")
        };
        let mut args = package_args(&i.both, &i.private, &out, &["--onto", s(&dir)]);
        args.extend_from_slice(&extra);
        let o = run_confined(&args, &[&a.out]);
        refused(&o, 2, &[says], says);
    }
    assert_eq!(snapshot(&dir), before);
    ok(&["verify", s(&dir), "--public-key", s(&i.public)]);
}

/// A checkpoint copied from the fixture with `edit` applied to its header
/// and data.
fn edited_checkpoint(a: &Area, name: &str, edit: impl FnOnce(&Value, &mut Vec<u8>)) -> PathBuf {
    let hf = a.inp.join(name);
    copy_tree(&common::synthetic::checkpoint_dir(), &hf);
    let file = hf.join("model.safetensors");
    let (h, mut data) = common::read_safetensors(&file);
    edit(&h, &mut data);
    common::write_safetensors(&file, &h, &data);
    hf
}

fn edited_config(a: &Area, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let hf = a.inp.join(name);
    copy_tree(&common::synthetic::checkpoint_dir(), &hf);
    let mut c = json_file(&hf.join("config.json"));
    edit(&mut c);
    fs::write(
        hf.join("config.json"),
        serde_json::to_string_pretty(&c).unwrap(),
    )
    .unwrap();
    hf
}

/// Point 11: parity on a NaN weight, or on a RoPE theta or a softcap of 1e-300,
/// names the tensor or the config value (as build and side-files do), never
/// an unreadable reply.
#[test]
fn parity_names_the_non_finite_input_it_was_given() {
    let a = area("parity-nan");
    let nan = edited_checkpoint(&a, "nan", |h, data| {
        let at = h["model.layers.0.self_attn.q_proj.weight"]["data_offsets"][0]
            .as_u64()
            .unwrap() as usize;
        data[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    let theta = edited_config(&a, "theta", |c| {
        c["rope_parameters"]["full_attention"]["rope_theta"] = json!(1e-300)
    });
    let cap = edited_config(&a, "cap", |c| c["final_logit_softcapping"] = json!(1e-300));
    for (ck, says) in [
        (
            &nan,
            "weight model.layers.0.self_attn.q_proj.weight has 1 NaN/Inf values",
        ),
        (
            &theta,
            "`rope_parameters.full_attention.rope_theta` is 1e-300",
        ),
        (&cap, "`final_logit_softcapping` is 1e-300"),
    ] {
        let o = confined(
            &a,
            &[
                "parity",
                "--hf-dir",
                s(ck),
                "--mode",
                "two",
                "--steps",
                "1",
                "--verbose",
            ],
            None,
        );
        refused(&o, 2, &[says], says);
        assert!(!stderr(&o).contains("bad reply"), "{}", stderr(&o));
    }
}

/// Adds `n` files of `len` bytes (at least the file's number) to package
/// `pkg` of the synthetic build and records its new tree in build.json.
fn add_files(build: &Path, pkg: &str, n: usize, len: usize) {
    let dir = build.join(format!("{pkg}.mlpackage/Data/many"));
    fs::create_dir_all(&dir).unwrap();
    for k in 0..n {
        let mut bytes = k.to_string().into_bytes();
        bytes.resize(bytes.len().max(len), b'.');
        fs::write(dir.join(format!("f{k}")), bytes).unwrap();
    }
    let tree = common::synthetic::tree_digest(&build.join(format!("{pkg}.mlpackage")));
    let path = build.join("build.json");
    let mut b = json_file(&path);
    for c in b["chunks"].as_array_mut().unwrap() {
        if c["name"] == pkg {
            c["sha256_tree"] = json!(tree);
        }
    }
    fs::write(&path, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
}

/// Point 12: `--zip` at the app extractor's limits: 65,535 entries (0xFFFF, the
/// zip64 mark) is refused before anything is copied, 65,534 is written and
/// verifies; an entry over 4 GiB is refused before the copy, naming the
/// archive the user gave (not a temporary file).
#[test]
fn zip_limits_are_refused_before_the_copy() {
    let a = area("zip-limits");
    let (private, public) = keys(&a.work, "k");
    let build = synthetic_build(&a.inp.join("build"), &[], 0);
    let probe = a.out.join("probe");
    ok(&package_args(&build, &private, &probe, &[]));
    let entries = walkdir::WalkDir::new(&probe)
        .into_iter()
        .filter(|e| e.as_ref().unwrap().file_type().is_file())
        .count();
    fs::remove_dir_all(&probe).unwrap();
    add_files(&build, "merged_chunk1", 65_535 - entries, 0);
    let (out, zip) = (a.out.join("rel"), a.out.join("rel.zip"));
    let o = confined(
        &a,
        &package_args(&build, &private, &out, &["--zip", s(&zip)]),
        Some("rel"),
    );
    refused(
        &o,
        2,
        &[&format!("{}: 65535 entries, over the 65534", zip.display())],
        "65535",
    );
    assert!(!out.exists() && !zip.exists());
    // One fewer: 65,534 entries, written, and read back by verify.
    fs::remove_file(build.join("merged_chunk1.mlpackage/Data/many/f0")).unwrap();
    add_files(&build, "merged_chunk1", 0, 0);
    let o = run_confined(
        &package_args(&build, &private, &out, &["--zip", s(&zip)]),
        &[&a.out],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    ok(&[
        "verify",
        s(&out),
        "--public-key",
        s(&public),
        "--archive",
        s(&zip),
    ]);

    // A 4.1 GiB weight blob (sparse: no disk), refused before the copy.
    let big = synthetic_build(&a.inp.join("big"), &[], 0);
    let blob = big.join("merged_chunk1.mlpackage/Data/com.apple.CoreML/weights/weight.bin");
    fs::OpenOptions::new()
        .write(true)
        .open(&blob)
        .unwrap()
        .set_len(4_400_000_000)
        .unwrap();
    let (out, zip) = (a.out.join("big"), a.out.join("big.zip"));
    let before = names_in(&a.out);
    let t = std::time::Instant::now();
    let o = run_confined(
        &package_args(&big, &private, &out, &["--zip", s(&zip)]),
        &[&a.out],
    );
    let took = t.elapsed();
    refused(
        &o,
        2,
        &[&format!("{}: entry 'merged_chunk1.mlpackage/Data/com.apple.CoreML/weights/weight.bin' is 4.10 GiB", zip.display())],
        "4.1 GiB entry",
    );
    assert!(!stderr(&o).contains(".tmp-"), "{}", stderr(&o));
    assert!(took.as_secs() < 10, "took {took:?}: was it copied?");
    assert_eq!(names_in(&a.out), before);
}

/// Point 13: `--base-url` that cannot serve the files is refused naming the
/// option, before anything is signed.
#[test]
fn base_urls_that_cannot_work_are_refused() {
    let a = area("base-url");
    let (private, _) = keys(&a.work, "k");
    let build = synthetic_build(&a.inp.join("build"), &[], 0);
    let out = a.out.join("rel");
    for (url, says) in [
        ("https://h.example/x#frag", "#fragment"),
        ("https://h.example/x?a=b", "?query"),
        ("https://", "no host"),
        ("https://h.example/\"x\"<script>", "'\"'"),
        ("https://h.example\\@evil.example/x", "'\\'"),
        ("https://h.example/a\tb", "U+0009"),
        ("https://h.example/a\u{200b}b", "U+200B"),
    ] {
        let o = confined(
            &a,
            &package_args(&build, &private, &out, &["--base-url", url]),
            Some("rel"),
        );
        refused(&o, 2, &["--base-url", says], url);
        assert!(!out.exists(), "{url}");
    }
    let o = confined(
        &a,
        &package_args(
            &build,
            &private,
            &out,
            &["--base-url", "https://huggingface.co/me/m/resolve/main"],
        ),
        Some("rel"),
    );
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Point 14: a package that changed after its build is named at its own path in
/// the build folder (not its release path); a carried one against DIR's
/// manifest, not build.json.
#[test]
fn a_changed_package_is_named_where_it_is_with_the_record_it_breaks() {
    let a = area("messages");
    let i = inputs(&a);
    let spec = i
        .build
        .join("chunk1.mlpackage/Data/com.apple.CoreML/model.mlmodel");
    let mut bytes = fs::read(&spec).unwrap();
    bytes.push(b'\n');
    fs::write(&spec, bytes).unwrap();
    let out = a.out.join("rel");
    let o = confined(
        &a,
        &package_args(&i.build, &i.private, &out, &[]),
        Some("rel"),
    );
    let want = format!(
        "{}: contents differ from what {} records",
        i.build.join("chunk1.mlpackage").display(),
        i.build.join("build.json").display()
    );
    refused(&o, 2, &[&want], "changed build package");
    assert!(!stderr(&o).contains("swa/chunk1"), "{}", stderr(&o));

    let dir = a.inp.join("dir");
    copy_tree(&i.release, &dir);
    edit_manifest(&dir, |m| {
        for c in m["chunks"].as_array_mut().unwrap() {
            if c["name"] == "chunk2" {
                c["sha256_tree"] = json!("cd".repeat(32));
            }
        }
    });
    resign(&dir, &i.private);
    let (_, o) = onto(&a, &i, &dir, "rel", &[]);
    let want = format!(
        "{}: contents differ from what {} records",
        dir.join("swa/chunk2.mlpackage").display(),
        dir.join("manifest.json").display()
    );
    refused(&o, 2, &[&want], "carried package");
}

/// Point 15: a failed side-files run leaves neither its output folder nor its
/// lock file; a cache folder refused for its parent is not created, nor
/// are the folders above it.
#[test]
fn failed_runs_leave_nothing() {
    let a = area("leftovers");
    let nan = edited_checkpoint(&a, "nan", |h, data| {
        let at = h["model.embed_tokens_per_layer.weight"]["data_offsets"][0]
            .as_u64()
            .unwrap() as usize;
        data[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    let side = a.out.join("side");
    let o = confined(
        &a,
        &["side-files", "--hf-dir", s(&nan), "--output", s(&side)],
        None,
    );
    refused(&o, 2, &["not a finite number"], "side-files");
    let left: Vec<_> = fs::read_dir(&a.out)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");

    let open = a.work.join("open");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    for cache in [open.join("cache"), open.join("a/b/cache")] {
        for mut c in [
            std::process::Command::new(common::bin()),
            std::process::Command::new("bash"),
        ] {
            if c.get_program() == "bash" {
                c.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/setup-signing.sh"));
            } else {
                c.arg("setup");
            }
            let o = c.env("CHUNKFORGE_CACHE", &cache).output().unwrap();
            refused(
                &o,
                if c.get_program() == "bash" { 1 } else { 2 },
                &["is writable by everyone"],
                s(&cache),
            );
            let made: Vec<_> = fs::read_dir(&open)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert!(made.is_empty(), "{:?} made {made:?}", c.get_program());
        }
    }
}

/// A chunkforge run with `env`, its stderr read line by line.
fn spawn(
    args: &[&str],
    env: &[(&str, &str)],
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(common::bin())
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

fn signal(pid: u32, sig: &str) {
    let st = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}

/// The names in `dir`.
fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Waits until `ready` holds (checked every millisecond), or panics once
/// the child has ended without it.
fn until(child: &mut std::process::Child, what: &str, ready: impl Fn() -> bool) {
    loop {
        if ready() {
            return;
        }
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the run ended ({st}) before {what}");
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Point 10: Ctrl-C during package's copy, or while it writes the archive, leaves
/// nothing (no staging folder, no partial file, no archive temporary, no
/// lock), as its message says. A thousand files of 256 KiB: a copy is
/// always starting one when the signal comes (before the fix, about one
/// round in seven left a staging folder that a copy had made again).
#[test]
fn ctrl_c_during_packages_copy_leaves_nothing() {
    let a = area("interrupt");
    let (private, _) = keys(&a.work, "k");
    let build = synthetic_build(&a.inp.join("build"), &[], 0);
    // A large file too, so that writing the archive takes a while.
    let big: Vec<u8> = (0..(96u32 << 20))
        .map(|k| (k.wrapping_mul(2654435761) >> 24) as u8)
        .collect();
    fs::write(build.join("merged_chunk1.mlpackage/Data/big.bin"), big).unwrap();
    add_files(&build, "merged_chunk1", 1000, 256 << 10);
    let out = a.out.join("rel");
    let staged = || {
        names_in(&a.out)
            .iter()
            .filter(|n| n.starts_with(".chunkforge-staging-"))
            .any(|n| {
                fs::read_dir(a.out.join(n).join("rel/merged_chunk1.mlpackage/Data/many"))
                    .is_ok_and(|d| d.count() > 100)
            })
    };
    for round in 0..10 {
        let (mut child, rx) = spawn(&package_args(&build, &private, &out, &[]), &[]);
        until(&mut child, "the copy was under way", staged);
        signal(child.id(), "INT");
        let st = child.wait().unwrap();
        let err: Vec<String> = rx.iter().collect();
        assert_eq!(st.code(), Some(130), "round {round}: {err:?}");
        assert!(
            err.iter().any(|l| l.contains("unfinished work is removed")),
            "{err:?}"
        );
        assert!(
            names_in(&a.out).is_empty(),
            "round {round}: left {:?}",
            names_in(&a.out)
        );
    }
    // While the archive is written beside its final name.
    let zip = a.out.join("rel.zip");
    let (mut child, rx) = spawn(
        &package_args(&build, &private, &out, &["--zip", s(&zip)]),
        &[],
    );
    until(&mut child, "the archive was being written", || {
        names_in(&a.out)
            .iter()
            .any(|n| n.starts_with(".rel.zip.tmp-"))
    });
    signal(child.id(), "INT");
    let st = child.wait().unwrap();
    let err: Vec<String> = rx.iter().collect();
    assert_eq!(st.code(), Some(130), "{err:?}");
    assert!(names_in(&a.out).is_empty(), "left {:?}", names_in(&a.out));
}

/// Point 10: `client-check --materialize` interrupted (Ctrl-C) leaves nothing;
/// killed, it leaves a staging folder the next run removes, and so it does
/// an older chunkforge's `.NAME.partial-PID`.
#[test]
fn an_interrupted_materialize_leaves_nothing_a_later_run_keeps() {
    let a = area("materialize-interrupt");
    let i = inputs(&a);
    let m = a.out.join("m");
    let args = [
        "client-check",
        s(&i.release),
        "--client",
        "main",
        "--multimodal",
        "off",
        "--materialize",
        s(&m),
    ];
    let paused = |sig: &str| {
        let (mut child, rx) = spawn(&args, &[("CHUNKFORGE_TEST_PAUSE_AFTER", "copy")]);
        let mut seen = Vec::new();
        loop {
            match rx.recv_timeout(std::time::Duration::from_secs(60)) {
                Ok(l) if l.contains("test hook: paused after copy") => break,
                Ok(l) => seen.push(l),
                Err(_) => panic!("no pause ({:?}): {seen:?}", child.try_wait()),
            }
        }
        signal(child.id(), sig);
        child.wait().unwrap()
    };
    let st = paused("INT");
    assert_eq!(st.code(), Some(130));
    assert!(names_in(&a.out).is_empty(), "left {:?}", names_in(&a.out));
    let st = paused("KILL");
    assert_eq!(st.code(), None);
    assert!(!m.exists());
    // An older chunkforge's leftover of a run long gone.
    let old = a.out.join(".m.partial-4194000");
    fs::create_dir_all(old.join("chunk1.mlpackage")).unwrap();
    // (exit 1: the synthetic release's widths are not the app's.)
    let o = common::run(&args);
    assert_ne!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(names_in(&a.out), ["m"]);
}

/// Every command that writes, on ordinary inputs, writes its output and
/// nothing else: each run confined (the file system read-only but the
/// output's folder) with the work area compared before and after. Commands
/// that only read (`plan`, `verify`, `run`, `inspect`, `audit`, `exec`,
/// `parity` without `--report`, `client-check`) are confined in the tests
/// above, on hostile inputs.
#[test]
fn every_writing_command_writes_its_output_and_nothing_else() {
    let a = area("writers");
    let out = |n: &str| a.out.join(n);
    let o = confined(&a, &["keygen", "--out", s(&out("k"))], Some("k"));
    assert!(o.status.success(), "keygen: {}", stderr(&o));
    // keygen's output is a prefix: KEY.pem and KEY.pub.
    assert!(out("k.pem").is_file() && out("k.pub").is_file());
    let ck = out("fx");
    let o = confined(&a, &["fixture", "--out", s(&ck)], Some("fx"));
    assert!(o.status.success(), "fixture: {}", stderr(&o));
    // Inputs from here on are read-only to the commands.
    let hf = a.inp.join("ckpt");
    fs::rename(&ck, &hf).unwrap();
    let o = confined(
        &a,
        &[
            "side-files",
            "--hf-dir",
            s(&hf),
            "--output",
            s(&out("side")),
        ],
        Some("side"),
    );
    assert!(o.status.success(), "side-files: {}", stderr(&o));
    let build = out("build");
    let o = confined(
        &a,
        &[
            "build",
            "--hf-dir",
            s(&hf),
            "--mode",
            "one",
            "--no-quantize",
            "--output",
            s(&build),
        ],
        Some("build"),
    );
    assert!(o.status.success(), "build: {}", stderr(&o));
    // The shared build of every layout (outside the work area, read-only).
    let b = common::built_all();
    let hf = PathBuf::from(
        json_file(&b.join("build.json"))["checkpoint"]["dir"]
            .as_str()
            .unwrap(),
    );
    let report = out("parity.json");
    let o = confined(
        &a,
        &[
            "parity",
            "--hf-dir",
            s(&hf),
            "--artifacts",
            s(&b),
            "--mode",
            "two",
            "--steps",
            "2",
            "--report",
            s(&report),
        ],
        Some("parity.json"),
    );
    assert!(o.status.success(), "parity: {}", stderr(&o));
    let rel = out("rel");
    let zip = out("rel.zip");
    let o = confined(
        &a,
        &[
            "package",
            s(&b),
            "--layout",
            "two",
            "--key",
            s(&out("k.pem")),
            "--output",
            s(&rel),
            "--zip",
            s(&zip),
            "--parity-report",
            s(&report),
        ],
        Some("rel"),
    );
    assert!(o.status.success(), "package: {}", stderr(&o));
    let m = out("m");
    let o = confined(
        &a,
        &[
            "client-check",
            s(&rel),
            "--client",
            "main",
            "--multimodal",
            "off",
            "--materialize",
            s(&m),
        ],
        Some("m"),
    );
    assert!(m.is_dir(), "client-check --materialize: {}", stderr(&o));
}
