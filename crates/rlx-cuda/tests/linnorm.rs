//! The fused linear layer + norm (kernels/linnorm.cu, src/linnorm.rs)
//! against the CPU backend: every compiled (K, N) and columns-per-block
//! variant, random row counts up to 128, f16 and bf16, LayerNorm and
//! RmsNorm, with and without beta, the residual in the matmul or in the norm
//! (or none), stacked pairs; replay equals eager bit for bit, repeated calls
//! give the same bits, and the fused kernel must actually have run.

mod common;

use common::*;
use rand::Rng;
use rlx_compile::Thunk;
use rlx_cuda::{set_linear_norm_fusion, LinearNormFusion};
use rlx_ir::DType;
use rlx_runtime::{Executable, PrepareOptions, Tensor};

/// The switch is process-wide: tests that set it run one at a time.
static FUSION_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// (K, N, columns per block) of every compiled variant (kernels/linnorm.cu).
const VARIANTS: [(usize, usize, usize); 6] =
    [(384, 384, 32), (384, 384, 48), (1536, 384, 32), (1536, 384, 48), (768, 768, 48), (768, 768, 96)];

#[derive(Clone, Copy, Debug)]
struct Case {
    rows: usize,
    k: usize,
    n: usize,
    /// 0: no residual, 1: added by the matmul, 2: added by the norm.
    residual: u8,
    rms: bool,
    beta: bool,
    /// Pairs one after another (the later ones K = N = n).
    layers: usize,
    /// The middle pairs write their norm's output over their input (as the
    /// arena planner places MiniLM's output projections).
    in_place: bool,
}

/// x [rows, K], r [rows, N] -> `layers` × (matmul + bias -> norm) -> out;
/// the first pair reads x, later ones the previous norm's output (also
/// their residual).
fn graph(dt: DType, c: Case, seed: u64) -> Sb {
    let mut rg = rng(seed);
    let (rows, n) = (c.rows, c.n);
    let mut sb = Sb::new();
    let mut cur = sb.input("x", &[rows, c.k], dt);
    let mut res = sb.input("r", &[rows, n], dt);
    for l in 0..c.layers {
        let k = if l == 0 { c.k } else { n };
        let mut w = |name: &str, shape: &[usize]| sb.weight(&format!("l{l}.{name}"), shape, dt, &mut rg);
        let (wt, b, g, beta) = (w("w", &[n, k]), w("b", &[n]), w("g", &[n]), w("beta", &[n]));
        let y = sb.scratch((rows * n * dt.size()) as u64);
        sb.thunk(matmul(dt, rows, n, k, cur, wt, true, Some(b), None, (c.residual == 1).then_some(res), y));
        let out = if l + 1 == c.layers {
            sb.output("out", &[rows, n], dt)
        } else if c.in_place && l > 0 {
            cur
        } else {
            sb.scratch((rows * n * dt.size()) as u64)
        };
        let residual = (c.residual == 2).then_some(res);
        let beta = c.beta.then_some(beta);
        sb.thunk(Thunk::Norm { rms: c.rms, dtype: dt, rows, cols: n, eps: 1e-6, x: y, residual, gamma: g, beta, out });
        cur = out;
        res = out;
    }
    sb
}

fn inputs(c: Case, dt: DType, seed: u64) -> Vec<(String, Tensor)> {
    let mut r = rng(seed);
    vec![("x".to_string(), rand_tensor(&mut r, &[c.rows, c.k], dt)), ("r".to_string(), rand_tensor(&mut r, &[c.rows, c.n], dt))]
}

