"""Text MIL (``model.mil`` of a compiled ``.mlmodelc``), written from and read
back into the protobuf program (``MIL_pb2.Program``) of an ``.mlpackage``.

The app's iPhone loads only text MIL, as Core ML's compiler writes it from a
package (``coremltools``' ``get_compiled_model_path()``; upstream's
``docs/DEPLOYMENT.md``). The form below is the one Apple's compiler wrote for
the published fixtures of the ``mlmodelc-export`` crate (coremlc 3520.5.1 and
3600.25.1), which ``python/tests/test_mlmodelc.py`` requires byte for byte::

    program(1.3)
    [buildInfo = dict<string, string>({{"KEY", "VALUE"}, ...})]
    {
        func NAME<ios18>(tensor<fp16, [1, 1, 64]> x, ...) {
                tensor<int32, [1]> v = const()[name = string("v"), val = tensor<int32, [1]>([-1])];
                tensor<fp16, [1, 1, 64]> y = add(x = x, y = x)[name = string("y")];
            } -> (y);
    }

- functions in name order, inputs in declaration order, each op's inputs and
  attributes in name order; a rank-0 type is its data type alone
  (``int32``), an unknown dimension ``?``;
- floats in C99 hex (``0x1.8p-3``, ``-0x0p+0``, ``inf``), integers in
  decimal, strings quoted, tensors as nested brackets, weights as
  ``BLOBFILE(path = string("@model_path/weights/weight.bin"), offset = uint64(N))``;
- ``buildInfo`` holds the package's own entries and the compiler's
  (``coremlc-component-MIL``, ``coremlc-version``), sorted by key; chunkforge
  writes the versions of the compiler whose output it is matched against
  (``COREMLC_BUILD``), so the file is Apple's form byte for byte; who really
  wrote it is recorded in the release's ``manifest.json`` (``compiled.by``).

Fail closed: anything the form above does not cover (a value kind, data type,
storage, nested block, docstring or attribute chunkforge has not matched
against Apple's output) is an ``UnsupportedMil`` naming the function and the
op; nothing is guessed. ``parse`` is the inverse of ``emit``: the program it
reads back must equal the package's protobuf (``first_difference``), which
``compile`` checks for every package it writes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime import ChunkforgeError
from .program import DATA_TYPES, SUB_BYTE, unpack_bits

# The compiler whose text form the emitter reproduces (its fixtures'
# newest iOS 18-era build: coremlc 3520.5.1, MIL component 3520.4.1).
COREMLC_BUILD = {"coremlc-component-MIL": "3520.4.1", "coremlc-version": "3520.5.1"}
INDENT_FUNC = "    "
INDENT_OP = "            "
INDENT_END = "        "
# MIL opsets and the target names the text uses.
OPSETS = {"CoreML5": "ios15", "CoreML6": "ios16", "CoreML7": "ios17", "CoreML8": "ios18"}
TARGETS = {v: k for k, v in OPSETS.items()}
NAME_NUMBERS = {name: number for number, name in DATA_TYPES.items()}
# The data types the text form covers (bf16 and fp8 never seen in Apple's output).
TEXT_TYPES = (
    "bool",
    "string",
    "fp16",
    "fp32",
    "fp64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    *SUB_BYTE,
)
# Where coremltools stores an immediate value of each data type
# (MIL_pb2.TensorValue's oneof); the text keeps values, not storage, so a
# value stored elsewhere could not come back the same and is refused.
STORAGE = {
    "bool": "bools",
    "string": "strings",
    "fp16": "bytes",
    "fp32": "floats",
    "fp64": "doubles",
    "int8": "bytes",
    "int16": "bytes",
    "int32": "ints",
    "int64": "longInts",
    "uint8": "bytes",
    "uint16": "bytes",
    "uint32": "bytes",
    "uint64": "bytes",
    **{t: "bytes" for t in SUB_BYTE},
}
WHOLE_BYTES = {
    "fp16": "<f2",
    "int8": "i1",
    "int16": "<i2",
    "uint8": "u1",
    "uint16": "<u2",
    "uint32": "<u4",
    "uint64": "<u8",
}
SAFE_STRING = re.compile(r'^[^"\\\x00-\x1f\x7f]*$')


class UnsupportedMil(ChunkforgeError):
    """A program the text form cannot hold exactly."""


@dataclass
class Where:
    """What is being written or read, for errors: package, function, op."""

    package: str
    function: str = ""
    op: str = ""

    def __call__(self, message: str) -> UnsupportedMil:
        at = [self.package]
        if self.function:
            at.append(f"function {self.function}")
        if self.op:
            at.append(f"op {self.op}")
        return UnsupportedMil(f"{': '.join(at)}: {message}")


# ---------------------------------------------------------------- numbers


def hex_float(x: float) -> str:
    """C99 ``%a`` of a double: ``0x1.8p-3``, ``0x0p+0``, ``-inf``."""
    if math.isnan(x):
        raise ValueError("nan")
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    if x == 0:
        return "-0x0p+0" if math.copysign(1.0, x) < 0 else "0x0p+0"
    text = x.hex()  # [-]0x1.<13 hex digits>p<exp>, subnormal doubles never occur here
    sign = "-" if text.startswith("-") else ""
    mantissa, exponent = text.lstrip("-")[2:].split("p")
    lead, _, frac = mantissa.partition(".")
    frac = frac.rstrip("0")
    exp = int(exponent)
    return f"{sign}0x{lead}{'.' + frac if frac else ''}p{'+' if exp >= 0 else '-'}{abs(exp)}"


# ---------------------------------------------------------------- types


def dtype_name(number: int, where: Where) -> str:
    name = DATA_TYPES.get(number)
    if name not in TEXT_TYPES:
        raise where(f"data type {name or number} is not in the text form chunkforge writes")
    return str(name)


def type_text(vt: Any, where: Where) -> str:
    kind = vt.WhichOneof("type")
    if kind != "tensorType":
        raise where(f"a {kind} type (the text form chunkforge writes holds tensors only)")
    t = vt.tensorType
    if t.attributes:
        raise where(f"tensor type attributes {sorted(t.attributes)}")
    name = dtype_name(t.dataType, where)
    if len(t.dimensions) != t.rank:
        raise where(f"rank {t.rank} with {len(t.dimensions)} dimensions")
    if t.rank == 0:
        return name
    dims = []
    for d in t.dimensions:
        which = d.WhichOneof("dimension")
        if which == "constant":
            dims.append(str(d.constant.size))
        elif which == "unknown" and not d.unknown.variadic:
            dims.append("?")
        else:
            raise where(f"a {which or 'missing'} dimension{' (variadic)' if which == 'unknown' else ''}")
    return f"tensor<{name}, [{', '.join(dims)}]>"


def shape_of(vt: Any) -> tuple[int, ...] | None:
    t = vt.tensorType
    if any(d.WhichOneof("dimension") != "constant" for d in t.dimensions):
        return None
    return tuple(int(d.constant.size) for d in t.dimensions)


# ---------------------------------------------------------------- values


def flat_values(tv: Any, dtype: str, count: int, where: Where) -> list[str]:
    """An immediate tensor's values as text, in row-major order."""
    field = tv.WhichOneof("value")
    want = STORAGE[dtype]
    if field != want:
        raise where(f"a {dtype} value stored as {field} (coremltools stores it as {want}; the text cannot keep it)")
    if field == "bytes":
        raw = np.frombuffer(tv.bytes.values, dtype=np.uint8)
        if dtype in SUB_BYTE:
            nbits, signed = SUB_BYTE[dtype]
            if raw.size != (count * nbits + 7) // 8:
                raise where(f"{raw.size} bytes for {count} {dtype} values")
            return [str(int(v)) for v in unpack_bits(raw, nbits, signed, count)]
        arr = raw.view(np.dtype(WHOLE_BYTES[dtype]))
        if arr.size != count:
            raise where(f"{arr.size} {dtype} values for {count} elements")
        if dtype == "fp16":
            out = []
            for v in arr:
                if np.isnan(v):
                    raise where("a NaN constant (its bits cannot be kept in text)")
                out.append(hex_float(float(v)))
            return out
        return [str(int(v)) for v in arr]
    values = list(getattr(tv, field).values)
    if len(values) != count:
        raise where(f"{len(values)} values for {count} elements")
    if field in ("floats", "doubles"):
        if any(math.isnan(v) for v in values):
            raise where("a NaN constant (its bits cannot be kept in text)")
        return [hex_float(float(v)) for v in values]
    if field == "bools":
        return ["true" if v else "false" for v in values]
    if field == "strings":
        for s in values:
            if not SAFE_STRING.match(s):
                raise where(f"string {s!r} holds a quote, backslash or control character")
        return [f'"{s}"' for s in values]
    return [str(int(v)) for v in values]


