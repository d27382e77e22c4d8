//! Which search build runs on this CPU (`best_isa`), and the narrow searches
//! written with AVX2 and AVX-512 intrinsics.

#[cfg(target_arch = "x86_64")]
use super::{
    prefix::{Prefix, TWO32},
    search::SMALL,
};

/// `Prefix::row_narrow` compiled for AVX2 (four f64 lanes).
#[cfg(all(test, target_arch = "x86_64"))]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn row_narrow_avx2(
    p: &Prefix,
    prev: &[f64],
    j: usize,
    a: usize,
    out: &mut [f64],
) {
    p.row_narrow(prev, j, a, out)
}

/// Which search code `Dp` runs (a const parameter, so each build is
/// compiled separately with its target features).
pub(super) const ISA_PORTABLE: u8 = 0;
pub(super) const ISA_AVX2: u8 = 1;
pub(super) const ISA_AVX512: u8 = 2;

/// The search builds this CPU can run, slowest first.
pub(super) fn available_isas() -> Vec<u8> {
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
pub(super) fn best_isa() -> u8 {
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
pub(super) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
/// The narrow search written with AVX2 intrinsics: the same operations in
/// the same order as `Prefix::row_narrow` (so the same roundings), with the
/// lane-wise minimum and the leftmost-lane search kept in vector registers.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
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
    pub(in crate::palette) unsafe fn best_split(
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
pub(super) mod avx512 {
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
    pub(in crate::palette) unsafe fn best_split(
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
