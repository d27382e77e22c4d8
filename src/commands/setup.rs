//! `chunkforge setup`: create or update the pinned Python environment.

use anyhow::Result;

use super::ExitStatus;
use crate::py::env as pyenv;

pub fn run(verbose: bool) -> Result<ExitStatus> {
    pyenv::activate(verbose)?;
    eprintln!("Python environment: {}", pyenv::venv_dir()?.display());
    Ok(ExitStatus::Success)
}
