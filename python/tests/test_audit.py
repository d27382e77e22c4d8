"""The static ANE audit's rules, layer attribution and op-type table, on tiny
hand-built MIL programs converted to iOS18 ML programs and saved (seconds);
and on one sliding and one full layer of E2B's chunk1 at its real widths,
every function, converted from chunkforge's own modules."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any, cast

import coremltools as ct
import numpy as np
import pytest
import torch
from chunkforge_py.contract import AuditFinding, AuditPackage, ChunkPlan, ConversionSettings, FunctionPlan, LayerKind
from chunkforge_py.convert import chunks as convert
from chunkforge_py.fixture import text_config_dict
from chunkforge_py.mil import audit as A
from chunkforge_py.model import Chunk
from chunkforge_py.roles import CACHE, NEW_ROWS
from chunkforge_py.runtime import ChunkforgeError
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types

IOS18 = ct.target.iOS18
KINDS: dict[str, LayerKind] = {"0": "sliding", "1": "full"}
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("CHUNKFORGE_BIN", ROOT / "target" / "release" / "chunkforge"))


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


def tied_head(h: Any, width: int = 64) -> Any:
    """The head's projection (a const named ``lm_head*``): what follows is the head's."""
    return mb.conv(x=h, weight=weight("lm_head_weight", width, width, 1, 1), name="head_conv")


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
        h = tied_head(two_layers(x))
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
        h = tied_head(two_layers(x))
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
        return mb.sin(x=tied_head(two_layers(x)), name="head_sin")

    path = save(prog, tmp_path / "types.mlpackage")
    got = A.op_types({"packages": [package(path)], "compute_plan": False})
    assert set(got["layer_kinds"]) == set(A.LAYER_KINDS)
    assert got["layer_kinds"]["sliding"] == ["const", "conv", "mul"]
    assert "sin" in got["layer_kinds"]["head"]


def test_a_folder_that_is_not_a_package(tmp_path: Path) -> None:
    with pytest.raises(ChunkforgeError, match="not a readable .mlpackage"):
        A.audit({"packages": [package(tmp_path)], "compute_plan": False})


# ---- layers of a Gemma 4 stream --------------------------------------------------


def rms(x: Any, w: Any, name: str) -> Any:
    """RMSNorm as the device-proven graphs write it: layer_norm over [x, -x],
    first half, times the weight (``w``: a const of its own, or one shared)."""
    both = mb.concat(values=[x, mb.mul(x=x, y=np.float16(-1.0), name=f"{name}_neg")], axis=-1, name=f"{name}_cat")
    normed = mb.layer_norm(x=both, axes=[-1], epsilon=np.float16(1e-6), name=f"{name}_ln")
    half, _ = mb.split(x=normed, num_splits=2, axis=-1, name=f"{name}_split")
    return mb.mul(x=half, y=w, name=f"{name}_w")


def projection(x: Any, weight_name: str, name: str, width: int = 64) -> Any:
    """A 1x1 conv on the token's NCHW row, back to [1, 1, width]."""
    row = mb.reshape(x=x, shape=[1, width, 1, 1], name=f"{name}_row")
    out = mb.conv(x=row, weight=weight(weight_name, width, width, 1, 1), name=f"{name}_conv")
    return mb.reshape(x=out, shape=[1, 1, width], name=f"{name}_tokens")


