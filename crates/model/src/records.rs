//! The records chunkforge writes and reads back: `build.json` and the
//! conversion settings it hands Python. Written and read through these types
//! only; fields later versions added are optional, so older records (and the
//! tests' synthetic builds) still read.

use std::collections::BTreeMap;

use clap::Args;
use indexmap::IndexMap;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::args::named;
use crate::plan::{FunctionKind, LayoutKind, Mode, Plan};

/// `build.json`'s `format`.
pub const BUILD_FORMAT: &str = "chunkforge-build/1";
/// INT4: the palettization the runtime's packages use.
pub const NBITS: u32 = 4;
/// Rows per look-up table (`per_grouped_channel`).
pub const GROUP_SIZE: usize = 32;

crate::named! {
    /// Who computes the INT4 look-up tables: `chunkforge`, the Rust kernel
    /// (optimal, deterministic, each distinct weight once per build), or
    /// `coremltools`, its own k-means, for comparison. (The CLI's `--help`
    /// says this on the option, so the values carry no docs of their own.)
    pub enum Palettizer {
        Chunkforge = "chunkforge",
        Coremltools = "coremltools",
    }
}

crate::named! {
    /// The MIL pass pipeline `ct.convert` runs: `chunkforge`, coremltools'
    /// default without the passes that cannot change a chunkforge program
    /// (python/chunkforge_py/convert/passes.py `SKIPPED`; byte-identical packages),
    /// or `coremltools`, its default pipeline, for comparison.
    pub enum PassPipeline {
        Chunkforge = "chunkforge",
        Coremltools = "coremltools",
    }
}

crate::named! {
    /// Who writes bundled and composed packages: `chunkforge` (protobuf
    /// level, weights copied, not loaded; the default) or `coremltools` (its
    /// MIL loader and serialiser: `save_multifunction`, `ct.convert` of the
    /// loaded program), the reference the first matches byte for byte
    /// (`CHUNKFORGE_WRITER`, `bench build --compare writer`).
    pub enum PackageWriter {
        Chunkforge = "chunkforge",
        Coremltools = "coremltools",
    }
}

crate::named! {
    /// A two-way switch of the environment (`CHUNKFORGE_JOINT`,
    /// `CHUNKFORGE_MIL_SHORTCUTS`): `on`, the default, or `off`.
    pub enum Switch {
        On = "on",
        Off = "off",
    }
}

crate::named! {
    /// `ct.target` member: the oldest OS the packages load on (the runtime
    /// needs iOS 18's multifunction packages and INT4 palettes).
    pub enum DeploymentTarget {
        Ios18 = "iOS18",
    }
}

crate::named! {
    /// `ct.precision` member: the packages compute in fp16.
    pub enum ComputePrecision {
        Float16 = "FLOAT16",
    }
}

crate::named! {
    /// `ct.ComputeUnit` member: the units the packages are converted for.
    pub enum ComputeUnits {
        CpuAndNe = "CPU_AND_NE",
    }
}

pub fn default_pass_pipeline() -> PassPipeline {
    // build.json files written before the field existed ran coremltools' default.
    PassPipeline::Coremltools
}

/// INT4 palettization settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Palettization {
    pub nbits: u32,
    pub granularity: String,
    pub group_size: usize,
    #[serde(default = "default_palettizer")]
    pub palettizer: Palettizer,
    /// Empty only in records from before it (`settings::recorded` fills it in).
    #[serde(default)]
    pub mode: String,
    #[serde(default = "one")]
    pub kmeans_workers: usize,
}

fn default_palettizer() -> Palettizer {
    Palettizer::Chunkforge
}

fn one() -> usize {
    1
}

/// What `ct.convert` is called with, defined here once and handed to Python
/// as it is (recorded in build.json and the manifest).
///
/// Every field but `quantize` reads with a default (the value builds had
/// before it was recorded), so `build --check` replays a record of any age.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ConversionSettings {
    /// Absent in hand-made records: `request.ctx` says it.
    #[serde(default)]
    pub ctx: usize,
    /// `ct.target` member.
    #[serde(default = "shipped_target")]
    pub minimum_deployment_target: DeploymentTarget,
    /// `ct.precision` member.
    #[serde(default = "shipped_precision")]
    pub compute_precision: ComputePrecision,
    /// `ct.ComputeUnit` member.
    #[serde(default = "shipped_units")]
    pub compute_units: ComputeUnits,
    pub quantize: bool,
    #[serde(default)]
    pub palettization: Option<Palettization>,
    #[serde(default = "default_pass_pipeline")]
    pub pass_pipeline: PassPipeline,
    /// Decode packages of layouts whose chunks the four-chunk layout tiles
    /// are composed from the four-chunk programs (`convert/compose.py`), not
    /// converted again (absent in older records: they were converted).
    #[serde(default)]
    pub compose: bool,
    /// A unit's functions (chunkN's decode and verify, prefill_chunkN's
    /// prefill) converted together and split (`convert/joint.py`); absent in older
    /// records: one conversion per function. The packages differ in op names.
    #[serde(default)]
    pub joint: bool,
    /// Who writes bundled and composed packages (the packages are the same
    /// bytes either way). build.json and the manifest record it only when not
    /// the default (`ConversionSettings::recorded`).
    #[serde(default = "default_writer")]
    pub writer: PackageWriter,
    /// Conversions take chunkforge's shortcuts through coremltools' own code
    /// (python/chunkforge_py/convert/passes.py `shortcuts`; the same bytes either
    /// way). build.json and the manifest record it only when off.
    #[serde(default = "on")]
    pub mil_shortcuts: bool,
}

