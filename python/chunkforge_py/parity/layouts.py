"""The layouts check: every decode layout, verify_qK and the prefill
function against the four-chunk reference, step by step (the report's
``steps``; Rust's `parity_checks::LAYOUTS`).

Teacher-forced decode: step t feeds prompt token t. A decode layout runs the
reference's computation chunk by chunk; after a prefill hand-off every
layout starts from the prefill function's caches, copied by the plan's slot
map as the runtime copies them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from ..contract import (
    ChunkPlan,
    LayerDivergence,
    Localisation,
    ParityLayout,
    ParityReport,
    ParityRequest,
    StepRecord,
    Verdict,
)
from ..emulate.stepper import Caches, Embeddings, LayoutRunner
from .check import Check, Parity, caches_cosine, chunk_say, cosine, margin
from .verdicts import judge


def decode_layouts(req: ParityRequest) -> frozenset[str]:
    """The decode layouts of ``req``: the reference and the layouts compared
    with it, which Rust picks from the layout table by purpose
    (`parity.rs`). Every other step record is a function's."""
    return frozenset({req["reference"], *(layout["name"] for layout in req["layouts"])})


def judge_steps(
    records: list[StepRecord], ill: Collection[int], reference: str, prefill: int, decode: Collection[str]
) -> None:
    """Every step record's verdict (`verdicts.judge`). Decode layouts
    (``decode``: the request's layouts, which Rust takes from the layout
    table) that ran exactly the reference's computation are judged exactly;
    after a prefill hand-off they start from the prefill function's caches,
    not the reference's, so a layout failing at an ill-conditioned step
    where the four-chunk layout (started from the same caches, the same
    computation as every layout) fails too shows the hand-off's deviation,
    not its own. Any other record is a function's: verify_qK and the
    prefill functions compute the steps in another order than decode."""
    four_failed = {r["step"] for r in records if r["layout"] == reference and not r["ok"]}
    for r in records:
        function = r["layout"] not in decode
        exact = not function and not (prefill and (r["layout"] == reference or r["step"] in four_failed))
        r["verdict"] = judge([] if r["ok"] else [r["step"]], ill, exact=exact)


def localise(ref: dict[str, Any], got: dict[str, Any], chunks: list[ChunkPlan], tol: float) -> LayerDivergence:
    """First layer whose output hidden state diverges from the reference's."""
    for layer in sorted(got["trace"]):
        c = cosine(ref["trace"][layer], got["trace"][layer])
        if c < tol:
            chunk = next(ch["name"] for ch in chunks if ch["first_layer"] <= layer <= ch["last_layer"])
            return {"layer": layer, "chunk": chunk, "cos": c}
    return {"layer": None, "chunk": None, "cos": None}


def first_divergence(
    ref_trace: dict[int, Any], got_trace: dict[int, Any], chunks: list[ChunkPlan], tol: float
) -> LayerDivergence:
    """The first layer whose hidden state leaves the reference's."""
    return localise({"trace": ref_trace}, {"trace": got_trace}, chunks, tol)


def step_record(layout: str, step: int, cos: float, ref: dict[str, Any], token: int, tol: float) -> StepRecord:
    """``layout`` at ``step`` against the reference's result ``ref`` there
    (judged once every check has run: `judge_steps`)."""
    ok = cos >= tol and token == ref["token"]
    return {
        "layout": layout,
        "step": step,
        "cos": cos,
        "ref_token": ref["token"],
        "token": token,
        "margin": margin(ref["logits"]),
        "ok": ok,
        "verdict": judge([] if ok else [step], ()),
    }


def prefill_record(
    records: list[StepRecord],
    localisation: dict[str, Localisation],
    prefilled: dict[str, Any],
    ref_caches: Caches,
    ref_results: list[dict[str, Any]],
    tol: float,
) -> None:
    """Prefill of n tokens against n reference decode steps: the caches it
    leaves (all slots, cosine) against the reference's after those steps
    (``ref_caches``), and the token it predicts after the prompt."""
    n = len(ref_results)
    c = caches_cosine(prefilled["runner"].caches, ref_caches)
    rec = step_record(prefilled["function"], n - 1, c, ref_results[-1], prefilled["token"], tol)
    records.append(rec)
    if not rec["ok"]:
        # The first layer whose hidden state at some prompt position leaves the reference's.
        for layer in sorted(prefilled["trace"]):
            worst = min(cosine(ref_results[i]["trace"][layer], prefilled["trace"][layer][i]) for i in range(n))
            if worst < tol:
                chunk = next(ch["name"] for ch in prefilled["chunks"] if ch["first_layer"] <= layer <= ch["last_layer"])
                localisation[prefilled["function"]] = {"step": n - 1, "layer": layer, "chunk": chunk, "cos": worst}
                return
        localisation[prefilled["function"]] = {"step": n - 1, "layer": None, "chunk": None, "cos": c}


