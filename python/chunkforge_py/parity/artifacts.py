"""The artifacts check (`parity --artifacts`): each decode layout with every
projection weight read back from its packages (INT4, or FP16 from a
`--no-quantize` build) against the fp32 reference, and verify_qK and the
prefill function with their packages' weights against the same build's
four-chunk decode (the report's ``artifacts`` and ``summary.artifacts``;
Rust's `parity_checks::ARTIFACTS`). A layout that fails its loose thresholds
with every weight within --max-weight-rel-mse is held to weight noise of its
palettization's size (`noise.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial
from typing import Any

import torch

from .. import weights
from ..checkpoint import Fetcher
from ..contract import (
    ArtifactRecord,
    ArtifactSummary,
    ChunkPlan,
    FunctionArtifactSummary,
    LayoutArtifactSummary,
    ParityLayout,
    ParityReport,
    StepRecord,
    Verdict,
    WeightNoise,
    WorstWeight,
)
from ..emulate.stepper import LayoutRunner, PrefillRunner
from ..model import Projection
from ..runtime import ChunkforgeError, release_memory, trim_heap
from ..weights import Stored, relative_error, shaped, value_of
from .check import Check, Parity, chunk_say, cosine, prefill_function
from .layouts import prefill_record, verify_records
from .noise import int4_verdict, weight_noise
from .programs import Programs
from .verdicts import judge


def function_summary(
    records: list[StepRecord], replaced: dict[str, int], ill: Collection[int]
) -> FunctionArtifactSummary:
    """The artifact summary of one function's records (another order of
    the decode's arithmetic: inconclusive at ill-conditioned steps)."""
    return {
        "weights_replaced": replaced,
        "min_cos": min(r["cos"] for r in records),
        "steps": len(records),
        "tokens_match": all(r["token"] == r["ref_token"] for r in records),
        "ok": all(r["ok"] for r in records),
        "verdict": judge([r["step"] for r in records if not r["ok"]], ill),
    }


def load_artifacts(runner: LayoutRunner, programs: Programs) -> tuple[dict[str, int], dict[str, float]]:
    """Replace every projection weight of the runner's modules with the package's
    dequantized one. Returns replaced counts per chunk and each weight's
    relative MSE (dequantized vs checkpoint weight, by ``chunk:weight``): the
    worst (`worst_weight`) exposes a weight stored in the wrong layer or slot
    (relative MSE ~2) as clearly as a bad quantizer."""
    return load_artifacts_into(runner.modules, runner.chunks, programs)


def worst_weight(rel_mse: dict[str, float]) -> WorstWeight:
    """The weight farthest from the checkpoint's, of `load_artifacts`' figures."""
    worst: WorstWeight = {"weight": None, "rel_mse": 0.0}
    for weight, rel in rel_mse.items():
        if rel > worst["rel_mse"]:
            worst = {"weight": weight, "rel_mse": rel}
    return worst


def load_artifacts_into(
    modules: dict[str, Any], chunks: list[ChunkPlan], programs: Programs
) -> tuple[dict[str, int], dict[str, float]]:
    """Every projection of ``modules`` (built from the checkpoint, streamed)
    takes its weight from its chunk's package instead: every palettized
    const (LUT + indices -> dense) or, in a --no-quantize build, every fp16
    matrix const; norms and scalars stay the checkpoint's (the packages keep
    them in fp16)."""
    counts = {}
    rels: dict[str, float] = {}
    for chunk in chunks:
        mod = modules[chunk["name"]]
        dense = programs.weights(chunk["name"])
        replaced = 0
        for mname, proj in mod.named_modules():
            if not isinstance(proj, Projection):
                continue
            pname = f"{mname}.weight"
            key = pname.replace(".", "_")
            shape = tuple(proj.weight.shape)
            if key not in dense:
                raise ChunkforgeError(
                    f"{chunk['name']}.mlpackage: no weight {key} for {pname} (built from a different plan?)"
                )
            # coremltools may store a 1x1 convolution's weight as [out, in, 1].
            got = tuple(dense[key].shape)
            if dense[key].numel() != proj.weight.numel() or got[:2] != shape[:2]:
                raise ChunkforgeError(
                    f"{chunk['name']}.mlpackage: weight {pname} has shape {got}, the plan expects {shape}"
                )
            # The package's weight first: its dequantization's temporaries
            # are gone before the checkpoint's weight is read.
            packed = shaped(value_of(dense[key]), shape)
            assert proj.fetch is not None, "parity's modules are streamed"
            # The checkpoint's weight a block of rows at a time where it can
            # be read so (an E2B head is 1.6 GB in fp32 beside its read-back);
            # both in their stored forms where the kernels run.
            source = proj.source
            if isinstance(packed, Stored) and isinstance(source, Fetcher) and source.stored:
                rel = relative_error(packed, source.read_stored())
            elif isinstance(source, Fetcher):
                rel = relative_mse(dense_of(packed), source.rows)
            else:
                with weights.RESIDENT.passing():
                    rel = relative_mse(dense_of(packed), dense_of(proj.fetch()).reshape(shape))
            del packed
            trim_heap()
            rels[f"{chunk['name']}:{pname}"] = rel
            proj.fetch = partial(packaged, dense[key], shape)
            replaced += 1
        counts[chunk["name"]] = replaced
    return counts, rels


