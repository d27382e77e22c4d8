//! `chunkforge selftest-python` (hidden): pytest inside the embedded
//! interpreter, where `chunkforge_native` is importable.

use anyhow::Result;

use super::ExitStatus;
use crate::py::native::run_pytest;

pub fn run(args: &[String], verbose: bool) -> Result<ExitStatus> {
    match run_pytest(args, verbose)? {
        0 => Ok(ExitStatus::Success),
        code => anyhow::bail!("pytest failed (exit code {code})"),
    }
}
