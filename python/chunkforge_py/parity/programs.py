"""The programs check (`parity --artifacts`), the packages' own programs: every
function of every package of the build executed op by op by the MIL
interpreter (mil/interp.py) with the packaged weights, fed as the runtime
feeds it (the report's ``programs`` and ``summary.programs``; Rust's
`parity_checks::PROGRAMS`).

The artifacts check (artifacts.py) runs *our torch modules* with the weights the
packages hold; it cannot see a program that computes something else (a
frontend or pass bug, an edited program). This one runs the program itself and
holds it against those same read-back modules: in fp32 mode the two compute the
same function of the same weights, so they must agree to ``tol`` (cosine of the
final hidden state) with the same token at every step; that is the gate. fp16
mode rounds every fp16 op output to fp16, the closest Linux gets to the
device's arithmetic, and is reported. Both are also reported against the fp32
reference (checkpoint weights) and, when the oracle ran, against transformers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection
from functools import partial
from typing import Any, Literal

import torch

from ..contract import (
    ChunkPlan,
    Dims,
    Fp16RangeReport,
    FunctionKind,
    ParityLayout,
    ParityReport,
    ProgramRecord,
    ProgramSummary,
    Verdict,
)
from ..emulate.release import SCALAR_DROPPED_AT_ONE
from ..emulate.stepper import EmbeddingSource, LayoutRunner, PrefillRunner, function_of, schedule
from ..mil.chunk import ProgramChunk
from ..mil.fp16range import Fp16Range
from ..mil.inspect import const_key
from ..mil.interp import Interpreter
from ..model import Chunk, load_streamed
from ..runtime import ChunkforgeError
from ..weights import Stored, kernels, value_of
from .check import Check, Parity, caches_cosine, chunk_say, cosine
from .verdicts import judge

# (name, fp16 rounding after every op)
Precision = Literal["fp32", "fp16"]
PRECISIONS: tuple[tuple[Precision, bool], ...] = (("fp32", False), ("fp16", True))


class Programs:
    """The build's packages, each parsed once and shared by every layout that
    holds it; their weights are the interpreter's (`weights.Lazy` when
    large), so the read-back modules, the weights ``--artifacts`` loads and
    the programs draw on the same ones."""

    def __init__(self, build_dir: str):
        self.build_dir = build_dir
        self._interp: dict[str, Interpreter] = {}
        # Every program run's fp16-typed op outputs (`fp16range`): the fp16
        # range report, and the ops that make inf or NaN in fp16 only.
        self.watch = Fp16Range()

    def interpreter(self, name: str) -> Interpreter:
        """The package ``name`` (``chunk1``), parsed once."""
        if name not in self._interp:
            path = os.path.join(self.build_dir, f"{name}.mlpackage")
            if not os.path.isdir(path):
                raise ChunkforgeError(f"{path}: package not found (build it with `chunkforge build --mode all`)")
            self._interp[name] = Interpreter(path)
        return self._interp[name]

    def weights(self, name: str, function: str | None = None) -> dict[str, Any]:
        """The named constants of one function of package ``name`` (default:
        its default function) by torch parameter path with dots as
        underscores (`inspect_pkg.const_key`): tensors, or `weights.Lazy`."""
        interp = self.interpreter(name)
        fn = interp.function(function or interp.default_function)
        consts = fn.consts
        out: dict[str, Any] = {}
        # A weight's palettized value wins over any other constant of its name.
        for n in sorted(consts, key=lambda n: not n.endswith("_palettized")):
            # As the kernels read it (`Interpreter.stored_const`): an fp16
            # matrix as its stored values, not made dense.
            value = interp.stored_const(fn.const_keys[n], consts[n]) if kernels() else consts[n]
            out.setdefault(const_key(n), value)
        return out

    def read_back(self, dims: Dims, chunks: list[ChunkPlan], kind: FunctionKind) -> dict[str, Any]:
        """Our torch modules of the chunks' ``kind`` functions with every
        weight (projections, norms, layer scalars) read back from the packages
        by name, as `emulate.module_from_package` reads them; the projections'
        weights are made when they run (`model.load_streamed`)."""
        out: dict[str, Any] = {}
        for c in chunks:
            function = function_of(c, kind)
            with torch.device("meta"):
                module = Chunk(dims, c, function).eval()
            found = self.weights(c["name"], function["name"])
            where = f"{self.interpreter(c['name']).path}: function {function['name']}"

            lookup = Lookup(found, where, module)
            load_streamed(module, lookup.fetch, lookup.get)
            out[c["name"]] = module
        return out

    def modules(
        self, chunks: list[ChunkPlan], kind: FunctionKind, fp16: bool, tokens: int | None = None
    ) -> dict[str, Any]:
        return {
            c["name"]: ProgramChunk(self.interpreter(c["name"]), function_of(c, kind, tokens), fp16, self.watch)
            for c in chunks
        }


class Lookup:
    """A module's weights by parameter name among a package function's
    constants (`Programs.weights`): a weight the package lacks, or holds in
    another size, is an error naming it."""

    def __init__(self, found: dict[str, Any], where: str, module: torch.nn.Module):
        self.found = found
        self.where = where
        self.shapes = {n: tuple(t.shape) for n, t in [*module.named_parameters(), *module.named_buffers()]}

    def find(self, name: str) -> Any:
        key = name.replace(".", "_")
        if key not in self.found and key.endswith(SCALAR_DROPPED_AT_ONE):
            # coremltools removes a multiplication by 1.0 (noop_elimination),
            # and its const with it: the package multiplies by 1.
            return torch.ones(self.shapes[name])
        if key not in self.found:
            raise ChunkforgeError(
                f"{self.where} holds no weight {key} (built from a different plan, or by an older chunkforge?)"
            )
        value = self.found[key]
        if value.numel() != math.prod(self.shapes[name]):
            raise ChunkforgeError(
                f"{self.where}: weight {key} has shape {tuple(value.shape)}, the plan expects {self.shapes[name]}"
            )
        return value

    def fetch(self, name: str, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        return partial(value_of, self.find(name))

    def get(self, name: str) -> torch.Tensor:
        value = value_of(self.find(name))
        return value.dense() if isinstance(value, Stored) else value


class CosineSums:
    """`caches_cosine` of a layout's caches summed chunk by chunk (`add`),
    for calls run chunk by chunk: the same cosine up to float64 rounding of
    the sums' order (1e-15)."""

    def __init__(self) -> None:
        self.dot = self.aa = self.bb = 0.0
        self.finite = True

    def add(self, a: Any, b: Any) -> None:
        """One chunk's caches (tensors by role)."""
        for key in a:
            x, y = a[key].double().reshape(-1), b[key].double().reshape(-1)
            self.finite = self.finite and bool(torch.isfinite(x).all() and torch.isfinite(y).all())
            self.dot += float(x @ y)
            self.aa += float(x @ x)
            self.bb += float(y @ y)

    def cosine(self) -> float:
        """As `cosine` (torch's cosine_similarity: eps 1e-8 on each norm)."""
        if not self.finite:
            return -1.0
        return self.dot / (max(self.aa**0.5, 1e-8) * max(self.bb**0.5, 1e-8))


