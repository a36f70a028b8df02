//! Matmul against a transposed b (`[N, K]`, K contiguous: every weight of a
//! BERT linear layer), two kernels:
//!
//! - b a weight (the usual case), any row count: the executable packs it
//!   once at prepare (`pack`: 64-column groups, k-major) and a tile of 6 a
//!   rows × 64 columns accumulates broadcast-a × four 16-lane weight
//!   vectors per k step, no horizontal sums, over blocks of 128 k steps
//!   that stay in L1 for every tile of a task. One group (and up to 192
//!   rows) per task, so cores stream disjoint weight groups. 15% less
//!   matmul time than the dot kernel on MiniLM at 1×128, and 4-5% less
//!   forward time than gemm at 8×128 (bench/LOG.md).
//! - b anything else: dot products with nothing packed. gemm would pack b
//!   into panels on every call, and with a handful of rows that copy costs
//!   about as much as the multiply. A tile of MR a rows × NR b rows
//!   accumulates 16-lane FMAs over K, reduced horizontally at the end.
//!
//! The epilogue (bias, activation, residual) runs on each block while it is
//! hot.

use rayon::prelude::*;
use rlx_schedule::MatMulThunk;

use crate::act;
use crate::elem::Elem;
use crate::memory::{Dst, Src};

/// Most rows (batch × m) the dot kernel (b read in place) takes: MiniLM at
/// 1×128 ran 4% faster there than through gemm, at 8×128 gemm's packed
/// microkernel won (bench/LOG.md). The packed kernel for weights
/// has no limit.
pub const MAX_ROWS: usize = 128;

/// a rows per tile (the last tile of a block may be shorter).
const MR: usize = 4;
/// b rows per tile: 4×6 accumulators + 6 b + 1 a operand fit the 32
/// registers. b rows stay in L1 across a block's row tiles while a rows come
/// from L2, so more b rows per a load is what helps: 4×6 ran 5-7% faster
/// than 4×4 on MiniLM, 6×4 no faster.
const NR: usize = 6;

/// Whether the CPU runs AVX-512 (F) code (std caches the check).
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the dot kernel runs `mm` (b read in place): b transposed and
/// shared by every batch, few rows, and a CPU with AVX-512 (without it
/// gemm's AVX2 path is used).
pub fn applies(mm: &MatMulThunk) -> bool {
    let rows = mm.batch * mm.m;
    applies_packed(mm) && rows <= MAX_ROWS
}

/// Whether the packed kernel can run `mm` given b in the packed layout: as
/// `applies` at any row count. With the weight blocked by k (`KC`) it beat
/// gemm at 1024 rows too (bench/LOG.md).
pub fn applies_packed(mm: &MatMulThunk) -> bool {
    let rows = mm.batch * mm.m;
    mm.b_trans && (mm.batch == 1 || mm.b_batch_stride == 0) && rows > 0 && mm.n > 0 && has_avx512()
}

/// The views one call reads and writes; a and b are f32 (half-precision
/// callers pass their widened copies), bias / residual / out in T.
pub struct SmallArgs<'a, T> {
    pub a: &'a Src<f32>,
    pub b: &'a Src<f32>,
    pub bias: Option<&'a Src<T>>,
    pub residual: Option<&'a Src<T>>,
    pub out: &'a Dst<T>,
}

/// Columns per group of the packed weight layout (four 16-lane vectors).
pub const GROUP: usize = 64;

/// k steps per block of the packed kernel: a group's 128 × 64 weights (32
/// KB) stay in L1 while every row tile of a task uses them, instead of
/// streaming the whole group from L2 for each tile. (64, 192 and 256
/// measured no better at MiniLM 8×128.)
const KC: usize = 128;

/// Rows per task of the packed kernel (a multiple of its 6-row tiles; 96
/// and 384 measured the same at MiniLM 8×128).
const ROW_CHUNK: usize = 192;

/// bᵀ (`n` rows of `k`, fetched by `row`) in the layout the packed kernel
/// streams: 64-column groups, k-major within a group (`[g][k][64]`), the
/// last group zero-padded. Made once per weight at prepare: every k step of
/// the kernel then reads one contiguous 256-byte line pair instead of six
/// strided rows.
pub fn pack(n: usize, k: usize, mut row: impl FnMut(usize, &mut [f32])) -> Vec<f32> {
    let mut v = vec![0f32; packed_len(n, k)];
    let mut tmp = vec![0f32; k];
    for col in 0..n {
        row(col, &mut tmp);
        let (g, c) = (col / GROUP, col % GROUP);
        for (kk, &x) in tmp.iter().enumerate() {
            v[(g * k + kk) * GROUP + c] = x;
        }
    }
    v
}