def stream(
    h: Any, layers: int, scalars: set[int], head: bool, norm: dict[int, Any] | None = None
) -> tuple[Any, list[Any]]:
    """``layers`` decoder layers of the Gemma 4 stream: input norm, a
    projection, post norm, residual sum; pre-FFN norm, a projection, post norm,
    residual sum; times the layer's scalar for the layers in ``scalars`` (a
    scalar of 1.0 leaves no multiplication in a converted program). Then the
    final norm and head, or the K rows stacked as an output. ``norm``: a
    layer's input-norm weight given (shared, as coremltools' const
    deduplication leaves equal weights)."""
    norm = norm or {}
    keys = []
    for i in range(layers):
        w = norm.get(i, weight(f"layers_{i}_input_layernorm_weight", 64))
        x = rms(h, w, f"l{i}_in")
        keys.append(projection(x, f"layers_{i}_self_attn_k_proj_weight", f"l{i}_k"))
        attended = mb.mul(x=x, y=keys[-1], name=f"l{i}_attend")
        a = projection(attended, f"layers_{i}_self_attn_o_proj_weight", f"l{i}_o")
        post = rms(a, weight(f"layers_{i}_post_attention_layernorm_weight", 64), f"l{i}_post")
        h = mb.add(x=h, y=post, name=f"l{i}_attn_sum")
        m = projection(
            rms(h, weight(f"layers_{i}_pre_ff_weight", 64), f"l{i}_pre_ff"), f"layers_{i}_mlp_w", f"l{i}_mlp"
        )
        h = mb.add(x=h, y=rms(m, weight(f"layers_{i}_post_ff_weight", 64), f"l{i}_post_ff"), name=f"l{i}_ff_sum")
        if i in scalars:
            h = mb.mul(x=h, y=weight(f"layers_{i}_layer_scalar", 1), name=f"l{i}_scalar")
    if head:
        logits = projection(rms(h, weight("norm_weight", 64), "final"), "lm_head_weight", "head")
        return h, [mb.reduce_argmax(x=logits, axis=-1, name="argmax")]
    return h, [mb.stack(values=keys, axis=0, name="k_stacked")]


def places(path: Path) -> dict[str, str]:
    (f,) = A.read_functions(package(path))
    return {op.name: lay for op, lay in zip(f.ops, A.layers_of(f), strict=True) if not op.is_const}


@pytest.mark.parametrize("scalars", [{0, 1, 2}, set(), {1}, {0, 2}], ids=["every", "none", "middle", "outer"])
@pytest.mark.parametrize("head", [True, False], ids=["head", "no-head"])
def test_a_layer_ends_with_its_residual_sum_whether_or_not_its_scalar_multiplies(
    tmp_path: Path, scalars: set[int], head: bool
) -> None:
    # A layer_scalar of exactly 1.0 (transformers' default; what bf16 rounds a
    # scalar within 0.4 % of 1 to) leaves no `mul` in a converted program: the
    # layer's last op is its residual sum, which reads no weight. It is still
    # that layer's, never the head's (the bug: `add` in the head of chunk1).
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 1, 64), dtype=types.fp16)], opset_version=IOS18)
    def prog(h: Any) -> Any:
        out, extra = stream(h, 3, scalars, head)
        return out, *extra

    got = places(save(prog, tmp_path / "stream.mlpackage"))
    for i in range(3):
        mine = {name: lay for name, lay in got.items() if name.startswith(f"l{i}_")}
        assert mine and all(lay == str(i) for lay in mine.values()), (i, {k: v for k, v in mine.items() if v != str(i)})
    rest = {name: lay for name, lay in got.items() if not name.startswith("l")}
    assert rest and all(lay == "head" for lay in rest.values()), rest
    # The audit agrees: no `add` outside a decoder layer.
    kinds: dict[str, LayerKind] = {"0": "sliding", "1": "full", "2": "shared_sliding"}
    assert findings(tmp_path / "stream.mlpackage", kinds) == []


def test_a_weight_shared_by_const_deduplication_names_the_first_layer_only(tmp_path: Path) -> None:
    # Equal weights of 100+ elements become one const under the first one's
    # name: layers 1 and 2 read layer 0's input-norm weight.
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 1, 64), dtype=types.fp16)], opset_version=IOS18)
    def prog(h: Any) -> Any:
        w = weight("layers_0_input_layernorm_weight", 64)
        out, extra = stream(h, 3, {0, 1, 2}, head=True, norm={0: w, 1: w, 2: w})
        return out, *extra

    got = places(save(prog, tmp_path / "dedup.mlpackage"))
    for i in range(3):
        assert {got[f"l{i}_in_{part}"] for part in ("neg", "cat", "ln", "split", "w")} == {str(i)}, i


