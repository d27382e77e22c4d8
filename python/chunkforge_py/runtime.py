"""Process-wide settings for the embedded interpreter, and the error type whose
message reaches the user verbatim (no exception class name, no traceback)."""

from __future__ import annotations

import functools
import gc
import importlib.abc
import importlib.machinery
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from .contract import ConversionSettings, PackageWriter, PlatformLimits


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


# coremltools' import tries every optional converter's dependency
# (coremltools/_deps): scikit-learn, XGBoost, libsvm, TensorFlow, SciPy and
# transformers. chunkforge converts torch programs only, and importing those
# took 2.8 of coremltools' 3.8 s import on this machine, once per process.
# While coremltools imports, they read as not installed; afterwards they import
# normally (bench palettize's scikit-learn k-means, the transformers oracle).
# coremltools only uses the flags for its scikit-learn / XGBoost / libsvm
# converters and SciPy sparse inputs to `predict`.
COREMLTOOLS_OPTIONAL = (
    "sklearn",
    "xgboost",
    "libsvm",
    "tensorflow",
    "scipy",
    "transformers",
    "torchvision",
    "torchaudio",
    "executorch",
    "torchao",
)


class _LeanLoader(importlib.abc.Loader):
    """coremltools' own loader, run with `COREMLTOOLS_OPTIONAL` hidden."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        import torch  # noqa: F401  (coremltools needs it; imported with its own optional modules)

        hidden = [name for name in COREMLTOOLS_OPTIONAL if name not in sys.modules]
        for name in hidden:
            sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
        try:
            self._inner.exec_module(module)
        finally:
            for name in hidden:
                if name in sys.modules and sys.modules[name] is None:
                    del sys.modules[name]
            module.__loader__ = self._inner
            if module.__spec__ is not None:
                module.__spec__.loader = self._inner
        # torch and coremltools are now a few hundred thousand long-lived
        # objects; frozen, the cycle collector runs of `release_memory` and
        # the release pass no longer walk them after every conversion.
        gc.freeze()


class _LeanCoremltools(importlib.abc.MetaPathFinder):
    """Finds `coremltools` the usual way and wraps its loader in `_LeanLoader`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "coremltools":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LeanLoader(spec.loader)
        return spec


def lean_coremltools_import() -> None:
    """Makes the process's first `import coremltools` skip its optional
    converters' dependencies (see `COREMLTOOLS_OPTIONAL`)."""
    if "coremltools" not in sys.modules and not any(isinstance(f, _LeanCoremltools) for f in sys.meta_path):
        sys.meta_path.insert(0, _LeanCoremltools())


def package_writer(settings: ConversionSettings | None) -> PackageWriter:
    """Who writes bundled and composed packages: ``chunkforge`` (the default:
    `mil_write`, at the protobuf level) or ``coremltools`` (its MIL loader and
    serialiser: ``save_multifunction``, ``ct.convert`` of the loaded program),
    the reference the first must match byte for byte (`bench build
    --compare writer`, python/tests/test_compose.py). The build's settings
    say (Rust reads ``CHUNKFORGE_WRITER`` and sends the field always); no
    settings (a test's compose of loose packages): the default."""
    return settings["writer"] if settings else "chunkforge"


def mil_shortcuts(settings: ConversionSettings) -> bool:
    """Whether a conversion with chunkforge's pass pipeline takes the
    shortcuts through coremltools' own code (`passes.shortcuts`: on, the
    default) or runs coremltools' code for every step (off, the reference the
    first must match byte for byte: `bench build --compare shortcuts`,
    tests/build.rs). The build's settings say (Rust reads
    ``CHUNKFORGE_MIL_SHORTCUTS`` and sends the field always)."""
    return settings["mil_shortcuts"]


def heap_kept() -> bool:
    """Whether this process keeps the memory it frees for its own next
    allocations (`CHUNKFORGE_HEAP=keep`, set by the chunkforge binary after
    configuring glibc's allocator that way: src/heap.rs). A plain Python
    interpreter has glibc's defaults."""
    return os.environ.get("CHUNKFORGE_HEAP") == "keep"


