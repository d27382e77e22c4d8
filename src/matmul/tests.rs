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
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Uniform in (-1, 1), times a magnitude spread over 2^-6..2^6 (so sums
    /// cancel and values span many exponents).
    fn value(&mut self) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        u * (2f32).powi(self.below(13) as i32 - 6)
    }
}

/// A random weight of each stored form, `[rows, cols]`, and its values.
struct Owned {
    packed: Vec<u8>,
    lut: Vec<f32>,
    group_rows: usize,
    half: Vec<u16>,
    full: Vec<f32>,
}

fn bf16_bits(v: f32) -> u16 {
    // Round to nearest even, as torch's conversion does.
    let b = v.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn owned(rng: &mut Rng, rows: usize, cols: usize, group_rows: usize) -> Owned {
    let groups = rows / group_rows;
    let lut: Vec<f32> = (0..groups * LUT_ENTRIES)
        .map(|_| f16::from_f32(rng.value()).to_f32())
        .collect();
    let packed: Vec<u8> = (0..(rows * cols).div_ceil(2))
        .map(|_| rng.next() as u8)
        .collect();
    let half: Vec<u16> = (0..rows * cols)
        .map(|_| rng.next() as u16 & 0x7fff)
        .collect();
    let full: Vec<f32> = (0..rows * cols).map(|_| rng.value()).collect();
    Owned {
        packed,
        lut,
        group_rows,
        half: half
            .iter()
            .map(|&b| {
                // Finite bf16 / fp16 bit patterns either way: exponent below all-ones.
                let v = b & 0x3fff;
                v | ((b & 1) << 15)
            })
            .collect(),
        full,
    }
}

impl Owned {
    fn weights(&self) -> Vec<Weights<'_>> {
        vec![
            Weights::Lut4 {
                packed: &self.packed,
                lut: &self.lut,
                group_rows: self.group_rows,
            },
            Weights::Bf16(&self.half),
            Weights::F16(&self.half),
            Weights::F32(&self.full),
        ]
    }
}

/// `(Σ x·w, Σ |x·w|)` in float64 for every output, token-major.
fn reference(w: &Weights, rows: usize, cols: usize, x: &[f32], tokens: usize) -> Vec<(f64, f64)> {
    let values = dense_rows(w, rows, cols, 0, rows).unwrap();
    let mut out = Vec::with_capacity(rows * tokens);
    for t in 0..tokens {
        for r in 0..rows {
            let (mut s, mut a) = (0f64, 0f64);
            for c in 0..cols {
                let p = x[t * cols + c] as f64 * values[r * cols + c] as f64;
                s += p;
                a += p.abs();
            }
            out.push((s, a));
        }
    }
    out
}

/// The product of every build, checked against float64 by the bound and
/// against the portable build bit for bit.
fn check_all(w: &Weights, rows: usize, cols: usize, x: &[f32], tokens: usize, what: &str) {
    let want = reference(w, rows, cols, x, tokens);
    let input = Input {
        x,
        tokens,
        live: tokens,
    };
    let portable = matmul(w, rows, cols, input, Layout::TokenMajor, Isa::Portable).unwrap();
    for isa in available_isas() {
        let got = matmul(w, rows, cols, input, Layout::TokenMajor, isa).unwrap();
        for (i, (&g, &(s, a))) in got.iter().zip(&want).enumerate() {
            // float64's own rounding of the reference sum, beside the bound.
            let slack = a * cols as f64 * f64::EPSILON;
            let bound = error_bound(cols, a) + slack;
            assert!(
                (g as f64 - s).abs() <= bound,
                "{what} {} {isa:?}: output {i} is {g}, float64 {s}, bound {bound:e}",
                w.kind()
            );
            assert_eq!(
                g.to_bits(),
                portable[i].to_bits(),
                "{what} {} {isa:?}: output {i} differs from the portable build",
                w.kind()
            );
        }
    }
}

fn input(rng: &mut Rng, tokens: usize, cols: usize) -> Vec<f32> {
    (0..tokens * cols)
        .map(|i| if i % 7 == 3 { 0.0 } else { rng.value() })
        .collect()
}

