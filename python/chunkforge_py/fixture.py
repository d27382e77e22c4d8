"""Random-weight Gemma 4 checkpoints in the Hugging Face layout.

These stand in for real checkpoints, which cannot be downloaded here. They keep
the real model's layer structure (layer types, KV sharing, double-wide MLP,
two head dims, per-layer embeddings, tied head, softcap) at tiny widths, and
are written by ``transformers`` itself so the real loading path is exercised.
Each also ships the files of a tokenizer (see ``tokenizer``) and a
``generation_config.json``, as Hugging Face checkpoints do.

Full-size checkpoints (the published E2B and E4B shapes, 262144-token
vocabulary) do not fit in memory as a transformers model: ``full_size_layout``
writes their config and tokenizer and returns, for every tensor of the model
transformers builds from that config (on the meta device, so nothing is
allocated), its name, shape and how its values are drawn; Rust streams the
values into shards (src/fixture/stream.rs).
"""

from __future__ import annotations

import json
import os
from typing import Any, cast

import torch

from .contract import (
    AttentionSharpness,
    FixtureArgs,
    FixtureInfo,
    FullSizeArgs,
    FullSizeLayout,
    Init,
    NormalInit,
    TensorRecipe,
)
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


# How the fixtures' weights are drawn (the transformers-made fixtures
# perturb transformers' own initialisation this way; full-size ones are drawn
# from the same distributions tensor by tensor, ``full_size_init``).
# Projections and embeddings: N(0, INITIALIZER_RANGE^2); a larger scale than
# transformers' 0.02 keeps the top-1 logit well clear of the runner-up, so
# parity's "identical token" check is not decided by rounding.
INITIALIZER_RANGE = 0.1
# Norm weights: their scale times (1 + NORM_SPREAD * N(0, 1)), so a loader that
# drops or swaps a norm produces visibly different numbers.
NORM_SPREAD = 0.1
# Trained decoders add small updates to a large residual stream; with unit
# post-norms a random 35-layer stack is chaotic (1% weight noise flips every
# token), which would make INT4 agreement meaningless.
POST_NORM_SCALE = 0.15
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm")
# A wider final norm spreads the logits so top-1 is not a near-tie.
FINAL_NORM_SCALE = 4.0
# Full size: the final norm's scale puts the raw logits' standard deviation
# here instead. The largest of 262144 normals is about 4.9 deviations out, and
# the softcap (30 tanh(x / 30)) squeezes what lies beyond ~30: at FINAL_NORM_SCALE
# the top logits of an E2B-width model (deviation 16) sit at 29.6 and up and
# the top-2 margin is ~0.07, near 5 the softcap costs the margin least.
FULL_SIZE_LOGIT_SPREAD = 5.0
LAYER_SCALAR_RANGE = (0.7, 1.3)

