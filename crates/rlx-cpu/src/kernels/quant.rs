//! GGML block-quantized weights ([`QFormat`]) on the CPU: a reference
//! decoder, a simple encoder (for test weights and test GGUF files), an
//! embedding gather, and a matmul that reads the blocks as stored.
//!
//! The matmul rounds each activation row to int8 with one f32 scale per
//! weight block (32 elements; 256 for the K formats) and keeps integer sums
//! of the rounded values, so its inner loop is integer dot products of the
//! 4–8-bit weights with int8 activations (AVX-512 VNNI, AVX2 or scalar,
//! picked once at run time). Its only error beyond f32 rounding is that of
//! the activations: at most half a scale step (block amax / 254) per element.

use std::sync::OnceLock;

use half::f16;
use rayon::prelude::*;
use rlx_ir::QFormat;

// ---------------------------------------------------------------------------
// Format constants (const-generic codes so the SIMD loops are monomorphised
// per format).

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;
const Q4K: u8 = 5;
const Q6K: u8 = 6;

fn code(f: QFormat) -> u8 {
    match f {
        QFormat::Q4_0 => Q4_0,
        QFormat::Q4_1 => Q4_1,
        QFormat::Q5_0 => Q5_0,
        QFormat::Q5_1 => Q5_1,
        QFormat::Q8_0 => Q8_0,
        QFormat::Q4K => Q4K,
        QFormat::Q6K => Q6K,
    }
}

const fn block_bytes(f: u8) -> usize {
    match f {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        Q8_0 => 34,
        Q4K => 144,
        _ => 210,
    }
}

/// Offset of the 16 nibble bytes in a 32-element 4/5-bit block.
const fn qs_offset(f: u8) -> usize {
    match f {
        Q4_0 => 2,
        Q4_1 => 4,
        Q5_0 => 6,
        _ => 8,
    }
}

/// Offset of the 32 high bits (u32) in a Q5 block.
const fn qh_offset(f: u8) -> usize {
    if f == Q5_0 {
        2
    } else {
        4
    }
}

const fn has_min(f: u8) -> bool {
    matches!(f, Q4_1 | Q5_1)
}

const fn is_q5(f: u8) -> bool {
    matches!(f, Q5_0 | Q5_1)
}

#[inline(always)]
fn h16(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline(always)]
fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(b[off..off + 2].try_into().unwrap_or_default())
}

#[inline(always)]
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Q4_K's packed 6-bit scale and min of sub-block `j` (0..8).
#[inline(always)]
fn k4_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

#[inline(always)]
fn k4_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..8 {
        (sc[j], mn[j]) = k4_scale_min(s, j);
    }
    (sc, mn)
}

// ---------------------------------------------------------------------------
// Length checks.

fn row_bytes(format: QFormat, k: usize) -> Result<usize, String> {
    format.row_bytes(k).ok_or_else(|| format!("{format}: row length {k} is not a multiple of the block size {}", format.block_elems()))
}

/// Elements a strided `rows × cols` matrix needs: `(rows-1)·ld + cols`.
fn strided_len(what: &str, rows: usize, cols: usize, ld: usize) -> Result<usize, String> {
    if rows == 0 {
        return Ok(0);
    }
    if ld < cols {
        return Err(format!("{what}: row stride {ld} is less than the row length {cols}"));
    }
    (rows - 1).checked_mul(ld).and_then(|v| v.checked_add(cols)).ok_or_else(|| format!("{what}: {rows} rows of stride {ld} overflow"))
}

/// Checks a matmul's operands; returns the weight row bytes.
#[allow(clippy::too_many_arguments)]
fn check_matmul(
    format: QFormat,
    m: usize,
    n: usize,
    k: usize,
    a: usize,
    lda: usize,
    w: usize,
    out: usize,
    ldo: usize,
) -> Result<usize, String> {
    let rb = row_bytes(format, k)?;
    let need_a = strided_len("activations", m, k, lda)?;
    if a < need_a {
        return Err(format!("activations: {a} elements, {m}×{k} with stride {lda} needs {need_a}"));
    }
    let need_out = strided_len("output", m, n, ldo)?;
    if out < need_out {
        return Err(format!("output: {out} elements, {m}×{n} with stride {ldo} needs {need_out}"));
    }
    let need_w = n.checked_mul(rb).ok_or_else(|| format!("weights: {n} rows of {rb} bytes overflow"))?;
    if w < need_w {
        return Err(format!("weights: {w} bytes, {n} rows of {format} × {k} need {need_w}"));
    }
    Ok(rb)
}

// ---------------------------------------------------------------------------
// Reference decoder.

fn dequantize_block(f: QFormat, b: &[u8], y: &mut [f32]) {
    match f {
        QFormat::Q4_0 | QFormat::Q4_1 | QFormat::Q5_0 | QFormat::Q5_1 => {
            let c = code(f);
            let d = h16(b, 0);
            let m = if has_min(c) { h16(b, 2) } else { 0.0 };
            let qh = if is_q5(c) { u32_at(b, qh_offset(c)) } else { 0 };
            let qs = &b[qs_offset(c)..qs_offset(c) + 16];
            for j in 0..32 {
                let nib = if j < 16 { qs[j] & 15 } else { qs[j - 16] >> 4 };
                let q = nib as i32 | (((qh >> j) & 1) as i32) << 4;
                y[j] = match c {
                    Q4_0 => d * (q - 8) as f32,
                    Q5_0 => d * (q - 16) as f32,
                    _ => d * q as f32 + m,
                };
            }
        }
        QFormat::Q8_0 => {
            let d = h16(b, 0);
            for j in 0..32 {
                y[j] = d * (b[2 + j] as i8) as f32;
            }
        }
        QFormat::Q4K => {
            let d = h16(b, 0);
            let dmin = h16(b, 2);
            let (sc, mn) = k4_scales_mins(&b[4..16]);
            for c in 0..4 {
                let qs = &b[16 + 32 * c..16 + 32 * c + 32];
                let (d1, m1) = (d * sc[2 * c] as f32, dmin * mn[2 * c] as f32);
                let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * mn[2 * c + 1] as f32);
                for l in 0..32 {
                    y[64 * c + l] = d1 * (qs[l] & 15) as f32 - m1;
                    y[64 * c + 32 + l] = d2 * (qs[l] >> 4) as f32 - m2;
                }
            }
        }
        QFormat::Q6K => {
            let d = h16(b, 208);
            for h in 0..2 {
                let ql = &b[64 * h..64 * h + 64];
                let qh = &b[128 + 32 * h..128 + 32 * h + 32];
                let sc = &b[192 + 8 * h..192 + 8 * h + 8];
                let y = &mut y[128 * h..128 * h + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = (ql[l] & 15) as i32 | ((qh[l] & 3) as i32) << 4;
                    let q2 = (ql[l + 32] & 15) as i32 | (((qh[l] >> 2) & 3) as i32) << 4;
                    let q3 = (ql[l] >> 4) as i32 | (((qh[l] >> 4) & 3) as i32) << 4;
                    let q4 = (ql[l + 32] >> 4) as i32 | (((qh[l] >> 6) & 3) as i32) << 4;
                    y[l] = d * (sc[is] as i8) as f32 * (q1 - 32) as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * (q2 - 32) as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * (q3 - 32) as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * (q4 - 32) as f32;
                }
            }
        }
    }
}

/// Decodes one row: `dst.len()` elements (a whole number of blocks) from
/// exactly `format.row_bytes(dst.len())` bytes.
pub fn dequantize_row(format: QFormat, src: &[u8], dst: &mut [f32]) -> Result<(), String> {
    let rb = row_bytes(format, dst.len())?;
    if src.len() != rb {
        return Err(format!("{format}: {} bytes for a row of {} elements, expected {rb}", src.len(), dst.len()));
    }
    for (b, y) in src.chunks_exact(format.block_bytes()).zip(dst.chunks_exact_mut(format.block_elems())) {
        dequantize_block(format, b, y);
    }
    Ok(())
}

/// Decodes the rows `ids` of `table` (rows of `dim` elements, stored back to
/// back) into `dst` (`ids.len() × dim`). Every id is checked before anything
/// is written.
pub fn gather_rows(format: QFormat, table: &[u8], dim: usize, ids: impl IntoIterator<Item = i64>, dst: &mut [f32]) -> Result<(), String> {
    if dim == 0 {
        return Err(format!("{format} gather: row length 0"));
    }
    let rb = row_bytes(format, dim)?;
    if !table.len().is_multiple_of(rb) {
        return Err(format!("{format} gather: table of {} bytes is not a whole number of {rb}-byte rows", table.len()));
    }
    let vocab = table.len() / rb;
    let ids: Vec<usize> = ids
        .into_iter()
        .enumerate()
        .map(|(i, id)| {
            if id < 0 || id as u64 >= vocab as u64 {
                Err(format!("{format} gather: id {id} at position {i} is outside the table ({vocab} rows)"))
            } else {
                Ok(id as usize)
            }
        })
        .collect::<Result<_, _>>()?;
    if dst.len() != ids.len() * dim {
        return Err(format!("{format} gather: output of {} elements for {} rows of {dim}", dst.len(), ids.len()));
    }
    dst.par_chunks_mut(dim).zip(ids.par_iter()).with_min_len((1 << 14) / dim + 1).for_each(|(y, &id)| {
        for (b, yb) in table[id * rb..(id + 1) * rb].chunks_exact(format.block_bytes()).zip(y.chunks_exact_mut(format.block_elems())) {
            dequantize_block(format, b, yb);
        }
    });
    Ok(())
}

// ---------------------------------------------------------------------------
// Encoder.

/// Next f16 towards +∞ (finite values; MAX stays MAX).
fn f16_next_up(h: f16) -> f16 {
    let b = h.to_bits();
    let r = if b & 0x7FFF == 0 {
        0x0001
    } else if b & 0x8000 == 0 {
        b + 1
    } else {
        b - 1
    };
    let r = f16::from_bits(r);
    if r.is_finite() {
        r
    } else {
        f16::MAX
    }
}

/// The smallest f16 ≥ `v` (saturating at ±MAX).
fn f16_ceil(v: f32) -> f16 {
    let h = f16::from_f32(v);
    if !h.is_finite() {
        return if v > 0.0 { f16::MAX } else { f16::MIN };
    }
    if h.to_f32() < v {
        f16_next_up(h)
    } else {
        h
    }
}

/// The largest f16 ≤ `v` (saturating at ±MAX).
fn f16_floor(v: f32) -> f16 {
    -f16_ceil(-v)
}

fn put16(out: &mut Vec<u8>, h: f16) {
    out.extend_from_slice(&h.to_bits().to_le_bytes());
}