fn default_writer() -> PackageWriter {
    PackageWriter::Chunkforge
}

fn on() -> bool {
    true
}

fn shipped_target() -> DeploymentTarget {
    DeploymentTarget::Ios18
}

fn shipped_precision() -> ComputePrecision {
    ComputePrecision::Float16
}

fn shipped_units() -> ComputeUnits {
    ComputeUnits::CpuAndNe
}

impl ConversionSettings {
    /// The settings that shipped: iOS18, FP16, CPU_AND_NE and, with
    /// `quantize`, INT4 per_grouped_channel palettization in groups of 32.
    pub fn shipped(
        ctx: usize,
        quantize: bool,
        palettizer: Palettizer,
        kmeans_workers: usize,
    ) -> Self {
        ConversionSettings {
            ctx,
            minimum_deployment_target: shipped_target(),
            compute_precision: shipped_precision(),
            compute_units: shipped_units(),
            quantize,
            palettization: quantize.then(|| Palettization {
                nbits: NBITS,
                granularity: "per_grouped_channel".into(),
                group_size: GROUP_SIZE,
                palettizer,
                mode: match palettizer {
                    Palettizer::Chunkforge => "custom (chunkforge optimal LUT)".into(),
                    Palettizer::Coremltools => "kmeans".into(),
                },
                kmeans_workers,
            }),
            pass_pipeline: PassPipeline::Chunkforge,
            compose: true,
            joint: true,
            writer: default_writer(),
            mil_shortcuts: true,
        }
    }

    /// The palettizer, if the build palettizes.
    pub fn palettizer(&self) -> Option<Palettizer> {
        self.palettization.as_ref().map(|p| p.palettizer)
    }

    /// `settings` as build.json and the manifest record them
    /// (`serialize_with`): every field but the writer when it is the default
    /// and the shortcuts when on, so the records of default builds read as
    /// before those fields. The seam sends every field (Python keeps no
    /// default of its own).
    pub fn recorded<S: serde::Serializer>(settings: &Self, s: S) -> Result<S::Ok, S::Error> {
        let mut v = serde_json::to_value(settings).map_err(serde::ser::Error::custom)?;
        if let serde_json::Value::Object(fields) = &mut v {
            if settings.writer == default_writer() {
                fields.remove("writer");
            }
            if settings.mil_shortcuts {
                fields.remove("mil_shortcuts");
            }
        }
        v.serialize(s)
    }
}

/// The options that change a conversion, one group flattened into `build`,
/// `bench build` and `release` and lowered by [`ConversionArgs::settings`]
/// alone: a new one is a field here, one in [`ConversionSettings`] and its
/// line in `settings`, then Python's use of it (contract.py
/// `ConversionSettings` is held to the type by python/tests/test_seam.py).
#[derive(Args, Clone, Debug)]
pub struct ConversionArgs {
    /// Skip INT4 palettization (FP16 weights).
    #[arg(long)]
    pub no_quantize: bool,
    /// coremltools k-means worker processes for palettization.
    #[arg(long, default_value_t = 1)]
    pub kmeans_workers: usize,
    /// INT4 palettizer: chunkforge (Rust kernel: optimal, deterministic, each distinct
    /// weight once per build) or coremltools (its own k-means, for comparison).
    #[arg(long, default_value = "chunkforge", value_parser = named::<Palettizer>())]
    pub palettizer: Palettizer,
    /// MIL pass pipeline: chunkforge (coremltools' default without the passes that
    /// cannot change a chunkforge program; byte-identical packages, about half the
    /// conversion time) or coremltools (its whole default pipeline).
    #[arg(long, default_value = "chunkforge", value_parser = named::<PassPipeline>())]
    pub pass_pipeline: PassPipeline,
    /// Convert every layout's packages from torch, instead of composing the decode
    /// packages the four-chunk layout tiles (three-chunk, two-chunk, one-chunk, a
    /// --split on four-chunk boundaries) from the four-chunk decode programs.
    #[arg(long)]
    pub no_compose: bool,
}

impl ConversionArgs {
    /// The conversion these options ask for at context length `ctx` (the
    /// environment's switches are the settings' resolve step's).
    pub fn settings(&self, ctx: usize) -> ConversionSettings {
        // Every option named: one added above and not lowered here does not compile.
        let ConversionArgs {
            no_quantize,
            kmeans_workers,
            palettizer,
            pass_pipeline,
            no_compose,
        } = *self;
        ConversionSettings {
            pass_pipeline,
            compose: !no_compose,
            ..ConversionSettings::shipped(ctx, !no_quantize, palettizer, kmeans_workers)
        }
    }
}

