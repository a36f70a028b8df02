//! The `rlx` binary as a user runs it: output formats, notices, errors for
//! model directories it cannot read, `rlx fetch` on a verified directory.

mod common;

use std::process::Command;

use common::{model_dir, path_str, rlx, stderr, temp_dir};

#[test]
fn output_format_follows_the_extension() {
    let Some(model) = model_dir("output_format_follows_the_extension") else { return };
    let dir = temp_dir("format");
    let npy = dir.join("vectors.npy");
    let o = rlx(&["embed", "--model", path_str(&model), "-o", path_str(&npy), "first text", "second text"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let bytes = std::fs::read(&npy).unwrap_or_default();
    assert!(bytes.starts_with(b"\x93NUMPY"), "not an npy file: {:?}", &bytes[..bytes.len().min(16)]);
    let header = String::from_utf8_lossy(&bytes[..128.min(bytes.len())]).into_owned();
    assert!(header.contains("'shape': (2, 384)"), "{header}");
    assert_eq!(bytes.len(), 128 + 2 * 384 * 4);

    let jsonl = dir.join("vectors.jsonl");
    let o = rlx(&["embed", "--model", path_str(&model), "-o", path_str(&jsonl), "one"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&jsonl).unwrap_or_default();
    assert!(text.starts_with("{\"index\":0,\"embedding\":["), "{text:.80}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_format_that_contradicts_the_extension_is_an_error() {
    let dir = temp_dir("conflict");
    let npy = dir.join("x.npy");
    // Refused before any model is looked for: no model needed.
    let o = rlx(&["embed", "-o", path_str(&npy), "--format", "jsonl", "text"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("--format jsonl conflicts with --output") && e.contains("x.npy"), "{e}");
    assert!(!npy.exists(), "nothing written");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn truncated_texts_are_counted_once() {
    let Some(model) = model_dir("truncated_texts_are_counted_once") else { return };
    let dir = temp_dir("truncated");
    // More lines than one round of the stream (1024), two of them far over
    // the model's 256 tokens: one notice at the end, counting both.
    let long = vec!["word"; 400].join(" ");
    let mut lines: Vec<String> = (0..1030).map(|i| format!("text {i}")).collect();
    lines[3] = long.clone();
    lines[1029] = long;
    let input = dir.join("texts.txt");
    std::fs::write(&input, lines.join("\n")).unwrap_or_else(|e| panic!("{e}"));
    let out = dir.join("out.npy");
    let o = rlx(&["embed", "--model", path_str(&model), "-i", path_str(&input), "-o", path_str(&out)]);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert_eq!(e.matches("truncated").count(), 1, "{e}");
    assert!(e.contains("2 of 1030 texts were longer than the model's limit of 256 tokens"), "{e}");
    // stderr is not a terminal here: no progress bar.
    assert!(!e.contains("eta"), "{e}");

    let o = rlx(&["embed", "--model", path_str(&model), "-o", path_str(&out), "a short text"]);
    assert!(o.status.success() && !stderr(&o).contains("truncated"), "{}", stderr(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn model_dirs_in_formats_rlx_cannot_read_are_not_supported() {
    let dir = temp_dir("unsupported");
    let vocab_only = dir.join("vocab-only");
    std::fs::create_dir_all(&vocab_only).unwrap_or_else(|e| panic!("{e}"));
    for f in ["config.json", "vocab.txt", "model.safetensors"] {
        std::fs::write(vocab_only.join(f), "").unwrap_or_else(|e| panic!("{e}"));
    }
    let o = rlx(&["embed", "--model", path_str(&vocab_only), "text"]);
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(e.contains("not supported") && e.contains("vocab.txt") && e.contains("AutoTokenizer.from_pretrained"), "{e}");

    let bin_only = dir.join("bin-only");
    std::fs::create_dir_all(&bin_only).unwrap_or_else(|e| panic!("{e}"));
    for f in ["config.json", "tokenizer.json", "pytorch_model.bin"] {
        std::fs::write(bin_only.join(f), "").unwrap_or_else(|e| panic!("{e}"));
    }
    let o = rlx(&["similarity", "--model", path_str(&bin_only), "a", "b"]);
    let e = stderr(&o);
    assert!(!o.status.success());
    assert!(e.contains("not supported") && e.contains("pytorch_model.bin") && e.contains("safetensors"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fetch_leaves_verified_models_alone() {
    let Some(model) = model_dir("fetch_leaves_verified_models_alone") else { return };
    let gguf = model.join("../SmolLM2-135M-Instruct.Q4_1.gguf");
    if !gguf.is_file() {
        if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
            panic!("fetch_leaves_verified_models_alone: {} is missing and RLX_REQUIRE_MODELS=1: run scripts/fetch-models", gguf.display());
        }
        eprintln!("SKIPPED fetch_leaves_verified_models_alone: {} is missing (run scripts/fetch-models)", gguf.display());
        return;
    }
    // A models directory whose files link to the fetched ones: the embedded
    // script checks their sha256 and downloads nothing.
    let dir = temp_dir("fetch");
    let gguf = gguf.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", gguf.display()));
    std::os::unix::fs::symlink(gguf, dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap_or_else(|e| panic!("{e}"));
    let dest = dir.join("all-MiniLM-L6-v2");
    std::fs::create_dir_all(dest.join("1_Pooling")).unwrap_or_else(|e| panic!("{e}"));
    for f in ["config.json", "tokenizer.json", "modules.json", "sentence_bert_config.json", "1_Pooling/config.json", "model.safetensors"] {
        let src = model.join(f).canonicalize().unwrap_or_else(|e| panic!("{f}: {e}"));
        std::os::unix::fs::symlink(src, dest.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    let o = rlx(&["fetch", "--dir", path_str(&dir)]);
    let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert!(o.status.success(), "{out}");
    assert_eq!(out.matches("present and verified").count(), 2, "{out}");
    assert!(!out.contains("downloading"), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_reader_that_goes_away_ends_the_output_quietly() {
    // `rlx inspect | head -1`: the pipe closes before rlx writes (here: at
    // once), so every write fails with a broken pipe.
    let mut child = Command::new(env!("CARGO_BIN_EXE_rlx"))
        .arg("inspect")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run rlx: {e}"));
    drop(child.stdout.take());
    let o = child.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    let e = stderr(&o);
    assert!(o.status.success() && !e.contains("panicked"), "{:?}: {e}", o.status);
}

/// A file read in several rounds (32, 64, then 128 lines: reading,
/// embedding and writing overlap across them) comes out in input order:
/// lines from every round equal the same text embedded on its own.
#[test]
fn pipelined_rounds_keep_input_order() {
    let Some(model) = model_dir("pipelined_rounds_keep_input_order") else { return };
    let dir = temp_dir("rounds");
    let lines: Vec<String> =
        (0..200).map(|i| format!("line {i}: {}", vec!["alpha beta", "gamma", "delta epsilon zeta"][i % 3].repeat(1 + i % 7))).collect();
    let input = dir.join("texts.txt");
    std::fs::write(&input, lines.join("\n")).unwrap_or_else(|e| panic!("{e}"));
    let out = dir.join("out.jsonl");
    let o = rlx(&["embed", "--model", path_str(&model), "-i", path_str(&input), "-o", path_str(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&out).unwrap_or_else(|e| panic!("{e}"));
    let rows: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
    assert_eq!(rows.len(), 200);
    let vec_of = |v: &serde_json::Value| -> Vec<f64> {
        v["embedding"].as_array().unwrap_or_else(|| panic!("no embedding in {v}")).iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect()
    };
    for i in [0usize, 31, 32, 95, 96, 150, 199] {
        assert_eq!(rows[i]["index"].as_u64(), Some(i as u64), "row {i}");
        let o = rlx(&["embed", "--model", path_str(&model), "-o", path_str(&dir.join("one.jsonl")), &lines[i]]);
        assert!(o.status.success(), "{}", stderr(&o));
        let one: serde_json::Value = serde_json::from_str(std::fs::read_to_string(dir.join("one.jsonl")).unwrap_or_default().trim())
            .unwrap_or_else(|e| panic!("{e}"));
        let (a, b) = (vec_of(&rows[i]), vec_of(&one));
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
        assert!(a.len() == b.len() && d <= 1e-5, "line {i}: max |diff| {d} against the text embedded alone");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
