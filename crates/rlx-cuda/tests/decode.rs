//! The generation step's thunks on the GPU against the CPU backend:
//! quantized matmuls (every block format, against a dequantise-then-f64
//! oracle and the CPU's int8-activation kernel within its bound), quantized
//! gathers (bit for bit), sampling (the same token for greedy, top-k, top-p,
//! min-p, penalties, ties and NaNs), integer binary ops, per-row state
//! writes and valid lengths, and state shared between two executables.
//! Replayed runs equal eager ones bit for bit.

mod common;

use std::sync::Arc;

use common::*;
use rand::rngs::StdRng;
use rand::Rng;
use rlx_cpu::quant::dequantize_row;
use rlx_ir::{BinaryOp, DType, QFormat, Shape};
use rlx_runtime::{Backend, PrepareOptions, StateSet, Tensor};
use rlx_schedule::{qmatmul_scratch_parts, AttentionThunk, BufRef, SeqView, Space, Thunk, WeightSlot};

fn t_i32(shape: &[usize], v: &[i32]) -> Tensor {
    Tensor::from_i32(shape.to_vec(), v).unwrap_or_else(|e| panic!("{e}"))
}

fn t_f32(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), v).unwrap_or_else(|e| panic!("{e}"))
}

/// Byte offsets of a block's f16 scale fields.
fn scale_fields(f: QFormat) -> &'static [usize] {
    match f {
        QFormat::Q4_0 | QFormat::Q5_0 | QFormat::Q8_0 => &[0],
        QFormat::Q4_1 | QFormat::Q5_1 | QFormat::Q4K => &[0, 2],
        QFormat::Q6K => &[208],
    }
}

