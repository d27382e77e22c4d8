"""The typed seam between the Rust binary and this package.

Every dict Rust hands to Python (the chunk plan, checkpoint info, build
settings, parity and fixture requests) and every dict Python hands back (a
package's stats, the parity report, a package description) is one of these
TypedDicts. They describe plain JSON-like data and cost nothing at run time:
the values are ordinary dicts. The Rust side of each is named in its docstring
(serde field names are the keys). Every entry point Rust calls is declared in
src/py/calls.rs with its Rust request and reply types; python/tests/test_seam.py
holds these TypedDicts to those types' JSON schemas (python/tests/seam.json),
so a field renamed on one side only fails a test.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

# ---- the plan (crates/model/src/plan.rs) --------------------------------

DType = Literal["fp16", "fp32", "int32"]
Attention = Literal["sliding", "full"]
# Runtime names of the producer KV read by KV-shared sliding / full layers.
Alias = Literal["kv13", "kv14"]
FunctionKind = Literal["decode", "verify", "prefill"]
# How a runtime build commits a verify_qK call (crates/model/src/layouts.rs).
VerifyCommit = Literal["accepted-rows", "write-through"]
# A row of the layout table (crates/model/src/layouts.rs): Python takes the
# names, and every fact about a layout, from the plan it is handed.
LayoutKind = str
# What a tensor of a function's contract carries.
Role = Literal[
    "hidden",
    "hidden_out",
    "mask_full",
    "mask_sliding",
    "mask_causal",
    "update_mask",
    "update_indicator",
    "per_layer_raw",
    "per_layer_combined",
    "per_layer_combined_out",
    "cos_sliding",
    "sin_sliding",
    "cos_full",
    "sin_full",
    "k_sliding",
    "v_sliding",
    "k_full",
    "v_full",
    "shared_k",
    "shared_v",
    "new_k_sliding",
    "new_v_sliding",
    "new_k_full",
    "new_v_full",
    "layer_k",
    "layer_v",
    "last_position_mask",
    "token_id",
    "token_logit",
    "token_ids",
]


class TensorSpec(TypedDict):
    """`plan::TensorSpec`: one input or output of a function, in contract order."""

    name: str
    shape: list[int]
    dtype: DType
    # What the tensor carries; the Python side finds tensors by it (roles.py),
    # never by name.
    role: Role
    # shared_k/shared_v: which producer KV the tensor carries.
    alias: NotRequired[Alias]
    # layer_k/layer_v: the layer whose K/V the tensor holds.
    layer: NotRequired[int]


class Contract(TypedDict):
    """A function's inputs and outputs, in the order Core ML sees them."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]


class FunctionPlan(Contract):
    """`plan::FunctionPlan`: one function of a package."""

    name: str
    kind: FunctionKind
    tokens: int
    # Prefill only (absent otherwise): the layers whose K/V its outputs hold, in
    # order (each layer_k/layer_v spec also names its own layer, which is what
    # Python reads).
    kv_layers: NotRequired[list[int]]


class OwnKv(TypedDict):
    """`plan::KvSource::Own`: the layer computes its K/V into ``slot`` of its
    kind's cache; a producer layer also carries the alias shared layers read."""

    kind: Literal["own"]
    slot: int
    alias: Alias | None


class SharedKv(TypedDict):
    """`plan::KvSource::Shared`: the layer reads the producer's K/V through ``alias``."""

    kind: Literal["shared"]
    alias: Alias
    producer: int


# `plan::KvSource`, tagged by "kind".
KvSource = OwnKv | SharedKv


class LayerPlan(TypedDict):
    """`plan::LayerPlan`."""

    index: int
    attention: Attention
    mlp_width: int
    kv: KvSource


class AliasUse(TypedDict):
    """`plan::AliasUse`: producer KV a chunk emits or consumes."""

    alias: Alias
    layer: int
    attention: Attention


class ChunkPlan(TypedDict):
    """`plan::ChunkPlan`: one package."""

    name: str
    first_layer: int
    last_layer: int
    layers: list[LayerPlan]
    sliding_slots: list[int]
    full_slots: list[int]
    emits: list[AliasUse]
    consumes: list[AliasUse]
    computes_per_layer_input: bool
    has_head: bool
    # The default function's contract.
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    # Every function, the default first.
    functions: list[FunctionPlan]


