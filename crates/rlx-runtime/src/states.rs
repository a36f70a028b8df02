//! State shared by several executables.
//!
//! A decoder's KV cache is written by the prefill executable of every length
//! bucket and by the decode step, so it cannot belong to one executable. A
//! [`StateSet`] holds such buffers by name; each backend allocates its own
//! buffer type the first time an executable bound to the set asks for a name,
//! and every later executable asking for that name gets the same buffer.
//!
//! Ordering: executables bound to one set each run their own calls in order,
//! but calls of different executables are ordered only by the caller — wait
//! for one executable's calls that touch the set before submitting to
//! another (the generator does this between prefill and decode).

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::{Result, RuntimeError};

struct Entry {
    backend: String,
    bytes: u64,
    buf: Arc<dyn Any + Send + Sync>,
}

/// Named state buffers shared by the executables bound to the set.
#[derive(Default)]
pub struct StateSet {
    entries: Mutex<HashMap<String, Entry>>,
}

impl std::fmt::Debug for StateSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.entries.lock().map(|e| e.keys().cloned().collect()).unwrap_or_default();
        f.debug_struct("StateSet").field("names", &names).finish()
    }
}

impl StateSet {
    pub fn new() -> Arc<StateSet> {
        Arc::new(StateSet::default())
    }

    /// The buffer named `name`, made by `make` on first use. A later request
    /// must come from the same backend and ask for the same size.
    pub fn get_or_create<T: Any + Send + Sync>(
        &self,
        backend: &str,
        name: &str,
        bytes: u64,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        let mut map = self.entries.lock().map_err(|_| RuntimeError::backend(backend, "state set lock poisoned"))?;
        if let Some(e) = map.get(name) {
            if e.backend != backend || e.bytes != bytes {
                return Err(RuntimeError::backend(
                    backend,
                    format!(
                        "shared state '{name}' is a {} byte buffer of the {} backend; this executable needs {bytes} bytes on {backend}",
                        e.bytes, e.backend
                    ),
                ));
            }
            return e
                .buf
                .clone()
                .downcast::<T>()
                .map_err(|_| RuntimeError::backend(backend, format!("shared state '{name}' has another buffer type")));
        }
        let buf = Arc::new(make()?);
        map.insert(name.to_string(), Entry { backend: backend.to_string(), bytes, buf: buf.clone() });
        Ok(buf)
    }

    /// Names of the buffers made so far.
    pub fn names(&self) -> Vec<String> {
        self.entries.lock().map(|e| e.keys().cloned().collect()).unwrap_or_default()
    }
}
