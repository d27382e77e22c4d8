"""Process-wide settings for the embedded interpreter, and the error type whose
message reaches the user verbatim (no exception class name, no traceback)."""

from __future__ import annotations

import logging
import os
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


def versions() -> dict[str, str]:
    """Versions of the Python-side tools, for build.json and `doctor`."""
    import importlib.metadata as md
    import sys

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