/// What was asked for: the CLI's layout options, as `build --check` replays them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BuildRequest {
    pub mode: Option<Mode>,
    #[serde(default)]
    pub split: Option<String>,
    #[serde(default)]
    pub ctx: Option<u64>,
    #[serde(default)]
    pub verify_k: Option<usize>,
    #[serde(default)]
    pub prefill_len: Option<Vec<usize>>,
}

/// Tool versions: chunkforge's, and the Python side's by package.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ToolVersions {
    pub chunkforge: String,
    /// `python`, `torch`, `coremltools`, `transformers`, ... (as `runtime.versions` reports them).
    pub python: Versions,
}

/// Versions by package, in the order Python reported them.
pub type Versions = IndexMap<String, String>;

impl ToolVersions {
    /// One Python-side version, if recorded.
    pub fn python(&self, package: &str) -> Option<&str> {
        self.python.get(package).map(String::as_str)
    }
}

/// The checkpoint a build or parity run read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CheckpointRecord {
    pub dir: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub architecture: String,
    #[serde(default)]
    pub multimodal: bool,
    #[serde(default)]
    pub config_sha256: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_tensors: Option<usize>,
    /// The weights read (absent in build.json files of older chunkforges).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightsDigest>,
}

/// What identifies the weights a build or a parity run read: the SHA-256 of
/// every file they come from (each safetensors file, and the shard index
/// when there is one) by file name, and one digest over that list. Two
/// checkpoints with one `config.json` (another seed, a fine-tune) differ
/// here, so `package` can tell a parity report about other weights.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WeightsDigest {
    /// SHA-256 over a `name\0sha256\n` line per file, in name order.
    #[schemars(pattern("^[0-9a-f]{64}$"))]
    pub sha256: String,
    /// File name (in the checkpoint folder) -> SHA-256.
    #[schemars(extend("minProperties" = 1, "additionalProperties" = {"type": "string", "pattern": "^[0-9a-f]{64}$"}))]
    pub files: BTreeMap<String, String>,
}

impl WeightsDigest {
    /// Each file that differs between `self` (called `mine`) and `other`
    /// (called `theirs`), said in a few words.
    pub fn differences(&self, other: &WeightsDigest, mine: &str, theirs: &str) -> Vec<String> {
        let names: std::collections::BTreeSet<&String> =
            self.files.keys().chain(other.files.keys()).collect();
        names
            .into_iter()
            .filter_map(|n| match (self.files.get(n), other.files.get(n)) {
                (Some(a), Some(b)) if a == b => None,
                (Some(a), Some(b)) => {
                    Some(format!("{n} has sha256 {b} in {theirs}, {a} in {mine}"))
                }
                (Some(_), None) => Some(format!("{n} is in {mine} only")),
                (None, _) => Some(format!("{n} is in {theirs} only")),
            })
            .collect()
    }
}

/// Python's counts for one converted function (`convert.save`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ChunkStats {
    pub mil_ops: u64,
    pub op_counts: BTreeMap<String, u64>,
    pub weight_bytes: u64,
    pub palettized_weights: u64,
    pub projection_ops: u64,
    /// The Rust palettizer's cache counts (None when it did not run).
    pub palettize_cache_hits: Option<u64>,
    pub palettize_cache_misses: Option<u64>,
    pub palettize_unmatched_groups: Option<u64>,
    /// Kernel seconds inside the conversion.
    #[serde(default, skip_serializing)]
    pub palettize_seconds: Option<f64>,
}

impl ChunkStats {
    /// A package's counts over its functions: ops, palettized weights and
    /// cache counts add up; the weight blob is the bundle's, set by the caller.
    pub fn add(&mut self, f: &ChunkStats) {
        self.mil_ops += f.mil_ops;
        self.projection_ops += f.projection_ops;
        self.palettized_weights += f.palettized_weights;
        let sum = |a: Option<u64>, b: Option<u64>| a.zip(b).map(|(a, b)| a + b);
        self.palettize_cache_hits = sum(self.palettize_cache_hits, f.palettize_cache_hits);
        self.palettize_cache_misses = sum(self.palettize_cache_misses, f.palettize_cache_misses);
        self.palettize_unmatched_groups = sum(
            self.palettize_unmatched_groups,
            f.palettize_unmatched_groups,
        );
        for (op, n) in &f.op_counts {
            *self.op_counts.entry(op.clone()).or_default() += n;
        }
    }
}

/// Seconds per build phase.
pub type Seconds = BTreeMap<String, f64>;

/// One function of a built package.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FunctionRecord {
    pub name: String,
    pub kind: FunctionKind,
    pub tokens: usize,
    pub mil_ops: u64,
    /// Its single-function blob size (a multifunction package's blob holds
    /// each shared weight once).
    pub weight_bytes: u64,
    pub seconds: Seconds,
    /// Seconds per coremltools graph pass (`bench build --profile` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passes: Option<BTreeMap<String, PassStat>>,
}

/// One graph pass in one conversion, summed over its runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PassStat {
    pub seconds: f64,
    pub runs: u64,
    /// Runs that changed the program.
    pub changed: Option<u64>,
}

