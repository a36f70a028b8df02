//! The fuse_attention pass: a decode step's RoPE, KV-cache writes and
//! attention become one `attention_append`. On random shapes (batch, head
//! counts and widths, cache length, RoPE mode and frequency factors, cache
//! dtype, shared or per-row positions) and several steps, the fused CPU
//! schedule gives the unfused one's outputs and caches bit for bit, and the
//! CUDA backend's fused kernel (when a GPU is present) agrees with the
//! unfused CPU schedule.

mod common;

use common::*;
use rand::Rng;
use rlx::{AttentionSpec, CompileOptions, DType, Device, Graph, Op, RopeMode, RopeSpec, Session, Tensor};

#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ctx: usize,
    rope: Option<RopeMode>,
    factors: bool,
    kv_dtype: DType,
    per_batch: bool,
    /// The first step's position (the cache rows before it stay zero).
    start: usize,
}

impl Case {
    fn random(r: &mut rand::rngs::StdRng) -> Case {
        let kv_heads = r.random_range(1..4);
        let per_batch = r.random_bool(0.5);
        let rope = [None, Some(RopeMode::RotateHalf), Some(RopeMode::Interleaved)][r.random_range(0..3)];
        Case {
            batch: if per_batch { r.random_range(1..4) } else { 1 },
            heads: kv_heads * r.random_range(1..4),
            kv_heads,
            head_dim: [8, 16, 32, 48, 64, 128][r.random_range(0..6)],
            ctx: r.random_range(4..40),
            rope,
            factors: rope.is_some() && r.random_bool(0.5),
            kv_dtype: [DType::F32, DType::F16, DType::BF16][r.random_range(0..3)],
            per_batch,
            start: 0,
        }
    }

    fn widths(&self) -> (usize, usize) {
        (self.heads * self.head_dim, self.kv_heads * self.head_dim)
    }
}

/// One decode step per case, side by side in one graph: x `[B, 1,
/// q|k|v]` split into three strided views, RoPE of q and k at `pos`, the
/// cache writes at `pos`, attention over `pos + 1` keys (read from a
/// per-row or shared position). With `by_hand` the graph holds the fused
/// op itself, written without the pass. The cases' inputs are x, x1, x2,
/// .., their states k_cache, k_cache1, .., their outputs in case order;
/// one `pos` input (the cases share batch and per_batch).
fn steps_graph(cases: &[Case], by_hand: bool) -> Graph {
    let c0 = &cases[0];
    let mut g = Graph::new();
    let np = if c0.per_batch { c0.batch } else { 1 };
    let pos = g.input("pos", [np], DType::I32).unwrap();
    for (i, c) in cases.iter().enumerate() {
        assert_eq!((c.batch, c.per_batch), (c0.batch, c0.per_batch), "cases of one graph share batch and per_batch");
        let o = add_step(&mut g, c, by_hand, pos, &tag(i));
        g.output(o).unwrap();
    }
    g
}

fn tag(i: usize) -> String {
    if i == 0 {
        String::new()
    } else {
        i.to_string()
    }
}

