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

/// Another tensor turned at `RopeArgs`' positions ([`run_shared`]): its
/// rows (`heads` heads of the args' head dim each) and its output.
pub struct RopeTarget<'a> {
    pub heads: usize,
    pub x: &'a SeqView,
    pub out: &'a BufRef,
}

pub fn run(a: &RopeArgs<'_>, mem: &Mem) -> Result<()> {
    run_shared(a, &[], mem)
}

/// `a`, and the `more` tensors at the same positions (a decode step's
/// query and new key): each row's angles are computed once for all of
/// them, with the same values `run` computes for each.
pub fn run_shared(a: &RopeArgs<'_>, more: &[RopeTarget<'_>], mem: &Mem) -> Result<()> {
    let pos = mem.src::<i32>(a.positions).map_err(exec_err)?;
    let half = a.head_dim / 2;
    let factors = match a.freq_factors {
        Some(f) => {
            let mut v = vec![0f32; half];
            mem.src::<f32>(f).map_err(exec_err)?.load(0, &mut v);
            Some(v)
        }
        None => None,
    };
    let inv_freq = inv_freq(a.theta, a.head_dim, factors.as_deref());
    let own = RopeTarget { heads: a.heads, x: a.x, out: a.out };
    let targets: Vec<&RopeTarget<'_>> = std::iter::once(&own).chain(more).collect();
    with_float!(a.dtype, T => {
        let views = targets
            .iter()
            .map(|t| Ok((t.heads, t.x, mem.src::<T>(&t.x.buf).map_err(exec_err)?, mem.dst::<T>(t.out).map_err(exec_err)?)))
            .collect::<Result<Vec<_>>>()?;
        rows::<T>(a, &inv_freq, &views, pos);
    });
    Ok(())
}

/// freq_i = theta^(-2i / head_dim) / factor_i, in f64. The last set made
/// on this thread is kept: a decode step asks for the same one in every
/// layer.
fn inv_freq(theta: f32, head_dim: usize, factors: Option<&[f32]>) -> std::rc::Rc<Vec<f64>> {
    type Key = (u32, usize, Option<Vec<u32>>);
    thread_local! {
        static LAST: std::cell::RefCell<Option<(Key, std::rc::Rc<Vec<f64>>)>> = const { std::cell::RefCell::new(None) };
    }
    let key: Key = (theta.to_bits(), head_dim, factors.map(|f| f.iter().map(|v| v.to_bits()).collect()));
    LAST.with(|last| {
        if let Some((k, v)) = &*last.borrow() {
            if *k == key {
                return v.clone();
            }
        }
        let half = head_dim / 2;
        let mut f: Vec<f64> = (0..half).map(|i| (theta as f64).powf(-2.0 * i as f64 / head_dim as f64)).collect();
        if let Some(factors) = factors {
            f.iter_mut().zip(factors).for_each(|(v, d)| *v /= *d as f64);
        }
        let f = std::rc::Rc::new(f);
        *last.borrow_mut() = Some((key, f.clone()));
        f
    })
}

type View<'a, T> = (usize, &'a SeqView, Src<T>, Dst<T>);

fn rows<T: Elem>(a: &RopeArgs<'_>, inv_freq: &[f64], views: &[View<'_, T>], pos: Src<i32>) {
    let (hd, half) = (a.head_dim, a.head_dim / 2);
    let width = views.iter().map(|v| v.0 * hd).max().unwrap_or(0);
    let all: usize = views.iter().map(|v| v.0 * hd).sum();
    let rows = a.batch * a.seq;
    let new_bufs = || (vec![0f32; width], vec![0f32; width], vec![0f32; half], vec![0f32; half]);
    let row_fn = |(v, o, cos, sin): &mut (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>), row: usize| {
        let (b, s) = (row / a.seq, row % a.seq);
        let p = pos.get(if a.positions_per_batch { row } else { s }) as f64;
        for i in 0..half {
            let (sn, cs) = (p * inv_freq[i]).sin_cos();
            cos[i] = cs as f32;
            sin[i] = sn as f32;
        }
        for (heads, view, x, out) in views {
            let w = heads * hd;
            let (v, o) = (&mut v[..w], &mut o[..w]);
            x.load(b * view.batch_stride as usize + s * view.row_stride as usize, v);
            for h in 0..*heads {
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
            out.store(row * w, o);
        }
    };
    // A decode step's few rows run here: a parallel loop's hand-offs cost
    // more than they take.
    if rows * all < 1 << 14 {
        let mut bufs = new_bufs();
        (0..rows).for_each(|row| row_fn(&mut bufs, row));
    } else {
        (0..rows).into_par_iter().with_min_len((1 << 12) / all.max(1) + 1).for_each_init(new_bufs, row_fn);
    }
}