/// Elements of `pack(n, k, ..)`.
pub fn packed_len(n: usize, k: usize) -> usize {
    n.div_ceil(GROUP) * GROUP * k
}

/// `out = act(a · bᵀ + bias) + residual` for a thunk `applies` accepted;
/// with `packed` (its weight made by `pack`) the broadcast kernel runs,
/// otherwise the dot-product one reads b in place.
pub fn run<T: Elem>(mm: &MatMulThunk, v: &SmallArgs<'_, T>, threads: usize, packed: Option<&[f32]>) {
    let (m, n, k) = (mm.m, mm.n, mm.k);
    let rows = mm.batch * m;
    let (lda, abs, ldb) = (mm.lda as usize, mm.a_batch_stride as usize, mm.ldb as usize);
    // Row r of the folded batch starts here; the largest start + k is a's
    // extent, which validate.rs checked against the buffer.
    let a_off: Vec<usize> = (0..rows).map(|r| (r / m) * abs + (r % m) * lda).collect();
    let a_len = a_off.iter().max().copied().unwrap_or(0) + k;
    let a_all = v.a.row(0, a_len);
    let packed = packed.filter(|p| p.len() == packed_len(n, k) && has_avx512());
    let b_all = if packed.is_some() { &[][..] } else { v.b.row(0, (n - 1) * ldb + k) };
    // Dot kernel: about four column blocks per thread (work stealing covers
    // a thread that gets descheduled), a multiple of 16 so GELU runs in full
    // blocks. Packed kernel: one 64-column group per task; fewer, larger
    // blocks left a thread idle at N = 384 (3 blocks on 2 threads), which
    // cost more than the per-task overhead.
    let nb = if packed.is_some() { GROUP } else { (n / (4 * threads.max(1))).clamp(16, 256).div_ceil(16) * 16 };
    // Many rows: tasks of ROW_CHUNK rows per group (more tasks than
    // groups for many threads, a product block that stays in L2).
    let chunk = if packed.is_some() { ROW_CHUNK } else { rows };
    let chunks = rows.div_ceil(chunk);
    let fast = v.out.as_f32().map(|out| F32Epilogue {
        bias: v.bias.and_then(|b| b.as_f32()),
        residual: v.residual.and_then(|r| r.as_f32()),
        in_place: v.residual.is_some_and(|r| v.out.same_start(r)),
        out,
    });
    // Through the task buffer (half-precision out, or the residual is out
    // itself) the packed kernel still applies bias and erf-GELU to each
    // finished tile; the store pass adds the residual and converts.
    let through_c = fast.as_ref().is_none_or(|f| f.in_place);
    let tile_done = packed.is_some() && through_c && matches!(mm.act, None | Some(rlx_ir::Activation::Gelu));
    let bias32: Option<Vec<f32>> = v.bias.filter(|_| tile_done).map(|b| {
        let mut t = vec![0f32; n];
        b.load(0, &mut t);
        t
    });
    (0..n.div_ceil(nb) * chunks).into_par_iter().for_each_init(
        || (vec![0f32; chunk.min(rows) * nb], vec![0f32; nb]),
        |(c, tmp), p| {
            let (j0, r0) = ((p / chunks) * nb, (p % chunks) * chunk);
            let (w, r1) = (nb.min(n - j0), (r0 + chunk).min(rows));
            let c = &mut c[..(r1 - r0) * w];
            match (packed, &fast) {
                // Products straight into out, epilogue in place there: no
                // copy of every output element through c (memmove was 4%
                // of MiniLM at 8×128).
                (Some(pk), Some(f)) if !f.in_place => {
                    // Bias, erf-GELU and residual on the tile's registers
                    // before the one store; other activations in a pass after.
                    let fuse = matches!(mm.act, None | Some(rlx_ir::Activation::Gelu));
                    let epi = fuse.then(|| f.tile_epilogue(mm, n, r0, r1, j0, w));
                    packed_dots_into(a_all, &a_off[r0..r1], k, pk, j0, w, &f.out, r0, n, epi.as_ref());
                    if !fuse {
                        f.apply_in_out(mm, n, r0..r1, j0, w);
                    }
                    return;
                }
                (Some(pk), _) => {
                    let epi = tile_done.then(|| TileEpilogue {
                        bias: bias32.as_ref().map(|b| b[j0..j0 + w].as_ptr()).unwrap_or(std::ptr::null()),
                        gelu: mm.act.is_some(),
                        residual: std::ptr::null(),
                    });
                    packed_dots(a_all, &a_off[r0..r1], k, pk, j0, w, c, epi.as_ref())
                }
                (None, _) => dots(a_all, &a_off[r0..r1], k, b_all, ldb, j0, w, c),
            }
            if let Some(f) = &fast {
                f.apply(mm, c, n, r0, j0, w, tile_done);
                return;
            }
            let tmp = &mut tmp[..w];
            for (r, row) in c.chunks_exact_mut(w).enumerate() {
                let r = r0 + r;
                if let (Some(b), false) = (v.bias, tile_done) {
                    b.load(j0, tmp);
                    row.iter_mut().zip(tmp.iter()).for_each(|(x, y)| *x += y);
                }
                if let (Some(a), false) = (mm.act, tile_done) {
                    act::apply(a, row);
                }
                // Loaded into tmp before the store: the residual may be out.
                if let Some(res) = v.residual {
                    res.load(r * n + j0, tmp);
                    row.iter_mut().zip(tmp.iter()).for_each(|(x, y)| *x += y);
                }
                v.out.store(r * n + j0, row);
            }
        },
    );
}

