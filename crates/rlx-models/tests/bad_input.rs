//! Bad files and bad input give clear errors, never a panic or a
//! complete-looking partial output. Small synthetic files in a temp dir.

use std::path::{Path, PathBuf};

use rlx::{DType, Device, Tensor, WeightStore};
use rlx_models::safetensors::{write_safetensors, SafetensorsFile};
use rlx_models::{
    bert_weight_specs, load_bert_weights, random_weights, BertConfig, EmbedderOptions, EmbeddingWriter, ModelError, OutputFormat,
    SentenceEmbedder, TextLines,
};

fn tiny() -> BertConfig {
    BertConfig {
        vocab_size: 50,
        hidden_size: 8,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        intermediate_size: 16,
        max_position_embeddings: 32,
        ..BertConfig::minilm_l6()
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rlx-models-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// The tiny model's weights as (name, tensor), optionally with a `bert.` prefix.
fn tiny_tensors(prefix: &str) -> Vec<(String, Tensor)> {
    let cfg = tiny();
    let store = random_weights(&cfg, 7, DType::F32).expect("random weights");
    bert_weight_specs(&cfg)
        .into_iter()
        .map(|(n, _)| {
            let t = store.get(&n).expect("weight present");
            (format!("{prefix}{n}"), (*t).clone())
        })
        .collect()
}

fn write(path: &Path, tensors: &[(String, Tensor)]) {
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_safetensors(path, &refs).expect("write safetensors");
}

fn load(path: &Path) -> Result<WeightStore, ModelError> {
    let store = WeightStore::new();
    load_bert_weights(path, &tiny(), DType::F32, &store).map(|_| store)
}

fn err_text(r: Result<WeightStore, ModelError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_good_file_loads_with_or_without_the_bert_prefix_and_in_any_float_dtype() {
    let dir = temp_dir("good");
    let plain = tiny_tensors("");
    for (prefix, dtype) in [("", DType::F32), ("bert.", DType::F16), ("bert.", DType::BF16)] {
        let tensors: Vec<(String, Tensor)> = tiny_tensors(prefix).into_iter().map(|(n, t)| (n, t.to_dtype(dtype))).collect();
        let path = dir.join(format!("{dtype}.safetensors"));
        write(&path, &tensors);
        let store = load(&path).expect("loads");
        let tol = if dtype == DType::F32 { 0.0 } else { 1e-2 };
        for (name, want) in &plain {
            let got = store.get(name).unwrap_or_else(|| panic!("{name} missing ({prefix}, {dtype})"));
            assert_eq!(got.dtype(), DType::F32, "converted to the asked dtype");
            for (a, b) in got.to_f32().iter().zip(want.to_f32()) {
                assert!((a - b).abs() <= tol * b.abs().max(1.0), "{name} {dtype}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn a_truncated_file_is_refused() {
    let dir = temp_dir("truncated");
    let path = dir.join("model.safetensors");
    write(&path, &tiny_tensors(""));
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() - 100]).expect("truncate");
    let e = err_text(load(&path));
    assert!(e.contains("past the data section"), "{e}");
    // Cut inside the header, and below the length field.
    std::fs::write(&path, &bytes[..20]).expect("truncate");
    let e = err_text(load(&path));
    assert!(e.contains("truncated"), "{e}");
    std::fs::write(&path, &bytes[..3]).expect("truncate");
    let e = err_text(load(&path));
    assert!(e.contains("truncated"), "{e}");
}

/// Rewrites one tensor's data_offsets in the header (same header length).
fn patch_offsets(path: &Path, name: &str, f: impl Fn([u64; 2]) -> [u64; 2]) {
    let bytes = std::fs::read(path).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let offs = &mut header[name]["data_offsets"];
    let old = [offs[0].as_u64().expect("start"), offs[1].as_u64().expect("end")];
    *offs = serde_json::json!(f(old));
    let mut h = header.to_string().into_bytes();
    while h.len() < n {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).expect("write");
}

#[test]
fn a_header_that_lies_about_offsets_is_refused() {
    let dir = temp_dir("lying");
    let path = dir.join("model.safetensors");
    let name = "encoder.layer.0.output.dense.bias";
    // Beyond the end of the data.
    write(&path, &tiny_tensors(""));
    patch_offsets(&path, name, |[a, b]| [a + 1_000_000, b + 1_000_000]);
    let e = err_text(load(&path));
    assert!(e.contains(name) && e.contains("past the data section"), "{e}");
    // A range that does not match dtype × shape.
    write(&path, &tiny_tensors(""));
    patch_offsets(&path, name, |[a, b]| [a, b - 4]);
    let e = err_text(load(&path));
    assert!(e.contains(name) && e.contains("needs 32"), "{e}");
    // Overlapping another tensor.
    write(&path, &tiny_tensors(""));
    patch_offsets(&path, name, |[a, b]| [a - 4, b - 4]);
    let e = err_text(load(&path));
    assert!(e.contains("overlap"), "{e}");
    // Not JSON at all.
    std::fs::write(&path, [16u64.to_le_bytes().as_slice(), b"not json at all!".as_slice()].concat()).expect("write");
    let e = err_text(load(&path));
    assert!(e.contains("not a JSON object"), "{e}");
}

#[test]
fn missing_extra_and_misshaped_tensors_are_named() {
    let dir = temp_dir("tensors");
    let path = dir.join("model.safetensors");

    let mut t = tiny_tensors("");
    t.retain(|(n, _)| n != "encoder.layer.0.attention.self.key.weight");
    write(&path, &t);
    let e = err_text(load(&path));
    assert!(e.contains("encoder.layer.0.attention.self.key.weight") && e.contains("missing") && e.contains("[8, 8]"), "{e}");

    let mut t = tiny_tensors("");
    t.push(("encoder.layer.1.attention.self.key.weight".into(), Tensor::from_f32([8, 8], &[0.5; 64]).expect("t")));
    write(&path, &t);
    let e = err_text(load(&path));
    assert!(e.contains("encoder.layer.1.attention.self.key.weight") && e.contains("unexpected"), "{e}");

    let mut t = tiny_tensors("");
    for (n, tensor) in t.iter_mut() {
        if n == "encoder.layer.0.intermediate.dense.weight" {
            *tensor = Tensor::from_f32([8, 16], &[0.25; 128]).expect("t");
        }
    }
    write(&path, &t);
    let e = err_text(load(&path));
    assert!(e.contains("intermediate.dense.weight") && e.contains("[8, 16]") && e.contains("[16, 8]"), "{e}");

    // Buffers and heads a BertModel checkpoint carries are not errors.
    let mut t = tiny_tensors("bert.");
    t.push(("bert.embeddings.position_ids".into(), Tensor::from_i64([1, 32], &(0..32).collect::<Vec<i64>>()).expect("t")));
    t.push(("bert.pooler.dense.bias".into(), Tensor::from_f32([8], &[0.1; 8]).expect("t")));
    write(&path, &t);
    load(&path).expect("buffers and pooler are ignored");
    assert_eq!(
        SafetensorsFile::open(&path).expect("open").info("bert.embeddings.position_ids").map(|i| i.shape.clone()),
        Some(vec![1, 32])
    );
}

fn write_config(dir: &Path, patch: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let mut v = serde_json::json!({
        "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 16, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
        "max_position_embeddings": 32, "type_vocab_size": 2, "vocab_size": 50
    });
    patch(&mut v);
    let p = dir.join("config.json");
    std::fs::write(&p, v.to_string()).expect("write config");
    p
}

#[test]
fn configs_of_other_architectures_are_refused() {
    let dir = temp_dir("config");
    let p = write_config(&dir, |_| {});
    assert_eq!(BertConfig::from_file(&p).expect("a BERT config"), tiny());

    let p = write_config(&dir, |v| v["model_type"] = "llama".into());
    let e = BertConfig::from_file(&p).expect_err("llama").to_string();
    assert!(e.contains("llama") && e.contains("bert"), "{e}");

    let p = write_config(&dir, |v| v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]));
    let e = BertConfig::from_file(&p).expect_err("gpt2").to_string();
    assert!(e.contains("GPT2LMHeadModel") && e.contains("BertModel"), "{e}");

    let p = write_config(&dir, |v| v["num_attention_heads"] = 3.into());
    let e = BertConfig::from_file(&p).expect_err("heads").to_string();
    assert!(e.contains("not a multiple"), "{e}");

    std::fs::write(&p, "{ not json").expect("write");
    let e = BertConfig::from_file(&p).expect_err("bad json").to_string();
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn missing_files_are_named() {
    let dir = temp_dir("missing");
    let e = SentenceEmbedder::load(dir.join("nope"), Device::Cpu).err().expect("no dir").to_string();
    assert!(e.contains("nope") && e.contains("does not exist"), "{e}");
    let e = SentenceEmbedder::load(&dir, Device::Cpu).err().expect("no config").to_string();
    assert!(e.contains("config.json"), "{e}");
    write_config(&dir, |_| {});
    let e = SentenceEmbedder::load(&dir, Device::Cpu).err().expect("no tokenizer").to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    let bad = EmbedderOptions { batch_size: 0, ..EmbedderOptions::default() };
    let e = SentenceEmbedder::load_with(&dir, Device::Cpu, bad).err().expect("batch 0").to_string();
    assert!(e.contains("batch size"), "{e}");
}

#[test]
fn vocab_txt_and_pytorch_bin_directories_are_not_supported_with_the_conversion() {
    let dir = temp_dir("unsupported");
    write_config(&dir, |_| {});
    std::fs::write(dir.join("vocab.txt"), "[PAD]\n").expect("write");
    let e = SentenceEmbedder::load(&dir, Device::Cpu).err().expect("vocab.txt only").to_string();
    assert!(e.contains("not supported") && e.contains("vocab.txt") && e.contains("tokenizer.json"), "{e}");
    assert!(e.contains("AutoTokenizer.from_pretrained") && e.contains(&dir.display().to_string()), "{e}");

    std::fs::write(dir.join("tokenizer.json"), "{}").expect("write");
    std::fs::write(dir.join("pytorch_model.bin"), "").expect("write");
    let e = SentenceEmbedder::load(&dir, Device::Cpu).err().expect("pytorch_model.bin only").to_string();
    assert!(e.contains("not supported") && e.contains("pytorch_model.bin") && e.contains("save_pretrained"), "{e}");

    // With model.safetensors beside it, the .bin is ignored and loading goes on
    // (to the next problem: this tokenizer.json is empty).
    write(&dir.join("model.safetensors"), &tiny_tensors(""));
    let e = SentenceEmbedder::load(&dir, Device::Cpu).err().expect("bad tokenizer").to_string();
    assert!(!e.contains("not supported") && e.contains("tokenizer"), "{e}");
}

#[test]
fn an_invalid_utf8_line_is_named_and_empty_lines_are_texts() {
    let input: &[u8] = b"first\n\nthird\r\n\xff\xfe bad\nfifth";
    let mut lines = TextLines::new(input, "texts.txt");
    assert_eq!(lines.next_batch(3).expect("three good lines"), vec!["first", "", "third"]);
    let e = lines.next_batch(3).expect_err("line 4 is not UTF-8").to_string();
    assert!(e.contains("texts.txt line 4") && e.contains("UTF-8"), "{e}");

    let all: Vec<String> = TextLines::new(&b"a\n\nb"[..], "x").map(|r| r.expect("utf-8")).collect();
    assert_eq!(all, vec!["a", "", "b"]);
    let all: Vec<String> = TextLines::new(&b"\n"[..], "x").map(|r| r.expect("utf-8")).collect();
    assert_eq!(all, vec![""], "one empty line is one empty text");
}

#[test]
fn output_is_complete_or_absent() {
    let dir = temp_dir("output");
    let dest = dir.join("out.npy");
    let tmp: PathBuf;

    // Dropped before finish (an error half-way): nothing is left behind.
    {
        let mut w = EmbeddingWriter::to_file(&dest, OutputFormat::Npy, 3).expect("create");
        tmp = w.temp_path().expect("a temporary file").to_path_buf();
        assert_eq!(tmp.parent(), Some(dir.as_path()), "beside the destination, so the rename stays on one file system");
        w.write(&[1.0, 2.0, 3.0]).expect("write");
        assert!(tmp.exists() && !dest.exists(), "written to the temporary name first");
        let e = w.write(&[1.0]).expect_err("wrong width").to_string();
        assert!(e.contains("width 3"), "{e}");
    }
    assert!(!tmp.exists() && !dest.exists(), "no partial file after an abandoned write");

    // Finished: the npy header carries the final row count.
    let mut w = EmbeddingWriter::to_file(&dest, OutputFormat::Npy, 3).expect("create");
    let tmp = w.temp_path().expect("a temporary file").to_path_buf();
    w.write(&[1.0, 2.0, 3.0]).expect("write");
    w.write(&[4.0, 5.0, 6.5]).expect("write");
    assert_eq!(w.finish().expect("finish"), 2);
    assert!(!tmp.exists());
    let bytes = std::fs::read(&dest).expect("read");
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + hlen]).expect("ascii");
    assert!(header.contains("'shape': (2, 3)") && header.ends_with('\n') && (10 + hlen).is_multiple_of(64), "{header:?}");
    let data: Vec<f32> = bytes[10 + hlen..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect();
    assert_eq!(data, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.5]);

    let dest = dir.join("out.jsonl");
    let mut w = EmbeddingWriter::to_file(&dest, OutputFormat::Jsonl, 2).expect("create");
    w.write(&[0.5, -0.25]).expect("write");
    w.write(&[1e-8, 3.0]).expect("write");
    w.finish().expect("finish");
    let text = std::fs::read_to_string(&dest).expect("read");
    let rows: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1]["index"], 1);
    assert_eq!(rows[1]["embedding"][0].as_f64().map(|x| x as f32), Some(1e-8));
}

