//! The arena planner: where every value lives and when arena memory can be
//! reused.
//!
//! Steps are node indices (the schedule runs nodes in graph order). A value
//! either owns an arena buffer, aliases another value (views, in-place
//! elementwise ops, state writes), or lives outside the arena (weights,
//! states, constants). Buffers get 256-byte aligned offsets by best fit in
//! a free list; a buffer is free once the last step that reads it (directly
//! or through an alias) has run.

use rlx_ir::{FfnResidual, Graph, Op};

use crate::layout::{rows_view, seq_view, Loc, Root};
use crate::passes::users;
use crate::{ArenaSummary, CompileError, ConstBlob, PlacedBuffer, WeightSlot, ARENA_ALIGN};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferKind {
    /// A node's own output.
    Value,
    /// A graph input, staged before step 0.
    Input,
    /// Working memory of one node, live only at its step.
    Scratch,
    /// Graph output `i` materialised by a copy right after its node.
    OutputCopy(usize),
}

#[derive(Debug, Clone)]
pub struct Buffer {
    pub node: usize,
    pub kind: BufferKind,
    pub bytes: u64,
    pub first: usize,
    /// Last step that reads it; `steps` (one past the last node) = to the end.
    pub last: usize,
    pub offset: u64,
}

#[derive(Debug, Clone)]
pub struct ArenaPlan {
    /// Where each node's value lives.
    pub locs: Vec<Loc>,
    pub buffers: Vec<Buffer>,
    /// The node writes over its first input.
    pub in_place: Vec<bool>,
    /// Scratch buffer of a node (reduce over non-adjacent axes; the turned
    /// q and k of an attention append with RoPE; the values a fused
    /// feed-forward block passes between its parts, see [`ffn_scratch`]).
    pub scratch: Vec<Option<usize>>,
    /// Per graph output: the buffer it is copied into, if it needs one.
    pub output_copy: Vec<Option<usize>>,
    pub weights: Vec<WeightSlot>,
    /// Node of each state, indexed like `Space::State`.
    pub states: Vec<usize>,
    pub consts: Vec<ConstBlob>,
    pub steps: usize,
    pub arena_bytes: u64,
    pub naive_bytes: u64,
}

pub fn align(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

fn value_bytes(g: &Graph, i: usize) -> u64 {
    (g.nodes[i].shape.numel() * g.nodes[i].dtype.size()) as u64
}

/// A reduce whose axes are not adjacent is lowered as a transposing copy
/// into scratch followed by one reduce.
pub fn reduce_needs_copy(axes: &[usize]) -> bool {
    axes.windows(2).any(|w| w[1] != w[0] + 1)
}

/// The scratch parts of fused feed-forward block `i`, in bytes, each
/// rounded up to the arena's alignment: FFN1's output `[rows, I]`, FFN2's
/// `[rows, H]`, and with `attn_out` the projection's and norm1's
/// `[rows, H]`.
pub fn ffn_scratch(g: &Graph, i: usize, f: &rlx_ir::FeedForwardSpec) -> Vec<u64> {
    let n = &g.nodes[i];
    let (numel, h, es) = (n.shape.numel() as u64, n.shape.last().max(1) as u64, n.dtype.size() as u64);
    let inter = g.nodes[n.inputs[f.slots().w1].0].shape.dims()[0] as u64;
    let mut parts = vec![align(numel / h * inter * es), align(numel * es)];
    if f.attn_out.is_some() {
        parts.extend([align(numel * es); 2]);
    }
    parts
}

/// Whether `user` can read the value at input slot `slot` through these
/// strides (the consumers that take views, see `Thunk`).
fn accepts_strides(op: &Op, slot: usize, dims: &[usize], strides: &[u64]) -> bool {
    match op {
        Op::Attention(_) | Op::AttentionAppend { .. } if slot < 3 => seq_view(dims, strides).is_some(),
        Op::Rope { .. } if slot == 0 => seq_view(dims, strides).is_some(),
        Op::SwiGlu if slot < 2 => rows_view(dims, strides).is_some(),
        Op::MatMul { .. } | Op::MatMulFused { .. } if slot == 0 => rows_view(dims, strides).is_some(),
        // The block's input as rows, unless a residual reads it densely too.
        Op::FeedForward(f) if slot == 0 => {
            let dense = f.attn_out.is_none() && [f.residual2, f.norm_residual].contains(&FfnResidual::Block);
            !dense && rows_view(dims, strides).is_some()
        }
        _ => false,
    }
}

/// The weight slot a node denotes without any work: a param, a cast of a
/// param, or a concat of those.
fn weight_slot(g: &Graph, i: usize) -> Option<WeightSlot> {
    let node = &g.nodes[i];
    let param_name = |j: usize| -> Option<String> {
        let n = &g.nodes[j];
        match &n.op {
            Op::Param { name } => Some(name.clone()),
            Op::Cast => match &g.nodes[n.inputs[0].0].op {
                Op::Param { name } => Some(name.clone()),
                _ => None,
            },
            _ => None,
        }
    };
    let (parts, concat_axis) = match &node.op {
        Op::Param { .. } | Op::Cast => (vec![param_name(i)?], 0),
        Op::Concat { axis } => (node.inputs.iter().map(|x| param_name(x.0)).collect::<Option<Vec<_>>>()?, *axis),
        _ => return None,
    };
    Some(WeightSlot { name: parts.join("+"), parts, concat_axis, shape: node.shape.clone(), dtype: node.dtype })
}

struct Planner<'a> {
    g: &'a Graph,
    users: Vec<Vec<usize>>,
    last_use: Vec<usize>,
    is_output: Vec<bool>,
    plan: ArenaPlan,
}

