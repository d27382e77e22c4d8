"""Execute the ML programs of a package on the CPU: what the package itself
computes, with its own weights (coremltools cannot predict on Linux).

Python API::

    from chunkforge_py.mil.interp import Interpreter

    interp = Interpreter("out/chunk1.mlpackage")   # parses the spec once
    interp.functions                               # ["verify_qK", "decode_q1"]
    decode = interp.function("decode_q1")          # prepared once, run many times
    outputs = decode.run({"hidden_states": h, ...}, fp16=False)   # name -> np.ndarray

``Function.run`` takes every input of the function by name (numpy arrays of the
declared shape: float16 or float32 for an fp16 input, float32 or float16 for an
fp32 one, int32 for int32) and returns every output by name. An input that is
missing, extra, mis-shaped or mis-typed is a ``ChunkforgeError`` naming it and
what the function expects. ``Function.run_torch`` is the same on torch tensors
(outputs as float32 / int32 / bool tensors), for callers that already hold them.

Precision:

- ``fp16=False``: every tensor the program types fp16 is computed and kept in
  float32 (fp16 constants and inputs are upcast, exactly); outputs are float32.
- ``fp16=True``: each op still computes in float32, then every fp16-typed
  output of the op is rounded to fp16, and fp16 inputs are rounded on the way
  in: the closest the CPU gets to the device's arithmetic. fp16 outputs come
  back as float16.
- int32 stays int32 and bool stays bool in both.

Ops are defined in ``mil_ops.py`` after coremltools' op definitions; an op the
interpreter does not implement is an error naming its type, its name and the
function. Constants and the compile-time ops (``constexpr_lut_to_dense``:
palettized weights) are evaluated once per package and shared by all its
functions; a function is resolved once into a list of steps over numbered
slots, each slot freed after its last use. Weights (constants of at least
``LAZY_ELEMENTS`` values read from the weight file, and compile-time ops
giving or reading one) are `weights.Lazy`: made when a step reads them and
kept between runs only as far as `weights.RESIDENT`'s budget allows, so a
real-size package (gigabytes of dequantized weights) runs in the memory of
the weights that budget holds plus one at a time.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from ..contract import ExecRequest, ExecResult
from ..runtime import ChunkforgeError
from ..weights import Lazy, Stored, kernels, value_of
from . import ops
from .fp16range import Fp16Range
from .ops import CONSTEXPR, OPS, Impl, OpError
from .program import FLOATS, MLPackage, TensorType, tensor_type

# Constants read from a weight file with at least this many values are
# weights, made when a step reads them (`weights.Lazy`).
LAZY_ELEMENTS = 1 << 16

# Our names of the fp16 and other float types the program may declare.
FLOAT_TYPES = frozenset(FLOATS)
BOOL = "bool"


def is_int_type(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


def to_torch(value: np.ndarray) -> torch.Tensor:
    """A constant as the interpreter holds it: floats as float32, bools as
    bool, int8 / uint8 (and unpacked sub-byte) as they are, wider ints as int32."""
    kind = value.dtype.kind
    if kind == "f":
        return torch.from_numpy(np.array(value, dtype=np.float32))
    if kind == "b":
        return torch.from_numpy(np.array(value, dtype=np.bool_))
    if value.dtype in (np.int8, np.uint8):
        return torch.from_numpy(np.array(value))
    return torch.from_numpy(np.array(value, dtype=np.int32))


def settle(t: torch.Tensor, dtype: str, fp16: bool) -> torch.Tensor:
    """An op's output as the program types it: float32 (rounded to fp16 in
    fp16 mode when typed fp16), int32 (narrow ints as they are), bool."""
    if dtype in FLOAT_TYPES:
        if t.dtype != torch.float32:
            t = t.float()
        if fp16 and dtype == "fp16":
            t = t.half().float()
        return t
    if dtype == BOOL:
        return t if t.dtype == torch.bool else t != 0
    if t.dtype.is_floating_point or t.dtype in (torch.bool, torch.int64):
        return t.to(torch.int32)
    return t


@dataclass(frozen=True)
class IoSpec:
    """An input or output of a function."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.name} {list(self.shape)} {self.dtype}"


