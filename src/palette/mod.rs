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

/// Order-preserving key of an fp16 bit pattern: ascending keys are ascending
/// values. -0 is folded onto +0 (the same value, so the same LUT entry).
#[inline]
fn key(bits: u16) -> u16 {
    let b = if bits == 0x8000 { 0 } else { bits };
    if b & 0x8000 != 0 {
        !b
    } else {
        b | 0x8000
    }
}

#[inline]
fn unkey(k: u16) -> u16 {
    if k & 0x8000 != 0 {
        k & 0x7fff
    } else {
        !k
    }
}

#[inline]
fn is_finite_bits(bits: u16) -> bool {
    bits & 0x7c00 != 0x7c00
}

/// The value of one unit of [`fixed`].
const FIXED_UNIT: f64 = 1.0 / (1u64 << 24) as f64;

/// The fp16 value as an integer multiple of 2^-24 (exact; |q| < 2^40).
#[inline]
fn fixed(bits: u16) -> i64 {
    let exp = (bits >> 10) & 0x1f;
    let mant = i64::from(bits & 0x3ff);
    let mag = if exp == 0 {
        mant
    } else {
        (mant | 0x400) << (exp - 1)
    };
    if bits & 0x8000 != 0 {
        -mag
    } else {
        mag
    }
}

/// Weighted points sorted by value, with exact integer prefix sums, plus
/// f64 views of them for the vectorised search.
struct Prefix {
    /// `w[j]`: total count of the first `j` points.
    w: Vec<i64>,
    /// `s1[j]`: sum of count * q (|s1| < 2^23 * 2^40: fits i64).
    s1: Vec<i64>,
    /// `s2[j]`: sum of count * q^2, used when the total reaches 2^64 (values
    /// of magnitude ~0.5 and above); otherwise empty.
    s2_wide: Vec<i128>,
    /// True when every `s2` prefix is below 2^64: then the split views below
    /// are filled and costs are evaluated in f64, several at a time.
    narrow: bool,
    /// `w` as f64 (exact: below 2^23).
    fw: Vec<f64>,
    /// `s1 = h * 2^32 + l` with `0 <= l < 2^32`: both parts exact in f64, so
    /// a difference of prefixes is recovered exactly before one rounding.
    /// (Only filled for the portable and AVX2 searches, see `has_split_views`;
    /// the AVX-512 search reads the integer views.)
    s1h: Vec<f64>,
    s1l: Vec<f64>,
    s2h: Vec<f64>,
    s2l: Vec<f64>,
    /// Narrow groups: `s1` and `s2` as integers, padded like the f64 views
    /// (the AVX-512 search subtracts them exactly, then converts once).
    s1i: Vec<i64>,
    s2u: Vec<u64>,
}

const TWO32: f64 = 4294967296.0;

impl Prefix {
    fn new() -> Self {
        Prefix {
            w: Vec::new(),
            s1: Vec::new(),
            s2_wide: Vec::new(),
            s1i: Vec::new(),
            s2u: Vec::new(),
            narrow: true,
            fw: Vec::new(),
            s1h: Vec::new(),
            s1l: Vec::new(),
            s2h: Vec::new(),
            s2l: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.w.len() - 1
    }

    /// A bound on the rounding in any programme value, far above what
    /// accumulates: every cost is a few units in the last place of at most
    /// the sum of every point's `count * q^2` (which no cost or value
    /// exceeds), and each layer adds one more rounding.
    fn rounding_margin(&self) -> f64 {
        let n = self.len();
        let s2 = if self.narrow {
            self.s2u[n] as f64
        } else {
            self.s2_wide[n] as f64
        };
        s2 * (-36f64).exp2()
    }

    /// Whether the split f64 views are filled, as long as `fw` (narrow
    /// groups filled with `split`, and their samples).
    fn has_split_views(&self) -> bool {
        [&self.s1h, &self.s1l, &self.s2h, &self.s2l]
            .iter()
            .all(|v| v.len() == self.fw.len())
    }

    /// The prefix of the points merged into runs of `step` (the last run
    /// may be shorter): the prefix sums at split points `0, step, 2*step, ...,
    /// n`. Costs on it are exactly those of the original at those splits.
    fn sample(&self, step: usize, out: &mut Prefix) {
        let n = self.len();
        let at: Vec<usize> = (0..n.div_ceil(step)).map(|t| t * step).chain([n]).collect();
        out.narrow = self.narrow;
        out.w = at.iter().map(|&i| self.w[i]).collect();
        out.s1 = at.iter().map(|&i| self.s1[i]).collect();
        if self.narrow {
            out.s2_wide.clear();
            for (dst, src) in [
                (&mut out.fw, &self.fw),
                (&mut out.s1h, &self.s1h),
                (&mut out.s1l, &self.s1l),
                (&mut out.s2h, &self.s2h),
                (&mut out.s2l, &self.s2l),
            ] {
                dst.clear();
                if !src.is_empty() {
                    dst.extend(at.iter().map(|&i| src[i]));
                    dst.extend(std::iter::repeat_n(src[n], PAD));
                }
            }
            out.s1i.clear();
            out.s1i.extend(at.iter().map(|&i| self.s1i[i]));
            out.s1i.extend(std::iter::repeat_n(self.s1i[n], PAD));
            out.s2u.clear();
            out.s2u.extend(at.iter().map(|&i| self.s2u[i]));
            out.s2u.extend(std::iter::repeat_n(self.s2u[n], PAD));
        } else {
            out.s2_wide = at.iter().map(|&i| self.s2_wide[i]).collect();
        }
    }

    /// Prefix sums of the sorted distinct values `q` with their counts, and
    /// every view a search build reads.
    #[cfg(test)]
    fn fill(&mut self, q: &[i64], counts: &[u32]) {
        self.fill_for(q, counts, true);
    }

    /// As `fill`; the split f64 views (read by the portable and AVX2
    /// searches) only when `split`.
    fn fill_for(&mut self, q: &[i64], counts: &[u32], split: bool) {
        let total: u128 = counts.iter().map(|&c| u128::from(c)).sum();
        let qmax = q
            .iter()
            .map(|v| u128::from(v.unsigned_abs()))
            .max()
            .unwrap_or(0);
        self.narrow = total * qmax * qmax < 1u128 << 64;
        for v in [
            &mut self.fw,
            &mut self.s1h,
            &mut self.s1l,
            &mut self.s2h,
            &mut self.s2l,
        ] {
            v.clear();
        }
        self.w.clear();
        self.s1.clear();
        self.s2_wide.clear();
        self.s1i.clear();
        self.s2u.clear();
        let (mut w, mut s1) = (0i64, 0i64);
        if self.narrow {
            // Every count * q^2 and every prefix of them is below 2^64.
            let mut s2 = 0u64;
            for t in 0..=q.len() {
                if t > 0 {
                    let (v, c) = (q[t - 1], counts[t - 1]);
                    w += i64::from(c);
                    s1 += i64::from(c) * v;
                    s2 += u64::from(c) * (v.unsigned_abs() * v.unsigned_abs());
                }
                self.w.push(w);
                self.s1.push(s1);
                self.fw.push(w as f64);
                // Arithmetic shift: h * 2^32 + l == s1 with 0 <= l < 2^32.
                if split {
                    self.s1h.push((s1 >> 32) as f64);
                    self.s1l.push((s1 & 0xffff_ffff) as f64);
                    self.s2h.push((s2 >> 32) as f64);
                    self.s2l.push((s2 & 0xffff_ffff) as f64);
                }
                self.s2u.push(s2);
            }
        } else {
            let mut s2 = 0i128;
            for t in 0..=q.len() {
                if t > 0 {
                    let (v, c) = (q[t - 1], counts[t - 1]);
                    w += i64::from(c);
                    s1 += i64::from(c) * v;
                    s2 += i128::from(c) * i128::from(v) * i128::from(v);
                }
                self.w.push(w);
                self.s1.push(s1);
                self.s2_wide.push(s2);
            }
        }
        if self.narrow {
            // Fixed-width windows may read up to PAD entries past the end.
            for v in [
                &mut self.fw,
                &mut self.s1h,
                &mut self.s1l,
                &mut self.s2h,
                &mut self.s2l,
            ] {
                if let Some(&last) = v.last() {
                    v.extend(std::iter::repeat_n(last, PAD));
                }
            }
            self.s1i.extend_from_slice(&self.s1);
            self.s1i.extend(std::iter::repeat_n(s1, PAD));
            self.s2u
                .extend(std::iter::repeat_n(*self.s2u.last().unwrap_or(&0), PAD));
        }
    }

    /// Sum of squared deviations from the mean of points `i..j` (`i < j`), in
    /// units of 2^-48, for wide groups: `(W*S2 - S1^2) / W` with the
    /// numerator exact in i128.
    #[inline]
    fn cost_wide(&self, i: usize, j: usize) -> f64 {
        let w = self.w[j] - self.w[i];
        let s1 = i128::from(self.s1[j] - self.s1[i]);
        let s2 = self.s2_wide[j] - self.s2_wide[i];
        let num = s2 * i128::from(w) - s1 * s1;
        num as f64 / w as f64
    }

    /// The same for narrow groups, from the split f64 prefixes: `S2 - S1^2/W`
    /// with `S1`, `S2` exact differences rounded once. Written so that a
    /// whole row of `i` vectorises; the scalar and vector forms round
    /// identically (no fused multiply-add), so results do not depend on the CPU.
    #[inline(always)]
    fn row_narrow(&self, prev: &[f64], j: usize, a: usize, out: &mut [f64]) {
        debug_assert!(self.has_split_views(), "the split views were not filled");
        let b = a + out.len();
        let (wj, s1hj, s1lj, s2hj, s2lj) = (
            self.fw[j],
            self.s1h[j],
            self.s1l[j],
            self.s2h[j],
            self.s2l[j],
        );
        let it = out
            .iter_mut()
            .zip(&prev[a..b])
            .zip(&self.fw[a..b])
            .zip(self.s1h[a..b].iter().zip(&self.s1l[a..b]))
            .zip(self.s2h[a..b].iter().zip(&self.s2l[a..b]));
        for ((((o, &p), &w), (&h1, &l1)), (&h2, &l2)) in it {
            let dw = wj - w;
            let d1 = (s1hj - h1) * TWO32 + (s1lj - l1);
            let d2 = (s2hj - h2) * TWO32 + (s2lj - l2);
            *o = p + (d2 - d1 * d1 / dw);
        }
    }

    /// Leftmost `i` in `[a, a + w)` minimising `prev[i] + cost(i, j)` for a
    /// narrow group, `1 <= w <= L`, with the same arithmetic as `row`. All
    /// `L` lanes are computed without branches (reads past the last split land
    /// in the padding of `prev` and the prefix views) and lanes from `w` on are
    /// masked before the minimum.
    #[inline(always)]
    fn small_min<const L: usize>(
        &self,
        prev: &[f64],
        j: usize,
        a: usize,
        w: usize,
    ) -> (usize, f64) {
        let mut v = [0.0; L];
        self.row_narrow(prev, j, a, &mut v);
        for (t, x) in v.iter_mut().enumerate() {
            if t >= w {
                *x = f64::INFINITY;
            }
        }
        let (t, m) = argmin_fixed(&v);
        (a + t, m)
    }

    /// `out[t] = prev[a + t] + cost(a + t, j)`.
    #[cfg(test)]
    fn row(&self, prev: &[f64], j: usize, a: usize, out: &mut [f64], avx2: bool) {
        if self.narrow {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: only called when the CPU reports AVX2.
                unsafe { row_narrow_avx2(self, prev, j, a, out) };
                return;
            }
            let _ = avx2;
            self.row_narrow(prev, j, a, out);
        } else {
            self.row_wide(prev, j, a, out);
        }
    }