/// Scale for levels `-lo..=hi` (Q4_0: 8, 7; Q5_0: 16, 15), sign chosen so
/// the wider side of the data gets the extra level; rounded up so no value
/// falls outside the range.
fn symmetric_scale(x: &[f32], lo: f32, hi: f32) -> f16 {
    let mn = x.iter().fold(0f32, |a, &v| a.min(v));
    let mx = x.iter().fold(0f32, |a, &v| a.max(v));
    let pos = (-mn / lo).max(mx / hi);
    let neg = (mx / lo).max(-mn / hi);
    if pos <= neg {
        f16_ceil(pos)
    } else {
        -f16_ceil(neg)
    }
}

#[inline]
fn round_to(v: f32, lo: i32, hi: i32) -> i32 {
    (v.round() as i32).clamp(lo, hi)
}

/// q = round(x / d) in `lo..=hi`; 0 when d is 0.
#[inline]
fn level(x: f32, d: f32, lo: i32, hi: i32) -> i32 {
    if d == 0.0 {
        0.clamp(lo, hi)
    } else {
        round_to(x / d, lo, hi)
    }
}

fn quantize_block(f: QFormat, x: &[f32], out: &mut Vec<u8>) {
    match f {
        QFormat::Q4_0 | QFormat::Q5_0 => {
            let (lo, hi) = if f == QFormat::Q4_0 { (8, 7) } else { (16, 15) };
            let d = symmetric_scale(x, lo as f32, hi as f32);
            let q: Vec<u8> = x.iter().map(|&v| (level(v, d.to_f32(), -lo, hi) + lo) as u8).collect();
            put16(out, d);
            if f == QFormat::Q5_0 {
                let qh = q.iter().enumerate().fold(0u32, |a, (j, &v)| a | (((v >> 4) as u32) << j));
                out.extend_from_slice(&qh.to_le_bytes());
            }
            out.extend((0..16).map(|j| (q[j] & 15) | (q[j + 16] & 15) << 4));
        }
        QFormat::Q4_1 | QFormat::Q5_1 => {
            let top = if f == QFormat::Q4_1 { 15 } else { 31 };
            let mn = x.iter().fold(f32::INFINITY, |a, &v| a.min(v));
            let mx = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
            // The min rounds down and the step up, so every value lies in range.
            let m = f16_floor(mn);
            let d = f16_ceil((mx - m.to_f32()) / top as f32);
            let q: Vec<u8> = x.iter().map(|&v| level(v - m.to_f32(), d.to_f32(), 0, top) as u8).collect();
            put16(out, d);
            put16(out, m);
            if f == QFormat::Q5_1 {
                let qh = q.iter().enumerate().fold(0u32, |a, (j, &v)| a | (((v >> 4) as u32) << j));
                out.extend_from_slice(&qh.to_le_bytes());
            }
            out.extend((0..16).map(|j| (q[j] & 15) | (q[j + 16] & 15) << 4));
        }
        QFormat::Q8_0 => {
            let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
            let d = f16_ceil(amax / 127.0);
            put16(out, d);
            out.extend(x.iter().map(|&v| level(v, d.to_f32(), -127, 127) as i8 as u8));
        }
        QFormat::Q4K => {
            // Per sub-block of 32: range [lo, hi] with lo ≤ 0 (the format
            // subtracts a non-negative min), then 6-bit min and scale indices
            // rounded up so the range stays covered.
            let mut lo = [0f32; 8];
            let mut hi = [0f32; 8];
            for j in 0..8 {
                let s = &x[32 * j..32 * j + 32];
                lo[j] = s.iter().fold(0f32, |a, &v| a.min(v));
                hi[j] = s.iter().fold(0f32, |a, &v| a.max(v));
            }
            let dmin = f16_ceil(lo.iter().fold(0f32, |a, &v| a.max(-v)) / 63.0);
            let mut mi = [0u8; 8];
            let mut eff_min = [0f32; 8];
            for j in 0..8 {
                if dmin.to_f32() > 0.0 {
                    mi[j] = ((-lo[j] / dmin.to_f32()).ceil() as i32).clamp(0, 63) as u8;
                }
                eff_min[j] = dmin.to_f32() * mi[j] as f32;
            }
            let need: Vec<f32> = (0..8).map(|j| (hi[j] + eff_min[j]) / 15.0).collect();
            let d = f16_ceil(need.iter().fold(0f32, |a, &v| a.max(v)) / 63.0);
            let mut si = [0u8; 8];
            let mut q = [0u8; 256];
            for j in 0..8 {
                if d.to_f32() > 0.0 {
                    si[j] = ((need[j] / d.to_f32()).ceil() as i32).clamp(0, 63) as u8;
                }
                let step = d.to_f32() * si[j] as f32;
                for l in 0..32 {
                    q[32 * j + l] = level(x[32 * j + l] + eff_min[j], step, 0, 15) as u8;
                }
            }
            put16(out, d);
            put16(out, dmin);
            let mut s = [0u8; 12];
            for j in 0..4 {
                s[j] = (si[j] & 63) | ((si[j + 4] >> 4) << 6);
                s[j + 4] = (mi[j] & 63) | ((mi[j + 4] >> 4) << 6);
                s[j + 8] = (si[j + 4] & 15) | ((mi[j + 4] & 15) << 4);
            }
            out.extend_from_slice(&s);
            for c in 0..4 {
                out.extend((0..32).map(|l| q[64 * c + l] | q[64 * c + 32 + l] << 4));
            }
        }
        QFormat::Q6K => {
            // Per sub-block of 16: symmetric step amax/31, as a positive 8-bit
            // multiple of d (rounded up).
            let need: Vec<f32> = (0..16).map(|s| x[16 * s..16 * s + 16].iter().fold(0f32, |a, &v| a.max(v.abs())) / 31.0).collect();
            let d = f16_ceil(need.iter().fold(0f32, |a, &v| a.max(v)) / 127.0);
            let mut sc = [0i8; 16];
            let mut q = [0u8; 256];
            for s in 0..16 {
                if d.to_f32() > 0.0 {
                    sc[s] = ((need[s] / d.to_f32()).ceil() as i32).clamp(0, 127) as i8;
                }
                let step = d.to_f32() * sc[s] as f32;
                for l in 0..16 {
                    q[16 * s + l] = (level(x[16 * s + l], step, -32, 31) + 32) as u8;
                }
            }
            let mut ql = [0u8; 128];
            let mut qh = [0u8; 64];
            for h in 0..2 {
                for l in 0..32 {
                    let [q1, q2, q3, q4] = [0, 32, 64, 96].map(|o| q[128 * h + o + l]);
                    ql[64 * h + l] = (q1 & 15) | (q3 & 15) << 4;
                    ql[64 * h + 32 + l] = (q2 & 15) | (q4 & 15) << 4;
                    qh[32 * h + l] = (q1 >> 4) | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6;
                }
            }
            out.extend_from_slice(&ql);
            out.extend_from_slice(&qh);
            out.extend(sc.iter().map(|&v| v as u8));
            put16(out, d);
        }
    }
}

/// Encodes one row (a whole number of blocks of finite values). Per block
/// (or sub-block) the step is chosen to cover the block's range, so each
/// element is off by at most half its step (Q4_1/Q5_1 and the K formats:
/// the step times 1/2 of the final level; see the tests for the bounds).
/// Not llama.cpp's error-minimising search; meant for test weights.
pub fn quantize_row(format: QFormat, x: &[f32]) -> Result<Vec<u8>, String> {
    let rb = row_bytes(format, x.len())?;
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return Err(format!("{format}: element {i} is not finite ({})", x[i]));
    }
    let mut out = Vec::with_capacity(rb);
    for b in x.chunks_exact(format.block_elems()) {
        quantize_block(format, b, &mut out);
    }
    debug_assert_eq!(out.len(), rb);
    Ok(out)
}

// ---------------------------------------------------------------------------
// Oracle.

