//! The fused feed-forward block (kernels/ffn.cu, src/ffn.rs): FFN1 with
//! erf-GELU, FFN2 and the norm after them, against the CPU backend on
//! random row counts up to 128, f16 and bf16, the residual in the norm or in
//! FFN2, LayerNorm and RmsNorm: the cluster kernel at both compiled widths
//! (MiniLM's 384/1536 and bert-base's 768/3072), the row split at MiniLM's;
//! replay equals eager bit for bit, repeated calls give the same bits, and
//! the fused kernels must actually have run.

mod common;

use common::*;
use rand::Rng;
use rlx_compile::Thunk;
use rlx_cuda::{set_ffn_fusion, FfnFusion};
use rlx_ir::{Activation, DType};
use rlx_runtime::{Executable, PrepareOptions, Tensor};

/// The switch is process-wide: tests that set it run one at a time.
static FUSION_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[derive(Clone, Copy, Debug)]
struct Case {
    rows: usize,
    h: usize,
    i: usize,
    /// The residual added by FFN2's epilogue rather than by the norm.
    residual_in_matmul: bool,
    rms: bool,
    layers: usize,
}

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

#[test]
fn fused_ffn_matches_cpu() {
    let Some(g) = gpu_or_dry() else { return };
    let _lock = FUSION_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let mut r = rng(7);
    let mut cases = vec![
        Case { rows: 128, h: 768, i: 3072, residual_in_matmul: false, rms: false, layers: 2 },
        Case { rows: 128, h: 384, i: 1536, residual_in_matmul: false, rms: false, layers: 2 },
        Case { rows: 1, h: 384, i: 1536, residual_in_matmul: true, rms: true, layers: 1 },
        Case { rows: 17, h: 384, i: 1536, residual_in_matmul: false, rms: false, layers: 1 },
    ];
    for _ in 0..4 {
        let big = r.random_bool(0.4);
        cases.push(Case {
            rows: r.random_range(2..128),
            h: if big { 768 } else { 384 },
            i: if big { 3072 } else { 1536 },
            residual_in_matmul: r.random_bool(0.5),
            rms: r.random_bool(0.3),
            layers: 1,
        });
    }
    for mode in [FfnFusion::Clusters, FfnFusion::Rows] {
        set_ffn_fusion(mode);
        for (n, c) in cases.iter().copied().enumerate() {
            // The row split is compiled for MiniLM's widths only.
            if mode == FfnFusion::Rows && c.h != 384 {
                continue;
            }
            for dt in [DType::F16, DType::BF16] {
                let what = format!("fused ffn {mode:?} {dt} {c:?}");
                let (s, w) = graph(dt, c, 100 + n as u64).finish();
                let inp = vec![("x".to_string(), rand_tensor(&mut rng(200 + n as u64), &[c.rows, c.h], dt))];
                check_floor(&what, &g, &s, &w, &inp, 5.0, 3.0);
                let Some(g) = &g else { continue };
                let mut e = g.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(e.fused_ffn_count(), c.layers, "{what}: the fused kernels did not run\n{}", e.segment_map());
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
    set_ffn_fusion(FfnFusion::Off);
}

#[test]
fn fusion_off_and_ineligible_shapes_run_the_usual_kernels() {
    let Some(Some(g)) = gpu_or_dry() else { return };
    let _lock = FUSION_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let c = Case { rows: 64, h: 384, i: 1536, residual_in_matmul: false, rms: false, layers: 1 };
    let (s, w) = graph(DType::F16, c, 3).finish();
    let inp = [("x".to_string(), rand_tensor(&mut rng(4), &[c.rows, c.h], DType::F16))];
    let refs: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
    set_ffn_fusion(FfnFusion::Off);
    let mut off = g.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(off.fused_ffn_count(), 0);
    let unfused = Executable::run(&mut off, &refs).unwrap_or_else(|e| panic!("{e}"))[0].clone();
    for mode in [FfnFusion::Clusters, FfnFusion::Rows, FfnFusion::All] {
        set_ffn_fusion(mode);
        let mut on = g.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(on.fused_ffn_count(), 1, "{mode:?}");
        let fused = Executable::run(&mut on, &refs).unwrap_or_else(|e| panic!("{e}"))[0].clone();
        assert_close_floor(&format!("{mode:?} against unfused"), &fused, &unfused, 5.0, 3.0);
    }
    // 129 rows and an uncompiled width stay unfused (and still run).
    set_ffn_fusion(FfnFusion::All);
    for c in [
        Case { rows: 129, h: 384, i: 1536, residual_in_matmul: false, rms: false, layers: 1 },
        Case { rows: 16, h: 256, i: 1024, residual_in_matmul: false, rms: false, layers: 1 },
    ] {
        let (s, w) = graph(DType::F16, c, 5).finish();
        let mut e = g.prepare_cuda(s, w, &PrepareOptions::default()).unwrap_or_else(|e| panic!("{c:?}: {e}"));
        assert_eq!(e.fused_ffn_count(), 0, "{c:?}");
        let inp = [("x", &rand_tensor(&mut rng(6), &[c.rows, c.h], DType::F16))];
        Executable::run(&mut e, &inp).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
    set_ffn_fusion(FfnFusion::Off);
}
