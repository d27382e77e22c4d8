//! `chunkforge package`: a signed release folder from a build.

use anyhow::Result;

use super::ExitStatus;
use crate::cli::PackageCmd;
use crate::package::{package, summary};

pub fn run(args: PackageCmd) -> Result<ExitStatus> {
    let request = args.request();
    let report = package(&request)?;
    eprintln!("{}", summary(&report, &request.output));
    Ok(ExitStatus::Success)
}
