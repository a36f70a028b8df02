//! Test harness: hand-built schedules, random tensors, and a runner that
//! checks the GPU (replay and eager) against the CPU backend.
#![allow(dead_code)]

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rlx_cuda::CudaBackend;
use rlx_ir::{DType, Shape};
use rlx_runtime::{Backend, PrepareOptions, Tensor, WeightStore};
use rlx_schedule::{ArenaSummary, AttentionThunk, BufRef, Schedule, SeqView, Space, TensorSlot, Thunk, WeightSlot, ARENA_ALIGN};

/// The GPU backend, or None (with the reason printed) when no GPU is usable.
/// With RLX_REQUIRE_GPU=1 a missing GPU fails the test instead.
pub fn gpu() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var("RLX_REQUIRE_GPU").map(|v| v == "1").unwrap_or(false) {
                panic!("RLX_REQUIRE_GPU=1 but no usable GPU: {e}");
            }
            eprintln!("skipping GPU test: {e}");
            None
        }
    }
}

/// For thunk tests: Some(Some(gpu)), or Some(None) for a CPU-only dry run
/// (RLX_TEST_DRY_RUN=1: checks that the test schedules are valid on a machine
/// without a GPU), or None to skip.
pub fn gpu_or_dry() -> Option<Option<CudaBackend>> {
    match gpu() {
        Some(g) => Some(Some(g)),
        None if std::env::var("RLX_TEST_DRY_RUN").map(|v| v == "1").unwrap_or(false) => Some(None),
        None => None,
    }
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Builds a schedule: every tensor gets its own 256-aligned arena range.
pub struct Sb {
    pub s: Schedule,
    pub store: WeightStore,
}

impl Default for Sb {
    fn default() -> Self {
        Self::new()
    }
}

impl Sb {
    pub fn new() -> Sb {
        Sb {
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
        }
    }
    pub fn scratch(&mut self, bytes: u64) -> BufRef {
        let off = self.s.arena_bytes;
        self.s.arena_bytes += bytes.div_ceil(ARENA_ALIGN).max(1) * ARENA_ALIGN;
        BufRef { space: Space::Arena, offset: off, bytes }
    }
    pub fn input(&mut self, name: &str, shape: &[usize], dt: DType) -> BufRef {
        let b = self.scratch((shape.iter().product::<usize>() * dt.size()) as u64);
        self.s.inputs.push(TensorSlot { name: name.into(), shape: Shape(shape.to_vec()), dtype: dt, buf: b });
        b
    }
    pub fn output(&mut self, name: &str, shape: &[usize], dt: DType) -> BufRef {
        let b = self.scratch((shape.iter().product::<usize>() * dt.size()) as u64);
        self.mark_output(name, shape, dt, b);
        b
    }
    pub fn mark_output(&mut self, name: &str, shape: &[usize], dt: DType, b: BufRef) {
        self.s.outputs.push(TensorSlot { name: name.into(), shape: Shape(shape.to_vec()), dtype: dt, buf: b });
    }
    /// A weight with random values in the store, referenced by its slot.
    pub fn weight(&mut self, name: &str, shape: &[usize], dt: DType, r: &mut StdRng) -> BufRef {
        let t = rand_tensor(r, shape, DType::F32);
        self.store.set(name, t).expect("test weight");
        let i = self.s.weights.len() as u32;
        self.s.weights.push(WeightSlot {
            name: name.into(),
            parts: vec![name.into()],
            concat_axis: 0,
            shape: Shape(shape.to_vec()),
            dtype: dt,
        });
        BufRef { space: Space::Weight(i), offset: 0, bytes: (shape.iter().product::<usize>() * dt.size()) as u64 }
    }
    pub fn state(&mut self, name: &str, shape: &[usize], dt: DType) -> BufRef {
        let i = self.s.states.len() as u32;
        let b = BufRef { space: Space::State(i), offset: 0, bytes: (shape.iter().product::<usize>() * dt.size()) as u64 };
        self.s.states.push(TensorSlot { name: name.into(), shape: Shape(shape.to_vec()), dtype: dt, buf: b });
        b
    }
    pub fn thunk(&mut self, t: Thunk) {
        self.s.thunks.push(t);
    }
    pub fn finish(self) -> (Arc<Schedule>, Arc<WeightStore>) {
        (Arc::new(self.s), Arc::new(self.store))
    }
}

/// Uniform values in [-1, 1), rounded to `dt`.
pub fn rand_tensor(r: &mut StdRng, shape: &[usize], dt: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect();
    Tensor::from_f32(shape.to_vec(), &v).expect("shape").to_dtype(dt)
}

pub fn tol(dt: DType) -> (f64, f64) {
    match dt {
        DType::F32 => (2e-4, 2e-4),
        DType::F16 => (6e-3, 1e-2),
        DType::BF16 => (4e-2, 3e-2),
        _ => (0.0, 0.0),
    }
}

/// Asserts |gpu - cpu| <= atol + rtol * |cpu| elementwise (exact for ints).
pub fn assert_close(what: &str, gpu: &Tensor, cpu: &Tensor, scale: f64) {
    assert_close_floor(what, gpu, cpu, scale, 0.0)
}

/// As `assert_close`, but no element's limit is below `floor_steps` storage
/// rounding steps at the reference's RMS: for outputs that are sums of many
/// large terms (cancellation leaves small elements with the absolute error
/// of the large terms).
pub fn assert_close_floor(what: &str, gpu: &Tensor, cpu: &Tensor, scale: f64, floor_steps: f64) {
    let c = cpu.to_f32();
    let rms = (c.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>() / c.len().max(1) as f64).sqrt();
    let mant = match cpu.dtype() {
        DType::F16 => 10,
        DType::BF16 => 7,
        _ => 23,
    };
    let floor = floor_steps * rms * 2f64.powi(-mant);
    assert_eq!(gpu.shape(), cpu.shape(), "{what}: shape");
    assert_eq!(gpu.dtype(), cpu.dtype(), "{what}: dtype");
    let (atol, rtol) = tol(gpu.dtype());
    let (g, c) = (gpu.to_f32(), cpu.to_f32());
    let mut worst = (0.0f64, 0usize);
    for (i, (a, b)) in g.iter().zip(&c).enumerate() {
        let d = (*a as f64 - *b as f64).abs();
        let lim = ((atol + rtol * (*b as f64).abs()) * scale).max(floor);
        let bad = if a.is_nan() || b.is_nan() { a.is_nan() != b.is_nan() } else { d > lim };
        if bad {
            panic!("{what}: element {i}: gpu {a} vs cpu {b} (|diff| {d:e} > {lim:e}); {} elements", g.len());
        }
        if d > worst.0 {
            worst = (d, i);
        }
    }
    eprintln!("{what}: ok, {} elements, max |diff| {:e}", g.len(), worst.0);
}

pub fn run(
    b: &dyn Backend,
    s: &Arc<Schedule>,
    w: &Arc<WeightStore>,
    inputs: &[(String, Tensor)],
    replay: bool,
) -> Result<Vec<Tensor>, rlx_runtime::RuntimeError> {
    let opts = PrepareOptions { slots: 2, replay, allow_tf32: false, ..PrepareOptions::default() };
    let mut e = b.prepare(s.clone(), w.clone(), &opts)?;
    let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    e.run(&refs)
}

/// Runs on the CPU, on the GPU with replay and eager; compares the GPU with
/// the CPU (tolerance x `scale`) and replay with eager (bit for bit).
pub fn check(what: &str, g: &Option<CudaBackend>, s: &Arc<Schedule>, w: &Arc<WeightStore>, inputs: &[(String, Tensor)], scale: f64) {
    check_floor(what, g, s, w, inputs, scale, 0.0)
}

/// `check` with `assert_close_floor`'s floor of `floor_steps` rounding steps at the output's RMS.
pub fn check_floor(
    what: &str,
    g: &Option<CudaBackend>,
    s: &Arc<Schedule>,
    w: &Arc<WeightStore>,
    inputs: &[(String, Tensor)],
    scale: f64,
    floor_steps: f64,
) {
    let cpu = rlx_cpu::CpuBackend::new();
    let want = run(&cpu, s, w, inputs, true).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
    let Some(g) = g else {
        eprintln!("{what}: dry run, cpu ok");
        return;
    };
    let replay = run(g, s, w, inputs, true).unwrap_or_else(|e| panic!("{what}: gpu replay: {e}"));
    let eager = run(g, s, w, inputs, false).unwrap_or_else(|e| panic!("{what}: gpu eager: {e}"));
    for (i, ((r, e), c)) in replay.iter().zip(&eager).zip(&want).enumerate() {
        assert_eq!(r.bytes(), e.bytes(), "{what}: output {i}: replay and eager differ");
        assert_close_floor(&format!("{what} [out {i}]"), r, c, scale, floor_steps);
    }
}

pub fn named(v: Vec<(&str, Tensor)>) -> Vec<(String, Tensor)> {
    v.into_iter().map(|(n, t)| (n.to_string(), t)).collect()
}

/// Self-attention reading Q, K and V straight out of one fused `[batch, seq,
/// 3h]` projection (views into `qkv`), scale 1/sqrt(head_dim), an optional
/// key-padding mask of the given dtype; out `[batch, seq, h]`.
#[allow(clippy::too_many_arguments)]
pub fn fused_qkv_attention(
    dt: DType,
    batch: usize,
    seq: usize,
    h: usize,
    heads: usize,
    qkv: BufRef,
    mask: Option<(BufRef, DType)>,
    out: BufRef,
) -> Thunk {
    let hd = h / heads;
    let view = |off: usize| SeqView {
        // The view ends where the fused tensor ends.
        buf: BufRef { offset: qkv.offset + (off * dt.size()) as u64, bytes: qkv.bytes - (off * dt.size()) as u64, ..qkv },
        batch_stride: (seq * 3 * h) as u64,
        row_stride: (3 * h) as u64,
    };
    Thunk::Attention(AttentionThunk {
        dtype: dt,
        kv_dtype: dt,
        batch,
        heads,
        kv_heads: heads,
        head_dim: hd,
        q_len: seq,
        kv_len: seq,
        scale: 1.0 / (hd as f32).sqrt(),
        causal: false,
        q: view(0),
        k: view(h),
        v: view(2 * h),
        mask: mask.map(|m| m.0),
        mask_dtype: mask.map(|m| m.1).unwrap_or(DType::F32),
        valid_len: None,
        valid_len_per_batch: false,
        out,
    })
}

/// `[rows, k] · B` (+bias, activation, +residual) as one batch: B a weight
/// stored `[k, n]`, or `[n, k]` with `b_trans` (a Linear layer's layout).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    dt: DType,
    rows: usize,
    n: usize,
    k: usize,
    a: BufRef,
    b: BufRef,
    b_trans: bool,
    bias: Option<BufRef>,
    act: Option<rlx_ir::Activation>,
    residual: Option<BufRef>,
    out: BufRef,
) -> Thunk {
    Thunk::MatMul(rlx_schedule::MatMulThunk {
        dtype: dt,
        batch: 1,
        m: rows,
        n,
        k,
        a,
        lda: k as u64,
        a_batch_stride: (rows * k) as u64,
        b,
        b_trans,
        ldb: if b_trans { k } else { n } as u64,
        b_batch_stride: 0,
        bias,
        act,
        residual,
        out,
    })
}