#[test]
fn every_build_within_the_bound_and_equal_to_portable_on_random_shapes() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for trial in 0..60 {
        let group_rows = [1, 2, 3, 8, 32][rng.below(5)];
        let rows = group_rows * (1 + rng.below(12));
        let cols = 1 + rng.below(200);
        let tokens = 1 + rng.below(9);
        let o = owned(&mut rng, rows, cols, group_rows);
        let x = input(&mut rng, tokens, cols);
        for w in o.weights() {
            check_all(
                &w,
                rows,
                cols,
                &x,
                tokens,
                &format!("trial {trial} [{rows}, {cols}] x{tokens}"),
            );
        }
    }
}

#[test]
fn odd_sizes_and_block_edges() {
    let mut rng = Rng(7);
    // Columns around block and byte edges, odd ones (LUT rows starting
    // mid-byte), rows not a multiple of any tile, token counts around tiles.
    for &cols in &[1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 1535, 1536] {
        for &(rows, group_rows) in &[(1, 1), (3, 3), (5, 1), (7, 7), (33, 11), (64, 32)] {
            for &tokens in &[1, 2, 3, 4, 5, 8] {
                let o = owned(&mut rng, rows, cols, group_rows);
                let x = input(&mut rng, tokens, cols);
                for w in o.weights() {
                    check_all(
                        &w,
                        rows,
                        cols,
                        &x,
                        tokens,
                        &format!("[{rows}, {cols}] x{tokens}"),
                    );
                }
            }
        }
    }
}

#[test]
fn each_output_has_the_same_bits_whatever_the_tokens_beside_it() {
    // A decode step (one token), a batch of steps and a prefill call give a
    // token the same bits: the order depends on the columns alone.
    let mut rng = Rng(11);
    let (rows, cols, tokens) = (70, 301, 11);
    let o = owned(&mut rng, rows, cols, 7);
    let x = input(&mut rng, tokens, cols);
    for w in o.weights() {
        for isa in available_isas() {
            let all = Input {
                x: &x,
                tokens,
                live: tokens,
            };
            let batched = matmul(&w, rows, cols, all, Layout::TokenMajor, isa).unwrap();
            for t in 0..tokens {
                let one = Input {
                    x: &x[t * cols..(t + 1) * cols],
                    tokens: 1,
                    live: 1,
                };
                let alone = matmul(&w, rows, cols, one, Layout::TokenMajor, isa).unwrap();
                assert_eq!(
                    alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    batched[t * rows..(t + 1) * rows]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>(),
                    "{} {isa:?} token {t}",
                    w.kind()
                );
            }
        }
    }
}

#[test]
fn channel_major_is_the_transpose_and_padding_tokens_are_zero() {
    let mut rng = Rng(13);
    let (rows, cols, tokens, live) = (48, 130, 9, 5);
    let o = owned(&mut rng, rows, cols, 16);
    let x = input(&mut rng, tokens, cols);
    for w in o.weights() {
        let isa = best_isa();
        let full = Input {
            x: &x,
            tokens,
            live: tokens,
        };
        let token_major = matmul(&w, rows, cols, full, Layout::TokenMajor, isa).unwrap();
        let channel_major = matmul(&w, rows, cols, full, Layout::ChannelMajor, isa).unwrap();
        let part = Input {
            x: &x[..live * cols],
            tokens,
            live,
        };
        let partial = matmul(&w, rows, cols, part, Layout::ChannelMajor, isa).unwrap();
        for r in 0..rows {
            for t in 0..tokens {
                let v = token_major[t * rows + r];
                assert_eq!(channel_major[r * tokens + t].to_bits(), v.to_bits());
                let p = partial[r * tokens + t];
                if t < live {
                    assert_eq!(p.to_bits(), v.to_bits(), "live token {t}");
                } else {
                    assert_eq!(p, 0.0, "padding token {t}");
                }
            }
        }
    }
}

