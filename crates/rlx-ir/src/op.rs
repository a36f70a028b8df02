use serde::{Deserialize, Serialize};

use crate::{DType, QFormat};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Activation {
    /// Exact GELU: x * Φ(x) with the error function.
    Gelu,
    /// GELU's tanh approximation.
    GeluTanh,
    Silu,
    Relu,
    Tanh,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RopeMode {
    /// Hugging Face / NeoX layout: pairs are (i, i + head_dim/2).
    RotateHalf,
    /// GGML "normal" layout: pairs are (2i, 2i + 1).
    Interleaved,
}

/// Attention over sequence-major tensors: q is `[B, Sq, heads*head_dim]`, k and
/// v are `[B, Skv, kv_heads*head_dim]`, the output is `[B, Sq, heads*head_dim]`
/// in q's dtype. K and V share one float dtype, which may be narrower than
/// q's (an f16 KV cache under f32 activations).
///
/// Optional inputs follow q, k, v in this order:
/// - `mask`: key-padding mask `[B, Skv]` (nonzero = attend), any dtype.
/// - `valid_len`: i32 `[1]` (one for every batch row) or `[B]` (one per
///   row) device values — the number of valid keys. Keys at or past it are
///   ignored and, with `causal`, query i sits at absolute position
///   `valid_len - Sq + i`. This is what lets one compiled decode step serve
///   every position of a KV cache, and a batched step sequences of
///   different lengths.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttentionSpec {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub causal: bool,
    pub mask: bool,
    pub valid_len: bool,
}

/// Rotary embedding inside a fused op: [`Op::Rope`]'s attributes (the head
/// dim is the attention's), and whether frequency factors are an input.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RopeSpec {
    pub theta: f32,
    pub mode: RopeMode,
    pub factors: bool,
}

/// Where a residual inside an [`Op::FeedForward`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FfnResidual {
    None,
    /// The block's input: FFN1's input (norm1's output with `attn_out`).
    Block,
    /// A node of its own, the op's next input.
    Input,
}

/// The attention output projection and norm an [`Op::FeedForward`] starts
/// with: x = Norm1(a·woᵀ (+ bo) (+ residual) (+ norm_residual)).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttnOutSpec {
    pub bias: bool,
    /// Added after the projection's bias (a matmul residual epilogue).
    pub residual: bool,
    /// Added to the norm's input (a residual norm).
    pub norm_residual: bool,
    /// RmsNorm (gamma) rather than LayerNorm (gamma, beta).
    pub rms: bool,
    pub eps: f32,
}

/// A transformer feed-forward block and the norm after it, see
/// [`Op::FeedForward`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FeedForwardSpec {
    /// FFN1's activation.
    pub act: Activation,
    pub bias1: bool,
    pub bias2: bool,
    /// Added after FFN2's bias (a matmul residual epilogue).
    pub residual2: FfnResidual,
    /// Added to the norm's input (a residual norm).
    pub norm_residual: FfnResidual,
    /// RmsNorm (gamma) rather than LayerNorm (gamma, beta).
    pub rms: bool,
    pub eps: f32,
    /// The block starts at the attention's output projection and its norm.
    pub attn_out: Option<AttnOutSpec>,
}

/// Input positions of an [`Op::FeedForward`] node's operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FfnSlots {
    /// With `attn_out`: a, wo, bo, residual, norm residual, gamma, beta.
    pub attn_out: Option<AttnOutSlots>,
    /// The block's input (without `attn_out`).
    pub x: Option<usize>,
    pub w1: usize,
    pub b1: Option<usize>,
    pub w2: usize,
    pub b2: Option<usize>,
    pub residual2: Option<usize>,
    pub norm_residual: Option<usize>,
    pub gamma: usize,
    pub beta: Option<usize>,
    /// How many inputs the node has.
    pub count: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnOutSlots {
    pub a: usize,
    pub wo: usize,
    pub bo: Option<usize>,
    pub residual: Option<usize>,
    pub norm_residual: Option<usize>,
    pub gamma: usize,
    pub beta: Option<usize>,
}

