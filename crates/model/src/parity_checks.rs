//! Parity's checks, one [`Check`] each, in one table ([`CHECKS`]): where a
//! check's rows sit in the report, each row's name and verdict, its lines of
//! the printout and what its failure says. `failed_checks`, the run's verdict
//! and `chunkforge parity`'s output all go through the table, so a check
//! cannot be left out of one of them. On the other side of the seam each
//! check is a unit, `chunkforge_py.parity.<name>`, which computes its rows
//! and their verdicts; the request names the units to run, in this table's
//! order ([`CheckName`]), and what they are held to ([`Thresholds`]). A test
//! here fails when the report holds a verdict no check claims, and one in
//! python/tests/test_parity_units.py when a check has no unit.

use clap::{Args, Command, FromArgMatches};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::args;
use crate::records::{
    ArtifactSummary, KlSummary, OracleRecord, ParityReport, ProgramSummary, StepRecord, Verdict,
};

/// What parity's checks are held to, each threshold a field: `parity`'s
/// options (flattened into its command line, with their defaults here
/// only), the settings a run resolves, and the request's `thresholds`
/// (python/chunkforge_py/contract.py `ParityThresholds`), as they are.
#[derive(Args, Clone, Copy, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Thresholds {
    /// Minimum cosine of the final normed hidden state per step.
    #[arg(long, default_value_t = 0.9999, value_parser = args::cosine)]
    pub tol_cos: f64,
    /// Minimum cosine per step for the INT4 artifacts.
    #[arg(long, default_value_t = 0.85, value_parser = args::cosine)]
    pub tol_cos_int4: f64,
    /// Minimum fraction of steps whose INT4 token equals the reference's.
    #[arg(long, default_value_t = 0.75, value_parser = args::fraction)]
    pub min_top1_int4: f64,
    /// Largest relative MSE (dequantized vs checkpoint) allowed for any INT4 weight.
    #[arg(long, default_value_t = 0.03, value_parser = args::non_negative)]
    pub max_weight_rel_mse: f64,
    /// Largest KL(transformers ‖ reference) of the next-token distributions, in nats,
    /// allowed at any step (an fp32 reference stays under 1e-10 where transformers
    /// agrees with itself).
    #[arg(long, default_value_t = 1e-4, value_parser = args::non_negative)]
    pub max_kl: f64,
}

impl Default for Thresholds {
    /// The options' defaults: `parity` given none of them (`release`'s gate
    /// and `bench parity` hold their checks to these).
    fn default() -> Self {
        let options = Thresholds::augment_args(Command::new("thresholds"));
        let given = options
            .try_get_matches_from(["thresholds"])
            .expect("every threshold has a default");
        Thresholds::from_arg_matches(&given).expect("every threshold has a default")
    }
}

/// `--tol-cos-int4 0.85, --min-top1-int4 0.75`: the thresholds named, each
/// as its option (a field's name as clap makes it an option) and its value.
macro_rules! options {
    ($t:expr, $($field:ident),+ $(,)?) => {
        [$(format!("--{} {}", stringify!($field).replace('_', "-"), $t.$field)),+].join(", ")
    };
}

crate::named! {
    /// Parity's checks by name: each is a [`Check`] here and the unit
    /// `chunkforge_py.parity.<name>` in Python, run in this order.
    pub enum CheckName {
        Layouts = "layouts",
        Oracle = "oracle",
        Artifacts = "artifacts",
        Programs = "programs",
        Kl = "kl",
    }
}

/// One row of a check: a layout's step, an oracle step, a layout's or a
/// function's artifact or program check.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// How messages name it: `steps[3] (layout two, step 3)`.
    pub name: String,
    pub ok: bool,
    /// As the row records it (`verdicts.py`); rows older than verdicts have none.
    pub recorded: Option<Verdict>,
}

impl Row {
    fn new(name: String, ok: bool, recorded: Option<Verdict>) -> Self {
        Row { name, ok, recorded }
    }

    /// What the row says: ok when it held; else inconclusive when it is
    /// recorded so, and a failure otherwise (a row without a verdict, from
    /// an older report, fails).
    pub fn verdict(&self) -> Verdict {
        match (self.ok, self.recorded) {
            (true, _) => Verdict::Ok,
            (false, Some(Verdict::Inconclusive)) => Verdict::Inconclusive,
            (false, _) => Verdict::Fail,
        }
    }

