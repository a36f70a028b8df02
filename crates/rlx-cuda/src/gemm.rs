//! Our own skinny-M matmul (kernels/gemm.cu) against cuBLASLt: which MatMul
//! thunks it can run, its tilings, and the per-shape choice, made by timing
//! both at prepare and kept for the life of the process (every executable of
//! a shape then runs the same kernel, so replay and eager executables give
//! the same bits).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use rlx_compile::{MatMulThunk, Space};
use rlx_ir::{Activation, DType};
use rlx_runtime::Result;

use crate::blas::folded;
use crate::driver::{err, Event, GraphExec, Stream};
use crate::launch::{Bases, Kernels, Op, Step};

/// Rows per block and K per pipeline stage (kernels/gemm.cu).
const BM: usize = 128;
const BK: usize = 64;
const STAGES: usize = 4;
/// Few-row GEMMs only: past this, cuBLASLt's large tiles are the right tool.
const MAX_ROWS: usize = 1024;

/// One tiling of the own kernel: `bn` columns per block, K split `split` ways.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GemmCfg {
    pub bn: usize,
    pub split: usize,
}

/// How MatMul thunks pick their kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPolicy {
    /// Time the own kernel's tilings against cuBLASLt at prepare; keep the
    /// fastest (`RLX_GEMM=auto`).
    Auto,
    /// cuBLASLt (+ epilogue kernel) always: the default until the own
    /// kernel measures faster (bench/gpu-perf.md, 2026-11-30 session 2).
    Library,
    /// The own kernel wherever it applies, in its fastest tiling (`RLX_GEMM=own`).
    Own,
    /// The own kernel in this tiling (columns per block, K split) wherever
    /// the tiling applies, cuBLASLt elsewhere (tests of each tiling).
    Tiling(usize, usize),
}

static POLICY: Mutex<Option<GemmPolicy>> = Mutex::new(None);

/// Sets the process-wide policy (overrides `RLX_GEMM`). Choices already made
/// for a shape are forgotten, so the next prepare decides again.
pub fn set_gemm_policy(p: GemmPolicy) {
    if let Ok(mut g) = POLICY.lock() {
        *g = Some(p);
    }
    if let Ok(mut c) = choices().lock() {
        c.clear();
    }
}

fn policy() -> GemmPolicy {
    let Ok(mut g) = POLICY.lock() else { return GemmPolicy::Library };
    *g.get_or_insert_with(|| match std::env::var("RLX_GEMM").as_deref().map(str::trim) {
        Ok("auto") => GemmPolicy::Auto,
        Ok("own") => GemmPolicy::Own,
        _ => GemmPolicy::Library,
    })
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    device: usize,
    dtype: DType,
    rows: usize,
    n: usize,
    k: usize,
    lda: u64,
    ldb: u64,
    b_trans: bool,
    bias: bool,
    act: Option<Activation>,
    residual: bool,
}

fn choices() -> &'static Mutex<HashMap<Key, Option<GemmCfg>>> {
    static C: OnceLock<Mutex<HashMap<Key, Option<GemmCfg>>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// Whether the own kernel can run this thunk by shape alone (pointers are
/// checked by `eligible`).
fn shape_ok(t: &MatMulThunk) -> bool {
    let (rows, batch) = folded(t);
    matches!(t.dtype, DType::F16 | DType::BF16)
        && batch == 1
        && rows <= MAX_ROWS
        && t.k.is_multiple_of(BK)
        && t.n.is_multiple_of(32)
        && t.lda.is_multiple_of(8)
        && t.ldb.is_multiple_of(8)
        && t.out.space == Space::Arena
}

/// Shape, alignment of every pointer, and an arena output (timing writes it).
pub(crate) fn eligible(t: &MatMulThunk, b: &Bases) -> Result<bool> {
    if !shape_ok(t) {
        return Ok(false);
    }
    let mut ptrs = vec![b.ptr(&t.a)?, b.ptr(&t.b)?, b.ptr(&t.out)?];
    for x in [&t.bias, &t.residual].into_iter().flatten() {
        ptrs.push(b.ptr(x)?);
    }
    Ok(ptrs.iter().all(|p| p.is_multiple_of(16)))
}

fn tiles(rows: usize, n: usize, bn: usize) -> usize {
    (n / bn) * rows.div_ceil(BM)
}

/// The tilings worth timing: 32 or 64 columns per block, K split up to 8
/// ways, at most 4 blocks per SM in all.
pub(crate) fn candidates(t: &MatMulThunk, sm_count: usize) -> Vec<GemmCfg> {
    let (rows, _) = folded(t);
    let mut v = Vec::new();
    for bn in [32, 64] {
        if !t.n.is_multiple_of(bn) {
            continue;
        }
        for split in [1, 2, 3, 4, 6, 8] {
            if t.k.is_multiple_of(BK * split) && tiles(rows, t.n, bn) * split <= 4 * sm_count {
                v.push(GemmCfg { bn, split });
            }
        }
    }
    v
}

/// (workspace bytes, counters) the own kernel may need for this thunk in
/// any candidate tiling: the executable allocates the maximum once.
pub(crate) fn scratch_need(t: &MatMulThunk, sm_count: usize) -> (u64, usize) {
    if !shape_ok(t) {
        return (0, 0);
    }
    let (rows, _) = folded(t);
    candidates(t, sm_count).iter().filter(|c| c.split > 1).fold((0, 0), |(w, n), c| {
        let tl = tiles(rows, t.n, c.bn);
        (w.max((tl * c.split * BM * c.bn * 4) as u64), n.max(tl))
    })
}

