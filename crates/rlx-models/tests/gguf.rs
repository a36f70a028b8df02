//! The GGUF reader: round trips of every metadata value type and tensor type
//! through an in-memory writer, every kind of corruption (truncation at each
//! byte, lying lengths and counts, bad types, dims, offsets, alignment,
//! duplicates, encoding), and the real SmolLM2 Q4_1 file when present.

#[path = "common/gguf_writer.rs"]
mod gguf_writer;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use gguf_writer::{patch_u32, patch_u64, put_str, put_u32, put_u64, Writer, KV_COUNT_AT, TENSOR_COUNT_AT};
use rlx_ir::QFormat;
use rlx_models::gguf::{GgufArray, GgufError, GgufFile, GgufValue, TensorType, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH};

const F32: u32 = 0;
const F16: u32 = 1;
const Q4_0: u32 = 2;
const Q4_1: u32 = 3;
const Q5_0: u32 = 6;
const Q5_1: u32 = 7;
const Q8_0: u32 = 8;
const Q4_K: u32 = 12;
const Q6_K: u32 = 14;
const BF16: u32 = 30;

fn s(x: &str) -> GgufValue {
    GgufValue::String(x.to_string())
}

fn parse_err(bytes: Vec<u8>) -> GgufError {
    match GgufFile::parse(bytes) {
        Ok(f) => panic!("expected an error, parsed {f:?}"),
        Err(e) => e,
    }
}

fn err_text(bytes: Vec<u8>) -> String {
    parse_err(bytes).to_string()
}

/// One metadata entry of every value type, arrays of every element type,
/// nested arrays (with mixed element types per element) and empty ones.
fn all_values() -> Vec<(String, GgufValue)> {
    let v = vec![
        ("t.u8", GgufValue::U8(200)),
        ("t.i8", GgufValue::I8(-100)),
        ("t.u16", GgufValue::U16(60000)),
        ("t.i16", GgufValue::I16(-30000)),
        ("t.u32", GgufValue::U32(4_000_000_000)),
        ("t.i32", GgufValue::I32(-2_000_000_000)),
        ("t.u64", GgufValue::U64(u64::MAX)),
        ("t.i64", GgufValue::I64(i64::MIN)),
        ("t.f32", GgufValue::F32(1.5e-5)),
        ("t.f64", GgufValue::F64(-2.25e100)),
        ("t.bool_true", GgufValue::Bool(true)),
        ("t.bool_false", GgufValue::Bool(false)),
        ("t.str", s("héllo ✓ {% chat %}")),
        ("t.str_empty", s("")),
        ("a.u8", GgufValue::Array(GgufArray::U8(vec![0, 1, 255]))),
        ("a.i8", GgufValue::Array(GgufArray::I8(vec![-128, 0, 127]))),
        ("a.u16", GgufValue::Array(GgufArray::U16(vec![1, 65535]))),
        ("a.i16", GgufValue::Array(GgufArray::I16(vec![-32768, 32767]))),
        ("a.u32", GgufValue::Array(GgufArray::U32(vec![7, u32::MAX]))),
        ("a.i32", GgufValue::Array(GgufArray::I32(vec![-1, 0, 5]))),
        ("a.u64", GgufValue::Array(GgufArray::U64(vec![u64::MAX, 3]))),
        ("a.i64", GgufValue::Array(GgufArray::I64(vec![i64::MIN, 4]))),
        ("a.f32", GgufValue::Array(GgufArray::F32(vec![0.5, -1.0, f32::INFINITY]))),
        ("a.f64", GgufValue::Array(GgufArray::F64(vec![0.25, 1e300]))),
        ("a.bool", GgufValue::Array(GgufArray::Bool(vec![true, false, true]))),
        ("a.str", GgufValue::Array(GgufArray::String(vec!["a".into(), "".into(), "Ġthe".into()]))),
        ("a.empty", GgufValue::Array(GgufArray::U32(vec![]))),
        ("a.empty_str", GgufValue::Array(GgufArray::String(vec![]))),
        (
            "a.nested",
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::U8(vec![1, 2]),
                GgufArray::String(vec!["x".into()]),
                GgufArray::Array(vec![GgufArray::F32(vec![3.0]), GgufArray::Array(vec![])]),
                GgufArray::I64(vec![]),
            ])),
        ),
    ];
    v.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Every tensor type, with 1 to 4 dims.
fn all_tensors(w: Writer) -> Writer {
    w.tensor("f32.1d", &[7], F32)
        .tensor("f16.2d", &[3, 5], F16)
        .tensor("bf16.3d", &[2, 3, 4], BF16)
        .tensor("q4_0", &[64, 3], Q4_0)
        .tensor("q4_1", &[32, 2, 2], Q4_1)
        .tensor("q5_0", &[96], Q5_0)
        .tensor("q5_1", &[32, 1, 1, 2], Q5_1)
        .tensor("q8_0", &[64, 4], Q8_0)
        .tensor("q4_k", &[256, 2], Q4_K)
        .tensor("q6_k", &[512, 3], Q6_K)
}

