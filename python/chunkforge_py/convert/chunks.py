"""Trace a chunk module and turn it into a palettized Core ML package.

`convert_chunk` converts one package: every function of it is loaded,
traced, converted (and palettized) and saved, each phase reported through the
progress callback and timed. The Rust build calls `joint.convert_jobs`, which
uses it when a unit's functions are converted one at a time. The conversion
settings come from Rust (`ConversionSettings`, records.rs); none is written
here.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import torch

from ..checkpoint import Checkpoint
from ..contract import (
    BundleStats,
    CheckpointInfo,
    ChunkJob,
    ChunkPlan,
    ChunkStats,
    ConversionSettings,
    ConvertedChunk,
    ConvertedFunction,
    Dims,
    FunctionPlan,
    MilStats,
    PackageWriter,
    Palettization,
    PalettizeStats,
)
from ..mil import names as mil_names
from ..mil import write as mil_write
from ..mil.inspect import PROJECTION_OPS
from ..model import Chunk, build_chunk
from ..runtime import (
    ChunkforgeError,
    mil_shortcuts,
    release_memory,
    temporaries_beside,
    torch_threads,
)
from . import passes
from .palettize import WeightCache, conversion_pipeline, whole_weight_compression

NP_DTYPES = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32}
TORCH_DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "int32": torch.int32}


def load(dims: Dims, chunk: ChunkPlan, ckpt_info: CheckpointInfo, function: FunctionPlan) -> Chunk:
    """Build the torch module of one of the chunk's functions with its weights
    from the checkpoint, rounded to fp16 and held in fp32, as `trace` takes
    them: the same module as one loaded in fp16 and then cast to fp32, without
    the fp16 copy of every weight in between (at full width, gigabytes
    written, which costs seconds per GB on a virtual machine)."""
    ckpt = Checkpoint(ckpt_info)
    try:
        module = build_chunk(dims, chunk, ckpt, torch.float32, function=function, rounded_to=torch.float16)
    finally:
        ckpt.close()
    check_finite(module, ckpt_info["prefix"])
    return module


def check_finite(module: Chunk, prefix: str) -> None:
    for local, p in module.named_parameters():
        # One reduction, no mask: a NaN anywhere makes both ends NaN, an
        # infinity one end (18x faster than `isfinite(p).all()` on a
        # full-width weight, which builds a mask of every element).
        lo, hi = torch.aminmax(p.detach())
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            continue
        bad = int((~torch.isfinite(p)).sum())
        raise ChunkforgeError(
            f"weight {prefix}{module.checkpoint_name(local)} has {bad} NaN/Inf values "
            "(after conversion to fp16: values beyond ±65504 overflow)"
        )


def example_inputs(function: FunctionPlan, dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    out = []
    for spec in function["inputs"]:
        t = torch.zeros(spec["shape"], dtype=TORCH_DTYPES[spec["dtype"]] if spec["dtype"] != "fp16" else dtype)
        out.append(t)
    return out


def trace(module: Chunk, function: FunctionPlan | None = None) -> torch.jit.ScriptModule:
    """Traces `module`, its weights rounded to fp16 (and checked: `load`),
    with its weights and inputs in fp32 (a module loaded in fp16 is cast).

    coremltools' frontend builds an fp32 program and `add_fp16_cast` casts
    it to fp16 (compute precision FLOAT16). From an fp16 trace it first
    promotes every fp16 weight to a new fp32 constant (a cast of each, the
    frontend's largest cost at full width) and keeps the torch module's
    fp16 copy besides; from an fp32 trace it takes the weights as they are.
    The converted program is the same op for op and value for value (the
    weights are the same fp16 values either way): only the frontend's name
    for each converted constant differs, ``<name>_to_fp16`` where it was
    ``<name>_promoted_to_fp16`` (python/tests/test_mil_interp.py
    `test_tracing_in_fp32_converts_to_the_program_an_fp16_trace_gives`).
    Tracing runs the module once on zeros and keeps only the ops it called,
    and torch's fp32 CPU kernels are fast where its fp16 ones are plain loops
    (a full-width 512-token prefill: 2 s against 270 s). ``function``: what
    the module's forward takes, if not its own function (`model.Functions`)."""
    module.float()
    with torch.no_grad():
        return torch.jit.trace(
            module,
            tuple(example_inputs(function or module.function, torch.float32)),
            check_trace=False,
            strict=False,
        )


def convert(
    traced: torch.jit.ScriptModule,
    function: FunctionPlan,
    name: str,
    settings: ConversionSettings,
    cache: WeightCache | None = None,
) -> Any:
    """ct.convert with `settings`. With the chunkforge palettizer, the Rust
    kernel's INT4 palettization runs as the last pass of the conversion itself
    (see `palettize.conversion_pipeline`; `cache`: the build's results); its
    counts and kernel seconds are attached to the model for `save`. With the
    chunkforge pass pipeline, `traced`'s weights are freed during the
    conversion (`passes.release_torch_weights`): it cannot be used again."""
    import coremltools as ct

    inputs = [ct.TensorType(name=t["name"], shape=t["shape"], dtype=NP_DTYPES[t["dtype"]]) for t in function["inputs"]]
    outputs = [ct.TensorType(name=t["name"], dtype=NP_DTYPES[t["dtype"]]) for t in function["outputs"]]
    pal = settings["palettization"]
    pipeline = passes.pipeline(default=settings["pass_pipeline"] == "coremltools")
    dispatcher = None
    if pal is not None and pal["palettizer"] == "chunkforge":
        dispatcher = conversion_pipeline(pipeline, name, pal, cache)
    cut = settings["pass_pipeline"] == "chunkforge"
    if cut:
        passes.release_torch_weights(pipeline, traced)
    shortcuts = cut and mil_shortcuts(settings)
    with passes.shortcuts(shortcuts), whole_weight_compression(dispatcher if shortcuts else None):
        mlmodel = ct.convert(
            traced,
            inputs=inputs,
            outputs=outputs,
            convert_to="mlprogram",
            minimum_deployment_target=getattr(ct.target, settings["minimum_deployment_target"]),
            compute_precision=getattr(ct.precision, settings["compute_precision"]),
            compute_units=getattr(ct.ComputeUnit, settings["compute_units"]),
            pass_pipeline=pipeline,
        )
    if dispatcher is not None and pal is not None:
        dispatcher.release()
        check_palettized(mlmodel, name, int(pal["group_size"]))
        mlmodel._chunkforge_palettize_stats = dispatcher.stats()
    return mlmodel


def group_size_error(name: str, wname: str, rows: int, group: int) -> ChunkforgeError:
    return ChunkforgeError(
        f"{name}: weight {wname} has {rows} output channels, not a multiple of the "
        f"palettization group size {group}; use --no-quantize or a checkpoint with compatible widths"
    )


def check_palettized(mlmodel: Any, name: str, group: int) -> None:
    """Every projection weight must have come out palettized: coremltools skips a
    weight it cannot group (with a log line), which would silently ship a
    larger, slower model than asked for."""
    for op in mlmodel._mil_program.functions["main"].operations:
        if op.op_type not in PROJECTION_OPS:
            continue
        w = op.weight
        if w.op is not None and w.op.op_type == "constexpr_lut_to_dense":
            continue
        wname = w.op.name if w.op is not None else w.name
        if w.shape[0] % group != 0:
            raise group_size_error(name, wname, w.shape[0], group)
        raise ChunkforgeError(f"{name}: weight {wname} {tuple(w.shape)} was not palettized by coremltools")


def projection_weights(mlmodel: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(const name, shape) of every weight feeding a projection (1x1 `conv`) in the main function."""
    prog = mlmodel._mil_program
    out = []
    for op in prog.functions["main"].operations:
        if op.op_type in PROJECTION_OPS:
            w = op.weight
            out.append((w.op.name if w.op is not None else w.name, tuple(w.shape)))
    return out


def palettize(mlmodel: Any, name: str, settings: Palettization) -> Any:
    """coremltools' own INT4 per_grouped_channel k-means palettization of every
    projection weight (`--palettizer coremltools`, for comparison; `--kmeans-workers`
    processes). The Rust kernel runs inside `convert` instead.

    A weight whose output-channel count is not a multiple of the group size is
    an error naming it: leaving it unquantized would silently ship a larger,
    slower model than the user asked for.
    """
    from coremltools.optimize.coreml import OpPalettizerConfig, OptimizationConfig, palettize_weights

    group = int(settings["group_size"])
    for wname, shape in projection_weights(mlmodel):
        if shape[0] % group != 0:
            raise group_size_error(name, wname, shape[0], group)
    cfg = OpPalettizerConfig(
        mode=settings["mode"],
        nbits=int(settings["nbits"]),
        granularity=settings["granularity"],
        group_size=group,
        channel_axis=0,
        weight_threshold=0,
        num_kmeans_workers=int(settings["kmeans_workers"]),
    )
    return palettize_weights(mlmodel, OptimizationConfig(op_type_configs={op: cfg for op in PROJECTION_OPS}))


def mil_stats(mlmodel: Any) -> MilStats:
    prog = mlmodel._mil_program
    ops = list(prog.functions["main"].operations)
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.op_type] = counts.get(op.op_type, 0) + 1
    return {"mil_ops": len(ops), "op_counts": dict(sorted(counts.items()))}


def normalize_manifest(path: str) -> None:
    """Replace the random item identifiers coremltools writes into a package's
    Manifest.json with identifiers derived from each item's path, so the same
    model gives the same bytes. Identifiers only need to be unique within one
    package; the runtime resolves them through this same file."""
    manifest_path = os.path.join(path, "Manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    entries = manifest.get("itemInfoEntries", {})
    renamed = {old: mil_write.manifest_id(entry["path"]) for old, entry in entries.items()}
    manifest["itemInfoEntries"] = {renamed[old]: entries[old] for old in sorted(entries, key=lambda o: renamed[o])}
    if manifest.get("rootModelIdentifier") in renamed:
        manifest["rootModelIdentifier"] = renamed[manifest["rootModelIdentifier"]]
    # Byte-for-byte the layout coremltools itself writes (it rewrites this file
    # whenever it opens a package, so any other layout would change on read).
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=4, sort_keys=True)
        f.write("\n")


def serialize_spec_deterministically(path: str, canonical: bool = True) -> None:
    """Rewrite the package's model.mlmodel with protobuf's deterministic
    serialization: the default one writes map entries (metadata, op attributes)
    in an order that can change between processes. ``canonical``: with the
    program's canonical names (`mil_names`), not the trace's."""
    from coremltools.proto import Model_pb2

    spec_path = os.path.join(path, "Data", "com.apple.CoreML", "model.mlmodel")
    spec = Model_pb2.Model()
    with open(spec_path, "rb") as f:
        spec.ParseFromString(f.read())
    if canonical:
        mil_names.canonicalize(spec)
    with open(spec_path, "wb") as f:
        f.write(spec.SerializeToString(deterministic=True))


def weight_bytes(path: str) -> int:
    weights = os.path.join(path, "Data", "com.apple.CoreML", "weights", "weight.bin")
    return os.path.getsize(weights) if os.path.exists(weights) else 0


def save(mlmodel: Any, path: str, canonical: bool = True) -> ChunkStats:
    """Write the package to ``path`` (a temporary name chosen by Rust) and
    return its stats. ``canonical``: its program's names made canonical
    (`mil_names`; the joint program, which is split first, keeps the trace's)."""
    mil = mil_stats(mlmodel)
    # The conversion date would make two builds of the same model differ.
    metadata = mlmodel.user_defined_metadata
    if "com.github.apple.coremltools.conversion_date" in metadata:
        del metadata["com.github.apple.coremltools.conversion_date"]
    mlmodel.save(path)
    serialize_spec_deterministically(path, canonical)
    normalize_manifest(path)
    # Weight-cache counts of the Rust palettizer (None when it did not run).
    pal = cast(PalettizeStats, getattr(mlmodel, "_chunkforge_palettize_stats", None) or {})
    stats: ChunkStats = {
        **mil,
        "weight_bytes": weight_bytes(path),
        "palettized_weights": mil["op_counts"].get("constexpr_lut_to_dense", 0),
        "projection_ops": sum(mil["op_counts"].get(op, 0) for op in PROJECTION_OPS),
        "palettize_cache_hits": pal.get("palettize_cache_hits"),
        "palettize_cache_misses": pal.get("palettize_cache_misses"),
        "palettize_unmatched_groups": pal.get("palettize_unmatched_groups"),
        "palettize_seconds": pal.get("palettize_seconds"),
    }
    return stats


def combine(
    parts: list[tuple[str, str]], targets: list[tuple[str, list[str]]], writer: PackageWriter = "chunkforge"
) -> BundleStats:
    """Bundle single-function packages ``(package path, function name)`` into the
    packages ``targets`` (``(path, [function, ...])``, each target's first
    function its default). ``writer``: ``chunkforge`` (`mil_write`, below) or
    ``coremltools`` (`combine_with_coremltools`, the reference it matches
    byte for byte; the build's `ConversionSettings` ``writer``).

    All parts go into one multifunction program first, at the protobuf level
    (`mil_write`): every part is a finished program, so its function is
    copied as it is and its weights are copied, not loaded. A weight that
    several functions hold (same values) is stored once: the kernel's
    palettization is deterministic and cached within the build, so every
    function's copy of a weight is the same bytes and the blob is the size of
    one function's. Each target is then that program with the other targets'
    functions removed from its spec, beside the same weight file, so all
    targets share one weight blob byte for byte (the runtime hard-links
    ``chunkN``'s blob into ``prefill_chunkN``)."""
    import shutil
    import tempfile

    from coremltools.proto import Model_pb2

    if writer == "coremltools":
        return combine_with_coremltools(parts, targets)
    whole = Model_pb2.Model()
    sources: dict[str, str] = {}
    for k, (part, function) in enumerate(parts):
        spec = mil_write.read_spec(part)
        if list(spec.mlProgram.functions) != ["main"]:
            raise ChunkforgeError(f"{part}: a bundle part must hold one function, main")
        if k == 0:
            whole.CopyFrom(spec)
            whole.mlProgram.ClearField("functions")
            # What coremltools' save_multifunction keeps of its parts: the
            # functions, not a part's conversion metadata or build info.
            whole.mlProgram.ClearField("attributes")
            whole.description.Clear()
            whole.description.defaultFunctionName = function
        elif spec.specificationVersion != whole.specificationVersion:
            raise ChunkforgeError(
                f"{part}: specification version {spec.specificationVersion}, "
                f"not the {whole.specificationVersion} of {parts[0][0]}"
            )
        fn = whole.mlProgram.functions[function]
        fn.CopyFrom(spec.mlProgram.functions["main"])
        # Each part's weight file under a name of its own.
        key = f"@model_path/weights/part{k}.bin"
        for v in mil_write.blob_values(whole, [function]):
            if v.blobFileValue.fileName != mil_write.WEIGHT_FILE:
                raise ChunkforgeError(f"{part}: reads weight file {v.blobFileValue.fileName!r}, not weight.bin")
            v.blobFileValue.fileName = key
        sources[key] = os.path.join(part, mil_write.WEIGHTS_REL)
        fd = whole.description.functions.add(name=function)
        fd.input.extend(spec.description.input)
        fd.output.extend(spec.description.output)
        fd.state.extend(spec.description.state)
        fd.predictedFeatureName = spec.description.predictedFeatureName
        fd.predictedProbabilitiesName = spec.description.predictedProbabilitiesName
    with tempfile.TemporaryDirectory(dir=os.path.dirname(targets[0][0])) as tmp:
        staged = os.path.join(tmp, "whole.mlpackage")
        mil_write.write_package(whole, staged, sources)
        weights = os.path.join(staged, mil_write.WEIGHTS_REL)
        for path, functions in targets:
            spec = Model_pb2.Model()
            spec.CopyFrom(whole)
            keep_functions(spec, functions)
            os.makedirs(os.path.dirname(os.path.join(path, mil_write.WEIGHTS_REL)))
            shutil.copyfile(weights, os.path.join(path, mil_write.WEIGHTS_REL))
            with open(os.path.join(path, mil_write.SPEC_REL), "wb") as f:
                f.write(spec.SerializeToString(deterministic=True))
            mil_write.write_manifest(path)
    return {"weight_bytes": weight_bytes(targets[0][0])}


def combine_with_coremltools(parts: list[tuple[str, str]], targets: list[tuple[str, list[str]]]) -> BundleStats:
    """`combine` by coremltools' ``save_multifunction``: it loads every part
    into one MIL program (weights and all), stores a weight several functions
    hold once, and serialises the program again; each target is then a copy
    with the other targets' functions removed from its spec."""
    import shutil
    import tempfile

    from coremltools.models.utils import MultiFunctionDescriptor, save_multifunction

    desc = MultiFunctionDescriptor()
    for part, function in parts:
        desc.add_function(part, src_function_name="main", target_function_name=function)
    desc.default_function_name = parts[0][1]
    with tempfile.TemporaryDirectory(dir=os.path.dirname(targets[0][0])) as tmp:
        whole = os.path.join(tmp, "whole.mlpackage")
        # save_multifunction validates the program after each of its passes;
        # once is the same check.
        with passes.validate_once(), temporaries_beside(whole):
            save_multifunction(desc, whole)
        for path, functions in targets:
            shutil.copytree(whole, path)
            spec = mil_write.read_spec(path)
            keep_functions(spec, functions)
            with open(os.path.join(path, mil_write.SPEC_REL), "wb") as f:
                f.write(spec.SerializeToString(deterministic=True))
            normalize_manifest(path)
    release_memory()
    return {"weight_bytes": weight_bytes(targets[0][0])}


def keep_functions(spec: Any, functions: list[str]) -> None:
    """Remove every function but ``functions`` from a multifunction spec
    (program and description), the first of them the default."""
    for name in list(spec.mlProgram.functions):
        if name not in functions:
            del spec.mlProgram.functions[name]
    kept = [fd for fd in spec.description.functions if fd.name in functions]
    del spec.description.functions[:]
    spec.description.functions.extend(sorted(kept, key=lambda fd: functions.index(fd.name)))
    spec.description.defaultFunctionName = functions[0]


def conversion_phases(settings: ConversionSettings) -> tuple[str, str]:
    """How the progress line names the conversion phase, and the INT4
    settings (for coremltools' palettization phase)."""
    pal = settings["palettization"]
    int4 = f"INT4 {pal['granularity']}, group {pal['group_size']}" if pal is not None else ""
    target = f"{settings['minimum_deployment_target']}, FP16"
    if pal is not None and pal["palettizer"] == "chunkforge":
        return f"convert + palettize (ct.convert, {target}, {int4})", int4
    return f"convert (ct.convert, {target})", int4


def kernel_apart(seconds: dict[str, float], kernel: float | None) -> dict[str, float]:
    """``seconds`` with the kernel's time inside the conversion reported as
    palettize, not convert."""
    if kernel is not None:
        seconds["convert"] = max(seconds["convert"] - kernel, 0.0)
        seconds["palettize"] = kernel
    return seconds


class _Phases:
    """Times the phases of one function's conversion, telling `progress` the
    function (`chunk` or `chunk/function`) and each phase as it starts."""

    def __init__(self, label: str, progress: Callable[[str, str], None]):
        self.label, self.progress = label, progress
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, key: str, what: str) -> Iterator[None]:
        self.progress(self.label, what)
        started = time.perf_counter()
        yield
        self.seconds[key] = time.perf_counter() - started


def load_and_convert(
    phases: _Phases,
    module: Callable[[], Chunk],
    loading: str,
    function: FunctionPlan,
    name: str,
    settings: ConversionSettings,
    cache: WeightCache | None,
    job: ChunkJob,
    threads: int,
) -> tuple[Any, passes.PassProfile | None]:
    """load (``module()``, told as ``loading``) → trace → convert (+ the
    kernel's palettization) → [coremltools' palettization] of the module
    whose forward takes ``function``'s inputs; the model and, with the job's
    ``profile``, its pass profile. Loading and tracing take ``threads``
    torch threads. Only this function holds the module, so its weights go
    as soon as the conversion lets go of them."""
    pal = settings["palettization"]
    if pal is not None and pal["palettizer"] == "coremltools" and int(pal["kmeans_workers"]) > 1:
        # coremltools forks its k-means workers after this, and OpenMP's
        # thread pool does not survive a fork (runtime.configure).
        threads = 1
    with phases("load", loading), torch_threads(threads):
        loaded = module()
    with phases("trace", "trace"), torch_threads(threads):
        traced = trace(loaded, function)
    del loaded
    what, int4 = conversion_phases(settings)
    with phases("convert", what), passes.maybe_profile(job["profile"], probe=True) as profile:
        ml = convert(traced, function, name, settings, cache)
    del traced
    if pal is not None and pal["palettizer"] == "coremltools":
        with phases("palettize", f"palettize ({int4})"):
            ml = palettize(ml, name, pal)
    return ml, profile


def convert_chunk(
    job: ChunkJob, cache: WeightCache, progress: Callable[[str, str], None], threads: int = 1
) -> ConvertedChunk:
    """Every function of one package, each load → trace → convert (+ the
    kernel's palettization) → [coremltools' palettization] → save into its
    path. `progress(function, phase)` is told each phase as it starts; `cache` is the
    build's palettization cache (Rust owns it: one per build); loading and
    tracing take ``threads`` torch threads."""
    chunk, settings = job["chunk"], job["settings"]
    name = chunk["name"]
    functions = chunk["functions"]
    out: list[ConvertedFunction] = []
    for function, path in zip(functions, job["paths"], strict=True):
        phases = _Phases(f"{name}/{function['name']}" if len(functions) > 1 else name, progress)

        def module(function: FunctionPlan = function) -> Chunk:
            return load(job["dims"], chunk, job["checkpoint"], function)

        ml, profile = load_and_convert(phases, module, "load weights", function, name, settings, cache, job, threads)
        with phases("save", "save"):
            stats = save(ml, path)
        del ml
        release_memory()
        seconds = kernel_apart(phases.seconds, stats["palettize_seconds"])
        out.append(
            {
                "name": function["name"],
                "stats": stats,
                "seconds": seconds,
                "passes": profile.stats if profile is not None else None,
            }
        )
    return {"functions": out}
