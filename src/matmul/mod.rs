//! Matrix products that read a projection's weight in its stored form
//! (pure Rust): `y = x · Wᵀ` for a weight `W [rows, cols]` (rows = output
//! channels) held as
//!
//! - 4-bit palettized indices, two a byte, the low nibble first, with one
//!   16-entry look-up table per group of consecutive rows (a package's
//!   `constexpr_lut_to_dense` as its weight file stores it: `Weights::Lut4`);
//! - bfloat16 or float16 rows (a checkpoint's, or a `--no-quantize`
//!   package's constants: `Weights::Bf16`, `Weights::F16`);
//! - float32 rows (a float32 checkpoint's: `Weights::F32`).
//!
//! No dense float32 copy of the weight is made: each block of 32 weights is
//! widened in registers, where bf16, fp16 and LUT entries become float32
//! exactly, and multiplied there. The inputs `x [tokens, cols]` are float32.
//!
//! **The arithmetic** is one order of the float32 product, the same for every
//! instruction set, thread count, row split and token count (so a decode
//! step, a batch of teacher-forced steps and a prefill call give each output
//! the same bits, and the vector builds agree with the portable one bit for
//! bit): every output `y[t, r]` has 16 lane accumulators, zero at the start.
//! The columns are taken in blocks of 32; block `b` adds, to each lane `j`,
//! two products with fused multiply-adds, first then second:
//!
//! - `Lut4`: byte `j` of the block: columns `32b + 2j` (low nibble), then
//!   `32b + 2j + 1` (high nibble);
//! - `Bf16`, `F16`, `F32`: columns `32b + j`, then `32b + 16 + j`.
//!
//! Columns past the end are skipped (the lane keeps its value). The 16 lanes
//! are then summed by a fixed tree: `s[j] = a[j] + a[j+8]` (8 lanes), then
//! `+ [j+4]`, `+ [j+2]`, `+ [j+1]`.
//!
//! **The bound this order implies.** Each product enters its lane by one
//! rounding (the fused multiply-add) and goes through at most one more per
//! later term of its lane and one per level of the tree: `k = 2·⌈cols/32⌉ + 4`
//! roundings in all. With `u = 2⁻²⁴`, `γ_k = k·u / (1 − k·u)`:
//!
//! `|ŷ − Σ x_i·w_i| ≤ γ_k · Σ |x_i·w_i|  (+ k · 2⁻¹⁵⁰ for results below float32's normal range)`
//!
//! (the classic bound of a summation in which every term passes through at
//! most `k` roundings; no term is lost, since the products of float32 values
//! are exact inside the fused multiply-add). torch's float32 product, today's
//! path, satisfies the same form of bound with its own `k`, so the two differ
//! by at most the sum of the two. `tests.rs` holds every instruction set to it
//! against float64.
//!
//! Parallelism: rows are split over rayon's pool in tasks of whole row tiles;
//! each output is written by exactly one task.

use half::f16;
use rayon::prelude::*;

mod kernels;
mod simd;
#[cfg(test)]
mod tests;

pub use simd::{available_isas, best_isa, Isa};

/// Below this many bytes of stored weight (times live tokens) a product
/// runs on the calling thread alone.
pub const SERIAL_BYTES: usize = 1 << 20;

/// Values of one block of columns.
pub const BLOCK: usize = 32;
/// Lanes of one block's accumulator.
pub const LANES: usize = 16;
/// Entries of one 4-bit look-up table.
pub const LUT_ENTRIES: usize = 16;

/// A weight `[rows, cols]` in its stored form.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    /// `packed`: `rows * cols` 4-bit indices, two a byte, the low nibble
    /// first, row after row (a row starts mid-byte when `cols` is odd);
    /// `lut`: `rows / group_rows` tables of 16 float32 values (a package's
    /// fp16 entries, widened exactly), one per `group_rows` consecutive rows.
    Lut4 {
        packed: &'a [u8],
        lut: &'a [f32],
        group_rows: usize,
    },
    /// bfloat16 bits, row-major.
    Bf16(&'a [u16]),
    /// IEEE float16 bits, row-major.
    F16(&'a [u16]),
    /// float32, row-major.
    F32(&'a [f32]),
}

impl Weights<'_> {
    /// The name of the stored form, for messages and benchmarks.
    pub fn kind(&self) -> &'static str {
        match self {
            Weights::Lut4 { .. } => "lut4",
            Weights::Bf16(_) => "bf16",
            Weights::F16(_) => "fp16",
            Weights::F32(_) => "fp32",
        }
    }

    /// Bytes of the stored weight (its indices and tables for `Lut4`).
    pub fn stored_bytes(&self) -> usize {
        match self {
            Weights::Lut4 { packed, lut, .. } => packed.len() + lut.len() * 2,
            Weights::Bf16(w) | Weights::F16(w) => w.len() * 2,
            Weights::F32(w) => w.len() * 4,
        }
    }
}

