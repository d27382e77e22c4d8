"""Every function of a unit's packages in one conversion, then split.

A unit of the build (`chunk1` with its ``decode_q1`` and ``verify_qK`` and
`prefill_chunk1` with its ``prefill_b512``, say) holds several functions of the
same layers, and so of the same weights. Converted one by one, each function
loads, traces, casts, palettizes and serialises every weight again: at full
width, most of a conversion's time and most of the gigabytes it writes.
`convert_jobs` converts them together instead:

1. one module runs every function (`model.Functions`: the first function's
   module, the others' modules holding its very parameters), loaded once;
2. it is traced once and converted once (`convert.convert`, the build's
   settings), its inputs and outputs named ``f{k}__{name}`` after the
   function ``k`` they belong to, so every weight is one constant of one
   program, cast and palettized once;
3. the program is saved once, and `split` cuts it into one single-function
   package per function, at the protobuf level: the function's own inputs and
   outputs, the ops they need (the others' are dead there), every other name
   made canonical (`mil_names`: the trace numbers its names over every
   function), the ``f{k}__`` prefix taken off the inputs and outputs, and a
   hard link of the one weight file.

Each function's program is op for op the program its own conversion gives,
with the same values and, being canonical, the same names; the constants sit
where the first function read them (python/tests/test_joint.py runs both
through the MIL interpreter). The parts are bundled as before
(`convert.combine`), which keeps only the blobs each package reads.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..checkpoint import Checkpoint
from ..contract import ChunkJob, ChunkStats, ConvertedChunk, ConvertedFunction, FunctionPlan
from ..mil import names as mil_names
from ..mil import write as mil_write
from ..mil.program import BLOB_HEADER, BLOB_METADATA
from ..model import Functions, build_functions
from ..runtime import ChunkforgeError, release_memory, temporaries_beside
from . import compose
from .chunks import _Phases, check_finite, kernel_apart, load_and_convert, save
from .palettize import WeightCache


def prefix(k: int) -> str:
    """What the names of function ``k``'s inputs and outputs start with in the joint program."""
    return f"f{k}__"


def joint_plan(functions: list[FunctionPlan]) -> FunctionPlan:
    """The joint program's function: every function's inputs, then outputs,
    in order, each name prefixed with its function's `prefix`."""
    return {
        "name": "joint",
        "kind": functions[0]["kind"],
        "tokens": functions[0]["tokens"],
        "inputs": [{**s, "name": prefix(k) + s["name"]} for k, f in enumerate(functions) for s in f["inputs"]],
        "outputs": [{**s, "name": prefix(k) + s["name"]} for k, f in enumerate(functions) for s in f["outputs"]],
    }


def convert_jobs(
    jobs: list[ChunkJob], joint: bool, threads: int, cache: WeightCache, progress: Callable[[str, str], None]
) -> list[ConvertedChunk]:
    """Each job's functions converted into its paths: one conversion of them
    all with ``joint`` (the jobs are of the same layers), else
    `convert.convert_chunk` of each job. Loading and tracing (torch's
    arithmetic: the trace runs the module once) take ``threads`` threads."""
    from .chunks import convert_chunk

    with temporaries_beside(jobs[0]["paths"][0]):
        if not joint:
            return [convert_chunk(job, cache, progress, threads) for job in jobs]
        return convert_joint(jobs, cache, progress, threads)


def convert_joint(
    jobs: list[ChunkJob], cache: WeightCache, progress: Callable[[str, str], None], threads: int = 1
) -> list[ConvertedChunk]:
    """The functions of ``jobs`` (chunk plans of the same layers) in one
    conversion, split into each function's path (module docstring); one
    reply per job, as `convert.convert_chunk` gives it."""
    first = jobs[0]
    settings = first["settings"]
    for job in jobs[1:]:
        c, lead = job["chunk"], first["chunk"]
        if (c["first_layer"], c["last_layer"]) != (lead["first_layer"], lead["last_layer"]):
            raise ChunkforgeError(
                f"{c['name']} and {lead['name']} hold different layers: they cannot be converted together"
            )
    pairs = [(job["chunk"], f) for job in jobs for f in job["chunk"]["functions"]]
    paths = [p for job in jobs for p in job["paths"]]
    functions = [f for _, f in pairs]
    plan = joint_plan(functions)
    label = " + ".join(job["chunk"]["name"] for job in jobs)
    name = first["chunk"]["name"]
    phases = _Phases(label, progress)

    def module() -> Functions:
        ckpt = Checkpoint(first["checkpoint"])
        try:
            loaded = build_functions(first["dims"], pairs, ckpt, torch.float32, rounded_to=torch.float16)
        finally:
            ckpt.close()
        check_finite(loaded, first["checkpoint"]["prefix"])
        return loaded

    loading = f"load weights (once for {len(pairs)} functions)"
    ml, profile = load_and_convert(phases, module, loading, plan, name, settings, cache, first, threads)
    whole = os.path.join(os.path.dirname(paths[0]), ".joint-" + os.path.basename(paths[0]))
    try:
        with phases("save", f"save, split into {len(pairs)} functions"):
            stats = save(ml, whole, canonical=False)
            del ml
            release_memory()
            parts = split(whole, functions, paths)
    except BaseException:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(whole, ignore_errors=True)
    kernel = stats["palettize_seconds"]
    seconds = kernel_apart(phases.seconds, kernel)
    # The one conversion's seconds, kernel counts and pass profile are the
    # first function's; the others took none of their own (zero kernel work
    # when the kernel ran, none when it did not).
    for k, part in enumerate(parts):
        ran = kernel is not None
        part["palettize_cache_hits"] = stats["palettize_cache_hits"] if k == 0 else (0 if ran else None)
        part["palettize_cache_misses"] = stats["palettize_cache_misses"] if k == 0 else (0 if ran else None)
        part["palettize_unmatched_groups"] = stats["palettize_unmatched_groups"] if k == 0 else (0 if ran else None)
        part["palettize_seconds"] = kernel if k == 0 else (0.0 if ran else None)
    out: list[ConvertedChunk] = []
    k = 0
    for job in jobs:
        converted: list[ConvertedFunction] = []
        for f in job["chunk"]["functions"]:
            converted.append(
                {
                    "name": f["name"],
                    "stats": parts[k],
                    "seconds": seconds if k == 0 else {},
                    "passes": profile.stats if profile is not None and k == 0 else None,
                }
            )
            k += 1
        out.append({"functions": converted})
    return out


