//! Dead-code elimination: keep what the outputs and the side effects
//! (state writes) need. Graph inputs and states stay even when unused: they
//! are the graph's interface (callers pass inputs and read states by name).

use rlx_ir::{Graph, IrError, Op};

use super::{emit, map_ids, map_outputs};

pub fn run(g: &Graph) -> Result<Graph, IrError> {
    g.verify()?;
    let n = g.len();
    let mut live = vec![false; n];
    for o in &g.outputs {
        if let Some(l) = live.get_mut(o.0) {
            *l = true;
        }
    }
    for (i, node) in g.nodes.iter().enumerate() {
        if node.op.has_side_effect() || matches!(node.op, Op::Input { .. } | Op::State { .. }) {
            live[i] = true;
        }
    }
    // Inputs precede their users, so one backward sweep reaches everything.
    for i in (0..n).rev() {
        if live[i] {
            for x in &g.nodes[i].inputs {
                if let Some(l) = live.get_mut(x.0) {
                    *l = true;
                }
            }
        }
    }
    let mut out = Graph::new();
    let mut map = vec![None; n];
    for (i, node) in g.nodes.iter().enumerate() {
        if live[i] {
            let ins = map_ids(&map, &node.inputs, "dce", i)?;
            map[i] = Some(emit(&mut out, node, ins)?);
        }
    }
    map_outputs(&mut out, g, &map, "dce")?;
    Ok(out)
}