fn full_writer() -> Writer {
    let mut w = Writer::new();
    w.kvs = all_values();
    all_tensors(w)
}

/// A small file with a few entries of each kind, for exhaustive corruption.
fn small_writer() -> Writer {
    Writer::new()
        .kv("general.architecture", s("llama"))
        .kv("n", GgufValue::U32(3))
        .kv("arr", GgufValue::Array(GgufArray::String(vec!["ab".into(), "c".into()])))
        .kv("nest", GgufValue::Array(GgufArray::Array(vec![GgufArray::I16(vec![1, -1])])))
        .tensor("w", &[32, 2], Q4_1)
        .tensor("b", &[3], F32)
}

#[test]
fn round_trips_every_value_type_in_file_order() {
    let w = full_writer();
    let f = GgufFile::parse(w.build()).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), DEFAULT_ALIGNMENT);
    let got: Vec<(String, GgufValue)> = f.metadata().map(|(k, v)| (k.to_string(), v.clone())).collect();
    assert_eq!(got, w.kvs);
    assert_eq!(f.metadata().len(), w.kvs.len());
    for (k, v) in &w.kvs {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    assert_eq!(f.get("absent"), None);
}

#[test]
fn typed_getters_convert_what_fits_and_explain_what_does_not() {
    let f = GgufFile::parse(full_writer().kv("neg", GgufValue::I32(-5)).kv("small_i64", GgufValue::I64(42)).build()).unwrap();
    assert_eq!(f.get_u32("t.u8").unwrap(), 200);
    assert_eq!(f.get_u32("t.u16").unwrap(), 60000);
    assert_eq!(f.get_u32("small_i64").unwrap(), 42);
    assert_eq!(f.get_u64("t.u64").unwrap(), u64::MAX);
    assert_eq!(f.get_i64("t.i64").unwrap(), i64::MIN);
    assert_eq!(f.get_f32("t.f32").unwrap(), 1.5e-5);
    assert_eq!(f.get_f32("t.f64").unwrap(), -2.25e100f64 as f32);
    assert!(f.get_bool("t.bool_true").unwrap());
    assert!(!f.get_bool("t.bool_false").unwrap());
    assert_eq!(f.get_str("t.str").unwrap(), "héllo ✓ {% chat %}");
    assert_eq!(f.get_str_array("a.str").unwrap(), ["a", "", "Ġthe"]);
    assert!(matches!(f.get_i32_array("a.i32").unwrap(), Cow::Borrowed([-1, 0, 5])));
    assert_eq!(&*f.get_i32_array("a.u8").unwrap(), [0, 1, 255]);
    assert_eq!(
        f.get_u32_array("a.i8").unwrap_err().to_string(),
        "metadata key 'a.i8': expected array of integers that fit u32, found array of 3 i8 whose element 0 is -128"
    );
    assert!(matches!(f.get_u32_array("a.u32").unwrap(), Cow::Borrowed([7, u32::MAX])));
    assert_eq!(&*f.get_u32_array("a.u16").unwrap(), [1, 65535]);
    assert!(matches!(f.get_f32_array("a.f32").unwrap(), Cow::Borrowed(_)));
    assert_eq!(&*f.get_f32_array("a.f64").unwrap(), [0.25, f32::INFINITY]);
    assert_eq!(f.get_array("a.nested").unwrap().len(), 4);
    assert_eq!(f.get_opt_u32("absent").unwrap(), None);
    assert_eq!(f.get_opt_str("t.str").unwrap(), Some("héllo ✓ {% chat %}"));

    let e = |r: Result<(), GgufError>| r.unwrap_err().to_string();
    assert_eq!(e(f.get_u32("neg").map(drop)), "metadata key 'neg': expected an integer that fits u32, found i32 -5");
    assert_eq!(e(f.get_u32("t.u64").map(drop)), "metadata key 't.u64': expected an integer that fits u32, found u64 18446744073709551615");
    assert_eq!(
        e(f.get_u32("t.str").map(drop)),
        "metadata key 't.str': expected an integer that fits u32, found string \"héllo ✓ {% chat %}\""
    );
    assert_eq!(e(f.get_f32("t.u32").map(drop)), "metadata key 't.u32': expected f32 or f64, found u32 4000000000");
    assert_eq!(e(f.get_str("a.str").map(drop)), "metadata key 'a.str': expected string, found array of 3 string");
    assert_eq!(e(f.get_bool("t.u8").map(drop)), "metadata key 't.u8': expected bool, found u8 200");
    assert_eq!(e(f.get_str_array("a.i32").map(drop)), "metadata key 'a.i32': expected array of string, found array of 3 i32");
    assert_eq!(
        e(f.get_i32_array("a.u64").map(drop)),
        "metadata key 'a.u64': expected array of integers that fit i32, found array of 2 u64 whose element 0 is 18446744073709551615"
    );
    assert_eq!(
        e(f.get_i32_array("a.f32").map(drop)),
        "metadata key 'a.f32': expected array of integers that fit i32, found array of 3 f32"
    );
    assert_eq!(e(f.get_f32_array("a.str").map(drop)), "metadata key 'a.str': expected array of f32 or f64, found array of 3 string");
    assert_eq!(e(f.get_u32("llama.block_count").map(drop)), "metadata key 'llama.block_count' not found");
    assert!(matches!(f.get_str("nope").unwrap_err(), GgufError::MissingKey { .. }));
}

