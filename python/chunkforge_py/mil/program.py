"""An ML program package read straight from its files: the protobuf spec, the
weight blob storage, and every value a program holds. Nothing is loaded into
coremltools' object model and nothing in the package is written, so packages
on a read-only mount work.

The weight file (``weights/weight.bin``, MIL blob storage version 2) is a
64-byte storage header (uint32 blob count, uint32 version) followed by blobs,
each a 64-byte metadata record (uint32 sentinel ``0xDEADBEEF``, uint32 blob
data type, uint64 byte size, uint64 data offset, reserved) and its data. A
program's ``blobFileValue`` names the file and the offset of a blob's metadata
record. Sub-byte data (uint1..uint6, int4) is packed least significant bit
first.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..runtime import ChunkforgeError

# MIL_pb2.DataType numbers -> our names.
DATA_TYPES: dict[int, str] = {
    1: "bool",
    2: "string",
    10: "fp16",
    11: "fp32",
    12: "fp64",
    13: "bf16",
    21: "int8",
    22: "int16",
    23: "int32",
    24: "int64",
    25: "int4",
    31: "uint8",
    32: "uint16",
    33: "uint32",
    34: "uint64",
    35: "uint4",
    36: "uint2",
    37: "uint1",
    38: "uint6",
    39: "uint3",
    40: "fp8e4m3fn",
    41: "fp8e5m2",
}
# numpy dtypes of the whole-byte types (sub-byte types unpack to uint8 / int8).
NUMPY: dict[str, Any] = {
    "bool": np.bool_,
    "fp16": np.float16,
    "fp32": np.float32,
    "fp64": np.float64,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
}
SUB_BYTE: dict[str, tuple[int, bool]] = {
    "uint1": (1, False),
    "uint2": (2, False),
    "uint3": (3, False),
    "uint4": (4, False),
    "uint6": (6, False),
    "int4": (4, True),
}
FLOATS = ("fp16", "fp32", "fp64", "bf16")
# MILBlob's BlobDataType numbers (what a blob's metadata record says it holds).
BLOB_TYPES: dict[int, str] = {
    1: "fp16",
    2: "fp32",
    3: "uint8",
    4: "int8",
    5: "bf16",
    6: "int16",
    7: "uint16",
    8: "int4",
    9: "uint1",
    10: "uint2",
    11: "uint4",
    12: "uint3",
    13: "uint6",
    14: "int32",
    15: "uint32",
    16: "fp8e4m3fn",
    17: "fp8e5m2",
}
BLOB_SENTINEL = 0xDEADBEEF
BLOB_HEADER = 64
BLOB_METADATA = 64


@dataclass(frozen=True)
class TensorType:
    """A value's type: data type name and shape (None for a dimension the
    program leaves unknown)."""

    dtype: str
    shape: tuple[int | None, ...]


def tensor_type(value_type: Any, what: str) -> TensorType:
    """A MIL_pb2.ValueType that must be a tensor."""
    kind = value_type.WhichOneof("type")
    if kind != "tensorType":
        raise ChunkforgeError(f"{what}: a {kind} value (the interpreter handles tensors only)")
    t = value_type.tensorType
    if t.dataType not in DATA_TYPES:
        raise ChunkforgeError(f"{what}: unknown data type number {t.dataType}")
    shape: list[int | None] = []
    for d in t.dimensions:
        shape.append(int(d.constant.size) if d.WhichOneof("dimension") == "constant" else None)
    if len(shape) != t.rank:
        raise ChunkforgeError(f"{what}: rank {t.rank} with {len(shape)} dimensions")
    return TensorType(DATA_TYPES[t.dataType], tuple(shape))


def unpack_bits(packed: np.ndarray, nbits: int, signed: bool, count: int) -> np.ndarray:
    """``count`` ``nbits``-bit integers packed least significant bit first."""
    if nbits == 4 and not signed:
        # Palettized weights' indices: two per byte, the low nibble first.
        raw = packed.view(np.uint8)
        if raw.size * 2 < count:
            raise ValueError(f"{raw.size} bytes hold fewer than {count} 4-bit values")
        out = np.empty(raw.size * 2, dtype=np.uint8)
        np.bitwise_and(raw, 0x0F, out=out[0::2])
        np.right_shift(raw, 4, out=out[1::2])
        return out[:count]
    bits = np.unpackbits(packed.view(np.uint8), bitorder="little")
    if bits.size < count * nbits:
        raise ValueError(f"{packed.size} bytes hold fewer than {count} {nbits}-bit values")
    groups = bits[: count * nbits].reshape(count, nbits).astype(np.uint8)
    values = (groups << np.arange(nbits, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)
    if signed:
        out = values.astype(np.int8)
        out[values >= 1 << (nbits - 1)] -= np.int8(1 << nbits)
        return out
    return values


def bf16_to_fp32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


class BlobFile:
    """One MIL blob storage file, read with positioned reads: a weight read
    is memory of its own, let go with it (a mapping of the file would keep
    every page it touched resident for as long as the file stays open)."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY)
            self.size = os.fstat(self.fd).st_size
        except OSError as e:
            raise ChunkforgeError(f"{path}: cannot read the weight file ({e})") from e
        if self.size < BLOB_HEADER:
            raise ChunkforgeError(f"{path}: {self.size} bytes, shorter than the blob storage header")
        count, version = struct.unpack_from("<II", self._bytes(0, 8))
        if version != 2:
            raise ChunkforgeError(f"{path}: blob storage version {version} (the interpreter reads version 2)")
        self.count = count

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)

    def _bytes(self, offset: int, size: int) -> bytes:
        data = os.pread(self.fd, size, offset)
        while len(data) < size:
            more = os.pread(self.fd, size - len(data), offset + len(data))
            if not more:
                raise ChunkforgeError(f"{self.path}: ends at {offset + len(data)}, inside a blob")
            data += more
        return data

    def read(self, offset: int, t: TensorType, what: str, packed: bool = False) -> np.ndarray:
        """The blob whose metadata record is at ``offset``, as ``t`` (checked
        against the record's own data type and size). Whole-byte types are
        read-only arrays over the bytes read; sub-byte types are unpacked,
        or with ``packed`` the bytes as stored (flat uint8)."""
        if offset < BLOB_HEADER or offset + BLOB_METADATA > self.size:
            raise ChunkforgeError(f"{self.path}: {what}: blob offset {offset} is outside the file")
        sentinel, blob_type, size, data_offset = struct.unpack_from("<IIQQ", self._bytes(offset, 24))
        if sentinel != BLOB_SENTINEL:
            raise ChunkforgeError(f"{self.path}: {what}: no blob metadata at offset {offset}")
        stored = BLOB_TYPES.get(blob_type, f"type {blob_type}")
        if stored != t.dtype:
            raise ChunkforgeError(f"{self.path}: {what}: the program reads {t.dtype}, blob at {offset} holds {stored}")
        if data_offset + size > self.size:
            raise ChunkforgeError(f"{self.path}: {what}: blob at {offset} runs past the end of the file")
        if any(d is None for d in t.shape):
            raise ChunkforgeError(f"{what}: a weight of unknown shape {t.shape}")
        shape = tuple(int(d) for d in t.shape if d is not None)
        count = int(np.prod(shape, dtype=np.int64))
        raw = np.frombuffer(self._bytes(data_offset, size), dtype=np.uint8)
        if t.dtype in SUB_BYTE:
            nbits, signed = SUB_BYTE[t.dtype]
            if size != (count * nbits + 7) // 8:
                raise ChunkforgeError(
                    f"{self.path}: {what}: blob at {offset} has {size} bytes, {shape} {t.dtype} needs "
                    f"{(count * nbits + 7) // 8}"
                )
            if packed:
                return raw
            return unpack_bits(np.asarray(raw), nbits, signed, count).reshape(shape)
        np_type = np.uint16 if t.dtype == "bf16" else NUMPY.get(t.dtype)
        if np_type is None:
            raise ChunkforgeError(f"{self.path}: {what}: cannot read {t.dtype} weights")
        want = count * np.dtype(np_type).itemsize
        if size != want:
            raise ChunkforgeError(
                f"{self.path}: {what}: blob at {offset} has {size} bytes, {shape} {t.dtype} needs {want}"
            )
        array = np.frombuffer(raw, dtype=np.dtype(np_type).newbyteorder("<"), count=count).reshape(shape)
        return bf16_to_fp32(array) if t.dtype == "bf16" else array


