//! LLaMA-family decoders (RMSNorm, RoPE, grouped-query attention, SwiGLU):
//! the config, the weights from a GGUF file or a Hugging Face directory, and
//! the graph of one generation step.
//!
//! Weights keep GGUF's names (`token_embd.weight`, `blk.N.attn_q.weight`, …)
//! whatever the source. Block-quantized GGUF weights stay quantized: they are
//! `U8` params read by `qmatmul` / `qgather`. llama.cpp's converter permutes
//! the rows of `attn_q` / `attn_k` so that RoPE pairs are adjacent; RLX keeps
//! that layout and uses adjacent-pair RoPE (`RopeMode::Interleaved`) for GGUF
//! files, and rotate-half RoPE for Hugging Face weights, which are not
//! permuted. Both give the same logits.
//!
//! One step graph serves prefill and decode, for `batch` sequences at once,
//! over state shared by every step executable of a generator:
//! - `k_cache.L`, `v_cache.L`: `[batch, ctx, kv_heads*head_dim]` of the
//!   step's `kv_dtype` (f16 on a GPU by default: half the memory and half
//!   the bytes each decode step's attention reads);
//! - `history`: i32 `[batch, ctx, 1]`, every sequence's tokens by position;
//! - `token`: i32 `[batch, 2, 1]`, row 0 the next token to feed;
//! - `pos`: i32 `[batch, 2, 1]`, row 0 its position (= tokens in the cache).
//!
//! Row 1 of `token` and `pos` is a dump: a prefill step writes a row's new
//! token and position to row 0 (`slot_row` 0) or, for a batch row it is not
//! prefilling, to row 1, so that row keeps its own. (The generator prefills
//! one row at a time, on the slot's row of the shared states, and always
//! passes 0.)
//!
//! A prefill step (`seq` > 1, or a decode-less first chunk) takes the prompt
//! chunk as inputs; a decode step (`decode`) reads its token and position
//! from state. Both end by sampling the next token on the device and writing
//! it, its position and its history entry back to state, so the host can
//! submit decode step t+1 before it has read step t's token.

use std::collections::HashMap;
use std::path::Path;

use rlx::{AttentionSpec, DType, Graph, NodeId, QFormat, RopeMode, Tensor};

use crate::gguf::{GgufFile, TensorType};
use crate::{ModelError, Result};

/// What a LLaMA-family model looks like.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    pub rope_mode: RopeMode,
    /// RoPE scaling as per-pair frequency factors `[head_dim/2]` (pair i's
    /// frequency is divided by factor i): llama3's scaling (from
    /// `rope_scaling` in config.json, or a GGUF's `rope_freqs.weight`), or
    /// linear scaling (every factor the same). `None`: no scaling.
    pub rope_freq_factors: Option<Vec<f32>>,
    pub rms_eps: f32,
    /// The context length the model was trained for.
    pub max_context: usize,
    /// Q, K and V projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// No `output.weight`: the head reuses `token_embd.weight`.
    pub tied_embeddings: bool,
}

/// How one weight is stored in the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightKind {
    /// f32 `[rows, cols]` (or `[cols]` for vectors).
    F32,
    /// Rows of GGML blocks: a `U8 [rows, row_bytes]` param.
    Quant(QFormat),
}

/// A loaded model: its config and named weights (GGUF names).
pub struct LlamaWeights {
    pub config: LlamaConfig,
    pub kinds: HashMap<String, WeightKind>,
    pub tensors: Vec<(String, Tensor)>,
}

fn fmt_err(path: &Path, detail: impl Into<String>) -> ModelError {
    ModelError::Format { path: path.to_path_buf(), detail: detail.into() }
}

