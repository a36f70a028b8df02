//! Test support: a small schedule builder that places buffers by hand, and
//! plain f64 reference implementations of every kernel.
#![allow(dead_code)]

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rlx_cpu::CpuBackend;
use rlx_ir::{Activation, DType, Shape};
use rlx_runtime::{Backend, Executable, PrepareOptions, Tensor, WeightStore};
use rlx_schedule::{ArenaSummary, BufRef, ConstBlob, Schedule, Space, TensorSlot, Thunk, WeightSlot};

/// Tolerances (|got - want| / max(|want|, 1)), as the issue states them.
pub const TOL_ELEMENTWISE: f64 = 1e-5;
pub const TOL_MATMUL: f64 = 1e-4;
pub const TOL_HALF: f64 = 1e-2;

pub fn tol(dtype: DType, f32_tol: f64) -> f64 {
    if dtype == DType::F32 {
        f32_tol
    } else {
        TOL_HALF
    }
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Random values in [-1, 1) already rounded to `dtype`, so the reference
/// sees exactly what the kernel sees.
pub fn values(r: &mut StdRng, n: usize, dtype: DType) -> Vec<f64> {
    (0..n).map(|_| round_to(r.random_range(-1.0..1.0), dtype)).collect()
}

pub fn round_to(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        DType::F32 => v as f32 as f64,
        _ => v.trunc(),
    }
}

pub fn tensor(shape: &[usize], dtype: DType, vals: &[f64]) -> Tensor {
    let f: Vec<f32> = vals.iter().map(|v| *v as f32).collect();
    let t = Tensor::from_f32(shape.to_vec(), &f).expect("test tensor");
    t.to_dtype(dtype)
}

pub fn ints(shape: &[usize], dtype: DType, vals: &[i64]) -> Tensor {
    match dtype {
        DType::I64 => Tensor::from_i64(shape.to_vec(), vals).expect("test tensor"),
        _ => Tensor::from_i32(shape.to_vec(), &vals.iter().map(|v| *v as i32).collect::<Vec<_>>()).expect("test tensor"),
    }
}

#[track_caller]
pub fn assert_close(got: &Tensor, want: &[f64], tol: f64, what: &str) {
    let g = got.to_f32();
    assert_eq!(g.len(), want.len(), "{what}: length");
    let mut worst = (0.0f64, 0usize);
    for (i, (a, b)) in g.iter().zip(want).enumerate() {
        let e = (*a as f64 - b).abs() / b.abs().max(1.0);
        if e.is_nan() || e > worst.0 {
            worst = (if e.is_nan() { f64::INFINITY } else { e }, i);
        }
    }
    assert!(worst.0 <= tol, "{what}: error {:.3e} > {tol:.1e} at {} (got {}, want {})", worst.0, worst.1, g[worst.1], want[worst.1]);
}

/// Builds a schedule by placing buffers in the arena, weight, state and
/// const spaces by hand.
#[derive(Default)]
pub struct Plan {
    arena: u64,
    pub inputs: Vec<TensorSlot>,
    pub outputs: Vec<TensorSlot>,
    pub weights: Vec<WeightSlot>,
    pub states: Vec<TensorSlot>,
    pub consts: Vec<ConstBlob>,
    pub thunks: Vec<Thunk>,
    pub store: WeightStore,
}

fn bytes(shape: &[usize], dtype: DType) -> u64 {
    (shape.iter().product::<usize>() * dtype.size()) as u64
}

