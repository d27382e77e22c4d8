//! Optimal, deterministic n-bit palettization of fp16 weights (pure Rust).
//!
//! A weight `[rows, cols]` (rows = output channels) is cut into groups of
//! `group_size` consecutive rows. Each group gets a look-up table of
//! `2^nbits` fp16 entries and one index per element, chosen to minimise the
//! squared error — the same layout coremltools' `per_grouped_channel`
//! palettization produces.
//!
//! fp16 has only 65,536 bit patterns, so a histogram of the group's bit
//! patterns turns the group into a weighted 1-D k-means over its sorted
//! distinct values. In 1-D the optimal clusters are contiguous runs of the
//! sorted values, so the optimum is a dynamic programme over split points:
//! `D[k][j] = min_i D[k-1][i] + cost(i, j)`, where `cost` is the within-run
//! sum of squared deviations. That cost satisfies the quadrangle inequality,
//! so the best split `i` is monotone in `j` and divide and conquer finds each
//! layer in `O(n log n)`.
//!
//! What makes it fast (each step keeps the result exact and identical):
//! - **Level-order divide and conquer** (`Layer::solve`): all rows of one
//!   recursion level are independent, so their searches overlap in the CPU.
//! - **Row floors and ceilings** (`Dp::layers`, `Dp::coarse_bounds`): the
//!   final answer only depends on layer `m` at rows `j >= opt[m][floor[m+1]]`,
//!   and only up to the first row whose value reaches the layer above's at
//!   its own ceiling (values never fall as rows grow, costs are not
//!   negative). A pass over every 16th split point estimates both, the full
//!   programme then skips about 60% of the rows, and a cheap check after each
//!   layer proves the bounds were wide enough (otherwise the full programme
//!   runs).
//! - **Vector searches** (`avx2`, `avx512`): branch-free windows of 4 or 8
//!   splits and one-pass minimum-and-index loops, with the same roundings as
//!   the portable code.
//!
//! Exactness: every fp16 value is an integer multiple of 2^-24 (the smallest
//! subnormal), so values, counts and prefix sums are kept as integers (`q =
//! v * 2^24`, `i128` sums). A run's cost is `(W*S2 - S1^2) / W` with the
//! numerator computed exactly in integers, so each cost is a single rounding
//! away from its true value (no cancellation between large prefix sums).
//! Ties go to the smallest split index, which makes the result a function of
//! the input alone: same bytes in, same LUT and indices out, whatever the
//! thread count or vector build.
//!
//! The LUT is stored in fp16: each cluster's mean is rounded to the nearest
//! fp16 (which, for a fixed cluster, is the fp16 value with the least squared
//! error), then every distinct value is re-assigned to its nearest LUT entry
//! (lower index on a tie), which can only lower the error further.

use half::f16;
use rayon::prelude::*;

mod prefix;
mod search;
mod simd;
#[cfg(test)]
mod tests;

use prefix::{fixed, is_finite_bits, key, unkey, Prefix, FIXED_UNIT};
use search::Dp;
use simd::ISA_AVX512;

/// Largest number of elements in one group: keeps `W * S2` and `S1^2` inside
/// `i128` (|q| < 2^40, so both are below 2^(2*23+80) = 2^126).
pub const MAX_GROUP_ELEMENTS: usize = 1 << 23;

/// Why a weight cannot be palettized.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PaletteError {
    #[error("value {value} at row {row}, column {col}: palettization needs finite weights (NaN/Inf found)")]
    NonFinite { row: usize, col: usize, value: f32 },
    #[error("{rows} output channels are not a multiple of the group size {group_size}")]
    GroupMismatch { rows: usize, group_size: usize },
    #[error("shape [{rows}, {cols}] does not match {len} elements")]
    ShapeMismatch {
        rows: usize,
        cols: usize,
        len: usize,
    },
    #[error("nbits must be between 1 and 8, got {0}")]
    BadNbits(u32),
    #[error("group size must be at least 1")]
    ZeroGroup,
    #[error("a group holds {0} elements; at most {max} are supported", max = MAX_GROUP_ELEMENTS)]
    GroupTooLarge(usize),
    #[error("a LUT of {len} entries for {groups} groups of {entries}")]
    LutShape {
        len: usize,
        groups: usize,
        entries: usize,
    },
    #[error("group {0}'s LUT is not one the kernel made (its entries must be finite and sorted)")]
    LutNotKernels(usize),
}

