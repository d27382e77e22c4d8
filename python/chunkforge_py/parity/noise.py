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
Gaussian noise of each weight's own relative MSE, and the failure is
inconclusive when that noise fails every threshold INT4 failed: at this
checkpoint the thresholds cannot tell a palettization error from any change
of the weights that size. Where the noise stays within them, INT4 is worse
than noise of its size and the check fails, as before.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .. import weights
from ..checkpoint import Checkpoint, Fetcher
from ..contract import Dims, ParityLayout, ParityThresholds, Verdict, WeightNoise
from ..emulate.stepper import Embeddings, LayoutRunner
from ..model import Projection
from .check import cosine

# Values per block of rows while a noisy weight is made (fp32: 16 MB).
NOISE_BLOCK = 1 << 22


def noisy_weight(
    source: Any, fetch: Callable[[], torch.Tensor], shape: tuple[int, ...], rel_mse: float, seed: int
) -> torch.Tensor:
    """The weight ``fetch`` gives, in ``shape``, plus Gaussian noise of
    relative MSE ``rel_mse`` (its variance ``rel_mse`` times the weight's
    mean square), drawn from ``seed``. A `Fetcher` source is read a block of
    rows at a time into the one new tensor (an E2B head is 1.6 GB)."""
    if isinstance(source, Fetcher):
        out = torch.empty(shape, dtype=source.dtype)
        flat = out.view(shape[0], -1)
        rows = max(1, NOISE_BLOCK // max(1, flat[0].numel()))
        for r in range(0, shape[0], rows):
            flat[r : r + rows] = source.rows(r, r + rows).reshape(flat[r : r + rows].shape)
    else:
        with weights.RESIDENT.passing():
            out = fetch().reshape(shape).clone()
        flat = out.view(shape[0], -1)
        rows = max(1, NOISE_BLOCK // max(1, flat[0].numel()))
    square = sum(float((flat[r : r + rows].double() ** 2).sum()) for r in range(0, shape[0], rows))
    sigma = (rel_mse * square / max(1, out.numel())) ** 0.5
    gen = torch.Generator().manual_seed(seed)
    for r in range(0, shape[0], rows):
        block = flat[r : r + rows]
        block += torch.randn(block.shape, generator=gen, dtype=block.dtype) * sigma
    return out


def seed_of(key: str) -> int:
    """A weight's noise seed: the same weight gets the same noise in every run."""
    return zlib.crc32(key.encode())


def add_noise(runner: LayoutRunner, rel_mse: dict[str, float]) -> int:
    """Every projection of ``runner`` (streamed from the checkpoint) takes
    its weight plus noise of ``rel_mse[chunk:weight]``, made on use through
    the resident budget. Returns how many took noise."""
    count = 0
    for chunk in runner.chunks:
        for mname, proj in runner.modules[chunk["name"]].named_modules():
            if not isinstance(proj, Projection):
                continue
            key = f"{chunk['name']}:{mname}.weight"
            assert proj.fetch is not None, "parity's modules are streamed"
            shape = tuple(proj.weight.shape)
            make = partial(noisy_weight, proj.source, proj.fetch, shape, rel_mse[key], seed_of(key))
            lazy = weights.Lazy(("weight-noise", key), make, shape)
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
) -> WeightNoise:
    """``layout`` decoding ``prompt`` with every projection's weight moved by
    noise of ``rel_mse`` (its palettization's, by ``chunk:weight``), against
    the fp32 reference's ``ref_results``."""
    runner = LayoutRunner(dims, layout, ckpt)
    add_noise(runner, rel_mse)
    got = runner.steps(emb, prompt, 0, progress=progress)
    coss = [cosine(ref["hidden"], g["hidden"]) for ref, g in zip(ref_results, got, strict=True)]
    agree = sum(g["token"] == ref["token"] for ref, g in zip(ref_results, got, strict=True))
    return {"min_cos": min(coss), "mean_cos": sum(coss) / len(coss), "top1_agreement": agree / len(got)}


def int4_verdict(min_cos: float, top1: float, noise: WeightNoise | None, t: ParityThresholds) -> Verdict:
    """A layout's INT4 check whose weights and tokens held but whose cosine or
    top-1 did not: inconclusive when ``noise`` (`weight_noise`) fails every
    threshold INT4 fails, else a failure."""
    if noise is None:
        return "fail"
    cos_explained = min_cos >= t["tol_cos_int4"] or noise["min_cos"] < t["tol_cos_int4"]
    top1_explained = top1 >= t["min_top1_int4"] or noise["top1_agreement"] < t["min_top1_int4"]
    return "inconclusive" if cos_explained and top1_explained else "fail"
