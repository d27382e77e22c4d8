"""`chunkforge run`: the app's runtime emulated on the CPU from a release folder alone.

Everything comes from the folder, as on the phone: the tokenizer from
``hf_model/``, embeddings from the int8 tables (dequantized as
EmbeddingLookup.swift does), RoPE rows from the ``.npy`` tables, and every
chunk is its package's own ML program, executed op by op by the MIL
interpreter (mil_interp.py) with the packaged weights (palettized ones
dequantized; ``fp16``: rounded to fp16 after every op), masks built as the
runtime builds them. Rust has already picked
the layout by file presence, checked every side file's size, header and digest
and that the packages' contracts are the plan of ``hf_model/config.json``.

The prompt is prefilled by prefill_chunk1..4 into four-chunk caches, copied
into the decode layout by the manifest's slot map, then decoded token by
token, or with ``speculate`` K: K tokens per ``verify_qK`` call of chunk1..4
(the last accepted token and K-1 prompt-lookup drafts), committed as the
runtime build does (``verify_commit``): main writes the accepted rows into
its caches; the branch copies the caches ``verify_qK`` returns back whole,
every row written, and only advances the position past the accepted ones,
so the rows of rejected drafts stay in the window caches, where the next
steps attend to them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import weights
from ..contract import ChunkPlan, Dims, FunctionPlan, RunLayout, RunRequest, RunResult, Speculation
from ..mil.chunk import ProgramChunk
from ..mil.inspect import const_key, function_descriptions, io, read_package
from ..mil.interp import Interpreter
from ..model import Chunk
from ..roles import ROPE, Key
from ..runtime import ChunkforgeError, release_memory
from .stepper import Caches, LayoutRunner, PrefillRunner, copy_slots, empty_caches, write_prefill_kv
from .stepper import function_of as find_function


class Package:
    """One package's program, read once; every function's weights on demand."""

    def __init__(self, path: str, program: bool = True):
        """``program=False``: the spec only (the contract), not the MIL program."""
        if not os.path.isdir(path):
            raise ChunkforgeError(f"{path}: package missing from the release")
        self.path = path
        self.spec, self.prog, self.default = read_package(path, program=program)
        if program and self.prog is None:
            raise ChunkforgeError(f"{path}: not an ML program")
        self._dense: dict[str, torch.Tensor] = {}

    def weights(self, function: str) -> dict[str, torch.Tensor]:
        """Every named weight const of ``function``, dense fp32, by torch
        parameter path with dots as underscores. Functions of one package
        share their weights, so each is dequantized once."""
        if function not in self.prog.functions:
            raise ChunkforgeError(
                f"{self.path}: no function {function} (it has {', '.join(sorted(self.prog.functions))})"
            )
        out: dict[str, torch.Tensor] = {}
        for op in self.prog.functions[function].operations:
            if op.op_type == "constexpr_lut_to_dense":
                key = const_key(op.name)
                if key not in self._dense:
                    self._dense[key] = torch.from_numpy(op.materialized_val_inference().astype(np.float32))
                out[key] = self._dense[key]
            elif op.op_type == "const" and op.outputs[0].val is not None and not op.name.startswith("const_"):
                val = op.outputs[0].val
                if isinstance(val, np.ndarray) and val.dtype.kind == "f":
                    key = const_key(op.name)
                    out.setdefault(key, torch.from_numpy(val.astype(np.float32)))
        return out


# A layer's scalar buffer: a checkpoint's layer_scalar of exactly 1.0 (the
# default, and what bf16 rounds a scalar within 0.4 % of 1 to) leaves no const.
SCALAR_DROPPED_AT_ONE = "_layer_scalar"


def module_from_package(dims: Dims, chunk: ChunkPlan, function: FunctionPlan, package: Package) -> Chunk:
    """The torch module of one function with every parameter and buffer read
    from the package; a weight the package lacks is an error naming it."""
    with torch.device("meta"):
        module = Chunk(dims, chunk, function).eval()
    consts = package.weights(function["name"])
    state: dict[str, torch.Tensor] = {}
    wanted = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for name, like in wanted.items():
        key = name.replace(".", "_")
        if key not in consts and key.endswith(SCALAR_DROPPED_AT_ONE):
            # coremltools removes a multiplication by 1.0 (noop_elimination),
            # and its const with it: the package multiplies by 1.
            state[name] = torch.ones(like.shape)
            continue
        if key not in consts:
            raise ChunkforgeError(
                f"{package.path}: function {function['name']} holds no weight {key} "
                "(built from a different plan, or by an older chunkforge?)"
            )
        if consts[key].numel() != like.numel():
            raise ChunkforgeError(
                f"{package.path}: weight {key} has shape {tuple(consts[key].shape)}, "
                f"the plan expects {tuple(like.shape)}"
            )
        # A scalar buffer may be stored with another rank ([1] vs [1, 1]).
        state[name] = consts[key].reshape(like.shape)
    module.load_state_dict(state, strict=True, assign=True)
    return module


def check_contract(package: Package, function: FunctionPlan, context_length: int) -> None:
    """The package's own description of the function against the plan, as
    the runtime reads it (names, shapes, dtypes); ``causal_mask_full`` must
    span ``context_length`` or the runtime refuses to load."""
    described = function_descriptions(package.spec) or [
        {
            "name": package.default,
            "inputs": io(package.spec.description.input),
            "outputs": io(package.spec.description.output),
        }
    ]
    found = next((f for f in described if f["name"] == function["name"]), None)
    if found is None:
        raise ChunkforgeError(f"{package.path}: no function {function['name']}")
    for side in ("inputs", "outputs"):
        got = [(t["name"], list(t["shape"]), t["dtype"]) for t in found[side]]
        want = [(t["name"], list(t["shape"]), t["dtype"]) for t in function[side]]
        if got != want:
            pairs = zip(got, want, strict=False)
            diff = next((f"{g} != {w}" for g, w in pairs if g != w), f"{len(got)} vs {len(want)} tensors")
            raise ChunkforgeError(
                f"{package.path}: {function['name']} {side} differ from the plan of hf_model/config.json: {diff}"
            )
        for name, shape, _ in got:
            if name == "causal_mask_full" and shape[-1] != context_length:
                raise ChunkforgeError(
                    f"{package.path}: causal_mask_full spans {shape[-1]} positions but model_config.json's "
                    f"context_length is {context_length} (the runtime refuses to load this folder)"
                )


class QuantizedTable:
    """An int8 [rows, cols] table with one fp16 scale per row."""

    def __init__(self, q8: str, scales: str, rows: int, cols: int, scale: float):
        self.q8 = np.memmap(q8, dtype=np.int8, mode="r", shape=(rows, cols))
        self.scales = np.memmap(scales, dtype="<f2", mode="r", shape=(rows,))
        self.scale = np.float32(scale)

    def row(self, token: int) -> np.ndarray:
        """``int8 * (scale_fp16 / 127 * embed_scale)`` in fp32, rounded to fp16."""
        row_scale = np.float32(self.scales[token]) / np.float32(127.0) * self.scale
        return (self.q8[token].astype(np.float32) * row_scale).astype(np.float16)


class ReleaseEmbeddings:
    """The runtime's CPU lookups, from the release's int8 tables."""

    def __init__(self, req: RunRequest):
        d, f = req["dims"], req["files"]
        per_layer = d["num_hidden_layers"] * d["hidden_size_per_layer_input"]
        self.embed = QuantizedTable(
            f["embed_tokens_q8"], f["embed_tokens_scales"], d["vocab_size"], d["hidden_size"], d["embed_scale"]
        )
        self.per_layer = QuantizedTable(
            f["embed_tokens_per_layer_q8"],
            f["embed_tokens_per_layer_scales"],
            d["vocab_size_per_layer_input"],
            per_layer,
            d["per_layer_embed_scale"],
        )

    def rows(self, tokens: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = np.stack([self.embed.row(t) for t in tokens])
        per_layer = np.stack([self.per_layer.row(t) for t in tokens])
        return (
            torch.from_numpy(hidden).view(1, len(tokens), -1).to(dtype),
            torch.from_numpy(per_layer).view(1, len(tokens), -1).to(dtype),
        )


class RopeTables:
    """cos/sin rows read from the release's ``.npy`` tables."""

    def __init__(self, req: RunRequest):
        f = req["files"]
        paths = {"sliding": (f["cos_sliding"], f["sin_sliding"]), "full": (f["cos_full"], f["sin_full"])}
        self.tables = {kind: (np.load(c, mmap_mode="r"), np.load(s, mmap_mode="r")) for kind, (c, s) in paths.items()}
        self.paths = {kind: c for kind, (c, _) in paths.items()}

    def __call__(self, pos: int, dtype: torch.dtype, tokens: int) -> dict[Key, torch.Tensor]:
        rows: dict[Key, torch.Tensor] = {}
        for kind, (cos_role, sin_role) in ROPE.items():
            cos, sin = self.tables[kind]
            if pos + tokens > cos.shape[0]:
                raise ChunkforgeError(
                    f"{self.paths[kind]}: {cos.shape[0]} positions, position {pos + tokens - 1} needs more"
                )
            for role, table in ((cos_role, cos), (sin_role, sin)):
                rows[Key(role)] = torch.from_numpy(np.array(table[pos : pos + tokens])).view(1, 1, tokens, -1).to(dtype)
        return rows


