"""MIL ops in torch (CPU), one function per op type, as coremltools defines
them (``coremltools/converters/mil/mil/ops/defs/iOS15..iOS18``): the same
inputs, the same defaults for inputs a program leaves out, the same semantics.

Each op gets its inputs by name (``Args``): float tensors as float32, integer
tensors as int32, bools as bool, strings as ``str``, variadic inputs
(``concat``'s ``values``) as lists. It returns one tensor or a tuple (one per
output). The interpreter casts each output to the program's declared type
(and, in fp16 mode, rounds fp16 outputs), so an op computes in float32 and
need not care about fp16.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..weights import Stored

Args = dict[str, Any]
Result = torch.Tensor | tuple[torch.Tensor, ...]
Impl = Callable[[Args], Result]

OPS: dict[str, Impl] = {}


def op(*names: str) -> Callable[[Impl], Impl]:
    def register(fn: Impl) -> Impl:
        for n in names:
            OPS[n] = fn
        return fn

    return register


class OpError(ValueError):
    """An op's inputs break its definition (the interpreter names the op)."""


# ---- reading inputs ---------------------------------------------------------


def ints(v: Any) -> list[int]:
    if isinstance(v, tuple):
        return list(v)
    if isinstance(v, torch.Tensor):
        return [int(x) for x in v.reshape(-1).tolist()]
    return [int(x) for x in np.asarray(v).reshape(-1).tolist()]


def one_int(v: Any) -> int:
    values = ints(v)
    if len(values) != 1:
        raise OpError(f"expected one integer, got {values}")
    return values[0]


def flag(v: Any) -> bool:
    if isinstance(v, tuple):
        return bool(v[0])
    return bool(v.reshape(-1)[0]) if isinstance(v, torch.Tensor) else bool(v)


def flags(v: Any, rank: int) -> list[bool]:
    if v is None:
        return [False] * rank
    if isinstance(v, tuple):
        return [bool(x) for x in v]
    return [bool(x) for x in v.reshape(-1).tolist()]


def number(v: Any) -> float:
    return float(v.reshape(-1)[0]) if isinstance(v, torch.Tensor) else float(v)


# Constant inputs that only parameterize an op (axes, shapes, slices,
# flags; small integers or bools), and scalar float ones (eps, bounds): the
# interpreter hands them to the op as a tuple or a float once read, not as
# a tensor to read again at every run (`parameter`). Every helper above
# takes either form.
INT_PARAMS = frozenset(
    {
        "axis", "axes", "perm", "shape", "begin", "end", "stride", "begin_mask", "end_mask", "squeeze_mask",
        "keep_dims", "transpose_x", "transpose_y", "split_sizes", "num_splits", "reps", "pad", "strides",
        "dilations", "groups", "interleave", "k", "batch_dims", "ascending", "sort", "return_indices",
        "exclusive", "reverse", "lower", "upper", "size", "vector_axis",
    }
)  # fmt: skip
FLOAT_PARAMS = frozenset({"epsilon", "alpha", "constant_val"})
# Ops that read one of those names as a tensor.
TENSOR_PARAMS = frozenset({"range_1d"})


def parameter(op_type: str, arg: str, value: Any) -> Any:
    """A constant input as `Function` hands it to the op on every run."""
    if op_type in TENSOR_PARAMS or not isinstance(value, torch.Tensor) or value.numel() > 64:
        return value
    if arg in INT_PARAMS and not value.dtype.is_floating_point:
        return tuple(int(x) if value.dtype != torch.bool else bool(x) for x in value.reshape(-1).tolist())
    floats = arg in FLOAT_PARAMS or (op_type == "clip" and arg == "beta")
    if floats and value.dtype.is_floating_point and value.numel() == 1:
        return float(value.reshape(-1)[0])
    return value


def text(v: Any) -> str:
    if not isinstance(v, str):
        raise OpError(f"expected a string, got {type(v).__name__}")
    return v


def axis_of(a: int, rank: int) -> int:
    if not -rank <= a < max(rank, 1):
        raise OpError(f"axis {a} is out of range for rank {rank}")
    return a + rank if a < 0 else a


def axes_of(v: Any, rank: int) -> list[int] | None:
    """``axes`` of a reduction or normalization (None: every axis)."""
    if v is None:
        return None
    return [axis_of(a, rank) for a in ints(v)]


def is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point


# ---- elementwise -------------------------------------------------------------


def binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Impl:
    return lambda a: fn(a["x"], a["y"])


