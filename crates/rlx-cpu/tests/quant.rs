//! GGML block-quantized weights: the decoder against an f64 decoder written
//! here from the format descriptions, the encoder's round-trip error, the
//! int8-activation matmul (every kernel) against the f64 oracle within a
//! bound derived from the activation rounding, the gather, and argument
//! checks.

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rlx_cpu::quant::{dequantize_row, gather_rows, matmul, matmul_reference, matmul_with, quantize_row, QPath};
use rlx_ir::QFormat;

fn h(b: &[u8], off: usize) -> f64 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f64()
}

/// One block decoded in f64 from the format description. Returns per
/// element (value, |scale part| + |min part|): the second is the size of
/// the terms a kernel adds, for the float-rounding slack.
fn decode(f: QFormat, b: &[u8]) -> Vec<(f64, f64)> {
    let nib = |qs: &[u8], j: usize| if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 } as i64;
    match f {
        QFormat::Q4_0 => (0..32).map(|j| h(b, 0) * (nib(&b[2..18], j) - 8) as f64).map(|v| (v, v.abs())).collect(),
        QFormat::Q4_1 => (0..32)
            .map(|j| {
                let (s, m) = (h(b, 0) * nib(&b[4..20], j) as f64, h(b, 2));
                (s + m, s.abs() + m.abs())
            })
            .collect(),
        QFormat::Q5_0 | QFormat::Q5_1 => {
            let o = if f == QFormat::Q5_0 { 2 } else { 4 };
            let qh = u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
            (0..32)
                .map(|j| {
                    let q = nib(&b[o + 4..o + 20], j) + (((qh >> j) & 1) as i64) * 16;
                    if f == QFormat::Q5_0 {
                        let v = h(b, 0) * (q - 16) as f64;
                        (v, v.abs())
                    } else {
                        let (s, m) = (h(b, 0) * q as f64, h(b, 2));
                        (s + m, s.abs() + m.abs())
                    }
                })
                .collect()
        }
        QFormat::Q8_0 => (0..32).map(|j| h(b, 0) * (b[2 + j] as i8) as f64).map(|v| (v, v.abs())).collect(),
        QFormat::Q4K => {
            let s = &b[4..16];
            let scale_min = |j: usize| -> (f64, f64) {
                if j < 4 {
                    ((s[j] & 63) as f64, (s[j + 4] & 63) as f64)
                } else {
                    (((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)) as f64, ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as f64)
                }
            };
            let mut out = vec![(0.0, 0.0); 256];
            for c in 0..4 {
                for half in 0..2 {
                    let (sc, m) = scale_min(2 * c + half);
                    for l in 0..32 {
                        let byte = b[16 + 32 * c + l];
                        let q = if half == 0 { byte & 15 } else { byte >> 4 } as f64;
                        let (a, mm) = (h(b, 0) * sc * q, h(b, 2) * m);
                        out[64 * c + 32 * half + l] = (a - mm, a.abs() + mm.abs());
                    }
                }
            }
            out
        }
        QFormat::Q6K => {
            let mut out = vec![(0.0, 0.0); 256];
            for half in 0..2 {
                let (ql, qh, sc) = (&b[64 * half..], &b[128 + 32 * half..], &b[192 + 8 * half..]);
                for l in 0..32 {
                    let qs = [
                        (ql[l] & 15) | (qh[l] & 3) << 4,
                        (ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4,
                        (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4,
                        (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4,
                    ];
                    for (t, &q) in qs.iter().enumerate() {
                        let v = h(b, 208) * (sc[l / 16 + 2 * t] as i8) as f64 * (q as f64 - 32.0);
                        out[128 * half + 32 * t + l] = (v, v.abs());
                    }
                }
            }
            out
        }
    }
}

fn decode_row(f: QFormat, row: &[u8]) -> Vec<(f64, f64)> {
    row.chunks_exact(f.block_bytes()).flat_map(|b| decode(f, b)).collect()
}

/// Where a format keeps its f16 fields.
fn f16_fields(f: QFormat) -> &'static [usize] {
    match f {
        QFormat::Q4_0 | QFormat::Q5_0 | QFormat::Q8_0 => &[0],
        QFormat::Q4_1 | QFormat::Q5_1 | QFormat::Q4K => &[0, 2],
        QFormat::Q6K => &[208],
    }
}

const EXTREME_F16: [u16; 10] = [
    0x7BFF, // 65504
    0xFBFF, // -65504
    0x0001, // smallest subnormal
    0x8001, 0x03FF, // largest subnormal
    0x0400, // smallest normal
    0x0000, 0x8000, 0x3C00, // 1
    0xBC00, // -1
];

/// A finite f16: an extreme one, or random bits (exponent 31 cleared).
fn any_f16(r: &mut StdRng) -> u16 {
    if r.random_bool(0.3) {
        EXTREME_F16[r.random_range(0..EXTREME_F16.len())]
    } else {
        let b: u16 = r.random();
        if b & 0x7C00 == 0x7C00 {
            b & !0x4000
        } else {
            b
        }
    }
}

/// An f16 of moderate size (|v| in about [2^-12, 2^2]), either sign.
fn moderate_f16(r: &mut StdRng) -> u16 {
    let v = f16::from_f32(r.random_range(-4.0f32..4.0) * 2f32.powi(-r.random_range(0..10)));
    v.to_bits()
}

/// Random blocks: every quant bit random, the f16 fields from `scale`.
fn random_blocks(f: QFormat, r: &mut StdRng, n: usize, scale: fn(&mut StdRng) -> u16) -> Vec<u8> {
    let mut out = vec![0u8; n * f.block_bytes()];
    r.fill(&mut out[..]);
    for b in out.chunks_exact_mut(f.block_bytes()) {
        for &o in f16_fields(f) {
            b[o..o + 2].copy_from_slice(&scale(r).to_le_bytes());
        }
    }
    out
}

#[test]
fn dequantize_matches_spec_decoder() {
    let mut r = StdRng::seed_from_u64(1);
    for f in QFormat::ALL {
        let mut row = random_blocks(f, &mut r, 3000, any_f16);
        // Every quant byte all zeros / all ones, and each extreme scale on
        // every field.
        let bb = f.block_bytes();
        for (i, b) in row.chunks_exact_mut(bb).take(2 * EXTREME_F16.len()).enumerate() {
            b.fill(if i % 2 == 0 { 0x00 } else { 0xFF });
            for &o in f16_fields(f) {
                b[o..o + 2].copy_from_slice(&EXTREME_F16[i / 2].to_le_bytes());
            }
        }
        let n = row.len() / bb * f.block_elems();
        let mut got = vec![f32::NAN; n];
        dequantize_row(f, &row, &mut got).unwrap();
        let want = decode_row(f, &row);
        for (i, (&g, &(w, _))) in got.iter().zip(&want).enumerate() {
            assert!(g == w as f32, "{f}: element {i} (block {}): got {g:e}, spec {w:e}", i / f.block_elems());
        }
    }
}

/// Rows with various shapes of data: Gaussian-ish, uniform of one sign,
/// outliers, constant and zero blocks, tiny and large magnitudes.
fn test_row(r: &mut StdRng, k: usize, kind: usize) -> Vec<f32> {
    let mag = [1.0f32, 1e-3, 1e-6, 30.0, 1000.0][r.random_range(0..5)];
    let mut x: Vec<f32> = (0..k)
        .map(|_| match kind % 4 {
            0 => (0..4).map(|_| r.random_range(-1.0f32..1.0)).sum::<f32>() * mag,
            1 => r.random_range(0.0f32..1.0) * mag,
            2 => -r.random_range(0.0f32..1.0) * mag - mag,
            _ => r.random_range(-1.0f32..1.0) * mag * if r.random_bool(0.02) { 50.0 } else { 1.0 },
        })
        .collect();
    // Some constant and zero stretches.
    for chunk in x.chunks_mut(32) {
        match r.random_range(0..12) {
            0 => chunk.fill(0.0),
            1 => chunk.fill(mag * 0.37),
            2 => chunk.fill(-mag),
            _ => {}
        }
    }
    x
}

/// The round trip is within half a step of each element's (sub-)block, the
/// step read back from the block:
/// - Q4_0/Q5_0/Q8_0: |d|/2, with |d| ≤ amax/7, amax/15, amax/127 (f16
///   rounded up);
/// - Q4_1/Q5_1: d/2 (plus f32 rounding of x − m), d ≤ (max − min)/15 or /31
///   (the min rounded down to f16, d up);
/// - Q4_K: d·scale_j/2 for sub-block j; Q6_K: |d·scale_s|/2.
#[test]
fn quantize_round_trip_within_half_a_step() {
    let mut r = StdRng::seed_from_u64(2);
    for f in QFormat::ALL {
        for kind in 0..40 {
            let k = f.block_elems() * r.random_range(1..6);
            let x = test_row(&mut r, k, kind);
            let q = quantize_row(f, &x).unwrap();
            assert_eq!(q.len(), f.row_bytes(k).unwrap());
            let mut y = vec![0f32; k];
            dequantize_row(f, &q, &mut y).unwrap();
            for (bi, blk) in q.chunks_exact(f.block_bytes()).enumerate() {
                let be = f.block_elems();
                let xs = &x[bi * be..(bi + 1) * be];
                let ys = &y[bi * be..(bi + 1) * be];
                let amax = xs.iter().fold(0f64, |a, &v| a.max(v.abs() as f64));
                let lo = xs.iter().fold(f64::INFINITY, |a, &v| a.min(v as f64));
                let hi = xs.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
                let d = h(blk, if f == QFormat::Q6K { 208 } else { 0 });
                // The step each element is rounded to, and an absolute slack
                // for f32 rounding of the arithmetic.
                let (steps, slack): (Vec<f64>, Vec<f64>) = match f {
                    QFormat::Q4_0 | QFormat::Q5_0 | QFormat::Q8_0 => {
                        let levels =
                            [(QFormat::Q4_0, 7.0), (QFormat::Q5_0, 15.0), (QFormat::Q8_0, 127.0)].iter().find(|p| p.0 == f).unwrap().1;
                        assert!(d.abs() <= amax / levels * (1.0 + 1e-3) + 6e-8, "{f}: step {d} for amax {amax}");
                        (vec![d.abs(); be], xs.iter().map(|&v| v.abs() as f64 * 2e-7).collect())
                    }
                    QFormat::Q4_1 | QFormat::Q5_1 => {
                        let top = if f == QFormat::Q4_1 { 15.0 } else { 31.0 };
                        let m = h(blk, 2);
                        assert!(m <= lo, "{f}: min {m} above the data's {lo}");
                        assert!(d <= (hi - lo + lo.abs() * 1e-3 + 6e-8) / top * (1.0 + 1e-3) + 6e-8, "{f}: step {d} for range {lo}..{hi}");
                        (vec![d; be], xs.iter().map(|&v| (v.abs() as f64 + m.abs()) * 3e-7).collect())
                    }
                    QFormat::Q4K => {
                        let dmin = h(blk, 2);
                        let s = &blk[4..16];
                        let mut steps = vec![0.0; 256];
                        let mut slack = vec![0.0; 256];
                        for j in 0..8 {
                            let (sc, mn) = if j < 4 {
                                (s[j] & 63, s[j + 4] & 63)
                            } else {
                                ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
                            };
                            for l in 0..32 {
                                steps[32 * j + l] = d * sc as f64;
                                slack[32 * j + l] = (xs[32 * j + l].abs() as f64 + dmin * mn as f64) * 3e-7;
                            }
                        }
                        (steps, slack)
                    }
                    QFormat::Q6K => {
                        let steps = (0..256).map(|e| (d * (blk[192 + e / 16] as i8) as f64).abs()).collect();
                        (steps, xs.iter().map(|&v| v.abs() as f64 * 2e-7).collect())
                    }
                };
                for e in 0..be {
                    let err = (xs[e] as f64 - ys[e] as f64).abs();
                    let bound = steps[e] / 2.0 * (1.0 + 1e-5) + slack[e] + 1e-30;
                    assert!(
                        err <= bound,
                        "{f} kind {kind}: block {bi} elem {e}: x {} → {} (err {err:e} > {bound:e}, step {})",
                        xs[e],
                        ys[e],
                        steps[e]
                    );
                }
            }
        }
    }
}

struct Problem {
    f: QFormat,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldo: usize,
    a: Vec<f32>,
    w: Vec<u8>,
}

fn problem(r: &mut StdRng, f: QFormat, m: usize, n: usize, k: usize, extreme: bool) -> Problem {
    let lda = k + if r.random_bool(0.5) { r.random_range(1..9) } else { 0 };
    let ldo = n + if r.random_bool(0.5) { r.random_range(1..9) } else { 0 };
    let mut a = vec![f32::NAN; (m - 1) * lda + k];
    for i in 0..m {
        let kind = r.random_range(0..4);
        let row = test_row(r, k, kind);
        a[i * lda..i * lda + k].copy_from_slice(&row);
    }
    let w = random_blocks(f, r, n * k / f.block_elems(), if extreme { any_f16 } else { moderate_f16 });
    Problem { f, m, n, k, lda, ldo, a, w }
}

impl Problem {
    /// Per output: the oracle, and the allowed error. The kernel computes
    /// Σ w·â exactly in integers per block, â the activation rounded to
    /// int8 with scale amax_b/127 per weight block b, so
    /// |out − ref| ≤ Σ_b (amax_b/127/2)·Σ_{e∈b}|w_e| (times 1 + 1e-4 for the
    /// f32 product a·(127/amax)), plus f32 rounding of the per-block scale
    /// products and of the sum over blocks: (blocks + 16)·1e-6 of the size
    /// of the terms added, plus the oracle's own rounding to f32.
    fn oracle(&self) -> (Vec<f32>, Vec<f64>) {
        let be = self.f.block_elems();
        let rb = self.f.row_bytes(self.k).unwrap();
        let nb = self.k / be;
        let mut reference = vec![f32::NAN; (self.m - 1) * self.ldo + self.n];
        matmul_reference(self.f, self.m, self.n, self.k, &self.a, self.lda, &self.w, &mut reference, self.ldo).unwrap();
        let mut bound = vec![0f64; reference.len()];
        for j in 0..self.n {
            let wr = decode_row(self.f, &self.w[j * rb..(j + 1) * rb]);
            for i in 0..self.m {
                let x = &self.a[i * self.lda..i * self.lda + self.k];
                let (mut quant, mut size) = (0f64, 0f64);
                for b in 0..nb {
                    let xs = &x[b * be..(b + 1) * be];
                    let ws = &wr[b * be..(b + 1) * be];
                    let step = xs.iter().fold(0f64, |a, &v| a.max(v.abs() as f64)) / 127.0;
                    quant += step / 2.0 * ws.iter().map(|w| w.0.abs()).sum::<f64>();
                    size += xs.iter().zip(ws).map(|(&a, w)| (a.abs() as f64 + step) * w.1).sum::<f64>();
                }
                let o = i * self.ldo + j;
                bound[o] = quant * (1.0 + 1e-4) + size * (nb as f64 + 16.0) * 1e-6 + reference[o].abs() as f64 * 2f64.powi(-23) + 1e-30;
            }
        }
        (reference, bound)
    }

    fn run(&self, path: Option<QPath>) -> Vec<f32> {
        let mut out = vec![f32::NAN; (self.m - 1) * self.ldo + self.n];
        match path {
            Some(p) => matmul_with(p, self.f, self.m, self.n, self.k, &self.a, self.lda, &self.w, &mut out, self.ldo),
            None => matmul(self.f, self.m, self.n, self.k, &self.a, self.lda, &self.w, &mut out, self.ldo),
        }
        .unwrap();
        out
    }

    fn check(&self, got: &[f32], reference: &[f32], bound: &[f64], what: &str) {
        for i in 0..self.m {
            for j in 0..self.n {
                let o = i * self.ldo + j;
                let err = (got[o] as f64 - reference[o] as f64).abs();
                assert!(
                    err <= bound[o],
                    "{what} {} m={} n={} k={}: out[{i}][{j}] = {} vs {} (err {err:e} > bound {:e})",
                    self.f,
                    self.m,
                    self.n,
                    self.k,
                    got[o],
                    reference[o],
                    bound[o]
                );
            }
            // The stride padding is not written.
            if i + 1 < self.m {
                assert!(got[i * self.ldo + self.n..(i + 1) * self.ldo].iter().all(|v| v.is_nan()), "{what}: wrote into the row padding");
            }
        }
    }
}

fn ks(f: QFormat) -> &'static [usize] {
    if f.block_elems() == 256 {
        &[256, 512, 768]
    } else {
        &[32, 64, 160, 576, 1536]
    }
}

