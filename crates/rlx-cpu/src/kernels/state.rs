//! WriteState: rows appended to a persistent `[batch, max_rows, width]`
//! state at a position read from an i32 device scalar (e.g. a KV cache).
//! A float value of another float dtype is rounded to the state's.

use rlx_ir::DType;
use rlx_schedule::BufRef;

use crate::elem::with_float;
use crate::memory::Mem;
use crate::{exec_err, Result};

pub struct WriteStateArgs<'a> {
    /// The state's dtype.
    pub dtype: DType,
    /// The value's dtype: the state's, or (both floats) one converted to it.
    pub value_dtype: DType,
    pub batch: usize,
    pub max_rows: usize,
    pub new_rows: usize,
    pub width: usize,
    pub state: &'a BufRef,
    pub value: &'a BufRef,
    pub position: &'a BufRef,
    /// One position per batch row rather than one for all.
    pub positions_per_batch: bool,
    /// Elements between the value's batch rows and between its rows
    /// (`new_rows * width` and `width` when dense).
    pub value_batch_stride: usize,
    pub value_row_stride: usize,
}

pub fn run(a: &WriteStateArgs<'_>, mem: &Mem) -> Result<()> {
    let positions = mem.src::<i32>(a.position).map_err(exec_err)?;
    let state = mem.dst::<u8>(a.state).map_err(exec_err)?;
    let value = mem.src::<u8>(a.value).map_err(exec_err)?;
    let es = a.dtype.size();
    let row = a.width * es;
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
    if a.value_dtype != a.dtype {
        return write_converted(a, mem, &pos_of);
    }
    // Rows next to each other in the value move as one block.
    let (rows_per_copy, copies) = if a.value_row_stride == a.width { (a.new_rows, 1) } else { (1, a.new_rows) };
    for b in 0..a.batch {
        for s in 0..copies {
            let src = (b * a.value_batch_stride + s * a.value_row_stride) * es;
            state.copy_from((b * a.max_rows + pos_of(b) as usize + s) * row, &value, src, rows_per_copy * row);
        }
    }
    Ok(())
}

/// The write of a float value into a float state of another dtype, row by
/// row through f32 (positions already checked).
fn write_converted(a: &WriteStateArgs<'_>, mem: &Mem, pos_of: &dyn Fn(usize) -> i32) -> Result<()> {
    if !(a.dtype.is_float() && a.value_dtype.is_float()) {
        return Err(exec_err(format!("write_state: a {} value cannot be written into a {} state", a.value_dtype, a.dtype)));
    }
    let mut row = vec![0.0f32; a.width];
    with_float!(a.value_dtype, V => {
        let value = mem.src::<V>(a.value).map_err(exec_err)?;
        with_float!(a.dtype, S => {
            let state = mem.dst::<S>(a.state).map_err(exec_err)?;
            for b in 0..a.batch {
                for s in 0..a.new_rows {
                    value.load(b * a.value_batch_stride + s * a.value_row_stride, &mut row);
                    state.store((b * a.max_rows + pos_of(b) as usize + s) * a.width, &row);
                }
            }
        })
    });
    Ok(())
}
