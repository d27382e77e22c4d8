"""Tensors of a function's contract, found by what they carry.

Every input and output spec of a function has a ``role`` (and, for shared KV,
the producer's ``alias``; for prefill's per-layer K/V rows, the ``layer``). The
torch modules and the runtime emulation hold their tensors in dicts keyed by
those (a :class:`Key`) and go through the specs to line them up with the
function's inputs and outputs, so the runtime's tensor names appear only in the
plan Rust computes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple, TypeVar

from .contract import Alias, Attention, Role, TensorSpec

T = TypeVar("T")


class Key(NamedTuple):
    """What a tensor carries: its role, and the alias or layer that tells
    apart several tensors of one role."""

    role: Role
    alias: Alias | None = None
    layer: int | None = None


def key_of(spec: TensorSpec) -> Key:
    return Key(spec["role"], spec.get("alias"), spec.get("layer"))


def bind(specs: list[TensorSpec], values: Iterable[T]) -> dict[Key, T]:
    """``values`` given in the order of ``specs`` (a call's arguments or
    results), keyed by what each carries."""
    return {key_of(spec): value for spec, value in zip(specs, values, strict=True)}


def in_order(specs: list[TensorSpec], values: Mapping[Key, T]) -> list[T]:
    """The values ``specs`` ask for, in their order (a call's arguments or results)."""
    return [values[key_of(spec)] for spec in specs]


# The caches of each attention kind, K then V: a chunk's own cache slots (the
# same role in and out of a decode call) and verify's new rows for them.
CACHE: dict[Attention, tuple[Role, Role]] = {"sliding": ("k_sliding", "v_sliding"), "full": ("k_full", "v_full")}
NEW_ROWS: dict[Attention, tuple[Role, Role]] = {
    "sliding": ("new_k_sliding", "new_v_sliding"),
    "full": ("new_k_full", "new_v_full"),
}
CACHE_ROLES: tuple[Role, ...] = (*CACHE["sliding"], *CACHE["full"])
NEW_ROW_ROLES: tuple[Role, ...] = (*NEW_ROWS["sliding"], *NEW_ROWS["full"])
# RoPE rows (cos, sin) and the additive mask of each attention kind, decode and verify.
ROPE: dict[Attention, tuple[Role, Role]] = {"sliding": ("cos_sliding", "sin_sliding"), "full": ("cos_full", "sin_full")}
MASK: dict[Attention, Role] = {"sliding": "mask_sliding", "full": "mask_full"}
