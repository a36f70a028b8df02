//! The fused feed-forward block (kernels/ffn.cu) for at most 128 rows:
//! FFN1 (+bias, erf-GELU), FFN2 (+bias) and the norm after them as one
//! kernel instead of cuBLASLt, the GELU epilogue, cuBLASLt and the norm.
//!
//! `find` picks the triples it can run: MatMul → MatMul → Norm where the
//! first matmul's output feeds only the second, the second's only the norm
//! (neither is read again before it is overwritten, nor is an output), the
//! weights are stored `[out, in]` and (H, I) has a compiled kernel. `build`
//! lowers one for a slot.
//!
//! The kernel is a row split (`ffn_rows_<H>_<I>`): 16-block clusters over
//! groups of at most 32 rows run the whole block and the norm, each block
//! 1/16 of I, FFN2's partials and the norm's statistics summed over DSMEM.
//! Where the block follows the attention's output projection and its norm
//! (MatMul [H, H] → Norm → triple), `ffn_rows_tail_<H>_<I>` runs those two
//! as well (five thunks): each block OC = H/16 columns of the projection,
//! norm1's statistics combined over DSMEM, and norm1's output stored and
//! pushed into every block of the cluster. On sm_90+ it is the default
//! (`CudaOptions::ffn_fusion`): at MiniLM's widths it measured faster than
//! cuBLASLt's kernels at every row count up to 128 (20 kernels per 1×128
//! forward instead of 50).

use rlx_ir::{Activation, DType};
use rlx_runtime::Result;
use rlx_schedule::operands::operands;
use rlx_schedule::{BufRef, MatMulThunk, Thunk};

use crate::launch::{suffix, Bases, Kernels, Op, Step};
use crate::params::{i, FfnRowsP};

/// Rows one fused block handles.
const MAX_ROWS: usize = 128;

/// The compiled widths of the row-split kernel (kernels/ffn.cu
/// `ffn_rows_*`): (H, I).
const ROW_VARIANTS: [(usize, usize); 1] = [(384, 1536)];
/// Blocks per cluster of the row split (a non-portable size).
const ROW_CLUSTER: usize = 16;
/// Rows one row-split cluster can take (kernels/ffn.cu FfnRowsSmem::RT).
const ROW_TILE: usize = 32;
/// Rows per row-split group to aim for (as many groups as that takes, up to
/// the clusters that fit at once): a cluster's DSMEM partials and epilogue
/// grow with its rows; 12 measured best on the H200 between 1×16 and 1×64
/// (8 to 32 were tried).
const GROUP_ROWS: usize = 12;

/// kernels/ffn.cu's FfnRowsSmem::TOTAL.
fn row_smem(h: usize, i: usize) -> u32 {
    let is = i / ROW_CLUSTER;
    let (xp, hp) = (h + 8, is + 8);
    let khalf = 4 * 16 * (is / 2 + 4) * 4;
    ((ROW_TILE + is) * xp * 2 + h * hp * 2 + ROW_TILE * hp * 2 + is * 2 + 2 * ROW_TILE * 4 + ROW_TILE * 8 * 4 + khalf) as u32
}

/// The tail kernel's extra shared memory: the output projection's weight
/// slice [32][H+8] (kernels/ffn.cu FfnRowsSmem::WO).
fn tail_smem(h: usize) -> u32 {
    (32 * (h + 8) * 2) as u32
}

/// The kernel a fused block runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// `ffn_rows_<H>_<I>`: the feed-forward block and the norm in one kernel.
    Rows,
    /// `ffn_rows_tail_<H>_<I>`: also the attention's output projection and
    /// the norm before the feed-forward block (five thunks).
    RowsTail,
}

/// Thunks start.. that `find` accepted: a feed-forward triple, or for
/// `RowsTail` the output projection and its norm, then the triple.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fusion {
    pub start: usize,
    kernel: Kernel,
}

