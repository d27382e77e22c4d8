"""Parity's checks table (`verdicts.CHECKS`): every verdict the report can
hold belongs to a check, and a failure in any check decides the run."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, cast

import pytest
from chunkforge_py.contract import ParityReport, Verdict
from chunkforge_py.parity import verdicts

SEAM = json.loads((Path(__file__).parent / "seam.json").read_text())
# The reply of parity.run as Rust declares it (its ParityReport's JSON schema).
REPORT = next(e for e in SEAM if (e["module"], e["function"]) == ("parity.run", "run"))["reply"]


def verdict_paths(schema: dict[str, Any], path: str, out: set[str]) -> None:
    """The paths (object keys, dot-separated) of every object in ``schema``
    that carries a ``verdict``; lists, maps and alternatives are walked."""
    ref = schema.get("$ref")
    if ref:
        schema = REPORT["$defs"][ref.removeprefix("#/$defs/")]
    props = schema.get("properties", {})
    if "verdict" in props:
        out.add(path)
    for key, sub in props.items():
        verdict_paths(sub, f"{path}.{key}" if path else key, out)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            verdict_paths(schema[key], path, out)
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key, []):
            verdict_paths(sub, path, out)


def test_every_verdict_in_the_rust_report_belongs_to_one_check() -> None:
    """A new kind of row with a verdict (a KL check's, say) needs its Check
    here, as Rust's parity_checks.rs needs one: else the run's verdict would
    not see it."""
    paths: set[str] = set()
    verdict_paths(REPORT, "", paths)
    paths.remove("summary")  # the run's own verdict, which the checks add up to
    fields = [c.field for c in verdicts.CHECKS]
    assert sorted(fields) == sorted(paths)
    assert len(set(c.name for c in verdicts.CHECKS)) == len(verdicts.CHECKS)


def row(**extra: Any) -> dict[str, Any]:
    return {"ok": True, "verdict": "ok", **extra}


# A report with one row of every check, all held.
HELD: dict[str, Any] = {
    "steps": [row(layout="two", step=0), row(layout="verify_qK", step=0)],
    "oracle": [row(step=0, ill_conditioned=False)],
    "artifacts": [{"layout": "two", "step": 0, "same_token": True}],
    "programs": [{"target": "two", "step": 0}],
    "summary": {
        "ok": True,
        "verdict": "ok",
        "artifacts": {"two": row(min_cos=1.0), "verify_qK": row(min_cos=1.0)},
        "programs": {"two": {"fp32": row(gated=True), "fp16": row(gated=False)}},
    },
}


@pytest.mark.parametrize("check", verdicts.CHECKS, ids=lambda c: c.name)
@pytest.mark.parametrize("verdict", ["fail", "inconclusive"])
def test_a_row_of_any_check_decides_the_run(check: verdicts.Check, verdict: Verdict) -> None:
    report = cast(ParityReport, copy.deepcopy(HELD))
    assert verdicts.of_report(report) == "ok"
    rows = list(verdicts.rows_at(report, check.field.split(".")))
    assert rows, f"HELD has no row of the {check.name} check"
    rows[-1].update(ok=False, verdict=verdict)
    assert check.verdicts(report).count(verdict) == 1
    assert verdicts.of_report(report) == verdict
    # A failure elsewhere outweighs an inconclusive check.
    other = next(c for c in verdicts.CHECKS if c != check)
    next(verdicts.rows_at(report, other.field.split("."))).update(ok=False, verdict="fail")
    assert verdicts.of_report(report) == "fail"
