"""A package compiled to the `.mlmodelc` the app downloads (macOS only).

Upstream compiles with coremltools' ``MLModel(pkg).get_compiled_model_path()``,
which writes text MIL (``program(1.3)``); ``xcrun coremlcompiler compile``
writes a binary ``model.mil`` that the iPhone rejects and that the app's
downloader cannot read for its context check (RUNTIME.md, "The downloader").
Only the files the app requests are laid out (Rust passes the list).

This cannot run on Linux: Core ML's compiler is part of macOS.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .. import contract
from ..runtime import ChunkforgeError


def compile_package(req: contract.CompileRequest) -> contract.CompileReply:
    """Compiles ``req["package"]`` and copies ``req["files"]`` of the compiled
    model into the new folder ``req["output"]``; says which were absent."""
    if sys.platform != "darwin":
        raise ChunkforgeError(f"compiling .mlmodelc needs macOS (Core ML's compiler); this is {sys.platform}")
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
