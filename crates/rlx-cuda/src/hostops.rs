//! Thunks that run on the host, between replay segments. TopK is one: the
//! stream copies x into pinned memory, a host callback (cuLaunchHostFunc)
//! sorts, and the stream copies values and indices back. Everything is
//! enqueued, so `submit` still returns without waiting; the callback splits
//! the schedule into two recorded segments, which is what exercises the
//! segment path.

use half::{bf16, f16};
use rlx_ir::DType;
use rlx_runtime::Result;
use rlx_schedule::Thunk;

use crate::driver::{err, Device, PinnedBuffer};

/// One TopK thunk's staging for one slot.
pub(crate) struct HostTask {
    dtype: DType,
    rows: usize,
    len: usize,
    k: usize,
    x: PinnedBuffer,
    values: PinnedBuffer,
    indices: PinnedBuffer,
}

impl HostTask {
    pub fn for_thunk(dev: &Device, t: &Thunk) -> Result<Option<Box<HostTask>>> {
        let Thunk::TopK { dtype, rows, len, k, .. } = t else { return Ok(None) };
        let es = dtype.size();
        Ok(Some(Box::new(HostTask {
            dtype: *dtype,
            rows: *rows,
            len: *len,
            k: *k,
            x: PinnedBuffer::alloc(dev, rows * len * es)?,
            values: PinnedBuffer::alloc(dev, rows * k * es)?,
            indices: PinnedBuffer::alloc(dev, rows * k * 4)?,
        })))
    }

    /// (x, x bytes, values, values bytes, indices, indices bytes).
    pub fn buffers(&self) -> (*mut u8, usize, *const u8, usize, *const u8, usize) {
        let es = self.dtype.size();
        (
            self.x.as_ptr(),
            self.rows * self.len * es,
            self.values.as_ptr(),
            self.rows * self.k * es,
            self.indices.as_ptr(),
            self.rows * self.k * 4,
        )
    }

    fn load(&self, i: usize) -> f32 {
        let es = self.dtype.size();
        let b = self.x.slice(i * es, es);
        match (self.dtype, b.unwrap_or_default()) {
            (DType::F16, [a, c]) => f16::from_le_bytes([*a, *c]).to_f32(),
            (DType::BF16, [a, c]) => bf16::from_le_bytes([*a, *c]).to_f32(),
            (_, [a, c, d, e]) => f32::from_le_bytes([*a, *c, *d, *e]),
            _ => f32::NAN,
        }
    }

    /// Called by the driver's callback thread once x has arrived. Sorted
    /// descending, ties to the lower index; NaN sorts last.
    pub fn run(&self) {
        let es = self.dtype.size();
        let mut order: Vec<usize> = Vec::with_capacity(self.len);
        let mut vals = vec![0u8; self.k * es];
        let mut idx = vec![0u8; self.k * 4];
        for r in 0..self.rows {
            let row: Vec<f32> = (0..self.len).map(|j| self.load(r * self.len + j)).collect();
            order.clear();
            order.extend(0..self.len);
            let key = |a: &usize, b: &usize| {
                let (x, y) = (row[*a], row[*b]);
                match (x.is_nan(), y.is_nan()) {
                    (true, true) => a.cmp(b),
                    (true, false) => std::cmp::Ordering::Greater,
                    (false, true) => std::cmp::Ordering::Less,
                    _ => y.partial_cmp(&x).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(b)),
                }
            };
            if self.k < self.len {
                order.select_nth_unstable_by(self.k - 1, key);
                order.truncate(self.k);
            }
            order.sort_by(key);
            for (i, &j) in order.iter().take(self.k).enumerate() {
                // x holds rows × len values (sized at prepare), so this is
                // always Some; the check only keeps a callback from panicking.
                if let Some(v) = self.x.slice((r * self.len + j) * es, es) {
                    vals[i * es..(i + 1) * es].copy_from_slice(v);
                }
                idx[i * 4..i * 4 + 4].copy_from_slice(&(j as i32).to_le_bytes());
            }
            write_pinned(&self.values, r * self.k * es, &vals);
            write_pinned(&self.indices, r * self.k * 4, &idx);
        }
    }
}

fn write_pinned(buf: &PinnedBuffer, off: usize, data: &[u8]) {
    // SAFETY: off + len is inside the buffer (sizes set in for_thunk), and
    // stream order guarantees no copy reads it while the callback runs.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.as_ptr().add(off), data.len()) };
}

pub(crate) fn check_sizes(t: &Thunk) -> Result<()> {
    if let Thunk::TopK { k, len, .. } = t {
        if *k == 0 || k > len {
            return Err(err(format!("topk k={k} must be in 1..={len}")));
        }
    }
    Ok(())
}
