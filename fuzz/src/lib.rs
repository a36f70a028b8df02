//! The fuzz targets' bodies, one function per target: the targets in
//! fuzz_targets/ call them, and rlx-models' test `fuzz_replay` runs every
//! seed and every recorded crash input through them on the stable toolchain,
//! so a fixed crash stays fixed in CI. Each returns normally for any input;
//! a panic (an assertion here or in the library) is a finding.

use rlx_models::bpe_vocab::{build_tokenizer, GgufVocab};
use rlx_models::chat_template::ChatTemplate;
use rlx_models::gguf::GgufFile;
use rlx_models::llama::LlamaConfig;
use rlx_models::safetensors::parse_header;
use rlx_models::Message;
use rlx_models::TextLines;
use rlx_models::TextTokenizer;
use rlx_models::{bert_weight_specs, BertConfig};
use std::path::Path;

/// A safetensors image: the header length, the JSON header and the tensor
/// table are checked against the bytes. Whatever the input, parsing returns
/// an error or a table whose every range lies inside the data.
pub fn safetensors_header(data: &[u8]) {
    if let Ok((data_start, tensors)) = parse_header(Path::new("fuzz.safetensors"), data) {
        assert!(data_start <= data.len());
        let data_len = data.len() - data_start;
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        for info in tensors.values() {
            assert!(info.start <= info.end && info.end <= data_len, "{info:?} outside {data_len} bytes");
            let numel: usize = info.shape.iter().product();
            assert_eq!(info.end - info.start, numel * info.dtype.size());
            ranges.push((info.start, info.end));
        }
        ranges.sort();
        for w in ranges.windows(2) {
            assert!(w[1].0 >= w[0].1, "overlap {w:?}");
        }
    }
}

/// config.json → BertConfig, then the list of weights it asks for (bounded
/// by the config's size limits, so this must stay small and fast).
pub fn bert_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(cfg) = BertConfig::from_json(Path::new("config.json"), text) {
        assert!(cfg.hidden_size % cfg.num_attention_heads == 0);
        let specs = bert_weight_specs(&cfg);
        assert!(specs.len() <= 5 + 16 * cfg.num_hidden_layers);
    }
}

/// tokenizer.json through TextTokenizer (the HF tokenizers crate set up as
/// the embedder uses it), then a few texts encoded, one far past the limit.
pub fn tokenizer_json(data: &[u8]) {
    // The loader reads a path; one file per process, rewritten per input.
    let path = std::env::temp_dir().join(format!("rlx-fuzz-tokenizer-{}.json", std::process::id()));
    if std::fs::write(&path, data).is_err() {
        return;
    }
    if let Ok(tok) = TextTokenizer::from_file(&path, 16) {
        let long = "word ".repeat(2000);
        for text in ["", "hello world", "naïve café, 日本語!", long.as_str()] {
            if let Ok(ids) = tok.encode(text) {
                assert!(ids.len() <= 16, "{} ids past max_len 16", ids.len());
            }
        }
        let _ = tok.encode_batch_counting(&["a b c", ""]);
    }
}

/// The CLI's input reader: lines in bounded batches, UTF-8 checked, CR LF
/// endings stripped. Texts never contain a newline and a batch never holds
/// more than asked for.
pub fn text_lines(data: &[u8]) {
    let max = 1 + data.first().copied().unwrap_or(0) as usize % 7;
    let mut lines = TextLines::new(data, "fuzz");
    let mut texts = 0u64;
    loop {
        match lines.next_batch_within(max, 64) {
            Ok(batch) if batch.is_empty() => break,
            Ok(batch) => {
                assert!(batch.len() <= max);
                for t in &batch {
                    assert!(!t.contains('\n'));
                }
                texts += batch.len() as u64;
            }
            Err(_) => break,
        }
    }
    assert!(texts <= data.iter().filter(|&&b| b == b'\n').count() as u64 + 1);
}