/// A `Write` whose bytes the test can read afterwards.
#[derive(Clone, Default)]
struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
impl std::io::Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn npy_and_jsonl_to_a_stream() {
    let sink = Shared::default();
    let mut w = EmbeddingWriter::to_stream(Box::new(sink.clone()), "test stream", OutputFormat::Npy, 2).expect("create");
    w.write(&[1.5, -2.0]).expect("write");
    assert!(sink.0.lock().expect("lock").is_empty(), "npy is spooled until finish");
    assert_eq!(w.finish().expect("finish"), 1);
    let bytes = sink.0.lock().expect("lock").clone();
    assert_eq!(bytes.len(), 128 + 8);
    assert!(std::str::from_utf8(&bytes[10..128]).expect("ascii").contains("'shape': (1, 2)"));
    assert_eq!(&bytes[128..], [1.5f32.to_le_bytes(), (-2.0f32).to_le_bytes()].concat());

    let sink = Shared::default();
    let mut w = EmbeddingWriter::to_stream(Box::new(sink.clone()), "test stream", OutputFormat::Jsonl, 1).expect("create");
    w.write(&[0.25]).expect("write");
    w.finish().expect("finish");
    assert_eq!(String::from_utf8(sink.0.lock().expect("lock").clone()).expect("utf-8"), "{\"index\":0,\"embedding\":[0.25]}\n");
}

#[test]
fn a_named_pooling_module_without_its_config_is_refused() {
    let dir = temp_dir("pooling");
    let modules = r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
                      {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"}]"#;
    std::fs::write(dir.join("modules.json"), modules).unwrap();
    let err = rlx_models::SentenceConfig::from_dir(&dir, &tiny()).unwrap_err().to_string();
    assert!(err.contains("Pooling") && err.contains("1_Pooling"), "{err}");
    // With the config present, CLS pooling is read from it.
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    std::fs::write(dir.join("1_Pooling/config.json"), r#"{"pooling_mode_cls_token": true, "pooling_mode_mean_tokens": false}"#).unwrap();
    let cfg = rlx_models::SentenceConfig::from_dir(&dir, &tiny()).unwrap();
    assert_eq!(cfg.pooling, rlx_models::Pooling::Cls);
    // A max_seq_length that is not a positive integer is an error, not ignored.
    std::fs::write(dir.join("sentence_bert_config.json"), r#"{"max_seq_length": "long"}"#).unwrap();
    let err = rlx_models::SentenceConfig::from_dir(&dir, &tiny()).unwrap_err().to_string();
    assert!(err.contains("max_seq_length"), "{err}");
}
