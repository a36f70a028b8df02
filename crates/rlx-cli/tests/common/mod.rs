//! Shared by the CLI's integration tests: running the built binary, temp
//! directories, and where the real model is (and whether its absence is a
//! skip or a failure).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The `rlx` binary with no model directory from the environment.
pub fn rlx_command() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_rlx"));
    c.env_remove("RLX_MODEL_DIR");
    c
}

pub fn rlx(args: &[&str]) -> Output {
    rlx_command().args(args).output().unwrap_or_else(|e| panic!("cannot run rlx: {e}"))
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rlx-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    d
}

/// models/all-MiniLM-L6-v2 when present. Absent: the test prints the skip
/// marker and returns, unless RLX_REQUIRE_MODELS=1 (CI), where it fails.
pub fn model_dir(test: &str) -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/all-MiniLM-L6-v2");
    if dir.join("model.safetensors").is_file() && dir.join("tokenizer.json").is_file() {
        return Some(dir);
    }
    if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{test}: {} is missing and RLX_REQUIRE_MODELS=1: run scripts/fetch-models", dir.display());
    }
    eprintln!("SKIPPED {test}: {} is missing (run scripts/fetch-models)", dir.display());
    None
}

pub fn path_str(p: &Path) -> &str {
    p.to_str().unwrap_or_else(|| panic!("non-UTF-8 temp path {}", p.display()))
}
