//! `chunkforge build`: plan, then for every chunk load → trace → convert →
//! palettize → save, each phase timed under its own spinner; all packages are
//! staged and moved into the output folder together when every one succeeded.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use pyo3::prelude::*;
use serde_json::{json, Value};
use sha2::Digest;

use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::fsutil::{self, Staging};
use crate::plan::{ChunkPlan, LayoutKind, Plan};
use crate::progress::BuildProgress;
use crate::publish::{OnLocked, OutputLock};
use crate::pyenv;

/// Conversion settings; the defaults are the ones that shipped.
#[derive(Clone, Debug)]
pub struct Settings {
    pub ctx: usize,
    pub quantize: bool,
    pub nbits: u32,
    pub group_size: usize,
    pub kmeans_workers: usize,
    pub verbose: bool,
    // palette: "chunkforge" (Rust kernel, default) or "coremltools" (its k-means).
    pub palettizer: String,
    /// When another run holds the output folder's lock; None: the output is
    /// a fresh temporary folder of this run (`--check`, `bench build`), unlocked.
    pub lock: Option<OnLocked>,
}

impl Settings {
    fn to_json(&self) -> Value {
        json!({
            "ctx": self.ctx,
            "minimum_deployment_target": "iOS18",
            "compute_precision": "FLOAT16",
            "compute_units": "CPU_AND_NE",
            "quantize": self.quantize,
            "palettization": if self.quantize {
                json!({"nbits": self.nbits, "granularity": "per_grouped_channel", "group_size": self.group_size,
                       "palettizer": self.palettizer,
                       "mode": if self.palettizer == "chunkforge" { "custom (chunkforge optimal LUT)" } else { "kmeans" },
                       "kmeans_workers": self.kmeans_workers})
            } else { Value::Null },
        })
    }
}

const PHASES: [&str; 6] = ["load", "trace", "convert", "palettize", "save", "bundle"];

/// Runs one Python phase under a spinner and returns its result and seconds.
fn phase<'py>(
    progress: &BuildProgress,
    label: String,
    f: impl FnOnce() -> PyResult<Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyAny>, f64)> {
    let pb = progress.phase(label);
    let t = Instant::now();
    let r = f();
    pb.finish_and_clear();
    r.map(|v| (v, t.elapsed().as_secs_f64()))
}

pub struct BuildReport {
    pub json: Value,
}