fn add_step(g: &mut Graph, c: &Case, by_hand: bool, pos: rlx::NodeId, tag: &str) -> rlx::NodeId {
    let (qw, kw) = c.widths();
    let b = c.batch;
    let np = if c.per_batch { b } else { 1 };
    let x = g.input(&format!("x{tag}"), [b, 1, qw + 2 * kw], DType::F32).unwrap();
    let q = g.narrow(x, 2, 0, qw).unwrap();
    let mut k = g.narrow(x, 2, qw, kw).unwrap();
    let v = g.narrow(x, 2, qw + kw, kw).unwrap();
    let (q_raw, k_raw) = (q, k);
    let mut rope_ins = vec![];
    let mut q = q;
    if let Some(mode) = c.rope {
        let rp = if c.per_batch { g.reshape(pos, [b, 1]).unwrap() } else { pos };
        if c.factors {
            let f: Vec<f32> = (0..c.head_dim / 2).map(|i| 1.0 + (i % 5) as f32 * 0.75).collect();
            let f = g.constant_f32([c.head_dim / 2], &f).unwrap();
            rope_ins = vec![rp, f];
            q = g.rope_scaled(q, rp, f, c.head_dim, 10000.0, mode).unwrap();
            k = g.rope_scaled(k, rp, f, c.head_dim, 10000.0, mode).unwrap();
        } else {
            rope_ins = vec![rp];
            q = g.rope(q, rp, c.head_dim, 10000.0, mode).unwrap();
            k = g.rope(k, rp, c.head_dim, 10000.0, mode).unwrap();
        }
    }
    let kc = g.state(&format!("k_cache{tag}"), [b, c.ctx, kw], c.kv_dtype).unwrap();
    let vc = g.state(&format!("v_cache{tag}"), [b, c.ctx, kw], c.kv_dtype).unwrap();
    let one = g.constant_i32([np], &vec![1; np]).unwrap();
    let valid = g.add(pos, one).unwrap();
    let spec = AttentionSpec {
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        scale: 1.0 / (c.head_dim as f32).sqrt(),
        causal: true,
        mask: false,
        valid_len: true,
    };
    if by_hand {
        let rope = c.rope.map(|mode| RopeSpec { theta: 10000.0, mode, factors: c.factors });
        let mut ins = vec![q_raw, k_raw, v, kc, vc, pos, valid];
        ins.extend(rope_ins);
        g.push(Op::AttentionAppend { spec, rope }, ins, None).unwrap()
    } else {
        let kc = g.write_state(kc, k, pos).unwrap();
        let vc = g.write_state(vc, v, pos).unwrap();
        g.attention(spec, q, kc, vc, None, Some(valid)).unwrap()
    }
}

const UNFUSED: CompileOptions = CompileOptions {
    precision: None,
    merge_matmuls: false,
    fuse: false,
    fuse_feed_forward: true,
    approximate_gelu: false,
    qmatmul_scratch_rows: None,
};

/// Runs `steps` decode steps (positions 0, 1, .. per row, each row at its
/// own offset when per-row) and returns every step's output, then both
/// caches as f32.
fn run(c: &Case, device: Device, opts: CompileOptions, seed: u64, steps: usize, by_hand: bool) -> (Vec<Vec<f32>>, Graph) {
    run_cases(&[*c], device, opts, seed, steps, by_hand)
}

/// `run` over the graph of several cases (`steps_graph`): every step's
/// outputs in case order, then each case's caches.
fn run_cases(cases: &[Case], device: Device, opts: CompileOptions, seed: u64, steps: usize, by_hand: bool) -> (Vec<Vec<f32>>, Graph) {
    let c0 = &cases[0];
    let mut r = rng(seed);
    let s = {
        let mut s = Session::new(device).unwrap();
        s.set_compile_options(opts);
        s
    };
    let mut exe = s.compile(&steps_graph(cases, by_hand)).unwrap();
    let mut outs = vec![];
    for t in 0..steps {
        let xs: Vec<(String, Tensor)> = cases
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (qw, kw) = c.widths();
                let x = Tensor::from_f32([c.batch, 1, qw + 2 * kw], &randn(&mut r, c.batch * (qw + 2 * kw))).unwrap();
                (format!("x{}", tag(i)), x)
            })
            .collect();
        let t = c0.start + t;
        let pos: Vec<i32> = if c0.per_batch { (0..c0.batch).map(|b| (t + b) as i32).collect() } else { vec![t as i32] };
        let pos = Tensor::from_i32([pos.len()], &pos).unwrap();
        let mut ins: Vec<(&str, &Tensor)> = xs.iter().map(|(n, x)| (n.as_str(), x)).collect();
        ins.push(("pos", &pos));
        outs.extend(exe.run(&ins).unwrap().into_iter().map(|o| o.to_f32()));
    }
    for i in 0..cases.len() {
        for name in ["k_cache", "v_cache"] {
            outs.push(exe.read_state(&format!("{name}{}", tag(i))).unwrap().to_f32());
        }
    }
    (outs, exe.after().clone())
}