impl Planner<'_> {
    fn new_buffer(&mut self, node: usize, kind: BufferKind, bytes: u64, first: usize, last: usize) -> usize {
        self.plan.buffers.push(Buffer { node, kind, bytes, first, last, offset: 0 });
        self.plan.buffers.len() - 1
    }

    fn own(&mut self, i: usize) -> Loc {
        let b = self.new_buffer(i, BufferKind::Value, value_bytes(self.g, i), i, self.last_use[i]);
        Loc::dense(Root::Arena(b), 0, self.g.nodes[i].shape.dims())
    }

    /// `i` shares the memory of `loc`: an arena root must stay alive as long
    /// as `i` is read.
    fn alias(&mut self, i: usize, loc: Loc) -> Loc {
        if let Root::Arena(b) = loc.root {
            let last = self.last_use[i];
            let buf = &mut self.plan.buffers[b];
            buf.last = buf.last.max(last);
        }
        loc
    }

    fn weight(&mut self, slot: WeightSlot) -> u32 {
        let w = &mut self.plan.weights;
        let pos = w.iter().position(|s| s.parts == slot.parts && s.concat_axis == slot.concat_axis && s.dtype == slot.dtype);
        pos.unwrap_or_else(|| {
            w.push(slot);
            w.len() - 1
        }) as u32
    }

    /// A param read only through a derived slot (a concat or cast of
    /// params) needs no slot of its own: backends would upload it for
    /// nothing. Removes such slots and renumbers the rest.
    fn drop_absorbed_weights(&mut self) {
        let g = self.g;
        let locs = &self.plan.locs;
        let mut needed = vec![false; self.plan.weights.len()];
        for (i, loc) in locs.iter().enumerate() {
            if let Root::Weight(w) = loc.root {
                let absorbed =
                    |u: &usize| matches!(locs[*u].root, Root::Weight(_)) && matches!(g.nodes[*u].op, Op::Cast | Op::Concat { .. });
                if self.is_output[i] || !self.users[i].iter().all(absorbed) {
                    needed[w as usize] = true;
                }
            }
        }
        let mut renumber = vec![0u32; needed.len()];
        let mut kept = vec![];
        for (w, slot) in std::mem::take(&mut self.plan.weights).into_iter().enumerate() {
            if needed[w] {
                renumber[w] = kept.len() as u32;
                kept.push(slot);
            }
        }
        self.plan.weights = kept;
        for loc in &mut self.plan.locs {
            if let Root::Weight(w) = &mut loc.root {
                *w = renumber[*w as usize];
            }
        }
    }

    fn can_run_in_place(&self, i: usize) -> bool {
        let node = &self.g.nodes[i];
        let elementwise = match node.op {
            Op::Binary(_) => self.g.nodes[node.inputs[0].0].shape == node.shape,
            Op::Activation(_) | Op::SwiGlu => true,
            _ => false,
        };
        if !elementwise {
            return false;
        }
        let first = node.inputs[0].0;
        let loc = &self.plan.locs[first];
        let Root::Arena(b) = loc.root else { return false };
        let buf = &self.plan.buffers[b];
        let others_alias = node.inputs[1..].iter().any(|x| x.0 != first && self.plan.locs[x.0].root == loc.root);
        buf.kind == BufferKind::Value
            && loc.contiguous
            && loc.offset == 0
            && buf.bytes == value_bytes(self.g, i)
            && buf.last <= i
            && !others_alias
    }

    fn narrow(&mut self, i: usize, axis: usize, start: usize) -> Loc {
        let g = self.g;
        let node = &g.nodes[i];
        let src = self.plan.locs[node.inputs[0].0].clone();
        if !src.contiguous {
            return self.own(i);
        }
        let offset = src.offset + (start as u64) * src.strides[axis] * node.dtype.size() as u64;
        let dims = node.shape.dims();
        if dims[..axis].iter().all(|&d| d == 1) {
            return self.alias(i, Loc::dense(src.root, offset, dims));
        }
        let strides = src.strides.clone();
        let all_accept = !self.is_output[i]
            && self.users[i].iter().all(|&u| {
                let un = &g.nodes[u];
                un.inputs.iter().enumerate().filter(|(_, x)| x.0 == i).all(|(k, _)| accepts_strides(&un.op, k, dims, &strides))
            });
        if all_accept {
            self.alias(i, Loc { root: src.root, offset, strides, contiguous: false })
        } else {
            self.own(i)
        }
    }

    fn place(&mut self, i: usize) -> Result<Loc, CompileError> {
        let g = self.g;
        let node = &g.nodes[i];
        let dims = node.shape.dims();
        let input_loc = |p: &Self| node.inputs.first().map(|x| p.plan.locs[x.0].clone());
        if let Some(slot) = weight_slot(g, i) {
            let w = self.weight(slot);
            return Ok(Loc::dense(Root::Weight(w), 0, dims));
        }
        Ok(match &node.op {
            Op::Input { .. } => {
                let b = self.new_buffer(i, BufferKind::Input, value_bytes(g, i), 0, self.last_use[i]);
                Loc::dense(Root::Arena(b), 0, dims)
            }
            Op::State { .. } => {
                self.plan.states.push(i);
                Loc::dense(Root::State(self.plan.states.len() as u32 - 1), 0, dims)
            }
            Op::Constant { data } => {
                self.plan.consts.push(ConstBlob { shape: node.shape.clone(), dtype: node.dtype, data: data.clone() });
                Loc::dense(Root::Const(self.plan.consts.len() as u32 - 1), 0, dims)
            }
            Op::WriteState => {
                let src = input_loc(self).ok_or_else(|| lower_err(g, i, "write_state without a state input"))?;
                self.alias(i, src)
            }
            Op::Reshape | Op::Cast if node.op == Op::Reshape || g.nodes[node.inputs[0].0].dtype == node.dtype => {
                let src = input_loc(self).ok_or_else(|| lower_err(g, i, "missing input"))?;
                if !src.contiguous {
                    return Err(lower_err(g, i, "input is a strided view; reshape needs a dense input"));
                }
                self.alias(i, Loc::dense(src.root, src.offset, dims))
            }
            Op::Narrow { axis, start, .. } => self.narrow(i, *axis, *start),
            _ if self.can_run_in_place(i) => {
                self.plan.in_place[i] = true;
                let src = input_loc(self).ok_or_else(|| lower_err(g, i, "missing input"))?;
                self.alias(i, src)
            }
            _ => self.own(i),
        })
    }
}

