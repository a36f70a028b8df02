//! The BERT graph for configs other than MiniLM's, against a plain f64
//! implementation written here from the BERT definition: seeded random
//! weights and ids, mixed lengths (so padding and masking matter), mean and
//! CLS pooling, erf and tanh GELU, token types.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rlx::{Activation, DType, Device, Session, Tensor, WeightStore};
use rlx_models::{
    build_bert_graph, random_weights, BertConfig, BertGraphOptions, EmbedderOptions, Pooling, SentenceConfig, SentenceEmbedder,
    ATTENTION_MASK, INPUT_IDS, TOKEN_TYPE_IDS,
};

fn small(act: Activation) -> BertConfig {
    BertConfig {
        vocab_size: 61,
        hidden_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 3,
        intermediate_size: 40,
        hidden_act: act,
        layer_norm_eps: 1e-5,
        max_position_embeddings: 40,
        type_vocab_size: 2,
    }
}

fn erf(x: f64) -> f64 {
    // Taylor series; |x| >= 5 is ±1 to double precision for our purpose.
    if x.abs() >= 5.0 {
        return x.signum();
    }
    let (mut term, mut sum, mut n) = (x, x, 0.0);
    while term.abs() > 1e-17 * sum.abs().max(1e-300) {
        n += 1.0;
        term *= -x * x / n;
        sum += term / (2.0 * n + 1.0);
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

fn act(a: Activation, x: f64) -> f64 {
    match a {
        Activation::Gelu => 0.5 * x * (1.0 + erf(x / 2f64.sqrt())),
        Activation::GeluTanh => 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()),
        Activation::Relu => x.max(0.0),
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::Tanh => x.tanh(),
    }
}

/// Weights as f64 for the reference.
struct W<'a>(&'a WeightStore);
impl W<'_> {
    fn get(&self, n: &str) -> Vec<f64> {
        self.0.get(n).unwrap_or_else(|| panic!("{n}")).to_f32().iter().map(|&x| x as f64).collect()
    }
}

fn layer_norm(x: &mut [f64], g: &[f64], b: &[f64], eps: f64) {
    let h = g.len();
    for row in x.chunks_mut(h) {
        let mean = row.iter().sum::<f64>() / h as f64;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / h as f64;
        for (j, v) in row.iter_mut().enumerate() {
            *v = (*v - mean) / (var + eps).sqrt() * g[j] + b[j];
        }
    }
}

/// y[s, o] = sum_i x[s, i] w[o, i] + b[o]
fn linear(x: &[f64], w: &[f64], b: &[f64], d_in: usize) -> Vec<f64> {
    let d_out = b.len();
    let rows = x.len() / d_in;
    let mut y = vec![0.0; rows * d_out];
    for s in 0..rows {
        for o in 0..d_out {
            y[s * d_out + o] = b[o] + (0..d_in).map(|i| x[s * d_in + i] * w[o * d_in + i]).sum::<f64>();
        }
    }
    y
}

/// Hidden states of one unpadded sequence: embeddings LN, then each layer.
fn reference(cfg: &BertConfig, w: &W, ids: &[u32], types: &[u32]) -> Vec<Vec<f64>> {
    let (h, s) = (cfg.hidden_size, ids.len());
    let (word, pos, tt) = (
        w.get("embeddings.word_embeddings.weight"),
        w.get("embeddings.position_embeddings.weight"),
        w.get("embeddings.token_type_embeddings.weight"),
    );
    let mut x = vec![0.0; s * h];
    for t in 0..s {
        for j in 0..h {
            x[t * h + j] = word[ids[t] as usize * h + j] + pos[t * h + j] + tt[types[t] as usize * h + j];
        }
    }
    let eps = cfg.layer_norm_eps as f64;
    layer_norm(&mut x, &w.get("embeddings.LayerNorm.weight"), &w.get("embeddings.LayerNorm.bias"), eps);
    let mut out = vec![x.clone()];
    let (heads, d) = (cfg.num_attention_heads, cfg.head_dim());
    for l in 0..cfg.num_hidden_layers {
        let p = |n: &str| format!("encoder.layer.{l}.{n}");
        let lin = |x: &[f64], m: &str, d_in| linear(x, &w.get(&p(&format!("{m}.weight"))), &w.get(&p(&format!("{m}.bias"))), d_in);
        let (q, k, v) = (lin(&x, "attention.self.query", h), lin(&x, "attention.self.key", h), lin(&x, "attention.self.value", h));
        let mut ctx = vec![0.0; s * h];
        for hd in 0..heads {
            for i in 0..s {
                let scores: Vec<f64> = (0..s)
                    .map(|j| (0..d).map(|c| q[i * h + hd * d + c] * k[j * h + hd * d + c]).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|z| (z - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..d {
                    ctx[i * h + hd * d + c] = (0..s).map(|j| e[j] / z * v[j * h + hd * d + c]).sum();
                }
            }
        }
        let mut a = lin(&ctx, "attention.output.dense", h);
        a.iter_mut().zip(&x).for_each(|(a, r)| *a += r);
        layer_norm(&mut a, &w.get(&p("attention.output.LayerNorm.weight")), &w.get(&p("attention.output.LayerNorm.bias")), eps);
        let up: Vec<f64> = lin(&a, "intermediate.dense", h).into_iter().map(|z| act(cfg.hidden_act, z)).collect();
        let mut down = lin(&up, "output.dense", cfg.intermediate_size);
        down.iter_mut().zip(&a).for_each(|(o, r)| *o += r);
        layer_norm(&mut down, &w.get(&p("output.LayerNorm.weight")), &w.get(&p("output.LayerNorm.bias")), eps);
        x = down;
        out.push(x.clone());
    }
    out
}

fn pooled(cfg: &BertConfig, last: &[f64], pooling: Pooling, normalize: bool) -> Vec<f64> {
    let h = cfg.hidden_size;
    let s = last.len() / h;
    let mut v: Vec<f64> = match pooling {
        Pooling::Mean => (0..h).map(|j| (0..s).map(|t| last[t * h + j]).sum::<f64>() / s as f64).collect(),
        Pooling::Cls => last[..h].to_vec(),
    };
    if normalize {
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
        v.iter_mut().for_each(|x| *x /= n);
    }
    v
}

fn random_ids(rng: &mut impl Rng, cfg: &BertConfig, lens: &[usize]) -> Vec<Vec<u32>> {
    lens.iter().map(|&n| (0..n).map(|_| rng.random_range(0..cfg.vocab_size as u32)).collect()).collect()
}

fn max_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).map(|d| if d.is_nan() { f64::INFINITY } else { d }).fold(0.0, f64::max)
}

