"""The compiled models chunkforge writes (`mil.modelc`, `mil.text`), held to
Apple's compiler and to the packages they come from.

- Apple: the ``mlmodelc-export`` crate (0.1.0, crates.io) publishes
  ``input.mlmodel`` files with the ``.mlmodelc`` Apple's ``coremlc``
  (3520.5.1, 3600.25.1) made of them. ``tests/apple-fixtures/Cargo.toml``
  names it; ``cargo metadata --locked`` downloads it (checked against
  Cargo.lock) and says where. Each ML program is fed through the writer
  ``compile`` uses: ``model.mil`` byte for byte (but the compiler's version
  strings in ``buildInfo``), ``coremldata.bin`` and
  ``analytics/coremldata.bin`` byte for byte, ``metadata.json`` as JSON; a
  pipeline's sub-models (``model0``, ``model1``) the same, minus
  ``metadata.json``, which a sub-model has none of.
- The packages: every package of the shared build (``CHUNKFORGE_TEST_BUILD``,
  ``build --mode all`` of the default checkpoint, INT4) compiled, its
  ``model.mil`` read back equal to the package's program, and every function
  run by the interpreter from the ``.mlmodelc`` with bits equal to the
  ``.mlpackage``'s.
- Refusals: an op the writer does not know in text form is an error naming
  package, function and op.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from chunkforge_py.mil import modelc, text
from chunkforge_py.mil.interp import Function, Interpreter
from chunkforge_py.mil.program import MLPackage, read_model_spec
from chunkforge_py.runtime import ChunkforgeError

REPO = Path(__file__).resolve().parents[2]
FILES = ["model.mil", "coremldata.bin", "metadata.json", "analytics/coremldata.bin"]


def apple_crate() -> Path:
    """The downloaded package of mlmodelc-export (its manifest's folder)."""
    out = subprocess.run(
        [
            "cargo",
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--manifest-path",
            str(REPO / "tests" / "apple-fixtures" / "Cargo.toml"),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pkg = next(p for p in json.loads(out)["packages"] if p["name"] == "mlmodelc-export")
    return Path(pkg["manifest_path"]).parent


def written(files: dict[str, bytes], folder: Path) -> Path:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def test_every_apple_compiled_fixture_is_matched(tmp_path: Path) -> None:
    crate = apple_crate()
    single = sorted((crate / "tests" / "fixtures").glob("*/expected-macos.mlmodelc"))
    pipelines = sorted((crate / "tests" / "pipeline-fixtures").glob("*/expected.mlmodelc"))
    assert len(single) == 7 and len(pipelines) == 8, (single, pipelines)
    matched = 0
    for expected in single:
        name = expected.parent.name
        raw = (expected.parent / "input.mlmodel").read_bytes()
        ours = written(modelc.compiled_files(raw, name, "input"), tmp_path / name)
        assert modelc.compare_dirs(str(ours), str(expected), FILES) is None, name
        matched += 1
    for expected in pipelines:
        name = expected.parent.name
        raw = (expected.parent / "input.mlmodel").read_bytes()
        pipeline = next(v for n, _, v in modelc.raw_fields(raw) if n == 202)
        assert isinstance(pipeline, bytes)
        children = [v for n, _, v in modelc.raw_fields(pipeline) if n == 1]
        assert children, name
        for i, child in enumerate(children):
            assert isinstance(child, bytes)
            files = modelc.compiled_files(child, f"{name}/model{i}", "input", top_level=False)
            ours = written(files, tmp_path / f"{name}-{i}")
            theirs = expected / f"model{i}"
            diff = modelc.compare_dirs(
                str(ours), str(theirs), ["model.mil", "coremldata.bin", "analytics/coremldata.bin"]
            )
            assert diff is None, f"{name}/model{i}: {diff}"
            matched += 1
    assert matched == 7 + 15


def test_a_different_byte_is_named(tmp_path: Path) -> None:
    """The comparison can fail: one changed constant and one changed
    description byte are each reported with the file and where."""
    expected = apple_crate() / "tests" / "fixtures" / "fp16-subnormal-cast" / "expected-macos.mlmodelc"
    raw = (expected.parent / "input.mlmodel").read_bytes()
    ours = written(modelc.compiled_files(raw, "x", "input"), tmp_path / "x")
    mil = (ours / "model.mil").read_text().replace("0x1p-24", "0x1p-23")
    (ours / "model.mil").write_text(mil)
    assert "model.mil line 5" in str(modelc.compare_dirs(str(ours), str(expected), FILES))
    (ours / "model.mil").write_bytes((expected / "model.mil").read_bytes())
    data = bytearray((ours / "coremldata.bin").read_bytes())
    data[100] ^= 1
    (ours / "coremldata.bin").write_bytes(bytes(data))
    assert "coremldata.bin: first differing byte at offset 100" in str(
        modelc.compare_dirs(str(ours), str(expected), FILES)
    )


def shared_build() -> Path:
    build = os.environ.get("CHUNKFORGE_TEST_BUILD")
    if not build:
        default = REPO / "target" / "tmp" / "builds"
        found = sorted(default.glob("gen*/default-all"))
        if not found:
            pytest.skip("no shared build (run the Rust tests first, or set CHUNKFORGE_TEST_BUILD)")
        return found[-1]
    return Path(build)


def compile_into(package: Path, out: Path) -> Path:
    """``package`` compiled the way `compile` does on Linux: the four files
    from the spec, the blob linked."""
    modelc.write_compiled(str(package), str(out), package.stem)
    blob = package / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    (out / "weights").mkdir()
    os.link(blob, out / "weights" / "weight.bin")
    return out


def inputs_of(fn: Function, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for io in fn.inputs:
        if io.dtype == "int32":
            out[io.name] = rng.integers(0, 8, size=io.shape, dtype=np.int32)
        else:
            out[io.name] = (rng.standard_normal(io.shape) * 0.5).astype(np.float16)
    return out


def test_every_package_round_trips_and_runs_the_same_bits(tmp_path: Path) -> None:
    build = shared_build()
    packages = sorted(build.glob("*.mlpackage"))
    assert len(packages) >= 13, packages
    functions = 0
    for package in packages:
        compiled = compile_into(package, tmp_path / f"{package.stem}.mlmodelc")
        text_mil = (compiled / "model.mil").read_text()
        assert text_mil.startswith("program(1.3)\n")
        source, _ = read_model_spec(str(package))
        back, _ = read_model_spec(str(compiled))
        assert text.first_difference(source.mlProgram, back.mlProgram, package.name) is None
        # Apple's compiler records an empty metadata field where the package has none.
        source.description.metadata.SetInParent()
        assert back.description == source.description
        a, b = Interpreter(str(package)), Interpreter(str(compiled))
        assert sorted(a.functions) == sorted(b.functions)
        for name in a.functions:
            fa, fb = a.function(name), b.function(name)
            feed = inputs_of(fa, functions)
            # In fp16, as on the device (each op rounded to its fp16 type).
            ra, rb = fa.run(feed, fp16=True), fb.run(feed, fp16=True)
            assert list(ra) == list(rb)
            for k in ra:
                x, y = np.asarray(ra[k]), np.asarray(rb[k])
                assert x.dtype == y.dtype and x.shape == y.shape, (package.name, name, k)
                assert x.tobytes() == y.tobytes(), (package.name, name, k)
            functions += 1
    assert functions >= 17


def test_what_the_text_cannot_hold_is_refused_by_name(tmp_path: Path) -> None:
    build = shared_build()
    pkg = MLPackage(str(build / "chunk1.mlpackage"))
    program = pkg.program
    block = program.functions["decode_q1"].block_specializations[program.functions["decode_q1"].opset]
    # An op with a nested block (control flow): no text form written here.
    op = next(o for o in block.operations if o.type == "add")
    label = text.op_label(op)
    op.blocks.add()
    with pytest.raises(text.UnsupportedMil, match=rf"chunk1: function decode_q1: op {label}: an op with nested blocks"):
        text.emit(program, "chunk1")
    del op.blocks[:]
    # A data type the text form does not cover.
    op.outputs[0].type.tensorType.dataType = 13  # bf16
    with pytest.raises(text.UnsupportedMil, match=rf"function decode_q1: op {label}: data type bf16"):
        text.emit(program, "chunk1")
    op.outputs[0].type.tensorType.dataType = 10
    # An op type nothing here has run or seen compiled.
    op.type = "frobnicate"
    with pytest.raises(text.UnsupportedMil, match=r"function decode_q1: op frobnicate .*: op type 'frobnicate'"):
        text.emit(program, "chunk1", known_ops=modelc.known_ops())
    op.type = "add"
    # A state input.
    fn = program.functions["decode_q1"]
    fn.inputs[0].type.stateType.wrappedType.tensorType.dataType = 10
    with pytest.raises(text.UnsupportedMil, match="function decode_q1: a stateType type"):
        text.emit(program, "chunk1")
    assert isinstance(text.UnsupportedMil("x"), ChunkforgeError)


def test_a_compiled_model_reads_back_through_every_reader(tmp_path: Path) -> None:
    """`inspect`'s reader and the interpreter take a `.mlmodelc` where they
    took an `.mlpackage`; a binary model.mil is refused naming the file."""
    build = shared_build()
    compiled = compile_into(build / "prefill_chunk1.mlpackage", tmp_path / "prefill_chunk1.mlmodelc")
    from chunkforge_py.mil.inspect import read_package

    spec, prog, default = read_package(str(compiled))
    assert prog is not None and default == spec.description.defaultFunctionName
    broken = tmp_path / "broken.mlmodelc"
    shutil.copytree(compiled, broken)
    (broken / "model.mil").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ChunkforgeError, match="not text MIL"):
        read_model_spec(str(broken))
