"""How parity judges its step records (`parity.layouts.judge_steps`): a decode
layout is the same computation as the reference, so it is judged exactly,
even at an ill-conditioned step; a function (verify_qK, prefill) computes in
another order and is inconclusive there. Which records are a decode layout's
comes from the request (Rust's layout table), never from a type annotation."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, cast

from chunkforge_py.contract import ParityRequest, StepRecord
from chunkforge_py.parity.layouts import decode_layouts, judge_steps

PACKAGE = Path(__file__).resolve().parents[1] / "chunkforge_py"


def request(*layouts: str) -> ParityRequest:
    """The part of a parity request `decode_layouts` reads."""
    return cast(ParityRequest, {"reference": "four", "layouts": [{"name": n} for n in ("four", *layouts)]})


def record(layout: str, step: int, ok: bool) -> StepRecord:
    return cast(
        StepRecord,
        {"layout": layout, "step": step, "cos": 1.0 if ok else 0.5, "ok": ok, "verdict": "ok"},
    )


def verdicts_of(records: list[StepRecord]) -> dict[tuple[str, int], str]:
    return {(r["layout"], r["step"]): r["verdict"] for r in records}


def test_the_decode_layouts_are_the_requests() -> None:
    assert decode_layouts(request("two", "one")) == {"four", "two", "one"}


def test_a_decode_layout_failing_only_at_an_ill_conditioned_step_fails() -> None:
    """Step 3 is ill-conditioned and the reference held there: a merged
    layout that leaves the reference there computed something else."""
    records = [
        record("four", 3, True),
        record("two", 2, True),
        record("two", 3, False),
        record("verify_q3", 3, False),
        record("prefill_b8", 3, False),
    ]
    judge_steps(records, {3}, "four", 0, decode_layouts(request("two")))
    got = verdicts_of(records)
    assert got[("two", 3)] == "fail"
    assert got[("two", 2)] == "ok"
    # The functions compute the step in another order: inconclusive there.
    assert got[("verify_q3", 3)] == "inconclusive"
    assert got[("prefill_b8", 3)] == "inconclusive"


def test_after_a_prefill_hand_off_a_layout_is_excused_only_where_the_reference_failed_too() -> None:
    """After prefill every decode layout starts from the prefill function's
    caches, the reference included: where the four-chunk layout fails at an
    ill-conditioned step too, the deviation is the hand-off's."""
    records = [
        record("four", 9, False),
        record("two", 9, False),
        record("four", 10, True),
        record("two", 10, False),
        record("two", 11, False),
    ]
    judge_steps(records, {9, 10}, "four", 8, decode_layouts(request("two")))
    got = verdicts_of(records)
    assert got[("four", 9)] == "inconclusive"
    assert got[("two", 9)] == "inconclusive"
    assert got[("two", 10)] == "fail"
    assert got[("two", 11)] == "fail"


def annotation_reads(tree: ast.AST) -> list[str]:
    """Run-time reads of type annotations in ``tree``: `typing.get_args`,
    `get_origin`, `get_type_hints` and `__annotations__`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in READERS | {"__annotations__"}:
            found.append(f"line {node.lineno}: {node.attr}")
        elif isinstance(node, ast.Name) and node.id in READERS:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, ast.ImportFrom) and any(a.name in READERS for a in node.names):
            found.append(f"line {node.lineno}: import of {[a.name for a in node.names if a.name in READERS]}")
    return found


READERS = {"get_args", "get_origin", "get_type_hints"}


def test_no_module_reads_type_annotations_at_run_time() -> None:
    """contract.py's annotations are for mypy and the seam test: `LayoutKind`
    became `str`, and a `get_args` of it silently gave an empty set of decode
    layouts, so every layout was judged as a function. Facts come from the
    request."""
    offenders: dict[str, Any] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = annotation_reads(ast.parse(path.read_text(), str(path)))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}


def test_the_lint_sees_a_get_args_call() -> None:
    assert annotation_reads(ast.parse("from typing import get_args\nX = get_args(int)\n"))
    assert annotation_reads(ast.parse("import typing\nX = typing.get_type_hints(int)\n"))