/// A GGUF file: header, metadata, tensor table; then what generation reads
/// from it: the LLaMA config, the tokenizer metadata (built into a
/// tokenizer) and the chat template, rendered once.
pub fn gguf_file(data: &[u8]) {
    let Ok(f) = GgufFile::parse(data.to_vec()) else { return };
    for (_key, value) in f.metadata() {
        let _ = value.to_string();
    }
    for t in f.tensors() {
        let bytes = f.tensor_data(t);
        assert!(bytes.len() as u64 <= f.file_len());
        let _ = (t.n_elements(), t.row_len(), t.n_rows(), t.row_bytes(), t.shape());
    }
    let _ = LlamaConfig::from_gguf(&f, Path::new("fuzz.gguf"));
    // The text side reads a path: one file per process.
    let path = std::env::temp_dir().join(format!("rlx-fuzz-gguf-{}.gguf", std::process::id()));
    if std::fs::write(&path, data).is_ok() {
        if let Ok((tok, template, _eos)) = rlx_models::gguf_text(&path) {
            let _ = tok.encode("Hello, world! 123", true);
            if let Some(t) = template {
                let _ = t.render(&[Message::new("user", "hi")], true);
            }
        }
        let _ = std::fs::remove_file(&path);
    }
}

fn strings(b: &[u8]) -> Vec<String> {
    if b.is_empty() {
        return vec![];
    }
    b.split(|&c| c == 0).map(|s| String::from_utf8_lossy(s).into_owned()).collect()
}

/// GGUF tokenizer metadata → a byte-level BPE tokenizer. The input is split
/// on 0xFF bytes into: model, pre, tokens (NUL-separated), merges
/// (NUL-separated), token types (one byte each) and a text to encode.
pub fn bpe_vocab(data: &[u8]) {
    let parts: Vec<&[u8]> = data.split(|&c| c == 0xFF).collect();
    let part = |i: usize| parts.get(i).copied().unwrap_or(&[]);
    let tokens = strings(part(2));
    let n = tokens.len() as u32;
    let id = |k: usize| part(4).get(k).map(|&b| b as u32 % (n + 2));
    let vocab = GgufVocab {
        model: String::from_utf8_lossy(part(0)).into_owned(),
        pre: Some(String::from_utf8_lossy(part(1)).into_owned()).filter(|s| !s.is_empty()),
        merges: strings(part(3)),
        token_types: if part(4).is_empty() { None } else { Some(part(4).iter().map(|&b| b as i32 % 8).collect()) },
        bos: id(0),
        eos: id(1),
        pad: id(2),
        unk: id(3),
        add_bos: part(4).first().is_some_and(|b| b & 1 == 1),
        add_eos: part(4).first().is_some_and(|b| b & 2 == 2),
        tokens,
    };
    if let Ok(tok) = build_tokenizer(&vocab) {
        let text = String::from_utf8_lossy(part(5)).into_owned();
        if let Ok(enc) = tok.encode(text.as_str(), true) {
            let _ = tok.decode(enc.get_ids(), false);
        }
    }
}

/// A chat template (the first part of the input, up to a 0xFF byte) rendered
/// over messages from the rest (role and content alternate, NUL-separated),
/// under the default limits: an error or a string within the output limit,
/// promptly.
pub fn chat_template(data: &[u8]) {
    let (src, rest) = match data.iter().position(|&b| b == 0xFF) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(src) = std::str::from_utf8(src) else { return };
    let Ok(t) = ChatTemplate::new(src, "<s>", "</s>") else { return };
    let fields: Vec<String> = rest.split(|&b| b == 0).map(|s| String::from_utf8_lossy(s).into_owned()).collect();
    let messages: Vec<Message> = fields.chunks(2).map(|c| Message::new(c[0].clone(), c.get(1).cloned().unwrap_or_default())).collect();
    for add in [false, true] {
        if let Ok(out) = t.render(&messages, add) {
            assert!(out.len() <= t.limits().max_output_bytes);
        }
    }
}

