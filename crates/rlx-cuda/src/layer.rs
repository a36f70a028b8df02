//! The layer program (kernels/layer.cu): a run of consecutive MatMul,
//! Attention and Norm thunks (at batch 1 a whole BERT encoder, embeddings'
//! LayerNorm to the last layer) executed by one persistent kernel, with a
//! grid-wide barrier between instructions instead of kernel boundaries.
//!
//! `runs` finds the runs the program can execute; `build` turns one into
//! instructions for one slot (device pointers are per slot) and the launch
//! step. A run it cannot take at build time (an operand not 16-byte
//! aligned, no room on the SMs) returns None and the thunks lower as usual.
//!
//! Off by default: on the H200 it measured slower than the kernel-per-thunk
//! graph (bench/gpu-perf.md, session 6, final code: MiniLM 1x128 291
//! against 163 µs, bert-base 762 against 420 µs). RLX_LAYER=auto takes runs whose matmuls
//! have at most `AUTO_MAX_ROWS` rows, RLX_LAYER=1 every eligible run,
//! RLX_LAYER=0 none (`set_layer_policy` overrides the variable).
//! Diagnostics: RLX_LAYER_TRACE=1 prints each instruction's time (block 0's
//! view) after every launch and the kernel's resources at prepare;
//! RLX_LAYER_NOOPS=k appends k empty instructions (the barrier's cost);
//! RLX_LAYER_PREFETCH=0 drops the L2 weight prefetch; RLX_LAYER_MAX_SPLITS=s
//! caps the K splits.

use std::ops::Range;
use std::sync::Arc;

use rlx_compile::{BufRef, Thunk};
use rlx_ir::DType;
use rlx_runtime::Result;

use crate::driver::{err, Device, DeviceBuffer};
use crate::launch::{act_code, attention_args, Bases, Kernels, Op, Step};

/// Dynamic shared memory of a block: 8 stages of 64x(64+8) A and B tiles
/// (kernels/layer.cu); also the attention buffers and 4 rows of f32 values.
pub(crate) const SMEM: u32 = 8 * 2 * 64 * 72 * 2;
const THREADS: u32 = 128;
/// Widest norm row (kernels/layer.cu: 8 vectors of 8 per lane).
const NORM_MAX_COLS: usize = 2048;
const TILE: usize = 64;
/// Matmul rows up to which `Policy::Auto` takes a run.
pub(crate) const AUTO_MAX_ROWS: usize = 256;
const WORDS: usize = 32;
const LI_GEMM: u64 = 1;
const LI_NORM: u64 = 2;
const LI_ATTN: u64 = 3;

/// When runs of thunks execute as one layer program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Off,
    /// Matmuls of at most `AUTO_MAX_ROWS` rows.
    Auto,
    /// Every eligible run, any row count.
    On,
}

/// Without `RLX_LAYER` or `set_layer_policy`.
const DEFAULT_POLICY: Policy = Policy::Off;

static POLICY: std::sync::Mutex<Option<Policy>> = std::sync::Mutex::new(None);

/// Sets the process-wide layer-program policy for later prepares
/// (overrides `RLX_LAYER`).
pub fn set_layer_policy(p: Policy) {
    if let Ok(mut g) = POLICY.lock() {
        *g = Some(p);
    }
}

impl Policy {
    /// `set_layer_policy`'s choice, else `RLX_LAYER`, else `DEFAULT_POLICY`.
    pub(crate) fn current() -> Policy {
        if let Some(p) = POLICY.lock().ok().and_then(|g| *g) {
            return p;
        }
        match std::env::var("RLX_LAYER").ok().as_deref().map(str::trim) {
            Some("0" | "off" | "false" | "no") => Policy::Off,
            Some("1" | "on" | "true" | "yes") => Policy::On,
            Some("auto") => Policy::Auto,
            _ => DEFAULT_POLICY,
        }
    }
}

