"""INT4 per_grouped_channel palettization through chunkforge's Rust kernel.

The kernel (`chunkforge_native.palettize_int4`, registered by the chunkforge
binary before the interpreter starts) computes, for every group of 32 output
channels, the least-squares 16-entry fp16 LUT and 4-bit indices. This module
hands exactly those to coremltools through its public API, during
conversion: `ct.convert(pass_pipeline=...)` with the default pipeline plus
coremltools' `compression::palettize_weights` pass appended last
(`PassPipeline.append_pass`; its config through `set_options`, the way
`PassPipeline.DEFAULT_PALETTIZATION` sets it), configured
with `OpPalettizerConfig(mode="custom", lut_function=...)` for projection weights,
`granularity="per_grouped_channel"`, `group_size=32`, `channel_axis=0`. In
custom mode coremltools splits each weight into its channel groups, calls
`lut_function(group)` for each in order and expects `(lut[16], indices)` back;
it then builds the same `constexpr_lut_to_dense` op (iOS18: lut
`[rows/32, 1, 16, 1]`, uint4 indices) as its own k-means mode. So the package
is the kind coremltools would write, with our LUT in it unchanged. (The
alternative, snapping the weight to the LUT and using mode "unique", would
let coremltools re-derive and re-order the table and re-scan every group.)
Running the pass inside the conversion, rather than `palettize_weights` on the
converted model, saves a second pass pipeline and serialization of the whole
program, which is most of the palettization time at small widths.

Results are cached within a build (one build = one interpreter), keyed by
SHA-256 of the fp16 weight bytes, its shape and the settings: `--mode both`
palettizes merged_full's weights (exactly those of merged_chunk1 +
merged_chunk2) once, and because the kernel is deterministic every layout's
copy of a weight is byte-identical. The cache holds only the LUTs (2**nbits
fp16 entries per group: 32 bytes per 32 rows at the defaults): a later use
re-derives the indices from the weight and its LUT (`indices_int4`, one
cheap pass that gives the kernel's indices byte for byte), where keeping the
indices would hold one byte per weight element, about 1.9 GB for E2B's projection
weights, through the next layout's conversion. Every layout holds
each weight once, so a build of L layouts uses a weight L times: an entry is
dropped after its last use, and a one-layout build caches (and hashes)
nothing. (Two different weights with identical bytes share one entry and use
its count up early: later uses recompute them, with the same result.)
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..contract import Palettization, PalettizeStats
from ..mil.inspect import PROJECTION_OPS
from ..runtime import ChunkforgeError
from .passes import replaced

# Bump when the kernel's output for the same input could change.
KERNEL_VERSION = 2


def cache_key(weight: np.ndarray, nbits: int, group_size: int) -> str:
    """`weight` must be C-contiguous."""
    h = hashlib.sha256()
    h.update(f"chunkforge-palette/{KERNEL_VERSION};{weight.dtype.str};{weight.shape};{nbits};{group_size};".encode())
    h.update(weight.data)
    return h.hexdigest()


class WeightCache:
    """One build's palettization results (module docstring). The Rust build
    loop makes one per build and hands it to every conversion, so its
    lifetime is the build's.

    `uses`: how many conversions of the build hold each weight (its layouts'
    functions); an entry is dropped after its last use, and 1 caches (and
    hashes) nothing. None keeps entries until the cache is dropped."""

    def __init__(self, uses: int | None = None):
        self.uses = uses
        # key -> [lut, uses left]
        self._entries: dict[str, list[Any]] = {}

    def size(self) -> int:
        return len(self._entries)

    def palettize_weight(
        self, weight: np.ndarray, nbits: int, group_size: int, name: str
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """(lut [groups, 2**nbits] fp16, indices [rows, cols] uint8, cache hit) for one weight."""
        import chunkforge_native

        if weight.dtype != np.float16 or weight.ndim != 2:
            raise ChunkforgeError(f"{name}: expected a 2-D float16 weight, got {weight.dtype} {weight.shape}")
        weight = np.ascontiguousarray(weight)
        uses = self.uses
        key = cache_key(weight, nbits, group_size) if uses is None or uses > 1 else None
        hit = self._entries.get(key) if key is not None else None
        try:
            if hit is not None and key is not None:
                if hit[1] is not None:
                    hit[1] -= 1
                    if hit[1] <= 0:
                        del self._entries[key]
                lut = hit[0]
                return lut, chunkforge_native.indices_int4(weight, lut, group_size, nbits, name), True
            lut, indices = chunkforge_native.palettize_int4(weight, group_size, nbits, name)
        except ValueError as e:
            raise ChunkforgeError(f"palettizing {e}") from None
        # Read-only: a cached LUT is shared between packages.
        lut.flags.writeable = False
        if key is not None:
            self._entries[key] = [lut, None if uses is None else uses - 1]
        return lut, indices, False


def as_matrix(t: np.ndarray) -> np.ndarray:
    """A 1x1 convolution's [out, in, 1, 1] weight (or a group of its rows;
    [out, in, 1] once coremltools has made it a 1-D convolution) as the
    [out, in] matrix it is; any other array as it is. The palettization is
    per output channel, so both views give the same LUTs and indices."""
    if t.ndim > 2 and all(d == 1 for d in t.shape[2:]):
        return t.reshape(t.shape[0], t.shape[1])
    return t


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shapes and float16 bit patterns (numpy compares float16 values
    slowly, in float32)."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


class _Feeder:
    """One weight's results, handed out group by group in order. The kernel
    (or, on a cache hit, the index pass) runs when the first group is asked
    for and the feeder lets go of the result after the last (coremltools
    compresses the weights one after another), so one weight's indices are
    alive at a time rather than the whole package's."""

    def __init__(
        self, name: str, weight: np.ndarray, nbits: int, group: int, cache: WeightCache, counts: dict[str, int]
    ):
        self.name, self.weight, self.nbits, self.group, self.cache = name, weight, nbits, group, cache
        self.counts = counts
        self.groups = weight.shape[0] // group
        self.next = 0
        self.result: tuple[np.ndarray, np.ndarray] | None = None

    def rows(self, g: int) -> slice:
        return slice(g * self.group, (g + 1) * self.group)

    def takes(self, val: np.ndarray) -> bool:
        """Whether `val` is, bit for bit, this weight's next group: only then
        is our result for that group the right one for it."""
        return self.next < self.groups and _same_bits(val, self.weight[self.rows(self.next)])

    def done(self) -> bool:
        return self.next == self.groups

    def serve(self) -> tuple[np.ndarray, np.ndarray]:
        """The next group's LUT and flat indices."""
        if self.result is None:
            lut, indices, hit = self.cache.palettize_weight(self.weight, self.nbits, self.group, self.name)
            self.counts["hits" if hit else "misses"] += 1
            self.result = (lut, indices)
        lut, indices = self.result
        g = self.next
        self.next += 1
        if self.done():
            self.result = None
        return lut[g], indices[self.rows(g)].reshape(-1)


