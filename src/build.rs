//! `chunkforge build`: plan, then for every chunk load → trace → convert →
//! palettize → save, each phase timed under its own spinner; all packages are
//! staged and moved into the output folder together when every one succeeded.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, Context, Result};

use crate::audit;
use crate::checkpoint::Checkpoint;
use crate::cli::values::Jobs;
use crate::config::TextConfig;
use crate::hashing;
use crate::layouts::{spec, Purpose, REFERENCE};
use crate::plan::{ChunkPlan, FunctionKind, Functions, LayoutKind, Mode, Plan};
use crate::progress::{self, BuildProgress};
use crate::py::calls::WeightCache;
use crate::py::contract::{
    CheckpointFiles, ChunkJob, ComposeJob, ComposeSource, Composed, ConvertedChunk,
    ConvertedFunction,
};
use crate::py::env as pyenv;
use crate::py::worker::{self, BundleRequest, Stage, Task, TaskReply, Worker};
use crate::records::{
    BuildRecord, BuildSeconds, CacheTotals, CheckpointRecord, ChunkRecord, ChunkStats,
    ConversionSettings, FunctionRecord, Seconds, ToolVersions, BUILD_FORMAT,
};
use crate::settings::BuildSettings;
use crate::staging::OutputLock;
use crate::staging::{self, Staging};

/// The phase the bundle of a multifunction package is timed under.
const BUNDLE: &str = "bundle";

/// The memory a build may plan for with `--jobs auto`: half of upstream's
/// 13 GB for a full-width `--mode both` (issue 15's target).
const MEMORY_TARGET: u64 = 6_979_321_856; // 6.5 GiB

/// A conversion's estimated peak RSS: the interpreter with torch and
/// coremltools (0.9 GB), plus 3.5 times the fp16 weights of its layers.
/// Measured on full-width E2B chunks (chunk4: 1.29 GB of weights, peak
/// 4.8 GB at `add_fp16_cast`): the fp32 constants the frontend makes (2x),
/// their fp16 casts (1x) and what MIL keeps besides.
fn conversion_peak_estimate(weight_bytes: u64) -> u64 {
    900 * 1024 * 1024 + weight_bytes * 7 / 2
}

/// Bytes of the checkpoint's tensors of layers `first..=last`, plus every
/// tensor of no layer (embeddings, norms; counted for every chunk).
fn chunk_weight_bytes(ckpt: &Checkpoint, first: usize, last: usize) -> u64 {
    ckpt.tensors
        .iter()
        .filter(|(name, _)| {
            let rest = name.strip_prefix(&ckpt.prefix).unwrap_or(name);
            match rest
                .strip_prefix("layers.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<usize>().ok())
            {
                Some(layer) => (first..=last).contains(&layer),
                None => true,
            }
        })
        .map(|(_, t)| t.bytes)
        .sum()
}

/// Processes for `--jobs auto`: up to one per core and one per task, while
/// the largest `peaks` (sorted, largest first) of that many conversions at
/// once fit `budget`.
fn auto_jobs(cores: usize, peaks: &[u64], budget: u64, tasks: usize) -> usize {
    let mut n = 1;
    while n < cores.min(tasks) && peaks.iter().take(n + 1).sum::<u64>() <= budget {
        n += 1;
    }
    n
}

/// Memory available to new processes (`MemAvailable`), if the system says.
fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024)
}

/// The processes a build converts on: its own and its conversion workers.
struct Pool {
    workers: Vec<Worker>,
    /// Why that many (for the progress line and build.json's reader).
    reason: String,
}

