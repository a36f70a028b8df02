//! The output of compilation: a backend-neutral list of thunks over byte
//! offsets. Plain data: serialisable, printable, no pointers.

use rlx_ir::{Activation, BinaryOp, DType, QFormat, ReduceOp, RopeMode, Shape};
use serde::{Deserialize, Serialize};

/// Which memory a buffer lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Space {
    /// The activation arena: inputs, outputs and every intermediate of one
    /// call (nothing in it outlives the call). The CPU backend has one per
    /// pipeline slot; the CUDA backend one per executable, or one for all
    /// the executables of a state set.
    Arena,
    /// `Schedule::weights[i]`, owned by the weight store, shared.
    Weight(u32),
    /// `Schedule::states[i]`, one per executable, persists across calls.
    State(u32),
    /// `Schedule::consts[i]`, literal data uploaded once.
    Const(u32),
}

/// The RmsNorm a fused quantized matmul applies to its activation rows:
/// gamma `[k]` in the activations' dtype, and eps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QNorm {
    pub gamma: BufRef,
    pub eps: f32,
}

/// Alignment of each part of a quantized matmul's scratch.
pub const QMATMUL_SCRATCH_ALIGN: u64 = 256;

/// The parts of a quantized matmul's scratch (`Thunk::QMatMul::scratch`),
/// in bytes, each a multiple of [`QMATMUL_SCRATCH_ALIGN`] and laid out in
/// this order: the activations as 16-bit floats `[rows, k]` (normed, when
/// the matmul has a norm); the weights decoded to 16-bit floats `[n', k]`
/// (n' = 2n with `glu`); with `glu`, the f32 products `[rows, 2n]` before
/// SwiGLU (else 0). `None` when the sizes overflow.
pub fn qmatmul_scratch_parts(rows: usize, n: usize, k: usize, glu: bool) -> Option<[u64; 3]> {
    let al = |b: u64| b.checked_next_multiple_of(QMATMUL_SCRATCH_ALIGN);
    let wn = if glu { n.checked_mul(2)? } else { n } as u64;
    let a = al((rows as u64).checked_mul(k as u64)?.checked_mul(2)?)?;
    let w = al(wn.checked_mul(k as u64)?.checked_mul(2)?)?;
    let g = if glu { al((rows as u64).checked_mul(wn)?.checked_mul(4)?)? } else { 0 };
    Some([a, w, g])
}

/// A byte range in one memory space. Element (0, 0, ..) of the tensor it
/// holds sits at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BufRef {
    pub space: Space,
    /// Bytes from the start of the space (the arena) or of the tensor.
    pub offset: u64,
    /// Bytes covered from `offset` (for bounds checks and aliasing).
    pub bytes: u64,
}

impl BufRef {
    /// Whether the two share a byte.
    pub fn overlaps(&self, other: &BufRef) -> bool {
        self.space == other.space
            && self.offset < other.offset.saturating_add(other.bytes)
            && other.offset < self.offset.saturating_add(self.bytes)
    }
}

/// A `[B, S, W]` tensor read through strides (in elements), e.g. Q out of a
/// fused QKV projection: batch_stride = S*3W, row_stride = 3W.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqView {
    pub buf: BufRef,
    pub batch_stride: u64,
    pub row_stride: u64,
}

/// A `[rows, cols]` matrix with a row stride in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowsView {
    pub buf: BufRef,
    pub row_stride: u64,
}

/// `out[b] = act(a[b] · op(b_[b]) + bias) + residual[b]`, f32 accumulation.
/// Shapes: a `[batch, m, k]`; b `[batch_b, k, n]` or `[batch_b, n, k]` when
/// `b_trans`; out and residual `[batch, m, n]` contiguous.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MatMulThunk {
    pub dtype: DType,
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: BufRef,
    /// Row stride of a in elements (k when contiguous).
    pub lda: u64,
    /// Batch stride of a in elements.
    pub a_batch_stride: u64,
    pub b: BufRef,
    pub b_trans: bool,
    /// Row stride of b in elements (n, or k when transposed, when contiguous).
    pub ldb: u64,
    /// 0 = the same b for every batch (a weight).
    pub b_batch_stride: u64,
    pub bias: Option<BufRef>,
    pub act: Option<Activation>,
    pub residual: Option<BufRef>,
    pub out: BufRef,
}

