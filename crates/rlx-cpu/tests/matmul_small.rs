//! The few-row matmul path (b a transposed weight shared by every batch,
//! batch × m ≤ 128: dot products, no packing) against an f64 reference:
//! row counts on both sides of the cut-over, odd K (masked tail) and odd N
//! (short tiles, column blocks split across threads), lda > k, folded
//! batches, bias / activation / residual (also in place), f32 and f16/bf16.

mod reference;

use rand::Rng;
use reference::*;
use rlx_ir::{Activation, DType};
use rlx_schedule::{MatMulThunk, Thunk};

const ACTS: [Activation; 5] = [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu, Activation::Tanh];

struct Case {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    bias: bool,
    act: Option<Activation>,
    residual: bool,
    in_place: bool,
}

fn random_case(r: &mut rand::rngs::StdRng) -> Case {
    let batch = if r.random_bool(0.3) { r.random_range(2..5) } else { 1 };
    let m = r.random_range(1..=140usize.div_ceil(batch));
    let k = r.random_range(1..200);
    let n = r.random_range(1..150);
    let lda = k + if r.random_bool(0.5) { r.random_range(1..20) } else { 0 };
    let ldb = k + if r.random_bool(0.3) { r.random_range(1..5) } else { 0 };
    let residual = r.random_bool(0.5);
    Case {
        batch,
        m,
        n,
        k,
        lda,
        ldb,
        bias: r.random_bool(0.5),
        act: r.random_bool(0.5).then(|| ACTS[r.random_range(0..5)]),
        residual,
        in_place: residual && r.random_bool(0.5),
    }
}

fn check(seed: u64, dtype: DType, c: &Case) {
    check_b(seed, dtype, c, true)
}

/// `weight_b`: b is a weight (the executable packs it at prepare and the
/// broadcast kernel runs); otherwise an input (the dot kernel reads it in
/// place).
fn check_b(seed: u64, dtype: DType, c: &Case, weight_b: bool) {
    let mut r = rng(seed);
    let rows = c.batch * c.m;
    // a's batches lie a few elements apart, so folding them must follow
    // a_batch_stride rather than assume m * lda.
    let a_batch_stride = c.m * c.lda + 5;
    let a_vals = values(&mut r, c.batch * a_batch_stride, dtype);
    let b_vals = values(&mut r, c.n * c.ldb, dtype);
    let bias_vals = values(&mut r, c.n, dtype);
    let res_vals = values(&mut r, rows * c.n, dtype);

    let mut p = Plan::new();
    let a = p.input("a", &[a_vals.len()], dtype);
    let bt = tensor(&[b_vals.len()], dtype, &b_vals);
    let b = if weight_b { p.weight("w", bt.clone()) } else { p.input("w", &[b_vals.len()], dtype) };
    let bias_buf = c.bias.then(|| p.weight("bias", tensor(&[c.n], dtype, &bias_vals)));
    let res_buf = c.residual.then(|| p.input("res", &[rows * c.n], dtype));
    let out = match (c.in_place, res_buf) {
        (true, Some(rb)) => {
            p.output_at("out", &[rows * c.n], dtype, rb);
            rb
        }
        _ => p.output("out", &[rows * c.n], dtype),
    };
    p.push(Thunk::MatMul(MatMulThunk {
        dtype,
        batch: c.batch,
        m: c.m,
        n: c.n,
        k: c.k,
        a,
        lda: c.lda as u64,
        a_batch_stride: a_batch_stride as u64,
        b,
        b_trans: true,
        ldb: c.ldb as u64,
        b_batch_stride: 0,
        bias: bias_buf,
        act: c.act,
        residual: res_buf,
        out,
    }));

    let mut want = vec![0f64; rows * c.n];
    for row in 0..rows {
        let a_row = &a_vals[(row / c.m) * a_batch_stride + (row % c.m) * c.lda..][..c.k];
        for j in 0..c.n {
            let mut s: f64 = a_row.iter().zip(&b_vals[j * c.ldb..][..c.k]).map(|(x, y)| x * y).sum();
            if c.bias {
                s += bias_vals[j];
            }
            if let Some(a) = c.act {
                s = act_ref(a, s);
            }
            if c.residual {
                s += res_vals[row * c.n + j];
            }
            want[row * c.n + j] = s;
        }
    }
    let at = tensor(&[a_vals.len()], dtype, &a_vals);
    let rt = tensor(&[res_vals.len()], dtype, &res_vals);
    let mut inputs: Vec<(&str, &rlx_runtime::Tensor)> = vec![("a", &at)];
    if !weight_b {
        inputs.push(("w", &bt));
    }
    if c.residual {
        inputs.push(("res", &rt));
    }
    let got = p.run(&inputs).expect("matmul runs");
    let what = format!(
        "seed {seed} {dtype} b{} m{} n{} k{} lda{} ldb{} bias{} {:?} res{} inplace{} weight_b {weight_b}",
        c.batch, c.m, c.n, c.k, c.lda, c.ldb, c.bias, c.act, c.residual, c.in_place
    );
    assert_close(&got[0], &want, tol(dtype, TOL_MATMUL), &what);
}

