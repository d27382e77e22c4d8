"""Process-wide settings for the embedded interpreter, and the error type whose
message reaches the user verbatim (no exception class name, no traceback)."""

from __future__ import annotations

import logging
import os
import sys
import warnings

from .contract import PlatformLimits


class ChunkforgeError(Exception):
    """An error already phrased for the user: what failed, on which file or weight, what to do."""


VERBOSE = False


def configure(verbose: bool) -> None:
    """Quiet coremltools / torch progress bars and warnings unless ``verbose``."""
    global VERBOSE
    VERBOSE = verbose
    if not verbose:
        # tqdm reads TQDM_* environment variables as defaults (tqdm >= 4.66).
        os.environ["TQDM_DISABLE"] = "1"
        warnings.filterwarnings("ignore")
        for name in ("coremltools", "torch", "transformers"):
            logging.getLogger(name).setLevel(logging.ERROR)
    # Deterministic, bounded CPU use: coremltools' k-means workers deadlock in
    # forked processes with multi-threaded OpenMP.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def release_memory() -> None:
    """Frees what one conversion, composition or bundle left behind before the
    next starts: MIL programs are reference cycles (ops and their values), so
    a finished one, weights and all, lives until the cycle collector runs;
    and glibc keeps freed heap pages mapped (its mmap threshold grows with
    every large array freed, so later arrays come from the heap). On a
    full-width E2B build that is 1.2 GB still resident between conversions;
    each conversion's peak comes on top of it."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None and sys.platform.startswith("linux"):
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)


def versions() -> dict[str, str]:
    """Versions of the Python-side tools, for build.json and `doctor`."""
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "coremltools", "transformers", "numpy", "safetensors", "scikit-learn"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def platform_limits() -> PlatformLimits:
    """What coremltools can and cannot do on this platform."""
    import platform

    mac = platform.system() == "Darwin"
    return {
        "system": platform.system(),
        "machine": platform.machine(),
        "can_predict": mac,
        "can_compile_mlmodelc": mac,
        "can_load_compute_plan": mac,
    }
