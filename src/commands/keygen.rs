//! `chunkforge keygen`: an ECDSA P-256 key pair for signing releases.

use std::path::Path;

use anyhow::Result;

use super::ExitStatus;
use crate::sign::keygen;

pub fn run(prefix: &Path) -> Result<ExitStatus> {
    let (pem, public) = keygen(prefix)?;
    eprintln!(
        "wrote private key {} (mode 0600) and public key {}",
        pem.display(),
        public.display()
    );
    Ok(ExitStatus::Success)
}
