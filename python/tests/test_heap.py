"""The heap policy of the process this runs in (src/heap.rs, runtime.heap_kept).

Inside chunkforge (tests/heap.rs runs this file through `chunkforge
selftest-python`, with and without CHUNKFORGE_HEAP=keep) and in a plain
interpreter (the control: glibc's defaults)."""

from __future__ import annotations

import resource
from collections.abc import Callable

import numpy as np
from chunkforge_py.runtime import heap_kept, release_memory

# Well above glibc's largest mmap threshold (32 MiB): with its defaults an
# array this size is always mapped afresh and unmapped when freed.
SIZE = 256 * 1024 * 1024


def faults(work: Callable[[], None]) -> int:
    """Page faults (minor: no disk) while `work` runs."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    work()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def touch_and_free() -> None:
    a = np.ones(SIZE // 4, dtype=np.float32)
    assert float(a[-1]) == 1.0


def test_freed_memory_is_reused_exactly_when_the_heap_is_kept() -> None:
    first = faults(touch_and_free)
    # A conversion ends like this: its program collected, the heap trimmed
    # unless it is kept.
    release_memory()
    again = faults(touch_and_free)
    # The first array needed pages the process did not have (2 MiB ones where
    # transparent huge pages are on, 4 KiB ones otherwise).
    assert first >= SIZE // (2 * 1024 * 1024), first
    # tests/heap.rs reads which policy was checked (pytest -s).
    print(f"heap policy checked: {'keep' if heap_kept() else 'release'} ({first} faults, then {again})")
    if heap_kept():
        # Written into the pages the first one left: next to no new ones.
        assert again <= first // 10, (first, again)
    else:
        # glibc's defaults: unmapped when freed, faulted in again.
        assert again >= first // 2, (first, again)
