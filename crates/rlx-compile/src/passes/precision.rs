//! Precision policy: every float param, constant, state and intermediate is
//! stored as `dtype`; graph inputs and outputs keep their declared dtypes
//! (a Cast follows each float input and precedes each float output whose
//! dtype changed). Integer tensors are untouched. Accumulation in f32 is
//! the kernels' job, not the graph's. Two casts are not needed: an input
//! read only as a mask (attention's, or mean pooling's, which read any
//! float type) stays as given, and a mean pooling that is an output writes
//! the output's dtype itself. RoPE's frequency factors stay f32.

use half::{bf16, f16};
use rlx_ir::{DType, Graph, IrError, NodeId, Op};

use super::{emit, map_ids};

pub fn run(g: &Graph, dtype: DType) -> Result<Graph, IrError> {
    if !dtype.is_float() {
        return Err(IrError::Attribute { op: "precision".into(), detail: format!("storage dtype must be a float type, found {dtype}") });
    }
    g.verify()?;
    let store = |d: DType| if d.is_float() { dtype } else { d };
    let users = super::users(g);
    // Input i is read only in mask slots, which take any float dtype.
    let mask_only = |i: usize| {
        !users[i].is_empty()
            && users[i].iter().all(|&u| {
                let n = &g.nodes[u];
                n.inputs.iter().enumerate().filter(|(_, x)| x.0 == i).all(|(k, _)| match &n.op {
                    Op::Attention(spec) => spec.mask && k == 3,
                    Op::AttentionAppend { spec, .. } => spec.mask && k == 6,
                    Op::MaskedMean => k == 1,
                    _ => false,
                })
            })
    };
    // Leaf i is read only as RoPE frequency factors, which stay f32.
    let factors_only = |i: usize| {
        g.nodes[i].op.is_leaf()
            && !users[i].is_empty()
            && users[i].iter().all(|&u| {
                let n = &g.nodes[u];
                let slot = match n.op {
                    Op::Rope { .. } => 2,
                    Op::AttentionAppend { rope: Some(r), .. } if r.factors => n.inputs.len() - 1,
                    _ => return false,
                };
                n.inputs.iter().enumerate().all(|(k, x)| x.0 != i || k == slot)
            })
    };
    let mut out = Graph::new();
    let mut map: Vec<Option<NodeId>> = vec![None; g.len()];
    for (i, node) in g.nodes.iter().enumerate() {
        let ins = map_ids(&map, &node.inputs, "precision", i)?;
        let id = match &node.op {
            _ if factors_only(i) => emit(&mut out, node, ins)?,
            Op::Input { .. } => {
                let x = emit(&mut out, node, ins)?;
                if node.dtype.is_float() && node.dtype != dtype && !mask_only(i) {
                    out.cast(x, dtype)?
                } else {
                    x
                }
            }
            Op::Constant { data } if node.dtype.is_float() => {
                let data = convert(data, node.dtype, dtype);
                out.push(Op::Constant { data }, vec![], Some((node.shape.clone(), dtype)))?
            }
            // A float → float cast has nothing left to do once both sides
            // are stored alike.
            Op::Cast if ins.first().is_some_and(|x| out.dtype(*x) == store(node.dtype)) => ins[0],
            _ => {
                // A pooled output no node reads: written in the output's dtype.
                let keep = node.op == Op::MaskedMean && users[i].is_empty() && g.outputs.iter().any(|o| o.0 == i);
                let d = if keep { node.dtype } else { store(node.dtype) };
                let id = out.push(node.op.clone(), ins, Some((node.shape.clone(), d)))?;
                if let Some(name) = &node.name {
                    out.set_name(id, name.clone());
                }
                id
            }
        };
        map[i] = Some(id);
    }
    for o in &g.outputs {
        let id = map.get(o.0).copied().flatten().ok_or_else(|| IrError::Invalid(format!("precision: output %{} was removed", o.0)))?;
        let want = g.dtype(*o);
        let id = if out.dtype(id) != want {
            let c = out.cast(id, want)?;
            if let Some(name) = &g.nodes[o.0].name {
                out.set_name(c, name.clone());
            }
            c
        } else {
            id
        };
        out.output(id)?;
    }
    Ok(out)
}

/// Little-endian float bytes of one float dtype as another (round to nearest).
fn convert(data: &[u8], from: DType, to: DType) -> Vec<u8> {
    let vals: Vec<f32> = match from {
        DType::F16 => data.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::BF16 => data.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    };
    match to {
        DType::F16 => vals.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
        DType::BF16 => vals.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
        _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}