impl Pool {
    /// `--jobs N` starts N-1 workers. `auto`: one process per core, as many
    /// as the estimated peaks of that many of the build's largest
    /// conversions at once keep within `MEMORY_TARGET` and the memory
    /// available, and no more than there are tasks.
    fn start(
        settings: &BuildSettings,
        plan: &Plan,
        ckpt: &Checkpoint,
        tasks: usize,
        uses: usize,
        verbose: bool,
    ) -> Result<Pool> {
        let (n, reason) = match settings.jobs {
            Jobs::N(n) => (n, "--jobs".to_string()),
            Jobs::Auto => {
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                let mut peaks: Vec<u64> = plan
                    .layouts
                    .iter()
                    .flat_map(|l| &l.chunks)
                    .map(|c| {
                        conversion_peak_estimate(chunk_weight_bytes(
                            ckpt,
                            c.first_layer,
                            c.last_layer,
                        ))
                    })
                    .collect();
                peaks.sort_unstable_by(|a, b| b.cmp(a));
                let budget = available_memory().map_or(MEMORY_TARGET, |a| a.min(MEMORY_TARGET));
                let n = auto_jobs(cores, &peaks, budget, tasks);
                let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
                let reason = format!(
                    "auto: {cores} cores, {n} conversions at once estimated at {:.1} GiB of {:.1} GiB",
                    gib(peaks.iter().take(n).sum()),
                    gib(budget)
                );
                (n, reason)
            }
        };
        let workers = (1..n.min(tasks.max(1)))
            .map(|_| Worker::spawn(uses, verbose))
            .collect::<Result<Vec<_>>>()?;
        Ok(Pool { workers, reason })
    }

    fn processes(&self) -> usize {
        1 + self.workers.len()
    }

    /// torch threads for each conversion: the cores shared by the processes.
    fn threads(&self) -> usize {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / self.processes()).max(1)
    }

    fn describe(&self) -> String {
        format!("{} processes; {}", self.processes(), self.reason)
    }

    /// Runs `tasks` (each with what its errors name and its cost: the
    /// fp16 weight bytes it converts or composes, times its functions);
    /// the first error, if any.
    fn run(
        &mut self,
        tasks: &[(Task, String, u64)],
        cache: &WeightCache,
        progress: &BuildProgress,
        verbose: bool,
    ) -> Result<Vec<Option<TaskReply>>> {
        let only: Vec<Task> = tasks.iter().map(|(t, _, _)| t.clone()).collect();
        let cost: Vec<u64> = tasks.iter().map(|(_, _, c)| *c).collect();
        let results = worker::run_all(&only, &cost, &mut self.workers, cache, progress, verbose);
        // A task the build stopped (its worker killed after another failed)
        // is not the error to report.
        let failure = results
            .iter()
            .zip(tasks)
            .filter_map(|(r, (_, label, _))| match r {
                Some(Err(e)) => Some((e, label)),
                _ => None,
            })
            .min_by_key(|(e, _)| matches!(e.stage, Stage::Worker));
        if let Some((e, label)) = failure {
            return Err(match &e.stage {
                Stage::Convert(Some(function)) => anyhow!("building {function}: {}", e.message),
                Stage::Convert(None) | Stage::Worker => anyhow!("building {label}: {}", e.message),
                Stage::Bundle => anyhow!("bundling {label}: {}", e.message),
                Stage::Compose => anyhow!("composing {label}: {}", e.message),
            });
        }
        Ok(results
            .into_iter()
            .map(|r| r.and_then(|r| r.ok()))
            .collect())
    }

    /// Ends the workers; the largest peak RSS one of them reached, summed.
    fn finish(self) -> Result<u64> {
        let peak = self.workers.iter().map(|w| w.peak_rss_bytes).sum();
        for w in self.workers {
            w.finish()?;
        }
        Ok(peak)
    }
}

/// What the build does for a unit of the plan.
enum Work {
    /// Converted by task `task`; `parts`: its single-function packages if bundled.
    Converted {
        task: usize,
        parts: Vec<(String, String)>,
    },
    Composed,
}

/// A package's record parts, before its record is written.
struct Done<'p> {
    layout: LayoutKind,
    chunk: &'p ChunkPlan,
    functions: Vec<FunctionRecord>,
    seconds: Seconds,
    stats: ChunkStats,
    from: Option<Vec<String>>,
}

/// `chunk`'s conversion job: each function to its path.
fn chunk_job(
    plan: &Plan,
    chunk: &ChunkPlan,
    checkpoint: &CheckpointFiles,
    settings: &BuildSettings,
    paths: &[PathBuf],
) -> ChunkJob {
    ChunkJob {
        dims: plan.dims.clone(),
        chunk: chunk.clone(),
        checkpoint: checkpoint.clone(),
        settings: settings.conversion.clone(),
        paths: paths
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect(),
        profile: settings.profile,
    }
}

