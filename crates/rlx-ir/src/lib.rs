//! The RLX intermediate representation: what a model is.
//!
//! A [`Graph`] is a list of [`Node`]s in topological order. Builder methods on
//! `Graph` infer each node's shape and dtype and refuse mismatches; the
//! [`verify`](Graph::verify) method re-checks any graph, including one a pass
//! produced.

mod builder;
mod dtype;
mod error;
mod graph;
mod op;
mod print;
mod quant;
mod shape;
mod verify;

pub use dtype::DType;
pub use error::IrError;
pub use graph::{Graph, Node, NodeId};
pub use op::{
    Activation, AttentionSpec, AttnOutSlots, AttnOutSpec, BinaryOp, FeedForwardSpec, FfnResidual, FfnSlots, Op, ReduceOp, RopeMode,
    RopeSpec,
};
pub use quant::QFormat;
pub use shape::{broadcast_shapes, Shape};

pub type Result<T, E = IrError> = std::result::Result<T, E>;
