//! A model file truncated (or rewritten) after loading: the loaders copy
//! every weight out of the mapped file and drop the mapping before `load`
//! returns, so nothing of the file stays mapped (no SIGBUS can come from
//! it later) and the model keeps answering exactly as before, including
//! shapes first prepared after the file was cut.

mod common;

use std::path::{Path, PathBuf};

use rlx::Device;
use rlx_models::{Generator, GeneratorOptions, SamplingParams, SentenceEmbedder};

fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rlx-truncated-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    dir
}

/// Copies the regular files of `from` (and of its subfolders) into `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap_or_else(|e| panic!("{}: {e}", to.display()));
    for entry in std::fs::read_dir(from).unwrap_or_else(|e| panic!("{}: {e}", from.display())) {
        let p = entry.unwrap_or_else(|e| panic!("{e}")).path();
        let dest = to.join(p.file_name().unwrap_or_default());
        if p.is_dir() {
            copy_dir(&p, &dest);
        } else {
            std::fs::copy(&p, &dest).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        }
    }
}

/// Whether this process has `path` mapped (a line of /proc/self/maps names it).
fn mapped(path: &Path) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let name = path.to_string_lossy();
    maps.lines().any(|l| l.ends_with(name.as_ref()))
}

/// Cuts `path` to nothing, then writes garbage where the data was: any read
/// through a stale mapping would now fault or see different bytes.
fn truncate(path: &Path) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.set_len(0).unwrap_or_else(|e| panic!("{e}"));
    drop(f);
    std::fs::write(path, vec![0xA5u8; 4096]).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_safetensors_file_cut_after_loading_changes_nothing() {
    let Some(src) = common::model_dir("a_safetensors_file_cut_after_loading_changes_nothing") else { return };
    let dir = scratch("bert");
    copy_dir(&src, &dir);
    let weights = dir.join("model.safetensors");
    // The check below can see a mapping: an open file is mapped.
    let open = rlx_models::safetensors::SafetensorsFile::open(&weights).unwrap_or_else(|e| panic!("{e}"));
    assert!(mapped(&weights), "an open SafetensorsFile is not seen in /proc/self/maps");
    drop(open);
    let embedder = SentenceEmbedder::load(&dir, Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    assert!(!mapped(&weights), "{} is still mapped after load", weights.display());
    let short = ["a short text", "another one"];
    let before = embedder.embed(&short).unwrap_or_else(|e| panic!("{e}"));

    truncate(&weights);
    let after = embedder.embed(&short).unwrap_or_else(|e| panic!("after truncation: {e}"));
    assert_eq!(before, after, "embeddings changed after the file was cut");
    // A longer text needs a shape bucket not prepared before the cut.
    let long = "word ".repeat(200);
    let v = embedder.embed(&[long.as_str()]).unwrap_or_else(|e| panic!("a new bucket after truncation: {e}"));
    let fresh = SentenceEmbedder::load(&src, Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let want = fresh.embed(&[long.as_str()]).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(v, want, "a bucket prepared after the cut differs from one of an intact file");
    // Loading the cut file is a clear error, not a fault.
    let e = SentenceEmbedder::load(&dir, Device::Cpu).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("model.safetensors"), "loading the cut file: {e:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_gguf_file_cut_after_loading_changes_nothing() {
    let Some(src) = common::smollm2::gguf("a_gguf_file_cut_after_loading_changes_nothing") else { return };
    let dir = scratch("gguf");
    let path = dir.join("model.gguf");
    std::fs::copy(&src, &path).unwrap_or_else(|e| panic!("{e}"));
    let open = rlx_models::gguf::GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(mapped(&path), "an open GgufFile is not seen in /proc/self/maps");
    drop(open);
    let opts = GeneratorOptions { ctx_size: 128, ..Default::default() };
    let mut g = Generator::load_with(&path, Device::Cpu, opts).unwrap_or_else(|e| panic!("{e}"));
    assert!(!mapped(&path), "{} is still mapped after load", path.display());
    let params = SamplingParams { max_tokens: 6, ignore_eos: true, ..SamplingParams::greedy() };
    let greedy = |g: &mut Generator| -> Vec<u32> {
        let ids = g.encode("The capital of France is").unwrap_or_else(|e| panic!("{e}"));
        g.generate_ids(&ids, &params).unwrap_or_else(|e| panic!("{e}")).map(|p| p.unwrap_or_else(|e| panic!("{e}")).token).collect()
    };
    let before = greedy(&mut g);
    truncate(&path);
    let after = greedy(&mut g);
    assert_eq!(before, after, "generation changed after the file was cut");
    let e = Generator::load_with(&path, Device::Cpu, GeneratorOptions::default()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("model.gguf"), "loading the cut file: {e:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