def real_div(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.true_divide(x, y)


BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "real_div": real_div,
    "floor_div": torch.floor_divide,
    "mod": torch.remainder,
    "pow": torch.pow,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "equal": torch.eq,
    "not_equal": torch.ne,
    "less": torch.lt,
    "less_equal": torch.le,
    "greater": torch.gt,
    "greater_equal": torch.ge,
    "logical_and": torch.logical_and,
    "logical_or": torch.logical_or,
    "logical_xor": torch.logical_xor,
}
for _name, _fn in BINARY.items():
    OPS[_name] = binary(_fn)


def unary(fn: Callable[[torch.Tensor], torch.Tensor]) -> Impl:
    return lambda a: fn(a["x"])


UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "abs": torch.abs,
    "acos": torch.acos,
    "asin": torch.asin,
    "atan": torch.atan,
    "atanh": torch.atanh,
    "ceil": torch.ceil,
    "cos": torch.cos,
    "cosh": torch.cosh,
    "erf": torch.erf,
    "exp": torch.exp,
    "exp2": torch.exp2,
    "floor": torch.floor,
    # np.round: halves to even, as torch.round.
    "round": torch.round,
    "sign": torch.sign,
    "sin": torch.sin,
    "sinh": torch.sinh,
    "sqrt": torch.sqrt,
    "square": torch.square,
    "tan": torch.tan,
    "tanh": torch.tanh,
    "relu": torch.relu,
    "relu6": lambda x: torch.clamp(x, 0.0, 6.0),
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "softplus": F.softplus,
    "softsign": F.softsign,
    "logical_not": torch.logical_not,
    "identity": lambda x: x,
}
for _name, _ufn in UNARY.items():
    OPS[_name] = unary(_ufn)


@op("rsqrt")
def rsqrt(a: Args) -> Result:
    eps = number(a["epsilon"]) if a.get("epsilon") is not None else 1e-12
    return torch.rsqrt(a["x"] + eps)


@op("inverse")
def inverse(a: Args) -> Result:
    eps = number(a["epsilon"]) if a.get("epsilon") is not None else 1e-4
    return torch.reciprocal(a["x"] + eps)


@op("log")
def log(a: Args) -> Result:
    eps = number(a["epsilon"]) if a.get("epsilon") is not None else 1e-45
    return torch.log(a["x"] + eps)


@op("clip")
def clip(a: Args) -> Result:
    return torch.clamp(a["x"], number(a["alpha"]), number(a["beta"]))


@op("threshold")
def threshold(a: Args) -> Result:
    return torch.clamp(a["x"], min=number(a["alpha"]))


@op("leaky_relu")
def leaky_relu(a: Args) -> Result:
    alpha = number(a["alpha"]) if a.get("alpha") is not None else 0.01
    return F.leaky_relu(a["x"], alpha)


@op("elu")
def elu(a: Args) -> Result:
    alpha = number(a["alpha"]) if a.get("alpha") is not None else 1.0
    return F.elu(a["x"], alpha)


@op("gelu")
def gelu(a: Args) -> Result:
    mode = text(a["mode"]) if a.get("mode") is not None else "EXACT"
    x = a["x"]
    if mode == "EXACT":
        return F.gelu(x)
    if mode == "TANH_APPROXIMATION":
        return F.gelu(x, approximate="tanh")
    if mode == "SIGMOID_APPROXIMATION":
        return x * torch.sigmoid(1.702 * x)
    raise OpError(f"unknown gelu mode {mode}")


@op("softmax")
def softmax(a: Args) -> Result:
    x = a["x"]
    axis = one_int(a["axis"]) if a.get("axis") is not None else -1
    return torch.softmax(x, dim=axis_of(axis, x.dim()))


@op("select")
def select(a: Args) -> Result:
    return torch.where(a["cond"].bool(), a["a"], a["b"])


@op("cast")
def cast(a: Args) -> Result:
    # The interpreter casts to the declared output type; a float-to-int cast
    # truncates toward zero (numpy's astype, which coremltools' value inference uses).
    dtype = text(a["dtype"])
    x = a["x"]
    if dtype == "bool":
        return x != 0
    if dtype.startswith(("int", "uint")) and is_float(x):
        return torch.trunc(x)
    return x


# ---- linear algebra ------------------------------------------------------------


@op("linear")
def linear(a: Args) -> Result:
    w = a["weight"]
    if isinstance(w, Stored):
        y = w.linear(a["x"])
        return y + a["bias"] if a.get("bias") is not None else y
    return F.linear(a["x"], w, a.get("bias"))


