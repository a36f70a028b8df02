//! Every thunk kind, every float dtype, random (odd) shapes: the GPU against
//! the CPU backend, and replay against eager bit for bit.

mod common;

use common::*;
use rand::Rng;
use rlx_ir::{Activation, BinaryOp, DType, ReduceOp, RopeMode};
use rlx_runtime::Tensor;
use rlx_schedule::{AttentionThunk, MatMulThunk, RowsView, SeqView, Thunk};

fn bytes(shape: &[usize], dt: DType) -> u64 {
    (shape.iter().product::<usize>() * dt.size()) as u64
}

#[test]
fn matmul_epilogues_and_layouts() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(1);
    let acts =
        [None, Some(Activation::Gelu), Some(Activation::GeluTanh), Some(Activation::Silu), Some(Activation::Relu), Some(Activation::Tanh)];
    let mut case = 0;
    for dt in FLOATS {
        for (batch, m, n, k, b_trans, shared_b) in
            [(1, 7, 33, 19, false, true), (3, 13, 65, 70, true, true), (2, 5, 17, 40, false, false), (2, 9, 24, 31, true, false)]
        {
            for (ai, act) in acts.iter().enumerate() {
                case += 1;
                let bias = (case % 2) == 0 || ai > 0;
                let residual = case % 3 == 0;
                let mut sb = Sb::new();
                let a = sb.input("a", &[batch, m, k], dt);
                let bshape: Vec<usize> = match (shared_b, b_trans) {
                    (true, false) => vec![k, n],
                    (true, true) => vec![n, k],
                    (false, false) => vec![batch, k, n],
                    (false, true) => vec![batch, n, k],
                };
                let bb = if shared_b { sb.weight("w", &bshape, dt, &mut r) } else { sb.input("b", &bshape, dt) };
                let bias_buf = if bias { Some(sb.weight("bias", &[n], dt, &mut r)) } else { None };
                let res_buf = if residual { Some(sb.input("res", &[batch, m, n], dt)) } else { None };
                let out = sb.output("out", &[batch, m, n], dt);
                sb.thunk(Thunk::MatMul(MatMulThunk {
                    dtype: dt,
                    batch,
                    m,
                    n,
                    k,
                    a,
                    lda: k as u64,
                    a_batch_stride: (m * k) as u64,
                    b: bb,
                    b_trans,
                    ldb: if b_trans { k } else { n } as u64,
                    b_batch_stride: if shared_b { 0 } else { (k * n) as u64 },
                    bias: bias_buf,
                    act: *act,
                    residual: res_buf,
                    out,
                }));
                let mut inputs = vec![("a", rand_tensor(&mut r, &[batch, m, k], dt))];
                if !shared_b {
                    inputs.push(("b", rand_tensor(&mut r, &bshape, dt)));
                }
                if residual {
                    inputs.push(("res", rand_tensor(&mut r, &[batch, m, n], dt)));
                }
                let (s, w) = sb.finish();
                let what =
                    format!("matmul {dt} b{batch} {m}x{n}x{k} trans={b_trans} shared={shared_b} act={act:?} bias={bias} res={residual}");
                check(&what, &g, &s, &w, &named(inputs), (k as f64).sqrt() / 2.0);
            }
        }
    }
}

#[test]
fn binary_broadcast() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(2);
    for dt in FLOATS {
        for (op, shape) in
            [(BinaryOp::Add, [3usize, 5, 7]), (BinaryOp::Sub, [2, 1, 33]), (BinaryOp::Mul, [4, 9, 1]), (BinaryOp::Div, [1, 3, 129])]
        {
            let mut sb = Sb::new();
            let n: usize = shape.iter().product();
            let a = sb.input("a", &shape, dt);
            // b broadcasts along the middle axis: shape [d0, 1, d2].
            let bshape = [shape[0], 1, shape[2]];
            let bb = sb.input("b", &bshape, dt);
            let out = sb.output("out", &shape, dt);
            let a_strides = vec![(shape[1] * shape[2]) as u64, shape[2] as u64, 1];
            let b_strides = vec![shape[2] as u64, 0, 1];
            sb.thunk(Thunk::Binary { op, dtype: dt, out_shape: shape.to_vec(), a, a_strides, b: bb, b_strides, out });
            let mut bt = rand_tensor(&mut r, &bshape, dt);
            if op == BinaryOp::Div {
                // Keep divisors away from zero.
                let v: Vec<f32> = bt.to_f32().iter().map(|x| if x.abs() < 0.25 { 0.5 } else { *x }).collect();
                bt = Tensor::from_f32(bshape.to_vec(), &v).unwrap_or_else(|e| panic!("{e}")).to_dtype(dt);
            }
            let (s, w) = sb.finish();
            check(
                &format!("binary {op:?} {dt} {shape:?} ({n})"),
                &g,
                &s,
                &w,
                &named(vec![("a", rand_tensor(&mut r, &shape, dt)), ("b", bt)]),
                1.0,
            );
        }
    }
}

/// One Binary thunk: inputs "a" (dense, `shape`) and "b" (`bshape`, read
/// through `b_strides` over `shape`), output "out".
fn binary_schedule(
    op: BinaryOp,
    dt: DType,
    shape: &[usize],
    bshape: &[usize],
    b_strides: Vec<u64>,
) -> (std::sync::Arc<rlx_schedule::Schedule>, std::sync::Arc<rlx_runtime::WeightStore>) {
    let mut sb = Sb::new();
    let a = sb.input("a", shape, dt);
    let bb = sb.input("b", bshape, dt);
    let out = sb.output("out", shape, dt);
    let mut a_strides = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        a_strides[d] = a_strides[d + 1] * shape[d + 1] as u64;
    }
    sb.thunk(Thunk::Binary { op, dtype: dt, out_shape: shape.to_vec(), a, a_strides, b: bb, b_strides, out });
    sb.finish()
}

