"""Checks, for every one of the 2^32 fp32 bit patterns, that torch's fp32 → fp16
conversion gives the bits numpy's `astype` gives, NaNs apart (both give a NaN,
with possibly different payloads). `passes.fast_fp16_cast_value` relies on it.

Run with the pinned environment: ``~/.cache/chunkforge/venv/bin/python
scripts/check_fp16_cast.py`` (about nine minutes here)."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

CHUNK = 1 << 24


def main() -> int:
    started = time.perf_counter()
    mismatches = 0
    for start in range(0, 1 << 32, CHUNK):
        bits = np.arange(start, start + CHUNK, dtype=np.uint64).astype(np.uint32)
        values = bits.view(np.float32)
        with np.errstate(over="ignore"):
            by_numpy = values.astype(np.float16)
        by_torch = torch.from_numpy(values).to(torch.float16).numpy()
        nan = np.isnan(values)
        if not np.array_equal(np.isnan(by_torch), nan):
            print(f"NaN mismatch in [{start:#x}, {start + CHUNK:#x})")
            return 1
        differ = (by_numpy.view(np.uint16) != by_torch.view(np.uint16)) & ~nan
        if differ.any():
            first = int(np.flatnonzero(differ)[0])
            print(
                f"fp32 bits {int(bits[first]):#010x}: numpy {int(by_numpy.view(np.uint16)[first]):#06x}, "
                f"torch {int(by_torch.view(np.uint16)[first]):#06x}"
            )
            mismatches += int(differ.sum())
    elapsed = time.perf_counter() - started
    if mismatches:
        print(f"{mismatches} fp32 values convert differently ({elapsed:.0f} s)")
        return 1
    print(f"all 2^32 fp32 bit patterns: torch and numpy give the same fp16 bits, NaNs apart ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
