//! The seam's types: every request Rust hands to `chunkforge_py` and every
//! reply it reads back, the twin of `python/chunkforge_py/contract.py` (section
//! for section). This module imports nothing of the binary, only the two pure
//! crates' records, so every module that calls Python (and `calls`, which
//! declares the entry points with these types) depends on it and it on none
//! of them. `python/tests/seam.json` is their JSON schemas, and
//! `python/tests/test_seam.py` holds `contract.py` to them.

use std::collections::BTreeMap;

use indexmap::IndexMap;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use chunkforge_model::checkpoint::Checkpoint;
use chunkforge_model::layouts::VerifyCommit;
use chunkforge_model::parity_checks::{CheckName, Thresholds};
use chunkforge_model::plan::{self, ChunkPlan, Dims, Layout, LayoutKind};
use chunkforge_model::records::{
    AuditFinding, ChunkStats, ComputePlanRecord, ConversionSettings, PackageWriter, PassStat,
    RuleCounts, Seconds, Severity,
};
use chunkforge_release::bench::transcript::Transcript;
use chunkforge_release::folder::PackageFiles;
use chunkforge_release::sidefiles;

// ---- runtime (python/chunkforge_py/runtime.py) ----------------------------

/// `runtime.configure`'s request.
#[derive(Serialize, JsonSchema)]
pub struct ConfigureArgs {
    pub verbose: bool,
}

/// `runtime.versions`' request: the packages whose versions are asked for.
#[derive(Serialize, JsonSchema)]
pub struct VersionsArgs {
    pub packages: Vec<String>,
}

/// What coremltools can and cannot do on this platform.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct PlatformLimits {
    pub system: String,
    pub machine: String,
    pub can_predict: bool,
    pub can_compile_mlmodelc: bool,
    pub can_load_compute_plan: bool,
}

/// A Python object a call makes and Rust keeps (not JSON).
pub struct PyObjectReply;

impl JsonSchema for PyObjectReply {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "PyObject".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({"description": "a Python object, kept by Rust"})
    }
}

impl<'de> Deserialize<'de> for PyObjectReply {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Err(serde::de::Error::custom(
            "a Python object is not read as JSON",
        ))
    }
}

// ---- build (src/build.rs, python/chunkforge_py/convert/) ------------------

/// The checkpoint as Python opens it: the tensor-name prefix and each
/// (prefixed) tensor name's safetensors file.
#[derive(Clone, Serialize, Deserialize, JsonSchema)]
pub struct CheckpointFiles {
    pub prefix: String,
    pub files: BTreeMap<String, String>,
}

impl CheckpointFiles {
    pub fn of(ckpt: &Checkpoint) -> Self {
        CheckpointFiles {
            prefix: ckpt.prefix.clone(),
            files: ckpt
                .files
                .iter()
                .map(|(k, v)| (k.clone(), v.to_string_lossy().into_owned()))
                .collect(),
        }
    }
}

/// One package to convert: its plan (every function), the model's dims, the
/// checkpoint, the settings, and where each function's package goes.
#[derive(Clone, Serialize, Deserialize, JsonSchema)]
pub struct ChunkJob {
    pub dims: Dims,
    pub chunk: ChunkPlan,
    pub checkpoint: CheckpointFiles,
    pub settings: ConversionSettings,
    /// In the chunk's function order.
    pub paths: Vec<String>,
    /// Time (and probe) every coremltools graph pass.
    pub profile: bool,
}

/// One converted function: its counts and seconds per phase.
#[derive(Serialize, Deserialize, JsonSchema)]
pub struct ConvertedFunction {
    pub name: String,
    pub stats: ChunkStats,
    pub seconds: Seconds,
    pub passes: Option<BTreeMap<String, PassStat>>,
}

/// `convert.convert_chunk`'s reply.
#[derive(Serialize, Deserialize, JsonSchema)]
pub struct ConvertedChunk {
    pub functions: Vec<ConvertedFunction>,
}

