"""Weights made when an op reads them, not held by the modules that run them.

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
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

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
        self._held: OrderedDict[Hashable, tuple[torch.Tensor, int]] = OrderedDict()
        self._keeping = True

    def get(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        held = self._held.get(key)
        if held is not None:
            self._held[key] = (held[0], self.set)
            self._held.move_to_end(key)
            return held[0]
        value = make()
        size = nbytes(value)
        self.makes += 1
        self.made_bytes += size
        if not self._keeping:
            return value
        if self.used + size > self.budget:
            self._make_room(size)
        if self.used + size <= self.budget:
            self._held[key] = (value, self.set)
            self.used += size
        return value

    def held(self, key: Hashable) -> torch.Tensor | None:
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


def nbytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


# Another budget, in bytes, for benchmarks (`bench parity --order-baseline`
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


# Where `write_stats` puts what the budget made (`bench parity --order-baseline`).
STATS_ENV = "CHUNKFORGE_WEIGHT_STATS"


def write_stats() -> None:
    """``{"makes", "made_bytes", "budget"}`` of `RESIDENT` into the file
    ``$CHUNKFORGE_WEIGHT_STATS`` names, if set."""
    path = os.environ.get(STATS_ENV)
    if path:
        stats = {"makes": RESIDENT.makes, "made_bytes": RESIDENT.made_bytes, "budget": RESIDENT.budget}
        with open(path, "w") as f:
            json.dump(stats, f)


# The process's one budget: parity's modules, its read-back packages and the
# interpreter's programs all draw on it.
RESIDENT = Resident(budget_from_env())


class Lazy:
    """A weight made on use (through `RESIDENT`), with the shape it will have."""

    __slots__ = ("key", "make", "shape")

    def __init__(self, key: Hashable, make: Callable[[], torch.Tensor], shape: tuple[int, ...]):
        self.key = key
        self.make = make
        self.shape = shape

    def get(self) -> torch.Tensor:
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