#[test]
fn reads_every_tensor_type_with_its_dims_size_and_data() {
    let w = full_writer();
    let (bytes, layout) = w.build_with_layout();
    let f = GgufFile::parse(bytes.clone()).unwrap();
    assert_eq!(f.tensors().len(), w.tensors.len());
    assert_eq!(f.data_start(), layout.data_start as u64);
    assert_eq!(f.data_start() % 32, 0);
    let expect_type = |id: u32| match id {
        F32 => TensorType::F32,
        F16 => TensorType::F16,
        BF16 => TensorType::BF16,
        Q4_0 => TensorType::Quant(QFormat::Q4_0),
        Q4_1 => TensorType::Quant(QFormat::Q4_1),
        Q5_0 => TensorType::Quant(QFormat::Q5_0),
        Q5_1 => TensorType::Quant(QFormat::Q5_1),
        Q8_0 => TensorType::Quant(QFormat::Q8_0),
        Q4_K => TensorType::Quant(QFormat::Q4K),
        Q6_K => TensorType::Quant(QFormat::Q6K),
        other => panic!("type {other}"),
    };
    for (i, wt) in w.tensors.iter().enumerate() {
        let t = f.tensor(&wt.name).unwrap_or_else(|| panic!("{} missing", wt.name));
        assert_eq!(&f.tensors()[i], t, "file order");
        assert_eq!(t.dims, wt.dims);
        assert_eq!(t.ttype, expect_type(wt.ggml_type), "{}", wt.name);
        assert_eq!(t.ttype.ggml_type(), wt.ggml_type);
        assert_eq!(t.bytes, wt.data.len() as u64, "{}", wt.name);
        assert_eq!(t.offset, layout.tensors[i].offset);
        assert_eq!(t.offset % 32, 0);
        assert_eq!(f.tensor_data(t), &wt.data[..], "{}", wt.name);
        assert_eq!(f.tensor_data_by_name(&wt.name), Some(&wt.data[..]));
        assert_eq!(t.n_elements(), wt.dims.iter().product::<u64>());
        assert_eq!(t.row_len() * t.n_rows(), t.n_elements());
        assert_eq!(t.row_bytes() * t.n_rows(), t.bytes);
        assert_eq!(t.shape(), wt.dims.iter().rev().copied().collect::<Vec<_>>());
    }
    assert_eq!(f.tensor("absent"), None);
    assert_eq!(f.tensor_data_by_name("absent"), None);
    assert_eq!(f.bytes(), &bytes[..]);
    fn send_sync<T: Send + Sync>(_: &T) {}
    send_sync(&f);
}

#[test]
fn accepts_version_2_custom_alignment_and_no_tensors() {
    let mut w = small_writer().kv("general.alignment", GgufValue::U32(64));
    w.alignment = 64;
    w.version = 2;
    let f = GgufFile::parse(w.build()).unwrap();
    assert_eq!((f.version(), f.alignment()), (2, 64));
    assert_eq!(f.data_start() % 64, 0);
    assert_eq!(f.tensors().len(), 2);
    // general.alignment may be any integer type that holds a power of two.
    let mut w = small_writer().kv("general.alignment", GgufValue::U64(16));
    w.alignment = 16;
    assert_eq!(GgufFile::parse(w.build()).unwrap().alignment(), 16);
    let mut w = small_writer().kv("general.alignment", GgufValue::U32(1));
    w.alignment = 1;
    assert_eq!(GgufFile::parse(w.build()).unwrap().alignment(), 1);

    let f = GgufFile::parse(Writer::new().build()).unwrap();
    assert_eq!((f.metadata().len(), f.tensors().len()), (0, 0));
    let f = GgufFile::parse(Writer::new().kv("only", GgufValue::Bool(true)).build()).unwrap();
    assert!(f.get_bool("only").unwrap());
}

