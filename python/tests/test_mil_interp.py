"""The MIL interpreter (chunkforge_py.mil.interp) against torch, op by op, and
against the torch modules a build came from; the sabotage helpers against
weight read-back.

Op tests build small MIL programs with coremltools' builder, save them as
iOS18 .mlpackages (no graph passes, so every op stays as written) and compare
what the interpreter computes with the same math in torch. The tests on real
packages need a shared `build --mode all` of the built-in checkpoint: the one
the Rust tests make (`target/tmp/builds/<generation>/default-all`, see
tests/common/mod.rs) or CHUNKFORGE_TEST_BUILD; without one they are skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import coremltools as ct
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chunkforge_py.mil import ops as mil_ops
from chunkforge_py.mil.interp import Interpreter
from chunkforge_py.mil.program import BlobFile, TensorType
from chunkforge_py.runtime import ChunkforgeError
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

ROOT = Path(__file__).resolve().parents[2]
FP32 = types.fp32
RNG = np.random.default_rng(7)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """One torch thread, as the binary runs (runtime.configure sets OMP_NUM_THREADS=1):
    the interpreter's many small ops slow down by an order of magnitude when
    two threads spin against each other on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save(prog: Any, tmp_path: Path, name: str) -> Interpreter:
    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        pass_pipeline=ct.PassPipeline.EMPTY,
    )
    path = tmp_path / f"{name}.mlpackage"
    model.save(str(path))
    return Interpreter(str(path))


def check(got: dict[str, np.ndarray], want: dict[str, torch.Tensor], atol: float = 1e-5) -> None:
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for name, w in want.items():
        g = torch.from_numpy(np.asarray(got[name]))
        assert tuple(g.shape) == tuple(w.shape), f"{name}: {tuple(g.shape)} != {tuple(w.shape)}"
        if w.dtype in (torch.int32, torch.int64):
            assert torch.equal(g.long(), w.long()), f"{name}: {g} != {w}"
            continue
        err = (g.double() - w.double()).abs()
        bound = atol + 1e-5 * w.double().abs()
        assert bool((err <= bound).all()), f"{name}: worst error {float(err.max())} ({g} != {w})"


def program(specs: list[Any]) -> Callable[[Callable[..., Any]], Any]:
    """``mb.program`` with the iOS18 opset (fp16 inputs, iOS17 reshape, slice_update)."""
    return lambda fn: mb.program(input_specs=specs, opset_version=ct.target.iOS18)(fn)


def spec(shape: tuple[int, ...], dtype: Any = FP32) -> Any:
    return mb.TensorSpec(shape=shape, dtype=dtype)


def f32(*shape: int, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


# ---- elementwise --------------------------------------------------------------


def test_binary_ops_and_select(tmp_path: Path) -> None:
    x, y = f32(3, 4), f32(3, 4, lo=0.5, hi=2.0)
    xi = RNG.integers(-9, 9, (3, 4)).astype(np.int32)
    yi = RNG.integers(1, 5, (3, 4)).astype(np.int32) * np.where(RNG.random((3, 4)) < 0.5, -1, 1).astype(np.int32)
    binary = ["add", "sub", "mul", "real_div", "maximum", "minimum", "floor_div", "mod"]
    compare = ["equal", "not_equal", "less", "less_equal", "greater", "greater_equal"]

    @program([spec((3, 4)), spec((3, 4)), spec((3, 4), types.int32), spec((3, 4), types.int32)])
    def prog(x: Any, y: Any, xi: Any, yi: Any) -> Any:
        out = [getattr(mb, n)(x=x, y=y, name=n) for n in binary]
        out += [getattr(mb, n)(x=xi, y=yi, name=f"{n}_i") for n in ("add", "sub", "mul", "floor_div", "mod")]
        out.append(mb.pow(x=mb.add(x=mb.abs(x=x), y=0.5), y=y, name="pow"))
        for n in compare:
            out.append(mb.select(cond=getattr(mb, n)(x=x, y=mb.sub(x=y, y=1.0)), a=x, b=y, name=f"sel_{n}"))
        p, q = mb.greater(x=x, y=0.0), mb.less(x=y, y=1.2)
        for n in ("logical_and", "logical_or", "logical_xor"):
            out.append(mb.cast(x=getattr(mb, n)(x=p, y=q), dtype="fp32", name=n))
        out.append(mb.cast(x=mb.logical_not(x=p), dtype="fp32", name="logical_not"))
        return tuple(out)

    got = save(prog, tmp_path, "binary").function().run({"x": x, "y": y, "xi": xi, "yi": yi})
    X, Y, XI, YI = t(x), t(y), t(xi), t(yi)
    want = {
        "add": X + Y,
        "sub": X - Y,
        "mul": X * Y,
        "real_div": X / Y,
        "maximum": torch.maximum(X, Y),
        "minimum": torch.minimum(X, Y),
        "floor_div": torch.floor(X / Y),
        "mod": X - torch.floor(X / Y) * Y,
        "add_i": XI + YI,
        "sub_i": XI - YI,
        "mul_i": XI * YI,
        # Python's // and %: floor division, remainder with the divisor's sign.
        "floor_div_i": t(np.floor_divide(xi, yi)),
        "mod_i": t(np.mod(xi, yi)),
        "pow": (X.abs() + 0.5) ** Y,
    }
    ops = {
        "equal": torch.eq,
        "not_equal": torch.ne,
        "less": torch.lt,
        "less_equal": torch.le,
        "greater": torch.gt,
        "greater_equal": torch.ge,
    }
    for n, fn in ops.items():
        want[f"sel_{n}"] = torch.where(fn(X, Y - 1.0), X, Y)
    P, Q = X > 0, Y < 1.2
    want["logical_and"] = (P & Q).float()
    want["logical_or"] = (P | Q).float()
    want["logical_xor"] = (P ^ Q).float()
    want["logical_not"] = (~P).float()
    check(got, want)


def test_unary_ops_activations_and_cast(tmp_path: Path) -> None:
    x = f32(3, 4, lo=0.1, hi=0.9)
    s = f32(2, 5, lo=-3.0, hi=3.0)
    unary: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "abs": torch.abs,
        "acos": torch.acos,
        "asin": torch.asin,
        "atan": torch.atan,
        "atanh": torch.atanh,
        "ceil": lambda v: torch.ceil(v * 3),
        "cos": torch.cos,
        "cosh": torch.cosh,
        "erf": torch.erf,
        "exp": torch.exp,
        "exp2": torch.exp2,
        "floor": lambda v: torch.floor(v * 3),
        "round": lambda v: torch.round(v * 3),
        "sign": lambda v: torch.sign(v - 0.5),
        "sin": torch.sin,
        "sinh": torch.sinh,
        "sqrt": torch.sqrt,
        "square": torch.square,
        "tan": torch.tan,
        "tanh": torch.tanh,
        "relu": lambda v: torch.relu(v - 0.5),
        "relu6": lambda v: torch.clamp(v * 10 - 2, 0, 6),
        "sigmoid": torch.sigmoid,
        "silu": F.silu,
        "softplus": F.softplus,
        "softsign": F.softsign,
    }
    prescale = {"ceil": 3.0, "floor": 3.0, "round": 3.0}

    @program([spec((3, 4)), spec((2, 5))])
    def prog(x: Any, s: Any) -> Any:
        out = []
        for n in unary:
            v = x
            if n in prescale:
                v = mb.mul(x=x, y=prescale[n])
            elif n in ("sign", "relu"):
                v = mb.sub(x=x, y=0.5)
            elif n == "relu6":
                v = mb.sub(x=mb.mul(x=x, y=10.0), y=2.0)
            out.append(getattr(mb, n)(x=v, name=n))
        out += [
            mb.rsqrt(x=x, epsilon=0.25, name="rsqrt"),
            mb.inverse(x=x, epsilon=0.5, name="inverse"),
            mb.log(x=x, epsilon=0.125, name="log"),
            mb.clip(x=s, alpha=-1.0, beta=2.0, name="clip"),
            mb.threshold(x=s, alpha=0.5, name="threshold"),
            mb.leaky_relu(x=s, alpha=0.2, name="leaky_relu"),
            mb.elu(x=s, alpha=0.7, name="elu"),
            mb.identity(x=s, name="identity"),
        ]
        for mode in ("EXACT", "TANH_APPROXIMATION", "SIGMOID_APPROXIMATION"):
            out.append(mb.gelu(x=s, mode=mode, name=f"gelu_{mode}"))
        out += [
            mb.softmax(x=s, axis=0, name="softmax0"),
            mb.softmax(x=s, axis=-1, name="softmax1"),
            mb.cast(x=s, dtype="int32", name="cast_int"),
            mb.cast(x=mb.cast(x=s, dtype="int32"), dtype="fp32", name="cast_back"),
        ]
        return tuple(out)

    got = save(prog, tmp_path, "unary").function().run({"x": x, "s": s})
    X, S = t(x), t(s)
    want = {n: fn(X) for n, fn in unary.items()}
    want.update(
        {
            "rsqrt": 1 / torch.sqrt(X + 0.25),
            "inverse": 1 / (X + 0.5),
            "log": torch.log(X + 0.125),
            "clip": S.clamp(-1.0, 2.0),
            "threshold": S.clamp(min=0.5),
            "leaky_relu": F.leaky_relu(S, 0.2),
            "elu": F.elu(S, 0.7),
            "identity": S,
            "gelu_EXACT": F.gelu(S),
            "gelu_TANH_APPROXIMATION": F.gelu(S, approximate="tanh"),
            "gelu_SIGMOID_APPROXIMATION": S * torch.sigmoid(1.702 * S),
            "softmax0": torch.softmax(S, 0),
            "softmax1": torch.softmax(S, 1),
            # Toward zero, as numpy's astype.
            "cast_int": S.trunc().int(),
            "cast_back": S.trunc(),
        }
    )
    check(got, want)


