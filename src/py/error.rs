//! The one error type of the Python half, and how a Python exception is
//! rendered for the user.

use pyo3::prelude::*;

/// A failure inside the Python half (torch, coremltools), already rendered.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PythonError {
    pub message: String,
}

/// Renders a Python exception for the user: the message, plus the traceback with `--verbose`.
pub fn render_error(err: PyErr, verbose: bool) -> String {
    Python::attach(|py| {
        let value = err.value(py);
        let kind = value
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default();
        let msg = value.str().map(|s| s.to_string()).unwrap_or_default();
        let mut out = if kind == "ChunkforgeError" {
            msg
        } else {
            format!("{kind}: {msg}")
        };
        if verbose {
            if let Ok(tb) = py
                .import("traceback")
                .and_then(|m| m.call_method1("format_exception", (value,)))
            {
                if let Ok(lines) = tb.extract::<Vec<String>>() {
                    out.push_str("\n\nPython traceback:\n");
                    out.push_str(&lines.concat());
                }
            }
        } else {
            out.push_str(" (run with --verbose for the Python traceback)");
        }
        out
    })
}
