//! chunkforge: Gemma 4 checkpoint → Core ML decode chunk packages for the Apple
//! Neural Engine.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::json;

use chunkforge::plan::Mode;
use chunkforge::{
    args, bench_palettize, build, checkpoint, config, fixture, fsutil, hashbench, native, parity,
    plan, publish, pyenv, release, verify,
};

#[derive(Parser)]
#[command(
    name = "chunkforge",
    version,
    about = "Gemma 4 checkpoint -> Core ML decode chunk packages for the Apple Neural Engine"
)]
struct Cli {
    /// Show Python tracebacks and coremltools' own progress output.
    #[arg(long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// Hugging Face Gemma 4 checkpoint folder (config.json + safetensors). Without
    /// it (and without GEMMA4_HF_DIR) a small built-in random checkpoint is used.
    #[arg(long, env = "GEMMA4_HF_DIR")]
    hf_dir: Option<PathBuf>,
}

#[derive(Args, Clone)]
struct LayoutArgs {
    /// Layouts: four (chunk1..4 reference), three (chunk1..3_3way), two (merged_chunk1/2),
    /// one (merged_full), both (two+one), all (four with verify, three, two, one, prefill).
    #[arg(long, value_enum, default_value = "both")]
    mode: Mode,
    /// Custom split instead of --mode: contiguous layer ranges covering every layer, e.g. 0-11,12-23,24-34.
    #[arg(long)]
    split: Option<String>,
    /// Full-attention context length (KV cache entries), at most 131072.
    #[arg(long, default_value_t = 2048, value_parser = args::ctx)]
    ctx: usize,
    #[command(flatten)]
    functions: FunctionArgs,
}

#[derive(Args, Clone)]
struct FunctionArgs {
    /// Draft tokens of chunk1..4's verify_qK function (default with --mode all: 3).
    #[arg(long)]
    verify_k: Option<usize>,
    /// Tokens per batched prefill call of prefill_chunk1..4, one function per value,
    /// e.g. 64,128,512 (default with --mode all: 512).
    #[arg(long, value_delimiter = ',')]
    prefill_len: Option<Vec<usize>>,
}

