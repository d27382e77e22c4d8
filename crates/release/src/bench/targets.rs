//! The device bench's targets: what a decode layout must reach on the iPhone
//! to pass or to ship (the chunk consolidation run book's "Target numbers"
//! and compute-plan audit). The one place they are written down:
//! `DEVICE_RUNBOOK.md` prints them and `chunkforge device-report` judges by
//! them.

use std::sync::LazyLock;

use chunkforge_model::layouts::{spec, Bench, LAYOUTS, REFERENCE};
use chunkforge_model::plan::LayoutKind;

/// The context length (KV cache entries) the targets are measured at.
pub const BENCH_CONTEXT: usize = 2048;

/// Cold-cache runs per layout (device rebooted before each): fewer leave the
/// verdict incomplete.
pub const COLD_RUNS: usize = 3;

/// Largest fraction of a layout's decode ops the compute plan may put off
/// the Neural Engine. More means the consolidated chunk spilled to CPU/GPU
/// (the PR #17 pattern): a regression, whatever its tok/s.
pub const MAX_OFF_NEURAL_ENGINE: f64 = 0.05;

/// The layout the others are measured against: its tok/s is the baseline,
/// it has no target of its own (its row's bench is `Control`).
pub const CONTROL: LayoutKind = REFERENCE;

/// Decode tok/s at [`BENCH_CONTEXT`] (median of the cold runs).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct TokTarget {
    pub layout: LayoutKind,
    /// The consolidation did not hurt.
    pub pass: f64,
    /// The gain justifies the extra model download.
    pub ship: f64,
}

/// The layouts with a target (their rows' bench), in layout-table order;
/// the others (the control, the three-chunk layout) get no tok/s verdict:
/// their tok/s is reported.
pub static TOK_TARGETS: LazyLock<Vec<TokTarget>> =
    LazyLock::new(|| LAYOUTS.iter().filter_map(|l| tok_target(l.kind)).collect());

pub fn tok_target(kind: LayoutKind) -> Option<TokTarget> {
    match spec(kind).runtime?.bench {
        Bench::Target { pass, ship } => Some(TokTarget {
            layout: kind,
            pass,
            ship,
        }),
        Bench::Control | Bench::Measured => None,
    }
}

/// Whether the compute-plan limit applies: to every layout but the control.
pub fn placement_checked(kind: LayoutKind) -> bool {
    kind != CONTROL
}

/// A threshold as the run book and the report write it: `36`, `36.5`.
pub fn fmt_number(x: f64) -> String {
    let s = format!("{x:.1}");
    s.strip_suffix(".0").map_or(s.clone(), str::to_string)
}

/// A fraction as a percentage: `5 %`, `1.4 %`.
pub fn fmt_percent(fraction: f64) -> String {
    format!("{} %", fmt_number(fraction * 100.0))
}
