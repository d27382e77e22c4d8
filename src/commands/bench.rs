//! `chunkforge bench ...`: build and parity timed, side files against a
//! plain write, hashing and signing against other tools, the INT4 kernel
//! against coremltools.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use super::build::summary;
use super::side_files::{rate, rope_positions, Outcome, MIB};
use super::{resolve_checkpoint, ExitStatus};
use crate::checkpoint::{Checkpoint, TensorInfo};
use crate::cli::{
    BenchBuildCmd, BenchCmd, BenchParityCmd, BenchSideFilesCmd, BuildComparison, ParityComparison,
};
use crate::config::TextConfig;
use crate::progress::peak_rss_bytes;
use crate::records::{BuildRecord, FunctionRecord, PassPipeline, PassStat, Seconds, Verdict};
use crate::settings::{
    BuildCommand, BuildSettings, Env, ParityCommand, ParitySettings, JOINT_ENV, SHORTCUTS_ENV,
    WRITER_ENV,
};
use crate::{bench_matmul, bench_palettize, bench_run, hashbench, heap, sidefiles};

pub fn run(what: BenchCmd, verbose: bool) -> Result<ExitStatus> {
    match what {
        BenchCmd::Hash(args) => hashbench::run(&args)?,
        BenchCmd::Parity(args) => match args.compare {
            Some(what) => bench_parity_pair(what)?,
            None => bench_parity(&args, verbose)?,
        },
        BenchCmd::Build(args) => bench_build(args, verbose)?,
        BenchCmd::SideFiles(args) => bench_side_files(args, verbose)?,
        BenchCmd::Matmul { json, quick, isa } => bench_matmul::run(json, quick, isa.as_deref())?,
        BenchCmd::Run(args) => bench_run::run(&bench_run::BenchRunOptions {
            release: &args.release_dir,
            checkpoint: args.hf_dir.clone(),
            prompt: &args.prompt,
            prompt_tokens: args.prompt_tokens,
            max_tokens: args.max_tokens,
            baseline: !args.no_baseline,
            json: args.json,
        })?,
        BenchCmd::Palettize { json, quick, seed } => {
            bench_palettize::run(json, quick, seed, verbose)?
        }
    }
    Ok(ExitStatus::Success)
}

/// `bench parity`: one parity run, its wall time and peak RSS, and the
/// weights it made by source and form.
fn bench_parity(args: &BenchParityCmd, verbose: bool) -> Result<()> {
    // The weights made, written by the parity run at its end (the interpreter
    // starts below and reads its environment then).
    let stats = std::env::var_os(WEIGHT_STATS_ENV)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            let path = std::env::temp_dir().join(format!(
                "chunkforge-bench-parity-weights-{}.json",
                std::process::id()
            ));
            std::env::set_var(WEIGHT_STATS_ENV, &path);
            path
        });
    let started = Instant::now();
    // The build's context length, as `parity --artifacts` takes it.
    let build = args
        .artifacts
        .as_deref()
        .map(super::parity::artifacts_build)
        .transpose()?;
    let settings = ParitySettings::resolve(ParityCommand::Bench(args), build.as_ref())?;
    let verdict = super::parity::check(args.model.hf_dir.as_deref(), &settings, verbose)?;
    let run = ParityRun {
        seconds: started.elapsed().as_secs_f64(),
        peak_rss_bytes: peak_rss_bytes(),
        verdict: match verdict {
            Verdict::Ok => "passed",
            Verdict::Inconclusive => "INCONCLUSIVE",
            Verdict::Fail => "FAILED",
        }
        .into(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&run)?);
    } else {
        println!(
            "bench parity --mode {} --steps {} --prefill {}{}: wall {:.1}s (including interpreter start and imports), peak RSS {:.0} MiB, {}",
            args.mode,
            args.steps,
            args.prefill,
            if args.artifacts.is_some() { " --artifacts" } else { "" },
            run.seconds,
            run.peak_rss_bytes as f64 / MIB,
            run.verdict
        );
        if let Ok(bytes) = fs::read(&stats) {
            let made: serde_json::Value = serde_json::from_slice(&bytes)?;
            print!("{}", render_made(&made));
        }
    }
    Ok(())
}

/// The weights a parity run made (`weights.write_stats`), by source and
/// form, and the float32 projections made for parity's own products.
fn render_made(stats: &serde_json::Value) -> String {
    let rows = stats["made"].as_array().cloned().unwrap_or_default();
    let mut s = String::from("weights made (kept by the resident budget or made for one use):\n");
    s += &format!(
        "  {:<13} {:<8} {:>8} {:>10}\n",
        "for", "form", "makes", "GiB"
    );
    let mut dense_own = 0u64;
    for r in &rows {
        let (source, form) = (
            r["source"].as_str().unwrap_or("?"),
            r["form"].as_str().unwrap_or("?"),
        );
        let bytes = r["bytes"].as_u64().unwrap_or(0);
        if source != "transformers" && matches!(form, "float32" | "float64") {
            dense_own += bytes;
        }
        s += &format!(
            "  {source:<13} {form:<8} {:>8} {:>10.2}\n",
            r["makes"].as_u64().unwrap_or(0),
            bytes as f64 / (1u64 << 30) as f64
        );
    }
    s += &format!(
        "float32 weights made for parity's own products: {:.2} GiB (transformers, the oracle, \
         multiplies float tensors: its layers' weights are made for each call)\n",
        dense_own as f64 / (1u64 << 30) as f64
    );
    s
}

