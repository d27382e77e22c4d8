//! The register tiles of `super::matmul`: one generic body over a 16-lane
//! vector type (`Lanes`), compiled once per instruction set inside a
//! function that enables it, so every build runs the same operations in
//! the same order (`super`'s doc).

use super::simd::Isa;
use super::{Dst, Weights, BLOCK, LANES, LUT_ENTRIES};

/// The input `x` rearranged for the tiles: per token, one run of
/// `nblocks * 32` float32 values, each block in lane order (the values of
/// a lane's first products, then of its second), zero past `cols`.
pub(super) struct Prepared {
    data: Vec<f32>,
    stride: usize,
}

impl Prepared {
    /// The first `live` tokens of `x [.., cols]` in `w`'s lane order.
    pub(super) fn new(w: &Weights, x: &[f32], cols: usize, live: usize) -> Prepared {
        let nblocks = cols.div_ceil(BLOCK);
        let stride = nblocks * BLOCK;
        let mut data = vec![0f32; stride * live];
        let pairs = matches!(w, Weights::Lut4 { .. });
        for t in 0..live {
            let src = &x[t * cols..(t + 1) * cols];
            let dst = &mut data[t * stride..(t + 1) * stride];
            if pairs {
                // Block b, lane j: column 32b + 2j first, then 32b + 2j + 1.
                for (c, &v) in src.iter().enumerate() {
                    let (b, k) = (c / BLOCK, c % BLOCK);
                    dst[b * BLOCK + (k % 2) * LANES + k / 2] = v;
                }
            } else {
                dst[..cols].copy_from_slice(src);
            }
        }
        Prepared { data, stride }
    }

    fn token(&self, t: usize) -> *const f32 {
        self.data[t * self.stride..].as_ptr()
    }
}

/// One 16-lane vector of float32 and what a build does with it.
///
/// # Safety
/// Every method is `unsafe`: callers guarantee the pointers' ranges (a
/// full block's, or `n` values for a partial one) and that the CPU runs
/// the build.
pub(super) trait Lanes: Copy {
    /// A 16-entry look-up table held for a row.
    type Table: Copy;
    unsafe fn zero() -> Self;
    /// 16 float32 values.
    unsafe fn load(p: *const f32) -> Self;
    /// `w * x + acc`, one rounding, in every lane.
    unsafe fn fma(w: Self, x: Self, acc: Self) -> Self;
    /// `fma` in the lanes whose bit of `mask` is set; `acc` in the others.
    unsafe fn fma_mask(w: Self, x: Self, acc: Self, mask: u16) -> Self;
    /// The fixed tree: `[j] + [j+8]`, then `+ [j+4]`, `+ [j+2]`, `+ [j+1]`.
    unsafe fn sum(self) -> f32;
    unsafe fn table(lut: *const f32) -> Self::Table;
    /// A block of 4-bit indices (`n` of its 16 bytes readable): the low
    /// nibbles' values, then the high nibbles'.
    unsafe fn lut4(p: *const u8, n: usize, table: &Self::Table) -> (Self, Self);
    /// A block of bfloat16 (`n` of its 32 values readable): values 0..16, then 16..32.
    unsafe fn bf16(p: *const u16, n: usize) -> (Self, Self);
    /// The same of float16.
    unsafe fn f16(p: *const u16, n: usize) -> (Self, Self);
    /// The same of float32.
    unsafe fn f32(p: *const f32, n: usize) -> (Self, Self);
}

/// A stored form: where a row's block starts and how it widens.
trait Kind {
    type Elem: Copy;
    /// Stored values per block.
    const PER_BLOCK: usize;
    /// The lanes whose first and second products exist when the block has
    /// `rem` columns (1..=32).
    fn masks(rem: usize) -> (u16, u16);
    /// Readable stored values of a block of `rem` columns.
    fn stored(rem: usize) -> usize;
    /// # Safety
    /// `p` holds `n` readable values (`PER_BLOCK` for a full block).
    unsafe fn widen<L: Lanes>(p: *const Self::Elem, n: usize, table: &L::Table) -> (L, L);
}

