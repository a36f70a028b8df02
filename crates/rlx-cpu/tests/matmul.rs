//! MatMul against an f64 reference: random shapes, strided a (lda > k),
//! transposed and batch-shared b, bias / activation / residual epilogues,
//! residual in place, f32 (tol 1e-4) and f16/bf16 (tol 1e-2).

mod reference;

use rand::Rng;
use reference::*;
use rlx_ir::{Activation, DType};
use rlx_schedule::{MatMulThunk, Thunk};

const ACTS: [Activation; 5] = [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu, Activation::Tanh];

fn case(seed: u64, dtype: DType) {
    let mut r = rng(seed);
    let batch = r.random_range(1..4);
    let (m, n, k) = (r.random_range(1..40), r.random_range(1..40), r.random_range(1..70));
    let lda = k + if r.random_bool(0.5) { r.random_range(1..9) } else { 0 };
    let b_trans = r.random_bool(0.5);
    let shared_b = r.random_bool(0.5);
    let ldb = if b_trans { k } else { n } + if r.random_bool(0.3) { 3 } else { 0 };
    let b_rows = if b_trans { n } else { k };
    let a_batch_stride = m * lda;
    let b_batch = if shared_b { 1 } else { batch };
    let b_batch_stride = if shared_b { 0 } else { b_rows * ldb };
    let bias = r.random_bool(0.5);
    let act = if r.random_bool(0.5) { Some(ACTS[r.random_range(0..5)]) } else { None };
    let residual = r.random_bool(0.5);
    let in_place = residual && r.random_bool(0.5);

    let a_vals = values(&mut r, batch * a_batch_stride, dtype);
    let b_vals = values(&mut r, b_batch * b_rows * ldb, dtype);
    let bias_vals = values(&mut r, n, dtype);
    let res_vals = values(&mut r, batch * m * n, dtype);

    let mut p = Plan::new();
    let a = p.input("a", &[batch * a_batch_stride], dtype);
    // A shared b is a weight (the usual case); a batched one an activation.
    let b = if shared_b { p.weight("b", tensor(&[b_rows * ldb], dtype, &b_vals)) } else { p.input("b", &[b_vals.len()], dtype) };
    let bias_buf = bias.then(|| p.weight("bias", tensor(&[n], dtype, &bias_vals)));
    let res_buf = residual.then(|| p.input("res", &[batch * m * n], dtype));
    let out = match (in_place, res_buf) {
        (true, Some(rb)) => {
            p.output_at("out", &[batch * m * n], dtype, rb);
            rb
        }
        _ => p.output("out", &[batch * m * n], dtype),
    };
    p.push(Thunk::MatMul(MatMulThunk {
        dtype,
        batch,
        m,
        n,
        k,
        a,
        lda: lda as u64,
        a_batch_stride: a_batch_stride as u64,
        b,
        b_trans,
        ldb: ldb as u64,
        b_batch_stride: b_batch_stride as u64,
        bias: bias_buf,
        act,
        residual: res_buf,
        out,
    }));

    let mut want = vec![0f64; batch * m * n];
    for bi in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for kk in 0..k {
                    let av = a_vals[bi * a_batch_stride + i * lda + kk];
                    let boff = bi * b_batch_stride;
                    let bv = if b_trans { b_vals[boff + j * ldb + kk] } else { b_vals[boff + kk * ldb + j] };
                    s += av * bv;
                }
                if bias {
                    s += bias_vals[j];
                }
                if let Some(a) = act {
                    s = act_ref(a, s);
                }
                if residual {
                    s += res_vals[(bi * m + i) * n + j];
                }
                want[(bi * m + i) * n + j] = s;
            }
        }
    }
    let at = tensor(&[a_vals.len()], dtype, &a_vals);
    let bt = tensor(&[b_vals.len()], dtype, &b_vals);
    let rt = tensor(&[res_vals.len()], dtype, &res_vals);
    let mut inputs: Vec<(&str, &rlx_runtime::Tensor)> = vec![("a", &at)];
    if !shared_b {
        inputs.push(("b", &bt));
    }
    if residual {
        inputs.push(("res", &rt));
    }
    let got = p.run(&inputs).expect("matmul runs");
    let what = format!("seed {seed} {dtype} b{batch} m{m} n{n} k{k} lda{lda} bt{b_trans} shared{shared_b} bias{bias} {act:?} res{residual} inplace{in_place}");
    assert_close(&got[0], &want, tol(dtype, TOL_MATMUL), &what);
}

