//! Row kernels against f64 references: LayerNorm / RmsNorm (with residual,
//! in place), softmax, reduce, argmax, top-k. f32 tolerance 1e-5, f16/bf16
//! 1e-2.

mod reference;

use rand::Rng;
use reference::*;
use rlx_ir::{DType, ReduceOp};
use rlx_schedule::Thunk;

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn norms_random() {
    for seed in 0..36 {
        let mut r = rng(seed);
        let dtype = FLOATS[seed as usize % 3];
        let rms = seed % 2 == 0;
        let (rows, cols) = (r.random_range(1..40), r.random_range(1..800));
        let residual = r.random_bool(0.5);
        let with_beta = !rms;
        let in_place = r.random_bool(0.5);
        let eps = 1e-5f32;
        // An offset mean makes one-pass variance visibly wrong.
        let x: Vec<f64> = values(&mut r, rows * cols, dtype).iter().map(|v| round_to(v + 3.0, dtype)).collect();
        let res = values(&mut r, rows * cols, dtype);
        let gamma = values(&mut r, cols, dtype);
        let beta = values(&mut r, cols, dtype);
        let mut p = Plan::new();
        let xb = p.input("x", &[rows, cols], dtype);
        let rb = residual.then(|| p.input("r", &[rows, cols], dtype));
        let gb = p.weight("g", tensor(&[cols], dtype, &gamma));
        let bb = with_beta.then(|| p.weight("b", tensor(&[cols], dtype, &beta)));
        let out = if in_place {
            p.output_at("y", &[rows, cols], dtype, xb);
            xb
        } else {
            p.output("y", &[rows, cols], dtype)
        };
        p.push(Thunk::Norm { rms, dtype, rows, cols, eps, x: xb, residual: rb, gamma: gb, beta: bb, out });
        let mut want = vec![0f64; rows * cols];
        for i in 0..rows {
            let v: Vec<f64> = (0..cols).map(|j| x[i * cols + j] + if residual { res[i * cols + j] } else { 0.0 }).collect();
            let n = cols as f64;
            if rms {
                let ms = v.iter().map(|a| a * a).sum::<f64>() / n;
                for j in 0..cols {
                    want[i * cols + j] = v[j] / (ms + eps as f64).sqrt() * gamma[j];
                }
            } else {
                let mean = v.iter().sum::<f64>() / n;
                let var = v.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / n;
                for j in 0..cols {
                    want[i * cols + j] = (v[j] - mean) / (var + eps as f64).sqrt() * gamma[j] + beta[j];
                }
            }
        }
        let xt = tensor(&[rows, cols], dtype, &x);
        let rt = tensor(&[rows, cols], dtype, &res);
        let mut inputs = vec![("x", &xt)];
        if residual {
            inputs.push(("r", &rt));
        }
        let got = p.run(&inputs).expect("norm runs");
        assert_close(
            &got[0],
            &want,
            tol(dtype, TOL_ELEMENTWISE),
            &format!("seed {seed} rms {rms} {dtype} {rows}x{cols} res {residual} in_place {in_place}"),
        );
    }
}

/// [outer, len, inner] with random dims (inner 1 most of the time).
fn dims(r: &mut rand::rngs::StdRng) -> (usize, usize, usize) {
    (r.random_range(1..6), r.random_range(1..200), if r.random_bool(0.5) { 1 } else { r.random_range(1..5) })
}

fn line(x: &[f64], o: usize, i: usize, len: usize, inner: usize) -> Vec<f64> {
    (0..len).map(|j| x[(o * len + j) * inner + i]).collect()
}