/// One built package (`chunks[]` of build.json).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ChunkRecord {
    pub name: String,
    pub layout: LayoutKind,
    pub package: String,
    pub first_layer: usize,
    pub last_layer: usize,
    #[serde(default)]
    pub layers: usize,
    #[serde(default)]
    pub mil_ops: u64,
    pub weight_bytes: u64,
    /// Ops holding a projection weight (1x1 `conv`; `linear` in builds
    /// before the Neural Engine graph, recorded as `linear_ops`).
    #[serde(default, alias = "linear_ops")]
    pub projection_ops: u64,
    #[serde(default)]
    pub palettized_weights: u64,
    /// Weights served from the per-build palettization cache.
    #[serde(default)]
    pub palettize_cache_hits: Option<u64>,
    #[serde(default)]
    pub palettize_cache_misses: Option<u64>,
    /// Groups of weights not matched to a module tensor (palettized one by
    /// one, uncached); 0 for every Gemma 4 chunk.
    #[serde(default)]
    pub palettize_unmatched_groups: Option<u64>,
    #[serde(default)]
    pub op_counts: BTreeMap<String, u64>,
    /// Per function: its own program's ops and blob size.
    #[serde(default)]
    pub functions: Vec<FunctionRecord>,
    /// The four-chunk packages its program was composed from (`convert/compose.py`);
    /// None: converted from torch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub composed_from: Option<Vec<String>>,
    pub sha256_tree: String,
    #[serde(default)]
    pub seconds: Seconds,
}

/// Wall time of a build: in total and per phase over all packages.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BuildSeconds {
    pub total: f64,
    pub phases: Seconds,
}

/// Totals of the per-package palettization cache counts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CacheTotals {
    pub hits: u64,
    pub misses: u64,
}

/// `build.json`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct BuildRecord {
    pub format: String,
    #[serde(default)]
    pub tree_sha256: String,
    pub tool: ToolVersions,
    pub checkpoint: CheckpointRecord,
    pub request: BuildRequest,
    #[serde(serialize_with = "ConversionSettings::recorded")]
    pub settings: ConversionSettings,
    pub plan: Plan,
    pub chunks: Vec<ChunkRecord>,
    /// Four-chunk decode programs converted only to compose from (not
    /// shipped): each one's function record (ops, seconds, `passes`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<FunctionRecord>,
    #[serde(default)]
    pub seconds: BuildSeconds,
    #[serde(default)]
    pub palettize_cache: CacheTotals,
    /// Peak RSS of the build's process plus that of each conversion worker
    /// (each its own peak: the sum bounds the build's).
    #[serde(default)]
    pub peak_rss_bytes: u64,
    /// Processes that converted: the build's own and its conversion workers (`--jobs`).
    #[serde(default = "one_process")]
    pub processes: usize,
    /// The static ANE audit of the packages (`chunkforge audit`), in brief;
    /// absent from builds made before the audit existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditRecord>,
}

impl BuildRecord {
    /// The record of package `name`.
    pub fn chunk(&self, name: &str) -> Option<&ChunkRecord> {
        self.chunks.iter().find(|c| c.name == name)
    }
}

/// The audit report's `format`.
fn one_process() -> usize {
    1
}

/// `/2`: findings carry a severity, records each rule's.
pub const AUDIT_FORMAT: &str = "chunkforge-audit/2";

/// What a finding of an audit rule weighs for a release (the rules and theirs:
/// python/chunkforge_py/mil/audit.py `SEVERITY`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// A pattern that keeps an op off the Neural Engine or a function from
    /// compiling for it: `package` refuses the release, `audit` exits 1. A
    /// record that does not say (made before severities) counts every rule so.
    #[default]
    Error,
    /// A pattern that costs speed only: reported, never refused.
    Warning,
}

/// One rule broken by one op (or function input) of one function of a package.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AuditFinding {
    /// The package's folder name (`chunk1.mlpackage`).
    pub package: String,
    pub function: String,
    pub op: String,
    pub op_type: String,
    /// A decoder layer index, `pre` (before the first layer) or `head` (after the last).
    pub layer: String,
    /// `sliding`, `full`, `shared_sliding`, `shared_full`, `pre`, `head`, or
    /// `unknown` (a layer the build's plan does not describe).
    pub layer_kind: String,
    pub rule: String,
    #[serde(default)]
    pub severity: Severity,
    /// The op output or function input the finding is about.
    pub tensor: String,
    pub detail: String,
}

/// Counts by rule (`op-type`, `fp32`, ...), in rule-name order.
pub type RuleCounts = BTreeMap<String, u64>;

/// One package's ops by compute device, from MLComputePlan (macOS only).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ComputePlanPackage {
    pub package: String,
    pub ops: u64,
    pub non_ane: u64,
    /// Non-ANE ops by `op_type -> device`.
    #[serde(default)]
    pub non_ane_by_kind: BTreeMap<String, u64>,
    /// Merged packages only: at most 5 % of the ops off the Neural Engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ship: Option<bool>,
}

