//! The fused feed-forward block (kernels/ffn.cu) for at most 128 rows: a
//! `Thunk::FeedForward` (the compiler's `fuse_ffn` pass) as one kernel
//! instead of cuBLASLt, the GELU epilogue, cuBLASLt and the norm.
//!
//! [`eligible`] is the one rule for which blocks the kernel runs, from the
//! shapes alone: sm_90+ (clusters), f16 or bf16, erf-GELU, weights stored
//! `[out, in]`, at most 128 rows, widths (H, I) the kernel's tiling divides
//! with and without the tail (one module holds both; H a multiple of 128
//! up to 384, I/16 a multiple of 32, and the tail's limits) and whose
//! shared memory fits the device. The backend reports the others as unsupported,
//! and they run as their parts. [`build`] lowers one for a slot; it also
//! declines (the parts run) when an operand is not aligned or the row
//! groups do not fit at once. The kernel is compiled for the block's (H, I)
//! the first time a schedule needs it (src/nvrtc.rs `ffn_source`).
//!
//! The kernel is a row split (`ffn_rows_<H>_<I>`): 16-block clusters over
//! groups of at most 32 rows run the whole block and the norm, each block
//! 1/16 of I, FFN2's partials and the norm's statistics summed over DSMEM.
//! Where the block starts at the attention's output projection and its norm
//! (MatMul [H, H] → Norm → the block), `ffn_rows_tail_<H>_<I>` runs those
//! two as well: each block OC = H/16 columns of the projection, norm1's
//! statistics combined over DSMEM, and norm1's output stored and pushed
//! into every block of the cluster. On sm_90+ it is the default
//! (`CudaOptions::ffn_fusion`): at MiniLM's widths it measured faster than
//! cuBLASLt's kernels at every row count up to 128 (20 kernels per 1×128
//! forward instead of 50).

use rlx_ir::{Activation, DType};
use rlx_runtime::Result;
use rlx_schedule::{BufRef, FeedForwardParts, FeedForwardThunk, MatMulThunk, Thunk};

use crate::launch::{suffix, Bases, Op, Step};
use crate::modules::Kernels;
use crate::params::{i, FfnRowsP};

/// Rows one fused block handles.
const MAX_ROWS: usize = 128;
/// Blocks per cluster of the row split (a non-portable size).
const ROW_CLUSTER: usize = 16;
/// Rows one row-split cluster can take (kernels/ffn.cu FfnRowsSmem::RT).
const ROW_TILE: usize = 32;
/// Rows per row-split group to aim for (as many groups as that takes, up to
/// the clusters that fit at once): a cluster's DSMEM partials and epilogue
/// grow with its rows; 12 measured best on the H200 between 1×16 and 1×64
/// (8 to 32 were tried).
const GROUP_ROWS: usize = 12;
/// The most shared memory one block of the kernel may ask for (its
/// static_assert; sm_90's opt-in limit).
const SMEM_MAX: usize = 227 * 1024;

/// kernels/ffn.cu's FfnRowsSmem::TOTAL.
fn row_smem(h: usize, i: usize) -> usize {
    let is = i / ROW_CLUSTER;
    let (xp, hp) = (h + 8, is + 8);
    let khalf = 4 * 16 * (is / 2 + 4) * 4;
    (ROW_TILE + is) * xp * 2 + h * hp * 2 + ROW_TILE * hp * 2 + is * 2 + 2 * ROW_TILE * 4 + ROW_TILE * 8 * 4 + khalf
}

/// The tail kernel's extra shared memory: the output projection's weight
/// slice [32][H+8] (kernels/ffn.cu FfnRowsSmem::WO).
fn tail_smem(h: usize) -> usize {
    32 * (h + 8) * 2
}

/// Whether the kernel's tiling takes widths (H, I), with or without the
/// tail: kernels/ffn.cu's static_asserts, plus the row-split's float4
/// units of a row (at most 6 per block, beside the 2 statistics slots).
fn widths_fit(h: usize, i: usize, tail: bool) -> bool {
    if h == 0 || i == 0 || !i.is_multiple_of(ROW_CLUSTER) || !h.is_multiple_of(ROW_CLUSTER) {
        return false;
    }
    let (is, oc) = (i / ROW_CLUSTER, h / ROW_CLUSTER);
    let (hp, u4) = (is + 8, oc / 4);
    let (nf1, nf2) = (is / 16, h / 32);
    let plain = h.is_multiple_of(128)
        && is.is_multiple_of(32)
        && nf1.is_multiple_of(2)
        && nf2.is_multiple_of(2)
        && oc.is_multiple_of(4)
        && ROW_TILE * u4 <= 256
        && u4 <= 6;
    let tail_ok = oc.is_multiple_of(8)
        && oc <= 32
        && h.is_multiple_of(64)
        && 2 * ROW_TILE * oc + 3 * oc <= ROW_TILE * hp
        && ROW_TILE * oc <= 4 * 16 * (is / 2 + 4)
        && 4 * ROW_TILE * 36 * 4 <= h * hp * 2;
    plain && (!tail || tail_ok)
}

