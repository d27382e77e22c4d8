"""Random-weight checkpoints (chunkforge_py.fixture): the full-size layout is
transformers' model of the published configs, tensor for tensor; the q/k norm
recipes give the score spreads they are named for; ``attention`` touches the
q/k norms only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from chunkforge_py.contract import AttentionSharpness
from chunkforge_py.fixture import QK_REFERENCE_HEAD_DIM, full_size_layout, qk_norm_init, sample, write_fixture
from safetensors.torch import load_file

# The published checkpoints' parameter counts (text decoder, tied head counted once,
# layer scalars included), from their configs.
PUBLISHED = {
    "e2b": {"parameters": 4_647_449_891, "num_hidden_layers": 35, "hidden_size": 1536, "num_key_value_heads": 1},
    "e4b": {"parameters": 7_518_069_034, "num_hidden_layers": 42, "hidden_size": 2560, "num_key_value_heads": 2},
}


@pytest.mark.parametrize("shape", ["e2b", "e4b"])
def test_full_size_layout_is_transformers_model_of_the_published_config(tmp_path: Path, shape: str) -> None:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    layout = full_size_layout(str(tmp_path), shape)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Gemma4ForCausalLM"]
    config = Gemma4TextConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    want = PUBLISHED[shape]
    for key in ("num_hidden_layers", "hidden_size", "num_key_value_heads"):
        assert getattr(config, key) == want[key], key
    assert (config.vocab_size, config.vocab_size_per_layer_input, config.hidden_size_per_layer_input) == (
        262_144,
        262_144,
        256,
    )
    assert config.tie_word_embeddings
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    state = {k: list(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    got = {t["name"]: t["shape"] for t in layout["tensors"]}
    assert got == state
    assert sum(math.prod(s) for s in got.values()) == want["parameters"]
    assert [t["name"] for t in layout["tensors"]] == sorted(got)
    # A tokenizer of the whole vocabulary and a generation config beside it.
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) + len(tok["added_tokens"]) >= 262_144
    assert (tmp_path / "generation_config.json").exists()


def test_full_size_multimodal_names_and_inits(tmp_path: Path) -> None:
    sharpness: tuple[AttentionSharpness, ...] = ("soft", "sharp")
    for attention in sharpness:
        d = tmp_path / attention
        d.mkdir()
        layout = full_size_layout(str(d), "e2b", multimodal=True, attention=attention)
        init = {t["name"]: t["init"] for t in layout["tensors"]}
        assert "model.vision_tower.encoder.layers.0.mlp.fc1.weight" in init
        assert not any(n.startswith("model.layers.") for n in init)
        prefix = "model.language_model."
        assert init[prefix + "layers.0.self_attn.q_norm.weight"] == qk_norm_init(attention, 256)
        # Full-attention layers have 512-dim heads.
        assert init[prefix + "layers.4.self_attn.k_norm.weight"] == qk_norm_init(attention, 512)
        assert init[prefix + "layers.0.layer_scalar"] == {"uniform": {"low": 0.7, "high": 1.3}}
        post = init[prefix + "layers.0.post_attention_layernorm.weight"]
        up = init[prefix + "layers.0.mlp.up_proj.weight"]
        if attention == "soft":
            # Damped post-norms, the fixtures' weight scale.
            assert (post, up) == ({"normal": {"mean": 0.15, "std": 0.015}}, {"normal": {"mean": 0.0, "std": 0.1}})
        else:
            # transformers' own initialisation.
            assert (post, up) == ({"normal": {"mean": 1.0, "std": 0.1}}, {"normal": {"mean": 0.0, "std": 0.02}})
        raw = json.loads((d / "config.json").read_text())
        assert raw["architectures"] == ["Gemma4ForConditionalGeneration"]
        assert raw["text_config"]["num_hidden_layers"] == 35


@pytest.mark.parametrize(("attention", "spread"), [("soft", 1.0), ("sharp", 16.0)])
@pytest.mark.parametrize("head_dim", [QK_REFERENCE_HEAD_DIM, 512, 32])
def test_qk_norm_recipes_give_the_score_spread_they_are_named_for(attention: str, spread: float, head_dim: int) -> None:
    # q and k as the attention sees them: RMS-normed random heads times the norm weights.
    torch.manual_seed(0)
    n = 4000
    w_q = sample(qk_norm_init(attention, head_dim), (head_dim,))  # type: ignore[arg-type]
    w_k = sample(qk_norm_init(attention, head_dim), (head_dim,))  # type: ignore[arg-type]
    q, k = torch.randn(n, head_dim), torch.randn(n, head_dim)
    q = q / q.pow(2).mean(-1, keepdim=True).sqrt() * w_q
    k = k / k.pow(2).mean(-1, keepdim=True).sqrt() * w_k
    scores = (q * k).sum(-1)
    # sqrt(head_dim) * w_q * w_k at E2B's 256, the same spread at every head dim.
    assert float(scores.std()) == pytest.approx(spread, rel=0.25)


def test_soft_attention_draws_only_the_qk_norms_and_sharp_is_transformers_init(tmp_path: Path) -> None:
    written = {}
    choices: tuple[AttentionSharpness | None, ...] = (None, "soft", "sharp")
    for attention in choices:
        d = tmp_path / str(attention)
        d.mkdir()
        write_fixture(str(d), attention=attention)
        written[attention] = load_file(str(d / "model.safetensors"))
    plain, soft, sharp = written[None], written["soft"], written["sharp"]
    assert plain.keys() == soft.keys() == sharp.keys()
    changed = sorted(k for k in plain if not torch.equal(plain[k], soft[k]))
    assert changed and all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in changed)
    f = (QK_REFERENCE_HEAD_DIM / 32) ** 0.25
    q = soft["model.layers.0.self_attn.q_norm.weight"]
    assert abs(float(q.mean()) - 0.25 * f) < 0.05 * f
    q = sharp["model.layers.0.self_attn.q_norm.weight"]
    assert float(q.min()) >= 0.5 * f and float(q.max()) <= 1.5 * f
    # Undamped post-norms and transformers' weight scale.
    assert abs(float(sharp["model.layers.0.post_attention_layernorm.weight"].mean()) - 1.0) < 0.05
    assert abs(float(sharp["model.layers.0.mlp.up_proj.weight"].std()) - 0.02) < 0.002
    assert abs(float(plain["model.layers.0.mlp.up_proj.weight"].std()) - 0.1) < 0.01
