"""The Rust kernels the chunkforge binary registers as ``chunkforge_native``
(src/py/native.rs) before its interpreter starts: importable only inside the
binary, so this stub is what type checkers see."""

import numpy as np
from numpy.typing import NDArray

def palettize_int4(
    weight: NDArray[np.float16], group_size: int = 32, nbits: int = 4, name: str | None = None
) -> tuple[NDArray[np.float16], NDArray[np.uint8]]:
    """``(lut [rows // group_size, 2**nbits] float16, indices [rows, cols] uint8)``
    of a C-contiguous float16 ``weight [rows, cols]``; ValueError on bad input."""

def indices_int4(
    weight: NDArray[np.float16],
    lut: NDArray[np.float16],
    group_size: int = 32,
    nbits: int = 4,
    name: str | None = None,
) -> NDArray[np.uint8]:
    """The ``indices`` `palettize_int4` returns for ``weight`` when it returned ``lut``."""
