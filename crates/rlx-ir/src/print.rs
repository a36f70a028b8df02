use std::fmt;

use crate::{Graph, Op};

fn attrs(op: &Op) -> String {
    match op {
        Op::Input { name } | Op::Param { name } | Op::State { name } => format!("\"{name}\""),
        Op::Constant { data } => format!("{} bytes", data.len()),
        Op::MatMul { transpose_rhs } => {
            if *transpose_rhs {
                "rhsᵀ".into()
            } else {
                String::new()
            }
        }
        Op::MatMulFused { transpose_rhs, bias, act, residual } => {
            let mut s = vec![];
            if *transpose_rhs {
                s.push("rhsᵀ".to_string());
            }
            if *bias {
                s.push("+bias".into());
            }
            if let Some(a) = act {
                s.push(format!("{a:?}").to_lowercase());
            }
            if *residual {
                s.push("+residual".into());
            }
            s.join(" ")
        }
        Op::LayerNorm { eps }
        | Op::RmsNorm { eps }
        | Op::ResidualLayerNorm { eps }
        | Op::ResidualRmsNorm { eps }
        | Op::EmbedLayerNorm { eps } => format!("eps={eps:e}"),
        Op::Softmax { axis } | Op::Concat { axis } | Op::ArgMax { axis } => format!("axis={axis}"),
        Op::Reduce { op, axes, keep_dims } => format!("{op:?} axes={axes:?}{}", if *keep_dims { " keep" } else { "" }).to_lowercase(),
        Op::Narrow { axis, start, len } => format!("axis={axis} {start}..{}", start + len),
        Op::Transpose { perm } => format!("perm={perm:?}"),
        Op::TopK { k, indices } => format!("k={k} {}", if *indices { "indices" } else { "values" }),
        Op::Attention(s) => attention(s),
        Op::AttentionAppend { spec, rope } => format!(
            "{}{}",
            attention(spec),
            rope.map_or(String::new(), |r| format!(" rope theta={} {:?}{}", r.theta, r.mode, if r.factors { " factors" } else { "" }))
        ),
        Op::FeedForward(f) => {
            let res = |r: crate::FfnResidual| match r {
                crate::FfnResidual::None => "",
                crate::FfnResidual::Block => " +x",
                crate::FfnResidual::Input => " +residual",
            };
            let norm = |rms: bool, eps: f32| format!("{} eps={eps:e}", if rms { "rms_norm" } else { "layer_norm" });
            let head = f.attn_out.map_or(String::new(), |o| {
                format!(
                    "attn_out{}{} {}{} -> ",
                    if o.bias { " +bias" } else { "" },
                    if o.residual { " +residual" } else { "" },
                    norm(o.rms, o.eps),
                    if o.norm_residual { " +residual" } else { "" },
                )
            });
            format!(
                "{head}ffn1{} {} -> ffn2{}{} -> {}{}",
                if f.bias1 { " +bias" } else { "" },
                format!("{:?}", f.act).to_lowercase(),
                if f.bias2 { " +bias" } else { "" },
                res(f.residual2),
                norm(f.rms, f.eps),
                res(f.norm_residual),
            )
        }
        Op::Rope { theta, mode, head_dim } => format!("theta={theta} head_dim={head_dim} {mode:?}"),
        Op::QMatMul { format } | Op::QGather { format } => format!("{format}"),
        Op::QMatMulFused { format, norm_eps, glu, residual } => {
            let mut s = vec![format!("{format}")];
            if let Some(eps) = norm_eps {
                s.push(format!("rms_norm eps={eps}"));
            }
            if *glu {
                s.push("swiglu".into());
            }
            if *residual {
                s.push("+residual".into());
            }
            s.join(" ")
        }
        _ => String::new(),
    }
}

/// One line per node: `%3 = matmul(%1, %2) rhsᵀ : [2, 8] f32  # name`.
impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, n) in self.nodes.iter().enumerate() {
            let args: Vec<String> = n.inputs.iter().map(|x| x.to_string()).collect();
            let a = attrs(&n.op);
            write!(f, "%{i} = {}({})", n.op.name(), args.join(", "))?;
            if !a.is_empty() {
                write!(f, " {a}")?;
            }
            write!(f, " : {} {}", n.shape, n.dtype)?;
            match (&n.name, &n.op) {
                (_, Op::Input { .. } | Op::Param { .. } | Op::State { .. }) | (None, _) => {}
                (Some(name), _) => write!(f, "  # {name}")?,
            }
            writeln!(f)?;
        }
        let outs: Vec<String> = self.outputs.iter().map(|o| o.to_string()).collect();
        writeln!(f, "outputs: {}", outs.join(", "))
    }
}

fn attention(s: &crate::AttentionSpec) -> String {
    format!(
        "heads={} kv_heads={} head_dim={} scale={:.4}{}{}{}",
        s.heads,
        s.kv_heads,
        s.head_dim,
        s.scale,
        if s.causal { " causal" } else { "" },
        if s.mask { " mask" } else { "" },
        if s.valid_len { " valid_len" } else { "" }
    )
}
