//! `chunkforge device-report`: device bench logs (the runtime's own lines)
//! into a verdict per decode layout, by DEVICE_RUNBOOK.md's rules.

use anyhow::Result;

use super::ExitStatus;
use crate::cli::DeviceReportCmd;
use chunkforge_release::bench::device_report::{read_logs, report};

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