def nested(values: list[str], shape: tuple[int, ...]) -> str:
    if not shape:
        return values[0]
    if len(shape) == 1:
        return "[" + ", ".join(values) + "]"
    step = int(np.prod(shape[1:], dtype=np.int64))
    return "[" + ", ".join(nested(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])) + "]"


def value_text(v: Any, where: Where) -> str:
    if v.docString:
        raise where("a value with a docstring")
    ty = type_text(v.type, where)
    kind = v.WhichOneof("value")
    if kind == "blobFileValue":
        b = v.blobFileValue
        if not SAFE_STRING.match(b.fileName):
            raise where(f"weight file name {b.fileName!r}")
        return f'{ty}(BLOBFILE(path = string("{b.fileName}"), offset = uint64({b.offset})))'
    if kind != "immediateValue":
        raise where("a value with no data")
    imm = v.immediateValue
    if imm.WhichOneof("value") != "tensor":
        raise where(f"a {imm.WhichOneof('value')} immediate value")
    shape = shape_of(v.type)
    if shape is None:
        raise where("an immediate value of unknown shape")
    dtype = DATA_TYPES[v.type.tensorType.dataType]
    values = flat_values(imm.tensor, dtype, int(np.prod(shape, dtype=np.int64)), where)
    return f"{ty}({nested(values, shape)})"