/// One `bench parity --json` child's figures.
#[derive(serde::Serialize, serde::Deserialize)]
struct ParityRun {
    seconds: f64,
    peak_rss_bytes: u64,
    verdict: String,
}

/// One `bench parity --compare` value's row: the environment variable the
/// two child runs differ by, each run's label and value (the baseline
/// first), what both runs also set, how far the reports' floats may differ,
/// and how the result is named.
struct ParityRow {
    env: &'static str,
    runs: [(&'static str, &'static str); 2],
    common_env: &'static [(&'static str, &'static str)],
    float_tolerance: f64,
    versus: &'static str,
}

impl ParityComparison {
    fn row(self) -> ParityRow {
        match self {
            // Step by step (each layout's steps one after another, each
            // through every chunk, as before) and chunk by chunk (each chunk
            // over every step, `stepper.schedule`).
            ParityComparison::Order => ParityRow {
                env: PARITY_ORDER_ENV,
                runs: [
                    ("step by step (before)", "step"),
                    ("chunk by chunk (default)", "chunk"),
                ],
                common_env: &[],
                float_tolerance: 1e-9,
                versus: "chunk by chunk vs step by step",
            },
            // Weights past the resident budget are made again at each use,
            // into fresh pages or into memory the process already holds (heap.rs).
            ParityComparison::Heap => ParityRow {
                env: heap::ENV,
                runs: [
                    ("heap released (default)", heap::Policy::Release.name()),
                    (
                        "heap kept (CHUNKFORGE_HEAP=keep)",
                        heap::Policy::Keep.name(),
                    ),
                ],
                common_env: &[],
                float_tolerance: 1e-9,
                versus: "heap kept vs released",
            },
            // From unpacked indices or from their stored bytes
            // (`ops.lut_nibbles_to_dense`), both with float32 weights and
            // torch's products (the kernels never dequantize).
            ParityComparison::Dequant => ParityRow {
                env: DEQUANT_ENV,
                runs: [
                    ("indices unpacked (before)", "unpack"),
                    ("from the stored bytes", "nibbles"),
                ],
                common_env: &[(MATMUL_ENV, "dense")],
                float_tolerance: 1e-9,
                versus: "stored bytes vs unpacked",
            },
            // The products differ in the order of their sums, so the
            // reports' floats may differ in their last bits: every other
            // value must agree.
            ParityComparison::Matmul => ParityRow {
                env: MATMUL_ENV,
                runs: [
                    ("float32 weights, torch (before)", "dense"),
                    ("stored weights, kernels (default)", "native"),
                ],
                common_env: &[],
                float_tolerance: f64::INFINITY,
                versus: "native kernels vs float32 weights",
            },
        }
    }
}

/// One `bench build --compare` value's row: the environment variable the
/// two child builds differ by, each build's label and value (the reference
/// first), whether their packages must be byte-identical, the phases whose
/// seconds the result line sums (and what they are), and how it is named.
struct BuildRow {
    env: &'static str,
    runs: [(&'static str, &'static str); 2],
    identical: bool,
    phases: &'static [&'static str],
    phases_are: &'static str,
    versus: &'static str,
    /// Refused with `--pass-pipeline coremltools` (its pipeline is the one compared).
    needs_own_pipeline: bool,
}

impl BuildComparison {
    fn row(self) -> BuildRow {
        match self {
            // The allocator cannot change a value.
            BuildComparison::Heap => BuildRow {
                env: heap::ENV,
                runs: [
                    ("heap released (default)", heap::Policy::Release.name()),
                    (
                        "heap kept (CHUNKFORGE_HEAP=keep)",
                        heap::Policy::Keep.name(),
                    ),
                ],
                identical: true,
                phases: &[],
                phases_are: "",
                versus: "heap kept vs released",
                needs_own_pipeline: false,
            },
            // save_multifunction and ct.convert of the loaded program, or
            // chunkforge's protobuf-level writer.
            BuildComparison::Writer => BuildRow {
                env: WRITER_ENV,
                runs: [
                    ("coremltools writer", "coremltools"),
                    ("chunkforge writer (default)", "chunkforge"),
                ],
                identical: true,
                phases: &["bundle", "compose"],
                phases_are: "of bundles and compositions",
                versus: "chunkforge's writer vs coremltools'",
                needs_own_pipeline: false,
            },
            // Conversions of packages and of the sources of composed ones.
            BuildComparison::Shortcuts => BuildRow {
                env: SHORTCUTS_ENV,
                runs: [
                    ("coremltools' code (shortcuts off)", "off"),
                    ("shortcuts on (default)", "on"),
                ],
                identical: true,
                phases: &["convert", "sources"],
                phases_are: "of conversions",
                versus: "shortcuts vs coremltools' code",
                needs_own_pipeline: true,
            },
            // The names of the ops the trace numbers differ
            // (python/tests/test_joint.py checks the programs compute the
            // same bits and the weights are the same bytes).
            BuildComparison::Joint => BuildRow {
                env: JOINT_ENV,
                runs: [
                    ("one conversion per function", "off"),
                    ("functions together (default)", "on"),
                ],
                identical: false,
                phases: &["load", "trace", "convert", "palettize", "save", "sources"],
                phases_are: "of load, trace, conversion, palettization and save",
                versus: "functions together vs one conversion each",
                needs_own_pipeline: false,
            },
        }
    }
}

