//! `chunkforge eval`: what a release or build costs against its source.

use anyhow::{Context, Result};

use super::ExitStatus;
use crate::cli::EvalCmd;
use crate::eval::{self, EvalOptions};
use crate::staging;

/// Exit 0 with the report; 1 when `--fp16` finds an op that makes inf or
/// NaN the fp32 program does not.
pub fn run(args: EvalCmd, verbose: bool) -> Result<ExitStatus> {
    let report = eval::eval(&EvalOptions {
        target: &args.target,
        text: args.text.as_deref(),
        hf_dir: args.hf_dir.as_deref(),
        max_tokens: args.max_tokens,
        fp16: args.fp16,
        verbose,
    })?;
    if let Some(path) = &args.report {
        staging::write_atomic(path, &serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing the eval report {}", path.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", eval::render(&report));
    }
    let range_ok = report.result.fp16_range.as_ref().is_none_or(|r| r.ok);
    Ok(if range_ok {
        ExitStatus::Success
    } else {
        ExitStatus::CheckFailed
    })
}
