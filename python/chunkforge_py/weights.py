"""Weights made when an op reads them, not held by the modules that run them,
and multiplied in the form they are stored in.

Parity compares several copies of one model: the checkpoint's weights in the
reference and every layout, the packages' weights read back into the same
modules, the packages' own programs run by the MIL interpreter, and
transformers on the checkpoint. At real size one fp32 copy is 7 GB (E2B) or
16 GB (E4B), so none of them can be held whole. Each large weight (a
projection's matrix, a palettized constant) is therefore made from its
source when the op that reads it runs and let go after: from the checkpoint
with a positioned read (`read_at`: the file is never mapped into the process,
so its pages stay in the page cache and out of this process's resident set),
from a package by dequantizing its indices and LUT. What fits in one budget
(`Resident`, shared by every source) is kept between uses instead: a small
model stays resident whole, as if nothing were streamed, and a large one
keeps what came first and makes the rest again at each use. Either way a
weight holds the same values, so streaming changes no result.

A projection's weight is made in its stored form (`Stored`): a package's
4-bit indices, two a byte, with their per-group LUT, or the checkpoint's
bf16 / fp16 rows, as the files hold them. The native kernels
(``chunkforge_native.matmul``, src/matmul) multiply it there, widening each
block of weights to float32 in registers: no dense float32 copy of a
projection is made, and the budget holds two (bf16) to eight (INT4) times
the weights it held in float32. Every output is the same float32 product up
to the order of its sums (src/matmul's doc gives the order and its bound).
``CHUNKFORGE_MATMUL=dense`` keeps the path before it (every weight made
dense in float32, torch's product): the baseline of ``bench run``.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from .runtime import ChunkforgeError

# Bytes of weights kept between uses, by every source together (`Resident`):
# 2.5 GiB, what parity can spare at E2B size within 8 GiB (README, "Memory").
RESIDENT_BYTES = 5 << 29


class Resident:
    """Weights kept between uses, up to ``budget`` bytes, in working sets.

    Within one working set nothing is let go: a weight that does not fit is
    made again at each use and the ones held stay (a decode step reads every
    weight once, in the same order, so evicting the oldest for the newest
    would keep none of them until its next use). `next_set` starts a new
    working set (parity runs one chunk over all its steps, then the next:
    `stepper.schedule`); a weight of the new set that does not fit then
    takes the room of weights no use has touched since, least recently used
    first. Without `next_set` (one step at a time) it is first come, never
    evicted."""

    def __init__(self, budget: int = RESIDENT_BYTES):
        self.budget = budget
        self.used = 0
        self.set = 0
        # Weights made (kept or not) and their bytes, over the process.
        self.makes = 0
        self.made_bytes = 0
        # In order of last use, oldest first, with the working set of that use.
        self._held: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._keeping = True

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        held = self._held.get(key)
        if held is not None:
            self._held[key] = (held[0], self.set)
            self._held.move_to_end(key)
            return held[0]
        value = make()
        size = nbytes(value)
        self.makes += 1
        self.made_bytes += size
        tally(SOURCES.get(key[0], "other") if isinstance(key, tuple) and key else "other", form_of(value), size)
        if not self._keeping:
            return value
        if self.used + size > self.budget:
            self._make_room(size)
        if self.used + size <= self.budget:
            self._held[key] = (value, self.set)
            self.used += size
        return value

    def held(self, key: Hashable) -> Any | None:
        """The weight held under ``key``, if any (not counted as a use)."""
        held = self._held.get(key)
        return held[0] if held is not None else None

    def next_set(self) -> None:
        """A new working set starts: the weights held so far may make room for it."""
        self.set += 1

    def _make_room(self, size: int) -> None:
        """Lets go of the least recently used weights of earlier working
        sets, if that leaves room for ``size`` bytes (else of none)."""
        older = [k for k, (_, s) in self._held.items() if s < self.set]
        if self.used - sum(nbytes(self._held[k][0]) for k in older) + size > self.budget:
            return
        for key in older:
            if self.used + size <= self.budget:
                break
            self.used -= nbytes(self._held.pop(key)[0])

    @contextmanager
    def passing(self) -> Iterator[None]:
        """Within it, weights not held are made for the use at hand and not
        kept (a weight read once, whose room later uses need)."""
        keeping, self._keeping = self._keeping, False
        try:
            yield
        finally:
            self._keeping = keeping

    def release(self, keep: Callable[[Hashable], bool]) -> None:
        """Let go of every held weight whose key ``keep`` rejects."""
        for key in [k for k in self._held if not keep(k)]:
            self.used -= nbytes(self._held.pop(key)[0])


def nbytes(value: Any) -> int:
    if isinstance(value, Stored):
        return value.nbytes
    return int(value.numel() * value.element_size())


# Another budget, in bytes, for benchmarks (`bench parity --compare order`
# on a small checkpoint with a budget as much smaller than its model as
# 2.5 GiB is than a real-size one's, docs/benchmarks.md).
RESIDENT_ENV = "CHUNKFORGE_RESIDENT_BYTES"


def budget_from_env() -> int:
    """`RESIDENT_BYTES`, or the budget ``$CHUNKFORGE_RESIDENT_BYTES`` gives."""
    value = os.environ.get(RESIDENT_ENV)
    if not value:
        return RESIDENT_BYTES
    if not value.isdigit():
        raise ChunkforgeError(f"{RESIDENT_ENV}={value}: expected a number of bytes")
    return int(value)


# Where `write_stats` puts what the budget made (`bench parity --compare order`).
STATS_ENV = "CHUNKFORGE_WEIGHT_STATS"


def write_stats() -> None:
    """``{"makes", "made_bytes", "budget", "made"}`` into the file
    ``$CHUNKFORGE_WEIGHT_STATS`` names, if set: what `RESIDENT` made, and
    every weight made by source and form (`tally`)."""
    path = os.environ.get(STATS_ENV)
    if path:
        made = [
            {"source": source, "form": form, "makes": n, "bytes": size}
            for (source, form), (n, size) in sorted(MADE.items())
        ]
        stats = {"makes": RESIDENT.makes, "made_bytes": RESIDENT.made_bytes, "budget": RESIDENT.budget, "made": made}
        with open(path, "w") as f:
            json.dump(stats, f)


# Weights made over the process, by (source, form): makes and bytes. A
# source is what the weight is for: parity's modules reading the checkpoint
# ("checkpoint"), the packages' weights ("packages"), the INT4 noise floor's
# noisy weights ("noise"), transformers' layers ("transformers": it
# multiplies float tensors, so each is made for the call that reads it),
# and values made dense for an op the kernels do not serve ("dense"). A
# form is a `Stored` kind (lut4, bf16, fp16, fp32 as stored) or, for a
# tensor made from a stored weight, "float32" / "float64".
MADE: dict[tuple[str, str], tuple[int, int]] = {}
SOURCES = {"checkpoint": "checkpoint", "mil": "packages", "weight-noise": "noise"}
# The source of the dense values `Stored.rows_f32` makes (`making`).
_purpose = "dense"


def tally(source: str, form: str, size: int) -> None:
    n, total = MADE.get((source, form), (0, 0))
    MADE[(source, form)] = (n + 1, total + size)


def form_of(value: Any) -> str:
    if isinstance(value, Stored):
        return value.kind
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else type(value).__name__


@contextmanager
def making(source: str) -> Iterator[None]:
    """Within it, dense values made from stored weights count for ``source``."""
    global _purpose
    before, _purpose = _purpose, source
    try:
        yield
    finally:
        _purpose = before


# The process's one budget: parity's modules, its read-back packages and the
# interpreter's programs all draw on it.
RESIDENT = Resident(budget_from_env())


class Lazy:
    """A weight made on use (through `RESIDENT`), with the shape it will
    have: a tensor, or a `Stored` weight."""

    __slots__ = ("key", "make", "shape")

    def __init__(self, key: Hashable, make: Callable[[], Any], shape: tuple[int, ...]):
        self.key = key
        self.make = make
        self.shape = shape

    def get(self) -> Any:
        return RESIDENT.get(self.key, self.make)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def value_of(v: Any) -> Any:
    """``v``, made if it is `Lazy`."""
    return v.get() if isinstance(v, Lazy) else v


def read_at(fd: int, offset: int, out: torch.Tensor, what: str) -> torch.Tensor:
    """Fills the contiguous tensor ``out`` with the bytes of the open file
    ``fd`` at ``offset``, by positioned reads (no mapping of the file)."""
    view = out.view(-1).view(torch.uint8).numpy().data
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{what}: the file ends {len(view) - done} bytes early")
        done += n
    return out


# ---- weights in their stored form -------------------------------------------------

# How projections multiply: "native" (weights in their stored form, the
# kernels of src/matmul; the default inside the binary) or "dense" (every
# weight made in float32 and multiplied by torch, as before the kernels:
# the baseline `bench run` compares).
MATMUL_ENV = "CHUNKFORGE_MATMUL"

_native: Any = None
_kernels: bool | None = None


def kernels() -> bool:
    """Whether projections multiply their stored weights natively: inside
    the binary (where ``chunkforge_native`` is importable) unless
    ``$CHUNKFORGE_MATMUL`` is ``dense``; read once per process."""
    global _native, _kernels
    if _kernels is None:
        mode = os.environ.get(MATMUL_ENV) or "native"
        if mode not in ("native", "dense"):
            raise ChunkforgeError(f"{MATMUL_ENV}={mode}: expected native or dense")
        try:
            import chunkforge_native

            _native = chunkforge_native
        except ImportError:
            _native = None
        _kernels = mode == "native" and _native is not None
    return _kernels


def native() -> Any:
    """The ``chunkforge_native`` module (inside the binary)."""
    kernels()
    if _native is None:
        raise ChunkforgeError(
            "a stored weight needs the native kernels: chunkforge_native exists only inside the binary"
        )
    return _native


# Stored forms the kernels read, by the numpy dtype of their values.
STORED_KINDS = {"lut4": np.uint8, "bf16": np.uint16, "fp16": np.uint16, "fp32": np.float32}


class Stored:
    """A projection's weight in its stored form: ``kind`` "lut4" (``data``
    the 4-bit indices as the weight file stores them, two a byte, the low
    nibble first; ``lut`` float32 [groups, 16], one table per
    ``group_rows`` rows: a package's fp16 entries, widened exactly), "bf16"
    / "fp16" (``data`` the bits, [rows, cols]) or "fp32". ``shape`` is the
    weight's own ([out, in], or a 1x1 convolution's [out, in, 1, 1]): rows
    are the output channels, cols every other axis. ``sign`` -1 negates
    every product (a test hook's corrupted weight, exactly)."""

    __slots__ = ("cols", "data", "group_rows", "kind", "lut", "name", "rows", "shape", "sign")

    def __init__(
        self,
        kind: str,
        data: np.ndarray,
        shape: tuple[int, ...],
        name: str,
        lut: np.ndarray | None = None,
        group_rows: int = 0,
        sign: float = 1.0,
    ):
        if kind not in STORED_KINDS or data.dtype != STORED_KINDS[kind]:
            raise ChunkforgeError(f"{name}: a {kind} weight of {data.dtype} values")
        self.kind = kind
        # The kernels read C-ordered, aligned values: a float32 tensor mapped
        # from a safetensors file whose data starts off a 4-byte boundary is
        # neither, and is copied once here (no copy otherwise).
        self.data = np.require(data, requirements=("C", "A"))
        self.shape = tuple(int(d) for d in shape)
        self.rows = self.shape[0] if self.shape else 1
        self.cols = math.prod(self.shape[1:])
        self.lut = None if lut is None else np.require(lut, requirements=("C", "A"))
        self.group_rows = group_rows
        self.name = name
        self.sign = sign

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (self.lut.nbytes if self.lut is not None else 0))

    def numel(self) -> int:
        return self.rows * self.cols

    def spec(self) -> tuple[str, np.ndarray, np.ndarray | None, int]:
        return (self.kind, self.data, self.lut, self.group_rows)

    def negated(self) -> Stored:
        return Stored(self.kind, self.data, self.shape, self.name, self.lut, self.group_rows, -self.sign)

    def matmul(self, x: torch.Tensor, live: int | None = None, channels_first: bool = False) -> torch.Tensor:
        """``x [tokens, cols] · Wᵀ``: float32 [tokens, rows] (or [rows,
        tokens]); only the first ``live`` tokens computed, the rest 0."""
        if x.dtype != torch.float32:
            x = x.float()
        out = native().matmul(x.detach().numpy(), self.spec(), self.rows, self.cols, live, channels_first, self.name)
        y = torch.from_numpy(out)
        return -y if self.sign < 0 else y

    def conv(self, x: torch.Tensor) -> torch.Tensor:
        """The 1x1 convolution of ``x [N, cols, *spatial]`` (a projection on
        the Neural Engine's NCHW tensors): ``[N, rows, *spatial]``. One
        image's positions are its tokens; a prefill call's padding among
        them is skipped (`live_tokens`)."""
        n, c, spatial = int(x.shape[0]), int(x.shape[1]), tuple(int(d) for d in x.shape[2:])
        positions = math.prod(spatial)
        if n == 1 and positions == 1:
            # One token (decode): [1, c, 1, 1] is the token's row as it is.
            return self.matmul(x.reshape(1, c)).reshape(1, self.rows, *spatial)
        if n == 1:
            y = self.matmul(x.reshape(c, positions).t(), live_of(spatial), channels_first=True)
            return y.reshape(1, self.rows, *spatial)
        y = self.matmul(x.movedim(1, -1).reshape(-1, c))
        return y.reshape(n, *spatial, self.rows).movedim(-1, 1)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., cols] · Wᵀ``: [..., rows]."""
        lead = tuple(int(d) for d in x.shape[:-1])
        return self.matmul(x.reshape(-1, int(x.shape[-1]))).reshape(*lead, self.rows)

    def rows_f32(self, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 as float32 [stop - start, cols] (the values
        the products use)."""
        stop = min(stop, self.rows)
        out = torch.from_numpy(native().dense_rows(self.spec(), self.rows, self.cols, start, stop, self.name))
        tally(_purpose, "float32", out.numel() * 4)
        return -out if self.sign < 0 else out

    def dense_into(self, out: torch.Tensor) -> torch.Tensor:
        """The whole weight's float32 values written into ``out`` (a
        contiguous float32 tensor of its size, memory the caller reuses)."""
        native().dense_rows_into(
            self.spec(), self.rows, self.cols, 0, out.view(self.rows, self.cols).numpy(), self.name
        )
        tally(_purpose, "float32", out.numel() * 4)
        if self.sign < 0:
            out.neg_()
        return out.view(self.shape)

    def dense(self) -> torch.Tensor:
        """The whole weight in float32, in its shape: the general path, for
        an op the kernels do not serve."""
        return self.rows_f32(0, self.rows).reshape(self.shape)


