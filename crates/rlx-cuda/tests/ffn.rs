//! The fused feed-forward block (kernels/ffn.cu, src/ffn.rs): a
//! `Thunk::FeedForward` of FFN1 with erf-GELU, FFN2 and the norm after them
//! (and the attention's output projection and norm before them), against
//! the CPU backend (which runs its parts) on random row counts up to 128,
//! f16 and bf16, the residual in the norm or in FFN2, LayerNorm and
//! RmsNorm, at MiniLM's widths (384/1536) and others the kernel's width
//! rule takes; replay equals eager bit for bit, repeated calls give the
//! same bits, the fused kernel must actually have run, and blocks it does
//! not take run as their parts.

mod common;

use common::*;
use rand::Rng;
use rlx_cuda::{CudaBackend, CudaOptions};
use rlx_ir::{Activation, DType};
use rlx_runtime::{Executable, PrepareOptions, Tensor};
use rlx_schedule::{FeedForwardThunk, Thunk};

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

/// x -> LayerNorm -> `layers` × fused block (FFN1 + GELU -> FFN2 -> norm
/// with the residual, after the output projection and its norm with
/// `tail`) -> out.
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
        // The layer's thunks, pushed as one fused block at its end.
        let mut parts = Vec::new();
        if c.tail {
            let a = sb.input(&format!("a{l}"), &[rows, h], dt);
            let mut w = |name: &str, shape: &[usize]| sb.weight(&format!("l{l}.{name}"), shape, dt, &mut r);
            let (wo, bo, g1, b1) = (w("wo", &[h, h]), w("bo", &[h]), w("g1", &[h]), w("be1", &[h]));
            let yo = act(&mut sb, h);
            parts.push(matmul(dt, rows, h, h, a, wo, true, Some(bo), None, c.residual_in_matmul.then_some(cur), yo));
            let x1 = if c.in_place { a } else { act(&mut sb, h) };
            let residual = (!c.residual_in_matmul).then_some(cur);
            let beta = (!c.rms).then_some(b1);
            parts.push(Thunk::Norm { rms: c.rms, dtype: dt, rows, cols: h, eps: 1e-5, x: yo, residual, gamma: g1, beta, out: x1 });
            cur = x1;
        }
        let mut w = |name: &str, shape: &[usize]| sb.weight(&format!("l{l}.{name}"), shape, dt, &mut r);
        let (w1, b1, w2, b2, g, b) = (w("w1", &[i, h]), w("b1", &[i]), w("w2", &[h, i]), w("b2", &[h]), w("g", &[h]), w("b", &[h]));
        let f1 = act(&mut sb, i);
        parts.push(matmul(dt, rows, i, h, cur, w1, true, Some(b1), Some(Activation::Gelu), None, f1));
        let f2 = act(&mut sb, h);
        parts.push(matmul(dt, rows, h, i, f1, w2, true, Some(b2), None, c.residual_in_matmul.then_some(cur), f2));
        let out = if l + 1 == c.layers { sb.output("out", &[rows, h], dt) } else { act(&mut sb, h) };
        let residual = (!c.residual_in_matmul).then_some(cur);
        let beta = (!c.rms).then_some(b);
        parts.push(Thunk::Norm { rms: c.rms, dtype: dt, rows, cols: h, eps: 1e-6, x: f2, residual, gamma: g, beta, out });
        sb.thunk(Thunk::FeedForward(Box::new(FeedForwardThunk { parts })));
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
    // 129 rows and widths outside the rule (bert-base's needs more shared
    // memory than a block has) run as their parts.
    let g = fusion(&g, true);
    for c in [
        Case { rows: 129, ..PLAIN },
        Case { rows: 16, h: 512, i: 2048, ..PLAIN },
        Case { rows: 32, h: 768, i: 3072, ..PLAIN },
        Case { rows: 32, h: 128, i: 512, tail: true, ..PLAIN },
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

/// |gpu - cpu| <= eps · (8 + 2·log2 K) · max(1, |cpu|), eps the storage
/// type's rounding step and K = I, the longest sum: the fused kernel keeps
/// FFN2's sums in f32 where the parts round them to storage (one step), and
/// a flipped rounding of one intermediate moves a sum of K terms by about
/// one step of the result; the rest is the few roundings of the norm.
fn assert_close_k(what: &str, gpu: &Tensor, cpu: &Tensor, k: usize) {
    let eps = match cpu.dtype() {
        DType::F16 => 2f64.powi(-10),
        DType::BF16 => 2f64.powi(-7),
        _ => 2f64.powi(-23),
    };
    let steps = 8.0 + 2.0 * (k as f64).log2();
    let (g, c) = (gpu.to_f32(), cpu.to_f32());
    assert_eq!(g.len(), c.len(), "{what}");
    for (n, (a, b)) in g.iter().zip(&c).enumerate() {
        let lim = eps * steps * (*b as f64).abs().max(1.0);
        assert!(((*a - *b) as f64).abs() <= lim, "{what}: element {n}: gpu {a} vs cpu {b} (limit {lim:e})");
    }
}

#[test]
fn the_general_kernel_at_several_widths_matches_cpu() {
    let Some(g) = gpu_or_dry() else { return };
    let g = g.map(|g| fusion(&g, true));
    // MiniLM's widths and others the width rule takes (src/ffn.rs
    // `widths_fit`; shared memory per block 102 KB at 256/1024, 198 KB at
    // 256/2048 with the tail), with and without the tail; and 128/512,
    // whose plain tiling fits but whose tail kernels do not, so its module
    // does not compile and the rule refuses it: the parts run.
    let widths = [(384, 1536, true), (256, 1024, true), (256, 2048, true), (128, 512, false)];
    for (n, (h, i, fits)) in widths.into_iter().enumerate() {
        for rows in [1, 7, 32, 100] {
            for tail in [false, true] {
                if tail && !fits {
                    continue;
                }
                let c = Case { rows, h, i, tail, in_place: tail && rows == 7, residual_in_matmul: rows == 32, ..PLAIN };
                let dt = DType::F16;
                let what = format!("H {h} I {i} rows {rows} tail {tail}");
                let (s, w) = graph(dt, c, 300 + n as u64).finish();
                let inp = inputs(c, dt, 400 + rows as u64);
                let refs: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
                let mut cpu = rlx_runtime::Backend::prepare(&rlx_cpu::CpuBackend::new(), s.clone(), w.clone(), &PrepareOptions::default())
                    .unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
                let want = cpu.run(&refs).unwrap_or_else(|e| panic!("{what}: cpu: {e}"))[0].clone();
                let Some(g) = &g else { continue };
                assert_eq!(rlx_runtime::Backend::supports(g, &s.thunks[1]), fits, "{what}: the width rule");
                let mut e = g.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(e.fused_ffn_count(), fits as usize, "{what}: fused kernels run\n{}", e.segment_map());
                let got = Executable::run(&mut e, &refs).unwrap_or_else(|e| panic!("{what}: {e}"))[0].clone();
                assert_close_k(&what, &got, &want, i);
            }
        }
    }
}
