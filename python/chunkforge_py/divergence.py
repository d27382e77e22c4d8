"""How far one model's next-token distributions are from another's, from
their logits at the same positions: the figures `eval` reports (and a
check comparing a package with transformers can use).

Logits are the model's final, softcapped ones; every figure is computed in
float64 from them, so rounding in the figure itself is far below what it
measures.
"""

from __future__ import annotations

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log softmax over the last axis, in float64."""
    return torch.log_softmax(logits.double(), dim=-1)


def kl(source: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(source ‖ other) per row, in nats, from log-probabilities ([..., vocab]):
    the extra code length of coding the source's tokens with the other's
    distribution. 0 when they agree; where the other gives a token the
    source expects (probability p) probability q, it costs p log(p / q)."""
    return (source.exp() * (source - other)).sum(-1).clamp_min(0.0)


def top2_margin(logits: torch.Tensor) -> float:
    """The top logit minus the runner-up's (of one row): near 0 the two
    tokens are a near-tie that rounding may swap."""
    top = torch.topk(logits.double().reshape(-1), 2).values
    return float(top[0] - top[1])


def nll(log_p: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` ([n]) under ``log_p`` ([n, vocab])."""
    return -log_p.gather(-1, targets.view(-1, 1)).view(-1)