/// This process's arguments without `--compare VALUE` (or `--compare=VALUE`)
/// and without `flag`: what each child of a side-by-side bench runs.
fn child_argv(flag: Option<&str>) -> Vec<std::ffi::OsString> {
    without_compare(std::env::args_os().skip(1), flag)
}

/// `args` without `--compare VALUE`, `--compare=VALUE` and `flag`.
fn without_compare(
    args: impl IntoIterator<Item = std::ffi::OsString>,
    flag: Option<&str>,
) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        if a == "--compare" {
            args.next();
        } else if a.to_string_lossy().starts_with("--compare=")
            || Some(&*a.to_string_lossy()) == flag
        {
            continue;
        } else {
            out.push(a);
        }
    }
    out
}

/// `bench parity --compare`: the same parity run twice, each in a child
/// process of its own (`ParityComparison::row`), side by side. Fails unless
/// the two reports agree: the same values, every float within the row's
/// tolerance (1e-9 but for `matmul`: the cache cosines of the packages'
/// programs are summed chunk by chunk, so their last bits may differ between
/// orders).
fn bench_parity_pair(what: ParityComparison) -> Result<()> {
    let pair = what.row();
    let exe = std::env::current_exe().context("cannot find the chunkforge executable")?;
    let argv = child_argv(None);
    let tmp = std::env::temp_dir().join(format!("chunkforge-bench-parity-{}", std::process::id()));
    fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let runs = parity_children(what, &exe, &argv, &tmp);
    let _ = fs::remove_dir_all(&tmp);
    let runs = runs?;
    println!(
        "{:<32} {:>9} {:>11} {:>15} {:>8}  verdict",
        "parity", "wall", "peak RSS", "weights made", "makes"
    );
    for (label, run, made, _) in &runs {
        println!(
            "{label:<32} {:>8.1}s {:>7.0} MiB {:>11.1} MiB {:>8}  {}",
            run.seconds,
            run.peak_rss_bytes as f64 / MIB,
            made.bytes as f64 / MIB,
            made.makes,
            run.verdict
        );
    }
    println!(
        "(weights made: projections and program constants made from the checkpoint or the \
         packages through the resident budget of {:.1} MiB, kept or not)",
        runs[0].2.budget as f64 / MIB
    );
    let (before, after) = (&runs[0], &runs[1]);
    let mut diff = ReportDiff {
        tolerance: pair.float_tolerance,
        ..ReportDiff::default()
    };
    diff.walk("", &before.3, &after.3);
    if let Some(first) = diff.mismatches.first() {
        bail!(
            "the two runs' reports differ in {} value(s), first {first}",
            diff.mismatches.len()
        );
    }
    println!(
        "{}: {:.2}x faster wall, {:.2}x the peak RSS, {:.2}x the weights made; reports agree ({} values, {} floats differ, by at most {:.1e})",
        pair.versus,
        before.1.seconds / after.1.seconds.max(1e-9),
        after.1.peak_rss_bytes as f64 / (before.1.peak_rss_bytes as f64).max(1.0),
        after.2.bytes as f64 / (before.2.bytes as f64).max(1.0),
        diff.values,
        diff.floats_differing,
        diff.largest
    );
    Ok(())
}

/// The two children of `bench parity --compare what`, their reports in `tmp`.
fn parity_children(
    what: ParityComparison,
    exe: &Path,
    argv: &[std::ffi::OsString],
    tmp: &Path,
) -> Result<Vec<(&'static str, ParityRun, WeightsMade, serde_json::Value)>> {
    let mut runs = Vec::new();
    let pair = what.row();
    let env = pair.env;
    for (i, (label, value)) in pair.runs.into_iter().enumerate() {
        let report = tmp.join(format!("{i}.json"));
        let stats = tmp.join(format!("{i}-weights.json"));
        eprintln!("bench parity --compare {what}: {env}={value}");
        let out = Command::new(exe)
            .args(argv)
            .arg("--json")
            .arg("--report")
            .arg(&report)
            .env(env, value)
            .envs(pair.common_env.iter().copied())
            .env(WEIGHT_STATS_ENV, &stats)
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("{}: cannot run", exe.display()))?;
        if !out.status.success() {
            bail!("bench parity {env}={value} failed ({})", out.status);
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let run: ParityRun = serde_json::from_str(text.lines().last().unwrap_or(""))
            .with_context(|| format!("bench parity {env}={value}: no figures"))?;
        let read = |path: &Path| -> Result<serde_json::Value> {
            let bytes = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_slice(&bytes).with_context(|| format!("reading {}", path.display()))
        };
        let (report, stats) = (read(&report)?, read(&stats)?);
        let made = WeightsMade {
            makes: stats["makes"].as_u64().unwrap_or(0),
            bytes: stats["made_bytes"].as_u64().unwrap_or(0),
            budget: stats["budget"].as_u64().unwrap_or(0),
        };
        runs.push((label, run, made, report));
    }
    Ok(runs)
}