/// Sanity bounds on config values, so a lying file is an error instead of
/// a huge allocation.
fn check_config(c: &LlamaConfig, path: &Path) -> Result<()> {
    let bad = |what: &str, v: usize, max: usize| -> Result<()> {
        if v == 0 || v > max {
            return Err(fmt_err(path, format!("{what} = {v} is outside 1..={max}")));
        }
        Ok(())
    };
    bad("vocabulary size", c.vocab, 1 << 22)?;
    bad("hidden size", c.hidden, 1 << 16)?;
    bad("feed-forward size", c.intermediate, 1 << 18)?;
    bad("layer count", c.layers, 1024)?;
    bad("attention heads", c.heads, 1024)?;
    bad("key/value heads", c.kv_heads, 1024)?;
    bad("context length", c.max_context, 1 << 24)?;
    if !c.heads.is_multiple_of(c.kv_heads) {
        return Err(fmt_err(path, format!("{} attention heads are not a multiple of {} key/value heads", c.heads, c.kv_heads)));
    }
    if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) || c.head_dim > 1024 {
        return Err(fmt_err(path, format!("head dimension {} must be even and in 2..=1024", c.head_dim)));
    }
    if c.rope_theta.is_nan() || c.rope_theta <= 0.0 || c.rms_eps.is_nan() || c.rms_eps < 0.0 {
        return Err(fmt_err(path, format!("rope theta {} and RMSNorm eps {} must be positive", c.rope_theta, c.rms_eps)));
    }
    Ok(())
}

/// Per-pair RoPE frequency factors for a config.json `rope_scaling` entry
/// (`None` for none or `default`). llama3: a pair whose wavelength is
/// shorter than `original_max_position_embeddings / high_freq_factor`
/// keeps its frequency, one longer than `.. / low_freq_factor` is divided
/// by `factor`, and those between blend the two linearly in
/// `original_max_position_embeddings / wavelength`. linear: every pair
/// divided by `factor`. Others are refused.
pub fn rope_scaling_factors(s: &serde_json::Value, theta: f32, head_dim: usize) -> std::result::Result<Option<Vec<f32>>, String> {
    if s.is_null() {
        return Ok(None);
    }
    let kind = s["rope_type"].as_str().or_else(|| s["type"].as_str()).unwrap_or("");
    let num = |k: &str| -> std::result::Result<f64, String> {
        s[k].as_f64()
            .filter(|v| v.is_finite() && *v > 0.0)
            .ok_or_else(|| format!("rope_scaling.{k} must be a positive number, found {}", s[k]))
    };
    let half = head_dim / 2;
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(vec![num("factor")? as f32; half])),
        "llama3" => {
            let (factor, low, high, old) =
                (num("factor")?, num("low_freq_factor")?, num("high_freq_factor")?, num("original_max_position_embeddings")?);
            if high <= low {
                return Err(format!("rope_scaling: high_freq_factor {high} must exceed low_freq_factor {low}"));
            }
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            let v = (0..half)
                .map(|i| {
                    let freq = (theta as f64).powf(-2.0 * i as f64 / head_dim as f64);
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    let scaled = if wavelen < high_wavelen {
                        freq
                    } else if wavelen > low_wavelen {
                        freq / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    };
                    (freq / scaled) as f32
                })
                .collect();
            Ok(Some(v))
        }
        other => Err(format!("rope_scaling type '{other}' is not supported (default, linear, llama3)")),
    }
}

