use rlx_ir::{AttentionSpec, DType, Graph, IrError, Node, NodeId, Op, Shape};

#[test]
fn matmul_mismatch_names_both_shapes() {
    let mut g = Graph::new();
    let a = g.input("a", [2, 3], DType::F32).unwrap();
    let b = g.input("b", [4, 5], DType::F32).unwrap();
    let err = g.matmul(a, b).unwrap_err().to_string();
    assert!(err.contains("[2, 3]") && err.contains("[4, 5]"), "{err}");
    assert_eq!(g.len(), 2, "a failed builder call must not add a node");
}

#[test]
fn shapes_are_inferred() {
    let mut g = Graph::new();
    let a = g.input("a", [7, 2, 3], DType::F32).unwrap();
    let w = g.param("w", [5, 3], DType::F32).unwrap();
    let y = g.matmul_t(a, w).unwrap();
    assert_eq!(g.shape(y), &Shape::new([7, 2, 5]));
    let b = g.param("b", [1, 5], DType::F32).unwrap();
    let z = g.add(y, b).unwrap();
    assert_eq!(g.shape(z), &Shape::new([7, 2, 5]));
    let r = g.reduce(rlx_ir::ReduceOp::Mean, z, &[2, 0], false).unwrap();
    assert_eq!(g.shape(r), &Shape::new([2]));
    let t = g.transpose(z, &[2, 0, 1]).unwrap();
    assert_eq!(g.shape(t), &Shape::new([5, 7, 2]));
    let n = g.narrow(t, 0, 1, 3).unwrap();
    assert_eq!(g.shape(n), &Shape::new([3, 7, 2]));
    let c = g.concat(&[n, t], 0).unwrap();
    assert_eq!(g.shape(c), &Shape::new([8, 7, 2]));
    let am = g.argmax(c, 1).unwrap();
    assert_eq!((g.shape(am).clone(), g.dtype(am)), (Shape::new([8, 2]), DType::I32));
    let (v, i) = g.top_k(c, 2).unwrap();
    assert_eq!(g.shape(v), &Shape::new([8, 7, 2]));
    assert_eq!(g.dtype(i), DType::I32);
    let h = g.cast(c, DType::F16).unwrap();
    assert_eq!(g.dtype(h), DType::F16);
    g.output(h).unwrap();
    g.verify().unwrap();
}

#[test]
fn broadcasting_rules() {
    let mut g = Graph::new();
    let a = g.input("a", [3, 1, 4], DType::F32).unwrap();
    let b = g.input("b", [2, 1], DType::F32).unwrap();
    let c = g.mul(a, b).unwrap();
    assert_eq!(g.shape(c), &Shape::new([3, 2, 4]));
    let d = g.input("d", [3], DType::F32).unwrap();
    let err = g.add(c, d).unwrap_err().to_string();
    assert!(err.contains("[3, 2, 4]") && err.contains("[3]"), "{err}");
    let e = g.input("e", [4], DType::F16).unwrap();
    assert!(matches!(g.add(c, e), Err(IrError::DType { .. })));
}

#[test]
fn attention_and_state_checks() {
    let mut g = Graph::new();
    let q = g.input("q", [2, 5, 8 * 4], DType::F32).unwrap();
    let k = g.input("k", [2, 9, 2 * 4], DType::F32).unwrap();
    let len = g.input("len", [1], DType::I32).unwrap();
    let spec = AttentionSpec { heads: 8, kv_heads: 2, head_dim: 4, scale: 0.5, causal: true, mask: false, valid_len: false };
    let o = g.attention(spec, q, k, k, None, Some(len)).unwrap();
    assert_eq!(g.shape(o), &Shape::new([2, 5, 32]));
    let bad = AttentionSpec { kv_heads: 3, ..spec };
    assert!(g.attention(bad, q, k, k, None, None).is_err());

    let st = g.state("kv", [2, 16, 8], DType::F32).unwrap();
    let w = g.write_state(st, k, len).unwrap();
    assert_eq!(g.shape(w), &Shape::new([2, 16, 8]));
    let too_long = g.input("big", [2, 17, 8], DType::F32).unwrap();
    assert!(g.write_state(st, too_long, len).is_err());

    // An f16 cache: f32 keys are written into it and read by f32 queries;
    // K and V must still agree, and integer states take only their dtype.
    let st16 = g.state("kv16", [2, 16, 8], DType::F16).unwrap();
    let w16 = g.write_state(st16, k, len).unwrap();
    assert_eq!(g.dtype(w16), DType::F16);
    let o16 = g.attention(spec, q, w16, w16, None, Some(len)).unwrap();
    assert_eq!(g.dtype(o16), DType::F32);
    assert!(g.attention(spec, q, w16, k, None, None).is_err(), "k f16 with v f32");
    let ist = g.state("ids", [2, 16, 8], DType::I32).unwrap();
    assert!(g.write_state(ist, k, len).is_err(), "f32 into an i32 state");
    g.output(o16).unwrap();
    g.output(o).unwrap();
    g.verify().unwrap();
}