/// See `python/chunkforge_py/emulate/stepper.py` (`ORDER_ENV`).
const PARITY_ORDER_ENV: &str = "CHUNKFORGE_PARITY_ORDER";
/// How the interpreter dequantizes 4-bit weights (python/chunkforge_py/mil/interp.py).
const DEQUANT_ENV: &str = "CHUNKFORGE_DEQUANT";
/// See `python/chunkforge_py/weights.py` (`STATS_ENV`).
const WEIGHT_STATS_ENV: &str = "CHUNKFORGE_WEIGHT_STATS";
/// How projections multiply (python/chunkforge_py/weights.py, `MATMUL_ENV`).
pub(crate) const MATMUL_ENV: &str = "CHUNKFORGE_MATMUL";

/// What a parity child made through `weights.RESIDENT`.
struct WeightsMade {
    makes: u64,
    bytes: u64,
    budget: u64,
}

/// Two parity reports compared value by value: floats within 1e-9, the
/// run's `seconds` left out, everything else equal.
#[derive(Default)]
struct ReportDiff {
    /// How far two floats may differ (0 from `Default`: read as 1e-9).
    tolerance: f64,
    values: usize,
    floats_differing: usize,
    largest: f64,
    mismatches: Vec<String>,
}

impl ReportDiff {
    fn walk(&mut self, path: &str, a: &serde_json::Value, b: &serde_json::Value) {
        use serde_json::Value;
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                if x.len() != y.len() || x.keys().any(|k| !y.contains_key(k)) {
                    self.mismatches.push(format!("{path}: other fields"));
                    return;
                }
                for (k, v) in x.iter().filter(|(k, _)| k.as_str() != "seconds") {
                    self.walk(&format!("{path}.{k}"), v, &y[k]);
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (u, v)) in x.iter().zip(y).enumerate() {
                    self.walk(&format!("{path}[{i}]"), u, v);
                }
            }
            (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
                self.values += 1;
                let d = (x.as_f64().unwrap_or(f64::NAN) - y.as_f64().unwrap_or(f64::NAN)).abs();
                if d > 0.0 {
                    self.floats_differing += 1;
                    self.largest = self.largest.max(d);
                }
                let tolerance = if self.tolerance > 0.0 {
                    self.tolerance
                } else {
                    1e-9
                };
                if d.is_nan() || d > tolerance {
                    self.mismatches.push(format!("{path}: {x} vs {y}"));
                }
            }
            _ => {
                self.values += 1;
                if a != b {
                    self.mismatches.push(format!("{path}: {a} vs {b}"));
                }
            }
        }
    }
}

fn bench_build(args: BenchBuildCmd, verbose: bool) -> Result<()> {
    if args.baseline {
        return bench_build_baseline();
    }
    if let Some(what) = args.compare {
        refuse_pipeline(what, &args)?;
        return bench_build_compare(what);
    }
    let tmp = std::env::temp_dir().join(format!("chunkforge-bench-{}", std::process::id()));
    let settings = BuildSettings::resolve(BuildCommand::Bench(&args), &Env::process())?;
    let result = super::build::build(&settings, &tmp, verbose);
    // The side files a release of this build carries, written where the
    // packages are (what `package` adds to the build).
    let side = result
        .as_ref()
        .ok()
        .map(|record| -> Result<sidefiles::SideFilesReport> {
            let dir = resolve_checkpoint(args.model.hf_dir.as_deref(), verbose)?;
            let cfg = TextConfig::load(&dir)?;
            let ckpt = Checkpoint::open(&dir, &cfg)?;
            let ctx = record.settings.ctx;
            Ok(sidefiles::write_side_files(&sidefiles::SideFilesRequest {
                hf_dir: &dir,
                cfg: &cfg,
                checkpoint: &ckpt,
                context_length: ctx,
                rope_positions: ctx,
                model_name: "bench",
                dest: &tmp,
                repository: false,
            })?)
        });
    let _ = std::fs::remove_dir_all(&tmp);
    let record = result?;
    let side = side.transpose()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&record)?);
    } else {
        print_phases(&record);
        if args.profile {
            print_pass_profile(&record);
        }
        println!("{}", summary(&record, &tmp));
        if let Some(s) = side {
            let mib = s.bytes_written() as f64 / MIB;
            println!(
                "side files: {} files, {mib:.1} MiB in {:.2}s ({:.0} MiB/s); peak RSS of the whole run {:.0} MiB",
                s.files.len(),
                s.seconds,
                mib / s.seconds.max(1e-9),
                peak_rss_bytes() as f64 / MIB
            );
        }
    }
    Ok(())
}

