//! Fused attention: one rayon task per (batch, head, block of 64 queries)
//! computes that block's scores against one head's keys (a small gemm),
//! masks and softmaxes them, and multiplies by that head's values (a second
//! small gemm). A task holds at most a [64, kv_len] block of one head's
//! scores; the full [B, H, Sq, Skv] matrix is never built.
//!
//! Masking: keys at or past `valid_len` (default kv_len), keys whose
//! key-padding mask is zero, and with `causal` keys after the query's
//! position (`valid_len - q_len + i` for query i) get weight exactly 0. A
//! query row with no key left (fully masked) outputs zeros rather than NaN.

use rayon::prelude::*;
use rlx_compile::AttentionThunk;
use rlx_ir::DType;

use super::lanes;
use crate::elem::{with_float, Elem};
use crate::memory::{gemm_f32, gemm_f32_scaled, Dst, MatRef, Mem, Src};
use crate::{exec_err, Result};

/// Queries per task: enough work to amortise loading the head's K and V.
const Q_BLOCK: usize = 64;

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
    out: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn tasks<T: Elem>(t: &AttentionThunk, valid: usize, mask: Option<Src<u8>>, q: Src<T>, k: Src<T>, v: Src<T>, out: Dst<T>) {
    let (hd, group) = (t.head_dim, t.heads / t.kv_heads.max(1));
    let blocks = t.q_len.div_ceil(Q_BLOCK);
    let out_w = t.heads * hd;
    (0..t.batch * t.heads * blocks).into_par_iter().for_each_init(
        || TaskBuf {
            k: vec![0.0; valid * hd],
            v: vec![0.0; valid * hd],
            keep: vec![true; valid],
            q: vec![0.0; Q_BLOCK * hd],
            scores: vec![0.0; Q_BLOCK * valid],
            out: vec![0.0; Q_BLOCK * hd],
        },
        |buf, task| {
            let (b, rest) = (task / (t.heads * blocks), task % (t.heads * blocks));
            let (h, blk) = (rest / blocks, rest % blocks);
            let g = h / group;
            let q0 = blk * Q_BLOCK;
            let qn = Q_BLOCK.min(t.q_len - q0);
            for j in 0..valid {
                buf.keep[j] = mask.as_ref().is_none_or(|m| keep(m, t.mask_dtype, b * t.kv_len + j));
            }
            let none = gemm::Parallelism::None;
            if let (Some(qf), Some(kf), Some(vf), Some(of)) = (q.as_f32(), k.as_f32(), v.as_f32(), out.as_f32()) {
                // f32: the gemms read q, k, v through their strides and write
                // this block of the output in place.
                let (qa, ka, va) = (t.q.row_stride as usize, t.k.row_stride as usize, t.v.row_stride as usize);
                let sd = Dst::from_slice(&mut buf.scores[..qn * valid]);
                let qm = MatRef { src: &qf, offset: b * t.q.batch_stride as usize + q0 * qa + h * hd, rs: qa, cs: 1 };
                let km = MatRef { src: &kf, offset: b * t.k.batch_stride as usize + g * hd, rs: 1, cs: ka };
                gemm_f32_scaled(&sd, 0, valid, false, qm, km, (qn, valid, hd), t.scale, none);
                softmax_rows(t, valid, q0, qn, &mut buf.scores, &buf.keep);
                let ss = Src::from_slice(&buf.scores[..qn * valid]);
                let vm = MatRef { src: &vf, offset: b * t.v.batch_stride as usize + g * hd, rs: va, cs: 1 };
                gemm_f32(
                    &of,
                    (b * t.q_len + q0) * out_w + h * hd,
                    out_w,
                    false,
                    MatRef { src: &ss, offset: 0, rs: valid, cs: 1 },
                    vm,
                    (qn, hd, valid),
                    none,
                );
                return;
            }
            // Half precision: this head's keys and values, contiguous in f32.
            for j in 0..valid {
                let kr = b * t.k.batch_stride as usize + j * t.k.row_stride as usize + g * hd;
                let vr = b * t.v.batch_stride as usize + j * t.v.row_stride as usize + g * hd;
                k.load(kr, &mut buf.k[j * hd..(j + 1) * hd]);
                v.load(vr, &mut buf.v[j * hd..(j + 1) * hd]);
            }
            for i in 0..qn {
                q.load(b * t.q.batch_stride as usize + (q0 + i) * t.q.row_stride as usize + h * hd, &mut buf.q[i * hd..(i + 1) * hd]);
            }
            // scores[qn, valid] = scale · Q Kᵀ
            let (qs, ks, vs) = (Src::from_slice(&buf.q), Src::from_slice(&buf.k), Src::from_slice(&buf.v));
            let sd = Dst::from_slice(&mut buf.scores);
            gemm_f32_scaled(
                &sd,
                0,
                valid,
                false,
                MatRef { src: &qs, offset: 0, rs: hd, cs: 1 },
                MatRef { src: &ks, offset: 0, rs: 1, cs: hd },
                (qn, valid, hd),
                t.scale,
                none,
            );
            softmax_rows(t, valid, q0, qn, &mut buf.scores, &buf.keep);
            // out[qn, hd] = P V
            let ss = Src::from_slice(&buf.scores);
            let od = Dst::from_slice(&mut buf.out);
            gemm_f32(
                &od,
                0,
                hd,
                false,
                MatRef { src: &ss, offset: 0, rs: valid, cs: 1 },
                MatRef { src: &vs, offset: 0, rs: hd, cs: 1 },
                (qn, hd, valid),
                none,
            );
            for i in 0..qn {
                out.store((b * t.q_len + q0 + i) * out_w + h * hd, &buf.out[i * hd..(i + 1) * hd]);
            }
        },
    );
}

/// Masked softmax of the score rows of queries q0..q0+qn.
fn softmax_rows(t: &AttentionThunk, valid: usize, q0: usize, qn: usize, scores: &mut [f32], keep: &[bool]) {
    for i in 0..qn {
        let limit = if t.causal {
            // Query i sits at absolute position valid - q_len + i.
            let p = valid as isize - t.q_len as isize + (q0 + i) as isize;
            (p + 1).clamp(0, valid as isize) as usize
        } else {
            valid
        };
        masked_softmax(&mut scores[i * valid..(i + 1) * valid], keep, limit);
    }
}

crate::simd::multiversion! {
    /// Softmax over the keys of one score row that are before `limit` and
    /// kept by the mask; every other weight is exactly 0, and a row with no
    /// key left is all zeros.
    fn masked_softmax(row: &mut [f32], keep: &[bool], limit: usize) {
        let (head, tail) = row.split_at_mut(limit.min(row.len()));
        tail.fill(0.0);
        head.iter_mut().zip(keep).for_each(|(x, &k)| if !k { *x = f32::NEG_INFINITY });
        let m = lanes::max(head);
        if m == f32::NEG_INFINITY {
            head.fill(0.0);
            return;
        }
        head.iter_mut().zip(keep).for_each(|(x, &k)| *x = if k { lanes::exp(*x - m) } else { 0.0 });
        let inv = 1.0 / lanes::sum(head);
        head.iter_mut().for_each(|x| *x *= inv);
    }
}
