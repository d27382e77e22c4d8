"""Compose a multi-layer package from converted single-chunk programs.

A merged chunk (``merged_full`` = layers 0-34, ``merged_chunk1`` = 0-14, the
three-chunk layout's chunks, ...) computes exactly what the four-chunk
layout's functions compute back to back. Instead of tracing and converting it
from torch again (about 95 MIL graph passes over the whole program), `compose`
splices the already converted and palettized programs of the chunks it is made
of into one MIL function at the protobuf level and writes it there too
(`write`, `mil_write`): dead ops removed, the package's description and
metadata added, the weights copied from the sources' files. That is byte for
byte what coremltools' own loader and serialiser write
(`write_with_coremltools`, the reference; python/tests/test_compose.py).

Python API::

    from chunkforge_py.convert.compose import compose

    result = compose(
        [("out/chunk1.mlpackage", chunk1_plan), ("out/chunk2.mlpackage", chunk2_plan)],
        merged_chunk1_plan,
        "out/merged_chunk1.mlpackage",
    )

Each source is ``(package path, its ChunkPlan)`` or ``(package path, its
ChunkPlan, function name)``; without a name the package's default function is
used together with the plan's default function (``functions[0]``), so the
four-chunk packages give their ``decode_q1``. The target's function is its
``functions[0]`` (``main``). Everything is plain JSON-like data.

How the wiring is derived (`plan_wiring`, from the plans alone): tensors are
matched by what they carry (their role, alias and layer: ``roles.Key``), never
by name.

- Tiling: the sources' layers, in order, must be the target's layers, each
  with the same attention kind, MLP width and KV source kind (own / shared,
  alias, producer); the slots may differ. The sources' functions must be of
  the target function's kind and token count.
- KV caches (``k_sliding``, ``v_full``, ... and verify's new rows): axis 0
  holds one slot per layer owning a cache of that kind (``LayerPlan.kv.slot``).
  Each target slot is matched to the (source, slot) of the same layer. A
  source's cache input is the target input itself when it covers every slot;
  else the source's own constant-bound ``slice_by_index`` ops on it are
  rewritten to slice the target input at the slot offset (`folded_slice`),
  and any other reader gets a ``slice_by_index`` (or a concat of slices) of
  the target input; a
  target cache output is one source's output, or the concatenation along axis
  0 of the sources' outputs (``stack`` ops that built the slots are merged into
  one ``stack``, as the direct conversion has it).
- Every other source input is fed by the latest earlier source that outputs
  it (``hidden`` <- ``hidden_out`` of the source just before, which must
  exist; ``per_layer_combined`` <- ``per_layer_combined_out``; shared KV
  ``shared_k``/``shared_v`` of an alias <- the emitting source's output), and
  else by the target input of the same key (same shape and dtype).
- Every target output is the output of the same key of the latest source
  that has one (the last source's ``hidden_out``, the emitter's shared KV).
  Source outputs that are neither another source's input nor a target output
  are dropped (their ops are removed when dead).
- Every target input must feed some source input and every target output must
  be found; otherwise the composition is refused with a `ChunkforgeError`.

Names: the target's input and output names are reserved; any other variable
or op name of a source that is taken (by the target or an earlier source) gets
the source's suffix ``_s{k}`` (weights keep their names: they hold the layer
index). The written program's names are then made canonical (`mil_names`),
so they follow from its ops alone, not from its sources' names.

Weights: each source's ``blobFileValue`` references are pointed at its own
file (``@model_path/weights/source{k}.bin``, standing for its
``weight.bin``); `mil_write.write_package` copies each blob the composed
program reads into one fresh ``weight.bin``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..contract import (
    Attention,
    ChunkPlan,
    ChunkStats,
    ComposedChunk,
    ComposeJob,
    ConversionSettings,
    FunctionPlan,
    PackageWriter,
    TensorSpec,
)
from ..mil import names as mil_names
from ..mil import write as mil_write
from ..mil.inspect import PROJECTION_OPS
from ..mil.names import defined_names, rename_definitions, rename_names
from ..roles import CACHE, NEW_ROWS, Key, key_of
from ..runtime import ChunkforgeError, package_writer, release_memory, temporaries_beside

COMPOSED_FROM = "com.github.chunkforge.composed_from"
# coremltools' metadata keys (version, source, conversion date).
COREMLTOOLS_KEYS = "com.github.apple.coremltools."

# Roles whose tensor has one slot per cache-owning layer on axis 0, by attention kind.
SLOT_ROLES: dict[str, Attention] = {
    role: kind for table in (CACHE, NEW_ROWS) for kind, pair in table.items() for role in pair
}
# A source input fed by an earlier source's output of another role.
FORWARDED: dict[str, str] = {"hidden": "hidden_out", "per_layer_combined": "per_layer_combined_out"}
WEIGHTS_PREFIX = "@model_path/weights/"

# A source: (package path, its chunk plan) or (package path, chunk plan, function name).
Source = tuple[str, ChunkPlan] | tuple[str, ChunkPlan, str]


class ComposeResult(TypedDict):
    """What `compose` returns: the saved package's stats (`convert.save`),
    seconds per phase, the ``composed_from`` metadata and the wiring (target
    tensor name -> where it comes from / what it feeds, for reports)."""

    stats: ChunkStats
    seconds: dict[str, float]
    composed_from: str
    wiring: dict[str, list[str]]


# ---- the wiring, from the plans ----------------------------------------------


@dataclass(frozen=True)
class Run:
    """Slots ``start:end`` (axis 0) of a tensor: of the target's (inputs) or of
    source ``source``'s output ``name`` (target outputs)."""

    source: int
    name: str
    start: int
    end: int


@dataclass
class Feed:
    """Where one source input comes from: a target input (``runs`` of its
    slots: one run covering all of them is the input itself), or the output
    ``name`` of an earlier source ``source``."""

    kind: str  # "target" | "slots" | "source"
    name: str
    source: int = -1
    runs: list[Run] = field(default_factory=list)


@dataclass
class Wiring:
    """The complete connection of the sources to the target function."""

    # Per source: source input name -> its feed.
    feeds: list[dict[str, Feed]]
    # Target output name -> the runs it is made of, in slot order (one run:
    # a source output as it is; for a non-slot tensor start = end = 0).
    outputs: dict[str, list[Run]]
    # Per source: its outputs that go nowhere.
    dropped: list[list[str]]

    def describe(self, target: FunctionPlan) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for spec in target["inputs"]:
            fed = []
            for k, feeds in enumerate(self.feeds):
                for sname, f in feeds.items():
                    if f.kind == "target" and f.name == spec["name"]:
                        fed.append(f"s{k}.{sname}")
                    elif f.kind == "slots" and f.name == spec["name"]:
                        slots = "+".join(f"{r.start}:{r.end}" for r in f.runs)
                        fed.append(f"s{k}.{sname}[{slots}]")
            out[spec["name"]] = fed
        for name, runs in self.outputs.items():
            out[name] = [f"s{r.source}.{r.name}" + (f"[{r.start}:{r.end}]" if r.end else "") for r in runs]
        return out


