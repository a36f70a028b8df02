//! One file per kernel family; `run` maps a thunk to its kernel.

pub mod attention;
pub mod copy;
pub mod elementwise;
pub mod gather;
pub mod lanes;
pub mod matmul;
pub mod matmul_small;
pub mod norm;
pub mod qlinear;
pub mod quant;
pub mod reduce;
pub mod rope;
pub mod sample;
pub mod softmax;
pub mod state;
pub mod topk;

use rlx_schedule::Thunk;

use crate::memory::Mem;
use crate::{Result, Scratch};

/// Runs one thunk. `copy` is a matmul's weight as prepared at prepare time
/// (`matmul::WeightCopy`); `threads` sizes gemm's parallelism.
pub fn run(thunk: &Thunk, mem: &Mem, scratch: &mut Scratch, copy: Option<&matmul::WeightCopy>, threads: usize) -> Result<()> {
    match thunk {
        Thunk::MatMul(mm) => matmul::run(mm, mem, scratch, copy, threads),
        Thunk::Binary { op, dtype, out_shape, a, a_strides, b, b_strides, out } => {
            elementwise::binary(*op, *dtype, out_shape, a, a_strides, b, b_strides, out, mem)
        }
        Thunk::Activation { act, dtype, n, x, out } => elementwise::activation(*act, *dtype, *n, x, out, mem),
        Thunk::Norm { rms, dtype, rows, cols, eps, x, residual, gamma, beta, out } => norm::run(
            &norm::NormArgs {
                rms: *rms,
                dtype: *dtype,
                rows: *rows,
                cols: *cols,
                eps: *eps,
                x,
                residual: residual.as_ref(),
                gamma,
                beta: beta.as_ref(),
                out,
            },
            mem,
        ),
        Thunk::Softmax { dtype, outer, len, inner, x, out } => softmax::run(*dtype, *outer, *len, *inner, x, out, mem),
        Thunk::Reduce { op, dtype, outer, len, inner, x, out } => reduce::reduce(*op, *dtype, *outer, *len, *inner, x, out, mem),
        Thunk::ArgMax { dtype, outer, len, inner, x, out } => reduce::argmax(*dtype, *outer, *len, *inner, x, out, mem),
        Thunk::TopK { dtype, rows, len, k, x, values, indices } => topk::run(
            &topk::TopKArgs { dtype: *dtype, rows: *rows, len: *len, k: *k, x, values: values.as_ref(), indices: indices.as_ref() },
            mem,
        ),
        Thunk::Gather { dtype, id_dtype, n, dim, vocab, table, ids, out } => {
            gather::run(&gather::GatherArgs { dtype: *dtype, id_dtype: *id_dtype, n: *n, dim: *dim, vocab: *vocab, table, ids, out }, mem)
        }
        Thunk::Copy { dtype, shape, src, src_strides, dst, dst_strides } => {
            copy::run(*dtype, shape, src, src_strides, dst, dst_strides, mem)
        }
        Thunk::Cast { from, to, n, src, dst } => elementwise::cast(*from, *to, *n, src, dst, mem),
        Thunk::Attention(a) => attention::run(a, mem),
        Thunk::AttentionAppend(t) => append(t, mem),
        // The reference: the parts in order (an executable runs them as
        // thunks of their own, with their matmuls' weight copies).
        Thunk::FeedForward(f) => f.parts.iter().try_for_each(|p| run(p, mem, scratch, None, threads)),
        Thunk::Rope { dtype, mode, theta, batch, seq, heads, head_dim, x, positions, positions_per_batch, out, freq_factors } => rope::run(
            &rope::RopeArgs {
                dtype: *dtype,
                mode: *mode,
                theta: *theta,
                batch: *batch,
                seq: *seq,
                heads: *heads,
                head_dim: *head_dim,
                x,
                positions,
                positions_per_batch: *positions_per_batch,
                out,
                freq_factors: freq_factors.as_ref(),
            },
            mem,
        ),
        Thunk::SwiGlu { dtype, rows, cols, gate, up, out } => elementwise::swiglu(*dtype, *rows, *cols, gate, up, out, mem),
        Thunk::EmbedNorm { dtype, id_dtype, rows, cols, vocab, eps, table, ids, addends, gamma, beta, out } => norm::embed(
            &norm::EmbedArgs {
                dtype: *dtype,
                id_dtype: *id_dtype,
                rows: *rows,
                cols: *cols,
                vocab: *vocab,
                eps: *eps,
                table,
                ids,
                addends,
                gamma,
                beta,
                out,
            },
            mem,
        ),
        Thunk::MaskedMean { dtype, mask_dtype, out_dtype, batch, seq, dim, x, mask, out } => {
            reduce::masked_mean(*dtype, *mask_dtype, *out_dtype, [*batch, *seq, *dim], x, mask, out, mem)
        }
        Thunk::WriteState { dtype, value_dtype, batch, max_rows, new_rows, width, state, value, position, positions_per_batch } => {
            state::run(
                &state::WriteStateArgs {
                    dtype: *dtype,
                    value_dtype: *value_dtype,
                    batch: *batch,
                    max_rows: *max_rows,
                    new_rows: *new_rows,
                    width: *width,
                    state,
                    value,
                    position,
                    positions_per_batch: *positions_per_batch,
                    value_batch_stride: new_rows * width,
                    value_row_stride: *width,
                },
                mem,
            )
        }
        Thunk::QMatMul { format, rows, n, k, a, lda, w, out, norm, glu, residual, .. } => qlinear::matmul(
            &qlinear::QMatMulArgs {
                format: *format,
                rows: *rows,
                n: *n,
                k: *k,
                a,
                lda: *lda,
                w,
                out,
                norm: norm.as_ref(),
                glu: *glu,
                residual: residual.as_ref(),
            },
            mem,
        ),
        Thunk::QGather { format, id_dtype, n, dim, vocab, table, ids, out } => qlinear::gather(
            &qlinear::QGatherArgs { format: *format, id_dtype: *id_dtype, n: *n, dim: *dim, vocab: *vocab, table, ids, out },
            mem,
        ),
        Thunk::Sample { batch, vocab, history_len, logits, fparams, iparams, history, position, out } => sample::run(
            &sample::SampleArgs {
                batch: *batch,
                vocab: *vocab,
                history_len: *history_len,
                logits,
                fparams,
                iparams,
                history,
                position,
                out,
            },
            mem,
        ),
    }
}

