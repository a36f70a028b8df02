//! Sibling matmuls that read the same lhs against 2-D params with the same
//! K, layout and dtype (Q, K, V; LLaMA gate and up) become one matmul
//! against the concatenated params, followed by one narrow per original on
//! the last axis. One wide GEMM beats several narrow ones, and the narrows
//! are free views for consumers that take strides (attention, SwiGLU).
//! Quantized matmuls of one block format merge the same way: their `[N,
//! row_bytes]` weights stack on axis 0 as they are.
//!
//! Biases (an `Add` of a `[N]` param right after every member) are merged
//! the same way so the bias epilogue still fuses.

use std::collections::BTreeMap;

use rlx_ir::{BinaryOp, Graph, IrError, NodeId, Op, QFormat};

use super::{emit, map_ids, map_outputs, users};

/// Which matmul a group is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Float { transpose_rhs: bool },
    Quant(usize),
}

struct Group {
    lhs: usize,
    kind: Kind,
    /// The matmul nodes, in node order.
    members: Vec<usize>,
    /// (add node, bias param) per member when every member has a bias.
    biases: Option<Vec<(usize, usize)>>,
}

/// The bias param of `mm` if its only user adds a `[N]` param to it.
fn bias_of(g: &Graph, users: &[Vec<usize>], uses: &[usize], mm: usize) -> Option<(usize, usize)> {
    if uses[mm] != 1 || users[mm].len() != 1 {
        return None;
    }
    let add = users[mm][0];
    let a = &g.nodes[add];
    if a.op != Op::Binary(BinaryOp::Add) || a.shape != g.nodes[mm].shape {
        return None;
    }
    let other = if a.inputs[0].0 == mm { a.inputs[1].0 } else { a.inputs[0].0 };
    let p = &g.nodes[other];
    let n = g.nodes[mm].shape.last();
    let ok = other != mm && matches!(p.op, Op::Param { .. }) && p.shape.dims() == [n] && p.dtype == g.nodes[mm].dtype;
    ok.then_some((add, other))
}

fn find_groups(g: &Graph) -> Vec<Group> {
    let users = users(g);
    let uses = g.use_counts();
    let mut by_key: BTreeMap<(usize, Kind, usize, &'static str), Vec<usize>> = BTreeMap::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let kind = match node.op {
            Op::MatMul { transpose_rhs } => Kind::Float { transpose_rhs },
            Op::QMatMul { format } => Kind::Quant(QFormat::ALL.iter().position(|f| *f == format).unwrap_or(usize::MAX)),
            _ => continue,
        };
        let Some(rhs) = node.inputs.get(1).and_then(|r| g.nodes.get(r.0)) else { continue };
        if !matches!(rhs.op, Op::Param { .. }) || rhs.shape.rank() != 2 {
            continue;
        }
        // Quantized rows hold K elements in row_bytes; the same format and
        // row size means the same K.
        let k = match kind {
            Kind::Float { transpose_rhs: true } | Kind::Quant(_) => rhs.shape.dims()[1],
            Kind::Float { transpose_rhs: false } => rhs.shape.dims()[0],
        };
        by_key.entry((node.inputs[0].0, kind, k, node.dtype.name())).or_default().push(i);
    }
    by_key
        .into_iter()
        .filter(|(_, m)| m.len() >= 2)
        .map(|((lhs, kind, _, _), members)| {
            let biases: Option<Vec<_>> = members.iter().map(|&m| bias_of(g, &users, &uses, m)).collect();
            Group { lhs, kind, members, biases }
        })
        .collect()
}

pub fn run(g: &Graph) -> Result<Graph, IrError> {
    g.verify()?;
    let groups = find_groups(g);
    let n = g.len();
    // Per node: the group it starts, or `true` when a group replaced it.
    let mut starts: Vec<Option<usize>> = vec![None; n];
    let mut replaced = vec![false; n];
    for (gi, grp) in groups.iter().enumerate() {
        starts[grp.members[0]] = Some(gi);
        for &m in &grp.members {
            replaced[m] = true;
        }
        for &(add, _) in grp.biases.iter().flatten() {
            replaced[add] = true;
        }
    }

    let mut out = Graph::new();
    let mut map: Vec<Option<NodeId>> = vec![None; n];
    // Leaves first: a group is emitted where its first member was, and the
    // params of later members must already exist there.
    for (i, node) in g.nodes.iter().enumerate() {
        if node.op.is_leaf() {
            map[i] = Some(emit(&mut out, node, vec![])?);
        }
    }
    for (i, node) in g.nodes.iter().enumerate() {
        if node.op.is_leaf() {
            continue;
        }
        if let Some(gi) = starts[i] {
            emit_group(&mut out, g, &groups[gi], &mut map)?;
            continue;
        }
        if replaced[i] {
            continue;
        }
        let ins = map_ids(&map, &node.inputs, "merge_matmul", i)?;
        map[i] = Some(emit(&mut out, node, ins)?);
    }
    map_outputs(&mut out, g, &map, "merge_matmul")?;
    Ok(out)
}

fn emit_group(out: &mut Graph, g: &Graph, grp: &Group, map: &mut [Option<NodeId>]) -> Result<(), IrError> {
    let at = grp.members[0];
    let rhs_old: Vec<NodeId> = grp.members.iter().map(|&m| g.nodes[m].inputs[1]).collect();
    let rhs = map_ids(map, &rhs_old, "merge_matmul", at)?;
    // [N, K] params (and quantized rows) stack on axis 0, [K, N] params on axis 1.
    let w = out.concat(&rhs, if grp.kind == (Kind::Float { transpose_rhs: false }) { 1 } else { 0 })?;
    let lhs = map_ids(map, &[NodeId(grp.lhs)], "merge_matmul", at)?[0];
    let op = match (grp.kind, &g.nodes[at].op) {
        (Kind::Float { transpose_rhs }, _) => Op::MatMul { transpose_rhs },
        (Kind::Quant(_), Op::QMatMul { format }) => Op::QMatMul { format: *format },
        _ => return Err(IrError::Invalid(format!("merge_matmul: node {at} is not the group's kind of matmul"))),
    };
    let mut y = out.push(op, vec![lhs, w], None)?;
    if let Some(biases) = &grp.biases {
        let old: Vec<NodeId> = biases.iter().map(|&(_, b)| NodeId(b)).collect();
        let b = map_ids(map, &old, "merge_matmul", at)?;
        let b = out.concat(&b, 0)?;
        y = out.add(y, b)?;
    }
    let axis = out.shape(y).rank() - 1;
    let mut start = 0;
    for (j, &m) in grp.members.iter().enumerate() {
        // With biases, users read the add; map the add to the narrow.
        let target = grp.biases.as_ref().map_or(m, |b| b[j].0);
        let len = g.nodes[m].shape.last();
        let part = out.narrow(y, axis, start, len)?;
        if let Some(name) = &g.nodes[target].name {
            out.set_name(part, name.clone());
        }
        map[target] = Some(part);
        start += len;
    }
    Ok(())
}
