//! A memory-mapped safetensors file. The header is checked against the file
//! before any tensor is read: every tensor's byte range must lie inside the
//! data section, match its dtype and shape, and not overlap another.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rlx::{DType, Tensor};
use serde::Deserialize;

use crate::error::open_regular_file;
use crate::{ModelError, Result};

/// Element types a safetensors file may declare. Only the float ones can be
/// weights; the integer ones appear as buffers (e.g. BERT's `position_ids`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StDType {
    F32,
    F16,
    BF16,
    F64,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl StDType {
    fn parse(s: &str) -> Option<StDType> {
        Some(match s {
            "F32" => StDType::F32,
            "F16" => StDType::F16,
            "BF16" => StDType::BF16,
            "F64" => StDType::F64,
            "I64" => StDType::I64,
            "I32" => StDType::I32,
            "I16" => StDType::I16,
            "I8" => StDType::I8,
            "U8" => StDType::U8,
            "BOOL" => StDType::Bool,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            StDType::F64 | StDType::I64 => 8,
            StDType::F32 | StDType::I32 => 4,
            StDType::F16 | StDType::BF16 | StDType::I16 => 2,
            StDType::I8 | StDType::U8 | StDType::Bool => 1,
        }
    }

    /// The RLX dtype for a weight of this type, if it can be one.
    pub fn float_dtype(self) -> Option<DType> {
        match self {
            StDType::F32 => Some(DType::F32),
            StDType::F16 => Some(DType::F16),
            StDType::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

/// One tensor's header entry, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub dtype: StDType,
    pub shape: Vec<usize>,
    /// Byte range inside the data section.
    pub start: usize,
    pub end: usize,
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

/// Headers larger than this are refused before parsing (a corrupt length
/// field would otherwise ask for gigabytes of JSON).
const MAX_HEADER: u64 = 100 << 20;

pub struct SafetensorsFile {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    tensors: BTreeMap<String, TensorInfo>,
}

impl SafetensorsFile {
    pub fn open(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
        let path = path.as_ref();
        let file: File = open_regular_file(path)?;
        // SAFETY: the map is read-only; a file changed underneath us while
        // mapped gives wrong numbers, never memory unsafety in our code,
        // since every access is bounds-checked against the mapped length.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let (data_start, tensors) = parse_header(path, &map)?;
        Ok(SafetensorsFile { path: path.to_path_buf(), map, data_start, tensors })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names as stored, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The raw little-endian bytes of a tensor.
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensors.get(name).ok_or_else(|| ModelError::tensor(&self.path, name, "not in the file"))?;
        // parse_header proved the range lies inside the map.
        Ok(&self.map[self.data_start + info.start..self.data_start + info.end])
    }

    /// A float tensor as an RLX host tensor in its stored dtype.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let info = self.tensors.get(name).ok_or_else(|| ModelError::tensor(&self.path, name, "not in the file"))?;
        let dtype = info.dtype.float_dtype().ok_or_else(|| {
            ModelError::tensor(&self.path, name, format!("dtype {:?} cannot be a weight (expected F32, F16 or BF16)", info.dtype))
        })?;
        let bytes = self.bytes(name)?.to_vec();
        Tensor::from_bytes(info.shape.clone(), dtype, bytes).map_err(|e| ModelError::tensor(&self.path, name, e.to_string()))
    }
}

/// The header's entries in file order. A name that appears twice is an
/// error: a plain map would keep one of the two silently, and which tensor
/// a model then loads would depend on the parser.
struct UniqueEntries(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for UniqueEntries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Entries;
        impl<'de> serde::de::Visitor<'de> for Entries {
            type Value = UniqueEntries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<UniqueEntries, A::Error> {
                let mut seen = std::collections::HashSet::new();
                let mut out = Vec::new();
                while let Some((name, value)) = map.next_entry::<String, serde_json::Value>()? {
                    if !seen.insert(name.clone()) {
                        return Err(serde::de::Error::custom(format!("tensor '{name}' appears twice")));
                    }
                    out.push((name, value));
                }
                Ok(UniqueEntries(out))
            }
        }
        d.deserialize_map(Entries)
    }
}

/// Checks a safetensors image (the whole file's bytes) and returns where its
/// data section starts and its tensor table. Public so fuzzing can drive it
/// without a file.
pub fn parse_header(path: &Path, map: &[u8]) -> Result<(usize, BTreeMap<String, TensorInfo>)> {
    let file_len = map.len() as u64;
    if file_len < 8 {
        return Err(ModelError::format(
            path,
            format!("truncated: {file_len} bytes, a safetensors file starts with an 8-byte header length"),
        ));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&map[..8]);
    let header_len = u64::from_le_bytes(len8);
    if header_len > MAX_HEADER {
        return Err(ModelError::format(
            path,
            format!("header length field says {header_len} bytes (more than the {MAX_HEADER} allowed): not a safetensors file or corrupt"),
        ));
    }
    if 8 + header_len > file_len {
        return Err(ModelError::format(path, format!("truncated: the header needs {} bytes, the file has {file_len}", 8 + header_len)));
    }
    let data_start = 8 + header_len as usize;
    let header = std::str::from_utf8(&map[8..data_start]).map_err(|e| ModelError::format(path, format!("header is not UTF-8: {e}")))?;
    let raw: UniqueEntries =
        serde_json::from_str(header.trim_end()).map_err(|e| ModelError::format(path, format!("header is not a JSON object: {e}")))?;
    let data_len = map.len() - data_start;
    let mut tensors = BTreeMap::new();
    for (name, value) in raw.0 {
        if name == "__metadata__" {
            continue;
        }
        let e: RawEntry = serde_json::from_value(value)
            .map_err(|err| ModelError::tensor(path, &name, format!("bad header entry (expected dtype, shape, data_offsets): {err}")))?;
        let dtype = StDType::parse(&e.dtype).ok_or_else(|| ModelError::tensor(path, &name, format!("unknown dtype '{}'", e.dtype)))?;
        let [start, end] = e.data_offsets;
        let numel = e.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let want = numel.and_then(|n| n.checked_mul(dtype.size()));
        if start > end || Some(end - start) != want {
            return Err(ModelError::tensor(
                path,
                &name,
                format!(
                    "header offsets [{start}, {end}] give {} bytes, but {:?} {:?} needs {}",
                    end.saturating_sub(start),
                    dtype,
                    e.shape,
                    want.map_or("an overflowing size".to_string(), |w| w.to_string())
                ),
            ));
        }
        if end > data_len {
            return Err(ModelError::tensor(
                path,
                &name,
                format!("header offsets [{start}, {end}] run past the data section ({data_len} bytes): the file is truncated or the header lies"),
            ));
        }
        tensors.insert(name, TensorInfo { dtype, shape: e.shape, start, end });
    }
    let mut ranges: Vec<(&String, &TensorInfo)> = tensors.iter().collect();
    ranges.sort_by_key(|(_, t)| (t.start, t.end));
    for w in ranges.windows(2) {
        if w[1].1.start < w[0].1.end {
            return Err(ModelError::tensor(
                path,
                w[1].0,
                format!(
                    "bytes [{}, {}] overlap tensor '{}' at [{}, {}]: the header lies",
                    w[1].1.start, w[1].1.end, w[0].0, w[0].1.start, w[0].1.end
                ),
            ));
        }
    }
    Ok((data_start, tensors))
}

/// Writes a safetensors file (used by tests and tools to make small files).
pub fn write_safetensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, t) in tensors {
        let dtype = match t.dtype() {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::U8 => "U8",
        };
        let n = t.bytes().len();
        header.insert(name.to_string(), serde_json::json!({"dtype": dtype, "shape": t.dims(), "data_offsets": [offset, offset + n]}));
        offset += n;
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + offset);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for (_, t) in tensors {
        out.extend_from_slice(t.bytes());
    }
    std::fs::write(path, out).map_err(|e| ModelError::io(path, e))
}