fn steps(c: &Case) -> usize {
    // Every row's last position (start + t + b) stays inside the cache.
    (c.ctx - c.start - c.batch + 1).min(5)
}

#[test]
fn fused_append_equals_the_separate_steps_bit_for_bit_on_the_cpu() {
    let mut r = rng(51);
    for case in 0..24 {
        let c = Case::random(&mut r);
        let n = steps(&c);
        let (want, before) = run(&c, Device::Cpu, UNFUSED, case, n, false);
        let (got, after) = run(&c, Device::Cpu, CompileOptions::default(), case, n, false);
        let fused = after.nodes.iter().filter(|x| matches!(x.op, Op::AttentionAppend { .. })).count();
        assert_eq!(fused, 1, "case {case} {c:?}: {after}");
        for op in ["rope", "write_state", "attention"] {
            assert!(!after.nodes.iter().any(|x| x.op.name() == op), "case {case} {c:?}: a {op} is left: {after}");
        }
        assert!(before.nodes.iter().any(|x| x.op.name() == "write_state"));
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "case {case} {c:?}: output {i} (steps, then the caches) differs");
            assert!(a.iter().all(|v| v.is_finite()));
        }
    }
}

/// RoPE on q alone (or with other attributes than k's) leaves the rotations
/// as they are and fuses only the cache writes; an attention over caches
/// another node also reads is not fused; f16 and bf16 caches fuse as f32
/// ones do.
#[test]
fn mismatched_rope_or_shared_caches_fuse_less() {
    let c = Case {
        batch: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 8,
        ctx: 6,
        rope: None,
        factors: false,
        kv_dtype: DType::F32,
        per_batch: false,
        start: 0,
    };
    let (qw, kw) = c.widths();
    let build = |rope_k_theta: Option<f32>, extra_reader: bool, cache: DType| {
        let mut g = Graph::new();
        let x = g.input("x", [1, 1, qw + 2 * kw], DType::F32).unwrap();
        let pos = g.input("pos", [1], DType::I32).unwrap();
        let q = g.narrow(x, 2, 0, qw).unwrap();
        let q = g.rope(q, pos, 8, 10000.0, RopeMode::RotateHalf).unwrap();
        let mut k = g.narrow(x, 2, qw, kw).unwrap();
        if let Some(theta) = rope_k_theta {
            k = g.rope(k, pos, 8, theta, RopeMode::RotateHalf).unwrap();
        }
        let v = g.narrow(x, 2, qw + kw, kw).unwrap();
        let kc0 = g.state("k_cache", [1, 6, kw], cache).unwrap();
        let vc = g.state("v_cache", [1, 6, kw], cache).unwrap();
        let kc = g.write_state(kc0, k, pos).unwrap();
        let vc = g.write_state(vc, v, pos).unwrap();
        let spec = AttentionSpec { heads: 2, kv_heads: 1, head_dim: 8, scale: 0.3, causal: true, mask: false, valid_len: false };
        let o = g.attention(spec, q, kc, vc, None, None).unwrap();
        g.output(o).unwrap();
        if extra_reader {
            let r = g.reduce(rlx::ReduceOp::Sum, kc0, &[2], false).unwrap();
            g.output(r).unwrap();
        }
        g
    };
    let s = Session::new(Device::Cpu).unwrap();
    let cases = [
        (Some(500.0), false, DType::F32, 2, 1),
        (None, false, DType::F32, 1, 1),
        (Some(10000.0), true, DType::F32, 2, 0),
        (Some(10000.0), false, DType::F16, 0, 1),
        (Some(10000.0), false, DType::BF16, 0, 1),
        (Some(10000.0), false, DType::F32, 0, 1),
    ];
    for (theta, extra, cache, want_ropes, want_fused) in cases {
        let after = s.compile(&build(theta, extra, cache)).unwrap().after().clone();
        let ropes = after.nodes.iter().filter(|x| x.op.name() == "rope").count();
        let fused = after.nodes.iter().filter(|x| matches!(x.op, Op::AttentionAppend { .. })).count();
        assert_eq!((ropes, fused), (want_ropes, want_fused), "k theta {theta:?}, extra reader {extra}, {cache} cache: {after}");
    }
}