def layer_slots(chunk: ChunkPlan, kind: Attention) -> list[int]:
    """The layer held in each cache slot of ``kind`` (slot order)."""
    owned = {
        lay["kv"]["slot"]: lay["index"]
        for lay in chunk["layers"]
        if lay["kv"]["kind"] == "own" and lay["attention"] == kind
    }
    if sorted(owned) != list(range(len(owned))):
        raise ChunkforgeError(f"{chunk['name']}: {kind} cache slots {sorted(owned)} are not 0..{len(owned) - 1}")
    return [owned[s] for s in range(len(owned))]


def function_of(chunk: ChunkPlan, name: str | None) -> FunctionPlan:
    if name is None:
        return chunk["functions"][0]
    for f in chunk["functions"]:
        if f["name"] == name:
            return f
    raise ChunkforgeError(f"{chunk['name']}: no function {name} in its plan")


def describe_spec(spec: TensorSpec) -> str:
    return f"{spec['name']} {spec['shape']} {spec['dtype']}"


def check_tiling(chunks: Sequence[ChunkPlan], functions: Sequence[FunctionPlan], target: ChunkPlan) -> None:
    """The sources' layers, in order, are the target's (same structure), and
    their functions are the target function's kind."""
    names = ", ".join(c["name"] for c in chunks)
    if not chunks:
        raise ChunkforgeError(f"cannot compose {target['name']}: no sources")
    got = [lay["index"] for c in chunks for lay in c["layers"]]
    want = [lay["index"] for lay in target["layers"]]
    if got != want:
        ranges = ", ".join(f"{c['name']} {c['first_layer']}-{c['last_layer']}" for c in chunks)
        raise ChunkforgeError(
            f"sources do not tile {target['name']} (layers {target['first_layer']}-{target['last_layer']}): "
            f"they hold {ranges}, layers {got} instead of {want}"
        )
    source_layers = {lay["index"]: (c["name"], lay) for c in chunks for lay in c["layers"]}
    for lay in target["layers"]:
        cname, src = source_layers[lay["index"]]

        def shape(layer: Any) -> tuple[Any, ...]:
            kv = layer["kv"]
            return (layer["attention"], layer["mlp_width"], kv["kind"], kv.get("alias"), kv.get("producer"))

        if shape(src) != shape(lay):
            raise ChunkforgeError(
                f"cannot compose {target['name']} from {names}: layer {lay['index']} of {cname} is "
                f"{shape(src)}, the target's is {shape(lay)} (attention, MLP width, KV source)"
            )
    tf = target["functions"][0]
    for c, f in zip(chunks, functions, strict=True):
        if (f["kind"], f["tokens"]) != (tf["kind"], tf["tokens"]):
            raise ChunkforgeError(
                f"cannot compose {target['name']}/{tf['name']} ({tf['kind']}, {tf['tokens']} tokens) from "
                f"{c['name']}/{f['name']} ({f['kind']}, {f['tokens']} tokens)"
            )
    if target["computes_per_layer_input"] != chunks[0]["computes_per_layer_input"] or any(
        c["computes_per_layer_input"] for c in chunks[1:]
    ):
        raise ChunkforgeError(
            f"cannot compose {target['name']} from {names}: only the first chunk may (and must, when the "
            "target does) project the per-layer inputs"
        )
    if target["has_head"] != chunks[-1]["has_head"] or any(c["has_head"] for c in chunks[:-1]):
        raise ChunkforgeError(
            f"cannot compose {target['name']} from {names}: only the last chunk may (and must, when the "
            "target does) apply the head"
        )


