"""Makes `chunkforge_py` importable when pytest runs from the repository root,
and keeps coremltools' temporaries of the tests in the session's own folder."""

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session", autouse=True)
def coremltools_temporaries(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests that call ``ct.convert`` directly get a model backed by a
    temporary package, which coremltools removes only at interpreter exit;
    inside the chunkforge binary that never comes. They go into a folder of
    this session, removed at its end."""
    previous = tempfile.tempdir
    folder = tmp_path_factory.mktemp("coremltools-temporaries")
    tempfile.tempdir = str(folder)
    yield
    tempfile.tempdir = previous
    shutil.rmtree(folder, ignore_errors=True)