impl Fusion {
    /// How many thunks it runs.
    pub fn thunks(&self) -> usize {
        if self.kernel == Kernel::RowsTail {
            5
        } else {
            3
        }
    }
}

/// `w` may be written (by the block that owns its rows and columns, after
/// every read of `r` that other blocks make) while `r` is read only if they
/// are the same bytes or apart.
fn same_or_apart(w: &BufRef, r: Option<&BufRef>) -> bool {
    r.is_none_or(|r| r == w || !w.overlaps(r))
}

/// Thunks i, i + 1: the attention's output projection ([rows, H] · W_oᵀ
/// (+ bias, + residual), W_o [H, H]) and the norm (+ residual) whose output
/// the feed-forward block `ffn` (thunks i + 2..) reads; the tail kernel
/// writes norm1's output as well, so its liveness does not matter; the
/// projection's output must be dead after the norm.
fn tail(thunks: &[Thunk], i: usize, ffn: &MatMulThunk, norm2_out: &BufRef, outputs: &[BufRef]) -> bool {
    let (Thunk::MatMul(o), Thunk::Norm { dtype, rows, cols, x, residual, out, .. }) = (&thunks[i], &thunks[i + 1]) else {
        return false;
    };
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
        // The block's residuals, read after norm1's output is written.
        && matches!((&thunks[i + 3], &thunks[i + 4]), (Thunk::MatMul(f2), Thunk::Norm { residual: r2, .. })
            if same_or_apart(out, f2.residual.as_ref()) && same_or_apart(out, r2.as_ref()))
        && (*out == o.out || dead_after(thunks, i + 1, &o.out, outputs))
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

/// Nothing after `after` reads a byte of `buf` before something overwrites
/// that byte, nor does the copy of the graph's outputs after the last thunk.
fn dead_after(thunks: &[Thunk], after: usize, buf: &BufRef, outputs: &[BufRef]) -> bool {
    // The byte ranges of `buf` still holding its value: [start, end).
    let mut live = vec![(buf.offset, buf.offset + buf.bytes)];
    let read =
        |live: &[(u64, u64)], o: &BufRef, need: u64| o.space == buf.space && live.iter().any(|&(a, b)| a < o.offset + need && o.offset < b);
    for t in &thunks[after + 1..] {
        let ops = operands(t);
        if ops.iter().any(|o| !o.write && read(&live, &o.buf, o.need)) {
            return false;
        }
        for o in ops.iter().filter(|o| o.write && o.buf.space == buf.space) {
            let (s, e) = (o.buf.offset, o.buf.offset + o.need);
            live = live.into_iter().flat_map(|(a, b)| [(a, b.min(s)), (a.max(e), b)]).filter(|&(a, b)| a < b).collect();
        }
        if live.is_empty() {
            return true;
        }
    }
    !outputs.iter().any(|o| read(&live, o, o.bytes))
}

/// The blocks the fused kernel can run (none before sm_90, which the
/// clusters need).
pub(crate) fn find(thunks: &[Thunk], outputs: &[BufRef], cc_major: i32) -> Vec<Fusion> {
    if cc_major < 9 {
        return Vec::new();
    }
    // The feed-forward triple at i: its first matmul and the norm's output.
    let triple = |i: usize| -> Option<(&MatMulThunk, &BufRef)> {
        let (Thunk::MatMul(a), Thunk::MatMul(b), Thunk::Norm { dtype, rows, cols, x, residual, out, .. }) =
            (thunks.get(i)?, thunks.get(i + 1)?, thunks.get(i + 2)?)
        else {
            return None;
        };
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
            && same_or_apart(out, residual.as_ref())
            && dead_after(thunks, i + 1, &a.out, outputs)
            && dead_after(thunks, i + 2, &b.out, outputs);
        (ok && ROW_VARIANTS.contains(&(a.k, a.n))).then_some((a, out))
    };
    let mut found = Vec::new();
    let mut i = 0;
    while i + 2 < thunks.len() {
        if let Some((a, out)) = triple(i + 2) {
            if tail(thunks, i, a, out, outputs) {
                found.push(Fusion { start: i, kernel: Kernel::RowsTail });
                i += 5;
                continue;
            }
        }
        if triple(i).is_some() {
            found.push(Fusion { start: i, kernel: Kernel::Rows });
            i += 3;
            continue;
        }
        i += 1;
    }
    found
}

/// The launch step of one fused block for a slot, or None when an operand
/// is not aligned or the row groups do not fit at once (the thunks then
/// lower as usual). `trace`: print the grouping.
pub(crate) fn build(k: &Kernels, thunks: &[Thunk], f: Fusion, b: &Bases, trace: bool) -> Result<Option<Vec<Step>>> {
    let t0 = f.start + f.thunks() - 3;
    let (Thunk::MatMul(m1), Thunk::MatMul(m2), Thunk::Norm { rms, eps, x: _, residual, gamma, beta, out, .. }) =
        (&thunks[t0], &thunks[t0 + 1], &thunks[t0 + 2])
    else {
        return Ok(None);
    };
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
    // The kernels could not be compiled or loaded: the thunks run as usual
    // (said once per process, as this is the default path).
    let own = match k.ffn() {
        Ok(o) => o,
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("rlx-cuda: fused feed-forward kernels unavailable, using the unfused ones: {e}"));
            return Ok(None);
        }
    };
    let (h, n_i) = (m1.k, m1.n);
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
    let mut smem = row_smem(h, n_i);
    let name = if f.kernel == Kernel::RowsTail {
        let (Thunk::MatMul(mo), Thunk::Norm { rms: rms1, eps: eps1, residual: r1, gamma: g1, beta: be1, out: out1, .. }) =
            (&thunks[f.start], &thunks[f.start + 1])
        else {
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
        smem += tail_smem(h);
        format!("ffn_rows_tail_{h}_{n_i}_{sfx}")
    } else {
        format!("ffn_rows_{h}_{n_i}_{sfx}")
    };
    let func = own.get(&name)?;
    func.set_max_dynamic_smem(smem)?;
    // Groups of about GROUP_ROWS rows, as many as fit at once (one wave),
    // each at most ROW_TILE rows; else (or where 16-block clusters are
    // refused) the thunks lower as usual.
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
    use rlx_schedule::Space;

    fn buf(offset: u64, bytes: usize) -> BufRef {
        BufRef { space: Space::Arena, offset, bytes: bytes as u64 }
    }
    fn w(i: u32, bytes: usize) -> BufRef {
        BufRef { space: Space::Weight(i), offset: 0, bytes: bytes as u64 }
    }
    fn mm(rows: usize, n: usize, k: usize, a: BufRef, b: BufRef, act: Option<Activation>, out: BufRef) -> Thunk {
        Thunk::MatMul(MatMulThunk {
            dtype: DType::F16,
            batch: 1,
            m: rows,
            n,
            k,
            a,
            lda: k as u64,
            a_batch_stride: (rows * k) as u64,
            b,
            b_trans: true,
            ldb: k as u64,
            b_batch_stride: 0,
            bias: Some(w(9, n * 2)),
            act,
            residual: None,
            out,
        })
    }
    /// X at 0, H after it, Y after H, the norm's output after Y.
    fn block(rows: usize, h: usize, i: usize, act: Option<Activation>) -> (Vec<Thunk>, [BufRef; 4]) {
        let x = buf(0, rows * h * 2);
        let hb = buf(x.bytes, rows * i * 2);
        let y = buf(hb.offset + hb.bytes, rows * h * 2);
        let out = buf(y.offset + y.bytes, rows * h * 2);
        let norm = Thunk::Norm {
            rms: false,
            dtype: DType::F16,
            rows,
            cols: h,
            eps: 1e-12,
            x: y,
            residual: Some(x),
            gamma: w(3, h * 2),
            beta: None,
            out,
        };
        (vec![mm(rows, i, h, x, w(1, i * h * 2), act, hb), mm(rows, h, i, hb, w(2, i * h * 2), None, y), norm], [x, hb, y, out])
    }

    #[test]
    fn finds_minilm_blocks_and_nothing_else() {
        let (t, [.., out]) = block(128, 384, 1536, Some(Activation::Gelu));
        assert_eq!(find(&t, &[out], 9), vec![Fusion { start: 0, kernel: Kernel::Rows }]);
        // Before sm_90 (no clusters): nothing.
        assert!(find(&t, &[out], 8).is_empty());
        // 129 rows, the tanh GELU, widths without a compiled kernel.
        for (rows, h, i, act) in [
            (129, 384, 1536, Activation::Gelu),
            (64, 384, 1536, Activation::GeluTanh),
            (64, 256, 1024, Activation::Gelu),
            (128, 768, 3072, Activation::Gelu),
        ] {
            let (t, [.., out]) = block(rows, h, i, Some(act));
            assert!(find(&t, &[out], 9).is_empty(), "{rows} {h} {i} {act:?}");
        }
    }

    #[test]
    fn intermediates_read_later_or_returned_are_not_fused() {
        let (mut t, [x, hb, y, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        // FFN1's output is a graph output, or FFN2's is read after the norm.
        assert!(find(&t, &[out, hb], 9).is_empty());
        let later = Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: y, out: x };
        t.push(later.clone());
        assert!(find(&t, &[out], 9).is_empty());
        // Overwritten first, then read: dead, so fused.
        let (mut t, [x, _, y, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: out, out: y });
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: y, out: x });
        assert_eq!(find(&t, &[x], 9).len(), 1);
        // A later tensor over part of FFN1's output, written then read (as
        // the arena planner reuses memory): still dead. Reading the part not
        // overwritten is not.
        let (mut t, [x, hb, _, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        let part = buf(hb.offset + 4096, 32 * 384 * 2);
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: out, out: part });
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: part, out: x });
        assert_eq!(find(&t, &[x], 9).len(), 1);
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 1024, x: buf(hb.offset, 2048), out: x });
        assert!(find(&t, &[x], 9).is_empty());
    }

    #[test]
    fn every_block_of_the_real_minilm_schedule_is_found() {
        // `rlx inspect --model models/all-MiniLM-L6-v2 --precision f16 --json`
        // (1×128; crates/rlx-cli/tests/fixtures.rs checks that the file is
        // what the compiler makes now): the arena planner reuses FFN1's
        // output for later tensors.
        let s: rlx_schedule::Schedule =
            serde_json::from_str(include_str!("../tests/data/minilm-f16-1x128.schedule.json")).expect("schedule");
        let outputs: Vec<BufRef> = s.outputs.iter().map(|o| o.buf).collect();
        // The row split takes each layer's output projection and its norm
        // too (the norm writes over the projection's input here).
        let found = find(&s.thunks, &outputs, 9);
        assert_eq!(found.iter().map(|f| f.start).collect::<Vec<_>>(), [3, 10, 17, 24, 31, 38]);
        assert!(found.iter().all(|f| f.kernel == Kernel::RowsTail && f.thunks() == 5));
    }

    /// The output projection and its norm before `block`'s triple: A (the
    /// attention's output) and the residual X0 after the block's buffers.
    fn tail_block(rows: usize) -> (Vec<Thunk>, [BufRef; 4]) {
        let (h, i) = (384, 1536);
        let (t, [x1, _, _, out]) = block(rows, h, i, Some(Activation::Gelu));
        let a = buf(out.offset + out.bytes, rows * h * 2);
        let yo = buf(a.offset + a.bytes, rows * h * 2);
        let x0 = buf(yo.offset + yo.bytes, rows * h * 2);
        let Thunk::MatMul(mut o) = t[1].clone() else { unreachable!() };
        (o.m, o.n, o.k, o.a, o.lda, o.b, o.ldb, o.out) = (rows, h, h, a, h as u64, w(5, h * h * 2), h as u64, yo);
        o.a_batch_stride = (rows * h) as u64;
        let norm1 = Thunk::Norm {
            rms: false,
            dtype: DType::F16,
            rows,
            cols: h,
            eps: 1e-12,
            x: yo,
            residual: Some(x0),
            gamma: w(6, h * 2),
            beta: None,
            out: x1,
        };
        let mut all = vec![Thunk::MatMul(o), norm1];
        all.extend(t);
        (all, [a, yo, x0, out])
    }

    #[test]
    fn the_row_split_takes_the_output_projection_and_its_norm() {
        let (t, [a, yo, x0, out]) = tail_block(64);
        assert_eq!(find(&t, &[out], 9), [Fusion { start: 0, kernel: Kernel::RowsTail }]);
        // The projection's output read later: only the triple.
        assert_eq!(find(&t, &[out, yo], 9), [Fusion { start: 2, kernel: Kernel::Rows }]);
        // Norm1 in place over the projection's input or its residual: still the tail.
        for over in [a, x0] {
            let mut t2 = t.clone();
            if let Thunk::Norm { out, .. } = &mut t2[1] {
                *out = over;
            }
            if let Thunk::MatMul(m) = &mut t2[2] {
                m.a = over;
            }
            if let Thunk::Norm { residual, .. } = &mut t2[4] {
                *residual = Some(over);
            }
            assert_eq!(find(&t2, &[out], 9)[0].kernel, Kernel::RowsTail, "{over:?}");
        }
        // Norm1's output over part of the projection's input: not the tail.
        let shifted = buf(a.offset + 768, a.bytes as usize);
        let mut t3 = t.clone();
        if let Thunk::Norm { out, .. } = &mut t3[1] {
            *out = shifted;
        }
        if let Thunk::MatMul(m) = &mut t3[2] {
            m.a = shifted;
        }
        if let Thunk::Norm { residual, .. } = &mut t3[4] {
            *residual = Some(shifted);
        }
        assert!(find(&t3, &[out], 9).iter().all(|f| f.kernel != Kernel::RowsTail));
        // The block's second norm reading a residual that norm1's output
        // partly overwrites: neither the tail nor the triple.
        let mut t4 = t.clone();
        if let Thunk::Norm { residual, .. } = &mut t4[4] {
            *residual = Some(buf(x0.offset, x0.bytes as usize));
        }
        if let Thunk::Norm { out, .. } = &mut t4[1] {
            *out = buf(x0.offset + 768, x0.bytes as usize);
        }
        if let Thunk::MatMul(m) = &mut t4[2] {
            m.a = buf(x0.offset + 768, x0.bytes as usize);
        }
        assert!(find(&t4, &[out], 9).iter().all(|f| f.kernel != Kernel::RowsTail));
    }

    #[test]
    fn a_norm_output_partly_over_its_block_input_or_residual_is_not_fused() {
        let (t, [x, _, _, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        // In place over the input (same bytes): fused.
        let mut same = t.clone();
        if let Thunk::Norm { out: o, .. } = &mut same[2] {
            *o = x;
        }
        assert_eq!(find(&same, &[x], 9).len(), 1);
        // Shifted by one row: not fused.
        let mut shifted = t.clone();
        if let Thunk::Norm { out: o, .. } = &mut shifted[2] {
            *o = buf(x.offset + 768, x.bytes as usize);
        }
        assert!(find(&shifted, &[out], 9).is_empty());
    }

    #[test]
    fn shared_memory_matches_the_kernel_layout() {
        // X and W1 (the f32 partial reuses them), W2, H, b1,
        // statistics, per-thread sums, FFN1's second K half.
        assert_eq!(
            row_smem(384, 1536),
            (32 + 96) * 392 * 2 + 384 * 104 * 2 + 32 * 104 * 2 + 96 * 2 + 2 * 32 * 4 + 32 * 8 * 4 + 4 * 16 * 52 * 4
        );
        assert!(row_smem(384, 1536) <= 227 * 1024);
    }
}
