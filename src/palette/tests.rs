use super::prefix::TWO32;
use super::search::{Rows, COARSE_MIN};
use super::simd::{available_isas, best_isa, has_avx2, ISA_PORTABLE};
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
    fn rec(start: usize, n: usize, left: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
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
        let len = [30000, 6000, 12000, 2500, 9000][trial as usize % 5] + rng.below(3000) as usize;
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
                .flat_map(|b| std::iter::repeat_n(f16::from_bits(b), 1 + rng.below(20) as usize))
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