/// The epilogue's f32 views when T is f32: rows are added and stored
/// straight from the arena instead of copied through a buffer (three
/// small memmoves per row and block were 4% of MiniLM at 1×16).
struct F32Epilogue {
    bias: Option<Src<f32>>,
    residual: Option<Src<f32>>,
    /// The residual is out itself (validate.rs allows that or disjoint).
    in_place: bool,
    out: Dst<f32>,
}

/// The fused epilogue of the packed kernel's last k block (f32 out, not in
/// place): pointers at column j0 of the task's first row, bounds checked by
/// `F32Epilogue::tile_epilogue`.
pub struct TileEpilogue {
    bias: *const f32,
    gelu: bool,
    residual: *const f32,
}

impl F32Epilogue {
    /// Bias at column j0 and the residual at (r0, j0), both range checked
    /// for rows r0..r1 and columns j0..j0 + w.
    fn tile_epilogue(&self, mm: &MatMulThunk, n: usize, r0: usize, r1: usize, j0: usize, w: usize) -> TileEpilogue {
        let rows = r1 - r0;
        TileEpilogue {
            bias: self.bias.as_ref().map(|b| b.row(j0, w).as_ptr()).unwrap_or(std::ptr::null()),
            gelu: mm.act == Some(rlx_ir::Activation::Gelu),
            residual: match (&self.residual, rows) {
                (Some(res), 1..) => res.row(r0 * n + j0, (rows - 1) * n + w).as_ptr(),
                _ => std::ptr::null(),
            },
        }
    }
    /// Columns j0..j0 + w of `rows`, the products already in out: bias,
    /// activation and a residual that is not out itself, in place.
    fn apply_in_out(&self, mm: &MatMulThunk, n: usize, rows: std::ops::Range<usize>, j0: usize, w: usize) {
        for r in rows {
            // SAFETY: these columns of row r belong to this task alone.
            let o = unsafe { self.out.row_mut(r * n + j0, w) };
            if let Some(b) = &self.bias {
                o.iter_mut().zip(b.row(j0, w)).for_each(|(x, y)| *x += y);
            }
            if let Some(a) = mm.act {
                act::apply(a, o);
            }
            if let Some(res) = &self.residual {
                o.iter_mut().zip(res.row(r * n + j0, w)).for_each(|(x, y)| *x += y);
            }
        }
    }

    /// Columns j0..j0 + w of rows r0.., the products in c (rows of w);
    /// `tile_done`: bias and activation were applied by the kernel.
    #[allow(clippy::too_many_arguments)]
    fn apply(&self, mm: &MatMulThunk, c: &mut [f32], n: usize, r0: usize, j0: usize, w: usize, tile_done: bool) {
        for (r, row) in c.chunks_exact_mut(w).enumerate() {
            let r = r0 + r;
            if let (Some(b), false) = (&self.bias, tile_done) {
                row.iter_mut().zip(b.row(j0, w)).for_each(|(x, y)| *x += y);
            }
            if let (Some(a), false) = (mm.act, tile_done) {
                act::apply(a, row);
            }
            // SAFETY: these columns of row r belong to this task alone.
            let o = unsafe { self.out.row_mut(r * n + j0, w) };
            match &self.residual {
                // o holds the residual until this write.
                Some(_) if self.in_place => o.iter_mut().zip(row.iter()).for_each(|(o, x)| *o += x),
                // Disjoint from out, so both slices may be alive.
                Some(res) => o.iter_mut().zip(row.iter().zip(res.row(r * n + j0, w))).for_each(|(o, (x, y))| *o = x + y),
                None => o.copy_from_slice(row),
            }
        }
    }
}

