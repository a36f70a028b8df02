//! The fused feed-forward block (kernels/ffn.cu) for at most 128 rows:
//! FFN1 (+bias, erf-GELU), FFN2 (+bias) and the norm after them as fused
//! kernels instead of cuBLASLt, the GELU epilogue, cuBLASLt and the norm.
//!
//! `find` picks the triples it can run: MatMul → MatMul → Norm where the
//! first matmul's output feeds only the second, the second's only the norm
//! (neither is read again before it is overwritten, nor is an output), the
//! weights are stored `[out, in]` and (H, I) has a compiled kernel. `build`
//! lowers one triple for a slot. Two kernels exist:
//! - the cluster kernel (`ffn_<KB>_<IC>` + `ffn_norm`; bert-base's and
//!   MiniLM's widths): 8-block clusters split I, sum FFN1's split-K and
//!   exchange the intermediate through DSMEM, and write f32 shares of FFN2
//!   to a workspace (shared by every fused block of an executable: they run
//!   one after another on its stream) that the norm kernel sums;
//! - the row split (`ffn_rows_<H>_<I>`, MiniLM's widths): 16-block clusters
//!   over groups of at most 32 rows run the whole block and the norm, each
//!   block 1/16 of I, FFN2's partials and the norm's statistics summed over
//!   DSMEM. Where the block follows the attention's output projection and
//!   its norm (MatMul [H, H] → Norm → triple), `ffn_rows_tail_<H>_<I>` runs
//!   those two as well (five thunks): each block OC = H/16 columns of the
//!   projection, norm1's statistics combined over DSMEM, and norm1's output
//!   stored and pushed into every block of the cluster.
//!
//! The row split with its tail is the default where it is compiled (sm_90+):
//! on the H200 (bench/gpu-perf.md, session 12) MiniLM reads 112 / 122 / 129
//! / 131 / 149 µs at 1×16 / 1×32 / 1×48 / 1×64 / 1×128 against 133 / 133 /
//! 139 / 138 / 150 with cuBLASLt's kernels (20 kernels per forward instead
//! of 50), and never measured slower. RLX_FFN_TAIL=0 leaves the tail out.
//! The cluster kernel is opt-in: 197–203 µs against 150–154 at MiniLM 1×128,
//! bert-base 625–642 against 370–374 (session 11). Its data movement is the
//! cost: DSMEM exchanges (~10 KB per µs per block measured), the cluster
//! barriers, the f32 shares through L2 (6.3 MB at bert-base) and two waves of
//! clusters at bert-base (15 of its 16 fit at once). `set_ffn_fusion` or
//! RLX_FFN (`0` none, `rows` the default, `1` = all, `clusters`) chooses;
//! each loads kernels/ffn.cu on first use. Diagnostics: RLX_FFN_INFO=1
//! prints the resident clusters at prepare; RLX_FFN_SKIP=bits leaves parts
//! of the kernels out (wrong results, timing only; see `skip_bits`).

use rlx_compile::operands::operands;
use rlx_compile::{BufRef, MatMulThunk, Thunk};
use rlx_ir::{Activation, DType};
use rlx_runtime::Result;

use crate::launch::{suffix, Args, Bases, Kernels, Op, Step};

/// Rows one fused block handles (one 128-row tile per cluster).
const MAX_ROWS: usize = 128;
/// Blocks per cluster: the K slices of FFN1 and the column slices of FFN2.
const CLUSTER: usize = 8;

/// A compiled variant of kernels/ffn.cu: hidden width H, intermediate I,
/// intermediate columns per cluster and warps per block.
struct Variant {
    h: usize,
    i: usize,
    ic: usize,
    warps: u32,
}

const VARIANTS: [Variant; 2] = [Variant { h: 768, i: 3072, ic: 192, warps: 16 }, Variant { h: 384, i: 1536, ic: 96, warps: 8 }];

impl Variant {
    fn kb(&self) -> usize {
        self.h / CLUSTER
    }
    fn clusters(&self) -> usize {
        self.i / self.ic
    }
    /// kernels/ffn.cu's FfnSmem::TOTAL.
    fn smem(&self) -> u32 {
        let (kb, ic) = (self.kb(), self.ic);
        let (xp, hp) = (kb + 8, ic + 8);
        let u = ((128 + ic) * xp * 2).max(128 * hp * 2);
        (u + kb * hp * 2 + 128 * hp * 4 + ic * 2) as u32
    }
}

