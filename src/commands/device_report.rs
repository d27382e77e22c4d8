//! `chunkforge device-report`: device bench logs (the runtime's own lines)
//! into a verdict per decode layout, by DEVICE_RUNBOOK.md's rules.

use anyhow::Result;
use clap::Args;

use super::ExitStatus;
use crate::cli::named;
use chunkforge_release::device_report::{read_logs, report, Level};

/// `chunkforge device-report`.
#[derive(Args, Clone, Debug)]
pub struct DeviceReportCmd {
    /// Device logs, one file per run (one launch of the app), each optionally
    /// labelled with the layout it was meant to run: LAYOUT=FILE (four, three,
    /// two, one), e.g. two=two-1.log.
    #[arg(required = true, value_name = "LOG")]
    pub logs: Vec<String>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 unless every layout with a target reaches this verdict, with
    /// no error finding and no unparsed runtime line.
    #[arg(long, value_parser = named::<Level>())]
    pub require: Option<Level>,
}

/// Exit 0 with the report; 1 when `--require` is not met; 2 when a log
/// cannot be read.
pub fn run(args: DeviceReportCmd) -> Result<ExitStatus> {
    let logs = read_logs(&args.logs)?;
    let mut r = report(&logs);
    let met = args.require.map(|level| r.require(level));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", r.render());
    }
    Ok(match met {
        Some(false) => ExitStatus::CheckFailed,
        _ => ExitStatus::Success,
    })
}
