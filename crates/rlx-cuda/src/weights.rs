//! Device copies of a weight store, one per (device, store id), shared by
//! every executable compiled against that store. Refreshed in place (same
//! addresses, so recorded graphs stay valid) when the store's version moves.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rlx_ir::DType;
use rlx_runtime::{Result, RuntimeError, WeightStore};
use rlx_schedule::WeightSlot;

use crate::driver::{err, Device, DeviceBuffer};

type Key = (Vec<String>, usize, DType);

pub(crate) struct DeviceWeights {
    dev: Arc<Device>,
    inner: Mutex<Inner>,
}

struct Inner {
    bufs: HashMap<Key, (WeightSlot, Arc<DeviceBuffer>)>,
    /// Store version the device copies reflect.
    version: u64,
}

/// (device ordinal, store id) -> the shared copy, while any executable holds it.
type Cache = Mutex<HashMap<(usize, u64), Weak<DeviceWeights>>>;

fn cache() -> &'static Cache {
    static C: OnceLock<Cache> = OnceLock::new();
    C.get_or_init(Default::default)
}

fn poisoned<T>(_: T) -> RuntimeError {
    err("device weight cache lock poisoned by a panic elsewhere")
}

impl DeviceWeights {
    /// The shared copy for this store on this device (created on first use).
    pub fn for_store(dev: &Arc<Device>, store: &WeightStore) -> Result<Arc<DeviceWeights>> {
        let mut c = cache().lock().map_err(poisoned)?;
        c.retain(|_, w| w.strong_count() > 0);
        let key = (dev.ordinal, store.id());
        if let Some(w) = c.get(&key).and_then(|w| w.upgrade()) {
            return Ok(w);
        }
        let w = Arc::new(DeviceWeights { dev: dev.clone(), inner: Mutex::new(Inner { bufs: HashMap::new(), version: store.version() }) });
        c.insert(key, Arc::downgrade(&w));
        Ok(w)
    }

    /// Device buffers for a schedule's weight slots, uploading those not
    /// yet on the device.
    pub fn bind(&self, store: &WeightStore, slots: &[WeightSlot]) -> Result<Vec<Arc<DeviceBuffer>>> {
        self.refresh(store)?;
        let mut g = self.inner.lock().map_err(poisoned)?;
        let mut out = Vec::with_capacity(slots.len());
        for slot in slots {
            let key = (slot.parts.clone(), slot.concat_axis, slot.dtype);
            if let Some((_, b)) = g.bufs.get(&key) {
                out.push(b.clone());
                continue;
            }
            let t = store.resolve(slot)?;
            let buf = Arc::new(DeviceBuffer::alloc(&self.dev, t.bytes().len() as u64)?);
            buf.upload(0, t.bytes())?;
            g.bufs.insert(key, (slot.clone(), buf.clone()));
            out.push(buf);
        }
        Ok(out)
    }

    /// Re-uploads every weight when the store changed since the last upload.
    /// Waits for all work on the device first: a kernel may be reading them.
    pub fn refresh(&self, store: &WeightStore) -> Result<()> {
        let v = store.version();
        let mut g = self.inner.lock().map_err(poisoned)?;
        if g.version == v {
            return Ok(());
        }
        self.dev.synchronize()?;
        for (slot, buf) in g.bufs.values() {
            let t = store.resolve(slot)?;
            if t.bytes().len() as u64 != buf.bytes {
                return Err(RuntimeError::Weight {
                    name: slot.name.clone(),
                    detail: format!(
                        "now {} bytes, the device copy holds {}: weights may change values, not sizes",
                        t.bytes().len(),
                        buf.bytes
                    ),
                });
            }
            buf.upload(0, t.bytes())?;
        }
        g.version = v;
        Ok(())
    }
}
