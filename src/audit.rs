//! The static ANE audit of Core ML packages (`chunkforge audit`, and `build`
//! after it writes its packages): which packages, with which layer kinds,
//! handed to `chunkforge_py.mil.audit`, and its report read back. The rules and
//! the op-type table live on the Python side (python/chunkforge_py/mil/audit.py).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};

use crate::config::Attention;
use crate::layouts::{kind_of_package, spec, Bench};
use crate::plan::{ChunkPlan, KvSource, LayoutKind, Plan};
use crate::py::calls;
use crate::py::contract::AuditArgs;
pub use crate::py::contract::{AuditPackage, AuditReport, OpTypes, PackageAudit};
use crate::records::{severity_text, AuditRecord, BuildRecord, AUDIT_FORMAT};

impl AuditPackage {
    /// A package of a build, described by its chunk plan.
    pub fn of_chunk(path: &Path, chunk: &ChunkPlan, layout: LayoutKind) -> Self {
        AuditPackage {
            path: path.to_string_lossy().into_owned(),
            name: file_name(path),
            layer_kinds: chunk
                .layers
                .iter()
                .map(|l| (l.index.to_string(), layer_kind(l.attention, &l.kv)))
                .collect(),
            merged: ships_on_verdict(layout),
        }
    }

    /// A package nothing is known about (no build.json lists it).
    pub fn bare(path: &Path) -> Self {
        let name = file_name(path);
        AuditPackage {
            path: path.to_string_lossy().into_owned(),
            merged: name
                .strip_suffix(".mlpackage")
                .and_then(kind_of_package)
                .is_some_and(ships_on_verdict),
            name,
            layer_kinds: BTreeMap::new(),
        }
    }
}

/// A layout whose packages the compute plan's ship verdict applies to: one
/// with a device-bench target (the two- and one-chunk layouts).
fn ships_on_verdict(kind: LayoutKind) -> bool {
    spec(kind)
        .runtime
        .is_some_and(|rt| matches!(rt.bench, Bench::Target { .. }))
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.to_string_lossy().into_owned())
}

/// The op-type table's name for a layer: attention kind, `shared_` when it
/// reads another layer's KV.
fn layer_kind(attention: Attention, kv: &KvSource) -> &'static str {
    match (attention, kv) {
        (Attention::Sliding, KvSource::Own { .. }) => "sliding",
        (Attention::Full, KvSource::Own { .. }) => "full",
        (Attention::Sliding, KvSource::Shared { .. }) => "shared_sliding",
        (Attention::Full, KvSource::Shared { .. }) => "shared_full",
    }
}

/// The chunk plan of package `name` and its layout.
fn chunk_of<'a>(plan: &'a Plan, name: &str) -> Option<(LayoutKind, &'a ChunkPlan)> {
    plan.layouts
        .iter()
        .flat_map(|l| l.chunks.iter().map(move |c| (l.kind, c)))
        .find(|(_, c)| c.name == name)
}

/// Every package `record` lists, in `dir`, described by the build's plan
/// (`existing`: only those whose folder exists).
pub fn build_packages(dir: &Path, record: &BuildRecord, existing: bool) -> Vec<AuditPackage> {
    record
        .chunks
        .iter()
        .map(|c| (dir.join(&c.package), c))
        .filter(|(path, _)| !existing || path.is_dir())
        .map(|(path, c)| match chunk_of(&record.plan, &c.name) {
            Some((layout, chunk)) => AuditPackage::of_chunk(&path, chunk, layout),
            None => AuditPackage::bare(&path),
        })
        .collect()
}

