//! The loaded kernels of a device: the modules compiled (or read from the
//! disk cache) when it opens, and those loaded on first use (the fused
//! feed-forward block's, the generation step's, the fault hook's). The
//! steps that launch them are built in `launch`.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use rlx_runtime::Result;

use crate::driver::{err, Device, Func, Module};
use crate::options::CudaOptions;

/// Compiles (or reads from the disk cache) the files, all at once, and
/// loads them as modules on the device: their functions by name. Modules
/// live for the process (every executable uses their functions).
pub(crate) fn load_modules(dev: &Device, files: &[crate::nvrtc::Source], opts: &CudaOptions) -> Result<HashMap<String, Func>> {
    let mut funcs = HashMap::new();
    for cubin in crate::nvrtc::compile_many(files, opts)? {
        let module: &'static Module = Box::leak(Box::new(Module::load(dev, &cubin)?));
        funcs.extend(module.functions()?);
    }
    Ok(funcs)
}

/// Loaded kernel functions by name (`binary_f16`, `gather`, ...).
pub(crate) struct Kernels {
    funcs: HashMap<String, Func>,
    pub sm_count: u32,
    dev: Arc<Device>,
    /// How kernels compile (cache folder, headers): the options the device
    /// was opened with.
    compile: CudaOptions,
    /// The fused feed-forward kernels by widths (H, I), each compiled and
    /// loaded on first use (`ffn`); a failure is kept as its message and
    /// repeated to every caller.
    ffn: std::sync::Mutex<HashMap<(usize, usize), Loaded>>,
    /// The generation step's kernels (kernels/decode.cu, qmma.cu, qlib.cu, sample.cu), loaded on first
    /// use (`decode`) in the same way.
    decode: OnceLock<std::result::Result<LazyModule, String>>,
    /// The fault-injection hook's trapping kernel (kernels/fault.cu).
    fault: OnceLock<std::result::Result<LazyModule, String>>,
}

/// A module compiled and loaded on first use, or why it could not be.
type Loaded = std::result::Result<&'static LazyModule, String>;

/// Kernels compiled and loaded on first use: the fused feed-forward
/// block's (kernels/ffn.cu) and the generation step's (kernels/decode.cu and its siblings),
/// which only some schedules run.
pub(crate) struct LazyModule {
    funcs: HashMap<String, Func>,
    /// Its file, for error messages.
    file: &'static str,
}

impl LazyModule {
    pub(crate) fn get(&self, name: &str) -> Result<Func> {
        self.funcs.get(name).copied().ok_or_else(|| err(format!("kernel {name} is not in kernels/{}", self.file)))
    }
}

impl Kernels {
    pub(crate) fn new(dev: Arc<Device>, funcs: HashMap<String, Func>, compile: CudaOptions) -> Kernels {
        Kernels {
            funcs,
            sm_count: dev.sm_count.max(1) as u32,
            dev,
            compile,
            ffn: Default::default(),
            decode: OnceLock::new(),
            fault: OnceLock::new(),
        }
    }
    pub(crate) fn get(&self, name: &str) -> Result<Func> {
        self.funcs.get(name).copied().ok_or_else(|| err(format!("kernel {name} is not in the loaded modules")))
    }
    /// What a timed matmul choice depends on beyond its shape (src/gemm_cache.rs):
    /// the device model, the driver and cuBLASLt versions, and the
    /// revision of the candidate list (2: answers of one configuration
    /// count once, so choices stored from an older list, which could hold
    /// an answer whose results change from call to call, are not used).
    pub(crate) fn timing_context(&self) -> String {
        let d = &self.dev;
        let driver = crate::driver::driver_version().unwrap_or(0);
        let lt = crate::blas::cublaslt_version().unwrap_or(0);
        format!("{} cc {}.{} sms {} driver {driver} cublasLt {lt} candidates 2", d.name, d.cc.0, d.cc.1, d.sm_count)
    }
    /// The fused feed-forward kernels at widths (H, I), compiled (or read
    /// from the disk cache) and loaded the first time a block of those
    /// widths needs them (src/ffn.rs).
    pub(crate) fn ffn(&self, h: usize, i: usize) -> Result<&'static LazyModule> {
        let mut loaded = self.ffn.lock().unwrap_or_else(|p| p.into_inner());
        let module = loaded.entry((h, i)).or_insert_with(|| {
            let arch = format!("sm_{}{}", self.dev.cc.0, self.dev.cc.1);
            let cubin =
                crate::nvrtc::compile_cubin("ffn.cu", &crate::nvrtc::ffn_source(h, i), &arch, &self.compile).map_err(|e| e.to_string())?;
            let module: &'static Module = Box::leak(Box::new(Module::load(&self.dev, &cubin).map_err(|e| e.to_string())?));
            let funcs = module.functions().map_err(|e| e.to_string())?.into_iter().collect();
            Ok(&*Box::leak(Box::new(LazyModule { funcs, file: "ffn.cu" })))
        });
        module.clone().map_err(|e| err(format!("loading the fused feed-forward kernels for H {h}, I {i}: {e}")))
    }
    /// The generation step's kernels (src/decode.rs), compiled (or read from
    /// the disk cache) and loaded the first time a schedule needs them.
    pub(crate) fn decode(&self) -> Result<&LazyModule> {
        let files = || crate::nvrtc::decode_sources_for(self.dev.cc);
        self.lazy(&self.decode, files, "decode.cu, qmma.cu, qlib.cu or sample.cu", "the generation kernels")
    }
    /// The fault-injection kernel's module (kernels/fault.cu), compiled
    /// and loaded on first use.
    pub(crate) fn fault_module(&self) -> Result<&LazyModule> {
        self.lazy(&self.fault, || crate::nvrtc::fault_sources_for(self.dev.cc), "fault.cu", "the fault-injection kernel")
    }
    /// The module in `cell`, compiled from `files` and loaded on first use;
    /// a failure is kept and repeated to every caller.
    fn lazy<'a>(
        &self,
        cell: &'a OnceLock<std::result::Result<LazyModule, String>>,
        files: impl FnOnce() -> Vec<crate::nvrtc::Source>,
        file: &'static str,
        what: &str,
    ) -> Result<&'a LazyModule> {
        let loaded = cell.get_or_init(|| {
            let funcs = load_modules(&self.dev, &files(), &self.compile).map_err(|e| e.to_string())?;
            Ok(LazyModule { funcs, file })
        });
        loaded.as_ref().map_err(|e| err(format!("loading {what}: {e}")))
    }
}
