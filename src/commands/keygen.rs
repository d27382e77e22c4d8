//! `chunkforge keygen`: an ECDSA P-256 key pair for signing releases.

use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use anyhow::{Context, Result};

use super::ExitStatus;
use crate::sign::keygen;

pub fn run(prefix: &Path) -> Result<ExitStatus> {
    // `keygen --out keys/release` in a fresh clone: the folder is made, private
    // to its owner like the key it will hold.
    let folder = prefix.parent().filter(|p| !p.as_os_str().is_empty());
    let made = match folder {
        Some(dir) if !dir.exists() && !dir.is_symlink() => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("{}: could not create the key folder", dir.display()))?;
            Some(dir)
        }
        _ => None,
    };
    let (pem, public) = keygen(prefix)?;
    if let Some(dir) = made {
        eprintln!("created folder {} (mode 0700)", dir.display());
    }
    eprintln!(
        "wrote private key {} (mode 0600) and public key {}",
        pem.display(),
        public.display()
    );
    Ok(ExitStatus::Success)
}