/// A `convert_chunk` reply (one per job of `convert_jobs`) for `chunk`
/// checked: every function was converted, in order.
fn converted_chunk(
    chunk: &ChunkPlan,
    converted: ConvertedChunk,
) -> std::result::Result<ConvertedChunk, String> {
    let sent: Vec<&str> = chunk.functions.iter().map(|f| f.name.as_str()).collect();
    let got: Vec<&str> = converted
        .functions
        .iter()
        .map(|f| f.name.as_str())
        .collect();
    if sent != got {
        return Err(format!(
            "the conversion of {} converted functions {got:?} of {sent:?}",
            chunk.name
        ));
    }
    Ok(converted)
}

/// The record of converted function `f` (`c`: its reply), under `name`.
fn function_record(
    name: &str,
    f: &crate::plan::FunctionPlan,
    c: ConvertedFunction,
) -> FunctionRecord {
    FunctionRecord {
        name: name.to_string(),
        kind: f.kind,
        tokens: f.tokens,
        mil_ops: c.stats.mil_ops,
        weight_bytes: c.stats.weight_bytes,
        seconds: c.seconds,
        passes: c.passes,
    }
}

/// A converted chunk's function records, summed seconds and summed counts.
fn function_records(
    chunk: &ChunkPlan,
    converted: ConvertedChunk,
) -> (Vec<FunctionRecord>, Seconds, ChunkStats) {
    let mut functions = Vec::new();
    let mut seconds = Seconds::new();
    let mut stats: Option<ChunkStats> = None;
    for (f, c) in chunk.functions.iter().zip(converted.functions) {
        for (k, v) in &c.seconds {
            *seconds.entry(k.clone()).or_default() += v;
        }
        match &mut stats {
            None => stats = Some(c.stats.clone()),
            Some(acc) => acc.add(&c.stats),
        }
        functions.push(function_record(&f.name, f, c));
    }
    (
        functions,
        seconds,
        stats.expect("every chunk has a function"),
    )
}

/// Builds `plan` of the checkpoint in `hf_dir` into `out` as `settings` say:
/// every package and build.json appear there together, once all are complete.
#[allow(clippy::too_many_arguments)]
pub fn run(
    hf_dir: &Path,
    cfg: &TextConfig,
    ckpt: &Checkpoint,
    plan: &Plan,
    out: &Path,
    settings: &BuildSettings,
    verbose: bool,
) -> Result<BuildRecord> {
    let started = Instant::now();
    // The lock first: it notes whether this run creates the output folder,
    // and removes it again (with the lock file) if the run ends without a
    // result.
    let _lock = settings
        .lock
        .map(|on_locked| OutputLock::take(out, on_locked))
        .transpose()?;
    staging::output_folder(out)?;
    let staging = Staging::new(out)?;
    let units = units(plan);
    let packages: usize = units.iter().map(Vec::len).sum();
    let progress = BuildProgress::new(packages as u64);
    for w in &plan.warnings {
        progress.println(format!("warning: {w}"));
    }
    // Decode packages the four-chunk layout tiles are composed from its
    // programs (see `Composer`), not converted.
    let mut composer = Composer::new(cfg, plan, &settings.conversion, &staging.dir)?;
    let uses = cache_uses(plan, &composer, settings.conversion.joint);
    let cache = WeightCache::new(uses)
        .map_err(|e| anyhow!("palettization cache: {}", pyenv::render_error(e, verbose)))?;
    let step = Step {
        plan,
        ckpt,
        settings,
        staging: &staging.dir,
        cache: &cache,
        progress: &progress,
        verbose,
    };
    let mut planned = step.plan_units(&units, &mut composer)?;
    let mut pool = Pool::start(settings, plan, ckpt, planned.tasks.len(), uses, verbose)?;
    let converted = step.run_pool(&mut pool, &mut planned)?;
    let done = step.collect(&units, &planned, converted, &mut composer)?;
    let records = step.compose(&units, done, &mut composer, &mut pool)?;
    let processes = pool.processes();
    let worker_peak = pool.finish()?;
    progress.bar.finish_and_clear();
    let mut record = step.record(hf_dir, cfg, records, &mut composer, started)?;
    record.processes = processes;
    // Each worker's own peak: the sum bounds the build's.
    record.peak_rss_bytes = progress::peak_rss_bytes() + worker_peak;
    record.audit = Some(step.audit(&record)?);
    publish(staging, &record)?;
    Ok(record)
}

