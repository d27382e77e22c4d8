//! Files generated from the code and checked in: the JSON schemas of the
//! published records (`chunkforge_release::schemas`), the seam's schemas
//! (`python/tests/seam.json`, `src/py/calls.rs`) and the run books of
//! `manifests/runbooks/` (`chunkforge_release::bench::runbook`). A unit test
//! beside each one's generator fails when the checked-in file is stale; with
//! [`BLESS_ENV`] set it writes the file instead. `scripts/generate-all.sh`
//! sets it and runs every library's unit tests, so it regenerates them all
//! (docs/contributing.md); `crates/release/tests/generated.rs` holds every
//! generator to this one switch.

/// The switch that makes the generators' tests write their files.
pub const BLESS_ENV: &str = "CHUNKFORGE_BLESS";

/// Whether this test run writes the generated files (`scripts/generate-all.sh`).
pub fn bless() -> bool {
    std::env::var_os(BLESS_ENV).is_some()
}

/// What a stale generated file's test says.
pub const REGENERATE: &str = "regenerate every generated file with scripts/generate-all.sh";