#[test]
fn every_truncation_is_an_error_never_a_panic() {
    for w in [small_writer(), full_writer()] {
        let bytes = w.build();
        assert!(GgufFile::parse(bytes.clone()).is_ok());
        for n in 0..bytes.len() {
            let e = match GgufFile::parse(bytes[..n].to_vec()) {
                Ok(_) => panic!("prefix of {n} of {} bytes parsed", bytes.len()),
                Err(e) => e,
            };
            assert!(
                matches!(e, GgufError::Truncated { .. } | GgufError::CountTooLarge { .. } | GgufError::OutOfFile { .. }),
                "prefix {n}: {e}"
            );
        }
    }
}

#[test]
fn truncation_messages_name_the_field_and_offsets() {
    let (bytes, layout) = small_writer().build_with_layout();
    assert_eq!(err_text(bytes[..2].to_vec()), "truncated: magic needs 4 bytes at offset 0, file has 2");
    assert_eq!(err_text(bytes[..6].to_vec()), "truncated: version needs 4 bytes at offset 4, file has 6");
    assert_eq!(err_text(bytes[..20].to_vec()), "truncated: metadata count needs 8 bytes at offset 16, file has 20");
    // Counts are checked against the bytes left before their elements are read.
    assert_eq!(
        err_text(bytes[..66].to_vec()),
        "metadata count: count 4 at offset 16 needs at least 13 bytes per element, but only 42 bytes remain in the file after offset 24"
    );
    let t = &layout.tensors[0];
    assert_eq!(
        err_text(bytes[..t.info_at + 40].to_vec()),
        format!(
            "tensor count: count 2 at offset 8 needs at least 32 bytes per element, but only 40 bytes remain in the file after offset {}",
            t.info_at
        )
    );
    // Cut inside a string value.
    let (bytes, layout) = Writer::new().kv("general.architecture", s("llama")).build_with_layout();
    let cut = layout.value_at[0] + 4 + 8 + 2;
    assert_eq!(
        err_text(bytes[..cut].to_vec()),
        format!("truncated: metadata key #0 'general.architecture' value (string) needs 5 bytes at offset {}, file has {cut}", cut - 2)
    );
    let cut = layout.value_at[0] + 4 + 3;
    assert_eq!(
        err_text(bytes[..cut].to_vec()),
        format!(
            "truncated: metadata key #0 'general.architecture' value (string) length needs 8 bytes at offset {}, file has {cut}",
            cut - 3
        )
    );
    // Cut inside the second element of a string array.
    let (bytes, _) = Writer::new().kv("arr", GgufValue::Array(GgufArray::String(vec!["ab".into(), "c".into()]))).build_with_layout();
    let cut = bytes.len() - 1;
    assert_eq!(
        err_text(bytes[..cut].to_vec()),
        format!("truncated: metadata key #0 'arr' value (array) element 1 (string) needs 1 bytes at offset {cut}, file has {cut}")
    );
    // Cut inside a tensor info.
    let (bytes, layout) = Writer::new().tensor("w", &[32, 2], Q4_1).tensor("b", &[3], F32).build_with_layout();
    let t = &layout.tensors[1];
    let cut = t.type_at + 2;
    assert_eq!(
        err_text(bytes[..cut].to_vec()),
        format!("truncated: tensor #1 b type needs 4 bytes at offset {}, file has {cut}", t.type_at)
    );
    // Header complete, data cut short.
    let e = err_text(bytes[..bytes.len() - 1].to_vec());
    assert!(e.starts_with("tensor b: 12 bytes at data offset 64 (data section starts at "), "{e}");
    assert!(e.ends_with(&format!("run past the end of the file ({} bytes)", bytes.len() - 1)), "{e}");
}

