"""A static ANE audit of Core ML packages: what can be known on Linux.

Every function of a package is read straight from its protobuf
(``Data/com.apple.CoreML/model.mlmodel``; no weights are loaded, nothing is
written), every op is attributed to a decoder layer, and each op and function
input is checked against the rules below. None of the rules proves that an op
runs on the Neural Engine — only the compute plan on macOS says where Core ML
places each op — but each names a pattern the device-proven graphs do not have.

Rules (a finding names the package, function, op, op type, layer, rule and
its severity; ``SEVERITY``: errors refuse a release, warnings cost speed only):

- ``op-type`` (error): an op type outside the device-proven set of its
  layer's kind (``ane_op_types.json``, a checked-in table; ``cast`` is proven
  only to the output dtypes the table lists).
- ``rank`` (error): a tensor of rank above 4 (the ANE's tensors have at most 4 axes).
- ``fp32`` (error): an fp32 (or fp64) tensor anywhere: function inputs, op
  outputs, consts (the ANE computes in fp16).
- ``large-dim`` (error): a dimension above 16384, except under the
  ``head-vocab`` allowance: the tied head weight (a const named ``lm_head*``),
  the ops that consume it, and the ops downstream of those whose every large
  dimension is the head weight's (the vocabulary): softcap, reshape, argmax /
  max over the vocabulary. The device-proven graphs have such a dimension
  there only.
- ``last-axis-1`` (warning): an activation (op output or function input) of
  at least 4096 elements whose last axis is 1: the ANE pads the last axis to
  64 bytes, so a singleton last axis costs 32x at fp16. Weights are exempt (a
  1x1 conv weight is [O, I, 1, 1] by definition and is not laid out that
  way), and so are the two layouts the device-proven graphs run with: the
  NCHW row ``[1, C, 1, T]`` of a 1x1 convolution, and a softmax's row
  statistics (``is_row_statistic``).
- ``dynamic-shape`` (error): a dimension (or rank) that is not a constant.

Layers. Weights say where their op sits: an op that consumes a
``layers_N_*`` const (a weight of decoder layer N, as coremltools names
torch's ``layers.N.*`` parameters) belongs to layer N, one that consumes the
per-layer input projection or its norm to ``pre``, the final norm or the tied
head to ``head``; unless the op already depends on a later layer (coremltools
keeps one const of equal weights, under the first one's name). Every other
op is placed by dataflow: ``up`` is the latest place among its ancestors,
``next`` the places of the nearest weighted ops among its descendants.
Between two places (``up`` before every ``next``) an op belongs to the next
one (the norm before a layer's first weighted op is that layer's), unless it
is a residual sum of ``up``'s layer: it adds two different results of that
layer's weighted ops (``h + f(h)``), so it ends the layer, whether or not a
``layer_scalar`` multiplication follows (coremltools drops ``x * 1.0``).
Fed by inputs alone, an op belongs to its one ``next`` layer, or to ``pre``
when it feeds several (shared preparation: masks, per-layer inputs). With no
weighted op after it, an op belongs to ``up`` when that is ``pre`` or
``head``, when it is a residual sum of ``up``'s layer, or when every nearest
weighted op it derives from is that layer's (its cache slot cut for the
outputs); else to ``head`` (several layers' caches assembled for the
outputs, or inputs handed on). Nothing depends on the order of the ops in
the program. A const belongs to the place its name
says, else to its first consumer's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from ..contract import (
    AuditArgs,
    AuditFinding,
    AuditLimits,
    AuditPackage,
    AuditReport,
    AuditRule,
    ComputePlanPackage,
    ComputePlanReport,
    FunctionAudit,
    LayerKind,
    OpTypes,
    PackageAudit,
    Severity,
)
from ..runtime import ChunkforgeError
from .inspect import LAYER_RE, read_package

FORMAT = "chunkforge-audit/2"
# Every rule and the weight of its findings: an error is a pattern that keeps
# an op off the Neural Engine or a function from compiling for it (`package`
# refuses a release with one), a warning one that costs speed only (`package`
# ships and reports it). `chunkforge audit` exits 1 on errors only.
SEVERITY: dict[AuditRule, Severity] = {
    "op-type": "error",
    "rank": "error",
    "fp32": "error",
    "large-dim": "error",
    "last-axis-1": "warning",
    "dynamic-shape": "error",
    "compute-plan": "error",
}
MAX_RANK = 4
MAX_DIM = 16384
LAST_AXIS_1_MIN_ELEMENTS = 4096
# The compute plan's ship verdict for a merged package: at most this fraction
# of its ops off the Neural Engine (the device run book's pass criterion).
MAX_NON_ANE_FRACTION = 0.05
LAYER_KINDS: tuple[LayerKind, ...] = ("sliding", "full", "shared_sliding", "shared_full", "pre", "head")
DECODER_KINDS: tuple[LayerKind, ...] = ("sliding", "full", "shared_sliding", "shared_full")
# Weights, materialized at load time: not dispatched per call (the compute
# plan audit does not count them either).
CONST_OPS = frozenset(
    {
        "const",
        "constexpr_lut_to_dense",
        "constexpr_affine_dequantize",
        "constexpr_blockwise_shift_scale",
        "constexpr_sparse_to_dense",
        "constexpr_cast",
    }
)
HEAD_WEIGHT_RE = re.compile(r"^lm_head")
TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ane_op_types.json")
# MIL DataType names -> the names the rest of chunkforge uses.
DTYPES = {"FLOAT16": "fp16", "FLOAT32": "fp32", "FLOAT64": "fp64", "BFLOAT16": "bf16", "BOOL": "bool"}
WIDE_FLOATS = frozenset({"fp32", "fp64"})


# ---- the program, as read from the protobuf -------------------------------


@dataclass
class Tensor:
    """A typed value: dtype name and shape (None: unknown dimension; a shape
    of None: unknown rank, or not a tensor)."""

    name: str
    dtype: str
    shape: list[int | None] | None

    def elements(self) -> int | None:
        if self.shape is None or any(d is None for d in self.shape):
            return None
        n = 1
        for d in self.shape:
            n *= cast(int, d)
        return n

    def shape_text(self) -> str:
        if self.shape is None:
            return "[?]"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"


@dataclass
class Op:
    index: int
    type: str
    name: str
    # The values it reads, by argument name (``x``, ``weight``, ...), and all of them.
    args: dict[str, list[str]]
    outputs: list[Tensor]
    inputs: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.inputs = [v for values in self.args.values() for v in values]

    @property
    def is_const(self) -> bool:
        return self.type in CONST_OPS


@dataclass
class Function:
    name: str
    inputs: list[Tensor]
    ops: list[Op]
    producer: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for op in self.ops:
            for t in op.outputs:
                self.producer[t.name] = op.index
            for v in op.inputs:
                self.consumers.setdefault(v, []).append(op.index)

    def value(self, name: str) -> Tensor | None:
        """The tensor named ``name``: an op's output or a function input."""
        p = self.producer.get(name)
        if p is not None:
            return next(t for t in self.ops[p].outputs if t.name == name)
        return next((t for t in self.inputs if t.name == name), None)