    #[inline(always)]
    fn row_wide(&self, prev: &[f64], j: usize, a: usize, out: &mut [f64]) {
        for (t, o) in out.iter_mut().enumerate() {
            *o = prev[a + t] + self.cost_wide(a + t, j);
        }
    }

    /// `out[j] = cost(0, j)` for `j` in `1..out.len()`: the first layer (one
    /// cluster over the first `j` points), with the arithmetic of `row`.
    #[inline(always)]
    fn first_column(&self, out: &mut [f64]) {
        if self.narrow {
            // The exact integer differences rounded once: the values the
            // split views give (see `row_narrow`).
            let m = out.len();
            let (w0, s10, s20) = (self.fw[0], self.s1i[0], self.s2u[0]);
            let it = out[1..]
                .iter_mut()
                .zip(&self.fw[1..m])
                .zip(self.s1i[1..m].iter().zip(&self.s2u[1..m]));
            for ((o, &wj), (&s1, &s2)) in it {
                let dw = wj - w0;
                let d1 = (s1 - s10) as f64;
                let d2 = s2.wrapping_sub(s20) as f64;
                *o = 0.0 + (d2 - d1 * d1 / dw);
            }
        } else {
            for (j, o) in out.iter_mut().enumerate().skip(1) {
                *o = 0.0 + self.cost_wide(0, j);
            }
        }
    }
}

/// Windows of at most this many splits are searched with fixed-width,
/// branch-free code: most windows of a divide and conquer hold a handful.
const SMALL: usize = 8;
/// Entries appended to `prev` and to the f64 prefix views so a fixed-width
/// window never reads past the end.
const PAD: usize = SMALL - 1;

/// `Prefix::row_narrow` compiled for AVX2 (four f64 lanes).
#[cfg(all(test, target_arch = "x86_64"))]
#[target_feature(enable = "avx2")]
unsafe fn row_narrow_avx2(p: &Prefix, prev: &[f64], j: usize, a: usize, out: &mut [f64]) {
    p.row_narrow(prev, j, a, out)
}

/// Which search code `Dp` runs (a const parameter, so each build is
/// compiled separately with its target features).
const ISA_PORTABLE: u8 = 0;
const ISA_AVX2: u8 = 1;
const ISA_AVX512: u8 = 2;

/// The search builds this CPU can run, slowest first.
fn available_isas() -> Vec<u8> {
    let mut isas = vec![ISA_PORTABLE];
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            isas.push(ISA_AVX2);
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512dq")
            {
                isas.push(ISA_AVX512);
            }
        }
    }
    isas
}

/// The fastest build this CPU runs. `CHUNKFORGE_PALETTE_ISA=portable|avx2`
/// caps it (for comparisons; every build gives the same bytes).
fn best_isa() -> u8 {
    let cap = match std::env::var("CHUNKFORGE_PALETTE_ISA").as_deref() {
        Ok("portable") => ISA_PORTABLE,
        Ok("avx2") => ISA_AVX2,
        _ => ISA_AVX512,
    };
    available_isas()
        .into_iter()
        .filter(|&i| i <= cap)
        .max()
        .unwrap_or(ISA_PORTABLE)
}

#[cfg(test)]
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `if x < m { x } else { m }`: the minimum of two non-NaN values (exact, so
/// any order of reduction gives the same result), one `minpd` lane.
#[inline(always)]
fn min2(m: f64, x: f64) -> f64 {
    if x < m {
        x
    } else {
        m
    }
}

/// Leftmost minimum of a power-of-two-sized array (index, value): a lane-wise
/// reduction tree for the value, then the first lane equal to it.
#[inline(always)]
fn argmin_fixed<const L: usize>(v: &[f64; L]) -> (usize, f64) {
    let mut m = *v;
    let mut len = L;
    while len > 1 {
        len /= 2;
        for t in 0..len {
            m[t] = min2(m[t], m[t + len]);
        }
    }
    let min = m[0];
    let mut mask = 0u32;
    for (t, &x) in v.iter().enumerate() {
        mask |= u32::from(x == min) << t;
    }
    (mask.trailing_zeros() as usize, min)
}

/// Leftmost minimum of `v` (index, value); `v` is never empty and holds no
/// NaN. Eight-lane minimum, then the first element equal to it.
#[inline(always)]
fn argmin(v: &[f64]) -> (usize, f64) {
    let mut acc = [f64::INFINITY; SMALL];
    let mut chunks = v.chunks_exact(SMALL);
    for c in &mut chunks {
        for t in 0..SMALL {
            acc[t] = min2(acc[t], c[t]);
        }
    }
    for (t, &x) in chunks.remainder().iter().enumerate() {
        acc[t] = min2(acc[t], x);
    }
    let (_, min) = argmin_fixed(&acc);
    let at = v.iter().position(|&x| x == min).unwrap_or(0);
    (at, min)
}

/// The narrow search written with AVX2 intrinsics: the same operations in
/// the same order as `Prefix::row_narrow` (so the same roundings), with the
/// lane-wise minimum and the leftmost-lane search kept in vector registers.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Prefix, SMALL, TWO32};
    use std::arch::x86_64::*;

    /// `prev[i] + cost(i, j)` for the four splits `i = a..a + 4`.
    #[inline(always)]
    unsafe fn eval4(p: &Prefix, prev: &[f64], j: usize, a: usize) -> __m256d {
        assert!(a + 4 <= prev.len() && a + 4 <= p.fw.len());
        // SAFETY: the assert keeps every four-lane load inside the arrays
        // (`best_split`, the only caller, checks that the split views have
        // the length of `fw`).
        let ld = |v: &[f64]| unsafe { _mm256_loadu_pd(v.as_ptr().add(a)) };
        let two32 = _mm256_set1_pd(TWO32);
        let dw = _mm256_sub_pd(_mm256_set1_pd(p.fw[j]), ld(&p.fw));
        let d1 = _mm256_add_pd(
            _mm256_mul_pd(_mm256_sub_pd(_mm256_set1_pd(p.s1h[j]), ld(&p.s1h)), two32),
            _mm256_sub_pd(_mm256_set1_pd(p.s1l[j]), ld(&p.s1l)),
        );
        let d2 = _mm256_add_pd(
            _mm256_mul_pd(_mm256_sub_pd(_mm256_set1_pd(p.s2h[j]), ld(&p.s2h)), two32),
            _mm256_sub_pd(_mm256_set1_pd(p.s2l[j]), ld(&p.s2l)),
        );
        let cost = _mm256_sub_pd(d2, _mm256_div_pd(_mm256_mul_pd(d1, d1), dw));
        _mm256_add_pd(ld(prev), cost)
    }

    /// Lanes at or past `w` (counting from `base`) set to +inf.
    #[inline(always)]
    unsafe fn mask_from(v: __m256d, base: usize, w: usize) -> __m256d {
        let lane = _mm256_set_pd(3.0, 2.0, 1.0, 0.0);
        let limit = _mm256_set1_pd(w as f64 - base as f64);
        let keep = _mm256_cmp_pd::<_CMP_LT_OQ>(lane, limit);
        _mm256_blendv_pd(_mm256_set1_pd(f64::INFINITY), v, keep)
    }

    /// The minimum of the four lanes, in every lane (exact, order-free).
    #[inline(always)]
    unsafe fn hmin(v: __m256d) -> __m256d {
        let m = _mm256_min_pd(v, _mm256_permute2f128_pd::<1>(v, v));
        _mm256_min_pd(m, _mm256_shuffle_pd::<0b0101>(m, m))
    }

    /// Bit `t` set when lane `t` equals the broadcast minimum.
    #[inline(always)]
    unsafe fn hits(v: __m256d, m: __m256d) -> u32 {
        _mm256_movemask_pd(_mm256_cmp_pd::<_CMP_EQ_OQ>(v, m)) as u32
    }

    /// Leftmost `i` in `[a, a + w)` minimising `prev[i] + cost(i, j)`, and
    /// the minimum. Short windows are one or two masked vectors (reads past
    /// the end land in the padding); long ones one pass over vectors.
    #[inline(always)]
    pub(super) unsafe fn best_split(
        p: &Prefix,
        prev: &[f64],
        j: usize,
        a: usize,
        w: usize,
    ) -> (usize, f64) {
        assert!(p.has_split_views());
        if w <= 4 {
            let v = mask_from(eval4(p, prev, j, a), 0, w);
            let m = hmin(v);
            (
                a + hits(v, m).trailing_zeros() as usize,
                _mm256_cvtsd_f64(m),
            )
        } else if w <= SMALL {
            let v0 = eval4(p, prev, j, a);
            let v1 = mask_from(eval4(p, prev, j, a + 4), 4, w);
            let m = hmin(_mm256_min_pd(v0, v1));
            let bits = hits(v0, m) | hits(v1, m) << 4;
            (a + bits.trailing_zeros() as usize, _mm256_cvtsd_f64(m))
        } else {
            // One pass: each lane keeps its lowest value and the first
            // split holding it (strict `<`); the answer is the lowest index
            // among the lanes holding the overall minimum. The last vector is
            // masked.
            let chunks = w.div_ceil(4);
            let mut acc = _mm256_set1_pd(f64::INFINITY);
            let mut idx = _mm256_setzero_pd();
            let mut lane = _mm256_set_pd(3.0, 2.0, 1.0, 0.0);
            let four = _mm256_set1_pd(4.0);
            for c in 0..chunks - 1 {
                let v = eval4(p, prev, j, a + 4 * c);
                let lt = _mm256_cmp_pd::<_CMP_LT_OQ>(v, acc);
                acc = _mm256_blendv_pd(acc, v, lt);
                idx = _mm256_blendv_pd(idx, lane, lt);
                lane = _mm256_add_pd(lane, four);
            }
            let c = chunks - 1;
            let v = mask_from(eval4(p, prev, j, a + 4 * c), 4 * c, w);
            let lt = _mm256_cmp_pd::<_CMP_LT_OQ>(v, acc);
            acc = _mm256_blendv_pd(acc, v, lt);
            idx = _mm256_blendv_pd(idx, lane, lt);
            let m = hmin(acc);
            let at_min = _mm256_cmp_pd::<_CMP_EQ_OQ>(acc, m);
            let first = hmin(_mm256_blendv_pd(_mm256_set1_pd(f64::INFINITY), idx, at_min));
            (a + _mm256_cvtsd_f64(first) as usize, _mm256_cvtsd_f64(m))
        }
    }
}

