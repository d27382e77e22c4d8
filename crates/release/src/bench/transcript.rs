//! The free-running gate's transcript (`run --against-source --transcript
//! FILE`) and its rule: a release generates N tokens greedily after a prompt,
//! transformers generates N on the source checkpoint, and the first position
//! where the two streams part is the divergence. It is excused only where
//! the source's top-2 margin there is under the near-tie threshold: a gap
//! that small is one the package's rounding may cross without being wrong,
//! and after it the two continue from different texts, so nothing after it
//! is compared. Any other divergence fails.
//!
//! A device replays the transcript's prompt ids with greedy decoding and
//! logs the ids it emits on one line ([`GATE_LINE`]); `device-report
//! --transcript FILE` holds them to transformers' stream by the same rule.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use chunkforge_model::plan::LayoutKind;
use chunkforge_model::records::{ParityCheckpoint, ToolVersions};

/// `format` of a transcript.
pub const TRANSCRIPT_FORMAT: &str = "chunkforge-transcript/1";

/// `run --near-tie`'s default: the source's top-2 margin (softcapped logits)
/// under which a divergence is excused. The gap fp16 arithmetic can close:
/// on the built-in checkpoint an FP16 release's logits stay within 0.03 of
/// transformers' (`eval --fp16`, README), so two logits cross only where
/// they were within twice that; 0.1 is the Core AI model zoo's near-tie.
pub const DEFAULT_NEAR_TIE: f64 = 0.1;

/// The device's line: `[Gate] tokens: 12 345 6` (ids separated by spaces or
/// commas), the ids the app emitted after the transcript's prompt, in order.
pub const GATE_LINE: &str = "[Gate] tokens:";

/// One side's tokens, with each token's top-2 margin (its logit minus the runner-up's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Stream {
    pub ids: Vec<i64>,
    pub margins: Vec<f64>,
}

/// The release's side.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ReleaseStream {
    pub ids: Vec<i64>,
    pub margins: Vec<f64>,
    /// The release folder and its version (manifest.json).
    pub folder: String,
    pub version: String,
    /// The decode layout `run` ran, and its arithmetic.
    pub layout: LayoutKind,
    pub fp16: bool,
    /// The manifest's SHA-256: which files the tokens came from.
    pub manifest_sha256: String,
}

/// Where two streams first part.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Divergence {
    pub position: usize,
    /// transformers' token there (None: its stream ended).
    pub source_token: Option<i64>,
    /// The other side's token there (None: its stream ended).
    pub other_token: Option<i64>,
    /// The source's top-2 margin there (None: its stream ended).
    pub source_margin: Option<f64>,
    /// The margin was under the near-tie threshold.
    pub excused: bool,
}

/// The gate's verdict on one stream against the source's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Judged {
    pub pass: bool,
    /// Tokens equal to the source's before the divergence (all, without one).
    pub equal: usize,
    pub divergence: Option<Divergence>,
}

/// `run --against-source --transcript FILE` (schema: eval/transcript.schema.json).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[schemars(title = "chunkforge free-running gate transcript")]
pub struct Transcript {
    #[schemars(extend("const" = TRANSCRIPT_FORMAT))]
    pub format: String,
    /// The prompt as text, when given so.
    pub prompt: Option<String>,
    pub prompt_ids: Vec<i64>,
    pub max_tokens: usize,
    pub near_tie: f64,
    /// transformers on the source checkpoint (fp32, eager attention, greedy).
    pub source: Stream,
    pub release: ReleaseStream,
    pub judged: Judged,
    /// The source checkpoint: folder, config.json and weights digests.
    pub checkpoint: ParityCheckpoint,
    pub tool: ToolVersions,
}

/// `other` against `source` (with its margins) by the gate's rule.
pub fn judge(source: &Stream, other: &[i64], near_tie: f64) -> Judged {
    let n = source.ids.len().max(other.len());
    for i in 0..n {
        let (s, o) = (source.ids.get(i).copied(), other.get(i).copied());
        if s == o {
            continue;
        }
        let margin = source.margins.get(i).copied().filter(|_| s.is_some());
        let excused = s.is_some() && o.is_some() && margin.is_some_and(|m| m < near_tie);
        return Judged {
            pass: excused,
            equal: i,
            divergence: Some(Divergence {
                position: i,
                source_token: s,
                other_token: o,
                source_margin: margin,
                excused,
            }),
        };
    }
    Judged {
        pass: true,
        equal: n,
        divergence: None,
    }
}

