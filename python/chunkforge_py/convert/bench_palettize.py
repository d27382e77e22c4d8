"""`chunkforge bench palettize`: the Rust kernel against coremltools, same weights, one run.

Every implementation palettizes the same fp16 matrix (INT4, per_grouped_channel,
32 output channels per LUT) and is timed around the palettization call alone.
coremltools is timed through `palettize_weights.blockwise_compress`, the
function its `palettize_weights` pass calls for every const (the MIL graph
rewrite around it is left out, which only flatters coremltools). The mean
squared error is always that of the dequantized fp16 weight (fp16 LUT entry
per element) against the original, in float64.

coremltools 9.0 ships its own `coremltools._deps.kmeans1d` and uses it for fp16
weights; "without kmeans1d" switches that off so it falls back to
scikit-learn. scikit-learn's k-means deadlocks in forked workers unless
OpenMP is single-threaded, so the two-worker runs get OMP_NUM_THREADS=1; the
one-worker runs do not fork (coremltools runs k-means in-process) and keep
OpenMP's default, all cores, as a user would. Each coremltools measurement
runs in its own plain interpreter process (see `run_coremltools`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from ..contract import BenchArgs, BenchReport, BenchResult
from ..runtime import ChunkforgeError

GROUP = 32
NBITS = 4
# E2B widths: q/k/v/o, gate/up (double-wide MLP: 12288), the 262144-token head.
FULL_SHAPES = [(12288, 1536), (6144, 1536), (2048, 1536), (1536, 2048), (262144, 1536)]
QUICK_SHAPES = [(256, 1536), (128, 2048)]
# scikit-learn runs only on matrices up to this many rows (the head would take hours).
SKLEARN_MAX_ROWS = 12288
# Weight scale: standard deviation 0.02 (variance 4e-4, like trained projections).
WEIGHT_STD = 0.02


def make_weight(shape: tuple[int, int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows, cols = shape
    out = np.empty(shape, dtype=np.float16)
    step = 8192
    for r in range(0, rows, step):
        out[r : r + step] = (rng.standard_normal((min(step, rows - r), cols)) * WEIGHT_STD).astype(np.float16)
    return out


def dequantized_mse(weight: np.ndarray, lut: np.ndarray, indices: np.ndarray, group: int = GROUP) -> float:
    """Mean squared error of `lut[row // group, indices]` against `weight` (float64 sums)."""
    rows = weight.shape[0]
    lut2 = np.asarray(lut).reshape(rows // group, -1)
    total = 0.0
    step = group * 128
    for r in range(0, rows, step):
        idx = np.asarray(indices[r : r + step]).astype(np.intp)
        g = (np.arange(r, min(r + step, rows)) // group)[:, None]
        deq = lut2[g, idx].astype(np.float64)
        total += float(np.sum((deq - weight[r : r + step].astype(np.float64)) ** 2))
    return total / weight.size


def run_chunkforge(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    import chunkforge_native

    t = time.perf_counter()
    lut, indices = chunkforge_native.palettize_int4(weight, GROUP, NBITS)
    return lut, indices, time.perf_counter() - t


class _NoPool:
    """Stands in for coremltools' class-level worker pool once we have closed it
    (its atexit hook calls `.terminate()` on whatever is there)."""

    def terminate(self) -> None:
        pass

    def close(self) -> None:
        pass


def _reset_pool() -> None:
    from coremltools.optimize.coreml._quantization_passes import palettize_weights

    pool = palettize_weights._compress_pool
    if pool is not None and not isinstance(pool, _NoPool):
        pool.terminate()
    palettize_weights._compress_pool = None


def _coremltools_in_process(weight: np.ndarray, workers: int, kmeans1d: bool) -> tuple[np.ndarray, np.ndarray, float]:
    import coremltools.models.neural_network.quantization_utils as qu
    from coremltools.optimize.coreml._quantization_passes import palettize_weights

    saved = qu._HAS_KMEANS1D
    qu._HAS_KMEANS1D = saved and kmeans1d
    # coremltools keeps one class-level pool sized by the first call: start each
    # setting with a fresh one so the worker count is the one asked for.
    _reset_pool()
    try:
        t = time.perf_counter()
        params = palettize_weights.blockwise_compress(weight, "KMEANS", NBITS, [GROUP, 0], num_kmeans_workers=workers)
        seconds = time.perf_counter() - t
    finally:
        qu._HAS_KMEANS1D = saved
        _reset_pool()
        palettize_weights._compress_pool = _NoPool()
    return params.lut, params.indices, seconds


def run_coremltools(weight: np.ndarray, workers: int, kmeans1d: bool) -> tuple[np.ndarray, np.ndarray, float]:
    """coremltools' k-means in a separate, plain Python process of the same
    environment. coremltools forks its k-means workers; forking the chunkforge
    process itself (torch and rayon threads alive) can deadlock the children,
    so the fork happens in a process that only ever ran numpy and coremltools.
    Returns the LUT, indices and the seconds measured inside that process
    around the compression call (interpreter start-up is not counted)."""
    python = os.environ.get("CHUNKFORGE_VENV_PYTHON")
    if not python:
        return _coremltools_in_process(weight, workers, kmeans1d)
    with tempfile.TemporaryDirectory(prefix="chunkforge-bench-") as tmp:
        src = os.path.join(tmp, "weight.npy")
        dst = os.path.join(tmp, "result.npz")
        np.save(src, weight)
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
        if workers > 1:
            # scikit-learn's OpenMP deadlocks in coremltools' forked workers.
            env["OMP_NUM_THREADS"] = "1"
        elif os.environ.get("CHUNKFORGE_OMP_DEFAULTED") == "1":
            # One worker runs k-means in-process: scikit-learn gets OpenMP's
            # default (all cores), as it would for a user.
            env.pop("OMP_NUM_THREADS", None)
        code = (
            "import sys, numpy as np\n"
            "from chunkforge_py.convert.bench_palettize import _coremltools_in_process\n"
            "lut, idx, s = _coremltools_in_process(np.load(sys.argv[1]), int(sys.argv[3]), sys.argv[4] == '1')\n"
            "np.savez(sys.argv[2], lut=lut, indices=idx, seconds=np.array(s))\n"
        )
        proc = subprocess.run(
            [python, "-c", code, src, dst, str(workers), "1" if kmeans1d else "0"],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise ChunkforgeError(f"coremltools benchmark process failed:\n{proc.stderr[-2000:]}")
        with np.load(dst) as r:
            return r["lut"], r["indices"], float(r["seconds"])


def implementations(shape: tuple[int, int]) -> list[tuple[str, Callable[[np.ndarray], Any]]]:
    impls: list[tuple[str, Callable[[np.ndarray], Any]]] = [("chunkforge", run_chunkforge)]
    for w in (1, 2):
        impls.append((f"coremltools-kmeans1d-w{w}", partial(run_coremltools, workers=w, kmeans1d=True)))
    if shape[0] <= SKLEARN_MAX_ROWS:
        for w in (1, 2):
            impls.append((f"coremltools-sklearn-w{w}", partial(run_coremltools, workers=w, kmeans1d=False)))
    return impls


def run(args: BenchArgs) -> BenchReport:
    """Benchmark every implementation on every shape.

    `args`: {"quick": bool, "seed": int, "progress": bool (one stderr line per run)}.
    """
    # coremltools warns once per group when kmeans1d is off; that is the point here.
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    shapes = QUICK_SHAPES if args["quick"] else FULL_SHAPES
    show = args["progress"]
    seed = args["seed"]
    # Imports and first-call set-up (coremltools takes seconds to import) stay
    # out of the timings: every implementation runs once on a tiny weight first.
    tiny = make_weight((GROUP, 64), seed)
    for _impl, fn in implementations((GROUP, 64)):
        fn(tiny)
    results: list[BenchResult] = []
    for i, shape in enumerate(shapes):
        weight = make_weight(shape, seed + i)
        for impl, fn in implementations(shape):
            lut, indices, seconds = fn(weight)
            if show:
                print(f"  {impl:<26} {shape[0]}x{shape[1]}: {seconds:.2f}s", file=sys.stderr, flush=True)
            results.append(
                {
                    "shape": list(shape),
                    "impl": impl,
                    "seconds": seconds,
                    "mse": dequantized_mse(weight, lut, indices),
                    "lut_shape": list(np.shape(lut)),
                }
            )
            del lut, indices
    return {
        "results": results,
        "group_size": GROUP,
        "nbits": NBITS,
        "weight_std": WEIGHT_STD,
        "seed": seed,
    }
