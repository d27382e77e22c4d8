//! `chunkforge parity`: merged layouts vs the four-chunk reference, the
//! reference vs transformers, verify_qK and prefill hand-off, and INT4
//! artifacts. The numbers and each check's verdict come from Python (torch,
//! fp32 CPU) as a typed `ParityReport`; printing and the report file are here.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use indexmap::IndexMap;
use serde::Serialize;

use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::hashing;
use crate::plan::{self, LayoutKind, Mode, Plan};
use crate::progress;
use crate::py::calls::{self, CheckpointFiles};
use crate::records::{
    ArtifactSummary, ParityCheckpoint, ParityReport, ParitySummary, ToolVersions, PARITY_FORMAT,
};
use crate::staging;

/// Options of one parity run.
pub struct ParityOptions {
    pub mode: Mode,
    /// verify_qK and prefill functions to check (`--mode all` asks for both).
    pub functions: plan::Functions,
    pub split: Option<String>,
    pub steps: usize,
    pub tol_cos: f64,
    pub ctx: usize,
    pub prompt_ids: Option<Vec<i64>>,
    pub prefill: usize,
    pub skip_prefill_copy: bool,
    pub artifacts: Option<PathBuf>,
    pub tol_cos_int4: f64,
    pub min_top1_int4: f64,
    pub max_weight_rel_mse: f64,
    pub report: Option<PathBuf>,
    pub oracle: bool,
    pub corrupt_layer: Option<usize>,
    pub corrupt_function: Option<CorruptFunction>,
    pub verbose: bool,
}

chunkforge_model::named! {
    /// `--corrupt-function` (testing aid): which modules `--corrupt-layer` corrupts.
    pub enum CorruptFunction {
        Verify = "verify",
        Prefill = "prefill",
    }
}

/// The default prompt shipped in `parity/default_prompt.json`.
pub const DEFAULT_PROMPT: &str = include_str!("../parity/default_prompt.json");

fn default_prompt() -> Result<Vec<i64>> {
    #[derive(serde::Deserialize)]
    struct Prompt {
        prompt_ids: Vec<i64>,
    }
    let p: Prompt = serde_json::from_str(DEFAULT_PROMPT)?;
    Ok(p.prompt_ids)
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
#[derive(Serialize)]
struct ParityLayout<'a> {
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

#[derive(Serialize)]
struct DimsOnly<'a> {
    dims: &'a plan::Dims,
}

/// What `parity.run` is asked to check (contract.py `ParityRequest`).
#[derive(Serialize)]
struct ParityRequest<'a> {
    plan: DimsOnly<'a>,
    /// The layout every other one is compared against.
    reference: LayoutKind,
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
    corrupt_layer: Option<usize>,
    corrupt_function: Option<CorruptFunction>,
    artifacts: Option<String>,
    artifact_layouts: IndexMap<LayoutKind, ParityLayout<'a>>,
    tol_cos_int4: f64,
    min_top1_int4: f64,
    max_weight_rel_mse: f64,
}

/// Runs parity; returns whether everything passed.
pub fn run(
    hf_dir: &Path,
    cfg: &TextConfig,
    ckpt: &Checkpoint,
    opts: &ParityOptions,
) -> Result<bool> {
    if opts.steps == 0 {
        bail!("--steps must be at least 1");
    }
    // `--prefill N` without prefill functions in the request checks one of exactly N tokens.
    let mut functions = opts.functions.clone();
    if opts.prefill > 0 && functions.prefill_lens.is_empty() {
        functions.prefill_lens = vec![opts.prefill];
    }
    let requested: Plan = plan::plan(cfg, opts.ctx, opts.mode, opts.split.as_deref(), &functions)?;
    let four = match requested
        .layouts
        .iter()
        .find(|l| l.kind == LayoutKind::Four)
    {
        Some(l) => l.clone(),
        None => plan::plan_layout(
            cfg,
            opts.ctx,
            LayoutKind::Four,
            &plan::layout_spans(cfg, LayoutKind::Four),
        ),
    };
    let decode = |l: &&plan::Layout| l.kind != LayoutKind::Prefill;
    let compared: Vec<&plan::Layout> = requested
        .layouts
        .iter()
        .filter(decode)
        .filter(|l| l.kind != LayoutKind::Four)
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
        None => default_prompt()?,
    };
    let req = ParityRequest {
        plan: DimsOnly {
            dims: &requested.dims,
        },
        reference: LayoutKind::Four,
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
        corrupt_layer: opts.corrupt_layer,
        corrupt_function: opts.corrupt_function,
        artifacts: opts
            .artifacts
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned()),
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
    let result: Result<ParityReport> = calls::call("parity", "run", &req, opts.verbose);
    sp.finish_and_clear();
    let mut report = result?;
    print_checks(&report);
    report.format = PARITY_FORMAT.into();
    report.checkpoint = ParityCheckpoint {
        dir: hf_dir.to_string_lossy().into_owned(),
        config_sha256: hashing::sha256_file(&hf_dir.join("config.json"))?,
    };
    report.prompt_ids = prompt.iter().take(opts.steps).copied().collect();
    report.tool = ToolVersions {
        chunkforge: env!("CARGO_PKG_VERSION").into(),
        python: calls::versions(opts.verbose)?,
    };
    if let Some(path) = &opts.report {
        staging::write_atomic(path, &serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing the parity report {}", path.display()))?;
    }
    print_verdict(&report.summary, opts);
    Ok(report.summary.ok)
}

