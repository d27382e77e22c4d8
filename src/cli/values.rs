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
