//! The executable: pipelining, replay vs eager on a layer-shaped schedule,
//! weight updates after recording, and every error path.

mod common;

use std::sync::Arc;

use common::*;
use rlx_cuda::{CudaBackend, CudaOptions};
use rlx_ir::{Activation, BinaryOp, DType};
use rlx_runtime::{Backend, PrepareOptions, RuntimeError, Tensor};
use rlx_schedule::{MatMulThunk, Thunk};

/// x [rows, h] -> QKV matmul (+bias) -> attention -> out-proj (+residual) ->
/// LayerNorm -> FFN (erf-GELU) -> residual add: one encoder layer.
fn layer(dt: DType, batch: usize, seq: usize, h: usize, heads: usize, seed: u64) -> Sb {
    let mut r = rng(seed);
    let rows = batch * seq;
    let mut sb = Sb::new();
    let x = sb.input("x", &[batch, seq, h], dt);
    let mask = sb.input("mask", &[batch, seq], DType::I32);
    let wqkv = sb.weight("wqkv", &[h, 3 * h], dt, &mut r);
    let bqkv = sb.weight("bqkv", &[3 * h], dt, &mut r);
    let qkv = sb.scratch((rows * 3 * h * dt.size()) as u64);
    let mm = |a, b, bias, act, residual, out, n, k| matmul(dt, rows, n, k, a, b, false, bias, act, residual, out);
    sb.thunk(mm(x, wqkv, Some(bqkv), None, None, qkv, 3 * h, h));
    let att = sb.scratch((rows * h * dt.size()) as u64);
    sb.thunk(fused_qkv_attention(dt, batch, seq, h, heads, qkv, Some((mask, DType::I32)), att));
    let wo = sb.weight("wo", &[h, h], dt, &mut r);
    let proj = sb.scratch((rows * h * dt.size()) as u64);
    sb.thunk(mm(att, wo, None, None, Some(x), proj, h, h));
    let g1 = sb.weight("ln_g", &[h], dt, &mut r);
    let b1 = sb.weight("ln_b", &[h], dt, &mut r);
    let n1 = sb.scratch((rows * h * dt.size()) as u64);
    sb.thunk(Thunk::Norm { rms: false, dtype: dt, rows, cols: h, eps: 1e-12, x: proj, residual: None, gamma: g1, beta: Some(b1), out: n1 });
    let w1 = sb.weight("w1", &[h, 4 * h], dt, &mut r);
    let bias1 = sb.weight("b1", &[4 * h], dt, &mut r);
    let f1 = sb.scratch((rows * 4 * h * dt.size()) as u64);
    sb.thunk(mm(n1, w1, Some(bias1), Some(Activation::Gelu), None, f1, 4 * h, h));
    let w2 = sb.weight("w2", &[4 * h, h], dt, &mut r);
    let f2 = sb.scratch((rows * h * dt.size()) as u64);
    sb.thunk(mm(f1, w2, None, None, None, f2, h, 4 * h));
    let out = sb.output("out", &[batch, seq, h], dt);
    let st = vec![(seq * h) as u64, h as u64, 1];
    sb.thunk(Thunk::Binary {
        op: BinaryOp::Add,
        dtype: dt,
        out_shape: vec![batch, seq, h],
        a: f2,
        a_strides: st.clone(),
        b: n1,
        b_strides: st,
        out,
    });
    sb
}

fn layer_inputs(dt: DType, batch: usize, seq: usize, h: usize, seed: u64) -> Vec<(String, Tensor)> {
    let mut r = rng(seed);
    let mut mask = vec![1i32; batch * seq];
    for b in 1..batch {
        for j in seq - b.min(seq - 1)..seq {
            mask[b * seq + j] = 0;
        }
    }
    named(vec![
        ("x", rand_tensor(&mut r, &[batch, seq, h], dt)),
        ("mask", Tensor::from_i32(vec![batch, seq], &mask).unwrap_or_else(|e| panic!("{e}"))),
    ])
}