/// Each function of each converted layout holds every weight of its layers
/// once (the composer's own sources: one more), so the build's
/// palettization cache keeps a result until that many conversions have used
/// it. The cache lives as long as the run. Converted together (`joint`), a
/// unit's functions are one conversion.
fn cache_uses(plan: &Plan, composer: &Composer, joint: bool) -> usize {
    let has_four = plan.layouts.iter().any(|l| l.kind == REFERENCE);
    plan.layouts
        .iter()
        .filter(|l| !l.chunks.iter().all(|c| composer.composes(l.kind, c)))
        .map(|l| match l.chunks.first() {
            // Prefill chunks are in the four-chunk units (`units`).
            Some(_) if joint && l.kind == LayoutKind::Prefill && has_four => 0,
            Some(_) if joint => 1,
            Some(c) => c.functions.len(),
            None => 0,
        })
        .sum::<usize>()
        + usize::from(composer.converts_sources(plan))
}

/// What every step of a build reads.
struct Step<'a> {
    plan: &'a Plan,
    ckpt: &'a Checkpoint,
    settings: &'a BuildSettings,
    staging: &'a Path,
    cache: &'a WeightCache,
    progress: &'a BuildProgress,
    verbose: bool,
}

/// The conversion tasks of a build: one per converted unit (in unit
/// order), then one per composition source the build does not make itself.
struct Planned {
    /// Each task, what its errors name, and its cost.
    tasks: Vec<(Task, String, u64)>,
    /// What the build does for each unit.
    work: Vec<Work>,
    /// (four-chunk index, chunk, staged path) of each source task, from `first_source` on.
    sources: Vec<(usize, ChunkPlan, PathBuf)>,
    first_source: usize,
}