/// `bench build --baseline`: this same command three times, each in a child
/// process of its own (own peak RSS, cold Python), with `--json`: coremltools'
/// default pass pipeline without composition in one process, chunkforge's in
/// one process, chunkforge's with `--jobs auto`; one table of all three.
fn bench_build_baseline() -> Result<()> {
    let before = [
        "--pass-pipeline",
        "coremltools",
        "--no-compose",
        "--jobs",
        "1",
    ];
    let one = ["--pass-pipeline", "chunkforge", "--jobs", "1"];
    let shipped = ["--pass-pipeline", "chunkforge", "--jobs", "auto"];
    let runs = bench_children(
        "--baseline",
        &[
            (
                "coremltools pipeline, no compose",
                &before[..],
                &[(WRITER_ENV, "coremltools")],
            ),
            ("chunkforge, one process", &one[..], &[]),
            ("chunkforge (shipped, --jobs auto)", &shipped[..], &[]),
        ],
    )?;
    print_children(&runs);
    let (a, one, b) = (&runs[0].1, &runs[1].1, &runs[2].1);
    same_packages(one, b, "one process and --jobs auto")?;
    println!(
        "--jobs auto ({} processes) vs one process: {}; every package byte-identical",
        b.processes,
        speedup(one, b),
    );
    // Converted packages must be byte-identical; composed ones are other
    // programs (same values: python/tests/test_compose.py).
    let mut identical = 0;
    let mut composed = 0;
    for (x, y) in a.chunks.iter().zip(&b.chunks) {
        if y.composed_from.is_some() {
            composed += 1;
        } else if x.package == y.package && x.sha256_tree == y.sha256_tree {
            identical += 1;
        } else {
            bail!(
                "{}: the two builds converted different packages ({} vs {})",
                y.package,
                x.sha256_tree,
                y.sha256_tree
            );
        }
    }
    println!(
        "shipped vs before: {}; {identical} converted packages byte-identical, {composed} composed",
        speedup(a, b),
    );
    Ok(())
}

/// One child build of a side-by-side bench: its label, its extra arguments
/// and the environment variables it runs with (else it inherits this
/// process's).
type Child<'a> = (&'static str, &'a [&'a str], &'a [(&'a str, &'a str)]);

/// This `bench build` command once per child, each in a process of its own
/// (own peak RSS, cold Python) with `--json`, without the bench flag `flag`
/// that asked for them.
fn bench_children(flag: &str, children: &[Child]) -> Result<Vec<(&'static str, BuildRecord)>> {
    let exe = std::env::current_exe().context("cannot find the chunkforge executable")?;
    let argv = child_argv(Some(flag));
    let mut runs = Vec::new();
    for (label, extra, env) in children {
        let mut what = extra.join(" ");
        let mut cmd = Command::new(&exe);
        cmd.args(&argv).arg("--json").args(*extra);
        for (key, value) in env.iter().rev() {
            cmd.env(key, value);
            what = format!("{key}={value} {what}");
        }
        eprintln!("bench build {flag}: {}", what.trim());
        let out = cmd
            .stderr(std::process::Stdio::inherit())
            .output()
            .with_context(|| format!("{}: cannot run", exe.display()))?;
        if !out.status.success() {
            bail!("bench build {} failed ({})", what.trim(), out.status);
        }
        let record: BuildRecord = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("bench build {}: unreadable report", what.trim()))?;
        runs.push((*label, record));
    }
    Ok(runs)
}

/// Fails unless the two builds made the same packages, byte for byte.
fn same_packages(x: &BuildRecord, y: &BuildRecord, who: &str) -> Result<()> {
    for (a, b) in x.chunks.iter().zip(&y.chunks) {
        if a.package != b.package || a.sha256_tree != b.sha256_tree {
            bail!(
                "{}: {who} built different packages ({} vs {})",
                b.package,
                a.sha256_tree,
                b.sha256_tree
            );
        }
    }
    Ok(())
}

/// One table of the children's builds.
fn print_children(runs: &[(&str, BuildRecord)]) {
    // Phase seconds are summed over processes: with workers they exceed the wall time.
    println!(
        "{:<34} {:>8} {:>8} {:>8} {:>8} {:>8} {:>11} {:>5}  packages",
        "build", "wall", "convert", "sources", "compose", "bundle", "peak RSS", "procs"
    );
    for (label, r) in runs {
        let phase = |k: &str| phase_seconds(r, &[k]);
        println!(
            "{label:<34} {:>7.1}s {:>7.1}s {:>7.1}s {:>7.1}s {:>7.1}s {:>7.0} MiB {:>5}  {}",
            r.seconds.total,
            phase("convert"),
            phase("sources"),
            phase("compose"),
            phase("bundle"),
            r.peak_rss_bytes as f64 / MIB,
            r.processes,
            r.chunks.len()
        );
    }
}

/// Seconds of the phases `keys` of a build, summed (over processes).
fn phase_seconds(r: &BuildRecord, keys: &[&str]) -> f64 {
    // An empty float sum is -0.0 (printed "-0.0s"); adding 0.0 makes it +0.0.
    keys.iter()
        .filter_map(|k| r.seconds.phases.get(*k))
        .sum::<f64>()
        + 0.0
}