impl LlamaConfig {
    /// The config from a GGUF file's `{arch}.*` metadata.
    pub fn from_gguf(f: &GgufFile, path: &Path) -> Result<LlamaConfig> {
        let g = |e: crate::gguf::GgufError| fmt_err(path, e.to_string());
        let arch = f.get_str("general.architecture").map_err(g)?;
        if !matches!(arch, "llama" | "qwen2" | "mistral") {
            return Err(fmt_err(path, format!("architecture '{arch}' is not supported (supported: llama, qwen2, mistral)")));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| f.get_u32(&key(k)).map(|v| v as usize).map_err(g);
        let hidden = u("embedding_length")?;
        let heads = u("attention.head_count")?;
        let kv_heads = f.get_opt_u32(&key("attention.head_count_kv")).map_err(g)?.map_or(heads, |v| v as usize);
        if heads == 0 {
            return Err(fmt_err(path, format!("{} is 0", key("attention.head_count"))));
        }
        let head_dim = f.get_opt_u32(&key("rope.dimension_count")).map_err(g)?.map_or(hidden / heads, |v| v as usize);
        let half = head_dim / 2;
        let mut rope_freq_factors = None;
        match f.get_opt_str(&key("rope.scaling.type")).map_err(g)? {
            None | Some("none") => {}
            Some("linear") => {
                let factor = f.get_f32(&key("rope.scaling.factor")).map_err(g)?;
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(fmt_err(path, format!("{} must be a positive number, found {factor}", key("rope.scaling.factor"))));
                }
                rope_freq_factors = Some(vec![factor; half]);
            }
            Some(t) => return Err(fmt_err(path, format!("RoPE scaling '{t}' is not supported (none, linear, or llama3's rope_freqs)"))),
        }
        // llama3 files carry their scaling as per-pair frequency factors.
        if let Some(t) = f.tensor("rope_freqs.weight") {
            if t.ttype != crate::gguf::TensorType::F32 || t.dims != [half as u64] {
                return Err(fmt_err(path, format!("tensor rope_freqs.weight must be f32 [{half}], found {} {:?}", t.ttype.name(), t.dims)));
            }
            let v: Vec<f32> = f.tensor_data(t).chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            if v.len() != half || v.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
                return Err(fmt_err(path, "tensor rope_freqs.weight must hold positive finite factors"));
            }
            rope_freq_factors = Some(v);
        }
        let embd = f.tensor("token_embd.weight").ok_or_else(|| fmt_err(path, "missing tensor token_embd.weight"))?;
        let vocab = match f.get_opt_u32(&key("vocab_size")).map_err(g)? {
            Some(v) => v as usize,
            None => embd.n_rows() as usize,
        };
        let c = LlamaConfig {
            vocab,
            hidden,
            intermediate: u("feed_forward_length")?,
            layers: u("block_count")?,
            heads,
            kv_heads,
            head_dim,
            rope_theta: f.get_opt_f32(&key("rope.freq_base")).map_err(g)?.unwrap_or(10000.0),
            // llama.cpp's converter permutes Q/K rows for llama and
            // mistral; qwen2 keeps Hugging Face's layout (NeoX RoPE).
            rope_mode: if arch == "qwen2" { RopeMode::RotateHalf } else { RopeMode::Interleaved },
            rope_freq_factors,
            rms_eps: f.get_f32(&key("attention.layer_norm_rms_epsilon")).map_err(g)?,
            max_context: u("context_length")?,
            qkv_bias: f.tensor("blk.0.attn_q.bias").is_some(),
            tied_embeddings: f.tensor("output.weight").is_none(),
        };
        check_config(&c, path)?;
        Ok(c)
    }

    /// The config from a Hugging Face `config.json` (LlamaForCausalLM,
    /// Qwen2ForCausalLM, MistralForCausalLM).
    pub fn from_hf(json: &serde_json::Value, path: &Path) -> Result<LlamaConfig> {
        let arch = json["architectures"].get(0).and_then(|a| a.as_str()).unwrap_or("");
        if !matches!(arch, "LlamaForCausalLM" | "Qwen2ForCausalLM" | "MistralForCausalLM") {
            return Err(fmt_err(
                path,
                format!("architecture '{arch}' is not supported (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)"),
            ));
        }
        let u = |k: &str| -> Result<usize> {
            json[k]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| fmt_err(path, format!("'{k}' must be a non-negative integer, found {}", json[k])))
        };
        let hidden = u("hidden_size")?;
        let heads = u("num_attention_heads")?;
        let kv_heads = if json["num_key_value_heads"].is_null() { heads } else { u("num_key_value_heads")? };
        if heads == 0 {
            return Err(fmt_err(path, "num_attention_heads is 0"));
        }
        let head_dim = if json["head_dim"].is_u64() { u("head_dim")? } else { hidden / heads };
        let rope_theta = json["rope_theta"].as_f64().unwrap_or(10000.0) as f32;
        let rope_freq_factors = rope_scaling_factors(&json["rope_scaling"], rope_theta, head_dim).map_err(|e| fmt_err(path, e))?;
        let c = LlamaConfig {
            vocab: u("vocab_size")?,
            hidden,
            intermediate: u("intermediate_size")?,
            layers: u("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            rope_theta,
            rope_mode: RopeMode::RotateHalf,
            rope_freq_factors,
            rms_eps: json["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            max_context: u("max_position_embeddings")?,
            qkv_bias: arch == "Qwen2ForCausalLM" || json["attention_bias"].as_bool().unwrap_or(false),
            tied_embeddings: json["tie_word_embeddings"].as_bool().unwrap_or(false),
        };
        check_config(&c, path)?;
        Ok(c)
    }

    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Every weight the graph reads, with its logical `[rows, cols]` shape.
    pub fn weight_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (h, q, kv, ff) = (self.hidden, self.q_width(), self.kv_width(), self.intermediate);
        let mut v = vec![("token_embd.weight".to_string(), vec![self.vocab, h]), ("output_norm.weight".to_string(), vec![h])];
        if !self.tied_embeddings {
            v.push(("output.weight".into(), vec![self.vocab, h]));
        }
        for l in 0..self.layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            v.push((n("attn_norm.weight"), vec![h]));
            v.push((n("attn_q.weight"), vec![q, h]));
            v.push((n("attn_k.weight"), vec![kv, h]));
            v.push((n("attn_v.weight"), vec![kv, h]));
            if self.qkv_bias {
                v.push((n("attn_q.bias"), vec![q]));
                v.push((n("attn_k.bias"), vec![kv]));
                v.push((n("attn_v.bias"), vec![kv]));
            }
            v.push((n("attn_output.weight"), vec![h, q]));
            v.push((n("ffn_norm.weight"), vec![h]));
            v.push((n("ffn_gate.weight"), vec![ff, h]));
            v.push((n("ffn_up.weight"), vec![ff, h]));
            v.push((n("ffn_down.weight"), vec![h, ff]));
        }
        v
    }
}