#[test]
fn matmul_within_activation_rounding_bound() {
    let mut r = StdRng::seed_from_u64(3);
    for f in QFormat::ALL {
        for &k in ks(f) {
            for t in 0..6 {
                let (m, n) = (r.random_range(1..=5), r.random_range(1..=70));
                let p = problem(&mut r, f, m, n, k, t % 2 == 1);
                let (reference, bound) = p.oracle();
                p.check(&p.run(None), &reference, &bound, "matmul");
            }
        }
    }
}

/// Every kernel this CPU has, on small shapes and on shapes that split
/// over threads (odd block counts too), against the oracle's bound and
/// against the scalar kernel (which differs only in f32 rounding).
#[test]
fn every_kernel_against_oracle_and_scalar() {
    let paths = QPath::available();
    println!("kernels on this CPU: {paths:?} (matmul uses {:?})", QPath::best());
    assert_eq!(paths[0], QPath::Scalar);
    let mut r = StdRng::seed_from_u64(4);
    for f in QFormat::ALL {
        let shapes: Vec<(usize, usize, usize)> = if f.block_elems() == 256 {
            vec![(1, 37, 256), (3, 5, 512), (1, 1500, 768), (4, 600, 256)]
        } else {
            vec![(1, 70, 576), (5, 3, 32), (2, 9, 96), (1, 2000, 576), (3, 700, 1536), (2, 1100, 160)]
        };
        for (t, &(m, n, k)) in shapes.iter().enumerate() {
            let p = problem(&mut r, f, m, n, k, t % 2 == 0);
            let (reference, bound) = p.oracle();
            let scalar = p.run(Some(QPath::Scalar));
            p.check(&scalar, &reference, &bound, "scalar");
            for &path in &paths[1..] {
                let got = p.run(Some(path));
                p.check(&got, &reference, &bound, &format!("{path:?}"));
                // Same integer sums; only the f32 combination order differs.
                let rb = f.row_bytes(k).unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let o = i * p.ldo + j;
                        let wr = decode_row(f, &p.w[j * rb..(j + 1) * rb]);
                        let size: f64 =
                            p.a[i * p.lda..i * p.lda + k].iter().zip(&wr).map(|(&a, w)| (a.abs() as f64 * 1.01 + 1e-30) * w.1).sum();
                        let tol = size * (k / f.block_elems() + 16) as f64 * 2e-6 + 1e-30;
                        let diff = (got[o] as f64 - scalar[o] as f64).abs();
                        assert!(
                            diff <= tol,
                            "{path:?} vs scalar {f} m={m} n={n} k={k}: [{i}][{j}] {} vs {} (diff {diff:e} > {tol:e})",
                            got[o],
                            scalar[o]
                        );
                    }
                }
            }
        }
    }
}