# ---- linear algebra -------------------------------------------------------------


def test_linear_matmul_conv(tmp_path: Path) -> None:
    x = f32(2, 5, 8)
    w, b = f32(6, 8), f32(6)
    a, c = f32(2, 3, 4), f32(4, 5)
    at, ct_ = f32(2, 4, 3), f32(2, 5, 4)
    img = f32(1, 8, 1, 5)
    w1, b1 = f32(6, 8, 1, 1), f32(6)
    img2 = f32(1, 4, 7, 9)
    w3 = f32(6, 2, 3, 3)
    w4 = f32(3, 4, 2, 3)
    seq, w5 = f32(2, 3, 11), f32(4, 3, 3)

    @program(
        [
            spec((2, 5, 8)),
            spec((2, 3, 4)),
            spec((4, 5)),
            spec((2, 4, 3)),
            spec((2, 5, 4)),
            spec((1, 8, 1, 5)),
            spec((1, 4, 7, 9)),
            spec((2, 3, 11)),
        ]
    )
    def prog(x: Any, a: Any, c: Any, at: Any, ct_: Any, img: Any, img2: Any, seq: Any) -> Any:
        return (
            mb.linear(x=x, weight=w, bias=b, name="linear"),
            mb.linear(x=x, weight=w, name="linear_nobias"),
            mb.matmul(x=a, y=c, name="matmul"),
            mb.matmul(x=at, y=ct_, transpose_x=True, transpose_y=True, name="matmul_tt"),
            mb.conv(x=img, weight=w1, bias=b1, name="conv_1x1"),
            mb.conv(x=img2, weight=w3, pad_type="same", strides=[2, 2], groups=2, name="conv_same"),
            mb.conv(x=img2, weight=w4, pad_type="custom", pad=[1, 2, 0, 3], dilations=[2, 1], name="conv_custom"),
            mb.conv(x=seq, weight=w5, strides=[2], name="conv1d"),
        )

    got = (
        save(prog, tmp_path, "linalg")
        .function()
        .run({"x": x, "a": a, "c": c, "at": at, "ct_": ct_, "img": img, "img2": img2, "seq": seq})
    )
    want = {
        "linear": F.linear(t(x), t(w), t(b)),
        "linear_nobias": F.linear(t(x), t(w)),
        "matmul": t(a) @ t(c),
        "matmul_tt": t(at).transpose(1, 2) @ t(ct_).transpose(1, 2),
        "conv_1x1": F.conv2d(t(img), t(w1), t(b1)),
        # ceil(7/2) x ceil(9/2) out of a 3x3 kernel: one row / col of padding each side.
        "conv_same": F.conv2d(t(img2), t(w3), stride=2, padding=1, groups=2),
        "conv_custom": F.conv2d(F.pad(t(img2), [0, 3, 1, 2]), t(w4), dilation=(2, 1)),
        "conv1d": F.conv1d(t(seq), t(w5), stride=2),
    }
    check(got, want, atol=1e-4)


