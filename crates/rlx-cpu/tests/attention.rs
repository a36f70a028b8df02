//! Fused attention against an f64 reference: Q/K/V read straight out of a
//! fused QKV projection (strided views), GQA, key-padding masks of several
//! dtypes, causal with valid_len, fully-masked rows (zeros). f32 tolerance
//! 1e-4, f16/bf16 1e-2.

mod reference;

use rand::Rng;
use reference::*;
use rlx_ir::DType;
use rlx_schedule::{AttentionThunk, BufRef, SeqView, Thunk};

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

struct Case {
    dtype: DType,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    q_len: usize,
    kv_len: usize,
    causal: bool,
    valid: Option<usize>,
    mask: Option<(DType, Vec<bool>)>,
    scale: f32,
    /// Fill the K and V rows of masked keys with NaN (separate buffers
    /// only): they must not reach the output.
    poison: bool,
}

/// Reads [b, s, col] through a view given as (data, batch stride, row stride).
fn get(v: &(Vec<f64>, usize, usize), b: usize, s: usize, col: usize) -> f64 {
    v.0[b * v.1 + s * v.2 + col]
}

fn reference(c: &Case, q: &(Vec<f64>, usize, usize), k: &(Vec<f64>, usize, usize), v: &(Vec<f64>, usize, usize)) -> Vec<f64> {
    let valid = c.valid.unwrap_or(c.kv_len);
    let group = c.heads / c.kv_heads;
    let mut out = vec![0.0; c.batch * c.q_len * c.heads * c.hd];
    for b in 0..c.batch {
        for h in 0..c.heads {
            let g = h / group;
            for i in 0..c.q_len {
                let pos = valid as isize - c.q_len as isize + i as isize;
                let allowed: Vec<usize> = (0..valid)
                    .filter(|&j| !c.causal || j as isize <= pos)
                    .filter(|&j| c.mask.as_ref().is_none_or(|(_, m)| m[b * c.kv_len + j]))
                    .collect();
                if allowed.is_empty() {
                    continue; // fully masked: zeros
                }
                let scores: Vec<f64> = allowed
                    .iter()
                    .map(|&j| (0..c.hd).map(|d| get(q, b, i, h * c.hd + d) * get(k, b, j, g * c.hd + d)).sum::<f64>() * c.scale as f64)
                    .collect();
                let p = softmax_ref(&scores);
                for d in 0..c.hd {
                    out[(b * c.q_len + i) * c.heads * c.hd + h * c.hd + d] =
                        allowed.iter().zip(&p).map(|(&j, w)| w * get(v, b, j, g * c.hd + d)).sum();
                }
            }
        }
    }
    out
}

fn sub(b: BufRef, elems: usize, dtype: DType) -> BufRef {
    let off = (elems * dtype.size()) as u64;
    BufRef { offset: b.offset + off, bytes: b.bytes - off, ..b }
}

