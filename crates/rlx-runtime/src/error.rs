use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error("input '{name}': {detail}")]
    Input { name: String, detail: String },
    #[error("weight '{name}': {detail}")]
    Weight { name: String, detail: String },
    #[error("tensor: {0}")]
    Tensor(String),
    #[error("{backend} backend: {detail}")]
    Backend { backend: String, detail: String },
    #[error("{backend} backend does not support thunk {thunk}: {detail}")]
    Unsupported { backend: String, thunk: String, detail: String },
    #[error("all {slots} pipeline slots hold results that were not collected; wait() for one before submitting more")]
    Busy { slots: usize },
    #[error("ticket {0} does not belong to this executable or was already collected")]
    BadTicket(u64),
    #[error("device out of memory: asked for {requested} bytes, {free} bytes free")]
    OutOfMemory { requested: u64, free: u64 },
}

impl RuntimeError {
    pub fn backend(backend: &str, detail: impl Into<String>) -> Self {
        RuntimeError::Backend { backend: backend.to_string(), detail: detail.into() }
    }
}
