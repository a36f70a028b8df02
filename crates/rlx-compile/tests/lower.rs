//! Lowering of whole layers: the expected thunks with the expected views,
//! a JSON round trip, the printer, and clean errors for what cannot lower.

mod common;

use common::*;
use rlx_compile::{compile, CompileError, CompileOptions, Schedule, Space, Thunk};
use rlx_ir::{DType, Graph};

fn kinds(s: &Schedule) -> Vec<&'static str> {
    s.thunks.iter().map(|t| t.kind()).collect()
}

#[test]
fn bert_layer_lowers_to_fused_thunks_with_strided_qkv() {
    let c = compile(&bert_layer(true), &CompileOptions::default()).unwrap();
    // The output projection, its norm and the feed-forward block are one
    // fused thunk (`fuse_ffn`); the rest of the test reads its parts.
    assert_eq!(kinds(&c.schedule), ["matmul", "attention", "feed_forward"], "{}", c.schedule);
    let s = &c.schedule.expand(|_| false);
    assert_eq!(kinds(s), ["matmul", "attention", "matmul", "layer_norm", "matmul", "matmul", "layer_norm"], "{s}");
    let Thunk::MatMul(qkv) = &s.thunks[0] else { unreachable!() };
    assert_eq!((qkv.batch, qkv.m, qkv.n, qkv.k, qkv.b_trans, qkv.b_batch_stride), (1, 10, 48, 16, true, 0));
    assert!(qkv.bias.is_some());
    let w = &s.weights[match qkv.b.space {
        Space::Weight(i) => i as usize,
        _ => panic!("{s}"),
    }];
    assert_eq!(w.parts, ["q.w", "k.w", "v.w"]);
    assert_eq!((w.concat_axis, w.shape.dims()), (0, &[48, 16][..]));
    let Thunk::Attention(a) = &s.thunks[1] else { unreachable!() };
    for (view, at) in [(a.q, 0), (a.k, 16), (a.v, 32)] {
        assert_eq!((view.batch_stride, view.row_stride), (5 * 48, 48), "{s}");
        assert_eq!(view.buf.offset, qkv.out.offset + at * 4);
        assert_eq!(view.buf.space, Space::Arena);
    }
    assert!(a.mask.is_some() && a.mask_dtype == DType::F32);
    // q.w, k.w, v.w are read only through the merged slot: no slots of their own.
    assert_eq!(s.weights.len(), 2 + 2 + 2 + 2 + 2 + 2, "{s}");
    assert!(s.weights.iter().all(|w| w.parts.len() == 3 || !w.name.starts_with(['q', 'k', 'v'])), "{s}");
    let Thunk::Norm { residual, rms: false, .. } = &s.thunks[3] else { unreachable!() };
    assert!(residual.is_some());
    let Thunk::MatMul(ff1) = &s.thunks[4] else { unreachable!() };
    assert_eq!(ff1.act, Some(rlx_ir::Activation::Gelu));
    assert_eq!(s.inputs.len(), 2);
    assert_eq!(s.outputs[0].name, "hidden");
    assert!(s.arena.planned_bytes < s.arena.naive_bytes, "{s}");
}

#[test]
fn schedule_round_trips_through_json_and_prints() {
    for opts in [CompileOptions::default(), CompileOptions { precision: Some(DType::BF16), ..Default::default() }] {
        let s = compile(&bert_layer(true), &opts).unwrap().schedule;
        let json = serde_json::to_string(&s).unwrap();
        let back: Schedule = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
        let text = s.to_string();
        for want in ["matmul", "attention", "arena+0x", "w0", "% saved", "q.w+k.w+v.w", "hidden"] {
            assert!(text.contains(want), "'{want}' missing from:\n{text}");
        }
    }
}

#[test]
fn bf16_storage_casts_at_the_edges() {
    let opts = CompileOptions { precision: Some(DType::BF16), ..Default::default() };
    let s = compile(&bert_layer(true), &opts).unwrap().schedule;
    let k = kinds(&s);
    // x in and hidden out; the mask stays f32 (attention reads any float mask).
    assert_eq!(k.iter().filter(|k| **k == "cast").count(), 2, "x in; hidden out: {s}");
    let Some(Thunk::Attention(a)) = s.thunks.iter().find(|t| matches!(t, Thunk::Attention(_))) else { unreachable!() };
    assert_eq!(a.mask_dtype, DType::F32);
    assert_eq!(s.outputs[0].dtype, DType::F32);
    for t in &s.thunks {
        if let Thunk::MatMul(m) = t {
            assert_eq!(m.dtype, DType::BF16);
        }
    }
    assert!(s.weights.iter().all(|w| w.dtype == DType::BF16));
}

