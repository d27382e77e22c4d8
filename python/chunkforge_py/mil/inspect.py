"""Read a built .mlpackage back (no model load, works on Linux) and describe it:
spec version, I/O, palettized weights and the decoder layers its weights belong to."""

from __future__ import annotations

import os
import re
from typing import Any

from ..contract import (
    DescribeArgs,
    FunctionDescription,
    IoDescription,
    PackageDescription,
    PalettizedConst,
    ProjectionWeight,
)
from .program import read_model_spec

# ArrayFeatureType.ArrayDataType values in the Core ML spec.
ARRAY_DTYPES = {65552: "fp16", 65568: "fp32", 131104: "int32"}
LAYER_RE = re.compile(r"^layers_(\d+)_")


# The ops that hold a projection's weight: 1x1 convolutions (the Neural Engine
# formulation chunkforge writes) and `linear` (builds before it).
PROJECTION_OPS = ("conv", "linear")


def int4_g32_lut_shape(weight_shape: list[int]) -> list[int]:
    """The iOS18 LUT shape of an INT4 per_grouped_channel, group-32 weight: one
    16-entry palette per 32 output channels, ones on the other weight axes."""
    return [weight_shape[0] // 32, *[1] * (len(weight_shape) - 1), 16, 1]


def const_key(name: str) -> str:
    """A package const's name reduced to the torch parameter path with dots as
    underscores (coremltools appends `_promoted_to_fp16`, `_palettized`, ...)."""
    for suffix in ("_palettized", "_promoted_to_fp16", "_to_fp16"):
        name = name.removesuffix(suffix)
    return name


def read_package(path: str, program: bool = True, weights_dir: str | None = None) -> tuple[Any, Any, str]:
    """A saved package's spec, its MIL program (None with ``program=False`` or
    for a non-ML-program model) and the default function's name, read without
    loading the model (works on Linux). Every function of a chunkforge
    multifunction package holds the same weights. ``weights_dir``: the folder
    of the blob it reads, when not its own (shared in by the app's download)."""
    from coremltools.converters.mil.frontend.milproto.load import load as mil_load

    # The spec is read straight from the package's files: coremltools'
    # MLModel(path) rewrites Manifest.json, and a release must stay untouched
    # (and readable from a read-only mount).
    spec, model_file = read_model_spec(path)
    prog = None
    if program and spec.WhichOneof("Type") == "mlProgram":
        weights = weights_dir or os.path.join(os.path.dirname(model_file), "weights")
        prog = mil_load(spec, specification_version=spec.specificationVersion, file_weights_dir=weights)
    return spec, prog, spec.description.defaultFunctionName or "main"


def io(features: Any) -> list[IoDescription]:
    """Inputs or outputs as a package's spec describes them."""
    return [
        {
            "name": f.name,
            "shape": [int(d) for d in f.type.multiArrayType.shape],
            "dtype": ARRAY_DTYPES.get(f.type.multiArrayType.dataType, str(f.type.multiArrayType.dataType)),
        }
        for f in features
    ]


def function_descriptions(spec: Any) -> list[FunctionDescription]:
    """Each function's I/O as the spec describes it (a multifunction package
    describes each function; its top-level I/O is the default function's)."""
    return [{"name": f.name, "inputs": io(f.input), "outputs": io(f.output)} for f in spec.description.functions]


def describe(args: DescribeArgs) -> PackageDescription:
    path = args["path"]
    spec, prog, default = read_package(path, weights_dir=args["weights"])
    kind = spec.WhichOneof("Type")
    desc = spec.description
    functions = function_descriptions(spec)
    top = next((f for f in functions if f["name"] == default), None)
    out: PackageDescription = {
        "path": path,
        "specification_version": int(spec.specificationVersion),
        "model_type": kind,
        "default_function": default,
        "inputs": top["inputs"] if top else io(desc.input),
        "outputs": top["outputs"] if top else io(desc.output),
        "functions": functions or [{"name": "main", "inputs": io(desc.input), "outputs": io(desc.output)}],
    }
    if prog is None:
        return out
    for f in out["functions"]:
        ops = list(prog.functions[f["name"]].operations)
        f["mil_ops"] = len(ops)
        projections = [op for op in ops if op.op_type in PROJECTION_OPS]
        f["projection_ops"] = len(projections)
        # INT4 per_grouped_channel, group 32: one 16-entry LUT per 32 output channels.
        f["int4_g32_projection_ops"] = sum(
            1
            for op in projections
            if op.weight.op is not None
            and op.weight.op.op_type == "constexpr_lut_to_dense"
            and list(op.weight.op.lut.shape) == int4_g32_lut_shape([int(d) for d in op.weight.shape])
        )
    main = prog.functions[default]
    out["opset"] = main.opset_version.name if hasattr(main.opset_version, "name") else str(main.opset_version)
    ops = list(main.operations)
    luts: list[PalettizedConst] = []
    layers: set[int] = set()
    projection_weights: list[ProjectionWeight] = []
    for op in ops:
        if op.op_type == "constexpr_lut_to_dense":
            luts.append(
                {
                    "name": op.name,
                    "weight_shape": [int(x) for x in op.outputs[0].shape],
                    "lut_shape": [int(x) for x in op.lut.shape],
                    "indices_dtype": str(
                        op.indices.dtype.__name__ if hasattr(op.indices.dtype, "__name__") else op.indices.dtype
                    ),
                }
            )
        if op.op_type in ("const", "constexpr_lut_to_dense"):
            m = LAYER_RE.match(op.name)
            if m:
                layers.add(int(m.group(1)))
        if op.op_type in PROJECTION_OPS:
            src = op.weight.op
            projection_weights.append({"op": op.name, "weight": src.name, "weight_op": src.op_type})
    out.update(
        {
            "mil_ops": len(ops),
            "palettized": luts,
            "projections": projection_weights,
            "layers": sorted(layers),
        }
    )
    return out
