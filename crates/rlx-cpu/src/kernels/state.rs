//! WriteState: rows appended to a persistent `[batch, max_rows, width]`
//! state at a position read from an i32 device scalar (e.g. a KV cache).

use rlx_compile::BufRef;
use rlx_ir::DType;

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
}

pub fn run(a: &WriteStateArgs<'_>, mem: &Mem) -> Result<()> {
    let pos = mem.src::<i32>(a.position).map_err(exec_err)?.get(0);
    if pos < 0 || pos as u64 + a.new_rows as u64 > a.max_rows as u64 {
        return Err(exec_err(format!(
            "write_state: writing {} rows at position {pos} does not fit a state of {} rows",
            a.new_rows, a.max_rows
        )));
    }
    let state = mem.dst::<u8>(a.state).map_err(exec_err)?;
    let value = mem.src::<u8>(a.value).map_err(exec_err)?;
    let row = a.width * a.dtype.size();
    let block = a.new_rows * row;
    for b in 0..a.batch {
        state.copy_from((b * a.max_rows + pos as usize) * row, &value, b * block, block);
    }
    Ok(())
}
