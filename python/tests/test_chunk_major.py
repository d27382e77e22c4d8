"""Parity's chunk-major order (`stepper.schedule`): a layout run chunk by
chunk over every teacher-forced step computes, bit for bit, what it computes
step by step, and a model larger than the resident budget has each chunk's
weights made once for all the steps instead of once per step."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Hashable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from chunkforge_py import weights
from chunkforge_py.checkpoint import Checkpoint
from chunkforge_py.emulate.stepper import ORDER_ENV, Embeddings, LayoutRunner
from chunkforge_py.model import Projection
from chunkforge_py.weights import Resident
from test_mil_interp import build, layout  # noqa: F401 (the shared build fixture)


def test_a_new_working_set_takes_the_room_of_earlier_ones_least_recently_used_first() -> None:
    r = Resident(budget=4 * 30)
    made: list[str] = []

    def make(name: str) -> torch.Tensor:
        made.append(name)
        return torch.zeros(10)

    def use(*names: str) -> None:
        for name in names:
            r.get(name, partial(make, name))

    use("a", "b", "c", "a")
    r.next_set()
    # d takes the room of b (a was used after it); a and c stay.
    use("d", "a", "c", "d")
    assert made == ["a", "b", "c", "d"]
    # Within a working set nothing is evicted: b is made at each use.
    use("b", "b")
    assert made[-2:] == ["b", "b"] and r.used == 120
    r.next_set()
    # A weight that cannot fit even when every earlier one goes evicts none.
    r.get("big", lambda: torch.zeros(40))
    assert r.used == 120
    assert sorted(str(k) for k in r._held) == ["a", "c", "d"]


def test_a_weight_made_while_passing_is_not_kept_and_release_lets_go_by_key() -> None:
    r = Resident(budget=1000)
    made: list[str] = []

    def make(name: str) -> torch.Tensor:
        made.append(name)
        return torch.zeros(10)

    def use(name: str) -> None:
        r.get(name, partial(make, name))

    use("a")
    with r.passing():
        # Held weights are still given; new ones are made for this use only.
        use("a")
        use("b")
        use("b")
    assert made == ["a", "b", "b"] and r.used == 40
    use("b")
    assert made[-1] == "b" and r.used == 80
    r.release(lambda key: key != "a")
    assert r.used == 40 and list(r._held) == ["b"]


def checkpoint_of(built: dict[str, Any]) -> Checkpoint:
    """The shared build's checkpoint, as Rust hands it to Python."""
    info = built["checkpoint"]
    files = {}
    for name in info["weights"]["files"]:
        path = Path(info["dir"]) / name
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        files.update({t: str(path) for t in header if t != "__metadata__"})
    return Checkpoint({"prefix": info["tensor_prefix"], "files": files})


