"""chunkforge_py.mil.write and `convert.combine`: bundles written at the
protobuf level, weights copied and not loaded, must be the packages coremltools'
``save_multifunction`` writes, byte for byte.

The parts are the shared `build --mode all`'s own functions (tests/common
built_all(), or CHUNKFORGE_TEST_BUILD; skipped without one), each split back
into the single-function package a conversion writes: the build bundled them,
so bundling them again with either writer must give the build's packages. The
composed packages' counterpart is in test_compose.py
(`test_the_writer_writes_the_bytes_coremltools_writes`).
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from chunkforge_py.convert.chunks import combine
from chunkforge_py.mil.write import SPEC_REL, WEIGHTS_REL, op_counts, read_spec, write_package
from chunkforge_py.runtime import ChunkforgeError
from test_mil_interp import shared_build


@pytest.fixture(scope="module")
def build() -> dict[str, Any]:
    """`build --mode all` (INT4): tests/common built_all()."""
    return shared_build("CHUNKFORGE_TEST_BUILD", "default-all")


def tree(path: Path) -> dict[str, bytes]:
    """Every file of a package by its path inside it."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def split(package: Path, function: str, out: Path) -> tuple[str, str]:
    """``function`` of ``package`` as a single-function package ``out``
    (function ``main``, described at the top level, as `ct.convert` writes
    one), reading the package's whole weight file."""
    shutil.copytree(package, out)
    spec = read_spec(str(package))
    fn = spec.mlProgram.functions[function]
    desc = next(d for d in spec.description.functions if d.name == function)
    part = type(spec)()
    part.specificationVersion = spec.specificationVersion
    part.mlProgram.version = spec.mlProgram.version
    part.mlProgram.functions["main"].CopyFrom(fn)
    part.description.input.extend(desc.input)
    part.description.output.extend(desc.output)
    (out / SPEC_REL).write_bytes(part.SerializeToString(deterministic=True))
    return str(out), function


def bundle_parts(build: dict[str, Any], n: int, out: Path) -> tuple[list[tuple[str, str]], list[tuple[str, list[str]]]]:
    """The parts of ``chunk{n}`` and ``prefill_chunk{n}`` and their targets, as the build bundles them."""
    chunks = {c["name"]: c for lay in build["plan"]["layouts"] for c in lay["chunks"]}
    decode, prefill = chunks[f"chunk{n}"], chunks[f"prefill_chunk{n}"]
    parts = []
    for chunk in (decode, prefill):
        for f in chunk["functions"]:
            parts.append(split(build["dir"] / f"{chunk['name']}.mlpackage", f["name"], out / f"{f['name']}-{n}"))
    targets = [(str(out / f"{c['name']}.mlpackage"), [f["name"] for f in c["functions"]]) for c in (decode, prefill)]
    return parts, targets


@pytest.mark.parametrize("n", [1, 4])
def test_bundles_are_the_bytes_save_multifunction_writes(build: dict[str, Any], tmp_path: Path, n: int) -> None:
    parts, targets = bundle_parts(build, n, tmp_path / "parts")
    outputs = {}
    for writer in ("chunkforge", "coremltools"):
        out = tmp_path / writer
        out.mkdir()
        mine = [(str(out / Path(p).name), fs) for p, fs in targets]
        stats = combine(parts, mine, writer=writer)
        outputs[writer] = {Path(p).name: tree(Path(p)) for p, _ in mine}
        assert stats["weight_bytes"] == os.path.getsize(Path(mine[0][0]) / WEIGHTS_REL)
    assert outputs["chunkforge"] == outputs["coremltools"]
    # And both are the build's own packages: one weight file, shared byte for
    # byte by the decode/verify package and the prefill package.
    for name, files in outputs["chunkforge"].items():
        assert files == tree(build["dir"] / name), name
    decode, prefill = (outputs["chunkforge"][Path(p).name] for p, _ in targets)
    assert decode[WEIGHTS_REL] == prefill[WEIGHTS_REL]


def test_op_counts_count_inline_values_as_coremltools_loads_them(build: dict[str, Any]) -> None:
    """`op_counts` (composed packages' stats) against build.json's counts of
    the same package, which come from coremltools' loaded program."""
    import json

    record = json.loads((build["dir"] / "build.json").read_text())
    composed = [c for c in record["chunks"] if c.get("composed_from")]
    assert composed
    for c in composed:
        spec = read_spec(str(build["dir"] / c["package"]))
        main = spec.mlProgram.functions["main"]
        counts = op_counts(main.block_specializations[main.opset])
        assert counts == c["op_counts"], c["package"]
        assert sum(counts.values()) == c["mil_ops"]


def weight_of(spec: Any) -> Any:
    """The first ``blobFileValue`` of the spec's main function."""
    main = spec.mlProgram.functions["main"]
    for op in main.block_specializations[main.opset].operations:
        for v in op.attributes.values():
            if v.WhichOneof("value") == "blobFileValue":
                return v.blobFileValue
    raise AssertionError("no weight")


def test_bad_weight_references_name_the_file(build: dict[str, Any], tmp_path: Path) -> None:
    (part, _), *_ = bundle_parts(build, 1, tmp_path / "parts")[0]
    weights = str(Path(part) / WEIGHTS_REL)

    def write(name: str, edit: Any, sources: dict[str, str]) -> None:
        spec = read_spec(part)
        edit(weight_of(spec))
        write_package(spec, str(tmp_path / name), sources)

    ok = {"@model_path/weights/weight.bin": weights}
    with pytest.raises(ChunkforgeError, match=r"reads weight file '@model_path/weights/other.bin', which no source"):
        write("a.mlpackage", lambda bf: setattr(bf, "fileName", "@model_path/weights/other.bin"), ok)
    with pytest.raises(ChunkforgeError, match=rf"{weights}: blob offset 999999999 is outside the file"):
        write("b.mlpackage", lambda bf: setattr(bf, "offset", 999999999), ok)
    with pytest.raises(ChunkforgeError, match=rf"{weights}: no blob metadata at offset 96"):
        write("c.mlpackage", lambda bf: setattr(bf, "offset", 96), ok)
    # Cut inside the data of the first blob the program reads.
    data = Path(weights).read_bytes()
    first = weight_of(read_spec(part)).offset
    size, data_offset = struct.unpack_from("<QQ", data, first + 8)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(data[: data_offset + size - 1])
    with pytest.raises(ChunkforgeError, match=rf"truncated.bin: the blob at {first} runs past the end of the file"):
        spec = read_spec(part)
        write_package(spec, str(tmp_path / "d.mlpackage"), {"@model_path/weights/weight.bin": str(truncated)})
    version = tmp_path / "version.bin"
    version.write_bytes(data[:4] + struct.pack("<I", 3) + data[8:])
    with pytest.raises(ChunkforgeError, match=r"version.bin: blob storage version 3, not 2"):
        write("e.mlpackage", lambda bf: None, {"@model_path/weights/weight.bin": str(version)})
