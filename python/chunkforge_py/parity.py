"""Parity: every layout against the four-chunk reference, the reference against
transformers, prefill hand-off, and the INT4 weights read back from built packages.

Torch on CPU in fp32, teacher-forced decode: step t feeds prompt token t.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from .checkpoint import Checkpoint
from .contract import (
    ArtifactRecord,
    ArtifactSummary,
    ChunkPlan,
    Dims,
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
    WorstWeight,
)
from .parity_programs import Programs, caches_cosine, check_layout, check_prefill, check_verify, cosine
from .runtime import ChunkforgeError
from .stepper import Embeddings, LayoutRunner, PrefillRunner


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
            w = mod.layers[str(layer)].mlp.down_proj.weight
            # A new tensor, not an in-place edit: checkpoint tensors may share
            # memory-mapped storage with the reference's modules.
            w.data = -w.data.clone()
            return name
    raise ChunkforgeError(f"--corrupt-layer {layer}: no chunk of this layout holds layer {layer}")


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
    ref: LayoutRunner,
    ref_results: list[dict[str, Any]],
    four: ParityLayout,
    tol: float,
) -> None:
    """Prefill of n tokens against n reference decode steps: the caches it
    leaves (all slots, cosine) and the token it predicts after the prompt."""
    n = len(ref_results)
    last = ref_results[-1]
    c = caches_cosine(prefilled["runner"].caches, ref.caches)
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
    for pos in range(0, steps - k + 1, k):
        got = vr.verify(emb, prompt[pos : pos + k], pos)
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
                }
            )
            if not ok and name not in localisation:
                at = {layer: h[i] for layer, h in got["trace"].items()}
                localisation[name] = {"step": pos + i, **first_divergence(ref["trace"], at, four["chunks"], tol)}
        vr.commit(got["new"], pos, k)


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
    build_dir: str,
    tol: float,
) -> dict[str, FunctionArtifactSummary]:
    """verify_qK of chunk1..4 and the prefill functions of prefill_chunk1..4,
    with the weights read back from their packages, against the INT4
    four-chunk decode ``q`` of the same build (which ran ``steps`` steps)."""
    out: dict[str, FunctionArtifactSummary] = {}
    k = next((f["tokens"] for f in four["chunks"][0]["functions"] if f["kind"] == "verify"), None)
    if k and steps >= k:
        vq = LayoutRunner(dims, four, ckpt, modules=q.modules)
        replaced, _ = load_artifacts_into(vq.verify_modules(ckpt), four["chunks"], build_dir)
        recs: list[StepRecord] = []
        verify_records(recs, {}, vq, emb, prompt, steps, k, q_results, four, tol)
        out["verify_qK"] = function_summary(recs, replaced)
    n = int(req.get("prefill") or 0)
    pf_layout = req.get("prefill_layout")
    if n and pf_layout:
        again = LayoutRunner(dims, four, ckpt, modules=q.modules)
        for t in range(n):
            again.step(emb, prompt[t], t)
        fits = sorted(f["tokens"] for f in pf_layout["chunks"][0]["functions"] if f["tokens"] >= n)
        pf = PrefillRunner(dims, pf_layout, ckpt, fits[0])
        replaced, _ = load_artifacts_into(pf.modules, pf_layout["chunks"], build_dir)
        prefilled, _ = run_prefill(req, dims, ckpt, emb, prompt[:n], four, again, pf)
        recs = []
        prefill_record(recs, {}, prefilled, again, q_results[:n], four, tol)
        out[prefilled["function"]] = function_summary(recs, replaced)
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
    summary: dict[str, dict[str, ProgramSummary]],
    records: list[ProgramRecord],
) -> None:
    """chunk1..4's verify_qK and prefill_chunk1..4's prefill programs, run by
    the interpreter, against the read-back four-chunk decode ``q``."""
    k = next((f["tokens"] for f in four["chunks"][0]["functions"] if f["kind"] == "verify"), None)
    if k and steps >= k:
        summary["verify_qK"], recs = check_verify(programs, four, k, dims, emb, prompt, q_results, tol)
        records += recs
    n = int(req.get("prefill") or 0)
    pf_layout = req.get("prefill_layout")
    if n and pf_layout:
        again = LayoutRunner(dims, four, ckpt, modules=q.modules)
        for t in range(n):
            again.step(emb, prompt[t], t)
        function, by, recs = check_prefill(
            programs, pf_layout, four, n, dims, emb, prompt, q_results, again.caches, tol
        )
        summary[function] = by
        records += recs


def function_summary(records: list[StepRecord], replaced: dict[str, int]) -> FunctionArtifactSummary:
    """The artifact summary of one function's records."""
    return {
        "weights_replaced": replaced,
        "min_cos": min(r["cos"] for r in records),
        "steps": len(records),
        "tokens_match": all(r["token"] == r["ref_token"] for r in records),
        "ok": all(r["ok"] for r in records),
    }