/// Every row of a call over several activation rows has the bits of that
/// row run alone, on every kernel: batched decode equals single runs.
#[test]
fn rows_of_a_batch_equal_single_rows_bit_for_bit() {
    let mut r = StdRng::seed_from_u64(9);
    for f in QFormat::ALL {
        // An odd block count for the 32-element formats (the kernels' tail
        // block), 2 blocks for the K formats.
        let k = if f.block_elems() == 256 { 512 } else { 544 };
        for m in [4, 6, 7, 8, 9, 10, 11, 13] {
            let p = problem(&mut r, f, m, 37, k, false);
            for path in QPath::available() {
                let all = p.run(Some(path));
                for i in 0..m {
                    let mut one = vec![f32::NAN; p.n];
                    matmul_with(path, f, 1, p.n, k, &p.a[i * p.lda..i * p.lda + k], k, &p.w, &mut one, p.n).unwrap();
                    let row = &all[i * p.ldo..i * p.ldo + p.n];
                    assert!(
                        row.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{path:?} {f} m={m}: row {i} differs from the row alone"
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_of_encoded_weights_tracks_f32_matmul() {
    // The use the encoder exists for: weights from quantize_row, then the
    // fast matmul; compared with the decoded weights' oracle.
    let mut r = StdRng::seed_from_u64(5);
    for f in QFormat::ALL {
        let (m, n, k) = (2, 40, if f.block_elems() == 256 { 512 } else { 576 });
        let mut w = Vec::new();
        for _ in 0..n {
            let row: Vec<f32> = (0..k).map(|_| r.random_range(-0.1f32..0.1)).collect();
            w.extend(quantize_row(f, &row).unwrap());
        }
        let a: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let p = Problem { f, m, n, k, lda: k, ldo: n, a, w };
        let (reference, bound) = p.oracle();
        p.check(&p.run(None), &reference, &bound, "encoded");
    }
}

#[test]
fn nan_activations_reach_the_outputs() {
    // Rounding to int8 must not turn a NaN into 0: its row comes out NaN on
    // every kernel, the other rows are untouched by it.
    let mut r = StdRng::seed_from_u64(9);
    for f in QFormat::ALL {
        let (m, n, k) = (2, 5, 2 * f.block_elems());
        let w = random_blocks(f, &mut r, n * 2, moderate_f16);
        let mut a: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0f32..1.0)).collect();
        a[k + 7] = f32::NAN;
        for path in QPath::available() {
            let mut out = vec![0f32; m * n];
            matmul_with(path, f, m, n, k, &a, k, &w, &mut out, n).unwrap();
            assert!(out[..n].iter().all(|v| v.is_finite()), "{f} {path:?}: row 0 {:?}", &out[..n]);
            assert!(out[n..].iter().all(|v| v.is_nan()), "{f} {path:?}: row 1 {:?}", &out[n..]);
        }
    }
}

#[test]
fn gather_matches_dequantize_row() {
    let mut r = StdRng::seed_from_u64(6);
    for f in QFormat::ALL {
        let dim = f.block_elems() * 3;
        let vocab = 50;
        let rb = f.row_bytes(dim).unwrap();
        let table = random_blocks(f, &mut r, vocab * 3, any_f16);
        let ids: Vec<i32> = (0..37).map(|_| r.random_range(0..vocab as i32)).collect();
        let mut got = vec![f32::NAN; ids.len() * dim];
        gather_rows(f, &table, dim, ids.iter().map(|&i| i as i64), &mut got).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            let mut want = vec![0f32; dim];
            dequantize_row(f, &table[id as usize * rb..(id as usize + 1) * rb], &mut want).unwrap();
            assert!(got[t * dim..(t + 1) * dim].iter().zip(&want).all(|(a, b)| a == b), "{f}: row {t} (id {id})");
        }
        // Out-of-range ids are errors and nothing is written.
        for bad in [-1i64, vocab as i64, i64::MAX, i64::MIN] {
            let mut out = vec![f32::NAN; 2 * dim];
            assert!(gather_rows(f, &table, dim, [0, bad], &mut out).is_err(), "{f}: id {bad}");
            assert!(out.iter().all(|v| v.is_nan()));
        }
    }
}

#[test]
fn bad_arguments_are_errors() {
    let mut r = StdRng::seed_from_u64(7);
    for f in QFormat::ALL {
        let be = f.block_elems();
        let (m, n, k) = (2, 3, 2 * be);
        let rb = f.row_bytes(k).unwrap();
        let w = random_blocks(f, &mut r, n * 2, moderate_f16);
        let a = vec![0.5f32; m * k];
        let mut out = vec![0f32; m * n];
        let mut paths = QPath::available();
        paths.push(QPath::Scalar);
        for path in paths {
            let mm = |m: usize, n: usize, k: usize, a: &[f32], lda: usize, w: &[u8], out: &mut [f32], ldo: usize| {
                let fast = matmul_with(path, f, m, n, k, a, lda, w, out, ldo);
                let oracle = matmul_reference(f, m, n, k, a, lda, w, out, ldo);
                assert_eq!(fast.is_err(), oracle.is_err(), "{f}: fast and oracle disagree on validity: {fast:?} / {oracle:?}");
                fast
            };
            assert!(mm(m, n, k, &a, k, &w, &mut out, n).is_ok());
            assert!(mm(m, n, k + 1, &a, k + 1, &w, &mut out, n).is_err(), "k not a whole number of blocks");
            assert!(mm(m, n, k, &a[..m * k - 1], k, &w, &mut out, n).is_err(), "a too short");
            assert!(mm(m, n, k, &a, k - 1, &w, &mut out, n).is_err(), "lda < k");
            assert!(mm(m, n, k, &a, k, &w[..n * rb - 1], &mut out, n).is_err(), "w too short");
            assert!(mm(m, n, k, &a, k, &w, &mut out[..m * n - 1], n).is_err(), "out too short");
            assert!(mm(m, n, k, &a, k, &w, &mut out, n - 1).is_err(), "ldo < n");
            assert!(mm(m, usize::MAX, k, &a, k, &w, &mut out, usize::MAX).is_err(), "n overflows");
            assert!(mm(usize::MAX, n, k, &a, k, &w, &mut out, n).is_err(), "m overflows");
            assert!(mm(m, n, k, &a, usize::MAX, &w, &mut out, n).is_err(), "lda overflows");
            // Empty shapes are fine; k = 0 writes zeros.
            assert!(mm(0, n, k, &[], 0, &w, &mut [], 0).is_ok());
            assert!(mm(m, 0, k, &a, k, &[], &mut [], 0).is_ok());
            let mut z = vec![1f32; m * n];
            assert!(mm(m, n, 0, &[], 0, &[], &mut z, n).is_ok());
            assert!(z.iter().all(|&v| v == 0.0));
            // One row: a needs only k elements.
            assert!(mm(1, n, k, &a[..k], 0, &w, &mut out[..n], 0).is_err(), "lda < k even for one row");
            assert!(mm(1, n, k, &a[..k], k, &w, &mut out[..n], n).is_ok());
        }

        let mut y = vec![0f32; k];
        assert!(dequantize_row(f, &w[..rb], &mut y).is_ok());
        assert!(dequantize_row(f, &w[..rb - 1], &mut y).is_err());
        assert!(dequantize_row(f, &w[..rb + 1], &mut y).is_err());
        assert!(dequantize_row(f, &w[..rb], &mut y[..k - 1]).is_err());
        assert!(quantize_row(f, &y[..k - 1]).is_err());
        let mut nan = vec![0.0f32; k];
        nan[3] = f32::NAN;
        assert!(quantize_row(f, &nan).is_err());
        nan[3] = f32::INFINITY;
        assert!(quantize_row(f, &nan).is_err());
        assert!(quantize_row(f, &[]).unwrap().is_empty());

        let table = &w[..2 * rb];
        let mut g = vec![0f32; 2 * k];
        assert!(gather_rows(f, table, k, [1, 0], &mut g).is_ok());
        assert!(gather_rows(f, table, k, [1, 2], &mut g).is_err(), "id = rows");
        assert!(gather_rows(f, table, k, [1], &mut g).is_err(), "dst size");
        assert!(gather_rows(f, &table[..2 * rb - 1], k, [0, 0], &mut g).is_err(), "table not whole rows");
        assert!(gather_rows(f, table, k + 1, [0, 0], &mut g).is_err(), "dim not whole blocks");
        assert!(gather_rows(f, table, 0, [0, 0], &mut g).is_err(), "dim 0");
    }
    for path in [QPath::Avx2, QPath::Avx512] {
        if !path.supported() {
            let mut out = [0f32; 1];
            assert!(matmul_with(path, QFormat::Q8_0, 1, 1, 32, &[0.0; 32], 32, &[0; 34], &mut out, 1).is_err());
        }
    }
}

/// Decode-shape timings (m = 1) per kernel, and a prefill shape; best and
/// median of single calls (the best is the steadier figure on a shared
/// machine): `cargo test --release -p rlx-cpu --test quant -- --ignored --nocapture`.
#[test]
#[ignore]
fn speed() {
    let mut r = StdRng::seed_from_u64(8);
    // Called from inside a pool, as the backend does (a call from outside
    // also pays for waking the pool).
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    let threads = pool.current_num_threads();
    for (f, m, n, k) in [
        (QFormat::Q4_1, 1, 1536, 576),
        (QFormat::Q4_1, 1, 49152, 576),
        (QFormat::Q8_0, 1, 1536, 576),
        (QFormat::Q8_0, 1, 49152, 576),
        (QFormat::Q4_0, 1, 1536, 576),
        (QFormat::Q5_0, 1, 1536, 576),
        (QFormat::Q5_1, 1, 1536, 576),
        (QFormat::Q8_0, 1, 1536, 1536),
        (QFormat::Q4K, 1, 1536, 1536),
        (QFormat::Q6K, 1, 1536, 1536),
        (QFormat::Q4K, 1, 49152, 768),
        (QFormat::Q6K, 1, 49152, 768),
        (QFormat::Q4_1, 64, 1536, 576),
        (QFormat::Q8_0, 64, 1536, 576),
        (QFormat::Q4_1, 128, 576, 576),
        (QFormat::Q5_0, 128, 1536, 576),
        (QFormat::Q5_0, 128, 3072, 576),
        (QFormat::Q4K, 128, 576, 1536),
        (QFormat::Q6K, 128, 576, 1536),
    ] {
        let w = random_blocks(f, &mut r, n * k / f.block_elems(), moderate_f16);
        let a: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let mut out = vec![0f32; m * n];
        for path in QPath::available() {
            let calls = ((if path == QPath::Scalar { 2e8 } else { 2e9 }) / (m * n * k) as f64).clamp(5.0, 3000.0) as usize;
            let mut times: Vec<f64> = pool.install(|| {
                (0..calls)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        matmul_with(path, f, m, n, k, &a, k, &w, &mut out, n).unwrap();
                        t.elapsed().as_secs_f64()
                    })
                    .collect()
            });
            times.sort_by(f64::total_cmp);
            let (best, median) = (times[0], times[times.len() / 2]);
            println!(
                "{f} m={m:<3} n={n:<6} k={k:<5} {:<7} best {:>8.1} µs ({:>5.1} GB/s of weights, {:>6.1} GFLOP/s)  median {:>8.1} µs  [{threads} threads]",
                format!("{path:?}"),
                best * 1e6,
                w.len() as f64 / best / 1e9,
                2.0 * (m * n * k) as f64 / best / 1e9,
                median * 1e6,
            );
        }
    }
}

/// The AVX-512 and AVX2 kernels of the 32-element block formats do the
/// same integer sums and the same f32 operations lane for lane (AVX-512
/// takes two blocks a pass in the halves of one register), so they give
/// the same bits: one activation row (two columns a pass and an odd one
/// left over), two, four and eight rows a pass (and the rows left over),
/// odd block counts.
#[test]
fn avx512_and_avx2_kernels_agree_bit_for_bit() {
    if !QPath::Avx512.supported() {
        println!("SKIPPED avx512_and_avx2_kernels_agree_bit_for_bit: this CPU has no AVX-512");
        return;
    }
    let mut r = StdRng::seed_from_u64(21);
    for f in QFormat::ALL.into_iter().filter(|f| f.block_elems() == 32) {
        for &(m, n, k) in &[
            (1, 33, 32),
            (1, 33, 160),
            (1, 70, 576),
            (2, 19, 96),
            (3, 40, 160),
            (5, 12, 1536),
            (4, 300, 544),
            (7, 21, 96),
            (9, 40, 160),
            (12, 17, 576),
        ] {
            let p = problem(&mut r, f, m, n, k, n % 2 == 0);
            let (wide, narrow) = (p.run(Some(QPath::Avx512)), p.run(Some(QPath::Avx2)));
            for (o, (a, b)) in wide.iter().zip(&narrow).enumerate() {
                assert!(a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()), "{f} m={m} n={n} k={k}: output {o}: {a} vs {b}");
            }
        }
    }
}