/// `palettize.WeightCache`'s arguments.
#[derive(Serialize, JsonSchema)]
pub struct WeightCacheArgs {
    /// Conversions that hold each weight (an entry is dropped after its last).
    pub uses: usize,
}

/// `joint.convert_jobs`'s request: every job of a task, converted together
/// with `joint` (the jobs are of the same layers), loading and tracing on
/// `threads` torch threads.
#[derive(Serialize, JsonSchema)]
pub struct ConvertJobsArgs<'a> {
    pub jobs: &'a [ChunkJob],
    pub joint: bool,
    pub threads: usize,
}

/// `convert.combine`'s reply: the bundle's weight blob size.
#[derive(Serialize, Deserialize, JsonSchema)]
pub struct Bundle {
    pub weight_bytes: u64,
}

/// `convert.combine`'s request: single-function packages `(path, function)`
/// bundled into multifunction ones `(path, [function, ...])` sharing one
/// weight blob, written by `writer`.
#[derive(Serialize, JsonSchema)]
pub struct BundleArgs<'a> {
    pub parts: &'a [(String, String)],
    pub targets: &'a [(String, Vec<String>)],
    pub writer: PackageWriter,
}

/// One source of a composed package: a single-function four-chunk decode
/// package and its chunk plan (that one function).
#[derive(Clone, Serialize, Deserialize, JsonSchema)]
pub struct ComposeSource {
    pub path: String,
    pub chunk: ChunkPlan,
}

/// `compose.compose_job`'s job: the target chunk (one decode function) from
/// its sources, in layer order, written to `path`.
#[derive(Clone, Serialize, Deserialize, JsonSchema)]
pub struct ComposeJob {
    pub target: ChunkPlan,
    pub sources: Vec<ComposeSource>,
    pub path: String,
    /// The build's: deployment target and compute units of the package.
    pub settings: ConversionSettings,
}

/// `compose.compose_job`'s reply.
#[derive(Serialize, Deserialize, JsonSchema)]
pub struct Composed {
    pub stats: ChunkStats,
    pub seconds: Seconds,
}

// ---- parity (src/parity.rs, python/chunkforge_py/parity/) -----------------

/// A layout as parity compares it: named by its kind.
#[derive(Serialize, JsonSchema)]
pub struct ParityLayout<'a> {
    pub name: LayoutKind,
    pub chunks: &'a [plan::ChunkPlan],
    pub kv_slot_map: &'a [plan::SlotCopy],
}

impl<'a> From<&'a Layout> for ParityLayout<'a> {
    fn from(l: &'a Layout) -> Self {
        ParityLayout {
            name: l.kind,
            chunks: &l.chunks,
            kv_slot_map: &l.kv_slot_map,
        }
    }
}

#[derive(Serialize, JsonSchema)]
pub struct DimsOnly<'a> {
    pub dims: &'a Dims,
}

/// What `parity.run` is asked to check (contract.py `ParityRequest`).
#[derive(Serialize, JsonSchema)]
pub struct ParityRequest<'a> {
    pub plan: DimsOnly<'a>,
    /// The layout every other one is compared against.
    pub reference: LayoutKind,
    /// The decode layouts (the layout table's `Purpose::Decode` rows), the
    /// reference first: Python judges exactly these records as the
    /// reference's own computation (`judge_steps`); every other step
    /// record is a function's.
    pub layouts: Vec<ParityLayout<'a>>,
    pub checkpoint: CheckpointFiles,
    pub config_path: String,
    pub prompt_ids: &'a [i64],
    pub steps: usize,
    /// The checks to run, in order: each is the unit
    /// `chunkforge_py.parity.<name>` (`parity_checks::CHECKS`).
    pub checks: Vec<CheckName>,
    /// What the checks are held to.
    pub thresholds: Thresholds,
    pub prefill: usize,
    pub prefill_layout: Option<ParityLayout<'a>>,
    pub oracle: bool,
    /// What a test build breaks on purpose (python/tests/parity_sabotage.py
    /// applies it); never sent by any other build.
    #[cfg(feature = "test-hooks")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sabotage: Option<Sabotage>,
    pub artifacts: Option<String>,
    /// `INT4` for a palettized build, `FP16` for a `--no-quantize` one.
    pub artifacts_precision: Option<&'static str>,
    pub artifact_layouts: IndexMap<LayoutKind, ParityLayout<'a>>,
}