fn to_f32_tensor(shape: &[usize], ttype: TensorType, bytes: &[u8], name: &str, path: &Path) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let vals: Vec<f32> = match ttype {
        TensorType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        TensorType::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        TensorType::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        TensorType::Quant(q) => {
            let mut out = vec![0f32; n];
            let k = *shape.last().unwrap_or(&0);
            let rb =
                q.row_bytes(k).ok_or_else(|| ModelError::tensor(path, name, format!("row of {k} is not a whole number of {q} blocks")))?;
            for (r, row) in out.chunks_mut(k.max(1)).enumerate() {
                let src = bytes.get(r * rb..(r + 1) * rb).ok_or_else(|| ModelError::tensor(path, name, "data shorter than its shape"))?;
                rlx::backends::quant::dequantize_row(q, src, row).map_err(|e| ModelError::tensor(path, name, e))?;
            }
            out
        }
    };
    if vals.len() != n {
        return Err(ModelError::tensor(path, name, format!("holds {} values, its shape {shape:?} needs {n}", vals.len())));
    }
    Ok(Tensor::from_f32(shape.to_vec(), &vals)?)
}

impl LlamaWeights {
    /// Config and weights of a GGUF file. Quantized matrices stay quantized;
    /// vectors (norms, biases) and float matrices become f32.
    pub fn from_gguf(path: &Path) -> Result<LlamaWeights> {
        let f = GgufFile::open(path).map_err(|e| fmt_err(path, e.to_string()))?;
        let config = LlamaConfig::from_gguf(&f, path)?;
        let mut kinds = HashMap::new();
        let mut tensors = Vec::new();
        for (name, shape) in config.weight_shapes() {
            let t = f.tensor(&name).ok_or_else(|| ModelError::tensor(path, &name, "missing from the file"))?;
            let got: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
            if got != shape {
                return Err(ModelError::tensor(path, &name, format!("expected shape {shape:?}, found {got:?}")));
            }
            let bytes = f.tensor_data(t);
            match t.ttype {
                TensorType::Quant(q) if shape.len() == 2 => {
                    let rb = q
                        .row_bytes(shape[1])
                        .ok_or_else(|| ModelError::tensor(path, &name, format!("rows of {} are not whole {q} blocks", shape[1])))?;
                    kinds.insert(name.clone(), WeightKind::Quant(q));
                    tensors.push((name, Tensor::from_bytes([shape[0], rb], DType::U8, bytes.to_vec())?));
                }
                tt => {
                    kinds.insert(name.clone(), WeightKind::F32);
                    tensors.push((name.clone(), to_f32_tensor(&shape, tt, bytes, &name, path)?));
                }
            }
        }
        Ok(LlamaWeights { config, kinds, tensors })
    }

    /// Every quantized weight dequantised to f32 (the reference path: what
    /// the quantized kernels are compared against).
    pub fn dequantized(self) -> Result<LlamaWeights> {
        let mut kinds = self.kinds;
        let mut tensors = Vec::with_capacity(self.tensors.len());
        let shapes: HashMap<String, Vec<usize>> = self.config.weight_shapes().into_iter().collect();
        for (name, t) in self.tensors {
            match kinds.get(&name).copied() {
                Some(WeightKind::Quant(q)) => {
                    let shape = shapes.get(&name).cloned().unwrap_or_default();
                    let f = to_f32_tensor(&shape, TensorType::Quant(q), t.bytes(), &name, Path::new("(in memory)"))?;
                    kinds.insert(name.clone(), WeightKind::F32);
                    tensors.push((name, f));
                }
                _ => tensors.push((name, t)),
            }
        }
        Ok(LlamaWeights { config: self.config, kinds, tensors })
    }

