//! `chunkforge package`: a signed release folder from a build.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::ExitStatus;
use crate::audit;
use crate::cli::{PackageCmd, ReleaseArgs};
use crate::manifest::Build;
use crate::package::{package, Compiled, PackageReport, PackageRequest};
use crate::py::env as pyenv;
use crate::records::{rule_counts_text, AUDIT_FORMAT};
use crate::sign::SIG_FILE;
use crate::staging::OnLocked;
use chunkforge_release::paths::RUNBOOK_FILE;

pub fn run(args: PackageCmd, verbose: bool) -> Result<ExitStatus> {
    let mut request = request(args);
    audit_older_build(&mut request, verbose)?;
    let report = package(&request)?;
    eprintln!("{}", summary(&report, &request));
    Ok(ExitStatus::Success)
}

/// A build made before the audit existed has no audit record in build.json,
/// and one audited by an older chunkforge (another record format, or another
/// op-type table) has a stale one: its
/// packages are audited now (a static read, seconds), and `package`
/// refuses or ships on that result as it would on a recorded one. build.json
/// is not rewritten. A build.json `package` cannot read is left for it to
/// report.
pub(super) fn audit_older_build(request: &mut PackageRequest, verbose: bool) -> Result<()> {
    let Ok(build) = Build::load(&request.build_dir) else {
        return Ok(());
    };
    let why = match &build.record.audit {
        None => "no audit record (built before `chunkforge audit`)",
        Some(a) if a.format != AUDIT_FORMAT => {
            "its audit record is of an older format (no errors and warnings told apart)"
        }
        Some(a) if a.op_table_sha256 != audit::op_table_sha256() => {
            "its audit record was made against another op-type table"
        }
        Some(_) => return Ok(()),
    };
    let packages = audit::build_packages(&build.dir, &build.record, true);
    pyenv::activate(verbose)?;
    let report = audit::run(&packages, verbose).with_context(|| {
        format!(
            "{}: {why}, and auditing its packages failed",
            build.dir.join("build.json").display()
        )
    })?;
    let record = report.record();
    eprintln!(
        "{}: {why}; audited its packages now: {}",
        build.dir.join("build.json").display(),
        audit::summary_line(&record, packages.len())
    );
    request.audit = Some(record);
    Ok(())
}

fn request(a: PackageCmd) -> PackageRequest {
    let (onto, onto_public_key, allow_unverified_onto) =
        (a.onto, a.onto_public_key, a.allow_unverified_onto);
    let eval_report = a.eval_report;
    let mut r = release_request(
        a.build_dir,
        a.release,
        a.hf_dir,
        a.parity_report,
        ParityAcceptance {
            failed: a.allow_failed_parity,
            inconclusive: a.inconclusive.accept_inconclusive_parity,
        },
        Compiled::not(NOT_COMPILED),
    );
    r.onto = onto;
    r.eval_report = eval_report;
    r.onto_public_key = onto_public_key;
    r.allow_unverified_onto = allow_unverified_onto;
    r
}

/// The manifest's note on an uncompiled release.
pub(super) const NOT_COMPILED: &str = "not compiled: .mlpackage at the app's paths; `chunkforge compile RELEASE --key K` makes the .mlmodelc the app fetches";

/// Which parity reports that did not pass may be signed.
pub(super) struct ParityAcceptance {
    /// A failed one (`package --allow-failed-parity`).
    pub failed: bool,
    /// An inconclusive one (`--accept-inconclusive-parity`).
    pub inconclusive: bool,
}

/// The package request of a build folder and the release options.
pub(super) fn release_request(
    build_dir: PathBuf,
    r: ReleaseArgs,
    hf_dir: Option<PathBuf>,
    parity_report: Option<PathBuf>,
    accept: ParityAcceptance,
    compiled: Compiled,
) -> PackageRequest {
    PackageRequest {
        build_dir,
        layout: r.layout,
        key: r.key,
        output: r.output,
        version: r.version,
        model_id: r.model_id,
        base_url: r.base_url,
        parity_report,
        eval_report: None,
        allow_failed_parity: accept.failed,
        accept_inconclusive_parity: accept.inconclusive,
        zip: r.zip,
        on_locked: OnLocked::from_no_wait(r.no_wait),
        hf_dir,
        no_tokenizer: r.no_tokenizer,
        rope_positions: r.rope_positions,
        compiled,
        allow_audit_findings: r.allow_audit_findings,
        allow_over_ceiling: r.allow_over_ceiling,
        encoders_from: r.encoders_from,
        audit: None,
        onto: None,
        onto_public_key: None,
        allow_unverified_onto: false,
    }
}

/// The side files, then one line for the terminal.
pub(super) fn summary(r: &PackageReport, request: &PackageRequest) -> String {
    let side = &r.side_files;
    let mut s = format!(
        "side files: {} files, {:.1} MiB in {:.2}s ({:.0} MiB/s); hf_model/: {}\n",
        side.files.len(),
        side.bytes_written() as f64 / (1024.0 * 1024.0),
        side.seconds,
        side.bytes_written() as f64 / (1024.0 * 1024.0) / side.seconds.max(1e-9),
        if r.hf_model.is_empty() {
            "-".to_string()
        } else {
            r.hf_model
                .iter()
                .map(|p| p.trim_start_matches("hf_model/"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    s.push_str(&format!(
        "wrote release {} ({} files, {:.1} MiB, subject sha256 {}) with {SIG_FILE}; the device bench: {RUNBOOK_FILE}",
        request.output.display(),
        r.files,
        r.bytes as f64 / (1024.0 * 1024.0),
        r.root_digest,
    ));
    if let Some((z, d)) = &r.zip {
        s.push_str(&format!("; archive {} (sha256 {d})", z.display()));
    }
    if !r.audit_errors.is_empty() {
        s.push_str(&format!(
            "; with audit errors ({}, --allow-audit-findings)",
            rule_counts_text(&r.audit_errors)
        ));
    }
    if !r.audit_warnings.is_empty() {
        s.push_str(&format!(
            "; audit warnings: {}",
            rule_counts_text(&r.audit_warnings)
        ));
    }
    s
}