# ---------------------------------------------------------------- emit


def build_info(program: Any, where: Where) -> list[tuple[str, str]]:
    """The ``buildInfo`` entries of the compiled program: the package's and
    the compiler's versions, sorted by key."""
    entries = dict(COREMLC_BUILD)
    extra = set(program.attributes) - {"buildInfo"}
    if extra:
        raise where(f"program attributes {sorted(extra)} (only buildInfo is known)")
    if "buildInfo" in program.attributes:
        for k, v in read_build_info(program.attributes["buildInfo"], where).items():
            if k in entries:
                raise where(f"buildInfo already holds {k!r}, which the compiler writes")
            entries[k] = v
    for k, v in entries.items():
        if not (SAFE_STRING.match(k) and SAFE_STRING.match(v)):
            raise where(f"buildInfo entry {k!r}: {v!r} holds a quote, backslash or control character")
    return sorted(entries.items())


def read_build_info(value: Any, where: Where) -> dict[str, str]:
    vt = value.type
    if vt.WhichOneof("type") != "dictionaryType" or value.WhichOneof("value") != "immediateValue":
        raise where("buildInfo is not an immediate dictionary")
    out: dict[str, str] = {}
    for kv in value.immediateValue.dictionary.values:
        key = kv.key.immediateValue.tensor.strings.values
        val = kv.value.immediateValue.tensor.strings.values
        if len(key) != 1 or len(val) != 1:
            raise where("buildInfo holds an entry that is not string to string")
        out[str(key[0])] = str(val[0])
    if build_info_value(out) != value:
        raise where("buildInfo is not stored the way coremltools stores it")
    return out


