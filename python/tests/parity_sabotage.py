"""Parity broken on purpose (tests only: not part of the `chunkforge_py`
package). A test build of chunkforge (`--corrupt-layer`, `--corrupt-function`,
`--skip-prefill-copy`: src/test_hooks.rs) sends the request's ``sabotage``
and puts this folder on the interpreter's path; parity's driver
(`parity.run.hooks_of`) then applies it through these hooks, to show that
parity finds a broken layer and names it, and that the prefill hand-off's
KV copy is what makes merged decode after prefill agree.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from chunkforge_py.contract import Sabotage as Asked
from chunkforge_py.emulate.stepper import LayoutRunner
from chunkforge_py.parity.check import Hooks
from chunkforge_py.runtime import ChunkforgeError
from chunkforge_py.weights import Stored


def negated(source: Any) -> Any:
    """``-source()``: a corrupted weight, made anew at each use (a stored
    one negates every product instead, exactly the same values)."""
    w = source()
    return w.negated() if isinstance(w, Stored) else -w


def corrupt_modules(modules: dict[str, Any], layer: int) -> str:
    """Negate one weight of ``layer`` in whichever of ``modules`` holds it;
    the chunk that holds it."""
    for name, mod in modules.items():
        if str(layer) in mod.layers:
            proj = mod.layers[str(layer)].mlp.down_proj
            # A new tensor at each use, not an in-place edit: the weight is
            # shared with the reference's modules.
            proj.fetch = partial(negated, proj.fetch)
            return name
    raise ChunkforgeError(f"--corrupt-layer {layer}: no chunk of this layout holds layer {layer}")


class Sabotage(Hooks):
    """The request's ``sabotage`` as parity's hooks: one weight of
    ``corrupt_layer`` negated in the compared layouts, or (with
    ``corrupt_function``) in the verify or prefill modules only; the prefill
    KV copy skipped."""

    def __init__(self, asked: Asked) -> None:
        self.layer = asked["corrupt_layer"]
        self.function = asked["corrupt_function"]
        self.skip_copy = asked["skip_prefill_copy"]

    def layouts(self, runners: dict[str, LayoutRunner]) -> None:
        if self.layer is not None and self.function is None:
            for r in runners.values():
                corrupt_modules(r.modules, self.layer)

    def prefill(self, modules: dict[str, Any]) -> None:
        if self.layer is not None and self.function == "prefill":
            corrupt_modules(modules, self.layer)

    def verify(self, modules: dict[str, Any]) -> None:
        if self.layer is not None and self.function == "verify":
            corrupt_modules(modules, self.layer)

    def copies_prefill(self) -> bool:
        return not self.skip_copy
