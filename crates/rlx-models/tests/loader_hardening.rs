//! Files that lie, point somewhere odd or hold poison: each is refused with
//! a message about the file, promptly, and never writes or hangs. Small
//! synthetic files in a temp dir (the tokenizer case uses the real model's
//! tokenizer.json and skips without it).

mod common;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rlx::{DType, Tensor, WeightStore};
use rlx_models::safetensors::{write_safetensors, SafetensorsFile};
use rlx_models::{
    bert_weight_specs, load_bert_weights, random_weights, BertConfig, EmbeddingWriter, ModelError, OutputFormat, SentenceConfig,
    TextTokenizer,
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
    let d = std::env::temp_dir().join(format!("rlx-hardening-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display()));
    d
}

fn tiny_tensors() -> Vec<(String, Tensor)> {
    let cfg = tiny();
    let store = random_weights(&cfg, 7, DType::F32).unwrap_or_else(|e| panic!("{e}"));
    bert_weight_specs(&cfg)
        .into_iter()
        .map(|(n, _)| {
            let t = store.get(&n).unwrap_or_else(|| panic!("{n} missing"));
            (n, (*t).clone())
        })
        .collect()
}

fn write(path: &Path, tensors: &[(String, Tensor)]) {
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_safetensors(path, &refs).unwrap_or_else(|e| panic!("{e}"));
}

fn load_err(path: &Path, cfg: &BertConfig) -> String {
    match load_bert_weights(path, cfg, DType::F32, &WeightStore::new()) {
        Ok(()) => panic!("{} loaded but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

/// Runs `f` on another thread and fails if it takes longer than `limit`
/// (a FIFO opened for reading blocks until a writer comes: forever here).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).unwrap_or_else(|_| panic!("still running after {limit:?}: it hangs"))
}

fn mkfifo(path: &Path) {
    let status = std::process::Command::new("mkfifo").arg(path).status().unwrap_or_else(|e| panic!("mkfifo: {e}"));
    assert!(status.success(), "mkfifo {}", path.display());
}

#[test]
fn a_config_with_absurd_sizes_is_refused_before_anything_is_allocated() {
    let base = serde_json::json!({
        "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 32, "vocab_size": 50
    });
    for (key, value) in [
        ("num_hidden_layers", serde_json::json!(1_000_000_000_000u64)),
        ("hidden_size", serde_json::json!(1u64 << 40)),
        ("vocab_size", serde_json::json!(u64::MAX)),
        ("max_position_embeddings", serde_json::json!(1u64 << 33)),
        ("type_vocab_size", serde_json::json!(1u64 << 20)),
    ] {
        let mut v = base.clone();
        v[key] = value.clone();
        let start = Instant::now();
        let e = BertConfig::from_json(Path::new("config.json"), &v.to_string()).expect_err(key).to_string();
        assert!(e.contains(key) && e.contains(&value.to_string()) && e.contains("corrupt"), "{e}");
        assert!(start.elapsed() < Duration::from_secs(1));
    }
    let mut v = base.clone();
    v["layer_norm_eps"] = serde_json::json!(-1.0);
    let e = BertConfig::from_json(Path::new("config.json"), &v.to_string()).expect_err("negative eps").to_string();
    assert!(e.contains("layer_norm_eps"), "{e}");
}

#[test]
fn a_config_that_disagrees_with_the_weights_names_both() {
    let dir = temp_dir("layers");
    let path = dir.join("model.safetensors");
    write(&path, &tiny_tensors());
    // The bound above lets 1000 layers through; the file has one.
    let e = load_err(&path, &BertConfig { num_hidden_layers: 1000, ..tiny() });
    assert!(e.contains("num_hidden_layers 1000") && e.contains("1 encoder layer"), "{e}");
    let e = load_err(&path, &BertConfig { vocab_size: 60, ..tiny() });
    assert!(e.contains("vocab_size 60") && e.contains("[50, 8]"), "{e}");

    // type_vocab_size 0 beside a stored [2, h] table: the message is about
    // the config value, not an "unexpected tensor".
    let e = load_err(&path, &BertConfig { type_vocab_size: 0, ..tiny() });
    assert!(e.contains("type_vocab_size 0") && e.contains("set type_vocab_size to 2"), "{e}");
    // ...while an empty [0, h] table with type_vocab_size 0 loads.
    let mut tensors: Vec<(String, Tensor)> =
        tiny_tensors().into_iter().filter(|(n, _)| n != "embeddings.token_type_embeddings.weight").collect();
    let empty = Tensor::from_f32([0, 8], &[]).unwrap_or_else(|e| panic!("{e}"));
    tensors.push(("embeddings.token_type_embeddings.weight".into(), empty));
    write(&path, &tensors);
    load_bert_weights(&path, &BertConfig { type_vocab_size: 0, ..tiny() }, DType::F32, &WeightStore::new())
        .unwrap_or_else(|e| panic!("an empty token-type table with type_vocab_size 0 loads: {e}"));
}

#[test]
fn nan_and_infinite_weights_are_refused_in_every_float_dtype() {
    let dir = temp_dir("nan");
    for (dtype, poison) in
        [(DType::F32, f32::NAN), (DType::F16, f32::INFINITY), (DType::BF16, f32::NEG_INFINITY), (DType::F32, f32::INFINITY)]
    {
        let mut tensors = tiny_tensors();
        let (name, t) = &mut tensors[5];
        let mut values = t.to_f32();
        values[3] = poison;
        *t = Tensor::from_f32(t.dims().to_vec(), &values).unwrap_or_else(|e| panic!("{e}")).to_dtype(dtype);
        let name = name.clone();
        let tensors: Vec<(String, Tensor)> = tensors.into_iter().map(|(n, t)| (n, t.to_dtype(dtype))).collect();
        let path = dir.join(format!("{dtype}.safetensors"));
        write(&path, &tensors);
        let e = load_err(&path, &tiny());
        assert!(e.contains(&name) && e.contains("1 of") && e.contains("NaN or infinite") && e.contains("index 3"), "{dtype}: {e}");
    }
}

/// A minimal safetensors image with the given header text.
fn with_header(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

#[test]
fn a_header_naming_a_tensor_twice_is_refused() {
    let dir = temp_dir("dup");
    let path = dir.join("dup.safetensors");
    let header = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    std::fs::write(&path, with_header(header, &[0u8; 8])).unwrap_or_else(|e| panic!("{e}"));
    let e = SafetensorsFile::open(&path).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("'a' appears twice"), "{e}");
    // Distinct names load.
    let header = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    std::fs::write(&path, with_header(header, &[0u8; 8])).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(SafetensorsFile::open(&path).map(|f| f.names().count()).unwrap_or_else(|e| panic!("{e}")), 2);
}

#[test]
fn fifos_and_directories_in_place_of_model_files_are_named_not_waited_on() {
    let dir = temp_dir("fifo");
    let fifo = dir.join("model.safetensors");
    mkfifo(&fifo);
    let f = fifo.clone();
    let e = within(Duration::from_secs(20), move || SafetensorsFile::open(&f).err().map(|e| e.to_string()));
    let e = e.unwrap_or_default();
    assert!(e.contains("model.safetensors") && e.contains("FIFO"), "{e}");

    let cfg = dir.join("config.json");
    mkfifo(&cfg);
    let c = cfg.clone();
    let e = within(Duration::from_secs(20), move || BertConfig::from_file(&c).err().map(|e| e.to_string())).unwrap_or_default();
    assert!(e.contains("config.json") && e.contains("FIFO"), "{e}");

    let tok = dir.join("tokenizer.json");
    mkfifo(&tok);
    let t = tok.clone();
    let e = within(Duration::from_secs(20), move || TextTokenizer::from_file(&t, 16).err().map(|e| e.to_string())).unwrap_or_default();
    assert!(e.contains("tokenizer.json") && e.contains("FIFO"), "{e}");

    let pooling = dir.join("1_Pooling");
    std::fs::create_dir_all(&pooling).unwrap_or_else(|e| panic!("{e}"));
    mkfifo(&pooling.join("config.json"));
    let d = dir.clone();
    let e = within(Duration::from_secs(20), move || SentenceConfig::from_dir(&d, &tiny()).err().map(|e| e.to_string())).unwrap_or_default();
    assert!(e.contains("1_Pooling/config.json") && e.contains("FIFO"), "{e}");

    let as_dir = dir.join("weights-dir.safetensors");
    std::fs::create_dir_all(&as_dir).unwrap_or_else(|e| panic!("{e}"));
    let e = SafetensorsFile::open(&as_dir).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("is a directory") && !e.contains("No such device"), "{e}");
}

#[test]
fn pooling_configs_that_rlx_cannot_honour_say_why() {
    let dir = temp_dir("pool");
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap_or_else(|e| panic!("{e}"));
    let set = |json: &str| std::fs::write(dir.join("1_Pooling/config.json"), json).unwrap_or_else(|e| panic!("{e}"));
    let err = || SentenceConfig::from_dir(&dir, &tiny()).err().map(|e| e.to_string()).unwrap_or_default();

    set(r#"{"pooling_mode_max_tokens": true, "pooling_mode_mean_tokens": false}"#);
    let e = err();
    assert!(e.contains("pooling_mode_max_tokens is not supported") && !e.contains("exactly one"), "{e}");

    set(r#"{"pooling_mode_mean_tokens": true, "word_embedding_dimension": 384}"#);
    let e = err();
    assert!(e.contains("word_embedding_dimension is 384") && e.contains("hidden_size is 8"), "{e}");

    set(r#"{"pooling_mode_mean_tokens": true, "word_embedding_dimension": 8}"#);
    assert!(SentenceConfig::from_dir(&dir, &tiny()).is_ok(), "a matching dimension is fine");
}

fn write_rows(path: &Path, format: OutputFormat) -> Result<u64, ModelError> {
    let mut w = EmbeddingWriter::to_file(path, format, 2)?;
    w.write(&[1.0, 2.0])?;
    w.finish()
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|r| r.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.contains("rlx-tmp")).collect())
        .unwrap_or_default()
}

#[test]
fn output_paths_that_are_links_devices_or_long_are_handled() {
    let dir = temp_dir("outputs");
    // A symlink to a file: the target gets the data, the link stays a link.
    let real = dir.join("real.npy");
    std::fs::write(&real, b"old").unwrap_or_else(|e| panic!("{e}"));
    let link = dir.join("link.npy");
    std::os::unix::fs::symlink("real.npy", &link).unwrap_or_else(|e| panic!("{e}"));
    write_rows(&link, OutputFormat::Npy).unwrap_or_else(|e| panic!("{e}"));
    assert!(std::fs::symlink_metadata(&link).map(|m| m.file_type().is_symlink()).unwrap_or(false), "the link is kept");
    assert_eq!(std::fs::read(&real).map(|b| b.len()).unwrap_or(0), 128 + 8, "written through the link");

    // A dangling symlink: the file appears at its target.
    let dangling = dir.join("dangling.jsonl");
    std::os::unix::fs::symlink("made.jsonl", &dangling).unwrap_or_else(|e| panic!("{e}"));
    write_rows(&dangling, OutputFormat::Jsonl).unwrap_or_else(|e| panic!("{e}"));
    assert!(dir.join("made.jsonl").is_file());

    // Devices, directly or through a link, and FIFOs are refused untouched.
    let to_null = dir.join("null.jsonl");
    std::os::unix::fs::symlink("/dev/null", &to_null).unwrap_or_else(|e| panic!("{e}"));
    for (p, kind) in [(Path::new("/dev/null").to_path_buf(), "character device"), (to_null.clone(), "character device")] {
        let e = write_rows(&p, OutputFormat::Jsonl).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(kind) && e.contains("not a regular file") && e.contains(&p.display().to_string()), "{e}");
    }
    assert!(std::fs::symlink_metadata(&to_null).map(|m| m.file_type().is_symlink()).unwrap_or(false));
    let fifo = dir.join("fifo.jsonl");
    mkfifo(&fifo);
    let e = write_rows(&fifo, OutputFormat::Jsonl).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("FIFO"), "{e}");
    let e = write_rows(&dir, OutputFormat::Jsonl).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("directory"), "{e}");

    // A name of 250 characters (NAME_MAX is 255): the temporary is short.
    let long = dir.join(format!("{}.jsonl", "x".repeat(244)));
    write_rows(&long, OutputFormat::Jsonl).unwrap_or_else(|e| panic!("a 250-character name: {e}"));
    assert!(long.is_file());

    // Errors name the user's path, not the temporary one.
    let missing = dir.join("no-such-dir").join("out.npy");
    let e = write_rows(&missing, OutputFormat::Npy).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.starts_with(&missing.display().to_string()) && e.contains("temporary file"), "{e}");
    assert_eq!(leftovers(&dir), Vec::<String>::new());
}

