//! Each pass on a small graph: the result verifies, contains the rewritten
//! op, has fewer nodes, and computes the same values as the input graph
//! (both evaluated by the f64 reference, so only the rewrite is tested).

mod common;

use common::*;
use rlx_compile::passes::{dce, fuse, gelu_tanh, merge_matmul, precision};
use rlx_compile::{compile, optimise, CompileOptions};
use rlx_ir::{Activation, DType, Graph, Op};

fn same_values(before: &Graph, after: &Graph, seed: u64) {
    let (ins, ps) = random_feeds(before, seed);
    let err = max_rel_err(&eval(after, &ins, &ps), &eval(before, &ins, &ps));
    assert!(err < 1e-12, "pass changed the values: max rel err {err:e}");
}

#[test]
fn dce_drops_dead_nodes_but_keeps_state_writes() {
    let mut g = Graph::new();
    let x = g.input("x", [2, 4], DType::F32).unwrap();
    let w = g.param("w", [4, 4], DType::F32).unwrap();
    let dead = g.matmul(x, w).unwrap();
    let _dead2 = g.gelu(dead).unwrap();
    let y = g.silu(x).unwrap();
    let st = g.state("cache", [1, 8, 4], DType::F32).unwrap();
    let pos = g.input("pos", [1], DType::I32).unwrap();
    let val = g.reshape(y, [1, 2, 4]).unwrap();
    let _write = g.write_state(st, val, pos).unwrap();
    g.output(y).unwrap();
    let after = dce::run(&g).unwrap();
    after.verify().unwrap();
    assert_eq!(after.len(), g.len() - 3, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::WriteState)), 1);
    assert_eq!(count(&after, |o| matches!(o, Op::Param { .. })), 0);
    assert_eq!(count(&after, |o| matches!(o, Op::MatMul { .. })), 0);
}

#[test]
fn merge_matmul_builds_one_qkv_projection() {
    let g = bert_layer(false);
    let after = merge_matmul::run(&g).unwrap();
    after.verify().unwrap();
    assert_eq!(count(&g, |o| matches!(o, Op::MatMul { .. })), 6);
    assert_eq!(count(&after, |o| matches!(o, Op::MatMul { .. })), 4, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::Concat { axis: 0 })), 2, "weights and biases concatenated: {after}");
    assert_eq!(count(&after, |o| matches!(o, Op::Narrow { axis: 2, .. })), 3);
    let merged = after.nodes.iter().find(|n| matches!(n.op, Op::MatMul { .. }) && n.shape.last() == 48);
    assert!(merged.is_some(), "no [.., 48] QKV matmul in {after}");
    same_values(&g, &after, 1);
}

#[test]
fn merge_matmul_without_biases_and_untransposed() {
    let mut g = Graph::new();
    let x = g.input("x", [3, 8], DType::F32).unwrap();
    let a = g.param("a", [8, 5], DType::F32).unwrap();
    let b = g.param("b", [8, 7], DType::F32).unwrap();
    let c = g.param("c", [6, 8], DType::F32).unwrap();
    let ya = g.matmul(x, a).unwrap();
    let yb = g.matmul(x, b).unwrap();
    let yc = g.matmul_t(x, c).unwrap(); // other layout: not merged with a, b
    g.output(ya).unwrap();
    g.output(yb).unwrap();
    g.output(yc).unwrap();
    let after = merge_matmul::run(&g).unwrap();
    after.verify().unwrap();
    assert_eq!(count(&after, |o| matches!(o, Op::MatMul { .. })), 2, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::Concat { axis: 1 })), 1);
    same_values(&g, &after, 2);
}

#[test]
fn fuse_bert_layer() {
    let g = bert_layer(false);
    let after = fuse::run(&g).unwrap();
    after.verify().unwrap();
    assert!(after.len() < g.len());
    let gelu = count(&after, |o| matches!(o, Op::MatMulFused { bias: true, act: Some(Activation::Gelu), residual: false, .. }));
    assert_eq!(gelu, 1, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::ResidualLayerNorm { .. })), 2, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::MatMul { .. })), 0, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::LayerNorm { .. })), 0);
    same_values(&g, &after, 3);
}

#[test]
fn fuse_llama_mlp() {
    let g = llama_mlp();
    let after = fuse::run(&g).unwrap();
    after.verify().unwrap();
    assert!(after.len() < g.len());
    assert_eq!(count(&after, |o| matches!(o, Op::SwiGlu)), 1, "{after}");
    // x + r feeds the norm *and* the final residual: two users, no fusion.
    assert_eq!(count(&after, |o| matches!(o, Op::ResidualRmsNorm { .. })), 0, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::MatMulFused { bias: false, act: None, residual: true, .. })), 1, "{after}");
    same_values(&g, &after, 4);
}