/// A palettized weight: `lut` is `[groups, entries]` fp16, `indices` is
/// `[rows, cols]` (one byte per index, values below `entries`).
#[derive(Debug, Clone, PartialEq)]
pub struct Palette {
    pub lut: Vec<f16>,
    pub indices: Vec<u8>,
    pub groups: usize,
    pub entries: usize,
}

#[cfg(test)]
impl Palette {
    /// The dequantized weight, row-major `[rows, cols]`.
    pub fn dequantize(&self) -> Vec<f16> {
        let per_group = (self.indices.len() / self.groups.max(1)).max(1);
        self.indices
            .iter()
            .enumerate()
            .map(|(e, &ix)| self.lut[(e / per_group) * self.entries + ix as usize])
            .collect()
    }
}

thread_local! {
    /// Each worker thread's buffers, kept across groups and calls: a fresh
    /// set per rayon job costs page faults on every call.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::new());
}

/// Per-thread buffers, reused across groups.
struct Scratch {
    hist: Vec<u32>,
    slot: Vec<u8>,
    cents: Vec<f64>,
    keys: Vec<u16>,
    counts: Vec<u32>,
    q: Vec<i64>,
    prefix: Prefix,
    dp: Dp,
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            hist: vec![0; 1 << 16],
            slot: vec![0; 1 << 16],
            cents: Vec::new(),
            keys: Vec::new(),
            counts: Vec::new(),
            q: Vec::new(),
            prefix: Prefix::new(),
            dp: Dp::new(),
        }
    }

    /// Palettizes one group (`w`: fp16 bits) into `lut` and `idx`; on a NaN or
    /// an infinity, `idx` and `lut` are left unspecified.
    fn group(&mut self, w: &[u16], idx: &mut [u8], lut: &mut [f16]) -> Check {
        if !self.distinct(w) {
            return Check::NonFinite;
        }
        let k = lut.len().min(self.keys.len());
        let split = self.dp.isa != ISA_AVX512;
        self.prefix.fill_for(&self.q, &self.counts, split);
        let bounds = self.dp.solve(&self.prefix, k);

        // Cluster means rounded to fp16; unused entries stay +0.
        lut.fill(f16::ZERO);
        for c in 0..k {
            let (i, j) = (bounds[c], bounds[c + 1]);
            let p = &self.prefix;
            let mean = (p.s1[j] - p.s1[i]) as f64 / (p.w[j] - p.w[i]) as f64;
            lut[c] = f16::from_f64(mean * FIXED_UNIT);
        }
        self.assign(w, idx, &lut[..k]);
        Check::Ok
    }

    /// The indices `group` gives `w` with this `lut` (its own output), without
    /// solving for the LUT again: the same distinct values, the same number
    /// of used entries and the same nearest-entry pass, so the same bytes.
    /// A `lut` that `group` could not have made for `w` is refused: used
    /// entries not finite and sorted, or unused ones not +0.
    fn reassign(&mut self, w: &[u16], idx: &mut [u8], lut: &[f16]) -> Check {
        if !self.distinct(w) {
            return Check::NonFinite;
        }
        let (used, unused) = lut.split_at(lut.len().min(self.keys.len()));
        if !(used.iter().all(|c| c.is_finite()) && used.is_sorted())
            || unused.iter().any(|c| c.to_bits() != 0)
        {
            return Check::NotKernels;
        }
        self.assign(w, idx, used);
        Check::Ok
    }

    /// The group's distinct values in ascending order (`keys`), their counts
    /// and fixed-point values (`q`); false if one is a NaN or an infinity.
    /// Leaves the histogram zeroed for the next group.
    fn distinct(&mut self, w: &[u16]) -> bool {
        let (mut kmin, mut kmax) = (u16::MAX, 0u16);
        for &b in w {
            let k = key(b);
            self.hist[k as usize] += 1;
            kmin = kmin.min(k);
            kmax = kmax.max(k);
        }
        // Occupied keys in order, compacted without branches (about half the
        // keys in the range are occupied, so a branch would guess wrong often).
        let span = if kmin <= kmax {
            usize::from(kmax - kmin) + 1
        } else {
            0
        };
        self.keys.resize(span, 0);
        self.counts.resize(span, 0);
        let mut n = 0;
        for (t, c) in self.hist[usize::from(kmin)..usize::from(kmin) + span]
            .iter_mut()
            .enumerate()
        {
            let count = std::mem::take(c);
            self.keys[n] = kmin + t as u16;
            self.counts[n] = count;
            n += usize::from(count != 0);
        }
        self.keys.truncate(n);
        self.counts.truncate(n);
        self.q.clear();
        self.q.extend(self.keys.iter().map(|&k| fixed(unkey(k))));
        // Keys of -inf and negative NaNs are at most 0x03ff, those of +inf
        // and positive NaNs at least 0xfc00; every finite value lies between.
        !(kmin <= 0x03ff || kmax >= 0xfc00)
    }

    /// Every element's index: the nearest entry of `cents` (sorted; lower
    /// index on a tie) to its value. Sorted values and sorted entries, so the
    /// nearest index only moves forward; runs of equal entries are skipped so
    /// a tie keeps the lowest index.
    fn assign(&mut self, w: &[u16], idx: &mut [u8], entries: &[f16]) {
        let cents = &mut self.cents;
        cents.clear();
        cents.extend(entries.iter().map(|c| c.to_f64()));
        let k = cents.len();
        let mut t = 0usize;
        for (&kk, &qv) in self.keys.iter().zip(&self.q) {
            let x = qv as f64 * FIXED_UNIT;
            loop {
                let mut nx = t + 1;
                while nx < k && cents[nx] == cents[t] {
                    nx += 1;
                }
                if nx < k && (x - cents[nx]).abs() < (x - cents[t]).abs() {
                    t = nx;
                } else {
                    break;
                }
            }
            self.slot[kk as usize] = t as u8;
        }
        for (o, &b) in idx.iter_mut().zip(w) {
            *o = self.slot[key(b) as usize];
        }
    }
}

