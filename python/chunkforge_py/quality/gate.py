"""The source's side of the free-running gate (`run --against-source`):
transformers' greedy generation on the source checkpoint, with the source's
top-2 margin at every generated token. The release's side is `run` itself;
Rust compares the two streams and writes the transcript (src/gate.rs)."""

from __future__ import annotations

import os
import time

from ..checkpoint import Checkpoint
from ..contract import SourceGreedy, SourceGreedyRequest
from ..parity.oracle import Oracle


def source_greedy(req: SourceGreedyRequest) -> SourceGreedy:
    """transformers' ``generate(do_sample=False)`` of ``max_tokens`` tokens
    after ``prompt_ids``, in fp32 with eager attention, with the checkpoint's
    generation config (its end-of-text ids), as `Oracle.generate` runs it."""
    from transformers import GenerationConfig

    started = time.perf_counter()
    oracle = Oracle(req["config_path"], Checkpoint(req["checkpoint"]))
    folder = os.path.dirname(req["config_path"])
    config = None
    if os.path.exists(os.path.join(folder, "generation_config.json")):
        config = GenerationConfig.from_pretrained(folder)
    margins: list[float] = []
    ids = oracle.generate(list(req["prompt_ids"]), req["max_tokens"], config, margins=margins)
    return {"generated_ids": ids, "margins": margins, "seconds": time.perf_counter() - started}
