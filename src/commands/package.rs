//! `chunkforge package`: a signed release folder from a build.

use anyhow::Result;

use super::ExitStatus;
use crate::cli::PackageCmd;
use crate::package::{package, PackageReport, PackageRequest};
use crate::publish::OnLocked;
use crate::sign::SIG_FILE;

pub fn run(args: PackageCmd) -> Result<ExitStatus> {
    let request = request(args);
    let report = package(&request)?;
    eprintln!("{}", summary(&report, &request));
    Ok(ExitStatus::Success)
}

fn request(a: PackageCmd) -> PackageRequest {
    PackageRequest {
        build_dir: a.build_dir,
        layout: a.layout,
        key: a.key,
        output: a.output,
        version: a.version,
        model_id: a.model_id,
        base_url: a.base_url,
        parity_report: a.parity_report,
        allow_failed_parity: a.allow_failed_parity,
        zip: a.zip,
        on_locked: OnLocked::from_no_wait(a.no_wait),
    }
}

/// One line for the terminal.
fn summary(r: &PackageReport, request: &PackageRequest) -> String {
    let mut s = format!(
        "wrote release {} ({} files, {:.1} MiB, subject sha256 {}) with {SIG_FILE}",
        request.output.display(),
        r.files,
        r.bytes as f64 / (1024.0 * 1024.0),
        r.root_digest,
    );
    if let Some((z, d)) = &r.zip {
        s.push_str(&format!("; archive {} (sha256 {d})", z.display()));
    }
    s
}
