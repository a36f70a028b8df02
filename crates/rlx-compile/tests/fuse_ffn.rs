//! The feed-forward fusion pass (`fuse_ffn`): which blocks become one
//! `Op::FeedForward` (with the attention output projection and its norm
//! where they match), which do not (an intermediate with another reader or
//! that is an output), and that the fused graph computes the same values as
//! the unfused one: in the f64 reference, and bit for bit on the CPU
//! backend (random weights, several (rows, H, I), f32 and f16 storage).

mod common;

use std::sync::Arc;

use common::*;
use rand::{Rng, SeedableRng};
use rlx_compile::passes::{dce, fuse, fuse_attention, fuse_ffn, merge_matmul, precision};
use rlx_compile::{compile, CompileOptions, Schedule};
use rlx_cpu::CpuBackend;
use rlx_ir::{DType, FfnResidual, Graph, NodeId, Op};
use rlx_runtime::{Backend, PrepareOptions, Tensor, WeightStore};

fn ffn_ops(g: &Graph) -> Vec<rlx_ir::FeedForwardSpec> {
    g.nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::FeedForward(f) => Some(*f),
            _ => None,
        })
        .collect()
}

/// What the block's shapes and wiring are.
#[derive(Clone, Copy, Debug)]
struct Block {
    batch: usize,
    seq: usize,
    h: usize,
    i: usize,
    /// The attention output projection and its residual norm first.
    tail: bool,
    rms: bool,
    /// The last norm's residual is an input of its own rather than the
    /// block's input.
    other_residual: bool,
}

/// The block as separate ops: [a → Linear(wo) + x → norm1 →] Linear(w1) →
/// GELU → Linear(w2) + residual → norm → out. Returns the graph and the
/// ids of (projection, norm1 output, FFN1 output after GELU, FFN2 output).
fn block_graph(c: Block) -> (Graph, [NodeId; 4]) {
    let (b, s, h, i) = (c.batch, c.seq, c.h, c.i);
    let mut g = Graph::new();
    let x = g.input("x", [b, s, h], DType::F32).unwrap();
    let norm = |g: &mut Graph, x, name: &str, rms: bool| {
        let gamma = g.param(&format!("{name}.g"), [h], DType::F32).unwrap();
        if rms {
            g.rms_norm(x, gamma, 1e-6).unwrap()
        } else {
            let beta = g.param(&format!("{name}.b"), [h], DType::F32).unwrap();
            g.layer_norm(x, gamma, beta, 1e-5).unwrap()
        }
    };
    let (proj, x1) = if c.tail {
        let a = g.input("a", [b, s, h], DType::F32).unwrap();
        let o = lin(&mut g, a, "o", h, h);
        let r = g.add(o, x).unwrap();
        (o, norm(&mut g, r, "ln1", false))
    } else {
        (x, x)
    };
    let f1 = lin(&mut g, x1, "ff1", i, h);
    let f1 = g.gelu(f1).unwrap();
    let f2 = lin(&mut g, f1, "ff2", h, i);
    let res = if c.other_residual { g.input("r", [b, s, h], DType::F32).unwrap() } else { x1 };
    let r2 = g.add(res, f2).unwrap();
    let y = norm(&mut g, r2, "ln2", c.rms);
    g.output(y).unwrap();
    (g, [proj, x1, f1, f2])
}

const BERT: Block = Block { batch: 2, seq: 5, h: 16, i: 32, tail: true, rms: false, other_residual: false };

fn fused(g: &Graph) -> Graph {
    fuse_ffn::run(&fuse::run(g).unwrap()).unwrap()
}

#[test]
fn fuses_the_bert_layer_with_its_output_projection() {
    let g = bert_layer(false);
    let before = fuse::run(&g).unwrap();
    let after = fuse_ffn::run(&before).unwrap();
    after.verify().unwrap();
    let [f] = ffn_ops(&after)[..] else { panic!("one feed_forward expected in {after}") };
    let o = f.attn_out.expect("the output projection and its norm are part of the op");
    assert!(o.bias && !o.residual && o.norm_residual && !o.rms);
    assert!(f.bias1 && f.bias2 && !f.rms && f.act == rlx_ir::Activation::Gelu);
    // The FFN's residual is norm1's output, which exists only inside the op.
    assert_eq!((f.residual2, f.norm_residual), (FfnResidual::None, FfnResidual::Block));
    // Five nodes (projection, norm1, FFN1, FFN2, norm2) became one.
    assert_eq!(after.len(), before.len() - 4, "{after}");
    same_values(&g, &after);
    // The whole pipeline fuses it as well, and the text printer shows it.
    let opt = rlx_compile::optimise(&bert_layer(true), &CompileOptions::default()).unwrap();
    assert_eq!(ffn_ops(&opt).len(), 1, "{opt}");
    assert!(opt.to_string().contains("feed_forward"), "{opt}");
}