def top_margin(logits: torch.Tensor) -> float:
    """How far the chosen token's logit is ahead of the runner-up's (softcapped
    logits): near 0, fp16 weights or int8 embeddings may pick the other one."""
    top = torch.topk(logits.float().view(-1), 2).values
    return float(top[0] - top[1])


def prompt_lookup(history: list[int], k: int, ngram: int = 3) -> list[int]:
    """``k`` draft tokens: what followed the latest earlier occurrence of the
    history's last n-gram (n = ngram..1), else repeats of the last token."""
    for n in range(min(ngram, len(history) - 1), 0, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == tail:
                follow = history[start + n : start + n + k]
                if follow:
                    return (follow + [follow[-1]] * k)[:k]
    return [history[-1]] * k


def run(req: RunRequest, progress: Callable[[str], None] | None = None) -> RunResult:
    """Generate from the release folder; ``progress(what)`` is told each phase
    as it starts (the prefill call, each decode step), for the command's
    spinner or log lines: at E4B size a token takes half a minute here."""
    tell = progress or (lambda _what: None)
    torch.set_grad_enabled(False)
    dims = req["dims"]
    ctx = dims["ctx"]
    started = time.perf_counter()
    if req["prompt_ids"] is not None:
        prompt = list(req["prompt_ids"] or [])
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(req["files"]["tokenizer"])
        prompt = tokenizer.encode(req["prompt"] or "").ids
    if not prompt:
        raise ChunkforgeError("the prompt has no tokens")
    bad = [t for t in prompt if not 0 <= t < dims["vocab_size"]]
    if bad:
        raise ChunkforgeError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{dims['vocab_size'] - 1})")
    if len(prompt) >= ctx:
        raise ChunkforgeError(f"the prompt has {len(prompt)} tokens; the context holds {ctx}")

    emb = ReleaseEmbeddings(req)
    rope = RopeTables(req)
    fp16 = req["fp16"]
    programs: dict[str, Interpreter] = {}

    def program(name: str) -> Interpreter:
        if name not in programs:
            files = req["packages"].get(name)
            if files is None or not os.path.isdir(files["path"]):
                where = files["path"] if files else os.path.join(req["release"], name)
                raise ChunkforgeError(f"{where}: package missing from the release")
            programs[name] = Interpreter(files["path"], files["weights"])
        return programs[name]

    def modules(layout: RunLayout, kind: str, tokens: int | None = None) -> dict[str, Any]:
        """Each chunk's function as the package's own program, run by the MIL
        interpreter with the packaged weights (fp16: rounded after every op)."""
        out: dict[str, Any] = {}
        for c in layout["chunks"]:
            f = find_function(c, kind, tokens)  # type: ignore[arg-type]
            interp = program(c["name"])
            check_contract(Package(interp.path, program=False), f, ctx)
            out[c["name"]] = ProgramChunk(interp, f, fp16)
        return out

    decode_layout = req["decode"]
    # The reference layout: prefill writes its caches, its packages verify.
    reference = req["reference"]
    speculate = req["speculate"] or 0
    verify = modules(reference, "verify") if speculate else None
    if speculate and decode_layout["kind"] != reference["kind"]:
        raise ChunkforgeError(f"speculative decoding verifies with the {reference['kind']} layout: run that layout")
    decode_modules = modules(decode_layout, "decode")
    runner = LayoutRunner(dims, decode_layout, None, modules=decode_modules, rope=rope, verify=verify)
    # The runtime reads N from prefill_chunk1's default function (the first,
    # the longest) and always calls that one.
    n_call = find_function(req["prefill"]["chunks"][0], "prefill")["tokens"]
    n_prefill = min(len(prompt), n_call)
    prefill_modules = modules(req["prefill"], "prefill", n_call)
    prefill = PrefillRunner(dims, req["prefill"], None, n_call, modules=prefill_modules, rope=rope)
    loaded = time.perf_counter()

    # Prefill into the reference's caches, then the decode layout's by the slot map.
    t0 = time.perf_counter()
    prefill_names = ", ".join(c["name"] for c in req["prefill"]["chunks"])
    tell(f"prefill: {n_prefill} of the prompt's {len(prompt)} tokens, one prefill_b{n_call} call ({prefill_names})")
    pre = prefill.run(emb, prompt[:n_prefill])
    margin = top_margin(prefill.modules[req["prefill"]["chunks"][-1]["name"]].last_logits)
    # The runtime calls prefill once per prompt: let go of its programs, and
    # of its weights in the resident budget, which the decode layout's need
    # (at E4B size each holds about 2 GB of INT4 weights; those both read,
    # from one blob, are read again once).
    del prefill, prefill_modules
    for c in req["prefill"]["chunks"]:
        programs.pop(c["name"], None)
    weights.RESIDENT.release(lambda key: False)
    release_memory()
    caches: Caches = empty_caches(reference["chunks"], torch.float32)
    write_prefill_kv(caches, reference["chunks"], pre["kv"], n_prefill, dims["sliding_window"])
    del pre["kv"]
    if decode_layout["kind"] == reference["kind"]:
        runner.caches = caches
    else:
        copy_slots(caches, runner.caches, decode_layout["kv_slot_map"])
        del caches
    token = pre["token"]
    # Prompt tokens past the prefill length go through decode, one by one.
    for pos in range(n_prefill, len(prompt)):
        tell(f"prompt token {pos + 1} of {len(prompt)} through decode")
        step = runner.step(emb, prompt[pos], pos)
        token, margin = step["token"], top_margin(step["logits"])
    prefill_seconds = time.perf_counter() - t0

    eos = set(req["eos_token_ids"])
    generated = [token]
    margins = [margin]
    stopped = "eos" if token in eos else ""
    pos = len(prompt)
    commit = req["verify_commit"]
    spec: Speculation = {
        "k": speculate,
        "calls": 0,
        "accepted_drafts": 0,
        "drafts": 0,
        "commit": commit,
        "stale_rows": 0,
    }
    t1 = time.perf_counter()
    while not stopped:
        if len(generated) >= req["max_tokens"]:
            stopped = "max_tokens"
            break
        if pos >= ctx:
            stopped = "context"
            break
        tell(f"decode: token {len(generated) + 1} of at most {req['max_tokens']} (position {pos})")
        if speculate and pos + speculate <= ctx:
            drafts = prompt_lookup(prompt + generated, speculate - 1)
            tokens = [generated[-1], *drafts]
            out = runner.verify(emb, tokens, pos)
            accepted = 1
            while accepted < speculate and tokens[accepted] == out["tokens"][accepted - 1]:
                accepted += 1
            if commit == "write-through":
                runner.commit_through(out["through"])
                spec["stale_rows"] += speculate - accepted
            else:
                runner.commit(out["new"], pos, accepted)
            spec["calls"] += 1
            spec["drafts"] += speculate - 1
            spec["accepted_drafts"] += accepted - 1
            new = out["tokens"][:accepted]
            new_margins = [top_margin(out["logits"][i]) for i in range(accepted)]
            pos += accepted
        else:
            step = runner.step(emb, generated[-1], pos)
            new, new_margins = [step["token"]], [top_margin(step["logits"])]
            pos += 1
        for t, m in zip(new, new_margins, strict=True):
            generated.append(t)
            margins.append(m)
            if t in eos:
                stopped = "eos"
                break
            if len(generated) >= req["max_tokens"]:
                break
    decode_seconds = time.perf_counter() - t1
    generated = generated[: req["max_tokens"]]
    margins = margins[: len(generated)]
    text = None
    if os.path.exists(req["files"]["tokenizer"]):
        from tokenizers import Tokenizer

        text = Tokenizer.from_file(req["files"]["tokenizer"]).decode(generated, skip_special_tokens=True)
    decoded = max(len(generated) - 1, 0)
    return {
        "layout": decode_layout["kind"],
        "chunks": [c["name"] for c in decode_layout["chunks"]],
        "prompt_ids": prompt,
        "generated_ids": generated,
        "margins": margins,
        "text": text,
        "stopped": stopped,
        "prefill_tokens": n_prefill,
        "prefill_function": f"prefill_b{n_call}",
        "load_seconds": loaded - started,
        "prefill_seconds": prefill_seconds,
        "decode_seconds": decode_seconds,
        "decode_tokens_per_second": decoded / decode_seconds if decode_seconds > 0 and decoded else 0.0,
        "speculation": spec if speculate else None,
    }
