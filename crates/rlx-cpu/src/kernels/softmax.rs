//! Softmax over the middle axis of `[outer, len, inner]`, in f32.

use rayon::prelude::*;
use rlx_ir::DType;
use rlx_schedule::BufRef;

use super::lanes;
use crate::elem::{with_float, Elem};
use crate::memory::{Dst, Mem, Src};
use crate::{exec_err, Result};

crate::simd::multiversion! {
    /// In place over one row: exp(x - max) / Σ.
    pub fn softmax_row(v: &mut [f32]) {
        let m = lanes::max(v);
        v.iter_mut().for_each(|x| *x = lanes::exp(*x - m));
        let s = 1.0 / lanes::sum(v);
        v.iter_mut().for_each(|x| *x *= s);
    }
}

pub fn run(dtype: DType, outer: usize, len: usize, inner: usize, x: &BufRef, out: &BufRef, mem: &Mem) -> Result<()> {
    with_float!(dtype, T => rows::<T>(outer, len, inner, mem.src::<T>(x).map_err(exec_err)?, mem.dst::<T>(out).map_err(exec_err)?));
    Ok(())
}

fn rows<T: Elem>(outer: usize, len: usize, inner: usize, x: Src<T>, out: Dst<T>) {
    if len == 0 {
        return;
    }
    (0..outer * inner).into_par_iter().with_min_len((1 << 13) / len + 1).for_each_init(
        || vec![0f32; len],
        |v, line| {
            let (o, i) = (line / inner, line % inner);
            let start = o * len * inner + i;
            if let (true, Some(xf), Some(of)) = (inner == 1, x.as_f32(), out.as_f32()) {
                if !of.same_start(&x) {
                    of.copy_from(start, &xf, start, len);
                }
                // SAFETY: this line belongs to this task alone; x was copied in above.
                softmax_row(unsafe { of.row_mut(start, len) });
                return;
            }
            x.load_strided(start, inner, v);
            softmax_row(v);
            if inner == 1 {
                out.store(start, v);
            } else {
                for (j, val) in v.iter().enumerate() {
                    out.set(start + j * inner, T::from_f32(*val));
                }
            }
        },
    );
}