#[test]
fn verifier_rejects_broken_graphs() {
    let mut g = Graph::new();
    let a = g.input("a", [2, 3], DType::F32).unwrap();
    let b = g.gelu(a).unwrap();
    g.output(b).unwrap();
    g.verify().unwrap();

    // A node that lies about its shape.
    let mut bad = g.clone();
    bad.nodes[1].shape = Shape::new([3, 2]);
    let e = bad.verify().unwrap_err().to_string();
    assert!(e.contains("node 1") && e.contains("gelu"), "{e}");

    // A forward reference.
    let mut bad = g.clone();
    bad.nodes[0] = Node {
        op: Op::Activation(rlx_ir::Activation::Relu),
        inputs: vec![NodeId(1)],
        shape: Shape::new([2, 3]),
        dtype: DType::F32,
        name: None,
    };
    assert!(bad.verify().is_err());

    // Duplicate input names and no outputs.
    let mut bad = g.clone();
    bad.nodes.push(Node { op: Op::Input { name: "a".into() }, inputs: vec![], shape: Shape::new([1]), dtype: DType::F32, name: None });
    assert!(bad.verify().unwrap_err().to_string().contains("duplicate"));
    let mut bad = g.clone();
    bad.outputs.clear();
    assert!(bad.verify().is_err());
}

#[test]
fn printer_is_readable() {
    let mut g = Graph::new();
    let a = g.input("x", [2, 3], DType::F32).unwrap();
    let w = g.param("w", [4, 3], DType::F32).unwrap();
    let y = g.matmul_t(a, w).unwrap();
    g.set_name(y, "logits");
    g.output(y).unwrap();
    let text = g.to_string();
    assert!(text.contains("%2 = matmul(%0, %1) rhsᵀ : [2, 4] f32  # logits"), "{text}");
    assert!(text.contains("outputs: %2"));
}

#[test]
fn masked_mean_shapes_and_errors() {
    let mut g = Graph::new();
    let x = g.input("x", [2, 5, 8], DType::F32).unwrap();
    let m = g.input("m", [2, 5], DType::F32).unwrap();
    let y = g.masked_mean(x, m).unwrap();
    assert_eq!(g.shape(y), &Shape::new([2, 8]));
    let wrong = g.input("w", [2, 4], DType::F32).unwrap();
    let err = g.masked_mean(x, wrong).unwrap_err().to_string();
    assert!(err.contains("[2, 5, 8]") && err.contains("[2, 4]"), "{err}");
    // Any float mask; the output takes x's dtype.
    let half = g.input("h", [2, 5], DType::F16).unwrap();
    let y = g.masked_mean(x, half).unwrap();
    assert_eq!(g.dtype(y), DType::F32);
    let ints = g.input("i", [2, 5], DType::I32).unwrap();
    assert!(matches!(g.masked_mean(x, ints), Err(IrError::DType { .. })));
    let flat = g.input("f", [10, 8], DType::F32).unwrap();
    assert!(g.masked_mean(flat, m).is_err(), "x must be [B, S, D]");
}

#[test]
fn embed_layer_norm_shapes() {
    let s = |d: &[usize]| Shape::new(d.to_vec());
    let out = s(&[2, 7, 16]);
    assert_eq!(s(&[7, 16]).row_period(&out), Some(7));
    assert_eq!(s(&[1, 16]).row_period(&out), Some(1));
    assert_eq!(s(&[1, 1, 16]).row_period(&out), Some(1));
    assert_eq!(s(&[2, 7, 16]).row_period(&out), Some(14));
    assert_eq!(s(&[2, 1, 16]).row_period(&out), None, "not periodic over rows");
    assert_eq!(s(&[7, 8]).row_period(&out), None, "other width");

    let mut g = Graph::new();
    let ids = g.input("ids", [2, 7], DType::I32).unwrap();
    let table = g.param("t", [30, 16], DType::F32).unwrap();
    let (gm, bt) = (g.param("g", [16], DType::F32).unwrap(), g.param("b", [16], DType::F32).unwrap());
    let pos = g.param("pos", [7, 16], DType::F32).unwrap();
    let bad = g.param("bad", [2, 1, 16], DType::F32).unwrap();
    let y = g.embed_layer_norm(table, ids, gm, bt, &[pos], 1e-12).unwrap();
    assert_eq!((g.nodes[y.0].shape.dims(), g.nodes[y.0].dtype), (&[2, 7, 16][..], DType::F32));
    let e = g.embed_layer_norm(table, ids, gm, bt, &[bad], 1e-12).unwrap_err().to_string();
    assert!(e.contains("addend 0") && e.contains("[2, 1, 16]"), "{e}");
    let e = g.embed_layer_norm(table, table, gm, bt, &[], 1e-12).unwrap_err().to_string();
    assert!(e.contains("ids"), "{e}");
    let e = g.embed_layer_norm(table, ids, gm, bt, &[pos, pos, pos], 1e-12).unwrap_err().to_string();
    assert!(e.contains("inputs"), "{e}");
}

