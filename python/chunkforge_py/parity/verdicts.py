"""How parity judges a check at an ill-conditioned step.

Parity measures, at every step, how far transformers moves from itself on
the same inputs (its noise floor, `parity.oracle_record`). Where that floor
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
artifact summary) carries its verdict; the run's is the worst of them.
Which rows those are is `CHECKS`, one `Check` per kind of check; Rust's
`parity_checks::CHECKS` (crates/model/src/parity_checks.rs) is the same
table, and a test on each side fails when the report holds a verdict that
no check claims.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..contract import ParityReport, Verdict

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


@dataclass(frozen=True)
class Check:
    """One of parity's checks: its name and where its rows sit in the report
    (object keys from the root, dot-separated; the lists and maps between
    are walked), as `parity_checks.rs` has them."""

    name: str
    field: str

    def verdicts(self, report: ParityReport) -> list[Verdict]:
        """The verdict of every row of this check in ``report``."""
        return [row["verdict"] for row in rows_at(report, self.field.split("."))]


# Every check, in the order Rust prints them.
CHECKS: tuple[Check, ...] = (
    Check("layouts", "steps"),
    Check("oracle", "oracle"),
    Check("artifacts", "summary.artifacts"),
    Check("programs", "summary.programs"),
)


def rows_at(value: Any, keys: list[str]) -> Iterator[dict[str, Any]]:
    """The verdict-carrying objects under ``keys`` in ``value``: a list's
    items and, past the last key, a map's values are walked."""
    if isinstance(value, list):
        for item in value:
            yield from rows_at(item, keys)
    elif not isinstance(value, dict):
        return
    elif keys:
        yield from rows_at(value.get(keys[0]), keys[1:])
    elif "verdict" in value:
        yield value
    else:
        for item in value.values():
            yield from rows_at(item, keys)


def of_report(report: ParityReport) -> Verdict:
    """The run's verdict: the worst of every check's rows."""
    return overall(v for check in CHECKS for v in check.verdicts(report))