def artifact_weights(package: str) -> dict[str, torch.Tensor]:
    """Dense fp32 weights of every palettized const in a built package (LUT +
    indices -> dense) or, in a --no-quantize build, every fp16 matrix const."""
    from .inspect_pkg import const_key, read_package

    if not os.path.isdir(package):
        raise ChunkforgeError(f"{package}: package not found (build it with `chunkforge build --mode all`)")
    _, prog, default = read_package(package)
    out = {}
    for op in prog.functions[default].operations:
        if op.op_type == "constexpr_lut_to_dense":
            out[const_key(op.name)] = torch.from_numpy(op.materialized_val_inference().astype("float32"))
        elif op.op_type == "const" and not op.name.startswith("const_"):
            val = op.outputs[0].val
            if isinstance(val, np.ndarray) and val.dtype == np.float16 and val.ndim >= 2:
                out.setdefault(const_key(op.name), torch.from_numpy(val.astype("float32")))
    return out


def load_artifacts(runner: LayoutRunner, build_dir: str) -> tuple[dict[str, int], WorstWeight]:
    """Replace every projection weight of the runner's modules with the package's
    dequantized one. Returns replaced counts per chunk and the worst relative
    MSE (dequantized vs checkpoint weight), which exposes a weight stored in the
    wrong layer or slot (relative MSE ~2) as clearly as a bad quantizer."""
    return load_artifacts_into(runner.modules, runner.chunks, build_dir)


def load_artifacts_into(
    modules: dict[str, Any], chunks: list[ChunkPlan], build_dir: str
) -> tuple[dict[str, int], WorstWeight]:
    counts = {}
    worst: WorstWeight = {"weight": None, "rel_mse": 0.0}
    for chunk in chunks:
        mod = modules[chunk["name"]]
        dense = artifact_weights(os.path.join(build_dir, f"{chunk['name']}.mlpackage"))
        replaced = 0
        new_state = {}
        for pname, p in mod.named_parameters():
            if p.dim() != 4:
                # Projections are [out, in, 1, 1] convolution weights; the rest
                # (norm weights) are vectors the packages keep in fp16.
                continue
            key = pname.replace(".", "_")
            if key not in dense:
                raise ChunkforgeError(
                    f"{chunk['name']}.mlpackage: no weight {key} for {pname} (built from a different plan?)"
                )
            # coremltools may store a 1x1 convolution's weight as [out, in, 1].
            if dense[key].numel() != p.numel() or dense[key].shape[:2] != p.shape[:2]:
                raise ChunkforgeError(
                    f"{chunk['name']}.mlpackage: weight {pname} has shape {tuple(dense[key].shape)}, "
                    f"the plan expects {tuple(p.shape)}"
                )
            dense[key] = dense[key].reshape(p.shape)
            rel = float(((dense[key] - p.float()) ** 2).mean() / (p.float() ** 2).mean().clamp_min(1e-30))
            if rel > worst["rel_mse"]:
                worst = {"weight": f"{chunk['name']}:{pname}", "rel_mse": rel}
            new_state[pname] = dense[key]
            replaced += 1
        # New tensors, not in-place copies: the originals are shared with the reference.
        mod.load_state_dict(new_state, strict=False, assign=True)
        counts[chunk["name"]] = replaced
    return counts, worst


