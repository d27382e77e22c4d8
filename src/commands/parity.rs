//! `chunkforge parity`: merged layouts vs the four-chunk reference, the
//! reference vs transformers; exit 1 when a check fails.

use anyhow::Result;

use super::{resolve_checkpoint, verdict, ExitStatus};
use crate::checkpoint::Checkpoint;
use crate::cli::ParityCmd;
use crate::config::TextConfig;
use crate::parity::{self, ParityOptions};
use crate::py::env as pyenv;

/// Runs parity as `args` asks; returns whether every check passed.
pub(super) fn check(args: ParityCmd, verbose: bool) -> Result<bool> {
    let dir = resolve_checkpoint(args.model.hf_dir.as_deref(), verbose)?;
    let cfg = TextConfig::load(&dir)?;
    let ckpt = Checkpoint::open(&dir, &cfg)?;
    pyenv::activate(verbose)?;
    let opts = ParityOptions {
        mode: args.mode,
        functions: args.functions.resolve(args.mode),
        split: args.split,
        steps: args.steps,
        tol_cos: args.tol_cos,
        ctx: args.ctx,
        prompt_ids: args
            .prompt_ids
            .as_deref()
            .map(parity::parse_prompt)
            .transpose()?,
        prefill: args.prefill,
        skip_prefill_copy: args.skip_prefill_copy,
        artifacts: args.artifacts,
        tol_cos_int4: args.tol_cos_int4,
        min_top1_int4: args.min_top1_int4,
        max_weight_rel_mse: args.max_weight_rel_mse,
        report: args.report,
        oracle: !args.no_oracle,
        corrupt_layer: args.corrupt_layer,
        corrupt_function: args.corrupt_function,
        verbose,
    };
    parity::run(&dir, &cfg, &ckpt, &opts)
}

pub fn run(args: ParityCmd, verbose: bool) -> Result<ExitStatus> {
    Ok(verdict(check(args, verbose)?))
}
