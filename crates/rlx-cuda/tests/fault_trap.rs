//! A kernel fault inside a replayed graph (a trapping kernel recorded into
//! an executable's slots through the test hook). The executable reports a
//! clear error on that call and on every later one, without a hang and
//! without touching freed memory.
//!
//! A device trap is a sticky error: CUDA keeps the process's (primary)
//! context in the error state until the process exits, and every driver
//! call in it fails. RLX opens one primary context per device per process
//! and shares it between backends, so a new session in the same process
//! cannot work either: it gets the same clear error at once. This test
//! asserts exactly that. It is alone in its binary because it poisons the
//! process's GPU for any test that would follow it.

mod common;

use common::{gpu, Sb};
use rlx_cuda::CudaBackend;
use rlx_ir::{Activation, DType};
use rlx_runtime::{Backend, Executable, PrepareOptions, Tensor};
use rlx_schedule::Thunk;

fn relu_schedule() -> (std::sync::Arc<rlx_schedule::Schedule>, std::sync::Arc<rlx_runtime::WeightStore>) {
    let mut sb = Sb::new();
    let x = sb.input("x", &[8], DType::F32);
    let out = sb.output("y", &[8], DType::F32);
    sb.thunk(Thunk::Activation { act: Activation::Relu, dtype: DType::F32, n: 8, x, out });
    sb.finish()
}

fn input() -> Tensor {
    Tensor::from_f32(vec![8], &[-2.0, -1.0, 0.0, 1.0, 2.0, -3.0, 3.0, 0.5]).unwrap_or_else(|e| panic!("{e}"))
}

const RELU: [f32; 8] = [0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 3.0, 0.5];

/// The message every call after the fault must carry.
fn assert_lost(what: &str, e: &str) {
    assert!(
        e.contains("CUDA context of this process is lost") && e.contains("restart the process"),
        "{what}: not the context-lost error: {e}"
    );
}

#[test]
fn a_trap_in_a_replayed_graph_is_a_clear_error_now_and_on_every_later_call() {
    let Some(g) = gpu() else { return };
    let (s, w) = relu_schedule();
    let opts = PrepareOptions { slots: 2, ..PrepareOptions::default() };
    let mut healthy = g.prepare_cuda(s.clone(), w.clone(), &opts).unwrap_or_else(|e| panic!("{e}"));
    let mut faulty = g.prepare_cuda(s.clone(), w.clone(), &opts).unwrap_or_else(|e| panic!("{e}"));
    let x = input();
    for exe in [&mut healthy, &mut faulty] {
        let out = exe.run(&[("x", &x)]).unwrap_or_else(|e| panic!("before the fault: {e}"));
        assert_eq!(out[0].to_f32(), RELU);
    }

    g.inject_trap_for_test(&mut faulty).unwrap_or_else(|e| panic!("injecting the trap: {e}"));
    // Two calls in flight (both slots), then collected. The fault shows at
    // the first wait, or already at a submit when the driver saw it while
    // launching the graphs after the trapping one.
    let first = faulty.submit(&[("x", &x)]);
    let second = faulty.submit(&[("x", &x)]);
    for (which, submitted) in [("the faulting call", first), ("the call beside it", second)] {
        let e = match submitted {
            Ok(t) => faulty.wait(t).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("{which} returned outputs")),
            Err(e) => e.to_string(),
        };
        eprintln!("{which}: {e}");
        assert_lost(which, &e);
    }
    // Every later call, on this executable and on the healthy one sharing the context.
    for i in 0..3 {
        let e = faulty.run(&[("x", &x)]).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("call {i} after the fault ran"));
        assert_lost("a later call", &e);
        let e = healthy.run(&[("x", &x)]).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("a healthy call after the fault ran"));
        assert_lost("another executable's call", &e);
    }
    assert_lost("reset_state", &faulty.reset_state().err().map(|e| e.to_string()).unwrap_or_default());
    // Preparing again, and a new backend (a new session) in the same process: the same error.
    let e = g.prepare(s.clone(), w.clone(), &opts).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("prepare after the fault worked"));
    assert_lost("prepare", &e);
    let e = CudaBackend::new(0).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("a new backend after the fault opened"));
    assert_lost("a new backend", &e);
    // Dropping the executables must not hang or crash.
    drop(faulty);
    drop(healthy);
}
