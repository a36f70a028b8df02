//! A small GGUF writer for tests: builds files in memory, with the byte
//! offset of every field recorded so tests can corrupt exactly one of them.
//! Written from the format description, independently of the reader (its
//! own type ids and block sizes), so a wrong id in one shows up as a failure.
#![allow(dead_code)]

use rlx_models::gguf::{GgufArray, GgufValue};

pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// On-disk id of a metadata value's type.
pub fn value_type_id(v: &GgufValue) -> u32 {
    match v {
        GgufValue::U8(_) => 0,
        GgufValue::I8(_) => 1,
        GgufValue::U16(_) => 2,
        GgufValue::I16(_) => 3,
        GgufValue::U32(_) => 4,
        GgufValue::I32(_) => 5,
        GgufValue::F32(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array(_) => 9,
        GgufValue::U64(_) => 10,
        GgufValue::I64(_) => 11,
        GgufValue::F64(_) => 12,
    }
}

fn array_elem_type_id(a: &GgufArray) -> u32 {
    match a {
        GgufArray::U8(_) => 0,
        GgufArray::I8(_) => 1,
        GgufArray::U16(_) => 2,
        GgufArray::I16(_) => 3,
        GgufArray::U32(_) => 4,
        GgufArray::I32(_) => 5,
        GgufArray::F32(_) => 6,
        GgufArray::Bool(_) => 7,
        GgufArray::String(_) => 8,
        GgufArray::Array(_) => 9,
        GgufArray::U64(_) => 10,
        GgufArray::I64(_) => 11,
        GgufArray::F64(_) => 12,
    }
}

/// A value's bytes without its type id.
pub fn put_value_body(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => put_str(out, s),
        GgufValue::Array(a) => put_array(out, a),
    }
}

/// An array's element type, count and elements.
pub fn put_array(out: &mut Vec<u8>, a: &GgufArray) {
    put_u32(out, array_elem_type_id(a));
    put_u64(out, a.len() as u64);
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => out.extend_from_slice(v),
        GgufArray::I8(v) => each!(v),
        GgufArray::U16(v) => each!(v),
        GgufArray::I16(v) => each!(v),
        GgufArray::U32(v) => each!(v),
        GgufArray::I32(v) => each!(v),
        GgufArray::U64(v) => each!(v),
        GgufArray::I64(v) => each!(v),
        GgufArray::F32(v) => each!(v),
        GgufArray::F64(v) => each!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        GgufArray::String(v) => v.iter().for_each(|s| put_str(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|a| put_array(out, a)),
    }
}

/// (elements per block, bytes per block) of the GGML types the tests use.
pub fn ggml_block(ggml_type: u32) -> Option<(u64, u64)> {
    Some(match ggml_type {
        0 => (1, 4),
        1 | 30 => (1, 2),
        2 => (32, 18),
        3 => (32, 20),
        6 => (32, 22),
        7 => (32, 24),
        8 => (32, 34),
        12 => (256, 144),
        14 => (256, 210),
        _ => return None,
    })
}

/// Bytes of a tensor of `dims` (GGUF order); 0 for types without a block size here.
pub fn ggml_bytes(ggml_type: u32, dims: &[u64]) -> u64 {
    let Some((be, bb)) = ggml_block(ggml_type) else { return 0 };
    let rows: u64 = dims[1..].iter().product();
    dims[0] / be * bb * rows
}

#[derive(Clone, Debug)]
pub struct WTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub data: Vec<u8>,
    /// Written instead of the computed offset when set.
    pub offset: Option<u64>,
}

/// Where each part of a built file starts.
#[derive(Clone, Debug, Default)]
pub struct Layout {
    /// Start of each metadata entry (its key length).
    pub kv_at: Vec<usize>,
    /// Start of each metadata value (its type id).
    pub value_at: Vec<usize>,
    pub tensors: Vec<TensorLayout>,
    pub data_start: usize,
}

