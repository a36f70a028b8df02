//! Runs the Python package's pytest suite (tests/test_rlx.py) in the
//! virtual environment that scripts/build-python makes, against reference
//! outputs this test computes with the Rust APIs: `SentenceEmbedder::embed`
//! vectors (compared bit for bit) and greedy `Generator` text.
//!
//! Without the models, python3's venv or a successful wheel build the test
//! prints the skip marker and returns, except under RLX_REQUIRE_MODELS=1
//! (CI), where each of those fails it.

use std::path::{Path, PathBuf};
use std::process::Command;

use rlx::Device;
use rlx_models::{Generator, GeneratorOptions, Message, SamplingParams, SentenceEmbedder};
use serde_json::{json, Value};

const TEST: &str = "pytest_suite_of_the_python_package";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn required() -> bool {
    std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1")
}

/// Prints the skip marker, or panics where the test must run.
fn skip(why: &str) {
    if required() {
        panic!("{TEST}: {why} and RLX_REQUIRE_MODELS=1");
    }
    eprintln!("SKIPPED {TEST}: {why}");
}

fn model(rel: &str) -> Option<PathBuf> {
    let p = root().join("models").join(rel);
    if p.exists() {
        return Some(p);
    }
    skip(&format!("{} is missing (run scripts/fetch-models)", p.display()));
    None
}

/// Texts for the bit-for-bit check: the recorded sentence-transformers
/// texts (the empty and the over-long one among them) and a few more.
fn texts() -> Vec<String> {
    let path = root().join("crates/rlx-models/tests/data/minilm/embeddings.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out: Vec<String> = v["items"]
        .as_array()
        .unwrap_or_else(|| panic!("no items"))
        .iter()
        .map(|it| it["text"].as_str().unwrap_or_else(|| panic!("item without text")).to_string())
        .collect();
    out.extend(["RLX turns text into vectors.", "Ein Satz auf Deutsch.", "first text", "first text"].map(String::from));
    out.extend((0..40).map(|i| format!("sentence {i} of a batch that spans more than one forward pass")));
    out
}

/// The Rust outputs the Python package must reproduce, as JSON.
fn rust_reference(minilm: &Path, gguf: &Path) -> Value {
    let texts = texts();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let embedder = SentenceEmbedder::load(minilm, Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let vectors = embedder.embed(&refs).unwrap_or_else(|e| panic!("{e}"));
    // f32 bit patterns, so nothing is lost in decimal.
    let bits: Vec<Vec<u32>> = vectors.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect();

    let opts = GeneratorOptions { ctx_size: 512, ..GeneratorOptions::default() };
    let mut gen = Generator::load_with(gguf, Device::Cpu, opts).unwrap_or_else(|e| panic!("{e}"));
    let params = SamplingParams { max_tokens: 24, ..SamplingParams::greedy() };
    let prompt = "The capital of France is";
    let generated = gen.generate(prompt, &params).and_then(|mut g| g.collect_text()).unwrap_or_else(|e| panic!("{e}"));
    let question = "What is 2+2?";
    let chat = gen.chat(&[Message::new("user", question)], &params).and_then(|mut g| g.collect_text()).unwrap_or_else(|e| panic!("{e}"));
    json!({
        "texts": texts,
        "embedding_bits": bits,
        "generate": {"prompt": prompt, "max_tokens": 24, "text": generated},
        "chat": {"user": question, "max_tokens": 24, "text": chat},
    })
}

#[test]
fn pytest_suite_of_the_python_package() {
    let (Some(minilm), Some(gguf)) = (model("all-MiniLM-L6-v2"), model("SmolLM2-135M-Instruct.Q4_1.gguf")) else { return };
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("rlx-python");
    std::fs::create_dir_all(&work).unwrap_or_else(|e| panic!("{}: {e}", work.display()));
    let reference = work.join("rust_reference.json");
    let value = rust_reference(&minilm, &gguf);
    std::fs::write(&reference, value.to_string()).unwrap_or_else(|e| panic!("{}: {e}", reference.display()));

    if !Command::new("python3").args(["-m", "venv", "--help"]).output().is_ok_and(|o| o.status.success()) {
        return skip("python3 -m venv is not available");
    }
    // The workspace's target directory (CARGO_TARGET_TMPDIR is its tmp/),
    // so the wheel build reuses what `cargo test` compiled.
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().unwrap_or_else(|| panic!("no target directory")).to_path_buf();
    let venv = target.join("python-venv-test");
    let built = Command::new(root().join("scripts/build-python"))
        .args(["--dev", "--venv"])
        .arg(&venv)
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .unwrap_or_else(|e| panic!("cannot run scripts/build-python: {e}"));
    let log = format!("{}{}", String::from_utf8_lossy(&built.stdout), String::from_utf8_lossy(&built.stderr));
    if !built.status.success() {
        return skip(&format!("scripts/build-python failed ({}): {log}", built.status));
    }
    println!("{}", log.trim());

    let out = Command::new(venv.join("bin/python"))
        .args(["-m", "pytest", "-p", "no:cacheprovider", "-rs", "-v"])
        .arg(root().join("crates/rlx-python/tests"))
        .current_dir(root())
        .env("RLX_TEST_REFERENCE", &reference)
        .env("RLX_TEST_MINILM", &minilm)
        .env("RLX_TEST_GGUF", &gguf)
        .env("RLX_TEST_ST_REFERENCE", root().join("crates/rlx-models/tests/data/minilm/embeddings.json"))
        .env_remove("RLX_MODEL_DIR")
        .output()
        .unwrap_or_else(|e| panic!("cannot run pytest: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "pytest failed ({})", out.status);
    let summary = text.lines().rev().find(|l| l.contains(" passed")).unwrap_or_default();
    assert!(!summary.contains("skipped") && !summary.contains("failed"), "every Python test must run and pass: {summary}");
}