/// `rows` rows of random blocks: every quant bit random, the f16 scales
/// finite, each block's magnitude drawn from 1e-4 to 1e3 (extreme scales
/// side by side in one row).
fn random_blocks(r: &mut StdRng, f: QFormat, rows: usize, k: usize) -> Vec<u8> {
    let rb = f.row_bytes(k).unwrap_or_else(|| panic!("{f}: {k}"));
    let mut out = vec![0u8; rows * rb];
    r.fill(&mut out[..]);
    for blk in out.chunks_exact_mut(f.block_bytes()) {
        let mag = 10f32.powf(r.random_range(-4.0f32..3.0)) / 64.0;
        for &o in scale_fields(f) {
            let v = half::f16::from_f32(mag * r.random_range(-1.0f32..1.0));
            blk[o..o + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    out
}

/// Adds a U8 weight `[rows, row_bytes]` holding `bytes`.
fn u8_weight(sb: &mut Sb, name: &str, rows: usize, bytes: Vec<u8>) -> BufRef {
    u8_weight_at(sb, name, rows, bytes, 0)
}

/// As `u8_weight`, the rows starting `pad` bytes into the stored weight (a
/// view whose start is not 16-byte aligned when `pad` is not a multiple of 16).
fn u8_weight_at(sb: &mut Sb, name: &str, rows: usize, bytes: Vec<u8>, pad: usize) -> BufRef {
    let len = bytes.len();
    let stored: Vec<u8> = std::iter::repeat_n(0u8, pad).chain(bytes).collect();
    let shape = if pad == 0 { vec![rows, len / rows] } else { vec![pad + len] };
    sb.store
        .set(name, Tensor::from_bytes(shape.clone(), DType::U8, stored).unwrap_or_else(|e| panic!("{e}")))
        .unwrap_or_else(|e| panic!("{e}"));
    let i = sb.s.weights.len() as u32;
    sb.s.weights.push(WeightSlot { name: name.into(), parts: vec![name.into()], concat_axis: 0, shape: Shape(shape), dtype: DType::U8 });
    BufRef { space: Space::Weight(i), offset: pad as u64, bytes: len as u64 }
}

/// The GPU's rounding of one product's operands in a quantized matmul of
/// `rows` rows: none for one row (f32 throughout); two and more rows run on
/// tensor cores with both operands rounded to 16 bits (f16, bf16 for bf16
/// activations). Returns (relative bound per product, absolute bound per
/// unit of |w| + |x|: f16's subnormal spacing).
fn mma_rounding(rows: usize, dt: DType) -> (f64, f64) {
    match (rows, dt) {
        (1, _) => (0.0, 0.0),
        (_, DType::BF16) => (2.0 * 2f64.powi(-8) * 1.01, 0.0),
        _ => (2.0 * 2f64.powi(-11) * 1.01, 2f64.powi(-25)),
    }
}

fn run_both(
    what: &str,
    g: &Option<rlx_cuda::CudaBackend>,
    s: &Arc<rlx_schedule::Schedule>,
    w: &Arc<rlx_runtime::WeightStore>,
    inputs: &[(String, Tensor)],
) -> (Vec<Tensor>, Option<Vec<Tensor>>) {
    let cpu = run(&rlx_cpu::CpuBackend::new(), s, w, inputs, true).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
    let Some(g) = g else { return (cpu, None) };
    let replay = run(g, s, w, inputs, true).unwrap_or_else(|e| panic!("{what}: gpu replay: {e}"));
    let eager = run(g, s, w, inputs, false).unwrap_or_else(|e| panic!("{what}: gpu eager: {e}"));
    for (i, (a, b)) in replay.iter().zip(&eager).enumerate() {
        assert_eq!(a.bytes(), b.bytes(), "{what}: output {i}: replay and eager differ");
    }
    (cpu, Some(replay))
}

#[test]
fn qmatmul_every_format_against_the_f64_oracle_and_the_cpu() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(31);
    for f in QFormat::ALL {
        let be = f.block_elems();
        for case in [
            (1, 37, 3, DType::F32),
            (3, 64, 2, DType::F32),
            (17, 9, 1, DType::F32),
            (1, 20, 2, DType::F16),
            (6, 11, 2, DType::BF16),
            (43, 10, 1, DType::F32),
            // One row of up to 4 and 8 chunks per lane (576 and 1536
            // elements of a 32-element format), one of exactly 8, and one
            // past them (the general kernel again).
            (1, 33, 18, DType::F32),
            (1, 19, 48, DType::F16),
            (1, 9, 64, DType::F32),
            (1, 7, 65, DType::BF16),
            // Past 8,192 columns without a gate, four columns a warp (the
            // output head), with a partial last warp, at up to 2 and 4
            // chunks a lane; the weight's start 16-byte aligned (its rows
            // staged in shared memory, a partial last 16-byte piece) or
            // not (read in place: 8,202 columns, 2 bytes into the weight).
            (1, 8195, 9, DType::F16),
            (1, 8202, 18, DType::F32),
            // Tensor-core tiles: a batch of 8, two tiles of 32 rows with a
            // partial third, columns past a multiple of 16, and (odd rows)
            // a row stride that is not a multiple of 4 elements.
            (8, 40, 18, DType::F32),
            (70, 33, 5, DType::F32),
            (37, 24, 3, DType::F16),
            (9, 17, 4, DType::BF16),
            // Many rows, each without scratch (qmma) and with it (from 256
            // rows: the library form), with partial tiles both ways (and,
            // at 521 rows, a row stride of k + 3).
            (300, 24, 3, DType::F16),
            (521, 70, 2, DType::F32),
            (512, 136, 2, DType::F16),
            (600, 40, 2, DType::BF16),
        ]
        .into_iter()
        .flat_map(|c| [(c, false), (c, true)])
        {
            let ((rows, n, nblk, dt), lib) = case;
            // From 256 rows with scratch: a library matmul over weights
            // decoded into it (kernels/qlib.cu and cuBLASLt).
            if lib && rows < 256 {
                continue;
            }
            let k = nblk * be;
            // A row stride past the row: the activations are a strided view.
            let lda = if rows % 2 == 1 && rows > 1 { k + 3 } else { k + 8 };
            let mut sb = Sb::new();
            let a = sb.input("a", &[rows, lda], dt);
            let wb = random_blocks(&mut r, f, n, k);
            let w = u8_weight_at(&mut sb, "w", n, wb.clone(), if n == 8202 { 2 } else { 0 });
            let out = sb.output("out", &[rows, n], dt);
            let scratch = lib.then(|| sb.scratch(qmatmul_scratch_parts(rows, n, k, false).expect("scratch").iter().sum()));
            sb.thunk(Thunk::QMatMul {
                format: f,
                dtype: dt,
                rows,
                n,
                k,
                a,
                lda: lda as u64,
                w,
                out,
                norm: None,
                glu: false,
                residual: None,
                scratch,
            });
            let at = rand_tensor(&mut r, &[rows, lda], dt);
            let (s, ws) = sb.finish();
            let what = format!("qmatmul {f} {dt} {rows}x{n}x{k}{}", if lib { " (library)" } else { "" });
            let inputs = named(vec![("a", at.clone())]);
            // The oracle: dequantised rows, the activations as stored, f64.
            let x = at.to_f32();
            let rb = f.row_bytes(k).unwrap_or(0);
            let mut wrow = vec![0f32; k];
            let mut want = vec![0f64; rows * n];
            let mut mag = vec![0f64; rows * n];
            // Sum of |w| + |x| over the products (f16's subnormal steps).
            let mut spread = vec![0f64; rows * n];
            for j in 0..n {
                dequantize_row(f, &wb[j * rb..(j + 1) * rb], &mut wrow).unwrap_or_else(|e| panic!("{e}"));
                for i in 0..rows {
                    for (c, wv) in wrow.iter().enumerate() {
                        let p = x[i * lda + c] as f64 * *wv as f64;
                        want[i * n + j] += p;
                        mag[i * n + j] += p.abs();
                        spread[i * n + j] += (x[i * lda + c] as f64).abs() + (*wv as f64).abs();
                    }
                }
            }
            if dt == DType::F32 {
                // The CPU rounds activations to int8 per block: each element
                // is off by at most half a step (block amax / 254).
                let cpu = run(&rlx_cpu::CpuBackend::new(), &s, &ws, &inputs, true).unwrap_or_else(|e| panic!("{what}: cpu: {e}"));
                let c = cpu[0].to_f32();
                for i in 0..rows {
                    for j in 0..n {
                        dequantize_row(f, &wb[j * rb..(j + 1) * rb], &mut wrow).unwrap_or_else(|e| panic!("{e}"));
                        let mut bound = 1e-5 * mag[i * n + j];
                        for b0 in (0..k).step_by(be) {
                            let amax = (b0..b0 + be).map(|c| x[i * lda + c].abs()).fold(0f32, f32::max) as f64;
                            bound += amax / 254.0 * wrow[b0..b0 + be].iter().map(|w| w.abs() as f64).sum::<f64>();
                        }
                        let d = (c[i * n + j] as f64 - want[i * n + j]).abs();
                        assert!(
                            d <= bound * 1.01 + 1e-30,
                            "{what}: cpu [{i},{j}] {} vs oracle {} (bound {bound:e})",
                            c[i * n + j],
                            want[i * n + j]
                        );
                    }
                }
            }
            let Some(g) = &g else { continue };
            let replay = run(g, &s, &ws, &inputs, true).unwrap_or_else(|e| panic!("{what}: gpu replay: {e}"));
            let eager = run(g, &s, &ws, &inputs, false).unwrap_or_else(|e| panic!("{what}: gpu eager: {e}"));
            assert_eq!(replay[0].bytes(), eager[0].bytes(), "{what}: replay and eager differ");
            // f32 accumulation over k products, then the output's rounding.
            let unit = match dt {
                DType::F16 => 2f64.powi(-11),
                DType::BF16 => 2f64.powi(-8),
                _ => 0.0,
            };
            let (rel, abs) = mma_rounding(rows, dt);
            let got = replay[0].to_f32();
            let mut worst = 0f64;
            for (e, (gv, wv)) in got.iter().zip(&want).enumerate() {
                // Past f16's largest finite value (65504, rounding up from
                // 65520) the right answer is an infinity of the sum's sign;
                // within the rounding bound of 65520 either is right.
                let tol = (1e-5 + rel) * mag[e] + abs * spread[e];
                let same_sign_inf = gv.is_infinite() && (*gv > 0.0) == (*wv > 0.0);
                if dt == DType::F16 && wv.abs() - tol >= 65520.0 {
                    assert!(same_sign_inf, "{what}: element {e}: gpu {gv} vs oracle {wv} (beyond f16)");
                    continue;
                }
                if dt == DType::F16 && wv.abs() + tol >= 65520.0 && same_sign_inf {
                    continue;
                }
                let bound = tol + unit * wv.abs() * 1.01 + 1e-30;
                let d = (*gv as f64 - wv).abs();
                assert!(d <= bound, "{what}: element {e}: gpu {gv} vs oracle {wv} (|diff| {d:e} > {bound:e})");
                worst = worst.max(d / mag[e].max(1e-30));
            }
            eprintln!("{what}: ok, worst |diff| / sum|terms| {worst:e}");
        }
    }
}

/// The fused forms (RmsNorm prologue, SwiGLU over the two halves, residual
/// epilogue, and all three at once) for every format, against the same
/// dequantise-then-f64 oracle; the CPU's fused path is checked bit for bit
/// against its unfused kernels in crates/rlx/tests/passes.rs.
#[test]
fn qmatmul_fused_forms_against_the_f64_oracle() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(37);
    for f in QFormat::ALL {
        for case in [
            (1, 24, true, false, false, 2),
            (1, 12, false, true, false, 2),
            (3, 20, false, false, true, 2),
            (1, 16, true, true, true, 2),
            (5, 9, true, true, true, 2),
            (19, 7, true, true, true, 2),
            // A decode step's shapes: 576-element rows with the norm and
            // the gate, 1536-element rows with the residual.
            (1, 40, true, true, false, 18),
            (1, 21, false, false, true, 48),
            // The output head's form: many columns, the final norm, four
            // columns a warp (with a residual too).
            (1, 8201, true, false, false, 18),
            (1, 8195, true, false, true, 2),
            // The same on tensor cores: a batch of 8, and two 32-row tiles
            // with a partial third.
            (8, 40, true, true, false, 18),
            (70, 21, true, true, true, 5),
            // The same over many rows, without scratch and with it (the
            // library form from 256 rows).
            (520, 72, true, true, true, 2),
            (515, 100, true, false, false, 3),
            (530, 36, false, false, true, 2),
            (260, 24, true, true, false, 2),
        ]
        .into_iter()
        .flat_map(|c| [(c, false), (c, true)])
        {
            let ((rows, n, norm, glu, res, nblk), lib) = case;
            // From 256 rows with scratch: the library matmul.
            if lib && rows < 256 {
                continue;
            }
            let k = nblk * f.block_elems();
            let lda = k + 4;
            let mut sb = Sb::new();
            let a = sb.input("a", &[rows, lda], DType::F32);
            let wrows = if glu { 2 * n } else { n };
            let wb = random_blocks(&mut r, f, wrows, k);
            let w = u8_weight(&mut sb, "w", wrows, wb.clone());
            let gamma = sb.input("gamma", &[k], DType::F32);
            let resb = sb.input("res", &[rows, n], DType::F32);
            let out = sb.output("out", &[rows, n], DType::F32);
            let eps = 1e-5f32;
            let scratch = lib.then(|| sb.scratch(qmatmul_scratch_parts(rows, n, k, glu).expect("scratch").iter().sum()));
            sb.thunk(Thunk::QMatMul {
                format: f,
                dtype: DType::F32,
                rows,
                n,
                k,
                a,
                lda: lda as u64,
                w,
                out,
                norm: norm.then_some(rlx_schedule::QNorm { gamma, eps }),
                glu,
                residual: res.then_some(resb),
                scratch,
            });
            let at = rand_tensor(&mut r, &[rows, lda], DType::F32);
            let gt = rand_tensor(&mut r, &[k], DType::F32);
            let rt = rand_tensor(&mut r, &[rows, n], DType::F32);
            let (s, ws) = sb.finish();
            let what = format!("qmatmul {f} {rows}x{n}x{k} norm={norm} glu={glu} residual={res}{}", if lib { " (library)" } else { "" });
            let inputs = named(vec![("a", at.clone()), ("gamma", gt.clone()), ("res", rt.clone())]);
            let (x, gv, rv) = (at.to_f32(), gt.to_f32(), rt.to_f32());
            let rb = f.row_bytes(k).unwrap_or(0);
            let mut wrow = vec![0f32; k];
            // (value, bound on the GPU's error) of each weight row against
            // each a row: f32 accumulation, and on tensor cores the rounding
            // of x·gamma and w to f16 (the norm's scale comes after).
            let (rel, abs) = mma_rounding(rows, DType::F32);
            let mut dots = vec![(0f64, 0f64); rows * wrows];
            for i in 0..rows {
                let xr = &x[i * lda..i * lda + k];
                let inv =
                    if norm { 1.0 / (xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / k as f64 + eps as f64).sqrt() } else { 1.0 };
                for j in 0..wrows {
                    dequantize_row(f, &wb[j * rb..(j + 1) * rb], &mut wrow).unwrap_or_else(|e| panic!("{e}"));
                    let (mut v, mut m, mut spread) = (0f64, 0f64, 0f64);
                    for c in 0..k {
                        let xg = xr[c] as f64 * if norm { gv[c] as f64 } else { 1.0 };
                        let h = xg * if norm { inv } else { 1.0 };
                        v += h * wrow[c] as f64;
                        m += (h * wrow[c] as f64).abs();
                        spread += (xg.abs() + (wrow[c] as f64).abs()) * if norm { inv } else { 1.0 };
                    }
                    dots[i * wrows + j] = (v, (1e-5 + rel) * m + abs * spread);
                }
            }
            let Some(g) = &g else { continue };
            let replay = run(g, &s, &ws, &inputs, true).unwrap_or_else(|e| panic!("{what}: gpu replay: {e}"));
            let eager = run(g, &s, &ws, &inputs, false).unwrap_or_else(|e| panic!("{what}: gpu eager: {e}"));
            assert_eq!(replay[0].bytes(), eager[0].bytes(), "{what}: replay and eager differ");
            let got = replay[0].to_f32();
            for i in 0..rows {
                for j in 0..n {
                    let (sv, se) = dots[i * wrows + j];
                    let (mut want, mut bound) = (sv, se);
                    if glu {
                        let (uv, ue) = dots[i * wrows + n + j];
                        let silu = sv / (1.0 + (-sv).exp());
                        want = silu * uv;
                        bound = 1.1 * uv.abs() * se + silu.abs() * ue + 1.1 * se * ue + 1e-5 * want.abs();
                    }
                    if res {
                        want += rv[i * n + j] as f64;
                        bound += 1e-6 * (rv[i * n + j] as f64).abs();
                    }
                    let gv = got[i * n + j] as f64;
                    assert!((gv - want).abs() <= bound + 1e-30, "{what}: [{i},{j}]: gpu {gv} vs oracle {want} (bound {bound:e})");
                }
            }
            eprintln!("{what}: ok");
        }
    }
}

#[test]
fn qgather_every_format_bit_for_bit_and_bad_ids() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(32);
    for f in QFormat::ALL {
        for (vocab, nblk, id_dtype) in [(50, 2, DType::I32), (7, 1, DType::I64)] {
            let dim = nblk * f.block_elems();
            let n = 9;
            let mut sb = Sb::new();
            let table = u8_weight(&mut sb, "table", vocab, random_blocks(&mut r, f, vocab, dim));
            let ids = sb.input("ids", &[n], id_dtype);
            let out = sb.output("out", &[n, dim], DType::F32);
            sb.thunk(Thunk::QGather { format: f, id_dtype, n, dim, vocab, table, ids, out });
            let (s, w) = sb.finish();
            let idv: Vec<i32> = (0..n).map(|i| if i == 0 { (vocab - 1) as i32 } else { r.random_range(0..vocab as i32) }).collect();
            let idt = t_i32(&[n], &idv).to_dtype(id_dtype);
            let what = format!("qgather {f} {id_dtype} vocab {vocab} dim {dim}");
            let (cpu, gpu) = run_both(&what, &g, &s, &w, &named(vec![("ids", idt)]));
            if let Some(gpu) = gpu {
                assert_eq!(gpu[0].bytes(), cpu[0].bytes(), "{what}: not bit-identical to the CPU");
                eprintln!("{what}: ok, bit-identical");
            }
            // An id outside the table: an error on both.
            let bad = t_i32(&[n], &vec![vocab as i32; n]).to_dtype(id_dtype);
            let bad = named(vec![("ids", bad)]);
            assert!(run(&rlx_cpu::CpuBackend::new(), &s, &w, &bad, true).is_err(), "{what}: cpu accepted a bad id");
            if let Some(g) = &g {
                let e = run(g, &s, &w, &bad, true).err().map(|e| e.to_string()).unwrap_or_default();
                assert!(e.contains("outside 0..vocab"), "{what}: gpu: {e:?}");
            }
        }
    }
}

