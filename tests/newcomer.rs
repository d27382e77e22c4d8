//! A newcomer's path: what a first user types from the README, and the
//! mistakes they make on the way. A folder handed to the wrong command (a
//! file, an empty folder or a Hugging Face cache as `--hf-dir`, a build
//! folder to `run`, `inspect` or `verify`) is answered with what that command
//! takes, before Python starts where it can be; the environment install
//! reports progress in a log; `scripts/setup-system.sh` names what is
//! missing; help texts, `doctor` and `plan`'s text say what they should.

mod common;

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{fixture, ok, run, run_env, stderr, stdout, tempdir};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Asserts exit status 2 (bad input) and returns stderr.
fn refused(o: &Output) -> String {
    let e = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "stdout:\n{}\nstderr:\n{e}",
        stdout(o)
    );
    assert!(!e.contains("Traceback"), "{e}");
    e
}

/// A folder laid out as `build` leaves it: build.json and packages (their
/// contents do not matter to the messages under test).
fn build_folder(tag: &str) -> PathBuf {
    let d = tempdir(tag);
    fs::write(d.join("build.json"), "{}").unwrap();
    for p in [
        "chunk1.mlpackage",
        "merged_chunk1.mlpackage",
        "merged_chunk2.mlpackage",
    ] {
        fs::create_dir_all(d.join(p).join("Data")).unwrap();
        fs::write(d.join(p).join("Manifest.json"), "{}").unwrap();
    }
    d
}

/// The environment of a run that must not start Python: were it started,
/// the missing `chunkforge_py` package would be the error instead.
const NO_PYTHON: (&str, &str) = ("CHUNKFORGE_PYTHON_DIR", "/nonexistent/no-python-here");

#[test]
fn hf_dir_that_is_a_file_or_an_empty_folder_says_what_a_checkpoint_folder_is() {
    let w = tempdir("hf-file");
    let file = w.join("model.safetensors");
    fs::write(&file, b"not a folder").unwrap();
    let e = refused(&run(&["plan", "--hf-dir", s(&file)]));
    assert!(
        e.contains(&format!(
            "{}: is a file, not a checkpoint folder",
            file.display()
        )) && e.contains("the folder that holds config.json"),
        "{e}"
    );
    assert!(!e.contains("does not exist"), "{e}");

    let empty = w.join("empty");
    fs::create_dir(&empty).unwrap();
    let e = refused(&run(&[
        "build",
        "--hf-dir",
        s(&empty),
        "--output",
        s(&w.join("out")),
    ]));
    assert!(
        e.contains(&format!(
            "{}: no config.json here: is this a checkpoint folder?",
            empty.display()
        )),
        "{e}"
    );
    assert!(!e.contains("Hugging Face cache"), "{e}");
    assert!(!w.join("out").exists());
}

/// A Hugging Face cache as `huggingface-cli download` leaves it: snapshot
/// folders of symlinks into `blobs/`, under `hub/models--ORG--NAME/`.
fn hf_cache(tag: &str, checkpoint: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let root = tempdir(tag);
    let model = root.join("hub").join("models--google--gemma-4-E2B-it");
    let snapshot = model.join("snapshots").join("0123abcd");
    fs::create_dir_all(model.join("blobs")).unwrap();
    fs::create_dir_all(model.join("refs")).unwrap();
    fs::create_dir_all(&snapshot).unwrap();
    fs::write(model.join("refs").join("main"), "0123abcd").unwrap();
    for e in fs::read_dir(checkpoint).unwrap() {
        let e = e.unwrap();
        let blob = model.join("blobs").join(e.file_name());
        fs::copy(e.path(), &blob).unwrap();
        symlink(
            Path::new("../../blobs").join(e.file_name()),
            snapshot.join(e.file_name()),
        )
        .unwrap();
    }
    // A second, unfinished download: a snapshot without config.json.
    let other = root.join("hub/models--google--gemma-4-E4B/snapshots/4567ef");
    fs::create_dir_all(&other).unwrap();
    (root, model, snapshot)
}