/// Fused attention; see `rlx_ir::AttentionSpec`. q is `[batch, q_len,
/// heads*head_dim]`, k/v `[batch, kv_len, kv_heads*head_dim]` through their
/// views; out is contiguous `[batch, q_len, heads*head_dim]`. Query head h
/// reads kv head `h / (heads / kv_heads)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionThunk {
    /// q's and out's dtype.
    pub dtype: DType,
    /// k's and v's dtype (an f16 cache may serve f32 queries).
    pub kv_dtype: DType,
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub scale: f32,
    pub causal: bool,
    pub q: SeqView,
    pub k: SeqView,
    pub v: SeqView,
    /// Key-padding mask `[batch, kv_len]`, nonzero = attend, of `mask_dtype`.
    pub mask: Option<BufRef>,
    pub mask_dtype: DType,
    /// i32 device scalar: keys `>= valid_len` are ignored; with `causal`,
    /// query i is at position `valid_len - q_len + i`. Without it valid_len
    /// is kv_len. A value outside `0..=kv_len` is an error (CPU) or is
    /// clamped and raises the backend's error flag (GPU).
    pub valid_len: Option<BufRef>,
    /// valid_len holds one value per batch row (`[batch]`) rather than one
    /// for all (`[1]`).
    #[serde(default)]
    pub valid_len_per_batch: bool,
    pub out: BufRef,
}

/// A decoder step's attention with its KV-cache append
/// (`rlx_ir::Op::AttentionAppend`), one new row per sequence: with `rope`
/// q and k_new turn (as [`Thunk::Rope`]); k_new and v_new are written into
/// the caches at `position` (as [`Thunk::WriteState`], rounded to the
/// caches' dtype); then `attn` runs over the caches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionAppendThunk {
    /// The attention after the write: `attn.k` and `attn.v` are the caches
    /// (dense `[batch, kv_len, kv_heads*head_dim]` of `attn.kv_dtype`),
    /// `attn.q_len` is 1, and `attn.q` is `q`, or `rope.q_out` with `rope`.
    pub attn: AttentionThunk,
    /// The queries as given `[batch, 1, heads*head_dim]` (before RoPE).
    pub q: SeqView,
    /// The new key and value rows `[batch, 1, kv_heads*head_dim]`, in
    /// `attn.dtype`.
    pub k_new: SeqView,
    pub v_new: SeqView,
    /// i32: the cache row written, one for every batch row or one per row.
    pub position: BufRef,
    pub position_per_batch: bool,
    pub rope: Option<AppendRope>,
}

/// The RoPE of an [`AttentionAppendThunk`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AppendRope {
    pub mode: RopeMode,
    pub theta: f32,
    /// i32 `[1]` (shared by the batch) or `[batch, 1]`.
    pub positions: BufRef,
    pub positions_per_batch: bool,
    /// f32 `[head_dim/2]`: pair i's frequency is divided by factor i.
    pub freq_factors: Option<BufRef>,
    /// Scratch, dense in `attn.dtype`, for a backend that turns q and k in
    /// steps of their own: the turned queries (`attn.q`'s buffer) and keys.
    pub q_out: BufRef,
    pub k_out: BufRef,
}

/// A transformer feed-forward block and the norm after it
/// (`rlx_ir::Op::FeedForward`) as the plain thunks it stands for, run in
/// this order: with the attention output projection, that `MatMul` and its
/// `Norm`; then FFN1 (a `MatMul` with its activation), FFN2 (a `MatMul`) and
/// the `Norm`. Each part reads the one before it through arena scratch that
/// nothing outside the block reads, so a backend with a kernel for the whole
/// block need only write the last norm's output (and may write the
/// scratch). A backend without one runs the parts ([`Schedule::expand`]):
/// that is the block's definition, so both agree exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeedForwardThunk {
    pub parts: Vec<Thunk>,
}

/// The parts of a [`FeedForwardThunk`] by role.
pub struct FeedForwardParts<'a> {
    /// The attention output projection and its norm, when the block starts there.
    pub attn_out: Option<(&'a MatMulThunk, &'a Thunk)>,
    pub ffn1: &'a MatMulThunk,
    pub ffn2: &'a MatMulThunk,
    /// A `Thunk::Norm`.
    pub norm: &'a Thunk,
}

