//! MatMul with fused epilogue: `out = act(a · b + bias) + residual`.
//!
//! f32 runs straight through the `gemm` crate on the arena. f16 and bf16
//! operands are widened to f32 (weights once at prepare, see
//! `weight_cache`), multiplied into an f32 scratch and narrowed by the
//! epilogue, so accumulation is always f32.

use rayon::prelude::*;
use rlx_ir::DType;
use rlx_schedule::MatMulThunk;

use crate::elem::{with_float, Elem};
use crate::kernels::matmul_small::{self, SmallArgs};
use crate::memory::{gemm_f32, Dst, MatRef, Mem, Src};
use crate::{act, exec_err, Result, Scratch};
use rlx_schedule::operands::extent;

/// An f32 operand: a view plus its batch stride, row and column strides.
struct Operand<'a> {
    src: &'a Src<f32>,
    offset: usize,
    batch_stride: usize,
    rs: usize,
    cs: usize,
}

fn a_extent(mm: &MatMulThunk) -> usize {
    extent(&[mm.batch, mm.m, mm.k], &[mm.a_batch_stride, mm.lda, 1]) as usize
}

fn b_extent(mm: &MatMulThunk) -> usize {
    let (r, c) = if mm.b_trans { (mm.n, mm.k) } else { (mm.k, mm.n) };
    extent(&[mm.batch, r, c], &[mm.b_batch_stride, mm.ldb, 1]) as usize
}

/// b's (row, column) strides as a k×n matrix.
fn b_strides(mm: &MatMulThunk) -> (usize, usize) {
    if mm.b_trans {
        (1, mm.ldb as usize)
    } else {
        (mm.ldb as usize, 1)
    }
}

/// The f32 copy of a half-precision weight b, in b's own strided layout, so
/// the conversion is paid once per weight version instead of every call.
pub fn weight_cache(mm: &MatMulThunk, mem: &Mem) -> Result<Option<Vec<f32>>> {
    if !needs_weight_cache(mm) {
        return Ok(None);
    }
    let n = b_extent(mm);
    let mut v = vec![0f32; n];
    with_float!(mm.dtype, T => {
        let b = mem.src::<T>(&mm.b).map_err(exec_err)?;
        b.load(0, &mut v);
    });
    Ok(Some(v))
}

/// A weight operand prepared at prepare time for one matmul thunk.
pub enum WeightCopy {
    /// f32 copy of a half-precision weight (gemm path).
    Plain(std::sync::Arc<Vec<f32>>),
    /// The few-row kernel's packed layout (`matmul_small::pack`).
    Packed(std::sync::Arc<Vec<f32>>),
}

/// Whether the few-row path runs `mm` with a packed weight: its b is a
/// weight (fixed at prepare) and `matmul_small` takes the shape.
pub fn wants_packed(mm: &MatMulThunk) -> bool {
    matches!(mm.b.space, rlx_schedule::Space::Weight(_)) && matmul_small::applies_packed(mm)
}

/// `mm`'s weight in the packed layout, read from `mem` in its dtype.
pub fn packed_weight(mm: &MatMulThunk, mem: &Mem) -> Result<Vec<f32>> {
    let (n, k, ldb) = (mm.n, mm.k, mm.ldb as usize);
    with_float!(mm.dtype, T => {
        let b = mem.src::<T>(&mm.b).map_err(exec_err)?;
        Ok(matmul_small::pack(n, k, |col, row| b.load(col * ldb, row)))
    })
}

/// Whether `weight_cache` makes a copy: a half-precision weight operand.
pub fn needs_weight_cache(mm: &MatMulThunk) -> bool {
    mm.dtype != DType::F32 && matches!(mm.b.space, rlx_schedule::Space::Weight(_))
}

/// Elements of the f32 copy `weight_cache` makes.
pub fn weight_cache_len(mm: &MatMulThunk) -> usize {
    b_extent(mm)
}