#[test]
fn json_lines_refuse_non_finite_values_instead_of_writing_null() {
    let dir = temp_dir("nonfinite");
    let path = dir.join("out.jsonl");
    let mut w = EmbeddingWriter::to_file(&path, OutputFormat::Jsonl, 2).unwrap_or_else(|e| panic!("{e}"));
    let e = w.write(&[0.5, f32::NAN]).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("non-finite") && e.contains("element 1"), "{e}");
    drop(w);
    assert!(!path.exists());
    assert_eq!(leftovers(&dir), Vec::<String>::new());
}

/// An `io::Write` that fails with ENOSPC once `room` bytes are taken.
struct FullDisk {
    room: usize,
}

impl std::io::Write for FullDisk {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.room == 0 {
            return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let n = b.len().min(self.room);
        self.room -= n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_stream_that_fills_up_fails_with_the_stream_named() {
    for format in [OutputFormat::Jsonl, OutputFormat::Npy] {
        let mut w =
            EmbeddingWriter::to_stream(Box::new(FullDisk { room: 10_000 }), "stdout", format, 384).unwrap_or_else(|e| panic!("{e}"));
        // npy is spooled to a temporary file until the end: it must not outlive the failure.
        let spool = w.temp_path().map(std::path::Path::to_path_buf);
        assert_eq!(spool.is_some(), format == OutputFormat::Npy);
        let v = vec![0.123_456_78f32; 384];
        let mut failed = None;
        for _ in 0..100 {
            if let Err(e) = w.write(&v).and_then(|()| w.flush()) {
                failed = Some(e.to_string());
                break;
            }
        }
        let e = match failed {
            Some(e) => e,
            None => w.finish().err().map(|e| e.to_string()).unwrap_or_default(),
        };
        assert!(e.starts_with("stdout") && e.contains("No space left"), "{format:?}: {e}");
        if let Some(spool) = spool {
            assert!(!spool.exists(), "{format:?}: the spool {} was left behind", spool.display());
        }
    }
}

#[test]
fn a_huge_text_is_cut_before_tokenising_and_keeps_its_first_tokens() {
    let Some(dir) = common::model_dir("a_huge_text_is_cut_before_tokenising_and_keeps_its_first_tokens") else { return };
    let tok = TextTokenizer::from_file(&dir.join("tokenizer.json"), 256).unwrap_or_else(|e| panic!("{e}"));
    let budget = tok.input_budget();
    assert!((100_000..1_000_000).contains(&budget), "budget {budget}");

    // Ordinary words far past the budget: the same ids as a text just long
    // enough for 256 tokens, fast, and counted as truncated.
    let words: Vec<String> = (0..2_000_000).map(|i| format!("word{}", i % 97)).collect();
    let huge = words.join(" ");
    let short = words[..400].join(" ");
    let start = Instant::now();
    let (ids, truncated) = tok.encode_batch_counting(&[&huge, &short]).unwrap_or_else(|e| panic!("{e}"));
    assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
    assert_eq!(ids[0].len(), 256);
    assert_eq!(ids[0], ids[1], "the cut changes none of the tokens kept");
    assert_eq!(truncated, 2);

    // One 8 MB word: [UNK] whole or cut.
    let word = "a".repeat(8 << 20);
    let ids = tok.encode(&word).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ids, tok.encode(&"a".repeat(1000)).unwrap_or_else(|e| panic!("{e}")));
    assert_eq!(ids.len(), 3, "[CLS] [UNK] [SEP]");

