//! `chunkforge run`: text from a release folder alone, through the app's
//! runtime emulated on the CPU (Python, torch). The folder is opened and
//! checked here (`folder.rs`); the emulation is `chunkforge_py.emulate`.

use std::path::Path;

use anyhow::{bail, Result};

pub use crate::folder::RunLayout;
use crate::folder::{ReleaseFolder, RunPlan};
use crate::layouts::{spec, Missing, Runtime, REFERENCE};
use crate::plan;
use crate::py::calls;
use crate::py::contract::{RunFiles, RunRequest};
pub use crate::py::contract::{RunResult, Speculation};

/// What to generate.
pub struct RunOptions<'a> {
    pub release: &'a Path,
    pub prompt: Prompt,
    pub max_tokens: usize,
    pub layout: RunLayout,
    /// The runtime build whose layout pick and download to follow (None:
    /// either build's pick, main's first; the download of a build that
    /// loads the layout).
    pub runtime: Option<Runtime>,
    pub speculate: Option<usize>,
    /// Round every fp16 op output to fp16 in the interpreter.
    pub fp16: bool,
    pub verbose: bool,
}

pub enum Prompt {
    Text(String),
    Ids(Vec<i64>),
}

/// Opens and checks the folder, plans the layouts, then starts Python and
/// runs the emulation.
pub fn run(o: &RunOptions) -> Result<RunResult> {
    let folder = ReleaseFolder::open(o.release)?;
    folder.check_files()?;
    let RunPlan {
        decode,
        four,
        prefill,
        picked_by,
        packages,
        entry,
    } = folder.plan(o.layout, o.runtime)?;
    if o.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let tokenizer = folder.tokenizer();
    if matches!(o.prompt, Prompt::Text(_)) && tokenizer.is_none() {
        bail!(
            "{}: the release has no tokenizer (packaged with --no-tokenizer); pass --prompt-ids",
            o.release.join("hf_model/tokenizer.json").display()
        );
    }
    let reference = spec(REFERENCE);
    let decode = match (o.speculate, o.layout, decode.kind) {
        (Some(_), RunLayout::Auto, _) => four.clone(),
        (Some(_), _, k) if k != REFERENCE => bail!(
            "--speculate verifies with {}'s verify_qK, so it runs the {} layout: use --layout {} or auto",
            reference.range(),
            reference.runtime.map_or(REFERENCE.as_str(), |rt| rt.name),
            REFERENCE
        ),
        _ => decode,
    };
    if let Some(k) = o.speculate {
        let last = four.chunks.last().map_or("", |c| c.name.as_str());
        let have = four
            .chunks
            .last()
            .and_then(|c| {
                c.functions
                    .iter()
                    .find(|f| f.kind == plan::FunctionKind::Verify)
            })
            .map(|f| f.tokens);
        match have {
            None => bail!(
                "{}: {last} has no verify_qK function (build with --mode all or --verify-k)",
                o.release.display()
            ),
            Some(have) if have != k => bail!(
                "--speculate {k}: {last}'s verify function takes {have} tokens per call (verify_q{have}); use --speculate {have}"
            ),
            _ => {}
        }
        // What this runtime build reads from verify_qK: a missing output the
        // app force-unwraps crashes it, an optional one skips the commit.
        let contract = entry.runtime.verify();
        for r in contract.reads {
            let Some(c) = four.chunks.get(r.chunk) else {
                continue;
            };
            let has = c
                .functions
                .iter()
                .filter(|f| f.kind == plan::FunctionKind::Verify)
                .any(|f| f.outputs.iter().any(|t| t.name == r.output));
            if !has {
                bail!(
                    "{}: {}'s verify_qK returns no {}, which {} reads ({}): {}",
                    o.release.display(),
                    c.name,
                    r.output,
                    entry.runtime.describe(),
                    contract.source,
                    match r.missing {
                        Missing::Crashes => "the app would crash on the first verify call",
                        Missing::SkipsCommit => "its commit would be skipped and decode would go on without the verified rows",
                    }
                );
            }
        }
    }
    let files = RunFiles::new(
        &|name| folder.side_file(name).to_string_lossy().into_owned(),
        tokenizer.map_or_else(String::new, |p| p.to_string_lossy().into_owned()),
    );
    let req = RunRequest {
        release: o.release.to_string_lossy().into_owned(),
        packages: &packages,
        dims: plan::Dims {
            // What the runtime reads from model_config.json (checked to
            // agree with the plan when the folder was opened).
            embed_scale: folder.embed_scale,
            per_layer_embed_scale: folder.per_layer_embed_scale,
            ..plan::dims(&folder.cfg, folder.context_length)
        },
        decode: &decode,
        reference: &four,
        prefill: &prefill,
        files,
        prompt: match &o.prompt {
            Prompt::Text(t) => Some(t),
            Prompt::Ids(_) => None,
        },
        prompt_ids: match &o.prompt {
            Prompt::Ids(ids) => Some(ids),
            Prompt::Text(_) => None,
        },
        max_tokens: o.max_tokens,
        speculate: o.speculate,
        verify_commit: entry.runtime.verify().commit,
        eos_token_ids: &folder.eos_token_ids,
        fp16: o.fp16,
    };
    // Python starts only once the folder has passed every check above.
    crate::py::env::activate(o.verbose)?;
    let sp = crate::progress::spinner(format!(
        "run: {} layout ({}), {} new tokens at most",
        decode.kind.as_str(),
        decode
            .chunks
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        o.max_tokens
    ));
    let result = calls::with_progress::<calls::Emulate>(
        &req,
        o.verbose,
        crate::progress::phases(&sp, "run"),
    );
    sp.finish_and_clear();
    let mut result: RunResult = result?;
    result.picked_by = if o.speculate.is_some() && o.layout == RunLayout::Auto {
        format!("--speculate (verify_qK lives in {})", reference.range())
    } else {
        picked_by.into()
    };
    result.download = entry.client.to_string();
    Ok(result)
}
