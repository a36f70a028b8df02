//! Lowering thunks to device steps: which kernel, what grid, which argument
//! words (pointers already resolved for one slot). A slot's steps are built
//! once at prepare; eager mode enqueues them one by one, replay records them
//! into CUDA graphs. Both enqueue the very same steps, so both give the same
//! bits.

use std::sync::Arc;

use rlx_ir::{Activation, BinaryOp, DType, ReduceOp, RopeMode};
use rlx_runtime::Result;
use rlx_schedule::{BufRef, Space, Thunk};

use crate::blas::{Blas, MatMulCall, MatMulPlan};
use crate::driver::{self, err, Func, Stream};
use crate::hostops::HostTask;
use crate::modules::Kernels;
use crate::params::{self, arr, i, KernelParams, Params, COPY_MANY, MAX_RANK};

const BLOCK: u32 = 256;

pub(crate) fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
        DType::I32 => 3,
        DType::I64 => 4,
        DType::U8 => 5,
    }
}

pub(crate) fn act_code(a: Option<Activation>) -> i64 {
    match a {
        None => 0,
        Some(Activation::Gelu) => 1,
        Some(Activation::GeluTanh) => 2,
        Some(Activation::Silu) => 3,
        Some(Activation::Relu) => 4,
        Some(Activation::Tanh) => 5,
    }
}

pub(crate) fn suffix(d: DType) -> &'static str {
    match d {
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

/// One thing to enqueue on the stream.
pub(crate) enum Op {
    Kernel {
        func: Func,
        grid: [u32; 3],
        block: u32,
        /// Dynamic shared memory bytes (0 for kernels with static shared memory only).
        smem: u32,
        /// Thread-block cluster dimensions ([1, 1, 1]: no cluster).
        cluster: [u32; 3],
        params: Params,
    },
    MatMul(MatMulCall),
    HtoD {
        dst: u64,
        src: *const u8,
        bytes: usize,
    },
    DtoH {
        dst: *mut u8,
        src: u64,
        bytes: usize,
    },
    /// Runs on the host (through the stream); never recorded in a graph.
    Host(Box<HostTask>),
}

impl Op {
    /// A launch of `func` with the twin `p` of its parameter struct; an
    /// error when the driver reports another parameter size for `func`.
    pub fn kernel<T: KernelParams>(func: Func, grid: [u32; 3], block: u32, smem: u32, cluster: [u32; 3], p: &T) -> Result<Op> {
        let params = Params::new(p);
        func.check(&params)?;
        Ok(Op::Kernel { func, grid, block, smem, cluster, params })
    }
}

pub(crate) struct Step {
    pub op: Op,
    /// Host-side steps split replay segments.
    pub host: bool,
    /// Thunk kind for traces and profiles ("io" for staging copies).
    pub kind: &'static str,
    /// Launch as a programmatic dependent of the previous kernel (set by
    /// `mark_pdl`; kernels only).
    pub pdl: bool,
    /// The weight bytes (address, length) a matmul step reads: a recorded
    /// graph prefetches them into L2 beside the forward (exec.rs `record`).
    pub weight: Option<(u64, u64)>,
}

// SAFETY: the raw pointers are pinned buffers owned by the same slot as the step.
unsafe impl Send for Step {}

impl Step {
    pub fn new(op: Op, kind: &'static str) -> Step {
        Step { op, host: false, kind, pdl: false, weight: None }
    }
    pub fn is_kernel(&self) -> bool {
        matches!(self.op, Op::Kernel { .. } | Op::MatMul(_))
    }
    pub fn enqueue(&self, s: &Stream) -> Result<()> {
        self.enqueue_with(s, self.pdl)
    }
    /// As `enqueue`; `pdl` false forces a plain launch (RLX_PROFILE puts
    /// timing events between steps).
    pub fn enqueue_with(&self, s: &Stream, pdl: bool) -> Result<()> {
        match &self.op {
            Op::Kernel { func, grid, block, smem, cluster, params } => {
                func.launch(s, *grid, *block, *smem, *cluster, params, pdl && self.pdl)
            }
            Op::MatMul(call) => call.enqueue(s),
            Op::HtoD { dst, src, bytes } => driver::memcpy_htod_async(*dst, *src, *bytes, s),
            Op::DtoH { dst, src, bytes } => driver::memcpy_dtoh_async(*dst, *src, *bytes, s),
            Op::Host(task) => driver::launch_host(s, task.as_ref() as *const HostTask),
        }
    }
}

/// Marks each of our kernels that directly follows another kernel (ours or
/// cuBLASLt's) on the stream for programmatic dependent launch. Copies,
/// memsets and host steps keep plain stream order on both sides.
pub(crate) fn mark_pdl(steps: &mut [Step]) {
    for i in 1..steps.len() {
        let after_kernel = !steps[i - 1].host && steps[i - 1].is_kernel();
        steps[i].pdl = after_kernel && !steps[i].host && matches!(steps[i].op, Op::Kernel { .. });
    }
}

/// Device addresses of every memory space, for one slot.
pub(crate) struct Bases {
    pub arena: u64,
    pub weights: Vec<u64>,
    pub states: Vec<u64>,
    pub consts: Vec<u64>,
    /// The slot's i32 error flag.
    pub err: u64,
    /// The split-key attention appends' counters and partial sums
    /// (`SplitScratch`), 0 where no append splits.
    pub split: u64,
    pub split_part: u64,
}

impl Bases {
    pub fn ptr(&self, b: &BufRef) -> Result<u64> {
        let base = match b.space {
            Space::Arena => Some(self.arena),
            Space::Weight(i) => self.weights.get(i as usize).copied(),
            Space::State(i) => self.states.get(i as usize).copied(),
            Space::Const(i) => self.consts.get(i as usize).copied(),
        };
        base.map(|p| p + b.offset).ok_or_else(|| err(format!("buffer in {:?} has no backing memory", b.space)))
    }
}

impl Kernels {
    /// A launch of the trapping kernel (kernels/fault.cu): for the
    /// fault-injection hook only.
    pub(crate) fn trap(&self) -> Result<Step> {
        let module = self.fault_module()?;
        Ok(Step::new(Op::kernel(module.get("trap_always")?, [1, 1, 1], 32, 0, [1, 1, 1], &params::TrapP { when: 0 })?, "trap"))
    }
    fn typed(&self, base: &str, d: DType) -> Result<Func> {
        self.get(&format!("{base}_{}", suffix(d)))
    }
    /// 1-D grid for a grid-stride loop over n items.
    fn grid(&self, n: u64) -> [u32; 3] {
        let want = n.div_ceil(BLOCK as u64).max(1);
        [want.min(self.sm_count as u64 * 32).max(1) as u32, 1, 1]
    }
    /// `n` u32 values set to `value`, as a kernel step (kernels/elementwise.cu
    /// `fill_pitched`; a memset node costs host time at every graph launch).
    pub(crate) fn fill32(&self, dst: u64, value: u32, n: u64, kind: &'static str) -> Result<Step> {
        let p = params::FillP { dst, pitch: 4 * n as i64, width: n as i64, height: 1, value: value as i64, esize: 4 };
        self.flat(self.get("fill_pitched")?, n, &p, kind)
    }
    /// An L2 prefetch of `bytes` at `ptr` (kernels/elementwise.cu
    /// `prefetch_l2`): a block of 256 threads per 512 KB, which measured
    /// faster at bert-base 1×128 than 32 KB, 128 KB or 2 MB per block.
    pub(crate) fn prefetch_l2(&self, ptr: u64, bytes: u64) -> Result<Step> {
        let grid = bytes.div_ceil(512 * 1024).clamp(1, 1024) as u32;
        let p = params::PrefetchP { ptr, bytes: bytes as i64 };
        Ok(Step::new(Op::kernel(self.get("prefetch_l2")?, [grid, 1, 1], 256, 0, [1, 1, 1], &p)?, "prefetch"))
    }
    /// Byte copies (dst, src, bytes) between device-accessible addresses,
    /// `COPY_MANY` per kernel step (kernels/elementwise.cu `copy_many`); the
    /// first step also sets the u32 at `fill` (the error flag) when given.
    pub(crate) fn copy_many(&self, fill: Option<(u64, u32)>, copies: &[(u64, u64, u64)], kind: &'static str) -> Result<Vec<Step>> {
        let func = self.get("copy_many")?;
        let mut steps = Vec::new();
        let groups: Vec<&[(u64, u64, u64)]> = if copies.is_empty() { vec![&[]] } else { copies.chunks(COPY_MANY).collect() };
        for (gi, group) in groups.into_iter().enumerate() {
            let (fill, fill_value) = match fill {
                Some((p, v)) if gi == 0 => (p, v as i64),
                _ => (0, 0),
            };
            let mut p = params::CopyManyP { n: i(group.len()), fill, fill_value, ..Default::default() };
            for (k, &(dst, src, bytes)) in group.iter().enumerate() {
                (p.dst[k], p.src[k], p.bytes[k]) = (dst, src, bytes as i64);
            }
            let most = group.iter().map(|c| c.2).max().unwrap_or(0);
            let x = most.div_ceil(16 * BLOCK as u64).clamp(1, 64) as u32;
            let grid = [x, group.len().max(1) as u32, 1];
            steps.push(Step::new(Op::kernel(func, grid, BLOCK, 0, [1, 1, 1], &p)?, kind));
        }
        Ok(steps)
    }
    /// A grid-stride launch over `n` items.
    fn flat<T: KernelParams>(&self, func: Func, n: u64, p: &T, kind: &'static str) -> Result<Step> {
        Ok(Step::new(Op::kernel(func, self.grid(n), BLOCK, 0, [1, 1, 1], p)?, kind))
    }
    /// One block per row.
    fn rows<T: KernelParams>(&self, func: Func, rows: u64, p: &T, kind: &'static str) -> Result<Step> {
        Ok(Step::new(Op::kernel(func, [rows.max(1) as u32, 1, 1], BLOCK, 0, [1, 1, 1], p)?, kind))
    }
}

/// Rows (one warp each) per block of the `norm_warp` kernels.
const NORM_WARP_ROWS: u64 = 4;

/// The vectors-per-lane variant of `norm_warp` (kernels/rows.cu) for a row of
/// `cols`, or None when the block-per-row kernel must run: cols not a
/// multiple of the 16-byte vector, a pointer (0 = absent) not 16-byte
/// aligned, or a row too long for registers.
pub(crate) fn norm_warp_nv(dtype: DType, cols: usize, ptrs: &[u64]) -> Option<usize> {
    let width = 16 / dtype.size().max(1);
    if cols == 0 || !cols.is_multiple_of(width) || ptrs.iter().any(|p| !p.is_multiple_of(16)) {
        return None;
    }
    let per_lane = (cols / width).div_ceil(32);
    [1, 2, 3, 4, 6, 8].into_iter().find(|&nv| nv >= per_lane)
}

/// Drops size-1 dims and merges each pair of adjacent dims that every
/// operand walks contiguously (stride of the outer = stride of the inner x
/// its size), so an elementwise kernel decomposes its linear (row-major,
/// contiguous output) index over as few dims as possible. Returns at least
/// one dim. `strides[k][d]` is operand k's stride of dim d, in elements.
pub(crate) fn collapse(shape: &[usize], strides: &[&[u64]]) -> (Vec<usize>, Vec<Vec<u64>>) {
    let mut out_shape: Vec<usize> = Vec::new();
    let mut out_st: Vec<Vec<u64>> = vec![Vec::new(); strides.len()];
    for (d, &size) in shape.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let st = |k: usize| strides[k].get(d).copied().unwrap_or(0);
        let merge = match out_shape.last() {
            Some(_) => (0..strides.len()).all(|k| out_st[k].last().copied() == Some(st(k) * size as u64)),
            None => false,
        };
        if let (true, Some(last)) = (merge, out_shape.last_mut()) {
            *last *= size;
            for (k, v) in out_st.iter_mut().enumerate() {
                if let Some(x) = v.last_mut() {
                    *x = st(k);
                }
            }
        } else {
            out_shape.push(size);
            for (k, v) in out_st.iter_mut().enumerate() {
                v.push(st(k));
            }
        }
    }
    if out_shape.is_empty() {
        out_shape.push(1);
        for v in out_st.iter_mut() {
            v.push(0);
        }
    }
    (out_shape, out_st)
}

