//! Model configuration: Hugging Face `config.json` for BertModel, and the
//! sentence-transformers files around it (`sentence_bert_config.json`,
//! `modules.json`, `1_Pooling/config.json`).

use std::path::Path;

use rlx::Activation;
use serde::Deserialize;
use serde_json::Value;

use crate::error::{read_regular_file, read_regular_file_if_present};
use crate::{ModelError, Result};

/// The shape of a BERT encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: Activation,
    pub layer_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
}

#[derive(Deserialize)]
struct RawBert {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    intermediate_size: Option<usize>,
    hidden_act: Option<String>,
    layer_norm_eps: Option<f64>,
    max_position_embeddings: Option<usize>,
    type_vocab_size: Option<usize>,
    position_embedding_type: Option<String>,
}

/// Upper bounds on a config's sizes, far above any published BERT (the
/// largest have 48 layers, hidden 4096, 250k tokens, 8192 positions). They
/// keep a corrupt config from asking for unbounded memory before the
/// weights are checked against it; the weights then decide.
const MAX_LAYERS: usize = 1024;
const MAX_HIDDEN: usize = 1 << 16;
const MAX_INTERMEDIATE: usize = 1 << 18;
const MAX_VOCAB: usize = 1 << 24;
const MAX_POSITIONS: usize = 1 << 20;
const MAX_TYPE_VOCAB: usize = 1 << 16;

/// BERT-family classes whose encoder weights are a plain BertModel's.
const BERT_ARCHS: &[&str] = &["BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification"];

impl BertConfig {
    /// all-MiniLM-L6-v2's shape.
    pub fn minilm_l6() -> BertConfig {
        BertConfig {
            vocab_size: 30522,
            hidden_size: 384,
            num_hidden_layers: 6,
            num_attention_heads: 12,
            intermediate_size: 1536,
            hidden_act: Activation::Gelu,
            layer_norm_eps: 1e-12,
            max_position_embeddings: 512,
            type_vocab_size: 2,
        }
    }

    /// bert-base-uncased's shape (benchmarks use it with random weights).
    pub fn bert_base() -> BertConfig {
        BertConfig { hidden_size: 768, num_hidden_layers: 12, intermediate_size: 3072, ..BertConfig::minilm_l6() }
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Reads a Hugging Face `config.json`; anything but a BERT encoder with
    /// absolute positions is refused.
    pub fn from_file(path: &Path) -> Result<BertConfig> {
        let text = read_regular_file(path)?;
        BertConfig::from_json(path, &text)
    }

    pub fn from_json(path: &Path, text: &str) -> Result<BertConfig> {
        let raw: RawBert = serde_json::from_str(text).map_err(|e| ModelError::format(path, format!("not a valid config.json: {e}")))?;
        match raw.model_type.as_deref() {
            Some("bert") => {}
            Some(other) => {
                return Err(ModelError::format(path, format!("model_type '{other}' is not supported: expected 'bert' (a BertModel)")))
            }
            None => return Err(ModelError::format(path, "no model_type: expected \"model_type\": \"bert\"")),
        }
        if let Some(archs) = &raw.architectures {
            if !archs.iter().any(|a| BERT_ARCHS.contains(&a.as_str())) {
                return Err(ModelError::format(
                    path,
                    format!("architectures {archs:?} are not supported: expected BertModel (or {})", BERT_ARCHS[1..].join(", ")),
                ));
            }
        }
        if let Some(p) = raw.position_embedding_type.as_deref() {
            if p != "absolute" {
                return Err(ModelError::format(path, format!("position_embedding_type '{p}' is not supported: expected 'absolute'")));
            }
        }
        let need = |v: Option<usize>, key: &str| -> Result<usize> {
            match v {
                Some(0) => Err(ModelError::format(path, format!("{key} is 0: expected a positive number"))),
                Some(v) => Ok(v),
                None => Err(ModelError::format(path, format!("missing {key}"))),
            }
        };
        let hidden_act = match raw.hidden_act.as_deref().unwrap_or("gelu") {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            "silu" | "swish" => Activation::Silu,
            "tanh" => Activation::Tanh,
            other => {
                return Err(ModelError::format(
                    path,
                    format!("hidden_act '{other}' is not supported: expected gelu, gelu_new, relu, silu or tanh"),
                ))
            }
        };
        let cfg = BertConfig {
            vocab_size: need(raw.vocab_size, "vocab_size")?,
            hidden_size: need(raw.hidden_size, "hidden_size")?,
            num_hidden_layers: need(raw.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads: need(raw.num_attention_heads, "num_attention_heads")?,
            intermediate_size: need(raw.intermediate_size, "intermediate_size")?,
            hidden_act,
            layer_norm_eps: raw.layer_norm_eps.unwrap_or(1e-12) as f32,
            max_position_embeddings: need(raw.max_position_embeddings, "max_position_embeddings")?,
            type_vocab_size: raw.type_vocab_size.unwrap_or(2),
        };
        for (key, value, limit) in [
            ("vocab_size", cfg.vocab_size, MAX_VOCAB),
            ("hidden_size", cfg.hidden_size, MAX_HIDDEN),
            ("num_hidden_layers", cfg.num_hidden_layers, MAX_LAYERS),
            ("intermediate_size", cfg.intermediate_size, MAX_INTERMEDIATE),
            ("max_position_embeddings", cfg.max_position_embeddings, MAX_POSITIONS),
            ("type_vocab_size", cfg.type_vocab_size, MAX_TYPE_VOCAB),
        ] {
            if value > limit {
                return Err(ModelError::format(
                    path,
                    format!("{key} is {value}, more than any BERT model has (at most {limit} accepted): the config is corrupt"),
                ));
            }
        }
        if !(cfg.layer_norm_eps.is_finite() && cfg.layer_norm_eps > 0.0 && cfg.layer_norm_eps < 1.0) {
            return Err(ModelError::format(
                path,
                format!("layer_norm_eps is {}: expected a small positive number such as 1e-12", raw.layer_norm_eps.unwrap_or(f64::NAN)),
            ));
        }
        if !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
            return Err(ModelError::format(
                path,
                format!("hidden_size {} is not a multiple of num_attention_heads {}", cfg.hidden_size, cfg.num_attention_heads),
            ));
        }
        Ok(cfg)
    }
}

/// How token vectors become one sentence vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Mean over positions with mask 1 (special tokens included).
    Mean,
    /// The first position (`[CLS]`).
    Cls,
}