#[test]
fn embedder_matches_an_f64_bert_for_mean_and_cls_pooling() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for (act, pooling, normalize) in [(Activation::Gelu, Pooling::Mean, true), (Activation::GeluTanh, Pooling::Cls, false)] {
        let cfg = small(act);
        let store = random_weights(&cfg, 5, DType::F32).expect("weights");
        // Lengths straddle buckets (max 40 -> buckets 16, 24, 32, 40).
        let ids = random_ids(&mut rng, &cfg, &[3, 17, 1, 40, 16, 9, 33]);
        let sentence = SentenceConfig { max_seq_length: 40, pooling, normalize };
        let opts = EmbedderOptions { dtype: DType::F32, batch_size: 4, ..EmbedderOptions::default() };
        let e = SentenceEmbedder::from_weights(cfg.clone(), sentence, None, Arc::clone(&store), Device::Cpu, opts).expect("embedder");
        let got = e.embed_ids(&ids).expect("embed");
        let w = W(&store);
        for (i, row) in ids.iter().enumerate() {
            let hs = reference(&cfg, &w, row, &vec![0; row.len()]);
            let want = pooled(&cfg, &hs[cfg.num_hidden_layers], pooling, normalize);
            let d = max_diff(&got[i], &want);
            assert!(d <= 1e-4, "{act:?} {pooling:?} text {i} ({} tokens): max abs diff {d}", row.len());
        }
        let hs = e.hidden_states(&ids[1]).expect("hidden states");
        let want = reference(&cfg, &w, &ids[1], &vec![0; ids[1].len()]);
        for (l, (g, r)) in hs.iter().zip(&want).enumerate() {
            let d = max_diff(g, r);
            assert!(d <= 1e-4, "{act:?} hidden state {l}: max abs diff {d}");
        }
        // Ids outside the vocabulary are refused before anything runs.
        let err = e.embed_ids(&[vec![1, cfg.vocab_size as u32]]).expect_err("bad id").to_string();
        assert!(err.contains("outside the vocabulary"), "{err}");
        let err = e.embed_ids(&[vec![1; 41]]).expect_err("too long").to_string();
        assert!(err.contains("at most 40"), "{err}");
    }
}

#[test]
fn a_partial_batch_cut_into_smaller_batches_matches_the_reference() {
    // On the CPU, 29 texts at batch 16 run as 16 + 8 + 5 (the last few rows
    // padded to 8): every vector against the f64 model, in input order, and
    // the progress adds up to every text.
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let cfg = small(Activation::Gelu);
    let store = random_weights(&cfg, 13, DType::F32).expect("weights");
    let lens: Vec<usize> = (0..29).map(|i| 1 + (i * 7) % 40).collect();
    let ids = random_ids(&mut rng, &cfg, &lens);
    let sentence = SentenceConfig { max_seq_length: 40, pooling: Pooling::Mean, normalize: true };
    let opts = EmbedderOptions { dtype: DType::F32, batch_size: 16, ..EmbedderOptions::default() };
    let e = SentenceEmbedder::from_weights(cfg.clone(), sentence, None, Arc::clone(&store), Device::Cpu, opts).expect("embedder");
    let mut done = 0;
    let got = e.embed_ids_with_progress(&ids, &mut |n| done += n).expect("embed");
    assert_eq!(done, ids.len());
    let w = W(&store);
    for (i, row) in ids.iter().enumerate() {
        let hs = reference(&cfg, &w, row, &vec![0; row.len()]);
        let d = max_diff(&got[i], &pooled(&cfg, &hs[cfg.num_hidden_layers], Pooling::Mean, true));
        assert!(d <= 1e-4, "text {i} ({} tokens): max abs diff {d}", row.len());
    }
}