/// How the output is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// `[tokens, rows]` (a `linear`'s output).
    TokenMajor,
    /// `[rows, tokens]` (a 1×1 convolution's `[1, out, 1, T]`).
    ChannelMajor,
}

/// Why a product cannot be made.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MatmulError {
    #[error("weight [{rows}, {cols}] ({kind}): {len} stored values, expected {want}")]
    WeightSize {
        kind: &'static str,
        rows: usize,
        cols: usize,
        len: usize,
        want: usize,
    },
    #[error("weight [{rows}, {cols}]: {len} LUT values, expected {want} ({groups} groups of 16)")]
    LutSize {
        rows: usize,
        cols: usize,
        len: usize,
        want: usize,
        groups: usize,
    },
    #[error("weight of {rows} rows: groups of {group_rows} rows do not tile it")]
    Groups { rows: usize, group_rows: usize },
    #[error("LUT entry {entry} of group {group} is {value}: a palettized weight's entries must be finite")]
    LutNotFinite {
        group: usize,
        entry: usize,
        value: f32,
    },
    #[error("input of {len} values is not [{tokens}, {cols}]")]
    InputSize {
        tokens: usize,
        cols: usize,
        len: usize,
    },
    #[error("{live} live tokens of {tokens}")]
    Live { live: usize, tokens: usize },
    #[error("rows {start}..{stop} of a weight of {rows} rows")]
    RowRange {
        start: usize,
        stop: usize,
        rows: usize,
    },
}

/// Checks `w` against `[rows, cols]`.
pub fn check(w: &Weights, rows: usize, cols: usize) -> Result<(), MatmulError> {
    let size = |len: usize, want: usize| {
        if len == want {
            Ok(())
        } else {
            Err(MatmulError::WeightSize {
                kind: w.kind(),
                rows,
                cols,
                len,
                want,
            })
        }
    };
    match *w {
        Weights::Lut4 {
            packed,
            lut,
            group_rows,
        } => {
            size(packed.len(), (rows * cols).div_ceil(2))?;
            if group_rows == 0 || !rows.is_multiple_of(group_rows) {
                return Err(MatmulError::Groups { rows, group_rows });
            }
            let groups = rows / group_rows;
            if lut.len() != groups * LUT_ENTRIES {
                return Err(MatmulError::LutSize {
                    rows,
                    cols,
                    len: lut.len(),
                    want: groups * LUT_ENTRIES,
                    groups,
                });
            }
            // Columns past a row's end read a table entry of index 0 or the
            // next row's nibble, skipped by the lane masks; a finite table
            // keeps even those lanes' products finite before the skip.
            if let Some(e) = lut.iter().position(|v| !v.is_finite()) {
                return Err(MatmulError::LutNotFinite {
                    group: e / LUT_ENTRIES,
                    entry: e % LUT_ENTRIES,
                    value: lut[e],
                });
            }
            Ok(())
        }
        Weights::Bf16(v) | Weights::F16(v) => size(v.len(), rows * cols),
        Weights::F32(v) => size(v.len(), rows * cols),
    }
}

/// The input of a product: `tokens` tokens, of which the first `live` are
/// computed; `x [live, cols]` row-major holds those (the others, a prefill
/// call's padding, are never read).
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    pub x: &'a [f32],
    pub tokens: usize,
    pub live: usize,
}

