//! Fused attention: one rayon task per (batch, head, block of 128 queries)
//! computes that block's scores against one head's keys, masks and
//! softmaxes them, and multiplies by that head's values, all in f32 task
//! buffers (K transposed so a score tile is broadcast-FMAs over 16 keys at
//! a time; 4 query rows share every K or V vector loaded). A task holds at
//! most a [128, kv_len] block of one head's scores; the full
//! [B, H, Sq, Skv] matrix is never built. This replaced two small gemm
//! calls per task: 3% faster on MiniLM at 1×128 and 8×128 (bench/LOG.md).
//!
//! A few query rows per head (a decode step) take another path: one task
//! per (batch row, head) reads that head's K and V rows where they lie, a
//! tile of keys at a time, rather than copying and transposing the whole
//! cache for one query.
//!
//! Masking: keys at or past `valid_len` (default kv_len), keys whose
//! key-padding mask is zero, and with `causal` keys after the query's
//! position (`valid_len - q_len + i` for query i) get weight exactly 0. A
//! query row with no key left (fully masked) outputs zeros rather than NaN.

use rayon::prelude::*;
use rlx_ir::DType;
use rlx_schedule::AttentionThunk;

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
        DType::I32 | DType::I64 | DType::U8 => b.iter().any(|&x| x != 0),
    }
}

pub fn run(t: &AttentionThunk, mem: &Mem) -> Result<()> {
    let Some(b) = &t.valid_len else { return run_valid(t, t.kv_len, mem) };
    let lens = mem.src::<i32>(b).map_err(exec_err)?;
    let rows = if t.valid_len_per_batch { t.batch } else { 1 };
    let mut valid = Vec::with_capacity(rows);
    for r in 0..rows {
        let v = lens.get(r);
        if v < 0 || v as usize > t.kv_len {
            return Err(exec_err(format!("attention: valid_len {v} (batch row {r}) is outside 0..={} (kv_len)", t.kv_len)));
        }
        valid.push(v as usize);
    }
    if !t.valid_len_per_batch {
        return run_valid(t, valid[0], mem);
    }
    // One valid length per batch row: each row is its own batch-1 attention.
    for (r, &v) in valid.iter().enumerate() {
        run_valid(&batch_row(t, r), v, mem)?;
    }
    Ok(())
}

/// The thunk restricted to batch row `r` (its operands start at that row).
fn batch_row(t: &AttentionThunk, r: usize) -> AttentionThunk {
    let (es, kes) = (t.dtype.size() as u64, t.kv_dtype.size() as u64);
    let shift = |b: rlx_schedule::BufRef, elems: u64, size: u64| {
        let d = (r as u64 * elems).saturating_mul(size);
        rlx_schedule::BufRef { offset: b.offset + d, bytes: b.bytes.saturating_sub(d), ..b }
    };
    let seq = |v: &rlx_schedule::SeqView, es: u64| rlx_schedule::SeqView { buf: shift(v.buf, v.batch_stride, es), ..*v };
    AttentionThunk {
        batch: 1,
        q: seq(&t.q, es),
        k: seq(&t.k, kes),
        v: seq(&t.v, kes),
        mask: t.mask.map(|m| shift(m, t.kv_len as u64, t.mask_dtype.size() as u64)),
        out: shift(t.out, (t.q_len * t.heads * t.head_dim) as u64, es),
        valid_len: None,
        valid_len_per_batch: false,
        ..t.clone()
    }
}

fn run_valid(t: &AttentionThunk, valid: usize, mem: &Mem) -> Result<()> {
    let mask = t.mask.map(|m| mem.src::<u8>(&m)).transpose().map_err(exec_err)?;
    with_float!(t.dtype, T => {
        let q = mem.src::<T>(&t.q.buf).map_err(exec_err)?;
        let out = mem.dst::<T>(&t.out).map_err(exec_err)?;
        with_float!(t.kv_dtype, K => {
            let k = mem.src::<K>(&t.k.buf).map_err(exec_err)?;
            let v = mem.src::<K>(&t.v.buf).map_err(exec_err)?;
            tasks::<T, K>(t, valid, mask, q, k, v, out);
        })
    });
    Ok(())
}

