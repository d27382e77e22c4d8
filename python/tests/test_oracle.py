"""The oracle's memory (parity/oracle.py): its pool of layer buffers keeps
only what it lent, and greedy generation reads the per-layer table's called
rows alone."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from chunkforge_py.checkpoint import Checkpoint
from chunkforge_py.parity.oracle import Buffers, Oracle

BUILTIN = Path(__file__).resolve().parents[2] / "checkpoints" / "default"


def test_buffers_keep_only_what_they_lent() -> None:
    pool = Buffers()
    lent = pool.take((4, 3), torch.float32)
    pool.give(lent)
    assert pool.take((4, 3), torch.float32).data_ptr() == lent.data_ptr()
    # A tensor the pool did not lend (a weight the resident budget holds) is
    # neither kept nor handed out to be written into.
    other = torch.ones(4, 5)
    pool.give(other)
    assert not any(pool.free.values())
    assert pool.take((4, 5), torch.float32).data_ptr() != other.data_ptr()
    assert bool((other == 1).all())


class Counting(Checkpoint):
    """A checkpoint that counts the tensors read whole, by name."""

    def __init__(self, info: Any):
        super().__init__(info)
        self.whole: dict[str, int] = {}

    def get(self, name: str, dtype: torch.dtype | None, share: bool = False, rounded_to: Any = None) -> torch.Tensor:
        self.whole[name] = self.whole.get(name, 0) + 1
        return super().get(name, dtype, share, rounded_to)

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        self.whole[name] = self.whole.get(name, 0) + 1
        return super().read(name, dtype)


def test_generate_reads_called_rows_and_pools_nothing_it_did_not_lend() -> None:
    from safetensors import safe_open

    single = str(BUILTIN / "model.safetensors")
    with safe_open(single, framework="pt") as f:
        names = list(f.keys())
    prefix = next(p for p in ("model.language_model.", "model.", "") if f"{p}embed_tokens.weight" in names)
    ckpt = Counting({"prefix": prefix, "files": dict.fromkeys(names, single)})
    oracle = Oracle(str(BUILTIN / "config.json"), ckpt)
    with open(BUILTIN / "generation_config.json") as f:
        eos = json.load(f).get("eos_token_id")
    from transformers import GenerationConfig

    config = GenerationConfig(eos_token_id=eos)
    prompt = [2, 386, 286, 16, 543, 15, 478, 16, 490, 15]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        margins: list[float] = []
        first = oracle.generate(prompt, 8, config, margins)
        pooled = {k: len(v) for k, v in oracle.buffers.free.items()}
        again = oracle.generate(prompt, 8, config)
    assert first == again and len(first) == 8 and len(margins) == 8
    assert ckpt.whole.get("embed_tokens_per_layer.weight", 0) == 0
    # Every layer call gave back what it took: nothing out on loan, and a
    # second generation leaves the pool as the first did.
    assert not oracle.buffers.lent
    assert {k: len(v) for k, v in oracle.buffers.free.items()} == pooled
