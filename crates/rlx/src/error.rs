use thiserror::Error;

/// The one error type users of the facade see.
#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Ir(#[from] rlx_ir::IrError),
    #[error(transparent)]
    Compile(#[from] rlx_compile::CompileError),
    #[error(transparent)]
    Runtime(#[from] rlx_runtime::RuntimeError),
    #[error("device '{0}': {1}")]
    Device(String, String),
}
