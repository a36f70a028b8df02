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
//! RLX_LAYER=0 turns the program off; RLX_LAYER=1 takes every eligible run
//! whatever its row count; by default matmuls of up to `AUTO_MAX_ROWS` rows
//! qualify (at more rows cuBLASLt's large tiles win). RLX_LAYER_BLOCKS=n
//! sets blocks per SM (default 2, at most what fits).

use std::ops::Range;
use std::sync::Arc;

use rlx_compile::{BufRef, Thunk};
use rlx_ir::DType;
use rlx_runtime::Result;

use crate::driver::{err, Device, DeviceBuffer};
use crate::launch::{act_code, attention_args, Bases, Kernels, Op, Step};

/// Dynamic shared memory of a block: 4 stages of 64x(64+8) A and B tiles
/// (kernels/layer.cu); also the attention buffers and 4 rows of f32 values.
pub(crate) const SMEM: u32 = 4 * 2 * 64 * 72 * 2;
const THREADS: u32 = 128;
const WARPS: usize = 4;
const TILE: usize = 64;
/// Matmul rows up to which the program is used by default.
pub(crate) const AUTO_MAX_ROWS: usize = 256;
const WORDS: usize = 32;
const LI_GEMM: u64 = 1;
const LI_ROWS: u64 = 2;
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
            let ok = half(*dtype) && cols.is_multiple_of(8) && *cols > 0 && *rows > 0 && cols * 4 * WARPS <= SMEM as usize;
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

