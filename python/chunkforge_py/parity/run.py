"""Parity: every layout against the four-chunk reference, the reference against
transformers, prefill hand-off, and the INT4 weights read back from built packages.

Torch on CPU in fp32, teacher-forced decode: step t feeds prompt token t.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from functools import partial
from typing import Any

import torch

from .. import weights
from ..checkpoint import Checkpoint, Fetcher
from ..contract import (
    ArtifactRecord,
    ArtifactSummary,
    ChunkPlan,
    Dims,
    Fp16RangeReport,
    FunctionArtifactSummary,
    LayerDivergence,
    Localisation,
    OracleRecord,
    ParityLayout,
    ParityReport,
    ParityRequest,
    ParitySummary,
    ProgramRecord,
    ProgramSummary,
    StepRecord,
    Verdict,
    WeightNoise,
    WorstWeight,
)
from ..emulate.stepper import Caches, Embeddings, LayoutRunner, PrefillRunner
from ..model import Projection
from ..runtime import ChunkforgeError, release_memory, trim_heap
from ..weights import Stored, relative_error, shaped, value_of
from . import verdicts
from .noise import int4_verdict, weight_noise
from .programs import Programs, caches_cosine, check_layout, check_prefill, check_verify, cosine
from .verdicts import judge


def decode_layouts(req: ParityRequest) -> frozenset[str]:
    """The decode layouts of ``req``: the reference and the layouts compared
    with it, which Rust picks from the layout table by purpose
    (`parity.rs`). Every other step record is a function's."""
    return frozenset({req["reference"], *(layout["name"] for layout in req["layouts"])})


def margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def corrupt(runner: LayoutRunner, layer: int) -> str:
    """Test hook: negate one weight of ``layer`` to break a layout on purpose."""
    return corrupt_modules(runner.modules, layer)


def corrupt_modules(modules: dict[str, Any], layer: int) -> str:
    """Negate one weight of ``layer`` in whichever of ``modules`` holds it."""
    for name, mod in modules.items():
        if str(layer) in mod.layers:
            proj = mod.layers[str(layer)].mlp.down_proj
            # A new tensor at each use, not an in-place edit: the weight is
            # shared with the reference's modules.
            proj.fetch = partial(negated, proj.fetch)
            return name
    raise ChunkforgeError(f"--corrupt-layer {layer}: no chunk of this layout holds layer {layer}")


def oracle_record(
    step: int, ref: dict[str, Any], hf: dict[str, Any], opinions: list[dict[str, Any]], tol: float
) -> OracleRecord:
    """The reference against transformers at ``step``, with how far
    transformers moves from itself on the same inputs there: the same
    model, weights and inputs computed another way (``opinions``: sdpa
    attention instead of eager, and float64), the worst of them. The sdpa
    kernel orders the attention's arithmetic differently; float64 rounds the
    projections and attention 2^29 times finer (transformers' norms still
    compute in fp32), so it also sees where rounding anywhere else decides
    the result. The step is ill-conditioned when that floor is past the
    tolerance (cosine below ``tol``) or the top-2 logit gap is inside it (at
    most twice the largest logit change: each of the two logits may move by
    that much). There, agreement with transformers cannot be asked of the
    reference any more than of transformers itself."""
    logits, hidden = hf["logits"][step], hf["hidden"][step]
    hf_token = int(logits.argmax())
    c = cosine(ref["hidden"], hidden)
    floor_cos = min(cosine(hidden, o["hidden"][step]) for o in opinions)
    floor_logit = max(float((logits.double() - o["logits"][step].double()).abs().max()) for o in opinions)
    gap = margin(logits)
    ok = c >= tol and hf_token == ref["token"]
    ill = floor_cos < tol or gap <= 2 * floor_logit
    return {
        "step": step,
        "hf_token": hf_token,
        "ref_token": ref["token"],
        "cos": c,
        "margin": gap,
        "ok": ok,
        "floor_cos": floor_cos,
        "floor_logit": floor_logit,
        "ill_conditioned": ill,
        "verdict": judge([] if ok else [step], [step] if ill else []),
    }


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


