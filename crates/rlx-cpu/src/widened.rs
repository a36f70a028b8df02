//! Prepared matmul weights (f32 copies of half-precision weights, and the
//! packed matmul kernel's layout), shared process-wide.
//!
//! The matmul kernels read f16/bf16 weights through an f32 copy made at
//! prepare. Every shape bucket of a model is its own executable, so without
//! sharing each bucket held its own copy: 4 bytes per parameter per bucket
//! on top of the 2-byte weights. Copies are keyed by the store's tensor
//! (pointer identity, checked through a weak reference so a freed tensor's
//! address cannot be mistaken for a live one) and the byte range read; an
//! entry lives as long as some executable holds the copy. Each copy is made
//! under its entry's own lock, so prepares of other weights (another model
//! loading on another thread) do not wait for it.

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
    /// The copy, made under this entry's own lock: a second request for the
    /// same weight waits for it, requests for other weights do not.
    copy: Arc<Mutex<Weak<Vec<f32>>>>,
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
    let cell = {
        // Entries are plain data, so a panic elsewhere cannot leave them torn.
        let mut g = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        // An entry stays while its tensor lives and its copy lives or is
        // being made (someone holds its cell).
        g.retain(|e| {
            e.tensor.strong_count() > 0 && (Arc::strong_count(&e.copy) > 1 || e.copy.lock().map(|w| w.strong_count() > 0).unwrap_or(false))
        });
        let found = g.iter().find(|e| {
            e.dtype == dtype
                && e.layout == layout
                && e.offset == offset
                && e.elems == elems
                && e.tensor.upgrade().is_some_and(|t| Arc::ptr_eq(&t, tensor))
        });
        match found {
            Some(e) => e.copy.clone(),
            None => {
                let cell = Arc::new(Mutex::new(Weak::new()));
                g.push(Entry { tensor: Arc::downgrade(tensor), dtype, offset, elems, layout, copy: cell.clone() });
                cell
            }
        }
    };
    // The global list is unlocked: only requests for this weight wait here.
    let mut slot = cell.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = slot.upgrade() {
        return Ok(c);
    }
    let copy = Arc::new(make()?);
    *slot = Arc::downgrade(&copy);
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

    /// While one weight's copy is being made, a request for another weight
    /// completes (prepares of different models do not wait for each other).
    #[test]
    fn making_one_copy_does_not_block_another_weight() {
        use std::sync::mpsc;
        use std::time::Duration;
        let (t1, t2) = (half(&[1.0, 2.0]), half(&[3.0, 4.0]));
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (started_tx, started_rx) = mpsc::channel::<()>();
        let slow_t = t1.clone();
        let slow = std::thread::spawn(move || {
            shared(&slow_t, DType::BF16, 0, 2, [0; 3], || {
                let _ = started_tx.send(());
                // Held until the other request has finished (or 10 s).
                let _ = go_rx.recv_timeout(Duration::from_secs(10));
                Ok(vec![1.0, 2.0])
            })
            .map(|c| c.len())
        });
        started_rx.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|e| panic!("slow make never started: {e}"));
        let (done_tx, done_rx) = mpsc::channel();
        let fast_t = t2.clone();
        std::thread::spawn(move || {
            let r = shared(&fast_t, DType::BF16, 0, 2, [0; 3], || Ok(vec![3.0, 4.0])).map(|c| c.len());
            let _ = done_tx.send(r.ok());
        });
        let fast = done_rx.recv_timeout(Duration::from_secs(5));
        let _ = go_tx.send(());
        assert_eq!(fast.ok().flatten(), Some(2), "the other weight's copy waited for the slow one");
        assert_eq!(slow.join().ok().and_then(|r| r.ok()), Some(2));
    }
}