class SlotCopy(TypedDict):
    """`plan::SlotCopy`: one KV slot copy from the four-chunk caches into a layout's."""

    layer: int
    attention: Attention
    from_chunk: str
    from_slot: int
    to_chunk: str
    to_slot: int


class Layout(TypedDict):
    """`plan::Layout`."""

    kind: LayoutKind
    chunks: list[ChunkPlan]
    kv_slot_map: list[SlotCopy]


class Dims(TypedDict):
    """`plan::Dims`: the model dimensions every consumer of the plan needs."""

    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    vocab_size_per_layer_input: int
    num_attention_heads: int
    num_kv_heads_sliding: int
    num_kv_heads_full: int
    head_dim_sliding: int
    head_dim_full: int
    max_head_dim: int
    sliding_window: int
    ctx: int
    hidden_size_per_layer_input: int
    embed_scale: float
    per_layer_embed_scale: float
    rms_norm_eps: float
    final_logit_softcapping: float | None
    rope_theta_sliding: float
    rope_theta_full: float
    partial_rotary_factor_full: float
    kv_start: int
    producer_sliding: int | None
    producer_full: int | None
    layer_types: list[Attention]


class PlanDims(TypedDict):
    """The part of a plan every consumer reads (parity sends only this)."""

    dims: Dims


class Plan(PlanDims):
    """`plan::Plan`, as `chunkforge plan --json` prints it and `build` hands it over."""

    layouts: list[Layout]
    contract_notes: list[str]
    warnings: list[str]


# ---- build (crates/model/src/records.rs, src/py/calls.rs, src/build.rs) --


class CheckpointInfo(TypedDict):
    """A checkpoint Rust has validated: the tensor-name prefix and each
    (prefixed) tensor name's safetensors file."""

    prefix: str
    files: dict[str, str]


class Palettization(TypedDict):
    """records.rs `Palettization`: INT4 per_grouped_channel settings."""

    nbits: int
    granularity: str
    group_size: int
    palettizer: Literal["chunkforge", "coremltools"]
    # coremltools' palettization mode (`--palettizer coremltools`).
    mode: str
    # coremltools' k-means worker processes (`--palettizer coremltools`).
    kmeans_workers: int


# records.rs `PackageWriter`.
PackageWriter = Literal["chunkforge", "coremltools"]


class ConversionSettings(TypedDict):
    """records.rs `ConversionSettings`: what `ct.convert` is called with, defined
    once on the Rust side (`ConversionSettings::shipped`). Each string is the
    name of a coremltools enum member (`ct.target`, `ct.precision`,
    `ct.ComputeUnit`)."""

    ctx: int
    minimum_deployment_target: str
    compute_precision: str
    compute_units: str
    quantize: bool
    palettization: Palettization | None
    # "chunkforge": the default pipeline without `passes.SKIPPED`;
    # "coremltools": coremltools' default pipeline.
    pass_pipeline: Literal["chunkforge", "coremltools"]
    # Compose decode packages from the four-chunk programs (build.rs `Composer`).
    compose: bool
    # Convert a unit's functions together (joint.py).
    joint: bool
    # Who writes bundled and composed packages (runtime.package_writer).
    writer: PackageWriter
    # Take the shortcuts through coremltools' own code (runtime.mil_shortcuts).
    mil_shortcuts: bool


class ChunkJob(TypedDict):
    """py/calls.rs `ChunkJob`: one package to convert, every function of it."""

    dims: Dims
    chunk: ChunkPlan
    checkpoint: CheckpointInfo
    settings: ConversionSettings
    # Where each function's package goes, in the chunk's function order.
    paths: list[str]
    # Time every coremltools graph pass (`passes.PassProfile`).
    profile: bool


class PalettizeStats(TypedDict):
    """`palettize.Dispatcher.stats()`: the Rust kernel's counts for one conversion."""

    palettize_cache_hits: int
    palettize_cache_misses: int
    palettize_unmatched_groups: int
    palettize_seconds: float


