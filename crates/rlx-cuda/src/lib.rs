//! RLX CUDA backend.
//!
//! Thunks become steps (kernel launches from `kernels/*.cu` compiled by
//! NVRTC, cuBLASLt matmuls, staging copies); each slot's steps are recorded
//! into CUDA graphs once and replayed on every call (or launched one by one
//! in eager mode). CUDA libraries are loaded at run time: without a driver,
//! a device or a library, `CudaBackend::new` returns an error saying what is
//! missing, and the crate still builds and tests everywhere.
//!
//! Files: `options` (every setting, read once), `driver` (owned driver
//! handles), `nvrtc` (compile + disk cache) and `kernel_cache` (the checked
//! format of its files), `launch` (thunk → steps), `ffn` (the fused
//! feed-forward kernel), `decode` (the generation step's kernels: quantized
//! matmuls and gathers, sampling), `blas` (cuBLASLt), `gemm` (the cuBLASLt
//! algorithm per shape, timed) and `gemm_cache` (its choices on disk),
//! `hostops` (TopK on the host), `weights` (shared device weights), `exec`
//! (slots, replay, submit/wait).

mod arena;
mod blas;
mod decode;
mod driver;
mod exec;
mod ffn;
mod gemm;
/// The matmul-choice file's parser (public for the fuzz targets).
#[doc(hidden)]
pub mod gemm_cache;
mod hostops;
/// The compiled-kernel cache's file format (public for the fuzz targets).
#[doc(hidden)]
pub mod kernel_cache;
mod launch;
mod libs;
mod modules;
mod nvrtc;
mod options;
mod params;
mod record;
mod weights;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use rlx_runtime::{Backend, Executable, PrepareOptions, Result, RuntimeError, StateSet, WeightStore};
use rlx_schedule::{Schedule, Thunk};

pub use exec::CudaExecutable;
pub use nvrtc::SOURCES as KERNEL_SOURCES;
pub use options::{CudaOptions, MatmulChoice};

use driver::{err, Device};
use libs::Lib;
use modules::Kernels;

/// The CUDA backend for one device, with the options every executable it
/// prepares runs under.
#[derive(Clone)]
pub struct CudaBackend {
    dev: Arc<Device>,
    kernels: Arc<Kernels>,
    opts: CudaOptions,
}

fn missing_lib(lib: &str, file: &str, hint: &str) -> RuntimeError {
    err(format!("{lib} ({file}) was not found: {hint}; check LD_LIBRARY_PATH"))
}

/// Fails unless the driver and NVRTC can be loaded. cudarc panics on first
/// use of an absent library, so this runs before any call; cuBLASLt is
/// checked by `with_options` (it loads while the device opens).
fn probe_libraries() -> Result<()> {
    if !libs::present(Lib::Driver) {
        return Err(missing_lib(
            "the CUDA driver",
            "libcuda.so.1",
            "install the NVIDIA driver (usually /usr/lib/x86_64-linux-gnu or /usr/local/nvidia/lib64)",
        ));
    }
    if !nvrtc::nvrtc_present() {
        return Err(missing_lib(
            "NVRTC",
            "libnvrtc.so.13",
            "install the CUDA 13 toolkit or the pip wheel nvidia-cuda-nvrtc (e.g. /usr/local/cuda/lib64)",
        ));
    }
    Ok(())
}

fn missing_cublaslt() -> RuntimeError {
    missing_lib("cuBLASLt", "libcublasLt.so.13", "install the CUDA 13 toolkit or the pip wheel nvidia-cublas (e.g. /usr/local/cuda/lib64)")
}

/// Runs a closure that calls into cudarc, turning a panic (a symbol missing
/// from an older library) into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
        Err(err(format!("{what}: the CUDA library failed to load ({msg}); check LD_LIBRARY_PATH and that it is CUDA 13")))
    })
}

/// Devices and their loaded kernels, opened once per process: the first
/// opener's compile options (kernel cache, headers) hold for the process.
type Opened = (Arc<Device>, Arc<Kernels>);

