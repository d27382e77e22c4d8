//! `chunkforge build`: plan, then for every chunk load → trace → convert →
//! palettize → save, each phase timed under its own spinner; all packages are
//! staged and moved into the output folder together when every one succeeded.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;

use crate::audit;
use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::hashing;
use crate::plan::{ChunkPlan, FunctionKind, Functions, LayoutKind, Mode, Plan};
use crate::progress::{self, BuildProgress};
use crate::publish::{OnLocked, OutputLock};
use crate::py::calls::{self, CheckpointFiles, ChunkJob, WeightCache};
use crate::py::env as pyenv;
use crate::records::{
    BuildRecord, BuildRequest, BuildSeconds, CacheTotals, CheckpointRecord, ChunkRecord,
    ChunkStats, ConversionSettings, FunctionRecord, Palettizer, PassPipeline, Seconds,
    ToolVersions, BUILD_FORMAT,
};
use crate::staging::{self, Staging};

/// How to build: the conversion settings handed to Python, and the run's own options.
#[derive(Clone, Debug)]
pub struct Settings {
    pub conversion: ConversionSettings,
    /// Time every coremltools graph pass into each function's record.
    pub profile: bool,
    pub verbose: bool,
    /// When another run holds the output folder's lock; None: the output is
    /// a fresh temporary folder of this run (`--check`, `bench build`), unlocked.
    pub lock: Option<OnLocked>,
}

/// The phase the bundle of a multifunction package is timed under.
const BUNDLE: &str = "bundle";

