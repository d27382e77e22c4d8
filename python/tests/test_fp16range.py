"""The fp16 range recorder (chunkforge_py.mil.fp16range) on small programs:
the largest |value| of each fp16 op output and its margin, an overflow that
the fp32 program does not have named by op, and a mask's -inf not charged
to the ops that pass it on."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import coremltools as ct
import numpy as np
import torch
from chunkforge_py.mil.fp16range import FP16_MAX, Fp16Range
from chunkforge_py.mil.interp import Interpreter
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types


def package(tmp_path: Path, scale: float) -> Interpreter:
    """``out = (x * scale) + mask``, every value fp16: with ``scale`` large
    enough ``x * scale`` passes 65504 for |x| near 1."""

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(2, 4), dtype=types.fp16), mb.TensorSpec(shape=(2, 4), dtype=types.fp16)],
        opset_version=ct.target.iOS18,
    )
    def prog(x: Any, mask: Any) -> Any:
        big = mb.mul(x=x, y=np.float16(scale), name="big")
        return mb.add(x=big, y=mask, name="out")

    model = ct.convert(
        prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18, pass_pipeline=ct.PassPipeline.EMPTY
    )
    path = tmp_path / f"p{int(scale)}.mlpackage"
    model.save(str(path))
    return Interpreter(str(path))


def inputs() -> dict[str, torch.Tensor]:
    x = torch.tensor([[0.5, -1.0, 0.25, 2.0], [1.0, 0.0, -0.5, 1.5]], dtype=torch.float16)
    # A causal-style mask: fp16 -inf blocks a position, as the runtime feeds it.
    mask = torch.zeros(2, 4, dtype=torch.float16)
    mask[0, 3] = float("-inf")
    return {"x": x, "mask": mask}


def test_margin_names_the_largest_output_and_a_mask_is_not_an_overflow(tmp_path: Path) -> None:
    fn = package(tmp_path, 1000.0).function()
    watch = Fp16Range()
    fn.run_torch(inputs(), fp16=True, watch=watch)
    report = watch.report()
    assert report["ok"] and not report["introduced"], report
    nearest = report["closest"][0]
    # x * 1000 reaches 2000; the masked add's finite values do too (its -inf is the mask's).
    assert nearest["max_abs"] == 2000.0
    assert math.isclose(nearest["margin_log2"] or 0.0, math.log2(FP16_MAX / 2000.0))
    assert {o["op"] for o in report["every"]} == {"big", "out"}
    assert all(o["made_nonfinite_fp16"] == 0 for o in report["every"])


def test_an_fp16_overflow_the_fp32_program_lacks_is_named(tmp_path: Path) -> None:
    fn = package(tmp_path, 40000.0).function()
    watch = Fp16Range()
    fn.run_torch(inputs(), fp16=True, watch=watch)
    fn.run_torch(inputs(), fp16=False, watch=watch)
    report = watch.report(every=False)
    assert not report["ok"]
    # The op whose finite fp32 results round to inf: the mul, not the add after it.
    assert [o["op"] for o in report["introduced"]] == ["big"], report["introduced"]
    bad = report["introduced"][0]
    # 2.0 * 40000 passes 65504 (1.5 * 40000 does not).
    assert bad["overflow"] == 1 and bad["made_nonfinite_fp16"] == 1 and bad["made_nonfinite_fp32"] == 0
    assert bad["max_abs"] == 80000.0 and (bad["margin_log2"] or 0.0) < 0
    assert "every" not in report


def test_an_inf_the_fp32_program_makes_too_is_not_a_failure(tmp_path: Path) -> None:
    @mb.program(
        input_specs=[mb.TensorSpec(shape=(4,), dtype=types.fp16), mb.TensorSpec(shape=(4,), dtype=types.fp16)],
        opset_version=ct.target.iOS18,
    )
    def prog(x: Any, y: Any) -> Any:
        return mb.real_div(x=x, y=y, name="ratio")

    model = ct.convert(
        prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18, pass_pipeline=ct.PassPipeline.EMPTY
    )
    model.save(str(tmp_path / "div.mlpackage"))
    fn = Interpreter(str(tmp_path / "div.mlpackage")).function()
    feeds = {"x": torch.tensor([1.0, 2.0, 3.0, 4.0]).half(), "y": torch.tensor([1.0, 0.0, 2.0, 4.0]).half()}
    watch = Fp16Range()
    fn.run_torch(feeds, fp16=True, watch=watch)
    # Alone, the fp16 run's inf (2 / 0) is charged to the op ...
    assert [r.op for r in watch.introduced()] == ["ratio"]
    # ... and not once the fp32 program is seen making it too.
    fn.run_torch(feeds, fp16=False, watch=watch)
    report = watch.report()
    assert report["ok"] and report["every"][0]["made_nonfinite_fp32"] == 1, report
