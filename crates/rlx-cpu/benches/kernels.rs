//! CPU kernel benchmark: f32 matmul against numpy (OpenBLAS) in the same
//! run, as a share of the measured FMA peak; LayerNorm and Softmax against
//! a plain memory copy of the same bytes.
//!
//! `cargo bench -p rlx-cpu --bench kernels` (numpy + threadpoolctl from
//! bench/setup-peers.sh). `RLX_BENCH_THREADS=1,2` picks the thread counts
//! (default: 1 and all cores).
//!
//! RLX is timed through the public executable API with every operand in
//! the weight store and no inputs or outputs to copy, two submissions in
//! flight so the worker never idles: what a model's matmul costs inside a
//! schedule.

use std::collections::VecDeque;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use rlx_cpu::CpuBackend;
use rlx_ir::{DType, Shape};
use rlx_runtime::{Backend, Executable, PrepareOptions, Tensor, WeightStore};
use rlx_schedule::{ArenaSummary, BufRef, MatMulThunk, Schedule, Space, Thunk, WeightSlot};

const SHAPES: [(usize, usize, usize); 3] = [(128, 384, 1536), (128, 1536, 384), (1024, 1024, 1024)];

/// Best time per call over 5 runs of a calibrated number of calls.
fn best_seconds(mut f: impl FnMut(usize)) -> f64 {
    f(2);
    let mut iters = 1;
    loop {
        let t = Instant::now();
        f(iters);
        if t.elapsed().as_secs_f64() > 0.06 {
            break;
        }
        iters *= 2;
    }
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f(iters);
            t.elapsed().as_secs_f64() / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn weight(store: &WeightStore, slots: &mut Vec<WeightSlot>, name: &str, shape: &[usize], seed: u32) -> BufRef {
    weight_of(store, slots, name, shape, seed, DType::F32)
}

fn weight_of(store: &WeightStore, slots: &mut Vec<WeightSlot>, name: &str, shape: &[usize], seed: u32, dtype: DType) -> BufRef {
    let n: usize = shape.iter().product();
    let vals: Vec<f32> = (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0 - 0.5).collect();
    let t = Tensor::from_f32(shape.to_vec(), &vals).expect("bench tensor").to_dtype(dtype);
    let b = BufRef { space: Space::Weight(slots.len() as u32), offset: 0, bytes: (n * dtype.size()) as u64 };
    slots.push(WeightSlot { name: name.into(), parts: vec![name.into()], concat_axis: 0, shape: Shape::new(shape.to_vec()), dtype });
    store.set(name, t).expect("bench weight");
    b
}

/// An executable running `thunk` `reps` times per call, so per-call
/// overhead (waking the worker and the pool) is amortised as it is over a
/// model's many thunks.
fn executable(
    backend: &CpuBackend,
    thunk: Thunk,
    reps: usize,
    weights: Vec<WeightSlot>,
    store: WeightStore,
    arena_bytes: u64,
) -> Box<dyn Executable> {
    let schedule = Schedule {
        thunks: vec![thunk; reps],
        arena_bytes,
        inputs: vec![],
        outputs: vec![],
        weights,
        states: vec![],
        consts: vec![],
        arena: ArenaSummary::default(),
    };
    backend.prepare(Arc::new(schedule), Arc::new(store), &PrepareOptions { slots: 2, ..Default::default() }).expect("prepare")
}

/// Seconds per call with two calls in flight.
fn time_exe(exe: &mut Box<dyn Executable>) -> f64 {
    best_seconds(|iters| {
        let mut pending = VecDeque::new();
        for _ in 0..iters {
            if pending.len() == 2 {
                exe.wait(pending.pop_front().expect("pending")).expect("wait");
            }
            pending.push_back(exe.submit(&[]).expect("submit"));
        }
        for t in pending {
            exe.wait(t).expect("wait");
        }
    })
}

fn rlx_matmul(backend: &CpuBackend, mkn: (usize, usize, usize)) -> f64 {
    rlx_matmul_of(backend, mkn, DType::F32)
}

/// GFLOP/s of a matmul with `dtype` storage (half types: a widened per
/// call, b widened once at prepare, f32 accumulation).
fn rlx_matmul_of(backend: &CpuBackend, (m, k, n): (usize, usize, usize), dtype: DType) -> f64 {
    let store = WeightStore::new();
    let mut slots = Vec::new();
    let a = weight_of(&store, &mut slots, "a", &[m, k], 1, dtype);
    let b = weight_of(&store, &mut slots, "b", &[k, n], 2, dtype);
    let out = BufRef { space: Space::Arena, offset: 0, bytes: (m * n * dtype.size()) as u64 };
    let t = Thunk::MatMul(MatMulThunk {
        dtype,
        batch: 1,
        m,
        n,
        k,
        a,
        lda: k as u64,
        a_batch_stride: (m * k) as u64,
        b,
        b_trans: false,
        ldb: n as u64,
        b_batch_stride: 0,
        bias: None,
        act: None,
        residual: None,
        out,
    });
    let reps = if m * n * k >= 1 << 28 { 1 } else { 4 };
    let mut exe = executable(backend, t, reps, slots, store, out.bytes);
    reps as f64 * 2.0 * (m * n * k) as f64 / time_exe(&mut exe) / 1e9
}

#[derive(Clone, Copy)]
enum RowKernel {
    LayerNorm,
    Softmax,
    Gelu,
}

/// GB/s (bytes read + written) of a row kernel over [rows, cols].
fn rlx_rows(backend: &CpuBackend, kind: RowKernel, rows: usize, cols: usize) -> f64 {
    let store = WeightStore::new();
    let mut slots = Vec::new();
    let x = weight(&store, &mut slots, "x", &[rows, cols], 3);
    let out = BufRef { space: Space::Arena, offset: 0, bytes: (rows * cols * 4) as u64 };
    let t = match kind {
        RowKernel::Softmax => Thunk::Softmax { dtype: DType::F32, outer: rows, len: cols, inner: 1, x, out },
        RowKernel::Gelu => Thunk::Activation { act: rlx_ir::Activation::Gelu, dtype: DType::F32, n: rows * cols, x, out },
        RowKernel::LayerNorm => {
            let gamma = weight(&store, &mut slots, "g", &[cols], 4);
            let beta = weight(&store, &mut slots, "b", &[cols], 5);
            Thunk::Norm { rms: false, dtype: DType::F32, rows, cols, eps: 1e-5, x, residual: None, gamma, beta: Some(beta), out }
        }
    };
    let reps = (1 << 24) / out.bytes as usize + 1;
    let mut exe = executable(backend, t, reps, slots, store, out.bytes);
    reps as f64 * 2.0 * out.bytes as f64 / time_exe(&mut exe) / 1e9
}

/// GB/s (read + written) of a plain parallel copy of the same bytes.
fn memcpy(pool: &rayon::ThreadPool, bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let chunk = bytes.div_ceil(pool.current_num_threads()).max(1);
    let s = best_seconds(|iters| {
        pool.install(|| {
            for _ in 0..iters {
                dst.par_chunks_mut(chunk).zip(src.par_chunks(chunk)).for_each(|(d, s)| d.copy_from_slice(s));
            }
        })
    });
    std::hint::black_box(&dst);
    2.0 * bytes as f64 / s / 1e9
}

#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;

    /// 16 independent FMA chains of 16 lanes: 512 flops per iteration.
    #[target_feature(enable = "avx512f")]
    unsafe fn fma512(iters: u64) -> f32 {
        let (a, b) = (_mm512_set1_ps(0.999), _mm512_set1_ps(0.001));
        let mut acc = [_mm512_set1_ps(0.5); 16];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        let mut s = _mm512_setzero_ps();
        for x in acc {
            s = _mm512_add_ps(s, x);
        }
        _mm512_reduce_add_ps(s)
    }

    /// 12 chains of 8 lanes: 192 flops per iteration.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fma256(iters: u64) -> f32 {
        let (a, b) = (_mm256_set1_ps(0.999), _mm256_set1_ps(0.001));
        let mut acc = [_mm256_set1_ps(0.5); 12];
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        let mut out = [0f32; 8];
        let mut s = _mm256_setzero_ps();
        for x in acc {
            s = _mm256_add_ps(s, x);
        }
        _mm256_storeu_ps(out.as_mut_ptr(), s);
        out.iter().sum()
    }

    /// (label, flops per iteration, kernel).
    pub type Fma = (&'static str, f64, fn(u64) -> f32);

    /// The widest FMA loop the CPU has.
    pub fn kernel() -> Option<Fma> {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature was detected at run time.
            Some(("AVX-512", 512.0, |n| unsafe { fma512(n) }))
        } else if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: as above.
            Some(("AVX2", 192.0, |n| unsafe { fma256(n) }))
        } else {
            None
        }
    }
}

