"""The static ANE audit's rules, layer attribution and op-type table, on tiny
hand-built MIL programs converted to iOS18 ML programs and saved (seconds)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import coremltools as ct
import numpy as np
import pytest
from chunkforge_py import audit as A
from chunkforge_py.contract import AuditFinding, AuditPackage, LayerKind
from chunkforge_py.runtime import ChunkforgeError
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types

IOS18 = ct.target.iOS18
KINDS: dict[str, LayerKind] = {"0": "sliding", "1": "full"}


def weight(name: str, *shape: int) -> Any:
    rng = np.random.default_rng(0)
    return mb.const(val=(rng.random(shape) - 0.5).astype(np.float16), name=name)


def save(prog: Any, path: Path, **convert: Any) -> Path:
    """The program as written (no optimization passes: nothing fused or renamed)."""
    kwargs: dict[str, Any] = {
        "convert_to": "mlprogram",
        "minimum_deployment_target": IOS18,
        "pass_pipeline": ct.PassPipeline.EMPTY,
    }
    kwargs.update(convert)
    ct.convert(prog, **kwargs).save(str(path))
    return path


def package(path: Path, kinds: dict[str, LayerKind] | None = None) -> AuditPackage:
    return {"path": str(path), "name": path.name, "layer_kinds": KINDS if kinds is None else kinds, "merged": False}


def findings(path: Path, kinds: dict[str, LayerKind] | None = None) -> list[AuditFinding]:
    report = A.audit({"packages": [package(path, kinds)], "compute_plan": False})
    assert report["total"] == len(report["findings"])
    return report["findings"]


def rules(found: list[AuditFinding]) -> dict[str, list[str]]:
    """Op names by rule."""
    out: dict[str, list[str]] = {}
    for f in found:
        out.setdefault(f["rule"], []).append(f["op"])
    return out


def two_layers(x: Any, width: int = 64) -> Any:
    """Layer 0 and layer 1 as the device-proven graphs write them: a 1x1 conv
    on its layer's weight, a residual add, the next layer's norm input."""
    h = mb.conv(x=x, weight=weight("layers_0_q_proj_weight", width, width, 1, 1), name="l0_conv")
    h = mb.mul(x=h, y=weight("layers_0_layer_scalar", 1, width, 1, 1), name="l0_scale")
    h = mb.add(x=h, y=x, name="l0_res")
    h = mb.mul(x=h, y=np.float16(0.5), name="l1_prep")
    h = mb.conv(x=h, weight=weight("layers_1_q_proj_weight", width, width, 1, 1), name="l1_conv")
    return mb.mul(x=h, y=weight("layers_1_layer_scalar", 1, width, 1, 1), name="l1_scale")


def test_a_device_proven_formulation_has_no_findings(tmp_path: Path) -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        pre = mb.mul(x=x, y=np.float16(2.0), name="pre_scale")
        return two_layers(pre)

    assert findings(save(prog, tmp_path / "clean.mlpackage")) == []


def test_layers_follow_the_weights_and_the_dataflow(tmp_path: Path) -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        shared = mb.mul(x=x, y=np.float16(2.0), name="shared_prep")
        h = two_layers(shared)
        h = mb.add(x=h, y=shared, name="uses_shared")
        lg = mb.conv(x=h, weight=weight("lm_head_weight", 512, 64, 1, 1), name="head_conv")
        return mb.reduce_argmax(x=lg, axis=1, name="argmax")

    path = save(prog, tmp_path / "layers.mlpackage")
    (f,) = A.read_functions(package(path))
    layer = {op.name: lay for op, lay in zip(f.ops, A.layers_of(f), strict=True)}
    # Fed to layer 0 and, through the residual, past it: shared preparation.
    assert layer["shared_prep"] == "pre"
    assert layer["l0_conv"] == layer["l0_scale"] == "0"
    # Between layer 0's last weight and layer 1's first: the next layer's.
    assert layer["l1_prep"] == "1"
    assert layer["l1_conv"] == "1"
    # After the last layer's last weighted op.
    assert layer["uses_shared"] == layer["head_conv"] == layer["argmax"] == "head"
    # Consts: by name, else their consumer's.
    assert layer["layers_1_q_proj_weight"] == "1"
    assert layer["lm_head_weight"] == "head"


def test_op_type_outside_the_table_of_its_layer_kind(tmp_path: Path) -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        h = two_layers(x)
        # sin: in no layer kind; pad: proven in sliding layers only, this is a full one.
        h = mb.sin(x=h, name="head_sin")
        return mb.add(x=h, y=np.float16(1.0), name="head_add")

    found = findings(save(prog, tmp_path / "optype.mlpackage"))
    by_op = {f["op"]: f for f in found if f["rule"] == "op-type"}
    assert set(by_op) == {"head_sin", "head_add"}
    assert by_op["head_sin"]["layer"] == "head" and by_op["head_sin"]["op_type"] == "sin"
    assert by_op["head_sin"]["package"] == "optype.mlpackage" and by_op["head_sin"]["function"] == "main"
    assert "`head`" in by_op["head_sin"]["detail"]

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)], opset_version=IOS18)
    def padded(x: Any) -> Any:
        h = mb.conv(x=x, weight=weight("layers_0_k_proj_weight", 64, 64, 1, 1), name="l0_conv")
        pad = np.array([0, 0, 0, 0, 0, 0, 0, 8], dtype=np.int32)
        h = mb.pad(x=h, pad=pad, constant_val=np.float16(0), name="l0_pad")
        return mb.mul(x=h, y=weight("layers_0_k_norm_weight", 1, 1, 1, 16), name="l0_norm")

    path = save(padded, tmp_path / "pad.mlpackage")
    assert rules(findings(path, {"0": "sliding"})) == {}
    assert rules(findings(path, {"0": "full"})) == {"op-type": ["l0_pad"]}
    # A layer no plan describes is checked against every decoder layer kind.
    assert rules(findings(path, {})) == {}


def test_cast_is_proven_only_to_the_tables_dtypes(tmp_path: Path) -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        h = two_layers(x)
        i = mb.reduce_argmax(x=h, axis=1, name="argmax")
        return mb.cast(x=i, dtype="int32", name="to_int32"), mb.cast(x=h, dtype="int16", name="to_int16")

    found = findings(save(prog, tmp_path / "cast.mlpackage"))
    assert rules(found) == {"op-type": ["to_int16"]}
    assert "int16" in found[0]["detail"]


def test_rank_above_four(tmp_path: Path) -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        h = two_layers(x)
        h = mb.reshape(x=h, shape=[1, 2, 32, 1, 8], name="rank5")
        return mb.reshape(x=h, shape=[1, 64, 1, 8], name="back")

    found = findings(save(prog, tmp_path / "rank.mlpackage"))
    assert rules(found).get("rank") == ["rank5"]
    assert "rank 5" in next(f["detail"] for f in found if f["rule"] == "rank")


def test_fp32_inputs_ops_and_consts(tmp_path: Path) -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp32)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        w = mb.const(val=np.ones((1, 64, 1, 8), dtype=np.float32), name="layers_0_bias")
        return mb.add(x=x, y=w, name="l0_add")

    found = findings(save(prog, tmp_path / "fp32.mlpackage", compute_precision=ct.precision.FLOAT32))
    fp32 = {(f["op_type"], f["op"]) for f in found if f["rule"] == "fp32"}
    assert ("input", "x") in fp32
    assert ("add", "l0_add") in fp32
    assert ("const", "layers_0_bias") in fp32


def test_large_dims_only_under_the_head_vocab_allowance(tmp_path: Path) -> None:
    vocab = A.MAX_DIM + 616

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 1), dtype=types.fp16)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        h = two_layers(x)
        lg = mb.conv(x=h, weight=weight("lm_head_weight", vocab, 64, 1, 1), name="head_conv")
        lg = mb.mul(x=mb.tanh(x=lg, name="softcap"), y=np.float16(30.0), name="softcap_scale")
        flat = mb.reshape(x=lg, shape=[vocab], name="logits")
        # Not on the vocabulary axis: a large dimension of its own.
        wide = mb.tile(x=flat, reps=[2], name="wide")
        return mb.reduce_argmax(x=flat, axis=0, name="argmax"), mb.reduce_max(x=wide, axes=[0], name="wide_max")

    found = findings(save(prog, tmp_path / "vocab.mlpackage"))
    assert rules(found).get("large-dim") == ["wide"]

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 1), dtype=types.fp16)], opset_version=IOS18)
    def not_head(x: Any) -> Any:
        return mb.conv(x=x, weight=weight("layers_0_up_proj_weight", vocab, 64, 1, 1), name="l0_up")

    found = findings(save(not_head, tmp_path / "wide.mlpackage"))
    assert sorted(rules(found).get("large-dim", [])) == ["l0_up", "layers_0_up_proj_weight"]


def test_a_large_tensor_with_a_singleton_last_axis(tmp_path: Path) -> None:
    n = A.LAST_AXIS_1_MIN_ELEMENTS

    @mb.program(
        input_specs=[
            mb.TensorSpec(shape=(1, 1, n, 1), dtype=types.fp16),
            mb.TensorSpec(shape=(1, 1, n - 1, 1), dtype=types.fp16),
        ],
        opset_version=IOS18,
    )
    def prog(big: Any, small: Any) -> Any:
        # A 1x1 conv weight is [O, I, 1, 1] by definition: not an activation.
        w = weight("layers_0_o_proj_weight", 64, n, 1, 1)
        h = mb.conv(x=mb.reshape(x=big, shape=[1, n, 1, 1], name="l0_in"), weight=w, name="l0_conv")
        return mb.mul(x=big, y=np.float16(2.0), name="l0_mask"), mb.mul(x=small, y=np.float16(2.0), name="small"), h

    found = findings(save(prog, tmp_path / "axis.mlpackage"))
    flagged = rules(found).get("last-axis-1", [])
    # l0_in is the NCHW [1, C, 1, 1] row a 1x1 conv reads: the device-proven form.
    assert sorted(flagged) == ["big", "l0_mask"]


def test_dynamic_shapes(tmp_path: Path) -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, get_new_symbol()), dtype=types.fp16)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        return two_layers(x)

    path = save(prog, tmp_path / "dynamic.mlpackage")
    found = [f for f in findings(path) if f["rule"] == "dynamic-shape"]
    assert found and found[0]["op_type"] == "input" and "?" in found[0]["detail"]
    assert any(f["op"] == "l0_conv" for f in found)


def test_every_function_of_a_multifunction_package(tmp_path: Path) -> None:
    def ending_in(op: str) -> Any:
        @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)], opset_version=IOS18)
        def prog(x: Any) -> Any:
            return getattr(mb, op)(x=two_layers(x), name=f"head_{op}")

        return prog

    parts = [save(ending_in(op), tmp_path / f"part{op}.mlpackage") for op in ("sin", "cos")]
    desc = ct.utils.MultiFunctionDescriptor()
    desc.add_function(str(parts[0]), "main", "decode_q1")
    desc.add_function(str(parts[1]), "main", "verify_qK")
    desc.default_function_name = "decode_q1"
    path = tmp_path / "multi.mlpackage"
    ct.utils.save_multifunction(desc, str(path))
    found = findings(path)
    assert {(f["function"], f["op_type"]) for f in found} == {("decode_q1", "sin"), ("verify_qK", "cos")}
    report = A.audit({"packages": [package(path)], "compute_plan": True})
    functions = {f["name"]: f for f in report["packages"][0]["functions"]}
    assert functions["decode_q1"]["findings"] == {"op-type": 1}
    assert functions["decode_q1"]["ops"] == functions["decode_q1"]["op_counts"]["conv"] + 5
    # Linux: said, not faked.
    assert report["compute_plan"] == {"skipped": "MLComputePlan needs macOS; this is linux"}


def test_the_op_table_and_its_errors(tmp_path: Path) -> None:
    table = A.load_table()
    assert set(table.layer_kinds) == set(A.LAYER_KINDS)
    assert all(table.layer_kinds[k] for k in A.LAYER_KINDS)
    assert "conv" in table.layer_kinds["sliding"] and "linear" not in table.layer_kinds["sliding"]
    bad = tmp_path / "table.json"
    bad.write_text(json.dumps({"layer_kinds": {"sliding": ["conv"]}}))
    with pytest.raises(ChunkforgeError, match=r"table.json: layer_kinds.full must be a list"):
        A.load_table(str(bad))
    bad.write_text("{")
    with pytest.raises(ChunkforgeError, match=r"table.json: cannot read the op-type table"):
        A.load_table(str(bad))


def test_op_types_regenerate_the_table_shape(tmp_path: Path) -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        return mb.sin(x=two_layers(x), name="head_sin")

    path = save(prog, tmp_path / "types.mlpackage")
    got = A.op_types({"packages": [package(path)], "compute_plan": False})
    assert set(got["layer_kinds"]) == set(A.LAYER_KINDS)
    assert got["layer_kinds"]["sliding"] == ["const", "conv", "mul"]
    assert "sin" in got["layer_kinds"]["head"]


def test_a_folder_that_is_not_a_package(tmp_path: Path) -> None:
    with pytest.raises(ChunkforgeError, match="not a readable .mlpackage"):
        A.audit({"packages": [package(tmp_path)], "compute_plan": False})
