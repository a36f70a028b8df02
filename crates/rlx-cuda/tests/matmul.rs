//! Matmuls through cuBLASLt: every algorithm the timed choice may pick
//! against the CPU backend, replay graphs of kernels only, and timed
//! choices kept on disk and read back.

mod common;

use std::path::PathBuf;

use common::*;
use rlx_cuda::{CudaBackend, CudaOptions, MatmulChoice};
use rlx_ir::{Activation, DType};
use rlx_runtime::{Executable, PrepareOptions};
use rlx_schedule::{MatMulThunk, Thunk};

/// The backend choosing matmul algorithms by `matmul`, its choices kept in
/// `file` (None: in memory only).
fn choosing(g: &CudaBackend, matmul: MatmulChoice, file: Option<PathBuf>) -> CudaBackend {
    g.reconfigured(CudaOptions { matmul, gemm_cache: file, ..g.options().clone() })
}

/// (batch, m, n, k, b_trans, bias, act, residual)
type Case = (usize, usize, usize, usize, bool, bool, Option<Activation>, bool);

fn build(dt: DType, c: Case, r: &mut rand::rngs::StdRng) -> (Sb, Vec<(&'static str, rlx_runtime::Tensor)>) {
    let (batch, m, n, k, b_trans, bias, act, residual) = c;
    let mut sb = Sb::new();
    let a = sb.input("a", &[batch, m, k], dt);
    let b_shape = if b_trans { [n, k] } else { [k, n] };
    let bb = sb.weight("w", &b_shape, dt, r);
    let bias_buf = bias.then(|| sb.weight("bias", &[n], dt, r));
    let res_buf = residual.then(|| sb.input("res", &[batch, m, n], dt));
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
        b_batch_stride: 0,
        bias: bias_buf,
        act,
        residual: res_buf,
        out,
    }));
    let mut inputs = vec![("a", rand_tensor(r, &[batch, m, k], dt))];
    if residual {
        inputs.push(("res", rand_tensor(r, &[batch, m, n], dt)));
    }
    (sb, inputs)
}

/// Every cuBLASLt algorithm the timed choice may pick (heuristic answers and
/// their split-K variants) against the CPU, with replay == eager and two
/// calls of one executable bit for bit: BERT's FFN2 at batch 1 (long K,
/// where split-K and its reduce kernel appear; residual through C), FFN1
/// with erf-GELU left to our epilogue kernel, and a small f32 case.
#[test]
fn every_cublaslt_candidate_matches_cpu() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(52);
    let cases: [(DType, Case); 3] = [
        (DType::F16, (1, 128, 768, 3072, true, true, None, true)),
        (DType::BF16, (1, 128, 3072, 768, true, true, Some(Activation::Gelu), false)),
        (DType::F32, (1, 16, 40, 64, false, true, None, true)),
    ];
    let cpu = rlx_cpu::CpuBackend::new();
    for (dt, c) in cases {
        let (sb, inputs) = build(dt, c, &mut r);
        let (s, w) = sb.finish();
        let inputs = named(inputs);
        let want = run(&cpu, &s, &w, &inputs, true).unwrap_or_else(|e| panic!("cpu: {e}"));
        let Some(g) = &g else { continue };
        let mut i = 0;
        let mut labels = Vec::new();
        loop {
            let gi = choosing(g, MatmulChoice::Candidate(i), None);
            let opts = PrepareOptions { slots: 2, replay: true, allow_tf32: false, ..PrepareOptions::default() };
            let mut e = gi.prepare_cuda(s.clone(), w.clone(), &opts).unwrap_or_else(|e| panic!("{e}"));
            let (label, count) = e.matmul_choices()[0].clone();
            assert!(count >= 1, "{dt} {c:?}: no cuBLASLt candidate");
            let what = format!("{dt} {c:?} candidate {i}/{count} ({label})");
            let refs: Vec<(&str, &rlx_runtime::Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let first = e.run(&refs).unwrap_or_else(|e| panic!("{what}: {e}"));
            let second = e.run(&refs).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(first[0].bytes(), second[0].bytes(), "{what}: two calls differ");
            let eager = run(&gi, &s, &w, &inputs, false).unwrap_or_else(|e| panic!("{what}: eager: {e}"));
            assert_eq!(first[0].bytes(), eager[0].bytes(), "{what}: replay and eager differ");
            assert_close(&what, &first[0], &want[0], (c.3 as f64).sqrt() / 2.0);
            labels.push(label);
            i += 1;
            if i >= count {
                break;
            }
        }
        eprintln!("{dt} {c:?}: {} candidates: {}", labels.len(), labels.join(", "));
    }
}

