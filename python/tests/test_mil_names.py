"""chunkforge_py.mil.names: canonical variable and op names.

A small program is built twice with coremltools' builder, the same ops under
other names, and saved without graph passes; canonicalised, the two are the
same bytes, keep the contract's and the weights' names, compute what they
computed before, and canonicalising again changes nothing. The weights keep
their names only if every parameter of the chunk module is one `is_weight`
recognises: checked on the plan of the built-in checkpoint's ``merged_full``
(every kind of parameter there is).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import coremltools as ct
import numpy as np
import pytest
from chunkforge_py.mil import names as mil_names
from chunkforge_py.mil import write as mil_write
from chunkforge_py.mil.audit import anchor
from chunkforge_py.mil.interp import Interpreter
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "chunkforge"
WEIGHT = "layers_3_mlp_up_proj_weight_to_fp16"
CANONICAL = re.compile(r"^[a-z_]+_\d+(_\d+)?$")


def package(tmp_path: Path, tag: str, names: list[str]) -> Path:
    """``out = relu(x @ W + 1)`` (and a split of it into ``a``, ``b``), its
    intermediate variables and ops named ``names``."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 10

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3), dtype=types.fp32)], opset_version=ct.target.iOS18)
    def prog(x: Any) -> Any:
        weight = mb.const(val=w, name=WEIGHT)
        y = mb.matmul(x=x, y=weight, name=names[0])
        y = mb.add(x=y, y=np.float32(1.0), name=names[1])
        out = mb.relu(x=y, name="out")
        a, b = mb.split(x=out, num_splits=2, axis=1, name=names[2])
        return out, mb.identity(x=a, name="a"), mb.identity(x=b, name="b")

    model = ct.convert(
        prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18, pass_pipeline=ct.PassPipeline.EMPTY
    )
    path = tmp_path / f"{tag}.mlpackage"
    model.save(str(path))
    return path


def canonical_copy(path: Path) -> tuple[Any, Path]:
    """The canonical spec of ``path`` and a copy of the package holding it."""
    import shutil

    spec = mil_write.read_spec(str(path))
    mil_names.canonicalize(spec)
    out = path.with_name(path.stem + "-canonical.mlpackage")
    shutil.copytree(path, out)
    (out / mil_write.SPEC_REL).write_bytes(spec.SerializeToString(deterministic=True))
    return spec, out


def names_of(spec: Any) -> tuple[list[str], list[str]]:
    """Every variable an op defines, and every op name, of the spec's main function."""
    fn = spec.mlProgram.functions["main"]
    ops = list(mil_names.ops_in_order(fn.block_specializations[fn.opset]))
    return (
        [o.name for op in ops for o in op.outputs],
        [op.attributes["name"].immediateValue.tensor.strings.values[0] for op in ops],
    )


def test_the_same_ops_under_other_names_are_the_same_bytes(tmp_path: Path) -> None:
    one = package(tmp_path, "one", ["h_15_cast", "var_428", "var_430"])
    two = package(tmp_path, "two", ["h_1_cast", "var_1036", "split_7"])
    assert (one / mil_write.SPEC_REL).read_bytes() != (two / mil_write.SPEC_REL).read_bytes()
    a, pa = canonical_copy(one)
    b, pb = canonical_copy(two)
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    # The same computation as before.
    x = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    before, after = Interpreter(str(one)).function().run({"x": x}), Interpreter(str(pa)).function().run({"x": x})
    assert sorted(before) == sorted(after) == ["a", "b", "out"]
    for k, v in before.items():
        assert np.array_equal(after[k], v), k
    # Again: nothing changes.
    again = type(a)()
    again.CopyFrom(a)
    mil_names.canonicalize(again)
    assert again.SerializeToString(deterministic=True) == a.SerializeToString(deterministic=True)


def test_contract_and_weight_names_stay_every_other_name_says_where_its_op_sits(tmp_path: Path) -> None:
    spec, _ = canonical_copy(package(tmp_path, "p", ["h_15_cast", "var_428", "var_430"]))
    fn = spec.mlProgram.functions["main"]
    block = fn.block_specializations[fn.opset]
    assert [i.name for i in fn.inputs] == ["x"]
    assert list(block.outputs) == ["out", "a", "b"]
    variables, ops = names_of(spec)
    kept = {"x", "out", "a", "b", WEIGHT}
    assert WEIGHT in variables and WEIGHT in ops
    types_in_order = [op.type for op in mil_names.ops_in_order(block)]
    for k, op in enumerate(mil_names.ops_in_order(block)):
        outs = [o.name for o in op.outputs]
        if set(outs) & kept:
            continue
        want = [f"{op.type}_{k}"] if len(outs) == 1 else [f"{op.type}_{k}_{j}" for j in range(len(outs))]
        assert outs == want, (k, types_in_order)
        assert op.attributes["name"].immediateValue.tensor.strings.values[0] == f"{op.type}_{k}"
    renamed = [n for n in variables if n not in kept]
    assert renamed and all(CANONICAL.match(n) for n in renamed), renamed
    assert len(set(variables)) == len(variables) and len(set(ops)) == len(ops)


def test_every_parameter_of_the_chunk_module_is_a_weight_by_name() -> None:
    """A parameter `is_weight` did not recognise would lose its name to a
    canonical one, and with it the audit's layer and parity's read-back."""
    import torch
    from chunkforge_py.model import Chunk

    if not BIN.exists():
        pytest.skip(f"{BIN} is missing: run cargo build --release first")
    done = subprocess.run([str(BIN), "plan", "--mode", "one", "--json"], capture_output=True, text=True, check=True)
    plan = json.loads(done.stdout)
    [chunk] = plan["layouts"][0]["chunks"]
    with torch.device("meta"):
        module = Chunk(plan["dims"], chunk)
    names = [n for n, _ in [*module.named_parameters(), *module.named_buffers()]]
    assert any(n.startswith("lm_head") for n in names) and any(n.startswith("per_layer_model") for n in names)
    for n in names:
        const = n.replace(".", "_") + "_to_fp16"
        assert anchor(const) is not None, f"{n}: {const} would not keep its name"
