//! One tiny random LLaMA model written three ways — a Hugging Face
//! directory (config.json + safetensors, rotate-half RoPE), an f32 GGUF
//! (llama.cpp's Q/K row permutation, adjacent-pair RoPE) and GGUFs whose
//! matrices are each block format — gives the same logits through the
//! generator: HF vs GGUF f32 within f32 rounding; each quantized file's
//! quantized kernels against its own dequantised weights within a bound.
//! Also Qwen2's Q/K/V biases, and the loader's errors.

#[path = "common/gguf_writer.rs"]
mod gguf_writer;

use std::collections::HashMap;
use std::path::Path;

use gguf_writer::Writer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rlx::{Device, QFormat, Tensor};
use rlx_models::bpe_vocab::{build_tokenizer, GgufVocab};
use rlx_models::gguf::{GgufArray, GgufValue};
use rlx_models::llama::LlamaWeights;
use rlx_models::{Generator, GeneratorOptions, SamplingParams};

const VOCAB: usize = 96;
const HIDDEN: usize = 256;
const FFN: usize = 512;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = HIDDEN / HEADS;
const LAYERS: usize = 2;

struct Model {
    /// HF-layout f32 weights by GGUF name, row-major `[rows, cols]`.
    w: HashMap<String, (Vec<usize>, Vec<f32>)>,
    bias: bool,
}

fn shapes(bias: bool) -> Vec<(String, Vec<usize>)> {
    let mut v = vec![
        ("token_embd.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("output_norm.weight".into(), vec![HIDDEN]),
        ("output.weight".into(), vec![VOCAB, HIDDEN]),
    ];
    for l in 0..LAYERS {
        let n = |s: &str| format!("blk.{l}.{s}");
        v.push((n("attn_norm.weight"), vec![HIDDEN]));
        v.push((n("attn_q.weight"), vec![HEADS * HD, HIDDEN]));
        v.push((n("attn_k.weight"), vec![KV_HEADS * HD, HIDDEN]));
        v.push((n("attn_v.weight"), vec![KV_HEADS * HD, HIDDEN]));
        if bias {
            v.push((n("attn_q.bias"), vec![HEADS * HD]));
            v.push((n("attn_k.bias"), vec![KV_HEADS * HD]));
            v.push((n("attn_v.bias"), vec![KV_HEADS * HD]));
        }
        v.push((n("attn_output.weight"), vec![HIDDEN, HEADS * HD]));
        v.push((n("ffn_norm.weight"), vec![HIDDEN]));
        v.push((n("ffn_gate.weight"), vec![FFN, HIDDEN]));
        v.push((n("ffn_up.weight"), vec![FFN, HIDDEN]));
        v.push((n("ffn_down.weight"), vec![HIDDEN, FFN]));
    }
    v
}

fn random_model(seed: u64, bias: bool) -> Model {
    let mut r = StdRng::seed_from_u64(seed);
    let mut w = HashMap::new();
    for (name, shape) in shapes(bias) {
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = if name.contains("norm") {
            (0..n).map(|_| r.random_range(0.8f32..1.2)).collect()
        } else {
            let s = 1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt();
            (0..n).map(|_| r.random_range(-2.0 * s..2.0 * s)).collect()
        };
        w.insert(name, (shape, vals));
    }
    Model { w, bias }
}

/// llama.cpp's converter order for Q/K rows: per head, the rotate-half
/// pairs (i, i + hd/2) become adjacent rows (2i, 2i + 1).
fn permute_rows(vals: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; vals.len()];
    for h in 0..heads {
        for i in 0..HD / 2 {
            for (half, dst) in [(0, 2 * i), (1, 2 * i + 1)] {
                let src_row = h * HD + half * HD / 2 + i;
                let dst_row = h * HD + dst;
                out[dst_row * cols..(dst_row + 1) * cols].copy_from_slice(&vals[src_row * cols..(src_row + 1) * cols]);
            }
        }
    }
    out
}

