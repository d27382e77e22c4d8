"""The oracle check: the four-chunk reference against transformers, step by
step, with transformers' noise floor there (the report's ``oracle``; Rust's
`parity_checks::ORACLE`); and the oracle itself, Hugging Face
``Gemma4ForCausalLM`` on the same weights.

transformers' own code runs every step of the computation (its masks, RoPE,
per-layer inputs, KV sharing and decoder layers); only the weights are
brought in differently: each decoder layer's are read from the checkpoint
when transformers calls the layer and let go when it returns (forward hooks),
so the oracle holds one layer at a time (weights.py says why), and the head
is the tied embedding applied to transformers' final hidden states.
"""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import Checkpoint
from ..contract import OracleRecord, ParityReport, Verdict
from ..weights import RESIDENT, Stored, kernels, making, tally
from .check import Check, Parity, cosine, margin
from .verdicts import judge

if TYPE_CHECKING:
    from ..emulate.stepper import Embeddings

# transformers' attention implementations: eager is the oracle's (in fp32);
# the oracle's noise floor is measured against sdpa attention in fp32 and
# eager attention in float64 (`oracle_record`).
ORACLE_ATTENTION = "eager"
SECOND_ATTENTION = "sdpa"
# Head rows a forward multiplies at a time (a whole fp32 copy of the tied
# head would be 1.6 GB at E2B, fp64 3.2 GB).
HEAD_BLOCK = 1 << 15


class Buffers:
    """Tensors reused between transformers' layer calls: each layer's weights
    are made into the memory an earlier layer's of the same shapes used (on
    this machine fresh pages cost more than the values written into them:
    src/heap.rs), and given back after the call (`let_go`).

    Only memory `take` lent comes back: a layer's other tensors (a weight
    the resident budget holds, or one made for the call alone, as every
    weight is without the native kernels) are not the pool's to keep or to
    write into. So the pool holds at most, for each shape, the most tensors
    of it one layer call had out at once."""

    def __init__(self) -> None:
        self.free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        # The tensors out on loan, by where their memory starts (held here,
        # so no other tensor's memory can start there while they are out).
        self.lent: dict[int, torch.Tensor] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        free = self.free.get((shape, dtype))
        t = free.pop() if free else torch.empty(shape, dtype=dtype)
        self.lent[t.data_ptr()] = t
        return t

    def give(self, t: torch.Tensor) -> None:
        """``t`` back, if `take` lent it (else nothing)."""
        lent = self.lent.pop(t.data_ptr(), None)
        if lent is not None:
            self.free.setdefault((tuple(lent.shape), lent.dtype), []).append(lent)


