//! Reduce (sum, mean, max) and ArgMax over the middle axis of
//! `[outer, len, inner]`, accumulating in f32.

use rayon::prelude::*;
use rlx_ir::{DType, ReduceOp};
use rlx_schedule::BufRef;

use super::lanes;
use crate::elem::{read_int, with_float, Elem};
use crate::memory::{Dst, Mem, Src};
use crate::{exec_err, Result};

#[allow(clippy::too_many_arguments)]
pub fn reduce(op: ReduceOp, dtype: DType, outer: usize, len: usize, inner: usize, x: &BufRef, out: &BufRef, mem: &Mem) -> Result<()> {
    with_float!(dtype, T => reduce_t::<T>(op, outer, len, inner, mem.src::<T>(x).map_err(exec_err)?, mem.dst::<T>(out).map_err(exec_err)?));
    Ok(())
}

fn reduce_t<T: Elem>(op: ReduceOp, outer: usize, len: usize, inner: usize, x: Src<T>, out: Dst<T>) {
    (0..outer * inner).into_par_iter().with_min_len((1 << 13) / len.max(1) + 1).for_each_init(
        || vec![0f32; len],
        |v, line| {
            let (o, i) = (line / inner, line % inner);
            x.load_strided(o * len * inner + i, inner, v);
            let r = reduce_line(op, v);
            out.set(line, T::from_f32(r));
        },
    );
}

/// out[b, d] = Σ_s x[b, s, d]·mask[b, s] / max(Σ_s mask[b, s], 1e-9) for
/// x `[batch, seq, dim]` (`Op::MaskedMean`): per batch row, the masked rows
/// summed in f32 in sequence order. The mask and the output may be any
/// float type (the mask is widened to f32 first: batch x seq values).
#[allow(clippy::too_many_arguments)]
pub fn masked_mean(
    dtype: DType,
    mask_dtype: DType,
    out_dtype: DType,
    [batch, seq, dim]: [usize; 3],
    x: &BufRef,
    mask: &BufRef,
    out: &BufRef,
    mem: &Mem,
) -> Result<()> {
    let mut m = vec![0f32; batch * seq];
    with_float!(mask_dtype, M => mem.src::<M>(mask).map_err(exec_err)?.load(0, &mut m));
    with_float!(dtype, T => {
        let x = mem.src::<T>(x).map_err(exec_err)?;
        with_float!(out_dtype, O => masked_mean_t::<T, O>([batch, seq, dim], x, &m, mem.dst::<O>(out).map_err(exec_err)?));
    });
    Ok(())
}

fn masked_mean_t<T: Elem, O: Elem>([batch, seq, dim]: [usize; 3], x: Src<T>, mask: &[f32], out: Dst<O>) {
    (0..batch).into_par_iter().for_each_init(
        || (vec![0f32; dim], vec![0f32; dim]),
        |(acc, row), b| {
            acc.fill(0.0);
            let mut count = 0f32;
            for s in 0..seq {
                let m = mask[b * seq + s];
                count += m;
                if m != 0.0 {
                    x.load((b * seq + s) * dim, row);
                    axpy(acc, row, m);
                }
            }
            let inv = 1.0 / count.max(1e-9);
            acc.iter_mut().for_each(|a| *a *= inv);
            out.store(b * dim, acc);
        },
    );
}

crate::simd::multiversion! {
    /// acc += m · v, fused multiply-adds where the CPU has them (a plain
    /// `mul_add` in the crate's baseline build is a libm call per element:
    /// the pooling of MiniLM at 8×128 took 0.43 ms that way).
    fn axpy(acc: &mut [f32], v: &[f32], m: f32) {
        acc.iter_mut().zip(v).for_each(|(a, x)| *a = x.mul_add(m, *a));
    }
}

pub fn argmax(dtype: DType, outer: usize, len: usize, inner: usize, x: &BufRef, out: &BufRef, mem: &Mem) -> Result<()> {
    let o = mem.dst::<i32>(out).map_err(exec_err)?;
    if dtype.is_int() {
        // Ids and counts: compared exactly as i64; ties to the lowest index.
        let x = mem.src::<u8>(x).map_err(exec_err)?;
        for line in 0..outer * inner {
            let (ob, i) = (line / inner, line % inner);
            let at = |j: usize| read_int(&x, dtype, (ob * len + j) * inner + i);
            let best = (1..len).fold(0usize, |b, j| if at(j) > at(b) { j } else { b });
            o.set(line, best as i32);
        }
        return Ok(());
    }
    with_float!(dtype, T => argmax_t::<T>(outer, len, inner, mem.src::<T>(x).map_err(exec_err)?, o));
    Ok(())
}

/// Ties go to the lowest index; NaN never wins.
fn argmax_t<T: Elem>(outer: usize, len: usize, inner: usize, x: Src<T>, out: Dst<i32>) {
    (0..outer * inner).into_par_iter().with_min_len((1 << 13) / len.max(1) + 1).for_each_init(
        || vec![0f32; len],
        |v, line| {
            let (o, i) = (line / inner, line % inner);
            x.load_strided(o * len * inner + i, inner, v);
            let mut best = 0usize;
            let mut bv = f32::NEG_INFINITY;
            for (j, &val) in v.iter().enumerate() {
                if val > bv {
                    bv = val;
                    best = j;
                }
            }
            out.set(line, best as i32);
        },
    );
}

crate::simd::multiversion! {
    fn reduce_line(op: ReduceOp, v: &[f32]) -> f32 {
        match op {
            ReduceOp::Sum => lanes::sum(v),
            ReduceOp::Mean => lanes::sum(v) / v.len().max(1) as f32,
            // Max of an empty axis is -inf (the identity).
            ReduceOp::Max => lanes::max(v),
        }
    }
}