/// Runs a case; `fused` reads q, k, v out of one [B, S, (H + 2 KVH) * hd]
/// buffer (needs q_len == kv_len), otherwise separate padded buffers.
fn run(seed: u64, c: &Case, fused: bool) {
    let mut r = rng(seed);
    let dt = c.dtype;
    let (qw, kw) = (c.heads * c.hd, c.kv_heads * c.hd);
    let mut p = Plan::new();
    let mut tensors = Vec::new();
    let (qv, kv, vv, qs, ks, vs);
    if fused {
        let w = qw + 2 * kw;
        let data = values(&mut r, c.batch * c.q_len * w, dt);
        let buf = p.input("qkv", &[c.batch, c.q_len, w], dt);
        let (bs, rs) = ((c.q_len * w) as u64, w as u64);
        qs = SeqView { buf, batch_stride: bs, row_stride: rs };
        ks = SeqView { buf: sub(buf, qw, dt), batch_stride: bs, row_stride: rs };
        vs = SeqView { buf: sub(buf, qw + kw, dt), batch_stride: bs, row_stride: rs };
        let view = |off: usize| (data[off..].to_vec(), c.q_len * w, w);
        (qv, kv, vv) = (view(0), view(qw), view(qw + kw));
        tensors.push(("qkv", tensor(&[c.batch, c.q_len, w], dt, &data)));
    } else {
        let pad = 3;
        let mk = |p: &mut Plan,
                  r: &mut rand::rngs::StdRng,
                  name: &'static str,
                  len: usize,
                  width: usize,
                  tensors: &mut Vec<(&'static str, rlx_runtime::Tensor)>| {
            let row = width + pad;
            let mut data = values(r, c.batch * len * row, dt);
            if let (true, "k" | "v", Some((_, m))) = (c.poison, name, &c.mask) {
                for b in 0..c.batch {
                    for j in (0..len).filter(|&j| !m[b * c.kv_len + j]) {
                        data[(b * len + j) * row..][..width].fill(f64::NAN);
                    }
                }
            }
            let buf = p.input(name, &[c.batch, len, row], dt);
            tensors.push((name, tensor(&[c.batch, len, row], dt, &data)));
            (SeqView { buf, batch_stride: (len * row) as u64, row_stride: row as u64 }, (data, len * row, row))
        };
        let (a, av) = mk(&mut p, &mut r, "q", c.q_len, qw, &mut tensors);
        let (b, bv) = mk(&mut p, &mut r, "k", c.kv_len, kw, &mut tensors);
        let (d, dv) = mk(&mut p, &mut r, "v", c.kv_len, kw, &mut tensors);
        (qs, ks, vs, qv, kv, vv) = (a, b, d, av, bv, dv);
    }
    let mask = c.mask.as_ref().map(|(mdt, m)| {
        let buf = p.input("mask", &[c.batch, c.kv_len], *mdt);
        let vals: Vec<f64> = m.iter().map(|&k| if k { 1.0 } else { 0.0 }).collect();
        let t = if mdt.is_float() {
            tensor(&[c.batch, c.kv_len], *mdt, &vals)
        } else {
            ints(&[c.batch, c.kv_len], *mdt, &vals.iter().map(|v| *v as i64).collect::<Vec<_>>())
        };
        tensors.push(("mask", t));
        buf
    });
    let valid_len = c.valid.map(|v| {
        let buf = p.input("valid", &[1], DType::I32);
        tensors.push(("valid", ints(&[1], DType::I32, &[v as i64])));
        buf
    });
    let out = p.output("out", &[c.batch, c.q_len, qw], dt);
    p.push(Thunk::Attention(AttentionThunk {
        dtype: dt,
        kv_dtype: dt,
        batch: c.batch,
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.hd,
        q_len: c.q_len,
        kv_len: c.kv_len,
        scale: c.scale,
        causal: c.causal,
        q: qs,
        k: ks,
        v: vs,
        mask,
        mask_dtype: c.mask.as_ref().map(|m| m.0).unwrap_or(DType::I32),
        valid_len,
        valid_len_per_batch: false,
        out,
    }));
    let want = reference(c, &qv, &kv, &vv);
    let inputs: Vec<(&str, &rlx_runtime::Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    let got = p.run(&inputs).expect("attention runs");
    let what = format!(
        "seed {seed} {dt} b{} h{}/{} hd{} q{} kv{} causal {} valid {:?} mask {} fused {fused}",
        c.batch,
        c.heads,
        c.kv_heads,
        c.hd,
        c.q_len,
        c.kv_len,
        c.causal,
        c.valid,
        c.mask.is_some()
    );
    assert_close(&got[0], &want, tol(dt, TOL_MATMUL), &what);
}

fn random_case(r: &mut rand::rngs::StdRng, dtype: DType, same_len: bool) -> Case {
    let kv_heads = r.random_range(1..4);
    let heads = kv_heads * r.random_range(1..4);
    let hd = [4, 8, 16, 32, 40][r.random_range(0..5)];
    let kv_len = r.random_range(1..80);
    let q_len = if same_len { kv_len } else { r.random_range(1..=kv_len) };
    let batch = r.random_range(1..3);
    let causal = r.random_bool(0.5);
    let valid = (!same_len && r.random_bool(0.6)).then(|| r.random_range(q_len..=kv_len));
    let mask = r.random_bool(0.5).then(|| {
        let mdt = [DType::I32, DType::I64, DType::F32, DType::F16][r.random_range(0..4)];
        (mdt, (0..batch * kv_len).map(|_| r.random_bool(0.8)).collect())
    });
    Case { dtype, batch, heads, kv_heads, hd, q_len, kv_len, causal, valid, mask, scale: 1.0 / (hd as f32).sqrt(), poison: false }
}

#[test]
fn attention_fused_qkv_random() {
    for seed in 0..24 {
        let mut r = rng(seed);
        let c = random_case(&mut r, FLOATS[seed as usize % 3], true);
        run(seed, &c, true);
    }
}

#[test]
fn attention_separate_views_gqa_causal_valid_len() {
    for seed in 100..130 {
        let mut r = rng(seed);
        let c = random_case(&mut r, FLOATS[seed as usize % 3], false);
        run(seed, &c, false);
    }
}

/// Decode-shaped attention (1–4 query rows per head) over short and long
/// caches: the path that reads K and V in place, on one thread below its
/// work threshold and split over tasks above it, with GQA, masks holding
/// NaN in masked rows, causal rows and valid lengths.
#[test]
fn attention_few_query_rows_random() {
    for seed in 500..524 {
        let mut r = rng(seed);
        let mut c = random_case(&mut r, FLOATS[seed as usize % 3], false);
        c.hd = [8, 16, 64, 72][r.random_range(0..4)];
        c.kv_len = if seed % 2 == 0 { r.random_range(1..40) } else { r.random_range(200..700) };
        c.q_len = r.random_range(1..=4.min(c.kv_len));
        c.valid = r.random_bool(0.6).then(|| r.random_range(c.q_len..=c.kv_len));
        if let Some((dt, _)) = c.mask {
            c.mask = Some((dt, (0..c.batch * c.kv_len).map(|_| r.random_bool(0.8)).collect()));
            c.poison = true;
        }
        c.scale = 1.0 / (c.hd as f32).sqrt();
        run(seed, &c, false);
    }
}

/// A sequence longer than one query block, so several tasks share a head.
#[test]
fn attention_long_sequence() {
    let c = Case {
        dtype: DType::F32,
        batch: 1,
        heads: 4,
        kv_heads: 2,
        hd: 32,
        q_len: 130,
        kv_len: 130,
        causal: true,
        valid: None,
        mask: None,
        scale: 0.17,
        poison: false,
    };
    run(7, &c, true);
}

/// Every key of batch 1 masked: its rows come out as zeros, not NaN.
#[test]
fn attention_fully_masked_rows_are_zero() {
    let (batch, kv_len) = (2, 5);
    let mask: Vec<bool> = (0..batch * kv_len).map(|i| i < kv_len).collect();
    let c = Case {
        dtype: DType::F32,
        batch,
        heads: 2,
        kv_heads: 2,
        hd: 8,
        q_len: 3,
        kv_len,
        causal: false,
        valid: None,
        mask: Some((DType::I32, mask)),
        scale: 0.3,
        poison: false,
    };
    run(9, &c, false);
}

/// Head dims of 64 and 128 (64-wide P·V tiles, several score chunks) and
/// key counts that are not a multiple of 16, with a mask and causal rows.
#[test]
fn attention_wide_heads_and_odd_lengths() {
    for (seed, hd, kv_len, dtype) in [(300, 64, 77, DType::F32), (301, 128, 150, DType::F32), (302, 80, 33, DType::BF16)] {
        let mut r = rng(seed);
        let mask = (DType::I32, (0..2 * kv_len).map(|_| r.random_bool(0.85)).collect());
        let c = Case {
            dtype,
            batch: 2,
            heads: 2,
            kv_heads: 1,
            hd,
            q_len: kv_len - 3,
            kv_len,
            causal: seed % 2 == 0,
            valid: Some(kv_len - 1),
            mask: Some(mask),
            scale: 1.0 / (hd as f32).sqrt(),
            poison: false,
        };
        run(seed, &c, false);
    }
}

/// NaN in the K and V rows of masked keys (a padded batch whose pad rows
/// hold garbage) stays out of every output; causal rows before the first
/// valid key (q_len > valid_len) come out as zeros.
#[test]
fn attention_masked_garbage_and_rows_before_the_first_key() {
    for (seed, dtype, hd, q_len, kv_len, valid, causal) in [
        (400, DType::F32, 32, 9, 40, Some(33), false),
        (401, DType::BF16, 16, 12, 30, Some(7), true),
        (402, DType::F32, 40, 20, 20, Some(5), true),
    ] {
        let mut r = rng(seed);
        let mut m: Vec<bool> = (0..2 * kv_len).map(|_| r.random_bool(0.7)).collect();
        m[kv_len + 1] = false;
        let c = Case {
            dtype,
            batch: 2,
            heads: 2,
            kv_heads: 2,
            hd,
            q_len,
            kv_len,
            causal,
            valid,
            mask: Some((DType::I32, m)),
            scale: 1.0 / (hd as f32).sqrt(),
            poison: true,
        };
        run(seed, &c, false);
    }
}