/// Whether `binary_vec` (kernels/elementwise.cu) may run over collapsed
/// dims: the innermost dim whole vectors of `width` elements walked with
/// stride 1 by both operands, every outer stride a multiple of `width`, and
/// every pointer 16-byte aligned.
pub(crate) fn binary_vec_ok(shape: &[usize], st: &[Vec<u64>], width: usize, ptrs: &[u64]) -> bool {
    let w = width as u64;
    let Some(&inner) = shape.last() else { return false };
    width > 1
        && inner.is_multiple_of(width)
        && st.iter().all(|s| s.last() == Some(&1) && s[..s.len() - 1].iter().all(|x| x.is_multiple_of(w)))
        && ptrs.iter().all(|p| p.is_multiple_of(16))
}

/// The largest element offset an operand with these strides reaches.
fn max_offset(shape: &[usize], strides: &[u64]) -> u64 {
    shape.iter().zip(strides).map(|(&n, &s)| (n.saturating_sub(1) as u64).saturating_mul(s)).fold(0u64, |a, x| a.saturating_add(x))
}

/// The steps of one thunk for one slot. `plan` is the thunk's cuBLASLt plan
/// (MatMul only); `host` the staging task (TopK only).
pub(crate) fn lower(
    t: &Thunk,
    b: &Bases,
    k: &Kernels,
    blas: &Arc<Blas>,
    plan: Option<&Arc<MatMulPlan>>,
    host: Option<Box<HostTask>>,
) -> Result<Vec<Step>> {
    let kind = t.kind();
    let mut steps = Vec::new();
    match t {
        Thunk::FeedForward(_) => return Err(err("feed_forward runs as the fused kernel (src/ffn.rs) or as its parts (src/exec.rs)")),
        Thunk::MatMul(m) => {
            let plan = plan.ok_or_else(|| err("matmul without a cuBLASLt plan"))?.clone();
            let d = b.ptr(&m.out)?;
            let c = match (&m.residual, plan.epilogue.is_none()) {
                (Some(r), true) => b.ptr(r)?,
                _ => d,
            };
            let bias = match &m.bias {
                Some(x) => b.ptr(x)?,
                None => 0,
            };
            let epi = plan.epilogue;
            steps.push(Step::new(
                Op::MatMul(MatMulCall { algo: plan.algo.algo, plan, blas: blas.clone(), a: b.ptr(&m.a)?, b: b.ptr(&m.b)?, c, d, bias }),
                kind,
            ));
            if let Some(e) = epi {
                let n = (m.batch * m.m * m.n) as u64;
                let res = match (&m.residual, e.residual) {
                    (Some(r), true) => b.ptr(r)?,
                    _ => 0,
                };
                let p = params::EpilogueP { out: d, res, n: n as i64, act: act_code(e.act) };
                let width = (16 / m.dtype.size()) as u64;
                if n.is_multiple_of(width) && (d | res).is_multiple_of(16) {
                    steps.push(k.flat(k.typed("epilogue_vec", m.dtype)?, n / width, &p, "matmul_epilogue")?);
                } else {
                    steps.push(k.flat(k.typed("epilogue", m.dtype)?, n, &p, "matmul_epilogue")?);
                }
            }
        }
        // Integer arithmetic (positions, lengths): kernels/decode.cu.
        Thunk::Binary { dtype: DType::I32 | DType::I64, .. } => steps.extend(crate::decode::lower(t, b, k, blas, None)?),
        Thunk::Binary { op, dtype, out_shape, a, a_strides, b: bb, b_strides, out } => {
            let n: usize = out_shape.iter().product();
            let op = match op {
                BinaryOp::Add => 0,
                BinaryOp::Sub => 1,
                BinaryOp::Mul => 2,
                BinaryOp::Div => 3,
            };
            let (shape, st) = collapse(out_shape, &[a_strides, b_strides]);
            let p = params::BinaryP {
                a: b.ptr(a)?,
                b: b.ptr(bb)?,
                out: b.ptr(out)?,
                n: i(n),
                rank: i(shape.len()),
                op,
                shape: arr(shape.iter().map(|&d| d as u64)),
                sa: arr(st[0].iter().copied()),
                sb: arr(st[1].iter().copied()),
            };
            let fits31 = |v: u64| v < (1u64 << 31);
            let small = fits31(n as u64) && st.iter().all(|s| fits31(max_offset(&shape, s)));
            let width = 16 / dtype.size().max(1);
            if small && binary_vec_ok(&shape, &st, width, &[b.ptr(a)?, b.ptr(bb)?, b.ptr(out)?]) {
                steps.push(k.flat(k.typed("binary_vec", *dtype)?, (n / width) as u64, &p, kind)?);
            } else {
                let name = if small { "binary32" } else { "binary" };
                steps.push(k.flat(k.typed(name, *dtype)?, n as u64, &p, kind)?);
            }
        }
        Thunk::Activation { act, dtype, n, x, out } => {
            let p = params::ActP { x: b.ptr(x)?, out: b.ptr(out)?, n: i(*n), act: act_code(Some(*act)) };
            steps.push(k.flat(k.typed("activation", *dtype)?, *n as u64, &p, kind)?);
        }
        Thunk::Norm { rms, dtype, rows, cols, eps, x, residual, gamma, beta, out } => {
            let res = residual.as_ref().map(|r| b.ptr(r)).transpose()?.unwrap_or(0);
            let bet = beta.as_ref().map(|r| b.ptr(r)).transpose()?.unwrap_or(0);
            let (xp, gp, op) = (b.ptr(x)?, b.ptr(gamma)?, b.ptr(out)?);
            let p = params::NormP {
                x: xp,
                res,
                gamma: gp,
                beta: bet,
                out: op,
                rows: i(*rows),
                cols: i(*cols),
                rms: *rms as i64,
                eps: *eps as f64,
            };
            match norm_warp_nv(*dtype, *cols, &[xp, res, gp, bet, op]) {
                Some(nv) => {
                    let func = k.get(&format!("norm_warp_{nv}_{}", suffix(*dtype)))?;
                    let grid = [(*rows as u64).div_ceil(NORM_WARP_ROWS).max(1) as u32, 1, 1];
                    steps.push(Step::new(Op::kernel(func, grid, 32 * NORM_WARP_ROWS as u32, 0, [1, 1, 1], &p)?, kind));
                }
                None => steps.push(k.rows(k.typed("norm", *dtype)?, *rows as u64, &p, kind)?),
            }
        }
        Thunk::Softmax { dtype, outer, len, inner, x, out } => {
            let p = params::AxisP { x: b.ptr(x)?, out: b.ptr(out)?, outer: i(*outer), len: i(*len), inner: i(*inner), op: 0 };
            steps.push(k.rows(k.typed("softmax", *dtype)?, (*outer * *inner) as u64, &p, kind)?);
        }
        Thunk::Reduce { op, dtype, outer, len, inner, x, out } => {
            let op = match op {
                ReduceOp::Sum => 0,
                ReduceOp::Mean => 1,
                ReduceOp::Max => 2,
            };
            let p = params::AxisP { x: b.ptr(x)?, out: b.ptr(out)?, outer: i(*outer), len: i(*len), inner: i(*inner), op };
            if *inner >= 32 {
                // Wide rows kept: 32 columns per block (kernels/rows.cu, reduce_cols).
                let blocks = (*outer as u64) * (*inner as u64).div_ceil(32);
                steps.push(k.rows(k.typed("reduce_cols", *dtype)?, blocks, &p, kind)?);
            } else {
                steps.push(k.rows(k.typed("reduce", *dtype)?, (*outer * *inner) as u64, &p, kind)?);
            }
        }
        Thunk::MaskedMean { dtype, mask_dtype, out_dtype, batch, seq, dim, x, mask, out } => {
            // 32 columns per block, 8 warps splitting the sequence (kernels/rows.cu).
            let p = params::MaskedMeanP {
                x: b.ptr(x)?,
                mask: b.ptr(mask)?,
                out: b.ptr(out)?,
                batch: i(*batch),
                seq: i(*seq),
                dim: i(*dim),
                mask_dt: dtype_code(*mask_dtype),
                out_dt: dtype_code(*out_dtype),
            };
            let blocks = (*batch as u64) * (*dim as u64).div_ceil(32);
            steps.push(k.rows(k.typed("masked_mean", *dtype)?, blocks, &p, kind)?);
        }
        Thunk::ArgMax { dtype, outer, len, inner, x, out } => {
            let p = params::AxisP { x: b.ptr(x)?, out: b.ptr(out)?, outer: i(*outer), len: i(*len), inner: i(*inner), op: 0 };
            steps.push(k.rows(k.typed("argmax", *dtype)?, (*outer * *inner) as u64, &p, kind)?);
        }
        Thunk::TopK { x, values, indices, .. } => {
            let task = host.ok_or_else(|| err("topk without its host staging"))?;
            let (pin_x, xb, pin_v, vb, pin_i, ib) = task.buffers();
            let mut s = Step::new(Op::DtoH { dst: pin_x, src: b.ptr(x)?, bytes: xb }, kind);
            s.host = true;
            steps.push(s);
            let mut s = Step::new(Op::Host(task), kind);
            s.host = true;
            steps.push(s);
            if let Some(v) = values {
                let mut s = Step::new(Op::HtoD { dst: b.ptr(v)?, src: pin_v, bytes: vb }, kind);
                s.host = true;
                steps.push(s);
            }
            if let Some(i) = indices {
                let mut s = Step::new(Op::HtoD { dst: b.ptr(i)?, src: pin_i, bytes: ib }, kind);
                s.host = true;
                steps.push(s);
            }
        }
        Thunk::Gather { dtype, id_dtype, n, dim, vocab, table, ids, out } => {
            let p = params::GatherP {
                table: b.ptr(table)?,
                ids: b.ptr(ids)?,
                out: b.ptr(out)?,
                err: b.err,
                n: i(*n),
                dim: i(*dim),
                vocab: i(*vocab),
                id64: (*id_dtype == DType::I64) as i64,
                esize: i(dtype.size()),
            };
            // Whole 16-byte chunks per row, aligned table and output: gather_vec.
            let row_bytes = (*dim * dtype.size()) as u64;
            if row_bytes.is_multiple_of(16) && (b.ptr(table)? | b.ptr(out)?).is_multiple_of(16) {
                steps.push(k.flat(k.get("gather_vec")?, *n as u64 * (row_bytes / 16), &p, kind)?);
            } else {
                steps.push(k.flat(k.get("gather")?, (*n * *dim) as u64, &p, kind)?);
            }
        }
        Thunk::EmbedNorm { dtype, id_dtype, rows, cols, vocab, eps, table, ids, addends, gamma, beta, out } => {
            let mut ptrs = vec![b.ptr(table)?, b.ptr(gamma)?, b.ptr(beta)?, b.ptr(out)?];
            for (a, _) in addends {
                ptrs.push(b.ptr(a)?);
            }
            match norm_warp_nv(*dtype, *cols, &ptrs).filter(|_| addends.len() <= 2) {
                Some(nv) => {
                    let add = |k: usize| -> Result<(u64, usize)> { addends.get(k).map(|(a, n)| Ok((b.ptr(a)?, *n))).unwrap_or(Ok((0, 1))) };
                    let ((a0, n0), (a1, n1)) = (add(0)?, add(1)?);
                    let p = params::EmbedNormP {
                        table: b.ptr(table)?,
                        ids: b.ptr(ids)?,
                        add0: a0,
                        add1: a1,
                        gamma: b.ptr(gamma)?,
                        beta: b.ptr(beta)?,
                        out: b.ptr(out)?,
                        err: b.err,
                        rows: i(*rows),
                        cols: i(*cols),
                        vocab: i(*vocab),
                        id64: (*id_dtype == DType::I64) as i64,
                        rows0: i(n0.max(1)),
                        rows1: i(n1.max(1)),
                        eps: *eps as f64,
                    };
                    let func = k.get(&format!("embed_norm_{nv}_{}", suffix(*dtype)))?;
                    let grid = [(*rows as u64).div_ceil(NORM_WARP_ROWS).max(1) as u32, 1, 1];
                    steps.push(Step::new(Op::kernel(func, grid, 32 * NORM_WARP_ROWS as u32, 0, [1, 1, 1], &p)?, kind));
                }
                // Rows too wide for one warp, or unaligned: the gather, one
                // broadcast add per addend and the norm, in place in `out`.
                None => {
                    let gather = Thunk::Gather {
                        dtype: *dtype,
                        id_dtype: *id_dtype,
                        n: *rows,
                        dim: *cols,
                        vocab: *vocab,
                        table: *table,
                        ids: *ids,
                        out: *out,
                    };
                    steps.extend(lower(&gather, b, k, blas, None, None)?);
                    for (a, n) in addends {
                        let n = (*n).max(1);
                        let add = Thunk::Binary {
                            op: BinaryOp::Add,
                            dtype: *dtype,
                            out_shape: vec![rows / n, n, *cols],
                            a: *out,
                            a_strides: vec![(n * cols) as u64, *cols as u64, 1],
                            b: *a,
                            b_strides: vec![0, *cols as u64, 1],
                            out: *out,
                        };
                        steps.extend(lower(&add, b, k, blas, None, None)?);
                    }
                    let norm = Thunk::Norm {
                        rms: false,
                        dtype: *dtype,
                        rows: *rows,
                        cols: *cols,
                        eps: *eps,
                        x: *out,
                        residual: None,
                        gamma: *gamma,
                        beta: Some(*beta),
                        out: *out,
                    };
                    steps.extend(lower(&norm, b, k, blas, None, None)?);
                    for s in &mut steps {
                        s.kind = kind;
                    }
                }
            }
        }
        Thunk::Copy { dtype, shape, src, src_strides, dst, dst_strides } => {
            let n: usize = shape.iter().product();
            let p = params::CopyP {
                src: b.ptr(src)?,
                dst: b.ptr(dst)?,
                n: i(n),
                rank: i(shape.len()),
                esize: i(dtype.size()),
                shape: arr(shape.iter().map(|&d| d as u64)),
                ss: arr(src_strides.iter().copied()),
                ds: arr(dst_strides.iter().copied()),
            };
            steps.push(k.flat(k.get("copy_strided")?, n as u64, &p, kind)?);
        }
        Thunk::Cast { from, to, n, src, dst } => {
            let p = params::CastP { src: b.ptr(src)?, dst: b.ptr(dst)?, n: i(*n), from: dtype_code(*from), to: dtype_code(*to) };
            steps.push(k.flat(k.get("cast_any")?, *n as u64, &p, kind)?);
        }
        Thunk::Attention(a) => {
            // Head dim padded to a compiled variant; 4 rows per warp unless
            // that leaves the GPU under-filled (see kernels/attention.cu).
            let hdp = a.head_dim.div_ceil(32) * 32;
            let blocks16 = (a.q_len as u64).div_ceil(16) * (a.heads * a.batch) as u64;
            let rpw: u64 = if blocks16 >= 2 * k.sm_count as u64 { 4 } else { 1 };
            let p = attention_params(a, b)?;
            // Tensor cores for f16/bf16 keys and values with head_dim a
            // multiple of 16 (f32 queries, a decoder's prompt over its f16
            // cache, round to the cache's type as they load): blocks of 128
            // or 64 query rows when they fill the GPU (`attention_mma_rows`),
            // else 16-row blocks whose 4 warps split the keys (batch 1: 12
            // heads x 128 tokens is 24 blocks of 64 rows but 96 of 16). The
            // scalar kernel otherwise (f32 caches, odd head dims).
            let tensor = a.kv_dtype != DType::F32 && a.head_dim % 16 == 0;
            let rows = attention_mma_rows(a.q_len, a.heads * a.batch, k.sm_count);
            // The dtype suffix: f32 queries over an f16 or bf16 cache read
            // it as stored (`f32_kvf16`, `f32_kvbf16`).
            let sfx = if a.kv_dtype == a.dtype { suffix(a.dtype).to_string() } else { format!("f32_kv{}", suffix(a.kv_dtype)) };
            let (grid, func, block, smem) = match rows {
                // One query row (a decode step): the keys split over a block's warps.
                _ if a.q_len == 1 => {
                    let w = decode_warps(a.heads * a.batch, k.sm_count);
                    ([a.heads as u32, a.batch as u32, 1], k.get(&format!("attention_dec{w}_{hdp}_{sfx}"))?, w * 32, 0)
                }
                Some(r) if tensor => {
                    let grid = [(a.q_len as u64).div_ceil(r).max(1) as u32, a.heads as u32, a.batch as u32];
                    // The short-range kernel folds the scale into its exponent
                    // (it must be positive); it has no f32-query form.
                    let short = a.scale > 0.0 && a.dtype == a.kv_dtype;
                    let name = attention_block_kernel(r, hdp, a.kv_len, short, a.causal);
                    let func = k.get(&format!("{name}_{hdp}_{sfx}"))?;
                    // The short-range kernel's Q and output rows (dynamic shared memory).
                    let smem = if name.starts_with("attention_short") { short_q_smem(r, hdp) } else { 0 };
                    if smem > 0 {
                        func.set_max_dynamic_smem(smem)?;
                    }
                    (grid, func, (r * 2) as u32, smem)
                }
                _ if tensor => {
                    let grid = [(a.q_len as u64).div_ceil(16).max(1) as u32, a.heads as u32, a.batch as u32];
                    (grid, k.get(&format!("attention_split_{hdp}_{sfx}"))?, 128, 0)
                }
                _ => {
                    let grid = [(a.q_len as u64).div_ceil(4 * rpw).max(1) as u32, a.heads as u32, a.batch as u32];
                    (grid, k.get(&format!("attention_{hdp}_{rpw}_{sfx}"))?, 128, 0)
                }
            };
            steps.push(Step::new(Op::kernel(func, grid, block, smem, [1, 1, 1], &p)?, kind));
        }
        Thunk::AttentionAppend(t) => {
            let a = &t.attn;
            let hdp = a.head_dim.div_ceil(32) * 32;
            let sfx = if a.kv_dtype == a.dtype { suffix(a.dtype).to_string() } else { format!("f32_kv{}", suffix(a.kv_dtype)) };
            let rope = t.rope.as_ref();
            let p = params::AttnAppP {
                q: b.ptr(&t.q.buf)?,
                kn: b.ptr(&t.k_new.buf)?,
                vn: b.ptr(&t.v_new.buf)?,
                kc: b.ptr(&a.k.buf)?,
                vc: b.ptr(&a.v.buf)?,
                wpos: b.ptr(&t.position)?,
                rpos: rope.map(|r| b.ptr(&r.positions)).transpose()?.unwrap_or(0),
                factors: rope.and_then(|r| r.freq_factors.as_ref()).map(|f| b.ptr(f)).transpose()?.unwrap_or(0),
                valid: a.valid_len.as_ref().map(|m| b.ptr(m)).transpose()?.unwrap_or(0),
                mask: a.mask.as_ref().map(|m| b.ptr(m)).transpose()?.unwrap_or(0),
                out: b.ptr(&a.out)?,
                err: b.err,
                batch: i(a.batch),
                heads: i(a.heads),
                kv_heads: i(a.kv_heads),
                hd: i(a.head_dim),
                kv_len: i(a.kv_len),
                mask_dt: dtype_code(a.mask_dtype),
                qbs: t.q.batch_stride as i64,
                knbs: t.k_new.batch_stride as i64,
                vnbs: t.v_new.batch_stride as i64,
                kbs: a.k.batch_stride as i64,
                krs: a.k.row_stride as i64,
                vbs: a.v.batch_stride as i64,
                vrs: a.v.row_stride as i64,
                wpos_pb: t.position_per_batch as i64,
                rpos_pb: rope.is_some_and(|r| r.positions_per_batch) as i64,
                valid_pb: a.valid_len_per_batch as i64,
                rope: match rope.map(|r| r.mode) {
                    None => 0,
                    Some(RopeMode::RotateHalf) => 1,
                    Some(RopeMode::Interleaved) => 2,
                },
                theta: rope.map_or(0.0, |r| r.theta as f64),
                scale: a.scale as f64,
                part: 0,
                cnt: 0,
                chunk: 0,
            };
            let shape = append_shape(a.heads * a.batch, a.kv_len, k.sm_count);
            let p = if shape.splits > 1 {
                if b.split == 0 {
                    return Err(err("a split-key attention append without its scratch"));
                }
                params::AttnAppP { cnt: b.split, part: b.split_part, chunk: APPEND_CHUNK as i64, ..p }
            } else {
                p
            };
            let func = k.get(&format!("attention_app{}_{hdp}_{sfx}", shape.warps))?;
            let grid = [a.heads as u32, a.batch as u32, shape.splits];
            steps.push(Step::new(Op::kernel(func, grid, shape.warps * 32, 0, [1, 1, 1], &p)?, kind));
        }
        Thunk::Rope { dtype, mode, theta, batch, seq, heads, head_dim, x, positions, positions_per_batch, out, freq_factors } => {
            let n = (batch * seq * heads * (head_dim / 2)) as u64;
            let p = params::RopeP {
                x: b.ptr(&x.buf)?,
                pos: b.ptr(positions)?,
                out: b.ptr(out)?,
                factors: match freq_factors {
                    Some(f) => b.ptr(f)?,
                    None => 0,
                },
                batch: i(*batch),
                seq: i(*seq),
                heads: i(*heads),
                hd: i(*head_dim),
                xbs: x.batch_stride as i64,
                xrs: x.row_stride as i64,
                mode: matches!(mode, RopeMode::Interleaved) as i64,
                per_batch: *positions_per_batch as i64,
                theta: *theta as f64,
            };
            steps.push(k.flat(k.typed("rope", *dtype)?, n, &p, kind)?);
        }
        Thunk::SwiGlu { dtype, rows, cols, gate, up, out } => {
            let n = (rows * cols) as u64;
            let p = params::SwiGluP {
                gate: b.ptr(&gate.buf)?,
                up: b.ptr(&up.buf)?,
                out: b.ptr(out)?,
                rows: i(*rows),
                cols: i(*cols),
                gs: gate.row_stride as i64,
                us: up.row_stride as i64,
            };
            steps.push(k.flat(k.typed("swiglu", *dtype)?, n, &p, kind)?);
        }
        Thunk::WriteState { dtype, value_dtype, batch, max_rows, new_rows, width, state, value, position, positions_per_batch } => {
            let n = (batch * new_rows * width) as u64;
            let p = params::WriteStateP {
                state: b.ptr(state)?,
                value: b.ptr(value)?,
                pos: b.ptr(position)?,
                err: b.err,
                batch: i(*batch),
                max_rows: i(*max_rows),
                new_rows: i(*new_rows),
                width: i(*width),
                esize: i(dtype.size()),
                per_batch: *positions_per_batch as i64,
                from: dtype_code(*value_dtype),
                to: dtype_code(*dtype),
            };
            steps.push(k.flat(k.get("write_state")?, n, &p, kind)?);
        }
        Thunk::QMatMul { .. } | Thunk::QGather { .. } | Thunk::Sample { .. } => steps.extend(crate::decode::lower(t, b, k, blas, plan)?),
    }
    Ok(steps)
}