#[cfg(feature = "test-hooks")]
chunkforge_model::named! {
    /// `--corrupt-function`: which modules `--corrupt-layer` corrupts.
    pub enum CorruptFunction {
        Verify = "verify",
        Prefill = "prefill",
    }
}

/// What a test build breaks on purpose (`test_hooks::SabotageArgs`): one
/// weight of `corrupt_layer` in the compared layouts (or, with
/// `corrupt_function`, in the verify or prefill modules), or the prefill
/// hand-off's KV copy (`skip_prefill_copy`).
#[cfg(feature = "test-hooks")]
#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct Sabotage {
    pub corrupt_layer: Option<usize>,
    pub corrupt_function: Option<CorruptFunction>,
    pub skip_prefill_copy: bool,
}

// ---- fixture (src/fixture/, python/chunkforge_py/fixture.py) --------------

chunkforge_model::named! {
    /// The fixture's layer structure.
    pub enum Shape {
        /// 35 layers, full attention every 5th, 20 KV-shared layers, 1 KV head.
        E2b = "e2b",
        /// 42 layers, full attention every 6th, 18 KV-shared layers, 2 KV heads.
        E4b = "e4b",
    }
}

chunkforge_model::named! {
    /// How peaked the random weights make attention (`--attention`): the q/k
    /// norm weights set the spread of q·k scores (fixture.py `qk_norm_init`).
    pub enum AttentionSharpness {
        /// q/k norm weights near 0.25: scores spread about 1, transformers agrees with itself.
        Soft = "soft",
        /// q/k norm weights U(0.5, 1.5): scores spread about 16, softmax nearly hard; ill-conditioned.
        Sharp = "sharp",
    }
}

/// What the fixture generator was asked for (sent to `fixture.write_fixture_json`).
#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct FixtureArgs {
    pub shape: Shape,
    pub seed: u64,
    pub multimodal: bool,
    pub shards: usize,
    pub sliding_window: usize,
    pub vocab_size: usize,
    pub full_width: bool,
    /// None: transformers' own initialisation of the q/k norms.
    pub attention: Option<AttentionSharpness>,
}

/// What the generator wrote.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
pub struct FixtureInfo {
    pub tensors: u64,
    pub parameters: u64,
}

/// `fixture.write_fixture_json`'s request.
#[derive(Serialize, JsonSchema)]
pub struct FixtureRequest<'a> {
    pub out_dir: &'a str,
    #[serde(flatten)]
    pub args: &'a FixtureArgs,
}

/// `fixture.full_size_layout_json`'s request.
#[derive(Serialize, JsonSchema)]
pub struct FullSizeRequest<'a> {
    pub out_dir: &'a str,
    pub shape: Shape,
    pub multimodal: bool,
    pub sliding_window: usize,
    pub attention: AttentionSharpness,
}

/// How a tensor's values are drawn (fixture.py `Init`).
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Init {
    /// N(mean, std²).
    Normal { mean: f64, std: f64 },
    /// U(low, high).
    Uniform { low: f64, high: f64 },
}

/// One tensor of the checkpoint (fixture.py `TensorRecipe`).
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
pub struct TensorRecipe {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
}

/// `fixture.full_size_layout_json`'s reply: the tensors to stream into shards.
#[derive(Deserialize, JsonSchema)]
pub struct FullSizeLayout {
    pub tensors: Vec<TensorRecipe>,
}

