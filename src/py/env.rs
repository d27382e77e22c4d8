//! The embedded Python: a pinned virtual environment in a cache folder outside
//! the clone (created on first use, reused by every clone and CI run), and the
//! project's own `chunkforge_py` package on `sys.path`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use pyo3::prelude::*;
use pyo3::types::PyList;
use sha2::{Digest, Sha256};

use crate::cache_dir::cache_dir;
use crate::hashing::hex;
use crate::progress;
use crate::records::Versions;
use crate::staging::{OnLocked, OutputLock};

use super::contract::{ConfigureArgs, VersionsArgs};
pub use super::error::render_error;

/// The pinned Python requirements, compiled in so the stamp always matches the
/// binary: torch and the CUDA libraries it links, installed without dependency
/// resolution (so its GPU-only requirements stay out), then the rest.
pub const TORCH_REQUIREMENTS: &str = include_str!("../../python/requirements-torch.txt");
pub const REQUIREMENTS: &str = include_str!("../../python/requirements.txt");

/// The packages pinned to one version on every platform (`name==version`
/// without an environment marker) in the two requirement files, in file order:
/// what `doctor` and build.json report.
pub fn pinned_packages() -> Vec<(&'static str, &'static str)> {
    [TORCH_REQUIREMENTS, REQUIREMENTS]
        .iter()
        .flat_map(|text| text.lines())
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.contains(';'))
        .filter_map(|l| l.split_once("=="))
        .map(|(name, version)| (name.trim(), version.trim()))
        .collect()
}

/// The pinned environment, `venv/` in the cache folder (see [`crate::cache_dir`]).
pub fn venv_dir() -> Result<PathBuf> {
    Ok(cache_dir()?.join("venv"))
}

/// Where the `chunkforge_py` package lives: `$CHUNKFORGE_PYTHON_DIR`, else the
/// repository's `python/` folder this binary was built from.
pub fn python_dir() -> PathBuf {
    std::env::var_os("CHUNKFORGE_PYTHON_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("python"))
}

fn requirements_digest() -> String {
    let mut h = Sha256::new();
    for text in [TORCH_REQUIREMENTS, REQUIREMENTS] {
        h.update(text.as_bytes());
        h.update([0]);
    }
    hex(&h.finalize())
}

fn stamp_path(venv: &Path) -> PathBuf {
    venv.join(".chunkforge-requirements.sha256")
}

/// Whether the cached environment holds exactly the pinned requirements.
pub fn env_ready(venv: &Path) -> bool {
    std::fs::read_to_string(stamp_path(venv)).is_ok_and(|s| s.trim() == requirements_digest())
}

/// The interpreter pyo3 is linked against (its prefix and `X.Y` version).
fn embedded_interpreter() -> Result<(PathBuf, String)> {
    Python::attach(|py| -> PyResult<(PathBuf, String)> {
        let sys = py.import("sys")?;
        let base: String = sys.getattr("base_prefix")?.extract()?;
        let vi = sys.getattr("version_info")?;
        let (major, minor): (u32, u32) = (
            vi.getattr("major")?.extract()?,
            vi.getattr("minor")?.extract()?,
        );
        Ok((PathBuf::from(base), format!("{major}.{minor}")))
    })
    .map_err(|e| anyhow::anyhow!("cannot start the embedded Python interpreter: {e}"))
}

/// Creates or updates the cached virtual environment, with a progress line.
/// An environment stamped for other requirements (made by another chunkforge
/// version) is made again from nothing, so it holds exactly the pinned
/// packages: installing over it would
/// keep the packages that are no longer pinned (the GPU-only ones an older
/// environment has), and with them a test run would pass that fails on a
/// fresh machine. One without a stamp (an install cut short) is completed in
/// place. Concurrent runs wait for each other (a lock beside `venv/`).
pub fn ensure_env(verbose: bool) -> Result<()> {
    let cache = cache_dir()?;
    let venv = cache.join("venv");
    if env_ready(&venv) {
        return Ok(());
    }
    let _lock = OutputLock::take(&venv, OnLocked::Wait)?;
    if env_ready(&venv) {
        return Ok(());
    }
    if remove_stale(&venv)? {
        eprintln!(
            "{}: made for other requirements than this chunkforge's; making it again",
            venv.display()
        );
    }
    let (base, version) = embedded_interpreter()?;
    let python = base.join("bin").join(format!("python{version}"));
    let what = format!(
        "setting up Python {version} environment in {}",
        venv.display()
    );
    let spinner = progress::spinner(what.clone());
    if spinner.is_hidden() {
        eprintln!("{what} (a new environment: 2.3 GB to download, minutes)");
    }
    if !venv.join("bin").join("python").exists() {
        let status = Command::new(&python)
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .with_context(|| format!("running {} -m venv", python.display()))?;
        if !status.success() {
            bail!(
                "{} -m venv {} failed ({status})",
                python.display(),
                venv.display()
            );
        }
    }
    // torch first, without its dependencies (python/requirements-torch.txt),
    // then everything else with them.
    let torch_req = cache.join("requirements-torch.txt");
    let req = cache.join("requirements.txt");
    for (path, text) in [(&torch_req, TORCH_REQUIREMENTS), (&req, REQUIREMENTS)] {
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    let started = Instant::now();
    let python = venv.join("bin").join("python");
    for (extra, path) in [(Some("--no-deps"), &torch_req), (None, &req)] {
        let mut cmd = Command::new(&python);
        cmd.args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
        ])
        .args(extra)
        .arg("-r")
        .arg(path);
        pip(cmd, &spinner, started, verbose).with_context(|| {
            format!(
                "installing the pinned Python packages of {} into {} failed",
                path.display(),
                venv.display()
            )
        })?;
    }
    spinner.finish_and_clear();
    std::fs::write(stamp_path(&venv), requirements_digest())
        .context("writing the environment stamp")?;
    eprintln!("Python environment ready: {}", venv.display());
    Ok(())
}