#[test]
fn fuse_residual_rms_norm_and_matmul_act() {
    let mut g = Graph::new();
    let x = g.input("x", [4, 8], DType::F32).unwrap();
    let r = g.input("r", [4, 8], DType::F32).unwrap();
    let gamma = g.param("g", [8], DType::F32).unwrap();
    let s = g.add(x, r).unwrap();
    let n = g.rms_norm(s, gamma, 1e-6).unwrap();
    let w = g.param("w", [8, 8], DType::F32).unwrap();
    let y = g.matmul(n, w).unwrap();
    let y = g.activation(Activation::Relu, y).unwrap();
    g.output(y).unwrap();
    let after = fuse::run(&g).unwrap();
    after.verify().unwrap();
    assert_eq!(count(&after, |o| matches!(o, Op::ResidualRmsNorm { .. })), 1, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::MatMulFused { bias: false, act: Some(Activation::Relu), .. })), 1, "{after}");
    assert_eq!(after.len(), g.len() - 2);
    same_values(&g, &after, 5);
}

#[test]
fn fuse_leaves_shared_intermediates_alone() {
    let mut g = Graph::new();
    let x = g.input("x", [4, 8], DType::F32).unwrap();
    let w = g.param("w", [8, 8], DType::F32).unwrap();
    let b = g.param("b", [8], DType::F32).unwrap();
    let y = g.matmul(x, w).unwrap();
    let z = g.add(y, b).unwrap();
    g.output(y).unwrap(); // y is also an output: it must exist, so no fusion
    g.output(z).unwrap();
    let after = fuse::run(&g).unwrap();
    assert_eq!(after, g);
}

#[test]
fn merge_then_fuse_keeps_bias_epilogue_and_swiglu_views() {
    let opts = CompileOptions::default();
    let after = optimise(&llama_mlp(), &opts).unwrap();
    // gate/up merged into one projection; SwiGLU reads its two halves.
    assert_eq!(count(&after, |o| matches!(o, Op::SwiGlu)), 1, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::MatMul { .. })), 1, "{after}");
    let after = optimise(&bert_layer(false), &opts).unwrap();
    // The merged QKV projection keeps its bias epilogue; the output
    // projection and the feed-forward block become one op, biases and all.
    assert_eq!(count(&after, |o| matches!(o, Op::MatMulFused { bias: true, .. })), 1, "{after}");
    let ffn = |o: &Op| matches!(o, Op::FeedForward(f) if f.bias1 && f.bias2 && f.attn_out.is_some_and(|a| a.bias));
    assert_eq!(count(&after, ffn), 1, "{after}");
    same_values(&bert_layer(false), &after, 6);
}

