use thiserror::Error;

/// Everything that can be wrong with a graph: the message names the node, op
/// and shapes involved.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum IrError {
    #[error("{op}: shape mismatch: {detail}")]
    Shape { op: String, detail: String },
    #[error("{op}: dtype mismatch: {detail}")]
    DType { op: String, detail: String },
    #[error("{op}: invalid attribute: {detail}")]
    Attribute { op: String, detail: String },
    #[error("node {node} refers to input {input} which is not defined before it")]
    BadInput { node: usize, input: usize },
    #[error("invalid graph: {0}")]
    Invalid(String),
    #[error("node {node} ({op}): {source}")]
    AtNode {
        node: usize,
        op: String,
        #[source]
        source: Box<IrError>,
    },
}

impl IrError {
    pub(crate) fn shape(op: &str, detail: impl Into<String>) -> Self {
        IrError::Shape { op: op.to_string(), detail: detail.into() }
    }
    pub(crate) fn dtype(op: &str, detail: impl Into<String>) -> Self {
        IrError::DType { op: op.to_string(), detail: detail.into() }
    }
    pub(crate) fn attr(op: &str, detail: impl Into<String>) -> Self {
        IrError::Attribute { op: op.to_string(), detail: detail.into() }
    }
}
