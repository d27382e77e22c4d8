"""macOS only: load every function of every compiled model (`.mlmodelc`) in a
model folder with Core ML and compare its predictions with chunkforge's MIL
interpreter on the same inputs, within fp16 tolerance.

    python scripts/coreml_predict_check.py MODEL_DIR [MODEL_DIR ...]

MODEL_DIR is a folder the app's download leaves (`chunkforge client-check
RELEASE --client main --multimodal off --materialize MODEL_DIR`), so a
package whose blob the app shares in has it. Prints one line per function
(loaded, largest difference) and exits 1 when a function does not load or
a float output is outside tolerance (|a - b| <= 0.05 + 0.05 * |b|: fp16
rounding compounds over tens of ops); integer outputs (token ids) are
reported, not judged, because a near-tie may pick another id.
Run it with chunkforge's environment (`chunkforge doctor --venv-python`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))


def main(dirs: list[str]) -> int:
    if sys.platform != "darwin":
        print("Core ML predictions need macOS; nothing was checked", file=sys.stderr)
        return 2
    import coremltools as ct
    from chunkforge_py.mil.interp import Interpreter

    failed = 0
    for d in dirs:
        for model in sorted(Path(d).glob("*.mlmodelc")):
            if not (model / "model.mil").is_file() or not (model / "coremldata.bin").is_file():
                continue
            if model.stem in ("vision", "vision_video", "audio"):
                continue
            interp = Interpreter(str(model))
            for name in interp.functions:
                fn = interp.function(name)
                rng = np.random.default_rng(0)
                feed = {}
                for io in fn.inputs:
                    if io.dtype == "int32":
                        feed[io.name] = rng.integers(0, 8, size=io.shape, dtype=np.int32)
                    else:
                        feed[io.name] = (rng.standard_normal(io.shape) * 0.5).astype(np.float16)
                try:
                    cm = ct.models.CompiledMLModel(
                        str(model), compute_units=ct.ComputeUnit.CPU_AND_NE, function_name=name
                    )
                    got = cm.predict(feed)
                except Exception as e:  # noqa: BLE001 - every load failure is reported
                    print(f"FAIL {model.name} {name}: Core ML did not load or run it: {e}")
                    failed += 1
                    continue
                want = fn.run(feed, fp16=True)
                worst = 0.0
                for k, w in want.items():
                    a = np.asarray(got[k])
                    b = np.asarray(w)
                    if b.dtype.kind in "iu":
                        same = int((a.astype(np.int64) == b.astype(np.int64)).sum())
                        print(f"  {model.name} {name} {k}: {same}/{b.size} integer values equal")
                        continue
                    a32, b32 = a.astype(np.float32), b.astype(np.float32)
                    bad = np.abs(a32 - b32) > 0.05 + 0.05 * np.abs(b32)
                    worst = max(worst, float(np.abs(a32 - b32).max(initial=0.0)))
                    if bad.any():
                        print(f"FAIL {model.name} {name} {k}: {int(bad.sum())} of {b.size} values outside tolerance")
                        failed += 1
                print(f"ok   {model.name} {name}: loaded, largest difference {worst:.4g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
