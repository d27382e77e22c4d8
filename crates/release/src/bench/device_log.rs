//! The app runtime's own log lines from a device run, one line at a time:
//! the decode layout it loaded, the `[ComputePlan]` audit
//! (`COMPUTE_PLAN_AUDIT=1`), the `[Profile…]` decode timings, the KV cache's
//! context length and the Neural Engine compiler's load failure.
//!
//! The formats are the upstream Swift runtime's print statements
//! (`ChunkedEngine.swift`, `ComputePlanAudit.swift`, on its main and
//! merged-layout branches), transcribed as templates: `{}` is a field of
//! text, `{n}` a number. A line carrying one of the runtime's tags
//! (`[Load]`, `[ComputePlan]`, `[Profile`) must match one of them, or it is
//! reported as unparsed; every other line is not the runtime's and is
//! ignored.

use std::sync::LazyLock;

use chunkforge_model::layouts::{LoadLine, LAYOUTS};
use chunkforge_model::plan::LayoutKind;

use super::runtime_layout::{profile_tag, Runtime, RUNTIME_LAYOUTS};

/// The tags that mark a line as the runtime's.
pub const RUNTIME_TAGS: &[&str] = &["[Load]", "[ComputePlan]", "[Profile"];

/// The merged-layout runtime's layout line (NAME: `four`, `two`, `one`).
/// The main runtime has no `Decode layout` line; its line per layout is in
/// the layout's row ([`main_lines`]).
pub const LAYOUT_LINE: &str = "[Load] Decode layout: {}-chunk";
/// main's opt-in three-chunk split into `chunk*_topoI` packages, which
/// chunkforge releases do not have.
const MAIN_TOPOLOGY_I_LINE: &str = "[Load] Topology I — 3-chunk ({})";

pub const AUDIT_ALL: &str = "[ComputePlan] {}: all {n} ops on Neural Engine";
pub const AUDIT_SOME: &str = "[ComputePlan] {}: {n}/{n} ops NOT on Neural Engine";
pub const AUDIT_SUMMARY: &str =
    "[ComputePlan] ── summary: {n} non-ANE op(s) out of {n} total across all chunks";
const AUDIT_LOAD_FAILED: &str = "[ComputePlan] {}: failed to load plan — {}";
const AUDIT_NOT_A_PROGRAM: &str = "[ComputePlan] {}: model structure is not a program";

/// Each `[Profile…]` tag's line (from the layout rows, each tag once); the
/// last field is the running tok/s.
pub static PROFILE_LINES: LazyLock<Vec<(&'static str, &'static str)>> = LazyLock::new(|| {
    let mut v: Vec<(&str, &str)> = Vec::new();
    for rt in LAYOUTS.iter().filter_map(|l| l.runtime) {
        let tag = profile_tag(rt.profile_line);
        if !v.iter().any(|(t, _)| *t == tag) {
            v.push((tag, rt.profile_line));
        }
    }
    v
});

/// The main runtime's layout line of each layout it loads.
pub fn main_lines() -> impl Iterator<Item = (LayoutKind, &'static str)> {
    LAYOUTS.iter().flat_map(|l| {
        l.runtime.into_iter().flat_map(move |rt| {
            rt.load_lines.iter().filter_map(move |line| match line {
                LoadLine::Main(t) => Some((l.kind, *t)),
                LoadLine::Merged => None,
            })
        })
    })
}

/// The KV cache allocation, with the context length (main appends
/// ` — ` and more).
pub const KV_CONTEXT_LINE: &str = "[KV] Allocating IOSurface-backed KV cache buffers (ctx={n})";

/// What the OS prints when the Neural Engine cannot load a compiled model
/// (seed: merged_full, 35 layers, iPhone 17 Pro). It comes with the OS's own
/// prefixes, so it is found anywhere in a line.
pub const ANE_COMPILE_FAILED: &str = "ANE model load has failed for on-device compiled macho";

