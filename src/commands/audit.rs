//! `chunkforge audit`: the static ANE audit of a build's packages or of one
//! package, and on macOS the compute plan; exit 1 with error findings
//! (warnings are listed, and leave the exit status 0).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;

use super::{verdict, ExitStatus};
use crate::audit::{self, AuditReport, PackageAudit};
use crate::py::env as pyenv;
use crate::records::{severity_text, split_by_severity, AuditFinding};

/// Op types named per rule in the grouped output.
const OP_TYPES_SHOWN: usize = 6;

pub fn run(path: &Path, json: bool, print_op_types: bool, verbose: bool) -> Result<ExitStatus> {
    super::plain_folder(path)?;
    let (packages, described_by) = audit::resolve(path)?;
    pyenv::activate(verbose)?;
    if print_op_types {
        let types = audit::op_types(&packages, verbose)?;
        println!("{}", serde_json::to_string_pretty(&types)?);
        return Ok(ExitStatus::Success);
    }
    let report = audit::run(&packages, verbose)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let kinds = match &described_by {
            Some(b) => format!("layer kinds from {}", b.display()),
            None => "no build.json lists it: layer kinds unknown".into(),
        };
        println!(
            "audit of {} ({} package{}, {kinds})",
            path.display(),
            packages.len(),
            if packages.len() == 1 { "" } else { "s" }
        );
        print_report(&report);
    }
    Ok(verdict(report.errors == 0))
}

/// Each package's functions and findings grouped by rule (count, op types,
/// the first one), then the totals and the compute plan.
fn print_report(r: &AuditReport) {
    for p in &r.packages {
        print_package(r, p);
    }
    if r.total == 0 {
        println!("no findings in {} packages", r.packages.len());
    } else {
        let (errors, warnings) = split_by_severity(&r.severity, &r.by_rule);
        println!(
            "total: {} in {} packages",
            severity_text(&errors, &warnings),
            r.packages.len(),
        );
    }
    if r.errors == 0 && r.warnings > 0 {
        println!("warnings cost speed, not a working package: no errors, exit 0");
    }
    print_compute_plan(r);
}

fn print_package(r: &AuditReport, p: &PackageAudit) {
    let functions: Vec<String> = p
        .functions
        .iter()
        .map(|f| format!("{} {} ops", f.name, f.ops))
        .collect();
    let (errors, warnings) = split_by_severity(&r.severity, &p.findings);
    println!(
        "{}: {}; {}",
        p.package,
        functions.join(", "),
        if p.findings.is_empty() {
            "no findings".to_string()
        } else {
            severity_text(&errors, &warnings)
        }
    );
    let mine: Vec<&AuditFinding> = r
        .findings
        .iter()
        .filter(|f| f.package == p.package)
        .collect();
    for rule in p.findings.keys() {
        let of_rule: Vec<&&AuditFinding> = mine.iter().filter(|f| &f.rule == rule).collect();
        let mut by_type: BTreeMap<&str, u64> = BTreeMap::new();
        for f in &of_rule {
            *by_type.entry(f.op_type.as_str()).or_default() += 1;
        }
        let mut types: Vec<(&str, u64)> = by_type.into_iter().collect();
        types.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let mut shown: Vec<String> = types
            .iter()
            .take(OP_TYPES_SHOWN)
            .map(|(t, n)| format!("{t} {n}"))
            .collect();
        if types.len() > OP_TYPES_SHOWN {
            shown.push("...".into());
        }
        let first = of_rule.first().map(|f| describe(f)).unwrap_or_default();
        let severity = if errors.contains_key(rule) {
            "error"
        } else {
            "warning"
        };
        println!(
            "    {rule:<13} {severity:<7} {:>5} ops ({}); first: {first}",
            of_rule.len(),
            shown.join(", ")
        );
    }
}

/// `decode_q1 L12 linear linear_3: detail`.
fn describe(f: &AuditFinding) -> String {
    let layer = match f.layer.parse::<u64>() {
        Ok(n) => format!("L{n}"),
        Err(_) => f.layer.clone(),
    };
    format!(
        "{} {layer} {} {}: {}",
        f.function, f.op_type, f.op, f.detail
    )
}

/// The app's ComputePlanAudit lines (macOS), or why there are none.
fn print_compute_plan(r: &AuditReport) {
    let plan = &r.compute_plan;
    if let Some(why) = &plan.skipped {
        println!("compute plan: skipped ({why})");
        return;
    }
    for p in &plan.packages {
        let name = p.package.trim_end_matches(".mlpackage");
        if p.non_ane == 0 {
            println!("[ComputePlan] {name}: all {} ops on Neural Engine", p.ops);
        } else {
            println!(
                "[ComputePlan] {name}: {}/{} ops NOT on Neural Engine",
                p.non_ane, p.ops
            );
        }
    }
    println!(
        "[ComputePlan] ── summary: {} non-ANE op(s) out of {} total across all chunks",
        plan.non_ane.unwrap_or(0),
        plan.ops.unwrap_or(0)
    );
    for p in &plan.packages {
        if let Some(ship) = p.ship {
            let share = 100.0 * p.non_ane as f64 / (p.ops.max(1)) as f64;
            println!(
                "ship {}: {} ({share:.1} % of its ops off the Neural Engine; at most 5 %)",
                p.package.trim_end_matches(".mlpackage"),
                if ship { "yes" } else { "NO" }
            );
        }
    }
}
