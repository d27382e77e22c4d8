"""The heap policy of the process this runs in (src/heap.rs, runtime.heap_kept).

Inside chunkforge (tests/heap.rs runs this file through `chunkforge
selftest-python`, with and without CHUNKFORGE_HEAP=keep) and in a plain
interpreter (the control: glibc's defaults)."""

from __future__ import annotations

import resource

import numpy as np
import pytest
from chunkforge_py.runtime import heap_kept, release_memory

# Well above glibc's largest mmap threshold (32 MiB): with its defaults an
# array this size is always mapped afresh and unmapped when freed.
SIZE = 256 * 1024 * 1024


def resident() -> int:
    """Bytes of this process's memory in RAM (/proc/self/statm)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        pytest.skip("no /proc/self/statm: the resident size is read from Linux's proc")
    return pages * resource.getpagesize()


def touch_and_free() -> None:
    a = np.ones(SIZE // 4, dtype=np.float32)
    assert float(a[-1]) == 1.0


def test_freed_memory_is_reused_exactly_when_the_heap_is_kept() -> None:
    """Measured by the resident size, not by page faults: numpy asks for
    transparent huge pages on large arrays, so the same array can fault 4 KiB
    pages one time and 2 MiB ones the next (4217 faults, then 129)."""
    before = resident()
    touch_and_free()
    # A conversion ends like this: its program collected, the heap trimmed
    # unless it is kept.
    release_memory()
    kept = resident() - before
    touch_and_free()
    grown = resident() - before - kept
    # tests/heap.rs reads which policy was checked (pytest -s).
    print(f"heap policy checked: {'keep' if heap_kept() else 'release'} ({kept} bytes kept, then {grown} more)")
    if heap_kept():
        # The freed array's pages stay, and the next one is written into them.
        assert kept >= SIZE // 2, kept
        assert grown <= SIZE // 8, grown
    else:
        # glibc's defaults: unmapped when freed, so nothing of it stays.
        assert kept <= SIZE // 8, kept
