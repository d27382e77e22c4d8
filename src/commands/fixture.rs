//! `chunkforge fixture`: a random-weight Gemma 4 checkpoint.

use anyhow::Result;

use super::ExitStatus;
use crate::cli::FixtureCmd;
use crate::fixture::{self, FixtureArgs};
use crate::py::env as pyenv;

pub fn run(args: FixtureCmd, verbose: bool) -> Result<ExitStatus> {
    pyenv::activate(verbose)?;
    let request = FixtureArgs {
        shape: args.shape,
        seed: args.seed,
        multimodal: args.multimodal,
        shards: args.shards.max(1),
        sliding_window: args.sliding_window,
        vocab_size: args.vocab_size,
        full_width: args.full_width,
    };
    let info = fixture::write(&args.out, &request, verbose)?;
    eprintln!(
        "wrote {} checkpoint to {} ({} tensors, {} parameters)",
        args.shape,
        args.out.display(),
        info.tensors,
        info.parameters
    );
    Ok(ExitStatus::Success)
}