/// One sampling row's settings.
#[derive(Clone, Copy, Debug)]
struct Settings {
    temperature: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    penalty: f32,
    last_n: i32,
    seed: u64,
}

fn greedy() -> Settings {
    Settings { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, penalty: 1.0, last_n: 0, seed: 0 }
}

/// Rows of logits shaped to reach every branch: plain, a few levels (ties
/// everywhere), NaNs, -inf, flat (every candidate weighs the same), and one
/// dominant value.
fn logits_row(r: &mut StdRng, kind: usize, vocab: usize) -> Vec<f32> {
    (0..vocab)
        .map(|i| match kind % 6 {
            0 => r.random_range(-8.0f32..8.0),
            1 => (r.random_range(-4.0f32..4.0) * 2.0).round() / 2.0,
            2 if i % 7 == 3 => f32::NAN,
            2 => r.random_range(-3.0f32..3.0),
            3 if i % 3 == 0 => f32::NEG_INFINITY,
            3 => r.random_range(-2.0f32..2.0),
            4 => 0.25,
            _ if i == vocab / 2 => 30.0,
            _ => r.random_range(-1.0f32..1.0),
        })
        .collect()
}

fn sample_case(g: &Option<rlx_cuda::CudaBackend>, r: &mut StdRng, vocab: usize, rows: &[Settings], what: &str) {
    let batch = rows.len();
    let hist = 48;
    let mut sb = Sb::new();
    let logits = sb.input("logits", &[batch, vocab], DType::F32);
    let fparams = sb.input("f", &[batch, 4], DType::F32);
    let iparams = sb.input("i", &[batch, 4], DType::I32);
    let history = sb.input("history", &[batch, hist], DType::I32);
    let position = sb.input("pos", &[batch], DType::I32);
    let out = sb.output("token", &[batch], DType::I32);
    sb.thunk(Thunk::Sample { batch, vocab, history_len: hist, logits, fparams, iparams, history, position, out });
    let (s, w) = sb.finish();
    let mut lv = Vec::new();
    for b in 0..batch {
        lv.extend(logits_row(r, b, vocab));
    }
    let fv: Vec<f32> = rows.iter().flat_map(|p| [p.temperature, p.top_p, p.min_p, p.penalty]).collect();
    let iv: Vec<i32> = rows.iter().flat_map(|p| [p.top_k, p.last_n, p.seed as u32 as i32, (p.seed >> 32) as u32 as i32]).collect();
    // History: mostly ids near the top of each row, some out of range (ignored).
    let hv: Vec<i32> = (0..batch * hist)
        .map(|i| match i % 11 {
            0 => -1,
            1 => vocab as i32 + 3,
            _ => r.random_range(0..vocab as i32),
        })
        .collect();
    let pv: Vec<i32> = (0..batch).map(|b| (b * 7 % hist) as i32).collect();
    let inputs = named(vec![
        ("logits", t_f32(&[batch, vocab], &lv)),
        ("f", t_f32(&[batch, 4], &fv)),
        ("i", t_i32(&[batch, 4], &iv)),
        ("history", t_i32(&[batch, hist], &hv)),
        ("pos", t_i32(&[batch], &pv)),
    ]);
    let (cpu, gpu) = run_both(what, g, &s, &w, &inputs);
    let Some(gpu) = gpu else { return };
    let (c, gt) = (cpu[0].to_i32(), gpu[0].to_i32());
    for b in 0..batch {
        assert_eq!(gt[b], c[b], "{what}: row {b} ({:?}, logits kind {}): gpu token {} vs cpu {}", rows[b], b % 6, gt[b], c[b]);
    }
    eprintln!("{what}: {batch} rows, every token equal to the CPU's");
}

