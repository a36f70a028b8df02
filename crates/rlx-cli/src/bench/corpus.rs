//! `rlx bench --corpus FILE`: how much of the device's forward capacity
//! `rlx embed` delivers on a real corpus. Two figures over the same lines,
//! the same model and the same bucket mix, in one run:
//! - forward only: the corpus tokenised beforehand (not timed), then
//!   `SentenceEmbedder::embed_ids` over all of it (batching, padding, the
//!   device, vectors back on the host), after an untimed pass that compiles
//!   every bucket;
//! - end to end: `rlx embed --input FILE --output TMP.npy` as a child
//!   process (reading, tokenising, embedding, writing, model load
//!   included), timed from spawn to exit.

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use rlx_models::TextLines;

use crate::embed::ModelArgs;

pub struct CorpusBench {
    pub corpus: PathBuf,
    pub model: ModelArgs,
}

pub fn run(b: &CorpusBench) -> Result<(), String> {
    let file = File::open(&b.corpus).map_err(|e| format!("--corpus {}: {e}", b.corpus.display()))?;
    let mut lines = TextLines::new(BufReader::new(file), b.corpus.display().to_string());
    let mut texts = Vec::new();
    loop {
        let round = lines.next_batch_within(4096, 64 << 20).map_err(|e| e.to_string())?;
        if round.is_empty() {
            break;
        }
        texts.extend(round);
    }
    if texts.is_empty() {
        return Err(format!("--corpus {}: no lines to embed", b.corpus.display()));
    }
    let t0 = Instant::now();
    let embedder = crate::embed::load(&b.model)?;
    let load_s = t0.elapsed().as_secs_f64();
    let refs: Vec<&str> = texts.iter().map(|t| t.as_str()).collect();
    let t0 = Instant::now();
    let (ids, _) = embedder.tokenize_counting(&refs).map_err(|e| e.to_string())?;
    let tok_s = t0.elapsed().as_secs_f64();
    eprintln!("{} lines tokenised in {tok_s:.2} s; compiling every bucket (untimed pass)...", texts.len());
    let t0 = Instant::now();
    embedder.embed_ids(&ids).map_err(|e| e.to_string())?;
    let first_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    embedder.embed_ids(&ids).map_err(|e| e.to_string())?;
    let fwd_s = t0.elapsed().as_secs_f64();
    let fwd = texts.len() as f64 / fwd_s;
    drop(embedder);

    let out = std::env::temp_dir().join(format!("rlx-bench-corpus-{}.npy", std::process::id()));
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the rlx executable: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.arg("embed").arg("--input").arg(&b.corpus).arg("--output").arg(&out);
    cmd.args(["--device", &b.model.device, "--dtype", &b.model.dtype, "--batch-size", &b.model.batch_size.to_string()]);
    if let Some(m) = &b.model.model {
        cmd.arg("--model").arg(m);
    }
    let t0 = Instant::now();
    let o = cmd.output().map_err(|e| format!("cannot run rlx embed: {e}"))?;
    let e2e_s = t0.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&out);
    if !o.status.success() {
        return Err(format!("rlx embed failed: {}", String::from_utf8_lossy(&o.stderr).trim()));
    }
    let e2e = texts.len() as f64 / e2e_s;
    let summary = String::from_utf8_lossy(&o.stderr).lines().rfind(|l| l.starts_with("embedded")).unwrap_or("").to_string();
    let md = format!(
        "| measurement | texts/s | seconds |\n|---|---:|---:|\n\
         | forward only (pre-tokenised, `embed_ids`) | {fwd:.0} | {fwd_s:.2} |\n\
         | `rlx embed --input … --output ….npy` (process start to exit) | {e2e:.0} | {e2e_s:.2} |\n\n\
         {} lines, device {}, dtype {}, batch {}. End to end / forward only: {:.2}. \
         In this process: model load {load_s:.2} s, tokenising every line at once {tok_s:.2} s, \
         the first forward pass over every line (compiling each bucket it meets) {first_s:.2} s. \
         rlx embed's own summary: {summary}\n",
        texts.len(),
        b.model.device,
        b.model.dtype,
        b.model.batch_size,
        e2e / fwd
    );
    crate::stdout::print(&md)
}
