//! LayerNorm and RmsNorm over rows, with an optional residual added first;
//! and LayerNorm over embedding rows gathered by id plus repeating addends.
//! Two passes over the row in f32: mean, then variance of the deviations
//! (more accurate than E[x²] - E[x]² when the mean is large).

use rayon::prelude::*;
use rlx_ir::DType;
use rlx_schedule::BufRef;

use super::lanes;
use crate::elem::{read_int, with_float, Elem};
use crate::memory::{Dst, Mem, Src};
use crate::{exec_err, Result};

pub struct NormArgs<'a> {
    pub rms: bool,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
    pub x: &'a BufRef,
    pub residual: Option<&'a BufRef>,
    pub gamma: &'a BufRef,
    pub beta: Option<&'a BufRef>,
    pub out: &'a BufRef,
}

pub fn run(a: &NormArgs<'_>, mem: &Mem) -> Result<()> {
    with_float!(a.dtype, T => {
        let x = mem.src::<T>(a.x).map_err(exec_err)?;
        let res = a.residual.map(|r| mem.src::<T>(r)).transpose().map_err(exec_err)?;
        let gamma = load_param::<T>(mem, a.gamma, a.cols)?;
        let beta = a.beta.map(|b| load_param::<T>(mem, b, a.cols)).transpose()?;
        let out = mem.dst::<T>(a.out).map_err(exec_err)?;
        rows::<T>(a, x, res, &gamma, beta.as_deref(), out);
    });
    Ok(())
}

/// Arguments of [`embed`] (`Thunk::EmbedNorm`).
pub struct EmbedArgs<'a> {
    pub dtype: DType,
    pub id_dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub vocab: usize,
    pub eps: f32,
    pub table: &'a BufRef,
    pub ids: &'a BufRef,
    /// (buffer, its rows R): row r adds addend row r % R.
    pub addends: &'a [(BufRef, usize)],
    pub gamma: &'a BufRef,
    pub beta: &'a BufRef,
    pub out: &'a BufRef,
}

/// LayerNorm(table[ids[r]] + Σ addend rows) per row, in f32. Every id is
/// checked before anything is written (as the gather does).
pub fn embed(a: &EmbedArgs<'_>, mem: &Mem) -> Result<()> {
    let ids = mem.src::<u8>(a.ids).map_err(exec_err)?;
    super::gather::check_ids("embedding", &ids, a.id_dtype, a.rows, a.vocab)?;
    with_float!(a.dtype, T => {
        let table = mem.src::<T>(a.table).map_err(exec_err)?;
        let adds = a.addends.iter().map(|(b, n)| mem.src::<T>(b).map(|s| (s, (*n).max(1)))).collect::<std::result::Result<Vec<_>, _>>().map_err(exec_err)?;
        let gamma = load_param::<T>(mem, a.gamma, a.cols)?;
        let beta = load_param::<T>(mem, a.beta, a.cols)?;
        let out = mem.dst::<T>(a.out).map_err(exec_err)?;
        let cols = a.cols;
        let inv_n = 1.0 / cols.max(1) as f32;
        (0..a.rows).into_par_iter().with_min_len((1 << 13) / cols.max(1) + 1).for_each_init(
            || (vec![0f32; cols], vec![0f32; cols]),
            |(v, t), r| {
                let id = read_int(&ids, a.id_dtype, r) as usize;
                table.load(id * cols, v);
                for (s, n) in &adds {
                    s.load((r % n) * cols, t);
                    v.iter_mut().zip(t.iter()).for_each(|(x, y)| *x += y);
                }
                norm_row(v, None, &gamma, Some(&beta), a.eps, false, inv_n);
                out.store(r * cols, v);
            },
        );
    });
    Ok(())
}

/// gamma / beta widened to f32 once per call (a few KB).
fn load_param<T: Elem>(mem: &Mem, b: &BufRef, cols: usize) -> Result<Vec<f32>> {
    let s = mem.src::<T>(b).map_err(exec_err)?;
    let mut v = vec![0f32; cols];
    s.load(0, &mut v);
    Ok(v)
}