/// The runtime's other lines: recognized, carrying nothing the report uses.
const KNOWN: &[&str] = &[
    "[Load] {} done in {n}s",
    "[Load] All {n} chunks loaded in {n}s (parallel)",
    "[Load] ComputePlan warm: {n} plan(s) in {n}s",
    "[Load] Verify functions loaded (K={n}) in {n}s",
    "[Load] No verify_qK function found, speculative verification disabled",
    "[Load] ANE prewarm ({n} steps) done in {n}s",
    "[Load] prefillN updated via attachPrefill: {n} → {n}",
    "[Load] Prefill-only warm skipped (engine in use, pos={n})",
    "[Load] LLM_COMPUTE_UNITS={} → computeUnits={}",
    "[Load] GPU_PREFILL=1 — prefill chunks will use .cpuAndGPU",
    "[Load] MLOptimizationHints.specializationStrategy = .fastPrediction",
    "[Load] Removing stale prefill_chunk{n}.mlmodelc (missing coremldata.bin)",
    "[Load] LLM_3CHUNK_TOPO=I requested but chunk{1,2,3}_topoI not found — falling back to Topology II / 4-chunk",
    "[Load] LLM_LOAD_MAX_PARALLEL={n} (override default sequential load)",
    "[Load] deferred prefill load ({}) — decode chunks foreground, prefill chunks background",
    "[Load] {n}/{n} chunks loaded in {n}s ({}){}",
    "[Load] Could not infer K from verify_chunk4 token_ids shape; defaulting to 3",
    "[Load] Standalone verify chunks loaded (K={n}) in {n}s",
    "[Load] Partial verify_chunk*.mlmodelc set — speculative disabled",
    "[Load] verify_chunk*.mlmodelc load failed ({}) — speculative disabled",
    "[Load] speculative disabled by default — set LLM_EAGLE3_ENABLE=1 or SPECULATIVE_PROFILE=1 to load verify chunks",
    "[Load] Final prewarm (prefill + decode + verify + transition) done in {n}s",
    "[ComputePlan] {}: not found, skipping",
    "[ComputePlan] {}: {n} off-{} op(s) out of {n} total",
    "[ComputePlan] {} fallback | {}: {n}",
    "[ComputePlan] {} | {} → {} | {} | outputs={}",
];

/// One line of a device log, read.
#[derive(Clone, Debug, PartialEq)]
pub enum Line {
    /// Not a runtime line: ignored.
    Other,
    /// A runtime line that carries nothing the report uses.
    Known,
    /// The decode layout the runtime loaded, and which runtime said so.
    Layout(LayoutKind, Runtime),
    /// A decode layout of packages chunkforge releases do not have.
    ForeignLayout(String),
    /// One package's compute plan: `off` of its `total` ops not on the
    /// Neural Engine.
    Audit { chunk: String, off: u64, total: u64 },
    /// The audit's closing line over the packages it just listed.
    AuditSummary { off: u64, total: u64 },
    /// The audit could not read a package's plan.
    AuditFailed { chunk: String, why: String },
    /// A decode timing line; `tok_s` is the running average so far.
    Profile { tag: &'static str, tok_s: f64 },
    /// The KV cache's context length.
    Context(usize),
    /// The Neural Engine could not load a compiled model.
    AneCompileFailed,
    /// Starts with a runtime tag but is none of its formats.
    Unparsed(String),
}

/// The fields of `line` if it matches `template`, else None. A field runs
/// up to the first occurrence of the text after it (the last one up to the
/// template's final text, which must end the line); a `{n}` field must be a
/// number.
pub fn match_template<'a>(line: &'a str, template: &str) -> Option<Vec<&'a str>> {
    let (literals, numeric) = split_template(template);
    let mut rest = line.strip_prefix(literals[0])?;
    let mut out = Vec::with_capacity(numeric.len());
    for (i, is_number) in numeric.iter().enumerate() {
        let next = literals[i + 1];
        let value = if i + 1 == numeric.len() {
            let v = rest.strip_suffix(next)?;
            rest = "";
            v
        } else {
            let at = rest.find(next)?;
            let v = &rest[..at];
            rest = &rest[at + next.len()..];
            v
        };
        if *is_number && value.parse::<f64>().is_err() {
            return None;
        }
        out.push(value);
    }
    // With fields the last one took the rest; without, the line is the template.
    rest.is_empty().then_some(out)
}

/// A template's literal texts (one more than its fields) and whether each
/// field is a number. Only `{}` and `{n}` are fields; other braces are text.
fn split_template(template: &str) -> (Vec<&str>, Vec<bool>) {
    let mut literals = Vec::new();
    let mut numeric = Vec::new();
    let mut rest = template;
    loop {
        let field = [("{}", false), ("{n}", true)]
            .into_iter()
            .filter_map(|(f, n)| rest.find(f).map(|at| (at, f.len(), n)))
            .min();
        match field {
            Some((at, len, n)) => {
                literals.push(&rest[..at]);
                numeric.push(n);
                rest = &rest[at + len..];
            }
            None => {
                literals.push(rest);
                return (literals, numeric);
            }
        }
    }
}

