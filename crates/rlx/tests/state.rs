//! State across calls: a decode step appends K/V rows to state tensors at a
//! device-scalar position and attends over the valid prefix. Run step by step
//! it must equal causal attention over the whole sequence computed at once.

mod common;

use common::*;
use rlx::{AttentionSpec, DType, Device, Graph, Session, Tensor};

const H: usize = 4;
const KVH: usize = 2;
const D: usize = 8;
const MAX: usize = 24;

fn spec(causal: bool) -> AttentionSpec {
    AttentionSpec { heads: H, kv_heads: KVH, head_dim: D, scale: 0.35, causal, mask: false, valid_len: false }
}

/// One step: `new` rows of q/k/v at `pos`, attention over `pos + new` keys.
fn step_graph(new: usize) -> Graph {
    let mut g = Graph::new();
    let q = g.input("q", [1, new, H * D], DType::F32).unwrap();
    let k = g.input("k", [1, new, KVH * D], DType::F32).unwrap();
    let v = g.input("v", [1, new, KVH * D], DType::F32).unwrap();
    let pos = g.input("pos", [1], DType::I32).unwrap();
    let len = g.input("len", [1], DType::I32).unwrap();
    let kc = g.state("k_cache", [1, MAX, KVH * D], DType::F32).unwrap();
    let vc = g.state("v_cache", [1, MAX, KVH * D], DType::F32).unwrap();
    let kc = g.write_state(kc, k, pos).unwrap();
    let vc = g.write_state(vc, v, pos).unwrap();
    let o = g.attention(spec(true), q, kc, vc, None, Some(len)).unwrap();
    g.output(o).unwrap();
    g
}

fn full_graph(s: usize) -> Graph {
    let mut g = Graph::new();
    let q = g.input("q", [1, s, H * D], DType::F32).unwrap();
    let k = g.input("k", [1, s, KVH * D], DType::F32).unwrap();
    let v = g.input("v", [1, s, KVH * D], DType::F32).unwrap();
    let o = g.attention(spec(true), q, k, v, None, None).unwrap();
    g.output(o).unwrap();
    g
}

fn rows(x: &[f32], w: usize, from: usize, n: usize) -> Tensor {
    Tensor::from_f32([1, n, w], &x[from * w..(from + n) * w]).unwrap()
}

#[test]
fn incremental_decode_equals_recompute() {
    let mut r = rng(21);
    let total = 13;
    let q = randn(&mut r, total * H * D);
    let k = randn(&mut r, total * KVH * D);
    let v = randn(&mut r, total * KVH * D);
    let s = Session::new(Device::Cpu).unwrap();
    let want = s
        .compile(&full_graph(total))
        .unwrap()
        .run(&[("q", &rows(&q, H * D, 0, total)), ("k", &rows(&k, KVH * D, 0, total)), ("v", &rows(&v, KVH * D, 0, total))])
        .unwrap()[0]
        .to_f32();

    // A 5-token prefill then one token at a time: one executable per step
    // size, each with its own state — so prefill on the decode executable:
    // use the 1-row step for everything to exercise one recorded graph
    // serving every position.
    let mut step = s.compile(&step_graph(1)).unwrap();
    let mut got = vec![];
    for p in 0..total {
        let pos = Tensor::from_i32([1], &[p as i32]).unwrap();
        let len = Tensor::from_i32([1], &[p as i32 + 1]).unwrap();
        let out = step
            .run(&[
                ("q", &rows(&q, H * D, p, 1)),
                ("k", &rows(&k, KVH * D, p, 1)),
                ("v", &rows(&v, KVH * D, p, 1)),
                ("pos", &pos),
                ("len", &len),
            ])
            .unwrap();
        got.extend(out[0].to_f32());
    }
    let want64: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    assert_close("decode vs recompute", &got, &want64, 1e-5);

    // The cache holds exactly the rows written; the rest is still zero.
    let cache = step.read_state("k_cache").unwrap().to_f32();
    assert_eq!(&cache[..total * KVH * D], &k[..]);
    assert!(cache[total * KVH * D..].iter().all(|&x| x == 0.0));

    // Writing past the capacity is an error, not a silent overwrite.
    let pos = Tensor::from_i32([1], &[MAX as i32]).unwrap();
    let len = Tensor::from_i32([1], &[MAX as i32]).unwrap();
    let err = step.run(&[
        ("q", &rows(&q, H * D, 0, 1)),
        ("k", &rows(&k, KVH * D, 0, 1)),
        ("v", &rows(&v, KVH * D, 0, 1)),
        ("pos", &pos),
        ("len", &len),
    ]);
    assert!(err.is_err(), "a write at position {MAX} of a {MAX}-row state must fail");

    // reset_state zeroes the cache.
    step.reset_state().unwrap();
    assert!(step.read_state("k_cache").unwrap().to_f32().iter().all(|&x| x == 0.0));
}

