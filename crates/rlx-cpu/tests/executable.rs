//! The executable around the kernels: submit / wait with several slots,
//! the busy error, dropped tickets, weight updates, prepare-time bounds
//! and support checks, bad inputs.

mod reference;

use std::sync::Arc;

use reference::*;
use rlx_cpu::CpuBackend;
use rlx_ir::{BinaryOp, DType};
use rlx_runtime::{Backend, RuntimeError, Tensor};
use rlx_schedule::{BufRef, Space, Thunk};

/// y = x * w over 4 elements, w a weight.
fn scale_plan(w: &[f64]) -> Plan {
    let mut p = Plan::new();
    let x = p.input("x", &[4], DType::F32);
    let wb = p.weight("w", tensor(&[4], DType::F32, w));
    let out = p.output("y", &[4], DType::F32);
    p.push(Thunk::Binary {
        op: BinaryOp::Mul,
        dtype: DType::F32,
        out_shape: vec![4],
        a: x,
        a_strides: vec![1],
        b: wb,
        b_strides: vec![1],
        out,
    });
    p
}

fn x(v: f64) -> Tensor {
    tensor(&[4], DType::F32, &[v, v + 1.0, v + 2.0, v + 3.0])
}

fn want(v: f64, w: f64) -> Vec<f64> {
    (0..4).map(|i| (v + i as f64) * w).collect()
}

#[test]
fn submit_wait_in_any_order() {
    let mut exe = scale_plan(&[2.0; 4]).prepare(3).expect("prepare");
    let t1 = exe.submit(&[("x", &x(1.0))]).expect("submit 1");
    let t2 = exe.submit(&[("x", &x(10.0))]).expect("submit 2");
    let t3 = exe.submit(&[("x", &x(100.0))]).expect("submit 3");
    assert_close(&exe.wait(t3).expect("wait 3")[0], &want(100.0, 2.0), 0.0, "third");
    assert_close(&exe.wait(t1).expect("wait 1")[0], &want(1.0, 2.0), 0.0, "first");
    assert_close(&exe.wait(t2).expect("wait 2")[0], &want(10.0, 2.0), 0.0, "second");
    assert_eq!(exe.stats().calls, 3);
    assert_eq!(exe.stats().slots, 3);
}

#[test]
fn busy_when_every_slot_holds_a_result_and_dropped_tickets_free_theirs() {
    let mut exe = scale_plan(&[1.0; 4]).prepare(2).expect("prepare");
    let t1 = exe.submit(&[("x", &x(1.0))]).expect("submit 1");
    let t2 = exe.submit(&[("x", &x(2.0))]).expect("submit 2");
    match exe.submit(&[("x", &x(3.0))]) {
        Err(RuntimeError::Busy { slots: 2 }) => {}
        other => panic!("expected Busy, got {other:?}"),
    }
    drop(t1);
    let t3 = exe.submit(&[("x", &x(3.0))]).expect("slot of the dropped ticket is free");
    assert_close(&exe.wait(t3).expect("wait 3")[0], &want(3.0, 1.0), 0.0, "after drop");
    assert_close(&exe.wait(t2).expect("wait 2")[0], &want(2.0, 1.0), 0.0, "kept ticket");
}

#[test]
fn foreign_ticket_is_rejected() {
    let mut a = scale_plan(&[1.0; 4]).prepare(2).expect("prepare a");
    let mut b = scale_plan(&[1.0; 4]).prepare(2).expect("prepare b");
    let ta = a.submit(&[("x", &x(1.0))]).expect("submit");
    match b.wait(ta) {
        Err(RuntimeError::BadTicket(_)) => {}
        other => panic!("expected BadTicket, got {other:?}"),
    }
}

#[test]
fn weight_updates_are_seen_by_the_next_call() {
    let p = scale_plan(&[2.0; 4]);
    let schedule = Arc::new(p.schedule());
    let store = Arc::new(p.store);
    let mut exe = CpuBackend::new().prepare(schedule, store.clone(), &Default::default()).expect("prepare");
    assert_close(&exe.run(&[("x", &x(1.0))]).expect("run")[0], &want(1.0, 2.0), 0.0, "before update");
    store.set("w", tensor(&[4], DType::F32, &[3.0; 4])).expect("update");
    assert_close(&exe.run(&[("x", &x(1.0))]).expect("run")[0], &want(1.0, 3.0), 0.0, "after update");
    // Another dtype is converted to the slot's dtype by the store.
    store.set("w", tensor(&[4], DType::BF16, &[0.5; 4])).expect("update");
    assert_close(&exe.run(&[("x", &x(1.0))]).expect("run")[0], &want(1.0, 0.5), 0.0, "after bf16 update");
}

