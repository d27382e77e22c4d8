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

import os
from collections.abc import Callable, Hashable
from typing import Any

import torch

# Bytes of weights kept between uses, by every source together (`Resident`):
# 2.5 GiB, what parity can spare at E2B size within 8 GiB (README, "Memory").
RESIDENT_BYTES = 5 << 29


class Resident:
    """Weights kept between uses, up to ``budget`` bytes. A weight that
    does not fit is made again at each use; the ones held stay (a decode
    step reads every weight once, in the same order, so evicting the oldest
    for the newest would keep none of them until its next use)."""

    def __init__(self, budget: int = RESIDENT_BYTES):
        self.budget = budget
        self.used = 0
        self._held: dict[Hashable, torch.Tensor] = {}

    def get(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        held = self._held.get(key)
        if held is not None:
            return held
        value = make()
        size = value.numel() * value.element_size()
        if self.used + size <= self.budget:
            self._held[key] = value
            self.used += size
        return value

    def release(self, keep: Callable[[Hashable], bool]) -> None:
        """Let go of every held weight whose key ``keep`` rejects."""
        for key in [k for k in self._held if not keep(k)]:
            value = self._held.pop(key)
            self.used -= value.numel() * value.element_size()


# The process's one budget: parity's modules, its read-back packages and the
# interpreter's programs all draw on it.
RESIDENT = Resident()


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
