//! Top k along the last axis, sorted descending, ties to the lower index.

use rayon::prelude::*;
use rlx_ir::DType;
use rlx_schedule::BufRef;

use crate::elem::{read_int, with_float, Elem};
use crate::memory::{Dst, Mem, Src};
use crate::{exec_err, Result};

pub struct TopKArgs<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub len: usize,
    pub k: usize,
    pub x: &'a BufRef,
    pub values: Option<&'a BufRef>,
    pub indices: Option<&'a BufRef>,
}

pub fn run(a: &TopKArgs<'_>, mem: &Mem) -> Result<()> {
    let idx = a.indices.map(|b| mem.dst::<i32>(b)).transpose().map_err(exec_err)?;
    if a.dtype.is_int() {
        return ints(a, mem, idx);
    }
    with_float!(a.dtype, T => {
        let x = mem.src::<T>(a.x).map_err(exec_err)?;
        let vals = a.values.map(|b| mem.dst::<T>(b)).transpose().map_err(exec_err)?;
        rows::<T>(a, x, vals, idx);
    });
    Ok(())
}

/// Descending by value, NaN last, equal values by ascending index.
fn order(a: &(f32, usize), b: &(f32, usize)) -> std::cmp::Ordering {
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    key(b.0).total_cmp(&key(a.0)).then(a.1.cmp(&b.1))
}

fn rows<T: Elem>(a: &TopKArgs<'_>, x: Src<T>, vals: Option<Dst<T>>, idx: Option<Dst<i32>>) {
    let (len, k) = (a.len, a.k);
    (0..a.rows).into_par_iter().for_each_init(
        || (vec![0f32; len], Vec::with_capacity(len)),
        |(v, pairs), r| {
            x.load(r * len, v);
            pairs.clear();
            pairs.extend(v.iter().copied().zip(0..len));
            if k < len && k > 0 {
                pairs.select_nth_unstable_by(k - 1, order);
            }
            let top = &mut pairs[..k];
            top.sort_by(order);
            for (j, (val, i)) in top.iter().enumerate() {
                if let Some(d) = &vals {
                    d.set(r * k + j, T::from_f32(*val));
                }
                if let Some(d) = &idx {
                    d.set(r * k + j, *i as i32);
                }
            }
        },
    );
}

/// Integer input: keys compared exactly as i64, values copied as bytes.
fn ints(a: &TopKArgs<'_>, mem: &Mem, idx: Option<Dst<i32>>) -> Result<()> {
    let x = mem.src::<u8>(a.x).map_err(exec_err)?;
    let vals = a.values.map(|b| mem.dst::<u8>(b)).transpose().map_err(exec_err)?;
    let (len, k, es) = (a.len, a.k, a.dtype.size());
    let mut order: Vec<(i64, usize)> = Vec::with_capacity(len);
    for r in 0..a.rows {
        order.clear();
        order.extend((0..len).map(|j| (read_int(&x, a.dtype, r * len + j), j)));
        order.sort_by(|p, q| q.0.cmp(&p.0).then(p.1.cmp(&q.1)));
        for (j, &(_, i)) in order[..k].iter().enumerate() {
            if let Some(d) = &vals {
                d.copy_from((r * k + j) * es, &x, (r * len + i) * es, es);
            }
            if let Some(d) = &idx {
                d.set(r * k + j, i as i32);
            }
        }
    }
    Ok(())
}