impl FeedForwardSpec {
    /// Where each operand sits in the node's inputs (the order
    /// [`Op::FeedForward`] lists).
    pub fn slots(&self) -> FfnSlots {
        let mut c = Slots(0);
        let attn_out = self.attn_out.map(|o| AttnOutSlots {
            a: c.one(),
            wo: c.one(),
            bo: c.opt(o.bias),
            residual: c.opt(o.residual),
            norm_residual: c.opt(o.norm_residual),
            gamma: c.one(),
            beta: c.opt(!o.rms),
        });
        let x = c.opt(self.attn_out.is_none());
        let (w1, b1) = (c.one(), c.opt(self.bias1));
        let (w2, b2) = (c.one(), c.opt(self.bias2));
        let residual2 = c.opt(self.residual2 == FfnResidual::Input);
        let norm_residual = c.opt(self.norm_residual == FfnResidual::Input);
        let (gamma, beta) = (c.one(), c.opt(!self.rms));
        FfnSlots { attn_out, x, w1, b1, w2, b2, residual2, norm_residual, gamma, beta, count: c.0 }
    }
}

/// Numbers input slots in order.
struct Slots(usize);

impl Slots {
    fn one(&mut self) -> usize {
        self.0 += 1;
        self.0 - 1
    }
    fn opt(&mut self, present: bool) -> Option<usize> {
        present.then(|| self.one())
    }
}