/// Keys a split of a split-key attention append takes at least.
pub(crate) const APPEND_CHUNK: usize = 512;
/// Splits a (batch, head) of an append at most (kernels/attention_dec.cu
/// APP_MAX_SPLITS).
const APPEND_MAX_SPLITS: usize = 16;

/// How a decode step's attention append runs (kernels/attention_dec.cu
/// `attention_app_body`): `warps` a block (as `decode_warps`), and up to
/// `splits` blocks a (batch, head), each over a run of at least
/// APPEND_CHUNK valid keys. Where the 16-warp (batch, head) blocks fill
/// less than the GPU (a block an SM), a long cache's keys split over as
/// many as fill it, at most APPEND_MAX_SPLITS; the kernel counts the runs
/// from the valid keys at each call, so up to APPEND_CHUNK keys one block
/// does the whole. (In bench/decode-append.cu on an H100 a merge of runs
/// cost ~2.6 µs, more than a 16-warp block spends on keys up to ~500.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AppendShape {
    pub warps: u32,
    pub splits: u32,
}

/// The shape for `pairs` (batch, head) blocks over a cache of `kv_len` rows.
pub(crate) fn append_shape(pairs: usize, kv_len: usize, sm_count: u32) -> AppendShape {
    let blocks = pairs.max(1);
    let warps = decode_warps(blocks, sm_count);
    let fill = if warps == 16 { (sm_count as usize / blocks).max(1) } else { 1 };
    let splits = fill.min(kv_len.div_ceil(APPEND_CHUNK)).clamp(1, APPEND_MAX_SPLITS);
    AppendShape { warps, splits: splits as u32 }
}

