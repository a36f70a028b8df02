//! Elementwise kernels: broadcasting binary ops, activations, SwiGLU, casts.
//! Each works on f32 chunks (load, compute, store), so `out` may be the
//! same buffer as an input (in place).

use rayon::prelude::*;
use rlx_ir::{Activation, BinaryOp, DType};
use rlx_schedule::{BufRef, RowsView};

use crate::elem::{read_int, with_float, Elem};
use crate::memory::{Dst, Mem, Src};
use crate::{act, exec_err, Result};

/// Elements per rayon task: big enough to amortise scheduling.
const GRAIN: usize = 1 << 14;
/// Elements per f32 scratch chunk (stays in L1).
const CHUNK: usize = 1024;

/// Drops size-1 dims and merges dims that are contiguous for every
/// operand, so `[8, 128, 384] + [384]` becomes `[1024, 384]` with strides
/// `[384, 1]` and `[0, 1]`.
fn coalesce(shape: &[usize], strides: &[&[u64]]) -> (Vec<usize>, Vec<Vec<u64>>) {
    let mut dims: Vec<usize> = Vec::new();
    let mut st: Vec<Vec<u64>> = vec![Vec::new(); strides.len()];
    for (i, &d) in shape.iter().enumerate() {
        if d == 1 {
            continue;
        }
        let merge = match dims.last() {
            Some(&ld) => {
                strides
                    .iter()
                    .enumerate()
                    .all(|(j, s)| st[j].last().copied() == Some(s[i] * d as u64) || (st[j].last() == Some(&0) && s[i] == 0))
                    && ld > 0
            }
            None => false,
        };
        if merge {
            let last = dims.len() - 1;
            dims[last] *= d;
            for (j, s) in strides.iter().enumerate() {
                let l = st[j].len() - 1;
                st[j][l] = s[i];
            }
        } else {
            dims.push(d);
            for (j, s) in strides.iter().enumerate() {
                st[j].push(s[i]);
            }
        }
    }
    if dims.is_empty() {
        dims.push(1);
        for s in st.iter_mut() {
            s.push(0);
        }
    }
    (dims, st)
}

crate::simd::multiversion! {
    pub(crate) fn combine(op: BinaryOp, x: &mut [f32], y: &[f32]) {
        match op {
            BinaryOp::Add => x.iter_mut().zip(y).for_each(|(a, b)| *a += b),
            BinaryOp::Sub => x.iter_mut().zip(y).for_each(|(a, b)| *a -= b),
            BinaryOp::Mul => x.iter_mut().zip(y).for_each(|(a, b)| *a *= b),
            BinaryOp::Div => x.iter_mut().zip(y).for_each(|(a, b)| *a /= b),
        }
    }
}

crate::simd::multiversion! {
    /// x = silu(x) · y, the SwiGLU kernel's arithmetic (fused quantized
    /// matmuls reuse it, so fusing does not change a bit).
    pub(crate) fn silu_mul(x: &mut [f32], y: &[f32]) {
        x.iter_mut().zip(y).for_each(|(a, b)| *a = act::silu(*a) * b);
    }
}

/// Loads `out.len()` elements along a stride (0 = broadcast one value).
#[inline(always)]
fn load_line<T: Elem>(src: &Src<T>, start: usize, stride: usize, out: &mut [f32]) {
    if stride == 0 {
        let v = src.get(start).to_f32();
        out.fill(v);
    } else {
        src.load_strided(start, stride, out);
    }
}

#[allow(clippy::too_many_arguments)]
pub fn binary(
    op: BinaryOp,
    dtype: DType,
    out_shape: &[usize],
    a: &BufRef,
    a_strides: &[u64],
    b: &BufRef,
    b_strides: &[u64],
    out: &BufRef,
    mem: &Mem,
) -> Result<()> {
    if dtype.is_int() {
        let (a, b, out) = (mem.src::<u8>(a).map_err(exec_err)?, mem.src::<u8>(b).map_err(exec_err)?, mem.dst::<u8>(out).map_err(exec_err)?);
        return binary_int(op, dtype, out_shape, &a, a_strides, &b, b_strides, &out);
    }
    with_float!(dtype, T => binary_t::<T>(op, out_shape, mem.src::<T>(a).map_err(exec_err)?, a_strides, mem.src::<T>(b).map_err(exec_err)?, b_strides, mem.dst::<T>(out).map_err(exec_err)?))
}

