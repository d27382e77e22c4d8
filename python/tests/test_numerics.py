"""Pieces of the chunk module checked against transformers' own Gemma 4 code."""

from __future__ import annotations

import math
from typing import cast

import pytest
import torch
from chunkforge_py import fixture, model
from chunkforge_py.checkpoint import Checkpoint
from chunkforge_py.contract import Dims
from chunkforge_py.emulate import stepper
from chunkforge_py.roles import Key
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextRotaryEmbedding


def dims_for(cfg: dict) -> Dims:
    """Just the dims the RoPE tables read."""
    rope = cfg["rope_parameters"]
    return cast(
        Dims,
        {
            "head_dim_sliding": cfg["head_dim"],
            "head_dim_full": cfg["global_head_dim"],
            "rope_theta_sliding": rope["sliding_attention"]["rope_theta"],
            "rope_theta_full": rope["full_attention"]["rope_theta"],
            "partial_rotary_factor_full": rope["full_attention"]["partial_rotary_factor"],
        },
    )


@pytest.mark.parametrize("head_dims", [(32, 64), (256, 512)])
def test_rope_tables_match_transformers(head_dims: tuple[int, int]) -> None:
    kwargs = fixture.text_config_dict("e2b")
    kwargs["head_dim"], kwargs["global_head_dim"] = head_dims
    config = Gemma4TextConfig(**kwargs)
    hf = Gemma4TextRotaryEmbedding(config)
    dims = dims_for(kwargs)
    x = torch.zeros(1, dtype=torch.float32)
    for pos in (0, 1, 7, 511, 1500):
        ids = torch.tensor([[pos]])
        for kind, layer_type in (("sliding", "sliding_attention"), ("full", "full_attention")):
            cos_hf, sin_hf = hf(x, ids, layer_type)
            cos, sin = stepper.rope(dims, kind, pos, torch.float32)
            torch.testing.assert_close(cos.view(-1), cos_hf.view(-1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(sin.view(-1), sin_hf.view(-1), rtol=1e-5, atol=1e-5)


def test_full_rope_rotates_only_the_first_quarter_of_pairs() -> None:
    # E2B numbers: 512-dim full heads, partial_rotary_factor 0.25 -> 64 rotating pairs,
    # exponents over the whole 512 dims; the other 192 pairs never rotate.
    dims = cast(Dims, {"head_dim_full": 512, "rope_theta_full": 1e6, "partial_rotary_factor_full": 0.25})
    inv = stepper.inv_freq(dims, "full")
    assert inv.shape == (256,)
    assert torch.all(inv[64:] == 0) and torch.all(inv[:64] > 0)
    assert math.isclose(float(inv[1]), 1e6 ** (-2 / 512), rel_tol=1e-6)
    cos, sin = stepper.rope(dims, "full", 1000, torch.float32)
    assert torch.all(cos.view(-1)[64:256] == 1) and torch.all(sin.view(-1)[64:256] == 0)


def test_rmsnorm_matches_transformers() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 64) * 5
    ours = model.RMSNorm(64, 1e-6)
    ref = Gemma4RMSNorm(64, eps=1e-6)
    w = torch.randn(64)
    assert ours.weight is not None
    ours.weight.data = w.clone()
    ref.weight.data = w.clone()
    torch.testing.assert_close(ours(x), ref(x))
    torch.testing.assert_close(
        model.RMSNorm(64, 1e-6, with_scale=False)(x), Gemma4RMSNorm(64, 1e-6, with_scale=False)(x)
    )


@pytest.mark.parametrize("pos,window", [(0, 8), (5, 8), (7, 8), (8, 8), (30, 8), (3, 512)])
def test_step_masks_follow_transformers_sliding_and_causal_rules(pos: int, window: int) -> None:
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    ctx = 64
    full, sliding, update = stepper.step_masks(ctx, window, pos, torch.float32)
    sliding_rule = sliding_window_causal_mask_function(window)
    for s in range(window):
        key_pos = pos - (window - 1 - s)  # what the window cache holds in slot s
        visible = key_pos >= 0 and bool(sliding_rule(0, 0, torch.tensor(pos), torch.tensor(key_pos)))
        assert (float(sliding.view(-1)[s]) == 0) == visible, (s, key_pos)
    for j in range(ctx):
        # transformers annotates the positions as int; its mask functions run on tensors.
        rule = causal_mask_function(0, 0, torch.tensor(pos), torch.tensor(j))  # type: ignore[arg-type]
        assert (float(full.view(-1)[j]) == 0) == bool(rule)
    assert update.view(-1).tolist() == [1.0 if j == pos else 0.0 for j in range(ctx)]


class _Tables:
    """Just the two embedding tables, as the checkpoint reader hands them out."""

    def __init__(self, embed: torch.Tensor, per_layer: torch.Tensor):
        self.tables = {"embed_tokens.weight": embed, "embed_tokens_per_layer.weight": per_layer}

    def table(self, name: str) -> torch.Tensor:
        return self.tables[name]


def test_step_inputs_are_what_the_runtime_feeds() -> None:
    # The app multiplies the looked-up rows by embed_scale and per_layer_embed_scale and
    # hands fp16 arrays to the first chunk; the chunk must not scale them again.
    torch.manual_seed(1)
    hidden, per_layer = 64, 4 * 32
    embed = torch.randn(10, hidden, dtype=torch.bfloat16)
    ple = torch.randn(10, per_layer, dtype=torch.bfloat16)
    dims = cast(Dims, {"embed_scale": math.sqrt(hidden), "per_layer_embed_scale": math.sqrt(32)})
    emb = stepper.Embeddings(dims, cast(Checkpoint, _Tables(embed, ple)))
    want_h = (embed[3].float() * math.sqrt(hidden)).half().float()
    want_p = (ple[3].float() * math.sqrt(32)).half().float()
    assert torch.equal(emb.hidden(3, torch.float32).view(-1), want_h)
    assert torch.equal(emb.per_layer_raw(3, torch.float32).view(-1), want_p)

    full, sliding, _ = stepper.step_masks(16, 8, 2, torch.float16)
    blocked = torch.cat([full.view(-1)[3:], sliding.view(-1)[:5]])
    assert blocked.numel() == 13 + 5
    assert torch.all(blocked.view(torch.int16) == torch.tensor(0xFC00 - 0x10000, dtype=torch.int16))


@pytest.mark.parametrize("pos", [0, 2, 6, 30])
def test_verify_rows_are_the_decode_rows_of_their_positions(pos: int) -> None:
    # verify_qK's K rows are what K decode steps at pos..pos+K-1 would get: the
    # runtime builds them that way, and each token attends over its own window.
    full, sliding, indicator = stepper.step_masks(64, 8, pos, torch.float32, tokens=3)
    for i in range(3):
        f1, s1, u1 = stepper.step_masks(64, 8, pos + i, torch.float32)
        assert torch.equal(full[0, 0, i], f1.view(-1)) and torch.equal(sliding[0, 0, i], s1.view(-1))
        assert torch.equal(indicator[0, 0, :, i], u1.view(-1))


def test_prefill_window_band_matches_transformers() -> None:
    from transformers.masking_utils import sliding_window_causal_mask_function

    n, w = 12, 5
    causal, last = stepper.prefill_masks(9, n, torch.float32)
    chunk = model.Chunk.__new__(model.Chunk)
    chunk.kind, chunk.tokens, chunk.dims = "prefill", n, cast(Dims, {"sliding_window": w})
    band = chunk._masks({Key("mask_causal"): causal})["sliding"]
    assert band is not None
    sliding = band[0, 0]
    rule = sliding_window_causal_mask_function(w)
    for i in range(n):
        for j in range(n):
            assert (float(sliding[i, j]) == 0) == bool(rule(0, 0, torch.tensor(i), torch.tensor(j))), (i, j)
    assert last.view(-1).tolist() == [1.0 if i == 8 else 0.0 for i in range(n)]


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_rounded_load_is_fp16_then_fp32(source: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`checkpoint.rounded` (how a conversion loads its weights) gives the bits
    of ``.to(fp16).float()``, across blocks and for every shape."""
    from chunkforge_py import checkpoint

    monkeypatch.setattr(checkpoint, "ROUND_BLOCK", 1000)
    gen = torch.Generator().manual_seed(0)
    big = (torch.randn(37, 101, generator=gen) * 30000).to(source)  # some values overflow fp16
    tiny = (torch.randn(64, generator=gen) * 1e-6).to(source)  # fp16 subnormals and zeros
    for t in (big, tiny, torch.tensor(3.14159, dtype=source), torch.zeros(0, 5, dtype=source)):
        got = checkpoint.rounded(t, torch.float32, torch.float16)
        want = t.to(torch.float16).float()
        assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
