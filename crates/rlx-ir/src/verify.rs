use std::collections::HashSet;

use crate::{broadcast_shapes, DType, Graph, IrError, Op, Result, Shape};

fn same_dtype(op: &str, a: DType, b: DType, what: &str) -> Result<()> {
    if a != b {
        return Err(IrError::dtype(op, format!("{what}: expected {a}, found {b}")));
    }
    Ok(())
}

fn float(op: &str, d: DType) -> Result<()> {
    if !d.is_float() {
        return Err(IrError::dtype(op, format!("expected a float tensor, found {d}")));
    }
    Ok(())
}

fn int(op: &str, d: DType, what: &str) -> Result<()> {
    if !d.is_int() {
        return Err(IrError::dtype(op, format!("{what}: expected i32 or i64, found {d}")));
    }
    Ok(())
}

fn heads(op: &str, spec: &crate::AttentionSpec) -> Result<()> {
    if spec.heads == 0 || spec.kv_heads == 0 || spec.head_dim == 0 || !spec.heads.is_multiple_of(spec.kv_heads) {
        return Err(IrError::attr(
            op,
            format!("heads {} must be a positive multiple of kv_heads {} (head_dim {})", spec.heads, spec.kv_heads, spec.head_dim),
        ));
    }
    Ok(())
}

fn arity(op: &str, n: usize, want: std::ops::RangeInclusive<usize>) -> Result<()> {
    if !want.contains(&n) {
        return Err(IrError::Invalid(format!("{op}: expected {}..={} inputs, found {n}", want.start(), want.end())));
    }
    Ok(())
}

fn matmul_shape(op: &str, a: &Shape, b: &Shape, transpose_rhs: bool) -> Result<Shape> {
    if a.rank() < 2 || b.rank() < 2 {
        return Err(IrError::shape(op, format!("matmul needs rank >= 2 operands, found {a} and {b}")));
    }
    let (m, k) = (a.0[a.rank() - 2], a.0[a.rank() - 1]);
    let (kb, n) = if transpose_rhs { (b.0[b.rank() - 1], b.0[b.rank() - 2]) } else { (b.0[b.rank() - 2], b.0[b.rank() - 1]) };
    if k != kb {
        let how = if transpose_rhs { " (rhs transposed)" } else { "" };
        return Err(IrError::shape(op, format!("cannot multiply {a} by {b}{how}: inner dimensions {k} and {kb} differ")));
    }
    let batch = broadcast_shapes(op, &Shape(a.0[..a.rank() - 2].to_vec()), &Shape(b.0[..b.rank() - 2].to_vec()))?;
    let mut out = batch.0;
    out.push(m);
    out.push(n);
    Ok(Shape(out))
}

fn last_dim_vec(op: &str, what: &str, x: &Shape, v: &Shape) -> Result<()> {
    if v.0 != [x.last()] {
        return Err(IrError::shape(op, format!("{what} must be [{}] for input {x}, found {v}", x.last())));
    }
    Ok(())
}

/// Shape and dtype of an op's output given its inputs. `declared` is the
/// shape/dtype given by the caller for ops that cannot infer them.
/// Shape and dtype of a · wᵀ for a block-quantized weight (QMatMul and the
/// first two inputs of QMatMulFused).
fn qmatmul_shape(name: &str, format: crate::QFormat, ins: &[(&Shape, DType)]) -> Result<(Shape, DType)> {
    float(name, ins[0].1)?;
    let (a, w) = (ins[0].0, ins[1].0);
    if ins[1].1 != DType::U8 || w.rank() != 2 {
        return Err(IrError::dtype(name, format!("weight must be u8 [N, row_bytes] ({format} blocks), found {w} {}", ins[1].1)));
    }
    if a.rank() < 2 {
        return Err(IrError::shape(name, format!("a must have rank >= 2, found {a}")));
    }
    let k = a.last();
    match format.row_bytes(k) {
        Some(rb) if rb == w.0[1] => {}
        Some(rb) => {
            return Err(IrError::shape(name, format!("a row of {k} {format} elements takes {rb} bytes, weight rows have {}", w.0[1])))
        }
        None => {
            return Err(IrError::shape(name, format!("K = {k} is not a multiple of {format}'s block of {} elements", format.block_elems())))
        }
    }
    let mut out = a.0.clone();
    *out.last_mut().unwrap_or(&mut 0) = w.0[0];
    Ok((Shape(out), ins[0].1))
}

