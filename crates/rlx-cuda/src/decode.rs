//! Launches of the generation step's kernels: matmuls and embedding
//! gathers over block-quantized weights read as stored (kernels/decode.cu,
//! kernels/qmma.cu; over many rows kernels/qlib.cu and cuBLASLt), next-token
//! sampling (kernels/sample.cu), and integer
//! binary ops (positions). The files are compiled and loaded the first time
//! a schedule needs them (`Kernels::decode`). Every launch reads its
//! changing values (ids, positions, sampling settings) from device memory,
//! so a recorded decode step serves every position.

use rlx_ir::{BinaryOp, DType, QFormat};
use rlx_runtime::Result;
use rlx_schedule::Thunk;

use std::sync::Arc;

use crate::blas::{Blas, MatMulCall, MatMulPlan};
use crate::driver::err;
use crate::launch::{collapse, suffix, Bases, Op, Step};
use crate::modules::Kernels;
use crate::params::{self, arr, i};

/// Threads per block of the quantized matvec: one warp per output column.
const QMM_THREADS: u32 = 256;
/// Columns from which a one-row matvec without a gate takes four columns
/// a warp (`qmatvec_s4_*`, or `qmatvec_w4_*` for weights not 16-byte
/// aligned): the output head's tens of thousands.
const WIDE_MIN: usize = 8192;
/// Threads per block of the tensor-core quantized matmul (`QMMA_WARPS` in
/// kernels/qmma.cu): its warps split k.
const QMMA_THREADS: u32 = 256;
/// Threads of the sampling kernel (`SAMPLE_THREADS` in kernels/decode.cu).
const SAMPLE_THREADS: u32 = 512;
/// Candidates the sampling kernel holds in shared memory after top-k
/// (`SAMPLE_CAP` in kernels/decode.cu): a (logit, id) pair each.
const SAMPLE_CAP: usize = 2048;
/// The sampling kernel's static shared memory, rounded up (its reduction
/// scratch; ptxas reports 4480 bytes).
const SAMPLE_STATIC_SMEM: usize = 8192;
/// Shared memory a block may have on the devices we run on (sm_80+: 163 KB
/// and more; sm_90: 227 KB). A vocabulary whose penalty bitmap does not fit
/// beside the candidates is refused at prepare.
const SMEM_LIMIT: usize = 160 * 1024;

/// The format's code in kernels/quant.cuh (`QF_*`).
pub(crate) fn qformat_code(f: QFormat) -> i64 {
    match f {
        QFormat::Q4_0 => 0,
        QFormat::Q4_1 => 1,
        QFormat::Q5_0 => 2,
        QFormat::Q5_1 => 3,
        QFormat::Q8_0 => 4,
        QFormat::Q4K => 5,
        QFormat::Q6K => 6,
    }
}

/// Words of the sampling kernel's penalty bitmap (one bit per id).
fn bitmap_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// The sampling kernel's dynamic shared memory: the bitmap, then the
/// candidates.
fn sample_smem(vocab: usize) -> usize {
    4 * bitmap_words(vocab) + 8 * SAMPLE_CAP
}

/// Why this module cannot run a thunk it would otherwise take, or None.
pub(crate) fn unsupported(t: &Thunk) -> Option<String> {
    let fits31 = |v: usize| v < (1 << 31);
    match t {
        Thunk::QMatMul { format, dtype, k, .. } if format.row_bytes(*k).is_none() || !dtype.is_float() => Some(format!(
            "qmatmul of {format} rows of {k} {dtype} elements (whole {}-element blocks of a float type)",
            format.block_elems()
        )),
        Thunk::QMatMul { lda, k, .. } if *lda < *k as u64 => Some(format!("qmatmul row stride {lda} below the row length {k}")),
        Thunk::QGather { format, dim, .. } if format.row_bytes(*dim).is_none() => {
            Some(format!("qgather of {format} rows of {dim} elements (whole {}-element blocks)", format.block_elems()))
        }
        Thunk::QGather { id_dtype, .. } if !matches!(id_dtype, DType::I32 | DType::I64) => Some(format!("qgather with {id_dtype} ids")),
        Thunk::Sample { vocab, .. } if *vocab == 0 || !fits31(*vocab) => Some(format!("sample over a vocabulary of {vocab}")),
        Thunk::Sample { vocab, .. } if sample_smem(*vocab) + SAMPLE_STATIC_SMEM > SMEM_LIMIT => {
            Some(format!("sample over a vocabulary of {vocab} (its penalty bitmap needs more shared memory than a block has)"))
        }
        Thunk::Sample { batch, .. } if !fits31(*batch) => Some(format!("sample over a batch of {batch}")),
        _ => None,
    }
}

