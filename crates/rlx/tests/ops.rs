//! Every op through the whole pipeline (builder → passes → plan → lower →
//! CPU backend) against plain f64 references, on seeded random shapes.
//! Tolerances: f32 relative 1e-5 for elementwise ops and norms, 1e-4 for
//! matmul and attention; f16/bf16 storage 1e-2.

mod common;

use common::*;
use rand::Rng;
use rlx::{Activation, AttentionSpec, BinaryOp, CompileOptions, DType, Device, Graph, ReduceOp, RopeMode, Session, Tensor};

const EW: f64 = 1e-5;
const MM: f64 = 1e-4;
const HALF: f64 = 1e-2;

/// Compiles `g` on the CPU with `precision`, sets `params`, runs with `inputs`.
fn run(g: &Graph, precision: Option<DType>, params: &[(&str, Tensor)], inputs: &[(&str, Tensor)]) -> Vec<Tensor> {
    let mut s = Session::new(Device::Cpu).unwrap();
    s.set_compile_options(CompileOptions { precision, ..CompileOptions::default() });
    for (n, t) in params {
        s.set_weight(n, t.clone()).unwrap();
    }
    let mut exe = s.compile(g).unwrap();
    let ins: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (*n, t)).collect();
    exe.run(&ins).unwrap()
}

fn t(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), v).unwrap()
}

fn precisions() -> [(Option<DType>, f64, f64); 3] {
    [(None, EW, MM), (Some(DType::F16), HALF, HALF), (Some(DType::BF16), HALF * 2.0, HALF * 2.0)]
}

fn rand_shape(r: &mut rand::rngs::StdRng, rank: usize, max: usize) -> Vec<usize> {
    (0..rank).map(|_| r.random_range(1..=max)).collect()
}

#[test]
fn binary_ops_broadcast() {
    let mut r = rng(1);
    for case in 0..24 {
        let rank = r.random_range(1..=4);
        let out = rand_shape(&mut r, rank, 5);
        // Each operand: drop some leading dims and set some dims to 1.
        let mk = |r: &mut rand::rngs::StdRng| -> Vec<usize> {
            let drop = r.random_range(0..rank);
            out[drop..].iter().map(|&d| if r.random_bool(0.3) { 1 } else { d }).collect()
        };
        let (sa, sb) = (mk(&mut r), mk(&mut r));
        let os = broadcast(&sa, &sb);
        let a = randn(&mut r, numel(&sa));
        let mut b = randn(&mut r, numel(&sb));
        for v in b.iter_mut() {
            *v += 2.0f32.copysign(*v); // keep divisors away from zero
        }
        for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div] {
            let mut g = Graph::new();
            let x = g.input("a", sa.clone(), DType::F32).unwrap();
            let y = g.input("b", sb.clone(), DType::F32).unwrap();
            let z = g.binary(op, x, y).unwrap();
            g.output(z).unwrap();
            let want: Vec<f64> = (0..numel(&os))
                .map(|i| {
                    let idx = unravel(i, &os);
                    let (p, q) = (a[bcast_index(&idx, &sa)] as f64, b[bcast_index(&idx, &sb)] as f64);
                    match op {
                        BinaryOp::Add => p + q,
                        BinaryOp::Sub => p - q,
                        BinaryOp::Mul => p * q,
                        BinaryOp::Div => p / q,
                    }
                })
                .collect();
            for (prec, tol, _) in precisions() {
                let got = run(&g, prec, &[], &[("a", t(&sa, &a)), ("b", t(&sb, &b))]);
                assert_close(&format!("case {case} {op:?} {sa:?}x{sb:?} {prec:?}"), &got[0].to_f32(), &want, tol);
            }
        }
    }
}