/// The broadcasts a BERT graph makes (position add, mask multiply, pooled
/// division), odd sizes: collapsed dims, 32-bit index kernel.
#[test]
fn binary_bert_broadcasts() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(12);
    // h = 48: whole 16-byte vectors per row (binary_vec where strides allow).
    for (dt, h) in FLOATS.into_iter().flat_map(|d| [(d, 47usize), (d, 48)]) {
        let (bs, s) = (5usize, 33usize);
        // (op, out shape, b shape, b strides over the out shape)
        type Case = (BinaryOp, Vec<usize>, Vec<usize>, Vec<u64>);
        let cases: [Case; 4] = [
            (BinaryOp::Add, vec![bs, s, h], vec![s, h], vec![0, h as u64, 1]),
            (BinaryOp::Add, vec![bs, s, h], vec![bs, s, h], vec![(s * h) as u64, h as u64, 1]),
            (BinaryOp::Mul, vec![bs, s, h], vec![bs, s, 1], vec![s as u64, 1, 0]),
            (BinaryOp::Div, vec![bs, h], vec![bs, 1], vec![1, 0]),
        ];
        for (op, shape, bshape, b_strides) in cases {
            let (sch, w) = binary_schedule(op, dt, &shape, &bshape, b_strides);
            let mut bt = rand_tensor(&mut r, &bshape, dt);
            if op == BinaryOp::Div {
                let v: Vec<f32> = bt.to_f32().iter().map(|x| if x.abs() < 0.25 { 0.5 } else { *x }).collect();
                bt = Tensor::from_f32(bshape.to_vec(), &v).unwrap_or_else(|e| panic!("{e}")).to_dtype(dt);
            }
            check(
                &format!("binary {op:?} {dt} {shape:?} by {bshape:?}"),
                &g,
                &sch,
                &w,
                &named(vec![("a", rand_tensor(&mut r, &shape, dt)), ("b", bt)]),
                1.0,
            );
        }
    }
}

/// `binary_vec` over more vectors than its grid has threads (132 SMs × 32
/// blocks × 256 threads ≈ 1.08M): threads go round the grid-stride loop a
/// second time, some of them only. A same-shape add and the position-style
/// broadcast, every float type.
#[test]
fn binary_vec_beyond_one_wave() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(13);
    let (bs, s, h) = (64usize, 128usize, 1160usize);
    for dt in FLOATS {
        for bshape in [vec![bs, s, h], vec![s, h]] {
            let shape = vec![bs, s, h];
            let b_strides = if bshape.len() == 3 { vec![(s * h) as u64, h as u64, 1] } else { vec![0, h as u64, 1] };
            let (sch, w) = binary_schedule(BinaryOp::Add, dt, &shape, &bshape, b_strides);
            let inputs = named(vec![("a", rand_tensor(&mut r, &shape, dt)), ("b", rand_tensor(&mut r, &bshape, dt))]);
            check(&format!("binary_vec Add {dt} {shape:?} by {bshape:?}"), &g, &sch, &w, &inputs, 1.0);
        }
    }
}

/// Masked mean (mean pooling) against the CPU: 32-column blocks with a
/// partial last one, sequences shorter and longer than the 8 warps, a row
/// with every token masked (zeros), fractional weights.
#[test]
fn masked_mean_matches_cpu() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(14);
    for dt in FLOATS {
        for (i, (batch, seq, dim)) in [(1, 128, 384), (3, 5, 40), (32, 128, 768), (2, 300, 33)].into_iter().enumerate() {
            // Odd cases: an f32 mask and an f32 output (BERT after the precision pass).
            let (mdt, odt) = if i % 2 == 1 { (DType::F32, DType::F32) } else { (dt, dt) };
            let mut sb = Sb::new();
            let x = sb.input("x", &[batch, seq, dim], dt);
            let m = sb.input("m", &[batch, seq], mdt);
            let out = sb.output("out", &[batch, dim], odt);
            sb.thunk(Thunk::MaskedMean { dtype: dt, mask_dtype: mdt, out_dtype: odt, batch, seq, dim, x, mask: m, out });
            let (sch, w) = sb.finish();
            let mask: Vec<f32> = (0..batch * seq)
                .map(|i| {
                    if i / seq == 1 || r.random_bool(0.25) {
                        0.0
                    } else if i % 7 == 0 {
                        0.5
                    } else {
                        1.0
                    }
                })
                .collect();
            let mask = Tensor::from_f32(vec![batch, seq], &mask).unwrap_or_else(|e| panic!("{e}")).to_dtype(mdt);
            let inputs = named(vec![("x", rand_tensor(&mut r, &[batch, seq, dim], dt)), ("m", mask)]);
            check(&format!("masked_mean {dt} (mask {mdt}, out {odt}) [{batch}, {seq}, {dim}]"), &g, &sch, &w, &inputs, 1.0);
        }
    }
}

#[test]
fn activations_and_swiglu() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(3);
    for dt in FLOATS {
        for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu, Activation::Tanh] {
            let n = 1031;
            let mut sb = Sb::new();
            let x = sb.input("x", &[n], dt);
            let out = sb.output("out", &[n], dt);
            sb.thunk(Thunk::Activation { act, dtype: dt, n, x, out });
            let (s, w) = sb.finish();
            check(&format!("activation {act:?} {dt}"), &g, &s, &w, &named(vec![("x", rand_tensor(&mut r, &[n], dt))]), 1.0);
        }
        // SwiGLU over the two halves of one fused [rows, 2*cols] projection.
        let (rows, cols) = (7, 45);
        let mut sb = Sb::new();
        let gu = sb.input("gu", &[rows, 2 * cols], dt);
        let mut up = gu;
        up.offset += (cols * dt.size()) as u64;
        let out = sb.output("out", &[rows, cols], dt);
        sb.thunk(Thunk::SwiGlu {
            dtype: dt,
            rows,
            cols,
            gate: RowsView { buf: gu, row_stride: 2 * cols as u64 },
            up: RowsView { buf: up, row_stride: 2 * cols as u64 },
            out,
        });
        let (s, w) = sb.finish();
        check(&format!("swiglu {dt}"), &g, &s, &w, &named(vec![("gu", rand_tensor(&mut r, &[rows, 2 * cols], dt))]), 1.0);
    }
}