/// "{wall speed-up}x faster wall, {peak ratio}x the peak RSS" of `ours`
/// against `reference`.
fn speedup(reference: &BuildRecord, ours: &BuildRecord) -> String {
    format!(
        "{:.2}x faster wall, {:.2}x the peak RSS",
        reference.seconds.total / ours.seconds.total.max(1e-9),
        ours.peak_rss_bytes as f64 / (reference.peak_rss_bytes as f64).max(1.0)
    )
}

/// `--compare shortcuts` compares the shortcuts through chunkforge's pass
/// pipeline: refused with another one.
fn refuse_pipeline(what: BuildComparison, args: &BenchBuildCmd) -> Result<()> {
    let pipeline = args.conversion.pass_pipeline;
    if what.row().needs_own_pipeline && pipeline != PassPipeline::Chunkforge {
        bail!("bench build --compare {what} compares chunkforge's pass pipeline: it cannot run with --pass-pipeline {pipeline}");
    }
    Ok(())
}

/// `bench build --compare what`: the same build twice, each in a child
/// process of its own, differing only in the row's environment variable
/// (`BuildComparison::row`: the reference's value, then the default's),
/// side by side; fails unless every package is byte-identical where the row
/// says they must be.
fn bench_build_compare(what: BuildComparison) -> Result<()> {
    let row = what.row();
    let flag = format!("--compare {what}");
    let [reference, default] = row.runs;
    let runs = bench_children(
        &flag,
        &[
            (reference.0, &[], &[(row.env, reference.1)]),
            (default.0, &[], &[(row.env, default.1)]),
        ],
    )?;
    print_children(&runs);
    let (x, y) = (&runs[0].1, &runs[1].1);
    let mut line = format!("{}: {}", row.versus, speedup(x, y));
    if !row.phases.is_empty() {
        line += &format!(
            " ({:.1}s vs {:.1}s {})",
            phase_seconds(y, row.phases),
            phase_seconds(x, row.phases),
            row.phases_are
        );
    }
    if row.identical {
        same_packages(x, y, &format!("the two runs of --compare {what}"))?;
        line += &format!("; all {} packages byte-identical", y.chunks.len());
    }
    println!("{line}");
    Ok(())
}

/// `bench build --profile`: seconds per coremltools graph pass over the whole
/// build (with its runs and the runs that changed the program), then the
/// passes that took most of each package's time.
fn print_pass_profile(record: &BuildRecord) {
    let mut total: BTreeMap<&str, PassStat> = BTreeMap::new();
    let mut per_package = Vec::new();
    let sources: Vec<(String, &[FunctionRecord])> = record
        .sources
        .iter()
        .map(|f| (format!("(source) {}", f.name), std::slice::from_ref(f)))
        .collect();
    let packages = sources.into_iter().chain(
        record
            .chunks
            .iter()
            .map(|c| (c.name.clone(), c.functions.as_slice())),
    );
    for (name, functions) in packages {
        let mut mine: BTreeMap<&str, f64> = BTreeMap::new();
        for f in functions {
            for (name, s) in f.passes.iter().flatten() {
                let t = total.entry(name).or_insert(PassStat {
                    seconds: 0.0,
                    runs: 0,
                    changed: Some(0),
                });
                t.seconds += s.seconds;
                t.runs += s.runs;
                t.changed = match (t.changed, s.changed) {
                    (Some(a), Some(b)) => Some(a + b),
                    _ => None,
                };
                *mine.entry(name).or_default() += s.seconds;
            }
        }
        per_package.push((name, mine));
    }
    let mut rows: Vec<_> = total.into_iter().collect();
    rows.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
    let all: f64 = rows.iter().map(|(_, s)| s.seconds).sum();
    println!();
    println!(
        "{:<58} {:>6} {:>8} {:>9} {:>6}",
        "graph pass (all conversions)", "runs", "changed", "seconds", "share"
    );
    for (name, s) in &rows {
        println!(
            "{name:<58} {:>6} {:>8} {:>8.2}s {:>5.1}%",
            s.runs,
            s.changed.map_or("-".to_string(), |c| c.to_string()),
            s.seconds,
            100.0 * s.seconds / all.max(1e-9)
        );
    }
    println!("{:<58} {:>6} {:>8} {all:>8.2}s", "total", "", "");
    println!();
    for (name, mine) in per_package {
        let sum: f64 = mine.values().sum();
        let mut top: Vec<_> = mine.into_iter().collect();
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top: Vec<String> = top
            .iter()
            .take(4)
            .map(|(p, s)| format!("{} {s:.2}s", p.trim_start_matches("common::")))
            .collect();
        println!("{name:<28} passes {sum:>7.2}s: {}", top.join(", "));
    }
    println!();
}

