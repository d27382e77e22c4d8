//! The layered dynamic programme over split points (`Dp`): one layer at a
//! time by level-order divide and conquer (`Layer`), on the rows a coarse
//! pass bounds (`Rows`), with branch-free leftmost-minimum helpers.

use super::prefix::Prefix;
#[cfg(test)]
use super::simd::available_isas;
#[cfg(target_arch = "x86_64")]
use super::simd::{avx2, avx512, ISA_AVX2};
use super::simd::{best_isa, ISA_AVX512, ISA_PORTABLE};

/// Windows of at most this many splits are searched with fixed-width,
/// branch-free code: most windows of a divide and conquer hold a handful.
pub(super) const SMALL: usize = 8;
/// Entries appended to `prev` and to the f64 prefix views so a fixed-width
/// window never reads past the end.
pub(super) const PAD: usize = SMALL - 1;

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
pub(super) fn argmin_fixed<const L: usize>(v: &[f64; L]) -> (usize, f64) {
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

/// The layered dynamic programme `D[k][j] = min_i D[k-1][i] + cost(i, j)`.
pub(super) struct Dp {
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
    pub(super) isa: u8,
    /// The coarse pass's prefix and programme (see `coarse_bounds`).
    coarse: Option<Box<(Prefix, Dp)>>,
}

impl Dp {
    pub(super) fn new() -> Self {
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
    pub(super) fn with_isa(isa: u8) -> Self {
        assert!(available_isas().contains(&isa));
        Dp { isa, ..Dp::new() }
    }

    /// Split points `0 = b[0] < b[1] < ... < b[k] = n` of the optimal
    /// partition of the `n` sorted weighted points into `k` contiguous
    /// clusters.
    pub(super) fn solve(&mut self, p: &Prefix, k: usize) -> Vec<usize> {
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
    pub(super) fn layers<const ISA: u8>(&mut self, p: &Prefix, k: usize, rows: &Rows) -> bool {
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
    pub(super) fn backtrack(&self, n: usize, k: usize) -> Vec<usize> {
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
    pub(super) fn coarse_bounds<const ISA: u8>(&mut self, p: &Prefix, k: usize) -> Option<Rows> {
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
pub(super) struct Rows {
    pub(super) floors: Vec<usize>,
    pub(super) ceils: Vec<usize>,
}

impl Rows {
    /// The invariants above.
    pub(super) fn valid(&self, n: usize, k: usize) -> bool {
        let Rows { floors, ceils } = self;
        (1..=k).all(|m| m <= floors[m] && floors[m] <= ceils[m] && ceils[m] <= n - (k - m))
            && (1..k).all(|m| floors[m] <= floors[m + 1] && ceils[m] <= ceils[m + 1])
            && floors[k] == n
            && ceils[k] == n
    }

    /// Every row of every layer: nothing to check.
    pub(super) fn all(n: usize, k: usize) -> Self {
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
pub(super) const COARSE_MIN: usize = 64;
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