#[test]
fn sample_matches_the_cpu() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(33);
    let mut rows = Vec::new();
    let base = [
        greedy(),
        Settings { penalty: 1.3, last_n: 16, ..greedy() },
        Settings { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, ..greedy() },
        Settings { temperature: 1.0, ..greedy() },
        Settings { temperature: 0.7, top_k: 5, ..greedy() },
        Settings { temperature: 1.3, top_p: 0.5, ..greedy() },
        Settings { temperature: 0.9, min_p: 0.2, ..greedy() },
        Settings { temperature: 1.0, top_k: 3000, top_p: 0.9, ..greedy() },
        Settings { temperature: 0.5, top_k: 100000, min_p: 0.01, penalty: 0.8, last_n: 48, ..greedy() },
        Settings { temperature: 2.0, top_k: 1, ..greedy() },
        Settings { temperature: 1.0, top_p: 0.999, penalty: 1.1, last_n: 30, ..greedy() },
        Settings { temperature: 0.6, top_k: 2048, ..greedy() },
    ];
    // Every setting over every kind of logits row, several seeds.
    for (i, p) in base.iter().enumerate() {
        for kind in 0..6 {
            rows.push((Settings { seed: (i * 6 + kind) as u64 * 0x9E37_79B9 + 11, ..*p }, kind));
        }
    }
    // Rows are logits kind b % 6: keep each setting's rows in that order.
    let settings: Vec<Settings> = rows.iter().map(|x| x.0).collect();
    sample_case(&g, &mut r, 5003, &settings, "sample vocab 5003");
    sample_case(&g, &mut r, 49152, &settings[..24], "sample vocab 49152");
    // Many seeds with the default settings on one kind of row.
    let many: Vec<Settings> =
        (0..96).map(|s| Settings { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, seed: s * 6 + 1, ..greedy() }).collect();
    sample_case(&g, &mut r, 1000, &many, "sample, 96 seeds");
}