class MilStats(TypedDict):
    mil_ops: int
    op_counts: dict[str, int]


class ChunkStats(MilStats):
    """What `convert.save` returns for one function's package. The palettize_*
    counts are None when the Rust palettizer did not run."""

    weight_bytes: int
    palettized_weights: int
    projection_ops: int
    palettize_cache_hits: int | None
    palettize_cache_misses: int | None
    palettize_unmatched_groups: int | None
    palettize_seconds: float | None


class PassStat(TypedDict):
    """records.rs `PassStat`: one graph pass in one conversion, summed over its runs."""

    seconds: float
    runs: int
    # Runs that changed the program (only when probed, else None).
    changed: int | None


class ConvertedFunction(TypedDict):
    """One function of a `convert_chunk` job: its counts and seconds per phase,
    and with `profile` the seconds per graph pass."""

    name: str
    stats: ChunkStats
    seconds: dict[str, float]
    passes: dict[str, PassStat] | None


class ConvertedChunk(TypedDict):
    """What `convert.convert_chunk` returns (py/calls.rs `ConvertedChunk`)."""

    functions: list[ConvertedFunction]


class ComposeSource(TypedDict):
    """py/calls.rs `ComposeSource`: a single-function four-chunk decode package and its plan."""

    path: str
    chunk: ChunkPlan


class ComposeJob(TypedDict):
    """py/calls.rs `ComposeJob`: the target chunk composed from its sources (layer order) into `path`."""

    target: ChunkPlan
    sources: list[ComposeSource]
    path: str
    settings: ConversionSettings


class ComposedChunk(TypedDict):
    """What `compose.compose_job` returns (py/calls.rs `Composed`)."""

    stats: ChunkStats
    seconds: dict[str, float]


class BundleStats(TypedDict):
    """What `convert.combine` returns."""

    weight_bytes: int


# ---- parity (src/parity.rs, crates/model/src/parity_checks.rs) ------------


class ParityLayout(TypedDict):
    """contract.rs `ParityLayout`: a layout named by its kind."""

    name: LayoutKind
    chunks: list[ChunkPlan]
    kv_slot_map: list[SlotCopy]


class ParityRequest(TypedDict):
    """What `parity.run` gets. Rust sends every key but the test build's
    ``sabotage``."""

    plan: PlanDims
    # The layout every other one is compared against (the four-chunk one).
    reference: LayoutKind
    # The decode layouts, the reference first (Rust takes them from the
    # layout table); every other step record is a function's.
    layouts: list[ParityLayout]
    checkpoint: CheckpointInfo
    config_path: str
    prompt_ids: list[int]
    steps: int
    # The checks to run, in order: each the unit chunkforge_py.parity.<name>
    # (parity_checks.rs `CHECKS`; a name from Rust's table, as LayoutKind).
    checks: list[str]
    thresholds: ParityThresholds
    prefill: int | None
    prefill_layout: ParityLayout | None
    oracle: bool
    # Sent by a test build only (python/tests/parity_sabotage.py applies it).
    sabotage: NotRequired[Sabotage]
    # The build folder whose packages' INT4 weights are checked, or None.
    artifacts: str | None
    # INT4 (palettized build) or FP16 (--no-quantize), from the build's settings.
    artifacts_precision: str | None
    artifact_layouts: dict[LayoutKind, ParityLayout]


class ParityThresholds(TypedDict):
    """parity_checks.rs `Thresholds`: what the checks are held to (parity's options)."""

    tol_cos: float
    tol_cos_int4: float
    min_top1_int4: float
    max_weight_rel_mse: float
    max_kl: float


class Sabotage(TypedDict):
    """contract.rs `Sabotage` (test builds only): a weight of ``corrupt_layer``
    broken in the compared layouts or, with ``corrupt_function``, in the
    verify or prefill modules; or the prefill hand-off's KV copy skipped."""

    corrupt_layer: int | None
    corrupt_function: Literal["verify", "prefill"] | None
    skip_prefill_copy: bool


# records.rs `Verdict`: a check's or a run's outcome (verdicts.py).
Verdict = Literal["ok", "inconclusive", "fail"]