/// `y = x · Wᵀ` for `input`'s tokens, computed for the first `live`
/// tokens only: the other tokens' outputs are zero (a prefill call's
/// padding, which the caller has shown cannot reach the outputs it keeps).
/// Runs on the current rayon pool with the instruction set `isa`.
pub fn matmul(
    w: &Weights,
    rows: usize,
    cols: usize,
    input: Input,
    layout: Layout,
    isa: Isa,
) -> Result<Vec<f32>, MatmulError> {
    let Input { x, tokens, live } = input;
    check(w, rows, cols)?;
    if live > tokens {
        return Err(MatmulError::Live { live, tokens });
    }
    if x.len() != live * cols {
        return Err(MatmulError::InputSize {
            tokens: live,
            cols,
            len: x.len(),
        });
    }
    let mut out = vec![0f32; rows * tokens];
    if live == 0 || rows == 0 {
        return Ok(out);
    }
    let prepared = kernels::Prepared::new(w, x, cols, live);
    let (tile_rows, _) = simd::tile(isa);
    let per_task = task_rows(w, rows, cols, live, tile_rows);
    let (row_step, token_step) = match layout {
        Layout::TokenMajor => (1, rows),
        Layout::ChannelMajor => (tokens, 1),
    };
    let dst = Dst {
        ptr: out.as_mut_ptr(),
        len: out.len(),
        row_step,
        token_step,
    };
    let task = |task: usize| {
        let start = task * per_task;
        let stop = (start + per_task).min(rows);
        kernels::rows(isa, w, cols, &prepared, start, stop, &dst);
    };
    let tasks = rows.div_ceil(per_task);
    // A small product runs on the calling thread: waking the pool costs
    // more than it saves (an E2B k_proj is 0.2 MB of indices, 20 µs).
    if w.stored_bytes().saturating_mul(live) < SERIAL_BYTES {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
    Ok(out)
}

/// Rows per task: whole tiles, enough tasks to balance the pool, and few
/// enough bytes of weight that a task's rows stay in the core's cache while
/// every token tile reads them.
fn task_rows(w: &Weights, rows: usize, cols: usize, live: usize, tile: usize) -> usize {
    let row_bytes = match w {
        Weights::Lut4 { .. } => cols.div_ceil(2),
        Weights::Bf16(_) | Weights::F16(_) => cols * 2,
        Weights::F32(_) => cols * 4,
    }
    .max(1);
    let threads = rayon::current_num_threads().max(1);
    // Many tokens: rows of about 256 KB per task (they are read once per
    // token tile); one token: each row is read once, only balance matters.
    let cached = if live > 4 {
        (256 << 10) / row_bytes
    } else {
        usize::MAX
    };
    let balanced = rows.div_ceil(threads * 8);
    let n = balanced.min(cached).max(tile);
    n.div_ceil(tile) * tile
}

/// Where the tasks write: disjoint outputs of one buffer.
pub(crate) struct Dst {
    ptr: *mut f32,
    len: usize,
    row_step: usize,
    token_step: usize,
}

// SAFETY: every output index is written by exactly one task (tasks own
// disjoint row ranges), and the buffer outlives the parallel loop.
unsafe impl Sync for Dst {}

impl Dst {
    /// Writes output `(row, token)`.
    #[inline(always)]
    pub(crate) fn put(&self, row: usize, token: usize, v: f32) {
        let at = row * self.row_step + token * self.token_step;
        assert!(at < self.len);
        // SAFETY: in bounds (asserted); no other task writes this row.
        unsafe { *self.ptr.add(at) = v }
    }
}

/// Rows `start..stop` of `w` as float32, row-major (the values the products
/// use: the general path for an op the kernels do not serve).
pub fn dense_rows(
    w: &Weights,
    rows: usize,
    cols: usize,
    start: usize,
    stop: usize,
) -> Result<Vec<f32>, MatmulError> {
    if start > stop || stop > rows {
        return Err(MatmulError::RowRange { start, stop, rows });
    }
    let mut out = vec![0f32; stop.saturating_sub(start) * cols];
    dense_rows_into(w, rows, cols, start, &mut out)?;
    Ok(out)
}

/// `dense_rows` into `out` (`out.len() / cols` rows from `start`): memory
/// the caller reuses, so no fresh pages are faulted in.
pub fn dense_rows_into(
    w: &Weights,
    rows: usize,
    cols: usize,
    start: usize,
    out: &mut [f32],
) -> Result<(), MatmulError> {
    check(w, rows, cols)?;
    let stop = start + out.len() / cols.max(1);
    if stop > rows || out.len() != (stop - start) * cols {
        return Err(MatmulError::RowRange { start, stop, rows });
    }
    out.par_chunks_mut(cols.max(1))
        .enumerate()
        .for_each(|(i, row)| kernels::row_values(w, cols, start + i, row));
    Ok(())
}

/// `(Σ (a − b)², Σ b²)` over every value of two weights of one shape, in
/// float64 (a read-back weight's relative error against the checkpoint's),
/// summed row by row and then over rows in order: the same figure whatever
/// the thread count.
pub fn squared_error(
    a: &Weights,
    b: &Weights,
    rows: usize,
    cols: usize,
) -> Result<(f64, f64), MatmulError> {
    check(a, rows, cols)?;
    check(b, rows, cols)?;
    let per_row: Vec<(f64, f64)> = (0..rows)
        .into_par_iter()
        .map_init(
            || (vec![0f32; cols], vec![0f32; cols]),
            |(ra, rb), r| {
                kernels::row_values(a, cols, r, ra);
                kernels::row_values(b, cols, r, rb);
                ra.iter()
                    .zip(rb.iter())
                    .fold((0.0, 0.0), |(e, s), (&x, &y)| {
                        let (x, y) = (x as f64, y as f64);
                        (e + (x - y) * (x - y), s + y * y)
                    })
            },
        )
        .collect();
    Ok(per_row
        .iter()
        .fold((0.0, 0.0), |(e, s), &(re, rs)| (e + re, s + rs)))
}

/// The float32 value of a 16-entry fp16 table, for `Weights::Lut4`.
pub fn widen_lut(lut: &[f16]) -> Vec<f32> {
    lut.iter().map(|v| v.to_f32()).collect()
}

/// The bound above for `cols` columns, given the float64 sum of absolute
/// products: `γ_k · Σ|x_i·w_i| + k · 2⁻¹⁵⁰` (the second term is rounding
/// below float32's normal range, at most half a subnormal step each time).
pub fn error_bound(cols: usize, abs_sum: f64) -> f64 {
    let k = (2 * cols.div_ceil(BLOCK) + 4) as f64;
    let u = (2f64).powi(-24);
    k * u / (1.0 - k * u) * abs_sum + k * (2f64).powi(-150)
}
