//! chunkforge's release half, pure Rust with no Python: digests, staging and
//! crash-safe publishing, `manifest.json`, OpenSSF model signing, `verify`,
//! release archives, the runtime's side files (embedding tables, RoPE
//! tables, `model_config.json`) written from the checkpoint, and the device
//! bench (`DEVICE_RUNBOOK.md`, `device-report`). The fuzz targets link only
//! this crate and the model crate.

pub mod archive;
pub mod bench;
pub mod bundle;
pub mod client_check;
pub mod distribution;
pub mod downloader;
pub mod encoders;
pub mod folder;
pub mod hashing;
pub mod keykind;
pub mod manifest;
pub mod onto;
pub mod package;
pub mod paths;
pub mod publish;
pub mod schemas;
pub mod sidefiles;
pub mod sign;
pub mod staging;
pub mod verify;
pub mod zipwalk;

/// Duplicate-key-refusing JSON, shared with the model half (config.json).
pub use chunkforge_model::strict_json;