    // Whitespace costs nothing against the budget: words after a long run of
    // spaces still count.
    let padded = format!("{}hello world", " ".repeat(2 * budget));
    assert_eq!(tok.encode(&padded).unwrap_or_else(|e| panic!("{e}")), tok.encode("hello world").unwrap_or_else(|e| panic!("{e}")));
}

#[test]
fn repeated_sequences_run_once_and_get_the_vector_they_get_alone() {
    use rlx_models::{EmbedderOptions, Pooling, SentenceEmbedder};
    let cfg = tiny();
    let weights = random_weights(&cfg, 11, DType::F32).unwrap_or_else(|e| panic!("{e}"));
    let sentence = SentenceConfig { max_seq_length: 32, pooling: Pooling::Mean, normalize: true };
    let e = SentenceEmbedder::from_weights(cfg, sentence, None, weights, rlx::Device::Cpu, EmbedderOptions::default())
        .unwrap_or_else(|e| panic!("{e}"));
    let ids: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![4, 5], vec![1, 2, 3], vec![1, 2, 3], vec![4, 5], vec![6]];
    let mut progressed = 0;
    let all = e.embed_ids_with_progress(&ids, &mut |n| progressed += n).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(progressed, ids.len(), "progress counts every text, repeats included");
    for (row, v) in ids.iter().zip(&all) {
        let alone = e.embed_ids(std::slice::from_ref(row)).unwrap_or_else(|e| panic!("{e}"));
        let worst = v.iter().zip(&alone[0]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "{row:?}: differs from its own embedding by {worst}");
    }
    assert_eq!(all[0], all[2]);
    assert_eq!(all[1], all[4]);
}

