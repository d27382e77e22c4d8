"""The two runtime builds' commits of a ``verify_qK`` call (layouts.rs
``VerifyCommit``), on the Rust tests' shared build: main writes the accepted
rows of ``new_K/V_*`` into its caches; the branch copies the ``K/V_*_out``
caches back whole (write-through) and only advances the position.

With every draft accepted the two leave the same caches; with drafts
rejected the branch's window caches keep their rows, and the next decode
step attends to them."""

from __future__ import annotations

from typing import Any

import torch
from chunkforge_py.emulate.stepper import Caches, Embeddings, LayoutRunner
from chunkforge_py.roles import CACHE_ROLES
from test_chunk_major import checkpoint_of
from test_mil_interp import build, layout  # noqa: F401 (the shared build fixture)


def caches(c: Caches) -> list[torch.Tensor]:
    return [c[name][key] for name in sorted(c) for key in sorted(c[name], key=str) if key.role in CACHE_ROLES]


def test_write_through_is_mains_commit_of_every_row_and_keeps_rejected_ones(
    build: dict[str, Any],  # noqa: F811
) -> None:
    dims, lay = build["dims"], layout(build, "four")
    ckpt = checkpoint_of(build)
    emb = Embeddings(dims, ckpt)
    prompt = [(7 * t + 3) % dims["vocab_size"] for t in range(12)]
    k = next(f["tokens"] for f in lay["chunks"][0]["functions"] if f["kind"] == "verify")
    r = LayoutRunner(dims, lay, ckpt)
    r.verify_modules(ckpt)
    r.steps(emb, prompt[:5], 0)
    base = r.snapshot()
    out = r.verify(emb, prompt[5 : 5 + k], 5)

    def after(commit: Any) -> Caches:
        r.caches = {name: dict(c) for name, c in base.items()}
        commit()
        return r.snapshot()

    # Every draft accepted: the branch's caches are main's.
    main_all = after(lambda: r.commit(out["new"], 5, k))
    branch = after(lambda: r.commit_through(out["through"]))
    for a, b in zip(caches(main_all), caches(branch), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

    # One token accepted (the one fed first), the K - 1 drafts rejected:
    # main's caches are plain decode's through that token ...
    main_one = after(lambda: r.commit(out["new"], 5, 1))
    serial = after(lambda: r.steps(emb, prompt[5:6], 5))
    for a, b in zip(caches(main_one), caches(serial), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # ... the branch's window caches end with the drafts' rows, and the
    # next step (position 6) attends to them: its hidden state moves.
    nxt = []
    for c in (main_one, branch):
        r.caches = c
        nxt.append(r.step(emb, prompt[6], 6)["hidden"])
    moved = float((nxt[0] - nxt[1]).abs().max()) / float(nxt[0].abs().max())
    assert moved > 1e-3, moved
