//! A linear layer and the norm after it as one kernel (kernels/linnorm.cu)
//! for at most 128 rows: MatMul (+bias, +residual) → Norm (+residual)
//! instead of cuBLASLt and the norm kernel.
//!
//! `find` picks the pairs it can run: the matmul's weight is stored
//! `[N, K]` with (K, N) compiled, it has no activation, its output feeds
//! only the norm (it is not read again before it is overwritten, nor an
//! output), and the norm's output is either the same bytes as the matmul's
//! input or a residual, or apart from them. `build` lowers one pair for a slot: clusters
//! of N / OC blocks over groups of 16 rows, each block OC output columns
//! over the full K, the norm's row statistics combined across the cluster
//! through DSMEM.
//!
//! `set_linear_norm_fusion` or RLX_LINNORM (`1` on, `0` off, a number:
//! on with that many columns per block where compiled) chooses.

use rlx_compile::{BufRef, MatMulThunk, Thunk};
use rlx_ir::DType;
use rlx_runtime::Result;

use crate::ffn::dead_after;
use crate::launch::{suffix, Args, Bases, Kernels, Op, Step};

/// Rows the fused pair may have (the measured regime: batch 1 × 128).
const MAX_ROWS: usize = 128;
/// Rows per cluster (kernels/linnorm.cu LinNormSmem::R).
const ROWS: usize = 16;
/// Threads per block.
const THREADS: u32 = 256;

/// Compiled variants (kernels/linnorm.cu): K, N, the columns per block, the
/// first being the default.
const VARIANTS: [(usize, usize, [usize; 2]); 3] = [(384, 384, [32, 48]), (1536, 384, [32, 48]), (768, 768, [48, 96])];

/// kernels/linnorm.cu's LinNormSmem::TOTAL.
fn smem(k: usize, oc: usize) -> u32 {
    let (kp, pp) = (k + 8, oc + 4);
    let u = (ROWS * kp * 2).max(8 * ROWS * pp * 4);
    (oc * kp * 2 + u + ROWS * oc * 4 + 2 * ROWS * oc * 2 + 3 * oc * 2 + 2 * ROWS * 8) as u32
}

/// Which MatMul → Norm pairs run as the fused kernel (`set_linear_norm_fusion`, RLX_LINNORM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearNormFusion {
    /// None (RLX_LINNORM=0).
    Off,
    /// Every pair of a compiled width, in its default columns per block (RLX_LINNORM=1).
    On,
    /// As `On`, with this many columns per block where that is compiled, the
    /// default elsewhere (RLX_LINNORM=<columns>; A/B measurements and tests).
    Columns(usize),
}

static MODE: std::sync::Mutex<Option<LinearNormFusion>> = std::sync::Mutex::new(None);

/// Sets which MatMul → Norm pairs later prepares fuse (overrides `RLX_LINNORM`).
pub fn set_linear_norm_fusion(mode: LinearNormFusion) {
    if let Ok(mut g) = MODE.lock() {
        *g = Some(mode);
    }
}

fn mode() -> LinearNormFusion {
    if let Some(m) = MODE.lock().ok().and_then(|g| *g) {
        return m;
    }
    match std::env::var("RLX_LINNORM").ok().as_deref().map(str::trim) {
        Some("1" | "on" | "true" | "yes") => LinearNormFusion::On,
        Some(v) => v.parse().map(LinearNormFusion::Columns).unwrap_or(LinearNormFusion::Off),
        None => LinearNormFusion::Off,
    }
}

/// The columns per block for (K, N) under `mode`, None where not compiled.
fn columns(k: usize, n: usize, mode: LinearNormFusion) -> Option<usize> {
    let (_, _, ocs) = VARIANTS.iter().find(|v| v.0 == k && v.1 == n)?;
    match mode {
        LinearNormFusion::Columns(c) if ocs.contains(&c) => Some(c),
        _ => Some(ocs[0]),
    }
}

/// The matmul: [rows, K] · Wᵀ (+ bias, + residual), no activation, rows contiguous.
fn eligible(m: &MatMulThunk) -> bool {
    let rows = m.batch * m.m;
    matches!(m.dtype, DType::F16 | DType::BF16)
        && m.b_trans
        && m.b_batch_stride == 0
        && m.ldb == m.k as u64
        && (m.batch == 1 || m.a_batch_stride == m.m as u64 * m.lda)
        && m.lda.is_multiple_of(8)
        && m.lda >= m.k as u64
        && m.act.is_none()
        && (1..=MAX_ROWS).contains(&rows)
        && VARIANTS.iter().any(|v| v.0 == m.k && v.1 == m.n)
}

fn overlap(a: &BufRef, b: &BufRef) -> bool {
    a.space == b.space && a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes
}

/// `out` may be written while `b` is read only if they are the same bytes
/// (each block reads its own rows and columns before writing them) or apart.
fn same_or_apart(out: &BufRef, b: Option<&BufRef>) -> bool {
    b.is_none_or(|b| b == out || !overlap(out, b))
}