    /// Config and weights of a Hugging Face directory (`config.json` +
    /// `model.safetensors`), converted to f32.
    pub fn from_hf_dir(dir: &Path) -> Result<LlamaWeights> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| fmt_err(&cfg_path, format!("not valid JSON: {e}")))?;
        let config = LlamaConfig::from_hf(&json, &cfg_path)?;
        let st_path = dir.join("model.safetensors");
        let st = crate::safetensors::SafetensorsFile::open(&st_path)?;
        let hf_name = |name: &str| -> String {
            let map = [
                ("attn_norm.weight", "input_layernorm.weight"),
                ("ffn_norm.weight", "post_attention_layernorm.weight"),
                ("attn_q.", "self_attn.q_proj."),
                ("attn_k.", "self_attn.k_proj."),
                ("attn_v.", "self_attn.v_proj."),
                ("attn_output.weight", "self_attn.o_proj.weight"),
                ("ffn_gate.weight", "mlp.gate_proj.weight"),
                ("ffn_up.weight", "mlp.up_proj.weight"),
                ("ffn_down.weight", "mlp.down_proj.weight"),
            ];
            match name {
                "token_embd.weight" => "model.embed_tokens.weight".into(),
                "output_norm.weight" => "model.norm.weight".into(),
                "output.weight" => "lm_head.weight".into(),
                _ => {
                    let rest = name.strip_prefix("blk.").unwrap_or(name);
                    let (layer, part) = rest.split_once('.').unwrap_or(("0", rest));
                    let part = map.iter().find(|(g, _)| part.starts_with(g)).map_or(part.to_string(), |(g, h)| part.replacen(g, h, 1));
                    format!("model.layers.{layer}.{part}")
                }
            }
        };
        // A tied checkpoint may still carry lm_head.weight; an untied one
        // without it is refused by the shape walk below.
        let mut kinds = HashMap::new();
        let mut tensors = Vec::new();
        for (name, shape) in config.weight_shapes() {
            let hf = hf_name(&name);
            let t = st.tensor(&hf).map_err(|e| ModelError::tensor(&st_path, &hf, e.to_string()))?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::tensor(&st_path, &hf, format!("expected shape {shape:?}, found {:?}", t.dims())));
            }
            kinds.insert(name.clone(), WeightKind::F32);
            tensors.push((name, t.to_dtype(DType::F32)));
        }
        Ok(LlamaWeights { config, kinds, tensors })
    }
}

/// What one step graph computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    /// Sequences run side by side (every state tensor has this batch).
    pub batch: usize,
    /// Tokens per sequence in this step (1 for decode).
    pub seq: usize,
    /// Read the token and position from state instead of inputs.
    pub decode: bool,
    /// Cache rows per sequence.
    pub ctx: usize,
    /// Also output the logits the token was sampled from (tests, tools).
    pub logits: bool,
    /// The KV cache's dtype (f32, f16 or bf16): keys and values are
    /// rounded to it as they are written, and attention reads them as
    /// stored with f32 queries.
    pub kv_dtype: DType,
}

/// Input and output names of a step graph.
pub mod io {
    /// i32 `[B, S]` (prefill): the chunk's tokens.
    pub const IDS: &str = "ids";
    /// i32 `[B, S]` (prefill): each token's position.
    pub const POSITIONS: &str = "positions";
    /// i32 `[B]` (prefill): the chunk's first position per sequence.
    pub const START: &str = "start";
    /// i32 `[B]` (prefill): valid keys after the chunk (start + S).
    pub const VALID: &str = "valid";
    /// i32 `[B]` (prefill): flat row `b*S + i` of each sequence's last real token.
    pub const LAST_ROW: &str = "last_row";
    /// i32 `[B]` (prefill): tokens in the cache after the chunk (start + real length).
    pub const NEXT_POS: &str = "next_pos";
    /// i32 `[B]` (prefill): 0 for a sequence being prefilled, 1 for the
    /// others (their token and position are left as they are).
    pub const SLOT_ROW: &str = "slot_row";
    /// i32 `[B]` (decode): 1 for a sequence that advances, 0 for a free slot.
    pub const STEP: &str = "step";
    /// f32 `[B, 4]`: temperature, top_p, min_p, repeat_penalty.
    pub const FPARAMS: &str = "sample_f";
    /// i32 `[B, 4]`: top_k, repeat_last_n, seed low, seed high.
    pub const IPARAMS: &str = "sample_i";
    /// Output i32 `[B]`: the sampled token.
    pub const TOKEN_OUT: &str = "next_token";
    /// Output f32 `[B, V]` when asked for.
    pub const LOGITS_OUT: &str = "logits";
}