impl FunctionArgs {
    fn resolve(&self, mode: Mode) -> plan::Functions {
        plan::Functions::resolve(mode, self.verify_k, self.prefill_len.as_deref())
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the Python interpreter, package versions, cache paths and what this platform cannot do.
    Doctor {
        /// Only print the path of the cached environment's python executable (for scripts).
        #[arg(long)]
        venv_python: bool,
    },
    /// Create (or update) the pinned Python environment in the cache folder.
    Setup,
    /// Print the chunk plan for a checkpoint: layer ranges, KV slots, producer KV, I/O contracts.
    Plan {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        layout: LayoutArgs,
        /// Print the plan as JSON (the same data every other step consumes).
        #[arg(long)]
        json: bool,
    },
    /// Convert a checkpoint into Core ML decode packages (.mlpackage) plus build.json.
    Build {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        layout: LayoutArgs,
        /// Output folder; packages appear there only when every one of them is complete.
        #[arg(long, required_unless_present = "check")]
        output: Option<PathBuf>,
        /// Rebuild the build in this folder (same checkpoint and settings, from its
        /// build.json) into a temporary folder and report whether every package is
        /// byte-identical.
        #[arg(long, conflicts_with = "output")]
        check: Option<PathBuf>,
        /// Skip INT4 palettization (FP16 weights).
        #[arg(long)]
        no_quantize: bool,
        /// coremltools k-means worker processes for palettization.
        #[arg(long, default_value_t = 1)]
        kmeans_workers: usize,
        // palette: begin
        /// INT4 palettizer: chunkforge (Rust kernel: optimal, deterministic, each distinct
        /// weight once per build) or coremltools (its own k-means, for comparison).
        #[arg(long, value_parser = ["chunkforge", "coremltools"], default_value = "chunkforge")]
        palettizer: String,
        // palette: end
        /// If another run is writing the same --output, fail at once instead of waiting for it.
        #[arg(long)]
        no_wait: bool,
    },
    /// Check merged layouts against the four-chunk reference and the reference against transformers (torch, fp32, CPU).
    Parity {
        #[command(flatten)]
        model: ModelArgs,
        /// Layouts to check: three, two, one, both, all (four checks only the reference against
        /// transformers; all also checks verify_qK and the prefill functions).
        #[arg(long, value_enum, default_value = "both")]
        mode: Mode,
        #[command(flatten)]
        functions: FunctionArgs,
        /// A custom split to check instead of --mode, e.g. 0-11,12-23,24-34.
        #[arg(long)]
        split: Option<String>,
        /// Decode steps (step t feeds prompt token t).
        #[arg(long, default_value_t = 16)]
        steps: usize,
        /// Minimum cosine of the final normed hidden state per step.
        #[arg(long, default_value_t = 0.9999, value_parser = args::cosine)]
        tol_cos: f64,
        /// Full-attention context length used for the caches, at most 131072.
        #[arg(long, default_value_t = 512, value_parser = args::ctx)]
        ctx: usize,
        /// Prompt token ids (comma-separated); default: parity/default_prompt.json.
        #[arg(long)]
        prompt_ids: Option<String>,
        /// Run the first N prompt tokens through the four-chunk reference, copy its KV
        /// slots into each layout (plan's slot map), then decode the rest with the layout.
        #[arg(long, default_value_t = 0)]
        prefill: usize,
        /// Read the INT4 weights back out of the packages in this build folder and
        /// report their agreement with the fp32 reference.
        #[arg(long)]
        artifacts: Option<PathBuf>,
        /// Minimum cosine per step for the INT4 artifacts.
        #[arg(long, default_value_t = 0.85, value_parser = args::cosine)]
        tol_cos_int4: f64,
        /// Minimum fraction of steps whose INT4 token equals the reference's.
        #[arg(long, default_value_t = 0.75, value_parser = args::fraction)]
        min_top1_int4: f64,
        /// Largest relative MSE (dequantized vs checkpoint) allowed for any INT4 weight.
        #[arg(long, default_value_t = 0.03, value_parser = args::non_negative)]
        max_weight_rel_mse: f64,
        /// Write the JSON report (schema: parity/report.schema.json) here.
        #[arg(long)]
        report: Option<PathBuf>,
        /// Skip the transformers oracle.
        #[arg(long)]
        no_oracle: bool,
        /// Testing aid: skip the prefill KV copy (shows the seed's integration bug).
        #[arg(long, hide = true)]
        skip_prefill_copy: bool,
        /// Testing aid: corrupt one weight of this layer in the compared layouts.
        #[arg(long, hide = true)]
        corrupt_layer: Option<usize>,
        /// Testing aid: with --corrupt-layer, corrupt the verify or prefill modules instead.
        #[arg(long, hide = true, value_parser = ["verify", "prefill"], requires = "corrupt_layer")]
        corrupt_function: Option<String>,
    },
    /// Write a random-weight Gemma 4 checkpoint in the Hugging Face layout.
    Fixture {
        /// Folder to create.
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value = "e2b")]
        shape: fixture::Shape,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Gemma4ForConditionalGeneration layout: text_config, model.language_model.* names, extra vision tensors.
        #[arg(long)]
        multimodal: bool,
        /// Number of safetensors shards (>1 writes model.safetensors.index.json).
        #[arg(long, default_value_t = 1)]
        shards: usize,
        #[arg(long, default_value_t = 512)]
        sliding_window: usize,
        /// Vocabulary size (the LM head's rows).
        #[arg(long, default_value_t = 512)]
        vocab_size: usize,
        /// The released model's widths (E2B: hidden 1536, 8x256/512 heads, MLP 6144)
        /// instead of tiny ones, stored in bfloat16: for benchmarks (E2B ~2B parameters
        /// with --vocab-size 16384).
        #[arg(long)]
        full_width: bool,
    },
    /// Describe a built .mlpackage: spec version, inputs/outputs, palettized weights, layers (no model load; works on Linux).
    Inspect {
        package: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write an ECDSA P-256 signing key pair: PREFIX.pem (PKCS#8, mode 0600) and PREFIX.pub.
    Keygen {
        /// File prefix; refuses to overwrite existing PREFIX.pem / PREFIX.pub.
        #[arg(long)]
        out: PathBuf,
    },
    /// Make a signed release folder (manifest.json + model.sig, OpenSSF model signing format) from a build.
    Package(release::PackageArgs),
    /// Check a release folder's signature, files and manifest (and optionally its zip).
    Verify(verify::VerifyArgs),
    // palette: begin
    /// Run pytest inside the embedded interpreter (where chunkforge_native is importable).
    #[command(hide = true)]
    SelftestPython {
        /// Arguments for pytest.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    // palette: end
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Time `parity` (wall time, peak RSS) with default settings.
    Parity {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long, value_enum, default_value = "all")]
        mode: Mode,
        #[arg(long, default_value_t = 16)]
        steps: usize,
    },
    /// Time `build` (wall time per phase, peak RSS) into a temporary folder.
    Build {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        layout: LayoutArgs,
        #[arg(long, default_value_t = 1)]
        kmeans_workers: usize,
        // palette: begin
        #[arg(long, value_parser = ["chunkforge", "coremltools"], default_value = "chunkforge")]
        palettizer: String,
        // palette: end
        /// Print the build report JSON instead of a summary.
        #[arg(long)]
        json: bool,
    },
    /// Time hashing + signing a release (1 big file, 8 smaller ones) against openssl and model_signing.
    Hash(hashbench::HashBenchArgs),
    // palette: begin
    /// INT4 g=32 palettization: the Rust kernel vs coremltools 9.0 (kmeans1d and scikit-learn,
    /// 1 and 2 workers) on E2B-width matrices; seconds and MSE side by side.
    Palettize {
        /// Print {"results": [{"shape", "impl", "seconds", "mse"}, ...]} instead of a table.
        #[arg(long)]
        json: bool,
        /// Small matrices only (seconds instead of many minutes; for tests).
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    // palette: end
}

fn resolve_checkpoint(model: &ModelArgs, verbose: bool) -> Result<PathBuf> {
    match &model.hf_dir {
        Some(d) => {
            if !d.is_dir() {
                anyhow::bail!(
                    "{}: checkpoint folder does not exist (--hf-dir / GEMMA4_HF_DIR)",
                    d.display()
                );
            }
            Ok(d.clone())
        }
        None => {
            pyenv::activate(verbose)?;
            fixture::default_checkpoint(verbose)
        }
    }
}

/// coremltools and safetensors take paths as Python strings: refuse a path that
/// is not valid UTF-8 instead of silently writing somewhere else.
fn require_utf8(path: &Path, what: &str) -> Result<()> {
    if path.to_str().is_none() {
        anyhow::bail!(
            "{}: the {what} path is not valid UTF-8; coremltools needs UTF-8 paths, choose another folder name",
            path.display()
        );
    }
    Ok(())
}

fn plan_for(dir: &Path, layout: &LayoutArgs) -> Result<(config::TextConfig, plan::Plan)> {
    let cfg = config::TextConfig::load(dir)?;
    let functions = layout.functions.resolve(layout.mode);
    let plan = plan::plan(
        &cfg,
        layout.ctx,
        layout.mode,
        layout.split.as_deref(),
        &functions,
    )?;
    Ok((cfg, plan))
}

/// `lock`: what to do when another run holds `out`'s lock (None: `out` is a
/// fresh temporary folder, not locked).
#[allow(clippy::too_many_arguments)]
fn do_build(
    model: &ModelArgs,
    layout: &LayoutArgs,
    out: &Path,
    quantize: bool,
    kmeans_workers: usize,
    palettizer: &str,
    verbose: bool,
    lock: Option<publish::OnLocked>,
) -> Result<serde_json::Value> {
    require_utf8(out, "output")?;
    let dir = resolve_checkpoint(model, verbose)?;
    require_utf8(&dir, "checkpoint")?;
    let (cfg, plan) = plan_for(&dir, layout)?;
    let ckpt = checkpoint::Checkpoint::open(&dir, &cfg)?;
    if quantize {
        checkpoint::check_groupable(&ckpt, &cfg, 32)?;
    }
    pyenv::activate(verbose)?;
    let settings = build::Settings {
        ctx: layout.ctx,
        quantize,
        nbits: 4,
        group_size: 32,
        kmeans_workers,
        verbose,
        palettizer: palettizer.to_string(),
        lock,
    };
    let args = json!({
        "mode": format!("{:?}", layout.mode).to_lowercase(),
        "split": layout.split,
        "ctx": layout.ctx,
        "verify_k": layout.functions.verify_k,
        "prefill_len": layout.functions.prefill_len,
    });
    let report = build::run(&dir, &cfg, &ckpt, &plan, args, out, &settings)?;
    Ok(report.json)
}

fn run(cli: Cli) -> Result<()> {
    let verbose = cli.verbose;
    match cli.command {
        Cmd::Doctor { venv_python: true } => {
            pyenv::ensure_env(verbose)?;
            println!(
                "{}",
                pyenv::venv_dir()?.join("bin").join("python").display()
            );
            Ok(())
        }
        Cmd::Doctor { venv_python: false } => doctor(verbose),
        Cmd::Setup => {
            pyenv::activate(verbose)?;
            eprintln!("Python environment: {}", pyenv::venv_dir()?.display());
            Ok(())
        }
        Cmd::Plan {
            model,
            layout,
            json,
        } => {
            let dir = resolve_checkpoint(&model, verbose)?;
            let (_, plan) = plan_for(&dir, &layout)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&plan)?);
            } else {
                print!("{}", plan::render(&plan));
            }
            Ok(())
        }
        Cmd::Build {
            check: Some(dir),
            model,
            kmeans_workers,
            ..
        } => {
            let (model, layout, quantize, palettizer) =
                build::request_of(&dir.join("build.json"), &model.hf_dir)?;
            let model = ModelArgs { hf_dir: model };
            let (verify_k, prefill_len) = build::functions_of(&dir.join("build.json"))?;
            let layout = LayoutArgs {
                mode: layout.0,
                split: layout.1,
                ctx: layout.2,
                functions: FunctionArgs {
                    verify_k,
                    prefill_len,
                },
            };
            let tmp = std::env::temp_dir().join(format!("chunkforge-check-{}", std::process::id()));
            let result = do_build(
                &model,
                &layout,
                &tmp,
                quantize,
                kmeans_workers,
                &palettizer,
                verbose,
                None,
            );
            let same = result.and_then(|fresh| build::compare(&dir, &tmp, &fresh));
            let _ = std::fs::remove_dir_all(&tmp);
            if same? {
                println!(
                    "REPRODUCIBLE: every package in {} is byte-identical to a fresh build",
                    dir.display()
                );
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "{}: a fresh build differs (see above)",
                    dir.display()
                ))
            }
        }
        Cmd::Build {
            model,
            layout,
            output,
            no_quantize,
            kmeans_workers,
            palettizer,
            no_wait,
            ..
        } => {
            let output = output.expect("clap: --output is required without --check");
            let report = do_build(
                &model,
                &layout,
                &output,
                !no_quantize,
                kmeans_workers,
                &palettizer,
                verbose,
                Some(publish::OnLocked::from_no_wait(no_wait)),
            )?;
            eprintln!("{}", build::summary(&report, &output));
            Ok(())
        }
        Cmd::Parity {
            model,
            mode,
            functions,
            split,
            steps,
            tol_cos,
            ctx,
            prompt_ids,
            prefill,
            artifacts,
            tol_cos_int4,
            min_top1_int4,
            max_weight_rel_mse,
            report,
            no_oracle,
            skip_prefill_copy,
            corrupt_layer,
            corrupt_function,
        } => {
            let dir = resolve_checkpoint(&model, verbose)?;
            let cfg = config::TextConfig::load(&dir)?;
            let ckpt = checkpoint::Checkpoint::open(&dir, &cfg)?;
            pyenv::activate(verbose)?;
            let opts = parity::ParityOptions {
                mode,
                functions: functions.resolve(mode),
                split,
                steps,
                tol_cos,
                ctx,
                prompt_ids: prompt_ids
                    .as_deref()
                    .map(parity::parse_prompt)
                    .transpose()?,
                prefill,
                skip_prefill_copy,
                artifacts,
                tol_cos_int4,
                min_top1_int4,
                max_weight_rel_mse,
                report,
                oracle: !no_oracle,
                corrupt_layer,
                corrupt_function,
                verbose,
            };
            if parity::run(&dir, &cfg, &ckpt, &opts)? {
                Ok(())
            } else {
                Err(ParityFailed.into())
            }
        }
        Cmd::Inspect { package, json } => {
            pyenv::activate(verbose)?;
            let d = pyenv::call_json(
                "inspect_pkg",
                "describe",
                &json!({"path": package.to_string_lossy()}),
                verbose,
            )?;
            if json {
                println!("{}", serde_json::to_string_pretty(&d)?);
            } else {
                print_inspect(&d);
            }
            Ok(())
        }
        Cmd::Fixture {
            out,
            shape,
            seed,
            multimodal,
            shards,
            sliding_window,
            vocab_size,
            full_width,
        } => {
            pyenv::activate(verbose)?;
            let args = fixture::FixtureArgs {
                shape,
                seed,
                multimodal,
                shards: shards.max(1),
                sliding_window,
                vocab_size,
                full_width,
            };
            let info = fixture::write(&out, &args, verbose)?;
            eprintln!(
                "wrote {} checkpoint to {} ({} tensors, {} parameters)",
                shape.label(),
                out.display(),
                info["tensors"],
                info["parameters"]
            );
            Ok(())
        }
        Cmd::Keygen { out } => release::keygen(&out),
        Cmd::Package(args) => {
            let report = release::package(&args)?;
            eprintln!("{}", release::summary(&report, &args.output));
            Ok(())
        }
        Cmd::Verify(args) => verify::run(&args),
        Cmd::Bench {
            what: BenchCmd::Hash(args),
        } => hashbench::run(&args),
        Cmd::Bench {
            what: BenchCmd::Parity { model, mode, steps },
        } => {
            let started = std::time::Instant::now();
            let dir = resolve_checkpoint(&model, verbose)?;
            let cfg = config::TextConfig::load(&dir)?;
            let ckpt = checkpoint::Checkpoint::open(&dir, &cfg)?;
            pyenv::activate(verbose)?;
            let opts = parity::ParityOptions {
                mode,
                functions: plan::Functions::resolve(mode, None, None),
                split: None,
                steps,
                tol_cos: 0.9999,
                ctx: 512,
                prompt_ids: None,
                prefill: 0,
                skip_prefill_copy: false,
                artifacts: None,
                tol_cos_int4: 0.85,
                min_top1_int4: 0.75,
                max_weight_rel_mse: 0.03,
                report: None,
                oracle: true,
                corrupt_layer: None,
                corrupt_function: None,
                verbose,
            };
            let ok = parity::run(&dir, &cfg, &ckpt, &opts)?;
            println!(
                "bench parity --mode {} --steps {steps}: wall {:.1}s (including interpreter start and imports), peak RSS {:.0} MiB, {}",
                format!("{mode:?}").to_lowercase(),
                started.elapsed().as_secs_f64(),
                fsutil::peak_rss_bytes() as f64 / (1024.0 * 1024.0),
                if ok { "passed" } else { "FAILED" }
            );
            Ok(())
        }
        Cmd::Bench {
            what:
                BenchCmd::Build {
                    model,
                    layout,
                    kmeans_workers,
                    palettizer,
                    json,
                },
        } => {
            let tmp = std::env::temp_dir().join(format!("chunkforge-bench-{}", std::process::id()));
            let result = do_build(
                &model,
                &layout,
                &tmp,
                true,
                kmeans_workers,
                &palettizer,
                verbose,
                None,
            );
            let _ = std::fs::remove_dir_all(&tmp);
            let report = result?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                const COLS: [&str; 6] = ["load", "trace", "convert", "palettize", "save", "bundle"];
                println!(
                    "{:<30} {:>7} {:>7} {:>8} {:>10} {:>7} {:>7} {:>8}",
                    "package / function",
                    "load",
                    "trace",
                    "convert",
                    "palettize",
                    "save",
                    "bundle",
                    "total"
                );
                let row = |label: String, secs: &serde_json::Value| {
                    let s = |k: &str| secs[k].as_f64().unwrap_or(0.0);
                    println!(
                        "{label:<30} {:>6.1}s {:>6.1}s {:>7.1}s {:>9.1}s {:>6.1}s {:>6.1}s {:>7.1}s",
                        s("load"),
                        s("trace"),
                        s("convert"),
                        s("palettize"),
                        s("save"),
                        s("bundle"),
                        COLS.iter().map(|k| s(k)).sum::<f64>()
                    );
                };
                for c in report["chunks"].as_array().into_iter().flatten() {
                    row(c["name"].as_str().unwrap_or("").to_string(), &c["seconds"]);
                    let functions = c["functions"].as_array().cloned().unwrap_or_default();
                    if functions.len() > 1 {
                        for f in &functions {
                            row(
                                format!("  {}", f["name"].as_str().unwrap_or("")),
                                &f["seconds"],
                            );
                        }
                    }
                }
                println!("{}", build::summary(&report, &tmp));
            }
            Ok(())
        }
        // palette: begin
        Cmd::Bench {
            what: BenchCmd::Palettize { json, quick, seed },
        } => bench_palettize::run(json, quick, seed, verbose),
        Cmd::SelftestPython { args } => match native::run_pytest(&args, verbose)? {
            0 => Ok(()),
            code => anyhow::bail!("pytest failed (exit code {code})"),
        },
        // palette: end
    }
}

