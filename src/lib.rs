//! chunkforge as a library. The model half (`chunkforge_model`: config,
//! plan, checkpoint, records) and the release half (`chunkforge_release`:
//! hashing, staging, manifest, signing, verify, archives) are crates of their
//! own with no Python; this crate adds what needs the embedded interpreter
//! (`py`, `build`, `parity`, `fixture`), the INT4 kernel (`palette`), the
//! benchmarks and the CLI's commands.

pub use chunkforge_model::{
    args, checkpoint, config, error, layouts, names, parity_checks, plan, quality, records,
};
pub use chunkforge_release::{
    archive, bench, client_check, downloader, folder, hashing, keykind, manifest, package, paths,
    publish, sidefiles, sign, staging, strict_json, verify, zipwalk,
};

pub mod audit;
pub mod bench_matmul;
pub mod bench_palettize;
pub mod bench_run;
pub mod build;
pub mod builtin;
pub mod cache_dir;
pub mod cli;
pub mod commands;
pub mod compile;
pub mod eval;
pub mod fixture;
pub mod gate;
pub mod hashbench;
pub mod heap;
pub mod matmul;
pub mod palette;
pub mod parity;
pub mod progress;
pub mod py;
pub mod run;
pub mod settings;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;