def summarize(records: list[ProgramRecord], tol: float, gated: bool, ill: Collection[int]) -> ProgramSummary:
    """A program's records in one precision; fp32 (``gated``) must compute
    what the read-back modules compute, at every step that is not
    ill-conditioned (`verdicts.judge`: the two are different orders of the
    same arithmetic)."""

    def mean(xs: list[bool]) -> float:
        return sum(xs) / len(xs)

    hf = [r for r in records if r["hf_token"] is not None]
    ref = [r for r in records if r["ref_token"] is not None]
    min_readback = min(r["cos_readback"] for r in records)
    tokens_match = all(r["token"] == r["readback_token"] for r in records)
    changes = [r["logit_change"] for r in records if r["logit_change"] is not None]
    flips = [r["readback_margin"] for r in records if r["token"] != r["readback_token"]]
    known_flips = [m for m in flips if m is not None]
    failing = [r["step"] for r in records if r["cos_readback"] < tol or r["token"] != r["readback_token"]]
    return {
        "steps": len(records),
        "min_cos_readback": min_readback,
        "tokens_match_readback": tokens_match,
        "max_logit_change": max(changes, default=None),
        "max_flip_margin": None if len(known_flips) < len(flips) else max(known_flips, default=None),
        "min_cos_reference": min((r["cos_reference"] for r in records if r["cos_reference"] is not None), default=None),
        "top1_reference": mean([r["token"] == r["ref_token"] for r in ref]) if ref else None,
        "min_cos_hf": min((r["cos_hf"] for r in hf if r["cos_hf"] is not None), default=None),
        "top1_hf": mean([r["token"] == r["hf_token"] for r in hf]) if hf else None,
        "gated": gated,
        "ok": (min_readback >= tol and tokens_match) if gated else True,
        "verdict": judge(failing, ill) if gated else "ok",
    }


