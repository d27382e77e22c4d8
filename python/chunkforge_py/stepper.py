"""A CPU emulation of the on-device runtime: builds each decode step's inputs
(embeddings, masks, RoPE tables) and carries caches between the chunks of a
layout, exactly as the Swift runtime does with the Core ML packages."""

from __future__ import annotations

from typing import Any

import torch

from .checkpoint import Checkpoint
from .model import MASK_MIN, Chunk, build_chunk


def inv_freq(dims: dict[str, Any], kind: str) -> torch.Tensor:
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


def rope(dims: dict[str, Any], kind: str, pos: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = inv_freq(dims, kind).float() * float(pos)
    emb = torch.cat([freqs, freqs]).view(1, 1, 1, -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def step_masks(ctx: int, window: int, pos: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Additive masks and the full-cache write mask for the token at ``pos``.

    Full cache slot j holds position j. The window cache holds the newest
    ``window`` keys at its end (slot s holds position pos - (window - 1 - s)),
    so the visible slots are the last min(pos + 1, window).
    """
    full_mask = torch.full((1, 1, 1, ctx), MASK_MIN, dtype=dtype)
    full_mask[..., : pos + 1] = 0
    valid = min(pos + 1, window)
    sliding_mask = torch.full((1, 1, 1, window), MASK_MIN, dtype=dtype)
    sliding_mask[..., window - valid :] = 0
    update = torch.zeros((1, 1, ctx, 1), dtype=dtype)
    update[0, 0, pos, 0] = 1
    return full_mask, sliding_mask, update


class Embeddings:
    """The CPU-side lookups the runtime does before the first chunk."""

    def __init__(self, dims: dict[str, Any], ckpt: Checkpoint):
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

    @staticmethod
    def _scaled(table: torch.Tensor, token: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
        row = table[token].float() * torch.tensor(scale, dtype=torch.float32)
        return row.half().view(1, 1, -1).to(dtype)


class LayoutRunner:
    """Runs one layout's chunks step by step with its own caches."""

    def __init__(
        self,
        dims: dict[str, Any],
        layout: dict[str, Any],
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

    def step(self, emb: Embeddings, token: int, pos: int) -> dict[str, Any]:
        """One decode step at position ``pos``; returns token, logits, normed hidden, per-layer trace."""
        d, dt = self.dims, self.dtype
        ctx, w = d["ctx"], d["sliding_window"]
        if pos >= ctx:
            raise ValueError(f"position {pos} is beyond the full-attention context ({ctx})")
        full_mask, sliding_mask, update = step_masks(ctx, w, pos, dt)
        cos_s, sin_s = rope(d, "sliding", pos, dt)
        cos_f, sin_f = rope(d, "full", pos, dt)
        shared: dict[str, torch.Tensor] = {
            "hidden_states": emb.hidden(token, dt),
            "per_layer_raw": emb.per_layer_raw(token, dt),
            "causal_mask_full": full_mask,
            "causal_mask_sliding": sliding_mask,
            "update_mask": update,
            "cos_s": cos_s,
            "sin_s": sin_s,
            "cos_f": cos_f,
            "sin_f": sin_f,
        }
        trace: dict[int, torch.Tensor] = {}
        result: dict[str, Any] = {}
        for c in self.chunks:
            mod = self.modules[c["name"]]
            cache = self.caches[c["name"]]
            args = [cache[t["name"]] if t["name"] in cache else shared[t["name"]] for t in c["inputs"]]
            with torch.no_grad():
                outs = dict(zip(mod.output_names, mod(*args), strict=False))
            for spec, h in zip(c["layers"], mod.trace_layers or [], strict=False):
                trace[spec["index"]] = h.detach().float().view(-1)
            for name, value in outs.items():
                if name.endswith("_out") and name.startswith(("K_", "V_")):
                    cache[name[: -len("_out")] + "_in"] = value
                elif name.startswith(("kv13_", "kv14_")):
                    shared[name] = value
                elif name == "per_layer_combined_out":
                    shared["per_layer_combined"] = value
                elif name == "hidden_states_out":
                    shared["hidden_states"] = value
            if c["has_head"]:
                result["token"] = int(outs["token_id"][0])
                result["logits"] = mod.last_logits.detach().float()
                result["hidden"] = outs["hidden_states_out"].detach().float().view(-1)
        result["trace"] = trace
        return result

    def load_prefill(self, source: LayoutRunner, slot_map: list[dict[str, Any]]) -> None:
        """Copy the four-chunk reference's KV slots into this layout's caches using the plan's slot map."""
        for m in slot_map:
            kind = "sliding" if m["attention"] == "sliding" else "full"
            for kv in ("K", "V"):
                src = source.caches[m["from_chunk"]][f"{kv}_{kind}_in"][m["from_slot"]]
                self.caches[m["to_chunk"]][f"{kv}_{kind}_in"][m["to_slot"]] = src.clone()
