//! Block-quantized weight formats (GGML's), as stored in GGUF files.
//!
//! A quantized matrix is stored row by row; each row of `k` elements is
//! `k / block_elems` blocks of `block_bytes` bytes. In the IR such a weight is
//! a `U8` param of shape `[rows, row_bytes]`, read by [`crate::Op::QMatMul`]
//! and [`crate::Op::QGather`], which carry the format.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum QFormat {
    /// 32 elements: f16 d, 16 bytes of 4-bit q; w = d·(q − 8).
    Q4_0,
    /// 32 elements: f16 d, f16 m, 16 bytes of 4-bit q; w = d·q + m.
    Q4_1,
    /// 32 elements: f16 d, 4 bytes of high bits, 16 bytes of low nibbles; w = d·(q − 16).
    Q5_0,
    /// 32 elements: f16 d, f16 m, 4 bytes of high bits, 16 bytes of low nibbles; w = d·q + m.
    Q5_1,
    /// 32 elements: f16 d, 32 × i8; w = d·q.
    Q8_0,
    /// 256 elements: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and
    /// mins, 128 bytes of 4-bit q; 8 sub-blocks of 32.
    Q4K,
    /// 256 elements: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 × i8
    /// sub-block scales, f16 d; 16 sub-blocks of 16; w = d·scale·(q − 32).
    Q6K,
}

impl QFormat {
    pub const ALL: [QFormat; 7] = [QFormat::Q4_0, QFormat::Q4_1, QFormat::Q5_0, QFormat::Q5_1, QFormat::Q8_0, QFormat::Q4K, QFormat::Q6K];

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            QFormat::Q4K | QFormat::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QFormat::Q4_0 => 18,
            QFormat::Q4_1 => 20,
            QFormat::Q5_0 => 22,
            QFormat::Q5_1 => 24,
            QFormat::Q8_0 => 34,
            QFormat::Q4K => 144,
            QFormat::Q6K => 210,
        }
    }

    /// Bytes of one row of `k` elements, or `None` when `k` is not a whole
    /// number of blocks.
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        k.is_multiple_of(self.block_elems()).then(|| k / self.block_elems() * self.block_bytes())
    }

    /// The GGML type id (as in GGUF tensor infos).
    pub fn ggml_type(self) -> u32 {
        match self {
            QFormat::Q4_0 => 2,
            QFormat::Q4_1 => 3,
            QFormat::Q5_0 => 6,
            QFormat::Q5_1 => 7,
            QFormat::Q8_0 => 8,
            QFormat::Q4K => 12,
            QFormat::Q6K => 14,
        }
    }

    pub fn from_ggml_type(t: u32) -> Option<QFormat> {
        QFormat::ALL.into_iter().find(|f| f.ggml_type() == t)
    }

    pub fn name(self) -> &'static str {
        match self {
            QFormat::Q4_0 => "q4_0",
            QFormat::Q4_1 => "q4_1",
            QFormat::Q5_0 => "q5_0",
            QFormat::Q5_1 => "q5_1",
            QFormat::Q8_0 => "q8_0",
            QFormat::Q4K => "q4_k",
            QFormat::Q6K => "q6_k",
        }
    }
}

impl fmt::Display for QFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
