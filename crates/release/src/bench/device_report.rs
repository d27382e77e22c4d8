//! `chunkforge device-report`: device bench logs turned into a verdict per
//! decode layout, by the run book's rules (`targets`).
//!
//! Each log file is one run: the console output of one launch of the app,
//! from model load to the end of its decode. A file with two `[Load]`
//! layout lines is refused rather than split, because a launch whose load
//! fails prints its Neural Engine failure before any layout line, and a split
//! there would charge it to the run before. A file may be labelled with the
//! layout it was meant to run (`two=two-1.log`): the runtime's layout line
//! must then agree, and a launch that died while loading (no layout line)
//! counts against its label.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Serialize;

use chunkforge_model::plan::LayoutKind;

use super::device_log::{parse_line, Line, LAYOUT_LINE};
use super::runtime_layout::{runtime_layout, Runtime, RuntimeLayout, RUNTIME_LAYOUTS};
use super::targets::{
    self, fmt_number, fmt_percent, placement_checked, tok_target, TokTarget, BENCH_CONTEXT,
    COLD_RUNS, CONTROL, MAX_OFF_NEURAL_ENGINE,
};

pub const FORMAT: &str = "chunkforge-device-report/1";

/// A log file that cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct LogError {
    pub path: PathBuf,
    pub message: String,
}

/// One log file, read, with the layout it is labelled with.
pub struct LogInput {
    pub path: PathBuf,
    pub label: Option<LayoutKind>,
    pub text: String,
}

/// `LAYOUT=FILE` (LAYOUT one of the runtime's layouts: four, three, two,
/// one) or `FILE`. Anything else before a `=` is part of the file name.
pub fn parse_log_arg(arg: &str) -> (Option<LayoutKind>, PathBuf) {
    if let Some((label, path)) = arg.split_once('=') {
        if let Ok(kind) = label.parse::<LayoutKind>() {
            if runtime_layout(kind).is_some() && !path.is_empty() {
                return (Some(kind), PathBuf::from(path));
            }
        }
    }
    (None, PathBuf::from(arg))
}

/// Reads every `LOG` argument; the first that cannot be read is an error
/// naming it.
pub fn read_logs(args: &[String]) -> Result<Vec<LogInput>, LogError> {
    args.iter()
        .map(|a| {
            let (label, path) = parse_log_arg(a);
            let bytes = std::fs::read(&path).map_err(|e| LogError {
                message: match e.kind() {
                    std::io::ErrorKind::NotFound if a.contains('=') && label.is_none() => format!(
                        "missing (a LAYOUT=FILE label takes one of {})",
                        layout_names().join(", ")
                    ),
                    std::io::ErrorKind::NotFound => "missing".to_string(),
                    _ => format!("cannot read: {e}"),
                },
                path: path.clone(),
            })?;
            Ok(LogInput {
                path,
                label,
                // Console captures may hold stray bytes; the lines that matter are ASCII.
                text: String::from_utf8_lossy(&bytes).into_owned(),
            })
        })
        .collect()
}

fn layout_names() -> Vec<&'static str> {
    bench_order().iter().map(|l| l.kind.as_str()).collect()
}

/// The runtime's layouts as the bench runs and reports them: the control
/// first, then by fewer packages (more consolidation).
pub fn bench_order() -> Vec<&'static RuntimeLayout> {
    let mut v: Vec<&RuntimeLayout> = RUNTIME_LAYOUTS.iter().collect();
    v.sort_by_key(|l| (l.kind != CONTROL, Reverse(l.decode.len())));
    v
}

chunkforge_model::named! {
    /// A layout's verdict.
    pub enum Status {
        /// The Neural Engine could not load one of its packages.
        DeadOnArrival = "dead_on_arrival",
        /// More of its ops off the Neural Engine than the limit.
        AneRegression = "ane_regression",
        /// Fewer cold runs than required, or no compute-plan audit.
        Incomplete = "incomplete",
        BelowPass = "below_pass",
        Pass = "pass",
        Ship = "ship",
        /// The four-chunk control: measured, no target.
        Control = "control",
        /// Measured; the run book has no target for it.
        Measured = "measured",
    }
}