fn open(ordinal: usize, opts: &CudaOptions) -> Result<Opened> {
    static OPEN: OnceLock<Mutex<HashMap<usize, Opened>>> = OnceLock::new();
    let mut g = OPEN.get_or_init(Default::default).lock().map_err(|_| err("device table lock poisoned"))?;
    if let Some(v) = g.get(&ordinal) {
        return Ok(v.clone());
    }
    let t0 = std::time::Instant::now();
    let dev = Device::open(ordinal)?;
    let t1 = std::time::Instant::now();
    let funcs = modules::load_modules(&dev, &nvrtc::sources_for(dev.cc), opts)?;
    if opts.trace {
        let ms = |a: std::time::Instant, b: std::time::Instant| (b - a).as_secs_f64() * 1e3;
        let now = std::time::Instant::now();
        eprintln!("rlx-cuda: device {ordinal} opened in {:.1} ms, its kernels loaded in {:.1} ms", ms(t0, t1), ms(t1, now));
    }
    let kernels = Arc::new(Kernels::new(dev.clone(), funcs, opts.clone()));
    g.insert(ordinal, (dev.clone(), kernels.clone()));
    Ok((dev, kernels))
}

impl CudaBackend {
    /// Opens CUDA device `ordinal` with the options of the environment
    /// (`CudaOptions::from_env`) and loads (compiling on first use) the
    /// kernels. An error, never a panic, when anything is missing or a
    /// variable has a bad value.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        CudaBackend::with_options(ordinal, CudaOptions::from_env()?)
    }

    /// As `new`, with these options.
    pub fn with_options(ordinal: usize, opts: CudaOptions) -> Result<CudaBackend> {
        // cuBLASLt, by far the slowest of the three libraries to load,
        // loads on a thread while the driver starts and the kernels load
        // (where no thread can be started, here after them).
        let cublaslt = std::thread::Builder::new().name("rlx-cublaslt-load".into()).spawn(|| libs::present(Lib::CublasLt)).ok();
        probe_libraries()?;
        driver::check_context()?;
        let opened = guarded("opening the CUDA device", || open(ordinal, &opts));
        let loaded = match cublaslt {
            Some(t) => t.join().unwrap_or(false),
            None => libs::present(Lib::CublasLt),
        };
        if !loaded {
            return Err(missing_cublaslt());
        }
        let (dev, kernels) = opened?;
        Ok(CudaBackend { dev, kernels, opts })
    }

    /// The same device and kernels, preparing executables under `opts`
    /// (its compile settings do not apply: the kernels are loaded).
    pub fn reconfigured(&self, opts: CudaOptions) -> CudaBackend {
        CudaBackend { opts, ..self.clone() }
    }

    /// The options executables are prepared under.
    pub fn options(&self) -> &CudaOptions {
        &self.opts
    }

    /// Device name and compute capability.
    pub fn device_name(&self) -> String {
        format!("{} (sm_{}{})", self.dev.name, self.dev.cc.0, self.dev.cc.1)
    }

    /// (free, total) device memory in bytes.
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        self.dev.bind()?;
        self.dev.mem_info()
    }

    /// Prepares and returns the concrete executable (tests reach
    /// `segment_map` through it).
    pub fn prepare_cuda(&self, schedule: Arc<Schedule>, weights: Arc<WeightStore>, opts: &PrepareOptions) -> Result<CudaExecutable> {
        driver::check_context()?;
        guarded("preparing a CUDA executable", || {
            CudaExecutable::new(self.dev.clone(), &self.kernels, schedule, weights, None, opts, &self.opts)
        })
    }
}