/// rlx-cuda's matmul-choice file (`gemm-choices.txt`): any bytes parse to
/// a set of choices, each of which, written back as a line, parses to
/// itself; there are never more choices than lines.
pub fn gemm_choices(data: &[u8]) {
    use rlx_cuda::gemm_cache::{gemm_choice_line, parse_gemm_choices};
    let choices = parse_gemm_choices(data);
    assert!(choices.len() <= data.iter().filter(|&&b| b == b'\n').count() + 1);
    for (key, words) in &choices {
        let line = gemm_choice_line(key, *words);
        let again = parse_gemm_choices(line.as_bytes());
        assert_eq!(again.len(), 1, "{line:?}");
        assert_eq!(again.get(key), Some(words), "{line:?}");
    }
}

/// rlx-cuda's compiled-kernel cache file: `decode` accepts exactly what
/// `encode` wrote for an image that passes the ELF checks, and the input
/// itself, encoded, round-trips if and only if it passes them.
pub fn kernel_cache(data: &[u8]) {
    use rlx_cuda::kernel_cache::{check_elf, decode, encode};
    if let Ok(cubin) = decode(data) {
        assert!(check_elf(cubin).is_ok());
        assert_eq!(encode(cubin), data);
    }
    let encoded = encode(data);
    match (check_elf(data), decode(&encoded)) {
        (Ok(()), Ok(back)) => assert_eq!(back, data),
        (Ok(()), Err(e)) => panic!("an image that passes the ELF checks does not round-trip: {e}"),
        (Err(_), Ok(_)) => panic!("an image that fails the ELF checks decodes"),
        (Err(e), Err(_)) => assert!(!e.to_string().is_empty()),
    }
}

/// A refused request: a 4xx with a message, and an OpenAI error body.
fn refused(e: &rlx_serve::ApiError) {
    assert!(e.status.is_client_error(), "{e:?}");
    assert!(!e.message.is_empty());
    assert!(e.body().get("error").is_some_and(|b| b.get("message").is_some()));
}

/// rlx-serve's request bodies: the bytes as JSON, then read as each route
/// reads them (/v1/embeddings, /v1/rerank, /v1/chat/completions,
/// /v1/completions). Either a 4xx error with a message, or a request that
/// keeps the routes' limits.
pub fn serve_request(data: &[u8]) {
    use rlx_serve::request::fields;
    use rlx_serve::routes::completions::{Api, GenerationRequest};
    use rlx_serve::routes::embeddings::{EmbeddingsRequest, Inputs};
    use rlx_serve::routes::rerank::RerankRequest;
    const MAX_INPUTS: usize = 8;
    let f = match fields(data) {
        Ok(f) => f,
        Err(e) => return refused(&e),
    };
    match EmbeddingsRequest::read(&f, MAX_INPUTS) {
        Ok(r) => {
            assert!((1..=MAX_INPUTS).contains(&r.inputs.len()));
            match &r.inputs {
                Inputs::Texts(t) => assert!(t.iter().all(|s| !s.is_empty())),
                Inputs::Ids(rows) => assert!(rows.iter().all(|r| !r.is_empty())),
            }
        }
        Err(e) => refused(&e),
    }
    match RerankRequest::read(&f, MAX_INPUTS) {
        Ok(r) => {
            assert!(!r.query.is_empty());
            assert!((1..=MAX_INPUTS).contains(&r.documents.len()));
            assert!((1..=r.documents.len()).contains(&r.top_n));
        }
        Err(e) => refused(&e),
    }
    for api in [Api::Chat, Api::Completion] {
        match GenerationRequest::read(&f, api) {
            Ok(r) => {
                let p = &r.params;
                assert!((0.0..=2.0).contains(&p.temperature) && (0.0..=1.0).contains(&p.top_p) && (0.0..=1.0).contains(&p.min_p));
                assert!(p.stop.len() <= 16 && p.stop.iter().all(|s| !s.is_empty()));
                assert!(r.max_tokens.is_none_or(|n| n >= 1));
            }
            Err(e) => refused(&e),
        }
    }
}
