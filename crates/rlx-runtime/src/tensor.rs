use half::{bf16, f16};
use rlx_ir::{DType, Shape};

use crate::{Result, RuntimeError};

/// A host tensor: shape, dtype and little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Shape,
    dtype: DType,
    data: Vec<u8>,
}

macro_rules! typed {
    ($from:ident, $to:ident, $as:ident, $t:ty, $dt:expr) => {
        pub fn $from(shape: impl Into<Shape>, values: &[$t]) -> Result<Tensor> {
            Tensor::from_bytes(shape, $dt, bytemuck::cast_slice(values).to_vec())
        }
        /// The data as this type; an error if the dtype differs.
        pub fn $as(&self) -> Result<Vec<$t>> {
            if self.dtype != $dt {
                return Err(RuntimeError::Tensor(format!("expected a {} tensor, found {}", $dt, self.dtype)));
            }
            Ok(bytemuck::pod_collect_to_vec(&self.data))
        }
    };
}

impl Tensor {
    /// A tensor from raw bytes; the length must match shape and dtype.
    pub fn from_bytes(shape: impl Into<Shape>, dtype: DType, data: Vec<u8>) -> Result<Tensor> {
        let shape = shape.into();
        let want = shape.numel() * dtype.size();
        if data.len() != want {
            return Err(RuntimeError::Tensor(format!("{} bytes given for a {shape} {dtype} tensor (expected {want})", data.len())));
        }
        Ok(Tensor { shape, dtype, data })
    }

    pub fn zeros(shape: impl Into<Shape>, dtype: DType) -> Tensor {
        let shape = shape.into();
        let n = shape.numel() * dtype.size();
        Tensor { shape, dtype, data: vec![0; n] }
    }

    typed!(from_f32, to_f32_exact, as_f32, f32, DType::F32);
    typed!(from_f16, to_f16_exact, as_f16, f16, DType::F16);
    typed!(from_bf16, to_bf16_exact, as_bf16, bf16, DType::BF16);
    typed!(from_i32, to_i32_exact, as_i32, i32, DType::I32);
    typed!(from_i64, to_i64_exact, as_i64, i64, DType::I64);

    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }
    pub fn into_bytes(self) -> Vec<u8> {
        self.data
    }
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// Same data, new shape of the same element count.
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.shape.numel() {
            return Err(RuntimeError::Tensor(format!("cannot reshape {} to {shape}", self.shape)));
        }
        Ok(Tensor { shape, ..self })
    }

    /// Values as i32: i32 data as is, anything else converted like
    /// [`to_dtype`](Self::to_dtype).
    pub fn to_i32(&self) -> Vec<i32> {
        let t = self.to_dtype(DType::I32);
        t.data.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// Values as f32 whatever the dtype (ints converted).
    pub fn to_f32(&self) -> Vec<f32> {
        let d = &self.data;
        match self.dtype {
            DType::F32 => bytemuck::pod_collect_to_vec(d),
            DType::F16 => d.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::BF16 => d.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::I32 => d.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect(),
            DType::I64 => d.chunks_exact(8).map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f32).collect(),
            DType::U8 => d.iter().map(|&b| b as f32).collect(),
        }
    }

    /// Converts to another dtype (floats round to nearest; float → int
    /// truncates toward zero; i64 → i32 saturates, so an id too large for
    /// i32 stays out of range instead of wrapping to a valid-looking one).
    pub fn to_dtype(&self, to: DType) -> Tensor {
        if to == self.dtype {
            return self.clone();
        }
        let data: Vec<u8> = match (self.dtype, to) {
            (DType::I64, DType::I32) => self
                .data
                .chunks_exact(8)
                .flat_map(|c| {
                    (i64::from_le_bytes(c.try_into().unwrap_or([0; 8])).clamp(i32::MIN as i64, i32::MAX as i64) as i32).to_le_bytes()
                })
                .collect(),
            (DType::I32, DType::I64) => {
                self.data.chunks_exact(4).flat_map(|c| (i32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as i64).to_le_bytes()).collect()
            }
            _ => {
                let v = self.to_f32();
                match to {
                    DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    DType::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
                    DType::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
                    DType::I32 => v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
                    DType::I64 => v.iter().flat_map(|x| (*x as i64).to_le_bytes()).collect(),
                    DType::U8 => v.iter().map(|x| *x as u8).collect(),
                }
            }
        };
        Tensor { shape: self.shape.clone(), dtype: to, data }
    }
}