/// What `chunkforge audit PATH` audits: a build folder's packages (from its
/// build.json), or one `.mlpackage` (described by the build.json beside it
/// when that lists it).
pub fn resolve(path: &Path) -> Result<(Vec<AuditPackage>, Option<PathBuf>)> {
    let build_json = path.join("build.json");
    if path.is_dir() && build_json.is_file() {
        let record = read_record(&build_json)?;
        if record.chunks.is_empty() {
            bail!("{}: lists no packages", build_json.display());
        }
        let packages = build_packages(path, &record, false);
        for p in &packages {
            if !Path::new(&p.path).is_dir() {
                bail!(
                    "{}: missing: {} lists it (was the build interrupted?)",
                    p.path,
                    build_json.display()
                );
            }
        }
        return Ok((packages, Some(build_json)));
    }
    let is_package = path.extension().is_some_and(|e| e == "mlpackage");
    if !(is_package && path.is_dir()) {
        bail!(
            "{}: neither a build folder (no build.json in it) nor an .mlpackage folder",
            path.display()
        );
    }
    let beside = path.parent().map(|p| p.join("build.json"));
    let described = beside.as_ref().filter(|b| b.is_file()).and_then(|b| {
        let record = read_record(b).ok()?;
        let name = file_name(path);
        let c = record.chunks.iter().find(|c| c.package == name)?;
        let (layout, chunk) = chunk_of(&record.plan, &c.name)?;
        Some(AuditPackage::of_chunk(path, chunk, layout))
    });
    let by_build = described.is_some();
    Ok((
        vec![described.unwrap_or_else(|| AuditPackage::bare(path))],
        beside.filter(|_| by_build),
    ))
}

fn read_record(build_json: &Path) -> Result<BuildRecord> {
    let text = std::fs::read(build_json)
        .with_context(|| format!("{}: cannot read", build_json.display()))?;
    serde_json::from_slice(&text).map_err(|e| {
        anyhow!(
            "{}: not a chunkforge build record ({e})",
            build_json.display()
        )
    })
}

impl AuditReport {
    /// build.json's brief form: counts, and the first finding of each rule
    /// in each package.
    pub fn record(&self) -> AuditRecord {
        let mut seen = std::collections::BTreeSet::new();
        let first = self
            .findings
            .iter()
            .filter(|f| seen.insert((f.package.clone(), f.rule.clone())))
            .cloned()
            .collect();
        AuditRecord {
            format: AUDIT_FORMAT.into(),
            op_table_sha256: self.op_table.sha256.clone(),
            total: self.total,
            errors: self.errors,
            warnings: self.warnings,
            by_rule: self.by_rule.clone(),
            severity: self.severity.clone(),
            packages: self
                .packages
                .iter()
                .map(|p| (p.package.clone(), p.findings.clone()))
                .collect(),
            first,
            compute_plan: self.compute_plan.clone(),
        }
    }
}

/// The audit of `packages` (with the compute plan on macOS).
pub fn run(packages: &[AuditPackage], verbose: bool) -> Result<AuditReport> {
    let report: AuditReport = calls::call::<calls::Audit>(
        &AuditArgs {
            packages,
            compute_plan: true,
        },
        verbose,
    )?;
    if report.format != AUDIT_FORMAT {
        bail!(
            "audit.audit replied format {:?}, expected {AUDIT_FORMAT:?}",
            report.format
        );
    }
    Ok(report)
}

/// The op types per layer kind of `packages`, in ane_op_types.json's shape.
pub fn op_types(packages: &[AuditPackage], verbose: bool) -> Result<OpTypes> {
    calls::call::<calls::OpTypes>(
        &AuditArgs {
            packages,
            compute_plan: false,
        },
        verbose,
    )
}

/// The line `build` and `package` print for an audit.
pub fn summary_line(record: &AuditRecord, packages: usize) -> String {
    let plan = match &record.compute_plan.skipped {
        Some(why) => format!("compute plan: skipped ({why})"),
        None => format!(
            "compute plan: {} non-ANE op(s) out of {}",
            record.compute_plan.non_ane.unwrap_or(0),
            record.compute_plan.ops.unwrap_or(0)
        ),
    };
    if record.total == 0 {
        format!("audit: {packages} packages, no findings; {plan}")
    } else {
        let (errors, warnings) = record.split(&record.by_rule);
        format!(
            "audit: {} in {packages} packages; {plan}",
            severity_text(&errors, &warnings)
        )
    }
}

/// The SHA-256 of the op-type table this chunkforge audits against (the same
/// bytes Python reads: `python/chunkforge_py/mil/ane_op_types.json`), to tell a
/// build.json audit record made against another table.
pub fn op_table_sha256() -> String {
    use sha2::{Digest, Sha256};
    crate::hashing::hex(&Sha256::digest(include_bytes!(
        "../python/chunkforge_py/mil/ane_op_types.json"
    )))
}