/// Shared memory one block of the kernel takes at (H, I).
fn smem(h: usize, i: usize, tail: bool) -> usize {
    row_smem(h, i) + if tail { tail_smem(h) } else { 0 }
}

/// `w` may be written (by the block that owns its rows and columns, after
/// every read of `r` that other blocks make) while `r` is read only if they
/// are the same bytes or apart.
fn same_or_apart(w: &BufRef, r: Option<&BufRef>) -> bool {
    r.is_none_or(|r| r == w || !w.overlaps(r))
}

/// The first matmul: [rows, H] · W1ᵀ + b1, erf-GELU, rows contiguous.
fn first(m: &MatMulThunk) -> bool {
    let rows = m.batch * m.m;
    matches!(m.dtype, DType::F16 | DType::BF16)
        && m.b_trans
        && m.b_batch_stride == 0
        && m.ldb == m.k as u64
        && (m.batch == 1 || m.a_batch_stride == m.m as u64 * m.lda)
        && m.lda.is_multiple_of(8)
        && m.lda >= m.k as u64
        && m.act == Some(Activation::Gelu)
        && m.residual.is_none()
        && (1..=MAX_ROWS).contains(&rows)
}

/// `b` reads `a`'s whole output as a contiguous [rows, n] matrix.
fn second(a: &MatMulThunk, b: &MatMulThunk) -> bool {
    b.dtype == a.dtype
        && b.a == a.out
        && b.batch * b.m == a.batch * a.m
        && (b.batch == 1 || b.a_batch_stride == b.m as u64 * b.lda)
        && b.lda == a.n as u64
        && b.k == a.n
        && b.n == a.k
        && b.b_trans
        && b.b_batch_stride == 0
        && b.ldb == b.k as u64
        && b.act.is_none()
        && b.residual.is_none_or(|r| r != b.out)
}

/// The attention's output projection ([rows, H] · W_oᵀ (+ bias, +
/// residual), W_o [H, H]) and the norm (+ residual) whose output FFN1
/// reads; `ffn2` and `norm2_res` are the block's residuals, read after
/// norm1's output is written, `norm2_out` the block's output.
fn tail(o: &MatMulThunk, n1: &Thunk, ffn: &MatMulThunk, ffn2: &MatMulThunk, norm2_res: Option<&BufRef>, norm2_out: &BufRef) -> bool {
    let Thunk::Norm { dtype, rows, cols, x, residual, out, .. } = n1 else { return false };
    let h = ffn.k;
    o.dtype == ffn.dtype
        && o.b_trans
        && o.b_batch_stride == 0
        && o.ldb == o.k as u64
        && o.k == h
        && o.n == h
        && o.batch * o.m == ffn.batch * ffn.m
        && (o.batch == 1 || o.a_batch_stride == o.m as u64 * o.lda)
        && o.lda.is_multiple_of(8)
        && o.lda >= o.k as u64
        && o.act.is_none()
        && o.residual.is_none_or(|r| r != o.out)
        && *dtype == o.dtype
        && *rows == o.batch * o.m
        && *cols == h
        && *x == o.out
        && residual.is_none_or(|r| r != *x)
        && *out == ffn.a
        && ffn.lda == h as u64
        // Norm1's output over the projection's input only as the same rows.
        && (!out.overlaps(&o.a) || (*out == o.a && o.lda == h as u64))
        && same_or_apart(out, residual.as_ref())
        && same_or_apart(out, o.residual.as_ref())
        && (!norm2_out.overlaps(&o.a) || (*norm2_out == o.a && o.lda == h as u64))
        && same_or_apart(norm2_out, residual.as_ref())
        && same_or_apart(norm2_out, o.residual.as_ref())
        && same_or_apart(norm2_out, Some(out))
        && same_or_apart(out, ffn2.residual.as_ref())
        && same_or_apart(out, norm2_res)
}

