//! What every thunk touches, checked before a backend runs it: each
//! operand's byte extent (derived from its dims and strides, the way the
//! kernels index) must fit inside its `BufRef`, writes must not go to
//! weights or constants, and the few kernels that cannot run in place must
//! not have their output overlap an input. Backends call
//! [`check_operands`] at prepare, so a schedule with a compiler bug, or one
//! deserialised from a file that lies, fails with an error there instead of
//! reading or writing out of bounds on the device.

use rlx_ir::DType;

use crate::{BufRef, SeqView, Space, Thunk};

/// One operand of a thunk as the kernel will touch it.
pub struct Operand {
    pub what: &'static str,
    pub buf: BufRef,
    /// Bytes the kernel reads or writes from `buf.offset`.
    pub need: u64,
    /// Alignment of the element type the kernel views it as.
    pub align: usize,
    pub write: bool,
}

/// Elements spanned by a strided view: 1 + Σ (dim - 1) * stride, or 0 for
/// an empty view. Saturates rather than overflowing, so a huge stride fails
/// the bounds check instead of wrapping.
pub fn extent(dims: &[usize], strides: &[u64]) -> u64 {
    if dims.contains(&0) {
        return 0;
    }
    dims.iter().zip(strides).fold(1u64, |acc, (&d, &s)| acc.saturating_add((d as u64 - 1).saturating_mul(s)))
}

/// Product of dims, saturating: a schedule whose sizes overflow asks for
/// usize::MAX bytes and fails validation instead of wrapping to a small size.
pub fn prod(dims: &[usize]) -> usize {
    dims.iter().fold(1usize, |acc, &d| acc.saturating_mul(d))
}

fn n_bytes(elems: usize, dtype: DType) -> u64 {
    (elems as u64).saturating_mul(dtype.size() as u64)
}

fn seq(view: &SeqView, batch: usize, rows: usize, width: usize, dtype: DType, what: &'static str) -> Operand {
    let e = extent(&[batch, rows, width], &[view.batch_stride, view.row_stride, 1]);
    Operand { what, buf: view.buf, need: e.saturating_mul(dtype.size() as u64), align: dtype.size(), write: false }
}

fn rd(what: &'static str, buf: BufRef, elems: usize, dtype: DType) -> Operand {
    Operand { what, buf, need: n_bytes(elems, dtype), align: dtype.size(), write: false }
}

fn wr(what: &'static str, buf: BufRef, elems: usize, dtype: DType) -> Operand {
    Operand { what, buf, need: n_bytes(elems, dtype), align: dtype.size(), write: true }
}

/// An attention's operands; `cache_write`: k and v are caches the thunk
/// writes (an append) rather than inputs.
fn attention(a: &crate::AttentionThunk, cache_write: bool) -> Vec<Operand> {
    let qw = prod(&[a.heads, a.head_dim]);
    let kw = prod(&[a.kv_heads, a.head_dim]);
    let mut v = vec![
        seq(&a.q, a.batch, a.q_len, qw, a.dtype, "q"),
        Operand { write: cache_write, ..seq(&a.k, a.batch, a.kv_len, kw, a.kv_dtype, "k") },
        Operand { write: cache_write, ..seq(&a.v, a.batch, a.kv_len, kw, a.kv_dtype, "v") },
        wr("out", a.out, prod(&[a.batch, a.q_len, qw]), a.dtype),
    ];
    if let Some(m) = a.mask {
        v.push(rd("mask", m, prod(&[a.batch, a.kv_len]), a.mask_dtype));
    }
    if let Some(l) = a.valid_len {
        v.push(rd("valid_len", l, if a.valid_len_per_batch { a.batch } else { 1 }, DType::I32));
    }
    v
}

