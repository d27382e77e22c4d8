"""chunkforge_py.convert.joint: a unit's functions converted together and split.

One unit of the built-in checkpoint (``chunk4`` with ``decode_q1`` and
``verify_qK``, ``prefill_chunk4`` with ``prefill_b512``: the head, KV-shared
layers and the ``update_mask`` input no op reads) is converted both ways, INT4
with the Rust kernel, and each function's package from the joint conversion
is checked against the package of its own conversion:

- the MIL interpreter gives the same bits for every output, on random inputs;
- the same ops of each type, the same inputs and outputs, the same weight
  bytes; and bundled as the build bundles them, the packages hold the same
  weight file byte for byte.

Runs inside the binary, where ``chunkforge_native`` (the kernel) exists:
tests/build.rs `joint_conversion_python_tests_pass_inside_the_binary`, which
also makes the shared build it reads the plan and checkpoint from.
"""

from __future__ import annotations

import glob
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from chunkforge_py.contract import ChunkJob, ChunkPlan, ConversionSettings
from chunkforge_py.mil import names as mil_names
from chunkforge_py.mil import write as mil_write
from chunkforge_py.mil.interp import Interpreter
from chunkforge_py.runtime import ChunkforgeError
from test_mil_interp import one_thread, random_inputs, shared_build  # noqa: F401 (one_thread: autouse)

# What a name of the joint program starts with when it comes from a function's input or output.
PREFIXED = re.compile(r"f\d+__")

native = pytest.importorskip("chunkforge_native", reason="the Rust kernel exists inside the chunkforge binary only")


