"""A package function run by the MIL interpreter, in the shape of a torch
chunk module, so the runtime emulation (``stepper.LayoutRunner``,
``PrefillRunner``) drives what a package computes exactly as it drives the
modules a build came from::

    modules = {c["name"]: ProgramChunk(Interpreter(path), function_plan, fp16) for c in layout["chunks"]}
    runner = LayoutRunner(dims, layout, None, modules=modules)

Like ``model.Chunk`` it takes the function's inputs in plan order and returns
its outputs in plan order. ``last_logits`` is the value the program's
``reduce_argmax`` reads (the softcapped logits of a head chunk); there is no
per-layer trace (``trace_layers`` is None).
"""

from __future__ import annotations

import torch

from ..contract import FunctionPlan
from ..runtime import ChunkforgeError
from .fp16range import Fp16Range
from .interp import Interpreter


class ProgramChunk:
    def __init__(self, interp: Interpreter, function: FunctionPlan, fp16: bool = False, watch: Fp16Range | None = None):
        self.function = function
        self.fp16 = fp16
        # Sees every fp16-typed op output of each call (`fp16range`).
        self.watch = watch
        self.program = interp.function(function["name"])
        self.trace_layers: list[torch.Tensor] | None = None
        self.last_logits: torch.Tensor | None = None
        want = [(t["name"], tuple(t["shape"]), t["dtype"]) for t in function["inputs"]]
        got = [(s.name, s.shape, s.dtype) for s in self.program.inputs]
        if want != got:
            raise ChunkforgeError(f"{self.program.where}: inputs {got} differ from the plan's {want}")
        self.output_names = [t["name"] for t in function["outputs"]]
        missing = [n for n in self.output_names if n not in self.program.output_names]
        if missing:
            raise ChunkforgeError(f"{self.program.where}: the plan's outputs {missing} are not in the program")
        argmax = [s for s in self.program.steps if s.op_type == "reduce_argmax"]
        self.logits_name: str | None = None
        if len(argmax) == 1:
            x = dict(argmax[0].dynamic).get("x")
            names = {slot: name for name, slot in self.program.slots.items()}
            self.logits_name = names.get(x) if x is not None else None

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = {t["name"]: a for t, a in zip(self.function["inputs"], args, strict=True)}
        taps = (self.logits_name,) if self.logits_name else ()
        out = self.program.run_torch(inputs, self.fp16, taps, self.watch)
        if self.logits_name:
            logits = out[self.logits_name]
            # One row per token for verify; decode and prefill (its last real token) give one.
            rows = self.function["tokens"] if self.function["kind"] == "verify" else 1
            self.last_logits = logits.reshape(-1) if rows == 1 else logits.reshape(rows, -1)
        return tuple(out[n] for n in self.output_names)