impl FeedForwardThunk {
    /// The parts by role, or why they do not form a block: 3 or 5 parts of
    /// the kinds above, each reading the previous one's output.
    pub fn roles(&self) -> Result<FeedForwardParts<'_>, String> {
        let norm_io = |t: &Thunk| match t {
            Thunk::Norm { x, out, .. } => Some((*x, *out)),
            _ => None,
        };
        let (attn_out, rest) = match self.parts.as_slice() {
            [Thunk::MatMul(o), n1, rest @ ..] if rest.len() == 3 => (Some((o, n1)), rest),
            rest => (None, rest),
        };
        let [Thunk::MatMul(ffn1), Thunk::MatMul(ffn2), norm] = rest else {
            return Err(format!("feed_forward: expected [matmul, norm,] matmul, matmul, norm; found {} parts", self.parts.len()));
        };
        let Some((y, _)) = norm_io(norm) else { return Err("feed_forward: the last part is not a norm".into()) };
        if ffn1.act.is_none() || ffn2.a != ffn1.out || y != ffn2.out {
            return Err("feed_forward: FFN1 needs an activation, FFN2 must read FFN1's output and the norm FFN2's".into());
        }
        if let Some((o, n1)) = attn_out {
            match norm_io(n1) {
                Some((x, out)) if x == o.out && out == ffn1.a => {}
                _ => return Err("feed_forward: norm1 must read the projection's output and FFN1 norm1's".into()),
            }
        }
        Ok(FeedForwardParts { attn_out, ffn1, ffn2, norm })
    }
}

