"""Break a package's program on purpose (tests only: not part of the
`chunkforge_py` package; tests/parity.rs puts this folder on PYTHONPATH):
each helper copies a package to a new folder and edits one function's
protobuf in the copy, never the original, to prove that interpreter parity
sees what weight read-back parity cannot.

Weight read-back (``emulate.Package.weights``, ``parity.artifact_weights``)
finds each weight by its const's NAME and runs it through the torch module the
plan builds, so it never looks at the ops between the weights. Hence:

- ``swap_sub_operands`` (x - y becomes y - x) and ``shift_slice`` (a
  slice_by_index window moved: end bound and begin by the same amount, so the
  declared shape still holds) leave every weight as it was: read-back sees an
  intact package, the interpreter computes the edited program.
- ``swap_weight_uses`` swaps which of two same-shaped weights (say layers 0
  and 1's q_proj) the ops read, names and blob offsets untouched: read-back
  finds each name with its own tensor (an intact package), the program
  computes with the two weights exchanged.
- ``swap_weight_offsets`` swaps the two consts' blob offsets instead: the
  names now lead to each other's tensors, so read-back sees the swap as well
  (both parities catch it).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np
from chunkforge_py.mil.program import MLPackage, tensor_type
from chunkforge_py.runtime import ChunkforgeError


def copy_package(src: str, dst: str) -> MLPackage:
    """``src`` copied to ``dst`` (which must not exist), writable, and opened."""
    if os.path.exists(dst):
        raise ChunkforgeError(f"{dst}: already exists")
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    for root, dirs, files in os.walk(dst):
        os.chmod(root, 0o755)
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    return MLPackage(dst)


def save_spec(pkg: MLPackage) -> None:
    """The edited spec written back over the copy's model file (temp + rename)."""
    tmp = pkg.model_file + ".partial"
    with open(tmp, "wb") as f:
        f.write(pkg.spec.SerializeToString())
    os.replace(tmp, pkg.model_file)


def operations(pkg: MLPackage, function: str | None) -> tuple[str, Any]:
    name = function or pkg.default_function
    return name, pkg.block(name).operations


def swap_sub_operands(src: str, dst: str, function: str | None = None, index: int = 0) -> str:
    """Swap x and y of the ``index``-th ``sub`` op of ``function``; returns its name."""
    pkg = copy_package(src, dst)
    fn, ops = operations(pkg, function)
    subs = [op for op in ops if op.type == "sub"]
    if len(subs) <= index:
        raise ChunkforgeError(f"{src}: function {fn} has {len(subs)} sub ops")
    op = subs[index]
    x, y = op.inputs["x"], op.inputs["y"]
    x_copy = type(x)()
    x_copy.CopyFrom(x)
    x.CopyFrom(y)
    y.CopyFrom(x_copy)
    save_spec(pkg)
    return str(op.outputs[0].name)


def const_values(ops: Any) -> dict[str, Any]:
    """The immediate value of every const op, by name."""
    out = {}
    for op in ops:
        if op.type == "const" and "val" in op.attributes:
            v = op.attributes["val"]
            if v.WhichOneof("value") == "immediateValue":
                out[op.outputs[0].name] = v
    return out


def int_binding(values: list[int]) -> Any:
    """An op input bound to an inline int32 vector."""
    from coremltools.proto import MIL_pb2

    arg = MIL_pb2.Argument()
    b = arg.arguments.add()
    t = b.value.type.tensorType
    t.dataType = MIL_pb2.DataType.Value("INT32")
    t.rank = 1
    t.dimensions.add().constant.size = len(values)
    b.value.immediateValue.tensor.ints.values.extend(values)
    return arg


