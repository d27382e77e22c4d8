"""transformers' own greedy ``generate`` on a checkpoint, timed: the other
side of ``chunkforge bench run``.

    python -m chunkforge_py.emulate.transformers_generate HF_DIR IDS N

``IDS``: the prompt's token ids, comma-separated; ``N``: tokens to
generate. The model is ``AutoModelForCausalLM.from_pretrained`` with its
weights in bfloat16, as the checkpoint stores them, and sdpa attention, on
all cores: the way a user runs a Gemma 4 checkpoint on a CPU with
transformers. Prints one JSON line: the generated ids, the seconds to load,
the prompt's prefill (until the first token) and the decode rate after it.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from typing import Any


class Clock:
    """A generate streamer that notes when each new token arrives (the
    first call is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.calls = 0

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls > 1:
            self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[2].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    hf_dir, ids, n = argv[0], [int(t) for t in argv[1].split(",") if t], int(argv[2])
    warnings.filterwarnings("ignore")
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    loaded = time.perf_counter()
    clock = Clock()
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            streamer=clock,
        )
    generated = [int(t) for t in out[0, len(ids) :]]
    first = clock.times[0] if clock.times else time.perf_counter()
    decode = clock.times[-1] - first if len(clock.times) > 1 else 0.0
    print(
        json.dumps(
            {
                "prompt_ids": ids,
                "generated_ids": generated,
                "load_seconds": loaded - started,
                "prefill_seconds": first - t0,
                "decode_seconds": decode,
                "decode_tokens_per_second": (len(clock.times) - 1) / decode if decode > 0 else 0.0,
                "threads": torch.get_num_threads(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
