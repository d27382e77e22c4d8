"""Python half of chunkforge: torch chunk modules, checkpoint loading, coremltools calls.

The Rust binary imports this package through pyo3. Every entry point takes and
returns plain data (dicts, lists, numpy arrays); the chunk plan always comes
from Rust and is never re-derived here.

Shared modules sit here: the seam's types (`contract`), the interpreter's
set-up (`runtime`), the checkpoint and its weights (`checkpoint`, `weights`),
the torch chunk modules (`model`, `roles`), fixtures (`fixture`,
`tokenizer`). The rest is grouped by concern: `convert/`, `mil/`,
`parity/`, `emulate/`.
"""

from .runtime import lean_coremltools_import

lean_coremltools_import()