def build_info_value(entries: dict[str, str]) -> Any:
    """``buildInfo`` as coremltools stores it in the program's attributes."""
    from coremltools.proto import MIL_pb2

    string = MIL_pb2.ValueType()
    string.tensorType.dataType = MIL_pb2.DataType.STRING
    v = MIL_pb2.Value()
    v.type.dictionaryType.keyType.CopyFrom(string)
    v.type.dictionaryType.valueType.CopyFrom(string)
    for k, val in entries.items():
        kv = v.immediateValue.dictionary.values.add()
        kv.key.type.CopyFrom(string)
        kv.key.immediateValue.tensor.strings.values.append(k)
        kv.value.type.CopyFrom(string)
        kv.value.immediateValue.tensor.strings.values.append(val)
    return v


def op_label(op: Any) -> str:
    name = op.attributes["name"].immediateValue.tensor.strings.values[0] if "name" in op.attributes else ""
    outs = ", ".join(o.name for o in op.outputs)
    return f"{op.type} {name or outs!s}" if (name or outs) else op.type


def op_text(op: Any, where: Where, known_ops: frozenset[str] | None) -> str:
    where = Where(where.package, where.function, op_label(op))
    if known_ops is not None and op.type not in known_ops:
        raise where(
            f"op type {op.type!r} is neither one the MIL interpreter runs (so the compiled program could not be "
            "proven by running it) nor one seen in Apple's compiled fixtures"
        )
    if op.blocks:
        raise where("an op with nested blocks (control flow)")
    if not op.outputs:
        raise where("an op without outputs")
    outs = ", ".join(f"{type_text(o.type, where)} {o.name}" for o in op.outputs)
    args = []
    for key in sorted(op.inputs):
        bindings = op.inputs[key].arguments
        if not bindings:
            raise where(f"input {key} binds nothing")
        parts = []
        for b in bindings:
            kind = b.WhichOneof("binding")
            if kind == "name":
                parts.append(b.name)
            elif kind == "value":
                parts.append(value_text(b.value, where))
            else:
                raise where(f"input {key}: an empty binding")
        args.append(f"{key} = {parts[0] if len(parts) == 1 else '(' + ', '.join(parts) + ')'}")
    text = f"{INDENT_OP}{outs} = {op.type}({', '.join(args)})"
    if op.attributes:
        attrs = ", ".join(f"{k} = {value_text(op.attributes[k], where)}" for k in sorted(op.attributes))
        text += f"[{attrs}]"
    return text + ";\n"


def emit(
    program: Any,
    package: str,
    flexible: Callable[[str], str] | None = None,
    known_ops: frozenset[str] | None = None,
) -> str:
    """``program`` (MIL_pb2.Program) as text MIL. ``flexible(function)``
    gives a function's ``FlexibleShapeInformation`` attribute text (from the
    model description), or "". ``known_ops``: the op types allowed (None:
    any)."""
    where = Where(package)
    if program.version != 1:
        raise where(f"program version {program.version} (coremltools writes 1)")
    if program.docString:
        raise where("a program docstring")
    info = build_info(program, where)
    lines = ["program(1.3)\n"]
    lines.append("[buildInfo = dict<string, string>({" + ", ".join(f'{{"{k}", "{v}"}}' for k, v in info) + "})]\n{\n")
    for name in sorted(program.functions):
        f = program.functions[name]
        fw = Where(package, name)
        if f.attributes:
            raise fw(f"function attributes {sorted(f.attributes)}")
        if f.opset not in OPSETS:
            raise fw(f"opset {f.opset!r} (known: {', '.join(OPSETS)})")
        if list(f.block_specializations) != [f.opset]:
            raise fw(f"block specializations {sorted(f.block_specializations)} (one, for opset {f.opset}, is known)")
        block = f.block_specializations[f.opset]
        if block.inputs or block.attributes:
            raise fw("a main block with inputs or attributes")
        params = ", ".join(f"{type_text(i.type, fw)} {i.name}" for i in f.inputs)
        flex = flexible(name) if flexible else ""
        lines.append(f"{INDENT_FUNC}func {name}<{OPSETS[f.opset]}>({params}){flex} {{\n")
        for op in block.operations:
            lines.append(op_text(op, fw, known_ops))
        lines.append(f"{INDENT_END}}} -> ({', '.join(block.outputs)});\n")
    lines.append("}")
    return "".join(lines)


