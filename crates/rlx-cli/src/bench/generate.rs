//! `rlx bench --model smollm2`: text generation speed of a GGUF decoder
//! (prefill of a prompt, decode at batch 1, aggregate decode of a batch),
//! with llama.cpp's own benchmark tools run on the same file in the same
//! run when `--llama-cpp DIR` names them, PyTorch on the same shapes with
//! `--torch` (see generate_peer.rs), and the ratios printed.
//!
//! Prompts are seeded random token ids (speed does not depend on them), so
//! no prompt is served from the prefix cache; every sequence runs to its
//! token count (end-of-sequence ignored), greedy.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use rlx::Device;
use rlx_models::{Generator, GeneratorOptions, SamplingParams};

use super::generate_chart::{Chart, ChartRow};
use super::generate_peer::{self, Measure, TorchCommand, TorchRun};

/// What one generation benchmark measures.
pub struct GenBench<'a> {
    pub gguf: PathBuf,
    pub device: Device,
    pub device_name: &'a str,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Batched decode: tokens per sequence (llama-batched-bench's -ntg).
    pub batch_tokens: usize,
    pub batches: Vec<usize>,
    pub runs: usize,
    pub seed: u64,
    pub llama_cpp: Option<PathBuf>,
    pub threads: usize,
    /// The KV cache's dtype (None: the device's default).
    pub kv_dtype: Option<rlx::DType>,
    /// Run the PyTorch peer (`--torch`).
    pub torch: Option<TorchPeer<'a>>,
}

/// Where the PyTorch peer is: the interpreter and bench/torch_decode_peer.py.
pub struct TorchPeer<'a> {
    pub python: &'a str,
    pub script: PathBuf,
}

/// The benchmark's results: the markdown report and the chart's data.
pub struct Report {
    pub markdown: String,
    pub chart: Chart,
}