impl Step<'_> {
    /// The task's cost: the fp16 weight bytes `chunk` converts or composes, times its functions.
    fn cost(&self, chunk: &ChunkPlan) -> u64 {
        chunk_weight_bytes(self.ckpt, chunk.first_layer, chunk.last_layer)
            * chunk.functions.len() as u64
    }

    /// Every conversion (with its bundle) is a task (py/worker.rs), run on
    /// this process and its conversion workers at once; the compositions
    /// come after (`compose`), as they read the four-chunk decode programs.
    fn plan_units(
        &self,
        units: &[Vec<(LayoutKind, &ChunkPlan)>],
        composer: &mut Composer,
    ) -> Result<Planned> {
        let checkpoint = CheckpointFiles::of(self.ckpt);
        let joint = self.settings.conversion.joint;
        let mut tasks: Vec<(Task, String, u64)> = Vec::new();
        let mut work: Vec<Work> = Vec::new();
        for unit in units {
            if let [(layout, chunk)] = unit[..] {
                if composer.composes(layout, chunk) {
                    work.push(Work::Composed);
                    continue;
                }
            }
            // One program per function; a unit of several functions is bundled
            // from single-function parts (see `convert.combine`).
            let bundled = unit.len() > 1 || unit[0].1.functions.len() > 1;
            let package = |name: &str| self.staging.join(format!("{name}.mlpackage"));
            let part_path =
                |pkg: &str, f: &str| self.staging.join(format!(".part-{pkg}-{f}.mlpackage"));
            let mut jobs = Vec::new();
            let mut parts = Vec::new();
            for (layout, chunk) in unit {
                let paths: Vec<PathBuf> = chunk
                    .functions
                    .iter()
                    .map(|f| {
                        if bundled {
                            part_path(&chunk.name, &f.name)
                        } else {
                            package(&chunk.name)
                        }
                    })
                    .collect();
                jobs.push(chunk_job(
                    self.plan,
                    chunk,
                    &checkpoint,
                    self.settings,
                    &paths,
                ));
                for (f, path) in chunk.functions.iter().zip(&paths) {
                    parts.push((path.to_string_lossy().into_owned(), f.name.clone()));
                }
                if *layout == REFERENCE {
                    composer.converted(chunk, &paths);
                }
            }
            let names: Vec<&str> = unit.iter().map(|(_, c)| c.name.as_str()).collect();
            let bundle = bundled.then(|| BundleRequest {
                label: names.join(" + "),
                parts: parts.clone(),
                targets: unit
                    .iter()
                    .map(|(_, c)| {
                        let functions = c.functions.iter().map(|f| f.name.clone()).collect();
                        (package(&c.name).to_string_lossy().into_owned(), functions)
                    })
                    .collect(),
                writer: self.settings.conversion.writer,
            });
            work.push(Work::Converted {
                task: tasks.len(),
                parts,
            });
            // Conversions keep plan order (cost 0): a bad weight in the first
            // layers is reported first, as in one process.
            let task = Task::Convert {
                jobs,
                bundle,
                joint: joint && bundled,
                threads: 1,
            };
            tasks.push((task, names.join(" + "), 0));
        }
        // The four-chunk decode programs the compositions need and the build
        // does not make itself.
        let composed: Vec<&ChunkPlan> = units
            .iter()
            .zip(&work)
            .filter(|(_, w)| matches!(w, Work::Composed))
            .map(|(u, _)| u[0].1)
            .collect();
        let sources = composer.missing_sources(&composed);
        let first_source = tasks.len();
        for (_, source, path) in &sources {
            let job = chunk_job(
                self.plan,
                source,
                &checkpoint,
                self.settings,
                std::slice::from_ref(path),
            );
            let task = Task::Convert {
                jobs: vec![job],
                bundle: None,
                joint: false,
                threads: 1,
            };
            let label = format!("{} (a source of a composed package)", source.name);
            tasks.push((task, label, 0));
        }
        Ok(Planned {
            tasks,
            work,
            sources,
            first_source,
        })
    }

    /// Runs the conversions on `pool`; each task's reply.
    fn run_pool(&self, pool: &mut Pool, planned: &mut Planned) -> Result<Vec<Option<TaskReply>>> {
        // A process converting alone gets every core for torch's arithmetic
        // (loading, and the trace's one run of the module: at full width a
        // 512-token prefill); processes side by side take one each.
        let threads = pool.threads();
        for (task, _, _) in &mut planned.tasks {
            if let Task::Convert { threads: t, .. } = task {
                *t = threads;
            }
        }
        self.progress
            .bar
            .set_message(format!("converting on {}", pool.describe()));
        pool.run(&planned.tasks, self.cache, self.progress, self.verbose)
    }

    /// The converted units' record parts (None for a composed unit), in
    /// unit order, and the composer's sources; the parts no longer needed go.
    fn collect<'p>(
        &self,
        units: &[Vec<(LayoutKind, &'p ChunkPlan)>],
        planned: &Planned,
        mut results: Vec<Option<TaskReply>>,
        composer: &mut Composer,
    ) -> Result<Vec<Option<Vec<Done<'p>>>>> {
        for (k, (i, source, _)) in planned.sources.iter().enumerate() {
            let reply = results[planned.first_source + k]
                .take()
                .expect("every task ran");
            let converted = reply
                .converted
                .into_iter()
                .next()
                .ok_or_else(|| anyhow!("building {}: no reply", source.name))?;
            let converted = converted_chunk(source, converted)
                .map_err(|e| anyhow!("building {}: {e}", source.name))?;
            composer.sourced(*i, converted);
        }
        let mut done: Vec<Option<Vec<Done>>> = Vec::new();
        for (unit, w) in units.iter().zip(&planned.work) {
            let Work::Converted { task, parts } = w else {
                done.push(None);
                continue;
            };
            let reply = results[*task].take().expect("every task ran");
            let mut out = Vec::new();
            for ((layout, chunk), converted) in unit.iter().zip(reply.converted) {
                let converted = converted_chunk(chunk, converted)
                    .map_err(|e| anyhow!("building {}: {e}", chunk.name))?;
                let (functions, mut seconds, mut stats) = function_records(chunk, converted);
                if let Some(b) = &reply.bundle {
                    stats.weight_bytes = b.weight_bytes;
                    // The bundle's seconds are shared by its packages.
                    seconds.insert(BUNDLE.to_string(), reply.bundle_seconds / unit.len() as f64);
                }
                out.push(Done {
                    layout: *layout,
                    chunk,
                    functions,
                    seconds,
                    stats,
                    from: None,
                });
            }
            if reply.bundle.is_some() {
                for (path, _) in parts {
                    // A four-chunk decode program the composer reads stays until the build ends.
                    if !composer.keeps(Path::new(path)) {
                        std::fs::remove_dir_all(path)
                            .with_context(|| format!("{path}: cannot remove"))?;
                    }
                }
            }
            done.push(Some(out));
        }
        Ok(done)
    }

    /// Composes the composed units on `pool`; every package's record, in
    /// plan order (each line printed as it is recorded).
    fn compose(
        &self,
        units: &[Vec<(LayoutKind, &ChunkPlan)>],
        done: Vec<Option<Vec<Done>>>,
        composer: &mut Composer,
        pool: &mut Pool,
    ) -> Result<Vec<ChunkRecord>> {
        let mut tasks = Vec::new();
        for (unit, d) in units.iter().zip(&done) {
            if d.is_none() {
                let chunk = unit[0].1;
                let (task, label) = composer.compose_task(chunk, &self.settings.conversion);
                tasks.push((task, label, self.cost(chunk)));
            }
        }
        let mut results = pool.run(&tasks, self.cache, self.progress, self.verbose)?;
        let mut next = 0;
        let mut records: Vec<ChunkRecord> = Vec::new();
        for (unit, d) in units.iter().zip(done) {
            let out = match d {
                Some(out) => out,
                None => {
                    let (layout, chunk) = unit[0];
                    let reply = results[next].take().expect("every task ran");
                    next += 1;
                    let composed = reply
                        .composed
                        .ok_or_else(|| anyhow!("composing {}: no reply", chunk.name))?;
                    let (functions, seconds, stats, from) = composer.composed(chunk, composed);
                    vec![Done {
                        layout,
                        chunk,
                        functions,
                        seconds,
                        stats,
                        from: Some(from),
                    }]
                }
            };
            for d in out {
                records.push(record(self.staging, d, self.progress)?);
            }
        }
        Ok(records)
    }

    /// build.json's record of `records`; the processes, their peak memory
    /// and the audit are the caller's to fill in.
    fn record(
        &self,
        hf_dir: &Path,
        cfg: &TextConfig,
        records: Vec<ChunkRecord>,
        composer: &mut Composer,
        started: Instant,
    ) -> Result<BuildRecord> {
        let versions = pyenv::versions(self.verbose)?;
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
        // The composer's own sources palettize too.
        let cache_total =
            |of: fn(&ChunkRecord) -> Option<u64>| -> u64 { records.iter().filter_map(of).sum() };
        let palettize_cache = CacheTotals {
            hits: cache_total(|r| r.palettize_cache_hits) + composer.cache.hits,
            misses: cache_total(|r| r.palettize_cache_misses) + composer.cache.misses,
        };
        Ok(BuildRecord {
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
                tensor_prefix: Some(self.ckpt.prefix.clone()),
                skipped_tensors: Some(self.ckpt.skipped),
                weights: Some(hashing::weights_digest(self.ckpt)?),
            },
            request: self.settings.layout.record(),
            settings: self.settings.conversion.clone(),
            plan: self.plan.clone(),
            palettize_cache,
            chunks: records,
            sources: std::mem::take(&mut composer.sources),
            seconds: BuildSeconds {
                total: started.elapsed().as_secs_f64(),
                phases,
            },
            peak_rss_bytes: 0,
            processes: 1,
            audit: None,
        })
    }

    /// The static ANE audit of the staged packages, for build.json: `package`
    /// can then refuse findings without reading the programs again.
    fn audit(&self, record: &BuildRecord) -> Result<crate::records::AuditRecord> {
        let packages = audit::build_packages(self.staging, record, false);
        let spinner = progress::spinner(format!("audit {} packages", packages.len()));
        let report = audit::run(&packages, self.verbose);
        spinner.finish_and_clear();
        let audited = report.context("auditing the built packages")?.record();
        eprintln!("{}", audit::summary_line(&audited, packages.len()));
        Ok(audited)
    }
}