class StepRecord(TypedDict):
    """One layout (or function) at one step against the reference."""

    layout: str
    step: int
    cos: float
    ref_token: int
    token: int
    margin: float
    ok: bool
    # verdicts.py: what a failure here means.
    verdict: Verdict


class OracleRecord(TypedDict):
    """The reference against transformers at one step, and transformers'
    noise floor there: its eager attention against sdpa, hidden-state cosine
    and largest logit change (parity.py `oracle_record`)."""

    step: int
    hf_token: int
    ref_token: int
    cos: float
    margin: float
    ok: bool
    floor_cos: float
    floor_logit: float
    ill_conditioned: bool
    verdict: Verdict


class ArtifactRecord(TypedDict):
    """A layout with its packages' INT4 weights at one step."""

    layout: str
    step: int
    cos: float
    ref_token: int
    token: int
    same_token: bool


class LayerDivergence(TypedDict):
    """The first layer whose hidden state leaves the reference's (all None:
    every layer matches, the divergence is in the head)."""

    layer: int | None
    chunk: str | None
    cos: float | None


class Localisation(LayerDivergence):
    step: int


class WorstWeight(TypedDict):
    weight: str | None
    rel_mse: float


class NoiseDraw(TypedDict):
    """One draw of `WeightNoise`."""

    min_cos: float
    mean_cos: float
    top1_agreement: float


class WeightNoise(TypedDict):
    """The fp32 model with each projection's weight plus Gaussian noise of
    its palettization's relative MSE, against the reference (parity/noise.py):
    the lowest min cos and top-1 and the mean cos over its draws, and each draw."""

    min_cos: float
    mean_cos: float
    top1_agreement: float
    draws: list[NoiseDraw]


class LayoutArtifactSummary(TypedDict):
    """A decode layout with its packages' INT4 weights, over every step."""

    weights_replaced: dict[str, int]
    worst_weight: WorstWeight
    min_cos: float
    mean_cos: float
    top1_agreement: float
    tokens_match_other_layouts: bool
    # Measured where the thresholds failed and the weights held (noise.py).
    weight_noise: WeightNoise | None
    ok: bool
    # verdicts.py and noise.py: what a failure here means.
    verdict: Verdict


class FunctionArtifactSummary(TypedDict):
    """verify_qK / prefill_bN with their packages' weights, against the INT4
    four-chunk decode of the same build."""

    weights_replaced: dict[str, int]
    min_cos: float
    steps: int
    tokens_match: bool
    ok: bool
    # verdicts.py: what a failure here means.
    verdict: Verdict


ArtifactSummary = LayoutArtifactSummary | FunctionArtifactSummary


class FirstFailure(TypedDict):
    layout: str
    step: int
    cos: float
    ref_token: int
    token: int


class PrefillSummary(TypedDict):
    tokens: int
    function: str


class ProgramRecord(TypedDict):
    """One step of a package's own program run by the MIL interpreter
    (parity_programs.py): against the read-back torch modules (same weights),
    the fp32 reference (checkpoint weights) and transformers where they apply."""

    target: str
    precision: Literal["fp32", "fp16"]
    step: int
    token: int
    readback_token: int
    cos_readback: float
    # The read-back modules' top-2 logit margin at the step, and the largest
    # change of any logit from them to the program (None where not compared).
    readback_margin: float | None
    logit_change: float | None
    ref_token: int | None
    cos_reference: float | None
    hf_token: int | None
    cos_hf: float | None


class ProgramSummary(TypedDict):
    steps: int
    min_cos_readback: float
    tokens_match_readback: bool
    # The largest logit change over the steps, and the largest read-back
    # margin at a step whose token differs (None: none differs).
    max_logit_change: float | None
    max_flip_margin: float | None
    min_cos_reference: float | None
    top1_reference: float | None
    min_cos_hf: float | None
    top1_hf: float | None
    # fp32 is the gate (the program and the read-back modules compute the same
    # function); fp16 is reported.
    gated: bool
    ok: bool
    # verdicts.py: what a failure here means.
    verdict: Verdict


