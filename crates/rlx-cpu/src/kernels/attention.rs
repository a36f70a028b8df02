//! Fused attention: one rayon task per (batch, head, block of queries)
//! computes that block's scores against one head's keys, masks, softmaxes
//! and takes the weighted sum of values. Only one row of scores exists per
//! task at a time; the full [B, H, Sq, Skv] matrix is never built.
//!
//! Masking: keys at or past `valid_len` (default kv_len), keys whose
//! key-padding mask is zero, and with `causal` keys after the query's
//! position (`valid_len - q_len + i` for query i) are excluded. A query row
//! with no key left (fully masked) outputs zeros rather than NaN.

use rayon::prelude::*;
use rlx_compile::AttentionThunk;
use rlx_ir::DType;

use super::lanes;
use crate::elem::{with_float, Elem};
use crate::memory::{Dst, Mem, Src};
use crate::{exec_err, Result};

/// Queries per task: enough work to amortise loading the head's K and V.
const Q_BLOCK: usize = 32;

/// Whether element i of a mask of any dtype is nonzero.
fn keep(mask: &Src<u8>, dtype: DType, i: usize) -> bool {
    let es = dtype.size();
    let b = mask.row(i * es, es);
    match dtype {
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) != 0.0,
        DType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32() != 0.0,
        DType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32() != 0.0,
        DType::I32 | DType::I64 => b.iter().any(|&x| x != 0),
    }
}

pub fn run(t: &AttentionThunk, mem: &Mem) -> Result<()> {
    let valid = match &t.valid_len {
        Some(b) => {
            let v = mem.src::<i32>(b).map_err(exec_err)?.get(0);
            if v < 0 || v as usize > t.kv_len {
                return Err(exec_err(format!("attention: valid_len {v} is outside 0..={} (kv_len)", t.kv_len)));
            }
            v as usize
        }
        None => t.kv_len,
    };
    let mask = t.mask.map(|m| mem.src::<u8>(&m)).transpose().map_err(exec_err)?;
    with_float!(t.dtype, T => {
        let q = mem.src::<T>(&t.q.buf).map_err(exec_err)?;
        let k = mem.src::<T>(&t.k.buf).map_err(exec_err)?;
        let v = mem.src::<T>(&t.v.buf).map_err(exec_err)?;
        let out = mem.dst::<T>(&t.out).map_err(exec_err)?;
        tasks::<T>(t, valid, mask, q, k, v, out);
    });
    Ok(())
}

struct TaskBuf {
    k: Vec<f32>,
    v: Vec<f32>,
    keep: Vec<bool>,
    q: Vec<f32>,
    scores: Vec<f32>,
    acc: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn tasks<T: Elem>(t: &AttentionThunk, valid: usize, mask: Option<Src<u8>>, q: Src<T>, k: Src<T>, v: Src<T>, out: Dst<T>) {
    let (hd, group) = (t.head_dim, t.heads / t.kv_heads.max(1));
    let blocks = t.q_len.div_ceil(Q_BLOCK);
    let out_w = t.heads * hd;
    (0..t.batch * t.heads * blocks).into_par_iter().for_each_init(
        || TaskBuf { k: vec![0.0; valid * hd], v: vec![0.0; valid * hd], keep: vec![true; valid], q: vec![0.0; hd], scores: vec![0.0; valid], acc: vec![0.0; hd] },
        |buf, task| {
            let (b, rest) = (task / (t.heads * blocks), task % (t.heads * blocks));
            let (h, blk) = (rest / blocks, rest % blocks);
            let g = h / group;
            // This head's keys and values, contiguous in f32.
            for j in 0..valid {
                let kr = b * t.k.batch_stride as usize + j * t.k.row_stride as usize + g * hd;
                let vr = b * t.v.batch_stride as usize + j * t.v.row_stride as usize + g * hd;
                k.load(kr, &mut buf.k[j * hd..(j + 1) * hd]);
                v.load(vr, &mut buf.v[j * hd..(j + 1) * hd]);
                buf.keep[j] = mask.as_ref().is_none_or(|m| keep(m, t.mask_dtype, b * t.kv_len + j));
            }
            let q_end = ((blk + 1) * Q_BLOCK).min(t.q_len);
            for i in blk * Q_BLOCK..q_end {
                let limit = if t.causal {
                    // Query i sits at absolute position valid - q_len + i.
                    let p = valid as isize - t.q_len as isize + i as isize;
                    (p + 1).clamp(0, valid as isize) as usize
                } else {
                    valid
                };
                q.load(b * t.q.batch_stride as usize + i * t.q.row_stride as usize + h * hd, &mut buf.q);
                let n = limit * hd;
                attend_row(&mut buf.q, t.scale, &buf.k[..n], &buf.v[..n], &buf.keep[..limit], &mut buf.scores[..limit], &mut buf.acc);
                out.store((b * t.q_len + i) * out_w + h * hd, &buf.acc);
            }
        },
    );
}

crate::simd::multiversion! {
    /// One query row: scores against `k` rows (head_dim = q.len()) that
    /// `keep` allows, softmax, weighted sum of `v` rows into `acc`; zeros
    /// when no key is allowed.
    fn attend_row(q: &mut [f32], scale: f32, k: &[f32], v: &[f32], keep: &[bool], scores: &mut [f32], acc: &mut [f32]) {
        let hd = q.len();
        q.iter_mut().for_each(|x| *x *= scale);
        let mut m = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate() {
            *s = if keep[j] { lanes::dot(q, &k[j * hd..(j + 1) * hd]) } else { f32::NEG_INFINITY };
            m = m.max(*s);
        }
        acc.fill(0.0);
        if m == f32::NEG_INFINITY {
            return;
        }
        let mut sum = 0.0f32;
        for (j, s) in scores.iter().enumerate() {
            if keep[j] {
                let p = lanes::exp(s - m);
                sum += p;
                lanes::axpy(acc, p, &v[j * hd..(j + 1) * hd]);
            }
        }
        let inv = 1.0 / sum;
        acc.iter_mut().for_each(|x| *x *= inv);
    }
}