# Attention sharpness (``--attention``, ``qk_norm_init``). q and k are
# RMS-normed per head, so with norm weights w_q, w_k a random q.k score over
# head_dim dimensions has a standard deviation near sqrt(head_dim) * w_q * w_k
# (Gemma 4's attention scale is 1): 16 at E2B's head_dim 256 with unit-ish
# weights, where softmax is nearly hard; near 1 with weights near 0.25. Both
# scale with (QK_REFERENCE_HEAD_DIM / head_dim)^(1/4), so every head dim gets
# the same score spread.
#
# Sharpness alone does not make a checkpoint ill-conditioned: the damping
# above (post-norms of 0.15 against embeddings of INITIALIZER_RANGE) keeps a
# random stack calm whatever its attention (transformers' sdpa and eager
# attention agree to 1-cos < 1e-9 at E2B widths even with q/k weights of 8).
# So ``sharp`` is the random checkpoint one gets without taming:
# transformers' own initialisation (weights N(0, 0.02^2), norms near 1, none
# damped) with unit-ish q/k norm weights. There the nearly hard softmax of a
# stack that amplifies what it is given lets the last bit of a score decide
# now and then: the small E2B-shaped fixture of seed 1 is ill-conditioned at
# step 12, where transformers moves from itself by 1-cos 2e-4.
QK_REFERENCE_HEAD_DIM = 256
QK_SOFT_SCALE = 0.25
QK_SHARP_RANGE = (0.5, 1.5)
SHARP_INITIALIZER_RANGE = 0.02


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
# The published checkpoints' text configs beyond their widths
# (transformers' convert_gemma4_weights.py, variants gemma-4-e2b and
# gemma-4-e4b): the full vocabulary, 131072 positions, and the double-wide MLP
# of E2B's KV-shared layers (E4B has none). Fields left out take
# Gemma4TextConfig's defaults.
PUBLISHED: dict[str, dict[str, Any]] = {
    "e2b": {"use_double_wide_mlp": True},
    "e4b": {"use_double_wide_mlp": False},
}
PUBLISHED_VOCAB_SIZE = 262_144
PUBLISHED_MAX_POSITIONS = 131_072
TINY_WIDTHS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "head_dim": 32,
    "global_head_dim": 64,
    "hidden_size_per_layer_input": 32,
}
# Query heads per KV head at tiny widths: 2, so attention is grouped-query
# as in the released shapes (E2B 8 per KV head, E4B 4), and a graph that
# repeats anything per group has it at tiny widths too (E4B's once had 2
# query heads over 2 KV heads, and only the full-size build showed the
# `tile` its verify attention made).
TINY_GROUPS = 2


def text_config_dict(
    shape: str, sliding_window: int = 512, vocab_size: int = 512, full_width: bool = False
) -> dict[str, Any]:
    """The Gemma4TextConfig keyword arguments for a checkpoint of ``shape`` (tiny widths unless ``full_width``)."""
    s = SHAPES[shape]
    n = s["num_hidden_layers"]
    every = s["full_every"]
    widths = (
        FULL_WIDTHS[shape]
        if full_width
        else {**TINY_WIDTHS, "num_attention_heads": TINY_GROUPS * s["num_key_value_heads"]}
    )
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
        "initializer_range": INITIALIZER_RANGE,
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
    attention: AttentionSharpness | None = None,
) -> FixtureInfo:
    """Write a random-weight checkpoint into ``out_dir`` (which must exist and be empty).

    ``multimodal`` writes a ``Gemma4ForConditionalGeneration``-style directory:
    config under ``text_config``, tensors under ``model.language_model.``, and
    extra vision tensors that a loader must skip. ``shards`` > 1 writes
    ``model.safetensors.index.json`` with that many shard files. The tokenizer
    files and ``generation_config.json`` do not depend on ``seed``.
    ``attention`` ``soft`` draws the q/k norm weights for soft attention
    (``qk_norm_init``) after every other weight, which stays as without it;
    ``sharp`` makes transformers' own initialisation with unit-ish q/k norm
    weights (see QK_SHARP_RANGE).
    """
    from safetensors.torch import save_file
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown fixture shape {shape!r}; expected one of {sorted(SHAPES)}")
    torch.manual_seed(seed)
    cfg_kwargs = text_config_dict(shape, sliding_window=sliding_window, vocab_size=vocab_size, full_width=full_width)
    # The sharp checkpoint is transformers' own initialisation, undamped.
    tamed = attention != "sharp"
    if not tamed:
        cfg_kwargs["initializer_range"] = SHARP_INITIALIZER_RANGE
    config = Gemma4TextConfig(**cfg_kwargs)
    # First, so a vocabulary too small for the tokenizer fails before the model is built.
    write_side_files(out_dir, config)
    model = Gemma4ForCausalLM(config).eval()
    # Norm weights initialise to ones; perturb them (see NORM_SPREAD and the
    # scales beside it).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1.0 + NORM_SPREAD * torch.randn_like(p))
        for name, p in model.named_parameters():
            if tamed and any(k in name for k in POST_NORMS):
                p.mul_(POST_NORM_SCALE)
        if tamed:
            model.model.norm.weight.mul_(FINAL_NORM_SCALE)
        for layer in model.model.layers:
            layer.layer_scalar.fill_(float(torch.empty(1).uniform_(*LAYER_SCALAR_RANGE)))
        if attention is not None:
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.copy_(sample(qk_norm_init(attention, p.shape[-1]), tuple(p.shape)))

    # Real checkpoints are stored in bfloat16; full-width fixtures are too (half the disk).
    store = torch.bfloat16 if full_width else torch.float32
    tensors = {k: v.detach().to(store).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    del model
    if multimodal:
        tensors = {multimodal_name(k): v for k, v in tensors.items()}
        g = torch.Generator().manual_seed(seed + 1)
        for vision, vision_shape in VISION_TENSORS.items():
            tensors[vision] = torch.randn(*vision_shape, generator=g)

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
    write_config(out_dir, config, multimodal)
    return {"tensors": len(names), "parameters": int(sum(t.numel() for t in tensors.values()))}


# Tensors of a vision tower that a multimodal checkpoint holds beside the text
# decoder's, and that a loader must skip.
VISION_TENSORS: dict[str, tuple[int, ...]] = {
    "model.vision_tower.encoder.layers.0.mlp.fc1.weight": (48, 16),
    "model.embed_vision.embedding_projection.weight": (64, 48),
}


def multimodal_name(name: str) -> str:
    """A text-decoder tensor's name in a ``Gemma4ForConditionalGeneration`` checkpoint."""
    return name.replace("model.", "model.language_model.", 1)


def write_side_files(out_dir: str, config: Any) -> None:
    """The tokenizer's files and ``generation_config.json`` (they depend on the config alone)."""
    from transformers import GenerationConfig

    write_tokenizer(out_dir, vocab_size=config.vocab_size, model_max_length=config.max_position_embeddings)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out_dir)


