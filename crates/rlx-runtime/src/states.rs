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
    /// must come from the same backend and ask for at most its size: one
    /// that asks for fewer bytes uses the buffer's first bytes (the first
    /// rows of a state whose batch dimension is outermost, for an
    /// executable built for a smaller batch).
    pub fn get_or_create<T: Any + Send + Sync>(
        &self,
        backend: &str,
        name: &str,
        bytes: u64,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        let mut map = self.entries.lock().map_err(|_| RuntimeError::backend(backend, "state set lock poisoned"))?;
        if let Some(e) = map.get(name) {
            if e.backend != backend || bytes > e.bytes {
                return Err(RuntimeError::backend(
                    backend,
                    format!(
                        "shared state '{name}' is a {} byte buffer of the {} backend; this executable needs {bytes} bytes on {backend} (at most the buffer's size)",
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A smaller request gets the same buffer (its first bytes); a larger
    /// one, or one from another backend, is refused with both sizes named.
    #[test]
    fn smaller_requests_share_the_buffer_larger_ones_fail() {
        let set = StateSet::new();
        let full = set.get_or_create("cpu", "k", 64, || Ok(vec![7u8; 64])).expect("make");
        let part = set.get_or_create("cpu", "k", 16, || -> Result<Vec<u8>> { panic!("made twice") }).expect("prefix");
        assert!(Arc::ptr_eq(&full, &part));
        let err = set.get_or_create("cpu", "k", 65, || Ok(vec![0u8; 65])).expect_err("larger").to_string();
        assert!(err.contains("64 byte buffer") && err.contains("needs 65 bytes"), "{err}");
        assert!(set.get_or_create("cuda:0", "k", 64, || Ok(vec![0u8; 64])).is_err());
        assert_eq!(set.names(), vec!["k".to_string()]);
    }
}
