"""The native product kernels (src/matmul) as the Python side uses them:
``chunkforge_native.matmul`` against float64 by the bound src/matmul
defines, on every build this CPU runs (bit for bit alike); `weights.Stored`
as a projection, a MIL conv and linear (also in the interpreter's fp16
mode); inputs checked with errors naming the tensor; and a prefill call
that skips its padding returning what computing it returns.

These need `chunkforge_native`, which only exists inside the chunkforge
binary: tests/matmul.rs runs them with `chunkforge selftest-python`, once
per instruction set (CHUNKFORGE_MATMUL_ISA). Under a plain ``python -m
pytest`` they are skipped.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import coremltools as ct
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

native = pytest.importorskip("chunkforge_native")

from chunkforge_py import weights  # noqa: E402
from chunkforge_py.mil.interp import Interpreter  # noqa: E402
from chunkforge_py.weights import Stored  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHOSEN, ISAS = native.matmul_isas()
RNG = np.random.default_rng(3)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """One torch thread, as the binary runs (`runtime.configure`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bound(cols: int, abs_sum: np.ndarray) -> np.ndarray:
    """src/matmul's bound: gamma_k * sum|x w| + k * 2^-150, k = 2 ceil(cols/32) + 4,
    plus float64's own rounding of the reference."""
    k = 2 * math.ceil(cols / 32) + 4
    u = 2.0**-24
    return k * u / (1 - k * u) * abs_sum + k * 2.0**-150 + abs_sum * cols * np.finfo(np.float64).eps


def weight(kind: str, rows: int, cols: int, group_rows: int = 1) -> tuple[Stored, np.ndarray]:
    """A random stored weight and its values in float64."""
    scale = RNG.standard_normal((rows, cols)) * 0.05
    if kind == "lut4":
        lut = RNG.standard_normal((rows // group_rows, 16)).astype(np.float16).astype(np.float32)
        idx = RNG.integers(0, 16, rows * cols + (rows * cols) % 2).astype(np.uint8)
        packed = (idx[0::2] | (idx[1::2] << 4)).astype(np.uint8)
        values = lut[
            np.repeat(np.arange(rows // group_rows), group_rows)[:, None], idx[: rows * cols].reshape(rows, cols)
        ]
        return Stored("lut4", packed, (rows, cols), "w", lut=lut, group_rows=group_rows), values.astype(np.float64)
    if kind == "bf16":
        t = torch.from_numpy(scale.astype(np.float32)).bfloat16()
        return Stored("bf16", t.view(torch.int16).numpy().view(np.uint16), (rows, cols), "w"), t.double().numpy()
    if kind == "fp16":
        h = scale.astype(np.float16)
        return Stored("fp16", h.view(np.uint16), (rows, cols), "w"), h.astype(np.float64)
    f = scale.astype(np.float32)
    return Stored("fp32", f, (rows, cols), "w"), f.astype(np.float64)


def within_bound(got: np.ndarray, x: np.ndarray, w: np.ndarray, what: str) -> None:
    """``got`` [tokens, rows] against x [tokens, cols] @ w.T in float64."""
    x64 = x.astype(np.float64)
    want = x64 @ w.T
    abs_sum = np.abs(x64) @ np.abs(w).T
    err = np.abs(got.astype(np.float64) - want)
    limit = bound(w.shape[1], abs_sum)
    worst = np.unravel_index(np.argmax(err - limit), err.shape)
    assert (err <= limit).all(), f"{what}: output {worst} off by {err[worst]:e}, bound {limit[worst]:e}"


KINDS = ["lut4", "bf16", "fp16", "fp32"]
SHAPES = [(1, 1, 1), (5, 17, 3), (64, 96, 1), (96, 1536, 3), (33, 65, 8), (256, 301, 2)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,cols,tokens", SHAPES)
def test_every_build_within_the_bound_and_alike(kind: str, rows: int, cols: int, tokens: int) -> None:
    group = 32 if rows % 32 == 0 else 1
    stored, values = weight(kind, rows, cols, group)
    x = RNG.standard_normal((tokens, cols)).astype(np.float32)
    outs = {}
    for isa in ISAS:
        got = native.matmul(x, stored.spec(), rows, cols, isa=isa, name="w")
        assert got.shape == (tokens, rows) and got.dtype == np.float32
        within_bound(got, x, values, f"{kind} {isa}")
        outs[isa] = got
    for isa, got in outs.items():
        assert got.tobytes() == outs["portable"].tobytes(), f"{kind}: {isa} differs from portable"


def test_the_chosen_build_is_the_capped_one() -> None:
    cap = os.environ.get("CHUNKFORGE_MATMUL_ISA")
    order = ["portable", "avx2", "avx512"]
    want = max((i for i in ISAS if cap is None or order.index(i) <= order.index(cap)), key=order.index)
    assert CHOSEN == want, (CHOSEN, cap, ISAS)


def test_e2b_head_decode_within_the_bound() -> None:
    """E2B's tied head, 262144 x 1536 INT4 (group 32), one token, the chosen build."""
    rows, cols = 262144, 1536
    lut = (RNG.standard_normal((rows // 32, 16)) * 0.05).astype(np.float16).astype(np.float32)
    packed = RNG.integers(0, 256, rows * cols // 2).astype(np.uint8)
    x = RNG.standard_normal((1, cols)).astype(np.float32)
    got = native.matmul(x, ("lut4", packed, lut, 32), rows, cols)
    # Every 4096th row in float64 (the whole head is 0.4 G products).
    for r0 in range(0, rows, 32768):
        rs = np.arange(r0, r0 + 32768, 4096)
        idx = np.empty((len(rs), cols), np.uint8)
        sub = packed.reshape(rows, cols // 2)[rs]
        idx[:, 0::2], idx[:, 1::2] = sub & 15, sub >> 4
        values = np.take_along_axis(lut[rs // 32], idx.astype(np.int64), axis=1).astype(np.float64)
        within_bound(got[:, rs], x, values, "E2B head")


def test_channels_first_live_and_strided_inputs() -> None:
    rows, cols, tokens, live = 48, 70, 9, 4
    stored, values = weight("lut4", rows, cols, 16)
    x = RNG.standard_normal((cols, tokens)).astype(np.float32).T  # a transposed view
    full = native.matmul(x, stored.spec(), rows, cols)
    within_bound(full, np.ascontiguousarray(x), values, "strided")
    part = native.matmul(x, stored.spec(), rows, cols, live=live, channels_first=True)
    assert part.shape == (rows, tokens)
    assert part[:, :live].tobytes() == np.ascontiguousarray(full[:live].T).tobytes()
    assert not part[:, live:].any()


def test_stored_projection_matches_torch_within_the_bound() -> None:
    """`Stored.conv` on NCHW [1, in, 1, T] (a projection) and [2, in, 3, 1],
    `Stored.linear` on [..., in]; a negated weight negates exactly."""
    rows, cols = 40, 96
    stored, values = weight("bf16", rows, cols)
    w = torch.from_numpy(values).float()
    x = torch.randn(1, cols, 1, 5)
    y = stored.conv(x)
    within_bound(y.reshape(rows, 5).T.numpy(), x.reshape(cols, 5).T.numpy(), values, "conv")
    ref = F.conv2d(x, w.view(rows, cols, 1, 1))
    assert y.shape == ref.shape
    batch = torch.randn(2, cols, 3, 1)
    yb = stored.conv(batch)
    assert torch.allclose(yb, F.conv2d(batch, w.view(rows, cols, 1, 1)), atol=1e-5)
    lin = torch.randn(2, 3, cols)
    assert torch.allclose(stored.linear(lin), F.linear(lin, w), atol=1e-5)
    assert torch.equal(stored.negated().conv(x), -y)
    assert torch.equal(stored.dense(), w)


def test_unaligned_float32_weight_is_read() -> None:
    """A float32 weight mapped from a safetensors file whose data starts off
    a 4-byte boundary (the sharp fixture's) is neither aligned nor, to the
    kernels, contiguous: `Stored` takes it all the same, with equal products."""
    rows, cols = 24, 64
    values = RNG.standard_normal((rows, cols)).astype(np.float32)
    raw = np.zeros(values.nbytes + 3, np.uint8)
    raw[3:] = values.view(np.uint8).reshape(-1)
    unaligned = raw[3:].view(np.float32).reshape(rows, cols)
    assert not unaligned.flags["ALIGNED"]
    x = torch.randn(3, cols)
    got = Stored("fp32", unaligned, (rows, cols), "unaligned").matmul(x)
    want = Stored("fp32", values, (rows, cols), "aligned").matmul(x)
    assert torch.equal(got, want)


def test_bad_input_names_the_tensor() -> None:
    stored, _ = weight("lut4", 32, 8, 16)
    x = np.zeros((1, 8), np.float32)
    with pytest.raises(ValueError, match="layers.3.q_proj.*an input of 9 columns"):
        native.matmul(np.zeros((1, 9), np.float32), stored.spec(), 32, 8, name="layers.3.q_proj")
    with pytest.raises(ValueError, match="layers.3.q_proj.*stored values"):
        native.matmul(np.zeros((1, 10), np.float32), stored.spec(), 32, 10, name="layers.3.q_proj")
    assert stored.lut is not None
    bad = stored.lut.copy()
    bad[1, 2] = np.inf
    with pytest.raises(ValueError, match="head.*LUT entry 2 of group 1 is inf"):
        native.matmul(x, ("lut4", stored.data, bad, 16), 32, 8, name="head")
    with pytest.raises(ValueError, match="head.*uint16"):
        native.matmul(x, ("bf16", stored.data, None, 0), 32, 8, name="head")
    with pytest.raises(ValueError, match="unknown stored form"):
        native.matmul(x, ("int8", stored.data, None, 0), 32, 8)
    with pytest.raises(ValueError, match="live tokens"):
        native.matmul(x, stored.spec(), 32, 8, live=2)


# ---- the interpreter ------------------------------------------------------------------


def save(prog: Any, tmp_path: Path, name: str) -> Interpreter:
    model = ct.convert(
        prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18, pass_pipeline=ct.PassPipeline.EMPTY
    )
    path = tmp_path / f"{name}.mlpackage"
    model.save(str(path))
    return Interpreter(str(path))


@pytest.mark.parametrize("fp16", [False, True])
def test_interpreter_projections_read_their_weights_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fp16: bool
) -> None:
    """A 4-bit palettized 1x1 conv, an fp16 linear and an fp16 conv run by
    the interpreter with the kernels (their weights `Stored`), against the
    dense path (the same program with the kernels off): within the bound in
    fp32; in fp16 mode every fp16 output is still rounded to fp16, so the
    two differ by at most the bound and one fp16 rounding each."""
    cin, cout, t = 96, 64, 3
    idx = RNG.integers(0, 16, (cout, cin, 1, 1)).astype(types.np_uint4_dtype)
    lut = RNG.standard_normal((cout // 32, 1, 1, 1, 16, 1)).astype(np.float16) * np.float16(0.1)
    w16 = (RNG.standard_normal((cout, cin)) * 0.1).astype(np.float16)
    wc16 = (RNG.standard_normal((cout, cin, 1, 1)) * 0.1).astype(np.float16)
    specs = [mb.TensorSpec(shape=(1, cin, 1, t), dtype=types.fp16), mb.TensorSpec(shape=(t, cin), dtype=types.fp16)]

    @mb.program(input_specs=specs, opset_version=ct.target.iOS18)
    def prog(img: Any, x: Any) -> Any:
        w = mb.constexpr_lut_to_dense(indices=idx, lut=lut, name="w4")
        return (
            mb.conv(x=img, weight=w, name="c4"),
            mb.linear(x=x, weight=w16, name="l16"),
            mb.conv(x=img, weight=wc16, name="c16"),
        )

    interp = save(prog, tmp_path, "stored")
    fn = interp.function()
    kinds = {type(v).__name__ for s in fn.steps for k, v in s.static.items() if k == "weight"}
    assert kinds == {"Lazy"}, kinds
    made = {s.op_type: weights.value_of(s.static["weight"]) for s in fn.steps if "weight" in s.static}
    assert all(isinstance(v, Stored) for v in made.values()), made
    inputs = {
        "img": (RNG.standard_normal((1, cin, 1, t)) * 0.5).astype(np.float16),
        "x": (RNG.standard_normal((t, cin)) * 0.5).astype(np.float16),
    }
    got = fn.run(inputs, fp16=fp16)
    monkeypatch.setattr(weights, "_kernels", False)
    dense = save(prog, tmp_path, "dense").function().run(inputs, fp16=fp16)
    products = {
        "c4": (inputs["img"].reshape(cin, t).T, made["conv"].dense().numpy().reshape(cout, cin)),
        "l16": (inputs["x"], w16),
        "c16": (inputs["img"].reshape(cin, t).T, wc16.reshape(cout, cin)),
    }
    for name, (x, w) in products.items():
        # Token-major [t, cout], as `within_bound` reads it.
        g, ref = (a[name].reshape(t, cout) if name == "l16" else a[name].reshape(cout, t).T for a in (got, dense))
        assert got[name].dtype == (np.float16 if fp16 else np.float32), name
        abs_sum = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
        # Each side within the bound of the exact value; fp16 mode rounds
        # each to fp16 once more (half an fp16 ulp, 2^-11 relative).
        limit = 2 * bound(cin, abs_sum)
        if fp16:
            limit = limit + 2.0**-10 * np.abs(ref.astype(np.float64)) + 2.0**-24
        err = np.abs(g.astype(np.float64) - ref.astype(np.float64))
        assert (err <= limit).all(), f"{name}: worst {err.max():e}"


def checkpoint_of(b: dict[str, Any]) -> Any:
    """The checkpoint a shared build read."""
    from chunkforge_py.checkpoint import Checkpoint
    from safetensors import safe_open

    files = {}
    folder = b["checkpoint"]["dir"]
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            with safe_open(path, framework="pt") as f:
                files.update(dict.fromkeys(f.keys(), path))
    return Checkpoint({"prefix": b["checkpoint"]["tensor_prefix"], "files": files})


# ---- a prefill call's padding ----------------------------------------------------------


def shared_build() -> dict[str, Any]:
    given = os.environ.get("CHUNKFORGE_TEST_BUILD")
    found = sorted((ROOT / "target" / "tmp" / "builds").glob("gen*/default-all/build.json"))
    path = Path(given) if given else found[-1].parent if found else None
    if path is None or not (path / "build.json").exists():
        pytest.skip("no shared build default-all: tests/matmul.rs sets CHUNKFORGE_TEST_BUILD")
    info = json.loads((path / "build.json").read_text())
    return {"dir": path, "plan": info["plan"], "dims": info["plan"]["dims"], "checkpoint": info["checkpoint"]}


@pytest.mark.parametrize("fp16", [False, True])
def test_prefill_skipping_its_padding_returns_what_computing_it_returns(
    fp16: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prefill_chunk1..4's programs (fp32 and fp16 mode), and the read-back
    torch modules, on a short prompt in the longest prefill function: with
    the padding's projections skipped (`weights.live_tokens`) the token,
    its logit, every layer's K/V rows of the prompt and the per-layer hidden
    states are the same bits as with the padding computed. On one torch
    thread instead of two (a prefill call's ops run on one per core) the
    token is the same and every value within float32 rounding: torch splits
    these ops by rows (equal bits here), but a BLAS may split a product
    differently on another CPU."""
    from chunkforge_py.emulate import stepper
    from chunkforge_py.emulate.stepper import Embeddings, PrefillRunner, function_of
    from chunkforge_py.mil.chunk import ProgramChunk
    from chunkforge_py.parity.programs import Programs

    b = shared_build()
    layout = next(lay for lay in b["plan"]["layouts"] if lay["kind"] == "prefill")
    n_call = max(f["tokens"] for f in layout["chunks"][0]["functions"])
    emb = Embeddings(b["dims"], checkpoint_of(b))
    prompt = [5, 17, 300, 42, 7, 9]
    programs = Programs(str(b["dir"]))
    kinds: list[tuple[str, dict[str, Any]]] = [
        (
            "programs",
            {
                c["name"]: ProgramChunk(programs.interpreter(c["name"]), function_of(c, "prefill", n_call), fp16)
                for c in layout["chunks"]
            },
        )
    ]
    if not fp16:
        kinds.append(("read-back modules", programs.read_back(b["dims"], layout["chunks"], "prefill")))
    for what, modules in kinds:
        runs = []
        for skip, threads in ((True, 2), (False, 2), (True, 1)):
            monkeypatch.setattr(stepper, "cores", lambda threads=threads: threads)
            runner = PrefillRunner(b["dims"], layout, None, n_call, modules=modules)
            runner.skip_padding = skip
            runs.append(runner.run(emb, prompt))
        skipped = runs[0]
        for computed, exact in zip(runs[1:], (True, False), strict=True):
            how = "padding computed" if exact else "one thread"

            def same(a: torch.Tensor, b: torch.Tensor, exact: bool = exact) -> bool:
                return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)

            assert skipped["token"] == computed["token"], (what, how)
            assert same(torch.tensor(skipped["logit"]), torch.tensor(computed["logit"])), (what, how)
            assert skipped["kv"].keys() == computed["kv"].keys()
            for layer, (k, v) in skipped["kv"].items():
                assert k.shape[2] == len(prompt)
                assert same(k, computed["kv"][layer][0]), (what, how, layer)
                assert same(v, computed["kv"][layer][1]), (what, how, layer)
            for layer, h in skipped["trace"].items():
                assert same(h, computed["trace"][layer]), (what, how, layer)
