//! `rlx bench`: RLX replay and eager against PyTorch eager and PyTorch
//! CUDA-graph replay, on the same seeded random BERT weights and inputs, with
//! the outputs compared so a fast-but-wrong result shows.

mod corpus;
mod generate;
mod generate_chart;
mod generate_peer;
mod model;
mod peer;
mod report;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use rlx::{CompileOptions, CompiledGraph, DType, Device, PrepareOptions, Session, Tensor, WeightStore};

use model::{Inputs, ModelSpec};
use peer::{PeerCommand, PeerJob, PeerOutcome};
use report::{Context, Row};

#[derive(Args)]
pub struct BenchArgs {
    /// Models, comma-separated: minilm, bert-base, tiny; or smollm2 alone
    /// for the text-generation benchmark (a GGUF decoder, see --gguf).
    #[arg(long, default_value = "minilm,bert-base")]
    model: String,
    /// Generation benchmark: the GGUF file (default: the SmolLM2 file that
    /// `rlx fetch` downloads).
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// Generation benchmark: the folder holding llama.cpp's llama-bench and
    /// llama-batched-bench, run on the same file as the peer.
    #[arg(long)]
    llama_cpp: Option<PathBuf>,
    /// Generation benchmark: prompt length in tokens.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Generation benchmark: new tokens at batch 1.
    #[arg(long, default_value_t = 256)]
    new_tokens: usize,
    /// Generation benchmark: new tokens per sequence in batched decode.
    #[arg(long, default_value_t = 128)]
    batch_tokens: usize,
    /// Generation benchmark: batch sizes for aggregate decode, comma-separated.
    #[arg(long, default_value = "8,32")]
    batches: String,
    /// Generation benchmark: KV cache dtype (auto: f16 on a GPU, f32 on the CPU; f32, f16, bf16).
    #[arg(long, default_value = "auto")]
    kv_dtype: String,
    /// Generation benchmark: also time PyTorch (bench/torch_decode_peer.py:
    /// transformers' LlamaForCausalLM on random weights of the same shapes,
    /// static KV cache, CUDA graphs on a GPU) with the same settings.
    #[arg(long)]
    torch: bool,
    /// Storage precision: f16, bf16 or f32.
    #[arg(long, default_value = "f16")]
    dtype: String,
    /// Shapes as BATCHxSEQ, comma-separated.
    #[arg(long, default_value = "1x128,32x128")]
    shapes: String,
    /// cuda, cuda:N or cpu.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Timed runs per measurement (the median is reported; the generation
    /// benchmark runs at most 5).
    #[arg(long, default_value_t = 200)]
    runs: usize,
    /// Untimed runs before timing.
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Seed of the random weights and inputs.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Skip the PyTorch peer (RLX rows only).
    #[arg(long)]
    no_peer: bool,
    /// RLX runs the exact (erf) GELU as its tanh approximation (the peer
    /// stays exact, so the max-difference column shows what it costs).
    #[arg(long)]
    approximate_gelu: bool,
    /// Python interpreter for the PyTorch peer.
    #[arg(long, default_value = "python3")]
    python: String,
    /// The PyTorch peer script (default: bench/gpu_peer.py, or
    /// bench/torch_decode_peer.py for --model smollm2, in the current
    /// directory or the source tree).
    #[arg(long)]
    peer_script: Option<PathBuf>,
    /// Write the markdown table to this file.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Draw grouped bars per configuration (per measurement with --model
    /// smollm2) to this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Keep the temporary directory (weights, inputs, PyTorch outputs).
    #[arg(long)]
    keep_temp: bool,
    /// Corpus benchmark: a text file, one text per line. Times `rlx embed`
    /// end to end against the forward passes alone on the same lines
    /// (uses --embed-model, --device, --dtype, --embed-batch-size).
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Corpus benchmark: the embedding model directory (default: as `rlx embed`).
    #[arg(long)]
    embed_model: Option<PathBuf>,
    /// Corpus benchmark: texts per forward pass.
    #[arg(long, default_value_t = 32)]
    embed_batch_size: usize,
}

