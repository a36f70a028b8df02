//! Fuses a transformer's feed-forward block and the norm after it into one
//! [`Op::FeedForward`]: FFN1 (a matmul by a transposed 2-D weight, + bias,
//! with an activation) → FFN2 (the same without an activation, + bias, +
//! residual) → LayerNorm / RmsNorm (+ residual), where FFN1's output is
//! read only by FFN2 and FFN2's only by the norm (neither is a graph
//! output). Where the block's input is itself such a norm of the attention
//! output projection (a matmul by a transposed `[H, H]` weight read only by
//! that norm), and that norm's output is read only inside the block (by
//! FFN1, and as a residual of FFN2 or of the last norm), the projection and
//! its norm go into the op too (`attn_out`).
//!
//! The op computes exactly what the separate ops do; the schedule keeps its
//! parts (`Thunk::FeedForward`), so a backend without a kernel for the whole
//! block runs them as before. Run after `fuse`, which builds the matmul
//! epilogues and residual norms this pass reads.

use rlx_ir::{Activation, AttnOutSpec, FeedForwardSpec, FfnResidual, Graph, IrError, NodeId, Op};

use super::{emit_plan, Plan, Readers};

/// A matmul by a transposed 2-D weight with its epilogue.
struct Linear {
    a: usize,
    w: usize,
    bias: Option<usize>,
    act: Option<Activation>,
    residual: Option<usize>,
}

fn linear(g: &Graph, i: usize) -> Option<Linear> {
    let n = &g.nodes[i];
    let (bias, act, residual) = match n.op {
        Op::MatMul { transpose_rhs: true } => (false, None, false),
        Op::MatMulFused { transpose_rhs: true, bias, act, residual } => (bias, act, residual),
        _ => return None,
    };
    let ins: Vec<usize> = n.inputs.iter().map(|x| x.0).collect();
    let w = ins[1];
    if g.nodes[w].shape.rank() != 2 {
        return None;
    }
    let bias = bias.then(|| ins[2]);
    let residual = residual.then(|| ins[2 + bias.is_some() as usize]);
    Some(Linear { a: ins[0], w, bias, act, residual })
}

/// A norm of `from`'s output (a residual norm: the other addend is its
/// residual).
struct Norm {
    residual: Option<usize>,
    gamma: usize,
    beta: Option<usize>,
    rms: bool,
    eps: f32,
}

fn norm(g: &Graph, i: usize, from: usize) -> Option<Norm> {
    let n = &g.nodes[i];
    let ins: Vec<usize> = n.inputs.iter().map(|x| x.0).collect();
    let (rms, eps, residual, params) = match n.op {
        Op::LayerNorm { eps } | Op::RmsNorm { eps } if ins[0] == from => (matches!(n.op, Op::RmsNorm { .. }), eps, None, &ins[1..]),
        Op::ResidualLayerNorm { eps } | Op::ResidualRmsNorm { eps } => {
            // x + residual is the same sum in either order.
            let r = match (ins[0] == from, ins[1] == from) {
                (true, false) => ins[1],
                (false, true) => ins[0],
                _ => return None,
            };
            (matches!(n.op, Op::ResidualRmsNorm { .. }), eps, Some(r), &ins[2..])
        }
        _ => return None,
    };
    Some(Norm { residual, gamma: params[0], beta: params.get(1).copied(), rms, eps })
}

