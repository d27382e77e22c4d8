"""The process-wide import set-up of chunkforge_py (runtime.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PYTHON_DIR = Path(__file__).resolve().parents[1]

PROBE = """
import gc, json, sys
if sys.argv[1] == "lean":
    import chunkforge_py  # installs the lean coremltools import
import coremltools
seen = sorted(n for n in ("sklearn", "transformers", "scipy", "xgboost") if n in sys.modules)
frozen = gc.get_freeze_count()
import sklearn.cluster, transformers  # still importable afterwards
print(json.dumps({
    "seen": seen,
    "frozen": frozen,
    "loader": type(coremltools.__spec__.loader).__name__,
    "has_hf": coremltools._deps._HAS_HF,
    "after": "sklearn.cluster" in sys.modules and "transformers" in sys.modules,
}))
"""


def probe(mode: str) -> dict[str, Any]:
    # A fresh interpreter (this one has long imported coremltools), with the
    # packages this one uses: the embedding process's sys.executable may be a
    # different Python than the environment's.
    spec = importlib.util.find_spec("coremltools")
    assert spec is not None and spec.origin is not None
    site = Path(spec.origin).parents[1]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        check=True,
        cwd=PYTHON_DIR,
        env={"PYTHONPATH": os.pathsep.join([str(PYTHON_DIR), str(site)])},
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_coremltools_imports_without_its_optional_converters_dependencies() -> None:
    # The control: a plain `import coremltools` pulls in scikit-learn and
    # transformers (2.8 s of its 3.8 s import on the development machine).
    plain = probe("plain")
    assert "sklearn" in plain["seen"] and "transformers" in plain["seen"]
    assert plain["has_hf"] is True
    lean = probe("lean")
    assert lean["seen"] == []
    assert lean["has_hf"] is False
    # The hiding ends with coremltools' import: both import normally afterwards,
    # and coremltools keeps its own loader.
    assert lean["after"] is True
    assert lean["loader"] == "SourceFileLoader"
    assert isinstance(lean["frozen"], int) and lean["frozen"] > 100_000


def test_the_package_writer_switch(monkeypatch: Any) -> None:
    import pytest
    from chunkforge_py.runtime import WRITER_ENV, ChunkforgeError, package_writer

    monkeypatch.delenv(WRITER_ENV, raising=False)
    assert package_writer() == "chunkforge"
    monkeypatch.setenv(WRITER_ENV, "")
    assert package_writer() == "chunkforge"
    monkeypatch.setenv(WRITER_ENV, "coremltools")
    assert package_writer() == "coremltools"
    monkeypatch.setenv(WRITER_ENV, "protobuf")
    with pytest.raises(ChunkforgeError, match=f"{WRITER_ENV}='protobuf': expected chunkforge or coremltools"):
        package_writer()
