"""The independent oracle: Hugging Face ``Gemma4ForCausalLM`` on the same weights."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint import Checkpoint

if TYPE_CHECKING:
    from .stepper import Embeddings


def load_hf_model(config_path: str, ckpt: Checkpoint) -> Any:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    with open(config_path) as f:
        raw = json.load(f)
    text = raw.get("text_config", raw) if isinstance(raw.get("text_config"), dict) else raw
    fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "transformers_version")}
    config = Gemma4TextConfig(**fields)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config).eval()
    loaded = set()
    # Point the oracle's parameters at the same tensors the chunk modules use
    # (one fp32 copy of the weights in memory, not two).
    state = {}
    for key in [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_buffers()]:
        name = key[len("model.") :]
        if key != "lm_head.weight" and ckpt.prefix + name in ckpt.files:
            state[key] = ckpt.get(name, torch.float32, share=True)
            loaded.add(key)
    model.load_state_dict(state, strict=False, assign=True)
    model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers computed at construction time (not stored in checkpoints) were
    # created on the meta device: build them again for real.
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    model.model.rotary_emb = Gemma4TextRotaryEmbedding(config)
    for module in model.modules():
        if hasattr(module, "scalar_embed_scale"):
            module.embed_scale = torch.tensor(module.scalar_embed_scale)
    state = dict(model.named_parameters())
    # Only the unused K/V projections of KV-shared layers may stay unloaded.
    missing = [
        k
        for k in state
        if k not in loaded and k != "lm_head.weight" and not any(s in k for s in ("k_proj", "v_proj", "k_norm"))
    ]
    if missing:
        raise RuntimeError(f"transformers oracle: tensors not loaded: {missing[:5]}")
    return model


def teacher_forced(model: Any, prompt: list[int], emb: Embeddings) -> dict[str, torch.Tensor]:
    """Final normed hidden and softcapped logits at every prompt position (one causal forward).

    transformers gets the embeddings the runtime feeds the chunks (``emb``: scaled
    rows rounded to fp16), not its own fp32 lookups, so the oracle compares the
    decoder's math on identical inputs; the rounding itself is the runtime's."""
    n_layers, ple = model.config.num_hidden_layers, model.config.hidden_size_per_layer_input
    embeds = torch.cat([emb.hidden(t, torch.float32) for t in prompt], dim=1)
    per_layer = torch.cat([emb.per_layer_raw(t, torch.float32) for t in prompt], dim=1)
    with torch.no_grad():
        # use_cache=True matters: without a cache, transformers lets KV-shared layers
        # compute their own K/V instead of reading the producer layer's.
        out = model.model(
            inputs_embeds=embeds,
            per_layer_inputs=per_layer.view(1, len(prompt), n_layers, ple),
            use_cache=True,
        )
        hidden = out.last_hidden_state[0].float()
        logits = model.lm_head(out.last_hidden_state)[0].float()
        cap = model.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
    return {"hidden": hidden, "logits": logits}