/// An attention append as the three steps it fuses: RoPE of q and the new
/// keys into the thunk's scratch, the cache writes, the attention.
fn append(t: &rlx_schedule::AttentionAppendThunk, mem: &Mem) -> Result<()> {
    let a = &t.attn;
    let kvw = a.kv_heads * a.head_dim;
    let mut k_new = t.k_new;
    if let Some(r) = &t.rope {
        // q and the new keys share their positions: their angles are
        // computed once.
        rope::run_shared(
            &rope::RopeArgs {
                dtype: a.dtype,
                mode: r.mode,
                theta: r.theta,
                batch: a.batch,
                seq: 1,
                heads: a.heads,
                head_dim: a.head_dim,
                x: &t.q,
                positions: &r.positions,
                positions_per_batch: r.positions_per_batch,
                out: &r.q_out,
                freq_factors: r.freq_factors.as_ref(),
            },
            &[rope::RopeTarget { heads: a.kv_heads, x: &t.k_new, out: &r.k_out }],
            mem,
        )?;
        k_new = rlx_schedule::SeqView { buf: r.k_out, batch_stride: kvw as u64, row_stride: kvw as u64 };
    }
    let write = |cache: &rlx_schedule::SeqView, value: &rlx_schedule::SeqView| {
        state::run(
            &state::WriteStateArgs {
                dtype: a.kv_dtype,
                value_dtype: a.dtype,
                batch: a.batch,
                max_rows: a.kv_len,
                new_rows: 1,
                width: kvw,
                state: &cache.buf,
                value: &value.buf,
                position: &t.position,
                positions_per_batch: t.position_per_batch,
                value_batch_stride: value.batch_stride as usize,
                value_row_stride: value.row_stride as usize,
            },
            mem,
        )
    };
    write(&a.k, &k_new)?;
    write(&a.v, &t.v_new)?;
    attention::run(a, mem)
}
