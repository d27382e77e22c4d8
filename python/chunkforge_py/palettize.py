"""INT4 per_grouped_channel palettization through chunkforge's Rust kernel.

The kernel (`chunkforge_native.palettize_int4`, registered by the chunkforge
binary before the interpreter starts) computes, for every group of 32 output
channels, the least-squares 16-entry fp16 LUT and 4-bit indices. This module
hands exactly those to coremltools through its public API:
`OpPalettizerConfig(mode="custom", lut_function=...)`, one config per weight
(`OptimizationConfig.op_name_configs`, keyed by the weight's const name), with
`granularity="per_grouped_channel"`, `group_size=32`, `channel_axis=0`. In
custom mode coremltools splits the weight into its channel groups, calls
`lut_function(group)` for each in order and expects `(lut[16], indices)` back;
it then builds the same `constexpr_lut_to_dense` op (iOS18: lut
`[rows/32, 1, 16, 1]`, uint4 indices) as its own k-means mode. So the package
is the kind coremltools would write, with our LUT in it unchanged. (The
alternative, snapping the weight to the LUT and using mode "unique", would
let coremltools re-derive and re-order the table and re-scan every group.)

Every result is cached for the life of the process (one build = one
interpreter), keyed by SHA-256 of the fp16 weight bytes, its shape and the
settings: `--mode both` palettizes merged_full's weights (exactly those of
merged_chunk1 + merged_chunk2) once, and because the kernel is deterministic
every layout's copy of a weight is byte-identical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .runtime import ChunkforgeError

# Bump when the kernel's output for the same input could change.
KERNEL_VERSION = 2

_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def cache_key(weight: np.ndarray, nbits: int, group_size: int) -> str:
    h = hashlib.sha256()
    h.update(f"chunkforge-palette/{KERNEL_VERSION};{weight.dtype.str};{weight.shape};{nbits};{group_size};".encode())
    h.update(np.ascontiguousarray(weight).data)
    return h.hexdigest()


def palettize_weight(weight: np.ndarray, nbits: int, group_size: int, name: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """(lut [groups, 2**nbits] fp16, indices [rows, cols] uint8, cache hit) for one weight."""
    import chunkforge_native

    if weight.dtype != np.float16 or weight.ndim != 2:
        raise ChunkforgeError(f"{name}: expected a 2-D float16 weight, got {weight.dtype} {weight.shape}")
    key = cache_key(weight, nbits, group_size)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit[0], hit[1], True
    try:
        lut, indices = chunkforge_native.palettize_int4(np.ascontiguousarray(weight), group_size, nbits, name)
    except ValueError as e:
        raise ChunkforgeError(f"palettizing {e}") from None
    # Read-only: cached arrays are shared between packages.
    lut.flags.writeable = False
    indices.flags.writeable = False
    _CACHE[key] = (lut, indices)
    return lut, indices, False


def _feeder(
    name: str, weight: np.ndarray, lut: np.ndarray, indices: np.ndarray, group: int
) -> tuple[Callable, Callable[[], None]]:
    """A coremltools `lut_function` handing out our per-group results in order,
    and a check that every group was taken exactly once."""
    groups = lut.shape[0]
    # First row of each group, to confirm coremltools asks for the groups in
    # the order we computed them.
    probe = np.ascontiguousarray(weight[::group, : min(8, weight.shape[1])])
    state = {"next": 0}

    def lut_function(val: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = state["next"]
        if (
            g >= groups
            or val.shape != (group, weight.shape[1])
            or not np.array_equal(val[0, : probe.shape[1]], probe[g])
        ):
            raise ChunkforgeError(
                f"{name}: coremltools asked for channel group {g} of {groups} with shape {val.shape}, "
                "which is not the group palettized for it (coremltools changed how it splits groups?)"
            )
        state["next"] = g + 1
        return lut[g], indices[g * group : (g + 1) * group].reshape(-1)

    def finished() -> None:
        if state["next"] != groups:
            raise ChunkforgeError(f"{name}: coremltools used {state['next']} of {groups} channel groups")

    return lut_function, finished


def palettize_model(
    mlmodel: Any, weights: list[tuple[str, tuple[int, ...]]], name: str, settings: dict[str, Any]
) -> tuple[Any, dict[str, int]]:
    """Palettizes the given linear weights (const name, shape) of `mlmodel` with the kernel.

    Returns the palettized model and {"palettize_cache_hits", "palettize_cache_misses"}.
    """
    from coremltools.optimize.coreml import OpPalettizerConfig, OptimizationConfig, palettize_weights

    nbits = int(settings["nbits"])
    group = int(settings["group_size"])
    consts = {}
    for op in mlmodel._mil_program.functions["main"].operations:
        if op.op_type == "const":
            consts[op.name] = op
    configs = {}
    checks = []
    hits = misses = 0
    for wname, _shape in dict.fromkeys(weights):
        op = consts.get(wname)
        if op is None:
            raise ChunkforgeError(f"{name}: weight {wname} is not a const in the converted program")
        weight = op.outputs[0].val
        lut, indices, hit = palettize_weight(weight, nbits, group, f"{name}: weight {wname}")
        hits += hit
        misses += not hit
        fn, done = _feeder(wname, weight, lut, indices, group)
        checks.append(done)
        configs[wname] = OpPalettizerConfig(
            mode="custom",
            lut_function=fn,
            granularity="per_grouped_channel",
            group_size=group,
            channel_axis=0,
            weight_threshold=0,
        )
    out = palettize_weights(mlmodel, OptimizationConfig(op_name_configs=configs))
    for done in checks:
        done()
    return out, {"palettize_cache_hits": hits, "palettize_cache_misses": misses}


def cache_size() -> int:
    return len(_CACHE)


def read_palettized(path: str) -> list[dict[str, Any]]:
    """Every `constexpr_lut_to_dense` of a saved package, read back through
    coremltools: {"name", "lut" (np), "indices" (np), "indices_dtype" (MIL type name)}."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as load_milproto
    from coremltools.converters.mil.mil import types

    model = ct.models.MLModel(path, skip_model_load=True)
    spec = model.get_spec()
    prog = load_milproto(spec, spec.specificationVersion, file_weights_dir=model.weights_dir)
    out = []
    for op in prog.functions["main"].operations:
        if op.op_type == "constexpr_lut_to_dense":
            out.append(
                {
                    "name": op.name,
                    "lut": np.asarray(op.lut.val),
                    "indices": np.asarray(op.indices.val),
                    "indices_dtype": types.builtin_to_string(op.indices.dtype),
                    "lut_dtype": types.builtin_to_string(op.lut.dtype),
                }
            )
    return out