#[test]
fn sample_position_outside_the_history_is_an_error() {
    let Some(g) = gpu_or_dry() else { return };
    let (batch, vocab, hist) = (2, 64, 8);
    let mut sb = Sb::new();
    let logits = sb.input("logits", &[batch, vocab], DType::F32);
    let fparams = sb.input("f", &[batch, 4], DType::F32);
    let iparams = sb.input("i", &[batch, 4], DType::I32);
    let history = sb.input("history", &[batch, hist], DType::I32);
    let position = sb.input("pos", &[batch], DType::I32);
    let out = sb.output("token", &[batch], DType::I32);
    sb.thunk(Thunk::Sample { batch, vocab, history_len: hist, logits, fparams, iparams, history, position, out });
    let (s, w) = sb.finish();
    let inputs = named(vec![
        ("logits", t_f32(&[batch, vocab], &vec![0.5; batch * vocab])),
        ("f", t_f32(&[batch, 4], &[0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0])),
        ("i", t_i32(&[batch, 4], &[0; 8])),
        ("history", t_i32(&[batch, hist], &vec![0; batch * hist])),
        ("pos", t_i32(&[batch], &[1, hist as i32])),
    ]);
    assert!(run(&rlx_cpu::CpuBackend::new(), &s, &w, &inputs, true).is_err());
    if let Some(g) = &g {
        let e = run(g, &s, &w, &inputs, true).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("sample position"), "{e:?}");
    }
}

