"""Lazy tensor access to a Hugging Face checkpoint that Rust has already validated.

Rust parses every safetensors header, checks names, shapes and offsets against
the plan, and hands over a map from tensor name to file. Tensors are read one at
a time on demand, so a 5 GB checkpoint is never held twice in memory.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors import safe_open

from .contract import CheckpointInfo

# Values converted per block by `rounded`: small enough that the block's
# intermediate copy costs nothing, large enough for torch's threads.
ROUND_BLOCK = 1 << 22

# `rounded`'s intermediate block, by dtype: one buffer reused for every block
# of every tensor, so its pages are faulted in once per process, not once per
# block (a fresh 8 MB temporary per block is mapped and unmapped each time).
_round_buffers: dict[torch.dtype, torch.Tensor] = {}


def rounded(tensor: torch.Tensor, dtype: torch.dtype, via: torch.dtype) -> torch.Tensor:
    """``tensor.to(via).to(dtype)`` into one new tensor, a block of
    `ROUND_BLOCK` values at a time through one reused buffer: the memory
    written anew is the result's alone (at full width, a chunk's weights are
    gigabytes, and on a virtual machine every page written anew costs
    time)."""
    out = torch.empty(tensor.shape, dtype=dtype)
    src, dst = tensor.reshape(-1), out.view(-1)
    n = src.numel()
    block = max(min(ROUND_BLOCK, n), 1)
    buffer = _round_buffers.get(via)
    if buffer is None or buffer.numel() < block:
        buffer = _round_buffers[via] = torch.empty(block, dtype=via)
    for start in range(0, n, block):
        end = min(start + block, n)
        part = buffer[: end - start]
        part.copy_(src[start:end])
        dst[start:end].copy_(part)
    return out


class Checkpoint:
    """Reads text-decoder tensors by their unprefixed name (``layers.3.mlp.up_proj.weight``)."""

    def __init__(self, info: CheckpointInfo):
        self.prefix: str = info["prefix"]
        self.files: dict[str, str] = info["files"]
        self._handles: dict[str, Any] = {}
        # (name, dtype, rounded_to) -> tensor
        self._cache: dict[tuple[str, torch.dtype | None, torch.dtype | None], torch.Tensor] = {}

    def _handle(self, path: str) -> Any:
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path]

    def get(
        self, name: str, dtype: torch.dtype | None, share: bool = False, rounded_to: torch.dtype | None = None
    ) -> torch.Tensor:
        """The tensor, converted to ``dtype`` (None keeps the stored dtype);
        with ``rounded_to``, its values rounded to that dtype first and then
        held as ``dtype`` (fp16 values in fp32: what ``.to(fp16).float()``
        gives, without a whole fp16 copy in between).

        The result may share memory with the file mapping: never modify it in
        place. With ``share``, conversions are cached so several modules built
        from this checkpoint (parity's layouts, the oracle) hold one copy.
        """
        key = (name, dtype, rounded_to)
        if share and key in self._cache:
            return self._cache[key]
        full = self.prefix + name
        path = self.files.get(full)
        if path is None:
            raise KeyError(f"tensor {full} is not in the checkpoint")
        tensor = self._handle(path).get_tensor(full)
        if dtype is not None and rounded_to is not None:
            tensor = rounded(tensor, dtype, rounded_to)
        elif dtype is not None:
            tensor = tensor.to(dtype)
        if share:
            self._cache[key] = tensor
        return tensor

    def close(self) -> None:
        self._handles.clear()
        self._cache.clear()