def negated(source: Any) -> Any:
    """``-source()``: a corrupted weight, made anew at each use (a stored
    one negates every product instead, exactly the same values)."""
    w = source()
    return w.negated() if isinstance(w, Stored) else -w


def localise(ref: dict[str, Any], got: dict[str, Any], chunks: list[ChunkPlan], tol: float) -> LayerDivergence:
    """First layer whose output hidden state diverges from the reference's."""
    for layer in sorted(got["trace"]):
        c = cosine(ref["trace"][layer], got["trace"][layer])
        if c < tol:
            chunk = next(ch["name"] for ch in chunks if ch["first_layer"] <= layer <= ch["last_layer"])
            return {"layer": layer, "chunk": chunk, "cos": c}
    return {"layer": None, "chunk": None, "cos": None}


def first_divergence(
    ref_trace: dict[int, torch.Tensor], got_trace: dict[int, torch.Tensor], chunks: list[ChunkPlan], tol: float
) -> LayerDivergence:
    """The first layer whose hidden state leaves the reference's."""
    return localise({"trace": ref_trace}, {"trace": got_trace}, chunks, tol)


def run_prefill(
    req: ParityRequest,
    dims: Dims,
    ckpt: Checkpoint,
    emb: Embeddings,
    prompt: list[int],
    four: ParityLayout,
    ref: LayoutRunner,
    pf: PrefillRunner | None = None,
) -> tuple[dict[str, Any], PrefillRunner]:
    """Prefill ``prompt`` with the shortest prefill function that holds it and
    load its K/V into a fresh four-chunk runner (sharing the reference's modules)."""
    layout = req.get("prefill_layout")
    if layout is None:
        raise ChunkforgeError(f"--prefill {len(prompt)}: the plan has no prefill functions")
    lens = sorted(f["tokens"] for f in layout["chunks"][0]["functions"])
    fits = [n for n in lens if n >= len(prompt)]
    if not fits:
        raise ChunkforgeError(f"--prefill {len(prompt)}: the longest prefill function takes {lens[-1]} tokens")
    pf = pf or PrefillRunner(dims, layout, ckpt, fits[0])
    res = pf.run(emb, prompt)
    runner = LayoutRunner(dims, four, ckpt, modules=ref.modules)
    runner.load_prefill_kv(res["kv"], len(prompt))
    return {**res, "runner": runner, "function": f"prefill_b{pf.tokens}", "chunks": layout["chunks"]}, pf


def prefill_record(
    records: list[StepRecord],
    localisation: dict[str, Localisation],
    prefilled: dict[str, Any],
    ref_caches: Caches,
    ref_results: list[dict[str, Any]],
    four: ParityLayout,
    tol: float,
) -> None:
    """Prefill of n tokens against n reference decode steps: the caches it
    leaves (all slots, cosine) against the reference's after those steps
    (``ref_caches``), and the token it predicts after the prompt."""
    n = len(ref_results)
    last = ref_results[-1]
    c = caches_cosine(prefilled["runner"].caches, ref_caches)
    ok = c >= tol and prefilled["token"] == last["token"]
    records.append(
        {
            "layout": prefilled["function"],
            "step": n - 1,
            "cos": c,
            "ref_token": last["token"],
            "token": prefilled["token"],
            "margin": margin(last["logits"]),
            "ok": ok,
            "verdict": judge([] if ok else [n - 1], ()),
        }
    )
    if not ok:
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
            c = cosine(ref["trace"][last_layer], got["hidden"][i])
            ok = c >= tol and got["tokens"][i] == ref["token"]
            records.append(
                {
                    "layout": name,
                    "step": pos + i,
                    "cos": c,
                    "ref_token": ref["token"],
                    "token": got["tokens"][i],
                    "margin": margin(ref["logits"]),
                    "ok": ok,
                    "verdict": judge([] if ok else [pos + i], ()),
                }
            )
            if not ok and name not in localisation:
                at = {layer: h[i] for layer, h in got["trace"].items()}
                localisation[name] = {"step": pos + i, **first_divergence(ref["trace"], at, four["chunks"], tol)}