def shift_slice(src: str, dst: str, function: str | None = None, delta: int = 1) -> str:
    """Move the window of the first slice_by_index of ``function`` that has a
    dim sliced by both bounds with room to move: its end bound (and its begin,
    so the sliced shape and the program's declared types still hold) shifted
    by ``delta`` along that dim. Only that op's bounds change (inline values;
    a const it shares with other ops is left alone). Returns the op's name."""
    pkg = copy_package(src, dst)
    fn, ops = operations(pkg, function)
    types = {}
    for inp in pkg.function(fn).inputs:
        types[inp.name] = tensor_type(inp.type, inp.name)
    for op in ops:
        for o in op.outputs:
            if o.type.WhichOneof("type") == "tensorType":
                types[o.name] = tensor_type(o.type, o.name)
    consts = const_values(ops)

    def const_of(op: Any, arg: str) -> list[Any] | None:
        """An input's constant value as a list (None: absent or computed at run time)."""
        if arg not in op.inputs:
            return None
        b = op.inputs[arg].arguments[0]
        v = consts.get(b.name) if b.WhichOneof("binding") == "name" else b.value
        return None if v is None else list(np.asarray(pkg.value(v, arg)).reshape(-1).tolist())

    def ints_of(op: Any, arg: str) -> list[int] | None:
        v = const_of(op, arg)
        return None if v is None else [int(x) for x in v]

    def bools_of(op: Any, arg: str, rank: int) -> list[bool] | None:
        if arg not in op.inputs:
            return [False] * rank
        v = const_of(op, arg)
        return None if v is None else [bool(x) for x in v]

    for op in ops:
        if op.type != "slice_by_index":
            continue
        begin, end = ints_of(op, "begin"), ints_of(op, "end")
        x = op.inputs["x"].arguments[0]
        if begin is None or end is None or x.WhichOneof("binding") != "name" or x.name not in types:
            continue
        shape = types[x.name].shape
        rank = len(shape)
        masks = [bools_of(op, m, rank) for m in ("begin_mask", "end_mask", "squeeze_mask")]
        if any(m is None for m in masks):
            continue
        masked = [any(m[d] for m in masks if m is not None) for d in range(rank)]
        stride = ints_of(op, "stride") or [1] * rank
        for d in range(rank):
            size = shape[d]
            if masked[d] or stride[d] != 1 or size is None or begin[d] < 0 or end[d] < 0:
                continue
            if 0 <= begin[d] + delta and end[d] + delta <= size and begin[d] < end[d]:
                begin[d] += delta
                end[d] += delta
                op.inputs["begin"].CopyFrom(int_binding(begin))
                op.inputs["end"].CopyFrom(int_binding(end))
                save_spec(pkg)
                return str(op.outputs[0].name)
    raise ChunkforgeError(f"{src}: function {fn} has no slice_by_index whose window can move by {delta}")


def weight_ops(ops: Any, names: tuple[str, str]) -> list[Any]:
    by_name = {op.outputs[0].name: op for op in ops if op.outputs}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ChunkforgeError(f"no weight {', '.join(missing)} in the function")
    found = [by_name[n] for n in names]
    for op in found:
        if op.type not in ("const", "constexpr_lut_to_dense"):
            raise ChunkforgeError(f"{op.outputs[0].name} is a {op.type}, not a weight")
    a, b = (tensor_type(op.outputs[0].type, op.outputs[0].name) for op in found)
    if a != b:
        raise ChunkforgeError(f"{names[0]} is {a}, {names[1]} is {b}: only same-shaped weights can be swapped")
    return found


def hoist(ops: Any, names: tuple[str, str]) -> None:
    """Move the ops defining ``names`` to the front of the block (in their
    order), so each is defined before any op that will read it once the uses
    are swapped: a program lists every value before its first use, and a later
    layer's weight may be defined after an earlier layer's ops."""
    front = [op for op in ops if op.outputs and op.outputs[0].name in names]
    rest = [op for op in ops if not (op.outputs and op.outputs[0].name in names)]
    ordered = [type(op)() for op in front + rest]
    for new, old in zip(ordered, front + rest, strict=True):
        new.CopyFrom(old)
    del ops[:]
    ops.extend(ordered)


def swap_weight_uses(src: str, dst: str, a: str, b: str, function: str | None = None) -> int:
    """Every op of ``function`` that reads weight ``a`` reads ``b`` instead and
    the other way round (names and blobs untouched). Returns the number of
    bindings changed."""
    pkg = copy_package(src, dst)
    _, ops = operations(pkg, function)
    weight_ops(ops, (a, b))
    hoist(ops, (a, b))
    changed = 0
    for op in ops:
        for arg in op.inputs.values():
            for binding in arg.arguments:
                if binding.WhichOneof("binding") == "name" and binding.name in (a, b):
                    binding.name = b if binding.name == a else a
                    changed += 1
    if not changed:
        raise ChunkforgeError(f"{src}: no op reads {a} or {b}")
    save_spec(pkg)
    return changed


def blob_values(op: Any) -> list[Any]:
    """The blob-backed values of a weight op (const: val; LUT: indices and lut), in a fixed order."""
    if op.type == "const":
        return [op.attributes["val"]]
    return [op.inputs[k].arguments[0].value for k in sorted(op.inputs)]


def swap_weight_offsets(src: str, dst: str, a: str, b: str, function: str | None = None) -> None:
    """The blob offsets of weights ``a`` and ``b`` exchanged (names and uses untouched)."""
    pkg = copy_package(src, dst)
    _, ops = operations(pkg, function)
    wa, wb = weight_ops(ops, (a, b))
    for va, vb in zip(blob_values(wa), blob_values(wb), strict=True):
        if va.WhichOneof("value") != "blobFileValue" or vb.WhichOneof("value") != "blobFileValue":
            raise ChunkforgeError(f"{src}: {a} / {b} are not stored in the weight blob")
        va.blobFileValue.offset, vb.blobFileValue.offset = vb.blobFileValue.offset, va.blobFileValue.offset
    save_spec(pkg)
