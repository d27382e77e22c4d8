//! `chunkforge client-check`: the app's download of a release folder,
//! replayed (`chunkforge_release::client_check`), printed as a list of what
//! would fail and why.

use anyhow::Result;

use super::{verdict, ExitStatus};
use crate::cli::ClientCheckCmd;
use chunkforge_release::client_check::{check, materialize, CheckOptions, Status};

/// Exit 1 when the download would abort or the load would fail.
pub fn run(args: ClientCheckCmd) -> Result<ExitStatus> {
    let report = check(&CheckOptions {
        release: &args.release_dir,
        client: args.client,
        multimodal: args.multimodal == "on",
        can_compile: cfg!(target_os = "macos"),
    })?;
    if let Some(out) = &args.materialize {
        materialize(&report, out)?;
        eprintln!(
            "materialized {}'s download into {}",
            report.client,
            out.display()
        );
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(verdict(report.ok()));
    }
    println!(
        "{}: the {} entry ({}), {}, multimodal {}: {} requests",
        report.release,
        report.client,
        report.model_id,
        if report.compiled {
            "compiled"
        } else {
            "uncompiled"
        },
        if report.multimodal { "on" } else { "off" },
        report.requests.len()
    );
    for r in &report.requests {
        let tag = match r.status {
            Status::Present => continue,
            Status::Optional => "OPTIONAL",
            Status::NeedsCompile => "NEEDS COMPILE",
            Status::Missing => "FAIL",
        };
        println!("{tag} {}: {}", r.remote, r.why);
    }
    for p in report
        .problems
        .iter()
        .filter(|p| p.kind != chunkforge_release::client_check::ProblemKind::Request)
    {
        println!("FAIL {} [{}]: {}", p.kind, p.files.join(", "), p.message);
    }
    for n in &report.notes {
        println!("note: {n}");
    }
    let compile = report.needs_compile().len();
    if report.ok() {
        let count = |s: Status| report.requests.iter().filter(|r| r.status == s).count();
        println!(
            "OK: every request finds its file ({} present{}{}), every shared blob is the same bytes, and the context length, the hard-coded widths{} and the verify outputs agree with the runtime{}",
            count(Status::Present),
            if compile > 0 {
                format!(", {compile} to be made by `chunkforge compile`")
            } else {
                String::new()
            },
            match count(Status::Optional) {
                0 => String::new(),
                n => format!(", {n} absent that may 404"),
            },
            if report.client == chunkforge_release::downloader::Client::Branch {
                ", slot counts"
            } else {
                ""
            },
            report
                .pick
                .as_ref()
                .map(|p| format!("; it picks the {} layout", p.downloaded))
                .unwrap_or_default()
        );
        println!(
            "not checked here: that Core ML on the device compiles, loads and runs the packages (DEVICE_RUNBOOK.md)"
        );
    } else {
        eprintln!(
            "error: {}: {} problem{}{}",
            report.release,
            report.problems.len(),
            if report.problems.len() == 1 { "" } else { "s" },
            if report.aborts() {
                " (the download aborts)"
            } else {
                " (the runtime would fail to load or compute wrong results)"
            }
        );
    }
    Ok(verdict(report.ok()))
}