pub fn run(
    hf_dir: &Path,
    cfg: &TextConfig,
    ckpt: &Checkpoint,
    plan: &Plan,
    plan_args: Value,
    out: &Path,
    settings: &Settings,
) -> Result<BuildReport> {
    let started = Instant::now();
    fsutil::output_folder(out)?;
    let _lock = settings
        .lock
        .map(|on_locked| OutputLock::take(out, on_locked))
        .transpose()?;
    let staging = Staging::new(out)?;
    let units = units(plan);
    let packages: usize = units.iter().map(Vec::len).sum();
    let progress = BuildProgress::new(packages as u64);
    for w in &plan.warnings {
        progress.println(format!("warning: {w}"));
    }
    let plan_json = serde_json::to_value(plan)?;
    let ckpt_json = json!({
        "prefix": ckpt.prefix,
        "files": ckpt.files.iter().map(|(k, v)| (k.clone(), Value::String(v.to_string_lossy().into()))).collect::<serde_json::Map<_, _>>(),
    });
    // `layouts`: each function of each layout holds every weight of its layers
    // once, so the palettization cache keeps a result until that many
    // conversions have used it.
    let settings_json = json!({
        "nbits": settings.nbits, "group_size": settings.group_size, "kmeans_workers": settings.kmeans_workers,
        "palettizer": settings.palettizer,
        "layouts": plan.layouts.iter().map(|l| l.chunks.first().map_or(0, |c| c.functions.len())).sum::<usize>(),
    });
    let verbose = settings.verbose;

    let mut records = Vec::new();
    for unit in &units {
        let names: Vec<&str> = unit.iter().map(|(_, c)| c.name.as_str()).collect();
        let (first, last) = (unit[0].1.first_layer, unit[0].1.last_layer);
        progress
            .bar
            .set_message(format!("{} (layers {first}-{last})", names.join(" + ")));
        // One program per function; a unit of several functions is bundled
        // from single-function parts (see `convert.combine`).
        let bundled = unit.len() > 1 || unit[0].1.functions.len() > 1;
        let part_path = |pkg: &str, f: &str| staging.dir.join(format!(".part-{pkg}-{f}.mlpackage"));
        let mut parts = Vec::new();
        let mut done = Vec::new();
        for (layout, chunk) in unit {
            let name = &chunk.name;
            let mut functions = Vec::new();
            let mut seconds: BTreeMap<&str, f64> = BTreeMap::new();
            let mut stats = Value::Null;
            for f in &chunk.functions {
                let label = if chunk.functions.len() > 1 {
                    format!("{name}/{}", f.name)
                } else {
                    name.clone()
                };
                let path = if bundled {
                    part_path(name, &f.name)
                } else {
                    staging.dir.join(format!("{name}.mlpackage"))
                };
                let (fstats, fsecs) = convert_function(
                    &progress,
                    &label,
                    &plan_json,
                    &ckpt_json,
                    &settings_json,
                    settings,
                    name,
                    (chunk.functions.len() > 1).then_some(f.name.as_str()),
                    &path,
                )
                .map_err(|e| anyhow!("building {label}: {}", pyenv::render_error(e, verbose)))?;
                for (k, v) in &fsecs {
                    *seconds.entry(k).or_default() += v;
                }
                functions.push(json!({
                    "name": f.name,
                    "kind": f.kind,
                    "tokens": f.tokens,
                    "mil_ops": fstats["mil_ops"],
                    "weight_bytes": fstats["weight_bytes"],
                    "seconds": fsecs,
                }));
                stats = merge_stats(stats, fstats);
                parts.push((path.to_string_lossy().into_owned(), f.name.clone()));
            }
            done.push((layout, *chunk, functions, seconds, stats));
        }
        if bundled {
            let t = Instant::now();
            let pb = progress.phase(format!(
                "{}: bundle {} functions",
                names.join(" + "),
                parts.len()
            ));
            let targets: Vec<(String, Vec<String>)> = unit
                .iter()
                .map(|(_, c)| {
                    (
                        staging
                            .dir
                            .join(format!("{}.mlpackage", c.name))
                            .to_string_lossy()
                            .into_owned(),
                        c.functions.iter().map(|f| f.name.clone()).collect(),
                    )
                })
                .collect();
            let sizes = Python::attach(|py| -> PyResult<Value> {
                let conv = py.import("chunkforge_py.convert")?;
                pyenv::from_py(&conv.call_method1("combine", (parts.clone(), targets))?)
            })
            .map_err(|e| {
                anyhow!(
                    "bundling {}: {}",
                    names.join(" + "),
                    pyenv::render_error(e, verbose)
                )
            });
            pb.finish_and_clear();
            let sizes = sizes?;
            for (path, _) in &parts {
                std::fs::remove_dir_all(path).with_context(|| format!("{path}: cannot remove"))?;
            }
            // The bundle's seconds are shared by its packages.
            let share = t.elapsed().as_secs_f64() / unit.len() as f64;
            for d in &mut done {
                d.4["weight_bytes"] = sizes["weight_bytes"].clone();
                d.3.insert(PHASES[5], share);
            }
        }
        for (layout, chunk, functions, seconds, stats) in done {
            let pkg = format!("{}.mlpackage", chunk.name);
            let digest = fsutil::tree_digest(&staging.dir.join(&pkg))?;
            let total: f64 = seconds.values().sum();
            progress.println(format!(
                "built {pkg:<28} layers {:>2}-{:<2} {:>5} MIL ops {:>11} weight bytes  {total:>6.1}s",
                chunk.first_layer, chunk.last_layer, stats["mil_ops"], stats["weight_bytes"]
            ));
            records.push(json!({
                "name": chunk.name,
                "layout": layout,
                "package": pkg,
                "first_layer": chunk.first_layer,
                "last_layer": chunk.last_layer,
                "layers": chunk.layer_count(),
                "mil_ops": stats["mil_ops"],
                "weight_bytes": stats["weight_bytes"],
                "linear_ops": stats["linear_ops"],
                "palettized_weights": stats["palettized_weights"],
                // palette: weights served from the per-build palettization cache.
                "palettize_cache_hits": stats["palettize_cache_hits"],
                "palettize_cache_misses": stats["palettize_cache_misses"],
                // Groups of weights not matched to a module tensor (palettized
                // one by one, uncached); 0 for every Gemma 4 chunk.
                "palettize_unmatched_groups": stats["palettize_unmatched_groups"],
                "op_counts": stats["op_counts"],
                // Per function: its own program's ops and single-function blob size
                // (a multifunction package's blob holds each shared weight once).
                "functions": functions,
                "sha256_tree": digest,
                "seconds": seconds,
            }));
            progress.bar.inc(1);
        }
    }
    progress.bar.finish_and_clear();

    let versions = pyenv::call_json("runtime", "versions", &Value::Null, verbose)?;
    let config_sha = fsutil::sha256_file(&hf_dir.join("config.json"))?;
    // Absolute, so `build --check` finds the same checkpoint from any folder.
    let recorded_dir = std::path::absolute(hf_dir)
        .with_context(|| format!("{}: cannot make the path absolute", hf_dir.display()))?;
    let mut phase_totals: BTreeMap<&str, f64> = BTreeMap::new();
    for r in &records {
        for (k, v) in r["seconds"].as_object().into_iter().flatten() {
            if let Some(p) = PHASES.iter().find(|p| *p == k) {
                *phase_totals.entry(p).or_default() += v.as_f64().unwrap_or(0.0);
            }
        }
    }
    let tree: String = records
        .iter()
        .map(|r| {
            format!(
                "{}\0{}\n",
                r["package"].as_str().unwrap_or(""),
                r["sha256_tree"].as_str().unwrap_or("")
            )
        })
        .collect();
    let report = json!({
        "format": "chunkforge-build/1",
        "tree_sha256": pyenv::hex(&sha2::Sha256::digest(tree.as_bytes())),
        "tool": {"chunkforge": env!("CARGO_PKG_VERSION"), "python": versions},
        "checkpoint": {
            "dir": recorded_dir.to_string_lossy(),
            "architecture": cfg.architecture,
            "multimodal": cfg.multimodal,
            "config_sha256": config_sha,
            "tensor_prefix": ckpt.prefix,
            "skipped_tensors": ckpt.skipped,
        },
        "request": plan_args,
        "settings": settings.to_json(),
        "plan": plan_json,
        "chunks": records,
        "seconds": {"total": started.elapsed().as_secs_f64(), "phases": phase_totals},
        // palette: totals of the per-package cache counts.
        "palettize_cache": {
            "hits": records.iter().filter_map(|r| r["palettize_cache_hits"].as_u64()).sum::<u64>(),
            "misses": records.iter().filter_map(|r| r["palettize_cache_misses"].as_u64()).sum::<u64>(),
        },
        "peak_rss_bytes": fsutil::peak_rss_bytes(),
    });
    // All packages, then build.json last, as one publish: a reader that sees
    // the new build.json sees every package it lists, and a run killed
    // before the end has them all put back by the next run.
    let bytes = serde_json::to_vec_pretty(&report)?;
    fsutil::write_atomic(&staging.dir.join("build.json"), &bytes)?;
    let mut names: Vec<&str> = records
        .iter()
        .map(|r| r["package"].as_str().expect("set above"))
        .collect();
    names.push("build.json");
    staging.publish_names(&names)?;
    staging.finish()?;
    Ok(BuildReport { json: report })
}

