"""`passes.shortcuts`: each shortcut through coremltools' own code gives the
answer coremltools' code gives, and leaves coremltools as it found it."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import coremltools as ct
import numpy as np
import pytest
from chunkforge_py.convert import passes
from coremltools.converters.mil.mil import Builder as mb
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.mil.block import Block, Function
from coremltools.converters.mil.mil.operation import Operation
from coremltools.converters.mil.mil.ops.defs.iOS15.control_flow import Const
from coremltools.converters.mil.mil.ops.defs.iOS15.elementwise_unary import cast as Cast
from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision
from coremltools.converters.mil.mil.program import Program
from coremltools.converters.mil.mil.var import Var

TYPE_INFO_MODULE = sys.modules["coremltools.converters.mil.mil.types.get_type_info"]


def _patched_attributes() -> dict[str, Any]:
    return {
        "Program.__str__": Program.__dict__["__str__"],
        "Function.__str__": Function.__dict__["__str__"],
        "Block.__str__": Block.__dict__["__str__"],
        "Program.validate": Program.__dict__["validate"],
        "Block._propagate_nonreplaceable_vars": Block.__dict__["_propagate_nonreplaceable_vars"],
        "Var._set_nonreplaceable_vars_upstream": Var.__dict__["_set_nonreplaceable_vars_upstream"],
        "FP16ComputePrecision.fp16_overflow": FP16ComputePrecision.__dict__["fp16_overflow"],
        "Const.type_inference": Const.__dict__["type_inference"],
        "Const.value_inference": Const.__dict__["value_inference"],
        "FP16ComputePrecision._check_underflow_to_zero": FP16ComputePrecision.__dict__["_check_underflow_to_zero"],
        "Operation.type_value_inference": Operation.__dict__["type_value_inference"],
        "cast.get_cast_value": Cast.__dict__["get_cast_value"],
        "get_type_info": TYPE_INFO_MODULE.get_type_info,
        "types.get_type_info": types.get_type_info,
    }


def test_every_shortcut_is_taken_inside_and_undone_after() -> None:
    before = _patched_attributes()
    with passes.shortcuts(True):
        inside = _patched_attributes()
    after = _patched_attributes()
    assert after == before
    changed = {k for k in before if inside[k] is not before[k]}
    assert changed == set(before), f"not replaced inside: {sorted(set(before) - changed)}"
    with passes.shortcuts(False):
        assert _patched_attributes() == before


def _sets(prog: Program) -> dict[str, set[str]]:
    """Each variable's set by name; a literal's constant (named with a
    process-wide counter) by its name without the counter."""
    out: dict[str, set[str]] = {}

    def name(v: Any) -> str:
        return re.sub(r"_\d+$", "", v.name)

    def block(b: Any) -> None:
        for op in b.operations:
            for sub in op.blocks:
                block(sub)
            for v in op.outputs:
                out[name(v)] = {name(u) for u in v.nonreplaceable_vars_upstream}

    for f in prog.functions.values():
        block(f)
    return out


def _edited_program() -> Program:
    """relu(x) built first, then its input replaced by a palettized weight
    (a `constexpr_lut_to_dense` made afterwards): only the propagation on
    leaving the block gives relu's output a non-empty set."""

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(4, 2), dtype=types.fp16)],
        opset_version=ct.target.iOS18,
    )
    def prog(x: Any) -> Any:
        r = mb.relu(x=x, name="r")
        s = mb.shape(x=r, name="s")
        return mb.add(x=r, y=np.float16(1.0), name="out"), s

    f = prog.functions["main"]
    relu = f.find_ops(op_type="relu")[0]
    with f:
        lut = mb.constexpr_lut_to_dense(
            indices=np.array([[0, 1], [1, 0], [0, 0], [1, 1]], dtype=types.np_uint1_dtype),
            lut=np.array([-1.0, 2.0], dtype=np.float16).reshape(1, 1, 2, 1),
            before_op=relu,
            name="w",
        )
        relu.enclosing_block.replace_uses_of_var_after_op(anchor_op=lut.op, old_var=relu.x, new_var=lut)
        relu.set_inputs(x=lut)
    return prog