/// One kernel launch worth of work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Thunk {
    MatMul(MatMulThunk),
    /// Broadcasting elementwise op: strides in elements per output dim
    /// (0 where the operand broadcasts). out is contiguous `out_shape`.
    Binary {
        op: BinaryOp,
        dtype: DType,
        out_shape: Vec<usize>,
        a: BufRef,
        a_strides: Vec<u64>,
        b: BufRef,
        b_strides: Vec<u64>,
        out: BufRef,
    },
    /// out = act(x), `n` contiguous elements (out may equal x).
    Activation {
        act: Activation,
        dtype: DType,
        n: usize,
        x: BufRef,
        out: BufRef,
    },
    /// LayerNorm (with beta) or RmsNorm (without) over rows of `cols`
    /// contiguous elements of `x (+ residual)`.
    Norm {
        rms: bool,
        dtype: DType,
        rows: usize,
        cols: usize,
        eps: f32,
        x: BufRef,
        residual: Option<BufRef>,
        gamma: BufRef,
        beta: Option<BufRef>,
        out: BufRef,
    },
    /// Softmax over the middle axis of a contiguous `[outer, len, inner]`.
    Softmax {
        dtype: DType,
        outer: usize,
        len: usize,
        inner: usize,
        x: BufRef,
        out: BufRef,
    },
    /// Reduce the middle axis of a contiguous `[outer, len, inner]` → `[outer, inner]`.
    Reduce {
        op: ReduceOp,
        dtype: DType,
        outer: usize,
        len: usize,
        inner: usize,
        x: BufRef,
        out: BufRef,
    },
    /// ArgMax over the middle axis of `[outer, len, inner]` → i32 `[outer, inner]`.
    ArgMax {
        dtype: DType,
        outer: usize,
        len: usize,
        inner: usize,
        x: BufRef,
        out: BufRef,
    },
    /// Top k over the last axis of contiguous `[rows, len]`, sorted
    /// descending (ties: lower index first). Writes values and/or i32 indices.
    TopK {
        dtype: DType,
        rows: usize,
        len: usize,
        k: usize,
        x: BufRef,
        values: Option<BufRef>,
        indices: Option<BufRef>,
    },
    /// out[i, :] = table[ids[i], :]; an id outside 0..vocab is an error
    /// (CPU) or writes zeros and raises the backend's error flag (GPU).
    Gather {
        dtype: DType,
        id_dtype: DType,
        n: usize,
        dim: usize,
        vocab: usize,
        table: BufRef,
        ids: BufRef,
        out: BufRef,
    },
    /// Strided copy: dst[idx] = src[idx] over `shape`, strides in elements.
    /// Materialises narrow, transpose and each part of a concat.
    Copy {
        dtype: DType,
        shape: Vec<usize>,
        src: BufRef,
        src_strides: Vec<u64>,
        dst: BufRef,
        dst_strides: Vec<u64>,
    },
    /// Element type conversion of `n` contiguous elements.
    Cast {
        from: DType,
        to: DType,
        n: usize,
        src: BufRef,
        dst: BufRef,
    },
    Attention(AttentionThunk),
    AttentionAppend(Box<AttentionAppendThunk>),
    FeedForward(Box<FeedForwardThunk>),
    /// Rotary embedding of `x` `[batch, seq, heads*head_dim]` (through a
    /// view) into contiguous out. positions: i32 `[seq]` (shared by the batch)
    /// or `[batch, seq]`.
    Rope {
        dtype: DType,
        mode: RopeMode,
        theta: f32,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        x: SeqView,
        positions: BufRef,
        positions_per_batch: bool,
        out: BufRef,
        /// f32 `[head_dim/2]`: pair i's frequency is divided by factor i.
        #[serde(default)]
        freq_factors: Option<BufRef>,
    },
    /// out[b, d] = Σ_s x[b, s, d]·mask[b, s] / max(Σ_s mask[b, s], 1e-9), all
    /// contiguous (`Op::MaskedMean`), accumulated in f32.
    MaskedMean {
        /// x's dtype; the mask and the output may differ.
        dtype: DType,
        mask_dtype: DType,
        out_dtype: DType,
        batch: usize,
        seq: usize,
        dim: usize,
        x: BufRef,
        mask: BufRef,
        out: BufRef,
    },
    /// LayerNorm(table[ids] + Σ addends) over `rows` rows of `cols`
    /// (`Op::EmbedLayerNorm`), all dense; addend k is (buffer, its rows R):
    /// row r adds addend row r % R. An id outside the vocabulary is an error.
    EmbedNorm {
        dtype: DType,
        id_dtype: DType,
        rows: usize,
        cols: usize,
        vocab: usize,
        eps: f32,
        table: BufRef,
        ids: BufRef,
        addends: Vec<(BufRef, usize)>,
        gamma: BufRef,
        beta: BufRef,
        out: BufRef,
    },
    /// out = silu(gate) * up over `[rows, cols]`; gate/up may be strided
    /// (halves of one fused projection); out contiguous.
    SwiGlu {
        dtype: DType,
        rows: usize,
        cols: usize,
        gate: RowsView,
        up: RowsView,
        out: BufRef,
    },
    /// state[b, pos + s, :] = value[b, s, :] for s < new_rows (a float value
    /// rounded to the state's float `dtype`), pos read from
    /// i32 device memory: one value for every batch row, or one per row with
    /// `positions_per_batch`. State is `[batch, max_rows, width]`. A position
    /// with pos + new_rows > max_rows is an error (CPU) or a no-op that
    /// raises the error flag (GPU).
    WriteState {
        dtype: DType,
        value_dtype: DType,
        batch: usize,
        max_rows: usize,
        new_rows: usize,
        width: usize,
        state: BufRef,
        value: BufRef,
        position: BufRef,
        #[serde(default)]
        positions_per_batch: bool,
    },
    /// out[r, :] = a[r, :] · wᵀ for `rows` rows of `k` elements (row stride
    /// `lda`); w is `n` rows of `format` blocks read as stored (2n with
    /// `glu`); out is contiguous `[rows, n]`. f32 accumulation. The fused
    /// forms (`Op::QMatMulFused`), in order: `norm` replaces each a row by
    /// its RmsNorm times gamma; `glu` makes out = silu(a·w[..n]ᵀ) ·
    /// (a·w[n..2n]ᵀ); `residual` (`[rows, n]` contiguous, a's dtype, either
    /// disjoint from out or out itself) is added last. `scratch`
    /// ([`qmatmul_scratch_parts`] bytes, disjoint from every operand), for a
    /// backend that runs many rows as a library matmul over weights decoded
    /// into it; the planner adds it from the rows its backend asks for
    /// (`CompileOptions::qmatmul_scratch_rows`), and a backend that has no
    /// use for it ignores it.
    QMatMul {
        format: QFormat,
        dtype: DType,
        rows: usize,
        n: usize,
        k: usize,
        a: BufRef,
        lda: u64,
        w: BufRef,
        out: BufRef,
        #[serde(default)]
        norm: Option<QNorm>,
        #[serde(default)]
        glu: bool,
        #[serde(default)]
        residual: Option<BufRef>,
        #[serde(default)]
        scratch: Option<BufRef>,
    },
    /// out[i, :] = dequantised table row ids[i] (f32); `vocab` rows of `dim`
    /// elements in `format` blocks. An id outside 0..vocab is an error.
    QGather {
        format: QFormat,
        id_dtype: DType,
        n: usize,
        dim: usize,
        vocab: usize,
        table: BufRef,
        ids: BufRef,
        out: BufRef,
    },
    /// Next-token sampling over `[batch, vocab]` f32 logits (`Op::Sample`):
    /// fparams f32 `[batch, 4]`, iparams i32 `[batch, 4]`, history i32
    /// `[batch, history_len]`, position i32 `[batch]` → out i32 `[batch]`.
    Sample {
        batch: usize,
        vocab: usize,
        history_len: usize,
        logits: BufRef,
        fparams: BufRef,
        iparams: BufRef,
        history: BufRef,
        position: BufRef,
        out: BufRef,
    },
}