def slot_runs(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(a, b)`` pairs with consecutive ``a`` grouped into runs ``(a0, b0, n)``
    where ``b`` is consecutive too."""
    runs: list[tuple[int, int, int]] = []
    for a, b in pairs:
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


def plan_wiring(chunks: Sequence[ChunkPlan], functions: Sequence[FunctionPlan], target: ChunkPlan) -> Wiring:
    """How the sources' functions connect to the target's function (see the
    module docstring); a `ChunkforgeError` when they do not tile it or a
    tensor cannot be wired."""
    check_tiling(chunks, functions, target)
    tf = target["functions"][0]
    what = f"cannot compose {target['name']}/{tf['name']} from {', '.join(c['name'] for c in chunks)}"
    t_inputs = {key_of(s): s for s in tf["inputs"]}
    # (kind, layer) -> target slot; (kind, layer) -> (source, slot).
    t_slot = {(kind, layer): i for kind in CACHE for i, layer in enumerate(layer_slots(target, kind))}
    s_slot = {
        (kind, layer): (k, i)
        for k, c in enumerate(chunks)
        for kind in CACHE
        for i, layer in enumerate(layer_slots(c, kind))
    }

    def same(a: TensorSpec, b: TensorSpec, slots: bool = False) -> bool:
        return a["dtype"] == b["dtype"] and (a["shape"][1:] == b["shape"][1:] if slots else a["shape"] == b["shape"])

    def check_slots(spec: TensorSpec, n: int, who: str) -> None:
        if spec["shape"][0] != n:
            raise ChunkforgeError(f"{what}: {who} {describe_spec(spec)} has {spec['shape'][0]} slots, its plan {n}")

    feeds: list[dict[str, Feed]] = []
    used: set[tuple[int, str]] = set()
    fed_targets: set[str] = set()
    for k, (c, f) in enumerate(zip(chunks, functions, strict=True)):
        mine: dict[str, Feed] = {}
        for spec in f["inputs"]:
            key = key_of(spec)
            who = f"{c['name']} input {describe_spec(spec)}"
            kind = SLOT_ROLES.get(spec["role"])
            if kind is not None:
                t_spec = t_inputs.get(key)
                if t_spec is None or not same(spec, t_spec, slots=True):
                    found = describe_spec(t_spec) if t_spec else "none"
                    raise ChunkforgeError(f"{what}: {who}: the target has no matching input (found {found})")
                layers = layer_slots(c, kind)
                check_slots(spec, len(layers), who)
                check_slots(t_spec, len(layer_slots(target, kind)), f"target input {t_spec['name']}")
                pairs = [(i, t_slot[(kind, layer)]) for i, layer in enumerate(layers)]
                taken = [Run(-1, t_spec["name"], b, b + n) for _, b, n in slot_runs(pairs)]
                whole = len(taken) == 1 and taken[0].start == 0 and taken[0].end == t_spec["shape"][0]
                mine[spec["name"]] = Feed("target" if whole else "slots", t_spec["name"], runs=taken)
                fed_targets.add(t_spec["name"])
                continue
            # The latest earlier source with the output this input forwards.
            out_key = Key(FORWARDED.get(key.role, key.role), key.alias, key.layer)  # type: ignore[arg-type]
            producer = None
            for j in range(k - 1, -1, -1):
                match = [o for o in functions[j]["outputs"] if key_of(o) == out_key]
                if match:
                    producer = (j, match[0])
                    break
            if key.role == "hidden" and k > 0 and (producer is None or producer[0] != k - 1):
                raise ChunkforgeError(f"{what}: {who}: {chunks[k - 1]['name']} hands on no hidden state")
            if producer is not None:
                j, o = producer
                if not same(spec, o):
                    raise ChunkforgeError(f"{what}: {who} is fed by {chunks[j]['name']} output {describe_spec(o)}")
                mine[spec["name"]] = Feed("source", o["name"], source=j)
                used.add((j, o["name"]))
                continue
            t_spec = t_inputs.get(key)
            if t_spec is None:
                raise ChunkforgeError(f"{what}: {who} is neither a target input nor an earlier chunk's output")
            if not same(spec, t_spec):
                raise ChunkforgeError(f"{what}: {who} does not match target input {describe_spec(t_spec)}")
            mine[spec["name"]] = Feed("target", t_spec["name"])
            fed_targets.add(t_spec["name"])
        feeds.append(mine)
    unfed = [s["name"] for s in tf["inputs"] if s["name"] not in fed_targets]
    if unfed:
        raise ChunkforgeError(f"{what}: target input(s) {', '.join(unfed)} feed no source input")

    outputs: dict[str, list[Run]] = {}
    for spec in tf["outputs"]:
        key = key_of(spec)
        who = f"target output {describe_spec(spec)}"
        kind = SLOT_ROLES.get(spec["role"])
        if kind is not None:
            layers = layer_slots(target, kind)
            check_slots(spec, len(layers), who)
            pieces: list[tuple[int, str, int]] = []
            for layer in layers:
                k, i = s_slot[(kind, layer)]
                match = [o for o in functions[k]["outputs"] if key_of(o) == key]
                if not match or not same(spec, match[0], slots=True):
                    raise ChunkforgeError(f"{what}: {who}: {chunks[k]['name']} has no such output for layer {layer}")
                check_slots(match[0], len(layer_slots(chunks[k], kind)), f"{chunks[k]['name']} output")
                pieces.append((k, match[0]["name"], i))
            runs: list[Run] = []
            for k, name, i in pieces:
                last = runs[-1] if runs else None
                if last is not None and last.source == k and last.name == name and last.end == i:
                    runs[-1] = Run(k, name, last.start, i + 1)
                else:
                    runs.append(Run(k, name, i, i + 1))
            outputs[spec["name"]] = runs
            used.update((r.source, r.name) for r in runs)
            continue
        maker: tuple[int, TensorSpec] | None = None
        for k in range(len(chunks) - 1, -1, -1):
            match = [o for o in functions[k]["outputs"] if key_of(o) == key]
            if match:
                maker = (k, match[0])
                break
        if maker is None:
            raise ChunkforgeError(f"{what}: {who} is no source's output")
        k, o = maker
        if not same(spec, o):
            raise ChunkforgeError(f"{what}: {who} does not match {chunks[k]['name']} output {describe_spec(o)}")
        outputs[spec["name"]] = [Run(k, o["name"], 0, 0)]
        used.add((k, o["name"]))
    dropped = [[o["name"] for o in f["outputs"] if (k, o["name"]) not in used] for k, f in enumerate(functions)]
    return Wiring(feeds, outputs, dropped)


# ---- the program, at the protobuf level --------------------------------------

DTYPES = {"fp16": "FLOAT16", "fp32": "FLOAT32", "int32": "INT32"}


def tensor_value_type(mil: Any, dtype: str, shape: Sequence[int]) -> Any:
    vt = mil.ValueType()
    tt = vt.tensorType
    tt.dataType = mil.DataType.Value(dtype)
    tt.rank = len(shape)
    for d in shape:
        tt.dimensions.add().constant.size = int(d)
    return vt


def string_value(mil: Any, s: str) -> Any:
    v = mil.Value()
    v.type.tensorType.dataType = mil.DataType.Value("STRING")
    v.immediateValue.tensor.strings.values.append(s)
    return v


def const_op(mil: Any, name: str, values: Sequence[int] | Sequence[bool] | int | bool) -> Any:
    """A ``const`` op of an int32 or bool vector, an int32 scalar or a bool scalar."""
    op = mil.Operation(type="const")
    if not isinstance(values, int) and values and all(isinstance(v, bool) for v in values):
        vt = tensor_value_type(mil, "BOOL", [len(values)])
        op.attributes["val"].type.CopyFrom(vt)
        op.attributes["val"].immediateValue.tensor.bools.values.extend(bool(v) for v in values)
    elif isinstance(values, bool):
        vt = tensor_value_type(mil, "BOOL", [])
        op.attributes["val"].type.CopyFrom(vt)
        op.attributes["val"].immediateValue.tensor.bools.values.append(values)
    elif isinstance(values, int):
        vt = tensor_value_type(mil, "INT32", [])
        op.attributes["val"].type.CopyFrom(vt)
        op.attributes["val"].immediateValue.tensor.ints.values.append(values)
    else:
        vt = tensor_value_type(mil, "INT32", [len(values)])
        op.attributes["val"].type.CopyFrom(vt)
        op.attributes["val"].immediateValue.tensor.ints.values.extend(int(v) for v in values)
    out = op.outputs.add()
    out.name = name
    out.type.CopyFrom(vt)
    op.attributes["name"].CopyFrom(string_value(mil, name))
    return op


def op_name(op: Any) -> str | None:
    attr = op.attributes.get("name")
    if attr is None or not attr.immediateValue.tensor.strings.values:
        return None
    return str(attr.immediateValue.tensor.strings.values[0])


def with_slots(vt: Any, n: int) -> Any:
    """A copy of a tensor value type with axis 0 of size ``n``."""
    out = type(vt)()
    out.CopyFrom(vt)
    out.tensorType.dimensions[0].constant.size = n
    return out


class Names:
    """Unique variable and op names across the composed function."""

    def __init__(self, reserved: Iterable[str]):
        self.vars: set[str] = set(reserved)
        self.ops: set[str] = set(reserved)

    @staticmethod
    def _fresh(taken: set[str], name: str, suffix: str) -> str:
        out, n = name, 1
        while out in taken:
            out = f"{name}{suffix}" if n == 1 else f"{name}{suffix}_{n}"
            n += 1
        taken.add(out)
        return out

    def var(self, name: str, suffix: str) -> str:
        return self._fresh(self.vars, name, suffix)

    def op(self, name: str, suffix: str) -> str:
        return self._fresh(self.ops, name, suffix)


@dataclass
class SourceProgram:
    """One source function's protobuf pieces."""

    path: str
    spec: Any
    function: Any
    block: Any
    label: str


def read_source(path: str, function: str | None) -> SourceProgram:
    spec = mil_write.read_spec(path)
    names = list(spec.mlProgram.functions)
    name = function or spec.description.defaultFunctionName or ("main" if "main" in names else names[0])
    if name not in spec.mlProgram.functions:
        raise ChunkforgeError(f"{path}: no function {name} (it has {', '.join(sorted(names))})")
    fn = spec.mlProgram.functions[name]
    if fn.opset not in fn.block_specializations:
        raise ChunkforgeError(f"{path}: function {name} has no block for its opset {fn.opset}")
    label = os.path.basename(os.path.normpath(path)).removesuffix(".mlpackage")
    return SourceProgram(path, spec, fn, fn.block_specializations[fn.opset], label)


def check_declared(src: SourceProgram, f: FunctionPlan, mil: Any) -> None:
    """The source function's inputs and outputs are the ones its plan names."""
    declared = {i.name: i.type for i in src.function.inputs}
    want = [s["name"] for s in f["inputs"]]
    if sorted(declared) != sorted(want):
        raise ChunkforgeError(f"{src.path}: inputs {sorted(declared)} are not its plan's {sorted(want)}")
    for s in f["inputs"]:
        if declared[s["name"]] != tensor_value_type(mil, DTYPES[s["dtype"]], s["shape"]):
            raise ChunkforgeError(f"{src.path}: input {s['name']} is not {s['shape']} {s['dtype']} as its plan says")
    outs = [s["name"] for s in f["outputs"]]
    if list(src.block.outputs) != outs:
        raise ChunkforgeError(f"{src.path}: outputs {list(src.block.outputs)} are not its plan's {outs}")


def values_of(op: Any) -> Iterator[Any]:
    """Every value proto ``op`` holds: inline input values and attributes, its
    nested blocks' ops' too."""
    for arg in op.inputs.values():
        for b in arg.arguments:
            if b.WhichOneof("binding") == "value":
                yield b.value
    yield from op.attributes.values()
    for block in op.blocks:
        for inner in block.operations:
            yield from values_of(inner)


def rename_bindings(op: Any, rename: dict[str, str], blob: dict[str, str]) -> None:
    """Point ``op``'s (and its nested blocks') variable references and blob files at their new names."""
    for v in values_of(op):
        if v.WhichOneof("value") == "blobFileValue":
            base = v.blobFileValue.fileName.removeprefix(WEIGHTS_PREFIX)
            if base not in blob:
                raise ChunkforgeError(f"weight file {v.blobFileValue.fileName!r} is not in the package's weights/")
            v.blobFileValue.fileName = WEIGHTS_PREFIX + blob[base]
    rename_names(op, rename)


def consumers(block: Any) -> dict[str, int]:
    """How many times each variable is read in ``block`` (outputs count once)."""
    counts: dict[str, int] = {}

    def walk(ops: Iterable[Any]) -> None:
        for op in ops:
            for arg in op.inputs.values():
                for b in arg.arguments:
                    if b.WhichOneof("binding") == "name":
                        counts[b.name] = counts.get(b.name, 0) + 1
            for inner in op.blocks:
                walk(inner.operations)
                for n in inner.outputs:
                    counts[n] = counts.get(n, 0) + 1

    walk(block.operations)
    for n in block.outputs:
        counts[n] = counts.get(n, 0) + 1
    return counts


def const_int(ops_by_output: dict[str, Any], arg: Any) -> int | None:
    """The int value of a single-binding argument bound to a scalar int const op."""
    if len(arg.arguments) != 1 or arg.arguments[0].WhichOneof("binding") != "name":
        return None
    op = ops_by_output.get(arg.arguments[0].name)
    if op is None or op.type != "const":
        return None
    ints = op.attributes["val"].immediateValue.tensor.ints.values
    return int(ints[0]) if len(ints) == 1 else None


def const_vector(ops_by_output: dict[str, Any], arg: Any) -> list[int] | list[bool] | None:
    """The values of a single-binding argument bound to an int or bool vector const op."""
    if len(arg.arguments) != 1 or arg.arguments[0].WhichOneof("binding") != "name":
        return None
    op = ops_by_output.get(arg.arguments[0].name)
    if op is None or op.type != "const" or op.attributes["val"].type.tensorType.rank != 1:
        return None
    tensor = op.attributes["val"].immediateValue.tensor
    if tensor.WhichOneof("value") == "ints":
        return [int(v) for v in tensor.ints.values]
    if tensor.WhichOneof("value") == "bools":
        return [bool(v) for v in tensor.bools.values]
    return None


def folded_slice(op: Any, ops_by_output: dict[str, Any], x: str, offset: int, n: int) -> dict[str, Any] | None:
    """``op`` reading source input ``x`` (slots ``offset:offset+n`` of a target
    input) rewritten to read the target input itself: a ``slice_by_index`` of
    constant bounds whose axis-0 range lies in ``0:n`` takes ``offset`` on its
    axis-0 begin and end. The new values of its vector inputs by input name, or
    None when it cannot be folded (then it reads a slice of the target input)."""
    if op.type != "slice_by_index" or [b.name for b in op.inputs["x"].arguments] != [x]:
        return None
    args = {name: const_vector(ops_by_output, arg) for name, arg in op.inputs.items() if name != "x"}
    if any(v is None or not v for v in args.values()) or "begin" not in args or "end" not in args:
        return None
    begin, end = list(args["begin"] or []), list(args["end"] or [])
    begin_mask = list(args.get("begin_mask") or [False] * len(begin))
    end_mask = list(args.get("end_mask") or [False] * len(end))
    if "stride" in args and (args["stride"] or [1])[0] != 1:
        return None
    b0 = 0 if begin_mask[0] else int(begin[0])
    e0 = n if end_mask[0] else int(end[0])
    b0, e0 = b0 + n if b0 < 0 else b0, e0 + n if e0 < 0 else e0
    squeeze = bool((args.get("squeeze_mask") or [False])[0])
    if not 0 <= b0 <= e0 <= n or (squeeze and b0 >= n):
        return None
    begin[0], end[0] = b0 + offset, (b0 + 1 if squeeze else e0) + offset
    out: dict[str, Any] = {"begin": begin, "end": end}
    if "begin_mask" in args:
        out["begin_mask"] = [False] + begin_mask[1:]
    if "end_mask" in args:
        out["end_mask"] = [False] + end_mask[1:]
    return out


def build_program(
    sources: Sequence[SourceProgram], functions: Sequence[FunctionPlan], target: FunctionPlan, wiring: Wiring
) -> Any:
    """The composed Model proto (one function ``main``), its weights referenced
    as ``source{k}.bin`` (links `compose` makes to each source's weight.bin)."""
    from coremltools.proto import MIL_pb2 as mil
    from coremltools.proto import Model_pb2

    opsets = {s.function.opset for s in sources}
    if len(opsets) != 1:
        raise ChunkforgeError(f"the sources' functions have different opsets {sorted(opsets)}")
    opset = opsets.pop()
    for s, f in zip(sources, functions, strict=True):
        check_declared(s, f, mil)

    reserved = [t["name"] for t in target["inputs"]] + [t["name"] for t in target["outputs"]]
    names = Names(reserved)
    main = mil.Function(opset=opset)
    for t in target["inputs"]:
        main.inputs.add(name=t["name"], type=tensor_value_type(mil, DTYPES[t["dtype"]], t["shape"]))
    block = main.block_specializations[opset]
    t_specs = {t["name"]: t for t in target["inputs"] + target["outputs"]}

    # Target outputs that are one source output as it is take their name from
    # the target; those several sources make are built after the sources.
    direct: dict[tuple[int, str], str] = {}
    for name, runs in wiring.outputs.items():
        r = runs[0]
        if len(runs) == 1 and (r.end == 0 or (r.start == 0 and r.end == slots_of(functions[r.source], r.name))):
            direct.setdefault((r.source, r.name), name)
    stacks = mergeable_stacks(sources, functions, wiring)
    skip = {id(op) for _, op in stacks.values()}
    stack_values: dict[tuple[int, str], list[str]] = {}
    finals: list[dict[str, str]] = []

    # Where each source's ops begin in the block (then where the ops added
    # after the sources begin), for `outputs_last`.
    starts: list[int] = []
    for k, src in enumerate(sources):
        starts.append(len(block.operations))
        suffix = f"_s{k}"
        rename: dict[str, str] = {}
        ops_by_output = {o.name: op for op in src.block.operations for o in op.outputs}
        counts = consumers(src.block)
        # Per op reading a cache input: the target input it reads instead and
        # its new bounds (see `folded_slice`).
        folds: dict[int, tuple[str, dict[str, Any]]] = {}
        # Inputs: the target's input, an earlier source's output, or slices.
        for sname, feed in wiring.feeds[k].items():
            if feed.kind == "target":
                rename[sname] = feed.name
            elif feed.kind == "source":
                rename[sname] = finals[feed.source][feed.name]
            else:
                mine: dict[int, tuple[str, dict[str, Any]]] = {}
                if len(feed.runs) == 1:
                    r = feed.runs[0]
                    for op in src.block.operations:
                        bounds = folded_slice(op, ops_by_output, sname, r.start, r.end - r.start)
                        if bounds is not None:
                            mine[id(op)] = (feed.name, bounds)
                folds.update(mine)
                if len(mine) == counts.get(sname, 0):
                    rename[sname] = feed.name
                else:
                    base = f"{sname}{suffix}"
                    rename[sname] = slice_slots(mil, block, names, feed, t_specs[feed.name], base, suffix)
        for op in src.block.operations:
            for n in defined_names(op):
                if n in rename:
                    raise ChunkforgeError(f"{src.path}: {n} is defined twice")
                target_name = direct.get((k, n))
                if target_name is not None:
                    rename[n] = target_name
                else:
                    rename[n] = names.var(n, suffix)
        for oname in src.block.outputs:
            if oname not in rename:
                raise ChunkforgeError(f"{src.path}: output {oname} is not produced by any op")
        blob = {"weight.bin": f"source{k}.bin"}
        for op in src.block.operations:
            blob.update(blob_files(op, k))
        for op in src.block.operations:
            if id(op) in skip:
                continue
            consts: dict[str, str] = {}
            if id(op) in folds:
                for arg, values in folds[id(op)][1].items():
                    consts[arg] = names.var(f"{rename[op.outputs[0].name]}_{arg}", "_composed")
                    block.operations.append(const_op(mil, consts[arg], values))
            new = block.operations.add()
            new.CopyFrom(op)
            original = op_name(op)
            rename_definitions(new, rename)
            rename_bindings(new, rename, blob)
            if id(op) in folds:
                new.inputs["x"].arguments[0].name = folds[id(op)][0]
                for arg, const in consts.items():
                    new.inputs[arg].arguments[0].name = const
            if original is not None:
                # An op named after its output follows the output's new name.
                first = op.outputs[0].name if op.outputs else None
                wanted = rename[first] if first is not None and original == first else original
                new.attributes["name"].CopyFrom(string_value(mil, names.op(wanted, suffix)))
        finals.append({o: rename[o] for o in src.block.outputs})
        for (j, oname), (values, _) in stacks.items():
            if j == k:
                stack_values[(j, oname)] = [rename.get(v, v) for v in values]

    for name, runs in wiring.outputs.items():
        if len(runs) == 1 and finals[runs[0].source][runs[0].name] == name:
            continue
        r0 = runs[0]
        out_type = output_type(sources[r0.source], r0.name)
        if r0.end == 0:
            # The same source output is two target outputs: an identity.
            identity(mil, block, names, finals[r0.source][r0.name], name, out_type)
            continue
        vt = with_slots(out_type, t_specs[name]["shape"][0])
        if all((r.source, r.name) in stacks for r in runs):
            # The slots' values in one stack, as a direct conversion writes it.
            values = [v for r in runs for v in stack_values[(r.source, r.name)]]
            stack(mil, block, names, values, name, vt, op_name(stacks[(r0.source, r0.name)][1]) or name)
            continue
        parts = []
        for r in runs:
            var = finals[r.source][r.name]
            if r.start == 0 and r.end == slots_of(functions[r.source], r.name):
                parts.append(var)
            else:
                vt_r = output_type(sources[r.source], r.name)
                parts.append(slice_var(mil, block, names, var, r.start, r.end, vt_r, f"{name}_{r.start}"))
        concat(mil, block, names, parts, name, vt)

    del block.outputs[:]
    block.outputs.extend(t["name"] for t in target["outputs"])
    starts.append(len(block.operations))
    outputs_last(block, starts)
    model = Model_pb2.Model()
    model.specificationVersion = max(s.spec.specificationVersion for s in sources)
    model.mlProgram.version = 1
    model.mlProgram.functions["main"].CopyFrom(main)
    return model


def outputs_last(block: Any, starts: Sequence[int]) -> None:
    """Moves the ops that make a block output and feed no other op (a
    source's cache stacks, its last hidden state) after all others: where a
    direct conversion has them, after the last layer. ``starts``: the index
    of each source's first op (ops from the last start on were added after
    the sources). The last source's go first, then each earlier source's,
    then those added after the sources, each in its order: every layer's op
    then comes before the outputs of earlier layers' sources, as in a direct
    conversion, whose audit (audit.py) places such ops in ``head`` by their
    position. The values are the same; every moved op still follows its
    inputs, and nothing reads it."""
    ops = list(block.operations)
    if any(op.blocks for op in ops):
        # Control flow reads names inside its blocks: left as it is.
        return
    read = {
        a.name for op in ops for arg in op.inputs.values() for a in arg.arguments if a.WhichOneof("binding") == "name"
    }
    outputs = set(block.outputs)

    def origin(i: int) -> int:
        return max(k for k, start in enumerate(starts) if start <= i) if starts and i >= starts[0] else 0

    keep: list[tuple[int, Any]] = []
    moved: list[tuple[int, Any]] = []
    for i, op in enumerate(ops):
        sink = any(o.name in outputs for o in op.outputs) and not any(o.name in read for o in op.outputs)
        (moved if sink else keep).append((i, op))
    added = len(starts) - 1
    moved.sort(key=lambda e: (origin(e[0]) == added, -origin(e[0]), e[0]))
    copies = [type(op)() for _, op in keep + moved]
    for c, (_, op) in zip(copies, keep + moved, strict=True):
        c.CopyFrom(op)
    del block.operations[:]
    block.operations.extend(copies)


def slots_of(function: FunctionPlan, output: str) -> int:
    return int(next(o for o in function["outputs"] if o["name"] == output)["shape"][0])


def output_type(src: SourceProgram, name: str) -> Any:
    """The value type of the op output ``name`` of a source."""
    for op in src.block.operations:
        for o in op.outputs:
            if o.name == name:
                return o.type
    raise ChunkforgeError(f"{src.path}: output {name} is not produced by any op (a function input?)")


def mergeable_stacks(
    sources: Sequence[SourceProgram], functions: Sequence[FunctionPlan], wiring: Wiring
) -> dict[tuple[int, str], tuple[list[str], Any]]:
    """The source outputs of the target outputs that several sources make and
    that can be merged into one ``stack``: each whole, made by a ``stack`` on
    axis 0 (or an ``expand_dims`` on axis 0) and read by nothing else.
    (source, output) -> (the stack's values, the op)."""
    uses: dict[tuple[int, str], int] = {}
    for runs in wiring.outputs.values():
        for r in runs:
            uses[(r.source, r.name)] = uses.get((r.source, r.name), 0) + 1
    for feeds in wiring.feeds:
        for f in feeds.values():
            if f.kind == "source":
                uses[(f.source, f.name)] = uses.get((f.source, f.name), 0) + 1
    out: dict[tuple[int, str], tuple[list[str], Any]] = {}
    for runs in wiring.outputs.values():
        if len(runs) < 2:
            continue
        found: dict[tuple[int, str], tuple[list[str], Any]] = {}
        for r in runs:
            src = sources[r.source]
            ops_by_output = {o.name: op for op in src.block.operations for o in op.outputs}
            op = ops_by_output.get(r.name)
            whole = r.start == 0 and r.end == slots_of(functions[r.source], r.name)
            if op is None or not whole or uses[(r.source, r.name)] != 1 or consumers(src.block).get(r.name) != 1:
                break
            if op.type == "stack" and "axis" in op.inputs and const_int(ops_by_output, op.inputs["axis"]) == 0:
                found[(r.source, r.name)] = ([b.name for b in op.inputs["values"].arguments], op)
            elif op.type == "expand_dims" and const_vector(ops_by_output, op.inputs["axes"]) == [0]:
                # coremltools writes the stack of one slot as an expand_dims.
                found[(r.source, r.name)] = ([b.name for b in op.inputs["x"].arguments], op)
            else:
                break
        else:
            out.update(found)
    return out


def identity(mil: Any, block: Any, names: Names, x: str, out: str, vt: Any) -> None:
    op = block.operations.add(type="identity")
    op.inputs["x"].arguments.add(name=x)
    op.outputs.add(name=out, type=vt)
    op.attributes["name"].CopyFrom(string_value(mil, names.op(out, "_composed")))


def stack(mil: Any, block: Any, names: Names, values: Sequence[str], out: str, vt: Any, name: str) -> None:
    """``out = stack(values, axis=0)``."""
    axis = names.var(f"{out}_axis", "_composed")
    block.operations.append(const_op(mil, axis, 0))
    op = block.operations.add(type="stack")
    for v in values:
        op.inputs["values"].arguments.add(name=v)
    op.inputs["axis"].arguments.add(name=axis)
    op.outputs.add(name=out, type=vt)
    op.attributes["name"].CopyFrom(string_value(mil, names.op(name, "_composed")))


def blob_files(op: Any, k: int) -> dict[str, str]:
    """Every weight file ``op`` references other than weight.bin -> its per-source name."""
    out: dict[str, str] = {}
    for v in values_of(op):
        if v.WhichOneof("value") == "blobFileValue":
            base = v.blobFileValue.fileName.removeprefix(WEIGHTS_PREFIX)
            if base != "weight.bin":
                out[base] = f"source{k}_{base}"
    return out


def slice_var(mil: Any, block: Any, names: Names, x: str, start: int, end: int, vt: Any, base: str) -> str:
    """``x[start:end]`` on axis 0 (rank of ``vt``) as a new variable."""
    rank = vt.tensorType.rank
    begin = names.var(f"{base}_begin", "_composed")
    stop = names.var(f"{base}_end", "_composed")
    mask = names.var(f"{base}_end_mask", "_composed")
    block.operations.append(const_op(mil, begin, [start] + [0] * (rank - 1)))
    block.operations.append(const_op(mil, stop, [end] + [0] * (rank - 1)))
    block.operations.append(const_op(mil, mask, [False] + [True] * (rank - 1)))
    out = names.var(base, "_composed")
    op = block.operations.add(type="slice_by_index")
    op.inputs["x"].arguments.add(name=x)
    op.inputs["begin"].arguments.add(name=begin)
    op.inputs["end"].arguments.add(name=stop)
    op.inputs["end_mask"].arguments.add(name=mask)
    op.outputs.add(name=out, type=with_slots(vt, end - start))
    op.attributes["name"].CopyFrom(string_value(mil, names.op(out, "_composed")))
    return out


def concat(mil: Any, block: Any, names: Names, parts: Sequence[str], out: str, vt: Any) -> None:
    """``out = concat(parts, axis=0)`` (no op for a single part other than a rename is needed)."""
    axis = names.var(f"{out}_axis", "_composed")
    interleave = names.var(f"{out}_interleave", "_composed")
    block.operations.append(const_op(mil, axis, 0))
    block.operations.append(const_op(mil, interleave, False))
    op = block.operations.add(type="concat" if len(parts) > 1 else "identity")
    if len(parts) > 1:
        for p in parts:
            op.inputs["values"].arguments.add(name=p)
        op.inputs["axis"].arguments.add(name=axis)
        op.inputs["interleave"].arguments.add(name=interleave)
    else:
        op.inputs["x"].arguments.add(name=parts[0])
    op.outputs.add(name=out, type=vt)
    op.attributes["name"].CopyFrom(string_value(mil, names.op(out, "_composed")))


def slice_slots(mil: Any, block: Any, names: Names, feed: Feed, spec: TensorSpec, base: str, suffix: str) -> str:
    """The slots ``feed.runs`` of the target input ``feed.name``, as one variable."""
    vt = tensor_value_type(mil, DTYPES[spec["dtype"]], spec["shape"])
    parts = [slice_var(mil, block, names, feed.name, r.start, r.end, vt, f"{base}_{r.start}") for r in feed.runs]
    if len(parts) == 1:
        return parts[0]
    out = names.var(base, suffix)
    concat(mil, block, names, parts, out, with_slots(vt, sum(r.end - r.start for r in feed.runs)))
    return out


# ---- compose -----------------------------------------------------------------


def compose(
    sources: Sequence[Source],
    target: ChunkPlan,
    path: str,
    settings: ConversionSettings | None = None,
    writer: PackageWriter | None = None,
) -> ComposeResult:
    """Write the package of ``target``'s default function composed from
    ``sources`` (in layer order: ``(package, plan)`` or ``(package, plan,
    function)``) to ``path``. See the module docstring for the wiring.
    ``settings``: the build's (its deployment target must be the sources';
    default iOS18, CPU_AND_NE). ``writer``: ``chunkforge`` (`mil_write`) or
    ``coremltools`` (its MIL loader and ``ct.convert``, the reference);
    default: ``settings``' (`runtime.package_writer`). Raises `ChunkforgeError` when the
    sources do not tile the target or a tensor cannot be wired."""
    import coremltools as ct

    seconds: dict[str, float] = {}
    started = time.perf_counter()
    entries = [(str(s[0]), s[1], str(s[2]) if len(s) > 2 else None) for s in sources]
    chunks = [c for _, c, _ in entries]
    functions = [function_of(c, fname) for _, c, fname in entries]
    wiring = plan_wiring(chunks, functions, target)
    programs = [read_source(p, fname or None) for p, _, fname in entries]
    tf = target["functions"][0]
    model = build_program(programs, functions, tf, wiring)
    deployment = getattr(ct.target, settings["minimum_deployment_target"] if settings else "iOS18")
    if model.specificationVersion != deployment.value:
        raise ChunkforgeError(
            f"composed {target['name']}: the sources are specification version {model.specificationVersion}, "
            f"not the {deployment.value} of {deployment.name}"
        )
    # The sources' own metadata keys, not coremltools' conversion keys (the
    # source's dialect, its date), so the bytes do not depend on which package
    # of a source (a part, a bundle) was read; and the sources' chunk names
    # (their packages may be staged under other names).
    composed_from = ",".join(c["name"] for c in chunks)
    metadata = {
        key: value
        for prog_src in programs
        for key, value in prog_src.spec.description.metadata.userDefined.items()
        if not key.startswith(COREMLTOOLS_KEYS)
    }
    metadata[COMPOSED_FROM] = composed_from
    weights: dict[str, str] = {}
    for k, prog in enumerate(programs):
        folder = os.path.join(os.path.dirname(os.path.join(prog.path, mil_write.SPEC_REL)), "weights")
        for base in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            link = f"source{k}.bin" if base == "weight.bin" else f"source{k}_{base}"
            weights[WEIGHTS_PREFIX + link] = os.path.abspath(os.path.join(folder, base))
    seconds["wire"] = time.perf_counter() - started
    composed = Composed(model, tf, target["name"], weights, metadata, path, settings)
    if (writer or package_writer(settings)) == "coremltools":
        stats = write_with_coremltools(composed, seconds)
    else:
        stats = write(composed, seconds)
    seconds["total"] = time.perf_counter() - started
    return {"stats": stats, "seconds": seconds, "composed_from": composed_from, "wiring": wiring.describe(tf)}


@dataclass
class Composed:
    """A composed program (`build_program`'s model) and what writing it needs."""

    model: Any
    function: FunctionPlan
    name: str
    # Weight file names the program reads -> their source files.
    weights: dict[str, str]
    # The package's own metadata keys.
    metadata: dict[str, str]
    path: str
    settings: ConversionSettings | None


def write(c: Composed, seconds: dict[str, float]) -> ChunkStats:
    """Finish the composed program at the protobuf level, as coremltools'
    serialiser would (`write_with_coremltools`, byte for byte), and write it
    with `mil_write.write_package`."""
    import coremltools as ct

    model, function, name, path = c.model, c.function, c.name, c.path

    t = time.perf_counter()
    main = model.mlProgram.functions["main"]
    block = main.block_specializations[main.opset]
    # Only ops that became dead (a dropped output's producers, merged stacks)
    # go: the sources are optimised already.
    eliminate_dead_code(block)
    consume_unused_inputs(main, block)
    # The names of the composed program, not the sources' with their
    # suffixes: coremltools' writer gets them from `convert.save`.
    mil_names.canonicalize(model)
    check_contract(model, function, name)
    describe(model, function)
    # What coremltools records for a MIL program it serialises: the composed
    # ops are its ops.
    model.description.metadata.userDefined.update(
        {COREMLTOOLS_KEYS + "version": ct.__version__, COREMLTOOLS_KEYS + "source": "milinternal", **c.metadata}
    )
    build_info(model, {"coremltools-version": ct.__version__, "coremltools-component-milinternal": ""})
    seconds["wire"] += time.perf_counter() - t
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(path))) as tmp:
        staged = os.path.join(tmp, "composed.mlpackage")
        mil_write.write_package(model, staged, c.weights, ["main"])
        os.rename(staged, path)
    seconds["save"] = time.perf_counter() - t
    return program_stats(mil_write.op_counts(block), os.path.getsize(os.path.join(path, mil_write.WEIGHTS_REL)))


