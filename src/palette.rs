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
//! Exactness: every fp16 value is an integer multiple of 2^-24 (the smallest
//! subnormal), so values, counts and prefix sums are kept as integers (`q =
//! v * 2^24`, `i128` sums). A run's cost is `(W*S2 - S1^2) / W` with the
//! numerator computed exactly in integers, so each cost is a single rounding
//! away from its true value (no cancellation between large prefix sums).
//! Ties go to the smallest split index, which makes the result a function of
//! the input alone: same bytes in, same LUT and indices out, whatever the
//! thread count.
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
    s1h: Vec<f64>,
    s1l: Vec<f64>,
    s2h: Vec<f64>,
    s2l: Vec<f64>,
}

const TWO32: f64 = 4294967296.0;

impl Prefix {
    fn new() -> Self {
        Prefix {
            w: Vec::new(),
            s1: Vec::new(),
            s2_wide: Vec::new(),
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

    fn fill(&mut self, q: &[i64], counts: &[u32]) {
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
        let (mut w, mut s1, mut s2) = (0i64, 0i64, 0i128);
        let split = |x: i128| ((x >> 32) as f64, (x & 0xffff_ffff) as f64);
        for t in 0..=q.len() {
            if t > 0 {
                let (v, c) = (q[t - 1], counts[t - 1]);
                w += i64::from(c);
                s1 += i64::from(c) * v;
                s2 += i128::from(c) * i128::from(v) * i128::from(v);
            }
            self.w.push(w);
            self.s1.push(s1);
            if self.narrow {
                self.fw.push(w as f64);
                let (h, l) = split(i128::from(s1));
                self.s1h.push(h);
                self.s1l.push(l);
                let (h, l) = split(s2);
                self.s2h.push(h);
                self.s2l.push(l);
            } else {
                self.s2_wide.push(s2);
            }
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

    /// Leftmost `i` in `[a, b]` minimising `prev[i] + cost(i, j)`, and the
    /// minimum; the same arithmetic as `row`.
    #[inline]
    fn row_min(&self, prev: &[f64], j: usize, a: usize, b: usize) -> (usize, f64) {
        let mut out = [0.0; SHORT_ROW];
        let out = &mut out[..=b - a];
        if self.narrow {
            self.row_narrow(prev, j, a, out);
        } else {
            self.row(prev, j, a, out, false);
        }
        let (t, v) = argmin(out);
        (a + t, v)
    }

    /// `out[t] = prev[a + t] + cost(a + t, j)`.
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
            for (t, o) in out.iter_mut().enumerate() {
                *o = prev[a + t] + self.cost_wide(a + t, j);
            }
        }
    }
}

/// Rows shorter than this are searched with scalar code fused with the
/// minimum (most rows of a divide and conquer are a handful of columns).
const SHORT_ROW: usize = 16;

/// `Prefix::row_narrow` compiled for AVX2 (four f64 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_narrow_avx2(p: &Prefix, prev: &[f64], j: usize, a: usize, out: &mut [f64]) {
    p.row_narrow(prev, j, a, out)
}

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

/// Leftmost minimum of `v` (index, value); `v` is never empty.
#[inline]
fn argmin(v: &[f64]) -> (usize, f64) {
    let mut bi = 0;
    let mut best = v[0];
    for (t, &x) in v.iter().enumerate().skip(1) {
        if x < best {
            best = x;
            bi = t;
        }
    }
    (bi, best)
}

/// The layered dynamic programme `D[k][j] = min_i D[k-1][i] + cost(i, j)`.
struct Dp {
    prev: Vec<f64>,
    cur: Vec<f64>,
    /// `opt[(k - 1) * (n + 1) + j]`: best last split for `j` points in `k` clusters.
    opt: Vec<u32>,
    row: Vec<f64>,
    avx2: bool,
}

impl Dp {
    fn new() -> Self {
        Dp {
            prev: Vec::new(),
            cur: Vec::new(),
            opt: Vec::new(),
            row: Vec::new(),
            avx2: has_avx2(),
        }
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
        let stride = n + 1;
        self.prev.clear();
        self.prev.resize(stride, 0.0);
        self.cur.clear();
        self.cur.resize(stride, f64::INFINITY);
        self.opt.clear();
        self.opt.resize(k * stride, 0);
        self.row.resize(stride, 0.0);
        // One cluster over the first j points (prev[0] = 0 turns `row` into
        // plain costs); only j <= n-(k-1) leaves a point for every later cluster.
        let last = n - (k - 1);
        let mut one = [0.0];
        for j in 1..=last {
            p.row(&self.prev, j, 0, &mut one, false);
            self.cur[j] = one[0];
        }
        std::mem::swap(&mut self.prev, &mut self.cur);
        self.cur.fill(f64::INFINITY);
        for layer in 2..=k {
            let (done, rest) = self.opt.split_at_mut((layer - 1) * stride);
            let lower = &done[(layer - 2) * stride..];
            let opt = &mut rest[..stride];
            if layer == k {
                // The last cluster ends at n: one row.
                let (a, b) = (k - 1, n - 1);
                let row = &mut self.row[..=b - a];
                p.row(&self.prev, n, a, row, self.avx2);
                let (t, v) = argmin(row);
                opt[n] = (a + t) as u32;
                self.cur[n] = v;
            } else {
                // Rows j in [layer, n-(k-layer)], splits i in [layer-1, j-1].
                let hi = n - (k - layer);
                let mut ctx = Layer {
                    p,
                    prev: &self.prev,
                    cur: &mut self.cur,
                    opt,
                    lower: if layer > 2 { Some(lower) } else { None },
                    row: &mut self.row,
                    avx2: self.avx2,
                };
                ctx.solve(layer, hi, layer - 1, hi - 1);
            }
            std::mem::swap(&mut self.prev, &mut self.cur);
        }
        let mut b = vec![0usize; k + 1];
        b[k] = n;
        for layer in (2..=k).rev() {
            b[layer - 1] = self.opt[(layer - 1) * stride + b[layer]] as usize;
        }
        b
    }
}

/// One layer of the programme, by divide and conquer over rows: the best
/// split of row `j` is monotone in `j` (quadrangle inequality) and is never
/// before the best split of the previous layer at the same `j` (one more
/// cluster never lengthens the last one).
struct Layer<'a> {
    p: &'a Prefix,
    prev: &'a [f64],
    cur: &'a mut [f64],
    opt: &'a mut [u32],
    lower: Option<&'a [u32]>,
    row: &'a mut [f64],
    avx2: bool,
}

