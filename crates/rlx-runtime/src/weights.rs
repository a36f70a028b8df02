use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use rlx_ir::{DType, Shape};
use rlx_schedule::WeightSlot;

use crate::{Result, RuntimeError, Tensor};

static NEXT_STORE_ID: AtomicU64 = AtomicU64::new(1);

/// Every param of a model, once. Shared (`Arc`) by every executable compiled
/// from the model; backends keep their device copies keyed by [`id`] and
/// refresh them when [`version`] changes.
///
/// [`id`]: WeightStore::id
/// [`version`]: WeightStore::version
#[derive(Debug)]
pub struct WeightStore {
    id: u64,
    inner: RwLock<Inner>,
}

/// (parts, concat axis, dtype) -> the resolved tensor and the newest part version it was built from.
type Derived = HashMap<(Vec<String>, usize, DType), (Arc<Tensor>, u64)>;

#[derive(Debug, Default)]
struct Inner {
    params: HashMap<String, (Arc<Tensor>, u64)>,
    /// Concatenated / converted forms asked for by schedules.
    derived: Derived,
    version: u64,
}

impl Default for WeightStore {
    fn default() -> Self {
        Self::new()
    }
}

fn poisoned<T>(_: T) -> RuntimeError {
    RuntimeError::Weight { name: "*".into(), detail: "weight store lock poisoned by a panic elsewhere".into() }
}

impl WeightStore {
    pub fn new() -> Self {
        WeightStore { id: NEXT_STORE_ID.fetch_add(1, Ordering::Relaxed), inner: RwLock::default() }
    }

    /// Unique per store: the key under which backends cache device copies.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bumped by every change; a backend that saw an older version refreshes.
    pub fn version(&self) -> u64 {
        // A writer that panicked left the data consistent (set() swaps whole
        // entries), so a poisoned lock still reports the real version.
        self.inner.read().map(|g| g.version).unwrap_or_else(|p| p.into_inner().version)
    }

    /// Adds or replaces a param. Replacing requires the same shape (the
    /// data may come in another float dtype; it is converted where used).
    /// `U8` params hold block-quantized rows, read as stored.
    pub fn set(&self, name: &str, tensor: Tensor) -> Result<()> {
        if !tensor.dtype().is_float() && tensor.dtype() != DType::U8 {
            return Err(RuntimeError::Weight {
                name: name.into(),
                detail: format!("weights must be f32, f16, bf16 or u8 (quantized blocks), found {}", tensor.dtype()),
            });
        }
        let mut g = self.inner.write().map_err(poisoned)?;
        if let Some((old, _)) = g.params.get(name) {
            if old.shape() != tensor.shape() {
                return Err(RuntimeError::Weight {
                    name: name.into(),
                    detail: format!("has shape {}, new data has shape {}", old.shape(), tensor.shape()),
                });
            }
        }
        g.version += 1;
        let v = g.version;
        g.params.insert(name.to_string(), (Arc::new(tensor), v));
        Ok(())
    }

    /// Sets a param from f32 values with the given shape.
    pub fn set_f32(&self, name: &str, shape: impl Into<Shape>, values: &[f32]) -> Result<()> {
        let t = Tensor::from_f32(shape, values).map_err(|e| RuntimeError::Weight { name: name.into(), detail: e.to_string() })?;
        self.set(name, t)
    }

    pub fn get(&self, name: &str) -> Option<Arc<Tensor>> {
        self.inner.read().ok()?.params.get(name).map(|(t, _)| t.clone())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.inner.read().map(|g| g.params.contains_key(name)).unwrap_or(false)
    }

    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.inner.read().map(|g| g.params.keys().cloned().collect()).unwrap_or_default();
        v.sort();
        v
    }

    /// Total bytes of the params as stored.
    pub fn bytes(&self) -> u64 {
        self.inner.read().map(|g| g.params.values().map(|(t, _)| t.bytes().len() as u64).sum()).unwrap_or(0)
    }

    /// The tensor a schedule's weight slot refers to: its parts concatenated
    /// and converted to the slot's dtype, checked against the slot's shape.
    /// Cached until one of its parts changes.
    pub fn resolve(&self, slot: &WeightSlot) -> Result<Arc<Tensor>> {
        let key = (slot.parts.clone(), slot.concat_axis, slot.dtype);
        let mut parts = Vec::with_capacity(slot.parts.len());
        let mut newest = 0;
        {
            let g = self.inner.read().map_err(poisoned)?;
            for p in &slot.parts {
                let (t, v) = g.params.get(p).ok_or_else(|| RuntimeError::Weight {
                    name: p.clone(),
                    detail: format!("missing: the graph needs it as {} {} and it was never set", slot.shape, slot.dtype),
                })?;
                newest = newest.max(*v);
                parts.push(t.clone());
            }
            if let Some((t, v)) = g.derived.get(&key) {
                if *v >= newest {
                    return Ok(t.clone());
                }
            }
        }
        // A single part already in the slot's dtype and shape is the stored
        // tensor itself: share it, so every executable (every shape bucket)
        // points at one copy instead of cloning the weights.
        if parts.len() == 1 && parts[0].dtype() == slot.dtype && parts[0].shape() == &slot.shape {
            return Ok(parts[0].clone());
        }
        let built = Arc::new(build(slot, &parts)?);
        let mut g = self.inner.write().map_err(poisoned)?;
        g.derived.insert(key, (built.clone(), newest));
        Ok(built)
    }
}

fn build(slot: &WeightSlot, parts: &[Arc<Tensor>]) -> Result<Tensor> {
    let err = |detail: String| RuntimeError::Weight { name: slot.name.clone(), detail };
    if let Some(p) = parts.iter().find(|p| (p.dtype() == DType::U8) != (slot.dtype == DType::U8)) {
        return Err(err(format!(
            "the graph reads it as {}, the store holds {}: quantized blocks and floats do not convert",
            slot.dtype,
            p.dtype()
        )));
    }
    if parts.len() == 1 {
        if parts[0].shape() != &slot.shape {
            return Err(err(format!("the graph expects shape {}, the store holds {}", slot.shape, parts[0].shape())));
        }
        return Ok(parts[0].to_dtype(slot.dtype));
    }
    let axis = slot.concat_axis;
    let first = parts[0].shape();
    let mut total = first.dims().to_vec();
    if axis >= total.len() {
        return Err(err(format!("concat axis {axis} out of range for {first}")));
    }
    total[axis] = 0;
    for (p, t) in slot.parts.iter().zip(parts) {
        let s = t.shape();
        if s.rank() != first.rank() || (0..s.rank()).any(|i| i != axis && s.dims()[i] != first.dims()[i]) {
            return Err(RuntimeError::Weight {
                name: p.clone(),
                detail: format!("shape {s} cannot be concatenated with {first} on axis {axis}"),
            });
        }
        total[axis] += s.dims()[axis];
    }
    if total != slot.shape.dims() {
        return Err(err(format!("the graph expects shape {}, the parts give {}", slot.shape, Shape(total))));
    }
    let es = slot.dtype.size();
    let outer: usize = total[..axis].iter().product();
    let mut data = Vec::with_capacity(slot.shape.numel() * es);
    let conv: Vec<Tensor> = parts.iter().map(|t| t.to_dtype(slot.dtype)).collect();
    for o in 0..outer {
        for t in &conv {
            let chunk = t.numel() / outer.max(1) * es;
            data.extend_from_slice(&t.bytes()[o * chunk..(o + 1) * chunk]);
        }
    }
    Tensor::from_bytes(slot.shape.clone(), slot.dtype, data)
}