/// A grid-stride launch over `n` items, 256 threads per block.
fn flat<T: params::KernelParams>(k: &Kernels, name: &str, n: u64, p: &T, kind: &'static str) -> Result<Step> {
    let blocks = n.div_ceil(256).clamp(1, k.sm_count as u64 * 32) as u32;
    Ok(Step::new(Op::kernel(k.decode()?.get(name)?, [blocks, 1, 1], 256, 0, [1, 1, 1], p)?, kind))
}

/// Rows from which a quantized matmul with scratch runs as a library
/// matmul (`library_steps`); the compiler plans the scratch from here
/// (`Backend::qmatmul_scratch_rows`). Measured on an H100 on SmolLM2-135M's
/// four projections (bench/prefill-matmul.cu, Q4_1, f32 rows): at 128 rows
/// the library form took 1.23× qmma's time over the four, at 256 0.85×,
/// at 512 0.50×, at 4,096 0.16×.
pub(crate) const LIB_MIN_ROWS: usize = 256;

/// The 16-bit type a library quantized matmul rounds its operands to (the
/// tensor-core input type of kernels/qmma.cu).
fn half_of(dtype: DType) -> DType {
    if dtype == DType::BF16 {
        DType::BF16
    } else {
        DType::F16
    }
}

/// Whether a QMatMul thunk runs as a library matmul over its scratch.
pub(crate) fn runs_library(t: &Thunk) -> bool {
    matches!(t, Thunk::QMatMul { rows, scratch: Some(_), .. } if *rows >= LIB_MIN_ROWS)
}

/// The cuBLASLt plan of a QMatMul that runs as a library matmul, else None.
pub(crate) fn library_plan(t: &Thunk, blas: &Blas) -> Result<Option<MatMulPlan>> {
    let Thunk::QMatMul { dtype, rows, n, k, out, glu, residual, scratch: Some(x), .. } = t else { return Ok(None) };
    if !runs_library(t) {
        return Ok(None);
    }
    let [pa, pw, _] = parts(*rows, *n, *k, *glu)?;
    let (a_off, w_off) = (x.offset, x.offset + pa);
    let plan = if *glu {
        // The gate's and up's products, f32, into the scratch's last part.
        MatMulPlan::decoded(blas, *rows, 2 * n, *k, half_of(*dtype), DType::F32, (a_off, w_off, w_off + pw), None)?
    } else {
        MatMulPlan::decoded(blas, *rows, *n, *k, half_of(*dtype), *dtype, (a_off, w_off, out.offset), residual.map(|r| r.offset))?
    };
    Ok(Some(plan))
}

/// The scratch's parts (rlx_schedule::qmatmul_scratch_parts).
fn parts(rows: usize, n: usize, k: usize, glu: bool) -> Result<[u64; 3]> {
    rlx_schedule::qmatmul_scratch_parts(rows, n, k, glu).ok_or_else(|| err(format!("qmatmul scratch for {rows}x{n}x{k} overflows")))
}

