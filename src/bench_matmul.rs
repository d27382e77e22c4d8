//! `chunkforge bench matmul`: the product kernels (src/matmul) against the
//! machine's memory, in one run: the GB/s of stored weight the 4-bit (LUT)
//! and bf16 kernels read in a decode step's products (one token), beside
//! the copy bandwidth measured the same way (every core copying one buffer
//! into another), and their ratio; then the few-token products (verify,
//! batched teacher-forced steps, prefill) in GFLOP/s.
//!
//! The weights are E2B's decode step: every projection of its 35 layers
//! and the tied head, at their real shapes (`decode_step`), random, so the
//! stored bytes (1.1 GB INT4, 4.4 GB bf16) are far larger than any cache.
//! `--quick` takes a tenth of the layers and a slice of the head.

use std::time::Instant;

use anyhow::{bail, Result};
use rayon::prelude::*;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::matmul::{self, Input, Isa, Layout, Weights};

/// One product figure.
#[derive(Serialize, Deserialize, JsonSchema, Debug, Clone)]
pub struct KernelRow {
    /// `lut4` (a package's INT4 weights) or `bf16` (a checkpoint's).
    pub form: String,
    pub tokens: usize,
    pub isa: String,
    /// Seconds of one pass over every weight (best of the passes).
    pub seconds: f64,
    /// Bytes of stored weight read per pass.
    pub stored_bytes: u64,
    /// `stored_bytes / seconds`, in GB/s (10^9).
    pub read_gb_per_s: f64,
    /// `2 · rows · cols · tokens / seconds`, in GFLOP/s.
    pub gflop_per_s: f64,
    /// `read_gb_per_s / copy_gb_per_s`.
    pub of_copy: f64,
}

/// `bench matmul --json`.
#[derive(Serialize, Deserialize, JsonSchema, Debug, Clone)]
pub struct KernelReport {
    pub threads: usize,
    pub isa: String,
    /// Bytes per second a parallel copy moves (read plus written, as STREAM
    /// counts a copy), in GB/s.
    pub copy_gb_per_s: f64,
    /// Bytes per second a parallel copy reads (half the above).
    pub copy_read_gb_per_s: f64,
    pub rows: Vec<KernelRow>,
}

/// E2B's decode-step projections `[rows, cols]`: 35 layers (full attention
/// every 5th: 8 heads of 512 instead of 256, 2 KV heads' worth of 512; the
/// last 20 share KV and have a double-wide MLP), the per-layer input
/// projection and the tied head. `fraction` keeps every n-th layer and that
/// share of the head.
fn decode_step(fraction: usize) -> Vec<(usize, usize)> {
    let (hidden, ple, layers, shared_from) = (1536, 256, 35, 15);
    let mut out = vec![(layers * ple, hidden)];
    for l in (0..layers).step_by(fraction) {
        let full = l % 5 == 4;
        let hd = if full { 512 } else { 256 };
        let mlp = if l >= shared_from { 12288 } else { 6144 };
        out.push((8 * hd, hidden));
        if l < shared_from {
            out.push((hd, hidden));
            out.push((hd, hidden));
        }
        out.push((hidden, 8 * hd));
        out.extend([(mlp, hidden), (mlp, hidden), (hidden, mlp)]);
        out.extend([(ple, hidden), (hidden, ple)]);
    }
    out.push((262_144 / fraction / 32 * 32, hidden));
    out
}

/// A weight's stored values.
enum Owned {
    Lut4 { packed: Vec<u8>, lut: Vec<f32> },
    Bf16(Vec<u16>),
}

impl Owned {
    fn weights(&self) -> Weights<'_> {
        match self {
            Owned::Lut4 { packed, lut } => Weights::Lut4 {
                packed,
                lut,
                group_rows: 32,
            },
            Owned::Bf16(v) => Weights::Bf16(v),
        }
    }
}

/// Fills in parallel with xorshift bytes (content does not change the speed).
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    v.par_chunks_mut(1 << 20).enumerate().for_each(|(i, c)| {
        let mut s = (seed ^ (i as u64 + 1)).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for b in c.chunks_mut(8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let bytes = s.to_le_bytes();
            b.copy_from_slice(&bytes[..b.len()]);
        }
    });
    v
}

fn make(form: &str, rows: usize, cols: usize, seed: u64) -> Owned {
    match form {
        "lut4" => {
            let lut = (0..rows / 32 * 16)
                .map(|i| ((i % 16) as f32 - 7.5) * 0.01)
                .collect();
            Owned::Lut4 {
                packed: random_bytes(rows * cols / 2, seed),
                lut,
            }
        }
        _ => {
            // Weights of a trained model's size: sign, an exponent between
            // 2^-12 and 2^-4 (no subnormals), any mantissa.
            let raw = random_bytes(rows * cols * 2, seed);
            Owned::Bf16(
                raw.chunks_exact(2)
                    .map(|b| {
                        let r = u16::from_le_bytes([b[0], b[1]]);
                        let exponent = 115 + (r >> 7) % 8;
                        (r & 0x807f) | (exponent << 7)
                    })
                    .collect(),
            )
        }
    }
}

