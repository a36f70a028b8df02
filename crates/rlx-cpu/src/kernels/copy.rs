//! Strided copy of any dtype (narrow, transpose, concat parts).

use rayon::prelude::*;
use rlx_ir::DType;
use rlx_schedule::BufRef;

use crate::memory::{Dst, Mem, Src};
use crate::{exec_err, Result};

pub fn run(dtype: DType, shape: &[usize], src: &BufRef, src_strides: &[u64], dst: &BufRef, dst_strides: &[u64], mem: &Mem) -> Result<()> {
    // Elements move as opaque words of their size.
    match dtype.size() {
        2 => copy_t::<u16>(shape, mem.src(src).map_err(exec_err)?, src_strides, mem.dst(dst).map_err(exec_err)?, dst_strides),
        4 => copy_t::<u32>(shape, mem.src(src).map_err(exec_err)?, src_strides, mem.dst(dst).map_err(exec_err)?, dst_strides),
        8 => copy_t::<u64>(shape, mem.src(src).map_err(exec_err)?, src_strides, mem.dst(dst).map_err(exec_err)?, dst_strides),
        s => return Err(exec_err(format!("copy: unsupported element size {s}"))),
    }
    Ok(())
}

fn copy_t<T: Copy + Send + Sync>(shape: &[usize], src: Src<T>, ss: &[u64], dst: Dst<T>, ds: &[u64]) {
    let total: usize = shape.iter().product();
    if total == 0 {
        return;
    }
    let r = shape.len();
    let inner = if r == 0 { 1 } else { shape[r - 1] };
    let (si, di) = if r == 0 { (1, 1) } else { (ss[r - 1] as usize, ds[r - 1] as usize) };
    let outer = &shape[..r.saturating_sub(1)];
    let rows = total / inner;
    let offsets = |row: usize| {
        let (mut rem, mut so, mut dof) = (row, 0usize, 0usize);
        for d in (0..outer.len()).rev() {
            let idx = rem % outer[d];
            rem /= outer[d];
            so += idx * ss[d] as usize;
            dof += idx * ds[d] as usize;
        }
        (so, dof)
    };
    (0..rows).into_par_iter().with_min_len((1 << 14) / inner + 1).for_each(|row| {
        let (so, dof) = offsets(row);
        if si == 1 && di == 1 {
            dst.copy_from(dof, &src, so, inner);
        } else {
            for j in 0..inner {
                dst.set(dof + j * di, src.get(so + j * si));
            }
        }
    });
}