/// One task's f32 working set, reused across the tasks a thread runs.
struct TaskBuf {
    /// K rows in f32: [vp][head_dim] (zero past `valid`), then transposed.
    k: Vec<f32>,
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
fn tasks<T: Elem, K: Elem>(t: &AttentionThunk, valid: usize, mask: Option<Src<u8>>, q: Src<T>, k: Src<K>, v: Src<K>, out: Dst<T>) {
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
    if t.q_len <= DECODE_ROWS {
        return decode(t, valid, &kept, q, k, v, out);
    }
    (0..t.batch * t.heads * blocks).into_par_iter().for_each_init(
        || TaskBuf {
            k: vec![0.0; vp * hd],
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
            // This head's keys and values row by row in f32, then the keys
            // transposed (16×16 blocks in registers: element by element the
            // transpose was 70% of a task's preparation, 11% of attention).
            // A masked key's K and V are zeros: whatever the buffer holds
            // there (NaN, inf) must not reach a score or a weighted sum as
            // 0 · NaN. Read in place and converted element by element: a
            // library copy per 32-float row cost more than the row (memmove
            // was 2% of MiniLM at 8×128).
            for j in 0..valid {
                let vrow = &mut buf.v[j * hdp..j * hdp + hd];
                let krow = &mut buf.k[j * hd..(j + 1) * hd];
                if buf.keep[j] == 0.0 {
                    vrow.fill(0.0);
                    krow.fill(0.0);
                } else {
                    let kr = k.row(b * t.k.batch_stride as usize + j * t.k.row_stride as usize + g * hd, hd);
                    let vr = v.row(b * t.v.batch_stride as usize + j * t.v.row_stride as usize + g * hd, hd);
                    vrow.iter_mut().zip(vr).for_each(|(o, x)| *o = x.to_f32());
                    krow.iter_mut().zip(kr).for_each(|(o, x)| *o = x.to_f32());
                }
            }
            transpose(&buf.k, vp, hd, &mut buf.kt);
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

/// Queries per head up to which attention reads K and V where they lie
/// (a decode step, a few speculative rows): copying and transposing a
/// head's whole cache for one query cost ~8× the arithmetic.
const DECODE_ROWS: usize = 4;

/// Keys per tile of the decode path: one tile of K or V rows in f32 stays
/// in L1 while every query row of the head uses it.
const KEY_TILE: usize = 32;

/// Below this many multiply-adds per call the decode path runs on the
/// calling thread: handing out tasks costs more than they would save.
const DECODE_SERIAL_MACS: usize = 1 << 15;

/// One decode task's f32 working set.
struct RowBuf {
    /// Q rows pre-multiplied by the scale: [q_len][hd].
    q: Vec<f32>,
    /// Scores, then unnormalised probabilities: [q_len][vp].
    s: Vec<f32>,
    /// Up to KEY_TILE K or V rows in f32: [KEY_TILE][hd].
    tile: Vec<f32>,
    /// Σ p·v per query row: [q_len][hd].
    acc: Vec<f32>,
    limit: Vec<usize>,
    inv: Vec<f32>,
}

/// Attention for a few query rows per head: one task per (batch row,
/// head) walks the head's keys in tiles, scores every query row against
/// each tile, softmaxes, then walks the values the same way. Masked keys'
/// rows are zeros in the tile, so a non-finite value there never meets a
/// weight.
#[allow(clippy::too_many_arguments)]
fn decode<T: Elem, K: Elem>(t: &AttentionThunk, valid: usize, kept: &[f32], q: Src<T>, k: Src<K>, v: Src<K>, out: Dst<T>) {
    let (hd, group, qn) = (t.head_dim, t.heads / t.kv_heads.max(1), t.q_len);
    let vp = valid.div_ceil(16) * 16;
    let out_w = t.heads * hd;
    let new_buf = || RowBuf {
        q: vec![0.0; qn * hd],
        s: vec![0.0; qn * vp],
        tile: vec![0.0; KEY_TILE * hd],
        acc: vec![0.0; qn * hd],
        limit: vec![0; qn],
        inv: vec![0.0; qn],
    };
    let task = |buf: &mut RowBuf, task: usize| {
        let (b, h) = (task / t.heads, task % t.heads);
        let g = h / group;
        let keep = &kept[b * valid..(b + 1) * valid];
        for i in 0..qn {
            let qr = q.row(b * t.q.batch_stride as usize + i * t.q.row_stride as usize + h * hd, hd);
            buf.q[i * hd..(i + 1) * hd].iter_mut().zip(qr).for_each(|(o, x)| *o = x.to_f32() * t.scale);
            buf.limit[i] = if t.causal {
                let p = valid as isize - qn as isize + i as isize;
                (p + 1).clamp(0, valid as isize) as usize
            } else {
                valid
            };
        }
        let keys = buf.limit.iter().copied().max().unwrap_or(0);
        let first = |view: &rlx_schedule::SeqView, j0: usize| b * view.batch_stride as usize + j0 * view.row_stride as usize + g * hd;
        let mut j0 = 0;
        while j0 < keys {
            let n = KEY_TILE.min(keys - j0);
            let (f, rs) = (first(&t.k, j0), t.k.row_stride as usize);
            if !half_rows(&k, f, rs, hd, &keep[j0..j0 + n]).is_some_and(|r| avx512::scores(r, rs, n, hd, &buf.q, &mut buf.s, vp, j0)) {
                let (rows, stride) = head_rows(&k, f, rs, hd, &keep[j0..j0 + n], &mut buf.tile);
                if !avx512::scores(rows, stride, n, hd, &buf.q, &mut buf.s, vp, j0) {
                    tile_scores(rows, stride, n, hd, &buf.q, &mut buf.s, vp, j0);
                }
            }
            j0 += n;
        }
        let all = keep[..keys].iter().all(|&x| x != 0.0);
        softmax_all(&mut buf.s[..qn * vp], vp, keep, &buf.limit[..qn], all, &mut buf.inv[..qn]);
        buf.acc.fill(0.0);
        let mut j0 = 0;
        while j0 < keys {
            let n = KEY_TILE.min(keys - j0);
            let (f, rs) = (first(&t.v, j0), t.v.row_stride as usize);
            if !half_rows(&v, f, rs, hd, &keep[j0..j0 + n]).is_some_and(|r| avx512::pv_f16(r, rs, n, hd, &buf.s, vp, j0, &mut buf.acc)) {
                let (rows, stride) = head_rows(&v, f, rs, hd, &keep[j0..j0 + n], &mut buf.tile);
                tile_pv(rows, stride, n, hd, &buf.s, vp, j0, &mut buf.acc);
            }
            j0 += n;
        }
        for i in 0..qn {
            let row = &mut buf.acc[i * hd..(i + 1) * hd];
            row.iter_mut().for_each(|x| *x *= buf.inv[i]);
            out.store((b * qn + i) * out_w + h * hd, row);
        }
    };
    let tasks = t.batch * t.heads;
    if tasks * valid * hd * qn < DECODE_SERIAL_MACS {
        let mut buf = new_buf();
        (0..tasks).for_each(|i| task(&mut buf, i));
    } else {
        (0..tasks).into_par_iter().for_each_init(new_buf, task);
    }
}

/// One head's K or V rows for the keys of `keep` (one flag per row, the
/// first at element `first`, rows `rs` apart), as (rows, row stride): the
/// rows where they lie when they are f32 and none is masked, else
/// converted into `tile` with zeros for masked keys.
fn head_rows<'a, K: Elem>(src: &'a Src<K>, first: usize, rs: usize, hd: usize, keep: &[f32], tile: &'a mut [f32]) -> (&'a [f32], usize) {
    let n = keep.len();
    if keep.iter().all(|&x| x != 0.0) {
        if let Some(rows) = K::as_f32(src.row(first, (n - 1) * rs + hd)) {
            return (rows, rs);
        }
    }
    for (jj, row) in tile.chunks_exact_mut(hd).take(n).enumerate() {
        if keep[jj] == 0.0 {
            row.fill(0.0);
        } else {
            K::load(src.row(first + jj * rs, hd), row);
        }
    }
    (&tile[..n * hd], hd)
}

/// One head's K or V rows for the keys of `keep` as they lie, when they are
/// f16 and none is masked (the AVX-512 kernels widen them as they load:
/// f16 to f32 is exact, so they compute what the converted rows give).
fn half_rows<'a, K: Elem>(src: &'a Src<K>, first: usize, rs: usize, hd: usize, keep: &[f32]) -> Option<&'a [half::f16]> {
    let n = keep.len();
    if n == 0 || !keep.iter().all(|&x| x != 0.0) {
        return None;
    }
    K::as_f16(src.row(first, (n - 1) * rs + hd))
}

/// Masked softmax of every row of `s` (rows `vp` apart) up to its limit,
/// leaving unnormalised weights and 1 / Σ in `inv`: AVX-512 where the CPU
/// has it.
#[inline(always)]
fn softmax_all(s: &mut [f32], vp: usize, keep: &[f32], limit: &[usize], all: bool, inv: &mut [f32]) {
    if !avx512::softmax_rows(s, vp, keep, limit, all, inv) {
        for (i, &lim) in limit.iter().enumerate() {
            let row = &mut s[i * vp..(i + 1) * vp];
            inv[i] = if all { softmax_row::<true>(row, keep, lim) } else { softmax_row::<false>(row, keep, lim) };
        }
    }
}

crate::simd::multiversion! {
    /// s[i][j0 + jj] = q row i · tile row jj, for every query row of `q`
    /// ([rows][hd]) and the n tile rows (`stride` apart).
    #[allow(clippy::too_many_arguments)]
    fn tile_scores(tile: &[f32], stride: usize, n: usize, hd: usize, q: &[f32], s: &mut [f32], vp: usize, j0: usize) {
        match hd {
            64 => scores_of::<64>(tile, stride, n, q, s, vp, j0),
            128 => scores_of::<128>(tile, stride, n, q, s, vp, j0),
            _ => {
                for (i, qr) in q.chunks_exact(hd).enumerate() {
                    for jj in 0..n {
                        s[i * vp + j0 + jj] = lanes::dot(qr, &tile[jj * stride..jj * stride + hd]);
                    }
                }
            }
        }
    }
}

/// `tile_scores` for a head dim known at compile time: the loops unroll and
/// the query row stays in registers (the same arithmetic, so the same bits).
#[inline(always)]
fn scores_of<const HD: usize>(tile: &[f32], stride: usize, n: usize, q: &[f32], s: &mut [f32], vp: usize, j0: usize) {
    for (i, qr) in q.as_chunks::<HD>().0.iter().enumerate() {
        let out = &mut s[i * vp + j0..i * vp + j0 + n];
        for (jj, o) in out.iter_mut().enumerate() {
            let kr: &[f32; HD] = &tile[jj * stride..].as_chunks::<HD>().0[0];
            *o = lanes::dot(qr, kr);
        }
    }
}

crate::simd::multiversion! {
    /// acc[i] += Σ_jj p[i][j0 + jj] · tile row jj (rows `stride` apart),
    /// for every query row.
    #[allow(clippy::too_many_arguments)]
    fn tile_pv(tile: &[f32], stride: usize, n: usize, hd: usize, p: &[f32], vp: usize, j0: usize, acc: &mut [f32]) {
        match hd {
            64 => pv_of::<64>(tile, stride, n, p, vp, j0, acc),
            128 => pv_of::<128>(tile, stride, n, p, vp, j0, acc),
            _ => {
                for (i, ar) in acc.chunks_exact_mut(hd).enumerate() {
                    for jj in 0..n {
                        let vr = &tile[jj * stride..jj * stride + hd];
                        let w = p[i * vp + j0 + jj];
                        if w != 0.0 {
                            for (a, &x) in ar.iter_mut().zip(vr) {
                                *a = w.mul_add(x, *a);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `tile_pv` for a head dim known at compile time: each accumulator row
/// stays in registers across the tile (the same arithmetic, so the same
/// bits).
#[inline(always)]
fn pv_of<const HD: usize>(tile: &[f32], stride: usize, n: usize, p: &[f32], vp: usize, j0: usize, acc: &mut [f32]) {
    for (i, ar) in acc.as_chunks_mut::<HD>().0.iter_mut().enumerate() {
        let mut a = *ar;
        for (jj, &w) in p[i * vp + j0..i * vp + j0 + n].iter().enumerate() {
            if w != 0.0 {
                let vr: &[f32; HD] = &tile[jj * stride..].as_chunks::<HD>().0[0];
                for d in 0..HD {
                    a[d] = w.mul_add(vr[d], a[d]);
                }
            }
        }
        *ar = a;
    }
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
                    (_, true) => {
                        for r in 0..nr {
                            score_tile::<1, 64>(kt, vp, hd, q, i + r, j, s)
                        }
                    }
                    (_, false) => {
                        for r in 0..nr {
                            score_tile::<1, 16>(kt, vp, hd, q, i + r, j, s)
                        }
                    }
                }
                j += if vp - j >= 64 { 64 } else { 16 };
            }
            i += nr;
        }
        // No masked key before any row's limit: the select-free softmax.
        let all = keep[..limit.iter().copied().max().unwrap_or(0)].iter().all(|&k| k != 0.0);
        softmax_all(s, vp, keep, limit, all, inv);
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
                    (_, 32..) => {
                        for r in 0..nr {
                            pv_tile::<1, 32>(s, vp, v, d.hdp, keys, i + r, c, inv, out)
                        }
                    }
                    (_, _) => {
                        for r in 0..nr {
                            pv_tile::<1, 16>(s, vp, v, d.hdp, keys, i + r, c, inv, out)
                        }
                    }
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

/// kt[d · rows + j] = k[j · hd + d] for j < rows, d < hd: `k` row-major
/// [rows][hd], `kt` its transpose [hd][rows]. In 16×16 register blocks on
/// AVX-512 (rows and hd multiples of 16), element by element otherwise.
fn transpose(k: &[f32], rows: usize, hd: usize, kt: &mut [f32]) {
    let (k, kt) = (&k[..rows * hd], &mut kt[..rows * hd]);
    if rows.is_multiple_of(16) && hd.is_multiple_of(16) && avx512::available() {
        // SAFETY: AVX-512 detected; both slices hold rows · hd floats and
        // the blocks stay inside them (rows and hd are multiples of 16).
        unsafe { avx512::transpose16(k.as_ptr(), rows, hd, kt.as_mut_ptr()) };
        return;
    }
    for j in 0..rows {
        for d in 0..hd {
            kt[d * rows + j] = k[j * hd + d];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        super::super::matmul_small::has_avx512()
    }

    /// `super::transpose` for rows and hd multiples of 16.
    ///
    /// # Safety
    /// AVX-512F present; `k` and `kt` valid for rows · hd floats.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose16(k: *const f32, rows: usize, hd: usize, kt: *mut f32) {
        for j0 in (0..rows).step_by(16) {
            for d0 in (0..hd).step_by(16) {
                // r[i]: key j0 + i, dims d0..d0 + 16.
                let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(k.add((j0 + i) * hd + d0)));
                // Pairs of rows interleaved, then quadruples: u[4q + m]
                // holds, in its 128-bit lane l, dim 4l + m of rows 4q..4q + 3.
                let t: [__m512; 16] = std::array::from_fn(|i| {
                    let (a, b) = (r[i & !1], r[i | 1]);
                    if i % 2 == 0 {
                        _mm512_unpacklo_ps(a, b)
                    } else {
                        _mm512_unpackhi_ps(a, b)
                    }
                });
                let u: [__m512; 16] = std::array::from_fn(|i| {
                    let (q, m) = (i / 4, i % 4);
                    let (a, b) = (t[4 * q + m / 2], t[4 * q + 2 + m / 2]);
                    if m % 2 == 0 {
                        _mm512_shuffle_ps::<0x44>(a, b)
                    } else {
                        _mm512_shuffle_ps::<0xEE>(a, b)
                    }
                });
                // Gather lane l of u[m], u[4 + m], u[8 + m], u[12 + m]: dim 4l + m, all 16 keys.
                for m in 0..4 {
                    let v0 = _mm512_shuffle_f32x4::<0x88>(u[m], u[4 + m]);
                    let v1 = _mm512_shuffle_f32x4::<0xDD>(u[m], u[4 + m]);
                    let v2 = _mm512_shuffle_f32x4::<0x88>(u[8 + m], u[12 + m]);
                    let v3 = _mm512_shuffle_f32x4::<0xDD>(u[8 + m], u[12 + m]);
                    let cols = [
                        (m, _mm512_shuffle_f32x4::<0x88>(v0, v2)),
                        (4 + m, _mm512_shuffle_f32x4::<0x88>(v1, v3)),
                        (8 + m, _mm512_shuffle_f32x4::<0xDD>(v0, v2)),
                        (12 + m, _mm512_shuffle_f32x4::<0xDD>(v1, v3)),
                    ];
                    for (d, c) in cols {
                        _mm512_storeu_ps(kt.add((d0 + d) * rows + j0), c);
                    }
                }
            }
        }
    }

    /// `super::tile_scores` for a head dim that is a whole number of
    /// 16-lane vectors: the query row stays in registers and each key's
    /// dot product runs lanes::dot's order (16 lane-wise FMA chains, then
    /// halves added down to one lane), so the same bits; the portable form
    /// compiled to scalar moves and stack traffic (with it, a decode step's
    /// attention took 1.6–1.8× as long). Returns false, touching nothing, without
    /// AVX-512, for another head dim or for operands too short. Rows of f16
    /// are widened as loaded (exactly), so they give the bits of the rows
    /// converted to f32.
    #[allow(clippy::too_many_arguments)]
    pub fn scores<E: Lanes16>(tile: &[E], stride: usize, n: usize, hd: usize, q: &[f32], s: &mut [f32], vp: usize, j0: usize) -> bool {
        let rows = q.len().checked_div(hd).unwrap_or(0);
        if !fits(tile.len(), stride, n, hd, rows, s.len(), vp, j0) {
            return false;
        }
        // SAFETY: AVX-512 detected; every load lies in `tile` or `q` and
        // every store in `s` (`fits`).
        unsafe { scores_imp(tile, stride, n, hd, q, s, vp, j0) };
        true
    }

    /// 16 consecutive elements of a row as f32 lanes.
    pub trait Lanes16: Copy {
        /// # Safety
        /// AVX-512F present; `p` valid for 16 elements.
        unsafe fn load16(p: *const Self) -> __m512;
    }
    impl Lanes16 for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
    }
    impl Lanes16 for half::f16 {
        #[inline(always)]
        unsafe fn load16(p: *const half::f16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
    }

    /// Whether `scores` / `pv` can take these operands: AVX-512, a head dim
    /// of whole 16-lane vectors up to 256, the tile and `s` long enough.
    #[allow(clippy::too_many_arguments)]
    fn fits(tile_len: usize, stride: usize, n: usize, hd: usize, rows: usize, s_len: usize, vp: usize, j0: usize) -> bool {
        let tile_end = n.checked_sub(1).and_then(|m| m.checked_mul(stride)).and_then(|x| x.checked_add(hd));
        let s_end = rows.checked_sub(1).and_then(|r| r.checked_mul(vp)).and_then(|x| x.checked_add(j0)).and_then(|x| x.checked_add(n));
        available()
            && hd > 0
            && hd.is_multiple_of(16)
            && hd <= 256
            && stride >= hd
            && tile_end.is_some_and(|e| tile_len >= e)
            && s_end.is_some_and(|e| s_len >= e)
    }

    /// acc[i] += Σ_jj p[i][j0 + jj] · row jj (f16 rows `stride` apart,
    /// widened as loaded) for every query row: `super::pv_of`'s arithmetic
    /// (one FMA per element per kept weight, in key order), so the same
    /// bits as over the rows converted to f32. Returns false, touching
    /// nothing, where the operands do not fit (`fits`).
    #[allow(clippy::too_many_arguments)]
    pub fn pv_f16(tile: &[half::f16], stride: usize, n: usize, hd: usize, p: &[f32], vp: usize, j0: usize, acc: &mut [f32]) -> bool {
        let rows = acc.len().checked_div(hd).unwrap_or(0);
        if !fits(tile.len(), stride, n, hd, rows, p.len(), vp, j0) {
            return false;
        }
        // SAFETY: AVX-512 detected; loads in `tile` and `p`, loads and
        // stores of `acc` within its rows · hd elements (`fits`).
        unsafe { pv_imp(tile, stride, n, hd, p, vp, j0, acc) };
        true
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv_imp(tile: &[half::f16], stride: usize, n: usize, hd: usize, p: &[f32], vp: usize, j0: usize, acc: &mut [f32]) {
        let chunks = hd / 16;
        for (i, ar) in acc.chunks_exact_mut(hd).enumerate() {
            let mut a = [_mm512_setzero_ps(); 16];
            for (c, v) in a.iter_mut().enumerate().take(chunks) {
                *v = _mm512_loadu_ps(ar.as_ptr().add(16 * c));
            }
            let w = p.as_ptr().add(i * vp + j0);
            for jj in 0..n {
                let wj = *w.add(jj);
                if wj != 0.0 {
                    let (wv, vr) = (_mm512_set1_ps(wj), tile.as_ptr().add(jj * stride));
                    for (c, v) in a.iter_mut().enumerate().take(chunks) {
                        *v = _mm512_fmadd_ps(wv, half::f16::load16(vr.add(16 * c)), *v);
                    }
                }
            }
            for (c, v) in a.iter().enumerate().take(chunks) {
                _mm512_storeu_ps(ar.as_mut_ptr().add(16 * c), *v);
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores_imp<E: Lanes16>(tile: &[E], stride: usize, n: usize, hd: usize, q: &[f32], s: &mut [f32], vp: usize, j0: usize) {
        let chunks = hd / 16;
        for (i, qr) in q.chunks_exact(hd).enumerate() {
            let mut qv = [_mm512_setzero_ps(); 16];
            for (c, v) in qv.iter_mut().enumerate().take(chunks) {
                *v = _mm512_loadu_ps(qr.as_ptr().add(16 * c));
            }
            let out = s.as_mut_ptr().add(i * vp + j0);
            for jj in 0..n {
                let kr = tile.as_ptr().add(jj * stride);
                let mut acc = _mm512_setzero_ps();
                for (c, &v) in qv.iter().enumerate().take(chunks) {
                    acc = _mm512_fmadd_ps(v, E::load16(kr.add(16 * c)), acc);
                }
                let a8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc))));
                let a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps::<1>(a8));
                let a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
                let a1 = _mm_add_ss(a2, _mm_movehdup_ps(a2));
                *out.add(jj) = _mm_cvtss_f32(a1) + 0.0;
            }
        }
    }

    /// Every row's softmax (as `super::softmax_row`) with AVX-512 when the
    /// CPU has it: e^x from a Cody-Waite reduction, the same Taylor
    /// polynomial to r⁷ and `vscalefps` for 2^n (12 instructions a vector
    /// against ~19 for the portable form's exponent-bit arithmetic and
    /// clamps). Returns false, touching nothing, without AVX-512.
    pub fn softmax_rows(s: &mut [f32], vp: usize, keep: &[f32], limit: &[usize], all: bool, inv: &mut [f32]) -> bool {
        if !available() {
            return false;
        }
        let rows = limit.len().min(inv.len()).min(s.len() / vp.max(1));
        let keep = &keep[..vp.min(keep.len())];
        // SAFETY: AVX-512 detected; every row read or written lies inside
        // `s` (rows · vp floats) and `keep` is read below each row's limit,
        // which is clamped to its length.
        unsafe {
            if all {
                rows_imp::<true>(s.as_mut_ptr(), vp, keep, &limit[..rows], &mut inv[..rows]);
            } else {
                rows_imp::<false>(s.as_mut_ptr(), vp, keep, &limit[..rows], &mut inv[..rows]);
            }
        }
        true
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn rows_imp<const ALL: bool>(s: *mut f32, vp: usize, keep: &[f32], limit: &[usize], inv: &mut [f32]) {
        for (i, &lim) in limit.iter().enumerate() {
            let row = s.add(i * vp);
            let lim = lim.min(vp).min(keep.len());
            if lim < vp {
                std::ptr::write_bytes(row.add(lim), 0, vp - lim);
            }
            inv[i] = softmax_row::<ALL>(row, keep.as_ptr(), lim);
        }
    }

    /// e^x for x ≤ 0 (scores minus their row's maximum).
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        const LN2_HI: f32 = 0.693_145_75;
        const LN2_LO: f32 = 1.428_606_8e-6;
        const C: [f32; 8] = [1.0, 1.0, 0.5, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0, 1.0 / 5040.0];
        // Below -104, 2^n is past the smallest subnormal: e^x reads 0.
        let x = _mm512_max_ps(x, _mm512_set1_ps(-104.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(C[7]);
        for c in C[..7].iter().rev() {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        _mm512_scalef_ps(p, n)
    }

    /// The lanes of `mask` whose key is kept (`keep` nonzero); all of them for `ALL`.
    #[inline(always)]
    unsafe fn kept<const ALL: bool>(keep: *const f32, mask: __mmask16) -> __mmask16 {
        if ALL {
            mask
        } else {
            _mm512_mask_cmp_ps_mask::<_CMP_NEQ_UQ>(mask, _mm512_maskz_loadu_ps(mask, keep), _mm512_setzero_ps())
        }
    }

    /// One row of `lim` scores (the rest already zeroed): weights in place,
    /// returns 1 / Σ weights, or 0 with all weights 0 when no key is kept.
    /// Whole 16-lane chunks unmasked (under `ALL`), the last one masked.
    #[inline(always)]
    unsafe fn softmax_row<const ALL: bool>(row: *mut f32, keep: *const f32, lim: usize) -> f32 {
        let (whole, left) = (lim / 16, lim % 16);
        let tail: __mmask16 = ((1u32 << left) - 1) as __mmask16;
        // Max of the kept scores in two independent chains; a NaN score is
        // skipped (vmaxps takes the second operand when either is NaN).
        let mut mx = [_mm512_set1_ps(f32::NEG_INFINITY); 2];
        for c in 0..whole {
            let m = kept::<ALL>(keep.add(16 * c), 0xFFFF);
            mx[c % 2] = _mm512_mask_max_ps(mx[c % 2], m, _mm512_loadu_ps(row.add(16 * c)), mx[c % 2]);
        }
        if left > 0 {
            let m = kept::<ALL>(keep.add(16 * whole), tail);
            mx[0] = _mm512_mask_max_ps(mx[0], m, _mm512_maskz_loadu_ps(m, row.add(16 * whole)), mx[0]);
        }
        let top = _mm512_reduce_max_ps(_mm512_max_ps(mx[0], mx[1]));
        if top == f32::NEG_INFINITY {
            std::ptr::write_bytes(row, 0, lim);
            return 0.0;
        }
        let tv = _mm512_set1_ps(top);
        let mut acc = [_mm512_setzero_ps(); 2];
        for c in 0..whole {
            let x = _mm512_sub_ps(_mm512_loadu_ps(row.add(16 * c)), tv);
            let e = if ALL { exp(x) } else { _mm512_maskz_mov_ps(kept::<false>(keep.add(16 * c), 0xFFFF), exp(x)) };
            _mm512_storeu_ps(row.add(16 * c), e);
            acc[c % 2] = _mm512_add_ps(acc[c % 2], e);
        }
        if left > 0 {
            let m = kept::<ALL>(keep.add(16 * whole), tail);
            let e = _mm512_maskz_mov_ps(m, exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row.add(16 * whole)), tv)));
            _mm512_mask_storeu_ps(row.add(16 * whole), tail, e);
            acc[0] = _mm512_add_ps(acc[0], e);
        }
        1.0 / _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]))
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod avx512 {
    pub fn available() -> bool {
        false
    }
    pub unsafe fn transpose16(_: *const f32, _: usize, _: usize, _: *mut f32) {}
    #[allow(clippy::too_many_arguments)]
    pub fn scores<E>(_: &[E], _: usize, _: usize, _: usize, _: &[f32], _: &mut [f32], _: usize, _: usize) -> bool {
        false
    }
    pub fn softmax_rows(_: &mut [f32], _: usize, _: &[f32], _: &[usize], _: bool, _: &mut [f32]) -> bool {
        false
    }
    #[allow(clippy::too_many_arguments)]
    pub fn pv_f16(_: &[half::f16], _: usize, _: usize, _: usize, _: &[f32], _: usize, _: usize, _: &mut [f32]) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeded(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 20_001) as f32 / 1000.0 - 10.0
            })
            .collect()
    }

    #[test]
    fn transpose_matches_elementwise() {
        for (rows, hd) in [(16, 16), (48, 32), (128, 64), (20, 32), (32, 8)] {
            let k = seeded(rows * hd, (rows * 31 + hd) as u32);
            let mut kt = vec![f32::NAN; rows * hd];
            transpose(&k, rows, hd, &mut kt);
            for j in 0..rows {
                for d in 0..hd {
                    assert_eq!(kt[d * rows + j].to_bits(), k[j * hd + d].to_bits(), "rows {rows} hd {hd} at key {j} dim {d}");
                }
            }
        }
    }

    /// Decode tiles the kernel tests take: (head dim, row stride, query rows,
    /// keys, offset into the score rows).
    const DECODE_CASES: [(usize, usize, usize, usize, usize); 5] =
        [(64, 64, 1, 32, 0), (64, 192, 1, 7, 32), (128, 384, 2, 17, 16), (16, 48, 4, 1, 5), (32, 32, 3, 32, 64)];

    /// The f16 rows read in place (scores and P·V, widened as loaded) give
    /// the bits of the same rows converted to f32 first: head dims 16-128,
    /// rows strided past the head dim, 1-4 query rows, tiles of 1-32 keys at
    /// an offset, zero weights skipped in P·V as `pv_of` skips them.
    #[test]
    fn decode_over_f16_rows_matches_converted_rows_bit_for_bit() {
        if !avx512::available() {
            eprintln!("skipped: no AVX-512");
            return;
        }
        for (case, &(hd, stride, rows, n, j0)) in DECODE_CASES.iter().enumerate() {
            let vp = j0 + n + 3;
            let tile16: Vec<half::f16> = seeded((n - 1) * stride + hd, case as u32 + 7).iter().map(|&x| half::f16::from_f32(x)).collect();
            let tile32: Vec<f32> = tile16.iter().map(|x| x.to_f32()).collect();
            let q = seeded(rows * hd, case as u32 + 50);
            let (mut s16, mut s32) = (vec![0.5f32; rows * vp], vec![0.5f32; rows * vp]);
            assert!(avx512::scores(&tile16, stride, n, hd, &q, &mut s16, vp, j0), "case {case}");
            assert!(avx512::scores(&tile32, stride, n, hd, &q, &mut s32, vp, j0), "case {case}");
            assert!(s16.iter().zip(&s32).all(|(a, b)| a.to_bits() == b.to_bits()), "case {case}: scores differ");
            // Weights with zeros, as a masked softmax leaves them.
            let mut p = seeded(rows * vp, case as u32 + 90);
            p.iter_mut().step_by(5).for_each(|w| *w = 0.0);
            let acc0 = seeded(rows * hd, case as u32 + 130);
            let (mut a16, mut a32) = (acc0.clone(), acc0);
            assert!(avx512::pv_f16(&tile16, stride, n, hd, &p, vp, j0, &mut a16), "case {case}");
            tile_pv(&tile32, stride, n, hd, &p, vp, j0, &mut a32);
            assert!(a16.iter().zip(&a32).all(|(a, b)| a.to_bits() == b.to_bits()), "case {case}: P·V differs");
        }
    }

    /// The AVX-512 decode scores give the portable kernel's bits (and both
    /// lie within f32 rounding of an f64 dot product): head dims 16-128,
    /// rows strided past the head dim, 1-4 query rows, tiles of 1-32 keys
    /// at an offset into the score rows.
    #[test]
    fn decode_scores_match_portable_bits() {
        for (case, &(hd, stride, rows, n, j0)) in DECODE_CASES.iter().enumerate() {
            let vp = (j0 + n).div_ceil(16) * 16;
            let tile = seeded((n - 1) * stride + hd, 10 + case as u32);
            let mut q = seeded(rows * hd, 20 + case as u32);
            q[0] = -0.0;
            let (mut want, mut got) = (vec![f32::NAN; rows * vp], vec![f32::NAN; rows * vp]);
            tile_scores(&tile, stride, n, hd, &q, &mut want, vp, j0);
            if !avx512::scores(&tile, stride, n, hd, &q, &mut got, vp, j0) {
                eprintln!("SKIPPED decode_scores_match_portable_bits: no AVX-512");
                return;
            }
            for i in 0..rows {
                for jj in 0..n {
                    let at = i * vp + j0 + jj;
                    assert_eq!(got[at].to_bits(), want[at].to_bits(), "case {case}: row {i} key {jj}");
                    let (qr, kr) = (&q[i * hd..(i + 1) * hd], &tile[jj * stride..jj * stride + hd]);
                    let exact: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let scale: f64 = qr.iter().zip(kr).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                    assert!(
                        (got[at] as f64 - exact).abs() <= scale * 1e-6 + 1e-30,
                        "case {case}: row {i} key {jj}: {} vs {exact}",
                        got[at]
                    );
                }
            }
            // Nothing outside the tile's columns was written.
            assert!(got.iter().enumerate().all(|(at, v)| (at % vp >= j0 && at % vp < j0 + n) || v.is_nan()), "case {case}");
        }
    }

    /// The AVX-512 softmax (where the CPU has it) against an f64 softmax:
    /// masks, limits short of the row, remainders of 1-15 lanes, a row with
    /// every key masked, scores far below the maximum (weights 0).
    #[test]
    fn softmax_rows_match_f64() {
        let vp = 48;
        let limits = [48usize, 37, 16, 1, 0, 47];
        let rows = limits.len();
        for all in [true, false] {
            let mut s = seeded(rows * vp, if all { 3 } else { 4 });
            s[5] = -300.0;
            let mut keep: Vec<f32> = (0..vp).map(|j| if all || j % 3 != 1 { 1.0 } else { 0.0 }).collect();
            if !all {
                keep[0] = 0.0;
            }
            let orig = s.clone();
            let mut inv = vec![f32::NAN; rows];
            if !avx512::softmax_rows(&mut s, vp, &keep, &limits, all, &mut inv) {
                eprintln!("SKIPPED softmax_rows_match_f64: no AVX-512");
                return;
            }
            for (i, &lim) in limits.iter().enumerate() {
                let x = &orig[i * vp..(i + 1) * vp];
                let kept: Vec<usize> = (0..lim).filter(|&j| keep[j] != 0.0).collect();
                let m = kept.iter().map(|&j| x[j] as f64).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = kept.iter().map(|&j| (x[j] as f64 - m).exp()).sum();
                for j in 0..vp {
                    let want = if kept.contains(&j) { (x[j] as f64 - m).exp() / sum } else { 0.0 };
                    let got = s[i * vp + j] as f64 * inv[i] as f64;
                    // f32 rounding of x - max (relative to |x - max|), e^r and 1 / Σ.
                    let tol = if want > 0.0 { want * (4e-7 + (x[j] as f64 - m).abs() * 1.2e-7) } else { 0.0 } + 1e-37;
                    assert!((got - want).abs() <= tol, "row {i} key {j} all={all}: {got} vs {want}");
                    if want == 0.0 {
                        assert_eq!(s[i * vp + j], 0.0, "row {i} key {j}: masked or past the limit must be exactly 0");
                    }
                }
                if kept.is_empty() {
                    assert_eq!(inv[i], 0.0);
                }
            }
        }
    }
}