class KlRecord(TypedDict):
    """KL(transformers ‖ reference) of the next-token distributions at one step (parity/kl.py)."""

    step: int
    kl: float


class KlSummary(TypedDict):
    """The KL check over every step: the mean and the largest, against --max-kl."""

    steps: int
    mean: float
    max: float
    max_step: int
    ok: bool
    verdict: Verdict


class ParitySummary(TypedDict):
    ok: bool
    verdict: Verdict
    steps: int
    decode_steps: int
    tol_cos: float
    layouts: list[str]
    min_cos: float | None
    min_margin: float | None
    oracle_ok: bool | None
    oracle_min_cos: float | None
    # Steps where transformers disagrees with itself beyond the tolerance.
    ill_conditioned: list[int] | None
    first_failure: FirstFailure | None
    localisation: dict[str, Localisation] | None
    prefill: PrefillSummary | None
    verify_k: int | None
    artifacts: dict[str, ArtifactSummary] | None
    # INT4 (palettized build) or FP16 (--no-quantize): what the read-back weights are.
    artifacts_precision: str | None
    # By layout or function, then precision (fp32, fp16).
    programs: dict[str, dict[str, ProgramSummary]] | None
    kl: KlSummary | None
    # The fp16 range of the packages' programs as --artifacts ran them in fp16.
    fp16_range: Fp16RangeReport | None
    seconds: float


class ParityReport(TypedDict):
    """What `parity.run` returns (Rust adds format, checkpoint, prompt_ids and tool)."""

    steps: list[StepRecord]
    oracle: list[OracleRecord]
    artifacts: list[ArtifactRecord]
    programs: list[ProgramRecord]
    kl: list[KlRecord]
    summary: ParitySummary


# ---- fixture (src/fixture.rs) -------------------------------------------

FixtureShape = Literal["e2b", "e4b"]
# fixture/mod.rs `AttentionSharpness`: how peaked random attention is.
AttentionSharpness = Literal["soft", "sharp"]


class FixtureArgs(TypedDict):
    """What `fixture.write_fixture_json` gets."""

    out_dir: str
    shape: FixtureShape
    seed: int
    multimodal: bool
    shards: int
    sliding_window: int
    vocab_size: int
    full_width: bool
    attention: AttentionSharpness | None


class FixtureInfo(TypedDict):
    """What `fixture.write_fixture` returns."""

    tensors: int
    parameters: int


class FullSizeArgs(TypedDict):
    """What `fixture.full_size_layout_json` gets (fixture/mod.rs `write_full_size`)."""

    out_dir: str
    shape: FixtureShape
    multimodal: bool
    sliding_window: int
    attention: AttentionSharpness


class NormalInit(TypedDict):
    """Values drawn from N(mean, std^2)."""

    normal: dict[Literal["mean", "std"], float]


class UniformInit(TypedDict):
    """Values drawn from U(low, high)."""

    uniform: dict[Literal["low", "high"], float]


Init = NormalInit | UniformInit


class TensorRecipe(TypedDict):
    """One tensor of a streamed checkpoint (fixture/stream.rs `TensorRecipe`): its
    name and shape as transformers has them, and how its values are drawn."""

    name: str
    shape: list[int]
    init: Init


class FullSizeLayout(TypedDict):
    """What `fixture.full_size_layout_json` returns: the tensors for Rust to stream into shards."""

    tensors: list[TensorRecipe]


# ---- inspect (src/commands/inspect.rs, src/py/calls.rs) -----------------


class DescribeArgs(TypedDict):
    path: str
    # The folder of the weight blob the package reads when it holds none
    # (a release's package whose blob the app's download shares in).
    weights: str | None


class IoDescription(TypedDict):
    name: str
    shape: list[int]
    # fp16 / fp32 / int32, or the spec's data type number for any other.
    dtype: str


class FunctionDescription(TypedDict):
    name: str
    inputs: list[IoDescription]
    outputs: list[IoDescription]
    # ML programs only:
    mil_ops: NotRequired[int]
    projection_ops: NotRequired[int]
    int4_g32_projection_ops: NotRequired[int]