#[test]
fn prefill_then_decode() {
    let mut r = rng(22);
    let (prefill, total) = (6, 11);
    let q = randn(&mut r, total * H * D);
    let k = randn(&mut r, total * KVH * D);
    let v = randn(&mut r, total * KVH * D);
    let s = Session::new(Device::Cpu).unwrap();
    let want = s
        .compile(&full_graph(total))
        .unwrap()
        .run(&[("q", &rows(&q, H * D, 0, total)), ("k", &rows(&k, KVH * D, 0, total)), ("v", &rows(&v, KVH * D, 0, total))])
        .unwrap()[0]
        .to_f32();
    // One executable with a 6-row step writes the prefix, then (a second call
    // on the same state) the 6-row window ending at the last token.
    let mut exe = s.compile(&step_graph(prefill)).unwrap();
    let p0 = Tensor::from_i32([1], &[0]).unwrap();
    let l0 = Tensor::from_i32([1], &[prefill as i32]).unwrap();
    let a = exe
        .run(&[
            ("q", &rows(&q, H * D, 0, prefill)),
            ("k", &rows(&k, KVH * D, 0, prefill)),
            ("v", &rows(&v, KVH * D, 0, prefill)),
            ("pos", &p0),
            ("len", &l0),
        ])
        .unwrap()[0]
        .to_f32();
    let start = total - prefill;
    let p1 = Tensor::from_i32([1], &[start as i32]).unwrap();
    let l1 = Tensor::from_i32([1], &[total as i32]).unwrap();
    let b = exe
        .run(&[
            ("q", &rows(&q, H * D, start, prefill)),
            ("k", &rows(&k, KVH * D, start, prefill)),
            ("v", &rows(&v, KVH * D, start, prefill)),
            ("pos", &p1),
            ("len", &l1),
        ])
        .unwrap()[0]
        .to_f32();
    let w = |from: usize, n: usize| -> Vec<f64> { want[from * H * D..(from + n) * H * D].iter().map(|&x| x as f64).collect() };
    assert_close("prefill", &a, &w(0, prefill), 1e-5);
    assert_close("second window", &b, &w(start, prefill), 1e-5);
}

/// The CPU, and CUDA device 0 when it is usable (required under
/// RLX_REQUIRE_GPU=1).
fn devices() -> Vec<Device> {
    let mut devices = vec![Device::Cpu];
    match Session::new(Device::Cuda(0)) {
        Ok(_) => devices.push(Device::Cuda(0)),
        Err(e) if std::env::var("RLX_REQUIRE_GPU").as_deref() == Ok("1") => panic!("RLX_REQUIRE_GPU=1 but CUDA is unusable: {e}"),
        Err(e) => eprintln!("SKIPPED the CUDA half: no CUDA device ({e})"),
    }
    devices
}