#[test]
fn activations() {
    let mut r = rng(2);
    for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu, Activation::Tanh] {
        let shape = rand_shape(&mut r, 2, 40);
        let x: Vec<f32> = randn(&mut r, numel(&shape)).iter().map(|v| v * 6.0).collect();
        let mut g = Graph::new();
        let i = g.input("x", shape.clone(), DType::F32).unwrap();
        let y = g.activation(act, i).unwrap();
        g.output(y).unwrap();
        let want: Vec<f64> = x
            .iter()
            .map(|&v| {
                let v = v as f64;
                match act {
                    Activation::Gelu => gelu(v),
                    Activation::GeluTanh => gelu_tanh(v),
                    Activation::Silu => silu(v),
                    Activation::Relu => v.max(0.0),
                    Activation::Tanh => v.tanh(),
                }
            })
            .collect();
        for (prec, tol, _) in precisions() {
            let got = run(&g, prec, &[], &[("x", t(&shape, &x))]);
            assert_close(&format!("{act:?} {prec:?}"), &got[0].to_f32(), &want, tol);
        }
    }
}

#[test]
fn matmul_batched_and_transposed() {
    let mut r = rng(3);
    for case in 0..16 {
        let (m, k, n) = (r.random_range(1..40), r.random_range(1..70), r.random_range(1..50));
        let batch = r.random_range(1..4);
        let trans = r.random_bool(0.5);
        let weight_rhs = r.random_bool(0.5);
        let sa = vec![batch, m, k];
        let sb = match (weight_rhs, trans) {
            (true, true) => vec![n, k],
            (true, false) => vec![k, n],
            (false, true) => vec![batch, n, k],
            (false, false) => vec![batch, k, n],
        };
        let a = randn(&mut r, numel(&sa));
        let b = randn(&mut r, numel(&sb));
        let mut g = Graph::new();
        let x = g.input("a", sa.clone(), DType::F32).unwrap();
        let w = if weight_rhs { g.param("w", sb.clone(), DType::F32).unwrap() } else { g.input("w", sb.clone(), DType::F32).unwrap() };
        let y = if trans { g.matmul_t(x, w).unwrap() } else { g.matmul(x, w).unwrap() };
        g.output(y).unwrap();
        let mut want = vec![0f64; batch * m * n];
        for bi in 0..batch {
            let boff = if weight_rhs { 0 } else { bi * n * k };
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0f64;
                    for p in 0..k {
                        let bv = if trans { b[boff + j * k + p] } else { b[boff + p * n + j] };
                        s += a[bi * m * k + i * k + p] as f64 * bv as f64;
                    }
                    want[bi * m * n + i * n + j] = s;
                }
            }
        }
        for (prec, _, tol) in precisions() {
            let (params, inputs) = if weight_rhs {
                (vec![("w", t(&sb, &b))], vec![("a", t(&sa, &a))])
            } else {
                (vec![], vec![("a", t(&sa, &a)), ("w", t(&sb, &b))])
            };
            let got = run(&g, prec, &params, &inputs);
            // Matmul error grows with k: scale the tolerance by sqrt(k)/4 for half types.
            let tol = if prec.is_some() { tol * (k as f64).sqrt().max(4.0) / 4.0 } else { tol };
            assert_close(&format!("case {case} [{batch},{m},{k}]x{sb:?} {prec:?}"), &got[0].to_f32(), &want, tol);
        }
    }
}

fn norm_ref(x: &[f32], gamma: &[f32], beta: Option<&[f32]>, cols: usize, eps: f64) -> Vec<f64> {
    let mut out = vec![0f64; x.len()];
    for (row, o) in x.chunks(cols).zip(out.chunks_mut(cols)) {
        let r: Vec<f64> = row.iter().map(|&v| v as f64).collect();
        match beta {
            Some(b) => {
                let mean = r.iter().sum::<f64>() / cols as f64;
                let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
                for j in 0..cols {
                    o[j] = (r[j] - mean) / (var + eps).sqrt() * gamma[j] as f64 + b[j] as f64;
                }
            }
            None => {
                let ms = r.iter().map(|v| v * v).sum::<f64>() / cols as f64;
                for j in 0..cols {
                    o[j] = r[j] / (ms + eps).sqrt() * gamma[j] as f64;
                }
            }
        }
    }
    out
}