/// A QMatMul as a library matmul: its rows in 16 bits (normed), its
/// weights decoded to 16 bits, cuBLASLt, and with a gate SwiGLU
/// (kernels/qlib.cu).
fn library_steps(t: &Thunk, b: &Bases, k: &Kernels, blas: &Arc<Blas>, plan: &Arc<MatMulPlan>) -> Result<Vec<Step>> {
    let Thunk::QMatMul { format, dtype, rows, n, k: kk, a, lda, w, out, norm, glu, residual, scratch: Some(x) } = t else {
        return Err(err("qmatmul without scratch cannot run as a library matmul"));
    };
    let kind = t.kind();
    let [pa, pw, _] = parts(*rows, *n, *kk, *glu)?;
    let base = b.ptr(x)?;
    let (ap, wp, gp) = (base, base + pa, base + pa + pw);
    let row_bytes = format.row_bytes(*kk).ok_or_else(|| err(format!("qmatmul: {kk} is not a whole number of {format} blocks")))?;
    let wrows = if *glu { 2 * n } else { *n };
    let half = suffix(half_of(*dtype));
    let prep = params::QPrepP {
        a: b.ptr(a)?,
        gamma: match norm {
            Some(nm) => b.ptr(&nm.gamma)?,
            None => 0,
        },
        out: ap,
        rows: i(*rows),
        k: i(*kk),
        lda: *lda as i64,
        eps: norm.map_or(0.0, |nm| nm.eps as f64),
    };
    // One warp a row, 8 a block.
    let blocks = rows.div_ceil(8).clamp(1, k.sm_count as usize * 16) as u32;
    let mut steps = vec![Step::new(
        Op::kernel(k.decode()?.get(&format!("qprep_{}", suffix(*dtype)))?, [blocks, 1, 1], 256, 0, [1, 1, 1], &prep)?,
        kind,
    )];
    let wptr = b.ptr(w)?;
    if !wptr.is_multiple_of(2) {
        return Err(err(format!("qmatmul: the {format} weight starts at an odd address")));
    }
    let deq = params::QDequantP { w: wptr, out: wp, n: i(wrows), k: i(*kk), row_bytes: i(row_bytes) };
    steps.push(flat(k, &format!("qdequant_{}_{half}", format.name()), (wrows * kk / 8) as u64, &deq, kind)?);
    let (c, d) = match (glu, residual) {
        (true, _) => (gp, gp),
        (false, Some(r)) => (b.ptr(r)?, b.ptr(out)?),
        (false, None) => (b.ptr(out)?, b.ptr(out)?),
    };
    steps.push(Step::new(
        Op::MatMul(MatMulCall { algo: plan.algo.algo, plan: plan.clone(), blas: blas.clone(), a: ap, b: wp, c, d, bias: 0 }),
        kind,
    ));
    if *glu {
        let p = params::QGluP {
            g: gp,
            out: b.ptr(out)?,
            res: match residual {
                Some(r) => b.ptr(r)?,
                None => 0,
            },
            rows: i(*rows),
            n: i(*n),
        };
        steps.push(flat(k, &format!("qglu_{}", suffix(*dtype)), (rows * n) as u64, &p, kind)?);
    }
    Ok(steps)
}

