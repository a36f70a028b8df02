//! The PyTorch side of `rlx bench`: writes the jobs file, runs
//! bench/gpu_peer.py once for all jobs, reads its JSON lines and its hidden
//! states, and compares them with RLX's outputs. How a peer script is run
//! and when it counts as unavailable (`run_script`, `ScriptExit`) is shared
//! with the generation benchmark's peer.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Value};

/// One configuration for the peer to run (see the peer script's docstring).
#[derive(Debug, Clone)]
pub struct PeerJob {
    pub id: String,
    pub model_dir: PathBuf,
    pub dtype: String,
    pub batch: usize,
    pub seq: usize,
    pub ids: PathBuf,
    pub mask: PathBuf,
    pub hidden_out: PathBuf,
}

/// What the peer reported for one job.
#[derive(Debug, Clone, Default)]
pub struct PeerResult {
    pub eager_us: Option<f64>,
    pub graph_us: Option<f64>,
    /// The eager last hidden state, f32 [batch, seq, hidden], if written.
    pub hidden: Option<PathBuf>,
    pub notes: Vec<String>,
}

#[derive(Debug)]
pub enum PeerOutcome {
    /// No peer could run at all (python, torch or the GPU missing).
    Unavailable(String),
    Ran {
        /// "torch X, transformers Y on DEVICE".
        versions: String,
        results: HashMap<String, PeerResult>,
        /// Problems outside any one job (a crash, a bad line).
        notes: Vec<String>,
    },
}

pub struct PeerCommand<'a> {
    pub python: &'a str,
    pub script: &'a Path,
    pub runs: usize,
    pub warmup: usize,
    /// "cuda" or "cpu".
    pub device: &'a str,
}

/// How a peer script ended.
pub struct ScriptExit {
    pub code: Option<i32>,
    /// The exit status in words, for messages.
    pub status: String,
}

impl ScriptExit {
    /// Why the peer counts as not run at all, if it does: exit status 3 is
    /// a peer script's "cannot run here" (no torch, no GPU); any other
    /// failure with no result is one too. `said`: what the peer reported
    /// besides results (its `{"error"}` lines first of all).
    pub fn unavailable(&self, any_result: bool, said: &[String]) -> Option<String> {
        (self.code == Some(3) || (!any_result && self.code != Some(0))).then(|| {
            if said.is_empty() {
                format!("the peer exited with {} and reported nothing", self.status)
            } else {
                said.join("; ")
            }
        })
    }
}

/// Runs `python script args...` with the hub offline, hands each stdout
/// line to `on_line` as it arrives (stderr passes through), and waits. An
/// error when the script is missing or python cannot start.
pub fn run_script(python: &str, script: &Path, args: &[String], mut on_line: impl FnMut(&str)) -> Result<ScriptExit, String> {
    if !script.is_file() {
        return Err(format!("peer script {} not found (run from the repository root or pass --peer-script)", script.display()));
    }
    let mut child = Command::new(python)
        .arg(script)
        .args(args)
        // The GPU machine has no network: never let transformers try the hub.
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start '{python}': {e}"))?;
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            on_line(&line);
        }
    }
    let status = child.wait();
    Ok(ScriptExit { code: status.as_ref().ok().and_then(|s| s.code()), status: format!("{status:?}") })
}