/// K splits for a matmul tile grid on `blocks` blocks: the fewest waves x
/// chunks per item, a split > 1 charged 3 chunks (its partial sum pass and
/// barrier), fewest splits on ties.
pub(crate) fn splits(rows: usize, n: usize, k: usize, blocks: usize) -> usize {
    let tiles = rows.div_ceil(TILE) * (n / TILE);
    let chunks = (k / TILE).max(1);
    let blocks = blocks.max(1);
    let cost = |s: usize| (tiles * s).div_ceil(blocks) * chunks.div_ceil(s) + if s > 1 { 3 } else { 0 };
    (1..=chunks.min(16)).min_by_key(|&s| (cost(s), s)).unwrap_or(1)
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

fn same_buf(a: &BufRef, b: &BufRef) -> bool {
    a.space == b.space && a.offset == b.offset
}

/// The program for `thunks[range]` (a run from `runs`) in one slot, or None
/// when this slot's operands or the device do not allow it.
pub(crate) fn build(dev: &Arc<Device>, kernels: &Kernels, thunks: &[Thunk], range: Range<usize>, b: &Bases) -> Result<Option<Program>> {
    let run = &thunks[range];
    let Some(dtype) = run.iter().find_map(|t| eligible(t, usize::MAX).map(|e| e.0)) else { return Ok(None) };
    let hdp = run.iter().find_map(|t| eligible(t, usize::MAX).map(|e| e.1).filter(|&h| h > 0)).unwrap_or(64);
    let func = kernels.get(&format!("layer_program_{}", if dtype == DType::BF16 { "bf16" } else { "f16" }))?;
    func.set_max_dynamic_smem(SMEM)?;
    let fit = func.max_blocks_per_sm(THREADS, SMEM)?;
    let want = std::env::var("RLX_LAYER_BLOCKS").ok().and_then(|v| v.trim().parse::<u32>().ok()).unwrap_or(2).max(1);
    let per_sm = want.min(fit);
    if per_sm == 0 {
        return Ok(None);
    }
    let blocks = per_sm * kernels.sm_count;

    let opt = |x: &Option<BufRef>| -> Result<u64> { x.as_ref().map(|r| b.ptr(r)).transpose().map(|p| p.unwrap_or(0)) };
    let mut aligned = true;
    let mut need16 = |p: u64| aligned &= p.is_multiple_of(16);
    let mut prog: Vec<Instr> = Vec::new();
    let mut work_bytes = 0u64;
    // The workspace pointer is patched in once its size is known.
    const WORK_SLOT: u64 = u64::MAX;
    let mut i = 0;
    while i < run.len() {
        match &run[i] {
            Thunk::MatMul(m) => {
                let rows = m.batch * m.m;
                let (a, w, out) = (b.ptr(&m.a)?, b.ptr(&m.b)?, b.ptr(&m.out)?);
                let (bias, res) = (opt(&m.bias)?, opt(&m.residual)?);
                for p in [a, w, out, bias, res] {
                    need16(p);
                }
                let s = splits(rows, m.n, m.k, blocks as usize);
                let act = act_code(m.act) as u64;
                let gemm = |bias: u64, res: u64, act: u64, work: u64| {
                    [a, w, bias, res, out, work, rows as u64, m.n as u64, m.k as u64, m.lda, act, s as u64]
                };
                let wbytes = (m.n * m.k * dtype.size()) as u64;
                if s == 1 {
                    let mut g = instr(LI_GEMM, &gemm(bias, res, act, 0))?;
                    g.weight = Some((w, wbytes));
                    prog.push(g);
                    i += 1;
                    continue;
                }
                work_bytes = work_bytes.max((s * rows * m.n * 4) as u64);
                let mut g = instr(LI_GEMM, &gemm(0, 0, 0, WORK_SLOT))?;
                g.weight = Some((w, wbytes));
                prog.push(g);
                // The partial sums, with a LayerNorm / RmsNorm that reads this
                // matmul's output folded in.
                let norm = match run.get(i + 1) {
                    Some(Thunk::Norm { rows: nr, cols, x, .. }) if same_buf(x, &m.out) && *nr == rows && *cols == m.n => run.get(i + 1),
                    _ => None,
                };
                let (gamma, beta, nout, eps, rms, nres) = match norm {
                    Some(Thunk::Norm { gamma, beta, out, eps, rms, residual, .. }) => {
                        (b.ptr(gamma)?, opt(beta)?, b.ptr(out)?, *eps, *rms, opt(residual)?)
                    }
                    _ => (0, 0, 0, 0.0, false, 0),
                };
                for p in [gamma, beta, nout, nres] {
                    need16(p);
                }
                let r = [
                    WORK_SLOT,
                    0,
                    bias,
                    res,
                    out,
                    gamma,
                    beta,
                    nout,
                    rows as u64,
                    m.n as u64,
                    s as u64,
                    act,
                    norm.is_some() as u64,
                    rms as u64,
                    (eps as f64).to_bits(),
                    nres,
                ];
                prog.push(instr(LI_ROWS, &r)?);
                i += if norm.is_some() { 2 } else { 1 };
            }
            Thunk::Norm { rms, rows, cols, eps, x, residual, gamma, beta, out, .. } => {
                let (x, gamma, beta, out, nres) = (b.ptr(x)?, b.ptr(gamma)?, opt(beta)?, b.ptr(out)?, opt(residual)?);
                for p in [x, gamma, beta, out, nres] {
                    need16(p);
                }
                let r = [0, x, 0, 0, 0, gamma, beta, out, *rows as u64, *cols as u64, 0, 0, 1, *rms as u64, (*eps as f64).to_bits(), nres];
                prog.push(instr(LI_ROWS, &r)?);
                i += 1;
            }
            Thunk::Attention(a) => {
                prog.push(instr(LI_ATTN, &attention_args(a, b)?.0)?);
                i += 1;
            }
            t => return Err(err(format!("layer program: thunk kind {} is not one it runs", t.kind()))),
        }
    }
    if !aligned {
        return Ok(None);
    }
    // Each matmul's weight is prefetched into L2 by the instruction right
    // after the matmul before it, so it streams in while that one's partial
    // sums and the next ops run.
    let gemms: Vec<usize> = prog.iter().enumerate().filter(|(_, x)| x.weight.is_some()).map(|(i, _)| i).collect();
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

    let bar_bytes = 256u64;
    let scratch = DeviceBuffer::alloc(dev, bar_bytes + work_bytes.max(16))?;
    scratch.zero()?;
    let work = scratch.ptr + bar_bytes;
    let mut bytes = Vec::with_capacity(prog.len() * WORDS * 8);
    for ins in &mut prog {
        for w in ins.words.iter_mut() {
            if *w == WORK_SLOT {
                *w = work;
            }
        }
        bytes.extend(ins.words.iter().flat_map(|w| w.to_le_bytes()));
    }
    let code = DeviceBuffer::alloc(dev, bytes.len() as u64)?;
    code.upload(0, &bytes)?;
    let args = vec![code.ptr, prog.len() as u64, scratch.ptr, hdp as u64];
    let step = Step::new(Op::Kernel { func, grid: [blocks, 1, 1], block: THREADS, smem: SMEM, cluster: [1, 1, 1], args }, "layer");
    Ok(Some(Program { step, buffers: vec![code, scratch], instructions: prog.len() }))
}

#[cfg(test)]
mod tests {
    use super::*;

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
