//! The fused feed-forward block (kernels/ffn.cu) for at most 128 rows:
//! FFN1 (+bias, erf-GELU), FFN2 (+bias) and the norm after them as two
//! kernels instead of cuBLASLt, the GELU epilogue, cuBLASLt and the norm.
//!
//! `find` picks the triples it can run: MatMul → MatMul → Norm where the
//! first matmul's output feeds only the second, the second's only the norm
//! (neither is read again before it is overwritten, nor is an output), the
//! weights are stored `[out, in]` and (H, I) has a compiled variant.
//! `build` lowers one triple for a slot. The f32 shares of FFN2 go to a
//! workspace that every fused block of an executable shares (they run one
//! after another on its stream).
//!
//! Off by default: on the H200 it measured slower than cuBLASLt's kernels
//! (bench/gpu-perf.md, session 11: MiniLM 1×128 198 against 151 µs,
//! bert-base 1×128 625–637 against 373). Its data movement is the cost: the
//! 8-way split-K sum of FFN1 and the exchange of the intermediate through
//! DSMEM (~150 KB per block at bert-base), and the f32 shares of FFN2
//! through L2 (6.3 MB); bert-base's 16 clusters of 8 one-block SMs also
//! need two waves (15 fit at once). RLX_FFN=1 or `set_ffn_fusion(true)`
//! turns it on (sm_90+; the kernels load with the own matmul's modules).
//! Diagnostics: RLX_FFN_INFO=1 prints the resident clusters at prepare;
//! RLX_FFN_SKIP=bits leaves parts of the kernel out (wrong results, timing
//! only; see `skip_bits`).

use rlx_compile::operands::operands;
use rlx_compile::{BufRef, MatMulThunk, Thunk};
use rlx_ir::{Activation, DType};
use rlx_runtime::Result;

use crate::launch::{suffix, Args, Bases, Kernels, Op, Step};

/// Rows one fused block handles (one 128-row tile per cluster).
pub(crate) const MAX_ROWS: usize = 128;
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

static ENABLED: std::sync::Mutex<Option<bool>> = std::sync::Mutex::new(None);

/// Turns the fused feed-forward block on or off for later prepares
/// (overrides `RLX_FFN`).
pub fn set_ffn_fusion(on: bool) {
    if let Ok(mut g) = ENABLED.lock() {
        *g = Some(on);
    }
}

fn enabled() -> bool {
    if let Some(on) = ENABLED.lock().ok().and_then(|g| *g) {
        return on;
    }
    matches!(std::env::var("RLX_FFN").ok().as_deref().map(str::trim), Some("1" | "on" | "true" | "yes"))
}

/// RLX_FFN_SKIP=bits (timing diagnostic, wrong results): parts of the
/// fused kernel left out: 1 the cluster reduction, 2 FFN1's multiply, 4
/// FFN2, 8 the weight loads, 16 the cluster barriers.
fn skip_bits() -> i64 {
    std::env::var("RLX_FFN_SKIP").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// A triple `find` accepted: thunks start, start + 1, start + 2.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fusion {
    pub start: usize,
    variant: usize,
}

fn variant_for(m: &MatMulThunk) -> Option<usize> {
    VARIANTS.iter().position(|v| v.h == m.k && v.i == m.n)
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
    if cc_major < 9 || !enabled() {
        return Vec::new();
    }
    let mut found = Vec::new();
    let mut i = 0;
    while i + 2 < thunks.len() {
        if let (Thunk::MatMul(a), Thunk::MatMul(b), Thunk::Norm { dtype, rows, cols, x, residual, .. }) =
            (&thunks[i], &thunks[i + 1], &thunks[i + 2])
        {
            let ok = first(a)
                && second(a, b)
                && *dtype == a.dtype
                && *rows == a.batch * a.m
                && *cols == a.k
                && *x == b.out
                && residual.is_none_or(|r| r != *x)
                && dead_after(thunks, i + 1, &a.out, outputs)
                && dead_after(thunks, i + 2, &b.out, outputs);
            if let (true, Some(variant)) = (ok, variant_for(a)) {
                found.push(Fusion { start: i, variant });
                i += 3;
                continue;
            }
        }
        i += 1;
    }
    found
}

/// Bytes of the f32 workspace the fused blocks of `thunks` need (0 when none).
pub(crate) fn workspace_bytes(thunks: &[Thunk], fusions: &[Fusion]) -> u64 {
    fusions
        .iter()
        .map(|f| match &thunks[f.start] {
            Thunk::MatMul(m) => (VARIANTS[f.variant].clusters() * m.batch * m.m * m.k * 4) as u64,
            _ => 0,
        })
        .max()
        .unwrap_or(0)
}

