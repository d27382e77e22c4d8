"""Parity's checks as units (`chunkforge_py.parity.<name>`, one per check Rust
names: crates/model/src/parity_checks.rs `CheckName`, whose names seam.json
lists): each exists, each writes its members of the report whether it ran or
not (so the report has every key contract.py declares), and every verdict a
unit writes is one the run's verdict counts."""

from __future__ import annotations

import copy
import json
import typing
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from chunkforge_py.contract import ParityReport, ParityRequest, ParitySummary, Verdict
from chunkforge_py.parity.check import Check, Parity
from chunkforge_py.parity.kl import KlCheck, kl_divergence
from chunkforge_py.parity.run import check_of, empty_report
from chunkforge_py.parity.verdicts import overall

SEAM = json.loads((Path(__file__).parent / "seam.json").read_text())
PARITY = next(e for e in SEAM if (e["module"], e["function"]) == ("parity.run", "run"))
# Every check Rust names, in its order.
CHECK_NAMES: list[str] = PARITY["request"]["$defs"]["CheckName"]["enum"]
# The report as Rust reads it (its ParityReport's JSON schema).
REPORT = PARITY["reply"]


def given(**what: Any) -> Parity:
    """What the checks are given for a run of 4 steps of the layouts four
    (the reference) and two that none of them computed."""
    p = object.__new__(Parity)
    req = {
        "reference": "four",
        "layouts": [{"name": "four"}, {"name": "two"}],
        "thresholds": {
            "tol_cos": 0.9999,
            "tol_cos_int4": 0.85,
            "min_top1_int4": 0.75,
            "max_weight_rel_mse": 0.03,
            "max_kl": 1e-4,
        },
        "artifacts": None,
    }
    fields = {
        "req": cast(ParityRequest, req),
        "steps": 4,
        "prefill": 0,
        "tol": 0.9999,
        "reference": "four",
        "compared": {"two": {"name": "two", "chunks": [], "kv_slot_map": []}},
        "ref_layout": {"name": "four", "chunks": [{"functions": []}], "kv_slot_map": []},
        "prefilled": {},
        "hf": None,
        "ill": set(),
        "programs": None,
        "readback": None,
        **what,
    }
    for key, value in fields.items():
        setattr(p, key, value)
    return p


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_every_check_rust_names_has_a_unit(name: str) -> None:
    assert issubclass(check_of(name), Check)


def test_the_checks_write_every_key_of_the_report_when_none_ran() -> None:
    """A check that did not run (no oracle, no artifacts) still writes its
    rows (none) and its members of the summary: a key a unit forgets is
    missing here, where Rust would read it as a default."""
    p = given()
    report = empty_report(p)
    checks = [check_of(name)(p) for name in CHECK_NAMES]
    for check in checks:
        check.write(report)
    assert set(report) == set(typing.get_type_hints(ParityReport))
    assert set(report["summary"]) == set(typing.get_type_hints(ParitySummary))
    assert overall(v for check in checks for v in check.verdicts()) == "ok"


