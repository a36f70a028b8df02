//! Fusions around quantized matmuls, for decoder steps where one token's
//! work is a few hundred small kernels and every launch saved counts. Each
//! `QMatMul` absorbs, when the intermediate values have no other reader:
//! - its input's `RmsNorm` (prologue): a norm whose every user is a
//!   quantized matmul reading it as activations is dropped, and each of
//!   those matmuls normalises its rows itself (a LLaMA block's Q/K/V and
//!   gate/up projections, merged or not);
//! - a SwiGLU over its two halves (epilogue): `SwiGlu(Narrow(y, 0..N/2),
//!   Narrow(y, N/2..N))` of a merged gate/up projection `y`;
//! - a residual `Add` of a same-shaped tensor (epilogue).
//!
//! The result is one [`Op::QMatMulFused`] placed where the last absorbed
//! node was, so every input it reads is already computed.

use rlx_ir::{BinaryOp, Graph, IrError, NodeId, Op};

use super::{emit_plan, users, Plan};

pub fn run(g: &Graph) -> Result<Graph, IrError> {
    g.verify()?;
    let users = users(g);
    let uses = g.use_counts();
    let sole_user = |i: usize| (uses[i] == 1 && users[i].len() == 1).then(|| users[i][0]);
    let mut plan = vec![Plan::Keep; g.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        let Op::QMatMul { format } = node.op else { continue };
        let (a, w) = (node.inputs[0], node.inputs[1]);
        // Prologue: every reader of the norm is a quantized matmul taking it
        // as activations (and the norm is not a graph output).
        let mut norm = None;
        if let Op::RmsNorm { eps } = g.nodes[a.0].op {
            let all_qmm = users[a.0].iter().all(|&u| {
                let un = &g.nodes[u];
                matches!(un.op, Op::QMatMul { .. }) && un.inputs[0] == a && un.inputs[1] != a
            });
            if all_qmm && uses[a.0] == users[a.0].len() && !matches!(plan[a.0], Plan::Replace(..)) {
                plan[a.0] = Plan::Skip;
                let nn = &g.nodes[a.0];
                norm = Some((nn.inputs[0], nn.inputs[1], eps));
            }
        }
        // SwiGLU over the two halves of this matmul's output.
        let mut cur = i;
        let mut glu = false;
        let shape = &node.shape;
        let (rank, n) = (shape.rank(), shape.last());
        if n % 2 == 0 && users[i].len() == 2 && uses[i] == 2 {
            let half = |u: usize, start: usize| {
                g.nodes[u].op == (Op::Narrow { axis: rank - 1, start, len: n / 2 }) && matches!(plan[u], Plan::Keep)
            };
            let (u0, u1) = (users[i][0], users[i][1]);
            let (gate, up) = if half(u0, 0) && half(u1, n / 2) {
                (u0, u1)
            } else if half(u1, 0) && half(u0, n / 2) {
                (u1, u0)
            } else {
                (usize::MAX, usize::MAX)
            };
            if gate != usize::MAX {
                if let (Some(s), Some(s2)) = (sole_user(gate), sole_user(up)) {
                    let sn = &g.nodes[s];
                    if s == s2 && sn.op == Op::SwiGlu && sn.inputs == [NodeId(gate), NodeId(up)] && matches!(plan[s], Plan::Keep) {
                        plan[gate] = Plan::Skip;
                        plan[up] = Plan::Skip;
                        glu = true;
                        cur = s;
                    }
                }
            }
        }
        // Residual add.
        let mut residual = None;
        if let Some(u) = sole_user(cur) {
            let un = &g.nodes[u];
            if un.op == Op::Binary(BinaryOp::Add) && matches!(plan[u], Plan::Keep) && un.shape == g.nodes[cur].shape {
                let other = if un.inputs[0].0 == cur { un.inputs[1] } else { un.inputs[0] };
                if other.0 != cur && g.nodes[other.0].shape == un.shape {
                    residual = Some(other);
                    cur = u;
                }
            }
        }
        if norm.is_none() && !glu && residual.is_none() {
            continue;
        }
        let mut ins = vec![norm.map_or(a, |n| n.0), w];
        ins.extend(norm.map(|n| n.1));
        ins.extend(residual);
        let op = Op::QMatMulFused { format, norm_eps: norm.map(|n| n.2), glu, residual: residual.is_some() };
        if cur != i {
            plan[i] = Plan::Skip;
        }
        plan[cur] = Plan::Replace(op, ins);
    }
    emit_plan(g, &plan, "fuse_quant")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::{DType, QFormat};

    fn count(g: &Graph, name: &str) -> usize {
        g.nodes.iter().filter(|n| n.op.name() == name).count()
    }

    /// A LLaMA block's shape: norm → merged Q/K/V-like projection read by two
    /// narrows elsewhere, residual add of the output projection, norm →
    /// merged gate/up → SwiGLU → down projection + residual.
    fn block(share_norm: bool) -> Result<Graph, IrError> {
        let (k, f) = (64, QFormat::Q8_0);
        let rb = f.row_bytes(k).ok_or_else(|| IrError::Invalid("row bytes".into()))?;
        let mut g = Graph::new();
        let x = g.input("x", [1, k], DType::F32)?;
        let g1 = g.param("g1", [k], DType::F32)?;
        let wqkv = g.param("wqkv", [3 * k, rb], DType::U8)?;
        let wo = g.param("wo", [k, rb], DType::U8)?;
        let g2 = g.param("g2", [k], DType::F32)?;
        let wgu = g.param("wgu", [4 * k, rb], DType::U8)?;
        let wd = g.param("wd", [k, rb * 2], DType::U8)?;
        let h = g.rms_norm(x, g1, 1e-5)?;
        let qkv = g.qmatmul(h, wqkv, f)?;
        let q = g.narrow(qkv, 1, 0, k)?;
        let v = g.narrow(qkv, 1, 2 * k, k)?;
        let att = g.mul(q, v)?;
        let o = g.qmatmul(att, wo, f)?;
        let x = g.add(x, o)?;
        let h2 = g.rms_norm(x, g2, 1e-5)?;
        if share_norm {
            g.output(h2)?;
        }
        let gu = g.qmatmul(h2, wgu, f)?;
        let gate = g.narrow(gu, 1, 0, 2 * k)?;
        let up = g.narrow(gu, 1, 2 * k, 2 * k)?;
        let act = g.swiglu(gate, up)?;
        let d = g.qmatmul(act, wd, f)?;
        let y = g.add(x, d)?;
        g.output(y)?;
        Ok(g)
    }

    #[test]
    fn a_block_becomes_four_fused_matmuls() -> Result<(), IrError> {
        let g = block(false)?;
        let f = run(&g)?;
        f.verify()?;
        assert_eq!(count(&f, "qmatmul_fused"), 4, "{f}");
        assert_eq!(count(&f, "qmatmul"), 0);
        assert_eq!(count(&f, "rms_norm"), 0);
        assert_eq!(count(&f, "swiglu"), 0);
        assert_eq!(count(&f, "add"), 0);
        let ops: Vec<Op> = f.nodes.iter().filter(|n| n.op.name() == "qmatmul_fused").map(|n| n.op.clone()).collect();
        let want = |norm: bool, glu, residual| Op::QMatMulFused { format: QFormat::Q8_0, norm_eps: norm.then_some(1e-5), glu, residual };
        assert_eq!(ops, vec![want(true, false, false), want(false, false, true), want(true, true, false), want(false, false, true)]);
        Ok(())
    }

    #[test]
    fn a_norm_with_another_reader_stays() -> Result<(), IrError> {
        let f = run(&block(true)?)?;
        assert_eq!(count(&f, "rms_norm"), 1, "the output norm is kept: {f}");
        assert_eq!(count(&f, "qmatmul_fused"), 4);
        Ok(())
    }
}
