//! RLX: compile a neural-network graph once for a device, run it on every
//! call with almost no host work.
//!
//! ```no_run
//! use rlx::{DType, Device, Graph, Session, Tensor};
//! # fn main() -> Result<(), rlx::Error> {
//! let mut g = Graph::new();
//! let x = g.input("x", [2, 3], DType::F32)?;
//! let w = g.param("w", [3, 4], DType::F32)?;
//! let y = g.matmul(x, w)?;
//! let y = g.gelu(y)?;
//! g.output(y)?;
//!
//! let session = Session::new(Device::Cpu)?;
//! session.set_weight("w", Tensor::from_f32([3, 4], &[0.1; 12])?)?;
//! let mut exe = session.compile(&g)?;
//! let out = exe.run(&[("x", &Tensor::from_f32([2, 3], &[1.0; 6])?)])?;
//! println!("{:?}", out[0].to_f32());
//! # Ok(()) }
//! ```

mod device;
mod error;
mod options;
mod session;

pub use device::Device;
pub use error::Error;
pub use options::{CpuOptions, Options};
#[cfg(feature = "cuda")]
pub use options::{CudaOptions, MatmulChoice};
pub use session::{CompiledGraph, Session};

pub use rlx_compile::{compile, CompileOptions, Compiled, Schedule, Thunk};
pub use rlx_ir::{
    Activation, AttentionSpec, BinaryOp, DType, Graph, IrError, Node, NodeId, Op, QFormat, ReduceOp, RopeMode, RopeSpec, Shape,
};
pub use rlx_runtime::{ExecStats, PrepareOptions, RuntimeError, StateSet, Tensor, Ticket, WeightStore};

/// The backends themselves, for tools that need them directly.
pub mod backends {
    /// The CPU's quantized-block kernels (dequantisation, quantisation,
    /// reference and fast matmul), e.g. to read GGUF weights on the host.
    pub use rlx_cpu::quant;
    pub use rlx_cpu::CpuBackend;
    #[cfg(feature = "cuda")]
    pub use rlx_cuda::{doctor as cuda_doctor, CudaBackend};

    /// What `rlx doctor` prints in a build without the CUDA backend.
    #[cfg(not(feature = "cuda"))]
    pub fn cuda_doctor() -> String {
        "CUDA: this build of rlx has no CUDA support (built without the `cuda` feature)".into()
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