fn binary_t<T: Elem>(
    op: BinaryOp,
    out_shape: &[usize],
    a: Src<T>,
    a_strides: &[u64],
    b: Src<T>,
    b_strides: &[u64],
    out: Dst<T>,
) -> Result<()> {
    let total: usize = out_shape.iter().product();
    if total == 0 {
        return Ok(());
    }
    let out_strides: Vec<u64> = rlx_ir::Shape::new(out_shape.to_vec()).strides().iter().map(|&s| s as u64).collect();
    let (dims, st) = coalesce(out_shape, &[a_strides, b_strides, &out_strides]);
    let inner = *dims.last().unwrap_or(&1);
    let (sa, sb) = (st[0][dims.len() - 1] as usize, st[1][dims.len() - 1] as usize);
    let outer_dims = &dims[..dims.len() - 1];
    let rows = total / inner;
    // Offset of row r (an index over the outer dims) in operand j.
    let row_offset = |r: usize, j: usize| -> usize {
        let mut rem = r;
        let mut off = 0usize;
        for d in (0..outer_dims.len()).rev() {
            let idx = rem % outer_dims[d];
            rem /= outer_dims[d];
            off += idx * st[j][d] as usize;
        }
        off
    };
    let min_rows = GRAIN / inner.max(1) + 1;
    (0..rows).into_par_iter().with_min_len(min_rows).for_each_init(
        || (vec![0f32; CHUNK.min(inner)], vec![0f32; CHUNK.min(inner)]),
        |(x, y), r| {
            let (oa, ob) = (row_offset(r, 0), row_offset(r, 1));
            let mut c = 0;
            while c < inner {
                let len = CHUNK.min(inner - c);
                let (x, y) = (&mut x[..len], &mut y[..len]);
                load_line(&a, oa + c * sa, sa, x);
                load_line(&b, ob + c * sb, sb, y);
                combine(op, x, y);
                out.store(r * inner + c, x);
                c += len;
            }
        },
    );
    Ok(())
}

/// Integer ops (ids, positions): small tensors, so a plain loop. Computed in
/// i64, which for i32 gives the same bits as wrapping i32 arithmetic;
/// division truncates toward zero and dividing by zero is an error.
#[allow(clippy::too_many_arguments)]
fn binary_int(
    op: BinaryOp,
    dtype: DType,
    out_shape: &[usize],
    a: &Src<u8>,
    a_strides: &[u64],
    b: &Src<u8>,
    b_strides: &[u64],
    out: &Dst<u8>,
) -> Result<()> {
    let total: usize = out_shape.iter().product();
    let es = dtype.size();
    for i in 0..total {
        let (mut rem, mut oa, mut ob) = (i, 0usize, 0usize);
        for d in (0..out_shape.len()).rev() {
            let idx = rem % out_shape[d];
            rem /= out_shape[d];
            oa += idx * a_strides[d] as usize;
            ob += idx * b_strides[d] as usize;
        }
        let (x, y) = (read_int(a, dtype, oa), read_int(b, dtype, ob));
        let r = match op {
            BinaryOp::Add => x.wrapping_add(y),
            BinaryOp::Sub => x.wrapping_sub(y),
            BinaryOp::Mul => x.wrapping_mul(y),
            BinaryOp::Div if y == 0 => {
                return Err(exec_err(format!("binary div: integer division by zero at element {i} of {out_shape:?}")))
            }
            BinaryOp::Div => x.wrapping_div(y),
        };
        // SAFETY: element i belongs to this iteration alone.
        let row = unsafe { out.row_mut(i * es, es) };
        match dtype {
            DType::I64 => row.copy_from_slice(&r.to_le_bytes()),
            _ => row.copy_from_slice(&(r as i32).to_le_bytes()),
        }
    }
    Ok(())
}