def relative_mse(got: torch.Tensor, want: torch.Tensor | Callable[[int, int], torch.Tensor]) -> float:
    """mean((got - want)^2) / mean(want^2). ``want`` is a tensor, or gives
    rows start..stop-1 of one (`checkpoint.Fetcher.rows`), of ``got``'s
    values. A weight of more than `RELATIVE_MSE_BLOCK` values (the head of
    a real-size model is gigabytes) is summed in float64 over blocks of
    rows of about `RELATIVE_MSE_ROWS` values instead of through
    temporaries its own size; smaller ones take the direct formula (the
    figures the fixtures have always reported)."""

    def rows_of(start: int, stop: int) -> torch.Tensor:
        part = want[start:stop] if isinstance(want, torch.Tensor) else want(start, stop)
        return part.reshape(got[start:stop].shape)

    if got.numel() <= RELATIVE_MSE_BLOCK:
        w = rows_of(0, got.shape[0])
        return float(((got - w) ** 2).mean() / (w**2).mean().clamp_min(1e-30))
    rows = max(1, RELATIVE_MSE_ROWS // max(1, got[0].numel()))
    err = ref = 0.0
    for r in range(0, got.shape[0], rows):
        g, w = got[r : r + rows].double(), rows_of(r, r + rows).double()
        err += float(((g - w) ** 2).sum())
        ref += float((w**2).sum())
    return (err / got.numel()) / max(ref / got.numel(), 1e-30)


# Values above which `relative_mse` sums in blocks.
RELATIVE_MSE_BLOCK = 1 << 26
# Values per block there: four float64 temporaries of 32 MB each. (Blocks
# of `RELATIVE_MSE_BLOCK` values made 2 GB of temporaries beside the two
# fp32 copies of an E2B head: 9.9 GiB peak, measured.)
RELATIVE_MSE_ROWS = 1 << 22


def packaged(value: Any, shape: tuple[int, ...]) -> Any:
    """A package's weight (a tensor, `weights.Stored`, or `weights.Lazy` of
    either) in a projection's shape."""
    return shaped(value_of(value), shape)


def dense_of(value: Any) -> torch.Tensor:
    """A weight as float32 values (a stored one made dense: the general path)."""
    return value.dense() if isinstance(value, Stored) else value


class ArtifactsCheck(Check):
    """The artifacts check (the module docstring). It gives the programs
    check the build's packages (``Parity.programs``) and the read-back
    four-chunk decode (``Parity.readback``); without ``--artifacts`` it has
    no rows."""

    def __init__(self, p: Parity) -> None:
        super().__init__(p)
        self.records: list[ArtifactRecord] = []
        # Each check's summary in the order the report lists them, a
        # function's records kept until it is judged.
        self.checks: dict[str, LayoutArtifactSummary | tuple[list[StepRecord], dict[str, int]]] = {}
        self.summaries: dict[str, ArtifactSummary] = {}

    def compute(self) -> None:
        p = self.p
        build_dir = p.req["artifacts"]
        if not build_dir:
            return
        # The checkpoint's projections are read once each from here on (each
        # read-back weight's relative MSE): the budget goes to the packages'.
        weights.RESIDENT.release(lambda key: not (isinstance(key, tuple) and key[:1] == ("checkpoint",)))
        release_memory()
        p.programs = Programs(build_dir)
        first_tokens: list[int] | None = None
        # Every layout holds the same weights: one noise run serves them all.
        noise: WeightNoise | None = None
        t = p.req["thresholds"]
        for name, layout in p.req["artifact_layouts"].items():
            p.say(f"{name}: the packages' weights read back")
            q = LayoutRunner(p.dims, layout, p.ckpt)
            replaced, rels = load_artifacts(q, p.programs)
            worst = worst_weight(rels)
            agree = 0
            coss = []
            tokens = []
            q_results = q.steps(p.emb, p.prompt[: p.steps], 0, progress=chunk_say(p.say, f"{name} read back"))
            for step, got in enumerate(q_results):
                ref = p.ref_results[step]
                c = cosine(ref["hidden"], got["hidden"])
                same = got["token"] == ref["token"]
                agree += same
                coss.append(c)
                tokens.append(got["token"])
                self.records.append(
                    {
                        "layout": name,
                        "step": step,
                        "cos": c,
                        "ref_token": ref["token"],
                        "token": got["token"],
                        "same_token": same,
                    }
                )
            # Every layout's INT4 model holds the same palettized weights, so their
            # tokens must agree with each other even where INT4 moves them off fp32.
            if first_tokens is None:
                first_tokens = tokens
            top1 = agree / p.steps
            weights_held = worst["rel_mse"] <= t["max_weight_rel_mse"] and tokens == first_tokens
            ok = min(coss) >= t["tol_cos_int4"] and top1 >= t["min_top1_int4"] and weights_held
            if name == p.reference:
                # The packages' own verify and prefill weights against the same
                # INT4 model's sequential decode: equal up to fp32 rounding.
                p.say(f"{name}: the packages' verify and prefill functions, read back")
                self.functions(layout, q, q_results)
                p.readback = (q, q_results)
            # Loose thresholds over all steps: judged as they stand, unless
            # the weights and tokens held and weight noise of the
            # palettization's size fails them too (noise.py).
            verdict: Verdict = "ok" if ok else "fail"
            noise_here: WeightNoise | None = None
            if not ok and weights_held:
                if noise is None:
                    p.say(f"{name}: weight noise of the palettization's size (the INT4 check's noise floor)")
                    noise = weight_noise(
                        p.dims,
                        layout,
                        p.ckpt,
                        rels,
                        p.emb,
                        p.prompt[: p.steps],
                        p.ref_results[: p.steps],
                        chunk_say(p.say, f"{name} weight noise"),
                    )
                noise_here = noise
                verdict = int4_verdict(min(coss), top1, noise, t)
            self.checks[name] = {
                "weights_replaced": replaced,
                "worst_weight": worst,
                "min_cos": min(coss),
                "mean_cos": sum(coss) / len(coss),
                "top1_agreement": top1,
                "tokens_match_other_layouts": tokens == first_tokens,
                "weight_noise": noise_here,
                "ok": ok,
                "verdict": verdict,
            }

    def functions(self, four: ParityLayout, q: LayoutRunner, q_results: list[dict[str, Any]]) -> None:
        """verify_qK of chunk1..4 and the prefill function of prefill_chunk1..4,
        with the weights read back from their packages, against the INT4
        four-chunk decode ``q`` of the same build (``q_results``: its steps)."""
        p = self.p
        assert p.programs is not None
        k = p.verify_k()
        if k and p.steps >= k:
            vq = LayoutRunner(p.dims, four, p.ckpt, modules=q.modules)
            replaced, _ = load_artifacts_into(vq.verify_modules(p.ckpt), four["chunks"], p.programs)
            recs: list[StepRecord] = []
            verify_records(recs, {}, vq, p.emb, p.prompt, p.steps, k, q_results, four, p.tol)
            self.checks["verify_qK"] = (recs, replaced)
        n = p.prefill
        if n and p.req["prefill_layout"]:
            again = LayoutRunner(p.dims, four, p.ckpt, modules=q.modules)
            again.steps(p.emb, p.prompt[:n], 0)
            pf_layout, tokens = prefill_function(p.req, n)
            pf = PrefillRunner(p.dims, pf_layout, p.ckpt, tokens)
            replaced, _ = load_artifacts_into(pf.modules, pf_layout["chunks"], p.programs)
            prefilled = p.run_prefill(p.prompt[:n], pf, again)
            recs = []
            prefill_record(recs, {}, prefilled, again.caches, q_results[:n], p.tol)
            self.checks[prefilled["function"]] = (recs, replaced)

    def write(self, report: ParityReport) -> None:
        p = self.p
        for name, check in self.checks.items():
            if isinstance(check, tuple):
                self.summaries[name] = function_summary(*check, p.ill)
            else:
                self.summaries[name] = check
        report["artifacts"] = self.records
        report["summary"]["artifacts"] = self.summaries or None
        report["summary"]["artifacts_precision"] = p.req["artifacts_precision"] if p.req["artifacts"] else None

    def verdicts(self) -> list[Verdict]:
        return [s["verdict"] for s in self.summaries.values()]


CHECK = ArtifactsCheck