/// erfc in f64 to ~1e-11 relative (series below 2.5, continued fraction
/// above), so the reference GELU keeps its relative accuracy in the tail.
fn erfc64(z: f64) -> f64 {
    if z < 2.5 {
        let (mut sum, mut term) = (0.0f64, z);
        for n in 0..80 {
            sum += term / (2 * n + 1) as f64;
            term *= -z * z / (n + 1) as f64;
        }
        1.0 - 2.0 / std::f64::consts::PI.sqrt() * sum
    } else {
        let mut f = z;
        for k in (1..=80).rev() {
            f = z + (k as f64 / 2.0) / f;
        }
        (-z * z).exp() / (std::f64::consts::PI.sqrt() * f)
    }
}

fn gelu64(x: f64) -> f64 {
    let phi =
        if x >= 0.0 { 1.0 - 0.5 * erfc64(x * std::f64::consts::FRAC_1_SQRT_2) } else { 0.5 * erfc64(-x * std::f64::consts::FRAC_1_SQRT_2) };
    x * phi
}

/// The half types' cheaper erf-GELU (kernels/common.cuh, gelu_fast) must
/// round faithfully: every output within one f16/bf16 step of the exact
/// f64 GELU of its input, over the whole range where GELU is not 0 or x.
#[test]
fn gelu_half_types_round_faithfully() {
    assert!((erfc64(0.5) - 0.4795001221869535).abs() < 1e-12 && (erfc64(3.0) / 2.209049699858544e-5 - 1.0).abs() < 1e-9);
    let Some(Some(g)) = gpu_or_dry() else { return };
    let mut r = rng(31);
    for (dt, mant) in [(DType::F16, 10), (DType::BF16, 7)] {
        let n = 20011;
        // Down to -14: bf16 keeps GELU's tail to ~-13.6 (subnormals), where the
        // kernel's fit ends and it reads 0.
        let xs: Vec<f32> = (0..n).map(|i| -14.0 + 26.0 * i as f32 / n as f32 + r.random_range(-1e-3f32..1e-3)).collect();
        let x = Tensor::from_f32(vec![n], &xs).unwrap_or_else(|e| panic!("{e}")).to_dtype(dt);
        let mut sb = Sb::new();
        let xb = sb.input("x", &[n], dt);
        let out = sb.output("out", &[n], dt);
        sb.thunk(Thunk::Activation { act: Activation::Gelu, dtype: dt, n, x: xb, out });
        let (s, w) = sb.finish();
        let inputs = named(vec![("x", x.clone())]);
        let got = run(&g, &s, &w, &inputs, true).unwrap_or_else(|e| panic!("gelu {dt}: {e}"));
        let got = got[0].to_f32();
        for (i, (xi, yi)) in x.to_f32().iter().zip(&got).enumerate() {
            let want = gelu64(*xi as f64);
            // One step of the format at |want| (subnormal step for f16 below 2^-14;
            // bf16 shares f32's exponent range).
            let e = if want == 0.0 { -149 } else { want.abs().log2().floor() as i32 };
            let min_e = if dt == DType::F16 { -14 } else { -126 };
            let step = 2f64.powi(e.max(min_e) - mant);
            let d = (*yi as f64 - want).abs();
            assert!(d < step, "gelu {dt} element {i}: x {xi}: gpu {yi} vs exact {want:e} (|diff| {d:e} >= one step {step:e})");
        }
    }
}

/// The f16 erf-GELU (`gelu_fast<__half>` in kernels/common.cuh), evaluated
/// on the CPU as the GPU does (f32 fused multiply-adds, an exp2 that flushes
/// below 2^-126, the same select), rounds faithfully for every finite f16
/// input: within one f16 step of the f64 GELU. The coefficients are read
/// from the kernel source, so the check follows the code. Runs without a GPU.
#[test]
fn gelu_f16_fit_rounds_faithfully_for_every_input() {
    let src = include_str!("../kernels/common.cuh");
    let start = src.find("float gelu_fast<__half>(float x)").unwrap_or_else(|| panic!("gelu_fast<__half> not found in common.cuh"));
    let body = &src[start..start + src[start..].find("\n}\n").unwrap_or_else(|| panic!("end of gelu_fast<__half>"))];
    // Float literals in order: the clamp, the t scale, -1, then the
    // coefficients from the highest degree down up to the clamp's second use.
    let lits: Vec<f32> = body
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '-' || c == '+'))
        .filter_map(|w| w.strip_suffix('f'))
        .filter_map(|w| w.parse::<f32>().ok())
        .collect();
    let again = lits.iter().skip(1).position(|v| *v == lits[0]).map(|i| i + 1);
    let Some(end) = again.filter(|e| *e >= 5 && lits[2] == -1.0) else { panic!("float literals of gelu_fast<__half>: {lits:?}") };
    let (clamp, scale, coeffs) = (lits[0], lits[1], &lits[3..end]);
    let gelu = |x: f32| -> f32 {
        let a = x.abs().min(clamp);
        let t = a.mul_add(scale, -1.0);
        let q = coeffs[1..].iter().fold(coeffs[0], |q, c| q.mul_add(t, *c));
        let e = if q < -126.0 { 0.0 } else { 2f64.powf(q as f64) as f32 };
        let p = if a < clamp { e } else { 0.0 };
        x * if x >= 0.0 { 1.0 - p } else { p }
    };
    let mut worst = 0f64;
    for bits in 0..=u16::MAX {
        let xh = half::f16::from_bits(bits);
        if !xh.is_finite() {
            continue;
        }
        let x = f32::from(xh);
        let got = f64::from(f32::from(half::f16::from_f32(gelu(x))));
        let want = gelu64(x as f64);
        let e = if want == 0.0 { -149 } else { want.abs().log2().floor() as i32 };
        let step = 2f64.powi(e.max(-14) - 10);
        let steps = (got - want).abs() / step;
        assert!(steps < 1.0, "f16 GELU of {x}: {got:e} vs exact {want:e} ({steps:.3} steps)");
        worst = worst.max(steps);
    }
    assert!(worst > 0.0, "the check compared nothing");
}