def program_stats(counts: dict[str, int], weight_bytes: int) -> ChunkStats:
    """The stats of a program written at the protobuf level (op counts as
    `mil_write.op_counts` gives them); no kernel ran for it."""
    return {
        "mil_ops": sum(counts.values()),
        "op_counts": counts,
        "weight_bytes": weight_bytes,
        "palettized_weights": counts.get("constexpr_lut_to_dense", 0),
        "projection_ops": sum(counts.get(op, 0) for op in PROJECTION_OPS),
        "palettize_cache_hits": None,
        "palettize_cache_misses": None,
        "palettize_unmatched_groups": None,
        "palettize_seconds": None,
    }


def write_with_coremltools(c: Composed, seconds: dict[str, float]) -> ChunkStats:
    """The reference writer: coremltools' MIL loader reads the composed
    program (type-checking every op) with its weights, and ``ct.convert``
    runs dead code elimination and its backend passes and serialises it
    (its temporaries beside the package, `runtime.temporaries_beside`)."""
    with temporaries_beside(c.path):
        return _write_with_coremltools(c, seconds)


def _write_with_coremltools(c: Composed, seconds: dict[str, float]) -> ChunkStats:
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto import load as milproto_load

    from . import chunks as convert_mod
    from . import passes as passes_mod

    model, settings = c.model, c.settings
    with tempfile.TemporaryDirectory() as folder:
        for file_name, source in c.weights.items():
            os.symlink(source, os.path.join(folder, file_name.removeprefix(WEIGHTS_PREFIX)))
        # One validation of the program (not one per pass: the same check) and
        # no text rendering of it for coremltools' debug log lines.
        with passes_mod.validate_once(), passes_mod.terse_program_text():
            t = time.perf_counter()
            prog = milproto_load.load(model, model.specificationVersion, file_weights_dir=folder)
            mlmodel = ct.convert(
                prog,
                convert_to="mlprogram",
                minimum_deployment_target=getattr(
                    ct.target, settings["minimum_deployment_target"] if settings else "iOS18"
                ),
                # The program is fp16 already: no casts to add.
                compute_precision=ct.precision.FLOAT32,
                compute_units=getattr(ct.ComputeUnit, settings["compute_units"] if settings else "CPU_AND_NE"),
                pass_pipeline=ct.PassPipeline(pass_names=["common::dead_code_elimination"]),
            )
            seconds["wire"] += time.perf_counter() - t
    check_contract(mlmodel.get_spec(), c.function, c.name)
    mlmodel.user_defined_metadata.update(c.metadata)
    t = time.perf_counter()
    stats = convert_mod.save(mlmodel, c.path)
    seconds["save"] = time.perf_counter() - t
    return stats