#[test]
fn precision_f16_stores_floats_as_f16_and_keeps_the_interface() {
    let mut g = Graph::new();
    let ids = g.input("ids", [2, 3], DType::I32).unwrap();
    let x = g.input("x", [2, 3, 4], DType::F32).unwrap();
    let table = g.param("emb", [10, 4], DType::F32).unwrap();
    let e = g.gather(table, ids).unwrap();
    let c = g.constant_f32([4], &[0.5, -1.0, 2.0, 0.25]).unwrap();
    let y = g.add(e, x).unwrap();
    let y = g.mul(y, c).unwrap();
    let am = g.argmax(y, 2).unwrap();
    g.set_name(y, "y");
    g.output(y).unwrap();
    g.output(am).unwrap();
    let after = precision::run(&g, DType::F16).unwrap();
    after.verify().unwrap();
    for n in &after.nodes {
        match &n.op {
            Op::Input { name } if name == "x" => assert_eq!(n.dtype, DType::F32),
            Op::Input { .. } | Op::ArgMax { .. } => assert!(n.dtype.is_int()),
            Op::Cast => {}
            _ => assert_eq!(n.dtype, DType::F16, "{after}"),
        }
    }
    assert_eq!(count(&after, |o| matches!(o, Op::Cast)), 2, "one after x, one before y: {after}");
    assert_eq!(after.dtype(after.outputs[0]), DType::F32);
    assert_eq!(after.dtype(after.outputs[1]), DType::I32);
    assert_eq!(after.output_name(0), "y");
    let c16 = after
        .nodes
        .iter()
        .find_map(|n| match &n.op {
            Op::Constant { data } => Some(data.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(c16, [0.5f32, -1.0, 2.0, 0.25].iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect::<Vec<u8>>());
    assert!(precision::run(&g, DType::I32).is_err());
    // The whole pipeline lowers with f16 storage.
    let opts = CompileOptions { precision: Some(DType::F16), ..Default::default() };
    let c = compile(&g, &opts).unwrap();
    assert!(c.schedule.weights.iter().all(|w| w.dtype == DType::F16));
    assert_eq!(c.schedule.inputs.iter().find(|s| s.name == "x").unwrap().dtype, DType::F32);
}

#[test]
fn invalid_graph_is_an_error_not_a_panic() {
    let mut g = Graph::new();
    let x = g.input("x", [2, 3], DType::F32).unwrap();
    g.output(x).unwrap();
    g.nodes[0].shape = rlx_ir::Shape::new(vec![5]);
    g.nodes.push(rlx_ir::Node {
        op: Op::Activation(Activation::Relu),
        inputs: vec![rlx_ir::NodeId(7)],
        shape: [2, 3].into(),
        dtype: DType::F32,
        name: None,
    });
    let e = compile(&g, &CompileOptions::default()).unwrap_err();
    assert!(e.to_string().contains("node 1"), "{e}");
}

#[test]
fn fuse_never_claims_a_node_twice() {
    // a·w1 + b·w2: the first matmul's chain takes the add as its residual;
    // the second matmul must then stay a plain matmul.
    let mut g = Graph::new();
    let a = g.input("a", [3, 8], DType::F32).unwrap();
    let b = g.input("b", [3, 8], DType::F32).unwrap();
    let w1 = g.param("w1", [8, 8], DType::F32).unwrap();
    let w2 = g.param("w2", [8, 8], DType::F32).unwrap();
    let y1 = g.matmul(a, w1).unwrap();
    let y2 = g.matmul(b, w2).unwrap();
    let s = g.add(y1, y2).unwrap();
    g.output(s).unwrap();
    let after = fuse::run(&g).unwrap();
    after.verify().unwrap();
    assert_eq!(count(&after, |o| matches!(o, Op::MatMulFused { residual: true, .. })), 1, "{after}");
    assert_eq!(count(&after, |o| matches!(o, Op::MatMul { .. })), 1, "{after}");
    same_values(&g, &after, 7);
}

/// `approximate_gelu`: every exact GELU of a BERT layer becomes the tanh
/// form (fused into its matmul's epilogue like a model that names it); the
/// default leaves them exact; the rewritten op computes
/// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) in the f64 reference.
#[test]
fn approximate_gelu_rewrites_every_exact_gelu() {
    let acts = |g: &Graph| -> Vec<Activation> {
        g.nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Activation(a) => Some(*a),
                Op::MatMulFused { act, .. } => *act,
                Op::FeedForward(f) => Some(f.act),
                _ => None,
            })
            .collect()
    };
    let g = bert_layer(true);
    assert!(acts(&g).contains(&Activation::Gelu));
    let exact = optimise(&g, &CompileOptions::default()).unwrap();
    assert!(acts(&exact).contains(&Activation::Gelu) && !acts(&exact).contains(&Activation::GeluTanh));
    let approx = optimise(&g, &CompileOptions { approximate_gelu: true, ..CompileOptions::default() }).unwrap();
    let a = acts(&approx);
    assert!(a.contains(&Activation::GeluTanh) && !a.contains(&Activation::Gelu), "{a:?}");
    assert!(approx.nodes.iter().any(|n| matches!(n.op, Op::FeedForward(f) if f.act == Activation::GeluTanh)));

    let mut small = Graph::new();
    let x = small.input("x", [3, 5], DType::F32).unwrap();
    let y = small.gelu(x).unwrap();
    small.output(y).unwrap();
    let rewritten = gelu_tanh::run(&small).unwrap();
    rewritten.verify().unwrap();
    let (ins, ps) = random_feeds(&small, 7);
    let got = eval(&rewritten, &ins, &ps);
    let xs = &ins["x"];
    let tanh_gelu = |v: f64| 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh());
    let want = T { dims: xs.dims.clone(), v: xs.v.iter().map(|&v| tanh_gelu(v)).collect() };
    let err = max_rel_err(&got, &[want]);
    assert!(err < 1e-12, "tanh GELU in the reference: max rel err {err:e}");
}