#[test]
fn norms_softmax_reduce_argmax() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(4);
    for dt in FLOATS {
        // Block-per-row kernel (odd or long rows) and the warp-per-row kernel
        // (rows a multiple of 16 bytes: 1, 2, 3, 4, 6, 8 vectors per lane;
        // row counts that leave a block part empty).
        for (rms, with_res, rows, cols) in [
            (false, false, 5, 384),
            (false, true, 9, 771),
            (true, false, 3, 129),
            (true, true, 4, 64),
            (false, true, 3, 2050),
            (true, false, 2, 1500),
            (false, true, 37, 768),
            (true, true, 13, 1024),
            (false, false, 6, 2048),
            (false, true, 11, 1536),
            (false, true, 70, 256),
            (true, false, 5, 8),
        ] {
            let mut sb = Sb::new();
            let x = sb.input("x", &[rows, cols], dt);
            let residual = if with_res { Some(sb.input("res", &[rows, cols], dt)) } else { None };
            let gamma = sb.weight("gamma", &[cols], dt, &mut r);
            let beta = if rms { None } else { Some(sb.weight("beta", &[cols], dt, &mut r)) };
            let out = sb.output("out", &[rows, cols], dt);
            sb.thunk(Thunk::Norm { rms, dtype: dt, rows, cols, eps: 1e-5, x, residual, gamma, beta, out });
            let mut inputs = vec![("x", rand_tensor(&mut r, &[rows, cols], dt))];
            if with_res {
                inputs.push(("res", rand_tensor(&mut r, &[rows, cols], dt)));
            }
            let (s, w) = sb.finish();
            check(&format!("norm rms={rms} res={with_res} {dt} {rows}x{cols}"), &g, &s, &w, &named(inputs), 2.0);
        }
        // inner >= 32 takes the column-block reduction (mean pooling's shape).
        for (outer, len, inner) in [(3, 37, 1), (2, 300, 5), (1, 1000, 2), (3, 37, 40), (2, 129, 96), (5, 3, 33)] {
            let shape = [outer, len, inner];
            let mut sb = Sb::new();
            let x = sb.input("x", &shape, dt);
            let sm = sb.output("softmax", &shape, dt);
            let sum = sb.output("sum", &[outer, inner], dt);
            let mean = sb.output("mean", &[outer, inner], dt);
            let max = sb.output("max", &[outer, inner], dt);
            let am = sb.output("argmax", &[outer, inner], DType::I32);
            sb.thunk(Thunk::Softmax { dtype: dt, outer, len, inner, x, out: sm });
            sb.thunk(Thunk::Reduce { op: ReduceOp::Sum, dtype: dt, outer, len, inner, x, out: sum });
            sb.thunk(Thunk::Reduce { op: ReduceOp::Mean, dtype: dt, outer, len, inner, x, out: mean });
            sb.thunk(Thunk::Reduce { op: ReduceOp::Max, dtype: dt, outer, len, inner, x, out: max });
            sb.thunk(Thunk::ArgMax { dtype: dt, outer, len, inner, x, out: am });
            let (s, w) = sb.finish();
            check(
                &format!("softmax/reduce/argmax {dt} {shape:?}"),
                &g,
                &s,
                &w,
                &named(vec![("x", rand_tensor(&mut r, &shape, dt))]),
                (len as f64).sqrt(),
            );
        }
    }
}

#[test]
fn topk_runs_on_the_host_between_segments() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(5);
    for dt in FLOATS {
        let (rows, len, k) = (3, 257, 7);
        let mut sb = Sb::new();
        let x0 = sb.input("x", &[rows, len], dt);
        let x = sb.scratch(bytes(&[rows, len], dt));
        // A kernel before and after the host step: two replay segments.
        sb.thunk(Thunk::Activation { act: Activation::Tanh, dtype: dt, n: rows * len, x: x0, out: x });
        let values = sb.scratch(bytes(&[rows, k], dt));
        let indices = sb.output("indices", &[rows, k], DType::I32);
        sb.thunk(Thunk::TopK { dtype: dt, rows, len, k, x, values: Some(values), indices: Some(indices) });
        let out = sb.output("values2", &[rows, k], dt);
        sb.thunk(Thunk::Activation { act: Activation::Relu, dtype: dt, n: rows * k, x: values, out });
        let (s, w) = sb.finish();
        check(&format!("topk {dt}"), &g, &s, &w, &named(vec![("x", rand_tensor(&mut r, &[rows, len], dt))]), 1.0);
        if let Some(g) = &g {
            let e = g.prepare_cuda(s.clone(), w.clone(), &Default::default()).unwrap_or_else(|e| panic!("{e}"));
            let map = e.segment_map();
            assert!(map.contains("host") && map.matches("replay").count() >= 2, "expected replay/host/replay segments:\n{map}");
        }
    }
}

