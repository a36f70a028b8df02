//! Fused attention: one rayon task per (batch, head, block of 128 queries)
//! computes that block's scores against one head's keys, masks and
//! softmaxes them, and multiplies by that head's values, all in f32 task
//! buffers (K transposed so a score tile is broadcast-FMAs over 16 keys at
//! a time; 4 query rows share every K or V vector loaded). A task holds at
//! most a [128, kv_len] block of one head's scores; the full
//! [B, H, Sq, Skv] matrix is never built. This replaced two small gemm
//! calls per task: 3% faster on MiniLM at 1×128 and 8×128 (bench/cpu-perf.md).
//!
//! Masking: keys at or past `valid_len` (default kv_len), keys whose
//! key-padding mask is zero, and with `causal` keys after the query's
//! position (`valid_len - q_len + i` for query i) get weight exactly 0. A
//! query row with no key left (fully masked) outputs zeros rather than NaN.

use rayon::prelude::*;
use rlx_compile::AttentionThunk;
use rlx_ir::DType;

use super::lanes;
use crate::elem::{with_float, Elem};
use crate::memory::{Dst, Mem, Src};
use crate::{exec_err, Result};

/// Queries per task: enough work to amortise loading the head's K and V.
const Q_BLOCK: usize = 128;

/// Whether element i of a mask of any dtype is nonzero.
fn keep(mask: &Src<u8>, dtype: DType, i: usize) -> bool {
    let es = dtype.size();
    let b = mask.row(i * es, es);
    match dtype {
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) != 0.0,
        DType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32() != 0.0,
        DType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32() != 0.0,
        DType::I32 | DType::I64 => b.iter().any(|&x| x != 0),
    }
}

pub fn run(t: &AttentionThunk, mem: &Mem) -> Result<()> {
    let valid = match &t.valid_len {
        Some(b) => {
            let v = mem.src::<i32>(b).map_err(exec_err)?.get(0);
            if v < 0 || v as usize > t.kv_len {
                return Err(exec_err(format!("attention: valid_len {v} is outside 0..={} (kv_len)", t.kv_len)));
            }
            v as usize
        }
        None => t.kv_len,
    };
    let mask = t.mask.map(|m| mem.src::<u8>(&m)).transpose().map_err(exec_err)?;
    with_float!(t.dtype, T => {
        let q = mem.src::<T>(&t.q.buf).map_err(exec_err)?;
        let k = mem.src::<T>(&t.k.buf).map_err(exec_err)?;
        let v = mem.src::<T>(&t.v.buf).map_err(exec_err)?;
        let out = mem.dst::<T>(&t.out).map_err(exec_err)?;
        tasks::<T>(t, valid, mask, q, k, v, out);
    });
    Ok(())
}

