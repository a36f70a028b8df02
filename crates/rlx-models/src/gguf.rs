//! A GGUF (version 2 and 3, little-endian) reader.
//!
//! A GGUF file is a header (magic `GGUF`, version, tensor count, metadata
//! count), typed key/value metadata, one info record per tensor (name, dims,
//! GGML type, data offset), then the tensor data, which starts at the first
//! multiple of the alignment (`general.alignment`, default 32) after the infos.
//!
//! The whole header is validated when the file is opened, so a [`GgufFile`]
//! only ever holds consistent data: every length and count is checked against
//! the bytes left in the file before anything is allocated or read, dims and
//! byte sizes are computed with checked arithmetic, and every tensor's data
//! lies inside the file, aligned, and apart from every other tensor's. Bad
//! input yields a [`GgufError`] naming the field, key or tensor and the byte
//! offset; it never panics.
//!
//! ```no_run
//! # fn main() -> Result<(), rlx_models::gguf::GgufError> {
//! let file = rlx_models::gguf::GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf".as_ref())?;
//! let layers = file.get_u32("llama.block_count")?;
//! let embd = file.tensor("token_embd.weight").expect("present");
//! let bytes: &[u8] = file.tensor_data(embd);
//! # let _ = (layers, bytes); Ok(()) }
//! ```

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rlx_ir::QFormat;
use thiserror::Error;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Metadata key that overrides [`DEFAULT_ALIGNMENT`].
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Alignment of the data section and of every tensor's offset when the file
/// does not set `general.alignment`.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest nesting of arrays inside metadata values (an array of scalars is
/// depth 1). Bounds recursion on hostile input.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Most dimensions a tensor may have (GGML's limit).
pub const MAX_DIMS: usize = 4;

/// Smallest possible encoded tensor info: name length (8), n_dims (4), one
/// dim (8), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 32;
/// Smallest possible encoded metadata entry: key length (8), value type (4),
/// a one-byte value.
const MIN_KV_BYTES: u64 = 13;

pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// Everything that can be wrong with a GGUF file or a metadata lookup.
/// Messages say what was expected, what was found and where.
#[derive(Debug, Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// Any other error, for a file opened by path.
    #[error("{path}: {source}")]
    File { path: PathBuf, source: Box<GgufError> },

    #[error("not a GGUF file: the first 4 bytes are {found:02x?}, expected \"GGUF\" [47, 47, 55, 46]")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {found} at offset 4 (this reader accepts versions 2 and 3)")]
    UnsupportedVersion { found: u32 },
    #[error("big-endian GGUF files are not supported (the version field at offset 4 reads {little} little-endian, {big} big-endian)")]
    BigEndian { little: u32, big: u32 },
    #[error("truncated: {field} needs {needed} bytes at offset {offset}, file has {file_len}")]
    Truncated { field: String, needed: u64, offset: u64, file_len: u64 },
    #[error(
        "{field}: count {count} at offset {offset} needs at least {min_elem_bytes} bytes per element, \
         but only {remaining} bytes remain in the file after offset {from}"
    )]
    CountTooLarge { field: String, count: u64, min_elem_bytes: u64, offset: u64, remaining: u64, from: u64 },
    #[error("{field} at offset {offset} is not valid UTF-8: {source}")]
    Utf8 { field: String, offset: u64, source: std::str::Utf8Error },
    #[error("{field} at offset {offset}: unknown metadata value type {found} (expected 0 to 12)")]
    BadValueType { field: String, found: u32, offset: u64 },
    #[error("{field} at offset {offset}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels")]
    TooDeep { field: String, offset: u64 },
    #[error("{field} at offset {offset}: bool byte is {found}, expected 0 or 1")]
    BadBool { field: String, found: u8, offset: u64 },
    #[error("metadata key #{index} at offset {offset} is empty")]
    EmptyKey { index: u64, offset: u64 },
    #[error("duplicate metadata key '{key}': key #{index} at offset {offset} repeats key #{first}")]
    DuplicateKey { key: String, index: u64, first: u64, offset: u64 },
    #[error("{ALIGNMENT_KEY} is {found}, expected a nonzero power of two that fits u32")]
    BadAlignment { found: String },

    #[error("tensor #{index} at offset {offset} has an empty name")]
    EmptyTensorName { index: u64, offset: u64 },
    #[error("duplicate tensor name '{tensor}': tensor #{index} at offset {offset} repeats tensor #{first}")]
    DuplicateTensor { tensor: String, index: u64, first: u64, offset: u64 },
    #[error("tensor {tensor}: n_dims is {n_dims} at offset {offset}, expected 1 to {MAX_DIMS}")]
    BadDimCount { tensor: String, n_dims: u32, offset: u64 },
    #[error("tensor {tensor}: dims {dims:?} has a 0 at index {axis}; every dimension must be at least 1")]
    ZeroDim { tensor: String, dims: Vec<u64>, axis: usize },
    #[error("unsupported GGML type {ggml_type}{name} in tensor {tensor}", name = type_name_suffix(*.ggml_type))]
    UnsupportedType { ggml_type: u32, tensor: String },
    #[error("tensor {tensor}: row length {row} is not a multiple of {format}'s block of {block}")]
    RowNotBlockMultiple { tensor: String, row: u64, format: &'static str, block: u64 },
    #[error("tensor {tensor}: dims {dims:?} of {format} overflow the element count or byte size")]
    TooLarge { tensor: String, dims: Vec<u64>, format: &'static str },
    #[error("tensor {tensor}: data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { tensor: String, offset: u64, alignment: u64 },
    #[error(
        "tensor {tensor}: {bytes} bytes at data offset {offset} (data section starts at {data_start}) \
         run past the end of the file ({file_len} bytes)"
    )]
    OutOfFile { tensor: String, offset: u64, bytes: u64, data_start: u64, file_len: u64 },
    #[error("tensor {tensor}: data bytes {start}..{end} overlap tensor {other}'s bytes {other_start}..{other_end}")]
    Overlap { tensor: String, start: u64, end: u64, other: String, other_start: u64, other_end: u64 },

    #[error("metadata key '{key}' not found")]
    MissingKey { key: String },
    #[error("metadata key '{key}': expected {expected}, found {found}")]
    WrongType { key: String, expected: &'static str, found: String },
}