/// Measured FMA peak in GFLOP/s with `threads` threads at once.
fn fma_peak(threads: usize) -> Option<(&'static str, f64)> {
    #[cfg(target_arch = "x86_64")]
    {
        let (label, flops, f) = peak::kernel()?;
        let iters = 4_000_000u64;
        let best = (0..25)
            .map(|_| {
                let t = Instant::now();
                std::thread::scope(|s| {
                    for _ in 0..threads {
                        s.spawn(|| std::hint::black_box(f(std::hint::black_box(iters))));
                    }
                });
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        Some((label, threads as f64 * iters as f64 * flops / best / 1e9))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = threads;
        None
    }
}

struct Numpy {
    header: String,
    gflops: Vec<Option<f64>>,
}

/// Runs bench/numpy_matmul.py with the same thread count and OpenBLAS left
/// to pick its own kernels (OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE removed).
fn numpy(threads: usize) -> Numpy {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/numpy_matmul.py");
    let shapes: Vec<String> = SHAPES.iter().map(|(m, k, n)| format!("{m}x{k}x{n}")).collect();
    let t = threads.to_string();
    let out = Command::new("python3")
        .arg(script)
        .arg(&t)
        .args(&shapes)
        .env_remove("OPENBLAS_CORETYPE")
        .env_remove("OPENBLAS_L2_SIZE")
        .env("OPENBLAS_NUM_THREADS", &t)
        .env("OMP_NUM_THREADS", &t)
        .output();
    let mut np = Numpy { header: String::new(), gflops: vec![None; SHAPES.len()] };
    let text = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        Ok(o) => {
            np.header = format!("numpy failed: {}", String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or(""));
            return np;
        }
        Err(e) => {
            np.header = format!("python3 not runnable: {e}");
            return np;
        }
    };
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if let Some(g) = v.get("gflops").and_then(|g| g.as_f64()) {
            let key = (v["m"].as_u64().unwrap_or(0) as usize, v["k"].as_u64().unwrap_or(0) as usize, v["n"].as_u64().unwrap_or(0) as usize);
            if let Some(i) = SHAPES.iter().position(|s| *s == key) {
                np.gflops[i] = Some(g);
            }
        } else {
            np.header = format!(
                "numpy {} with {} {} (core type {})",
                v["numpy"].as_str().unwrap_or("?"),
                v["blas"].as_str().unwrap_or("?"),
                v["version"].as_str().unwrap_or("?"),
                v["core_type"].as_str().unwrap_or("?")
            );
        }
    }
    np
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".into())
}

