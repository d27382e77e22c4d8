"""`chunkforge side-files` read back by independent readers.

Runs the binary (`target/release/chunkforge`, or $CHUNKFORGE_BIN) on the
built-in default checkpoint (fp32, one file, `model.` names) and on a
multimodal checkpoint in three shards (`model.language_model.` names, the text
config under `text_config`), then checks every file with numpy against the
checkpoint as safetensors reads it and against transformers' own Gemma 4 code:
the dequantized tables within int8 rounding, the RoPE tables equal to
`Gemma4TextRotaryEmbedding` at every position, `model_config.json` against
config.json and the scales transformers' text model applies.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextModel, Gemma4TextRotaryEmbedding

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CHUNKFORGE_BIN", ROOT / "target" / "release" / "chunkforge"))
CTX = 64
# Past the tiny fixture's sliding window (512) and large enough that angles
# reach thousands of radians, where f32 rounding of the angle matters.
ROPE_POSITIONS = 3000
# The keys the runtime's ModelConfig.swift reads.
RUNTIME_KEYS = {
    "model_name",
    "architecture",
    "hidden_size",
    "context_length",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "per_layer_dim",
    "num_layers",
    "num_hidden_layers",
    "sliding_window",
    "embed_scale",
    "per_layer_model_projection_scale",
    "per_layer_input_scale",
    "per_layer_embed_scale",
    "layer_types",
    "num_kv_shared_layers",
}


def chunkforge(*args: str) -> subprocess.CompletedProcess[str]:
    assert BIN.exists(), f"{BIN} is missing: run cargo build --release first"
    env = {k: v for k, v in os.environ.items() if k != "GEMMA4_HF_DIR"}
    r = subprocess.run([str(BIN), *args], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module", params=["default", "multimodal-sharded"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One side-files run: its JSON report, the output folder and the checkpoint folder."""
    out = tmp_path_factory.mktemp("side")
    extra: list[str] = []
    if request.param != "default":
        ckpt = tmp_path_factory.mktemp("ckpt") / "mm"
        chunkforge("fixture", "--out", str(ckpt), "--multimodal", "--shards", "3", "--seed", "3")
        extra = ["--hf-dir", str(ckpt)]
    r = chunkforge(
        "side-files", *extra, "--ctx", str(CTX), "--rope-positions", str(ROPE_POSITIONS), "--output", str(out), "--json"
    )
    report = json.loads(r.stdout)
    return {"report": report, "out": out, "ckpt": Path(report["checkpoint"])}


def text_config(ckpt: Path) -> Any:
    return AutoConfig.from_pretrained(ckpt).get_text_config()


def tensor(ckpt: Path, local: str) -> torch.Tensor:
    """A checkpoint tensor by its name without prefix, read by safetensors."""
    index = ckpt / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    for f in files:
        with safe_open(str(ckpt / f), framework="pt") as st:
            for prefix in ("model.language_model.", "model."):
                if prefix + local in st.keys():
                    return st.get_tensor(prefix + local)
    raise KeyError(local)


def fp16_file(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype="<f2")


@pytest.mark.parametrize(
    ("name", "local"),
    [("embed_tokens", "embed_tokens.weight"), ("embed_tokens_per_layer", "embed_tokens_per_layer.weight")],
)
def test_int8_tables_dequantize_to_the_checkpoint(run: dict[str, Any], name: str, local: str) -> None:
    w = tensor(run["ckpt"], local).float().numpy()
    rows, width = w.shape
    q = np.fromfile(run["out"] / f"{name}_q8.bin", dtype=np.int8)
    scales = fp16_file(run["out"] / f"{name}_scales.bin")
    assert q.size == rows * width and scales.size == rows
    q = q.reshape(rows, width)
    absmax = np.abs(w).max(axis=1)
    # Each scale is the row's absmax rounded to fp16; the absmax element maps to ±127.
    np.testing.assert_array_equal(scales, absmax.astype(np.float16))
    assert np.abs(q).max() <= 127
    nonzero = absmax > 0
    assert np.all(np.abs(q[nonzero]).max(axis=1) == 127)
    # The runtime's dequantization: q * (scale / 127).
    step = scales.astype(np.float32) / 127.0
    deq = q.astype(np.float32) * step[:, None]
    # Half a quantization step, plus the scale's own fp16 rounding (an absmax
    # just above its fp16 scale is clamped to 127), plus f32 slack.
    bound = step / 2 + absmax * 2.0**-11 + 1e-6 * absmax + 1e-30
    err = np.abs(deq - w)
    assert np.all(err <= bound[:, None]), f"max error / bound {float((err / bound[:, None]).max())}"