#[test]
fn hugging_face_cache_root_lists_the_snapshot_folders_to_pass() {
    let (root, model, snapshot) = hf_cache("hf-cache", &fixture("e2b", &[]));
    for dir in [
        root.clone(),
        root.join("hub"),
        model.clone(),
        model.join("snapshots"),
    ] {
        let e = refused(&run(&["plan", "--hf-dir", s(&dir)]));
        assert!(
            e.contains("is this a checkpoint folder?")
                && e.contains("this is a Hugging Face cache: pass one of its snapshot folders")
                && e.contains(s(&snapshot)),
            "{}: {e}",
            dir.display()
        );
        assert!(
            !e.contains("4567ef"),
            "a snapshot without config.json offered: {e}"
        );
    }
    let e = refused(&run(&[
        "plan",
        "--hf-dir",
        s(&root.join("hub/models--google--gemma-4-E4B")),
    ]));
    assert!(
        e.contains("none of its 1 snapshot folders holds a config.json"),
        "{e}"
    );
    // The snapshot folder itself is a checkpoint folder.
    let plan = ok(&["plan", "--hf-dir", s(&snapshot), "--mode", "two"]);
    assert!(plan.contains("layout two (2 chunks)"), "{plan}");
}

#[test]
fn plan_counts_one_chunk_in_the_singular() {
    let hf = fixture("e2b", &[]);
    let one = ok(&["plan", "--hf-dir", s(&hf), "--mode", "one"]);
    assert!(one.contains("layout one (1 chunk)\n"), "{one}");
    assert!(!one.contains("1 chunks"), "{one}");
    let both = ok(&["plan", "--hf-dir", s(&hf), "--mode", "both"]);
    assert!(both.contains("layout two (2 chunks)\n"), "{both}");
}

#[test]
fn run_on_a_build_folder_says_run_takes_a_release() {
    let build = build_folder("run-build");
    let e = refused(&run_env(
        &["run", s(&build), "--prompt", "Hello"],
        &[NO_PYTHON],
    ));
    assert!(
        e.contains(&format!(
            "{}: a build folder (it has build.json), not a release",
            build.display()
        )) && e.contains("`chunkforge run` takes a release folder")
            && e.contains(&format!("chunkforge package {}", build.display())),
        "{e}"
    );
    assert!(!e.contains("manifest.json: missing"), "{e}");
    let empty = tempdir("run-empty");
    let e = refused(&run_env(
        &["run", s(&empty), "--prompt", "Hello"],
        &[NO_PYTHON],
    ));
    assert!(
        e.contains("not a release folder (no manifest.json, no model.sig)")
            && e.contains("made by `chunkforge package` or `chunkforge release`"),
        "{e}"
    );
}

#[test]
fn inspect_on_a_build_folder_names_its_packages_before_python_starts() {
    let build = build_folder("inspect-build");
    let e = refused(&run_env(&["inspect", s(&build)], &[NO_PYTHON]));
    assert!(
        e.contains(&format!(
            "{}: a build folder, not a package",
            build.display()
        )) && e.contains(&format!(
            "e.g. `chunkforge inspect {}`",
            build.join("chunk1.mlpackage").display()
        )) && e.contains(
            "the packages here: chunk1.mlpackage, merged_chunk1.mlpackage, merged_chunk2.mlpackage"
        ),
        "{e}"
    );
    let e = refused(&run_env(
        &[
            "exec",
            s(&build),
            "--inputs",
            s(&build.join("build.json")),
            "--output",
            s(&build.join("o.npz")),
        ],
        &[NO_PYTHON],
    ));
    assert!(
        e.contains("`chunkforge exec` takes one .mlpackage folder"),
        "{e}"
    );
    let e = refused(&run_env(
        &["inspect", s(&build.join("build.json"))],
        &[NO_PYTHON],
    ));
    assert!(e.contains("a file, not an .mlpackage folder"), "{e}");
    let empty = tempdir("inspect-empty");
    let e = refused(&run_env(&["inspect", s(&empty)], &[NO_PYTHON]));
    assert!(
        e.contains("not an .mlpackage folder (no Manifest.json), and no .mlpackage folders inside"),
        "{e}"
    );
}

/// inspect's first line: `mlProgram, specification version 9 ...`, no space
/// before the comma.
#[test]
fn inspect_prints_the_model_type_and_spec_version() {
    let pkg = common::non_ane_package(&tempdir("inspect-real").join("p.mlpackage"));
    let out = ok(&["inspect", s(&pkg)]);
    assert!(
        out.contains("  mlProgram, specification version 9 (iOS18 = 9)"),
        "{out}"
    );
}

