//! `chunkforge verify`: a release folder's signature, files and manifest.

use anyhow::Result;

use super::{verdict, ExitStatus};
use crate::cli::VerifyCmd;
use crate::verify;

/// Exit 1 when verification finds problems (each printed, naming its file).
pub fn run(args: VerifyCmd) -> Result<ExitStatus> {
    Ok(verdict(verify::run(&args.request())?))
}
