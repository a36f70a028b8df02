//! Our own skinny-M matmul (kernels/gemm.cu: mma.sync, any sm_90 device;
//! kernels/gemm_wgmma.cu: TMA + wgmma, cc 9.0 only, B as [N, K]) against
//! cuBLASLt: which MatMul thunks it can run, its tilings, and the per-shape
//! choice, made by timing both at prepare and kept for the life of the
//! process (every executable of a shape then runs the same kernel, so replay
//! and eager executables give the same bits) and in a file that later
//! processes read instead of timing again (src/gemm_cache.rs).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use rlx_compile::{MatMulThunk, Space};
use rlx_ir::{Activation, DType};
use rlx_runtime::Result;

use crate::blas::{folded, Blas, LtAlgo, MatMulPlan};
use crate::driver::{err, Event, Func, GraphExec, Stream};
use crate::gemm_cache::{self, Stored};
use crate::launch::{Bases, Kernels, Op, Step};

/// cuBLASLt heuristic answers to time per shape, and the cap on all
/// cuBLASLt candidates (the answers plus split-K variants).
const HEURISTICS: usize = 12;
const MAX_LT: usize = 32;

/// Rows per block and K per pipeline stage (kernels/gemm.cu).
const BM: usize = 128;
const BK: usize = 64;
/// Most pipeline stages, and the dynamic shared memory a block may have on
/// sm_90 (227 KB).
const MAX_STAGES: usize = 8;
const MAX_SMEM: usize = 227 * 1024;
/// Most blocks of a K split: one thread-block cluster (portable size).
const MAX_SPLIT: usize = 8;
/// (columns per block, warps) of the compiled variants (kernels/gemm.cu).
const VARIANTS: [(usize, usize); 4] = [(32, 8), (64, 8), (64, 16), (128, 16)];
/// The wgmma + TMA kernel (kernels/gemm_wgmma.cu, sm_90a): its warps (two
/// consumer warpgroups and a producer warp) stand in for `warps` in a
/// tiling, and its columns per block. B as [N, K] only.
const WG_WARPS: usize = 9;
const WG_BNS: [usize; 3] = [32, 64, 128];
/// (columns, A multicast factor) of the compiled multicast variants.
const WG_MC: [(usize, usize); 5] = [(32, 2), (32, 4), (64, 2), (64, 4), (128, 2)];
/// Its shared memory: mbarriers, alignment slack to the 1024-byte boundary
/// the 128-byte swizzle needs, then the stages.
const WG_SMEM_HEAD: usize = 256 + 1024;
/// Few-row GEMMs only: past this, cuBLASLt's large tiles are the right tool.
const MAX_ROWS: usize = 1024;
/// Past this many rows `Library` and `Auto` keep cuBLASLt's first answer:
/// timing one GEMM repeated in a graph (its weights hot in L2) picked
/// algorithms 3-6 % faster there that were not faster in the forward.
const TUNE_MAX_ROWS: usize = 1024;

/// One tiling of the own kernel: `bn` columns per block, `warps` warps, K
/// split `split` ways across a cluster of `split` blocks; `mc` > 1 (wgmma
/// kernel only): clusters also span `mc` N-tiles, which share each A tile
/// by TMA multicast.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GemmCfg {
    pub bn: usize,
    pub warps: usize,
    pub split: usize,
    pub mc: usize,
}

/// How MatMul thunks pick their kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPolicy {
    /// cuBLASLt's first heuristic answer (+ epilogue kernel), nothing timed
    /// (`RLX_GEMM=heuristic`; the default before 2026-11-30 session 2).
    Heuristic,
    /// cuBLASLt; for GEMMs of at most `TUNE_MAX_ROWS` rows its algorithm is
    /// timed per shape at prepare among the heuristic's answers and their
    /// split-K variants, larger ones take the first answer
    /// (`RLX_GEMM=cublas`; the default).
    Library,
    /// As `Library` at every row count (`RLX_GEMM=cublas-all`): at 4096 rows
    /// the graph-timed winner did not hold up in the forward
    /// (bench/gpu-perf.md, session 2 helper 2), so this is for experiments.
    LibraryAll,
    /// As `Library`, with the own kernel's tilings timed among them
    /// (`RLX_GEMM=auto`).
    Auto,
    /// The own kernel wherever it applies, in its fastest tiling (`RLX_GEMM=own`).
    Own,
    /// The own kernel in this tiling (columns per block, warps, K split, A
    /// multicast factor) wherever the tiling applies, cuBLASLt elsewhere
    /// (tests of each tiling).
    Tiling(usize, usize, usize, usize),
    /// cuBLASLt's i-th timing candidate (the default if there are fewer),
    /// nothing timed or cached (tests of every candidate).
    LtCandidate(usize),
}

