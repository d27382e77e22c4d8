//! `chunkforge keygen`: an ECDSA P-256 key pair for signing releases.

use std::path::Path;

use anyhow::Result;

use super::ExitStatus;
use crate::package::keygen;

pub fn run(out: &Path) -> Result<ExitStatus> {
    keygen(out)?;
    Ok(ExitStatus::Success)
}