pub(crate) fn infer(op: &Op, ins: &[(&Shape, DType)], declared: Option<(&Shape, DType)>) -> Result<(Shape, DType)> {
    let name = op.name();
    let need_declared =
        || declared.map(|(s, d)| (s.clone(), d)).ok_or_else(|| IrError::Invalid(format!("{name}: output shape/dtype must be given")));
    match op {
        Op::Input { .. } | Op::Param { .. } | Op::State { .. } => {
            arity(name, ins.len(), 0..=0)?;
            need_declared()
        }
        Op::Constant { data } => {
            arity(name, ins.len(), 0..=0)?;
            let (s, d) = need_declared()?;
            if !Op::const_dtype_ok(data, d, s.numel()) {
                return Err(IrError::shape(name, format!("{} bytes of data for {s} {d} (expected {})", data.len(), s.numel() * d.size())));
            }
            Ok((s, d))
        }
        Op::MatMul { transpose_rhs } => {
            arity(name, ins.len(), 2..=2)?;
            float(name, ins[0].1)?;
            same_dtype(name, ins[0].1, ins[1].1, "rhs")?;
            Ok((matmul_shape(name, ins[0].0, ins[1].0, *transpose_rhs)?, ins[0].1))
        }
        Op::MatMulFused { transpose_rhs, bias, act: _, residual } => {
            let want = 2 + *bias as usize + *residual as usize;
            arity(name, ins.len(), want..=want)?;
            float(name, ins[0].1)?;
            for (i, (_, d)) in ins.iter().enumerate().skip(1) {
                same_dtype(name, ins[0].1, *d, &format!("input {i}"))?;
            }
            let out = matmul_shape(name, ins[0].0, ins[1].0, *transpose_rhs)?;
            let mut next = 2;
            if *bias {
                last_dim_vec(name, "bias", &out, ins[next].0)?;
                next += 1;
            }
            if *residual && ins[next].0 != &out {
                return Err(IrError::shape(name, format!("residual must be {out}, found {}", ins[next].0)));
            }
            Ok((out, ins[0].1))
        }
        Op::Binary(_) => {
            arity(name, ins.len(), 2..=2)?;
            same_dtype(name, ins[0].1, ins[1].1, "rhs")?;
            Ok((broadcast_shapes(name, ins[0].0, ins[1].0)?, ins[0].1))
        }
        Op::Activation(_) => {
            arity(name, ins.len(), 1..=1)?;
            float(name, ins[0].1)?;
            Ok((ins[0].0.clone(), ins[0].1))
        }
        Op::SwiGlu => {
            arity(name, ins.len(), 2..=2)?;
            float(name, ins[0].1)?;
            same_dtype(name, ins[0].1, ins[1].1, "up")?;
            if ins[0].0 != ins[1].0 {
                return Err(IrError::shape(name, format!("gate {} and up {} differ", ins[0].0, ins[1].0)));
            }
            Ok((ins[0].0.clone(), ins[0].1))
        }
        Op::MaskedMean => {
            arity(name, ins.len(), 2..=2)?;
            float(name, ins[0].1)?;
            float(name, ins[1].1).map_err(|_| IrError::dtype(name, format!("mask: expected a float tensor, found {}", ins[1].1)))?;
            let (x, m) = (ins[0].0, ins[1].0);
            if x.rank() != 3 || m.rank() != 2 || x.0[..2] != m.0[..] {
                return Err(IrError::shape(name, format!("expected x [B, S, D] and mask [B, S], found x {x} and mask {m}")));
            }
            // The mask may be any float type, and so may the output (the
            // precision pass keeps a pooled f32 output f32): x's by default.
            let out = match declared {
                Some((_, d)) if d.is_float() => d,
                _ => ins[0].1,
            };
            Ok((Shape(vec![x.0[0], x.0[2]]), out))
        }
        Op::EmbedLayerNorm { eps } => {
            arity(name, ins.len(), 4..=6)?;
            let (table, ids) = (ins[0], ins[1]);
            float(name, table.1)?;
            int(name, ids.1, "ids")?;
            if table.0.rank() != 2 {
                return Err(IrError::shape(name, format!("table must be [V, D], found {}", table.0)));
            }
            let mut out = ids.0 .0.clone();
            out.push(table.0 .0[1]);
            let out = Shape(out);
            norm_checks(name, *eps, (&out, table.1), &ins[2..4])?;
            for (k, (a, d)) in ins[4..].iter().enumerate() {
                same_dtype(name, table.1, *d, &format!("addend {k}"))?;
                if a.row_period(&out).is_none() {
                    return Err(IrError::shape(
                        name,
                        format!("addend {k} must be leading 1s then trailing dims of the output {out}, found {a}"),
                    ));
                }
            }
            Ok((out, table.1))
        }
        Op::LayerNorm { eps } | Op::RmsNorm { eps } => {
            let n = if matches!(op, Op::LayerNorm { .. }) { 3 } else { 2 };
            arity(name, ins.len(), n..=n)?;
            norm_checks(name, *eps, ins[0], &ins[1..])?;
            Ok((ins[0].0.clone(), ins[0].1))
        }
        Op::FeedForward(spec) => feed_forward(name, spec, ins),
        Op::ResidualLayerNorm { eps } | Op::ResidualRmsNorm { eps } => {
            let n = if matches!(op, Op::ResidualLayerNorm { .. }) { 4 } else { 3 };
            arity(name, ins.len(), n..=n)?;
            if ins[0].0 != ins[1].0 {
                return Err(IrError::shape(name, format!("x {} and residual {} differ", ins[0].0, ins[1].0)));
            }
            same_dtype(name, ins[0].1, ins[1].1, "residual")?;
            norm_checks(name, *eps, ins[0], &ins[2..])?;
            Ok((ins[0].0.clone(), ins[0].1))
        }
        Op::Softmax { axis } => {
            arity(name, ins.len(), 1..=1)?;
            float(name, ins[0].1)?;
            if *axis >= ins[0].0.rank() {
                return Err(IrError::attr(name, format!("axis {axis} out of range for {}", ins[0].0)));
            }
            Ok((ins[0].0.clone(), ins[0].1))
        }
        Op::Reduce { op: _, axes, keep_dims } => {
            arity(name, ins.len(), 1..=1)?;
            float(name, ins[0].1)?;
            let s = ins[0].0;
            if axes.is_empty() || axes.windows(2).any(|w| w[0] >= w[1]) || axes.iter().any(|&a| a >= s.rank()) {
                return Err(IrError::attr(name, format!("axes {axes:?} must be sorted, distinct and < rank of {s}")));
            }
            let mut out = vec![];
            for (i, &d) in s.0.iter().enumerate() {
                if axes.contains(&i) {
                    if *keep_dims {
                        out.push(1);
                    }
                } else {
                    out.push(d);
                }
            }
            Ok((Shape(out), ins[0].1))
        }
        Op::Gather => {
            arity(name, ins.len(), 2..=2)?;
            float(name, ins[0].1)?;
            int(name, ins[1].1, "ids")?;
            if ins[0].0.rank() != 2 {
                return Err(IrError::shape(name, format!("table must be [vocab, dim], found {}", ins[0].0)));
            }
            let mut out = ins[1].0 .0.clone();
            out.push(ins[0].0 .0[1]);
            Ok((Shape(out), ins[0].1))
        }
        Op::Narrow { axis, start, len } => {
            arity(name, ins.len(), 1..=1)?;
            let s = ins[0].0;
            if *axis >= s.rank() || start + len > s.0[*axis] || *len == 0 {
                return Err(IrError::attr(name, format!("cannot take {len} elements from {start} on axis {axis} of {s}")));
            }
            let mut out = s.0.clone();
            out[*axis] = *len;
            Ok((Shape(out), ins[0].1))
        }
        Op::Reshape => {
            arity(name, ins.len(), 1..=1)?;
            let (s, _) = need_declared()?;
            if s.numel() != ins[0].0.numel() {
                return Err(IrError::shape(
                    name,
                    format!("cannot reshape {} ({} elements) to {s} ({} elements)", ins[0].0, ins[0].0.numel(), s.numel()),
                ));
            }
            Ok((s, ins[0].1))
        }
        Op::Transpose { perm } => {
            arity(name, ins.len(), 1..=1)?;
            let s = ins[0].0;
            let mut seen = vec![false; s.rank()];
            if perm.len() != s.rank() || perm.iter().any(|&p| p >= s.rank() || std::mem::replace(&mut seen[p], true)) {
                return Err(IrError::attr(name, format!("{perm:?} is not a permutation of the axes of {s}")));
            }
            Ok((Shape(perm.iter().map(|&p| s.0[p]).collect()), ins[0].1))
        }
        Op::Concat { axis } => {
            if ins.len() < 2 {
                return Err(IrError::Invalid(format!("concat: expected at least 2 inputs, found {}", ins.len())));
            }
            let first = ins[0].0;
            if *axis >= first.rank() {
                return Err(IrError::attr(name, format!("axis {axis} out of range for {first}")));
            }
            let mut out = first.0.clone();
            out[*axis] = 0;
            for (i, (s, d)) in ins.iter().enumerate() {
                same_dtype(name, ins[0].1, *d, &format!("input {i}"))?;
                let ok = s.rank() == first.rank() && (0..s.rank()).all(|j| j == *axis || s.0[j] == first.0[j]);
                if !ok {
                    return Err(IrError::shape(name, format!("input {i} {s} does not match {first} outside axis {axis}")));
                }
                out[*axis] += s.0[*axis];
            }
            Ok((Shape(out), ins[0].1))
        }
        Op::Cast => {
            arity(name, ins.len(), 1..=1)?;
            let (_, d) = need_declared()?;
            Ok((ins[0].0.clone(), d))
        }
        Op::ArgMax { axis } => {
            arity(name, ins.len(), 1..=1)?;
            let s = ins[0].0;
            if *axis >= s.rank() {
                return Err(IrError::attr(name, format!("axis {axis} out of range for {s}")));
            }
            let mut out = s.0.clone();
            out.remove(*axis);
            Ok((Shape(out), DType::I32))
        }
        Op::TopK { k, indices } => {
            arity(name, ins.len(), 1..=1)?;
            let s = ins[0].0;
            if s.rank() == 0 || *k == 0 || *k > s.last() {
                return Err(IrError::attr(name, format!("k = {k} must be in 1..={} for {s}", s.last())));
            }
            let mut out = s.0.clone();
            *out.last_mut().unwrap_or(&mut 0) = *k;
            Ok((Shape(out), if *indices { DType::I32 } else { ins[0].1 }))
        }
        Op::Attention(spec) => {
            let want = 3 + spec.mask as usize + spec.valid_len as usize;
            arity(name, ins.len(), want..=want)?;
            float(name, ins[0].1)?;
            // K and V share one float dtype, which may differ from q's (an
            // f16 KV cache read by f32 queries).
            float(name, ins[1].1)?;
            same_dtype(name, ins[1].1, ins[2].1, "v")?;
            heads(name, spec)?;
            let (q, k, v) = (ins[0].0, ins[1].0, ins[2].0);
            if q.rank() != 3 || k.rank() != 3 || v.rank() != 3 {
                return Err(IrError::shape(name, format!("q, k, v must be [B, S, H*D], found {q}, {k}, {v}")));
            }
            if q.0[2] != spec.heads * spec.head_dim {
                return Err(IrError::shape(name, format!("q {q} must have last dim heads*head_dim = {}", spec.heads * spec.head_dim)));
            }
            let kvw = spec.kv_heads * spec.head_dim;
            if k.0 != [q.0[0], k.0[1], kvw] || v.0 != k.0 {
                return Err(IrError::shape(name, format!("k {k} and v {v} must both be [{}, Skv, {kvw}]", q.0[0])));
            }
            let mut next = 3;
            if spec.mask {
                let m = ins[next].0;
                if m.0 != [q.0[0], k.0[1]] {
                    return Err(IrError::shape(name, format!("mask must be [{}, {}], found {m}", q.0[0], k.0[1])));
                }
                next += 1;
            }
            if spec.valid_len {
                let (l, d) = ins[next];
                if !(l.0 == [1] || l.0 == [q.0[0]]) || d != DType::I32 {
                    return Err(IrError::shape(name, format!("valid_len must be an i32 [1] or [{}], found {l} {d}", q.0[0])));
                }
            }
            Ok((q.clone(), ins[0].1))
        }
        Op::AttentionAppend { spec, rope } => {
            let want = 6 + spec.mask as usize + spec.valid_len as usize + rope.map_or(0, |r| 1 + r.factors as usize);
            arity(name, ins.len(), want..=want)?;
            float(name, ins[0].1)?;
            same_dtype(name, ins[0].1, ins[1].1, "k_new")?;
            same_dtype(name, ins[0].1, ins[2].1, "v_new")?;
            float(name, ins[3].1)?;
            same_dtype(name, ins[3].1, ins[4].1, "the value cache")?;
            heads(name, spec)?;
            let (q, kn, vn, kc, vc) = (ins[0].0, ins[1].0, ins[2].0, ins[3].0, ins[4].0);
            let kvw = spec.kv_heads * spec.head_dim;
            if q.rank() != 3 || q.0[1] != 1 || q.0[2] != spec.heads * spec.head_dim {
                return Err(IrError::shape(name, format!("q must be [B, 1, {}] (one new row), found {q}", spec.heads * spec.head_dim)));
            }
            let (b, sn) = (q.0[0], q.0[1]);
            if kn.0 != [b, sn, kvw] || vn.0 != kn.0 {
                return Err(IrError::shape(name, format!("k_new {kn} and v_new {vn} must both be [{b}, {sn}, {kvw}]")));
            }
            if kc.rank() != 3 || kc.0[0] != b || kc.0[2] != kvw || kc.0[1] < sn || vc.0 != kc.0 {
                return Err(IrError::shape(name, format!("the caches {kc} and {vc} must both be [{b}, Smax >= {sn}, {kvw}]")));
            }
            let one_or_b = |s: &Shape, d: DType| (s.0 == [1] || s.0 == [b]) && d == DType::I32;
            if !one_or_b(ins[5].0, ins[5].1) {
                return Err(IrError::shape(
                    name,
                    format!("the write position must be an i32 [1] or [{b}], found {} {}", ins[5].0, ins[5].1),
                ));
            }
            let mut next = 6;
            if spec.mask {
                let m = ins[next].0;
                if m.0 != [b, kc.0[1]] {
                    return Err(IrError::shape(name, format!("mask must be [{b}, {}], found {m}", kc.0[1])));
                }
                next += 1;
            }
            if spec.valid_len {
                let (l, d) = ins[next];
                if !one_or_b(l, d) {
                    return Err(IrError::shape(name, format!("valid_len must be an i32 [1] or [{b}], found {l} {d}")));
                }
                next += 1;
            }
            if let Some(r) = rope {
                let (p, pd) = ins[next];
                if pd != DType::I32 || (p.0 != [sn] && p.0 != [b, sn]) {
                    return Err(IrError::shape(name, format!("RoPE positions must be an i32 [{sn}] or [{b}, {sn}], found {p} {pd}")));
                }
                if spec.head_dim % 2 != 0 {
                    return Err(IrError::attr(name, format!("RoPE needs an even head_dim, found {}", spec.head_dim)));
                }
                if r.theta.is_nan() || r.theta <= 0.0 {
                    return Err(IrError::attr(name, format!("theta must be positive, found {}", r.theta)));
                }
                if r.factors {
                    let (f, fd) = ins[next + 1];
                    if fd != DType::F32 || f.0 != [spec.head_dim / 2] {
                        return Err(IrError::shape(name, format!("frequency factors must be f32 [{}], found {f} {fd}", spec.head_dim / 2)));
                    }
                }
            }
            Ok((q.clone(), ins[0].1))
        }
        Op::Rope { theta, mode: _, head_dim } => {
            arity(name, ins.len(), 2..=3)?;
            if let Some((f, fd)) = ins.get(2) {
                if *fd != DType::F32 || f.0 != [head_dim / 2] {
                    return Err(IrError::shape(name, format!("frequency factors must be f32 [{}], found {f} {fd}", head_dim / 2)));
                }
            }
            float(name, ins[0].1)?;
            let (x, p) = (ins[0].0, ins[1].0);
            if ins[1].1 != DType::I32 {
                return Err(IrError::dtype(name, format!("positions must be i32, found {}", ins[1].1)));
            }
            if x.rank() != 3 || *head_dim == 0 || head_dim % 2 != 0 || x.0[2] % head_dim != 0 {
                return Err(IrError::shape(name, format!("x must be [B, S, heads*{head_dim}] with an even head_dim, found {x}")));
            }
            if p.0 != [x.0[1]] && p.0 != [x.0[0], x.0[1]] {
                return Err(IrError::shape(name, format!("positions must be [{}] or [{}, {}], found {p}", x.0[1], x.0[0], x.0[1])));
            }
            if theta.is_nan() || *theta <= 0.0 {
                return Err(IrError::attr(name, format!("theta must be positive, found {theta}")));
            }
            Ok((x.clone(), ins[0].1))
        }
        Op::WriteState => {
            arity(name, ins.len(), 3..=3)?;
            let (st, val, pos) = (ins[0].0, ins[1].0, ins[2].0);
            // A float value is converted to a float state's dtype (e.g. f32
            // keys into an f16 cache); other dtypes must match.
            if !(ins[0].1.is_float() && ins[1].1.is_float()) {
                same_dtype(name, ins[0].1, ins[1].1, "value")?;
            }
            if st.rank() != 3 || val.rank() != 3 || st.0[0] != val.0[0] || st.0[2] != val.0[2] || val.0[1] > st.0[1] {
                return Err(IrError::shape(name, format!("value {val} does not fit state {st} (both [B, S, W])")));
            }
            if !(pos.0 == [1] || pos.0 == [st.0[0]]) || ins[2].1 != DType::I32 {
                return Err(IrError::shape(name, format!("position must be an i32 [1] or [{}], found {pos} {}", st.0[0], ins[2].1)));
            }
            Ok((st.clone(), ins[0].1))
        }
        Op::QMatMul { format } => {
            arity(name, ins.len(), 2..=2)?;
            qmatmul_shape(name, *format, ins)
        }
        Op::QMatMulFused { format, norm_eps, glu, residual } => {
            let want = 2 + norm_eps.is_some() as usize + *residual as usize;
            arity(name, ins.len(), want..=want)?;
            let (mut out, dt) = qmatmul_shape(name, *format, ins)?;
            if *glu {
                let r = out.last();
                if r % 2 != 0 {
                    return Err(IrError::shape(name, format!("a gated (glu) weight needs an even row count, found {r}")));
                }
                let l = out.0.len() - 1;
                out.0[l] = r / 2;
            }
            let mut next = 2;
            if let Some(eps) = norm_eps {
                if eps.is_nan() || *eps < 0.0 {
                    return Err(IrError::attr(name, format!("eps must be >= 0, found {eps}")));
                }
                same_dtype(name, dt, ins[next].1, "gamma")?;
                if ins[next].0 .0 != [ins[0].0.last()] {
                    return Err(IrError::shape(name, format!("gamma must be [{}], found {}", ins[0].0.last(), ins[next].0)));
                }
                next += 1;
            }
            if *residual {
                same_dtype(name, dt, ins[next].1, "residual")?;
                if ins[next].0 != &out {
                    return Err(IrError::shape(name, format!("residual must be {out}, found {}", ins[next].0)));
                }
            }
            Ok((out, dt))
        }
        Op::QGather { format } => {
            arity(name, ins.len(), 2..=2)?;
            int(name, ins[1].1, "ids")?;
            let t = ins[0].0;
            if ins[0].1 != DType::U8 || t.rank() != 2 || !t.0[1].is_multiple_of(format.block_bytes()) {
                return Err(IrError::dtype(
                    name,
                    format!("table must be u8 [V, n*{}] ({format} blocks), found {t} {}", format.block_bytes(), ins[0].1),
                ));
            }
            let mut out = ins[1].0 .0.clone();
            out.push(t.0[1] / format.block_bytes() * format.block_elems());
            Ok((Shape(out), DType::F32))
        }
        Op::Sample => {
            arity(name, ins.len(), 5..=5)?;
            let (l, fp, ip, hist, pos) = (ins[0].0, ins[1].0, ins[2].0, ins[3].0, ins[4].0);
            if ins[0].1 != DType::F32 || l.rank() != 2 {
                return Err(IrError::shape(name, format!("logits must be f32 [B, V], found {l} {}", ins[0].1)));
            }
            let b = l.0[0];
            let want = |what: &str, s: &Shape, d: DType, dims: &[usize], dt: DType| -> Result<()> {
                if s.0 != dims || d != dt {
                    return Err(IrError::shape(name, format!("{what} must be {dt} {}, found {s} {d}", Shape(dims.to_vec()))));
                }
                Ok(())
            };
            want("fparams", fp, ins[1].1, &[b, 4], DType::F32)?;
            want("iparams", ip, ins[2].1, &[b, 4], DType::I32)?;
            if hist.rank() != 2 || hist.0[0] != b || ins[3].1 != DType::I32 {
                return Err(IrError::shape(name, format!("history must be i32 [{b}, H], found {hist} {}", ins[3].1)));
            }
            want("position", pos, ins[4].1, &[b], DType::I32)?;
            Ok((Shape(vec![b]), DType::I32))
        }
    }
}

