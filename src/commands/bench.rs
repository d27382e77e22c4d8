//! `chunkforge bench ...`: build and parity timed, hashing and signing
//! against other tools, the INT4 kernel against coremltools.

use anyhow::Result;
use clap::{Args, FromArgMatches};

use super::build::{summary, BuildJob};
use super::{ExitStatus, Layout};
use crate::cli::{BenchBuildCmd, BenchCmd, ParityCmd};
use crate::progress::peak_rss_bytes;
use crate::records::{BuildRecord, Seconds};
use crate::{bench_palettize, hashbench};

pub fn run(what: BenchCmd, verbose: bool) -> Result<ExitStatus> {
    match what {
        BenchCmd::Hash(args) => hashbench::run(&args)?,
        BenchCmd::Parity { model, mode, steps } => {
            let started = std::time::Instant::now();
            // Every other option at `parity`'s own defaults.
            let matches = ParityCmd::augment_args(clap::Command::new("parity"))
                .try_get_matches_from(["parity"])?;
            let args = ParityCmd {
                model,
                mode,
                steps,
                ..ParityCmd::from_arg_matches(&matches)?
            };
            let ok = super::parity::check(args, verbose)?;
            println!(
                "bench parity --mode {mode} --steps {steps}: wall {:.1}s (including interpreter start and imports), peak RSS {:.0} MiB, {}",
                started.elapsed().as_secs_f64(),
                peak_rss_bytes() as f64 / (1024.0 * 1024.0),
                if ok { "passed" } else { "FAILED" }
            );
        }
        BenchCmd::Build(args) => bench_build(args, verbose)?,
        BenchCmd::Palettize { json, quick, seed } => {
            bench_palettize::run(json, quick, seed, verbose)?
        }
    }
    Ok(ExitStatus::Success)
}

fn bench_build(args: BenchBuildCmd, verbose: bool) -> Result<()> {
    let tmp = std::env::temp_dir().join(format!("chunkforge-bench-{}", std::process::id()));
    let result = BuildJob {
        hf_dir: args.model.hf_dir.as_deref(),
        layout: Layout::of(&args.layout),
        quantize: true,
        kmeans_workers: args.kmeans_workers,
        palettizer: args.palettizer,
        lock: None,
    }
    .run(&tmp, verbose);
    let _ = std::fs::remove_dir_all(&tmp);
    let record = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&record)?);
    } else {
        print_phases(&record);
        println!("{}", summary(&record, &tmp));
    }
    Ok(())
}

/// Seconds per phase of every package and, for a multifunction one, of each function.
fn print_phases(record: &BuildRecord) {
    const COLS: [&str; 6] = ["load", "trace", "convert", "palettize", "save", "bundle"];
    const WIDTHS: [usize; 6] = [7, 7, 8, 10, 7, 7];
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
    for c in &record.chunks {
        row(&c.name, &c.seconds);
        if c.functions.len() > 1 {
            for f in &c.functions {
                row(&format!("  {}", f.name), &f.seconds);
            }
        }
    }
}