#[test]
fn gather_copy_cast() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(6);
    for dt in FLOATS {
        for id_dt in [DType::I32, DType::I64] {
            // dim 48: whole 16-byte chunks per row (gather_vec).
            for dim in [37usize, 48] {
                let (vocab, n) = (50, 11);
                let mut sb = Sb::new();
                let table = sb.weight("emb", &[vocab, dim], dt, &mut r);
                let ids = sb.input("ids", &[n], id_dt);
                let out = sb.output("out", &[n, dim], dt);
                sb.thunk(Thunk::Gather { dtype: dt, id_dtype: id_dt, n, dim, vocab, table, ids, out });
                let idv: Vec<i32> = (0..n).map(|_| r.random_range(0..vocab as i32)).collect();
                let ids_t = Tensor::from_i32(vec![n], &idv).unwrap_or_else(|e| panic!("{e}")).to_dtype(id_dt);
                let (s, w) = sb.finish();
                check(&format!("gather {dt} ids {id_dt} dim {dim}"), &g, &s, &w, &named(vec![("ids", ids_t)]), 1.0);
            }
        }
        // Transpose [4, 6, 5] -> [5, 4, 6] through a strided copy, then casts.
        let (a0, a1, a2) = (4usize, 6usize, 5usize);
        let mut sb = Sb::new();
        let x = sb.input("x", &[a0, a1, a2], dt);
        let t = sb.output("t", &[a2, a0, a1], dt);
        sb.thunk(Thunk::Copy {
            dtype: dt,
            shape: vec![a2, a0, a1],
            src: x,
            src_strides: vec![1, (a1 * a2) as u64, a2 as u64],
            dst: t,
            dst_strides: vec![(a0 * a1) as u64, a1 as u64, 1],
        });
        let n = a0 * a1 * a2;
        for (name, to) in [("to_f32", DType::F32), ("to_f16", DType::F16), ("to_bf16", DType::BF16), ("to_i32", DType::I32)] {
            let out = sb.output(name, &[n], to);
            sb.thunk(Thunk::Cast { from: dt, to, n, src: x, dst: out });
        }
        let ints = sb.input("ints", &[n], DType::I64);
        let back = sb.output("i64_to_this", &[n], dt);
        sb.thunk(Thunk::Cast { from: DType::I64, to: dt, n, src: ints, dst: back });
        let iv: Vec<i64> = (0..n).map(|_| r.random_range(-100..100)).collect();
        let (s, w) = sb.finish();
        let xt = Tensor::from_f32(vec![a0, a1, a2], &(0..n).map(|_| r.random_range(-9.0f32..9.0)).collect::<Vec<_>>())
            .unwrap_or_else(|e| panic!("{e}"))
            .to_dtype(dt);
        check(
            &format!("copy/cast {dt}"),
            &g,
            &s,
            &w,
            &named(vec![("x", xt), ("ints", Tensor::from_i64(vec![n], &iv).unwrap_or_else(|e| panic!("{e}")))]),
            1.0,
        );
    }
}

/// LayerNorm(table[ids] + repeating addends) (`Thunk::EmbedNorm`, BERT's
/// embeddings) against the CPU: one warp per row where rows are whole
/// 16-byte vectors (384 and 768 columns; none, one or two addends of 1, S or
/// all rows; i32 and i64 ids), the gather + adds + norm kernels otherwise
/// (20 columns). A bad id is an error on both backends.
#[test]
fn embed_norm_matches_cpu() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(12);
    for dt in FLOATS {
        for (id_dt, rows, cols, periods) in [
            (DType::I32, 2 * 77, 384usize, vec![77usize, 1]),
            (DType::I64, 3 * 128, 768, vec![128]),
            (DType::I32, 64, 768, vec![]),
            (DType::I32, 40, 384, vec![40, 8]),
            (DType::I64, 15, 20, vec![5, 1]),
        ] {
            let vocab = 300;
            let mut sb = Sb::new();
            let table = sb.weight("emb", &[vocab, cols], dt, &mut r);
            let ids = sb.input("ids", &[rows], id_dt);
            let addends: Vec<(rlx_schedule::BufRef, usize)> =
                periods.iter().enumerate().map(|(k, &n)| (sb.weight(&format!("add{k}"), &[n, cols], dt, &mut r), n)).collect();
            let gamma = sb.weight("gamma", &[cols], dt, &mut r);
            let beta = sb.weight("beta", &[cols], dt, &mut r);
            let out = sb.output("out", &[rows, cols], dt);
            sb.thunk(Thunk::EmbedNorm { dtype: dt, id_dtype: id_dt, rows, cols, vocab, eps: 1e-12, table, ids, addends, gamma, beta, out });
            let (s, w) = sb.finish();
            let idv: Vec<i32> = (0..rows).map(|_| r.random_range(0..vocab as i32)).collect();
            let ids_t = |v: &[i32]| Tensor::from_i32(vec![rows], v).unwrap_or_else(|e| panic!("{e}")).to_dtype(id_dt);
            let what = format!("embed_norm {dt} ids {id_dt} rows {rows} cols {cols} addends {periods:?}");
            check(&what, &g, &s, &w, &named(vec![("ids", ids_t(&idv))]), 2.0);
            let mut bad = idv.clone();
            bad[rows / 2] = vocab as i32 + 3;
            if let Some(g) = &g {
                let e = run(g, &s, &w, &named(vec![("ids", ids_t(&bad))]), true).err().map(|e| e.to_string()).unwrap_or_default();
                assert!(e.contains("outside 0..vocab"), "{what}: {e}");
            }
        }
    }
}