pub fn activation(act_kind: Activation, dtype: DType, n: usize, x: &BufRef, out: &BufRef, mem: &Mem) -> Result<()> {
    with_float!(dtype, T => {
        let (x, out) = (mem.src::<T>(x).map_err(exec_err)?, mem.dst::<T>(out).map_err(exec_err)?);
        let chunks = n.div_ceil(CHUNK);
        (0..chunks).into_par_iter().with_min_len(GRAIN / CHUNK).for_each_init(
            || vec![0f32; CHUNK],
            |buf, i| {
                let start = i * CHUNK;
                let v = &mut buf[..CHUNK.min(n - start)];
                x.load(start, v);
                act::apply(act_kind, v);
                out.store(start, v);
            },
        );
    });
    Ok(())
}

pub fn swiglu(dtype: DType, rows: usize, cols: usize, gate: &RowsView, up: &RowsView, out: &BufRef, mem: &Mem) -> Result<()> {
    with_float!(dtype, T => {
        let g = mem.src::<T>(&gate.buf).map_err(exec_err)?;
        let u = mem.src::<T>(&up.buf).map_err(exec_err)?;
        let o = mem.dst::<T>(out).map_err(exec_err)?;
        let (gs, us) = (gate.row_stride as usize, up.row_stride as usize);
        (0..rows).into_par_iter().with_min_len(GRAIN / cols.max(1) + 1).for_each_init(
            || (vec![0f32; cols], vec![0f32; cols]),
            |(x, y), r| {
                g.load(r * gs, x);
                u.load(r * us, y);
                silu_mul(x, y);
                o.store(r * cols, x);
            },
        );
    });
    Ok(())
}

/// One element as f64 (ints exactly up to 2^53).
#[inline(always)]
fn read_any(src: &Src<u8>, dtype: DType, i: usize) -> f64 {
    let es = dtype.size();
    let b = src.row(i * es, es);
    match dtype {
        DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        DType::I32 | DType::I64 => read_int(src, dtype, i) as f64,
        DType::U8 => b[0] as f64,
    }
}

/// Element type conversion. Floats round to nearest; float → int truncates
/// toward zero and saturates (NaN → 0), like `Tensor::to_dtype`.
pub fn cast(from: DType, to: DType, n: usize, src: &BufRef, dst: &BufRef, mem: &Mem) -> Result<()> {
    let s = mem.src::<u8>(src).map_err(exec_err)?;
    let d = mem.dst::<u8>(dst).map_err(exec_err)?;
    if from == to {
        d.copy_from(0, &s, 0, n * from.size());
        return Ok(());
    }
    let es = to.size();
    (0..n).into_par_iter().with_min_len(GRAIN).for_each(|i| {
        // SAFETY: element i belongs to this task alone; src is another buffer or this element.
        let row = unsafe { d.row_mut(i * es, es) };
        if from == DType::I64 && to == DType::I32 {
            row.copy_from_slice(&(read_int(&s, from, i) as i32).to_le_bytes());
            return;
        }
        if from == DType::I32 && to == DType::I64 {
            row.copy_from_slice(&read_int(&s, from, i).to_le_bytes());
            return;
        }
        let v = read_any(&s, from, i);
        match to {
            DType::F32 => row.copy_from_slice(&(v as f32).to_le_bytes()),
            DType::F16 => row.copy_from_slice(&half::f16::from_f32(v as f32).to_le_bytes()),
            DType::BF16 => row.copy_from_slice(&half::bf16::from_f32(v as f32).to_le_bytes()),
            DType::I32 => row.copy_from_slice(&(v as i32).to_le_bytes()),
            DType::I64 => row.copy_from_slice(&(v as i64).to_le_bytes()),
            DType::U8 => row[0] = v as u8,
        }
    });
    Ok(())
}
