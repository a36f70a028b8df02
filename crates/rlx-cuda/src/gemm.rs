//! Which cuBLASLt algorithm runs each MatMul thunk: cuBLASLt's first
//! heuristic answer, or the fastest of its answers and their split-K
//! variants, timed at prepare. A timed choice is kept for the life of the
//! process (every executable of a shape then runs the same algorithm, so
//! replay and eager executables give the same bits) and in a file that
//! later processes read instead of timing again (src/gemm_cache.rs).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use rlx_ir::{Activation, DType};
use rlx_runtime::Result;
use rlx_schedule::{MatMulThunk, Space};

use crate::blas::{folded, Blas, LtAlgo, MatMulPlan};
use crate::driver::{err, Event, Func, GraphExec, Stream};
use crate::gemm_cache::{self, Stored};
use crate::launch::{Op, Step};
use crate::modules::Kernels;
use crate::options::{CudaOptions, MatmulChoice};

/// cuBLASLt heuristic answers to time per shape, and the cap on all
/// cuBLASLt candidates (the answers plus split-K variants).
const HEURISTICS: usize = 12;
const MAX_LT: usize = 32;
/// Past this many rows the timed choice keeps cuBLASLt's first answer:
/// timing one GEMM repeated in a graph (its weights hot in L2) picked
/// algorithms there that were not faster in the forward.
const TUNE_MAX_ROWS: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    device: usize,
    dtype: DType,
    tf32: bool,
    rows: usize,
    batch: usize,
    a_batch_stride: u64,
    b_batch_stride: u64,
    /// Minimum alignment of A, B, C, D (the heuristic's answers depend on it).
    aligns: [u32; 4],
    n: usize,
    k: usize,
    lda: u64,
    ldb: u64,
    b_trans: bool,
    bias: bool,
    act: Option<Activation>,
    residual: bool,
}

/// The choices made in this process, per choice file (None: no file).
type Choices = HashMap<(Option<PathBuf>, Key), LtAlgo>;

fn choices() -> &'static Mutex<Choices> {
    static C: OnceLock<Mutex<Choices>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// One timing alternative: enqueues its work once on the stream.
type Enqueue<'a> = dyn Fn(&Stream) -> Result<()> + 'a;

/// Device time of each alternative, in µs per run: each recorded 10 times
/// into a CUDA graph (as replay runs it: no host launch cost in the figure),
/// after a warm-up; the best of 5 graph launches. An alternative that cannot
/// be recorded or launched reads infinite.
fn time_alternatives(stream: &Stream, fill: Option<Func>, alts: &[&Enqueue]) -> Result<Vec<f64>> {
    const REPS: usize = 10;
    let (e0, e1) = (Event::new(true)?, Event::new(true)?);
    let graphs: Vec<Option<GraphExec>> = alts
        .iter()
        .enumerate()
        .map(|(n, alt)| {
            let Ok(g) = GraphExec::capture(stream, fill, None, false, || {
                for _ in 0..REPS {
                    alt(stream)?;
                }
                Ok(())
            }) else {
                return Ok(None);
            };
            // A candidate the driver refuses to launch is dropped, not fatal;
            // one that faults on the device has poisoned the context, so the
            // error is reported here rather than at some later call.
            if g.launch(stream).is_err() {
                return Ok(None);
            }
            stream.synchronize().map_err(|e| err(format!("matmul timing: candidate {n} of {} faulted on the device: {e}", alts.len())))?;
            Ok(Some(g))
        })
        .collect::<Result<_>>()?;
    // Clocks ramp up under load: about a millisecond of work first (each
    // launch is REPS matmuls of 3-50 µs), at least two rounds.
    let rounds = (24 / alts.len().max(1)).clamp(2, 20);
    for _ in 0..rounds {
        for g in graphs.iter().flatten() {
            g.launch(stream)?;
        }
    }
    let mut best = vec![f64::INFINITY; alts.len()];
    for _ in 0..5 {
        for (i, g) in graphs.iter().enumerate() {
            let Some(g) = g else { continue };
            e0.record(stream)?;
            g.launch(stream)?;
            e1.record(stream)?;
            e1.synchronize()?;
            best[i] = best[i].min(Event::elapsed_ms(&e0, &e1)? as f64 * 1000.0 / REPS as f64);
        }
    }
    Ok(best)
}

/// Index and value of the smallest entry.
fn argmin(v: &[f64]) -> (usize, f64) {
    v.iter().enumerate().fold((0, f64::INFINITY), |(bi, bv), (i, x)| if *x < bv { (i, *x) } else { (bi, bv) })
}

/// Puts the chosen cuBLASLt algorithm into a thunk's lowered steps.
pub(crate) fn set_algo(steps: &mut [Step], a: &LtAlgo) {
    for st in steps {
        if let Op::MatMul(call) = &mut st.op {
            call.algo = a.algo;
        }
    }
}

