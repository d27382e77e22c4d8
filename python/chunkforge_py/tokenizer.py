"""The fixtures' tokenizer: a small byte-level BPE trained on a fixed English text.

Random-weight checkpoints have no tokenizer of their own, but the tools around a
checkpoint (``transformers.AutoTokenizer``, chat front ends, the app that runs the
packages) expect the files a Hugging Face checkpoint ships. This one is trained by
the ``tokenizers`` library on ``TRAINING_TEXT`` below, has exactly the checkpoint's
vocabulary size, and is deterministic: the same arguments give the same bytes in
every file.

Byte-level (GPT-2 style) rather than Gemma's SentencePiece with byte fallback, so
any text encodes without an unknown token and decodes back to itself. The special
tokens keep Gemma's ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3), and
``encode`` prepends ``<bos>`` as Gemma's tokenizer does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from .runtime import ChunkforgeError

# Gemma's special tokens and their ids; the fixture's config.json takes its
# pad/eos/bos ids from here, so config and tokenizer cannot disagree.
PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_IDS: dict[str, int] = {PAD: 0, EOS: 1, BOS: 2, UNK: 3}

# The byte-level alphabet: every one of the 256 byte values is a token of its own.
BYTE_ALPHABET_SIZE = 256
MIN_VOCAB_SIZE = len(SPECIAL_IDS) + BYTE_ALPHABET_SIZE

# The tokenizer's whole training corpus, written for chunkforge. Changing one
# character changes the merges, so it is part of the fixture generator
# (DEFAULT_FIXTURE_VERSION in src/fixture.rs).
TRAINING_TEXT = """\
The river town wakes before the sun. Bakers light their ovens at four, and by
five the smell of bread drifts down the main street, past the closed shutters of
the bookshop and the hardware store, to the bridge where the first fishermen are
already standing with their lines in the water. Nobody hurries. The ferry leaves
at half past six, and everyone who needs to be on it knows exactly how long the
walk takes.

In the spring the water rises. It comes up slowly, a few centimetres a day, until
the lower meadows turn into a wide grey lake and the herons move in. Children
measure it against the painted marks on the old mill wall: 1954, 1978, 1999,
2013. Each year someone says that this will be the one that reaches the top mark,
and each year, so far, they have been wrong.

A computer is a machine that follows instructions very quickly and very exactly.
It does not understand what it is doing; it only moves numbers from one place to
another, adds them, compares them and decides what to do next. Everything else,
from the letters on this page to the voice that answers a question, is built out
of those small steps, repeated billions of times every second.

Language models read text as a sequence of tokens. A token may be a whole word,
a piece of a word, a single letter or a punctuation mark. Before a model can
learn anything, its tokenizer has to decide where one token ends and the next
begins. Common words such as "the", "and" or "water" usually get a token of
their own, while rare words are split into smaller, more familiar pieces.

She opened the window and listened. Somewhere a dog was barking, a car door
closed, and a radio played a song she almost remembered. "Are you coming?" her
brother called from the garden. "In a minute!" she answered, but she stayed where
she was for a while longer, watching the light change over the hills.

Good instructions are short, clear and tested. Say what you want to happen, what
you expect to see, and what to do when something goes wrong. If a step takes ten
minutes, say so; if it needs 5 GB of free space, say that too. People forgive a
slow process much more easily than a surprising one.
"""


def _filler_pairs(pieces: list[str]) -> Iterator[tuple[str, str]]:
    """Every pair of ``pieces``, in a fixed order that keeps up as ``pieces`` grows.

    Walks the pairs (i, j) by ``max(i, j)``: for n = 0, 1, 2, ... first (0, n), (n, 0),
    then (1, n), (n, 1) and so on up to (n, n). Pieces appended while walking are
    reached in their turn, so the walk never runs dry."""
    n = 0
    while n < len(pieces):
        for k in range(n + 1):
            yield pieces[k], pieces[n]
            if k != n:
                yield pieces[n], pieces[k]
        n += 1


def _fill(vocab: dict[str, int], merges: list[tuple[str, str]], vocab_size: int) -> None:
    """Adds merges (and their tokens) after the trained ones until ``vocab`` holds ``vocab_size`` tokens.

    ``TRAINING_TEXT`` supplies about 640 merges; the
    vocabularies benchmarks ask for (16384, or Gemma's 262144) need far more. The
    extra tokens are real BPE merges of existing tokens (lowest priority, in a fixed
    order), so every id is an ordinary vocabulary entry that decodes to its bytes;
    not every one is a token that encoding some text would produce. A merge's
    right part never starts with "Ġ" (a word's leading space), so no new token
    holds a space between two words."""
    pieces = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if tok not in SPECIAL_IDS]
    for a, b in _filler_pairs(pieces):
        if len(vocab) >= vocab_size:
            return
        if b.startswith("Ġ") or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        pieces.append(a + b)


def build_tokenizer(vocab_size: int, text: str = TRAINING_TEXT) -> Any:
    """The fixture tokenizer (a ``tokenizers.Tokenizer``) with exactly ``vocab_size`` tokens,
    trained on ``text`` (the trained default checkpoint's is trained on its own corpus, `train`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise ChunkforgeError(
            f"--vocab-size {vocab_size}: the fixture's byte-level tokenizer needs at least {MIN_VOCAB_SIZE} "
            f"tokens ({len(SPECIAL_IDS)} special tokens and {BYTE_ALPHABET_SIZE} bytes); choose a larger one"
        )
    by_id = sorted(SPECIAL_IDS, key=SPECIAL_IDS.__getitem__)
    trained = Tokenizer(models.BPE(unk_token=UNK))
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=by_id,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    trained.train_from_iterator([text], trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges: list[tuple[str, str]] = [(a, b) for a, b in model["merges"]]
    if any(vocab.get(tok) != i for tok, i in SPECIAL_IDS.items()):
        raise ChunkforgeError(f"tokenizers {_version()}: the BPE trainer did not give the special tokens ids 0-3")
    _fill(vocab, merges, vocab_size)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in by_id])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Gemma's template: <bos> before each sequence, no <eos>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, SPECIAL_IDS[BOS])]
    )
    if tok.get_vocab_size() != vocab_size:
        raise ChunkforgeError(
            f"tokenizers {_version()}: built a tokenizer of {tok.get_vocab_size()} tokens, expected {vocab_size}"
        )
    return tok


def _version() -> str:
    import tokenizers

    return str(tokenizers.__version__)


def _write_json(path: str, value: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def write_tokenizer(out_dir: str, vocab_size: int, model_max_length: int, text: str = TRAINING_TEXT) -> None:
    """Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    (of `build_tokenizer`) into ``out_dir``."""
    build_tokenizer(vocab_size, text).save(os.path.join(out_dir, "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            # transformers' class that loads tokenizer.json as it is (GemmaTokenizer
            # would rebuild a SentencePiece-style pipeline around the vocabulary).
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
        },
    )
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), special)