@dataclass
class Step:
    """One op, resolved: its implementation, constant inputs, the slots it
    reads, the slots it writes with their declared types, the slots it frees."""

    op_type: str
    name: str
    impl: Impl
    static: dict[str, Any]
    dynamic: list[tuple[str, int]]
    lists: list[tuple[str, list[tuple[int, Any]]]]
    outputs: list[tuple[int, TensorType]]
    free: list[int] = field(default_factory=list)
    # What `Function.run_torch` reads, prepared once: the constant inputs
    # as the op takes them, those made on use (`Lazy`), and each output's
    # declared shape (None when not fully known) and type.
    fixed: dict[str, Any] = field(default_factory=dict)
    made: list[tuple[str, Lazy]] = field(default_factory=list)
    checks: list[tuple[int, tuple[int, ...] | None, str]] = field(default_factory=list)


# What one binding of an op input resolves to: a slot (>= 0) or a constant.
Binding = tuple[int, Any]


class Function:
    """One function of a package, resolved into steps: call ``run`` many times."""

    def __init__(self, interp: Interpreter, name: str):
        self.interp = interp
        self.name = name
        pkg = interp.package
        proto = pkg.function(name)
        block = pkg.block(name)
        self.where = f"{pkg.path}: function {name}"
        self.slots: dict[str, int] = {}
        self.consts: dict[str, Any] = {}
        self.const_keys: dict[str, bytes] = {}
        self.inputs: list[IoSpec] = []
        for inp in proto.inputs:
            t = tensor_type(inp.type, f"{self.where}: input {inp.name}")
            if any(d is None for d in t.shape):
                raise ChunkforgeError(f"{self.where}: input {inp.name} has a flexible shape {t.shape} (not supported)")
            self.inputs.append(IoSpec(inp.name, t.dtype, tuple(int(d) for d in t.shape if d is not None)))
            self._slot(inp.name)
        self.steps: list[Step] = []
        self._taps: dict[tuple[str, ...], dict[int, list[tuple[str, int]]]] = {}
        self.op_types: dict[str, int] = {}
        for op in block.operations:
            self.op_types[op.type] = self.op_types.get(op.type, 0) + 1
            self._resolve(op)
        self.output_names = list(block.outputs)
        self.outputs: list[IoSpec] = []
        types = {o.name: o for o in proto.inputs}
        for op in block.operations:
            for o in op.outputs:
                types[o.name] = o
        for n in self.output_names:
            if n not in types:
                raise ChunkforgeError(f"{self.where}: output {n} is not produced by any op")
            t = tensor_type(types[n].type, f"{self.where}: output {n}")
            self.outputs.append(IoSpec(n, t.dtype, tuple(int(d) if d is not None else -1 for d in t.shape)))
        self._plan_frees()

    # ---- resolving ---------------------------------------------------------

    def _slot(self, name: str) -> int:
        if name in self.slots or name in self.consts:
            raise ChunkforgeError(f"{self.where}: {name} is defined twice")
        self.slots[name] = len(self.slots)
        return self.slots[name]

    def _binding(self, b: Any, what: str) -> tuple[Binding, bytes]:
        """A binding as (slot, None) or (-1, constant), and its constant's cache key."""
        kind = b.WhichOneof("binding")
        if kind == "name":
            if b.name in self.consts:
                return (-1, self.consts[b.name]), self.const_keys[b.name]
            if b.name in self.slots:
                return (self.slots[b.name], None), b""
            raise ChunkforgeError(f"{self.where}: {what} reads {b.name}, which is not defined before it")
        if kind == "value":
            key = b"v" + b.value.SerializeToString()
            return (-1, self.interp.constant(key, b.value, what)), key
        raise ChunkforgeError(f"{self.where}: {what}: an empty binding")

    def _resolve(self, op: Any) -> None:
        name = op.outputs[0].name if op.outputs else op.type
        what = f"op {op.type} {name}"
        if op.blocks:
            raise ChunkforgeError(f"{self.where}: {what} has nested blocks (control flow is not supported)")
        if op.type == "const":
            if "val" not in op.attributes or len(op.outputs) != 1:
                raise ChunkforgeError(f"{self.where}: {what} has no value")
            key = b"c" + op.attributes["val"].SerializeToString()
            self.consts[name] = self.interp.constant(key, op.attributes["val"], f"{self.where}: {what}")
            self.const_keys[name] = key
            return
        impl = OPS.get(op.type)
        if impl is None:
            raise ChunkforgeError(
                f"{self.where}: {what}: the interpreter does not implement MIL op {op.type} "
                "(python/chunkforge_py/mil/ops.py)"
            )
        static: dict[str, Any] = {}
        dynamic: list[tuple[str, int]] = []
        lists: list[tuple[str, list[Binding]]] = []
        key_parts = [op.type.encode()]
        weight_key = b""
        for arg in sorted(op.inputs):
            bindings = [self._binding(b, f"{what} input {arg}") for b in op.inputs[arg].arguments]
            key_parts += [arg.encode()] + [k for _, k in bindings]
            if arg == "weight" and len(bindings) == 1:
                weight_key = bindings[0][1]
            resolved = [r for r, _ in bindings]
            # Variadic inputs (concat's values) are lists even with one element.
            if arg == "values" and op.type in ("concat", "stack"):
                lists.append((arg, resolved))
            elif len(resolved) != 1:
                lists.append((arg, resolved))
            elif resolved[0][0] >= 0:
                dynamic.append((arg, resolved[0][0]))
            else:
                static[arg] = resolved[0][1]
        outputs = [(o.name, tensor_type(o.type, f"{self.where}: {what} output {o.name}")) for o in op.outputs]
        if op.type in STORED_OPS and "weight" in static and kernels():
            # A projection reads its fp16 (or fp32) constant as stored.
            static["weight"] = self.interp.stored_const(weight_key, static["weight"])
        if op.type in CONSTEXPR:
            if dynamic or any(s >= 0 for _, items in lists for s, _ in items):
                raise ChunkforgeError(f"{self.where}: {what}: a compile-time op reads a runtime value")
            key = b"\0".join(key_parts)
            shape = outputs[0][1].shape if len(outputs) == 1 else ()
            if any(isinstance(v, Lazy) for v in static.values()) or (
                all(d is not None for d in shape) and count(shape) >= LAZY_ELEMENTS
            ):
                dense = tuple(int(d) for d in shape if d is not None)
                make = self._nibbles(op.type, static, dense, outputs, what) or (
                    lambda: self._run_static(impl, {k: value_of(v) for k, v in static.items()}, outputs, what)
                )
                value = self.interp.lazy(key, make, dense)
            else:
                value = self.interp.constexpr(key, lambda: self._run_static(impl, static, outputs, what))
            self.consts[name] = value
            self.const_keys[name] = key
            return
        step = Step(op.type, name, impl, static, dynamic, lists, [(self._slot(n), t) for n, t in outputs])
        step.fixed = {
            k: ops.parameter(op.type, k, served(op.type, k, v)) for k, v in static.items() if not isinstance(v, Lazy)
        }
        step.made = [(k, v) for k, v in static.items() if isinstance(v, Lazy)]
        step.checks = [(slot, known(t.shape), t.dtype) for slot, t in step.outputs]
        self.steps.append(step)

    def _nibbles(
        self,
        op_type: str,
        static: dict[str, Any],
        shape: tuple[int, ...],
        outputs: list[tuple[str, TensorType]],
        what: str,
    ) -> Callable[[], Any] | None:
        """How to make a palettized weight straight from its 4-bit indices as
        the weight file stores them: as they are, for the native kernels
        (`weights.Stored`), or dense (`ops.lut_nibbles_to_dense`); None
        where that does not apply (the op's own implementation runs)."""
        indices, lut = static.get("indices"), static.get("lut")
        if op_type != "constexpr_lut_to_dense" or set(static) - {"indices", "lut", "vector_axis"}:
            return None
        if not kernels() and dequant_mode() == "unpack":
            return None
        if not isinstance(indices, Lazy) or tuple(indices.shape) != shape or not isinstance(lut, Lazy | torch.Tensor):
            return None
        read = self.interp.packed_reader(indices)
        if read is None or ops.lut_of_rows(list(shape), torch.empty(tuple(lut.shape), device="meta")) is None:
            return None
        if kernels() and len(shape) >= 2:
            return partial(self._stored_lut4, read, lut, shape, what)

        def nibbles(a: dict[str, Any]) -> torch.Tensor:
            palettes = value_of(a["lut"])
            raw = read()
            made = ops.lut_nibbles_to_dense(raw, list(shape), palettes) if raw is not None else None
            return made if made is not None else ops.lut_to_dense(value_of(indices), palettes, None)

        return lambda: self._run_static(nibbles, {"lut": lut}, outputs, what)

    def _stored_lut4(
        self, read: Callable[[], np.ndarray | None], lut: Any, shape: tuple[int, ...], what: str
    ) -> Stored:
        """A 4-bit palettized weight as its weight file stores it, with its
        LUT widened to float32 (exactly): `weights.Stored`."""
        rows_lut = ops.lut_of_rows(list(shape), value_of(lut))
        raw = read()
        if rows_lut is None or raw is None:
            raise ChunkforgeError(f"{self.where}: {what}: not a 4-bit per-row-group palettized weight")
        groups = int(rows_lut.shape[0])
        count = math.prod(shape)
        return Stored(
            "lut4",
            np.ascontiguousarray(raw[: (count + 1) // 2]),
            shape,
            f"{self.where}: {what}",
            lut=np.ascontiguousarray(rows_lut.float().numpy()),
            group_rows=shape[0] // groups,
        )

    def _run_static(
        self, impl: Impl, static: dict[str, Any], outputs: list[tuple[str, TensorType]], what: str
    ) -> torch.Tensor:
        try:
            out = impl(dict(static))
        except (OpError, RuntimeError, ValueError, IndexError, TypeError) as e:
            raise ChunkforgeError(f"{self.where}: {what}: {e}") from e
        if not isinstance(out, torch.Tensor) or len(outputs) != 1:
            raise ChunkforgeError(f"{self.where}: {what}: a compile-time op must give one tensor")
        # Weights stay float32 in both modes: they are fp16 values already.
        return settle(out, outputs[0][1].dtype, False)

    def _plan_frees(self) -> None:
        """Free every slot after its last reader (outputs are kept)."""
        last: dict[int, int] = {}
        for i, step in enumerate(self.steps):
            for _, s in step.dynamic:
                last[s] = i
            for _, items in step.lists:
                for s, _ in items:
                    if s >= 0:
                        last[s] = i
        keep = {self.slots[n] for n in self.output_names if n in self.slots}
        for s, i in last.items():
            if s not in keep:
                self.steps[i].free.append(s)

    # ---- running -----------------------------------------------------------

    def check_inputs(self, inputs: Mapping[str, Any]) -> None:
        """Every input present with its declared shape and a dtype it accepts; no extra ones."""
        problems = []
        missing = [spec.describe() for spec in self.inputs if spec.name not in inputs]
        if missing:
            problems.append("missing " + ", ".join(missing))
        for spec in self.inputs:
            if spec.name not in inputs:
                continue
            v = inputs[spec.name]
            shape = tuple(int(d) for d in v.shape)
            dtype = str(v.dtype).removeprefix("torch.")
            if shape != spec.shape:
                problems.append(f"input {spec.name} has shape {list(shape)}, expected {list(spec.shape)}")
            if not accepts(spec.dtype, dtype):
                problems.append(f"input {spec.name} is {dtype}, expected {expected_dtypes(spec.dtype)}")
        known = {s.name for s in self.inputs}
        extra = sorted(set(inputs) - known)
        if extra:
            problems.append(f"unexpected {', '.join(extra)} (not inputs of {self.name})")
        if problems:
            raise ChunkforgeError(f"{self.where}: " + "; ".join(problems))

    def run_torch(
        self,
        inputs: Mapping[str, torch.Tensor],
        fp16: bool = False,
        taps: tuple[str, ...] = (),
        watch: Fp16Range | None = None,
    ) -> dict[str, torch.Tensor]:
        """The function on torch tensors; outputs by name (and each of ``taps``,
        an intermediate value by its program name). ``watch`` sees every
        fp16-typed op output (`fp16range`)."""
        self.check_inputs(inputs)
        names = {slot: name for name, slot in self.slots.items()} if watch is not None else {}
        if watch is not None:
            watch.started(fp16)
        env: list[Any] = [None] * len(self.slots)
        for spec in self.inputs:
            env[self.slots[spec.name]] = settle(inputs[spec.name], spec.dtype, fp16)
        missing = [n for n in taps if n not in self.slots and n not in self.consts]
        if missing:
            raise ChunkforgeError(f"{self.where}: no value named {', '.join(missing)}")
        tap_at = self._tap_steps(taps)
        tapped: dict[str, torch.Tensor] = {}
        where = self.where
        with torch.no_grad():
            for i, step in enumerate(self.steps):
                args = dict(step.fixed)
                for k, lazy in step.made:
                    args[k] = served(step.op_type, k, lazy.get())
                for k, s in step.dynamic:
                    args[k] = env[s]
                for k, items in step.lists:
                    args[k] = [env[s] if s >= 0 else value_of(v) for s, v in items]
                try:
                    res = step.impl(args)
                except (OpError, RuntimeError, ValueError, IndexError, TypeError) as e:
                    raise ChunkforgeError(f"{where}: op {step.op_type} {step.name} failed: {e}") from e
                outs = (res,) if isinstance(res, torch.Tensor) else res
                if len(outs) != len(step.checks):
                    raise ChunkforgeError(
                        f"{where}: op {step.op_type} {step.name} gave {len(outs)} outputs, "
                        f"the program declares {len(step.checks)}"
                    )
                for (slot, shape, dtype), value in zip(step.checks, outs, strict=True):
                    if shape is not None and value.shape != shape:
                        raise ChunkforgeError(
                            f"{where}: op {step.op_type} {step.name} gave shape {list(value.shape)}, "
                            f"the program declares {list(shape)}"
                        )
                    env[slot] = settle(value, dtype, fp16)
                    if watch is not None and dtype == "fp16":
                        watch.see(self, names[slot], step.op_type, [*args.values()], value, env[slot], fp16)
                if i in tap_at:
                    for n, s in tap_at[i]:
                        tapped[n] = env[s]
                for s in step.free:
                    env[s] = None
        out = {}
        for n in self.output_names:
            out[n] = env[self.slots[n]] if n in self.slots else value_of(self.consts[n])
        for n in taps:
            out[n] = tapped[n] if n in tapped else value_of(self.consts.get(n))
        return out

    def _tap_steps(self, taps: tuple[str, ...]) -> dict[int, list[tuple[str, int]]]:
        """Each tap by the step that writes it: taken when that step has run."""
        if taps not in self._taps:
            writer = {s: i for i, st in enumerate(self.steps) for s, _ in st.outputs}
            at: dict[int, list[tuple[str, int]]] = {}
            for n in taps:
                if n in self.slots and self.slots[n] in writer:
                    at.setdefault(writer[self.slots[n]], []).append((n, self.slots[n]))
            self._taps[taps] = at
        return self._taps[taps]

    def run(self, inputs: Mapping[str, np.ndarray], fp16: bool = False) -> dict[str, np.ndarray]:
        """The function on numpy arrays; outputs by name (fp16 outputs as float16
        in fp16 mode, float32 otherwise)."""
        self.check_inputs(inputs)
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
        out = self.run_torch(tensors, fp16)
        result = {}
        for spec in self.outputs:
            value = out[spec.name].numpy()
            if spec.dtype == "fp16" and fp16:
                value = value.astype(np.float16)
            elif is_int_type(spec.dtype):
                value = value.astype(np.int32)
            result[spec.name] = value
        return result


# Ops that multiply a `weights.Stored` weight (their ``weight`` input) with
# the native kernels; any other op reading one gets it dense.
STORED_OPS = frozenset({"conv", "linear"})


def served(op_type: str, arg: str, value: Any) -> Any:
    """An op's constant input as the op takes it: a `weights.Stored` weight
    stays stored for a projection's weight, else is made dense."""
    if isinstance(value, Stored) and not (op_type in STORED_OPS and arg == "weight"):
        return value.dense()
    return value


# How 4-bit palettized weights are made: "nibbles" (the default: from the
# stored bytes, `ops.lut_nibbles_to_dense`) or "unpack" (indices unpacked,
# then gathered: the baseline of `bench parity --compare dequant`).
DEQUANT_ENV = "CHUNKFORGE_DEQUANT"


def dequant_mode() -> str:
    mode = os.environ.get(DEQUANT_ENV) or "nibbles"
    if mode not in ("nibbles", "unpack"):
        raise ChunkforgeError(f"{DEQUANT_ENV}={mode}: expected nibbles or unpack")
    return mode


def known(shape: tuple[int | None, ...]) -> tuple[int, ...] | None:
    """A shape whose every dimension is known, else None."""
    dims = [d for d in shape if d is not None]
    return tuple(dims) if len(dims) == len(shape) else None


def count(shape: tuple[int | None, ...]) -> int:
    """Values in a tensor of a fully known ``shape``."""
    n = 1
    for d in shape:
        n *= int(d or 0)
    return n


def accepts(declared: str, given: str) -> bool:
    """Whether an input typed ``declared`` takes an array of dtype ``given``."""
    if declared in ("fp16", "fp32"):
        return given in ("float16", "float32")
    if is_int_type(declared):
        return given == "int32"
    return given == declared


def expected_dtypes(declared: str) -> str:
    if declared in ("fp16", "fp32"):
        return f"{declared} (a float16 or float32 array)"
    if is_int_type(declared):
        return f"{declared} (an int32 array)"
    return declared


class Interpreter:
    """A package's programs: the spec parsed once, each function resolved on
    first use, constants and dequantized weights shared by all functions."""

    def __init__(self, package_path: str, weights_dir: str | None = None):
        self.package = MLPackage(package_path, weights_dir)
        self.path = package_path
        self._functions: dict[str, Function] = {}
        self._consts: dict[bytes, Any] = {}
        # Readers of the 4-bit weights' stored bytes, by their `Lazy`.
        self._packed: dict[Lazy, Callable[[], np.ndarray | None]] = {}
        # Constants of the weight file, by const key: (value, type, what).
        self._blob_consts: dict[bytes, tuple[Any, TensorType, str]] = {}
        # Weights are keyed by the weight file they come from: packages
        # that read one blob (a release's prefill_chunkN and chunkN) share them.
        self.weights_key = os.path.realpath(self.package.weights_dir)

    @property
    def functions(self) -> list[str]:
        return self.package.function_names

    @property
    def default_function(self) -> str:
        return self.package.default_function

    def function(self, name: str | None = None) -> Function:
        """A function by name (default: the package's default function)."""
        name = name or self.default_function
        if name not in self._functions:
            self._functions[name] = Function(self, name)
        return self._functions[name]

    def constant(self, key: bytes, value: Any, what: str) -> Any:
        """A program value (a string, or a tensor), read once per package;
        a weight read from the weight file is `Lazy` (4-bit indices always:
        the kernels read them as stored, whatever their size)."""
        if key not in self._consts:
            t = tensor_type(value.type, what) if value.type.WhichOneof("type") == "tensorType" else None
            blob = (
                value.WhichOneof("value") == "blobFileValue" and t is not None and all(d is not None for d in t.shape)
            )
            if blob and t is not None:
                self._blob_consts[key] = (value, t, what)
            if blob and t is not None and (count(t.shape) >= LAZY_ELEMENTS or (t.dtype == "uint4" and kernels())):
                weight = self.lazy(key, lambda: self.weight(value, what), tuple(int(d or 0) for d in t.shape))
                self._consts[key] = weight
                if t.dtype == "uint4":
                    self._packed[weight] = lambda: self.package.packed(value, what)
            else:
                v = self.package.value(value, what)
                self._consts[key] = v if isinstance(v, str) else to_torch(v)
        return self._consts[key]

    def stored_const(self, key: bytes, current: Any) -> Any:
        """A projection's weight constant ``current`` (const key ``key``) as
        the kernels read it: an fp16 or fp32 constant of the weight file as
        its stored values (`weights.Stored`, `Lazy`); anything else as it is
        (a palettized weight is stored already)."""
        meta = self._blob_consts.get(key)
        if meta is None:
            return current
        value, t, what = meta
        if t.dtype not in ("fp16", "fp32") or len(t.shape) < 2:
            return current
        skey = key + b"\0stored"
        if skey not in self._consts:
            shape = tuple(int(d or 0) for d in t.shape)

            def make() -> Stored:
                v = self.package.value(value, what)
                assert not isinstance(v, str)
                data = v.view(np.uint16) if t.dtype == "fp16" else np.ascontiguousarray(v, dtype=np.float32)
                return Stored(t.dtype, data.reshape(shape[0], -1), shape, f"{self.path}: {what}")

            self._consts[skey] = Lazy(("mil", self.weights_key, skey), make, shape)
        return self._consts[skey]

    def weight(self, value: Any, what: str) -> torch.Tensor:
        """A tensor value read from the weight file."""
        v = self.package.value(value, what)
        if isinstance(v, str):
            raise ChunkforgeError(f"{what}: a string where a weight was expected")
        return to_torch(v)

    def constexpr(self, key: bytes, compute: Any) -> Any:
        """A compile-time op's value (a small one), computed once per package."""
        if key not in self._consts:
            self._consts[key] = compute()
        return self._consts[key]

    def packed_reader(self, weight: Lazy) -> Callable[[], np.ndarray | None] | None:
        """A reader of the bytes the weight file stores for ``weight``, a
        4-bit constant of this package (None for any other)."""
        return self._packed.get(weight)

    def lazy(self, key: bytes, make: Any, shape: tuple[int, ...]) -> Lazy:
        """A weight of this package made on use (one `Lazy` per value, shared by its functions)."""
        if key not in self._consts:
            self._consts[key] = Lazy(("mil", self.weights_key, key), make, shape)
        value: Lazy = self._consts[key]
        return value


# ---- `chunkforge exec` ------------------------------------------------------------


def load_npz(path: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise ChunkforgeError(f"{path}: not a readable .npz file ({e})") from e


def save_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` through a temporary file in its folder, renamed when complete."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ChunkforgeError(f"{path}: the folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".exec-", suffix=".npz.partial", dir=folder)
    try:
        named: dict[str, Any] = dict(arrays)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **named)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def exec_function(req: ExecRequest) -> ExecResult:
    """``chunkforge exec``: one function of a package on the inputs of an .npz,
    its outputs written by name to another."""
    started = time.perf_counter()
    interp = Interpreter(req["package"])
    name = req.get("function") or interp.default_function
    if name not in interp.functions:
        raise ChunkforgeError(f"{req['package']}: no function {name} (it has {', '.join(interp.functions)})")
    fn = interp.function(name)
    inputs = load_npz(req["inputs"])
    try:
        fn.check_inputs(inputs)
    except ChunkforgeError as e:
        raise ChunkforgeError(f"{req['inputs']}: {e}") from e
    loaded = time.perf_counter()
    outputs = fn.run(inputs, fp16=req["fp16"])
    ran = time.perf_counter()
    save_npz(req["output"], outputs)
    return {
        "package": req["package"],
        "function": name,
        "fp16": req["fp16"],
        "ops": len(fn.steps),
        "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in fn.inputs],
        "outputs": [{"name": k, "shape": [int(d) for d in v.shape], "dtype": str(v.dtype)} for k, v in outputs.items()],
        "output": req["output"],
        "load_seconds": loaded - started,
        "run_seconds": ran - loaded,
    }
