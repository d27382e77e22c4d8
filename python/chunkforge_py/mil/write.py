"""Write an ML program package straight from its protobuf: the spec, one
weight blob file and the manifest, without coremltools' object model.

A bundle (several converted functions in one package) and a composition (the
ops of several converted programs spliced into one) are programs whose every
op was already converted, optimised and serialised by coremltools. Loading
them back into coremltools' MIL objects, only to serialise them again, reads
every weight into memory and rebuilds the protobuf op by op. `write_package`
copies what the program references instead:

- every ``blobFileValue`` of the spec names a source weight file (a key of
  ``sources``) and the offset of a blob's metadata record in it (format:
  `mil_program`);
- each referenced blob is copied once, in the order the program first reads
  it (functions in ``functions`` order, ops in block order), and blobs of the
  same type and bytes are stored once, as coremltools' ``save_multifunction``
  stores a weight several functions hold;
- the references are pointed at ``@model_path/weights/weight.bin`` and the
  new offsets, and the spec is written with protobuf's deterministic
  serialisation beside a manifest with path-derived identifiers
  (`convert.normalize_manifest`).

Everything is written under ``path``, which must not exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from ..runtime import ChunkforgeError
from .program import BLOB_HEADER, BLOB_METADATA, BLOB_SENTINEL, parse_spec

SPEC_REL = os.path.join("Data", "com.apple.CoreML", "model.mlmodel")
WEIGHTS_REL = os.path.join("Data", "com.apple.CoreML", "weights", "weight.bin")
WEIGHT_FILE = "@model_path/weights/weight.bin"
# MIL blob storage: version 2, each record and its data aligned to 64 bytes.
STORAGE_VERSION = 2
ALIGN = 64
# What coremltools writes into a package's manifest, by item path.
MANIFEST_ITEMS = {
    "com.apple.CoreML/model.mlmodel": ("model.mlmodel", "CoreML Model Specification"),
    "com.apple.CoreML/weights": ("weights", "CoreML Model Weights"),
}


def manifest_id(item_path: str) -> str:
    """The identifier `convert.normalize_manifest` gives a package item."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "chunkforge:" + item_path))


