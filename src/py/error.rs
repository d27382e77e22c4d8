//! The one error type of the Python half.

/// A failure inside the Python half (torch, coremltools), already rendered.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PythonError {
    pub message: String,
}