// ---- inspect (src/commands/inspect.rs, python/chunkforge_py/mil/inspect.py) -

/// `inspect.describe`'s request.
#[derive(Serialize, JsonSchema)]
pub struct PathArg<'a> {
    pub path: &'a str,
    /// The folder of the weight blob the package reads, when not its own
    /// (a release's package stored without its blob, shared in by the app's
    /// download).
    pub weights: Option<&'a str>,
}

/// One input or output of a package's function.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct Feature {
    pub name: String,
    pub shape: Vec<i64>,
    pub dtype: String,
}

/// One function of a package.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct FunctionDescription {
    pub name: String,
    pub inputs: Vec<Feature>,
    pub outputs: Vec<Feature>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mil_ops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub projection_ops: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub int4_g32_projection_ops: Option<u64>,
}

/// One palettized weight.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct Lut {
    pub name: String,
    pub weight_shape: Vec<i64>,
    pub lut_shape: Vec<i64>,
    pub indices_dtype: String,
}

/// One projection op (1x1 `conv`, or `linear` in older builds) and where its weight comes from.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct ProjectionOp {
    pub op: String,
    pub weight: String,
    pub weight_op: String,
}

/// `inspect.describe`: a package as read from disk.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct PackageDescription {
    pub path: String,
    pub specification_version: u64,
    pub model_type: String,
    pub default_function: Option<String>,
    pub inputs: Vec<Feature>,
    pub outputs: Vec<Feature>,
    pub functions: Vec<FunctionDescription>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opset: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mil_ops: Option<u64>,
    #[serde(default)]
    pub palettized: Vec<Lut>,
    #[serde(default)]
    pub projections: Vec<ProjectionOp>,
    #[serde(default)]
    pub layers: Vec<u64>,
}

// ---- audit (src/audit.rs, python/chunkforge_py/mil/audit.py) --------------

/// One package to audit.
#[derive(Clone, Debug, Serialize, JsonSchema)]
pub struct AuditPackage {
    pub path: String,
    /// The package's folder name (`chunk1.mlpackage`): what findings carry.
    pub name: String,
    /// The kind of each decoder layer by index (empty: unknown).
    pub layer_kinds: BTreeMap<String, &'static str>,
    /// A package of a layout with a device-bench target (two- and one-chunk):
    /// the compute plan's ship verdict applies.
    pub merged: bool,
}

/// `audit.audit`'s and `audit.op_types`' request.
#[derive(Serialize, JsonSchema)]
pub struct AuditArgs<'a> {
    pub packages: &'a [AuditPackage],
    pub compute_plan: bool,
}

/// One function of an audited package.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct FunctionAudit {
    pub name: String,
    /// Ops run per call (const and constexpr_* ops excluded).
    pub ops: u64,
    pub const_ops: u64,
    pub op_counts: BTreeMap<String, u64>,
    pub findings: RuleCounts,
}

/// One audited package.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct PackageAudit {
    pub package: String,
    pub path: String,
    pub functions: Vec<FunctionAudit>,
    pub findings: RuleCounts,
}

#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct OpTable {
    pub path: String,
    pub sha256: String,
}

/// The rules' thresholds.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct Limits {
    pub max_rank: u64,
    pub max_dim: u64,
    pub last_axis_1_min_elements: u64,
}

/// `audit.audit`'s report (what `chunkforge audit --json` prints).
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct AuditReport {
    pub format: String,
    pub op_table: OpTable,
    pub limits: Limits,
    pub packages: Vec<PackageAudit>,
    pub findings: Vec<AuditFinding>,
    pub total: u64,
    pub errors: u64,
    pub warnings: u64,
    pub by_rule: RuleCounts,
    pub severity: BTreeMap<String, Severity>,
    pub compute_plan: ComputePlanRecord,
}