fn print_inspect(d: &serde_json::Value) {
    println!("{}", d["path"].as_str().unwrap_or(""));
    println!(
        "  {} , specification version {} (iOS18 = 9), opset {}",
        d["model_type"].as_str().unwrap_or("?"),
        d["specification_version"],
        d["opset"].as_str().unwrap_or("?")
    );
    let functions = d["functions"].as_array().cloned().unwrap_or_default();
    for f in &functions {
        if functions.len() > 1 {
            let default = f["name"] == d["default_function"];
            println!(
                "  function {}{}: {} MIL ops",
                f["name"].as_str().unwrap_or(""),
                if default { " (default)" } else { "" },
                f["mil_ops"]
            );
        }
        for (label, key) in [("in ", "inputs"), ("out", "outputs")] {
            for t in f[key].as_array().into_iter().flatten() {
                println!(
                    "  {label} {:<24} {:<20} {}",
                    t["name"].as_str().unwrap_or(""),
                    t["shape"].to_string(),
                    t["dtype"].as_str().unwrap_or("")
                );
            }
        }
    }
    let luts = d["palettized"].as_array().map_or(0, Vec::len);
    let linear = d["linear"].as_array().map_or(0, Vec::len);
    println!(
        "  {} MIL ops; {luts} palettized weights for {linear} linear ops",
        d["mil_ops"]
    );
    if let Some(l) = d["palettized"].as_array().and_then(|a| a.first()) {
        println!(
            "  e.g. {} {} with LUT {}",
            l["name"].as_str().unwrap_or(""),
            l["weight_shape"],
            l["lut_shape"]
        );
    }
    let layers: Vec<u64> = d["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_u64())
        .collect();
    if let (Some(a), Some(b)) = (layers.first(), layers.last()) {
        println!("  decoder layers {a}-{b} ({} layers)", layers.len());
    }
}

fn doctor(verbose: bool) -> Result<()> {
    println!("chunkforge {}", env!("CARGO_PKG_VERSION"));
    let venv = pyenv::venv_dir()?;
    println!(
        "cache folder:        {}",
        chunkforge::cache_dir::cache_dir()?.display()
    );
    println!(
        "python environment:  {} ({})",
        venv.display(),
        if pyenv::env_ready(&venv) {
            "ready"
        } else {
            "not set up yet: created on first use"
        }
    );
    println!("python package dir:  {}", pyenv::python_dir().display());
    pyenv::activate(verbose).context("setting up the Python environment")?;
    let v = pyenv::call_json("runtime", "versions", &serde_json::Value::Null, verbose)?;
    println!(
        "embedded interpreter: Python {}",
        v["python"].as_str().unwrap_or("?")
    );
    for (k, val) in v.as_object().into_iter().flatten() {
        if k != "python" {
            println!("  {k:<14} {}", val.as_str().unwrap_or("?"));
        }
    }
    let lim = pyenv::call_json(
        "runtime",
        "platform_limits",
        &serde_json::Value::Null,
        verbose,
    )?;
    println!(
        "platform: {} {}",
        lim["system"].as_str().unwrap_or("?"),
        lim["machine"].as_str().unwrap_or("?")
    );
    for (key, what) in [
        ("can_predict", "Core ML prediction (MLModel.predict)"),
        ("can_compile_mlmodelc", "compiling .mlpackage to .mlmodelc"),
        (
            "can_load_compute_plan",
            "MLComputePlan audit (Neural Engine placement)",
        ),
    ] {
        let ok = lim[key].as_bool().unwrap_or(false);
        println!(
            "  {:<48} {}",
            what,
            if ok {
                "available"
            } else {
                "not available on this platform (needs macOS); skipped"
            }
        );
    }
    Ok(())
}

/// Parity ran and found a failure (exit 1; errors exit 2).
#[derive(Debug, thiserror::Error)]
#[error("parity failed")]
struct ParityFailed;

fn main() -> ExitCode {
    // Fixed string hashing in the embedded interpreter (set before it starts):
    // set iteration order must not vary between runs of a reproducible build.
    std::env::set_var("PYTHONHASHSEED", "0");
    // palette: the Rust kernels must be importable before the interpreter starts.
    use chunkforge::native::chunkforge_native;
    pyo3::append_to_inittab!(chunkforge_native);
    let cli = Cli::parse();
    fsutil::install_interrupt_handler();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<ParityFailed>() => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {}", render(&e));
            ExitCode::from(2)
        }
    }
}

/// The error and its causes, each said once. Several error types end their
/// own message with their source's (so a `verify` report line stands alone);
/// printing the whole chain after it would repeat the OS error.
fn render(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}