/// c[batch, m, n] (=|+=) a · b over all batches, choosing how to spread the
/// work: one tall gemm when b is shared and a's batches are evenly strided,
/// rayon over batches when each product is small, else gemm's own threads.
fn gemm_batches(mm: &MatMulThunk, a: &Operand<'_>, b: &Operand<'_>, c: &Dst<f32>, accumulate: bool, threads: usize) {
    let (m, n, k) = (mm.m, mm.n, mm.k);
    let par = gemm::Parallelism::Rayon(threads);
    let fold = mm.batch == 1 || (b.batch_stride == 0 && a.batch_stride == m * a.rs);
    if fold {
        let rows = mm.batch * m;
        // Few rows (a transformer at small batch): split the columns into
        // blocks, each a single-threaded gemm, about four per thread so a
        // thread that gets descheduled is covered by work stealing. gemm's
        // own threading synchronises per k-block, which costs more than it
        // gains here (and much more on a loaded machine); large products
        // keep it.
        if threads > 1 && rows <= 1024 && n >= 64 * threads {
            let chunk = (n / (4 * threads)).max(64).div_ceil(16) * 16;
            (0..n.div_ceil(chunk)).into_par_iter().for_each(|p| {
                let j0 = p * chunk;
                let am = MatRef { src: a.src, offset: a.offset, rs: a.rs, cs: a.cs };
                let bm = MatRef { src: b.src, offset: b.offset + j0 * b.cs, rs: b.rs, cs: b.cs };
                gemm_f32(c, j0, n, accumulate, am, bm, (rows, chunk.min(n - j0), k), gemm::Parallelism::None);
            });
            return;
        }
        let am = MatRef { src: a.src, offset: a.offset, rs: a.rs, cs: a.cs };
        let bm = MatRef { src: b.src, offset: b.offset, rs: b.rs, cs: b.cs };
        gemm_f32(c, 0, n, accumulate, am, bm, (rows, n, k), par);
        return;
    }
    let one = |i: usize, par: gemm::Parallelism| {
        let am = MatRef { src: a.src, offset: a.offset + i * a.batch_stride, rs: a.rs, cs: a.cs };
        let bm = MatRef { src: b.src, offset: b.offset + i * b.batch_stride, rs: b.rs, cs: b.cs };
        gemm_f32(c, i * m * n, n, accumulate, am, bm, (m, n, k), par);
    };
    if m * n * k < 128 * 128 * 64 {
        (0..mm.batch).into_par_iter().for_each(|i| one(i, gemm::Parallelism::None));
    } else {
        (0..mm.batch).for_each(|i| one(i, par));
    }
}

/// Per row of c: `v = act(c + bias) + residual`, written to out (or left in
/// c when c is out).
fn epilogue<T: Elem>(mm: &MatMulThunk, c: &Dst<f32>, bias: Option<Src<T>>, residual: Option<Src<T>>, out: Option<Dst<T>>) {
    let (rows, n) = (mm.batch * mm.m, mm.n);
    let min_len = (1 << 14) / n.max(1) + 1;
    (0..rows).into_par_iter().with_min_len(min_len).for_each_init(
        || vec![0f32; n],
        |tmp, r| {
            // SAFETY: row r belongs to this task alone.
            let v = unsafe { c.row_mut(r * n, n) };
            if let Some(b) = &bias {
                b.load(0, tmp);
                v.iter_mut().zip(tmp.iter()).for_each(|(x, y)| *x += y);
            }
            if let Some(a) = mm.act {
                act::apply(a, v);
            }
            if let Some(res) = &residual {
                res.load(r * n, tmp);
                v.iter_mut().zip(tmp.iter()).for_each(|(x, y)| *x += y);
            }
            if let Some(o) = &out {
                o.store(r * n, v);
            }
        },
    );
}

/// `copy` is the prepared form of a weight operand (`weight_copy`): the
/// packed layout on the few-row path, else an f32 copy of a half weight.
pub fn run(mm: &MatMulThunk, mem: &Mem, scratch: &mut Scratch, copy: Option<&WeightCopy>, threads: usize) -> Result<()> {
    let packed = match copy {
        Some(WeightCopy::Packed(p)) => Some(p.as_slice()),
        _ => None,
    };
    if mm.dtype == DType::F32 {
        return run_f32(mm, mem, scratch, packed, threads);
    }
    let plain = match copy {
        Some(WeightCopy::Plain(p)) => Some(p.as_slice()),
        _ => None,
    };
    with_float!(mm.dtype, T => run_half::<T>(mm, mem, scratch, plain, packed, threads))
}