/// Without `RLX_GEMM` or `set_gemm_policy`.
const DEFAULT_POLICY: GemmPolicy = GemmPolicy::Library;

static POLICY: Mutex<Option<GemmPolicy>> = Mutex::new(None);

/// Sets the process-wide policy (overrides `RLX_GEMM`). Choices already made
/// for a shape are forgotten, so the next prepare decides again. `Auto`,
/// `Own` and `Tiling` run the own kernels: they pass the GPU suite (the real
/// MiniLM model included) but were not faster than cuBLASLt in the forward on
/// the H200 (bench/gpu-perf.md, session 5), so they are not the default.
pub fn set_gemm_policy(p: GemmPolicy) {
    if let Ok(mut g) = POLICY.lock() {
        *g = Some(p);
    }
    if let Ok(mut c) = choices().lock() {
        c.clear();
    }
    gemm_cache::forget();
}

/// The policies whose choices come from timing (and so are worth keeping on disk).
fn timed_policy(p: GemmPolicy) -> bool {
    matches!(p, GemmPolicy::Library | GemmPolicy::LibraryAll | GemmPolicy::Auto | GemmPolicy::Own)
}

fn policy() -> GemmPolicy {
    let Ok(mut g) = POLICY.lock() else { return DEFAULT_POLICY };
    *g.get_or_insert_with(|| match std::env::var("RLX_GEMM").as_deref().map(str::trim) {
        Ok("auto") => GemmPolicy::Auto,
        Ok("own") => GemmPolicy::Own,
        Ok("cublas") | Ok("library") => GemmPolicy::Library,
        Ok("cublas-all") => GemmPolicy::LibraryAll,
        Ok("heuristic") => GemmPolicy::Heuristic,
        Ok(other) => {
            // A typo must not silently measure something else.
            eprintln!("rlx-cuda: RLX_GEMM={other:?} is not one of auto, own, cublas, cublas-all, heuristic; using the default");
            DEFAULT_POLICY
        }
        Err(_) => DEFAULT_POLICY,
    })
}

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

/// What runs a MatMul thunk.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Choice {
    /// cuBLASLt with this algorithm (+ our epilogue kernel where needed).
    Lt(LtAlgo),
    /// The own kernel in this tiling.
    Own(GemmCfg),
}

impl Choice {
    /// Short form for traces and tests.
    pub fn label(&self) -> String {
        match self {
            Choice::Lt(a) => format!("cublasLt {}", a.label()),
            Choice::Own(c) => format!("own {}", c.label()),
        }
    }
}

impl GemmCfg {
    fn label(&self) -> String {
        let wg = if self.warps == WG_WARPS { "wg" } else { "" };
        let mc = if self.mc > 1 { format!("mc{}", self.mc) } else { String::new() };
        format!("{wg}{}/{}wx{}{mc}", self.bn, self.warps, self.split)
    }
}

fn choices() -> &'static Mutex<HashMap<Key, Choice>> {
    static C: OnceLock<Mutex<HashMap<Key, Choice>>> = OnceLock::new();
    C.get_or_init(Default::default)
}

/// Whether the own kernel can run this thunk by shape alone (pointers are
/// checked by `eligible`), on a GPU with thread-block clusters (sm_90+).
fn shape_ok(k: &Kernels, t: &MatMulThunk) -> bool {
    let (rows, batch) = folded(t);
    k.clusters
        && matches!(t.dtype, DType::F16 | DType::BF16)
        && batch == 1
        && rows <= MAX_ROWS
        && t.k.is_multiple_of(BK)
        && t.n.is_multiple_of(32)
        && t.lda.is_multiple_of(8)
        && t.ldb.is_multiple_of(8)
        && t.out.space == Space::Arena
}

