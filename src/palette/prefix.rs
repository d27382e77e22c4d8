//! Points sorted by value with exact integer prefix sums: fp16 values as
//! integer multiples of 2^-24 (`fixed`), the order-preserving keys the
//! histogram is indexed by (`key`, `unkey`), and the cost of a run of points
//! evaluated from the prefixes (`Prefix`).

use super::search::{argmin_fixed, PAD};
#[cfg(all(test, target_arch = "x86_64"))]
use super::simd::row_narrow_avx2;

/// Order-preserving key of an fp16 bit pattern: ascending keys are ascending
/// values. -0 is folded onto +0 (the same value, so the same LUT entry).
#[inline]
pub(super) fn key(bits: u16) -> u16 {
    let b = if bits == 0x8000 { 0 } else { bits };
    if b & 0x8000 != 0 {
        !b
    } else {
        b | 0x8000
    }
}

#[inline]
pub(super) fn unkey(k: u16) -> u16 {
    if k & 0x8000 != 0 {
        k & 0x7fff
    } else {
        !k
    }
}

#[inline]
pub(super) fn is_finite_bits(bits: u16) -> bool {
    bits & 0x7c00 != 0x7c00
}

/// The value of one unit of [`fixed`].
pub(super) const FIXED_UNIT: f64 = 1.0 / (1u64 << 24) as f64;

/// The fp16 value as an integer multiple of 2^-24 (exact; |q| < 2^40).
#[inline]
pub(super) fn fixed(bits: u16) -> i64 {
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
pub(super) struct Prefix {
    /// `w[j]`: total count of the first `j` points.
    pub(super) w: Vec<i64>,
    /// `s1[j]`: sum of count * q (|s1| < 2^23 * 2^40: fits i64).
    pub(super) s1: Vec<i64>,
    /// `s2[j]`: sum of count * q^2, used when the total reaches 2^64 (values
    /// of magnitude ~0.5 and above); otherwise empty.
    pub(super) s2_wide: Vec<i128>,
    /// True when every `s2` prefix is below 2^64: then the split views below
    /// are filled and costs are evaluated in f64, several at a time.
    pub(super) narrow: bool,
    /// `w` as f64 (exact: below 2^23).
    pub(super) fw: Vec<f64>,
    /// `s1 = h * 2^32 + l` with `0 <= l < 2^32`: both parts exact in f64, so
    /// a difference of prefixes is recovered exactly before one rounding.
    /// (Only filled for the portable and AVX2 searches, see `has_split_views`;
    /// the AVX-512 search reads the integer views.)
    pub(super) s1h: Vec<f64>,
    pub(super) s1l: Vec<f64>,
    pub(super) s2h: Vec<f64>,
    pub(super) s2l: Vec<f64>,
    /// Narrow groups: `s1` and `s2` as integers, padded like the f64 views
    /// (the AVX-512 search subtracts them exactly, then converts once).
    pub(super) s1i: Vec<i64>,
    pub(super) s2u: Vec<u64>,
}

pub(super) const TWO32: f64 = 4294967296.0;

impl Prefix {
    pub(super) fn new() -> Self {
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

    pub(super) fn len(&self) -> usize {
        self.w.len() - 1
    }

    /// A bound on the rounding in any programme value, far above what
    /// accumulates: every cost is a few units in the last place of at most
    /// the sum of every point's `count * q^2` (which no cost or value
    /// exceeds), and each layer adds one more rounding.
    pub(super) fn rounding_margin(&self) -> f64 {
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
    pub(super) fn has_split_views(&self) -> bool {
        [&self.s1h, &self.s1l, &self.s2h, &self.s2l]
            .iter()
            .all(|v| v.len() == self.fw.len())
    }

    /// The prefix of the points merged into runs of `step` (the last run
    /// may be shorter): the prefix sums at split points `0, step, 2*step, ...,
    /// n`. Costs on it are exactly those of the original at those splits.
    pub(super) fn sample(&self, step: usize, out: &mut Prefix) {
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
    pub(super) fn fill(&mut self, q: &[i64], counts: &[u32]) {
        self.fill_for(q, counts, true);
    }

    /// As `fill`; the split f64 views (read by the portable and AVX2
    /// searches) only when `split`.
    pub(super) fn fill_for(&mut self, q: &[i64], counts: &[u32], split: bool) {
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
    pub(super) fn row_narrow(&self, prev: &[f64], j: usize, a: usize, out: &mut [f64]) {
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
    pub(super) fn small_min<const L: usize>(
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
    pub(super) fn row(&self, prev: &[f64], j: usize, a: usize, out: &mut [f64], avx2: bool) {
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
    pub(super) fn row_wide(&self, prev: &[f64], j: usize, a: usize, out: &mut [f64]) {
        for (t, o) in out.iter_mut().enumerate() {
            *o = prev[a + t] + self.cost_wide(a + t, j);
        }
    }

    /// `out[j] = cost(0, j)` for `j` in `1..out.len()`: the first layer (one
    /// cluster over the first `j` points), with the arithmetic of `row`.
    #[inline(always)]
    pub(super) fn first_column(&self, out: &mut [f64]) {
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