def run(req: ParityRequest) -> ParityReport:
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
    ref_results: list[dict[str, Any]] = []
    localisation: dict[str, Localisation] = {}
    # Set (non-empty) exactly when ``prefill``.
    prefilled: dict[str, Any] = {}
    if prefill:
        # The runtime's start of a prompt: one batched prefill call writes every
        # layer's K/V into the four-chunk caches; merged layouts copy those by
        # the slot map before their first decode step.
        prefilled, pf = run_prefill(req, dims, ckpt, emb, prompt[:prefill], ref_layout, ref)
        if corrupt_function == "prefill" and corrupt_layer is not None:
            corrupted = corrupt_modules(pf.modules, int(corrupt_layer))
            prefilled, pf = run_prefill(req, dims, ckpt, emb, prompt[:prefill], ref_layout, ref, pf)
        runners = {reference: prefilled["runner"], **runners}
    for t in range(steps):
        token = prompt[t]
        if t == prefill and prefill:
            prefill_record(records, localisation, prefilled, ref, ref_results, ref_layout, tol)
            if not req.get("skip_prefill_copy"):
                for name, r in runners.items():
                    if name != reference:
                        r.load_prefill(prefilled["runner"], layouts[name]["kv_slot_map"])
        r_ref = ref.step(emb, token, t)
        ref_results.append(
            {"token": r_ref["token"], "hidden": r_ref["hidden"], "logits": r_ref["logits"], "trace": r_ref["trace"]}
        )
        if t < prefill:
            continue
        for name, r in runners.items():
            got = r.step(emb, token, t)
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
                }
            )
            if not ok and name not in localisation:
                localisation[name] = {"step": t, **localise(r_ref, got, layouts.get(name, ref_layout)["chunks"], tol)}

    verify_k = next((f["tokens"] for f in ref_layout["chunks"][0]["functions"] if f["kind"] == "verify"), None)
    if verify_k:
        vr = LayoutRunner(dims, ref_layout, ckpt, modules=ref.modules)
        vr.verify_modules(ckpt)
        if corrupt_function == "verify" and corrupt_layer is not None:
            corrupted = corrupt_modules(vr.verify_modules(), int(corrupt_layer))
        verify_records(records, localisation, vr, emb, prompt, steps, verify_k, ref_results, ref_layout, tol)

    oracle: list[OracleRecord] = []
    hf: dict[str, Any] | None = None
    if req.get("oracle", True):
        from .oracle import load_hf_model, teacher_forced

        hf = teacher_forced(load_hf_model(req["config_path"], ckpt), prompt[:steps], emb)
        for t in range(steps):
            hf_token = int(hf["logits"][t].argmax())
            c = cosine(ref_results[t]["hidden"], hf["hidden"][t])
            oracle.append(
                {
                    "step": t,
                    "hf_token": hf_token,
                    "ref_token": ref_results[t]["token"],
                    "cos": c,
                    "margin": margin(hf["logits"][t]),
                    "ok": c >= tol and hf_token == ref_results[t]["token"],
                }
            )

    artifacts: list[ArtifactRecord] = []
    artifact_summary: dict[str, ArtifactSummary] = {}
    program_records: list[ProgramRecord] = []
    program_summary: dict[str, dict[str, ProgramSummary]] = {}
    build_dir = req.get("artifacts")
    if build_dir:
        programs = Programs(build_dir)
        first_tokens: list[int] | None = None
        for name, layout in req["artifact_layouts"].items():
            q = LayoutRunner(dims, layout, ckpt)
            replaced, worst = load_artifacts(q, build_dir)
            agree = 0
            coss = []
            tokens = []
            q_results = []
            for t in range(steps):
                got = q.step(emb, prompt[t], t)
                q_results.append(got)
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
            summ, recs = check_layout(programs, name, layout, dims, emb, prompt, ref_results[:steps], hf, tol)
            program_summary[name] = summ
            program_records += recs
            if name == reference:
                # The packages' own verify and prefill weights against the same
                # INT4 model's sequential decode: equal up to fp32 rounding.
                artifact_summary.update(
                    artifact_functions(req, dims, ckpt, emb, prompt, steps, layout, q, q_results, build_dir, tol)
                )
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
                    program_summary,
                    program_records,
                )
            artifact_summary[name] = {
                "weights_replaced": replaced,
                "worst_weight": worst,
                "min_cos": min(coss),
                "mean_cos": sum(coss) / len(coss),
                "top1_agreement": top1,
                "tokens_match_other_layouts": tokens == first_tokens,
                "ok": ok,
            }

    failed_steps = [r for r in records if not r["ok"]]
    failed_oracle = [o for o in oracle if not o["ok"]]
    failed_artifacts = [n for n, s in artifact_summary.items() if not s["ok"]]
    failed_artifacts += [n for n, by in program_summary.items() if not all(p["ok"] for p in by.values())]
    summary: ParitySummary = {
        "ok": not failed_steps and not failed_oracle and not failed_artifacts,
        "steps": steps,
        "decode_steps": steps - prefill,
        "tol_cos": tol,
        "layouts": sorted(layouts),
        "min_cos": min((r["cos"] for r in records), default=None),
        "min_margin": min((r["margin"] for r in records), default=None),
        "oracle_ok": not failed_oracle if oracle else None,
        "oracle_min_cos": min((o["cos"] for o in oracle), default=None),
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
        "seconds": time.perf_counter() - started,
    }
    return {"steps": records, "oracle": oracle, "artifacts": artifacts, "programs": program_records, "summary": summary}
