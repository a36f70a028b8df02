//! Test support: a plain f64 evaluator of graphs (the reference) and an
//! interpreter of f32 schedules over a byte-addressed arena. Together they
//! check that planning and lowering preserve what the graph computes,
//! independently of any backend. Unwritten arena memory starts as NaN so a
//! read of a clobbered or never-written buffer shows up in the comparison.
#![allow(dead_code)]

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rlx_compile::{BufRef, Schedule, Space, Thunk};
use rlx_ir::{Activation, BinaryOp, DType, FfnResidual, Graph, NodeId, Op, ReduceOp};

#[derive(Debug, Clone)]
pub struct T {
    pub dims: Vec<usize>,
    pub v: Vec<f64>,
}

fn strides(d: &[usize]) -> Vec<usize> {
    let mut s = vec![1; d.len()];
    for i in (0..d.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * d[i + 1];
    }
    s
}

fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = i % dims[d].max(1);
        i /= dims[d].max(1);
    }
    idx
}

/// erf, Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7).
pub fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * (-x * x).exp();
    if x >= 0.0 {
        y
    } else {
        -y
    }
}

pub fn act(a: Activation, x: f64) -> f64 {
    match a {
        Activation::Gelu => 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2)),
        Activation::GeluTanh => 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()),
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::Relu => x.max(0.0),
        Activation::Tanh => x.tanh(),
    }
}

fn bin(op: BinaryOp, a: f64, b: f64) -> f64 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
    }
}

fn broadcast(op: BinaryOp, a: &T, b: &T, out: &[usize]) -> T {
    let r = out.len();
    let at = |t: &T, idx: &[usize]| {
        let pad = r - t.dims.len();
        let s = strides(&t.dims);
        (0..t.dims.len()).map(|j| if t.dims[j] == 1 { 0 } else { idx[j + pad] * s[j] }).sum::<usize>()
    };
    let n: usize = out.iter().product();
    let v = (0..n)
        .map(|i| {
            let idx = unravel(i, out);
            bin(op, a.v[at(a, &idx)], b.v[at(b, &idx)])
        })
        .collect();
    T { dims: out.to_vec(), v }
}

fn matmul(a: &T, b: &T, trans: bool, out: &[usize]) -> T {
    let (ar, br, or) = (a.dims.len(), b.dims.len(), out.len());
    let (m, k) = (a.dims[ar - 2], a.dims[ar - 1]);
    let n = out[or - 1];
    let batch: usize = out[..or - 2].iter().product();
    let bidx = |t: &T, bi: usize| {
        let tb = &t.dims[..t.dims.len() - 2];
        let idx = unravel(bi, &out[..or - 2]);
        let pad = idx.len() - tb.len();
        let s = strides(tb);
        (0..tb.len()).map(|j| if tb[j] == 1 { 0 } else { idx[j + pad] * s[j] }).sum::<usize>()
    };
    let mut v = vec![0.0; batch * m * n];
    for bi in 0..batch {
        let (ao, bo) = (bidx(a, bi) * m * k, bidx(b, bi) * k * n);
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for kk in 0..k {
                    let bv = if trans { b.v[bo + j * k + kk] } else { b.v[bo + kk * n + j] };
                    s += a.v[ao + i * k + kk] * bv;
                }
                v[bi * m * n + i * n + j] = s;
            }
        }
    }
    let _ = br;
    T { dims: out.to_vec(), v }
}

fn norm(x: &T, res: Option<&T>, gamma: &T, beta: Option<&T>, eps: f32, rms: bool) -> T {
    let cols = *x.dims.last().unwrap_or(&1);
    let mut v = x.v.clone();
    if let Some(r) = res {
        v.iter_mut().zip(&r.v).for_each(|(a, b)| *a += b);
    }
    for row in v.chunks_mut(cols) {
        let mean = if rms { 0.0 } else { row.iter().sum::<f64>() / cols as f64 };
        let var = row.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / cols as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for (c, a) in row.iter_mut().enumerate() {
            *a = (*a - mean) * inv * gamma.v[c] + beta.map_or(0.0, |b| b.v[c]);
        }
    }
    T { dims: x.dims.clone(), v }
}