class PalettizedConst(TypedDict):
    name: str
    weight_shape: list[int]
    lut_shape: list[int]
    indices_dtype: str


class ProjectionWeight(TypedDict):
    op: str
    weight: str
    weight_op: str


class PackageDescription(TypedDict):
    """What `inspect_pkg.describe` returns. The keys after ``functions`` are
    there only for an ML program (and describe its default function)."""

    path: str
    specification_version: int
    model_type: str
    default_function: str
    inputs: list[IoDescription]
    outputs: list[IoDescription]
    functions: list[FunctionDescription]
    opset: NotRequired[str]
    mil_ops: NotRequired[int]
    palettized: NotRequired[list[PalettizedConst]]
    projections: NotRequired[list[ProjectionWeight]]
    layers: NotRequired[list[int]]


# ---- audit (src/audit.rs, src/commands/audit.rs) ------------------------

# The layer kinds of the device-proven op-type table (ane_op_types.json):
# decoder layers by attention and KV source, and the ops before the first /
# after the last layer of a program.
LayerKind = Literal["sliding", "full", "shared_sliding", "shared_full", "pre", "head"]
AuditRule = Literal["op-type", "rank", "fp32", "large-dim", "last-axis-1", "dynamic-shape", "compute-plan"]
# error: `package` refuses the release, `audit` exits 1; warning: reported only.
Severity = Literal["error", "warning"]


class AuditPackage(TypedDict):
    """One package to audit: its path, the name findings carry, and the kind of
    each decoder layer it holds (by layer index; from the build's plan, empty
    when unknown)."""

    path: str
    name: str
    layer_kinds: dict[str, LayerKind]
    # The two- and one-chunk layouts' packages: the compute plan's ship verdict
    # (at most 5 % of the ops off the Neural Engine) applies to them.
    merged: bool


class AuditArgs(TypedDict):
    packages: list[AuditPackage]
    # Run MLComputePlan when the platform can (macOS).
    compute_plan: bool


class AuditFinding(TypedDict):
    """One rule broken by one op (or function input) of one function."""

    package: str
    function: str
    op: str
    op_type: str
    # A decoder layer index, `pre` or `head`.
    layer: str
    # The layer's kind, or `unknown` (a layer the plan does not describe).
    layer_kind: str
    rule: AuditRule
    severity: Severity
    # The tensor the finding is about (an op output or a function input).
    tensor: str
    detail: str


class FunctionAudit(TypedDict):
    name: str
    # Ops that run per call (const and constexpr_* ops are load-time weights).
    ops: int
    const_ops: int
    op_counts: dict[str, int]
    findings: dict[str, int]


class PackageAudit(TypedDict):
    package: str
    path: str
    functions: list[FunctionAudit]
    findings: dict[str, int]


class ComputePlanPackage(TypedDict):
    package: str
    ops: int
    non_ane: int
    # Non-ANE ops by `op_type -> device`.
    non_ane_by_kind: dict[str, int]
    # merged packages only: at most 5 % of the ops off the Neural Engine.
    ship: NotRequired[bool]


class ComputePlanReport(TypedDict):
    # Why no compute plan was made (every other key is then absent).
    skipped: NotRequired[str]
    packages: NotRequired[list[ComputePlanPackage]]
    ops: NotRequired[int]
    non_ane: NotRequired[int]


class AuditLimits(TypedDict):
    max_rank: int
    max_dim: int
    last_axis_1_min_elements: int


class OpTable(TypedDict):
    path: str
    sha256: str


class AuditReport(TypedDict):
    """What `audit.audit` returns (`chunkforge audit --json` prints it)."""

    format: str
    op_table: OpTable
    limits: AuditLimits
    packages: list[PackageAudit]
    findings: list[AuditFinding]
    total: int
    errors: int
    warnings: int
    by_rule: dict[str, int]
    # Every rule's severity (audit.SEVERITY).
    severity: dict[str, Severity]
    compute_plan: ComputePlanReport


class OpTypes(TypedDict):
    """What `audit.op_types` returns: the op types per layer kind found in the
    packages, in ane_op_types.json's shape (to regenerate and diff the table)."""

    layer_kinds: dict[str, list[str]]
    output_dtypes: dict[str, list[str]]