/// All packages, then build.json last, as one publish: a reader that sees
/// the new build.json sees every package it lists, and a run killed before
/// the end has them all put back by the next run.
fn publish(staging: Staging, record: &BuildRecord) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(record)?;
    staging::write_atomic(&staging.dir.join("build.json"), &bytes)?;
    let mut names: Vec<&str> = record.chunks.iter().map(|r| r.package.as_str()).collect();
    names.push("build.json");
    staging.publish_names(&names)?;
    staging.finish()
}

/// Writes a package's line and returns its record (`done.from`: the
/// four-chunk packages it was composed from; None: converted).
fn record(staging: &Path, done: Done, progress: &BuildProgress) -> Result<ChunkRecord> {
    let Done {
        layout,
        chunk,
        functions,
        seconds,
        stats,
        from: composed_from,
    } = done;
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
/// already converted and optimised; `convert/compose.py` joins them at the MIL level
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
        let own = plan.layouts.iter().find(|l| l.kind == REFERENCE);
        let four: Vec<ChunkPlan> = match own {
            Some(l) => l.chunks.clone(),
            None if conversion.compose => {
                crate::plan::plan(
                    cfg,
                    conversion.ctx,
                    Mode::Only(REFERENCE),
                    None,
                    &Functions::resolve(Mode::Only(REFERENCE), None, None),
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

    /// `chunk` is composed: a decode chunk the four-chunk layout tiles,
    /// whether of one of its chunks or more, and whether the build makes the
    /// four-chunk layout or converts its sources only for this. A package is
    /// then the same bytes whichever mode builds it (`--mode three`'s
    /// `chunk3_3way` is `--mode all`'s); converting a one-chunk source costs
    /// what converting the chunk itself would.
    fn composes(&self, kind: LayoutKind, chunk: &ChunkPlan) -> bool {
        self.enabled
            && kind != REFERENCE
            && spec(kind).purpose == Purpose::Decode
            && matches!(&chunk.functions[..], [f] if f.kind == FunctionKind::Decode && f.tokens == 1)
            && self.tiling(chunk).is_some()
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

    /// The four-chunk chunks `chunks`' compositions read that nothing
    /// converts yet: (index, chunk, staged path), each given its path now.
    fn missing_sources(&mut self, chunks: &[&ChunkPlan]) -> Vec<(usize, ChunkPlan, PathBuf)> {
        let mut out = Vec::new();
        for chunk in chunks {
            for i in self.tiling(chunk).expect("composes() checked the tiling") {
                if self.decode[i].is_some() {
                    continue;
                }
                let source = self.four[i].clone();
                let path = self
                    .staging
                    .join(format!(".source-{}.mlpackage", source.name));
                self.decode[i] = Some(path.clone());
                out.push((i, source, path));
            }
        }
        out
    }

    /// Source `i` was converted (for composition only).
    fn sourced(&mut self, i: usize, converted: ConvertedChunk) {
        let source = &self.four[i];
        for (f, c) in source.functions.iter().zip(converted.functions) {
            self.sources_seconds += c.seconds.values().sum::<f64>();
            self.cache.hits += c.stats.palettize_cache_hits.unwrap_or(0);
            self.cache.misses += c.stats.palettize_cache_misses.unwrap_or(0);
            // A source's record is named after its chunk (its only function is decode).
            self.sources.push(function_record(&source.name, f, c));
        }
    }

    /// The four-chunk chunks `chunk` is composed from, by name.
    fn from(&self, chunk: &ChunkPlan) -> Vec<String> {
        self.tiling(chunk)
            .expect("composes() checked the tiling")
            .map(|i| self.four[i].name.clone())
            .collect()
    }

    /// The task composing `chunk` into staging, and what its errors say it was.
    fn compose_task(&self, chunk: &ChunkPlan, conversion: &ConversionSettings) -> (Task, String) {
        let range = self.tiling(chunk).expect("composes() checked the tiling");
        let from = self.from(chunk).join(" + ");
        let sources = range
            .map(|i| ComposeSource {
                path: self.decode[i]
                    .as_ref()
                    .expect("missing_sources() gave every source a path")
                    .to_string_lossy()
                    .into_owned(),
                chunk: self.four[i].clone(),
            })
            .collect();
        let path = self.staging.join(format!("{}.mlpackage", chunk.name));
        let job = ComposeJob {
            target: chunk.clone(),
            sources,
            path: path.to_string_lossy().into_owned(),
            settings: conversion.clone(),
        };
        let task = Task::Compose {
            job: Box::new(job),
            label: chunk.name.clone(),
            what: format!("compose {from} (MIL, no conversion)"),
        };
        (task, format!("{} from {from}", chunk.name))
    }

    /// `chunk`'s record parts from its composition's reply.
    fn composed(
        &self,
        chunk: &ChunkPlan,
        composed: Composed,
    ) -> (Vec<FunctionRecord>, Seconds, ChunkStats, Vec<String>) {
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
        (
            functions,
            composed.seconds,
            composed.stats,
            self.from(chunk),
        )
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
    let has_four = plan.layouts.iter().any(|l| l.kind == REFERENCE);
    let mut units = Vec::new();
    // A package two layouts hold (the three-chunk decode's chunk1 is the
    // reference's) is built once.
    let mut seen = std::collections::BTreeSet::new();
    for l in &plan.layouts {
        for c in l.chunks.iter().filter(|c| seen.insert(c.name.as_str())) {
            if l.kind == REFERENCE {
                let mut unit = vec![(l.kind, c)];
                unit.extend(partner(c).map(|p| (LayoutKind::Prefill, p)));
                units.push(unit);
            } else if !(l.kind == LayoutKind::Prefill && has_four) {
                units.push(vec![(l.kind, c)]);
            }
        }
    }
    units
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

    #[test]
    fn auto_jobs_runs_two_tiny_conversions_at_once_but_one_full_width() {
        let gib = 1u64 << 30;
        // The tiny default checkpoint: a few MB of weights per chunk.
        let tiny = conversion_peak_estimate(4 << 20);
        assert_eq!(auto_jobs(2, &[tiny; 4], MEMORY_TARGET, 12), 2);
        assert_eq!(
            auto_jobs(8, &[tiny; 4], MEMORY_TARGET, 3),
            3,
            "no more than tasks"
        );
        assert_eq!(
            auto_jobs(1, &[tiny; 4], MEMORY_TARGET, 12),
            1,
            "no more than cores"
        );
        // Full-width E2B: chunk4 holds 1.29 GB of fp16 weights, one
        // conversion alone is estimated at 5.1 GiB (measured: 4.7 GiB).
        let wide = conversion_peak_estimate(1_290_000_000);
        assert!(wide > 5 * gib && wide < MEMORY_TARGET, "{wide}");
        assert_eq!(auto_jobs(2, &[wide, wide, tiny], MEMORY_TARGET, 12), 1);
        // With memory to spare, both cores.
        assert_eq!(auto_jobs(2, &[wide, wide, tiny], 16 * gib, 12), 2);
    }

    #[test]
    fn jobs_parse_auto_or_a_positive_count() {
        assert_eq!("auto".parse::<Jobs>(), Ok(Jobs::Auto));
        assert_eq!("3".parse::<Jobs>(), Ok(Jobs::N(3)));
        assert!("0"
            .parse::<Jobs>()
            .unwrap_err()
            .contains("auto or a number"));
        assert!("two".parse::<Jobs>().is_err());
    }
}