def parse_spec(package: str, rel: str, raw: bytes) -> Any:
    """The Core ML spec in the bytes ``raw`` of ``package``'s file ``rel``.
    protobuf's own error names neither the package nor the file, and an
    empty file parses as a model of no type: both are said here."""
    from coremltools.proto import Model_pb2
    from google.protobuf.message import DecodeError

    if not raw:
        raise ChunkforgeError(f"{package}: {rel} is empty (0 bytes): the package has no model spec")
    spec = Model_pb2.Model()
    try:
        spec.ParseFromString(raw)
    except DecodeError as e:
        raise ChunkforgeError(
            f"{package}: {rel} ({len(raw)} bytes) is truncated or corrupt, not a Core ML model spec ({e})"
        ) from e
    return spec


def read_model_spec(path: str) -> tuple[Any, str]:
    """The spec of the package ``path`` and the file it came from (the root
    item its Manifest.json names), read without loading the model (works on
    Linux; coremltools' MLModel(path) would also rewrite Manifest.json, and a
    release must stay untouched). Every error names the package, and the
    file when the file is at fault. A compiled model (``.mlmodelc`` with a
    text ``model.mil``) is read as the same spec: its description from
    ``coremldata.bin``, its program parsed from ``model.mil`` (`modelc.read_compiled`)."""
    if os.path.isfile(os.path.join(path, "model.mil")) and os.path.isfile(os.path.join(path, "coremldata.bin")):
        from .modelc import read_compiled

        return read_compiled(path)
    if not os.path.isdir(path):
        raise ChunkforgeError(f"{path}: not an .mlpackage folder")
    try:
        with open(os.path.join(path, "Manifest.json")) as f:
            manifest = json.load(f)
        item = manifest["itemInfoEntries"][manifest["rootModelIdentifier"]]["path"]
        rel = os.path.join("Data", inside_package(path, item))
        with open(os.path.join(path, rel), "rb") as f:
            raw = f.read()
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise ChunkforgeError(f"{path}: not a readable .mlpackage ({e})") from e
    return parse_spec(path, rel, raw), os.path.join(path, rel)