#[derive(Clone, Debug, Default)]
pub struct TensorLayout {
    pub info_at: usize,
    pub n_dims_at: usize,
    pub dims_at: usize,
    pub type_at: usize,
    pub offset_at: usize,
    /// Offset written (relative to the data section).
    pub offset: u64,
}

pub const TENSOR_COUNT_AT: usize = 8;
pub const KV_COUNT_AT: usize = 16;

#[derive(Clone, Debug)]
pub struct Writer {
    pub magic: [u8; 4],
    pub version: u32,
    /// Layout alignment; put a `general.alignment` entry in `kvs` to declare it.
    pub alignment: u64,
    pub kvs: Vec<(String, GgufValue)>,
    pub tensors: Vec<WTensor>,
}

impl Default for Writer {
    fn default() -> Self {
        Writer { magic: *b"GGUF", version: 3, alignment: 32, kvs: Vec::new(), tensors: Vec::new() }
    }
}

impl Writer {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn kv(mut self, key: &str, v: GgufValue) -> Self {
        self.kvs.push((key.to_string(), v));
        self
    }

    /// A tensor with `data`.
    pub fn tensor_data(mut self, name: &str, dims: &[u64], ggml_type: u32, data: Vec<u8>) -> Self {
        self.tensors.push(WTensor { name: name.to_string(), dims: dims.to_vec(), ggml_type, data, offset: None });
        self
    }

    /// A tensor of the right size for its type and dims, filled with a
    /// pattern that differs between tensors.
    pub fn tensor(self, name: &str, dims: &[u64], ggml_type: u32) -> Self {
        let n = ggml_bytes(ggml_type, dims) as usize;
        let seed = self.tensors.len() as u8;
        let data = (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed.wrapping_mul(7))).collect();
        self.tensor_data(name, dims, ggml_type, data)
    }

    pub fn build(&self) -> Vec<u8> {
        self.build_with_layout().0
    }

    /// The file and its layout. Tensor data is placed at aligned offsets in
    /// order, with no padding after the last tensor, so every strict prefix
    /// of a file with tensors is incomplete.
    pub fn build_with_layout(&self) -> (Vec<u8>, Layout) {
        let mut out = Vec::new();
        let mut layout = Layout::default();
        out.extend_from_slice(&self.magic);
        put_u32(&mut out, self.version);
        put_u64(&mut out, self.tensors.len() as u64);
        put_u64(&mut out, self.kvs.len() as u64);
        for (k, v) in &self.kvs {
            layout.kv_at.push(out.len());
            put_str(&mut out, k);
            layout.value_at.push(out.len());
            put_u32(&mut out, value_type_id(v));
            put_value_body(&mut out, v);
        }
        let align = |x: u64| x.div_ceil(self.alignment) * self.alignment;
        let mut next = 0u64;
        for t in &self.tensors {
            let mut tl = TensorLayout { info_at: out.len(), ..Default::default() };
            put_str(&mut out, &t.name);
            tl.n_dims_at = out.len();
            put_u32(&mut out, t.dims.len() as u32);
            tl.dims_at = out.len();
            t.dims.iter().for_each(|&d| put_u64(&mut out, d));
            tl.type_at = out.len();
            put_u32(&mut out, t.ggml_type);
            tl.offset_at = out.len();
            let offset = t.offset.unwrap_or_else(|| align(next));
            next = align(next) + t.data.len() as u64;
            put_u64(&mut out, offset);
            tl.offset = offset;
            layout.tensors.push(tl);
        }
        if !self.tensors.is_empty() {
            out.resize(align(out.len() as u64) as usize, 0);
        }
        layout.data_start = align(out.len() as u64) as usize;
        let mut next = 0u64;
        for t in &self.tensors {
            let at = layout.data_start + align(next) as usize;
            out.resize(at, 0);
            out.extend_from_slice(&t.data);
            next = align(next) + t.data.len() as u64;
        }
        (out, layout)
    }
}

/// Overwrites 4 bytes at `at`.
pub fn patch_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Overwrites 8 bytes at `at`.
pub fn patch_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