#[test]
fn encoder_layer_matches_cpu_and_replay_equals_eager() {
    let Some(g) = gpu_or_dry() else { return };
    for dt in FLOATS {
        let (batch, seq, h, heads) = (2, 23, 96, 3);
        let (s, w) = layer(dt, batch, seq, h, heads, 11).finish();
        // Half-precision storage between seven thunks (then a LayerNorm that
        // rescales) drifts further than one thunk: a wider band.
        let scale = if dt == DType::F32 { 3.0 } else { 5.0 };
        // The output is FFN2 (sums of 4h products of magnitude ~10) plus the
        // normed input: elements near zero carry the rounding error of the
        // large terms, up to a storage step or two at the output's RMS
        // (bf16 at RMS ~40: ~0.3; f16 measured 0.06).
        check_floor(&format!("encoder layer {dt}"), &g, &s, &w, &layer_inputs(dt, batch, seq, h, 12), scale, 3.0);
    }
}

/// More inputs and outputs than one staging kernel copies (8, `copy_many`),
/// of odd byte sizes: every tensor arrives and returns intact, replayed and
/// eager.
#[test]
fn many_inputs_and_outputs_of_odd_sizes() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(21);
    let mut sb = Sb::new();
    let mut inputs = Vec::new();
    for i in 0..11 {
        let n = 1 + 7 * i + (i % 3);
        let (name, out) = (format!("x{i}"), format!("y{i}"));
        let x = sb.input(&name, &[n], DType::F16);
        let y = sb.output(&out, &[n], DType::F16);
        sb.thunk(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n, x, out: y });
        inputs.push((name, rand_tensor(&mut r, &[n], DType::F16)));
    }
    let (s, w) = sb.finish();
    check("11 inputs and outputs", &g, &s, &w, &inputs, 1.0);
}

