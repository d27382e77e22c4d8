"""The files of a compiled model (``.mlmodelc``) besides the weights, written
on any platform from a package's spec file: ``model.mil`` (text MIL,
`text.emit`), ``coremldata.bin``, ``metadata.json`` and
``analytics/coremldata.bin``; and a compiled model read back as a spec
(`read_compiled`), so the interpreter, ``inspect`` and ``run`` take either.

Formats, as Apple's compiler wrote them for the ``mlmodelc-export`` crate's
published fixtures (``python/tests/test_mlmodelc.py`` holds them to it):

- ``coremldata.bin``: a 83-byte header (uint32 502, the ML program's field
  number in ``Model``; uint32 specification version; 20 zero bytes; uint64 7
  and ``generic``; the specification version as one byte; 31 zero bytes;
  uint64 the description's size), the package's ``ModelDescription`` bytes as
  they are in its spec file (an empty ``metadata`` field appended when it has
  none), then 16 bytes per function (uint32 502, 12 zero bytes), at least one.
- ``analytics/coremldata.bin``: length-prefixed (uint64) strings:
  ``NeuralNetworkModelDetails`` with two entries (``containsCustomLayer`` 0,
  ``modelDimension`` 0), ``SpecificationDetails`` with ``modelHash`` (base64
  of the spec file's SHA-256) and ``modelName`` (a pipeline's sub-model: the
  first part alone).
- ``metadata.json``: the model's schemas, function list, op histogram,
  precisions and availability, as Core ML's ``MLModel.modelDescription`` shows them.

Only specification version 9 (iOS 18) is written: the one every fixture and
every chunkforge package has. Anything else is refused.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import struct
from collections import Counter
from typing import Any

from ..runtime import ChunkforgeError
from . import text
from .program import DATA_TYPES, parse_spec, read_model_spec

ML_PROGRAM = 502  # Model.mlProgram's field number: the model type coremldata.bin records
SPEC_VERSION = 9
HEADER = 0x53
# ArrayFeatureType.ArrayDataType
ARRAY_TYPES = {65552: "Float16", 65568: "Float32", 65600: "Double", 131104: "Int32", 131080: "Int8"}
AVAILABILITY = {
    "macOS": "15.0",
    "tvOS": "18.0",
    "visionOS": "2.0",
    "watchOS": "11.0",
    "iOS": "18.0",
    "macCatalyst": "18.0",
}
PRECISION_NAMES = {
    "fp16": "Float16",
    "fp32": "Float32",
    "fp64": "Float64",
    "int8": "Int8",
    "int16": "Int16",
    "int32": "Int32",
    "int64": "Int64",
    "uint8": "UInt8",
    "uint16": "UInt16",
    "uint32": "UInt32",
    "uint64": "UInt64",
    "int4": "Int4",
    "uint1": "UInt1",
    "uint2": "UInt2",
    "uint3": "UInt3",
    "uint4": "UInt4",
    "uint6": "UInt6",
}
# Ops whose text form Apple's compiled fixtures show but the interpreter
# does not run. Every other op `compile` writes is one the interpreter runs
# (mil/ops.py), so the compiled program can be executed and compared.
FIXTURE_OPS = frozenset({"constexpr_affine_dequantize"})


def known_ops() -> frozenset[str]:
    from .ops import CONSTEXPR, OPS

    return frozenset(OPS) | frozenset(CONSTEXPR) | {"const"} | FIXTURE_OPS


# Ops the histogram names by an older opset than their function's, as Apple's
# compiler did in its fixtures (op type, function target) -> target. Core ML's
# own opset table is not public: any other op is named by its function's
# opset, which the first `compile --check` on a Mac confirms or corrects.
OLDER_OPSET = {
    ("constexpr_affine_dequantize", "ios17"): "ios16",
    ("relu", "ios17"): "ios16",
}


# ---------------------------------------------------------------- protobuf wire


def varint(data: bytes, pos: int) -> tuple[int, int]:
    out, shift = 0, 0
    while True:
        if pos >= len(data):
            raise ValueError("truncated varint")
        b = data[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, pos
        shift += 7


def raw_fields(data: bytes) -> list[tuple[int, int, bytes | int]]:
    """The top-level fields of a protobuf message as (number, wire type,
    bytes or integer), in file order."""
    out: list[tuple[int, int, bytes | int]] = []
    pos = 0
    while pos < len(data):
        tag, pos = varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            v, pos = varint(data, pos)
            out.append((number, wire, v))
        elif wire == 2:
            n, pos = varint(data, pos)
            out.append((number, wire, data[pos : pos + n]))
            pos += n
        elif wire == 1:
            out.append((number, wire, data[pos : pos + 8]))
            pos += 8
        elif wire == 5:
            out.append((number, wire, data[pos : pos + 4]))
            pos += 4
        else:
            raise ValueError(f"wire type {wire}")
    if pos != len(data):
        raise ValueError("truncated message")
    return out


def description_bytes(raw: bytes, where: str, top_level: bool = True) -> bytes:
    """The ``description`` (field 2) of a Model, byte for byte (with an empty
    ``metadata`` field added to a top-level model's, as Apple's compiler
    does; a pipeline's sub-model keeps its own as it is)."""
    try:
        found = [v for n, w, v in raw_fields(raw) if n == 2 and w == 2]
    except ValueError as e:
        raise ChunkforgeError(f"{where}: not a Core ML model spec ({e})") from e
    if len(found) != 1 or not isinstance(found[0], bytes):
        raise ChunkforgeError(f"{where}: the spec has {len(found)} descriptions")
    desc = found[0]
    if top_level and not any(n == 100 for n, _, _ in raw_fields(desc)):
        desc += b"\xa2\x06\x00"  # an empty metadata field, as Apple's compiler adds it
    return desc


# ---------------------------------------------------------------- files


def coremldata(spec_version: int, description: bytes, functions: int) -> bytes:
    head = struct.pack("<II", ML_PROGRAM, spec_version) + bytes(20)
    head += struct.pack("<II", 7, 0) + b"generic" + bytes([spec_version]) + bytes(31)
    head += struct.pack("<Q", len(description))
    assert len(head) == HEADER
    return head + description + (struct.pack("<I", ML_PROGRAM) + bytes(12)) * max(functions, 1)


def lp(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def analytics(spec_file: bytes, model_name: str, top_level: bool = True) -> bytes:
    """A top-level model's analytics, or a pipeline sub-model's (no
    ``SpecificationDetails``, as in Apple's fixtures)."""
    digest = base64.b64encode(hashlib.sha256(spec_file).digest()).decode()
    out = lp("NeuralNetworkModelDetails") + struct.pack("<Q", 2)
    out += lp("containsCustomLayer") + lp("0") + lp("modelDimension") + lp("0")
    if not top_level:
        return out
    out += lp("SpecificationDetails") + struct.pack("<Q", 2)
    out += lp("modelHash") + lp(digest) + lp("modelName") + lp(model_name)
    return out


def camel(op_type: str) -> str:
    head, *rest = op_type.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def histogram(function: Any) -> dict[str, int]:
    """Each op type of a function but ``const``, as Core ML names it."""
    target = text.OPSETS[function.opset]
    counts: Counter[str] = Counter()
    for op in function.block_specializations[function.opset].operations:
        if op.type == "const":
            continue
        prefix = OLDER_OPSET.get((op.type, target), target)
        counts[f"{prefix.capitalize()}.{camel(op.type)}"] += 1
    return dict(counts)


def precision(names: set[str]) -> str:
    names = {PRECISION_NAMES[n] for n in names if n in PRECISION_NAMES}
    ordered = sorted(names)
    if not ordered:
        return "Float32"
    return ordered[0] if len(ordered) == 1 else f"Mixed ({', '.join(ordered)})"


def compute_precision(function: Any) -> str:
    """The data types every op of a function makes (bool aside)."""
    out = set()
    for op in function.block_specializations[function.opset].operations:
        for o in op.outputs:
            out.add(DATA_TYPES.get(o.type.tensorType.dataType, ""))
    return precision(out)


def storage_precision(program: Any) -> str | None:
    """The data types of the weights in the blob file, if any."""
    out = set()
    for _, op in text.iter_ops(program):
        values = [b.value for a in op.inputs.values() for b in a.arguments if b.WhichOneof("binding") == "value"]
        values += list(op.attributes.values())
        for v in values:
            if v.WhichOneof("value") == "blobFileValue":
                out.add(DATA_TYPES.get(v.type.tensorType.dataType, ""))
    return precision(out) if out else None


def feature_schema(feature: Any, where: text.Where) -> dict[str, str]:
    ft = feature.type
    kind = ft.WhichOneof("Type")
    if kind != "multiArrayType":
        raise where(f"feature {feature.name}: a {kind} feature (the compiled form writes multi-arrays only)")
    a = ft.multiArrayType
    dtype = ARRAY_TYPES.get(a.dataType)
    if dtype is None:
        raise where(f"feature {feature.name}: array data type {a.dataType}")
    flex = a.WhichOneof("ShapeFlexibility")
    shape = [int(d) for d in a.shape]
    out: dict[str, str] = {
        "hasShapeFlexibility": "1" if flex else "0",
        "isOptional": "1" if ft.isOptional else "0",
    }
    if flex == "shapeRange":
        ranges = [(int(r.lowerBound), int(r.upperBound)) for r in a.shapeRange.sizeRanges]
        if not shape:
            shape = [lo for lo, _ in ranges]
        out["shapeRange"] = "[" + ", ".join(f"[{lo}, {hi}]" for lo, hi in ranges) + "]"
        out["shapeFlexibility"] = " × ".join(str(lo) if lo == hi else f"{lo}...{hi}" for lo, hi in ranges)
    elif flex is not None:
        raise where(f"feature {feature.name}: {flex} shapes (not matched against Apple's compiler)")
    out["dataType"] = dtype
    out["formattedType"] = f"MultiArray ({dtype} {' × '.join(str(d) for d in shape)})"
    out["shortDescription"] = feature.shortDescription
    out["shape"] = "[" + ", ".join(str(d) for d in shape) + "]"
    out["name"] = feature.name
    out["type"] = "MultiArray"
    return out


def metadata(spec: Any, class_name: str, where: text.Where) -> list[dict[str, Any]]:
    d = spec.description
    if d.state or any(f.state for f in d.functions):
        raise where("state features (not matched against Apple's compiler)")
    program = spec.mlProgram
    names = sorted(program.functions)
    default = d.defaultFunctionName or ("main" if "main" in names else names[0])
    if default not in program.functions:
        raise where(f"default function {default!r} is not in the program")
    top = program.functions[default]
    desc_fns = {f.name: f for f in d.functions}
    if d.functions:
        top_in, top_out = desc_fns[default].input, desc_fns[default].output
    else:
        top_in, top_out = d.input, d.output
    m: dict[str, Any] = {
        "metadataOutputVersion": "3.0",
        "outputSchema": [feature_schema(f, where) for f in top_out],
        "modelParameters": [],
        "specificationVersion": spec.specificationVersion,
    }
    if d.functions:
        fns = []
        for fd in d.functions:
            if fd.name not in program.functions:
                raise where(f"the description's function {fd.name!r} is not in the program")
            f = program.functions[fd.name]
            fns.append(
                {
                    "computePrecision": compute_precision(f),
                    "outputSchema": [feature_schema(x, where) for x in fd.output],
                    "stateSchema": [],
                    "name": fd.name,
                    "mlProgramOperationTypeHistogram": histogram(f),
                    "inputSchema": [feature_schema(x, where) for x in fd.input],
                }
            )
        m["functions"] = fns
    m["mlProgramOperationTypeHistogram"] = histogram(top)
    m["isUpdatable"] = "1" if spec.isUpdatable else "0"
    m["stateSchema"] = []
    m["availability"] = dict(AVAILABILITY)
    m["computePrecision"] = compute_precision(top)
    storage = storage_precision(program)
    if storage:
        m["storagePrecision"] = storage
    m["modelType"] = {"name": "MLModelType_mlProgram"}
    m["inputSchema"] = [feature_schema(f, where) for f in top_in]
    if d.functions:
        m["defaultFunctionName"] = default
    m["generatedClassName"] = class_name
    user = dict(d.metadata.userDefined)
    for key, field in (("author", "author"), ("license", "license"), ("shortDescription", "shortDescription")):
        value = getattr(d.metadata, field)
        if value:
            m[key] = value
    if d.metadata.versionString:
        m["version"] = d.metadata.versionString
    m["userDefinedMetadata"] = user
    m["method"] = "predict"
    return [m]


def metadata_text(value: list[dict[str, Any]]) -> str:
    """JSON the way Core ML's compiler lays it out (``"key" : value``, two
    spaces, an empty list or object on three lines)."""
    out = json.dumps(value, indent=2, ensure_ascii=False, separators=(",", " : "))
    return out.replace("[]", "[\n\n]").replace("{}", "{\n\n}")


def flexible_info(spec: Any) -> Any:
    """A function's ``FlexibleShapeInformation`` text (its inputs' default
    shapes and ranges from the description), "" when its shapes are fixed."""
    d = spec.description

    def of(name: str) -> str:
        features = next((list(f.input) for f in d.functions if f.name == name), None)
        if features is None:
            features = list(d.input)
        flex = []
        for f in sorted(features, key=lambda f: f.name):
            a = f.type.multiArrayType
            if f.type.WhichOneof("Type") == "multiArrayType" and a.WhichOneof("ShapeFlexibility") == "shapeRange":
                ranges = [(int(r.lowerBound), int(r.upperBound)) for r in a.shapeRange.sizeRanges]
                default = [int(x) for x in a.shape] or [lo for lo, _ in ranges]
                flex.append((f.name, default, ranges))
        if not flex:
            return ""
        defaults = ", ".join(f'{{"{n}", [{", ".join(map(str, s))}]}}' for n, s, _ in flex)
        dims = ", ".join(f'{{"{n}", [{", ".join(f"[{lo}, {hi}]" for lo, hi in r)}]}}' for n, _, r in flex)
        return (
            " [FlexibleShapeInformation = tuple<tuple<string, dict<string, tensor<int32, [?]>>>, "
            "tuple<string, dict<string, list<tensor<int32, [2]>, ?>>>>"
            f'((("DefaultShapes", {{{defaults}}}), ("RangeDims", {{{dims}}})))]'
        )

    return of


def compiled_files(spec_file: bytes, where: str, class_name: str, top_level: bool = True) -> dict[str, bytes]:
    """Every file of the compiled model but the weights, from the bytes of a
    package's spec file: ``model.mil``, ``coremldata.bin``, ``metadata.json``,
    ``analytics/coremldata.bin``. The text is parsed back and must be the
    package's program exactly, or nothing is returned. ``top_level=False``:
    a pipeline's sub-model (Apple's fixtures: its description kept as is)."""
    spec = parse_spec(where, "model spec", spec_file)
    w = text.Where(where)
    if spec.WhichOneof("Type") != "mlProgram":
        raise w(f"a {spec.WhichOneof('Type')} model (only ML programs are compiled here)")
    if spec.specificationVersion != SPEC_VERSION:
        raise w(
            f"specification version {spec.specificationVersion} "
            f"(only {SPEC_VERSION}, iOS 18, is matched against Apple's compiler)"
        )
    program = spec.mlProgram
    mil = text.emit(program, where, flexible_info(spec), known_ops())
    back = text.parse(mil, where)
    diff = text.first_difference(program, back, where)
    if diff:
        raise text.UnsupportedMil(diff)
    desc = description_bytes(spec_file, where, top_level)
    n = len(spec.description.functions)
    meta = metadata(spec, class_name, w)
    return {
        "model.mil": mil.encode(),
        "coremldata.bin": coremldata(spec.specificationVersion, desc, n),
        "metadata.json": metadata_text(meta).encode(),
        "analytics/coremldata.bin": analytics(spec_file, class_name, top_level),
    }


def write_compiled(package: str, output: str, class_name: str) -> list[str]:
    """Writes the compiled files of ``package`` (an .mlpackage folder or a
    bare spec file) into the folder ``output`` (made; must not exist).
    Returns the files written; the weights are the caller's."""
    if os.path.isdir(package):
        _, spec_path = read_model_spec(package)
    else:
        spec_path = package
    with open(spec_path, "rb") as f:
        raw = f.read()
    files = compiled_files(raw, package, class_name)
    if os.path.exists(output):
        raise ChunkforgeError(f"{output}: already exists")
    for rel, data in files.items():
        dst = os.path.join(output, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
    return list(files)


# ---------------------------------------------------------------- read back


def read_coremldata(path: str) -> tuple[int, bytes]:
    """The specification version and description bytes of a compiled
    model's ``coremldata.bin``."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ChunkforgeError(f"{path}: cannot read ({e})") from e
    if len(data) < HEADER + 16:
        raise ChunkforgeError(f"{path}: {len(data)} bytes, shorter than a compiled model's header")
    kind, version = struct.unpack_from("<II", data, 0)
    (size,) = struct.unpack_from("<Q", data, HEADER - 8)
    if kind != ML_PROGRAM or data[0x24:0x2B] != b"generic":
        raise ChunkforgeError(f"{path}: not an ML program's coremldata.bin (model type {kind})")
    if HEADER + size > len(data) or (len(data) - HEADER - size) % 16:
        raise ChunkforgeError(f"{path}: description of {size} bytes does not fit the file")
    return version, data[HEADER : HEADER + size]


def read_compiled(path: str) -> tuple[Any, str]:
    """A compiled model (``.mlmodelc`` with text ``model.mil``) as a spec: its
    description from ``coremldata.bin``, its program parsed from
    ``model.mil``; and the path of ``model.mil`` (its weights are beside it)."""
    from coremltools.proto import Model_pb2

    mil_path = os.path.join(path, "model.mil")
    version, desc = read_coremldata(os.path.join(path, "coremldata.bin"))
    try:
        with open(mil_path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ChunkforgeError(f"{mil_path}: cannot read ({e})") from e
    try:
        source = raw.decode()
    except UnicodeDecodeError as e:
        raise ChunkforgeError(
            f"{mil_path}: not text MIL (a binary model.mil, as `xcrun coremlcompiler` writes, which the iPhone rejects)"
        ) from e
    spec = Model_pb2.Model()
    spec.specificationVersion = version
    try:
        spec.description.ParseFromString(desc)
    except Exception as e:
        raise ChunkforgeError(f"{path}/coremldata.bin: the model description does not parse ({e})") from e
    spec.mlProgram.CopyFrom(text.parse(source, mil_path))
    return spec, mil_path


# ---------------------------------------------------------------- compare

BUILD_VERSIONS = re.compile(rb'\{"(coremlc-component-MIL|coremlc-version)", "[^"]*"\}')


def mil_without_versions(data: bytes) -> bytes:
    """``model.mil`` with the compiler's version strings blanked (they say
    which compiler wrote it, not what the program is)."""
    return BUILD_VERSIONS.sub(lambda m: b'{"' + m.group(1) + b'", ""}', data)


def first_json_difference(a: Any, b: Any, at: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{at}/{k} only in {'theirs' if k not in a else 'ours'}"
            d = first_json_difference(a[k], b[k], f"{at}/{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{at}: {len(a)} entries against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_json_difference(x, y, f"{at}/{i}")
            if d:
                return d
        return None
    return None if a == b else f"{at}: {a!r} against {b!r}"


def first_byte_difference(a: str, b: str) -> int | None:
    """The offset of the first byte where files ``a`` and ``b`` differ
    (read in 1 MiB pieces), or None."""
    offset = 0
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                n = min(len(x), len(y))
                return offset + next((i for i in range(n) if x[i] != y[i]), n)
            if not x:
                return None
            offset += len(x)


def compare_dirs(ours: str, theirs: str, files: list[str], substitutes: dict[str, str] | None = None) -> str | None:
    """The first difference between two compiled models, file by file (in
    ``files``' order): ``model.mil`` byte for byte but the compiler's version
    strings, ``metadata.json`` as JSON, everything else byte for byte.
    ``substitutes`` names where one of ours really is (the package's blob)."""
    for rel in files:
        a = (substitutes or {}).get(rel, os.path.join(ours, rel))
        b = os.path.join(theirs, rel)
        if not os.path.isfile(a) or not os.path.isfile(b):
            if os.path.isfile(a) != os.path.isfile(b):
                return f"{rel}: only {'ours' if os.path.isfile(a) else 'theirs'} has it"
            continue
        if rel == "model.mil":
            with open(a, "rb") as fa, open(b, "rb") as fb:
                x, y = mil_without_versions(fa.read()), mil_without_versions(fb.read())
            if x != y:
                lx, ly = x.split(b"\n"), y.split(b"\n")
                line = next((i for i, (p, q) in enumerate(zip(lx, ly, strict=False)) if p != q), min(len(lx), len(ly)))
                got = lx[line][:160].decode(errors="replace") if line < len(lx) else "(end)"
                want = ly[line][:160].decode(errors="replace") if line < len(ly) else "(end)"
                return f"model.mil line {line + 1}: ours {got!r}, theirs {want!r}"
        elif rel == "metadata.json":
            with open(a, "rb") as fa, open(b, "rb") as fb:
                d = first_json_difference(json.load(fa), json.load(fb))
            if d:
                return f"metadata.json {d}"
        else:
            at = first_byte_difference(a, b)
            if at is not None:
                sizes = f"{os.path.getsize(a)} bytes against {os.path.getsize(b)}"
                return f"{rel}: first differing byte at offset {at} ({sizes})"
    return None