# ---- normalization, reductions ------------------------------------------------------


def test_layer_norm_reductions_argmax_topk(tmp_path: Path) -> None:
    x = f32(2, 3, 4, 5)
    g, b = f32(5), f32(5)
    g2 = f32(3, 5)
    ties = np.array([[3, 7, 7, 1], [5, 5, 2, 5]], dtype=np.int32)
    reductions = {
        "reduce_sum": lambda v, d, k: v.sum(d, keepdim=k),
        "reduce_mean": lambda v, d, k: v.mean(d, keepdim=k),
        "reduce_max": lambda v, d, k: v.amax(d, keepdim=k),
        "reduce_min": lambda v, d, k: v.amin(d, keepdim=k),
        "reduce_prod": lambda v, d, k: (v.prod(d[0], keepdim=True).prod(d[1], keepdim=True)).reshape(
            [s if i not in d else 1 for i, s in enumerate(v.shape)]
            if k
            else [s for i, s in enumerate(v.shape) if i not in d]
        ),
        "reduce_sum_square": lambda v, d, k: (v * v).sum(d, keepdim=k),
        "reduce_l1_norm": lambda v, d, k: v.abs().sum(d, keepdim=k),
        "reduce_l2_norm": lambda v, d, k: (v * v).sum(d, keepdim=k).sqrt(),
        "reduce_log_sum": lambda v, d, k: v.sum(d, keepdim=k).log(),
        "reduce_log_sum_exp": lambda v, d, k: torch.logsumexp(v, d, keepdim=k),
    }

    @program([spec((2, 3, 4, 5)), spec((2, 4), types.int32)])
    def prog(x: Any, ties: Any) -> Any:
        out = [
            mb.layer_norm(x=x, axes=[-1], gamma=g, beta=b, epsilon=1e-3, name="ln_last"),
            mb.layer_norm(x=x, axes=[1, 3], gamma=g2, name="ln_13"),
            mb.layer_norm(x=x, axes=[0, 1, 2, 3], name="ln_all"),
        ]
        for n in reductions:
            v = mb.add(x=mb.abs(x=x), y=1.0) if n == "reduce_log_sum" else x
            out.append(getattr(mb, n)(x=v, axes=[1, 3], keep_dims=True, name=f"{n}_keep"))
            out.append(getattr(mb, n)(x=v, axes=[-1, 0], keep_dims=False, name=f"{n}_drop"))
        out.append(mb.reduce_sum(x=x, name="reduce_sum_all"))
        out += [
            mb.reduce_argmax(x=x, axis=2, keep_dims=True, name="argmax"),
            mb.reduce_argmin(x=x, axis=-1, name="argmin"),
            mb.reduce_argmax(x=ties, axis=-1, name="argmax_ties"),
        ]
        top = mb.topk(x=x, k=2, axis=1, name="top")
        low = mb.topk(x=x, k=3, axis=-1, ascending=True, name="low")
        out += [mb.identity(x=top[0], name="top_v"), mb.identity(x=top[1], name="top_i")]
        out += [mb.identity(x=low[0], name="low_v"), mb.identity(x=low[1], name="low_i")]
        return tuple(out)

    got = save(prog, tmp_path, "norm").function().run({"x": x, "ties": ties})
    X = t(x)
    want = {
        "ln_last": F.layer_norm(X, [5], t(g), t(b), 1e-3),
        "ln_13": (X - X.mean((1, 3), keepdim=True))
        / torch.sqrt(X.var((1, 3), unbiased=False, keepdim=True) + 1e-5)
        * t(g2).view(1, 3, 1, 5),
        "ln_all": F.layer_norm(X, list(X.shape), eps=1e-5),
        "reduce_sum_all": X.sum(),
        "argmax": X.argmax(2, keepdim=True).int(),
        "argmin": X.argmin(-1).int(),
        # The first of equal values.
        "argmax_ties": torch.tensor([1, 0], dtype=torch.int32),
    }
    for n, fn in reductions.items():
        v = X.abs() + 1 if n == "reduce_log_sum" else X
        want[f"{n}_keep"] = fn(v, [1, 3], True)
        want[f"{n}_drop"] = fn(v, [3, 0], False)
    tv, ti = torch.topk(X, 2, dim=1)
    lv, li = torch.topk(X, 3, dim=-1, largest=False)
    want.update({"top_v": tv, "top_i": ti.int(), "low_v": lv, "low_i": li.int()})
    check(got, want, atol=1e-4)


# ---- shapes, slices, gather / scatter ------------------------------------------------------


