//! `chunkforge parity`: merged layouts vs the four-chunk reference, the
//! reference vs transformers, verify_qK and prefill hand-off, and INT4
//! artifacts. The numbers and each check's verdict come from Python (torch,
//! fp32 CPU) as a typed `ParityReport`; printing and the report file are here.

use std::path::Path;

use anyhow::{bail, Context, Result};
use schemars::JsonSchema;

use crate::builtin;
use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::hashing;
use crate::layouts::{spec, Purpose, REFERENCE};
use crate::manifest::Build;
use crate::parity_checks::CHECKS;
use crate::plan::{self, LayoutKind, Plan};
use crate::progress;
use crate::py::calls;
use crate::py::contract::{CheckpointFiles, DimsOnly, ParityLayout, ParityRequest};
use crate::records::{ParityCheckpoint, ParityReport, ToolVersions, PARITY_FORMAT};
use crate::staging;

use crate::settings::ParitySettings;

/// The default prompt shipped in `parity/default_prompt.json`: fixed random
/// ids, for a checkpoint that has no prompt of its own.
pub const DEFAULT_PROMPT: &str = include_str!("../parity/default_prompt.json");
/// The built-in checkpoint's default prompt, `parity/builtin_prompt.json`:
/// the task it was trained on (counting in words), as its tokenizer encodes it.
pub const BUILTIN_PROMPT: &str = include_str!("../parity/builtin_prompt.json");

/// The prompt parity feeds without `--prompt-ids`: for the built-in
/// checkpoint its trained task, where its next-token guesses are confident,
/// so INT4's top-1 agreement measures the palettization and not how often
/// near-ties on text it never saw flip (on the random ids it sits at
/// `--min-top1-int4` itself); for any other checkpoint the random ids.
pub fn default_prompt(hf_dir: &Path) -> Result<Vec<i64>> {
    #[derive(serde::Deserialize, JsonSchema)]
    struct Prompt {
        prompt_ids: Vec<i64>,
    }
    let text = if is_builtin(hf_dir) {
        BUILTIN_PROMPT
    } else {
        DEFAULT_PROMPT
    };
    let p: Prompt = serde_json::from_str(text)?;
    Ok(p.prompt_ids)
}

/// Whether `hf_dir` is the built-in checkpoint's folder (`builtin::dir`).
fn is_builtin(hf_dir: &Path) -> bool {
    match (hf_dir.canonicalize(), builtin::dir().canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Runs parity and writes `--report`; returns the report (its
/// `summary.ok`: whether everything passed).
pub fn run(
    hf_dir: &Path,
    cfg: &TextConfig,
    ckpt: &Checkpoint,
    opts: &ParitySettings,
    verbose: bool,
) -> Result<ParityReport> {
    if opts.steps == 0 {
        bail!("--steps must be at least 1");
    }
    // `--prefill N` without prefill functions in the request checks one of exactly N tokens.
    let mut functions = opts.functions.clone();
    if opts.prefill > 0 && functions.prefill_lens.is_empty() {
        functions.prefill_lens = vec![opts.prefill];
    }
    let requested: Plan = plan::plan(cfg, opts.ctx, opts.mode, opts.split.as_deref(), &functions)?;
    let four = match requested.layouts.iter().find(|l| l.kind == REFERENCE) {
        Some(l) => l.clone(),
        None => {
            let spans = plan::layout_spans(cfg, REFERENCE)
                .context("the reference layout has fixed spans")?;
            plan::plan_layout(cfg, opts.ctx, REFERENCE, &spans)
        }
    };
    let decode = |l: &&plan::Layout| spec(l.kind).purpose == Purpose::Decode;
    let compared: Vec<&plan::Layout> = requested
        .layouts
        .iter()
        .filter(decode)
        .filter(|l| l.kind != REFERENCE)
        .collect();
    let prefill_layout = requested
        .layouts
        .iter()
        .find(|l| l.kind == LayoutKind::Prefill)
        .map(ParityLayout::from);
    let mut layouts = vec![ParityLayout::from(&four)];
    layouts.extend(compared.iter().map(|l| ParityLayout::from(*l)));
    let artifact_layouts = requested
        .layouts
        .iter()
        .filter(decode)
        .map(|l| (l.kind, ParityLayout::from(l)))
        .collect();
    let prompt = match &opts.prompt_ids {
        Some(p) => p.clone(),
        None => default_prompt(hf_dir)?,
    };
    let req = ParityRequest {
        plan: DimsOnly {
            dims: &requested.dims,
        },
        reference: REFERENCE,
        layouts,
        checkpoint: CheckpointFiles::of(ckpt),
        config_path: hf_dir.join("config.json").to_string_lossy().into_owned(),
        prompt_ids: &prompt,
        steps: opts.steps,
        checks: CHECKS.iter().map(|c| c.name).collect(),
        thresholds: opts.thresholds,
        prefill: opts.prefill,
        prefill_layout,
        oracle: opts.oracle,
        #[cfg(feature = "test-hooks")]
        sabotage: opts.sabotage.clone(),
        artifacts: opts
            .artifacts
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned()),
        artifacts_precision: opts
            .artifacts
            .as_deref()
            .map(|dir| -> Result<&'static str> {
                let build = Build::load(dir)?;
                Ok(match build.record.settings.palettization {
                    Some(_) => "INT4",
                    None => "FP16",
                })
            })
            .transpose()?,
        artifact_layouts,
    };
    for w in &requested.warnings {
        eprintln!("note: {w}");
    }
    let sp = progress::spinner(format!(
        "parity: {} steps, layouts {} vs four-chunk reference{}",
        opts.steps,
        compared
            .iter()
            .map(|l| l.kind.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        if opts.oracle {
            " + transformers oracle"
        } else {
            ""
        }
    ));
    #[cfg(feature = "test-hooks")]
    if req.sabotage.is_some() {
        crate::test_hooks::sabotage_importable()?;
    }
    let result =
        calls::with_progress::<calls::Parity>(&req, verbose, progress::phases(&sp, "parity"));
    sp.finish_and_clear();
    let mut report = result?;
    // The run's verdict is what Python's checks counted; the rows they wrote
    // must say the same, check by check (`parity_checks::CHECKS`).
    let (told, rows) = (report.summary.verdict(), report.verdict_of_checks());
    if told != rows {
        bail!(
            "parity.run said {told}, but its checks' rows say {rows}: a check's unit \
             (python/chunkforge_py/parity/) left a row out of its verdicts"
        );
    }
    report.format = PARITY_FORMAT.into();
    // Absolute, as build.json records it; the weights, so that `package`
    // can tell a report about another seed or a fine-tune with the same
    // config.json.
    let dir = std::path::absolute(hf_dir)
        .with_context(|| format!("{}: cannot make the path absolute", hf_dir.display()))?;
    report.checkpoint = ParityCheckpoint {
        dir: dir.to_string_lossy().into_owned(),
        config_sha256: hashing::sha256_file(&hf_dir.join("config.json"))?,
        weights: Some(hashing::weights_digest(ckpt)?),
    };
    report.prompt_ids = prompt.iter().take(opts.steps).copied().collect();
    report.tool = ToolVersions {
        chunkforge: env!("CARGO_PKG_VERSION").into(),
        python: crate::py::env::versions(verbose)?,
    };
    if let Some(path) = &opts.report {
        staging::write_atomic(path, &serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing the parity report {}", path.display()))?;
    }
    Ok(report)
}
