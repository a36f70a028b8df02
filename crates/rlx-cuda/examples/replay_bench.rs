//! Replay vs eager on BERT-shaped encoders (seeded random weights, fp16):
//! median latency per call (submit + wait), host time per submit, kernels per
//! forward. Usage: replay_bench [RUNS] (default 200). Needs a GPU.
//! `replay_bench host [RUNS]` instead splits the host time of a replayed
//! submit by phase under several conditions (see `host_experiment`).
//!
//! The schedule is built by hand, thunk by thunk, as the compiler lowers a
//! BERT encoder: embedding gather + position add + LayerNorm, then per layer
//! QKV matmul+bias, fused attention on strided QKV, out-projection with the
//! residual fused, LayerNorm, FFN1+bias+erf-GELU, FFN2+bias+residual, LayerNorm.

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::f16;
use rlx_cuda::CudaBackend;
use rlx_ir::{Activation, BinaryOp, DType, Shape};
use rlx_runtime::{Backend, Executable, PrepareOptions, Tensor, WeightStore};
use rlx_schedule::{
    ArenaSummary, AttentionThunk, BufRef, MatMulThunk, Schedule, SeqView, Space, TensorSlot, Thunk, WeightSlot, ARENA_ALIGN,
};

struct Model {
    name: &'static str,
    h: usize,
    heads: usize,
    layers: usize,
    ffn: usize,
}

struct Builder {
    s: Schedule,
    store: WeightStore,
    seed: u64,
}

impl Builder {
    fn scratch(&mut self, elems: usize) -> BufRef {
        let bytes = (elems * 2) as u64;
        let off = self.s.arena_bytes;
        self.s.arena_bytes += bytes.div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
        BufRef { space: Space::Arena, offset: off, bytes }
    }
    fn weight(&mut self, name: &str, shape: &[usize], scale: f32) -> BufRef {
        let n: usize = shape.iter().product();
        // xorshift: fast, seeded, good enough for benchmark weights.
        let mut x = self.seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        self.seed += 1;
        let v: Vec<f16> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                f16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            })
            .collect();
        let t = Tensor::from_f16(shape.to_vec(), &v).unwrap_or_else(|e| fail(&e.to_string()));
        self.store.set(name, t).unwrap_or_else(|e| fail(&e.to_string()));
        let i = self.s.weights.len() as u32;
        self.s.weights.push(WeightSlot {
            name: name.into(),
            parts: vec![name.into()],
            concat_axis: 0,
            shape: Shape(shape.to_vec()),
            dtype: DType::F16,
        });
        BufRef { space: Space::Weight(i), offset: 0, bytes: (n * 2) as u64 }
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("replay_bench: {msg}");
    std::process::exit(1)
}

