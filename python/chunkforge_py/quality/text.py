"""`chunkforge eval`: what a release (or a build) costs, layout by layout,
on a text.

The text is tokenized by the release's tokenizer and fed teacher-forced:
position t holds token t, and its logits predict token t + 1. Two models
read it:

- the source: transformers' ``Gemma4ForCausalLM`` on the source checkpoint
  (`parity.oracle.Oracle`, fp32, eager attention), given the checkpoint's
  own fp32 embedding rows (`SourceEmbeddings`): the model as trained;
- each decode layout's packages: their own ML programs, executed op by op
  by the MIL interpreter with the packaged weights (palettized ones
  dequantized; ``fp16``: every fp16 op output rounded to fp16, as `run
  --fp16`), fed as the app's runtime feeds them, from the runtime's int8
  embedding tables and RoPE tables (`emulate.release`), one decode call per
  position (`stepper.LayoutRunner.steps`).

Per layout: perplexity (exp of the mean negative log-likelihood of each
next token), KL(source ‖ package) per position (mean and largest), the
share of positions whose top-1 token is the source's, and each position
where it is not, with the source's top-2 margin there (a small margin is a
near-tie rounding may swap; a large one is an error). With ``fp16`` the
range of every fp16-typed op output is recorded (`mil.fp16range`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .. import divergence
from ..checkpoint import Checkpoint
from ..contract import Dims, Disagreement, EvalLayout, EvalRequest, EvalResult, LayoutQuality, SourceQuality
from ..emulate.release import Package, ReleaseEmbeddings, RopeTables, check_contract
from ..emulate.stepper import LayoutRunner, function_of
from ..mil.chunk import ProgramChunk
from ..mil.fp16range import Fp16Range
from ..mil.interp import Interpreter
from ..parity.oracle import Oracle
from ..runtime import ChunkforgeError, release_memory


class SourceEmbeddings:
    """The checkpoint's embedding rows in fp32, scaled as transformers scales
    them (``embed_tokens[id] * embed_scale``; the per-layer rows by
    ``per_layer_embed_scale``), not rounded: the source model's own inputs."""

    def __init__(self, dims: Dims, ckpt: Checkpoint):
        self.dims = dims
        self.embed = ckpt.get("embed_tokens.weight", None)
        self.per_layer = ckpt.get("embed_tokens_per_layer.weight", None)

    def hidden(self, token: int, dtype: torch.dtype) -> torch.Tensor:
        return (self.embed[token].float() * self.dims["embed_scale"]).view(1, 1, -1).to(dtype)

    def per_layer_raw(self, token: int, dtype: torch.dtype) -> torch.Tensor:
        return (self.per_layer[token].float() * self.dims["per_layer_embed_scale"]).view(1, 1, -1).to(dtype)


def tokens_of(req: EvalRequest) -> list[int]:
    """The text's token ids by the release's tokenizer (<bos> first), at most ``max_tokens``."""
    from tokenizers import Tokenizer

    path = req["files"]["tokenizer"]
    if not path:
        raise ChunkforgeError(f"{req['target']}: no tokenizer (hf_model/tokenizer.json) to read the text with")
    ids: list[int] = Tokenizer.from_file(path).encode(req["text"]).ids[: req["max_tokens"]]
    if len(ids) < 2:
        raise ChunkforgeError("the text has fewer than two tokens: nothing to predict")
    vocab = req["dims"]["vocab_size"]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ChunkforgeError(f"{path}: token ids {bad[:5]} are outside the model's vocabulary (0..{vocab - 1})")
    return ids


def source_logits(req: EvalRequest, ids: list[int]) -> torch.Tensor:
    """transformers' softcapped logits at every position [T, vocab] (fp32)."""
    ckpt = Checkpoint(req["checkpoint"])
    oracle = Oracle(req["config_path"], ckpt)
    logits: torch.Tensor = oracle.teacher_forced(ids, SourceEmbeddings(req["dims"], ckpt))["logits"]  # type: ignore[arg-type]
    return logits.float()


def score_source(logits: torch.Tensor, ids: list[int], seconds: float) -> tuple[SourceQuality, list[float], list[int]]:
    """The source's own figures, its top-2 margin and top-1 token at every scored position."""
    n = len(ids) - 1
    nll = 0.0
    margins: list[float] = []
    top: list[int] = []
    for t in range(n):
        lp = divergence.log_probs(logits[t])
        nll += float(-lp[ids[t + 1]])
        margins.append(divergence.top2_margin(logits[t]))
        top.append(int(logits[t].argmax()))
    mean = nll / n
    return (
        {"perplexity": float(torch.tensor(mean).exp()), "nll": mean, "min_margin": min(margins), "seconds": seconds},
        margins,
        top,
    )