# ---- runtime and bench (src/commands/doctor.rs, src/bench_palettize.rs) --


class PlatformLimits(TypedDict):
    system: str
    machine: str
    can_predict: bool
    can_compile_mlmodelc: bool
    can_load_compute_plan: bool


class BenchArgs(TypedDict):
    """What `bench_palettize.run` gets."""

    quick: bool
    seed: int
    progress: bool


class BenchResult(TypedDict):
    shape: list[int]
    impl: str
    seconds: float
    mse: float
    lut_shape: list[int]


class BenchReport(TypedDict):
    results: list[BenchResult]
    group_size: int
    nbits: int
    weight_std: float
    seed: int


# ---- run (src/run.rs) -------------------------------------------------------

# A layout as `run` gets it: the plan of hf_model/config.json at the release's
# context length, checked against manifest.json.
RunLayout = Layout


# Paths of the release's side files `run` reads (Rust checked each one's size,
# header and manifest digest): every side file of Rust's `SIDE_FILES` by its
# name without the extension (embed_tokens_q8, embed_tokens_scales,
# embed_tokens_per_layer_q8, embed_tokens_per_layer_scales, cos_sliding,
# sin_sliding, cos_full, sin_full, ...), and tokenizer: hf_model/tokenizer.json
# (empty where a release made with --no-tokenizer has none).
RunFiles = dict[str, str]


class RunPackage(TypedDict):
    """Where `run` reads one package: its folder, and the folder of the
    weight blob it reads (its own, or the one the app's downloader links or
    copies it from)."""

    path: str
    weights: str


class RunRequest(TypedDict):
    """What `emulate.run` gets."""

    release: str
    # Every package of the decode, reference and prefill layouts, by name.
    packages: dict[str, RunPackage]
    dims: Dims
    decode: RunLayout
    # The reference layout: prefill's KV lands in its caches, its packages hold verify_qK.
    reference: RunLayout
    prefill: RunLayout
    files: RunFiles
    prompt: str | None
    prompt_ids: list[int] | None
    max_tokens: int
    # Draft tokens per verify_qK call (its K), or None for plain decode.
    speculate: int | None
    # How the runtime build commits a verify call (layouts.rs `VerifyCommit`):
    # main's accepted rows, or the branch's write-through caches.
    verify_commit: VerifyCommit
    eos_token_ids: list[int]
    # Round every fp16 op output to fp16 in the interpreter (the device's arithmetic, closest).
    fp16: bool


class Speculation(TypedDict):
    k: int
    calls: int
    drafts: int
    accepted_drafts: int
    commit: VerifyCommit
    # write-through: rows of rejected drafts left in the window caches.
    stale_rows: int


class RunResult(TypedDict):
    layout: LayoutKind
    chunks: list[str]
    prompt_ids: list[int]
    generated_ids: list[int]
    # Per generated token: its logit minus the runner-up's.
    margins: list[float]
    text: str | None
    # eos, max_tokens or context.
    stopped: str
    prefill_tokens: int
    prefill_function: str
    load_seconds: float
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_second: float
    speculation: Speculation | None


# ---- exec (src/commands/exec.rs, src/py/calls.rs) ------------------------


class ExecRequest(TypedDict):
    """What `mil_interp.exec_function` gets."""

    package: str
    # None: the package's default function.
    function: str | None
    inputs: str
    output: str
    fp16: bool


class ExecTensor(TypedDict):
    name: str
    shape: list[int]
    # The program's type (inputs) or the written array's numpy dtype (outputs).
    dtype: str


class ExecResult(TypedDict):
    package: str
    function: str
    fp16: bool
    # Ops run per call (constants and compile-time ops excluded).
    ops: int
    inputs: list[ExecTensor]
    outputs: list[ExecTensor]
    output: str
    load_seconds: float
    run_seconds: float


class CompileRequest(TypedDict):
    """compiled.compile_package: one .mlpackage to the .mlmodelc files the app requests."""

    package: str
    output: str
    # Paths inside the compiled model to lay out (downloader.rs MODELC_FILES).
    files: list[str]
    # chunkforge (any platform), coremltools or check (both, compared; macOS).
    writer: str
    # The model's name (metadata.json's generatedClassName, analytics' modelName).
    name: str


