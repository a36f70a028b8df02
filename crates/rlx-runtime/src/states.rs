//! State shared by several executables.
//!
//! A decoder's KV cache is written by the prefill executable of every length
//! bucket and by the decode step, so it cannot belong to one executable. A
//! [`StateSet`] holds such buffers by name; each backend allocates its own
//! buffer type the first time an executable bound to the set asks for a name,
//! and every later executable asking for that name gets the same buffer.
//!
//! A backend may also keep one object of its own per set for every
//! executable bound to it ([`StateSet::backend_object`]): the CUDA backend
//! keeps one activation arena there, which all of them share, and orders
//! the calls of different executables on the device itself.
//!
//! Ordering: executables bound to one set each run their own calls in order.
//! On the CPU, calls of different executables are ordered only by the
//! caller — wait for one executable's calls that touch the set before
//! submitting to another (the generator does this between prefill and
//! decode); the CUDA backend orders them in submission order.

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
    /// Backend name -> that backend's object for the set.
    objects: Mutex<HashMap<String, Arc<dyn Any + Send + Sync>>>,
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

    /// The object backend `backend` keeps for every executable bound to
    /// the set, made by `make` on first use (one per backend name; a later
    /// request for another type is an error).
    pub fn backend_object<T: Any + Send + Sync>(&self, backend: &str, make: impl FnOnce() -> Result<T>) -> Result<Arc<T>> {
        let mut map = self.objects.lock().map_err(|_| RuntimeError::backend(backend, "state set lock poisoned"))?;
        if let Some(o) = map.get(backend) {
            return o
                .clone()
                .downcast::<T>()
                .map_err(|_| RuntimeError::backend(backend, "the state set's backend object has another type"));
        }
        let o = Arc::new(make()?);
        map.insert(backend.to_string(), o.clone());
        Ok(o)
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

    /// One object per backend name, made once; another type is refused.
    #[test]
    fn a_backend_object_is_made_once_per_backend() {
        let set = StateSet::new();
        let a = set.backend_object("cuda:0", || Ok(5u32)).expect("make");
        let b = set.backend_object("cuda:0", || -> Result<u32> { panic!("made twice") }).expect("again");
        assert!(Arc::ptr_eq(&a, &b));
        let c = set.backend_object("cuda:1", || Ok(6u32)).expect("another backend");
        assert_eq!((*a, *c), (5, 6));
        assert!(set.backend_object("cuda:0", || Ok(1u8)).is_err());
        assert!(set.names().is_empty(), "objects are not state buffers");
    }
}
