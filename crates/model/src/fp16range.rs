//! The fp16 range of the programs a run executed in fp16
//! (python/chunkforge_py/mil/fp16range.py): the largest |value| of every
//! fp16-typed op output, the ops nearest to overflow, and those that make inf
//! or NaN in fp16 only. `parity --artifacts` records it in its summary
//! ([`crate::records`]) and `eval --fp16` in its report ([`crate::quality`]);
//! both import it, and it imports neither.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One fp16-typed op output as the fp16 runs saw it (contract.py `Fp16Op`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Fp16Op {
    pub package: String,
    pub function: String,
    pub op: String,
    pub op_type: String,
    /// The audit's place of the op: a layer index, `pre` or `head`.
    pub layer: String,
    /// The largest finite |value| the op computed before rounding to fp16.
    pub max_abs: f64,
    /// log2(65504 / max_abs): the doublings left before overflow (None: all zero).
    pub margin_log2: Option<f64>,
    /// Elements finite before the rounding to fp16 and inf after.
    pub overflow: u64,
    /// Elements inf or NaN where none of the op's inputs was, in the fp16 runs.
    pub made_nonfinite_fp16: u64,
    /// The same in the fp32 runs (None: none ran).
    pub made_nonfinite_fp32: Option<u64>,
}

impl Fp16Op {
    /// `op_type op (package function, layer L)`.
    pub fn name(&self) -> String {
        format!(
            "{} {} ({} {}, layer {})",
            self.op_type, self.op, self.package, self.function, self.layer
        )
    }
}

/// The fp16 range of the programs a run executed in fp16 (contract.py `Fp16RangeReport`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Fp16RangeReport {
    pub fp16_max: f64,
    pub fp16_runs: u64,
    pub fp32_runs: u64,
    /// fp16-typed op outputs seen.
    pub outputs: u64,
    /// The outputs nearest to overflow, nearest first.
    pub closest: Vec<Fp16Op>,
    /// Ops that make inf or NaN in fp16 and not in fp32: the failure.
    pub introduced: Vec<Fp16Op>,
    pub ok: bool,
    /// Every output, nearest first (not kept where the report is embedded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub every: Vec<Fp16Op>,
}

impl Fp16RangeReport {
    /// The line a report prints: the nearest op and its margin, or the op that overflows.
    pub fn line(&self) -> String {
        if let Some(bad) = self.introduced.first() {
            return format!(
                "fp16 range: FAIL: {} makes inf or NaN in fp16 that the fp32 program does not ({} elements; largest finite |value| {:.4e})",
                bad.name(),
                bad.made_nonfinite_fp16,
                bad.max_abs
            );
        }
        match self.closest.first() {
            Some(op) => format!(
                "fp16 range: nearest to overflow (65504): {}, |value| up to {:.4e}, {}",
                op.name(),
                op.max_abs,
                op.margin_log2
                    .map_or("all zero".into(), |m| format!("2^{m:.2} below"))
            ),
            None => "fp16 range: no fp16 op output seen".into(),
        }
    }

    /// Without `every` (for embedding).
    pub fn summary(&self) -> Self {
        Self {
            every: Vec::new(),
            ..self.clone()
        }
    }
}