#[test]
fn layer_norm_and_rms_norm() {
    let mut r = rng(4);
    for case in 0..8 {
        let shape = vec![r.random_range(1..4), r.random_range(1..9), r.random_range(1..300)];
        let cols = shape[2];
        let x: Vec<f32> = randn(&mut r, numel(&shape)).iter().map(|v| v * 3.0 + 0.5).collect();
        let gamma = randn(&mut r, cols);
        let beta = randn(&mut r, cols);
        for rms in [false, true] {
            let mut g = Graph::new();
            let i = g.input("x", shape.clone(), DType::F32).unwrap();
            let gm = g.param("g", [cols], DType::F32).unwrap();
            let y = if rms {
                g.rms_norm(i, gm, 1e-6).unwrap()
            } else {
                let bt = g.param("b", [cols], DType::F32).unwrap();
                g.layer_norm(i, gm, bt, 1e-5).unwrap()
            };
            g.output(y).unwrap();
            let want = norm_ref(&x, &gamma, if rms { None } else { Some(&beta) }, cols, if rms { 1e-6 } else { 1e-5 });
            for (prec, tol, _) in precisions() {
                let got = run(
                    &g,
                    prec,
                    &[("g", t(&[cols], &gamma)), ("b", t(&[cols], &beta))][..if rms { 1 } else { 2 }],
                    &[("x", t(&shape, &x))],
                );
                assert_close(&format!("case {case} rms={rms} {shape:?} {prec:?}"), &got[0].to_f32(), &want, tol * 4.0);
            }
        }
    }
}

#[test]
fn softmax_any_axis() {
    let mut r = rng(5);
    for case in 0..12 {
        let rank = r.random_range(1..=3);
        let shape = rand_shape(&mut r, rank, 20);
        let axis = r.random_range(0..rank);
        let x: Vec<f32> = randn(&mut r, numel(&shape)).iter().map(|v| v * 8.0).collect();
        let mut g = Graph::new();
        let i = g.input("x", shape.clone(), DType::F32).unwrap();
        let y = g.softmax(i, axis).unwrap();
        g.output(y).unwrap();
        let st = strides(&shape);
        let want: Vec<f64> = (0..x.len())
            .map(|idx| {
                let pos = unravel(idx, &shape);
                let base = idx - pos[axis] * st[axis];
                let vals: Vec<f64> = (0..shape[axis]).map(|j| x[base + j * st[axis]] as f64).collect();
                let m = vals.iter().cloned().fold(f64::MIN, f64::max);
                let s: f64 = vals.iter().map(|v| (v - m).exp()).sum();
                (x[idx] as f64 - m).exp() / s
            })
            .collect();
        for (prec, tol, _) in precisions() {
            let got = run(&g, prec, &[], &[("x", t(&shape, &x))]);
            assert_close(&format!("case {case} {shape:?} axis {axis} {prec:?}"), &got[0].to_f32(), &want, tol);
        }
    }
}

#[test]
fn reduce_axes() {
    let mut r = rng(6);
    for case in 0..16 {
        let rank = r.random_range(1..=4);
        let shape = rand_shape(&mut r, rank, 6);
        let mut axes: Vec<usize> = (0..rank).filter(|_| r.random_bool(0.5)).collect();
        if axes.is_empty() {
            axes.push(r.random_range(0..rank));
        }
        let keep = r.random_bool(0.5);
        let x = randn(&mut r, numel(&shape));
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            let mut g = Graph::new();
            let i = g.input("x", shape.clone(), DType::F32).unwrap();
            let y = g.reduce(op, i, &axes, keep).unwrap();
            g.output(y).unwrap();
            let kept: Vec<usize> = (0..rank).map(|d| if axes.contains(&d) { 1 } else { shape[d] }).collect();
            let mut acc = vec![if op == ReduceOp::Max { f64::MIN } else { 0.0 }; numel(&kept)];
            for (idx, &v) in x.iter().enumerate() {
                let pos = unravel(idx, &shape);
                let o = bcast_index(&pos, &kept);
                acc[o] = if op == ReduceOp::Max { acc[o].max(v as f64) } else { acc[o] + v as f64 };
            }
            if op == ReduceOp::Mean {
                let n: usize = axes.iter().map(|&a| shape[a]).product();
                acc.iter_mut().for_each(|v| *v /= n as f64);
            }
            let got = run(&g, None, &[], &[("x", t(&shape, &x))]);
            assert_close(&format!("case {case} {op:?} {shape:?} axes {axes:?}"), &got[0].to_f32(), &acc, EW * 10.0);
        }
    }
}

