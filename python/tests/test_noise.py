"""The INT4 check's noise floor (`parity/noise.py`): weights moved by noise
of a given relative MSE, and the verdict it gives a failed INT4 check."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from chunkforge_py.checkpoint import Checkpoint
from chunkforge_py.contract import NoiseDraw, ParityThresholds, WeightNoise
from chunkforge_py.parity import noise
from chunkforge_py.parity.artifacts import relative_mse
from chunkforge_py.weights import Resident
from safetensors.torch import save_file


@pytest.mark.parametrize("block", [1 << 22, 64, 1])
def test_noisy_weights_have_the_asked_relative_mse_whether_read_by_rows_or_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr("chunkforge_py.checkpoint.RESIDENT", Resident())
    monkeypatch.setattr(noise, "NOISE_BLOCK", block)
    w = torch.randn(300, 64) * 0.05 + 0.01
    path = str(tmp_path / "w.safetensors")
    save_file({"model.w": w}, path, metadata={"format": "pt"})
    ckpt = Checkpoint({"prefix": "model.", "files": {"model.w": path}})
    fetcher = ckpt.fetcher("w", torch.float32)
    shape = (300, 64, 1, 1)
    by_rows = noise.noisy_weight(fetcher, lambda: fetcher().view(shape), shape, 0.01, 5)
    whole = noise.noisy_weight(None, lambda: w.view(shape), shape, 0.01, 5)
    assert by_rows.shape == shape and by_rows.dtype == torch.float32
    # The same seed, the same noise, however the weight was read; the
    # source is not touched.
    assert torch.equal(by_rows, whole)
    assert torch.equal(fetcher(), w)
    assert relative_mse(by_rows.view(300, 64), w) == pytest.approx(0.01, rel=0.05)
    other = noise.noisy_weight(None, lambda: w.view(shape), shape, 0.01, noise.seed_of("another"))
    assert not torch.equal(other, whole)


REQ = cast(ParityThresholds, {"tol_cos_int4": 0.85, "min_top1_int4": 0.75})


def floor(min_cos: float, top1: float) -> WeightNoise:
    """One draw."""
    return spread((min_cos, top1))


def spread(*draws: tuple[float, float]) -> WeightNoise:
    """Draws of (min cos, top-1)."""
    each: list[NoiseDraw] = [{"min_cos": c, "mean_cos": c, "top1_agreement": t} for c, t in draws]
    return {
        "min_cos": min(c for c, _ in draws),
        "mean_cos": sum(c for c, _ in draws) / len(draws),
        "top1_agreement": min(t for _, t in draws),
        "draws": each,
    }


@pytest.mark.parametrize(
    ("int4", "weight_noise", "verdict"),
    [
        # The sharp E2B-size checkpoint: INT4 and noise of its size both
        # move the logits far off.
        ((0.26, 0.0), floor(0.31, 0.06), "inconclusive"),
        # Noise stays within a threshold INT4 fails: INT4 is worse than noise.
        ((0.26, 0.0), floor(0.95, 0.0), "fail"),
        ((0.26, 0.0), floor(0.20, 0.9), "fail"),
        ((0.80, 0.9), floor(0.90, 0.5), "fail"),
        # Only the failed threshold has to be failed by the noise too.
        ((0.80, 0.9), floor(0.70, 1.0), "inconclusive"),
        ((0.95, 0.5), floor(0.99, 0.25), "inconclusive"),
        # Not measured: judged as it stands.
        ((0.26, 0.0), None, "fail"),
        # Draws on both sides of the cos threshold: INT4 within their spread
        # is as good as some draw of noise its size; below all of them it is
        # worse than noise, wherever the threshold.
        ((0.80, 1.0), spread((0.70, 1.0), (0.90, 1.0), (0.95, 1.0)), "inconclusive"),
        ((0.60, 1.0), spread((0.70, 1.0), (0.90, 1.0), (0.95, 1.0)), "fail"),
        # Every draw fails the threshold: explained, however INT4 compares.
        ((0.20, 1.0), spread((0.30, 1.0), (0.40, 1.0)), "inconclusive"),
        # One draw alone would have said inconclusive; the others pass the
        # threshold and INT4 is worse than all of them.
        ((0.26, 0.0), spread((0.31, 0.06), (0.95, 0.9), (0.97, 1.0)), "fail"),
    ],
)
def test_a_failed_int4_check_is_inconclusive_only_where_noise_of_its_size_fails_the_same_thresholds(
    int4: tuple[float, float], weight_noise: WeightNoise | None, verdict: str
) -> None:
    assert noise.int4_verdict(*int4, weight_noise, REQ) == verdict
