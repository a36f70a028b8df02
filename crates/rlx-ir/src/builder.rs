//! One builder method per op. Each infers its output shape and dtype and
//! returns an error on mismatch; nothing is added to the graph on error.

use crate::{Activation, AttentionSpec, BinaryOp, DType, Graph, NodeId, Op, QFormat, ReduceOp, Result, RopeMode, Shape};

impl Graph {
    pub fn input(&mut self, name: &str, shape: impl Into<Shape>, dtype: DType) -> Result<NodeId> {
        let id = self.push(Op::Input { name: name.to_string() }, vec![], Some((shape.into(), dtype)))?;
        self.set_name(id, name);
        Ok(id)
    }

    pub fn param(&mut self, name: &str, shape: impl Into<Shape>, dtype: DType) -> Result<NodeId> {
        let id = self.push(Op::Param { name: name.to_string() }, vec![], Some((shape.into(), dtype)))?;
        self.set_name(id, name);
        Ok(id)
    }

    /// A tensor that persists across calls, zero-initialised.
    pub fn state(&mut self, name: &str, shape: impl Into<Shape>, dtype: DType) -> Result<NodeId> {
        let id = self.push(Op::State { name: name.to_string() }, vec![], Some((shape.into(), dtype)))?;
        self.set_name(id, name);
        Ok(id)
    }