def logit_change(logits: torch.Tensor | None, readback_logits: torch.Tensor | None) -> float | None:
    """The largest change of any logit between a program and the read-back
    modules at one step: how far the program's arithmetic (in fp16 mode,
    every op's output rounded to fp16) moved the logits. Where the read-back's
    top-2 margin is inside twice this, that arithmetic may pick the runner-up."""
    if logits is None or readback_logits is None:
        return None
    change = float((logits.double().reshape(-1) - readback_logits.double().reshape(-1)).abs().max())
    return change if math.isfinite(change) else None


def top2_margin(logits: torch.Tensor | None) -> float | None:
    if logits is None:
        return None
    top = torch.topk(logits.double().reshape(-1), 2).values
    return float(top[0] - top[1])


def record(
    target: str,
    precision: Precision,
    step: int,
    token: int,
    hidden: torch.Tensor,
    readback: dict[str, Any],
    readback_hidden: torch.Tensor,
    ref: dict[str, Any] | None,
    hf: dict[str, Any] | None,
    logits: torch.Tensor | None = None,
    readback_logits: torch.Tensor | None = None,
) -> ProgramRecord:
    return {
        "target": target,
        "precision": precision,
        "step": step,
        "token": token,
        "readback_token": int(readback["token"]),
        "cos_readback": cosine(hidden, readback_hidden),
        "readback_margin": top2_margin(readback_logits),
        "logit_change": logit_change(logits, readback_logits),
        "ref_token": int(ref["token"]) if ref is not None else None,
        "cos_reference": cosine(hidden, ref["hidden"]) if ref is not None else None,
        "hf_token": int(hf["logits"][step].argmax()) if hf is not None else None,
        "cos_hf": cosine(hidden, hf["hidden"][step]) if hf is not None else None,
    }


