//! Value parsers for command-line options: a value outside what the option
//! means (a NaN tolerance, a context no model has, an id that is a path) is
//! refused while the arguments are parsed, naming the option, instead of
//! failing later inside Python or an allocator. And the parsers of the
//! closed sets (a [`crate::named!`] enum, a layout selector), whose possible
//! values `--help` lists.

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};

use crate::layouts::Choice;
use crate::names::Named;

/// Longest `--ctx`: 131072 (128 Ki) positions, the longest context window of
/// the Gemma 4 models. Positions past it were never trained, and the cache is
/// allocated up front: at E2B widths (head dim 512, fp16 K and V) each
/// full-attention layer's cache is already 256 MiB at this length, so a larger
/// request can only end in an allocation failure or a model no device loads.
pub const MAX_CTX: usize = 131_072;

/// `--ctx`: a whole number of cache positions in 1..=[`MAX_CTX`].
pub fn ctx(s: &str) -> Result<usize, String> {
    let n: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a whole number of positions"))?;
    check_ctx(n)
}

/// The [`ctx`] bound, also applied to a context read back from build.json.
pub fn check_ctx(n: usize) -> Result<usize, String> {
    if n == 0 || n > MAX_CTX {
        return Err(format!(
            "{n} is out of range: the context must be 1..={MAX_CTX} positions ({MAX_CTX} is Gemma 4's longest context window)"
        ));
    }
    Ok(n)
}

fn finite(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number"))?;
    if !v.is_finite() {
        return Err(format!("`{s}` is not a finite number"));
    }
    Ok(v)
}

fn within(s: &str, lo: f64, hi: f64, what: &str) -> Result<f64, String> {
    let v = finite(s)?;
    if !(lo..=hi).contains(&v) {
        return Err(format!(
            "{v} is out of range: {what} is between {lo} and {hi}"
        ));
    }
    Ok(v)
}

/// A minimum cosine similarity: finite, in -1..=1.
pub fn cosine(s: &str) -> Result<f64, String> {
    within(s, -1.0, 1.0, "a cosine")
}

/// A fraction of steps: finite, in 0..=1.
pub fn fraction(s: &str) -> Result<f64, String> {
    within(s, 0.0, 1.0, "a fraction")
}

/// A largest allowed error: finite and not negative.
pub fn non_negative(s: &str) -> Result<f64, String> {
    let v = finite(s)?;
    if v < 0.0 {
        return Err(format!("{v} is negative: an error bound is 0 or more"));
    }
    Ok(v)
}

/// Longest model id (it is recorded in the manifest and shown by `verify`).
const MAX_MODEL_ID: usize = 128;

/// A model id: 1 to 128 ASCII letters, digits, `.`, `_` and `-`, starting with
/// a letter or digit, without `..`. Runtimes and servers use the id in file
/// names and URLs, so a separator, `..` or a control character in it could
/// point them outside the model's own folder.
pub fn model_id(s: &str) -> Result<String, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let ok = !s.is_empty()
        && s.len() <= MAX_MODEL_ID
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.chars().all(allowed)
        && !s.contains("..");
    if !ok {
        return Err(format!(
            "{:?} is not a safe model id: use 1 to {MAX_MODEL_ID} ASCII letters, digits, '.', '_' and '-', starting with a letter or digit, with no '..' (no path separators, spaces or control characters)",
            s
        ));
    }
    Ok(s.to_string())
}

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

/// A value parser for a [`crate::named!`] enum: its names are the
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerances_must_be_finite_and_in_range() {
        assert_eq!(cosine("0.9999"), Ok(0.9999));
        assert_eq!(cosine("-1"), Ok(-1.0));
        for bad in ["nan", "NaN", "inf", "-inf", "1.5", "-2", "x", ""] {
            assert!(cosine(bad).is_err(), "{bad}");
        }
        assert_eq!(fraction("0.75"), Ok(0.75));
        assert!(fraction("1.01").is_err() && fraction("-0.1").is_err());
        assert_eq!(non_negative("0.03"), Ok(0.03));
        assert!(non_negative("-0.01").is_err() && non_negative("inf").is_err());
    }

    #[test]
    fn ctx_is_bounded() {
        assert_eq!(ctx("2048"), Ok(2048));
        assert_eq!(ctx("131072"), Ok(MAX_CTX));
        for bad in [
            "0",
            "131073",
            "18446744073709551615",
            "99999999999999999999",
            "-1",
            "1e6",
        ] {
            let e = ctx(bad).unwrap_err();
            assert!(!e.is_empty(), "{bad}");
        }
        assert!(ctx("131073").unwrap_err().contains("1..=131072"));
    }

    #[test]
    fn model_ids_are_plain_names() {
        for good in ["gemma-4-E2B-it", "e2b_v1.0", "A"] {
            assert_eq!(model_id(good).as_deref(), Ok(good));
        }
        for bad in [
            "",
            "../../etc/passwd",
            "a/b",
            "a\\b",
            "..",
            "a..b",
            ".hidden",
            "-flag",
            "tab\there",
            "new\nline",
            "nul\0",
            "space d",
            "é",
            &"x".repeat(129),
        ] {
            let e = model_id(bad).unwrap_err();
            assert!(e.contains("not a safe model id"), "{bad:?}: {e}");
        }
    }
}