def dtype_name(data_type: int) -> str:
    from coremltools.proto import MIL_pb2

    raw = str(MIL_pb2.DataType.Name(data_type))
    return DTYPES.get(raw, raw.lower())


def tensor_of(name: str, value_type: Any) -> Tensor:
    """A MIL ValueType as a Tensor (a state's wrapped tensor; a list's element
    type, with an unknown length as an unknown leading dimension)."""
    kind = value_type.WhichOneof("type")
    if kind == "stateType":
        return tensor_of(name, value_type.stateType.wrappedType)
    if kind == "listType":
        inner = tensor_of(name, value_type.listType.type)
        length = value_type.listType.length
        n = length.constant.size if length.WhichOneof("dimension") == "constant" else None
        return Tensor(name, inner.dtype, None if inner.shape is None else [n, *inner.shape])
    if kind != "tensorType":
        return Tensor(name, str(kind), None)
    tt = value_type.tensorType
    dims: list[int | None] = [
        int(d.constant.size) if d.WhichOneof("dimension") == "constant" else None for d in tt.dimensions
    ]
    shape = dims if tt.rank >= 0 and len(dims) == tt.rank else None
    return Tensor(name, dtype_name(tt.dataType), shape)


def op_name(op: Any) -> str:
    """The op's own name attribute (coremltools writes one), else its first output's."""
    if "name" in op.attributes:
        strings = op.attributes["name"].immediateValue.tensor.strings.values
        if strings:
            return str(strings[0])
    return str(op.outputs[0].name) if op.outputs else op.type


