//! Storage element types. Kernels compute in f32 and convert at the edges:
//! `load` a row to f32 scratch, work, `store` it back.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rlx_ir::DType;

pub trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    fn load(src: &[Self], dst: &mut [f32]);
    fn store(src: &[f32], dst: &mut [Self]);
    /// The slice itself when it already holds f32.
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    /// The slice itself when it holds f16.
    fn as_f16(_: &[Self]) -> Option<&[f16]> {
        None
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn as_f32(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    #[inline(always)]
    fn load(src: &[f16], dst: &mut [f32]) {
        // half uses F16C at run time where the CPU has it.
        src.convert_to_f32_slice(dst);
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }
    #[inline(always)]
    fn as_f16(s: &[f16]) -> Option<&[f16]> {
        Some(s)
    }
}

impl Elem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    #[inline(always)]
    fn load(src: &[bf16], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift, which vectorises.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline(always)]
    fn store(src: &[f32], dst: &mut [bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_f32(*s);
        }
    }
}

/// Runs `$body` with `$T` bound to the storage type of a float dtype;
/// other dtypes make the enclosing function return an error.
macro_rules! with_float {
    ($dt:expr, $T:ident => $body:expr) => {
        match $dt {
            rlx_ir::DType::F32 => {
                type $T = f32;
                $body
            }
            rlx_ir::DType::F16 => {
                type $T = half::f16;
                $body
            }
            rlx_ir::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            other => return Err(crate::exec_err(format!("expected a float dtype (f32, f16, bf16), found {other}"))),
        }
    };
}
pub(crate) use with_float;

/// Reads an integer id or position of either int dtype as i64.
#[inline(always)]
pub fn read_int(src: &crate::memory::Src<u8>, dtype: DType, i: usize) -> i64 {
    let es = dtype.size();
    let b = src.row(i * es, es);
    match dtype {
        DType::I64 => i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
        _ => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
    }
}