/// Seconds per phase of every package and, for a multifunction one, of each function.
fn print_phases(record: &BuildRecord) {
    const COLS: [&str; 7] = [
        "load",
        "trace",
        "convert",
        "palettize",
        "compose",
        "save",
        "bundle",
    ];
    const WIDTHS: [usize; 7] = [7, 7, 8, 10, 8, 7, 7];
    print!("{:<30}", "package / function");
    for (c, w) in COLS.iter().zip(WIDTHS) {
        print!(" {c:>w$}");
    }
    println!(" {:>8}", "total");
    let row = |label: &str, secs: &Seconds| {
        let s = |k: &str| secs.get(k).copied().unwrap_or(0.0);
        print!("{label:<30}");
        for (c, w) in COLS.iter().zip(WIDTHS) {
            print!(" {:>w$.1}s", s(c), w = w - 1);
        }
        println!(" {:>7.1}s", COLS.iter().map(|k| s(k)).sum::<f64>());
    };
    // Four-chunk programs converted only to compose from.
    for f in &record.sources {
        row(&format!("(source) {}", f.name), &f.seconds);
    }
    for c in &record.chunks {
        row(&c.name, &c.seconds);
        if c.functions.len() > 1 {
            for f in &c.functions {
                row(&format!("  {}", f.name), &f.seconds);
            }
        }
    }
}