/// One task's f32 working set, reused across the tasks a thread runs.
struct TaskBuf {
    /// Kᵀ: [head_dim][vp], keys contiguous (zero past `valid`).
    kt: Vec<f32>,
    /// V: [valid][hdp], each row zero-padded to a multiple of 16.
    v: Vec<f32>,
    /// 1.0 for a kept key, 0.0 for a masked one or past `valid`.
    keep: Vec<f32>,
    /// Q rows pre-multiplied by the scale: [qb][head_dim].
    q: Vec<f32>,
    /// Scores, then unnormalised probabilities: [qb][vp].
    s: Vec<f32>,
    out: Vec<f32>,
    /// Per query: keys before this one may be attended, and 1 / Σ p.
    limit: Vec<usize>,
    inv: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn tasks<T: Elem>(t: &AttentionThunk, valid: usize, mask: Option<Src<u8>>, q: Src<T>, k: Src<T>, v: Src<T>, out: Dst<T>) {
    let (hd, group) = (t.head_dim, t.heads / t.kv_heads.max(1));
    let blocks = t.q_len.div_ceil(Q_BLOCK);
    // Rows of the largest block: the task buffers are sized to it.
    let qb = Q_BLOCK.min(t.q_len);
    let out_w = t.heads * hd;
    // Keys padded to whole 16-lane vectors, head dims too (for P·V).
    let (vp, hdp) = (valid.div_ceil(16) * 16, hd.div_ceil(16) * 16);
    // Every key's mask flag once, not once per head: 1.0 kept, 0.0 masked.
    let kept: Vec<f32> = (0..t.batch * valid)
        .map(|i| {
            let (b, j) = (i / valid, i % valid);
            if mask.as_ref().is_none_or(|m| keep(m, t.mask_dtype, b * t.kv_len + j)) {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    (0..t.batch * t.heads * blocks).into_par_iter().for_each_init(
        || TaskBuf {
            kt: vec![0.0; hd * vp],
            v: vec![0.0; valid * hdp],
            keep: vec![0.0; vp],
            q: vec![0.0; qb * hd],
            s: vec![0.0; qb * vp],
            out: vec![0.0; qb * hdp],
            limit: vec![0; qb],
            inv: vec![0.0; qb],
        },
        |buf, task| {
            let (b, rest) = (task / (t.heads * blocks), task % (t.heads * blocks));
            let (h, blk) = (rest / blocks, rest % blocks);
            let g = h / group;
            let q0 = blk * Q_BLOCK;
            let qn = Q_BLOCK.min(t.q_len - q0);
            buf.keep[..valid].copy_from_slice(&kept[b * valid..(b + 1) * valid]);
            // This head's keys transposed and values row by row, in f32. A
            // masked key's K and V are zeros: whatever the buffer holds there
            // (NaN, inf) must not reach a score or a weighted sum as 0 · NaN.
            // Read in place and converted element by element: a library
            // copy per 32-float row cost more than the row (memmove was 2%
            // of MiniLM at 8×128).
            for j in 0..valid {
                let vrow = &mut buf.v[j * hdp..j * hdp + hd];
                if buf.keep[j] == 0.0 {
                    vrow.fill(0.0);
                    (0..hd).for_each(|d| buf.kt[d * vp + j] = 0.0);
                } else {
                    let kr = k.row(b * t.k.batch_stride as usize + j * t.k.row_stride as usize + g * hd, hd);
                    let vr = v.row(b * t.v.batch_stride as usize + j * t.v.row_stride as usize + g * hd, hd);
                    vrow.iter_mut().zip(vr).for_each(|(o, x)| *o = x.to_f32());
                    for (d, x) in kr.iter().enumerate() {
                        buf.kt[d * vp + j] = x.to_f32();
                    }
                }
            }
            for i in 0..qn {
                let qr = q.row(b * t.q.batch_stride as usize + (q0 + i) * t.q.row_stride as usize + h * hd, hd);
                buf.q[i * hd..(i + 1) * hd].iter_mut().zip(qr).for_each(|(o, x)| *o = x.to_f32() * t.scale);
                buf.limit[i] = if t.causal {
                    // Query i sits at absolute position valid - q_len + i.
                    let p = valid as isize - t.q_len as isize + (q0 + i) as isize;
                    (p + 1).clamp(0, valid as isize) as usize
                } else {
                    valid
                };
            }
            let dims = Dims { hd, hdp, vp, qn };
            block(&dims, &buf.kt, &buf.v, &buf.q, &buf.keep, &buf.limit[..qn], &mut buf.s, &mut buf.inv, &mut buf.out);
            for i in 0..qn {
                out.store((b * t.q_len + q0 + i) * out_w + h * hd, &buf.out[i * hdp..i * hdp + hd]);
            }
        },
    );
}

/// Sizes of one task: head dim (and padded), padded keys, queries.
struct Dims {
    hd: usize,
    hdp: usize,
    vp: usize,
    qn: usize,
}

/// Query rows handled together: each key or value vector loaded from L1 is
/// used by this many rows from registers.
const R: usize = 4;

crate::simd::multiversion! {
    /// Scores, masked softmax and P·V of one task, in f32.
    #[allow(clippy::too_many_arguments)]
    fn block(d: &Dims, kt: &[f32], v: &[f32], q: &[f32], keep: &[f32], limit: &[usize], s: &mut [f32], inv: &mut [f32], out: &mut [f32]) {
        let (hd, vp, qn) = (d.hd, d.vp, d.qn);
        let mut i = 0;
        while i < qn {
            let nr = (qn - i).min(R);
            let mut j = 0;
            while j < vp {
                match (nr, vp - j >= 64) {
                    (R, true) => score_tile::<R, 64>(kt, vp, hd, q, i, j, s),
                    (R, false) => score_tile::<R, 16>(kt, vp, hd, q, i, j, s),
                    (_, true) => (0..nr).for_each(|r| score_tile::<1, 64>(kt, vp, hd, q, i + r, j, s)),
                    (_, false) => (0..nr).for_each(|r| score_tile::<1, 16>(kt, vp, hd, q, i + r, j, s)),
                }
                j += if vp - j >= 64 { 64 } else { 16 };
            }
            i += nr;
        }
        // No masked key before any row's limit: the select-free softmax.
        let all = keep[..limit.iter().copied().max().unwrap_or(0)].iter().all(|&k| k != 0.0);
        for (i, &lim) in limit.iter().enumerate() {
            let row = &mut s[i * vp..(i + 1) * vp];
            inv[i] = if all { softmax_row::<true>(row, keep, lim) } else { softmax_row::<false>(row, keep, lim) };
        }
        let mut i = 0;
        while i < qn {
            let nr = (qn - i).min(R);
            // Probabilities past a row's limit are 0, so the tile may run to
            // the largest limit among its rows.
            let keys = limit[i..i + nr].iter().copied().max().unwrap_or(0);
            let mut c = 0;
            while c < d.hdp {
                let w = d.hdp - c;
                match (nr, w) {
                    (R, 64..) => pv_tile::<R, 64>(s, vp, v, d.hdp, keys, i, c, inv, out),
                    (R, 32..) => pv_tile::<R, 32>(s, vp, v, d.hdp, keys, i, c, inv, out),
                    (R, _) => pv_tile::<R, 16>(s, vp, v, d.hdp, keys, i, c, inv, out),
                    (_, 32..) => (0..nr).for_each(|r| pv_tile::<1, 32>(s, vp, v, d.hdp, keys, i + r, c, inv, out)),
                    (_, _) => (0..nr).for_each(|r| pv_tile::<1, 16>(s, vp, v, d.hdp, keys, i + r, c, inv, out)),
                }
                c += if w >= 64 && nr == R { 64 } else if w >= 32 { 32 } else { 16 };
            }
            i += nr;
        }
    }
}

/// s[i0 + r][j0..j0 + W] = q row (i0 + r) · Kᵀ columns j0..j0 + W, for r < N:
/// N × W accumulators in registers, one Kᵀ vector load per N FMAs.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn score_tile<const N: usize, const W: usize>(kt: &[f32], vp: usize, hd: usize, q: &[f32], i0: usize, j0: usize, s: &mut [f32]) {
    let mut acc = [[0f32; W]; N];
    let qr: [&[f32]; N] = std::array::from_fn(|r| &q[(i0 + r) * hd..(i0 + r + 1) * hd]);
    for d in 0..hd {
        let k: &[f32; W] = kt[d * vp + j0..][..W].try_into().unwrap_or(&[0.0; W]);
        for r in 0..N {
            let x = qr[r][d];
            for l in 0..W {
                acc[r][l] = x.mul_add(k[l], acc[r][l]);
            }
        }
    }
    for r in 0..N {
        s[(i0 + r) * vp + j0..][..W].copy_from_slice(&acc[r]);
    }
}

/// out[i0 + r][c0..c0 + W] = (Σ_j p[i0 + r][j] · v[j][c0..c0 + W]) / Σ p.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn pv_tile<const N: usize, const W: usize>(
    p: &[f32],
    vp: usize,
    v: &[f32],
    hdp: usize,
    keys: usize,
    i0: usize,
    c0: usize,
    inv: &[f32],
    out: &mut [f32],
) {
    let mut acc = [[0f32; W]; N];
    let pr: [&[f32]; N] = std::array::from_fn(|r| &p[(i0 + r) * vp..(i0 + r) * vp + keys]);
    for j in 0..keys {
        let vr: &[f32; W] = v[j * hdp + c0..][..W].try_into().unwrap_or(&[0.0; W]);
        for r in 0..N {
            let x = pr[r][j];
            for l in 0..W {
                acc[r][l] = x.mul_add(vr[l], acc[r][l]);
            }
        }
    }
    for r in 0..N {
        let o = &mut out[(i0 + r) * hdp + c0..][..W];
        for l in 0..W {
            o[l] = acc[r][l] * inv[i0 + r];
        }
    }
}

/// Turns one score row into unnormalised weights e^(x - max) over the keys
/// before `limit` that the mask keeps (every other weight exactly 0) and
/// returns 1 / Σ weights, or 0 for a row with no key left (zeros, not NaN).
#[inline(always)]
/// `ALL`: every key before `limit` is kept (no key-padding mask in this
/// batch row), so `keep` is not read and no lane needs a select.
fn softmax_row<const ALL: bool>(row: &mut [f32], keep: &[f32], limit: usize) -> f32 {
    let (head, tail) = row.split_at_mut(limit.min(row.len()));
    tail.fill(0.0);
    let keep = &keep[..head.len()];
    let m = fold_max::<ALL>(head, keep);
    if m == f32::NEG_INFINITY {
        head.fill(0.0);
        return 0.0;
    }
    // Masked weights are exactly 0 (a select, so even a non-finite score
    // there cannot leak through as 0 · NaN). Summed in the same pass, in
    // 32 independent lanes folded pairwise.
    const L: usize = 32;
    let mut acc = [0f32; L];
    let mut rest = 0f32;
    let mut hc = head.chunks_exact_mut(L);
    let mut kc = keep.chunks_exact(L);
    for (x, k) in (&mut hc).zip(&mut kc) {
        for l in 0..L {
            let e = if ALL || k[l] != 0.0 { lanes::exp(x[l] - m) } else { 0.0 };
            x[l] = e;
            acc[l] += e;
        }
    }
    for (x, &k) in hc.into_remainder().iter_mut().zip(kc.remainder()) {
        *x = if ALL || k != 0.0 { lanes::exp(*x - m) } else { 0.0 };
        rest += *x;
    }
    for w in [16, 8, 4, 2, 1] {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    1.0 / (acc[0] + rest)
}

/// Max of the kept entries (-inf when none is kept).
#[inline(always)]
fn fold_max<const ALL: bool>(v: &[f32], keep: &[f32]) -> f32 {
    const L: usize = 32;
    let mut acc = [f32::NEG_INFINITY; L];
    let (vc, kc) = (v.chunks_exact(L), keep.chunks_exact(L));
    let (vr, kr) = (vc.remainder(), kc.remainder());
    // Plain compares (not f32::max, whose NaN rule costs extra
    // instructions per lane); a NaN score is skipped either way.
    for (a, b) in vc.zip(kc) {
        for l in 0..L {
            let x = if ALL || b[l] != 0.0 { a[l] } else { f32::NEG_INFINITY };
            acc[l] = if x > acc[l] { x } else { acc[l] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for (&a, &b) in vr.iter().zip(kr) {
        if ALL || b != 0.0 {
            m = m.max(a);
        }
    }
    // Pairwise, so the fold vectorises (see lanes::fold).
    for w in [16, 8, 4, 2, 1] {
        for l in 0..w {
            acc[l] = acc[l].max(acc[l + w]);
        }
    }
    m.max(acc[0])
}