class CompileReply(TypedDict):
    output: str
    written: list[str]
    absent: list[str]
    coremltools: str


# ---- the fp16 range (python/chunkforge_py/mil/fp16range.py; records.rs) ----------


class Fp16Op(TypedDict):
    """One fp16-typed op output as the fp16 runs saw it."""

    package: str
    function: str
    op: str
    op_type: str
    # The audit's place of the op: a layer index, pre or head.
    layer: str
    # The largest finite |value| the op computed (before rounding to fp16).
    max_abs: float
    # log2(65504 / max_abs): how many doublings it is from overflowing (None: all zero).
    margin_log2: float | None
    # Elements finite before the rounding to fp16 and inf after.
    overflow: int
    # Elements inf or NaN where none of the op's inputs was, in fp16 runs and in fp32 runs (None: none ran).
    made_nonfinite_fp16: int
    made_nonfinite_fp32: int | None


class Fp16RangeReport(TypedDict):
    fp16_max: float
    fp16_runs: int
    fp32_runs: int
    # fp16-typed op outputs seen.
    outputs: int
    # The outputs nearest to overflow, nearest first.
    closest: list[Fp16Op]
    # Ops making inf or NaN in fp16 that the fp32 runs do not make: the failure.
    introduced: list[Fp16Op]
    ok: bool
    # Every output, nearest first (left out where the report is embedded).
    every: NotRequired[list[Fp16Op]]


# ---- eval (src/eval.rs) ---------------------------------------------------------


class EvalLayout(TypedDict):
    """One decode layout to evaluate: its plan, and where each of its packages is."""

    layout: Layout
    packages: dict[str, RunPackage]


class EvalRequest(TypedDict):
    """What `quality.text.evaluate` gets."""

    # The release or build folder (for messages).
    target: str
    dims: Dims
    layouts: list[EvalLayout]
    # The runtime's side files (a release's, or made from the build's checkpoint) and the tokenizer.
    files: RunFiles
    text: str
    # The text's tokens scored at most (the context holds the rest of a longer text).
    max_tokens: int
    # The source checkpoint, run by transformers.
    checkpoint: CheckpointInfo
    config_path: str
    # Round every fp16 op output to fp16 (and record the fp16 range).
    fp16: bool


class Disagreement(TypedDict):
    """A position where the package's top-1 token is not the source's."""

    position: int
    source_token: int
    package_token: int
    # The source's top logit minus its runner-up's there.
    source_margin: float


class LayoutQuality(TypedDict):
    layout: LayoutKind
    chunks: list[str]
    perplexity: float
    # Mean negative log-likelihood per scored token, nats.
    nll: float
    # KL(source ‖ package) per position, nats.
    kl_mean: float
    kl_max: float
    kl_max_position: int
    # Positions whose top-1 token is the source's.
    top1: float
    disagreements: list[Disagreement]
    # The largest |package logit - source logit| over every position and token.
    max_logit_error: float
    seconds: float


class SourceQuality(TypedDict):
    perplexity: float
    nll: float
    # The smallest top-2 margin of the source over the scored positions.
    min_margin: float
    seconds: float


class EvalResult(TypedDict):
    """What `quality.text.evaluate` returns (Rust adds the rest of the report)."""

    # Tokens of the text taken (<bos> included); the scored positions are one fewer.
    tokens: int
    positions: int
    source: SourceQuality
    layouts: list[LayoutQuality]
    fp16_range: Fp16RangeReport | None
    seconds: float


# ---- the free-running gate (src/gate.rs) ----------------------------------------


class SourceGreedyRequest(TypedDict):
    """What `quality.gate.source_greedy` gets."""

    checkpoint: CheckpointInfo
    config_path: str
    prompt_ids: list[int]
    max_tokens: int


class SourceGreedy(TypedDict):
    """transformers' greedy tokens after the prompt, each with the source's top-2 margin there."""

    generated_ids: list[int]
    margins: list[float]
    seconds: float
