//! Lowering: one or more thunks per compute node, over the places the
//! planner chose. Views, weights, states and constants cost nothing here.

use rlx_ir::{DType, FeedForwardSpec, FfnResidual, Graph, Node, Op};

use crate::layout::{dense_strides, rows_view, seq_view, span_bytes, Loc, Root};
use crate::plan::{lower_err, reduce_needs_copy, ArenaPlan, BufferKind};
use crate::{
    AppendRope, AttentionAppendThunk, AttentionThunk, BufRef, CompileError, FeedForwardThunk, MatMulThunk, QNorm, RowsView, Schedule,
    SeqView, Space, TensorSlot, Thunk,
};

type Result<T> = std::result::Result<T, CompileError>;

struct Lowerer<'a> {
    g: &'a Graph,
    plan: &'a ArenaPlan,
    thunks: Vec<Thunk>,
}

fn es(d: DType) -> u64 {
    d.size() as u64
}

/// Strides that read `in_dims` (with `in_strides`) broadcast to `out_dims`.
fn broadcast_strides(in_dims: &[usize], in_strides: &[u64], out_dims: &[usize]) -> Vec<u64> {
    let pad = out_dims.len() - in_dims.len().min(out_dims.len());
    (0..out_dims.len()).map(|j| if j < pad || in_dims[j - pad] == 1 { 0 } else { in_strides[j - pad] }).collect()
}