#[test]
fn gather_narrow_transpose_concat_reshape_cast() {
    let mut r = rng(7);
    for case in 0..10 {
        let (v, d) = (r.random_range(2..50), r.random_range(1..33));
        let table = randn(&mut r, v * d);
        let ids_shape = vec![r.random_range(1..4), r.random_range(1..7)];
        let ids: Vec<i32> = (0..numel(&ids_shape)).map(|_| r.random_range(0..v as i32)).collect();
        let mut g = Graph::new();
        let tb = g.param("table", [v, d], DType::F32).unwrap();
        let id = g.input("ids", ids_shape.clone(), DType::I32).unwrap();
        let e = g.gather(tb, id).unwrap(); // [b, s, d]
        let (b, s) = (ids_shape[0], ids_shape[1]);
        let start = r.random_range(0..d);
        let len = r.random_range(1..=d - start);
        let n = g.narrow(e, 2, start, len).unwrap(); // strided: [b, s, len]
        let tr = g.transpose(n, &[2, 0, 1]).unwrap(); // [len, b, s]
        let c = g.concat(&[tr, tr], 1).unwrap(); // [len, 2b, s]
        let re = g.reshape(c, [len * 2 * b * s]).unwrap();
        let h = g.cast(re, DType::F16).unwrap();
        let back = g.cast(h, DType::F32).unwrap();
        g.output(e).unwrap();
        g.output(back).unwrap();
        let emb: Vec<f64> = ids.iter().flat_map(|&i| table[i as usize * d..(i as usize + 1) * d].iter().map(|&x| x as f64)).collect();
        let mut want = vec![];
        for l in 0..len {
            for _rep in 0..2 {
                for bi in 0..b {
                    for si in 0..s {
                        want.push(emb[(bi * s + si) * d + start + l]);
                    }
                }
            }
        }
        // The cast to f16 and back rounds: compare with an f16 tolerance.
        let got = run(&g, None, &[("table", t(&[v, d], &table))], &[("ids", Tensor::from_i32(ids_shape.clone(), &ids).unwrap())]);
        assert_close(&format!("case {case} gather"), &got[0].to_f32(), &emb, 0.0);
        assert_close(&format!("case {case} narrow/transpose/concat/cast"), &got[1].to_f32(), &want, 1e-3);
    }
}

#[test]
fn gather_rejects_out_of_range_ids() {
    let mut g = Graph::new();
    let tb = g.param("table", [4, 2], DType::F32).unwrap();
    let id = g.input("ids", [3], DType::I32).unwrap();
    let e = g.gather(tb, id).unwrap();
    g.output(e).unwrap();
    let s = Session::new(Device::Cpu).unwrap();
    s.set_weight("table", t(&[4, 2], &[1.0; 8])).unwrap();
    let mut exe = s.compile(&g).unwrap();
    let bad = Tensor::from_i32([3], &[0, 7, 1]).unwrap();
    let err = exe.run(&[("ids", &bad)]).unwrap_err().to_string();
    assert!(err.contains('7') && err.contains('4'), "{err}");
    // Still usable afterwards.
    let ok = Tensor::from_i32([3], &[0, 3, 1]).unwrap();
    assert_eq!(exe.run(&[("ids", &ok)]).unwrap()[0].to_f32(), vec![1.0; 6]);
}