fn run_f32(mm: &MatMulThunk, mem: &Mem, scratch: &mut Scratch, packed: Option<&[f32]>, threads: usize) -> Result<()> {
    let a = mem.src::<f32>(&mm.a).map_err(exec_err)?;
    let b = mem.src::<f32>(&mm.b).map_err(exec_err)?;
    let out = mem.dst::<f32>(&mm.out).map_err(exec_err)?;
    let bias = mm.bias.map(|x| mem.src::<f32>(&x)).transpose().map_err(exec_err)?;
    let residual = mm.residual.map(|x| mem.src::<f32>(&x)).transpose().map_err(exec_err)?;
    let packed = packed.filter(|_| matmul_small::applies_packed(mm));
    if packed.is_some() || matmul_small::applies(mm) {
        matmul_small::run(mm, &SmallArgs { a: &a, b: &b, bias: bias.as_ref(), residual: residual.as_ref(), out: &out }, threads, packed);
        return Ok(());
    }
    let (brs, bcs) = b_strides(mm);
    let ao = Operand { src: &a, offset: 0, batch_stride: mm.a_batch_stride as usize, rs: mm.lda as usize, cs: 1 };
    let bo = Operand { src: &b, offset: 0, batch_stride: mm.b_batch_stride as usize, rs: brs, cs: bcs };
    let total = mm.batch * mm.m * mm.n;

    if mm.act.is_none() {
        // No activation: pre-fill out with residual (+ bias) and let gemm
        // accumulate onto it, saving a pass over the output.
        let mut accumulate = false;
        if let Some(res) = &residual {
            if mm.residual != Some(mm.out) {
                out.copy_from(0, res, 0, total);
            }
            accumulate = true;
        }
        if let Some(bias) = &bias {
            let n = mm.n;
            let bias_row = bias.row(0, n);
            let min_len = (1 << 14) / n.max(1) + 1;
            (0..mm.batch * mm.m).into_par_iter().with_min_len(min_len).for_each(|r| {
                // SAFETY: row r belongs to this task alone.
                let row = unsafe { out.row_mut(r * n, n) };
                if accumulate {
                    row.iter_mut().zip(bias_row).for_each(|(x, y)| *x += y);
                } else {
                    row.copy_from_slice(bias_row);
                }
            });
            accumulate = true;
        }
        gemm_batches(mm, &ao, &bo, &out, accumulate, threads);
        return Ok(());
    }
    if mm.residual == Some(mm.out) {
        // The residual lives where the product goes: multiply into scratch.
        let c = scratch.c(total);
        // SAFETY: `c` (scratch) outlives this call, the view's only use.
        let cd = unsafe { Dst::from_slice(c) };
        gemm_batches(mm, &ao, &bo, &cd, false, threads);
        epilogue::<f32>(mm, &cd, bias, residual, Some(out));
    } else {
        gemm_batches(mm, &ao, &bo, &out, false, threads);
        epilogue::<f32>(mm, &out, bias, residual, None);
    }
    Ok(())
}

fn run_half<T: Elem>(
    mm: &MatMulThunk,
    mem: &Mem,
    scratch: &mut Scratch,
    b_cache: Option<&[f32]>,
    packed: Option<&[f32]>,
    threads: usize,
) -> Result<()> {
    let a = mem.src::<T>(&mm.a).map_err(exec_err)?;
    let out = mem.dst::<T>(&mm.out).map_err(exec_err)?;
    let bias = mm.bias.map(|x| mem.src::<T>(&x)).transpose().map_err(exec_err)?;
    let residual = mm.residual.map(|x| mem.src::<T>(&x)).transpose().map_err(exec_err)?;
    if let (Some(pk), true) = (packed, matmul_small::applies_packed(mm)) {
        // The packed weight replaces b entirely: only a is widened.
        let a32 = scratch.c(a_extent(mm));
        a.load(0, a32);
        // SAFETY: a32 (scratch) outlives the call below, the views' only use.
        let (a_src, none) = unsafe { (Src::from_slice(a32), Src::from_slice(&[])) };
        matmul_small::run(
            mm,
            &SmallArgs { a: &a_src, b: &none, bias: bias.as_ref(), residual: residual.as_ref(), out: &out },
            threads,
            Some(pk),
        );
        return Ok(());
    }
    let (a32, b32, c32) = scratch.abc(a_extent(mm), if b_cache.is_some() { 0 } else { b_extent(mm) }, mm.batch * mm.m * mm.n);
    a.load(0, a32);
    let b_f32: &[f32] = match b_cache {
        Some(cached) => cached,
        None => {
            let b = mem.src::<T>(&mm.b).map_err(exec_err)?;
            b.load(0, b32);
            b32
        }
    };
    // SAFETY: a32 / b_f32 (scratch or the weight cache) outlive this call, the views' only use.
    let (a_src, b_src) = unsafe { (Src::from_slice(a32), Src::from_slice(b_f32)) };
    if matmul_small::applies(mm) {
        matmul_small::run(
            mm,
            &SmallArgs { a: &a_src, b: &b_src, bias: bias.as_ref(), residual: residual.as_ref(), out: &out },
            threads,
            None,
        );
        return Ok(());
    }
    let (brs, bcs) = b_strides(mm);
    let ao = Operand { src: &a_src, offset: 0, batch_stride: mm.a_batch_stride as usize, rs: mm.lda as usize, cs: 1 };
    let bo = Operand { src: &b_src, offset: 0, batch_stride: mm.b_batch_stride as usize, rs: brs, cs: bcs };
    // SAFETY: c32 (scratch) outlives this call, the view's only use.
    let cd = unsafe { Dst::from_slice(c32) };
    gemm_batches(mm, &ao, &bo, &cd, false, threads);
    epilogue::<T>(mm, &cd, bias, residual, Some(out));
    Ok(())
}