#[test]
fn softmax_random() {
    for seed in 0..30 {
        let mut r = rng(seed);
        let dtype = FLOATS[seed as usize % 3];
        let (outer, len, inner) = dims(&mut r);
        let x: Vec<f64> = values(&mut r, outer * len * inner, dtype).iter().map(|v| round_to(v * 8.0, dtype)).collect();
        let mut p = Plan::new();
        let xb = p.input("x", &[outer, len, inner], dtype);
        let out = p.output("y", &[outer, len, inner], dtype);
        p.push(Thunk::Softmax { dtype, outer, len, inner, x: xb, out });
        let mut want = vec![0f64; x.len()];
        for o in 0..outer {
            for i in 0..inner {
                for (j, v) in softmax_ref(&line(&x, o, i, len, inner)).into_iter().enumerate() {
                    want[(o * len + j) * inner + i] = v;
                }
            }
        }
        let got = p.run(&[("x", &tensor(&[outer, len, inner], dtype, &x))]).expect("softmax runs");
        assert_close(&got[0], &want, tol(dtype, TOL_ELEMENTWISE), &format!("softmax seed {seed} {dtype} {outer}x{len}x{inner}"));
    }
}

#[test]
fn reduce_and_argmax_random() {
    for seed in 0..30 {
        let mut r = rng(seed);
        let dtype = FLOATS[seed as usize % 3];
        let (outer, len, inner) = dims(&mut r);
        // Few distinct values, so argmax sees ties.
        let x: Vec<f64> = (0..outer * len * inner).map(|_| r.random_range(-4..5) as f64 * 0.25).collect();
        let xt = tensor(&[outer, len, inner], dtype, &x);
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            let mut p = Plan::new();
            let xb = p.input("x", &[outer, len, inner], dtype);
            let out = p.output("y", &[outer, inner], dtype);
            p.push(Thunk::Reduce { op, dtype, outer, len, inner, x: xb, out });
            let want: Vec<f64> = (0..outer * inner)
                .map(|l| {
                    let v = line(&x, l / inner, l % inner, len, inner);
                    match op {
                        ReduceOp::Sum => v.iter().sum(),
                        ReduceOp::Mean => v.iter().sum::<f64>() / len as f64,
                        ReduceOp::Max => v.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                    }
                })
                .collect();
            let got = p.run(&[("x", &xt)]).expect("reduce runs");
            assert_close(&got[0], &want, tol(dtype, TOL_ELEMENTWISE), &format!("{op:?} seed {seed} {dtype}"));
        }
        let mut p = Plan::new();
        let xb = p.input("x", &[outer, len, inner], dtype);
        let out = p.output("y", &[outer, inner], DType::I32);
        p.push(Thunk::ArgMax { dtype, outer, len, inner, x: xb, out });
        let want: Vec<i32> = (0..outer * inner)
            .map(|l| {
                let v = line(&x, l / inner, l % inner, len, inner);
                let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                v.iter().position(|a| *a == m).unwrap_or(0) as i32
            })
            .collect();
        let got = p.run(&[("x", &xt)]).expect("argmax runs");
        assert_eq!(got[0].as_i32().expect("i32"), want, "argmax seed {seed}");
    }
}

#[test]
fn topk_random_with_ties() {
    for seed in 0..20 {
        let mut r = rng(seed);
        let dtype = FLOATS[seed as usize % 3];
        let (rows, len) = (r.random_range(1..8), r.random_range(1..100));
        let k = r.random_range(0..=len);
        let x: Vec<f64> = (0..rows * len).map(|_| r.random_range(-5..6) as f64 * 0.5).collect();
        let mut p = Plan::new();
        let xb = p.input("x", &[rows, len], dtype);
        let vb = p.output("v", &[rows, k], dtype);
        let ib = p.output("i", &[rows, k], DType::I32);
        p.push(Thunk::TopK { dtype, rows, len, k, x: xb, values: Some(vb), indices: Some(ib) });
        let mut wv = Vec::new();
        let mut wi = Vec::new();
        for row in 0..rows {
            let mut idx: Vec<usize> = (0..len).collect();
            // Stable sort: equal values keep ascending index order.
            idx.sort_by(|a, b| x[row * len + b].total_cmp(&x[row * len + a]));
            for &j in &idx[..k] {
                wv.push(x[row * len + j]);
                wi.push(j as i32);
            }
        }
        let got = p.run(&[("x", &tensor(&[rows, len], dtype, &x))]).expect("topk runs");
        assert_close(&got[0], &wv, 0.0, &format!("topk values seed {seed}"));
        assert_eq!(got[1].as_i32().expect("i32"), wi, "topk indices seed {seed}");
    }
}