/// Whether a CUDA device opens; if not, prints the skip marker .ci/count-skips
/// reads (a panic instead under RLX_REQUIRE_GPU=1).
fn cuda_present(test: &str) -> bool {
    match Session::new(Device::Cuda(0)) {
        Ok(_) => true,
        Err(e) if std::env::var("RLX_REQUIRE_GPU").as_deref() == Ok("1") => panic!("RLX_REQUIRE_GPU=1 but CUDA is unusable: {e}"),
        Err(e) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e})");
            false
        }
    }
}

#[test]
fn cuda_fused_append_agrees_with_the_cpu() {
    if !cuda_present("cuda_fused_append_agrees_with_the_cpu") {
        return;
    }
    let mut r = rng(52);
    let mut cases: Vec<Case> = (0..24).map(|_| Case::random(&mut r)).collect();
    // Grids of more blocks (heads × batch) than an H100 has SMs: the
    // 4-warp decode kernels.
    for (batch, heads, kv_heads, kv_dtype) in [(20, 9, 3, DType::F16), (48, 4, 1, DType::F32)] {
        let rope = Some(RopeMode::Interleaved);
        cases.push(Case {
            batch,
            heads,
            kv_heads,
            head_dim: 64,
            ctx: batch + 24,
            rope,
            factors: false,
            kv_dtype,
            per_batch: true,
            start: 0,
        });
    }
    // Hundreds of keys: more than one round of a block's warps, and a
    // write position far into the cache.
    for (batch, heads, kv_heads, head_dim, start, kv_dtype) in
        [(1, 9, 3, 64, 600, DType::F16), (2, 4, 2, 128, 333, DType::BF16), (1, 9, 3, 64, 40, DType::F32), (3, 2, 1, 32, 150, DType::F16)]
    {
        let rope = Some(RopeMode::RotateHalf);
        let ctx = start + batch + 8;
        cases.push(Case { batch, heads, kv_heads, head_dim, ctx, rope, factors: true, kv_dtype, per_batch: batch > 1, start });
    }
    // Long caches: the append splits each head's keys over several blocks
    // (as many as the cache has runs of 512 keys, up to a block an SM).
    // The valid keys fill one run, a few, or all of them, or go from one
    // run to two during the steps (start 510); head dims 32 to 128 (48 and
    // 96 read the cache rows element by element); the batched cases' rows
    // each have their own count.
    let (half, inter) = (Some(RopeMode::RotateHalf), Some(RopeMode::Interleaved));
    for (batch, heads, kv_heads, head_dim, start, ctx, kv_dtype, rope, factors) in [
        (1, 9, 3, 64, 3000, 3010, DType::F16, half, false),
        (1, 9, 3, 64, 60, 4000, DType::F16, half, false),
        (1, 9, 3, 64, 510, 2000, DType::F16, inter, true),
        (1, 9, 3, 64, 1300, 4000, DType::F32, half, false),
        (1, 4, 4, 128, 1500, 2048, DType::BF16, half, true),
        (4, 8, 2, 64, 700, 1100, DType::F16, half, false),
        (1, 6, 2, 48, 700, 1000, DType::F32, inter, true),
        (1, 4, 2, 96, 900, 1200, DType::F16, half, true),
        (2, 8, 4, 32, 600, 700, DType::BF16, inter, false),
    ] {
        cases.push(Case { batch, heads, kv_heads, head_dim, ctx, rope, factors, kv_dtype, per_batch: batch > 1, start });
    }
    for (case, c) in cases.iter().enumerate() {
        let case = case as u64;
        let n = steps(c);
        let (want, _) = run(c, Device::Cpu, UNFUSED, case, n, false);
        // f16/bf16 caches: the GPU's rotation may round a key the other way.
        // f32: the rotation's f32 angle (position × frequency) is off by up
        // to an ulp of the position's magnitude, so far into the cache a
        // key differs by ~1e-7 × position (4.0e-5 at position 1,304).
        let last_pos = c.start + n + c.batch;
        let tol = if c.kv_dtype == DType::F32 { 2e-5f64.max(1e-7 * last_pos as f64) } else { 2e-2 };
        // Fused (attention_app), then unfused (the decode attention kernel).
        for opts in [CompileOptions::default(), UNFUSED] {
            let fused = opts.fuse;
            let (got, after) = run(c, Device::Cuda(0), opts, case, n, false);
            assert_eq!(after.nodes.iter().any(|x| matches!(x.op, Op::AttentionAppend { .. })), fused, "case {case}: {after}");
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                let want64: Vec<f64> = a.iter().map(|&v| v as f64).collect();
                assert_close(&format!("case {case} {c:?} fused {fused} output {i}"), b, &want64, tol);
            }
        }
    }
}