impl Thunk {
    /// The plain thunks a fused thunk stands for (run in order, they compute
    /// exactly what it does), or None for a plain thunk.
    pub fn parts(&self) -> Option<&[Thunk]> {
        match self {
            Thunk::FeedForward(f) => Some(&f.parts),
            _ => None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Thunk::MatMul(_) => "matmul",
            Thunk::Binary { .. } => "binary",
            Thunk::Activation { .. } => "activation",
            Thunk::Norm { rms: false, .. } => "layer_norm",
            Thunk::Norm { rms: true, .. } => "rms_norm",
            Thunk::Softmax { .. } => "softmax",
            Thunk::Reduce { .. } => "reduce",
            Thunk::ArgMax { .. } => "argmax",
            Thunk::TopK { .. } => "topk",
            Thunk::Gather { .. } => "gather",
            Thunk::Copy { .. } => "copy",
            Thunk::Cast { .. } => "cast",
            Thunk::Attention(_) => "attention",
            Thunk::AttentionAppend(_) => "attention_append",
            Thunk::FeedForward(_) => "feed_forward",
            Thunk::Rope { .. } => "rope",
            Thunk::SwiGlu { .. } => "swiglu",
            Thunk::MaskedMean { .. } => "masked_mean",
            Thunk::EmbedNorm { .. } => "embed_norm",
            Thunk::WriteState { .. } => "write_state",
            Thunk::QMatMul { .. } => "qmatmul",
            Thunk::QGather { .. } => "qgather",
            Thunk::Sample { .. } => "sample",
        }
    }
}

/// A named tensor the schedule reads or writes: an input, output, weight or
/// state. For inputs and outputs `buf` is where it lives in the arena.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorSlot {
    pub name: String,
    pub shape: Shape,
    pub dtype: DType,
    pub buf: BufRef,
}

/// A weight as the schedule sees it: one or more store params, concatenated
/// along `concat_axis` when there are several (e.g. Q, K, V merged into one
/// QKV matrix by a pass), converted to `dtype`. Backends resolve it through
/// `WeightStore::resolve`, which caches the result once per model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightSlot {
    /// Display name (the param name, or the parts joined with '+').
    pub name: String,
    pub parts: Vec<String>,
    pub concat_axis: usize,
    pub shape: Shape,
    pub dtype: DType,
}

/// Literal data referenced through `Space::Const`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConstBlob {
    pub shape: Shape,
    pub dtype: DType,
    pub data: Vec<u8>,
}

/// Arena accounting for `rlx inspect` and tests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ArenaSummary {
    /// Bytes the planner asks for (the arena size).
    pub planned_bytes: u64,
    /// Sum of the sizes of all intermediates if none shared memory.
    pub naive_bytes: u64,
    /// (node, offset, bytes, first step, last step) for every placed buffer.
    pub buffers: Vec<PlacedBuffer>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlacedBuffer {
    pub node: usize,
    pub offset: u64,
    pub bytes: u64,
    pub first: usize,
    pub last: usize,
}

/// Everything a backend needs to run a compiled graph.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub thunks: Vec<Thunk>,
    /// Bytes of one activation arena (256-byte aligned).
    pub arena_bytes: u64,
    pub inputs: Vec<TensorSlot>,
    pub outputs: Vec<TensorSlot>,
    /// Indexed by `Space::Weight(i)`.
    pub weights: Vec<WeightSlot>,
    /// Indexed by `Space::State(i)`; `buf` is the whole tensor.
    pub states: Vec<TensorSlot>,
    pub consts: Vec<ConstBlob>,
    pub arena: ArenaSummary,
}

pub const ARENA_ALIGN: u64 = 256;

impl Schedule {
    /// This schedule with every fused thunk that `supported` refuses
    /// replaced by its plain parts (`Thunk::parts`), which compute exactly
    /// what it does: how a backend runs a fusion it has no kernel for.
    /// `supported` is asked about each fused thunk once, in order.
    pub fn expand(&self, mut supported: impl FnMut(&Thunk) -> bool) -> Schedule {
        let mut thunks = Vec::with_capacity(self.thunks.len());
        for t in &self.thunks {
            match t.parts() {
                Some(parts) if !supported(t) => thunks.extend(parts.iter().cloned()),
                _ => thunks.push(t.clone()),
            }
        }
        Schedule { thunks, ..self.clone() }
    }
}