def test_upstream_sets_are_the_ones_coremltools_computes() -> None:
    with passes.fast_nonreplaceable_propagation(True):
        ours = _sets(_edited_program())
    reference = _sets(_edited_program())
    assert ours == reference
    assert reference["r"] == {"w"} and reference["out"] == {"w"} and reference["s"] == set()


def test_upstream_sets_without_a_constexpr_op_stay_empty() -> None:
    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3))], opset_version=ct.target.iOS18)
    def prog(x: Any) -> Any:
        return mb.mul(x=mb.relu(x=x), y=2.0)

    with passes.fast_nonreplaceable_propagation(True):
        f = prog.functions["main"]
        with f:
            mb.add(x=f.operations[-1].outputs[0], y=1.0)
        assert all(not s for s in _sets(prog).values())


def _describe(info: Any) -> tuple[Any, ...]:
    return (info.name, repr(info), info.python_class)


@pytest.mark.parametrize(
    "t",
    [
        types.fp16,
        types.fp32,
        types.int32,
        types.bool,
        types.str,
        types.tensor(types.fp16, (1, 2, 3)),
        types.tensor(types.int32, (7,)),
        types.list(types.fp32, init_length=2),
        types.tuple((types.fp32, types.int32)),
        types.dict(types.str, types.fp32),
    ],
)
def test_cached_type_info_is_coremltools_answer(t: Any) -> None:
    reference = TYPE_INFO_MODULE.get_type_info(t)
    checks = (types.is_tensor, types.is_scalar, types.is_list, types.is_tuple, types.is_dict, types.is_str)
    expected = [check(t) for check in checks]
    with passes.cached_type_info(True):
        first = types.get_type_info(t)
        second = TYPE_INFO_MODULE.get_type_info(t)
        assert second is first
        assert [check(t) for check in checks] == expected
    assert _describe(first) == _describe(reference)
    assert first == reference


