//! `chunkforge parity`: merged layouts vs the four-chunk reference, the
//! reference vs transformers, verify_qK and prefill hand-off, and INT4
//! artifacts. The numbers and each check's verdict come from Python (torch,
//! fp32 CPU) as a typed `ParityReport`; printing and the report file are here.

use std::path::Path;

use anyhow::{bail, Context, Result};
use indexmap::IndexMap;
use schemars::JsonSchema;
use serde::Serialize;

use crate::builtin;
use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::hashing;
use crate::layouts::{spec, Purpose, REFERENCE};
use crate::manifest::Build;
use crate::plan::{self, LayoutKind, Plan};
use crate::progress;
use crate::py::calls::{self, CheckpointFiles};
use crate::records::{ParityCheckpoint, ParityReport, ToolVersions, PARITY_FORMAT};
use crate::staging;

pub use crate::settings::ParitySettings;
#[cfg(feature = "test-hooks")]
pub use crate::test_hooks::Sabotage;

/// `--steps`.
pub const DEFAULT_STEPS: usize = 16;
/// `--tol-cos`: the minimum cosine of the final normed hidden state per step.
pub const DEFAULT_TOL_COS: f64 = 0.9999;
/// `--tol-cos-int4`.
pub const DEFAULT_TOL_COS_INT4: f64 = 0.85;
/// `--min-top1-int4`.
pub const DEFAULT_MIN_TOP1_INT4: f64 = 0.75;
/// `--max-weight-rel-mse`.
pub const DEFAULT_MAX_WEIGHT_REL_MSE: f64 = 0.03;

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

/// Parses `--prompt-ids 2,105,23` (commas or spaces).
pub fn parse_prompt(text: &str) -> Result<Vec<i64>> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<i64>()
                .with_context(|| format!("--prompt-ids: `{s}` is not a token id"))
        })
        .collect()
}

/// A layout as parity compares it: named by its kind.
#[derive(Serialize, JsonSchema)]
pub struct ParityLayout<'a> {
    name: LayoutKind,
    chunks: &'a [plan::ChunkPlan],
    kv_slot_map: &'a [plan::SlotCopy],
}

impl<'a> From<&'a plan::Layout> for ParityLayout<'a> {
    fn from(l: &'a plan::Layout) -> Self {
        ParityLayout {
            name: l.kind,
            chunks: &l.chunks,
            kv_slot_map: &l.kv_slot_map,
        }
    }
}

#[derive(Serialize, JsonSchema)]
pub struct DimsOnly<'a> {
    dims: &'a plan::Dims,
}

/// What `parity.run` is asked to check (contract.py `ParityRequest`).
#[derive(Serialize, JsonSchema)]
pub struct ParityRequest<'a> {
    plan: DimsOnly<'a>,
    /// The layout every other one is compared against.
    reference: LayoutKind,
    /// The decode layouts (the layout table's `Purpose::Decode` rows), the
    /// reference first: Python judges exactly these records as the
    /// reference's own computation (`judge_steps`); every other step
    /// record is a function's.
    layouts: Vec<ParityLayout<'a>>,
    checkpoint: CheckpointFiles,
    config_path: String,
    prompt_ids: &'a [i64],
    steps: usize,
    tol_cos: f64,
    prefill: usize,
    prefill_layout: Option<ParityLayout<'a>>,
    skip_prefill_copy: bool,
    oracle: bool,
    /// A weight broken on purpose (test builds only).
    #[cfg(feature = "test-hooks")]
    #[serde(flatten)]
    sabotage: Option<Sabotage>,
    artifacts: Option<String>,
    /// `INT4` for a palettized build, `FP16` for a `--no-quantize` one.
    artifacts_precision: Option<&'static str>,
    artifact_layouts: IndexMap<LayoutKind, ParityLayout<'a>>,
    tol_cos_int4: f64,
    min_top1_int4: f64,
    max_weight_rel_mse: f64,
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
        tol_cos: opts.tol_cos,
        prefill: opts.prefill,
        prefill_layout,
        skip_prefill_copy: opts.skip_prefill_copy,
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
        tol_cos_int4: opts.tol_cos_int4,
        min_top1_int4: opts.min_top1_int4,
        max_weight_rel_mse: opts.max_weight_rel_mse,
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
    let result =
        calls::with_progress::<calls::Parity>(&req, verbose, progress::phases(&sp, "parity"));
    sp.finish_and_clear();
    let mut report = result?;
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
        python: calls::versions(verbose)?,
    };
    if let Some(path) = &opts.report {
        staging::write_atomic(path, &serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing the parity report {}", path.display()))?;
    }
    Ok(report)
}