/// One line per step, oracle step and INT4 artifact check.
fn print_checks(report: &ParityReport) {
    let verdict = |ok: bool| if ok { "OK" } else { "FAIL" };
    for r in &report.steps {
        println!(
            "{:<6} step {:>3}  cos {:.6}  ref {:>6}  token {:>6}  margin {:>7.3}  {}",
            r.layout,
            r.step,
            r.cos,
            r.ref_token,
            r.token,
            r.margin,
            verdict(r.ok)
        );
    }
    for o in &report.oracle {
        println!(
            "reference vs transformers step {:>3}  cos {:.6}  hf {:>6}  ref {:>6}  margin {:>7.3}  {}",
            o.step,
            o.cos,
            o.hf_token,
            o.ref_token,
            o.margin,
            verdict(o.ok)
        );
    }
    for (name, s) in report.summary.artifacts.iter().flatten() {
        let replaced = s.weights_replaced();
        match s {
            ArtifactSummary::Function(f) => println!(
                // verify_qK / prefill_bN with their packages' weights, against the
                // INT4 four-chunk decode of the same build.
                "INT4 artifacts {name:<6} vs the INT4 four-chunk decode: min cos {:.6} over {} steps, tokens match: {}  ({replaced} weights read back)  {}",
                f.min_cos,
                f.steps,
                f.tokens_match,
                verdict(f.ok)
            ),
            ArtifactSummary::Layout(l) => println!(
                "INT4 artifacts {name:<6} min cos {:.6}  mean cos {:.6}  top-1 agreement {:.1}%  ({replaced} weights read back, worst relative MSE {:.2e} in {})  {}",
                l.min_cos,
                l.mean_cos,
                100.0 * l.top1_agreement,
                l.worst_weight.rel_mse,
                l.worst_weight.weight.as_deref().unwrap_or("-"),
                verdict(l.ok)
            ),
        }
    }
}

/// The verdict, and for a failure where it starts.
fn print_verdict(summary: &ParitySummary, opts: &ParityOptions) {
    let tol = opts.tol_cos;
    if summary.ok {
        println!("PARITY OK across {} steps (cos >= {tol}).", opts.steps);
        return;
    }
    println!("PARITY FAIL");
    if let Some(f) = &summary.first_failure {
        println!(
            "first failing step: layout {} step {} (cos {:.6}, token {} vs reference {})",
            f.layout, f.step, f.cos, f.token, f.ref_token
        );
    }
    for (name, loc) in summary.localisation.iter().flatten() {
        match loc.layer {
            Some(layer) => println!(
                "{name}: first divergence at layer {layer} in {} (cos {:.6} vs the reference's hidden state after that layer, step {})",
                loc.chunk.as_deref().unwrap_or("?"),
                loc.cos.unwrap_or(f64::NAN),
                loc.step
            ),
            None => println!(
                "{name}: every layer's hidden state matches the reference at step {}; the divergence is in the final norm / head",
                loc.step
            ),
        }
    }
    if summary.oracle_ok == Some(false) {
        println!("the four-chunk reference disagrees with transformers (see the `reference vs transformers` lines)");
    }
    for (name, s) in summary.artifacts.iter().flatten() {
        match s {
            ArtifactSummary::Function(f) if !f.ok => println!(
                "INT4 artifacts of {name} fail: its package's weights do not reproduce the INT4 \
                 four-chunk decode (cos >= {} and the same token at every step)",
                opts.tol_cos
            ),
            ArtifactSummary::Layout(l) if !l.ok => println!(
                "INT4 artifacts of {name} fail: thresholds --tol-cos-int4 {}, --min-top1-int4 {}, \
                 --max-weight-rel-mse {}; tokens match the other layouts' INT4 models: {}",
                opts.tol_cos_int4,
                opts.min_top1_int4,
                opts.max_weight_rel_mse,
                l.tokens_match_other_layouts
            ),
            _ => {}
        }
    }
}