fn lanes_below(n: usize) -> u16 {
    if n >= LANES {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

struct Lut4;
impl Kind for Lut4 {
    type Elem = u8;
    const PER_BLOCK: usize = LANES;
    fn masks(rem: usize) -> (u16, u16) {
        // Lane j: columns 2j and 2j + 1 of the block.
        (lanes_below(rem.div_ceil(2)), lanes_below(rem / 2))
    }
    fn stored(rem: usize) -> usize {
        rem.div_ceil(2)
    }
    #[inline(always)]
    unsafe fn widen<L: Lanes>(p: *const u8, n: usize, table: &L::Table) -> (L, L) {
        L::lut4(p, n, table)
    }
}

struct Bf16;
impl Kind for Bf16 {
    type Elem = u16;
    const PER_BLOCK: usize = BLOCK;
    fn masks(rem: usize) -> (u16, u16) {
        (lanes_below(rem), lanes_below(rem.saturating_sub(LANES)))
    }
    fn stored(rem: usize) -> usize {
        rem
    }
    #[inline(always)]
    unsafe fn widen<L: Lanes>(p: *const u16, n: usize, _: &L::Table) -> (L, L) {
        L::bf16(p, n)
    }
}

struct F16;
impl Kind for F16 {
    type Elem = u16;
    const PER_BLOCK: usize = BLOCK;
    fn masks(rem: usize) -> (u16, u16) {
        Bf16::masks(rem)
    }
    fn stored(rem: usize) -> usize {
        rem
    }
    #[inline(always)]
    unsafe fn widen<L: Lanes>(p: *const u16, n: usize, _: &L::Table) -> (L, L) {
        L::f16(p, n)
    }
}

struct F32;
impl Kind for F32 {
    type Elem = f32;
    const PER_BLOCK: usize = BLOCK;
    fn masks(rem: usize) -> (u16, u16) {
        Bf16::masks(rem)
    }
    fn stored(rem: usize) -> usize {
        rem
    }
    #[inline(always)]
    unsafe fn widen<L: Lanes>(p: *const f32, n: usize, _: &L::Table) -> (L, L) {
        L::f32(p, n)
    }
}

/// One row as a tile reads it.
#[derive(Clone, Copy)]
struct Row<E, T> {
    ptr: *const E,
    table: T,
}

/// The shape of every tile of one call.
#[derive(Clone, Copy)]
struct Blocks {
    /// Blocks per row.
    n: usize,
    /// Columns of the last block (1..=32).
    rem: usize,
}

/// How far ahead of each row's block a tile asks for its weight, in bytes.
/// A tile reads its rows in step, so a short row's stream jumps back and
/// forth inside a page and the hardware prefetcher falls behind: an E2B
/// 6144×1536 LUT4 product streamed 10.7 GB/s without this and 23 GB/s with
/// it (`bench matmul`: the decode step's LUT4 products 11.6 → 16-19 GB/s,
/// bf16 21.6 → 26; 2 KB ahead gained less, 6-8 KB no more). The address may
/// lie past the weight: a prefetch never faults.
const AHEAD: usize = 4096;

/// Asks for the cache line at `p` (a hint: no effect on any result).
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch never faults, whatever the address (SSE, which
    // every x86-64 CPU runs).
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `R` rows times `T` tokens: every output's 16 lanes over every block,
/// then their sum (`out[r][t]`).
///
/// # Safety
/// Each row holds `blocks`' stored values; each `xs[t]` its prepared token.
#[inline(always)]
unsafe fn tile<L: Lanes, K: Kind, const R: usize, const T: usize>(
    rows: &[Row<K::Elem, L::Table>; R],
    xs: &[*const f32; T],
    blocks: Blocks,
) -> [[f32; T]; R] {
    let mut acc = [[L::zero(); T]; R];
    let full = if blocks.rem == BLOCK {
        blocks.n
    } else {
        blocks.n - 1
    };
    for b in 0..full {
        let mut xv = [(L::zero(), L::zero()); T];
        for t in 0..T {
            let p = xs[t].add(b * BLOCK);
            xv[t] = (L::load(p), L::load(p.add(LANES)));
        }
        for r in 0..R {
            prefetch(
                rows[r]
                    .ptr
                    .wrapping_add(b * K::PER_BLOCK)
                    .cast::<u8>()
                    .wrapping_add(AHEAD),
            );
            let (w1, w2) = K::widen::<L>(
                rows[r].ptr.add(b * K::PER_BLOCK),
                K::PER_BLOCK,
                &rows[r].table,
            );
            for t in 0..T {
                acc[r][t] = L::fma(w1, xv[t].0, acc[r][t]);
                acc[r][t] = L::fma(w2, xv[t].1, acc[r][t]);
            }
        }
    }
    if full < blocks.n {
        let b = full;
        let (m1, m2) = K::masks(blocks.rem);
        let n = K::stored(blocks.rem);
        for r in 0..R {
            let (w1, w2) = K::widen::<L>(rows[r].ptr.add(b * K::PER_BLOCK), n, &rows[r].table);
            for t in 0..T {
                let p = xs[t].add(b * BLOCK);
                acc[r][t] = L::fma_mask(w1, L::load(p), acc[r][t], m1);
                acc[r][t] = L::fma_mask(w2, L::load(p.add(LANES)), acc[r][t], m2);
            }
        }
    }
    let mut out = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            out[r][t] = acc[r][t].sum();
        }
    }
    out
}

/// Rows `start..stop` of the product, every live token, in tiles of at most
/// `RM` rows and `TM` tokens.
///
/// # Safety
/// The CPU runs `L`'s build; `w` was checked against `[rows, cols]`.
#[inline(always)]
unsafe fn rows_of<L: Lanes, const RM: usize, const TM: usize>(
    w: &Weights,
    cols: usize,
    p: &Prepared,
    start: usize,
    stop: usize,
    dst: &Dst,
) {
    if cols == 0 {
        for r in start..stop {
            for t in 0..p.live() {
                dst.put(r, t, 0.0);
            }
        }
        return;
    }
    let blocks = Blocks {
        n: cols.div_ceil(BLOCK),
        rem: cols - (cols.div_ceil(BLOCK) - 1) * BLOCK,
    };
    let none = L::table([0f32; LUT_ENTRIES].as_ptr());
    match *w {
        Weights::Lut4 {
            packed,
            lut,
            group_rows,
        } => {
            // A row starts mid-byte when `cols` is odd: such rows are
            // shifted by a nibble into a buffer of their own.
            let row_bytes = cols.div_ceil(2);
            let mut shifted = vec![0u8; if cols % 2 == 1 { RM * row_bytes } else { 0 }];
            let spare = shifted.as_mut_ptr();
            let row = |r: usize, slot: usize| -> Row<u8, L::Table> {
                let table = L::table(lut.as_ptr().add((r / group_rows) * LUT_ENTRIES));
                let nibble = r * cols;
                if nibble.is_multiple_of(2) {
                    return Row {
                        ptr: packed.as_ptr().add(nibble / 2),
                        table,
                    };
                }
                let dst = std::slice::from_raw_parts_mut(spare.add(slot * row_bytes), row_bytes);
                let s = nibble / 2;
                for (k, d) in dst.iter_mut().enumerate() {
                    let hi = packed.get(s + k + 1).map_or(0, |b| b & 15);
                    *d = (packed[s + k] >> 4) | (hi << 4);
                }
                Row {
                    ptr: dst.as_ptr(),
                    table,
                }
            };
            tiles::<L, Lut4, RM, TM>(p, start, stop, blocks, dst, row);
        }
        Weights::Bf16(v) => {
            let row = |r: usize, _| Row {
                ptr: v.as_ptr().add(r * cols),
                table: none,
            };
            tiles::<L, Bf16, RM, TM>(p, start, stop, blocks, dst, row);
        }
        Weights::F16(v) => {
            let row = |r: usize, _| Row {
                ptr: v.as_ptr().add(r * cols),
                table: none,
            };
            tiles::<L, F16, RM, TM>(p, start, stop, blocks, dst, row);
        }
        Weights::F32(v) => {
            let row = |r: usize, _| Row {
                ptr: v.as_ptr().add(r * cols),
                table: none,
            };
            tiles::<L, F32, RM, TM>(p, start, stop, blocks, dst, row);
        }
    }
}

impl Prepared {
    fn live(&self) -> usize {
        self.data.len() / self.stride.max(1)
    }
}

/// Runs the tiles of one stored form over rows `start..stop`; `row(r,
/// slot)` gives row `r` (slot: its place in the tile, for a row that needs
/// a buffer).
#[inline(always)]
unsafe fn tiles<L: Lanes, K: Kind, const RM: usize, const TM: usize>(
    p: &Prepared,
    start: usize,
    stop: usize,
    blocks: Blocks,
    dst: &Dst,
    mut row: impl FnMut(usize, usize) -> Row<K::Elem, L::Table>,
) {
    let live = p.live();
    let mut t0 = 0;
    while t0 < live {
        let tn = TM.min(live - t0);
        let mut r = start;
        while r < stop {
            let rn = if stop - r >= RM { RM } else { 1 };
            macro_rules! go {
                ($r:literal, $t:literal) => {{
                    let rows: [Row<K::Elem, L::Table>; $r] = std::array::from_fn(|i| row(r + i, i));
                    let xs: [*const f32; $t] = std::array::from_fn(|i| p.token(t0 + i));
                    let out = tile::<L, K, $r, $t>(&rows, &xs, blocks);
                    for (i, o) in out.iter().enumerate() {
                        for (j, &v) in o.iter().enumerate() {
                            dst.put(r + i, t0 + j, v);
                        }
                    }
                }};
            }
            match (rn, tn) {
                (4, 4) => go!(4, 4),
                (4, 3) => go!(4, 3),
                (4, 2) => go!(4, 2),
                (4, 1) => go!(4, 1),
                (2, 3) => go!(2, 3),
                (2, 2) => go!(2, 2),
                (2, 1) => go!(2, 1),
                (1, 4) => go!(1, 4),
                (1, 3) => go!(1, 3),
                (1, 2) => go!(1, 2),
                _ => go!(1, 1),
            }
            r += rn;
        }
        t0 += tn;
    }
}

/// Rows `start..stop` of the product with the build `isa`.
pub(super) fn rows(
    isa: Isa,
    w: &Weights,
    cols: usize,
    p: &Prepared,
    start: usize,
    stop: usize,
    dst: &Dst,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` and `Isa::Avx2` are only chosen (or
        // accepted) when the CPU has them (`simd::available_isas`).
        Isa::Avx512 => unsafe { x86::rows_avx512(w, cols, p, start, stop, dst) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::rows_avx2(w, cols, p, start, stop, dst) },
        // SAFETY: the portable build runs everywhere.
        _ => unsafe { rows_of::<portable::V, 1, 1>(w, cols, p, start, stop, dst) },
    }
}

/// Row `r` of `w` as float32 (the values its products use).
pub(super) fn row_values(w: &Weights, cols: usize, r: usize, out: &mut [f32]) {
    match *w {
        Weights::Lut4 {
            packed,
            lut,
            group_rows,
        } => {
            let table = &lut[(r / group_rows) * LUT_ENTRIES..][..LUT_ENTRIES];
            for (c, o) in out.iter_mut().enumerate() {
                let at = r * cols + c;
                let byte = packed[at / 2];
                let ix = if at.is_multiple_of(2) {
                    byte & 15
                } else {
                    byte >> 4
                };
                *o = table[ix as usize];
            }
        }
        Weights::Bf16(v) => {
            for (o, &b) in out.iter_mut().zip(&v[r * cols..(r + 1) * cols]) {
                *o = f32::from_bits((b as u32) << 16);
            }
        }
        Weights::F16(v) => {
            for (o, &b) in out.iter_mut().zip(&v[r * cols..(r + 1) * cols]) {
                *o = half::f16::from_bits(b).to_f32();
            }
        }
        Weights::F32(v) => out.copy_from_slice(&v[r * cols..(r + 1) * cols]),
    }
}

/// The portable build: 16 lanes as an array.
mod portable {
    use super::{Lanes, LANES, LUT_ENTRIES};

    #[derive(Clone, Copy)]
    pub(super) struct V(pub [f32; LANES]);

    /// `n` values of `p` (of a block of `size`), the rest zero.
    unsafe fn padded<E: Copy + Default, const N: usize>(p: *const E, n: usize) -> [E; N] {
        let mut out = [E::default(); N];
        std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), n.min(N));
        out
    }

    fn halves(v: [f32; 2 * LANES]) -> (V, V) {
        let mut a = [0f32; LANES];
        let mut b = [0f32; LANES];
        a.copy_from_slice(&v[..LANES]);
        b.copy_from_slice(&v[LANES..]);
        (V(a), V(b))
    }

    impl Lanes for V {
        type Table = [f32; LUT_ENTRIES];
        unsafe fn zero() -> V {
            V([0.0; LANES])
        }
        unsafe fn load(p: *const f32) -> V {
            V(padded::<f32, LANES>(p, LANES))
        }
        unsafe fn fma(w: V, x: V, acc: V) -> V {
            V(std::array::from_fn(|j| w.0[j].mul_add(x.0[j], acc.0[j])))
        }
        unsafe fn fma_mask(w: V, x: V, acc: V, mask: u16) -> V {
            V(std::array::from_fn(|j| {
                if mask >> j & 1 == 1 {
                    w.0[j].mul_add(x.0[j], acc.0[j])
                } else {
                    acc.0[j]
                }
            }))
        }
        unsafe fn sum(self) -> f32 {
            let a = self.0;
            let s8: [f32; 8] = std::array::from_fn(|j| a[j] + a[j + 8]);
            let s4: [f32; 4] = std::array::from_fn(|j| s8[j] + s8[j + 4]);
            let s2: [f32; 2] = std::array::from_fn(|j| s4[j] + s4[j + 2]);
            s2[0] + s2[1]
        }
        unsafe fn table(lut: *const f32) -> Self::Table {
            padded::<f32, LUT_ENTRIES>(lut, LUT_ENTRIES)
        }
        unsafe fn lut4(p: *const u8, n: usize, table: &Self::Table) -> (V, V) {
            let bytes = padded::<u8, LANES>(p, n);
            (
                V(std::array::from_fn(|j| table[(bytes[j] & 15) as usize])),
                V(std::array::from_fn(|j| table[(bytes[j] >> 4) as usize])),
            )
        }
        unsafe fn bf16(p: *const u16, n: usize) -> (V, V) {
            let bits = padded::<u16, { 2 * LANES }>(p, n);
            halves(std::array::from_fn(|j| {
                f32::from_bits((bits[j] as u32) << 16)
            }))
        }
        unsafe fn f16(p: *const u16, n: usize) -> (V, V) {
            let bits = padded::<u16, { 2 * LANES }>(p, n);
            halves(std::array::from_fn(|j| {
                half::f16::from_bits(bits[j]).to_f32()
            }))
        }
        unsafe fn f32(p: *const f32, n: usize) -> (V, V) {
            halves(padded::<f32, { 2 * LANES }>(p, n))
        }
    }
}

/// The AVX2 and AVX-512 builds.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{rows_of, Dst, Lanes, Prepared, Weights, LANES};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn rows_avx512(
        w: &Weights,
        cols: usize,
        p: &Prepared,
        start: usize,
        stop: usize,
        dst: &Dst,
    ) {
        rows_of::<Z, 4, 4>(w, cols, p, start, stop, dst)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_avx2(
        w: &Weights,
        cols: usize,
        p: &Prepared,
        start: usize,
        stop: usize,
        dst: &Dst,
    ) {
        rows_of::<Y, 2, 3>(w, cols, p, start, stop, dst)
    }

    /// AVX-512: one register.
    #[derive(Clone, Copy)]
    pub(super) struct Z(__m512);

    impl Lanes for Z {
        type Table = __m512;
        #[inline(always)]
        unsafe fn zero() -> Z {
            Z(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Z {
            Z(_mm512_loadu_ps(p))
        }
        #[inline(always)]
        unsafe fn fma(w: Z, x: Z, acc: Z) -> Z {
            Z(_mm512_fmadd_ps(w.0, x.0, acc.0))
        }
        #[inline(always)]
        unsafe fn fma_mask(w: Z, x: Z, acc: Z, mask: u16) -> Z {
            Z(_mm512_mask3_fmadd_ps(w.0, x.0, acc.0, mask))
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            // [j] + [j+8] in lanes 0..8, then the 8 as AVX.
            let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(self.0, self.0);
            let s8 = _mm512_castps512_ps256(_mm512_add_ps(self.0, hi));
            sum8(s8)
        }
        #[inline(always)]
        unsafe fn table(lut: *const f32) -> __m512 {
            _mm512_loadu_ps(lut)
        }
        #[inline(always)]
        unsafe fn lut4(p: *const u8, n: usize, table: &__m512) -> (Z, Z) {
            let raw = if n >= LANES {
                _mm_loadu_si128(p as *const __m128i)
            } else {
                _mm_maskz_loadu_epi8(((1u32 << n) - 1) as u16, p as *const i8)
            };
            // `vpermps` reads only the low 4 bits of each index: the byte
            // itself picks by its low nibble, the byte shifted by its high.
            let b = _mm512_cvtepu8_epi32(raw);
            (
                Z(_mm512_permutexvar_ps(b, *table)),
                Z(_mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b), *table)),
            )
        }
        #[inline(always)]
        unsafe fn bf16(p: *const u16, n: usize) -> (Z, Z) {
            let (a, b) = halves16(p, n);
            (Z(widen_bf16(a)), Z(widen_bf16(b)))
        }
        #[inline(always)]
        unsafe fn f16(p: *const u16, n: usize) -> (Z, Z) {
            let (a, b) = halves16(p, n);
            (Z(_mm512_cvtph_ps(a)), Z(_mm512_cvtph_ps(b)))
        }
        #[inline(always)]
        unsafe fn f32(p: *const f32, n: usize) -> (Z, Z) {
            if n >= 2 * LANES {
                return (Z(_mm512_loadu_ps(p)), Z(_mm512_loadu_ps(p.add(LANES))));
            }
            let m = (1u64 << n) - 1;
            (
                Z(_mm512_maskz_loadu_ps(m as u16, p)),
                Z(_mm512_maskz_loadu_ps((m >> LANES) as u16, p.add(LANES))),
            )
        }
    }

    /// 16 bfloat16 values as float32: their bits moved to the top half.
    /// (Helpers, not closures: a closure does not take the enabled features,
    /// and its intrinsics would be calls.)
    #[inline(always)]
    unsafe fn widen_bf16(h: __m256i) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    /// 32 sixteen-bit values (`n` readable) as two halves.
    #[inline(always)]
    unsafe fn halves16(p: *const u16, n: usize) -> (__m256i, __m256i) {
        let v = if n >= 2 * LANES {
            _mm512_loadu_si512(p as *const __m512i)
        } else {
            _mm512_maskz_loadu_epi16(((1u64 << n) - 1) as u32, p as *const i16)
        };
        (_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
    }

    /// The tree over 8 lanes: `[j] + [j+4]`, `+ [j+2]`, `+ [j+1]`.
    #[inline(always)]
    unsafe fn sum8(s8: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<0b01>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// AVX2: lanes 0..8 and 8..16 in two registers.
    #[derive(Clone, Copy)]
    pub(super) struct Y(__m256, __m256);

    /// Lanes (of 8, from `first`) whose bit of `mask` is set, as a vector mask.
    #[inline(always)]
    unsafe fn lane_mask(mask: u16, first: i32) -> __m256 {
        let bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let m = _mm256_set1_epi32(((mask as i32) >> first) & 0xff);
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(m, bits), bits))
    }

    /// `n` values of a block of `N` (`n < N`) copied into a zeroed one.
    #[inline(always)]
    unsafe fn spill<E: Copy + Default, const N: usize>(p: *const E, n: usize) -> [E; N] {
        let mut out = [E::default(); N];
        std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), n.min(N));
        out
    }

    /// 8 bfloat16 values at `p` as float32.
    #[inline(always)]
    unsafe fn bf16x8(p: *const u16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }

    /// 8 float16 values at `p` as float32.
    #[inline(always)]
    unsafe fn f16x8(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// One nibble index per lane through a 16-entry table held as two
    /// halves. Only the low 4 bits of each index count: `vpermps` reads
    /// bits 0-2, and bit 3, moved to the sign bit, picks the half.
    #[inline(always)]
    unsafe fn look(ix: __m256i, t: &(__m256, __m256)) -> __m256 {
        let a = _mm256_permutevar8x32_ps(t.0, ix);
        let b = _mm256_permutevar8x32_ps(t.1, ix);
        // Bit 3 of the index moved to the sign bit picks the upper half.
        _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(ix)))
    }

    impl Lanes for Y {
        type Table = (__m256, __m256);
        #[inline(always)]
        unsafe fn zero() -> Y {
            Y(_mm256_setzero_ps(), _mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Y {
            Y(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
        #[inline(always)]
        unsafe fn fma(w: Y, x: Y, acc: Y) -> Y {
            Y(
                _mm256_fmadd_ps(w.0, x.0, acc.0),
                _mm256_fmadd_ps(w.1, x.1, acc.1),
            )
        }
        #[inline(always)]
        unsafe fn fma_mask(w: Y, x: Y, acc: Y, mask: u16) -> Y {
            let f = Y::fma(w, x, acc);
            Y(
                _mm256_blendv_ps(acc.0, f.0, lane_mask(mask, 0)),
                _mm256_blendv_ps(acc.1, f.1, lane_mask(mask, 8)),
            )
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            sum8(_mm256_add_ps(self.0, self.1))
        }
        #[inline(always)]
        unsafe fn table(lut: *const f32) -> (__m256, __m256) {
            (_mm256_loadu_ps(lut), _mm256_loadu_ps(lut.add(8)))
        }
        #[inline(always)]
        unsafe fn lut4(p: *const u8, n: usize, table: &(__m256, __m256)) -> (Y, Y) {
            let spilled;
            let p = if n >= LANES {
                p
            } else {
                spilled = spill::<u8, LANES>(p, n);
                spilled.as_ptr()
            };
            let b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
            let b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i));
            // `look` reads only the low 4 bits of each index (the low nibble).
            let lo = Y(look(b0, table), look(b1, table));
            let hi = Y(
                look(_mm256_srli_epi32::<4>(b0), table),
                look(_mm256_srli_epi32::<4>(b1), table),
            );
            (lo, hi)
        }
        #[inline(always)]
        unsafe fn bf16(p: *const u16, n: usize) -> (Y, Y) {
            let spilled;
            let p = if n >= 2 * LANES {
                p
            } else {
                spilled = spill::<u16, { 2 * LANES }>(p, n);
                spilled.as_ptr()
            };
            (
                Y(bf16x8(p), bf16x8(p.add(8))),
                Y(bf16x8(p.add(16)), bf16x8(p.add(24))),
            )
        }
        #[inline(always)]
        unsafe fn f16(p: *const u16, n: usize) -> (Y, Y) {
            let spilled;
            let p = if n >= 2 * LANES {
                p
            } else {
                spilled = spill::<u16, { 2 * LANES }>(p, n);
                spilled.as_ptr()
            };
            (
                Y(f16x8(p), f16x8(p.add(8))),
                Y(f16x8(p.add(16)), f16x8(p.add(24))),
            )
        }
        #[inline(always)]
        unsafe fn f32(p: *const f32, n: usize) -> (Y, Y) {
            let spilled;
            let p = if n >= 2 * LANES {
                p
            } else {
                spilled = spill::<f32, { 2 * LANES }>(p, n);
                spilled.as_ptr()
            };
            (
                Y(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))),
                Y(_mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))),
            )
        }
    }
}