#[test]
fn argmax_and_topk() {
    let mut r = rng(8);
    for case in 0..10 {
        let shape = vec![r.random_range(1..5), r.random_range(2..300)];
        let len = shape[1];
        let x = randn(&mut r, numel(&shape));
        let k = r.random_range(1..=len.min(20));
        let mut g = Graph::new();
        let i = g.input("x", shape.clone(), DType::F32).unwrap();
        let am = g.argmax(i, 1).unwrap();
        let (tv, ti) = g.top_k(i, k).unwrap();
        g.output(am).unwrap();
        g.output(tv).unwrap();
        g.output(ti).unwrap();
        let got = run(&g, None, &[], &[("x", t(&shape, &x))]);
        let ams = got[0].as_i32().unwrap();
        let tvs = got[1].to_f32();
        let tis = got[2].as_i32().unwrap();
        for row in 0..shape[0] {
            let rv = &x[row * len..(row + 1) * len];
            let mut order: Vec<usize> = (0..len).collect();
            order.sort_by(|&a, &b| rv[b].total_cmp(&rv[a]).then(a.cmp(&b)));
            assert_eq!(ams[row] as usize, order[0], "case {case} argmax row {row}");
            for j in 0..k {
                assert_eq!(tis[row * k + j] as usize, order[j], "case {case} topk index row {row} rank {j}");
                assert_eq!(tvs[row * k + j], rv[order[j]], "case {case} topk value");
            }
        }
    }
}

/// Attention reference over [B, S, H*D] tensors.
#[allow(clippy::too_many_arguments)]
fn attention_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    b: usize,
    sq: usize,
    skv: usize,
    h: usize,
    kvh: usize,
    d: usize,
    scale: f64,
    causal: bool,
    mask: Option<&[f32]>,
    valid: usize,
) -> Vec<f64> {
    let mut out = vec![0f64; b * sq * h * d];
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / (h / kvh);
            for i in 0..sq {
                let qpos = valid - sq + i;
                let mut scores = vec![f64::NEG_INFINITY; skv];
                for j in 0..valid.min(skv) {
                    if causal && j > qpos {
                        continue;
                    }
                    if let Some(m) = mask {
                        if m[bi * skv + j] == 0.0 {
                            continue;
                        }
                    }
                    let mut s = 0f64;
                    for x in 0..d {
                        s += q[(bi * sq + i) * h * d + hi * d + x] as f64 * k[(bi * skv + j) * kvh * d + kh * d + x] as f64;
                    }
                    scores[j] = s * scale;
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for j in 0..skv {
                    let p = (scores[j] - m).exp() / z;
                    if p == 0.0 {
                        continue;
                    }
                    for x in 0..d {
                        out[(bi * sq + i) * h * d + hi * d + x] += p * v[(bi * skv + j) * kvh * d + kh * d + x] as f64;
                    }
                }
            }
        }
    }
    out
}

#[test]
fn attention_masks_gqa_and_fused_qkv_views() {
    let mut r = rng(9);
    for case in 0..10 {
        let kvh = [1, 2, 4][r.random_range(0..3)];
        let h = kvh * r.random_range(1..4);
        let d = [8, 16, 32][r.random_range(0..3)];
        let b = r.random_range(1..3);
        let s = r.random_range(1..40);
        let causal = r.random_bool(0.5);
        let use_mask = !causal || r.random_bool(0.5);
        // q, k, v come out of one fused [B, S, (h + 2kvh) d] tensor through narrows.
        let wq = (h + 2 * kvh) * d;
        let qkv = randn(&mut r, b * s * wq);
        let mut mask = vec![1f32; b * s];
        for bi in 0..b {
            let valid = r.random_range(1..=s);
            for j in valid..s {
                mask[bi * s + j] = 0.0;
            }
        }
        let mut g = Graph::new();
        let x = g.input("qkv", [b, s, wq], DType::F32).unwrap();
        let q = g.narrow(x, 2, 0, h * d).unwrap();
        let k = g.narrow(x, 2, h * d, kvh * d).unwrap();
        let v = g.narrow(x, 2, (h + kvh) * d, kvh * d).unwrap();
        let m = if use_mask { Some(g.input("mask", [b, s], DType::F32).unwrap()) } else { None };
        let scale = 1.0 / (d as f32).sqrt();
        let spec = AttentionSpec { heads: h, kv_heads: kvh, head_dim: d, scale, causal, mask: false, valid_len: false };
        let o = g.attention(spec, q, k, v, m, None).unwrap();
        g.output(o).unwrap();
        let split =
            |off: usize, w: usize| -> Vec<f32> { (0..b * s).flat_map(|row| qkv[row * wq + off..row * wq + off + w].to_vec()).collect() };
        let (qv, kv, vv) = (split(0, h * d), split(h * d, kvh * d), split((h + kvh) * d, kvh * d));
        let want = attention_ref(&qv, &kv, &vv, b, s, s, h, kvh, d, scale as f64, causal, if use_mask { Some(&mask) } else { None }, s);
        for (prec, _, tol) in precisions() {
            let mut inputs = vec![("qkv", t(&[b, s, wq], &qkv))];
            if use_mask {
                inputs.push(("mask", t(&[b, s], &mask)));
            }
            let got = run(&g, prec, &[], &inputs);
            assert_close(
                &format!("case {case} b{b} s{s} h{h}/{kvh} d{d} causal={causal} mask={use_mask} {prec:?}"),
                &got[0].to_f32(),
                &want,
                tol,
            );
        }
    }
}