/// A compiled width of the row-split kernel (kernels/ffn.cu `ffn_rows_*`):
/// (H, I).
const ROW_VARIANTS: [(usize, usize); 1] = [(384, 1536)];
/// Blocks per cluster of the row split (a non-portable size).
const ROW_CLUSTER: usize = 16;
/// Rows one row-split cluster can take (kernels/ffn.cu FfnRowsSmem::RT).
const ROW_TILE: usize = 32;
/// Rows per row-split group to aim for (as many groups as that takes, up to
/// the clusters that fit at once): a cluster's DSMEM partials and epilogue
/// grow with its rows. H200, MiniLM replay µs at 1×16 / 1×32 / 1×48 / 1×64
/// (bench/gpu-perf.md, session 12): 8 rows 122 / 124 / 131 / 136–137, 12
/// rows 122–123 / 125–126 / 128 / 134, 16 rows 125 / 128 / 130 / 136; 24 and
/// 32 were slower still (1×64: 141 and 146).
const GROUP_ROWS: usize = 12;

/// kernels/ffn.cu's FfnRowsSmem::TOTAL.
fn row_smem(h: usize, i: usize) -> u32 {
    let is = i / ROW_CLUSTER;
    let (xp, hp) = (h + 8, is + 8);
    let khalf = 4 * 16 * (is / 2 + 4) * 4;
    ((ROW_TILE + is) * xp * 2 + h * hp * 2 + ROW_TILE * hp * 2 + is * 2 + 2 * ROW_TILE * 4 + ROW_TILE * 8 * 4 + khalf) as u32
}

/// The tail kernel's extra shared memory: the output projection's weight
/// slice [32][H+8] (kernels/ffn.cu FfnRowsSmem::WO).
fn tail_smem(h: usize) -> u32 {
    (32 * (h + 8) * 2) as u32
}

/// Which feed-forward blocks run as fused kernels (`set_ffn_fusion`, RLX_FFN).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnFusion {
    /// None (RLX_FFN=0).
    Off,
    /// The row split where it is compiled (H 384, I 1536), nothing else (the
    /// default; RLX_FFN=rows).
    Rows,
    /// The row split where it is compiled, the cluster kernel elsewhere (RLX_FFN=1).
    All,
    /// The cluster kernel only (RLX_FFN=clusters; A/B measurements).
    Clusters,
}

static MODE: std::sync::Mutex<Option<FfnFusion>> = std::sync::Mutex::new(None);

/// Sets which feed-forward blocks later prepares fuse (overrides `RLX_FFN`).
pub fn set_ffn_fusion(mode: FfnFusion) {
    if let Ok(mut g) = MODE.lock() {
        *g = Some(mode);
    }
}

fn mode() -> FfnFusion {
    if let Some(m) = MODE.lock().ok().and_then(|g| *g) {
        return m;
    }
    match std::env::var("RLX_FFN").ok().as_deref().map(str::trim) {
        Some("1" | "on" | "true" | "yes" | "all") => FfnFusion::All,
        Some("rows") => FfnFusion::Rows,
        Some("clusters") => FfnFusion::Clusters,
        Some("0" | "off" | "false" | "no") => FfnFusion::Off,
        None | Some("") => FfnFusion::Rows,
        Some(other) => {
            // A typo must not silently measure something else.
            eprintln!("rlx-cuda: RLX_FFN={other:?} is not one of 0, rows, 1, clusters; using the default (rows)");
            FfnFusion::Rows
        }
    }
}

/// RLX_FFN_SKIP=bits (timing diagnostic, wrong results): parts of the
/// fused kernels left out. Cluster kernel: 1 the cluster reduction, 2
/// FFN1's multiply, 4 FFN2, 8 the weight loads, 16 the cluster barriers, 32
/// the reduction's remote stores, 64 its remote loads, 128 the workspace
/// stores. Row split: 1 the remote loads of FFN2's partials, 2 those of the
/// norm's statistics, 4 the weight loads, 8 FFN1's multiply, 16 FFN2's; 32
/// (results unchanged) copies W2 before the programmatic-launch wait rather
/// than after X.
fn skip_bits() -> i64 {
    std::env::var("RLX_FFN_SKIP").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// The kernel a fused block runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// `ffn_<KB>_<IC>` + `ffn_norm`: VARIANTS[i].
    Clusters(usize),
    /// `ffn_rows_<H>_<I>`: the feed-forward block and the norm in one kernel.
    Rows,
    /// `ffn_rows_tail_<H>_<I>`: also the attention's output projection and
    /// the norm before the feed-forward block (five thunks).
    RowsTail,
}

/// Thunks start.. that `find` accepted: a feed-forward triple, or for
/// `RowsTail` the output projection and its norm, then the triple.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fusion {
    pub start: usize,
    kernel: Kernel,
}

impl Fusion {
    /// How many thunks it runs.
    pub fn thunks(&self) -> usize {
        if self.kernel == Kernel::RowsTail {
            5
        } else {
            3
        }
    }
}

/// RLX_FFN_TAIL=0 (A/B): the row split without the output projection and
/// its norm.
fn tail_enabled() -> bool {
    std::env::var("RLX_FFN_TAIL").map(|v| v.trim() != "0").unwrap_or(true)
}