#[test]
fn matmul_f32_random() {
    for seed in 0..60 {
        case(seed, DType::F32);
    }
}

#[test]
fn matmul_f16_bf16_random() {
    for seed in 100..130 {
        case(seed, DType::F16);
        case(seed, DType::BF16);
    }
}

/// A shape big enough that gemm runs multi-threaded and packs its operands.
#[test]
fn matmul_f32_large() {
    let (m, n, k) = (130, 200, 300);
    let mut r = rng(7);
    let a_vals = values(&mut r, m * k, DType::F32);
    let b_vals = values(&mut r, n * k, DType::F32);
    let mut p = Plan::new();
    let a = p.input("a", &[m, k], DType::F32);
    let b = p.weight("w", tensor(&[n, k], DType::F32, &b_vals));
    let out = p.output("out", &[m, n], DType::F32);
    p.push(Thunk::MatMul(MatMulThunk {
        dtype: DType::F32,
        batch: 1,
        m,
        n,
        k,
        a,
        lda: k as u64,
        a_batch_stride: (m * k) as u64,
        b,
        b_trans: true,
        ldb: k as u64,
        b_batch_stride: 0,
        bias: None,
        act: Some(Activation::Gelu),
        residual: None,
        out,
    }));
    let want: Vec<f64> = (0..m * n)
        .map(|x| {
            let (i, j) = (x / n, x % n);
            act_ref(Activation::Gelu, (0..k).map(|kk| a_vals[i * k + kk] * b_vals[j * k + kk]).sum())
        })
        .collect();
    let at = tensor(&[m, k], DType::F32, &a_vals);
    let got = p.run(&[("a", &at)]).expect("runs");
    assert_close(&got[0], &want, TOL_MATMUL, "large gelu matmul");
}

/// Half-precision storage at a size where the work is split across
/// threads, with every epilogue part, b a transposed weight (f32 cache).
#[test]
fn matmul_half_large_with_epilogue() {
    for dtype in [DType::F16, DType::BF16] {
        let (m, n, k) = (70, 200, 96);
        let mut r = rng(21);
        let a_vals = values(&mut r, m * k, dtype);
        let b_vals = values(&mut r, n * k, dtype);
        let bias_vals = values(&mut r, n, dtype);
        let res_vals = values(&mut r, m * n, dtype);
        let mut p = Plan::new();
        let a = p.input("a", &[m, k], dtype);
        let b = p.weight("w", tensor(&[n, k], dtype, &b_vals));
        let bias = p.weight("bias", tensor(&[n], dtype, &bias_vals));
        let res = p.input("res", &[m, n], dtype);
        let out = p.output("out", &[m, n], dtype);
        p.push(Thunk::MatMul(MatMulThunk {
            dtype,
            batch: 1,
            m,
            n,
            k,
            a,
            lda: k as u64,
            a_batch_stride: (m * k) as u64,
            b,
            b_trans: true,
            ldb: k as u64,
            b_batch_stride: 0,
            bias: Some(bias),
            act: Some(Activation::Gelu),
            residual: Some(res),
            out,
        }));
        let want: Vec<f64> = (0..m * n)
            .map(|x| {
                let (i, j) = (x / n, x % n);
                let s: f64 = (0..k).map(|kk| a_vals[i * k + kk] * b_vals[j * k + kk]).sum();
                act_ref(Activation::Gelu, s + bias_vals[j]) + res_vals[x]
            })
            .collect();
        let (at, rt) = (tensor(&[m, k], dtype, &a_vals), tensor(&[m, n], dtype, &res_vals));
        let got = p.run(&[("a", &at), ("res", &rt)]).expect("runs");
        assert_close(&got[0], &want, TOL_HALF, &format!("large {dtype} matmul"));
    }
}