/// The scratch of a schedule's split-key attention appends: a region of
/// merge counters (one i32 a (batch, head) of the widest append, which
/// start at 0 and which each merge leaves at 0), then a region of partial
/// sums (HDP + 2 floats a (batch, head, split) of the largest append).
/// Every append uses both regions from their starts: a call's kernels run
/// one after another. `None` where no append splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SplitScratch {
    pub counts_bytes: u64,
    pub part_bytes: u64,
}

impl SplitScratch {
    pub fn of(thunks: &[Thunk], sm_count: u32) -> Option<SplitScratch> {
        let appends = thunks.iter().filter_map(|t| match t {
            Thunk::AttentionAppend(t) => Some((t.attn.batch * t.attn.heads, t.attn.head_dim, t.attn.kv_len)),
            _ => None,
        });
        SplitScratch::of_appends(appends, sm_count)
    }

    /// The scratch of appends given as ((batch, head) pairs, head dim, cache rows).
    fn of_appends(appends: impl Iterator<Item = (usize, usize, usize)>, sm_count: u32) -> Option<SplitScratch> {
        let mut s = SplitScratch { counts_bytes: 0, part_bytes: 0 };
        for (pairs, head_dim, kv_len) in appends {
            let shape = append_shape(pairs, kv_len, sm_count);
            if shape.splits > 1 {
                let hdp = head_dim.div_ceil(32) * 32;
                s.counts_bytes = s.counts_bytes.max(((pairs * 4) as u64).div_ceil(256) * 256);
                s.part_bytes = s.part_bytes.max((pairs * shape.splits as usize * (hdp + 2) * 4) as u64);
            }
        }
        (s.counts_bytes > 0).then_some(s)
    }
}