/// Packages converted together: each alone, except a four-chunk package and
/// the prefill package of the same layers, which are bundled from one set of
/// programs so their weight blobs are byte-identical (the runtime's
/// downloader hard-links `chunkN`'s blob into `prefill_chunkN`).
fn units(plan: &Plan) -> Vec<Vec<(&'static str, &ChunkPlan)>> {
    let prefill: Vec<&ChunkPlan> = plan
        .layouts
        .iter()
        .filter(|l| l.kind == LayoutKind::Prefill)
        .flat_map(|l| &l.chunks)
        .collect();
    let partner = |c: &ChunkPlan| {
        prefill
            .iter()
            .copied()
            .find(|p| (p.first_layer, p.last_layer) == (c.first_layer, c.last_layer))
    };
    let has_four = plan.layouts.iter().any(|l| l.kind == LayoutKind::Four);
    let mut units = Vec::new();
    for l in &plan.layouts {
        for c in &l.chunks {
            match l.kind {
                LayoutKind::Four => {
                    let mut unit = vec![(l.kind.label(), c)];
                    unit.extend(partner(c).map(|p| (LayoutKind::Prefill.label(), p)));
                    units.push(unit);
                }
                LayoutKind::Prefill if has_four => {}
                _ => units.push(vec![(l.kind.label(), c)]),
            }
        }
    }
    units
}