/// out = a · wᵀ with each weight row decoded and the sums in f64.
#[allow(clippy::too_many_arguments)]
pub fn matmul_reference(
    format: QFormat,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    w: &[u8],
    out: &mut [f32],
    ldo: usize,
) -> Result<(), String> {
    let rb = check_matmul(format, m, n, k, a.len(), lda, w.len(), out.len(), ldo)?;
    let mut row = vec![0f32; k];
    for j in 0..n {
        dequantize_row(format, &w[j * rb..(j + 1) * rb], &mut row)?;
        for i in 0..m {
            let x = &a[i * lda..i * lda + k];
            let s: f64 = x.iter().zip(&row).map(|(&p, &q)| p as f64 * q as f64).sum();
            out[i * ldo + j] = s as f32;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Kernel choice.

/// An implementation of [`matmul`]'s inner loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QPath {
    /// Plain Rust; any CPU.
    Scalar,
    /// AVX2 + FMA + F16C (`maddubs` dot products, 256-bit).
    Avx2,
    /// AVX-512 F/BW/VL + VNNI (`dpbusd`, 512-bit, two blocks per step).
    Avx512,
}

impl QPath {
    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            QPath::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            QPath::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            QPath::Avx512 => {
                QPath::Avx2.supported()
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The paths this CPU supports, slowest first.
    pub fn available() -> Vec<QPath> {
        [QPath::Scalar, QPath::Avx2, QPath::Avx512].into_iter().filter(|p| p.supported()).collect()
    }

    /// The fastest supported path (detected once).
    pub fn best() -> QPath {
        static BEST: OnceLock<QPath> = OnceLock::new();
        *BEST.get_or_init(|| *QPath::available().last().unwrap_or(&QPath::Scalar))
    }
}

// ---------------------------------------------------------------------------
// Activation quantization.

/// The int8 activations of `m` rows, in natural order, for one format.
struct Act {
    k: usize,
    nb: usize,
    ng: usize,
    /// Per row: k rounded values.
    q: Vec<i8>,
    /// Per row, per block: the scale (block amax / 127).
    d: Vec<f32>,
    /// Per row, per block: scale · Σq (the min term of Q4_1/Q5_1).
    s: Vec<f32>,
    /// Per row, per 32-element block: the scale 8 times (one per int32 lane
    /// of the SIMD kernels' dot products); unused for the K formats.
    db: Vec<f32>,
    /// Per row: Σq over each group of 32 (16 for Q6_K).
    sums: Vec<i32>,
    /// Per row, per 4 values: −offset · their sum, the integer correction
    /// for kernels that read the weights as unsigned q + offset (zero where
    /// the path does not).
    corr: Vec<i32>,
}

#[derive(Clone, Copy)]
struct ActRow<'a> {
    q: &'a [i8],
    d: &'a [f32],
    s: &'a [f32],
    db: &'a [f32],
    sums: &'a [i32],
    corr: &'a [i32],
}

fn sum_group(f: QFormat) -> usize {
    if f == QFormat::Q6K {
        16
    } else {
        32
    }
}

/// The offset a path's kernel adds to the weights to make them unsigned
/// (and removes again through `Act::corr`).
fn lane_offset(f: QFormat, path: QPath) -> i32 {
    match (path, f) {
        (QPath::Scalar, _) => 0,
        (_, QFormat::Q4_0) => 8,
        (_, QFormat::Q5_0) => 16,
        (QPath::Avx512, QFormat::Q8_0) => 128,
        _ => 0,
    }
}

impl Act {
    fn new(f: QFormat, path: QPath, m: usize, k: usize, a: &[f32], lda: usize) -> Act {
        let nb = k / f.block_elems();
        let ng = k / sum_group(f);
        let mut act = Act {
            k,
            nb,
            ng,
            q: vec![0; m * k],
            d: vec![0.0; m * nb],
            s: vec![0.0; m * nb],
            db: vec![0.0; m * (k / 4)],
            sums: vec![0; m * ng],
            corr: vec![0; m * (k / 4)],
        };
        let off = lane_offset(f, path);
        act.q
            .par_chunks_mut(k)
            .zip(act.d.par_chunks_mut(nb))
            .zip(act.s.par_chunks_mut(nb))
            .zip(act.db.par_chunks_mut(k / 4))
            .zip(act.sums.par_chunks_mut(ng))
            .zip(act.corr.par_chunks_mut(k / 4))
            .enumerate()
            .with_min_len((1 << 16) / k + 1)
            .for_each(|(i, (((((q, d), s), db), sums), corr))| quantize_act_row(f, off, &a[i * lda..i * lda + k], q, d, s, db, sums, corr));
        act
    }

    #[inline]
    fn row(&self, i: usize) -> ActRow<'_> {
        let (k, nb, ng) = (self.k, self.nb, self.ng);
        ActRow {
            q: &self.q[i * k..(i + 1) * k],
            d: &self.d[i * nb..(i + 1) * nb],
            s: &self.s[i * nb..(i + 1) * nb],
            db: &self.db[i * (k / 4)..(i + 1) * (k / 4)],
            sums: &self.sums[i * ng..(i + 1) * ng],
            corr: &self.corr[i * (k / 4)..(i + 1) * (k / 4)],
        }
    }
}

crate::simd::multiversion! {
    /// One activation row quantised to int8 per block, with the sums the
    /// kernels use. Compiled for AVX-512 and AVX2 too: as plain x86-64 code
    /// its rounding was a libm call per element (5% of a decode step).
    #[allow(clippy::too_many_arguments)]
    fn quantize_act_row(
        f: QFormat,
        off: i32,
        x: &[f32],
        q: &mut [i8],
        d: &mut [f32],
        s: &mut [f32],
        db: &mut [f32],
        sums: &mut [i32],
        corr: &mut [i32],
    ) {
        let be = f.block_elems();
        // The lanes below cover whole blocks only if they are whole 16s.
        debug_assert!(be.is_multiple_of(16));
        for (((xb, qb), dv), sv) in x.chunks_exact(be).zip(q.chunks_exact_mut(be)).zip(d.iter_mut()).zip(s.iter_mut()) {
            // max |x| in 16 lanes (blocks are 32 or 256 long). A NaN makes the
            // scale NaN, so it reaches the outputs it touches.
            let (mut lanes, mut nan) = ([0f32; 16], false);
            for c in xb.as_chunks::<16>().0 {
                for l in 0..16 {
                    lanes[l] = lanes[l].max(c[l].abs());
                    nan |= c[l].is_nan();
                }
            }
            let amax = if nan { f32::NAN } else { lanes.iter().fold(0f32, |a, &v| a.max(v)) };
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut total = 0i32;
            if inv > 0.0 && inv.is_finite() {
                // Every x is finite and at most amax in size, so |y| ≤ ~127.
                for (qv, &xv) in qb.iter_mut().zip(xb) {
                    // f32::round (half away from zero) in a form that
                    // vectorises: y - trunc(y) is exact, so this is round's
                    // result bit for bit.
                    let y = xv * inv;
                    let t = y.trunc();
                    let r = if (y - t).abs() >= 0.5 { t + 1f32.copysign(y) } else { t };
                    // SAFETY: r is finite, and within ±127 after the clamp.
                    let v = unsafe { r.clamp(-127.0, 127.0).to_int_unchecked::<i32>() } as i8;
                    *qv = v;
                    total += v as i32;
                }
            } else {
                // No scale (zeros, a NaN or an infinity in the block) or one
                // whose inverse overflows: the plain form, NaN products to 0.
                for (qv, &xv) in qb.iter_mut().zip(xb) {
                    let v = (xv * inv).round().clamp(-127.0, 127.0) as i8;
                    *qv = v;
                    total += v as i32;
                }
            }
            *dv = amax / 127.0;
            *sv = *dv * total as f32;
        }
        if be == 32 {
            for (lanes, &dv) in db.chunks_exact_mut(8).zip(d.iter()) {
                lanes.fill(dv);
            }
        }
        for (sum, qg) in sums.iter_mut().zip(q.chunks_exact(sum_group(f))) {
            *sum = qg.iter().map(|&v| v as i32).sum();
        }
        if off != 0 {
            for (c, lane) in corr.iter_mut().zip(q.chunks_exact(4)) {
                *c = -off * lane.iter().map(|&v| v as i32).sum::<i32>();
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The matmul.

/// out = a · wᵀ: `a` is m×k (row stride `lda`), `w` is n rows of
/// `format.row_bytes(k)` bytes, `out` is m×n (row stride `ldo`). Runs on
/// the current rayon pool, split over output columns, with the fastest
/// kernel this CPU supports.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    format: QFormat,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    w: &[u8],
    out: &mut [f32],
    ldo: usize,
) -> Result<(), String> {
    matmul_with(QPath::best(), format, m, n, k, a, lda, w, out, ldo)
}

/// [`matmul`] on a chosen kernel; an error if this CPU does not support it.
#[allow(clippy::too_many_arguments)]
pub fn matmul_with(
    path: QPath,
    format: QFormat,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    w: &[u8],
    out: &mut [f32],
    ldo: usize,
) -> Result<(), String> {
    let rb = check_matmul(format, m, n, k, a.len(), lda, w.len(), out.len(), ldo)?;
    if !path.supported() {
        return Err(format!("quantized matmul: this CPU does not support the {path:?} kernel"));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        for i in 0..m {
            out[i * ldo..i * ldo + n].fill(0.0);
        }
        return Ok(());
    }
    let act = Act::new(format, path, m, k, a, lda);
    let w = &w[..n * rb];

    // Columns per task: two tasks per thread, but at least ~32 KiB of
    // weight traffic × rows each so the split costs little. With eight a
    // thread, decode at batch 1 (SmolLM2-135M, 2 cores) ran 1–16% slower in
    // six alternated runs: each matvec is tens of µs, and the pool's
    // hand-offs cost more than the balance won.
    let threads = rayon::current_num_threads().max(1);
    let min_cols = ((32 << 10) / rb.saturating_mul(m).max(1)).max(1);
    let cn = n.div_ceil(threads * 2).max(min_cols).min(n);
    let nchunks = n.div_ceil(cn);

    // Each task gets the same column range of every output row.
    let mut pieces: Vec<Vec<&mut [f32]>> = (0..nchunks).map(|_| Vec::with_capacity(m)).collect();
    for row in out.chunks_mut(ldo).take(m) {
        for (c, piece) in row[..n].chunks_mut(cn).enumerate() {
            pieces[c].push(piece);
        }
    }
    if nchunks == 1 {
        run_chunk(path, format, w, rb, &act, &mut pieces[0]);
    } else {
        pieces.par_iter_mut().zip(w.par_chunks(cn * rb)).for_each(|(dst, wc)| run_chunk(path, format, wc, rb, &act, dst));
    }
    Ok(())
}

/// Columns `w` (whole rows of weights) for every activation row: dst[i][j].
fn run_chunk(path: QPath, f: QFormat, w: &[u8], rb: usize, act: &Act, dst: &mut [&mut [f32]]) {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: matmul_with checked that the CPU supports the path's features.
        QPath::Avx512 => unsafe { avx512::chunk(f, w, rb, act, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        QPath::Avx2 => unsafe { avx2::chunk(f, w, rb, act, dst) },
        _ => scalar::chunk(f, w, rb, act, dst),
    }
}

mod scalar {
    use super::*;

    pub(super) fn chunk(f: QFormat, w: &[u8], rb: usize, act: &Act, dst: &mut [&mut [f32]]) {
        for (j, wr) in w.chunks_exact(rb).enumerate() {
            for (i, d) in dst.iter_mut().enumerate() {
                d[j] = row(f, wr, act.row(i));
            }
        }
    }

    fn row(f: QFormat, w: &[u8], a: ActRow<'_>) -> f32 {
        let (be, bb) = (f.block_elems(), f.block_bytes());
        let per = be / sum_group(f);
        let mut acc = 0f32;
        for (b, blk) in w.chunks_exact(bb).enumerate() {
            acc += block_dot(f, blk, &a.q[b * be..(b + 1) * be], a.d[b], a.s[b], &a.sums[b * per..(b + 1) * per]);
        }
        acc
    }

    /// One block against its activations: `da` their scale, `s` = da·Σq,
    /// `sums` their group sums.
    pub(super) fn block_dot(f: QFormat, blk: &[u8], q: &[i8], da: f32, s: f32, sums: &[i32]) -> f32 {
        let t = f16_table();
        let h16 = |off: usize| t[u16_at(blk, off) as usize];
        let c = code(f);
        match c {
            Q4_0 | Q4_1 | Q5_0 | Q5_1 => {
                let qs = &blk[qs_offset(c)..qs_offset(c) + 16];
                let qh = if is_q5(c) { u32_at(blk, qh_offset(c)) } else { 0 };
                let mut t = 0i32;
                for j in 0..16 {
                    let lo = (qs[j] & 15) as i32 | (((qh >> j) & 1) << 4) as i32;
                    let hi = (qs[j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
                    t += lo * q[j] as i32 + hi * q[j + 16] as i32;
                }
                let d = h16(0) * da;
                match c {
                    Q4_0 => d * (t - 8 * sums[0]) as f32,
                    Q5_0 => d * (t - 16 * sums[0]) as f32,
                    _ => d * t as f32 + h16(2) * s,
                }
            }
            Q8_0 => {
                let t: i32 = blk[2..34].iter().zip(q).map(|(&w, &v)| (w as i8) as i32 * v as i32).sum();
                h16(0) * da * t as f32
            }
            Q4K => {
                let (sc, mn) = k4_scales_mins(&blk[4..16]);
                let (mut t, mut tm) = (0i32, 0i32);
                for c in 0..4 {
                    let qs = &blk[16 + 32 * c..48 + 32 * c];
                    let (mut lo, mut hi) = (0i32, 0i32);
                    for l in 0..32 {
                        lo += (qs[l] & 15) as i32 * q[64 * c + l] as i32;
                        hi += (qs[l] >> 4) as i32 * q[64 * c + 32 + l] as i32;
                    }
                    t += sc[2 * c] as i32 * lo + sc[2 * c + 1] as i32 * hi;
                    tm += mn[2 * c] as i32 * sums[2 * c] + mn[2 * c + 1] as i32 * sums[2 * c + 1];
                }
                h16(0) * da * t as f32 - h16(2) * da * tm as f32
            }
            _ => {
                let mut t = 0i32;
                for h in 0..2 {
                    let ql = &blk[64 * h..64 * h + 64];
                    let qh = &blk[128 + 32 * h..160 + 32 * h];
                    let mut part = [0i32; 8];
                    for l in 0..32 {
                        let v = [
                            (ql[l] & 15) as i32 | ((qh[l] & 3) as i32) << 4,
                            (ql[l + 32] & 15) as i32 | (((qh[l] >> 2) & 3) as i32) << 4,
                            (ql[l] >> 4) as i32 | (((qh[l] >> 4) & 3) as i32) << 4,
                            (ql[l + 32] >> 4) as i32 | (((qh[l] >> 6) & 3) as i32) << 4,
                        ];
                        for (s, &vs) in v.iter().enumerate() {
                            part[2 * s + l / 16] += vs * q[128 * h + 32 * s + l] as i32;
                        }
                    }
                    for (g, &p) in part.iter().enumerate() {
                        let sc = blk[192 + 8 * h + g] as i8 as i32;
                        t += sc * (p - 32 * sums[8 * h + g]);
                    }
                }
                h16(208) * da * t as f32
            }
        }
    }
}

/// Q4_K's eight 6-bit scales and eight mins (bytes 4..16 of a block), as
/// (scales, mins) with sub-block j in byte j of each u64. Of the three input
/// words, the first holds scales 0–3 in its low 6 bits per byte and the top
/// 2 bits of scales 4–7 above them, the second the same for the mins, the
/// third the low 4 bits of scales 4–7 (low nibbles) and mins 4–7 (high).
#[inline(always)]
fn k4_packed(blk: &[u8]) -> (u64, u64) {
    let (a, b, c) = (u32_at(blk, 4), u32_at(blk, 8), u32_at(blk, 12));
    let sc_hi = (c & 0x0F0F_0F0F) | ((a >> 2) & 0x3030_3030);
    let m_hi = ((c >> 4) & 0x0F0F_0F0F) | ((b >> 2) & 0x3030_3030);
    ((a & 0x3F3F_3F3F) as u64 | (sc_hi as u64) << 32, (b & 0x3F3F_3F3F) as u64 | (m_hi as u64) << 32)
}

/// f16 bits → f32, all 65536 values (256 KiB, built once). The kernels
/// read block scales through it: one load each, where converting with
/// F16C per block either chains blocks through partial register writes
/// (as compiled) or needs gathers, which are slow on Zen 4 and on Intel
/// parts with the gather microcode fix. Real weights use few distinct
/// scales, so few of its lines are touched.
fn f16_table() -> &'static [f32; 65536] {
    static TABLE: OnceLock<Box<[f32; 65536]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let t: Vec<f32> = (0..=u16::MAX).map(|b| f16::from_bits(b).to_f32()).collect();
        t.into_boxed_slice().try_into().unwrap_or_else(|_| unreachable!())
    })
}

/// `row32` (one row of a 32-element block format against the quantized
/// activations, pairs of blocks into two accumulators) and `row32x2` (the
/// same for two activation rows), compiled with the module's target
/// features and its own `block_dot`, `unpack` and `dot_u`.
#[cfg(target_arch = "x86_64")]
macro_rules! row_fns {
    ($features:literal) => {
        #[inline]
        #[target_feature(enable = $features)]
        fn row32<const F: u8>(w: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> f32 {
            let bb = block_bytes(F);
            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let (mut m0, mut m1) = (0f32, 0f32);
            let block = |wb: &[u8], q: &[i8], c: &[i32], db: &[f32], s: f32, acc: &mut __m256, macc: &mut f32| {
                let scale = _mm256_mul_ps(_mm256_set1_ps(t[u16_at(wb, 0) as usize]), ld256f(db));
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot::<F>(wb, q, c)), scale, *acc);
                if has_min(F) {
                    *macc += t[u16_at(wb, 2) as usize] * s;
                }
            };
            let mut pairs = w
                .chunks_exact(2 * bb)
                .zip(a.q.chunks_exact(64))
                .zip(a.corr.chunks_exact(16))
                .zip(a.db.chunks_exact(16))
                .zip(a.s.chunks_exact(2));
            for ((((wp, qp), cp), dp), sp) in &mut pairs {
                block(wp, qp, cp, dp, sp[0], &mut acc0, &mut m0);
                block(&wp[bb..], &qp[32..], &cp[8..], &dp[8..], sp[1], &mut acc1, &mut m1);
            }
            let nb = w.len() / bb;
            if nb % 2 == 1 {
                let b = nb - 1;
                block(&w[b * bb..], &a.q[32 * b..], &a.corr[8 * b..], &a.db[8 * b..], a.s[b], &mut acc0, &mut m0);
            }
            hsum(_mm256_add_ps(acc0, acc1)) + (m0 + m1)
        }

        /// `row32` for two activation rows at once: each weight block is
        /// unpacked once for both. Each row's sums run in `row32`'s order
        /// (even and odd blocks apart, then together), so a row gets the
        /// same bits whichever of the two computes it.
        #[inline]
        #[target_feature(enable = $features)]
        fn row32x2<const F: u8>(w: &[u8], a: ActRow<'_>, b: ActRow<'_>, t: &[f32; 65536]) -> (f32, f32) {
            let bb = block_bytes(F);
            let (mut a0, mut a1, mut b0, mut b1) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
            let (mut ma0, mut ma1, mut mb0, mut mb1) = (0f32, 0f32, 0f32, 0f32);
            /// One block of both rows.
            #[inline]
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            fn one<const F: u8>(
                wb: &[u8],
                t: &[f32; 65536],
                (qa, ca, da, sa): (&[i8], &[i32], &[f32], f32),
                (qb, cb, db, sb): (&[i8], &[i32], &[f32], f32),
                acc_a: &mut __m256,
                acc_b: &mut __m256,
                m_a: &mut f32,
                m_b: &mut f32,
            ) {
                let u = unpack::<F>(wb);
                let wd = _mm256_set1_ps(t[u16_at(wb, 0) as usize]);
                *acc_a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u::<F>(u, qa, ca)), _mm256_mul_ps(wd, ld256f(da)), *acc_a);
                *acc_b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u::<F>(u, qb, cb)), _mm256_mul_ps(wd, ld256f(db)), *acc_b);
                if has_min(F) {
                    let m = t[u16_at(wb, 2) as usize];
                    *m_a += m * sa;
                    *m_b += m * sb;
                }
            }
            let ra = a.q.chunks_exact(32).zip(a.corr.chunks_exact(8)).zip(a.db.chunks_exact(8)).zip(a.s.iter().copied());
            let rb = b.q.chunks_exact(32).zip(b.corr.chunks_exact(8)).zip(b.db.chunks_exact(8)).zip(b.s.iter().copied());
            for (i, (wb, ((((qa, ca), da), sa), (((qb, cb), db), sb)))) in w.chunks_exact(bb).zip(ra.zip(rb)).enumerate() {
                if i % 2 == 0 {
                    one::<F>(wb, t, (qa, ca, da, sa), (qb, cb, db, sb), &mut a0, &mut b0, &mut ma0, &mut mb0);
                } else {
                    one::<F>(wb, t, (qa, ca, da, sa), (qb, cb, db, sb), &mut a1, &mut b1, &mut ma1, &mut mb1);
                }
            }
            (hsum(_mm256_add_ps(a0, a1)) + (ma0 + ma1), hsum(_mm256_add_ps(b0, b1)) + (mb0 + mb1))
        }
    };
}