pub fn run(g: &Graph) -> Result<Graph, IrError> {
    g.verify()?;
    let readers = Readers::new(g);
    let sole = |x: usize, by: usize| readers.sole(x, by);
    let mut plan = vec![Plan::Keep; g.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        if !matches!(node.op, Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::ResidualLayerNorm { .. } | Op::ResidualRmsNorm { .. }) {
            continue;
        }
        // FFN2: one of the norm's first two inputs.
        let Some((n2, l2, nm)) = node.inputs.iter().take(2).find_map(|x| {
            let l2 = linear(g, x.0).filter(|l| l.act.is_none() && sole(x.0, i))?;
            Some((x.0, l2, norm(g, i, x.0)?))
        }) else {
            continue;
        };
        let n1 = l2.a;
        let Some(l1) = linear(g, n1).filter(|l| l.residual.is_none() && sole(n1, n2)) else { continue };
        let Some(act) = l1.act else { continue };
        let x = l1.a;
        if g.nodes[n2].shape != g.nodes[x].shape || !matches!((&plan[n1], &plan[n2]), (Plan::Keep, Plan::Keep)) {
            continue;
        }
        let h = g.nodes[x].shape.last();
        // The attention output projection and its norm before the block:
        // the norm's output read by FFN1 and otherwise only as a residual
        // of FFN2 or of the last norm.
        let tail = node_tail(g, x, h, &sole).filter(|(o, _, _)| {
            let only_here = readers.only(x, |u| u == n1 || u == n2 || u == i);
            let slots_ok = g.nodes[n1].inputs.iter().skip(1).all(|y| y.0 != x)
                && g.nodes[n2].inputs.iter().take(2).all(|y| y.0 != x)
                && l2.bias != Some(x)
                && nm.gamma != x
                && nm.beta != Some(x);
            only_here && slots_ok && matches!((&plan[*o], &plan[x]), (Plan::Keep, Plan::Keep))
        });
        // A residual that is the block's input is read there (in the tail
        // form the block's input exists only inside the op).
        let residual = |r: Option<usize>| match r {
            None => (FfnResidual::None, None),
            Some(r) if r == x => (FfnResidual::Block, None),
            Some(r) => (FfnResidual::Input, Some(NodeId(r))),
        };
        let (residual2, r2) = residual(l2.residual);
        let (norm_residual, r3) = residual(nm.residual);
        let mut ins = Vec::new();
        let attn_out = match &tail {
            Some((o, lo, n1m)) => {
                ins.extend([lo.a, lo.w].map(NodeId));
                ins.extend([lo.bias, lo.residual, n1m.residual].into_iter().flatten().map(NodeId));
                ins.extend([Some(n1m.gamma), n1m.beta].into_iter().flatten().map(NodeId));
                plan[*o] = Plan::Skip;
                plan[x] = Plan::Skip;
                Some(AttnOutSpec {
                    bias: lo.bias.is_some(),
                    residual: lo.residual.is_some(),
                    norm_residual: n1m.residual.is_some(),
                    rms: n1m.rms,
                    eps: n1m.eps,
                })
            }
            None => {
                ins.push(NodeId(x));
                None
            }
        };
        ins.extend([Some(l1.w), l1.bias, Some(l2.w), l2.bias].into_iter().flatten().map(NodeId));
        ins.extend([r2, r3].into_iter().flatten());
        ins.extend([Some(nm.gamma), nm.beta].into_iter().flatten().map(NodeId));
        let spec = FeedForwardSpec {
            act,
            bias1: l1.bias.is_some(),
            bias2: l2.bias.is_some(),
            residual2,
            norm_residual,
            rms: nm.rms,
            eps: nm.eps,
            attn_out,
        };
        plan[n1] = Plan::Skip;
        plan[n2] = Plan::Skip;
        plan[i] = Plan::Replace(Op::FeedForward(spec), ins);
    }
    emit_plan(g, &plan, "fuse_ffn")
}

/// Node `x` as a norm of an attention output projection (`[H, H]` weight,
/// no activation, read only by the norm): (projection, it, the norm).
fn node_tail(g: &Graph, x: usize, h: usize, sole: &dyn Fn(usize, usize) -> bool) -> Option<(usize, Linear, Norm)> {
    g.nodes[x].inputs.iter().take(2).find_map(|o| {
        let lo = linear(g, o.0).filter(|l| l.act.is_none() && sole(o.0, x) && g.nodes[l.w].shape.dims() == [h, h])?;
        (g.nodes[lo.a].shape == g.nodes[x].shape).then_some(())?;
        Some((o.0, lo, norm(g, x, o.0)?))
    })
}
