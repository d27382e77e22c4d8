"""One generic Gemma 4 decode chunk, built from a plan entry.

A chunk runs a contiguous range of decoder layers for one token. Everything
structural (which layers, which KV slots it owns, which producer KV it reads or
emits, whether it projects the per-layer inputs or applies the head, and the
order of its inputs and outputs) comes from the plan computed in Rust.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from .checkpoint import Checkpoint
from .contract import Attention as AttentionKind
from .contract import ChunkPlan, Dims, FunctionPlan, LayerPlan
from .roles import CACHE, MASK, NEW_ROWS, ROPE, Key, bind, in_order
from .weights import Stored, kernels, shaped

# Blocked positions of the additive masks, as the runtime writes them: fp16
# -inf (0xFC00). Every row keeps at least one visible position, so softmax
# never sees a row of -inf.
MASK_MIN = float("-inf")

# Tensors by attention kind, two each (cos/sin, K/V).
Pair = dict[AttentionKind, tuple[torch.Tensor, torch.Tensor]]
# A call's inputs or outputs by what they carry (see roles.py).
Tensors = dict[Key, torch.Tensor]


class RMSNorm(nn.Module):
    """Gemma 4 RMSNorm, ``x * (mean(x^2) + eps)^-0.5 * weight`` (weight used as is,
    not 1+w), written as the Neural Engine runs it: ``layer_norm`` over ``[x, -x]``.

    Why it is exact: the 2C entries of ``[x, -x]`` sum to zero, so layer_norm's
    mean is 0 and its variance is ``(sum x^2 + sum (-x)^2) / 2C = mean(x^2)``;
    layer_norm then returns ``[x, -x] / sqrt(mean(x^2) + eps)``, whose first
    half is RMSNorm's normalised x. The mirror half is dropped. The ANE has a
    fused layer_norm kernel; ``pow``/``reduce_mean``/``rsqrt`` are what the
    formulation avoids. Works on the last axis of any rank (the per-layer
    inputs are normed as one [1, T, L, P] tensor by one op).
    """

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        doubled = torch.cat([x, -x], dim=-1)
        normed = nn.functional.layer_norm(doubled, (2 * self.dim,), eps=self.eps)
        # chunk, not a slice: tracing records a static split.
        out, _ = torch.chunk(normed, 2, dim=-1)
        if self.weight is not None:
            # The weight is used as it is stored, with no cast in between, so
            # the converted program keeps it as a const under its own name
            # (`layers_0_input_layernorm_weight`) and `run` can read it back.
            out = out * self.weight
        return out


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis as the device-proven graphs write it:
    ``exp(x - max) / sum(exp(x - max))`` (``reduce_max``, ``sub``, ``exp``,
    ``reduce_sum``, ``real_div``), in the model's dtype (fp16 in a package: no
    fp32 island on the device). Subtracting the row maximum changes nothing
    in real arithmetic (it cancels between numerator and denominator) and
    keeps every exponent <= 0, so fp16 cannot overflow; a blocked position
    (-inf) gives exp(-inf) = 0, and every row has a visible one."""
    shifted = x - x.amax(dim=-1, keepdim=True)
    e = torch.exp(shifted)
    return e / e.sum(dim=-1, keepdim=True)