def artifact_functions(
    req: ParityRequest,
    dims: Dims,
    ckpt: Checkpoint,
    emb: Embeddings,
    prompt: list[int],
    steps: int,
    four: ParityLayout,
    q: LayoutRunner,
    q_results: list[dict[str, Any]],
    programs: Programs,
    tol: float,
    ill: Collection[int],
) -> dict[str, FunctionArtifactSummary]:
    """verify_qK of chunk1..4 and the prefill functions of prefill_chunk1..4,
    with the weights read back from their packages, against the INT4
    four-chunk decode ``q`` of the same build (which ran ``steps`` steps)."""
    out: dict[str, FunctionArtifactSummary] = {}
    k = next((f["tokens"] for f in four["chunks"][0]["functions"] if f["kind"] == "verify"), None)
    if k and steps >= k:
        vq = LayoutRunner(dims, four, ckpt, modules=q.modules)
        replaced, _ = load_artifacts_into(vq.verify_modules(ckpt), four["chunks"], programs)
        recs: list[StepRecord] = []
        verify_records(recs, {}, vq, emb, prompt, steps, k, q_results, four, tol)
        out["verify_qK"] = function_summary(recs, replaced, ill)
    n = int(req.get("prefill") or 0)
    pf_layout = req.get("prefill_layout")
    if n and pf_layout:
        again = LayoutRunner(dims, four, ckpt, modules=q.modules)
        again.steps(emb, prompt[:n], 0)
        fits = sorted(f["tokens"] for f in pf_layout["chunks"][0]["functions"] if f["tokens"] >= n)
        pf = PrefillRunner(dims, pf_layout, ckpt, fits[0])
        replaced, _ = load_artifacts_into(pf.modules, pf_layout["chunks"], programs)
        prefilled, _ = run_prefill(req, dims, ckpt, emb, prompt[:n], four, again, pf)
        recs = []
        prefill_record(recs, {}, prefilled, again.caches, q_results[:n], four, tol)
        out[prefilled["function"]] = function_summary(recs, replaced, ill)
    return out


def program_functions(
    req: ParityRequest,
    programs: Programs,
    dims: Dims,
    ckpt: Checkpoint,
    emb: Embeddings,
    prompt: list[int],
    steps: int,
    four: ParityLayout,
    q: LayoutRunner,
    q_results: list[dict[str, Any]],
    tol: float,
    ill: Collection[int],
    summary: dict[str, dict[str, ProgramSummary]],
    records: list[ProgramRecord],
) -> None:
    """chunk1..4's verify_qK and prefill_chunk1..4's prefill programs, run by
    the interpreter, against the read-back four-chunk decode ``q``."""
    k = next((f["tokens"] for f in four["chunks"][0]["functions"] if f["kind"] == "verify"), None)
    if k and steps >= k:
        summary["verify_qK"], recs = check_verify(programs, four, k, dims, emb, prompt, q_results, tol, ill)
        records += recs
    n = int(req.get("prefill") or 0)
    pf_layout = req.get("prefill_layout")
    if n and pf_layout:
        again = LayoutRunner(dims, four, ckpt, modules=q.modules)
        again.steps(emb, prompt[:n], 0)
        function, by, recs = check_prefill(
            programs, pf_layout, four, n, dims, emb, prompt, q_results, again.caches, tol, ill
        )
        summary[function] = by
        records += recs


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


def chunk_say(say: Callable[[str], None], layout: str) -> Callable[[str, int], None]:
    """`LayoutRunner.steps`' progress as parity phases: ``layout: chunk over n steps``."""
    return lambda chunk, n: say(f"{layout}: {chunk} over {n} decode steps")


