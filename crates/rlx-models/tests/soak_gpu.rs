//! GPU soak: a long run of pipelined, replayed calls of a MiniLM-shaped
//! BERT encoder (seeded random weights of all-MiniLM-L6-v2's shapes, f16 on
//! the GPU) across several shape buckets and every pipeline slot, with
//! random inputs and padding and weight updates between calls. Every
//! output is compared with a reference for its (bucket, input, weight
//! version): the same executable's output in a call with nothing else in
//! flight, itself checked against the CPU backend in f32 once per version.
//! Resident memory, open descriptors, threads and the GPU's used memory
//! (cuMemGetInfo) are sampled every `SOAK_SAMPLE_EVERY` calls and must stay
//! flat after warm-up.
//!
//! Ignored by default: run it with `scripts/soak-gpu` (or, from a GPU pack,
//! the `soak_gpu` test binary with `--ignored`). Settings: `SOAK_CALLS`
//! (default 1,000,000), `SOAK_DEVICE` (`cuda`, default, or `cpu`: a dry run
//! of the same logic), `SOAK_SAMPLE_EVERY` (10,000), `SOAK_UPDATE_EVERY`
//! (calls between weight updates, 20,000), `SOAK_WARMUP` (calls before the
//! memory baseline, a tenth of the calls).

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use rlx::{CompileOptions, CompiledGraph, DType, Device, PrepareOptions, Session, Tensor, Ticket, WeightStore};
use rlx_models::{build_bert_graph, random_weights, BertConfig, BertGraphOptions};

/// (batch, seq) buckets: every call picks one at random.
const BUCKETS: [(usize, usize); 6] = [(1, 16), (1, 128), (2, 32), (4, 64), (8, 16), (8, 128)];
const SLOTS: usize = 3;
const INPUTS_PER_BUCKET: usize = 4;
const WEIGHT_VERSIONS: usize = 3;
/// The tensors a weight update replaces (the rest stay the base weights).
const UPDATED: [&str; 3] =
    ["embeddings.LayerNorm.weight", "encoder.layer.3.attention.self.query.weight", "encoder.layer.5.output.dense.weight"];

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.replace('_', "").parse().ok()).unwrap_or(default)
}

/// Deterministic values without a random crate: a 64-bit LCG.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 11
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn f32(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }
}

struct Sample {
    calls: usize,
    rss_kb: u64,
    fds: usize,
    threads: u64,
    gpu_used: u64,
}

fn sample(calls: usize, gpu: &dyn Fn() -> u64) -> Sample {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        status.lines().find(|l| l.starts_with(k)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    Sample { calls, rss_kb: field("VmRSS:"), fds, threads: field("Threads:"), gpu_used: gpu() }
}

/// Device memory in use (total - free), or 0 on the CPU.
fn gpu_used_fn(device: Device) -> Box<dyn Fn() -> u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(i) = device {
        let b = rlx::backends::CudaBackend::new(i).unwrap_or_else(|e| panic!("{e}"));
        return Box::new(move || b.memory_info().map(|(free, total)| total - free).unwrap_or(0));
    }
    let _ = device;
    Box::new(|| 0)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).map(|d| if d.is_nan() { f32::INFINITY } else { d }).fold(0.0, f32::max)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// One bucket's fixed inputs: token ids and a padding mask (random valid
/// lengths, at least one token per row).
fn make_inputs(rng: &mut Lcg, cfg: &BertConfig, batch: usize, seq: usize) -> Vec<(Tensor, Tensor)> {
    (0..INPUTS_PER_BUCKET)
        .map(|_| {
            let ids: Vec<i32> = (0..batch * seq).map(|_| rng.below(cfg.vocab_size) as i32).collect();
            let mut mask = vec![0f32; batch * seq];
            for r in 0..batch {
                let valid = 1 + rng.below(seq);
                mask[r * seq..r * seq + valid].fill(1.0);
            }
            let ids = Tensor::from_i32([batch, seq], &ids).unwrap_or_else(|e| panic!("{e}"));
            let mask = Tensor::from_f32([batch, seq], &mask).unwrap_or_else(|e| panic!("{e}"));
            (ids, mask)
        })
        .collect()
}

