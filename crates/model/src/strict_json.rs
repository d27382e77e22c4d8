//! JSON parsing that refuses duplicate object keys.
//!
//! serde_json keeps the last of two equal keys; other parsers (and so other
//! verifiers and the app's downloader) may keep the first. A signed document
//! with a duplicate key therefore says different things to different readers,
//! so `manifest.json`, the Sigstore bundle (with its DSSE envelope), the
//! signed in-toto statement and a checkpoint's `config.json` (read by
//! chunkforge here and by transformers in Python) are parsed here: any
//! duplicate is an error naming the key and where it is.

use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Parses `text` like `serde_json::from_str::<Value>`, except that an object
/// holding the same key twice is an error.
pub fn from_str(text: &str) -> Result<Value, serde_json::Error> {
    parse(serde_json::Deserializer::from_str(text))
}

/// [`from_str`] over bytes (which must be UTF-8 JSON).
pub fn from_slice(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    parse(serde_json::Deserializer::from_slice(bytes))
}

fn parse<'de, R: serde_json::de::Read<'de>>(
    mut de: serde_json::Deserializer<R>,
) -> Result<Value, serde_json::Error> {
    let v = Node { at: String::new() }.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// One value being read, and where it sits (`release.version`, `files[3]`)
/// for the error message.
struct Node {
    at: String,
}

impl Node {
    fn child(&self, step: fmt::Arguments) -> Node {
        let at = if self.at.is_empty() {
            step.to_string().trim_start_matches('.').to_string()
        } else {
            format!("{}{step}", self.at)
        };
        Node { at }
    }
}

impl<'de> DeserializeSeed<'de> for Node {
    type Value = Value;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(self.child(format_args!("[{}]", out.len())))? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if out.contains_key(&k) {
                let within = if self.at.is_empty() {
                    "the top-level object".to_string()
                } else {
                    format!("`{}`", self.at)
                };
                return Err(de::Error::custom(format!(
                    "duplicate key `{k}` in {within} (readers disagree on which one counts)"
                )));
            }
            let v = map.next_value_seed(self.child(format_args!(".{k}")))?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_values_as_serde_json_without_duplicates() {
        let text = r#"{"a": [1, -2, 3.5, "x", null, true, {"b": {}}], "c": 18446744073709551615}"#;
        assert_eq!(
            from_str(text).unwrap(),
            serde_json::from_str::<Value>(text).unwrap()
        );
        assert!(from_str("{} x").is_err(), "trailing characters");
    }

    #[test]
    fn duplicate_keys_are_refused_naming_key_and_place() {
        let e = from_str(r#"{"release": {"version": "1", "version": "2"}}"#).unwrap_err();
        assert!(
            e.to_string()
                .contains("duplicate key `version` in `release`"),
            "{e}"
        );
        let e = from_slice(br#"{"files": [{}, {"path": "a", "path": "b"}]}"#).unwrap_err();
        assert!(e.to_string().contains("in `files[1]`"), "{e}");
        let e = from_str(r#"{"a": 1, "a": 1}"#).unwrap_err();
        assert!(e.to_string().contains("in the top-level object"), "{e}");
        // Equal keys in different objects are fine.
        assert!(from_str(r#"{"a": {"a": 1}, "b": {"a": 2}}"#).is_ok());
    }
}