fn rows<T: Elem>(a: &NormArgs<'_>, x: Src<T>, res: Option<Src<T>>, gamma: &[f32], beta: Option<&[f32]>, out: Dst<T>) {
    let cols = a.cols;
    let inv_n = 1.0 / cols.max(1) as f32;
    (0..a.rows).into_par_iter().with_min_len((1 << 13) / cols.max(1) + 1).for_each_init(
        || (vec![0f32; cols], vec![0f32; cols]),
        |(v, t), r| {
            // f32: x (+ residual) read in place into v, then normalised
            // straight into the output row (no library copies; out may be x
            // or the residual itself: both are read before out is written).
            if let (Some(xf), Some(of)) = (x.as_f32(), out.as_f32()) {
                let rf = res.as_ref().and_then(|r| r.as_f32());
                add_into(xf.row(r * cols, cols), rf.as_ref().map(|s| s.row(r * cols, cols)), v);
                // SAFETY: row r belongs to this task; x and the residual were read into v first.
                norm_to(v, unsafe { of.row_mut(r * cols, cols) }, gamma, beta, a.eps, a.rms, inv_n);
                return;
            }
            let residual = match &res {
                Some(res) => {
                    res.load(r * cols, t);
                    Some(&t[..])
                }
                None => None,
            };
            x.load(r * cols, v);
            norm_row(v, residual, gamma, beta, a.eps, a.rms, inv_n);
            out.store(r * cols, v);
        },
    );
}

crate::simd::multiversion! {
    /// v = x (+ residual).
    fn add_into(x: &[f32], residual: Option<&[f32]>, v: &mut [f32]) {
        match residual {
            Some(t) => v.iter_mut().zip(x).zip(t).for_each(|((o, a), b)| *o = a + b),
            None => v.copy_from_slice(x),
        }
    }
}

/// out = RmsNorm(v) · gamma, the RmsNorm kernel's arithmetic (fused
/// quantized matmuls reuse it, so fusing does not change a bit).
pub(crate) fn rms_to(v: &[f32], out: &mut [f32], gamma: &[f32], eps: f32) {
    norm_to(v, out, gamma, None, eps, true, 1.0 / v.len().max(1) as f32)
}

crate::simd::multiversion! {
    /// out = LayerNorm or RmsNorm of v (v is not changed).
    fn norm_to(v: &[f32], out: &mut [f32], gamma: &[f32], beta: Option<&[f32]>, eps: f32, rms: bool, inv_n: f32) {
        if rms {
            let ms = lanes::sum_sq_dev(v, 0.0) * inv_n;
            let s = 1.0 / (ms + eps).sqrt();
            out.iter_mut().zip(v).zip(gamma).for_each(|((o, x), g)| *o = *x * s * g);
        } else {
            let mean = lanes::sum(v) * inv_n;
            let var = lanes::sum_sq_dev(v, mean) * inv_n;
            let s = 1.0 / (var + eps).sqrt();
            match beta {
                Some(beta) => out.iter_mut().zip(v).zip(gamma).zip(beta).for_each(|(((o, x), g), b)| *o = (*x - mean) * s * g + b),
                None => out.iter_mut().zip(v).zip(gamma).for_each(|((o, x), g)| *o = (*x - mean) * s * g),
            }
        }
    }
}

crate::simd::multiversion! {
    /// One row in place: (+ residual), then LayerNorm or RmsNorm.
    fn norm_row(v: &mut [f32], residual: Option<&[f32]>, gamma: &[f32], beta: Option<&[f32]>, eps: f32, rms: bool, inv_n: f32) {
        if let Some(t) = residual {
            v.iter_mut().zip(t).for_each(|(a, b)| *a += b);
        }
        if rms {
            let ms = lanes::sum_sq_dev(v, 0.0) * inv_n;
            let s = 1.0 / (ms + eps).sqrt();
            v.iter_mut().zip(gamma).for_each(|(x, g)| *x = *x * s * g);
        } else {
            let mean = lanes::sum(v) * inv_n;
            let var = lanes::sum_sq_dev(v, mean) * inv_n;
            let s = 1.0 / (var + eps).sqrt();
            match beta {
                Some(beta) => v.iter_mut().zip(gamma).zip(beta).for_each(|((x, g), b)| *x = (*x - mean) * s * g + b),
                None => v.iter_mut().zip(gamma).for_each(|(x, g)| *x = (*x - mean) * s * g),
            }
        }
    }
}