def run(req: ParityRequest, progress: Callable[[str], None] | None = None) -> ParityReport:
    """Every parity check of ``req``; ``progress(what)`` is told each phase
    as it starts (the command's spinner, or a log line)."""
    tell = progress or (lambda _what: None)

    def say(what: str) -> None:
        # Each phase starts from what the last one left: its cycles
        # collected and the heap's freed pages given back (at E2B size the
        # verify and prefill programs left 6.0 GiB resident, 2 GiB of it freed).
        release_memory()
        tell(what)

    started = time.perf_counter()
    torch.set_grad_enabled(False)
    plan = req["plan"]
    dims = plan["dims"]
    ckpt = Checkpoint(req["checkpoint"])
    emb = Embeddings(dims, ckpt)
    prompt: list[int] = req["prompt_ids"]
    steps: int = req["steps"]
    tol: float = req["tol_cos"]
    if len(prompt) < steps:
        raise ChunkforgeError(f"the prompt has {len(prompt)} tokens but --steps is {steps}")
    bad = [t for t in prompt[:steps] if not 0 <= t < dims["vocab_size"]]
    if bad:
        raise ChunkforgeError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{dims['vocab_size'] - 1})")
    if steps > dims["ctx"]:
        raise ChunkforgeError(f"--steps {steps} exceeds --ctx {dims['ctx']}")

    layouts: dict[str, ParityLayout] = {layout["name"]: layout for layout in req["layouts"]}
    reference = req["reference"]
    ref_layout = layouts.pop(reference)
    ref = LayoutRunner(dims, ref_layout, ckpt)
    runners = {name: LayoutRunner(dims, layout, ckpt) for name, layout in layouts.items()}
    corrupted = None
    # Test hook: break one layer of the compared layouts, or (--corrupt-function)
    # of the verify or prefill modules only.
    # (--corrupt-function requires --corrupt-layer.)
    corrupt_function = req.get("corrupt_function")
    corrupt_layer = req.get("corrupt_layer")
    if corrupt_layer is not None and not corrupt_function:
        for r in runners.values():
            corrupted = corrupt(r, int(corrupt_layer))

    prefill = int(req.get("prefill") or 0)
    if prefill >= steps:
        raise ChunkforgeError(f"--prefill {prefill} leaves no decode steps (--steps {steps})")

    records: list[StepRecord] = []
    localisation: dict[str, Localisation] = {}
    # Set (non-empty) exactly when ``prefill``.
    prefilled: dict[str, Any] = {}
    if prefill:
        say(f"prefill of {prefill} tokens")
        # The runtime's start of a prompt: one batched prefill call writes every
        # layer's K/V into the four-chunk caches; merged layouts copy those by
        # the slot map before their first decode step.
        prefilled, pf = run_prefill(req, dims, ckpt, emb, prompt[:prefill], ref_layout, ref)
        if corrupt_function == "prefill" and corrupt_layer is not None:
            corrupted = corrupt_modules(pf.modules, int(corrupt_layer))
            prefilled, pf = run_prefill(req, dims, ckpt, emb, prompt[:prefill], ref_layout, ref, pf)
        runners = {reference: prefilled["runner"], **runners}
    # Teacher forcing: every layout runs all its steps chunk by chunk
    # (`LayoutRunner.steps`), then the records are made step by step.
    ref_results = ref.steps(
        emb, prompt[:steps], 0, keep_caches_after=prefill - 1 if prefill else None, progress=chunk_say(say, reference)
    )
    if prefill:
        prefill_record(records, localisation, prefilled, ref.kept_caches, ref_results[:prefill], ref_layout, tol)
        if not req.get("skip_prefill_copy"):
            for name, r in runners.items():
                if name != reference:
                    r.load_prefill(prefilled["runner"], layouts[name]["kv_slot_map"])
    decoded = {}
    for name, r in runners.items():
        decoded[name] = r.steps(emb, prompt[prefill:steps], prefill, progress=chunk_say(say, name))
    for t in range(prefill, steps):
        r_ref = ref_results[t]
        for name in runners:
            got = decoded[name][t - prefill]
            c = cosine(r_ref["hidden"], got["hidden"])
            ok = c >= tol and got["token"] == r_ref["token"]
            records.append(
                {
                    "layout": name,
                    "step": t,
                    "cos": c,
                    "ref_token": r_ref["token"],
                    "token": got["token"],
                    "margin": margin(r_ref["logits"]),
                    "ok": ok,
                    "verdict": judge([] if ok else [t], ()),
                }
            )
            if not ok and name not in localisation:
                localisation[name] = {"step": t, **localise(r_ref, got, layouts.get(name, ref_layout)["chunks"], tol)}
    del decoded

    verify_k = next((f["tokens"] for f in ref_layout["chunks"][0]["functions"] if f["kind"] == "verify"), None)
    if verify_k:
        say(f"verify_q{verify_k}")
        vr = LayoutRunner(dims, ref_layout, ckpt, modules=ref.modules)
        vr.verify_modules(ckpt)
        if corrupt_function == "verify" and corrupt_layer is not None:
            corrupted = corrupt_modules(vr.verify_modules(), int(corrupt_layer))
        verify_records(records, localisation, vr, emb, prompt, steps, verify_k, ref_results, ref_layout, tol)

    oracle: list[OracleRecord] = []
    hf: dict[str, Any] | None = None
    if req.get("oracle", True):
        from .oracle import SECOND_ATTENTION, Oracle

        # transformers reads each weight once per forward (`Oracle.teacher_forced`
        # keeps none): the reference's weights leave the budget first, so its
        # 2.5 GiB is not held beside the layers' float copies (at E2B size the
        # float64 pass's made this run's peak, 5.9 GiB with them).
        weights.RESIDENT.release(lambda key: not (isinstance(key, tuple) and key[:1] == ("checkpoint",)))
        say("transformers (eager attention)")
        model = Oracle(req["config_path"], ckpt)
        hf = model.teacher_forced(prompt[:steps], emb)
        # transformers against itself: another attention kernel, and float64.
        say(f"transformers ({SECOND_ATTENTION} attention), its noise floor")
        opinions = [model.teacher_forced(prompt[:steps], emb, SECOND_ATTENTION)]
        del model
        say("transformers (float64), its noise floor")
        opinions.append(Oracle(req["config_path"], ckpt, torch.float64).teacher_forced(prompt[:steps], emb))
        for t in range(steps):
            oracle.append(oracle_record(t, ref_results[t], hf, opinions, tol))
        del opinions
    ill = {o["step"] for o in oracle if o["ill_conditioned"]}

    artifacts: list[ArtifactRecord] = []
    artifact_summary: dict[str, ArtifactSummary] = {}
    program_records: list[ProgramRecord] = []
    program_summary: dict[str, dict[str, ProgramSummary]] = {}
    fp16_range: Fp16RangeReport | None = None
    build_dir = req.get("artifacts")
    if build_dir:
        # The checkpoint's projections are read once each from here on (each
        # read-back weight's relative MSE): the budget goes to the packages'.
        weights.RESIDENT.release(lambda key: not (isinstance(key, tuple) and key[:1] == ("checkpoint",)))
        release_memory()
        programs = Programs(build_dir)
        first_tokens: list[int] | None = None
        # Every layout holds the same weights: one noise run serves them all.
        noise: WeightNoise | None = None
        for name, layout in req["artifact_layouts"].items():
            say(f"{name}: the packages' weights read back")
            q = LayoutRunner(dims, layout, ckpt)
            replaced, rels = load_artifacts(q, programs)
            worst = worst_weight(rels)
            agree = 0
            coss = []
            tokens = []
            q_results = q.steps(emb, prompt[:steps], 0, progress=chunk_say(say, f"{name} read back"))
            for t, got in enumerate(q_results):
                c = cosine(ref_results[t]["hidden"], got["hidden"])
                same = got["token"] == ref_results[t]["token"]
                agree += same
                coss.append(c)
                tokens.append(got["token"])
                artifacts.append(
                    {
                        "layout": name,
                        "step": t,
                        "cos": c,
                        "ref_token": ref_results[t]["token"],
                        "token": got["token"],
                        "same_token": same,
                    }
                )
            # Every layout's INT4 model holds the same palettized weights, so their
            # tokens must agree with each other even where INT4 moves them off fp32.
            if first_tokens is None:
                first_tokens = tokens
            top1 = agree / steps
            ok = (
                min(coss) >= req["tol_cos_int4"]
                and top1 >= req["min_top1_int4"]
                and worst["rel_mse"] <= req["max_weight_rel_mse"]
                and tokens == first_tokens
            )
            # The packages' own programs against these read-back modules.
            summ, recs = check_layout(
                programs,
                name,
                layout,
                dims,
                emb,
                prompt,
                ref_results[:steps],
                hf,
                tol,
                ill,
                chunk_say(say, f"{name} programs (MIL interpreter)"),
            )
            program_summary[name] = summ
            program_records += recs
            if name == reference:
                # The packages' own verify and prefill weights against the same
                # INT4 model's sequential decode: equal up to fp32 rounding.
                say(f"{name}: the packages' verify and prefill functions, read back")
                artifact_summary.update(
                    artifact_functions(req, dims, ckpt, emb, prompt, steps, layout, q, q_results, programs, tol, ill)
                )
                say(f"{name}: the packages' verify and prefill programs (MIL interpreter)")
                program_functions(
                    req,
                    programs,
                    dims,
                    ckpt,
                    emb,
                    prompt,
                    steps,
                    layout,
                    q,
                    q_results,
                    tol,
                    ill,
                    program_summary,
                    program_records,
                )
            # Loose thresholds over all steps: judged as they stand, unless
            # the weights and tokens held and weight noise of the
            # palettization's size fails them too (noise.py).
            verdict: Verdict = "ok" if ok else "fail"
            noise_here: WeightNoise | None = None
            if not ok and worst["rel_mse"] <= req["max_weight_rel_mse"] and tokens == first_tokens:
                if noise is None:
                    say(f"{name}: weight noise of the palettization's size (the INT4 check's noise floor)")
                    noise = weight_noise(
                        dims,
                        layout,
                        ckpt,
                        rels,
                        emb,
                        prompt[:steps],
                        ref_results[:steps],
                        chunk_say(say, f"{name} weight noise"),
                    )
                noise_here = noise
                verdict = int4_verdict(min(coss), top1, noise, req)
            artifact_summary[name] = {
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
        fp16_range = programs.watch.report(every=False)

    judge_steps(records, ill, reference, prefill, decode_layouts(req))
    failed_steps = [r for r in records if not r["ok"]]
    failed_oracle = [o for o in oracle if not o["ok"]]
    summary: ParitySummary = {
        # Set below from every check's rows (`verdicts.CHECKS`).
        "ok": False,
        "verdict": "fail",
        "steps": steps,
        "decode_steps": steps - prefill,
        "tol_cos": tol,
        "layouts": sorted(layouts),
        "min_cos": min((r["cos"] for r in records), default=None),
        "min_margin": min((r["margin"] for r in records), default=None),
        "oracle_ok": not failed_oracle if oracle else None,
        "oracle_min_cos": min((o["cos"] for o in oracle), default=None),
        "ill_conditioned": [o["step"] for o in oracle if o["ill_conditioned"]] if oracle else None,
        "first_failure": (
            {
                "layout": failed_steps[0]["layout"],
                "step": failed_steps[0]["step"],
                "cos": failed_steps[0]["cos"],
                "ref_token": failed_steps[0]["ref_token"],
                "token": failed_steps[0]["token"],
            }
            if failed_steps
            else None
        ),
        "localisation": localisation or None,
        "prefill": (
            {"tokens": prefill, "function": prefilled["function"], "kv_copied": not req.get("skip_prefill_copy")}
            if prefilled
            else None
        ),
        "verify_k": verify_k,
        "artifacts": artifact_summary or None,
        "artifacts_precision": req.get("artifacts_precision") if build_dir else None,
        "programs": program_summary or None,
        "corrupted_chunk": corrupted,
        "fp16_range": fp16_range,
        "seconds": time.perf_counter() - started,
    }
    report: ParityReport = {
        "steps": records,
        "oracle": oracle,
        "artifacts": artifacts,
        "programs": program_records,
        "summary": summary,
    }
    summary["verdict"] = verdicts.of_report(report)
    if fp16_range is not None and not fp16_range["ok"]:
        # An op the fp16 programs overflow in, where the fp32 ones stay finite.
        summary["verdict"] = "fail"
    summary["ok"] = summary["verdict"] == "ok"
    weights.write_stats()
    return report