/// GFLOP/s (4·B·H·S²·hd, the two products) of fused self-attention reading
/// Q, K, V out of one fused [B, S, 3·H·hd] projection.
fn rlx_attention(backend: &CpuBackend, batch: usize, seq: usize, heads: usize, hd: usize) -> f64 {
    let store = WeightStore::new();
    let mut slots = Vec::new();
    let w = 3 * heads * hd;
    let qkv = weight(&store, &mut slots, "qkv", &[batch, seq, w], 7);
    let view = |off: usize| rlx_schedule::SeqView {
        buf: BufRef { offset: (off * 4) as u64, bytes: qkv.bytes - (off * 4) as u64, ..qkv },
        batch_stride: (seq * w) as u64,
        row_stride: w as u64,
    };
    let out = BufRef { space: Space::Arena, offset: 0, bytes: (batch * seq * heads * hd * 4) as u64 };
    let t = Thunk::Attention(rlx_schedule::AttentionThunk {
        dtype: DType::F32,
        kv_dtype: DType::F32,
        batch,
        heads,
        kv_heads: heads,
        head_dim: hd,
        q_len: seq,
        kv_len: seq,
        scale: 1.0 / (hd as f32).sqrt(),
        causal: false,
        q: view(0),
        k: view(heads * hd),
        v: view(2 * heads * hd),
        mask: None,
        mask_dtype: DType::I32,
        valid_len: None,
        valid_len_per_batch: false,
        out,
    });
    let reps = 4;
    let mut exe = executable(backend, t, reps, slots, store, out.bytes);
    reps as f64 * 4.0 * (batch * heads * seq * seq * hd) as f64 / time_exe(&mut exe) / 1e9
}

