//! RLX CPU backend: interprets a [`Schedule`](rlx_schedule::Schedule) with
//! fast kernels (the `gemm` crate for matmuls, rayon over rows for the
//! rest). It is the reference every other backend is checked against.
//!
//! ```text
//! let backend = rlx_cpu::CpuBackend::new();
//! let mut exe = backend.prepare(schedule, weights, &PrepareOptions::default())?;
//! let outputs = exe.run(&[("x", &x)])?;
//! ```

mod act;
mod elem;
mod exec;
mod kernels;
mod memory;
mod options;
mod pool;
mod simd;
mod validate;
mod widened;

/// Kernels for GGML block-quantized weights (also used by model loaders).
pub use kernels::quant;

use std::sync::Arc;

use rlx_runtime::{Backend, Executable, PrepareOptions, RuntimeError, StateSet, WeightStore};
use rlx_schedule::{Schedule, Thunk};

pub use act::erf;
pub use exec::CpuExecutable;
pub use options::CpuOptions;

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

pub(crate) fn exec_err(detail: impl Into<String>) -> RuntimeError {
    RuntimeError::backend("cpu", detail)
}

/// The CPU backend. Cheap to clone; executables share its thread pool.
#[derive(Clone)]
pub struct CpuBackend {
    /// The workers kernels run on (see `pool.rs`: pinned, one per CPU).
    pool: Option<Arc<rayon::ThreadPool>>,
    /// Set when the options or the pool could not be had; reported by `prepare`.
    pool_error: Option<String>,
    opts: CpuOptions,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// Runs kernels on the process-wide RLX pool: one worker per CPU the
    /// process may use (or `RAYON_NUM_THREADS`), each pinned to its CPU
    /// unless `RLX_CPU_PIN=0`. Rayon's global pool is left to the
    /// application. Options from the environment (a bad value is
    /// reported by `prepare`).
    pub fn new() -> CpuBackend {
        match CpuOptions::from_lookup(rlx_runtime::env::var) {
            Ok(o) => Self::with_options(o),
            Err(e) => CpuBackend { pool: None, pool_error: Some(e.to_string()), opts: CpuOptions::default() },
        }
    }

    /// As `new`, with these options (the shared pool's pinning is set by
    /// the first backend that starts it).
    pub fn with_options(opts: CpuOptions) -> CpuBackend {
        match pool::shared(opts.pin) {
            Ok(p) => CpuBackend { pool: Some(p), pool_error: None, opts },
            Err(e) => CpuBackend { pool: None, pool_error: Some(e), opts },
        }
    }

    /// Runs kernels on a pool of its own with `n` threads (at least 1),
    /// pinned unless `opts.pin` is off.
    pub fn with_threads(n: usize, opts: CpuOptions) -> CpuBackend {
        match pool::build(n, opts.pin) {
            Ok(p) => CpuBackend { pool: Some(Arc::new(p)), pool_error: None, opts },
            Err(e) => CpuBackend { pool: None, pool_error: Some(e), opts },
        }
    }

    pub fn options(&self) -> &CpuOptions {
        &self.opts
    }

    /// Threads kernels run on.
    pub fn threads(&self) -> usize {
        self.pool.as_ref().map(|p| p.current_num_threads()).unwrap_or_else(rayon::current_num_threads)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    fn supports(&self, thunk: &Thunk) -> bool {
        validate::check_thunk(thunk).is_ok()
    }

    fn prepare(&self, schedule: Arc<Schedule>, weights: Arc<WeightStore>, opts: &PrepareOptions) -> Result<Box<dyn Executable>> {
        self.check(&schedule)?;
        Ok(Box::new(CpuExecutable::new(
            schedule,
            weights,
            None,
            opts.state_block,
            opts.slots.max(1),
            self.pool.clone(),
            self.opts.profile,
        )?))
    }

    fn prepare_shared(
        &self,
        schedule: Arc<Schedule>,
        weights: Arc<WeightStore>,
        states: &Arc<StateSet>,
        opts: &PrepareOptions,
    ) -> Result<Box<dyn Executable>> {
        self.check(&schedule)?;
        Ok(Box::new(CpuExecutable::new(
            schedule,
            weights,
            Some(states),
            opts.state_block,
            opts.slots.max(1),
            self.pool.clone(),
            self.opts.profile,
        )?))
    }
}

impl CpuBackend {
    fn check(&self, schedule: &Schedule) -> Result<()> {
        if let Some(e) = &self.pool_error {
            return Err(exec_err(e.clone()));
        }
        for (i, t) in schedule.thunks.iter().enumerate() {
            validate::check_thunk(t).map_err(|detail| RuntimeError::Unsupported {
                backend: "cpu".into(),
                thunk: format!("#{i} {}", t.kind()),
                detail,
            })?;
        }
        Ok(())
    }
}

/// Reusable f32 buffers for matmuls on half-precision data: grown on first
/// use, then reused by every call.
#[derive(Default)]
pub(crate) struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

fn grown(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

impl Scratch {
    pub(crate) fn c(&mut self, n: usize) -> &mut [f32] {
        grown(&mut self.c, n)
    }
    pub(crate) fn abc(&mut self, na: usize, nb: usize, nc: usize) -> (&mut [f32], &mut [f32], &mut [f32]) {
        (grown(&mut self.a, na), grown(&mut self.b, nb), grown(&mut self.c, nc))
    }
}
