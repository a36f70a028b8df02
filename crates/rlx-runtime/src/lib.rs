//! The seam between the compiler and the backends: host [`Tensor`]s, the
//! shared [`WeightStore`], and the [`Backend`] / [`Executable`] traits.

mod backend;
pub mod env;
mod error;
mod states;
mod tensor;
mod weights;

pub use backend::{check_inputs, Backend, ExecStats, Executable, PrepareOptions, Ticket};
pub use error::RuntimeError;
pub use states::StateSet;
pub use tensor::Tensor;
pub use weights::WeightStore;

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