/// The compute-plan half of an audit: skipped (and why), or its counts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ComputePlanRecord {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packages: Vec<ComputePlanPackage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub non_ane: Option<u64>,
}

/// The audit as build.json keeps it: counts, and the first finding of each
/// rule in each package (`chunkforge audit BUILD_DIR` lists them all).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AuditRecord {
    pub format: String,
    /// SHA-256 of the op-type table (`ane_op_types.json`) the ops were checked against.
    pub op_table_sha256: String,
    pub total: u64,
    /// Of `total`: the findings that refuse a release, and those reported only.
    #[serde(default)]
    pub errors: u64,
    #[serde(default)]
    pub warnings: u64,
    pub by_rule: RuleCounts,
    /// Every rule's severity, as the audit classified it.
    #[serde(default)]
    pub severity: BTreeMap<String, Severity>,
    /// Every audited package (by folder name) and its findings by rule.
    pub packages: BTreeMap<String, RuleCounts>,
    pub first: Vec<AuditFinding>,
    pub compute_plan: ComputePlanRecord,
}

impl AuditRecord {
    /// `counts` split into (errors, warnings) by this record's severities.
    pub fn split(&self, counts: &RuleCounts) -> (RuleCounts, RuleCounts) {
        split_by_severity(&self.severity, counts)
    }

    /// The findings of these packages (folder names), by rule; Err names a
    /// package the audit did not cover.
    pub fn findings_of<'a>(
        &self,
        packages: impl IntoIterator<Item = &'a str>,
    ) -> Result<RuleCounts, &'a str> {
        let mut out = RuleCounts::new();
        for p in packages {
            let counts = self.packages.get(p).ok_or(p)?;
            for (rule, n) in counts {
                *out.entry(rule.clone()).or_default() += n;
            }
        }
        Ok(out)
    }
}

/// `counts` split into (errors, warnings) by `severity` (a rule it does not
/// classify is an error).
pub fn split_by_severity(
    severity: &BTreeMap<String, Severity>,
    counts: &RuleCounts,
) -> (RuleCounts, RuleCounts) {
    counts
        .iter()
        .map(|(rule, n)| (rule.clone(), *n))
        .partition(|(rule, _)| severity.get(rule).copied().unwrap_or_default() == Severity::Error)
}

/// `2 errors (op-type 2), 135 warnings (last-axis-1 135)`: the non-empty halves.
pub fn severity_text(errors: &RuleCounts, warnings: &RuleCounts) -> String {
    [(errors, "error"), (warnings, "warning")]
        .into_iter()
        .filter(|(c, _)| !c.is_empty())
        .map(|(c, what)| {
            let n: u64 = c.values().sum();
            let s = if n == 1 { "" } else { "s" };
            format!("{n} {what}{s} ({})", rule_counts_text(c))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `op-type 12, fp32 3`.
pub fn rule_counts_text(counts: &RuleCounts) -> String {
    counts
        .iter()
        .map(|(rule, n)| format!("{rule} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The parity report's `format`.
pub const PARITY_FORMAT: &str = "chunkforge-parity/1";

/// One layout (or function) at one step against the reference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StepRecord {
    pub layout: String,
    pub step: i64,
    pub cos: f64,
    pub ref_token: i64,
    pub token: i64,
    pub margin: f64,
    pub ok: bool,
    /// What a failure here means (`parity/verdicts.py`); reports older than
    /// verdicts have none, and a failure there fails.
    #[serde(default)]
    pub verdict: Option<Verdict>,
}

/// The reference against transformers at one step, and transformers'
/// noise floor there: how far its eager attention moves from its sdpa
/// attention on the same inputs (hidden-state cosine, largest logit change).
/// A step is ill-conditioned when the floor is past the tolerance or the
/// top-2 logit gap is inside it; a disagreement there is inconclusive.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct OracleRecord {
    pub step: i64,
    pub hf_token: i64,
    pub ref_token: i64,
    pub cos: f64,
    pub margin: f64,
    pub ok: bool,
    /// What a failure here means (`parity/verdicts.py`); reports older than
    /// verdicts have none, and a failure there fails.
    #[serde(default)]
    pub verdict: Option<Verdict>,
    /// Reports before the noise floor was measured have none (`None`).
    #[serde(default)]
    pub floor_cos: Option<f64>,
    #[serde(default)]
    pub floor_logit: Option<f64>,
    #[serde(default)]
    pub ill_conditioned: bool,
}

crate::named! {
    /// A parity check's, or a whole run's, outcome.
    pub enum Verdict {
        /// Every check held.
        Ok = "ok",
        /// The reference disagrees with transformers only at steps where
        /// transformers disagrees with itself (ill-conditioned): not a pass,
        /// and not evidence of a conversion error.
        Inconclusive = "inconclusive",
        /// A check failed where it can be trusted.
        Fail = "fail",
    }
}

/// A layout with its packages' INT4 weights at one step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ArtifactRecord {
    pub layout: String,
    pub step: i64,
    pub cos: f64,
    pub ref_token: i64,
    pub token: i64,
    pub same_token: bool,
}

/// The INT4 weight farthest from the checkpoint's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WorstWeight {
    pub weight: Option<String>,
    pub rel_mse: f64,
}

/// The fp32 model with each projection's weight plus Gaussian noise of its
/// palettization's relative MSE, against the reference: the INT4 check's
/// noise floor (`parity/noise.py`). Over its draws: the lowest min cos and
/// top-1 and the mean cos, and each draw's figures (reports before draws
/// have one draw, these figures).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct WeightNoise {
    pub min_cos: f64,
    pub mean_cos: f64,
    pub top1_agreement: f64,
    #[serde(default)]
    pub draws: Vec<NoiseDraw>,
}

/// One draw of `WeightNoise`: every weight's noise from its own seed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct NoiseDraw {
    pub min_cos: f64,
    pub mean_cos: f64,
    pub top1_agreement: f64,
}

