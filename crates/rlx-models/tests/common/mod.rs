//! Shared by the integration tests: where the real model is, and whether its
//! absence is a skip or a failure.
#![allow(dead_code)]

pub mod smollm2;

use std::path::PathBuf;

use serde_json::Value;

/// models/all-MiniLM-L6-v2 when present. Absent: the test prints why and is
/// skipped, unless RLX_REQUIRE_MODELS=1 (CI), where it fails.
pub fn model_dir(test: &str) -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/all-MiniLM-L6-v2");
    if dir.join("model.safetensors").is_file() && dir.join("tokenizer.json").is_file() {
        return Some(dir);
    }
    if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{test}: {} is missing and RLX_REQUIRE_MODELS=1: run scripts/fetch-models", dir.display());
    }
    eprintln!("SKIPPED {test}: {} is missing (run scripts/fetch-models)", dir.display());
    None
}

/// The recorded sentence-transformers outputs (copied from shared/reference).
pub fn reference() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/minilm/embeddings.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    // A NaN counts as an infinite difference (f32::max would drop it).
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).map(|d| if d.is_nan() { f32::INFINITY } else { d }).fold(0.0, f32::max)
}

/// Whether a CUDA device is usable. Without one the test prints why and is
/// skipped, unless RLX_REQUIRE_GPU=1 (the GPU machine), where it fails.
pub fn gpu(test: &str) -> bool {
    match rlx::Session::new(rlx::Device::Cuda(0)) {
        Ok(_) => true,
        Err(e) if std::env::var("RLX_REQUIRE_GPU").as_deref() == Ok("1") => panic!("{test}: RLX_REQUIRE_GPU=1 but CUDA is unusable: {e}"),
        Err(e) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e})");
            false
        }
    }
}