@op("matmul")
def matmul(a: Args) -> Result:
    x, y = a["x"], a["y"]
    if a.get("transpose_x") is not None and flag(a["transpose_x"]) and x.dim() >= 2:
        x = x.transpose(-1, -2)
    if a.get("transpose_y") is not None and flag(a["transpose_y"]) and y.dim() >= 2:
        y = y.transpose(-1, -2)
    return torch.matmul(x, y)


def same_pads(size: list[int], kernel: list[int], strides: list[int], dilations: list[int], lower: bool) -> list[int]:
    """``same`` / ``same_lower`` padding, before and after each spatial dim:
    output size ceil(in / stride). An odd total puts the extra row after
    (``same``, TensorFlow's SAME) or before (``same_lower``)."""
    pads = []
    for i, k, s, d in zip(size, kernel, strides, dilations, strict=True):
        eff = (k - 1) * d + 1
        total = max(0, (math.ceil(i / s) - 1) * s + eff - i)
        small, big = total // 2, total - total // 2
        pads += [big, small] if lower else [small, big]
    return pads


@op("conv")
def conv(a: Args) -> Result:
    x, w = a["x"], a["weight"]
    if isinstance(w, Stored):
        if pointwise(a, x, w):
            y = w.conv(x)
            bias = a.get("bias")
            return y + bias.reshape([1, -1] + [1] * (x.dim() - 2)) if bias is not None else y
        w = w.dense()
    spatial = x.dim() - 2
    if spatial not in (1, 2, 3) or w.dim() != x.dim():
        raise OpError(f"conv of a rank-{x.dim()} input with a rank-{w.dim()} weight")
    strides = ints(a["strides"]) if a.get("strides") is not None else [1] * spatial
    dilations = ints(a["dilations"]) if a.get("dilations") is not None else [1] * spatial
    groups = one_int(a["groups"]) if a.get("groups") is not None else 1
    pad_type = text(a["pad_type"]) if a.get("pad_type") is not None else "valid"
    if pad_type == "valid":
        pads = [0] * (2 * spatial)
    elif pad_type == "custom":
        pads = ints(a["pad"]) if a.get("pad") is not None else [0] * (2 * spatial)
    elif pad_type in ("same", "same_lower"):
        pads = same_pads(list(x.shape[2:]), list(w.shape[2:]), strides, dilations, pad_type == "same_lower")
    else:
        raise OpError(f"unknown pad_type {pad_type}")
    if len(pads) != 2 * spatial:
        raise OpError(f"pad has {len(pads)} values for {spatial} spatial dims")
    if any(pads):
        # F.pad lists the last dim first.
        x = F.pad(x, [p for i in reversed(range(spatial)) for p in pads[2 * i : 2 * i + 2]])
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spatial]
    return fn(x, w, a.get("bias"), stride=strides, dilation=dilations, groups=groups)


def pointwise(a: Args, x: torch.Tensor, w: Stored) -> bool:
    """Whether a conv of ``w`` is a projection of every position (1x1
    kernel, stride 1, no padding, one group): the kernels' product."""
    spatial = x.dim() - 2
    if spatial not in (1, 2, 3) or len(w.shape) != x.dim() or any(d != 1 for d in w.shape[2:]):
        return False
    if int(x.shape[1]) != w.cols:
        return False
    strides = ints(a["strides"]) if a.get("strides") is not None else [1] * spatial
    groups = one_int(a["groups"]) if a.get("groups") is not None else 1
    pad_type = text(a["pad_type"]) if a.get("pad_type") is not None else "valid"
    pads = ints(a["pad"]) if pad_type == "custom" and a.get("pad") is not None else [0]
    # A 1x1 kernel needs no padding for "same"; "custom" must pad nothing.
    return (
        groups == 1
        and all(s == 1 for s in strides)
        and pad_type in ("valid", "same", "same_lower", "custom")
        and not any(pads)
    )


# ---- normalization ---------------------------------------------------------------


@op("layer_norm")
def layer_norm(a: Args) -> Result:
    x = a["x"]
    axes = axes_of(a.get("axes"), x.dim())
    if axes is None:
        axes = list(range(x.dim()))
    eps = number(a["epsilon"]) if a.get("epsilon") is not None else 1e-5
    mean = x.mean(dim=axes, keepdim=True)
    centered = x - mean
    var = centered.square().mean(dim=axes, keepdim=True)
    out = centered / torch.sqrt(var + eps)
    # gamma / beta have the normalized axes' shape.
    shape = [x.shape[i] if i in axes else 1 for i in range(x.dim())]
    if a.get("gamma") is not None:
        out = out * a["gamma"].reshape(shape)
    if a.get("beta") is not None:
        out = out + a["beta"].reshape(shape)
    return out


