//! Faults made on purpose, for the tests only. This module exists in a
//! binary built with the `test-hooks` feature (what `cargo test` and `cargo
//! build --all-targets` build, through the dev-dependency on this crate in
//! Cargo.toml), never in a release build (`cargo build --release`): the
//! hidden `--corrupt-layer` / `--corrupt-function` / `--skip-prefill-copy`
//! options of `parity` and `release` are these (applied by
//! python/tests/parity_sabotage.py through the request's `sabotage`), as are the publish fault hooks of
//! crates/release/src/publish.rs (README: Tests).

use clap::Args;
use pyo3::prelude::*;

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
    /// Testing aid: skip the prefill KV copy (shows the seed's integration bug).
    #[arg(long, hide = true)]
    pub skip_prefill_copy: bool,
}

impl SabotageArgs {
    /// What parity is asked to break (None: nothing).
    pub fn sabotage(&self) -> Option<Sabotage> {
        let any = self.corrupt_layer.is_some() || self.skip_prefill_copy;
        any.then_some(Sabotage {
            corrupt_layer: self.corrupt_layer,
            corrupt_function: self.corrupt_function,
            skip_prefill_copy: self.skip_prefill_copy,
        })
    }
}

/// Makes python/tests/parity_sabotage.py importable in the embedded
/// interpreter: the module that applies a request's `sabotage` lives with
/// the tests, not in the `chunkforge_py` package.
pub fn sabotage_importable() -> anyhow::Result<()> {
    let tests = crate::py::env::python_dir().join("tests");
    Python::attach(|py| -> PyResult<()> {
        let path = py.import("sys")?.getattr("path")?;
        path.call_method1("insert", (0, tests.to_string_lossy().into_owned()))?;
        Ok(())
    })
    .map_err(|e| anyhow::anyhow!(crate::py::error::render_error(e, false)))
}