/// The starts of the MatMul → Norm pairs the fused kernel can run, none of
/// them inside `taken` (thunk ranges other fusions run); none when turned
/// off or before sm_90, which the clusters need.
pub(crate) fn find(thunks: &[Thunk], outputs: &[BufRef], cc_major: i32, taken: &[std::ops::Range<usize>]) -> Vec<usize> {
    if cc_major < 9 || mode() == LinearNormFusion::Off {
        return Vec::new();
    }
    find_all(thunks, outputs, taken)
}

fn find_all(thunks: &[Thunk], outputs: &[BufRef], taken: &[std::ops::Range<usize>]) -> Vec<usize> {
    let mut found = Vec::new();
    let mut i = 0;
    while i + 1 < thunks.len() {
        if let (Thunk::MatMul(m), Thunk::Norm { dtype, rows, cols, x, residual, out, .. }) = (&thunks[i], &thunks[i + 1]) {
            let ok = eligible(m)
                && !taken.iter().any(|r| r.start < i + 2 && i < r.end)
                && *dtype == m.dtype
                && *rows == m.batch * m.m
                && *cols == m.n
                && *x == m.out
                && residual.is_none_or(|r| r != *x)
                // In place over the input: each cluster reads all of its rows
                // before its first store, and no other cluster reads them.
                && (!overlap(out, &m.a) || (*out == m.a && m.lda == m.n as u64))
                && same_or_apart(out, m.residual.as_ref())
                && same_or_apart(out, residual.as_ref())
                // The norm writing over the matmul's output ends its life too.
                && (*out == m.out || dead_after(thunks, i + 1, &m.out, outputs));
            if ok {
                found.push(i);
                i += 2;
                continue;
            }
        }
        i += 1;
    }
    found
}