def relative_error(got: Stored, want: Stored) -> float:
    """mean((got - want)^2) / mean(want^2) of two stored weights of one
    shape, summed in float64 by the kernels (no float32 copy of either)."""
    if (got.rows, got.cols) != (want.rows, want.cols):
        raise ChunkforgeError(f"{got.name}: shape {got.shape} against {want.shape}")
    err, ref = native().squared_error(got.spec(), want.spec(), got.rows, got.cols, got.name)
    n = max(1, got.numel())
    return (err / n) / max(ref / n, 1e-30)


def shaped(value: Any, shape: tuple[int, ...]) -> Any:
    """A weight in ``shape``: a tensor viewed so, a `Stored` one as it is."""
    return value if isinstance(value, Stored) else value.reshape(shape)


# A prefill call's padding: (live tokens, tokens of the call), while
# `live_tokens` holds.
_live: tuple[int, int] | None = None


@contextmanager
def live_tokens(live: int, tokens: int) -> Iterator[None]:
    """Within it, the projections of a call of ``tokens`` tokens compute
    only the first ``live`` (the prompt) and leave the padding's outputs 0.
    Sound where the caller keeps only the first ``live`` tokens' results
    and every op that mixes tokens is causal (a prefill call: its attention
    is masked, so a padded row cannot reach a real one, and its last-token
    pick multiplies every other row by 0): the real rows are computed
    exactly as with the padding, since a padded row only ever meets them
    as a masked score (exp(-inf) = 0) or a product by 0 of a finite value.
    `stepper.PrefillRunner` uses it; tests hold it to computing the padding
    (python/tests/test_matmul_native.py)."""
    global _live
    before, _live = _live, (live, tokens)
    try:
        yield
    finally:
        _live = before


def live_of(spatial: tuple[int, ...]) -> int | None:
    """The live tokens of a 1x1 convolution over ``spatial`` positions:
    within `live_tokens`, when one axis holds the call's tokens and the
    others are 1; else None (every position computed)."""
    if _live is None:
        return None
    live, tokens = _live
    big = [d for d in spatial if d != 1]
    return live if big == [tokens] else None