pub fn run(
    hf_dir: &Path,
    cfg: &TextConfig,
    ckpt: &Checkpoint,
    plan: &Plan,
    request: BuildRequest,
    out: &Path,
    settings: &Settings,
) -> Result<BuildRecord> {
    let started = Instant::now();
    staging::output_folder(out)?;
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
    let checkpoint = CheckpointFiles::of(ckpt);
    let verbose = settings.verbose;
    // Decode packages the four-chunk layout tiles are composed from its
    // programs (see `Composer`), not converted.
    let mut composer = Composer::new(cfg, plan, &settings.conversion, &staging.dir)?;
    // Each function of each converted layout holds every weight of its layers
    // once (the composer's own sources: one more), so the build's
    // palettization cache keeps a result until that many conversions have
    // used it. The cache lives as long as this run.
    let uses: usize = plan
        .layouts
        .iter()
        .filter(|l| !l.chunks.iter().all(|c| composer.composes(l.kind, c)))
        .map(|l| l.chunks.first().map_or(0, |c| c.functions.len()))
        .sum::<usize>()
        + usize::from(composer.converts_sources(plan));
    let cache = WeightCache::new(uses)
        .map_err(|e| anyhow!("palettization cache: {}", pyenv::render_error(e, verbose)))?;

    let mut records: Vec<ChunkRecord> = Vec::new();
    for unit in &units {
        let names: Vec<&str> = unit.iter().map(|(_, c)| c.name.as_str()).collect();
        let (first, last) = (unit[0].1.first_layer, unit[0].1.last_layer);
        progress
            .bar
            .set_message(format!("{} (layers {first}-{last})", names.join(" + ")));
        if let [(layout, chunk)] = unit[..] {
            if composer.composes(layout, chunk) {
                let (functions, seconds, stats, from) =
                    composer.compose(chunk, &checkpoint, &cache, settings, &progress)?;
                records.push(record(
                    &staging.dir,
                    layout,
                    chunk,
                    functions,
                    seconds,
                    stats,
                    Some(from),
                    &progress,
                )?);
                continue;
            }
        }
        // One program per function; a unit of several functions is bundled
        // from single-function parts (see `convert.combine`).
        let bundled = unit.len() > 1 || unit[0].1.functions.len() > 1;
        let part_path = |pkg: &str, f: &str| staging.dir.join(format!(".part-{pkg}-{f}.mlpackage"));
        let mut parts = Vec::new();
        let mut done = Vec::new();
        for (layout, chunk) in unit {
            let name = &chunk.name;
            let paths: Vec<PathBuf> = chunk
                .functions
                .iter()
                .map(|f| {
                    if bundled {
                        part_path(name, &f.name)
                    } else {
                        staging.dir.join(format!("{name}.mlpackage"))
                    }
                })
                .collect();
            let job = ChunkJob {
                dims: &plan.dims,
                chunk,
                checkpoint: &checkpoint,
                settings: &settings.conversion,
                paths: paths
                    .iter()
                    .map(|p| p.to_string_lossy().into_owned())
                    .collect(),
                profile: settings.profile,
            };
            let converted = calls::convert_chunk(&job, &cache, &progress).map_err(|e| {
                let function = e.function.as_deref().unwrap_or(name);
                anyhow!(
                    "building {function}: {}",
                    pyenv::render_error(e.error, verbose)
                )
            })?;
            let mut functions = Vec::new();
            let mut seconds = Seconds::new();
            let mut stats: Option<ChunkStats> = None;
            for (f, c) in chunk.functions.iter().zip(converted.functions) {
                for (k, v) in &c.seconds {
                    *seconds.entry(k.clone()).or_default() += v;
                }
                functions.push(FunctionRecord {
                    name: f.name.clone(),
                    kind: f.kind,
                    tokens: f.tokens,
                    mil_ops: c.stats.mil_ops,
                    weight_bytes: c.stats.weight_bytes,
                    seconds: c.seconds,
                    passes: c.passes,
                });
                match &mut stats {
                    None => stats = Some(c.stats),
                    Some(acc) => acc.add(&c.stats),
                }
            }
            for (f, path) in chunk.functions.iter().zip(&paths) {
                parts.push((path.to_string_lossy().into_owned(), f.name.clone()));
            }
            if *layout == LayoutKind::Four {
                composer.converted(chunk, &paths);
            }
            let stats = stats.expect("every chunk has a function");
            done.push((*layout, *chunk, functions, seconds, stats));
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
            let bundle = calls::combine(&parts, &targets, settings.conversion.pass_pipeline)
                .map_err(|e| {
                    anyhow!(
                        "bundling {}: {}",
                        names.join(" + "),
                        pyenv::render_error(e, verbose)
                    )
                });
            pb.finish_and_clear();
            let bundle = bundle?;
            for (path, _) in &parts {
                // A four-chunk decode program the composer reads stays until the build ends.
                if !composer.keeps(Path::new(path)) {
                    std::fs::remove_dir_all(path)
                        .with_context(|| format!("{path}: cannot remove"))?;
                }
            }
            // The bundle's seconds are shared by its packages.
            let share = t.elapsed().as_secs_f64() / unit.len() as f64;
            for d in &mut done {
                d.4.weight_bytes = bundle.weight_bytes;
                d.3.insert(BUNDLE.to_string(), share);
            }
        }
        for (layout, chunk, functions, seconds, stats) in done {
            records.push(record(
                &staging.dir,
                layout,
                chunk,
                functions,
                seconds,
                stats,
                None,
                &progress,
            )?);
        }
    }
    progress.bar.finish_and_clear();

    let versions = calls::versions(verbose)?;
    let config_sha = hashing::sha256_file(&hf_dir.join("config.json"))?;
    // Absolute, so `build --check` finds the same checkpoint from any folder.
    let recorded_dir = std::path::absolute(hf_dir)
        .with_context(|| format!("{}: cannot make the path absolute", hf_dir.display()))?;
    let mut phases = Seconds::new();
    for r in &records {
        for (k, v) in &r.seconds {
            *phases.entry(k.clone()).or_default() += v;
        }
    }
    if composer.sources_seconds > 0.0 {
        phases.insert(SOURCES.to_string(), composer.sources_seconds);
    }
    let mut record = BuildRecord {
        format: BUILD_FORMAT.into(),
        tree_sha256: hashing::lines_digest(
            records
                .iter()
                .map(|r| (r.package.as_str(), r.sha256_tree.clone())),
        ),
        tool: ToolVersions {
            chunkforge: env!("CARGO_PKG_VERSION").into(),
            python: versions,
        },
        checkpoint: CheckpointRecord {
            dir: recorded_dir.to_string_lossy().into_owned(),
            architecture: cfg.architecture.clone(),
            multimodal: cfg.multimodal,
            config_sha256: config_sha,
            tensor_prefix: Some(ckpt.prefix.clone()),
            skipped_tensors: Some(ckpt.skipped),
        },
        request,
        settings: settings.conversion.clone(),
        plan: plan.clone(),
        // The composer's own sources palettize too.
        palettize_cache: CacheTotals {
            hits: records
                .iter()
                .filter_map(|r| r.palettize_cache_hits)
                .sum::<u64>()
                + composer.cache.hits,
            misses: records
                .iter()
                .filter_map(|r| r.palettize_cache_misses)
                .sum::<u64>()
                + composer.cache.misses,
        },
        chunks: records,
        sources: std::mem::take(&mut composer.sources),
        seconds: BuildSeconds {
            total: started.elapsed().as_secs_f64(),
            phases,
        },
        peak_rss_bytes: progress::peak_rss_bytes(),
        audit: None,
    };
    // The static ANE audit of the staged packages goes into build.json, so
    // `package` can refuse findings without reading the programs again.
    let packages = audit::build_packages(&staging.dir, &record, false);
    let spinner = progress::spinner(format!("audit {} packages", packages.len()));
    let report = audit::run(&packages, verbose);
    spinner.finish_and_clear();
    let audited = report.context("auditing the built packages")?.record();
    eprintln!("{}", audit::summary_line(&audited, packages.len()));
    record.audit = Some(audited);
    // All packages, then build.json last, as one publish: a reader that sees
    // the new build.json sees every package it lists, and a run killed
    // before the end has them all put back by the next run.
    let bytes = serde_json::to_vec_pretty(&record)?;
    staging::write_atomic(&staging.dir.join("build.json"), &bytes)?;
    let mut names: Vec<&str> = record.chunks.iter().map(|r| r.package.as_str()).collect();
    names.push("build.json");
    staging.publish_names(&names)?;
    staging.finish()?;
    Ok(record)
}