/// Whether the fused kernel runs this block on a device of compute
/// capability `cc` whose blocks may opt into `smem_optin` bytes of shared
/// memory (Ok), or why not. The one rule: from the shapes, not a list of
/// models.
pub(crate) fn eligible(f: &FeedForwardThunk, cc: (i32, i32), smem_optin: usize) -> std::result::Result<(), String> {
    if cc.0 < 9 {
        return Err(format!("sm_{}{}: the kernel needs thread-block clusters (sm_90+)", cc.0, cc.1));
    }
    let FeedForwardParts { attn_out, ffn1: a, ffn2: b, norm } = f.roles()?;
    let Thunk::Norm { dtype, rows, cols, x, residual, out, .. } = norm else { return Err("no norm".into()) };
    let ok = first(a)
        && second(a, b)
        && *dtype == a.dtype
        && *rows == a.batch * a.m
        && *cols == a.k
        && *x == b.out
        && residual.is_none_or(|r| r != *x)
        // The norm's output over a block's input rows or residuals only
        // as the same bytes (read before the rows' owner writes them).
        && (!out.overlaps(&a.a) || (*out == a.a && a.lda == a.k as u64))
        && same_or_apart(out, b.residual.as_ref())
        && same_or_apart(out, residual.as_ref());
    if !ok {
        return Err("not f16/bf16 erf-GELU over at most 128 contiguous rows by [out, in] weights".into());
    }
    if let Some((o, n1)) = attn_out {
        if !tail(o, n1, a, b, residual.as_ref(), out) {
            return Err("the output projection and its norm do not match the block".into());
        }
    }
    let (h, n_i, with_tail) = (a.k, a.n, attn_out.is_some());
    // One module per (H, I) holds the plain and the tail kernels, so it
    // compiles only for widths that fit both.
    if !widths_fit(h, n_i, true) {
        return Err(format!("widths H {h}, I {n_i} do not fit the kernel's tiling"));
    }
    let need = smem(h, n_i, with_tail);
    if need > SMEM_MAX.min(smem_optin) {
        return Err(format!("H {h}, I {n_i} need {need} bytes of shared memory per block, the device allows {}", SMEM_MAX.min(smem_optin)));
    }
    Ok(())
}

