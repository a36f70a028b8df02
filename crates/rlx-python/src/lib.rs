//! The `rlx` Python package's native module (`rlx._rlx`):
//! [`SentenceEmbedder`](embedder::PySentenceEmbedder) and
//! [`Generator`](generator::PyGenerator) over the Rust APIs of `rlx-models`.
//!
//! Every call that computes runs with the GIL released, inside
//! [`run_detached`], which also turns a panic into a `RuntimeError`, so none
//! crosses into Python. Errors keep the Rust message; their Python class
//! follows [`model_error`].

mod embedder;
mod generator;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use pyo3::exceptions::{PyFileNotFoundError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyModule;
use rlx::Device;
use rlx_models::model_dir::Env;
use rlx_models::ModelError;

/// The Python exception for a model error: a missing file or directory is
/// `FileNotFoundError`, input the model cannot take is `ValueError`,
/// anything else (a malformed file, a device failure) `RuntimeError`.
pub(crate) fn model_error(e: ModelError) -> PyErr {
    let msg = e.to_string();
    match &e {
        ModelError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
        ModelError::Input(_) => PyValueError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

/// Runs `f` with the GIL released; a panic in it becomes a `RuntimeError`
/// naming it as a bug instead of unwinding into the interpreter.
pub(crate) fn run_detached<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> PyResult<T> + Send,
{
    py.detach(|| catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(panic_error(p))))
}

/// The `RuntimeError` for a caught panic.
pub(crate) fn panic_error(payload: Box<dyn std::any::Any + Send>) -> PyErr {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    PyRuntimeError::new_err(format!("internal error in rlx (a bug, please report it): {what}"))
}

/// `"cpu"`, `"cuda"` or `"cuda:N"`.
pub(crate) fn parse_device(device: &str) -> PyResult<Device> {
    device.parse().map_err(|e: rlx::Error| PyValueError::new_err(format!("device '{device}': {e}")))
}

/// Where a default model is looked for: the process environment, with the
/// current directory and the package's own directory as bases (a package
/// installed into a virtual environment inside a checkout of the repository
/// finds the checkout's `models/`).
pub(crate) fn lookup_env(py: Python<'_>) -> Env<'static> {
    let mut bases = vec![];
    if let Ok(cwd) = std::env::current_dir() {
        bases.push(cwd);
    }
    let package_dir = py
        .import("rlx")
        .and_then(|m| m.getattr("__file__"))
        .and_then(|f| f.extract::<PathBuf>())
        .ok()
        .and_then(|f| f.parent().map(|p| p.to_path_buf()));
    if let Some(d) = package_dir {
        bases.push(d);
    }
    Env { var: &process_var, bases }
}

fn process_var(key: &str) -> Option<std::ffi::OsString> {
    std::env::var_os(key)
}

/// A model path given by the caller must exist: `FileNotFoundError` naming it.
pub(crate) fn check_exists(path: &std::path::Path, what: &str) -> PyResult<()> {
    match std::fs::symlink_metadata(path) {
        Ok(_) if path.exists() => Ok(()),
        Ok(_) => Err(PyFileNotFoundError::new_err(format!("{what} {} is a symbolic link to a path that does not exist", path.display()))),
        Err(_) => Err(PyFileNotFoundError::new_err(format!("{what} {} does not exist", path.display()))),
    }
}

#[pymodule]
#[pyo3(name = "_rlx")]
fn rlx_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<embedder::PySentenceEmbedder>()?;
    m.add_class::<generator::PyGenerator>()?;
    m.add_class::<generator::PyTextStream>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CUDA_BUILT", cfg!(feature = "cuda"))?;
    Ok(())
}