/// Writes a package's line and returns its record; `composed_from`: the
/// four-chunk packages it was composed from (None: converted).
#[allow(clippy::too_many_arguments)]
fn record(
    staging: &Path,
    layout: LayoutKind,
    chunk: &ChunkPlan,
    functions: Vec<FunctionRecord>,
    seconds: Seconds,
    stats: ChunkStats,
    composed_from: Option<Vec<String>>,
    progress: &BuildProgress,
) -> Result<ChunkRecord> {
    let pkg = format!("{}.mlpackage", chunk.name);
    let digest = hashing::tree_digest(&staging.join(&pkg))?;
    let total: f64 = seconds.values().sum();
    let how = match &composed_from {
        Some(from) => format!("  (composed from {})", from.join(" + ")),
        None => String::new(),
    };
    progress.println(format!(
        "built {pkg:<28} layers {:>2}-{:<2} {:>5} MIL ops {:>11} weight bytes  {total:>6.1}s{how}",
        chunk.first_layer, chunk.last_layer, stats.mil_ops, stats.weight_bytes
    ));
    progress.bar.inc(1);
    Ok(ChunkRecord {
        name: chunk.name.clone(),
        layout,
        package: pkg,
        first_layer: chunk.first_layer,
        last_layer: chunk.last_layer,
        layers: chunk.layer_count(),
        mil_ops: stats.mil_ops,
        weight_bytes: stats.weight_bytes,
        projection_ops: stats.projection_ops,
        palettized_weights: stats.palettized_weights,
        palettize_cache_hits: stats.palettize_cache_hits,
        palettize_cache_misses: stats.palettize_cache_misses,
        palettize_unmatched_groups: stats.palettize_unmatched_groups,
        op_counts: stats.op_counts,
        functions,
        composed_from,
        sha256_tree: digest,
        seconds,
    })
}

/// The phase a composed package's sources are timed under, when the build
/// converts them only to compose from (no four-chunk layout asked for).
const SOURCES: &str = "sources";