def eliminate_dead_code(block: Any) -> None:
    """Remove the ops of ``block`` (in program order) whose outputs no later
    op and no block output reads, as coremltools' ``dead_code_elimination``."""
    live = set(block.outputs)
    keep: list[Any] = []
    for op in reversed(block.operations):
        if not any(o.name in live for o in op.outputs):
            continue
        keep.append(op)
        for arg in op.inputs.values():
            for b in arg.arguments:
                if b.WhichOneof("binding") == "name":
                    live.add(b.name)
        for inner in op.blocks:
            # Conservative: a nested block keeps everything it reads.
            live.update(n for iop in inner.operations for a in iop.inputs.values() for n in names_bound(a))
            live.update(inner.outputs)
    if len(keep) == len(block.operations):
        return
    kept = [type(block.operations[0])() for _ in keep]
    for new, op in zip(kept, reversed(keep), strict=True):
        new.CopyFrom(op)
    del block.operations[:]
    block.operations.extend(kept)


def consume_unused_inputs(function: Any, block: Any) -> None:
    """An ``identity`` op ``{input}_tmp`` at the end of ``block`` for each
    input no op reads (a KV-shared chunk's ``update_mask``), as coremltools'
    ``handle_unused_inputs`` pass writes every program it serialises."""
    from coremltools.proto import MIL_pb2 as mil

    used = set(consumers(block))
    taken = {n for op in block.operations for n in defined_names(op)}
    for i in function.inputs:
        if i.name in used:
            continue
        out = f"{i.name}_tmp"
        if out in taken:
            raise ChunkforgeError(f"the composed program already has a variable {out}")
        op = block.operations.add(type="identity")
        op.inputs["x"].arguments.add(name=i.name)
        op.outputs.add(name=out, type=i.type)
        op.attributes["name"].CopyFrom(string_value(mil, out))


