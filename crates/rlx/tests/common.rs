//! Plain f64 reference implementations and random data for the facade tests.
#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn randn(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
}

pub fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

pub fn strides(s: &[usize]) -> Vec<usize> {
    let mut st = vec![1; s.len()];
    for i in (0..s.len().saturating_sub(1)).rev() {
        st[i] = st[i + 1] * s[i + 1];
    }
    st
}

/// Index of a multi-index into a broadcast operand of shape `s` (right-aligned).
pub fn bcast_index(idx: &[usize], s: &[usize]) -> usize {
    let off = idx.len() - s.len();
    let st = strides(s);
    (0..s.len()).map(|i| if s[i] == 1 { 0 } else { idx[i + off] * st[i] }).sum()
}

pub fn unravel(mut i: usize, s: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; s.len()];
    for d in (0..s.len()).rev() {
        idx[d] = i % s[d];
        i /= s[d];
    }
    idx
}

pub fn broadcast(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
            let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
            da.max(db)
        })
        .collect()
}

pub fn erf(x: f64) -> f64 {
    // Series / continued fraction with ample precision for f64 references.
    if x.abs() < 3.0 {
        let mut sum = x;
        let mut term = x;
        let x2 = x * x;
        for n in 1..200 {
            term *= -x2 / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 {
                break;
            }
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc continued fraction (Lentz) for large |x|.
        let z = x.abs();
        let mut f = z;
        let mut c = z;
        let mut d = 0.0;
        for n in 1..200 {
            let an = n as f64 / 2.0;
            d = z + an * d;
            d = 1.0 / d;
            c = z + an / c;
            let delta = c * d;
            f *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        let erfc = (-z * z).exp() / (f * std::f64::consts::PI.sqrt());
        (1.0 - erfc).copysign(x)
    }
}

pub fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

pub fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Asserts |got - want| <= tol * max(1, |want|) elementwise (relative for
/// large values, absolute near zero), printing the worst element.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length {} vs reference {}", got.len(), want.len());
    let mut worst = (0.0f64, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (*g as f64 - w).abs() / w.abs().max(1.0);
        if err.is_nan() || err > worst.0 {
            worst = (err, i);
        }
    }
    assert!(
        worst.0 <= tol,
        "{what}: relative error {:.3e} > {tol:e} at {} (got {}, want {})",
        worst.0,
        worst.1,
        got[worst.1],
        want[worst.1]
    );
}
