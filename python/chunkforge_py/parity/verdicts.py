"""How parity judges a check at an ill-conditioned step.

Parity measures, at every step, how far transformers moves from itself on
the same inputs (its noise floor, `oracle.oracle_record`). Where that floor
is past the tolerance the step is ill-conditioned: the model itself, in fp32,
cannot settle the step to the tolerance, so two computations of it made in
different orders may disagree there without either being wrong. A check
that compares such computations (the reference against transformers,
verify_qK or a prefill function against sequential decode, a package's
program against our modules, a layout that started from prefill caches
against the reference that did not) is inconclusive where it fails only at
ill-conditioned steps. A check that compares the same computation (a decode
layout against the reference from the same caches: the same ops on the same
values) is judged exactly everywhere, and so is any failure at a
well-conditioned step.

Every row of the report (a step record, an oracle step, a program or
artifact summary) carries its verdict, which the check that wrote it judged
(`check.Check.write`); the run's is the worst of them (`overall`). Rust's
`parity_checks::CHECKS` (crates/model/src/parity_checks.rs) reads them back
check by check, and a test there fails when the report holds a verdict that
no check claims.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from ..contract import Verdict

ORDER: tuple[Verdict, ...] = ("ok", "inconclusive", "fail")


def judge(failing: Iterable[int], ill: Collection[int], exact: bool = False) -> Verdict:
    """The verdict of a check that failed at the steps ``failing`` (none: it
    held): inconclusive when every one of them is ill-conditioned and the
    check compares computations made in different orders (not ``exact``)."""
    steps = list(failing)
    if not steps:
        return "ok"
    if not exact and all(s in ill for s in steps):
        return "inconclusive"
    return "fail"


def overall(verdicts: Iterable[Verdict]) -> Verdict:
    """The worst verdict: any failure fails, else any inconclusive check."""
    return max(verdicts, key=ORDER.index, default="ok")
