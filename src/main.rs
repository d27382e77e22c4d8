//! chunkforge: Gemma 4 checkpoint → Core ML decode chunk packages for the Apple
//! Neural Engine.

mod bench_palettize;
mod build;
mod checkpoint;
mod config;
mod error;
mod fixture;
mod fsutil;
mod native;
mod palette;
mod plan;
mod progress;
mod pyenv;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::json;

use crate::plan::Mode;

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
    /// Layouts: four (chunk1..4 reference), two (merged_chunk1/2), one (merged_full), both (two+one), all.
    #[arg(long, value_enum, default_value = "both")]
    mode: Mode,
    /// Custom split instead of --mode: contiguous layer ranges covering every layer, e.g. 0-11,12-23,24-34.
    #[arg(long)]
    split: Option<String>,
    /// Full-attention context length (KV cache entries).
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
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
        #[arg(long)]
        output: PathBuf,
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
    },
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

fn plan_for(dir: &Path, layout: &LayoutArgs) -> Result<(config::TextConfig, plan::Plan)> {
    let cfg = config::TextConfig::load(dir)?;
    if layout.ctx == 0 {
        anyhow::bail!("--ctx must be at least 1");
    }
    let plan = plan::plan(&cfg, layout.ctx, layout.mode, layout.split.as_deref())?;
    Ok((cfg, plan))
}

fn do_build(
    model: &ModelArgs,
    layout: &LayoutArgs,
    out: &Path,
    quantize: bool,
    kmeans_workers: usize,
    palettizer: &str,
    verbose: bool,
) -> Result<serde_json::Value> {
    let dir = resolve_checkpoint(model, verbose)?;
    let (cfg, plan) = plan_for(&dir, layout)?;
    let ckpt = checkpoint::Checkpoint::open(&dir, &cfg)?;
    pyenv::activate(verbose)?;
    let settings = build::Settings {
        ctx: layout.ctx,
        quantize,
        nbits: 4,
        group_size: 32,
        kmeans_workers,
        verbose,
        palettizer: palettizer.to_string(),
    };
    let args = json!({
        "mode": format!("{:?}", layout.mode).to_lowercase(),
        "split": layout.split,
        "ctx": layout.ctx,
    });
    let report = build::run(&dir, &cfg, &ckpt, &plan, args, out, &settings)?;
    Ok(report.json)
}

fn run(cli: Cli) -> Result<()> {
    let verbose = cli.verbose;
    match cli.command {
        Cmd::Doctor { venv_python: true } => {
            pyenv::ensure_env(verbose)?;
            println!("{}", pyenv::venv_dir().join("bin").join("python").display());
            Ok(())
        }
        Cmd::Doctor { venv_python: false } => doctor(verbose),
        Cmd::Setup => {
            pyenv::activate(verbose)?;
            eprintln!("Python environment: {}", pyenv::venv_dir().display());
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
            model,
            layout,
            output,
            no_quantize,
            kmeans_workers,
            palettizer,
        } => {
            let report = do_build(
                &model,
                &layout,
                &output,
                !no_quantize,
                kmeans_workers,
                &palettizer,
                verbose,
            )?;
            eprintln!("{}", build::summary(&report, &output));
            Ok(())
        }
        Cmd::Fixture {
            out,
            shape,
            seed,
            multimodal,
            shards,
            sliding_window,
        } => {
            pyenv::activate(verbose)?;
            let args = fixture::FixtureArgs {
                shape,
                seed,
                multimodal,
                shards: shards.max(1),
                sliding_window,
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
            );
            let _ = std::fs::remove_dir_all(&tmp);
            let report = result?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!(
                    "{:<18} {:>7} {:>7} {:>8} {:>10} {:>7} {:>8}",
                    "package", "load", "trace", "convert", "palettize", "save", "total"
                );
                for c in report["chunks"].as_array().into_iter().flatten() {
                    let s = |k: &str| c["seconds"][k].as_f64().unwrap_or(0.0);
                    println!(
                        "{:<18} {:>6.1}s {:>6.1}s {:>7.1}s {:>9.1}s {:>6.1}s {:>7.1}s",
                        c["name"].as_str().unwrap_or(""),
                        s("load"),
                        s("trace"),
                        s("convert"),
                        s("palettize"),
                        s("save"),
                        ["load", "trace", "convert", "palettize", "save"]
                            .iter()
                            .map(|k| s(k))
                            .sum::<f64>()
                    );
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

fn doctor(verbose: bool) -> Result<()> {
    println!("chunkforge {}", env!("CARGO_PKG_VERSION"));
    println!("cache folder:        {}", pyenv::cache_dir().display());
    println!(
        "python environment:  {} ({})",
        pyenv::venv_dir().display(),
        if pyenv::env_ready() {
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

fn main() -> ExitCode {
    // palette: the Rust kernels must be importable before the interpreter starts.
    use crate::native::chunkforge_native;
    pyo3::append_to_inittab!(chunkforge_native);
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