/// A template as the run book shows it: each field as `…`.
pub fn show_template(template: &str) -> String {
    template.replace("{n}", "…").replace("{}", "…")
}

fn count(s: &str) -> Option<u64> {
    s.parse().ok()
}

/// Reads one line of a device log (without its line ending).
pub fn parse_line(raw: &str) -> Line {
    let line = raw.trim();
    if line.contains(ANE_COMPILE_FAILED) {
        return Line::AneCompileFailed;
    }
    if let Some(f) = match_template(line, KV_CONTEXT_LINE)
        .or_else(|| match_template(line, &format!("{KV_CONTEXT_LINE} — {{}}")))
    {
        if let Ok(ctx) = f[0].parse() {
            return Line::Context(ctx);
        }
    }
    let Some(tag) = RUNTIME_TAGS.iter().find(|t| line.starts_with(**t)) else {
        return Line::Other;
    };
    if let Some(f) = match_template(line, LAYOUT_LINE) {
        let name = format!("{}-chunk", f[0]);
        return match RUNTIME_LAYOUTS.iter().find(|l| l.name == name) {
            Some(l) => Line::Layout(l.kind, Runtime::Merged),
            None => Line::Unparsed(format!(
                "decode layout '{name}' is none of {}",
                RUNTIME_LAYOUTS
                    .iter()
                    .map(|l| l.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        };
    }
    if let Some((kind, _)) = main_lines().find(|(_, t)| match_template(line, t).is_some()) {
        return Line::Layout(kind, Runtime::Main);
    }
    if match_template(line, MAIN_TOPOLOGY_I_LINE).is_some() {
        return Line::ForeignLayout("Topology I (chunk*_topoI packages)".into());
    }
    if let Some(f) = match_template(line, AUDIT_SUMMARY) {
        return match (count(f[0]), count(f[1])) {
            (Some(off), Some(total)) if off <= total => Line::AuditSummary { off, total },
            _ => Line::Unparsed(format!(
                "summary counts {}/{} are not whole numbers with off <= total",
                f[0], f[1]
            )),
        };
    }
    let audit = match_template(line, AUDIT_ALL)
        .map(|f| (f[0], Some("0"), f[1]))
        .or_else(|| match_template(line, AUDIT_SOME).map(|f| (f[0], Some(f[1]), f[2])));
    if let Some((chunk, off, total)) = audit {
        return match (off.and_then(count), count(total)) {
            (Some(off), Some(total)) if off <= total => Line::Audit {
                chunk: chunk.to_string(),
                off,
                total,
            },
            _ => Line::Unparsed(format!(
                "{chunk}'s op counts are not whole numbers with off <= total"
            )),
        };
    }
    if let Some(f) = match_template(line, AUDIT_LOAD_FAILED) {
        return Line::AuditFailed {
            chunk: f[0].to_string(),
            why: format!("failed to load plan — {}", f[1]),
        };
    }
    if let Some(f) = match_template(line, AUDIT_NOT_A_PROGRAM) {
        return Line::AuditFailed {
            chunk: f[0].to_string(),
            why: "model structure is not a program".into(),
        };
    }
    for (ptag, template) in PROFILE_LINES.iter() {
        if let Some(f) = match_template(line, template) {
            let tok = f.last().and_then(|v| v.parse::<f64>().ok());
            return match tok {
                Some(tok_s) if tok_s.is_finite() && tok_s > 0.0 => {
                    Line::Profile { tag: ptag, tok_s }
                }
                _ => Line::Unparsed(format!(
                    "tok/s is {}, not a positive number",
                    f.last().unwrap_or(&"")
                )),
            };
        }
    }
    if KNOWN.iter().any(|t| match_template(line, t).is_some()) {
        return Line::Known;
    }
    let profile = PROFILE_LINES
        .iter()
        .find(|(t, _)| line.starts_with(&format!("{t} ")));
    Line::Unparsed(match profile {
        Some((t, template)) => format!(
            "not the runtime's {t} line, which reads `{}`",
            show_template(template)
        ),
        None => format!("no {tag} line the runtime prints has this form"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_match_fields_and_numbers() {
        assert_eq!(
            match_template("[Load] chunk1 done in 1.2s", "[Load] {} done in {n}s"),
            Some(vec!["chunk1", "1.2"])
        );
        assert_eq!(
            match_template("[Load] chunk1 done in fast", "[Load] {} done in {n}s"),
            None
        );
        // Literal braces are text.
        let t = "[Load] LLM_3CHUNK_TOPO=I requested but chunk{1,2,3}_topoI not found — x";
        assert_eq!(
            match_template(
                t,
                "[Load] LLM_3CHUNK_TOPO=I requested but chunk{1,2,3}_topoI not found — {}"
            ),
            Some(vec!["x"])
        );
        // No fields: the whole line.
        assert!(match_template("[a] b", "[a] b").is_some());
        assert!(match_template("[a] b c", "[a] b").is_none());
    }

    #[test]
    fn the_seeds_lines() {
        assert_eq!(
            parse_line("[Profile-2chunk] emb=0.4ms mask=0.3ms | m1=13.1 m2=17.8 (sum=30.9ms) | predict=31.2ms (31.7 tok/s)"),
            Line::Profile { tag: "[Profile-2chunk]", tok_s: 31.7 }
        );
        assert_eq!(
            parse_line("[Load] Decode layout: two-chunk"),
            Line::Layout(LayoutKind::Two, Runtime::Merged)
        );
        assert_eq!(
            parse_line("[ComputePlan] merged_chunk2: 42/1683 ops NOT on Neural Engine"),
            Line::Audit {
                chunk: "merged_chunk2".into(),
                off: 42,
                total: 1683
            }
        );
        assert_eq!(
            parse_line("[ComputePlan] merged_chunk1: all 1247 ops on Neural Engine"),
            Line::Audit {
                chunk: "merged_chunk1".into(),
                off: 0,
                total: 1247
            }
        );
        assert_eq!(
            parse_line(
                "[ComputePlan] ── summary: 42 non-ANE op(s) out of 2930 total across all chunks"
            ),
            Line::AuditSummary {
                off: 42,
                total: 2930
            }
        );
        assert_eq!(
            parse_line("ANE model load has failed for on-device compiled macho. Must re-compile the E5 bundle."),
            Line::AneCompileFailed
        );
        // The seed's annotated example and its expected-shape template are not runtime output.
        assert!(matches!(
            parse_line(
                "[ComputePlan] merged_chunk2: 42/1683 ops NOT on Neural Engine     ← red flag"
            ),
            Line::Unparsed(_)
        ));
        let Line::Unparsed(why) = parse_line(
            "[Profile-2chunk] emb=0.0ms mask=0.0ms | m1=~20 m2=~20 (sum=~40ms) | predict=~40ms (~25 tok/s → target ~45 tok/s)",
        ) else {
            panic!("the seed's template line parsed");
        };
        assert!(why.contains("[Profile-2chunk] emb=…ms"), "{why}");
    }

    #[test]
    fn other_runtime_lines() {
        assert_eq!(parse_line("[Load] merged_full done in 12.5s"), Line::Known);
        assert_eq!(
            parse_line("[Load] Topology II — 3-chunk default (chunk1 + chunk2_3way[L8-24 merged] + chunk3_3way[L25-34+head])"),
            Line::Layout(LayoutKind::Three, Runtime::Main)
        );
        assert_eq!(
            parse_line("[Load] 4-chunk decode (legacy bundle, no chunk2_3way/chunk3_3way present)"),
            Line::Layout(LayoutKind::Four, Runtime::Main)
        );
        assert_eq!(
            parse_line("[KV] Allocating IOSurface-backed KV cache buffers (ctx=2048)"),
            Line::Context(2048)
        );
        assert_eq!(
            parse_line("[KV] Allocating IOSurface-backed KV cache buffers (ctx=8192) — 4 slots"),
            Line::Context(8192)
        );
        assert!(matches!(
            parse_line("[Load] Decode layout: five-chunk"),
            Line::Unparsed(_)
        ));
        assert!(matches!(
            parse_line("[Load] something new"),
            Line::Unparsed(_)
        ));
        assert!(matches!(
            parse_line("[ComputePlan] chunk1: 9/3 ops NOT on Neural Engine"),
            Line::Unparsed(_)
        ));
        assert!(matches!(
            parse_line("[ComputePlan] merged_full: failed to load plan — Error Domain=x"),
            Line::AuditFailed { .. }
        ));
        assert_eq!(parse_line("Loading model…"), Line::Other);
        assert_eq!(parse_line("[ANE/CPU] ANE_wait=1.0ms"), Line::Other);
    }
}
