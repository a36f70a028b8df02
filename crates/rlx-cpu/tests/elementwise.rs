//! Elementwise kernels against f64 references: broadcasting binary ops
//! (size-1 dims, rank differences, in place), activations (and erf itself),
//! SwiGLU on strided halves, casts, strided copies. f32 tolerance 1e-5,
//! f16/bf16 1e-2.

mod reference;

use rand::Rng;
use reference::*;
use rlx_ir::{Activation, BinaryOp, DType};
use rlx_schedule::{RowsView, Thunk};

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
const OPS: [BinaryOp; 4] = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div];
const ACTS: [Activation; 5] = [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu, Activation::Tanh];

/// A random operand shape that broadcasts to `out`: a suffix of it (rank
/// difference) with some dims set to 1. Returns its shape and broadcast
/// strides over `out`.
fn broadcast_operand(r: &mut rand::rngs::StdRng, out: &[usize]) -> (Vec<usize>, Vec<u64>) {
    let drop = r.random_range(0..=out.len());
    let mut shape: Vec<usize> = out[drop..].to_vec();
    for d in shape.iter_mut() {
        if r.random_bool(0.3) {
            *d = 1;
        }
    }
    let own = strides(&shape);
    let mut st = vec![0u64; out.len()];
    for (i, s) in shape.iter().enumerate() {
        st[drop + i] = if *s == 1 { 0 } else { own[i] };
    }
    (shape, st)
}

#[test]
fn binary_broadcasting_random() {
    for seed in 0..120 {
        let mut r = rng(seed);
        let dtype = FLOATS[seed as usize % 3];
        let op = OPS[r.random_range(0..4)];
        let rank = r.random_range(0..5);
        let out_shape: Vec<usize> = (0..rank).map(|_| if r.random_bool(0.2) { 1 } else { r.random_range(1..7) }).collect();
        let (a_shape, a_st) = broadcast_operand(&mut r, &out_shape);
        let (b_shape, b_st) = broadcast_operand(&mut r, &out_shape);
        let a_vals = values(&mut r, a_shape.iter().product(), dtype);
        // Keep divisors away from zero.
        let b_vals: Vec<f64> = values(&mut r, b_shape.iter().product(), dtype)
            .iter()
            .map(|v| round_to(if op == BinaryOp::Div { v.signum() * (0.5 + v.abs()) } else { *v }, dtype))
            .collect();
        let n: usize = out_shape.iter().product();
        // In place when a already has the output's shape.
        let in_place = a_shape == out_shape && r.random_bool(0.5);
        let mut p = Plan::new();
        let a = p.input("a", &a_shape, dtype);
        let b = p.input("b", &b_shape, dtype);
        let out = if in_place {
            p.output_at("out", &out_shape, dtype, a);
            a
        } else {
            p.output("out", &out_shape, dtype)
        };
        p.push(Thunk::Binary { op, dtype, out_shape: out_shape.clone(), a, a_strides: a_st.clone(), b, b_strides: b_st.clone(), out });
        let want: Vec<f64> = (0..n)
            .map(|i| {
                let idx = unflatten(i, &out_shape);
                let (x, y) = (at(&a_vals, &idx, &a_st), at(&b_vals, &idx, &b_st));
                match op {
                    BinaryOp::Add => x + y,
                    BinaryOp::Sub => x - y,
                    BinaryOp::Mul => x * y,
                    BinaryOp::Div => x / y,
                }
            })
            .collect();
        let (at_, bt_) = (tensor(&a_shape, dtype, &a_vals), tensor(&b_shape, dtype, &b_vals));
        let got = p.run(&[("a", &at_), ("b", &bt_)]).expect("binary runs");
        assert_close(
            &got[0],
            &want,
            tol(dtype, TOL_ELEMENTWISE),
            &format!("seed {seed} {op:?} {dtype} {out_shape:?} <- {a_shape:?}, {b_shape:?} in_place {in_place}"),
        );
    }
}

#[test]
fn erf_is_accurate() {
    let mut worst: f64 = 0.0;
    for i in -60000..=60000 {
        let x = i as f64 * 1e-4;
        worst = worst.max((rlx_cpu::erf(x) - erf_ref(x)).abs());
    }
    assert!(worst < 1e-7, "erf max error {worst:e}");
    assert!(rlx_cpu::erf(0.0).abs() < 1e-8);
    assert!((rlx_cpu::erf(10.0) - 1.0).abs() < 1e-7);
}