# ---- reductions -------------------------------------------------------------------


def reduction(fn: Callable[[torch.Tensor, list[int], bool], torch.Tensor]) -> Impl:
    def impl(a: Args) -> Result:
        x = a["x"]
        axes = axes_of(a.get("axes"), x.dim())
        keep = flag(a["keep_dims"]) if a.get("keep_dims") is not None else False
        return fn(x, list(range(x.dim())) if axes is None else axes, keep)

    return impl


def amax(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return torch.amax(x, dim=axes, keepdim=keep)


def amin(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    return torch.amin(x, dim=axes, keepdim=keep)


def prod(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    for ax in sorted(axes, reverse=True):
        x = torch.prod(x, dim=ax, keepdim=keep) if keep else torch.prod(x, dim=ax)
    return x


REDUCTIONS: dict[str, Callable[[torch.Tensor, list[int], bool], torch.Tensor]] = {
    "reduce_sum": lambda x, ax, k: torch.sum(x, dim=ax, keepdim=k),
    "reduce_mean": lambda x, ax, k: torch.mean(x, dim=ax, keepdim=k),
    "reduce_max": amax,
    "reduce_min": amin,
    "reduce_prod": prod,
    "reduce_sum_square": lambda x, ax, k: torch.sum(x * x, dim=ax, keepdim=k),
    "reduce_l1_norm": lambda x, ax, k: torch.sum(torch.abs(x), dim=ax, keepdim=k),
    "reduce_l2_norm": lambda x, ax, k: torch.sqrt(torch.sum(x * x, dim=ax, keepdim=k)),
    "reduce_log_sum": lambda x, ax, k: torch.log(torch.sum(x, dim=ax, keepdim=k)),
    "reduce_log_sum_exp": lambda x, ax, k: torch.logsumexp(x, dim=ax, keepdim=k),
}
for _name, _rfn in REDUCTIONS.items():
    OPS[_name] = reduction(_rfn)


def arg_reduction(fn: Callable[..., torch.Tensor]) -> Impl:
    def impl(a: Args) -> Result:
        x = a["x"]
        axis = axis_of(one_int(a["axis"]) if a.get("axis") is not None else -1, x.dim())
        keep = flag(a["keep_dims"]) if a.get("keep_dims") is not None else False
        # The first of equal values, as numpy's argmax.
        return fn(x, dim=axis, keepdim=keep).to(torch.int32)

    return impl


OPS["reduce_argmax"] = arg_reduction(torch.argmax)
OPS["reduce_argmin"] = arg_reduction(torch.argmin)


@op("topk")
def topk(a: Args) -> Result:
    x = a["x"]
    k = one_int(a["k"]) if a.get("k") is not None else 1
    axis = axis_of(one_int(a["axis"]) if a.get("axis") is not None else -1, x.dim())
    ascending = flag(a["ascending"]) if a.get("ascending") is not None else False
    # iOS16+: sort (default True) and return_indices (default True).
    ordered = flag(a["sort"]) if a.get("sort") is not None else True
    values, indices = torch.topk(x, k, dim=axis, largest=not ascending, sorted=True)
    if not ordered:
        # Unsorted: coremltools leaves the order unspecified; keep the input order.
        order = torch.argsort(indices, dim=axis)
        values, indices = torch.gather(values, axis, order), torch.gather(indices, axis, order)
    if a.get("return_indices") is not None and not flag(a["return_indices"]):
        return values
    return values, indices.to(torch.int32)


# ---- shapes and copies --------------------------------------------------------------


@op("reshape")
def reshape(a: Args) -> Result:
    x = a["x"]
    shape = ints(a["shape"])
    # iOS17: each 0 copies the input dim it lines up with counting from the
    # right (1 past the input's rank); -1 takes what is left.
    out = []
    for i, s in enumerate(shape):
        if s == 0:
            j = x.dim() - (len(shape) - i)
            out.append(int(x.shape[j]) if j >= 0 else 1)
        else:
            out.append(s)
    return x.reshape(out)


@op("transpose")
def transpose(a: Args) -> Result:
    x = a["x"]
    return x.permute([axis_of(p, x.dim()) for p in ints(a["perm"])])


@op("expand_dims")
def expand_dims(a: Args) -> Result:
    x = a["x"]
    axes = ints(a["axes"])
    rank = x.dim() + len(axes)
    shape = list(x.shape)
    for ax in sorted(axis_of(v, rank) for v in axes):
        shape.insert(ax, 1)
    return x.reshape(shape)


@op("squeeze")
def squeeze(a: Args) -> Result:
    x = a["x"]
    if a.get("axes") is None:
        return x.reshape([d for d in x.shape if d != 1])
    axes = {axis_of(v, x.dim()) for v in ints(a["axes"])}
    for ax in axes:
        if x.shape[ax] != 1:
            raise OpError(f"cannot squeeze axis {ax} of size {x.shape[ax]}")
    return x.reshape([d for i, d in enumerate(x.shape) if i not in axes])


@op("concat")
def concat(a: Args) -> Result:
    values = a["values"]
    x0 = values[0]
    axis = axis_of(one_int(a["axis"]), x0.dim())
    if a.get("interleave") is not None and flag(a["interleave"]):
        # output[k::n] = values[k] along axis.
        stacked = torch.stack(values, dim=axis + 1)
        shape = list(x0.shape)
        shape[axis] *= len(values)
        return stacked.reshape(shape)
    return torch.cat(values, dim=axis)


@op("stack")
def stack(a: Args) -> Result:
    values = a["values"]
    return torch.stack(values, dim=axis_of(one_int(a["axis"]), values[0].dim() + 1))


@op("split")
def split(a: Args) -> Result:
    x = a["x"]
    axis = axis_of(one_int(a["axis"]), x.dim())
    if a.get("split_sizes") is not None:
        sizes = ints(a["split_sizes"])
    elif a.get("num_splits") is not None:
        n = one_int(a["num_splits"])
        if x.shape[axis] % n:
            raise OpError(f"num_splits {n} does not divide dim {axis} of size {x.shape[axis]}")
        sizes = [x.shape[axis] // n] * n
    else:
        raise OpError("split needs num_splits or split_sizes")
    return tuple(torch.split(x, sizes, dim=axis))


def index_slices(
    shape: tuple[int, ...],
    begin: list[int],
    end: list[int],
    stride: list[int] | None,
    begin_mask: list[bool],
    end_mask: list[bool],
    squeeze_mask: list[bool],
) -> list[slice]:
    """slice_by_index's python slices (coremltools' solve_slice_by_index_slice):
    a masked begin / end is open, a squeezed dim takes the one element at begin."""
    rank = len(shape)
    if not len(begin) == len(end) == rank:
        raise OpError(f"begin / end of length {len(begin)} / {len(end)} for rank {rank}")
    steps = stride or [1] * rank
    out = []
    for i in range(rank):
        b: int | None = None if begin_mask[i] else begin[i]
        e: int | None = None if end_mask[i] else end[i]
        s = steps[i]
        if squeeze_mask[i]:
            e, s = None, np.iinfo(np.int32).max
        out.append(slice(b, e, s))
    return out


def slice_args(a: Args, rank: int) -> tuple[list[slice], list[int]]:
    x_shape = tuple(a["x"].shape)
    slices = index_slices(
        x_shape,
        ints(a["begin"]),
        ints(a["end"]),
        ints(a["stride"]) if a.get("stride") is not None else None,
        flags(a.get("begin_mask"), rank),
        flags(a.get("end_mask"), rank),
        flags(a.get("squeeze_mask"), rank),
    )
    squeezed = [i for i, m in enumerate(flags(a.get("squeeze_mask"), rank)) if m]
    return slices, squeezed


def take(x: torch.Tensor, slices: list[slice]) -> torch.Tensor:
    """``x[slices]`` with numpy semantics, negative steps included (torch has none)."""
    if all(s.step is None or s.step > 0 for s in slices):
        return x[tuple(slices)]
    for d, s in enumerate(slices):
        if s.step is not None and s.step < 0:
            idx = torch.arange(*s.indices(x.shape[d]))
            x = x.index_select(d, idx)
        else:
            x = x[(slice(None),) * d + (s,)]
    return x


@op("slice_by_index")
def slice_by_index(a: Args) -> Result:
    x = a["x"]
    slices, squeezed = slice_args(a, x.dim())
    out = take(x, slices)
    if squeezed:
        out = out.reshape([d for i, d in enumerate(out.shape) if i not in squeezed])
    return out


@op("slice_by_size")
def slice_by_size(a: Args) -> Result:
    x = a["x"]
    begin, size = ints(a["begin"]), ints(a["size"])
    slices = []
    for d, (b, n) in enumerate(zip(begin, size, strict=True)):
        b = b + x.shape[d] if b < 0 else b
        slices.append(slice(b, x.shape[d] if n == -1 else b + n))
    return x[tuple(slices)]


@op("slice_update")
def slice_update(a: Args) -> Result:
    x = a["x"]
    slices, _ = slice_args(a, x.dim())
    ranges = [torch.arange(*s.indices(x.shape[d])) for d, s in enumerate(slices)]
    out = x.clone()
    grid = torch.meshgrid(*ranges, indexing="ij")
    out[grid] = a["update"].reshape([len(r) for r in ranges]).to(out.dtype)
    return out


@op("pad")
def pad(a: Args) -> Result:
    x = a["x"]
    pads = ints(a["pad"])
    mode = text(a["mode"]) if a.get("mode") is not None else "constant"
    value = number(a["constant_val"]) if a.get("constant_val") is not None else 0.0
    n = len(pads) // 2
    if len(pads) % 2 or n > x.dim():
        raise OpError(f"pad of {len(pads)} values for rank {x.dim()}")
    if mode == "constant":
        return F.pad(x, [p for i in reversed(range(n)) for p in pads[2 * i : 2 * i + 2]], value=value)
    if mode not in ("reflect", "replicate"):
        raise OpError(f"unknown pad mode {mode}")
    widths = [(0, 0)] * (x.dim() - n) + [(pads[2 * i], pads[2 * i + 1]) for i in range(n)]
    padded = np.pad(x.numpy(), widths, mode="edge" if mode == "replicate" else "reflect")
    return torch.from_numpy(np.ascontiguousarray(padded))


@op("tile")
def tile(a: Args) -> Result:
    return a["x"].repeat(ints(a["reps"]))


@op("fill")
def fill(a: Args) -> Result:
    value = a.get("value")
    v = value.reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(0.0)
    return torch.full(ints(a["shape"]), v.item(), dtype=v.dtype)


@op("range_1d")
def range_1d(a: Args) -> Result:
    start, end, step = a["start"], a["end"], a["step"]
    return torch.arange(start.item(), end.item(), step.item(), dtype=start.dtype)


@op("band_part")
def band_part(a: Args) -> Result:
    x = a["x"]
    lower = one_int(a["lower"]) if a.get("lower") is not None else -1
    upper = one_int(a["upper"]) if a.get("upper") is not None else -1
    m, n = x.shape[-2], x.shape[-1]
    i = torch.arange(m).view(m, 1)
    j = torch.arange(n).view(1, n)
    keep = torch.ones((m, n), dtype=torch.bool)
    if lower >= 0:
        keep &= i - j <= lower
    if upper >= 0:
        keep &= j - i <= upper
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype))


@op("cumsum")
def cumsum(a: Args) -> Result:
    x = a["x"]
    axis = axis_of(one_int(a["axis"]) if a.get("axis") is not None else 0, x.dim())
    exclusive = flag(a["exclusive"]) if a.get("exclusive") is not None else False
    reverse = flag(a["reverse"]) if a.get("reverse") is not None else False
    if reverse:
        x = torch.flip(x, [axis])
    out = torch.cumsum(x, dim=axis)
    if exclusive:
        out = out - x
    return torch.flip(out, [axis]) if reverse else out


@op("shape")
def shape(a: Args) -> Result:
    return torch.tensor(list(a["x"].shape), dtype=torch.int32)


# ---- gather and scatter ---------------------------------------------------------------


def wrap(indices: torch.Tensor, size: int) -> torch.Tensor:
    """Indices as int64, negative ones counted from the end."""
    idx = indices.to(torch.int64)
    return torch.where(idx < 0, idx + size, idx)


def gather_plain(x: torch.Tensor, indices: torch.Tensor, axis: int) -> torch.Tensor:
    idx = wrap(indices, x.shape[axis])
    out = x.index_select(axis, idx.reshape(-1))
    return out.reshape(list(x.shape[:axis]) + list(indices.shape) + list(x.shape[axis + 1 :]))


@op("gather")
def gather(a: Args) -> Result:
    x, indices = a["x"], a["indices"]
    axis = axis_of(one_int(a["axis"]) if a.get("axis") is not None else 0, x.dim())
    batch = one_int(a["batch_dims"]) if a.get("batch_dims") is not None else 0
    if batch == 0:
        return gather_plain(x, indices, axis)
    # batch_dims leading dims of x and indices are matched pairwise.
    lead = list(x.shape[:batch])
    xs = x.reshape([-1] + list(x.shape[batch:]))
    ids = indices.reshape([-1] + list(indices.shape[batch:]))
    parts = [gather_plain(xi, ii, axis - batch) for xi, ii in zip(xs, ids, strict=True)]
    out = torch.stack(parts)
    return out.reshape(lead + list(out.shape[1:]))


@op("gather_along_axis")
def gather_along_axis(a: Args) -> Result:
    x, indices = a["x"], a["indices"]
    axis = axis_of(one_int(a["axis"]) if a.get("axis") is not None else 0, x.dim())
    return torch.gather(x, axis, wrap(indices, x.shape[axis]))


def scatter_mode(a: Args) -> str:
    # coremltools' default mode for scatter ops is "add".
    mode = text(a["mode"]) if a.get("mode") is not None else "add"
    if mode not in ("update", "add", "sub", "mul", "div", "max", "min"):
        raise OpError(f"unknown scatter mode {mode}")
    return mode


@op("scatter")
def scatter(a: Args) -> Result:
    data, updates = a["data"], a["updates"]
    axis = axis_of(one_int(a["axis"]) if a.get("axis") is not None else 0, data.dim())
    idx = wrap(a["indices"].reshape(-1), data.shape[axis])
    mode = scatter_mode(a)
    out = data.movedim(axis, 0).clone()
    upd = updates.movedim(axis, 0).to(out.dtype)
    if mode == "update":
        out[idx] = upd
    elif mode in ("add", "sub"):
        out.index_add_(0, idx, upd if mode == "add" else -upd)
    elif mode in ("mul", "div"):
        out.index_reduce_(0, idx, upd if mode == "mul" else torch.reciprocal(upd), "prod")
    else:
        out.index_reduce_(0, idx, upd, "amax" if mode == "max" else "amin")
    return out.movedim(0, axis)


@op("scatter_along_axis")
def scatter_along_axis(a: Args) -> Result:
    data, updates = a["data"], a["updates"].to(a["data"].dtype)
    axis = axis_of(one_int(a["axis"]) if a.get("axis") is not None else 0, data.dim())
    idx = wrap(a["indices"], data.shape[axis])
    mode = scatter_mode(a)
    if mode == "update":
        return torch.scatter(data, axis, idx, updates)
    if mode in ("add", "sub"):
        return torch.scatter_add(data, axis, idx, updates if mode == "add" else -updates)
    if mode in ("mul", "div"):
        src = updates if mode == "mul" else torch.reciprocal(updates)
        return torch.scatter_reduce(data, axis, idx, src, "prod")
    return torch.scatter_reduce(data, axis, idx, updates, "amax" if mode == "max" else "amin")


# ---- compile-time ops --------------------------------------------------------------------


# Values `lut_to_dense` makes at a time.
LUT_BLOCK = 1 << 22


def lut_to_dense(indices: torch.Tensor, lut: torch.Tensor, vector_axis: int | None) -> torch.Tensor:
    """iOS18 constexpr_lut_to_dense: ``indices`` [*S] (unpacked), ``lut``
    [*G, P, V] with G[i] dividing S[i]; element s takes palette entry
    ``indices[s]`` of the LUT of its block (s[i] // (S[i] / G[i]) per dim),
    a vector of V values laid out along ``vector_axis``."""
    shape = list(indices.shape)
    groups = list(lut.shape[:-2])
    palettes, vector = int(lut.shape[-2]), int(lut.shape[-1])
    if len(groups) != len(shape) or any(s % g for s, g in zip(shape, groups, strict=True)):
        raise OpError(f"lut {list(lut.shape)} does not tile indices {shape}")
    if not shape:
        raise OpError("a lut of a scalar")
    rows_lut = lut_of_rows(shape, lut)
    if rows_lut is not None:
        return lut_rows_to_dense(indices, rows_lut)
    flat = lut.reshape(-1, vector)
    out = torch.empty(shape + [vector], dtype=lut.dtype)
    # A few million values at a time along the first axis: the int64 row
    # numbers below are twice the size of the fp32 result they index.
    step = max(1, LUT_BLOCK // max(1, indices[:1].numel()))
    for r0 in range(0, shape[0], step):
        r1 = min(shape[0], r0 + step)
        part = [r1 - r0, *shape[1:]]
        # The flat LUT row of each element: its block's linear index * P + its index.
        block = torch.zeros(part, dtype=torch.int64)
        for d, (s, g) in enumerate(zip(shape, groups, strict=True)):
            at = torch.arange(r0, r1) if d == 0 else torch.arange(s)
            view = [1] * len(shape)
            view[d] = len(at)
            block = block * g + (at // (s // g)).view(view)
        rows = block * palettes + indices[r0:r1].to(torch.int64)
        out[r0:r1] = flat[rows.reshape(-1)].reshape(part + [vector])
    if vector == 1:
        return out.reshape(shape)
    if vector_axis is None:
        raise OpError("a vector LUT needs vector_axis")
    axis = axis_of(vector_axis, len(shape))
    out = out.movedim(-1, axis + 1)
    shape[axis] *= vector
    return out.reshape(shape)


def lut_of_rows(shape: list[int], lut: torch.Tensor) -> torch.Tensor | None:
    """``lut`` [*G, P, V] as [G0, P] when it holds scalar palettes grouped
    along the first axis of ``shape`` only (chunkforge's INT4
    per_grouped_channel), else None."""
    groups = list(lut.shape[:-2])
    if int(lut.shape[-1]) != 1 or len(groups) != len(shape) or not shape:
        return None
    if any(g != 1 for g in groups[1:]) or shape[0] % groups[0]:
        return None
    return lut.reshape(groups[0], int(lut.shape[-2]))


def lut_nibbles_to_dense(packed: np.ndarray, shape: list[int], lut: torch.Tensor) -> torch.Tensor | None:
    """`lut_rows_to_dense` of 4-bit indices as the weight file stores them
    (``packed``: two a byte, the low nibble first), without unpacking them:
    each group's 16-entry palette becomes a 256-entry table of value pairs
    (one per byte, as an int64 holding both float32s), and one gather per
    byte writes two values, the same bits as unpacking and gathering, in a
    fifth of the time (`chunkforge bench parity --compare dequant`). None when the palettes
    are not 16 per group or a group does not start on a byte."""
    rows_lut = lut_of_rows(shape, lut)
    if rows_lut is None or int(rows_lut.shape[1]) != 16:
        return None
    groups = int(rows_lut.shape[0])
    per_group = math.prod(shape) // groups
    if per_group % 2 or packed.size * 2 < per_group * groups:
        return None
    values = rows_lut.float().numpy()
    byte = np.arange(256)
    pairs = np.ascontiguousarray(np.stack([values[:, byte & 15], values[:, byte >> 4]], axis=-1))
    table = pairs.view(np.int64).reshape(groups, 256)
    source = packed[: per_group * groups // 2].reshape(groups, per_group // 2)
    out = np.empty((groups, per_group // 2), dtype=np.int64)
    for g in range(groups):
        np.take(table[g], source[g], out=out[g])
    return torch.from_numpy(out.view(np.float32).reshape(shape))


def lut_rows_to_dense(indices: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """`lut_to_dense` of scalar LUTs ``lut`` [G, P] grouped along the first
    axis only (chunkforge's INT4 per_grouped_channel: one palette per 32
    output channels): each row gathers from its group's palette, a few
    million values at a time. Six times faster than the general gather.
    The result is float32, the LUT's values exactly: the interpreter holds
    every weight in float32 (`settle`), and gathering into the fp16 dtype
    first made a second copy (an E2B head: 0.8 GB beside its 1.6 GB)."""
    rows = indices.shape[0]
    per_row = lut.float().repeat_interleave(rows // lut.shape[0], dim=0)
    flat = indices.reshape(rows, -1)
    out = torch.empty(flat.shape, dtype=torch.float32)
    step = max(1, LUT_BLOCK // max(1, flat.shape[1]))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[r0:r1] = torch.gather(per_row[r0:r1], 1, flat[r0:r1].to(torch.int64))
    return out.reshape(indices.shape)


@op("constexpr_lut_to_dense")
def constexpr_lut_to_dense(a: Args) -> Result:
    if a.get("shape") is not None:
        raise OpError("the iOS16 form of constexpr_lut_to_dense (flat indices and a shape) is not supported")
    va = one_int(a["vector_axis"]) if a.get("vector_axis") is not None else None
    return lut_to_dense(a["indices"], a["lut"], va)


# Ops whose value the interpreter computes once, when it prepares a function.
CONSTEXPR = frozenset(name for name in OPS if name.startswith("constexpr_"))
