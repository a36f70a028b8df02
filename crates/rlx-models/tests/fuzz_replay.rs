//! Replays every fuzz seed (fuzz/seeds/<target>/) and every input that once
//! crashed a fuzz target (fuzz/regressions/<target>/) through the targets'
//! own bodies (rlx-models' loaders, rlx-cuda's cache files, rlx-serve's
//! request bodies), on the stable toolchain: a fixed crash stays fixed in CI
//! without nightly or libFuzzer.

#[path = "../../../fuzz/src/lib.rs"]
mod bodies;

use std::path::Path;

/// A fuzz target's name and body.
type Target = (&'static str, fn(&[u8]));

#[test]
fn every_seed_and_recorded_crash_input_replays_cleanly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    let targets: [Target; 10] = [
        ("safetensors_header", bodies::safetensors_header),
        ("bert_config", bodies::bert_config),
        ("tokenizer_json", bodies::tokenizer_json),
        ("text_lines", bodies::text_lines),
        ("gguf_file", bodies::gguf_file),
        ("bpe_vocab", bodies::bpe_vocab),
        ("chat_template", bodies::chat_template),
        ("gemm_choices", bodies::gemm_choices),
        ("kernel_cache", bodies::kernel_cache),
        ("serve_request", bodies::serve_request),
    ];
    let (mut replayed, mut failed) = (0, Vec::new());
    for (name, body) in targets {
        let seeds = std::fs::read_dir(root.join("seeds").join(name)).map(|d| d.count()).unwrap_or(0);
        assert!(seeds > 0, "no seeds for fuzz target {name} under {}", root.display());
        for kind in ["seeds", "regressions"] {
            let Ok(entries) = std::fs::read_dir(root.join(kind).join(name)) else { continue };
            let mut paths: Vec<_> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
            paths.sort();
            for path in paths {
                let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                if std::panic::catch_unwind(|| body(&bytes)).is_err() {
                    failed.push(path.display().to_string());
                }
                replayed += 1;
            }
        }
    }
    assert!(failed.is_empty(), "inputs that panic: {failed:?}");
    assert!(replayed >= 30, "only {replayed} inputs found under {}", root.display());
}