def inside_package(package: str, item: Any) -> str:
    """``item``, a path Manifest.json states below the package's ``Data/``,
    if it stays there: relative, every component plain (no ``..``, ``.``,
    empty, backslash or control character), reached through no symlink.
    Anything else would read a file outside the package."""
    if not isinstance(item, str) or not item or item.startswith("/"):
        raise ChunkforgeError(
            f"{package}: Manifest.json names the item {item!r}, which leaves the package's Data/ folder"
        )
    for part in item.split("/"):
        if part in ("", ".", "..") or "\\" in part or any(ord(c) < 32 or ord(c) == 127 for c in part):
            raise ChunkforgeError(
                f"{package}: Manifest.json names the item {item!r}, which leaves the package's Data/ folder"
            )
    at = os.path.join(package, "Data")
    for part in item.split("/"):
        at = os.path.join(at, part)
        if os.path.islink(at):
            raise ChunkforgeError(f"{at}: a symlink; a package is read only from its own files")
    if os.path.islink(os.path.join(package, "Data")):
        raise ChunkforgeError(f"{os.path.join(package, 'Data')}: a symlink; a package is read only from its own files")
    return item


class MLPackage:
    """A saved .mlpackage: its spec, its ML program and its weight files,
    read without loading the model. Every function of a chunkforge
    multifunction package reads the same weight blob. ``weights_dir``: the
    folder of the blob it reads when that is not its own (a release holds a
    blob the app's downloader shares between packages once)."""

    def __init__(self, path: str, weights_dir: str | None = None):
        self.path = path
        self.spec, model_file = read_model_spec(path)
        self.model_file = model_file
        if self.spec.WhichOneof("Type") != "mlProgram":
            raise ChunkforgeError(f"{path}: a {self.spec.WhichOneof('Type')} model, not an ML program")
        self.program = self.spec.mlProgram
        if not self.program.functions:
            raise ChunkforgeError(f"{path}: the ML program has no functions")
        self.weights_dir = weights_dir or os.path.join(os.path.dirname(model_file), "weights")
        names = list(self.program.functions)
        self.default_function: str = self.spec.description.defaultFunctionName or (
            "main" if "main" in names else names[0]
        )
        self._blobs: dict[str, BlobFile] = {}

    @property
    def function_names(self) -> list[str]:
        return list(self.program.functions)

    def function(self, name: str) -> Any:
        """One function's protobuf, or an error listing the package's functions."""
        if name not in self.program.functions:
            raise ChunkforgeError(
                f"{self.path}: no function {name} (it has {', '.join(sorted(self.program.functions))})"
            )
        return self.program.functions[name]

    def block(self, name: str) -> Any:
        """The main block of a function (the specialization for its opset)."""
        f = self.function(name)
        blocks = f.block_specializations
        if f.opset in blocks:
            return blocks[f.opset]
        if len(blocks) == 1:
            return next(iter(blocks.values()))
        raise ChunkforgeError(f"{self.path}: function {name} has no block for its opset {f.opset}")

    def blob(self, file_name: str, what: str) -> BlobFile:
        """The weight file a ``blobFileValue`` names (``@model_path/weights/...``)."""
        prefix = "@model_path/weights/"
        base = file_name.removeprefix(prefix)
        if not file_name.startswith(prefix) or not base or "/" in base or base in (".", ".."):
            raise ChunkforgeError(f"{self.path}: {what}: weight file {file_name!r} is not in the package's weights/")
        if base not in self._blobs:
            self._blobs[base] = BlobFile(os.path.join(self.weights_dir, base))
        return self._blobs[base]

    def packed(self, v: Any, what: str) -> np.ndarray | None:
        """The bytes of a sub-byte weight ``v`` as its weight file stores
        them (flat uint8, least significant bits first), or None if ``v`` is
        not a sub-byte blob."""
        t = tensor_type(v.type, what)
        if v.WhichOneof("value") != "blobFileValue" or t.dtype not in SUB_BYTE:
            return None
        return self.blob(v.blobFileValue.fileName, what).read(int(v.blobFileValue.offset), t, what, packed=True)

    def value(self, v: Any, what: str) -> np.ndarray | str:
        """A MIL_pb2.Value: a numpy array of its type and shape (weights as
        read-only views of the weight file), or a string."""
        t = tensor_type(v.type, what)
        kind = v.WhichOneof("value")
        if kind == "blobFileValue":
            return self.blob(v.blobFileValue.fileName, what).read(int(v.blobFileValue.offset), t, what)
        if kind != "immediateValue":
            raise ChunkforgeError(f"{what}: a value with no data")
        imm = v.immediateValue
        if imm.WhichOneof("value") != "tensor":
            raise ChunkforgeError(f"{what}: a {imm.WhichOneof('value')} immediate value")
        return immediate(imm.tensor, t, what)