def check_layout(
    programs: Programs,
    name: str,
    layout: ParityLayout,
    dims: Dims,
    emb: EmbeddingSource,
    prompt: list[int],
    ref_results: list[dict[str, Any]],
    hf: dict[str, Any] | None,
    progress: Callable[[str, int], None] | None = None,
) -> dict[Precision, list[ProgramRecord]]:
    """The layout's decode programs, over every step, in both precisions.
    The comparison is our modules with every weight read back from the
    packages (``Programs.read_back``), stepped first; every program step
    reads the caches that module step read, so each step compares one call of
    the program with one call of the modules on identical inputs: a random-weight model amplifies the last
    ulp over steps (on the E4B-shaped fixture fp16 weight rounding alone moves
    the 16th step's cosine by 3e-4), and that drift is the model's, not the
    program's. Each chunk's call of the modules, then the programs' from the
    same caches (only one version of each chunk's caches is held);
    ``progress(chunk, n)`` is told as each chunk starts its n steps."""
    modules = LayoutRunner(dims, layout, None, modules=programs.read_back(dims, layout["chunks"], "decode"))
    runners = {
        precision: LayoutRunner(dims, layout, None, modules=programs.modules(layout["chunks"], "decode", fp16))
        for precision, fp16 in PRECISIONS
    }
    steps = len(ref_results)
    # Every call's feeds, results and cache cosine sums, by runner; the
    # modules' caches are those of ``modules``, each program call's the
    # ones the modules' call of the same chunk and step read.
    feeds = {who: [modules.step_feeds(emb, prompt[t], t) for t in range(steps)] for who in ["readback", *runners]}
    results: dict[str, list[dict[str, Any]]] = {who: [{} for _ in range(steps)] for who in feeds}
    sums = {precision: [CosineSums() for _ in range(steps)] for precision in runners}
    # Chunk by chunk, as `LayoutRunner.steps` (the chunk's package is read
    # once for its steps, not once per step and program).
    for t, c in schedule(layout["chunks"], steps):
        if progress and t == 0:
            progress(c["name"], steps)
        # Calls replace cache tensors, so a shallow copy keeps what this call read.
        before = dict(modules.caches[c["name"]])
        modules.decode_call(c, feeds["readback"][t], results["readback"][t])
        for precision, runner in runners.items():
            runner.caches[c["name"]] = dict(before)
            runner.decode_call(c, feeds[precision][t], results[precision][t])
            sums[precision][t].add(runner.caches[c["name"]], modules.caches[c["name"]])
    recs: dict[Precision, list[ProgramRecord]] = {precision: [] for precision, _ in PRECISIONS}
    for t in range(steps):
        rb = LayoutRunner.decoded(results["readback"][t])
        for precision in runners:
            got = LayoutRunner.decoded(results[precision][t])
            rec = record(
                name, precision, t, got["token"], got["hidden"], rb, rb["hidden"], ref_results[t], hf,
                got["logits"], rb["logits"],
            )  # fmt: skip
            # The caches the program wrote count too: the worse of the two cosines.
            rec["cos_readback"] = min(rec["cos_readback"], sums[precision][t].cosine())
            recs[precision].append(rec)
    return recs


def check_verify(
    programs: Programs,
    four: ParityLayout,
    k: int,
    dims: Dims,
    emb: EmbeddingSource,
    prompt: list[int],
    readback: list[dict[str, Any]],
) -> dict[Precision, list[ProgramRecord]]:
    """chunk1..4's verify_qK programs, K teacher-forced tokens per call with
    every row committed, against the read-back decode of the same positions
    (the pre-norm hidden state after the last layer, and the token)."""
    out: dict[Precision, list[ProgramRecord]] = {}
    last_layer = max(readback[0]["trace"])
    for precision, fp16 in PRECISIONS:
        chunks = four["chunks"]
        vr = LayoutRunner(
            dims,
            four,
            None,
            modules=programs.modules(chunks, "decode", fp16),
            verify=programs.modules(chunks, "verify", fp16),
        )
        recs = []
        for block, got in enumerate(vr.verify_blocks(emb, prompt, len(readback), k)):
            pos = block * k
            for i in range(k):
                rb = readback[pos + i]
                recs.append(
                    record(
                        "verify_qK", precision, pos + i, got["tokens"][i], got["hidden"][i], rb,
                        rb["trace"][last_layer], None, None, got["logits"][i], rb["logits"],
                    )
                )  # fmt: skip
        out[precision] = recs
    return out