/// Every operand of a thunk with the bytes its kernel touches.
pub fn operands(t: &Thunk) -> Vec<Operand> {
    match t {
        Thunk::MatMul(mm) => {
            let es = mm.dtype.size() as u64;
            let a = extent(&[mm.batch, mm.m, mm.k], &[mm.a_batch_stride, mm.lda, 1]);
            let b = if mm.b_trans {
                extent(&[mm.batch, mm.n, mm.k], &[mm.b_batch_stride, mm.ldb, 1])
            } else {
                extent(&[mm.batch, mm.k, mm.n], &[mm.b_batch_stride, mm.ldb, 1])
            };
            let mut v = vec![
                Operand { what: "a", buf: mm.a, need: a.saturating_mul(es), align: mm.dtype.size(), write: false },
                Operand { what: "b", buf: mm.b, need: b.saturating_mul(es), align: mm.dtype.size(), write: false },
                wr("out", mm.out, prod(&[mm.batch, mm.m, mm.n]), mm.dtype),
            ];
            if let Some(bias) = mm.bias {
                v.push(rd("bias", bias, mm.n, mm.dtype));
            }
            if let Some(r) = mm.residual {
                v.push(rd("residual", r, prod(&[mm.batch, mm.m, mm.n]), mm.dtype));
            }
            v
        }
        Thunk::Binary { dtype, out_shape, a, a_strides, b, b_strides, out, .. } => {
            let es = dtype.size() as u64;
            vec![
                Operand { what: "a", buf: *a, need: extent(out_shape, a_strides).saturating_mul(es), align: dtype.size(), write: false },
                Operand { what: "b", buf: *b, need: extent(out_shape, b_strides).saturating_mul(es), align: dtype.size(), write: false },
                wr("out", *out, prod(out_shape), *dtype),
            ]
        }
        Thunk::Activation { dtype, n, x, out, .. } => vec![rd("x", *x, *n, *dtype), wr("out", *out, *n, *dtype)],
        Thunk::Norm { dtype, rows, cols, x, residual, gamma, beta, out, .. } => {
            let mut v = vec![
                rd("x", *x, prod(&[*rows, *cols]), *dtype),
                rd("gamma", *gamma, *cols, *dtype),
                wr("out", *out, prod(&[*rows, *cols]), *dtype),
            ];
            if let Some(r) = residual {
                v.push(rd("residual", *r, prod(&[*rows, *cols]), *dtype));
            }
            if let Some(b) = beta {
                v.push(rd("beta", *b, *cols, *dtype));
            }
            v
        }
        Thunk::Softmax { dtype, outer, len, inner, x, out } => {
            vec![rd("x", *x, prod(&[*outer, *len, *inner]), *dtype), wr("out", *out, prod(&[*outer, *len, *inner]), *dtype)]
        }
        Thunk::Reduce { dtype, outer, len, inner, x, out, .. } => {
            vec![rd("x", *x, prod(&[*outer, *len, *inner]), *dtype), wr("out", *out, prod(&[*outer, *inner]), *dtype)]
        }
        Thunk::ArgMax { dtype, outer, len, inner, x, out } => {
            vec![rd("x", *x, prod(&[*outer, *len, *inner]), *dtype), wr("out", *out, prod(&[*outer, *inner]), DType::I32)]
        }
        Thunk::TopK { dtype, rows, len, k, x, values, indices } => {
            let mut v = vec![rd("x", *x, prod(&[*rows, *len]), *dtype)];
            if let Some(b) = values {
                v.push(wr("values", *b, prod(&[*rows, *k]), *dtype));
            }
            if let Some(b) = indices {
                v.push(wr("indices", *b, prod(&[*rows, *k]), DType::I32));
            }
            v
        }
        Thunk::Gather { dtype, id_dtype, n, dim, vocab, table, ids, out } => {
            vec![
                rd("table", *table, prod(&[*vocab, *dim]), *dtype),
                rd("ids", *ids, *n, *id_dtype),
                wr("out", *out, prod(&[*n, *dim]), *dtype),
            ]
        }
        Thunk::Copy { dtype, shape, src, src_strides, dst, dst_strides } => {
            let es = dtype.size() as u64;
            vec![
                Operand { what: "src", buf: *src, need: extent(shape, src_strides).saturating_mul(es), align: dtype.size(), write: false },
                Operand { what: "dst", buf: *dst, need: extent(shape, dst_strides).saturating_mul(es), align: dtype.size(), write: true },
            ]
        }
        Thunk::Cast { from, to, n, src, dst } => vec![rd("src", *src, *n, *from), wr("dst", *dst, *n, *to)],
        Thunk::Attention(a) => attention(a, false),
        Thunk::AttentionAppend(t) => {
            let a = &t.attn;
            let qw = prod(&[a.heads, a.head_dim]);
            let kw = prod(&[a.kv_heads, a.head_dim]);
            let mut v = attention(a, true);
            v.push(seq(&t.q, a.batch, 1, qw, a.dtype, "q as given"));
            v.push(seq(&t.k_new, a.batch, 1, kw, a.dtype, "k_new"));
            v.push(seq(&t.v_new, a.batch, 1, kw, a.dtype, "v_new"));
            v.push(rd("position", t.position, if t.position_per_batch { a.batch } else { 1 }, DType::I32));
            if let Some(r) = &t.rope {
                v.push(rd("rope positions", r.positions, if r.positions_per_batch { a.batch } else { 1 }, DType::I32));
                if let Some(f) = r.freq_factors {
                    v.push(rd("freq_factors", f, a.head_dim / 2, DType::F32));
                }
                v.push(wr("turned q", r.q_out, prod(&[a.batch, qw]), a.dtype));
                v.push(wr("turned k", r.k_out, prod(&[a.batch, kw]), a.dtype));
            }
            v
        }
        Thunk::FeedForward(ff) => ff.parts.iter().flat_map(operands).collect(),
        Thunk::Rope { dtype, batch, seq: s, heads, head_dim, x, positions, positions_per_batch, out, freq_factors, .. } => {
            let w = prod(&[*heads, *head_dim]);
            let np = if *positions_per_batch { prod(&[*batch, *s]) } else { *s };
            let mut v = vec![
                seq(x, *batch, *s, w, *dtype, "x"),
                rd("positions", *positions, np, DType::I32),
                wr("out", *out, prod(&[*batch, *s, w]), *dtype),
            ];
            if let Some(f) = freq_factors {
                v.push(rd("freq_factors", *f, *head_dim / 2, DType::F32));
            }
            v
        }
        Thunk::MaskedMean { dtype, mask_dtype, out_dtype, batch, seq, dim, x, mask, out } => vec![
            rd("x", *x, prod(&[*batch, *seq, *dim]), *dtype),
            rd("mask", *mask, prod(&[*batch, *seq]), *mask_dtype),
            wr("out", *out, prod(&[*batch, *dim]), *out_dtype),
        ],
        Thunk::EmbedNorm { dtype, id_dtype, rows, cols, vocab, table, ids, addends, gamma, beta, out, .. } => {
            let mut v = vec![rd("table", *table, prod(&[*vocab, *cols]), *dtype), rd("ids", *ids, *rows, *id_dtype)];
            for (b, n) in addends {
                v.push(rd("addend", *b, prod(&[*n, *cols]), *dtype));
            }
            v.push(rd("gamma", *gamma, *cols, *dtype));
            v.push(rd("beta", *beta, *cols, *dtype));
            v.push(wr("out", *out, prod(&[*rows, *cols]), *dtype));
            v
        }
        Thunk::SwiGlu { dtype, rows, cols, gate, up, out } => {
            let es = dtype.size() as u64;
            vec![
                Operand {
                    what: "gate",
                    buf: gate.buf,
                    need: extent(&[*rows, *cols], &[gate.row_stride, 1]).saturating_mul(es),
                    align: dtype.size(),
                    write: false,
                },
                Operand {
                    what: "up",
                    buf: up.buf,
                    need: extent(&[*rows, *cols], &[up.row_stride, 1]).saturating_mul(es),
                    align: dtype.size(),
                    write: false,
                },
                wr("out", *out, prod(&[*rows, *cols]), *dtype),
            ]
        }
        Thunk::WriteState { dtype, value_dtype, batch, max_rows, new_rows, width, state, value, position, positions_per_batch } => vec![
            wr("state", *state, prod(&[*batch, *max_rows, *width]), *dtype),
            rd("value", *value, prod(&[*batch, *new_rows, *width]), *value_dtype),
            rd("position", *position, if *positions_per_batch { *batch } else { 1 }, DType::I32),
        ],
        Thunk::QMatMul { format, dtype, rows, n, k, a, lda, w, out, norm, glu, residual, scratch } => {
            let row_bytes = format.row_bytes(*k).unwrap_or(usize::MAX);
            let wrows = if *glu { n.saturating_mul(2) } else { *n };
            let mut ops = vec![
                Operand {
                    what: "a",
                    buf: *a,
                    need: extent(&[*rows, *k], &[*lda, 1]).saturating_mul(dtype.size() as u64),
                    align: dtype.size(),
                    write: false,
                },
                rd("w", *w, prod(&[wrows, row_bytes]), DType::U8),
                wr("out", *out, prod(&[*rows, *n]), *dtype),
            ];
            if let Some(nm) = norm {
                ops.push(rd("gamma", nm.gamma, *k, *dtype));
            }
            if let Some(r) = residual {
                ops.push(rd("residual", *r, prod(&[*rows, *n]), *dtype));
            }
            if let Some(x) = scratch {
                let need = crate::qmatmul_scratch_parts(*rows, *n, *k, *glu).map_or(u64::MAX, |p| p.iter().sum());
                ops.push(Operand { what: "scratch", buf: *x, need, align: 16, write: true });
            }
            ops
        }
        Thunk::QGather { format, id_dtype, n, dim, vocab, table, ids, out } => {
            let row_bytes = format.row_bytes(*dim).unwrap_or(usize::MAX);
            vec![
                rd("table", *table, prod(&[*vocab, row_bytes]), DType::U8),
                rd("ids", *ids, *n, *id_dtype),
                wr("out", *out, prod(&[*n, *dim]), DType::F32),
            ]
        }
        Thunk::Sample { batch, vocab, history_len, logits, fparams, iparams, history, position, out } => vec![
            rd("logits", *logits, prod(&[*batch, *vocab]), DType::F32),
            rd("fparams", *fparams, prod(&[*batch, 4]), DType::F32),
            rd("iparams", *iparams, prod(&[*batch, 4]), DType::I32),
            rd("history", *history, prod(&[*batch, *history_len]), DType::I32),
            rd("position", *position, *batch, DType::I32),
            wr("out", *out, *batch, DType::I32),
        ],
    }
}

