//! Exact (erf) GELU → its tanh approximation, under
//! `CompileOptions::approximate_gelu`: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))),
//! PyTorch's `gelu(approximate="tanh")`. It differs from the exact GELU by
//! at most 4.7e-4 in absolute value (near x = -2.7, where GELU is -0.0094:
//! 5 % of that value, far below typical activations of order 1); the CUDA
//! backend then applies it in cuBLASLt's matmul epilogue instead of a kernel
//! of its own. Runs before fusion, so fusion sees the approximation as it
//! would in a model that names it.

use rlx_ir::{Activation, Graph, IrError, Node, Op};

use super::{emit, map_ids, map_outputs};

pub fn run(g: &Graph) -> Result<Graph, IrError> {
    g.verify()?;
    let mut out = Graph::new();
    let mut map = vec![None; g.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        let ins = map_ids(&map, &node.inputs, "gelu_tanh", i)?;
        let op = match &node.op {
            Op::Activation(Activation::Gelu) => Some(Op::Activation(Activation::GeluTanh)),
            Op::MatMulFused { transpose_rhs, bias, act: Some(Activation::Gelu), residual } => {
                Some(Op::MatMulFused { transpose_rhs: *transpose_rhs, bias: *bias, act: Some(Activation::GeluTanh), residual: *residual })
            }
            _ => None,
        };
        map[i] = Some(match op {
            Some(op) => emit(&mut out, &Node { op, ..node.clone() }, ins)?,
            None => emit(&mut out, node, ins)?,
        });
    }
    map_outputs(&mut out, g, &map, "gelu_tanh")?;
    Ok(out)
}