/// `w` may be written (by the block that owns its rows and columns, after
/// every read of `r` that other blocks make) while `r` is read only if they
/// are the same bytes or apart.
fn same_or_apart(w: &BufRef, r: Option<&BufRef>) -> bool {
    r.is_none_or(|r| r == w || !w.overlaps(r))
}

/// Thunks i, i + 1: the attention's output projection ([rows, H] · W_oᵀ
/// (+ bias, + residual), W_o [H, H]) and the norm (+ residual) whose output
/// the feed-forward block `ffn` (thunks i + 2..) reads; the tail kernel
/// writes norm1's output as well, so its liveness does not matter; the
/// projection's output must be dead after the norm.
fn tail(thunks: &[Thunk], i: usize, ffn: &MatMulThunk, norm2_out: &BufRef, outputs: &[BufRef]) -> bool {
    let (Thunk::MatMul(o), Thunk::Norm { dtype, rows, cols, x, residual, out, .. }) = (&thunks[i], &thunks[i + 1]) else {
        return false;
    };
    let h = ffn.k;
    o.dtype == ffn.dtype
        && o.b_trans
        && o.b_batch_stride == 0
        && o.ldb == o.k as u64
        && o.k == h
        && o.n == h
        && o.batch * o.m == ffn.batch * ffn.m
        && (o.batch == 1 || o.a_batch_stride == o.m as u64 * o.lda)
        && o.lda.is_multiple_of(8)
        && o.lda >= o.k as u64
        && o.act.is_none()
        && o.residual.is_none_or(|r| r != o.out)
        && *dtype == o.dtype
        && *rows == o.batch * o.m
        && *cols == h
        && *x == o.out
        && residual.is_none_or(|r| r != *x)
        && *out == ffn.a
        && ffn.lda == h as u64
        // Norm1's output over the projection's input only as the same rows.
        && (!out.overlaps(&o.a) || (*out == o.a && o.lda == h as u64))
        && same_or_apart(out, residual.as_ref())
        && same_or_apart(out, o.residual.as_ref())
        && (!norm2_out.overlaps(&o.a) || (*norm2_out == o.a && o.lda == h as u64))
        && same_or_apart(norm2_out, residual.as_ref())
        && same_or_apart(norm2_out, o.residual.as_ref())
        && same_or_apart(norm2_out, Some(out))
        // The block's residuals, read after norm1's output is written.
        && matches!((&thunks[i + 3], &thunks[i + 4]), (Thunk::MatMul(f2), Thunk::Norm { residual: r2, .. })
            if same_or_apart(out, f2.residual.as_ref()) && same_or_apart(out, r2.as_ref()))
        && (*out == o.out || dead_after(thunks, i + 1, &o.out, outputs))
}

fn kernel_for(m: &MatMulThunk, mode: FfnFusion) -> Option<Kernel> {
    let rows = ROW_VARIANTS.contains(&(m.k, m.n)) && matches!(mode, FfnFusion::Rows | FfnFusion::All);
    let clusters = VARIANTS.iter().position(|v| v.h == m.k && v.i == m.n).filter(|_| matches!(mode, FfnFusion::All | FfnFusion::Clusters));
    if rows {
        Some(Kernel::Rows)
    } else {
        clusters.map(Kernel::Clusters)
    }
}

/// The first matmul: [rows, H] · W1ᵀ + b1, erf-GELU, rows contiguous.
fn first(m: &MatMulThunk) -> bool {
    let rows = m.batch * m.m;
    matches!(m.dtype, DType::F16 | DType::BF16)
        && m.b_trans
        && m.b_batch_stride == 0
        && m.ldb == m.k as u64
        && (m.batch == 1 || m.a_batch_stride == m.m as u64 * m.lda)
        && m.lda.is_multiple_of(8)
        && m.lda >= m.k as u64
        && m.act == Some(Activation::Gelu)
        && m.residual.is_none()
        && (1..=MAX_ROWS).contains(&rows)
}

/// `b` reads `a`'s whole output as a contiguous [rows, n] matrix.
fn second(a: &MatMulThunk, b: &MatMulThunk) -> bool {
    b.dtype == a.dtype
        && b.a == a.out
        && b.batch * b.m == a.batch * a.m
        && (b.batch == 1 || b.a_batch_stride == b.m as u64 * b.lda)
        && b.lda == a.n as u64
        && b.k == a.n
        && b.n == a.k
        && b.b_trans
        && b.b_batch_stride == 0
        && b.ldb == b.k as u64
        && b.act.is_none()
        && b.residual.is_none_or(|r| r != b.out)
}