/// c[r * w + j] = a row r · b row (j0 + j) for every row and j < w.
#[allow(clippy::too_many_arguments)]
fn dots(a: &[f32], a_off: &[usize], k: usize, b: &[f32], ldb: usize, j0: usize, w: usize, c: &mut [f32]) {
    // Every pointer the tiles form lies in these ranges (masked loads touch
    // nothing past k).
    assert!(a_off.iter().all(|&o| o + k <= a.len()) && (j0 + w - 1) * ldb + k <= b.len() && c.len() == a_off.len() * w);
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: AVX-512F was detected; bounds asserted above.
        unsafe { avx512::dots(a, a_off, k, b, ldb, j0, w, c) };
        return;
    }
    // `applies` keeps non-AVX-512 CPUs off this path; a plain loop keeps
    // the function total anyway.
    for (r, &o) in a_off.iter().enumerate() {
        for j in 0..w {
            let br = &b[(j0 + j) * ldb..][..k];
            c[r * w + j] = a[o..o + k].iter().zip(br).map(|(x, y)| x * y).sum();
        }
    }
}

/// c[r * w + j] = a row r · column (j0 + j) of the packed weight, for a
/// block starting at a group boundary (j0 a multiple of GROUP).
#[allow(clippy::too_many_arguments)]
fn packed_dots(a: &[f32], a_off: &[usize], k: usize, pk: &[f32], j0: usize, w: usize, c: &mut [f32], epi: Option<&TileEpilogue>) {
    // Every pointer the tiles form lies in these ranges.
    assert!(
        j0.is_multiple_of(GROUP)
            && a_off.iter().all(|&o| o + k <= a.len())
            && (j0 + w).div_ceil(GROUP) * GROUP * k <= pk.len()
            && c.len() == a_off.len() * w
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: AVX-512F was detected; bounds asserted above.
        unsafe { avx512::packed_dots(a, a_off, k, pk, j0, w, c, epi) };
        return;
    }
    for (r, &o) in a_off.iter().enumerate() {
        // No residual on this path (the store pass adds it).
        packed_row_scalar(&a[o..o + k], pk, j0, &mut c[r * w..(r + 1) * w], epi, std::ptr::null());
    }
}

/// As `packed_dots`, the products written straight into out's rows
/// r0.. (row length n) at columns j0..j0 + w.
#[allow(clippy::too_many_arguments)]
fn packed_dots_into(
    a: &[f32],
    a_off: &[usize],
    k: usize,
    pk: &[f32],
    j0: usize,
    w: usize,
    out: &Dst<f32>,
    r0: usize,
    n: usize,
    epi: Option<&TileEpilogue>,
) {
    let rows = a_off.len();
    assert!(
        j0.is_multiple_of(GROUP)
            && j0 + w <= n
            && a_off.iter().all(|&o| o + k <= a.len())
            && (j0 + w).div_ceil(GROUP) * GROUP * k <= pk.len()
    );
    if rows == 0 {
        return;
    }
    // Rows r0..r0 + rows of out, columns j0..j0 + w: in bounds (checked
    // here); other tasks own the columns in between, so only a pointer.
    let dst = out.ptr_at(r0 * n + j0, (rows - 1) * n + w);
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: AVX-512F was detected; bounds asserted above; the tiles
        // write only columns j0..j0 + w of these rows.
        unsafe { avx512::packed_dots_ptr(a, a_off, k, pk, j0, w, dst, n, epi) };
        return;
    }
    for (r, &o) in a_off.iter().enumerate() {
        // SAFETY: tile_epilogue range-checked the residual for these rows.
        let res = epi.map(|e| e.residual).filter(|p| !p.is_null()).map(|p| unsafe { p.add(r * n) }).unwrap_or(std::ptr::null());
        // SAFETY: these columns of the row belong to this task alone.
        packed_row_scalar(&a[o..o + k], pk, j0, unsafe { out.row_mut((r0 + r) * n + j0, w) }, epi, res);
    }
}