impl WeightNoise {
    /// The draws (one, these figures, in a report before draws).
    pub fn each(&self) -> Vec<NoiseDraw> {
        if self.draws.is_empty() {
            vec![NoiseDraw {
                min_cos: self.min_cos,
                mean_cos: self.mean_cos,
                top1_agreement: self.top1_agreement,
            }]
        } else {
            self.draws.clone()
        }
    }

    /// `min cos a–b, top-1 c–d% over n draws` (one draw: its figures).
    pub fn spread(&self) -> String {
        let each = self.each();
        let span = |f: fn(&NoiseDraw) -> f64, scale: f64, digits: usize| {
            let lo = each.iter().map(f).fold(f64::INFINITY, f64::min) * scale;
            let hi = each.iter().map(f).fold(f64::NEG_INFINITY, f64::max) * scale;
            if each.len() == 1 {
                format!("{lo:.digits$}")
            } else {
                format!("{lo:.digits$}–{hi:.digits$}")
            }
        };
        format!(
            "min cos {}, top-1 agreement {}% over {} draw{}",
            span(|d| d.min_cos, 1.0, 6),
            span(|d| d.top1_agreement, 100.0, 1),
            each.len(),
            if each.len() == 1 { "" } else { "s" }
        )
    }
}

/// A decode layout with its packages' INT4 weights, over every step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct LayoutArtifacts {
    pub weights_replaced: IndexMap<String, u64>,
    pub worst_weight: WorstWeight,
    pub min_cos: f64,
    pub mean_cos: f64,
    pub top1_agreement: f64,
    pub tokens_match_other_layouts: bool,
    /// Measured where the thresholds failed and the weights held; the check
    /// is inconclusive when this fails every threshold INT4 failed.
    #[serde(default)]
    pub weight_noise: Option<WeightNoise>,
    pub ok: bool,
    /// What a failure here means (`parity/verdicts.py`); reports older than
    /// verdicts have none, and a failure there fails.
    #[serde(default)]
    pub verdict: Option<Verdict>,
}

/// verify_qK / prefill_bN with their packages' weights, against the INT4
/// four-chunk decode of the same build.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FunctionArtifacts {
    pub weights_replaced: IndexMap<String, u64>,
    pub min_cos: f64,
    pub steps: u64,
    pub tokens_match: bool,
    pub ok: bool,
    /// What a failure here means (`parity/verdicts.py`); reports older than
    /// verdicts have none, and a failure there fails.
    #[serde(default)]
    pub verdict: Option<Verdict>,
}

/// The INT4 artifact check of a layout or of a function.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum ArtifactSummary {
    Function(FunctionArtifacts),
    Layout(LayoutArtifacts),
}

impl ArtifactSummary {
    pub fn ok(&self) -> bool {
        match self {
            ArtifactSummary::Function(f) => f.ok,
            ArtifactSummary::Layout(l) => l.ok,
        }
    }

    pub fn verdict(&self) -> Option<Verdict> {
        match self {
            ArtifactSummary::Function(f) => f.verdict,
            ArtifactSummary::Layout(l) => l.verdict,
        }
    }

    pub fn weights_replaced(&self) -> u64 {
        match self {
            ArtifactSummary::Function(f) => f.weights_replaced.values().sum(),
            ArtifactSummary::Layout(l) => l.weights_replaced.values().sum(),
        }
    }
}

/// The first failing step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FirstFailure {
    pub layout: String,
    pub step: i64,
    pub cos: f64,
    pub ref_token: i64,
    pub token: i64,
}

/// Where a failing layout first leaves the reference (no layer: every
/// layer matches, the divergence is in the head).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Localisation {
    pub step: i64,
    pub layer: Option<u64>,
    pub chunk: Option<String>,
    pub cos: Option<f64>,
}

/// The prefill hand-off a run checked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PrefillSummary {
    pub tokens: u64,
    pub function: String,
}

/// One step of a package's own program run by the MIL interpreter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ProgramRecord {
    pub target: String,
    pub precision: String,
    pub step: i64,
    pub token: i64,
    pub readback_token: i64,
    pub cos_readback: f64,
    /// The read-back modules' top-2 logit margin at this step.
    #[serde(default)]
    pub readback_margin: Option<f64>,
    /// The largest change of any logit from the read-back modules to the
    /// program at this step (fp16 mode: what rounding every op moved).
    #[serde(default)]
    pub logit_change: Option<f64>,
    pub ref_token: Option<i64>,
    pub cos_reference: Option<f64>,
    pub hf_token: Option<i64>,
    pub cos_hf: Option<f64>,
}