fn permute(x: &T, perm: &[usize]) -> T {
    let out: Vec<usize> = perm.iter().map(|&p| x.dims[p]).collect();
    let s = strides(&x.dims);
    let n = x.v.len();
    let v = (0..n)
        .map(|i| {
            let idx = unravel(i, &out);
            x.v[(0..out.len()).map(|j| idx[j] * s[perm[j]]).sum::<usize>()]
        })
        .collect();
    T { dims: out, v }
}

/// Evaluates a graph in f64. Supports the ops the compiler tests build.
pub fn eval(g: &Graph, inputs: &HashMap<String, T>, params: &HashMap<String, T>) -> Vec<T> {
    let mut vals: Vec<T> = Vec::with_capacity(g.len());
    for n in &g.nodes {
        let x = |k: usize| &vals[n.inputs[k].0];
        let out = n.shape.dims();
        let t = match &n.op {
            Op::Input { name } => inputs[name].clone(),
            Op::Param { name } => params[name].clone(),
            Op::Constant { data } => {
                T { dims: out.to_vec(), v: data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect() }
            }
            Op::MatMul { transpose_rhs } => matmul(x(0), x(1), *transpose_rhs, out),
            Op::MatMulFused { transpose_rhs, bias, act: a, residual } => {
                let mut y = matmul(x(0), x(1), *transpose_rhs, out);
                let mut next = 2;
                if *bias {
                    y = broadcast(BinaryOp::Add, &y, x(2), out);
                    next = 3;
                }
                if let Some(a) = a {
                    y.v.iter_mut().for_each(|v| *v = act(*a, *v));
                }
                if *residual {
                    y = broadcast(BinaryOp::Add, &y, x(next), out);
                }
                y
            }
            Op::Binary(op) => broadcast(*op, x(0), x(1), out),
            Op::Activation(a) => T { dims: out.to_vec(), v: x(0).v.iter().map(|v| act(*a, *v)).collect() },
            Op::SwiGlu => T { dims: out.to_vec(), v: x(0).v.iter().zip(&x(1).v).map(|(g, u)| act(Activation::Silu, *g) * u).collect() },
            Op::LayerNorm { eps } => norm(x(0), None, x(1), Some(x(2)), *eps, false),
            Op::RmsNorm { eps } => norm(x(0), None, x(1), None, *eps, true),
            Op::ResidualLayerNorm { eps } => norm(x(0), Some(x(1)), x(2), Some(x(3)), *eps, false),
            Op::FeedForward(f) => {
                let s = f.slots();
                let xo = |k: Option<usize>| k.map(x);
                let block = match (f.attn_out, s.attn_out) {
                    (Some(o), Some(os)) => {
                        let mut y = matmul(x(os.a), x(os.wo), true, out);
                        for add in [xo(os.bo), xo(os.residual)].into_iter().flatten() {
                            y = broadcast(BinaryOp::Add, &y, add, out);
                        }
                        norm(&y, xo(os.norm_residual), x(os.gamma), xo(os.beta), o.eps, o.rms)
                    }
                    _ => x(s.x.unwrap_or(0)).clone(),
                };
                let residual = |r: FfnResidual, at: Option<usize>| match r {
                    FfnResidual::None => None,
                    FfnResidual::Block => Some(&block),
                    FfnResidual::Input => xo(at),
                };
                let mut hid_dims = out.to_vec();
                *hid_dims.last_mut().unwrap() = x(s.w1).dims[0];
                let mut hid = matmul(&block, x(s.w1), true, &hid_dims);
                if let Some(b) = xo(s.b1) {
                    hid = broadcast(BinaryOp::Add, &hid, b, &hid_dims);
                }
                hid.v.iter_mut().for_each(|v| *v = act(f.act, *v));
                let mut y = matmul(&hid, x(s.w2), true, out);
                for add in [xo(s.b2), residual(f.residual2, s.residual2)].into_iter().flatten() {
                    y = broadcast(BinaryOp::Add, &y, add, out);
                }
                norm(&y, residual(f.norm_residual, s.norm_residual), x(s.gamma), xo(s.beta), f.eps, f.rms)
            }
            Op::ResidualRmsNorm { eps } => norm(x(0), Some(x(1)), x(2), None, *eps, true),
            Op::Reshape | Op::Cast => T { dims: out.to_vec(), v: x(0).v.clone() },
            Op::Transpose { perm } => permute(x(0), perm),
            Op::Narrow { axis, start, .. } => {
                let src = x(0);
                let s = strides(&src.dims);
                let v = (0..n.shape.numel())
                    .map(|i| {
                        let mut idx = unravel(i, out);
                        idx[*axis] += start;
                        src.v[(0..idx.len()).map(|j| idx[j] * s[j]).sum::<usize>()]
                    })
                    .collect();
                T { dims: out.to_vec(), v }
            }
            Op::Concat { axis } => {
                let s = strides(out);
                let mut v = vec![0.0; n.shape.numel()];
                let mut at = 0;
                for k in 0..n.inputs.len() {
                    let p = x(k);
                    for (i, val) in p.v.iter().enumerate() {
                        let mut idx = unravel(i, &p.dims);
                        idx[*axis] += at;
                        v[(0..idx.len()).map(|j| idx[j] * s[j]).sum::<usize>()] = *val;
                    }
                    at += p.dims[*axis];
                }
                T { dims: out.to_vec(), v }
            }
            Op::Softmax { axis } => {
                let d = &x(0).dims;
                let (outer, len, inner): (usize, usize, usize) = (d[..*axis].iter().product(), d[*axis], d[axis + 1..].iter().product());
                let mut v = x(0).v.clone();
                for o in 0..outer {
                    for i in 0..inner {
                        let at = |l: usize| o * len * inner + l * inner + i;
                        let mx = (0..len).map(|l| v[at(l)]).fold(f64::MIN, f64::max);
                        let sum: f64 = (0..len).map(|l| (v[at(l)] - mx).exp()).sum();
                        for l in 0..len {
                            v[at(l)] = (v[at(l)] - mx).exp() / sum;
                        }
                    }
                }
                T { dims: out.to_vec(), v }
            }
            Op::Reduce { op, axes, .. } => {
                let src = x(0);
                let kept: Vec<usize> = (0..src.dims.len()).filter(|a| !axes.contains(a)).collect();
                let kd: Vec<usize> = kept.iter().map(|&a| src.dims[a]).collect();
                let cnt = src.v.len() / kd.iter().product::<usize>().max(1);
                let mut acc = vec![if *op == ReduceOp::Max { f64::MIN } else { 0.0 }; kd.iter().product()];
                let ks = strides(&kd);
                for (i, val) in src.v.iter().enumerate() {
                    let idx = unravel(i, &src.dims);
                    let o: usize = kept.iter().enumerate().map(|(j, &a)| idx[a] * ks[j]).sum();
                    acc[o] = if *op == ReduceOp::Max { acc[o].max(*val) } else { acc[o] + val };
                }
                if *op == ReduceOp::Mean {
                    acc.iter_mut().for_each(|a| *a /= cnt as f64);
                }
                T { dims: out.to_vec(), v: acc }
            }
            other => panic!("reference evaluator does not support {}", other.name()),
        };
        vals.push(t);
    }
    g.outputs.iter().map(|o| vals[o.0].clone()).collect()
}

