"""Weights made on use (chunkforge_py.weights and its users): the resident
budget, positioned checkpoint reads, streamed projections, the interpreter's
lazy weights and the blockwise dequantization all give exactly the values and
results of holding everything."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from chunkforge_py import weights
from chunkforge_py.checkpoint import Checkpoint
from chunkforge_py.mil import ops as mil_ops
from chunkforge_py.mil import program as mil_program
from chunkforge_py.model import Projection, load_streamed
from chunkforge_py.runtime import ChunkforgeError
from chunkforge_py.weights import Lazy, Resident
from safetensors.torch import save_file

RNG = np.random.default_rng(7)


def test_resident_keeps_what_fits_and_makes_the_rest_again() -> None:
    r = Resident(budget=3 * 4 * 10)
    made: list[str] = []

    def make(name: str, n: int) -> torch.Tensor:
        made.append(name)
        return torch.zeros(n)

    for _ in range(3):
        for name, n in (("a", 10), ("b", 20), ("c", 10)):
            r.get(name, partial(make, name, n))
    # a and b fill the budget and stay; c never fits and is made at each use.
    assert made == ["a", "b", "c", "c", "c"]
    assert r.used == 120
    r.release(lambda key: key != "a")
    assert r.used == 80
    r.get("a", lambda: make("a", 10))
    assert made[-1] == "a"


def checkpoint(tmp_path: Path, dtype: torch.dtype) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    tensors = {
        "model.w": torch.randn(48, 16).to(dtype),
        "model.v": torch.randn(7).to(dtype),
    }
    path = str(tmp_path / f"{dtype}.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return Checkpoint({"prefix": "model.", "files": {k: path for k in tensors}}), tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block", [1 << 22, 5])
def test_positioned_reads_give_what_the_mapping_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, block: int
) -> None:
    monkeypatch.setattr("chunkforge_py.checkpoint.ROUND_BLOCK", block)
    ckpt, tensors = checkpoint(tmp_path, dtype)
    for name in ("w", "v"):
        got = ckpt.read(name, torch.float32)
        assert got.dtype == torch.float32
        assert torch.equal(got, ckpt.get(name, torch.float32))
        assert torch.equal(got, tensors[f"model.{name}"].float())
    with pytest.raises(KeyError, match="model.x is not in the checkpoint"):
        ckpt.read("x", torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [1 << 22, 40])
def test_tables_read_by_rows_are_the_mapped_rows_and_refuse_a_nan_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, block: int
) -> None:
    # An embedding table is read a row per lookup (never mapped) and checked
    # finite whole first, in blocks of rows (40 values: 2 rows of 16 a block).
    monkeypatch.setattr("chunkforge_py.checkpoint.CHECK_BLOCK", block)
    ckpt, tensors = checkpoint(tmp_path, dtype)
    table = ckpt.table("w")
    for i in (0, 1, 31, 47):
        assert table[i].dtype == dtype
        assert torch.equal(table[i], ckpt.get("w", None)[i])
    assert torch.equal(table.take([5, 2, 5]), tensors["model.w"][[5, 2, 5]])

    bad = tensors["model.w"].clone()
    bad[46, 3] = float("nan")
    path = str(tmp_path / "bad.safetensors")
    save_file({"model.w": bad}, path, metadata={"format": "pt"})
    with pytest.raises(ChunkforgeError, match=r"bad.safetensors: weight model.w has 1 NaN/Inf values"):
        Checkpoint({"prefix": "model.", "files": {"model.w": path}}).table("w")


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = Projection(16, 48)
        self.down = Projection(48, 16)
        self.scale = torch.nn.Parameter(torch.ones(16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return self.down.tokens(torch.relu(self.up.tokens(x, t)), t) * self.scale


def test_streamed_projections_compute_what_held_ones_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"up.weight": torch.randn(48, 16), "down.weight": torch.randn(16, 48), "scale": torch.randn(16)}
    held = Two()
    held.load_state_dict({k: v.view(held.state_dict()[k].shape) for k, v in values.items()})
    with torch.device("meta"):
        streamed = Two()
    fetched: list[str] = []

    def fetch(name: str, shape: tuple[int, ...]) -> object:
        def make() -> torch.Tensor:
            fetched.append(name)
            return values[name]

        return make

    load_streamed(streamed, fetch, lambda name: values[name])  # type: ignore[arg-type]
    # The projections hold nothing; the rest is loaded.
    assert streamed.up.weight.is_meta and not streamed.scale.is_meta
    x = torch.randn(1, 5, 16)
    assert torch.equal(streamed(x), held(x))
    assert fetched == ["up.weight", "down.weight"]
    streamed(x)
    assert fetched == ["up.weight", "down.weight"] * 2


def test_uint4_unpacking_is_the_generic_bit_reader() -> None:
    values = RNG.integers(0, 16, 1001).astype(np.uint8)
    packed = np.zeros((values.size + 1) // 2, dtype=np.uint8)
    packed |= values[0::2]
    packed[: values[1::2].size] |= values[1::2] << 4
    fast = mil_program.unpack_bits(packed, 4, False, values.size)
    # The generic path (every other width) on the same bytes.
    bits = np.unpackbits(packed, bitorder="little")[: values.size * 4].reshape(-1, 4)
    generic = (bits << np.arange(4, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)
    assert np.array_equal(fast, values) and np.array_equal(generic, values)


@pytest.mark.parametrize("groups", [(2, 3, 1, 1, 1), (2, 1, 1, 1, 1), (2, 3, 1, 1, 2)])
def test_lut_to_dense_in_blocks_is_the_whole_gather(monkeypatch: pytest.MonkeyPatch, groups: tuple[int, ...]) -> None:
    # (G0, G1, 1, 1, vector): LUTs along two axes, along the first only (the
    # fast path, chunkforge's INT4), and vector LUTs.
    *tiles, vector = groups
    shape = [64, 12 // vector, 1, 1]
    indices = torch.from_numpy(RNG.integers(0, 16, shape).astype(np.uint8))
    lut = torch.randn(*tiles, 16, vector)
    axis = 1 if vector > 1 else None
    whole = mil_ops.lut_to_dense(indices, lut, axis)
    monkeypatch.setattr(mil_ops, "LUT_BLOCK", 7)
    assert torch.equal(mil_ops.lut_to_dense(indices, lut, axis), whole)
    # Element (r, c) takes palette entry indices[r, c] of its block's LUT.
    if vector == 1:
        g1 = 5 * tiles[1] // 12
        assert float(whole[40, 5, 0, 0]) == float(lut[1, g1, 0, 0, int(indices[40, 5, 0, 0]), 0])


@pytest.mark.parametrize("shape", [[64, 12], [96, 5, 1, 1], [32, 1]])
def test_palettes_made_from_stored_nibbles_are_the_unpacked_gather(shape: list[int]) -> None:
    # INT4 per_grouped_channel (palettes along the first axis), indices as the
    # weight file stores them: two a byte, the low nibble first.
    groups = shape[0] // 16
    count = int(np.prod(shape))
    values = RNG.integers(0, 16, count).astype(np.uint8)
    packed = (values[0::2] | (values[1::2] << 4)).astype(np.uint8)
    lut = torch.randn(groups, *[1] * (len(shape) - 1), 16, 1).half().float()
    indices = torch.from_numpy(mil_program.unpack_bits(packed, 4, False, count).reshape(shape))
    made = mil_ops.lut_nibbles_to_dense(packed, shape, lut)
    assert made is not None and made.dtype == torch.float32
    assert torch.equal(made, mil_ops.lut_to_dense(indices, lut, None))
    # Not 16 palettes, a group not starting on a byte, palettes along another
    # axis: not this path (None), the op's own gather runs.
    assert mil_ops.lut_nibbles_to_dense(packed, shape, lut[..., :8, :]) is None
    odd = [3 * groups, 3, *[1] * (len(shape) - 2)]
    assert mil_ops.lut_nibbles_to_dense(packed, odd, lut) is None
    if len(shape) > 2:
        across = torch.randn(groups, 5, 1, 1, 16, 1)
        assert mil_ops.lut_nibbles_to_dense(packed, shape, across) is None


def test_lazy_weights_are_made_through_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "RESIDENT", Resident(budget=0))
    made: list[int] = []

    def make() -> torch.Tensor:
        made.append(1)
        return torch.ones(2, 3)

    lazy = Lazy(("t", 1), make, (2, 3))
    assert lazy.numel() == 6
    assert torch.equal(weights.value_of(lazy), torch.ones(2, 3))
    lazy.get()
    assert len(made) == 2
    assert weights.value_of(5) == 5


def test_checkpoint_fetcher_keys_by_file_name_and_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget = Resident()
    monkeypatch.setattr("chunkforge_py.checkpoint.RESIDENT", budget)
    ckpt, _ = checkpoint(tmp_path, torch.bfloat16)
    a = ckpt.fetcher("w", torch.float32)()
    assert a is ckpt.fetcher("w", torch.float32)()
    assert ckpt.fetcher("w", torch.float16)().dtype == torch.float16
    assert len(budget._held) == 2


def test_relative_mse_in_blocks_is_the_direct_formula(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight past `RELATIVE_MSE_BLOCK` values is summed over blocks of
    rows (one row per block here, and a block not dividing the rows), with
    the direct formula's value."""
    from chunkforge_py.parity import artifacts as parity

    want = torch.from_numpy(RNG.standard_normal((37, 24)).astype(np.float32))
    got = want + torch.from_numpy(RNG.standard_normal((37, 24)).astype(np.float32)) * 0.01
    direct = parity.relative_mse(got, want)
    monkeypatch.setattr(parity, "RELATIVE_MSE_BLOCK", 100)
    for rows_values in (24, 5 * 24, 1 << 22):
        monkeypatch.setattr(parity, "RELATIVE_MSE_ROWS", rows_values)
        assert parity.relative_mse(got, want) == pytest.approx(direct, rel=1e-6)
    assert 5e-5 < direct < 2e-4