#[test]
fn lying_lengths_and_counts_are_errors_not_allocations() {
    let (bytes, layout) = small_writer().build_with_layout();
    let len = bytes.len() as u64;
    for lie in [u64::MAX, u64::MAX / 2, 1 << 62, len, len + 1, len - 40] {
        // Tensor count and metadata count.
        for at in [TENSOR_COUNT_AT, KV_COUNT_AT] {
            let mut b = bytes.clone();
            patch_u64(&mut b, at, lie);
            let e = parse_err(b);
            assert!(matches!(e, GgufError::CountTooLarge { .. }), "count at {at} = {lie}: {e}");
        }
        // A key's length, a string value's length, a string array's count,
        // a nested array's outer and inner counts, a tensor name's length.
        for (what, at) in [
            ("key length", layout.kv_at[1]),
            ("string value length", layout.value_at[0] + 4),
            ("string array count", layout.value_at[2] + 8),
            ("nested array count", layout.value_at[3] + 8),
            ("inner array count", layout.value_at[3] + 16),
            ("tensor name length", layout.tensors[0].info_at),
        ] {
            let mut b = bytes.clone();
            patch_u64(&mut b, at, lie);
            let e = parse_err(b);
            assert!(
                matches!(
                    e,
                    GgufError::Truncated { .. } | GgufError::CountTooLarge { .. } | GgufError::Utf8 { .. } | GgufError::BadValueType { .. }
                ),
                "{what} = {lie}: {e}"
            );
        }
    }
    // Exact messages for the two kinds.
    let mut b = bytes.clone();
    patch_u64(&mut b, layout.value_at[2] + 8, u64::MAX);
    let remaining = len - (layout.value_at[2] as u64 + 16);
    assert_eq!(
        err_text(b),
        format!(
            "metadata key #2 'arr' value (array) element count (array of string): count 18446744073709551615 at offset {} needs at least 8 bytes per element, but only {remaining} bytes remain in the file after offset {}",
            layout.value_at[2] + 8,
            layout.value_at[2] + 16
        )
    );
    let mut b = bytes.clone();
    patch_u64(&mut b, layout.value_at[0] + 4, len + 1);
    assert_eq!(
        err_text(b),
        format!(
            "truncated: metadata key #0 'general.architecture' value (string) needs {} bytes at offset {}, file has {len}",
            len + 1,
            layout.value_at[0] + 12
        )
    );
    // A count that exactly fits the bytes left, yet whose elements run out.
    let mut b = bytes.clone();
    let remaining = len - (layout.value_at[2] as u64 + 16);
    patch_u64(&mut b, layout.value_at[2] + 8, remaining / 8);
    assert!(GgufFile::parse(b).is_err());
    let mut b = bytes.clone();
    patch_u64(&mut b, layout.value_at[2] + 8, remaining / 8 + 1);
    assert!(matches!(parse_err(b), GgufError::CountTooLarge { .. }));
}

#[test]
fn huge_numeric_array_count_is_rejected_before_allocating() {
    let mut b = Writer::new().build();
    patch_u64(&mut b, KV_COUNT_AT, 1);
    put_str(&mut b, "big");
    put_u32(&mut b, 9);
    put_u32(&mut b, 10); // u64 elements
    put_u64(&mut b, u64::MAX / 8);
    b.extend_from_slice(&[0; 64]);
    assert_eq!(
        err_text(b),
        "metadata key #0 'big' value (array) element count (array of u64): count 2305843009213693951 at offset 43 needs at least 8 bytes per element, but only 64 bytes remain in the file after offset 51"
    );
}

#[test]
fn unsupported_tensor_type_message_is_exact() {
    let (bytes, layout) = Writer::new().tensor("blk.0.ffn_down.weight", &[256, 4], Q4_K).build_with_layout();
    for (id, text) in [
        (10, "unsupported GGML type 10 (q2_k) in tensor blk.0.ffn_down.weight"),
        (13, "unsupported GGML type 13 (q5_k) in tensor blk.0.ffn_down.weight"),
        (4, "unsupported GGML type 4 in tensor blk.0.ffn_down.weight"),
        (99, "unsupported GGML type 99 in tensor blk.0.ffn_down.weight"),
        (u32::MAX, "unsupported GGML type 4294967295 in tensor blk.0.ffn_down.weight"),
    ] {
        let mut b = bytes.clone();
        patch_u32(&mut b, layout.tensors[0].type_at, id);
        assert_eq!(err_text(b), text);
    }
}

#[test]
fn bad_dims_are_rejected() {
    let (bytes, layout) = Writer::new().tensor("blk.0.attn_q.weight", &[64, 2], Q4_1).build_with_layout();
    let t = &layout.tensors[0];
    for n in [0, 5, u32::MAX] {
        let mut b = bytes.clone();
        patch_u32(&mut b, t.n_dims_at, n);
        assert_eq!(err_text(b), format!("tensor blk.0.attn_q.weight: n_dims is {n} at offset {}, expected 1 to 4", t.n_dims_at));
    }
    let mut b = bytes.clone();
    patch_u64(&mut b, t.dims_at, 100);
    assert_eq!(err_text(b), "tensor blk.0.attn_q.weight: row length 100 is not a multiple of q4_1's block of 32");
    let mut b = bytes.clone();
    patch_u64(&mut b, t.dims_at + 8, 0);
    assert_eq!(err_text(b), "tensor blk.0.attn_q.weight: dims [64, 0] has a 0 at index 1; every dimension must be at least 1");
    // Element count or byte size overflowing.
    for (d0, d1) in [(1 << 40, 1 << 40), (u64::MAX - 31, 2), (32, u64::MAX)] {
        let mut b = bytes.clone();
        patch_u64(&mut b, t.dims_at, d0);
        patch_u64(&mut b, t.dims_at + 8, d1);
        assert!(matches!(parse_err(b), GgufError::TooLarge { .. }), "{d0} x {d1}");
    }
    // Large but representable: out of the file instead.
    let mut b = bytes.clone();
    patch_u64(&mut b, t.dims_at + 8, 1 << 30);
    assert!(matches!(parse_err(b), GgufError::OutOfFile { .. }));
    let e = err_text(Writer::new().tensor("k", &[255], Q6_K).build());
    assert_eq!(e, "tensor k: row length 255 is not a multiple of q6_k's block of 256");
}