/// Bytes per second a parallel copy of `bytes` moves (read + written), best of 3.
fn copy_bandwidth(bytes: usize) -> f64 {
    let src = random_bytes(bytes, 99);
    let mut dst = vec![0u8; bytes];
    let chunk = 1 << 22;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    2.0 * bytes as f64 / best / 1e9
}

/// One pass of every weight's product with `tokens` tokens, best of `passes`.
fn time_products(
    set: &[(usize, usize, Owned)],
    tokens: usize,
    isa: Isa,
    passes: usize,
) -> Result<f64> {
    let cols_max = set.iter().map(|(_, c, _)| *c).max().unwrap_or(1);
    let x: Vec<f32> = (0..tokens * cols_max)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let mut best = f64::INFINITY;
    for _ in 0..passes {
        let t = Instant::now();
        for (rows, cols, w) in set {
            let input = Input {
                x: &x[..tokens * cols],
                tokens,
                live: tokens,
            };
            let y = matmul::matmul(&w.weights(), *rows, *cols, input, Layout::TokenMajor, isa)?;
            std::hint::black_box(&y);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

pub fn run(json_out: bool, quick: bool, isa: Option<&str>) -> Result<()> {
    let isa = match isa {
        None => matmul::best_isa(),
        Some(name) => match Isa::parse(name) {
            Some(i) if matmul::available_isas().contains(&i) => i,
            _ => bail!(
                "--isa {name}: this CPU runs {}",
                matmul::available_isas()
                    .iter()
                    .map(|i| i.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        },
    };
    let fraction = if quick { 10 } else { 1 };
    let shapes = decode_step(fraction);
    let threads = rayon::current_num_threads();
    eprintln!(
        "matmul benchmark: E2B's decode step ({} products{}), {threads} threads, {} build",
        shapes.len(),
        if quick { ", a tenth" } else { "" },
        isa.name()
    );
    let copy = copy_bandwidth(if quick { 256 << 20 } else { 1 << 30 });
    let mut rows = Vec::new();
    for form in ["lut4", "bf16"] {
        let set: Vec<(usize, usize, Owned)> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(r, c))| (r, c, make(form, r, c, i as u64)))
            .collect();
        let stored: u64 = set
            .iter()
            .map(|(_, _, w)| w.weights().stored_bytes() as u64)
            .sum();
        let flop_per_token: f64 = set.iter().map(|(r, c, _)| 2.0 * (*r * *c) as f64).sum();
        for tokens in [1usize, 3, 8, 64] {
            // Few-token products run fewer passes: they take longer.
            let passes = if tokens >= 64 { 1 } else { 3 };
            let seconds = time_products(&set, tokens, isa, passes)?;
            let read = stored as f64 / seconds / 1e9;
            rows.push(KernelRow {
                form: form.to_string(),
                tokens,
                isa: isa.name().to_string(),
                seconds,
                stored_bytes: stored,
                read_gb_per_s: read,
                gflop_per_s: flop_per_token * tokens as f64 / seconds / 1e9,
                of_copy: read / copy,
            });
        }
    }
    let report = KernelReport {
        threads,
        isa: isa.name().to_string(),
        copy_gb_per_s: copy,
        copy_read_gb_per_s: copy / 2.0,
        rows,
    };
    if json_out {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

fn render(r: &KernelReport) -> String {
    let mut s = format!(
        "copy bandwidth: {:.1} GB/s moved ({:.1} GB/s read, {:.1} GB/s written), {} threads\n\n",
        r.copy_gb_per_s, r.copy_read_gb_per_s, r.copy_read_gb_per_s, r.threads
    );
    s += &format!(
        "{:<6} {:>6} {:>8} {:>10} {:>12} {:>10} {:>10}\n",
        "form", "tokens", "build", "seconds", "stored GB/s", "of copy", "GFLOP/s"
    );
    for row in &r.rows {
        s += &format!(
            "{:<6} {:>6} {:>8} {:>10.4} {:>12.2} {:>9.0}% {:>10.1}\n",
            row.form,
            row.tokens,
            row.isa,
            row.seconds,
            row.read_gb_per_s,
            100.0 * row.of_copy,
            row.gflop_per_s
        );
    }
    s += "\nstored GB/s: bytes of stored weight (4-bit indices and LUTs, or bf16) read per second;\n\
          of copy: that against the copy's bytes moved (read + written) per second.\n";
    s
}
