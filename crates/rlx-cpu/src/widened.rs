//! Prepared matmul weights (f32 copies of half-precision weights, and the
//! few-row kernel's packed layout), shared process-wide.
//!
//! The matmul kernels read f16/bf16 weights through an f32 copy made at
//! prepare. Every shape bucket of a model is its own executable, so without
//! sharing each bucket held its own copy: 4 bytes per parameter per bucket
//! on top of the 2-byte weights. Copies are keyed by the store's tensor
//! (pointer identity, checked through a weak reference so a freed tensor's
//! address cannot be mistaken for a live one) and the byte range read; an
//! entry lives as long as some executable holds the copy.

use std::sync::{Arc, Mutex, Weak};

use rlx_ir::DType;
use rlx_runtime::Tensor;

use crate::Result;

struct Entry {
    tensor: Weak<Tensor>,
    /// The element type the bytes are read as.
    dtype: DType,
    offset: u64,
    elems: usize,
    /// [0, 0, 0] for a plain copy; [n, k, ldb] for the packed layout.
    layout: [usize; 3],
    copy: Weak<Vec<f32>>,
}

static SHARED: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// The f32 copy of `elems` values of `tensor` read as `dtype` from byte
/// `offset`, made by `make` unless a live one exists.
pub fn shared(
    tensor: &Arc<Tensor>,
    dtype: DType,
    offset: u64,
    elems: usize,
    layout: [usize; 3],
    make: impl FnOnce() -> Result<Vec<f32>>,
) -> Result<Arc<Vec<f32>>> {
    // Entries are plain data, so a panic elsewhere cannot leave them torn.
    let mut g = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    g.retain(|e| e.tensor.strong_count() > 0 && e.copy.strong_count() > 0);
    let hit = g.iter().find_map(|e| {
        let same = e.dtype == dtype
            && e.layout == layout
            && e.offset == offset
            && e.elems == elems
            && e.tensor.upgrade().is_some_and(|t| Arc::ptr_eq(&t, tensor));
        if same {
            e.copy.upgrade()
        } else {
            None
        }
    });
    if let Some(c) = hit {
        return Ok(c);
    }
    let copy = Arc::new(make()?);
    g.push(Entry { tensor: Arc::downgrade(tensor), dtype, offset, elems, layout, copy: Arc::downgrade(&copy) });
    Ok(copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn half(vals: &[f32]) -> Arc<Tensor> {
        Arc::new(Tensor::from_f32(vec![vals.len()], vals).unwrap_or_else(|e| panic!("{e}")).to_dtype(DType::BF16))
    }

    #[test]
    fn same_tensor_and_range_share_one_copy() {
        let t = half(&[1.0, -2.0, 3.5, 0.25]);
        let made = std::cell::Cell::new(0);
        let mk = || -> Result<Vec<f32>> {
            made.set(made.get() + 1);
            Ok(t.to_f32())
        };
        let a = shared(&t, DType::BF16, 0, 4, [0; 3], mk).unwrap_or_else(|e| panic!("{e}"));
        let b = shared(&t, DType::BF16, 0, 4, [0; 3], mk).unwrap_or_else(|e| panic!("{e}"));
        assert!(Arc::ptr_eq(&a, &b));
        // Another range of the same tensor, and an equal-valued other tensor,
        // get copies of their own.
        let c = shared(&t, DType::BF16, 2, 2, [0; 3], mk).unwrap_or_else(|e| panic!("{e}"));
        let u = half(&[1.0, -2.0, 3.5, 0.25]);
        let d = shared(&u, DType::BF16, 0, 4, [0; 3], mk).unwrap_or_else(|e| panic!("{e}"));
        assert!(!Arc::ptr_eq(&a, &c) && !Arc::ptr_eq(&a, &d));
        assert_eq!(made.get(), 3);
        assert_eq!(*a, vec![1.0, -2.0, 3.5, 0.25]);
        // Once every holder is gone the next request makes a new copy.
        drop((a, b));
        let e = shared(&t, DType::BF16, 0, 4, [0; 3], mk).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((made.get(), e.len()), (4, 4));
    }
}
