"""Random-weight Gemma 4 checkpoints in the Hugging Face layout.

These stand in for real checkpoints, which cannot be downloaded here. They keep
the real model's layer structure (layer types, KV sharing, double-wide MLP,
two head dims, per-layer embeddings, tied head, softcap) at tiny widths, and
are written by ``transformers`` itself so the real loading path is exercised.
Each also ships the files of a tokenizer (see ``tokenizer``) and a
``generation_config.json``, as Hugging Face checkpoints do.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .contract import FixtureArgs, FixtureInfo
from .tokenizer import BOS, EOS, PAD, SPECIAL_IDS, write_tokenizer

# Layer structure of the released checkpoints; widths are kept tiny.
SHAPES: dict[str, dict[str, Any]] = {
    "e2b": {
        "num_hidden_layers": 35,
        "full_every": 5,
        "num_kv_shared_layers": 20,
        "num_key_value_heads": 1,
    },
    "e4b": {
        "num_hidden_layers": 42,
        "full_every": 6,
        "num_kv_shared_layers": 18,
        "num_key_value_heads": 2,
    },
}


POST_NORM_SCALE = 0.15


# The released checkpoints' widths, for benchmarks (`--full-width`).
FULL_WIDTHS: dict[str, dict[str, int]] = {
    "e2b": {
        "hidden_size": 1536,
        "intermediate_size": 6144,
        "num_attention_heads": 8,
        "head_dim": 256,
        "global_head_dim": 512,
        "hidden_size_per_layer_input": 256,
    },
    "e4b": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_attention_heads": 8,
        "head_dim": 256,
        "global_head_dim": 512,
        "hidden_size_per_layer_input": 256,
    },
}
TINY_WIDTHS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "head_dim": 32,
    "global_head_dim": 64,
    "hidden_size_per_layer_input": 32,
}


def text_config_dict(
    shape: str, sliding_window: int = 512, vocab_size: int = 512, full_width: bool = False
) -> dict[str, Any]:
    """The Gemma4TextConfig keyword arguments for a checkpoint of ``shape`` (tiny widths unless ``full_width``)."""
    s = SHAPES[shape]
    n = s["num_hidden_layers"]
    every = s["full_every"]
    widths = FULL_WIDTHS[shape] if full_width else TINY_WIDTHS
    return {
        **widths,
        "vocab_size": vocab_size,
        "vocab_size_per_layer_input": vocab_size,
        "num_hidden_layers": n,
        "num_key_value_heads": s["num_key_value_heads"],
        "num_kv_shared_layers": s["num_kv_shared_layers"],
        "use_double_wide_mlp": True,
        "sliding_window": sliding_window,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
        # The fixture tokenizer's ids (transformers' Gemma 4 defaults too).
        "pad_token_id": SPECIAL_IDS[PAD],
        "eos_token_id": SPECIAL_IDS[EOS],
        "bos_token_id": SPECIAL_IDS[BOS],
        "rms_norm_eps": 1e-6,
        # A larger init scale keeps the top-1 logit well clear of the runner-up,
        # so parity's "identical token" check is not decided by rounding.
        "initializer_range": 0.1,
        "layer_types": ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        },
    }


def write_fixture(
    out_dir: str,
    shape: str = "e2b",
    seed: int = 0,
    multimodal: bool = False,
    shards: int = 1,
    sliding_window: int = 512,
    vocab_size: int = 512,
    full_width: bool = False,
) -> FixtureInfo:
    """Write a random-weight checkpoint into ``out_dir`` (which must exist and be empty).

    ``multimodal`` writes a ``Gemma4ForConditionalGeneration``-style directory:
    config under ``text_config``, tensors under ``model.language_model.``, and
    extra vision tensors that a loader must skip. ``shards`` > 1 writes
    ``model.safetensors.index.json`` with that many shard files. The tokenizer
    files and ``generation_config.json`` do not depend on ``seed``.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown fixture shape {shape!r}; expected one of {sorted(SHAPES)}")
    torch.manual_seed(seed)
    cfg_kwargs = text_config_dict(shape, sliding_window=sliding_window, vocab_size=vocab_size, full_width=full_width)
    config = Gemma4TextConfig(**cfg_kwargs)
    # First, so a vocabulary too small for the tokenizer fails before the model is built.
    write_tokenizer(out_dir, vocab_size=config.vocab_size, model_max_length=config.max_position_embeddings)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)
    model = Gemma4ForCausalLM(config).eval()
    # Norm weights initialise to ones; perturb them so a loader that drops or
    # swaps a norm produces visibly different numbers.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1.0 + 0.1 * torch.randn_like(p))
        # Trained decoders add small updates to a large residual stream; with
        # unit post-norms a random 35-layer stack is chaotic (1% weight noise
        # flips every token), which would make INT4 agreement meaningless.
        for name, p in model.named_parameters():
            if any(
                k in name
                for k in ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")
            ):
                p.mul_(POST_NORM_SCALE)
        # A wider final norm spreads the logits so top-1 is not a near-tie.
        model.model.norm.weight.mul_(4.0)
        for layer in model.model.layers:
            layer.layer_scalar.fill_(float(torch.empty(1).uniform_(0.7, 1.3)))

    # Real checkpoints are stored in bfloat16; full-width fixtures are too (half the disk).
    store = torch.bfloat16 if full_width else torch.float32
    tensors = {k: v.detach().to(store).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    del model
    if multimodal:
        tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in tensors.items()}
        g = torch.Generator().manual_seed(seed + 1)
        tensors["model.vision_tower.encoder.layers.0.mlp.fc1.weight"] = torch.randn(48, 16, generator=g)
        tensors["model.embed_vision.embedding_projection.weight"] = torch.randn(64, 48, generator=g)
        config_json: dict[str, Any] = {
            "architectures": ["Gemma4ForConditionalGeneration"],
            "model_type": "gemma4",
            "text_config": {**config.to_dict(), "model_type": "gemma4_text"},
            "vision_config": {"model_type": "gemma4_vision", "hidden_size": 48},
            "tie_word_embeddings": True,
        }
    else:
        config_json = {**config.to_dict(), "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}

    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        per = (len(names) + shards - 1) // shards
        for i in range(shards):
            part = names[i * per : (i + 1) * per]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k] for k in part}, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2, sort_keys=True)
    return {"tensors": len(names), "parameters": int(sum(t.numel() for t in tensors.values()))}


def write_fixture_json(args: FixtureArgs) -> FixtureInfo:
    """Entry point for Rust: ``write_fixture`` with its arguments in one dict."""
    return write_fixture(
        args["out_dir"],
        shape=args["shape"],
        seed=int(args["seed"]),
        multimodal=bool(args["multimodal"]),
        shards=int(args["shards"]),
        sliding_window=int(args["sliding_window"]),
        vocab_size=int(args.get("vocab_size", 512)),
        full_width=bool(args.get("full_width", False)),
    )