#[test]
fn token_type_ids_input_matches_the_reference() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let cfg = small(Activation::Gelu);
    let store = random_weights(&cfg, 9, DType::F32).expect("weights");
    let (b, s) = (2, 8);
    let opts = BertGraphOptions { pooling: Pooling::Mean, hidden_states: true, token_type_ids: true };
    let g = build_bert_graph(&cfg, b, s, &opts).expect("graph");
    let session = Session::with_weights(Device::Cpu, Arc::clone(&store)).expect("session");
    let mut exe = session.compile(&g).expect("compile");
    let ids: Vec<u32> = (0..b * s).map(|_| rng.random_range(0..cfg.vocab_size as u32)).collect();
    let types: Vec<u32> = (0..b * s).map(|_| rng.random_range(0..2)).collect();
    // Row 1 has 5 real tokens and 3 pads.
    let lens = [8usize, 5];
    let mask: Vec<f32> = (0..b * s).map(|i| if i % s < lens[i / s] { 1.0 } else { 0.0 }).collect();
    let t = |v: &[u32]| Tensor::from_i32([b, s], &v.iter().map(|&x| x as i32).collect::<Vec<_>>()).expect("ids");
    let out = exe
        .run(&[(INPUT_IDS, &t(&ids)), (TOKEN_TYPE_IDS, &t(&types)), (ATTENTION_MASK, &Tensor::from_f32([b, s], &mask).expect("mask"))])
        .expect("run");
    assert_eq!(out.len(), 2 + cfg.num_hidden_layers, "pooled + embeddings + one per layer");
    let pooled_out = out[0].to_f32();
    let last = out[1 + cfg.num_hidden_layers].to_f32();
    let h = cfg.hidden_size;
    let w = W(&store);
    for r in 0..b {
        let n = lens[r];
        let hs = reference(&cfg, &w, &ids[r * s..r * s + n], &types[r * s..r * s + n]);
        let want_last = &hs[cfg.num_hidden_layers];
        let d = max_diff(&last[r * s * h..(r * s + n) * h], want_last);
        assert!(d <= 1e-4, "row {r} last hidden state: max abs diff {d}");
        let d = max_diff(&pooled_out[r * h..(r + 1) * h], &pooled(&cfg, want_last, Pooling::Mean, false));
        assert!(d <= 1e-4, "row {r} pooled: max abs diff {d}");
    }
}

#[test]
fn every_bucket_shares_the_stored_weights() {
    let cfg = small(Activation::Gelu);
    let store = random_weights(&cfg, 1, DType::F32).expect("weights");
    let session = Session::with_weights(Device::Cpu, Arc::clone(&store)).expect("session");
    let mut shared = 0;
    for (b, s) in [(1, 16), (4, 40)] {
        let exe = session.compile(&build_bert_graph(&cfg, b, s, &BertGraphOptions::default()).expect("graph")).expect("compile");
        for slot in &exe.schedule().weights {
            let resolved = store.resolve(slot).expect("resolve");
            if let [only] = slot.parts.as_slice() {
                let stored = store.get(only).expect("stored");
                if stored.dtype() == slot.dtype {
                    // One copy of each weight, whatever the number of buckets.
                    assert!(Arc::ptr_eq(&stored, &resolved), "{} was copied for bucket {b}x{s}", slot.name);
                    shared += 1;
                }
            }
        }
    }
    assert!(shared > 10, "only {shared} single-part weights seen");
}

/// MiniLM's graph (6 layers, H 384, I 1536) at 1×128 in f16: every layer's
/// output projection, its norm and the feed-forward block become one fused
/// thunk (`fuse_ffn`), the form the CUDA backend's fused kernel runs.
#[test]
fn every_minilm_layer_fuses_its_feed_forward_block() {
    let cfg = BertConfig {
        vocab_size: 100,
        hidden_size: 384,
        num_hidden_layers: 6,
        num_attention_heads: 12,
        intermediate_size: 1536,
        hidden_act: Activation::Gelu,
        layer_norm_eps: 1e-12,
        max_position_embeddings: 512,
        type_vocab_size: 2,
    };
    let g = build_bert_graph(&cfg, 1, 128, &BertGraphOptions::default()).unwrap();
    let opts = rlx::CompileOptions { precision: Some(DType::F16), ..Default::default() };
    let s = rlx::compile(&g, &opts).unwrap().schedule;
    let blocks: Vec<&rlx::Thunk> = s.thunks.iter().filter(|t| t.kind() == "feed_forward").collect();
    assert_eq!(blocks.len(), 6, "{s}");
    for b in blocks {
        let kinds: Vec<&str> = b.parts().unwrap_or_default().iter().map(|p| p.kind()).collect();
        assert_eq!(kinds, ["matmul", "layer_norm", "matmul", "matmul", "layer_norm"]);
    }
    // Nothing else is left of the layers' matmuls but the QKV projections.
    assert_eq!(s.thunks.iter().filter(|t| t.kind() == "matmul").count(), 6, "{s}");
}
