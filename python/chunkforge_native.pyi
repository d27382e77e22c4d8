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

# A stored weight as the product kernels take it (src/matmul): (kind, data,
# lut, group_rows); kind "lut4" (data uint8, two 4-bit indices a byte, the
# low nibble first; lut float32 [groups, 16]), "bf16" / "fp16" (data uint16
# bits), "fp32" (data float32).
WeightSpec = tuple[str, NDArray[np.uint8] | NDArray[np.uint16] | NDArray[np.float32], NDArray[np.float32] | None, int]

def matmul(
    x: NDArray[np.float32],
    weight: WeightSpec,
    rows: int,
    cols: int,
    live: int | None = None,
    channels_first: bool = False,
    name: str | None = None,
    isa: str | None = None,
) -> NDArray[np.float32]:
    """``x [tokens, cols] · Wᵀ`` as float32 ``[tokens, rows]`` (``[rows, tokens]``
    with ``channels_first``), only the first ``live`` tokens computed (the
    others 0); ValueError on bad input."""

def dense_rows(
    weight: WeightSpec, rows: int, cols: int, start: int, stop: int, name: str | None = None
) -> NDArray[np.float32]:
    """Rows ``start..stop`` of the weight as float32."""

def dense_rows_into(
    weight: WeightSpec, rows: int, cols: int, start: int, out: NDArray[np.float32], name: str | None = None
) -> None:
    """Rows ``start..start + len(out)`` of the weight into ``out`` (float32 [n, cols], C-contiguous)."""

def squared_error(a: WeightSpec, b: WeightSpec, rows: int, cols: int, name: str | None = None) -> tuple[float, float]:
    """``(sum((a - b)**2), sum(b**2))`` in float64."""

def matmul_isas() -> tuple[str, list[str]]:
    """The build the kernels run here and every build this CPU runs."""
