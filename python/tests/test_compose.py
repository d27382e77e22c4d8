"""chunkforge_py.convert.compose: merged decode packages spliced from the four-chunk
layout's converted ``decode_q1`` programs, run by the MIL interpreter.

Each of the three-, two- and one-chunk layouts' packages is composed from the
four-chunk packages of the shared `build --mode all` (the one the Rust tests
make, `target/tmp/builds/<generation>/default-all`, or CHUNKFORGE_TEST_BUILD;
without one these tests are skipped, as test_mil_interp's are) and checked on
random inputs against

- the four-chunk programs run back to back: bit-exact, since the composed
  program holds the same ops with the same weights (the per-layer cache
  slices read the merged cache at the slot offset, and each cache output is
  one ``stack`` of all the slots); the build's own composed package (the
  build composes these layouts) too, and
- the directly converted package of `build --mode all --no-compose`
  (`default-all-no-compose`, tests/build.rs; CHUNKFORGE_TEST_CONVERTED_BUILD):
  cos >= 0.9999 (its graph passes ran over the whole program, so fp16
  constants and op order could differ; the INT4 weights are the same).

The expected four-chunk chain is worked out here independently of
`compose.plan_wiring`: cache slots through the layout's ``kv_slot_map``
(Rust's), every other tensor by its name.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from chunkforge_py.contract import ChunkPlan, Layout
from chunkforge_py.convert.compose import COMPOSED_FROM, compose, plan_wiring
from chunkforge_py.mil.interp import Interpreter
from chunkforge_py.runtime import ChunkforgeError
from test_mil_interp import random_inputs, shared_build

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CHUNKFORGE_BIN", ROOT / "target" / "release" / "chunkforge"))
TARGETS = ["chunk2_3way", "chunk3_3way", "merged_chunk1", "merged_chunk2", "merged_full"]
CACHE_NAMES = {
    "K_sliding_in": ("sliding", "K_sliding_out"),
    "V_sliding_in": ("sliding", "V_sliding_out"),
    "K_full_in": ("full", "K_full_out"),
    "V_full_in": ("full", "V_full_out"),
}
# A four-chunk input fed by an earlier chunk's output of another name.
FORWARDED = {"hidden_states": "hidden_states_out", "per_layer_combined": "per_layer_combined_out"}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """One torch thread, as the binary runs (see test_mil_interp)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def build() -> dict[str, Any]:
    """`build --mode all` (INT4): tests/common built_all()."""
    return shared_build("CHUNKFORGE_TEST_BUILD", "default-all")


@pytest.fixture(scope="module")
def converted() -> dict[str, Any]:
    """`build --mode all --no-compose`: every layout converted from torch."""
    return shared_build("CHUNKFORGE_TEST_CONVERTED_BUILD", "default-all-no-compose")


def layouts(build: dict[str, Any]) -> dict[str, Layout]:
    """The plan's layouts by kind (``build``: a shared build or `plan_only`'s)."""
    return {lay["kind"]: lay for lay in build["plan"]["layouts"]}


def four_chunks(build: dict[str, Any]) -> list[ChunkPlan]:
    return layouts(build)["four"]["chunks"]


def target_of(build: dict[str, Any], name: str) -> tuple[ChunkPlan, Layout]:
    for lay in layouts(build).values():
        for chunk in lay["chunks"]:
            if chunk["name"] == name:
                return chunk, lay
    raise AssertionError(f"no chunk {name} in the plan")


def sources_of(build: dict[str, Any], target: ChunkPlan) -> list[ChunkPlan]:
    return [c for c in four_chunks(build) if target["first_layer"] <= c["first_layer"] <= target["last_layer"]]