/// Programmatic dependent launch is recorded into the replay graphs on
/// Hopper and later: consecutive kernels get programmatic edges.
#[test]
fn programmatic_launch_is_captured() {
    let Some(g) = gpu() else { return };
    let name = g.device_name();
    let major = sm_major(&name);
    let (s, w) = layer(DType::F16, 1, 32, 128, 2, 13).finish();
    let e = g.prepare_cuda(s, w, &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{name}: {}", e.segment_map());
    if major >= 9 {
        assert!(e.programmatic_edges() >= 2, "{name}: no programmatic edges recorded\n{}", e.segment_map());
    }
}

/// The compute capability's major number from the device name ("... (sm_90)").
fn sm_major(name: &str) -> u32 {
    name.rsplit("sm_")
        .next()
        .map(|v| v.trim_end_matches(')'))
        .and_then(|v| v.get(..v.len().saturating_sub(1)))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// On sm_90+ a recorded forward prefetches the weight of every matmul of at
/// most 128 rows into L2 on a second branch of the graph (one per matmul
/// reading a weight), and none for larger matmuls; the prefetched forward
/// matches the CPU backend and replay equals eager (`check`).
#[test]
fn weight_prefetch_is_recorded_for_small_matmuls() {
    let g = gpu();
    let Some(gb) = g.as_ref() else { return };
    let name = gb.device_name();
    let on = sm_major(&name) >= 9;
    for (batch, seq, want) in [(1, 32, 4), (2, 64, 4), (3, 48, 0), (8, 128, 0)] {
        let (s, w) = layer(DType::F16, batch, seq, 128, 2, 31).finish();
        let matmuls = s.thunks.iter().filter(|t| matches!(t, Thunk::MatMul(_))).count();
        assert_eq!(matmuls, 4, "the test layer has four matmuls");
        let e = gb.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        let got = e.weight_prefetches();
        eprintln!("{name}: {batch}x{seq}: {got} prefetches\n{}", e.segment_map());
        assert_eq!(got, if on { want } else { 0 }, "{batch}x{seq} ({} rows)", batch * seq);
        // As encoder_layer_matches_cpu_and_replay_equals_eager (f16).
        check_floor(&format!("prefetched layer {batch}x{seq}"), &g, &s, &w, &layer_inputs(DType::F16, batch, seq, 128, 32), 5.0, 3.0);
    }
}

/// The slots share one activation arena (the calls run in stream order):
/// three encoder-layer calls in flight at a time, each on its own input,
/// each returns exactly what an eager single-slot executable computes for
/// that input.
#[test]
fn pipelined_calls_in_one_arena_return_their_own_results() {
    let Some(g) = gpu() else { return };
    let (batch, seq, h) = (2, 64, 128);
    let (s, w) = layer(DType::F16, batch, seq, h, 2, 51).finish();
    let mut e = g.prepare(s.clone(), w.clone(), &PrepareOptions { slots: 3, ..Default::default() }).unwrap_or_else(|e| panic!("{e}"));
    let mut eager = g
        .prepare(s.clone(), w.clone(), &PrepareOptions { slots: 1, replay: false, ..Default::default() })
        .unwrap_or_else(|e| panic!("{e}"));
    let inputs: Vec<Vec<(String, Tensor)>> = (0..8).map(|i| layer_inputs(DType::F16, batch, seq, h, 60 + i)).collect();
    let want: Vec<Vec<u8>> = inputs
        .iter()
        .map(|inp| {
            let r: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
            eager.run(&r).unwrap_or_else(|e| panic!("{e}"))[0].bytes().to_vec()
        })
        .collect();
    let mut inflight = std::collections::VecDeque::new();
    for round in 0..4 {
        for (i, inp) in inputs.iter().enumerate() {
            let r: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
            inflight.push_back((i, e.submit(&r).unwrap_or_else(|e| panic!("submit: {e}"))));
            if inflight.len() == 3 {
                let (j, t) = inflight.pop_front().unwrap_or_else(|| panic!("queue"));
                let got = e.wait(t).unwrap_or_else(|e| panic!("wait: {e}"));
                assert_eq!(got[0].bytes(), &want[j][..], "round {round}: input {j} got another call's result");
            }
        }
    }
    while let Some((j, t)) = inflight.pop_front() {
        let got = e.wait(t).unwrap_or_else(|e| panic!("wait: {e}"));
        assert_eq!(got[0].bytes(), &want[j][..], "input {j}");
    }
}

/// With `l2_persist` (opt-in), on sm_80+ a replayed executable's
/// kernels carry an L2 access policy window over the whole arena
/// (persisting), and the results do not change: the CPU backend's, replay
/// equal to eager (`check_floor`). Without it, no window.
#[test]
fn arena_accesses_persist_in_l2_when_asked() {
    let g = gpu();
    let Some(gb) = g.as_ref() else { return };
    let name = gb.device_name();
    let (s, w) = layer(DType::F16, 4, 64, 128, 2, 71).finish();
    let persisting = |on: bool| gb.reconfigured(CudaOptions { l2_persist: on, ..gb.options().clone() });
    let window = |on: bool| {
        let e = persisting(on).prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("{}", e.segment_map());
        e.l2_window()
    };
    assert_eq!(window(false), None, "{name}: a window without l2_persist");
    match window(true) {
        Some((bytes, hit)) => {
            assert_eq!(bytes, s.arena_bytes as usize, "{name}: the window covers the arena");
            assert!(hit > 0.0 && hit <= 1.0, "hit ratio {hit}");
        }
        None => assert!(sm_major(&name) < 8, "{name}: no L2 window"),
    }
    check_floor("layer with a persisting arena", &Some(persisting(true)), &s, &w, &layer_inputs(DType::F16, 4, 64, 128, 72), 5.0, 3.0);
}

#[test]
fn weights_update_after_recording() {
    let Some(g) = gpu() else { return };
    let dt = DType::F32;
    let (s, w) = layer(dt, 1, 16, 64, 2, 21).finish();
    let inputs = layer_inputs(dt, 1, 16, 64, 22);
    let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut e = g.prepare(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let before = e.run(&refs).unwrap_or_else(|e| panic!("{e}"));
    let mut r = rng(23);
    w.set("w1", rand_tensor(&mut r, &[64, 256], DType::F32)).unwrap_or_else(|e| panic!("{e}"));
    let after = e.run(&refs).unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(before[0].bytes(), after[0].bytes(), "output did not change after a weight update");
    let cpu = rlx_cpu::CpuBackend::new();
    let want = run(&cpu, &s, &w, &inputs, true).unwrap_or_else(|e| panic!("{e}"));
    assert_close("after weight update", &after[0], &want[0], 3.0);
}

#[test]
fn pipelining_stress_10000_calls() {
    let Some(g) = gpu() else { return };
    let dt = DType::F32;
    let (m, n, k) = (4, 32, 16);
    let mut r = rng(31);
    let mut sb = Sb::new();
    let x = sb.input("x", &[m, k], dt);
    let wb = sb.weight("w", &[k, n], dt, &mut r);
    let out = sb.output("out", &[m, n], dt);
    sb.thunk(Thunk::MatMul(MatMulThunk {
        dtype: dt,
        batch: 1,
        m,
        n,
        k,
        a: x,
        lda: k as u64,
        a_batch_stride: (m * k) as u64,
        b: wb,
        b_trans: false,
        ldb: n as u64,
        b_batch_stride: 0,
        bias: None,
        act: Some(Activation::Relu),
        residual: None,
        out,
    }));
    let (s, w) = sb.finish();
    let wt = w.get("w").unwrap_or_else(|| panic!("weight"));
    let wv = wt.to_f32();
    let expect = |xv: &[f32]| -> Vec<f32> {
        let mut o = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let acc: f64 = (0..k).map(|p| xv[i * k + p] as f64 * wv[p * n + j] as f64).sum();
                o[i * n + j] = acc.max(0.0) as f32;
            }
        }
        o
    };
    let mut e = g
        .prepare(s, w, &PrepareOptions { slots: 3, replay: true, allow_tf32: false, ..PrepareOptions::default() })
        .unwrap_or_else(|e| panic!("{e}"));
    // Warm up, then measure device memory around the stress run.
    let x0 = rand_tensor(&mut r, &[m, k], dt);
    e.run(&[("x", &x0)]).unwrap_or_else(|e| panic!("{e}"));
    let (free0, _) = g.memory_info().unwrap_or_else(|e| panic!("{e}"));
    let mut inflight = std::collections::VecDeque::new();
    let total = 10_000;
    let mut checked = 0;
    for i in 0..total {
        let xv: Vec<f32> = (0..m * k).map(|j| ((i * 31 + j * 7) % 97) as f32 / 50.0 - 0.9).collect();
        let t = Tensor::from_f32(vec![m, k], &xv).unwrap_or_else(|e| panic!("{e}"));
        let ticket = e.submit(&[("x", &t)]).unwrap_or_else(|e| panic!("submit {i}: {e}"));
        inflight.push_back((ticket, xv));
        if inflight.len() == 3 {
            let (ticket, xv) = inflight.pop_front().unwrap_or_else(|| panic!("queue"));
            let got = e.wait(ticket).unwrap_or_else(|e| panic!("wait: {e}"));
            let want = expect(&xv);
            for (a, b) in got[0].to_f32().iter().zip(&want) {
                assert!((a - b).abs() <= 1e-4 + 1e-4 * b.abs(), "call {checked}: {a} vs {b}");
            }
            checked += 1;
        }
    }
    while let Some((ticket, xv)) = inflight.pop_front() {
        let got = e.wait(ticket).unwrap_or_else(|e| panic!("wait: {e}"));
        let want = expect(&xv);
        for (a, b) in got[0].to_f32().iter().zip(&want) {
            assert!((a - b).abs() <= 1e-4 + 1e-4 * b.abs(), "call {checked}: {a} vs {b}");
        }
        checked += 1;
    }
    assert_eq!(checked, total);
    let (free1, _) = g.memory_info().unwrap_or_else(|e| panic!("{e}"));
    let drift = free0 as i64 - free1 as i64;
    eprintln!(
        "pipelining: {total} calls checked; device free memory drift {drift} bytes; host time of last submit {:?}",
        e.stats().last_host_time
    );
    assert!(drift.abs() < 8 << 20, "device memory not flat: {drift} bytes");
}

#[test]
fn busy_bad_ticket_and_dropped_ticket() {
    let Some(g) = gpu() else { return };
    let dt = DType::F32;
    let mut sb = Sb::new();
    let x = sb.input("x", &[64], dt);
    let out = sb.output("y", &[64], dt);
    sb.thunk(Thunk::Activation { act: Activation::Tanh, dtype: dt, n: 64, x, out });
    let (s, w) = sb.finish();
    let mut e = g
        .prepare(s, w, &PrepareOptions { slots: 2, replay: true, allow_tf32: false, ..PrepareOptions::default() })
        .unwrap_or_else(|e| panic!("{e}"));
    let t = Tensor::from_f32(vec![64], &vec![0.5; 64]).unwrap_or_else(|e| panic!("{e}"));
    let a = e.submit(&[("x", &t)]).unwrap_or_else(|e| panic!("{e}"));
    let b = e.submit(&[("x", &t)]).unwrap_or_else(|e| panic!("{e}"));
    match e.submit(&[("x", &t)]) {
        Err(RuntimeError::Busy { slots: 2 }) => {}
        other => panic!("expected Busy, got {other:?}"),
    }
    drop(a);
    // The dropped ticket's slot is free again.
    let c = e.submit(&[("x", &t)]).unwrap_or_else(|e| panic!("after drop: {e}"));
    let bogus = rlx_runtime::Ticket::new(999, 0, Arc::new(Default::default()));
    assert!(matches!(e.wait(bogus), Err(RuntimeError::BadTicket(999))));
    for tk in [b, c] {
        let y = e.wait(tk).unwrap_or_else(|e| panic!("{e}"));
        assert!((y[0].to_f32()[0] - 0.5f32.tanh()).abs() < 1e-6);
    }
}

#[test]
fn input_errors_leave_the_executable_usable() {
    let Some(g) = gpu() else { return };
    let dt = DType::F32;
    let (vocab, dim) = (10, 8);
    let mut r = rng(41);
    let mut sb = Sb::new();
    let table = sb.weight("emb", &[vocab, dim], dt, &mut r);
    let ids = sb.input("ids", &[3], DType::I32);
    let out = sb.output("out", &[3, dim], dt);
    sb.thunk(Thunk::Gather { dtype: dt, id_dtype: DType::I32, n: 3, dim, vocab, table, ids, out });
    let (s, w) = sb.finish();
    let mut e = g.prepare(s, w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let good = Tensor::from_i32(vec![3], &[1, 2, 9]).unwrap_or_else(|e| panic!("{e}"));
    let wrong_shape = Tensor::from_i32(vec![4], &[1, 2, 3, 4]).unwrap_or_else(|e| panic!("{e}"));
    let wrong_dtype = Tensor::from_f32(vec![3], &[1.0, 2.0, 3.0]).unwrap_or_else(|e| panic!("{e}"));
    let bad_id = Tensor::from_i32(vec![3], &[1, 10, -1]).unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(e.run(&[("ids", &wrong_shape)]), Err(RuntimeError::Input { .. })));
    assert!(matches!(e.run(&[("ids", &wrong_dtype)]), Err(RuntimeError::Input { .. })));
    assert!(matches!(e.run(&[("nope", &good)]), Err(RuntimeError::Input { .. })));
    assert!(matches!(e.run(&[]), Err(RuntimeError::Input { .. })));
    let msg = match e.run(&[("ids", &bad_id)]) {
        Err(err) => err.to_string(),
        Ok(_) => panic!("an out-of-range id must be an error"),
    };
    assert!(msg.contains("outside 0..vocab"), "{msg}");
    let y = e.run(&[("ids", &good)]).unwrap_or_else(|e| panic!("still usable: {e}"));
    let emb = w.get("emb").unwrap_or_else(|| panic!("emb")).to_f32();
    assert_eq!(&y[0].to_f32()[..dim], &emb[dim..2 * dim]);
    assert_eq!(&y[0].to_f32()[2 * dim..], &emb[9 * dim..10 * dim]);
}

#[test]
fn state_overflow_is_an_error_and_state_persists() {
    let Some(g) = gpu() else { return };
    let dt = DType::F32;
    let (max_rows, width) = (4, 3);
    let mut sb = Sb::new();
    let value = sb.input("value", &[1, 2, width], dt);
    let pos = sb.input("pos", &[1], DType::I32);
    let state = sb.state("cache", &[1, max_rows, width], dt);
    sb.thunk(Thunk::WriteState {
        dtype: dt,
        value_dtype: dt,
        batch: 1,
        max_rows,
        new_rows: 2,
        width,
        state,
        value,
        position: pos,
        positions_per_batch: false,
    });
    let (s, w) = sb.finish();
    let mut e = g.prepare(s, w, &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    let v = Tensor::from_f32(vec![1, 2, width], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap_or_else(|e| panic!("{e}"));
    let p = |x: i32| Tensor::from_i32(vec![1], &[x]).unwrap_or_else(|e| panic!("{e}"));
    e.run(&[("value", &v), ("pos", &p(0))]).unwrap_or_else(|e| panic!("{e}"));
    e.run(&[("value", &v), ("pos", &p(2))]).unwrap_or_else(|e| panic!("{e}"));
    let err = e.run(&[("value", &v), ("pos", &p(3))]).err().unwrap_or_else(|| panic!("overflow must be an error"));
    assert!(err.to_string().contains("state"), "{err}");
    let c = e.read_state("cache").unwrap_or_else(|e| panic!("{e}")).to_f32();
    assert_eq!(c, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    e.reset_state().unwrap_or_else(|e| panic!("{e}"));
    assert!(e.read_state("cache").unwrap_or_else(|e| panic!("{e}")).to_f32().iter().all(|x| *x == 0.0));
    assert!(e.read_state("missing").is_err());
}

#[test]
fn out_of_memory_is_an_error() {
    let Some(g) = gpu() else { return };
    let mut sb = Sb::new();
    let x = sb.input("x", &[4], DType::F32);
    let out = sb.output("y", &[4], DType::F32);
    // 2^46 bytes: far beyond any GPU.
    let _huge = sb.state("huge", &[1 << 44], DType::F32);
    sb.thunk(Thunk::Activation { act: Activation::Relu, dtype: DType::F32, n: 4, x, out });
    let (s, w) = sb.finish();
    match g.prepare(s, w, &PrepareOptions::default()) {
        Err(RuntimeError::OutOfMemory { requested, free }) => {
            assert_eq!(requested, 1 << 46);
            assert!(free < requested);
        }
        Err(e) => panic!("expected OutOfMemory, got {e}"),
        Ok(_) => panic!("expected OutOfMemory, got an executable"),
    }
}

#[test]
fn missing_device_is_an_error() {
    // Runs with or without a GPU: either no driver or no device 4096.
    match CudaBackend::new(4096) {
        Err(e) => assert!(!e.to_string().is_empty()),
        Ok(_) => panic!("device 4096 cannot exist"),
    }
    let d = rlx_cuda::doctor();
    assert!(d.contains("CUDA driver") && d.contains("NVRTC"), "{d}");
    eprintln!("{d}");
}

#[test]
fn a_schedule_whose_strides_overrun_a_buffer_is_refused_at_prepare() {
    let Some(g) = gpu() else { return };
    let mut sb = Sb::new();
    let x = sb.input("x", &[2, 3], DType::F32);
    let y = sb.input("y", &[2, 3], DType::F32);
    let out = sb.output("out", &[2, 3], DType::F32);
    // Row stride 4 over 24-byte inputs: the kernel would read 28 bytes.
    sb.thunk(Thunk::Binary {
        op: BinaryOp::Add,
        dtype: DType::F32,
        out_shape: vec![2, 3],
        a: x,
        a_strides: vec![4, 1],
        b: y,
        b_strides: vec![3, 1],
        out,
    });
    let (s, w) = sb.finish();
    match g.prepare(s, w, &PrepareOptions::default()) {
        Err(e) => assert!(e.to_string().contains("operand a") && e.to_string().contains("28"), "{e}"),
        Ok(_) => panic!("a read past the input buffer was accepted"),
    }
}