def names_bound(arg: Any) -> Iterator[str]:
    for b in arg.arguments:
        if b.WhichOneof("binding") == "name":
            yield b.name


def describe(model: Any, function: FunctionPlan) -> None:
    """The model description of a single-function program: the plan's inputs
    and outputs as multi-arrays, as coremltools describes them."""
    from coremltools.proto import FeatureTypes_pb2

    dtypes = {
        "fp16": FeatureTypes_pb2.ArrayFeatureType.FLOAT16,
        "fp32": FeatureTypes_pb2.ArrayFeatureType.FLOAT32,
        "int32": FeatureTypes_pb2.ArrayFeatureType.INT32,
    }
    for features, specs in (
        (model.description.input, function["inputs"]),
        (model.description.output, function["outputs"]),
    ):
        for s in specs:
            f = features.add(name=s["name"])
            f.type.multiArrayType.shape.extend(s["shape"])
            f.type.multiArrayType.dataType = dtypes[s["dtype"]]


def build_info(model: Any, info: dict[str, str]) -> None:
    """The program's ``buildInfo`` attribute: a string -> string dictionary."""
    from coremltools.proto import MIL_pb2 as mil

    value = model.mlProgram.attributes["buildInfo"]
    string = mil.ValueType(tensorType=mil.TensorType(dataType=mil.DataType.STRING))
    value.type.dictionaryType.keyType.CopyFrom(string)
    value.type.dictionaryType.valueType.CopyFrom(string)
    for key, v in info.items():
        entry = value.immediateValue.dictionary.values.add()
        entry.key.CopyFrom(string_value(mil, key))
        entry.value.CopyFrom(string_value(mil, v))