class Oracle:
    """transformers' model of the checkpoint in ``dtype``, its decoder
    layers' weights loaded per call."""

    def __init__(self, config_path: str, ckpt: Checkpoint, dtype: torch.dtype = torch.float32):
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

        with open(config_path) as f:
            raw = json.load(f)
        text = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
        fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "transformers_version")}
        config = Gemma4TextConfig(**fields)
        config._attn_implementation = ORACLE_ATTENTION
        with torch.device("meta"):
            model = Gemma4ForCausalLM(config).eval()
        self.ckpt = ckpt
        self.model = model
        self.dtype = dtype
        self.buffers = Buffers()
        names = [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_buffers()]
        present = {k for k in names if k != "lm_head.weight" and ckpt.prefix + k[len("model.") :] in ckpt.files}
        # Only the unused K/V projections of KV-shared layers may stay unloaded.
        missing = [
            k
            for k, _ in model.named_parameters()
            if k not in present and k != "lm_head.weight" and not any(s in k for s in ("k_proj", "v_proj", "k_norm"))
        ]
        if missing:
            raise RuntimeError(f"transformers oracle: tensors not loaded: {missing[:5]}")
        # Outside the decoder layers: the norms and the per-layer input
        # projection, loaded now. The embedding tables stay unloaded: the
        # oracle is given the runtime's embeddings (`teacher_forced`).
        model.load_state_dict(
            {k: self.weight(k) for k in present if not k.startswith(("model.layers.", "model.embed_tokens"))},
            strict=False,
            assign=True,
        )
        for i, layer in enumerate(model.model.layers):
            own = sorted(k[len(f"model.layers.{i}.") :] for k in present if k.startswith(f"model.layers.{i}."))
            layer.register_forward_pre_hook(self._bring(i, own))
            layer.register_forward_hook(self.let_go)
        # Buffers computed at construction time (not stored in checkpoints) were
        # created on the meta device: build them again for real.
        model.model.rotary_emb = Gemma4TextRotaryEmbedding(config)
        for module in model.modules():
            if hasattr(module, "scalar_embed_scale"):
                module.embed_scale = torch.tensor(module.scalar_embed_scale)

    def weight(self, key: str) -> torch.Tensor:
        """A parameter or buffer of the model (``model.layers.3...``) from the
        checkpoint, in the model's dtype (through fp32: the values every
        other module of parity sees). transformers multiplies tensors, so
        each is made for the call that reads it; what the resident budget
        keeps between calls is the checkpoint's stored form, the one
        parity's own modules read (`weights.Stored`)."""
        return self._made(key)

    def _made(self, key: str, reused: bool = False) -> torch.Tensor:
        """`weight`, into memory of `Buffers` when ``reused`` (a decoder
        layer's, given back after its call)."""
        w = self.ckpt.fetcher(key[len("model.") :], torch.float32, stored=kernels())()
        if not isinstance(w, Stored):
            return w.to(self.dtype)
        with making("transformers"):
            if not reused:
                return w.dense().to(self.dtype)
            f32 = w.dense_into(self.buffers.take(w.shape, torch.float32))
        if self.dtype == torch.float32:
            return f32
        tally("transformers", str(self.dtype).removeprefix("torch."), f32.numel() * self.dtype.itemsize)
        out = self.buffers.take(w.shape, self.dtype).copy_(f32)
        self.buffers.give(f32)
        return out

    def let_go(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """After a decoder layer's call: its weights back to `Buffers`, the
        layer's to the meta device."""
        for t in [*module.parameters(), *module.buffers()]:
            if t.device.type == "cpu" and t.is_contiguous():
                self.buffers.give(t.data)
        module.to("meta")

    def head_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of the tied head (the embedding table) in float32."""
        fetch = self.ckpt.fetcher("embed_tokens.weight", torch.float32, stored=kernels())
        w = fetch()
        with making("transformers"):
            return w.rows_f32(start, stop) if isinstance(w, Stored) else w[start:stop]

    def _bring(self, index: int, own: list[str]) -> Any:
        def bring(module: torch.nn.Module, args: Any) -> None:
            state = {k: self._made(f"model.layers.{index}.{k}", reused=True) for k in own}
            module.load_state_dict(state, strict=False, assign=True)

        return bring

    def generate(
        self, prompt: list[int], n: int, generation_config: Any = None, margins: list[float] | None = None
    ) -> list[int]:
        """transformers' greedy ``generate`` of ``n`` tokens after ``prompt``
        (eager attention, its own KV cache), as
        ``AutoModelForCausalLM.from_pretrained(...).generate(..., do_sample=False)``
        computes it in this dtype, within the oracle's memory: the decoder
        layers' weights are loaded per call, the tied head is the embedding
        table (one copy), and the per-layer embedding table (262144 x 8960 at
        E2B: 9.4 GB in fp32) gives transformers only the rows of the ids it
        is called with (`_rows_only`), which its own module then scales.
        ``generation_config``: the checkpoint's (its end-of-text ids), as
        ``from_pretrained`` reads it. ``margins``, if given, gets each
        generated token's top-2 margin (its logit minus the runner-up's)."""
        inner = self.model.model
        table = self.weight("model.embed_tokens.weight")
        inner.embed_tokens.weight = torch.nn.Parameter(table, requires_grad=False)
        self.model.lm_head.weight = inner.embed_tokens.weight
        # generate's own merge of keyword arguments into the config, done here.
        config = copy.deepcopy(generation_config or self.model.generation_config)
        config.max_new_tokens, config.do_sample = n, False
        config.return_dict_in_generate, config.output_logits = True, margins is not None
        handle = inner.embed_tokens_per_layer.register_forward_pre_hook(self._rows_only)
        try:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    generation_config=config,
                )
        finally:
            handle.remove()
        if margins is not None:
            for logits in out.logits:
                top = torch.topk(logits[0].double(), 2).values
                margins.append(float(top[0] - top[1]))
        return [int(t) for t in out.sequences[0, len(prompt) :]]

    def _rows_only(self, module: torch.nn.Module, args: Any) -> tuple[torch.Tensor]:
        """Before transformers' per-layer embedding lookup: its table becomes
        the called ids' rows alone (in the model's dtype) and the ids their
        index among those rows, so its own forward (lookup, then scale) gives
        the values the whole table would."""
        (ids,) = args
        unique, index = torch.unique(ids, return_inverse=True)
        # The called ids' rows alone (`Checkpoint.table`): the whole table is
        # 4.7 GB in bf16 at E2B, a row 17.5 KB.
        rows = self.ckpt.table("embed_tokens_per_layer.weight").take(unique.tolist())
        module.weight = torch.nn.Parameter(rows.to(self.dtype), requires_grad=False)
        return (index,)

    def teacher_forced(
        self, prompt: list[int], emb: Embeddings, attention: str = ORACLE_ATTENTION
    ) -> dict[str, torch.Tensor]:
        """Final normed hidden and softcapped logits at every prompt position
        (one causal forward), with transformers' ``attention`` implementation.

        transformers gets the embeddings the runtime feeds the chunks (``emb``: scaled
        rows rounded to fp16), not its own fp32 lookups, so the oracle compares the
        decoder's math on identical inputs; the rounding itself is the runtime's.

        One forward reads each weight once, so what it reads is not kept in
        the resident budget (`Resident.passing`): the budget's room stays
        free for the float copies the layers are made into."""
        with RESIDENT.passing():
            return self._teacher_forced(prompt, emb, attention)

    def _teacher_forced(self, prompt: list[int], emb: Embeddings, attention: str) -> dict[str, torch.Tensor]:
        model = self.model
        n_layers, ple = model.config.num_hidden_layers, model.config.hidden_size_per_layer_input
        embeds = torch.cat([emb.hidden(t, self.dtype) for t in prompt], dim=1)
        per_layer = torch.cat([emb.per_layer_raw(t, self.dtype) for t in prompt], dim=1)
        model.config._attn_implementation = attention
        try:
            with torch.no_grad():
                # use_cache=True matters: without a cache, transformers lets KV-shared layers
                # compute their own K/V instead of reading the producer layer's.
                out = model.model(
                    inputs_embeds=embeds,
                    per_layer_inputs=per_layer.view(1, len(prompt), n_layers, ple),
                    use_cache=True,
                )
                hidden = out.last_hidden_state
                # The tied head: lm_head is embed_tokens, a block of rows at a time.
                vocab = model.config.vocab_size
                logits = torch.cat(
                    [
                        torch.nn.functional.linear(hidden[0], self.head_rows(r, r + HEAD_BLOCK).to(self.dtype))
                        for r in range(0, vocab, HEAD_BLOCK)
                    ],
                    dim=-1,
                )
                cap = model.config.final_logit_softcapping
                if cap:
                    logits = torch.tanh(logits / cap) * cap
                logits = logits.float() if self.dtype == torch.float32 else logits
        finally:
            model.config._attn_implementation = ORACLE_ATTENTION
        return {"hidden": hidden[0], "logits": logits}


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


class OracleCheck(Check):
    """The oracle check (the module docstring). It gives the later checks
    transformers' outputs (``Parity.hf``) and the ill-conditioned steps
    (``Parity.ill``); without the oracle (``--no-oracle``) it has no rows."""

    def __init__(self, p: Parity) -> None:
        super().__init__(p)
        self.records: list[OracleRecord] = []

    def compute(self) -> None:
        p = self.p
        if not p.req["oracle"]:
            return
        prompt = p.prompt[: p.steps]
        # transformers reads each weight once per forward (`Oracle.teacher_forced`
        # keeps none): the reference's weights leave the budget first, so its
        # 2.5 GiB is not held beside the layers' float copies (at E2B size the
        # float64 pass's made this run's peak, 5.9 GiB with them).
        RESIDENT.release(lambda key: not (isinstance(key, tuple) and key[:1] == ("checkpoint",)))
        p.say("transformers (eager attention)")
        model = Oracle(p.req["config_path"], p.ckpt)
        hf = model.teacher_forced(prompt, p.emb)
        # transformers against itself: another attention kernel, and float64.
        p.say(f"transformers ({SECOND_ATTENTION} attention), its noise floor")
        opinions = [model.teacher_forced(prompt, p.emb, SECOND_ATTENTION)]
        del model
        p.say("transformers (float64), its noise floor")
        opinions.append(Oracle(p.req["config_path"], p.ckpt, torch.float64).teacher_forced(prompt, p.emb))
        self.records = [oracle_record(t, p.ref_results[t], hf, opinions, p.tol) for t in range(p.steps)]
        p.hf = hf
        p.ill = {o["step"] for o in self.records if o["ill_conditioned"]}

    def write(self, report: ParityReport) -> None:
        ran = bool(self.records)
        report["oracle"] = self.records
        summary = report["summary"]
        summary["oracle_ok"] = all(o["ok"] for o in self.records) if ran else None
        summary["oracle_min_cos"] = min((o["cos"] for o in self.records), default=None)
        summary["ill_conditioned"] = [o["step"] for o in self.records if o["ill_conditioned"]] if ran else None

    def verdicts(self) -> list[Verdict]:
        return [o["verdict"] for o in self.records]


CHECK = OracleCheck