/// Runs an all-f32 schedule. `params` are looked up by weight-slot part.
pub struct Interp<'a> {
    s: &'a Schedule,
    arena: Vec<f32>,
    weights: Vec<Vec<f32>>,
    consts: Vec<Vec<f32>>,
}

fn resolve(slot: &rlx_compile::WeightSlot, params: &HashMap<String, T>) -> Vec<f32> {
    let parts: Vec<&T> = slot.parts.iter().map(|p| &params[p]).collect();
    let axis = slot.concat_axis;
    let outer: usize = slot.shape.dims()[..axis].iter().product();
    let mut v = vec![];
    for o in 0..outer {
        for p in &parts {
            let chunk = p.v.len() / outer;
            v.extend(p.v[o * chunk..(o + 1) * chunk].iter().map(|x| *x as f32));
        }
    }
    v
}

impl<'a> Interp<'a> {
    pub fn new(s: &'a Schedule, params: &HashMap<String, T>) -> Self {
        let weights = s.weights.iter().map(|w| resolve(w, params)).collect();
        let consts =
            s.consts.iter().map(|c| c.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()).collect();
        Interp { s, arena: vec![f32::NAN; (s.arena_bytes / 4) as usize], weights, consts }
    }

    fn get(&self, b: &BufRef, e: u64) -> f64 {
        let i = (b.offset / 4 + e) as usize;
        assert!(e * 4 < b.bytes.max(4), "read past {b:?} at element {e}");
        (match b.space {
            Space::Arena => self.arena[i],
            Space::Weight(w) => self.weights[w as usize][i],
            Space::Const(c) => self.consts[c as usize][i],
            Space::State(_) => panic!("states are not supported by the test interpreter"),
        }) as f64
    }