#[test]
fn small_rows_f32_random() {
    for seed in 0..60 {
        let c = random_case(&mut rng(1000 + seed));
        check(seed, DType::F32, &c);
    }
}

/// b as an input rather than a weight: nothing to pack, the dot kernel.
#[test]
fn small_rows_unpacked_b_random() {
    for seed in 0..30 {
        let c = random_case(&mut rng(3000 + seed));
        check_b(seed, DType::F32, &c, false);
        if seed % 3 == 0 {
            check_b(seed, DType::BF16, &c, false);
        }
    }
}

#[test]
fn small_rows_half_random() {
    for seed in 0..20 {
        let c = random_case(&mut rng(2000 + seed));
        check(seed, DType::F16, &c);
        check(seed, DType::BF16, &c);
    }
}

/// Every row count from 1 to 136 (every short last tile, and the cut-over
/// to gemm), K a multiple of 16 plus 0 or 7 (masked tail), with the whole
/// epilogue, the residual in place.
#[test]
fn small_rows_every_m() {
    for m in 1..=136 {
        let k = if m % 2 == 0 { 64 } else { 71 };
        let c = Case { batch: 1, m, n: 37, k, lda: k + 3, ldb: k, bias: true, act: Some(Activation::Gelu), residual: true, in_place: true };
        check(m as u64, DType::F32, &c);
    }
}

/// MiniLM's shapes at 16 tokens: wide N (several column blocks per
/// thread) and long K.
#[test]
fn small_rows_minilm_shapes() {
    for (n, k, act) in [(1152, 384, None), (1536, 384, Some(Activation::Gelu)), (384, 1536, None)] {
        let c = Case { batch: 1, m: 16, n, k, lda: k, ldb: k, bias: true, act, residual: act.is_none(), in_place: act.is_none() };
        check(n as u64, DType::F32, &c);
    }
}

/// The packed kernel at many rows (it replaces gemm for weights at any row
/// count): several 192-row tasks per group and several 128-step k blocks
/// (a short last one), ragged N, batches folded, the whole epilogue.
#[test]
fn many_rows_packed_random() {
    for seed in 0..8 {
        let mut r = rng(4000 + seed);
        let batch = if seed % 2 == 0 { 1 } else { r.random_range(2..4) };
        let m = r.random_range(193..500usize) / batch;
        let k = r.random_range(129..420);
        let n = r.random_range(1..200);
        let residual = seed % 3 != 0;
        let c = Case {
            batch,
            m,
            n,
            k,
            lda: k + if seed % 2 == 0 { 5 } else { 0 },
            ldb: k,
            bias: seed % 4 != 1,
            act: (seed % 2 == 0).then(|| ACTS[seed as usize % 5]),
            residual,
            in_place: residual && seed % 2 == 1,
        };
        check(seed, if seed % 3 == 2 { DType::BF16 } else { DType::F32 }, &c);
    }
}
