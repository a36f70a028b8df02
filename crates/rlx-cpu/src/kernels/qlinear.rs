//! Thunks over block-quantized weights: the matmul reads the GGUF blocks as
//! stored (`quant::matmul`), the embedding lookup dequantises only the rows
//! it gathers.

use rlx_ir::{BinaryOp, DType, QFormat};
use rlx_schedule::{BufRef, QNorm};

use super::{elementwise, norm, quant};
use crate::memory::Mem;
use crate::{exec_err, Result};

pub struct QMatMulArgs<'a> {
    pub format: QFormat,
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub a: &'a BufRef,
    pub lda: u64,
    pub w: &'a BufRef,
    pub out: &'a BufRef,
    pub norm: Option<&'a QNorm>,
    pub glu: bool,
    pub residual: Option<&'a BufRef>,
}

/// The quantized matmul and its fused forms. The fused steps run the
/// separate kernels' own arithmetic (RmsNorm, SwiGLU, Add) on this call's
/// rows, so a fused schedule gives the unfused one's bits.
pub fn matmul(a: &QMatMulArgs<'_>, mem: &Mem) -> Result<()> {
    let row_bytes =
        a.format.row_bytes(a.k).ok_or_else(|| exec_err(format!("qmatmul: K = {} is not a whole number of {} blocks", a.k, a.format)))?;
    if a.rows == 0 || a.n == 0 {
        return Ok(());
    }
    let (rows, n, k) = (a.rows, a.n, a.k);
    let lda = a.lda as usize;
    let a_len = (rows - 1) * lda + k;
    let x = mem.src::<f32>(a.a).map_err(exec_err)?;
    let w = mem.src::<u8>(a.w).map_err(exec_err)?;
    let wn = if a.glu { 2 * n } else { n };
    let w = w.row(0, wn * row_bytes);
    let normed;
    let (x, lda) = match a.norm {
        Some(nm) => {
            let gamma = mem.src::<f32>(&nm.gamma).map_err(exec_err)?;
            let gamma = gamma.row(0, k);
            let mut h = vec![0f32; rows * k];
            for (r, hr) in h.chunks_exact_mut(k).enumerate() {
                norm::rms_to(x.row(r * lda, k), hr, gamma, nm.eps);
            }
            normed = h;
            (&normed[..], k)
        }
        None => (x.row(0, a_len), lda),
    };
    let mm = |dst: &mut [f32]| quant::matmul(a.format, rows, wn, k, x, lda, w, dst, wn).map_err(|e| exec_err(format!("qmatmul: {e}")));
    let out = mem.dst::<f32>(a.out).map_err(exec_err)?;
    if !a.glu && a.residual.is_none() {
        // SAFETY: the output buffer is disjoint from a, w and gamma (operand checks at prepare) and this call is its only user.
        return mm(unsafe { out.row_mut(0, rows * n) });
    }
    let mut y = vec![0f32; rows * wn];
    mm(&mut y)?;
    if a.glu {
        for r in 0..rows {
            let (gate, up) = y[r * wn..(r + 1) * wn].split_at_mut(n);
            elementwise::silu_mul(gate, up);
        }
        for r in 1..rows {
            y.copy_within(r * wn..r * wn + n, r * n);
        }
        y.truncate(rows * n);
    }
    if let Some(res) = a.residual {
        // The residual may be the output buffer itself: read it whole first.
        let mut acc = vec![0f32; rows * n];
        mem.src::<f32>(res).map_err(exec_err)?.load(0, &mut acc);
        elementwise::combine(BinaryOp::Add, &mut acc, &y);
        y = acc;
    }
    // SAFETY: as above; the residual, if it is this buffer, was read in full.
    unsafe { out.row_mut(0, rows * n) }.copy_from_slice(&y);
    Ok(())
}

pub struct QGatherArgs<'a> {
    pub format: QFormat,
    pub id_dtype: DType,
    pub n: usize,
    pub dim: usize,
    pub vocab: usize,
    pub table: &'a BufRef,
    pub ids: &'a BufRef,
    pub out: &'a BufRef,
}

pub fn gather(a: &QGatherArgs<'_>, mem: &Mem) -> Result<()> {
    let rb = a
        .format
        .row_bytes(a.dim)
        .ok_or_else(|| exec_err(format!("qgather: dim {} is not a whole number of {} blocks", a.dim, a.format)))?;
    let table = mem.src::<u8>(a.table).map_err(exec_err)?;
    let out = mem.dst::<f32>(a.out).map_err(exec_err)?;
    let id = |i: usize| -> Result<i64> {
        Ok(match a.id_dtype {
            DType::I32 => mem.src::<i32>(a.ids).map_err(exec_err)?.get(i) as i64,
            DType::I64 => mem.src::<i64>(a.ids).map_err(exec_err)?.get(i),
            d => return Err(exec_err(format!("qgather: ids must be i32 or i64, found {d}"))),
        })
    };
    for i in 0..a.n {
        let t = id(i)?;
        if t < 0 || t as u64 >= a.vocab as u64 {
            return Err(exec_err(format!("qgather: id {t} at index {i} is outside the table's 0..{}", a.vocab)));
        }
        let t = t as usize;
        // SAFETY: output row i is written by this iteration alone; the table is a weight.
        let row = unsafe { out.row_mut(i * a.dim, a.dim) };
        quant::dequantize_row(a.format, table.row(t * rb, rb), row).map_err(|e| exec_err(format!("qgather: {e}")))?;
    }
    Ok(())
}
