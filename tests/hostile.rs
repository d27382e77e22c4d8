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
/// outputs under `out/` (the only folder it may write), a secret file
/// beside them.
struct Area {
    work: PathBuf,
    inp: PathBuf,
    out: PathBuf,
    secret: PathBuf,
}

fn area(tag: &str) -> Area {
    let work = tempdir(&format!("hostile-{tag}"));
    let (inp, out) = (work.join("in"), work.join("out"));
    fs::create_dir_all(&inp).unwrap();
    fs::create_dir_all(&out).unwrap();
    let secret = work.join("secret.txt");
    fs::write(&secret, SECRET).unwrap();
    Area {
        work,
        inp,
        out,
        secret,
    }
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
    let o = run_confined(args, &[&a.out]);
    let after = snapshot(&a.work);
    // The output, and the lock file beside it (emptied, kept for the next run).
    let allowed = |rel: &str| {
        output.is_some_and(|name| {
            let own = format!("out/{name}");
            rel == own
                || rel.starts_with(&format!("{own}/"))
                || rel == format!("out/.{name}.chunkforge-lock")
        })
    };
    let changed: Vec<&String> = before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k) && !allowed(k))
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
