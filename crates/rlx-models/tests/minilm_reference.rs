//! all-MiniLM-L6-v2 on the CPU against the recorded sentence-transformers
//! outputs (tests/data/minilm/embeddings.json).

mod common;

use std::sync::OnceLock;

use common::{f32s, max_abs_diff, model_dir, reference, u32s};
use rlx::{DType, Device};
use rlx_models::{cosine, EmbedderOptions, SentenceEmbedder};
use serde_json::Value;

fn items() -> Vec<Value> {
    reference()["items"].as_array().expect("items").clone()
}

/// One f32 embedder for every test in this file (loading takes a moment).
fn embedder(test: &str) -> Option<&'static SentenceEmbedder> {
    static E: OnceLock<SentenceEmbedder> = OnceLock::new();
    let dir = model_dir(test)?;
    Some(E.get_or_init(|| SentenceEmbedder::load(&dir, Device::Cpu).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))))
}

#[test]
fn token_ids_equal_the_reference() {
    let Some(e) = embedder("token_ids_equal_the_reference") else { return };
    for (i, item) in items().iter().enumerate() {
        let text = item["text"].as_str().expect("text");
        let ids = e.tokenize(&[text]).expect("tokenize").remove(0);
        assert_eq!(ids, u32s(&item["input_ids"]), "item {i} {text:?}");
    }
}

#[test]
fn the_long_text_is_truncated_exactly_as_the_reference() {
    let Some(e) = embedder("the_long_text_is_truncated_exactly_as_the_reference") else { return };
    let items = items();
    let long: Vec<&Value> = items.iter().filter(|it| it["truncated"].as_bool() == Some(true)).collect();
    assert_eq!(long.len(), 1, "the reference has one truncated item");
    let item = long[0];
    let ids = e.tokenize(&[item["text"].as_str().expect("text")]).expect("tokenize").remove(0);
    assert_eq!(ids.len(), 256);
    assert!(item["untruncated_num_tokens"].as_u64().expect("n") > 256);
    assert_eq!(ids.last(), Some(&102), "[SEP] stays last");
    assert_eq!(ids, u32s(&item["input_ids"]));
}

#[test]
fn truncated_texts_are_counted_as_the_reference_marks_them() {
    let Some(e) = embedder("truncated_texts_are_counted_as_the_reference_marks_them") else { return };
    let items = items();
    let texts: Vec<&str> = items.iter().map(|it| it["text"].as_str().expect("text")).collect();
    let marked = items.iter().filter(|it| it["truncated"].as_bool() == Some(true)).count();
    let (ids, truncated) = e.tokenize_counting(&texts).expect("tokenize");
    assert_eq!(truncated, marked);
    assert_eq!(ids, e.tokenize(&texts).expect("tokenize"));
    assert_eq!(e.max_tokens(), 256);
    let (_, none) = e.tokenize_counting(&["a short text", ""]).expect("tokenize");
    assert_eq!(none, 0);
}

#[test]
fn embeddings_match_sentence_transformers_one_by_one() {
    let Some(e) = embedder("embeddings_match_sentence_transformers_one_by_one") else { return };
    let (mut worst_cos, mut worst_diff) = (1f32, 0f32);
    for (i, item) in items().iter().enumerate() {
        let text = item["text"].as_str().expect("text");
        let got = e.embed(&[text]).expect("embed").remove(0);
        let want = f32s(&item["embedding"]);
        let (cos, diff) = (cosine(&got, &want), max_abs_diff(&got, &want));
        assert!(cos >= 0.99999, "item {i} {text:?}: cosine {cos}");
        assert!(diff <= 1e-5, "item {i} {text:?}: max abs diff {diff}");
        let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "item {i}: norm {norm}");
        worst_cos = worst_cos.min(cos);
        worst_diff = worst_diff.max(diff);
    }
    eprintln!("17 texts vs sentence-transformers: worst cosine {worst_cos}, worst max abs diff {worst_diff:.2e}");
}

#[test]
fn the_empty_text_is_a_text() {
    let Some(e) = embedder("the_empty_text_is_a_text") else { return };
    let items = items();
    let empty = items.iter().find(|it| it["text"].as_str() == Some("")).expect("the reference has the empty text");
    assert_eq!(e.tokenize(&[""]).expect("tokenize")[0], vec![101, 102]);
    let got = e.embed(&[""]).expect("embed").remove(0);
    assert!(max_abs_diff(&got, &f32s(&empty["embedding"])) <= 1e-5);
}