/// The narrow search in AVX-512, eight lanes. Prefix differences are taken
/// exactly in 64-bit integers and converted once (`vcvtqq2pd` rounds the
/// exact difference, as the split f64 form does), then the remaining
/// operations are those of `Prefix::row_narrow` in the same order: the same
/// value for every split as the other builds.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Prefix, SMALL};
    use std::arch::x86_64::*;

    /// `prev[i] + cost(i, j)` for the eight splits `i = a..a + 8`.
    #[inline(always)]
    unsafe fn eval8(p: &Prefix, prev: &[f64], j: usize, a: usize) -> __m512d {
        assert!(a + 8 <= prev.len() && a + 8 <= p.fw.len());
        assert!(p.s1i.len() == p.fw.len() && p.s2u.len() == p.fw.len());
        let dw = _mm512_sub_pd(
            _mm512_set1_pd(p.fw[j]),
            _mm512_loadu_pd(p.fw.as_ptr().add(a)),
        );
        let d1 = _mm512_cvtepi64_pd(_mm512_sub_epi64(
            _mm512_set1_epi64(p.s1i[j]),
            _mm512_loadu_epi64(p.s1i.as_ptr().add(a)),
        ));
        // Wraps only in lanes with i > j, which are masked.
        let d2 = _mm512_cvtepu64_pd(_mm512_sub_epi64(
            _mm512_set1_epi64(p.s2u[j] as i64),
            _mm512_loadu_epi64(p.s2u.as_ptr().add(a).cast::<i64>()),
        ));
        let cost = _mm512_sub_pd(d2, _mm512_div_pd(_mm512_mul_pd(d1, d1), dw));
        _mm512_add_pd(_mm512_loadu_pd(prev.as_ptr().add(a)), cost)
    }

    /// Lanes `0..valid` of `v`, +inf in the others (`1 <= valid <= 8`).
    #[inline(always)]
    unsafe fn keep(v: __m512d, valid: usize) -> __m512d {
        let k = (0xffu32 >> (8 - valid)) as __mmask8;
        _mm512_mask_blend_pd(k, _mm512_set1_pd(f64::INFINITY), v)
    }

    /// Leftmost `i` in `[a, a + w)` minimising `prev[i] + cost(i, j)`, and
    /// the minimum.
    #[inline(always)]
    pub(super) unsafe fn best_split(
        p: &Prefix,
        prev: &[f64],
        j: usize,
        a: usize,
        w: usize,
    ) -> (usize, f64) {
        if w <= SMALL {
            let v = keep(eval8(p, prev, j, a), w);
            let m = _mm512_reduce_min_pd(v);
            let hits = _mm512_cmpeq_pd_mask(v, _mm512_set1_pd(m));
            (a + hits.trailing_zeros() as usize, m)
        } else {
            // One pass: each lane keeps its lowest value and the first split
            // holding it (strict `<`); the answer is the lowest index among
            // the lanes holding the overall minimum.
            let chunks = w.div_ceil(8);
            let mut acc = _mm512_set1_pd(f64::INFINITY);
            let mut idx = _mm512_setzero_pd();
            let mut lane = _mm512_set_pd(7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0);
            let eight = _mm512_set1_pd(8.0);
            for c in 0..chunks {
                let mut v = eval8(p, prev, j, a + 8 * c);
                if c + 1 == chunks {
                    v = keep(v, w - 8 * c);
                }
                let lt = _mm512_cmp_pd_mask::<_CMP_LT_OQ>(v, acc);
                acc = _mm512_mask_blend_pd(lt, acc, v);
                idx = _mm512_mask_blend_pd(lt, idx, lane);
                lane = _mm512_add_pd(lane, eight);
            }
            let m = _mm512_reduce_min_pd(acc);
            let at = _mm512_cmpeq_pd_mask(acc, _mm512_set1_pd(m));
            let first = _mm512_mask_reduce_min_pd(at, idx);
            (a + first as usize, m)
        }
    }
}

/// The layered dynamic programme `D[k][j] = min_i D[k-1][i] + cost(i, j)`.
struct Dp {
    prev: Vec<f64>,
    cur: Vec<f64>,
    /// `opt[(k - 1) * (n + 1) + j]`: best last split for `j` points in `k` clusters.
    opt: Vec<u32>,
    row: Vec<f64>,
    /// `vals[(k - 1) * (n + 1) + j]`: the programme's value for `j` points in
    /// `k` clusters, kept only by the coarse pass (`keep_values`).
    vals: Vec<f64>,
    keep_values: bool,
    /// `ISA_*`: the search code this programme runs.
    isa: u8,
    /// The coarse pass's prefix and programme (see `coarse_bounds`).
    coarse: Option<Box<(Prefix, Dp)>>,
}

impl Dp {
    fn new() -> Self {
        Dp {
            prev: Vec::new(),
            cur: Vec::new(),
            opt: Vec::new(),
            row: Vec::new(),
            vals: Vec::new(),
            keep_values: false,
            isa: best_isa(),
            coarse: None,
        }
    }

    #[cfg(test)]
    fn with_isa(isa: u8) -> Self {
        assert!(available_isas().contains(&isa));
        Dp { isa, ..Dp::new() }
    }

    /// Split points `0 = b[0] < b[1] < ... < b[k] = n` of the optimal
    /// partition of the `n` sorted weighted points into `k` contiguous
    /// clusters.
    fn solve(&mut self, p: &Prefix, k: usize) -> Vec<usize> {
        let n = p.len();
        assert!(k >= 1 && k <= n);
        if k == n {
            return (0..=n).collect();
        }
        #[cfg(target_arch = "x86_64")]
        if self.isa == ISA_AVX512 {
            // SAFETY: `isa` is ISA_AVX512 only when the CPU reports AVX-512 F
            // and DQ (`best_isa`, `available_isas`).
            return unsafe { self.solve_avx512(p, k) };
        }
        #[cfg(target_arch = "x86_64")]
        if self.isa == ISA_AVX2 {
            // SAFETY: `isa` is ISA_AVX2 only when the CPU reports AVX2.
            return unsafe { self.solve_avx2(p, k) };
        }
        self.solve_body::<ISA_PORTABLE>(p, k)
    }

    /// `solve_body` with the narrow searches in AVX-512 (eight lanes, integer
    /// prefix differences converted once). The same roundings as the other
    /// builds: see `avx512`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,avx512f,avx512dq")]
    unsafe fn solve_avx512(&mut self, p: &Prefix, k: usize) -> Vec<usize> {
        self.solve_body::<ISA_AVX512>(p, k)
    }