    /// How its line of the printout ends.
    fn shown(&self) -> &'static str {
        match self.verdict() {
            Verdict::Ok => "OK",
            Verdict::Inconclusive => "INCONCLUSIVE",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One of parity's checks.
pub struct Check {
    /// Its name: the Python unit that computes it.
    pub name: CheckName,
    /// Where its verdict-carrying rows sit in the report: object keys from
    /// the report's root, dot-separated (lists and maps between are walked).
    pub field: &'static str,
    /// Every row, with whether it held and its recorded verdict.
    pub rows: fn(&ParityReport) -> Vec<Row>,
    /// Its lines of the printout, one per row.
    pub lines: fn(&ParityReport, &Thresholds) -> Vec<String>,
    /// What its failure says after `PARITY FAIL` (nothing when it held).
    pub failure: fn(&ParityReport, &Thresholds) -> Vec<String>,
}

/// Every check, in the order the printout and the messages list them.
pub const CHECKS: [Check; 5] = [LAYOUTS, ORACLE, ARTIFACTS, PROGRAMS, KL];

/// Every decode layout, verify_qK and prefill function against the four-chunk
/// reference, step by step.
pub const LAYOUTS: Check = Check {
    name: CheckName::Layouts,
    field: "steps",
    rows: |r| {
        let name = |i, s: &StepRecord| format!("steps[{i}] (layout {}, step {})", s.layout, s.step);
        let at = |(i, s)| Row::new(name(i, s), s.ok, s.verdict);
        r.steps.iter().enumerate().map(at).collect()
    },
    lines: |r, _| {
        let rows = (LAYOUTS.rows)(r);
        r.steps
            .iter()
            .zip(rows)
            .map(|(s, row)| step_line(s, &row))
            .collect()
    },
    failure: |r, _| {
        let summary = &r.summary;
        let first = summary.first_failure.iter().map(|f| {
            format!(
                "first failing step: layout {} step {} (cos {:.6}, token {} vs reference {})",
                f.layout, f.step, f.cos, f.token, f.ref_token
            )
        });
        let localised = summary.localisation.iter().flatten().map(|(name, loc)| match loc.layer {
            Some(layer) => format!(
                "{name}: first divergence at layer {layer} in {} (cos {:.6} vs the reference's hidden state after that layer, step {})",
                loc.chunk.as_deref().unwrap_or("?"),
                loc.cos.unwrap_or(f64::NAN),
                loc.step
            ),
            None => format!(
                "{name}: every layer's hidden state matches the reference at step {}; the divergence is in the final norm / head",
                loc.step
            ),
        });
        first.chain(localised).collect()
    },
};

/// The four-chunk reference against transformers, step by step, with
/// transformers' noise floor there.
pub const ORACLE: Check = Check {
    name: CheckName::Oracle,
    field: "oracle",
    rows: |r| {
        let name = |i, o: &OracleRecord| format!("oracle[{i}] (layout reference, step {})", o.step);
        let at = |(i, o)| Row::new(name(i, o), o.ok, o.verdict);
        r.oracle.iter().enumerate().map(at).collect()
    },
    lines: |r, _| {
        let rows = (ORACLE.rows)(r);
        r.oracle
            .iter()
            .zip(rows)
            .map(|(o, row)| oracle_line(o, &row))
            .collect()
    },
    failure: |r, _| {
        r.oracle
            .iter()
            .any(|o| !o.ok && !o.ill_conditioned)
            .then(|| "the four-chunk reference disagrees with transformers at a well-conditioned step (see the `reference vs transformers` lines)".to_string())
            .into_iter()
            .collect()
    },
};

/// A layout's or function's line at one step.
fn step_line(s: &StepRecord, row: &Row) -> String {
    format!(
        "{:<6} step {:>3}  cos {:.6}  ref {:>6}  token {:>6}  margin {:>7.3}  {}",
        s.layout,
        s.step,
        s.cos,
        s.ref_token,
        s.token,
        s.margin,
        row.shown()
    )
}

/// The reference against transformers at one step, with transformers'
/// distance from itself there.
fn oracle_line(o: &OracleRecord, row: &Row) -> String {
    // transformers against itself (sdpa attention, float64) at this step.
    let floor = match (o.floor_cos, o.floor_logit) {
        (Some(c), Some(l)) => format!(
            "  | itself 1-cos {:.1e} logits ±{l:.1e}{}",
            1.0 - c,
            if o.ill_conditioned {
                " ILL-CONDITIONED"
            } else {
                ""
            }
        ),
        _ => String::new(),
    };
    format!(
        "reference vs transformers step {:>3}  cos {:.6}  hf {:>6}  ref {:>6}  margin {:>7.3}{floor}  {}",
        o.step,
        o.cos,
        o.hf_token,
        o.ref_token,
        o.margin,
        row.shown()
    )
}

/// `INT4` (or `FP16`, a `--no-quantize` build): the precision of the packages'
/// weights the artifact checks read back.
fn precision(r: &ParityReport) -> &str {
    r.summary.artifacts_precision.as_deref().unwrap_or("INT4")
}

/// How the artifact check of a layout or function is named in verdicts.
pub fn artifact_check_name(name: &str) -> String {
    format!("the INT4 artifact check of {name}")
}

/// Each decode layout with its packages' weights read back, and verify_qK and
/// the prefill function with theirs, against the same build's four-chunk decode.
pub const ARTIFACTS: Check = Check {
    name: CheckName::Artifacts,
    field: "summary.artifacts",
    rows: |r| {
        let at = |(name, a): (&String, &ArtifactSummary)| Row {
            name: artifact_check_name(name),
            ok: a.ok(),
            recorded: a.verdict(),
        };
        r.summary.artifacts.iter().flatten().map(at).collect()
    },
    lines: |r, _| {
        let p = precision(r);
        let rows = (ARTIFACTS.rows)(r);
        r.summary.artifacts.iter().flatten().zip(rows).map(|((name, s), row)| {
            let replaced = s.weights_replaced();
            match s {
                ArtifactSummary::Function(f) => format!(
                    // verify_qK / prefill_bN with their packages' weights, against the
                    // INT4 four-chunk decode of the same build.
                    "{p} artifacts {name:<6} vs the {p} four-chunk decode: min cos {:.6} over {} steps, tokens match: {}  ({replaced} weights read back)  {}",
                    f.min_cos,
                    f.steps,
                    f.tokens_match,
                    row.shown()
                ),
                ArtifactSummary::Layout(l) => format!(
                    "{p} artifacts {name:<6} min cos {:.6}  mean cos {:.6}  top-1 agreement {:.1}%  ({replaced} weights read back, worst relative MSE {:.2e} in {}){}  {}",
                    l.min_cos,
                    l.mean_cos,
                    100.0 * l.top1_agreement,
                    l.worst_weight.rel_mse,
                    l.worst_weight.weight.as_deref().unwrap_or("-"),
                    l.weight_noise.as_ref().map(|n| format!(
                        "  | weight noise of that size: {}",
                        n.spread()
                    )).unwrap_or_default(),
                    row.shown()
                ),
            }
        }).collect()
    },
    failure: |r, t| {
        let p = precision(r);
        let failed = r
            .summary
            .artifacts
            .iter()
            .flatten()
            .filter(|(_, s)| !s.ok());
        failed
            .map(|(name, s)| match s {
                ArtifactSummary::Function(_) => format!(
                    "{p} artifacts of {name} fail: its package's weights do not reproduce the {p} \
                     four-chunk decode (cos >= {} and the same token at every step)",
                    t.tol_cos
                ),
                ArtifactSummary::Layout(l) => format!(
                    "{p} artifacts of {name} {}: thresholds {}; tokens match the other layouts' INT4 models: {}{}",
                    if l.verdict == Some(Verdict::Inconclusive) { "inconclusive" } else { "fail" },
                    options!(t, tol_cos_int4, min_top1_int4, max_weight_rel_mse),
                    l.tokens_match_other_layouts,
                    l.weight_noise.as_ref().map(|n| format!(
                        "; weight noise of the palettization's size: {}",
                        n.spread()
                    )).unwrap_or_default()
                ),
            })
            .collect()
    },
};

/// Every program check: (layout or function, precision, summary).
fn programs(r: &ParityReport) -> impl Iterator<Item = (&String, &String, &ProgramSummary)> {
    let by_layout = r.summary.programs.iter().flatten();
    by_layout.flat_map(|(name, by)| by.iter().map(move |(p, s)| (name, p, s)))
}

/// Whether a program's tokens match the read-back modules', and where they
/// do not, the largest read-back margin at such a step beside the largest
/// logit change the program's arithmetic made: a near-tie that arithmetic
/// decides, or a margin it could not have crossed.
fn tokens_shown(p: &ProgramSummary) -> String {
    match (
        p.tokens_match_readback,
        p.max_flip_margin,
        p.max_logit_change,
    ) {
        (true, _, _) => "true".into(),
        (false, Some(margin), Some(change)) => format!(
            "false (where they differ the read-back's top-2 margin is at most {margin:.4}; \
             the largest logit change is {change:.4})"
        ),
        (false, _, _) => "false".into(),
    }
}

/// Each package's own program, run by the MIL interpreter, against the
/// read-back modules (the gate), the fp32 reference and transformers.
pub const PROGRAMS: Check = Check {
    name: CheckName::Programs,
    field: "summary.programs",
    rows: |r| {
        let mut rows: Vec<Row> = programs(r)
            .map(|(name, precision, p)| Row {
                name: format!("the {precision} program check of {name}"),
                ok: p.ok,
                recorded: p.verdict,
            })
            .collect();
        // An op the fp16 programs overflow in where the fp32 ones stay
        // finite: a failure of its own (programs.py adds its "fail").
        if let Some(range) = r.summary.fp16_range.as_ref().filter(|f| !f.ok) {
            rows.push(Row {
                name: format!("the fp16 range of the programs ({})", range.line()),
                ok: false,
                recorded: Some(Verdict::Fail),
            });
        }
        rows
    },
    lines: |r, _| {
        let opt = |v: Option<f64>, pct: bool| match v {
            Some(v) if pct => format!("{:.1}%", 100.0 * v),
            Some(v) => format!("{v:.6}"),
            None => "-".into(),
        };
        let rows = (PROGRAMS.rows)(r);
        // The fp16 range's row, after the programs' (its own line).
        let extra: Vec<String> = rows
            .iter()
            .skip(programs(r).count())
            .map(|row| format!("{}  {}", row.name, row.shown()))
            .collect();
        programs(r).zip(rows).map(|((name, precision, p), row)| {
            format!(
                "program {name:<9} {precision}  vs read-back min cos {:.6} tokens match: {}  | vs reference min cos {} top-1 {}  | vs transformers min cos {} top-1 {}  ({} steps)  {}",
                p.min_cos_readback,
                tokens_shown(p),
                opt(p.min_cos_reference, false),
                opt(p.top1_reference, true),
                opt(p.min_cos_hf, false),
                opt(p.top1_hf, true),
                p.steps,
                if p.gated { row.shown() } else { "(reported)" }
            )
        }).chain(extra).collect()
    },
    failure: |r, t| {
        let overflow = r
            .summary
            .fp16_range
            .as_ref()
            .filter(|f| !f.ok)
            .map(|f| f.line());
        programs(r)
            .filter(|(_, _, p)| !p.ok)
            .map(|(name, precision, p)| {
                format!(
                    "the {precision} program of {name} fails: the package's own program, run by the \
                     MIL interpreter, does not compute what its read-back weights do in our modules \
                     (min cos {:.6} < {}, or a different token): the conversion or the program \
                     changed the computation",
                    p.min_cos_readback, t.tol_cos
                )
            })
            .chain(overflow)
            .collect()
    },
};

/// The reference's next-token distribution against transformers', over the
/// teacher-forced steps: the mean and the largest KL(transformers ‖ reference).
pub const KL: Check = Check {
    name: CheckName::Kl,
    field: "summary.kl",
    rows: |r| {
        let at = |k: &KlSummary| {
            Row::new(
                "the KL check (transformers ‖ reference)".into(),
                k.ok,
                Some(k.verdict),
            )
        };
        r.summary.kl.iter().map(at).collect()
    },
    lines: |r, _| {
        let rows = (KL.rows)(r);
        r.summary.kl.iter().zip(rows).map(|(k, row)| {
            format!(
                "reference KL vs transformers  mean {:.2e}  max {:.2e} at step {:>3}  over {} steps  {}",
                k.mean,
                k.max,
                k.max_step,
                k.steps,
                row.shown()
            )
        }).collect()
    },
    failure: |r, t| {
        r.summary.kl.iter().filter(|k| !k.ok).map(|k| {
            format!(
                "the reference's next-token distribution leaves transformers': KL(transformers ‖ reference) \
                 {:.3e} at step {} (mean {:.3e}), over {}",
                k.max,
                k.max_step,
                k.mean,
                options!(t, max_kl)
            )
        }).collect()
    },
};

impl ParityReport {
    /// Every row of every check, by check.
    pub fn check_rows(&self) -> impl Iterator<Item = (&'static Check, Row)> + '_ {
        CHECKS
            .iter()
            .flat_map(move |c| (c.rows)(self).into_iter().map(move |row| (c, row)))
    }

    /// Every check that did not hold, named, with its own verdict (as the
    /// row records it; a row without one, from an older report, fails): one
    /// row per step of a layout or function, per oracle step, per artifact
    /// check and per program check.
    pub fn checks_not_ok(&self) -> Vec<(String, Verdict)> {
        self.check_rows()
            .filter(|(_, row)| !row.ok)
            .map(|(_, row)| {
                let verdict = row.verdict();
                (row.name, verdict)
            })
            .collect()
    }

    /// The printout of every check, one line per row.
    pub fn check_lines(&self, thresholds: &Thresholds) -> Vec<String> {
        CHECKS
            .iter()
            .flat_map(|c| (c.lines)(self, thresholds))
            .collect()
    }

    /// What every failure says, check by check (after `PARITY FAIL`).
    pub fn failure_lines(&self, thresholds: &Thresholds) -> Vec<String> {
        CHECKS
            .iter()
            .flat_map(|c| (c.failure)(self, thresholds))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::{json, Value};

    use super::*;

    /// The paths (object keys from the root, dot-separated) of every object
    /// in `schema` that carries a `verdict`.
    fn verdict_paths(schema: &Value, defs: &Value, path: &str, out: &mut BTreeSet<String>) {
        let schema = match schema["$ref"].as_str() {
            Some(r) => &defs[r.trim_start_matches("#/$defs/")],
            None => schema,
        };
        if let Some(props) = schema["properties"].as_object() {
            if props.contains_key("verdict") {
                out.insert(path.to_string());
            }
            for (key, sub) in props {
                let at = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                verdict_paths(sub, defs, &at, out);
            }
        }
        for key in ["items", "additionalProperties"] {
            if schema[key].is_object() {
                verdict_paths(&schema[key], defs, path, out);
            }
        }
        for key in ["anyOf", "oneOf", "allOf"] {
            for sub in schema[key].as_array().into_iter().flatten() {
                verdict_paths(sub, defs, path, out);
            }
        }
    }

    /// The table is [`CheckName`]'s, in its order: each name a check, the
    /// request's list of units.
    #[test]
    fn every_check_is_named_once_in_order() {
        let names: Vec<CheckName> = CHECKS.iter().map(|c| c.name).collect();
        assert_eq!(names, CheckName::ALL);
    }

    /// The defaults are the options' (and the printout names a threshold
    /// by its option).
    #[test]
    fn thresholds_default_to_the_options_defaults() {
        let t = Thresholds::default();
        assert_eq!(
            (
                t.tol_cos,
                t.tol_cos_int4,
                t.min_top1_int4,
                t.max_weight_rel_mse
            ),
            (0.9999, 0.85, 0.75, 0.03)
        );
        assert_eq!(
            options!(t, tol_cos, max_weight_rel_mse),
            "--tol-cos 0.9999, --max-weight-rel-mse 0.03"
        );
    }

    /// A new kind of row with a verdict in the report (a KL check's, say)
    /// needs its `Check`: otherwise `failed_checks`, the verdict and the
    /// printout would not see it.
    #[test]
    fn every_verdict_in_the_report_belongs_to_one_check() {
        let schema = serde_json::to_value(schemars::schema_for!(ParityReport)).unwrap();
        let mut paths = BTreeSet::new();
        verdict_paths(&schema, &schema["$defs"], "", &mut paths);
        // The run's own verdict, which the checks add up to.
        assert!(paths.remove("summary"), "{paths:?}");
        let fields: Vec<&str> = CHECKS.iter().map(|c| c.field).collect();
        assert_eq!(
            paths.iter().map(String::as_str).collect::<Vec<_>>(),
            fields
                .iter()
                .copied()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>(),
        );
        assert_eq!(fields.len(), paths.len(), "two checks claim one field");
    }

    /// One failing row in each check: each is named by `failed_checks`,
    /// fails the run, ends its line with FAIL and says why after `PARITY FAIL`.
    #[test]
    fn a_failure_in_any_check_is_named_printed_and_fails_the_run() {
        let step = json!({"layout": "two", "step": 3, "cos": 0.5, "ref_token": 1, "token": 2,
            "margin": 1.0, "ok": false, "verdict": "fail"});
        let oracle = json!({"step": 3, "hf_token": 1, "ref_token": 2, "cos": 0.5, "margin": 1.0,
            "ok": false, "floor_cos": 1.0, "floor_logit": 0.0, "ill_conditioned": false, "verdict": "fail"});
        let layout_artifacts = json!({"weights_replaced": {"chunk1": 7}, "min_cos": 0.1, "mean_cos": 0.2,
            "worst_weight": {"weight": "chunk1:w", "rel_mse": 0.5}, "top1_agreement": 0.1,
            "tokens_match_other_layouts": true, "ok": false, "verdict": "fail"});
        let program = json!({"steps": 4, "min_cos_readback": 0.5, "tokens_match_readback": false,
            "min_cos_reference": null, "top1_reference": null, "min_cos_hf": null, "top1_hf": null,
            "gated": true, "ok": false, "verdict": "fail"});
        let report: ParityReport = serde_json::from_value(json!({
            "steps": [step], "oracle": [oracle],
            "summary": {"ok": false, "verdict": "fail",
                "first_failure": {"layout": "two", "step": 3, "cos": 0.5, "ref_token": 1, "token": 2},
                "artifacts": {"two": layout_artifacts}, "programs": {"two": {"fp32": program}},
                "kl": {"steps": 4, "mean": 0.5, "max": 1.0, "max_step": 3, "ok": false, "verdict": "fail"}},
        }))
        .unwrap();
        let t = Thresholds::default();
        assert_eq!(
            report.failed_checks().len(),
            CHECKS.len(),
            "{:?}",
            report.failed_checks()
        );
        assert_eq!(report.verdict_of_checks(), Verdict::Fail);
        for c in &CHECKS {
            let rows = (c.rows)(&report);
            assert!(
                rows.iter().any(|r| r.verdict() == Verdict::Fail),
                "{}",
                c.name
            );
            assert!(
                rows.iter()
                    .all(|r| report.failed_checks().contains(&r.name)),
                "{}",
                c.name
            );
            let lines = (c.lines)(&report, &t);
            assert_eq!(lines.len(), rows.len(), "{}", c.name);
            assert!(
                lines.iter().all(|l| l.ends_with("  FAIL")),
                "{}: {lines:?}",
                c.name
            );
            assert!(!(c.failure)(&report, &t).is_empty(), "{}", c.name);
        }
        assert_eq!(report.check_lines(&t).len(), CHECKS.len());
        assert!(report
            .failure_lines(&t)
            .iter()
            .any(|l| l
                .contains("--tol-cos-int4 0.85, --min-top1-int4 0.75, --max-weight-rel-mse 0.03")));
        // An op overflowing in the fp16 programs only fails the programs
        // check (programs.py adds its "fail"), with its own line and reason.
        let overflow: ParityReport = serde_json::from_value(json!({
            "steps": [], "oracle": [],
            "summary": {"ok": false, "verdict": "fail",
                "programs": {"four": {"fp16": {"steps": 4, "min_cos_readback": 1.0,
                    "tokens_match_readback": true, "min_cos_reference": null, "top1_reference": null,
                    "min_cos_hf": null, "top1_hf": null, "gated": false, "ok": true, "verdict": "ok"}}},
                "fp16_range": {"fp16_max": 65504.0, "fp16_runs": 4, "fp32_runs": 4, "outputs": 10,
                    "closest": [], "ok": false, "introduced": [{"package": "chunk1", "function": "decode_q1",
                    "op": "exp_3", "op_type": "exp", "layer": "2", "max_abs": 1.0e5, "margin_log2": null,
                    "overflow": 3, "made_nonfinite_fp16": 3, "made_nonfinite_fp32": 0}]}},
        }))
        .unwrap();
        assert_eq!(overflow.verdict_of_checks(), Verdict::Fail);
        let lines = (PROGRAMS.lines)(&overflow, &t);
        assert_eq!(lines.len(), (PROGRAMS.rows)(&overflow).len());
        assert!(
            lines[1].contains("exp_3") && lines[1].ends_with("  FAIL"),
            "{lines:?}"
        );
        assert!(overflow
            .failure_lines(&t)
            .iter()
            .any(|l| l.contains("exp_3")));
        // Held, every check is silent after the verdict.
        let held: ParityReport =
            serde_json::from_value(json!({"steps": [], "oracle": [], "summary": {"ok": true}}))
                .unwrap();
        assert!(held.failure_lines(&t).is_empty());
        assert_eq!(held.verdict_of_checks(), Verdict::Ok);
    }
}