#[test]
#[allow(clippy::needless_range_loop)] // indices mirror the formula
fn rope_both_modes() {
    let mut r = rng(10);
    for case in 0..8 {
        let (b, s, heads) = (r.random_range(1..3), r.random_range(1..9), r.random_range(1..4));
        let d = [4, 8, 16, 64][r.random_range(0..4)];
        let theta = 10000.0f32;
        let x = randn(&mut r, b * s * heads * d);
        let pos: Vec<i32> = (0..s).map(|i| i as i32 * 3 + r.random_range(0..5)).collect();
        for mode in [RopeMode::RotateHalf, RopeMode::Interleaved] {
            let mut g = Graph::new();
            let xi = g.input("x", [b, s, heads * d], DType::F32).unwrap();
            let p = g.input("pos", [s], DType::I32).unwrap();
            let y = g.rope(xi, p, d, theta, mode).unwrap();
            g.output(y).unwrap();
            let mut want = vec![0f64; x.len()];
            for bi in 0..b {
                for si in 0..s {
                    for hi in 0..heads {
                        let base = (bi * s + si) * heads * d + hi * d;
                        for i in 0..d / 2 {
                            let freq = (theta as f64).powf(-2.0 * i as f64 / d as f64);
                            let ang = pos[si] as f64 * freq;
                            let (i0, i1) = match mode {
                                RopeMode::RotateHalf => (i, i + d / 2),
                                RopeMode::Interleaved => (2 * i, 2 * i + 1),
                            };
                            let (a, c) = (x[base + i0] as f64, x[base + i1] as f64);
                            want[base + i0] = a * ang.cos() - c * ang.sin();
                            want[base + i1] = c * ang.cos() + a * ang.sin();
                        }
                    }
                }
            }
            let got = run(&g, None, &[], &[("x", t(&[b, s, heads * d], &x)), ("pos", Tensor::from_i32([s], &pos).unwrap())]);
            assert_close(&format!("case {case} {mode:?} d{d}"), &got[0].to_f32(), &want, EW * 10.0);
        }
    }
}

#[test]
fn swiglu_from_fused_projection() {
    let mut r = rng(11);
    let (rows, cols) = (7, 33);
    let x = randn(&mut r, rows * 2 * cols);
    let mut g = Graph::new();
    let i = g.input("x", [rows, 2 * cols], DType::F32).unwrap();
    let gate = g.narrow(i, 1, 0, cols).unwrap();
    let up = g.narrow(i, 1, cols, cols).unwrap();
    let y = g.swiglu(gate, up).unwrap();
    g.output(y).unwrap();
    let want: Vec<f64> = (0..rows)
        .flat_map(|rw| (0..cols).map(move |c| (rw, c)))
        .map(|(rw, c)| silu(x[rw * 2 * cols + c] as f64) * x[rw * 2 * cols + cols + c] as f64)
        .collect();
    for (prec, tol, _) in precisions() {
        let got = run(&g, prec, &[], &[("x", t(&[rows, 2 * cols], &x))]);
        assert_close(&format!("swiglu {prec:?}"), &got[0].to_f32(), &want, tol);
    }
}
