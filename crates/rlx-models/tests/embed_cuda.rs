//! The same SentenceEmbedder code on a CUDA device: parity with the CPU
//! backend on seeded random MiniLM-shaped weights, and the real model (f32
//! or the f16 copy from `scripts/fetch-models --f16`) against the recorded
//! sentence-transformers embeddings. Skips without a GPU unless
//! RLX_REQUIRE_GPU=1 (the GPU machine), where it must run.

mod common;

use std::path::PathBuf;

use common::{f32s, gpu, reference};
use rlx::{DType, Device};
use rlx_models::{cosine, random_weights, BertConfig, EmbedderOptions, Pooling, SentenceConfig, SentenceEmbedder};

fn lengths_ids(cfg: &BertConfig) -> Vec<Vec<u32>> {
    // Mixed lengths across several buckets; ids spread over the vocabulary.
    [2usize, 9, 16, 17, 40, 128, 100, 255]
        .iter()
        .enumerate()
        .map(|(r, &n)| (0..n).map(|t| ((r * 7919 + t * 104729) % cfg.vocab_size) as u32).collect())
        .collect()
}

#[test]
fn cuda_matches_cpu_on_random_minilm_weights() {
    if !gpu("cuda_matches_cpu_on_random_minilm_weights") {
        return;
    }
    let cfg = BertConfig::minilm_l6();
    let sentence = SentenceConfig { max_seq_length: 256, pooling: Pooling::Mean, normalize: true };
    let store = random_weights(&cfg, 42, DType::F32).expect("weights");
    let ids = lengths_ids(&cfg);
    let opts = |dtype| EmbedderOptions { dtype, batch_size: 4, ..EmbedderOptions::default() };
    let cpu =
        SentenceEmbedder::from_weights(cfg.clone(), sentence.clone(), None, store.clone(), Device::Cpu, opts(DType::F32)).expect("cpu");
    let want = cpu.embed_ids(&ids).expect("cpu embed");
    for (dtype, min_cos) in [(DType::F32, 0.99999), (DType::F16, 0.999), (DType::BF16, 0.995)] {
        let gpu =
            SentenceEmbedder::from_weights(cfg.clone(), sentence.clone(), None, store.clone(), Device::Cuda(0), opts(dtype)).expect("cuda");
        let got = gpu.embed_ids(&ids).expect("cuda embed");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let c = cosine(g, w);
            assert!(c >= min_cos, "{dtype} row {i} ({} tokens): cosine {c} vs CPU f32", ids[i].len());
        }
        let worst =
            got.iter().zip(&want).map(|(g, w)| cosine(g, w)).map(|c| if c.is_nan() { f32::NEG_INFINITY } else { c }).fold(1f32, f32::min);
        eprintln!("cuda {dtype} vs cpu f32, random weights: worst cosine {worst}");
    }
}

#[test]
fn cuda_matches_sentence_transformers_on_the_real_model() {
    if !gpu("cuda_matches_sentence_transformers_on_the_real_model") {
        return;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models");
    let Some(dir) =
        ["all-MiniLM-L6-v2", "all-MiniLM-L6-v2-f16"].iter().map(|d| root.join(d)).find(|d| d.join("model.safetensors").is_file())
    else {
        if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
            panic!("no MiniLM under {}: run scripts/fetch-models", root.display());
        }
        eprintln!("SKIPPED cuda_matches_sentence_transformers_on_the_real_model: no MiniLM under {}", root.display());
        return;
    };
    let reference = reference();
    let items = reference["items"].as_array().expect("items");
    let texts: Vec<&str> = items.iter().map(|it| it["text"].as_str().expect("text")).collect();
    // The last row: f16 with the tanh GELU (fused into cuBLASLt's epilogue).
    for (dtype, approximate_gelu, min_cos) in [(DType::F16, false, 0.999), (DType::F32, false, 0.9999), (DType::F16, true, 0.999)] {
        let opts = EmbedderOptions { dtype, batch_size: 8, approximate_gelu };
        let e = SentenceEmbedder::load_with(&dir, Device::Cuda(0), opts).expect("load");
        let got = e.embed(&texts).expect("embed");
        let mut worst = 1f32;
        for (i, item) in items.iter().enumerate() {
            let c = cosine(&got[i], &f32s(&item["embedding"]));
            assert!(c >= min_cos, "{} {dtype} (tanh GELU: {approximate_gelu}) item {i}: cosine {c}", dir.display());
            worst = worst.min(c);
        }
        eprintln!("cuda {dtype} (tanh GELU: {approximate_gelu}, {}): worst cosine vs sentence-transformers {worst}", dir.display());
    }
}
