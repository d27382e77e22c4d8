//! The embedded Python: a pinned virtual environment in a cache folder outside
//! the clone (created on first use, reused by every clone and CI run), and the
//! project's own `chunkforge_py` package on `sys.path`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use pyo3::prelude::*;
use pyo3::types::PyList;
use sha2::{Digest, Sha256};

use crate::cache_dir::cache_dir;
use crate::hashing::hex;
use crate::progress;

/// The pinned Python requirements, compiled in so the stamp always matches the binary.
pub const REQUIREMENTS: &str = include_str!("../../python/requirements.txt");

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
    hex(&Sha256::digest(REQUIREMENTS.as_bytes()))
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
pub fn ensure_env(verbose: bool) -> Result<()> {
    let cache = cache_dir()?;
    let venv = cache.join("venv");
    if env_ready(&venv) {
        return Ok(());
    }
    let (base, version) = embedded_interpreter()?;
    let python = base.join("bin").join(format!("python{version}"));
    let spinner = progress::spinner(format!(
        "setting up Python {version} environment in {}",
        venv.display()
    ));
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
    let req = cache.join("requirements.txt");
    std::fs::write(&req, REQUIREMENTS).with_context(|| format!("writing {}", req.display()))?;
    let mut child = Command::new(venv.join("bin").join("python"))
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "-r",
        ])
        .arg(&req)
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
    let mut log = String::new();
    for line in BufReader::new(child.stdout.take().expect("piped"))
        .lines()
        .map_while(|l| l.ok())
    {
        if verbose {
            eprintln!("{line}");
        }
        let short: String = line.chars().take(100).collect();
        spinner.set_message(format!("pip: {short}"));
        log.push_str(&line);
        log.push('\n');
    }
    let status = child.wait().context("waiting for pip")?;
    let err = err_thread.join().unwrap_or_default();
    spinner.finish_and_clear();
    if !status.success() {
        let tail: Vec<&str> = log.lines().chain(err.lines()).rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "installing the pinned Python packages into {} failed ({status}); last lines of pip's output:\n{}",
            venv.display(),
            tail.join("\n")
        );
    }
    std::fs::write(stamp_path(&venv), requirements_digest())
        .context("writing the environment stamp")?;
    eprintln!("Python environment ready: {}", venv.display());
    Ok(())
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
    super::calls::call::<super::calls::Configure>(&super::calls::ConfigureArgs { verbose }, verbose)
}

/// Renders a Python exception for the user: the message, plus the traceback with `--verbose`.
pub fn render_error(err: PyErr, verbose: bool) -> String {
    Python::attach(|py| {
        let value = err.value(py);
        let kind = value
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        let msg = value.str().map(|s| s.to_string()).unwrap_or_default();
        let mut out = if kind == "ChunkforgeError" {
            msg
        } else {
            format!("{kind}: {msg}")
        };
        if verbose {
            if let Ok(tb) = py
                .import("traceback")
                .and_then(|m| m.call_method1("format_exception", (value,)))
            {
                if let Ok(lines) = tb.extract::<Vec<String>>() {
                    out.push_str("\n\nPython traceback:\n");
                    out.push_str(&lines.concat());
                }
            }
        } else {
            out.push_str(" (run with --verbose for the Python traceback)");
        }
        out
    })
}