/// Load → trace → convert (→ palettize) → save of one function of `name` into
/// `path`; returns its stats and seconds per phase.
#[allow(clippy::too_many_arguments)]
fn convert_function(
    progress: &BuildProgress,
    label: &str,
    plan_json: &Value,
    ckpt_json: &Value,
    settings_json: &Value,
    settings: &Settings,
    name: &str,
    function: Option<&str>,
    path: &Path,
) -> PyResult<(Value, BTreeMap<&'static str, f64>)> {
    Python::attach(|py| {
        let conv = py.import("chunkforge_py.convert")?;
        let plan_py = pyenv::to_py(py, plan_json)?;
        let ckpt_py = pyenv::to_py(py, ckpt_json)?;
        let mut secs = BTreeMap::new();
        let (module, s) = phase(progress, format!("{label}: load weights"), || {
            conv.call_method1("load", (&plan_py, name, &ckpt_py, function))
        })?;
        secs.insert(PHASES[0], s);
        let (traced, s) = phase(progress, format!("{label}: trace"), || {
            conv.call_method1("trace", (&module,))
        })?;
        secs.insert(PHASES[1], s);
        drop(module);
        // The kernel palettizes inside ct.convert (its seconds are split
        // out of the conversion's below); coremltools' k-means runs on
        // the converted model.
        let in_convert = settings.quantize && settings.palettizer == "chunkforge";
        let sp = pyenv::to_py(py, settings_json)?;
        let int4 = format!("INT4 per_grouped_channel, group {}", settings.group_size);
        let what = if in_convert {
            format!("{label}: convert + palettize (ct.convert, iOS18, FP16, {int4})")
        } else {
            format!("{label}: convert (ct.convert, iOS18, FP16)")
        };
        let (mut ml, s) = phase(progress, what, || {
            let palettize = in_convert.then_some(&sp);
            conv.call_method1("convert", (&traced, &plan_py, name, palettize, function))
        })?;
        secs.insert(PHASES[2], s);
        drop(traced);
        if settings.quantize && !in_convert {
            let (p, s) = phase(progress, format!("{label}: palettize ({int4})"), || {
                conv.call_method1("palettize", (&ml, &plan_py, name, &sp))
            })?;
            ml = p;
            secs.insert(PHASES[3], s);
        }
        let (stats, s) = phase(progress, format!("{label}: save"), || {
            conv.call_method1("save", (&ml, path.to_string_lossy().to_string()))
        })?;
        secs.insert(PHASES[4], s);
        let stats = pyenv::from_py(&stats)?;
        if let Some(k) = stats["palettize_seconds"].as_f64() {
            // Kernel time inside the conversion: reported as palettize.
            let convert = secs.entry(PHASES[2]).or_default();
            *convert = (*convert - k).max(0.0);
            secs.insert(PHASES[3], k);
        }
        Ok((stats, secs))
    })
}