#[test]
fn block_variants_fuse_and_keep_their_values() {
    for c in [
        Block { tail: false, ..BERT },
        Block { rms: true, ..BERT },
        Block { other_residual: true, ..BERT },
        Block { tail: false, other_residual: true, rms: true, ..BERT },
    ] {
        let g = block_graph(c).0;
        let after = fused(&g);
        let [f] = ffn_ops(&after)[..] else { panic!("{c:?}: one feed_forward expected in {after}") };
        assert_eq!(f.attn_out.is_some(), c.tail, "{c:?}");
        assert_eq!(f.rms, c.rms);
        let want = if c.other_residual { FfnResidual::Input } else { FfnResidual::Block };
        assert_eq!(f.norm_residual, want, "{c:?}");
        same_values(&g, &after);
    }
}

#[test]
fn an_intermediate_with_another_reader_or_that_is_an_output_is_not_fused() {
    // The BERT block with node k of it also a graph output, or also read by
    // an op outside the block.
    let exposed = |k: usize, as_output: bool| {
        let (mut g, ids) = block_graph(BERT);
        if as_output {
            g.output(ids[k]).unwrap();
        } else {
            let extra = g.silu(ids[k]).unwrap();
            g.output(extra).unwrap();
        }
        g
    };
    // FFN1's or FFN2's output is a graph output or read elsewhere: no fusion.
    for (k, as_output) in [(2, true), (3, true), (2, false), (3, false)] {
        let g = exposed(k, as_output);
        let after = fused(&g);
        assert!(ffn_ops(&after).is_empty(), "node {k} (output: {as_output}): {after}");
        same_values(&g, &after);
    }
    // Norm1's output or the projection's read outside the block: the block
    // fuses without them.
    for (k, as_output) in [(0, true), (1, true), (1, false)] {
        let g = exposed(k, as_output);
        let after = fused(&g);
        let [f] = ffn_ops(&after)[..] else { panic!("node {k}: one feed_forward expected in {after}") };
        assert!(f.attn_out.is_none(), "node {k} (output: {as_output}): {after}");
        same_values(&g, &after);
    }
    // The tanh GELU still fuses (a backend without a kernel for it runs the
    // parts); no activation at all does not.
    let mut g = Graph::new();
    let x = g.input("x", [3, 8], DType::F32).unwrap();
    let w1 = g.param("w1", [12, 8], DType::F32).unwrap();
    let w2 = g.param("w2", [8, 12], DType::F32).unwrap();
    let (ga, be) = (g.param("g", [8], DType::F32).unwrap(), g.param("b", [8], DType::F32).unwrap());
    let h = g.linear(x, w1, None, true).unwrap();
    let y = g.linear(h, w2, None, true).unwrap();
    let out = g.layer_norm(y, ga, be, 1e-5).unwrap();
    g.output(out).unwrap();
    assert!(ffn_ops(&fused(&g)).is_empty());
}

fn same_values(before: &Graph, after: &Graph) {
    let (ins, ps) = random_feeds(before, 3);
    let err = max_rel_err(&eval(after, &ins, &ps), &eval(before, &ins, &ps));
    assert!(err < 1e-12, "the pass changed the values: max rel err {err:e}");
}

/// The passes `compile` runs, without `fuse_ffn`, then plan and lower.
fn unfused_schedule(g: &Graph, precision_to: Option<DType>) -> Schedule {
    let mut a = dce::run(g).unwrap();
    a = merge_matmul::run(&a).unwrap();
    a = fuse::run(&a).unwrap();
    a = fuse_attention::run(&a).unwrap();
    if let Some(d) = precision_to {
        a = precision::run(&a, d).unwrap();
    }
    a = dce::run(&a).unwrap();
    let plan = rlx_compile::plan(&a).unwrap();
    rlx_compile::lower(&a, &plan).unwrap()
}

fn run_cpu(s: Schedule, weights: &Arc<WeightStore>, inputs: &[(String, Tensor)]) -> Vec<Tensor> {
    let mut exe = CpuBackend::new().prepare(Arc::new(s), weights.clone(), &PrepareOptions::default()).unwrap();
    let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    exe.run(&refs).unwrap()
}