/// Composition: a decode chunk whose layers the four-chunk layout tiles
/// exactly (the three-chunk, two-chunk and one-chunk layouts; a `--split`
/// on four-chunk boundaries) is the four-chunk decode programs back to back,
/// already converted and optimised; `compose.py` joins them at the MIL level
/// instead of converting the layers from torch again. The sources are the
/// four-chunk layout's own decode programs when the build makes it, else
/// converted for this purpose into staging (`.source-chunkN.mlpackage`,
/// never published).
struct Composer {
    enabled: bool,
    /// The four-chunk layout's chunks, each with only its decode function.
    four: Vec<ChunkPlan>,
    /// The plan builds the four-chunk layout itself.
    in_plan: bool,
    /// Each four-chunk chunk's single-function decode package, once there.
    decode: Vec<Option<PathBuf>>,
    dims: crate::plan::Dims,
    staging: PathBuf,
    /// Seconds spent converting sources the build does not ship.
    sources_seconds: f64,
    /// Those conversions' records and palettization cache counts.
    sources: Vec<FunctionRecord>,
    cache: CacheTotals,
}

impl Composer {
    fn new(
        cfg: &TextConfig,
        plan: &Plan,
        conversion: &ConversionSettings,
        staging: &Path,
    ) -> Result<Self> {
        let own = plan.layouts.iter().find(|l| l.kind == LayoutKind::Four);
        let four: Vec<ChunkPlan> = match own {
            Some(l) => l.chunks.clone(),
            None if conversion.compose => {
                crate::plan::plan(
                    cfg,
                    conversion.ctx,
                    Mode::Four,
                    None,
                    &Functions::resolve(Mode::Four, None, None),
                )
                .map_err(|e| anyhow!("planning the four-chunk sources: {e}"))?
                .layouts
                .remove(0)
                .chunks
            }
            None => Vec::new(),
        };
        let four: Vec<ChunkPlan> = four
            .into_iter()
            .map(|mut c| {
                c.functions
                    .retain(|f| f.kind == FunctionKind::Decode && f.tokens == 1);
                c
            })
            .collect();
        Ok(Composer {
            enabled: conversion.compose && four.iter().all(|c| c.functions.len() == 1),
            decode: vec![None; four.len()],
            four,
            in_plan: own.is_some(),
            dims: plan.dims.clone(),
            staging: staging.to_path_buf(),
            sources_seconds: 0.0,
            sources: Vec::new(),
            cache: CacheTotals { hits: 0, misses: 0 },
        })
    }

    /// The four-chunk chunks whose layers are exactly `chunk`'s, in order.
    fn tiling(&self, chunk: &ChunkPlan) -> Option<std::ops::RangeInclusive<usize>> {
        let a = self
            .four
            .iter()
            .position(|c| c.first_layer == chunk.first_layer)?;
        let b = self
            .four
            .iter()
            .position(|c| c.last_layer == chunk.last_layer)?;
        (a <= b).then_some(a..=b)
    }

    /// `chunk` is composed: a decode chunk the four-chunk layout tiles, of
    /// two or more of its chunks, or of one the build converts anyway
    /// (converting a source only to copy it would cost as much as converting
    /// the chunk).
    fn composes(&self, kind: LayoutKind, chunk: &ChunkPlan) -> bool {
        self.enabled
            && !matches!(kind, LayoutKind::Four | LayoutKind::Prefill)
            && matches!(&chunk.functions[..], [f] if f.kind == FunctionKind::Decode && f.tokens == 1)
            && self
                .tiling(chunk)
                .is_some_and(|r| self.in_plan || r.end() > r.start())
    }

    /// The build converts sources it does not ship.
    fn converts_sources(&self, plan: &Plan) -> bool {
        !self.in_plan
            && plan
                .layouts
                .iter()
                .any(|l| l.chunks.iter().any(|c| self.composes(l.kind, c)))
    }

    /// A four-chunk package was converted: `paths` are its functions' packages.
    fn converted(&mut self, chunk: &ChunkPlan, paths: &[PathBuf]) {
        if !self.enabled {
            return;
        }
        if let Some(i) = self.four.iter().position(|c| c.name == chunk.name) {
            let f = chunk
                .functions
                .iter()
                .position(|f| f.kind == FunctionKind::Decode && f.tokens == 1);
            self.decode[i] = f.map(|f| paths[f].clone());
        }
    }

    /// `path` is a source the composer still reads.
    fn keeps(&self, path: &Path) -> bool {
        self.decode.iter().flatten().any(|p| p == path)
    }