/// E2B's tied head: 262144 × 1536, INT4 (group 32) and bf16, one token and
/// three, every build against float64 and the portable build.
#[test]
fn e2b_head_within_the_bound_on_every_build() {
    let (rows, cols) = (262_144, 1536);
    let mut rng = Rng(17);
    let lut: Vec<f32> = (0..rows / 32 * LUT_ENTRIES)
        .map(|_| f16::from_f32(rng.value() * 0.05).to_f32())
        .collect();
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
    let x = input(&mut rng, 3, cols);
    let w = Weights::Lut4 {
        packed: &packed,
        lut: &lut,
        group_rows: 32,
    };
    check_all(&w, rows, cols, &x, 3, "E2B head");
    drop(packed);
    let bits: Vec<u16> = (0..rows * cols)
        .map(|_| bf16_bits(rng.value() * 0.05))
        .collect();
    check_all(&Weights::Bf16(&bits), rows, cols, &x[..cols], 1, "E2B head");
}

#[test]
fn bad_weights_and_inputs_are_refused() {
    let lut = vec![0.5f32; 32];
    let packed = vec![0u8; 8];
    let w = Weights::Lut4 {
        packed: &packed,
        lut: &lut,
        group_rows: 2,
    };
    let x = vec![1f32; 4];
    // 4 x 4 = 16 nibbles = 8 bytes, 2 groups of 2 rows.
    assert!(matmul(
        &w,
        4,
        4,
        Input {
            x: &x,
            tokens: 1,
            live: 1
        },
        Layout::TokenMajor,
        Isa::Portable
    )
    .is_ok());
    assert!(matches!(
        matmul(
            &w,
            4,
            6,
            Input {
                x: &x,
                tokens: 1,
                live: 1
            },
            Layout::TokenMajor,
            Isa::Portable
        ),
        Err(MatmulError::WeightSize { .. })
    ));
    assert!(matches!(
        matmul(
            &w,
            4,
            4,
            Input {
                x: &x[..3],
                tokens: 1,
                live: 1
            },
            Layout::TokenMajor,
            Isa::Portable
        ),
        Err(MatmulError::InputSize { .. })
    ));
    assert!(matches!(
        matmul(
            &w,
            4,
            4,
            Input {
                x: &x[..2],
                tokens: 1,
                live: 2
            },
            Layout::TokenMajor,
            Isa::Portable
        ),
        Err(MatmulError::Live { .. })
    ));
    let odd = Weights::Lut4 {
        packed: &packed,
        lut: &lut,
        group_rows: 3,
    };
    assert!(matches!(check(&odd, 4, 4), Err(MatmulError::Groups { .. })));
    let mut bad = lut.clone();
    bad[21] = f32::INFINITY;
    let inf = Weights::Lut4 {
        packed: &packed,
        lut: &bad,
        group_rows: 2,
    };
    assert_eq!(
        check(&inf, 4, 4),
        Err(MatmulError::LutNotFinite {
            group: 1,
            entry: 5,
            value: f32::INFINITY
        })
    );
    let short = Weights::Lut4 {
        packed: &packed,
        lut: &lut[..16],
        group_rows: 2,
    };
    assert!(matches!(
        check(&short, 4, 4),
        Err(MatmulError::LutSize { .. })
    ));
    assert!(matches!(
        dense_rows(&Weights::F32(&x), 2, 2, 1, 3),
        Err(MatmulError::RowRange { .. })
    ));
}

#[test]
fn dense_rows_and_squared_error_agree_with_the_values() {
    let mut rng = Rng(23);
    let (rows, cols) = (12, 37);
    let o = owned(&mut rng, rows, cols, 4);
    let ws = o.weights();
    // Row r, column c of the LUT weight by hand.
    let dense = dense_rows(&ws[0], rows, cols, 3, 7).unwrap();
    for r in 3..7 {
        for c in 0..cols {
            let at = r * cols + c;
            let b = o.packed[at / 2];
            let ix = if at % 2 == 0 { b & 15 } else { b >> 4 } as usize;
            assert_eq!(dense[(r - 3) * cols + c], o.lut[(r / 4) * 16 + ix]);
        }
    }
    let a = dense_rows(&ws[0], rows, cols, 0, rows).unwrap();
    let b = dense_rows(&ws[1], rows, cols, 0, rows).unwrap();
    let (e, s) = squared_error(&ws[0], &ws[1], rows, cols).unwrap();
    let want_e: f64 = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let want_s: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    assert!((e - want_e).abs() <= 1e-12 * want_e);
    assert!((s - want_s).abs() <= 1e-12 * want_s);
}
