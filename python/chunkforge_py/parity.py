"""Parity: every layout against the four-chunk reference, the reference against
transformers, prefill hand-off, and the INT4 weights read back from built packages.

Torch on CPU in fp32, teacher-forced decode: step t feeds prompt token t.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from .checkpoint import Checkpoint
from .runtime import ChunkforgeError
from .stepper import Embeddings, LayoutRunner


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().view(-1), b.double().view(-1), dim=0))


def margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def corrupt(runner: LayoutRunner, layer: int) -> str:
    """Test hook: negate one weight of ``layer`` to break a layout on purpose."""
    for name, mod in runner.modules.items():
        if str(layer) in mod.layers:
            w = mod.layers[str(layer)].mlp.down_proj.weight
            # A new tensor, not an in-place edit: checkpoint tensors may share
            # memory-mapped storage with the reference's modules.
            w.data = -w.data.clone()
            return name
    raise ChunkforgeError(f"--corrupt-layer {layer}: no chunk of this layout holds layer {layer}")


def localise(ref: dict[str, Any], got: dict[str, Any], chunks: list[dict[str, Any]], tol: float) -> dict[str, Any]:
    """First layer whose output hidden state diverges from the reference's."""
    for layer in sorted(got["trace"]):
        c = cosine(ref["trace"][layer], got["trace"][layer])
        if c < tol:
            chunk = next(ch["name"] for ch in chunks if ch["first_layer"] <= layer <= ch["last_layer"])
            return {"layer": layer, "chunk": chunk, "cos": c}
    return {"layer": None, "chunk": None, "cos": None}


def const_key(name: str) -> str:
    """A package const's name reduced to the torch parameter path with dots as
    underscores (coremltools appends `_promoted_to_fp16`, `_palettized`, ...)."""
    for suffix in ("_palettized", "_promoted_to_fp16", "_to_fp16"):
        name = name.removesuffix(suffix)
    return name


def artifact_weights(package: str) -> dict[str, torch.Tensor]:
    """Dense fp32 weights of every palettized const in a built package (LUT + indices -> dense)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as mil_load

    if not os.path.isdir(package):
        raise ChunkforgeError(f"{package}: package not found (build it with `chunkforge build --mode all`)")
    model = ct.models.MLModel(package, skip_model_load=True)
    spec = model.get_spec()
    prog = mil_load(spec, specification_version=spec.specificationVersion, file_weights_dir=model.weights_dir)
    out = {}
    for op in prog.functions["main"].operations:
        if op.op_type == "constexpr_lut_to_dense":
            out[const_key(op.name)] = torch.from_numpy(op.materialized_val_inference().astype("float32"))
    return out


def load_artifacts(runner: LayoutRunner, build_dir: str) -> tuple[dict[str, int], dict[str, Any]]:
    """Replace every projection weight of the runner's modules with the package's
    dequantized one. Returns replaced counts per chunk and the worst relative
    MSE (dequantized vs checkpoint weight), which exposes a weight stored in the
    wrong layer or slot (relative MSE ~2) as clearly as a bad quantizer."""
    counts = {}
    worst = {"weight": None, "rel_mse": 0.0}
    for chunk in runner.chunks:
        mod = runner.modules[chunk["name"]]
        dense = artifact_weights(os.path.join(build_dir, f"{chunk['name']}.mlpackage"))
        replaced = 0
        new_state = {}
        for pname, p in mod.named_parameters():
            if p.dim() != 2:
                continue
            key = pname.replace(".", "_")
            if key not in dense:
                raise ChunkforgeError(
                    f"{chunk['name']}.mlpackage: no palettized weight for {pname} "
                    "(package built without quantization, or from a different plan?)"
                )
            if tuple(dense[key].shape) != tuple(p.shape):
                raise ChunkforgeError(
                    f"{chunk['name']}.mlpackage: weight {pname} has shape {tuple(dense[key].shape)}, "
                    f"the plan expects {tuple(p.shape)}"
                )
            rel = float(((dense[key] - p.float()) ** 2).mean() / (p.float() ** 2).mean().clamp_min(1e-30))
            if rel > worst["rel_mse"]:
                worst = {"weight": f"{chunk['name']}:{pname}", "rel_mse": rel}
            new_state[pname] = dense[key]
            replaced += 1
        # New tensors, not in-place copies: the originals are shared with the reference.
        mod.load_state_dict(new_state, strict=False, assign=True)
        counts[chunk["name"]] = replaced
    return counts, worst


def run(req: dict[str, Any]) -> dict[str, Any]:
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

    layouts = {layout["name"]: layout for layout in req["layouts"]}
    ref_layout = layouts.pop(req["reference"])
    ref = LayoutRunner(dims, ref_layout, ckpt)
    runners = {name: LayoutRunner(dims, layout, ckpt) for name, layout in layouts.items()}
    corrupted = None
    if req.get("corrupt_layer") is not None:
        for r in runners.values():
            corrupted = corrupt(r, int(req["corrupt_layer"]))

    prefill = int(req.get("prefill") or 0)
    if prefill >= steps:
        raise ChunkforgeError(f"--prefill {prefill} leaves no decode steps (--steps {steps})")

    records: list[dict[str, Any]] = []
    ref_results: list[dict[str, Any]] = []
    localisation: dict[str, Any] = {}
    for t in range(steps):
        token = prompt[t]
        if t == prefill and prefill and not req.get("skip_prefill_copy"):
            # Hand-off: the reference's caches now hold exactly the prefill tokens.
            for name, r in runners.items():
                r.load_prefill(ref, layouts[name]["kv_slot_map"])
        r_ref = ref.step(emb, token, t)
        ref_results.append({"token": r_ref["token"], "hidden": r_ref["hidden"], "logits": r_ref["logits"]})
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
                localisation[name] = {"step": t, **localise(r_ref, got, layouts[name]["chunks"], tol)}

    oracle: list[dict[str, Any]] = []
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

    artifacts: list[dict[str, Any]] = []
    artifact_summary: dict[str, Any] = {}
    if req.get("artifacts"):
        build_dir = req["artifacts"]
        first_tokens: list[int] | None = None
        for name, layout in req["artifact_layouts"].items():
            q = LayoutRunner(dims, layout, ckpt)
            replaced, worst = load_artifacts(q, build_dir)
            agree = 0
            coss = []
            tokens = []
            for t in range(steps):
                got = q.step(emb, prompt[t], t)
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
    summary = {
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
            {k: failed_steps[0][k] for k in ("layout", "step", "cos", "ref_token", "token")} if failed_steps else None
        ),
        "localisation": localisation or None,
        "prefill": {"tokens": prefill, "kv_copied": not req.get("skip_prefill_copy")} if prefill else None,
        "artifacts": artifact_summary or None,
        "corrupted_chunk": corrupted,
        "seconds": time.perf_counter() - started,
    }
    return {"steps": records, "oracle": oracle, "artifacts": artifacts, "summary": summary}
