//! CPU sentence-embedding benchmark: RLX vs ONNX Runtime (plain and
//! transformer-optimised) vs PyTorch eager, all-MiniLM-L6-v2, alternating
//! run by run in one process tree on the same thread count.
//!
//!   bash bench/setup-peers.sh    # once: torch, transformers, onnx, onnxruntime
//!   RAYON_NUM_THREADS=2 cargo bench -p rlx-models --bench embed
//!
//! Env: RLX_BENCH_ROUNDS (forward rounds, default 40), RLX_BENCH_E2E_ROUNDS
//! (end-to-end rounds, default 5), RLX_BENCH_THREADS (default: cores),
//! RLX_BENCH_PEERS=0 (RLX alone), RLX_BENCH_BF16=0 (no bf16-weight rows).
//! Without the peers it prints RLX's numbers alone.
//! Three views of the forward times: medians, fastest runs, and the median
//! of per-round ratios (each round runs every engine seconds apart, so the
//! VM's slow phases cancel within a pair).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use rlx::{DType, Device};
use rlx_models::{cosine, EmbedderOptions, SentenceEmbedder};
use serde_json::{json, Value};

const SHAPES: &[(usize, usize)] = &[(1, 16), (1, 128), (8, 128)];
const PEERS: &[&str] = &["ort", "ort_opt", "torch"];
/// Untimed gap before every timed run (RLX_BENCH_PAUSE_MS, default 50).
fn pause() -> std::time::Duration {
    std::time::Duration::from_millis(env_usize("RLX_BENCH_PAUSE_MS", 50) as u64)
}

/// The ids embed_peers.py's ids_for() makes: [CLS] … [SEP], the middle
/// spread over the vocabulary.
fn ids_for(batch: usize, seq: usize) -> Vec<Vec<u32>> {
    (0..batch)
        .map(|b| {
            (0..seq)
                .map(|s| match s {
                    0 => 101,
                    _ if s == seq - 1 => 102,
                    _ => 1000 + ((b * 7919 + s * 104729) % 28000) as u32,
                })
                .collect()
        })
        .collect()
}

struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn start(root: &Path, model: &Path, threads: usize) -> Result<(Peer, Value), String> {
        let mut child = Command::new("python3")
            .arg(root.join("bench/embed_peers.py"))
            .args(["--model", &model.display().to_string(), "--threads", &threads.to_string()])
            .args(["--corpus", &root.join("bench/embed-corpus.txt").display().to_string()])
            .env("OMP_NUM_THREADS", threads.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("python3: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut peer = Peer { child, stdin, stdout };
        let hello = peer.read()?;
        if hello.get("ready").is_none() {
            return Err(format!("peer did not start: {hello}"));
        }
        Ok((peer, hello))
    }

    fn read(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        self.stdout.read_line(&mut line).map_err(|e| e.to_string())?;
        if line.is_empty() {
            return Err("the peer exited (see its stderr above)".into());
        }
        serde_json::from_str(&line).map_err(|e| format!("{e}: {line}"))
    }

    fn ask(&mut self, req: Value) -> Result<Value, String> {
        writeln!(self.stdin, "{req}").map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        let v = self.read()?;
        if let Some(e) = v.get("error") {
            return Err(e.to_string());
        }
        Ok(v)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "{}", json!({"cmd": "quit"}));
        let _ = self.child.wait();
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn main() -> Result<(), String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let model = root.join("models/all-MiniLM-L6-v2");
    if !model.join("model.safetensors").is_file() {
        println!("embed bench: {} is missing; run scripts/fetch-models", model.display());
        return Ok(());
    }
    let rounds = env_usize("RLX_BENCH_ROUNDS", 40);
    let e2e_rounds = env_usize("RLX_BENCH_E2E_ROUNDS", 5);
    let threads = env_usize("RLX_BENCH_THREADS", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2));

    let load = |dtype| {
        SentenceEmbedder::load_with(&model, Device::Cpu, EmbedderOptions { dtype, batch_size: 32, ..EmbedderOptions::default() })
            .map_err(|e| e.to_string())
    };
    let mut engines: Vec<(&str, SentenceEmbedder)> = vec![("rlx", load(DType::F32)?)];
    if std::env::var("RLX_BENCH_BF16").map(|v| v != "0").unwrap_or(true) {
        engines.push(("rlx_bf16", load(DType::BF16)?));
    }

    let mut peer_engines: Vec<&str> = vec![];
    let want_peers = std::env::var("RLX_BENCH_PEERS").map(|v| v != "0").unwrap_or(true);
    let started = if want_peers { Peer::start(&root, &model, threads) } else { Err("RLX_BENCH_PEERS=0".to_string()) };
    let mut peer = match started {
        Ok((p, hello)) => {
            println!("peers: {} engines {}", hello["versions"], hello["engines"]);
            let offered: Vec<&str> = hello["engines"].as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
            peer_engines = PEERS.iter().copied().filter(|e| offered.contains(e)).collect();
            Some(p)
        }
        Err(e) => {
            println!("peers unavailable ({e}); run bash bench/setup-peers.sh. RLX alone:");
            None
        }
    };
    let names: Vec<&str> = engines.iter().map(|(n, _)| *n).chain(peer_engines.iter().copied()).collect();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_default();
    println!(
        "cpu {cpu:?}; threads {threads}, rlx-cpu on {} rayon threads; forward: median of {rounds} alternating runs after 3 warm-ups",
        rayon_threads()
    );

    let mut table: Vec<(String, Vec<f64>)> = vec![];
    let mut table_min: Vec<(String, Vec<f64>)> = vec![];
    let mut paired: Vec<(String, Vec<f64>)> = vec![];
    for &(b, s) in SHAPES {
        let ids = ids_for(b, s);
        let mut times: Vec<Vec<f64>> = vec![vec![]; names.len()];
        let mut row0: Vec<Option<Vec<f32>>> = vec![None; names.len()];
        for round in 0..rounds + 3 {
            // Rotate the order so no engine always runs right after another.
            for k in 0..names.len() {
                let i = (k + round) % names.len();
                // Let the previous engine's worker threads stop spinning
                // (ORT's pool and OpenMP spin-wait after a call) so they do
                // not steal the cores from the next one.
                std::thread::sleep(pause());
                let (ms, v) = if i < engines.len() {
                    let t = Instant::now();
                    let out = engines[i].1.embed_ids(&ids).map_err(|e| e.to_string())?;
                    (t.elapsed().as_secs_f64() * 1e3, out.into_iter().next().unwrap_or_default())
                } else {
                    let p = peer.as_mut().ok_or("no peer")?;
                    let r = p.ask(json!({"cmd": "fwd", "engine": names[i], "batch": b, "seq": s}))?;
                    let v =
                        r["row0"].as_array().map(|a| a.iter().filter_map(Value::as_f64).map(|x| x as f32).collect()).unwrap_or_default();
                    (r["ms"].as_f64().unwrap_or(f64::NAN), v)
                };
                if round >= 3 {
                    times[i].push(ms);
                }
                row0[i].get_or_insert(v);
            }
        }
        for (i, n) in names.iter().enumerate().skip(1) {
            if let (Some(a), Some(x)) = (&row0[0], &row0[i]) {
                let d = a.iter().zip(x).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
                let c = cosine(a, x);
                let flag = if c < 0.9999 { "  <-- WRONG: outputs differ" } else { "" };
                println!("  {b}x{s}: {n} vs rlx f32: cosine {c:.7}, max abs diff {d:.2e}{flag}");
                if std::env::var_os("RLX_BENCH_DEBUG").is_some() {
                    println!("    rlx {:?}\n    {n} {:?}", &a[..4.min(a.len())], &x[..4.min(x.len())]);
                }
            }
        }
        // Per round, RLX f32 over each engine (runs seconds apart, order
        // rotated): the VM's minute-long slow phases cancel in each pair.
        paired.push((
            format!("{b}×{s}"),
            (0..names.len())
                .map(|j| {
                    let mut r: Vec<f64> = times[0].iter().zip(&times[j]).map(|(a, x)| a / x).collect();
                    median(&mut r)
                })
                .collect(),
        ));
        table.push((format!("{b}×{s}"), times.iter_mut().map(|t| median(t)).collect()));
        // The fastest run: what each engine does when nothing else competes
        // for the cores (the median also carries the machine's noise).
        table_min.push((format!("{b}×{s}"), times.iter().map(|t| t.iter().copied().fold(f64::INFINITY, f64::min)).collect()));
    }

    // End to end: 1,000 texts, tokenisation included.
    let corpus_text = std::fs::read_to_string(root.join("bench/embed-corpus.txt")).map_err(|e| e.to_string())?;
    let corpus: Vec<&str> = corpus_text.lines().collect();
    let mut tps: Vec<Vec<f64>> = vec![vec![]; names.len()];
    for round in 0..e2e_rounds + 1 {
        for k in 0..names.len() {
            let i = (k + round) % names.len();
            std::thread::sleep(pause());
            let secs = if i < engines.len() {
                let t = Instant::now();
                let out = engines[i].1.embed(&corpus).map_err(|e| e.to_string())?;
                assert_eq!(out.len(), corpus.len());
                t.elapsed().as_secs_f64()
            } else {
                let p = peer.as_mut().ok_or("no peer")?;
                p.ask(json!({"cmd": "e2e", "engine": names[i]}))?["seconds"].as_f64().unwrap_or(f64::NAN)
            };
            if round >= 1 {
                tps[i].push(corpus.len() as f64 / secs);
            }
        }
    }
    let e2e: Vec<f64> = tps.iter_mut().map(|t| median(t)).collect();
    let e2e_best: Vec<f64> = tps.iter().map(|t| t.iter().copied().fold(0.0, f64::max)).collect();

    println!();
    let label = |n: &str| match n {
        "rlx" => "RLX f32",
        "rlx_bf16" => "RLX bf16 weights",
        "ort" => "ORT (ENABLE_ALL)",
        "ort_opt" => "ORT optimised",
        "torch" => "PyTorch eager",
        _ => "?",
    };
    let print_table = |what: &str, rows: &[(String, Vec<f64>)], e2e_what: &str, e2e: &[f64]| {
        print!("| forward, ms ({what}) |");
        for n in &names {
            print!(" {} |", label(n));
        }
        // RLX f32 against every peer; bf16 weights against ORT when both ran
        // (RLX_BENCH_BF16=0 or no peers leave either out).
        let ratio_cols: Vec<usize> = (0..names.len()).filter(|&j| !names[j].starts_with("rlx")).collect();
        let pos = |n: &str| names.iter().position(|x| *x == n);
        let bf16_ort = pos("rlx_bf16").zip(pos("ort"));
        for &j in &ratio_cols {
            print!(" RLX / {} |", label(names[j]));
        }
        if bf16_ort.is_some() {
            print!(" bf16 / ORT |");
        }
        println!();
        println!("|---|{}", "---|".repeat(names.len() + ratio_cols.len() + bf16_ort.is_some() as usize));
        for (shape, t) in rows {
            print!("| {shape} |");
            for x in t {
                print!(" {x:.2} |");
            }
            for &j in &ratio_cols {
                print!(" {:.2}× |", t[0] / t[j]);
            }
            if let Some((b, o)) = bf16_ort {
                print!(" {:.2}× |", t[b] / t[o]);
            }
            println!();
        }
        print!("| end to end, texts/s ({e2e_what}) |");
        for x in e2e {
            print!(" {x:.0} |");
        }
        for &j in &ratio_cols {
            // Throughput: a ratio below 1 means RLX takes less time per text.
            print!(" {:.2}× |", e2e[j] / e2e[0]);
        }
        if let Some((b, o)) = bf16_ort {
            print!(" {:.2}× |", e2e[o] / e2e[b]);
        }
        println!();
    };
    print_table(&format!("median of {rounds}"), &table, &format!("median of {e2e_rounds}"), &e2e);
    println!();
    print_table(&format!("fastest of {rounds}"), &table_min, &format!("best of {e2e_rounds}"), &e2e_best);
    println!();
    print!("| forward: median over rounds of the round's RLX f32 / engine ratio |");
    for n in names.iter().skip(1) {
        print!(" RLX / {} |", label(n));
    }
    println!("\n|---|{}", "---|".repeat(names.len() - 1));
    for (shape, r) in &paired {
        print!("| {shape} |");
        for x in r.iter().skip(1) {
            print!(" {x:.2}× |");
        }
        println!();
    }
    println!("\nRatios are RLX time / peer time (end to end: peer texts/s over RLX texts/s); below 1 is RLX faster.");
    Ok(())
}

fn rayon_threads() -> String {
    std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into())
}