def flatten(block: Any) -> Iterator[Any]:
    """A block's ops in program order, nested blocks (cond, while_loop) after their op."""
    for op in block.operations:
        yield op
        for inner in op.blocks:
            yield from flatten(inner)


def functions_of(spec: Any, path: str) -> list[Function]:
    """Every function of the package's ML program, read from the spec alone."""
    if spec.WhichOneof("Type") != "mlProgram":
        raise ChunkforgeError(f"{path}: not an ML program (model type {spec.WhichOneof('Type')}); nothing to audit")
    out = []
    # In the order the package describes them (the default first), then any other.
    described = [f.name for f in spec.description.functions if f.name in spec.mlProgram.functions]
    for fname in described + sorted(set(spec.mlProgram.functions) - set(described)):
        fn = spec.mlProgram.functions[fname]
        if fn.opset not in fn.block_specializations:
            raise ChunkforgeError(f"{path}: function {fname} has no block for its opset {fn.opset}")
        ops = []
        for i, op in enumerate(flatten(fn.block_specializations[fn.opset])):
            # Argument names sorted: a protobuf map's order is not the program's.
            args = {k: [b.name for b in arg.arguments if b.name] for k, arg in sorted(op.inputs.items())}
            outputs = [tensor_of(o.name, o.type) for o in op.outputs]
            ops.append(Op(i, op.type, op_name(op), args, outputs))
        out.append(Function(fname, [tensor_of(t.name, t.type) for t in fn.inputs], ops))
    return out


# ---- layers ---------------------------------------------------------------

# Where an op sits, as an ordered number: the ops before the first decoder
# layer (PRE), decoder layer N (N), the ops after the last (HEAD).
PRE = -1
HEAD = 1 << 30
# The weights that say where their op sits, by const name (coremltools names a
# const after torch's parameter: `layers.7.mlp.up_proj.weight` is
# `layers_7_mlp_up_proj_weight_to_fp16`): a decoder layer's own, the per-layer
# input projection and its norm (computed before the first layer), the final
# norm and the tied head.
PRE_WEIGHT_RE = re.compile(r"^per_layer_(model_projection|projection_norm)_")
HEAD_ANCHOR_RE = re.compile(r"^(norm_weight|lm_head)")


def anchor(name: str) -> int | None:
    """Where a weight named ``name`` sits (PRE, a layer index, HEAD), if its name says."""
    m = LAYER_RE.match(name)
    if m:
        return int(m.group(1))
    if PRE_WEIGHT_RE.match(name):
        return PRE
    if HEAD_ANCHOR_RE.match(name):
        return HEAD
    return None


def const_layer(op: Op) -> int | None:
    return anchor(op.outputs[0].name) if op.outputs else None


def place_name(place: int) -> str:
    return "pre" if place == PRE else "head" if place == HEAD else str(place)