impl Judged {
    /// `PASS: 64 of 64 tokens equal transformers'` and the like; `who` is the other side.
    pub fn line(&self, who: &str, n: usize, near_tie: f64) -> String {
        let tok = |t: Option<i64>| t.map_or("(ended)".to_string(), |t| t.to_string());
        match &self.divergence {
            None => format!("PASS: {who}'s {n} tokens equal transformers'"),
            Some(d) if d.excused => format!(
                "PASS: {who} follows transformers for {} tokens, then parts at a near-tie (token {}: {} vs transformers' {}, source margin {:.4} < {near_tie})",
                self.equal,
                d.position,
                tok(d.other_token),
                tok(d.source_token),
                d.source_margin.unwrap_or(f64::NAN)
            ),
            Some(d) => format!(
                "FAIL: {who} parts from transformers at token {} of {n}: {} vs transformers' {}{}",
                d.position,
                tok(d.other_token),
                tok(d.source_token),
                d.source_margin.map_or(String::new(), |m| format!(
                    ", where transformers' top-2 margin is {m:.4} (>= {near_tie}: not a near-tie)"
                ))
            ),
        }
    }
}

/// The ids of the last [`GATE_LINE`] in a log (None: no such line), or
/// the line that could not be read.
pub fn device_tokens(log: &str) -> Result<Option<Vec<i64>>, String> {
    let mut found = None;
    for (i, line) in log.lines().enumerate() {
        let Some(at) = line.find(GATE_LINE) else {
            continue;
        };
        let rest = &line[at + GATE_LINE.len()..];
        let ids: Result<Vec<i64>, _> = rest
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|s| !s.is_empty())
            .map(str::parse::<i64>)
            .collect();
        match ids {
            Ok(ids) => found = Some(ids),
            Err(_) => {
                return Err(format!(
                    "line {}: `{}` is not a list of token ids",
                    i + 1,
                    line.trim()
                ))
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> Stream {
        Stream {
            ids: vec![5, 6, 7, 8],
            margins: vec![2.0, 0.05, 1.5, 3.0],
        }
    }

    #[test]
    fn equal_streams_pass() {
        let j = judge(&source(), &[5, 6, 7, 8], DEFAULT_NEAR_TIE);
        assert!(j.pass && j.divergence.is_none() && j.equal == 4);
    }

    #[test]
    fn a_divergence_passes_only_at_a_near_tie() {
        let j = judge(&source(), &[5, 9, 1, 1], DEFAULT_NEAR_TIE);
        assert!(j.pass, "{j:?}");
        assert_eq!(j.divergence.as_ref().unwrap().position, 1);
        let j = judge(&source(), &[5, 6, 9, 8], DEFAULT_NEAR_TIE);
        assert!(!j.pass, "{j:?}");
        let d = j.divergence.unwrap();
        assert_eq!(
            (d.position, d.source_token, d.other_token),
            (2, Some(7), Some(9))
        );
        // A threshold above the margin excuses it.
        assert!(judge(&source(), &[5, 6, 9, 8], 2.0).pass);
        // A stream that ends early fails, whatever the margin.
        let j = judge(&source(), &[5], 10.0);
        assert!(!j.pass && j.divergence.unwrap().other_token.is_none());
    }

    #[test]
    fn device_lines_are_read() {
        let log = "[Load] x\n2026-01-01 [Gate] tokens: 1, 2 3\nnoise\n";
        assert_eq!(device_tokens(log), Ok(Some(vec![1, 2, 3])));
        assert_eq!(device_tokens("nothing"), Ok(None));
        assert!(device_tokens("[Gate] tokens: 1 two")
            .unwrap_err()
            .contains("line 1"));
    }
}