pub(crate) fn lower_err(g: &Graph, i: usize, detail: impl Into<String>) -> CompileError {
    CompileError::Lower { node: i, op: g.nodes[i].op.name().to_string(), detail: detail.into() }
}

/// Places every value of a graph (verified first).
pub fn plan(g: &Graph) -> Result<ArenaPlan, CompileError> {
    plan_with(g, None)
}

/// The scratch of quantized matmul node `i` (see
/// `rlx_schedule::qmatmul_scratch_parts`) when it has at least `min_rows`
/// rows, in bytes; 0 otherwise.
pub fn qmatmul_scratch(g: &Graph, i: usize, min_rows: Option<usize>) -> u64 {
    let node = &g.nodes[i];
    let glu = match node.op {
        Op::QMatMul { .. } => false,
        Op::QMatMulFused { glu, .. } => glu,
        _ => return 0,
    };
    let (n, k) = (node.shape.last(), g.nodes[node.inputs[0].0].shape.last());
    let rows = node.shape.numel() / n.max(1);
    match min_rows {
        Some(m) if rows >= m && n > 0 && k > 0 => rlx_schedule::qmatmul_scratch_parts(rows, n, k, glu).map_or(0, |p| p.iter().sum()),
        _ => 0,
    }
}

/// As [`plan`]; quantized matmuls of at least `qmatmul_scratch_rows` rows
/// get scratch ([`qmatmul_scratch`]).
pub fn plan_with(g: &Graph, qmatmul_scratch_rows: Option<usize>) -> Result<ArenaPlan, CompileError> {
    g.verify()?;
    let n = g.len();
    let users = users(g);
    let mut is_output = vec![false; n];
    for o in &g.outputs {
        if let Some(x) = is_output.get_mut(o.0) {
            *x = true;
        }
    }
    let last_use = (0..n).map(|i| if is_output[i] { n } else { users[i].iter().copied().max().unwrap_or(i) }).collect();
    let empty = ArenaPlan {
        locs: Vec::with_capacity(n),
        buffers: vec![],
        in_place: vec![false; n],
        scratch: vec![None; n],
        output_copy: vec![None; g.outputs.len()],
        weights: vec![],
        states: vec![],
        consts: vec![],
        steps: n,
        arena_bytes: 0,
        naive_bytes: 0,
    };
    let mut p = Planner { g, users, last_use, is_output, plan: empty };
    for i in 0..n {
        let loc = p.place(i)?;
        p.plan.locs.push(loc);
        let scratch = match &g.nodes[i].op {
            Op::Reduce { axes, .. } if reduce_needs_copy(axes) => g.nodes[g.nodes[i].inputs[0].0].shape.numel(),
            // The turned q and new keys, for a backend that turns them first.
            Op::AttentionAppend { rope: Some(_), .. } => g.nodes[i].shape.numel() + g.nodes[g.nodes[i].inputs[1].0].shape.numel(),
            _ => 0,
        };
        let bytes = match &g.nodes[i].op {
            Op::FeedForward(f) => ffn_scratch(g, i, f).iter().sum(),
            Op::QMatMul { .. } | Op::QMatMulFused { .. } => qmatmul_scratch(g, i, qmatmul_scratch_rows),
            _ => (scratch * g.nodes[i].dtype.size()) as u64,
        };
        if bytes > 0 {
            p.plan.scratch[i] = Some(p.new_buffer(i, BufferKind::Scratch, bytes, i, i));
        }
    }
    p.drop_absorbed_weights();
    for (k, o) in g.outputs.iter().enumerate() {
        let loc = &p.plan.locs[o.0];
        let owned = matches!(loc.root, Root::Arena(b) if p.plan.buffers[b].kind == BufferKind::Value);
        if !(owned && loc.contiguous) {
            p.plan.output_copy[k] = Some(p.new_buffer(o.0, BufferKind::OutputCopy(k), value_bytes(g, o.0), o.0, n));
        }
    }
    let mut plan = p.plan;
    assign_offsets(&mut plan);
    let in_place: u64 = (0..n).filter(|&i| plan.in_place[i]).map(|i| align(value_bytes(g, i))).sum();
    plan.naive_bytes = plan.buffers.iter().map(|b| align(b.bytes)).sum::<u64>() + in_place;
    Ok(plan)
}