#[test]
fn activations_random() {
    for (s, act) in ACTS.iter().enumerate() {
        for dtype in FLOATS {
            let mut r = rng(s as u64);
            let n = r.random_range(1..5000);
            let vals: Vec<f64> = values(&mut r, n, DType::F32).iter().map(|v| round_to(v * 6.0, dtype)).collect();
            let mut p = Plan::new();
            let x = p.input("x", &[n], dtype);
            // In place, as the planner lowers an activation whose input dies.
            p.output_at("y", &[n], dtype, x);
            p.push(Thunk::Activation { act: *act, dtype, n, x, out: x });
            let want: Vec<f64> = vals.iter().map(|v| act_ref(*act, *v)).collect();
            let got = p.run(&[("x", &tensor(&[n], dtype, &vals))]).expect("activation runs");
            assert_close(&got[0], &want, tol(dtype, TOL_ELEMENTWISE), &format!("{act:?} {dtype}"));
        }
    }
}

/// GELU (f32, rational erf) on a dense grid over [-10, 10]: within 1.5e-6
/// of the f64 formula everywhere, about one f32 ulp at |x| ≈ 8.
#[test]
fn gelu_dense_grid_f32() {
    let n = 20001;
    let vals: Vec<f64> = (0..n).map(|i| (i as f32 * 1e-3 - 10.0) as f64).collect();
    let mut p = Plan::new();
    let x = p.input("x", &[n], DType::F32);
    let y = p.output("y", &[n], DType::F32);
    p.push(Thunk::Activation { act: Activation::Gelu, dtype: DType::F32, n, x, out: y });
    let got = p.run(&[("x", &tensor(&[n], DType::F32, &vals))]).expect("gelu runs");
    let got: Vec<f32> = got[0].bytes().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let worst = vals.iter().zip(&got).map(|(v, g)| (*g as f64 - act_ref(Activation::Gelu, *v)).abs()).fold(0.0, f64::max);
    assert!(worst <= 1.5e-6, "gelu max abs error {worst:e}");
}

#[test]
fn swiglu_strided_halves() {
    for dtype in FLOATS {
        let mut r = rng(3);
        let (rows, cols) = (r.random_range(1..20), r.random_range(1..300));
        // gate and up are the two halves of one [rows, 2*cols] projection.
        let vals = values(&mut r, rows * 2 * cols, dtype);
        let mut p = Plan::new();
        let x = p.input("x", &[rows, 2 * cols], dtype);
        let up_buf =
            rlx_schedule::BufRef { offset: x.offset + (cols * dtype.size()) as u64, bytes: x.bytes - (cols * dtype.size()) as u64, ..x };
        let out = p.output("y", &[rows, cols], dtype);
        p.push(Thunk::SwiGlu {
            dtype,
            rows,
            cols,
            gate: RowsView { buf: x, row_stride: 2 * cols as u64 },
            up: RowsView { buf: up_buf, row_stride: 2 * cols as u64 },
            out,
        });
        let want: Vec<f64> = (0..rows * cols)
            .map(|i| {
                let (rr, c) = (i / cols, i % cols);
                act_ref(Activation::Silu, vals[rr * 2 * cols + c]) * vals[rr * 2 * cols + cols + c]
            })
            .collect();
        let got = p.run(&[("x", &tensor(&[rows, 2 * cols], dtype, &vals))]).expect("swiglu runs");
        assert_close(&got[0], &want, tol(dtype, TOL_ELEMENTWISE), &format!("swiglu {dtype}"));
    }
}

#[test]
fn cast_all_pairs() {
    let all = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64];
    for from in all {
        for to in all {
            let mut r = rng(11);
            let n = 257;
            let vals: Vec<f64> = (0..n).map(|_| round_to(r.random_range(-300.0..300.0), from)).collect();
            let t = if from.is_float() {
                tensor(&[n], from, &vals)
            } else {
                ints(&[n], from, &vals.iter().map(|v| *v as i64).collect::<Vec<_>>())
            };
            let mut p = Plan::new();
            let src = p.input("x", &[n], from);
            let dst = p.output("y", &[n], to);
            p.push(Thunk::Cast { from, to, n, src, dst });
            let got = p.run(&[("x", &t)]).expect("cast runs");
            assert_eq!(got[0].dtype(), to);
            // Same rule as the host tensor's conversion.
            assert_eq!(got[0], t.to_dtype(to), "cast {from} -> {to}");
        }
    }
}

