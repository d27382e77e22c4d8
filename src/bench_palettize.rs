//! `chunkforge bench palettize`: runs `chunkforge_py.bench_palettize` (the
//! Rust kernel and coremltools on the same matrices) and prints the table.

use anyhow::Result;
use serde_json::{json, Value};

use crate::py::env as pyenv;

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
    let report = pyenv::call_json(
        "bench_palettize",
        "run",
        &json!({"quick": quick, "seed": seed, "progress": true}),
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
pub fn render(report: &Value) -> String {
    let results = report["results"].as_array().cloned().unwrap_or_default();
    let mut out = format!(
        "{:<14} {:<26} {:>10} {:>12} {:>12} {:>14}\n",
        "shape", "impl", "seconds", "mse", "time ratio", "mse ratio"
    );
    let mut shapes: Vec<Value> = Vec::new();
    for r in &results {
        if !shapes.contains(&r["shape"]) {
            shapes.push(r["shape"].clone());
        }
    }
    for shape in shapes {
        let rows: Vec<&Value> = results.iter().filter(|r| r["shape"] == shape).collect();
        let ours = rows.iter().find(|r| r["impl"] == "chunkforge");
        let (our_s, our_mse) = ours.map_or((f64::NAN, f64::NAN), |r| {
            (
                r["seconds"].as_f64().unwrap_or(f64::NAN),
                r["mse"].as_f64().unwrap_or(f64::NAN),
            )
        });
        let label = format!("{}x{}", shape[0], shape[1]);
        for r in rows {
            let s = r["seconds"].as_f64().unwrap_or(f64::NAN);
            let mse = r["mse"].as_f64().unwrap_or(f64::NAN);
            out.push_str(&format!(
                "{:<14} {:<26} {:>10.3} {:>12.5e} {:>11.1}x {:>14.6}\n",
                label,
                r["impl"].as_str().unwrap_or("?"),
                s,
                mse,
                s / our_s,
                our_mse / mse
            ));
        }
    }
    out.push_str(
        "time ratio: seconds / chunkforge's seconds (higher = chunkforge faster); \
         mse ratio: chunkforge's MSE / this MSE (<= 1: chunkforge at least as accurate)\n",
    );
    out
}