def check_contract(model: Any, function: FunctionPlan, name: str) -> None:
    """The composed program's inputs and outputs have exactly the target
    function's names, shapes and dtypes."""
    from coremltools.proto import MIL_pb2 as mil

    main = model.mlProgram.functions["main"]
    block = main.block_specializations[main.opset]
    types = {i.name: i.type for i in main.inputs}
    types.update((o.name, o.type) for op in block.operations for o in op.outputs)
    for what, got, want in (
        ("inputs", [i.name for i in main.inputs], function["inputs"]),
        ("outputs", list(block.outputs), function["outputs"]),
    ):
        if got != [s["name"] for s in want]:
            raise ChunkforgeError(f"composed {name}: {what} {got} are not the plan's {[s['name'] for s in want]}")
        for s in want:
            if types.get(s["name"]) != tensor_value_type(mil, DTYPES[s["dtype"]], s["shape"]):
                raise ChunkforgeError(f"composed {name}: {s['name']} is not {s['shape']} {s['dtype']} as the plan says")


def compose_job(job: ComposeJob) -> ComposedChunk:
    """The build's call (py/calls.rs `compose`): `compose` of ``job``'s
    sources into its target at its path, with the seconds the build records:
    ``compose`` (wiring, loading and writing the program) and ``save``."""
    result = compose(
        [(s["path"], s["chunk"]) for s in job["sources"]], job["target"], job["path"], settings=job["settings"]
    )
    release_memory()
    seconds = result["seconds"]
    return {
        "stats": result["stats"],
        "seconds": {"compose": seconds["total"] - seconds["save"], "save": seconds["save"]},
    }