fn hf_dir(m: &Model, dir: &Path) {
    let arch = if m.bias { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" };
    let cfg = serde_json::json!({
        "architectures": [arch], "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": false
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("config");
    let hf = |name: &str| -> String {
        match name {
            "token_embd.weight" => "model.embed_tokens.weight".into(),
            "output_norm.weight" => "model.norm.weight".into(),
            "output.weight" => "lm_head.weight".into(),
            _ => {
                let rest = name.strip_prefix("blk.").expect("layer");
                let (l, part) = rest.split_once('.').expect("part");
                let part = part
                    .replace("attn_norm", "input_layernorm")
                    .replace("ffn_norm", "post_attention_layernorm")
                    .replace("attn_q", "self_attn.q_proj")
                    .replace("attn_k", "self_attn.k_proj")
                    .replace("attn_v", "self_attn.v_proj")
                    .replace("attn_output", "self_attn.o_proj")
                    .replace("ffn_gate", "mlp.gate_proj")
                    .replace("ffn_up", "mlp.up_proj")
                    .replace("ffn_down", "mlp.down_proj");
                format!("model.layers.{l}.{part}")
            }
        }
    };
    let tensors: Vec<(String, Tensor)> = m.w.iter().map(|(n, (s, v))| (hf(n), Tensor::from_f32(s.clone(), v).expect("tensor"))).collect();
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    rlx_models::safetensors::write_safetensors(&dir.join("model.safetensors"), &refs).expect("safetensors");
}

/// A GGUF of the model; matrices in `format` (None: f32), vectors f32.
fn gguf(m: &Model, format: Option<QFormat>, path: &Path) {
    let arch = if m.bias { "qwen2" } else { "llama" };
    let k = |s: &str| format!("{arch}.{s}");
    let mut w = Writer::new()
        .kv("general.architecture", GgufValue::String(arch.into()))
        .kv(&k("block_count"), GgufValue::U32(LAYERS as u32))
        .kv(&k("context_length"), GgufValue::U32(128))
        .kv(&k("embedding_length"), GgufValue::U32(HIDDEN as u32))
        .kv(&k("feed_forward_length"), GgufValue::U32(FFN as u32))
        .kv(&k("attention.head_count"), GgufValue::U32(HEADS as u32))
        .kv(&k("attention.head_count_kv"), GgufValue::U32(KV_HEADS as u32))
        .kv(&k("rope.freq_base"), GgufValue::F32(10000.0))
        .kv(&k("attention.layer_norm_rms_epsilon"), GgufValue::F32(1e-5))
        .kv("tokenizer.ggml.tokens", GgufValue::Array(GgufArray::String((0..VOCAB).map(|i| format!("t{i}")).collect())));
    let mut names: Vec<&String> = m.w.keys().collect();
    names.sort();
    for name in names {
        let (shape, vals) = &m.w[name];
        // qwen2 keeps Hugging Face's Q/K layout; llama files are permuted.
        let vals = match (arch, name.contains("attn_q.weight"), name.contains("attn_k.weight")) {
            ("llama", true, _) => permute_rows(vals, HEADS, HIDDEN),
            ("llama", _, true) => permute_rows(vals, KV_HEADS, HIDDEN),
            _ => vals.clone(),
        };
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        match (format, shape.len()) {
            (Some(q), 2) => {
                let cols = shape[1];
                let mut data = vec![];
                for row in vals.chunks(cols) {
                    data.extend(rlx::backends::quant::quantize_row(q, row).expect("quantize"));
                }
                w = w.tensor_data(name, &dims, q.ggml_type(), data);
            }
            _ => w = w.tensor_data(name, &dims, 0, vals.iter().flat_map(|x| x.to_le_bytes()).collect()),
        }
    }
    std::fs::write(path, w.build()).expect("write gguf");
}

fn tokenizer() -> tokenizers::Tokenizer {
    let v = GgufVocab { model: "gpt2".into(), tokens: (0..VOCAB).map(|i| format!("t{i}")).collect(), ..Default::default() };
    build_tokenizer(&v).expect("tokenizer")
}

/// Greedy ids and per-step logits of 6 tokens after a fixed prompt.
fn run(weights: LlamaWeights, dequantize: bool) -> (Vec<u32>, Vec<Vec<f32>>) {
    let opts = GeneratorOptions { ctx_size: 64, logits: true, dequantize, prefill_buckets: vec![8], ..Default::default() };
    let mut g = Generator::from_parts(weights, tokenizer(), None, vec![], Device::Cpu, opts).expect("generator");
    let prompt: Vec<u32> = vec![3, 17, 42, 5, 88, 1, 60, 23, 9, 31, 77];
    let params = SamplingParams { max_tokens: 6, ignore_eos: true, ..SamplingParams::greedy() };
    let mut ids = vec![];
    let mut logits = vec![];
    for p in g.generate_ids(&prompt, &params).expect("generate") {
        let p = p.expect("piece");
        ids.push(p.token);
        logits.push(p.logits.expect("logits"));
    }
    (ids, logits)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().zip(b).flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0.0, f32::max)
}

#[test]
fn hf_and_gguf_f32_agree() {
    for bias in [false, true] {
        let m = random_model(11 + bias as u64, bias);
        let dir = std::env::temp_dir().join(format!("rlx-llama-formats-{}-{bias}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        hf_dir(&m, &dir);
        gguf(&m, None, &dir.join("model.gguf"));
        let (hi, hl) = run(LlamaWeights::from_hf_dir(&dir).expect("hf weights"), false);
        let (gi, gl) = run(LlamaWeights::from_gguf(&dir.join("model.gguf")).expect("gguf weights"), false);
        let d = max_diff(&hl, &gl);
        assert!(d < 1e-4, "bias {bias}: HF vs GGUF logits differ by {d}");
        assert_eq!(hi, gi, "bias {bias}: greedy ids");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// llama3 RoPE scaling, from config.json's `rope_scaling` (factors computed
/// at load) and from a GGUF's `rope_freqs.weight` (factors stored in the
/// file): both give the same logits, and they differ from the unscaled
/// model's (a small original context, so the scaling reaches the positions
/// of the test).
#[test]
fn llama3_rope_scaling_from_hf_and_gguf() {
    let m = random_model(31, false);
    let dir = std::env::temp_dir().join(format!("rlx-llama-rope-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    hf_dir(&m, &dir);
    let (_, plain) = run(LlamaWeights::from_hf_dir(&dir).expect("hf weights"), false);
    let scaling = serde_json::json!({"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                                     "original_max_position_embeddings": 16});
    let cfg_path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("read")).expect("json");
    cfg["rope_scaling"] = scaling.clone();
    std::fs::write(&cfg_path, cfg.to_string()).expect("config");
    let factors = rlx_models::llama::rope_scaling_factors(&scaling, 10000.0, HD).expect("factors").expect("some");
    assert!(factors.iter().any(|&f| f > 1.0 && f < 4.0), "the test's settings must blend some pairs: {factors:?}");
    let mut g = Model { w: m.w.clone(), bias: false };
    g.w.insert("rope_freqs.weight".into(), (vec![HD / 2], factors));
    gguf(&g, None, &dir.join("model.gguf"));
    let (hi, hl) = run(LlamaWeights::from_hf_dir(&dir).expect("hf weights"), false);
    let (gi, gl) = run(LlamaWeights::from_gguf(&dir.join("model.gguf")).expect("gguf weights"), false);
    let d = max_diff(&hl, &gl);
    assert!(d < 1e-4, "scaled HF vs GGUF logits differ by {d}");
    assert_eq!(hi, gi);
    let moved = max_diff(&hl, &plain);
    assert!(moved > 1e-3, "the scaling changed the logits by only {moved}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Each block format's kernels (activations quantized to int8 per block)
/// against the same file's dequantised weights in f32. The bound is loose
/// (random weights, two layers): it catches a wrong layout, which moves
/// logits by their whole scale (~1), not rounding.
#[test]
fn every_block_format_loads_and_runs() {
    let m = random_model(5, false);
    let dir = std::env::temp_dir().join(format!("rlx-llama-q-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let (_, f32_logits) = {
        gguf(&m, None, &dir.join("f32.gguf"));
        run(LlamaWeights::from_gguf(&dir.join("f32.gguf")).expect("f32"), false)
    };
    for q in QFormat::ALL {
        let path = dir.join(format!("{q}.gguf"));
        gguf(&m, Some(q), &path);
        let (qi, ql) = run(LlamaWeights::from_gguf(&path).expect("quantized weights"), false);
        let (di, dl) = run(LlamaWeights::from_gguf(&path).expect("quantized weights"), true);
        let d = max_diff(&ql[..1], &dl[..1]);
        let scale = dl[0].iter().fold(0f32, |a, x| a.max(x.abs()));
        eprintln!(
            "{q}: quantized kernels vs dequantised f32: max |diff| {d} (logit scale {scale}); vs the unquantized model {}",
            max_diff(&dl[..1], &f32_logits[..1])
        );
        assert!(d <= 0.05 * scale.max(1.0), "{q}: quantized kernels differ from dequantised weights by {d}");
        assert_eq!(qi.len(), di.len());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn loader_errors_name_the_problem() {
    let m = random_model(1, false);
    let dir = std::env::temp_dir().join(format!("rlx-llama-err-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    // A missing tensor.
    let mut m2 = random_model(1, false);
    m2.w.remove("blk.1.ffn_up.weight");
    gguf(&m2, None, &dir.join("missing.gguf"));
    let e = LlamaWeights::from_gguf(&dir.join("missing.gguf")).err().expect("missing tensor").to_string();
    assert!(e.contains("blk.1.ffn_up.weight") && e.contains("missing"), "{e}");
    // A wrong shape.
    let mut m3 = random_model(1, false);
    m3.w.insert("blk.0.attn_v.weight".into(), (vec![HIDDEN, HIDDEN], vec![0.0; HIDDEN * HIDDEN]));
    gguf(&m3, None, &dir.join("shape.gguf"));
    let e = LlamaWeights::from_gguf(&dir.join("shape.gguf")).err().expect("bad shape").to_string();
    assert!(e.contains("blk.0.attn_v.weight") && e.contains("expected shape"), "{e}");
    // A truncated file.
    gguf(&m, None, &dir.join("ok.gguf"));
    let bytes = std::fs::read(dir.join("ok.gguf")).expect("read");
    std::fs::write(dir.join("cut.gguf"), &bytes[..bytes.len() / 2]).expect("write");
    let e = LlamaWeights::from_gguf(&dir.join("cut.gguf")).err().expect("truncated").to_string();
    assert!(e.contains("cut.gguf"), "{e}");
    // An unsupported architecture in config.json.
    hf_dir(&m, &dir);
    std::fs::write(dir.join("config.json"), r#"{"architectures": ["GPT2LMHeadModel"]}"#).expect("config");
    let e = LlamaWeights::from_hf_dir(&dir).err().expect("architecture").to_string();
    assert!(e.contains("GPT2LMHeadModel") && e.contains("not supported"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Hugging Face directory whose tokenizer.json makes the tokenizers crate
/// panic (the fuzzers' findings, kept in fuzz/regressions) is refused with
/// an error naming the file.
#[test]
fn a_malformed_tokenizer_json_is_an_error_for_generation_too() {
    let m = random_model(41, false);
    let dir = std::env::temp_dir().join(format!("rlx-llama-badtok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    hf_dir(&m, &dir);
    let regressions = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions/tokenizer_json");
    let mut seen = 0;
    for entry in std::fs::read_dir(&regressions).expect("fuzz/regressions/tokenizer_json") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, dir.join("tokenizer.json")).expect("copy");
        let opts = GeneratorOptions { ctx_size: 64, prefill_buckets: vec![8], ..Default::default() };
        match Generator::load_with(&dir, Device::Cpu, opts) {
            Ok(_) => panic!("{} loaded", path.display()),
            Err(e) => assert!(e.to_string().contains("tokenizer.json"), "{}: {e}", path.display()),
        }
        seen += 1;
    }
    assert!(seen >= 2, "expected the recorded fuzz findings, found {seen}");
    let _ = std::fs::remove_dir_all(&dir);
}
