//! Fuses a decoder step's KV-cache append into its attention: an
//! `Attention` whose keys and values are `WriteState`s of one new row into
//! states nothing else reads, becomes one [`Op::AttentionAppend`]. When q
//! and the new keys both come from `Rope`s with the same attributes and
//! positions (and nothing else reads them), the rotations move into the op
//! too. A LLaMA layer's five kernels between its Q/K/V projection and its
//! output projection (two RoPEs, two cache writes, attention) become one.
//!
//! Only single-row steps fuse (q `[B, 1, ..]`): a prompt's many rows are
//! better served by the separate kernels.

use rlx_ir::{Graph, IrError, NodeId, Op, RopeSpec};

use super::{emit_plan, Plan, Readers};

pub fn run(g: &Graph) -> Result<Graph, IrError> {
    g.verify()?;
    let readers = Readers::new(g);
    let sole = |x: usize, by: usize| readers.sole(x, by);
    let mut plan = vec![Plan::Keep; g.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        let Op::Attention(spec) = node.op else { continue };
        if node.shape.dims().get(1) != Some(&1) {
            continue;
        }
        let (q, k, v) = (node.inputs[0].0, node.inputs[1].0, node.inputs[2].0);
        // A write of new rows into a state only this write reads, itself
        // read only by this attention: (state, value, position).
        let write = |w: usize| -> Option<(usize, usize, usize)> {
            let n = &g.nodes[w];
            let st = n.inputs.first()?.0;
            let ok = n.op == Op::WriteState && sole(w, i) && matches!(g.nodes[st].op, Op::State { .. }) && sole(st, w);
            ok.then(|| (st, n.inputs[1].0, n.inputs[2].0))
        };
        let (Some((kc, kn, kpos)), Some((vc, vn, vpos))) = (write(k), write(v)) else { continue };
        let dt = node.dtype;
        if k == v
            || kc == vc
            || kpos != vpos
            || g.nodes[kn].dtype != dt
            || g.nodes[vn].dtype != dt
            || g.nodes[kn].shape.dims().get(1) != Some(&1)
        {
            continue;
        }
        // RoPE of q and of the new keys, alike: (theta, mode, positions and factors).
        let rope_of = |x: usize, by: usize| match g.nodes[x].op {
            Op::Rope { theta, mode, head_dim } if head_dim == spec.head_dim && sole(x, by) => Some((theta, mode, &g.nodes[x].inputs[1..])),
            _ => None,
        };
        let (mut q_in, mut k_in, mut rope, mut extra): (usize, usize, Option<RopeSpec>, Vec<NodeId>) = (q, kn, None, vec![]);
        if let (Some((t1, m1, r1)), Some((t2, m2, r2))) = (rope_of(q, i), rope_of(kn, k)) {
            if t1 == t2 && m1 == m2 && r1 == r2 {
                q_in = g.nodes[q].inputs[0].0;
                k_in = g.nodes[kn].inputs[0].0;
                rope = Some(RopeSpec { theta: t1, mode: m1, factors: r1.len() == 2 });
                extra = r1.to_vec();
                plan[q] = Plan::Skip;
                plan[kn] = Plan::Skip;
            }
        }
        plan[k] = Plan::Skip;
        plan[v] = Plan::Skip;
        let mut ins = vec![NodeId(q_in), NodeId(k_in), NodeId(vn), NodeId(kc), NodeId(vc), NodeId(kpos)];
        ins.extend_from_slice(&node.inputs[3..]);
        ins.extend(extra);
        plan[i] = Plan::Replace(Op::AttentionAppend { spec, rope }, ins);
    }
    emit_plan(g, &plan, "fuse_attention")
}