#[test]
fn the_fused_graph_computes_the_same_on_the_cpu_backend() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut cases = vec![Block { batch: 1, seq: 128, h: 384, i: 1536, ..BERT }, Block { batch: 1, seq: 1, h: 64, i: 256, ..BERT }];
    for _ in 0..4 {
        cases.push(Block {
            batch: rng.random_range(1..3),
            seq: rng.random_range(1..40),
            h: 8 * rng.random_range(1..12),
            i: 8 * rng.random_range(1..40),
            tail: rng.random_bool(0.6),
            rms: rng.random_bool(0.3),
            other_residual: rng.random_bool(0.3),
        });
    }
    for c in cases {
        let g = block_graph(c).0;
        let (ins, ps) = random_feeds(&g, 5);
        let store = Arc::new(WeightStore::new());
        for (name, t) in &ps {
            let v: Vec<f32> = t.v.iter().map(|&x| x as f32).collect();
            store.set_f32(name, t.dims.clone(), &v).unwrap();
        }
        let inputs: Vec<(String, Tensor)> = ins
            .iter()
            .map(|(n, t)| (n.clone(), Tensor::from_f32(t.dims.clone(), &t.v.iter().map(|&x| x as f32).collect::<Vec<_>>()).unwrap()))
            .collect();
        for precision_to in [None, Some(DType::F16)] {
            let opts = CompileOptions { precision: precision_to, ..Default::default() };
            let fused = compile(&g, &opts).unwrap().schedule;
            assert_eq!(fused.thunks.iter().filter(|t| t.kind() == "feed_forward").count(), 1, "{c:?}\n{fused}");
            let plain = unfused_schedule(&g, precision_to);
            assert!(plain.thunks.iter().all(|t| t.parts().is_none()));
            let (a, b) = (run_cpu(fused, &store, &inputs), run_cpu(plain, &store, &inputs));
            // The same kernels on the same values in the same order: the
            // same bits (only the arena offsets differ).
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x.bytes(), y.bytes(), "{c:?} {precision_to:?}");
            }
        }
    }
}

/// The CPU backend behind a `supports` that refuses every fused thunk: it
/// prepares the schedule with those expanded (`Schedule::expand`), as a
/// backend without a kernel for them does.
struct NoFused(CpuBackend);

impl Backend for NoFused {
    fn name(&self) -> &str {
        "cpu without fused thunks"
    }
    fn supports(&self, thunk: &rlx_compile::Thunk) -> bool {
        thunk.parts().is_none() && self.0.supports(thunk)
    }
    fn prepare(
        &self,
        schedule: Arc<Schedule>,
        weights: Arc<WeightStore>,
        opts: &PrepareOptions,
    ) -> rlx_runtime::Result<Box<dyn rlx_runtime::Executable>> {
        let plain = schedule.expand(|t| self.supports(t));
        assert!(plain.thunks.iter().all(|t| self.supports(t)), "{plain}");
        self.0.prepare(Arc::new(plain), weights, opts)
    }
}

#[test]
fn a_backend_that_does_not_support_the_fused_thunk_runs_its_parts() {
    let c = Block { batch: 2, seq: 9, h: 24, i: 40, ..BERT };
    let g = block_graph(c).0;
    let (ins, ps) = random_feeds(&g, 8);
    let store = Arc::new(WeightStore::new());
    for (name, t) in &ps {
        store.set_f32(name, t.dims.clone(), &t.v.iter().map(|&x| x as f32).collect::<Vec<_>>()).unwrap();
    }
    let inputs: Vec<(String, Tensor)> = ins
        .iter()
        .map(|(n, t)| (n.clone(), Tensor::from_f32(t.dims.clone(), &t.v.iter().map(|&x| x as f32).collect::<Vec<_>>()).unwrap()))
        .collect();
    let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let s = Arc::new(compile(&g, &CompileOptions::default()).unwrap().schedule);
    let ff = s.thunks.iter().find(|t| t.kind() == "feed_forward").expect("a fused block");
    assert!(!NoFused(CpuBackend::new()).supports(ff) && CpuBackend::new().supports(ff));
    let mut plain = NoFused(CpuBackend::new()).prepare(s.clone(), store.clone(), &PrepareOptions::default()).unwrap();
    assert_eq!(plain.schedule().thunks.len(), s.thunks.len() + 4, "five parts instead of one thunk");
    let mut reference = CpuBackend::new().prepare(s, store, &PrepareOptions::default()).unwrap();
    let (a, b) = (plain.run(&refs).unwrap(), reference.run(&refs).unwrap());
    assert_eq!(a[0].bytes(), b[0].bytes());
    // And both against the f64 reference of the graph as built.
    let want = &eval(&g, &ins, &ps)[0];
    let got = a[0].to_f32();
    let worst = got.iter().zip(&want.v).map(|(g, w)| (*g as f64 - w).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-4, "max abs error {worst:e} against the f64 reference");
}
