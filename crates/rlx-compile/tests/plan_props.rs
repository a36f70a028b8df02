//! Planner property test over random graphs of elementwise, matmul,
//! reshape, narrow, concat, transpose, norm and reduce ops: buffers that
//! are live at the same time never share bytes, the arena is no bigger than
//! the naive sum, every output is written, in-place writes happen only in
//! elementwise kernels over their own input, and the schedule — run by a
//! plain interpreter — computes what the f64 reference computes.

mod common;

use common::*;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rlx_compile::{compile, BufRef, CompileOptions, Schedule, Space, Thunk};
use rlx_ir::{Activation, BinaryOp, DType, Graph, NodeId, ReduceOp};

fn pick<T: Copy>(rng: &mut StdRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

fn random_graph(seed: u64, steps: usize) -> Graph {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut g = Graph::new();
    let mut pool = vec![g.input("x", [2, 3, 8], DType::F32).unwrap()];
    if rng.random_bool(0.5) {
        pool.push(g.input("y", [2, 3, 8], DType::F32).unwrap());
    }
    let mut params = 0;
    let mut param = |g: &mut Graph, dims: &[usize]| {
        params += 1;
        g.param(&format!("p{params}"), dims.to_vec(), DType::F32).unwrap()
    };
    for _ in 0..steps {
        let a = pick(&mut rng, &pool);
        let ad = g.shape(a).dims().to_vec();
        let w = *ad.last().unwrap();
        let same: Vec<NodeId> = pool.iter().copied().filter(|&p| g.shape(p).dims() == ad).collect();
        let partner = pick(&mut rng, &same);
        let made = match rng.random_range(0..12) {
            0 => {
                let b = match rng.random_range(0..3) {
                    0 => param(&mut g, &[w]),
                    _ => partner,
                };
                let op = pick(&mut rng, &[BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul]);
                if rng.random_bool(0.5) {
                    g.binary(op, a, b)
                } else {
                    g.binary(op, b, a)
                }
            }
            1 => g.activation(pick(&mut rng, &[Activation::Gelu, Activation::Silu, Activation::Relu, Activation::Tanh]), a),
            2 | 3 => {
                let n = pick(&mut rng, &[4, 8, 12]);
                let t = rng.random_bool(0.5);
                let mut out = vec![];
                for _ in 0..rng.random_range(1..=2) {
                    let p = if t { param(&mut g, &[n, w]) } else { param(&mut g, &[w, n]) };
                    let mut y = if t { g.matmul_t(a, p) } else { g.matmul(a, p) }.unwrap();
                    if rng.random_bool(0.5) {
                        let bias = param(&mut g, &[n]);
                        y = g.add(y, bias).unwrap();
                    }
                    out.push(y);
                }
                pool.extend(&out[..out.len() - 1]);
                Ok(out[out.len() - 1])
            }
            4 if ad.len() == 3 => g.reshape(a, [ad[0] * ad[1], w]),
            4 => g.reshape(a, [1, ad[0], w]),
            5 if w >= 2 => {
                let len = rng.random_range(1..w);
                g.narrow(a, ad.len() - 1, rng.random_range(0..=w - len), len)
            }
            5 | 6 if ad[0] >= 2 => g.narrow(a, 0, rng.random_range(0..ad[0]), 1),
            6 => g.swiglu(a, partner),
            7 => {
                let r = ad.len();
                let other: Vec<NodeId> =
                    pool.iter().copied().filter(|&p| g.shape(p).dims()[..r - 1] == ad[..r - 1] && g.shape(p).rank() == r).collect();
                let b = pick(&mut rng, &other);
                g.concat(&[a, b], r - 1)
            }
            8 if ad.len() == 3 => g.transpose(a, &[1, 0, 2]),
            8 => g.transpose(a, &[1, 0]),
            9 => {
                let gm = param(&mut g, &[w]);
                let bt = param(&mut g, &[w]);
                match rng.random_range(0..3) {
                    0 => g.layer_norm(a, gm, bt, 1e-5),
                    1 => g.rms_norm(a, gm, 1e-5),
                    _ => g.softmax(a, ad.len() - 1),
                }
            }
            10 if ad.len() == 3 => {
                let axes = pick(&mut rng, &[&[0usize, 2][..], &[1], &[0, 1], &[2]]);
                g.reduce(pick(&mut rng, &[ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max]), a, axes, true)
            }
            _ => g.silu(a).and_then(|s| g.mul(s, partner)),
        };
        if let Ok(id) = made {
            pool.push(id);
        }
    }
    let last = *pool.last().unwrap();
    g.output(last).unwrap();
    for _ in 0..rng.random_range(0..3) {
        let o = pick(&mut rng, &pool);
        g.output(o).unwrap();
    }
    if rng.random_bool(0.2) {
        g.output(pool[0]).unwrap();
    }
    g
}

fn overlaps(a: &BufRef, b: &BufRef) -> bool {
    a.space == b.space && a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes
}

/// (reads, writes) of a thunk.
fn io(t: &Thunk) -> (Vec<BufRef>, Vec<BufRef>) {
    match t {
        Thunk::MatMul(m) => ([Some(m.a), Some(m.b), m.bias, m.residual].into_iter().flatten().collect(), vec![m.out]),
        Thunk::Binary { a, b, out, .. } => (vec![*a, *b], vec![*out]),
        Thunk::Activation { x, out, .. } | Thunk::Softmax { x, out, .. } | Thunk::Reduce { x, out, .. } => (vec![*x], vec![*out]),
        Thunk::Norm { x, residual, gamma, beta, out, .. } => {
            ([Some(*x), *residual, Some(*gamma), *beta].into_iter().flatten().collect(), vec![*out])
        }
        Thunk::SwiGlu { gate, up, out, .. } => (vec![gate.buf, up.buf], vec![*out]),
        Thunk::MaskedMean { x, mask, out, .. } => (vec![*x, *mask], vec![*out]),
        Thunk::Copy { src, dst, .. } | Thunk::Cast { src, dst, .. } => (vec![*src], vec![*dst]),
        Thunk::ArgMax { x, out, .. } => (vec![*x], vec![*out]),
        Thunk::TopK { x, values, indices, .. } => (vec![*x], values.iter().chain(indices).copied().collect()),
        Thunk::Gather { table, ids, out, .. } => (vec![*table, *ids], vec![*out]),
        Thunk::EmbedNorm { table, ids, addends, gamma, beta, out, .. } => {
            ([*table, *ids, *gamma, *beta].into_iter().chain(addends.iter().map(|(a, _)| *a)).collect(), vec![*out])
        }
        Thunk::Attention(a) => {
            ([Some(a.q.buf), Some(a.k.buf), Some(a.v.buf), a.mask, a.valid_len].into_iter().flatten().collect(), vec![a.out])
        }
        Thunk::AttentionAppend(t) => {
            let a = &t.attn;
            let mut reads: Vec<BufRef> = [Some(t.q.buf), Some(t.k_new.buf), Some(t.v_new.buf), Some(t.position), a.mask, a.valid_len]
                .into_iter()
                .flatten()
                .collect();
            let mut writes = vec![a.out, a.k.buf, a.v.buf];
            if let Some(r) = &t.rope {
                reads.push(r.positions);
                reads.extend(r.freq_factors);
                writes.extend([r.q_out, r.k_out]);
            }
            (reads, writes)
        }
        Thunk::Rope { x, positions, out, .. } => (vec![x.buf, *positions], vec![*out]),
        Thunk::WriteState { state, value, position, .. } => (vec![*value, *position], vec![*state]),
        Thunk::QMatMul { a, w, out, scratch, .. } => (vec![*a, *w], [*out].into_iter().chain(*scratch).collect()),
        Thunk::QGather { table, ids, out, .. } => (vec![*table, *ids], vec![*out]),
        Thunk::Sample { logits, fparams, iparams, history, position, out, .. } => {
            (vec![*logits, *fparams, *iparams, *history, *position], vec![*out])
        }
        Thunk::FeedForward(f) => {
            let (mut reads, mut writes) = (vec![], vec![]);
            for (r, w) in f.parts.iter().map(io) {
                reads.extend(r);
                writes.extend(w);
            }
            (reads, writes)
        }
    }
}

fn check(s: &Schedule) -> Result<(), TestCaseError> {
    let a = &s.arena;
    prop_assert!(a.planned_bytes <= a.naive_bytes, "planned {} > naive {}", a.planned_bytes, a.naive_bytes);
    prop_assert_eq!(a.planned_bytes, s.arena_bytes);
    for (i, x) in a.buffers.iter().enumerate() {
        prop_assert_eq!(x.offset % 256, 0);
        prop_assert!(x.offset + x.bytes <= s.arena_bytes);
        for y in &a.buffers[i + 1..] {
            let live_together = x.first <= y.last && y.first <= x.last;
            let share = x.offset < y.offset + y.bytes.max(1) && y.offset < x.offset + x.bytes.max(1);
            prop_assert!(!(live_together && share), "buffers overlap: {x:?} and {y:?}\n{s}");
        }
    }
    for o in &s.outputs {
        prop_assert_eq!(o.buf.space, Space::Arena);
        let written = s.thunks.iter().any(|t| io(t).1.iter().any(|w| overlaps(w, &o.buf)));
        prop_assert!(written, "output {} is not written by a thunk\n{s}", o.name);
    }
    for t in &s.thunks {
        let (reads, writes) = io(t);
        for w in &writes {
            for r in &reads {
                if overlaps(w, r) {
                    let elementwise = matches!(t, Thunk::Binary { .. } | Thunk::Activation { .. } | Thunk::SwiGlu { .. });
                    prop_assert!(elementwise && r.offset == w.offset, "{} writes over its input: {t:?}\n{s}", t.kind());
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn planner_on_random_graphs(seed in any::<u64>(), steps in 1usize..24) {
        let g = random_graph(seed, steps);
        let (ins, ps) = random_feeds(&g, seed ^ 0x5eed);
        let want = eval(&g, &ins, &ps);
        for opts in [CompileOptions::default(), CompileOptions { merge_matmuls: false, fuse: false, fuse_feed_forward: false, precision: None, approximate_gelu: false, qmatmul_scratch_rows: None }] {
            let c = compile(&g, &opts).map_err(|e| TestCaseError::fail(format!("{e}\n{g}")))?;
            check(&c.schedule)?;
            let got = Interp::new(&c.schedule, &ps).run(&ins);
            let err = max_rel_err(&got, &want);
            prop_assert!(err < 1e-4, "max rel err {err:e}\n{g}\nafter passes:\n{}\n{}", c.after, c.schedule);
        }
    }
}

#[test]
fn arena_reuse_saves_memory_on_a_chain() {
    let mut g = Graph::new();
    let mut x = g.input("x", [64, 64], DType::F32).unwrap();
    for i in 0..6 {
        let w = g.param(&format!("w{i}"), [64, 64], DType::F32).unwrap();
        x = g.matmul(x, w).unwrap();
    }
    g.output(x).unwrap();
    let s = compile(&g, &CompileOptions::default()).unwrap().schedule;
    // Input, output and at most two live intermediates.
    assert!(s.arena.planned_bytes <= 4 * 64 * 64 * 4, "{s}");
    assert_eq!(s.arena.naive_bytes, 7 * 64 * 64 * 4);
}

#[test]
fn elementwise_runs_in_place_when_its_input_dies() {
    let mut g = Graph::new();
    let x = g.input("x", [4, 64], DType::F32).unwrap();
    let w = g.param("w", [64, 64], DType::F32).unwrap();
    let y = g.matmul(x, w).unwrap();
    let z = g.activation(Activation::Tanh, y).unwrap(); // not fusable: opts.fuse = false
    g.output(z).unwrap();
    let opts = CompileOptions { fuse: false, ..Default::default() };
    let s = compile(&g, &opts).unwrap().schedule;
    let Thunk::Activation { x, out, .. } = &s.thunks[1] else { panic!("{s}") };
    assert_eq!(x, out, "{s}");
    // x is a graph input: never overwritten.
    let mut g = Graph::new();
    let x = g.input("x", [4, 64], DType::F32).unwrap();
    let z = g.activation(Activation::Tanh, x).unwrap();
    g.output(z).unwrap();
    let s = compile(&g, &opts).unwrap().schedule;
    let Thunk::Activation { x, out, .. } = &s.thunks[0] else { panic!("{s}") };
    assert_ne!(x, out, "{s}");
}

/// The random graphs really exercise what the property test is about:
/// strided views, bias epilogues, in-place ops, merged weights, output
/// copies and reduces through scratch.
#[test]
fn random_graphs_cover_the_interesting_cases() {
    let mut c = [0usize; 6];
    for seed in 0..600u64 {
        let g = random_graph(seed, 1 + (seed as usize % 23));
        let s = compile(&g, &CompileOptions::default()).unwrap().schedule;
        for t in &s.thunks {
            match t {
                Thunk::MatMul(m) if m.lda != m.k as u64 => c[0] += 1,
                Thunk::SwiGlu { gate, cols, .. } if gate.row_stride != *cols as u64 => c[0] += 1,
                Thunk::MatMul(m) if m.bias.is_some() => c[1] += 1,
                Thunk::Activation { x, out, .. } if x == out => c[2] += 1,
                Thunk::Binary { a, out, .. } if a == out => c[2] += 1,
                _ => {}
            }
        }
        c[3] += s.weights.iter().filter(|w| w.parts.len() > 1).count();
        c[4] += s.outputs.iter().filter(|o| s.thunks.iter().any(|t| matches!(t, Thunk::Copy { dst, .. } if dst == &o.buf))).count();
        c[5] += s.thunks.iter().filter(|t| matches!(t, Thunk::Reduce { inner: 1, .. })).count();
    }
    assert!(c.iter().all(|&n| n > 0), "strided, bias, in-place, merged, output copy, scratch reduce: {c:?}");
}

/// Graphs with every other op (gather, attention over strided views, rope,
/// casts, argmax, top-k, state writes, concat of params) under every option
/// set, f16 and bf16 included: compiling never fails or panics and the
/// structural properties hold.
fn wide_graph(seed: u64) -> Graph {
    let mut rng = StdRng::seed_from_u64(seed);
    let (b, s, h) = (rng.random_range(1..3), rng.random_range(1..5), 4 * rng.random_range(1..4));
    let mut g = Graph::new();
    let ids = g.input("ids", [b, s], if rng.random_bool(0.5) { DType::I32 } else { DType::I64 }).unwrap();
    let table = g.param("emb", [11, h], DType::F32).unwrap();
    let mut x = g.gather(table, ids).unwrap();
    if rng.random_bool(0.5) {
        let w = g.param("w", [3 * h, h], DType::F32).unwrap();
        let qkv = g.matmul_t(x, w).unwrap();
        let q = g.narrow(qkv, 2, 0, h).unwrap();
        let k = g.narrow(qkv, 2, h, h).unwrap();
        let v = g.narrow(qkv, 2, 2 * h, h).unwrap();
        let pos = g.constant_i32([s], &(0..s as i32).collect::<Vec<_>>()).unwrap();
        let q = if rng.random_bool(0.5) { g.rope(q, pos, 4, 10000.0, rlx_ir::RopeMode::Interleaved).unwrap() } else { q };
        let mask = rng.random_bool(0.5).then(|| g.input("mask", [b, s], DType::F32).unwrap());
        let spec = rlx_ir::AttentionSpec {
            heads: h / 4,
            kv_heads: h / 4,
            head_dim: 4,
            scale: 0.5,
            causal: rng.random_bool(0.5),
            mask: false,
            valid_len: false,
        };
        x = g.attention(spec, q, k, v, mask, None).unwrap();
    }
    if rng.random_bool(0.5) {
        let st = g.state("cache", [b, s + 2, h], DType::F32).unwrap();
        let p = g.input("pos", [1], DType::I32).unwrap();
        let st = g.write_state(st, x, p).unwrap();
        g.output(st).unwrap();
    }
    let pa = g.param("pa", [h, 2], DType::F32).unwrap();
    let pb = g.param("pb", [h, 3], DType::F32).unwrap();
    let wc = g.concat(&[pa, pb], 1).unwrap();
    let y = g.matmul(x, wc).unwrap();
    let y = g.softmax(y, rng.random_range(0..3)).unwrap();
    let am = g.argmax(y, 2).unwrap();
    let (tv, ti) = g.top_k(y, rng.random_range(1..=5)).unwrap();
    let yc = g.cast(y, DType::F16).unwrap();
    for o in [am, tv, ti, yc, x] {
        if rng.random_bool(0.7) {
            g.output(o).unwrap();
        }
    }
    if g.outputs.is_empty() {
        g.output(y).unwrap();
    }
    g
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]
    #[test]
    fn every_op_compiles_under_every_option_set(seed in any::<u64>()) {
        let g = wide_graph(seed);
        for precision in [None, Some(DType::F16), Some(DType::BF16)] {
            for (merge_matmuls, fuse) in [(false, false), (true, true)] {
                let opts = CompileOptions { precision, merge_matmuls, fuse, fuse_feed_forward: fuse, approximate_gelu: false, qmatmul_scratch_rows: None };
                let c = compile(&g, &opts).map_err(|e| TestCaseError::fail(format!("{e}\n{g}")))?;
                check(&c.schedule)?;
                let json = serde_json::to_string(&c.schedule).map_err(|e| TestCaseError::fail(e.to_string()))?;
                let back: Schedule = serde_json::from_str(&json).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(&back, &c.schedule);
                prop_assert!(!c.schedule.to_string().is_empty());
            }
        }
    }
}
