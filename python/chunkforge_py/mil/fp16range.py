"""The fp16 range of a program, before a device finds it: the largest |value|
of every fp16-typed op output as the interpreter executes the program in
fp16 (`interp.Function.run_torch` with ``fp16=True``: each op computes in
float32 from fp16 inputs, then its fp16 outputs are rounded), and every inf
or NaN an op makes.

The Neural Engine computes in fp16; an activation past 65504 becomes inf,
and everything downstream of it garbage, while the fp32 program (and
transformers) computes a finite value. So, per op output (keyed by package,
function and op name, over every run the recorder sees):

- ``max_abs``: the largest finite |value| the op computed before rounding,
  and its margin to fp16's largest finite value in powers of two
  (``log2(65504 / max_abs)``: 1 means the values may double before
  overflowing);
- ``made_nonfinite``: elements that are inf or NaN where none of the op's
  inputs was (an overflow in the rounding, or inf - inf of a finite input
  that fp16 made so). Masks carry -inf on purpose (blocked positions), so an
  op whose inputs hold infinities is not charged with passing them on.

`Fp16Range.introduced` is each op that makes inf or NaN in fp16 runs and
not in the fp32 runs the recorder saw (all of them, when it saw none): the
failure the report names. The layer of an op is the audit's (`audit.layers_of`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..contract import Fp16Op, Fp16RangeReport

FP16_MAX = 65504.0
# Values from here on round to inf in fp16 (round to nearest even: 65504 + half an ulp).
FP16_OVERFLOW = 65520.0
# Ops listed closest first in a report's ``closest``.
CLOSEST = 10


@dataclass
class OpRange:
    package: str
    function: str
    op: str
    op_type: str
    max_abs: float = 0.0
    # Elements made inf/NaN from finite inputs, by precision.
    made16: int = 0
    made32: int = 0
    # Elements finite before rounding and inf after.
    overflow: int = 0


class Fp16Range:
    """What every program run it is handed to (``watch``) computes, op by op."""

    def __init__(self) -> None:
        self.ops: dict[tuple[str, str, str], OpRange] = {}
        self.runs = {"fp16": 0, "fp32": 0}
        self._specs: dict[str, Any] = {}

    def started(self, fp16: bool) -> None:
        """A function run starts (counted by precision)."""
        self.runs["fp16" if fp16 else "fp32"] += 1

    def see(
        self,
        function: Any,
        op: str,
        op_type: str,
        inputs: Sequence[Any],
        computed: torch.Tensor,
        settled: torch.Tensor,
        fp16: bool,
    ) -> None:
        """One fp16-typed output ``op`` of ``function`` (`interp.Function`):
        ``computed`` as the op gave it (before rounding), ``settled`` as the
        program keeps it."""
        package = function.interp.package
        key = (package.path, function.name, op)
        r = self.ops.get(key)
        if r is None:
            r = self.ops[key] = OpRange(package.path, function.name, op, op_type)
            self._specs.setdefault(package.path, package.spec)
        if computed.dtype.is_floating_point:
            computed = computed.float()
        finite = torch.isfinite(computed)
        every = bool(finite.all())
        if fp16:
            a = computed.abs() if every else computed.abs().masked_fill(~finite, 0.0)
            if a.numel():
                r.max_abs = max(r.max_abs, float(a.max()))
        if every and (not fp16 or bool(torch.isfinite(settled).all())):
            return
        made = int((~torch.isfinite(settled)).sum())
        if fp16:
            r.overflow += int((finite & ~torch.isfinite(settled)).sum())
        if made and all(_finite(x) for x in inputs):
            if fp16:
                r.made16 += made
            else:
                r.made32 += made

    def layers(self) -> dict[tuple[str, str, str], str]:
        """Each recorded op's layer, by the audit's attribution."""
        from .audit import functions_of, layers_of

        out: dict[tuple[str, str, str], str] = {}
        for path, spec in self._specs.items():
            for f in functions_of(spec, path):
                for op, layer in zip(f.ops, layers_of(f), strict=True):
                    if op.outputs:
                        for t in op.outputs:
                            out[(path, f.name, t.name)] = layer
        return out

    def introduced(self) -> list[OpRange]:
        """Ops making inf or NaN in fp16 that the fp32 runs do not make, in record order."""
        return [r for r in self.ops.values() if r.made16 > 0 and r.made32 == 0]

    def report(self, every: bool = True) -> Fp16RangeReport:
        """The figures; ``every`` lists every output (else the nearest and the failures)."""
        layers = self.layers()

        def row(r: OpRange) -> Fp16Op:
            return {
                "package": os.path.basename(r.package.rstrip("/")).removesuffix(".mlpackage"),
                "function": r.function,
                "op": r.op,
                "op_type": r.op_type,
                "layer": layers.get((r.package, r.function, r.op), "?"),
                "max_abs": r.max_abs,
                "margin_log2": math.log2(FP16_MAX / r.max_abs) if r.max_abs > 0 else None,
                "overflow": r.overflow,
                "made_nonfinite_fp16": r.made16,
                "made_nonfinite_fp32": r.made32 if self.runs["fp32"] else None,
            }

        rows = sorted((row(r) for r in self.ops.values()), key=lambda o: -o["max_abs"])
        bad = [row(r) for r in self.introduced()]
        out: Fp16RangeReport = {
            "fp16_max": FP16_MAX,
            "fp16_runs": self.runs["fp16"],
            "fp32_runs": self.runs["fp32"],
            "outputs": len(rows),
            "closest": rows[:CLOSEST],
            "introduced": bad,
            "ok": not bad,
        }
        if every:
            out["every"] = rows
        return out


def _finite(x: Any) -> bool:
    """Whether an op input holds no inf or NaN (non-tensors count as finite)."""
    if isinstance(x, torch.Tensor):
        return not x.dtype.is_floating_point or bool(torch.isfinite(x).all())
    if isinstance(x, list | tuple):
        return all(_finite(v) for v in x)
    return True