/// ArgMax and TopK over integer data compare exactly (values past 2^24
/// that f32 could not tell apart).
#[test]
fn argmax_and_topk_on_integers() {
    let big = 1i64 << 40;
    for dtype in [DType::I32, DType::I64] {
        let base = if dtype == DType::I64 { big } else { 1 << 28 };
        let x: Vec<i64> = vec![base, base + 1, base - 3, base + 1, 7, base + 2];
        let (rows, len, k) = (2, 3, 2);
        let mut p = Plan::new();
        let xb = p.input("x", &[rows, len], dtype);
        let am = p.output("am", &[rows], DType::I32);
        let vb = p.output("v", &[rows, k], dtype);
        let ib = p.output("i", &[rows, k], DType::I32);
        p.push(Thunk::ArgMax { dtype, outer: rows, len, inner: 1, x: xb, out: am });
        p.push(Thunk::TopK { dtype, rows, len, k, x: xb, values: Some(vb), indices: Some(ib) });
        let got = p.run(&[("x", &ints(&[rows, len], dtype, &x))]).expect("runs");
        assert_eq!(got[0].as_i32().expect("i32"), vec![1, 2], "argmax {dtype}");
        assert_eq!(got[1], ints(&[rows, k], dtype, &[base + 1, base, base + 2, base + 1]), "topk values {dtype}");
        assert_eq!(got[2].as_i32().expect("i32"), vec![1, 0, 2, 0], "topk indices {dtype}");
    }
}

/// Masked mean (mean pooling) against f64: random shapes, 0/1 masks with
/// some rows all masked (zeros out, not NaN), fractional weights, and NaN
/// in masked positions of x (skipped, as masked tokens must not leak).
#[test]
fn masked_mean_random() {
    for seed in 0..24 {
        let mut r = rng(seed);
        let dtype = FLOATS[seed as usize % 3];
        let (batch, seq, dim) = (r.random_range(1..6), r.random_range(1..70), r.random_range(1..300));
        let mut x = values(&mut r, batch * seq * dim, dtype);
        let weights = seed % 4 == 3;
        let mask: Vec<f64> = (0..batch * seq)
            .map(|i| {
                let row_masked = (i / seq) == 1 && seed % 2 == 0;
                if row_masked || r.random_bool(0.3) {
                    0.0
                } else if weights {
                    round_to(r.random_range(0.1..2.0), dtype)
                } else {
                    1.0
                }
            })
            .collect();
        for (i, m) in mask.iter().enumerate() {
            if *m == 0.0 && i % 3 == 0 {
                x[i * dim] = f64::NAN;
            }
        }
        // Odd seeds: an f32 mask and an f32 output over a half-type x (as
        // the precision pass leaves BERT's mask and pooled output).
        let (mask_dtype, out_dtype) = if seed % 2 == 1 { (DType::F32, DType::F32) } else { (dtype, dtype) };
        let mut p = Plan::new();
        let xb = p.input("x", &[batch, seq, dim], dtype);
        let mb = p.input("m", &[batch, seq], mask_dtype);
        let out = p.output("y", &[batch, dim], out_dtype);
        p.push(Thunk::MaskedMean { dtype, mask_dtype, out_dtype, batch, seq, dim, x: xb, mask: mb, out });
        let want: Vec<f64> = (0..batch * dim)
            .map(|l| {
                let (b, d) = (l / dim, l % dim);
                let count: f64 = (0..seq).map(|s| mask[b * seq + s]).sum();
                let sum: f64 = (0..seq).filter(|s| mask[b * seq + s] != 0.0).map(|s| x[(b * seq + s) * dim + d] * mask[b * seq + s]).sum();
                sum / count.max(1e-9)
            })
            .collect();
        let got = p
            .run(&[("x", &tensor(&[batch, seq, dim], dtype, &x)), ("m", &tensor(&[batch, seq], mask_dtype, &mask))])
            .expect("masked_mean runs");
        assert_close(&got[0], &want, tol(dtype, TOL_ELEMENTWISE), &format!("masked_mean seed {seed} {dtype} [{batch}, {seq}, {dim}]"));
    }
}