chunkforge_model::named! {
    /// `--require`: the verdict every layout with a target must reach.
    pub enum Level {
        Pass = "pass",
        Ship = "ship",
    }
}

chunkforge_model::named! {
    pub enum Severity {
        /// The run is not counted, or the report cannot be trusted as it is.
        Error = "error",
        Warning = "warning",
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub severity: Severity,
    pub file: String,
    pub line: Option<usize>,
    pub message: String,
}

/// A line with a runtime tag that matches none of the runtime's formats.
#[derive(Clone, Debug, Serialize)]
pub struct UnparsedLine {
    pub file: String,
    pub line: usize,
    pub text: String,
    pub reason: String,
}

/// One log file as a run.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub file: String,
    pub label: Option<LayoutKind>,
    /// The layout the runtime's layout line names, its line, and the
    /// runtime build that prints that form of it.
    pub loaded: Option<LayoutKind>,
    pub layout_line: Option<usize>,
    pub runtime: Option<Runtime>,
    /// The layout the run counts for (the loaded one, else the label).
    pub layout: Option<LayoutKind>,
    /// The last `[Profile…]` line's running tok/s, and its line.
    pub tok_s: Option<f64>,
    pub profile_line: Option<usize>,
    pub context: Option<usize>,
    /// The line of the first Neural Engine load failure.
    pub ane_compile_failed: Option<usize>,
    /// Whether its tok/s counts toward its layout's verdict.
    pub counted: bool,
    /// Why it does not, when it does not.
    pub excluded: Option<String>,
}

/// One package's compute-plan audit.
#[derive(Clone, Debug, Serialize)]
pub struct ChunkPlacement {
    pub chunk: String,
    pub off: u64,
    pub total: u64,
}

