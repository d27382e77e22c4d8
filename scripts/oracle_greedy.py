"""transformers' greedy generation on a checkpoint of any size, within memory.

    $(chunkforge doctor --venv-python) scripts/oracle_greedy.py HF_DIR TEXT N

Prints one JSON line: {"prompt": the ids of TEXT by the checkpoint's own
tokenizer, "generated": the N ids transformers' ``generate(do_sample=False)``
gives, in fp32 with eager attention}. It is transformers' model and code
(`chunkforge_py.parity.oracle.Oracle.generate`); only the weights are brought in per
decoder layer, so an E2B-size checkpoint needs about 3 GB instead of 18.6 GB.
`chunkforge run` on an FP16 release must print the same ids (scripts/realsize.sh).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

# The chunkforge_py package: where the binary finds it ($CHUNKFORGE_PYTHON_DIR),
# else this clone's python/ folder.
sys.path.insert(
    0,
    os.environ.get("CHUNKFORGE_PYTHON_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"),
)

from chunkforge_py.checkpoint import Checkpoint  # noqa: E402
from chunkforge_py.contract import CheckpointInfo  # noqa: E402
from chunkforge_py.parity.oracle import Oracle  # noqa: E402


def checkpoint_info(hf_dir: str) -> CheckpointInfo:
    """The text decoder's tensors by file (`Checkpoint`'s input), from the
    shard index or the single ``model.safetensors``."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
    else:
        from safetensors import safe_open

        single = os.path.join(hf_dir, "model.safetensors")
        with safe_open(single, framework="pt") as f:
            files = dict.fromkeys(f.keys(), single)
    # The prefix rule of Rust's checkpoint reader (crates/model/src/checkpoint.rs).
    prefix = next((p for p in ("model.language_model.", "model.", "") if f"{p}embed_tokens.weight" in files), None)
    if prefix is None:
        raise SystemExit(f"{hf_dir}: no embed_tokens.weight under `model.` or `model.language_model.`")
    return {"prefix": prefix, "files": files}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[2].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    hf_dir, text, n = argv[0], argv[1], int(argv[2])
    warnings.filterwarnings("ignore")
    from transformers import AutoTokenizer, GenerationConfig

    prompt = AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"]
    oracle = Oracle(os.path.join(hf_dir, "config.json"), Checkpoint(checkpoint_info(hf_dir)))
    config = (
        GenerationConfig.from_pretrained(hf_dir)
        if os.path.exists(os.path.join(hf_dir, "generation_config.json"))
        else None
    )
    print(json.dumps({"prompt": prompt, "generated": oracle.generate(prompt, n, config)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