/// One measured figure in tok/s: RLX's and each peer's (or why there is none).
struct Line {
    what: String,
    /// The chart's shorter label.
    short: String,
    rlx: Result<f64, String>,
    llama: Result<f64, String>,
    torch: Result<f64, String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// splitmix64: seeded prompt ids without a random-number crate.
struct Ids(u64);

impl Ids {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

fn random_prompt(rng: &mut Ids, vocab: usize, n: usize) -> Vec<u32> {
    // Ids from 1000 up skip the special and byte tokens at the start of
    // BPE vocabularies.
    let lo = 1000.min(vocab.saturating_sub(1)) as u64;
    let span = (vocab as u64).saturating_sub(lo).max(1);
    (0..n).map(|_| (lo + rng.next() % span) as u32).collect()
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::greedy() }
}

/// Prefill tok/s and batch-1 decode tok/s, medians of `runs`.
/// Batch 1: (prefill tok/s, decode tok/s, host µs per decode step, load s).
fn single(b: &GenBench) -> Result<(f64, f64, f64, f64), String> {
    let bucket = b.prompt_tokens.next_power_of_two();
    let ctx = (b.prompt_tokens + b.new_tokens + bucket + 16).next_power_of_two();
    let buckets = vec![bucket];
    let opts = GeneratorOptions { ctx_size: ctx, prefill_buckets: buckets, kv_dtype: b.kv_dtype, ..Default::default() };
    let t0 = Instant::now();
    let mut g = Generator::load_with(&b.gguf, b.device, opts).map_err(|e| format!("load {}: {e}", b.gguf.display()))?;
    let load_s = t0.elapsed().as_secs_f64();
    let vocab = g.config().vocab;
    let mut rng = Ids(b.seed);
    let (mut pre, mut dec, mut host) = (vec![], vec![], vec![]);
    // One untimed warm-up run, then the timed ones.
    for run in 0..=b.runs {
        let prompt = random_prompt(&mut rng, vocab, b.prompt_tokens);
        let mut gen = g.generate_ids(&prompt, &params(b.new_tokens)).map_err(|e| e.to_string())?;
        for piece in gen.by_ref() {
            piece.map_err(|e| e.to_string())?;
        }
        let st = gen.stats().clone();
        if st.cached_tokens > 0 {
            return Err(format!("{} prompt tokens came from the cache; the benchmark needs cold prompts", st.cached_tokens));
        }
        if run > 0 {
            pre.push(st.prefill_tok_s());
            dec.push(st.decode_tok_s());
            host.push(st.host_us_per_step());
        }
    }
    Ok((median(pre), median(dec), median(host), load_s))
}

/// Aggregate prefill tok/s of `batch` prompts admitted together
/// (`Generator::add_sequences`: side by side where its cost model says so)
/// and aggregate decode tok/s of the `batch` sequences decoding together
/// after that, medians of `runs`.
fn batched(b: &GenBench, batch: usize) -> Result<(f64, f64, bool), String> {
    // Room for one more prefill chunk past every sequence: a slot is
    // prefilled while the others hold their tokens.
    let bucket = b.prompt_tokens.next_power_of_two();
    let ctx = (b.prompt_tokens + b.batch_tokens + bucket + 16).next_power_of_two();
    let buckets = vec![bucket];
    let opts = GeneratorOptions { ctx_size: ctx, prefill_buckets: buckets, batch, kv_dtype: b.kv_dtype, ..Default::default() };
    let mut g = Generator::load_with(&b.gguf, b.device, opts).map_err(|e| format!("load {}: {e}", b.gguf.display()))?;
    let vocab = g.config().vocab;
    let mut rng = Ids(b.seed ^ batch as u64);
    let (mut pre, mut dec) = (vec![], vec![]);
    for run in 0..=b.runs.min(3) {
        let prompts: Vec<(Vec<u32>, SamplingParams)> =
            (0..batch).map(|_| (random_prompt(&mut rng, vocab, b.prompt_tokens), params(b.batch_tokens))).collect();
        let t0 = Instant::now();
        for r in g.add_sequences(&prompts) {
            r.map_err(|e| e.to_string())?;
        }
        let prefill_s = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let mut tokens = 0usize;
        while g.active_sequences() > 0 {
            tokens += g.step_batch().map_err(|e| e.to_string())?.len();
        }
        if run > 0 {
            pre.push((batch * b.prompt_tokens) as f64 / prefill_s);
            dec.push(tokens as f64 / t0.elapsed().as_secs_f64());
        }
    }
    // Whether the prompts went side by side (else one at a time).
    let joint = !g.joint_prefill_chunks().is_empty();
    Ok((median(pre), median(dec), joint))
}

/// llama-bench's prefill and decode tok/s on the same file: the faster of
/// flash attention off and on (CUDA graphs are on by default). Two runs:
/// the prompt's prefill from an empty context, then decode at a depth of
/// the prompt's length (`-d`), as RLX's decode follows its prompt (by
/// default llama-bench decodes from an empty context, with less attention
/// work a token).
fn llama_bench(b: &GenBench, dir: &Path) -> Result<(f64, f64, String), String> {
    let exe = dir.join("llama-bench");
    let run = |args: &[String]| -> Result<Vec<serde_json::Value>, String> {
        let mut cmd = Command::new(&exe);
        cmd.arg("-m").arg(&b.gguf).args(args);
        cmd.args(["-r", &b.runs.max(2).to_string(), "-fa", "0,1", "-o", "json"]);
        let out = run_peer(b, &exe, cmd)?;
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| format!("llama-bench output is not the JSON expected: {e}"))?;
        v.as_array().cloned().ok_or_else(|| "llama-bench JSON: expected an array of results".to_string())
    };
    let s = |n: usize| n.to_string();
    let pre = run(&["-p".into(), s(b.prompt_tokens), "-n".into(), "0".into()])?;
    let dec = run(&["-p".into(), "0".into(), "-n".into(), s(b.new_tokens), "-d".into(), s(b.prompt_tokens)])?;
    let best = |rows: &[serde_json::Value]| rows.iter().map(|r| r["avg_ts"].as_f64().unwrap_or(0.0)).fold(0.0, f64::max);
    let (pp, tg) = (best(&pre), best(&dec));
    let build = pre.iter().chain(&dec).find_map(|r| r["build_commit"].as_str()).unwrap_or_default().to_string();
    if pp == 0.0 || tg == 0.0 {
        return Err("llama-bench reported no prefill or no decode result".into());
    }
    Ok((pp, tg, build))
}