def rotate_half(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    # head_dim is passed as a Python int so tracing records no shape arithmetic.
    half = head_dim // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Projection(nn.Conv2d):
    """A bias-free projection ``in -> out`` as a 1x1 ``Conv2d`` on NCHW tensors
    ``[1, in, 1, T]``: the form every projection and the head take in the
    graphs that run on the Neural Engine (its convolution engine is where the
    matmul-heavy work goes; ``linear`` on ``[1, T, C]`` is not). A 1x1
    convolution over a [1, in, 1, T] tensor is ``y[:, o, 0, t] = sum_i
    W[o, i] x[:, i, 0, t]``, which is ``x @ W.T`` for every token: the same
    arithmetic as ``nn.Linear``. The weight is the checkpoint's [out, in]
    matrix viewed as [out, in, 1, 1]; its parameter keeps the checkpoint's name.
    """

    def __init__(self, inp: int, out: int):
        super().__init__(inp, out, kernel_size=1, bias=False)
        # Where the weight comes from when the module does not hold it
        # (`load_streamed`): called each time the projection runs; a
        # float32 tensor, or the weight in its stored form (`weights.Stored`,
        # multiplied there by the native kernels).
        self.fetch: Callable[[], Any] | None = None
        # What ``fetch`` reads from, for those who want part of the weight
        # (`load_streamed`: a `checkpoint.Fetcher` or a package's weight).
        self.source: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fetch is None:
            return super().forward(x)
        w = self.fetch()
        if isinstance(w, Stored):
            return w.conv(x)
        return self._conv_forward(x, w, None)

    def tokens(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """The projection of token-major ``[1, t, in]`` as ``[1, t, out]``."""
        return from_nchw(self(to_nchw(x, self.in_channels, t)), self.out_channels, t)


# The two layout changes are reshapes, not unsqueeze/squeeze: coremltools'
# compose_conv1d pass rewrites expand_dims -> conv -> squeeze into a 1-D conv,
# whose squeezed weight loses its parameter's name in the program (and `run`
# reads weights back by name). With reshapes every projection stays the 2-D
# NCHW convolution the device-proven graphs hold.


# ``c`` and ``t`` are Python ints (and T is -1) so tracing records static shapes.


# One token (decode, T = 1) is a plain reshape either way, since moving an
# axis of size 1 leaves the order of the elements as it is: the transposes
# (and the [1, c, 1] between them, a tensor whose last axis the Neural Engine
# pads to 64 bytes) are needed only when T > 1.


def to_nchw(x: torch.Tensor, c: int, t: int) -> torch.Tensor:
    """[1, t, c] -> [1, c, 1, t]."""
    if t == 1:
        return x.reshape(1, c, 1, 1)
    return x.permute(0, 2, 1).reshape(1, c, 1, -1)


def from_nchw(x: torch.Tensor, c: int, t: int) -> torch.Tensor:
    """[1, c, 1, t] -> [1, t, c]."""
    if t == 1:
        return x.reshape(1, 1, c)
    return x.reshape(1, c, -1).permute(0, 2, 1)


class Attention(nn.Module):
    """Self-attention of one layer. Shared-KV layers have no K/V projections at all."""

    def __init__(self, dims: Dims, spec: LayerPlan):
        super().__init__()
        self.sliding = spec["attention"] == "sliding"
        self.head_dim = dims["head_dim_sliding"] if self.sliding else dims["head_dim_full"]
        self.heads = dims["num_attention_heads"]
        self.kv_heads = dims["num_kv_heads_sliding"] if self.sliding else dims["num_kv_heads_full"]
        self.owns_kv = spec["kv"]["kind"] == "own"
        hidden = dims["hidden_size"]
        eps = dims["rms_norm_eps"]
        self.q_proj = Projection(hidden, self.heads * self.head_dim)
        self.q_norm = RMSNorm(self.head_dim, eps)
        if self.owns_kv:
            self.k_proj = Projection(hidden, self.kv_heads * self.head_dim)
            self.v_proj = Projection(hidden, self.kv_heads * self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, eps)
            self.v_norm = RMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = Projection(self.heads * self.head_dim, hidden)

    def new_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, t: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``t`` tokens' K and V, shaped [1, kv_heads, t, head_dim], K roped, both normed."""
        k = self.k_norm(self.k_proj.tokens(x, t).view(1, t, self.kv_heads, self.head_dim))
        k = k * cos + rotate_half(k, self.head_dim) * sin
        v = self.v_norm(self.v_proj.tokens(x, t).view(1, t, self.kv_heads, self.head_dim))
        return k.transpose(1, 2), v.transpose(1, 2)

    def attend(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        t: int = 1,
    ) -> torch.Tensor:
        """Attention of the ``t`` queries over ``keys``/``values`` [1, kv_heads, L, head_dim];
        ``mask`` is [1, 1, t, L]."""
        q = self.q_norm(self.q_proj.tokens(x, t).view(1, t, self.heads, self.head_dim))
        q = q * cos + rotate_half(q, self.head_dim) * sin
        # Grouped-query attention without repeating K/V: fold the query heads
        # that share a KV head (and the t tokens) into the row dimension of one
        # matmul. Head h = kv * groups + g, so row g * t + i is head g's token i.
        groups = self.heads // self.kv_heads
        if t == 1:
            q = q.view(1, self.kv_heads, groups, self.head_dim)
        else:
            q = q.transpose(1, 2).reshape(1, self.kv_heads, groups * t, self.head_dim)
            if groups > 1:
                # Concatenated, not repeated: `repeat` becomes MIL's `tile`,
                # which the device-proven graphs have in no KV-sharing layer,
                # and where a chunk's only full layer shares KV (E4B's
                # chunk3, L29) its verify mask would be tiled there.
                mask = torch.cat([mask] * groups, dim=2)
        scores = torch.matmul(q, keys.transpose(2, 3))  # Gemma 4 attention scale is 1.0
        probs = softmax(scores + mask.to(scores.dtype))
        out = torch.matmul(probs, values)
        if t == 1:
            out = out.reshape(1, 1, self.heads * self.head_dim)
        else:
            out = out.view(1, self.heads, t, self.head_dim).transpose(1, 2).reshape(1, t, self.heads * self.head_dim)
        return self.o_proj.tokens(out, t)


class MLP(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = Projection(hidden, width)
        self.up_proj = Projection(hidden, width)
        self.down_proj = Projection(width, hidden)

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        # One NCHW view in, one out: gate, up and down all run as convolutions.
        xc = to_nchw(x, self.down_proj.out_channels, t)
        gate = nn.functional.gelu(self.gate_proj(xc), approximate="tanh")
        return from_nchw(self.down_proj(gate * self.up_proj(xc)), self.down_proj.out_channels, t)


class DecoderLayer(nn.Module):
    """Module names follow the checkpoint's tensor names, so loading is a table."""

    layer_scalar: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, dims: Dims, spec: LayerPlan):
        super().__init__()
        hidden = dims["hidden_size"]
        eps = dims["rms_norm_eps"]
        ple = dims["hidden_size_per_layer_input"]
        self.spec = spec
        self.self_attn = Attention(dims, spec)
        self.mlp = MLP(hidden, spec["mlp_width"])
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.per_layer_input_gate = Projection(hidden, ple)
        self.per_layer_projection = Projection(ple, hidden)
        self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def feed_forward(self, h: torch.Tensor, per_layer_input: torch.Tensor, t: int) -> torch.Tensor:
        """Everything after attention for ``t`` tokens: FFN block, per-layer-input block, layer scalar."""
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), t))
        gated = nn.functional.gelu(self.per_layer_input_gate.tokens(h, t), approximate="tanh") * per_layer_input
        h = h + self.post_per_layer_input_norm(self.per_layer_projection.tokens(gated, t))
        return h * self.layer_scalar


