//! `chunkforge device-report`: device bench logs (the runtime's own lines)
//! into a verdict per decode layout, by DEVICE_RUNBOOK.md's rules.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::ExitStatus;
use crate::cli::DeviceReportCmd;
use chunkforge_release::bench::device_report::{read_logs, report, LogInput};
use chunkforge_release::bench::transcript::{
    device_tokens, judge, Judged, Transcript, GATE_LINE, TRANSCRIPT_FORMAT,
};

/// Exit 0 with the report; 1 when `--require` is not met; 2 when a log
/// cannot be read.
pub fn run(args: DeviceReportCmd) -> Result<ExitStatus> {
    let logs = read_logs(&args.logs)?;
    let transcript = args
        .transcript
        .as_deref()
        .map(read_transcript)
        .transpose()?;
    let mut r = report(&logs);
    let met = args.require.map(|level| r.require(level));
    let gate = transcript.map(|t| gate_runs(&t, &logs));
    if args.json {
        let mut value = serde_json::to_value(&r)?;
        if let Some(g) = &gate {
            value["gate"] = serde_json::to_value(g)?;
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", r.render());
        if let Some(g) = &gate {
            print!("{}", render_gate(g));
        }
    }
    let gate_failed = gate.as_ref().is_some_and(|g| !g.pass);
    Ok(match met {
        Some(false) => ExitStatus::CheckFailed,
        _ if gate_failed => ExitStatus::CheckFailed,
        _ => ExitStatus::Success,
    })
}

/// The transcript's runs on the device: each log's tokens held to transformers'.
#[derive(Serialize)]
struct GateRuns {
    transcript: String,
    near_tie: f64,
    runs: Vec<GateRun>,
    /// Every log has its tokens, and each passes.
    pass: bool,
}

#[derive(Serialize)]
struct GateRun {
    log: String,
    /// The device's ids (None: the log has no `[Gate] tokens:` line).
    tokens: Option<Vec<i64>>,
    /// Against transformers (None: no tokens, or an unreadable line: `problem`).
    judged: Option<Judged>,
    /// Tokens equal to the CPU emulation's (`run`) before they part.
    equal_to_emulation: Option<usize>,
    problem: Option<String>,
    line: String,
}

fn read_transcript(path: &Path) -> Result<Transcript> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("{}: cannot read the transcript", path.display()))?;
    let t: Transcript = serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "{}: not a transcript of `run --against-source --transcript`",
            path.display()
        )
    })?;
    if t.format != TRANSCRIPT_FORMAT {
        bail!(
            "{}: format is {:?}, expected {TRANSCRIPT_FORMAT:?}",
            path.display(),
            t.format
        );
    }
    Ok(t)
}

fn gate_runs(t: &Transcript, logs: &[LogInput]) -> GateRuns {
    let n = t.source.ids.len();
    let runs: Vec<GateRun> = logs
        .iter()
        .map(|log| {
            let name = log.path.display().to_string();
            match device_tokens(&log.text) {
                Err(problem) => GateRun {
                    line: format!("{name}: {problem}"),
                    log: name,
                    tokens: None,
                    judged: None,
                    equal_to_emulation: None,
                    problem: Some(problem),
                },
                Ok(None) => {
                    let problem =
                        format!("no `{GATE_LINE}` line: the device's tokens are not in this log");
                    GateRun {
                        line: format!("{name}: {problem}"),
                        log: name,
                        tokens: None,
                        judged: None,
                        equal_to_emulation: None,
                        problem: Some(problem),
                    }
                }
                Ok(Some(ids)) => {
                    let judged = judge(&t.source, &ids, t.near_tie);
                    let same = ids
                        .iter()
                        .zip(&t.release.ids)
                        .take_while(|(a, b)| a == b)
                        .count();
                    GateRun {
                        line: format!("{name}: {}", judged.line("the device", n, t.near_tie)),
                        log: name,
                        equal_to_emulation: Some(same),
                        tokens: Some(ids),
                        judged: Some(judged),
                        problem: None,
                    }
                }
            }
        })
        .collect();
    let pass = !runs.is_empty()
        && runs
            .iter()
            .all(|r| r.judged.as_ref().is_some_and(|j| j.pass));
    GateRuns {
        transcript: format!(
            "{} ({} tokens after {} prompt ids)",
            t.release.folder,
            n,
            t.prompt_ids.len()
        ),
        near_tie: t.near_tie,
        runs,
        pass,
    }
}

fn render_gate(g: &GateRuns) -> String {
    let mut out = format!(
        "\ngate: the device's tokens against transformers' (transcript of {}; near-tie < {}): {}\n",
        g.transcript,
        g.near_tie,
        if g.pass { "PASS" } else { "FAIL" }
    );
    for r in &g.runs {
        out += &format!("  {}", r.line);
        if let Some(same) = r.equal_to_emulation {
            out += &format!(" ({same} equal to the CPU emulation's)");
        }
        out.push('\n');
    }
    out
}
