//! `chunkforge run`: generate from a release folder through the emulated runtime.

use anyhow::{Context, Result};

use super::ExitStatus;
use crate::cli::values::parse_prompt;
use crate::cli::RunCmd;
use crate::gate::{self, GateInput};
use crate::layouts::VerifyCommit;
use crate::run::{self, Prompt, RunOptions, RunResult};
use crate::staging;

pub fn run(args: RunCmd, verbose: bool) -> Result<ExitStatus> {
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => Prompt::Ids(parse_prompt(ids)?),
        (Some(text), None) => Prompt::Text(text.clone()),
        (None, None) => unreachable!("clap requires --prompt or --prompt-ids"),
    };
    let mut result = run::run(&RunOptions {
        release: &args.release_dir,
        prompt,
        max_tokens: args.max_tokens as usize,
        layout: args.layout,
        runtime: args.runtime.map(|r| r.runtime()),
        speculate: args.speculate,
        fp16: args.fp16,
        verbose,
    })?;
    let mut status = ExitStatus::Success;
    if args.against_source {
        let transcript = gate::against_source(
            &GateInput {
                release: &args.release_dir,
                prompt: args.prompt.as_deref(),
                max_tokens: args.max_tokens as usize,
                fp16: args.fp16,
                near_tie: args.near_tie,
                hf_dir: args.hf_dir.as_deref(),
                verbose,
            },
            &result,
        )?;
        if let Some(path) = &args.transcript {
            staging::write_atomic(path, &serde_json::to_vec_pretty(&transcript)?)
                .with_context(|| format!("writing the transcript {}", path.display()))?;
        }
        if !transcript.judged.pass {
            status = ExitStatus::CheckFailed;
        }
        result.gate = Some(transcript);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        render(&result);
    }
    Ok(status)
}

fn render(r: &RunResult) {
    eprintln!(
        "layout {} ({}), {}; packages as the app's {} download has them",
        r.layout,
        r.chunks.join(", "),
        r.picked_by,
        r.download
    );
    eprintln!(
        "prompt: {} tokens, {} prefilled by {} in {:.2}s",
        r.prompt_ids.len(),
        r.prefill_tokens,
        r.prefill_function,
        r.prefill_seconds
    );
    match &r.text {
        Some(t) => println!("{t}"),
        None => println!(
            "{}",
            r.generated_ids
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        ),
    }
    eprintln!(
        "generated {} tokens (stopped: {}); {:.1} tok/s decode, {} (packages loaded in {:.1}s)",
        r.generated_ids.len(),
        r.stopped,
        r.decode_tokens_per_second,
        r.note,
        r.load_seconds
    );
    if let Some(t) = &r.gate {
        eprintln!(
            "against the source (transformers, {}): {}",
            t.checkpoint.dir,
            t.judged.line("the release", t.source.ids.len(), t.near_tie)
        );
    }
    if let Some(s) = &r.speculation {
        eprintln!(
            "speculation: verify_q{} x {} calls, {} of {} prompt-lookup drafts accepted, committed {}",
            s.k,
            s.calls,
            s.accepted_drafts,
            s.drafts,
            match s.commit {
                VerifyCommit::AcceptedRows => "as main does: the accepted rows written into the caches".to_string(),
                VerifyCommit::WriteThrough => format!(
                    "as the branch does (write-through): every call's caches copied back whole, so {} rows of rejected drafts stayed in the window caches and later steps attended to them",
                    s.stale_rows
                ),
            }
        );
    }
}
