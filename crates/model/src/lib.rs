//! chunkforge's model half, pure Rust: the Gemma 4 text config, checkpoint
//! validation, the chunk plan (layouts, functions, I/O contracts with their
//! roles), the conversion settings, and the records `build` and `parity`
//! write. Everything the Python half and the release half read is one of these
//! types.

pub mod args;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod fp16range;
pub mod generated;
pub mod layouts;
pub mod names;
pub mod parity_checks;
pub mod plan;
pub mod quality;
pub mod records;
pub mod strict_json;

/// For [`named!`]'s JSON schema in the crates that invoke it.
pub use schemars;
