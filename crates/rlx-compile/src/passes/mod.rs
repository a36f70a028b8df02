//! Graph → graph rewrites. Each pass verifies the graph it is given, then
//! builds a new one without touching its input; `compile` verifies the
//! result of every pass.

pub mod dce;
pub mod fuse;
pub mod fuse_attention;
pub mod fuse_ffn;
pub mod fuse_quant;
pub mod gelu_tanh;
pub mod merge_matmul;
pub mod precision;

use rlx_ir::{Graph, IrError, Node, NodeId};

/// Users of every node in node order (a node that reads x twice is listed
/// twice). Graph outputs are not users; see [`Graph::use_counts`].
pub(crate) fn users(g: &Graph) -> Vec<Vec<usize>> {
    let mut u = vec![Vec::new(); g.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        for x in &n.inputs {
            if let Some(list) = u.get_mut(x.0) {
                list.push(i);
            }
        }
    }
    u
}

/// Who reads each node: what a fusion pass asks before a value disappears
/// into a fused op.
pub(crate) struct Readers {
    users: Vec<Vec<usize>>,
    uses: Vec<usize>,
}

impl Readers {
    pub fn new(g: &Graph) -> Readers {
        Readers { users: users(g), uses: g.use_counts() }
    }
    /// Node x is read once, by node `by`, and is not a graph output.
    pub fn sole(&self, x: usize, by: usize) -> bool {
        self.uses[x] == 1 && self.users[x] == [by]
    }
    /// Node x is not a graph output and every node that reads it is `inside`.
    pub fn only(&self, x: usize, inside: impl Fn(usize) -> bool) -> bool {
        self.uses[x] == self.users[x].len() && self.users[x].iter().all(|&u| inside(u))
    }
}

/// The new ids of `inputs` under `map` (old id → new id); an input that was
/// dropped is an error rather than a panic, since it means a pass bug.
pub(crate) fn map_ids(map: &[Option<NodeId>], inputs: &[NodeId], pass: &str, at: usize) -> Result<Vec<NodeId>, IrError> {
    inputs
        .iter()
        .map(|x| {
            map.get(x.0)
                .copied()
                .flatten()
                .ok_or_else(|| IrError::Invalid(format!("{pass}: node {at} reads %{} which the pass removed", x.0)))
        })
        .collect()
}

/// Appends a copy of `node` reading `inputs`, keeping its name. The
/// declared shape/dtype is passed for ops that cannot infer it.
pub(crate) fn emit(g: &mut Graph, node: &Node, inputs: Vec<NodeId>) -> Result<NodeId, IrError> {
    let id = g.push(node.op.clone(), inputs, Some((node.shape.clone(), node.dtype)))?;
    if let Some(name) = &node.name {
        g.set_name(id, name.clone());
    }
    Ok(id)
}

/// Maps every graph output through `map`.
pub(crate) fn map_outputs(g: &mut Graph, old: &Graph, map: &[Option<NodeId>], pass: &str) -> Result<(), IrError> {
    for o in &old.outputs {
        let id = map.get(o.0).copied().flatten().ok_or_else(|| IrError::Invalid(format!("{pass}: output %{} was removed", o.0)))?;
        g.output(id)?;
    }
    Ok(())
}

/// What a fusion pass does with each node.
#[derive(Clone)]
pub(crate) enum Plan {
    Keep,
    /// Absorbed into a later node.
    Skip,
    /// Replaced by a fused op reading these (old) nodes.
    Replace(rlx_ir::Op, Vec<NodeId>),
}

/// The graph a fusion plan describes: kept nodes as they are, replaced ones
/// as their fused op (in the replaced node's place and with its name).
pub(crate) fn emit_plan(g: &Graph, plan: &[Plan], pass: &str) -> Result<Graph, IrError> {
    let mut out = Graph::new();
    let mut map: Vec<Option<NodeId>> = vec![None; g.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        let (op, ins) = match &plan[i] {
            Plan::Skip => continue,
            Plan::Keep => (node.op.clone(), &node.inputs),
            Plan::Replace(op, ins) => (op.clone(), ins),
        };
        let ins = map_ids(&map, ins, pass, i)?;
        let id = out.push(op, ins, Some((node.shape.clone(), node.dtype)))?;
        if let Some(name) = &node.name {
            out.set_name(id, name.clone());
        }
        map[i] = Some(id);
    }
    map_outputs(&mut out, g, &map, pass)?;
    Ok(out)
}
