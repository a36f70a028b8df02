//! The models `rlx bench` runs, through rlx-models: their shapes, seeded
//! random weights, the graph for one (batch, seq) bucket, the inputs, and the
//! Hugging Face directory (config.json + model.safetensors) that hands the
//! very same weights to the PyTorch peer.

use std::path::Path;
use std::sync::Arc;

use rlx::{Activation, DType, Graph, Tensor, WeightStore};
use rlx_models::{build_bert_graph, random_weights, BertConfig, BertGraphOptions, ATTENTION_MASK, INPUT_IDS};
use serde_json::json;

/// A named model shape.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub name: &'static str,
    pub cfg: BertConfig,
}

pub const MODEL_NAMES: &str = "minilm, bert-base, tiny";

/// `minilm` (all-MiniLM-L6-v2's shape), `bert-base`, or `tiny` (a
/// two-layer toy for quick checks of the bench itself).
pub fn model_spec(name: &str) -> Result<ModelSpec, String> {
    match name.trim().to_ascii_lowercase().as_str() {
        "minilm" | "minilm-l6" | "all-minilm-l6-v2" => Ok(ModelSpec { name: "MiniLM-L6", cfg: BertConfig::minilm_l6() }),
        "bert-base" | "bert" => Ok(ModelSpec { name: "bert-base", cfg: BertConfig::bert_base() }),
        "tiny" => Ok(ModelSpec {
            name: "tiny",
            cfg: BertConfig {
                vocab_size: 1000,
                hidden_size: 64,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                intermediate_size: 128,
                max_position_embeddings: 128,
                ..BertConfig::minilm_l6()
            },
        }),
        other => Err(format!("--model: unknown model '{other}' (expected one of: {MODEL_NAMES})")),
    }
}

/// Seeded random weights in `dtype`, HF BertModel names.
pub fn weights(spec: &ModelSpec, seed: u64, dtype: DType) -> Result<Arc<WeightStore>, String> {
    random_weights(&spec.cfg, seed, dtype).map_err(|e| format!("{}: random weights: {e}", spec.name))
}

/// The encoder for one bucket. Its output 0 is the mean of the last hidden
/// state over the mask, not normalised (see [`POOLED_NORMALIZED`]).
pub fn graph(spec: &ModelSpec, batch: usize, seq: usize) -> Result<Graph, String> {
    if seq > spec.cfg.max_position_embeddings {
        return Err(format!("{}: seq {seq} exceeds max_position_embeddings {}", spec.name, spec.cfg.max_position_embeddings));
    }
    build_bert_graph(&spec.cfg, batch, seq, &BertGraphOptions::default()).map_err(|e| format!("{}: building the graph: {e}", spec.name))
}

/// Whether [`graph`]'s pooled output is L2-normalised.
pub const POOLED_NORMALIZED: bool = false;

/// Token ids and mask for one bucket: row 0 full length, later rows padded
/// by varying amounts so the key-padding path is exercised and visible in
/// the output comparison.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub batch: usize,
    pub seq: usize,
    pub ids: Vec<i64>,
    pub mask: Vec<i64>,
}

impl Inputs {
    pub fn new(vocab: usize, batch: usize, seq: usize, seed: u64) -> Inputs {
        let mut state = seed ^ 0x9e37_79b9_7f4a_7c15 ^ ((batch as u64) << 32 | seq as u64);
        let (lo, hi) = if vocab > 2000 { (1000, vocab as u64) } else { (1, vocab.max(2) as u64) };
        let mut ids = Vec::with_capacity(batch * seq);
        let mut mask = Vec::with_capacity(batch * seq);
        for b in 0..batch {
            let len = if b == 0 || seq < 4 { seq } else { seq - (b * 37) % (seq / 2) };
            for s in 0..seq {
                let id = lo + splitmix64(&mut state) % (hi - lo);
                ids.push(if s < len { id as i64 } else { 0 });
                mask.push(i64::from(s < len));
            }
        }
        Inputs { batch, seq, ids, mask }
    }