#[test]
fn hidden_states_of_the_first_two_texts_match_every_layer() {
    let Some(e) = embedder("hidden_states_of_the_first_two_texts_match_every_layer") else { return };
    for (i, item) in items().iter().take(2).enumerate() {
        let ids = u32s(&item["input_ids"]);
        let got = e.hidden_states(&ids).expect("hidden states");
        let want = item["hidden_states"].as_array().expect("hidden_states");
        assert_eq!(got.len(), want.len(), "item {i}: embedding output + one per layer");
        for (layer, (g, w)) in got.iter().zip(want).enumerate() {
            let w: Vec<f32> = w.as_array().expect("rows").iter().flat_map(f32s).collect();
            let diff = max_abs_diff(g, &w);
            assert!(diff <= 1e-4, "item {i} hidden state {layer}: max abs diff {diff}");
            eprintln!("item {i} hidden state {layer}: max abs diff {diff:.2e}");
        }
    }
}

#[test]
fn a_padded_mixed_length_batch_equals_one_by_one() {
    let Some(dir) = model_dir("a_padded_mixed_length_batch_equals_one_by_one") else { return };
    let reference = reference();
    let batch = &reference["batch"];
    let items = items();
    let idx: Vec<usize> = batch["text_indices"].as_array().expect("indices").iter().map(|v| v.as_u64().expect("i") as usize).collect();
    let texts: Vec<&str> = idx.iter().map(|&i| items[i]["text"].as_str().expect("text")).collect();
    // Batch size = all the texts: one padded forward pass over mixed lengths.
    let opts = EmbedderOptions { batch_size: texts.len(), ..EmbedderOptions::default() };
    let batched_embedder = SentenceEmbedder::load_with(&dir, Device::Cpu, opts).expect("load");
    let batched = batched_embedder.embed(&texts).expect("embed batch");
    let single = embedder("a_padded_mixed_length_batch_equals_one_by_one").expect("model present");
    let want_batch: Vec<Vec<f32>> = batch["embeddings"].as_array().expect("embeddings").iter().map(f32s).collect();
    for (k, text) in texts.iter().enumerate() {
        let one = single.embed(&[text]).expect("embed one").remove(0);
        let diff = max_abs_diff(&batched[k], &one);
        assert!(diff <= 1e-6, "text {} {text:?}: batched vs alone max abs diff {diff}", idx[k]);
        eprintln!("text {}: batched vs alone {diff:.2e}", idx[k]);
        let diff = max_abs_diff(&batched[k], &want_batch[k]);
        assert!(diff <= 1e-5, "text {} {text:?}: batched vs reference batch max abs diff {diff}", idx[k]);
    }
}

/// `approximate_gelu` (the tanh GELU instead of the model's erf GELU) moves
/// the vectors, but only slightly: cosine to sentence-transformers stays
/// above 0.9999 in f32.
#[test]
fn approximate_gelu_moves_vectors_slightly() {
    let Some(dir) = model_dir("approximate_gelu_moves_vectors_slightly") else { return };
    let items = items();
    let texts: Vec<&str> = items.iter().map(|it| it["text"].as_str().expect("text")).collect();
    let load = |approximate_gelu| {
        let opts = EmbedderOptions { batch_size: 8, approximate_gelu, ..EmbedderOptions::default() };
        SentenceEmbedder::load_with(&dir, Device::Cpu, opts).expect("load").embed(&texts).expect("embed")
    };
    let (exact, approx) = (load(false), load(true));
    let mut worst = 1f32;
    let mut moved = 0f32;
    for (i, item) in items.iter().enumerate() {
        let cos = cosine(&approx[i], &f32s(&item["embedding"]));
        assert!(cos >= 0.9999, "item {i}: cosine {cos} with the tanh GELU");
        worst = worst.min(cos);
        moved = moved.max(max_abs_diff(&approx[i], &exact[i]));
    }
    assert!(moved > 1e-6, "the tanh GELU left every vector unchanged (max abs diff {moved})");
    eprintln!("tanh GELU: worst cosine {worst}, max abs diff to the exact GELU {moved:.2e}");
}

#[test]
fn f16_and_bf16_storage_keep_cosine_above_0_999() {
    let Some(dir) = model_dir("f16_and_bf16_storage_keep_cosine_above_0_999") else { return };
    let items = items();
    let texts: Vec<&str> = items.iter().map(|it| it["text"].as_str().expect("text")).collect();
    for dtype in [DType::F16, DType::BF16] {
        let e = SentenceEmbedder::load_with(&dir, Device::Cpu, EmbedderOptions { dtype, batch_size: 8, ..EmbedderOptions::default() })
            .expect("load");
        let got = e.embed(&texts).expect("embed");
        for (i, item) in items.iter().enumerate() {
            let cos = cosine(&got[i], &f32s(&item["embedding"]));
            assert!(cos >= 0.999, "{dtype} item {i}: cosine {cos}");
        }
        let worst = items
            .iter()
            .enumerate()
            .map(|(i, it)| cosine(&got[i], &f32s(&it["embedding"])))
            .map(|c| if c.is_nan() { f32::NEG_INFINITY } else { c })
            .fold(1f32, f32::min);
        eprintln!("{dtype}: worst cosine {worst}");
    }
}