#[test]
fn verify_on_a_folder_that_is_not_a_release_says_so() {
    let w = tempdir("verify-not-release");
    ok(&["keygen", "--out", s(&w.join("k"))]);
    let public = w.join("k.pub");
    let build = build_folder("verify-build");
    let e = refused(&run(&["verify", s(&build), "--public-key", s(&public)]));
    assert!(
        e.contains(&format!(
            "{}: a build folder (it has build.json), not a release",
            build.display()
        )) && e.contains("`chunkforge verify` takes a release folder"),
        "{e}"
    );
    assert!(!e.contains("model.sig: could not read"), "{e}");
    let e = refused(&run(&["verify", s(&w), "--public-key", s(&public)]));
    assert!(
        e.contains("not a release folder (no manifest.json, no model.sig)"),
        "{e}"
    );
}

/// The pins the two requirement files hold on every platform (`name==version`
/// without a marker), read here independently of the binary.
fn pins() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for f in ["requirements-torch.txt", "requirements.txt"] {
        let text = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("python").join(f))
            .unwrap();
        for line in text.lines().map(str::trim) {
            if line.starts_with('#') || line.contains(';') {
                continue;
            }
            if let Some((n, v)) = line.split_once("==") {
                out.push((n.to_string(), v.to_string()));
            }
        }
    }
    out
}

#[test]
fn doctor_lists_every_pinned_package_with_its_version() {
    let pins = pins();
    assert!(pins.iter().any(|(n, _)| n == "tokenizers"), "{pins:?}");
    assert!(pins.iter().any(|(n, _)| n == "torch"), "{pins:?}");
    let out = ok(&["doctor"]);
    for (name, version) in &pins {
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name.as_str()))
            .unwrap_or_else(|| panic!("doctor does not list {name}:\n{out}"));
        assert!(
            line.split_whitespace()
                .nth(1)
                .is_some_and(|v| v.starts_with(version.as_str())),
            "{name} is pinned to {version}: {line}"
        );
    }
}

/// A cache folder whose environment is a stand-in: `venv/bin/python` is a
/// script that records its arguments and prints what pip prints, so the
/// install's own steps and output are what is tested, in seconds.
fn fake_venv(tag: &str) -> PathBuf {
    let cache = tempdir(tag);
    fs::set_permissions(&cache, fs::Permissions::from_mode(0o700)).unwrap();
    let bin = cache.join("venv").join("bin");
    fs::create_dir_all(&bin).unwrap();
    let python = bin.join("python");
    fs::write(
        &python,
        format!(
            r#"#!/bin/sh
echo "$@" >> {calls}
echo "Collecting torch==2.11.0"
echo "  Downloading torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl (530.6 MB)"
echo "Requirement already satisfied: filelock in ./venv"
echo "Installing collected packages: torch"
echo "Successfully installed torch-2.11.0"
"#,
            calls = cache.join("calls").display()
        ),
    )
    .unwrap();
    fs::set_permissions(&python, fs::Permissions::from_mode(0o755)).unwrap();
    cache
}

#[test]
fn environment_install_logs_progress_when_stderr_is_not_a_terminal() {
    let cache = fake_venv("fake-venv");
    let o = run_env(
        &["doctor", "--venv-python"],
        &[("CHUNKFORGE_CACHE", s(&cache))],
    );
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("setting up Python 3.11 environment in"), "{e}");
    for line in [
        "s] pip: Collecting torch==2.11.0",
        "s] pip: Downloading torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl (530.6 MB)",
        "s] pip: Installing collected packages: torch",
        "s] pip: Successfully installed torch-2.11.0",
    ] {
        assert_eq!(e.matches(line).count(), 2, "once per pip call: {line}\n{e}");
    }
    assert!(!e.contains("Requirement already satisfied"), "{e}");
    // torch first, without dependency resolution; then the rest, with it.
    let calls = fs::read_to_string(cache.join("calls")).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(
        calls[0].contains("--no-deps -r") && calls[0].ends_with("requirements-torch.txt"),
        "{calls:?}"
    );
    assert!(
        !calls[1].contains("--no-deps") && calls[1].ends_with("/requirements.txt"),
        "{calls:?}"
    );
    assert_eq!(
        fs::read_to_string(cache.join("requirements-torch.txt")).unwrap(),
        fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/python/requirements-torch.txt"
        ))
        .unwrap()
    );
    // Ready now: no second install.
    let o = run_env(
        &["doctor", "--venv-python"],
        &[("CHUNKFORGE_CACHE", s(&cache))],
    );
    assert!(
        o.status.success() && !stderr(&o).contains("pip:"),
        "{}",
        stderr(&o)
    );
}

