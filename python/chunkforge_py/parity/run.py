"""Parity's driver: the checks Rust names (the request's ``checks``,
crates/model/src/parity_checks.rs `CHECKS`), each the unit
`chunkforge_py.parity.<name>` (`check.Check`), run in that order on what
they are given (`check.Parity`), then judged and written into one report.

Torch on CPU in fp32, teacher-forced decode: step t feeds prompt token t.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import cast

import torch

from .. import weights
from ..contract import ParityReport, ParityRequest
from ..runtime import release_memory
from .check import Check, Hooks, Parity
from .verdicts import overall


def check_of(name: str) -> type[Check]:
    """The unit of the check ``name``: `chunkforge_py.parity.<name>`'s ``CHECK``."""
    unit: type[Check] = importlib.import_module(f"{__package__}.{name}").CHECK
    return unit


def hooks_of(req: ParityRequest) -> Hooks:
    """What the request breaks on purpose: its ``sabotage``, sent only by a
    test build, is applied by python/tests/parity_sabotage.py (on the
    interpreter's path only in a test build, src/test_hooks.rs)."""
    sabotage = req.get("sabotage")
    if sabotage is None:
        return Hooks()
    hooks: Hooks = importlib.import_module("parity_sabotage").Sabotage(sabotage)
    return hooks


def run(req: ParityRequest, progress: Callable[[str], None] | None = None) -> ParityReport:
    """Every parity check of ``req``; ``progress(what)`` is told each phase
    as it starts (the command's spinner, or a log line)."""
    tell = progress or (lambda _what: None)

    def say(what: str) -> None:
        # Each phase starts from what the last one left: its cycles
        # collected and the heap's freed pages given back (at E2B size the
        # verify and prefill programs left 6.0 GiB resident, 2 GiB of it freed).
        release_memory()
        tell(what)

    started = time.perf_counter()
    torch.set_grad_enabled(False)
    p = Parity(req, say, hooks_of(req))
    checks = [check_of(name)(p) for name in req["checks"]]
    for check in checks:
        check.compute()
    report = empty_report(p)
    for check in checks:
        check.write(report)
    summary = report["summary"]
    summary["verdict"] = overall(v for check in checks for v in check.verdicts())
    summary["ok"] = summary["verdict"] == "ok"
    summary["seconds"] = time.perf_counter() - started
    weights.write_stats()
    return report


def empty_report(p: Parity) -> ParityReport:
    """The report before the checks write their rows and their members of
    the summary (each writes its own, whether it ran or not:
    python/tests/test_parity_units.py holds the written report to
    contract.py's keys): what the run itself says."""
    summary = {
        "ok": False,
        "verdict": "fail",
        "steps": p.steps,
        "decode_steps": p.steps - p.prefill,
        "tol_cos": p.tol,
        "seconds": 0.0,
    }
    return cast(ParityReport, {"summary": summary})