    fn set(&mut self, b: &BufRef, e: u64, v: f64) {
        assert!(b.space == Space::Arena, "write outside the arena: {b:?}");
        assert!(e * 4 < b.bytes, "write past {b:?} at element {e}");
        self.arena[(b.offset / 4 + e) as usize] = v as f32;
    }

    pub fn run(&mut self, inputs: &HashMap<String, T>) -> Vec<T> {
        for slot in &self.s.inputs {
            let t = &inputs[&slot.name];
            for (e, v) in t.v.iter().enumerate() {
                self.set(&slot.buf, e as u64, *v);
            }
        }
        for t in &self.s.thunks {
            self.thunk(t);
        }
        self.s
            .outputs
            .iter()
            .map(|o| T { dims: o.shape.dims().to_vec(), v: (0..o.shape.numel() as u64).map(|e| self.get(&o.buf, e)).collect() })
            .collect()
    }

    fn thunk(&mut self, t: &Thunk) {
        let dot = |idx: &[usize], s: &[u64]| idx.iter().zip(s).map(|(&i, &s)| i as u64 * s).sum::<u64>();
        match t {
            Thunk::MatMul(m) => {
                for bt in 0..m.batch as u64 {
                    for i in 0..m.m as u64 {
                        for j in 0..m.n as u64 {
                            let mut s = 0.0;
                            for k in 0..m.k as u64 {
                                let bi = if m.b_trans { j * m.ldb + k } else { k * m.ldb + j };
                                s += self.get(&m.a, bt * m.a_batch_stride + i * m.lda + k) * self.get(&m.b, bt * m.b_batch_stride + bi);
                            }
                            if let Some(b) = &m.bias {
                                s += self.get(b, j);
                            }
                            if let Some(a) = m.act {
                                s = act(a, s);
                            }
                            let o = (bt * m.m as u64 + i) * m.n as u64 + j;
                            if let Some(r) = &m.residual {
                                s += self.get(r, o);
                            }
                            self.set(&m.out, o, s);
                        }
                    }
                }
            }
            Thunk::Binary { op, out_shape, a, a_strides, b, b_strides, out, .. } => {
                for e in 0..out_shape.iter().product::<usize>() {
                    let idx = unravel(e, out_shape);
                    let v = bin(*op, self.get(a, dot(&idx, a_strides)), self.get(b, dot(&idx, b_strides)));
                    self.set(out, e as u64, v);
                }
            }
            Thunk::Activation { act: a, n, x, out, .. } => {
                for e in 0..*n as u64 {
                    let v = act(*a, self.get(x, e));
                    self.set(out, e, v);
                }
            }
            Thunk::SwiGlu { rows, cols, gate, up, out, .. } => {
                for r in 0..*rows as u64 {
                    for c in 0..*cols as u64 {
                        let v =
                            act(Activation::Silu, self.get(&gate.buf, r * gate.row_stride + c)) * self.get(&up.buf, r * up.row_stride + c);
                        self.set(out, r * *cols as u64 + c, v);
                    }
                }
            }
            Thunk::Copy { shape, src, src_strides, dst, dst_strides, .. } => {
                for e in 0..shape.iter().product::<usize>() {
                    let idx = unravel(e, shape);
                    let v = self.get(src, dot(&idx, src_strides));
                    self.set(dst, dot(&idx, dst_strides), v);
                }
            }
            Thunk::Cast { n, src, dst, .. } => {
                for e in 0..*n as u64 {
                    let v = self.get(src, e);
                    self.set(dst, e, v);
                }
            }
            Thunk::Norm { rms, rows, cols, eps, x, residual, gamma, beta, out, .. } => {
                let c = *cols as u64;
                for r in 0..*rows as u64 {
                    let row: Vec<f64> =
                        (0..c).map(|j| self.get(x, r * c + j) + residual.as_ref().map_or(0.0, |b| self.get(b, r * c + j))).collect();
                    let t = T { dims: vec![1, *cols], v: row };
                    let g = T { dims: vec![*cols], v: (0..c).map(|j| self.get(gamma, j)).collect() };
                    let b = beta.as_ref().map(|b| T { dims: vec![*cols], v: (0..c).map(|j| self.get(b, j)).collect() });
                    let y = norm(&t, None, &g, b.as_ref(), *eps, *rms);
                    for j in 0..c {
                        self.set(out, r * c + j, y.v[j as usize]);
                    }
                }
            }
            Thunk::Softmax { outer, len, inner, x, out, .. } => {
                let (len, inner) = (*len as u64, *inner as u64);
                for o in 0..*outer as u64 {
                    for i in 0..inner {
                        let at = |l: u64| (o * len + l) * inner + i;
                        let vals: Vec<f64> = (0..len).map(|l| self.get(x, at(l))).collect();
                        let mx = vals.iter().copied().fold(f64::MIN, f64::max);
                        let sum: f64 = vals.iter().map(|v| (v - mx).exp()).sum();
                        for l in 0..len {
                            self.set(out, at(l), (vals[l as usize] - mx).exp() / sum);
                        }
                    }
                }
            }
            Thunk::Reduce { op, outer, len, inner, x, out, .. } => {
                let (len, inner) = (*len as u64, *inner as u64);
                for o in 0..*outer as u64 {
                    for i in 0..inner {
                        let vals = (0..len).map(|l| self.get(x, (o * len + l) * inner + i));
                        let v = match op {
                            ReduceOp::Sum => vals.sum(),
                            ReduceOp::Mean => vals.sum::<f64>() / len as f64,
                            ReduceOp::Max => vals.fold(f64::MIN, f64::max),
                        };
                        self.set(out, o * inner + i, v);
                    }
                }
            }
            Thunk::FeedForward(f) => f.parts.iter().for_each(|p| self.thunk(p)),
            other => panic!("test interpreter does not support {}", other.kind()),
        }
    }
}