def verify_records(
    records: list[StepRecord],
    localisation: dict[str, Localisation],
    vr: LayoutRunner,
    emb: Embeddings,
    prompt: list[int],
    steps: int,
    k: int,
    ref_results: list[dict[str, Any]],
    four: ParityLayout,
    tol: float,
) -> None:
    """Speculative decode with every draft accepted: verify_qK on K
    teacher-forced tokens at a time, then commit its rows. Each position must
    give the token and the (pre-norm) last-layer hidden state of the
    reference's sequential decode step."""
    name = "verify_qK"
    last_layer = max(ref_results[0]["trace"])
    for block, got in enumerate(vr.verify_blocks(emb, prompt, steps, k)):
        pos = block * k
        for i in range(k):
            ref = ref_results[pos + i]
            rec = step_record(
                name, pos + i, cosine(ref["trace"][last_layer], got["hidden"][i]), ref, got["tokens"][i], tol
            )
            records.append(rec)
            if not rec["ok"] and name not in localisation:
                at = {layer: h[i] for layer, h in got["trace"].items()}
                localisation[name] = {"step": pos + i, **first_divergence(ref["trace"], at, four["chunks"], tol)}


class LayoutsCheck(Check):
    """The layouts check (the module docstring)."""

    def __init__(self, p: Parity) -> None:
        super().__init__(p)
        self.records: list[StepRecord] = []
        self.localisation: dict[str, Localisation] = {}

    def compute(self) -> None:
        p = self.p
        runners = {name: LayoutRunner(p.dims, layout, p.ckpt) for name, layout in p.compared.items()}
        p.hooks.layouts(runners)
        if p.prefill:
            prefill_record(
                self.records,
                self.localisation,
                p.prefilled,
                p.ref.kept_caches,
                p.ref_results[: p.prefill],
                p.tol,
            )
            if p.hooks.copies_prefill():
                for name, r in runners.items():
                    r.load_prefill(p.prefilled["runner"], p.compared[name]["kv_slot_map"])
            runners = {p.reference: p.prefilled["runner"], **runners}
        decoded = {}
        for name, r in runners.items():
            decoded[name] = r.steps(p.emb, p.prompt[p.prefill : p.steps], p.prefill, progress=chunk_say(p.say, name))
        for t in range(p.prefill, p.steps):
            r_ref = p.ref_results[t]
            for name in runners:
                got = decoded[name][t - p.prefill]
                rec = step_record(name, t, cosine(r_ref["hidden"], got["hidden"]), r_ref, got["token"], p.tol)
                self.records.append(rec)
                if not rec["ok"] and name not in self.localisation:
                    chunks = p.compared.get(name, p.ref_layout)["chunks"]
                    self.localisation[name] = {"step": t, **localise(r_ref, got, chunks, p.tol)}
        del decoded
        k = p.verify_k()
        if k:
            p.say(f"verify_q{k}")
            vr = LayoutRunner(p.dims, p.ref_layout, p.ckpt, modules=p.ref.modules)
            p.hooks.verify(vr.verify_modules(p.ckpt))
            verify_records(
                self.records, self.localisation, vr, p.emb, p.prompt, p.steps, k, p.ref_results, p.ref_layout, p.tol
            )

    def write(self, report: ParityReport) -> None:
        p = self.p
        judge_steps(self.records, p.ill, p.reference, p.prefill, decode_layouts(p.req))
        report["steps"] = self.records
        failed = [r for r in self.records if not r["ok"]]
        summary = report["summary"]
        summary["layouts"] = sorted(p.compared)
        summary["min_cos"] = min((r["cos"] for r in self.records), default=None)
        summary["min_margin"] = min((r["margin"] for r in self.records), default=None)
        summary["first_failure"] = (
            {
                "layout": failed[0]["layout"],
                "step": failed[0]["step"],
                "cos": failed[0]["cos"],
                "ref_token": failed[0]["ref_token"],
                "token": failed[0]["token"],
            }
            if failed
            else None
        )
        summary["localisation"] = self.localisation or None
        summary["prefill"] = {"tokens": p.prefill, "function": p.prefilled["function"]} if p.prefilled else None
        summary["verify_k"] = p.verify_k()

    def verdicts(self) -> list[Verdict]:
        return [r["verdict"] for r in self.records]


CHECK = LayoutsCheck