/// State names shared by the step executables of one generator.
pub mod state {
    pub const TOKEN: &str = "token";
    pub const POS: &str = "pos";
    pub const HISTORY: &str = "history";
    pub fn k_cache(l: usize) -> String {
        format!("k_cache.{l}")
    }
    pub fn v_cache(l: usize) -> String {
        format!("v_cache.{l}")
    }
}

struct Builder<'a> {
    g: Graph,
    kinds: &'a HashMap<String, WeightKind>,
    shapes: HashMap<String, Vec<usize>>,
}

impl Builder<'_> {
    fn kind(&self, name: &str) -> Result<WeightKind> {
        self.kinds.get(name).copied().ok_or_else(|| ModelError::Input(format!("weight '{name}' has no recorded storage kind")))
    }

    fn param(&mut self, name: &str) -> Result<NodeId> {
        let shape = self.shapes.get(name).cloned().ok_or_else(|| ModelError::Input(format!("unknown weight '{name}'")))?;
        Ok(match self.kind(name)? {
            WeightKind::F32 => self.g.param(name, shape, DType::F32)?,
            WeightKind::Quant(q) => {
                let rb =
                    q.row_bytes(shape[1]).ok_or_else(|| ModelError::Input(format!("weight '{name}': rows are not whole {q} blocks")))?;
                self.g.param(name, [shape[0], rb], DType::U8)?
            }
        })
    }

    /// x · wᵀ for a `[N, K]` weight in either storage.
    fn linear(&mut self, x: NodeId, name: &str) -> Result<NodeId> {
        let w = self.param(name)?;
        Ok(match self.kind(name)? {
            WeightKind::F32 => self.g.matmul_t(x, w)?,
            WeightKind::Quant(q) => self.g.qmatmul(x, w, q)?,
        })
    }
}

