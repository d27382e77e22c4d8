"""Python half of chunkforge: torch chunk modules, checkpoint loading, coremltools calls.

The Rust binary imports this package through pyo3. Every entry point takes and
returns plain data (dicts, lists, numpy arrays); the chunk plan always comes
from Rust and is never re-derived here.
"""

from .runtime import lean_coremltools_import

lean_coremltools_import()
