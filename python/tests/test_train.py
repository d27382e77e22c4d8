"""How the built-in checkpoint was trained (chunkforge_py.train): the
synthetic task's words, the prose taken from the docs, and the shipped
checkpoint's tokenizer made again from its corpus."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from chunkforge_py.train import CORPUS_COMMIT, LARGEST, MANIFEST, VOCAB_SIZE, corpus, counting, number_words, prose

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "checkpoints" / "default"


def test_number_words() -> None:
    assert [number_words(n) for n in (0, 7, 13, 20, 21, 99, 100, 101, 342, 999)] == [
        "zero",
        "seven",
        "thirteen",
        "twenty",
        "twenty-one",
        "ninety-nine",
        "one hundred",
        "one hundred one",
        "three hundred forty-two",
        "nine hundred ninety-nine",
    ]
    assert len({number_words(n) for n in range(LARGEST + 1)}) == LARGEST + 1
    with pytest.raises(ValueError):
        number_words(1000)


def test_counting_runs_to_the_largest_number_and_stops() -> None:
    assert counting(98, 3) == "ninety-eight, ninety-nine, one hundred,"
    assert counting(998, 5) == "nine hundred ninety-eight, nine hundred ninety-nine,"


def test_prose_drops_code_tables_and_markup() -> None:
    md = """# Title

Some `code` and a [link](https://x.invalid) in
a wrapped **line**.

```bash
chunkforge run
```

| a | b |
|---|---|
- an item
  that wraps
1. a step
"""
    assert prose(md) == ["Title", "Some code and a link in a wrapped line.", "an item that wraps", "a step"]


def have_commit() -> bool:
    done = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{CORPUS_COMMIT}^{{commit}}"], check=False)
    return done.returncode == 0


@pytest.mark.skipif(not have_commit(), reason=f"the clone lacks commit {CORPUS_COMMIT} (shallow?)")
def test_the_shipped_tokenizer_is_made_again_from_the_corpus(tmp_path: Path) -> None:
    from chunkforge_py.tokenizer import write_tokenizer

    paragraphs = corpus(str(ROOT))
    text = "\n\n".join(paragraphs) + "\n\n" + counting(1, LARGEST)
    write_tokenizer(str(tmp_path), vocab_size=VOCAB_SIZE, model_max_length=4096, text=text)
    manifest = json.loads((SHIPPED / MANIFEST).read_text())
    got = hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
    assert got == manifest["files"]["tokenizer.json"]
    assert manifest["training"]["corpus_paragraphs"] == len(paragraphs)