/// Warps of a decode attention block (kernels/attention_dec.cu) for a grid
/// of `blocks` (heads × batch): 16 while one block per SM covers the grid
/// (a 16-warp block's registers fill an SM), else 4, so that a batch's
/// blocks run in one wave instead of queueing behind each other.
pub(crate) fn decode_warps(blocks: usize, sm_count: u32) -> u32 {
    if blocks <= sm_count as usize {
        16
    } else {
        4
    }
}

/// The `AttnP` of kernels/attention_mma.cu (and attention.cu) for a thunk.
fn attention_params(a: &rlx_schedule::AttentionThunk, b: &Bases) -> Result<params::AttnP> {
    Ok(params::AttnP {
        q: b.ptr(&a.q.buf)?,
        k: b.ptr(&a.k.buf)?,
        v: b.ptr(&a.v.buf)?,
        mask: a.mask.as_ref().map(|m| b.ptr(m)).transpose()?.unwrap_or(0),
        valid: a.valid_len.as_ref().map(|m| b.ptr(m)).transpose()?.unwrap_or(0),
        out: b.ptr(&a.out)?,
        batch: i(a.batch),
        heads: i(a.heads),
        kv_heads: i(a.kv_heads),
        hd: i(a.head_dim),
        q_len: i(a.q_len),
        kv_len: i(a.kv_len),
        causal: a.causal as i64,
        mask_dt: dtype_code(a.mask_dtype),
        qbs: a.q.batch_stride as i64,
        qrs: a.q.row_stride as i64,
        kbs: a.k.batch_stride as i64,
        krs: a.k.row_stride as i64,
        vbs: a.v.batch_stride as i64,
        vrs: a.v.row_stride as i64,
        scale: a.scale as f64,
        err: b.err,
        valid_pb: a.valid_len_per_batch as i64,
    })
}