#[test]
fn swiglu_reads_both_halves_of_the_merged_projection() {
    let s = compile(&llama_mlp(), &CompileOptions::default()).unwrap().schedule;
    assert_eq!(kinds(&s), ["binary", "rms_norm", "matmul", "swiglu", "matmul"], "{s}");
    let (Thunk::MatMul(gu), Thunk::SwiGlu { rows, cols, gate, up, .. }) = (&s.thunks[2], &s.thunks[3]) else { unreachable!() };
    assert_eq!((gu.n, *rows, *cols), (48, 6, 24));
    assert_eq!((gate.row_stride, up.row_stride), (48, 48));
    assert_eq!(up.buf.offset - gate.buf.offset, 24 * 4);
    let Thunk::MatMul(down) = &s.thunks[4] else { unreachable!() };
    assert!(down.residual.is_some());
}

#[test]
fn views_of_leaves_are_copied_into_their_own_output_buffers() {
    let mut g = Graph::new();
    let x = g.input("x", [2, 4], DType::F32).unwrap();
    let w = g.param("w", [3, 4], DType::F32).unwrap();
    let wn = g.narrow(w, 0, 1, 2).unwrap(); // a view into the weight
    g.output(x).unwrap();
    g.output(wn).unwrap();
    let s = compile(&g, &CompileOptions::default()).unwrap().schedule;
    assert_eq!(kinds(&s), ["copy", "copy"], "{s}");
    let Thunk::Copy { src, dst, .. } = &s.thunks[1] else { unreachable!() };
    assert_eq!((src.space, src.offset), (Space::Weight(0), 16));
    assert_eq!(*dst, s.outputs[1].buf);
    assert_ne!(s.outputs[0].buf, s.inputs[0].buf);
}

#[test]
fn unsupported_batch_broadcast_is_a_lowering_error() {
    let mut g = Graph::new();
    let a = g.input("a", [2, 1, 3, 4], DType::F32).unwrap();
    let b = g.input("b", [1, 3, 4, 5], DType::F32).unwrap();
    let y = g.matmul(a, b).unwrap();
    g.output(y).unwrap();
    let e = compile(&g, &CompileOptions::default()).unwrap_err();
    assert!(matches!(e, CompileError::Lower { node: 2, .. }), "{e}");
    assert!(e.to_string().contains("matmul"), "{e}");
}

#[test]
fn reduce_over_split_axes_and_batched_matmul() {
    let mut g = Graph::new();
    let x = g.input("x", [2, 3, 4, 5], DType::F32).unwrap();
    let r = g.reduce(rlx_ir::ReduceOp::Mean, x, &[1, 3], false).unwrap();
    let y = g.input("y", [2, 3, 5, 2], DType::F32).unwrap();
    let m = g.matmul(x, y).unwrap();
    g.output(r).unwrap();
    g.output(m).unwrap();
    let c = compile(&g, &CompileOptions::default()).unwrap();
    let s = &c.schedule;
    assert_eq!(kinds(s), ["copy", "reduce", "matmul"], "{s}");
    let (ins, ps) = random_feeds(&g, 9);
    let err = max_rel_err(&Interp::new(s, &ps).run(&ins), &eval(&g, &ins, &ps));
    assert!(err < 1e-5, "{err:e}");
}

#[test]
#[ignore = "prints a schedule for eyeballing"]
fn show() {
    let c = compile(&bert_layer(true), &CompileOptions::default()).unwrap();
    println!("{}\n{}", c.after, c.schedule);
}

#[test]
fn decode_step_writes_state_in_place_and_attends_over_it() {
    // One decode step: project x to k, v; append them to two caches at the
    // device-scalar position; attend over the caches up to valid_len.
    let (b, max, w) = (1, 16, 8);
    let mut g = Graph::new();
    let x = g.input("x", [b, 1, w], DType::F32).unwrap();
    let pos = g.input("pos", [1], DType::I32).unwrap();
    let len = g.input("len", [1], DType::I32).unwrap();
    let wk = g.param("wk", [w, w], DType::F32).unwrap();
    let wv = g.param("wv", [w, w], DType::F32).unwrap();
    let k = g.matmul(x, wk).unwrap();
    let v = g.matmul(x, wv).unwrap();
    let kc = g.state("k_cache", [b, max, w], DType::F32).unwrap();
    let vc = g.state("v_cache", [b, max, w], DType::F32).unwrap();
    let kc = g.write_state(kc, k, pos).unwrap();
    let vc = g.write_state(vc, v, pos).unwrap();
    let spec = rlx_ir::AttentionSpec { heads: 2, kv_heads: 2, head_dim: 4, scale: 0.5, causal: true, mask: false, valid_len: true };
    let y = g.attention(spec, x, kc, vc, None, Some(len)).unwrap();
    g.output(y).unwrap();
    // The separate steps (fusion off; with it, one attention_append below).
    let s = compile(&g, &CompileOptions { fuse: false, ..CompileOptions::default() }).unwrap().schedule;
    assert_eq!(kinds(&s), ["matmul", "write_state", "write_state", "attention"], "{s}");
    assert_eq!(s.states.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["k_cache", "v_cache"]);
    let Thunk::WriteState { state, value, batch, max_rows, new_rows, width, .. } = &s.thunks[1] else { unreachable!() };
    assert_eq!((*batch, *max_rows, *new_rows, *width), (1, 16, 1, 8));
    assert_eq!((state.space, state.offset, state.bytes), (Space::State(0), 0, 16 * 8 * 4));
    // k and v came out of one merged [8, 16] projection: value is a contiguous half.
    assert_eq!(value.space, Space::Arena);
    let Thunk::Attention(a) = &s.thunks[3] else { unreachable!() };
    assert_eq!((a.k.buf.space, a.v.buf.space), (Space::State(0), Space::State(1)));
    assert_eq!((a.kv_len, a.k.row_stride, a.k.batch_stride), (16, 8, 128));
    assert!(a.valid_len.is_some() && a.causal);
    // Fused: the appended rows are read where the projection left them, the
    // caches written in place, no RoPE.
    let s = compile(&g, &CompileOptions::default()).unwrap().schedule;
    assert_eq!(kinds(&s), ["matmul", "attention_append"], "{s}");
    let Thunk::AttentionAppend(t) = &s.thunks[1] else { unreachable!() };
    let Thunk::MatMul(mm) = &s.thunks[0] else { unreachable!() };
    assert_eq!((t.k_new.buf.offset, t.v_new.buf.offset), (mm.out.offset, mm.out.offset + 8 * 4));
    assert_eq!((t.attn.k.buf.space, t.attn.v.buf.space), (Space::State(0), Space::State(1)));
    assert!(t.rope.is_none() && t.attn.q == t.q);
}