/// The fused kernel's step for the pair at `start`, or None when an operand
/// is not aligned or the device refuses the cluster (the pair then lowers
/// as usual).
pub(crate) fn build(k: &Kernels, thunks: &[Thunk], start: usize, b: &Bases) -> Result<Option<Step>> {
    let (Thunk::MatMul(m), Thunk::Norm { rms, eps, residual, gamma, beta, out, .. }) = (&thunks[start], &thunks[start + 1]) else {
        return Ok(None);
    };
    let Some(oc) = columns(m.k, m.n, mode()) else { return Ok(None) };
    let opt = |r: Option<&BufRef>| r.map(|r| b.ptr(r)).transpose().map(|p| p.unwrap_or(0));
    let (x, w, bias, res1, res2) = (b.ptr(&m.a)?, b.ptr(&m.b)?, opt(m.bias.as_ref())?, opt(m.residual.as_ref())?, opt(residual.as_ref())?);
    let (g, bt, o) = (b.ptr(gamma)?, opt(beta.as_ref())?, b.ptr(out)?);
    // 16-byte copies of every operand and row; 4-byte stores of the output.
    let row_bytes = m.lda * m.dtype.size() as u64;
    if !(x | w | bias | res1 | res2 | g | bt | row_bytes).is_multiple_of(16) || !o.is_multiple_of(4) {
        return Ok(None);
    }
    let rows = m.batch * m.m;
    let cs = m.n / oc;
    let func = k.own_gemm()?.get(&format!("linnorm_{}_{}_{oc}_{}", m.k, m.n, suffix(m.dtype)))?;
    let bytes = smem(m.k, oc);
    func.set_max_dynamic_smem(bytes)?;
    let groups = rows.div_ceil(ROWS);
    let grid = (cs * groups) as u32;
    // Clusters past 8 blocks are a non-portable size: refused on some devices.
    if cs > 8 && func.allow_non_portable_clusters().is_err() {
        return Ok(None);
    }
    if func.max_active_clusters(grid, THREADS, bytes, cs as u32).unwrap_or(0) == 0 {
        return Ok(None);
    }
    let args = Args::default().p(x).p(w).p(bias).p(res1).p(res2).p(g).p(bt).p(o).i(rows).p(m.lda).i(*rms as i64).f(*eps as f64);
    let op = Op::Kernel { func, grid: [grid, 1, 1], block: THREADS, smem: bytes, cluster: [cs as u32, 1, 1], args: args.0 };
    let mut step = Step::new(op, "linear_norm");
    step.weight = Some((w, m.b.bytes));
    Ok(Some(step))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_compile::Space;
    use rlx_ir::Activation;

    fn buf(offset: u64, bytes: usize) -> BufRef {
        BufRef { space: Space::Arena, offset, bytes: bytes as u64 }
    }
    fn w(i: u32, bytes: usize) -> BufRef {
        BufRef { space: Space::Weight(i), offset: 0, bytes: bytes as u64 }
    }
    /// X at 0, Y after it, the residual after Y, the norm's output last.
    fn pair(rows: usize, k: usize, n: usize, act: Option<Activation>) -> (Vec<Thunk>, [BufRef; 4]) {
        let x = buf(0, rows * k * 2);
        let y = buf(x.bytes, rows * n * 2);
        let r = buf(y.offset + y.bytes, rows * n * 2);
        let out = buf(r.offset + r.bytes, rows * n * 2);
        let mm = Thunk::MatMul(MatMulThunk {
            dtype: DType::F16,
            batch: 1,
            m: rows,
            n,
            k,
            a: x,
            lda: k as u64,
            a_batch_stride: (rows * k) as u64,
            b: w(1, n * k * 2),
            b_trans: true,
            ldb: k as u64,
            b_batch_stride: 0,
            bias: Some(w(2, n * 2)),
            act,
            residual: None,
            out: y,
        });
        let norm = Thunk::Norm {
            rms: false,
            dtype: DType::F16,
            rows,
            cols: n,
            eps: 1e-12,
            x: y,
            residual: Some(r),
            gamma: w(3, n * 2),
            beta: None,
            out,
        };
        (vec![mm, norm], [x, y, r, out])
    }

    #[test]
    fn finds_compiled_pairs_only() {
        for (k, n, _) in VARIANTS {
            let (t, [.., out]) = pair(128, k, n, None);
            assert_eq!(find_all(&t, &[out], &[]), [0], "{k}x{n}");
            // Taken by another fusion.
            assert!(find_all(&t, &[out], &[1..4]).is_empty());
        }
        for (rows, k, n, act) in [(129, 384, 384, None), (16, 256, 256, None), (16, 384, 384, Some(Activation::Gelu))] {
            let (t, [.., out]) = pair(rows, k, n, act);
            assert!(find_all(&t, &[out], &[]).is_empty(), "{rows} {k} {n} {act:?}");
        }
    }

    #[test]
    fn matmul_output_read_later_or_aliased_output_is_not_fused() {
        // The matmul's output is a graph output, or read after the norm.
        let (mut t, [x, y, _, out]) = pair(32, 384, 384, None);
        assert!(find_all(&t, &[out, y], &[]).is_empty());
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: y, out: x });
        assert!(find_all(&t, &[out], &[]).is_empty());
        // The norm's output over part of the matmul's input, or part of the residual.
        let (mut t, [x, _, r, _]) = pair(32, 384, 384, None);
        if let Thunk::Norm { out, .. } = &mut t[1] {
            *out = buf(x.offset + 768, x.bytes as usize);
        }
        assert!(find_all(&t, &[x], &[]).is_empty());
        // In place over the input (as the arena planner does in MiniLM): fused.
        if let Thunk::Norm { out, .. } = &mut t[1] {
            *out = x;
        }
        assert_eq!(find_all(&t, &[x], &[]), [0]);
        if let Thunk::Norm { out, .. } = &mut t[1] {
            *out = buf(r.offset + 256, r.bytes as usize);
        }
        assert!(find_all(&t, &[r], &[]).is_empty());
        // In place over the residual: fused.
        if let Thunk::Norm { out, .. } = &mut t[1] {
            *out = r;
        }
        assert_eq!(find_all(&t, &[r], &[]), [0]);
    }

    #[test]
    fn every_pair_of_the_real_minilm_schedule_is_found() {
        // `rlx inspect --model models/all-MiniLM-L6-v2 --precision f16 --json` (1×128).
        let s: rlx_compile::Schedule =
            serde_json::from_str(include_str!("../tests/data/minilm-f16-1x128.schedule.json")).expect("schedule");
        let outputs: Vec<BufRef> = s.outputs.iter().map(|o| o.buf).collect();
        let found = find_all(&s.thunks, &outputs, &[]);
        // Per layer: the output projection (thunk 3 of the layer) and FFN2 (6).
        let want: Vec<usize> = (0..6).flat_map(|l| [3 + 7 * l, 6 + 7 * l]).collect();
        assert_eq!(found, want);
    }

    #[test]
    fn shared_memory_matches_the_kernel_layout() {
        // W, then X (the f32 partials reuse it), y, the residuals, bias/gamma/beta, statistics.
        assert_eq!(smem(384, 32), (32 * 392 * 2 + (8 * 16 * 36 * 4) + 16 * 32 * 4 + 2 * 16 * 32 * 2 + 3 * 32 * 2 + 256) as u32);
        assert_eq!(smem(1536, 48), (48 * 1544 * 2 + 16 * 1544 * 2 + 16 * 48 * 4 + 2 * 16 * 48 * 2 + 3 * 48 * 2 + 256) as u32);
        for (k, n, ocs) in VARIANTS {
            for oc in ocs {
                assert!(smem(k, oc) <= 227 * 1024 && n % oc == 0 && n / oc <= 16 && oc % 16 == 0, "{k} {n} {oc}");
            }
        }
    }
}