/// The sentence-transformers pipeline around the encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct SentenceConfig {
    /// Texts are truncated to this many tokens (special tokens included).
    pub max_seq_length: usize,
    pub pooling: Pooling,
    /// L2-normalise the pooled vector (a `Normalize` module in modules.json).
    pub normalize: bool,
}

impl SentenceConfig {
    /// Reads the sentence-transformers files of `dir`. Missing files fall back
    /// to mean pooling, no normalisation and the model's own maximum length.
    pub fn from_dir(dir: &Path, model: &BertConfig) -> Result<SentenceConfig> {
        let mut cfg = SentenceConfig { max_seq_length: model.max_position_embeddings, pooling: Pooling::Mean, normalize: false };

        let sbert = dir.join("sentence_bert_config.json");
        if let Some(v) = read_json_if_present(&sbert)? {
            match v.get("max_seq_length") {
                None | Some(Value::Null) => {}
                Some(x) => {
                    let n = x
                        .as_u64()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| ModelError::format(&sbert, format!("max_seq_length must be a positive integer, found {x}")))?;
                    cfg.max_seq_length = (n as usize).min(model.max_position_embeddings);
                }
            }
        }

        let modules = dir.join("modules.json");
        let mut pooling_dir = dir.join("1_Pooling");
        // A Pooling module that modules.json names must have its config: a
        // silent fallback to mean pooling would give a CLS model wrong vectors.
        let mut pooling_named = false;
        if let Some(v) = read_json_if_present(&modules)? {
            let list = v.as_array().ok_or_else(|| ModelError::format(&modules, "expected a JSON list of modules"))?;
            for m in list {
                let ty = m.get("type").and_then(Value::as_str).unwrap_or("");
                let sub = m.get("path").and_then(Value::as_str).unwrap_or("");
                match ty.rsplit('.').next().unwrap_or("") {
                    "Normalize" => cfg.normalize = true,
                    "Pooling" => {
                        pooling_dir = dir.join(sub);
                        pooling_named = true;
                    }
                    "Transformer" => {}
                    other => {
                        return Err(ModelError::format(
                            &modules,
                            format!("module type '{ty}' ({other}) is not supported: expected Transformer, Pooling, Normalize"),
                        ))
                    }
                }
            }
        }

        let pooling = pooling_dir.join("config.json");
        if pooling_named && !pooling.exists() {
            return Err(ModelError::format(&modules, format!("names a Pooling module but {} is missing", pooling.display())));
        }
        if let Some(v) = read_json_if_present(&pooling)? {
            let on = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
            // Unsupported modes first: "max only" is not "neither mean nor CLS".
            for k in [
                "pooling_mode_max_tokens",
                "pooling_mode_mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens",
                "pooling_mode_lasttoken",
            ] {
                if on(k) {
                    return Err(ModelError::format(&pooling, format!("{k} is not supported (only mean and CLS pooling)")));
                }
            }
            cfg.pooling = match (on("pooling_mode_mean_tokens"), on("pooling_mode_cls_token")) {
                (true, false) => Pooling::Mean,
                (false, true) => Pooling::Cls,
                (m, c) => {
                    return Err(ModelError::format(
                        &pooling,
                        format!(
                            "pooling mean={m} cls={c}: exactly one of pooling_mode_mean_tokens and pooling_mode_cls_token must be true"
                        ),
                    ))
                }
            };
            match v.get("word_embedding_dimension") {
                None | Some(Value::Null) => {}
                Some(d) if d.as_u64() == Some(model.hidden_size as u64) => {}
                Some(d) => {
                    return Err(ModelError::format(
                        &pooling,
                        format!(
                        "word_embedding_dimension is {d}, but config.json's hidden_size is {}: the pooling module belongs to another model",
                        model.hidden_size
                    ),
                    ))
                }
            }
        }
        Ok(cfg)
    }
}

fn read_json_if_present(path: &Path) -> Result<Option<Value>> {
    match read_regular_file_if_present(path)? {
        Some(text) => serde_json::from_str(&text).map(Some).map_err(|e| ModelError::format(path, format!("invalid JSON: {e}"))),
        None => Ok(None),
    }
}