fn build(m: &Model, batch: usize, seq: usize, small_out: bool) -> (Arc<Schedule>, Arc<WeightStore>) {
    let dt = DType::F16;
    let (h, rows) = (m.h, batch * seq);
    let hd = h / m.heads;
    let mut b = Builder {
        s: Schedule {
            thunks: vec![],
            arena_bytes: 0,
            inputs: vec![],
            outputs: vec![],
            weights: vec![],
            states: vec![],
            consts: vec![],
            arena: ArenaSummary::default(),
        },
        store: WeightStore::new(),
        seed: 7,
    };
    let ids = b.scratch(rows * 2); // i32: 4 bytes = 2 f16 slots
    b.s.inputs.push(TensorSlot { name: "ids".into(), shape: Shape(vec![batch, seq]), dtype: DType::I32, buf: ids });
    let mask = b.scratch(rows * 2);
    b.s.inputs.push(TensorSlot { name: "mask".into(), shape: Shape(vec![batch, seq]), dtype: DType::I32, buf: mask });
    let vocab = 30522;
    let wemb = b.weight("word_emb", &[vocab, h], 0.5);
    let pemb = b.weight("pos_emb", &[seq, h], 0.5);
    let e0 = b.scratch(rows * h);
    b.s.thunks.push(Thunk::Gather { dtype: dt, id_dtype: DType::I32, n: rows, dim: h, vocab, table: wemb, ids, out: e0 });
    let e1 = b.scratch(rows * h);
    b.s.thunks.push(Thunk::Binary {
        op: BinaryOp::Add,
        dtype: dt,
        out_shape: vec![batch, seq, h],
        a: e0,
        a_strides: vec![(seq * h) as u64, h as u64, 1],
        b: pemb,
        b_strides: vec![0, h as u64, 1],
        out: e1,
    });
    let g = b.weight("emb_ln_g", &[h], 1.0);
    let be = b.weight("emb_ln_b", &[h], 0.1);
    let mut x = b.scratch(rows * h);
    b.s.thunks.push(Thunk::Norm {
        rms: false,
        dtype: dt,
        rows,
        cols: h,
        eps: 1e-12,
        x: e1,
        residual: None,
        gamma: g,
        beta: Some(be),
        out: x,
    });
    let mm = |a, w, bias, act, residual, out, n: usize, k: usize| {
        Thunk::MatMul(MatMulThunk {
            dtype: dt,
            batch: 1,
            m: rows,
            n,
            k,
            a,
            lda: k as u64,
            a_batch_stride: (rows * k) as u64,
            b: w,
            b_trans: false,
            ldb: n as u64,
            b_batch_stride: 0,
            bias,
            act,
            residual,
            out,
        })
    };
    let ws = 1.0 / (h as f32).sqrt();
    for l in 0..m.layers {
        let p = |s: &str| format!("l{l}.{s}");
        let wqkv = b.weight(&p("wqkv"), &[h, 3 * h], ws);
        let bqkv = b.weight(&p("bqkv"), &[3 * h], 0.1);
        let qkv = b.scratch(rows * 3 * h);
        b.s.thunks.push(mm(x, wqkv, Some(bqkv), None, None, qkv, 3 * h, h));
        let view = |off: usize| SeqView {
            buf: BufRef { offset: qkv.offset + (off * 2) as u64, bytes: qkv.bytes - (off * 2) as u64, ..qkv },
            batch_stride: (seq * 3 * h) as u64,
            row_stride: (3 * h) as u64,
        };
        let att = b.scratch(rows * h);
        b.s.thunks.push(Thunk::Attention(AttentionThunk {
            dtype: dt,
            kv_dtype: dt,
            batch,
            heads: m.heads,
            kv_heads: m.heads,
            head_dim: hd,
            q_len: seq,
            kv_len: seq,
            scale: 1.0 / (hd as f32).sqrt(),
            causal: false,
            q: view(0),
            k: view(h),
            v: view(2 * h),
            mask: Some(mask),
            mask_dtype: DType::I32,
            valid_len: None,
            valid_len_per_batch: false,
            out: att,
        }));
        let wo = b.weight(&p("wo"), &[h, h], ws);
        let bo = b.weight(&p("bo"), &[h], 0.1);
        let proj = b.scratch(rows * h);
        b.s.thunks.push(mm(att, wo, Some(bo), None, Some(x), proj, h, h));
        let (g1, b1) = (b.weight(&p("ln1_g"), &[h], 1.0), b.weight(&p("ln1_b"), &[h], 0.1));
        let n1 = b.scratch(rows * h);
        b.s.thunks.push(Thunk::Norm {
            rms: false,
            dtype: dt,
            rows,
            cols: h,
            eps: 1e-12,
            x: proj,
            residual: None,
            gamma: g1,
            beta: Some(b1),
            out: n1,
        });
        let (w1, bias1) = (b.weight(&p("w1"), &[h, m.ffn], ws), b.weight(&p("b1"), &[m.ffn], 0.1));
        let f1 = b.scratch(rows * m.ffn);
        b.s.thunks.push(mm(n1, w1, Some(bias1), Some(Activation::Gelu), None, f1, m.ffn, h));
        let (w2, bias2) = (b.weight(&p("w2"), &[m.ffn, h], 1.0 / (m.ffn as f32).sqrt()), b.weight(&p("b2"), &[h], 0.1));
        let f2 = b.scratch(rows * h);
        b.s.thunks.push(mm(f1, w2, Some(bias2), None, Some(n1), f2, h, m.ffn));
        let (g2, b2) = (b.weight(&p("ln2_g"), &[h], 1.0), b.weight(&p("ln2_b"), &[h], 0.1));
        let out = b.scratch(rows * h);
        b.s.thunks.push(Thunk::Norm {
            rms: false,
            dtype: dt,
            rows,
            cols: h,
            eps: 1e-12,
            x: f2,
            residual: None,
            gamma: g2,
            beta: Some(b2),
            out,
        });
        x = out;
    }
    if small_out {
        // First token's hidden state only: a pooled-size copy-out.
        b.s.outputs.push(TensorSlot {
            name: "hidden".into(),
            shape: Shape(vec![1, h]),
            dtype: dt,
            buf: BufRef { bytes: (h * 2) as u64, ..x },
        });
    } else {
        b.s.outputs.push(TensorSlot { name: "hidden".into(), shape: Shape(vec![batch, seq, h]), dtype: dt, buf: x });
    }
    (Arc::new(b.s), Arc::new(b.store))
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

struct Measured {
    latency: Duration,
    /// Per call with two calls in flight (submit runs while the GPU works).
    pipelined: Duration,
    host: Duration,
    kernels: usize,
    out: Vec<u8>,
}

fn measure(e: &mut Box<dyn Executable>, inputs: &[(&str, &Tensor)], runs: usize) -> Measured {
    for _ in 0..20 {
        e.run(inputs).unwrap_or_else(|err| fail(&err.to_string()));
    }
    let mut lat = Vec::with_capacity(runs);
    let mut out = Vec::new();
    for _ in 0..runs {
        let t0 = Instant::now();
        let t = e.submit(inputs).unwrap_or_else(|err| fail(&err.to_string()));
        let o = e.wait(t).unwrap_or_else(|err| fail(&err.to_string()));
        lat.push(t0.elapsed());
        out = o[0].bytes().to_vec();
    }
    // Pipelined: one call always queued behind the running one.
    let mut host = Vec::with_capacity(runs);
    let t0 = Instant::now();
    let mut prev = Some(e.submit(inputs).unwrap_or_else(|err| fail(&err.to_string())));
    for _ in 1..runs {
        let t = e.submit(inputs).unwrap_or_else(|err| fail(&err.to_string()));
        host.push(e.stats().last_host_time);
        if let Some(p) = prev.replace(t) {
            e.wait(p).unwrap_or_else(|err| fail(&err.to_string()));
        }
    }
    if let Some(p) = prev {
        e.wait(p).unwrap_or_else(|err| fail(&err.to_string()));
    }
    let pipelined = t0.elapsed() / runs as u32;
    if host.is_empty() {
        host.push(Duration::ZERO);
    }
    Measured { latency: median(lat), pipelined, host: median(host), kernels: e.stats().kernels_per_call, out }
}

fn inputs_for(batch: usize, seq: usize) -> (Tensor, Tensor) {
    let ids: Vec<i32> = (0..batch * seq).map(|i| ((i * 7919) % 30000) as i32 + 100).collect();
    let mut mask = vec![1i32; batch * seq];
    for bi in 0..batch {
        for j in seq - (bi % 17)..seq {
            mask[bi * seq + j] = 0;
        }
    }
    let ids = Tensor::from_i32(vec![batch, seq], &ids).unwrap_or_else(|e| fail(&e.to_string()));
    let mask = Tensor::from_i32(vec![batch, seq], &mask).unwrap_or_else(|e| fail(&e.to_string()));
    (ids, mask)
}

/// Why a replayed submit costs more at 32x128 than at 1x128: median host
/// time per phase (check, stage, launch, record) of a submit issued right
/// after the previous wait, after that wait plus 3 ms of CPU spinning or of
/// sleeping, and with the previous call still in flight; for the full
/// hidden state and a one-row output and for a 3-kernel graph.
fn host_experiment(g: &CudaBackend, runs: usize) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let bert = Model { name: "bert-base shape", h: 768, heads: 12, layers: 12, ffn: 3072 };
    // layers 0: no encoder layer (gather, position add, LayerNorm: 3 kernels).
    let tiny = Model { name: "embeddings only", h: 768, heads: 12, layers: 0, ffn: 3072 };
    println!("| shape | graph, output | condition | check | stage | launch | record | total (us) |");
    println!("|---|---|---|---|---|---|---|---|");
    for (batch, seq) in [(1usize, 128usize), (32, 128)] {
        let (ids, mask) = inputs_for(batch, seq);
        let inputs = [("ids", &ids), ("mask", &mask)];
        for (model, small) in [(&bert, false), (&bert, true), (&tiny, true)] {
            let (s, w) = build(model, batch, seq, small);
            let mut e = g
                .prepare_cuda(
                    s.clone(),
                    w.clone(),
                    &PrepareOptions { slots: 2, replay: true, allow_tf32: false, ..PrepareOptions::default() },
                )
                .unwrap_or_else(|e| fail(&e.to_string()));
            for _ in 0..10 {
                e.run(&inputs).unwrap_or_else(|err| fail(&err.to_string()));
            }
            for cond in ["after wait", "after wait + 3 ms spin", "after wait + 3 ms sleep", "previous in flight"] {
                let ph = timed_submits(&mut e, &inputs, runs, cond);
                let m: Vec<String> = ph.into_iter().take(5).map(|v| format!("{:.1}", us(median(v)))).collect();
                println!("| {batch}x{seq} | {} {} | {cond} | {} |", model.name, if small { "1 row" } else { "hidden" }, m.join(" | "));
            }
        }
    }
}

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}
extern "C" {
    fn clock_gettime(clk: i32, ts: *mut Timespec) -> i32;
}
fn thread_cpu() -> Duration {
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: CLOCK_THREAD_CPUTIME_ID = 3 on Linux; t is a valid timespec.
    unsafe { clock_gettime(3, &mut t) };
    Duration::new(t.sec as u64, t.nsec as u32)
}

