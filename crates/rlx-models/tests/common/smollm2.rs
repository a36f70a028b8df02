//! SmolLM2 helpers shared by the CPU and CUDA generation tests: the model
//! file, the recorded transformers outputs, prompts, greedy runs.

use std::path::PathBuf;

use rlx_models::{Generator, Message, SamplingParams};
use serde_json::Value;

/// models/SmolLM2-135M-Instruct.Q4_1.gguf when present. Absent: the test
/// prints why and is skipped, unless RLX_REQUIRE_MODELS=1 (CI), where it fails.
pub fn gguf(test: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{test}: {} is missing and RLX_REQUIRE_MODELS=1: run scripts/fetch-models", p.display());
    }
    eprintln!("SKIPPED {test}: {} is missing (run scripts/fetch-models)", p.display());
    None
}

/// tests/data/smollm2_reference.json (copied from shared/reference).
pub fn reference() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2_reference.json");
    serde_json::from_str(&std::fs::read_to_string(&path).expect("reference json")).expect("valid json")
}

/// A reference item's prompt as token ids (chat items through the template).
pub fn prompt_ids(g: &Generator, item: &Value) -> Vec<u32> {
    if item["kind"] == "chat" {
        let msgs: Vec<Message> = item["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| Message::new(m["role"].as_str().expect("role"), m["content"].as_str().expect("content")))
            .collect();
        g.encode_chat(&msgs).expect("chat prompt")
    } else {
        g.encode(item["prompt"].as_str().expect("prompt")).expect("raw prompt")
    }
}

/// Greedy new ids and each step's logits (the generator must return logits).
pub fn greedy(g: &mut Generator, ids: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let params = SamplingParams { max_tokens: n, ignore_eos: true, ..SamplingParams::greedy() };
    let mut out = vec![];
    let mut logits = vec![];
    for p in g.generate_ids(ids, &params).expect("generate") {
        let p = p.expect("piece");
        out.push(p.token);
        logits.push(p.logits.expect("logits"));
    }
    (out, logits)
}

/// Indices of the `k` largest values, ties to the lower index.
pub fn top(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// The largest |a - b| over two equally long slices.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A generator with a half-precision KV cache (`h`) against one with an
/// f32 cache (`f`) on the same weights, over every reference item: the
/// largest |logit diff| of `steps` greedy steps must stay within `tol`, the
/// top-20 logits at the prompt's end within `tol` of transformers', and the
/// greedy tokens equal while both runs' contexts agree and the f32 run's
/// top-1 margin exceeds twice `tol`. Returns the largest diff seen.
pub fn half_cache_against_f32_cache(h: &mut Generator, f: &mut Generator, tol: f32, steps: usize) -> f32 {
    let r = reference();
    let mut worst = 0f32;
    for (n, item) in r["items"].as_array().expect("items").iter().enumerate() {
        let ids = prompt_ids(f, item);
        let (hi, hl) = greedy(h, &ids, steps);
        let (fi, fl) = greedy(f, &ids, steps);
        let mut item_worst = 0f32;
        for (k, (a, b)) in hl.iter().zip(&fl).enumerate() {
            if hi[..k] != fi[..k] {
                break;
            }
            let d = max_diff(a, b);
            assert!(d <= tol, "item {n}: step {k}: max |logit diff| {d} between the caches (> {tol})");
            item_worst = item_worst.max(d);
        }
        for (id, v) in
            crate::common::u32s(&item["last_logits"]["top20_ids"]).iter().zip(crate::common::f32s(&item["last_logits"]["top20_values"]))
        {
            let d = (hl[0][*id as usize] - v).abs();
            assert!(d <= tol, "item {n}: logit of {id} with the half cache: {} vs transformers' {v}", hl[0][*id as usize]);
        }
        let mut agreed = 0;
        for (k, a) in hi.iter().enumerate() {
            let t = top(&fl[k], 2);
            if hi[..k] != fi[..k] || fl[k][t[0]] - fl[k][t[1]] <= 2.0 * tol {
                break;
            }
            assert_eq!(*a, fi[k], "item {n}: step {k}: greedy token, half vs f32 cache");
            agreed += 1;
        }
        eprintln!(
            "item {n}: half vs f32 KV cache: max |logit diff| {item_worst:e} over {steps} steps; {agreed} greedy tokens checked equal"
        );
        worst = worst.max(item_worst);
    }
    worst
}