impl GgufError {
    /// The error without its file-path wrapper ([`GgufError::File`]), for
    /// matching on what went wrong.
    pub fn kind(&self) -> &GgufError {
        match self {
            GgufError::File { source, .. } => source.kind(),
            other => other,
        }
    }
}

fn type_name_suffix(id: u32) -> String {
    ggml_type_name(id).map(|n| format!(" ({n})")).unwrap_or_default()
}

/// Name of every GGML type id GGUF files may carry, including those this
/// reader does not load (for error messages). `None` for ids never assigned
/// or retired.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "f32",
        1 => "f16",
        2 => "q4_0",
        3 => "q4_1",
        6 => "q5_0",
        7 => "q5_1",
        8 => "q8_0",
        9 => "q8_1",
        10 => "q2_k",
        11 => "q3_k",
        12 => "q4_k",
        13 => "q5_k",
        14 => "q6_k",
        15 => "q8_k",
        16 => "iq2_xxs",
        17 => "iq2_xs",
        18 => "iq3_xxs",
        19 => "iq1_s",
        20 => "iq4_nl",
        21 => "iq3_s",
        22 => "iq2_s",
        23 => "iq4_xs",
        24 => "i8",
        25 => "i16",
        26 => "i32",
        27 => "i64",
        28 => "f64",
        29 => "iq1_m",
        30 => "bf16",
        34 => "tq1_0",
        35 => "tq2_0",
        39 => "mxfp4",
        _ => return None,
    })
}

/// Element type of a tensor this reader can load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorType {
    F32,
    F16,
    BF16,
    /// A block-quantized GGML format.
    Quant(QFormat),
}

impl TensorType {
    /// The type for a GGML type id, or `None` when this reader does not
    /// support it.
    pub fn from_ggml_type(id: u32) -> Option<TensorType> {
        match id {
            0 => Some(TensorType::F32),
            1 => Some(TensorType::F16),
            30 => Some(TensorType::BF16),
            _ => QFormat::from_ggml_type(id).map(TensorType::Quant),
        }
    }