pub fn random(rng: &mut StdRng, dims: &[usize]) -> T {
    T { dims: dims.to_vec(), v: (0..dims.iter().product::<usize>()).map(|_| rng.random_range(-1.0..1.0)).collect() }
}

/// Random values for every input and param of `g`.
pub fn random_feeds(g: &Graph, seed: u64) -> (HashMap<String, T>, HashMap<String, T>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut ins, mut ps) = (HashMap::new(), HashMap::new());
    for n in &g.nodes {
        match &n.op {
            Op::Input { name } => {
                ins.insert(name.clone(), random(&mut rng, n.shape.dims()));
            }
            Op::Param { name } => {
                ps.insert(name.clone(), random(&mut rng, n.shape.dims()));
            }
            _ => {}
        }
    }
    (ins, ps)
}

/// Largest |a - b| / max(1, |b|) over all elements; panics on shape mismatch.
pub fn max_rel_err(a: &[T], b: &[T]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0.0f64;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.dims, y.dims);
        for (p, q) in x.v.iter().zip(&y.v) {
            let e = (p - q).abs() / q.abs().max(1.0);
            worst = if e.is_nan() { f64::INFINITY } else { worst.max(e) };
        }
    }
    worst
}

/// x · wᵀ + b with f32 parameters `{name}.w` `[n, k]` and `{name}.b` `[n]`.
pub fn lin(g: &mut Graph, x: NodeId, name: &str, n: usize, k: usize) -> NodeId {
    let w = g.param(&format!("{name}.w"), [n, k], DType::F32).unwrap();
    let bias = g.param(&format!("{name}.b"), [n], DType::F32).unwrap();
    g.linear(x, w, Some(bias), true).unwrap()
}