/// The graph of one step (see the module docs).
pub fn build_step_graph(c: &LlamaConfig, kinds: &HashMap<String, WeightKind>, s: StepShape) -> Result<Graph> {
    let (b, sq) = (s.batch, s.seq);
    if b == 0 || sq == 0 || s.ctx == 0 || (s.decode && sq != 1) || sq > s.ctx || !s.kv_dtype.is_float() {
        return Err(ModelError::Input(format!("invalid step shape {s:?}")));
    }
    let mut bl = Builder { g: Graph::new(), kinds, shapes: c.weight_shapes().into_iter().collect() };
    let (h, qw, kvw) = (c.hidden, c.q_width(), c.kv_width());
    let token_state = bl.g.state(state::TOKEN, [b, 2, 1], DType::I32)?;
    let pos_state = bl.g.state(state::POS, [b, 2, 1], DType::I32)?;
    let history = bl.g.state(state::HISTORY, [b, s.ctx, 1], DType::I32)?;
    let fparams = bl.g.input(io::FPARAMS, [b, 4], DType::F32)?;
    let iparams = bl.g.input(io::IPARAMS, [b, 4], DType::I32)?;

    // ids [B, S]; positions [B, S]; write position, valid keys, the row to
    // sample from, and the position of the token sampled next, all [B].
    let (ids, positions, start, valid, next_pos, history, sample_pos, write_row) = if s.decode {
        let tok = bl.g.narrow(token_state, 1, 0, 1)?;
        let ids = bl.g.reshape(tok, [b, 1])?;
        let pos = bl.g.narrow(pos_state, 1, 0, 1)?;
        let positions = bl.g.reshape(pos, [b, 1])?;
        let pos = bl.g.reshape(pos, [b])?;
        let step = bl.g.input(io::STEP, [b], DType::I32)?;
        let next = bl.g.add(pos, step)?;
        let one = bl.g.constant_i32([b], &vec![1; b])?;
        let valid_keys = bl.g.add(pos, one)?;
        let row0 = bl.g.constant_i32([b], &vec![0; b])?;
        (ids, positions, pos, valid_keys, next, history, pos, row0)
    } else {
        let ids = bl.g.input(io::IDS, [b, sq], DType::I32)?;
        let positions = bl.g.input(io::POSITIONS, [b, sq], DType::I32)?;
        let start = bl.g.input(io::START, [b], DType::I32)?;
        let valid = bl.g.input(io::VALID, [b], DType::I32)?;
        let next_pos = bl.g.input(io::NEXT_POS, [b], DType::I32)?;
        let slot_row = bl.g.input(io::SLOT_ROW, [b], DType::I32)?;
        let ids3 = bl.g.reshape(ids, [b, sq, 1])?;
        let history = bl.g.write_state(history, ids3, start)?;
        // The history entry of the last token consumed: its position.
        let one = bl.g.constant_i32([b], &vec![1; b])?;
        let sample_pos = bl.g.sub(next_pos, one)?;
        (ids, positions, start, valid, next_pos, history, sample_pos, slot_row)
    };

    let embd_kind = bl.kind("token_embd.weight")?;
    let table = bl.param("token_embd.weight")?;
    let mut x = match embd_kind {
        WeightKind::F32 => bl.g.gather(table, ids)?,
        WeightKind::Quant(q) => bl.g.qgather(table, ids, q)?,
    };
    let spec = AttentionSpec {
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        scale: 1.0 / (c.head_dim as f32).sqrt(),
        causal: true,
        mask: false,
        valid_len: true,
    };
    let factors = match &c.rope_freq_factors {
        Some(v) => Some(bl.g.constant_f32([v.len()], v)?),
        None => None,
    };
    for l in 0..c.layers {
        let n = |p: &str| format!("blk.{l}.{p}");
        let g1 = bl.param(&n("attn_norm.weight"))?;
        let hn = bl.g.rms_norm(x, g1, c.rms_eps)?;
        let mut q = bl.linear(hn, &n("attn_q.weight"))?;
        let mut k = bl.linear(hn, &n("attn_k.weight"))?;
        let mut v = bl.linear(hn, &n("attn_v.weight"))?;
        if c.qkv_bias {
            let (qb, kb, vb) = (bl.param(&n("attn_q.bias"))?, bl.param(&n("attn_k.bias"))?, bl.param(&n("attn_v.bias"))?);
            q = bl.g.add(q, qb)?;
            k = bl.g.add(k, kb)?;
            v = bl.g.add(v, vb)?;
        }
        let (q, k) = match factors {
            Some(f) => (
                bl.g.rope_scaled(q, positions, f, c.head_dim, c.rope_theta, c.rope_mode)?,
                bl.g.rope_scaled(k, positions, f, c.head_dim, c.rope_theta, c.rope_mode)?,
            ),
            None => (
                bl.g.rope(q, positions, c.head_dim, c.rope_theta, c.rope_mode)?,
                bl.g.rope(k, positions, c.head_dim, c.rope_theta, c.rope_mode)?,
            ),
        };
        let kc = bl.g.state(&state::k_cache(l), [b, s.ctx, kvw], s.kv_dtype)?;
        let vc = bl.g.state(&state::v_cache(l), [b, s.ctx, kvw], s.kv_dtype)?;
        let kc = bl.g.write_state(kc, k, start)?;
        let vc = bl.g.write_state(vc, v, start)?;
        let att = bl.g.attention(spec, q, kc, vc, None, Some(valid))?;
        let o = bl.linear(att, &n("attn_output.weight"))?;
        x = bl.g.add(x, o)?;
        let g2 = bl.param(&n("ffn_norm.weight"))?;
        let hn = bl.g.rms_norm(x, g2, c.rms_eps)?;
        let gate = bl.linear(hn, &n("ffn_gate.weight"))?;
        let up = bl.linear(hn, &n("ffn_up.weight"))?;
        let act = bl.g.swiglu(gate, up)?;
        let down = bl.linear(act, &n("ffn_down.weight"))?;
        x = bl.g.add(x, down)?;
    }
    debug_assert_eq!(qw, c.heads * c.head_dim);
    // The row each sequence samples from: its last real token.
    let last = if s.decode {
        bl.g.reshape(x, [b, h])?
    } else {
        let rows = bl.g.reshape(x, [b * sq, h])?;
        let last_row = bl.g.input(io::LAST_ROW, [b], DType::I32)?;
        bl.g.gather(rows, last_row)?
    };
    let gn = bl.param("output_norm.weight")?;
    let last = bl.g.rms_norm(last, gn, c.rms_eps)?;
    let head = if c.tied_embeddings { "token_embd.weight" } else { "output.weight" };
    let logits = if c.tied_embeddings {
        match embd_kind {
            WeightKind::F32 => bl.g.matmul_t(last, table)?,
            WeightKind::Quant(q) => bl.g.qmatmul(last, table, q)?,
        }
    } else {
        bl.linear(last, head)?
    };
    let hist2 = bl.g.reshape(history, [b, s.ctx])?;
    let token = bl.g.sample(logits, fparams, iparams, hist2, sample_pos)?;
    // Feed it back: the token, its position, its history entry.
    let tok3 = bl.g.reshape(token, [b, 1, 1])?;
    bl.g.write_state(token_state, tok3, write_row)?;
    let np3 = bl.g.reshape(next_pos, [b, 1, 1])?;
    bl.g.write_state(pos_state, np3, write_row)?;
    bl.g.write_state(history, tok3, next_pos)?;
    bl.g.output(token)?;
    bl.g.set_name(token, io::TOKEN_OUT);
    if s.logits {
        bl.g.output(logits)?;
        bl.g.set_name(logits, io::LOGITS_OUT);
    }
    Ok(bl.g)
}