/// Two split-key appends of different widths in one executable (12 and 24
/// heads at batch 2: 24 and 48 (batch, head) pairs, split four and two
/// ways, so different numbers of merge counters and partial sums in the
/// scratch they share), several steps, against the unfused CPU schedule.
#[test]
fn cuda_appends_of_different_widths_share_their_scratch() {
    if !cuda_present("cuda_appends_of_different_widths_share_their_scratch") {
        return;
    }
    let case = |heads, kv_heads| Case {
        batch: 2,
        heads,
        kv_heads,
        head_dim: 64,
        ctx: 2048,
        rope: Some(RopeMode::RotateHalf),
        factors: false,
        kv_dtype: DType::F16,
        per_batch: true,
        start: 1200,
    };
    for cases in [[case(12, 4), case(24, 8)], [case(24, 8), case(12, 4)]] {
        let (want, _) = run_cases(&cases, Device::Cpu, UNFUSED, 7, 4, false);
        let (got, after) = run_cases(&cases, Device::Cuda(0), CompileOptions::default(), 7, 4, false);
        assert_eq!(after.nodes.iter().filter(|x| matches!(x.op, Op::AttentionAppend { .. })).count(), 2, "{after}");
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            let want64: Vec<f64> = a.iter().map(|&v| v as f64).collect();
            assert_close(&format!("heads {} then {}: output {i}", cases[0].heads, cases[1].heads), b, &want64, 2e-2);
        }
    }
}

/// The fused op over f16 and bf16 caches, written into the graph by hand:
/// on the CPU its bits are the separate steps'; on CUDA (when present) its
/// kernels agree with them.
#[test]
fn fused_op_over_16_bit_caches_equals_the_separate_steps() {
    let cuda = cuda_present("fused_op_over_16_bit_caches_equals_the_separate_steps (its CUDA half)");
    let mut r = rng(53);
    for case in 0..12 {
        let c = Case { kv_dtype: [DType::F16, DType::BF16][case as usize % 2], ..Case::random(&mut r) };
        let n = steps(&c);
        let (want, _) = run(&c, Device::Cpu, UNFUSED, case, n, false);
        let (got, after) = run(&c, Device::Cpu, UNFUSED, case, n, true);
        assert!(after.nodes.iter().any(|x| matches!(x.op, Op::AttentionAppend { .. })), "case {case}: {after}");
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "case {case} {c:?}: output {i} (steps, then the caches) differs on the CPU");
        }
        if cuda {
            let (gpu, _) = run(&c, Device::Cuda(0), UNFUSED, case, n, true);
            // The GPU's rotation may round a key to the cache's dtype the other way.
            for (i, (a, b)) in want.iter().zip(&gpu).enumerate() {
                let want64: Vec<f64> = a.iter().map(|&v| v as f64).collect();
                assert_close(&format!("case {case} {c:?} output {i} on CUDA"), b, &want64, 2e-2);
            }
        }
    }
}