def counting(monkeypatch: pytest.MonkeyPatch, budget: int) -> Counter[Hashable]:
    """A fresh resident budget that counts how often each weight is made."""
    made: Counter[Hashable] = Counter()
    resident = Resident(budget=budget)
    get = resident.get

    def counted(key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        def making() -> torch.Tensor:
            made[key] += 1
            return make()

        return get(key, making)

    monkeypatch.setattr(resident, "get", counted)
    monkeypatch.setattr(weights, "RESIDENT", resident)
    monkeypatch.setattr("chunkforge_py.checkpoint.RESIDENT", resident)
    return made


@pytest.mark.parametrize("kind", ["four", "two"])
def test_chunk_major_is_step_major_bit_for_bit_and_reads_each_chunk_once(
    build: dict[str, Any],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    dims, lay = build["dims"], layout(build, kind)
    ckpt = checkpoint_of(build)
    emb = Embeddings(dims, ckpt)
    prompt = [(7 * t + 3) % dims["vocab_size"] for t in range(12)]
    k = next(f["tokens"] for f in lay["chunks"][0]["functions"] if f["kind"] == "verify") if kind == "four" else 0

    # Room for the largest chunk's weights, not for the whole model's.
    budget = biggest_chunk_bytes(LayoutRunner(dims, lay, ckpt))

    def run(order: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Counter[Hashable]]:
        monkeypatch.setenv(ORDER_ENV, order)
        made = counting(monkeypatch, budget)
        runner = LayoutRunner(dims, lay, ckpt)
        decoded = runner.steps(emb, prompt[:4], 0, keep_caches_after=1)
        kept = runner.kept_caches
        decoded += runner.steps(emb, prompt[4:], 4)
        verified = []
        if k:
            runner.reset()
            runner.verify_modules(ckpt)
            verified = runner.verify_blocks(emb, prompt, len(prompt), k)
        return decoded, [kept, *verified], made

    step_major, step_extra, step_made = run("step")
    chunk_major, chunk_extra, chunk_made = run("chunk")
    assert_same(step_major, chunk_major)
    assert_same(step_extra, chunk_extra)
    # The kept caches are those after step 1, not the last ones.
    assert not all(torch.equal(a, b) for a, b in zip(cache_values(chunk_extra[0]), cache_values(LayoutRunner(
        dims, lay, ckpt).caches), strict=True))  # fmt: skip
    # Chunk by chunk, every weight is made exactly once per run of steps
    # (three here: 4 steps, 8 steps, the verify blocks), whatever the
    # weights' sizes. Step-major makes the same weights, and one the budget
    # cannot hold beside the other chunks' at every step (4 + 8 decode steps,
    # and the verify calls).
    runs = 3 if k else 2
    assert set(chunk_made) == set(step_made)
    assert set(chunk_made.values()) == {runs}, Counter(chunk_made.values())
    assert max(step_made.values()) >= len(prompt), Counter(step_made.values())


def biggest_chunk_bytes(runner: LayoutRunner) -> int:
    """The fp32 bytes of the streamed weights of the layout's largest chunk."""
    return max(
        sum(4 * m.weight.numel() for m in mod.modules() if isinstance(m, Projection)) for mod in runner.modules.values()
    )


def cache_values(caches: Any) -> list[torch.Tensor]:
    return [caches[c][key] for c in sorted(caches) for key in sorted(caches[c], key=str)]


def assert_same(xs: list[Any], ys: list[Any]) -> None:
    """Equal results, tensors bit for bit."""
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert_equal(x, y)


def assert_equal(x: Any, y: Any) -> None:
    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y)
    elif isinstance(x, dict):
        assert list(x) == list(y)
        for key in x:
            assert_equal(x[key], y[key])
    elif isinstance(x, list):
        assert_same(x, y)
    else:
        assert x == y


def test_checkpoint_rows_are_the_whole_tensors_rows_and_give_the_same_relative_mse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chunkforge_py.checkpoint import Checkpoint as Ckpt
    from chunkforge_py.parity import artifacts as parity_run
    from safetensors.torch import save_file

    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_file({"model.w": torch.randn(70, 9).to(torch.bfloat16)}, str(path))
    ckpt = Ckpt({"prefix": "model.", "files": {"model.w": str(path)}})
    whole = ckpt.read("w", torch.float32)
    assert torch.equal(ckpt.read_rows("w", 10, 31, torch.float32), whole[10:31])
    fetch = ckpt.fetcher("w", torch.float32)
    got = whole + 0.01 * torch.randn(70, 9)
    direct = parity_run.relative_mse(got, whole)
    assert parity_run.relative_mse(got, fetch.rows) == direct
    # The blockwise sum over rows, from the file and from the tensor.
    monkeypatch.setattr(parity_run, "RELATIVE_MSE_BLOCK", 100)
    monkeypatch.setattr(parity_run, "RELATIVE_MSE_ROWS", 40)
    blocks = parity_run.relative_mse(got, whole)
    assert parity_run.relative_mse(got, fetch.rows) == blocks
    assert abs(blocks - direct) < 1e-6 * direct
