"""What a parity check is, and what every check is given.

A check is a unit (`Check`): it computes its records from what it is given
(`Parity`: the checkpoint's runners, the prompt's steps, the reference's
results and what the checks before it found), holds them and its summary,
judges them (their verdicts, `verdicts.judge`) and writes them into the
report. Each is the module `chunkforge_py.parity.<name>`, whose ``CHECK`` is
its `Check` class; Rust names them, in the order they run (crates/model/src/parity_checks.rs
`CHECKS`, the request's `checks`), and says what they are held to
(`req["thresholds"]`). The driver (`run.py`) runs them in that order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint import Checkpoint
from ..contract import ChunkPlan, Dims, LayoutKind, ParityLayout, ParityReport, ParityRequest, Verdict
from ..emulate.stepper import Embeddings, LayoutRunner, PrefillRunner
from ..runtime import ChunkforgeError

if TYPE_CHECKING:
    from .programs import Programs


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two hidden states; -1 (as far apart as it gets) when either
    holds a NaN or Inf, which a broken program can produce and JSON cannot carry."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return -1.0
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def caches_cosine(a: Any, b: Any) -> float:
    """Cosine over every cache slot of every chunk at once."""
    keys = sorted((c, key) for c in a for key in a[c])
    return cosine(torch.cat([a[c][k].reshape(-1) for c, k in keys]), torch.cat([b[c][k].reshape(-1) for c, k in keys]))


def margin(logits: torch.Tensor) -> float:
    """The top-2 logit gap."""
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def chunk_say(say: Callable[[str], None], layout: str) -> Callable[[str, int], None]:
    """`LayoutRunner.steps`' progress as parity phases: ``layout: chunk over n steps``."""
    return lambda chunk, n: say(f"{layout}: {chunk} over {n} decode steps")


class Hooks:
    """Where a test build breaks parity on purpose: the request's
    ``sabotage``, which only a test build sends, is applied by
    python/tests/parity_sabotage.py (a subclass). These do nothing."""

    def layouts(self, runners: dict[str, LayoutRunner]) -> None:
        """The compared layouts' runners, before they run."""

    def prefill(self, modules: dict[str, Any]) -> None:
        """The prefill function's modules, before they run."""

    def verify(self, modules: dict[str, Any]) -> None:
        """verify_qK's modules, before they run."""

    def copies_prefill(self) -> bool:
        """Whether the prefill hand-off copies its KV into the compared layouts."""
        return True


def prefill_function(req: ParityRequest, n: int) -> tuple[ParityLayout, int]:
    """The prefill layout and the token count of the shortest prefill
    function that holds ``n`` tokens."""
    layout = req["prefill_layout"]
    if layout is None:
        raise ChunkforgeError(f"--prefill {n}: the plan has no prefill functions")
    lens = sorted(f["tokens"] for f in layout["chunks"][0]["functions"])
    fits = [t for t in lens if t >= n]
    if not fits:
        raise ChunkforgeError(f"--prefill {n}: the longest prefill function takes {lens[-1]} tokens")
    return layout, fits[0]


