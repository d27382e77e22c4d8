"""A package compiled to the `.mlmodelc` the app downloads.

Two writers (``req["writer"]``):

- ``chunkforge`` (any platform): ``mil.modelc`` writes ``model.mil`` (text
  MIL, ``program(1.3)``), ``coremldata.bin``, ``metadata.json`` and
  ``analytics/coremldata.bin`` from the package's spec file, each text
  parsed back and required to be the package's program; the weights are the
  package's blob, which Rust links or streams into place (never read here).
- ``coremltools`` (macOS only): ``MLModel(pkg).get_compiled_model_path()``,
  as upstream does (text MIL; ``xcrun coremlcompiler compile`` writes a
  binary ``model.mil`` that the iPhone rejects and that the app's
  downloader cannot read for its context check, RUNTIME.md "The
  downloader"); the reference.
- ``check`` (macOS only): both, compared file by file (`modelc.compare_dirs`);
  the first difference is an error, else coremltools' files are kept.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from .. import contract
from ..mil import modelc
from ..runtime import ChunkforgeError

WEIGHTS = "weights/weight.bin"


def compile_package(req: contract.CompileRequest) -> contract.CompileReply:
    """Compiles ``req["package"]`` into the new folder ``req["output"]``
    (``req["files"]`` of the compiled model); says which were absent."""
    writer = req["writer"]
    if writer == "chunkforge":
        written = modelc.write_compiled(req["package"], req["output"], req["name"])
        absent = [f for f in req["files"] if f not in written]
        return {"output": req["output"], "written": written, "absent": absent, "coremltools": coremltools_version()}
    if writer not in ("coremltools", "check"):
        raise ChunkforgeError(f"unknown compile writer {writer!r}")
    if sys.platform != "darwin":
        raise ChunkforgeError(f"compiling with Core ML's compiler needs macOS; this is {sys.platform}")
    reply = with_coremltools(req)
    if writer == "check":
        with tempfile.TemporaryDirectory(prefix="chunkforge-check-") as tmp:
            ours = os.path.join(tmp, "ours.mlmodelc")
            modelc.write_compiled(req["package"], ours, req["name"])
            _, spec_path = modelc.read_model_spec(req["package"])
            blob = os.path.join(os.path.dirname(spec_path), WEIGHTS)
            diff = modelc.compare_dirs(ours, req["output"], req["files"], {WEIGHTS: blob})
        if diff:
            raise ChunkforgeError(
                f"compile --check: {req['package']}: chunkforge's compiled files differ from Core ML's: {diff}"
            )
    return reply


def coremltools_version() -> str:
    import coremltools as ct

    return str(ct.__version__)


def with_coremltools(req: contract.CompileRequest) -> contract.CompileReply:
    import coremltools as ct

    package = Path(req["package"])
    model = ct.models.MLModel(str(package), compute_units=ct.ComputeUnit.CPU_ONLY)
    compiled = Path(model.get_compiled_model_path())
    out = Path(req["output"])
    if out.exists():
        raise ChunkforgeError(f"{out}: already exists")
    written: list[str] = []
    absent: list[str] = []
    for rel in req["files"]:
        src = compiled / rel
        if not src.is_file():
            absent.append(rel)
            continue
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        written.append(rel)
    return {"output": str(out), "written": written, "absent": absent, "coremltools": ct.__version__}