/// A package's counts over its functions: ops, palettized weights and cache
/// counts add up; the weight blob is the bundle's, set by the caller.
fn merge_stats(acc: Value, f: Value) -> Value {
    if acc.is_null() {
        return f;
    }
    let mut acc = acc;
    for key in [
        "mil_ops",
        "linear_ops",
        "palettized_weights",
        "palettize_cache_hits",
        "palettize_cache_misses",
        "palettize_unmatched_groups",
    ] {
        if let (Some(a), Some(b)) = (acc[key].as_u64(), f[key].as_u64()) {
            acc[key] = json!(a + b);
        }
    }
    let mut counts = acc["op_counts"].as_object().cloned().unwrap_or_default();
    for (op, n) in f["op_counts"].as_object().into_iter().flatten() {
        let prev = counts.get(op).and_then(Value::as_u64).unwrap_or(0);
        counts.insert(op.clone(), json!(prev + n.as_u64().unwrap_or(0)));
    }
    acc["op_counts"] = Value::Object(counts);
    acc
}

/// Total of a phase across chunks, for the summary line.
pub fn summary(report: &Value, out: &Path) -> String {
    let secs = &report["seconds"];
    let phases = secs["phases"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k} {:.1}s", v.as_f64().unwrap_or(0.0)))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    format!(
        "wrote {} packages to {} in {:.1}s ({phases}); peak RSS {:.0} MiB",
        report["chunks"].as_array().map_or(0, Vec::len),
        out.display(),
        secs["total"].as_f64().unwrap_or(0.0),
        report["peak_rss_bytes"].as_f64().unwrap_or(0.0) / (1024.0 * 1024.0)
    )
}

/// The checkpoint, layout request and quantization of an earlier build, from its build.json.
#[allow(clippy::type_complexity)]
pub fn request_of(
    build_json: &Path,
    hf_override: &Option<std::path::PathBuf>,
) -> Result<(
    Option<std::path::PathBuf>,
    (crate::plan::Mode, Option<String>, usize),
    bool,
    String,
)> {
    let text = std::fs::read(build_json)
        .with_context(|| format!("{}: cannot read", build_json.display()))?;
    let v: Value = serde_json::from_slice(&text)
        .with_context(|| format!("{}: not valid JSON", build_json.display()))?;
    let bad = |what: &str| {
        anyhow!(
            "{}: {what} missing or invalid (not a chunkforge build.json?)",
            build_json.display()
        )
    };
    let mode = match v["request"]["mode"]
        .as_str()
        .ok_or_else(|| bad("request.mode"))?
    {
        "four" => crate::plan::Mode::Four,
        "three" => crate::plan::Mode::Three,
        "two" => crate::plan::Mode::Two,
        "one" => crate::plan::Mode::One,
        "both" => crate::plan::Mode::Both,
        "all" => crate::plan::Mode::All,
        _ => return Err(bad("request.mode")),
    };
    let split = v["request"]["split"].as_str().map(str::to_string);
    let ctx = v["request"]["ctx"]
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| bad("request.ctx"))?;
    crate::args::check_ctx(ctx)
        .map_err(|e| anyhow!("{}: request.ctx {e}", build_json.display()))?;
    let quantize = v["settings"]["quantize"]
        .as_bool()
        .ok_or_else(|| bad("settings.quantize"))?;
    let hf = match hf_override {
        Some(p) => Some(p.clone()),
        None => {
            let recorded = Path::new(
                v["checkpoint"]["dir"]
                    .as_str()
                    .ok_or_else(|| bad("checkpoint.dir"))?,
            );
            // Builds record an absolute path; a relative one (hand-written, or
            // from an older chunkforge) is taken relative to build.json, never
            // to the folder `--check` happens to run in.
            let base = build_json.parent().unwrap_or(Path::new(""));
            let dir = base.join(recorded);
            if !dir.is_dir() {
                bail!(
                    "{}: checkpoint.dir `{}` ({}) is not a folder; pass --hf-dir to say where the checkpoint is now",
                    build_json.display(),
                    recorded.display(),
                    dir.display()
                );
            }
            Some(dir)
        }
    };
    let palettizer = v["settings"]["palettization"]["palettizer"]
        .as_str()
        .unwrap_or("chunkforge")
        .to_string();
    Ok((hf, (mode, split, ctx), quantize, palettizer))
}