#[test]
fn integer_binary_ops() {
    let Some(g) = gpu_or_dry() else { return };
    for dt in [DType::I32, DType::I64] {
        for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div] {
            // [3, 5] op [5] (broadcast along rows), wrapping at the edges.
            let mut sb = Sb::new();
            let a = sb.input("a", &[3, 5], dt);
            let b = sb.input("b", &[5], dt);
            let out = sb.output("out", &[3, 5], dt);
            sb.thunk(Thunk::Binary { op, dtype: dt, out_shape: vec![3, 5], a, a_strides: vec![5, 1], b, b_strides: vec![0, 1], out });
            let (s, w) = sb.finish();
            let av = [7, -7, i32::MAX, i32::MIN, 0, 100, -100, 3, 4, 5, i32::MIN, 1, -1, 2, 9];
            let bv = [2, 3, 1, -1, -5];
            let inputs = named(vec![("a", t_i32(&[3, 5], &av).to_dtype(dt)), ("b", t_i32(&[5], &bv).to_dtype(dt))]);
            check(&format!("binary {op:?} {dt}"), &g, &s, &w, &inputs, 1.0);
            if op == BinaryOp::Div {
                let zero = named(vec![("a", t_i32(&[3, 5], &av).to_dtype(dt)), ("b", t_i32(&[5], &[1, 0, 1, 1, 1]).to_dtype(dt))]);
                assert!(run(&rlx_cpu::CpuBackend::new(), &s, &w, &zero, true).is_err());
                if let Some(g) = &g {
                    let e = run(g, &s, &w, &zero, true).err().map(|e| e.to_string()).unwrap_or_default();
                    assert!(e.contains("division by zero"), "{e:?}");
                }
            }
        }
    }
}

#[test]
fn write_state_one_position_per_row() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(34);
    for dt in [DType::F32, DType::F16, DType::I32] {
        let (batch, max_rows, new_rows, width) = (3, 9, 2, 5);
        let mut sb = Sb::new();
        let value = sb.input("value", &[batch, new_rows, width], dt);
        let pos = sb.input("pos", &[batch], DType::I32);
        let state = sb.state("cache", &[batch, max_rows, width], dt);
        sb.thunk(Thunk::WriteState {
            dtype: dt,
            value_dtype: dt,
            batch,
            max_rows,
            new_rows,
            width,
            state,
            value,
            position: pos,
            positions_per_batch: true,
        });
        let out = sb.output("out", &[batch, max_rows, width], dt);
        let n = batch * max_rows * width;
        sb.thunk(Thunk::Copy { dtype: dt, shape: vec![n], src: state, src_strides: vec![1], dst: out, dst_strides: vec![1] });
        let (s, w) = sb.finish();
        let v = if dt == DType::I32 {
            t_i32(&[batch, new_rows, width], &(0..30).map(|x| x * 3 - 7).collect::<Vec<_>>())
        } else {
            rand_tensor(&mut r, &[batch, new_rows, width], dt)
        };
        let inputs = named(vec![("value", v.clone()), ("pos", t_i32(&[batch], &[0, 7, 3]))]);
        check(&format!("write_state per row {dt}"), &g, &s, &w, &inputs, 1.0);
        // Row 1 past the end: an error, and nothing written.
        let bad = named(vec![("value", v), ("pos", t_i32(&[batch], &[0, 8, 3]))]);
        assert!(run(&rlx_cpu::CpuBackend::new(), &s, &w, &bad, true).is_err());
        if let Some(g) = &g {
            let e = run(g, &s, &w, &bad, true).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("past the state's capacity"), "{e:?}");
        }
    }
}

