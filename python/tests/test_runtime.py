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


def test_a_full_disk_under_the_temporaries_is_named(tmp_path: Path) -> None:
    """coremltools' C++ copy says "Input/output error" when the disk is full:
    temporaries_beside names the cause when a file already written there could
    not be written again into the space left, and passes other errors on."""
    import shutil

    import pytest
    from chunkforge_py.runtime import ChunkforgeError, temporaries_beside

    out = tmp_path / "out"
    staging = out / ".chunkforge-staging-1-2"
    staging.mkdir(parents=True)
    copy_failed = RuntimeError("filesystem error: cannot copy: Input/output error [a] [b]")

    # Room enough: the error is passed on untouched, and the folder is gone.
    with pytest.raises(RuntimeError, match="Input/output error"), temporaries_beside(str(staging / "x")) as folder:
        (Path(folder) / "small.mlmodel").write_bytes(b"0" * 1024)
        raise copy_failed
    assert os.listdir(staging) == []

    # A (sparse) file larger than the free space: the disk counts as full, and
    # the message names the output folder, not the staging folder.
    free = shutil.disk_usage(staging).free
    with pytest.raises(ChunkforgeError) as caught, temporaries_beside(str(staging / "x")) as folder:
        with open(Path(folder) / "big.mlmodel", "wb") as f:
            f.truncate(free + (1 << 30))
        raise copy_failed
    assert str(caught.value).startswith(f"{out}: No space left on device")
    assert caught.value.__cause__ is copy_failed
    assert os.listdir(staging) == []

    # Not a file-system error: never reported as a full disk.
    with pytest.raises(ValueError), temporaries_beside(str(staging / "x")) as folder:
        with open(Path(folder) / "big.mlmodel", "wb") as f:
            f.truncate(free + (1 << 30))
        raise ValueError("bad weight")