class Chunk(nn.Module):
    """Decoder layers ``first_layer..=last_layer`` as one function of a package.

    ``function`` is one of the chunk plan's functions (default: its first):
    ``decode`` runs one token against the caches and returns them updated,
    ``verify`` runs K tokens against read-only caches and returns their new K/V
    rows and the caches with all K rows written (two runtime contracts: main
    commits the accepted rows, the branch copies the caches back whole),
    ``prefill`` runs the first N tokens from empty caches and returns
    every layer's K/V. ``forward`` takes the function's inputs in plan order
    and returns its outputs in plan order; in between, tensors are found by
    their role (roles.py), never by name. With ``trace_layers`` set, it also
    records the hidden state after every layer (parity localises with it).
    """

    def __init__(self, dims: Dims, chunk: ChunkPlan, function: FunctionPlan | None = None):
        super().__init__()
        self.dims = dims
        self.chunk = chunk
        self.function = function or chunk["functions"][0]
        self.kind: str = self.function["kind"]
        self.tokens: int = self.function["tokens"]
        hidden = dims["hidden_size"]
        eps = dims["rms_norm_eps"]
        self.max_head_dim = dims["max_head_dim"]
        self.layer_specs = chunk["layers"]
        # Keyed by the global layer index so parameter (and Core ML const) names
        # match the checkpoint's: layers.15.self_attn.q_proj.weight.
        self.layers = nn.ModuleDict({str(spec["index"]): DecoderLayer(dims, spec) for spec in self.layer_specs})
        n_layers = dims["num_hidden_layers"]
        ple = dims["hidden_size_per_layer_input"]
        if chunk["computes_per_layer_input"]:
            self.per_layer_model_projection = Projection(hidden, n_layers * ple)
            self.per_layer_projection_norm = RMSNorm(ple, eps)
        if chunk["has_head"]:
            self.norm = RMSNorm(hidden, eps)
            self.lm_head = Projection(hidden, dims["vocab_size"])
        self.trace_layers: list[torch.Tensor] | None = None

    # ---- weights ---------------------------------------------------------

    def load(
        self,
        ckpt: Checkpoint,
        dtype: torch.dtype,
        share: bool = False,
        rounded_to: torch.dtype | None = None,
        stream: bool = False,
    ) -> None:
        """Fill every parameter from the checkpoint by name (tied head reads
        embed_tokens), in ``dtype``; with ``rounded_to``, values rounded to
        that dtype first (`Checkpoint.get`). With ``stream`` the projections'
        weights are read when they run (`load_streamed`)."""
        if stream:
            # float32 projections multiply the checkpoint's stored rows natively.
            stored = dtype == torch.float32 and rounded_to is None and kernels()
            load_streamed(
                self,
                lambda n, shape: ckpt.fetcher(self.checkpoint_name(n), dtype, stored=stored),
                lambda n: ckpt.get(self.checkpoint_name(n), dtype, share=share),
            )
            return
        shapes = {n: t.shape for n, t in [*self.named_parameters(), *self.named_buffers()]}
        # A projection's [out, in] matrix is its 1x1 convolution's [out, in, 1, 1] weight.
        state = {
            n: ckpt.get(self.checkpoint_name(n), dtype, share=share, rounded_to=rounded_to).view(shape)
            for n, shape in shapes.items()
        }
        # assign=True adopts the tensors as they are (the module was built on the
        # meta device, so nothing was allocated or initialised before this).
        self.load_state_dict(state, strict=True, assign=True)

    def checkpoint_name(self, local: str) -> str:
        if local == "lm_head.weight":
            return "embed_tokens.weight"  # tie_word_embeddings
        return local

    # ---- one call ----------------------------------------------------

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inp = bind(self.function["inputs"], args)
        dims = self.dims
        n_layers = dims["num_hidden_layers"]
        ple = dims["hidden_size_per_layer_input"]
        t = self.tokens
        h = inp[Key("hidden")]
        out: Tensors = {}

        if self.chunk["computes_per_layer_input"]:
            # per_layer_raw arrives already multiplied by per_layer_embed_scale (the
            # runtime scales the looked-up row), so it is used as is.
            raw = inp[Key("per_layer_raw")].view(1, t, n_layers, ple)
            proj = self.per_layer_model_projection.tokens(h, t) * (dims["hidden_size"] ** -0.5)
            proj = self.per_layer_projection_norm(proj.view(1, t, n_layers, ple))
            per_layer = (proj + raw) * (2.0**-0.5)
            out[Key("per_layer_combined_out")] = per_layer.reshape(1, t, n_layers * ple)
        else:
            per_layer = inp[Key("per_layer_combined")].view(1, t, n_layers, ple)

        # A chunk's inputs hold the RoPE rows, mask and (decode, verify) caches
        # of every attention kind its layers use; the others are None.
        rope = cast(Pair, {"sliding": self._rope(inp, "sliding"), "full": self._rope(inp, "full")})
        masks = cast(dict[AttentionKind, torch.Tensor], self._masks(inp))
        caches = cast(Pair, {kind: (inp.get(Key(k)), inp.get(Key(v))) for kind, (k, v) in CACHE.items()})
        # decode: updated cache slots; verify: the t new rows; prefill: by layer.
        new_slots: dict[AttentionKind, list[tuple[torch.Tensor, torch.Tensor]]] = {"sliding": [], "full": []}
        # verify: each slot with all t rows written (the branch's write-through).
        through: dict[AttentionKind, list[tuple[torch.Tensor, torch.Tensor]]] = {"sliding": [], "full": []}
        layer_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Producer KV visible to shared layers: the emitting layer's updated cache
        # (local) or the shared KV input from an earlier chunk, by alias.
        producer_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for use in self.chunk["consumes"]:
            alias = use["alias"]
            producer_kv[alias] = (inp[Key("shared_k", alias)], inp[Key("shared_v", alias)])

        trace: list[torch.Tensor] = []
        for spec in self.layer_specs:
            layer = cast(DecoderLayer, self.layers[str(spec["index"])])
            kind = spec["attention"]
            attn = layer.self_attn
            cos, sin = rope[kind]
            x = layer.input_layernorm(h)
            kv = spec["kv"]
            if kv["kind"] == "own":
                k_new, v_new = attn.new_kv(x, cos, sin, t)
                if self.kind == "prefill":
                    keys, values = k_new, v_new
                    layer_kv[spec["index"]] = (k_new, v_new)
                else:
                    keys, values = self.update_cache(kind, caches[kind], kv["slot"], k_new, v_new, attn.head_dim, inp)
                    new_slots[kind].append((k_new, v_new) if self.kind == "verify" else (keys, values))
                    if self.kind == "verify":
                        # The window cache shifted by t with the rows at its end
                        # (update_cache returned window + rows); the full cache as scattered.
                        written = (keys[:, :, t:], values[:, :, t:]) if kind == "sliding" else (keys, values)
                        through[kind].append(written)
                    keys = keys[..., : attn.head_dim]
                    values = values[..., : attn.head_dim]
                produced = kv.get("alias")
                if produced:
                    windowed = self.kind == "verify" and kind == "sliding"
                    # verify hands on the window cache extended by its rows (see attend_windows).
                    producer_kv[produced] = (keys[:, :, 1:], values[:, :, 1:]) if windowed else (keys, values)
            else:
                keys, values = producer_kv[kv["alias"]]
            if self.kind == "verify" and kind == "sliding":
                # Own cache: the window + t rows, the first window starts at row 1;
                # shared sliding KV from an earlier chunk already dropped that row.
                first = 1 if kv["kind"] == "own" else 0
                a = self.attend_windows(attn, x, cos, sin, keys, values, masks[kind], first)
            else:
                a = attn.attend(x, cos, sin, keys, values, masks[kind], t)
            h = h + layer.post_attention_layernorm(a)
            h = layer.feed_forward(h, per_layer[:, :, spec["index"], :], t)
            trace.append(h)
        self.trace_layers = trace

        if self.chunk["has_head"]:
            self._head(h, inp, out)
        else:
            out[Key("hidden_out")] = h
        for kind, slots in new_slots.items():
            if slots:
                if self.kind == "verify":
                    k_role, v_role = NEW_ROWS[kind]
                    out[Key(k_role)] = torch.cat([k for k, _ in slots], dim=0)
                    out[Key(v_role)] = torch.cat([v for _, v in slots], dim=0)
                    k_role, v_role = CACHE[kind]
                    out[Key(k_role)] = torch.cat([k for k, _ in through[kind]], dim=0)
                    out[Key(v_role)] = torch.cat([v for _, v in through[kind]], dim=0)
                else:
                    k_role, v_role = CACHE[kind]
                    out[Key(k_role)] = torch.stack([k[0] for k, _ in slots], dim=0)
                    out[Key(v_role)] = torch.stack([v[0] for _, v in slots], dim=0)
        for index, (k, v) in layer_kv.items():
            out[Key("layer_k", layer=index)] = k
            out[Key("layer_v", layer=index)] = v
        for use in self.chunk["emits"]:
            k, v = producer_kv[use["alias"]]
            out[Key("shared_k", use["alias"])] = k
            out[Key("shared_v", use["alias"])] = v
        # Only what the function returns: prefill's producer layers, say, hand
        # on their K/V as shared KV and not also as their layer's rows.
        return tuple(in_order(self.function["outputs"], out))

    def attend_windows(
        self,
        attn: Attention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        first: int,
    ) -> torch.Tensor:
        """Sliding attention of verify's K tokens, each over its own window.

        ``keys`` is the window cache followed by the K new rows (or, in a later
        chunk, that minus its oldest row: the shared KV of W + K - 1 rows). Token i's
        window is the W rows ending at its own row, so it sees exactly the
        positions (p + i - W, p + i] a decode step at p + i would, and mask row
        i is the runtime's decode-style row for that window (the last
        min(p + i + 1, W) slots visible). One shifted cache for all K tokens
        would drop the first tokens' oldest K - 1 keys and show them the
        later drafts. ``first`` is where token 0's window starts: a Python
        int, so tracing records static slices (a traced ``keys.shape`` would
        become a runtime size op)."""
        w, t = self.dims["sliding_window"], self.tokens
        rows = []
        for i in range(t):
            lo = first + i
            row = slice(i, i + 1)
            window = (keys[:, :, lo : lo + w], values[:, :, lo : lo + w])
            rows.append(attn.attend(x[:, row], cos[:, row], sin[:, row], *window, mask[:, :, row]))
        return torch.cat(rows, dim=1)

    def _rope(self, inp: Tensors, kind: AttentionKind) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """cos/sin rows arrive as [1, 1, t, hd]; the t tokens sit on axis 1 of q/k."""
        cos_role, sin_role = ROPE[kind]
        cos, sin = inp.get(Key(cos_role)), inp.get(Key(sin_role))
        if self.tokens == 1 or cos is None or sin is None:
            return cos, sin
        return cos.transpose(1, 2), sin.transpose(1, 2)

    def _masks(self, inp: Tensors) -> dict[AttentionKind, torch.Tensor | None]:
        if self.kind != "prefill":
            return {kind: inp.get(Key(role)) for kind, role in MASK.items()}
        causal = inp[Key("mask_causal")]
        n, w = self.tokens, self.dims["sliding_window"]
        if n <= w:
            return {"sliding": causal, "full": causal}
        # One causal mask serves every layer; sliding layers also block keys a
        # window or more behind the query (i - j >= w). Positions are 0..n-1 in
        # every prefill call, and causal[j, a] is blocked exactly when a > j, so
        # row i of the band is row i - w + 1 of causal's transpose; the rows
        # before w - 1 block nothing, as row 0 of the transpose does (every
        # query sees key 0). Derived from the input rather than stored as an
        # n x n constant, the prefill program holds the same weights as decode;
        # built by slice, tile and concat (the op types the device-proven graphs
        # use before the first layer), not pad (theirs only pads the K/V head dim).
        rows = causal.transpose(2, 3)
        band = rows[:, :, : n - w + 1, :]
        if w > 1:
            band = torch.cat([rows[:, :, :1, :].repeat(1, 1, w - 1, 1), band], dim=2)
        return {"sliding": causal + band, "full": causal}

    def _head(self, h: torch.Tensor, inp: Tensors, out: Tensors) -> None:
        """Final norm, tied head, softcap, argmax in the graph."""
        normed = self.norm(h)
        if self.kind == "prefill":
            # The prompt's last real token, picked by the runtime's one-hot mask.
            last = (normed * inp[Key("last_position_mask")]).sum(dim=1, keepdim=True)
            logits = self.lm_head.tokens(last, 1)
        else:
            logits = self.lm_head.tokens(normed, self.tokens)
        cap = self.dims["final_logit_softcapping"]
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if self.kind == "verify":
            # One token per draft position; the hidden state out is the
            # pre-norm residual stream, as the runtime's verify contract has it.
            out[Key("token_ids")] = torch.argmax(logits, dim=-1).to(torch.int32)
            out[Key("hidden_out")] = h
            self.last_logits = logits.view(self.tokens, -1)
            return
        logit, token = torch.max(logits.view(-1), dim=0, keepdim=True)
        out[Key("token_id")] = token.to(torch.int32)
        out[Key("token_logit")] = logit.to(h.dtype)
        out[Key("hidden_out")] = normed
        self.last_logits = logits.view(-1)

    def update_cache(
        self,
        kind: AttentionKind,
        cache: tuple[torch.Tensor, torch.Tensor],
        slot: int,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        head_dim: int,
        inp: Tensors,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this token's K/V into slot ``slot``; returns the updated [1, kv, L, max_hd] slot.

        Caches are padded to the larger head dim so sliding and full slots share
        one layout the runtime can copy between without reshaping.
        """
        pad = self.max_head_dim - head_dim
        if pad:
            k_new = nn.functional.pad(k_new, (0, pad))
            v_new = nn.functional.pad(v_new, (0, pad))
        k_cache = cache[0][slot : slot + 1]
        v_cache = cache[1][slot : slot + 1]
        if kind == "sliding" and self.kind == "verify":
            # The window followed by the t new rows; each token takes its own
            # window out of it (attend_windows).
            keys = torch.cat([k_cache, k_new], dim=2)
            values = torch.cat([v_cache, v_new], dim=2)
        elif kind == "sliding":
            # Window cache: drop the oldest entry, append the newest at the end.
            keys = torch.cat([k_cache[:, :, 1:, :], k_new], dim=2)
            values = torch.cat([v_cache[:, :, 1:, :], v_new], dim=2)
        elif self.kind == "verify":
            # update_indicator [1, 1, ctx, t] scatters the t rows to their
            # positions; its row sums mark which cache rows they replace.
            ind = inp[Key("update_indicator")]
            m = ind.sum(dim=-1, keepdim=True)
            keys = k_cache * (1 - m) + torch.matmul(ind, k_new)
            values = v_cache * (1 - m) + torch.matmul(ind, v_new)
        else:
            # Full cache: one-hot update_mask selects this position's row.
            m = inp[Key("update_mask")]
            keys = k_cache * (1 - m) + k_new * m
            values = v_cache * (1 - m) + v_new * m
        return keys, values


def load_streamed(
    module: nn.Module,
    fetch: Callable[[str, tuple[int, ...]], Callable[[], torch.Tensor]],
    get: Callable[[str], torch.Tensor],
) -> None:
    """Loads a module built on the meta device without holding its
    projections' weights: each `Projection` calls ``fetch(name, shape)``'s
    function for its weight whenever it runs (weights.py says why: a
    tensor, or a `weights.Stored` weight the kernels multiply), every
    other parameter and buffer (norms, scalars: small) is ``get(name)`` now.
    Names are the module's own (``layers.3.mlp.up_proj.weight``)."""
    projections = {f"{n}.weight": m for n, m in module.named_modules() if isinstance(m, Projection)}
    state: dict[str, torch.Tensor] = {}
    for name, like in [*module.named_parameters(), *module.named_buffers()]:
        shape = tuple(like.shape)
        if name in projections:
            source = fetch(name, shape)
            projections[name].fetch = lambda source=source, shape=shape: shaped(source(), shape)
            projections[name].source = source
        else:
            state[name] = get(name).view(shape)
    # assign=True adopts the tensors as they are; the projections' own
    # parameters stay on the meta device (shape only).
    module.load_state_dict(state, strict=False, assign=True)


def build_chunk(
    dims: Dims,
    chunk: ChunkPlan,
    ckpt: Checkpoint,
    dtype: torch.dtype,
    share: bool = False,
    function: FunctionPlan | None = None,
    rounded_to: torch.dtype | None = None,
    stream: bool = False,
) -> Chunk:
    """The module of one of the chunk's functions (default: the first) with its
    weights; ``share`` reuses tensors across modules (parity); ``rounded_to``:
    weight values rounded to that dtype, held as ``dtype``; ``stream``: the
    projections' weights read when they run (`load_streamed`)."""
    with torch.device("meta"):
        module = Chunk(dims, chunk, function).eval()
    module.load(ckpt, dtype, share=share, rounded_to=rounded_to, stream=stream)
    return module


class Functions(Chunk):
    """Several functions of the same layers as one module, for one conversion
    of them all (`joint.convert_jobs`): ``forward`` takes every function's
    inputs, in ``functions`` order, and returns every function's outputs.

    The module is the first function's; the others' modules are held in a
    plain list, so they are not submodules, and take its parameters (the same
    tensor objects, `share_weights`). The module's parameters are therefore
    named as a single function's (``layers.15.self_attn.q_proj.weight``), and
    tracing sees each weight once: every function's ops read the one tensor,
    which becomes one constant of the converted program."""

    def __init__(self, dims: Dims, functions: list[tuple[ChunkPlan, FunctionPlan]]):
        chunk, first = functions[0]
        super().__init__(dims, chunk, first)
        self.others: list[Chunk] = [Chunk(dims, c, f).eval() for c, f in functions[1:]]

    def share_weights(self) -> None:
        """Give every other function's module this module's parameters and
        buffers, by name (all of them: the same layers hold the same names)."""
        shared = {**dict(self.named_parameters()), **dict(self.named_buffers())}
        for m in self.others:
            m.load_state_dict(shared, strict=True, assign=True)

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.function["inputs"])
        out = list(super().forward(*args[:n]))
        for m in self.others:
            k = len(m.function["inputs"])
            out.extend(m(*args[n : n + k]))
            n += k
        if n != len(args):
            raise ValueError(f"{len(args)} inputs given, the functions take {n}")
        return tuple(out)


def build_functions(
    dims: Dims,
    functions: list[tuple[ChunkPlan, FunctionPlan]],
    ckpt: Checkpoint,
    dtype: torch.dtype,
    rounded_to: torch.dtype | None = None,
) -> Functions:
    """`Functions` of ``functions`` (each a chunk plan and one of its
    functions; every chunk of the same layers) with its weights, loaded once."""
    with torch.device("meta"):
        module = Functions(dims, functions).eval()
    module.load(ckpt, dtype, rounded_to=rounded_to)
    module.share_weights()
    return module