def check_prefill(
    programs: Programs,
    prefill_layout: ParityLayout,
    four: ParityLayout,
    n: int,
    dims: Dims,
    emb: EmbeddingSource,
    prompt: list[int],
    readback: list[dict[str, Any]],
    readback_caches: Any,
) -> tuple[str, dict[Precision, list[ProgramRecord]]]:
    """prefill_chunk1..4's programs on the first ``n`` prompt tokens (the
    shortest function that holds them): the token after the prompt against the
    read-back decode's at step n - 1, and the caches it leaves (loaded into
    four-chunk caches as the runtime does) against the read-back decode's
    after n steps, by cosine over every slot."""
    fits = sorted(f["tokens"] for f in prefill_layout["chunks"][0]["functions"] if f["tokens"] >= n)
    function = f"prefill_b{fits[0]}"
    out: dict[Precision, list[ProgramRecord]] = {}
    for precision, fp16 in PRECISIONS:
        pf = PrefillRunner(
            dims,
            prefill_layout,
            None,
            fits[0],
            modules=programs.modules(prefill_layout["chunks"], "prefill", fp16, fits[0]),
        )
        res = pf.run(emb, prompt[:n])
        caches = LayoutRunner(dims, four, None, modules=programs.modules(four["chunks"], "decode", fp16))
        caches.load_prefill_kv(res["kv"], n)
        rb = readback[n - 1]
        rec: ProgramRecord = {
            "target": function,
            "precision": precision,
            "step": n - 1,
            "token": int(res["token"]),
            "readback_token": int(rb["token"]),
            "cos_readback": caches_cosine(caches.caches, readback_caches),
            "readback_margin": top2_margin(rb["logits"]),
            "logit_change": logit_change(pf.modules[prefill_layout["chunks"][-1]["name"]].last_logits, rb["logits"]),
            "ref_token": None,
            "cos_reference": None,
            "hf_token": None,
            "cos_hf": None,
        }
        out[precision] = [rec]
    return function, out


class ProgramsCheck(Check):
    """The programs check (the module docstring): after the artifacts
    check, each decode layout's programs, and the reference's verify and
    prefill programs against its read-back four-chunk decode; without
    ``--artifacts`` it has no rows."""

    def __init__(self, p: Parity) -> None:
        super().__init__(p)
        # By layout or function, then precision: its records, judged in `write`.
        self.records: dict[str, dict[Precision, list[ProgramRecord]]] = {}
        self.summaries: dict[str, dict[str, ProgramSummary]] = {}
        self.fp16_range: Fp16RangeReport | None = None

    def compute(self) -> None:
        p = self.p
        if p.programs is None:
            return
        for name, layout in p.req["artifact_layouts"].items():
            self.records[name] = check_layout(
                p.programs,
                name,
                layout,
                p.dims,
                p.emb,
                p.prompt,
                p.ref_results[: p.steps],
                p.hf,
                chunk_say(p.say, f"{name} programs (MIL interpreter)"),
            )
            if name == p.reference and p.readback is not None:
                p.say(f"{name}: the packages' verify and prefill programs (MIL interpreter)")
                self.functions(layout, *p.readback)

    def functions(self, four: ParityLayout, q: LayoutRunner, q_results: list[dict[str, Any]]) -> None:
        """chunk1..4's verify_qK and prefill_chunk1..4's prefill programs, run by
        the interpreter, against the read-back four-chunk decode ``q``
        (``q_results``: its steps)."""
        p = self.p
        assert p.programs is not None
        k = p.verify_k()
        if k and p.steps >= k:
            self.records["verify_qK"] = check_verify(p.programs, four, k, p.dims, p.emb, p.prompt, q_results)
        n = p.prefill
        pf_layout = p.req["prefill_layout"]
        if n and pf_layout:
            again = LayoutRunner(p.dims, four, p.ckpt, modules=q.modules)
            again.steps(p.emb, p.prompt[:n], 0)
            function, recs = check_prefill(
                p.programs, pf_layout, four, n, p.dims, p.emb, p.prompt, q_results, again.caches
            )
            self.records[function] = recs

    def write(self, report: ParityReport) -> None:
        p = self.p
        self.summaries = {
            name: {precision: summarize(by[precision], p.tol, not fp16, p.ill) for precision, fp16 in PRECISIONS}
            for name, by in self.records.items()
        }
        report["programs"] = [r for by in self.records.values() for recs in by.values() for r in recs]
        report["summary"]["programs"] = self.summaries or None
        # The fp16 range of every program run (`fp16range`).
        self.fp16_range = p.programs.watch.report(every=False) if p.programs is not None else None
        report["summary"]["fp16_range"] = self.fp16_range

    def verdicts(self) -> list[Verdict]:
        found: list[Verdict] = [s["verdict"] for by in self.summaries.values() for s in by.values()]
        if self.fp16_range is not None and not self.fp16_range["ok"]:
            # An op the fp16 programs overflow in, where the fp32 ones stay finite.
            found.append("fail")
        return found


CHECK = ProgramsCheck