/// `audit.op_types`' reply: the op types per layer kind found in the
/// packages, in ane_op_types.json's shape (to regenerate and diff the table).
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct OpTypes {
    pub layer_kinds: IndexMap<String, Vec<String>>,
    pub output_dtypes: IndexMap<String, Vec<String>>,
}

// ---- bench palettize (src/bench_palettize.rs, convert/bench_palettize.py) -

/// `bench_palettize.run`'s request.
#[derive(Serialize, JsonSchema)]
pub struct BenchArgs {
    /// Small matrices only.
    pub quick: bool,
    pub seed: u64,
    /// One stderr line per run.
    pub progress: bool,
}

/// One implementation on one matrix.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct BenchResult {
    pub shape: Vec<usize>,
    #[serde(rename = "impl")]
    pub implementation: String,
    pub seconds: f64,
    pub mse: f64,
    pub lut_shape: Vec<usize>,
}

/// `bench_palettize.run`'s report (`--json` prints it).
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct BenchReport {
    pub results: Vec<BenchResult>,
    pub group_size: usize,
    pub nbits: u32,
    pub weight_std: f64,
    pub seed: u64,
}

// ---- run (src/run.rs, python/chunkforge_py/emulate/release.py) ------------

/// Paths of the side files the emulation reads (contract.py `RunFiles`):
/// every side file of [`sidefiles::SIDE_FILES`] by its name without the
/// extension (`embed_tokens_q8`, `cos_sliding`, ...), and `tokenizer`. A side
/// file added to that table reaches the emulator with no change here.
#[derive(Serialize, JsonSchema)]
#[serde(transparent)]
pub struct RunFiles(pub BTreeMap<String, String>);

impl RunFiles {
    /// The side files, `path` giving each one's path by its name in the
    /// release; `tokenizer` the tokenizer's (empty: none).
    pub fn new(path: &dyn Fn(&str) -> String, tokenizer: String) -> Self {
        let mut files: BTreeMap<String, String> = sidefiles::SIDE_FILES
            .iter()
            .map(|spec| (side_file_key(spec.name).to_string(), path(spec.name)))
            .collect();
        files.insert("tokenizer".into(), tokenizer);
        RunFiles(files)
    }
}

/// A side file's key in [`RunFiles`]: its name without the extension.
pub fn side_file_key(name: &str) -> &str {
    name.rsplit_once('.').map_or(name, |(stem, _)| stem)
}

/// contract.py `RunRequest`.
#[derive(Serialize, JsonSchema)]
pub struct RunRequest<'a> {
    pub release: String,
    /// Every package's folder and the folder of the weight blob it reads
    /// (contract.py `RunPackage`), as the app's download has them.
    pub packages: &'a BTreeMap<String, PackageFiles>,
    pub dims: Dims,
    pub decode: &'a Layout,
    /// The reference layout: prefill's KV lands in its caches, and its
    /// packages hold `verify_qK`.
    pub reference: &'a Layout,
    pub prefill: &'a Layout,
    pub files: RunFiles,
    pub prompt: Option<&'a str>,
    pub prompt_ids: Option<&'a [i64]>,
    pub max_tokens: usize,
    pub speculate: Option<usize>,
    /// How the runtime build whose download the run reads commits a verify call.
    pub verify_commit: VerifyCommit,
    pub eos_token_ids: &'a [i64],
    pub fp16: bool,
}

/// contract.py `Speculation`.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct Speculation {
    pub k: usize,
    pub calls: usize,
    pub drafts: usize,
    pub accepted_drafts: usize,
    /// How the runtime build committed each call.
    pub commit: VerifyCommit,
    /// Write-through: rows of rejected drafts left in the window caches.
    pub stale_rows: usize,
}