def read_spec(path: str) -> Any:
    """The protobuf spec of the ML program package ``path``."""
    try:
        with open(os.path.join(path, SPEC_REL), "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ChunkforgeError(f"{path}: not a readable .mlpackage ({e})") from e
    spec = parse_spec(path, SPEC_REL, raw)
    if spec.WhichOneof("Type") != "mlProgram":
        raise ChunkforgeError(f"{path}: not an ML program")
    return spec


def write_manifest(path: str) -> None:
    """``path``/Manifest.json, in the layout coremltools writes (keys sorted,
    four-space indent) with path-derived identifiers."""
    entries = {
        manifest_id(item): {"author": "com.apple.CoreML", "description": desc, "name": name, "path": item}
        for item, (name, desc) in MANIFEST_ITEMS.items()
    }
    manifest = {
        "fileFormatVersion": "1.0.0",
        "itemInfoEntries": dict(sorted(entries.items())),
        "rootModelIdentifier": manifest_id("com.apple.CoreML/model.mlmodel"),
    }
    with open(os.path.join(path, "Manifest.json"), "w") as f:
        json.dump(manifest, f, indent=4, sort_keys=True)
        f.write("\n")


def op_values(op: Any) -> Iterator[Any]:
    """Every value proto ``op`` holds, in serialisation order: its attributes
    (by key), inline input values (by parameter), then its nested blocks' ops'."""
    for key in sorted(op.attributes):
        yield op.attributes[key]
    for param in sorted(op.inputs):
        for b in op.inputs[param].arguments:
            if b.WhichOneof("binding") == "value":
                yield b.value
    for block in op.blocks:
        for inner in block.operations:
            yield from op_values(inner)


def blob_values(spec: Any, functions: Sequence[str]) -> Iterator[Any]:
    """Every ``blobFileValue`` value of ``functions`` (every block
    specialisation), in program order."""
    for name in functions:
        fn = spec.mlProgram.functions[name]
        for opset in [fn.opset, *sorted(k for k in fn.block_specializations if k != fn.opset)]:
            if opset not in fn.block_specializations:
                continue
            for op in fn.block_specializations[opset].operations:
                for v in op_values(op):
                    if v.WhichOneof("value") == "blobFileValue":
                        yield v


def op_counts(block: Any) -> dict[str, int]:
    """How many ops of each type ``block`` holds (top level), counted as
    coremltools' loader makes them: each value bound inline to an op's input
    is a ``const`` op of its own there."""
    counts: dict[str, int] = {}
    for op in block.operations:
        counts[op.type] = counts.get(op.type, 0) + 1
        inline = sum(1 for a in op.inputs.values() for b in a.arguments if b.WhichOneof("binding") == "value")
        if inline:
            counts["const"] = counts.get("const", 0) + inline
    return dict(sorted(counts.items()))


class Source:
    """One source weight file, memory-mapped."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.data = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)
        except (OSError, ValueError) as e:
            raise ChunkforgeError(f"{path}: cannot read the weight file ({e})") from e
        if self.data.size < BLOB_HEADER:
            raise ChunkforgeError(f"{path}: {self.data.size} bytes, shorter than the blob storage header")
        version = struct.unpack_from("<I", bytes(self.data[4:8]))[0]
        if version != STORAGE_VERSION:
            raise ChunkforgeError(f"{path}: blob storage version {version}, not {STORAGE_VERSION}")

    def blob(self, offset: int) -> tuple[bytes, memoryview]:
        """The metadata record at ``offset`` and its data."""
        if offset < BLOB_HEADER or offset + BLOB_METADATA > self.data.size:
            raise ChunkforgeError(f"{self.path}: blob offset {offset} is outside the file")
        record = bytes(self.data[offset : offset + BLOB_METADATA])
        sentinel, _, size, data_offset = struct.unpack_from("<IIQQ", record)
        if sentinel != BLOB_SENTINEL:
            raise ChunkforgeError(f"{self.path}: no blob metadata at offset {offset}")
        if data_offset < offset + BLOB_METADATA or data_offset + size > self.data.size:
            raise ChunkforgeError(f"{self.path}: the blob at {offset} runs past the end of the file")
        return record, self.data[data_offset : data_offset + size].data


class _Storage:
    """The weight file being written: blobs appended once each."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.count = 0
        self.end = BLOB_HEADER
        self.by_content: dict[tuple[int, int, bytes], int] = {}
        f.write(b"\0" * BLOB_HEADER)

    def add(self, record: bytes, data: memoryview) -> int:
        """The offset of the blob ``record`` describes, holding ``data``
        (appended unless the same type and bytes are stored already)."""
        blob_type = struct.unpack_from("<I", record, 4)[0]
        key = (blob_type, len(data), hashlib.blake2b(data, digest_size=32).digest())
        if key in self.by_content:
            return self.by_content[key]
        offset = self.end
        data_offset = offset + BLOB_METADATA
        self.f.write(record[:16] + struct.pack("<Q", data_offset) + record[24:])
        self.f.write(data)
        end = data_offset + len(data)
        padded = -(-end // ALIGN) * ALIGN
        self.f.write(b"\0" * (padded - end))
        self.end = padded
        self.count += 1
        self.by_content[key] = offset
        return offset

    def finish(self) -> None:
        self.f.seek(0)
        self.f.write(struct.pack("<II", self.count, STORAGE_VERSION))


def write_package(spec: Any, path: str, sources: Mapping[str, str], functions: Sequence[str] | None = None) -> None:
    """Write ``spec`` (an ML program ``Model``) as the package ``path``, its
    weights copied from ``sources`` (each ``blobFileValue.fileName`` the spec
    uses -> that weight file's path) into one weight file; ``functions``: the
    order blobs are laid out in (default: the description's functions, else
    the program's). ``spec``'s blob references are rewritten in place."""
    if functions is None:
        functions = [f.name for f in spec.description.functions] or list(spec.mlProgram.functions)
    missing = set(spec.mlProgram.functions) - set(functions)
    if missing:
        raise ChunkforgeError(f"{path}: functions {sorted(missing)} have no place in the weight layout")
    os.makedirs(os.path.dirname(os.path.join(path, WEIGHTS_REL)))
    opened: dict[str, Source] = {}
    # Offsets already copied, by (source file, offset); a file is known by its
    # inode, so the hard links of one weight file (`joint.split`) are one file.
    moved: dict[tuple[int, int, int], int] = {}
    inodes: dict[str, tuple[int, int]] = {}
    weights_path = os.path.join(path, WEIGHTS_REL)
    with open(weights_path, "wb") as f:
        storage = _Storage(f)
        for v in blob_values(spec, functions):
            bf = v.blobFileValue
            if bf.fileName not in sources:
                raise ChunkforgeError(f"{path}: the program reads weight file {bf.fileName!r}, which no source has")
            file = sources[bf.fileName]
            if file not in opened:
                opened[file] = Source(file)
                st = os.stat(file)
                inodes[file] = (st.st_dev, st.st_ino)
            where = (*inodes[file], int(bf.offset))
            if where not in moved:
                moved[where] = storage.add(*opened[file].blob(int(bf.offset)))
            bf.fileName = WEIGHT_FILE
            bf.offset = moved[where]
        storage.finish()
    opened.clear()
    with open(os.path.join(path, SPEC_REL), "wb") as f:
        f.write(spec.SerializeToString(deterministic=True))
    write_manifest(path)