def test_fp16_weights_are_the_checkpoints(run: dict[str, Any]) -> None:
    for name, local in [
        ("per_layer_projection.bin", "per_layer_model_projection.weight"),
        ("per_layer_norm_weight.bin", "per_layer_projection_norm.weight"),
    ]:
        want = tensor(run["ckpt"], local).to(torch.float16).numpy()
        got = fp16_file(run["out"] / name)
        assert got.tobytes() == want.tobytes(), name


@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_rope_tables_are_transformers_rotary_embedding(run: dict[str, Any], kind: str) -> None:
    cfg = text_config(run["ckpt"])
    layer_type = f"{kind}_attention"
    hd = cfg.head_dim if kind == "sliding" else cfg.global_head_dim
    rotary = Gemma4TextRotaryEmbedding(cfg)
    positions = torch.arange(ROPE_POSITIONS).view(1, -1)
    # forward() computes in f32 and returns x's dtype.
    cos_hf, sin_hf = rotary(torch.zeros(1, dtype=torch.float16), positions, layer_type)
    for wave, hf in (("cos", cos_hf), ("sin", sin_hf)):
        path = run["out"] / f"{wave}_{kind}.npy"
        table = np.load(path)
        assert table.dtype == np.float16 and table.shape == (ROPE_POSITIONS, hd)
        # The header is numpy's own, byte for byte.
        saved = io.BytesIO()
        np.save(saved, table)
        assert saved.getvalue() == path.read_bytes()
        want = hf[0].numpy()
        # Within fp16 rounding: at most one fp16 step apart (both round an
        # f32 cos/sin of the same f32 angle), and nearly always identical.
        # (At the fixture's head dims torch's f32 inv_freq is the nearest f32
        # to theta^(-2i/d), as chunkforge's is; at E2B's, two frequencies
        # differ by one f32 step, see README: chunkforge side-files.)
        np.testing.assert_array_max_ulp(table, want, maxulp=1)
        differ = int((table != want).sum())
        assert differ <= table.size // 1000, f"{wave}_{kind}: {differ} of {table.size} values differ by one fp16 step"
    if kind == "full":
        # Proportional RoPE: only the first partial_rotary_factor of the pairs rotate.
        factor = cfg.rope_parameters["full_attention"]["partial_rotary_factor"]
        rotated = int(factor * hd // 2)
        cos = np.load(run["out"] / "cos_full.npy")
        assert np.all(cos[:, rotated : hd // 2] == 1) and np.all(cos[:, hd // 2 + rotated :] == 1)
        assert not np.all(cos[1:, :rotated] == 1)


def test_model_config_is_what_transformers_computes(run: dict[str, Any]) -> None:
    mc = json.loads((run["out"] / "model_config.json").read_text())
    cfg = text_config(run["ckpt"])
    assert RUNTIME_KEYS <= mc.keys()
    with torch.device("meta"):
        model = Gemma4TextModel(cfg)
    assert mc["architecture"] == "gemma4"
    assert mc["model_name"] == run["ckpt"].name
    assert mc["context_length"] == CTX
    assert mc["hidden_size"] == cfg.hidden_size
    assert mc["vocab_size"] == cfg.vocab_size
    assert mc["num_layers"] == mc["num_hidden_layers"] == cfg.num_hidden_layers
    assert mc["per_layer_dim"] == cfg.hidden_size_per_layer_input
    assert mc["sliding_window"] == cfg.sliding_window
    assert mc["num_kv_shared_layers"] == cfg.num_kv_shared_layers
    assert mc["layer_types"] == list(cfg.layer_types)
    assert (mc["head_dim"], mc["global_head_dim"]) == (cfg.head_dim, cfg.global_head_dim)
    assert mc["bos_token_id"] == cfg.bos_token_id
    eos = cfg.eos_token_id
    assert mc["eos_token_id"] == (eos[0] if isinstance(eos, list) else eos)
    for key, value in [
        ("embed_scale", model.embed_tokens.scalar_embed_scale),
        ("per_layer_embed_scale", model.embed_tokens_per_layer.scalar_embed_scale),
        ("per_layer_model_projection_scale", model.per_layer_model_projection_scale),
        ("per_layer_input_scale", model.per_layer_input_scale),
    ]:
        assert math.isclose(mc[key], value, rel_tol=1e-12), key
    assert math.isclose(mc["rms_norm_eps"], cfg.rms_norm_eps)


def test_report_lists_every_file_once_and_no_temporary_is_left(run: dict[str, Any]) -> None:
    out: Path = run["out"]
    listed = {f["path"]: f["bytes"] for f in run["report"]["files"]}
    on_disk = {p.name: p.stat().st_size for p in out.iterdir()}
    assert listed == on_disk
    assert run["report"]["bytes_written"] == sum(listed.values())
    assert 0 < run["report"]["peak_rss_bytes"] < 1 << 30