impl CudaBackend {
    /// For the fault-injection tests only: makes every later call of `exe`
    /// replay a graph whose kernel traps, as a faulting kernel would. The
    /// CUDA context of the process is lost at the first such call.
    #[doc(hidden)]
    pub fn inject_trap_for_test(&self, exe: &mut CudaExecutable) -> Result<()> {
        exe.inject_trap(&self.kernels)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &str {
        "cuda"
    }

    /// For a fused thunk: whether the fused kernel runs it (src/ffn.rs
    /// `eligible`, with `CudaOptions::ffn_fusion`); one it does not runs as
    /// its parts.
    fn supports(&self, thunk: &Thunk) -> bool {
        let fused = match thunk {
            Thunk::FeedForward(f) => self.opts.ffn_fusion && ffn::eligible(f, self.dev.cc, self.dev.smem_optin).is_ok(),
            _ => true,
        };
        fused && launch::unsupported(thunk).is_none()
    }

    /// The fused thunks `supports` takes run as one kernel.
    fn runs_fused(&self, thunk: &Thunk) -> bool {
        thunk.parts().is_some() && self.supports(thunk)
    }

    /// Quantized matmuls of this many rows and more run through cuBLASLt
    /// over weights decoded into scratch (src/decode.rs).
    fn qmatmul_scratch_rows(&self) -> Option<usize> {
        Some(decode::LIB_MIN_ROWS)
    }

    fn prepare(&self, schedule: Arc<Schedule>, weights: Arc<WeightStore>, opts: &PrepareOptions) -> Result<Box<dyn Executable>> {
        Ok(Box::new(self.prepare_cuda(schedule, weights, opts)?))
    }

    /// State buffers come from `states` by name (made there, zeroed, by the
    /// first executable that names them): every executable of the set must
    /// run on this device, and the caller orders their calls (src/exec.rs).
    fn prepare_shared(
        &self,
        schedule: Arc<Schedule>,
        weights: Arc<WeightStore>,
        states: &Arc<StateSet>,
        opts: &PrepareOptions,
    ) -> Result<Box<dyn Executable>> {
        driver::check_context()?;
        let exe = guarded("preparing a CUDA executable", || {
            CudaExecutable::new(self.dev.clone(), &self.kernels, schedule, weights, Some(states), opts, &self.opts)
        })?;
        Ok(Box::new(exe))
    }
}

/// Compiles every kernel file for `arch` (CI check without a GPU) with
/// `opts`' compile settings; returns (file, architecture compiled for,
/// CUBIN bytes).
pub fn check_kernels(arch: (i32, i32), opts: &CudaOptions) -> Result<Vec<(&'static str, String, usize)>> {
    nvrtc::compile_all(arch, opts)
}

/// What `rlx doctor` prints: driver, device, compute capability, memory,
/// library versions, or what is missing.
pub fn doctor() -> String {
    let mut lines = Vec::new();
    let have_driver = libs::present(Lib::Driver);
    if !have_driver {
        lines.push("CUDA driver: libcuda.so.1 not found (install the NVIDIA driver; check LD_LIBRARY_PATH)".to_string());
    } else {
        match guarded("driver", driver::driver_version) {
            Ok(v) => lines.push(format!("CUDA driver: API version {}.{}", v / 1000, (v % 1000) / 10)),
            Err(e) => lines.push(format!("CUDA driver: {e}")),
        }
    }
    match nvrtc::nvrtc_version() {
        Ok((a, b)) => lines.push(format!("NVRTC: {a}.{b}")),
        Err(e) => lines.push(format!("NVRTC: {e}")),
    }
    match blas::cublaslt_version() {
        Some(v) => lines.push(format!("cuBLASLt: {}.{}.{}", v / 10000, (v / 100) % 100, v % 100)),
        None => lines.push("cuBLASLt: libcublasLt.so.13 not found (check LD_LIBRARY_PATH)".into()),
    }
    let opts = CudaOptions::from_env();
    if let Err(e) = &opts {
        lines.push(format!("options: {e}"));
    }
    match nvrtc::find_include_dir(opts.as_ref().ok().and_then(|o| o.cuda_include.as_deref())) {
        Ok(d) => lines.push(format!("CUDA headers: {}", d.display())),
        Err(e) => lines.push(format!("CUDA headers: {e}")),
    }
    if have_driver {
        let devs = guarded("devices", || {
            // SAFETY: plain driver calls with out-pointers to locals.
            unsafe {
                driver::check(cudarc::driver::sys::cuInit(0), "cuInit")?;
                let mut n = 0;
                driver::check(cudarc::driver::sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount")?;
                Ok(n.max(0) as usize)
            }
        });
        match devs {
            Ok(0) => lines.push("devices: none".into()),
            Ok(n) => {
                for i in 0..n {
                    match guarded("device", || Device::open(i)) {
                        Ok(d) => {
                            let mem = d
                                .mem_info()
                                .map(|(f, t)| format!("{:.1} GiB total, {:.1} GiB free", t as f64 / 1073741824.0, f as f64 / 1073741824.0))
                                .unwrap_or_else(|e| e.to_string());
                            lines.push(format!(
                                "device {i}: {}, compute capability {}.{}, {} SMs, {mem}",
                                d.name, d.cc.0, d.cc.1, d.sm_count
                            ));
                        }
                        Err(e) => lines.push(format!("device {i}: {e}")),
                    }
                }
            }
            Err(e) => lines.push(format!("devices: {e}")),
        }
    }
    lines.join("\n")
}