/// Shape and dtype of an [`Op::FeedForward`]: every operand of the block
/// input's float dtype, widths as its docs list.
fn feed_forward(name: &str, spec: &crate::FeedForwardSpec, ins: &[(&Shape, DType)]) -> Result<(Shape, DType)> {
    let s = spec.slots();
    arity(name, ins.len(), s.count..=s.count)?;
    let x = s.attn_out.map_or(s.x.unwrap_or(0), |o| o.a);
    let (xs, dt) = ins[x];
    float(name, dt)?;
    for (i, (_, d)) in ins.iter().enumerate() {
        same_dtype(name, dt, *d, &format!("input {i}"))?;
    }
    if xs.rank() < 2 {
        return Err(IrError::shape(name, format!("the block input must have rank >= 2, found {xs}")));
    }
    let h = xs.last();
    let w1 = ins[s.w1].0;
    let i = w1.0.first().copied().unwrap_or(0);
    let want = |what: &str, at: usize, dims: &[usize]| -> Result<()> {
        if ins[at].0 .0 != dims {
            return Err(IrError::shape(name, format!("{what} must be {:?}, found {}", dims, ins[at].0)));
        }
        Ok(())
    };
    want("w1", s.w1, &[i, h])?;
    want("w2", s.w2, &[h, i])?;
    if let Some(at) = s.b1 {
        want("b1", at, &[i])?;
    }
    let mut vec_h = vec![("b2", s.b2), ("gamma", Some(s.gamma)), ("beta", s.beta)];
    let mut rows_h = vec![("residual2", s.residual2), ("norm residual", s.norm_residual)];
    if let Some(o) = s.attn_out {
        want("wo", o.wo, &[h, h])?;
        vec_h.extend([("bo", o.bo), ("gamma1", Some(o.gamma)), ("beta1", o.beta)]);
        rows_h.extend([("attention output residual", o.residual), ("norm1 residual", o.norm_residual)]);
    }
    for (what, at) in vec_h {
        at.map(|at| want(what, at, &[h])).transpose()?;
    }
    for (what, at) in rows_h {
        at.map(|at| want(what, at, xs.dims())).transpose()?;
    }
    let eps = [Some(spec.eps), spec.attn_out.map(|o| o.eps)];
    if let Some(e) = eps.into_iter().flatten().find(|e| e.is_nan() || *e < 0.0) {
        return Err(IrError::attr(name, format!("eps must be >= 0, found {e}")));
    }
    Ok((xs.clone(), dt))
}