def test_a_softmax_row_statistic_is_the_proven_layout_a_column_is_not(tmp_path: Path) -> None:
    n = A.LAST_AXIS_1_MIN_ELEMENTS

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 1, n, 8), dtype=types.fp16)], opset_version=IOS18)
    def prog(scores: Any) -> Any:
        w = weight("layers_0_q_proj_weight", 8, 8, 1, 1)
        s = mb.transpose(x=mb.conv(x=mb.transpose(x=scores, perm=[0, 3, 1, 2]), weight=w), perm=[0, 2, 3, 1])
        top = mb.reduce_max(x=s, axes=[-1], keep_dims=True, name="l0_row_max")
        e = mb.exp(x=mb.sub(x=s, y=top, name="l0_shift"), name="l0_exp")
        total = mb.reduce_sum(x=e, axes=[-1], keep_dims=True, name="l0_row_sum")
        probs = mb.real_div(x=e, y=total, name="l0_probs")
        # The same numbers laid out as a column: a padded last axis.
        column = mb.reshape(x=mb.reduce_max(x=s, axes=[-1], keep_dims=False, name="l0_max"), shape=[1, n, 1])
        return probs, mb.mul(x=column, y=np.float16(2.0), name="l0_column")

    found = findings(save(prog, tmp_path / "softmax.mlpackage"), {"0": "sliding"})
    flagged = {f["op"] for f in found if f["rule"] == "last-axis-1"}
    assert "l0_column" in flagged and not flagged & {"l0_row_max", "l0_row_sum"}, found


