//! What a conversion costs, as `chunkforge eval` reports it (schema:
//! `eval/report.schema.json`) and a release's manifest records it
//! (`release --eval`, `package --eval-report`): perplexity, KL and top-1 of
//! each decode layout's programs against transformers over a text, and the
//! fp16 range of the programs (python/chunkforge_py/quality/text.py,
//! mil/fp16range.py). Python computes the figures ([`EvalResult`]); Rust adds
//! what it knows ([`EvalReport`]).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use crate::fp16range::{Fp16Op, Fp16RangeReport};
use crate::plan::LayoutKind;
use crate::records::{ParityCheckpoint, ToolVersions};

/// `format` of an eval report.
pub const EVAL_FORMAT: &str = "chunkforge-eval/1";

/// A position where the package's top-1 token is not the source's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Disagreement {
    /// The position whose logits predict the next token.
    pub position: u64,
    pub source_token: i64,
    pub package_token: i64,
    /// The source's top logit minus its runner-up's there.
    pub source_margin: f64,
}

/// One decode layout's programs against the source.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LayoutQuality {
    pub layout: LayoutKind,
    pub chunks: Vec<String>,
    pub perplexity: f64,
    /// Mean negative log-likelihood per scored token, nats.
    pub nll: f64,
    /// KL(source ‖ package) per position, nats: mean and largest.
    pub kl_mean: f64,
    pub kl_max: f64,
    pub kl_max_position: u64,
    /// The share of positions whose top-1 token is the source's.
    pub top1: f64,
    pub disagreements: Vec<Disagreement>,
    /// The largest |package logit - source logit| over every position and token.
    pub max_logit_error: f64,
    pub seconds: f64,
}

/// The source model (transformers on the source checkpoint, fp32).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SourceQuality {
    pub perplexity: f64,
    pub nll: f64,
    /// The smallest top-2 margin of the source over the scored positions.
    pub min_margin: f64,
    pub seconds: f64,
}

/// What Python computes (contract.py `EvalResult`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EvalResult {
    /// Tokens of the text taken (`<bos>` first); one fewer positions are scored.
    pub tokens: u64,
    pub positions: u64,
    pub source: SourceQuality,
    pub layouts: Vec<LayoutQuality>,
    pub fp16_range: Option<Fp16RangeReport>,
    pub seconds: f64,
}

/// The text an eval read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EvalText {
    /// `default` (the project's text, eval/default.txt) or the file given.
    pub name: String,
    #[schemars(pattern("^[0-9a-f]{64}$"))]
    pub sha256: String,
}

/// `chunkforge eval --json` (schema: eval/report.schema.json).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "chunkforge eval report")]
pub struct EvalReport {
    #[schemars(extend("const" = EVAL_FORMAT))]
    pub format: String,
    /// The release or build folder evaluated.
    pub target: String,
    /// `release` or `build`.
    pub kind: String,
    /// `INT4` (palettized) or `FP16` packages.
    pub precision: String,
    /// The programs ran with every fp16 op output rounded to fp16 (`--fp16`).
    pub fp16: bool,
    pub text: EvalText,
    /// The source checkpoint transformers ran.
    pub checkpoint: ParityCheckpoint,
    pub tool: ToolVersions,
    #[serde(flatten)]
    pub result: EvalResult,
}

/// One layout's figures as a manifest records them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct LayoutFigures {
    pub layout: LayoutKind,
    pub perplexity: f64,
    pub kl_mean: f64,
    pub kl_max: f64,
    pub top1: f64,
    pub disagreements: u64,
    /// The largest source top-2 margin among the disagreements (None: none).
    pub largest_disagreement_margin: Option<f64>,
}

/// An eval report as a release's manifest embeds it (`eval`): what the
/// release costs against its source, without the per-position detail.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct EmbeddedEval {
    #[schemars(extend("const" = EVAL_FORMAT))]
    pub format: String,
    pub precision: String,
    pub fp16: bool,
    pub text: EvalText,
    pub tokens: u64,
    pub source_perplexity: f64,
    pub layouts: Vec<LayoutFigures>,
    /// The op nearest to fp16 overflow, when the programs ran in fp16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16_nearest: Option<Fp16Op>,
    /// Whether no op made inf or NaN in fp16 that fp32 does not (None: not run in fp16).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16_ok: Option<bool>,
}

impl EvalReport {
    /// What a manifest records of it.
    pub fn embedded(&self) -> EmbeddedEval {
        EmbeddedEval {
            format: EVAL_FORMAT.into(),
            precision: self.precision.clone(),
            fp16: self.fp16,
            text: self.text.clone(),
            tokens: self.result.tokens,
            source_perplexity: self.result.source.perplexity,
            layouts: self
                .result
                .layouts
                .iter()
                .map(|l| LayoutFigures {
                    layout: l.layout,
                    perplexity: l.perplexity,
                    kl_mean: l.kl_mean,
                    kl_max: l.kl_max,
                    top1: l.top1,
                    disagreements: l.disagreements.len() as u64,
                    largest_disagreement_margin: l
                        .disagreements
                        .iter()
                        .map(|d| d.source_margin)
                        .reduce(f64::max),
                })
                .collect(),
            fp16_nearest: self
                .result
                .fp16_range
                .as_ref()
                .and_then(|r| r.closest.first().cloned()),
            fp16_ok: self.result.fp16_range.as_ref().map(|r| r.ok),
        }
    }
}
