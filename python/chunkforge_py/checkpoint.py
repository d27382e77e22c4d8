"""Lazy tensor access to a Hugging Face checkpoint that Rust has already validated.

Rust parses every safetensors header, checks names, shapes and offsets against
the plan, and hands over a map from tensor name to file. Tensors are read one at
a time on demand, so a 5 GB checkpoint is never held twice in memory.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from .contract import CheckpointInfo
from .runtime import ChunkforgeError
from .weights import RESIDENT, Stored, read_at

# safetensors dtype names -> torch dtypes (the float ones Rust admits for the decoder).
STORED = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

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
        # path -> (descriptor, the header's entries, where the data starts)
        self._files: dict[str, tuple[int, dict[str, Any], int]] = {}
        # Tensors read whole and found finite (checked once each).
        self._finite: set[str] = set()

    def _check_finite(self, name: str, tensor: torch.Tensor, whole: bool = True) -> None:
        """Refuses a NaN or infinity in tensor ``name`` as read (naming the
        tensor and its file), before anything computes with it: parity's
        reference and transformers would carry it into every number they
        report. A tensor read whole is checked once."""
        if name in self._finite or not tensor.is_floating_point():
            return
        # One reduction, no mask: a NaN makes both ends NaN, an infinity one end.
        lo, hi = torch.aminmax(tensor.detach())
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            full = self.prefix + name
            bad = int((~torch.isfinite(tensor)).sum())
            raise ChunkforgeError(f"{self.files.get(full, '?')}: weight {full} has {bad} NaN/Inf values")
        if whole:
            self._finite.add(name)

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
        self._check_finite(name, tensor)
        if dtype is not None and rounded_to is not None:
            tensor = rounded(tensor, dtype, rounded_to)
        elif dtype is not None:
            tensor = tensor.to(dtype)
        if share:
            self._cache[key] = tensor
        return tensor

    def _file(self, path: str) -> tuple[int, dict[str, Any], int]:
        """The open file and its safetensors header (validated by Rust)."""
        if path not in self._files:
            fd = os.open(path, os.O_RDONLY)
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            self._files[path] = (fd, json.loads(os.pread(fd, n, 8)), 8 + n)
        return self._files[path]

    def _entry(self, name: str) -> tuple[int, dict[str, Any], int, str]:
        """The open file of tensor ``name``, its header entry, where its
        bytes start in the file, and its path and name for errors."""
        full = self.prefix + name
        path = self.files.get(full)
        if path is None:
            raise KeyError(f"tensor {full} is not in the checkpoint")
        fd, header, start = self._file(path)
        entry = header[full]
        return fd, entry, start + entry["data_offsets"][0], f"{path}: {full}"

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in ``dtype``. Converted (a bf16 checkpoint's weights in
        fp32) it is read with positioned reads into memory of its own: the
        file is not mapped, so reading every weight of a large checkpoint
        leaves none of it in this process (pages a mapping touches stay
        resident while the file is open). Stored in ``dtype`` already, it is
        the file's mapped bytes, as `get` gives them: there is no copy to
        make, and kernels see the very tensor they saw before streaming (their
        results depend on its alignment in the last bit)."""
        fd, entry, start, what = self._entry(name)
        stored = STORED[entry["dtype"]]
        if stored == dtype:
            return self.get(name, None)
        out = self._read_converted(fd, entry, start, what, stored, dtype)
        self._check_finite(name, out)
        return out

    def _read_converted(
        self, fd: int, entry: dict[str, Any], start: int, what: str, stored: torch.dtype, dtype: torch.dtype
    ) -> torch.Tensor:
        """The tensor at ``start`` of ``fd``, stored as ``stored``, in ``dtype``."""
        # Converted a block at a time through one buffer: the memory written
        # anew is the result's alone (an E2B head is 0.8 GB in bf16).
        out = torch.empty(entry["shape"], dtype=dtype)
        flat = out.view(-1)
        size = torch.empty(0, dtype=stored).element_size()
        block = max(1, min(ROUND_BLOCK, flat.numel()))
        buffer = torch.empty(block, dtype=stored)
        for at in range(0, flat.numel(), block):
            part = buffer[: min(block, flat.numel() - at)]
            read_at(fd, start + at * size, part, what)
            flat[at : at + part.numel()].copy_(part)
        return out

    def fetcher(self, name: str, dtype: torch.dtype, stored: bool = False) -> Fetcher:
        """A function that gives the tensor in ``dtype`` each time it is
        called, kept between calls as the resident budget allows
        (weights.RESIDENT); never modify what it returns. With ``stored``
        (a float32 projection's weight for the native kernels), it gives
        the weight as the file stores it instead (`stored`)."""
        return Fetcher(self, name, dtype, stored)

    def stored_kind(self, name: str) -> str:
        """How the file stores a tensor: "bf16", "fp16" or "fp32" (`stored`)."""
        _, entry, _, _ = self._entry(name)
        return {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}[entry["dtype"]]

    def stored(self, name: str) -> Stored:
        """A 2-D weight as the file stores it (`weights.Stored`): bf16 or
        fp16 bits read with positioned reads into memory of its own, or a
        float32 file's mapped values (no copy to make, as `read`)."""
        fd, entry, start, what = self._entry(name)
        kind = self.stored_kind(name)
        shape = tuple(int(d) for d in entry["shape"])
        if kind == "fp32":
            return Stored(kind, self.get(name, None).numpy(), shape, what)
        bits = torch.empty(shape, dtype=torch.int16)
        read_at(fd, start, bits, what)
        return Stored(kind, bits.numpy().view(np.uint16), shape, what)

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows start..stop-1 (along the first axis) of the tensor in
        ``dtype``, read as `read` reads the whole: the bytes of those rows alone."""
        fd, entry, begin, what = self._entry(name)
        stored = STORED[entry["dtype"]]
        shape = list(entry["shape"])
        stop = min(stop, shape[0])
        row = 1
        for d in shape[1:]:
            row *= d
        size = torch.empty(0, dtype=stored).element_size()
        part = torch.empty([stop - start, *shape[1:]], dtype=stored)
        read_at(fd, begin + start * row * size, part, what)
        self._check_finite(name, part, whole=False)
        return part if stored == dtype else part.to(dtype)

    def close(self) -> None:
        self._handles.clear()
        self._cache.clear()
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()


class Fetcher:
    """A checkpoint tensor in one dtype, made on use (`Checkpoint.fetcher`):
    called, the whole tensor (or, ``stored``, the weight as the file stores
    it: `weights.Stored`) through the resident budget; `rows`, a block of
    its rows in ``dtype`` (from what the budget holds, else read alone)."""

    __slots__ = ("ckpt", "dtype", "key", "name", "stored")

    def __init__(self, ckpt: Checkpoint, name: str, dtype: torch.dtype, stored: bool = False):
        self.ckpt = ckpt
        self.name = name
        self.dtype = dtype
        self.stored = stored
        full = ckpt.prefix + name
        self.key = ("checkpoint", ckpt.files.get(full), full, "stored" if stored else dtype)

    def __call__(self) -> Any:
        if self.stored:
            return RESIDENT.get(self.key, lambda: self.ckpt.stored(self.name))
        return RESIDENT.get(self.key, lambda: self.ckpt.read(self.name, self.dtype))

    def read_stored(self) -> Stored:
        """The stored weight for one use, not kept (the budget's copy if it holds one)."""
        held = RESIDENT.held(self.key) if self.stored else None
        return held if isinstance(held, Stored) else self.ckpt.stored(self.name)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        held = RESIDENT.held(self.key)
        if isinstance(held, Stored):
            return held.rows_f32(start, stop).reshape(-1, *held.shape[1:]).to(self.dtype)
        if held is not None:
            return held[start:stop]
        return self.ckpt.read_rows(self.name, start, stop, self.dtype)