/// Shape, alignment of every pointer, and an arena output (timing writes it).
pub(crate) fn eligible(k: &Kernels, t: &MatMulThunk, b: &Bases) -> Result<bool> {
    if !shape_ok(k, t) {
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

/// The tilings worth timing: every compiled variant whose columns divide
/// N, K split up to `MAX_SPLIT` ways in whole BK tiles, at most two blocks
/// per SM in all; the multicast variants where the N-tiles group by `mc`,
/// the cluster stays within 8 blocks and every K tile has its own stage.
pub(crate) fn candidates(k: &Kernels, t: &MatMulThunk) -> Result<Vec<GemmCfg>> {
    let (rows, _) = folded(t);
    let sm_count = k.sm_count as usize;
    let mut v = Vec::new();
    let wg_ok = k.own_gemm()?.wgmma && t.b_trans;
    let wg = WG_BNS.iter().filter(|_| wg_ok).map(|bn| (*bn, WG_WARPS, 1));
    let mc = WG_MC.iter().filter(|_| wg_ok).map(|(bn, mc)| (*bn, WG_WARPS, *mc));
    let plain = VARIANTS.iter().map(|(bn, warps)| (*bn, *warps, 1));
    for (bn, warps, mc) in plain.chain(wg).chain(mc) {
        if !t.n.is_multiple_of(bn * mc) {
            continue;
        }
        for split in [1, 2, 3, 4, 6, 8] {
            let cfg = GemmCfg { bn, warps, split, mc };
            let fits = mc == 1 || (mc * split <= MAX_SPLIT && wg_launch_smem(t, cfg).0 * BK * split >= t.k);
            if split <= MAX_SPLIT && t.k.is_multiple_of(BK * split) && tiles(rows, t.n, bn) * split <= 2 * sm_count && fits {
                v.push(cfg);
            }
        }
    }
    Ok(v)
}

/// (pipeline stages, dynamic shared memory bytes) of a launch: the whole
/// K-chunk in flight where it fits (at least two stages). Layout as in
/// kernels/gemm.cu: bias slice [bn], residual share [ceil(BM/split)][bn],
/// then the stages (A tile [BM][BK+8] each, then B tiles [bn][BK+8] or
/// [BK][bn+8]), which the f32 partial tile [BM][bn+8] reuses.
fn launch_smem(t: &MatMulThunk, cfg: GemmCfg) -> (usize, usize) {
    if cfg.warps == WG_WARPS {
        return wg_launch_smem(t, cfg);
    }
    let b_elems = if t.b_trans { cfg.bn * (BK + 8) } else { BK * (cfg.bn + 8) };
    let stage = (BM * (BK + 8) + b_elems) * 2;
    let fixed = cfg.bn * 2 + if t.residual.is_some() { BM.div_ceil(cfg.split) * cfg.bn * 2 } else { 0 };
    let partial = BM * (cfg.bn + 8) * 4;
    let nk = t.k / cfg.split / BK;
    let mut stages = nk.clamp(2, MAX_STAGES);
    while stages > 2 && fixed + stage * stages > MAX_SMEM {
        stages -= 1;
    }
    (stages, fixed + (stage * stages).max(partial))
}

/// As `launch_smem` for the wgmma kernel: after the head, the bias slice
/// [bn] and residual share [ceil(BM/split)][bn], then stages of an A tile
/// [BM][BK] and a B tile [bn][BK] (no padding: the swizzle spreads the
/// banks), as many as the K-chunk has tiles where they fit; the f32
/// partial tile [BM][bn+8] reuses them.
fn wg_launch_smem(t: &MatMulThunk, cfg: GemmCfg) -> (usize, usize) {
    let head = WG_SMEM_HEAD + cfg.bn * 2 + if t.residual.is_some() { BM.div_ceil(cfg.split) * cfg.bn * 2 } else { 0 };
    let stage = (BM + cfg.bn) * BK * 2;
    let nk = t.k / cfg.split / BK;
    let stages = nk.min((MAX_SMEM - head) / stage).max(1);
    let partial = BM * (cfg.bn + 8) * 4;
    (stages, head + (stage * stages).max(partial))
}

/// A 2-D tensor map over a row-major [rows, cols] matrix of 2-byte
/// elements, `ld` elements per row: boxes of [box_rows][BK] with the
/// 128-byte swizzle, rows past the end read as zeros.
fn tensor_map(dt: DType, ptr: u64, rows: usize, cols: usize, ld: u64, box_rows: usize) -> Result<[u64; 16]> {
    use cudarc::driver::sys;
    let ty = if dt == DType::BF16 {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    } else {
        sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16
    };
    let dims = [cols as u64, rows as u64];
    let strides = [ld * 2];
    let boxes = [BK as u32, box_rows as u32];
    let elem = [1u32, 1];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every pointer is to a live local of the length the rank (2) implies;
    // the global address is only recorded, not dereferenced.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            ty,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    crate::driver::check(r, "cuTensorMapEncodeTiled")?;
    Ok(map.opaque)
}

/// The wgmma kernel's launch: its parameter struct (kernels/gemm_wgmma.cu
/// `GemmWgP`, 384 bytes) is the two tensor maps, then the words below.
fn wg_step(k: &Kernels, t: &MatMulThunk, b: &Bases, cfg: GemmCfg) -> Result<Step> {
    let (rows, _) = folded(t);
    let dt = if t.dtype == DType::BF16 { "bf16" } else { "f16" };
    let mc = if cfg.mc > 1 { format!("_mc{}", cfg.mc) } else { String::new() };
    let func = k.own_gemm()?.get(&format!("gemm_wg_{}{mc}_{dt}", cfg.bn))?;
    let opt = |x: &Option<rlx_compile::BufRef>| -> Result<u64> { x.as_ref().map(|r| b.ptr(r)).transpose().map(|p| p.unwrap_or(0)) };
    let (stages, smem) = wg_launch_smem(t, cfg);
    let early = prepared(&t.b) && t.bias.as_ref().is_none_or(prepared);
    let mut args = Vec::with_capacity(48);
    args.extend(tensor_map(t.dtype, b.ptr(&t.a)?, rows, t.k, t.lda, BM / cfg.mc)?);
    args.extend(tensor_map(t.dtype, b.ptr(&t.b)?, t.n, t.k, t.ldb, cfg.bn)?);
    args.extend([
        opt(&t.bias)?,
        opt(&t.residual)?,
        b.ptr(&t.out)?,
        rows as u64,
        t.n as u64,
        (t.k / cfg.split) as u64,
        crate::launch::act_code(t.act) as u64,
        stages as u64,
        early as u64,
    ]);
    args.resize(48, 0);
    let grid = [(t.n / cfg.bn) as u32, rows.div_ceil(BM) as u32, cfg.split as u32];
    func.set_max_dynamic_smem(MAX_SMEM as u32)?;
    let block = (WG_WARPS * 32) as u32;
    let cluster = [cfg.mc as u32, 1, cfg.split as u32];
    Ok(Step::new(Op::Kernel { func, grid, block, smem: smem as u32, cluster, args }, "matmul"))
}

/// Whether a buffer is written only at prepare (weights, constants), so the
/// kernel may read it before waiting for the previous kernel.
fn prepared(r: &rlx_compile::BufRef) -> bool {
    matches!(r.space, Space::Weight(_) | Space::Const(_))
}

/// The own kernel's launch for one slot.
pub(crate) fn step(k: &Kernels, t: &MatMulThunk, b: &Bases, cfg: GemmCfg) -> Result<Step> {
    if cfg.warps == WG_WARPS {
        return wg_step(k, t, b, cfg);
    }
    let (rows, _) = folded(t);
    let dt = if t.dtype == DType::BF16 { "bf16" } else { "f16" };
    let func = k.own_gemm()?.get(&format!("gemm_{}_{}w_{}_{dt}", cfg.bn, cfg.warps, if t.b_trans { "t" } else { "n" }))?;
    let opt = |x: &Option<rlx_compile::BufRef>| -> Result<u64> { x.as_ref().map(|r| b.ptr(r)).transpose().map(|p| p.unwrap_or(0)) };
    let (stages, smem) = launch_smem(t, cfg);
    let early = prepared(&t.b) && t.bias.as_ref().is_none_or(prepared);
    let args = vec![
        b.ptr(&t.a)?,
        b.ptr(&t.b)?,
        opt(&t.bias)?,
        opt(&t.residual)?,
        b.ptr(&t.out)?,
        rows as u64,
        t.n as u64,
        t.k as u64,
        t.lda,
        t.ldb,
        crate::launch::act_code(t.act) as u64,
        (t.k / cfg.split) as u64,
        stages as u64,
        early as u64,
    ];
    let grid = [(t.n / cfg.bn) as u32, rows.div_ceil(BM) as u32, cfg.split as u32];
    // The limit is per function and shapes share functions: always the most.
    func.set_max_dynamic_smem(MAX_SMEM as u32)?;
    let block = (cfg.warps * 32) as u32;
    let cluster = [1, 1, cfg.split as u32];
    Ok(Step::new(Op::Kernel { func, grid, block, smem: smem as u32, cluster, args }, "matmul"))
}

/// One timing alternative: enqueues its work once on the stream; the flag
/// says a kernel of the same alternative precedes it (programmatic
/// dependent launch allowed, as in the forward).
type Enqueue<'a> = dyn Fn(&Stream, bool) -> Result<()> + 'a;

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
            let Ok(g) = GraphExec::capture(stream, fill, None, || {
                for i in 0..REPS {
                    alt(stream, i > 0)?;
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

/// The kernel for this thunk, by policy, and how many cuBLASLt candidates
/// were considered (0 when nothing was timed); timed choices are made the
/// first time a shape is seen and kept for the process. `library` are the
/// thunk's cuBLASLt steps with this slot's pointers (the MatMul, then our
/// epilogue kernel if any); timing writes the thunk's (arena) output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn choose(
    device: usize,
    stream: &Stream,
    k: &Kernels,
    t: &MatMulThunk,
    b: &Bases,
    blas: &Blas,
    plan: &MatMulPlan,
    library: &[Step],
) -> Result<(Choice, usize)> {
    let pol = policy();
    let default = Choice::Lt(plan.algo);
    // Timing writes the output: only an arena output may be written at prepare.
    if pol == GemmPolicy::Heuristic || t.out.space != Space::Arena {
        return Ok((default, 0));
    }
    let (rows, batch) = folded(t);
    if matches!(pol, GemmPolicy::Library | GemmPolicy::Auto) && rows * batch > TUNE_MAX_ROWS {
        return Ok((default, 0));
    }
    let own_ok = eligible(k, t, b)?;
    if matches!(pol, GemmPolicy::Own | GemmPolicy::Tiling(..)) && !own_ok {
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
    if let Some(c) = choices().lock().map_err(|_| err("gemm choice table lock poisoned"))?.get(&key) {
        return Ok((*c, 0));
    }
    // Only the policies that may run the own kernel load it (src/launch.rs
    // `own_gemm`): the default never compiles it.
    let own_use = matches!(pol, GemmPolicy::Auto | GemmPolicy::Own | GemmPolicy::Tiling(..));
    let own_cands = if own_ok && own_use { candidates(k, t)? } else { Vec::new() };
    if let GemmPolicy::Tiling(bn, warps, split, mc) = pol {
        let c = GemmCfg { bn, warps, split, mc };
        return Ok((if own_cands.contains(&c) { Choice::Own(c) } else { default }, 0));
    }
    // A choice timed by an earlier process (src/gemm_cache.rs), used only if
    // it still applies: cuBLASLt accepts the algorithm for this plan, or the
    // tiling is one of this shape's candidates.
    let disk_key =
        timed_policy(pol).then(|| gemm_cache::key(&k.timing_context(), &format!("{pol:?} {:?}", Key { device: 0, ..key.clone() })));
    let stored = disk_key.as_deref().and_then(gemm_cache::get).and_then(|s| match s {
        Stored::Lt(data) => {
            let algo = cudarc::cublaslt::sys::cublasLtMatmulAlgo_t { data };
            plan.accepts(blas, &algo).then(|| Choice::Lt(LtAlgo::describe(algo)))
        }
        Stored::Own([bn, warps, split, mc]) => {
            let c = GemmCfg { bn, warps, split, mc };
            own_cands.contains(&c).then_some(Choice::Own(c))
        }
    });
    if let Some(c) = stored {
        let mut table = choices().lock().map_err(|_| err("gemm choice table lock poisoned"))?;
        return Ok((*table.entry(key).or_insert(c), 0));
    }
    // cuBLASLt candidates: only the default under `Own` (the reference the
    // own kernel is reported against).
    let inplace = std::env::var("RLX_GEMM_INPLACE").map(|v| v == "1").unwrap_or(false);
    let mut lt = if pol == GemmPolicy::Own { vec![plan.algo] } else { plan.candidates(blas, HEURISTICS, inplace) };
    lt.truncate(MAX_LT);
    if let GemmPolicy::LtCandidate(i) = pol {
        return Ok((lt.get(i).map(|a| Choice::Lt(*a)).unwrap_or(default), lt.len()));
    }
    let Some(Op::MatMul(call)) = library.first().map(|s| &s.op) else {
        return Err(err("matmul steps do not start with the cuBLASLt call"));
    };
    let rest = &library[1..];
    let lt_alts: Vec<Box<Enqueue<'_>>> = lt
        .iter()
        .map(|a| {
            let algo = a.algo;
            Box::new(move |s: &Stream, _: bool| -> Result<()> {
                call.enqueue_algo(s, &algo)?;
                rest.iter().try_for_each(|st| st.enqueue(s))
            }) as Box<Enqueue<'_>>
        })
        .collect();
    let own_steps: Vec<Step> = if own_use { own_cands.iter().map(|c| step(k, t, b, *c)).collect::<Result<_>>()? } else { Vec::new() };
    // Timed as the forward launches it: a programmatic dependent of the
    // kernel before (its weight copies overlap that kernel's tail; 0.3-0.7 µs
    // of the figure at M = 128). cuBLASLt launches its kernels itself.
    let own_steps: Vec<Step> = own_steps.into_iter().map(|st| Step { pdl: true, ..st }).collect();
    let own_alts: Vec<Box<Enqueue<'_>>> =
        own_steps.iter().map(|st| Box::new(move |s: &Stream, pdl: bool| st.enqueue_with(s, pdl)) as Box<Enqueue<'_>>).collect();
    let alts: Vec<&Enqueue> = lt_alts.iter().chain(&own_alts).map(|b| b.as_ref()).collect();
    let us = time_alternatives(stream, k.get("fill_pitched").ok(), &alts)?;
    let (lt_us, own_us) = us.split_at(lt.len());
    // A non-default choice must be clearly faster (3 %: timing noise), so a
    // tie never moves a shape off cuBLASLt's first answer.
    let (li, lv) = argmin(lt_us);
    let mut pick = if li != 0 && lv < 0.97 * lt_us[0] { (Choice::Lt(lt[li]), lv) } else { (default, lt_us[0]) };
    // Under `Auto` the own kernel must beat a cuBLASLt time that was
    // measured: a library call that could not be timed is no reason to leave it.
    if !own_cands.is_empty() && own_use {
        let (oi, ov) = argmin(own_us);
        if pol == GemmPolicy::Own || (pick.1.is_finite() && ov < 0.97 * pick.1) {
            pick = (Choice::Own(own_cands[oi]), ov);
        }
    }
    if !pick.1.is_finite() {
        // Nothing could be timed (the default included): keep the default.
        pick.0 = default;
    }
    if std::env::var("RLX_TRACE").map(|v| v == "1").unwrap_or(false) {
        let ll: Vec<String> = lt.iter().zip(lt_us).map(|(a, u)| format!("{}:{u:.2}", a.label())).collect();
        let ol: Vec<String> = own_cands.iter().zip(own_us).map(|(c, u)| format!("{}:{u:.2}", c.label())).collect();
        let name = pick.0.label();
        eprintln!(
            "rlx-cuda gemm {rows}x{}x{} {} batch {batch}: -> {name} {:.2}us (default {:.2}us); cublasLt [{}] own [{}]",
            t.n,
            t.k,
            t.dtype,
            pick.1,
            lt_us[0],
            ll.join(" "),
            ol.join(" ")
        );
    }
    if let (Some(dk), true) = (&disk_key, pick.1.is_finite()) {
        gemm_cache::put(
            dk,
            match pick.0 {
                Choice::Lt(a) => Stored::Lt(a.algo.data),
                Choice::Own(c) => Stored::Own([c.bn, c.warps, c.split, c.mc]),
            },
        );
    }
    // A prepare on another thread may have decided this shape meanwhile:
    // the first decision stands, so every executable of a shape runs the
    // same kernel (same bits).
    let mut table = choices().lock().map_err(|_| err("gemm choice table lock poisoned"))?;
    Ok((*table.entry(key).or_insert(pick.0), lt.len()))
}