/// Removes `venv` if it is stamped for other requirements; whether it did.
/// One stamped so that is not a Python environment (no `pyvenv.cfg`) is an
/// error, and left alone.
fn remove_stale(venv: &Path) -> Result<bool> {
    if env_ready(venv) || !stamp_path(venv).is_file() {
        return Ok(false);
    }
    if !venv.join("pyvenv.cfg").is_file() {
        bail!(
            "{}: not a Python environment (no pyvenv.cfg); chunkforge keeps its environment there: move it away",
            venv.display()
        );
    }
    std::fs::remove_dir_all(venv)
        .with_context(|| format!("{}: cannot remove the stale environment", venv.display()))?;
    Ok(true)
}

/// Seconds without a new line from pip after which a log (stderr not a
/// terminal) gets a line saying pip is still at work.
const QUIET_SECONDS: u64 = 30;

/// Runs one pip install. On a terminal its latest line shows in the spinner;
/// elsewhere (CI logs, `2>file`) every package it collects, downloads and
/// installs is a plain line with the seconds since the install started, and
/// a quiet spell of [`QUIET_SECONDS`] gets a line too, so a log never
/// stops for minutes. With `verbose`, every line of pip's output.
fn pip(mut cmd: Command, spinner: &ProgressBar, started: Instant, verbose: bool) -> Result<()> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting pip")?;
    let stderr = child.stderr.take().expect("piped");
    let err_thread = std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let (tx, lines) = mpsc::channel::<String>();
    let stdout = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let plain = spinner.is_hidden();
    let stamp = || format!("[{:>4}s]", started.elapsed().as_secs());
    let mut log = String::new();
    let mut last = String::new();
    loop {
        match lines.recv_timeout(Duration::from_secs(QUIET_SECONDS)) {
            Ok(line) => {
                if verbose {
                    eprintln!("{line}");
                } else if plain && is_progress(&line) {
                    eprintln!("{} pip: {}", stamp(), shorten(line.trim(), 160));
                }
                spinner.set_message(format!("pip: {}", shorten(line.trim(), 100)));
                last = line.trim().to_string();
                log.push_str(&line);
                log.push('\n');
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if plain && !verbose {
                    eprintln!(
                        "{} pip: still working (last: {})",
                        stamp(),
                        shorten(&last, 100)
                    );
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let status = child.wait().context("waiting for pip")?;
    let err = err_thread.join().unwrap_or_default();
    if !status.success() {
        let tail: Vec<&str> = log.lines().chain(err.lines()).rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "pip exited with {status}; last lines of its output:\n{}",
            tail.join("\n")
        );
    }
    Ok(())
}

/// pip's lines that mark progress: a package collected, downloaded, the
/// install step, the result.
fn is_progress(line: &str) -> bool {
    let l = line.trim_start();
    [
        "Collecting ",
        "Downloading ",
        "Installing ",
        "Successfully ",
    ]
    .iter()
    .any(|p| l.starts_with(p))
}

/// At most `n` characters of `s`, with `...` when cut.
fn shorten(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        return s.to_string();
    }
    let mut out: String = s.chars().take(n).collect();
    out.push_str("...");
    out
}

static ACTIVE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Puts the cached environment and `chunkforge_py` on the embedded interpreter's
/// path (once per process).
pub fn activate(verbose: bool) -> Result<()> {
    if ACTIVE.load(std::sync::atomic::Ordering::SeqCst) {
        return Ok(());
    }
    ensure_env(verbose)?;
    let venv = venv_dir()?;
    let pkg = python_dir();
    if !pkg.join("chunkforge_py").is_dir() {
        bail!(
            "{}: the chunkforge_py package is not there (set CHUNKFORGE_PYTHON_DIR to the repository's python/ folder)",
            pkg.display()
        );
    }
    Python::attach(|py| -> PyResult<()> {
        let sys = py.import("sys")?;
        let vi = sys.getattr("version_info")?;
        let (major, minor): (u32, u32) = (
            vi.getattr("major")?.extract()?,
            vi.getattr("minor")?.extract()?,
        );
        let site_dir = venv
            .join("lib")
            .join(format!("python{major}.{minor}"))
            .join("site-packages");
        py.import("site")?
            .call_method1("addsitedir", (site_dir.to_string_lossy().to_string(),))?;
        let path = sys.getattr("path")?.cast_into::<PyList>()?;
        path.insert(0, pkg.to_string_lossy().to_string())?;
        // For helpers that must run a plain interpreter of the same environment
        // (e.g. to fork worker pools away from this multi-threaded process).
        let python = venv.join("bin").join("python");
        py.import("os")?.getattr("environ")?.set_item(
            "CHUNKFORGE_VENV_PYTHON",
            python.to_string_lossy().to_string(),
        )?;
        Ok(())
    })
    .map_err(|e| anyhow::anyhow!(render_error(e, verbose)))?;
    super::calls::call::<super::calls::Configure>(&ConfigureArgs { verbose }, verbose)
}

/// Versions of the Python-side tools, by package: `python` first, then every
/// pinned package ([`pinned_packages`]) as installed.
pub fn versions(verbose: bool) -> Result<Versions> {
    let packages = pinned_packages()
        .into_iter()
        .map(|(name, _)| name.to_string())
        .collect();
    super::calls::call::<super::calls::VersionsOf>(&VersionsArgs { packages }, verbose)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stale environment (stamped for other requirements) is removed whole,
    /// packages no longer pinned included; a ready one, one without a stamp
    /// (an install to complete) and a folder that is not an environment are
    /// left as they are.
    #[test]
    fn only_a_stale_environment_is_removed() {
        let root = std::env::temp_dir().join(format!("cf-venv-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let venv = root.join("venv");
        assert!(!remove_stale(&venv).unwrap(), "nothing there");
        let site = venv.join("lib/python3.11/site-packages/triton");
        std::fs::create_dir_all(&site).unwrap();
        std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        std::fs::write(stamp_path(&venv), requirements_digest()).unwrap();
        assert!(!remove_stale(&venv).unwrap(), "a ready environment");
        assert!(site.is_dir());
        std::fs::remove_file(stamp_path(&venv)).unwrap();
        assert!(!remove_stale(&venv).unwrap(), "no stamp: to complete");
        assert!(site.is_dir());
        std::fs::write(stamp_path(&venv), "0".repeat(64)).unwrap();
        assert!(remove_stale(&venv).unwrap(), "another stamp");
        assert!(!venv.exists());
        std::fs::create_dir_all(venv.join("data")).unwrap();
        std::fs::write(stamp_path(&venv), "0".repeat(64)).unwrap();
        let e = remove_stale(&venv).unwrap_err().to_string();
        assert!(
            e.contains("not a Python environment (no pyvenv.cfg)"),
            "{e}"
        );
        assert!(venv.join("data").is_dir());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
