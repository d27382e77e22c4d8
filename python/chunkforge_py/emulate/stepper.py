"""A CPU emulation of the on-device runtime: builds each decode step's inputs
(embeddings, masks, RoPE tables) and carries caches between the chunks of a
layout, exactly as the Swift runtime does with the Core ML packages."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from .. import weights
from ..checkpoint import Checkpoint, Table
from ..contract import ChunkPlan, Dims, FunctionKind, FunctionPlan, Layout, ParityLayout, SlotCopy
from ..model import MASK_MIN, Chunk, Tensors, build_chunk
from ..roles import CACHE, CACHE_ROLES, NEW_ROW_ROLES, NEW_ROWS, ROPE, Key, bind, in_order
from ..runtime import ChunkforgeError, cores, release_memory, torch_threads, trim_heap

# Each chunk's own caches, by chunk name (the cache tensors of its inputs).
Caches = dict[str, Tensors]


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


class EmbeddingSource(Protocol):
    """The rows the runtime looks up on the CPU before the first chunk."""

    def rows(self, tokens: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


# RoPE rows of both attention kinds: (pos, dtype, tokens) -> cos/sin by role.
RopeSource = Callable[[int, torch.dtype, int], Tensors]


class Embeddings:
    """The CPU-side lookups the runtime does before the first chunk, from the checkpoint."""

    def __init__(self, dims: Dims, ckpt: Checkpoint):
        self.dims = dims
        # Stored dtype, read a row per lookup (`checkpoint.Table`): the
        # per-layer table of a real E2B is 262144 x 8960, 4.7 GB in bf16,
        # and a mapping of it would stay resident once checked finite.
        self.embed = ckpt.table("embed_tokens.weight")
        self.per_layer = ckpt.table("embed_tokens_per_layer.weight")

    def hidden(self, token: int, dtype: torch.dtype) -> torch.Tensor:
        """``embed_tokens[id] * embed_scale``, rounded to fp16 as the runtime's input array is."""
        return self._scaled(self.embed, token, self.dims["embed_scale"], dtype)

    def per_layer_raw(self, token: int, dtype: torch.dtype) -> torch.Tensor:
        """``embed_tokens_per_layer[id] * per_layer_embed_scale``: the runtime pre-scales it."""
        return self._scaled(self.per_layer, token, self.dims["per_layer_embed_scale"], dtype)

    def rows(self, tokens: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The hidden [1, T, H] and per-layer raw [1, T, L*P] rows of several tokens."""
        hidden = torch.cat([self.hidden(t, dtype) for t in tokens], dim=1)
        per_layer = torch.cat([self.per_layer_raw(t, dtype) for t in tokens], dim=1)
        return hidden, per_layer

    @staticmethod
    def _scaled(table: Table, token: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
        row = table[token].float() * torch.tensor(scale, dtype=torch.float32)
        return row.half().view(1, 1, -1).to(dtype)


class LayoutRunner:
    """Runs one layout's chunks step by step with its own caches."""

    def __init__(
        self,
        dims: Dims,
        layout: Layout | ParityLayout,
        ckpt: Checkpoint | None,
        dtype: torch.dtype = torch.float32,
        modules: dict[str, Chunk] | None = None,
        rope: RopeSource | None = None,
        verify: dict[str, Chunk] | None = None,
    ):
        self.dims = dims
        self.layout = layout
        self.dtype = dtype
        self.chunks = layout["chunks"]
        if modules is None:
            if ckpt is None:
                raise ValueError("a layout runner needs the checkpoint or the modules")
            modules = {c["name"]: build_chunk(dims, c, ckpt, dtype, share=True, stream=True) for c in self.chunks}
        self.modules = modules
        # The RoPE rows: computed (parity), or read from the release's tables (run).
        self.rope: RopeSource = rope or (lambda pos, dt, n: rope_rows(dims, pos, dt, n))
        if verify is not None:
            self._verify = verify
        self.reset()

    def reset(self) -> None:
        """Empty caches, as after ChunkedEngine.reset()."""
        self.caches = empty_caches(self.chunks, self.dtype)

    def snapshot(self) -> Caches:
        """The caches as they stand (calls replace cache tensors, never edit them)."""
        return {name: dict(cache) for name, cache in self.caches.items()}

    def step(self, emb: EmbeddingSource, token: int, pos: int) -> dict[str, Any]:
        """One decode step at position ``pos``; returns token, logits, normed hidden, per-layer trace."""
        return self.steps(emb, [token], pos)[0]

    def steps(
        self,
        emb: EmbeddingSource,
        tokens: list[int],
        pos: int,
        keep_caches_after: int | None = None,
        progress: Callable[[str, int], None] | None = None,
    ) -> list[dict[str, Any]]:
        """Decode steps of ``tokens`` at positions pos, pos+1, ..., each as
        `step` gives it. Teacher forcing makes every step's input known, so
        they run chunk by chunk (`schedule`): each chunk's weights are read
        once for all the steps, not once per step. With ``keep_caches_after``
        = i, ``kept_caches`` holds the caches as they stood after step i.
        ``progress(chunk, n)`` is told as each chunk starts its n steps."""
        feeds = [self.step_feeds(emb, token, pos + i) for i, token in enumerate(tokens)]
        results: list[dict[str, Any]] = [{} for _ in tokens]
        self.kept_caches: Caches = {}
        for i, c in schedule(self.chunks, len(tokens)):
            if progress and i == 0:
                progress(c["name"], len(tokens))
            self.decode_call(c, feeds[i], results[i])
            if i == keep_caches_after:
                self.kept_caches[c["name"]] = dict(self.caches[c["name"]])
        return [self.decoded(r) for r in results]

    def step_feeds(self, emb: EmbeddingSource, token: int, pos: int) -> Tensors:
        """What the runtime feeds a decode call at ``pos``."""
        d, dt = self.dims, self.dtype
        ctx, w = d["ctx"], d["sliding_window"]
        if pos >= ctx:
            raise ValueError(f"position {pos} is beyond the full-attention context ({ctx})")
        full_mask, sliding_mask, update = step_masks(ctx, w, pos, dt)
        feeds = self._rows(emb, [token], pos)
        feeds.update({Key("mask_full"): full_mask, Key("mask_sliding"): sliding_mask, Key("update_mask"): update})
        return feeds

    def call(self, c: ChunkPlan, modules: dict[str, Chunk], feeds: Tensors, result: dict[str, Any]) -> Tensors:
        """Chunk ``c`` of one call, on its own caches (not written) and
        ``feeds``, which takes what it hands on; ``result`` collects the
        call's trace and, from the last chunk, its outputs and logits."""
        out, trace = call_chunk(c, modules[c["name"]], feeds, self.caches.get(c["name"], {}))
        result.setdefault("trace", {}).update(trace)
        if c["name"] == self.chunks[-1]["name"]:
            # Not its caches: every step's would be kept until the records.
            result["out"] = {key: v for key, v in out.items() if key.role not in CACHE_ROLES}
            result["logits"] = modules[c["name"]].last_logits.detach().float()
            # Nothing is handed on from the last chunk: the call's inputs go.
            feeds.clear()
        else:
            hand_on(feeds, out)
        return out

    def decode_call(self, c: ChunkPlan, feeds: Tensors, result: dict[str, Any]) -> None:
        """Chunk ``c`` of one decode call (`call`), its caches updated."""
        out = self.call(c, self.modules, feeds, result)
        # A decode call returns its caches updated, under the roles they came in with.
        cache = self.caches[c["name"]]
        for key, value in out.items():
            if key.role in CACHE_ROLES:
                cache[key] = value

    @staticmethod
    def decoded(result: dict[str, Any]) -> dict[str, Any]:
        """A decode call's token, logits, normed hidden state and per-layer trace."""
        head = result["out"]
        return {
            "token": int(head[Key("token_id")][0]),
            "logits": result["logits"],
            "hidden": head[Key("hidden_out")].detach().float().view(-1),
            "trace": {layer: h.view(-1) for layer, h in result["trace"].items()},
        }

    def _rows(self, emb: EmbeddingSource, tokens: list[int], pos: int) -> Tensors:
        """Embeddings and RoPE rows of ``tokens`` at positions pos.., as the runtime feeds them."""
        hidden, per_layer = emb.rows(tokens, self.dtype)
        return {
            Key("hidden"): hidden,
            Key("per_layer_raw"): per_layer,
            **self.rope(pos, self.dtype, len(tokens)),
        }

    def verify_modules(self, ckpt: Checkpoint | None = None) -> dict[str, Chunk]:
        """Each chunk's ``verify_qK`` module (built once, sharing the decode modules' tensors)."""
        if not hasattr(self, "_verify"):
            if ckpt is None:
                raise ValueError("verify modules need the checkpoint the first time")
            self._verify = {
                c["name"]: build_chunk(
                    self.dims, c, ckpt, self.dtype, share=True, stream=True, function=function_of(c, "verify")
                )
                for c in self.chunks
            }
        return self._verify

    def verify(self, emb: EmbeddingSource, tokens: list[int], pos: int) -> dict[str, Any]:
        """``verify_qK`` on K draft tokens at pos..pos+K-1 against the caches as
        they stand (not written): per position token, logits, pre-norm hidden,
        per-layer trace, and each chunk's new K/V rows for ``commit``."""
        feeds = self.verify_feeds(emb, tokens, pos)
        result: dict[str, Any] = {}
        for c in self.chunks:
            self.verify_call(c, feeds, result)
        return self.verified(result, len(tokens))

    def verify_blocks(self, emb: EmbeddingSource, prompt: list[int], steps: int, k: int) -> list[dict[str, Any]]:
        """Speculative decode of ``prompt[:steps]`` with every draft accepted:
        `verify` on each whole block of K tokens from position 0, its rows
        committed before the next; chunk by chunk (`schedule`), as `steps`."""
        starts = list(range(0, steps - k + 1, k))
        feeds = [self.verify_feeds(emb, prompt[pos : pos + k], pos) for pos in starts]
        results: list[dict[str, Any]] = [{} for _ in starts]
        for i, c in schedule(self.chunks, len(starts)):
            self.verify_call(c, feeds[i], results[i])
            self.commit({c["name"]: results[i]["new"][c["name"]]}, starts[i], k, [c])
        return [self.verified(r, k) for r in results]

    def verify_feeds(self, emb: EmbeddingSource, tokens: list[int], pos: int) -> Tensors:
        """What the runtime feeds a ``verify_qK`` call on ``tokens`` at pos.."""
        d, dt, k = self.dims, self.dtype, len(tokens)
        if pos + k > d["ctx"]:
            raise ValueError(f"positions {pos}..{pos + k - 1} are beyond the full-attention context ({d['ctx']})")
        full_mask, sliding_mask, indicator = step_masks(d["ctx"], d["sliding_window"], pos, dt, k)
        feeds = self._rows(emb, tokens, pos)
        feeds.update(
            {Key("mask_full"): full_mask, Key("mask_sliding"): sliding_mask, Key("update_indicator"): indicator}
        )
        return feeds

    def verify_call(self, c: ChunkPlan, feeds: Tensors, result: dict[str, Any]) -> None:
        """Chunk ``c`` of one ``verify_qK`` call (`call`), its new K/V rows kept."""
        out = self.call(c, self.verify_modules(), feeds, result)
        result.setdefault("new", {})[c["name"]] = {key: v for key, v in out.items() if key.role in NEW_ROW_ROLES}
        # The caches with all K rows written (the branch's write-through contract).
        result.setdefault("through", {})[c["name"]] = {key: v for key, v in out.items() if key.role in CACHE_ROLES}

    @staticmethod
    def verified(result: dict[str, Any], k: int) -> dict[str, Any]:
        head = result["out"]
        return {
            "tokens": [int(x) for x in head[Key("token_ids")].view(-1)],
            "logits": result["logits"],
            "hidden": head[Key("hidden_out")].detach().float().view(k, -1),
            "trace": {layer: h.view(k, -1) for layer, h in result["trace"].items()},
            "new": result["new"],
            "through": result["through"],
        }

    def commit(self, new: Caches, pos: int, k: int, chunks: list[ChunkPlan] | None = None) -> None:
        """Write accepted verify rows into the caches (of ``chunks``, default
        all), as the runtime does after acceptance: window caches shift by k
        and take the rows at their end, full caches take them at positions
        pos..pos+k-1 (rows padded to the caches' head dim)."""
        mhd = self.dims["max_head_dim"]
        for c in chunks or self.chunks:
            cache = self.caches[c["name"]]
            for kind, cache_roles in CACHE.items():
                for cache_role, new_role in zip(cache_roles, NEW_ROWS[kind], strict=True):
                    rows = new[c["name"]].get(Key(new_role))
                    if rows is None:
                        continue
                    rows = torch.nn.functional.pad(rows[:, :, :k], (0, mhd - rows.shape[-1]))
                    old = cache[Key(cache_role)]
                    if kind == "sliding":
                        cache[Key(cache_role)] = torch.cat([old[:, :, k:], rows], dim=2)
                    else:
                        upd = old.clone()
                        upd[:, :, pos : pos + k] = rows
                        cache[Key(cache_role)] = upd

    def commit_through(self, through: Caches) -> None:
        """The branch's commit (ChunkedEngine.swift at 4cd6c6c, ``copyBack``
        in ``verifyCandidates``): every chunk's caches replaced by the
        write-through caches its ``verify_qK`` returned, all K rows written
        whatever was accepted; its ``commitAccepted`` then only advances the
        position, so rejected rows stay in the window caches."""
        for c in self.chunks:
            written = through.get(c["name"], {})
            cache = self.caches[c["name"]]
            for key in list(cache):
                if key.role in CACHE_ROLES:
                    if key not in written:
                        raise ValueError(f"{c['name']}: verify_qK returns no {key.role} cache to copy back")
                    cache[key] = written[key]

    def load_prefill_kv(self, layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Write prefill's per-layer K/V of positions 0..n-1 into this layout's
        own-KV slots, as the runtime does after a prefill call: full slots at
        their positions, window slots the newest min(n, W) at their end."""
        write_prefill_kv(self.caches, self.chunks, layer_kv, n, self.dims["sliding_window"])

    def load_prefill(self, source: LayoutRunner, slot_map: list[SlotCopy]) -> None:
        """Copy the four-chunk reference's KV slots into this layout's caches using the plan's slot map."""
        copy_slots(source.caches, self.caches, slot_map)


def empty_caches(chunks: list[ChunkPlan], dtype: torch.dtype) -> Caches:
    """Every chunk's cache inputs, zeroed, as after ChunkedEngine.reset()."""
    return {
        c["name"]: {
            Key(t["role"]): torch.zeros(t["shape"], dtype=dtype) for t in c["inputs"] if t["role"] in CACHE_ROLES
        }
        for c in chunks
    }


def write_prefill_kv(
    caches: Caches,
    chunks: list[ChunkPlan],
    layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
    n: int,
    window: int,
) -> None:
    """Write prefill's per-layer K/V of positions 0..n-1 into the own-KV slots
    of ``chunks``' caches, as the runtime does after a prefill call: full slots
    at their positions, window slots the newest min(n, W) at their end."""
    for c in chunks:
        cache = caches[c["name"]]
        for spec in c["layers"]:
            if spec["kv"]["kind"] != "own":
                continue
            label = spec["attention"]
            k_rows, v_rows = layer_kv[spec["index"]]
            hd = k_rows.shape[-1]
            for role, rows in zip(CACHE[label], (k_rows, v_rows), strict=True):
                upd = cache[Key(role)].clone()
                slot = spec["kv"]["slot"]
                if label == "full":
                    upd[slot, :, :n, :hd] = rows[0, :, :n]
                else:
                    m = min(n, window)
                    upd[slot, :, window - m :, :hd] = rows[0, :, n - m : n]
                cache[Key(role)] = upd


def copy_slots(source: Caches, dest: Caches, slot_map: list[SlotCopy]) -> None:
    """Copy whole KV slots from the four-chunk caches into a layout's by the
    slot map, in layer order (the runtime's copyKVSlots)."""
    for m in slot_map:
        for role in CACHE[m["attention"]]:
            src = source[m["from_chunk"]][Key(role)][m["from_slot"]]
            dest[m["to_chunk"]][Key(role)][m["to_slot"]] = src.clone()


def function_of(chunk: ChunkPlan, kind: FunctionKind, tokens: int | None = None) -> FunctionPlan:
    """The chunk's function of ``kind`` (with ``tokens`` tokens, if given)."""
    for f in chunk["functions"]:
        if f["kind"] == kind and (tokens is None or f["tokens"] == tokens):
            return f
    raise ValueError(f"{chunk['name']} has no {kind} function" + (f" of {tokens} tokens" if tokens else ""))


def rope_rows(dims: Dims, pos: int, dtype: torch.dtype, tokens: int) -> Tensors:
    """The cos/sin rows of both attention kinds for positions pos..pos+tokens-1."""
    rows: Tensors = {}
    for kind, (cos_role, sin_role) in ROPE.items():
        rows[Key(cos_role)], rows[Key(sin_role)] = rope(dims, kind, pos, dtype, tokens)
    return rows


def chain(
    chunks: list[ChunkPlan],
    modules: dict[str, Chunk],
    feeds: Tensors,
    caches: Caches | None = None,
) -> tuple[dict[str, Tensors], dict[int, torch.Tensor]]:
    """Runs one call through the chunks in order, as the runtime chains them:
    each chunk takes its inputs from its own caches or the per-call ``feeds``,
    and hands its hidden states, combined per-layer inputs and shared KV on
    to the next. Returns every chunk's outputs by role and the hidden state
    after every layer."""
    feeds = dict(feeds)
    outs: dict[str, Tensors] = {}
    trace: dict[int, torch.Tensor] = {}
    for c in chunks:
        out, layers = call_chunk(c, modules[c["name"]], feeds, (caches or {}).get(c["name"], {}))
        trace.update(layers)
        hand_on(feeds, out)
        outs[c["name"]] = out
    return outs, trace


def call_chunk(c: ChunkPlan, mod: Chunk, feeds: Tensors, cache: Tensors) -> tuple[Tensors, dict[int, torch.Tensor]]:
    """One chunk's call on its own caches and the call's ``feeds``: its
    outputs by role and the hidden state after each of its layers."""
    # The function's inputs in contract order, its own caches first.
    args = in_order(mod.function["inputs"], {**feeds, **cache})
    with torch.no_grad():
        out = bind(mod.function["outputs"], mod(*args))
    trace = {spec["index"]: h.detach().float()[0] for spec, h in zip(c["layers"], mod.trace_layers or [], strict=False)}
    return out, trace


def hand_on(feeds: Tensors, out: Tensors) -> None:
    """What a chunk hands on to the next through the call's ``feeds``: its
    hidden states, combined per-layer inputs and shared KV."""
    for key, value in out.items():
        if key.role in ("shared_k", "shared_v"):
            feeds[key] = value
        elif key.role == "per_layer_combined_out":
            feeds[Key("per_layer_combined")] = value
        elif key.role == "hidden_out":
            feeds[Key("hidden")] = value


# `schedule`'s order: chunk-major (the default), or step-major
# (CHUNKFORGE_PARITY_ORDER=step: each call through every chunk before the
# next, as the runtime runs them; `bench parity --compare order` compares).
ORDER_ENV = "CHUNKFORGE_PARITY_ORDER"


def schedule(chunks: list[ChunkPlan], calls: int) -> Iterator[tuple[int, ChunkPlan]]:
    """The (call, chunk) pairs of ``calls`` calls through ``chunks`` whose
    inputs are all known beforehand (teacher forcing): chunk by chunk, each
    over every call (chunk-major), so each chunk's weights are made once and
    reused while `weights.RESIDENT` holds them (each chunk is a working set
    of its own: `Resident.next_set`), instead of once per call when the
    model is larger than the budget. A chunk reads only its own caches and
    what the chunks before it handed on in the same call, so each pair
    computes exactly what it does call by call (step-major). One call is run
    step-major: a new working set per chunk would evict, at each step, what
    the generation loop of `run` keeps between steps."""
    order = os.environ.get(ORDER_ENV) or "chunk"
    if order not in ("chunk", "step"):
        raise ChunkforgeError(f"{ORDER_ENV}={order}: expected chunk or step")
    if order == "step" or calls == 1:
        yield from ((i, c) for i in range(calls) for c in chunks)
        return
    for c in chunks:
        weights.RESIDENT.next_set()
        # What each call freed goes back to the system before the next
        # (`trim_heap`), and the cycles of the last chunk's calls before the
        # next chunk's (`release_memory`): weights past the budget are made
        # and freed at every call, and glibc's heap, from which arrays up to
        # 32 MiB come once larger ones have been freed, kept the freed pages
        # mapped (at E2B size the packages' programs of chunk4 peaked at 9.8
        # GiB over 16 steps, against 7.0 over 4).
        release_memory()
        for i in range(calls):
            yield i, c
            trim_heap()


class PrefillRunner:
    """The prefill packages' functions of ``tokens`` tokens, run as the runtime
    runs them on the start of a prompt."""

    def __init__(
        self,
        dims: Dims,
        layout: Layout | ParityLayout,
        ckpt: Checkpoint | None,
        tokens: int,
        modules: dict[str, Chunk] | None = None,
        rope: RopeSource | None = None,
    ):
        self.dims = dims
        self.chunks = layout["chunks"]
        self.tokens = tokens
        self.functions = {c["name"]: function_of(c, "prefill", tokens) for c in self.chunks}
        if modules is None:
            if ckpt is None:
                raise ValueError("prefill modules need the checkpoint or the modules")
            modules = {
                c["name"]: build_chunk(
                    dims, c, ckpt, torch.float32, share=True, stream=True, function=self.functions[c["name"]]
                )
                for c in self.chunks
            }
        self.modules = modules
        self.rope: RopeSource = rope or (lambda pos, dt, n: rope_rows(dims, pos, dt, n))
        # Whether the padding's projections are skipped (the native kernels'
        # `live` tokens; the dense path computes every row).
        self.skip_padding = weights.kernels()

    def run(self, emb: EmbeddingSource, prompt: list[int]) -> dict[str, Any]:
        """Prefill ``prompt`` (padded to the function's length with its last
        token): the token after it, its logit, every own-KV layer's K/V rows
        of the prompt [1, kv, n, hd] and the per-layer hidden states [n, H].
        With ``skip_padding`` (the default where the kernels run) the
        padding's projections are not computed: what is returned is the same."""
        n, dt = len(prompt), torch.float32
        if not 0 < n <= self.tokens:
            raise ValueError(f"a prefill call of {self.tokens} tokens cannot take {n}")
        padded = prompt + [prompt[-1]] * (self.tokens - n)
        hidden, per_layer = emb.rows(padded, dt)
        causal, last = prefill_masks(n, self.tokens, dt)
        feeds: Tensors = {
            Key("hidden"): hidden,
            Key("per_layer_raw"): per_layer,
            Key("mask_causal"): causal,
            Key("last_position_mask"): last,
            **self.rope(0, dt, self.tokens),
        }
        # With `skip_padding` the padding's projections are not computed
        # (`weights.live_tokens` says why that leaves every real row as it
        # is); only the real rows are returned. A prefill call's other ops
        # (norms, activations, attention over every position) run on torch's
        # threads, one per core: the process keeps torch on one
        # (`OMP_NUM_THREADS`), and a call of 512 positions spent most of its
        # time in them (E2B size, 64 prompt tokens: 5.9 s on one core, 3.9 s
        # on two; decode's small ops gain nothing).
        padding = weights.live_tokens(n, self.tokens) if self.skip_padding else nullcontext()
        with torch_threads(cores()), padding:
            outs, trace = chain(self.chunks, self.modules, feeds)
        layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for c in self.chunks:
            out = outs[c["name"]]
            for key, k_rows in out.items():
                if key.role == "layer_k" and key.layer is not None:
                    layer_kv[key.layer] = (k_rows[:, :, :n], out[Key("layer_v", layer=key.layer)][:, :, :n])
            # Producer layers (only a model with KV sharing has them) hand on
            # their K/V as shared KV, not as their layer's rows.
            for use in c["emits"]:
                k, v = out[Key("shared_k", use["alias"])], out[Key("shared_v", use["alias"])]
                layer_kv[use["layer"]] = (k[:, :, :n], v[:, :, :n])
        head = outs[self.chunks[-1]["name"]]
        return {
            "token": int(head[Key("token_id")][0]),
            "logit": float(head[Key("token_logit")][0]),
            "kv": layer_kv,
            "trace": {layer: h[:n] for layer, h in trace.items()},
        }
