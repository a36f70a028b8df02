//! The fused feed-forward block (kernels/ffn.cu, src/ffn.rs): FFN1 with
//! erf-GELU, FFN2 and the norm after them (and the attention's output
//! projection and norm before them), against the CPU backend on random row
//! counts up to 128, f16 and bf16, the residual in the norm or in FFN2,
//! LayerNorm and RmsNorm, at the compiled width (MiniLM's 384/1536);
//! replay equals eager bit for bit, repeated calls give the same bits, and
//! the fused kernel must actually have run.

mod common;

use common::*;
use rand::Rng;
use rlx_cuda::{CudaBackend, CudaOptions};
use rlx_ir::{Activation, DType};
use rlx_runtime::{Executable, PrepareOptions, Tensor};
use rlx_schedule::Thunk;

/// The backend with the fused kernel on or off.
fn fusion(g: &CudaBackend, on: bool) -> CudaBackend {
    g.reconfigured(CudaOptions { ffn_fusion: on, ..g.options().clone() })
}

#[derive(Clone, Copy, Debug)]
struct Case {
    rows: usize,
    h: usize,
    i: usize,
    /// The residual added by FFN2's epilogue rather than by the norm.
    residual_in_matmul: bool,
    rms: bool,
    layers: usize,
    /// Each layer starts with an output projection of its own input `a<l>`
    /// and a norm adding the residual (the row split's tail kernel).
    tail: bool,
    /// The tail's norm writes over the projection's input (as MiniLM's
    /// arena plan does).
    in_place: bool,
}

const PLAIN: Case = Case { rows: 128, h: 384, i: 1536, residual_in_matmul: false, rms: false, layers: 1, tail: false, in_place: false };

/// x -> LayerNorm -> `layers` × (FFN1 + GELU -> FFN2 -> norm with the
/// residual) -> out.
fn graph(dt: DType, c: Case, seed: u64) -> Sb {
    let mut r = rng(seed);
    let (rows, h, i) = (c.rows, c.h, c.i);
    let mut sb = Sb::new();
    let x = sb.input("x", &[rows, h], dt);
    let act = |sb: &mut Sb, cols: usize| sb.scratch((rows * cols * dt.size()) as u64);
    let mut cur = act(&mut sb, h);
    let (g, b) = (sb.weight("ln0.g", &[h], dt, &mut r), sb.weight("ln0.b", &[h], dt, &mut r));
    sb.thunk(Thunk::Norm { rms: false, dtype: dt, rows, cols: h, eps: 1e-12, x, residual: None, gamma: g, beta: Some(b), out: cur });
    for l in 0..c.layers {
        if c.tail {
            let a = sb.input(&format!("a{l}"), &[rows, h], dt);
            let mut w = |name: &str, shape: &[usize]| sb.weight(&format!("l{l}.{name}"), shape, dt, &mut r);
            let (wo, bo, g1, b1) = (w("wo", &[h, h]), w("bo", &[h]), w("g1", &[h]), w("be1", &[h]));
            let yo = act(&mut sb, h);
            sb.thunk(matmul(dt, rows, h, h, a, wo, true, Some(bo), None, c.residual_in_matmul.then_some(cur), yo));
            let x1 = if c.in_place { a } else { act(&mut sb, h) };
            let residual = (!c.residual_in_matmul).then_some(cur);
            let beta = (!c.rms).then_some(b1);
            sb.thunk(Thunk::Norm { rms: c.rms, dtype: dt, rows, cols: h, eps: 1e-5, x: yo, residual, gamma: g1, beta, out: x1 });
            cur = x1;
        }
        let mut w = |name: &str, shape: &[usize]| sb.weight(&format!("l{l}.{name}"), shape, dt, &mut r);
        let (w1, b1, w2, b2, g, b) = (w("w1", &[i, h]), w("b1", &[i]), w("w2", &[h, i]), w("b2", &[h]), w("g", &[h]), w("b", &[h]));
        let f1 = act(&mut sb, i);
        sb.thunk(matmul(dt, rows, i, h, cur, w1, true, Some(b1), Some(Activation::Gelu), None, f1));
        let f2 = act(&mut sb, h);
        sb.thunk(matmul(dt, rows, h, i, f1, w2, true, Some(b2), None, c.residual_in_matmul.then_some(cur), f2));
        let out = if l + 1 == c.layers { sb.output("out", &[rows, h], dt) } else { act(&mut sb, h) };
        let residual = (!c.residual_in_matmul).then_some(cur);
        let beta = (!c.rms).then_some(b);
        sb.thunk(Thunk::Norm { rms: c.rms, dtype: dt, rows, cols: h, eps: 1e-6, x: f2, residual, gamma: g, beta, out });
        cur = out;
    }
    sb
}