fn half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// The head dim the attention body is compiled for (32 or 64).
fn attention_hdp(head_dim: usize) -> usize {
    head_dim.div_ceil(32) * 32
}

/// (dtype, attention head dim padding or 0) when the program can run `t`.
fn eligible(t: &Thunk, max_rows: usize) -> Option<(DType, usize)> {
    match t {
        Thunk::MatMul(m) => {
            let rows = m.batch * m.m;
            let folded = m.batch == 1 || m.a_batch_stride == m.m as u64 * m.lda;
            let ok = half(m.dtype)
                && m.b_trans
                && m.b_batch_stride == 0
                && m.ldb == m.k as u64
                && folded
                && m.k.is_multiple_of(TILE)
                && m.n.is_multiple_of(TILE)
                && m.lda.is_multiple_of(8)
                && rows > 0
                && rows <= max_rows
                && rows < (1 << 31);
            ok.then_some((m.dtype, 0))
        }
        Thunk::Attention(a) => {
            let ok = half(a.dtype) && a.head_dim.is_multiple_of(16) && a.head_dim <= 64 && a.q_len > 0 && a.kv_heads > 0;
            ok.then_some((a.dtype, attention_hdp(a.head_dim)))
        }
        Thunk::Norm { dtype, rows, cols, .. } => {
            let ok = half(*dtype) && cols.is_multiple_of(8) && *cols > 0 && *cols <= NORM_MAX_COLS && *rows > 0;
            ok.then_some((*dtype, 0))
        }
        _ => None,
    }
}

/// Maximal runs of consecutive thunks the program can execute: one dtype,
/// one attention head-dim variant, at least one matmul and two thunks.
pub(crate) fn runs(thunks: &[Thunk], policy: Policy) -> Vec<Range<usize>> {
    let max_rows = match policy {
        Policy::Off => return Vec::new(),
        Policy::Auto => AUTO_MAX_ROWS,
        Policy::On => usize::MAX,
    };
    let mut out = Vec::new();
    let mut start = 0;
    let mut key: Option<(DType, usize)> = None;
    let close = |out: &mut Vec<Range<usize>>, r: Range<usize>| {
        let has_mm = thunks[r.clone()].iter().any(|t| matches!(t, Thunk::MatMul(_)));
        if r.len() >= 2 && has_mm {
            out.push(r);
        }
    };
    for (i, t) in thunks.iter().enumerate() {
        let e = eligible(t, max_rows);
        match (e, key) {
            (Some((d, h)), Some((kd, kh))) if d == kd && (h == 0 || kh == 0 || h == kh) => key = Some((kd, kh.max(h))),
            _ => {
                if key.is_some() {
                    close(&mut out, start..i);
                }
                start = i;
                key = e;
            }
        }
    }
    if key.is_some() {
        close(&mut out, start..thunks.len());
    }
    out
}

/// K splits for a matmul tile grid on `blocks` blocks: the fewest chunks per
/// item, a split > 1 charged one chunk (the tile's blocks wait for each other
/// and sum the partials), fewest splits on ties; tiles x splits never exceeds
/// `blocks` (the split blocks of a tile must run at once), and no split when
/// the tiles alone fill the blocks.
pub(crate) fn splits(rows: usize, n: usize, k: usize, blocks: usize) -> usize {
    let tiles = rows.div_ceil(TILE) * (n / TILE);
    let chunks = (k / TILE).max(1);
    let blocks = blocks.max(1);
    if tiles >= blocks {
        return 1; // a full wave already: partial sums would only add traffic
    }
    // A split tile's blocks wait for each other: all items in one wave.
    let cost = |s: usize| chunks.div_ceil(s) + usize::from(s > 1);
    (1..=chunks.min(max_splits()).min(blocks / tiles)).min_by_key(|&s| (cost(s), s)).unwrap_or(1)
}