/// A layout's decode packages' audits together.
#[derive(Clone, Debug, Serialize)]
pub struct Placement {
    pub off: u64,
    pub total: u64,
    pub fraction: f64,
    pub chunks: Vec<ChunkPlacement>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LayoutReport {
    pub layout: LayoutKind,
    pub name: &'static str,
    pub verdict: Status,
    /// The verdict as printed, e.g. `BELOW PASS (31.7 tok/s < 36)`.
    pub text: String,
    pub runs: usize,
    pub runs_required: usize,
    /// The counted runs' tok/s, in the order given, and their median.
    pub tok_s: Vec<f64>,
    pub median_tok_s: Option<f64>,
    /// The median on each runtime build its runs ran on.
    pub median_by_runtime: Vec<RuntimeMedian>,
    /// The runtime build its counted runs ran on (None: none, or several).
    pub runtime: Option<Runtime>,
    /// The control's median on the same runtime build, and this layout's
    /// change against it (0.023 = +2.3 %).
    pub control_tok_s: Option<f64>,
    pub delta_vs_control: Option<f64>,
    pub target: Option<TokTarget>,
    pub placement: Option<Placement>,
    /// Decode packages without a usable audit.
    pub placement_missing: Vec<String>,
    /// Where the Neural Engine failed to load it: `FILE:LINE`.
    pub dead_on_arrival: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RuntimeMedian {
    pub runtime: Runtime,
    pub median_tok_s: f64,
}

/// What `--require` found.
#[derive(Clone, Debug, Serialize)]
pub struct RequireResult {
    pub level: Level,
    pub met: bool,
    /// Why not, one reason per layout or problem.
    pub missed: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Targets {
    pub context: usize,
    pub cold_runs: usize,
    pub max_off_neural_engine: f64,
    pub control: LayoutKind,
    pub tok_s: Vec<TokTarget>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub format: &'static str,
    pub targets: Targets,
    pub runs: Vec<RunReport>,
    pub layouts: Vec<LayoutReport>,
    pub findings: Vec<Finding>,
    pub unparsed: Vec<UnparsedLine>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub require: Option<RequireResult>,
}

/// An audit line seen: its counts and where.
struct Seen {
    off: u64,
    total: u64,
    at: String,
}

#[derive(Default)]
struct Collect {
    findings: Vec<Finding>,
    unparsed: Vec<UnparsedLine>,
    audits: BTreeMap<String, Vec<Seen>>,
    audit_failures: BTreeMap<String, Vec<String>>,
    /// Per layout: counted tok/s with the runtime that ran it, and where it
    /// was dead on arrival.
    tok: BTreeMap<LayoutKind, Vec<(f64, Runtime)>>,
    doa: BTreeMap<LayoutKind, Vec<String>>,
}

impl Collect {
    fn error(&mut self, file: &str, line: Option<usize>, message: String) {
        self.push(Severity::Error, file, line, message);
    }

    fn push(&mut self, severity: Severity, file: &str, line: Option<usize>, message: String) {
        self.findings.push(Finding {
            severity,
            file: file.to_string(),
            line,
            message,
        });
    }
}

fn name_of(kind: LayoutKind) -> &'static str {
    runtime_layout(kind).map_or("?", |l| l.name)
}

/// Reads one log file as one run.
fn examine(log: &LogInput, c: &mut Collect) -> RunReport {
    let file = log.path.display().to_string();
    let mut layouts: Vec<(usize, LayoutKind, Runtime)> = Vec::new();
    let mut foreign: Option<(usize, String)> = None;
    let mut profiles: Vec<(usize, &'static str, f64)> = Vec::new();
    let mut ane_failed = None;
    let mut context: Option<(usize, usize)> = None;
    let mut runtime_lines = 0usize;
    // Audit lines since the last summary, which must add up to it.
    let mut pending = (0u64, 0u64);
    for (i, raw) in log.text.lines().enumerate() {
        let n = i + 1;
        let line = parse_line(raw);
        if line != Line::Other {
            runtime_lines += 1;
        }
        match line {
            Line::Other | Line::Known => {}
            Line::Layout(k, rt) => layouts.push((n, k, rt)),
            Line::ForeignLayout(what) => {
                foreign.get_or_insert((n, what));
            }
            Line::Audit { chunk, off, total } => {
                pending = (pending.0 + off, pending.1 + total);
                c.audits.entry(chunk).or_default().push(Seen {
                    off,
                    total,
                    at: format!("{file}:{n}"),
                });
            }
            Line::AuditSummary { off, total } => {
                if pending != (off, total) {
                    c.error(
                        &file,
                        Some(n),
                        format!(
                            "the ComputePlan summary counts {off} of {total} ops off the Neural Engine, but the package lines before it add up to {} of {}: audit lines are missing from the log",
                            pending.0, pending.1
                        ),
                    );
                }
                pending = (0, 0);
            }
            Line::AuditFailed { chunk, why } => {
                c.push(
                    Severity::Warning,
                    &file,
                    Some(n),
                    format!("the compute-plan audit of {chunk} {why}"),
                );
                c.audit_failures
                    .entry(chunk)
                    .or_default()
                    .push(format!("{file}:{n}"));
            }
            Line::Profile { tag, tok_s } => profiles.push((n, tag, tok_s)),
            Line::Context(ctx) => context = Some((n, ctx)),
            Line::AneCompileFailed => {
                ane_failed.get_or_insert(n);
            }
            Line::Unparsed(reason) => c.unparsed.push(UnparsedLine {
                file: file.clone(),
                line: n,
                text: raw.trim().to_string(),
                reason,
            }),
        }
    }
    let mut run = RunReport {
        file: file.clone(),
        label: log.label,
        loaded: layouts.first().map(|l| l.1),
        layout_line: layouts.first().map(|l| l.0),
        runtime: layouts.first().map(|l| l.2),
        layout: None,
        tok_s: profiles.last().map(|p| p.2),
        profile_line: profiles.last().map(|p| p.0),
        context: context.map(|c| c.1),
        ane_compile_failed: ane_failed,
        counted: false,
        excluded: None,
    };
    let exclude = |c: &mut Collect, run: &mut RunReport, line: Option<usize>, why: String| {
        c.error(&file, line, why.clone());
        run.excluded.get_or_insert(why);
    };

    // Which layout the run is: the runtime's word, checked against the label.
    if layouts.len() > 1 {
        let at: Vec<String> = layouts.iter().map(|l| l.0.to_string()).collect();
        exclude(
            c,
            &mut run,
            Some(layouts[1].0),
            format!(
                "holds {} layout lines (lines {}): a log file is one launch of the app; save each run to its own file",
                layouts.len(),
                at.join(", ")
            ),
        );
        return run;
    }
    if let Some((n, what)) = foreign {
        exclude(
            c,
            &mut run,
            Some(n),
            format!("the runtime loaded {what}, which chunkforge releases do not have"),
        );
        return run;
    }
    let loaded = layouts.first().copied();
    if let (Some(label), Some((n, k, _))) = (log.label, loaded) {
        if label != k {
            exclude(
                c,
                &mut run,
                Some(n),
                format!(
                    "labelled {label}, but the runtime loaded {}: the model folder's packages select {}; DEVICE_RUNBOOK.md says what to move aside for each layout",
                    name_of(k),
                    name_of(k)
                ),
            );
            return run;
        }
    }
    let Some(kind) = loaded.map(|l| l.1).or(log.label) else {
        let why = if let Some(n) = ane_failed {
            (Some(n), "a Neural Engine load failure, but no layout line: label the file with the layout it was run with (LAYOUT=FILE) to count it".to_string())
        } else if runtime_lines == 0 {
            (None, "no runtime lines ([Load], [ComputePlan], [Profile…] at the start of a line): not the console output of a bench run".to_string())
        } else {
            (None, format!("no `{}` line: save the console from the app's launch on (or the model never finished loading)", super::device_log::show_template(LAYOUT_LINE)))
        };
        exclude(c, &mut run, why.0, why.1);
        return run;
    };
    run.layout = Some(kind);
    if let Some(n) = ane_failed {
        c.doa.entry(kind).or_default().push(format!("{file}:{n}"));
    }
    let Some(rt) = runtime_layout(kind) else {
        // Labels and layout lines name the runtime's layouts only.
        exclude(
            c,
            &mut run,
            None,
            format!("the runtime does not load a {kind} layout"),
        );
        return run;
    };
    if let Some(&(n, tag, _)) = profiles.iter().find(|p| p.1 != rt.profile_tag) {
        let said = match loaded {
            Some((l, _, _)) => format!("whose layout line (line {l}) says {}", rt.name),
            None => format!("labelled {}", rt.name),
        };
        exclude(
            c,
            &mut run,
            Some(n),
            format!(
                "layout mismatch: a {tag} line in a run {said}, which prints {} lines",
                rt.profile_tag
            ),
        );
        return run;
    }
    if ane_failed.is_some() {
        run.excluded = Some("the Neural Engine failed to load the model".into());
        return run;
    }
    if profiles.is_empty() {
        exclude(
            c,
            &mut run,
            None,
            format!(
                "no {} line: the run did not decode, or the log stops before it",
                rt.profile_tag
            ),
        );
        return run;
    }
    if loaded.is_none() {
        exclude(
            c,
            &mut run,
            None,
            format!(
                "decode timings but no layout line: the runtime never confirmed it ran {}; save the console from the app's launch on",
                rt.name
            ),
        );
        return run;
    }
    if let Some((n, ctx)) = context.filter(|c| c.1 != BENCH_CONTEXT) {
        let why = format!(
            "measured at context {ctx}; the targets are at {BENCH_CONTEXT}, so it is not counted"
        );
        c.push(Severity::Warning, &file, Some(n), why.clone());
        run.excluded = Some(why);
        return run;
    }
    run.counted = true;
    let (tok, runtime) = (run.tok_s, run.runtime);
    c.tok.entry(kind).or_default().push((
        tok.expect("profiles is not empty"),
        runtime.expect("a layout line was read"),
    ));
    run
}

fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(s[n / 2]),
        _ => Some((s[n / 2 - 1] + s[n / 2]) / 2.0),
    }
}

/// The tok/s verdict of `kind` at `tok`.
fn judge(kind: LayoutKind, tok: f64) -> (Status, String) {
    if kind == CONTROL {
        return (Status::Control, format!("CONTROL ({tok:.1} tok/s)"));
    }
    match tok_target(kind) {
        None => (
            Status::Measured,
            format!("MEASURED ({tok:.1} tok/s; the run book has no target for it)"),
        ),
        Some(t) if tok >= t.ship => (
            Status::Ship,
            format!("SHIP ({tok:.1} tok/s >= {})", fmt_number(t.ship)),
        ),
        Some(t) if tok >= t.pass => (
            Status::Pass,
            format!(
                "PASS ({tok:.1} tok/s >= {}; ship at {})",
                fmt_number(t.pass),
                fmt_number(t.ship)
            ),
        ),
        Some(t) => (
            Status::BelowPass,
            format!("BELOW PASS ({tok:.1} tok/s < {})", fmt_number(t.pass)),
        ),
    }
}

/// The worst audit seen of each package (they should all agree; a finding
/// says so when they do not).
fn audits_by_chunk(c: &mut Collect) -> BTreeMap<String, (u64, u64)> {
    let mut out = BTreeMap::new();
    let mut disagree = Vec::new();
    for (chunk, seen) in &c.audits {
        let worst = seen.iter().filter(|s| s.total > 0).max_by(|a, b| {
            (a.off as f64 / a.total as f64).total_cmp(&(b.off as f64 / b.total as f64))
        });
        if let Some(w) = worst {
            out.insert(chunk.clone(), (w.off, w.total));
        }
        let first = &seen[0];
        if let Some(other) = seen
            .iter()
            .find(|s| (s.off, s.total) != (first.off, first.total))
        {
            disagree.push(format!(
                "{chunk}'s audits differ: {}/{} ops off the Neural Engine at {}, {}/{} at {}: the package changed between runs (the worst counts)",
                first.off, first.total, first.at, other.off, other.total, other.at
            ));
        }
    }
    for m in disagree {
        c.findings.push(Finding {
            severity: Severity::Error,
            file: String::new(),
            line: None,
            message: m,
        });
    }
    out
}

/// A layout's median tok/s on each runtime build it ran on.
fn medians_by_runtime(c: &Collect, kind: LayoutKind) -> BTreeMap<Runtime, f64> {
    let mut by: BTreeMap<Runtime, Vec<f64>> = BTreeMap::new();
    for (t, r) in c.tok.get(&kind).into_iter().flatten() {
        by.entry(*r).or_default().push(*t);
    }
    by.into_iter()
        .filter_map(|(r, v)| Some((r, median(&v)?)))
        .collect()
}

fn layout_report(
    rt: &RuntimeLayout,
    c: &mut Collect,
    audits: &BTreeMap<String, (u64, u64)>,
    control: &BTreeMap<Runtime, f64>,
) -> LayoutReport {
    let kind = rt.kind;
    let runs = c.tok.get(&kind).cloned().unwrap_or_default();
    let tok: Vec<f64> = runs.iter().map(|r| r.0).collect();
    let med = median(&tok);
    // The runtime build its runs ran on: the control it compares with is the
    // control's runs on the same build (they differ in speed).
    let mut runtimes: Vec<Runtime> = runs.iter().map(|r| r.1).collect();
    runtimes.sort();
    runtimes.dedup();
    if runtimes.len() > 1 && kind != CONTROL {
        c.push(
            Severity::Warning,
            "",
            None,
            format!(
                "{}'s runs ran on {} runtime builds; it is not compared with the control",
                rt.name,
                runtimes.len()
            ),
        );
    }
    let runtime = (runtimes.len() == 1).then(|| runtimes[0]);
    let mut chunks = Vec::new();
    let mut missing = Vec::new();
    for p in &rt.decode {
        match audits.get(p) {
            Some(&(off, total)) => chunks.push(ChunkPlacement {
                chunk: p.to_string(),
                off,
                total,
            }),
            None => missing.push(p.to_string()),
        }
    }
    let placement = missing.is_empty().then(|| {
        let off = chunks.iter().map(|c| c.off).sum::<u64>();
        let total = chunks.iter().map(|c| c.total).sum::<u64>();
        Placement {
            off,
            total,
            fraction: off as f64 / total.max(1) as f64,
            chunks,
        }
    });
    let doa = c.doa.get(&kind).cloned().unwrap_or_default();
    let (verdict, text) = if !doa.is_empty() {
        (
            Status::DeadOnArrival,
            "DEAD ON ARRIVAL (ANE compile failed)".to_string(),
        )
    } else if let Some(p) = placement
        .as_ref()
        .filter(|p| placement_checked(kind) && p.fraction > MAX_OFF_NEURAL_ENGINE)
    {
        (
            Status::AneRegression,
            format!(
                "ANE REGRESSION ({} of ops off the Neural Engine > {})",
                fmt_percent(p.fraction),
                fmt_percent(MAX_OFF_NEURAL_ENGINE)
            ),
        )
    } else {
        let mut short = Vec::new();
        if tok.len() < COLD_RUNS {
            short.push(format!("{} of {COLD_RUNS} runs", tok.len()));
        }
        if placement_checked(kind) && !missing.is_empty() {
            let failed: Vec<&str> = missing
                .iter()
                .filter(|m| c.audit_failures.contains_key(*m))
                .map(String::as_str)
                .collect();
            short.push(if failed.is_empty() {
                format!(
                    "no ComputePlan audit of {} (launch with COMPUTE_PLAN_AUDIT=1)",
                    missing.join(", ")
                )
            } else {
                format!(
                    "no usable ComputePlan audit of {} (its plan did not load)",
                    missing.join(", ")
                )
            });
        }
        let so_far = med.map(|m| judge(kind, m));
        match (short.is_empty(), so_far) {
            (true, Some(v)) => v,
            (_, so_far) => (
                Status::Incomplete,
                format!(
                    "INCOMPLETE: {}{}",
                    short.join("; "),
                    so_far
                        .map(|(_, t)| format!("; so far {t}"))
                        .unwrap_or_default()
                ),
            ),
        }
    };
    let control_tok = runtime
        .filter(|_| kind != CONTROL)
        .and_then(|r| control.get(&r).copied());
    let delta = match (med, control_tok) {
        (Some(m), Some(c)) if c > 0.0 => Some((m - c) / c),
        _ => None,
    };
    LayoutReport {
        layout: kind,
        name: rt.name,
        verdict,
        text,
        runs: tok.len(),
        runs_required: COLD_RUNS,
        tok_s: tok,
        median_tok_s: med,
        median_by_runtime: medians_by_runtime(c, kind)
            .into_iter()
            .map(|(runtime, median_tok_s)| RuntimeMedian {
                runtime,
                median_tok_s,
            })
            .collect(),
        runtime,
        control_tok_s: control_tok,
        delta_vs_control: delta,
        target: tok_target(kind),
        placement,
        placement_missing: missing,
        dead_on_arrival: doa,
    }
}

/// The report of `logs`, one run per file.
pub fn report(logs: &[LogInput]) -> Report {
    let mut c = Collect::default();
    let runs: Vec<RunReport> = logs.iter().map(|l| examine(l, &mut c)).collect();
    let audits = audits_by_chunk(&mut c);
    let control = medians_by_runtime(&c, CONTROL);
    let layouts = bench_order()
        .into_iter()
        .filter(|rt| runs.iter().any(|r| r.layout == Some(rt.kind)))
        .map(|rt| layout_report(rt, &mut c, &audits, &control))
        .collect();
    Report {
        format: FORMAT,
        targets: Targets {
            context: BENCH_CONTEXT,
            cold_runs: COLD_RUNS,
            max_off_neural_engine: MAX_OFF_NEURAL_ENGINE,
            control: CONTROL,
            tok_s: targets::TOK_TARGETS.clone(),
        },
        runs,
        layouts,
        findings: c.findings,
        unparsed: c.unparsed,
        require: None,
    }
}

impl Report {
    /// Whether every layout with a target reached `level`, with no error
    /// finding and no unparsed runtime line.
    pub fn require(&mut self, level: Level) -> bool {
        let mut missed = Vec::new();
        let judged: Vec<&LayoutReport> =
            self.layouts.iter().filter(|l| l.target.is_some()).collect();
        if judged.is_empty() {
            missed.push(format!(
                "no layout with a target was measured ({})",
                targets::TOK_TARGETS
                    .iter()
                    .map(|t| name_of(t.layout))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        for l in judged {
            let ok = match level {
                Level::Ship => l.verdict == Status::Ship,
                Level::Pass => matches!(l.verdict, Status::Pass | Status::Ship),
            };
            if !ok {
                missed.push(format!("{}: {}", l.name, l.text));
            }
        }
        let errors = self
            .findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
            .count();
        if errors > 0 {
            missed.push(format!("{errors} error finding(s)"));
        }
        if !self.unparsed.is_empty() {
            missed.push(format!("{} unparsed runtime line(s)", self.unparsed.len()));
        }
        let met = missed.is_empty();
        self.require = Some(RequireResult { level, met, missed });
        met
    }

    /// The report for a terminal: a verdict line per layout, then the
    /// details, the findings and the unparsed lines.
    pub fn render(&self) -> String {
        let mut s = String::new();
        if self.layouts.is_empty() {
            s.push_str("no layout measured: no run could be attributed to a layout\n");
        }
        for l in &self.layouts {
            s.push_str(&format!("{}: {}\n", l.name, l.text));
        }
        for l in &self.layouts {
            s.push_str(&format!(
                "\n{}{}\n",
                l.name,
                if l.layout == CONTROL {
                    " (control)"
                } else {
                    ""
                }
            ));
            let runs: Vec<String> = self
                .runs
                .iter()
                .filter(|r| r.layout == Some(l.layout))
                .map(|r| match (&r.tok_s, r.counted, &r.excluded) {
                    (Some(t), true, _) => format!("{t:.1} ({})", r.file),
                    (_, _, Some(why)) => format!("not counted ({}: {why})", r.file),
                    _ => format!("not counted ({})", r.file),
                })
                .collect();
            s.push_str(&format!(
                "  runs: {} of {}: {}\n",
                l.runs,
                l.runs_required,
                runs.join(", ")
            ));
            if let Some(m) = l.median_tok_s {
                s.push_str(&format!("  median: {m:.1} tok/s"));
                match (l.delta_vs_control, l.control_tok_s, l.runtime) {
                    (Some(d), Some(c), Some(r)) => s.push_str(&format!(
                        " ({}{} vs {} {c:.1} tok/s on the {r} runtime)",
                        if d >= 0.0 { "+" } else { "-" },
                        fmt_percent(d.abs()),
                        name_of(CONTROL)
                    )),
                    _ if l.layout != CONTROL => s.push_str(&format!(
                        " (no counted {} run on the same runtime build to compare)",
                        name_of(CONTROL)
                    )),
                    _ if l.median_by_runtime.len() > 1 => {
                        let each: Vec<String> = l
                            .median_by_runtime
                            .iter()
                            .map(|m| format!("{} runtime {:.1}", m.runtime, m.median_tok_s))
                            .collect();
                        s.push_str(&format!(" ({})", each.join(", ")));
                    }
                    _ => {}
                }
                s.push('\n');
            }
            match &l.placement {
                Some(p) => {
                    let parts: Vec<String> = p
                        .chunks
                        .iter()
                        .map(|c| format!("{} {}/{}", c.chunk, c.off, c.total))
                        .collect();
                    s.push_str(&format!(
                        "  off the Neural Engine: {} of {} ops ({}): {}\n",
                        p.off,
                        p.total,
                        fmt_percent(p.fraction),
                        parts.join(", ")
                    ));
                }
                None => s.push_str(&format!(
                    "  off the Neural Engine: not audited ({})\n",
                    l.placement_missing.join(", ")
                )),
            }
            for d in &l.dead_on_arrival {
                s.push_str(&format!("  Neural Engine load failure: {d}\n"));
            }
        }
        if !self.findings.is_empty() {
            s.push_str("\nfindings:\n");
            for f in &self.findings {
                let at = match (f.file.is_empty(), f.line) {
                    (true, _) => String::new(),
                    (false, Some(n)) => format!("{}:{n}: ", f.file),
                    (false, None) => format!("{}: ", f.file),
                };
                s.push_str(&format!("  {}: {at}{}\n", f.severity, f.message));
            }
        }
        if !self.unparsed.is_empty() {
            s.push_str("\nunparsed runtime lines:\n");
            for u in &self.unparsed {
                s.push_str(&format!(
                    "  {}:{}: {} ({})\n",
                    u.file, u.line, u.text, u.reason
                ));
            }
        }
        if let Some(r) = &self.require {
            s.push_str(&format!(
                "\nrequire {}: {}\n",
                r.level,
                if r.met {
                    "met".to_string()
                } else {
                    format!("NOT met: {}", r.missed.join("; "))
                }
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(label: Option<LayoutKind>, text: &str) -> LogInput {
        LogInput {
            path: PathBuf::from("t.log"),
            label,
            text: text.into(),
        }
    }

    #[test]
    fn labels_and_paths() {
        assert_eq!(
            parse_log_arg("two=a.log"),
            (Some(LayoutKind::Two), PathBuf::from("a.log"))
        );
        assert_eq!(parse_log_arg("a=b.log"), (None, PathBuf::from("a=b.log")));
        assert_eq!(
            parse_log_arg("./two=a.log"),
            (None, PathBuf::from("./two=a.log"))
        );
        assert_eq!(parse_log_arg("split=a"), (None, PathBuf::from("split=a")));
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[1.0, 2.0]), Some(1.5));
        assert_eq!(median(&[]), None);
    }

    #[test]
    fn verdict_thresholds_come_from_the_table() {
        let t = tok_target(LayoutKind::Two).unwrap();
        assert_eq!(judge(LayoutKind::Two, t.pass - 0.1).0, Status::BelowPass);
        assert_eq!(judge(LayoutKind::Two, t.pass).0, Status::Pass);
        assert_eq!(judge(LayoutKind::Two, t.ship).0, Status::Ship);
        assert_eq!(judge(LayoutKind::Four, 99.0).0, Status::Control);
        assert_eq!(judge(LayoutKind::Three, 99.0).0, Status::Measured);
    }

    #[test]
    fn a_run_without_runtime_lines_is_an_error() {
        let r = report(&[log(None, "hello\nworld\n")]);
        assert!(r.layouts.is_empty());
        assert!(r.findings[0].message.contains("no runtime lines"));
    }
}
