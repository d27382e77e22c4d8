"""A CPU emulation of the on-device runtime: builds each decode step's inputs
(embeddings, masks, RoPE tables) and carries caches between the chunks of a
layout, exactly as the Swift runtime does with the Core ML packages."""

from __future__ import annotations

from typing import Any

import torch

from .checkpoint import Checkpoint
from .contract import ChunkPlan, Dims, FunctionKind, FunctionPlan, Layout, ParityLayout, SlotCopy
from .model import MASK_MIN, Chunk, build_chunk


def inv_freq(dims: Dims, kind: str) -> torch.Tensor:
    """Rotary inverse frequencies. Full layers use Gemma 4's proportional RoPE:
    only the first ``partial_rotary_factor * head_dim / 2`` pairs rotate, with
    exponents taken over the whole head dim; the rest have frequency 0.

    Computed in float32 the way the runtime's tables (and transformers) do, so
    large positions round identically."""
    if kind == "sliding":
        hd, theta = dims["head_dim_sliding"], dims["rope_theta_sliding"]
        return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    hd, theta = dims["head_dim_full"], dims["rope_theta_full"]
    angles = int(dims["partial_rotary_factor_full"] * hd // 2)
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / hd))
    return torch.cat([rotated, torch.zeros(hd // 2 - angles, dtype=torch.float32)])


def rope(dims: Dims, kind: str, pos: int, dtype: torch.dtype, tokens: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin rows [1, 1, tokens, head_dim] for positions pos..pos+tokens-1."""
    positions = torch.arange(pos, pos + tokens, dtype=torch.float32).view(-1, 1)
    freqs = positions * inv_freq(dims, kind).float().view(1, -1)
    emb = torch.cat([freqs, freqs], dim=-1).view(1, 1, tokens, -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def step_masks(
    ctx: int, window: int, pos: int, dtype: torch.dtype, tokens: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Additive masks and the full-cache write mask for tokens at pos..pos+tokens-1.

    Full cache slot j holds position j. The window cache, once this call has
    appended its tokens, holds the newest ``window`` keys at its end: slot s
    holds position pos + tokens - window + s. Query i (position pos + i) sees
    the slots holding positions in (pos + i - window, pos + i]. One token gives
    the decode shapes ([1,1,1,ctx], [1,1,1,W], update_mask [1,1,ctx,1]); K
    tokens the verify ones (update_indicator [1,1,ctx,K]), where sliding row i
    is the decode row of position pos + i: verify gives each token the window
    ending at its own position (``Chunk.attend_windows``), as the runtime's
    verify mask has it.
    """
    query = torch.arange(pos, pos + tokens).view(tokens, 1)
    full_mask = torch.where(torch.arange(ctx).view(1, ctx) <= query, 0.0, MASK_MIN)
    # Window slot s of the window ending at position q holds position q - (window - 1 - s).
    held = torch.arange(window).view(1, window) + query - (window - 1)
    sliding_mask = torch.where(held >= 0, 0.0, MASK_MIN)
    update = torch.zeros((1, 1, ctx, tokens), dtype=dtype)
    update[0, 0, pos + torch.arange(tokens), torch.arange(tokens)] = 1
    return (
        full_mask.view(1, 1, tokens, ctx).to(dtype),
        sliding_mask.view(1, 1, tokens, window).to(dtype),
        update,
    )


def prefill_masks(real: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill call's causal mask [1,1,n,n] and the one-hot
    last_position_mask [1,n,1] of the prompt's last real token (the rest of
    the n rows are padding, which the causal mask keeps away from it)."""
    causal = torch.triu(torch.full((n, n), MASK_MIN), diagonal=1).view(1, 1, n, n).to(dtype)
    last = torch.zeros((1, n, 1), dtype=dtype)
    last[0, real - 1, 0] = 1
    return causal, last


class Embeddings:
    """The CPU-side lookups the runtime does before the first chunk."""

    def __init__(self, dims: Dims, ckpt: Checkpoint):
        self.dims = dims
        # Stored dtype, memory-mapped: only the looked-up rows are converted
        # (the per-layer table of a real E2B is 262144 x 8960).
        self.embed = ckpt.get("embed_tokens.weight", None)
        self.per_layer = ckpt.get("embed_tokens_per_layer.weight", None)

    def hidden(self, token: int, dtype: torch.dtype) -> torch.Tensor:
        """``embed_tokens[id] * embed_scale``, rounded to fp16 as the runtime's input array is."""
        return self._scaled(self.embed, token, self.dims["embed_scale"], dtype)

    def per_layer_raw(self, token: int, dtype: torch.dtype) -> torch.Tensor:
        """``embed_tokens_per_layer[id] * per_layer_embed_scale``: the runtime pre-scales it."""
        return self._scaled(self.per_layer, token, self.dims["per_layer_embed_scale"], dtype)

    def rows(self, tokens: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [1, T, H] and per_layer_raw [1, T, L*P] of several tokens."""
        hidden = torch.cat([self.hidden(t, dtype) for t in tokens], dim=1)
        per_layer = torch.cat([self.per_layer_raw(t, dtype) for t in tokens], dim=1)
        return hidden, per_layer

    @staticmethod
    def _scaled(table: torch.Tensor, token: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
        row = table[token].float() * torch.tensor(scale, dtype=torch.float32)
        return row.half().view(1, 1, -1).to(dtype)


class LayoutRunner:
    """Runs one layout's chunks step by step with its own caches."""

    def __init__(
        self,
        dims: Dims,
        layout: Layout | ParityLayout,
        ckpt: Checkpoint,
        dtype: torch.dtype = torch.float32,
        modules: dict[str, Chunk] | None = None,
    ):
        self.dims = dims
        self.layout = layout
        self.dtype = dtype
        self.chunks = layout["chunks"]
        self.modules = modules or {c["name"]: build_chunk(dims, c, ckpt, dtype, share=True) for c in self.chunks}
        self.reset()

    def reset(self) -> None:
        """Empty caches, as after ChunkedEngine.reset()."""
        self.caches: dict[str, dict[str, torch.Tensor]] = {}
        for c in self.chunks:
            self.caches[c["name"]] = {
                t["name"]: torch.zeros(t["shape"], dtype=self.dtype)
                for t in c["inputs"]
                if t["name"].startswith(("K_", "V_"))
            }

    def snapshot(self) -> dict[str, dict[str, torch.Tensor]]:
        """The caches as they stand (calls replace cache tensors, never edit them)."""
        return {name: dict(cache) for name, cache in self.caches.items()}

    def step(self, emb: Embeddings, token: int, pos: int) -> dict[str, Any]:
        """One decode step at position ``pos``; returns token, logits, normed hidden, per-layer trace."""
        d, dt = self.dims, self.dtype
        ctx, w = d["ctx"], d["sliding_window"]
        if pos >= ctx:
            raise ValueError(f"position {pos} is beyond the full-attention context ({ctx})")
        full_mask, sliding_mask, update = step_masks(ctx, w, pos, dt)
        shared = self._rows(emb, [token], pos)
        shared.update({"causal_mask_full": full_mask, "causal_mask_sliding": sliding_mask, "update_mask": update})
        outs, trace = chain(self.chunks, self.modules, shared, self.caches)
        for c in self.chunks:
            cache = self.caches[c["name"]]
            for name, value in outs[c["name"]].items():
                if name.endswith("_out") and name.startswith(("K_", "V_")):
                    cache[name[: -len("_out")] + "_in"] = value
        last = self.chunks[-1]
        head = outs[last["name"]]
        return {
            "token": int(head["token_id"][0]),
            "logits": self.modules[last["name"]].last_logits.detach().float(),
            "hidden": head["hidden_states_out"].detach().float().view(-1),
            "trace": {layer: h.view(-1) for layer, h in trace.items()},
        }

    def _rows(self, emb: Embeddings, tokens: list[int], pos: int) -> dict[str, torch.Tensor]:
        """Embeddings and RoPE rows of ``tokens`` at positions pos.., as the runtime feeds them."""
        d, dt = self.dims, self.dtype
        hidden, per_layer = emb.rows(tokens, dt)
        cos_s, sin_s = rope(d, "sliding", pos, dt, len(tokens))
        cos_f, sin_f = rope(d, "full", pos, dt, len(tokens))
        return {
            "hidden_states": hidden,
            "per_layer_raw": per_layer,
            "cos_s": cos_s,
            "sin_s": sin_s,
            "cos_f": cos_f,
            "sin_f": sin_f,
        }

    def verify_modules(self, ckpt: Checkpoint | None = None) -> dict[str, Chunk]:
        """Each chunk's ``verify_qK`` module (built once, sharing the decode modules' tensors)."""
        if not hasattr(self, "_verify"):
            if ckpt is None:
                raise ValueError("verify modules need the checkpoint the first time")
            self._verify = {
                c["name"]: build_chunk(self.dims, c, ckpt, self.dtype, share=True, function=function_of(c, "verify"))
                for c in self.chunks
            }
        return self._verify

    def verify(self, emb: Embeddings, tokens: list[int], pos: int) -> dict[str, Any]:
        """``verify_qK`` on K draft tokens at pos..pos+K-1 against the caches as
        they stand (not written): per position token, logits, pre-norm hidden,
        per-layer trace, and each chunk's new K/V rows for ``commit``."""
        d, dt, k = self.dims, self.dtype, len(tokens)
        if pos + k > d["ctx"]:
            raise ValueError(f"positions {pos}..{pos + k - 1} are beyond the full-attention context ({d['ctx']})")
        full_mask, sliding_mask, indicator = step_masks(d["ctx"], d["sliding_window"], pos, dt, k)
        shared = self._rows(emb, tokens, pos)
        shared.update(
            {"causal_mask_full": full_mask, "causal_mask_sliding": sliding_mask, "update_indicator": indicator}
        )
        modules = self.verify_modules()
        outs, trace = chain(self.chunks, modules, shared, self.caches)
        last = self.chunks[-1]
        head = outs[last["name"]]
        return {
            "tokens": [int(x) for x in head["token_ids"].view(-1)],
            "logits": modules[last["name"]].last_logits.detach().float(),
            "hidden": head["hidden_states_out"].detach().float().view(k, -1),
            "trace": {layer: h.view(k, -1) for layer, h in trace.items()},
            "new": {name: {n: v for n, v in o.items() if n.startswith("new_")} for name, o in outs.items()},
        }

    def commit(self, new: dict[str, dict[str, torch.Tensor]], pos: int, k: int) -> None:
        """Write accepted verify rows into the caches, as the runtime does after
        acceptance: window caches shift by k and take the rows at their end,
        full caches take them at positions pos..pos+k-1 (rows padded to the
        caches' head dim)."""
        mhd = self.dims["max_head_dim"]
        for c in self.chunks:
            cache = self.caches[c["name"]]
            for kv in ("K", "V"):
                for label in ("sliding", "full"):
                    rows = new[c["name"]].get(f"new_{kv}_{label}")
                    if rows is None:
                        continue
                    rows = torch.nn.functional.pad(rows[:, :, :k], (0, mhd - rows.shape[-1]))
                    old = cache[f"{kv}_{label}_in"]
                    if label == "sliding":
                        cache[f"{kv}_{label}_in"] = torch.cat([old[:, :, k:], rows], dim=2)
                    else:
                        upd = old.clone()
                        upd[:, :, pos : pos + k] = rows
                        cache[f"{kv}_{label}_in"] = upd

    def load_prefill_kv(self, layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Write prefill's per-layer K/V of positions 0..n-1 into this layout's
        own-KV slots, as the runtime does after a prefill call: full slots at
        their positions, window slots the newest min(n, W) at their end."""
        w = self.dims["sliding_window"]
        for c in self.chunks:
            cache = self.caches[c["name"]]
            for spec in c["layers"]:
                if spec["kv"]["kind"] != "own":
                    continue
                label = spec["attention"]
                k_rows, v_rows = layer_kv[spec["index"]]
                hd = k_rows.shape[-1]
                for kv, rows in (("K", k_rows), ("V", v_rows)):
                    upd = cache[f"{kv}_{label}_in"].clone()
                    slot = spec["kv"]["slot"]
                    if label == "full":
                        upd[slot, :, :n, :hd] = rows[0, :, :n]
                    else:
                        m = min(n, w)
                        upd[slot, :, w - m :, :hd] = rows[0, :, n - m : n]
                    cache[f"{kv}_{label}_in"] = upd

    def load_prefill(self, source: LayoutRunner, slot_map: list[SlotCopy]) -> None:
        """Copy the four-chunk reference's KV slots into this layout's caches using the plan's slot map."""
        for m in slot_map:
            kind = "sliding" if m["attention"] == "sliding" else "full"
            for kv in ("K", "V"):
                src = source.caches[m["from_chunk"]][f"{kv}_{kind}_in"][m["from_slot"]]
                self.caches[m["to_chunk"]][f"{kv}_{kind}_in"][m["to_slot"]] = src.clone()


def function_of(chunk: ChunkPlan, kind: FunctionKind, tokens: int | None = None) -> FunctionPlan:
    """The chunk's function of ``kind`` (with ``tokens`` tokens, if given)."""
    for f in chunk["functions"]:
        if f["kind"] == kind and (tokens is None or f["tokens"] == tokens):
            return f
    raise ValueError(f"{chunk['name']} has no {kind} function" + (f" of {tokens} tokens" if tokens else ""))


def chain(
    chunks: list[ChunkPlan],
    modules: dict[str, Chunk],
    shared: dict[str, torch.Tensor],
    caches: dict[str, dict[str, torch.Tensor]] | None = None,
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[int, torch.Tensor]]:
    """Runs one call through the chunks in order, as the runtime chains them:
    each chunk takes its inputs from its own caches or the per-call inputs,
    and hands ``hidden_states_out``, ``per_layer_combined_out`` and
    kv13/kv14 to the next. Returns every chunk's outputs by name and the
    hidden state after every layer."""
    shared = dict(shared)
    outs: dict[str, dict[str, torch.Tensor]] = {}
    trace: dict[int, torch.Tensor] = {}
    for c in chunks:
        mod = modules[c["name"]]
        cache = (caches or {}).get(c["name"], {})
        args = [cache[n] if n in cache else shared[n] for n in mod.input_names]
        with torch.no_grad():
            out = dict(zip(mod.output_names, mod(*args), strict=False))
        for spec, h in zip(c["layers"], mod.trace_layers or [], strict=False):
            trace[spec["index"]] = h.detach().float()[0]
        for name, value in out.items():
            if name.startswith(("kv13_", "kv14_")):
                shared[name] = value
            elif name == "per_layer_combined_out":
                shared["per_layer_combined"] = value
            elif name == "hidden_states_out":
                shared["hidden_states"] = value
        outs[c["name"]] = out
    return outs, trace


class PrefillRunner:
    """The prefill packages' functions of ``tokens`` tokens, run as the runtime
    runs them on the start of a prompt."""

    def __init__(self, dims: Dims, layout: Layout | ParityLayout, ckpt: Checkpoint, tokens: int):
        self.dims = dims
        self.chunks = layout["chunks"]
        self.tokens = tokens
        self.functions = {c["name"]: function_of(c, "prefill", tokens) for c in self.chunks}
        self.modules = {
            c["name"]: build_chunk(dims, c, ckpt, torch.float32, share=True, function=self.functions[c["name"]])
            for c in self.chunks
        }

    def run(self, emb: Embeddings, prompt: list[int]) -> dict[str, Any]:
        """Prefill ``prompt`` (padded to the function's length with its last
        token): the token after it, its logit, every own-KV layer's K/V rows
        and the per-layer hidden states [n, H]."""
        n, dt = len(prompt), torch.float32
        if not 0 < n <= self.tokens:
            raise ValueError(f"a prefill call of {self.tokens} tokens cannot take {n}")
        padded = prompt + [prompt[-1]] * (self.tokens - n)
        hidden, per_layer = emb.rows(padded, dt)
        causal, last = prefill_masks(n, self.tokens, dt)
        cos_s, sin_s = rope(self.dims, "sliding", 0, dt, self.tokens)
        cos_f, sin_f = rope(self.dims, "full", 0, dt, self.tokens)
        shared = {
            "hidden_states": hidden,
            "per_layer_raw": per_layer,
            "causal_mask": causal,
            "last_position_mask": last,
            "cos_s": cos_s,
            "sin_s": sin_s,
            "cos_f": cos_f,
            "sin_f": sin_f,
        }
        outs, trace = chain(self.chunks, self.modules, shared)
        d = self.dims
        producers = {"kv13": d["producer_sliding"], "kv14": d["producer_full"]}
        layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for c in self.chunks:
            out = outs[c["name"]]
            for i, layer in enumerate(self.functions[c["name"]].get("kv_layers", [])):
                layer_kv[layer] = (out[f"K{i}"], out[f"V{i}"])
            for alias, producer in producers.items():
                # Only a model with KV sharing (producer layers) has kv13/kv14.
                if f"{alias}_k" in out and producer is not None:
                    layer_kv[producer] = (out[f"{alias}_k"], out[f"{alias}_v"])
        head = outs[self.chunks[-1]["name"]]
        return {
            "token": int(head["token_id"][0]),
            "logit": float(head["token_logit"][0]),
            "kv": layer_kv,
            "trace": {layer: h[:n] for layer, h in trace.items()},
        }