#[test]
fn rope_both_modes() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(7);
    for dt in FLOATS {
        for (mode, per_batch, scaled) in
            [(RopeMode::RotateHalf, false, false), (RopeMode::Interleaved, true, false), (RopeMode::Interleaved, false, true)]
        {
            let (batch, seq, heads, hd) = (2, 9, 3, 32);
            let width = heads * hd;
            let mut sb = Sb::new();
            // x is the first third of a fused [batch, seq, 3*width] projection.
            let x = sb.input("qkv", &[batch, seq, 3 * width], dt);
            let pshape = if per_batch { vec![batch, seq] } else { vec![seq] };
            let positions = sb.input("pos", &pshape, DType::I32);
            let factors = scaled.then(|| sb.input("factors", &[hd / 2], DType::F32));
            let out = sb.output("out", &[batch, seq, width], dt);
            sb.thunk(Thunk::Rope {
                dtype: dt,
                mode,
                theta: 10000.0,
                batch,
                seq,
                heads,
                head_dim: hd,
                x: SeqView { buf: x, batch_stride: (seq * 3 * width) as u64, row_stride: (3 * width) as u64 },
                positions,
                positions_per_batch: per_batch,
                out,
                freq_factors: factors,
            });
            let pv: Vec<i32> = (0..pshape.iter().product::<usize>()).map(|_| r.random_range(0..200)).collect();
            let (s, w) = sb.finish();
            let mut inputs = vec![
                ("qkv", rand_tensor(&mut r, &[batch, seq, 3 * width], dt)),
                ("pos", Tensor::from_i32(pshape.clone(), &pv).unwrap_or_else(|e| panic!("{e}"))),
            ];
            if scaled {
                let f: Vec<f32> = (0..hd / 2).map(|_| r.random_range(1.0f32..8.0)).collect();
                inputs.push(("factors", Tensor::from_f32(vec![hd / 2], &f).unwrap_or_else(|e| panic!("{e}"))));
            }
            check(&format!("rope {mode:?} {dt} scaled {scaled}"), &g, &s, &w, &named(inputs), 2.0);
        }
    }
}

/// Attention with Q, K, V read out of one fused QKV tensor through strides.
#[allow(clippy::too_many_arguments)]
fn attention_case(
    g: &Option<rlx_cuda::CudaBackend>,
    r: &mut rand::rngs::StdRng,
    dt: DType,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    q_len: usize,
    kv_len: usize,
    causal: bool,
    mask: bool,
    valid: Option<i32>,
) {
    attention_case_at(g, r, dt, batch, heads, kv_heads, hd, q_len, kv_len, causal, mask, valid, 0)
}

/// As `attention_case`; with `shift` > 0 (fused QKV only) Q, K and V start
/// `shift` elements into rows `shift` elements wider, so the kernels' aligned
/// 16-byte paths must not be taken.
#[allow(clippy::too_many_arguments)]
fn attention_case_at(
    g: &Option<rlx_cuda::CudaBackend>,
    r: &mut rand::rngs::StdRng,
    dt: DType,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    q_len: usize,
    kv_len: usize,
    causal: bool,
    mask: bool,
    valid: Option<i32>,
    shift: usize,
) {
    attention_case_full(g, r, dt, (batch, heads, kv_heads, hd, q_len, kv_len), causal, mask, valid, shift, false)
}

/// As `attention_case_at`; with `poison`, Q, K and V are separate tensors
/// and every K and V row of a key that is masked or past the valid length
/// is NaN: no output may see it (the CPU zeroes such rows).
#[allow(clippy::too_many_arguments)]
fn attention_case_full(
    g: &Option<rlx_cuda::CudaBackend>,
    r: &mut rand::rngs::StdRng,
    dt: DType,
    shape: (usize, usize, usize, usize, usize, usize),
    causal: bool,
    mask: bool,
    valid: Option<i32>,
    shift: usize,
    poison: bool,
) {
    let scale = 1.0 / (shape.3 as f32).sqrt();
    attention_case_scaled(g, r, dt, shape, causal, mask, valid, shift, poison, scale);
}

#[allow(clippy::too_many_arguments)]
fn attention_case_scaled(
    g: &Option<rlx_cuda::CudaBackend>,
    r: &mut rand::rngs::StdRng,
    dt: DType,
    (batch, heads, kv_heads, hd, q_len, kv_len): (usize, usize, usize, usize, usize, usize),
    causal: bool,
    mask: bool,
    valid: Option<i32>,
    shift: usize,
    poison: bool,
    scale: f32,
) {
    let qw = heads * hd;
    let kw = kv_heads * hd;
    let row = if q_len == kv_len && !poison { qw + 2 * kw + shift } else { 0 };
    let mut sb = Sb::new();
    let (q, k, v);
    let mut inputs = Vec::new();
    if row > 0 {
        let qkv = sb.input("qkv", &[batch, q_len, row], dt);
        inputs.push(("qkv", rand_tensor(r, &[batch, q_len, row], dt)));
        let view = |off: usize| SeqView {
            // The view ends where the fused tensor ends.
            buf: rlx_schedule::BufRef { offset: qkv.offset + (off * dt.size()) as u64, bytes: qkv.bytes - (off * dt.size()) as u64, ..qkv },
            batch_stride: (q_len * row) as u64,
            row_stride: row as u64,
        };
        (q, k, v) = (view(shift), view(shift + qw), view(shift + qw + kw));
    } else {
        let qb = sb.input("q", &[batch, q_len, qw], dt);
        let kb = sb.input("k", &[batch, kv_len, kw], dt);
        let vb = sb.input("v", &[batch, kv_len, kw], dt);
        inputs.push(("q", rand_tensor(r, &[batch, q_len, qw], dt)));
        inputs.push(("k", rand_tensor(r, &[batch, kv_len, kw], dt)));
        inputs.push(("v", rand_tensor(r, &[batch, kv_len, kw], dt)));
        q = SeqView { buf: qb, batch_stride: (q_len * qw) as u64, row_stride: qw as u64 };
        k = SeqView { buf: kb, batch_stride: (kv_len * kw) as u64, row_stride: kw as u64 };
        v = SeqView { buf: vb, batch_stride: (kv_len * kw) as u64, row_stride: kw as u64 };
    }
    let mask_buf = if mask {
        let m = sb.input("mask", &[batch, kv_len], DType::F32);
        // Each batch row keeps a random-length prefix of keys (at least one).
        let mut mv = vec![0f32; batch * kv_len];
        for b in 0..batch {
            let keep = r.random_range(1..=kv_len);
            for j in 0..keep {
                mv[b * kv_len + j] = 1.0;
            }
        }
        inputs.push(("mask", Tensor::from_f32(vec![batch, kv_len], &mv).unwrap_or_else(|e| panic!("{e}"))));
        Some(m)
    } else {
        None
    };
    if poison {
        let masked: Vec<bool> = match inputs.iter().find(|(n, _)| *n == "mask") {
            Some((_, m)) => m.to_f32().iter().map(|x| *x == 0.0).collect(),
            None => vec![false; batch * kv_len],
        };
        let cut = valid.map(|v| v as usize).unwrap_or(kv_len);
        for name in ["k", "v"] {
            let Some((_, t)) = inputs.iter_mut().find(|(n, _)| *n == name) else { continue };
            let mut vals = t.to_f32();
            for (i, x) in vals.iter_mut().enumerate() {
                let (b, j) = (i / (kv_len * kw), (i / kw) % kv_len);
                if masked[b * kv_len + j] || j >= cut {
                    *x = f32::NAN;
                }
            }
            *t = Tensor::from_f32(vec![batch, kv_len, kw], &vals).unwrap_or_else(|e| panic!("{e}")).to_dtype(dt);
        }
    }
    let valid_buf = valid.map(|vl| {
        let b = sb.input("valid", &[1], DType::I32);
        inputs.push(("valid", Tensor::from_i32(vec![1], &[vl]).unwrap_or_else(|e| panic!("{e}"))));
        b
    });
    let out = sb.output("out", &[batch, q_len, qw], dt);
    sb.thunk(Thunk::Attention(AttentionThunk {
        dtype: dt,
        kv_dtype: dt,
        batch,
        heads,
        kv_heads,
        head_dim: hd,
        q_len,
        kv_len,
        scale,
        causal,
        q,
        k,
        v,
        mask: mask_buf,
        mask_dtype: DType::F32,
        valid_len: valid_buf,
        valid_len_per_batch: false,
        out,
    }));
    let (s, w) = sb.finish();
    let what = format!(
        "attention {dt} b{batch} h{heads}/{kv_heads} hd{hd} q{q_len} kv{kv_len} causal={causal} mask={mask} valid={valid:?} shift={shift} poison={poison} scale={scale}"
    );
    check(&what, g, &s, &w, &named(inputs), 1.0);
}