# ---------------------------------------------------------------- parse


TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"[^"\\\n]*")
    | (?P<num>-?0x[0-9a-fA-F]+(?:\.[0-9a-fA-F]*)?p[+-]?\d+|-?inf\b|nan\b|-?\d+(?:\.\d+)?)
    | (?P<arrow>->)
    | (?P<name>[A-Za-z_][A-Za-z0-9_.]*)
    | (?P<punct>[()\[\]{}<>,=;?])
    )""",
    re.VERBOSE,
)


class Tokens:
    def __init__(self, text: str, package: str):
        self.items: list[tuple[str, str, int]] = []
        pos = 0
        end = len(text.rstrip())
        while pos < end:
            m = TOKEN.match(text, pos)
            if not m or m.end() == pos:
                raise self._error(text, pos, package, "unexpected text")
            kind = m.lastgroup or ""
            self.items.append((kind, m.group(kind), m.start(kind)))
            pos = m.end()
        self.i = 0
        self.text = text
        self.package = package

    @staticmethod
    def _error(text: str, pos: int, package: str, message: str) -> UnsupportedMil:
        line = text.count("\n", 0, pos) + 1
        col = pos - (text.rfind("\n", 0, pos) + 1) + 1
        snippet = text[pos : pos + 40].split("\n")[0]
        return UnsupportedMil(f"{package}: model.mil line {line} column {col}: {message} at {snippet!r}")

    def error(self, message: str) -> UnsupportedMil:
        pos = self.items[self.i][2] if self.i < len(self.items) else len(self.text)
        return self._error(self.text, pos, self.package, message)

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.items[j][1] if j < len(self.items) else ""

    def kind(self) -> str:
        return self.items[self.i][0] if self.i < len(self.items) else ""

    def next(self) -> str:
        if self.i >= len(self.items):
            raise self.error("unexpected end")
        tok = self.items[self.i][1]
        self.i += 1
        return tok

    def expect(self, want: str) -> None:
        got = self.next()
        if got != want:
            self.i -= 1
            raise self.error(f"expected {want!r}")

    def name(self) -> str:
        if self.kind() != "name":
            raise self.error("expected a name")
        return self.next()

    def string(self) -> str:
        if self.kind() != "str":
            raise self.error("expected a string")
        return self.next()[1:-1]


def parse_type(t: Tokens, vt: Any) -> None:
    word = t.name()
    tt = vt.tensorType
    if word != "tensor":
        if word not in TEXT_TYPES:
            raise t.error(f"unknown type {word!r}")
        tt.dataType = NAME_NUMBERS[word]
        tt.rank = 0
        return
    t.expect("<")
    dtype = t.name()
    if dtype not in TEXT_TYPES:
        raise t.error(f"unknown data type {dtype!r}")
    tt.dataType = NAME_NUMBERS[dtype]
    t.expect(",")
    t.expect("[")
    rank = 0
    while t.peek() != "]":
        if rank:
            t.expect(",")
        d = tt.dimensions.add()
        if t.peek() == "?":
            t.next()
            d.unknown.variadic = False
        else:
            d.constant.size = int(t.next())
        rank += 1
    t.expect("]")
    t.expect(">")
    tt.rank = rank


def parse_scalar(t: Tokens, dtype: str) -> Any:
    if dtype == "string":
        return t.string()
    tok = t.next()
    if dtype == "bool":
        if tok not in ("true", "false"):
            raise t.error("expected true or false")
        return tok == "true"
    if dtype in ("fp16", "fp32", "fp64"):
        return float.fromhex(tok) if tok.lstrip("-").startswith("0x") else float(tok)
    return int(tok)


def parse_nested(t: Tokens, dtype: str, shape: tuple[int, ...], out: list[Any]) -> None:
    if not shape:
        out.append(parse_scalar(t, dtype))
        return
    t.expect("[")
    for i in range(shape[0]):
        if i:
            t.expect(",")
        parse_nested(t, dtype, shape[1:], out)
    t.expect("]")


def store(tv: Any, dtype: str, values: list[Any]) -> None:
    """``values`` into a TensorValue the way coremltools stores them."""
    field = STORAGE[dtype]
    if field == "bytes":
        if dtype in SUB_BYTE:
            nbits, signed = SUB_BYTE[dtype]
            bits = np.zeros(len(values) * nbits, dtype=np.uint8)
            for i, v in enumerate(values):
                u = v & ((1 << nbits) - 1) if signed else v
                for b in range(nbits):
                    bits[i * nbits + b] = (u >> b) & 1
            tv.bytes.values = np.packbits(bits, bitorder="little").tobytes()
        else:
            tv.bytes.values = np.array(values, dtype=np.dtype(WHOLE_BYTES[dtype])).tobytes()
    else:
        getattr(tv, field).values.extend(values)
    if field == "bytes" and not values:
        tv.bytes.values = b""


def parse_value(t: Tokens, v: Any) -> None:
    parse_type(t, v.type)
    tt = v.type.tensorType
    dtype = DATA_TYPES[tt.dataType]
    t.expect("(")
    if t.peek() == "BLOBFILE":
        t.next()
        t.expect("(")
        t.expect("path")
        t.expect("=")
        t.expect("string")
        t.expect("(")
        v.blobFileValue.fileName = t.string()
        t.expect(")")
        t.expect(",")
        t.expect("offset")
        t.expect("=")
        t.expect("uint64")
        t.expect("(")
        v.blobFileValue.offset = int(t.next())
        t.expect(")")
        t.expect(")")
    else:
        shape = tuple(int(d.constant.size) for d in tt.dimensions)
        values: list[Any] = []
        parse_nested(t, dtype, shape, values)
        tensor = v.immediateValue.tensor
        store(tensor, dtype, values)
        if not values:
            tensor.SetInParent()
    t.expect(")")


def parse_binding(t: Tokens, arg: Any) -> None:
    b = arg.arguments.add()
    if t.kind() == "name" and t.peek(1) in (",", ")"):
        b.name = t.next()
    else:
        parse_value(t, b.value)


def parse_op(t: Tokens, block: Any) -> None:
    op = block.operations.add()
    while True:
        o = op.outputs.add()
        parse_type(t, o.type)
        o.name = t.name()
        if t.peek() != ",":
            break
        t.next()
    t.expect("=")
    op.type = t.name()
    t.expect("(")
    first = True
    while t.peek() != ")":
        if not first:
            t.expect(",")
        first = False
        key = t.name()
        t.expect("=")
        arg = op.inputs[key]
        if t.peek() == "(":
            t.next()
            while True:
                parse_binding(t, arg)
                if t.peek() != ",":
                    break
                t.next()
            t.expect(")")
        else:
            parse_binding(t, arg)
    t.expect(")")
    if t.peek() == "[":
        t.next()
        first = True
        while t.peek() != "]":
            if not first:
                t.expect(",")
            first = False
            key = t.name()
            t.expect("=")
            parse_value(t, op.attributes[key])
        t.expect("]")
    t.expect(";")


def skip_brackets(t: Tokens) -> None:
    """A function's attribute list (``[FlexibleShapeInformation = ...]``,
    made from the model description, not from the program)."""
    depth = 0
    while True:
        tok = t.next()
        if tok == "[":
            depth += 1
        elif tok == "]":
            depth -= 1
            if depth == 0:
                return


def parse(text: str, package: str) -> Any:
    """Text MIL back into a MIL_pb2.Program; ``buildInfo`` keeps the
    package's own entries only (the compiler's are dropped)."""
    from coremltools.proto import MIL_pb2

    t = Tokens(text, package)
    program = MIL_pb2.Program()
    program.version = 1
    t.expect("program")
    t.expect("(")
    if t.next() != "1.3":
        t.i -= 1
        raise t.error("expected program version 1.3")
    t.expect(")")
    t.expect("[")
    t.expect("buildInfo")
    t.expect("=")
    for tok in ("dict", "<", "string", ",", "string", ">", "(", "{"):
        t.expect(tok)
    entries: dict[str, str] = {}
    while t.peek() == "{":
        t.next()
        k = t.string()
        t.expect(",")
        entries[k] = t.string()
        t.expect("}")
        if t.peek() == ",":
            t.next()
    for tok in ("}", ")", "]", "{"):
        t.expect(tok)
    own = {k: v for k, v in entries.items() if k not in COREMLC_BUILD}
    if own:
        program.attributes["buildInfo"].CopyFrom(build_info_value(own))
    while t.peek() == "func":
        t.next()
        name = t.name()
        t.expect("<")
        target = t.name()
        if target not in TARGETS:
            raise t.error(f"unknown target {target!r}")
        t.expect(">")
        f = program.functions[name]
        f.opset = TARGETS[target]
        t.expect("(")
        while t.peek() != ")":
            if f.inputs:
                t.expect(",")
            i = f.inputs.add()
            parse_type(t, i.type)
            i.name = t.name()
        t.expect(")")
        if t.peek() == "[":
            skip_brackets(t)
        t.expect("{")
        block = f.block_specializations[f.opset]
        while t.peek() != "}":
            parse_op(t, block)
        t.expect("}")
        t.expect("->")
        t.expect("(")
        while t.peek() != ")":
            if block.outputs:
                t.expect(",")
            block.outputs.append(t.name())
        t.expect(")")
        t.expect(";")
    t.expect("}")
    if t.i != len(t.items):
        raise t.error("text after the program")
    return program


# ---------------------------------------------------------------- compare


def canonical(program: Any, package: str) -> Any:
    """``program`` with its ``buildInfo`` entries in key order (the order the
    text writes them in; a dictionary's order means nothing)."""
    if "buildInfo" not in program.attributes:
        return program
    out = type(program)()
    out.CopyFrom(program)
    entries = read_build_info(program.attributes["buildInfo"], Where(package))
    out.attributes["buildInfo"].CopyFrom(build_info_value(dict(sorted(entries.items()))))
    return out


def first_difference(source: Any, parsed: Any, package: str) -> str | None:
    """Where ``parsed`` (read back from text) departs from ``source`` (the
    package's program), named by function and op; None when equal."""
    source = canonical(source, package)
    if source == parsed:
        return None
    if sorted(source.functions) != sorted(parsed.functions):
        return f"{package}: functions {sorted(source.functions)} read back as {sorted(parsed.functions)}"
    if source.attributes != parsed.attributes:
        return f"{package}: program attributes (buildInfo) differ after the round trip"
    for name in sorted(source.functions):
        a, b = source.functions[name], parsed.functions[name]
        if a == b:
            continue
        if a.inputs != b.inputs:
            return f"{package}: function {name}: inputs differ after the round trip"
        if a.opset != b.opset or list(a.block_specializations) != list(b.block_specializations):
            return f"{package}: function {name}: opset differs after the round trip"
        ba, bb = a.block_specializations[a.opset], b.block_specializations[b.opset]
        for i, (oa, ob) in enumerate(zip(ba.operations, bb.operations, strict=False)):
            if oa != ob:
                fields = [fd.name for fd in oa.DESCRIPTOR.fields if getattr(oa, fd.name) != getattr(ob, fd.name)]
                what = ", ".join(fields) or "fields"
                return f"{package}: function {name}: op {i} ({op_label(oa)}): {what} differ after the round trip"
        if len(ba.operations) != len(bb.operations):
            return f"{package}: function {name}: {len(ba.operations)} ops read back as {len(bb.operations)}"
        return f"{package}: function {name}: block outputs differ after the round trip"
    return f"{package}: the program differs after the round trip"


def iter_ops(program: Any) -> Iterator[tuple[str, Any]]:
    for name in sorted(program.functions):
        f = program.functions[name]
        for op in f.block_specializations[f.opset].operations:
            yield name, op
