"""The Rust palettization kernel as the conversion code sees it.

These need `chunkforge_native`, which only exists inside the chunkforge binary:
run them with `chunkforge selftest-python python/tests/test_palettize_native.py`
(tests/palettize.rs does). Under a plain `python -m pytest` they are skipped.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest

native = pytest.importorskip("chunkforge_native")

from chunkforge_py.contract import ConversionSettings, FunctionPlan  # noqa: E402
from chunkforge_py.convert import bench_palettize, palettize  # noqa: E402
from chunkforge_py.runtime import ChunkforgeError  # noqa: E402


def weight(rows: int, cols: int, seed: int, std: float = 0.02) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, cols)) * std).astype(np.float16)


@pytest.mark.parametrize("shape", [(64, 96), (128, 257), (32, 1536)])
def test_kernel_mse_not_above_coremltools_kmeans1d(shape):
    w = weight(shape[0], shape[1], seed=shape[1])
    lut, idx = native.palettize_int4(w, 32, 4)
    assert lut.dtype == np.float16 and lut.shape == (shape[0] // 32, 16)
    assert idx.dtype == np.uint8 and idx.shape == shape and idx.max() < 16
    ct_lut, ct_idx, _ = bench_palettize.run_coremltools(w, 1, True)
    ours = bench_palettize.dequantized_mse(w, lut, idx)
    theirs = bench_palettize.dequantized_mse(w, ct_lut, ct_idx)
    assert ours <= theirs * (1 + 1e-9), (ours, theirs)


def test_kernel_beats_scikit_learn():
    w = weight(64, 512, seed=5)
    lut, idx = native.palettize_int4(w, 32, 4)
    sk_lut, sk_idx, _ = bench_palettize.run_coremltools(w, 1, False)
    assert bench_palettize.dequantized_mse(w, lut, idx) < bench_palettize.dequantized_mse(w, sk_lut, sk_idx)


def test_deterministic_and_cached():
    w = weight(96, 200, seed=11)
    a = native.palettize_int4(w, 32, 4)
    b = native.palettize_int4(w.copy(), 32, 4)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    cache = palettize.WeightCache()
    lut1, idx1, hit1 = cache.palettize_weight(w, 4, 32, "w")
    lut2, idx2, hit2 = cache.palettize_weight(w.copy(), 4, 32, "w")
    assert (hit1, hit2) == (False, True)
    assert lut1.tobytes() == a[0].tobytes() and idx2.tobytes() == a[1].tobytes()
    # Different settings are a different cache entry.
    _, _, hit3 = cache.palettize_weight(w, 4, 16, "w")
    assert not hit3


def test_cache_drops_entries_after_their_last_use():
    w = weight(64, 40, seed=12)
    # One layout: nothing is kept.
    one = palettize.WeightCache(uses=1)
    assert one.palettize_weight(w, 4, 32, "w")[2] is False
    assert one.size() == 0
    assert one.palettize_weight(w, 4, 32, "w")[2] is False
    # Three layouts: two hits, then the entry is gone.
    three = palettize.WeightCache(uses=3)
    first = three.palettize_weight(w, 4, 32, "w")
    assert three.size() == 1
    hits = [three.palettize_weight(w.copy(), 4, 32, "w") for _ in range(2)]
    assert [h[2] for h in hits] == [True, True]
    assert all(h[1].tobytes() == first[1].tobytes() for h in hits)
    assert three.size() == 0
    assert three.palettize_weight(w, 4, 32, "w")[2] is False


def test_non_finite_weight_names_weight_and_position():
    w = weight(64, 8, seed=1)
    w[40, 3] = np.inf
    with pytest.raises(ChunkforgeError, match=r"layers\.3\.mlp\.up_proj.*row 40, column 3"):
        palettize.WeightCache().palettize_weight(w, 4, 32, "layers.3.mlp.up_proj")
    w[40, 3] = np.nan
    with pytest.raises(ValueError, match="NaN/Inf"):
        native.palettize_int4(w, 32, 4)


def test_bad_inputs_are_errors():
    w = weight(64, 8, seed=2)
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        native.palettize_int4(w[:48], 32, 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        native.palettize_int4(w[:, ::2], 32, 4)
    with pytest.raises(TypeError):
        native.palettize_int4(w.astype(np.float32), 32, 4)


def test_degenerate_groups_exact():
    w = np.zeros((64, 16), dtype=np.float16)
    w[:32] = 0.5  # all equal
    w[32:] = np.array([-0.0, 0.0, 1e-7, -3.0, 2.0, 6e-8], dtype=np.float16)[np.arange(16) % 6]  # +-0, subnormals
    lut, idx = native.palettize_int4(w, 32, 4)
    assert bench_palettize.dequantized_mse(w, lut, idx) == 0.0
    assert lut[0, 0] == np.float16(0.5) and (idx[:32] == 0).all()


def _traced_linear(w: np.ndarray) -> Any:
    import torch

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).half().eval()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
    return torch.jit.trace(lin, (torch.zeros(1, w.shape[1], dtype=torch.float16),))


def _one_linear_model(
    w: np.ndarray, cache: palettize.WeightCache | None = None, pass_pipeline: str = "chunkforge", traced: Any = None
):
    """A one-linear torch model (`traced`, else traced here) converted like a
    build converts a chunk: with `cache`, palettized by the kernel inside the
    conversion (the shipped settings, INT4 in groups of 32)."""
    from chunkforge_py.convert import chunks as convert

    # A hand-made function: only what `convert` reads.
    function = {
        "inputs": [{"name": "x", "shape": [1, w.shape[1]], "dtype": "fp16"}],
        "outputs": [{"name": "y", "dtype": "fp16"}],
    }
    settings = shipped_settings(quantize=cache is not None)
    settings["pass_pipeline"] = cast(Any, pass_pipeline)
    traced = traced if traced is not None else _traced_linear(w)
    return convert.convert(traced, cast(FunctionPlan, function), "t", settings, cache)


def shipped_settings(quantize: bool) -> ConversionSettings:
    """What `ConversionSettings::shipped` (records.rs) hands Python."""
    return {
        "ctx": 1,
        "minimum_deployment_target": "iOS18",
        "compute_precision": "FLOAT16",
        "compute_units": "CPU_AND_NE",
        "quantize": quantize,
        "pass_pipeline": "chunkforge",
        "compose": True,
        "joint": True,
        "writer": "chunkforge",
        "mil_shortcuts": True,
        "palettization": {
            "nbits": 4,
            "granularity": "per_grouped_channel",
            "group_size": 32,
            "palettizer": "chunkforge",
            "mode": "custom (chunkforge optimal LUT)",
            "kmeans_workers": 1,
        }
        if quantize
        else None,
    }


def test_kernel_palettizes_inside_the_conversion(tmp_path):
    w = weight(96, 64, seed=3)
    ml = _one_linear_model(w, palettize.WeightCache(uses=1))
    stats = ml._chunkforge_palettize_stats
    assert (stats["palettize_cache_hits"], stats["palettize_cache_misses"]) == (0, 1)
    assert stats["palettize_unmatched_groups"] == 0 and stats["palettize_seconds"] > 0
    path = str(tmp_path / "one.mlpackage")
    ml.save(path)
    [op] = palettize.read_palettized(path)
    assert op["indices_dtype"] == "uint4"
    assert op["lut"].shape == (3, 1, 16, 1) and op["lut"].dtype == np.float16
    lut, idx = native.palettize_int4(w, 32, 4)
    np.testing.assert_array_equal(op["lut"].reshape(3, 16), lut)
    np.testing.assert_array_equal(op["indices"], idx)


def test_the_shipped_pipeline_frees_the_torch_weights_during_the_conversion(tmp_path):
    # The torch module's weights are freed once the frontend has its own
    # copies; the palettization still gets every weight (from the program's
    # constants) and the package is the same as coremltools' pipeline makes.
    w = weight(64, 32, seed=27)
    saved = {}
    for pipeline, left in (("chunkforge", 0), ("coremltools", w.size)):
        traced = _traced_linear(w)
        ml = _one_linear_model(w, palettize.WeightCache(uses=1), pipeline, traced)
        assert [p.numel() for p in traced.parameters()] == [left], pipeline
        assert ml._chunkforge_palettize_stats["palettize_unmatched_groups"] == 0
        path = str(tmp_path / f"{pipeline}.mlpackage")
        ml.save(path)
        [op] = palettize.read_palettized(path)
        saved[pipeline] = (op["lut"].tobytes(), op["indices"].tobytes())
    lut, idx = native.palettize_int4(w, 32, 4)
    assert saved["chunkforge"] == saved["coremltools"] == (lut.tobytes(), idx.tobytes())


def test_conversions_count_uses_per_layout():
    w = weight(64, 48, seed=21)
    one, three = palettize.WeightCache(uses=1), palettize.WeightCache(uses=3)

    def run(cache: palettize.WeightCache) -> tuple[int, int]:
        stats = _one_linear_model(w, cache)._chunkforge_palettize_stats
        return stats["palettize_cache_hits"], stats["palettize_cache_misses"]

    # One layout: never cached.
    assert [run(one), run(one)] == [(0, 1), (0, 1)] and one.size() == 0
    # Three layouts: paid once, served twice, then dropped.
    assert [run(three), run(three), run(three)] == [(0, 1), (1, 0), (1, 0)]
    assert three.size() == 0


def test_a_first_group_matching_no_module_tensor_is_palettized_alone():
    # The dispatcher as coremltools drives it, for a weight it cannot match:
    # each group on its own gives the whole-weight result (groups are
    # independent).
    w = weight(96, 40, seed=23)
    d = palettize.Dispatcher("t", 4, 32, None)
    d.add([("other", weight(64, 40, seed=24))])
    got = [d(w[g * 32 : (g + 1) * 32]) for g in range(3)]
    lut, idx = native.palettize_int4(w, 32, 4)
    for g, (glut, gidx) in enumerate(got):
        np.testing.assert_array_equal(glut, lut[g])
        np.testing.assert_array_equal(gidx, idx[g * 32 : (g + 1) * 32].reshape(-1))
    assert d.unmatched_groups == 3 and d.counts == {"hits": 0, "misses": 0}


@pytest.mark.parametrize("shortcuts", ["off", "on"])
def test_several_weights_including_one_sharing_another_ones_first_rows(tmp_path, shortcuts):
    # Group by group (shortcuts off), b's first group matches a: a's result
    # serves it, then b's own groups go alone. Whole weights at once (on,
    # `whole_weight_compression`): each weight is found by its memory, so no
    # group goes alone; the packages are the same.
    import torch
    from chunkforge_py.convert import chunks as convert

    a, b, c = weight(64, 48, seed=31), weight(96, 48, seed=32), weight(32, 48, seed=33)
    b[:32] = a[:32]  # b's first group matches a: a's result serves it, then b's own groups go alone

    class Three(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2, self.l3 = (torch.nn.Linear(48, w.shape[0], bias=False).half() for w in (a, b, c))
            with torch.no_grad():
                for lin, w in zip((self.l1, self.l2, self.l3), (a, b, c), strict=True):
                    lin.weight.copy_(torch.from_numpy(w))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.l1(x), self.l2(x), self.l3(x)

    traced = torch.jit.trace(Three().eval(), (torch.zeros(1, 48, dtype=torch.float16),))
    function = {
        "inputs": [{"name": "x", "shape": [1, 48], "dtype": "fp16"}],
        "outputs": [{"name": f"y{i}", "dtype": "fp16"} for i in range(3)],
    }
    cache = palettize.WeightCache()
    settings = shipped_settings(quantize=True)
    settings["mil_shortcuts"] = shortcuts == "on"
    ml = convert.convert(traced, cast(FunctionPlan, function), "t", settings, cache)
    stats = ml._chunkforge_palettize_stats
    # The indices each op holds: the kernel's (a copy of them with shortcuts off).
    made = [op.indices.val for op in ml._mil_program.functions["main"].find_ops(op_type="constexpr_lut_to_dense")]
    assert len(made) == 3 and all(i.dtype == np.uint8 for i in made)
    assert stats["palettize_unmatched_groups"] == (2 if shortcuts == "off" else 0)
    # Off: a is served twice (once for b's first group), a cache hit.
    assert (stats["palettize_cache_hits"], stats["palettize_cache_misses"]) == ((0, 3) if shortcuts == "on" else (1, 2))
    ml.save(str(tmp_path / "three.mlpackage"))
    ops = {op["indices"].shape: op for op in palettize.read_palettized(str(tmp_path / "three.mlpackage"))}
    assert len(ops) == 3
    for w in (a, b, c):
        lut, idx = native.palettize_int4(w, 32, 4)
        np.testing.assert_array_equal(ops[w.shape]["lut"].reshape(-1, 16), lut)
        np.testing.assert_array_equal(ops[w.shape]["indices"], idx)


def test_kernel_errors_inside_coremltools_name_the_weight():
    w = weight(64, 24, seed=22)
    w[33, 5] = np.inf
    with pytest.raises(ChunkforgeError, match=r"t: weight weight .*row 33, column 5"):
        _one_linear_model(w, palettize.WeightCache(uses=1))


def test_weights_coremltools_cannot_group_are_errors():
    with pytest.raises(ChunkforgeError, match="48 output channels, not a multiple of the palettization group size 32"):
        _one_linear_model(weight(48, 16, seed=25), palettize.WeightCache(uses=1))


def test_a_linear_weight_left_unpalettized_is_an_error():
    # What coremltools would hand back if it skipped a well-shaped weight: the
    # same one-linear model converted without palettization.
    from chunkforge_py.convert import chunks as convert

    ml = _one_linear_model(weight(64, 16, seed=26))
    with pytest.raises(ChunkforgeError, match=r"t: weight .* \(64, 16\) was not palettized by coremltools"):
        convert.check_palettized(ml, "t", 32)


def test_indices_from_a_cached_lut_are_the_kernels():
    # What a cache hit returns: the indices re-derived from the weight and
    # its LUT, byte for byte the kernel's, also for degenerate groups.
    few = np.resize(np.array([-0.5, 0.0, -0.0, 0.75], dtype=np.float16), (64, 24))
    for w in (weight(96, 200, seed=41), few, np.full((32, 8), 0.125, dtype=np.float16)):
        lut, idx = native.palettize_int4(w, 32, 4)
        np.testing.assert_array_equal(native.indices_int4(w, lut, 32, 4), idx)
    w = weight(64, 16, seed=42)
    lut, _ = native.palettize_int4(w, 32, 4)
    with pytest.raises(ValueError, match=r"w \[64, 16\]: a LUT of 16 entries for 2 groups of 16"):
        native.indices_int4(w, lut[:1], 32, 4, "w")
    unsorted = lut.copy()
    unsorted[1] = unsorted[1, ::-1]
    with pytest.raises(ValueError, match=r"w \[64, 16\]: group 1's LUT is not one the kernel made"):
        native.indices_int4(w, unsorted, 32, 4, "w")
    with pytest.raises(ValueError, match="w LUT: indices_int4 needs C-contiguous float16 arrays"):
        native.indices_int4(w, lut[:, ::-1], 32, 4, "w")
    # A LUT of the same size made with other settings: 2 groups of 16 is not 1 of 32.
    with pytest.raises(ValueError, match="w: a LUT of 16 entries per group; nbits 5 needs 32"):
        native.indices_int4(w, lut, 64, 5, "w")