/// A layout's or function's program in one precision, over its steps:
/// against the read-back modules (same weights; the fp32 gate), the fp32
/// reference and transformers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ProgramSummary {
    pub steps: u64,
    pub min_cos_readback: f64,
    pub tokens_match_readback: bool,
    /// The largest logit change over the steps (`ProgramRecord::logit_change`).
    #[serde(default)]
    pub max_logit_change: Option<f64>,
    /// The largest read-back top-2 margin at a step whose token differs
    /// from the read-back's; none when every token matches.
    #[serde(default)]
    pub max_flip_margin: Option<f64>,
    pub min_cos_reference: Option<f64>,
    pub top1_reference: Option<f64>,
    pub min_cos_hf: Option<f64>,
    pub top1_hf: Option<f64>,
    pub gated: bool,
    pub ok: bool,
    /// What a failure here means (`parity/verdicts.py`); reports older than
    /// verdicts have none, and a failure there fails.
    #[serde(default)]
    pub verdict: Option<Verdict>,
}

/// Transformers' next-token distribution against the reference's at one
/// teacher-forced step: KL(transformers ‖ reference), in nats.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct KlRecord {
    pub step: i64,
    pub kl: f64,
}

/// The KL check over every step: the mean and the largest per-token
/// KL(transformers ‖ reference), against `--max-kl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct KlSummary {
    pub steps: u64,
    pub mean: f64,
    pub max: f64,
    /// The step of the largest.
    pub max_step: i64,
    pub ok: bool,
    /// What a failure here means (`parity/verdicts.py`).
    pub verdict: Verdict,
}

/// The verdict of a parity run (`ok` is the one field a hand-written summary
/// must have).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ParitySummary {
    pub ok: bool,
    /// `ok` is `verdict == ok`; reports older than the verdict have only `ok`
    /// ([`ParitySummary::verdict`]).
    #[serde(default)]
    pub verdict: Option<Verdict>,
    #[serde(default)]
    pub steps: u64,
    #[serde(default)]
    pub decode_steps: u64,
    #[serde(default)]
    pub tol_cos: f64,
    #[serde(default)]
    pub layouts: Vec<String>,
    #[serde(default)]
    pub min_cos: Option<f64>,
    #[serde(default)]
    pub min_margin: Option<f64>,
    #[serde(default)]
    pub oracle_ok: Option<bool>,
    #[serde(default)]
    pub oracle_min_cos: Option<f64>,
    /// Steps where transformers disagrees with itself beyond the tolerance.
    #[serde(default)]
    pub ill_conditioned: Option<Vec<i64>>,
    #[serde(default)]
    pub first_failure: Option<FirstFailure>,
    #[serde(default)]
    pub localisation: Option<IndexMap<String, Localisation>>,
    #[serde(default)]
    pub prefill: Option<PrefillSummary>,
    #[serde(default)]
    pub verify_k: Option<u64>,
    #[serde(default)]
    pub artifacts: Option<IndexMap<String, ArtifactSummary>>,
    /// `INT4` (a palettized build) or `FP16` (`--no-quantize`).
    #[serde(default)]
    pub artifacts_precision: Option<String>,
    /// By layout or function, then precision (`fp32`, `fp16`).
    #[serde(default)]
    pub programs: Option<IndexMap<String, IndexMap<String, ProgramSummary>>>,
    /// KL(transformers ‖ reference) over the steps (None without the oracle).
    #[serde(default)]
    pub kl: Option<KlSummary>,
    /// The fp16 range of the packages' programs as `--artifacts` ran them in fp16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16_range: Option<crate::fp16range::Fp16RangeReport>,
    #[serde(default)]
    pub seconds: f64,
}

/// The checkpoint a parity run read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ParityCheckpoint {
    /// The checkpoint folder, absolute, as build.json records it (a relative
    /// one, from an older chunkforge, named nothing).
    #[serde(default)]
    #[schemars(pattern("^/"))]
    pub dir: String,
    #[serde(default)]
    #[schemars(pattern("^[0-9a-f]{64}$"))]
    pub config_sha256: String,
    /// The weights parity ran on (absent in reports of older chunkforges,
    /// which `package` refuses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightsDigest>,
}

/// The parity report (`parity --report`; schema: parity/report.schema.json).
/// Python returns the checks; Rust adds what it knows (format, checkpoint,
/// prompt, tools).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "chunkforge parity report")]
pub struct ParityReport {
    pub steps: Vec<StepRecord>,
    pub oracle: Vec<OracleRecord>,
    #[serde(default)]
    pub artifacts: Vec<ArtifactRecord>,
    #[serde(default)]
    pub programs: Vec<ProgramRecord>,
    #[serde(default)]
    pub kl: Vec<KlRecord>,
    pub summary: ParitySummary,
    #[serde(default)]
    #[schemars(extend("const" = PARITY_FORMAT))]
    pub format: String,
    #[serde(default)]
    pub checkpoint: ParityCheckpoint,
    #[serde(default)]
    pub prompt_ids: Vec<i64>,
    #[serde(default)]
    pub tool: ToolVersions,
}

