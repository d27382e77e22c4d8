//! Error types, one per layer of the program. Each message says what was being
//! done, to which file, and what was expected.

use std::path::PathBuf;

/// Problems with what the user handed us: checkpoints, configs, splits, paths.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    #[error("{}: {message}", path.display())]
    Checkpoint { path: PathBuf, message: String },
    #[error("--split {split}: {message}")]
    Split { split: String, message: String },
    #[error("{message}")]
    Functions { message: String },
    #[error("{}: could not {action}: {source}", path.display())]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
}