/// Runs the peer on `jobs`, writing the jobs file into `dir`. Progress lines
/// go to stderr as results arrive; the peer's own stderr passes through.
pub fn run(cmd: &PeerCommand, jobs: &[PeerJob], dir: &Path) -> PeerOutcome {
    let list: Vec<Value> = jobs
        .iter()
        .map(|j| {
            json!({
                "id": j.id, "model_dir": j.model_dir, "dtype": j.dtype, "batch": j.batch, "seq": j.seq,
                "ids": j.ids, "mask": j.mask, "hidden_out": j.hidden_out,
            })
        })
        .collect();
    let jobs_path = dir.join("jobs.json");
    if let Err(e) = std::fs::write(&jobs_path, Value::Array(list).to_string()) {
        return PeerOutcome::Unavailable(format!("cannot write {}: {e}", jobs_path.display()));
    }
    let mut results = HashMap::new();
    let mut notes = Vec::new();
    let mut versions = String::new();
    let args = [
        jobs_path.display().to_string(),
        "--runs".into(),
        cmd.runs.to_string(),
        "--warmup".into(),
        cmd.warmup.to_string(),
        "--device".into(),
        cmd.device.into(),
    ];
    let exit = run_script(cmd.python, cmd.script, &args, |line| match parse_line(line) {
        Line::Fatal(msg) => notes.push(msg),
        Line::Job { id, result, version } => {
            eprintln!("peer: {id}: eager {} µs, graph {} µs", fmt_opt(result.eager_us), fmt_opt(result.graph_us));
            if versions.is_empty() {
                versions = version;
            }
            results.insert(id, result);
        }
        Line::Other(l) => notes.push(format!("unexpected peer output: {l}")),
    });
    let exit = match exit {
        Ok(e) => e,
        Err(e) => return PeerOutcome::Unavailable(e),
    };
    if let Some(why) = exit.unavailable(!results.is_empty(), &notes) {
        return PeerOutcome::Unavailable(why);
    }
    if exit.code != Some(0) {
        notes.push(format!("the peer exited with {}; configurations without a result were not measured", exit.status));
    }
    PeerOutcome::Ran { versions, results, notes }
}

fn fmt_opt(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "—".into())
}

enum Line {
    Fatal(String),
    Job { id: String, result: PeerResult, version: String },
    Other(String),
}

fn parse_line(line: &str) -> Line {
    let Ok(v) = serde_json::from_str::<Value>(line) else {
        return Line::Other(line.chars().take(200).collect());
    };
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    let Some(id) = s("id") else {
        return match s("error") {
            Some(e) => Line::Fatal(e),
            None => Line::Other(line.chars().take(200).collect()),
        };
    };
    let loaded = v.get("graph_us").and_then(Value::as_f64);
    let plain = v.get("plain_graph_us").and_then(Value::as_f64);
    let mut r = PeerResult {
        eager_us: v.get("eager_us").and_then(Value::as_f64),
        // The faster of the two captures (see gpu_peer.py).
        graph_us: match (loaded, plain) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        },
        ..Default::default()
    };
    if let (Some(a), Some(b)) = (loaded, plain) {
        r.notes.push(format!(
            "PyTorch CUDA graph: {a:.1} µs for the loaded model, {b:.1} µs for a plain BertModel(config) of the same shapes; the table shows the faster"
        ));
    }
    if let Some(e) = s("plain_graph_error") {
        r.notes.push(format!("PyTorch CUDA graph of a plain BertModel(config): {e}"));
    }
    r.hidden = s("hidden_out").map(PathBuf::from);
    if let Some(e) = s("error") {
        r.notes.push(format!("PyTorch failed: {e}"));
    }
    if let Some(e) = s("graph_error") {
        r.notes.push(format!("PyTorch CUDA graph: {e}"));
    }
    if let Some(form) = s("graph_mask") {
        let diff = v.get("graph_vs_eager_max_abs").and_then(Value::as_f64).map(|d| format!("{d:.1e}")).unwrap_or_else(|| "?".into());
        let forms = v
            .get("graph_mask_us")
            .and_then(Value::as_object)
            .map(|m| m.iter().filter_map(|(k, t)| t.as_f64().map(|t| format!("{k} {t:.1} µs"))).collect::<Vec<_>>().join(", "))
            .unwrap_or_default();
        r.notes.push(format!(
            "PyTorch CUDA graph: the fastest mask form was {form} (max abs diff to its eager output {diff}; forms timed: {forms})"
        ));
    }
    let version = format!(
        "torch {}, transformers {} on {}",
        s("torch").unwrap_or_else(|| "?".into()),
        s("transformers").unwrap_or_else(|| "?".into()),
        s("device").unwrap_or_else(|| "?".into())
    );
    Line::Job { id, result: r, version }
}

