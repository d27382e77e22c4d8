"""The INT4 check's noise floor: how far the fp32 model moves when each
projection's weight moves by random noise of its palettization's size.

The INT4 artifact check holds a layout with its packages' palettized weights
to the fp32 reference by loose thresholds (--tol-cos-int4, --min-top1-int4).
A checkpoint that amplifies every change of its weights (a random one with
transformers' own initialisation and nearly hard attention: E2B-size, INT4
moves its logits to cos 0.26) fails them whatever the palettizer, and then
they say nothing about the palettization. So when a layout fails them with
every weight within --max-weight-rel-mse and the same tokens as the other
layouts, parity runs that layout once more on the checkpoint's weights plus
Gaussian noise of each weight's own relative MSE. One draw of that noise
can land on either side of a threshold, so the layout runs with
`NOISE_DRAWS` draws, each its own seed per weight, and the verdict rests
on their spread: a threshold INT4 fails is explained by the noise when
every draw fails it too (the threshold lies beyond any change of the
weights that size), or when INT4's figure lies within the draws' spread
(INT4 is as good as some draw of noise its size). Then the check is
inconclusive: at this checkpoint the thresholds cannot tell a
palettization error from any change of the weights that size. Where the
draws stay within a threshold INT4 fails and INT4 is worse than all of
them, INT4 is worse than noise of its size and the check fails, as before.

Each noisy weight is made once per draw and kept in the form the
checkpoint stores (bf16 for a real one: the rounding adds a relative MSE
of about 1e-6 to noise of 1e-3 and more), so the native kernels multiply
it as they do the checkpoint's own.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from .. import weights
from ..checkpoint import Checkpoint, Fetcher
from ..contract import Dims, NoiseDraw, ParityLayout, ParityThresholds, Verdict, WeightNoise
from ..emulate.stepper import Embeddings, LayoutRunner
from ..model import Projection
from .check import cosine

# Values per block of rows while a noisy weight is made (fp32: 16 MB).
NOISE_BLOCK = 1 << 22
# Draws of the noise, each a full run of the layout with its own seeds.
NOISE_DRAWS = 4

# The torch dtype of each stored form a noisy weight is kept in.
STORED_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def noisy_weight(source: Any, fetch: Callable[[], Any], shape: tuple[int, ...], rel_mse: float, seed: int) -> Any:
    """The weight ``fetch`` gives, in ``shape``, plus Gaussian noise of
    relative MSE ``rel_mse`` (its variance ``rel_mse`` times the weight's
    mean square), drawn from ``seed``. A `Fetcher` source is read a block of
    rows at a time (an E2B head is 1.6 GB in fp32), and where the native
    kernels read the checkpoint's stored rows the noisy weight is kept as
    the checkpoint stores its weights (`weights.Stored`), else in fp32."""
    if isinstance(source, Fetcher):
        with weights.making("noise"):
            return noisy_rows(source, shape, rel_mse, seed)
    with weights.RESIDENT.passing():
        w = fetch()
        out = (w.dense() if isinstance(w, weights.Stored) else w).reshape(shape).clone()
    flat = out.view(shape[0], -1)
    rows = max(1, NOISE_BLOCK // max(1, flat[0].numel()))
    square = sum(float((flat[r : r + rows].double() ** 2).sum()) for r in range(0, shape[0], rows))
    sigma = (rel_mse * square / max(1, out.numel())) ** 0.5
    gen = torch.Generator().manual_seed(seed)
    for r in range(0, shape[0], rows):
        block = flat[r : r + rows]
        block += torch.randn(block.shape, generator=gen, dtype=block.dtype) * sigma
    return out


def noisy_rows(source: Fetcher, shape: tuple[int, ...], rel_mse: float, seed: int) -> Any:
    """`noisy_weight` of a checkpoint weight, read a block of rows at a time:
    its mean square first, then each block plus its noise."""
    cols = max(1, math.prod(shape[1:]))
    rows = max(1, NOISE_BLOCK // cols)
    square = 0.0
    for r in range(0, shape[0], rows):
        square += float((source.rows(r, r + rows).double() ** 2).sum())
    sigma = (rel_mse * square / max(1, shape[0] * cols)) ** 0.5
    kind = source.ckpt.stored_kind(source.name) if source.stored else "fp32"
    out = torch.empty((shape[0], cols), dtype=STORED_DTYPES.get(kind, torch.float32))
    gen = torch.Generator().manual_seed(seed)
    for r in range(0, shape[0], rows):
        block = source.rows(r, r + rows).reshape(-1, cols).float()
        noisy = block + torch.randn(block.shape, generator=gen, dtype=block.dtype) * sigma
        out[r : r + rows] = noisy.to(out.dtype)
    if not source.stored:
        return out.reshape(shape)
    if kind in STORED_DTYPES:
        return weights.Stored(kind, out.view(torch.int16).numpy().view(np.uint16), shape, f"{source.name} + noise")
    return weights.Stored("fp32", out.numpy(), shape, f"{source.name} + noise")


def seed_of(key: str, draw: int = 0) -> int:
    """A weight's noise seed in draw ``draw``: the same weight gets the same
    noise in every run (draw 0's is the seed of the single draw before)."""
    return zlib.crc32(key.encode() if draw == 0 else f"{key}#{draw}".encode())


def add_noise(runner: LayoutRunner, rel_mse: dict[str, float], draw: int = 0) -> int:
    """Every projection of ``runner`` (streamed from the checkpoint) takes
    its weight plus noise of ``rel_mse[chunk:weight]`` from draw ``draw``'s
    seeds, made on use through the resident budget. Returns how many took
    noise."""
    count = 0
    for chunk in runner.chunks:
        for mname, proj in runner.modules[chunk["name"]].named_modules():
            if not isinstance(proj, Projection):
                continue
            key = f"{chunk['name']}:{mname}.weight"
            assert proj.fetch is not None, "parity's modules are streamed"
            shape = tuple(proj.weight.shape)
            make = partial(noisy_weight, proj.source, proj.fetch, shape, rel_mse[key], seed_of(key, draw))
            lazy = weights.Lazy(("weight-noise", key, draw), make, shape)
            proj.fetch = lazy.get
            count += 1
    return count


def weight_noise(
    dims: Dims,
    layout: ParityLayout,
    ckpt: Checkpoint,
    rel_mse: dict[str, float],
    emb: Embeddings,
    prompt: list[int],
    ref_results: list[dict[str, Any]],
    progress: Callable[[str, int], None] | None = None,
    draws: int = NOISE_DRAWS,
) -> WeightNoise:
    """``layout`` decoding ``prompt`` with every projection's weight moved by
    noise of ``rel_mse`` (its palettization's, by ``chunk:weight``), against
    the fp32 reference's ``ref_results``, in ``draws`` draws: each draw's
    figures, and the lowest min cos and top-1 and the mean cos over them."""
    figures: list[NoiseDraw] = []
    for draw in range(draws):
        runner = LayoutRunner(dims, layout, ckpt)
        add_noise(runner, rel_mse, draw)
        got = runner.steps(emb, prompt, 0, progress=progress)
        coss = [cosine(ref["hidden"], g["hidden"]) for ref, g in zip(ref_results, got, strict=True)]
        agree = sum(g["token"] == ref["token"] for ref, g in zip(ref_results, got, strict=True))
        figures.append({"min_cos": min(coss), "mean_cos": sum(coss) / len(coss), "top1_agreement": agree / len(got)})
        del runner, got
        # A draw's noisy weights are never read again.
        weights.RESIDENT.release(lambda key: not (isinstance(key, tuple) and key[:1] == ("weight-noise",)))
    return {
        "min_cos": min(f["min_cos"] for f in figures),
        "mean_cos": sum(f["mean_cos"] for f in figures) / len(figures),
        "top1_agreement": min(f["top1_agreement"] for f in figures),
        "draws": figures,
    }


def int4_verdict(min_cos: float, top1: float, noise: WeightNoise | None, t: ParityThresholds) -> Verdict:
    """A layout's INT4 check whose weights and tokens held but whose cosine or
    top-1 did not: inconclusive when the noise draws (`weight_noise`) explain
    every threshold INT4 fails (each draw fails it too, or INT4's figure lies
    within the draws' spread), else a failure."""
    if noise is None:
        return "fail"
    draws = noise.get("draws") or [noise]

    def explained(value: float, threshold: float, spread: list[float]) -> bool:
        return value >= threshold or max(spread) < threshold or value >= min(spread)

    cos_explained = explained(min_cos, t["tol_cos_int4"], [d["min_cos"] for d in draws])
    top1_explained = explained(top1, t["min_top1_int4"], [d["top1_agreement"] for d in draws])
    return "inconclusive" if cos_explained and top1_explained else "fail"
