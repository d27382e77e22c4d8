//! `chunkforge bench palettize`: runs `chunkforge_py.convert.bench_palettize` (the
//! Rust kernel and coremltools on the same matrices) and prints the table.

use anyhow::Result;

use crate::py::calls;
use crate::py::contract::{BenchArgs, BenchReport, BenchResult};
use crate::py::env as pyenv;
use crate::records::Palettizer;

pub fn run(json_out: bool, quick: bool, seed: u64, verbose: bool) -> Result<()> {
    // scikit-learn's k-means deadlocks in forked coremltools workers unless
    // OpenMP is single-threaded; it has to be set before the interpreter (and
    // its OpenMP runtime) starts. The Rust kernel uses rayon, not OpenMP.
    if std::env::var_os("OMP_NUM_THREADS").is_none() {
        std::env::set_var("OMP_NUM_THREADS", "1");
        // Lets the one-worker coremltools runs (in their own process, no
        // fork) go back to OpenMP's default thread count.
        std::env::set_var("CHUNKFORGE_OMP_DEFAULTED", "1");
    }
    pyenv::activate(verbose)?;
    eprintln!(
        "palettize benchmark ({} matrices, {} cores for the Rust kernel): coremltools on the large ones takes minutes",
        if quick { "quick" } else { "E2B-width" },
        rayon::current_num_threads()
    );
    let report = calls::call::<calls::BenchPalettize>(
        &BenchArgs {
            quick,
            seed,
            progress: true,
        },
        verbose,
    )?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

/// One table: per shape, every implementation with seconds, MSE, and how the
/// Rust kernel compares (time: impl / chunkforge; MSE: chunkforge / impl).
pub fn render(report: &BenchReport) -> String {
    let mut out = format!(
        "{:<14} {:<26} {:>10} {:>12} {:>12} {:>14}\n",
        "shape", "impl", "seconds", "mse", "time ratio", "mse ratio"
    );
    let mut shapes: Vec<&[usize]> = Vec::new();
    for r in &report.results {
        if !shapes.contains(&r.shape.as_slice()) {
            shapes.push(&r.shape);
        }
    }
    for shape in shapes {
        let rows: Vec<&BenchResult> = report.results.iter().filter(|r| r.shape == shape).collect();
        let ours = rows
            .iter()
            .find(|r| r.implementation == Palettizer::Chunkforge.as_str());
        let (our_s, our_mse) = ours.map_or((f64::NAN, f64::NAN), |r| (r.seconds, r.mse));
        let label = shape
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join("x");
        for r in rows {
            out.push_str(&format!(
                "{:<14} {:<26} {:>10.3} {:>12.5e} {:>11.1}x {:>14.6}\n",
                label,
                r.implementation,
                r.seconds,
                r.mse,
                r.seconds / our_s,
                our_mse / r.mse
            ));
        }
    }
    out.push_str(
        "time ratio: seconds / chunkforge's seconds (higher = chunkforge faster); \
         mse ratio: chunkforge's MSE / this MSE (<= 1: chunkforge at least as accurate)\n",
    );
    out
}
