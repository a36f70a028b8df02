//! Embedding lookup: out[i, :] = table[ids[i], :].

use rayon::prelude::*;
use rlx_ir::DType;
use rlx_schedule::BufRef;

use crate::elem::read_int;
use crate::memory::{Mem, Src};
use crate::{exec_err, Result};

pub struct GatherArgs<'a> {
    pub dtype: DType,
    pub id_dtype: DType,
    pub n: usize,
    pub dim: usize,
    pub vocab: usize,
    pub table: &'a BufRef,
    pub ids: &'a BufRef,
    pub out: &'a BufRef,
}

pub fn run(a: &GatherArgs<'_>, mem: &Mem) -> Result<()> {
    let ids = mem.src::<u8>(a.ids).map_err(exec_err)?;
    let table = mem.src::<u8>(a.table).map_err(exec_err)?;
    let out = mem.dst::<u8>(a.out).map_err(exec_err)?;
    check_ids("gather", &ids, a.id_dtype, a.n, a.vocab)?;
    let row = a.dim * a.dtype.size();
    (0..a.n).into_par_iter().with_min_len((1 << 16) / row.max(1) + 1).for_each(|i| {
        let id = read_int(&ids, a.id_dtype, i) as usize;
        out.copy_from(i * row, &table, id * row, row);
    });
    Ok(())
}

/// Every one of the first `n` ids lies in 0..vocab; checked before anything
/// is written, so an error leaves no partial rows. `what` names the op.
pub(super) fn check_ids(what: &str, ids: &Src<u8>, id_dtype: DType, n: usize, vocab: usize) -> Result<()> {
    for i in 0..n {
        let id = read_int(ids, id_dtype, i);
        if id < 0 || id as u64 >= vocab as u64 {
            return Err(exec_err(format!("{what}: id {id} at position {i} is outside the vocabulary (size {vocab})")));
        }
    }
    Ok(())
}