/// The two launch steps of one fused triple for a slot, or None when an
/// operand is not 16-byte aligned (the thunks then lower as usual).
pub(crate) fn build(k: &Kernels, thunks: &[Thunk], f: Fusion, b: &Bases, ws: u64) -> Result<Option<Vec<Step>>> {
    let (Thunk::MatMul(m1), Thunk::MatMul(m2), Thunk::Norm { rms, eps, x: _, residual, gamma, beta, out, .. }) =
        (&thunks[f.start], &thunks[f.start + 1], &thunks[f.start + 2])
    else {
        return Ok(None);
    };
    let v = &VARIANTS[f.variant];
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
    let own = k.own_gemm()?;
    let func = own.get(&format!("ffn_{}_{}_{sfx}", v.kb(), v.ic))?;
    let smem = v.smem();
    func.set_max_dynamic_smem(smem)?;
    let args = Args::default().p(x).p(w1).p(b1).p(w2).p(ws).i(rows).i(v.h).i(v.i).p(m1.lda).i(skip_bits());
    let grid = [(v.clusters() * CLUSTER) as u32, 1, 1];
    if std::env::var("RLX_FFN_INFO").is_ok() {
        let active = func.max_active_clusters(grid[0], 32 * v.warps, smem, CLUSTER as u32)?;
        // For designs with larger clusters: how many of 16 blocks would fit.
        let sixteen = func.allow_non_portable_clusters().and_then(|_| func.max_active_clusters(256, 32 * v.warps, smem, 16));
        eprintln!(
            "rlx-cuda ffn {}x{}: {} clusters of {CLUSTER}, {} resident at once, {} blocks/SM; clusters of 16 resident: {}",
            v.h,
            v.i,
            v.clusters(),
            active,
            func.max_blocks_per_sm(32 * v.warps, smem)?,
            sixteen.map(|n| n.to_string()).unwrap_or_else(|e| e.to_string())
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
        set_ffn_fusion(true);
        for (h, i, variant) in [(768, 3072, 0), (384, 1536, 1)] {
            let (t, [.., out]) = block(128, h, i, Some(Activation::Gelu));
            assert_eq!(find(&t, &[out], 9), vec![Fusion { start: 0, variant }]);
            // Before sm_90 (no clusters): nothing.
            assert!(find(&t, &[out], 8).is_empty());
        }
        // 129 rows, the tanh GELU, a width without a compiled kernel.
        for (rows, h, i, act) in
            [(129, 384, 1536, Activation::Gelu), (64, 384, 1536, Activation::GeluTanh), (64, 256, 1024, Activation::Gelu)]
        {
            let (t, [.., out]) = block(rows, h, i, Some(act));
            assert!(find(&t, &[out], 9).is_empty(), "{rows} {h} {i} {act:?}");
        }
    }

    #[test]
    fn intermediates_read_later_or_returned_are_not_fused() {
        set_ffn_fusion(true);
        let (mut t, [x, hb, y, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        // FFN1's output is a graph output, or FFN2's is read after the norm.
        assert!(find(&t, &[out, hb], 9).is_empty());
        let later = Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: y, out: x };
        t.push(later.clone());
        assert!(find(&t, &[out], 9).is_empty());
        // Overwritten first, then read: dead, so fused.
        let (mut t, [x, _, y, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: out, out: y });
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: y, out: x });
        assert_eq!(find(&t, &[x], 9).len(), 1);
        // A later tensor over part of FFN1's output, written then read (as
        // the arena planner reuses memory): still dead. Reading the part not
        // overwritten is not.
        let (mut t, [x, hb, _, out]) = block(32, 384, 1536, Some(Activation::Gelu));
        let part = buf(hb.offset + 4096, 32 * 384 * 2);
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: out, out: part });
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 32 * 384, x: part, out: x });
        assert_eq!(find(&t, &[x], 9).len(), 1);
        t.push(Thunk::Activation { act: Activation::Relu, dtype: DType::F16, n: 1024, x: buf(hb.offset, 2048), out: x });
        assert!(find(&t, &[x], 9).is_empty());
    }

    #[test]
    fn every_block_of_the_real_minilm_schedule_is_found() {
        // `rlx inspect --model models/all-MiniLM-L6-v2 --precision f16 --json`
        // (1×128): the arena planner reuses FFN1's output for later tensors.
        let s: rlx_compile::Schedule =
            serde_json::from_str(include_str!("../tests/data/minilm-f16-1x128.schedule.json")).expect("schedule");
        set_ffn_fusion(true);
        let outputs: Vec<BufRef> = s.outputs.iter().map(|o| o.buf).collect();
        let found = find(&s.thunks, &outputs, 9);
        assert_eq!(found.iter().map(|f| f.start).collect::<Vec<_>>(), [5, 12, 19, 26, 33, 40]);
    }

    #[test]
    fn shared_memory_matches_the_kernel_layout() {
        // kernels/ffn.cu: X and W1 (reused by the intermediate), W2, the f32 partial, b1.
        assert_eq!(VARIANTS[0].smem(), (128 + 192) * 104 * 2 + 96 * 200 * 2 + 128 * 200 * 4 + 192 * 2);
        assert_eq!(VARIANTS[1].smem(), 128 * 104 * 2 + 48 * 104 * 2 + 128 * 104 * 4 + 96 * 2);
        assert!(VARIANTS.iter().all(|v| v.smem() <= 227 * 1024 && v.i % v.ic == 0 && v.h % (8 * 16) == 0));
    }
}