class Parity:
    """What every check is given: the request, the checkpoint and the
    runtime's embeddings, the prompt's steps, the reference layout's runner
    and its decode results (and, after a prefill of the first ``prefill``
    tokens, the prefill function's results and a four-chunk runner started
    from its caches), then what a check found that a later one reads: the
    oracle's teacher-forced outputs (``hf``) and ill-conditioned steps
    (``ill``), the artifacts check's packages (``programs``) and read-back
    four-chunk decode (``readback``)."""

    def __init__(self, req: ParityRequest, say: Callable[[str], None], hooks: Hooks) -> None:
        self.req = req
        self.say = say
        self.hooks = hooks
        self.dims: Dims = req["plan"]["dims"]
        self.ckpt = Checkpoint(req["checkpoint"])
        self.emb = Embeddings(self.dims, self.ckpt)
        self.prompt: list[int] = req["prompt_ids"]
        self.steps: int = req["steps"]
        self.tol: float = req["thresholds"]["tol_cos"]
        self.check_inputs()
        self.prefill = req["prefill"] or 0
        if self.prefill >= self.steps:
            raise ChunkforgeError(f"--prefill {self.prefill} leaves no decode steps (--steps {self.steps})")
        self.reference: LayoutKind = req["reference"]
        self.compared: dict[str, ParityLayout] = {
            layout["name"]: layout for layout in req["layouts"] if layout["name"] != self.reference
        }
        self.ref_layout: ParityLayout = next(lay for lay in req["layouts"] if lay["name"] == self.reference)
        self.ref = LayoutRunner(self.dims, self.ref_layout, self.ckpt)
        # Set (non-empty) exactly when ``prefill``.
        self.prefilled: dict[str, Any] = {}
        if self.prefill:
            say(f"prefill of {self.prefill} tokens")
            # The runtime's start of a prompt: one batched prefill call writes every
            # layer's K/V into the four-chunk caches; merged layouts copy those by
            # the slot map before their first decode step.
            layout, tokens = prefill_function(req, self.prefill)
            pf = PrefillRunner(self.dims, layout, self.ckpt, tokens)
            hooks.prefill(pf.modules)
            self.prefilled = self.run_prefill(self.prompt[: self.prefill], pf, self.ref)
        # Teacher forcing: the reference runs all its steps chunk by chunk
        # (`LayoutRunner.steps`); every check compares with these.
        self.ref_results: list[dict[str, Any]] = self.ref.steps(
            self.emb,
            self.prompt[: self.steps],
            0,
            keep_caches_after=self.prefill - 1 if self.prefill else None,
            progress=chunk_say(say, self.reference),
        )
        self.hf: dict[str, Any] | None = None
        self.ill: set[int] = set()
        self.programs: Programs | None = None
        self.readback: tuple[LayoutRunner, list[dict[str, Any]]] | None = None

    def check_inputs(self) -> None:
        if len(self.prompt) < self.steps:
            raise ChunkforgeError(f"the prompt has {len(self.prompt)} tokens but --steps is {self.steps}")
        bad = [t for t in self.prompt[: self.steps] if not 0 <= t < self.dims["vocab_size"]]
        if bad:
            raise ChunkforgeError(
                f"prompt token ids {bad[:5]} are outside the vocabulary (0..{self.dims['vocab_size'] - 1})"
            )
        if self.steps > self.dims["ctx"]:
            raise ChunkforgeError(f"--steps {self.steps} exceeds --ctx {self.dims['ctx']}")

    def run_prefill(self, prompt: list[int], pf: PrefillRunner, ref: LayoutRunner) -> dict[str, Any]:
        """``prompt`` through the prefill function ``pf``, its K/V loaded into
        a fresh four-chunk runner (sharing ``ref``'s modules)."""
        res = pf.run(self.emb, prompt)
        runner = LayoutRunner(self.dims, self.ref_layout, self.ckpt, modules=ref.modules)
        runner.load_prefill_kv(res["kv"], len(prompt))
        chunks: list[ChunkPlan] = pf.chunks
        return {**res, "runner": runner, "function": f"prefill_b{pf.tokens}", "chunks": chunks}

    def verify_k(self) -> int | None:
        """Draft tokens of chunk1..4's verify_qK (None: the plan has none)."""
        return next((f["tokens"] for f in self.ref_layout["chunks"][0]["functions"] if f["kind"] == "verify"), None)


class Check(ABC):
    """One of parity's checks (the module docstring says what a check is).
    A subclass computes in `compute`, judges and writes in `write`, and
    says every verdict it wrote in `verdicts`; one without all three cannot
    be made."""

    def __init__(self, p: Parity) -> None:
        self.p = p

    @abstractmethod
    def compute(self) -> None:
        """Its records, from what it is given (and sets what a later check reads)."""

    @abstractmethod
    def write(self, report: ParityReport) -> None:
        """Its records, judged, into ``report`` (its rows and its members of
        the summary, whether it ran or not): every check has run by then, so
        the oracle's ill-conditioned steps are known."""

    @abstractmethod
    def verdicts(self) -> list[Verdict]:
        """The verdict of every row it wrote."""