    pub fn ggml_type(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::BF16 => 30,
            TensorType::Quant(q) => q.ggml_type(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TensorType::F32 => "f32",
            TensorType::F16 => "f16",
            TensorType::BF16 => "bf16",
            TensorType::Quant(q) => q.name(),
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_elems(self) -> u64 {
        match self {
            TensorType::Quant(q) => q.block_elems() as u64,
            _ => 1,
        }
    }

    /// Bytes per block (the element size for the float types).
    pub fn block_bytes(self) -> u64 {
        match self {
            TensorType::F32 => 4,
            TensorType::F16 | TensorType::BF16 => 2,
            TensorType::Quant(q) => q.block_bytes() as u64,
        }
    }

    /// Bytes of one row of `k` elements; `None` when `k` is not a whole
    /// number of blocks or the size overflows.
    pub fn row_bytes(self, k: u64) -> Option<u64> {
        if !k.is_multiple_of(self.block_elems()) {
            return None;
        }
        (k / self.block_elems()).checked_mul(self.block_bytes())
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` is the innermost (contiguous, row-length)
    /// dimension, the reverse of the usual row-major shape.
    pub dims: Vec<u64>,
    pub ttype: TensorType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub bytes: u64,
}

impl TensorInfo {
    /// Number of elements (product of the dims; saturates for infos not
    /// read from a file, whose dims were never checked).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Elements per row (`dims[0]`).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of `dims[1..]`, saturating).
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> u64 {
        self.ttype.row_bytes(self.row_len()).unwrap_or(0)
    }

    /// The dims in row-major order (outermost first), as RLX shapes are.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }
}

/// The type tag of a metadata value, with its on-disk id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufValueType {
    const ALL: [GgufValueType; 13] = [
        GgufValueType::U8,
        GgufValueType::I8,
        GgufValueType::U16,
        GgufValueType::I16,
        GgufValueType::U32,
        GgufValueType::I32,
        GgufValueType::F32,
        GgufValueType::Bool,
        GgufValueType::String,
        GgufValueType::Array,
        GgufValueType::U64,
        GgufValueType::I64,
        GgufValueType::F64,
    ];

    pub fn from_id(id: u32) -> Option<GgufValueType> {
        GgufValueType::ALL.get(usize::try_from(id).ok()?).copied()
    }

    /// The on-disk id (0 to 12).
    pub fn id(self) -> u32 {
        self as u32
    }

    pub fn name(self) -> &'static str {
        match self {
            GgufValueType::U8 => "u8",
            GgufValueType::I8 => "i8",
            GgufValueType::U16 => "u16",
            GgufValueType::I16 => "i16",
            GgufValueType::U32 => "u32",
            GgufValueType::I32 => "i32",
            GgufValueType::F32 => "f32",
            GgufValueType::Bool => "bool",
            GgufValueType::String => "string",
            GgufValueType::Array => "array",
            GgufValueType::U64 => "u64",
            GgufValueType::I64 => "i64",
            GgufValueType::F64 => "f64",
        }
    }

    /// Fewest bytes one value of this type takes on disk: its size for
    /// scalars, the length prefix for strings, element type + count for
    /// arrays. Bounds element counts before allocating.
    fn min_bytes(self) -> u64 {
        match self {
            GgufValueType::U8 | GgufValueType::I8 | GgufValueType::Bool => 1,
            GgufValueType::U16 | GgufValueType::I16 => 2,
            GgufValueType::U32 | GgufValueType::I32 | GgufValueType::F32 => 4,
            GgufValueType::U64 | GgufValueType::I64 | GgufValueType::F64 | GgufValueType::String => 8,
            GgufValueType::Array => 12,
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(GgufArray),
}

/// A metadata array, stored as one typed vector so that large arrays (a
/// tokenizer's vocabulary, its scores) cost no per-element tag. Elements of
/// an array of arrays may each have their own element type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
}

impl GgufValue {
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::F64(_) => GgufValueType::F64,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(_) => GgufValueType::Array,
        }
    }

    /// The value of any integer type, widened.
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any integer value that fits u32.
    pub fn as_u32(&self) -> Option<u32> {
        self.as_i128().and_then(|v| u32::try_from(v).ok())
    }

    /// Any integer value that fits u64.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer value that fits i64.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// An f32 or f64 value (f64 rounded to f32).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            GgufValue::F32(v) => Some(v),
            GgufValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// An f32 or f64 value.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Short description for messages: type and value, strings cut at 60 chars,
/// arrays as their length and element type.
impl fmt::Display for GgufValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.value_type();
        match self {
            GgufValue::String(s) => {
                let cut: String = s.chars().take(60).collect();
                let more = if cut.len() < s.len() { "…" } else { "" };
                write!(f, "{t} {cut:?}{more}")
            }
            GgufValue::Array(a) => write!(f, "{a}"),
            GgufValue::U8(v) => write!(f, "{t} {v}"),
            GgufValue::I8(v) => write!(f, "{t} {v}"),
            GgufValue::U16(v) => write!(f, "{t} {v}"),
            GgufValue::I16(v) => write!(f, "{t} {v}"),
            GgufValue::U32(v) => write!(f, "{t} {v}"),
            GgufValue::I32(v) => write!(f, "{t} {v}"),
            GgufValue::U64(v) => write!(f, "{t} {v}"),
            GgufValue::I64(v) => write!(f, "{t} {v}"),
            GgufValue::F32(v) => write!(f, "{t} {v}"),
            GgufValue::F64(v) => write!(f, "{t} {v}"),
            GgufValue::Bool(v) => write!(f, "{t} {v}"),
        }
    }
}

impl GgufArray {
    pub fn elem_type(&self) -> GgufValueType {
        match self {
            GgufArray::U8(_) => GgufValueType::U8,
            GgufArray::I8(_) => GgufValueType::I8,
            GgufArray::U16(_) => GgufValueType::U16,
            GgufArray::I16(_) => GgufValueType::I16,
            GgufArray::U32(_) => GgufValueType::U32,
            GgufArray::I32(_) => GgufValueType::I32,
            GgufArray::U64(_) => GgufValueType::U64,
            GgufArray::I64(_) => GgufValueType::I64,
            GgufArray::F32(_) => GgufValueType::F32,
            GgufArray::F64(_) => GgufValueType::F64,
            GgufArray::Bool(_) => GgufValueType::Bool,
            GgufArray::String(_) => GgufValueType::String,
            GgufArray::Array(_) => GgufValueType::Array,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::F64(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            GgufArray::String(v) => Some(v),
            _ => None,
        }
    }

    /// Element `i` of an integer array, widened; `None` for other arrays or
    /// `i` out of range.
    fn int_at(&self, i: usize) -> Option<i128> {
        Some(match self {
            GgufArray::U8(v) => (*v.get(i)?).into(),
            GgufArray::I8(v) => (*v.get(i)?).into(),
            GgufArray::U16(v) => (*v.get(i)?).into(),
            GgufArray::I16(v) => (*v.get(i)?).into(),
            GgufArray::U32(v) => (*v.get(i)?).into(),
            GgufArray::I32(v) => (*v.get(i)?).into(),
            GgufArray::U64(v) => (*v.get(i)?).into(),
            GgufArray::I64(v) => (*v.get(i)?).into(),
            _ => return None,
        })
    }

    fn is_integer(&self) -> bool {
        matches!(
            self,
            GgufArray::U8(_)
                | GgufArray::I8(_)
                | GgufArray::U16(_)
                | GgufArray::I16(_)
                | GgufArray::U32(_)
                | GgufArray::I32(_)
                | GgufArray::U64(_)
                | GgufArray::I64(_)
        )
    }

    /// The elements converted to `T`, borrowed when the array already holds
    /// `T`. `Err` carries a description of what was found instead: a
    /// non-integer array, or the first element that does not fit.
    fn ints<'a, T: Copy + TryFrom<i128>>(&'a self, exact: Option<&'a [T]>) -> Result<Cow<'a, [T]>, String> {
        if let Some(v) = exact {
            return Ok(Cow::Borrowed(v));
        }
        if !self.is_integer() {
            return Err(self.to_string());
        }
        let mut out = Vec::with_capacity(self.len());
        for i in 0..self.len() {
            let v = self.int_at(i).ok_or_else(|| self.to_string())?;
            out.push(T::try_from(v).map_err(|_| format!("{self} whose element {i} is {v}"))?);
        }
        Ok(Cow::Owned(out))
    }
}

impl fmt::Display for GgufArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "array of {} {}", self.len(), self.elem_type())
    }
}

/// The file's bytes: mapped from disk, or owned.
enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed, validated GGUF file and its bytes.
pub struct GgufFile {
    backing: Backing,
    path: Option<PathBuf>,
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: Vec<(String, GgufValue)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_start", &self.data_start)
            .field("file_len", &self.file_len())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and validates `path`. Errors carry the path.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only. If another process changes the
        // file while it is mapped, reads return the new bytes (or fault on
        // truncation), as with any mmap-based loader; every access here is
        // bounds-checked against the mapped length.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = parse_header(&map).map_err(|e| GgufError::File { path: path.to_path_buf(), source: Box::new(e) })?;
        Ok(GgufFile::assemble(Backing::Mmap(map), Some(path.to_path_buf()), header))
    }

    /// Validates a GGUF file held in memory.
    pub fn parse(bytes: Vec<u8>) -> Result<GgufFile> {
        let header = parse_header(&bytes)?;
        Ok(GgufFile::assemble(Backing::Owned(bytes), None, header))
    }

    fn assemble(backing: Backing, path: Option<PathBuf>, h: Header) -> GgufFile {
        let key_index = h.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let tensor_index = h.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        GgufFile {
            backing,
            path,
            version: h.version,
            alignment: h.alignment,
            data_start: h.data_start,
            metadata: h.metadata,
            key_index,
            tensors: h.tensors,
            tensor_index,
        }
    }

    /// The path given to [`GgufFile::open`]; `None` for [`GgufFile::parse`].
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of the data section and of every tensor offset.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section in the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// Metadata entries in file order.
    pub fn metadata(&self) -> impl ExactSizeIterator<Item = (&str, &GgufValue)> + '_ {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of `t`, which must be one of this file's tensors (all of
    /// which were checked to lie inside the file).
    ///
    /// # Panics
    /// If `t`'s byte range lies outside this file, which only a
    /// [`TensorInfo`] built or edited by the caller can do.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        self.range(t)
            .unwrap_or_else(|| panic!("tensor {}: {} bytes at data offset {} lie outside this GGUF file", t.name, t.bytes, t.offset))
    }

    /// The data of the tensor called `name`, if there is one.
    pub fn tensor_data_by_name(&self, name: &str) -> Option<&[u8]> {
        self.range(self.tensor(name)?)
    }

    fn range(&self, t: &TensorInfo) -> Option<&[u8]> {
        let start = self.data_start.checked_add(t.offset)?;
        let end = start.checked_add(t.bytes)?;
        self.backing.bytes().get(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.key_index.contains_key(key)
    }

    /// Adds the path, when there is one, to an error about this file.
    fn in_file(&self, e: GgufError) -> GgufError {
        match &self.path {
            Some(path) => GgufError::File { path: path.clone(), source: Box::new(e) },
            None => e,
        }
    }

    fn missing(&self, key: &str) -> GgufError {
        self.in_file(GgufError::MissingKey { key: key.to_string() })
    }

    fn wrong_type(&self, key: &str, expected: &'static str, found: String) -> GgufError {
        self.in_file(GgufError::WrongType { key: key.to_string(), expected, found })
    }

    /// `None` when `key` is absent; an error when it is present but `conv`
    /// rejects it.
    fn typed<'a, T>(&'a self, key: &str, expected: &'static str, conv: impl FnOnce(&'a GgufValue) -> Option<T>) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => conv(v).map(Some).ok_or_else(|| self.wrong_type(key, expected, v.to_string())),
        }
    }

    /// A value of any integer type that fits u32.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get_opt_u32(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn get_opt_u32(&self, key: &str) -> Result<Option<u32>> {
        self.typed(key, "an integer that fits u32", GgufValue::as_u32)
    }

    /// A value of any integer type that fits u64.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.typed(key, "an integer that fits u64", GgufValue::as_u64)?.ok_or_else(|| self.missing(key))
    }

    /// A value of any integer type that fits i64.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.typed(key, "an integer that fits i64", GgufValue::as_i64)?.ok_or_else(|| self.missing(key))
    }

    /// An f32 or f64 value.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.get_opt_f32(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn get_opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.typed(key, "f32 or f64", GgufValue::as_f32)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.get_opt_bool(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn get_opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "bool", GgufValue::as_bool)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.get_opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn get_opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "string", GgufValue::as_str)
    }

    pub fn get_array(&self, key: &str) -> Result<&GgufArray> {
        self.typed(key, "array", GgufValue::as_array)?.ok_or_else(|| self.missing(key))
    }

    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        self.typed(key, "array of string", |v| v.as_array()?.as_strings())?.ok_or_else(|| self.missing(key))
    }

    /// An array of any integer type whose elements all fit i32 (borrowed
    /// when it is stored as i32).
    pub fn get_i32_array(&self, key: &str) -> Result<Cow<'_, [i32]>> {
        let a = self.get_array(key)?;
        let exact = match a {
            GgufArray::I32(v) => Some(v.as_slice()),
            _ => None,
        };
        a.ints(exact).map_err(|found| self.wrong_type(key, "array of integers that fit i32", found))
    }

    /// An array of any integer type whose elements all fit u32 (borrowed
    /// when it is stored as u32).
    pub fn get_u32_array(&self, key: &str) -> Result<Cow<'_, [u32]>> {
        let a = self.get_array(key)?;
        let exact = match a {
            GgufArray::U32(v) => Some(v.as_slice()),
            _ => None,
        };
        a.ints(exact).map_err(|found| self.wrong_type(key, "array of integers that fit u32", found))
    }

    /// An f32 array (borrowed) or an f64 array (rounded to f32).
    pub fn get_f32_array(&self, key: &str) -> Result<Cow<'_, [f32]>> {
        match self.get_array(key)? {
            GgufArray::F32(v) => Ok(Cow::Borrowed(v)),
            GgufArray::F64(v) => Ok(Cow::Owned(v.iter().map(|&x| x as f32).collect())),
            other => Err(self.wrong_type(key, "array of f32 or f64", other.to_string())),
        }
    }
}

/// What [`parse_header`] extracts.
struct Header {
    version: u32,
    alignment: u64,
    data_start: u64,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian cursor. Field names are built lazily, only
/// when an error needs them.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

type Field<'f> = &'f dyn Fn() -> String;

impl<'a> Reader<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, field: Field) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated { field: field(), needed: n, offset: self.offset(), file_len: self.buf.len() as u64 });
        }
        // n <= remaining, so it fits usize and the range is in bounds.
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: Field) -> Result<[u8; N]> {
        let s = self.take(N as u64, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, field: Field) -> Result<u32> {
        self.array(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: Field) -> Result<u64> {
        self.array(field).map(u64::from_le_bytes)
    }

    /// An element count, checked against the bytes left: `count` elements of
    /// at least `min_elem_bytes` each must fit before anything is allocated.
    fn count(&mut self, min_elem_bytes: u64, field: Field) -> Result<usize> {
        let offset = self.offset();
        let count = self.u64(field)?;
        let remaining = self.remaining();
        match count.checked_mul(min_elem_bytes) {
            Some(need) if need <= remaining => Ok(count as usize),
            _ => Err(GgufError::CountTooLarge { field: field(), count, min_elem_bytes, offset, remaining, from: self.offset() }),
        }
    }

    /// A length-prefixed UTF-8 string.
    fn string(&mut self, field: Field) -> Result<String> {
        let len = self.u64(&|| format!("{} length", field()))?;
        let offset = self.offset();
        let bytes = self.take(len, field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(source) => Err(GgufError::Utf8 { field: field(), offset, source }),
        }
    }

    fn value_type(&mut self, field: Field) -> Result<GgufValueType> {
        let offset = self.offset();
        let id = self.u32(field)?;
        GgufValueType::from_id(id).ok_or_else(|| GgufError::BadValueType { field: field(), found: id, offset })
    }

    /// `n` fixed-size elements, decoded with `f`; `n * N` bytes were already
    /// checked to be present by [`Reader::count`].
    fn fixed<T, const N: usize>(&mut self, n: usize, field: Field, f: fn([u8; N]) -> T) -> Result<Vec<T>> {
        let bytes = self.take(n as u64 * N as u64, field)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect())
    }

    fn bool(&mut self, field: Field) -> Result<bool> {
        let offset = self.offset();
        match self.array::<1>(field)? {
            [0] => Ok(false),
            [1] => Ok(true),
            [found] => Err(GgufError::BadBool { field: field(), found, offset }),
        }
    }

    fn value(&mut self, t: GgufValueType, field: Field) -> Result<GgufValue> {
        Ok(match t {
            GgufValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.array(field)?)),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(field)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(field)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(field)?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(field)?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(field)?)),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(field)?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(field)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(field)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(field)?)),
            GgufValueType::Bool => GgufValue::Bool(self.bool(field)?),
            GgufValueType::String => GgufValue::String(self.string(field)?),
            GgufValueType::Array => GgufValue::Array(self.array_value(1, field)?),
        })
    }

    /// An array's element type, count and elements; `depth` is this array's
    /// nesting level (1 for an array that is not inside another).
    fn array_value(&mut self, depth: usize, field: Field) -> Result<GgufArray> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::TooDeep { field: field(), offset: self.offset() });
        }
        let t = self.value_type(&|| format!("{} element type", field()))?;
        let n = self.count(t.min_bytes(), &|| format!("{} element count (array of {t})", field()))?;
        let elems = &|| format!("{} elements ({n} × {t})", field());
        Ok(match t {
            GgufValueType::U8 => GgufArray::U8(self.fixed(n, elems, u8::from_le_bytes)?),
            GgufValueType::I8 => GgufArray::I8(self.fixed(n, elems, i8::from_le_bytes)?),
            GgufValueType::U16 => GgufArray::U16(self.fixed(n, elems, u16::from_le_bytes)?),
            GgufValueType::I16 => GgufArray::I16(self.fixed(n, elems, i16::from_le_bytes)?),
            GgufValueType::U32 => GgufArray::U32(self.fixed(n, elems, u32::from_le_bytes)?),
            GgufValueType::I32 => GgufArray::I32(self.fixed(n, elems, i32::from_le_bytes)?),
            GgufValueType::U64 => GgufArray::U64(self.fixed(n, elems, u64::from_le_bytes)?),
            GgufValueType::I64 => GgufArray::I64(self.fixed(n, elems, i64::from_le_bytes)?),
            GgufValueType::F32 => GgufArray::F32(self.fixed(n, elems, f32::from_le_bytes)?),
            GgufValueType::F64 => GgufArray::F64(self.fixed(n, elems, f64::from_le_bytes)?),
            GgufValueType::Bool => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.bool(&|| format!("{} element {i} (bool)", field()))?);
                }
                GgufArray::Bool(v)
            }
            GgufValueType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&|| format!("{} element {i} (string)", field()))?);
                }
                GgufArray::String(v)
            }
            GgufValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.array_value(depth + 1, &|| format!("{} element {i} (array)", field()))?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

/// Reads and validates everything before the data section.
fn parse_header(buf: &[u8]) -> Result<Header> {
    let mut r = Reader { buf, pos: 0 };
    let magic: [u8; 4] = r.array(&|| "magic".into())?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = r.u32(&|| "version".into())?;
    match version {
        2 | 3 => {}
        v if v & 0xffff == 0 && matches!(v.swap_bytes(), 1..=3) => return Err(GgufError::BigEndian { little: v, big: v.swap_bytes() }),
        v => return Err(GgufError::UnsupportedVersion { found: v }),
    }
    // The tensor count is checked against the bytes left after the metadata,
    // where the tensor infos start.
    let n_tensors_raw = r.u64(&|| "tensor count".into())?;
    let n_kv = r.count(MIN_KV_BYTES, &|| "metadata count".into())?;

    let mut metadata: Vec<(String, GgufValue)> = Vec::with_capacity(n_kv);
    let mut keys: HashMap<String, u64> = HashMap::with_capacity(n_kv);
    for i in 0..n_kv as u64 {
        let offset = r.offset();
        let key = r.string(&|| format!("metadata key #{i} name"))?;
        if key.is_empty() {
            return Err(GgufError::EmptyKey { index: i, offset });
        }
        if let Some(&first) = keys.get(&key) {
            return Err(GgufError::DuplicateKey { key, index: i, first, offset });
        }
        let t = r.value_type(&|| format!("metadata key #{i} '{key}' value type"))?;
        let value = r.value(t, &|| format!("metadata key #{i} '{key}' value ({t})"))?;
        keys.insert(key.clone(), i);
        metadata.push((key, value));
    }

    let alignment = match keys.get(ALIGNMENT_KEY).and_then(|&i| metadata.get(i as usize)) {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u32() {
            Some(a) if a.is_power_of_two() => u64::from(a),
            _ => return Err(GgufError::BadAlignment { found: v.to_string() }),
        },
    };

    let remaining = r.remaining();
    let n_tensors = match n_tensors_raw.checked_mul(MIN_TENSOR_INFO_BYTES) {
        Some(need) if need <= remaining => n_tensors_raw as usize,
        _ => {
            return Err(GgufError::CountTooLarge {
                field: "tensor count".into(),
                count: n_tensors_raw,
                min_elem_bytes: MIN_TENSOR_INFO_BYTES,
                offset: 8,
                remaining,
                from: r.offset(),
            })
        }
    };
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    let mut names: HashMap<String, u64> = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors as u64 {
        let offset = r.offset();
        let name = r.string(&|| format!("tensor #{i} name"))?;
        if name.is_empty() {
            return Err(GgufError::EmptyTensorName { index: i, offset });
        }
        if let Some(&first) = names.get(&name) {
            return Err(GgufError::DuplicateTensor { tensor: name, index: i, first, offset });
        }
        let dims_offset = r.offset();
        let n_dims = r.u32(&|| format!("tensor #{i} {name} n_dims"))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(GgufError::BadDimCount { tensor: name, n_dims, offset: dims_offset });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(r.u64(&|| format!("tensor #{i} {name} dim {d}"))?);
        }
        let ggml_type = r.u32(&|| format!("tensor #{i} {name} type"))?;
        let data_offset = r.u64(&|| format!("tensor #{i} {name} data offset"))?;
        let ttype = TensorType::from_ggml_type(ggml_type).ok_or_else(|| GgufError::UnsupportedType { ggml_type, tensor: name.clone() })?;
        let bytes = tensor_bytes(&name, &dims, ttype)?;
        names.insert(name.clone(), i);
        tensors.push(TensorInfo { name, dims, ttype, offset: data_offset, bytes });
    }

    let file_len = buf.len() as u64;
    let data_start = align_up(r.offset(), alignment).ok_or_else(|| GgufError::Truncated {
        field: "data section".into(),
        needed: alignment,
        offset: r.offset(),
        file_len,
    })?;
    for t in &tensors {
        if !t.offset.is_multiple_of(alignment) {
            return Err(GgufError::Misaligned { tensor: t.name.clone(), offset: t.offset, alignment });
        }
        let end = data_start.checked_add(t.offset).and_then(|s| s.checked_add(t.bytes));
        if !matches!(end, Some(end) if end <= file_len) {
            return Err(GgufError::OutOfFile { tensor: t.name.clone(), offset: t.offset, bytes: t.bytes, data_start, file_len });
        }
    }
    check_overlaps(&tensors)?;
    Ok(Header { version, alignment, data_start, metadata, tensors })
}

/// Validates dims against the type and returns the data size in bytes.
fn tensor_bytes(name: &str, dims: &[u64], ttype: TensorType) -> Result<u64> {
    if let Some(axis) = dims.iter().position(|&d| d == 0) {
        return Err(GgufError::ZeroDim { tensor: name.to_string(), dims: dims.to_vec(), axis });
    }
    let row = dims.first().copied().unwrap_or(1);
    if !row.is_multiple_of(ttype.block_elems()) {
        return Err(GgufError::RowNotBlockMultiple { tensor: name.to_string(), row, format: ttype.name(), block: ttype.block_elems() });
    }
    let too_large = || GgufError::TooLarge { tensor: name.to_string(), dims: dims.to_vec(), format: ttype.name() };
    // GGML counts elements in i64.
    dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).filter(|&n| n <= i64::MAX as u64).ok_or_else(too_large)?;
    let rows = dims.iter().skip(1).try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(too_large)?;
    ttype.row_bytes(row).and_then(|rb| rb.checked_mul(rows)).filter(|&b| b <= i64::MAX as u64).ok_or_else(too_large)
}

/// Errors if any two tensors' data ranges share a byte.
fn check_overlaps(tensors: &[TensorInfo]) -> Result<()> {
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Offsets and sizes were bounds-checked against the file, so these sums cannot overflow.
        let a_end = a.offset + a.bytes;
        if b.offset < a_end {
            return Err(GgufError::Overlap {
                tensor: b.name.clone(),
                start: b.offset,
                end: b.offset + b.bytes,
                other: a.name.clone(),
                other_start: a.offset,
                other_end: a_end,
            });
        }
    }
    Ok(())
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    Some(x.checked_add(alignment - 1)? / alignment * alignment)
}
