"""The MIL pass pipeline chunkforge converts with, and its profile.

`ct.convert` runs coremltools' default pipeline: about 95 graph passes, each
followed by a validation of the whole program. Most of them look for patterns
that chunkforge's programs never contain (convolution fusions, image
preprocessing, quantize/dequantize pairs, loops, ...). `SKIPPED` names those
passes, each with the reason it cannot change a chunkforge program; the
pipeline the build runs is the default one without them (`pipeline`). The
list was found with `bench build --profile --pass-pipeline coremltools
--mode all`, which counts, per pass, the runs that changed the program; the
test `cut_pass_pipeline_gives_byte_identical_packages` (tests/build.rs)
proves that every package of every layout and function comes out
byte-identical to the default pipeline's.

`shortcuts` takes shortcuts through coremltools' own code, each giving the
result coremltools' code gives: `terse_program_text` spares the debug-log
rendering of the whole program (computed whether or not it is logged);
`validate_once` defers the program validation coremltools runs after every
pass to one validation per program at the end; `fast_fp16_overflow_check`
gives `add_fp16_cast`'s fp16-range test of each constant without copies;
`fast_nonreplaceable_propagation` skips recomputing sets that must be empty;
`cached_type_info` describes each MIL type once; `single_const_inference`
infers each constant's type and value once; `sized_underflow_check`,
`const_reinference_without_compare` and `fast_fp16_cast_value` spare
copies and passes over every weight. They go with the "chunkforge"
pipeline (`CHUNKFORGE_MIL_SHORTCUTS=off` turns them off, `bench build
--compare shortcuts` compares); "coremltools" is coremltools' own
behaviour, pass for pass, for comparison (`bench build --baseline`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..contract import PassStat

# pass → why it cannot change a chunkforge program. Removing a pass removes
# every occurrence of it from the pipeline. A pass that changes any program
# stays in: `merge_consecutive_reshapes`, for one, merges decode's one-token
# reshapes to and from NCHW (model.py `to_nchw`/`from_nchw` with t = 1) with
# the head split after a projection and the head join before `o_proj`.
SKIPPED: dict[str, str] = {
    "common::lower_complex_dialect_ops": "no complex-number ops",
    "common::int_op_canonicalization": "no quantize/dequantize ops",
    "common::nullify_redundant_quantization_zero_point": "no quantize/dequantize ops",
    "common::dequantize_quantize_pair_elimination": "no quantize/dequantize ops",
    "common::distributive_quantized_binary_op_scale_normalization": "no quantize/dequantize ops",
    "common::dequantize_to_constexpr": "no dequantize ops (the LUTs come from the pass appended last)",
    "common::canonicalize_quantized_lut_pattern": "no LUT ops before the palettization pass",
    "common::sanitize_input_output_names": "the contract's names are valid identifiers already",
    "common::select_optimization": "no select ops",
    "common::add_conv_transpose_output_shape": "no conv_transpose ops",
    "common::loop_invariant_elimination": "no while_loop ops",
    "common::remove_symbolic_reshape": "every shape is static",
    "common::fuse_matmul_weight_bias": "no matmul followed by a bias add",
    "common::fuse_linear_bias": "projections have no bias",
    "common::fuse_gelu_tanh_approximation": "the torch frontend emits gelu(tanh) as one op",
    "common::fuse_gelu_exact": "no erf-based gelu pattern",
    "common::fuse_leaky_relu": "no leaky relu pattern",
    "common::rank0_expand_dims_swap": "no rank-0 expand_dims",
    "common::fuse_squeeze_expand_dims": "no squeeze followed by expand_dims",
    "common::compose_conv1d": "no conv1d pattern",
    "common::use_reflection_padding": "no padding ops",
    "common::merge_consecutive_paddings": "no padding ops",
    "common::fuse_pad_conv": "no padding ops",
    "common::image_input_preprocess": "no image inputs",
    "common::replace_stack_reshape": "no stack followed by reshape",
    "common::fuse_dilated_conv": "no space_to_batch/batch_to_space around a conv",
    "common::fuse_conv_scale": "no scale after a conv",
    "common::fuse_conv_bias": "no bias add after a conv",
    "common::fuse_onehot_matmul_to_gather": "no one_hot ops",
    "common::fuse_layernorm_or_instancenorm": "RMSNorm matches no layer/instance norm pattern",
    "common::fuse_elementwise_to_batchnorm": "no batch-norm pattern",
    "common::fuse_reduce_mean": "no reduce_sum-then-divide pattern",
    "common::fuse_conv_batchnorm": "no batch_norm ops",
    "common::detect_concat_interleave": "no interleaving concat",
    "common::concat_to_pixel_shuffle": "no pixel-shuffle concat",
    "common::fuse_prelu": "no prelu pattern",
    "common::prelu_to_lrelu": "no prelu ops",
    "common::merge_consecutive_relus": "no relu ops",
    "common::merge_consecutive_transposes": "no transpose feeds another transpose",
    "common::expand_high_rank_reshape_and_transpose": "every tensor is rank 5 or less",
    "common::fuse_stack_split": "no stack/split pairs",
    "common::add_int16_cast": "no op whose int32 inputs it narrows",
    "common::guard_negative_gather_indices": "no gather with possibly negative indices",
    "common::canonicalize_inplace_pattern": "no state (the KV caches are inputs and outputs)",
    "common::prefer_state_in_downstream": "no state",
    "common::merge_affine_dequantize_with_consecutive_ops": "no affine dequantize ops",
    "common::expand_dynamic_linear": "every linear weight is a constant",
}


def pipeline(default: bool) -> Any:
    """coremltools' default pipeline (`default`), or chunkforge's: the
    default one without the `SKIPPED` passes."""
    import coremltools as ct

    p = ct.PassPipeline.DEFAULT
    if not default:
        p.remove_passes(list(SKIPPED))
    return p


RELEASE_PASS = "chunkforge::release_torch_weights"


def _register_release_pass() -> None:
    from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY, register_pass

    if RELEASE_PASS in PASS_REGISTRY:
        return

    @register_pass(namespace="chunkforge")
    class release_torch_weights(AbstractGraphPass):
        """Frees the parameters and buffers of the torch module being converted
        (option `module`); changes nothing in the program."""

        def __init__(self) -> None:
            self.module: Any = None

        def apply(self, prog: Any) -> None:
            import gc

            import torch

            if self.module is None:
                return
            for t in [*self.module.parameters(), *self.module.buffers()]:
                t.data = torch.empty(0, dtype=t.dtype)
            self.module = None
            # The frontend's own objects (its torch graph and parameter
            # table) are reference cycles that still hold the tensors.
            gc.collect()


def release_torch_weights(pipeline: Any, module: Any) -> None:
    """Makes the first pass of `pipeline` free `module`'s weights.

    By then the torch frontend has made its own constants of them (the fp32
    constants of its fp32 program, which `add_fp16_cast` casts to fp16; from
    the fp32 trace `convert.trace` makes they share the module's storage)
    and its pipeline has dropped the constants it no longer needs. Until the
    end of `ct.convert` nothing reads the module again, yet it would keep
    every weight it holds alive through the pipeline's peak
    (`add_fp16_cast`, where the fp32 constant and its fp16 cast exist side
    by side): for a full-width E2B chunk of ten layers that is gigabytes.
    The pass also collects the frontend's finished objects (reference
    cycles that hold the tensors too). A weight the program still holds a
    view of stays alive through that view. `module` is unusable afterwards."""
    _register_release_pass()
    pipeline.insert_pass(0, RELEASE_PASS)
    pipeline.set_options(RELEASE_PASS, {"module": module})


def _fingerprint(prog: Any) -> str:
    """A digest of the program's structure: every op's type, name, input and
    output variables with their types, and every constant's bytes. Two
    programs a pass leaves with the same digest are the same program for this
    profile's purpose (did the pass change anything)."""
    h = hashlib.sha256()

    def block(b: Any) -> None:
        for v in b.inputs.values() if isinstance(b.inputs, dict) else b.inputs:
            h.update(f"in {v.name} {v.sym_type}\n".encode())
        for op in b.operations:
            ins = ",".join(
                f"{k}={getattr(v, 'name', [getattr(x, 'name', '?') for x in v] if isinstance(v, list | tuple) else v)}"
                for k, v in op.inputs.items()
            )
            outs = ",".join(f"{o.name}:{o.sym_type}" for o in op.outputs)
            h.update(f"{op.op_type} {op.name} ({ins}) -> {outs}\n".encode())
            for o in op.outputs:
                val = getattr(o, "val", None)
                if val is not None and hasattr(val, "tobytes"):
                    h.update(f"{getattr(val, 'dtype', '')}{getattr(val, 'shape', '')}".encode())
                    h.update(val.tobytes())
            for sub in op.blocks:
                block(sub)
        h.update(("out " + ",".join(o.name for o in b.outputs) + "\n").encode())

    for name, f in prog.functions.items():
        h.update(f"function {name}\n".encode())
        block(f)
    return h.hexdigest()