/// contract.py `RunResult`, plus what Rust adds.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct RunResult {
    pub layout: LayoutKind,
    pub chunks: Vec<String>,
    pub prompt_ids: Vec<i64>,
    pub generated_ids: Vec<i64>,
    /// Per generated token: its logit minus the runner-up's.
    pub margins: Vec<f64>,
    pub text: Option<String>,
    pub stopped: String,
    pub prefill_tokens: usize,
    pub prefill_function: String,
    pub load_seconds: f64,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub decode_tokens_per_second: f64,
    pub speculation: Option<Speculation>,
    #[serde(default)]
    pub picked_by: String,
    /// The app's download entry whose folder the run reads (main,
    /// main-3way, branch): which weight blobs came from which package.
    #[serde(default)]
    pub download: String,
    #[serde(default = "emulation")]
    pub note: String,
    /// The free-running gate against the source (`--against-source`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(skip)]
    pub gate: Option<Transcript>,
}

fn emulation() -> String {
    "CPU emulation of the app's runtime (torch, fp32): not device speed".into()
}

// ---- exec (src/commands/exec.rs, python/chunkforge_py/mil/interp.py) ------

/// `mil_interp.exec_function`'s request: one function of a package on the
/// arrays of an .npz.
#[derive(Serialize, JsonSchema)]
pub struct ExecRequest<'a> {
    pub package: &'a str,
    pub function: Option<&'a str>,
    pub inputs: &'a str,
    pub output: &'a str,
    pub fp16: bool,
}

/// A tensor `exec` read or wrote.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct ExecTensor {
    pub name: String,
    pub shape: Vec<i64>,
    pub dtype: String,
}

/// `mil_interp.exec_function`'s reply.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct ExecResult {
    pub package: String,
    pub function: String,
    pub fp16: bool,
    pub ops: u64,
    pub inputs: Vec<ExecTensor>,
    pub outputs: Vec<ExecTensor>,
    pub output: String,
    pub load_seconds: f64,
    pub run_seconds: f64,
}

// ---- compile (src/compile.rs, python/chunkforge_py/convert/compiled.py) ---

/// `compiled.compile_package`'s request.
#[derive(Serialize, JsonSchema)]
pub struct CompileRequest<'a> {
    pub package: &'a str,
    pub output: &'a str,
    pub files: Vec<&'a str>,
    /// `compile::Writer::name`.
    pub writer: &'a str,
    /// The model's name (`metadata.json`'s `generatedClassName`).
    pub name: &'a str,
}

/// `compiled.compile_package`'s reply.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct CompileReply {
    pub output: String,
    pub written: Vec<String>,
    pub absent: Vec<String>,
    pub coremltools: String,
}

// ---- eval (src/eval.rs, python/chunkforge_py/quality/text.py) -----------

/// One decode layout to evaluate (contract.py `EvalLayout`).
#[derive(Serialize, JsonSchema)]
pub struct EvalLayout {
    pub layout: Layout,
    pub packages: BTreeMap<String, PackageFiles>,
}

/// contract.py `EvalRequest`.
#[derive(Serialize, JsonSchema)]
pub struct EvalRequest<'a> {
    pub target: String,
    pub dims: Dims,
    pub layouts: Vec<EvalLayout>,
    pub files: RunFiles,
    pub text: &'a str,
    pub max_tokens: usize,
    pub checkpoint: CheckpointFiles,
    pub config_path: String,
    pub fp16: bool,
}

// ---- the free-running gate (src/gate.rs, python/chunkforge_py/quality/gate.py)

/// contract.py `SourceGreedyRequest`.
#[derive(Serialize, JsonSchema)]
pub struct SourceGreedyRequest<'a> {
    pub checkpoint: CheckpointFiles,
    pub config_path: String,
    pub prompt_ids: &'a [i64],
    pub max_tokens: usize,
}

/// contract.py `SourceGreedy`.
#[derive(Debug, Deserialize, JsonSchema)]
pub struct SourceGreedy {
    pub generated_ids: Vec<i64>,
    pub margins: Vec<f64>,
    pub seconds: f64,
}