def layers_of(f: Function) -> list[str]:
    """Each op's layer (module docstring: Layers), by op index."""
    n = len(f.ops)
    ops = f.ops

    def sources(op: Op) -> list[int]:
        """The non-const ops whose outputs ``op`` reads."""
        return [f.producer[v] for v in op.inputs if v in f.producer and not ops[f.producer[v]].is_const]

    # Named weights read by several ops. coremltools keeps one const of equal
    # weights (const_deduplication), under the first one's name, so a layer's
    # op can read a weight named after an earlier layer: one whose other
    # reader is among the op's ancestors is not the op's own.
    readers: dict[int, list[int]] = {}
    for op in ops:
        if op.is_const and const_layer(op) is not None:
            users = [c for t in op.outputs for c in f.consumers.get(t.name, []) if not ops[c].is_const]
            if len(users) > 1:
                readers[op.index] = users
    shared = {u for users in readers.values() for u in users}
    # direct: the place the op's own weights name. up: the latest place among
    # its ancestors and itself (ops are in topological order). below: the
    # readers of shared weights among its ancestors. reach: the nearest ops
    # with a direct place among its ancestors.
    direct: list[int | None] = [None] * n
    up: list[int | None] = [None] * n
    below: list[frozenset[int]] = [frozenset()] * n
    reach: list[frozenset[int]] = [frozenset()] * n
    for op in ops:
        if op.is_const:
            continue
        i = op.index
        srcs = sources(op)
        below[i] = frozenset().union(*(below[p] | ({p} if p in shared else set()) for p in srcs))
        weights = [f.producer[v] for v in op.inputs if v in f.producer and ops[f.producer[v]].is_const]
        named = [
            cast(int, const_layer(ops[w]))
            for w in weights
            if const_layer(ops[w]) is not None and not below[i].intersection(readers.get(w, ()))
        ]
        direct[i] = max(named) if named else None
        before = max((cast(int, up[p]) for p in srcs if up[p] is not None), default=None)
        places = [x for x in (direct[i], before) if x is not None]
        up[i] = max(places) if places else None
        acc: set[int] = set()
        for p in srcs:
            acc |= {p} if direct[p] is not None else reach[p]
        reach[i] = frozenset(acc)

    # next: the places of the nearest ops with a direct place among the descendants.
    nxt: list[frozenset[int]] = [frozenset()] * n
    for op in reversed(ops):
        if op.is_const:
            continue
        acc = set()
        for t in op.outputs:
            for c in f.consumers.get(t.name, []):
                d = direct[c]
                if d is not None:
                    acc.add(d)
                else:
                    acc |= nxt[c]
        nxt[op.index] = frozenset(acc)

    def joins(op: Op, layer: int) -> bool:
        """A residual sum of ``layer``: ``op`` brings together two different
        results of that layer's weighted ops (the stream and a branch, ``h +
        f(h)``), where the input of the next norm (``[x, -x]``) holds one
        result twice."""
        keys = {
            frozenset({p}) if direct[p] is not None else reach[p]
            for v in op.inputs
            for p in [f.producer.get(v)]
            if p is not None and not ops[p].is_const
        }
        return sum(1 for k in keys if any(direct[q] == layer for q in k)) >= 2

    place_of: list[int] = [PRE] * n
    for op in ops:
        i = op.index
        if op.is_const:
            continue
        d, u, fr = direct[i], up[i], nxt[i]
        if d is not None:
            place = d
        elif fr:
            lo = min(fr)
            if u is None or u == PRE:
                # Fed by inputs alone: one layer's slice of them, or preparation several share.
                place = lo if len(fr) == 1 else PRE
            elif lo <= u or joins(op, u):
                place = u
            else:
                # Between a layer's weighted ops and the next place's: the next one's norm, say.
                place = lo
        elif u is not None and (u in (PRE, HEAD) or joins(op, u) or all(direct[q] == u for q in reach[i])):
            # Feeds only the function's outputs: the end of a layer, or its own
            # results cut for them (one layer's cache slot).
            place = u
        else:
            # The results of several layers assembled for the outputs (their caches).
            place = HEAD
        place_of[i] = place
    out = [place_name(p) for p in place_of]
    for op in ops:
        if not op.is_const:
            continue
        own = const_layer(op)
        if own is not None:
            out[op.index] = place_name(own)
            continue
        users = [c for t in op.outputs for c in f.consumers.get(t.name, []) if not ops[c].is_const]
        if users:
            out[op.index] = out[min(users)]
        else:
            # A const feeding only other consts (a constexpr's inputs): theirs.
            feeds = [c for t in op.outputs for c in f.consumers.get(t.name, [])]
            out[op.index] = out[min(feeds)] if feeds else "pre"
    return out


