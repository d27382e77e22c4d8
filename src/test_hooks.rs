//! Faults made on purpose, for the tests only. This module exists in a
//! binary built with the `test-hooks` feature (what `cargo test` and `cargo
//! build --all-targets` build, through the dev-dependency on this crate in
//! Cargo.toml), never in a release build (`cargo build --release`): the
//! hidden `--corrupt-layer` / `--corrupt-function` options of `parity` and
//! `release` are these, as are the publish fault hooks of
//! crates/release/src/publish.rs (README: Tests).

use clap::Args;

use crate::cli::values::named;
pub use crate::py::contract::{CorruptFunction, Sabotage};

/// The hidden options that break a weight on purpose (the parity tests show
/// a broken layer is found and named).
#[derive(Args, Clone, Debug)]
pub struct SabotageArgs {
    /// Testing aid: corrupt one weight of this layer in the compared layouts.
    #[arg(long, hide = true)]
    pub corrupt_layer: Option<usize>,
    /// Testing aid: with --corrupt-layer, corrupt the verify or prefill modules instead.
    #[arg(long, hide = true, value_parser = named::<CorruptFunction>(), requires = "corrupt_layer")]
    pub corrupt_function: Option<CorruptFunction>,
}

impl SabotageArgs {
    pub fn sabotage(&self) -> Option<Sabotage> {
        self.corrupt_layer.map(|layer| Sabotage {
            layer,
            function: self.corrupt_function,
        })
    }
}
