use serde::{Deserialize, Serialize};

use crate::{DType, IrError, Op, Result, Shape};

/// Index of a node in its graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(pub usize);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "%{}", self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub shape: Shape,
    pub dtype: DType,
    pub name: Option<String>,
}

/// A model: nodes in topological order plus the list of outputs. Inputs,
/// params and states are the nodes of those ops.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub outputs: Vec<NodeId>,
}

impl Graph {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0]
    }

    pub fn shape(&self, id: NodeId) -> &Shape {
        &self.nodes[id.0].shape
    }

    pub fn dtype(&self, id: NodeId) -> DType {
        self.nodes[id.0].dtype
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn ids(&self) -> impl Iterator<Item = NodeId> {
        (0..self.nodes.len()).map(NodeId)
    }

    /// Graph inputs in node order.
    pub fn inputs(&self) -> Vec<NodeId> {
        self.ids().filter(|&i| matches!(self.nodes[i.0].op, Op::Input { .. })).collect()
    }

    /// Params in node order.
    pub fn params(&self) -> Vec<NodeId> {
        self.ids().filter(|&i| matches!(self.nodes[i.0].op, Op::Param { .. })).collect()
    }

    /// State tensors in node order.
    pub fn states(&self) -> Vec<NodeId> {
        self.ids().filter(|&i| matches!(self.nodes[i.0].op, Op::State { .. })).collect()
    }

    /// Marks a node as a graph output (outputs are returned in this order).
    pub fn output(&mut self, id: NodeId) -> Result<()> {
        if id.0 >= self.nodes.len() {
            return Err(IrError::Invalid(format!("output {id} does not exist ({} nodes)", self.nodes.len())));
        }
        self.outputs.push(id);
        Ok(())
    }

    /// Name of an output: the node's name, or `output{i}`.
    pub fn output_name(&self, i: usize) -> String {
        self.outputs.get(i).and_then(|id| self.nodes[id.0].name.clone()).unwrap_or_else(|| format!("output{i}"))
    }

    /// Number of users of every node (outputs count as a use).
    pub fn use_counts(&self) -> Vec<usize> {
        let mut uses = vec![0; self.nodes.len()];
        for n in &self.nodes {
            for i in &n.inputs {
                uses[i.0] += 1;
            }
        }
        for o in &self.outputs {
            uses[o.0] += 1;
        }
        uses
    }

    /// Sets the name of a node (used for outputs and in error messages).
    pub fn set_name(&mut self, id: NodeId, name: impl Into<String>) {
        if let Some(n) = self.nodes.get_mut(id.0) {
            n.name = Some(name.into());
        }
    }

    /// Appends a node after checking it: output shape and dtype are inferred
    /// from the inputs. `declared` carries the shape/dtype for ops that cannot
    /// infer them (leaves, reshape, cast).
    pub fn push(&mut self, op: Op, inputs: Vec<NodeId>, declared: Option<(Shape, DType)>) -> Result<NodeId> {
        for i in &inputs {
            if i.0 >= self.nodes.len() {
                return Err(IrError::BadInput { node: self.nodes.len(), input: i.0 });
            }
        }
        let ins: Vec<(&Shape, DType)> = inputs.iter().map(|i| (&self.nodes[i.0].shape, self.nodes[i.0].dtype)).collect();
        let (shape, dtype) = crate::verify::infer(&op, &ins, declared.as_ref().map(|(s, d)| (s, *d)))?;
        self.nodes.push(Node { op, inputs, shape, dtype, name: None });
        Ok(NodeId(self.nodes.len() - 1))
    }
}