class PassProfile:
    """Times every graph pass coremltools runs while it is active (the
    frontend's, the main pipeline's and the backend's), and, with `probe`,
    counts the runs that changed the program (a structural digest before and
    after each run: slow, for finding passes to skip). Validation time is the
    row "(validate)"."""

    def __init__(self, probe: bool = False):
        self.probe = probe
        self.stats: dict[str, PassStat] = {}
        self._undo: list[Any] = []

    def _row(self, name: str) -> PassStat:
        return self.stats.setdefault(name, {"seconds": 0.0, "runs": 0, "changed": 0 if self.probe else None})

    def __enter__(self) -> PassProfile:
        from coremltools.converters.mil.mil.passes.pass_registry import PassRegistry
        from coremltools.converters.mil.mil.program import Program

        profile = self
        get_original = PassRegistry.__getitem__
        validate_original = Program.validate

        class Timed:
            def __init__(self, name: str, inner: Any):
                self._name, self._inner = name, inner

            def __getattr__(self, attr: str) -> Any:
                return getattr(self._inner, attr)

            def __call__(self, prog: Any) -> Any:
                before = _fingerprint(prog) if profile.probe else None
                started = time.perf_counter()
                try:
                    return self._inner(prog)
                finally:
                    row = profile._row(self._name)
                    row["seconds"] += time.perf_counter() - started
                    row["runs"] += 1
                    if before is not None and _fingerprint(prog) != before:
                        row["changed"] = (row["changed"] or 0) + 1

        def getitem(registry: Any, pass_id: str) -> Any:
            return Timed(pass_id, get_original(registry, pass_id))

        def validate(prog: Any, *args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            try:
                validate_original(prog, *args, **kwargs)
            finally:
                row = profile._row("(validate)")
                row["seconds"] += time.perf_counter() - started
                row["runs"] += 1

        PassRegistry.__getitem__ = getitem
        Program.validate = validate
        self._undo = [(PassRegistry, "__getitem__", get_original), (Program, "validate", validate_original)]
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, attr, original in reversed(self._undo):
            setattr(cls, attr, original)
        self._undo = []


@contextmanager
def maybe_profile(enabled: bool, probe: bool = False) -> Iterator[PassProfile | None]:
    if not enabled:
        yield None
        return
    with PassProfile(probe) as p:
        yield p


@contextmanager
def replaced(owner: Any, **replacements: Any) -> Iterator[None]:
    """Within the block, each attribute ``owner.<name>`` is its replacement;
    on leaving, what ``owner`` itself held under that name is restored (an
    attribute it inherited is deleted from it again)."""
    missing = object()
    originals = {name: owner.__dict__.get(name, missing) for name in replacements}
    for name, value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


@contextmanager
def shortcuts(enabled: bool = True) -> Iterator[None]:
    """Every shortcut through coremltools' own code that a conversion takes
    (each below, with the reason its result is the one coremltools' code
    gives): `validate_once`, `terse_program_text`, `fast_fp16_overflow_check`,
    `fast_nonreplaceable_propagation`, `cached_type_info`,
    `single_const_inference`, `sized_underflow_check`,
    `const_reinference_without_compare` and `fast_fp16_cast_value`; with the
    Rust palettizer, `palettize.whole_weight_compression` goes with them.
    None changes the program: with them and without them
    (`CHUNKFORGE_MIL_SHORTCUTS=off`) every package is byte-identical (`bench
    build --compare shortcuts`; tests/build.rs)."""
    with (
        validate_once(enabled),
        terse_program_text(enabled),
        fast_fp16_overflow_check(enabled),
        fast_nonreplaceable_propagation(enabled),
        cached_type_info(enabled),
        single_const_inference(enabled),
        sized_underflow_check(enabled),
        const_reinference_without_compare(enabled),
        fast_fp16_cast_value(enabled),
    ):
        yield


@contextmanager
def validate_once(enabled: bool = True) -> Iterator[None]:
    """Within the block, `Program.validate` only notes the program (and the
    strictest check asked for it); on leaving the block, each noted program is
    validated once. coremltools validates the whole program after each of
    its ~100 passes; this is the same check on the final program."""
    if not enabled:
        yield
        return
    from coremltools.converters.mil.mil.program import Program

    noted: dict[int, tuple[Any, bool]] = {}

    def note(prog: Any, check_essential_scope: bool = False) -> None:
        seen = noted.get(id(prog))
        noted[id(prog)] = (prog, bool(check_essential_scope) or (seen is not None and seen[1]))

    with replaced(Program, validate=note):
        yield
    for prog, essential in noted.values():
        prog.validate(check_essential_scope=essential)


@contextmanager
def terse_program_text(enabled: bool = True) -> Iterator[None]:
    """Within the block, a MIL program, function or block renders as a
    one-line summary unless coremltools' logger is at DEBUG: its pass
    pipeline formats the whole program into debug messages (before and after
    each pipeline), and `reduce_transposes` the whole function (before and
    after each of its runs), whether or not they are logged, which costs
    seconds on a 10k-op program (`reduce_transposes`: 2.9 of 11.6 s on the
    default checkpoint's `--mode four`). The program itself is untouched."""
    import logging

    from coremltools.converters.mil.mil.block import Block, Function
    from coremltools.converters.mil.mil.program import Program

    if not enabled or logging.getLogger("coremltools").isEnabledFor(logging.DEBUG):
        yield
        return

    def program(prog: Any) -> str:
        return f"<MIL program: {', '.join(prog.functions)}>"

    def block(b: Any) -> str:
        return f"<MIL block {b.name}: {len(b.operations)} ops>"

    with replaced(Program, __str__=program), replaced(Function, __str__=block), replaced(Block, __str__=block):
        yield


@contextmanager
def fast_fp16_overflow_check(enabled: bool = True) -> Iterator[None]:
    """Within the block, `add_fp16_cast`'s check of whether an op's fp32
    constants fit fp16 (`FP16ComputePrecision.fp16_overflow`) gives the same
    answer in one pass over each constant instead of four.

    coremltools' check takes the largest |v| below 1e38 through
    ``np.where``, building an int64 index array per dimension for every
    element of every weight (each torch weight is an fp32 constant at that
    point): 10 of the 27 s of a full-width conversion. Here a constant whose
    min and max are within ±65504 cannot overflow, which needs no copy; any
    other (an attention mask's -inf, NaN, a large value) takes coremltools'
    own rule, so the answer is the same for every constant."""
    if not enabled:
        yield
        return
    import numpy as np
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision

    def overflows(value: Any) -> bool:
        value = np.asarray(value)
        if value.size == 0:
            return False
        if -65504 <= value.min() and value.max() <= 65504:
            return False
        magnitude = np.abs(value)
        return bool(np.max(magnitude[magnitude < 1e38], initial=0.0) > 65504)

    def fp16_overflow(op: Any) -> bool:
        for inputs in op.inputs.values():
            for var in inputs if isinstance(inputs, list | tuple) else [inputs]:
                if (
                    var.op is not None
                    and var.op.op_type == "const"
                    and var.is_tensor_or_scalar_of(dtype="fp32")
                    and overflows(var.op.val.val)
                ):
                    return True
        return False

    with replaced(FP16ComputePrecision, fp16_overflow=staticmethod(fp16_overflow)):
        yield


@contextmanager
def fast_nonreplaceable_propagation(enabled: bool = True) -> Iterator[None]:
    """Within the block, leaving a `with block:` (every graph pass that edits
    the program does, often several times) skips coremltools' recomputation
    of every variable's set of non-replaceable variables upstream for as long
    as every such set is necessarily empty.

    coremltools recomputes that set for every output of every op on each
    exit (`Block._propagate_nonreplaceable_vars`): the union of the sets of
    the op's inputs, `{var}` for the output of a `constexpr_` op, empty for
    `shape`; each variable an op makes gets its set the same way when it is
    made, and again when the op's inputs change
    (`Var._set_nonreplaceable_vars_upstream`). So a set is non-empty only
    downstream of a `constexpr_` op's output. Until the first variable made
    by a `constexpr_` op asks for its set, every set is empty and both
    computations change nothing; from then on, coremltools' own code runs.
    A chunkforge program has no `constexpr_` op until the palettization pass
    appended last, yet the two were 22 % of a conversion's time on the
    default checkpoint (cProfile, `--mode four`)."""
    if not enabled:
        yield
        return
    from coremltools.converters.mil.mil.block import Block
    from coremltools.converters.mil.mil.var import Var

    original_propagate = Block.__dict__["_propagate_nonreplaceable_vars"]
    original_set = Var.__dict__["_set_nonreplaceable_vars_upstream"]
    seen = False

    def set_upstream(var: Any) -> None:
        nonlocal seen
        if not seen:
            op = var.op
            if op is None or not op.op_type.startswith("constexpr_"):
                # Every set is empty: so is the union of the inputs' sets
                # (and `shape`'s), which is the set `var` already has.
                return
            seen = True
        original_set(var)

    def propagate(block: Any) -> None:
        if seen:
            original_propagate(block)

    with (
        replaced(Var, _set_nonreplaceable_vars_upstream=set_upstream),
        replaced(Block, _propagate_nonreplaceable_vars=propagate),
    ):
        yield


@contextmanager
def cached_type_info(enabled: bool = True) -> Iterator[None]:
    """Within the block, coremltools' `get_type_info` of a MIL type (a class:
    `types.fp16`, each `types.tensor(dtype, shape)`, ...) is computed once per
    type instead of on every call.

    Every `types.is_tensor`, `is_list`, `is_str`, `is_dict`, `is_state` and
    `Var.dtype` builds a fresh `Type` description of its argument (a tensor
    type's also builds its element type's), 2.3 million of them in the
    default checkpoint's `--mode four`, 14 % of its conversion time
    (cProfile). A type's description depends on the type alone (its shape
    and element type are fixed when the class is made, and `tensor` classes
    are memoised per dtype and shape), and no caller changes the `Type` it is
    given, so the cached answer is the one coremltools would compute.
    Arguments that are not classes are not cached; every module that
    imported the function gets the cached one for the duration."""
    if not enabled:
        yield
        return
    import importlib
    import sys

    # (the package `types` exports the function under the module's name)
    original = importlib.import_module("coremltools.converters.mil.mil.types.get_type_info").get_type_info
    cache: dict[type, Any] = {}

    def get_type_info(t: Any) -> Any:
        if isinstance(t, type):
            found = cache.get(t)
            if found is None:
                found = cache[t] = original(t)
            return found
        return original(t)

    patched: list[Any] = [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("coremltools") and getattr(m, "get_type_info", None) is original
    ]
    for m in patched:
        m.get_type_info = get_type_info
    try:
        yield
    finally:
        for m in patched:
            m.get_type_info = original


@contextmanager
def single_const_inference(enabled: bool = True) -> Iterator[None]:
    """Within the block, making a `const` op works out its value's type and
    value once instead of twice.

    coremltools' `Const` answers `type_inference` and then `value_inference`
    (one right after the other, in `Operation.type_value_inference`) with the
    same `_get_type_val(self.val.val)` each time: 89 thousand calls and 9 %
    of the default checkpoint's `--mode four` conversions (cProfile). Here
    `type_inference` keeps its answer for the value object it was given and
    `value_inference` takes it if asked about that same object next; any
    other call computes it as coremltools does."""
    if not enabled:
        yield
        return
    from coremltools.converters.mil.mil.ops.defs.iOS15.control_flow import Const

    last: dict[int, tuple[Any, Any]] = {}

    def type_inference(op: Any) -> Any:
        value = op.val.val
        builtin_type, val = op._get_type_val(value)
        last.clear()
        last[id(op)] = (value, val)
        return builtin_type

    def value_inference(op: Any) -> Any:
        value = op.val.val
        kept = last.pop(id(op), None)
        if kept is not None and kept[0] is value:
            return kept[1]
        return op._get_type_val(value)[1]

    try:
        with replaced(Const, type_inference=type_inference, value_inference=value_inference):
            yield
    finally:
        last.clear()


@contextmanager
def sized_underflow_check(enabled: bool = True) -> Iterator[None]:
    """Within the block, `add_fp16_cast`'s check of whether a constant's
    values underflow to zero in fp16 (`_check_underflow_to_zero`) skips
    constants of 400 values or more without copying them first.

    coremltools' check applies only to constants of fewer than 400 values,
    but it learns a constant's size by flattening it (`len(val.flatten())`,
    a copy of the whole weight): 14 of the 101 s of a full-width `--mode
    four` build's conversions (cProfile). An array's `size` is the length of
    its flattened copy, so an array of 400 values or more is skipped here as
    there; every other case runs coremltools' own check."""
    if not enabled:
        yield
        return
    import numpy as np
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision

    original = FP16ComputePrecision.__dict__["_check_underflow_to_zero"]

    def check(self: Any, new_var: Any, var: Any) -> None:
        value = var.val
        if isinstance(value, np.ndarray) and value.size >= 400 and new_var.val is not None:
            return
        original(self, new_var, var)

    with replaced(FP16ComputePrecision, _check_underflow_to_zero=check):
        yield


@contextmanager
def const_reinference_without_compare(enabled: bool = True) -> Iterator[None]:
    """Within the block, re-inferring a `const` op with `overwrite_output`
    (`reduce_transposes` re-infers every op of the function after each of
    its runs) sets the output's type and value without comparing the value
    with itself.

    With `overwrite_output`, coremltools' `Operation.type_value_inference`
    first replaces the output's type and value with the new ones, then
    compares the new value with the output's value, now the same object,
    element by element (`np.any(new != old)`), and if they differ assigns
    the new value again: the comparison cannot change anything, and on every
    weight it is a pass and a boolean array the size of the weight (6.5 of
    the 101 s of a full-width `--mode four` build's conversions, cProfile).
    Here a `const` op gets the same assignments (type, value, the output's
    non-replaceable set) without it; any other op, or a call without
    `overwrite_output`, runs coremltools' own code."""
    if not enabled:
        yield
        return
    from coremltools.converters.mil.mil.operation import Operation

    original = Operation.__dict__["type_value_inference"]

    def type_value_inference(op: Any, overwrite_output: bool = False) -> None:
        if not overwrite_output or op.op_type != "const" or op._output_vars is None or len(op._output_vars) != 1:
            return original(op, overwrite_output)
        sym_type = op.type_inference()
        (sym_val,) = op._auto_val((sym_type,))
        var = op._output_vars[0]
        var._sym_type = sym_type
        var._sym_val = sym_val
        var._set_nonreplaceable_vars_upstream()
        return None

    with replaced(Operation, type_value_inference=type_value_inference):
        yield


# fp32 → fp16 by torch only from this many values: below it numpy's
# conversion is as fast and the tensor wrapping is overhead.
TORCH_CAST_MIN_VALUES = 1 << 16


@contextmanager
def fast_fp16_cast_value(enabled: bool = True) -> Iterator[None]:
    """Within the block, the value of a `cast` of an fp32 weight to fp16 is
    converted by torch's vectorised kernel instead of numpy's `astype`.

    `add_fp16_cast` casts every fp32 weight to fp16, and the cast's value is
    worked out when the op is made (`cast.get_cast_value`, numpy's scalar
    conversion loop): 7.6 of the 101 s of a full-width `--mode four` build's
    conversions (cProfile). torch's conversion is 5-8x faster here. Both
    round to nearest, ties to even, give the same subnormals and overflow
    to the same infinities (every one of the 2^32 fp32 bit patterns that is
    not a NaN, checked with `scripts/check_fp16_cast.py`); NaN payloads are
    the one difference, so a result holding a NaN is recomputed by numpy.
    The fast path takes only C-contiguous, writeable fp32 arrays of at least
    `TORCH_CAST_MIN_VALUES` values (the shape and layout `astype` gives such
    an array); anything else runs coremltools' own code."""
    if not enabled:
        yield
        return
    import numpy as np
    import torch
    from coremltools.converters.mil.mil.ops.defs.iOS15.elementwise_unary import cast

    original = cast.__dict__["get_cast_value"]

    def get_cast_value(cls: Any, input_var: Any, dtype_val: str) -> Any:
        value = input_var.val
        if (
            dtype_val == "fp16"
            and isinstance(value, np.ndarray)
            and value.dtype == np.float32
            and value.size >= TORCH_CAST_MIN_VALUES
            and value.flags.c_contiguous
            and value.flags.writeable
        ):
            half = torch.from_numpy(value).to(torch.float16)
            # A NaN anywhere makes both ends NaN (one reduction, no mask).
            lo, hi = torch.aminmax(half)
            if not (bool(torch.isnan(lo)) or bool(torch.isnan(hi))):
                return half.numpy()
        return original.__func__(cls, input_var, dtype_val)

    with replaced(cast, get_cast_value=classmethod(get_cast_value)):
        yield