#[test]
fn bad_offsets_are_rejected() {
    let (bytes, layout) = small_writer().build_with_layout();
    let t = &layout.tensors[1]; // "b", 12 bytes at offset 64
    for (off, want) in [
        (65, "tensor b: data offset 65 is not a multiple of the alignment 32"),
        (16, "tensor b: data offset 16 is not a multiple of the alignment 32"),
        (u64::MAX, "tensor b: data offset 18446744073709551615 is not a multiple of the alignment 32"),
    ] {
        let mut b = bytes.clone();
        patch_u64(&mut b, t.offset_at, off);
        assert_eq!(err_text(b), want);
    }
    for off in [96, 1 << 20, u64::MAX - 31, u64::MAX / 32 * 32] {
        let mut b = bytes.clone();
        patch_u64(&mut b, t.offset_at, off);
        let e = parse_err(b);
        assert!(matches!(e, GgufError::OutOfFile { .. }), "offset {off}: {e}");
    }
    // Overlap: "b" moved onto "w".
    let mut b = bytes.clone();
    patch_u64(&mut b, t.offset_at, 32);
    assert_eq!(err_text(b), "tensor b: data bytes 32..44 overlap tensor w's bytes 0..40");
}

#[test]
fn duplicates_are_rejected() {
    let e = err_text(Writer::new().kv("a", GgufValue::U8(1)).kv("b", GgufValue::U8(2)).kv("a", GgufValue::U8(3)).build());
    assert_eq!(e, "duplicate metadata key 'a': key #2 at offset 52 repeats key #0");
    let (bytes, layout) = Writer::new().tensor("w", &[4], F32).tensor("v", &[4], F32).tensor("w", &[4], F32).build_with_layout();
    assert_eq!(err_text(bytes), format!("duplicate tensor name 'w': tensor #2 at offset {} repeats tensor #0", layout.tensors[2].info_at));
}

#[test]
fn bad_alignment_is_rejected() {
    for (v, found) in [
        (GgufValue::U32(0), "u32 0"),
        (GgufValue::U32(3), "u32 3"),
        (GgufValue::U32(48), "u32 48"),
        (GgufValue::I32(-32), "i32 -32"),
        (GgufValue::U64(1 << 32), "u64 4294967296"),
        (GgufValue::F32(32.0), "f32 32"),
        (s("32"), "string \"32\""),
    ] {
        let e = err_text(small_writer().kv("general.alignment", v).build());
        assert_eq!(e, format!("general.alignment is {found}, expected a nonzero power of two that fits u32"));
    }
}

#[test]
fn bad_magic_and_version_are_rejected() {
    let bytes = small_writer().build();
    let mut b = bytes.clone();
    b[..4].copy_from_slice(b"GGML");
    assert_eq!(err_text(b), "not a GGUF file: the first 4 bytes are [47, 47, 4d, 4c], expected \"GGUF\" [47, 47, 55, 46]");
    assert!(matches!(parse_err(b"PK\x03\x04 not gguf".to_vec()), GgufError::BadMagic { .. }));
    for v in [0, 1, 4, 0xffff_ffff] {
        let mut b = bytes.clone();
        patch_u32(&mut b, 4, v);
        assert_eq!(err_text(b), format!("unsupported GGUF version {v} at offset 4 (this reader accepts versions 2 and 3)"));
    }
    let mut b = bytes.clone();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert_eq!(
        err_text(b),
        "big-endian GGUF files are not supported (the version field at offset 4 reads 50331648 little-endian, 3 big-endian)"
    );
}