def checkpoint_info(build: dict[str, Any]) -> Any:
    from safetensors import safe_open

    folder = build["checkpoint"]["dir"]
    files = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            files.update({name: path for name in f.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    return {"prefix": build["checkpoint"]["tensor_prefix"], "files": files}


def unit(build: dict[str, Any], name: str) -> list[ChunkPlan]:
    """The four-chunk chunk ``name`` and its prefill partner."""
    chunks = {(lay["kind"], c["name"]): c for lay in build["plan"]["layouts"] for c in lay["chunks"]}
    return [chunks[("four", name)], chunks[("prefill", f"prefill_{name}")]]


def jobs(build: dict[str, Any], chunks: list[ChunkPlan], out: Path, tag: str) -> list[ChunkJob]:
    # build.json leaves out the writer and the shortcuts at their defaults; the seam sends them.
    recorded = json.loads((build["dir"] / "build.json").read_text())["settings"]
    settings = cast(ConversionSettings, {"writer": "chunkforge", "mil_shortcuts": True, **recorded})
    ckpt = checkpoint_info(build)
    return [
        {
            "dims": build["dims"],
            "chunk": c,
            "checkpoint": ckpt,
            "settings": settings,
            "paths": [str(out / f"{tag}-{c['name']}-{f['name']}.mlpackage") for f in c["functions"]],
            "profile": False,
        }
        for c in chunks
    ]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from chunkforge_py.convert.joint import convert_jobs
    from chunkforge_py.convert.palettize import WeightCache

    build = shared_build("CHUNKFORGE_TEST_BUILD", "default-all")
    out = tmp_path_factory.mktemp("joint")
    chunks = unit(build, "chunk4")
    together, alone = jobs(build, chunks, out, "joint"), jobs(build, chunks, out, "alone")
    phases: list[tuple[str, str]] = []

    def progress(function: str, what: str) -> None:
        phases.append((function, what))

    # Where coremltools would leave its temporary packages without
    # runtime.temporaries_beside: the embedded interpreter never runs atexit.
    sentinel = tmp_path_factory.mktemp("tempdir")
    previous, tempfile.tempdir = tempfile.tempdir, str(sentinel)
    try:
        replies = {
            "joint": convert_jobs(together, True, 2, WeightCache(1), progress),
            "alone": convert_jobs(alone, False, 1, WeightCache(3), progress),
        }
    finally:
        tempfile.tempdir = previous
    left = {"tempdir": sorted(os.listdir(sentinel)), "out": sorted(os.listdir(out))}
    return {
        "build": build,
        "jobs": {"joint": together, "alone": alone},
        "replies": replies,
        "phases": phases,
        "left": left,
    }


def test_no_temporary_is_left_behind(converted: dict[str, Any]) -> None:
    paths = [os.path.basename(p) for js in converted["jobs"].values() for j in js for p in j["paths"]]
    assert converted["left"] == {"tempdir": [], "out": sorted(paths)}


def functions(c: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(function name, joint part, separate part) of every function of the unit."""
    out = []
    for a, b in zip(c["jobs"]["joint"], c["jobs"]["alone"], strict=True):
        for f, pa, pb in zip(a["chunk"]["functions"], a["paths"], b["paths"], strict=True):
            out.append((f["name"], pa, pb))
    return out


def test_each_function_computes_the_same_bits_as_its_own_conversion(converted: dict[str, Any]) -> None:
    for name, joint, alone in functions(converted):
        a, b = Interpreter(joint).function(), Interpreter(alone).function()
        for seed in (0, 1):
            inputs = random_inputs(b, seed)
            ra, rb = a.run(inputs, fp16=True), b.run(inputs, fp16=True)
            assert sorted(ra) == sorted(rb), name
            for k in rb:
                assert np.array_equal(ra[k], rb[k], equal_nan=True), f"{name}: {k} differs (seed {seed})"


def test_each_function_holds_the_ops_and_interface_of_its_own_conversion(converted: dict[str, Any]) -> None:
    for name, joint, alone in functions(converted):
        sa, sb = mil_write.read_spec(joint), mil_write.read_spec(alone)
        assert list(sa.mlProgram.functions) == ["main"], name
        fa, fb = sa.mlProgram.functions["main"], sb.mlProgram.functions["main"]
        ba, bb = fa.block_specializations[fa.opset], fb.block_specializations[fb.opset]
        assert mil_write.op_counts(ba) == mil_write.op_counts(bb), name
        assert list(ba.outputs) == list(bb.outputs), name
        assert [i.SerializeToString() for i in fa.inputs] == [i.SerializeToString() for i in fb.inputs], name
        assert sa.description.SerializeToString(deterministic=True) == sb.description.SerializeToString(
            deterministic=True
        ), name
        # The input no op reads (update_mask of a KV-shared chunk) is consumed
        # as coremltools consumes it.
        assert sorted(o.name for op in ba.operations for o in op.outputs if o.name.endswith("_tmp")) == sorted(
            o.name for op in bb.operations for o in op.outputs if o.name.endswith("_tmp")
        ), name
        # No name keeps a function's prefix.
        from chunkforge_py.convert.joint import all_ops

        names = [o.name for op in ba.operations for o in op.outputs] + [i.name for i in fa.inputs]
        names += [op.attributes["name"].immediateValue.tensor.strings.values[0] for op in all_ops(ba)]
        assert not [n for n in names if PREFIXED.match(n)], name
        # Its names are canonical, as those of its own conversion.
        for spec in (sa, sb):
            again = type(spec)()
            again.CopyFrom(spec)
            mil_names.canonicalize(again)
            assert again.SerializeToString(deterministic=True) == spec.SerializeToString(deterministic=True), name
    # Not the same bytes: the joint program's op names differ (the trace
    # numbers them over every function).
    name, joint, alone = functions(converted)[1]
    assert Path(joint, mil_write.SPEC_REL).read_bytes() != Path(alone, mil_write.SPEC_REL).read_bytes()


def test_stats_and_bundles_match_the_conversions_one_by_one(converted: dict[str, Any], tmp_path: Path) -> None:
    from chunkforge_py.convert.chunks import combine

    joint, alone = converted["replies"]["joint"], converted["replies"]["alone"]
    for ja, jb in zip(joint, alone, strict=True):
        for fa, fb in zip(ja["functions"], jb["functions"], strict=True):
            assert fa["name"] == fb["name"]
            for key in ("mil_ops", "op_counts", "weight_bytes", "palettized_weights", "projection_ops"):
                assert fa["stats"][key] == fb["stats"][key], (fa["name"], key)
    # Every weight palettized once, by the one conversion: its first function
    # carries the kernel's counts and the conversion's seconds.
    first = joint[0]["functions"][0]
    assert first["stats"]["palettize_cache_misses"] == first["stats"]["palettized_weights"]
    assert set(first["seconds"]) >= {"load", "trace", "convert", "palettize", "save"}
    rest = [f for j in joint for f in j["functions"]][1:]
    assert all(f["seconds"] == {} and f["stats"]["palettize_cache_misses"] == 0 for f in rest)
    # Bundled: the same weight file, byte for byte.
    for tag in ("joint", "alone"):
        units = converted["jobs"][tag]
        parts = [(p, f["name"]) for j in units for f, p in zip(j["chunk"]["functions"], j["paths"], strict=True)]
        targets = [
            (str(tmp_path / tag / f"{j['chunk']['name']}.mlpackage"), [f["name"] for f in j["chunk"]["functions"]])
            for j in units
        ]
        os.makedirs(tmp_path / tag)
        combine(parts, targets)
    for j in converted["jobs"]["joint"]:
        name = f"{j['chunk']['name']}.mlpackage"
        a = (tmp_path / "joint" / name / mil_write.WEIGHTS_REL).read_bytes()
        b = (tmp_path / "alone" / name / mil_write.WEIGHTS_REL).read_bytes()
        assert a == b, name


def test_progress_names_the_unit_once(converted: dict[str, Any]) -> None:
    joint = [what for function, what in converted["phases"] if function == "chunk4 + prefill_chunk4"]
    assert joint[0] == "load weights (once for 3 functions)"
    assert joint[-1] == "save, split into 3 functions"


def test_chunks_of_different_layers_are_refused(tmp_path: Path) -> None:
    from chunkforge_py.convert.joint import convert_jobs

    build = shared_build("CHUNKFORGE_TEST_BUILD", "default-all")
    a = jobs(build, unit(build, "chunk3"), tmp_path, "x")[0]
    b = jobs(build, unit(build, "chunk4"), tmp_path, "y")[1]
    with pytest.raises(ChunkforgeError, match="hold different layers"):
        convert_jobs([a, b], True, 1, None, lambda *_: None)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())