@pytest.fixture(scope="module")
def composed(build: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every merged package composed from the four-chunk packages' default
    function (decode_q1), with its compose result and wall seconds."""
    out_dir = tmp_path_factory.mktemp("composed")
    out: dict[str, Any] = {}
    for name in TARGETS:
        target, _ = target_of(build, name)
        sources = [(str(build["dir"] / f"{c['name']}.mlpackage"), c) for c in sources_of(build, target)]
        path = out_dir / f"{name}.mlpackage"
        started = time.perf_counter()
        result = compose(sources, target, str(path))
        out[name] = {"path": path, "result": result, "seconds": time.perf_counter() - started}
    return out


@pytest.fixture(scope="module")
def four_functions(build: dict[str, Any]) -> dict[str, Any]:
    """The four-chunk packages' decode_q1 functions, prepared once."""
    return {
        c["name"]: Interpreter(str(build["dir"] / f"{c['name']}.mlpackage")).function("decode_q1")
        for c in four_chunks(build)
    }


def run_chain(
    build: dict[str, Any], name: str, inputs: dict[str, np.ndarray], four: dict[str, Any], fp16: bool
) -> dict[str, np.ndarray]:
    """What the four-chunk decode_q1 programs give for the target's inputs, run
    back to back: caches through the layout's kv_slot_map, the rest by name."""
    target, layout = target_of(build, name)
    slot_map = [s for s in layout["kv_slot_map"] if s["to_chunk"] == name]
    outputs: dict[str, np.ndarray] = {}
    carried: dict[str, np.ndarray] = {}
    per_chunk: dict[str, dict[str, np.ndarray]] = {}
    for chunk in sources_of(build, target):
        fn = four[chunk["name"]]
        feed: dict[str, np.ndarray] = {}
        for spec in fn.inputs:
            if spec.name in CACHE_NAMES:
                kind = CACHE_NAMES[spec.name][0]
                cache = np.zeros(spec.shape, np.float16)
                for s in slot_map:
                    if s["attention"] == kind and s["from_chunk"] == chunk["name"]:
                        cache[s["from_slot"]] = inputs[spec.name][s["to_slot"]]
                feed[spec.name] = cache
            elif FORWARDED.get(spec.name, spec.name) in carried:
                feed[spec.name] = carried[FORWARDED.get(spec.name, spec.name)]
            else:
                feed[spec.name] = inputs[spec.name]
        got = fn.run(feed, fp16=fp16)
        per_chunk[chunk["name"]] = got
        carried.update(got)
    for spec in target["functions"][0]["outputs"]:
        name_out = spec["name"]
        found = next((k for k, o in CACHE_NAMES.values() if o == name_out), None)
        if found is None:
            outputs[name_out] = carried[name_out]
            continue
        parts = [s for s in slot_map if s["attention"] == found]
        first = per_chunk[parts[0]["from_chunk"]][name_out]
        cache = np.zeros([len(parts), *first.shape[1:]], first.dtype)
        for s in parts:
            cache[s["to_slot"]] = per_chunk[s["from_chunk"]][name_out][s["from_slot"]]
        outputs[name_out] = cache
    return outputs


def cos(a: np.ndarray, b: np.ndarray) -> float:
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y) + 1e-30))


@pytest.mark.parametrize("name", TARGETS)
def test_composed_equals_the_four_chunk_chain_and_the_direct_package(
    build: dict[str, Any],
    converted: dict[str, Any],
    composed: dict[str, Any],
    four_functions: dict[str, Any],
    name: str,
) -> None:
    target, _ = target_of(build, name)
    fn = Interpreter(str(composed[name]["path"])).function()
    assert [s.name for s in fn.inputs] == [t["name"] for t in target["functions"][0]["inputs"]]
    assert fn.output_names == [t["name"] for t in target["functions"][0]["outputs"]]
    built = Interpreter(str(build["dir"] / f"{name}.mlpackage")).function()
    direct = Interpreter(str(converted["dir"] / f"{name}.mlpackage")).function()
    for seed, fp16 in ((1, False), (2, True)):
        inputs = random_inputs(fn, seed)
        got = fn.run(inputs, fp16=fp16)
        want = run_chain(build, name, inputs, four_functions, fp16)
        from_build = built.run(inputs, fp16=fp16)
        for out, w in want.items():
            # The same ops on the same values: exactly equal.
            assert got[out].dtype == w.dtype and np.array_equal(got[out], w), f"{name} {out} (fp16={fp16})"
            assert np.array_equal(from_build[out], w), f"the build's {name} {out} (fp16={fp16})"
        ref = direct.run(inputs, fp16=fp16)
        for out, r in ref.items():
            if r.dtype == np.int32 or r.size == 1:
                # token_id / token_logit: the same token, its logit close.
                assert np.allclose(got[out].astype(np.float64), r.astype(np.float64), rtol=1e-2, atol=1e-2), out
            else:
                c = cos(got[out], r)
                assert c >= 0.9999, f"{name} {out} (fp16={fp16}): cos {c} against the direct package"


def test_composing_is_fast_and_tags_the_package(composed: dict[str, Any]) -> None:
    from coremltools.models.utils import load_spec

    for name, entry in composed.items():
        spec = load_spec(str(entry["path"]))
        meta = dict(spec.description.metadata.userDefined)
        assert meta[COMPOSED_FROM] == entry["result"]["composed_from"]
        assert "com.github.apple.coremltools.conversion_date" not in meta
        weights = entry["path"] / "Data" / "com.apple.CoreML" / "weights"
        assert sorted(p.name for p in weights.iterdir()) == ["weight.bin"], name
    assert composed["merged_full"]["result"]["composed_from"] == "chunk1,chunk2,chunk3,chunk4"
    assert composed["merged_chunk2"]["result"]["composed_from"] == "chunk3,chunk4"
    # The whole point: no ~95-pass conversion. Generous for a busy machine.
    assert composed["merged_full"]["seconds"] < 15, composed["merged_full"]["seconds"]