    /// Composes `chunk` into staging (converting the sources it still lacks).
    fn compose(
        &mut self,
        chunk: &ChunkPlan,
        checkpoint: &CheckpointFiles,
        cache: &WeightCache,
        settings: &Settings,
        progress: &BuildProgress,
    ) -> Result<(Vec<FunctionRecord>, Seconds, ChunkStats, Vec<String>)> {
        let range = self.tiling(chunk).expect("composes() checked the tiling");
        for i in range.clone() {
            if self.decode[i].is_some() {
                continue;
            }
            let source = &self.four[i];
            let path = self
                .staging
                .join(format!(".source-{}.mlpackage", source.name));
            let job = ChunkJob {
                dims: &self.dims,
                chunk: source,
                checkpoint,
                settings: &settings.conversion,
                paths: vec![path.to_string_lossy().into_owned()],
                profile: settings.profile,
            };
            let converted = calls::convert_chunk(&job, cache, progress).map_err(|e| {
                anyhow!(
                    "building {} (a source of {}): {}",
                    source.name,
                    chunk.name,
                    pyenv::render_error(e.error, settings.verbose)
                )
            })?;
            for (f, c) in source.functions.iter().zip(converted.functions) {
                self.sources_seconds += c.seconds.values().sum::<f64>();
                self.cache.hits += c.stats.palettize_cache_hits.unwrap_or(0);
                self.cache.misses += c.stats.palettize_cache_misses.unwrap_or(0);
                self.sources.push(FunctionRecord {
                    name: source.name.clone(),
                    kind: f.kind,
                    tokens: f.tokens,
                    mil_ops: c.stats.mil_ops,
                    weight_bytes: c.stats.weight_bytes,
                    seconds: c.seconds,
                    passes: c.passes,
                });
            }
            self.decode[i] = Some(path);
        }
        let from: Vec<String> = range.clone().map(|i| self.four[i].name.clone()).collect();
        let sources = range
            .map(|i| calls::ComposeSource {
                path: self.decode[i]
                    .as_ref()
                    .expect("converted above")
                    .to_string_lossy()
                    .into_owned(),
                chunk: &self.four[i],
            })
            .collect();
        let path = self.staging.join(format!("{}.mlpackage", chunk.name));
        let pb = progress.phase(format!(
            "{}: compose {} (MIL, no conversion)",
            chunk.name,
            from.join(" + ")
        ));
        let composed = calls::compose(&calls::ComposeJob {
            target: chunk,
            sources,
            path: path.to_string_lossy().into_owned(),
            settings: &settings.conversion,
        });
        pb.finish_and_clear();
        let composed = composed.map_err(|e| {
            anyhow!(
                "composing {} from {}: {}",
                chunk.name,
                from.join(" + "),
                pyenv::render_error(e, settings.verbose)
            )
        })?;
        let f = &chunk.functions[0];
        let functions = vec![FunctionRecord {
            name: f.name.clone(),
            kind: f.kind,
            tokens: f.tokens,
            mil_ops: composed.stats.mil_ops,
            weight_bytes: composed.stats.weight_bytes,
            seconds: composed.seconds.clone(),
            passes: None,
        }];
        Ok((functions, composed.seconds, composed.stats, from))
    }
}

/// Packages converted together: each alone, except a four-chunk package and
/// the prefill package of the same layers, which are bundled from one set of
/// programs so their weight blobs are byte-identical (the runtime's
/// downloader hard-links `chunkN`'s blob into `prefill_chunkN`).
fn units(plan: &Plan) -> Vec<Vec<(LayoutKind, &ChunkPlan)>> {
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
                    let mut unit = vec![(l.kind, c)];
                    unit.extend(partner(c).map(|p| (LayoutKind::Prefill, p)));
                    units.push(unit);
                }
                LayoutKind::Prefill if has_four => {}
                _ => units.push(vec![(l.kind, c)]),
            }
        }
    }
    units
}

/// A layout request with its mode and context known (a recorded one is
/// checked to have both).
#[derive(Clone, Debug)]
pub struct Layout {
    pub mode: Mode,
    pub split: Option<String>,
    pub ctx: usize,
    pub verify_k: Option<usize>,
    pub prefill_len: Option<Vec<usize>>,
}

impl Layout {
    /// As build.json records it.
    pub fn record(&self) -> BuildRequest {
        BuildRequest {
            mode: Some(self.mode),
            split: self.split.clone(),
            ctx: Some(self.ctx as u64),
            verify_k: self.verify_k,
            prefill_len: self.prefill_len.clone(),
        }
    }
}