def test_shape_ops(tmp_path: Path) -> None:
    x = f32(2, 3, 4)
    y = f32(2, 3, 4)
    u = f32(2, 1, 2)
    idx = np.array([[2, -1], [0, 1], [1, 1]], dtype=np.int32)
    along = RNG.integers(0, 3, (2, 2, 4)).astype(np.int32)
    rows = np.array([3, 0], dtype=np.int32)
    upd = f32(2, 3, 2)

    @program(
        [
            spec((2, 3, 4)),
            spec((2, 3, 4)),
            spec((2, 1, 2)),
            spec((3, 2), types.int32),
            spec((2, 2, 4), types.int32),
            spec((2,), types.int32),
            spec((2, 3, 2)),
        ]
    )
    def prog(x: Any, y: Any, u: Any, idx: Any, along: Any, rows: Any, upd: Any) -> Any:
        sp = mb.split(x=x, num_splits=2, axis=-1)
        sz = mb.split(x=x, split_sizes=[1, 2], axis=1)
        return (
            mb.reshape(x=x, shape=[0, -1], name="reshape_0"),
            mb.reshape(x=x, shape=[1, 0, -1, 0], name="reshape_iOS17"),
            mb.transpose(x=x, perm=[2, 0, 1], name="transpose"),
            mb.expand_dims(x=x, axes=[0, -1], name="expand_dims"),
            mb.squeeze(x=u, axes=[1], name="squeeze"),
            mb.squeeze(x=mb.expand_dims(x=x, axes=[1]), name="squeeze_all"),
            mb.concat(values=[x, y], axis=1, name="concat"),
            mb.concat(values=[x, y], axis=-1, interleave=True, name="interleave"),
            mb.stack(values=[x, y], axis=-1, name="stack"),
            mb.identity(x=sp[0], name="split0"),
            mb.identity(x=sp[1], name="split1"),
            mb.identity(x=sz[0], name="sizes0"),
            mb.identity(x=sz[1], name="sizes1"),
            mb.slice_by_index(x=x, begin=[0, 1, 0], end=[1, 3, 3], end_mask=[True, False, False], name="slice"),
            mb.slice_by_index(
                x=x,
                begin=[1, 0, -3],
                end=[0, 0, 0],
                squeeze_mask=[True, False, False],
                end_mask=[False, True, True],
                name="slice_squeeze",
            ),
            mb.slice_by_index(
                x=x,
                begin=[0, 0, 0],
                end=[0, 0, 0],
                stride=[1, -1, 2],
                begin_mask=[True] * 3,
                end_mask=[True] * 3,
                name="slice_reverse",
            ),
            mb.slice_by_size(x=x, begin=[1, 1, 0], size=[1, -1, 3], name="slice_by_size"),
            mb.slice_update(x=x, update=upd, begin=[0, 0, 1], end=[2, 3, 4], stride=[1, 1, 2], name="slice_update"),
            mb.pad(x=x, pad=[1, 2], constant_val=0.5, name="pad_const"),
            mb.pad(x=x, pad=[1, 1, 2, 1], mode="reflect", name="pad_reflect"),
            mb.pad(x=x, pad=[0, 2, 1, 0], mode="replicate", name="pad_replicate"),
            mb.tile(x=x, reps=[1, 2, 3], name="tile"),
            mb.fill(shape=[2, 3], value=1.5, name="fill"),
            mb.range_1d(start=2, end=11, step=3, name="range_1d"),
            mb.band_part(x=x, lower=1, upper=0, name="band_part"),
            mb.cumsum(x=x, axis=1, exclusive=True, reverse=True, name="cumsum"),
            mb.shape(x=x, name="shape"),
            mb.gather(x=x, indices=idx, axis=2, name="gather"),
            mb.gather(
                x=x,
                indices=mb.slice_by_index(x=idx, begin=[0, 0], end=[2, 2]),
                axis=2,
                batch_dims=1,
                name="gather_batch",
            ),
            mb.gather_along_axis(x=x, indices=along, axis=1, name="gather_along_axis"),
            mb.scatter(
                data=x,
                indices=rows,
                updates=mb.slice_by_index(x=y, begin=[0, 0, 0], end=[2, 3, 2]),
                axis=2,
                mode="update",
                name="scatter_update",
            ),
            mb.scatter(
                data=x,
                indices=rows,
                updates=mb.slice_by_index(x=y, begin=[0, 0, 0], end=[2, 3, 2]),
                axis=-1,
                mode="add",
                name="scatter_add",
            ),
            mb.scatter_along_axis(
                data=x,
                indices=along,
                updates=mb.slice_by_index(x=y, begin=[0, 0, 0], end=[2, 2, 4]),
                axis=1,
                mode="update",
                name="scatter_along_axis",
            ),
            *[
                mb.scatter(
                    data=x,
                    indices=rows,
                    updates=mb.slice_by_index(x=y, begin=[0, 0, 0], end=[2, 3, 2]),
                    axis=2,
                    mode=mode,
                    name=f"scatter_{mode}",
                )
                for mode in ("sub", "mul", "div", "max", "min")
            ],
            *[
                mb.scatter_along_axis(
                    data=x,
                    indices=along,
                    updates=mb.slice_by_index(x=y, begin=[0, 0, 0], end=[2, 2, 4]),
                    axis=1,
                    mode=mode,
                    name=f"scatter_along_{mode}",
                )
                for mode in ("add", "max")
            ],
        )

    inputs = {"x": x, "y": y, "u": u, "idx": idx, "along": along, "rows": rows, "upd": upd}
    got = save(prog, tmp_path, "shape").function().run(inputs)
    X, Y = t(x), t(y)
    ys = Y[:, :, :2]
    scattered = X.clone()
    scattered[:, :, [3, 0]] = ys
    added = X.clone()
    added[:, :, 3] += ys[:, :, 0]
    added[:, :, 0] += ys[:, :, 1]
    updated = X.clone()
    updated[:, :, 1::2] = t(upd)
    tril = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.float32)
    idx_w = np.where(idx < 0, idx + 4, idx)
    want = {
        # iOS17: a 0 copies the input dim it lines up with from the right.
        "reshape_0": X.reshape(3, 8),
        "reshape_iOS17": X.reshape(1, 2, 3, 4),
        "transpose": X.permute(2, 0, 1),
        "expand_dims": X.reshape(1, 2, 3, 4, 1),
        "squeeze": t(u).reshape(2, 2),
        "squeeze_all": X,
        "concat": torch.cat([X, Y], 1),
        "interleave": torch.stack([X, Y], -1).reshape(2, 3, 8),
        "stack": torch.stack([X, Y], -1),
        "split0": X[..., :2],
        "split1": X[..., 2:],
        "sizes0": X[:, :1],
        "sizes1": X[:, 1:],
        "slice": X[:, 1:3, 0:3],
        "slice_squeeze": X[1, :, -3:],
        "slice_reverse": t(np.ascontiguousarray(x[:, ::-1, ::2])),
        "slice_by_size": X[1:2, 1:, 0:3],
        "slice_update": updated,
        "pad_const": F.pad(X, [1, 2], value=0.5),
        "pad_reflect": t(np.pad(x, [(0, 0), (1, 1), (2, 1)], mode="reflect")),
        "pad_replicate": t(np.pad(x, [(0, 0), (0, 2), (1, 0)], mode="edge")),
        "tile": X.repeat(1, 2, 3),
        "fill": torch.full((2, 3), 1.5),
        "range_1d": torch.arange(2, 11, 3, dtype=torch.int32),
        "band_part": X * tril,
        "cumsum": torch.flip(torch.cumsum(torch.flip(X, [1]), 1), [1]) - X,
        "shape": torch.tensor([2, 3, 4], dtype=torch.int32),
        "gather": X[:, :, t(idx_w).long()],
        "gather_batch": torch.stack([X[i][:, t(idx_w[i]).long()] for i in range(2)]),
        "gather_along_axis": torch.gather(X, 1, t(along).long()),
        "scatter_update": scattered,
        "scatter_add": added,
        "scatter_along_axis": torch.scatter(X, 1, t(along).long(), Y[:, :2]),
        "scatter_along_add": torch.scatter_add(X, 1, t(along).long(), Y[:, :2]),
        "scatter_along_max": torch.scatter_reduce(X, 1, t(along).long(), Y[:, :2], "amax"),
    }
    ops2: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "sub": torch.sub,
        "mul": torch.mul,
        "div": torch.div,
        "max": torch.maximum,
        "min": torch.minimum,
    }
    for mode, fn in ops2.items():
        out = X.clone()
        out[:, :, 3] = fn(X[:, :, 3], ys[:, :, 0])
        out[:, :, 0] = fn(X[:, :, 0], ys[:, :, 1])
        want[f"scatter_{mode}"] = out
    check(got, want)