/// Query rows per block of the tensor-core attention kernel
/// (kernels/attention_mma.cu), or None for the short-sequence kernel whose
/// warps split the keys: 64-row blocks must fill the SMs (`heads` counts
/// every (batch, head) pair). 128-row blocks (8 warps, one K/V pass for
/// twice the rows) when they too fill the SMs and pad no more rows than
/// 64-row blocks would.
pub(crate) fn attention_mma_rows(q_len: usize, heads: usize, sm_count: u32) -> Option<u64> {
    let (q, hb, sms) = (q_len as u64, heads as u64, sm_count as u64);
    if q < 16 || q.div_ceil(64) * hb < sms {
        return None;
    }
    let fill128 = q.div_ceil(128) * hb >= sms;
    let same_padding = q.div_ceil(128) * 2 == q.div_ceil(64);
    Some(if q > 64 && fill128 && same_padding { 128 } else { 64 })
}

/// Keys the short-range attention kernels hold in shared memory at once
/// (`SHORT_KEYS` in kernels/attention_mma.cu).
pub(crate) const ATTN_SHORT_KEYS: usize = 128;

/// The tensor-core attention kernel for blocks of `rows` query rows (64 or
/// 128) at padded head dim `hdp`: the short-range kernel (whole K and V in
/// shared memory, 16- or 32-key chunks, 3 blocks of 8 warps per SM) for at most
/// `ATTN_SHORT_KEYS` keys and head dims up to 64, else the streaming one.
pub(crate) fn attention_block_kernel(rows: u64, hdp: usize, kv_len: usize, short: bool, causal: bool) -> &'static str {
    match (short && hdp <= 64 && kv_len <= ATTN_SHORT_KEYS, rows == 128, causal) {
        (true, true, false) => "attention_short_w8",
        (true, true, true) => "attention_short_w8_causal",
        (true, false, false) => "attention_short",
        (true, false, true) => "attention_short_causal",
        (false, true, _) => "attention_mma_w8",
        (false, false, _) => "attention_mma",
    }
}

