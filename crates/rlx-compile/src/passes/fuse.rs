//! Fusion patterns, each only where the intermediate has a single user
//! (otherwise the intermediate must exist anyway and fusing saves nothing):
//! - MatMul (+ Add bias `[N]`) (+ Activation) (+ Add residual) → MatMulFused
//! - Add(x, r) → LayerNorm / RmsNorm → ResidualLayerNorm / ResidualRmsNorm
//! - Mul(Silu(a), b) with equal shapes → SwiGlu(a, b)
//! - LayerNorm(Gather(table, ids) + up to 2 addends that repeat over its
//!   rows, e.g. BERT's position and token-type rows) → EmbedLayerNorm
//!
//! A residual Add that feeds a norm goes to the norm, and a Silu that feeds
//! a SwiGLU product goes to the SwiGLU: both remove the same kernel, and the
//! norm / SwiGLU forms also read strided halves of merged projections.

use rlx_ir::{Activation, BinaryOp, Graph, IrError, NodeId, Op};

use super::{emit_plan, users, Plan};

struct Ctx<'a> {
    g: &'a Graph,
    users: Vec<Vec<usize>>,
    uses: Vec<usize>,
}

impl Ctx<'_> {
    /// The only user of `i`, if it has exactly one and is not an output.
    fn sole_user(&self, i: usize) -> Option<usize> {
        (self.uses[i] == 1 && self.users[i].len() == 1).then(|| self.users[i][0])
    }

    /// The operand of binary node `b` that is not `x`.
    fn other(&self, b: usize, x: usize) -> Option<usize> {
        let ins = &self.g.nodes[b].inputs;
        if ins.len() != 2 {
            return None;
        }
        match (ins[0].0 == x, ins[1].0 == x) {
            (true, false) => Some(ins[1].0),
            (false, true) => Some(ins[0].0),
            _ => None,
        }
    }

    fn is_binary(&self, i: usize, op: BinaryOp) -> bool {
        self.g.nodes[i].op == Op::Binary(op)
    }

    /// `add` is an Add of two equal shapes whose only user is a norm reading
    /// it as x: the norm will take it as its residual.
    fn feeds_norm(&self, add: usize) -> bool {
        let a = &self.g.nodes[add];
        let same = a.inputs.iter().all(|x| self.g.nodes[x.0].shape == a.shape);
        let norm = self.sole_user(add).map(|u| &self.g.nodes[u]);
        same && norm.is_some_and(|n| matches!(n.op, Op::LayerNorm { .. } | Op::RmsNorm { .. }) && n.inputs[0].0 == add)
    }

    /// For LayerNorm `norm`: its input is a chain of Adds over one Gather
    /// and at most 2 addends that repeat over the gathered rows (each read
    /// densely: a param, constant or input, or rows of one), every link
    /// used once. Returns (gather, addends, adds).
    fn embed_chain(&self, plan: &[Plan], norm: usize) -> Option<(usize, Vec<usize>, Vec<usize>)> {
        let out = &self.g.nodes[norm].shape;
        let free = |i: usize, user: usize| matches!(plan[i], Plan::Keep) && self.sole_user(i) == Some(user);
        let dense_leaf = |i: usize| {
            let n = &self.g.nodes[i];
            match &n.op {
                Op::Param { .. } | Op::Constant { .. } | Op::Input { .. } => true,
                Op::Narrow { axis: 0, .. } => self.g.nodes[n.inputs[0].0].op.is_leaf(),
                _ => false,
            }
        };
        let (mut cur, mut user) = (self.g.nodes[norm].inputs[0].0, norm);
        let (mut addends, mut adds) = (Vec::new(), Vec::new());
        loop {
            let n = &self.g.nodes[cur];
            if !free(cur, user) || n.shape != *out {
                return None;
            }
            match n.op {
                Op::Gather => return (!adds.is_empty()).then_some((cur, addends, adds)),
                Op::Binary(BinaryOp::Add) if adds.len() < 2 => {
                    let (a, b) = (n.inputs[0].0, n.inputs[1].0);
                    let addend_ok = |x: usize| dense_leaf(x) && self.g.nodes[x].shape.row_period(out).is_some();
                    let next = if addend_ok(b) && a != b {
                        addends.push(b);
                        a
                    } else if addend_ok(a) && a != b {
                        addends.push(a);
                        b
                    } else {
                        return None;
                    };
                    adds.push(cur);
                    user = cur;
                    cur = next;
                }
                _ => return None,
            }
        }
    }

    /// `s` is a Silu whose only user multiplies it by a same-shaped tensor.
    fn feeds_swiglu(&self, s: usize) -> bool {
        let Some(m) = self.sole_user(s) else { return false };
        let shape = &self.g.nodes[s].shape;
        self.is_binary(m, BinaryOp::Mul)
            && self.other(m, s).is_some_and(|o| &self.g.nodes[o].shape == shape)
            && &self.g.nodes[m].shape == shape
    }
}