/// `side-files` in a child process of its own (so its peak RSS is its own,
/// not this process's, which may have started Python for the default
/// checkpoint), then, into the same folder, a plain write of as many bytes
/// and a plain copy (the same tensor bytes read, as many bytes written, no
/// conversion: what `cp` would do), each ending with an fsync.
fn bench_side_files(args: BenchSideFilesCmd, verbose: bool) -> Result<()> {
    let rope = rope_positions(&args.options)?;
    let ckpt = resolve_checkpoint(args.model.hf_dir.as_deref(), verbose)?;
    let cfg = TextConfig::load(&ckpt)?;
    let sources = sidefiles::source_tensors(&Checkpoint::open(&ckpt, &cfg)?);
    let base = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let tmp = base.join(format!(
        "chunkforge-bench-side-files-{}",
        std::process::id()
    ));
    fs::create_dir_all(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    // Interleaved rounds, so each contender meets the same page-cache and
    // writeback state in turn; the best round of each is kept.
    let mut best: Option<(Outcome, f64, Timing, Timing)> = None;
    let mut result = Ok(());
    for _ in 0..args.repeat.max(1) {
        match measure_side_files(&args, &ckpt, rope, &sources, &tmp) {
            Ok(round) => best = Some(better(best, round)),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let _ = fs::remove_dir_all(&tmp);
    result?;
    let (child, wall, plain, copy) = best.expect("at least one round");
    let written = child.bytes_written;
    println!(
        "bench side-files: {} (ctx {}, {} RoPE rows): {} files, {:.1} MiB written from {:.1} MiB of tensors, in {}; best of {}",
        ckpt.display(),
        args.options.ctx,
        rope,
        child.files.len(),
        written as f64 / MIB,
        child.bytes_read as f64 / MIB,
        base.display(),
        args.repeat.max(1)
    );
    println!(
        "{:<38} {:>8} {:>9} {:>11} {:>9} {:>12}",
        "", "write", "MiB/s", "+ fsync", "MiB/s", "peak RSS"
    );
    let row = |label: &str, write: f64, total: f64, rss: Option<u64>| {
        println!(
            "{label:<38} {write:>7.2}s {:>9.0} {total:>10.2}s {:>9.0} {:>12}",
            rate(written, write),
            rate(written, total),
            rss.map_or(String::new(), |r| format!("{:.0} MiB", r as f64 / MIB))
        )
    };
    row(
        "chunkforge side-files",
        child.write_seconds,
        child.total_seconds,
        Some(child.peak_rss_bytes),
    );
    row("plain write, same bytes", plain.0, plain.0 + plain.1, None);
    row(
        "plain copy (same tensor bytes read)",
        copy.0,
        copy.0 + copy.1,
        None,
    );
    println!(
        "side-files takes {:.2}x the plain copy's time ({:.2}x with fsync), {:.2}x the plain write's; \
         child wall {wall:.2}s (process start and checkpoint headers included). The first \
         round reads the checkpoint from wherever it is (disk or page cache).",
        child.write_seconds / copy.0.max(1e-9),
        child.total_seconds / (copy.0 + copy.1).max(1e-9),
        child.write_seconds / plain.0.max(1e-9),
    );
    Ok(())
}

/// Seconds of a write and of its fsync.
type Timing = (f64, f64);

/// The best of two rounds, contender by contender (by time with fsync).
fn better(
    best: Option<(Outcome, f64, Timing, Timing)>,
    round: (Outcome, f64, Timing, Timing),
) -> (Outcome, f64, Timing, Timing) {
    let Some(b) = best else {
        return round;
    };
    let total = |t: &Timing| t.0 + t.1;
    let (child, wall) = if round.0.total_seconds < b.0.total_seconds {
        (round.0, round.1)
    } else {
        (b.0, b.1)
    };
    let plain = if total(&round.2) < total(&b.2) {
        round.2
    } else {
        b.2
    };
    let copy = if total(&round.3) < total(&b.3) {
        round.3
    } else {
        b.3
    };
    (child, wall, plain, copy)
}

/// The child's report and wall time, then the plain write and the plain copy.
fn measure_side_files(
    args: &BenchSideFilesCmd,
    ckpt: &Path,
    rope: usize,
    sources: &[TensorInfo],
    tmp: &Path,
) -> Result<(Outcome, f64, Timing, Timing)> {
    let exe = std::env::current_exe().context("cannot find the chunkforge executable")?;
    let out = tmp.join("side-files");
    let mut cmd = Command::new(exe);
    cmd.arg("side-files")
        .arg("--hf-dir")
        .arg(ckpt)
        .args(["--ctx", &args.options.ctx.to_string()])
        .args(["--rope-positions", &rope.to_string()])
        .arg("--output")
        .arg(&out)
        .arg("--json");
    if let Some(name) = &args.options.model_name {
        cmd.args(["--model-name", name]);
    }
    let started = Instant::now();
    let child = cmd.output().context("cannot start chunkforge side-files")?;
    let wall = started.elapsed().as_secs_f64();
    if !child.status.success() {
        bail!(
            "chunkforge side-files failed: {}",
            String::from_utf8_lossy(&child.stderr).trim()
        );
    }
    let outcome: Outcome = serde_json::from_slice(&child.stdout)
        .context("chunkforge side-files --json printed something else than its report")?;
    let _ = fs::remove_dir_all(&out);
    let plain = plain_io(&tmp.join("plain.bin"), &[], outcome.bytes_written)?;
    let copy = plain_io(&tmp.join("copy.bin"), sources, outcome.bytes_written)?;
    Ok((outcome, wall, plain, copy))
}

/// Writes `bytes` bytes to `path` in 8 MiB writes, then fsyncs. With
/// `sources`, their bytes are read in 8 MiB blocks first and each block's
/// share of `bytes` is written from it (a `cp` of the tensors, shrunk to the
/// output's size); without, pseudo-random bytes are written.
fn plain_io(path: &Path, sources: &[TensorInfo], bytes: u64) -> Result<Timing> {
    const BLOCK: u64 = 8 << 20;
    let mut buf = vec![0u8; BLOCK as usize];
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    for w in buf.chunks_exact_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        w.copy_from_slice(&s.to_le_bytes());
    }
    let started = Instant::now();
    let mut f =
        fs::File::create(path).with_context(|| format!("{}: cannot create", path.display()))?;
    let mut write = |data: &[u8]| {
        f.write_all(data)
            .with_context(|| format!("{}: write failed (disk full?)", path.display()))
    };
    let mut left = bytes;
    let total_read: u64 = sources.iter().map(|t| t.bytes).sum();
    for t in sources {
        let src = fs::File::open(&t.file)
            .with_context(|| format!("{}: cannot open", t.file.display()))?;
        let mut at = 0;
        while at < t.bytes {
            let n = BLOCK.min(t.bytes - at);
            src.read_exact_at(&mut buf[..n as usize], t.offset + at)
                .with_context(|| format!("{}: read failed", t.file.display()))?;
            let share = (n as u128 * bytes as u128).div_ceil(total_read as u128) as u64;
            let share = share.min(left).min(n);
            write(&buf[..share as usize])?;
            left -= share;
            at += n;
        }
    }
    while left > 0 {
        let n = left.min(BLOCK);
        write(&buf[..n as usize])?;
        left -= n;
    }
    let written = started.elapsed().as_secs_f64();
    f.sync_all()
        .with_context(|| format!("{}: fsync failed", path.display()))?;
    let sync = started.elapsed().as_secs_f64() - written;
    drop(f);
    let _ = fs::remove_file(path);
    Ok((written, sync))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn children_run_without_the_comparison() {
        let args = [
            "parity",
            "--compare",
            "heap",
            "--steps",
            "4",
            "--compare=order",
            "--baseline",
        ];
        let kept = without_compare(args.map(Into::into), Some("--baseline"));
        assert_eq!(
            kept,
            ["parity", "--steps", "4"].map(std::ffi::OsString::from)
        );
    }

    /// `--compare shortcuts` compares chunkforge's pass pipeline: refused
    /// with coremltools', accepted with the default.
    #[test]
    fn shortcuts_comparison_refuses_another_pipeline() {
        let parse = |extra: &[&str]| match crate::cli::Cli::try_parse_from(
            ["chunkforge", "bench", "build", "--compare", "shortcuts"]
                .iter()
                .chain(extra),
        )
        .unwrap()
        .command
        {
            crate::cli::Cmd::Bench {
                what: BenchCmd::Build(args),
            } => args,
            _ => unreachable!(),
        };
        let refused = refuse_pipeline(
            BuildComparison::Shortcuts,
            &parse(&["--pass-pipeline", "coremltools"]),
        );
        assert!(refused
            .unwrap_err()
            .to_string()
            .contains("--pass-pipeline coremltools"));
        refuse_pipeline(BuildComparison::Shortcuts, &parse(&[])).unwrap();
        refuse_pipeline(
            BuildComparison::Heap,
            &parse(&["--pass-pipeline", "coremltools"]),
        )
        .unwrap();
    }
}