#[test]
#[ignore = "minutes long on a GPU: run scripts/soak-gpu"]
fn soak_gpu_pipelined_replays_with_weight_updates() {
    let calls = env_usize("SOAK_CALLS", 1_000_000);
    let sample_every = env_usize("SOAK_SAMPLE_EVERY", 10_000).max(1);
    let update_every = env_usize("SOAK_UPDATE_EVERY", 20_000).max(1);
    let device = match std::env::var("SOAK_DEVICE").as_deref() {
        Ok("cpu") => Device::Cpu,
        Ok("cuda") | Err(_) => Device::Cuda(0),
        Ok(other) => panic!("SOAK_DEVICE must be cuda or cpu, found {other:?}"),
    };
    let t_start = Instant::now();
    let cfg = BertConfig::minilm_l6();
    let store = random_weights(&cfg, 0x50a6, DType::F32).unwrap_or_else(|e| panic!("{e}"));
    // Each version replaces the UPDATED tensors with values of its own.
    let mut rng = Lcg(0x5eed);
    let shape_of = |n: &str| store.get(n).map(|t| t.shape().0.to_vec()).unwrap_or_else(|| panic!("no weight {n}"));
    let versions: Vec<Vec<(String, Tensor)>> = (0..WEIGHT_VERSIONS)
        .map(|_| {
            UPDATED
                .iter()
                .map(|&n| {
                    let shape = shape_of(n);
                    let count: usize = shape.iter().product();
                    let scale = if n.ends_with("LayerNorm.weight") { 0.5 } else { 0.06 };
                    let base = if n.ends_with("LayerNorm.weight") { 1.0 } else { 0.0 };
                    let v: Vec<f32> = (0..count).map(|_| base + scale * rng.f32()).collect();
                    (n.to_string(), Tensor::from_f32(shape, &v).unwrap_or_else(|e| panic!("{e}")))
                })
                .collect()
        })
        .collect();
    let set_version = |store: &WeightStore, v: usize| {
        for (n, t) in &versions[v] {
            store.set(n, t.clone()).unwrap_or_else(|e| panic!("weight update {n}: {e}"));
        }
    };
    set_version(&store, 0);

    let mut session = Session::with_weights(device, store.clone()).unwrap_or_else(|e| panic!("{device:?}: {e}"));
    let precision = if device == Device::Cpu { None } else { Some(DType::F16) };
    session.set_compile_options(CompileOptions { precision, ..CompileOptions::default() });
    session.set_prepare_options(PrepareOptions { slots: SLOTS, ..session.prepare_options().clone() });
    let cpu = Session::with_weights(Device::Cpu, store.clone()).unwrap_or_else(|e| panic!("{e}"));
    let gopts = BertGraphOptions { hidden_states: false, ..BertGraphOptions::default() };
    let graphs: Vec<_> = BUCKETS.iter().map(|&(b, s)| build_bert_graph(&cfg, b, s, &gopts).unwrap_or_else(|e| panic!("{e}"))).collect();
    let mut exes: Vec<CompiledGraph> = graphs.iter().map(|g| session.compile(g).unwrap_or_else(|e| panic!("compile: {e}"))).collect();
    let mut cpu_exes: Vec<CompiledGraph> = graphs.iter().map(|g| cpu.compile(g).unwrap_or_else(|e| panic!("cpu compile: {e}"))).collect();
    let inputs: Vec<Vec<(Tensor, Tensor)>> = BUCKETS.iter().map(|&(b, s)| make_inputs(&mut rng, &cfg, b, s)).collect();
    let feed = |k: usize, i: usize| [("input_ids", &inputs[k][i].0), ("attention_mask", &inputs[k][i].1)];
    let t_prepared = Instant::now();

    // References: per version, each (bucket, input) run alone through the
    // soaked executable, checked against the CPU backend in f32.
    let (min_cos, max_diff) = if device == Device::Cpu { (0.999_999, 1e-4f32) } else { (0.999, 0.1f32) };
    let mut refs: Vec<Vec<Vec<Vec<f32>>>> = vec![vec![vec![]; INPUTS_PER_BUCKET]; BUCKETS.len()];
    for v in 0..WEIGHT_VERSIONS {
        set_version(&store, v);
        for (k, bucket_refs) in refs.iter_mut().enumerate() {
            for (i, input_refs) in bucket_refs.iter_mut().enumerate() {
                let got = exes[k].run(&feed(k, i)).unwrap_or_else(|e| panic!("reference run: {e}"))[0].to_f32();
                let want = cpu_exes[k].run(&feed(k, i)).unwrap_or_else(|e| panic!("cpu reference: {e}"))[0].to_f32();
                let h = cfg.hidden_size;
                let cos = (0..BUCKETS[k].0).map(|r| cosine(&got[r * h..(r + 1) * h], &want[r * h..(r + 1) * h])).fold(1.0, f64::min);
                let diff = max_abs(&got, &want);
                assert!(
                    cos >= min_cos && diff <= max_diff,
                    "bucket {:?} input {i} version {v}: {device:?} against the CPU: cosine {cos}, max abs {diff}",
                    BUCKETS[k]
                );
                input_refs.push(got);
            }
        }
    }
    // Versions and inputs must be told apart by far more than the
    // tolerance, or a stale weight or a mixed-up slot could pass unseen.
    // (A call that is not bit-identical to its reference but within this
    // is counted apart, not as wrong: f16 outputs are 1e-3 apart at 1.0.)
    let tolerance = 1e-2f32;
    for (k, bucket_refs) in refs.iter().enumerate() {
        for (i, versions) in bucket_refs.iter().enumerate() {
            for v in 1..WEIGHT_VERSIONS {
                let d = max_abs(&versions[v], &versions[0]);
                assert!(d > 20.0 * tolerance, "bucket {:?} input {i}: versions 0 and {v} differ by only {d}", BUCKETS[k]);
            }
        }
    }
    drop(cpu_exes);
    drop(cpu);
    let t_refs = Instant::now();

    let gpu_used = gpu_used_fn(device);
    let mut version = WEIGHT_VERSIONS - 1;
    let mut in_flight: VecDeque<(usize, Ticket, usize, usize)> = VecDeque::new();
    let (mut wrong, mut inexact, mut checked, mut updates) = (0usize, 0usize, 0usize, 0usize);
    let mut seen: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let mut samples = vec![sample(0, &*gpu_used)];
    let mut check = |exes: &mut Vec<CompiledGraph>, (k, ticket, i, v): (usize, Ticket, usize, usize)| {
        *seen.entry((k, ticket.slot)).or_default() += 1;
        let out = exes[k].wait(ticket).unwrap_or_else(|e| panic!("wait: {e}"));
        let got = out[0].to_f32();
        let want = &refs[k][i][v];
        if &got != want {
            inexact += 1;
            let d = max_abs(&got, want);
            if d > tolerance {
                wrong += 1;
                if wrong <= 5 {
                    eprintln!("wrong result: bucket {:?} input {i} version {v}: max abs difference {d}", BUCKETS[k]);
                }
            }
        }
        checked += 1;
    };
    let t_soak = Instant::now();
    for call in 0..calls {
        if call % update_every == 0 {
            // Weights change only between calls: collect what is in flight.
            while let Some(t) = in_flight.pop_front() {
                check(&mut exes, t);
            }
            version = (version + 1) % WEIGHT_VERSIONS;
            set_version(&store, version);
            updates += 1;
        }
        let k = rng.below(BUCKETS.len());
        let i = rng.below(INPUTS_PER_BUCKET);
        if in_flight.iter().filter(|t| t.0 == k).count() == SLOTS {
            let at = in_flight.iter().position(|t| t.0 == k).unwrap_or(0);
            if let Some(t) = in_flight.remove(at) {
                check(&mut exes, t);
            }
        }
        let ticket = exes[k].submit(&feed(k, i)).unwrap_or_else(|e| panic!("submit: {e}"));
        in_flight.push_back((k, ticket, i, version));
        if (call + 1) % sample_every == 0 {
            samples.push(sample(call + 1, &*gpu_used));
        }
    }
    while let Some(t) = in_flight.pop_front() {
        check(&mut exes, t);
    }
    let soak_s = t_soak.elapsed().as_secs_f64();
    samples.push(sample(calls, &*gpu_used));

    for s in &samples {
        eprintln!(
            "calls {:>9}  rss {:>8} KB  fds {:>3}  threads {:>3}  gpu used {:>6} MiB",
            s.calls,
            s.rss_kb,
            s.fds,
            s.threads,
            s.gpu_used >> 20
        );
    }
    let warmup = env_usize("SOAK_WARMUP", calls / 10);
    let warm = samples.iter().find(|s| s.calls >= warmup).unwrap_or(&samples[0]);
    let last = samples.last().unwrap_or(&samples[0]);
    let growth = last.rss_kb as f64 / warm.rss_kb.max(1) as f64 - 1.0;
    let gpu_growth = last.gpu_used as f64 / warm.gpu_used.max(1) as f64 - 1.0;
    eprintln!("| figure | value |");
    eprintln!("|---|---|");
    eprintln!("| device | {device:?}, {} (f16 on CUDA) |", if device == Device::Cpu { "f32" } else { "MiniLM-L6 shape" });
    eprintln!("| calls (replays) | {calls} |");
    eprintln!("| checked / wrong / not bit-identical | {checked} / {wrong} / {inexact} |");
    eprintln!("| weight updates | {updates} |");
    eprintln!("| (bucket, slot) pairs used | {} of {} |", seen.len(), BUCKETS.len() * SLOTS);
    eprintln!(
        "| prepare / references / soak | {:.1} s / {:.1} s / {soak_s:.1} s ({:.1} µs per call) |",
        (t_prepared - t_start).as_secs_f64(),
        (t_refs - t_prepared).as_secs_f64(),
        soak_s * 1e6 / calls.max(1) as f64
    );
    eprintln!("| RSS after warm-up ({} calls) → end | {} KB → {} KB ({:+.2}%) |", warm.calls, warm.rss_kb, last.rss_kb, growth * 100.0);
    eprintln!("| GPU used after warm-up → end | {} MiB → {} MiB ({:+.2}%) |", warm.gpu_used >> 20, last.gpu_used >> 20, gpu_growth * 100.0);
    eprintln!("| fds, threads after warm-up → end | {} → {}, {} → {} |", warm.fds, last.fds, warm.threads, last.threads);
    assert_eq!(checked, calls);
    assert_eq!(wrong, 0, "wrong results");
    assert_eq!(seen.len(), BUCKETS.len() * SLOTS, "not every (bucket, slot) pair ran: {seen:?}");
    assert!(growth <= 0.01, "resident memory grew {:.2}% after warm-up", growth * 100.0);
    assert!(gpu_growth <= 0.01, "GPU memory in use grew {:.2}% after warm-up", gpu_growth * 100.0);
    assert!(last.fds <= warm.fds && last.threads <= warm.threads, "descriptors or threads grew");
}