/// The checked shape of one palettization: fp16 bits, entries per LUT,
/// elements per group.
struct Shape<'a> {
    bits: &'a [u16],
    entries: usize,
    per_group: usize,
}

fn shape(
    weight: &[f16],
    rows: usize,
    cols: usize,
    group_size: usize,
    nbits: u32,
) -> Result<Shape<'_>, PaletteError> {
    if !(1..=8).contains(&nbits) {
        return Err(PaletteError::BadNbits(nbits));
    }
    if group_size == 0 {
        return Err(PaletteError::ZeroGroup);
    }
    if weight.len() != rows * cols {
        return Err(PaletteError::ShapeMismatch {
            rows,
            cols,
            len: weight.len(),
        });
    }
    if !rows.is_multiple_of(group_size) {
        return Err(PaletteError::GroupMismatch { rows, group_size });
    }
    let per_group = group_size * cols;
    if per_group > MAX_GROUP_ELEMENTS {
        return Err(PaletteError::GroupTooLarge(per_group));
    }
    Ok(Shape {
        bits: half::slice::HalfFloatSliceExt::reinterpret_cast(weight),
        entries: 1usize << nbits,
        per_group,
    })
}

/// How one group went.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Check {
    Ok,
    NonFinite,
    /// A LUT the kernel could not have made for the group.
    NotKernels,
}