/// The verify and prefill requests of an earlier build (absent in builds
/// from before they existed: none asked for).
pub fn functions_of(build_json: &Path) -> Result<(Option<usize>, Option<Vec<usize>>)> {
    let text = std::fs::read(build_json)
        .with_context(|| format!("{}: cannot read", build_json.display()))?;
    let v: Value = serde_json::from_slice(&text)
        .with_context(|| format!("{}: not valid JSON", build_json.display()))?;
    let request = &v["request"];
    let verify_k = request["verify_k"].as_u64().map(|k| k as usize);
    let prefill = request["prefill_len"].as_array().map(|a| {
        a.iter()
            .filter_map(Value::as_u64)
            .map(|n| n as usize)
            .collect()
    });
    Ok((verify_k, prefill))
}

/// Compares the packages of `old` with a fresh build in `fresh_dir`, printing
/// every package and, for a differing one, every differing file.
pub fn compare(old: &Path, fresh_dir: &Path, fresh: &Value) -> Result<bool> {
    let mut same = true;
    for c in fresh["chunks"].as_array().into_iter().flatten() {
        let pkg = c["package"].as_str().unwrap_or("");
        let a = old.join(pkg);
        let b = fresh_dir.join(pkg);
        if !a.exists() {
            println!("{pkg}: MISSING in {}", old.display());
            same = false;
            continue;
        }
        let da = fsutil::tree_digest(&a)?;
        let db = c["sha256_tree"].as_str().unwrap_or("").to_string();
        if da == db {
            println!("{pkg}: identical ({})", &da[..16]);
            continue;
        }
        same = false;
        println!("{pkg}: DIFFERS");
        let (fa, fb) = (fsutil::file_digests(&a)?, fsutil::file_digests(&b)?);
        for (rel, h) in &fa {
            match fb.get(rel) {
                Some(h2) if h2 == h => {}
                Some(_) => println!("    {rel}: content differs"),
                None => println!("    {rel}: only in {}", old.display()),
            }
        }
        for rel in fb.keys().filter(|k| !fa.contains_key(*k)) {
            println!("    {rel}: only in the fresh build");
        }
    }
    Ok(same)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relative_checkpoint_dir_is_taken_relative_to_build_json() {
        let root = std::env::temp_dir().join(format!("cf-request-of-{}", std::process::id()));
        let out = root.join("out");
        std::fs::create_dir_all(root.join("ck")).unwrap();
        std::fs::create_dir_all(&out).unwrap();
        let write_ctx = |dir: &str, ctx: u64| {
            let v = json!({
                "request": {"mode": "one", "split": null, "ctx": ctx},
                "settings": {"quantize": false},
                "checkpoint": {"dir": dir},
            });
            std::fs::write(out.join("build.json"), v.to_string()).unwrap();
        };
        let write = |dir: &str| write_ctx(dir, 64);
        write("../ck");
        let (hf, ..) = request_of(&out.join("build.json"), &None).unwrap();
        assert_eq!(hf.unwrap(), out.join("../ck"));
        write("../gone");
        let e = request_of(&out.join("build.json"), &None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("checkpoint.dir `../gone`") && e.contains("pass --hf-dir"),
            "{e}"
        );
        // A context no build could have had (--ctx refuses it) is refused here too.
        write_ctx("../ck", 1 << 40);
        let e = request_of(&out.join("build.json"), &None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("request.ctx 1099511627776 is out of range"),
            "{e}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