/// One operation. Inputs are listed per variant; every node has exactly one
/// output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A graph input, staged on every call.
    Input { name: String },
    /// A named weight from the weight store.
    Param { name: String },
    /// Literal data (little-endian bytes of the node's dtype).
    Constant { data: Vec<u8> },
    /// A tensor that persists across calls (zero at creation), e.g. a KV cache.
    State { name: String },
    /// inputs: a `[.., M, K]`, b `[.., K, N]` (or `[.., N, K]` with
    /// `transpose_rhs`). Batch dims broadcast.
    MatMul { transpose_rhs: bool },
    /// inputs: a, b — NumPy broadcasting.
    Binary(BinaryOp),
    /// inputs: x
    Activation(Activation),
    /// inputs: x, gamma, beta — normalises the last axis.
    LayerNorm { eps: f32 },
    /// inputs: x, gamma — normalises the last axis.
    RmsNorm { eps: f32 },
    /// inputs: x
    Softmax { axis: usize },
    /// inputs: x; `axes` sorted, non-empty.
    Reduce { op: ReduceOp, axes: Vec<usize>, keep_dims: bool },
    /// inputs: table `[V, D]`, ids (i32/i64, any shape) → `[..ids, D]`.
    Gather,
    /// inputs: x — `len` elements of `axis` from `start`.
    Narrow { axis: usize, start: usize, len: usize },
    /// inputs: x — the node's shape is the new shape.
    Reshape,
    /// inputs: x
    Transpose { perm: Vec<usize> },
    /// inputs: two or more tensors
    Concat { axis: usize },
    /// inputs: x — to the node's dtype.
    Cast,
    /// inputs: x → i32 index of the maximum along `axis` (axis removed).
    ArgMax { axis: usize },
    /// inputs: x — top `k` along the last axis, sorted descending. With
    /// `indices` the output is the i32 indices, otherwise the values.
    TopK { k: usize, indices: bool },
    /// inputs: q, k, v, [mask], [valid_len] — see [`AttentionSpec`].
    Attention(AttentionSpec),
    /// inputs: x `[B, S, heads*head_dim]`, positions i32 `[S]` or `[B, S]`,
    /// optionally frequency factors f32 `[head_dim/2]`: pair i turns by
    /// position · theta^(-2i/head_dim) / factor[i] (llama3's RoPE scaling,
    /// GGUF's `rope_freqs.weight`).
    Rope { theta: f32, mode: RopeMode, head_dim: usize },
    /// inputs: state `[B, Smax, W]`, value `[B, Snew, W]`, position i32 `[1]`
    /// (shared by every batch row) or `[B]` (per row). Writes value into
    /// state rows `position..position+Snew` in place (a float value rounded
    /// to a float state's dtype); the output is the
    /// updated state (same buffer). Later readers of the state must read this
    /// node so the write is ordered before them.
    WriteState,
    /// inputs: a `[.., M, K]` (float), w `U8 [N, format.row_bytes(K)]` — a
    /// block-quantized weight read as stored → `[.., M, N]` = a · wᵀ in a's
    /// dtype.
    QMatMul { format: QFormat },
    /// inputs: table `U8 [V, row_bytes]` (rows of `format` blocks), ids
    /// (i32/i64, any shape) → f32 `[..ids, D]`: the dequantised rows.
    QGather { format: QFormat },
    /// Next-token sampling, one row per sequence. inputs:
    /// - logits f32 `[B, V]`;
    /// - fparams f32 `[B, 4]`: temperature (≤ 0: greedy argmax), top_p (1:
    ///   off), min_p (0: off), repeat_penalty (1: off);
    /// - iparams i32 `[B, 4]`: top_k (0: off), repeat_last_n, seed low and
    ///   high 32 bits;
    /// - history i32 `[B, H]`: the sequence's tokens by position;
    /// - position i32 `[B]`: the position of the last token in history.
    ///
    /// → i32 `[B]`. The penalty applies to tokens at positions
    /// `position-repeat_last_n+1 ..= position`. The random draw is a pure
    /// function of (seed, position), so the same seed gives the same text
    /// on every backend and however calls are pipelined.
    Sample,

    // Fused ops produced by passes.
    /// inputs: a, b, [bias `[N]`], [residual `[.., M, N]`] — act(a·b + bias) + residual.
    MatMulFused { transpose_rhs: bool, bias: bool, act: Option<Activation>, residual: bool },
    /// inputs: a `[.., M, K]`, w `U8 [R, row_bytes]` (as [`Op::QMatMul`]),
    /// then gamma `[K]` when `norm_eps` is set, then residual `[.., M, N]`
    /// when `residual` → `[.., M, N]` in a's dtype, where N = R, or R/2
    /// with `glu`:
    /// 1. h = RmsNorm(a) · gamma with that eps (else h = a);
    /// 2. y = h · wᵀ;
    /// 3. with `glu`, y = silu(y[.., :N]) · y[.., N:] (the weight's first
    ///    half of rows is the gate, the second the up projection);
    /// 4. + residual.
    QMatMulFused { format: QFormat, norm_eps: Option<f32>, glu: bool, residual: bool },
    /// A decoder step's attention with its KV-cache append, in one op (one
    /// new row per sequence). inputs: q `[B, 1, heads*D]`, k_new and v_new
    /// `[B, 1, kv_heads*D]` (q's dtype), the key and value caches (states
    /// `[B, Smax, kv_heads*D]` of one float dtype), the write position i32
    /// `[1]` or `[B]`, then `mask` and `valid_len` as [`AttentionSpec`]
    /// says, then with `rope` the RoPE positions i32 `[1]` or `[B, 1]` and,
    /// when `rope.factors`, the f32 `[D/2]` frequency factors →
    /// `[B, 1, heads*D]`:
    /// 1. with `rope`, q and k_new turn as [`Op::Rope`] does;
    /// 2. k_new and v_new are written into the caches at rows `position..`
    ///    as [`Op::WriteState`] does (rounded to the caches' dtype);
    /// 3. the output is [`Op::Attention`] of q over the updated caches.
    ///
    /// The caches are updated in place, as by a `WriteState`.
    AttentionAppend { spec: AttentionSpec, rope: Option<RopeSpec> },
    /// A transformer feed-forward block and the norm after it (made by the
    /// `fuse_ffn` pass for backends with a kernel for the whole block):
    ///
    /// 1. with `attn_out`, x = Norm1(a·woᵀ (+ bo) (+ residual) (+
    ///    norm residual)); otherwise x is the first input;
    /// 2. h = act(x·w1ᵀ (+ b1));
    /// 3. y = h·w2ᵀ (+ b2) (+ residual2);
    /// 4. out = Norm(y (+ norm_residual)).
    ///
    /// Each step rounds to the storage dtype as the separate ops would (it
    /// computes exactly what they compute). inputs, in order: with
    /// `attn_out` a `[.., H]`, wo `[H, H]`, [bo `[H]`], [residual `[.., H]`],
    /// [norm residual `[.., H]`], gamma1 `[H]`, [beta1 `[H]`, LayerNorm];
    /// otherwise x `[.., H]`; then w1 `[I, H]`, [b1 `[I]`], w2 `[H, I]`, [b2
    /// `[H]`], [residual2 `[.., H]` when `Input`], [norm residual `[.., H]`
    /// when `Input`], gamma `[H]`, [beta `[H]`, LayerNorm] → `[.., H]`.
    /// See [`FeedForwardSpec::slots`].
    FeedForward(FeedForwardSpec),
    /// inputs: x, residual, gamma, beta — LayerNorm(x + residual).
    ResidualLayerNorm { eps: f32 },
    /// inputs: x, residual, gamma — RmsNorm(x + residual).
    ResidualRmsNorm { eps: f32 },
    /// inputs: gate, up — silu(gate) * up.
    SwiGlu,
    /// inputs: x `[B, S, D]`, mask `[B, S]` (any float dtype) → `[B, D]` (x's
    /// dtype unless the node declares another float dtype):
    /// Σ_s x·mask / max(Σ_s mask, 1e-9), sentence-transformers' mean
    /// pooling (a row whose mask is all zero gives zeros).
    MaskedMean,
    /// inputs: table `[V, D]`, ids (i32/i64, any shape), gamma `[D]`, beta
    /// `[D]`, then 0 to 2 addends → `[..ids, D]`: LayerNorm(table[ids] + Σ
    /// addends). An addend is `[.., R, D]`: leading 1s, then the trailing
    /// dims of the output, so output row r adds addend row r % R (BERT's
    /// position and token-type rows).
    EmbedLayerNorm { eps: f32 },
}