#[test]
fn attention_masks_gqa_strides() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(8);
    for dt in FLOATS {
        attention_case(&g, &mut r, dt, 2, 4, 4, 32, 37, 37, false, true, None);
        attention_case(&g, &mut r, dt, 1, 6, 2, 64, 50, 50, true, false, None);
        attention_case(&g, &mut r, dt, 2, 2, 1, 80, 19, 19, true, true, None);
        attention_case(&g, &mut r, dt, 1, 2, 2, 128, 530, 530, false, true, None);
        // Decode-style: a few new queries against a longer cache with a valid length.
        attention_case(&g, &mut r, dt, 2, 4, 2, 64, 3, 600, true, false, Some(517));
        attention_case(&g, &mut r, dt, 1, 3, 3, 96, 1, 64, false, false, Some(40));
        // Grids of at least one 64-row block per SM: the tensor-core kernel (f16/bf16).
        attention_case(&g, &mut r, dt, 4, 8, 8, 64, 300, 300, false, true, None);
        attention_case(&g, &mut r, dt, 3, 12, 4, 80, 256, 256, true, true, None);
        // BERT's shape (12 heads of 64, 128 tokens, key padding) and the other
        // padded head dims on the tensor-core kernel; then a misaligned
        // fused QKV, which takes its element-by-element loads.
        attention_case(&g, &mut r, dt, 6, 12, 12, 64, 128, 128, false, true, None);
        attention_case(&g, &mut r, dt, 4, 16, 16, 32, 190, 190, false, true, None);
        attention_case(&g, &mut r, dt, 2, 8, 2, 128, 520, 520, true, false, None);
        attention_case(&g, &mut r, dt, 3, 16, 8, 48, 140, 140, false, true, None);
        attention_case_at(&g, &mut r, dt, 6, 12, 12, 64, 128, 128, false, true, None, 1);
        attention_case_at(&g, &mut r, dt, 3, 12, 4, 80, 256, 256, true, false, None, 3);
        // Batch 1 (16-row blocks whose warps split the keys, f16/bf16): BERT
        // and MiniLM shapes, misaligned, causal GQA with head dim 128, a
        // single decode row, and head dim 40 (not a multiple of 16: scalar kernel).
        attention_case(&g, &mut r, dt, 1, 12, 12, 64, 128, 128, false, true, None);
        attention_case(&g, &mut r, dt, 1, 12, 12, 32, 128, 128, false, true, None);
        attention_case_at(&g, &mut r, dt, 1, 12, 12, 64, 128, 128, false, true, None, 1);
        attention_case(&g, &mut r, dt, 1, 4, 2, 128, 37, 37, true, true, None);
        attention_case(&g, &mut r, dt, 1, 8, 2, 64, 1, 300, true, false, Some(250));
        attention_case(&g, &mut r, dt, 1, 2, 2, 40, 20, 20, false, true, None);
        // One query row (the decode kernel: a key per lane, 32 a warp): key
        // padding masks, GQA, several batch rows, odd head dims, long caches.
        attention_case(&g, &mut r, dt, 3, 6, 2, 80, 1, 333, true, true, None);
        attention_case(&g, &mut r, dt, 2, 9, 3, 64, 1, 1000, false, true, Some(777));
        attention_case(&g, &mut r, dt, 1, 4, 4, 128, 1, 3, false, false, None);
        attention_case(&g, &mut r, dt, 2, 2, 1, 20, 1, 45, true, true, None);
    }
}