/// A folder of commands for a restricted PATH: links to the real ones named,
/// plus scripts given as (name, body).
fn bin_dir(tag: &str, real: &[&str], scripts: &[(&str, &str)]) -> PathBuf {
    let d = tempdir(tag);
    for name in real {
        let path = ["/usr/bin", "/bin", "/root/.cargo/bin"]
            .iter()
            .map(|p| Path::new(p).join(name))
            .find(|p| p.exists())
            .or_else(|| {
                let o = Command::new("sh")
                    .args(["-c", &format!("command -v {name}")])
                    .output()
                    .ok()?;
                Some(PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
            })
            .unwrap_or_else(|| panic!("{name} not found"));
        symlink(path, d.join(name)).unwrap();
    }
    for (name, body) in scripts {
        let p = d.join(name);
        fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    }
    d
}

fn setup_system_check(path: &Path, env: &[(&str, &str)]) -> Output {
    Command::new("/bin/bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/setup-system.sh"
        ))
        .arg("--check")
        .env("PATH", path)
        .env_remove("PYO3_PYTHON")
        .env_remove("VIRTUAL_ENV")
        .env_remove("CONDA_PREFIX")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

const TOOLS: &[&str] = &["awk", "grep", "id", "cc", "openssl", "cargo", "rustc"];

#[test]
fn setup_system_names_everything_the_readme_commands_need() {
    // This machine runs the suite: everything is here.
    let o = Command::new("/bin/bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/setup-system.sh"
        ))
        .arg("--check")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("rustfmt, clippy"), "{}", stderr(&o));

    // No rustfmt, clippy or strace; python3 a 3.11 without its shared library
    // (not Debian's, so no package can add it).
    let python311 = r#"case "$1" in --version) echo "Python 3.11.9";; *) cat >/dev/null; echo "3.11 3.11.9 0 /opt/py/lib/libpython3.11.a 1 /opt/py/bin/python3.11";; esac"#;
    let bin = bin_dir("sys-no-fmt", TOOLS, &[("python3", python311)]);
    let o = setup_system_check(&bin, &[]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    for want in [
        "missing: rustfmt (the test command runs it)",
        "missing: clippy (the test command runs it)",
        "missing: strace",
        "missing: the shared libpython3.11 of /opt/py/bin/python3.11: use a Python 3.11 built with --enable-shared",
        "Debian/Ubuntu packages for these: sudo apt-get install strace",
    ] {
        assert!(e.contains(want), "{want}:\n{e}");
    }
    assert!(
        !e.contains("missing: cc") && !e.contains("missing: openssl"),
        "{e}"
    );

    // pyo3 would take a Python 3.12.
    let python312 = r#"case "$1" in --version) echo "Python 3.12.1";; *) cat >/dev/null; echo "3.12 3.12.1 1 /opt/py/lib/libpython3.12.so 1 /opt/py/bin/python3.12";; esac"#;
    let bin = bin_dir("sys-312", TOOLS, &[("python3", python312)]);
    let e = stderr(&setup_system_check(&bin, &[]));
    assert!(
        e.contains("missing: CPython 3.11: pyo3 would build against")
            && e.contains("which is Python 3.12.1"),
        "{e}"
    );
    // ... unless PYO3_PYTHON names a 3.11.
    let bin = bin_dir(
        "sys-pyo3",
        TOOLS,
        &[("python3", python312), ("py311", python311)],
    );
    let e = stderr(&setup_system_check(&bin, &[("PYO3_PYTHON", "py311")]));
    assert!(
        !e.contains("pyo3 would build against") && e.contains("libpython3.11"),
        "{e}"
    );

    // No Rust at all.
    let bin = bin_dir(
        "sys-no-rust",
        &["awk", "grep", "id", "cc", "openssl", "strace"],
        &[("python3", python311)],
    );
    let e = stderr(&setup_system_check(&bin, &[]));
    assert!(
        e.contains("missing: cargo and rustc 1.89 or newer: install rustup (https://rustup.rs)"),
        "{e}"
    );
}
