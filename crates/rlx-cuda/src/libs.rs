//! The CUDA libraries loaded at run time (the driver, NVRTC, cuBLASLt):
//! each is loaded once, by the first check that it is present, and kept
//! loaded for the process, so that cudarc's own load of it (on its first
//! call) finds it mapped. A check that opened and closed the library made
//! the process load it twice, and loading cuBLASLt takes tens to hundreds
//! of milliseconds.

use std::sync::OnceLock;

/// A library cudarc loads on first use.
#[derive(Clone, Copy)]
pub(crate) enum Lib {
    Driver,
    Nvrtc,
    CublasLt,
}

impl Lib {
    /// cudarc's name for it (the stem it makes file names from).
    fn stem(self) -> &'static str {
        match self {
            Lib::Driver => "cuda",
            Lib::Nvrtc => "nvrtc",
            Lib::CublasLt => "cublasLt",
        }
    }
}

/// Whether `lib` loads: under the file names cudarc tries, in its order.
/// The first call loads it (callers of the same library meanwhile wait for
/// that answer) and keeps it loaded; later calls return the answer.
pub(crate) fn present(lib: Lib) -> bool {
    static LOADED: [OnceLock<bool>; 3] = [const { OnceLock::new() }; 3];
    *LOADED[lib as usize].get_or_init(|| {
        cudarc::get_lib_name_candidates(lib.stem()).into_iter().any(|name| {
            // SAFETY: loading a CUDA library runs only its own initialisers.
            match unsafe { libloading::Library::new(name) } {
                Ok(l) => {
                    // Never unloaded: cudarc keeps its own handle for the
                    // process's life as well.
                    std::mem::forget(l);
                    true
                }
                Err(_) => false,
            }
        })
    })
}