fn inputs(c: Case, dt: DType, seed: u64) -> Vec<(String, Tensor)> {
    let mut r = rng(seed);
    let mut v = vec![("x".to_string(), rand_tensor(&mut r, &[c.rows, c.h], dt))];
    if c.tail {
        for l in 0..c.layers {
            v.push((format!("a{l}"), rand_tensor(&mut r, &[c.rows, c.h], dt)));
        }
    }
    v
}

#[test]
fn fused_ffn_matches_cpu() {
    let Some(g) = gpu_or_dry() else { return };
    let g = g.map(|g| fusion(&g, true));
    let mut r = rng(7);
    let mut cases = vec![
        Case { layers: 2, ..PLAIN },
        Case { rows: 1, residual_in_matmul: true, rms: true, ..PLAIN },
        Case { rows: 17, ..PLAIN },
        // The tail: the output projection and its norm too.
        Case { layers: 2, tail: true, in_place: true, ..PLAIN },
        Case { rows: 1, residual_in_matmul: true, rms: true, tail: true, ..PLAIN },
        Case { rows: 37, layers: 2, tail: true, ..PLAIN },
    ];
    for _ in 0..5 {
        let tail = r.random_bool(0.6);
        cases.push(Case {
            rows: r.random_range(2..128),
            residual_in_matmul: r.random_bool(0.5),
            rms: r.random_bool(0.3),
            tail,
            in_place: tail && r.random_bool(0.5),
            ..PLAIN
        });
    }
    for (n, c) in cases.iter().copied().enumerate() {
        for dt in [DType::F16, DType::BF16] {
            let what = format!("fused ffn {dt} {c:?}");
            let (s, w) = graph(dt, c, 100 + n as u64).finish();
            let inp = inputs(c, dt, 200 + n as u64);
            check_floor(&what, &g, &s, &w, &inp, 5.0, 3.0);
            let Some(g) = &g else { continue };
            let mut e = g.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(e.fused_ffn_count(), c.layers, "{what}: the fused kernel did not run\n{}", e.segment_map());
            // Every matmul of the graph is fused away.
            assert_eq!(e.matmul_choices().len(), 0, "{what}");
            let refs: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let first = Executable::run(&mut e, &refs).unwrap_or_else(|e| panic!("{what}: {e}"))[0].clone();
            for _ in 0..10 {
                let again = Executable::run(&mut e, &refs).unwrap_or_else(|e| panic!("{what}: {e}"))[0].clone();
                assert_eq!(first.bytes(), again.bytes(), "{what}: repeated calls differ");
            }
        }
    }
}

#[test]
fn fusion_off_and_ineligible_shapes_run_the_usual_kernels() {
    let Some(Some(g)) = gpu_or_dry() else { return };
    for c in [Case { rows: 64, ..PLAIN }, Case { rows: 40, tail: true, ..PLAIN }] {
        let (s, w) = graph(DType::F16, c, 3).finish();
        let inp = inputs(c, DType::F16, 4);
        let refs: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut off = fusion(&g, false).prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(off.fused_ffn_count(), 0);
        let unfused = Executable::run(&mut off, &refs).unwrap_or_else(|e| panic!("{e}"))[0].clone();
        let mut on = fusion(&g, true).prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(on.fused_ffn_count(), 1, "{c:?}");
        let fused = Executable::run(&mut on, &refs).unwrap_or_else(|e| panic!("{e}"))[0].clone();
        assert_close_floor(&format!("{c:?} fused against unfused"), &fused, &unfused, 5.0, 3.0);
    }
    // 129 rows and uncompiled widths stay unfused (and still run).
    let g = fusion(&g, true);
    for c in [
        Case { rows: 129, ..PLAIN },
        Case { rows: 16, h: 256, i: 1024, ..PLAIN },
        Case { rows: 32, h: 768, i: 3072, ..PLAIN },
        Case { rows: 129, tail: true, ..PLAIN },
    ] {
        let (s, w) = graph(DType::F16, c, 5).finish();
        let mut e = g.prepare_cuda(s, w, &PrepareOptions::default()).unwrap_or_else(|e| panic!("{c:?}: {e}"));
        assert_eq!(e.fused_ffn_count(), 0, "{c:?}");
        let inp = inputs(c, DType::F16, 6);
        let refs: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Executable::run(&mut e, &refs).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
}