/// The fuzz seed's tiny WordPiece tokenizer.json, as JSON to edit.
fn tiny_tokenizer_json() -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/tokenizer_json/wordpiece.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"))
}

fn tokenizer_err(dir: &Path, json: &str) -> String {
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).unwrap_or_else(|e| panic!("{e}"));
    TextTokenizer::from_file(&path, 16).err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn tokenizer_files_that_made_the_tokenizers_crate_panic_are_errors() {
    let dir = temp_dir("tokenizer-panics");
    let good = tiny_tokenizer_json();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, good.to_string()).unwrap_or_else(|e| panic!("{e}"));
    let tok = TextTokenizer::from_file(&path, 16).unwrap_or_else(|e| panic!("the seed loads: {e}"));
    assert_eq!(tok.encode("hello worlds").unwrap_or_else(|e| panic!("{e}")), vec![2, 4, 5, 6, 3]);

    // Found by fuzzing: a JSON syntax error inside "decoder" hit an expect.
    let text = good.to_string().replacen(r#""decoder":{"#, r#""decoder":{"cleanup" true,"#, 1);
    assert_ne!(text, good.to_string(), "the edit applies");
    let e = tokenizer_err(&dir, &text);
    assert!(e.contains("tokenizer.json") && e.contains("not valid JSON"), "{e}");

    // Found by fuzzing: a template naming a special token that
    // special_tokens lacks panicked at the first encode (the type's spelling
    // does not matter to the crate).
    let mut bad = good.clone();
    bad["post_processor"]["type"] = "T,emplateProcessing".into();
    if let Some(m) = bad["post_processor"]["special_tokens"].as_object_mut() {
        m.remove("[CLS]");
    }
    let e = tokenizer_err(&dir, &bad.to_string());
    assert!(e.contains("special token '[CLS]'") && e.contains("single template"), "{e}");

    let mut bad = good.clone();
    bad["post_processor"]["single"] = serde_json::json!("[CLS]:0 $A:0 $B:1 [SEP]:0");
    let e = tokenizer_err(&dir, &bad.to_string());
    assert!(e.contains("second sequence"), "{e}");
}