def _head_key(group: np.ndarray) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(group, dtype=np.float16).data).digest() + repr(group.shape).encode()


class Dispatcher:
    """The `lut_function` of a conversion's palettization pass (every linear
    weight shares one config there, so the pass does not name the weight).

    A group that is not the next one of the weight in progress is a weight's
    first channel group: it is matched by content against the program's
    projection weights (`add`: the pass `chunkforge::palettize_sources`
    hands them over just before the palettization pass, as fp16 constants of
    the program itself, so the torch module's copy need not outlive the
    frontend), and that weight's `_Feeder` (kernel on the
    whole weight, the build cache) serves its groups, each checked bit for
    bit against the tensor. (A weight matched by its first group only, when
    another tensor starts with the same rows, thus starts over at the first
    group that differs; every group served before was equal, so stays
    right.) A group that matches nothing is palettized on its own: groups
    are independent, so the result is the same, only without the cache and
    the threads (counted in `unmatched_groups`).

    Only linear weights are configured: a const that also fed another op (a
    tied embedding's gather, which no chunk holds) would make coremltools
    refuse the config as a conflict."""

    def __init__(self, name: str, nbits: int, group: int, cache: WeightCache | None):
        self.name, self.nbits, self.group = name, nbits, group
        # No build cache: every weight is palettized for this conversion only.
        self.cache = cache if cache is not None else WeightCache(uses=1)
        self.heads: dict[bytes, list[tuple[str, np.ndarray]]] = {}
        self.feeder: _Feeder | None = None
        self.counts = {"hits": 0, "misses": 0}
        self.unmatched_groups = 0
        self.seconds = 0.0

    def add(self, tensors: list[tuple[str, np.ndarray]]) -> None:
        """Weights the groups coremltools passes may come from (name, array)."""
        group = self.group
        for tname, t in tensors:
            t = as_matrix(t)
            if t.ndim == 2 and t.dtype == np.float16 and t.shape[0] >= group and t.shape[0] % group == 0:
                self.heads.setdefault(_head_key(t[:group]), []).append((tname, t))

    def release(self) -> None:
        """Lets go of the weights once the palettization pass has run."""
        self.heads.clear()
        self.feeder = None

    def _match(self, head: np.ndarray) -> _Feeder | None:
        for tname, t in self.heads.get(_head_key(head), []):
            if _same_bits(t[: self.group], head):
                return _Feeder(f"{self.name}: weight {tname}", t, self.nbits, self.group, self.cache, self.counts)
        return None

    def __call__(self, val: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        started = time.perf_counter()
        try:
            if val.dtype != np.float16:
                raise ChunkforgeError(f"{self.name}: coremltools passed a {val.dtype} weight group; expected float16")
            val = as_matrix(val)
            if self.feeder is None or not self.feeder.takes(val):
                self.feeder = self._match(val)
            if self.feeder is None:
                self.unmatched_groups += 1
                label = f"{self.name}: a weight group"
                lut, indices, _ = WeightCache(uses=1).palettize_weight(val, self.nbits, self.group, label)
                return lut[0], indices.reshape(-1)
            out = self.feeder.serve()
            if self.feeder.done():
                self.feeder = None
            return out
        finally:
            self.seconds += time.perf_counter() - started

    def whole(self, weight: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(lut [groups, 2**nbits], indices [rows, cols] uint8) of a whole
        weight at once, when `weight` is one of the program's weights this
        dispatcher was given (the same memory, so the same bits) and is
        grouped as ours are; None otherwise (its groups then come one by one
        through `__call__`). The LUT and indices are those `__call__` serves
        group by group, from the same kernel and cache."""
        started = time.perf_counter()
        try:
            if group != self.group or weight.dtype != np.float16:
                return None
            matrix = as_matrix(weight)
            if matrix.ndim != 2 or matrix.shape[0] < group or matrix.shape[0] % group != 0:
                return None
            address = matrix.__array_interface__["data"][0]
            for tname, t in self.heads.get(_head_key(matrix[:group]), []):
                if (
                    t.__array_interface__["data"][0] == address
                    and t.shape == matrix.shape
                    and t.strides == matrix.strides
                ):
                    label = f"{self.name}: weight {tname}"
                    lut, indices, hit = self.cache.palettize_weight(t, self.nbits, group, label)
                    self.counts["hits" if hit else "misses"] += 1
                    return lut, indices
            return None
        finally:
            self.seconds += time.perf_counter() - started

    def stats(self) -> PalettizeStats:
        return {
            "palettize_cache_hits": self.counts["hits"],
            "palettize_cache_misses": self.counts["misses"],
            "palettize_unmatched_groups": self.unmatched_groups,
            "palettize_seconds": self.seconds,
        }


def weight_label(const: str) -> str:
    """A projection weight's name for messages: its constant's name without
    the suffixes coremltools' passes add (``layers_3_mlp_up_proj_weight`` for
    ``layers_3_mlp_up_proj_weight_to_fp16``, or ``..._promoted_to_fp16`` from
    an fp16 trace)."""
    for suffix in ("_to_fp16", "_promoted"):
        const = const.removesuffix(suffix)
    return const


def program_weights(prog: Any) -> list[tuple[str, np.ndarray]]:
    """(name, value) of every constant weight feeding a projection in `prog`."""
    out = []
    for func in prog.functions.values():
        for op in func.operations:
            if op.op_type in PROJECTION_OPS:
                w = op.weight
                if w.op is not None and w.op.op_type == "const" and isinstance(w.val, np.ndarray):
                    out.append((weight_label(w.op.name), w.val))
    return out


_SOURCES_PASS = "chunkforge::palettize_sources"


def _register_sources_pass() -> None:
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY, register_pass

    if _SOURCES_PASS in PASS_REGISTRY:
        return

    @register_pass(namespace="chunkforge")
    class palettize_sources(AbstractGraphPass):
        """Hands the program's projection weights to the conversion's `Dispatcher`
        (option `dispatcher`); changes nothing in the program."""

        def __init__(self) -> None:
            self.dispatcher: Dispatcher | None = None

        def apply(self, prog: Any) -> None:
            if self.dispatcher is not None:
                self.dispatcher.add(program_weights(prog))


@contextmanager
def whole_weight_compression(dispatcher: Dispatcher | None) -> Iterator[None]:
    """Within the block, coremltools' grouped-channel palettization of a
    weight the `dispatcher` holds (`Dispatcher.whole`) takes its LUTs and
    indices for the whole weight at once, instead of calling the dispatcher
    once per group of 32 rows and stacking the results.

    coremltools' custom mode (`grouped_channelwise_compress`) splits the
    weight into its groups, calls `lut_function` on each (our dispatcher
    serves each from one kernel call on the whole weight, after checking the
    group's bits against it) and stacks the per-group LUTs and indices into
    new arrays (`np.stack`, then a copy to the indices' dtype): 30 thousand
    calls, a compare of every weight and two copies of its indices per
    full-width `--mode four` build (4 s of its conversions, cProfile). Here
    the result is built from the kernel's arrays: `LutParams(indices
    reshaped to the weight's shape, LUTs reshaped to [groups, 1, ..., 16,
    1], None)`, the values, dtypes and shapes coremltools builds. Any call
    it does not cover (another mode or dispatcher, vector or non-zero-axis
    palettization, a weight the dispatcher does not hold) runs
    coremltools' own code; so does every call with `dispatcher` None.

    The pass then makes the `constexpr_lut_to_dense` op of those indices
    (`_construct_constexpr_lut_op`), first copying them to the dtype of
    the LUT's bit width (iOS18: uint4, numpy's uint8 tagged as uint4), the
    same bytes (2.9 s per full-width `--mode four`). For the uint8 indices
    served here, the op is made of a view of them under that dtype, with the
    inputs coremltools passes (`mb.constexpr_lut_to_dense(indices, lut[,
    vector_axis][, name][, before_op])`): the same values and dtype, in an
    array nothing else holds."""
    if dispatcher is None:
        yield
        return
    from coremltools.converters.mil._deployment_compatibility import AvailableTarget
    from coremltools.converters.mil.frontend import _utils as frontend_utils
    from coremltools.converters.mil.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.block import is_current_opset_version_compatible_with
    from coremltools.optimize import _utils as optimize_utils
    from coremltools.optimize.coreml._quantization_passes import palettize_weights

    original = palettize_weights.__dict__["grouped_channelwise_compress"]
    # The indices array last served (the pass makes its op next).
    served_indices: list[np.ndarray] = []

    def grouped_channelwise_compress(
        original_data: np.ndarray,
        mode: str,
        nbits: int | None,
        channel_axis: int,
        channel_group_size: int,
        lut_function: Any = None,
        cluster_dim: int = 1,
        num_kmeans_workers: int = 1,
    ) -> Any:
        served = None
        if (
            lut_function is dispatcher
            and mode.upper() == "CUSTOM"
            and cluster_dim == 1
            and isinstance(original_data, np.ndarray)
            and original_data.ndim >= 1
            and channel_axis in (0, -original_data.ndim)
            and nbits in (None, dispatcher.nbits)
        ):
            # Group size 0: the whole axis is one group (coremltools' rule).
            served = dispatcher.whole(original_data, channel_group_size or original_data.shape[0])
        if served is None:
            return original.__func__(
                original_data,
                mode,
                nbits,
                channel_axis,
                channel_group_size,
                lut_function,
                cluster_dim,
                num_kmeans_workers,
            )
        lut, indices = served
        lut_shape = [lut.shape[0]] + [1] * (original_data.ndim - 1) + [lut.shape[1], 1]
        shaped = np.ascontiguousarray(indices).reshape(original_data.shape)
        served_indices[:] = [shaped]
        return optimize_utils.LutParams(shaped, np.array(lut).reshape(lut_shape), None)

    original_construct = frontend_utils.__dict__["_construct_constexpr_lut_op"]

    def construct_constexpr_lut_op(
        indices: Any, lut: Any, vector_axis: Any = None, name: str | None = None, before_op: Any = None
    ) -> Any:
        ours = bool(served_indices) and indices is served_indices[0]
        served_indices.clear()
        if ours and isinstance(lut, np.ndarray) and is_current_opset_version_compatible_with(AvailableTarget.iOS18):
            # uint8 tagged as the bit width's type (numpy dtype metadata).
            wanted = types.nptype_from_builtin(types.string_to_builtin(f"uint{int(math.log2(lut.shape[-2]))}"))
        else:
            wanted = None
        if wanted is not None and indices.dtype == np.uint8 and np.dtype(wanted) == np.uint8:
            # `astype(wanted)` of uint8 indices is the same bytes under the
            # tagged dtype: a view of them gives that without the copy.
            kwargs: dict[str, Any] = {"indices": indices.view(wanted), "lut": lut}
            if vector_axis is not None:
                kwargs["vector_axis"] = vector_axis
            if name is not None:
                kwargs["name"] = name
            if before_op is not None:
                kwargs["before_op"] = before_op
            return mb.constexpr_lut_to_dense(**kwargs)
        return original_construct(indices, lut, vector_axis, name=name, before_op=before_op)

    try:
        with (
            replaced(palettize_weights, grouped_channelwise_compress=staticmethod(grouped_channelwise_compress)),
            replaced(frontend_utils, _construct_constexpr_lut_op=construct_constexpr_lut_op),
        ):
            yield
    finally:
        served_indices.clear()


def conversion_pipeline(pipeline: Any, name: str, settings: Palettization, cache: WeightCache | None) -> Dispatcher:
    """Appends coremltools' palettization pass last to `pipeline` (ct.convert's
    pass pipeline, `passes.pipeline`; public API: `PassPipeline.append_pass`,
    and `set_options` for its config, as `PassPipeline.DEFAULT_PALETTIZATION`
    sets it), in custom mode with our LUTs, for every linear weight, after
    `chunkforge::palettize_sources`, which gives the dispatcher the weights.
    Palettizing during conversion spares the program a second trip through
    the pipeline and serialization, which is what `palettize_weights` on a
    converted model costs."""
    from coremltools.optimize.coreml import OpPalettizerConfig, OptimizationConfig

    nbits = int(settings["nbits"])
    group = int(settings["group_size"])
    dispatcher = Dispatcher(name, nbits, group, cache)
    op_config = OpPalettizerConfig(
        mode="custom",
        lut_function=dispatcher,
        granularity=settings["granularity"],
        group_size=group,
        channel_axis=0,
        weight_threshold=0,
    )
    config = OptimizationConfig(op_type_configs={op: op_config for op in PROJECTION_OPS})
    _register_sources_pass()
    pipeline.append_pass(_SOURCES_PASS)
    pipeline.set_options(_SOURCES_PASS, {"dispatcher": dispatcher})
    pipeline.append_pass("compression::palettize_weights")
    pipeline.set_options("compression::palettize_weights", {"config": config})
    return dispatcher


def read_palettized(path: str) -> list[dict[str, Any]]:
    """Every `constexpr_lut_to_dense` of a saved package, read back through
    coremltools: {"name", "lut" (np), "indices" (np), "indices_dtype" (MIL type name)}."""
    from coremltools.converters.mil.mil import types

    from ..mil.inspect import read_package

    _, prog, default = read_package(path)
    out = []
    for op in prog.functions[default].operations:
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