impl ParitySummary {
    /// The run's verdict: as recorded, or for a report older than verdicts,
    /// `ok` or `fail` by `ok`.
    pub fn verdict(&self) -> Verdict {
        self.verdict
            .unwrap_or(if self.ok { Verdict::Ok } else { Verdict::Fail })
    }
}

impl ParityReport {
    /// Every check whose own verdict is a failure, named.
    pub fn failed_checks(&self) -> Vec<String> {
        self.checks_with(Verdict::Fail)
    }

    /// Every check that is inconclusive (a disagreement at an ill-conditioned
    /// step, or an INT4 check weight noise of its size fails too), named.
    pub fn inconclusive_checks(&self) -> Vec<String> {
        self.checks_with(Verdict::Inconclusive)
    }

    /// The layouts whose INT4 check is inconclusive by its noise floor (weight
    /// noise of the palettization's size fails its thresholds too), with it.
    pub fn noise_bound_artifacts(&self) -> Vec<(&String, &LayoutArtifacts, &WeightNoise)> {
        let layouts = self.summary.artifacts.iter().flatten();
        layouts
            .filter_map(|(name, s)| match s {
                ArtifactSummary::Layout(l) if l.verdict == Some(Verdict::Inconclusive) => {
                    l.weight_noise.as_ref().map(|n| (name, l, n))
                }
                _ => None,
            })
            .collect()
    }

    fn checks_with(&self, verdict: Verdict) -> Vec<String> {
        self.checks_not_ok()
            .into_iter()
            .filter(|(_, v)| *v == verdict)
            .map(|(name, _)| name)
            .collect()
    }

    /// The verdict the checks add up to: a failure anywhere fails, else an
    /// inconclusive check makes the run inconclusive.
    pub fn verdict_of_checks(&self) -> Verdict {
        let checks = self.checks_not_ok();
        if checks.iter().any(|(_, v)| *v == Verdict::Fail) {
            Verdict::Fail
        } else if checks.is_empty() {
            Verdict::Ok
        } else {
            Verdict::Inconclusive
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(
        steps: serde_json::Value,
        oracle: serde_json::Value,
        summary: serde_json::Value,
    ) -> ParityReport {
        serde_json::from_value(serde_json::json!({
            "steps": steps, "oracle": oracle, "summary": summary,
        }))
        .unwrap()
    }

    #[test]
    fn every_check_not_ok_carries_its_rows_verdict_and_old_rows_fail() {
        let r = report(
            serde_json::json!([
                {"layout": "two", "step": 3, "cos": 0.5, "ref_token": 1, "token": 2, "margin": 1.0, "ok": false, "verdict": "fail"},
                {"layout": "verify_qK", "step": 3, "cos": 0.9, "ref_token": 1, "token": 1, "margin": 1.0, "ok": false, "verdict": "inconclusive"},
                {"layout": "two", "step": 4, "cos": 0.5, "ref_token": 1, "token": 2, "margin": 1.0, "ok": false},
                {"layout": "one", "step": 4, "cos": 1.0, "ref_token": 1, "token": 1, "margin": 1.0, "ok": true, "verdict": "ok"},
            ]),
            serde_json::json!([
                {"step": 3, "hf_token": 1, "ref_token": 1, "cos": 0.9, "margin": 1.0, "ok": false,
                 "floor_cos": 0.8, "floor_logit": 0.1, "ill_conditioned": true, "verdict": "inconclusive"},
            ]),
            serde_json::json!({"ok": false, "verdict": "fail"}),
        );
        let checks = r.checks_not_ok();
        assert_eq!(checks.len(), 4);
        assert_eq!(
            r.failed_checks(),
            [
                "steps[0] (layout two, step 3)",
                "steps[2] (layout two, step 4)"
            ]
        );
        assert_eq!(
            r.inconclusive_checks(),
            [
                "steps[1] (layout verify_qK, step 3)",
                "oracle[0] (layout reference, step 3)"
            ]
        );
        assert_eq!(r.verdict_of_checks(), Verdict::Fail);
        assert_eq!(r.summary.verdict(), Verdict::Fail);
        // Without the failures, inconclusive; a report older than verdicts is ok or fail by `ok`.
        let r = report(
            serde_json::json!([]),
            serde_json::json!([{"step": 3, "hf_token": 1, "ref_token": 1, "cos": 0.9, "margin": 1.0,
                "ok": false, "ill_conditioned": true, "verdict": "inconclusive"}]),
            serde_json::json!({"ok": false}),
        );
        assert_eq!(r.verdict_of_checks(), Verdict::Inconclusive);
        assert_eq!(r.summary.verdict(), Verdict::Fail);
        let old = report(
            serde_json::json!([]),
            serde_json::json!([]),
            serde_json::json!({"ok": true}),
        );
        assert_eq!(
            (old.summary.verdict(), old.verdict_of_checks()),
            (Verdict::Ok, Verdict::Ok)
        );
    }
}