def write_config(out_dir: str, config: Any, multimodal: bool) -> None:
    """``config.json``: the text config, flat or under ``text_config`` of a multimodal checkpoint."""
    if multimodal:
        config_json: dict[str, Any] = {
            "architectures": ["Gemma4ForConditionalGeneration"],
            "model_type": "gemma4",
            "text_config": {**config.to_dict(), "model_type": "gemma4_text"},
            "vision_config": {"model_type": "gemma4_vision", "hidden_size": 48},
            "tie_word_embeddings": True,
        }
    else:
        config_json = {**config.to_dict(), "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2, sort_keys=True)


def qk_norm_init(attention: AttentionSharpness, head_dim: int) -> Init:
    """q/k norm weights for ``soft`` or ``sharp`` random attention at ``head_dim`` (see QK_SOFT_SCALE)."""
    f = (QK_REFERENCE_HEAD_DIM / head_dim) ** 0.25
    if attention == "soft":
        return {"normal": {"mean": QK_SOFT_SCALE * f, "std": NORM_SPREAD * QK_SOFT_SCALE * f}}
    low, high = QK_SHARP_RANGE
    return {"uniform": {"low": low * f, "high": high * f}}


def sample(init: Init, shape: tuple[int, ...]) -> torch.Tensor:
    """Values of ``shape`` drawn as ``init`` says, from torch's global generator."""
    if "normal" in init:
        n = cast(NormalInit, init)["normal"]
        return torch.randn(shape) * n["std"] + n["mean"]
    u = init["uniform"]
    return torch.empty(shape).uniform_(u["low"], u["high"])


def full_size_init(name: str, shape: list[int], attention: AttentionSharpness) -> Init:
    """How a full-size tensor's values are drawn: the distributions the
    transformers-made fixtures end up with (``write_fixture``, soft or sharp),
    by tensor name, but for the final norm of a soft one
    (FULL_SIZE_LOGIT_SPREAD)."""

    def normal(mean: float, std: float) -> Init:
        return {"normal": {"mean": mean, "std": std}}

    if name.endswith("layer_scalar"):
        low, high = LAYER_SCALAR_RANGE
        return {"uniform": {"low": low, "high": high}}
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return qk_norm_init(attention, shape[-1])
    if attention == "sharp":
        # transformers' own initialisation, nothing damped (see QK_SHARP_RANGE).
        return normal(1.0, NORM_SPREAD) if name.endswith("norm.weight") else normal(0.0, SHARP_INITIALIZER_RANGE)
    if name == "model.norm.weight":
        # Normed hidden of RMS w against embedding rows of deviation
        # INITIALIZER_RANGE: logits of deviation w * INITIALIZER_RANGE * sqrt(hidden).
        scale = FULL_SIZE_LOGIT_SPREAD / (INITIALIZER_RANGE * shape[0] ** 0.5)
        return normal(scale, NORM_SPREAD * scale)
    if any(k in name for k in POST_NORMS):
        return normal(POST_NORM_SCALE, NORM_SPREAD * POST_NORM_SCALE)
    if name.endswith("norm.weight"):
        return normal(1.0, NORM_SPREAD)
    return normal(0.0, INITIALIZER_RANGE)


def published_config(shape: str, sliding_window: int = 512) -> dict[str, Any]:
    """The Gemma4TextConfig keyword arguments of the published checkpoint of ``shape``."""
    return {
        **text_config_dict(shape, sliding_window=sliding_window, vocab_size=PUBLISHED_VOCAB_SIZE, full_width=True),
        **PUBLISHED[shape],
        "max_position_embeddings": PUBLISHED_MAX_POSITIONS,
    }


def full_size_layout(
    out_dir: str,
    shape: str = "e2b",
    multimodal: bool = False,
    sliding_window: int = 512,
    attention: AttentionSharpness = "soft",
) -> FullSizeLayout:
    """Write the config, tokenizer and generation config of a full-size
    checkpoint into ``out_dir`` and return its tensors (names and shapes of
    transformers' ``Gemma4ForCausalLM`` of that config, tied head left out,
    in name order) with how each is drawn; the caller streams the values."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown fixture shape {shape!r}; expected one of {sorted(SHAPES)}")
    config = Gemma4TextConfig(**published_config(shape, sliding_window))
    write_side_files(out_dir, config)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    state = model.state_dict()
    recipes: list[TensorRecipe] = []
    for name in sorted(k for k in state if k != "lm_head.weight"):
        dims = [int(d) for d in state[name].shape]
        init = full_size_init(name, dims, attention)
        recipes.append({"name": multimodal_name(name) if multimodal else name, "shape": dims, "init": init})
    if multimodal:
        for vision, vision_shape in VISION_TENSORS.items():
            recipes.append({"name": vision, "shape": list(vision_shape), "init": {"normal": {"mean": 0.0, "std": 1.0}}})
    write_config(out_dir, config, multimodal)
    return {"tensors": sorted(recipes, key=lambda r: r["name"])}


def full_size_layout_json(args: FullSizeArgs) -> FullSizeLayout:
    """Entry point for Rust: ``full_size_layout`` with its arguments in one dict."""
    return full_size_layout(
        args["out_dir"],
        shape=args["shape"],
        multimodal=bool(args["multimodal"]),
        sliding_window=int(args["sliding_window"]),
        attention=args["attention"],
    )


def write_fixture_json(args: FixtureArgs) -> FixtureInfo:
    """Entry point for Rust: ``write_fixture`` with its arguments in one dict."""
    return write_fixture(
        args["out_dir"],
        shape=args["shape"],
        seed=int(args["seed"]),
        multimodal=bool(args["multimodal"]),
        shards=int(args["shards"]),
        sliding_window=int(args["sliding_window"]),
        vocab_size=args["vocab_size"],
        full_width=args["full_width"],
        attention=args["attention"],
    )
