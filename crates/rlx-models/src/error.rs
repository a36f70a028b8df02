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

/// What a path that should be a regular file is instead, for messages.
pub(crate) fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO (named pipe)"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    }
}

/// Checks that `path` (after symlinks) is a regular file before it is
/// opened: opening a FIFO would block until some writer appears, and
/// mapping a directory fails with a baffling "No such device".
pub(crate) fn check_regular_file(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if meta.is_file() {
        return Ok(());
    }
    Err(ModelError::format(path, format!("is {}, expected a regular file", file_kind(&meta))))
}

/// Opens a file that must be a regular one (see [`check_regular_file`]).
pub(crate) fn open_regular_file(path: &Path) -> Result<std::fs::File> {
    check_regular_file(path)?;
    std::fs::File::open(path).map_err(|e| ModelError::io(path, e))
}

/// Reads a text file that must be a regular one. `Ok(None)` if it does not
/// exist.
pub(crate) fn read_regular_file_if_present(path: &Path) -> Result<Option<String>> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ModelError::io(path, e)),
        Ok(_) => check_regular_file(path)?,
    }
    std::fs::read_to_string(path).map(Some).map_err(|e| ModelError::io(path, e))
}

/// Reads a text file that must exist and be a regular one.
pub(crate) fn read_regular_file(path: &Path) -> Result<String> {
    check_regular_file(path)?;
    std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))
}