/// A LLaMA-like block over `rows` rows: norm → merged projection → narrow ·
/// narrow → projection + residual; norm → gate/up → SwiGLU → down +
/// residual; every matmul quantized (Q8_0).
fn quantized_block(rows: usize) -> Graph {
    use rlx_ir::QFormat;
    let (k, f) = (64, QFormat::Q8_0);
    let rb = f.row_bytes(k).expect("row bytes");
    let mut g = Graph::new();
    let x = g.input("x", [rows, k], DType::F32).unwrap();
    let g1 = g.param("g1", [k], DType::F32).unwrap();
    let wqkv = g.param("wqkv", [3 * k, rb], DType::U8).unwrap();
    let wo = g.param("wo", [k, rb], DType::U8).unwrap();
    let g2 = g.param("g2", [k], DType::F32).unwrap();
    let wgu = g.param("wgu", [4 * k, rb], DType::U8).unwrap();
    let wd = g.param("wd", [k, rb * 2], DType::U8).unwrap();
    let h = g.rms_norm(x, g1, 1e-5).unwrap();
    let qkv = g.qmatmul(h, wqkv, f).unwrap();
    let q = g.narrow(qkv, 1, 0, k).unwrap();
    let v = g.narrow(qkv, 1, 2 * k, k).unwrap();
    let att = g.mul(q, v).unwrap();
    let o = g.qmatmul(att, wo, f).unwrap();
    let x = g.add(x, o).unwrap();
    let h2 = g.rms_norm(x, g2, 1e-5).unwrap();
    let gu = g.qmatmul(h2, wgu, f).unwrap();
    let gate = g.narrow(gu, 1, 0, 2 * k).unwrap();
    let up = g.narrow(gu, 1, 2 * k, 2 * k).unwrap();
    let act = g.swiglu(gate, up).unwrap();
    let d = g.qmatmul(act, wd, f).unwrap();
    let y = g.add(x, d).unwrap();
    g.output(y).unwrap();
    g
}

#[test]
fn quantized_matmuls_get_scratch_from_the_rows_asked_for() {
    use rlx_compile::{operands, qmatmul_scratch_parts};
    let scratch_of = |t: &Thunk| match t {
        Thunk::QMatMul { rows, n, k, glu, scratch, .. } => Some((*rows, *n, *k, *glu, *scratch)),
        _ => None,
    };
    for (rows, ask, want) in [(40, None, false), (40, Some(41), false), (40, Some(40), true), (300, Some(16), true)] {
        let opts = CompileOptions { qmatmul_scratch_rows: ask, ..CompileOptions::default() };
        let s = compile(&quantized_block(rows), &opts).unwrap().schedule;
        let qmms: Vec<_> = s.thunks.iter().filter_map(scratch_of).collect();
        assert_eq!(qmms.len(), 4, "{s}");
        for (r, n, k, glu, scratch) in qmms {
            assert_eq!(r, rows);
            assert_eq!(scratch.is_some(), want, "rows {rows}, asked {ask:?}: {s}");
            if let Some(x) = scratch {
                let [a, w, gl] = qmatmul_scratch_parts(r, n, k, glu).unwrap();
                assert!(x.bytes >= a + w + gl, "{x} for {r}x{n}x{k}");
                assert_eq!(gl > 0, glu);
                assert_eq!(x.space, Space::Arena);
            }
        }
        // Every operand in bounds, the scratch disjoint from what the
        // thunk reads and writes.
        for t in &s.thunks {
            operands::check_operands(t).unwrap_or_else(|e| panic!("{t:?}: {e}"));
        }
        assert_eq!(s.to_string().contains("scratch="), want);
    }
}