/// The steps of a QMatMul, QGather, Sample, or integer Binary thunk;
/// `plan`: a library quantized matmul's (`library_plan`).
pub(crate) fn lower(t: &Thunk, b: &Bases, k: &Kernels, blas: &Arc<Blas>, plan: Option<&Arc<MatMulPlan>>) -> Result<Vec<Step>> {
    if let (true, Some(plan)) = (runs_library(t), plan) {
        return library_steps(t, b, k, blas, plan);
    }
    let kind = t.kind();
    let step = match t {
        Thunk::QMatMul { format, dtype, rows, n, k: kk, a, lda, w, out, norm, glu, residual, .. } => {
            let row_bytes = format.row_bytes(*kk).ok_or_else(|| err(format!("qmatmul: {kk} is not a whole number of {format} blocks")))?;
            let wp = b.ptr(w)?;
            // The kernel reads blocks with 16-bit loads.
            if !wp.is_multiple_of(2) {
                return Err(err(format!("qmatmul: the {format} weight starts at an odd address")));
            }
            let p = params::QMatMulP {
                a: b.ptr(a)?,
                w: wp,
                out: b.ptr(out)?,
                gamma: match norm {
                    Some(nm) => b.ptr(&nm.gamma)?,
                    None => 0,
                },
                res: match residual {
                    Some(r) => b.ptr(r)?,
                    None => 0,
                },
                rows: i(*rows),
                n: i(*n),
                k: i(*kk),
                lda: *lda as i64,
                row_bytes: i(row_bytes),
                glu: *glu as i64,
                eps: norm.map_or(0.0, |nm| nm.eps as f64),
            };
            // One row of a 32-element format: the kernel that loads its
            // weights before waiting on the previous kernel, sized to hold
            // a whole row per warp (8 elements a chunk, 32 lanes). Only for
            // weights and constants, which no kernel writes, and for an
            // activation row and norm weights it can read 4 elements at a
            // time (aligned to 4 elements).
            let chunks_per_lane = kk.div_ceil(8 * 32);
            let fixed = matches!(w.space, rlx_schedule::Space::Weight(_) | rlx_schedule::Space::Const(_));
            let aligned = [p.a, p.gamma].iter().all(|ptr| ptr.is_multiple_of(4 * dtype.size() as u64));
            let matvec = [2, 4, 8]
                .into_iter()
                .find(|&mc| chunks_per_lane <= mc)
                .filter(|_| *rows == 1 && fixed && aligned && format.block_elems() == 32);
            let mut smem = 0u32;
            let (name, grid, threads) = if *rows >= 2 {
                // Two and more rows on tensor cores (kernels/qmma.cu; from
                // LIB_MIN_ROWS with scratch, the library form above): 16
                // columns a block, 8 rows a tile up to 32 rows (a decode
                // batch: more blocks beat decoding each weight once per 32
                // rows), else 32.
                let tile = if *rows <= 32 { 8 } else { 32 };
                let grid = [n.div_ceil(16).max(1) as u32, rows.div_ceil(tile).clamp(1, 65535) as u32, 1];
                (format!("qmma_{}_r{tile}_{}", format.name(), suffix(*dtype)), grid, QMMA_THREADS)
            } else {
                // Many columns without a gate (the output head): four
                // columns a warp, so each lane has four times the weight
                // loads in flight.
                let cols_per_warp = match matvec {
                    Some(mc) if mc <= 4 && !*glu && *n >= WIDE_MIN => 4,
                    _ => 1,
                };
                let cols_per_block = (QMM_THREADS / 32) as u64 * cols_per_warp;
                // Four columns a warp with the weights 16-byte aligned: the
                // block's rows (contiguous) are first copied to shared
                // memory in 16-byte pieces (kernels/decode.cu
                // `qmatvec_staged_body`).
                let staged = cols_per_warp == 4 && wp.is_multiple_of(16);
                if staged {
                    smem = (cols_per_block * row_bytes as u64) as u32;
                }
                let name = match matvec {
                    Some(mc) if staged => format!("qmatvec_s4_{}_c{mc}_{}", format.name(), suffix(*dtype)),
                    Some(mc) if cols_per_warp == 4 => format!("qmatvec_w4_{}_c{mc}_{}", format.name(), suffix(*dtype)),
                    Some(mc) => format!("qmatvec_{}_c{mc}_{}", format.name(), suffix(*dtype)),
                    None => format!("qmatmul_{}_r1_{}", format.name(), suffix(*dtype)),
                };
                (name, [(*n as u64).div_ceil(cols_per_block).max(1) as u32, 1, 1], QMM_THREADS)
            };
            Step::new(Op::kernel(k.decode()?.get(&name)?, grid, threads, smem, [1, 1, 1], &p)?, kind)
        }
        Thunk::QGather { format, id_dtype, n, dim, vocab, table, ids, out } => {
            let row_bytes =
                format.row_bytes(*dim).ok_or_else(|| err(format!("qgather: {dim} is not a whole number of {format} blocks")))?;
            let tp = b.ptr(table)?;
            if !tp.is_multiple_of(2) {
                return Err(err(format!("qgather: the {format} table starts at an odd address")));
            }
            let p = params::QGatherP {
                table: tp,
                ids: b.ptr(ids)?,
                out: b.ptr(out)?,
                err: b.err,
                n: i(*n),
                dim: i(*dim),
                vocab: i(*vocab),
                id64: (*id_dtype == DType::I64) as i64,
                row_bytes: i(row_bytes),
                fmt: qformat_code(*format),
            };
            flat(k, "qgather", (n * dim) as u64, &p, kind)?
        }
        Thunk::Sample { batch, vocab, history_len, logits, fparams, iparams, history, position, out } => {
            let p = params::SampleP {
                logits: b.ptr(logits)?,
                fparams: b.ptr(fparams)?,
                iparams: b.ptr(iparams)?,
                history: b.ptr(history)?,
                pos: b.ptr(position)?,
                out: b.ptr(out)?,
                err: b.err,
                batch: i(*batch),
                vocab: i(*vocab),
                hist_len: i(*history_len),
                bitmap_words: i(bitmap_words(*vocab)),
            };
            let func = k.decode()?.get("sample")?;
            let smem = sample_smem(*vocab);
            if smem > 48 * 1024 {
                func.set_max_dynamic_smem(smem as u32)?;
            }
            Step::new(Op::kernel(func, [(*batch).max(1) as u32, 1, 1], SAMPLE_THREADS, smem as u32, [1, 1, 1], &p)?, kind)
        }
        Thunk::Binary { op, dtype, out_shape, a, a_strides, b: bb, b_strides, out } if matches!(dtype, DType::I32 | DType::I64) => {
            let n: usize = out_shape.iter().product();
            let (shape, st) = collapse(out_shape, &[a_strides, b_strides]);
            let p = params::IntBinaryP {
                a: b.ptr(a)?,
                b: b.ptr(bb)?,
                out: b.ptr(out)?,
                err: b.err,
                n: i(n),
                rank: i(shape.len()),
                op: match op {
                    BinaryOp::Add => 0,
                    BinaryOp::Sub => 1,
                    BinaryOp::Mul => 2,
                    BinaryOp::Div => 3,
                },
                wide: (*dtype == DType::I64) as i64,
                shape: arr(shape.iter().map(|&d| d as u64)),
                sa: arr(st[0].iter().copied()),
                sb: arr(st[1].iter().copied()),
            };
            flat(k, "binary_int", n as u64, &p, kind)?
        }
        _ => return Err(err(format!("{kind} is not a kernel of kernels/decode.cu"))),
    };
    Ok(vec![step])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernel_files() {
        let src = include_str!("../kernels/quant.cuh");
        for (f, name) in [
            (QFormat::Q4_0, "QF_Q4_0"),
            (QFormat::Q4_1, "QF_Q4_1"),
            (QFormat::Q5_0, "QF_Q5_0"),
            (QFormat::Q5_1, "QF_Q5_1"),
            (QFormat::Q8_0, "QF_Q8_0"),
            (QFormat::Q4K, "QF_Q4K"),
            (QFormat::Q6K, "QF_Q6K"),
        ] {
            assert!(src.contains(&format!("#define {name} {}\n", qformat_code(f))), "{name}");
        }
        let sample = include_str!("../kernels/sample.cu");
        for (name, v) in [("SAMPLE_THREADS", SAMPLE_THREADS as usize), ("SAMPLE_CAP", SAMPLE_CAP)] {
            assert!(sample.contains(&format!("#define {name} {v}\n")), "{name}");
        }
        let qmma = include_str!("../kernels/qmma.cu");
        assert!(qmma.contains(&format!("#define QMMA_WARPS {}\n", QMMA_THREADS / 32)), "QMMA_WARPS");
    }

    #[test]
    fn sample_shared_memory_bounds_the_vocabulary() {
        let buf = rlx_schedule::BufRef { space: rlx_schedule::Space::Arena, offset: 0, bytes: 0 };
        let t = |vocab| Thunk::Sample {
            batch: 1,
            vocab,
            history_len: 8,
            logits: buf,
            fparams: buf,
            iparams: buf,
            history: buf,
            position: buf,
            out: buf,
        };
        assert_eq!(unsupported(&t(49152)), None);
        assert_eq!(unsupported(&t(262144)), None, "Gemma's vocabulary");
        assert!(unsupported(&t(8_000_000)).is_some());
        assert!(unsupported(&t(0)).is_some());
    }
}
