"""The built-in default checkpoint, trained: how ``checkpoints/default/`` was made.

    cd python && nice -n 10 "$(chunkforge doctor --venv-python)" -m chunkforge_py.train --out ../checkpoints/default

Random weights cannot say what INT4 costs, and their continuations switch at
near-ties. The built-in checkpoint is therefore a small trained model: E2B's
layer structure at the fixtures' tiny widths (`fixture.text_config_dict`:
35 layers, full attention every 5th, 20 KV-shared layers, double-wide MLP,
per-layer inputs, tied head, softcap), trained from transformers' own
initialisation on

- the prose of the project's own README.md and docs/*.md as of
  ``CORPUS_COMMIT`` (read with ``git show``, so the corpus does not move when
  the docs do; code blocks and tables dropped, `corpus`), and
- a task with a known right continuation: counting in words, from any start
  between 1 and ``LARGEST`` (``forty-seven, forty-eight, forty-nine, fifty,``;
  `number_words`), so tests have an answer that does not come from
  transformers.

Its tokenizer is the fixtures' byte-level BPE (`tokenizer.build_tokenizer`),
trained on this corpus with ``VOCAB_SIZE`` tokens: at the fixtures' 512,
trained on their few paragraphs, a word is three tokens and the number words
four to six. Every layer's ``layer_scalar`` (a buffer transformers never
trains) is trained here, so the packages carry scalars other than 1.

Deterministic: one seed (``SEED``) for the weights and the data, a fixed
thread count, torch's deterministic algorithms; the same machine gives the
same bytes (another CPU may round sums differently). The weights are trained
in fp32 and stored in bf16, as released checkpoints are; the figures below
are the stored weights' own.

The run that made the shipped files (its record is in the manifest), on
this machine: 1200 steps of 16 rows of 128 tokens (2.46 M tokens, 45
passes over the 54,617 tokens of prose at the 60 % the prose rows take),
1016 s of CPU on one thread (17 min); 1 h 44 min of wall time under
``nice -n 10`` beside the other jobs of the 2 shared cores (load average
11 to 17, so the run had 10 to 30 % of a core). The training loss fell from
6.94 to 0.26 (smoothed); the stored bf16 weights score 0.42 nats per token
on prose rows and 0.064 on counting rows (fixed batches of the training
data), and count right for 32 tokens from 20 of 20 random starts. The
checkpoint is 6.7 MB: 3.3 M parameters in bf16, the per-layer embedding
table (1024 x 1120) a third of them.

The folder holds ``checkpoint-manifest.json``: every file's SHA-256 and how
it was made (`write_manifest`); chunkforge refuses a default checkpoint
whose files are not the ones it names (src/builtin.rs), and a test holds
the shipped files to it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from .fixture import text_config_dict, write_config
from .tokenizer import BOS, SPECIAL_IDS

SEED = 0
# README.md and docs/*.md of this commit are the text corpus.
CORPUS_COMMIT = "e626041"
VOCAB_SIZE = 1024
# Counting runs over 1..LARGEST.
LARGEST = 999
# Training windows: tokens per row (the first is <bos>), rows per step.
SEQ_LEN = 128
BATCH = 16
STEPS = 1200
# AdamW: peak learning rate after WARMUP steps, cosine down to FINAL_LR_SHARE of it.
LR = 3e-3
WARMUP = 100
FINAL_LR_SHARE = 0.1
WEIGHT_DECAY = 0.01
CLIP = 1.0
# The share of rows that count (the rest are the docs' prose).
COUNTING_SHARE = 0.4
# One: two threads on two cores that other jobs share wait on each other (a step took
# 17 times as long, measured under a load of 14).
THREADS = 1
# transformers' own initialisation scale (the fixtures use 0.1, `fixture.INITIALIZER_RANGE`).
INITIALIZER_RANGE = 0.02
MANIFEST = "checkpoint-manifest.json"

ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """``n`` (0..999) in words: ``three hundred forty-two`` (no "and")."""
    if not 0 <= n <= 999:
        raise ValueError(f"{n}: counting words cover 0..999")
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")
    rest = n % 100
    return ONES[n // 100] + " hundred" + (" " + number_words(rest) if rest else "")


def counting(start: int, count: int) -> str:
    """``count`` numbers in words from ``start`` (at most to LARGEST), each followed by a comma."""
    return " ".join(number_words(i) + "," for i in range(start, min(start + count, LARGEST + 1)))


# ---- the docs' prose ----------------------------------------------------------

LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")


def prose(markdown: str) -> list[str]:
    """The paragraphs of a Markdown text, as plain prose: fenced code, tables
    and HTML dropped, headings and list items their own paragraphs, wrapped
    lines joined, links reduced to their text, emphasis and code marks removed."""
    paragraphs: list[str] = []
    current: list[str] = []
    fenced = False

    def close() -> None:
        if current:
            text = " ".join(current)
            text = LINK.sub(r"\1", text).replace("`", "").replace("**", "")
            paragraphs.append(re.sub(r"\s+", " ", text).strip())
            current.clear()

    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            close()
            fenced = not fenced
            continue
        if fenced or stripped.startswith(("|", "<")):
            close()
            continue
        if not stripped:
            close()
            continue
        heading = stripped.startswith("#")
        item = re.match(r"^(?:[-*]|\d+\.)\s+", stripped)
        if heading or item:
            close()
            stripped = stripped.lstrip("#").strip() if heading else stripped[item.end() :] if item else stripped
        current.append(stripped)
        if heading:
            close()
    close()
    return [p for p in paragraphs if p]


def git_show(repo: str, commit: str, path: str) -> str:
    return subprocess.run(
        ["git", "-C", repo, "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def corpus(repo: str, commit: str = CORPUS_COMMIT) -> list[str]:
    """The prose paragraphs of README.md and docs/*.md at ``commit`` (in path order)."""
    try:
        listed = subprocess.run(
            ["git", "-C", repo, "ls-tree", "--name-only", commit, "docs/"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"{repo}: cannot read commit {commit} ({e.stderr.strip()}); train in a full clone") from e
    paths = ["README.md", *sorted(p for p in listed if p.endswith(".md"))]
    return [p for path in paths for p in prose(git_show(repo, commit, path))]


# ---- data ---------------------------------------------------------------------


@dataclass
class Data:
    """The token stream of the prose and the tokenizer, and how rows are drawn."""

    tokenizer: Any
    stream: list[int]
    starts: list[int]

    @classmethod
    def make(cls, paragraphs: list[str], tokenizer: Any) -> Data:
        stream: list[int] = []
        starts: list[int] = []
        for p in paragraphs:
            starts.append(len(stream))
            stream += tokenizer.encode("\n\n" + p if stream else p, add_special_tokens=False).ids
        return cls(tokenizer, stream, starts)

    def counting_row(self, rng: random.Random) -> list[int]:
        """<bos> and a count from a random start, SEQ_LEN tokens (or to LARGEST)."""
        start = rng.randint(1, LARGEST)
        ids = self.tokenizer.encode(counting(start, SEQ_LEN), add_special_tokens=False).ids
        return [SPECIAL_IDS[BOS], *ids[: SEQ_LEN - 1]]

    def prose_row(self, rng: random.Random) -> list[int]:
        """<bos> and prose from a paragraph's start (half the rows) or anywhere."""
        last = len(self.stream) - (SEQ_LEN - 1)
        start = rng.choice(self.starts) if rng.random() < 0.5 else rng.randrange(last)
        start = min(start, last)
        return [SPECIAL_IDS[BOS], *self.stream[start : start + SEQ_LEN - 1]]

    def batch(self, rng: random.Random, counting_share: float = COUNTING_SHARE) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids and labels [BATCH, SEQ_LEN]; labels -100 where a short row is padded."""
        rows = [self.counting_row(rng) if rng.random() < counting_share else self.prose_row(rng) for _ in range(BATCH)]
        ids = torch.full((BATCH, SEQ_LEN), SPECIAL_IDS["<pad>"], dtype=torch.long)
        labels = torch.full((BATCH, SEQ_LEN), -100, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            labels[i, : len(row)] = torch.tensor(row)
        return ids, labels


# ---- the model ----------------------------------------------------------------


def config() -> Any:
    from transformers import Gemma4TextConfig

    kwargs = text_config_dict("e2b", vocab_size=VOCAB_SIZE)
    kwargs["initializer_range"] = INITIALIZER_RANGE
    return Gemma4TextConfig(**kwargs)


def new_model() -> Any:
    """transformers' model of `config`, its own initialisation, every layer's scalar trainable."""
    from transformers import Gemma4ForCausalLM

    model = Gemma4ForCausalLM(config())
    for layer in model.model.layers:
        layer.layer_scalar = torch.nn.Parameter(layer.layer_scalar.detach().clone())
    return model


def learning_rate(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    done = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (FINAL_LR_SHARE + (1 - FINAL_LR_SHARE) * 0.5 * (1 + math.cos(math.pi * done)))


def stored(model: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: bf16, tied head left out."""
    return {
        k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
    }


def with_weights(tensors: dict[str, torch.Tensor]) -> Any:
    """A fresh model (fp32, eval) holding ``tensors``."""
    model = new_model().eval()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"stored weights do not fit the model: {missing[:3]} {unexpected[:3]}")
    model.tie_weights()
    return model


@torch.no_grad()
def loss_on(model: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    losses = [float(model(input_ids=ids, labels=labels).loss) for ids, labels in batches]
    return sum(losses) / len(losses)


@torch.no_grad()
def counts_right(model: Any, tokenizer: Any, start: int, tokens: int) -> bool:
    """Greedy ``tokens`` tokens after three numbers from ``start`` are the next numbers' words."""
    prompt = counting(start, 3)
    ids = tokenizer.encode(prompt).ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    text = tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
    want = " " + counting(start + 3, tokens)
    return want.startswith(text) or (start + 3 + tokens > LARGEST and text.startswith(want))


def train(repo: str, out: str, steps: int) -> dict[str, Any]:
    """Train the checkpoint and write it into ``out`` (which must not exist); returns the training record."""
    from .tokenizer import build_tokenizer

    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(SEED)
    paragraphs = corpus(repo)
    tokenizer_text = "\n\n".join(paragraphs) + "\n\n" + counting(1, LARGEST)
    tokenizer = build_tokenizer(VOCAB_SIZE, tokenizer_text)
    data = Data.make(paragraphs, tokenizer)
    model = new_model().train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
    )
    # Fixed batches of the training data (their own generator), to measure the stored weights on.
    held_rng = random.Random(SEED + 1)
    held = {
        "prose": [data.batch(held_rng, counting_share=0.0) for _ in range(4)],
        "counting": [data.batch(held_rng, counting_share=1.0) for _ in range(4)],
    }
    started, cpu = time.time(), time.process_time()
    smooth = None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, steps)
        ids, labels = data.batch(rng)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        smooth = float(loss) if smooth is None else 0.98 * smooth + 0.02 * float(loss)
        if step % 25 == 0 or step == steps - 1:
            print(
                f"step {step:5d}  loss {float(loss):.3f}  smoothed {smooth:.3f}  "
                f"{time.time() - started:7.0f} s wall  {time.process_time() - cpu:7.0f} s cpu",
                flush=True,
            )
    seconds, cpu_seconds = time.time() - started, time.process_time() - cpu

    tensors = stored(model)
    final = with_weights(tensors)
    losses = {k: loss_on(final, v) for k, v in held.items()}
    check = random.Random(SEED + 2)
    starts = [check.randint(1, LARGEST - 20) for _ in range(20)]
    right = sum(counts_right(final, tokenizer, s, 32) for s in starts)
    record = {
        "seed": SEED,
        "corpus_commit": CORPUS_COMMIT,
        "corpus_paragraphs": len(paragraphs),
        "corpus_tokens": len(data.stream),
        "vocab_size": VOCAB_SIZE,
        "steps": steps,
        "tokens_seen": steps * BATCH * SEQ_LEN,
        "threads": THREADS,
        "wall_seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),
        "final_smoothed_loss": round(smooth or 0.0, 4),
        "sample_loss_bf16": {k: round(v, 4) for k, v in losses.items()},
        "counting_right_of_20": right,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    write(out, tensors, tokenizer_text, record)
    return record


def write(out: str, tensors: dict[str, torch.Tensor], tokenizer_text: str, record: dict[str, Any]) -> None:
    """The checkpoint folder, written beside ``out`` and renamed into place when complete."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from .tokenizer import write_tokenizer

    if os.path.exists(out):
        raise SystemExit(f"{out}: already exists; remove it or choose another --out")
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    cfg = config()
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    write_config(tmp, cfg, multimodal=False)
    write_tokenizer(tmp, vocab_size=cfg.vocab_size, model_max_length=cfg.max_position_embeddings, text=tokenizer_text)
    GenerationConfig(
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id
    ).save_pretrained(tmp)
    write_manifest(tmp, record)
    os.rename(tmp, out)


def file_digests(folder: str) -> dict[str, str]:
    """SHA-256 of every file in ``folder`` but the manifest, by name."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name != MANIFEST:
            with open(os.path.join(folder, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def write_manifest(folder: str, record: dict[str, Any]) -> None:
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": file_digests(folder), "training": record}, f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the checkpoint folder to write (must not exist)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps (default {STEPS})")
    parser.add_argument(
        "--repo",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."),
        help="the clone whose git history holds CORPUS_COMMIT",
    )
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    record = train(args.repo, args.out, args.steps)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
