//! Row reductions written with 64 independent accumulators, so LLVM turns
//! them into several independent vector chains (a plain `iter().sum()` must
//! stay sequential because float addition does not reassociate, and one
//! 16-lane chain waits on the adder's latency).

const L: usize = 64;

#[inline(always)]
fn fold(v: &[f32], init: f32, f: impl Fn(f32, f32) -> f32, g: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [init; L];
    let chunks = v.chunks_exact(L);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..L {
            acc[i] = f(acc[i], g(c[i]));
        }
    }
    let mut r = init;
    for &x in rest {
        r = f(r, g(x));
    }
    // Halve the accumulators pairwise (each step vectorises) rather than
    // folding 64 of them one after another: on a 128-wide softmax row the
    // serial fold cost more than the row's exps.
    for w in [32, 16, 8, 4, 2, 1] {
        for i in 0..w {
            acc[i] = f(acc[i], acc[i + w]);
        }
    }
    f(r, acc[0])
}

#[inline(always)]
pub fn sum(v: &[f32]) -> f32 {
    fold(v, 0.0, |a, b| a + b, |x| x)
}

/// Σ (x - c)².
#[inline(always)]
pub fn sum_sq_dev(v: &[f32], c: f32) -> f32 {
    fold(v, 0.0, |a, b| a + b, |x| (x - c) * (x - c))
}

#[inline(always)]
pub fn max(v: &[f32]) -> f32 {
    fold(v, f32::NEG_INFINITY, f32::max, |x| x)
}

/// Σ a·b in 16 independent lanes, folded pairwise: one 16-lane chain per
/// vector of a short row (an attention head's 64 or 128 values), which the
/// 64-accumulator folds above would mostly leave empty.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let (ac, bc) = (a.chunks_exact(L), b.chunks_exact(L));
    let mut rest = 0f32;
    for (&x, &y) in ac.remainder().iter().zip(bc.remainder()) {
        rest = x.mul_add(y, rest);
    }
    for (x, y) in ac.zip(bc) {
        for l in 0..L {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    for w in [8, 4, 2, 1] {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0] + rest
}

/// e^x in f32 without a libm call, so loops over it vectorise: x = n·ln2 + r
/// with |r| ≤ ln2/2, e^r by its Taylor series to r⁷ (relative error ~2e-7),
/// times 2^n built in the exponent bits. Inputs are clamped to the normal
/// range, so e^-inf gives ~1e-38 rather than 0.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5·2^23 rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    // Taylor coefficients 1/k!, Horner with FMAs (inside the multiversioned
    // callers these are single instructions).
    const C: [f32; 8] = [1.0, 1.0, 0.5, 1.0 / 6.0, 1.0 / 24.0, 1.0 / 120.0, 1.0 / 720.0, 1.0 / 5040.0];
    let r2 = r * r;
    let even = C[6].mul_add(r2, C[4]).mul_add(r2, C[2]).mul_add(r2, C[0]);
    let odd = C[7].mul_add(r2, C[5]).mul_add(r2, C[3]).mul_add(r2, C[1]);
    let p = odd.mul_add(r, even);
    // t's low mantissa bits hold n as an integer (t = 1.5·2^23 + n), so 2^n
    // comes from integer ops on its bits; a float→int cast would not
    // vectorise (Rust's cast saturates, which compiles to scalar code).
    let e = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127) << 23;
    p * f32::from_bits(e)
}