def test_severity_errors_refuse_warnings_cost_speed(tmp_path: Path) -> None:
    n = A.LAST_AXIS_1_MIN_ELEMENTS

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64, 1, 8), dtype=types.fp16)], opset_version=IOS18)
    def prog(x: Any) -> Any:
        h = tied_head(two_layers(x))
        column = mb.reshape(x=mb.tile(x=h, reps=[1, n // 64, 1, 1]), shape=[1, n * 8, 1], name="head_column")
        return mb.sin(x=h, name="head_sin"), column

    path = save(prog, tmp_path / "severity.mlpackage")
    report = A.audit({"packages": [package(path)], "compute_plan": False})
    by_op = {(f["op"], f["rule"]): f["severity"] for f in report["findings"]}
    assert by_op[("head_sin", "op-type")] == "error"
    assert by_op[("head_column", "last-axis-1")] == "warning"
    assert (report["errors"], report["warnings"]) == (
        sum(1 for s in by_op.values() if s == "error"),
        sum(1 for s in by_op.values() if s == "warning"),
    )
    assert report["errors"] + report["warnings"] == report["total"]
    assert report["severity"] == A.SEVERITY
    assert {r for r, s in A.SEVERITY.items() if s == "warning"} == {"last-axis-1"}


# ---- E2B widths ------------------------------------------------------------------

# What `build --no-quantize` converts with (records.rs `ConversionSettings::shipped`).
UNQUANTIZED = cast(
    ConversionSettings,
    {
        "ctx": 2048,
        "minimum_deployment_target": "iOS18",
        "compute_precision": "FLOAT16",
        "compute_units": "CPU_AND_NE",
        "quantize": False,
        "palettization": None,
        "pass_pipeline": "chunkforge",
        "compose": True,
        "joint": True,
        "writer": "chunkforge",
        "mil_shortcuts": True,
    },
)
# chunkforge's roles of KV slots by attention kind: the caches and verify's new rows.
SLOT_ROLES = {role: kind for table in (CACHE, NEW_ROWS) for kind, roles in table.items() for role in roles}


@pytest.fixture(scope="module")
def e2b_plan(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`chunkforge plan --mode all --prefill-len 1024 --json` of E2B's config
    at its real widths (vocabulary cut to 16384): a config.json is all a plan needs."""
    assert BIN.exists(), f"{BIN} is missing: run cargo build --release first"
    folder = tmp_path_factory.mktemp("e2b-config")
    config = {**text_config_dict("e2b", full_width=True, vocab_size=16384), "model_type": "gemma4_text"}
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma4ForCausalLM"]}))
    args = ["plan", "--hf-dir", str(folder), "--mode", "all", "--prefill-len", "1024", "--json"]
    done = subprocess.run([str(BIN), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return cast(dict[str, Any], json.loads(done.stdout))


def unit(chunk: ChunkPlan, function: FunctionPlan, keep: set[int]) -> tuple[ChunkPlan, FunctionPlan]:
    """``chunk`` and its ``function`` cut down to the layers ``keep``, each the
    first of its attention kind (KV slot 0): the caches shrink to their slots,
    prefill's per-layer K/V to the layers kept."""
    c = copy.deepcopy(chunk)
    c["layers"] = [lay for lay in c["layers"] if lay["index"] in keep]
    assert {lay["index"] for lay in c["layers"]} == keep and all(lay["kv"].get("slot") == 0 for lay in c["layers"])
    slots = {kind: sum(lay["attention"] == kind for lay in c["layers"]) for kind in ("sliding", "full")}
    f = copy.deepcopy(function)
    for specs in (f["inputs"], f["outputs"]):
        specs[:] = [t for t in specs if t.get("layer") in (None, *keep)]
        for t in specs:
            if t["role"] in SLOT_ROLES:
                t["shape"][0] = slots[SLOT_ROLES[t["role"]]]
    if "kv_layers" in f:
        f["kv_layers"] = [i for i in f["kv_layers"] if i in keep]
    c["functions"], c["inputs"], c["outputs"] = [f], f["inputs"], f["outputs"]
    return c, f


def converted_unit(dims: Any, chunk: ChunkPlan, function: FunctionPlan, path: Path) -> Path:
    """The unit's module with random weights, converted as `build --no-quantize` does."""
    with torch.device("meta"):
        module = Chunk(dims, chunk, function).eval()
    module.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            t.normal_(0.0, 0.02, generator=g)
    convert.convert(convert.trace(module), function, chunk["name"], UNQUANTIZED).save(str(path))
    return path


def test_e2b_widths_every_function_has_no_findings(e2b_plan: dict[str, Any], tmp_path: Path) -> None:
    # Layers 0 (sliding) and 4 (full) of chunk1, at E2B's widths: decode (the
    # per-layer inputs are 35 x 256 = 8960 wide, the full layer's attention
    # 8 x 512 = 4096), verify, and a 1024-token prefill longer than the
    # 512-token window (the sliding layers' band).
    dims = e2b_plan["dims"]
    layouts = {lay["kind"]: lay for lay in e2b_plan["layouts"]}
    chunk1 = layouts["four"]["chunks"][0]
    prefill1 = layouts["prefill"]["chunks"][0]
    jobs = [(chunk1, f) for f in chunk1["functions"]] + [(prefill1, f) for f in prefill1["functions"]]
    assert [f["name"] for _, f in jobs] == ["decode_q1", "verify_qK", "prefill_b1024"]
    assert dims["sliding_window"] < 1024
    kinds: dict[str, LayerKind] = {"0": "sliding", "4": "full"}
    for chunk, function in jobs:
        c, f = unit(chunk, function, {0, 4})
        path = converted_unit(dims, c, f, tmp_path / f"{function['name']}.mlpackage")
        report = A.audit({"packages": [package(path, kinds)], "compute_plan": False})
        assert report["total"] == 0, (
            function["name"],
            [(x["op_type"], x["op"], x["detail"]) for x in report["findings"]],
        )
        (fn,) = A.read_functions(package(path, kinds))
        layers = A.layers_of(fn)
        shapes = [t.shape for op in fn.ops if not op.is_const for t in op.outputs]
        if function["kind"] == "decode":
            # One token's rows are reshaped, never transposed through [1, C, 1].
            assert [1, 8960, 1] not in shapes and [1, 4096, 1] not in shapes
            assert [1, 1, 8960] in shapes and [1, 4096, 1, 1] in shapes
        if function["kind"] == "prefill":
            # The band's leading rows, a tile of the transposed mask's first
            # row (the unit's one sliding layer reads it); no pad anywhere.
            window = dims["sliding_window"]
            band = [op for op in fn.ops if op.type == "tile" and op.outputs[0].shape == [1, 1, window - 1, 1024]]
            assert band and layers[band[0].index] == "0"
            assert "pad" not in {op.type for op in fn.ops}
            # The softmax's row statistics: 8 heads x 1024 rows, a last axis of 1.
            assert [1, 1, 8192, 1] in shapes
