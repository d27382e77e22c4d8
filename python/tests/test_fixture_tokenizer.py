"""The fixtures' tokenizer (chunkforge_py.tokenizer): deterministic, exactly the
checkpoint's vocabulary, Gemma's special ids, and loadable by transformers."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from chunkforge_py.fixture import write_fixture
from chunkforge_py.runtime import ChunkforgeError
from chunkforge_py.tokenizer import MIN_VOCAB_SIZE, SPECIAL_IDS, build_tokenizer, write_tokenizer

PYTHON_DIR = Path(__file__).resolve().parents[1]
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "  Ünïcödé, 日本語 and 🦊:\ttabs,\n\nnewlines and 1234567890 digits  ",
]

# sha256 of the default checkpoint's tokenizer.json (vocabulary 512). If this
# changes on purpose (new training text, another tokenizers version), bump
# DEFAULT_FIXTURE_VERSION in src/fixture.rs so cached default checkpoints are
# made again, and update this digest.
DEFAULT_TOKENIZER_SHA256 = "ddd246e3002083de"


def digests(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


@pytest.mark.parametrize("vocab_size", [512, 20_000])
def test_same_arguments_give_the_same_bytes_in_another_process(tmp_path: Path, vocab_size: int) -> None:
    # 512 is all trained merges; 20000 needs filler merges on top of them. The
    # second copy comes from a fresh interpreter with a different hash seed, so
    # any dict or set iteration order leaking into the files shows up.
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_tokenizer(str(a), vocab_size=vocab_size, model_max_length=4096)
    code = (
        "import sys; from chunkforge_py.tokenizer import write_tokenizer; "
        "write_tokenizer(sys.argv[1], int(sys.argv[2]), 4096)"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(b), str(vocab_size)],
        check=True,
        cwd=PYTHON_DIR,
        env={"PYTHONHASHSEED": "12345", "PYTHONPATH": str(PYTHON_DIR)},
    )
    assert digests(a) == digests(b)


def test_default_tokenizer_bytes_are_pinned(tmp_path: Path) -> None:
    write_tokenizer(str(tmp_path), vocab_size=512, model_max_length=4096)
    got = hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()[:16]
    assert got == DEFAULT_TOKENIZER_SHA256, "the default fixture's tokenizer changed: bump DEFAULT_FIXTURE_VERSION"


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 500, 512, 4096, 16_384])
def test_vocabulary_is_exactly_the_requested_size_and_every_id_is_a_token(vocab_size: int) -> None:
    tok = build_tokenizer(vocab_size)
    assert tok.get_vocab_size() == vocab_size
    vocab = tok.get_vocab()
    assert sorted(vocab.values()) == list(range(vocab_size))
    for i in range(vocab_size):
        piece = tok.id_to_token(i)
        assert piece is not None and tok.token_to_id(piece) == i
    assert {t: vocab[t] for t in SPECIAL_IDS} == SPECIAL_IDS
    # Byte-level: every byte is a token, so any text encodes without <unk>.
    from tokenizers.pre_tokenizers import ByteLevel

    assert set(ByteLevel.alphabet()) <= set(vocab)
    for s in SENTENCES:
        enc = tok.encode(s)
        assert enc.ids[0] == SPECIAL_IDS["<bos>"]
        assert SPECIAL_IDS["<unk>"] not in enc.ids
        assert tok.decode(enc.ids) == s


def test_a_vocabulary_smaller_than_the_byte_alphabet_is_refused() -> None:
    with pytest.raises(ChunkforgeError, match=f"needs at least {MIN_VOCAB_SIZE} tokens"):
        build_tokenizer(MIN_VOCAB_SIZE - 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A non-default vocabulary, so the tokenizer is seen to follow config.json.
    out = tmp_path_factory.mktemp("fixture")
    write_fixture(str(out), vocab_size=1000)
    return out


def test_fixture_config_generation_config_and_tokenizer_agree(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    generation = json.loads((checkpoint / "generation_config.json").read_text())
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"] if t["special"]}
    assert added == SPECIAL_IDS
    for name in ("bos", "eos", "pad"):
        assert config[f"{name}_token_id"] == generation[f"{name}_token_id"] == SPECIAL_IDS[f"<{name}>"]
    assert len(tok["model"]["vocab"]) == config["vocab_size"] == 1000


def test_auto_tokenizer_loads_the_fixture_and_matches_tokenizers(checkpoint: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(checkpoint))
    raw = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    config = json.loads((checkpoint / "config.json").read_text())
    assert len(hf) == config["vocab_size"]
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (
        config["bos_token_id"],
        config["eos_token_id"],
        config["pad_token_id"],
    )
    for s in SENTENCES:
        ids = hf(s)["input_ids"]
        assert ids == raw.encode(s).ids
        assert ids[0] == config["bos_token_id"] and ids[1] != config["bos_token_id"]
        assert hf.decode(ids, skip_special_tokens=True) == s == raw.decode(ids)
        assert hf.decode(ids) == "<bos>" + s