/// Best-fit placement over the live ranges.
fn assign_offsets(plan: &mut ArenaPlan) {
    let mut order: Vec<usize> = (0..plan.buffers.len()).collect();
    order.sort_by_key(|&b| (plan.buffers[b].first, b));
    // Free blocks (offset, size), sorted by offset, adjacent ones merged.
    let mut free: Vec<(u64, u64)> = vec![];
    let mut top = 0u64;
    let mut live: Vec<usize> = vec![];
    for &b in &order {
        let step = plan.buffers[b].first;
        live.retain(|&l| {
            let buf = &plan.buffers[l];
            if buf.last < step {
                release(&mut free, buf.offset, align(buf.bytes));
                false
            } else {
                true
            }
        });
        let need = align(plan.buffers[b].bytes);
        let best = free.iter().enumerate().filter(|(_, f)| f.1 >= need).min_by_key(|(_, f)| f.1).map(|(j, _)| j);
        let offset = match best {
            Some(j) => {
                let (off, size) = free[j];
                if size == need {
                    free.remove(j);
                } else {
                    free[j] = (off + need, size - need);
                }
                off
            }
            // Nothing fits: grow the arena, reusing a free tail if there is one.
            None => match free.last() {
                Some(&(off, size)) if off + size == top => {
                    free.pop();
                    top = off + need;
                    off
                }
                _ => {
                    top += need;
                    top - need
                }
            },
        };
        plan.buffers[b].offset = offset;
        live.push(b);
    }
    plan.arena_bytes = top;
}

fn release(free: &mut Vec<(u64, u64)>, off: u64, size: u64) {
    let pos = free.partition_point(|f| f.0 < off);
    free.insert(pos, (off, size));
    if pos + 1 < free.len() && free[pos].0 + free[pos].1 == free[pos + 1].0 {
        free[pos].1 += free[pos + 1].1;
        free.remove(pos + 1);
    }
    if pos > 0 && free[pos - 1].0 + free[pos - 1].1 == free[pos].0 {
        free[pos - 1].1 += free[pos].1;
        free.remove(pos);
    }
}

impl ArenaPlan {
    pub fn summary(&self) -> ArenaSummary {
        let buffers = self
            .buffers
            .iter()
            .map(|b| PlacedBuffer { node: b.node, offset: b.offset, bytes: b.bytes, first: b.first, last: b.last.min(self.steps) })
            .collect();
        ArenaSummary { planned_bytes: self.arena_bytes, naive_bytes: self.naive_bytes, buffers }
    }
}