fn norm_checks(name: &str, eps: f32, x: (&Shape, DType), params: &[(&Shape, DType)]) -> Result<()> {
    float(name, x.1)?;
    if eps.is_nan() || eps < 0.0 {
        return Err(IrError::attr(name, format!("eps must be >= 0, found {eps}")));
    }
    for (i, (s, d)) in params.iter().enumerate() {
        last_dim_vec(name, if i == 0 { "gamma" } else { "beta" }, x.0, s)?;
        same_dtype(name, x.1, *d, "gamma/beta")?;
    }
    Ok(())
}

impl Graph {
    /// Checks every node (topological order, arity, shapes and dtypes as the
    /// builders would infer them, unique leaf names) and the outputs.
    pub fn verify(&self) -> Result<()> {
        let mut names: HashSet<(&str, &str)> = HashSet::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let at = |e: IrError| IrError::AtNode { node: i, op: n.op.name().to_string(), source: Box::new(e) };
            for inp in &n.inputs {
                if inp.0 >= i {
                    return Err(IrError::BadInput { node: i, input: inp.0 });
                }
            }
            let leaf_name = match &n.op {
                Op::Input { name } => Some(("input", name.as_str())),
                Op::Param { name } => Some(("param", name.as_str())),
                Op::State { name } => Some(("state", name.as_str())),
                _ => None,
            };
            if let Some((kind, nm)) = leaf_name {
                if nm.is_empty() {
                    return Err(at(IrError::Invalid(format!("{kind} with an empty name"))));
                }
                if !names.insert((kind, nm)) {
                    return Err(at(IrError::Invalid(format!("duplicate {kind} name '{nm}'"))));
                }
            }
            let ins: Vec<(&Shape, DType)> = n.inputs.iter().map(|j| (&self.nodes[j.0].shape, self.nodes[j.0].dtype)).collect();
            let (s, d) = infer(&n.op, &ins, Some((&n.shape, n.dtype))).map_err(at)?;
            if s != n.shape || d != n.dtype {
                return Err(at(IrError::Invalid(format!("node records {} {} but its inputs give {s} {d}", n.shape, n.dtype))));
            }
            let is_state = |k: usize| matches!(self.nodes[n.inputs[k].0].op, Op::State { .. } | Op::WriteState);
            if matches!(n.op, Op::WriteState) && !is_state(0) {
                return Err(at(IrError::Invalid("write_state must write a state tensor".into())));
            }
            if matches!(n.op, Op::AttentionAppend { .. }) && !(is_state(3) && is_state(4)) {
                return Err(at(IrError::Invalid("attention_append must write its caches into state tensors".into())));
            }
        }
        if self.outputs.is_empty() {
            return Err(IrError::Invalid("graph has no outputs".into()));
        }
        for o in &self.outputs {
            if o.0 >= self.nodes.len() {
                return Err(IrError::Invalid(format!("output {o} does not exist")));
            }
        }
        Ok(())
    }
}