def kind_of(layer: str, kinds: dict[str, LayerKind]) -> str:
    if layer in ("pre", "head"):
        return layer
    return kinds.get(layer, "unknown")


# ---- the device-proven op-type table --------------------------------------


@dataclass
class OpTable:
    path: str
    sha256: str
    layer_kinds: dict[str, frozenset[str]]
    # Op types proven only with these output dtypes (e.g. cast: int32).
    output_dtypes: dict[str, frozenset[str]]

    def allowed(self, kind: str) -> frozenset[str]:
        if kind == "unknown":
            # A layer the plan does not describe: any decoder layer kind's op.
            return frozenset().union(*(self.layer_kinds[k] for k in DECODER_KINDS))
        return self.layer_kinds[kind]


def load_table(path: str = TABLE_PATH) -> OpTable:
    """The op-type table; any key beyond ``layer_kinds`` and
    ``output_dtypes`` is documentation."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        data = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ChunkforgeError(f"{path}: cannot read the op-type table ({e})") from e
    kinds = data.get("layer_kinds") if isinstance(data, dict) else None
    if not isinstance(kinds, dict):
        raise ChunkforgeError(f"{path}: no `layer_kinds` object")
    table: dict[str, frozenset[str]] = {}
    for k in LAYER_KINDS:
        v = kinds.get(k)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ChunkforgeError(f"{path}: layer_kinds.{k} must be a list of op type names")
        table[k] = frozenset(v)
    extra = sorted(set(kinds) - set(LAYER_KINDS))
    if extra:
        raise ChunkforgeError(f"{path}: layer_kinds has unknown kinds {extra} (known: {list(LAYER_KINDS)})")
    dtypes_raw = data.get("output_dtypes", {})
    if not isinstance(dtypes_raw, dict) or not all(
        isinstance(v, list) and all(isinstance(x, str) for x in v) for v in dtypes_raw.values()
    ):
        raise ChunkforgeError(f"{path}: output_dtypes must map op types to lists of dtype names")
    return OpTable(
        path,
        hashlib.sha256(raw).hexdigest(),
        table,
        {k: frozenset(v) for k, v in dtypes_raw.items()},
    )


# ---- the rules ------------------------------------------------------------


def head_vocab_allowed(f: Function) -> set[int]:
    """The ops under the ``head-vocab`` allowance (module docstring)."""
    allowed: set[int] = set()
    sizes: set[int] = set()
    for op in f.ops:
        if op.is_const and op.outputs and HEAD_WEIGHT_RE.match(op.outputs[0].name):
            allowed.add(op.index)
            sizes |= {d for d in op.outputs[0].shape or [] if d is not None and d > MAX_DIM}
            # Its constexpr inputs (LUT indices) are part of the same weight.
            allowed |= {f.producer[v] for v in op.inputs if v in f.producer}
    if not allowed:
        return allowed
    weights = set(allowed)
    for op in f.ops:
        if op.index in allowed or op.is_const:
            continue
        srcs = {f.producer[v] for v in op.inputs if v in f.producer}
        consumes_head = bool(srcs & weights)
        follows = bool(srcs & allowed)
        large = {d for t in op.outputs for d in t.shape or [] if d is not None and d > MAX_DIM}
        if consumes_head or (follows and large and large <= sizes):
            allowed.add(op.index)
    return allowed


def is_nchw_row(shape: Any) -> bool:
    """``[1, C, 1, T]``: the NCHW activation a 1x1 convolution reads and
    writes, the layout of every projection in the device-proven graphs (T = 1
    in decode). The ANE keeps C on its channel axis there, so a singleton
    last axis is the proven form, not the padding trap ``last-axis-1`` is
    about (``[1, L, 1]``, ``[1, 1, N, 1]``)."""
    return len(shape) == 4 and shape[0] == 1 and shape[2] == 1


# Reductions whose keep_dims result over the last axis is a softmax's row statistic.
ROW_STATISTIC_OPS = frozenset({"reduce_max", "reduce_sum"})


def is_row_statistic(f: Function, op: Op) -> bool:
    """A ``reduce_max``/``reduce_sum`` over the last axis that keeps it
    (``[.., R, N] -> [.., R, 1]``): the row maximum and sum of the decomposed
    softmax, as the device-proven graphs compute it (upstream's
    ``ane_softmax``: ``x.max(dim=-1, keepdim=True)``, ``sum(dim=-1,
    keepdim=True)``, [1, heads, N, 1] in its batched prefill). Read from the
    shapes: the result is the input with its last axis cut to 1."""
    if op.type not in ROW_STATISTIC_OPS or len(op.outputs) != 1 or len(op.args.get("x", [])) != 1:
        return False
    src = f.value(op.args["x"][0])
    out = op.outputs[0].shape
    return (
        src is not None
        and src.shape is not None
        and out is not None
        and len(src.shape) == len(out) >= 2
        and src.shape[:-1] == out[:-1]
        and out[-1] == 1
        and src.shape[-1] not in (None, 1)
    )


def check_tensor(
    t: Tensor, activation: bool, vocab_allowed: bool, row_statistic: bool = False
) -> list[tuple[AuditRule, str]]:
    """The rules a tensor breaks, with what was seen (``row_statistic``: a
    softmax's row statistic, ``is_row_statistic``)."""
    out: list[tuple[AuditRule, str]] = []
    shape = t.shape
    if shape is None or any(d is None for d in shape):
        out.append(("dynamic-shape", f"shape {t.shape_text()} is not static"))
    if shape is not None and len(shape) > MAX_RANK:
        out.append(("rank", f"rank {len(shape)} {t.shape_text()} (at most {MAX_RANK})"))
    if t.dtype in WIDE_FLOATS:
        out.append(("fp32", f"{t.dtype} {t.shape_text()}"))
    large = [d for d in shape or [] if d is not None and d > MAX_DIM]
    if large and not vocab_allowed:
        out.append(("large-dim", f"dimension {max(large)} in {t.shape_text()} (at most {MAX_DIM})"))
    n = t.elements()
    if (
        activation
        and shape
        and shape[-1] == 1
        and not is_nchw_row(shape)
        and not row_statistic
        and n is not None
        and n >= LAST_AXIS_1_MIN_ELEMENTS
    ):
        out.append(
            (
                "last-axis-1",
                f"{t.shape_text()} ({n} elements) has a last axis of 1 (padded to 64 bytes on the ANE)",
            )
        )
    return out


def audit_function(
    pkg: str, f: Function, kinds: dict[str, LayerKind], table: OpTable
) -> tuple[FunctionAudit, list[AuditFinding]]:
    layers = layers_of(f)
    vocab = head_vocab_allowed(f)
    findings: list[AuditFinding] = []

    def add(op: str, op_type: str, layer: str, rule: AuditRule, tensor: str, detail: str) -> None:
        findings.append(
            {
                "package": pkg,
                "function": f.name,
                "op": op,
                "op_type": op_type,
                "layer": layer,
                "layer_kind": kind_of(layer, kinds),
                "rule": rule,
                "severity": SEVERITY[rule],
                "tensor": tensor,
                "detail": detail,
            }
        )

    for t in f.inputs:
        for rule, detail in check_tensor(t, activation=True, vocab_allowed=False):
            add(t.name, "input", "pre", rule, t.name, f"function input: {detail}")
    counts: dict[str, int] = {}
    for op in f.ops:
        counts[op.type] = counts.get(op.type, 0) + 1
        layer = layers[op.index]
        kind = kind_of(layer, kinds)
        if op.type not in table.allowed(kind):
            where = "decoder layer" if kind == "unknown" else f"`{kind}`"
            add(
                op.name,
                op.type,
                layer,
                "op-type",
                op.outputs[0].name if op.outputs else op.name,
                f"`{op.type}` is not among the op types of the device-proven graphs' {where} ops",
            )
        elif op.type in table.output_dtypes:
            bad = [t for t in op.outputs if t.dtype not in table.output_dtypes[op.type]]
            if bad:
                proven = ", ".join(sorted(table.output_dtypes[op.type]))
                add(
                    op.name,
                    op.type,
                    layer,
                    "op-type",
                    bad[0].name,
                    f"`{op.type}` to {bad[0].dtype}: the device-proven graphs have it only to {proven}",
                )
        seen: set[str] = set()
        statistic = is_row_statistic(f, op)
        for t in op.outputs:
            for rule, detail in check_tensor(t, not op.is_const, op.index in vocab, statistic):
                if rule not in seen:  # one finding per op and rule
                    seen.add(rule)
                    add(op.name, op.type, layer, rule, t.name, detail)
    const_ops = sum(n for t, n in counts.items() if t in CONST_OPS)
    summary: FunctionAudit = {
        "name": f.name,
        "ops": len(f.ops) - const_ops,
        "const_ops": const_ops,
        "op_counts": dict(sorted(counts.items())),
        "findings": by_rule(findings),
    }
    return summary, findings


def by_rule(findings: list[AuditFinding]) -> dict[str, int]:
    """How many of ``findings`` each rule has."""
    out: dict[str, int] = {}
    for x in findings:
        out[x["rule"]] = out.get(x["rule"], 0) + 1
    return out


def read_functions(pkg: AuditPackage) -> list[Function]:
    spec, _, _ = read_package(pkg["path"], program=False)
    return functions_of(spec, pkg["path"])


def audit(args: AuditArgs) -> AuditReport:
    """The static audit of every package in ``args`` (and, on macOS when
    asked, the compute plan)."""
    table = load_table()
    packages: list[PackageAudit] = []
    findings: list[AuditFinding] = []
    for pkg in args["packages"]:
        functions = []
        mine: list[AuditFinding] = []
        for f in read_functions(pkg):
            summary, found = audit_function(pkg["name"], f, pkg["layer_kinds"], table)
            functions.append(summary)
            mine.extend(found)
        packages.append(
            {"package": pkg["name"], "path": pkg["path"], "functions": functions, "findings": by_rule(mine)}
        )
        findings.extend(mine)
    plan = compute_plan(args["packages"]) if args["compute_plan"] else {"skipped": "not asked for"}
    for p in plan.get("packages", []):
        if p.get("ship") is False:
            share = 100.0 * p["non_ane"] / max(p["ops"], 1)
            verdict: AuditFinding = {
                "package": p["package"],
                "function": "*",
                "op": "*",
                "op_type": "*",
                "layer": "*",
                "layer_kind": "*",
                "rule": "compute-plan",
                "severity": SEVERITY["compute-plan"],
                "tensor": "*",
                "detail": f"{p['non_ane']}/{p['ops']} ops ({share:.1f} %) NOT on the Neural Engine "
                f"(a merged package ships with at most {MAX_NON_ANE_FRACTION:.0%})",
            }
            findings.append(verdict)
            for pa in packages:
                if pa["package"] == p["package"]:
                    pa["findings"]["compute-plan"] = 1
    limits: AuditLimits = {
        "max_rank": MAX_RANK,
        "max_dim": MAX_DIM,
        "last_axis_1_min_elements": LAST_AXIS_1_MIN_ELEMENTS,
    }
    return {
        "format": FORMAT,
        "op_table": {"path": "python/chunkforge_py/mil/ane_op_types.json", "sha256": table.sha256},
        "limits": limits,
        "packages": packages,
        "findings": findings,
        "total": len(findings),
        "errors": sum(1 for x in findings if x["severity"] == "error"),
        "warnings": sum(1 for x in findings if x["severity"] == "warning"),
        "by_rule": by_rule(findings),
        "severity": {rule: s for rule, s in SEVERITY.items()},
        "compute_plan": plan,
    }


def op_types(args: AuditArgs) -> OpTypes:
    """The op types per layer kind in ``args``' packages, in the table's shape
    (``chunkforge audit --print-op-types``: regenerate and diff the table)."""
    found: dict[str, set[str]] = {k: set() for k in LAYER_KINDS}
    dtypes: dict[str, set[str]] = {}
    for pkg in args["packages"]:
        for f in read_functions(pkg):
            layers = layers_of(f)
            for op in f.ops:
                kind = kind_of(layers[op.index], pkg["layer_kinds"])
                found.setdefault(kind, set()).add(op.type)
                if op.type == "cast":
                    dtypes.setdefault(op.type, set()).update(t.dtype for t in op.outputs)
    return {
        "layer_kinds": {k: sorted(v) for k, v in found.items() if v or k in LAYER_KINDS},
        "output_dtypes": {k: sorted(v) for k, v in sorted(dtypes.items())},
    }


# ---- the compute plan (macOS only) ----------------------------------------


def compute_plan(packages: list[AuditPackage]) -> ComputePlanReport:
    """Each package's ops by preferred compute device, through coremltools'
    MLComputePlan on a compiled copy (macOS only: elsewhere it says so).
    Counted like the app's ComputePlanAudit: every non-const op of every function."""
    if sys.platform != "darwin":
        return {"skipped": f"MLComputePlan needs macOS; this is {sys.platform}"}
    import tempfile

    import coremltools as ct
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice
    from coremltools.models.compute_plan import MLComputePlan

    def ops_of(block: Any) -> Iterator[Any]:
        for op in block.operations:
            yield op
            for inner in op.blocks:
                yield from ops_of(inner)

    out: list[ComputePlanPackage] = []
    with tempfile.TemporaryDirectory(prefix="chunkforge-audit-") as tmp:
        for pkg in packages:
            compiled = ct.models.utils.compile_model(pkg["path"], os.path.join(tmp, pkg["name"] + ".mlmodelc"))
            plan = MLComputePlan.load_from_path(path=str(compiled), compute_units=ct.ComputeUnit.CPU_AND_NE)
            program = plan.model_structure.program
            if program is None:
                raise ChunkforgeError(f"{pkg['path']}: the compute plan has no ML program")
            ops = non_ane = 0
            by_kind: dict[str, int] = {}
            for fn in program.functions.values():
                for op in ops_of(fn.block):
                    if op.operator_name.split(".")[-1] in CONST_OPS:
                        continue
                    ops += 1
                    usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
                    device = usage.preferred_compute_device if usage is not None else None
                    if not isinstance(device, MLNeuralEngineComputeDevice):
                        non_ane += 1
                        key = f"{op.operator_name} -> {type(device).__name__ if device else 'unknown'}"
                        by_kind[key] = by_kind.get(key, 0) + 1
            entry: ComputePlanPackage = {
                "package": pkg["name"],
                "ops": ops,
                "non_ane": non_ane,
                "non_ane_by_kind": by_kind,
            }
            if pkg["merged"]:
                entry["ship"] = non_ane <= MAX_NON_ANE_FRACTION * ops
            out.append(entry)
    return {
        "packages": out,
        "ops": sum(p["ops"] for p in out),
        "non_ane": sum(p["non_ane"] for p in out),
    }