def immediate(tv: Any, t: TensorType, what: str) -> np.ndarray | str:
    """A MIL_pb2.TensorValue held in the program itself."""
    if any(d is None for d in t.shape):
        raise ChunkforgeError(f"{what}: a constant of unknown shape {t.shape}")
    shape = tuple(int(d) for d in t.shape if d is not None)
    count = int(np.prod(shape, dtype=np.int64))
    field = tv.WhichOneof("value")
    if t.dtype == "string":
        values = list(tv.strings.values)
        if shape == () and len(values) == 1:
            return str(values[0])
        raise ChunkforgeError(f"{what}: string tensors are not supported")
    if field == "bytes":
        raw = np.frombuffer(tv.bytes.values, dtype=np.uint8)
        if t.dtype in SUB_BYTE:
            nbits, signed = SUB_BYTE[t.dtype]
            return unpack_bits(raw, nbits, signed, count).reshape(shape)
        if t.dtype == "bf16":
            return bf16_to_fp32(raw.view("<u2")).reshape(shape)
        np_type = NUMPY.get(t.dtype)
        if np_type is None:
            raise ChunkforgeError(f"{what}: cannot read {t.dtype} bytes")
        return raw.view(np.dtype(np_type).newbyteorder("<")).reshape(shape)
    if field is None:
        raise ChunkforgeError(f"{what}: an empty tensor value")
    values = list(getattr(tv, field).values)
    np_type = NUMPY.get(t.dtype)
    if np_type is None:
        raise ChunkforgeError(f"{what}: cannot read {t.dtype} {field}")
    array = np.array(values, dtype=np_type)
    if array.size != count:
        raise ChunkforgeError(f"{what}: {array.size} values for shape {shape}")
    return array.reshape(shape)