def test_the_writer_writes_the_bytes_coremltools_writes(
    build: dict[str, Any], composed: dict[str, Any], tmp_path: Path
) -> None:
    """`compose` finishes and writes the program at the protobuf level
    (dead code, unused inputs, description, weights: `mil_write`). The
    reference is coremltools' own writer: its MIL loader reads the composed
    program, type-checking every op, and ``ct.convert`` serialises it. Every
    file of every composed package must be the same bytes, and its stats the
    same counts."""

    def tree(path: Path) -> dict[str, bytes]:
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}

    for name in TARGETS:
        target, _ = target_of(build, name)
        sources = [(str(build["dir"] / f"{c['name']}.mlpackage"), c) for c in sources_of(build, target)]
        path = tmp_path / f"{name}.mlpackage"
        result = compose(sources, target, str(path), writer="coremltools")
        assert tree(path) == tree(composed[name]["path"]), name
        assert result["stats"] == composed[name]["result"]["stats"], name
        # And the build's own package: composed from its single-function parts.
        assert tree(path) == tree(build["dir"] / f"{name}.mlpackage"), name


def test_the_wiring_of_the_one_chunk_layout(build: dict[str, Any], composed: dict[str, Any]) -> None:
    wiring = composed["merged_full"]["result"]["wiring"]
    assert wiring["hidden_states"] == ["s0.hidden_states"]
    assert wiring["per_layer_raw"] == ["s0.per_layer_raw"]
    assert wiring["K_sliding_in"] == ["s0.K_sliding_in[0:7]", "s1.K_sliding_in[7:12]"]
    assert wiring["K_full_out"] == ["s0.K_full_out[0:1]", "s1.K_full_out[0:2]"]
    assert wiring["hidden_states_out"] == ["s3.hidden_states_out"]
    assert wiring["token_id"] == ["s3.token_id"]


# ---- refusals (from the plan alone: no build needed) ---------------------------


@pytest.fixture(scope="module")
def plan_only() -> dict[str, Any]:
    """`chunkforge plan --mode all --json` of the built-in checkpoint, in a
    shared build's shape (the plan is all the refusals need)."""
    if not BIN.exists():
        pytest.skip(f"{BIN} is missing: run cargo build --release first")
    done = subprocess.run([str(BIN), "plan", "--mode", "all", "--json"], capture_output=True, text=True, check=True)
    return {"plan": json.loads(done.stdout)}


def test_sources_that_do_not_tile_the_target_are_refused(plan_only: dict[str, Any], tmp_path: Path) -> None:
    build = plan_only
    target, _ = target_of(build, "merged_full")
    chunks = four_chunks(build)
    fns = [c["functions"][0] for c in chunks]
    # A gap (chunk3 missing).
    gap = [chunks[0], chunks[1], chunks[3]]
    with pytest.raises(ChunkforgeError, match=r"sources do not tile merged_full \(layers 0-34\).*chunk4 25-34"):
        plan_wiring(gap, [c["functions"][0] for c in gap], target)
    # Out of order.
    swapped = [chunks[1], chunks[0], chunks[2], chunks[3]]
    with pytest.raises(ChunkforgeError, match=r"sources do not tile merged_full"):
        plan_wiring(swapped, [c["functions"][0] for c in swapped], target)
    # compose refuses before reading any package.
    with pytest.raises(ChunkforgeError, match=r"sources do not tile merged_chunk1"):
        compose(
            [("/nonexistent/chunk1.mlpackage", chunks[0])],
            target_of(build, "merged_chunk1")[0],
            str(tmp_path / "x.mlpackage"),
        )
    # The verify functions are not the target's decode function.
    verify = [c["functions"][1] for c in chunks]
    with pytest.raises(ChunkforgeError, match=r"from chunk1/verify_qK \(verify, 3 tokens\)"):
        plan_wiring(chunks, verify, target)
    # A chunk whose hidden state goes nowhere: chunk2 made to hand on none.
    broken = copy.deepcopy(chunks)
    fn2 = broken[1]["functions"][0]
    fn2["outputs"] = [o for o in fn2["outputs"] if o["role"] != "hidden_out"]
    with pytest.raises(ChunkforgeError, match=r"chunk3 input hidden_states \[1, 1, 64\] fp16: chunk2 hands on no"):
        plan_wiring(broken, [c["functions"][0] for c in broken], target)
    # A target input no source reads.
    extra = copy.deepcopy(target)
    extra["functions"][0]["inputs"].append({"name": "stray", "shape": [1], "dtype": "fp16", "role": "token_logit"})
    with pytest.raises(ChunkforgeError, match=r"target input\(s\) stray feed no source input"):
        plan_wiring(chunks, fns, extra)
    # A target output no source makes.
    missing = copy.deepcopy(target_of(build, "merged_chunk2")[0])
    missing["functions"][0]["outputs"].append(
        {"name": "kv13_k", "shape": [1, 1, 512, 32], "dtype": "fp16", "role": "shared_k", "alias": "kv13"}
    )
    with pytest.raises(ChunkforgeError, match=r"target output kv13_k \[1, 1, 512, 32\] fp16 is no source's output"):
        plan_wiring(chunks[2:], [c["functions"][0] for c in chunks[2:]], missing)