/// The cuBLASLt algorithm for this thunk under `opts.matmul`, and how many
/// candidates were considered (0 when nothing was timed); timed choices are
/// made the first time a shape is seen and kept for the process. `library`
/// are the thunk's steps with this slot's pointers (the MatMul, then our
/// epilogue kernel if any); timing writes the thunk's (arena) output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn choose(
    device: usize,
    stream: &Stream,
    k: &Kernels,
    t: &MatMulThunk,
    blas: &Blas,
    plan: &MatMulPlan,
    library: &[Step],
    opts: &CudaOptions,
) -> Result<(LtAlgo, usize)> {
    let default = plan.algo;
    let (rows, batch) = folded(t);
    if let MatmulChoice::Candidate(i) = opts.matmul {
        let lt = plan.candidates(blas, HEURISTICS);
        return Ok((lt.get(i).copied().unwrap_or(default), lt.len().min(MAX_LT)));
    }
    // Timing writes the output: only an arena output may be written at prepare.
    if opts.matmul == MatmulChoice::Heuristic || t.out.space != Space::Arena || rows * batch > TUNE_MAX_ROWS {
        return Ok((default, 0));
    }
    let key = Key {
        device,
        dtype: t.dtype,
        tf32: plan.tf32,
        rows,
        batch,
        a_batch_stride: t.a_batch_stride,
        b_batch_stride: t.b_batch_stride,
        aligns: plan.aligns(),
        n: t.n,
        k: t.k,
        lda: t.lda,
        ldb: t.ldb,
        b_trans: t.b_trans,
        bias: t.bias.is_some(),
        act: t.act,
        residual: t.residual.is_some(),
    };
    let table_key = (opts.gemm_cache.clone(), key.clone());
    if let Some(c) = choices().lock().map_err(|_| err("gemm choice table lock poisoned"))?.get(&table_key) {
        return Ok((*c, 0));
    }
    // A choice timed by an earlier process, used only if cuBLASLt still
    // accepts the algorithm for this plan.
    let disk_key = gemm_cache::key(&k.timing_context(), &format!("{:?}", Key { device: 0, ..key }));
    let stored = opts.gemm_cache.as_deref().and_then(|f| gemm_cache::get(f, &disk_key)).and_then(|Stored(data)| {
        let algo = cudarc::cublaslt::sys::cublasLtMatmulAlgo_t { data };
        plan.accepts(blas, &algo).then(|| LtAlgo::describe(algo))
    });
    if let Some(c) = stored {
        let mut table = choices().lock().map_err(|_| err("gemm choice table lock poisoned"))?;
        return Ok((*table.entry(table_key).or_insert(c), 0));
    }
    let mut lt = plan.candidates(blas, HEURISTICS);
    lt.truncate(MAX_LT);
    let Some(Op::MatMul(call)) = library.first().map(|s| &s.op) else {
        return Err(err("matmul steps do not start with the cuBLASLt call"));
    };
    let rest = &library[1..];
    let alts: Vec<Box<Enqueue<'_>>> = lt
        .iter()
        .map(|a| {
            let algo = a.algo;
            Box::new(move |s: &Stream| -> Result<()> {
                call.enqueue_algo(s, &algo)?;
                rest.iter().try_for_each(|st| st.enqueue(s))
            }) as Box<Enqueue<'_>>
        })
        .collect();
    let alts: Vec<&Enqueue> = alts.iter().map(|b| b.as_ref()).collect();
    let us = time_alternatives(stream, k.get("fill_pitched").ok(), &alts)?;
    // A non-default choice must be clearly faster (3 %: timing noise), so a
    // tie never moves a shape off cuBLASLt's first answer.
    let (li, lv) = argmin(&us);
    let pick = if li != 0 && lv < 0.97 * us[0] { (lt[li], lv) } else { (default, us[0]) };
    if opts.trace {
        let ll: Vec<String> = lt.iter().zip(&us).map(|(a, u)| format!("{}:{u:.2}", a.label())).collect();
        eprintln!(
            "rlx-cuda gemm {rows}x{}x{} {} batch {batch}: -> cublasLt {} {:.2}us (default {:.2}us); candidates [{}]",
            t.n,
            t.k,
            t.dtype,
            pick.0.label(),
            pick.1,
            us[0],
            ll.join(" ")
        );
    }
    // Nothing could be timed (the default included): the default, not stored.
    let timed = pick.1.is_finite();
    let pick = if timed { pick.0 } else { default };
    if let (Some(f), true) = (&opts.gemm_cache, timed) {
        gemm_cache::put(f, &disk_key, Stored(pick.algo.data));
    }
    // A prepare on another thread may have decided this shape meanwhile:
    // the first decision stands, so every executable of a shape runs the
    // same algorithm (same bits).
    let mut table = choices().lock().map_err(|_| err("gemm choice table lock poisoned"))?;
    Ok((*table.entry(table_key).or_insert(pick), lt.len()))
}