/// A valid_len outside 0..=kv_len is an error on every backend, and the
/// executable stays usable; on CUDA (when present) the same as on the CPU.
#[test]
fn valid_len_out_of_range_is_an_error_on_every_backend() {
    let devices = devices();
    let mut r = rng(23);
    let q = randn(&mut r, H * D);
    let k = randn(&mut r, KVH * D);
    let v = randn(&mut r, KVH * D);
    for device in devices {
        let s = Session::new(device).unwrap();
        let mut exe = s.compile(&step_graph(1)).unwrap();
        let pos = Tensor::from_i32([1], &[0]).unwrap();
        let run = |exe: &mut rlx::CompiledGraph, len: i32| {
            let len = Tensor::from_i32([1], &[len]).unwrap();
            exe.run(&[
                ("q", &rows(&q, H * D, 0, 1)),
                ("k", &rows(&k, KVH * D, 0, 1)),
                ("v", &rows(&v, KVH * D, 0, 1)),
                ("pos", &pos),
                ("len", &len),
            ])
        };
        for bad in [MAX as i32 + 1, -1] {
            let err = run(&mut exe, bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains("valid_len"), "{device}: valid_len {bad} must be an error, got '{err}'");
        }
        // Still usable: one key, so the output is v's head for each query head.
        let out = run(&mut exe, 1).unwrap()[0].to_f32();
        for h in 0..H {
            let kh = h / (H / KVH);
            let want: Vec<f64> = v[kh * D..(kh + 1) * D].iter().map(|&x| x as f64).collect();
            assert_close(&format!("{device} head {h}"), &out[h * D..(h + 1) * D], &want, 1e-5);
        }
    }
}

/// `[b, MAX, 2]` state "c" with one row of x written per batch row at its
/// own position; the output is x + x (a graph needs one).
fn writer(b: usize) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", [b, 1, 2], DType::F32).unwrap();
    let pos = g.input("pos", [b], DType::I32).unwrap();
    let c = g.state("c", [b, MAX, 2], DType::F32).unwrap();
    g.write_state(c, x, pos).unwrap();
    let y = g.add(x, x).unwrap();
    g.output(y).unwrap();
    g
}