# ---- palettized weights ------------------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True])
def test_lut_to_dense_matches_coremltools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lazy: bool) -> None:
    """Per-grouped-channel scalar LUTs (chunkforge's INT4 g=32, for a linear
    and for a 1x1 conv), and a vector LUT, read back from the blob file and
    dequantized, against coremltools' own loader and decompression; with
    ``lazy``, every weight made when a step reads it and never kept
    (`weights.Lazy`), as at real size."""
    from chunkforge_py import weights
    from chunkforge_py.mil import interp as mil_interp
    from chunkforge_py.mil.inspect import read_package

    # The 4-bit weights made straight from their stored bytes (lazy only).
    nibbles: list[tuple[int, ...]] = []
    made_from_bytes = mil_ops.lut_nibbles_to_dense

    def spy(packed: np.ndarray, shape: list[int], lut: torch.Tensor) -> torch.Tensor | None:
        made = made_from_bytes(packed, shape, lut)
        if made is not None:
            nibbles.append(tuple(shape))
        return made

    monkeypatch.setattr(mil_ops, "lut_nibbles_to_dense", spy)
    if lazy:
        monkeypatch.setattr(mil_interp, "LAZY_ELEMENTS", 1)
        monkeypatch.setattr(weights, "RESIDENT", weights.Resident(budget=0))

    idx4 = RNG.integers(0, 16, (64, 24)).astype(types.np_uint4_dtype)
    lut4 = RNG.standard_normal((2, 1, 16, 1)).astype(np.float16)
    idxc = RNG.integers(0, 16, (64, 24, 1, 1)).astype(types.np_uint4_dtype)
    lutc = RNG.standard_normal((2, 1, 1, 1, 16, 1)).astype(np.float16)
    idx2 = RNG.integers(0, 4, (4, 6)).astype(types.np_uint2_dtype)
    lut2 = RNG.standard_normal((2, 3, 4, 2)).astype(np.float32)
    x = f32(3, 24)
    img = f32(1, 24, 1, 3)

    @program([spec((3, 24), types.fp16), spec((1, 24, 1, 3), types.fp16)])
    def prog(x: Any, img: Any) -> Any:
        w = mb.constexpr_lut_to_dense(indices=idx4, lut=lut4, name="w4")
        wc = mb.constexpr_lut_to_dense(indices=idxc, lut=lutc, name="wc")
        v = mb.constexpr_lut_to_dense(indices=idx2, lut=lut2, vector_axis=0, name="w2")
        return mb.linear(x=x, weight=w, name="y"), mb.conv(x=img, weight=wc, name="c"), mb.identity(x=v, name="v")

    interp = save(prog, tmp_path, "lut")
    fn = interp.function()
    _, pymil, _ = read_package(str(tmp_path / "lut.mlpackage"))
    want = {
        op.name: torch.from_numpy(op.materialized_val_inference().astype(np.float32))
        for op in pymil.functions["main"].operations
        if op.op_type == "constexpr_lut_to_dense"
    }
    assert set(want) == {"w4", "wc", "w2"}
    for name, w in want.items():
        assert isinstance(fn.consts[name], weights.Lazy) == lazy
        assert torch.equal(weights.value_of(fn.consts[name]), w), name
    assert tuple(fn.consts["w2"].shape) == (8, 6)
    assert sorted(nibbles) == ([(64, 24), (64, 24, 1, 1)] if lazy else [])
    got = fn.run({"x": x.astype(np.float16), "img": img.astype(np.float16)})
    expected = {
        "y": F.linear(t(x).half().float(), want["w4"]),
        "c": F.conv2d(t(img).half().float(), want["wc"]),
        "v": want["w2"],
    }
    check(got, expected, atol=1e-4)


def test_blob_reader_reads_every_type_coremltools_writes(tmp_path: Path) -> None:
    from coremltools.libmilstoragepython import _BlobStorageWriter

    path = str(tmp_path / "weight.bin")
    w = _BlobStorageWriter(path)
    values: dict[str, np.ndarray] = {
        "fp16": RNG.standard_normal(7).astype(np.float16),
        "fp32": RNG.standard_normal(5).astype(np.float32),
        "int8": RNG.integers(-128, 127, 9).astype(np.int8),
        "uint8": RNG.integers(0, 255, 9).astype(np.uint8),
        "int16": RNG.integers(-999, 999, 3).astype(np.int16),
        "uint16": RNG.integers(0, 999, 3).astype(np.uint16),
        "int32": RNG.integers(-99999, 99999, 3).astype(np.int32),
        "uint32": RNG.integers(0, 99999, 3).astype(np.uint32),
        "int4": RNG.integers(-8, 8, 11).astype(np.int8),
        "uint1": RNG.integers(0, 2, 13).astype(np.uint8),
        "uint2": RNG.integers(0, 4, 13).astype(np.uint8),
        "uint3": RNG.integers(0, 8, 13).astype(np.uint8),
        "uint4": RNG.integers(0, 16, 13).astype(np.uint8),
        "uint6": RNG.integers(0, 64, 13).astype(np.uint8),
    }
    writers = {"fp16": "fp16", "fp32": "float"}
    offsets = {}
    for dtype, v in values.items():
        data = v.view(np.uint16) if dtype == "fp16" else v
        offsets[dtype] = getattr(w, f"write_{writers.get(dtype, dtype)}_data")(data)
    del w
    blob = BlobFile(path)
    for dtype, v in values.items():
        got = blob.read(offsets[dtype], TensorType(dtype, v.shape), dtype)
        assert np.array_equal(got.astype(np.int64 if v.dtype.kind in "iu" else np.float64), v), dtype
    with pytest.raises(ChunkforgeError, match="the program reads fp32, blob at"):
        blob.read(offsets["fp16"], TensorType("fp32", (7,)), "w")
    with pytest.raises(ChunkforgeError, match="needs 24"):
        blob.read(offsets["fp32"], TensorType("fp32", (6,)), "w")