/// What `build --check` replays of an earlier build: its checkpoint, layout
/// request and quantization.
#[derive(Debug)]
pub struct Rebuild {
    pub hf_dir: Option<PathBuf>,
    pub layout: Layout,
    pub quantize: bool,
    pub palettizer: Palettizer,
    pub pass_pipeline: PassPipeline,
    pub compose: bool,
}

/// The parts of build.json `--check` reads (older records have only these).
#[derive(Deserialize)]
struct Replayed {
    request: BuildRequest,
    settings: ReplayedSettings,
    checkpoint: ReplayedCheckpoint,
}

#[derive(Deserialize)]
struct ReplayedSettings {
    quantize: bool,
    #[serde(default)]
    palettization: Option<ReplayedPalettization>,
    /// Absent in records from before the field: coremltools' default ran.
    #[serde(default = "crate::records::default_pass_pipeline")]
    pass_pipeline: PassPipeline,
    /// Absent in records from before the field: every layout was converted.
    #[serde(default)]
    compose: bool,
}

#[derive(Deserialize)]
struct ReplayedPalettization {
    palettizer: Option<Palettizer>,
}

#[derive(Deserialize)]
struct ReplayedCheckpoint {
    dir: PathBuf,
}

/// The request of the build whose record is `build_json` (`hf_override`:
/// the checkpoint's folder now, instead of the recorded one).
pub fn request_of(build_json: &Path, hf_override: &Option<PathBuf>) -> Result<Rebuild> {
    let text = std::fs::read(build_json)
        .with_context(|| format!("{}: cannot read", build_json.display()))?;
    let v: Value = serde_json::from_slice(&text)
        .with_context(|| format!("{}: not valid JSON", build_json.display()))?;
    let r: Replayed = serde_json::from_value(v).map_err(|e| {
        anyhow!(
            "{}: {e}: missing or invalid (not a chunkforge build.json?)",
            build_json.display()
        )
    })?;
    let (Some(mode), Some(ctx)) = (r.request.mode, r.request.ctx) else {
        bail!(
            "{}: request.mode and request.ctx missing or invalid (not a chunkforge build.json?)",
            build_json.display()
        );
    };
    let ctx = usize::try_from(ctx)
        .map_err(|_| format!("{ctx} is out of range"))
        .and_then(crate::args::check_ctx)
        .map_err(|e| anyhow!("{}: request.ctx {e}", build_json.display()))?;
    let hf_dir = match hf_override {
        Some(p) => Some(p.clone()),
        None => {
            let recorded = &r.checkpoint.dir;
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
    let palettizer = r
        .settings
        .palettization
        .and_then(|p| p.palettizer)
        .unwrap_or(Palettizer::Chunkforge);
    Ok(Rebuild {
        hf_dir,
        layout: Layout {
            mode,
            split: r.request.split,
            ctx,
            verify_k: r.request.verify_k,
            prefill_len: r.request.prefill_len,
        },
        quantize: r.settings.quantize,
        palettizer,
        pass_pipeline: r.settings.pass_pipeline,
        compose: r.settings.compose,
    })
}

/// Compares the packages of `old` with a fresh build in `fresh_dir`, printing
/// every package and, for a differing one, every differing file.
pub fn compare(old: &Path, fresh_dir: &Path, fresh: &BuildRecord) -> Result<bool> {
    let mut same = true;
    for c in &fresh.chunks {
        let pkg = c.package.as_str();
        let a = old.join(pkg);
        let b = fresh_dir.join(pkg);
        if !a.exists() {
            println!("{pkg}: MISSING in {}", old.display());
            same = false;
            continue;
        }
        let da = hashing::tree_digest(&a)?;
        let db = c.sha256_tree.clone();
        if da == db {
            println!("{pkg}: identical ({})", &da[..16]);
            continue;
        }
        same = false;
        println!("{pkg}: DIFFERS");
        let (fa, fb) = (hashing::file_digests(&a)?, hashing::file_digests(&b)?);
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
    use serde_json::json;

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
        let hf = request_of(&out.join("build.json"), &None).unwrap().hf_dir;
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