    pub fn constant_f32(&mut self, shape: impl Into<Shape>, values: &[f32]) -> Result<NodeId> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.push(Op::Constant { data }, vec![], Some((shape.into(), DType::F32)))
    }

    pub fn constant_i32(&mut self, shape: impl Into<Shape>, values: &[i32]) -> Result<NodeId> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.push(Op::Constant { data }, vec![], Some((shape.into(), DType::I32)))
    }

    /// A constant from raw little-endian bytes of `dtype`.
    pub fn constant(&mut self, shape: impl Into<Shape>, dtype: DType, data: Vec<u8>) -> Result<NodeId> {
        self.push(Op::Constant { data }, vec![], Some((shape.into(), dtype)))
    }

    pub fn matmul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.push(Op::MatMul { transpose_rhs: false }, vec![a, b], None)
    }

    /// a · bᵀ (b is `[.., N, K]`, e.g. a PyTorch Linear weight).
    pub fn matmul_t(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.push(Op::MatMul { transpose_rhs: true }, vec![a, b], None)
    }

    pub fn binary(&mut self, op: BinaryOp, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.push(Op::Binary(op), vec![a, b], None)
    }
    pub fn add(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.binary(BinaryOp::Add, a, b)
    }
    pub fn sub(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.binary(BinaryOp::Sub, a, b)
    }
    pub fn mul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.binary(BinaryOp::Mul, a, b)
    }
    pub fn div(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.binary(BinaryOp::Div, a, b)
    }

    pub fn activation(&mut self, act: Activation, x: NodeId) -> Result<NodeId> {
        self.push(Op::Activation(act), vec![x], None)
    }
    pub fn gelu(&mut self, x: NodeId) -> Result<NodeId> {
        self.activation(Activation::Gelu, x)
    }
    pub fn silu(&mut self, x: NodeId) -> Result<NodeId> {
        self.activation(Activation::Silu, x)
    }

    pub fn layer_norm(&mut self, x: NodeId, gamma: NodeId, beta: NodeId, eps: f32) -> Result<NodeId> {
        self.push(Op::LayerNorm { eps }, vec![x, gamma, beta], None)
    }

    pub fn rms_norm(&mut self, x: NodeId, gamma: NodeId, eps: f32) -> Result<NodeId> {
        self.push(Op::RmsNorm { eps }, vec![x, gamma], None)
    }

    pub fn softmax(&mut self, x: NodeId, axis: usize) -> Result<NodeId> {
        self.push(Op::Softmax { axis }, vec![x], None)
    }

    pub fn reduce(&mut self, op: ReduceOp, x: NodeId, axes: &[usize], keep_dims: bool) -> Result<NodeId> {
        let mut axes = axes.to_vec();
        axes.sort_unstable();
        self.push(Op::Reduce { op, axes, keep_dims }, vec![x], None)
    }

    /// Embedding lookup: rows of `table` `[V, D]` at `ids`.
    pub fn gather(&mut self, table: NodeId, ids: NodeId) -> Result<NodeId> {
        self.push(Op::Gather, vec![table, ids], None)
    }

    pub fn narrow(&mut self, x: NodeId, axis: usize, start: usize, len: usize) -> Result<NodeId> {
        self.push(Op::Narrow { axis, start, len }, vec![x], None)
    }

    pub fn reshape(&mut self, x: NodeId, shape: impl Into<Shape>) -> Result<NodeId> {
        let dt = self.dtype(x);
        self.push(Op::Reshape, vec![x], Some((shape.into(), dt)))
    }

    pub fn transpose(&mut self, x: NodeId, perm: &[usize]) -> Result<NodeId> {
        self.push(Op::Transpose { perm: perm.to_vec() }, vec![x], None)
    }

    pub fn concat(&mut self, xs: &[NodeId], axis: usize) -> Result<NodeId> {
        self.push(Op::Concat { axis }, xs.to_vec(), None)
    }

    pub fn cast(&mut self, x: NodeId, to: DType) -> Result<NodeId> {
        let s = self.shape(x).clone();
        self.push(Op::Cast, vec![x], Some((s, to)))
    }

    pub fn argmax(&mut self, x: NodeId, axis: usize) -> Result<NodeId> {
        self.push(Op::ArgMax { axis }, vec![x], None)
    }

    /// Top `k` along the last axis, sorted descending: (values, i32 indices).
    pub fn top_k(&mut self, x: NodeId, k: usize) -> Result<(NodeId, NodeId)> {
        let v = self.push(Op::TopK { k, indices: false }, vec![x], None)?;
        let i = self.push(Op::TopK { k, indices: true }, vec![x], None)?;
        Ok((v, i))
    }

    /// Fused attention; `mask` and `valid_len` must be given exactly when the
    /// spec says so.
    pub fn attention(
        &mut self,
        spec: AttentionSpec,
        q: NodeId,
        k: NodeId,
        v: NodeId,
        mask: Option<NodeId>,
        valid_len: Option<NodeId>,
    ) -> Result<NodeId> {
        let spec = AttentionSpec { mask: mask.is_some(), valid_len: valid_len.is_some(), ..spec };
        let mut ins = vec![q, k, v];
        ins.extend(mask);
        ins.extend(valid_len);
        self.push(Op::Attention(spec), ins, None)
    }

    pub fn rope(&mut self, x: NodeId, positions: NodeId, head_dim: usize, theta: f32, mode: RopeMode) -> Result<NodeId> {
        self.push(Op::Rope { theta, mode, head_dim }, vec![x, positions], None)
    }

    /// [`rope`](Self::rope) with per-pair frequency factors f32
    /// `[head_dim/2]` (each pair's frequency is divided by its factor).
    pub fn rope_scaled(
        &mut self,
        x: NodeId,
        positions: NodeId,
        factors: NodeId,
        head_dim: usize,
        theta: f32,
        mode: RopeMode,
    ) -> Result<NodeId> {
        self.push(Op::Rope { theta, mode, head_dim }, vec![x, positions, factors], None)
    }

    /// Writes `value` into `state` at rows `position..` (axis 1), in place;
    /// a float value is rounded to a float state's dtype.
    pub fn write_state(&mut self, state: NodeId, value: NodeId, position: NodeId) -> Result<NodeId> {
        self.push(Op::WriteState, vec![state, value, position], None)
    }

    /// a · wᵀ with `w` a block-quantized weight `U8 [N, row_bytes]`.
    pub fn qmatmul(&mut self, a: NodeId, w: NodeId, format: QFormat) -> Result<NodeId> {
        self.push(Op::QMatMul { format }, vec![a, w], None)
    }

    /// [`Op::QMatMulFused`]: (RmsNorm(a)·gamma when `norm` is (gamma, eps))
    /// · wᵀ, then SwiGLU over the two halves with `glu`, then + residual.
    pub fn qmatmul_fused(
        &mut self,
        a: NodeId,
        w: NodeId,
        format: QFormat,
        norm: Option<(NodeId, f32)>,
        glu: bool,
        residual: Option<NodeId>,
    ) -> Result<NodeId> {
        let mut ins = vec![a, w];
        ins.extend(norm.map(|n| n.0));
        ins.extend(residual);
        self.push(Op::QMatMulFused { format, norm_eps: norm.map(|n| n.1), glu, residual: residual.is_some() }, ins, None)
    }

    /// Embedding lookup from a block-quantized table `U8 [V, row_bytes]`.
    pub fn qgather(&mut self, table: NodeId, ids: NodeId, format: QFormat) -> Result<NodeId> {
        self.push(Op::QGather { format }, vec![table, ids], None)
    }

    /// Next-token sampling (see [`Op::Sample`]).
    pub fn sample(&mut self, logits: NodeId, fparams: NodeId, iparams: NodeId, history: NodeId, position: NodeId) -> Result<NodeId> {
        self.push(Op::Sample, vec![logits, fparams, iparams, history, position], None)
    }

    pub fn swiglu(&mut self, gate: NodeId, up: NodeId) -> Result<NodeId> {
        self.push(Op::SwiGlu, vec![gate, up], None)
    }

    /// Mean of `x` `[B, S, D]` over S weighted by `mask` `[B, S]`: Σ x·mask /
    /// max(Σ mask, 1e-9) → `[B, D]` (sentence-transformers' mean pooling).
    pub fn masked_mean(&mut self, x: NodeId, mask: NodeId) -> Result<NodeId> {
        self.push(Op::MaskedMean, vec![x, mask], None)
    }

    /// LayerNorm(table[ids] + Σ addends), each addend `[.., R, D]` repeating
    /// over the gathered rows (see [`Op::EmbedLayerNorm`]). The fusion pass
    /// builds it from a gather, adds and a LayerNorm.
    pub fn embed_layer_norm(
        &mut self,
        table: NodeId,
        ids: NodeId,
        gamma: NodeId,
        beta: NodeId,
        addends: &[NodeId],
        eps: f32,
    ) -> Result<NodeId> {
        let mut ins = vec![table, ids, gamma, beta];
        ins.extend_from_slice(addends);
        self.push(Op::EmbedLayerNorm { eps }, ins, None)
    }

    /// `x·w (+ bias)`: the common linear layer, `w` as `[K, N]`, or `[N, K]`
    /// with `transposed` (PyTorch's layout).
    pub fn linear(&mut self, x: NodeId, w: NodeId, bias: Option<NodeId>, transposed: bool) -> Result<NodeId> {
        let y = self.push(Op::MatMul { transpose_rhs: transposed }, vec![x, w], None)?;
        match bias {
            Some(b) => self.add(y, b),
            None => Ok(y),
        }
    }
}