/// One output row of the packed kernel in plain code: row[j] = a_row ·
/// column j0 + j of the packed weight, then the epilogue (`res`: the
/// residual at column j0, or null). CPUs without AVX-512 never take the
/// packed path (`applies_packed`); this keeps the functions total, and the
/// unit test below checks it against the AVX-512 tiles.
fn packed_row_scalar(a_row: &[f32], pk: &[f32], j0: usize, row: &mut [f32], epi: Option<&TileEpilogue>, res: *const f32) {
    let k = a_row.len();
    for (j, x) in row.iter_mut().enumerate() {
        let (g, col) = ((j0 + j) / GROUP, (j0 + j) % GROUP);
        *x = a_row.iter().enumerate().map(|(kk, v)| v * pk[(g * k + kk) * GROUP + col]).sum();
        if let Some(e) = epi.filter(|e| !e.bias.is_null()) {
            // SAFETY: the caller's bias covers columns j0..j0 + row.len().
            *x += unsafe { *e.bias.add(j) };
        }
    }
    if epi.is_some_and(|e| e.gelu) {
        act::apply(rlx_ir::Activation::Gelu, row);
    }
    if !res.is_null() {
        // SAFETY: the caller's residual row covers row.len() columns.
        row.iter_mut().enumerate().for_each(|(j, x)| *x += unsafe { *res.add(j) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain row against the AVX-512 tiles (which the integration tests
    /// check against f64): 13 rows (two full tiles and a short one), 200
    /// columns (a ragged last group), K 300 (three k blocks), bias and GELU.
    #[test]
    fn scalar_row_matches_the_tiles() {
        if !has_avx512() {
            return;
        }
        let (rows, n, k) = (13, 200, 300);
        let val = |i: usize| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * 0.2;
        let a: Vec<f32> = (0..rows * k).map(val).collect();
        let bias: Vec<f32> = (0..n).map(|i| val(i + 5)).collect();
        let pk = pack(n, k, |col, out| out.iter_mut().enumerate().for_each(|(kk, x)| *x = val(col * k + kk + 11)));
        let a_off: Vec<usize> = (0..rows).map(|r| r * k).collect();
        let (mut fast, mut plain) = (vec![0f32; rows * n], vec![0f32; rows * n]);
        let epi = TileEpilogue { bias: bias.as_ptr(), gelu: true, residual: std::ptr::null() };
        // SAFETY: AVX-512F detected; every range is inside the buffers above.
        unsafe { avx512::packed_dots(&a, &a_off, k, &pk, 0, n, &mut fast, Some(&epi)) };
        for r in 0..rows {
            packed_row_scalar(&a[r * k..(r + 1) * k], &pk, 0, &mut plain[r * n..(r + 1) * n], Some(&epi), std::ptr::null());
        }
        let worst = fast.iter().zip(&plain).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "plain row vs tiles: max |diff| {worst:e}");
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{TileEpilogue, GROUP, KC, MR, NR};

    /// Most rows for which the next weight block is prefetched.
    const PREFETCH_ROWS: usize = 32;

    /// See `super::dots`; the caller checked the bounds and the feature.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn dots(a: &[f32], a_off: &[usize], k: usize, b: &[f32], ldb: usize, j0: usize, w: usize, c: &mut [f32]) {
        let rows = a_off.len();
        // Next-block prefetch, lines per k step so the block's rows are
        // requested during (about) its first NR row tiles. Only while the
        // weights are the bottleneck: from 32 rows on each block is reused
        // enough to hide its load, and the extra instructions cost more
        // (MiniLM 1×16: -13%, 1×128: +4% with it).
        let per = if rows <= PREFETCH_ROWS { NR.div_ceil(rows.div_ceil(MR)) } else { 0 };
        let last_row = (b.len() - k) / ldb.max(1);
        let mut j = 0;
        while j < w {
            let nr = (w - j).min(NR);
            let mut pf = Prefetch { rows: [b.as_ptr(); NR], t: 0, line: 0, lines: k.div_ceil(16) };
            for (t, p) in pf.rows.iter_mut().enumerate() {
                *p = b.as_ptr().add((j0 + j + NR + t).min(last_row) * ldb);
            }
            // A short last tile repeats its last b row; the extra sums are
            // dropped.
            let mut bp = [b.as_ptr(); NR];
            for (t, p) in bp.iter_mut().enumerate() {
                *p = b.as_ptr().add((j0 + j + t.min(nr - 1)) * ldb);
            }
            let mut i = 0;
            while i < rows {
                let mr = (rows - i).min(MR);
                let mut ap = [a.as_ptr(); MR];
                for (t, p) in ap.iter_mut().enumerate() {
                    *p = a.as_ptr().add(a_off[i + t.min(mr - 1)]);
                }
                let mut s = [[0f32; NR]; MR];
                match (mr, per > 0) {
                    (1, _) => tile::<1, true>(&ap, &bp, k, &mut s, &mut pf, per),
                    (2, _) => tile::<2, true>(&ap, &bp, k, &mut s, &mut pf, per),
                    (3, _) => tile::<3, true>(&ap, &bp, k, &mut s, &mut pf, per),
                    (_, true) => tile::<MR, true>(&ap, &bp, k, &mut s, &mut pf, per),
                    (_, false) => tile::<MR, false>(&ap, &bp, k, &mut s, &mut pf, per),
                }
                for (ti, srow) in s.iter().enumerate().take(mr) {
                    let cr = &mut c[(i + ti) * w + j..][..nr];
                    cr.copy_from_slice(&srow[..nr]);
                }
                i += mr;
            }
            j += nr;
        }
    }

    /// Rows of a per packed tile: 6 × 4 accumulators + 4 weight vectors +
    /// the broadcast fit the 32 registers.
    const PR: usize = 6;

    /// See `super::packed_dots`; the caller checked the bounds and feature.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn packed_dots(
        a: &[f32],
        a_off: &[usize],
        k: usize,
        pk: &[f32],
        j0: usize,
        w: usize,
        c: &mut [f32],
        epi: Option<&TileEpilogue>,
    ) {
        packed_dots_ptr(a, a_off, k, pk, j0, w, c.as_mut_ptr(), w, epi)
    }

    /// As `packed_dots` into rows `ldc` apart from `c` (column j0 of the
    /// first row); the caller checked every row's w columns are in bounds.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    /// `epi`: applied by the last k block's tiles (pointers at column j0
    /// of the first row; the residual's rows are `ldc` apart, like c's).
    pub unsafe fn packed_dots_ptr(
        a: &[f32],
        a_off: &[usize],
        k: usize,
        pk: &[f32],
        j0: usize,
        w: usize,
        c: *mut f32,
        ldc: usize,
        epi: Option<&TileEpilogue>,
    ) {
        let rows = a_off.len();
        let mut g0 = j0;
        while g0 < j0 + w {
            let gw = (j0 + w - g0).min(GROUP);
            // k blocks of KC steps: each block of the group's weights is
            // used by every row tile while it is in L1; the tiles of later
            // blocks add onto c.
            let mut k0 = 0;
            while k0 < k {
                let kc = (k - k0).min(KC);
                let bp = pk.as_ptr().add((g0 / GROUP * k + k0) * GROUP);
                let mut i = 0;
                while i < rows {
                    let mr = (rows - i).min(PR);
                    let mut ap = [a.as_ptr(); PR];
                    for (t, p) in ap.iter_mut().enumerate() {
                        *p = a.as_ptr().add(a_off[i + t.min(mr - 1)] + k0);
                    }
                    // Rows i..i + mr, columns g0 - j0 .. + gw of c: inside c
                    // (checked by the caller).
                    let dst = c.add(i * ldc + (g0 - j0));
                    let add = k0 > 0;
                    // The last k block finishes the tile: bias, GELU,
                    // residual at this tile's rows and columns.
                    let fin = epi.filter(|_| k0 + kc == k).map(|e| Fin {
                        bias: if e.bias.is_null() { e.bias } else { e.bias.add(g0 - j0) },
                        gelu: e.gelu,
                        residual: if e.residual.is_null() { e.residual } else { e.residual.add(i * ldc + (g0 - j0)) },
                    });
                    match mr {
                        6 => ptile::<6>(&ap, bp, kc, dst, ldc, gw, add),
                        5 => ptile::<5>(&ap, bp, kc, dst, ldc, gw, add),
                        4 => ptile::<4>(&ap, bp, kc, dst, ldc, gw, add),
                        3 => ptile::<3>(&ap, bp, kc, dst, ldc, gw, add),
                        2 => ptile::<2>(&ap, bp, kc, dst, ldc, gw, add),
                        _ => ptile::<1>(&ap, bp, kc, dst, ldc, gw, add),
                    }
                    // While the tile is in L1 (a separate function: inside
                    // the tile's loop its pointers crowded the registers).
                    if let Some(f) = fin {
                        finish(f, dst, ldc, mr, gw);
                    }
                    i += mr;
                }
                k0 += kc;
            }
            g0 += GROUP;
        }
    }

    /// dst[r][..gw] (+)= Σ_k a[r][k] · group[k][..gw] for the first R rows
    /// over k steps: four weight vectors per step, each a row's broadcast
    /// times them. `add`: start from dst (a later k block).
    #[inline(always)]
    unsafe fn ptile<const R: usize>(ap: &[*const f32; PR], bp: *const f32, k: usize, dst: *mut f32, ld: usize, gw: usize, add: bool) {
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        if add {
            for (r, row) in acc.iter_mut().enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    let left = gw.saturating_sub(16 * j).min(16);
                    if left > 0 {
                        *v = _mm512_maskz_loadu_ps(((1u32 << left) - 1) as __mmask16, dst.add(r * ld + 16 * j));
                    }
                }
            }
        }
        for kk in 0..k {
            let b = bp.add(kk * GROUP);
            let bv = [_mm512_loadu_ps(b), _mm512_loadu_ps(b.add(16)), _mm512_loadu_ps(b.add(32)), _mm512_loadu_ps(b.add(48))];
            for r in 0..R {
                let x = _mm512_set1_ps(*ap[r].add(kk));
                for (j, bj) in bv.iter().enumerate() {
                    acc[r][j] = _mm512_fmadd_ps(x, *bj, acc[r][j]);
                }
            }
        }
        // Straight into c (row stride ld), the first gw columns only: the
        // padding columns of the last group are never stored.
        for (r, row) in acc.iter().enumerate() {
            for (j, v) in row.iter().enumerate() {
                let left = gw.saturating_sub(16 * j).min(16);
                if left > 0 {
                    let mask = ((1u32 << left) - 1) as __mmask16;
                    _mm512_mask_storeu_ps(dst.add(r * ld + 16 * j), mask, *v);
                }
            }
        }
    }

    /// Applies `f` to the `rows` × `gw` tile at dst (rows `ld` apart).
    #[inline(never)]
    #[target_feature(enable = "avx512f")]
    unsafe fn finish(f: Fin, dst: *mut f32, ld: usize, rows: usize, gw: usize) {
        for r in 0..rows {
            for j in 0..gw.div_ceil(16) {
                let left = (gw - 16 * j).min(16);
                let mask = ((1u32 << left) - 1) as __mmask16;
                let o = dst.add(r * ld + 16 * j);
                let mut v = _mm512_maskz_loadu_ps(mask, o);
                if !f.bias.is_null() {
                    v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, f.bias.add(16 * j)));
                }
                if f.gelu {
                    v = gelu(v);
                }
                if !f.residual.is_null() {
                    v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, f.residual.add(r * ld + 16 * j)));
                }
                _mm512_mask_storeu_ps(o, mask, v);
            }
        }
    }

    /// A tile's epilogue: bias at its first column, erf-GELU, residual at
    /// its first row and column (rows `ld` apart); null pointers: none.
    #[derive(Clone, Copy)]
    pub struct Fin {
        pub bias: *const f32,
        pub gelu: bool,
        pub residual: *const f32,
    }

    /// `act::gelu32` on 16 lanes, the same operations in the same order (so
    /// the same bits as the separate pass).
    #[inline(always)]
    unsafe fn gelu(x: __m512) -> __m512 {
        use crate::act::{ERF_P, ERF_Q};
        let a = _mm512_min_ps(_mm512_abs_ps(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::FRAC_1_SQRT_2))), _mm512_set1_ps(4.0));
        let z = _mm512_mul_ps(a, a);
        let (mut p, mut q) = (_mm512_set1_ps(ERF_P[5]), _mm512_set1_ps(ERF_Q[5]));
        for j in (0..5).rev() {
            p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(ERF_P[j]));
            q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(ERF_Q[j]));
        }
        let e = _mm512_min_ps(_mm512_div_ps(_mm512_mul_ps(a, p), q), _mm512_set1_ps(1.0));
        // copysign(e, x): e ≥ 0, so OR in x's sign bit.
        let sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN));
        let e = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(e), sign));
        _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5), x), _mm512_add_ps(_mm512_set1_ps(1.0), e))
    }

    /// Requests the next block's weight rows into L2 one cache line at a
    /// time while the current block computes: at few rows the kernel
    /// waits on weight loads (perf: most samples on them), and the tiles
    /// after a block's first touch no memory at all without this.
    pub struct Prefetch {
        pub rows: [*const f32; NR],
        pub t: usize,
        pub line: usize,
        pub lines: usize,
    }

    impl Prefetch {
        #[inline(always)]
        unsafe fn next(&mut self) {
            if self.t < NR {
                // The line lies inside row t (line < lines), itself in b.
                _mm_prefetch::<_MM_HINT_T1>(self.rows[self.t].add(self.line * 16) as *const i8);
                self.line += 1;
                if self.line == self.lines {
                    self.line = 0;
                    self.t += 1;
                }
            }
        }
    }

    /// s[r][t] = Σ_k a[r][k] · b[t][k] for the first R a rows.
    #[inline(always)]
    unsafe fn tile<const R: usize, const PF: bool>(
        ap: &[*const f32; MR],
        bp: &[*const f32; NR],
        k: usize,
        s: &mut [[f32; NR]; MR],
        pf: &mut Prefetch,
        per: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NR]; R];
        let mut kk = 0;
        while kk + 16 <= k {
            if PF {
                for _ in 0..per {
                    pf.next();
                }
            }
            let mut bv = [_mm512_setzero_ps(); NR];
            for t in 0..NR {
                bv[t] = _mm512_loadu_ps(bp[t].add(kk));
            }
            for r in 0..R {
                let av = _mm512_loadu_ps(ap[r].add(kk));
                for t in 0..NR {
                    acc[r][t] = _mm512_fmadd_ps(av, bv[t], acc[r][t]);
                }
            }
            kk += 16;
        }
        if kk < k {
            // Masked loads read only the lanes below k, so odd K needs no
            // scalar tail and never touches memory past a row.
            let mask: __mmask16 = ((1u32 << (k - kk)) - 1) as __mmask16;
            let mut bv = [_mm512_setzero_ps(); NR];
            for t in 0..NR {
                bv[t] = _mm512_maskz_loadu_ps(mask, bp[t].add(kk));
            }
            for r in 0..R {
                let av = _mm512_maskz_loadu_ps(mask, ap[r].add(kk));
                for t in 0..NR {
                    acc[r][t] = _mm512_fmadd_ps(av, bv[t], acc[r][t]);
                }
            }
        }
        // The R × NR sums, 16 at a time through the reduction tree.
        const G: usize = (MR * NR).div_ceil(16) * 16;
        let mut v = [_mm512_setzero_ps(); G];
        for r in 0..R {
            for t in 0..NR {
                v[r * NR + t] = acc[r][t];
            }
        }
        let mut sums = [0f32; G];
        let mut g = 0;
        while g < R * NR {
            let mut part = [_mm512_setzero_ps(); 16];
            part.copy_from_slice(&v[g..g + 16]);
            _mm512_storeu_ps(sums.as_mut_ptr().add(g), reduce16(&part));
            g += 16;
        }
        for r in 0..R {
            s[r].copy_from_slice(&sums[r * NR..][..NR]);
        }
    }

    /// Per 128-bit lane, [Σ v0, Σ v1, Σ v2, Σ v3] over that lane's 4 floats.
    #[inline(always)]
    unsafe fn lane_sums(v0: __m512, v1: __m512, v2: __m512, v3: __m512) -> __m512 {
        let a = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
        let b = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(a, b), _mm512_shuffle_ps::<0b11_10_11_10>(a, b))
    }

    /// The 16 horizontal sums of v in one vector (lane i = Σ v[i]): a
    /// transposing tree of ~30 shuffles and adds instead of 16 separate
    /// reductions of ~8 each, which cost a third of a tile at K = 384.
    #[inline(always)]
    unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
        let c0 = lane_sums(v[0], v[1], v[2], v[3]);
        let c1 = lane_sums(v[4], v[5], v[6], v[7]);
        let c2 = lane_sums(v[8], v[9], v[10], v[11]);
        let c3 = lane_sums(v[12], v[13], v[14], v[15]);
        const EVEN: i32 = 0b10_00_10_00;
        const ODD: i32 = 0b11_01_11_01;
        let d01 = _mm512_add_ps(_mm512_shuffle_f32x4::<EVEN>(c0, c1), _mm512_shuffle_f32x4::<ODD>(c0, c1));
        let d23 = _mm512_add_ps(_mm512_shuffle_f32x4::<EVEN>(c2, c3), _mm512_shuffle_f32x4::<ODD>(c2, c3));
        _mm512_add_ps(_mm512_shuffle_f32x4::<EVEN>(d01, d23), _mm512_shuffle_f32x4::<ODD>(d01, d23))
    }
}
