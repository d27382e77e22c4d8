//! `chunkforge doctor`: the interpreter, versions, cache paths and what this
//! platform cannot do.

use anyhow::{Context, Result};

use super::ExitStatus;
use crate::cache_dir::cache_dir;
use crate::py::calls;
use crate::py::env as pyenv;

pub fn run(venv_python: bool, verbose: bool) -> Result<ExitStatus> {
    if venv_python {
        pyenv::ensure_env(verbose)?;
        println!(
            "{}",
            pyenv::venv_dir()?.join("bin").join("python").display()
        );
        return Ok(ExitStatus::Success);
    }
    println!("chunkforge {}", env!("CARGO_PKG_VERSION"));
    let venv = pyenv::venv_dir()?;
    println!("cache folder:        {}", cache_dir()?.display());
    println!(
        "python environment:  {} ({})",
        venv.display(),
        if pyenv::env_ready(&venv) {
            "ready"
        } else {
            "not set up yet: created on first use"
        }
    );
    println!("python package dir:  {}", pyenv::python_dir().display());
    pyenv::activate(verbose).context("setting up the Python environment")?;
    let v = pyenv::versions(verbose)?;
    println!(
        "embedded interpreter: Python {}",
        v.get("python").map_or("?", String::as_str)
    );
    for (k, val) in v.iter().filter(|(k, _)| *k != "python") {
        println!("  {k:<14} {val}");
    }
    let lim = calls::platform_limits(verbose)?;
    println!("platform: {} {}", lim.system, lim.machine);
    for (ok, what) in [
        (lim.can_predict, "Core ML prediction (MLModel.predict)"),
        (
            lim.can_compile_mlmodelc,
            "Core ML's compiler (compile --check; chunkforge's own .mlmodelc writer runs everywhere)",
        ),
        (
            lim.can_load_compute_plan,
            "MLComputePlan audit (Neural Engine placement)",
        ),
    ] {
        println!(
            "  {:<48} {}",
            what,
            if ok {
                "available"
            } else {
                "not available on this platform (needs macOS); skipped"
            }
        );
    }
    Ok(ExitStatus::Success)
}
