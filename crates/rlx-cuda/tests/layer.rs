//! The layer program (kernels/layer.cu, src/layer.rs): runs of matmuls,
//! attention and norms executed by one persistent kernel, against the CPU
//! backend on encoder stacks of random shapes, f16 and bf16; replay equals
//! eager bit for bit, and the program must actually have run.

mod common;

use common::*;
use rand::Rng;
use rlx_compile::{BufRef, MatMulThunk, Thunk};
use rlx_cuda::{set_layer_policy, LayerPolicy};
use rlx_ir::{Activation, DType};
use rlx_runtime::{Executable, PrepareOptions, Tensor};

/// The policy is process-wide: tests that set it run one at a time.
static POLICY_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

struct Shape {
    batch: usize,
    seq: usize,
    h: usize,
    heads: usize,
    ffn: usize,
    layers: usize,
}

/// An embedding LayerNorm (x + pos) then `layers` post-LN encoder layers,
/// weights stored [out, in] as BERT's: QKV (+bias) -> attention (key
/// padding mask) -> out-proj (+bias +residual) -> LayerNorm -> FFN1 (+bias,
/// erf-GELU) -> FFN2 (+bias +residual) -> LayerNorm.
fn encoder(dt: DType, sh: &Shape, seed: u64) -> Sb {
    let mut r = rng(seed);
    let (rows, h) = (sh.batch * sh.seq, sh.h);
    let mut sb = Sb::new();
    let x = sb.input("x", &[sh.batch, sh.seq, h], dt);
    let pos = sb.input("pos", &[sh.batch, sh.seq, h], dt);
    let mask = sb.input("mask", &[sh.batch, sh.seq], DType::F32);
    let act = |sb: &mut Sb, cols: usize| sb.scratch((rows * cols * dt.size()) as u64);
    let mm = |a: BufRef, b, bias, act, residual, out, n: usize, k: usize| {
        Thunk::MatMul(MatMulThunk {
            dtype: dt,
            batch: sh.batch,
            m: sh.seq,
            n,
            k,
            a,
            lda: k as u64,
            a_batch_stride: (sh.seq * k) as u64,
            b,
            b_trans: true,
            ldb: k as u64,
            b_batch_stride: 0,
            bias,
            act,
            residual,
            out,
        })
    };
    let norm = |sb: &mut Sb, r: &mut rand::rngs::StdRng, name: &str, x: BufRef, residual: Option<BufRef>, out: BufRef| {
        let g = sb.weight(&format!("{name}.g"), &[h], dt, r);
        let b = sb.weight(&format!("{name}.b"), &[h], dt, r);
        Thunk::Norm { rms: false, dtype: dt, rows, cols: h, eps: 1e-12, x, residual, gamma: g, beta: Some(b), out }
    };
    let mut cur = act(&mut sb, h);
    let t = norm(&mut sb, &mut r, "emb", x, Some(pos), cur);
    sb.thunk(t);
    for l in 0..sh.layers {
        let w = |sb: &mut Sb, r: &mut rand::rngs::StdRng, n: &str, shape: &[usize]| sb.weight(&format!("l{l}.{n}"), shape, dt, r);
        let (wqkv, bqkv) = (w(&mut sb, &mut r, "wqkv", &[3 * h, h]), w(&mut sb, &mut r, "bqkv", &[3 * h]));
        let qkv = act(&mut sb, 3 * h);
        sb.thunk(mm(cur, wqkv, Some(bqkv), None, None, qkv, 3 * h, h));
        let att = act(&mut sb, h);
        sb.thunk(fused_qkv_attention(dt, sh.batch, sh.seq, h, sh.heads, qkv, Some((mask, DType::F32)), att));
        let (wo, bo) = (w(&mut sb, &mut r, "wo", &[h, h]), w(&mut sb, &mut r, "bo", &[h]));
        let proj = act(&mut sb, h);
        sb.thunk(mm(att, wo, Some(bo), None, Some(cur), proj, h, h));
        let n1 = act(&mut sb, h);
        let t = norm(&mut sb, &mut r, &format!("l{l}.ln1"), proj, None, n1);
        sb.thunk(t);
        let (w1, b1) = (w(&mut sb, &mut r, "w1", &[sh.ffn, h]), w(&mut sb, &mut r, "b1", &[sh.ffn]));
        let f1 = act(&mut sb, sh.ffn);
        sb.thunk(mm(n1, w1, Some(b1), Some(Activation::Gelu), None, f1, sh.ffn, h));
        let (w2, b2) = (w(&mut sb, &mut r, "w2", &[h, sh.ffn]), w(&mut sb, &mut r, "b2", &[h]));
        let f2 = act(&mut sb, h);
        sb.thunk(mm(f1, w2, Some(b2), None, Some(n1), f2, h, sh.ffn));
        let out = if l + 1 == sh.layers { sb.output("out", &[sh.batch, sh.seq, h], dt) } else { act(&mut sb, h) };
        let t = norm(&mut sb, &mut r, &format!("l{l}.ln2"), f2, None, out);
        sb.thunk(t);
        cur = out;
    }
    sb
}