    /// `solve_body` with every inlined loop compiled for AVX2. No FMA: the
    /// roundings are those of the portable build, so results do not depend
    /// on the CPU.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn solve_avx2(&mut self, p: &Prefix, k: usize) -> Vec<usize> {
        self.solve_body::<ISA_AVX2>(p, k)
    }

    #[inline(always)]
    fn solve_body<const ISA: u8>(&mut self, p: &Prefix, k: usize) -> Vec<usize> {
        let n = p.len();
        if k > 2 && n >= COARSE_MIN * k {
            if let Some(bounds) = self.coarse_bounds::<ISA>(p, k) {
                if self.layers::<ISA>(p, k, &bounds) {
                    return self.backtrack(n, k);
                }
            }
        }
        // Every row of every layer: nothing to check.
        let complete = self.layers::<ISA>(p, k, &Rows::all(n, k));
        debug_assert!(complete);
        self.backtrack(n, k)
    }

    /// The layered programme, computing layer `m` only for the rows
    /// `rows.floors[m] ..= rows.ceils[m]` (see [`Rows`]).
    ///
    /// Floors: layer `m + 1` searches its rows `j >= floors[m + 1]` over
    /// splits `i >= floors[m]`, so it is exact when its best splits are never
    /// below `floors[m]`. They are not below `opt[m][j] >= opt[m][floors[m +
    /// 1]]` (one more cluster never lengthens the last one; best splits grow
    /// with `j`), so after each layer that one value is checked.
    ///
    /// Ceilings: layer `m + 1` searches splits `i <= ceils[m]`, so it is
    /// exact when no split above would do better for its top row `c =
    /// ceils[m + 1]` (best splits grow with `j`: then none would for lower
    /// rows either). Any such split costs at least `D[m][i] >= D[m][ceils[m]]`
    /// (`D[m][i]` never falls as `i` grows: dropping the last point cannot
    /// raise a partition's cost), so `D[m][ceils[m]]`, less a margin for
    /// rounding, at or above the top row's value proves it.
    ///
    /// Returns false, with the tables unusable, when a check fails.
    #[inline(always)]
    fn layers<const ISA: u8>(&mut self, p: &Prefix, k: usize, rows: &Rows) -> bool {
        let Rows { floors, ceils } = rows;
        let n = p.len();
        debug_assert!(rows.valid(n, k), "{rows:?}");
        let stride = n + 1;
        let margin = p.rounding_margin();
        // No clearing: every entry a layer reads was written by the layer
        // before it, except the `opt` entries above a layer's ceiling that
        // the next layer reads, set below (window lanes past the end are
        // masked whatever they hold).
        self.prev.resize(stride + PAD, f64::INFINITY);
        self.cur.resize(stride + PAD, f64::INFINITY);
        self.opt.resize(k * stride, 0);
        self.row.resize(stride + SMALL, 0.0);
        // One cluster over the first j points; only j <= n-(k-1) leaves a
        // point for every later cluster.
        let last = n - (k - 1);
        self.cur[0] = f64::INFINITY;
        p.first_column(&mut self.cur[..=last]);
        if self.keep_values {
            self.vals.resize(k * stride, f64::INFINITY);
            self.vals[..=last].copy_from_slice(&self.cur[..=last]);
        }
        std::mem::swap(&mut self.prev, &mut self.cur);
        for layer in 2..=k {
            let (done, rest) = self.opt.split_at_mut((layer - 1) * stride);
            let lower = &done[(layer - 2) * stride..];
            let opt = &mut rest[..stride];
            // Rows j in [floors[layer], ceils[layer]], splits i in
            // [floors[layer-1], min(ceils[layer-1], j-1)].
            let (lo, hi) = (floors[layer], ceils[layer]);
            let ihi = ceils[layer - 1].min(hi - 1);
            if layer == k {
                // The last cluster ends at n: one row.
                let ctx = Layer::<ISA> {
                    p,
                    prev: &self.prev,
                    lower: None,
                };
                let (t, v) = ctx.best_split(n, floors[k - 1], ihi, &mut self.row);
                opt[n] = t as u32;
                self.cur[n] = v;
            } else {
                let lower = if layer > 2 { Some(lower) } else { None };
                let ctx = Layer::<ISA> {
                    p,
                    prev: &self.prev,
                    lower,
                };
                ctx.solve(
                    &mut self.cur,
                    opt,
                    &mut self.row,
                    (lo, hi),
                    (floors[layer - 1], ihi),
                );
                // The next layer's rows above this one's ceiling read this
                // layer's best split there as their floor; 0 is always a
                // valid one.
                opt[hi + 1..=ceils[layer + 1]].fill(0);
                let demand = floors[layer + 1].min(hi);
                if lo > layer && (opt[demand] as usize) < lo {
                    return false;
                }
            }
            if ihi < hi - 1 && self.prev[ihi] - margin < self.cur[hi] {
                return false;
            }
            if self.keep_values {
                let at = (layer - 1) * stride;
                self.vals[at + lo..=at + hi].copy_from_slice(&self.cur[lo..=hi]);
            }
            std::mem::swap(&mut self.prev, &mut self.cur);
        }
        true
    }

    /// Split points of the optimum from the tables of `layers`.
    fn backtrack(&self, n: usize, k: usize) -> Vec<usize> {
        let stride = n + 1;
        let mut b = vec![0usize; k + 1];
        b[k] = n;
        for layer in (2..=k).rev() {
            b[layer - 1] = self.opt[(layer - 1) * stride + b[layer]] as usize;
        }
        b
    }

    /// Row floors and ceilings for `layers`, estimated from the same
    /// programme on every `COARSE`-th split point (about 1/16 of the work).
    ///
    /// Floors: the chain of best splits `L[k] = n`, `L[m] = opt[m][L[m +
    /// 1]]` marks the first row of each layer that the final answer can
    /// depend on. Ceilings, top down from `ceils[k] = n`: layer `m` is needed
    /// up to the first row whose value reaches that of layer `m + 1`'s top
    /// row (see `layers`). Both are moved outwards by a margin; `layers`
    /// verifies them and a wrong one costs a second pass.
    #[inline(always)]
    fn coarse_bounds<const ISA: u8>(&mut self, p: &Prefix, k: usize) -> Option<Rows> {
        let n = p.len();
        let (cp, cdp) = &mut **self.coarse.get_or_insert_with(|| {
            let dp = Dp {
                keep_values: true,
                ..Dp::new()
            };
            Box::new((Prefix::new(), dp))
        });
        p.sample(COARSE, cp);
        let nc = cp.len();
        if !cdp.layers::<ISA>(cp, k, &Rows::all(nc, k)) {
            return None;
        }
        let Rows {
            mut floors,
            mut ceils,
        } = Rows::all(n, k);
        let pos = |t: usize| (t * COARSE).min(n);
        for m in (2..k).rev() {
            // The coarse row at or below the next layer's (already lowered)
            // floor, so margins do not compound down the chain.
            // Coarse layer m holds rows m..=nc-(k-m) only: below that there
            // is no estimate (and the table holds another group's entries).
            let row = (floors[m + 1] / COARSE).min(nc - (k - m));
            if row < m {
                floors[m] = m;
                continue;
            }
            let split = cdp.opt[(m - 1) * (nc + 1) + row] as usize;
            let est = pos(split).saturating_sub(COARSE_SLACK);
            floors[m] = est.max(m).min(floors[m + 1]).min(n - (k - m));
        }
        // `top`: the coarse value of the layer above at its ceiling, which
        // (coarser splits, later rows) is at or above the full programme's.
        // Ceilings pay only when that value's relative gap `CEIL_REL` clears
        // the rounding margin (not so for values far from zero compared with
        // their spread, whose squares dwarf their deviations).
        let mut top = cdp.vals[(k - 1) * (nc + 1) + nc];
        let mut bounded = top * CEIL_REL > 8.0 * p.rounding_margin();
        for m in (1..k).rev() {
            let vals = &cdp.vals[(m - 1) * (nc + 1)..][..=nc - (k - m)];
            let target = top * (1.0 + CEIL_REL);
            // Without a ceiling, a layer is needed up to the row below the
            // layer above's ceiling (the last split that row can read).
            let mut c = n - (k - m);
            if bounded {
                match (m..vals.len()).find(|&t| vals[t] >= target) {
                    Some(t) => c = pos(t) + COARSE_SLACK,
                    None => bounded = false,
                }
            }
            c = c.min(n - (k - m)).min(ceils[m + 1] - 1).max(floors[m]);
            ceils[m] = c;
            top = vals[c.div_ceil(COARSE).min(vals.len() - 1)];
        }
        // `layers` checks `Rows::valid` in debug builds.
        Some(Rows { floors, ceils })
    }
}

/// The rows of each layer `m` (`1..=k`) that `Dp::layers` computes:
/// `floors[m] ..= ceils[m]`, with `m <= floors[m] <= ceils[m] <= n - (k -
/// m)`, both non-decreasing in `m`, and `floors[k] = ceils[k] = n`.
#[derive(Debug, PartialEq)]
struct Rows {
    floors: Vec<usize>,
    ceils: Vec<usize>,
}

impl Rows {
    /// The invariants above.
    fn valid(&self, n: usize, k: usize) -> bool {
        let Rows { floors, ceils } = self;
        (1..=k).all(|m| m <= floors[m] && floors[m] <= ceils[m] && ceils[m] <= n - (k - m))
            && (1..k).all(|m| floors[m] <= floors[m + 1] && ceils[m] <= ceils[m + 1])
            && floors[k] == n
            && ceils[k] == n
    }

    /// Every row of every layer: nothing to check.
    fn all(n: usize, k: usize) -> Self {
        let mut floors: Vec<usize> = (0..=k).collect();
        floors[k] = n;
        Rows {
            floors,
            ceils: (0..=k).map(|m| n - (k - m)).collect(),
        }
    }
}

/// How far above the value of the layer above a ceiling's coarse value must
/// be (relative): room for the coarse pass's coarser splits.
const CEIL_REL: f64 = 1.0 / 64.0;
/// Split-point step of the coarse pass that estimates row floors and ceilings.
const COARSE: usize = 16;
/// Groups with at least this many distinct values per cluster get the
/// coarse pass.
const COARSE_MIN: usize = 64;
/// How far below (above) the coarse estimate a layer's first (last) row is put.
const COARSE_SLACK: usize = 8 * COARSE;