fn overlaps(a: &BufRef, b: &BufRef) -> bool {
    a.space == b.space && a.offset < b.offset.saturating_add(b.bytes) && b.offset < a.offset.saturating_add(a.bytes)
}

/// Stride lists match their dims, every operand starts aligned for its
/// element type and its extent fits its buffer, nothing writes a weight or a
/// constant, and attention / matmul outputs do not overlap their inputs
/// (their kernels read the inputs while writing the output; elementwise
/// kernels may run in place). The error names the operand and both sizes.
pub fn check_operands(t: &Thunk) -> Result<(), String> {
    // `extent` pairs dims with strides: a shorter stride list would make
    // the extent look smaller than what the kernel indexes.
    match t {
        Thunk::Binary { out_shape, a_strides, b_strides, .. }
            if a_strides.len() != out_shape.len() || b_strides.len() != out_shape.len() =>
        {
            return Err(format!("binary: {} dims but {} and {} strides", out_shape.len(), a_strides.len(), b_strides.len()));
        }
        Thunk::Copy { shape, src_strides, dst_strides, .. } if src_strides.len() != shape.len() || dst_strides.len() != shape.len() => {
            return Err(format!("copy: {} dims but {} and {} strides", shape.len(), src_strides.len(), dst_strides.len()));
        }
        _ => {}
    }
    for op in operands(t) {
        if op.buf.offset % op.align.max(1) as u64 != 0 {
            return Err(format!("operand {}: offset {} is not a multiple of its element size {}", op.what, op.buf.offset, op.align));
        }
        if op.need > op.buf.bytes {
            return Err(format!("operand {}: the kernel touches {} bytes but the buffer holds {}", op.what, op.need, op.buf.bytes));
        }
        if op.write && matches!(op.buf.space, Space::Weight(_) | Space::Const(_)) {
            return Err(format!("operand {} writes to read-only {:?}", op.what, op.buf.space));
        }
    }
    // A fused block: its parts form one, and each passes its own checks.
    if let Thunk::FeedForward(ff) = t {
        ff.roles()?;
        for (k, p) in ff.parts.iter().enumerate() {
            check_operands(p).map_err(|e| format!("feed_forward part {k} ({}): {e}", p.kind()))?;
        }
    }
    // Attention tasks read every key and value row while others write
    // their output rows, so the output must not share bytes with q, k or v.
    if let Thunk::Attention(a) = t {
        if [a.q.buf, a.k.buf, a.v.buf].iter().any(|b| overlaps(&a.out, b)) {
            return Err("attention output overlaps q, k or v".into());
        }
    }
    // An append writes the caches, the output and its scratch while it
    // reads the new rows: none of those may share bytes.
    if let Thunk::AttentionAppend(x) = t {
        let a = &x.attn;
        let mut written = vec![("output", a.out), ("key cache", a.k.buf), ("value cache", a.v.buf)];
        if let Some(r) = &x.rope {
            written.push(("turned q", r.q_out));
            written.push(("turned k", r.k_out));
        }
        let read = [("q", x.q.buf), ("k_new", x.k_new.buf), ("v_new", x.v_new.buf), ("position", x.position)];
        for (k, (wn, w)) in written.iter().enumerate() {
            if let Some((on, _)) = written[k + 1..].iter().chain(&read).find(|(_, o)| overlaps(w, o)) {
                return Err(format!("attention_append: the {wn} overlaps the {on}"));
            }
        }
        if a.q_len != 1 {
            return Err(format!("attention_append appends one row per sequence, found q_len {}", a.q_len));
        }
    }
    // gemm reads its operands while it writes the output, so they must not
    // share bytes (elementwise kernels may run in place; a matmul cannot).
    if let Thunk::QMatMul { a, w, out, norm, residual, scratch, .. } = t {
        if overlaps(out, a) || overlaps(out, w) || norm.is_some_and(|nm| overlaps(out, &nm.gamma)) {
            return Err("qmatmul output overlaps an operand (a, w or gamma)".into());
        }
        if let Some(x) = scratch {
            let others = [Some(a), Some(w), Some(out), norm.as_ref().map(|nm| &nm.gamma), residual.as_ref()];
            if others.into_iter().flatten().any(|o| overlaps(x, o)) {
                return Err("qmatmul scratch overlaps an operand (a, w, out, gamma or residual)".into());
            }
        }
        if let Some(r) = residual {
            if overlaps(out, r) && r != out {
                return Err("qmatmul residual partly overlaps the output (it must be the same buffer or disjoint)".into());
            }
        }
    }
    if let Thunk::MatMul(mm) = t {
        if overlaps(&mm.out, &mm.a) || overlaps(&mm.out, &mm.b) {
            return Err("matmul output overlaps an operand (a or b)".into());
        }
        if let Some(r) = mm.residual {
            if overlaps(&mm.out, &r) && r != mm.out {
                return Err("matmul residual partly overlaps the output (it must be the same buffer or disjoint)".into());
            }
        }
    }
    Ok(())
}