/// The own kernel's launch for one slot.
pub(crate) fn step(k: &Kernels, t: &MatMulThunk, b: &Bases, cfg: GemmCfg, ws: u64, counters: u64) -> Result<Step> {
    let (rows, _) = folded(t);
    let dt = if t.dtype == DType::BF16 { "bf16" } else { "f16" };
    let func = k.get(&format!("gemm_{}_{}_{dt}", cfg.bn, if t.b_trans { "t" } else { "n" }))?;
    let opt = |x: &Option<rlx_compile::BufRef>| -> Result<u64> { x.as_ref().map(|r| b.ptr(r)).transpose().map(|p| p.unwrap_or(0)) };
    let args = vec![
        b.ptr(&t.a)?,
        b.ptr(&t.b)?,
        opt(&t.bias)?,
        opt(&t.residual)?,
        b.ptr(&t.out)?,
        ws,
        counters,
        rows as u64,
        t.n as u64,
        t.k as u64,
        t.lda,
        t.ldb,
        crate::launch::act_code(t.act) as u64,
        (t.k / cfg.split) as u64,
    ];
    let grid = [(t.n / cfg.bn) as u32, rows.div_ceil(BM) as u32, cfg.split as u32];
    // STAGES x (A tile [BM][BK+8] + B tile [BN][BK+8] or [BK][BN+8]), then
    // the residual tile [BM][BN] and the bias slice [BN]; 2-byte elements.
    let b_elems = if t.b_trans { cfg.bn * (BK + 8) } else { BK * (cfg.bn + 8) };
    let smem = ((STAGES * (BM * (BK + 8) + b_elems) + BM * cfg.bn + cfg.bn) * 2) as u32;
    func.set_max_dynamic_smem(smem)?;
    Ok(Step::new(Op::Kernel { func, grid, block: 128, smem, args }, "matmul"))
}

/// Device time of each alternative (a list of steps), in µs per run: each
/// recorded 10 times into a CUDA graph (as replay runs it: no host launch
/// cost in the figure), after a warm-up; the best of 5 graph launches.
fn time_alternatives(stream: &Stream, alts: &[&[Step]]) -> Result<Vec<f64>> {
    const REPS: usize = 10;
    let (e0, e1) = (Event::new(true)?, Event::new(true)?);
    let graphs: Vec<GraphExec> = alts
        .iter()
        .map(|alt| {
            GraphExec::capture(stream, || {
                for _ in 0..REPS {
                    for st in alt.iter() {
                        st.enqueue(stream)?;
                    }
                }
                Ok(())
            })
        })
        .collect::<Result<_>>()?;
    // Clocks ramp up under load: about a millisecond of work first.
    for _ in 0..20 {
        for g in &graphs {
            g.launch(stream)?;
        }
    }
    let mut best = vec![f64::INFINITY; alts.len()];
    for _ in 0..5 {
        for (i, g) in graphs.iter().enumerate() {
            e0.record(stream)?;
            g.launch(stream)?;
            e1.record(stream)?;
            e1.synchronize()?;
            best[i] = best[i].min(Event::elapsed_ms(&e0, &e1)? as f64 * 1000.0 / REPS as f64);
        }
    }
    Ok(best)
}

/// The kernel for this thunk: Some(tiling) for the own kernel, None for
/// cuBLASLt. `library` are the cuBLASLt steps with this slot's pointers
/// (timed against the own tilings the first time a shape is seen).
#[allow(clippy::too_many_arguments)]
pub(crate) fn choose(
    device: usize,
    stream: &Stream,
    k: &Kernels,
    t: &MatMulThunk,
    b: &Bases,
    library: &[Step],
    ws: u64,
    counters: u64,
) -> Result<Option<GemmCfg>> {
    let pol = policy();
    if pol == GemmPolicy::Library || !eligible(t, b)? {
        return Ok(None);
    }
    let (rows, _) = folded(t);
    let key = Key {
        device,
        dtype: t.dtype,
        rows,
        n: t.n,
        k: t.k,
        lda: t.lda,
        ldb: t.ldb,
        b_trans: t.b_trans,
        bias: t.bias.is_some(),
        act: t.act,
        residual: t.residual.is_some(),
    };
    if let Some(c) = choices().lock().map_err(|_| err("gemm choice table lock poisoned"))?.get(&key) {
        return Ok(*c);
    }
    let cands = candidates(t, k.sm_count as usize);
    if let GemmPolicy::Tiling(bn, split) = pol {
        let c = GemmCfg { bn, split };
        return Ok(cands.contains(&c).then_some(c));
    }
    if cands.is_empty() {
        return Ok(None);
    }
    let own: Vec<Step> = cands.iter().map(|c| step(k, t, b, *c, ws, counters)).collect::<Result<_>>()?;
    let mut alts: Vec<&[Step]> = vec![library];
    alts.extend(own.iter().map(std::slice::from_ref));
    let us = time_alternatives(stream, &alts)?;
    let (bi, own_best) = us[1..].iter().enumerate().fold((0, f64::INFINITY), |(bi, bv), (i, v)| if *v < bv { (i, *v) } else { (bi, bv) });
    // Auto keeps cuBLASLt unless ours is clearly faster (3%: timing noise).
    let pick = if pol == GemmPolicy::Own || own_best < 0.97 * us[0] { Some(cands[bi]) } else { None };
    if std::env::var("RLX_TRACE").map(|v| v == "1").unwrap_or(false) {
        let list: Vec<String> = cands.iter().zip(&us[1..]).map(|(c, u)| format!("{}x{}:{u:.2}", c.bn, c.split)).collect();
        eprintln!("rlx-cuda gemm {rows}x{}x{} {}: cublasLt {:.2}us, own [{}] -> {pick:?}", t.n, t.k, t.dtype, us[0], list.join(" "));
    }
    choices().lock().map_err(|_| err("gemm choice table lock poisoned"))?.insert(key, pick);
    Ok(pick)
}