/// `Session::compile_shared_at`: a one-row executable at block r of a
/// state set reads and writes row r of the wider executable's state, and
/// nothing else; a block past the shared buffer, or a block without a
/// state set, is an error.
#[test]
fn state_blocks_address_rows_of_a_wider_state() {
    let devices = devices();
    for device in devices {
        let s = Session::new(device).unwrap();
        let set = rlx::StateSet::new();
        let mut wide = s.compile_shared(&writer(3), &set).unwrap();
        let x = Tensor::from_f32([3, 1, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        wide.run(&[("x", &x), ("pos", &Tensor::from_i32([3], &[0, 0, 0]).unwrap())]).unwrap();
        let mut narrow = [1u64, 2].map(|b| s.compile_shared_at(&writer(1), &set, b).unwrap());
        for (k, exe) in narrow.iter_mut().enumerate() {
            let x = Tensor::from_f32([1, 1, 2], &[10.0 + k as f32, 20.0 + k as f32]).unwrap();
            exe.run(&[("x", &x), ("pos", &Tensor::from_i32([1], &[5 + k as i32]).unwrap())]).unwrap();
        }
        let c = wide.read_state("c").unwrap().to_f32();
        let mut want = vec![0f32; 3 * MAX * 2];
        for (r, v) in [(0, [1.0, 2.0]), (1, [3.0, 4.0]), (2, [5.0, 6.0])] {
            want[r * MAX * 2..r * MAX * 2 + 2].copy_from_slice(&v);
        }
        want[MAX * 2 + 5 * 2..MAX * 2 + 5 * 2 + 2].copy_from_slice(&[10.0, 20.0]);
        want[2 * MAX * 2 + 6 * 2..2 * MAX * 2 + 6 * 2 + 2].copy_from_slice(&[11.0, 21.0]);
        assert_eq!(c, want, "{device}: the wide state after the one-row writes");
        // Each one-row executable sees its own row.
        let own = narrow[1].read_state("c").unwrap().to_f32();
        assert_eq!(own, want[2 * MAX * 2..3 * MAX * 2].to_vec(), "{device}: block 2's view");
        narrow[0].reset_state().unwrap();
        let c = wide.read_state("c").unwrap().to_f32();
        assert!(c[MAX * 2..2 * MAX * 2].iter().all(|&v| v == 0.0) && c[..2] == [1.0, 2.0] && c[2 * MAX * 2..2 * MAX * 2 + 2] == [5.0, 6.0]);
        let err = s.compile_shared_at(&writer(1), &set, 3).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("shared state 'c'") && err.contains("at most the buffer's size"), "{device}: block 3: {err}");
        let mut s2 = Session::new(device).unwrap();
        s2.set_prepare_options(rlx::PrepareOptions { state_block: 1, ..s2.prepare_options().clone() });
        let err = s2.compile(&writer(1)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("state block 1 needs states shared through a StateSet"), "{device}: {err}");
    }
}

/// A call submitted, or on the CPU already waited for.
enum Call {
    Pending(rlx::Ticket),
    Done(Vec<Tensor>),
}

/// Executables bound to one state set share one activation arena on CUDA
/// and run in submission order there: a 6-row prefill and two one-row
/// steps submitted back to back (no wait between them, the steps reading
/// the keys the prefill writes) give causal attention over the whole
/// sequence; so do steps after a larger executable joins the set (the
/// arena grows in place) and after the prefill executable is dropped. On
/// the CPU the caller waits between executables, as the contract there
/// asks.
#[test]
fn executables_of_a_state_set_share_the_arena_and_run_in_order() {
    let devices = devices();
    let mut r = rng(24);
    let total = 12;
    let q = randn(&mut r, total * H * D);
    let k = randn(&mut r, total * KVH * D);
    let v = randn(&mut r, total * KVH * D);
    let want = Session::new(Device::Cpu)
        .unwrap()
        .compile(&full_graph(total))
        .unwrap()
        .run(&[("q", &rows(&q, H * D, 0, total)), ("k", &rows(&k, KVH * D, 0, total)), ("v", &rows(&v, KVH * D, 0, total))])
        .unwrap()[0]
        .to_f32();
    let w = |from: usize, n: usize| -> Vec<f64> { want[from * H * D..(from + n) * H * D].iter().map(|&x| x as f64).collect() };
    for device in devices {
        let cpu = device == Device::Cpu;
        // Rows from .. from + n at position `from`, over from + n keys.
        let call = |exe: &mut rlx::CompiledGraph, from: usize, n: usize| -> Call {
            let pos = Tensor::from_i32([1], &[from as i32]).unwrap();
            let len = Tensor::from_i32([1], &[(from + n) as i32]).unwrap();
            let (qt, kt, vt) = (rows(&q, H * D, from, n), rows(&k, KVH * D, from, n), rows(&v, KVH * D, from, n));
            let t = exe.submit(&[("q", &qt), ("k", &kt), ("v", &vt), ("pos", &pos), ("len", &len)]).unwrap();
            if cpu {
                Call::Done(exe.wait(t).unwrap())
            } else {
                Call::Pending(t)
            }
        };
        let out = |exe: &mut rlx::CompiledGraph, c: Call| -> Vec<f32> {
            let o = match c {
                Call::Pending(t) => exe.wait(t).unwrap(),
                Call::Done(o) => o,
            };
            o[0].to_f32()
        };
        let s = Session::new(device).unwrap();
        let set = rlx::StateSet::new();
        let mut prefill = s.compile_shared(&step_graph(6), &set).unwrap();
        let mut step = s.compile_shared(&step_graph(1), &set).unwrap();
        let a = call(&mut prefill, 0, 6);
        let b = call(&mut step, 6, 1);
        let c = call(&mut step, 7, 1);
        assert_close(&format!("{device}: prefill"), &out(&mut prefill, a), &w(0, 6), 1e-5);
        assert_close(&format!("{device}: step at 6"), &out(&mut step, b), &w(6, 1), 1e-5);
        assert_close(&format!("{device}: step at 7"), &out(&mut step, c), &w(7, 1), 1e-5);
        // A larger executable joins (a larger arena), then the prefill goes.
        let mut big = s.compile_shared(&step_graph(12), &set).unwrap();
        drop(prefill);
        let d = call(&mut step, 8, 1);
        assert_close(&format!("{device}: step at 8"), &out(&mut step, d), &w(8, 1), 1e-5);
        // The larger one rewrites every row, then a step reads them.
        let e = call(&mut big, 0, 12);
        let f = call(&mut step, 11, 1);
        assert_close(&format!("{device}: all 12 rows"), &out(&mut big, e), &w(0, 12), 1e-5);
        assert_close(&format!("{device}: step at 11 after them"), &out(&mut step, f), &w(11, 1), 1e-5);
    }
}