/// Dynamic shared memory of the short-range attention kernel: its `rows`
/// query rows at the padded pitch (head dim `hdp` + 8) of 2-byte elements.
pub(crate) fn short_q_smem(rows: u64, hdp: usize) -> u32 {
    (rows as usize * (hdp + 8) * 2) as u32
}

/// Why this backend cannot run a thunk, or None when it can.
pub(crate) fn unsupported(t: &Thunk) -> Option<String> {
    let float = |d: &DType| d.is_float();
    let too_big = |n: usize| n as u64 >= (1u64 << 40);
    match t {
        Thunk::MatMul(m) if !float(&m.dtype) => Some(format!("matmul dtype {}", m.dtype)),
        Thunk::MatMul(m) if m.batch == 0 || m.m == 0 || m.n == 0 || m.k == 0 => Some("matmul with an empty dimension".into()),
        Thunk::MatMul(m) if m.lda < m.k as u64 || m.ldb < if m.b_trans { m.k } else { m.n } as u64 => {
            Some("matmul leading dimension smaller than the row".into())
        }
        Thunk::Binary { out_shape, a_strides, b_strides, .. }
            if out_shape.len() > MAX_RANK || a_strides.len() != out_shape.len() || b_strides.len() != out_shape.len() =>
        {
            Some(format!("binary of rank {} (at most {MAX_RANK}, strides per dim)", out_shape.len()))
        }
        Thunk::Copy { shape, src_strides, dst_strides, .. }
            if shape.len() > MAX_RANK || src_strides.len() != shape.len() || dst_strides.len() != shape.len() =>
        {
            Some(format!("copy of rank {} (at most {MAX_RANK}, strides per dim)", shape.len()))
        }
        Thunk::Copy { dtype, .. } if ![2, 4, 8].contains(&dtype.size()) => Some(format!("copy of {dtype}")),
        Thunk::Binary { dtype: DType::I32 | DType::I64, .. } => None,
        Thunk::Binary { dtype, .. }
        | Thunk::Activation { dtype, .. }
        | Thunk::Norm { dtype, .. }
        | Thunk::Softmax { dtype, .. }
        | Thunk::Reduce { dtype, .. }
        | Thunk::ArgMax { dtype, .. }
        | Thunk::TopK { dtype, .. }
        | Thunk::Rope { dtype, .. }
        | Thunk::SwiGlu { dtype, .. }
        | Thunk::EmbedNorm { dtype, .. }
            if !float(dtype) =>
        {
            Some(format!("{} on {dtype} (f32, f16, bf16 only)", t.kind()))
        }
        Thunk::MaskedMean { dtype, mask_dtype, out_dtype, .. } if !(float(dtype) && float(mask_dtype) && float(out_dtype)) => {
            Some(format!("masked_mean on {dtype} with a {mask_dtype} mask into {out_dtype} (float types only)"))
        }
        Thunk::Gather { id_dtype, .. } | Thunk::EmbedNorm { id_dtype, .. } if !matches!(id_dtype, DType::I32 | DType::I64) => {
            Some(format!("{} with {id_dtype} ids", t.kind()))
        }
        Thunk::EmbedNorm { rows, addends, .. } if addends.iter().any(|(_, n)| *n == 0 || rows % n != 0) => {
            Some("embed_norm addend rows that do not divide the rows".into())
        }
        Thunk::AttentionAppend(t) => unsupported(&Thunk::Attention(t.attn.clone())).or_else(|| {
            let a = &t.attn;
            if a.q_len != 1 {
                Some(format!("attention_append of {} rows (one per sequence)", a.q_len))
            } else if t.rope.is_some() && a.head_dim % 2 != 0 {
                Some(format!("attention_append with RoPE over the odd head_dim {}", a.head_dim))
            } else {
                None
            }
        }),
        Thunk::Attention(a) if a.head_dim == 0 || a.head_dim > 128 => Some(format!("attention head_dim {} (1..=128)", a.head_dim)),
        Thunk::Attention(a) if a.kv_heads == 0 || a.heads % a.kv_heads != 0 => {
            Some(format!("attention heads {} not a multiple of kv_heads {}", a.heads, a.kv_heads))
        }
        Thunk::Attention(a) if !float(&a.dtype) || a.batch > 65535 || a.heads > 65535 => Some("attention dtype or grid".into()),
        Thunk::Attention(a) if a.kv_dtype != a.dtype && !(a.dtype == DType::F32 && matches!(a.kv_dtype, DType::F16 | DType::BF16)) => {
            Some(format!("attention of {} queries over {} keys and values (f32 over f16 or bf16 only)", a.dtype, a.kv_dtype))
        }
        Thunk::WriteState { dtype, value_dtype, .. } if dtype != value_dtype && !(float(dtype) && float(value_dtype)) => {
            Some(format!("write_state of a {value_dtype} value into a {dtype} state"))
        }
        Thunk::Rope { head_dim, .. } if head_dim % 2 != 0 => Some(format!("rope with odd head_dim {head_dim}")),
        Thunk::TopK { k, len, .. } if *k > *len || *k == 0 => Some(format!("topk k={k} of len {len}")),
        Thunk::Norm { rows, .. } | Thunk::EmbedNorm { rows, .. } | Thunk::Softmax { outer: rows, .. } if too_big(*rows) => {
            Some("too many rows".into())
        }
        Thunk::QMatMul { .. } | Thunk::QGather { .. } | Thunk::Sample { .. } => crate::decode::unsupported(t),
        Thunk::FeedForward(f) => f.roles().err().or_else(|| f.parts.iter().find_map(unsupported)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::{attention_mma_rows, collapse, max_offset, norm_warp_nv};
    use rlx_ir::DType;

    /// Element offsets of every linear index, walking `shape` row-major.
    fn offsets(shape: &[usize], st: &[u64]) -> Vec<u64> {
        let n: usize = shape.iter().product();
        (0..n)
            .map(|i| {
                let (mut rem, mut off) = (i, 0u64);
                for d in (0..shape.len()).rev() {
                    off += (rem % shape[d]) as u64 * st[d];
                    rem /= shape[d];
                }
                off
            })
            .collect()
    }

    #[test]
    fn collapse_keeps_every_offset_and_merges_what_it_can() {
        // (shape, a strides, b strides, expected rank)
        type Case<'a> = (&'a [usize], &'a [u64], &'a [u64], usize);
        let cases: &[Case] = &[
            (&[32, 128, 768], &[98304, 768, 1], &[0, 768, 1], 2),     // x + position embeddings
            (&[32, 128, 768], &[98304, 768, 1], &[98304, 768, 1], 1), // same-shape add
            (&[32, 128, 768], &[98304, 768, 1], &[128, 1, 0], 2),     // hidden * mask[.., None]
            (&[32, 768], &[768, 1], &[1, 0], 2),                      // sum / count
            (&[3, 1, 7], &[7, 7, 1], &[0, 0, 1], 2),
            (&[1, 1], &[1, 1], &[0, 0], 1),
            (&[], &[], &[], 1),
            (&[2, 3, 4, 5], &[60, 20, 5, 1], &[0, 1, 0, 0], 3),
        ];
        for (shape, a, b, rank) in cases {
            let (cs, st) = collapse(shape, &[a, b]);
            assert_eq!(cs.len(), *rank, "{shape:?}: collapsed to {cs:?}");
            assert_eq!(cs.iter().product::<usize>(), shape.iter().product::<usize>().max(1));
            assert_eq!(offsets(&cs, &st[0]), offsets(shape, a), "{shape:?} a");
            assert_eq!(offsets(&cs, &st[1]), offsets(shape, b), "{shape:?} b");
            assert_eq!(max_offset(&cs, &st[0]), offsets(shape, a).into_iter().max().unwrap_or(0));
        }
    }

    #[test]
    fn binary_vec_choice() {
        use super::binary_vec_ok;
        let st = |v: &[&[u64]]| v.iter().map(|s| s.to_vec()).collect::<Vec<_>>();
        // x + position embeddings (f16, 8 per vector): collapsed [32, 98304].
        assert!(binary_vec_ok(&[32, 98304], &st(&[&[98304, 1], &[0, 1]]), 8, &[0, 256, 512]));
        assert!(!binary_vec_ok(&[32, 98304], &st(&[&[98304, 1], &[0, 1]]), 8, &[0, 258, 512]), "misaligned");
        assert!(!binary_vec_ok(&[32, 764], &st(&[&[764, 1], &[0, 1]]), 8, &[0]), "rows not whole vectors");
        assert!(!binary_vec_ok(&[4096, 768], &st(&[&[768, 1], &[1, 0]]), 8, &[0]), "broadcast along the row");
        assert!(!binary_vec_ok(&[3, 16], &st(&[&[20, 1], &[16, 1]]), 8, &[0]), "outer stride not whole vectors");
        assert!(binary_vec_ok(&[3, 16], &st(&[&[24, 1], &[16, 1]]), 8, &[0]));
        assert!(!binary_vec_ok(&[7], &st(&[&[1], &[1]]), 4, &[0]));
    }

    #[test]
    fn append_shape_and_scratch() {
        use super::{append_shape, AppendShape, SplitScratch};
        let shape = |warps, splits| AppendShape { warps, splits };
        // One sequence of 9 heads on 132 SMs: runs of 512 keys, up to 14 blocks a head.
        assert_eq!(append_shape(9, 4096, 132), shape(16, 8));
        assert_eq!(append_shape(9, 512, 132), shape(16, 1), "one run fits the cache");
        assert_eq!(append_shape(9, 513, 132), shape(16, 2));
        assert_eq!(append_shape(9, 100_000, 132), shape(16, 14), "a block an SM");
        assert_eq!(append_shape(2, 100_000, 132), shape(16, 16), "at most 16");
        assert_eq!(append_shape(72, 4096, 132), shape(16, 1), "a batch of 8 fills the GPU");
        assert_eq!(append_shape(180, 4096, 132), shape(4, 1), "more blocks than SMs");
        // Two appends: the counters of the widest, the partials of the largest.
        let s = SplitScratch::of_appends([(24, 64, 2048), (48, 64, 2048), (9, 64, 400)].into_iter(), 132).unwrap();
        assert_eq!(s.counts_bytes, 256);
        assert_eq!(s.part_bytes, (24 * 4 * 66 * 4) as u64);
        let s = SplitScratch::of_appends([(3, 48, 4096)].into_iter(), 132).unwrap();
        assert_eq!((s.counts_bytes, s.part_bytes), (256, (3 * 8 * 66 * 4) as u64), "head dim 48 pads to 64");
        assert_eq!(SplitScratch::of_appends([(9, 64, 512), (180, 64, 8192)].into_iter(), 132), None, "no append splits");
    }

    #[test]
    fn norm_warp_variant_choice() {
        assert_eq!(norm_warp_nv(DType::F16, 768, &[0, 256, 512]), Some(3));
        assert_eq!(norm_warp_nv(DType::F16, 384, &[0]), Some(2));
        assert_eq!(norm_warp_nv(DType::F32, 1024, &[0]), Some(8));
        assert_eq!(norm_warp_nv(DType::F16, 2048, &[0]), Some(8));
        assert_eq!(norm_warp_nv(DType::F16, 2056, &[0]), None, "too long for registers");
        assert_eq!(norm_warp_nv(DType::F16, 771, &[0]), None, "not whole vectors");
        assert_eq!(norm_warp_nv(DType::BF16, 768, &[0, 8]), None, "misaligned pointer");
    }

    #[test]
    fn attention_short_kernel_choice() {
        use super::attention_block_kernel as k;
        assert_eq!(k(128, 64, 128, true, false), "attention_short_w8");
        assert_eq!(k(64, 32, 77, true, false), "attention_short");
        assert_eq!(k(128, 32, 100, true, true), "attention_short_w8_causal");
        assert_eq!(k(64, 64, 128, true, true), "attention_short_causal");
        assert_eq!(k(128, 64, 129, true, false), "attention_mma_w8", "more keys than fit");
        assert_eq!(k(64, 96, 128, true, true), "attention_mma", "head dim past 64");
        assert_eq!(k(128, 64, 128, false, false), "attention_mma_w8", "a scale that is not positive");
    }

    #[test]
    fn attention_block_rows_choice() {
        // bert-base 32x128 (384 (batch, head) pairs) on 132 SMs: one 8-warp block per head.
        assert_eq!(attention_mma_rows(128, 384, 132), Some(128));
        // batch 1: even 64-row blocks leave SMs idle.
        assert_eq!(attention_mma_rows(128, 12, 132), None);
        assert_eq!(attention_mma_rows(128, 72, 132), Some(64), "128-row blocks would not fill");
        assert_eq!(attention_mma_rows(300, 160, 132), Some(64), "more padding at 128");
        assert_eq!(attention_mma_rows(250, 72, 132), Some(128));
        assert_eq!(attention_mma_rows(50, 400, 132), Some(64));
        assert_eq!(attention_mma_rows(8, 4000, 132), None);
    }
}