pub fn run(g: &Graph) -> Result<Graph, IrError> {
    g.verify()?;
    let cx = Ctx { g, users: users(g), uses: g.use_counts() };
    let mut plan = vec![Plan::Keep; g.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        if !matches!(plan[i], Plan::Keep) {
            continue;
        }
        match &node.op {
            Op::MatMul { transpose_rhs } => matmul_chain(&cx, &mut plan, i, *transpose_rhs),
            Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
                let embed = if matches!(node.op, Op::LayerNorm { .. }) { cx.embed_chain(&plan, i) } else { None };
                if let Some((gather, addends, adds)) = embed {
                    for a in adds.into_iter().chain([gather]) {
                        plan[a] = Plan::Skip;
                    }
                    let gn = &g.nodes[gather];
                    let mut ins = vec![gn.inputs[0], gn.inputs[1], node.inputs[1], node.inputs[2]];
                    ins.extend(addends.into_iter().map(NodeId));
                    plan[i] = Plan::Replace(Op::EmbedLayerNorm { eps: *eps }, ins);
                    continue;
                }
                let add = node.inputs[0].0;
                if cx.is_binary(add, BinaryOp::Add) && matches!(plan[add], Plan::Keep) && cx.feeds_norm(add) {
                    let a = &g.nodes[add];
                    let mut ins = vec![a.inputs[0], a.inputs[1]];
                    ins.extend_from_slice(&node.inputs[1..]);
                    let op = if matches!(node.op, Op::LayerNorm { .. }) {
                        Op::ResidualLayerNorm { eps: *eps }
                    } else {
                        Op::ResidualRmsNorm { eps: *eps }
                    };
                    plan[add] = Plan::Skip;
                    plan[i] = Plan::Replace(op, ins);
                }
            }
            Op::Binary(BinaryOp::Mul) => {
                for (s, up) in [(node.inputs[0].0, node.inputs[1].0), (node.inputs[1].0, node.inputs[0].0)] {
                    let sn = &g.nodes[s];
                    let ok = sn.op == Op::Activation(Activation::Silu)
                        && s != up
                        && matches!(plan[s], Plan::Keep)
                        && cx.sole_user(s) == Some(i)
                        && g.nodes[sn.inputs[0].0].shape == node.shape
                        && g.nodes[up].shape == node.shape;
                    if ok {
                        plan[s] = Plan::Skip;
                        plan[i] = Plan::Replace(Op::SwiGlu, vec![sn.inputs[0], NodeId(up)]);
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    emit_plan(g, &plan, "fuse")
}

/// Grows an epilogue chain from matmul `mm` and records it in `plan`.
fn matmul_chain(cx: &Ctx, plan: &mut [Plan], mm: usize, transpose_rhs: bool) {
    let g = cx.g;
    let out_shape = &g.nodes[mm].shape;
    let n = out_shape.last();
    let mut cur = mm;
    let mut chain = vec![];
    // A user already claimed by an earlier chain (as its residual add)
    // must not be claimed twice.
    let free_user = |cur: usize| cx.sole_user(cur).filter(|&u| matches!(plan[u], Plan::Keep));
    let (mut bias, mut act, mut residual) = (None, None, None);
    if let Some(u) = free_user(cur) {
        let b = cx.other(u, cur).filter(|&b| g.nodes[b].shape.dims() == [n]);
        if cx.is_binary(u, BinaryOp::Add) && b.is_some() && g.nodes[u].shape == *out_shape {
            bias = b;
            chain.push(cur);
            cur = u;
        }
    }
    if let Some(u) = free_user(cur) {
        if let Op::Activation(a) = g.nodes[u].op {
            if !(a == Activation::Silu && cx.feeds_swiglu(u)) {
                act = Some(a);
                chain.push(cur);
                cur = u;
            }
        }
    }
    if let Some(u) = free_user(cur) {
        let r = cx.other(u, cur).filter(|&r| g.nodes[r].shape == *out_shape);
        if cx.is_binary(u, BinaryOp::Add) && r.is_some() && g.nodes[u].shape == *out_shape && !cx.feeds_norm(u) {
            residual = r;
            chain.push(cur);
            cur = u;
        }
    }
    if chain.is_empty() {
        return;
    }
    for &c in &chain {
        plan[c] = Plan::Skip;
    }
    let mut ins = g.nodes[mm].inputs.clone();
    ins.extend(bias.map(NodeId));
    ins.extend(residual.map(NodeId));
    let op = Op::MatMulFused { transpose_rhs, bias: bias.is_some(), act, residual: residual.is_some() };
    plan[cur] = Plan::Replace(op, ins);
}