/// BERT-base FFN1 at 32×128 (4096 rows): on the H200 cuBLASLt records a
/// memset of its workspace with this GEMM. Replay graphs carry no memset or
/// memcpy node (the memset becomes a fill kernel, staging copies are
/// kernels: each such node cost ~1 µs of host time per launch), and the
/// replayed result equals eager launches, where cuBLASLt's own memset runs,
/// bit for bit, and the CPU within tolerance.
#[test]
fn replay_graphs_hold_kernels_only() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(53);
    let c: Case = (1, 4096, 3072, 768, true, true, Some(Activation::Gelu), false);
    let (sb, inputs) = build(DType::F16, c, &mut r);
    let (s, w) = sb.finish();
    if let Some(g) = &g {
        let e = g.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        let (left, converted) = e.copy_node_counts();
        eprintln!("{}", e.segment_map());
        assert_eq!(left, 0, "memset/memcpy nodes left in the replay graph\n{}", e.segment_map());
        // Seen on sm_90 (H200, cuBLASLt 13.1); other GPUs may pick a GEMM without one.
        if g.device_name().contains("sm_90") {
            assert!(converted >= 1, "no cuBLASLt memset was converted: the conversion went untested\n{}", e.segment_map());
        }
    }
    check("f16 4096x3072x768 bias+gelu, replay graph of kernels only", &g, &s, &w, &named(inputs), (768f64).sqrt() / 2.0);
}

/// Timed choices go to the cache file, and a prepare with a fresh copy of
/// that file (as a fresh process would read it) takes them from it without
/// timing, running the same kernels (same bits). A file of garbage means
/// timing again, and the re-timed choices are written back.
#[test]
fn timed_choices_are_kept_on_disk() {
    let Some(Some(g)) = gpu_or_dry() else { return };
    let dir = std::env::temp_dir().join(format!("rlx-gemm-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let file = |name: &str| dir.join(name);
    let mut r = rng(58);
    let mut sb = Sb::new();
    // Two shapes: an FFN2-like one (split-K candidates) and a small one.
    let x = sb.input("x", &[96, 1536], DType::F16);
    let w1 = sb.weight("w1", &[384, 1536], DType::F16, &mut r);
    let b1 = sb.weight("b1", &[384], DType::F16, &mut r);
    let y = sb.scratch(96 * 384 * 2);
    sb.thunk(matmul(DType::F16, 96, 384, 1536, x, w1, true, Some(b1), None, None, y));
    let w2 = sb.weight("w2", &[64, 384], DType::F16, &mut r);
    let out = sb.output("out", &[96, 64], DType::F16);
    sb.thunk(matmul(DType::F16, 96, 64, 384, y, w2, true, None, Some(Activation::Gelu), None, out));
    let (s, w) = sb.finish();
    let inputs = named(vec![("x", rand_tensor(&mut r, &[96, 1536], DType::F16))]);
    let refs: Vec<(&str, &rlx_runtime::Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let prepare = |f: PathBuf| {
        let gf = choosing(&g, MatmulChoice::Timed, Some(f));
        let mut e = gf.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        let out = e.run(&refs).unwrap_or_else(|e| panic!("{e}"))[0].clone();
        (e.matmul_choices().to_vec(), out)
    };
    let copy = |from: &str, to: &str| std::fs::copy(file(from), file(to)).unwrap_or_else(|e| panic!("{from} -> {to}: {e}"));
    let (timed, first) = prepare(file("a.txt"));
    assert_eq!(timed.len(), 2);
    assert!(timed.iter().all(|(_, n)| *n > 0), "not timed: {timed:?}");
    let text = std::fs::read_to_string(file("a.txt")).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert_eq!(text.lines().count(), 2, "{text}");
    copy("a.txt", "b.txt");
    let (read, again) = prepare(file("b.txt"));
    assert!(read.iter().all(|(_, n)| *n == 0), "timed again: {read:?}");
    assert_eq!(read.iter().map(|c| &c.0).collect::<Vec<_>>(), timed.iter().map(|c| &c.0).collect::<Vec<_>>());
    assert_eq!(first.bytes(), again.bytes(), "the choices read from the file run other kernels");
    // Garbage: ignored, timed again, and the file gets the choices back.
    std::fs::write(file("c.txt"), "not a choice\n0123 lt 1 2\n").unwrap_or_else(|e| panic!("{e}"));
    let (retimed, _) = prepare(file("c.txt"));
    assert!(retimed.iter().all(|(_, n)| *n > 0), "not timed again: {retimed:?}");
    copy("c.txt", "d.txt");
    let (reread, _) = prepare(file("d.txt"));
    assert!(reread.iter().all(|(_, n)| *n == 0), "the re-timed choices were not written back: {reread:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
