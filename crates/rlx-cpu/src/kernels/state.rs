//! WriteState: rows appended to a persistent `[batch, max_rows, width]`
//! state at a position read from an i32 device scalar (e.g. a KV cache).

use rlx_ir::DType;
use rlx_schedule::BufRef;

use crate::memory::Mem;
use crate::{exec_err, Result};

pub struct WriteStateArgs<'a> {
    pub dtype: DType,
    pub batch: usize,
    pub max_rows: usize,
    pub new_rows: usize,
    pub width: usize,
    pub state: &'a BufRef,
    pub value: &'a BufRef,
    pub position: &'a BufRef,
    /// One position per batch row rather than one for all.
    pub positions_per_batch: bool,
}

pub fn run(a: &WriteStateArgs<'_>, mem: &Mem) -> Result<()> {
    let positions = mem.src::<i32>(a.position).map_err(exec_err)?;
    let state = mem.dst::<u8>(a.state).map_err(exec_err)?;
    let value = mem.src::<u8>(a.value).map_err(exec_err)?;
    let row = a.width * a.dtype.size();
    let block = a.new_rows * row;
    // Check every row's position before writing any, so a bad one leaves
    // the state as it was.
    let pos_of = |b: usize| positions.get(if a.positions_per_batch { b } else { 0 });
    for b in 0..a.batch {
        let pos = pos_of(b);
        if pos < 0 || pos as u64 + a.new_rows as u64 > a.max_rows as u64 {
            return Err(exec_err(format!(
                "write_state: writing {} rows at position {pos} (batch row {b}) does not fit a state of {} rows",
                a.new_rows, a.max_rows
            )));
        }
    }
    for b in 0..a.batch {
        state.copy_from((b * a.max_rows + pos_of(b) as usize) * row, &value, b * block, block);
    }
    Ok(())
}