/// A float value written into a float state of another dtype is rounded to
/// the state's (f32 keys into an f16 cache), on the GPU as on the CPU.
#[test]
fn write_state_converts_floats() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(36);
    for (vt, st) in [(DType::F32, DType::F16), (DType::F32, DType::BF16), (DType::F16, DType::F32), (DType::BF16, DType::F16)] {
        let (batch, max_rows, new_rows, width) = (2, 7, 3, 33);
        let mut sb = Sb::new();
        let value = sb.input("value", &[batch, new_rows, width], vt);
        let pos = sb.input("pos", &[batch], DType::I32);
        let state = sb.state("cache", &[batch, max_rows, width], st);
        sb.thunk(Thunk::WriteState {
            dtype: st,
            value_dtype: vt,
            batch,
            max_rows,
            new_rows,
            width,
            state,
            value,
            position: pos,
            positions_per_batch: true,
        });
        let out = sb.output("out", &[batch, max_rows, width], st);
        let n = batch * max_rows * width;
        sb.thunk(Thunk::Copy { dtype: st, shape: vec![n], src: state, src_strides: vec![1], dst: out, dst_strides: vec![1] });
        let (s, w) = sb.finish();
        let v = rand_tensor(&mut r, &[batch, new_rows, width], vt);
        let inputs = named(vec![("value", v.clone()), ("pos", t_i32(&[batch], &[4, 1]))]);
        // The CPU's result is checked against plain rounding of each value.
        let cpu = run(&rlx_cpu::CpuBackend::new(), &s, &w, &inputs, true).expect("cpu").remove(0).to_f32();
        let vals = v.to_f32();
        for (b, p) in [(0usize, 4usize), (1, 1)] {
            for i in 0..new_rows * width {
                let want = t_f32(&[1], &[vals[b * new_rows * width + i]]).to_dtype(st).to_f32()[0];
                assert_eq!(cpu[(b * max_rows + p) * width + i].to_bits(), want.to_bits(), "{vt} -> {st}: batch {b} element {i}");
            }
        }
        check(&format!("write_state {vt} into {st}"), &g, &s, &w, &inputs, 1.0);
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_per_row(
    g: &Option<rlx_cuda::CudaBackend>,
    r: &mut StdRng,
    (dt, kvt): (DType, DType),
    (batch, heads, kv_heads, hd, q_len, kv_len): (usize, usize, usize, usize, usize, usize),
    causal: bool,
) {
    let (qw, kw) = (heads * hd, kv_heads * hd);
    let mut sb = Sb::new();
    let qb = sb.input("q", &[batch, q_len, qw], dt);
    let kb = sb.input("k", &[batch, kv_len, kw], kvt);
    let vb = sb.input("v", &[batch, kv_len, kw], kvt);
    let valid = sb.input("valid", &[batch], DType::I32);
    let out = sb.output("out", &[batch, q_len, qw], dt);
    sb.thunk(Thunk::Attention(AttentionThunk {
        dtype: dt,
        kv_dtype: kvt,
        batch,
        heads,
        kv_heads,
        head_dim: hd,
        q_len,
        kv_len,
        scale: 1.0 / (hd as f32).sqrt(),
        causal,
        q: SeqView { buf: qb, batch_stride: (q_len * qw) as u64, row_stride: qw as u64 },
        k: SeqView { buf: kb, batch_stride: (kv_len * kw) as u64, row_stride: kw as u64 },
        v: SeqView { buf: vb, batch_stride: (kv_len * kw) as u64, row_stride: kw as u64 },
        mask: None,
        mask_dtype: DType::F32,
        valid_len: Some(valid),
        valid_len_per_batch: true,
        out,
    }));
    let (s, w) = sb.finish();
    // Every row its own length, from q_len (the causal minimum) to kv_len.
    let vv: Vec<i32> = (0..batch).map(|b| if b == 0 { kv_len as i32 } else { r.random_range(q_len..=kv_len) as i32 }).collect();
    // Keys past a row's valid length hold NaN: they must never be read.
    let mut kv = |name: &str| {
        let mut x = rand_tensor(r, &[batch, kv_len, kw], kvt).to_f32();
        for (i, e) in x.iter_mut().enumerate() {
            if (i / kw) % kv_len >= vv[i / (kv_len * kw)] as usize {
                *e = f32::NAN;
            }
        }
        (name.to_string(), t_f32(&[batch, kv_len, kw], &x).to_dtype(kvt))
    };
    let (kt, vt) = (kv("k"), kv("v"));
    let mut inputs = named(vec![("q", rand_tensor(r, &[batch, q_len, qw], dt)), ("valid", t_i32(&[batch], &vv))]);
    inputs.push(kt);
    inputs.push(vt);
    let what = format!(
        "attention per-row valid {dt} (k, v {kvt}) b{batch} h{heads}/{kv_heads} hd{hd} q{q_len} kv{kv_len} causal={causal} valid={vv:?}"
    );
    // f32 queries over a 16-bit cache on tensor cores (prompt rows, head
    // dims a multiple of 16) round the queries and the probabilities to the
    // cache's type: f32's tolerance scaled by the ratio of that type's
    // absolute tolerance to f32's (f16: 6e-3 absolute and relative; bf16:
    // 4e-2). A decode row stays in f32.
    let scale = if dt != kvt && q_len > 1 && hd % 16 == 0 { common::tol(kvt).0 / common::tol(dt).0 } else { 1.0 };
    check(&what, g, &s, &w, &inputs, scale);
}

#[test]
fn attention_one_valid_length_per_row() {
    let Some(g) = gpu_or_dry() else { return };
    let mut r = rng(35);
    for dt in FLOATS {
        attention_per_row(&g, &mut r, (dt, dt), (3, 4, 2, 64, 1, 40), true);
        attention_per_row(&g, &mut r, (dt, dt), (4, 3, 3, 32, 5, 33), true);
        attention_per_row(&g, &mut r, (dt, dt), (2, 2, 1, 48, 3, 20), false);
    }
    // f32 queries over a half-precision cache (the decoder's f16 KV cache):
    // the decode kernel (one query row), the scalar kernel (head dims not a
    // multiple of 16) and the tensor-core kernels.
    for kvt in [DType::F16, DType::BF16] {
        attention_per_row(&g, &mut r, (DType::F32, kvt), (3, 9, 3, 64, 1, 70), true);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (2, 4, 2, 128, 1, 50), true);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (2, 4, 2, 32, 1, 45), true);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (4, 3, 3, 32, 5, 33), true);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (2, 4, 2, 96, 17, 60), true);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (2, 2, 1, 48, 3, 20), false);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (2, 4, 2, 40, 5, 30), true);
        // Prompt rows on tensor cores: 64-row blocks, 128-row blocks, the
        // key-splitting 16-row blocks, head dims 32 to 128.
        attention_per_row(&g, &mut r, (DType::F32, kvt), (20, 8, 4, 64, 64, 120), true);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (16, 9, 3, 64, 128, 300), true);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (20, 4, 2, 96, 40, 90), false);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (24, 6, 2, 32, 64, 100), true);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (12, 12, 4, 128, 70, 160), true);
        // Head dims below their compiled width (80 in 96, 112 in 128).
        attention_per_row(&g, &mut r, (DType::F32, kvt), (20, 8, 4, 80, 64, 120), true);
        attention_per_row(&g, &mut r, (DType::F32, kvt), (12, 12, 4, 112, 70, 160), false);
    }
    // Shapes that take the tensor-core kernels (f16/bf16, 16-row blocks or
    // 64-row blocks filling the GPU; short and streaming key ranges).
    for dt in [DType::F16, DType::BF16] {
        attention_per_row(&g, &mut r, (dt, dt), (3, 4, 2, 64, 16, 100), true);
        attention_per_row(&g, &mut r, (dt, dt), (20, 8, 4, 64, 64, 120), true);
        attention_per_row(&g, &mut r, (dt, dt), (20, 8, 8, 64, 64, 200), true);
    }
}