/// `runs` submits of one executable under `cond` ("after wait", "after
/// wait + 3 ms spin", "after wait + 3 ms sleep" or "previous in flight"):
/// per submit its four phases (check, stage, launch, record), its wall time
/// and the calling thread's CPU time.
fn timed_submits(e: &mut rlx_cuda::CudaExecutable, inputs: &[(&str, &Tensor)], runs: usize, cond: &str) -> [Vec<Duration>; 6] {
    let mut ph: [Vec<Duration>; 6] = Default::default();
    let mut prev = None;
    for _ in 0..runs {
        match cond {
            "after wait + 3 ms spin" => {
                let t = Instant::now();
                while t.elapsed() < Duration::from_millis(3) {
                    std::hint::spin_loop();
                }
            }
            "after wait + 3 ms sleep" => std::thread::sleep(Duration::from_millis(3)),
            _ => {}
        }
        let (t0, c0) = (Instant::now(), thread_cpu());
        let t = e.submit(inputs).unwrap_or_else(|err| fail(&err.to_string()));
        let (wall, cpu) = (t0.elapsed(), thread_cpu() - c0);
        for (i, d) in e.last_submit_phases().into_iter().chain([wall, cpu]).enumerate() {
            ph[i].push(d);
        }
        if cond == "previous in flight" {
            if let Some(p) = prev.replace(t) {
                e.wait(p).unwrap_or_else(|err| fail(&err.to_string()));
            }
        } else {
            e.wait(t).unwrap_or_else(|err| fail(&err.to_string()));
        }
    }
    if let Some(p) = prev {
        e.wait(p).unwrap_or_else(|err| fail(&err.to_string()));
    }
    ph
}