/// `chunk_f`: a chunk of output columns for every activation row,
/// dispatching on the format, with the module's kernels for one row
/// (`$one`; `$q4k`, `$q6k`), one row against two columns (`$one2`;
/// `$q4k2`, `$q6k2`), two rows (`$two`) and R rows (`$rows`; `$q4k_rows`,
/// `$q6k_rows`). Several rows run eight (then four) at a time
/// against every column of the chunk, so the group's int8 activations stay
/// in L1 while the weights stream past. With the columns outer, as before,
/// every column read all rows' activations again, from L2 at a prompt's 128
/// rows. On a 2-core Intel Xeon VM, in-process alternated against that form
/// (medians of 40 rounds): 128 rows of SmolLM2's projections took 0.47–0.50×
/// the time on Q4_1 / Q5_0, 0.59× on Q4_K, 0.69× on Q6_K; 8 rows 0.54×.
#[cfg(target_arch = "x86_64")]
macro_rules! chunk_fns {
    ($features:literal, $one:ident, $one2:ident, $two:ident, $rows:ident, $q4k:ident, $q6k:ident, $q4k2:ident, $q6k2:ident, $q4k_rows:ident, $q6k_rows:ident) => {
        #[inline]
        #[target_feature(enable = $features)]
        fn chunk_f<const F: u8>(w: &[u8], rb: usize, act: &Act, dst: &mut [&mut [f32]]) {
            let t = f16_table();
            let one = |wr: &[u8], a: ActRow<'_>| match F {
                Q4K => $q4k(wr, a, t),
                Q6K => $q6k(wr, a, t),
                _ => $one::<F>(wr, a, t),
            };
            if let [d] = dst {
                // One activation row (decode): its slices taken once, the
                // outputs walked beside the weight rows, two columns at a
                // time. With the slices taken and the output indexed per
                // column, a decode step's matvecs took 1.1–1.35× as long
                // (alternated in one process).
                let a = act.row(0);
                for (o, wp) in d.chunks_exact_mut(2).zip(w.chunks_exact(2 * rb)) {
                    let (w0, w1) = wp.split_at(rb);
                    (o[0], o[1]) = match F {
                        Q4K => $q4k2(w0, w1, a, t),
                        Q6K => $q6k2(w0, w1, a, t),
                        _ => $one2::<F>(w0, w1, a, t),
                    };
                }
                if d.len() % 2 == 1 {
                    let j = d.len() - 1;
                    d[j] = one(&w[j * rb..(j + 1) * rb], a);
                }
                return;
            }
            let m = dst.len();
            let mut i = 0;
            // A group's per-block min terms side by side (Q4_1, Q5_1).
            let (mut s8, mut s4) = (Vec::new(), Vec::new());
            while i + 8 <= m {
                group::<F, 8>(w, rb, act, i, &mut s8, dst);
                i += 8;
            }
            while i + 4 <= m {
                group::<F, 4>(w, rb, act, i, &mut s4, dst);
                i += 4;
            }
            if F != Q4K && F != Q6K && i + 2 <= m {
                let (a, b) = (act.row(i), act.row(i + 1));
                for (j, wr) in w.chunks_exact(rb).enumerate() {
                    let (x, y) = $two::<F>(wr, a, b, t);
                    dst[i][j] = x;
                    dst[i + 1][j] = y;
                }
                i += 2;
            }
            for (i, d) in dst.iter_mut().enumerate().skip(i) {
                let a = act.row(i);
                for (o, wr) in d.iter_mut().zip(w.chunks_exact(rb)) {
                    *o = one(wr, a);
                }
            }
        }

        /// Rows `i..i + R` against every column of the chunk; `sr` is
        /// scratch for their min terms.
        #[inline]
        #[target_feature(enable = $features)]
        fn group<const F: u8, const R: usize>(w: &[u8], rb: usize, act: &Act, i: usize, sr: &mut Vec<[f32; R]>, dst: &mut [&mut [f32]]) {
            let t = f16_table();
            let rows: [ActRow<'_>; R] = std::array::from_fn(|r| act.row(i + r));
            if has_min(F) {
                sr.clear();
                sr.extend((0..act.nb).map(|b| rows.map(|r| r.s[b])));
            }
            for (j, wr) in w.chunks_exact(rb).enumerate() {
                let o = match F {
                    Q4K => $q4k_rows::<R>(wr, &rows, t),
                    Q6K => $q6k_rows::<R>(wr, &rows, t),
                    _ => $rows::<F, R>(wr, &rows, sr, t),
                };
                for (r, v) in o.into_iter().enumerate() {
                    dst[i + r][j] = v;
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::*;

    // Loads take slices and re-slice them to the bytes read, so each one is
    // bounds-checked (the checks fold away inside the loops, whose chunks
    // have constant sizes).

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn ld128(b: &[u8], off: usize) -> __m128i {
        let s = &b[off..off + 16];
        // SAFETY: `s` holds 16 readable bytes; loadu has no alignment needs.
        unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn ld256(b: &[u8], off: usize) -> __m256i {
        let s = &b[off..off + 32];
        // SAFETY: `s` holds 32 readable bytes.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn ld256q(q: &[i8], off: usize) -> __m256i {
        let s = &q[off..off + 32];
        // SAFETY: `s` holds 32 readable bytes.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn ld256i(v: &[i32], off: usize) -> __m256i {
        let s = &v[off..off + 8];
        // SAFETY: `s` holds 8 readable i32.
        unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn ld256f(v: &[f32]) -> __m256 {
        let s = &v[..8];
        // SAFETY: `s` holds 8 readable f32.
        unsafe { _mm256_loadu_ps(s.as_ptr()) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// Byte j = 0xFF where bit j of `bits` is set.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn bits_to_bytes(bits: u32) -> __m256i {
        let v = _mm256_set1_epi32(bits as i32);
        let idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        let v = _mm256_shuffle_epi8(v, idx);
        let m = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        _mm256_cmpeq_epi8(_mm256_and_si256(v, m), m)
    }

    /// One 32-element block (`w`) · its activations, int32 in 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn block_dot<const F: u8>(w: &[u8], q: &[i8], corr: &[i32]) -> __m256i {
        dot_u::<F>(unpack::<F>(w), q, corr)
    }

    /// A block's 32 weights as bytes: the unsigned levels of the 4/5-bit
    /// formats, Q8_0's signed values as stored.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn unpack<const F: u8>(w: &[u8]) -> __m256i {
        if F == Q8_0 {
            return ld256(w, 2);
        }
        let x = ld128(w, qs_offset(F));
        let u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(x), x), _mm256_set1_epi8(15));
        if is_q5(F) {
            _mm256_or_si256(u, _mm256_and_si256(bits_to_bytes(u32_at(w, qh_offset(F))), _mm256_set1_epi8(16)))
        } else {
            u
        }
    }

    /// Unpacked weights (`unpack`) · a block's activations, int32 in 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_u<const F: u8>(u: __m256i, q: &[i8], corr: &[i32]) -> __m256i {
        let qa = ld256q(q, 0);
        let ones = _mm256_set1_epi16(1);
        if F == Q8_0 {
            // |w| × (a with w's sign): maddubs needs one unsigned side.
            return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(qa, u)), ones);
        }
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, qa), ones);
        if has_min(F) {
            p
        } else {
            _mm256_add_epi32(p, ld256i(corr, 0))
        }
    }

    row_fns!("avx2,fma,f16c");
    chunk_fns!("avx2,fma,f16c", row32, row32c2, row32x2, row32xr, row_q4k, row_q6k, row_q4k_c2, row_q6k_c2, row_q4k_xr, row_q6k_xr);

    /// `row32` for two columns of one activation row side by side (as the
    /// AVX-512 module's `row32wc2`; each column with `row32`'s bits).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn row32c2<const F: u8>(w0: &[u8], w1: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> (f32, f32) {
        let bb = block_bytes(F);
        let z = _mm256_setzero_ps();
        let (mut a0, mut a1, mut b0, mut b1) = (z, z, z, z);
        let (mut ma0, mut ma1, mut mb0, mut mb1) = (0f32, 0f32, 0f32, 0f32);
        let block = |wb: &[u8], q: &[i8], c: &[i32], db: &[f32], acc: &mut __m256| {
            let scale = _mm256_mul_ps(_mm256_set1_ps(t[u16_at(wb, 0) as usize]), ld256f(db));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot::<F>(wb, q, c)), scale, *acc);
        };
        let pairs = w0
            .chunks_exact(2 * bb)
            .zip(w1.chunks_exact(2 * bb))
            .zip(a.q.chunks_exact(64))
            .zip(a.corr.chunks_exact(16))
            .zip(a.db.chunks_exact(16))
            .zip(a.s.chunks_exact(2));
        for (((((wa, wb), qp), cp), dp), sp) in pairs {
            block(wa, qp, cp, dp, &mut a0);
            block(wb, qp, cp, dp, &mut b0);
            block(&wa[bb..], &qp[32..], &cp[8..], &dp[8..], &mut a1);
            block(&wb[bb..], &qp[32..], &cp[8..], &dp[8..], &mut b1);
            if has_min(F) {
                ma0 += t[u16_at(wa, 2) as usize] * sp[0];
                ma1 += t[u16_at(wa, bb + 2) as usize] * sp[1];
                mb0 += t[u16_at(wb, 2) as usize] * sp[0];
                mb1 += t[u16_at(wb, bb + 2) as usize] * sp[1];
            }
        }
        let nb = w0.len() / bb;
        if nb % 2 == 1 {
            let k = nb - 1;
            let (wa, wb) = (&w0[k * bb..], &w1[k * bb..]);
            block(wa, &a.q[32 * k..], &a.corr[8 * k..], &a.db[8 * k..], &mut a0);
            block(wb, &a.q[32 * k..], &a.corr[8 * k..], &a.db[8 * k..], &mut b0);
            if has_min(F) {
                ma0 += t[u16_at(wa, 2) as usize] * a.s[k];
                mb0 += t[u16_at(wb, 2) as usize] * a.s[k];
            }
        }
        (hsum(_mm256_add_ps(a0, a1)) + (ma0 + ma1), hsum(_mm256_add_ps(b0, b1)) + (mb0 + mb1))
    }

    /// Two columns, one after the other (`row_q4k`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn row_q4k_c2(w0: &[u8], w1: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> (f32, f32) {
        (row_q4k(w0, a, t), row_q4k(w1, a, t))
    }

    /// Two columns, one after the other (`row_q6k`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn row_q6k_c2(w0: &[u8], w1: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> (f32, f32) {
        (row_q6k(w0, a, t), row_q6k(w1, a, t))
    }

    /// R activation rows (R even) as pairs (`row32x2`, so `row32`'s bits).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn row32xr<const F: u8, const R: usize>(w: &[u8], r: &[ActRow<'_>; R], _sr: &[[f32; R]], t: &[f32; 65536]) -> [f32; R] {
        const { assert!(R.is_multiple_of(2), "row32xr takes rows in pairs") };
        let mut out = [0f32; R];
        for i in (0..R).step_by(2) {
            (out[i], out[i + 1]) = row32x2::<F>(w, r[i], r[i + 1], t);
        }
        out
    }

    /// R activation rows one at a time (`row_q4k`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn row_q4k_xr<const R: usize>(w: &[u8], r: &[ActRow<'_>; R], t: &[f32; 65536]) -> [f32; R] {
        r.map(|a| row_q4k(w, a, t))
    }

    /// R activation rows one at a time (`row_q6k`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn row_q6k_xr<const R: usize>(w: &[u8], r: &[ActRow<'_>; R], t: &[f32; 65536]) -> [f32; R] {
        r.map(|a| row_q6k(w, a, t))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn row_q4k(w: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> f32 {
        let m4 = _mm256_set1_epi8(15);
        let (mut acc, mut macc) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (((blk, q), sums), &da) in w.chunks_exact(144).zip(a.q.chunks_exact(256)).zip(a.sums.chunks_exact(8)).zip(a.d) {
            let (sc, mn) = k4_packed(blk);
            // Sub-block j's scale as i16 in every lane.
            let scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let mut iacc = _mm256_setzero_si256();
            for c in 0..4 {
                let y = ld256(blk, 16 + 32 * c);
                let lo = _mm256_maddubs_epi16(_mm256_and_si256(y, m4), ld256q(q, 64 * c));
                let hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16::<4>(y), m4), ld256q(q, 64 * c + 32));
                let (j0, j1) = (4 * c as i16, 4 * c as i16 + 2);
                let s0 = _mm256_shuffle_epi8(scv, _mm256_set1_epi16(j0 | (j0 + 1) << 8));
                let s1 = _mm256_shuffle_epi8(scv, _mm256_set1_epi16(j1 | (j1 + 1) << 8));
                iacc = _mm256_add_epi32(iacc, _mm256_add_epi32(_mm256_madd_epi16(lo, s0), _mm256_madd_epi16(hi, s1)));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), _mm256_set1_ps(t[u16_at(blk, 0) as usize] * da), acc);
            let mins = _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64)), ld256i(sums, 0));
            macc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(t[u16_at(blk, 2) as usize] * da), macc);
        }
        hsum(acc) - hsum(macc)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn row_q6k(w: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> f32 {
        let m4 = _mm256_set1_epi8(15);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = _mm256_setzero_ps();
        for (((blk, q), sums), &da) in w.chunks_exact(210).zip(a.q.chunks_exact(256)).zip(a.sums.chunks_exact(16)).zip(a.d) {
            let sc = ld128(blk, 192);
            // q is stored as q + 32: start from −32 · Σ scale · group sum.
            let c0 = _mm256_mullo_epi32(_mm256_cvtepi8_epi32(sc), ld256i(sums, 0));
            let c1 = _mm256_mullo_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc)), ld256i(sums, 8));
            let mut iacc = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<5>(_mm256_add_epi32(c0, c1)));
            for h in 0..2 {
                let lo = ld256(blk, 64 * h);
                let hi = ld256(blk, 64 * h + 32);
                let qh = ld256(blk, 128 + 32 * h);
                let v = [
                    _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_and_si256(_mm256_slli_epi16::<4>(qh), m30)),
                    _mm256_or_si256(_mm256_and_si256(hi, m4), _mm256_and_si256(_mm256_slli_epi16::<2>(qh), m30)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(lo), m4), _mm256_and_si256(qh, m30)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(hi), m4), _mm256_and_si256(_mm256_srli_epi16::<2>(qh), m30)),
                ];
                for (j, &vj) in v.iter().enumerate() {
                    let p = _mm256_maddubs_epi16(vj, ld256q(q, 128 * h + 32 * j));
                    // Scales of groups g, g+1 as 8 × i16 each.
                    let g = (8 * h + 2 * j) as i8;
                    let ctrl = _mm_setr_epi8(g, g, g, g, g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1);
                    let s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, ctrl));
                    iacc = _mm256_add_epi32(iacc, _mm256_madd_epi16(p, s));
                }
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc), _mm256_set1_ps(t[u16_at(blk, 208) as usize] * da), acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn chunk(f: QFormat, w: &[u8], rb: usize, act: &Act, dst: &mut [&mut [f32]]) {
        match code(f) {
            Q4_0 => chunk_f::<Q4_0>(w, rb, act, dst),
            Q4_1 => chunk_f::<Q4_1>(w, rb, act, dst),
            Q5_0 => chunk_f::<Q5_0>(w, rb, act, dst),
            Q5_1 => chunk_f::<Q5_1>(w, rb, act, dst),
            Q8_0 => chunk_f::<Q8_0>(w, rb, act, dst),
            Q4K => chunk_f::<Q4K>(w, rb, act, dst),
            _ => chunk_f::<Q6K>(w, rb, act, dst),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::avx2::{hsum, ld128, ld256, ld256f, ld256i, ld256q};
    use super::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn ld512q(q: &[i8], off: usize) -> __m512i {
        let s = &q[off..off + 64];
        // SAFETY: `s` holds 64 readable bytes; loadu has no alignment needs.
        unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn ld512(b: &[u8], off: usize) -> __m512i {
        let s = &b[off..off + 64];
        // SAFETY: `s` holds 64 readable bytes.
        unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn ld512i(v: &[i32], off: usize) -> __m512i {
        let s = &v[off..off + 16];
        // SAFETY: `s` holds 16 readable i32.
        unsafe { _mm512_loadu_si512(s.as_ptr().cast()) }
    }

    /// One 32-element block (`w`) · its activations: int32 in 8 lanes (the
    /// odd block left over by `row32w` and `row32wc2`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn block_dot<const F: u8>(w: &[u8], q: &[i8], corr: &[i32]) -> __m256i {
        dot_u::<F>(unpack::<F>(w), q, corr)
    }

    /// A block's 32 weights as unsigned bytes (Q8_0 read as w + 128;
    /// `corr` removes 128·Σa).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn unpack<const F: u8>(w: &[u8]) -> __m256i {
        if F == Q8_0 {
            _mm256_xor_si256(ld256(w, 2), _mm256_set1_epi8(-128))
        } else {
            let x = ld128(w, qs_offset(F));
            let u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(x), x), _mm256_set1_epi8(15));
            if is_q5(F) {
                _mm256_mask_add_epi8(u, u32_at(w, qh_offset(F)), u, _mm256_set1_epi8(16))
            } else {
                u
            }
        }
    }

    /// Unpacked weights (`unpack`) · a block's activations, int32 in 8 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn dot_u<const F: u8>(u: __m256i, q: &[i8], corr: &[i32]) -> __m256i {
        let c = if has_min(F) { _mm256_setzero_si256() } else { ld256i(corr, 0) };
        _mm256_dpbusd_epi32(c, u, ld256q(q, 0))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn ld512f(v: &[f32]) -> __m512 {
        let s = &v[..16];
        // SAFETY: `s` holds 16 readable f32.
        unsafe { _mm512_loadu_ps(s.as_ptr()) }
    }

    /// Two consecutive blocks' 64 weights (`w`: both blocks) as `unpack`
    /// gives each: the first block in bytes 0-31, the second in 32-63.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn unpack2<const F: u8>(w: &[u8]) -> __m512i {
        let bb = block_bytes(F);
        if F == Q8_0 {
            let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld256(w, 2)), ld256(w, bb + 2));
            return _mm512_xor_si512(v, _mm512_set1_epi8(-128));
        }
        // Each block's 16 bytes twice, then the second copy's high nibbles.
        let x = _mm256_broadcastsi128_si256(ld128(w, qs_offset(F)));
        let y = _mm256_broadcastsi128_si256(ld128(w, bb + qs_offset(F)));
        let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x), y);
        let v = _mm512_mask_srli_epi16::<4>(v, 0xFF00_FF00, v);
        let u = _mm512_and_si512(v, _mm512_set1_epi8(15));
        if is_q5(F) {
            let hi = u32_at(w, qh_offset(F)) as u64 | (u32_at(w, bb + qh_offset(F)) as u64) << 32;
            _mm512_mask_add_epi8(u, hi, u, _mm512_set1_epi8(16))
        } else {
            u
        }
    }

    /// `unpack2`'s weights · the two blocks' activations: int32, the first
    /// block in lanes 0-7, the second in 8-15 (each as `dot_u` gives it).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn dot_u2<const F: u8>(u: __m512i, q: &[i8], corr: &[i32]) -> __m512i {
        let c = if has_min(F) { _mm512_setzero_si512() } else { ld512i(corr, 0) };
        _mm512_dpbusd_epi32(c, u, ld512q(q, 0))
    }

    /// Two blocks' weight scales: the first's in lanes 0-7, the second's in 8-15.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn scales2<const F: u8>(w: &[u8], t: &[f32; 65536]) -> __m512 {
        let bb = block_bytes(F);
        _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(t[u16_at(w, 0) as usize]), _mm512_set1_ps(t[u16_at(w, bb) as usize]))
    }

    /// The two 256-bit accumulators of `row32` held in one register's
    /// halves: (lanes 0-7, lanes 8-15).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn halves(v: __m512) -> (__m256, __m256) {
        (_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))))
    }

    /// `row32` with each pair of blocks in one 512-bit pass: the even
    /// block's arithmetic in the low lanes, the odd one's in the high, so
    /// every lane does what `row32`'s two accumulators do and the result has
    /// the same bits. On a 2-core Intel Xeon VM (AVX-512 FMAs at twice the
    /// 256-bit rate), in alternated rounds against the 256-bit form, a
    /// decode step's matvecs took 0.88–0.96× the time (medians; one round's
    /// best 1.04×) and two or eight activation rows 0.79–0.86× (as two-row
    /// passes, before `row32xrw`). An earlier two-blocks-a-pass form, with
    /// more shuffles to line the nibbles up, lost by 10–15% on Zen 4, whose
    /// 512-bit operations are two 256-bit halves.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row32w<const F: u8>(w: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> f32 {
        let bb = block_bytes(F);
        let mut acc = _mm512_setzero_ps();
        let (mut m0, mut m1) = (0f32, 0f32);
        let pairs = w
            .chunks_exact(2 * bb)
            .zip(a.q.chunks_exact(64))
            .zip(a.corr.chunks_exact(16))
            .zip(a.db.chunks_exact(16))
            .zip(a.s.chunks_exact(2));
        for ((((wp, qp), cp), dp), sp) in pairs {
            let scale = _mm512_mul_ps(scales2::<F>(wp, t), ld512f(dp));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u2::<F>(unpack2::<F>(wp), qp, cp)), scale, acc);
            if has_min(F) {
                m0 += t[u16_at(wp, 2) as usize] * sp[0];
                m1 += t[u16_at(wp, bb + 2) as usize] * sp[1];
            }
        }
        let (mut acc0, acc1) = halves(acc);
        let nb = w.len() / bb;
        if nb % 2 == 1 {
            let b = nb - 1;
            let wb = &w[b * bb..];
            let scale = _mm256_mul_ps(_mm256_set1_ps(t[u16_at(wb, 0) as usize]), ld256f(&a.db[8 * b..]));
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot::<F>(wb, &a.q[32 * b..], &a.corr[8 * b..])), scale, acc0);
            if has_min(F) {
                m0 += t[u16_at(wb, 2) as usize] * a.s[b];
            }
        }
        hsum(_mm256_add_ps(acc0, acc1)) + (m0 + m1)
    }

    /// `row32w` for two columns of one activation row side by side: two
    /// independent accumulator chains, and the row's activations loaded
    /// once for both (each column with `row32w`'s bits). One column at a
    /// time, a column's short chain of dependent multiply-adds and its final
    /// sum left the core waiting: on a 2-core Intel Xeon VM a 1536 × 576
    /// matvec took 20.4–20.6 µs against 32.5–32.7 (Q4_1) and 18.9–19.3
    /// against 33.4–35.5 (Q5_0), the 49152-row Q8_0 output head 0.72–0.99×
    /// the time (four alternated rounds, best of each round's calls). Four
    /// columns at a time were no faster than two.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row32wc2<const F: u8>(w0: &[u8], w1: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> (f32, f32) {
        let bb = block_bytes(F);
        let (mut acc_a, mut acc_b) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let (mut ma0, mut ma1, mut mb0, mut mb1) = (0f32, 0f32, 0f32, 0f32);
        let pairs = w0
            .chunks_exact(2 * bb)
            .zip(w1.chunks_exact(2 * bb))
            .zip(a.q.chunks_exact(64))
            .zip(a.corr.chunks_exact(16))
            .zip(a.db.chunks_exact(16))
            .zip(a.s.chunks_exact(2));
        for (((((wa, wb), qp), cp), dp), sp) in pairs {
            let (q, d) = (ld512q(qp, 0), ld512f(dp));
            let c = if has_min(F) { _mm512_setzero_si512() } else { ld512i(cp, 0) };
            acc_a = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, unpack2::<F>(wa), q)),
                _mm512_mul_ps(scales2::<F>(wa, t), d),
                acc_a,
            );
            acc_b = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, unpack2::<F>(wb), q)),
                _mm512_mul_ps(scales2::<F>(wb, t), d),
                acc_b,
            );
            if has_min(F) {
                ma0 += t[u16_at(wa, 2) as usize] * sp[0];
                ma1 += t[u16_at(wa, bb + 2) as usize] * sp[1];
                mb0 += t[u16_at(wb, 2) as usize] * sp[0];
                mb1 += t[u16_at(wb, bb + 2) as usize] * sp[1];
            }
        }
        let ((mut a0, a1), (mut b0, b1)) = (halves(acc_a), halves(acc_b));
        let nb = w0.len() / bb;
        if nb % 2 == 1 {
            let k = nb - 1;
            let (wa, wb) = (&w0[k * bb..], &w1[k * bb..]);
            let db = ld256f(&a.db[8 * k..]);
            let dot = |w: &[u8]| _mm256_cvtepi32_ps(block_dot::<F>(w, &a.q[32 * k..], &a.corr[8 * k..]));
            a0 = _mm256_fmadd_ps(dot(wa), _mm256_mul_ps(_mm256_set1_ps(t[u16_at(wa, 0) as usize]), db), a0);
            b0 = _mm256_fmadd_ps(dot(wb), _mm256_mul_ps(_mm256_set1_ps(t[u16_at(wb, 0) as usize]), db), b0);
            if has_min(F) {
                ma0 += t[u16_at(wa, 2) as usize] * a.s[k];
                mb0 += t[u16_at(wb, 2) as usize] * a.s[k];
            }
        }
        (hsum(_mm256_add_ps(a0, a1)) + (ma0 + ma1), hsum(_mm256_add_ps(b0, b1)) + (mb0 + mb1))
    }

    /// `row32x2` with each pair of blocks in one 512-bit pass, unpacked
    /// once for both activation rows (the same bits, as `row32w`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row32x2w<const F: u8>(w: &[u8], a: ActRow<'_>, b: ActRow<'_>, t: &[f32; 65536]) -> (f32, f32) {
        let bb = block_bytes(F);
        let (mut acc_a, mut acc_b) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let (mut ma0, mut ma1, mut mb0, mut mb1) = (0f32, 0f32, 0f32, 0f32);
        let ra = a.q.chunks_exact(64).zip(a.corr.chunks_exact(16)).zip(a.db.chunks_exact(16)).zip(a.s.chunks_exact(2));
        let rb = b.q.chunks_exact(64).zip(b.corr.chunks_exact(16)).zip(b.db.chunks_exact(16)).zip(b.s.chunks_exact(2));
        for (wp, ((((qa, ca), da), sa), (((qb, cb), db), sb))) in w.chunks_exact(2 * bb).zip(ra.zip(rb)) {
            let u = unpack2::<F>(wp);
            let wd = scales2::<F>(wp, t);
            acc_a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u2::<F>(u, qa, ca)), _mm512_mul_ps(wd, ld512f(da)), acc_a);
            acc_b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u2::<F>(u, qb, cb)), _mm512_mul_ps(wd, ld512f(db)), acc_b);
            if has_min(F) {
                let (m_even, m_odd) = (t[u16_at(wp, 2) as usize], t[u16_at(wp, bb + 2) as usize]);
                ma0 += m_even * sa[0];
                mb0 += m_even * sb[0];
                ma1 += m_odd * sa[1];
                mb1 += m_odd * sb[1];
            }
        }
        let ((mut a0, a1), (mut b0, b1)) = (halves(acc_a), halves(acc_b));
        let nb = w.len() / bb;
        if nb % 2 == 1 {
            let k = nb - 1;
            let wb = &w[k * bb..];
            let u = unpack::<F>(wb);
            let wd = _mm256_set1_ps(t[u16_at(wb, 0) as usize]);
            a0 = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(dot_u::<F>(u, &a.q[32 * k..], &a.corr[8 * k..])),
                _mm256_mul_ps(wd, ld256f(&a.db[8 * k..])),
                a0,
            );
            b0 = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(dot_u::<F>(u, &b.q[32 * k..], &b.corr[8 * k..])),
                _mm256_mul_ps(wd, ld256f(&b.db[8 * k..])),
                b0,
            );
            if has_min(F) {
                let m = t[u16_at(wb, 2) as usize];
                ma0 += m * a.s[k];
                mb0 += m * b.s[k];
            }
        }
        (hsum(_mm256_add_ps(a0, a1)) + (ma0 + ma1), hsum(_mm256_add_ps(b0, b1)) + (mb0 + mb1))
    }

    /// `row32w` for R activation rows: each pair of weight blocks is
    /// unpacked once for the R, and each row's sums run in `row32w`'s
    /// order, so a row has the bits it has alone. `sr[b]` holds the rows'
    /// block-b min terms (Q4_1, Q5_1), summed lane by lane as `row32w`'s
    /// scalars.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row32xrw<const F: u8, const R: usize>(w: &[u8], r: &[ActRow<'_>; R], sr: &[[f32; R]], t: &[f32; 65536]) -> [f32; R] {
        let bb = block_bytes(F);
        let nb = w.len() / bb;
        // Every row holds nb blocks' activations: the loads below read
        // within them without a check per load.
        assert!(r.iter().all(|row| row.q.len() >= 32 * nb
            && row.corr.len() >= 8 * nb
            && row.db.len() >= 8 * nb
            && sr.len() >= if has_min(F) { nb } else { 0 }));
        let mut acc = [_mm512_setzero_ps(); R];
        let (mut m0, mut m1) = ([0f32; R], [0f32; R]);
        for (p, wp) in w.chunks_exact(2 * bb).enumerate() {
            let u = unpack2::<F>(wp);
            let wd = scales2::<F>(wp, t);
            for (a, row) in acc.iter_mut().zip(r) {
                // SAFETY: pair p < nb / 2, so these 64 bytes, 16 i32 and 16
                // f32 lie within the row (the assert above).
                let (q, c, d) = unsafe {
                    (
                        _mm512_loadu_si512(row.q.as_ptr().add(64 * p).cast()),
                        if has_min(F) { _mm512_setzero_si512() } else { _mm512_loadu_si512(row.corr.as_ptr().add(16 * p).cast()) },
                        _mm512_loadu_ps(row.db.as_ptr().add(16 * p)),
                    )
                };
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, u, q)), _mm512_mul_ps(wd, d), *a);
            }
            if has_min(F) {
                let (me, mo) = (t[u16_at(wp, 2) as usize], t[u16_at(wp, bb + 2) as usize]);
                let (se, so) = (&sr[2 * p], &sr[2 * p + 1]);
                for i in 0..R {
                    m0[i] += me * se[i];
                    m1[i] += mo * so[i];
                }
            }
        }
        let mut lo = acc.map(|v| halves(v).0);
        let hi = acc.map(|v| halves(v).1);
        if nb % 2 == 1 {
            let b = nb - 1;
            let wb = &w[b * bb..];
            let u = unpack::<F>(wb);
            let wd = _mm256_set1_ps(t[u16_at(wb, 0) as usize]);
            for (a, row) in lo.iter_mut().zip(r) {
                let dot = dot_u::<F>(u, &row.q[32 * b..], &row.corr[8 * b..]);
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(wd, ld256f(&row.db[8 * b..])), *a);
            }
            if has_min(F) {
                let me = t[u16_at(wb, 2) as usize];
                for i in 0..R {
                    m0[i] += me * sr[b][i];
                }
            }
        }
        let mut out = [0f32; R];
        for i in 0..R {
            out[i] = hsum(_mm256_add_ps(lo[i], hi[i])) + (m0[i] + m1[i]);
        }
        out
    }

    chunk_fns!(
        "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
        row32w,
        row32wc2,
        row32x2w,
        row32xrw,
        row_q4k,
        row_q6k,
        row_q4k_c2,
        row_q6k_c2,
        row_q4k_xr,
        row_q6k_xr
    );

    /// Sub-block scale (i16) for each half of a Q4_K 64-element chunk.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn q4k_sidx() -> [__m512i; 4] {
        [0i16, 1, 2, 3].map(|c| _mm512_inserti64x4::<1>(_mm512_set1_epi16(2 * c), _mm256_set1_epi16(2 * c + 1)))
    }

    /// One Q4_K block against its activations (`q`: 256, `sums`: 8, `da`
    /// their scale) into a column's accumulators.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    fn q4k_step(blk: &[u8], q: &[i8], sums: &[i32], da: f32, t: &[f32; 65536], sidx: &[__m512i; 4], acc: &mut __m512, macc: &mut __m256) {
        let m4 = _mm512_set1_epi8(15);
        let (sc, mn) = k4_packed(blk);
        let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let mut iacc = _mm512_setzero_si512();
        for (c, &idx) in sidx.iter().enumerate() {
            let y = ld256(blk, 16 + 32 * c);
            let z = _mm512_and_si512(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(y), _mm256_srli_epi16::<4>(y)), m4);
            let p = _mm512_maddubs_epi16(z, ld512q(q, 64 * c));
            iacc = _mm512_add_epi32(iacc, _mm512_madd_epi16(p, _mm512_permutexvar_epi16(idx, sc16)));
        }
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_set1_ps(t[u16_at(blk, 0) as usize] * da), *acc);
        let mins = _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64)), ld256i(sums, 0));
        *macc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(t[u16_at(blk, 2) as usize] * da), *macc);
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row_q4k(w: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> f32 {
        let sidx = q4k_sidx();
        let (mut acc, mut macc) = (_mm512_setzero_ps(), _mm256_setzero_ps());
        for (((blk, q), sums), &da) in w.chunks_exact(144).zip(a.q.chunks_exact(256)).zip(a.sums.chunks_exact(8)).zip(a.d) {
            q4k_step(blk, q, sums, da, t, &sidx, &mut acc, &mut macc);
        }
        _mm512_reduce_add_ps(acc) - hsum(macc)
    }

    /// Two columns one after the other (`row_q4k`). Side by side, as
    /// `row_q6k_c2`, measured slower on a 2-core Intel Xeon VM (a 1536 ×
    /// 1536 matvec 56–106 µs against 45–61, four alternated rounds).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row_q4k_c2(w0: &[u8], w1: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> (f32, f32) {
        (row_q4k(w0, a, t), row_q4k(w1, a, t))
    }

    /// Scale (i16) of each 16-element group of a Q6_K 64-element run:
    /// groups 4r..4r+4.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn q6k_gidx() -> [__m512i; 4] {
        [0i16, 1, 2, 3].map(|r| {
            let g = 4 * r;
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(g + 1), _mm_set1_epi16(g))),
                _mm256_set_m128i(_mm_set1_epi16(g + 3), _mm_set1_epi16(g + 2)),
            )
        })
    }

    /// One Q6_K block against its activations (`q`: 256, `sums`: 16, `da`
    /// their scale) into a column's accumulator.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn q6k_step(blk: &[u8], q: &[i8], sums: &[i32], da: f32, t: &[f32; 65536], gidx: &[__m512i; 4], acc: &mut __m512) {
        let m4 = _mm512_set1_epi8(15);
        let m30 = _mm512_set1_epi8(0x30);
        let scb = ld128(blk, 192);
        let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(scb));
        // q is stored as q + 32: start from −32 · Σ scale · group sum.
        let corr = _mm512_mullo_epi32(_mm512_cvtepi8_epi32(scb), ld512i(sums, 0));
        let mut iacc = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<5>(corr));
        for h in 0..2 {
            let ql = ld512(blk, 64 * h);
            let qh = ld256(blk, 128 + 32 * h);
            let hh = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), _mm256_srli_epi16::<2>(qh));
            // Elements 128h + 0..64, then 128h + 64..128.
            let v1 = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_slli_epi16::<4>(hh), m30));
            let v2 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4), _mm512_and_si512(hh, m30));
            let p1 = _mm512_maddubs_epi16(v1, ld512q(q, 128 * h));
            let p2 = _mm512_maddubs_epi16(v2, ld512q(q, 128 * h + 64));
            iacc = _mm512_add_epi32(iacc, _mm512_madd_epi16(p1, _mm512_permutexvar_epi16(gidx[2 * h], sc16)));
            iacc = _mm512_add_epi32(iacc, _mm512_madd_epi16(p2, _mm512_permutexvar_epi16(gidx[2 * h + 1], sc16)));
        }
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_set1_ps(t[u16_at(blk, 208) as usize] * da), *acc);
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row_q6k(w: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> f32 {
        let gidx = q6k_gidx();
        let mut acc = _mm512_setzero_ps();
        for (((blk, q), sums), &da) in w.chunks_exact(210).zip(a.q.chunks_exact(256)).zip(a.sums.chunks_exact(16)).zip(a.d) {
            q6k_step(blk, q, sums, da, t, &gidx, &mut acc);
        }
        _mm512_reduce_add_ps(acc)
    }

    /// `row_q6k` for two columns side by side (each with `row_q6k`'s bits):
    /// a 1536 × 1536 matvec 40.7–53.3 µs against 57.6–67.6, the 49152-row
    /// output head 0.66–0.97× the time (four alternated rounds, 2-core Xeon
    /// VM).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row_q6k_c2(w0: &[u8], w1: &[u8], a: ActRow<'_>, t: &[f32; 65536]) -> (f32, f32) {
        let gidx = q6k_gidx();
        let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let blocks = w0.chunks_exact(210).zip(w1.chunks_exact(210)).zip(a.q.chunks_exact(256)).zip(a.sums.chunks_exact(16)).zip(a.d);
        for ((((b0, b1), q), sums), &da) in blocks {
            q6k_step(b0, q, sums, da, t, &gidx, &mut acc0);
            q6k_step(b1, q, sums, da, t, &gidx, &mut acc1);
        }
        (_mm512_reduce_add_ps(acc0), _mm512_reduce_add_ps(acc1))
    }

    /// `row_q4k` for R activation rows: a block's nibbles and scales are
    /// unpacked once for the R; each row's arithmetic is `row_q4k`'s, in
    /// its order (the same bits).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row_q4k_xr<const R: usize>(w: &[u8], r: &[ActRow<'_>; R], t: &[f32; 65536]) -> [f32; R] {
        let m4 = _mm512_set1_epi8(15);
        let sidx = q4k_sidx();
        let nb = w.len() / 144;
        // Every row holds nb blocks' activations: the loads below read
        // within them without a check per load.
        assert!(r.iter().all(|row| row.q.len() >= 256 * nb && row.sums.len() >= 8 * nb && row.d.len() >= nb));
        let mut acc = [_mm512_setzero_ps(); R];
        let mut macc = [_mm256_setzero_ps(); R];
        for (b, blk) in w.chunks_exact(144).enumerate() {
            let (sc, mn) = k4_packed(blk);
            let sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
            let z = [0, 1, 2, 3].map(|c| {
                let y = ld256(blk, 16 + 32 * c);
                _mm512_and_si512(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(y), _mm256_srli_epi16::<4>(y)), m4)
            });
            let s = sidx.map(|idx| _mm512_permutexvar_epi16(idx, sc16));
            let mn32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64));
            let (dw, dm) = (t[u16_at(blk, 0) as usize], t[u16_at(blk, 2) as usize]);
            for ((a, ma), row) in acc.iter_mut().zip(macc.iter_mut()).zip(r) {
                // SAFETY: block b < nb: its 256 bytes, 8 sums and scale lie
                // within the row (the assert above).
                let (q, sums, da) = unsafe {
                    (row.q.as_ptr().add(256 * b), _mm256_loadu_si256(row.sums.as_ptr().add(8 * b).cast()), *row.d.get_unchecked(b))
                };
                let mut iacc = _mm512_setzero_si512();
                for c in 0..4 {
                    // SAFETY: as above, bytes 64c..64c + 64 of the block.
                    let p = _mm512_maddubs_epi16(z[c], unsafe { _mm512_loadu_si512(q.add(64 * c).cast()) });
                    iacc = _mm512_add_epi32(iacc, _mm512_madd_epi16(p, s[c]));
                }
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_set1_ps(dw * da), *a);
                let mins = _mm256_mullo_epi32(mn32, sums);
                *ma = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(dm * da), *ma);
            }
        }
        let mut out = [0f32; R];
        for i in 0..R {
            out[i] = _mm512_reduce_add_ps(acc[i]) - hsum(macc[i]);
        }
        out
    }

    /// `row_q6k` for R activation rows, a block unpacked once for the R
    /// (the same bits per row, as `row_q4k_xr`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    fn row_q6k_xr<const R: usize>(w: &[u8], r: &[ActRow<'_>; R], t: &[f32; 65536]) -> [f32; R] {
        let m4 = _mm512_set1_epi8(15);
        let m30 = _mm512_set1_epi8(0x30);
        let gidx = q6k_gidx();
        let nb = w.len() / 210;
        // As in `row_q4k_xr`.
        assert!(r.iter().all(|row| row.q.len() >= 256 * nb && row.sums.len() >= 16 * nb && row.d.len() >= nb));
        let mut acc = [_mm512_setzero_ps(); R];
        for (b, blk) in w.chunks_exact(210).enumerate() {
            let scb = ld128(blk, 192);
            let sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(scb));
            let sc32 = _mm512_cvtepi8_epi32(scb);
            let g = gidx.map(|idx| _mm512_permutexvar_epi16(idx, sc16));
            // Elements 128h + 0..64 (v[2h]), then 128h + 64..128 (v[2h + 1]).
            let v = [0, 1, 2, 3].map(|i| {
                let h = i / 2;
                let ql = ld512(blk, 64 * h);
                let qh = ld256(blk, 128 + 32 * h);
                let hh = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(qh), _mm256_srli_epi16::<2>(qh));
                if i % 2 == 0 {
                    _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_slli_epi16::<4>(hh), m30))
                } else {
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4), _mm512_and_si512(hh, m30))
                }
            });
            let dw = t[u16_at(blk, 208) as usize];
            for (a, row) in acc.iter_mut().zip(r) {
                // SAFETY: block b < nb: its 256 bytes, 16 sums and scale lie
                // within the row (the assert above).
                let (q, sums, da) = unsafe {
                    (row.q.as_ptr().add(256 * b), _mm512_loadu_si512(row.sums.as_ptr().add(16 * b).cast()), *row.d.get_unchecked(b))
                };
                let corr = _mm512_mullo_epi32(sc32, sums);
                let mut iacc = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<5>(corr));
                for h in 0..2 {
                    // SAFETY: as above, bytes 128h..128h + 128 of the block.
                    let (q1, q2) = unsafe { (_mm512_loadu_si512(q.add(128 * h).cast()), _mm512_loadu_si512(q.add(128 * h + 64).cast())) };
                    let p1 = _mm512_maddubs_epi16(v[2 * h], q1);
                    let p2 = _mm512_maddubs_epi16(v[2 * h + 1], q2);
                    iacc = _mm512_add_epi32(iacc, _mm512_madd_epi16(p1, g[2 * h]));
                    iacc = _mm512_add_epi32(iacc, _mm512_madd_epi16(p2, g[2 * h + 1]));
                }
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc), _mm512_set1_ps(dw * da), *a);
            }
        }
        let mut out = [0f32; R];
        for i in 0..R {
            out[i] = _mm512_reduce_add_ps(acc[i]);
        }
        out
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) fn chunk(f: QFormat, w: &[u8], rb: usize, act: &Act, dst: &mut [&mut [f32]]) {
        match code(f) {
            Q4_0 => chunk_f::<Q4_0>(w, rb, act, dst),
            Q4_1 => chunk_f::<Q4_1>(w, rb, act, dst),
            Q5_0 => chunk_f::<Q5_0>(w, rb, act, dst),
            Q5_1 => chunk_f::<Q5_1>(w, rb, act, dst),
            Q8_0 => chunk_f::<Q8_0>(w, rb, act, dst),
            Q4K => chunk_f::<Q4K>(w, rb, act, dst),
            _ => chunk_f::<Q6K>(w, rb, act, dst),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The activation quantisation against the plain form it replaced
    /// (f32::round, a sequential max): the same bytes, scales and sums on
    /// rows with exact halves after scaling, zeros, signed zeros, NaN and
    /// infinities, in both block sizes.
    #[test]
    fn act_quantisation_matches_plain_rounding() {
        let mut x = 0x9E37_79B9u32;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        };
        for f in [QFormat::Q4_1, QFormat::Q4_0, QFormat::Q8_0, QFormat::Q4K, QFormat::Q6K] {
            for case in 0..40 {
                let k = 512;
                let mut row: Vec<f32> = (0..k).map(|_| (next() % 20_001) as f32 / 100.0 - 100.0).collect();
                if case % 4 == 1 {
                    // Values whose scaled form ends in .5: the block maximum
                    // 127, the rest halves.
                    for (i, v) in row.iter_mut().enumerate() {
                        *v = if i % 32 == 0 { 127.0 } else { (next() % 254) as f32 / 2.0 - 63.5 };
                    }
                }
                if case % 4 == 2 {
                    row[3] = f32::NAN;
                    row[40] = f32::INFINITY;
                    row[300] = f32::NEG_INFINITY;
                    row[64..96].fill(0.0);
                    row[96..128].fill(-0.0);
                    // A block whose scale's inverse overflows.
                    row[128..160].fill(0.0);
                    row[130] = 1e-45;
                    row[131] = -1e-45;
                }
                let (nb, ng) = (k / f.block_elems(), k / sum_group(f));
                let off = lane_offset(f, QPath::Avx512);
                let run = |plain: bool| {
                    let (mut q, mut d, mut s) = (vec![0i8; k], vec![0f32; nb], vec![0f32; nb]);
                    let (mut db, mut sums, mut corr) = (vec![0f32; k / 4], vec![0i32; ng], vec![0i32; k / 4]);
                    if plain {
                        let be = f.block_elems();
                        for (((xb, qb), dv), sv) in row.chunks_exact(be).zip(q.chunks_exact_mut(be)).zip(d.iter_mut()).zip(s.iter_mut()) {
                            let amax = xb.iter().fold(0f32, |a, &v| if v.abs() > a || v.is_nan() { v.abs() } else { a });
                            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                            let mut total = 0i32;
                            for (qv, &xv) in qb.iter_mut().zip(xb) {
                                *qv = (xv * inv).round().clamp(-127.0, 127.0) as i8;
                                total += *qv as i32;
                            }
                            *dv = amax / 127.0;
                            *sv = *dv * total as f32;
                        }
                    } else {
                        quantize_act_row(f, off, &row, &mut q, &mut d, &mut s, &mut db, &mut sums, &mut corr);
                    }
                    (q, d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), s.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
                };
                assert_eq!(run(false), run(true), "{f} case {case}");
            }
        }
    }
}
