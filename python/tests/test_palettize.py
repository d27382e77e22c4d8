"""Packages built with the Rust palettizer, read back through coremltools.

Builds the default checkpoint with the chunkforge binary (`target/release/chunkforge`,
or $CHUNKFORGE_BIN): `--mode both --no-compose` twice, so the same weights go
through two separate builds, and within each build through the two-chunk and
the one-chunk conversions (composed packages reuse their sources' LUTs: the
cache across conversions is what this exercises). The first build runs in one
process (`--jobs 1`: one cache sees every conversion), the second in two
(`--jobs 2`: each process has its own cache), and both give the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from chunkforge_py.convert.palettize import read_palettized

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CHUNKFORGE_BIN", ROOT / "target" / "release" / "chunkforge"))


def build(out: Path, *extra: str) -> dict:
    assert BIN.exists(), f"{BIN} is missing: run cargo build --release first"
    env = {k: v for k, v in os.environ.items() if k != "GEMMA4_HF_DIR"}
    r = subprocess.run([str(BIN), "build", "--output", str(out), *extra], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "build.json").read_text())


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    a = tmp_path_factory.mktemp("a")
    b = tmp_path_factory.mktemp("b")
    return (
        (a, build(a, "--mode", "both", "--no-compose", "--jobs", "1")),
        (b, build(b, "--mode", "both", "--no-compose", "--jobs", "2")),
    )


def luts(path: Path) -> list[tuple[str, bytes, bytes]]:
    return [(op["name"], op["lut"].tobytes(), op["indices"].tobytes()) for op in read_palettized(str(path))]


def digest(entry: tuple[str, bytes, bytes]) -> str:
    return hashlib.sha256(entry[1] + b"|" + entry[2]).hexdigest()


def test_reads_back_as_4bit_per_grouped_channel_group_32(builds):
    (out, report), _ = builds
    for chunk in report["chunks"]:
        ops = read_palettized(str(out / chunk["package"]))
        assert len(ops) == chunk["projection_ops"] == chunk["palettized_weights"] > 0
        for op in ops:
            assert op["indices_dtype"] == "uint4", op["name"]
            rows = op["indices"].shape[0]
            # One 16-entry LUT per 32 output channels, ones on the weight's other
            # axes: [rows/32, 1, 1, 1, 16, 1] for a [rows, in, 1, 1] conv weight.
            ones = (1,) * (op["indices"].ndim - 1)
            assert op["lut"].shape == (rows // 32, *ones, 16, 1), op["name"]
            assert op["lut"].dtype == np.float16


def test_two_builds_byte_identical_luts_and_indices(builds):
    (a, ra), (b, rb) = builds
    for chunk in ra["chunks"]:
        pa, pb = luts(a / chunk["package"]), luts(b / chunk["package"])
        assert [x[0] for x in pa] == [x[0] for x in pb]
        for x, y in zip(pa, pb, strict=False):
            assert x[1] == y[1] and x[2] == y[2], f"{chunk['name']}: {x[0]} differs between builds"


def test_merged_full_weights_equal_merged_chunks(builds):
    (out, report), _ = builds
    by_name = {c["name"]: luts(out / c["package"]) for c in report["chunks"]}
    full = sorted(digest(e) for e in by_name["merged_full"])
    halves = sorted(digest(e) for e in by_name["merged_chunk1"] + by_name["merged_chunk2"])
    assert full == halves


def test_cache_pays_each_weight_once(builds):
    (_, report), _ = builds
    c = {x["name"]: x for x in report["chunks"]}
    assert report["settings"]["palettization"]["palettizer"] == "chunkforge"
    for half in ("merged_chunk1", "merged_chunk2"):
        assert c[half]["palettize_cache_hits"] == 0
        assert c[half]["palettize_cache_misses"] == c[half]["palettized_weights"]
    full = c["merged_full"]
    assert full["palettize_cache_misses"] == 0
    assert full["palettize_cache_hits"] == full["palettized_weights"]
    assert report["palettize_cache"] == {"hits": full["palettized_weights"], "misses": full["palettized_weights"]}