    /// The graph's inputs: `input_ids` i32 and `attention_mask` f32.
    pub fn tensors(&self) -> Result<Vec<(&'static str, Tensor)>, String> {
        let shape = [self.batch, self.seq];
        let ids: Vec<i32> = self.ids.iter().map(|&v| v as i32).collect();
        let mask: Vec<f32> = self.mask.iter().map(|&v| v as f32).collect();
        let err = |e: rlx::RuntimeError| format!("bench inputs: {e}");
        Ok(vec![(INPUT_IDS, Tensor::from_i32(shape, &ids).map_err(err)?), (ATTENTION_MASK, Tensor::from_f32(shape, &mask).map_err(err)?)])
    }
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn hf_activation(a: Activation) -> &'static str {
    match a {
        Activation::Gelu => "gelu",
        Activation::GeluTanh => "gelu_new",
        Activation::Silu => "silu",
        Activation::Relu => "relu",
        Activation::Tanh => "tanh",
    }
}

/// Writes `dir/config.json` (a BertModel config) and `dir/model.safetensors`
/// holding exactly the store's tensors, so transformers loads the weights
/// RLX runs.
pub fn write_hf_dir(dir: &Path, spec: &ModelSpec, store: &WeightStore, dtype: DType) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let c = &spec.cfg;
    let torch_dtype = match dtype {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        _ => "float32",
    };
    let config = json!({
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "intermediate_size": c.intermediate_size,
        "hidden_act": hf_activation(c.hidden_act),
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": c.max_position_embeddings,
        "type_vocab_size": c.type_vocab_size,
        "layer_norm_eps": c.layer_norm_eps,
        "initializer_range": 0.02,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "torch_dtype": torch_dtype,
    });
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, config.to_string()).map_err(|e| format!("cannot write {}: {e}", cfg_path.display()))?;
    let names = store.names();
    let tensors: Vec<Arc<Tensor>> = names.iter().filter_map(|n| store.get(n)).collect();
    if tensors.len() != names.len() {
        return Err(format!("{}: the weight store changed while it was being written", spec.name));
    }
    let pairs: Vec<(&str, &Tensor)> = names.iter().map(String::as_str).zip(tensors.iter().map(|t| t.as_ref())).collect();
    let st_path = dir.join("model.safetensors");
    rlx_models::safetensors::write_safetensors(&st_path, &pairs).map_err(|e| format!("writing {}: {e}", st_path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_are_seeded_in_range_and_padded_after_row_zero() {
        let a = Inputs::new(30522, 4, 16, 7);
        assert_eq!(a.ids, Inputs::new(30522, 4, 16, 7).ids);
        assert_ne!(a.ids, Inputs::new(30522, 4, 16, 8).ids);
        assert!(a.mask[..16].iter().all(|&m| m == 1));
        for b in 1..4 {
            let row = &a.mask[b * 16..(b + 1) * 16];
            let len = row.iter().filter(|&&m| m == 1).count();
            assert!((8..=16).contains(&len) && row[..len].iter().all(|&m| m == 1), "row {b}: {row:?}");
        }
        assert!(a.ids.iter().zip(&a.mask).all(|(&i, &m)| if m == 1 { (1000..30522).contains(&i) } else { i == 0 }));
        assert!(a.mask.contains(&0), "some padding expected at batch 4");
    }

    #[test]
    fn unknown_model_is_an_error_naming_the_choices() {
        let e = model_spec("gpt2").err().unwrap_or_default();
        assert!(e.contains("gpt2") && e.contains("bert-base"), "{e}");
        assert_eq!(model_spec("MiniLM").map(|m| m.cfg.hidden_size).ok(), Some(384));
        assert_eq!(model_spec("bert-base").map(|m| m.cfg.num_hidden_layers).ok(), Some(12));
    }

    #[test]
    fn hf_dir_round_trips_through_the_models_loaders() {
        let spec = model_spec("tiny").unwrap_or_else(|e| panic!("{e}"));
        let store = weights(&spec, 3, DType::F16).unwrap_or_else(|e| panic!("{e}"));
        let dir = std::env::temp_dir().join(format!("rlx-bench-hf-{}", std::process::id()));
        write_hf_dir(&dir, &spec, &store, DType::F16).unwrap_or_else(|e| panic!("{e}"));
        let cfg = BertConfig::from_file(&dir.join("config.json")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cfg, spec.cfg);
        let back = WeightStore::new();
        rlx_models::load_bert_weights(&dir.join("model.safetensors"), &cfg, DType::F16, &back).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back.names(), store.names());
        for n in store.names() {
            assert_eq!(back.get(&n).map(|t| t.bytes().to_vec()), store.get(&n).map(|t| t.bytes().to_vec()), "{n}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
