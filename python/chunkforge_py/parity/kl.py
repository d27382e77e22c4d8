"""The KL check: the reference's next-token distribution against
transformers', over the teacher-forced steps: per step KL(transformers ‖
reference) in nats, and their mean and largest against --max-kl (the report's
``kl`` and ``summary.kl``; Rust's `parity_checks::KL`). It reads the oracle
check's outputs, so without the oracle it has no rows. A failure only at
ill-conditioned steps is inconclusive (the two compute the step in another
order: `verdicts.judge`).
"""

from __future__ import annotations

import torch

from ..contract import KlRecord, KlSummary, ParityReport, Verdict
from .check import Check, Parity
from .verdicts import judge


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(softmax(p) ‖ softmax(q)) in nats, computed in float64."""
    log_p = torch.log_softmax(p_logits.double().reshape(-1), dim=0)
    log_q = torch.log_softmax(q_logits.double().reshape(-1), dim=0)
    return float((log_p.exp() * (log_p - log_q)).sum())


class KlCheck(Check):
    """The KL check (the module docstring)."""

    def __init__(self, p: Parity) -> None:
        super().__init__(p)
        self.records: list[KlRecord] = []
        self.summary: KlSummary | None = None

    def compute(self) -> None:
        p = self.p
        if p.hf is None:
            return
        for t in range(p.steps):
            kl = kl_divergence(p.hf["logits"][t], p.ref_results[t]["logits"])
            self.records.append({"step": t, "kl": kl})

    def write(self, report: ParityReport) -> None:
        report["kl"] = self.records
        if self.records:
            limit = self.p.req["thresholds"]["max_kl"]
            worst = max(self.records, key=lambda r: r["kl"])
            failing = [r["step"] for r in self.records if not r["kl"] <= limit]
            self.summary = {
                "steps": len(self.records),
                "mean": sum(r["kl"] for r in self.records) / len(self.records),
                "max": worst["kl"],
                "max_step": worst["step"],
                "ok": not failing,
                "verdict": judge(failing, self.p.ill),
            }
        report["summary"]["kl"] = self.summary

    def verdicts(self) -> list[Verdict]:
        return [self.summary["verdict"]] if self.summary else []


CHECK = KlCheck
