//! Rotary position embedding. Angles are computed in f64 (positions times
//! frequencies reach thousands of radians, where f32 loses digits), then
//! the rotation itself runs in f32.

use rayon::prelude::*;
use rlx_ir::{DType, RopeMode};
use rlx_schedule::{BufRef, SeqView};

use crate::elem::{with_float, Elem};
use crate::memory::{Dst, Mem, Src};
use crate::{exec_err, Result};

pub struct RopeArgs<'a> {
    pub dtype: DType,
    pub mode: RopeMode,
    pub theta: f32,
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub x: &'a SeqView,
    pub positions: &'a BufRef,
    pub positions_per_batch: bool,
    pub out: &'a BufRef,
    /// f32 `[head_dim/2]`: pair i's frequency is divided by factor i.
    pub freq_factors: Option<&'a BufRef>,
}

pub fn run(a: &RopeArgs<'_>, mem: &Mem) -> Result<()> {
    let pos = mem.src::<i32>(a.positions).map_err(exec_err)?;
    let half = a.head_dim / 2;
    // freq_i = theta^(-2i / head_dim) / factor_i
    let mut inv_freq: Vec<f64> = (0..half).map(|i| (a.theta as f64).powf(-2.0 * i as f64 / a.head_dim as f64)).collect();
    if let Some(f) = a.freq_factors {
        let mut factors = vec![0f32; half];
        mem.src::<f32>(f).map_err(exec_err)?.load(0, &mut factors);
        inv_freq.iter_mut().zip(&factors).for_each(|(v, f)| *v /= *f as f64);
    }
    with_float!(a.dtype, T => rows::<T>(a, &inv_freq, mem.src::<T>(&a.x.buf).map_err(exec_err)?, pos, mem.dst::<T>(a.out).map_err(exec_err)?));
    Ok(())
}

fn rows<T: Elem>(a: &RopeArgs<'_>, inv_freq: &[f64], x: Src<T>, pos: Src<i32>, out: Dst<T>) {
    let (hd, half, width) = (a.head_dim, a.head_dim / 2, a.heads * a.head_dim);
    let (bs, rs) = (a.x.batch_stride as usize, a.x.row_stride as usize);
    (0..a.batch * a.seq).into_par_iter().with_min_len((1 << 12) / width.max(1) + 1).for_each_init(
        || (vec![0f32; width], vec![0f32; width], vec![0f32; half], vec![0f32; half]),
        |(v, o, cos, sin), row| {
            let (b, s) = (row / a.seq, row % a.seq);
            let p = pos.get(if a.positions_per_batch { row } else { s }) as f64;
            for i in 0..half {
                let (sn, cs) = (p * inv_freq[i]).sin_cos();
                cos[i] = cs as f32;
                sin[i] = sn as f32;
            }
            x.load(b * bs + s * rs, v);
            for h in 0..a.heads {
                let (xv, ov) = (&v[h * hd..(h + 1) * hd], &mut o[h * hd..(h + 1) * hd]);
                match a.mode {
                    RopeMode::RotateHalf => {
                        for i in 0..half {
                            let (x1, x2) = (xv[i], xv[i + half]);
                            ov[i] = x1 * cos[i] - x2 * sin[i];
                            ov[i + half] = x2 * cos[i] + x1 * sin[i];
                        }
                    }
                    RopeMode::Interleaved => {
                        for i in 0..half {
                            let (x1, x2) = (xv[2 * i], xv[2 * i + 1]);
                            ov[2 * i] = x1 * cos[i] - x2 * sin[i];
                            ov[2 * i + 1] = x2 * cos[i] + x1 * sin[i];
                        }
                    }
                }
            }
            out.store(row * width, o);
        },
    );
}