/// One layer of the programme by divide and conquer over rows: the best
/// split of row `j` is monotone in `j` (quadrangle inequality) and is never
/// before the best split of the previous layer at the same `j` (one more
/// cluster never lengthens the last one).
///
/// The divide and conquer runs level by level rather than recursively: at
/// step `s` the rows at odd multiples of `s` are searched between the best
/// splits of their neighbours at `s` either side, found at the levels above.
/// Rows of one level do not depend on each other, so the processor overlaps
/// their searches instead of waiting on each one in turn.
struct Layer<'a, const ISA: u8> {
    p: &'a Prefix,
    prev: &'a [f64],
    lower: Option<&'a [u32]>,
}

impl<const ISA: u8> Layer<'_, ISA> {
    /// Leftmost `i` in `[a, b]` minimising `prev[i] + cost(i, j)`, and the minimum.
    #[inline(always)]
    fn best_split(&self, j: usize, a: usize, b: usize, row: &mut [f64]) -> (usize, f64) {
        let w = b - a + 1;
        #[cfg(target_arch = "x86_64")]
        if ISA == ISA_AVX512 && self.p.narrow {
            // SAFETY: `ISA_AVX512` is used only inside `Dp::solve_avx512`,
            // which runs when the CPU reports AVX-512 F and DQ.
            return unsafe { avx512::best_split(self.p, self.prev, j, a, w) };
        }
        #[cfg(target_arch = "x86_64")]
        if ISA == ISA_AVX2 && self.p.narrow {
            // SAFETY: `ISA_AVX2` is used only inside `Dp::solve_avx2`, which
            // runs when the CPU reports AVX2.
            return unsafe { avx2::best_split(self.p, self.prev, j, a, w) };
        }
        if self.p.narrow && w <= SMALL / 2 {
            self.p.small_min::<{ SMALL / 2 }>(self.prev, j, a, w)
        } else if self.p.narrow && w <= SMALL {
            self.p.small_min::<SMALL>(self.prev, j, a, w)
        } else {
            let row = &mut row[..w];
            if self.p.narrow {
                self.p.row_narrow(self.prev, j, a, row);
            } else {
                self.p.row_wide(self.prev, j, a, row);
            }
            let (t, v) = argmin(row);
            (a + t, v)
        }
    }

    /// Rows `j` in `jlo..=jhi` with splits in `ilo..=ihi` (and below `j`).
    #[inline(always)]
    fn solve(
        &self,
        cur: &mut [f64],
        opt: &mut [u32],
        row: &mut [f64],
        (jlo, jhi): (usize, usize),
        (ilo, ihi): (usize, usize),
    ) {
        if jlo > jhi {
            return;
        }
        let rows = jhi - jlo + 1;
        // Row u (1-based) is j = jlo + u - 1; the largest step is the highest
        // power of two not above `rows`.
        let mut s = 1usize << (usize::BITS - 1 - rows.leading_zeros());
        loop {
            let mut u = s;
            while u <= rows {
                let j = jlo + u - 1;
                let left = if u > s { opt[j - s] as usize } else { ilo };
                let right = if u + s <= rows {
                    opt[j + s] as usize
                } else {
                    ihi
                };
                let b = right.min(j - 1);
                let floor = self.lower.map_or(0, |l| l[j] as usize);
                let a = left.max(floor).min(b);
                let (best, v) = self.best_split(j, a, b, row);
                cur[j] = v;
                opt[j] = best as u32;
                u += 2 * s;
            }
            if s == 1 {
                break;
            }
            s /= 2;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic xorshift for test data.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        /// Approximately normal (sum of uniforms), scaled.
        fn normal(&mut self, sd: f64) -> f64 {
            let s: f64 = (0..12)
                .map(|_| (self.next() >> 11) as f64 / (1u64 << 53) as f64)
                .sum();
            (s - 6.0) * sd
        }
    }

    fn h(v: f64) -> f16 {
        f16::from_f64(v)
    }

    fn sse(w: &[f16], p: &Palette) -> f64 {
        w.iter()
            .zip(p.dequantize())
            .map(|(a, b)| (a.to_f64() - b.to_f64()).powi(2))
            .sum()
    }

    /// Exact-ish SSE of a partition of sorted weighted points (f64, two-pass).
    fn partition_cost(xs: &[f64], cs: &[u32], b: &[usize]) -> f64 {
        b.windows(2)
            .map(|r| {
                let (xs, cs) = (&xs[r[0]..r[1]], &cs[r[0]..r[1]]);
                let w: f64 = cs.iter().map(|&c| c as f64).sum();
                let m = xs.iter().zip(cs).map(|(x, &c)| x * c as f64).sum::<f64>() / w;
                xs.iter()
                    .zip(cs)
                    .map(|(x, &c)| c as f64 * (x - m).powi(2))
                    .sum::<f64>()
            })
            .sum()
    }

    /// Every way to cut n points into k contiguous non-empty runs.
    fn all_partitions(n: usize, k: usize) -> Vec<Vec<usize>> {
        fn rec(
            start: usize,
            n: usize,
            left: usize,
            cur: &mut Vec<usize>,
            out: &mut Vec<Vec<usize>>,
        ) {
            if left == 1 {
                cur.push(n);
                out.push(cur.clone());
                cur.pop();
                return;
            }
            for s in start + 1..=n - (left - 1) {
                cur.push(s);
                rec(s, n, left - 1, cur, out);
                cur.pop();
            }
        }
        let mut out = Vec::new();
        rec(0, n, k, &mut vec![0], &mut out);
        out
    }

    /// Distinct sorted fp16 values with counts, the way the kernel sees them.
    fn distinct(w: &[f16]) -> (Vec<f64>, Vec<u32>, Vec<i64>) {
        let mut keys: Vec<u16> = w.iter().map(|v| key(v.to_bits())).collect();
        keys.sort_unstable();
        let mut xs = Vec::new();
        let mut cs: Vec<u32> = Vec::new();
        let mut qs = Vec::new();
        for k in keys {
            let bits = unkey(k);
            let x = f16::from_bits(bits).to_f64();
            if xs.last() == Some(&x) {
                *cs.last_mut().unwrap() += 1;
            } else {
                xs.push(x);
                cs.push(1);
                qs.push(fixed(bits));
            }
        }
        (xs, cs, qs)
    }

    #[test]
    fn fixed_point_is_exact() {
        for bits in 0..=u16::MAX {
            if !is_finite_bits(bits) {
                continue;
            }
            let v = f16::from_bits(bits).to_f64();
            assert_eq!(fixed(bits) as f64, v * 16777216.0, "bits {bits:#06x}");
            assert_eq!(unkey(key(bits)), if bits == 0x8000 { 0 } else { bits });
        }
        // Keys sort like values.
        let mut all: Vec<u16> = (0..=u16::MAX)
            .filter(|&b| is_finite_bits(b) && b != 0x8000)
            .collect();
        all.sort_by_key(|&b| key(b));
        for p in all.windows(2) {
            assert!(f16::from_bits(p[0]).to_f64() < f16::from_bits(p[1]).to_f64());
        }
    }

    #[test]
    fn dp_matches_brute_force_on_small_random_groups() {
        let mut rng = Rng(0x9e3779b97f4a7c15);
        let (mut checked, mut wide) = (0, 0);
        for trial in 0..400 {
            let n_distinct = 2 + rng.below(11) as usize; // 2..=12
                                                         // Ordinary weights, subnormals only, or large values (whose squared
                                                         // sums overflow u64 and take the i128 path).
            let mut vals: Vec<f16> = Vec::new();
            while vals.len() < n_distinct {
                let v = match trial % 3 {
                    0 => f16::from_bits(rng.below(64) as u16 | (rng.below(2) as u16) << 15),
                    1 => h(rng.normal(0.05)),
                    _ => h(rng.normal(3000.0)),
                };
                if !vals.iter().any(|u| u.to_f64() == v.to_f64()) {
                    vals.push(v);
                }
            }
            let mut w = Vec::new();
            for v in &vals {
                for _ in 0..1 + rng.below(20) {
                    w.push(*v);
                }
            }
            let (xs, cs, qs) = distinct(&w);
            let mut prefix = Prefix::new();
            prefix.fill(&qs, &cs);
            wide += usize::from(!prefix.narrow);
            for k in 1..=xs.len() {
                let got = Dp::new().solve(&prefix, k);
                let best = all_partitions(xs.len(), k)
                    .iter()
                    .map(|b| partition_cost(&xs, &cs, b))
                    .fold(f64::INFINITY, f64::min);
                let mine = partition_cost(&xs, &cs, &got);
                assert!(
                    mine <= best * (1.0 + 1e-12) + 1e-300,
                    "trial {trial} k {k}: dp {mine:e} > brute force {best:e} (bounds {got:?}, xs {xs:?}, cs {cs:?})"
                );
                checked += 1;
            }
        }
        assert!(
            checked > 1000 && wide > 50,
            "checked {checked}, i128 path {wide}"
        );
    }

    #[test]
    fn narrow_and_wide_costs_agree() {
        // The f64 fast path and the exact i128 path give the same costs to
        // within rounding, and the same partition, on data both can hold.
        let mut rng = Rng(3);
        for _ in 0..20 {
            let w: Vec<f16> = (0..4096).map(|_| h(rng.normal(0.02))).collect();
            let (_, cs, qs) = distinct(&w);
            let mut narrow = Prefix::new();
            narrow.fill(&qs, &cs);
            assert!(narrow.narrow);
            let mut wide = Prefix::new();
            wide.fill(&qs, &cs);
            wide.narrow = false;
            let mut acc = 0i128;
            wide.s2_wide = std::iter::once(0)
                .chain(qs.iter().zip(&cs).map(|(&q, &c)| {
                    acc += i128::from(c) * i128::from(q) * i128::from(q);
                    acc
                }))
                .collect();
            let zeros = vec![0.0; qs.len() + 1];
            for (i, j) in [(0, 5), (3, 400), (0, qs.len()), (100, 101)] {
                let (mut a, mut b) = ([0.0], [0.0]);
                narrow.row(&zeros, j, i, &mut a, false);
                wide.row(&zeros, j, i, &mut b, false);
                assert!(
                    (a[0] - b[0]).abs() <= 1e-12 * b[0].max(1.0),
                    "cost({i}, {j}): {} vs {}",
                    a[0],
                    b[0]
                );
                let mut v = [0.0];
                narrow.row(&zeros, j, i, &mut v, has_avx2());
                assert_eq!(v[0], a[0], "AVX2 and scalar rounding differ");
            }
            assert_eq!(Dp::new().solve(&narrow, 16), Dp::new().solve(&wide, 16));
        }
    }

    #[test]
    fn first_column_rounds_like_the_split_views() {
        // `first_column` reads the integer views; the portable and AVX2
        // searches read the split f64 views. Every build relies on the two
        // giving the same bits.
        let mut rng = Rng(17);
        let mut checked = 0;
        for kind in 0..4 {
            let (_, cs, qs) = distinct(&random_points(&mut rng, kind, 3000));
            let mut p = Prefix::new();
            p.fill(&qs, &cs);
            if !p.narrow {
                continue;
            }
            let mut out = vec![0.0; qs.len() + 1];
            p.first_column(&mut out);
            for (j, &got) in out.iter().enumerate().skip(1) {
                let d1 = (p.s1h[j] - p.s1h[0]) * TWO32 + (p.s1l[j] - p.s1l[0]);
                let d2 = (p.s2h[j] - p.s2h[0]) * TWO32 + (p.s2l[j] - p.s2l[0]);
                let want = 0.0 + (d2 - d1 * d1 / (p.fw[j] - p.fw[0]));
                assert_eq!(got.to_bits(), want.to_bits(), "kind {kind}, j = {j}");
                checked += 1;
            }
        }
        assert!(checked > 3000, "{checked}");
    }

    #[test]
    fn kernel_error_not_above_brute_force_partition_with_rounded_lut() {
        // The full kernel (rounding + nearest re-assignment) is never worse
        // than the brute-force optimal partition with fp16-rounded means.
        let mut rng = Rng(42);
        for trial in 0..200 {
            let nbits = 1 + (trial % 3) as u32; // k = 2, 4, 8
            let n_distinct = (1usize << nbits) + 1 + rng.below(4) as usize;
            let mut w = Vec::new();
            let mut vals: Vec<f16> = Vec::new();
            while vals.len() < n_distinct {
                let v = h(rng.normal(0.02));
                if !vals.iter().any(|u| u.to_f64() == v.to_f64()) {
                    vals.push(v);
                }
            }
            for _ in 0..64 {
                w.push(vals[rng.below(vals.len() as u64) as usize]);
            }
            let (xs, cs, _) = distinct(&w);
            let k = (1usize << nbits).min(xs.len());
            let mut best = f64::INFINITY;
            for b in all_partitions(xs.len(), k) {
                let mut e = 0.0;
                for r in b.windows(2) {
                    let wsum: f64 = cs[r[0]..r[1]].iter().map(|&c| c as f64).sum();
                    let m = (r[0]..r[1]).map(|i| xs[i] * cs[i] as f64).sum::<f64>() / wsum;
                    let m = h(m).to_f64();
                    e += (r[0]..r[1])
                        .map(|i| cs[i] as f64 * (xs[i] - m).powi(2))
                        .sum::<f64>();
                }
                best = best.min(e);
            }
            let p = palettize(&w, 1, w.len(), 1, nbits).unwrap();
            let mine = sse(&w, &p);
            assert!(
                mine <= best * (1.0 + 1e-9),
                "trial {trial}: kernel {mine:e} > brute force {best:e}"
            );
        }
    }

    #[test]
    fn all_equal_group() {
        let w = vec![h(0.125); 32 * 8];
        let p = palettize(&w, 32, 8, 32, 4).unwrap();
        assert_eq!(p.lut[0], h(0.125));
        assert!(p.lut[1..].iter().all(|v| v.to_bits() == 0));
        assert!(p.indices.iter().all(|&i| i == 0));
        assert_eq!(sse(&w, &p), 0.0);
    }

    #[test]
    fn fewer_distinct_values_than_entries_are_exact() {
        let vals = [-0.5, -0.25, 0.0, 0.001, 0.75, 3.0, -7.5];
        let w: Vec<f16> = (0..64 * 4)
            .map(|i| h(vals[(i * 7 + i / 5) % vals.len()]))
            .collect();
        let p = palettize(&w, 64, 4, 32, 4).unwrap();
        assert_eq!(sse(&w, &p), 0.0);
        // LUT: the sorted distinct values, then zeros.
        let mut sorted = vals.to_vec();
        sorted.sort_by(f64::total_cmp);
        let first: Vec<f64> = p.lut[..7].iter().map(|v| v.to_f64()).collect();
        assert_eq!(
            first,
            sorted.iter().map(|&v| h(v).to_f64()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn indices_for_the_kernels_lut_are_the_kernels_indices() {
        let mut rng = Rng(0x1dec_0de5);
        let mut cases: Vec<(Vec<f16>, usize, usize)> = (0..8)
            .map(|kind| (random_points(&mut rng, kind % 4, 64 * 96), 64, 96))
            .collect();
        // Degenerate groups: all equal, all zero, fewer distinct values than
        // entries (with +0 as the largest used entry, and negatives only),
        // signed zeros, subnormals, and a cluster mean that rounds to -0.
        let from = |vals: &[f64], cols: usize| -> (Vec<f16>, usize, usize) {
            (
                (0..32 * cols).map(|i| h(vals[i % vals.len()])).collect(),
                32,
                cols,
            )
        };
        cases.push(from(&[0.125], 8));
        cases.push(from(&[0.0], 8));
        cases.push(from(&[-0.5, 0.0, 0.75], 7));
        cases.push(from(&[-1.0, 0.0], 6));
        cases.push(from(&[-3.0, -0.25, -1.5], 5));
        cases.push((
            (0..32 * 4)
                .map(|i| [f16::ZERO, f16::NEG_ZERO, h(1.0), h(-1.0)][i % 4])
                .collect(),
            32,
            4,
        ));
        cases.push((
            (0..32 * 40)
                .map(|i| f16::from_bits((i % 40 + 1) as u16))
                .collect(),
            32,
            40,
        ));
        let mut neg_zero_mean = vec![f16::ZERO; 32 * 8];
        neg_zero_mean[0] = f16::from_bits(0x8001); // -2^-24 among zeros
        neg_zero_mean[1..128].fill(h(1.0));
        cases.push((neg_zero_mean, 32, 8));
        for (n, (w, rows, cols)) in cases.iter().enumerate() {
            for nbits in [1, 2, 4, 8] {
                let p = palettize(w, *rows, *cols, 32, nbits).unwrap();
                let got = indices_for(w, *rows, *cols, 32, nbits, &p.lut).unwrap();
                assert_eq!(got, p.indices, "case {n}, {nbits} bits");
            }
        }
        let p = palettize(&cases.last().unwrap().0, 32, 8, 32, 1).unwrap();
        assert_eq!(p.lut[0].to_bits(), 0x8000, "the -0 mean case lost its -0");
    }

    #[test]
    fn indices_for_keeps_the_lowest_index_on_a_tie_and_refuses_foreign_luts() {
        // 1 is as far from entry 0 as from entry 2: the lower index wins, as in
        // the kernel's own pass; a run of equal entries answers with its first.
        let w: Vec<f16> = [0.0, 1.0, 2.0, 1.0].iter().map(|&v| h(v)).collect();
        let got = indices_for(&w, 1, 4, 1, 1, &[h(0.0), h(2.0)]).unwrap();
        assert_eq!(got, [0, 0, 1, 0]);
        let w: Vec<f16> = (0..4).map(|i| h(f64::from(i))).collect();
        let lut = [h(0.0), h(2.0), h(2.0), h(3.0)];
        assert_eq!(indices_for(&w, 1, 4, 1, 2, &lut).unwrap(), [0, 0, 1, 3]);

        let (w, rows, cols) = (random_points(&mut Rng(7), 0, 64 * 96), 64, 96);
        let lut = palettize(&w, rows, cols, 32, 4).unwrap().lut;
        let mut bad = w.clone();
        bad[40 * 96 + 3] = f16::NAN;
        assert!(matches!(
            indices_for(&bad, rows, cols, 32, 4, &lut),
            Err(PaletteError::NonFinite {
                row: 40,
                col: 3,
                ..
            })
        ));
        assert_eq!(
            indices_for(&w, rows, cols, 32, 4, &lut[..16]),
            Err(PaletteError::LutShape {
                len: 16,
                groups: 2,
                entries: 16
            })
        );
        // Out of order; two positive entries then +0 as if unused, for a
        // group with more distinct values than entries; not finite.
        let mut shuffled = lut.clone();
        shuffled.swap(17, 18);
        let mut short = lut.clone();
        short.copy_within(14..16, 0);
        short[2..16].fill(f16::ZERO);
        let mut infinite = lut.clone();
        infinite[31] = f16::INFINITY;
        for (bad, group) in [(shuffled, 1), (short, 0), (infinite, 1)] {
            assert_eq!(
                indices_for(&w, rows, cols, 32, 4, &bad),
                Err(PaletteError::LutNotKernels(group))
            );
        }
        // Unused entries must be +0.
        let few: Vec<f16> = (0..32 * 3).map(|i| h([-1.0, 0.5][i % 2])).collect();
        let mut lut = palettize(&few, 32, 3, 32, 4).unwrap().lut;
        lut[5] = h(4.0);
        assert_eq!(
            indices_for(&few, 32, 3, 32, 4, &lut),
            Err(PaletteError::LutNotKernels(0))
        );
    }

    #[test]
    fn signed_zeros_share_one_entry() {
        let mut w = vec![f16::ZERO, f16::NEG_ZERO, h(1.0), h(-1.0)];
        w.extend(vec![f16::NEG_ZERO; 4]);
        let p = palettize(&w, 1, 8, 1, 1).unwrap();
        // Two entries for three values {-1, 0, 1}: both zeros land together.
        assert_eq!(p.indices[0], p.indices[1]);
        assert!(p.indices[4..].iter().all(|&i| i == p.indices[0]));
        let deq = p.dequantize();
        assert_eq!(deq[0].to_f64(), deq[1].to_f64());
    }

    #[test]
    fn subnormals_are_exact_values() {
        // 40 distinct subnormals (consecutive multiples of 2^-24) into 16
        // entries: runs of 2-3 neighbours, so no point is more than one step
        // from its entry, and every entry is itself subnormal.
        let w: Vec<f16> = (0..32 * 40)
            .map(|i| f16::from_bits((i % 40 + 1) as u16))
            .collect();
        let p = palettize(&w, 32, 40, 32, 4).unwrap();
        let e = sse(&w, &p);
        assert!(e > 0.0);
        let ulp = (-24f64).exp2();
        for (a, b) in w.iter().zip(p.dequantize()) {
            assert!((a.to_f64() - b.to_f64()).abs() <= ulp);
        }
        assert!(p.lut.iter().all(|v| v.to_bits() & 0x7c00 == 0));
        // Eight distinct subnormals (including negative ones) are exact.
        let w: Vec<f16> = (0..64)
            .map(|i| f16::from_bits([1u16, 2, 3, 0x8001, 0x8005, 0x3ff, 0x83ff, 0][i % 8]))
            .collect();
        let p = palettize(&w, 8, 8, 8, 4).unwrap();
        assert_eq!(sse(&w, &p), 0.0);
    }

    #[test]
    fn ties_are_broken_the_same_way_every_time() {
        // {-1, 0, 1} with equal counts into two clusters: {-1},{0,1} and
        // {-1,0},{1} cost the same; the smallest split index wins.
        let w = vec![h(-1.0), h(0.0), h(1.0), h(1.0), h(0.0), h(-1.0)];
        let p = palettize(&w, 1, 6, 1, 1).unwrap();
        assert_eq!(p.lut, vec![h(-1.0), h(0.5)]);
        assert_eq!(p.indices, vec![0, 1, 1, 1, 1, 0]);
        // A value exactly between two entries takes the lower index.
        let w = vec![h(0.0), h(0.0), h(1.0), h(1.0), h(2.0), h(3.0), h(3.0)];
        let p = palettize(&w, 1, 7, 1, 2).unwrap();
        assert_eq!(sse(&w, &p), 0.0);
    }

    #[test]
    fn deterministic_across_thread_counts() {
        let mut rng = Rng(7);
        let (rows, cols) = (256, 96);
        let w: Vec<f16> = (0..rows * cols).map(|_| h(rng.normal(0.02))).collect();
        let run = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| palettize(&w, rows, cols, 32, 4).unwrap())
        };
        let a = run(1);
        assert_eq!(a, run(2));
        assert_eq!(a, run(5));
        assert_eq!(a.lut.len(), (rows / 32) * 16);
        // Every LUT is sorted (clusters of sorted values) and every index is
        // the nearest entry.
        for g in 0..rows / 32 {
            let lut = &a.lut[g * 16..g * 16 + 16];
            assert!(lut.windows(2).all(|p| p[0].to_f64() <= p[1].to_f64()));
            for e in g * 32 * cols..(g + 1) * 32 * cols {
                let x = w[e].to_f64();
                let mine = (x - lut[a.indices[e] as usize].to_f64()).abs();
                assert!(lut.iter().all(|c| (x - c.to_f64()).abs() >= mine));
            }
        }
    }

    #[test]
    fn non_finite_weights_are_errors_with_position() {
        let mut w = vec![h(0.5); 64];
        w[37] = f16::INFINITY;
        w[50] = f16::NAN;
        let err = palettize(&w, 32, 2, 32, 4).unwrap_err();
        assert_eq!(
            err,
            PaletteError::NonFinite {
                row: 18,
                col: 1,
                value: f32::INFINITY
            }
        );
        assert!(err.to_string().contains("row 18, column 1"));
        w[37] = f16::NEG_INFINITY;
        w[10] = f16::NAN;
        assert!(matches!(
            palettize(&w, 32, 2, 32, 4),
            Err(PaletteError::NonFinite { row: 5, col: 0, .. })
        ));
    }

    #[test]
    fn shape_errors() {
        let w = vec![h(0.5); 48];
        assert_eq!(
            palettize(&w, 48, 1, 32, 4).unwrap_err(),
            PaletteError::GroupMismatch {
                rows: 48,
                group_size: 32
            }
        );
        assert!(matches!(
            palettize(&w, 32, 1, 32, 4),
            Err(PaletteError::ShapeMismatch { .. })
        ));
        assert_eq!(
            palettize(&w, 48, 1, 16, 0).unwrap_err(),
            PaletteError::BadNbits(0)
        );
        assert_eq!(
            palettize(&w, 48, 1, 0, 4).unwrap_err(),
            PaletteError::ZeroGroup
        );
    }

    /// Exact optimum by the plain O(k n^2) programme over exact i128 costs
    /// (no monotonicity, no floors, no vectors): the total cost in units of
    /// 2^-48.
    fn quadratic_optimum(qs: &[i64], cs: &[u32], k: usize) -> f64 {
        let n = qs.len();
        let (mut w, mut s1, mut s2) = (vec![0i128], vec![0i128], vec![0i128]);
        for (&q, &c) in qs.iter().zip(cs) {
            let (q, c) = (i128::from(q), i128::from(c));
            w.push(w.last().unwrap() + c);
            s1.push(s1.last().unwrap() + c * q);
            s2.push(s2.last().unwrap() + c * q * q);
        }
        let cost = |i: usize, j: usize| {
            let (dw, d1, d2) = (w[j] - w[i], s1[j] - s1[i], s2[j] - s2[i]);
            (dw * d2 - d1 * d1) as f64 / dw as f64
        };
        let mut prev: Vec<f64> = (0..=n)
            .map(|j| if j == 0 { 0.0 } else { cost(0, j) })
            .collect();
        for m in 2..=k {
            let cur: Vec<f64> = (0..=n)
                .map(|j| {
                    (m - 1..j)
                        .map(|i| prev[i] + cost(i, j))
                        .fold(f64::INFINITY, f64::min)
                })
                .collect();
            prev = cur;
        }
        prev[n]
    }

    /// Weighted points of one of several shapes: normal fp16 weights,
    /// heavy duplicates, a uniform spread, or large values (i128 path).
    fn random_points(rng: &mut Rng, kind: u64, len: usize) -> Vec<f16> {
        (0..len)
            .map(|_| match kind {
                0 => h(rng.normal(0.02)),
                1 => h((rng.below(40) as f64 - 20.0) * 0.001),
                2 => h((rng.below(1 << 20) as f64 / (1u64 << 20) as f64 - 0.5) * 0.2),
                _ => h(rng.normal(2000.0)),
            })
            .collect()
    }

    /// 2 to 6 clumps at random places in (-0.1, 0.1), with gaps between
    /// them; a clump at `c` has spread `sd * (1 + |c| * growth)`.
    fn clumps(rng: &mut Rng, len: usize, sd: f64, growth: f64) -> Vec<f16> {
        let centres: Vec<f64> = (0..2 + rng.below(5))
            .map(|_| (rng.below(2000) as f64 - 1000.0) * 1e-4)
            .collect();
        (0..len)
            .map(|_| {
                let c = centres[rng.below(centres.len() as u64) as usize];
                h(c + rng.normal(sd * (1.0 + c.abs() * growth)))
            })
            .collect()
    }

    /// The prefix sums of a group's distinct values.
    fn prefix_of(w: &[f16]) -> Prefix {
        let (_, cs, qs) = distinct(w);
        let mut prefix = Prefix::new();
        prefix.fill(&qs, &cs);
        prefix
    }

    fn partition_of(qs: &[i64], cs: &[u32], k: usize, isa: u8) -> Vec<usize> {
        let mut prefix = Prefix::new();
        prefix.fill(qs, cs);
        Dp::with_isa(isa).solve(&prefix, k)
    }

    #[test]
    fn fast_programme_matches_quadratic_reference() {
        // Medium groups, where the coarse pass, the row floors, the level-
        // order divide and conquer and the vector searches all take part.
        let mut rng = Rng(0xfeed_beef);
        let mut coarse = 0;
        for trial in 0..16 {
            let len = 400 + rng.below(4000) as usize;
            let w = random_points(&mut rng, trial % 4, len);
            let (xs, cs, qs) = distinct(&w);
            for k in [3, 8, 16] {
                if k > xs.len() {
                    continue;
                }
                coarse += usize::from(k > 2 && xs.len() >= COARSE_MIN * k);
                let best = quadratic_optimum(&qs, &cs, k);
                let got = partition_of(&qs, &cs, k, best_isa());
                let mine = partition_cost(&xs, &cs, &got) * (1u64 << 48) as f64;
                assert!(
                    mine <= best * (1.0 + 1e-9) + 1e-6,
                    "trial {trial} n {} k {k}: {mine:e} > optimum {best:e}",
                    xs.len()
                );
            }
        }
        assert!(coarse >= 5, "the coarse pass ran {coarse} times");
    }

    #[test]
    fn every_search_build_gives_the_same_partition() {
        // Portable, AVX2 and AVX-512 evaluate every split with the same
        // roundings, so they agree bit for bit (on whatever this CPU has).
        let isas = available_isas();
        let mut rng = Rng(77);
        for trial in 0..40 {
            let len = 64 + rng.below(20000) as usize;
            let w = random_points(&mut rng, trial % 4, len);
            let (xs, cs, qs) = distinct(&w);
            for k in [2, 4, 16] {
                if k > xs.len() {
                    continue;
                }
                let first = partition_of(&qs, &cs, k, isas[0]);
                for &isa in &isas[1..] {
                    assert_eq!(
                        partition_of(&qs, &cs, k, isa),
                        first,
                        "trial {trial} k {k}: build {isa} differs from the portable one"
                    );
                }
            }
        }
        // And the whole group (LUT and indices) through `Scratch`.
        let w: Vec<u16> = random_points(&mut rng, 0, 32 * 1536)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let mut want = None;
        for &isa in &isas {
            let mut s = Scratch::new();
            s.dp = Dp::with_isa(isa);
            let (mut idx, mut lut) = (vec![0u8; w.len()], vec![f16::ZERO; 16]);
            assert_eq!(s.group(&w, &mut idx, &mut lut), Check::Ok);
            match &want {
                None => want = Some((idx, lut)),
                Some(first) => assert!(*first == (idx, lut), "build {isa} differs"),
            }
        }
    }

    #[test]
    fn row_bounds_that_are_too_tight_are_caught() {
        // `layers` checks that no layer needs a row below its floor or above
        // its ceiling; floors at the top of every layer, or ceilings at the
        // bottom, must fail those checks, and `solve` (coarse bounds, with the
        // full programme behind them) stays optimal.
        let mut rng = Rng(5);
        let w = random_points(&mut rng, 0, 20000);
        let (xs, cs, qs) = distinct(&w);
        let k = 16;
        let mut prefix = Prefix::new();
        prefix.fill(&qs, &cs);
        let n = prefix.len();
        let mut dp = Dp::with_isa(ISA_PORTABLE);
        let all = Rows::all(n, k);
        let mut high = Rows::all(n, k);
        high.floors = (0..=k).map(|m| n - (k - m)).collect();
        high.floors[1] = 1;
        assert!(!dp.layers::<ISA_PORTABLE>(&prefix, k, &high));
        let mut low = Rows::all(n, k);
        low.ceils[1..k].copy_from_slice(&all.floors[1..k]);
        assert!(!dp.layers::<ISA_PORTABLE>(&prefix, k, &low));
        let bounds = dp
            .coarse_bounds::<ISA_PORTABLE>(&prefix, k)
            .expect("the coarse pass runs");
        assert!(dp.layers::<ISA_PORTABLE>(&prefix, k, &bounds));
        // One middle layer cut to its first rows (the layers below it with it,
        // as the bounds require): caught by the next layer's check.
        let m = k / 2;
        let mut cut = Rows {
            floors: bounds.floors.clone(),
            ceils: bounds.ceils.clone(),
        };
        for j in 1..=m {
            cut.ceils[j] = cut.ceils[j].min(cut.floors[m] + 8).max(cut.floors[j]);
        }
        assert!(cut.valid(n, k) && cut.ceils[m] + 1 < cut.ceils[m + 1]);
        assert!(!dp.layers::<ISA_PORTABLE>(&prefix, k, &cut));
        for rows in [&bounds.floors, &bounds.ceils] {
            assert!(rows[1..].windows(2).all(|f| f[0] <= f[1]), "{bounds:?}");
        }
        assert!((1..=k).all(|m| bounds.floors[m] <= bounds.ceils[m]));
        assert!(
            bounds.floors[k - 1] > n / 2,
            "floors {bounds:?} do not prune"
        );
        assert!(bounds.ceils[2] < n / 2, "ceilings {bounds:?} do not prune");
        let got = Dp::with_isa(ISA_PORTABLE).solve(&prefix, k);
        let mine = partition_cost(&xs, &cs, &got) * (1u64 << 48) as f64;
        let best = quadratic_optimum(&qs, &cs, k);
        assert!(mine <= best * (1.0 + 1e-9) + 1e-6);
    }

    #[test]
    fn bounded_rows_give_the_full_programmes_answer() {
        // The coarse bounds skip rows, never change the answer: on groups of
        // every shape and size (including clumps with gaps between them, and
        // values far from zero), for few and many clusters, with and without
        // the bounds, on every build; the bounds always keep their invariants.
        let mut rng = Rng(0xce11);
        let (mut bounded, mut rows, mut kept) = (0, 0, 0);
        for trial in 0..40u64 {
            let len =
                [30000, 6000, 12000, 2500, 9000][trial as usize % 5] + rng.below(3000) as usize;
            let w: Vec<f16> = match trial % 6 {
                4 => clumps(&mut rng, len, 0.002, 50.0),
                5 => (0..len).map(|_| h(1.0 + rng.normal(0.002))).collect(),
                kind => random_points(&mut rng, kind, len),
            };
            let prefix = prefix_of(&w);
            let n = prefix.len();
            for k in [3, 16, 32] {
                if n < COARSE_MIN * k {
                    continue;
                }
                let mut full = Dp::with_isa(ISA_PORTABLE);
                let all = Rows::all(n, k);
                assert!(full.layers::<ISA_PORTABLE>(&prefix, k, &all));
                let want = full.backtrack(n, k);
                let mut dp = Dp::with_isa(ISA_PORTABLE);
                if let Some(b) = dp.coarse_bounds::<ISA_PORTABLE>(&prefix, k) {
                    assert!(b.valid(n, k), "trial {trial}, k {k}: {b:?}");
                    bounded += usize::from(dp.layers::<ISA_PORTABLE>(&prefix, k, &b));
                    // Rows the floors alone keep, and those floors and
                    // ceilings keep, on normal weights with 16 clusters.
                    if trial % 6 == 0 && k == 16 {
                        rows += (1..k)
                            .map(|m| all.ceils[m] + 1 - b.floors[m])
                            .sum::<usize>();
                        kept += (1..k).map(|m| b.ceils[m] + 1 - b.floors[m]).sum::<usize>();
                    }
                }
                for &isa in &available_isas() {
                    let got = Dp::with_isa(isa).solve(&prefix, k);
                    assert_eq!(got, want, "trial {trial}, k {k}, build {isa}");
                }
            }
        }
        assert!(bounded >= 40, "the bounds held {bounded} times");
        assert!(
            kept * 5 < rows * 4,
            "on normal weights the ceilings kept {kept} of {rows} rows"
        );
    }

    #[test]
    fn coarse_bounds_keep_their_invariants() {
        // Many small groups near the coarse pass's threshold, where the
        // ceilings' search can run out of rows part-way down the layers.
        let mut rng = Rng(0xb0b5);
        let mut checked = 0;
        for trial in 0..300u64 {
            let w: Vec<f16> = match trial % 3 {
                0 => {
                    let len = 1500 + rng.below(5000) as usize;
                    random_points(&mut rng, 0, len)
                }
                1 => {
                    let len = 2000 + rng.below(6000) as usize;
                    clumps(&mut rng, len, 0.003, 0.0)
                }
                _ => (1..1200 + rng.below(2500) as u16)
                    .flat_map(|b| {
                        std::iter::repeat_n(f16::from_bits(b), 1 + rng.below(20) as usize)
                    })
                    .collect(),
            };
            let prefix = prefix_of(&w);
            let n = prefix.len();
            for k in [16, 24, 32] {
                if n < COARSE_MIN * k {
                    continue;
                }
                let mut dp = Dp::with_isa(ISA_PORTABLE);
                let b = dp.coarse_bounds::<ISA_PORTABLE>(&prefix, k).unwrap();
                assert!(b.valid(n, k), "trial {trial}, n {n}, k {k}: {b:?}");
                dp.layers::<ISA_PORTABLE>(&prefix, k, &b);
                checked += 1;
            }
        }
        assert!(checked >= 200, "{checked} groups checked");
    }

    #[test]
    fn reused_buffers_give_the_same_answer_as_fresh_ones() {
        // Tables are not cleared between groups: one programme (and one
        // `Scratch`) run over groups of changing size and k must give what a
        // fresh one gives, on every build. Small groups after large ones
        // leave the most stale entries behind; skewed data puts the first
        // clusters below the coarse pass's resolution.
        let mut rng = Rng(0x5eed);
        for &isa in &available_isas() {
            let mut reused = Dp::with_isa(isa);
            for trial in 0..60 {
                let len = [20000, 300, 4096, 9000, 1200][trial % 5] + rng.below(500) as usize;
                let mut w = random_points(&mut rng, trial as u64 % 4, len);
                if trial % 3 == 0 {
                    // A few low outliers: tiny first clusters.
                    for v in w.iter_mut().take(5) {
                        *v = h(-0.5 - rng.below(100) as f64 * 1e-3);
                    }
                }
                let (_, cs, qs) = distinct(&w);
                let k = [16, 4, 16, 8, 2][trial % 5].min(qs.len());
                let mut prefix = Prefix::new();
                prefix.fill(&qs, &cs);
                assert_eq!(
                    reused.solve(&prefix, k),
                    Dp::with_isa(isa).solve(&prefix, k),
                    "build {isa}, trial {trial}: a reused programme differs from a fresh one"
                );
                if isa == ISA_PORTABLE && k > 2 && qs.len() >= COARSE_MIN * k {
                    // The floors themselves are a function of the group.
                    assert_eq!(
                        reused.coarse_bounds::<ISA_PORTABLE>(&prefix, k),
                        Dp::with_isa(isa).coarse_bounds::<ISA_PORTABLE>(&prefix, k),
                        "trial {trial}: coarse bounds depend on the previous group"
                    );
                }
            }
        }
    }
}