def alternatives(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """``schema``'s alternatives, references resolved (null left out)."""
    ref = schema.get("$ref")
    if ref:
        return alternatives(REPORT["$defs"][ref.removeprefix("#/$defs/")])
    if "anyOf" in schema or "oneOf" in schema:
        return [a for sub in schema.get("anyOf", schema.get("oneOf", [])) for a in alternatives(sub)]
    return [] if schema.get("type") == "null" else [schema]


def verdicts_at(value: Any, schema: dict[str, Any], out: list[Verdict]) -> None:
    """Every ``verdict`` in ``value`` where Rust's schema of the report has one."""
    options = alternatives(schema)
    if isinstance(value, list):
        for item in value:
            for o in options:
                verdicts_at(item, o.get("items", {}), out)
        return
    if not isinstance(value, dict):
        return
    if any("verdict" in o.get("properties", {}) for o in options) and "verdict" in value:
        out.append(value["verdict"])
    for key, item in value.items():
        for o in options:
            sub = o.get("properties", {}).get(key) or o.get("additionalProperties") or {}
            verdicts_at(item, sub, out)


def step(layout: str, n: int, ok: bool) -> dict[str, Any]:
    return {"layout": layout, "step": n, "cos": 1.0 if ok else 0.5, "ref_token": 1, "token": 1 if ok else 2,
            "margin": 1.0, "ok": ok, "verdict": "ok"}  # fmt: skip


def program(n: int, cos: float) -> dict[str, Any]:
    return {"target": "two", "precision": "fp32", "step": n, "token": 1, "readback_token": 1, "cos_readback": cos,
            "readback_margin": 1.0, "logit_change": 0.0,
            "ref_token": None, "cos_reference": None, "hf_token": None, "cos_hf": None}  # fmt: skip


# What each check holds after computing one failing row (its records as
# `compute` leaves them).
FAILING: dict[str, dict[str, Any]] = {
    "layouts": {"records": [step("two", 0, True), step("two", 1, False)]},
    "oracle": {
        "records": [
            {
                "step": 0,
                "hf_token": 1,
                "ref_token": 2,
                "cos": 0.5,
                "margin": 1.0,
                "ok": False,
                "floor_cos": 1.0,
                "floor_logit": 0.0,
                "ill_conditioned": False,
                "verdict": "fail",
            },
        ]  # fmt: skip
    },
    "artifacts": {
        "checks": {
            "two": {
                "weights_replaced": {"chunk1": 1},
                "worst_weight": {"weight": None, "rel_mse": 0.0},
                "min_cos": 0.1,
                "mean_cos": 0.1,
                "top1_agreement": 0.0,
                "tokens_match_other_layouts": True,
                "weight_noise": None,
                "ok": False,
                "verdict": "fail",
            },
            "verify_qK": ([step("verify_qK", 0, False)], {"chunk1": 1}),
        }  # fmt: skip
    },
    "programs": {"records": {"two": {"fp32": [program(0, 0.5)], "fp16": [program(0, 0.5)]}}},
    "kl": {"records": [{"step": 0, "kl": 1e-12}, {"step": 1, "kl": 0.5}]},
}


@pytest.mark.parametrize("name", sorted(FAILING))
def test_every_verdict_a_check_writes_decides_the_run(name: str) -> None:
    """The rows a check writes with a verdict (where Rust's report has
    one) are the verdicts it gives the run's: a failing row fails it."""
    p = given()
    report = empty_report(p)
    checks = {n: check_of(n)(p) for n in CHECK_NAMES}
    for key, value in FAILING[name].items():
        setattr(checks[name], key, copy.deepcopy(value))
    for check in checks.values():
        check.write(report)
    written: list[Verdict] = []
    # The run's own verdict is not a check's.
    rows = {**report, "summary": {k: v for k, v in report["summary"].items() if k != "verdict"}}
    verdicts_at(rows, REPORT, written)
    counted = [v for check in checks.values() for v in check.verdicts()]
    assert sorted(written) == sorted(counted)
    assert "fail" in counted
    assert overall(counted) == "fail"


def test_kl_is_the_divergence_of_the_next_token_distributions() -> None:
    p = torch.tensor([2.0, 0.0, -1.0])
    q = torch.tensor([0.0, 1.0, 3.0])
    pp, qq = torch.softmax(p.double(), 0), torch.softmax(q.double(), 0)
    assert kl_divergence(p, q) == pytest.approx(float((pp * (pp / qq).log()).sum()), rel=1e-12)
    assert kl_divergence(p, p + 7.0) == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize(("ill", "verdict"), [(set(), "fail"), ({1}, "inconclusive"), ({0}, "fail")])
def test_a_kl_past_max_kl_fails_unless_only_at_ill_conditioned_steps(ill: set[int], verdict: Verdict) -> None:
    """The reference and transformers compute a step in different orders:
    where transformers moves from itself (ill-conditioned), a KL past
    --max-kl is inconclusive."""
    check = check_of("kl")(given(ill=ill))
    assert isinstance(check, KlCheck)
    check.records = [{"step": 0, "kl": 1e-12}, {"step": 1, "kl": 0.5}]
    report = empty_report(check.p)
    check.write(report)
    summary = report["summary"]["kl"]
    assert summary is not None
    assert (summary["max"], summary["max_step"], summary["ok"]) == (0.5, 1, False)
    assert summary["mean"] == pytest.approx(0.25)
    assert check.verdicts() == [verdict]