/// Microseconds of one `run()` of a schedule with one tiny thunk (nothing
/// else in flight, so it runs on the calling thread): the fixed cost of a
/// call.
fn call_overhead_us(backend: &CpuBackend) -> f64 {
    let store = WeightStore::new();
    let mut slots = Vec::new();
    let x = weight(&store, &mut slots, "x", &[16], 6);
    let out = BufRef { space: Space::Arena, offset: 0, bytes: 64 };
    let t = Thunk::Activation { act: rlx_ir::Activation::Relu, dtype: DType::F32, n: 16, x, out };
    let mut exe = executable(backend, t, 1, slots, store, 64);
    1e6 * best_seconds(|iters| {
        for _ in 0..iters {
            exe.run(&[]).expect("run");
        }
    })
}

fn max_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, y) => x.or(y),
    }
}

fn main() {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads: Vec<usize> = match std::env::var("RLX_BENCH_THREADS") {
        Ok(s) => s.split(',').filter_map(|x| x.trim().parse().ok()).filter(|&n| n > 0).collect(),
        Err(_) if cores > 1 => vec![1, cores],
        Err(_) => vec![1],
    };
    // Rounds alternate RLX and numpy and keep each side's best, so load
    // from other processes on a shared machine hurts neither side more.
    let rounds: usize = std::env::var("RLX_BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3).max(1);
    let row_cases: [(usize, usize); 2] = [(128, 384), (4096, 1024)];
    let only_rows = std::env::var("RLX_BENCH_ONLY_ROWS").is_ok();
    if std::env::var("RLX_BENCH_ONLY_ATTENTION").is_ok() {
        // For profiling the attention kernel alone (e.g. under `perf stat`).
        for &t in &threads {
            let backend = CpuBackend::with_threads(t, rlx_cpu::CpuOptions::default());
            println!("{t} threads: fused attention {:.1} GFLOP/s", rlx_attention(&backend, 1, 128, 12, 32));
        }
        return;
    }
    println!("# rlx-cpu kernels on {} ({cores} cores), best of {rounds} rounds\n", cpu_name());
    for &t in &threads {
        let backend = CpuBackend::with_threads(t, rlx_cpu::CpuOptions::default());
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("pool");
        let mut peak: Option<(&str, f64)> = None;
        let mut np = Numpy { header: String::new(), gflops: vec![None; SHAPES.len()] };
        let mut rlx = vec![0f64; SHAPES.len()];
        let mut rows = vec![(0f64, 0f64, 0f64, 0f64); row_cases.len()];
        // f16 matmul, bf16 matmul, attention GFLOP/s; call overhead µs.
        let mut extra = (0f64, 0f64, 0f64, f64::INFINITY);
        for _ in 0..rounds {
            if only_rows {
                for (i, &(r, c)) in row_cases.iter().enumerate() {
                    let g = |k| rlx_rows(&backend, k, r, c);
                    rows[i] = (
                        rows[i].0.max(memcpy(&pool, r * c * 4)),
                        rows[i].1.max(g(RowKernel::LayerNorm)),
                        rows[i].2.max(g(RowKernel::Softmax)),
                        rows[i].3.max(g(RowKernel::Gelu)),
                    );
                }
                continue;
            }
            if let Some((label, g)) = fma_peak(t) {
                peak = Some((label, peak.map_or(g, |p| p.1.max(g))));
            }
            let n = numpy(t);
            if np.header.is_empty() || !n.header.starts_with("numpy failed") {
                np.header = n.header;
            }
            for i in 0..SHAPES.len() {
                np.gflops[i] = max_opt(np.gflops[i], n.gflops[i]);
                rlx[i] = rlx[i].max(rlx_matmul(&backend, SHAPES[i]));
            }
            extra = (
                extra.0.max(rlx_matmul_of(&backend, SHAPES[0], DType::F16)),
                extra.1.max(rlx_matmul_of(&backend, SHAPES[0], DType::BF16)),
                extra.2.max(rlx_attention(&backend, 1, 128, 12, 32)),
                extra.3.min(call_overhead_us(&backend)),
            );
            for (i, &(r, c)) in row_cases.iter().enumerate() {
                let mc = memcpy(&pool, r * c * 4);
                let g = |k| rlx_rows(&backend, k, r, c);
                rows[i] = (
                    rows[i].0.max(mc),
                    rows[i].1.max(g(RowKernel::LayerNorm)),
                    rows[i].2.max(g(RowKernel::Softmax)),
                    rows[i].3.max(g(RowKernel::Gelu)),
                );
            }
        }
        println!("## {t} thread{}", if t == 1 { "" } else { "s" });
        println!();
        match peak {
            Some((label, g)) => println!("FMA peak ({label} register loop on {t} threads): {g:.1} GFLOP/s  "),
            None => println!("FMA peak: not measured on this CPU  "),
        }
        println!("{}\n", np.header);
        println!("| f32 matmul M×K×N | RLX GFLOP/s | numpy GFLOP/s | RLX / numpy | RLX % of peak | numpy % of peak |");
        println!("|---|---:|---:|---:|---:|---:|");
        let fmt = |v: Option<f64>, d: usize| v.map(|x| format!("{x:.d$}")).unwrap_or_else(|| "-".into());
        for (i, &s) in SHAPES.iter().enumerate() {
            let (r, pk) = (rlx[i], peak.map(|p| p.1));
            println!(
                "| {}×{}×{} | {r:.1} | {} | {} | {} | {} |",
                s.0,
                s.1,
                s.2,
                fmt(np.gflops[i], 1),
                fmt(np.gflops[i].map(|n| r / n), 2),
                fmt(pk.map(|p| 100.0 * r / p), 0),
                fmt(pk.zip(np.gflops[i]).map(|(p, n)| 100.0 * n / p), 0)
            );
        }
        println!();
        println!("| row kernel (f32) | RLX GB/s | memcpy GB/s | RLX / memcpy |");
        println!("|---|---:|---:|---:|");
        for (i, &(r, c)) in row_cases.iter().enumerate() {
            let (mc, ln, sm, ge) = rows[i];
            println!("| LayerNorm {r}×{c} | {ln:.1} | {mc:.1} | {:.2} |", ln / mc);
            println!("| Softmax {r}×{c} | {sm:.1} | {mc:.1} | {:.2} |", sm / mc);
            println!("| GELU (erf) {r}×{c} | {ge:.1} | {mc:.1} | {:.2} |", ge / mc);
        }
        println!();
        if !only_rows {
            let (m, k, n) = SHAPES[0];
            println!("f16 storage matmul {m}×{k}×{n}: {:.1} GFLOP/s  ", extra.0);
            println!("bf16 storage matmul {m}×{k}×{n}: {:.1} GFLOP/s  ", extra.1);
            println!("Fused attention, MiniLM shape (batch 1, seq 128, 12 heads of 32): {:.1} GFLOP/s  ", extra.2);
            println!("Fixed cost of one run() call (1 tiny thunk, nothing else in flight): {:.1} µs\n", extra.3);
        }
    }
}