/// `rlx bench --model smollm2`: see bench/generate.rs.
fn run_generation(args: &BenchArgs, device: Device) -> Result<(), String> {
    let gguf = match &args.gguf {
        Some(p) => p.clone(),
        None => crate::generate::default_model()?,
    };
    let batches = args
        .batches
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            s.trim().parse::<usize>().ok().filter(|&b| b > 0).ok_or_else(|| format!("--batches: expected positive integers, found '{s}'"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let b = generate::GenBench {
        gguf,
        device,
        device_name: &args.device,
        prompt_tokens: args.prompt_tokens,
        new_tokens: args.new_tokens,
        batch_tokens: args.batch_tokens,
        batches,
        runs: args.runs.min(5),
        seed: args.seed,
        llama_cpp: args.llama_cpp.clone(),
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        kv_dtype: crate::generate::parse_kv_dtype(&args.kv_dtype)?,
        torch: args.torch.then(|| generate::TorchPeer {
            python: &args.python,
            script: args.peer_script.clone().unwrap_or_else(|| default_peer_script("torch_decode_peer.py")),
        }),
    };
    let report = generate::run(&b)?;
    crate::stdout::print(&report.markdown)?;
    if let Some(path) = &args.output {
        std::fs::write(path, &report.markdown).map_err(|e| format!("--output {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        generate_chart::plot_svg(path, &report.chart)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Medians of one RLX executable.
struct Timing {
    wall_us: f64,
    submit_us: f64,
    /// Pipelined (two calls in flight): mean wall time per call and the
    /// median time `submit` takes while the previous call still runs, or why
    /// it failed. `None` when not measured or with a single slot.
    pipelined: Option<Result<(f64, f64), String>>,
    cpu_us: Option<f64>,
    kernels: usize,
    mode: String,
    outputs: Vec<Tensor>,
}

/// One configuration's RLX results awaiting the peer's.
struct Pending {
    row: Row,
    rlx_output: Option<Vec<f32>>,
    inputs: Inputs,
}

pub fn run(args: BenchArgs) -> Result<(), String> {
    let device: Device = args.device.parse().map_err(|e: rlx::Error| format!("--device: {e}"))?;
    if let Some(corpus) = &args.corpus {
        let model = crate::embed::ModelArgs {
            model: args.embed_model.clone(),
            device: args.device.clone(),
            dtype: args.dtype.clone(),
            batch_size: args.embed_batch_size,
            approximate_gelu: false,
        };
        return corpus::run(&corpus::CorpusBench { corpus: corpus.clone(), model });
    }
    if ["smollm2", "smollm"].contains(&args.model.trim().to_ascii_lowercase().as_str()) {
        return run_generation(&args, device);
    }
    let dtype = match DType::parse(&args.dtype) {
        Some(d) if d.is_float() => d,
        _ => return Err(format!("--dtype: expected f16, bf16 or f32, found '{}'", args.dtype)),
    };
    let specs = args.model.split(',').map(model::model_spec).collect::<Result<Vec<_>, _>>()?;
    let shapes = parse_shapes(&args.shapes)?;
    if args.runs == 0 {
        return Err("--runs: expected at least 1".into());
    }
    if let Device::Cuda(_) = device {
        // Fail before any work, with the reason, when there is no GPU.
        Session::new(device).map_err(|e| {
            format!(
                "no usable CUDA GPU for --device {}: {e} (`rlx doctor` shows what was found; --device cpu times the CPU backend)",
                args.device
            )
        })?;
    }
    let gpu = matches!(device, Device::Cuda(_));
    let tmp = TempDir::create(args.keep_temp)?;
    let want_peer = !args.no_peer;

    // Weights, inputs and the peer's files first; the peer then runs before
    // RLX, so its numbers survive even if an RLX configuration fails hard.
    let mut stores = Vec::new();
    let mut configs = Vec::new();
    let mut jobs = Vec::new();
    for (si, spec) in specs.iter().enumerate() {
        eprintln!("{}: seeded random weights ({dtype})...", spec.name);
        let store = model::weights(spec, args.seed, dtype)?;
        let model_dir = tmp.path.join(format!("{}-{}", spec.name, dtype));
        if want_peer {
            model::write_hf_dir(&model_dir, spec, &store, dtype)?;
        }
        stores.push(store);
        for &(batch, seq) in &shapes {
            let inputs = Inputs::new(spec.cfg.vocab_size, batch, seq, args.seed);
            let id = format!("{}-{}-{}x{}", spec.name, dtype, batch, seq);
            if want_peer {
                let job = PeerJob {
                    ids: tmp.path.join(format!("{id}.ids")),
                    mask: tmp.path.join(format!("{id}.mask")),
                    hidden_out: tmp.path.join(format!("{id}.hidden")),
                    id: id.clone(),
                    model_dir: model_dir.clone(),
                    dtype: dtype.name().to_string(),
                    batch,
                    seq,
                };
                peer::write_i64(&job.ids, &inputs.ids)?;
                peer::write_i64(&job.mask, &inputs.mask)?;
                jobs.push(job);
            }
            configs.push((si, id, inputs));
        }
    }

    let mut notes = Vec::new();
    if args.approximate_gelu {
        notes.push("RLX ran the tanh approximation of GELU (--approximate-gelu); the peer runs the exact GELU.".into());
    }
    let mut peer_results = None;
    let peer_desc = if want_peer {
        let script = args.peer_script.clone().unwrap_or_else(|| default_peer_script("gpu_peer.py"));
        let cmd = PeerCommand { python: &args.python, script: &script, runs: args.runs, warmup: args.warmup, device: &peer_device(device) };
        eprintln!("running the PyTorch peer ({} configurations)...", jobs.len());
        match peer::run(&cmd, &jobs, &tmp.path) {
            PeerOutcome::Unavailable(why) => {
                notes.push(format!("PyTorch peer not run: {why}. Only RLX rows are shown."));
                "none (unavailable)".to_string()
            }
            PeerOutcome::Ran { versions, results, notes: peer_notes } => {
                notes.extend(peer_notes);
                peer_results = Some(results);
                versions
            }
        }
    } else {
        notes.push("PyTorch peer skipped (--no-peer).".into());
        "none (--no-peer)".to_string()
    };

    let mut pending = Vec::new();
    for (si, id, inputs) in configs {
        let mut p = bench_rlx(&specs[si], &stores[si], device, dtype, inputs, &args);
        if let Some(results) = &peer_results {
            merge_peer(&mut p, results.get(&id));
        }
        pending.push(p);
    }

    let rows: Vec<Row> = pending.into_iter().map(|p| p.row).collect();
    let ctx = Context {
        machine: report::machine(gpu),
        date: report::utc_now(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        runs: args.runs,
        warmup: args.warmup,
        peer: peer_desc,
        notes,
        gpu,
    };
    let md = report::markdown(&ctx, &rows);
    crate::stdout::print(&md)?;
    if let Some(path) = &args.output {
        std::fs::write(path, &md).map_err(|e| format!("--output {}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(path) = &args.plot {
        report::plot_svg(path, &ctx, &rows)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Times one configuration with replay on, then off, and checks that both
/// modes agree bit for bit. Failures (errors or panics in a backend) become
/// notes on the row, so one bad configuration does not lose the others.
fn bench_rlx(spec: &ModelSpec, store: &Arc<WeightStore>, device: Device, dtype: DType, inputs: Inputs, args: &BenchArgs) -> Pending {
    let label = format!("{} {} {}x{}", spec.name, dtype, inputs.batch, inputs.seq);
    let mut row =
        Row { model: spec.name.to_string(), dtype: dtype.name().to_string(), batch: inputs.batch, seq: inputs.seq, ..Row::default() };
    let mut measure = |replay: bool| -> Option<Timing> {
        let mode = match (device, replay) {
            (Device::Cpu, _) => "run",
            (_, true) => "replay",
            (_, false) => "eager",
        };
        eprintln!("{label}: RLX {mode}...");
        let attempt =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| measure_mode(spec, store, device, dtype, &inputs, replay, args)));
        let result = attempt.unwrap_or_else(|panic| Err(format!("panicked: {}", panic_message(&panic))));
        result.map_err(|e| row.notes.push(format!("RLX {mode} failed: {e}"))).ok()
    };
    let gpu = matches!(device, Device::Cuda(_));
    let replay = measure(true);
    // The CPU backend has no replay: a second, "eager" executable would time the same thing.
    let eager = if gpu { measure(false) } else { None };

    if let Some(r) = &replay {
        row.rlx_replay_us = Some(r.wall_us);
        row.host_submit_us = Some(r.submit_us);
        row.host_cpu_us = r.cpu_us;
        match &r.pipelined {
            Some(Ok((wall, submit))) => (row.pipelined_us, row.host_submit_pipelined_us) = (Some(*wall), Some(*submit)),
            Some(Err(e)) => row.notes.push(format!("pipelined replay failed: {e}")),
            None => {}
        }
        row.kernels = Some(r.kernels);
        if gpu {
            eprintln!("{label}: replay {:.1} µs ({}), submit {:.2} µs, {} kernels", r.wall_us, r.mode, r.submit_us, r.kernels);
        } else {
            eprintln!("{label}: {:.1} µs ({}), {} thunks", r.wall_us, r.mode, r.kernels);
        }
        if gpu && !r.mode.contains("replay") {
            row.notes.push(format!("the replay executable ran in mode '{}' (is RLX_REPLAY=0 set?)", r.mode));
        }
    }
    if let Some(e) = &eager {
        row.rlx_eager_us = Some(e.wall_us);
        eprintln!("{label}: eager {:.1} µs ({})", e.wall_us, e.mode);
    }
    if let (Some(r), Some(e)) = (&replay, &eager) {
        if r.outputs != e.outputs {
            let d = max_diff(&r.outputs, &e.outputs);
            row.notes.push(format!("replay and eager outputs differ (max abs diff {d:.3e}); they should be bit-identical"));
        }
    }
    let rlx_output = replay.as_ref().or(eager.as_ref()).and_then(|t| t.outputs.first()).map(Tensor::to_f32);
    Pending { row, rlx_output, inputs }
}

/// Compiles the configuration with replay on or off and times it.
fn measure_mode(
    spec: &ModelSpec,
    store: &Arc<WeightStore>,
    device: Device,
    dtype: DType,
    inputs: &Inputs,
    replay: bool,
    args: &BenchArgs,
) -> Result<Timing, String> {
    let graph = model::graph(spec, inputs.batch, inputs.seq)?;
    let tensors = inputs.tensors()?;
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    let mut session = Session::with_weights(device, store.clone()).map_err(|e| e.to_string())?;
    session.set_compile_options(CompileOptions {
        precision: (dtype != DType::F32).then_some(dtype),
        approximate_gelu: args.approximate_gelu,
        ..CompileOptions::default()
    });
    session.set_prepare_options(PrepareOptions { replay, ..PrepareOptions::default() });
    let mut exe = session.compile(&graph).map_err(|e| format!("compiling for {device}: {e}"))?;
    time_rlx(&mut exe, &named, args.warmup, args.runs, replay).map_err(|e| e.to_string())
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Warm-up, then `runs` timed calls: wall clock around submit + wait, the
/// time submit takes, and the calling thread's CPU time per call.
fn time_rlx(exe: &mut CompiledGraph, inputs: &[(&str, &Tensor)], warmup: usize, runs: usize, pipeline: bool) -> Result<Timing, rlx::Error> {
    let mut outputs = exe.run(inputs)?;
    for _ in 1..warmup {
        outputs = exe.run(inputs)?;
    }
    let mut wall = Vec::with_capacity(runs);
    let mut submit = Vec::with_capacity(runs);
    let cpu_start = thread_cpu_ns();
    for _ in 0..runs {
        let t0 = Instant::now();
        let ticket = exe.submit(inputs)?;
        let t1 = Instant::now();
        outputs = exe.wait(ticket)?;
        let t2 = Instant::now();
        submit.push((t1 - t0).as_secs_f64() * 1e6);
        wall.push((t2 - t0).as_secs_f64() * 1e6);
    }
    let cpu_us = match (cpu_start, thread_cpu_ns()) {
        (Some(a), Some(b)) if b >= a => Some((b - a) as f64 / 1e3 / runs as f64),
        _ => None,
    };
    // Only the replay rows report it; a failure there is a note, not the
    // loss of the sequential numbers above.
    let pipelined = if pipeline {
        match time_pipelined(exe, inputs, runs, &outputs) {
            Ok(p) => p.map(Ok),
            Err(e) => Some(Err(e.to_string())),
        }
    } else {
        None
    };
    let stats = exe.stats();
    Ok(Timing {
        wall_us: median(&mut wall),
        submit_us: median(&mut submit),
        pipelined,
        cpu_us,
        kernels: stats.kernels_per_call,
        mode: stats.mode,
        outputs,
    })
}

/// Steady-state use as the executor is meant to be driven: call k + 1 is
/// submitted before call k is collected, so the host stages and launches
/// while the device works. Returns (wall µs per call, median submit µs), or
/// `None` when the executable has one slot (a second submit is Busy).
fn time_pipelined(
    exe: &mut CompiledGraph,
    inputs: &[(&str, &Tensor)],
    runs: usize,
    expected: &[Tensor],
) -> Result<Option<(f64, f64)>, rlx::Error> {
    let mut pending = exe.submit(inputs)?;
    let mut submit = Vec::with_capacity(runs);
    let start = Instant::now();
    for _ in 0..runs {
        let t0 = Instant::now();
        let next = match exe.submit(inputs) {
            Ok(t) => t,
            Err(rlx::Error::Runtime(rlx::RuntimeError::Busy { .. })) => {
                exe.wait(pending)?;
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        submit.push(t0.elapsed().as_secs_f64() * 1e6);
        let got = exe.wait(pending)?;
        // Same inputs every call: with two calls in flight each result must
        // still be the sequential one, bit for bit (slots must not alias).
        if got.iter().zip(expected).any(|(a, b)| a.bytes() != b.bytes()) {
            return Err(rlx::Error::Runtime(rlx::RuntimeError::Backend {
                backend: "bench".into(),
                detail: "a pipelined call returned different bits from the sequential ones".into(),
            }));
        }
        pending = next;
    }
    exe.wait(pending)?;
    let per_call = start.elapsed().as_secs_f64() * 1e6 / (runs as f64 + 1.0);
    Ok(Some((per_call, median(&mut submit))))
}

/// Fills a row with the peer's timings and compares the outputs.
fn merge_peer(p: &mut Pending, result: Option<&peer::PeerResult>) {
    let Some(r) = result else {
        p.row.notes.push("no PyTorch result for this configuration".into());
        return;
    };
    p.row.torch_eager_us = r.eager_us;
    p.row.torch_graph_us = r.graph_us;
    p.row.notes.extend(r.notes.iter().cloned());
    let (Some(hidden_path), Some(rlx)) = (&r.hidden, &p.rlx_output) else { return };
    let (b, s) = (p.inputs.batch, p.inputs.seq);
    // PyTorch's hidden state is [batch, seq, hidden]; RLX's pooled output [batch, hidden].
    let count = rlx.len() * s;
    let compared =
        peer::read_f32(hidden_path, count).and_then(|h| peer::compare_pooled(rlx, &h, b, s, &p.inputs.mask, model::POOLED_NORMALIZED));
    match compared {
        Ok(d) => p.row.max_abs_diff = Some(d),
        Err(e) => p.row.notes.push(format!("output comparison failed: {e}")),
    }
}

fn max_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.to_f32().into_iter().zip(y.to_f32()).map(|(p, q)| f64::from((p - q).abs())))
        .fold(if a.len() == b.len() { 0.0 } else { f64::INFINITY }, f64::max)
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// CPU time of the calling thread in nanoseconds, from
/// `clock_gettime(CLOCK_THREAD_CPUTIME_ID)` (exact, unlike
/// /proc/thread-self/schedstat, which only advances at scheduler ticks).
/// Declared by hand to avoid a libc dependency for one call.
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
fn thread_cpu_ns() -> Option<u64> {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;
    let mut t = Timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec (two 64-bit fields on 64-bit Linux).
    let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
    (rc == 0).then(|| t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64)
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
fn thread_cpu_ns() -> Option<u64> {
    None
}

fn parse_shapes(s: &str) -> Result<Vec<(usize, usize)>, String> {
    let parse = |part: &str| -> Option<(usize, usize)> {
        let (b, q) = part.trim().to_ascii_lowercase().split_once(['x', '×']).map(|(b, q)| (b.trim().to_string(), q.trim().to_string()))?;
        match (b.parse().ok()?, q.parse().ok()?) {
            (0, _) | (_, 0) => None,
            (b, q) => Some((b, q)),
        }
    };
    s.split(',')
        .map(|p| {
            parse(p).ok_or_else(|| format!("--shapes: expected BATCHxSEQ with positive numbers (e.g. 1x128,32x128), found '{}'", p.trim()))
        })
        .collect()
}

fn peer_device(d: Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(n) => format!("cuda:{n}"),
    }
}

/// bench/NAME under the current directory if present, else in the source
/// tree this binary was built from.
fn default_peer_script(name: &str) -> PathBuf {
    let here = Path::new("bench").join(name);
    if here.is_file() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench").join(name)
}

/// A scratch directory removed on drop unless kept.
struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    fn create(keep: bool) -> Result<TempDir, String> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let path = std::env::temp_dir().join(format!("rlx-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        Ok(TempDir { path, keep })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.keep {
            eprintln!("kept {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_parse_and_bad_ones_are_named() {
        assert_eq!(parse_shapes("1x128, 32X128,2×16").ok(), Some(vec![(1, 128), (32, 128), (2, 16)]));
        for bad in ["", "1x", "0x128", "1x128,abc", "3"] {
            let e = parse_shapes(bad).err().unwrap_or_default();
            assert!(e.contains("--shapes"), "{bad}: {e}");
        }
    }

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut [5.0, 1.0, 3.0]), 3.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }

    #[test]
    fn thread_cpu_time_advances_with_work() {
        let Some(a) = thread_cpu_ns() else {
            eprintln!("SKIPPED thread_cpu_time_advances_with_work: no per-thread CPU clock on this platform");
            return;
        };
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        let b = thread_cpu_ns().unwrap_or(0);
        // Sleeping costs no CPU time; the loop above does.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let c = thread_cpu_ns().unwrap_or(0);
        assert!(b > a, "{a} {b}");
        assert!(c - b < 10_000_000, "sleep counted as CPU: {}", c - b);
    }
}