impl Layer<'_> {
    /// Leftmost `i` in `[a, b]` minimising `prev[i] + cost(i, j)`, and the minimum.
    #[inline]
    fn best_split(&mut self, j: usize, a: usize, b: usize) -> (usize, f64) {
        if b - a < SHORT_ROW {
            self.p.row_min(self.prev, j, a, b)
        } else {
            let row = &mut self.row[..=b - a];
            self.p.row(self.prev, j, a, row, self.avx2);
            let (t, v) = argmin(row);
            (a + t, v)
        }
    }

    fn solve(&mut self, jlo: usize, jhi: usize, ilo: usize, ihi: usize) {
        if jlo > jhi {
            return;
        }
        let mid = jlo + (jhi - jlo) / 2;
        let b = ihi.min(mid - 1);
        let floor = self.lower.map_or(0, |l| l[mid] as usize);
        let a = ilo.max(floor).min(b);
        let (best, v) = self.best_split(mid, a, b);
        self.cur[mid] = v;
        self.opt[mid] = best as u32;
        if mid > jlo {
            self.solve(jlo, mid - 1, ilo, best);
        }
        self.solve(mid + 1, jhi, best, ihi);
    }
}

/// Per-thread buffers, reused across groups.
struct Scratch {
    hist: Vec<u32>,
    slot: Vec<u8>,
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
            keys: Vec::new(),
            counts: Vec::new(),
            q: Vec::new(),
            prefix: Prefix::new(),
            dp: Dp::new(),
        }
    }

    /// Palettizes one group (`w`: fp16 bits) into `lut` and `idx`.
    fn group(&mut self, w: &[u16], idx: &mut [u8], lut: &mut [f16]) {
        let (mut kmin, mut kmax) = (u16::MAX, 0u16);
        for &b in w {
            let k = key(b);
            self.hist[k as usize] += 1;
            kmin = kmin.min(k);
            kmax = kmax.max(k);
        }
        self.keys.clear();
        self.counts.clear();
        self.q.clear();
        for k in kmin..=kmax {
            let c = std::mem::take(&mut self.hist[k as usize]);
            if c != 0 {
                self.keys.push(k);
                self.counts.push(c);
                self.q.push(fixed(unkey(k)));
            }
        }
        let n = self.keys.len();
        let k = lut.len().min(n);
        self.prefix.fill(&self.q, &self.counts);
        let bounds = self.dp.solve(&self.prefix, k);

        // Cluster means rounded to fp16; unused entries stay +0.
        lut.fill(f16::ZERO);
        let scale = (-24f64).exp2();
        for c in 0..k {
            let (i, j) = (bounds[c], bounds[c + 1]);
            let p = &self.prefix;
            let mean = (p.s1[j] - p.s1[i]) as f64 / (p.w[j] - p.w[i]) as f64;
            lut[c] = f16::from_f64(mean * scale);
        }

        // Nearest LUT entry for every distinct value (sorted values and sorted
        // entries: the nearest index only moves forward). Runs of equal entries
        // are skipped so a tie keeps the lowest index.
        let cents: Vec<f64> = lut[..k].iter().map(|c| c.to_f64()).collect();
        let mut t = 0usize;
        for (&kk, &qv) in self.keys.iter().zip(&self.q) {
            let x = qv as f64 * scale;
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
    if rows % group_size != 0 {
        return Err(PaletteError::GroupMismatch { rows, group_size });
    }
    let per_group = group_size * cols;
    if per_group > MAX_GROUP_ELEMENTS {
        return Err(PaletteError::GroupTooLarge(per_group));
    }
    let bits: &[u16] = half::slice::HalfFloatSliceExt::reinterpret_cast(weight);
    // The first non-finite element in row-major order, whatever the threads.
    if let Some(e) = bits.par_iter().position_first(|&b| !is_finite_bits(b)) {
        return Err(PaletteError::NonFinite {
            row: e / cols.max(1),
            col: e % cols.max(1),
            value: weight[e].to_f32(),
        });
    }
    let entries = 1usize << nbits;
    let groups = rows / group_size;
    let mut lut = vec![f16::ZERO; groups * entries];
    let mut indices = vec![0u8; rows * cols];
    if per_group > 0 {
        indices
            .par_chunks_mut(per_group)
            .zip(lut.par_chunks_mut(entries))
            .zip(bits.par_chunks(per_group))
            .for_each_init(Scratch::new, |s, ((idx, l), w)| s.group(w, idx, l));
    }
    Ok(Palette {
        lut,
        indices,
        groups,
        entries,
    })
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
}
