//! Every RLX setting in one value: [`Options`] gathers what the compiler,
//! the runtime and each backend take, and [`Options::from_env`] is the one
//! place the `RLX_*` variables of README's "Options" table are read for a
//! session. A session passes each part to whoever uses it: the compile
//! options to the compiler, the prepare options and the backend's part to
//! every executable it prepares. Nothing is process-global except what is
//! by nature (the CPU thread pool's pinning, the CUDA kernel cache and
//! NVRTC include folder, the L2 set-aside), as the table says.

pub use rlx_cpu::CpuOptions;
#[cfg(feature = "cuda")]
pub use rlx_cuda::{CudaOptions, MatmulChoice};

use crate::{CompileOptions, PrepareOptions, Result};

/// A session's settings: `Options::default()` is what an empty environment
/// gives; `from_env` reads the environment; fields can be set in code.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// What the compiler may do (passes, storage precision).
    pub compile: CompileOptions,
    /// How executables are prepared (pipeline slots, replay, TF32).
    pub prepare: PrepareOptions,
    /// The CPU backend's settings (`RLX_PROFILE`, `RLX_CPU_PIN`).
    pub cpu: CpuOptions,
    /// The CUDA backend's settings (`RLX_REPLAY`, `RLX_TRACE`, `RLX_GEMM`, …).
    #[cfg(feature = "cuda")]
    pub cuda: CudaOptions,
}

impl Options {
    /// The options from the process environment: an unset or empty
    /// variable takes its default; a value that does not parse is an error
    /// naming the variable and the value.
    pub fn from_env() -> Result<Options> {
        Self::from_lookup(rlx_runtime::env::var)
    }

    /// As `from_env`, with `get` standing in for the environment.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Options> {
        let cpu = CpuOptions::from_lookup(&get)?;
        #[cfg(feature = "cuda")]
        let cuda = CudaOptions::from_lookup(&get)?;
        let mut prepare = PrepareOptions::default();
        #[cfg(feature = "cuda")]
        {
            prepare.replay = cuda.replay;
        }
        Ok(Options {
            compile: CompileOptions::default(),
            prepare,
            cpu,
            #[cfg(feature = "cuda")]
            cuda,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Options;

    #[test]
    fn one_lookup_fills_every_part() {
        let env = |n: &str| match n {
            "RLX_PROFILE" => Some("1".to_string()),
            "RLX_CPU_PIN" => Some("off".to_string()),
            "RLX_REPLAY" => Some("0".to_string()),
            _ => None,
        };
        let o = Options::from_lookup(env).expect("valid");
        assert!(o.cpu.profile && !o.cpu.pin);
        #[cfg(feature = "cuda")]
        {
            assert!(o.cuda.profile, "RLX_PROFILE is one setting for both backends");
            assert!(!o.cuda.replay && !o.prepare.replay);
        }
        let e = Options::from_lookup(|n| (n == "RLX_TRACE").then(|| "sometimes".to_string())).err().map(|e| e.to_string());
        #[cfg(feature = "cuda")]
        assert!(e.as_deref().is_some_and(|e| e.contains("RLX_TRACE") && e.contains("sometimes")), "{e:?}");
        #[cfg(not(feature = "cuda"))]
        assert!(e.is_none());
    }
}