#[test]
fn bad_encodings_are_rejected() {
    let (bytes, layout) = small_writer().build_with_layout();
    // Invalid UTF-8 in a key, a string value, a string array element, a tensor name.
    for (what, at) in [
        ("key", layout.kv_at[0] + 8),
        ("value", layout.value_at[0] + 12),
        ("array element", layout.value_at[2] + 16 + 8),
        ("tensor name", layout.tensors[0].info_at + 8),
    ] {
        let mut b = bytes.clone();
        b[at] = 0xff;
        let e = parse_err(b);
        assert!(matches!(&e, GgufError::Utf8 { offset, .. } if *offset == at as u64), "{what}: {e}");
    }
    let mut b = bytes.clone();
    b[layout.value_at[0] + 12] = 0xc3;
    assert_eq!(
        err_text(b),
        format!(
            "metadata key #0 'general.architecture' value (string) at offset {} is not valid UTF-8: invalid utf-8 sequence of 1 bytes from index 0",
            layout.value_at[0] + 12
        )
    );
    // Unknown value type, unknown array element type.
    let mut b = bytes.clone();
    patch_u32(&mut b, layout.value_at[1], 13);
    assert_eq!(
        err_text(b),
        format!("metadata key #1 'n' value type at offset {}: unknown metadata value type 13 (expected 0 to 12)", layout.value_at[1])
    );
    let mut b = bytes.clone();
    patch_u32(&mut b, layout.value_at[2] + 4, 0x8000_0000);
    assert!(matches!(parse_err(b), GgufError::BadValueType { found: 0x8000_0000, .. }));
    // A bool byte other than 0 or 1, as a value and inside an array.
    let mut b = Writer::new().kv("flag", GgufValue::Bool(true)).kv("flags", GgufValue::Array(GgufArray::Bool(vec![false, true]))).build();
    let n = b.len();
    b[n - 1] = 2;
    assert_eq!(
        err_text(b.clone()),
        format!("metadata key #1 'flags' value (array) element 1 (bool) at offset {}: bool byte is 2, expected 0 or 1", n - 1)
    );
    let at = 24 + 8 + 4 + 4;
    b[n - 1] = 1;
    b[at] = 7;
    assert_eq!(err_text(b), format!("metadata key #0 'flag' value (bool) at offset {at}: bool byte is 7, expected 0 or 1"));
    // An empty key and an empty tensor name.
    let e = err_text(Writer::new().kv("", GgufValue::U8(0)).build());
    assert_eq!(e, "metadata key #0 at offset 24 is empty");
    let e = err_text(Writer::new().tensor("", &[1], F32).build());
    assert_eq!(e, "tensor #0 at offset 24 has an empty name");
}

#[test]
fn array_nesting_depth_is_limited() {
    let nest = |depth: usize| {
        let mut a = GgufArray::U8(vec![1]);
        for _ in 1..depth {
            a = GgufArray::Array(vec![a]);
        }
        GgufValue::Array(a)
    };
    let ok = nest(MAX_ARRAY_DEPTH);
    let f = GgufFile::parse(Writer::new().kv("deep", ok.clone()).build()).unwrap();
    assert_eq!(f.get("deep"), Some(&ok));
    let e = parse_err(Writer::new().kv("deep", nest(MAX_ARRAY_DEPTH + 1)).build());
    assert!(matches!(e, GgufError::TooDeep { .. }), "{e}");
    assert!(e.to_string().contains("arrays nested deeper than 8 levels"), "{e}");
    // A file claiming a very deep nest of arrays of arrays.
    let mut b = Writer::new().build();
    patch_u64(&mut b, KV_COUNT_AT, 1);
    put_str(&mut b, "deep");
    put_u32(&mut b, 9);
    for _ in 0..10_000 {
        put_u32(&mut b, 9);
        put_u64(&mut b, 1);
    }
    assert!(matches!(parse_err(b), GgufError::TooDeep { .. }));
}

/// xorshift64*: deterministic, no dependencies.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn random_corruptions_never_panic() {
    let (bytes, layout) = small_writer().build_with_layout();
    let header_end = layout.data_start;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut errors = 0;
    for _ in 0..20_000 {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(header_end);
            match rng.below(4) {
                0 => b[at] ^= 1 << rng.below(8),
                1 => b[at] = rng.next() as u8,
                2 if at + 8 <= b.len() => patch_u64(&mut b, at, rng.next() >> rng.below(64)),
                _ => b[at] = [0, 1, 0xff, 0x80][rng.below(4)],
            }
        }
        if rng.below(4) == 0 {
            b.truncate(rng.below(b.len()));
        }
        if let Err(e) = GgufFile::parse(b) {
            assert!(!e.to_string().is_empty());
            errors += 1;
        }
    }
    assert!(errors > 10_000, "only {errors} of 20000 corruptions were rejected");
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("rlx-gguf-test-{}-{name}.gguf", std::process::id()))
}

#[test]
fn open_maps_the_file_and_errors_carry_the_path() {
    let path = temp_path("open");
    let w = full_writer();
    std::fs::write(&path, w.build()).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.path(), Some(path.as_path()));
    assert_eq!(f.tensor_data(f.tensor("q8_0").unwrap()), &w.tensors[7].data[..]);
    let e = f.get_u32("missing.key").unwrap_err();
    assert_eq!(e.to_string(), format!("{}: metadata key 'missing.key' not found", path.display()));
    assert!(matches!(e.kind(), GgufError::MissingKey { .. }));
    drop(f);

    let mut bad = w.build();
    patch_u32(&mut bad, 4, 9);
    std::fs::write(&path, &bad).unwrap();
    let e = GgufFile::open(&path).unwrap_err();
    assert_eq!(e.to_string(), format!("{}: unsupported GGUF version 9 at offset 4 (this reader accepts versions 2 and 3)", path.display()));
    assert!(matches!(e.kind(), GgufError::UnsupportedVersion { found: 9 }));

    std::fs::write(&path, b"").unwrap();
    let e = GgufFile::open(&path).unwrap_err();
    assert!(matches!(e.kind(), GgufError::Truncated { .. } | GgufError::Io { .. }), "{e}");
    assert!(e.to_string().starts_with(&path.display().to_string()), "{e}");
    std::fs::remove_file(&path).unwrap();

    let missing = Path::new("/nonexistent/dir/model.gguf");
    let e = GgufFile::open(missing).unwrap_err();
    assert!(matches!(e, GgufError::Io { .. }));
    assert!(e.to_string().starts_with("/nonexistent/dir/model.gguf: "), "{e}");
}