impl Lowerer<'_> {
    fn node(&self, i: usize) -> &Node {
        &self.g.nodes[i]
    }

    fn input(&self, i: usize, k: usize) -> Result<usize> {
        self.node(i).inputs.get(k).map(|x| x.0).ok_or_else(|| lower_err(self.g, i, format!("missing input {k}")))
    }

    fn at(&self, loc: &Loc, extra: u64, bytes: u64) -> BufRef {
        let (space, base) = match loc.root {
            Root::Arena(b) => (Space::Arena, self.plan.buffers[b].offset),
            Root::Weight(w) => (Space::Weight(w), 0),
            Root::State(s) => (Space::State(s), 0),
            Root::Const(c) => (Space::Const(c), 0),
        };
        BufRef { space, offset: base + loc.offset + extra, bytes }
    }

    /// The bytes node `i` covers, through its strides.
    fn buf(&self, i: usize) -> BufRef {
        let n = self.node(i);
        let loc = &self.plan.locs[i];
        self.at(loc, 0, span_bytes(n.shape.dims(), &loc.strides, n.dtype.size()))
    }

    /// Node `i` as a dense tensor; kernels without stride support need this.
    fn dense(&self, owner: usize, i: usize) -> Result<BufRef> {
        if !self.plan.locs[i].contiguous {
            return Err(lower_err(self.g, owner, format!("input %{i} is a strided view but this kernel needs a dense tensor")));
        }
        Ok(self.buf(i))
    }

    fn buffer(&self, b: usize) -> BufRef {
        let buf = &self.plan.buffers[b];
        BufRef { space: Space::Arena, offset: buf.offset, bytes: buf.bytes }
    }

    /// Node `i` writes its own buffer (or runs in place): not a view.
    fn computes(&self, i: usize) -> bool {
        self.plan.in_place[i]
            || matches!(self.plan.locs[i].root, Root::Arena(b) if self.plan.buffers[b].node == i && self.plan.buffers[b].kind == BufferKind::Value)
    }

    fn seq(&self, owner: usize, i: usize) -> Result<SeqView> {
        let loc = &self.plan.locs[i];
        let (batch_stride, row_stride) = seq_view(self.node(i).shape.dims(), &loc.strides)
            .ok_or_else(|| lower_err(self.g, owner, format!("input %{i} cannot be read as [B, S, W] through strides")))?;
        Ok(SeqView { buf: self.buf(i), batch_stride, row_stride })
    }

    fn rows(&self, owner: usize, i: usize) -> Result<(usize, RowsView)> {
        let loc = &self.plan.locs[i];
        let (rows, row_stride) = rows_view(self.node(i).shape.dims(), &loc.strides)
            .ok_or_else(|| lower_err(self.g, owner, format!("input %{i} cannot be read as rows through strides")))?;
        Ok((rows, RowsView { buf: self.buf(i), row_stride }))
    }

    fn copy(&mut self, dtype: DType, shape: &[usize], src: BufRef, src_strides: Vec<u64>, dst: BufRef, dst_strides: Vec<u64>) {
        self.thunks.push(Thunk::Copy { dtype, shape: shape.to_vec(), src, src_strides, dst, dst_strides });
    }

    fn lower_node(&mut self, i: usize) -> Result<()> {
        let g = self.g;
        let node = &g.nodes[i];
        let dims = node.shape.dims();
        let dtype = node.dtype;
        let numel = node.shape.numel();
        let rows_cols = || (numel / node.shape.last().max(1), node.shape.last());
        let outer_len_inner =
            |x: &[usize], axis: usize| -> (usize, usize, usize) { (x[..axis].iter().product(), x[axis], x[axis + 1..].iter().product()) };
        let in0 = |s: &Self| s.input(i, 0);
        let thunk = match &node.op {
            Op::Input { .. } | Op::Param { .. } | Op::State { .. } | Op::Constant { .. } | Op::Reshape => return Ok(()),
            Op::Cast | Op::Concat { .. } | Op::Narrow { .. } if !self.computes(i) => return Ok(()),
            Op::MatMul { transpose_rhs } => self.matmul(i, *transpose_rhs, false, None, false)?,
            Op::MatMulFused { transpose_rhs, bias, act, residual } => self.matmul(i, *transpose_rhs, *bias, *act, *residual)?,
            Op::Binary(op) => {
                let (a, b) = (in0(self)?, self.input(i, 1)?);
                let (la, lb) = (&self.plan.locs[a], &self.plan.locs[b]);
                Thunk::Binary {
                    op: *op,
                    dtype,
                    out_shape: dims.to_vec(),
                    a: self.buf(a),
                    a_strides: broadcast_strides(g.nodes[a].shape.dims(), &la.strides, dims),
                    b: self.buf(b),
                    b_strides: broadcast_strides(g.nodes[b].shape.dims(), &lb.strides, dims),
                    out: self.buf(i),
                }
            }
            Op::Activation(act) => Thunk::Activation { act: *act, dtype, n: numel, x: self.dense(i, in0(self)?)?, out: self.buf(i) },
            Op::LayerNorm { eps } | Op::RmsNorm { eps } | Op::ResidualLayerNorm { eps } | Op::ResidualRmsNorm { eps } => {
                let residual = matches!(node.op, Op::ResidualLayerNorm { .. } | Op::ResidualRmsNorm { .. });
                let rms = matches!(node.op, Op::RmsNorm { .. } | Op::ResidualRmsNorm { .. });
                let p = if residual { 2 } else { 1 };
                let (rows, cols) = rows_cols();
                Thunk::Norm {
                    rms,
                    dtype,
                    rows,
                    cols,
                    eps: *eps,
                    x: self.dense(i, in0(self)?)?,
                    residual: if residual { Some(self.dense(i, self.input(i, 1)?)?) } else { None },
                    gamma: self.dense(i, self.input(i, p)?)?,
                    beta: if rms { None } else { Some(self.dense(i, self.input(i, p + 1)?)?) },
                    out: self.buf(i),
                }
            }
            Op::EmbedLayerNorm { eps } => {
                let (t, ids) = (in0(self)?, self.input(i, 1)?);
                let td = g.nodes[t].shape.dims();
                let mut addends = Vec::new();
                for k in 4..node.inputs.len() {
                    let a = self.input(i, k)?;
                    let period = g.nodes[a]
                        .shape
                        .row_period(&node.shape)
                        .ok_or_else(|| lower_err(g, i, format!("addend %{a} does not repeat over rows")))?;
                    addends.push((self.dense(i, a)?, period));
                }
                let (rows, cols) = rows_cols();
                Thunk::EmbedNorm {
                    dtype,
                    id_dtype: g.nodes[ids].dtype,
                    rows,
                    cols,
                    vocab: td[0],
                    eps: *eps,
                    table: self.dense(i, t)?,
                    ids: self.dense(i, ids)?,
                    addends,
                    gamma: self.dense(i, self.input(i, 2)?)?,
                    beta: self.dense(i, self.input(i, 3)?)?,
                    out: self.buf(i),
                }
            }
            Op::Softmax { axis } => {
                let (outer, len, inner) = outer_len_inner(dims, *axis);
                Thunk::Softmax { dtype, outer, len, inner, x: self.dense(i, in0(self)?)?, out: self.buf(i) }
            }
            Op::ArgMax { axis } => {
                let x = in0(self)?;
                let (outer, len, inner) = outer_len_inner(g.nodes[x].shape.dims(), *axis);
                Thunk::ArgMax { dtype: g.nodes[x].dtype, outer, len, inner, x: self.dense(i, x)?, out: self.buf(i) }
            }
            Op::Reduce { op, axes, .. } => self.reduce(i, *op, axes)?,
            Op::TopK { k, indices } => {
                let x = in0(self)?;
                let xs = &g.nodes[x].shape;
                let out = self.buf(i);
                Thunk::TopK {
                    dtype: g.nodes[x].dtype,
                    rows: xs.numel() / xs.last().max(1),
                    len: xs.last(),
                    k: *k,
                    x: self.dense(i, x)?,
                    values: (!indices).then_some(out),
                    indices: indices.then_some(out),
                }
            }
            Op::Gather => {
                let (t, ids) = (in0(self)?, self.input(i, 1)?);
                let td = g.nodes[t].shape.dims();
                Thunk::Gather {
                    dtype,
                    id_dtype: g.nodes[ids].dtype,
                    n: g.nodes[ids].shape.numel(),
                    dim: td[1],
                    vocab: td[0],
                    table: self.dense(i, t)?,
                    ids: self.dense(i, ids)?,
                    out: self.buf(i),
                }
            }
            Op::Narrow { axis, start, .. } => {
                let x = in0(self)?;
                let loc = &self.plan.locs[x];
                let off = *start as u64 * loc.strides[*axis] * es(dtype);
                let src = self.at(loc, off, span_bytes(dims, &loc.strides, dtype.size()));
                let strides = loc.strides.clone();
                Thunk::Copy { dtype, shape: dims.to_vec(), src, src_strides: strides, dst: self.buf(i), dst_strides: dense_strides(dims) }
            }
            Op::Transpose { perm } => {
                let x = in0(self)?;
                let loc = &self.plan.locs[x];
                let src_strides: Vec<u64> = perm.iter().map(|&p| loc.strides[p]).collect();
                Thunk::Copy {
                    dtype,
                    shape: dims.to_vec(),
                    src: self.buf(x),
                    src_strides,
                    dst: self.buf(i),
                    dst_strides: dense_strides(dims),
                }
            }
            Op::Concat { axis } => {
                let out_loc = self.plan.locs[i].clone();
                let mut at = 0u64;
                for x in &node.inputs {
                    let part = g.nodes[x.0].shape.dims();
                    let off = at * out_loc.strides[*axis] * es(dtype);
                    let dst = self.at(&out_loc, off, span_bytes(part, &out_loc.strides, dtype.size()));
                    let src = self.buf(x.0);
                    let src_strides = self.plan.locs[x.0].strides.clone();
                    self.copy(dtype, part, src, src_strides, dst, out_loc.strides.clone());
                    at += part[*axis] as u64;
                }
                return Ok(());
            }
            Op::Cast => {
                let x = in0(self)?;
                Thunk::Cast { from: g.nodes[x].dtype, to: dtype, n: numel, src: self.dense(i, x)?, dst: self.buf(i) }
            }
            Op::Attention(spec) => {
                let (q, k) = (in0(self)?, self.input(i, 1)?);
                let mut next = 3;
                let mask = if spec.mask {
                    next += 1;
                    Some(self.input(i, 3)?)
                } else {
                    None
                };
                let valid_len = if spec.valid_len { Some(self.input(i, next)?) } else { None };
                let valid_len_per_batch = valid_len.is_some_and(|l| g.nodes[l].shape.dims() != [1]);
                let valid_len = valid_len.map(|l| self.dense(i, l)).transpose()?;
                Thunk::Attention(AttentionThunk {
                    dtype,
                    kv_dtype: g.nodes[k].dtype,
                    batch: dims[0],
                    heads: spec.heads,
                    kv_heads: spec.kv_heads,
                    head_dim: spec.head_dim,
                    q_len: dims[1],
                    kv_len: g.nodes[k].shape.dims()[1],
                    scale: spec.scale,
                    causal: spec.causal,
                    q: self.seq(i, q)?,
                    k: self.seq(i, k)?,
                    v: self.seq(i, self.input(i, 2)?)?,
                    mask: mask.map(|m| self.dense(i, m)).transpose()?,
                    mask_dtype: mask.map_or(dtype, |m| g.nodes[m].dtype),
                    valid_len,
                    valid_len_per_batch,
                    out: self.buf(i),
                })
            }
            Op::AttentionAppend { spec, rope } => self.attention_append(i, spec, rope.as_ref())?,
            Op::FeedForward(f) => self.feed_forward(i, f)?,
            Op::Rope { theta, mode, head_dim } => {
                let (x, pos) = (in0(self)?, self.input(i, 1)?);
                Thunk::Rope {
                    dtype,
                    mode: *mode,
                    theta: *theta,
                    batch: dims[0],
                    seq: dims[1],
                    heads: dims[2] / head_dim.max(&1),
                    head_dim: *head_dim,
                    x: self.seq(i, x)?,
                    positions: self.dense(i, pos)?,
                    positions_per_batch: g.nodes[pos].shape.rank() == 2,
                    out: self.buf(i),
                    freq_factors: match node.inputs.get(2) {
                        Some(f) => Some(self.dense(i, f.0)?),
                        None => None,
                    },
                }
            }
            Op::MaskedMean => {
                let (x, m) = (in0(self)?, self.input(i, 1)?);
                let xd = g.nodes[x].shape.dims();
                Thunk::MaskedMean {
                    dtype: g.nodes[x].dtype,
                    mask_dtype: g.nodes[m].dtype,
                    out_dtype: dtype,
                    batch: xd[0],
                    seq: xd[1],
                    dim: xd[2],
                    x: self.dense(i, x)?,
                    mask: self.dense(i, m)?,
                    out: self.buf(i),
                }
            }
            Op::SwiGlu => {
                let (rows, gate) = self.rows(i, in0(self)?)?;
                let (_, up) = self.rows(i, self.input(i, 1)?)?;
                Thunk::SwiGlu { dtype, rows, cols: node.shape.last(), gate, up, out: self.buf(i) }
            }
            Op::WriteState => {
                let (st, val, pos) = (in0(self)?, self.input(i, 1)?, self.input(i, 2)?);
                let vd = g.nodes[val].shape.dims();
                Thunk::WriteState {
                    dtype,
                    value_dtype: g.nodes[val].dtype,
                    batch: dims[0],
                    max_rows: dims[1],
                    new_rows: vd[1],
                    width: dims[2],
                    state: self.dense(i, st)?,
                    value: self.dense(i, val)?,
                    position: self.dense(i, pos)?,
                    positions_per_batch: g.nodes[pos].shape.dims() != [1],
                }
            }
            Op::QMatMul { .. } | Op::QMatMulFused { .. } => {
                let (format, norm_eps, glu, residual) = match &node.op {
                    Op::QMatMulFused { format, norm_eps, glu, residual } => (*format, *norm_eps, *glu, *residual),
                    Op::QMatMul { format } => (*format, None, false, false),
                    op => return Err(lower_err(g, i, format!("{} is not a quantized matmul", op.name()))),
                };
                let (a, w) = (in0(self)?, self.input(i, 1)?);
                let (rows, a_rows) = self.rows(i, a)?;
                let norm = match norm_eps {
                    Some(eps) => Some(QNorm { gamma: self.dense(i, self.input(i, 2)?)?, eps }),
                    None => None,
                };
                let next = 2 + norm.is_some() as usize;
                let residual = if residual { Some(self.dense(i, self.input(i, next)?)?) } else { None };
                let scratch = self.plan.scratch[i].map(|b| self.buffer(b));
                Thunk::QMatMul {
                    format,
                    dtype,
                    rows,
                    n: node.shape.last(),
                    k: g.nodes[a].shape.last(),
                    a: a_rows.buf,
                    lda: a_rows.row_stride,
                    w: self.dense(i, w)?,
                    out: self.buf(i),
                    norm,
                    glu,
                    residual,
                    scratch,
                }
            }
            Op::QGather { format } => {
                let (t, ids) = (in0(self)?, self.input(i, 1)?);
                Thunk::QGather {
                    format: *format,
                    id_dtype: g.nodes[ids].dtype,
                    n: g.nodes[ids].shape.numel(),
                    dim: node.shape.last(),
                    vocab: g.nodes[t].shape.dims()[0],
                    table: self.dense(i, t)?,
                    ids: self.dense(i, ids)?,
                    out: self.buf(i),
                }
            }
            Op::Sample => {
                let l = in0(self)?;
                let ld = g.nodes[l].shape.dims();
                let h = self.input(i, 3)?;
                Thunk::Sample {
                    batch: ld[0],
                    vocab: ld[1],
                    history_len: g.nodes[h].shape.dims()[1],
                    logits: self.dense(i, l)?,
                    fparams: self.dense(i, self.input(i, 1)?)?,
                    iparams: self.dense(i, self.input(i, 2)?)?,
                    history: self.dense(i, h)?,
                    position: self.dense(i, self.input(i, 4)?)?,
                    out: self.buf(i),
                }
            }
        };
        self.thunks.push(thunk);
        Ok(())
    }

    fn attention_append(&self, i: usize, spec: &rlx_ir::AttentionSpec, rope: Option<&rlx_ir::RopeSpec>) -> Result<Thunk> {
        let g = self.g;
        let node = &g.nodes[i];
        let dims = node.shape.dims();
        let input = |k: usize| self.input(i, k);
        let (kc, vc, pos) = (input(3)?, input(4)?, input(5)?);
        let mut next = 6;
        let mask = if spec.mask {
            next += 1;
            Some(input(6)?)
        } else {
            None
        };
        let valid_len = if spec.valid_len {
            next += 1;
            Some(input(next - 1)?)
        } else {
            None
        };
        let per_batch = |x: usize| g.nodes[x].shape.dims() != [1];
        let q = self.seq(i, input(0)?)?;
        let rope = match rope {
            Some(r) => {
                let b = self.plan.scratch[i].ok_or_else(|| lower_err(g, i, "attention_append with RoPE has no scratch buffer"))?;
                let scratch = self.buffer(b);
                let q_bytes = (node.shape.numel() * node.dtype.size()) as u64;
                let positions = input(next)?;
                Some(AppendRope {
                    mode: r.mode,
                    theta: r.theta,
                    positions: self.dense(i, positions)?,
                    positions_per_batch: g.nodes[positions].shape.rank() == 2,
                    freq_factors: if r.factors { Some(self.dense(i, input(next + 1)?)?) } else { None },
                    q_out: BufRef { bytes: q_bytes, ..scratch },
                    k_out: BufRef { offset: scratch.offset + q_bytes, bytes: scratch.bytes - q_bytes, ..scratch },
                })
            }
            None => None,
        };
        let attn_q = match &rope {
            Some(r) => SeqView { buf: r.q_out, batch_stride: dims[2] as u64, row_stride: dims[2] as u64 },
            None => q,
        };
        let attn = AttentionThunk {
            dtype: node.dtype,
            kv_dtype: g.nodes[kc].dtype,
            batch: dims[0],
            heads: spec.heads,
            kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            q_len: dims[1],
            kv_len: g.nodes[kc].shape.dims()[1],
            scale: spec.scale,
            causal: spec.causal,
            q: attn_q,
            k: self.seq(i, kc)?,
            v: self.seq(i, vc)?,
            mask: mask.map(|m| self.dense(i, m)).transpose()?,
            mask_dtype: mask.map_or(node.dtype, |m| g.nodes[m].dtype),
            valid_len: valid_len.map(|l| self.dense(i, l)).transpose()?,
            valid_len_per_batch: valid_len.is_some_and(per_batch),
            out: self.buf(i),
        };
        Ok(Thunk::AttentionAppend(Box::new(AttentionAppendThunk {
            attn,
            q,
            k_new: self.seq(i, input(1)?)?,
            v_new: self.seq(i, input(2)?)?,
            position: self.dense(i, pos)?,
            position_per_batch: per_batch(pos),
            rope,
        })))
    }

    /// The parts of a fused feed-forward block over its scratch
    /// (`plan::ffn_scratch`), as the separate ops would lower: each matmul
    /// one GEMM of all rows by its 2-D weight.
    fn feed_forward(&self, i: usize, f: &FeedForwardSpec) -> Result<Thunk> {
        let g = self.g;
        let node = &g.nodes[i];
        let (dtype, h) = (node.dtype, node.shape.last());
        let s = f.slots();
        let input = |k: usize| self.input(i, k);
        let dense = |k: Option<usize>| k.map(|k| self.dense(i, self.input(i, k)?)).transpose();
        let n_i = g.nodes[input(s.w1)?].shape.dims()[0];
        let b = self.plan.scratch[i].ok_or_else(|| lower_err(g, i, "feed_forward has no scratch buffer"))?;
        let scratch = self.buffer(b);
        let mut at = scratch.offset;
        let mut part = |bytes: u64| {
            at += bytes;
            BufRef { space: Space::Arena, offset: at - bytes, bytes }
        };
        let sizes = crate::plan::ffn_scratch(g, i, f);
        let (rows, x_in) = self.rows(i, input(s.attn_out.map_or(s.x.unwrap_or(0), |o| o.a))?)?;
        let mm = |a: RowsView, k: usize, n: usize, w: usize, bias: Option<BufRef>, act, residual, out| -> Result<MatMulThunk> {
            Ok(MatMulThunk {
                dtype,
                batch: 1,
                m: rows,
                n,
                k,
                a: a.buf,
                lda: a.row_stride,
                a_batch_stride: rows as u64 * a.row_stride,
                b: self.dense(i, input(w)?)?,
                b_trans: true,
                ldb: k as u64,
                b_batch_stride: 0,
                bias,
                act,
                residual,
                out,
            })
        };
        let norm = |rms: bool,
                    eps: f32,
                    x: BufRef,
                    residual: Option<BufRef>,
                    gamma: usize,
                    beta: Option<usize>,
                    out: BufRef|
         -> Result<Thunk> {
            Ok(Thunk::Norm { rms, dtype, rows, cols: h, eps, x, residual, gamma: self.dense(i, input(gamma)?)?, beta: dense(beta)?, out })
        };
        let h_buf = part(sizes[0]);
        let y_buf = part(sizes[1]);
        let mut parts = Vec::new();
        let x = match (f.attn_out, s.attn_out) {
            (Some(o), Some(os)) => {
                let (proj, x1) = (part(sizes[2]), part(sizes[3]));
                parts.push(Thunk::MatMul(mm(x_in, h, h, os.wo, dense(os.bo)?, None, dense(os.residual)?, proj)?));
                parts.push(norm(o.rms, o.eps, proj, dense(os.norm_residual)?, os.gamma, os.beta, x1)?);
                RowsView { buf: x1, row_stride: h as u64 }
            }
            _ => x_in,
        };
        let residual = |r: FfnResidual, at: Option<usize>| -> Result<Option<BufRef>> {
            match r {
                FfnResidual::None => Ok(None),
                FfnResidual::Block if x.row_stride == h as u64 => Ok(Some(x.buf)),
                FfnResidual::Block => Err(lower_err(g, i, "the block's input is a strided view but a residual reads it densely")),
                FfnResidual::Input => dense(at),
            }
        };
        parts.push(Thunk::MatMul(mm(x, h, n_i, s.w1, dense(s.b1)?, Some(f.act), None, h_buf)?));
        let h_rows = RowsView { buf: h_buf, row_stride: n_i as u64 };
        parts.push(Thunk::MatMul(mm(h_rows, n_i, h, s.w2, dense(s.b2)?, None, residual(f.residual2, s.residual2)?, y_buf)?));
        parts.push(norm(f.rms, f.eps, y_buf, residual(f.norm_residual, s.norm_residual)?, s.gamma, s.beta, self.buf(i))?);
        Ok(Thunk::FeedForward(Box::new(FeedForwardThunk { parts })))
    }

    fn reduce(&mut self, i: usize, op: rlx_ir::ReduceOp, axes: &[usize]) -> Result<Thunk> {
        let x = self.input(i, 0)?;
        let xd = self.node(x).shape.dims().to_vec();
        let dtype = self.node(i).dtype;
        let out = self.buf(i);
        if !reduce_needs_copy(axes) {
            let (a0, a1) = (axes[0], axes[axes.len() - 1]);
            let (outer, len, inner) = (xd[..a0].iter().product(), xd[a0..=a1].iter().product(), xd[a1 + 1..].iter().product());
            return Ok(Thunk::Reduce { op, dtype, outer, len, inner, x: self.dense(i, x)?, out });
        }
        // Move the reduced axes last (a transposing copy into scratch), then
        // reduce them as one contiguous run.
        let b = self.plan.scratch[i].ok_or_else(|| lower_err(self.g, i, "reduce over non-adjacent axes has no scratch buffer"))?;
        let kept: Vec<usize> = (0..xd.len()).filter(|a| !axes.contains(a)).collect();
        let perm: Vec<usize> = kept.iter().chain(axes).copied().collect();
        let shape: Vec<usize> = perm.iter().map(|&p| xd[p]).collect();
        let src_loc = &self.plan.locs[x];
        let src_strides = perm.iter().map(|&p| src_loc.strides[p]).collect();
        let scratch = self.buffer(b);
        self.copy(dtype, &shape, self.buf(x), src_strides, scratch, dense_strides(&shape));
        let outer = kept.iter().map(|&a| xd[a]).product();
        let len = axes.iter().map(|&a| xd[a]).product();
        Ok(Thunk::Reduce { op, dtype, outer, len, inner: 1, x: scratch, out })
    }

    fn matmul(&self, i: usize, b_trans: bool, bias: bool, act: Option<rlx_ir::Activation>, residual: bool) -> Result<Thunk> {
        let g = self.g;
        let node = &g.nodes[i];
        let (a, b) = (self.input(i, 0)?, self.input(i, 1)?);
        let (ad, bd, od) = (g.nodes[a].shape.dims(), g.nodes[b].shape.dims(), node.shape.dims());
        let (ar, br, or) = (ad.len(), bd.len(), od.len());
        let (m, k, n) = (ad[ar - 2], ad[ar - 1], od[or - 1]);
        let (rows, a_rows) = self.rows(i, a)?;
        let lda = a_rows.row_stride;
        let bbuf = self.dense(i, b)?;
        let ldb = if b_trans { k } else { n } as u64;
        let (batch, m_eff, a_batch_stride, b_batch_stride) = if br == 2 {
            // Every lhs row against one weight: a single GEMM of all rows.
            (1, rows, rows as u64 * lda, 0)
        } else {
            let ob = &od[..or - 2];
            let batch: usize = ob.iter().product();
            let stride_for = |dims: &[usize], per: u64, what: &str| -> Result<u64> {
                let pad = ob.len() - dims.len();
                let padded: Vec<usize> = std::iter::repeat_n(1, pad).chain(dims.iter().copied()).collect();
                if padded == ob {
                    Ok(per)
                } else if dims.iter().all(|&d| d == 1) {
                    Ok(0)
                } else {
                    Err(lower_err(
                        g,
                        i,
                        format!("{what} batch dims {dims:?} broadcast partially against {ob:?}; only full or no broadcasting is supported"),
                    ))
                }
            };
            let asb = stride_for(&ad[..ar - 2], m as u64 * lda, "lhs")?;
            let bsb = stride_for(&bd[..br - 2], (k * n) as u64, "rhs")?;
            (batch, m, asb, bsb)
        };
        let mut next = 2;
        let bias = if bias {
            next += 1;
            Some(self.dense(i, self.input(i, 2)?)?)
        } else {
            None
        };
        let residual = if residual { Some(self.dense(i, self.input(i, next)?)?) } else { None };
        Ok(Thunk::MatMul(MatMulThunk {
            dtype: node.dtype,
            batch,
            m: m_eff,
            n,
            k,
            a: a_rows.buf,
            lda,
            a_batch_stride,
            b: bbuf,
            b_trans,
            ldb,
            b_batch_stride,
            bias,
            act,
            residual,
            out: self.buf(i),
        }))
    }
}