/// A BERT-style encoder layer on `[2, 5, 16]`: Q/K/V projections with
/// biases, attention (or, with `attention = false`, the sum q + k * v so the
/// f64 reference can evaluate it), output projection, residual LayerNorm,
/// GELU FFN, residual LayerNorm.
pub fn bert_layer(attention: bool) -> Graph {
    let (b, s, h, f) = (2, 5, 16, 32);
    let mut g = Graph::new();
    let x = g.input("x", [b, s, h], DType::F32).unwrap();
    let q = lin(&mut g, x, "q", h, h);
    let k = lin(&mut g, x, "k", h, h);
    let v = lin(&mut g, x, "v", h, h);
    let a = if attention {
        let mask = g.input("mask", [b, s], DType::F32).unwrap();
        let spec =
            rlx_ir::AttentionSpec { heads: 2, kv_heads: 2, head_dim: h / 2, scale: 0.25, causal: false, mask: true, valid_len: false };
        g.attention(spec, q, k, v, Some(mask), None).unwrap()
    } else {
        let kv = g.mul(k, v).unwrap();
        g.add(q, kv).unwrap()
    };
    let o = lin(&mut g, a, "o", h, h);
    let r1 = g.add(o, x).unwrap();
    let g1 = g.param("ln1.g", [h], DType::F32).unwrap();
    let b1 = g.param("ln1.b", [h], DType::F32).unwrap();
    let h1 = g.layer_norm(r1, g1, b1, 1e-5).unwrap();
    let f1 = lin(&mut g, h1, "ff1", f, h);
    let f1 = g.gelu(f1).unwrap();
    let f2 = lin(&mut g, f1, "ff2", h, f);
    let r2 = g.add(f2, h1).unwrap();
    let g2 = g.param("ln2.g", [h], DType::F32).unwrap();
    let b2 = g.param("ln2.b", [h], DType::F32).unwrap();
    let y = g.layer_norm(r2, g2, b2, 1e-5).unwrap();
    g.set_name(y, "hidden");
    g.output(y).unwrap();
    g
}

/// A LLaMA-style MLP block on `[2, 3, 16]`: RmsNorm(x + r), gate/up
/// projections, silu(gate) * up, down projection plus residual.
pub fn llama_mlp() -> Graph {
    let (b, s, h, f) = (2, 3, 16, 24);
    let mut g = Graph::new();
    let x = g.input("x", [b, s, h], DType::F32).unwrap();
    let r = g.input("r", [b, s, h], DType::F32).unwrap();
    let gamma = g.param("norm.g", [h], DType::F32).unwrap();
    let xr = g.add(x, r).unwrap();
    let n = g.rms_norm(xr, gamma, 1e-6).unwrap();
    let wg = g.param("gate", [f, h], DType::F32).unwrap();
    let wu = g.param("up", [f, h], DType::F32).unwrap();
    let wd = g.param("down", [h, f], DType::F32).unwrap();
    let gt = g.matmul_t(n, wg).unwrap();
    let up = g.matmul_t(n, wu).unwrap();
    let sg = g.silu(gt).unwrap();
    let m = g.mul(sg, up).unwrap();
    let d = g.matmul_t(m, wd).unwrap();
    let y = g.add(d, xr).unwrap();
    g.output(y).unwrap();
    g
}

pub fn count(g: &Graph, pred: impl Fn(&Op) -> bool) -> usize {
    g.nodes.iter().filter(|n| pred(&n.op)).count()
}
