//! chunkforge as a library: the plan, checkpoint validation, build and parity
//! drivers, release manifests, signing and verification. The `chunkforge`
//! binary is a thin CLI over these modules; the fuzz targets use them too.

pub mod archive;
pub mod args;
pub mod bench_palettize;
pub mod build;
pub mod cache_dir;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod fixture;
pub mod fsutil;
pub mod hashbench;
pub mod hashing;
pub mod keykind;
pub mod manifest;
pub mod native;
pub mod palette;
pub mod parity;
pub mod plan;
pub mod progress;
pub mod publish;
pub mod pyenv;
pub mod release;
pub mod sign;
pub mod strict_json;
pub mod verify;
pub mod zipwalk;