/// Cheap consistency checks so a plan of another graph is an error, not
/// an out-of-bounds panic.
fn check_plan(g: &Graph, plan: &ArenaPlan) -> Result<()> {
    let bad = |detail: String| CompileError::Lower { node: 0, op: "plan".into(), detail };
    if plan.locs.len() != g.len()
        || plan.output_copy.len() != g.outputs.len()
        || plan.scratch.len() != g.len()
        || plan.in_place.len() != g.len()
    {
        return Err(bad(format!(
            "the plan covers {} nodes and {} outputs, the graph has {} and {}",
            plan.locs.len(),
            plan.output_copy.len(),
            g.len(),
            g.outputs.len()
        )));
    }
    let nb = plan.buffers.len();
    for (i, (loc, n)) in plan.locs.iter().zip(&g.nodes).enumerate() {
        let root_ok = match loc.root {
            Root::Arena(b) => b < nb,
            Root::Weight(w) => (w as usize) < plan.weights.len(),
            Root::State(s) => (s as usize) < plan.states.len(),
            Root::Const(c) => (c as usize) < plan.consts.len(),
        };
        if !root_ok || loc.strides.len() != n.shape.rank() {
            return Err(lower_err(g, i, "the plan does not match this graph (was it planned from another one?)"));
        }
    }
    if plan.scratch.iter().chain(&plan.output_copy).flatten().any(|&b| b >= nb) {
        return Err(bad("the plan refers to a buffer it does not have".into()));
    }
    Ok(())
}