impl Op {
    /// A short name for printing and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Param { .. } => "param",
            Op::Constant { .. } => "constant",
            Op::State { .. } => "state",
            Op::MatMul { .. } => "matmul",
            Op::Binary(BinaryOp::Add) => "add",
            Op::Binary(BinaryOp::Sub) => "sub",
            Op::Binary(BinaryOp::Mul) => "mul",
            Op::Binary(BinaryOp::Div) => "div",
            Op::Activation(Activation::Gelu) => "gelu",
            Op::Activation(Activation::GeluTanh) => "gelu_tanh",
            Op::Activation(Activation::Silu) => "silu",
            Op::Activation(Activation::Relu) => "relu",
            Op::Activation(Activation::Tanh) => "tanh",
            Op::LayerNorm { .. } => "layer_norm",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Softmax { .. } => "softmax",
            Op::Reduce { .. } => "reduce",
            Op::Gather => "gather",
            Op::Narrow { .. } => "narrow",
            Op::Reshape => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Concat { .. } => "concat",
            Op::Cast => "cast",
            Op::ArgMax { .. } => "argmax",
            Op::TopK { .. } => "topk",
            Op::Attention(_) => "attention",
            Op::Rope { .. } => "rope",
            Op::WriteState => "write_state",
            Op::QMatMul { .. } => "qmatmul",
            Op::QGather { .. } => "qgather",
            Op::Sample => "sample",
            Op::MatMulFused { .. } => "matmul_fused",
            Op::QMatMulFused { .. } => "qmatmul_fused",
            Op::AttentionAppend { .. } => "attention_append",
            Op::FeedForward(_) => "feed_forward",
            Op::ResidualLayerNorm { .. } => "residual_layer_norm",
            Op::ResidualRmsNorm { .. } => "residual_rms_norm",
            Op::SwiGlu => "swiglu",
            Op::MaskedMean => "masked_mean",
            Op::EmbedLayerNorm { .. } => "embed_layer_norm",
        }
    }

    /// Leaves of the graph: no inputs, data comes from outside the schedule.
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } | Op::State { .. })
    }

    /// Ops whose output is a view of their first input (no data moves when the
    /// layout allows it).
    pub fn is_view(&self) -> bool {
        matches!(self, Op::Reshape | Op::Narrow { .. } | Op::Transpose { .. })
    }

    /// Elementwise ops that may run in place over their first input.
    pub fn is_elementwise(&self) -> bool {
        matches!(self, Op::Binary(_) | Op::Activation(_) | Op::SwiGlu)
    }

    /// Ops with an effect beyond their output (must never be eliminated).
    pub fn has_side_effect(&self) -> bool {
        matches!(self, Op::WriteState | Op::AttentionAppend { .. })
    }

    /// Accumulation type of a float op over the node dtype: matmul, norms and
    /// softmax accumulate in f32 whatever the storage.
    pub fn accumulates_in_f32(&self) -> bool {
        matches!(
            self,
            Op::MatMul { .. }
                | Op::MatMulFused { .. }
                | Op::FeedForward(_)
                | Op::QMatMul { .. }
                | Op::QMatMulFused { .. }
                | Op::LayerNorm { .. }
                | Op::RmsNorm { .. }
                | Op::ResidualLayerNorm { .. }
                | Op::ResidualRmsNorm { .. }
                | Op::Softmax { .. }
                | Op::Attention(_)
                | Op::AttentionAppend { .. }
                | Op::Reduce { .. }
                | Op::MaskedMean
                | Op::EmbedLayerNorm { .. }
        )
    }

    pub(crate) fn const_dtype_ok(data: &[u8], dtype: DType, numel: usize) -> bool {
        data.len() == numel * dtype.size()
    }
}
