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

Results are cached within a build (one build = one interpreter), keyed by
SHA-256 of the fp16 weight bytes, its shape and the settings: `--mode both`
palettizes merged_full's weights (exactly those of merged_chunk1 +
merged_chunk2) once, and because the kernel is deterministic every layout's
copy of a weight is byte-identical. Every layout holds each weight once, so a
build of L layouts uses a weight L times: an entry is dropped after its last
use, and a one-layout build caches (and hashes) nothing. The cache would
otherwise keep one index byte per weight element to the end of the build,
over 2 GB for E2B. (Two different weights with identical bytes share one
entry and use its count up early: later uses recompute them, with the same
result.)
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from .runtime import ChunkforgeError

# Bump when the kernel's output for the same input could change.
KERNEL_VERSION = 2

# key -> [lut, indices, uses left]
_CACHE: dict[str, list[Any]] = {}


def cache_key(weight: np.ndarray, nbits: int, group_size: int) -> str:
    h = hashlib.sha256()
    h.update(f"chunkforge-palette/{KERNEL_VERSION};{weight.dtype.str};{weight.shape};{nbits};{group_size};".encode())
    h.update(np.ascontiguousarray(weight).data)
    return h.hexdigest()


def palettize_weight(
    weight: np.ndarray, nbits: int, group_size: int, name: str, uses: int | None = None
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(lut [groups, 2**nbits] fp16, indices [rows, cols] uint8, cache hit) for one weight.

    `uses`: how many times this build will ask for the weight (its number of
    layouts); the cached result is dropped after the last, and 1 skips the
    cache. None keeps the result for the life of the process.
    """
    import chunkforge_native

    if weight.dtype != np.float16 or weight.ndim != 2:
        raise ChunkforgeError(f"{name}: expected a 2-D float16 weight, got {weight.dtype} {weight.shape}")
    key = cache_key(weight, nbits, group_size) if uses is None or uses > 1 else None
    hit = _CACHE.get(key) if key is not None else None
    if hit is not None:
        if hit[2] is not None:
            hit[2] -= 1
            if hit[2] <= 0:
                del _CACHE[key]
        return hit[0], hit[1], True
    try:
        lut, indices = chunkforge_native.palettize_int4(np.ascontiguousarray(weight), group_size, nbits, name)
    except ValueError as e:
        raise ChunkforgeError(f"palettizing {e}") from None
    # Read-only: cached arrays are shared between packages.
    lut.flags.writeable = False
    indices.flags.writeable = False
    if key is not None:
        _CACHE[key] = [lut, indices, None if uses is None else uses - 1]
    return lut, indices, False


class _Feeder:
    """A coremltools `lut_function` for one weight, handing out our per-group
    results in order, and a check that every group was taken exactly once.

    The kernel runs when coremltools asks for the first group and the feeder
    lets go of the result after the last (coremltools compresses the weights
    one after another), so outside the cache one weight's indices are alive
    at a time rather than the whole package's."""

    def __init__(self, name: str, weight: np.ndarray, nbits: int, group: int, uses: int | None, counts: dict[str, int]):
        self.name, self.weight, self.nbits, self.group, self.uses = name, weight, nbits, group, uses
        self.counts = counts
        self.groups = weight.shape[0] // group
        # First row of each group, to confirm coremltools asks for the groups
        # in the order we computed them.
        self.probe = np.ascontiguousarray(weight[::group, : min(8, weight.shape[1])])
        self.next = 0
        self.result: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, val: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = self.next
        if (
            g >= self.groups
            or val.shape != (self.group, self.weight.shape[1])
            or not np.array_equal(val[0, : self.probe.shape[1]], self.probe[g])
        ):
            raise ChunkforgeError(
                f"{self.name}: coremltools asked for channel group {g} of {self.groups} with shape {val.shape}, "
                "which is not the group palettized for it (coremltools changed how it splits groups?)"
            )
        if self.result is None:
            lut, indices, hit = palettize_weight(self.weight, self.nbits, self.group, self.name, self.uses)
            self.counts["hits" if hit else "misses"] += 1
            self.result = (lut, indices)
        lut, indices = self.result
        self.next = g + 1
        if self.next == self.groups:
            self.result = None
        return lut[g], indices[g * self.group : (g + 1) * self.group].reshape(-1)

    def finished(self) -> None:
        if self.next != self.groups:
            raise ChunkforgeError(f"{self.name}: coremltools used {self.next} of {self.groups} channel groups")


def palettize_model(
    mlmodel: Any, weights: list[tuple[str, tuple[int, ...]]], name: str, settings: dict[str, Any]
) -> tuple[Any, dict[str, int]]:
    """Palettizes the given linear weights (const name, shape) of `mlmodel` with the kernel.

    Returns the palettized model and {"palettize_cache_hits", "palettize_cache_misses"}.
    """
    from coremltools.optimize.coreml import OpPalettizerConfig, OptimizationConfig, palettize_weights

    nbits = int(settings["nbits"])
    group = int(settings["group_size"])
    # Layouts in this build (each holds every weight once); absent: keep all.
    uses = int(settings["layouts"]) if settings.get("layouts") is not None else None
    consts = {}
    for op in mlmodel._mil_program.functions["main"].operations:
        if op.op_type == "const":
            consts[op.name] = op
    configs = {}
    feeders = []
    counts = {"hits": 0, "misses": 0}
    for wname, _shape in dict.fromkeys(weights):
        op = consts.get(wname)
        if op is None:
            raise ChunkforgeError(f"{name}: weight {wname} is not a const in the converted program")
        weight = op.outputs[0].val
        if weight.dtype != np.float16 or weight.ndim != 2:
            raise ChunkforgeError(
                f"{name}: weight {wname}: expected a 2-D float16 weight, got {weight.dtype} {weight.shape}"
            )
        feeder = _Feeder(f"{name}: weight {wname}", weight, nbits, group, uses, counts)
        feeders.append(feeder)
        configs[wname] = OpPalettizerConfig(
            mode="custom",
            lut_function=feeder,
            granularity="per_grouped_channel",
            group_size=group,
            channel_axis=0,
            weight_threshold=0,
        )
    out = palettize_weights(mlmodel, OptimizationConfig(op_name_configs=configs))
    for feeder in feeders:
        feeder.finished()
    return out, {"palettize_cache_hits": counts["hits"], "palettize_cache_misses": counts["misses"]}


def cache_size() -> int:
    return len(_CACHE)


def clear_cache() -> None:
    _CACHE.clear()


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
