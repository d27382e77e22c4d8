"""Canonical variable and op names: a package's bytes depend on its program only.

coremltools names a converted program's variables and ops after the trace:
torch's debug names with a number that keeps them apart (``h_15_cast_fp16``)
and the numbers of the trace's values (``var_1036``), counted over everything
the trace holds. The same function converted alone, converted with the other
functions of its unit (`joint`) or composed (`compose`) comes out with other
names, and a package built by ``--mode both`` would differ from the one
``--mode all`` builds of the same checkpoint only in those names.

`canonicalize` renames every variable and op of every function by where it
sits: the op ``k``-th in program order (nested blocks' ops after their op,
depth first) is ``{type}_{k}`` (``conv_17``), its outputs ``{type}_{k}`` or,
for several, ``{type}_{k}_{j}``, and a nested block's inputs
``{type}_{k}_in{b}_{j}``. Two names stay:

- the function's inputs and outputs: the contract the runtime binds by name;
- the weights' names (`is_weight`: a constant named after its torch
  parameter, ``layers_7_mlp_up_proj_weight_to_fp16``): the audit places an op
  by the weights it reads (`audit.anchor`), and parity and emulation read a
  package's weights back by them (`inspect_pkg.const_key`).

So a function's names follow from its ops alone, and renaming a canonical
program again changes nothing. Every package passes through it: a conversion
when it is saved (`convert.save`), the joint program's parts when they are
split (`joint.split`) and a composition when it is written (`compose.write`;
coremltools' writer saves through `convert.save`). A bundle copies its parts'
functions as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from .audit import anchor


def is_weight(op: Any) -> bool:
    """``op`` is a constant (``const`` or ``constexpr_*``) named after a torch
    parameter or buffer of the chunk module (`audit.anchor` places it)."""
    const = op.type == "const" or op.type.startswith("constexpr_")
    return const and len(op.outputs) == 1 and anchor(op.outputs[0].name) is not None


def ops_in_order(block: Any) -> Iterator[Any]:
    """Every op of ``block`` in program order, each followed by its nested blocks' ops."""
    for op in block.operations:
        yield op
        for inner in op.blocks:
            yield from ops_in_order(inner)


def canonicalize(spec: Any) -> None:
    """Give every function of ``spec`` (a ``Model`` holding an ML program) its
    canonical names, in place (module docstring)."""
    for fn in spec.mlProgram.functions.values():
        for block in fn.block_specializations.values():
            canonicalize_block(fn, block)


def canonicalize_block(fn: Any, block: Any) -> None:
    """Canonical names for one block specialisation of function ``fn``."""
    ops = list(ops_in_order(block))
    kept = {i.name for i in fn.inputs} | set(block.outputs)
    kept.update(op.outputs[0].name for op in ops if is_weight(op))
    taken_vars, taken_ops = set(kept), set(kept)

    def fresh(taken: set[str], name: str) -> str:
        # A kept name could only look like a canonical one by accident; then
        # the canonical one gives way.
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    rename: dict[str, str] = {}
    for k, op in enumerate(ops):
        base = f"{op.type}_{k}"
        many = len(op.outputs) > 1
        for j, o in enumerate(op.outputs):
            if o.name not in kept:
                rename[o.name] = fresh(taken_vars, f"{base}_{j}" if many else base)
        for b, inner in enumerate(op.blocks):
            for j, i in enumerate(inner.inputs):
                if i.name not in kept:
                    rename[i.name] = fresh(taken_vars, f"{base}_in{b}_{j}")
        if "name" in op.attributes:
            names = op.attributes["name"].immediateValue.tensor.strings.values
            if names and names[0] not in kept:
                names[0] = fresh(taken_ops, base)
    for op in block.operations:
        rename_definitions(op, rename)
        rename_names(op, rename)


def rename_names(op: Any, rename: dict[str, str]) -> None:
    """Point ``op``'s (and its nested blocks') variable references at their new names."""
    for arg in op.inputs.values():
        for b in arg.arguments:
            if b.WhichOneof("binding") == "name":
                b.name = rename.get(b.name, b.name)
    for block in op.blocks:
        for inner in block.operations:
            rename_names(inner, rename)
        outs = [rename.get(n, n) for n in block.outputs]
        del block.outputs[:]
        block.outputs.extend(outs)


def defined_names(op: Any) -> Iterable[str]:
    for o in op.outputs:
        yield o.name
    for block in op.blocks:
        for i in block.inputs:
            yield i.name
        for inner in block.operations:
            yield from defined_names(inner)


def rename_definitions(op: Any, rename: dict[str, str]) -> None:
    for o in op.outputs:
        o.name = rename.get(o.name, o.name)
    for block in op.blocks:
        for i in block.inputs:
            i.name = rename.get(i.name, i.name)
        for inner in block.operations:
            rename_definitions(inner, rename)