#[test]
fn attention_append_shapes_and_errors() {
    use rlx_ir::{RopeMode, RopeSpec};
    let spec = AttentionSpec { heads: 4, kv_heads: 2, head_dim: 8, scale: 0.3, causal: true, mask: false, valid_len: true };
    let rope = Some(RopeSpec { theta: 10000.0, mode: RopeMode::RotateHalf, factors: false });
    let mut g = Graph::new();
    let q = g.input("q", [2, 1, 32], DType::F32).unwrap();
    let q2 = g.input("q2", [2, 2, 32], DType::F32).unwrap();
    let k = g.input("k", [2, 1, 16], DType::F32).unwrap();
    let kbad = g.input("kbad", [2, 1, 12], DType::F32).unwrap();
    let v = g.input("v", [2, 1, 16], DType::F32).unwrap();
    let pos = g.input("pos", [2], DType::I32).unwrap();
    let fpos = g.input("fpos", [2], DType::F32).unwrap();
    let rpos = g.input("rpos", [2, 1], DType::I32).unwrap();
    let kc = g.state("kc", [2, 10, 16], DType::F16).unwrap();
    let vc = g.state("vc", [2, 10, 16], DType::F16).unwrap();
    let notstate = g.input("notstate", [2, 10, 16], DType::F16).unwrap();
    let op = Op::AttentionAppend { spec, rope };
    let out = g.push(op.clone(), vec![q, k, v, kc, vc, pos, pos, rpos], None).unwrap();
    assert_eq!((g.shape(out).dims(), g.dtype(out)), (&[2, 1, 32][..], DType::F32));
    let err = |ins: Vec<NodeId>| g.clone().push(op.clone(), ins, None).unwrap_err().to_string();
    let e = err(vec![q2, k, v, kc, vc, pos, pos, rpos]);
    assert!(e.contains("[B, 1, 32]") && e.contains("[2, 2, 32]"), "{e}");
    let e = err(vec![q, kbad, v, kc, vc, pos, pos, rpos]);
    assert!(e.contains("k_new [2, 1, 12]"), "{e}");
    let e = err(vec![q, k, v, kc, vc, fpos, pos, rpos]);
    assert!(e.contains("write position") && e.contains("f32"), "{e}");
    let e = err(vec![q, k, v, kc, vc, pos, pos]);
    assert!(e.contains("input"), "a missing RoPE position: {e}");
    // Caches that are not states are refused by the verifier.
    let mut h = g.clone();
    let bad = h.push(op.clone(), vec![q, k, v, notstate, vc, pos, pos, rpos], None).unwrap();
    h.output(bad).unwrap();
    let e = h.verify().unwrap_err().to_string();
    assert!(e.contains("caches into state tensors"), "{e}");
}

#[test]
fn feed_forward_shapes_and_errors() {
    use rlx_ir::{Activation, FeedForwardSpec, FfnResidual};
    // x [2, 5, 8] → FFN1 [16, 8] + b1, GELU → FFN2 [8, 16] + b2 → LayerNorm(+ x).
    let spec = FeedForwardSpec {
        act: Activation::Gelu,
        bias1: true,
        bias2: true,
        residual2: FfnResidual::None,
        norm_residual: FfnResidual::Block,
        rms: false,
        eps: 1e-12,
        attn_out: None,
    };
    let mut g = Graph::new();
    let x = g.input("x", [2, 5, 8], DType::F32).unwrap();
    let x16 = g.input("x16", [2, 5, 8], DType::F16).unwrap();
    let w1 = g.param("w1", [16, 8], DType::F32).unwrap();
    let b1 = g.param("b1", [16], DType::F32).unwrap();
    let w2 = g.param("w2", [8, 16], DType::F32).unwrap();
    let w2bad = g.param("w2bad", [16, 8], DType::F32).unwrap();
    let b2 = g.param("b2", [8], DType::F32).unwrap();
    let gamma = g.param("gamma", [8], DType::F32).unwrap();
    let beta = g.param("beta", [8], DType::F32).unwrap();
    let op = Op::FeedForward(spec);
    let out = g.push(op.clone(), vec![x, w1, b1, w2, b2, gamma, beta], None).unwrap();
    assert_eq!((g.shape(out).dims(), g.dtype(out)), (&[2, 5, 8][..], DType::F32));
    let err = |ins: Vec<NodeId>, op: &Op| g.clone().push(op.clone(), ins, None).unwrap_err().to_string();
    let e = err(vec![x, w1, b1, w2bad, b2, gamma, beta], &op);
    assert!(e.contains("w2 must be [8, 16]") && e.contains("[16, 8]"), "{e}");
    let e = err(vec![x, w1, b1, w2, b2, gamma], &op);
    assert!(e.contains("expected 7..=7 inputs, found 6"), "a missing beta: {e}");
    let e = err(vec![x16, w1, b1, w2, b2, gamma, beta], &op);
    assert!(e.contains("f16") && e.contains("f32"), "{e}");
    let nan_eps = Op::FeedForward(FeedForwardSpec { eps: f32::NAN, ..spec });
    let e = err(vec![x, w1, b1, w2, b2, gamma, beta], &nan_eps);
    assert!(e.contains("eps"), "{e}");
}