def score_layout(
    ev: EvalLayout,
    results: list[dict[str, Any]],
    source: torch.Tensor,
    ids: list[int],
    margins: list[float],
    top: list[int],
    seconds: float,
) -> LayoutQuality:
    n = len(ids) - 1
    nll = kl_sum = kl_max = error = 0.0
    kl_at = agree = 0
    disagreements: list[Disagreement] = []
    for t in range(n):
        q = results[t]["logits"].reshape(-1)
        lq, ls = divergence.log_probs(q), divergence.log_probs(source[t])
        nll += float(-lq[ids[t + 1]])
        k = float(divergence.kl(ls, lq))
        kl_sum += k
        if k > kl_max:
            kl_max, kl_at = k, t
        error = max(error, float((q.double() - source[t].double()).abs().max()))
        token = int(q.argmax())
        if token == top[t]:
            agree += 1
        else:
            disagreements.append(
                {"position": t, "source_token": top[t], "package_token": token, "source_margin": margins[t]}
            )
    mean = nll / n
    return {
        "layout": ev["layout"]["kind"],
        "chunks": [c["name"] for c in ev["layout"]["chunks"]],
        "perplexity": float(torch.tensor(mean).exp()),
        "nll": mean,
        "kl_mean": kl_sum / n,
        "kl_max": kl_max,
        "kl_max_position": kl_at,
        "top1": agree / n,
        "disagreements": disagreements,
        "max_logit_error": error,
        "seconds": seconds,
    }


def told(tell: Callable[[str], None], say: str, chunk: str, _n: int) -> None:
    """`LayoutRunner.steps`' progress as an eval phase."""
    tell(say.format(chunk))


def evaluate(req: EvalRequest, progress: Callable[[str], None] | None = None) -> EvalResult:
    """Every layout of ``req`` against the source over the text (module docstring)."""
    tell = progress or (lambda _what: None)
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    dims = req["dims"]
    ids = tokens_of(req)
    if len(ids) > dims["ctx"]:
        raise ChunkforgeError(f"the text's {len(ids)} tokens do not fit the context of {dims['ctx']}")

    tell(f"transformers on the source checkpoint, {len(ids)} tokens")
    t0 = time.perf_counter()
    source = source_logits(req, ids)
    source_quality, margins, top = score_source(source, ids, time.perf_counter() - t0)
    release_memory()

    emb = ReleaseEmbeddings(req)  # type: ignore[arg-type]
    rope = RopeTables(req)  # type: ignore[arg-type]
    fp16 = bool(req["fp16"])
    watch = Fp16Range() if fp16 else None
    layouts: list[LayoutQuality] = []
    for ev in req["layouts"]:
        layout = ev["layout"]
        t0 = time.perf_counter()
        modules = {}
        for c in layout["chunks"]:
            files = ev["packages"][c["name"]]
            f = function_of(c, "decode")
            interp = Interpreter(files["path"], files["weights"])
            check_contract(Package(files["path"], program=False), f, dims["ctx"])
            modules[c["name"]] = ProgramChunk(interp, f, fp16, watch)
        runner = LayoutRunner(dims, layout, None, modules=modules, rope=rope)  # type: ignore[arg-type]
        say = f"{layout['kind']}: {{}} over {len(ids)} positions (MIL interpreter{', fp16' if fp16 else ''})"
        results = runner.steps(emb, ids, 0, progress=partial(told, tell, say))
        layouts.append(score_layout(ev, results, source, ids, margins, top, time.perf_counter() - t0))
        del results, runner, modules
        release_memory()
    if watch is not None and watch.introduced():
        # Whether the fp32 programs make the same infinities: the layouts again, in fp32.
        for ev in req["layouts"]:
            tell(f"{ev['layout']['kind']}: the fp32 programs, for the ops that made inf or NaN in fp16")
            again = {
                c["name"]: ProgramChunk(
                    Interpreter(ev["packages"][c["name"]]["path"], ev["packages"][c["name"]]["weights"]),
                    function_of(c, "decode"),
                    False,
                    watch,
                )
                for c in ev["layout"]["chunks"]
            }
            LayoutRunner(dims, ev["layout"], None, modules=again, rope=rope).steps(emb, ids, 0)  # type: ignore[arg-type]
            release_memory()
    return {
        "tokens": len(ids),
        "positions": len(ids) - 1,
        "source": source_quality,
        "layouts": layouts,
        "fp16_range": watch.report() if watch is not None else None,
        "seconds": time.perf_counter() - started,
    }