#[test]
fn out_of_bounds_buffer_is_a_prepare_error() {
    let mut p = scale_plan(&[1.0; 4]);
    if let Thunk::Binary { out, .. } = &mut p.thunks[0] {
        *out = BufRef { space: Space::Arena, offset: 1 << 20, bytes: 16 };
    }
    let err = p.prepare(1).err().expect("bounds error");
    assert!(err.to_string().contains("outside the space"), "{err}");

    // A view that claims more elements than its buffer holds.
    let mut p = scale_plan(&[1.0; 4]);
    if let Thunk::Binary { out_shape, a_strides, b_strides, .. } = &mut p.thunks[0] {
        *out_shape = vec![8];
        *a_strides = vec![1];
        *b_strides = vec![0];
    }
    let err = p.prepare(1).err().expect("extent error");
    assert!(err.to_string().contains("touches"), "{err}");

    // Dims whose product overflows (a malformed or hand-made schedule) must
    // not wrap to a small size that passes the check.
    let mut p = scale_plan(&[1.0; 4]);
    if let Thunk::Binary { out_shape, a_strides, b_strides, .. } = &mut p.thunks[0] {
        *out_shape = vec![1 << 33, 1 << 31, 4];
        *a_strides = vec![0, 0, 1];
        *b_strides = vec![0, 0, 0];
    }
    let err = p.prepare(1).err().expect("overflow error");
    assert!(err.to_string().contains("touches"), "{err}");
}

#[test]
fn writing_a_weight_is_rejected() {
    let mut p = scale_plan(&[1.0; 4]);
    if let Thunk::Binary { out, b, .. } = &mut p.thunks[0] {
        *out = *b;
    }
    let err = p.prepare(1).err().expect("read-only error");
    assert!(err.to_string().contains("read-only"), "{err}");
}

#[test]
fn unsupported_thunk_is_reported() {
    let mut p = Plan::new();
    let xb = p.input("x", &[4], DType::I32);
    let out = p.output("y", &[4], DType::I32);
    let t = Thunk::Activation { act: rlx_ir::Activation::Relu, dtype: DType::I32, n: 4, x: xb, out };
    assert!(!CpuBackend::new().supports(&t));
    p.push(t);
    match p.prepare(1) {
        Err(RuntimeError::Unsupported { thunk, .. }) => assert!(thunk.contains("activation")),
        Err(e) => panic!("expected Unsupported, got {e}"),
        Ok(_) => panic!("expected Unsupported, got an executable"),
    }
}

#[test]
fn bad_inputs_are_errors() {
    let mut exe = scale_plan(&[1.0; 4]).prepare(1).expect("prepare");
    let err = exe.run(&[("nope", &x(1.0))]).expect_err("unknown name");
    assert!(err.to_string().contains("nope"), "{err}");
    let wrong_shape = tensor(&[2, 2], DType::F32, &[1.0; 4]);
    let err = exe.run(&[("x", &wrong_shape)]).expect_err("wrong shape");
    assert!(err.to_string().contains("shape"), "{err}");
    let err = exe.run(&[("x", &x(1.0).to_dtype(DType::F16))]).expect_err("wrong dtype");
    assert!(err.to_string().contains("dtype"), "{err}");
    // Errors do not poison the executable.
    assert_close(&exe.run(&[("x", &x(1.0))]).expect("run")[0], &want(1.0, 1.0), 0.0, "after errors");
}

#[test]
fn missing_weight_is_a_prepare_error() {
    let p = scale_plan(&[1.0; 4]);
    let schedule = Arc::new(p.schedule());
    let err =
        CpuBackend::new().prepare(schedule, Arc::new(rlx_runtime::WeightStore::new()), &Default::default()).err().expect("missing weight");
    assert!(err.to_string().contains("'w'"), "{err}");
}

#[test]
fn own_thread_pool() {
    let p = scale_plan(&[2.0; 4]);
    let schedule = Arc::new(p.schedule());
    let backend = CpuBackend::with_threads(1, rlx_cpu::CpuOptions::default());
    assert_eq!(backend.threads(), 1);
    let mut exe = backend.prepare(schedule, Arc::new(p.store), &Default::default()).expect("prepare");
    assert_close(&exe.run(&[("x", &x(1.0))]).expect("run")[0], &want(1.0, 2.0), 0.0, "one thread");
}

#[test]
fn consts_are_uploaded_once_and_read() {
    let mut p = Plan::new();
    let xb = p.input("x", &[4], DType::F32);
    let c = p.konst(&tensor(&[4], DType::F32, &[0.5, -1.0, 2.0, 4.0]));
    let out = p.output("y", &[4], DType::F32);
    p.push(Thunk::Binary {
        op: BinaryOp::Add,
        dtype: DType::F32,
        out_shape: vec![4],
        a: xb,
        a_strides: vec![1],
        b: c,
        b_strides: vec![1],
        out,
    });
    let mut exe = p.prepare(1).expect("prepare");
    for _ in 0..2 {
        let got = exe.run(&[("x", &x(1.0))]).expect("run");
        assert_close(&got[0], &[1.5, 1.0, 5.0, 8.0], 0.0, "x + const");
    }
}

#[test]
fn run_while_a_submission_is_in_flight_queues_behind_it() {
    let mut exe = scale_plan(&[3.0; 4]).prepare(2).expect("prepare");
    let t = exe.submit(&[("x", &x(1.0))]).expect("submit");
    assert_close(&exe.run(&[("x", &x(5.0))]).expect("run")[0], &want(5.0, 3.0), 0.0, "run behind a submission");
    assert_close(&exe.wait(t).expect("wait")[0], &want(1.0, 3.0), 0.0, "the submission");
    assert_close(&exe.run(&[("x", &x(7.0))]).expect("run")[0], &want(7.0, 3.0), 0.0, "run when idle");
}
