//! `chunkforge fixture`: a random-weight Gemma 4 checkpoint.

use anyhow::Result;

use super::ExitStatus;
use crate::cli::FixtureCmd;
use crate::fixture::{self, AttentionSharpness, FixtureArgs, FullSizeArgs};
use crate::progress;
use crate::py::env as pyenv;

pub fn run(args: FixtureCmd, verbose: bool) -> Result<ExitStatus> {
    pyenv::activate(verbose)?;
    if args.full_size {
        let request = FullSizeArgs {
            shape: args.shape,
            seed: args.seed,
            multimodal: args.multimodal,
            shards: args.shards,
            sliding_window: args.sliding_window,
            attention: args.attention.unwrap_or(AttentionSharpness::Soft),
        };
        let info = fixture::write_full_size(&args.out, &request, verbose)?;
        let w = &info.written;
        eprintln!(
            "wrote {} full-size checkpoint ({} attention) to {} ({} tensors, {} parameters, {:.2} GiB in {} shard{}) in {:.1} s, peak RSS {} MiB",
            args.shape,
            request.attention,
            args.out.display(),
            w.tensors,
            w.parameters,
            w.bytes as f64 / (1u64 << 30) as f64,
            w.shards,
            if w.shards == 1 { "" } else { "s" },
            info.seconds,
            progress::peak_rss_bytes() >> 20
        );
        return Ok(ExitStatus::Success);
    }
    let request = FixtureArgs {
        shape: args.shape,
        seed: args.seed,
        multimodal: args.multimodal,
        shards: args.shards.unwrap_or(1).max(1),
        sliding_window: args.sliding_window,
        vocab_size: args.vocab_size,
        full_width: args.full_width,
        attention: args.attention,
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
