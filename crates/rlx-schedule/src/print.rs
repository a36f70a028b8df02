//! Human-readable schedule: one line per thunk, then the tables and the
//! arena summary. Addresses read `arena+0x1200`, `w3`, `w3+0x40`, `s0`, `c1`.

use std::fmt;

use crate::{BufRef, RowsView, Schedule, SeqView, Space, Thunk};

impl fmt::Display for BufRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (prefix, idx) = match self.space {
            Space::Arena => return write!(f, "arena+{:#x}", self.offset),
            Space::Weight(i) => ("w", i),
            Space::State(i) => ("s", i),
            Space::Const(i) => ("c", i),
        };
        write!(f, "{prefix}{idx}")?;
        if self.offset != 0 {
            write!(f, "+{:#x}", self.offset)?;
        }
        Ok(())
    }
}

fn seq(v: &SeqView) -> String {
    format!("{}[b*{} r*{}]", v.buf, v.batch_stride, v.row_stride)
}

fn rows(v: &RowsView) -> String {
    format!("{}[r*{}]", v.buf, v.row_stride)
}

fn opt(b: &Option<BufRef>) -> String {
    b.map_or_else(|| "-".to_string(), |b| b.to_string())
}

fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// The arguments of one thunk, after its kind.
fn describe(t: &Thunk) -> String {
    match t {
        Thunk::MatMul(m) => {
            let mut s = format!(
                "{} batch={} m={} n={} k={} a={} lda={} b={}{} ldb={}",
                m.dtype,
                m.batch,
                m.m,
                m.n,
                m.k,
                m.a,
                m.lda,
                m.b,
                if m.b_trans { "ᵀ" } else { "" },
                m.ldb
            );
            if m.batch > 1 {
                s += &format!(" a_bs={} b_bs={}", m.a_batch_stride, m.b_batch_stride);
            }
            if let Some(b) = m.bias {
                s += &format!(" bias={b}");
            }
            if let Some(a) = m.act {
                s += &format!(" act={a:?}");
            }
            if let Some(r) = m.residual {
                s += &format!(" residual={r}");
            }
            s + &format!(" -> {}", m.out)
        }
        Thunk::Binary { op, dtype, out_shape, a, a_strides, b, b_strides, out } => {
            format!("{op:?} {dtype} {out_shape:?} a={a}{a_strides:?} b={b}{b_strides:?} -> {out}")
        }
        Thunk::Activation { act, dtype, n, x, out } => format!("{act:?} {dtype} n={n} x={x} -> {out}"),
        Thunk::Norm { dtype, rows, cols, eps, x, residual, gamma, beta, out, .. } => format!(
            "{dtype} rows={rows} cols={cols} eps={eps:e} x={x} residual={} gamma={gamma} beta={} -> {out}",
            opt(residual),
            opt(beta)
        ),
        Thunk::Softmax { dtype, outer, len, inner, x, out } => format!("{dtype} [{outer}, {len}, {inner}] x={x} -> {out}"),
        Thunk::Reduce { op, dtype, outer, len, inner, x, out } => format!("{op:?} {dtype} [{outer}, {len}, {inner}] x={x} -> {out}"),
        Thunk::ArgMax { dtype, outer, len, inner, x, out } => format!("{dtype} [{outer}, {len}, {inner}] x={x} -> {out}"),
        Thunk::TopK { dtype, rows, len, k, x, values, indices } => {
            format!("{dtype} rows={rows} len={len} k={k} x={x} -> values={} indices={}", opt(values), opt(indices))
        }
        Thunk::Gather { dtype, id_dtype, n, dim, vocab, table, ids, out } => {
            format!("{dtype} n={n} dim={dim} vocab={vocab} table={table} ids={ids}:{id_dtype} -> {out}")
        }
        Thunk::Copy { dtype, shape, src, src_strides, dst, dst_strides } => {
            format!("{dtype} {shape:?} {src}{src_strides:?} -> {dst}{dst_strides:?}")
        }
        Thunk::Cast { from, to, n, src, dst } => format!("{from}->{to} n={n} {src} -> {dst}"),
        Thunk::Attention(a) => attention(a),
        Thunk::AttentionAppend(t) => {
            let r = t.rope.as_ref().map_or(String::new(), |r| {
                let f = r.freq_factors.map(|f| format!(" factors={f}")).unwrap_or_default();
                format!(" rope {:?} theta={} pos={}{f} scratch={},{}", r.mode, r.theta, r.positions, r.q_out, r.k_out)
            });
            format!("q={} k_new={} v_new={} at={}{r} then {}", seq(&t.q), seq(&t.k_new), seq(&t.v_new), t.position, attention(&t.attn))
        }
        Thunk::FeedForward(ff) => {
            let parts: Vec<String> = ff.parts.iter().map(|p| format!("\n        {:<11} {}", p.kind(), describe(p))).collect();
            format!("{} parts:{}", ff.parts.len(), parts.concat())
        }
        Thunk::Rope { dtype, mode, theta, batch, seq: s, heads, head_dim, x, positions, out, freq_factors, .. } => {
            let f = freq_factors.map(|f| format!(" factors={f}")).unwrap_or_default();
            format!("{dtype} {mode:?} theta={theta} [{batch}, {s}, {heads}x{head_dim}] x={} pos={positions}{f} -> {out}", seq(x))
        }
        Thunk::MaskedMean { dtype, mask_dtype, out_dtype, batch, seq: s, dim, x, mask, out } => {
            format!("{dtype} [{batch}, {s}, {dim}] x={x} mask={mask}:{mask_dtype} -> {out}:{out_dtype}")
        }
        Thunk::EmbedNorm { dtype, id_dtype, rows: r, cols, vocab, eps, table, ids, addends, gamma, beta, out } => {
            let adds: Vec<String> = addends.iter().map(|(b, n)| format!("{b}x{n}")).collect();
            format!(
                "{dtype} rows={r} cols={cols} eps={eps:e} table={table} vocab={vocab} ids={ids}:{id_dtype} addends=[{}] gamma={gamma} beta={beta} -> {out}",
                adds.join(", ")
            )
        }
        Thunk::SwiGlu { dtype, rows: r, cols, gate, up, out } => {
            format!("{dtype} rows={r} cols={cols} gate={} up={} -> {out}", rows(gate), rows(up))
        }
        Thunk::WriteState { dtype, value_dtype, batch, max_rows, new_rows, width, state, value, position, positions_per_batch } => {
            let per = if *positions_per_batch { " per row" } else { "" };
            let from = if value_dtype != dtype { format!(" from {value_dtype}") } else { String::new() };
            format!("{dtype}{from} [{batch}, {new_rows}/{max_rows}, {width}] {value} -> {state} at pos={position}{per}")
        }
        Thunk::QMatMul { format, dtype, rows, n, k, a, lda, w, out, norm, glu, residual, scratch } => {
            let mut s = String::new();
            if let Some(nm) = norm {
                s += &format!(" rms_norm(gamma={} eps={})", nm.gamma, nm.eps);
            }
            if *glu {
                s += &format!(" swiglu(2x{n} rows)");
            }
            if let Some(r) = residual {
                s += &format!(" +residual={r}");
            }
            if let Some(x) = scratch {
                s += &format!(" scratch={x}");
            }
            format!("{dtype} [{rows}, {k}] x {format}[{n}, {k}]ᵀ a={a} lda={lda} w={w}{s} -> {out}")
        }
        Thunk::QGather { format, id_dtype, n, dim, vocab, table, ids, out } => {
            format!("{format} table={table} [{vocab}, {dim}] ids={ids}:{id_dtype} n={n} -> {out}:f32")
        }
        Thunk::Sample { batch, vocab, history_len, logits, fparams, iparams, history, position, out } => {
            format!("[{batch}, {vocab}] logits={logits} f={fparams} i={iparams} history={history}x{history_len} pos={position} -> {out}")
        }
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "inputs:")?;
        for s in &self.inputs {
            writeln!(f, "  {} : {} {} @ {}", s.name, s.shape, s.dtype, s.buf)?;
        }
        writeln!(f, "outputs:")?;
        for s in &self.outputs {
            writeln!(f, "  {} : {} {} @ {}", s.name, s.shape, s.dtype, s.buf)?;
        }
        if !self.weights.is_empty() {
            writeln!(f, "weights:")?;
            for (i, w) in self.weights.iter().enumerate() {
                let concat = if w.parts.len() > 1 { format!(" (concat axis {})", w.concat_axis) } else { String::new() };
                writeln!(f, "  w{i} {} : {} {}{concat}", w.name, w.shape, w.dtype)?;
            }
        }
        if !self.states.is_empty() {
            writeln!(f, "states:")?;
            for (i, s) in self.states.iter().enumerate() {
                writeln!(f, "  s{i} {} : {} {} ({})", s.name, s.shape, s.dtype, bytes(s.buf.bytes))?;
            }
        }
        if !self.consts.is_empty() {
            writeln!(f, "consts:")?;
            for (i, c) in self.consts.iter().enumerate() {
                writeln!(f, "  c{i} : {} {} ({})", c.shape, c.dtype, bytes(c.data.len() as u64))?;
            }
        }
        writeln!(f, "thunks:")?;
        for (i, t) in self.thunks.iter().enumerate() {
            writeln!(f, "  {i:>3} {:<11} {}", t.kind(), describe(t))?;
        }
        let a = &self.arena;
        let saved = if a.naive_bytes > 0 { 100.0 * (1.0 - a.planned_bytes as f64 / a.naive_bytes as f64) } else { 0.0 };
        writeln!(
            f,
            "arena: planned {} vs naive {} ({saved:.1}% saved), {} buffers",
            bytes(a.planned_bytes),
            bytes(a.naive_bytes),
            a.buffers.len()
        )
    }
}

fn attention(a: &crate::AttentionThunk) -> String {
    format!(
        "{}{} batch={} heads={}/{} head_dim={} q_len={} kv_len={} scale={:.4}{} q={} k={} v={} mask={} valid_len={} -> {}",
        a.dtype,
        if a.kv_dtype != a.dtype { format!(" kv={}", a.kv_dtype) } else { String::new() },
        a.batch,
        a.heads,
        a.kv_heads,
        a.head_dim,
        a.q_len,
        a.kv_len,
        a.scale,
        if a.causal { " causal" } else { "" },
        seq(&a.q),
        seq(&a.k),
        seq(&a.v),
        opt(&a.mask),
        opt(&a.valid_len),
        a.out
    )
}
