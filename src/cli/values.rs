//! The command line's value types and parsers (ripgrep's `lowargs`): what a
//! flag's value is, its default and its possible values, read by `cli` and by
//! the settings the commands resolve.

use anyhow::{Context, Result};
use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};

use crate::layouts::Choice;
use crate::names::Named;

/// A value parser whose possible values (listed in `--help`, checked while
/// parsing) are `values`: (name, help).
fn values_parser<T>(values: Vec<(&'static str, String)>) -> impl TypedValueParser<Value = T>
where
    T: std::str::FromStr + Clone + Send + Sync + 'static,
{
    let values = values.into_iter().map(|(name, doc)| {
        let value = PossibleValue::new(name);
        match doc.trim() {
            "" => value,
            doc => value.help(doc.trim_end_matches('.').to_string()),
        }
    });
    PossibleValuesParser::new(values).map(|s| {
        s.parse::<T>()
            .ok()
            .expect("clap only passes one of the possible values")
    })
}

/// A value parser for a [`chunkforge_model::named!`] enum: its names are the
/// possible values.
pub fn named<T: Named + Clone + Send + Sync>() -> impl TypedValueParser<Value = T> {
    values_parser(
        T::NAMES
            .iter()
            .zip(T::DOCS)
            .map(|(n, d)| (*n, d.to_string()))
            .collect(),
    )
}

/// A value parser for a layout selector: the layouts of the layout table it
/// admits (each with its packages as help) and its words.
pub fn choice<T: Choice + Clone + Send + Sync>() -> impl TypedValueParser<Value = T> {
    values_parser(T::choices())
}

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