fn inputs(dt: DType, sh: &Shape, seed: u64) -> Vec<(String, Tensor)> {
    let mut r = rng(seed);
    // Batch row b > 0 has its last 5·b + (random) keys padded.
    let mut mask = vec![1f32; sh.batch * sh.seq];
    for b in 1..sh.batch {
        let pad = (5 * b + r.random_range(0..7usize)).min(sh.seq - 1);
        for j in sh.seq - pad..sh.seq {
            mask[b * sh.seq + j] = 0.0;
        }
    }
    named(vec![
        ("x", rand_tensor(&mut r, &[sh.batch, sh.seq, sh.h], dt)),
        ("pos", rand_tensor(&mut r, &[sh.batch, sh.seq, sh.h], dt)),
        ("mask", Tensor::from_f32(vec![sh.batch, sh.seq], &mask).unwrap_or_else(|e| panic!("{e}"))),
    ])
}

#[test]
fn layer_program_matches_cpu_on_encoder_stacks() {
    let Some(g) = gpu_or_dry() else { return };
    let _lock = POLICY_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    set_layer_policy(LayerPolicy::On);
    let shapes = [
        // MiniLM-like (head dim 32), batch 1: every matmul split (2- to 8-way).
        Shape { batch: 1, seq: 128, h: 384, heads: 12, ffn: 1536, layers: 2 },
        // Head dim 64, rows not a multiple of 64, padded keys.
        Shape { batch: 2, seq: 77, h: 256, heads: 4, ffn: 1024, layers: 2 },
        // On the H200 (132 blocks): an unsplit FFN1 beside 3- and 6-way splits.
        Shape { batch: 1, seq: 200, h: 192, heads: 3, ffn: 768, layers: 1 },
        // 390 rows (past `auto`'s limit; on by policy): unsplit QKV, out-proj
        // and FFN1, an 8-way split FFN2.
        Shape { batch: 3, seq: 130, h: 128, heads: 2, ffn: 512, layers: 1 },
    ];
    for (i, sh) in shapes.iter().enumerate() {
        for dt in [DType::F16, DType::BF16] {
            let what = format!("layer program {dt} {}x{} h{} heads{} ffn{} x{}", sh.batch, sh.seq, sh.h, sh.heads, sh.ffn, sh.layers);
            let (s, w) = encoder(dt, sh, 40 + i as u64).finish();
            let inp = inputs(dt, sh, 60 + i as u64);
            // Seven thunks a layer in half precision, as tests/exec.rs's encoder layer.
            check_floor(&what, &g, &s, &w, &inp, 5.0, 3.0);
            if let Some(g) = &g {
                let mut e = g.prepare_cuda(s.clone(), w.clone(), &PrepareOptions::default()).unwrap_or_else(|e| panic!("{what}: {e}"));
                let (thunks, instructions) = e.layer_program_thunks();
                assert_eq!(thunks, s.thunks.len(), "{what}: not every thunk ran in the layer program\n{}", e.segment_map());
                assert_eq!(e.stats().kernels_per_call, 1, "{what}: {}", e.segment_map());
                eprintln!("{what}: {thunks} thunks as {instructions} instructions");
                // Many calls back to back: the barrier counter resets every time.
                let refs: Vec<(&str, &Tensor)> = inp.iter().map(|(n, t)| (n.as_str(), t)).collect();
                let first = Executable::run(&mut e, &refs).unwrap_or_else(|e| panic!("{what}: {e}"))[0].clone();
                for _ in 0..20 {
                    let again = Executable::run(&mut e, &refs).unwrap_or_else(|e| panic!("{what}: {e}"))[0].clone();
                    assert_eq!(first.bytes(), again.bytes(), "{what}: repeated calls differ");
                }
            }
        }
    }
}

#[test]
fn layer_program_off_runs_the_usual_kernels() {
    let Some(Some(g)) = gpu_or_dry() else { return };
    let sh = Shape { batch: 1, seq: 64, h: 128, heads: 2, ffn: 256, layers: 1 };
    let (s, w) = encoder(DType::F16, &sh, 5).finish();
    let _lock = POLICY_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    set_layer_policy(LayerPolicy::Off);
    let off = g.prepare_cuda(s, w, &PrepareOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(off.layer_program_thunks(), (0, 0));
    assert!(off.stats().kernels_per_call > 1);
}
