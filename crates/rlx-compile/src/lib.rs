//! RLX compiler: passes over the IR, the arena planner and lowering to a
//! backend-neutral [`Schedule`].
//!
//! `compile` = verify → passes (dce → merge_matmul → fuse → fuse_quant →
//! fuse_attention → fuse_ffn → precision → dce, each result verified) → plan
//! (`plan.rs`: where every value lives) → lower (`lower.rs`: thunks) → [`Schedule`] (printable, serialisable).

pub mod layout;
mod lower;
pub mod passes;
pub mod plan;

pub use lower::lower;
pub use plan::{plan, ArenaPlan};
pub use rlx_schedule::operands;
/// The schedule types live in their own crate, which the backends depend on
/// instead of the compiler; re-exported so compiler users need one import.
pub use rlx_schedule::*;

use rlx_ir::{DType, Graph, IrError};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum CompileError {
    #[error("invalid graph: {0}")]
    Ir(#[from] IrError),
    #[error("pass {pass} produced an invalid graph: {source}")]
    Pass { pass: &'static str, source: IrError },
    #[error("lowering node {node} ({op}): {detail}")]
    Lower { node: usize, op: String, detail: String },
}

/// What the compiler may do to a graph.
#[derive(Debug, Clone)]
pub struct CompileOptions {
    /// Storage dtype for float tensors (params, activations); matmul, norms
    /// and softmax still accumulate in f32. `None` keeps the graph's dtypes.
    pub precision: Option<DType>,
    /// Merge sibling matmuls sharing an input (Q, K, V → QKV).
    pub merge_matmuls: bool,
    /// Fusion patterns (matmul epilogues, residual norms, SwiGLU; around
    /// quantized matmuls: RmsNorm prologues, SwiGLU and residual epilogues;
    /// a decode step's RoPE and KV-cache writes into its attention; a
    /// feed-forward block and its norm, with the attention output
    /// projection and norm before it, as one op that a backend without a
    /// kernel for it runs as its parts).
    pub fuse: bool,
    /// With `fuse`: the feed-forward block as one op (`fuse_ffn`). A
    /// session turns it off for a graph whose blocks its backend would
    /// only run as their parts: the separate ops' arena plan needs less
    /// memory than the fused op's scratch.
    pub fuse_feed_forward: bool,
    /// Run the exact (erf) GELU as its tanh approximation (PyTorch's
    /// `approximate="tanh"`; at most 4.7e-4 apart). Off by default: results
    /// then follow the model exactly. On CUDA the approximation rides in the
    /// matmul's library epilogue, which saves a kernel per FFN.
    pub approximate_gelu: bool,
    /// Quantized matmuls of at least this many rows get arena scratch (a
    /// backend runs them as a library matmul over weights decoded into
    /// it). A session sets it from its backend
    /// (`Backend::qmatmul_scratch_rows`); `None`: no scratch.
    pub qmatmul_scratch_rows: Option<usize>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            precision: None,
            merge_matmuls: true,
            fuse: true,
            fuse_feed_forward: true,
            approximate_gelu: false,
            qmatmul_scratch_rows: None,
        }
    }
}

/// The result of compiling: the graph as given, the graph after passes, and
/// the schedule a backend runs.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub before: Graph,
    pub after: Graph,
    pub schedule: Schedule,
}

/// Verify, optimise, plan and lower a graph.
pub fn compile(graph: &Graph, opts: &CompileOptions) -> Result<Compiled, CompileError> {
    graph.verify()?;
    let after = optimise(graph, opts)?;
    let plan = plan::plan_with(&after, opts.qmatmul_scratch_rows)?;
    let schedule = lower::lower(&after, &plan)?;
    Ok(Compiled { before: graph.clone(), after, schedule })
}

/// The passes `opts` selects, in order: dce → merge → fuse → fuse_quant →
/// fuse_attention → fuse_ffn → precision → dce, each result verified (an
/// error names the pass).
pub fn optimise(graph: &Graph, opts: &CompileOptions) -> Result<Graph, CompileError> {
    fn step(g: Graph, pass: &'static str, f: impl FnOnce(&Graph) -> Result<Graph, IrError>) -> Result<Graph, CompileError> {
        let out = f(&g).map_err(|source| CompileError::Pass { pass, source })?;
        out.verify().map_err(|source| CompileError::Pass { pass, source })?;
        Ok(out)
    }
    let mut g = step(graph.clone(), "dce", passes::dce::run)?;
    if opts.approximate_gelu {
        g = step(g, "gelu_tanh", passes::gelu_tanh::run)?;
    }
    if opts.merge_matmuls {
        g = step(g, "merge_matmul", passes::merge_matmul::run)?;
    }
    if opts.fuse {
        g = step(g, "fuse", passes::fuse::run)?;
        g = step(g, "fuse_quant", passes::fuse_quant::run)?;
        g = step(g, "fuse_attention", passes::fuse_attention::run)?;
        if opts.fuse_feed_forward {
            g = step(g, "fuse_ffn", passes::fuse_ffn::run)?;
        }
    }
    if let Some(dtype) = opts.precision {
        g = step(g, "precision", |g| passes::precision::run(g, dtype))?;
    }
    step(g, "dce", passes::dce::run)
}
