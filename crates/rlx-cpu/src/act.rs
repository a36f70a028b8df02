//! Activation functions, computed in f32 (exact GELU through an f64 erf).

use rlx_ir::Activation;

/// erf on [0, 4] as one degree-22 polynomial in (x - 2), least-squares
/// fitted on Chebyshev nodes against an accurate erf (max error 8e-11 when
/// evaluated in f64). One polynomial and no table keeps the loop branch-free
/// so it vectorises; past 4, erf(x) = 1 to within 1.6e-8.
const ERF_POLY: [f64; 23] = [
    0.9953222650190332,
    0.02066698448094451,
    -0.041333970701740705,
    0.04822298532957716,
    -0.03444497584614897,
    0.013088961619931684,
    0.00045926858286282927,
    -0.003378492051112131,
    0.0015910211790620568,
    -5.0796973382384494e-05,
    -0.0002627839978971588,
    0.0001044816188531725,
    5.20578180378833e-06,
    -1.6733410921792857e-05,
    3.972066277984458e-06,
    1.181622008462105e-06,
    -7.126438746385294e-07,
    -9.619439259906282e-09,
    6.513164667840342e-08,
    -4.557097949884564e-09,
    -3.428187891308548e-09,
    2.4930459622258727e-10,
    8.41341695373965e-11,
];

/// The error function, |error| < 1e-7 (in practice ~1e-10 below 4 and
/// 1.6e-8 above).
#[inline(always)]
pub fn erf(x: f64) -> f64 {
    let t = x.abs().min(4.0) - 2.0;
    // Even and odd halves in t² as two independent Horner chains (half the
    // latency of one chain); mul_add becomes one FMA where the CPU has it.
    let t2 = t * t;
    let mut even = ERF_POLY[22];
    let mut odd = ERF_POLY[21];
    for j in (0..11).rev() {
        even = even.mul_add(t2, ERF_POLY[2 * j]);
        if j > 0 {
            odd = odd.mul_add(t2, ERF_POLY[2 * j - 1]);
        }
    }
    odd.mul_add(t, even).copysign(x)
}

#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    let x = x as f64;
    (0.5 * x * (1.0 + erf(x * std::f64::consts::FRAC_1_SQRT_2))) as f32
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
            Activation::Gelu => v.iter_mut().for_each(|x| *x = gelu(*x)),
            Activation::GeluTanh => v.iter_mut().for_each(|x| *x = gelu_tanh(*x)),
            Activation::Silu => v.iter_mut().for_each(|x| *x = silu(*x)),
            Activation::Relu => v.iter_mut().for_each(|x| *x = x.max(0.0)),
            Activation::Tanh => v.iter_mut().for_each(|x| *x = x.tanh()),
        }
    }
}