/// RLX_LAYER_MAX_SPLITS (default 16): the most K splits of a matmul.
fn max_splits() -> usize {
    std::env::var("RLX_LAYER_MAX_SPLITS").ok().and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(16).clamp(1, 64)
}

/// One slot's program: the launch step and the buffers it points into.
pub(crate) struct Program {
    pub step: Step,
    pub buffers: Vec<DeviceBuffer>,
    pub instructions: usize,
}

struct Instr {
    words: [u64; WORDS],
    /// Weight bytes this instruction's matmul reads (prefetched earlier).
    weight: Option<(u64, u64)>,
}

fn instr(kind: u64, body: &[u64]) -> Result<Instr> {
    if body.len() > WORDS - 4 {
        return Err(err(format!("layer instruction of {} words (at most {})", body.len(), WORDS - 4)));
    }
    let mut words = [0u64; WORDS];
    words[0] = kind;
    words[4..4 + body.len()].copy_from_slice(body);
    Ok(Instr { words, weight: None })
}

/// The program for `thunks[range]` (a run from `runs`) in one slot, or None
/// when this slot's operands or the device do not allow it.
pub(crate) fn build(dev: &Arc<Device>, kernels: &Kernels, thunks: &[Thunk], range: Range<usize>, b: &Bases) -> Result<Option<Program>> {
    let run = &thunks[range];
    let Some(dtype) = run.iter().find_map(|t| eligible(t, usize::MAX).map(|e| e.0)) else { return Ok(None) };
    let hdp = run.iter().find_map(|t| eligible(t, usize::MAX).map(|e| e.1).filter(|&h| h > 0)).unwrap_or(64);
    let func = kernels.get(&format!("layer_program_{}", if dtype == DType::BF16 { "bf16" } else { "f16" }))?;
    // A device without the shared memory (or the occupancy query) runs the
    // thunks as usual kernels.
    if func.set_max_dynamic_smem(SMEM).is_err() {
        return Ok(None);
    }
    // One block per SM (the 8-stage pipeline's shared memory allows no
    // more), every one resident: the grid barrier needs them all at once.
    if func.max_blocks_per_sm(THREADS, SMEM).unwrap_or(0) == 0 {
        return Ok(None);
    }
    let blocks = kernels.sm_count;

    let opt = |x: &Option<BufRef>| -> Result<u64> { x.as_ref().map(|r| b.ptr(r)).transpose().map(|p| p.unwrap_or(0)) };
    let mut aligned = true;
    let mut need16 = |p: u64| aligned &= p.is_multiple_of(16);
    let mut prog: Vec<Instr> = Vec::new();
    let (mut work_bytes, mut max_tiles) = (0u64, 0u64);
    for t in run {
        match t {
            Thunk::MatMul(m) => {
                let rows = m.batch * m.m;
                let (a, w, out) = (b.ptr(&m.a)?, b.ptr(&m.b)?, b.ptr(&m.out)?);
                let (bias, res) = (opt(&m.bias)?, opt(&m.residual)?);
                for p in [a, w, out, bias, res] {
                    need16(p);
                }
                let s = splits(rows, m.n, m.k, blocks as usize);
                let tiles = (rows.div_ceil(TILE) * (m.n / TILE)) as u64;
                if s > 1 {
                    work_bytes = work_bytes.max(s as u64 * tiles * (TILE * TILE * 4) as u64);
                    max_tiles = max_tiles.max(tiles);
                }
                let act = act_code(m.act) as u64;
                // Words 5 and 6 (workspace, tile counters) are set once their sizes are known.
                let body = [a, w, bias, res, out, 0, 0, rows as u64, m.n as u64, m.k as u64, m.lda, act, s as u64];
                let mut g = instr(LI_GEMM, &body)?;
                g.weight = Some((w, (m.n * m.k * dtype.size()) as u64));
                prog.push(g);
            }
            Thunk::Norm { rms, rows, cols, eps, x, residual, gamma, beta, out, .. } => {
                let (x, gamma, beta, out, res) = (b.ptr(x)?, b.ptr(gamma)?, opt(beta)?, b.ptr(out)?, opt(residual)?);
                for p in [x, gamma, beta, out, res] {
                    need16(p);
                }
                let body = [x, res, gamma, beta, out, *rows as u64, *cols as u64, *rms as u64, (*eps as f64).to_bits()];
                prog.push(instr(LI_NORM, &body)?);
            }
            Thunk::Attention(a) => prog.push(instr(LI_ATTN, &attention_args(a, b)?.0)?),
            t => return Err(err(format!("layer program: thunk kind {} is not one it runs", t.kind()))),
        }
    }
    // RLX_LAYER_NOOPS=k: k empty instructions at the end (measures the barrier).
    let noops = std::env::var("RLX_LAYER_NOOPS").ok().and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(0);
    for _ in 0..noops.min(1000) {
        prog.push(instr(0, &[])?);
    }
    if !aligned {
        return Ok(None);
    }
    // Each matmul's weight is prefetched into L2 by the instruction right
    // after the matmul before it, so it streams in while that one's partial
    // sums and the next ops run.
    let prefetch = std::env::var("RLX_LAYER_PREFETCH").map(|v| v.trim() != "0").unwrap_or(true);
    let gemms: Vec<usize> =
        if !prefetch { Vec::new() } else { prog.iter().enumerate().filter(|(_, x)| x.weight.is_some()).map(|(i, _)| i).collect() };
    for pair in gemms.windows(2) {
        let (prev, next) = (pair[0], pair[1]);
        let at = (prev + 1).min(next);
        if let Some((p, n)) = prog[next].weight {
            if prog[at].words[1] == 0 {
                prog[at].words[1] = p;
                prog[at].words[2] = n;
            }
        }
    }

    // Scratch: the barrier counter, RLX_LAYER_TRACE's timestamps, the split
    // tiles' counters, the partial sums.
    let trace = std::env::var("RLX_LAYER_TRACE").is_ok_and(|v| v.trim() == "1");
    let times_bytes = (8 * (9 * prog.len() as u64 + 1)).div_ceil(256) * 256;
    let head = 256 + times_bytes + (4 * max_tiles).div_ceil(256) * 256;
    let scratch = DeviceBuffer::alloc(dev, head + work_bytes.max(16))?;
    scratch.zero()?;
    let work = scratch.ptr + head;
    let times = if trace { scratch.ptr + 256 } else { 0 };
    let cnt_bytes = (4 * max_tiles).div_ceil(256) * 256;
    let mut bytes = Vec::with_capacity(prog.len() * WORDS * 8);
    for ins in &mut prog {
        if ins.words[0] == LI_GEMM {
            ins.words[4 + 5] = work;
            ins.words[4 + 6] = work - cnt_bytes;
        }
        bytes.extend(ins.words.iter().flat_map(|w| w.to_le_bytes()));
    }
    let code = DeviceBuffer::alloc(dev, bytes.len() as u64)?;
    code.upload(0, &bytes)?;
    if trace {
        let (regs, local) = func.regs_and_local_bytes()?;
        eprintln!(
            "rlx-cuda layer program: {} thunks as {} instructions, {blocks} blocks (1 per SM), {regs} registers, {local} local bytes per thread, {} KB partial sums",
            run.len(),
            prog.len(),
            work_bytes / 1024
        );
    }
    let args = vec![code.ptr, prog.len() as u64, scratch.ptr, hdp as u64, times];
    let mut step = Step::new(Op::Kernel { func, grid: [blocks, 1, 1], block: THREADS, smem: SMEM, cluster: [1, 1, 1], args }, "layer");
    step.cooperative = true;
    Ok(Some(Program { step, buffers: vec![code, scratch], instructions: prog.len() }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_compile::{AttentionThunk, MatMulThunk, SeqView, Space};

    fn buf(offset: u64) -> BufRef {
        BufRef { space: Space::Arena, offset, bytes: 1 << 20 }
    }
    fn mm(dtype: DType, m: usize, k: usize) -> Thunk {
        Thunk::MatMul(MatMulThunk {
            dtype,
            batch: 1,
            m,
            n: 128,
            k,
            a: buf(0),
            lda: k as u64,
            a_batch_stride: (m * k) as u64,
            b: BufRef { space: Space::Weight(0), offset: 0, bytes: 1 << 20 },
            b_trans: true,
            ldb: k as u64,
            b_batch_stride: 0,
            bias: None,
            act: None,
            residual: None,
            out: buf(1 << 20),
        })
    }
    fn norm(dtype: DType, cols: usize) -> Thunk {
        Thunk::Norm { rms: false, dtype, rows: 128, cols, eps: 1e-12, x: buf(0), residual: None, gamma: buf(0), beta: None, out: buf(0) }
    }
    fn attention(head_dim: usize) -> Thunk {
        let v = SeqView { buf: buf(0), batch_stride: 0, row_stride: 0 };
        Thunk::Attention(AttentionThunk {
            dtype: DType::F16,
            batch: 1,
            heads: 2,
            kv_heads: 2,
            head_dim,
            q_len: 128,
            kv_len: 128,
            scale: 1.0,
            causal: false,
            q: v,
            k: v,
            v,
            mask: None,
            mask_dtype: DType::F32,
            valid_len: None,
            out: buf(0),
        })
    }
    fn cast() -> Thunk {
        Thunk::Cast { from: DType::F32, to: DType::F16, n: 8, src: buf(0), dst: buf(0) }
    }

    #[test]
    fn runs_cover_maximal_stretches_of_one_dtype_and_head_dim() {
        let h = DType::F16;
        let t = vec![
            cast(),
            norm(h, 128),
            mm(h, 128, 128),
            attention(32),
            mm(h, 128, 128),
            norm(h, 128),
            cast(),
            // A lone norm (no matmul) is not worth a program.
            norm(h, 128),
            cast(),
            mm(h, 128, 128),
            // Another head dim, a bf16 matmul and an f32 matmul each end a run.
            attention(64),
            attention(32),
            mm(DType::BF16, 128, 128),
            mm(DType::F32, 128, 128),
            mm(h, 128, 128),
            // K not a multiple of 64 and a norm row too wide are not eligible.
            mm(h, 128, 96),
            norm(h, 4096),
        ];
        assert_eq!(runs(&t, Policy::Auto), vec![1..6, 9..11]);
        assert_eq!(runs(&t, Policy::Off), Vec::<Range<usize>>::new());
        // Rows past AUTO_MAX_ROWS only under On.
        let big = vec![mm(h, 512, 128), norm(h, 128)];
        assert!(runs(&big, Policy::Auto).is_empty());
        assert_eq!(runs(&big, Policy::On), vec![0..2]);
    }

    #[test]
    fn splits_fill_the_blocks_without_a_second_wave() {
        // bert-base QKV at 128 rows on 264 blocks: 72 tiles x 3 splits.
        assert_eq!(splits(128, 2304, 768, 264), 3);
        // FFN2: 24 tiles, 48 chunks -> 10 splits of 5 chunks (240 items).
        assert_eq!(splits(128, 768, 3072, 264), 10);
        // A grid with more tiles than blocks never splits.
        assert_eq!(splits(4096, 3072, 768, 264), 1);
        // Cheaper than the unsplit tile: never worse than 1.
        for (r, n, k) in [(128, 384, 384), (77, 64, 64), (256, 1536, 384)] {
            let s = splits(r, n, k, 264);
            assert!((1..=(k / 64)).contains(&s), "{r}x{n}x{k}: {s}");
        }
    }
}
