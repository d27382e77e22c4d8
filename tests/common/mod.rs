//! Shared helpers for the integration tests: run the binary, make fixtures.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_chunkforge"))
}

/// Runs chunkforge with `args`; returns the output (never panics on failure).
pub fn run(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .env_remove("GEMMA4_HF_DIR")
        .output()
        .expect("spawn chunkforge")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts success and returns stdout.
pub fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(o.status.success(), "chunkforge {args:?} failed:\n{}\n{}", stdout(&o), stderr(&o));
    stdout(&o)
}

/// Runs chunkforge expecting failure; returns stderr.
pub fn fails(args: &[&str]) -> String {
    let o = run(args);
    assert!(!o.status.success(), "chunkforge {args:?} unexpectedly succeeded:\n{}", stderr(&o));
    stderr(&o)
}

static FIXTURE_LOCK: Mutex<()> = Mutex::new(());

/// A cached fixture checkpoint under target/test-fixtures/<name>, made once
/// with `chunkforge fixture --out <dir> <extra...>` and shared by tests.
pub fn fixture(name: &str, extra: &[&str]) -> PathBuf {
    let _guard = FIXTURE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fixtures");
    std::fs::create_dir_all(&root).unwrap();
    let dir = root.join(name);
    if !dir.join("config.json").exists() {
        let _ = std::fs::remove_dir_all(&dir);
        let mut args = vec!["fixture", "--out", dir.to_str().unwrap()];
        args.extend_from_slice(extra);
        ok(&args);
    }
    dir
}

/// A fresh empty temporary folder under the target dir.
pub fn tempdir(tag: &str) -> PathBuf {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR")).join("work");
    std::fs::create_dir_all(&base).unwrap();
    let d = base.join(format!(
        "{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}