/// The launch step of one fused block for a slot, or None when an operand
/// is not aligned or the row groups do not fit at once (the parts then run
/// as usual). `f` must be [`eligible`]. `trace`: print the grouping.
pub(crate) fn build(k: &Kernels, f: &FeedForwardThunk, b: &Bases, trace: bool) -> Result<Option<Vec<Step>>> {
    let Ok(FeedForwardParts { attn_out, ffn1: m1, ffn2: m2, norm }) = f.roles() else { return Ok(None) };
    let Thunk::Norm { rms, eps, x: _, residual, gamma, beta, out, .. } = norm else { return Ok(None) };
    let opt = |r: Option<&BufRef>| r.map(|r| b.ptr(r)).transpose().map(|p| p.unwrap_or(0));
    let (x, w1, w2) = (b.ptr(&m1.a)?, b.ptr(&m1.b)?, b.ptr(&m2.b)?);
    let (b1, b2) = (opt(m1.bias.as_ref())?, opt(m2.bias.as_ref())?);
    let (res1, res2) = (opt(m2.residual.as_ref())?, opt(residual.as_ref())?);
    let (g, bt, o) = (b.ptr(gamma)?, opt(beta.as_ref())?, b.ptr(out)?);
    // Every pointer and row 16 bytes aligned (8 for the norm's 4-wide loads
    // of the residuals, b2, gamma, beta and out).
    let row_bytes = m1.lda * m1.dtype.size() as u64;
    if !(x | w1 | w2 | b1 | row_bytes).is_multiple_of(16) || !(b2 | res1 | res2 | g | bt | o).is_multiple_of(8) {
        return Ok(None);
    }
    let rows = (m1.batch * m1.m) as u64;
    let sfx = suffix(m1.dtype);
    let (h, n_i) = (m1.k, m1.n);
    // The kernels could not be compiled or loaded: the parts run as usual
    // (said once per process, as this is the default path).
    let own = match k.ffn(h, n_i) {
        Ok(o) => o,
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("rlx-cuda: fused feed-forward kernels unavailable, using the unfused ones: {e}"));
            return Ok(None);
        }
    };
    let mut p = FfnRowsP {
        x,
        w1,
        b1,
        w2,
        b2,
        res1,
        res2,
        gamma: g,
        beta: bt,
        out: o,
        m: rows as i64,
        lda: m1.lda as i64,
        rms: *rms as i64,
        eps: *eps as f64,
        // The tail's fields: zeros unless set below.
        ..Default::default()
    };
    let smem = smem(h, n_i, attn_out.is_some()) as u32;
    let name = if let Some((mo, n1)) = attn_out {
        let Thunk::Norm { rms: rms1, eps: eps1, residual: r1, gamma: g1, beta: be1, out: out1, .. } = n1 else {
            return Ok(None);
        };
        let (xa, wo, bo) = (b.ptr(&mo.a)?, b.ptr(&mo.b)?, opt(mo.bias.as_ref())?);
        let (r0a, r0, g1, be1, o1) = (opt(mo.residual.as_ref())?, opt(r1.as_ref())?, b.ptr(g1)?, opt(be1.as_ref())?, b.ptr(out1)?);
        // 16-byte copies of every operand and of each block's 48-byte
        // column slices; 4-byte stores of norm1's output.
        let a_row = mo.lda * mo.dtype.size() as u64;
        if !(xa | wo | bo | r0a | r0 | g1 | be1 | a_row).is_multiple_of(16) || !o1.is_multiple_of(4) {
            return Ok(None);
        }
        (p.xa, p.wo, p.bo, p.res0a, p.res0, p.g1, p.be1, p.out1) = (xa, wo, bo, r0a, r0, g1, be1, o1);
        (p.lda_a, p.rms1, p.eps1) = (mo.lda as i64, *rms1 as i64, *eps1 as f64);
        format!("ffn_rows_tail_{h}_{n_i}_{sfx}")
    } else {
        format!("ffn_rows_{h}_{n_i}_{sfx}")
    };
    let func = own.get(&name)?;
    func.set_max_dynamic_smem(smem)?;
    // Groups of about GROUP_ROWS rows, as many as fit at once (one wave),
    // each at most ROW_TILE rows; else (or where 16-block clusters are
    // refused) the parts run as usual.
    let want = (rows as usize).div_ceil(GROUP_ROWS);
    let fit = match func.allow_non_portable_clusters() {
        Ok(()) => func.max_active_clusters((ROW_CLUSTER * want) as u32, 256, smem, ROW_CLUSTER as u32).unwrap_or(0) as usize,
        Err(_) => 0,
    };
    let groups = want.min(fit);
    let per = if groups == 0 { usize::MAX } else { (rows as usize).div_ceil(groups) };
    if trace {
        eprintln!("rlx-cuda ffn rows {h}x{n_i}: {rows} rows, {fit} clusters of {ROW_CLUSTER} fit, {groups} groups of {per} rows");
    }
    if per > ROW_TILE {
        return Ok(None);
    }
    p.rows = i(per);
    let grid = [(ROW_CLUSTER * groups) as u32, 1, 1];
    let op = Op::kernel(func, grid, 256, smem, [ROW_CLUSTER as u32, 1, 1], &p)?;
    Ok(Some(vec![Step::new(op, "ffn")]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_matches_the_kernel_layout() {
        // X and W1 (the f32 partial reuses them), W2, H, b1,
        // statistics, per-thread sums, FFN1's second K half.
        assert_eq!(
            row_smem(384, 1536),
            (32 + 96) * 392 * 2 + 384 * 104 * 2 + 32 * 104 * 2 + 96 * 2 + 2 * 32 * 4 + 32 * 8 * 4 + 4 * 16 * 52 * 4
        );
        assert_eq!(tail_smem(384), 32 * 392 * 2);
        assert!(smem(384, 1536, true) <= SMEM_MAX);
    }

    #[test]
    fn the_width_rule() {
        // MiniLM, and smaller widths the tiling divides.
        for (h, i) in [(384, 1536), (256, 1024), (384, 1024), (256, 512), (128, 512)] {
            assert!(widths_fit(h, i, false) && smem(h, i, false) <= SMEM_MAX, "{h} {i}");
        }
        for (h, i) in [(384, 1536), (256, 1024), (256, 2048)] {
            assert!(widths_fit(h, i, true) && smem(h, i, true) <= SMEM_MAX, "{h} {i} tail");
        }
        // The tail's projection partials do not fit H 128's W2 slice.
        assert!(!widths_fit(128, 512, true));
        // H 512 and 768 take more than 6 float4 units of a row per block;
        // bert-base's (768, 3072) also needs more shared memory than sm_90 has.
        assert!(!widths_fit(512, 2048, false) && !widths_fit(768, 3072, false));
        assert!(smem(768, 3072, false) > SMEM_MAX);
        // I/16 not a multiple of 32, H not a multiple of 128.
        assert!(!widths_fit(384, 1000, false) && !widths_fit(320, 1280, false) && !widths_fit(384, 768, false));
    }
}
