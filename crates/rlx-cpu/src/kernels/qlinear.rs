//! Thunks over block-quantized weights: the matmul reads the GGUF blocks as
//! stored (`quant::matmul`), the embedding lookup dequantises only the rows
//! it gathers.

use rlx_ir::{DType, QFormat};
use rlx_schedule::BufRef;

use super::quant;
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
}

pub fn matmul(a: &QMatMulArgs<'_>, mem: &Mem) -> Result<()> {
    let row_bytes =
        a.format.row_bytes(a.k).ok_or_else(|| exec_err(format!("qmatmul: K = {} is not a whole number of {} blocks", a.k, a.format)))?;
    if a.rows == 0 || a.n == 0 {
        return Ok(());
    }
    let lda = a.lda as usize;
    let a_len = (a.rows - 1) * lda + a.k;
    let x = mem.src::<f32>(a.a).map_err(exec_err)?;
    let w = mem.src::<u8>(a.w).map_err(exec_err)?;
    let out = mem.dst::<f32>(a.out).map_err(exec_err)?;
    // SAFETY: the output buffer is disjoint from a and w (operand checks at prepare) and this call is its only user.
    let out = unsafe { out.row_mut(0, a.rows * a.n) };
    quant::matmul(a.format, a.rows, a.n, a.k, x.row(0, a_len), lda, w.row(0, a.n * row_bytes), out, a.n)
        .map_err(|e| exec_err(format!("qmatmul: {e}")))
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