/// Nothing after `after` reads a byte of `buf` before something overwrites
/// that byte, nor does the copy of the graph's outputs after the last thunk.
fn dead_after(thunks: &[Thunk], after: usize, buf: &BufRef, outputs: &[BufRef]) -> bool {
    // The byte ranges of `buf` still holding its value: [start, end).
    let mut live = vec![(buf.offset, buf.offset + buf.bytes)];
    let read =
        |live: &[(u64, u64)], o: &BufRef, need: u64| o.space == buf.space && live.iter().any(|&(a, b)| a < o.offset + need && o.offset < b);
    for t in &thunks[after + 1..] {
        let ops = operands(t);
        if ops.iter().any(|o| !o.write && read(&live, &o.buf, o.need)) {
            return false;
        }
        for o in ops.iter().filter(|o| o.write && o.buf.space == buf.space) {
            let (s, e) = (o.buf.offset, o.buf.offset + o.need);
            live = live.into_iter().flat_map(|(a, b)| [(a, b.min(s)), (a.max(e), b)]).filter(|&(a, b)| a < b).collect();
        }
        if live.is_empty() {
            return true;
        }
    }
    !outputs.iter().any(|o| read(&live, o, o.bytes))
}

/// The triples the fused kernels can run (none when turned off or before
/// sm_90, which the clusters need).
pub(crate) fn find(thunks: &[Thunk], outputs: &[BufRef], cc_major: i32) -> Vec<Fusion> {
    find_with(thunks, outputs, cc_major, mode())
}

fn find_with(thunks: &[Thunk], outputs: &[BufRef], cc_major: i32, mode: FfnFusion) -> Vec<Fusion> {
    if cc_major < 9 || mode == FfnFusion::Off {
        return Vec::new();
    }
    // The feed-forward triple at i, and the kernel that runs it.
    let triple = |i: usize| -> Option<(Kernel, &MatMulThunk, &BufRef)> {
        let (Thunk::MatMul(a), Thunk::MatMul(b), Thunk::Norm { dtype, rows, cols, x, residual, out, .. }) =
            (thunks.get(i)?, thunks.get(i + 1)?, thunks.get(i + 2)?)
        else {
            return None;
        };
        let ok = first(a)
            && second(a, b)
            && *dtype == a.dtype
            && *rows == a.batch * a.m
            && *cols == a.k
            && *x == b.out
            && residual.is_none_or(|r| r != *x)
            // The norm's output over a block's input rows or residuals only
            // as the same bytes (read before the rows' owner writes them).
            && (!out.overlaps(&a.a) || (*out == a.a && a.lda == a.k as u64))
            && same_or_apart(out, b.residual.as_ref())
            && same_or_apart(out, residual.as_ref())
            && dead_after(thunks, i + 1, &a.out, outputs)
            && dead_after(thunks, i + 2, &b.out, outputs);
        ok.then(|| kernel_for(a, mode)).flatten().map(|k| (k, a, out))
    };
    let tails = tail_enabled();
    let mut found = Vec::new();
    let mut i = 0;
    while i + 2 < thunks.len() {
        if let (true, Some((Kernel::Rows, a, out))) = (tails, triple(i + 2)) {
            if tail(thunks, i, a, out, outputs) {
                found.push(Fusion { start: i, kernel: Kernel::RowsTail });
                i += 5;
                continue;
            }
        }
        if let Some((kernel, ..)) = triple(i) {
            found.push(Fusion { start: i, kernel });
            i += 3;
            continue;
        }
        i += 1;
    }
    found
}

/// Bytes of the f32 workspace the fused blocks of `thunks` need (0 when none).
pub(crate) fn workspace_bytes(thunks: &[Thunk], fusions: &[Fusion]) -> u64 {
    fusions
        .iter()
        .map(|f| match (&thunks[f.start], f.kernel) {
            (Thunk::MatMul(m), Kernel::Clusters(v)) => (VARIANTS[v].clusters() * m.batch * m.m * m.k * 4) as u64,
            _ => 0,
        })
        .max()
        .unwrap_or(0)
}