def split(whole: str, functions: list[FunctionPlan], paths: list[str]) -> list[ChunkStats]:
    """Cut the joint program of the package ``whole`` (`joint_plan`) into one
    single-function package per function, written to ``paths``; each part's
    stats."""
    spec = mil_write.read_spec(whole)
    weights = os.path.join(whole, mil_write.WEIGHTS_REL)
    out = []
    for k, (f, path) in enumerate(zip(functions, paths, strict=True)):
        part = type(spec)()
        part.CopyFrom(spec)
        fn = part.mlProgram.functions["main"]
        block = fn.block_specializations[fn.opset]
        cut(fn, block, prefix(k), f)
        for features in (part.description.input, part.description.output):
            own = [x for x in features if x.name.startswith(prefix(k))]
            kept = [type(x)() for x in own]
            for new, x in zip(kept, own, strict=True):
                new.CopyFrom(x)
                new.name = x.name.removeprefix(prefix(k))
            del features[:]
            features.extend(kept)
        os.makedirs(os.path.dirname(os.path.join(path, mil_write.WEIGHTS_REL)))
        os.link(weights, os.path.join(path, mil_write.WEIGHTS_REL))
        with open(os.path.join(path, mil_write.SPEC_REL), "wb") as fh:
            fh.write(part.SerializeToString(deterministic=True))
        mil_write.write_manifest(path)
        out.append(part_stats(block, weights))
    return out


def cut(fn: Any, block: Any, pre: str, f: FunctionPlan) -> None:
    """Keep function ``fn``'s inputs and outputs named ``pre...`` and the ops
    they need, give every other name its canonical name (`mil_names`; the
    ops of the other functions are gone, so the names are those of a
    conversion of this function alone), and take ``pre`` off the inputs and
    outputs (and the ops named after them)."""
    own = [i for i in fn.inputs if i.name.startswith(pre)]
    kept = [type(i)() for i in own]
    for new, i in zip(kept, own, strict=True):
        new.CopyFrom(i)
    del fn.inputs[:]
    fn.inputs.extend(kept)
    outputs = [o for o in block.outputs if o.startswith(pre)]
    want = [pre + s["name"] for s in f["outputs"]]
    if outputs != want:
        raise ChunkforgeError(f"the joint program's outputs {outputs} are not {f['name']}'s {want}")
    del block.outputs[:]
    block.outputs.extend(outputs)
    compose.eliminate_dead_code(block)
    compose.consume_unused_inputs(fn, block)
    mil_names.canonicalize_block(fn, block)
    rename = {pre + s["name"]: s["name"] for s in [*f["inputs"], *f["outputs"]]}
    defined = {n for op in block.operations for n in compose.defined_names(op)} - set(rename)
    if defined & set(rename.values()):
        raise ChunkforgeError(
            f"{f['name']}: the split program already defines {sorted(defined & set(rename.values()))}"
        )
    for i in fn.inputs:
        i.name = rename.get(i.name, i.name)
    for op in block.operations:
        compose.rename_definitions(op, rename)
        compose.rename_names(op, rename)
    renamed = [rename.get(o, o) for o in block.outputs]
    del block.outputs[:]
    block.outputs.extend(renamed)
    inputs = [i.name for i in fn.inputs]
    if renamed != [s["name"] for s in f["outputs"]] or inputs != [s["name"] for s in f["inputs"]]:
        raise ChunkforgeError(f"{f['name']}: the split program takes {inputs} and gives {renamed}, not its plan's")
    for op in all_ops(block):
        names = op.attributes["name"].immediateValue.tensor.strings.values
        if len(names) == 1 and names[0] in rename:
            names[0] = rename[names[0]]


def all_ops(block: Any) -> Iterator[Any]:
    """Every op of ``block`` with a name, nested blocks' too."""
    for op in block.operations:
        if "name" in op.attributes:
            yield op
        for inner in op.blocks:
            yield from all_ops(inner)


def part_stats(block: Any, weights: str) -> ChunkStats:
    """A split function's counts; its weight bytes are those of the file a
    package of that function alone holds: the header and each blob it reads,
    in the order it reads them."""
    counts = mil_write.op_counts(block)
    read: dict[int, int] = {}
    for op in block.operations:
        for v in mil_write.op_values(op):
            if v.WhichOneof("value") == "blobFileValue":
                read[int(v.blobFileValue.offset)] = 0
    source = mil_write.Source(weights)
    for offset in read:
        _, data = source.blob(offset)
        read[offset] = BLOB_METADATA + len(data)
    # Each blob padded to the alignment but the last, as coremltools writes them.
    sizes = list(read.values())
    padded = sum(-(-n // mil_write.ALIGN) * mil_write.ALIGN for n in sizes[:-1])
    return compose.program_stats(counts, BLOB_HEADER + padded + sum(sizes[-1:]))
