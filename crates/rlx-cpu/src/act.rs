//! Activation functions, computed in f32 (exact GELU through a rational erf;
//! `erf` itself, in f64, for references).

use rlx_ir::Activation;

/// erf on [0, 4] as one degree-18 polynomial in (x - 2), least-squares
/// fitted on Chebyshev nodes against an accurate erf (max error 5e-9 when
/// evaluated in f64). One polynomial and no table keeps the loop branch-free
/// so it vectorises; past 4, erf(x) = 1 to within 1.6e-8.
const ERF_POLY: [f64; 19] = [
    0.9953222683432537,
    0.020666992141498836,
    -0.0413341386721828,
    0.048222887886379934,
    -0.03444357233564057,
    0.013089294327024487,
    0.00045470628292922717,
    -0.00337891053233602,
    0.0015985834849692197,
    -5.0700255825014675e-05,
    -0.0002700271340924822,
    0.00010473776907269366,
    9.468413802635462e-06,
    -1.7015201307692543e-05,
    2.395437980619426e-06,
    1.3158438847469405e-06,
    -3.500900326333848e-07,
    -4.3849415316032355e-08,
    1.6001402231169183e-08,
];

/// The error function, |error| < 1e-7 (in practice 5e-9 below 4 and
/// 1.6e-8 above).
#[inline(always)]
pub fn erf(x: f64) -> f64 {
    let t = x.abs().min(4.0) - 2.0;
    // Even and odd halves in t² as two independent Horner chains (half the
    // latency of one chain); mul_add becomes one FMA where the CPU has it.
    let t2 = t * t;
    const D: usize = ERF_POLY.len() - 1;
    let (mut even, mut odd) = (0.0f64, 0.0f64);
    for j in (0..=D / 2).rev() {
        even = even.mul_add(t2, ERF_POLY[2 * j]);
    }
    for j in (0..D.div_ceil(2)).rev() {
        odd = odd.mul_add(t2, ERF_POLY[2 * j + 1]);
    }
    odd.mul_add(t, even).copysign(x)
}

/// erf(a)/a ≈ P(a²)/Q(a²) on [0, 4]: a rational fit made for RLX
/// (least squares on Chebyshev nodes against an accurate erf, reweighted
/// by 1/Q), |erf error| ≤ 3.5e-7 evaluated in f32 — a few ulp of f32 near
/// 1, where GELU's own f32 rounding is of the same size.
// ERF_P[0] is fitted, not 2/√π rounded (the two differ in the last bit).
#[allow(clippy::approx_constant)]
pub(crate) const ERF_P: [f32; 6] = [1.128_379_1, 0.194_366_62, 0.053_214_457, 0.003_921_289, 0.000_285_894_96, 1.985_711e-6];
pub(crate) const ERF_Q: [f32; 6] = [1.0, 0.505_584_84, 0.115_694_13, 0.015_280_583, 0.001_195_793_9, 3.748_076_8e-5];

/// GELU in f32 through the rational erf above: branch-free, so the loop
/// over a slice vectorises 16 lanes wide (the f64 polynomial it replaced
/// took 0.71 ms per 1024×1536 block on one core, 5% of MiniLM at 8×128).
#[inline(always)]
fn gelu32(x: f32) -> f32 {
    let a = (x * std::f32::consts::FRAC_1_SQRT_2).abs().min(4.0);
    let z = a * a;
    let mut p = ERF_P[5];
    let mut q = ERF_Q[5];
    for j in (0..5).rev() {
        p = p.mul_add(z, ERF_P[j]);
        q = q.mul_add(z, ERF_Q[j]);
    }
    let e = (a * p / q).min(1.0).copysign(x);
    0.5 * x * (1.0 + e)
}

#[inline(always)]
fn gelu_slice(v: &mut [f32]) {
    v.iter_mut().for_each(|x| *x = gelu32(*x));
}

#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + crate::kernels::lanes::exp(-x))
}

crate::simd::multiversion! {
    /// Applies `act` to every element in place.
    pub fn apply(act: Activation, v: &mut [f32]) {
        match act {
            Activation::Gelu => gelu_slice(v),
            Activation::GeluTanh => v.iter_mut().for_each(|x| *x = gelu_tanh(*x)),
            Activation::Silu => v.iter_mut().for_each(|x| *x = silu(*x)),
            Activation::Relu => v.iter_mut().for_each(|x| *x = x.max(0.0)),
            Activation::Tanh => v.iter_mut().for_each(|x| *x = x.tanh()),
        }
    }
}