# ---- precision -------------------------------------------------------------------------


def test_fp16_mode_rounds_after_every_op_fp32_mode_never(tmp_path: Path) -> None:
    x = (RNG.standard_normal((4, 8)) * 3).astype(np.float16)
    y = (RNG.standard_normal((4, 8)) + 4).astype(np.float16)
    w = RNG.standard_normal((5, 8)).astype(np.float16)

    @program([spec((4, 8), types.fp16), spec((4, 8), types.fp16)])
    def prog(x: Any, y: Any) -> Any:
        z = mb.real_div(x=mb.add(x=mb.mul(x=x, y=y), y=x), y=y)
        return mb.softmax(x=mb.linear(x=z, weight=w), axis=-1, name="out"), mb.cast(x=z, dtype="fp32", name="z32")

    fn = save(prog, tmp_path, "fp16").function()
    half = fn.run({"x": x, "y": y}, fp16=True)
    full = fn.run({"x": x, "y": y}, fp16=False)
    X, Y, W = t(x).float(), t(y).float(), t(w).float()

    def r(v: torch.Tensor) -> torch.Tensor:
        return v.half().float()

    z16 = r(r(r(X * Y) + X) / Y)
    want16 = r(torch.softmax(r(F.linear(z16, W)), -1))
    z32 = (X * Y + X) / Y
    assert half["out"].dtype == np.float16 and full["out"].dtype == np.float32
    assert torch.equal(t(half["out"]).float(), want16)
    assert torch.equal(t(half["z32"]), z16)
    torch.testing.assert_close(t(full["out"]), torch.softmax(F.linear(z32, W), -1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(t(full["z32"]), z32, atol=1e-6, rtol=1e-6)
    assert not torch.equal(t(full["z32"]), z16)


# ---- errors ------------------------------------------------------------------------------


def test_unimplemented_op_is_named(tmp_path: Path) -> None:
    @program([spec((1, 2, 3, 3))])
    def prog(x: Any) -> Any:
        return mb.instance_norm(x=mb.relu(x=x), name="norm_me")

    interp = save(prog, tmp_path, "unimplemented")
    with pytest.raises(ChunkforgeError, match=r"function main: op instance_norm norm_me: .*MIL op instance_norm"):
        interp.function("main")


def test_inputs_are_checked_by_name_shape_and_dtype(tmp_path: Path) -> None:
    @program([spec((2, 3), types.fp16), spec((4,), types.int32)])
    def prog(a: Any, n: Any) -> Any:
        return mb.add(x=a, y=np.float16(1.0), name="a1"), mb.add(x=n, y=np.int32(1), name="n1")

    fn = save(prog, tmp_path, "inputs").function()
    a, n = np.zeros((2, 3), np.float16), np.arange(4, dtype=np.int32)
    assert fn.run({"a": a, "n": n})["n1"].tolist() == [1, 2, 3, 4]
    with pytest.raises(ChunkforgeError, match=r"missing n \[4\] int32"):
        fn.run({"a": a})
    with pytest.raises(ChunkforgeError, match=r"input a has shape \[3, 2\], expected \[2, 3\]"):
        fn.run({"a": a.T.copy(), "n": n})
    with pytest.raises(ChunkforgeError, match=r"input n is int64, expected int32"):
        fn.run({"a": a, "n": n.astype(np.int64)})
    with pytest.raises(ChunkforgeError, match=r"input a is float64, expected fp16"):
        fn.run({"a": a.astype(np.float64), "n": n})
    with pytest.raises(ChunkforgeError, match=r"unexpected b \(not inputs of main\)"):
        fn.run({"a": a, "n": n, "b": n})
    with pytest.raises(ChunkforgeError, match=r"no function nope \(it has main\)"):
        Interpreter(str(tmp_path / "inputs.mlpackage")).function("nope")


# ---- real packages -----------------------------------------------------------------------


def shared_build(env: str, under: str) -> dict[str, Any]:
    """One of the Rust tests' shared builds of the built-in checkpoint
    (``$env``, else the newest ``target/tmp/builds/gen*/<under>``)."""
    given = os.environ.get(env)
    found = sorted(
        (ROOT / "target" / "tmp" / "builds").glob(f"gen*/{under}/build.json"),
        key=lambda p: int(p.relative_to(ROOT / "target" / "tmp" / "builds").parts[0].removeprefix("gen") or 0),
    )
    path = Path(given) if given else found[-1].parent if found else None
    if path is None or not (path / "build.json").exists():
        pytest.skip(f"no shared build {under}: run the Rust tests once (tests/common/mod.rs) or set {env}")
    info = json.loads((path / "build.json").read_text())
    return {"dir": path, "plan": info["plan"], "dims": info["plan"]["dims"], "checkpoint": info["checkpoint"]}


@pytest.fixture(scope="module")
def build() -> dict[str, Any]:
    """`build --mode all` (INT4): tests/common built_all()."""
    return shared_build("CHUNKFORGE_TEST_BUILD", "default-all")


@pytest.fixture(scope="module")
def fp16_build() -> dict[str, Any]:
    """`build --mode all --no-quantize`: tests/run.rs fp16_release()'s build."""
    return shared_build("CHUNKFORGE_TEST_FP16_BUILD", "default-all-fp16/build")


def layout(build: dict[str, Any], kind: str) -> Any:
    return next(lay for lay in build["plan"]["layouts"] if lay["kind"] == kind)


def random_inputs(fn: Any, seed: int) -> dict[str, np.ndarray]:
    """Random fp16 activations and caches (masks left open), as the function declares them."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in fn.inputs:
        if "mask" in s.name and "update" not in s.name and "last" not in s.name:
            out[s.name] = np.zeros(s.shape, np.float16)
        elif s.name in ("update_mask", "update_indicator", "last_position_mask"):
            v = np.zeros(s.shape, np.float16)
            v[(0,) * (len(s.shape) - 2) + (3, 0)] = 1
            out[s.name] = v
        else:
            out[s.name] = (rng.standard_normal(s.shape) * 0.5).astype(np.float16)
    return out


def module_outputs(
    build: dict[str, Any], chunk: Any, function: Any, package: str, inputs: dict[str, np.ndarray]
) -> Any:
    """What the torch module of ``function``, with the package's weights read back, computes."""
    from chunkforge_py.emulate.release import Package, module_from_package

    module = module_from_package(build["dims"], chunk, function, Package(package))
    with torch.no_grad():
        outs = module(*[torch.from_numpy(inputs[t["name"]]).float() for t in function["inputs"]])
    return {t["name"]: o for t, o in zip(function["outputs"], outs, strict=True)}, module


@pytest.mark.parametrize("kind,layout_kind", [("decode", "four"), ("verify", "four"), ("prefill", "prefill")])
def test_chunk1_functions_match_their_torch_module(build: dict[str, Any], kind: str, layout_kind: str) -> None:
    chunk = layout(build, layout_kind)["chunks"][0]
    function = next(f for f in chunk["functions"] if f["kind"] == kind)
    package = str(build["dir"] / f"{chunk['name']}.mlpackage")
    interp = Interpreter(package)
    fn = interp.function(function["name"])
    inputs = random_inputs(fn, 1)
    # The functions of a package share one dequantized copy of each weight.
    others = [interp.function(f["name"]) for f in chunk["functions"] if f["name"] != function["name"]]
    for other in others:
        shared = [n for n in fn.consts if n.endswith("_palettized") and n in other.consts]
        assert shared and all(fn.consts[n] is other.consts[n] for n in shared)
    want, _ = module_outputs(build, chunk, function, package, inputs)
    got = fn.run(inputs)
    for name, w in want.items():
        g = torch.from_numpy(got[name]).double().reshape(-1)
        cos = float(F.cosine_similarity(g, w.double().reshape(-1), dim=0))
        # fp32 both; the package's scalar constants (2^-0.5, eps) are fp16.
        assert cos > 0.99999, f"{function['name']} {name}: cos {cos}"


def checkpoint_of(b: dict[str, Any]) -> Any:
    """The checkpoint a shared build read, opened as the build opens it."""
    from chunkforge_py.checkpoint import Checkpoint
    from safetensors import safe_open

    files = {}
    for name in sorted(os.listdir(b["checkpoint"]["dir"])):
        if name.endswith(".safetensors"):
            path = os.path.join(b["checkpoint"]["dir"], name)
            with safe_open(path, framework="pt") as f:
                files.update(dict.fromkeys(f.keys(), path))
    return Checkpoint({"prefix": b["checkpoint"]["tensor_prefix"], "files": files})


def test_fp16_build_matches_the_checkpoint_module(fp16_build: dict[str, Any]) -> None:
    """An FP16 build's chunk1 decode, run by the interpreter, against the torch
    module built from the checkpoint the build read (fp32 weights)."""
    from chunkforge_py.model import build_chunk

    b = fp16_build
    ckpt = checkpoint_of(b)
    for chunk in layout(b, "four")["chunks"]:
        function = next(f for f in chunk["functions"] if f["kind"] == "decode")
        fn = Interpreter(str(b["dir"] / f"{chunk['name']}.mlpackage")).function(function["name"])
        inputs = random_inputs(fn, 3)
        module = build_chunk(b["dims"], chunk, ckpt, torch.float32, function=function)
        with torch.no_grad():
            outs = module(*[torch.from_numpy(inputs[t["name"]]).float() for t in function["inputs"]])
        got = fn.run(inputs)
        for spec, want in zip(function["outputs"], outs, strict=True):
            g = torch.from_numpy(got[spec["name"]]).double().reshape(-1)
            if spec["dtype"] == "int32":
                assert torch.equal(g.long(), want.long().reshape(-1)), f"{chunk['name']} {spec['name']}"
                continue
            cos = float(F.cosine_similarity(g, want.double().reshape(-1), dim=0))
            assert cos > 0.99999, f"{chunk['name']} {spec['name']}: cos {cos}"


def test_four_chunk_decode_matches_read_back_modules(build: dict[str, Any]) -> None:
    """16 decode steps of chunk1..4 through the runtime emulation: the packages
    run by the interpreter (fp32 and fp16 arithmetic) against the torch modules
    with the packages' weights."""
    from chunkforge_py.emulate.release import Package, module_from_package
    from chunkforge_py.emulate.stepper import LayoutRunner, function_of
    from chunkforge_py.mil.chunk import ProgramChunk

    dims, four = build["dims"], layout(build, "four")
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(dims["vocab_size"], dims["hidden_size"], generator=gen).half()
    per_layer = torch.randn(
        dims["vocab_size"], dims["num_hidden_layers"] * dims["hidden_size_per_layer_input"], generator=gen
    ).half()

    class Rows:
        def rows(self, tokens: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            n = len(tokens)
            return table[tokens].view(1, n, -1).to(dtype), per_layer[tokens].view(1, n, -1).to(dtype)

    def package(c: Any) -> str:
        return str(build["dir"] / f"{c['name']}.mlpackage")

    ref = LayoutRunner(
        dims,
        four,
        None,
        modules={
            c["name"]: module_from_package(dims, c, function_of(c, "decode"), Package(package(c)))
            for c in four["chunks"]
        },
    )
    interps = {c["name"]: Interpreter(package(c)) for c in four["chunks"]}
    runners = {
        mode: LayoutRunner(
            dims,
            four,
            None,
            modules={
                c["name"]: ProgramChunk(interps[c["name"]], function_of(c, "decode"), mode == "fp16")  # type: ignore[misc]
                for c in four["chunks"]
            },
        )
        for mode in ("fp32", "fp16")
    }
    seconds = dict.fromkeys(runners, 0.0)
    for pos in range(16):
        token = (7 * pos + 3) % dims["vocab_size"]
        want = ref.step(Rows(), token, pos)
        for mode, runner in runners.items():
            started = time.perf_counter()
            got = runner.step(Rows(), token, pos)
            seconds[mode] += time.perf_counter() - started
            cos = float(F.cosine_similarity(got["hidden"].double(), want["hidden"].double(), dim=0))
            assert cos > (0.99999 if mode == "fp32" else 0.999), f"{mode} step {pos}: cos {cos}"
            assert got["token"] == want["token"] or mode == "fp16", f"{mode} step {pos}"
    print(f"16-step four-chunk decode: fp32 {seconds['fp32']:.2f}s, fp16 {seconds['fp16']:.2f}s")


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode() + p.read_bytes())
    return h.hexdigest()


def test_sabotage_changes_what_the_package_computes_not_what_read_back_sees(
    build: dict[str, Any], tmp_path: Path
) -> None:
    """Each edit of chunk1's decode program changes the interpreter's outputs;
    the weights today's read-back parity loads by const name stay the same
    for all but the blob-offset swap."""
    import mil_sabotage as sab

    chunk = layout(build, "four")["chunks"][0]
    function = next(f for f in chunk["functions"] if f["kind"] == "decode")
    src = build["dir"] / f"{chunk['name']}.mlpackage"
    before = tree_digest(src)
    fn = Interpreter(str(src)).function(function["name"])
    # Non-zero caches: with empty ones `1 - m` and `m - 1` scale zeros alike.
    inputs = random_inputs(fn, 2)
    base = fn.run(inputs)
    _, base_module = module_outputs(build, chunk, function, str(src), inputs)
    base_state = base_module.state_dict()
    from chunkforge_py.mil.inspect import const_key

    # The weights' program names (coremltools adds suffixes: _to_fp16, _palettized).
    by_key = {const_key(n): n for n in fn.consts}
    q0, q1 = by_key["layers_0_self_attn_q_proj_weight"], by_key["layers_1_self_attn_q_proj_weight"]
    edits: dict[str, Callable[[str], Any]] = {
        "sub": lambda d: sab.swap_sub_operands(str(src), d, function["name"]),
        "slice": lambda d: sab.shift_slice(str(src), d, function["name"]),
        "uses": lambda d: sab.swap_weight_uses(str(src), d, q0, q1, function["name"]),
        "offsets": lambda d: sab.swap_weight_offsets(str(src), d, q0, q1, function["name"]),
    }
    for what, edit in edits.items():
        dst = str(tmp_path / f"{what}.mlpackage")
        edit(dst)
        got = Interpreter(dst).function(function["name"]).run(inputs)
        worst = max(float(np.abs(got[n] - base[n]).max()) for n in base)
        assert worst > 1e-2, f"{what}: the interpreter's outputs did not change ({worst})"
        _, module = module_outputs(build, chunk, function, dst, inputs)
        differ = sorted(k for k, v in module.state_dict().items() if not torch.equal(v, base_state[k]))
        if what == "offsets":
            assert differ == ["layers.0.self_attn.q_proj.weight", "layers.1.self_attn.q_proj.weight"], differ
        else:
            assert differ == [], f"{what}: read-back weights changed: {differ}"
    assert tree_digest(src) == before, "the source package was modified"


def test_tracing_in_fp32_converts_to_the_program_an_fp16_trace_gives(build: dict[str, Any], tmp_path: Path) -> None:
    """`convert.trace` traces the fp16-loaded module with fp32 weights and
    inputs (the frontend then makes no fp32 copy of each weight). The
    converted program must compute what an fp16 trace's does, bit for bit,
    from byte-identical weights. Checked without palettization (the kernel
    is not importable in plain pytest; it reads the same fp16 constants
    either way) on:

    - chunk4's prefill (1x1 convs, attention over its tokens, the head,
      argmax), the largest program: byte-identical weights (the programs
      differ in the frontend's names of constants, ``_to_fp16`` /
      ``_promoted_to_fp16`` and their numbering);
    - chunk1's verify, where the fp16 trace promoted a norm weight read by
      several tokens once per read (duplicate constants of one blob) and the
      fp32 trace reads one constant.

    For both, the interpreter's outputs must be bit-identical. (In the
    bundled chunk1 package, where duplicate constants share one blob, the
    weights are byte-identical too.)"""
    from chunkforge_py.contract import ConversionSettings
    from chunkforge_py.convert import chunks as convert
    from chunkforge_py.model import build_chunk
    from coremltools.proto import Model_pb2

    b = build
    ckpt = checkpoint_of(b)
    recorded = json.loads((b["dir"] / "build.json").read_text())["settings"]
    # build.json leaves out the writer and the shortcuts at their defaults; the seam sends them.
    settings = cast(
        ConversionSettings, {"writer": "chunkforge", "mil_shortcuts": True, **recorded, "palettization": None}
    )

    def converted(chunk: Any, function: Any, how: str) -> Path:
        module = build_chunk(b["dims"], chunk, ckpt, torch.float16, function=function)
        if how == "fp32":
            traced = convert.trace(module)
        else:
            with torch.no_grad():
                inputs = tuple(convert.example_inputs(function))
                traced = torch.jit.trace(module, inputs, check_trace=False, strict=False)
        path = tmp_path / f"{chunk['name']}-{function['name']}-{how}.mlpackage"
        convert.save(convert.convert(traced, function, chunk["name"], settings), str(path))
        return path

    def program_text(path: Path) -> str:
        spec = Model_pb2.Model()
        spec.ParseFromString((path / "Data" / "com.apple.CoreML" / "model.mlmodel").read_bytes())
        return str(spec)

    def weights(path: Path) -> bytes:
        return (path / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").read_bytes()

    def same_outputs(fp16: Path, fp32: Path) -> None:
        run16, run32 = Interpreter(str(fp16)).function("main"), Interpreter(str(fp32)).function("main")
        inputs = random_inputs(run16, 5)
        got16, got32 = run16.run(inputs), run32.run(inputs)
        assert got16.keys() == got32.keys()
        for name, want in got16.items():
            assert np.array_equal(got32[name], want), name

    prefill = layout(b, "prefill")["chunks"][-1]
    fp16, fp32 = (converted(prefill, prefill["functions"][0], how) for how in ("fp16", "fp32"))
    assert weights(fp32) == weights(fp16)
    # Two real conversions, not one program compared with itself.
    assert program_text(fp16) != program_text(fp32), "the fp16 trace no longer promotes weights: drop the fp32 trace"
    same_outputs(fp16, fp32)

    chunk1 = layout(b, "four")["chunks"][0]
    verify = next(f for f in chunk1["functions"] if f["kind"] == "verify")
    fp16, fp32 = (converted(chunk1, verify, how) for how in ("fp16", "fp32"))
    # A package of one function stores each duplicate constant again (a
    # bundle stores them once: the built chunk1's weights are byte-identical).
    assert len(weights(fp32)) < len(weights(fp16))
    same_outputs(fp16, fp32)
