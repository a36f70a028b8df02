//! Activation functions, computed in f32 (exact GELU through an f64 erf).

use rlx_ir::Activation;

/// erf on [0, 4) as eight degree-7 polynomials in (x - centre), one per
/// interval of width 0.5, least-squares fitted on Chebyshev nodes against an
/// accurate erf (max error 1.2e-9). Past 4, erf(x) = 1 to within 1.6e-8.
const ERF_COEFS: [[f64; 8]; 8] = [
    [0.2763263890402538, 1.0600141280036686, -0.2650029541987045, -0.3091704947372739, 0.12693450609471887, 0.0800362475854509, -0.039340072890099435, -0.015803175343173225],
    [0.7111556333754852, 0.6429310712779474, -0.4821981597236017, 0.026788349804058417, 0.15067561481118147, -0.05321706137130167, -0.026582650510203365, 0.017885199389881517],
    [0.922900128924091, 0.23652112200162087, -0.2956517450988991, 0.16753589043614284, -0.0061320015361408685, -0.04718655986744816, 0.020597308424091878, 0.003745173460734722],
    [0.9866716711392742, 0.05277499545001885, -0.09235620175734802, 0.09015738709528447, -0.048105528491822314, 0.0066184666836395, 0.009049545099600887, -0.005933030767708432],
    [0.9985372832941056, 0.007142319215262267, -0.016070156791658154, 0.021724512418314426, -0.01908826230952247, 0.010660062056347194, -0.0027794884176494776, -0.0007215543814784558],
    [0.9998993780875949, 0.00058627728666514, -0.001612267429613512, 0.002760380285037101, -0.003257709968254327, 0.0027562915222239864, -0.0016678567114246038, 0.0006358097337146847],
    [0.99999569723033, 2.9189011692824688e-05, -9.486934244721046e-05, 0.00019581263465543513, -0.00028616893624874796, 0.0003136286631006103, -0.0002737647504705333, 0.00017359850123128354],
    [0.999999886274118, 8.814288450266078e-07, -3.306072240917453e-06, 7.970329089158422e-06, -1.3785339991923926e-05, 1.8330010000302025e-05, -2.069331082487738e-05, 1.7145236876671953e-05],
];

/// The error function with |error| < 1e-7 (in practice ~1e-9).
#[inline(always)]
pub fn erf(x: f64) -> f64 {
    let a = x.abs();
    let v = if a >= 4.0 {
        1.0
    } else {
        let i = (a * 2.0) as usize;
        let c = &ERF_COEFS[i.min(7)];
        let t = a - (i as f64 * 0.5 + 0.25);
        let mut p = c[7];
        for j in (0..7).rev() {
            p = p * t + c[j];
        }
        p
    };
    v.copysign(x)
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