fn real_model(test: &str) -> Option<PathBuf> {
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{test}: {} is missing and RLX_REQUIRE_MODELS=1", path.display());
    }
    eprintln!("SKIPPED {test}: {} is missing", path.display());
    None
}

#[test]
fn reads_smollm2_q4_1() {
    let Some(path) = real_model("reads_smollm2_q4_1") else { return };
    let start = std::time::Instant::now();
    let f = GgufFile::open(&path).unwrap();
    eprintln!(
        "{}: GGUF v{}, {} metadata entries, {} tensors, data at {}, opened in {:?}",
        path.display(),
        f.version(),
        f.metadata().len(),
        f.tensors().len(),
        f.data_start(),
        start.elapsed()
    );
    assert_eq!(f.version(), 3);
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.get_u32("llama.attention.head_count").unwrap(), 9);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(f.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(), 1e-5);
    assert!(!f.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.get_str_array("general.languages").unwrap(), ["en"]);

    assert_eq!(f.tensors().len(), 272);
    assert_eq!(f.data_start(), 1_785_664);
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.ttype, TensorType::Quant(QFormat::Q8_0));
    assert_eq!(embd.dims, [576, 49152]);
    assert_eq!(embd.bytes, 30_081_024);
    assert_eq!(f.tensor_data(embd).len(), 30_081_024);
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.ttype, TensorType::Quant(QFormat::Q4_1));
    assert_eq!(q.dims, [576, 576]);
    assert_eq!(q.bytes, 576 / 32 * 20 * 576);
    let down = f.tensor("blk.0.ffn_down.weight").unwrap();
    assert_eq!((down.dims.as_slice(), down.ttype), (&[1536u64, 576][..], TensorType::Quant(QFormat::Q4_1)));
    assert_eq!(f.data_start() + f.tensor("blk.0.attn_norm.weight").unwrap().offset, 31_866_688);
    let norm = f.tensor("output_norm.weight").unwrap();
    assert_eq!(norm.ttype, TensorType::F32);
    assert_eq!(norm.dims, [576]);
    // RMS-norm weights are finite and mostly positive.
    let w: Vec<f32> = f.tensor_data(norm).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert!(w.iter().all(|x| x.is_finite()) && w.iter().filter(|&&x| x > 0.0).count() > 500);
    let count = |t: TensorType| f.tensors().iter().filter(|x| x.ttype == t).count();
    assert_eq!((count(TensorType::Quant(QFormat::Q4_1)), count(TensorType::F32), count(TensorType::Quant(QFormat::Q8_0))), (210, 61, 1));

    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(f.get_u32("llama.vocab_size").unwrap() as usize, tokens.len());
    let types = f.get_i32_array("tokenizer.ggml.token_type").unwrap();
    assert!(matches!(types, Cow::Borrowed(_)));
    assert_eq!(types.len(), 49152);
    let merges = f.get_str_array("tokenizer.ggml.merges").unwrap();
    assert_eq!(merges.len(), 48900);
    assert!(merges.iter().all(|m| m.contains(' ')));
    let bos = f.get_u32("tokenizer.ggml.bos_token_id").unwrap() as usize;
    let eos = f.get_u32("tokenizer.ggml.eos_token_id").unwrap() as usize;
    assert_eq!((tokens[bos].as_str(), tokens[eos].as_str()), ("<|im_start|>", "<|im_end|>"));
    let template = f.get_str("tokenizer.chat_template").unwrap();
    assert!(template.contains("<|im_start|>"), "{template}");
}

#[test]
fn real_file_prefixes_fail_cleanly() {
    let Some(path) = real_model("real_file_prefixes_fail_cleanly") else { return };
    let bytes = std::fs::read(&path).unwrap();
    let header_end = GgufFile::parse(bytes.clone()).unwrap().data_start() as usize;
    // A spread of cut points through the header, and one in the data.
    for n in (0..header_end).step_by(9973).chain([header_end - 1, header_end, bytes.len() - 1]) {
        let e = parse_err(bytes[..n].to_vec());
        assert!(
            matches!(e, GgufError::Truncated { .. } | GgufError::CountTooLarge { .. } | GgufError::OutOfFile { .. }),
            "cut at {n}: {e}"
        );
    }
}