#[test]
fn copy_strided_transpose_and_narrow() {
    for (seed, dtype) in [DType::F32, DType::F16, DType::I32, DType::I64].into_iter().enumerate() {
        let mut r = rng(seed as u64);
        let (a, b, c) = (r.random_range(1..6), r.random_range(1..9), r.random_range(2..9));
        // Source [a, b, c]; copy its transpose [c, a, b'] where b' narrows b.
        let nb = r.random_range(1..=b);
        let off = r.random_range(0..=b - nb);
        let vals: Vec<f64> = (0..a * b * c).map(|i| i as f64 - 7.0).collect();
        let t = if dtype.is_float() {
            tensor(&[a, b, c], dtype, &vals)
        } else {
            ints(&[a, b, c], dtype, &vals.iter().map(|v| *v as i64).collect::<Vec<_>>())
        };
        let mut p = Plan::new();
        let src = p.input("x", &[a, b, c], dtype);
        let dst = p.output("y", &[c, a, nb], dtype);
        let es = dtype.size() as u64;
        let src_view =
            rlx_schedule::BufRef { offset: src.offset + off as u64 * c as u64 * es, bytes: src.bytes - off as u64 * c as u64 * es, ..src };
        p.push(Thunk::Copy {
            dtype,
            shape: vec![c, a, nb],
            src: src_view,
            src_strides: vec![1, (b * c) as u64, c as u64],
            dst,
            dst_strides: strides(&[c, a, nb]),
        });
        let want: Vec<f64> = (0..c * a * nb)
            .map(|i| {
                let idx = unflatten(i, &[c, a, nb]);
                vals[idx[1] * b * c + (idx[2] + off) * c + idx[0]]
            })
            .collect();
        let got = p.run(&[("x", &t)]).expect("copy runs");
        assert_close(&got[0], &want, 0.0, &format!("copy {dtype}"));
    }
}

/// Sizes that split across rayon tasks: a bias add over many rows, and a
/// long activation.
#[test]
fn large_elementwise_splits_across_tasks() {
    let (rows, cols) = (300, 200);
    let mut r = rng(5);
    let x = values(&mut r, rows * cols, DType::F32);
    let bias = values(&mut r, cols, DType::F32);
    let mut p = Plan::new();
    let xb = p.input("x", &[rows, cols], DType::F32);
    let bb = p.weight("b", tensor(&[cols], DType::F32, &bias));
    let out = p.output("y", &[rows, cols], DType::F32);
    p.push(Thunk::Binary {
        op: BinaryOp::Add,
        dtype: DType::F32,
        out_shape: vec![rows, cols],
        a: xb,
        a_strides: vec![cols as u64, 1],
        b: bb,
        b_strides: vec![0, 1],
        out,
    });
    p.push(Thunk::Activation { act: Activation::Gelu, dtype: DType::F32, n: rows * cols, x: out, out });
    let want: Vec<f64> = (0..rows * cols).map(|i| act_ref(Activation::Gelu, x[i] + bias[i % cols])).collect();
    let got = p.run(&[("x", &tensor(&[rows, cols], DType::F32, &x))]).expect("runs");
    assert_close(&got[0], &want, TOL_ELEMENTWISE, "bias add + gelu in place");
}

/// Integer binary ops (positions, ids): broadcasting, wrapping like the
/// integer type, division truncating toward zero, division by zero an error.
#[test]
fn binary_integers() {
    for (seed, dtype) in [DType::I32, DType::I64].into_iter().enumerate() {
        let mut r = rng(seed as u64 + 40);
        for op in OPS {
            let out_shape = vec![3, 5];
            let a: Vec<i64> = (0..15).map(|_| r.random_range(-1000..1000)).collect();
            let b: Vec<i64> = (0..5).map(|_| r.random_range(1..50) * if r.random_bool(0.5) { -1 } else { 1 }).collect();
            let mut p = Plan::new();
            let ab = p.input("a", &[3, 5], dtype);
            let bb = p.input("b", &[5], dtype);
            let out = p.output("y", &[3, 5], dtype);
            p.push(Thunk::Binary { op, dtype, out_shape, a: ab, a_strides: vec![5, 1], b: bb, b_strides: vec![0, 1], out });
            let want: Vec<i64> = (0..15)
                .map(|i| match op {
                    BinaryOp::Add => a[i] + b[i % 5],
                    BinaryOp::Sub => a[i] - b[i % 5],
                    BinaryOp::Mul => a[i] * b[i % 5],
                    BinaryOp::Div => a[i] / b[i % 5],
                })
                .collect();
            let got = p.run(&[("a", &ints(&[3, 5], dtype, &a)), ("b", &ints(&[5], dtype, &b))]).expect("int binary runs");
            assert_eq!(got[0], ints(&[3, 5], dtype, &want), "{op:?} {dtype}");
        }
    }
    let mut p = Plan::new();
    let ab = p.input("a", &[2], DType::I32);
    let bb = p.input("b", &[2], DType::I32);
    let out = p.output("y", &[2], DType::I32);
    p.push(Thunk::Binary {
        op: BinaryOp::Div,
        dtype: DType::I32,
        out_shape: vec![2],
        a: ab,
        a_strides: vec![1],
        b: bb,
        b_strides: vec![1],
        out,
    });
    let err = p.run(&[("a", &ints(&[2], DType::I32, &[4, 5])), ("b", &ints(&[2], DType::I32, &[2, 0]))]).expect_err("division by zero");
    assert!(err.to_string().contains("division by zero at element 1"), "{err}");
}