/// Runs `f` on every group in parallel, with its fp16 bits, its indices and
/// its item of `luts`; returns the first group, in order, that did not pass.
fn each_group<L: Send>(
    bits: &[u16],
    indices: &mut [u8],
    per_group: usize,
    luts: impl IndexedParallelIterator<Item = L>,
    f: impl Fn(&mut Scratch, &[u16], &mut [u8], L) -> Check + Sync + Send,
) -> Option<(usize, Check)> {
    if per_group == 0 {
        return None;
    }
    indices
        .par_chunks_mut(per_group)
        .zip(luts)
        .zip(bits.par_chunks(per_group))
        .map(|((idx, l), w)| SCRATCH.with(|s| f(&mut s.borrow_mut(), w, idx, l)))
        .enumerate()
        .find_first(|&(_, c)| c != Check::Ok)
}

/// The error for a group that reported a non-finite value: the first one in
/// row-major order, whatever the threads.
fn non_finite(weight: &[f16], bits: &[u16], cols: usize) -> PaletteError {
    let e = bits
        .iter()
        .position(|&b| !is_finite_bits(b))
        .expect("a group reported a non-finite value");
    PaletteError::NonFinite {
        row: e / cols.max(1),
        col: e % cols.max(1),
        value: weight[e].to_f32(),
    }
}

/// Palettizes a row-major fp16 weight `[rows, cols]` with one LUT of
/// `2^nbits` entries per `group_size` consecutive rows. Groups run in
/// parallel on the current rayon pool; the result does not depend on it.
pub fn palettize(
    weight: &[f16],
    rows: usize,
    cols: usize,
    group_size: usize,
    nbits: u32,
) -> Result<Palette, PaletteError> {
    let Shape {
        bits,
        entries,
        per_group,
    } = shape(weight, rows, cols, group_size, nbits)?;
    let groups = rows / group_size;
    let mut lut = vec![f16::ZERO; groups * entries];
    let mut indices = vec![0u8; rows * cols];
    // Non-finite values are found by each group's histogram, so the weight is
    // read once.
    let luts = lut.par_chunks_mut(entries);
    if each_group(bits, &mut indices, per_group, luts, Scratch::group).is_some() {
        return Err(non_finite(weight, bits, cols));
    }
    Ok(Palette {
        lut,
        indices,
        groups,
        entries,
    })
}

/// The indices [`palettize`] gives `weight` when it produced `lut` (`[groups,
/// 2^nbits]`), without solving for the LUT: a cheap pass over the weight, so
/// a build can keep just the LUTs of weights it will see again. Byte-identical
/// to `palettize(..).indices` for that LUT. A group's LUT that the kernel
/// could not have made for it (used entries not finite and sorted, unused
/// ones not +0) is refused.
pub fn indices_for(
    weight: &[f16],
    rows: usize,
    cols: usize,
    group_size: usize,
    nbits: u32,
    lut: &[f16],
) -> Result<Vec<u8>, PaletteError> {
    let Shape {
        bits,
        entries,
        per_group,
    } = shape(weight, rows, cols, group_size, nbits)?;
    let groups = rows / group_size;
    if lut.len() != groups * entries {
        return Err(PaletteError::LutShape {
            len: lut.len(),
            groups,
            entries,
        });
    }
    let mut indices = vec![0u8; rows * cols];
    let luts = lut.par_chunks(entries);
    match each_group(bits, &mut indices, per_group, luts, Scratch::reassign) {
        None => Ok(indices),
        Some((_, Check::NonFinite)) => Err(non_finite(weight, bits, cols)),
        Some((g, _)) => Err(PaletteError::LutNotKernels(g)),
    }
}
