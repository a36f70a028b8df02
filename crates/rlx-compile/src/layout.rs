//! How a value sits in memory: a root (arena buffer, weight, state, const),
//! a byte offset into it and element strides. Shared by the planner (which
//! decides what may be a view) and lowering (which turns it into `BufRef`s,
//! `SeqView`s and `RowsView`s).

/// What a value's bytes belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Root {
    /// Index into `ArenaPlan::buffers`.
    Arena(usize),
    Weight(u32),
    State(u32),
    Const(u32),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loc {
    pub root: Root,
    /// Bytes from the start of the root.
    pub offset: u64,
    /// Elements per step of each dim.
    pub strides: Vec<u64>,
    /// Row-major dense: `strides` are the shape's own.
    pub contiguous: bool,
}

impl Loc {
    pub fn dense(root: Root, offset: u64, dims: &[usize]) -> Loc {
        Loc { root, offset, strides: dense_strides(dims), contiguous: true }
    }
}

pub fn dense_strides(dims: &[usize]) -> Vec<u64> {
    let mut s = vec![1u64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1] as u64;
    }
    s
}

/// Bytes from the first to one past the last element reached.
pub fn span_bytes(dims: &[usize], strides: &[u64], elem: usize) -> u64 {
    if dims.contains(&0) {
        return 0;
    }
    let last: u64 = dims.iter().zip(strides).map(|(&d, &s)| (d as u64 - 1) * s).sum();
    (last + 1) * elem as u64
}

/// Reads `[.., cols]` as `[rows, cols]` with one row stride: the last dim
/// must be unit-stride and the leading dims must flatten (each stride the
/// next one times its extent). Returns (rows, row_stride).
pub fn rows_view(dims: &[usize], strides: &[u64]) -> Option<(usize, u64)> {
    let r = dims.len();
    if r == 0 {
        return Some((1, 1));
    }
    let cols = dims[r - 1];
    if cols > 1 && strides[r - 1] != 1 {
        return None;
    }
    let mut row_stride = None;
    let mut expect = None;
    for i in (0..r - 1).rev() {
        if dims[i] == 1 {
            continue;
        }
        match expect {
            None => row_stride = Some(strides[i]),
            Some(e) if e != strides[i] => return None,
            Some(_) => {}
        }
        expect = Some(strides[i] * dims[i] as u64);
    }
    Some((dims[..r - 1].iter().product(), row_stride.unwrap_or(cols as u64)))
}

/// Reads a rank-3 `[B, S, W]` through (batch_stride, row_stride).
pub fn seq_view(dims: &[usize], strides: &[u64]) -> Option<(u64, u64)> {
    if dims.len() != 3 || (dims[2] > 1 && strides[2] != 1) {
        return None;
    }
    Some((strides[0], strides[1]))
}