def cores() -> int:
    """The cores this process may run on (its affinity where the OS has
    one, as rayon counts them for the native kernels)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's CPU ops on ``n`` threads inside the block (the build gives a
    conversion every core when it is the only process converting; each
    process runs on one otherwise, `OMP_NUM_THREADS`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(n, 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def temporaries_beside(path: str) -> Iterator[str]:
    """Every temporary file and folder made meanwhile (tempfile's default
    folder: coremltools' temporary packages and weight folders) goes into a
    fresh folder beside ``path``, removed on the way out.

    coremltools removes its temporary packages only at interpreter exit
    (``atexit``), which the embedded interpreter never reaches: each
    conversion left a package under /tmp for good. Beside ``path`` (the run's
    staging folder) they are also on the output's file system, and a killed
    run's are swept with its staging folder."""
    folder = tempfile.mkdtemp(prefix=".tmp-coremltools-", dir=os.path.dirname(os.path.abspath(path)))
    previous = tempfile.tempdir
    tempfile.tempdir = folder
    try:
        yield folder
    except RuntimeError as e:
        full = _out_of_room(folder, e)
        if full is None:
            raise
        raise ChunkforgeError(full) from e
    finally:
        tempfile.tempdir = previous
        shutil.rmtree(folder, ignore_errors=True)


def _out_of_room(folder: str, e: RuntimeError) -> str | None:
    """The user's message when ``e`` is coremltools' failed copy into
    ``folder`` on a full file system, else None.

    coremltools' C++ copy of a temporary package reports a full disk as
    "filesystem error: cannot copy: Input/output error", naming no cause (a
    Python write says ENOSPC itself and passes through). The file system
    counts as full when a file already in ``folder`` could not be written
    again into the space that is left (or less than 1 MiB is left)."""
    if "filesystem error" not in str(e):
        return None
    try:
        free = shutil.disk_usage(folder).free
        largest = max(
            (os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs),
            default=0,
        )
    except OSError:
        return None
    if free >= max(largest, 1 << 20):
        return None
    place = os.path.dirname(folder)
    if os.path.basename(place).startswith(".chunkforge-staging-"):
        place = os.path.dirname(place)  # the output folder the user named
    return (
        f"{place}: No space left on device (coremltools' temporary package did not fit; "
        f"{free // 1024} KiB free): free space on that file system or choose another --output"
    )


def release_memory() -> None:
    """Frees what one conversion, composition or bundle left behind before the
    next starts: MIL programs are reference cycles (ops and their values), so
    a finished one, weights and all, lives until the cycle collector runs.

    With glibc's defaults (the default, `CHUNKFORGE_HEAP=release`, and a
    plain interpreter) the freed heap pages are then returned to the system
    (`malloc_trim`): glibc keeps them mapped otherwise (its mmap threshold
    grows with every large array freed, so later arrays come from the heap),
    1.2 GB between two full-width conversions. With `CHUNKFORGE_HEAP=keep`
    (`heap_kept`) they stay: the next conversion reuses them instead of
    faulting fresh pages in, which costs seconds per GB here, for a higher
    peak (src/heap.rs)."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """glibc's freed heap pages back to the system (`malloc_trim`), unless
    the heap is kept (`CHUNKFORGE_HEAP=keep`); cheap enough to call after
    every chunk call of a parity run (`stepper.schedule`)."""
    if heap_kept():
        return
    trim = malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def malloc_trim() -> Any:
    """glibc's `malloc_trim`, or None where there is none (looked up once:
    `find_library` runs a program)."""
    import ctypes
    import ctypes.util

    libc = ctypes.util.find_library("c")
    if libc is None or not sys.platform.startswith("linux"):
        return None
    return getattr(ctypes.CDLL(libc), "malloc_trim", None)


def versions(packages: list[str]) -> dict[str, str]:
    """Versions of the Python-side tools, for build.json and `doctor`: the
    interpreter's, then those of `packages` (the pinned ones, from Rust)."""
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in packages:
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