@pytest.mark.parametrize(
    "value",
    [
        2.5,
        True,
        7,
        2**40,
        np.int64(-(2**40)),
        [1, 2, 3],
        (1.5, 2.5),
        np.arange(6, dtype=np.float64).reshape(2, 3),
        np.arange(12, dtype=np.float16),
        np.array([2**40, 3], dtype=np.int64),
        "fp16",
    ],
)
def test_const_inferred_once_as_coremltools_infers_it(value: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = Const._get_type_val

    def counted(op: Any, v: Any) -> Any:
        calls.append(op.name)
        return original(op, v)

    monkeypatch.setattr(Const, "_get_type_val", counted)

    def make() -> Any:
        @mb.program(input_specs=[], opset_version=ct.target.iOS18)
        def prog() -> Any:
            return mb.identity(x=mb.const(val=value, name="c"))

        return prog.functions["main"].find_ops(op_type="const")[0].outputs[0]

    reference = make()
    reference_calls = len(calls)
    calls.clear()
    with passes.single_const_inference(True):
        ours = make()
    assert len(calls) * 2 == reference_calls
    assert ours.sym_type == reference.sym_type
    assert type(ours.val) is type(reference.val)
    assert np.array_equal(np.asarray(ours.val), np.asarray(reference.val))


def test_a_conversion_with_shortcuts_is_the_conversion_without() -> None:
    """A small torch module converted with chunkforge's pipeline, with and
    without the shortcuts: the same program, weights and all."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # 32x4096 weights: above the size from which fp16 casts go
            # through torch, and the underflow check is skipped.
            self.a = torch.nn.Conv2d(32, 4096, 1, bias=False)
            self.b = torch.nn.Conv2d(4096, 32, 1, bias=False)
            # Below the underflow check's size: values that become 0 in fp16.
            self.tiny = torch.nn.Parameter(torch.full((1, 32, 1, 1), 1e-9))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            h = torch.nn.functional.gelu(h, approximate="tanh") * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + 1e-6)
            return (self.b(h) + self.tiny).transpose(1, 3) + 1.0

    torch.manual_seed(0)
    traced = torch.jit.trace(Net().eval(), torch.randn(1, 32, 1, 8))

    def convert(shortcuts: bool) -> bytes:
        with passes.shortcuts(shortcuts):
            model = ct.convert(
                traced,
                inputs=[ct.TensorType(name="x", shape=(1, 32, 1, 8), dtype=np.float16)],
                convert_to="mlprogram",
                minimum_deployment_target=ct.target.iOS18,
                compute_precision=ct.precision.FLOAT16,
                pass_pipeline=passes.pipeline(default=False),
                skip_model_load=True,
            )
        return model.get_spec().SerializeToString(deterministic=True) + b"".join(
            p.read_bytes() for p in sorted(Path(model.weights_dir).rglob("*")) if p.is_file()
        )

    assert convert(True) == convert(False)


class _Counting(np.ndarray):
    """An array that counts its `flatten` calls and elementwise `!=`."""

    calls: list[str] = []

    def flatten(self, *args: Any, **kwargs: Any) -> Any:
        _Counting.calls.append("flatten")
        return super().flatten(*args, **kwargs)

    def __ne__(self, other: Any) -> Any:
        _Counting.calls.append("!=")
        return super().__ne__(other)


class _CastOutput:
    """The output of the cast `add_fp16_cast` makes: its value is its `_sym_val`'s."""

    def __init__(self, half: np.ndarray) -> None:
        from types import SimpleNamespace

        self._sym_val = SimpleNamespace(val=half)

    @property
    def val(self) -> Any:
        return self._sym_val.val


def _underflow_case(values: np.ndarray) -> tuple[_CastOutput, Any]:
    """(new_var, var) as `add_fp16_cast` hands them to the check: the cast's
    output (its fp16 value) and the fp32 constant."""
    from types import SimpleNamespace

    return _CastOutput(values.astype(np.float16)), SimpleNamespace(val=values.view(_Counting))


@pytest.mark.parametrize("size", [1, 399, 400, 5000])
def test_underflow_check_is_coremltools_check(size: int) -> None:
    values = np.full(size, 1e-9, dtype=np.float32)
    values[0] = 1.0
    pass_ = FP16ComputePrecision()
    reference_new, reference_var = _underflow_case(values)
    pass_._check_underflow_to_zero(reference_new, reference_var)
    _Counting.calls.clear()
    new, var = _underflow_case(values)
    with passes.sized_underflow_check(True):
        FP16ComputePrecision()._check_underflow_to_zero(new, var)
    assert np.array_equal(new._sym_val.val.view(np.uint16), reference_new._sym_val.val.view(np.uint16))
    # Below 400 values coremltools replaces the zeros; from 400 on it keeps them,
    # and only then does the shortcut skip the copy.
    assert bool((new._sym_val.val == 0).any()) == (size >= 400)
    assert ("flatten" in _Counting.calls) == (size < 400)


def _reinferred(value: np.ndarray, shortcut: bool) -> tuple[Any, Any, Any]:
    @mb.program(input_specs=[mb.TensorSpec(shape=value.shape, dtype=types.fp32)], opset_version=ct.target.iOS18)
    def prog(x: Any) -> Any:
        return mb.add(x=x, y=mb.const(val=value, name="w"))

    op = prog.functions["main"].find_ops(op_type="const")[0]
    before = op.outputs[0]._sym_val
    with passes.const_reinference_without_compare(shortcut):
        op.type_value_inference(overwrite_output=True)
    out = op.outputs[0]
    return out, before, op


@pytest.mark.parametrize(
    "value", [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([np.nan, 1.0, -np.inf], dtype=np.float32)]
)
def test_const_reinference_assigns_what_coremltools_assigns(value: np.ndarray) -> None:
    reference, reference_before, _ = _reinferred(value.view(_Counting), False)
    _Counting.calls.clear()
    ours, before, op = _reinferred(value.view(_Counting), True)
    assert "!=" not in _Counting.calls
    assert ours.sym_type == reference.sym_type
    # A fresh value object, as coremltools makes, holding the op's own array.
    assert ours._sym_val is not before and reference._sym_val is not reference_before
    assert ours.val is op.val.val
    assert np.array_equal(ours.val, reference.val, equal_nan=True)
    assert ours.nonreplaceable_vars_upstream == reference.nonreplaceable_vars_upstream


def _cast_value(values: np.ndarray, dtype: str = "fp16") -> np.ndarray:
    from types import SimpleNamespace

    return Cast.get_cast_value(SimpleNamespace(val=values, sym_val=values), dtype)


def _fp16_edge_values() -> np.ndarray:
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, size=1 << 17, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array(
        [0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, -65520, 6e-8, 2.98e-8, 2.99e-8, 1e-45, 1e30],
        dtype=np.float32,
    )
    # Halfway between neighbouring fp16 values: ties to even.
    halves = np.arange(0, 2048, dtype=np.float32) + np.float32(0.5)
    return np.concatenate([random_bits[~np.isnan(random_bits)], edges, halves, -halves])


def test_fp16_cast_value_is_numpys() -> None:
    values = _fp16_edge_values()
    assert values.size >= passes.TORCH_CAST_MIN_VALUES
    reference = _cast_value(values)
    with passes.fast_fp16_cast_value(True):
        ours = _cast_value(values)
    assert ours.dtype == np.float16 and ours.shape == reference.shape and ours.flags.c_contiguous
    assert np.array_equal(ours.view(np.uint16), reference.view(np.uint16))


@pytest.mark.parametrize("case", ["nan", "strided", "small", "fp32"])
def test_fp16_cast_value_falls_back_to_numpy(case: str) -> None:
    values = _fp16_edge_values()
    dtype = "fp16"
    if case == "nan":
        # A signalling NaN with a payload: numpy and torch make different NaNs of it.
        values[5] = np.array([0x7F800001], dtype=np.uint32).view(np.float32)[0]
    elif case == "strided":
        values = values[::2]
    elif case == "small":
        values = values[: passes.TORCH_CAST_MIN_VALUES - 1]
    else:
        dtype = "fp32"
    reference = _cast_value(values, dtype)
    with passes.fast_fp16_cast_value(True):
        ours = _cast_value(values, dtype)
    assert ours.dtype == reference.dtype and ours.strides == reference.strides
    assert np.array_equal(ours.view(np.uint8), reference.view(np.uint8))


def test_whole_weight_compression_is_undone_after() -> None:
    from chunkforge_py.convert import palettize
    from coremltools.converters.mil.frontend import _utils as frontend_utils
    from coremltools.optimize.coreml._quantization_passes import palettize_weights

    def patched() -> tuple[Any, Any]:
        return (
            palettize_weights.__dict__["grouped_channelwise_compress"],
            frontend_utils.__dict__["_construct_constexpr_lut_op"],
        )

    before = patched()
    with palettize.whole_weight_compression(palettize.Dispatcher("t", 4, 32, None)):
        inside = patched()
        assert inside[0] is not before[0] and inside[1] is not before[1]
    assert patched() == before
    with palettize.whole_weight_compression(None):
        assert patched() == before


def test_replaced_restores_what_the_owner_held() -> None:
    class Base:
        def f(self) -> str:
            return "base"

    class Owner(Base):
        def g(self) -> str:
            return "g"

    with passes.replaced(Owner, f=lambda self: "f'", g=lambda self: "g'"):
        assert (Owner().f(), Owner().g()) == ("f'", "g'")
    assert (Owner().f(), Owner().g()) == ("base", "g")