/// 128-row blocks of 8 warps (`attention_mma_w8_*`): chosen where they fill
/// the SMs on their own (at least 132 blocks on the H200) and pad no more
/// rows than 64-row blocks. BERT's batch-32 shape in miniature, the same out
/// of a misaligned fused QKV, causal GQA at head dim 32 with an odd length,
/// head dim 80 (one tile buffer) over more than 512 keys (the key flags are
/// read in two chunks), and causal + valid length with separate Q, K, V.
#[test]
fn attention_128_row_blocks() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(9);
    for dt in FLOATS {
        attention_case(&g, &mut r, dt, 12, 12, 12, 64, 128, 128, false, true, None);
        attention_case_at(&g, &mut r, dt, 12, 12, 12, 64, 128, 128, false, true, None, 1);
        attention_case(&g, &mut r, dt, 6, 12, 4, 32, 250, 250, true, true, None);
        attention_case(&g, &mut r, dt, 1, 28, 4, 80, 600, 600, false, true, None);
        attention_case(&g, &mut r, dt, 11, 12, 6, 128, 128, 300, true, true, Some(290));
    }
}

/// Short key ranges (at most 128 keys, head dim up to 64) on grids that fill
/// the SMs: `attention_short_*`, which holds all of K and V in shared memory
/// and sweeps them in 32-key chunks. 128-row blocks (8 warps) with and
/// without rows past q_len, 64-row blocks, key counts that are not a
/// multiple of 32, causal GQA, padded head dim 48, a valid length with
/// NaN garbage past it, and a misaligned fused QKV (element loads).
#[test]
fn attention_short_key_ranges() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(11);
    for dt in FLOATS {
        attention_case(&g, &mut r, dt, 32, 12, 12, 64, 128, 128, false, true, None);
        attention_case(&g, &mut r, dt, 11, 12, 12, 64, 100, 100, false, true, None);
        attention_case(&g, &mut r, dt, 6, 12, 12, 32, 128, 128, false, true, None);
        attention_case(&g, &mut r, dt, 6, 12, 4, 32, 77, 77, true, true, None);
        attention_case(&g, &mut r, dt, 6, 12, 12, 48, 100, 128, true, false, Some(120));
        attention_case_at(&g, &mut r, dt, 12, 12, 12, 64, 128, 128, false, true, None, 1);
        attention_case_full(&g, &mut r, dt, (11, 12, 4, 32, 64, 128), true, true, Some(100), 0, true);
        attention_case_full(&g, &mut r, dt, (12, 12, 12, 64, 128, 128), false, true, None, 0, true);
    }
}

/// Scores spread over hundreds of log2 units (scale 6 instead of 1/8): the
/// short-range kernel's lazy softmax must move each row's base many times
/// within a row (new maxima in late chunks, rows whose first keys are
/// masked, causal rows), and still match the CPU. A scale that is not
/// positive takes the streaming kernel, which must agree too.
#[test]
fn attention_short_large_scores() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(12);
    for dt in FLOATS {
        attention_case_scaled(&g, &mut r, dt, (32, 12, 12, 64, 128, 128), false, true, None, 0, false, 6.0);
        attention_case_scaled(&g, &mut r, dt, (6, 12, 4, 32, 77, 77), true, true, None, 0, false, 6.0);
        attention_case_scaled(&g, &mut r, dt, (6, 12, 12, 64, 100, 128), true, false, Some(120), 0, true, 3.0);
        attention_case_scaled(&g, &mut r, dt, (12, 12, 12, 64, 128, 128), false, true, None, 0, true, -0.5);
    }
}

/// NaN in the K and V rows of masked keys and of keys past the valid
/// length (padding that holds garbage) never reaches an output, on every
/// attention kernel: 64-row tensor-core blocks, 128-row blocks, 16-row
/// split-key blocks at batch 1, and the scalar kernel (f32, head dim 40).
/// The CPU backend zeroes such rows; the GPU must match it, NaN-free.
#[test]
fn attention_masked_nan_rows_stay_out() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(10);
    for dt in FLOATS {
        for (shape, causal, mask, valid) in [
            ((4, 8, 8, 64, 300, 300), false, true, None),
            ((12, 12, 12, 64, 128, 128), false, true, None),
            ((1, 12, 12, 64, 128, 128), false, true, None),
            ((1, 12, 12, 32, 128, 128), false, true, None),
            ((2, 4, 2, 64, 3, 600), true, false, Some(517)),
            ((1, 2, 2, 40, 20, 20), false, true, None),
        ] {
            attention_case_full(&g, &mut r, dt, shape, causal, mask, valid, 0, true);
        }
    }
}

#[test]
fn write_state_then_read() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(9);
    for dt in FLOATS {
        let (batch, max_rows, new_rows, width) = (2, 10, 3, 17);
        let mut sb = Sb::new();
        let value = sb.input("value", &[batch, new_rows, width], dt);
        let pos = sb.input("pos", &[1], DType::I32);
        let state = sb.state("cache", &[batch, max_rows, width], dt);
        sb.thunk(Thunk::WriteState {
            dtype: dt,
            value_dtype: dt,
            batch,
            max_rows,
            new_rows,
            width,
            state,
            value,
            position: pos,
            positions_per_batch: false,
        });
        let out = sb.output("out", &[batch, max_rows, width], dt);
        sb.thunk(Thunk::Copy {
            dtype: dt,
            shape: vec![batch * max_rows * width],
            src: state,
            src_strides: vec![1],
            dst: out,
            dst_strides: vec![1],
        });
        let (s, w) = sb.finish();
        let v = rand_tensor(&mut r, &[batch, new_rows, width], dt);
        let p = Tensor::from_i32(vec![1], &[4]).unwrap_or_else(|e| panic!("{e}"));
        check(&format!("write_state {dt}"), &g, &s, &w, &named(vec![("value", v), ("pos", p)]), 1.0);
    }
}