#[test]
fn fused_linear_norm_matches_cpu() {
    let Some(g) = gpu_or_dry() else { return };
    let _lock = FUSION_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let mut r = rng(11);
    let mut cases = Vec::new();
    for (k, n, oc) in VARIANTS {
        let fixed = [
            Case { rows: 128, k, n, residual: 2, rms: false, beta: true, layers: if k == n { 2 } else { 1 }, in_place: false },
            Case { rows: 1, k, n, residual: 1, rms: true, beta: false, layers: 1, in_place: false },
        ];
        for c in fixed {
            cases.push((oc, c));
        }
        if k == n {
            cases.push((oc, Case { rows: 77, k, n, residual: 1, rms: false, beta: true, layers: 3, in_place: true }));
        }
        cases.push((
            oc,
            Case {
                rows: r.random_range(2..128),
                k,
                n,
                residual: r.random_range(0..3),
                rms: r.random_bool(0.3),
                beta: r.random_bool(0.7),
                layers: 1,
                in_place: false,
            },
        ));
    }
    for (i, (oc, c)) in cases.into_iter().enumerate() {
        set_linear_norm_fusion(LinearNormFusion::Columns(oc));
        for dt in [DType::F16, DType::BF16] {
            let what = format!("linear+norm {oc} columns {dt} {c:?}");
            let (s, w) = graph(dt, c, 100 + i as u64).finish();
            let inp = inputs(c, dt, 200 + i as u64);
            check_floor(&what, &g, &s, &w, &inp, 5.0, 3.0);
            let Some(g) = &g else { continue };
            let mut e = g.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(e.fused_norm_count(), c.layers, "{what}: the fused kernel did not run\n{}", e.segment_map());
            assert_eq!(e.matmul_choices().len(), 0, "{what}: a matmul was left to cuBLASLt");
            let refs: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let first = Executable::run(&mut e, &refs).unwrap_or_else(|e| panic!("{what}: {e}"))[0].clone();
            for _ in 0..10 {
                let again = Executable::run(&mut e, &refs).unwrap_or_else(|e| panic!("{what}: {e}"))[0].clone();
                assert_eq!(first.bytes(), again.bytes(), "{what}: repeated calls differ");
            }
        }
    }
    set_linear_norm_fusion(LinearNormFusion::Off);
}

#[test]
fn fusion_off_and_ineligible_shapes_run_the_usual_kernels() {
    let Some(Some(g)) = gpu_or_dry() else { return };
    let _lock = FUSION_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let c = Case { rows: 64, k: 384, n: 384, residual: 2, rms: false, beta: true, layers: 1, in_place: false };
    let (s, w) = graph(DType::F16, c, 3).finish();
    let inp = inputs(c, DType::F16, 4);
    let refs: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
    set_linear_norm_fusion(LinearNormFusion::Off);
    let mut off = g.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(off.fused_norm_count(), 0);
    let unfused = Executable::run(&mut off, &refs).unwrap_or_else(|e| panic!("{e}"))[0].clone();
    set_linear_norm_fusion(LinearNormFusion::On);
    let mut on = g.prepare_cuda(s, w, &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(on.fused_norm_count(), 1);
    let fused = Executable::run(&mut on, &refs).unwrap_or_else(|e| panic!("{e}"))[0].clone();
    assert_close_floor("fused against unfused", &fused, &unfused, 5.0, 3.0);
    // 129 rows and an uncompiled width stay unfused (and still run).
    for c in [
        Case { rows: 129, k: 384, n: 384, residual: 2, rms: false, beta: true, layers: 1, in_place: false },
        Case { rows: 16, k: 256, n: 256, residual: 2, rms: false, beta: true, layers: 1, in_place: false },
    ] {
        let (s, w) = graph(DType::F16, c, 5).finish();
        let mut e = g.prepare_cuda(s, w, &PrepareOptions::default()).unwrap_or_else(|e| panic!("{c:?}: {e}"));
        assert_eq!(e.fused_norm_count(), 0, "{c:?}");
        let inp = inputs(c, DType::F16, 6);
        let refs: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Executable::run(&mut e, &refs).unwrap_or_else(|e| panic!("{c:?}: {e}"));
    }
    set_linear_norm_fusion(LinearNormFusion::Off);
}
