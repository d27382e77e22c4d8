//! The JSON schemas of the records chunkforge writes, generated from their
//! types: `manifests/manifest.schema.json` from [`Manifest`] and
//! `parity/report.schema.json` from [`ParityReport`],
//! `manifests/distribution.schema.json` from [`Distribution`],
//! `eval/report.schema.json` from [`EvalReport`] and
//! `eval/transcript.schema.json` from [`Transcript`]. The checked-in files
//! are these bytes; a test fails when they drift (and says how to write them
//! again).

use schemars::generate::SchemaSettings;
use schemars::JsonSchema;
use serde_json::Value;

use chunkforge_model::quality::EvalReport;
use chunkforge_model::records::ParityReport;

use crate::bench::transcript::Transcript;
use crate::distribution::Distribution;
use crate::manifest::Manifest;

/// Where each schema is checked in (relative to the repository) and its `$id`.
pub const MANIFEST_SCHEMA: &str = "manifests/manifest.schema.json";
pub const PARITY_REPORT_SCHEMA: &str = "parity/report.schema.json";
pub const DISTRIBUTION_SCHEMA: &str = "manifests/distribution.schema.json";
pub const EVAL_REPORT_SCHEMA: &str = "eval/report.schema.json";
pub const TRANSCRIPT_SCHEMA: &str = "eval/transcript.schema.json";

/// The schema of `T` (JSON Schema 2020-12), as checked in at `path`.
fn schema_of<T: JsonSchema>(path: &str) -> Value {
    let generator = SchemaSettings::draft2020_12().into_generator();
    let mut schema = generator.into_root_schema_for::<T>().to_value();
    if let Value::Object(m) = &mut schema {
        m.insert(
            "$id".into(),
            Value::String(format!("https://chunkforge.invalid/{path}")),
        );
        // What the schema is first, then its members.
        let mut rest = std::mem::take(m);
        for key in ["$schema", "$id", "title", "description"] {
            if let Some(v) = rest.remove(key) {
                m.insert(key.into(), v);
            }
        }
        m.append(&mut rest);
    }
    schema
}

/// Every generated schema: (path in the repository, its text).
pub fn schemas() -> Vec<(&'static str, String)> {
    [
        (MANIFEST_SCHEMA, schema_of::<Manifest>(MANIFEST_SCHEMA)),
        (
            PARITY_REPORT_SCHEMA,
            schema_of::<ParityReport>(PARITY_REPORT_SCHEMA),
        ),
        (
            DISTRIBUTION_SCHEMA,
            schema_of::<Distribution>(DISTRIBUTION_SCHEMA),
        ),
        (
            EVAL_REPORT_SCHEMA,
            schema_of::<EvalReport>(EVAL_REPORT_SCHEMA),
        ),
        (
            TRANSCRIPT_SCHEMA,
            schema_of::<Transcript>(TRANSCRIPT_SCHEMA),
        ),
    ]
    .into_iter()
    .map(|(path, schema)| {
        let mut text = serde_json::to_string_pretty(&schema).expect("JSON values serialize");
        text.push('\n');
        (path, text)
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checked-in schemas are the types' own. `scripts/generate-all.sh`
    /// has the test write them instead.
    #[test]
    fn checked_in_schemas_are_generated_from_the_types() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let write = chunkforge_model::generated::bless();
        for (path, text) in schemas() {
            let file = root.join(path);
            if write {
                std::fs::write(&file, &text).unwrap();
                continue;
            }
            let on_disk = std::fs::read_to_string(&file).unwrap_or_default();
            assert!(
                on_disk == text,
                "{path} is not the schema of its type; {}",
                chunkforge_model::generated::REGENERATE
            );
        }
    }
}