/// llama-batched-bench's aggregate prefill and decode tok/s per batch size
/// (flash attention on; CUDA graphs on by default).
fn llama_batched(b: &GenBench, dir: &Path) -> Result<Vec<(usize, f64, f64)>, String> {
    let exe = dir.join("llama-batched-bench");
    let max_b = b.batches.iter().copied().max().unwrap_or(1);
    let ctx = max_b * (b.prompt_tokens + b.batch_tokens) + 64;
    let pl: Vec<String> = b.batches.iter().map(|x| x.to_string()).collect();
    let mut cmd = Command::new(&exe);
    cmd.arg("-m").arg(&b.gguf).args(["-c", &ctx.to_string(), "-npp", &b.prompt_tokens.to_string()]);
    cmd.args(["-ntg", &b.batch_tokens.to_string(), "-npl", &pl.join(","), "-fa", "on", "--output-format", "jsonl"]);
    let out = run_peer(b, &exe, cmd)?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut res = vec![];
    for line in text.lines().filter(|l| l.trim_start().starts_with('{')) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("llama-batched-bench line {line:?}: {e}"))?;
        if let (Some(pl), Some(pp), Some(tg)) = (v["pl"].as_u64(), v["speed_pp"].as_f64(), v["speed_tg"].as_f64()) {
            res.push((pl as usize, pp, tg));
        }
    }
    if res.is_empty() {
        return Err(format!("llama-batched-bench printed no results: {}", tail(&out.stderr)));
    }
    Ok(res)
}