/// Two executables bound to one state set: one writes the state, the
/// other reads what it wrote; a size mismatch is an error.
#[test]
fn shared_state_between_executables() {
    let Some(g) = gpu_or_dry() else { return };
    let (rows, width) = (6, 4);
    let writer = {
        let mut sb = Sb::new();
        let value = sb.input("value", &[1, 2, width], DType::F32);
        let pos = sb.input("pos", &[1], DType::I32);
        let state = sb.state("kv", &[1, rows, width], DType::F32);
        sb.thunk(Thunk::WriteState {
            dtype: DType::F32,
            value_dtype: DType::F32,
            batch: 1,
            max_rows: rows,
            new_rows: 2,
            width,
            state,
            value,
            position: pos,
            positions_per_batch: false,
        });
        sb.finish()
    };
    let reader = {
        let mut sb = Sb::new();
        let state = sb.state("kv", &[1, rows, width], DType::F32);
        let out = sb.output("out", &[rows * width], DType::F32);
        sb.thunk(Thunk::Copy {
            dtype: DType::F32,
            shape: vec![rows * width],
            src: state,
            src_strides: vec![1],
            dst: out,
            dst_strides: vec![1],
        });
        sb.finish()
    };
    let value: Vec<f32> = (0..2 * width).map(|x| x as f32 + 0.5).collect();
    let inputs = [("value", t_f32(&[1, 2, width], &value)), ("pos", t_i32(&[1], &[3]))];
    let mut want = vec![0f32; rows * width];
    want[3 * width..5 * width].copy_from_slice(&value);
    let cpu = rlx_cpu::CpuBackend::new();
    let backends: Vec<&dyn Backend> = match &g {
        Some(g) => vec![&cpu, g],
        None => vec![&cpu],
    };
    for b in backends {
        for replay in [true, false] {
            let set = StateSet::new();
            let opts = PrepareOptions { slots: 2, replay, allow_tf32: false, ..PrepareOptions::default() };
            let mut w = b.prepare_shared(writer.0.clone(), writer.1.clone(), &set, &opts).unwrap_or_else(|e| panic!("{}: {e}", b.name()));
            let mut rd = b.prepare_shared(reader.0.clone(), reader.1.clone(), &set, &opts).unwrap_or_else(|e| panic!("{}: {e}", b.name()));
            let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (*n, t)).collect();
            w.run(&refs).unwrap_or_else(|e| panic!("{}: {e}", b.name()));
            let got = rd.run(&[]).unwrap_or_else(|e| panic!("{}: {e}", b.name()));
            assert_eq!(got[0].to_f32(), want, "{} (replay {replay}): the reader sees the writer's rows", b.name());
            // The same name at another size is refused.
            let other = {
                let mut sb = Sb::new();
                let state = sb.state("kv", &[1, rows + 1, width], DType::F32);
                let out = sb.output("out", &[width], DType::F32);
                sb.thunk(Thunk::Copy {
                    dtype: DType::F32,
                    shape: vec![width],
                    src: state,
                    src_strides: vec![1],
                    dst: out,
                    dst_strides: vec![1],
                });
                sb.finish()
            };
            let e = b.prepare_shared(other.0, other.1, &set, &opts).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("kv"), "{}: {e:?}", b.name());
        }
        eprintln!("{}: shared state ok", b.name());
    }
}