/// The launch steps of one fused triple for a slot (the row split's one
/// kernel, or the cluster kernel and its norm), or None when an operand is
/// not aligned or the row groups do not fit at once (the thunks then lower
/// as usual).
pub(crate) fn build(k: &Kernels, thunks: &[Thunk], f: Fusion, b: &Bases, ws: u64) -> Result<Option<Vec<Step>>> {
    let t0 = f.start + f.thunks() - 3;
    let (Thunk::MatMul(m1), Thunk::MatMul(m2), Thunk::Norm { rms, eps, x: _, residual, gamma, beta, out, .. }) =
        (&thunks[t0], &thunks[t0 + 1], &thunks[t0 + 2])
    else {
        return Ok(None);
    };
    let opt = |r: Option<&BufRef>| r.map(|r| b.ptr(r)).transpose().map(|p| p.unwrap_or(0));
    let (x, w1, w2) = (b.ptr(&m1.a)?, b.ptr(&m1.b)?, b.ptr(&m2.b)?);
    let (b1, b2) = (opt(m1.bias.as_ref())?, opt(m2.bias.as_ref())?);
    let (res1, res2) = (opt(m2.residual.as_ref())?, opt(residual.as_ref())?);
    let (g, bt, o) = (b.ptr(gamma)?, opt(beta.as_ref())?, b.ptr(out)?);
    // Every pointer and row 16 bytes aligned (8 for the norm's 4-wide loads
    // of the residuals, b2, gamma, beta and out).
    let row_bytes = m1.lda * m1.dtype.size() as u64;
    if !(x | w1 | w2 | b1 | ws | row_bytes).is_multiple_of(16) || !(b2 | res1 | res2 | g | bt | o).is_multiple_of(8) {
        return Ok(None);
    }
    let rows = (m1.batch * m1.m) as u64;
    let sfx = suffix(m1.dtype);
    // The kernels could not be compiled or loaded: the thunks run as usual
    // (said once per process, as this is the default path).
    let own = match k.ffn() {
        Ok(o) => o,
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("rlx-cuda: fused feed-forward kernels unavailable, using the unfused ones: {e}"));
            return Ok(None);
        }
    };
    let info = std::env::var("RLX_FFN_INFO").is_ok();
    let v = match f.kernel {
        Kernel::Clusters(_) if ws == 0 => return Ok(None),
        Kernel::Clusters(v) => &VARIANTS[v],
        Kernel::Rows | Kernel::RowsTail => {
            let (h, i) = (m1.k, m1.n);
            // The tail's output projection and norm1, or zeros.
            let mut tail_args = Args::default();
            let mut smem = row_smem(h, i);
            let name = if f.kernel == Kernel::RowsTail {
                let (Thunk::MatMul(mo), Thunk::Norm { rms: rms1, eps: eps1, residual: r1, gamma: g1, beta: be1, out: out1, .. }) =
                    (&thunks[f.start], &thunks[f.start + 1])
                else {
                    return Ok(None);
                };
                let (xa, wo, bo) = (b.ptr(&mo.a)?, b.ptr(&mo.b)?, opt(mo.bias.as_ref())?);
                let (r0a, r0, g1, be1, o1) = (opt(mo.residual.as_ref())?, opt(r1.as_ref())?, b.ptr(g1)?, opt(be1.as_ref())?, b.ptr(out1)?);
                // 16-byte copies of every operand and of each block's 48-byte
                // column slices; 4-byte stores of norm1's output.
                let a_row = mo.lda * mo.dtype.size() as u64;
                if !(xa | wo | bo | r0a | r0 | g1 | be1 | a_row).is_multiple_of(16) || !o1.is_multiple_of(4) {
                    return Ok(None);
                }
                tail_args = tail_args.p(xa).p(wo).p(bo).p(r0a).p(r0).p(g1).p(be1).p(o1).p(mo.lda).i(*rms1 as i64).f(*eps1 as f64);
                smem += tail_smem(h);
                format!("ffn_rows_tail_{h}_{i}_{sfx}")
            } else {
                // Eleven words of null pointers and zeros (0.0 is all zero bits).
                tail_args = Args(vec![0; 11]);
                format!("ffn_rows_{h}_{i}_{sfx}")
            };
            let func = own.get(&name)?;
            func.set_max_dynamic_smem(smem)?;
            // Groups of about GROUP_ROWS rows (RLX_FFN_GROUP_ROWS for A/B), as
            // many as fit at once (one wave), each at most ROW_TILE rows;
            // else (or where 16-block clusters are refused) the thunks lower
            // as usual.
            let aim = std::env::var("RLX_FFN_GROUP_ROWS").ok().and_then(|v| v.trim().parse::<usize>().ok());
            let aim = aim.unwrap_or(GROUP_ROWS).clamp(1, ROW_TILE);
            let want = (rows as usize).div_ceil(aim);
            let fit = match func.allow_non_portable_clusters() {
                Ok(()) => func.max_active_clusters((ROW_CLUSTER * want) as u32, 256, smem, ROW_CLUSTER as u32).unwrap_or(0) as usize,
                Err(_) => 0,
            };
            let groups = want.min(fit);
            let per = if groups == 0 { usize::MAX } else { (rows as usize).div_ceil(groups) };
            if info {
                eprintln!("rlx-cuda ffn rows {h}x{i}: {rows} rows, {fit} clusters of {ROW_CLUSTER} fit, {groups} groups of {per} rows");
            }
            if per > ROW_TILE {
                return Ok(None);
            }
            let args = Args::default()
                .p(x)
                .p(w1)
                .p(b1)
                .p(w2)
                .p(b2)
                .p(res1)
                .p(res2)
                .p(g)
                .p(bt)
                .p(o)
                .i(rows)
                .p(m1.lda)
                .i(per)
                .i(*rms as i64)
                .f(*eps as f64)
                .i(skip_bits())
                .extend(tail_args);
            let grid = [(ROW_CLUSTER * groups) as u32, 1, 1];
            let op = Op::Kernel { func, grid, block: 256, smem, cluster: [ROW_CLUSTER as u32, 1, 1], args: args.0 };
            return Ok(Some(vec![Step::new(op, "ffn")]));
        }
    };
    let func = own.get(&format!("ffn_{}_{}_{sfx}", v.kb(), v.ic))?;
    let smem = v.smem();
    func.set_max_dynamic_smem(smem)?;
    let args = Args::default().p(x).p(w1).p(b1).p(w2).p(ws).i(rows).i(v.h).i(v.i).p(m1.lda).i(skip_bits());
    let grid = [(v.clusters() * CLUSTER) as u32, 1, 1];
    if info {
        let active = func.max_active_clusters(grid[0], 32 * v.warps, smem, CLUSTER as u32)?;
        eprintln!(
            "rlx-cuda ffn {}x{}: {} clusters of {CLUSTER}, {} resident at once, {} blocks/SM",
            v.h,
            v.i,
            v.clusters(),
            active,
            func.max_blocks_per_sm(32 * v.warps, smem)?,
        );
    }
    let fused = Step::new(Op::Kernel { func, grid, block: 32 * v.warps, smem, cluster: [CLUSTER as u32, 1, 1], args: args.0 }, "ffn");
    let args = Args::default().p(ws).p(b2).p(res1).p(res2).p(g).p(bt).p(o).i(rows).i(v.h).i(v.clusters()).i(*rms as i64).f(*eps as f64);
    let func = own.get(&format!("ffn_norm_{sfx}"))?;
    let norm = Step::new(
        Op::Kernel { func, grid: [rows as u32, 1, 1], block: (v.h / 4) as u32, smem: 0, cluster: [1, 1, 1], args: args.0 },
        thunks[f.start + 2].kind(),
    );
    Ok(Some(vec![fused, norm]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_compile::Space;

    fn buf(offset: u64, bytes: usize) -> BufRef {
        BufRef { space: Space::Arena, offset, bytes: bytes as u64 }
    }
    fn w(i: u32, bytes: usize) -> BufRef {
        BufRef { space: Space::Weight(i), offset: 0, bytes: bytes as u64 }
    }
    fn mm(rows: usize, n: usize, k: usize, a: BufRef, b: BufRef, act: Option<Activation>, out: BufRef) -> Thunk {
        Thunk::MatMul(MatMulThunk {
            dtype: DType::F16,
            batch: 1,
            m: rows,
            n,
            k,
            a,
            lda: k as u64,
            a_batch_stride: (rows * k) as u64,
            b,
            b_trans: true,
            ldb: k as u64,
            b_batch_stride: 0,
            bias: Some(w(9, n * 2)),
            act,
            residual: None,
            out,
        })
    }
    /// X at 0, H after it, Y after H, the norm's output after Y.
    fn block(rows: usize, h: usize, i: usize, act: Option<Activation>) -> (Vec<Thunk>, [BufRef; 4]) {
        let x = buf(0, rows * h * 2);
        let hb = buf(x.bytes, rows * i * 2);
        let y = buf(hb.offset + hb.bytes, rows * h * 2);
        let out = buf(y.offset + y.bytes, rows * h * 2);
        let norm = Thunk::Norm {
            rms: false,
            dtype: DType::F16,
            rows,
            cols: h,
            eps: 1e-12,
            x: y,
            residual: Some(x),
            gamma: w(3, h * 2),
            beta: None,
            out,
        };
        (vec![mm(rows, i, h, x, w(1, i * h * 2), act, hb), mm(rows, h, i, hb, w(2, i * h * 2), None, y), norm], [x, hb, y, out])
    }

    #[test]
    fn finds_bert_and_minilm_blocks_and_nothing_else() {
        for (h, i, variant) in [(768, 3072, 0), (384, 1536, 1)] {
            let (t, [.., out]) = block(128, h, i, Some(Activation::Gelu));
            assert_eq!(find_with(&t, &[out], 9, FfnFusion::Clusters), vec![Fusion { start: 0, kernel: Kernel::Clusters(variant) }]);
            // Before sm_90 (no clusters): nothing.
            assert!(find_with(&t, &[out], 8, FfnFusion::All).is_empty());
        }
        // 129 rows, the tanh GELU, a width without a compiled kernel.
        for (rows, h, i, act) in
            [(129, 384, 1536, Activation::Gelu), (64, 384, 1536, Activation::GeluTanh), (64, 256, 1024, Activation::Gelu)]
        {
            let (t, [.., out]) = block(rows, h, i, Some(act));
            assert!(find_with(&t, &[out], 9, FfnFusion::Clusters).is_empty(), "{rows} {h} {i} {act:?}");
        }
    }

    #[test]
    fn modes_pick_the_kernels() {
        let (mini, [.., out]) = block(128, 384, 1536, Some(Activation::Gelu));
        let (bert, [.., bout]) = block(128, 768, 3072, Some(Activation::Gelu));
        let kernels = |t: &[Thunk], o: BufRef, m| find_with(t, &[o], 9, m).iter().map(|f| f.kernel).collect::<Vec<_>>();
        assert_eq!(kernels(&mini, out, FfnFusion::Off), []);
        assert_eq!(kernels(&mini, out, FfnFusion::Rows), [Kernel::Rows]);
        assert_eq!(kernels(&bert, bout, FfnFusion::Rows), []);
        assert_eq!(kernels(&mini, out, FfnFusion::All), [Kernel::Rows]);
        assert_eq!(kernels(&bert, bout, FfnFusion::All), [Kernel::Clusters(0)]);
        assert_eq!(kernels(&mini, out, FfnFusion::Clusters), [Kernel::Clusters(1)]);
    }

    #[test]
    fn intermediates_read_later_or_returned_are_not_fused() {
        let (mut t, [x, hb, y, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        // FFN1's output is a graph output, or FFN2's is read after the norm.
        assert!(find_with(&t, &[out, hb], 9, FfnFusion::All).is_empty());
        let later = Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: y, out: x };
        t.push(later.clone());
        assert!(find_with(&t, &[out], 9, FfnFusion::Clusters).is_empty());
        // Overwritten first, then read: dead, so fused.
        let (mut t, [x, _, y, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: out, out: y });
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: y, out: x });
        assert_eq!(find_with(&t, &[x], 9, FfnFusion::All).len(), 1);
        // A later tensor over part of FFN1's output, written then read (as
        // the arena planner reuses memory): still dead. Reading the part not
        // overwritten is not.
        let (mut t, [x, hb, _, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        let part = buf(hb.offset + 4096, 32 * 384 * 2);
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: out, out: part });
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: part, out: x });
        assert_eq!(find_with(&t, &[x], 9, FfnFusion::All).len(), 1);
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 1024, x: buf(hb.offset, 2048), out: x });
        assert!(find_with(&t, &[x], 9, FfnFusion::All).is_empty());
    }

    #[test]
    fn every_block_of_the_real_minilm_schedule_is_found() {
        // `rlx inspect --model models/all-MiniLM-L6-v2 --precision f16 --json`
        // (1×128): the arena planner reuses FFN1's output for later tensors.
        let s: rlx_compile::Schedule =
            serde_json::from_str(include_str!("../tests/data/minilm-f16-1x128.schedule.json")).expect("schedule");
        let outputs: Vec<BufRef> = s.outputs.iter().map(|o| o.buf).collect();
        // The row split takes each layer's output projection and its norm
        // too (the norm writes over the projection's input here); the
        // cluster kernel only the feed-forward block.
        let found = find_with(&s.thunks, &outputs, 9, FfnFusion::All);
        assert_eq!(found.iter().map(|f| f.start).collect::<Vec<_>>(), [3, 10, 17, 24, 31, 38]);
        assert!(found.iter().all(|f| f.kernel == Kernel::RowsTail && f.thunks() == 5));
        let clusters = find_with(&s.thunks, &outputs, 9, FfnFusion::Clusters);
        assert_eq!(clusters.iter().map(|f| f.start).collect::<Vec<_>>(), [5, 12, 19, 26, 33, 40]);
        assert!(clusters.iter().all(|f| f.kernel == Kernel::Clusters(1)));
    }

    /// The output projection and its norm before `block`'s triple: A (the
    /// attention's output) and the residual X0 after the block's buffers.
    fn tail_block(rows: usize) -> (Vec<Thunk>, [BufRef; 4]) {
        let (h, i) = (384, 1536);
        let (t, [x1, _, _, out]) = block(rows, h, i, Some(Activation::Gelu));
        let a = buf(out.offset + out.bytes, rows * h * 2);
        let yo = buf(a.offset + a.bytes, rows * h * 2);
        let x0 = buf(yo.offset + yo.bytes, rows * h * 2);
        let Thunk::MatMul(mut o) = t[1].clone() else { unreachable!() };
        (o.m, o.n, o.k, o.a, o.lda, o.b, o.ldb, o.out) = (rows, h, h, a, h as u64, w(5, h * h * 2), h as u64, yo);
        o.a_batch_stride = (rows * h) as u64;
        let norm1 = Thunk::Norm {
            rms: false,
            dtype: DType::F16,
            rows,
            cols: h,
            eps: 1e-12,
            x: yo,
            residual: Some(x0),
            gamma: w(6, h * 2),
            beta: None,
            out: x1,
        };
        let mut all = vec![Thunk::MatMul(o), norm1];
        all.extend(t);
        (all, [a, yo, x0, out])
    }

    #[test]
    fn the_row_split_takes_the_output_projection_and_its_norm() {
        let (t, [a, yo, x0, out]) = tail_block(64);
        assert_eq!(find_with(&t, &[out], 9, FfnFusion::Rows), [Fusion { start: 0, kernel: Kernel::RowsTail }]);
        // The projection's output read later: only the triple.
        assert_eq!(find_with(&t, &[out, yo], 9, FfnFusion::Rows), [Fusion { start: 2, kernel: Kernel::Rows }]);
        // Norm1 in place over the projection's input or its residual: still the tail.
        for over in [a, x0] {
            let mut t2 = t.clone();
            if let Thunk::Norm { out, .. } = &mut t2[1] {
                *out = over;
            }
            if let Thunk::MatMul(m) = &mut t2[2] {
                m.a = over;
            }
            if let Thunk::Norm { residual, .. } = &mut t2[4] {
                *residual = Some(over);
            }
            assert_eq!(find_with(&t2, &[out], 9, FfnFusion::Rows)[0].kernel, Kernel::RowsTail, "{over:?}");
        }
        // Norm1's output over part of the projection's input: not the tail.
        let shifted = buf(a.offset + 768, a.bytes as usize);
        let mut t3 = t.clone();
        if let Thunk::Norm { out, .. } = &mut t3[1] {
            *out = shifted;
        }
        if let Thunk::MatMul(m) = &mut t3[2] {
            m.a = shifted;
        }
        if let Thunk::Norm { residual, .. } = &mut t3[4] {
            *residual = Some(shifted);
        }
        assert!(find_with(&t3, &[out], 9, FfnFusion::Rows).iter().all(|f| f.kernel != Kernel::RowsTail));
        // The cluster kernel has no tail.
        assert_eq!(find_with(&t, &[out], 9, FfnFusion::Clusters), [Fusion { start: 2, kernel: Kernel::Clusters(1) }]);
        // The block's second norm reading a residual that norm1's output
        // partly overwrites: neither the tail nor the triple.
        let mut t4 = t.clone();
        if let Thunk::Norm { residual, .. } = &mut t4[4] {
            *residual = Some(buf(x0.offset, x0.bytes as usize));
        }
        if let Thunk::Norm { out, .. } = &mut t4[1] {
            *out = buf(x0.offset + 768, x0.bytes as usize);
        }
        if let Thunk::MatMul(m) = &mut t4[2] {
            m.a = buf(x0.offset + 768, x0.bytes as usize);
        }
        assert!(find_with(&t4, &[out], 9, FfnFusion::Rows).iter().all(|f| f.kernel != Kernel::RowsTail));
    }

    #[test]
    fn a_norm_output_partly_over_its_block_input_or_residual_is_not_fused() {
        let (t, [x, _, _, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        // In place over the input (same bytes): fused.
        let mut same = t.clone();
        if let Thunk::Norm { out: o, .. } = &mut same[2] {
            *o = x;
        }
        assert_eq!(find_with(&same, &[x], 9, FfnFusion::Rows).len(), 1);
        // Shifted by one row: not fused.
        let mut shifted = t.clone();
        if let Thunk::Norm { out: o, .. } = &mut shifted[2] {
            *o = buf(x.offset + 768, x.bytes as usize);
        }
        assert!(find_with(&shifted, &[out], 9, FfnFusion::Rows).is_empty());
    }

    #[test]
    fn shared_memory_matches_the_kernel_layout() {
        // kernels/ffn.cu: X and W1 (reused by the intermediate), W2, the f32 partial, b1.
        assert_eq!(VARIANTS[0].smem(), (128 + 192) * 104 * 2 + 96 * 200 * 2 + 128 * 200 * 4 + 192 * 2);
        assert_eq!(VARIANTS[1].smem(), 128 * 104 * 2 + 48 * 104 * 2 + 128 * 104 * 4 + 96 * 2);
        assert!(VARIANTS.iter().all(|v| v.smem() <= 227 * 1024 && v.i % v.ic == 0 && v.h % (8 * 16) == 0));
        // The row split: X and W1 (the f32 partial reuses them), W2, H, b1,
        // statistics, per-thread sums, FFN1's second K half.
        assert_eq!(
            row_smem(384, 1536),
            (32 + 96) * 392 * 2 + 384 * 104 * 2 + 32 * 104 * 2 + 96 * 2 + 2 * 32 * 4 + 32 * 8 * 4 + 4 * 16 * 52 * 4
        );
        assert!(row_smem(384, 1536) <= 227 * 1024);
    }
}