/// Median submit wall time and thread CPU time (equal: the host is busy,
/// not blocked) and the launch phase, bert-base at 1x128 and 32x128, right
/// after the previous wait and with the previous call in flight.
fn scale_experiment(g: &CudaBackend, runs: usize) {
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let bert = Model { name: "bert-base shape", h: 768, heads: 12, layers: 12, ffn: 3072 };
    println!("| model | shape | condition | submit wall us | submit cpu us | launch wall us |");
    println!("|---|---|---|---|---|---|");
    for model in [&bert] {
        for batch in [1usize, 32] {
            let seq = 128;
            let (ids, mask) = inputs_for(batch, seq);
            let inputs = [("ids", &ids), ("mask", &mask)];
            let (s, w) = build(model, batch, seq, true);
            let mut e = g
                .prepare_cuda(
                    s.clone(),
                    w.clone(),
                    &PrepareOptions { slots: 2, replay: true, allow_tf32: false, ..PrepareOptions::default() },
                )
                .unwrap_or_else(|e| fail(&e.to_string()));
            for _ in 0..10 {
                e.run(&inputs).unwrap_or_else(|err| fail(&err.to_string()));
            }
            for cond in ["after wait", "previous in flight"] {
                let [_, _, launch, _, wall, cpu] = timed_submits(&mut e, &inputs, runs, cond);
                println!(
                    "| {} | {batch}x{seq} | {cond} | {:.1} | {:.1} | {:.1} |",
                    model.name,
                    us(median(wall)),
                    us(median(cpu)),
                    us(median(launch))
                );
            }
        }
    }
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("scale") {
        let g = CudaBackend::new(0).unwrap_or_else(|e| fail(&e.to_string()));
        scale_experiment(&g, std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(100));
        return;
    }
    let host_mode = std::env::args().nth(1).as_deref() == Some("host");
    let runs: usize = std::env::args().nth(if host_mode { 2 } else { 1 }).and_then(|a| a.parse().ok()).unwrap_or(200).max(1);
    let g = CudaBackend::new(0).unwrap_or_else(|e| fail(&e.to_string()));
    if host_mode {
        println!("device: {}", g.device_name());
        host_experiment(&g, runs);
        return;
    }
    println!("device: {}", g.device_name());
    println!("fp16, seeded random weights, median of {runs} calls after 20 warm-up calls; latency = submit + wait (inputs staged, outputs copied back); host time = median submit() with the previous call still running\n");
    println!("| model | batch x seq | RLX replay (us) | RLX eager (us) | eager / replay | replay, 2 in flight (us/call) | host time per replayed submit (us) | kernels per forward |");
    println!("|---|---|---|---|---|---|---|---|");
    let models = [
        Model { name: "all-MiniLM-L6-v2 shape", h: 384, heads: 12, layers: 6, ffn: 1536 },
        Model { name: "bert-base shape", h: 768, heads: 12, layers: 12, ffn: 3072 },
    ];
    for m in &models {
        for (batch, seq) in [(1usize, 128usize), (32, 128)] {
            let (s, w) = build(m, batch, seq, false);
            let (ids, mask) = inputs_for(batch, seq);
            let inputs = [("ids", &ids), ("mask", &mask)];
            let mut rep = g
                .prepare(s.clone(), w.clone(), &PrepareOptions { slots: 2, replay: true, allow_tf32: false, ..PrepareOptions::default() })
                .unwrap_or_else(|e| fail(&e.to_string()));
            let mut eag = g
                .prepare(s, w, &PrepareOptions { slots: 2, replay: false, allow_tf32: false, ..PrepareOptions::default() })
                .unwrap_or_else(|e| fail(&e.to_string()));
            let r = measure(&mut rep, &inputs, runs);
            let e = measure(&mut eag, &inputs, runs);
            if r.out != e.out {
                fail(&format!("{} {batch}x{seq}: replay and eager outputs differ", m.name));
            }
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            println!(
                "| {} | {batch}x{seq} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | {} |",
                m.name,
                us(r.latency),
                us(e.latency),
                us(e.latency) / us(r.latency),
                us(r.pipelined),
                us(r.host),
                r.kernels
            );
        }
    }
}