/// Runs a llama.cpp tool on the benchmark's device (all layers on the GPU,
/// or the CPU with the benchmark's threads); an error if it fails.
fn run_peer(b: &GenBench, exe: &Path, mut cmd: Command) -> Result<std::process::Output, String> {
    match b.device {
        Device::Cpu => cmd.args(["-ngl", "0", "-t", &b.threads.to_string()]),
        _ => cmd.args(["-ngl", "99"]),
    };
    let out = cmd.output().map_err(|e| format!("{}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!("{} failed: {}", exe.display(), tail(&out.stderr)));
    }
    Ok(out)
}

fn tail(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = s.lines().rev().take(3).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// Runs PyTorch with the benchmark's settings (`--torch`), or says why
/// there are no PyTorch figures.
fn torch_peer(b: &GenBench) -> Result<TorchRun, String> {
    let Some(peer) = &b.torch else {
        return Err("not run (pass --torch)".into());
    };
    eprintln!("pytorch: {} with {}...", peer.script.display(), peer.python);
    let device = match b.device {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(n) => format!("cuda:{n}"),
    };
    let cmd = TorchCommand {
        python: peer.python,
        script: &peer.script,
        device: &device,
        prompt_tokens: b.prompt_tokens,
        new_tokens: b.new_tokens,
        batch_tokens: b.batch_tokens,
        batches: &b.batches,
        runs: b.runs,
        seed: b.seed,
    };
    generate_peer::run(&cmd).map_err(|why| format!("PyTorch unavailable: {why}"))
}

/// Runs the benchmark and returns its markdown report and chart.
pub fn run(b: &GenBench) -> Result<Report, String> {
    if b.runs == 0 {
        return Err("--runs: expected at least 1".into());
    }
    if !b.gguf.is_file() {
        return Err(format!("--gguf {}: no such file (run `rlx fetch` for the default SmolLM2 file)", b.gguf.display()));
    }
    let mut notes = vec![];
    eprintln!("rlx: prefill {} tokens, decode {} tokens at batch 1...", b.prompt_tokens, b.new_tokens);
    let single = single(b);
    let (pre, dec, load) = match &single {
        Ok((p, d, h, l)) => (Ok(*p), Ok(*d), Some((*h, *l))),
        Err(e) => (Err(e.clone()), Err(e.clone()), None),
    };
    let mut rlx_batched = vec![];
    for &bs in &b.batches {
        eprintln!("rlx: batch {bs}, {} tokens each...", b.batch_tokens);
        rlx_batched.push((bs, batched(b, bs)));
    }
    let (peer_single, peer_batched) = match &b.llama_cpp {
        Some(dir) => {
            eprintln!("llama.cpp: llama-bench and llama-batched-bench from {}...", dir.display());
            let s = llama_bench(b, dir);
            if let Ok((_, _, build)) = &s {
                let how = match b.device {
                    Device::Cpu => format!("on the CPU with {} threads", b.threads),
                    _ => "all layers on the GPU, CUDA graphs on (its default)".into(),
                };
                notes.push(format!("llama.cpp build {build}: fastest of flash attention off/on for prefill and decode; {how}."));
            }
            (s.map(|(p, t, _)| (p, t)), llama_batched(b, dir))
        }
        None => {
            let why = "not run (pass --llama-cpp DIR, the folder holding llama-bench)".to_string();
            (Err(why.clone()), Err(why))
        }
    };
    let peer = torch_peer(b);
    let torch = |m: Measure, batch: usize| match &peer {
        Ok(run) => run.tok_s(m, batch),
        Err(why) => Err(why.clone()),
    };
    let mut lines = vec![
        Line {
            what: format!("prefill, {}-token prompt", b.prompt_tokens),
            short: format!("prefill, {}-token prompt", b.prompt_tokens),
            rlx: pre,
            llama: peer_single.as_ref().map(|x| x.0).map_err(Clone::clone),
            torch: torch(Measure::Prefill, 1),
        },
        Line {
            what: format!("decode, batch 1, {} tokens", b.new_tokens),
            short: "decode, batch 1".into(),
            rlx: dec,
            llama: peer_single.as_ref().map(|x| x.1).map_err(Clone::clone),
            torch: torch(Measure::Decode, 1),
        },
    ];
    for (bs, r) in rlx_batched {
        let llama = |pick: fn(&(usize, f64, f64)) -> f64| match &peer_batched {
            Ok(v) => v.iter().find(|x| x.0 == bs).map(pick).ok_or_else(|| format!("no batch {bs} row")),
            Err(e) => Err(e.clone()),
        };
        lines.push(Line {
            what: format!(
                "aggregate prefill, {bs} prompts of {} tokens admitted together ({})",
                b.prompt_tokens,
                match &r {
                    Ok((_, _, true)) => "side by side",
                    Ok(_) => "one at a time",
                    Err(_) => "–",
                }
            ),
            short: format!("prefill, {bs} prompts together"),
            rlx: r.as_ref().map(|x| x.0).map_err(Clone::clone),
            llama: llama(|x| x.1),
            torch: torch(Measure::Prefill, bs),
        });
        lines.push(Line {
            what: format!("aggregate decode, batch {bs}, {} tokens each", b.batch_tokens),
            short: format!("decode, batch {bs}"),
            rlx: r.map(|x| x.1),
            llama: llama(|x| x.2),
            torch: torch(Measure::Decode, bs),
        });
    }
    if let Some((h, l)) = load {
        notes.push(format!("RLX model load and compile: {l:.2} s."));
        notes.push(format!(
            "RLX host time per decode step at batch 1: {h:.1} µs (submitting the step and handling its token; waits on the device excluded)."
        ));
        let kv = b.kv_dtype.unwrap_or_else(|| rlx_models::default_kv_dtype(b.device));
        notes.push(format!("RLX KV cache: {kv} (llama.cpp's default cache is f16)."));
    }
    if let Ok(run) = &peer {
        notes.extend(run.describe());
    }
    let machine = super::report::machine(!matches!(b.device, Device::Cpu));
    let date = super::report::utc_now();
    let markdown = markdown(b, &machine, &date, &lines, &notes);
    let chart = Chart {
        title: format!("rlx bench --model smollm2 — {machine} — {date}"),
        series: vec!["RLX", "llama.cpp", "PyTorch"],
        rows: lines
            .iter()
            .map(|l| ChartRow {
                label: l.short.clone(),
                values: [&l.rlx, &l.llama, &l.torch].iter().map(|r| r.as_ref().ok().copied()).collect(),
            })
            .collect(),
    };
    Ok(Report { markdown, chart })
}

/// The report: what ran where, the table, then the notes.
fn markdown(b: &GenBench, machine: &str, date: &str, lines: &[Line], notes: &[String]) -> String {
    let mut md = format!(
        "# RLX generation benchmark\n\nmodel: {}\ndevice: {} ({machine})\ndate: {date}\nruns: {} (medians)\n\n\
         | measurement | RLX | llama.cpp | RLX / llama.cpp | PyTorch | RLX / PyTorch |\n|---|---:|---:|---:|---:|---:|\n",
        b.gguf.display(),
        b.device_name,
        b.runs
    );
    let fmt = |r: &Result<f64, String>| match r {
        Ok(v) => format!("{v:.0} tok/s"),
        Err(e) => format!("– ({e})"),
    };
    let ratio = |a: &Result<f64, String>, p: &Result<f64, String>| match (a, p) {
        (Ok(a), Ok(p)) if *p > 0.0 => format!("{:.2}×", a / p),
        _ => "–".into(),
    };
    for l in lines {
        md += &format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            l.what,
            fmt(&l.rlx),
            fmt(&l.llama),
            ratio(&l.rlx, &l.llama),
            fmt(&l.torch),
            ratio(&l.rlx, &l.torch)
        );
    }
    if !notes.is_empty() {
        md += "\n";
        for n in notes {
            md += &format!("- {n}\n");
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_has_a_column_and_a_ratio_per_peer() {
        let b = GenBench {
            gguf: PathBuf::from("m.gguf"),
            device: Device::Cpu,
            device_name: "cpu",
            prompt_tokens: 128,
            new_tokens: 256,
            batch_tokens: 128,
            batches: vec![8],
            runs: 3,
            seed: 42,
            llama_cpp: None,
            threads: 2,
            kv_dtype: None,
            torch: None,
        };
        let lines = [
            Line {
                what: "prefill, 128-token prompt".into(),
                short: "prefill".into(),
                rlx: Ok(52342.0),
                llama: Ok(16484.0),
                torch: Ok(20000.0),
            },
            Line {
                what: "decode, batch 1, 256 tokens".into(),
                short: "decode".into(),
                rlx: Ok(1642.0),
                llama: Err("no batch 1 row".into()),
                torch: Err("not run (pass --torch)".into()),
            },
            Line { what: "x".into(), short: "x".into(), rlx: Err("load failed".into()), llama: Ok(1.0), torch: Ok(2.0) },
        ];
        let md = markdown(&b, "test machine", "2026-12-06 22:18 UTC", &lines, &["a note".into()]);
        assert!(
            md.contains("| measurement | RLX | llama.cpp | RLX / llama.cpp | PyTorch | RLX / PyTorch |\n|---|---:|---:|---:|---:|---:|"),
            "{md}"
        );
        assert!(md.contains("| prefill, 128-token prompt | 52342 tok/s | 16484 tok/s | 3.18× | 20000 tok/s | 2.62× |"), "{md}");
        assert!(
            md.contains("| decode, batch 1, 256 tokens | 1642 tok/s | – (no batch 1 row) | – | – (not run (pass --torch)) | – |"),
            "{md}"
        );
        assert!(md.contains("| x | – (load failed) | 1 tok/s | – | 2 tok/s | – |"), "{md}");
        assert!(md.contains("device: cpu (test machine)") && md.ends_with("- a note\n"), "{md}");
    }
}