#[cfg(test)]
mod tests {
    use super::rope_scaling_factors;
    use serde_json::json;

    /// Llama 3.1's published settings: pairs with wavelengths under 2048
    /// positions keep their frequency, those over 8192 are slowed 8×, and
    /// the band between blends the two.
    #[test]
    fn llama3_rope_factors() {
        let s = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192});
        let (theta, hd) = (500000.0f32, 128);
        let f = rope_scaling_factors(&s, theta, hd).expect("llama3").expect("factors");
        assert_eq!(f.len(), 64);
        let wavelen = |i: usize| 2.0 * std::f64::consts::PI * (theta as f64).powf(2.0 * i as f64 / hd as f64);
        for (i, &v) in f.iter().enumerate() {
            let w = wavelen(i);
            if w < 2048.0 {
                assert_eq!(v, 1.0, "pair {i} (wavelength {w})");
            } else if w > 8192.0 {
                assert!((v - 8.0).abs() < 1e-6, "pair {i} (wavelength {w}): {v}");
            } else {
                // 1 / ((1 - t)/8 + t) with t = (8192/w - 1) / 3.
                let t = (8192.0 / w - 1.0) / 3.0;
                let want = 1.0 / ((1.0 - t) / 8.0 + t);
                assert!((v as f64 - want).abs() < 1e-5 * want, "pair {i}: {v} vs {want}");
                assert!(v > 1.0 && v < 8.0);
            }
        }
        assert!(f.windows(2).all(|w| w[0] <= w[1]), "factors grow with the wavelength");
        assert!(f.iter().any(|&v| v > 1.0 && v < 8.0), "some pairs blend");
    }

    #[test]
    fn other_rope_scalings() {
        assert_eq!(rope_scaling_factors(&serde_json::Value::Null, 1e4, 64), Ok(None));
        assert_eq!(rope_scaling_factors(&json!({"rope_type": "default"}), 1e4, 64), Ok(None));
        assert_eq!(rope_scaling_factors(&json!({"type": "linear", "factor": 2.0}), 1e4, 8), Ok(Some(vec![2.0; 4])));
        let e = rope_scaling_factors(&json!({"rope_type": "yarn", "factor": 4.0}), 1e4, 64).unwrap_err();
        assert!(e.contains("'yarn' is not supported"), "{e}");
        let e = rope_scaling_factors(&json!({"rope_type": "llama3", "factor": 8.0}), 1e4, 64).unwrap_err();
        assert!(e.contains("low_freq_factor"), "{e}");
        let e = rope_scaling_factors(&json!({"rope_type": "linear", "factor": -1.0}), 1e4, 64).unwrap_err();
        assert!(e.contains("positive"), "{e}");
    }
}
