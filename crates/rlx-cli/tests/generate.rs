//! `rlx generate` as a user runs it, on the default model (SmolLM2 Q4_1):
//! greedy JSON output against transformers' recorded tokens, the chat
//! template, stop strings, and errors for bad arguments.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn rlx(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rlx")).args(args).output().unwrap_or_else(|e| panic!("cannot run rlx: {e}"))
}

fn model(test: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{test}: {} is missing and RLX_REQUIRE_MODELS=1: run scripts/fetch-models", p.display());
    }
    eprintln!("SKIPPED {test}: {} is missing (run scripts/fetch-models)", p.display());
    None
}

fn json(o: &Output) -> serde_json::Value {
    assert!(o.status.success(), "rlx failed: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not one JSON object ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id")).collect()
}

#[test]
fn greedy_json_matches_transformers() {
    let Some(m) = model("greedy_json_matches_transformers") else { return };
    let m = m.to_str().expect("utf-8 path");
    // Reference item 1 (raw): transformers' first greedy tokens; the
    // quantized path agrees with them on this prompt (margins > 0.3).
    let o = rlx(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "Once upon a time, in a small village by the sea,",
        "--temperature",
        "0",
        "--max-tokens",
        "4",
        "--format",
        "json",
    ]);
    let v = json(&o);
    assert_eq!(ids(&v["prompt_ids"]), vec![6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28]);
    assert_eq!(ids(&v["ids"]), vec![665, 436, 253, 9357]);
    assert_eq!(v["text"], " there was a wise");
    assert!(v["decode_tok_s"].as_f64().expect("speed") > 0.0);
    // The chat template: the recorded prompt ids of reference item 0.
    let o = rlx(&[
        "generate",
        "--model",
        m,
        "--chat",
        "What is the capital of France?",
        "--temperature",
        "0",
        "--max-tokens",
        "1",
        "--format",
        "json",
    ]);
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../rlx-models/tests/data/smollm2_reference.json"))
            .expect("reference"),
    )
    .expect("json");
    assert_eq!(ids(&json(&o)["prompt_ids"]), ids(&reference["items"][0]["input_ids"]), "chat-templated prompt ids");
}

#[test]
fn stop_string_ends_the_text_before_it() {
    let Some(m) = model("stop_string_ends_the_text_before_it") else { return };
    let o = rlx(&[
        "generate",
        "--model",
        m.to_str().expect("utf-8"),
        "--prompt",
        "Once upon a time, in a small village by the sea,",
        "--temperature",
        "0",
        "--max-tokens",
        "20",
        "--stop",
        "wise",
        "--format",
        "json",
    ]);
    let v = json(&o);
    assert_eq!(v["text"], " there was a ");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let Some(m) = model("bad_arguments_are_clear_errors") else { return };
    let m = m.to_str().expect("utf-8");
    for (args, want) in [
        (vec!["generate", "--model", m, "--prompt", ""], "the prompt is empty"),
        (vec!["generate", "--model", m, "--prompt", "hi", "--top-p", "2"], "top_p must be in 0..=1"),
        (vec!["generate", "--model", m, "--prompt", "hi", "--ctx-size", "1"], "ctx-size 1 is too small"),
        (vec!["generate", "--model", m, "--prompt", "hi", "--max-tokens", "0"], "max_tokens must be at least 1"),
        (vec!["generate", "--model", "no/such.gguf", "--prompt", "hi"], "no such file"),
        (vec!["generate", "--model", m], "give --prompt TEXT"),
    ] {
        let o = rlx(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: expected an error containing {want:?}, got: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}