impl Plan {
    pub fn new() -> Plan {
        Plan::default()
    }
    /// A fresh arena buffer (256-byte aligned like the real planner).
    pub fn buf(&mut self, bytes: u64) -> BufRef {
        let b = BufRef { space: Space::Arena, offset: self.arena, bytes };
        self.arena += bytes.div_ceil(256) * 256 + 256;
        b
    }
    pub fn tmp(&mut self, shape: &[usize], dtype: DType) -> BufRef {
        self.buf(bytes(shape, dtype))
    }
    pub fn input(&mut self, name: &str, shape: &[usize], dtype: DType) -> BufRef {
        let b = self.tmp(shape, dtype);
        self.inputs.push(TensorSlot { name: name.into(), shape: Shape::new(shape.to_vec()), dtype, buf: b });
        b
    }
    pub fn output(&mut self, name: &str, shape: &[usize], dtype: DType) -> BufRef {
        let b = self.tmp(shape, dtype);
        self.output_at(name, shape, dtype, b);
        b
    }
    /// Declares an existing buffer as an output (e.g. one written in place).
    pub fn output_at(&mut self, name: &str, shape: &[usize], dtype: DType, b: BufRef) {
        self.outputs.push(TensorSlot { name: name.into(), shape: Shape::new(shape.to_vec()), dtype, buf: b });
    }
    pub fn weight(&mut self, name: &str, t: Tensor) -> BufRef {
        let i = self.weights.len() as u32;
        let b = BufRef { space: Space::Weight(i), offset: 0, bytes: t.bytes().len() as u64 };
        self.weights.push(WeightSlot {
            name: name.into(),
            parts: vec![name.into()],
            concat_axis: 0,
            shape: t.shape().clone(),
            dtype: t.dtype(),
        });
        self.store.set(name, t).expect("set weight");
        b
    }
    pub fn state(&mut self, name: &str, shape: &[usize], dtype: DType) -> BufRef {
        let i = self.states.len() as u32;
        let b = BufRef { space: Space::State(i), offset: 0, bytes: bytes(shape, dtype) };
        self.states.push(TensorSlot { name: name.into(), shape: Shape::new(shape.to_vec()), dtype, buf: b });
        b
    }
    pub fn konst(&mut self, t: &Tensor) -> BufRef {
        let i = self.consts.len() as u32;
        self.consts.push(ConstBlob { shape: t.shape().clone(), dtype: t.dtype(), data: t.bytes().to_vec() });
        BufRef { space: Space::Const(i), offset: 0, bytes: t.bytes().len() as u64 }
    }
    pub fn push(&mut self, t: Thunk) {
        self.thunks.push(t);
    }
    pub fn schedule(&self) -> Schedule {
        Schedule {
            thunks: self.thunks.clone(),
            arena_bytes: self.arena,
            inputs: self.inputs.clone(),
            outputs: self.outputs.clone(),
            weights: self.weights.clone(),
            states: self.states.clone(),
            consts: self.consts.clone(),
            arena: ArenaSummary::default(),
        }
    }
    pub fn prepare(self, slots: usize) -> rlx_runtime::Result<Box<dyn Executable>> {
        let s = Arc::new(self.schedule());
        let opts = PrepareOptions { slots, ..PrepareOptions::default() };
        CpuBackend::new().prepare(s, Arc::new(self.store), &opts)
    }
    /// Prepares and runs once.
    pub fn run(self, inputs: &[(&str, &Tensor)]) -> rlx_runtime::Result<Vec<Tensor>> {
        self.prepare(1)?.run(inputs)
    }
}

// ---- f64 reference implementations -------------------------------------

/// erf by its Maclaurin series for |x| < 2.5 and by the continued fraction
/// of erfc beyond (where the series loses digits to cancellation).
pub fn erf_ref(x: f64) -> f64 {
    if x.abs() >= 2.5 {
        let a = x.abs();
        let mut t = a;
        for n in (1..=80).rev() {
            t = a + (n as f64 / 2.0) / t;
        }
        let erfc = (-a * a).exp() / (std::f64::consts::PI.sqrt() * t);
        return (1.0 - erfc).copysign(x);
    }
    let mut term = x;
    let mut sum = x;
    for n in 1..200 {
        term *= -x * x / n as f64;
        let t = term / (2 * n + 1) as f64;
        sum += t;
        if t.abs() < 1e-17 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

pub fn act_ref(a: Activation, x: f64) -> f64 {
    match a {
        Activation::Gelu => 0.5 * x * (1.0 + erf_ref(x / std::f64::consts::SQRT_2)),
        Activation::GeluTanh => 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()),
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::Relu => x.max(0.0),
        Activation::Tanh => x.tanh(),
    }
}

pub fn softmax_ref(v: &[f64]) -> Vec<f64> {
    let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = v.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// Row-major strides of a shape.
pub fn strides(shape: &[usize]) -> Vec<u64> {
    Shape::new(shape.to_vec()).strides().iter().map(|&s| s as u64).collect()
}

/// The value at multi-index `idx` of a strided view.
pub fn at(data: &[f64], idx: &[usize], strides: &[u64]) -> f64 {
    data[idx.iter().zip(strides).map(|(i, s)| i * *s as usize).sum::<usize>()]
}

/// Multi-index of flat row-major position `flat` in `shape`.
pub fn unflatten(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = flat % shape[d];
        flat /= shape[d];
    }
    idx
}
