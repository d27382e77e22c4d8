//! The command line's value types and parsers (ripgrep's `lowargs`): what a
//! flag's value is, its default and its possible values, read by `cli` and by
//! the settings the commands resolve.

use anyhow::{Context, Result};

pub use crate::args::{choice, named};

/// `--steps`.
pub const DEFAULT_STEPS: usize = 16;

/// `--jobs`: processes converting at once (this one and its conversion
/// workers), or `auto` (`Pool::start`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Jobs {
    Auto,
    N(usize),
}

impl std::str::FromStr for Jobs {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Jobs::Auto),
            _ => match s.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(Jobs::N(n)),
                _ => Err(format!(
                    "{s}: expected auto or a number of processes (1 or more)"
                )),
            },
        }
    }
}

/// Parses `--prompt-ids 2,105,23` (commas or spaces).
pub fn parse_prompt(text: &str) -> Result<Vec<i64>> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<i64>()
                .with_context(|| format!("--prompt-ids: `{s}` is not a token id"))
        })
        .collect()
}

chunkforge_model::named! {
    /// `bench parity --compare`: what the two child runs differ by (each
    /// value's row, its environment variable and the two runs, is
    /// `commands/bench.rs` `ParityComparison::row`).
    pub enum ParityComparison {
        /// Every layout step by step (each step through all its chunks, before) and chunk by chunk (each chunk over all steps: the default).
        Order = "order",
        /// glibc's heap defaults (CHUNKFORGE_HEAP=release, the default) and freed memory kept (CHUNKFORGE_HEAP=keep).
        Heap = "heap",
        /// The packages' 4-bit weights dequantized by unpacking their indices (before) and from the stored bytes (the default).
        Dequant = "dequant",
        /// Every weight made dense in float32 and multiplied by torch (before) and read as stored by the native kernels (the default); floats may differ in their last bits.
        Matmul = "matmul",
    }
}

chunkforge_model::named! {
    /// `bench build --compare`: what the two child builds differ by (each
    /// value's row is `commands/bench.rs` `BuildComparison::row`).
    pub enum BuildComparison {
        /// glibc's heap defaults (CHUNKFORGE_HEAP=release, the default) and freed memory kept (CHUNKFORGE_HEAP=keep); packages byte-identical.
        Heap = "heap",
        /// Bundles and compositions written by coremltools (CHUNKFORGE_WRITER=coremltools) and by chunkforge (the default); packages byte-identical.
        Writer = "writer",
        /// coremltools' own code for every conversion step (CHUNKFORGE_MIL_SHORTCUTS=off) and chunkforge's shortcuts (the default); packages byte-identical.
        Shortcuts = "shortcuts",
        /// One conversion per function (CHUNKFORGE_JOINT=off) and a unit's functions converted together (the default); packages differ in op names only.
        Joint = "joint",
    }
}
