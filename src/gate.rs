//! The free-running gate (`run --against-source`): the release's greedy
//! tokens (`run`) against transformers' on the source checkpoint
//! (python/chunkforge_py/quality/gate.py), judged by the transcript's rule
//! (`bench::transcript`: the first divergence fails unless the source's
//! top-2 margin there is under the near-tie threshold), written as a
//! transcript a device's tokens can be held to (`device-report --transcript`).

use std::path::Path;

use anyhow::{Context, Result};

use crate::bench::transcript::{judge, ReleaseStream, Stream, Transcript, TRANSCRIPT_FORMAT};
use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::folder::ReleaseFolder;
use crate::hashing;
use crate::manifest::MANIFEST_FILE;
use crate::py::calls;
use crate::py::contract::{CheckpointFiles, SourceGreedyRequest};
use crate::records::{ParityCheckpoint, ToolVersions};
use crate::run::RunResult;

/// What the gate compares: the release's run and how it was asked for.
pub struct GateInput<'a> {
    pub release: &'a Path,
    pub prompt: Option<&'a str>,
    pub max_tokens: usize,
    pub fp16: bool,
    pub near_tie: f64,
    /// The source checkpoint (None: the built-in one, when it is the release's).
    pub hf_dir: Option<&'a Path>,
    pub verbose: bool,
}

/// transformers' greedy stream for `run`'s prompt, and the transcript of the two.
pub fn against_source(g: &GateInput, run: &RunResult) -> Result<Transcript> {
    let folder = ReleaseFolder::open(g.release)?;
    let source = crate::eval::source_of(&folder.dir.join("hf_model/config.json"), g.hf_dir)?;
    let cfg = TextConfig::load(&source)?;
    let ckpt = Checkpoint::open(&source, &cfg)?;
    let sp = crate::progress::spinner(format!(
        "transformers on {}: {} greedy tokens",
        source.display(),
        g.max_tokens
    ));
    let got = calls::call::<calls::SourceGreedyOf>(
        &SourceGreedyRequest {
            checkpoint: CheckpointFiles::of(&ckpt),
            config_path: source.join("config.json").to_string_lossy().into_owned(),
            prompt_ids: &run.prompt_ids,
            max_tokens: g.max_tokens,
        },
        g.verbose,
    );
    sp.finish_and_clear();
    let got = got?;
    let stream = Stream {
        ids: got.generated_ids,
        margins: got.margins,
    };
    let judged = judge(&stream, &run.generated_ids, g.near_tie);
    let dir = std::path::absolute(&source)
        .with_context(|| format!("{}: cannot make the path absolute", source.display()))?;
    Ok(Transcript {
        format: TRANSCRIPT_FORMAT.into(),
        prompt: g.prompt.map(str::to_string),
        prompt_ids: run.prompt_ids.clone(),
        max_tokens: g.max_tokens,
        near_tie: g.near_tie,
        source: stream,
        release: ReleaseStream {
            ids: run.generated_ids.clone(),
            margins: run.margins.clone(),
            folder: g.release.display().to_string(),
            version: folder.manifest.release.version.clone(),
            layout: run.layout,
            fp16: g.fp16,
            manifest_sha256: hashing::sha256_file(&folder.dir.join(MANIFEST_FILE))?,
        },
        judged,
        checkpoint: ParityCheckpoint {
            dir: dir.to_string_lossy().into_owned(),
            config_sha256: hashing::sha256_file(&source.join("config.json"))?,
            weights: Some(hashing::weights_digest(&ckpt)?),
        },
        tool: ToolVersions {
            chunkforge: env!("CARGO_PKG_VERSION").into(),
            python: crate::py::env::versions(g.verbose)?,
        },
    })
}