/// Turns a planned graph into a schedule; `plan` must come from
/// [`plan`](crate::plan::plan) of this same graph.
pub fn lower(g: &Graph, plan: &ArenaPlan) -> Result<Schedule> {
    check_plan(g, plan)?;
    let mut l = Lowerer { g, plan, thunks: vec![] };
    for i in 0..g.len() {
        l.lower_node(i)?;
        for (k, o) in g.outputs.iter().enumerate() {
            if let (true, Some(b)) = (o.0 == i, plan.output_copy[k]) {
                let node = &g.nodes[i];
                let dims = node.shape.dims();
                let src_strides = plan.locs[i].strides.clone();
                let (src, dst) = (l.buf(i), l.buffer(b));
                l.copy(node.dtype, dims, src, src_strides, dst, dense_strides(dims));
            }
        }
    }
    let slot = |name: String, i: usize, buf: BufRef| TensorSlot { name, shape: g.nodes[i].shape.clone(), dtype: g.nodes[i].dtype, buf };
    let mut inputs = vec![];
    for (i, n) in g.nodes.iter().enumerate() {
        if let Op::Input { name } = &n.op {
            inputs.push(slot(name.clone(), i, l.buf(i)));
        }
    }
    let outputs = g
        .outputs
        .iter()
        .enumerate()
        .map(|(k, o)| {
            let buf = plan.output_copy[k].map_or_else(|| l.buf(o.0), |b| l.buffer(b));
            slot(g.output_name(k), o.0, buf)
        })
        .collect();
    let states = plan
        .states
        .iter()
        .map(|&i| {
            let name = match &g.nodes[i].op {
                Op::State { name } => name.clone(),
                _ => format!("state{i}"),
            };
            slot(name, i, l.buf(i))
        })
        .collect();
    Ok(Schedule {
        thunks: l.thunks,
        arena_bytes: plan.arena_bytes,
        inputs,
        outputs,
        weights: plan.weights.clone(),
        states,
        consts: plan.consts.clone(),
        arena: plan.summary(),
    })
}