pub fn write_i64(path: &Path, values: &[i64]) -> Result<(), String> {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// A file of little-endian f32 values; its length must be exactly `count`.
pub fn read_f32(path: &Path, count: usize) -> Result<Vec<f32>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() != count * 4 {
        return Err(format!("{}: expected {count} f32 values ({} bytes), found {} bytes", path.display(), count * 4, bytes.len()));
    }
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// Max abs difference between RLX's pooled output `[batch, hidden]` and
/// PyTorch's last hidden state mean-pooled over the mask (L2-normalised too
/// when `normalized`), with the largest magnitude of the latter.
pub fn compare_pooled(
    rlx: &[f32],
    torch_hidden: &[f32],
    batch: usize,
    seq: usize,
    mask: &[i64],
    normalized: bool,
) -> Result<(f64, f64), String> {
    let bs = batch * seq;
    if bs == 0 || mask.len() != bs || torch_hidden.len() != bs * (torch_hidden.len() / bs) {
        return Err(format!(
            "PyTorch hidden state of {} values does not fit batch {batch} × seq {seq} (mask {})",
            torch_hidden.len(),
            mask.len()
        ));
    }
    let h = torch_hidden.len() / bs;
    if rlx.len() != batch * h {
        return Err(format!("RLX output has {} values, expected batch {batch} × hidden {h}", rlx.len()));
    }
    let (mut max_diff, mut scale) = (0f64, 0f64);
    for b in 0..batch {
        let mut v = vec![0f64; h];
        let kept: Vec<usize> = (0..seq).filter(|&s| mask[b * seq + s] != 0).collect();
        for &s in &kept {
            for (i, x) in v.iter_mut().enumerate() {
                *x += f64::from(torch_hidden[(b * seq + s) * h + i]);
            }
        }
        let n = kept.len().max(1) as f64;
        v.iter_mut().for_each(|x| *x /= n);
        if normalized {
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
            v.iter_mut().for_each(|x| *x /= norm);
        }
        for (i, x) in v.iter().enumerate() {
            let d = (f64::from(rlx[b * h + i]) - x).abs();
            // f64::max drops NaN; a NaN anywhere must show.
            max_diff = if d.is_nan() || max_diff.is_nan() { f64::NAN } else { max_diff.max(d) };
            scale = scale.max(x.abs());
        }
    }
    Ok((max_diff, scale))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooled_comparison_means_over_the_mask_then_normalises() {
        // batch 2, seq 2, hidden 2; row 1's position 1 is padding with wild values.
        let torch = [3.0, 0.0, 1.0, 4.0, /* row 1 */ 0.0, 2.0, 90.0, 90.0];
        let mask = [1, 1, 1, 0];
        // Row 0 mean (2, 2); row 1 mean (0, 2).
        let rlx = [2.0, 2.0, 0.0, 2.25];
        let (d, s) = compare_pooled(&rlx, &torch, 2, 2, &mask, false).unwrap_or((f64::NAN, 0.0));
        assert!((d - 0.25).abs() < 1e-12 && (s - 2.0).abs() < 1e-12, "{d} {s}");
        let r = 0.5f32.sqrt();
        let (d, _) = compare_pooled(&[r, r, 0.0, 1.0], &torch, 2, 2, &mask, true).unwrap_or((f64::NAN, 0.0));
        assert!(d < 1e-7, "{d}");
        let (d, _) = compare_pooled(&[f32::NAN, 2.0, 0.0, 2.0], &torch, 2, 2, &mask, false).unwrap_or((0.0, 0.0));
        assert!(d.is_nan(), "a NaN output must not hide behind max: {d}");
    }

    #[test]
    fn mismatched_sizes_are_errors() {
        assert!(compare_pooled(&[0.0; 3], &[0.0; 4], 1, 2, &[1, 1], false).is_err());
        assert!(compare_pooled(&[0.0; 2], &[0.0; 5], 1, 2, &[1, 1], false).is_err());
        assert!(compare_pooled(&[0.0; 2], &[0.0; 4], 1, 2, &[1], false).is_err());
    }

    /// Runs `run` with `sh` standing in for python and a script body.
    fn run_fake(name: &str, body: &str) -> PeerOutcome {
        let dir = std::env::temp_dir().join(format!("rlx-bench-peer-{name}-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let script = dir.join("peer.sh");
        let _ = std::fs::write(&script, body);
        let cmd = PeerCommand { python: "sh", script: &script, runs: 3, warmup: 1, device: "cpu" };
        let job = PeerJob {
            id: "j1".into(),
            model_dir: dir.clone(),
            dtype: "f32".into(),
            batch: 1,
            seq: 2,
            ids: dir.join("ids"),
            mask: dir.join("mask"),
            hidden_out: dir.join("h"),
        };
        let out = run(&cmd, &[job], &dir);
        let _ = std::fs::remove_dir_all(&dir);
        out
    }

    #[test]
    fn a_peer_without_torch_is_reported_unavailable() {
        let out = run_fake("notorch", "echo '{\"error\": \"python peer unavailable: cannot import torch\"}'; exit 3\n");
        match out {
            PeerOutcome::Unavailable(m) => assert!(m.contains("cannot import torch"), "{m}"),
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }

    #[test]
    fn a_peer_that_runs_reports_per_job_and_crashes_become_notes() {
        // The jobs file path arrives as $1 and must exist.
        let body = "test -f \"$1\" || exit 9\necho 'warming up'\necho '{\"id\": \"j1\", \"eager_us\": 10.0, \"graph_us\": 2.0, \"torch\": \"t\", \"transformers\": \"x\", \"device\": \"cpu\"}'\nexit 1\n";
        match run_fake("runs", body) {
            PeerOutcome::Ran { versions, results, notes } => {
                assert_eq!(versions, "torch t, transformers x on cpu");
                assert_eq!(results.get("j1").map(|r| (r.eager_us, r.graph_us)), Some((Some(10.0), Some(2.0))));
                assert!(notes.iter().any(|n| n.contains("warming up")), "{notes:?}");
                assert!(notes.iter().any(|n| n.contains("exited")), "{notes:?}");
            }
            other => panic!("expected Ran, got {other:?}"),
        }
        assert!(matches!(run_fake("nostart", "exit 9\n"), PeerOutcome::Unavailable(_)));
    }

    #[test]
    fn the_faster_of_the_two_captures_is_the_peers_figure() {
        let line = r#"{"id": "j", "eager_us": 900.0, "graph_us": 456.0, "plain_graph_us": 333.0, "graph_mask": "2d", "graph_mask_us": {"2d": 456.0, "none (no padding)": 700.0}, "torch": "t", "transformers": "x", "device": "d"}"#;
        let Line::Job { result, .. } = parse_line(line) else { panic!("a job line") };
        assert_eq!(result.graph_us, Some(333.0));
        assert!(result.notes.iter().any(|n| n.contains("456.0") && n.contains("333.0")), "{:?}", result.notes);
        assert!(result.notes.iter().any(|n| n.contains("fastest mask form was 2d") && n.contains("700.0")), "{:?}", result.notes);
        let line = r#"{"id": "j", "graph_us": null, "plain_graph_us": 333.0}"#;
        let Line::Job { result, .. } = parse_line(line) else { panic!("a job line") };
        assert_eq!(result.graph_us, Some(333.0));
        let line = r#"{"id": "j", "graph_us": 300.0, "plain_graph_us": null, "plain_graph_error": "capture failed"}"#;
        let Line::Job { result, .. } = parse_line(line) else { panic!("a job line") };
        assert_eq!(result.graph_us, Some(300.0));
        assert!(result.notes.iter().any(|n| n.contains("capture failed")), "{:?}", result.notes);
    }

    #[test]
    fn f32_files_round_trip_and_lengths_are_checked() {
        let dir = std::env::temp_dir().join(format!("rlx-bench-peer-test-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let p = dir.join("x.bin");
        let vals = [1.5f32, -2.25, 3.0];
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let _ = std::fs::write(&p, bytes);
        assert_eq!(read_f32(&p, 3).ok(), Some(vals.to_vec()));
        assert!(read_f32(&p, 4).is_err());
        let q = dir.join("i.bin");
        assert!(write_i64(&q, &[7, -1]).is_ok());
        assert_eq!(std::fs::read(&q).map(|b| b.len()).unwrap_or(0), 16);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
