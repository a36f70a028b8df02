use std::path::{Path, PathBuf};

use thiserror::Error;

/// Everything loading or running a model can report. Messages name the file,
/// tensor or text involved, what was expected and what was found.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A file that exists but whose content is wrong (bad JSON, bad header,
    /// truncated data, unsupported architecture).
    #[error("{path}: {detail}")]
    Format { path: PathBuf, detail: String },
    /// The weights do not fit the config (missing, extra, mis-shaped tensors).
    #[error("{path}: tensor '{tensor}': {detail}")]
    Tensor { path: PathBuf, tensor: String, detail: String },
    #[error("tokenizer {path}: {detail}")]
    Tokenizer { path: PathBuf, detail: String },
    /// Input the caller gave that the model cannot take.
    #[error("{0}")]
    Input(String),
    #[error(transparent)]
    Rlx(#[from] rlx::Error),
}

impl ModelError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        ModelError::Io { path: path.to_path_buf(), source }
    }
    pub(crate) fn format(path: &Path, detail: impl Into<String>) -> Self {
        ModelError::Format { path: path.to_path_buf(), detail: detail.into() }
    }
    pub(crate) fn tensor(path: &Path, tensor: &str, detail: impl Into<String>) -> Self {
        ModelError::Tensor { path: path.to_path_buf(), tensor: tensor.to_string(), detail: detail.into() }
    }
}

impl From<rlx::RuntimeError> for ModelError {
    fn from(e: rlx::RuntimeError) -> Self {
        ModelError::Rlx(rlx::Error::Runtime(e))
    }
}

impl From<rlx::IrError> for ModelError {
    fn from(e: rlx::IrError) -> Self {
        ModelError::Rlx(rlx::Error::Ir(e))
    }
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
