//! BERT weights: the names and shapes a config needs, loading them from a
//! safetensors file into a [`WeightStore`] with every mismatch reported, and
//! seeded random weights for benchmarks and device tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rlx::{DType, Tensor, WeightStore};

use crate::safetensors::SafetensorsFile;
use crate::{BertConfig, ModelError, Result};

/// Every weight a BERT encoder of `cfg` needs: (name, shape), names without
/// the `bert.` prefix, as the graph's params use them.
pub fn bert_weight_specs(cfg: &BertConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let mut v = vec![
        ("embeddings.word_embeddings.weight".to_string(), vec![cfg.vocab_size, h]),
        ("embeddings.position_embeddings.weight".to_string(), vec![cfg.max_position_embeddings, h]),
        ("embeddings.LayerNorm.weight".to_string(), vec![h]),
        ("embeddings.LayerNorm.bias".to_string(), vec![h]),
    ];
    if cfg.type_vocab_size > 0 {
        v.push(("embeddings.token_type_embeddings.weight".to_string(), vec![cfg.type_vocab_size, h]));
    }
    for l in 0..cfg.num_hidden_layers {
        let p = |s: &str| format!("encoder.layer.{l}.{s}");
        for m in ["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"] {
            v.push((p(&format!("{m}.weight")), vec![h, h]));
            v.push((p(&format!("{m}.bias")), vec![h]));
        }
        v.push((p("attention.output.LayerNorm.weight"), vec![h]));
        v.push((p("attention.output.LayerNorm.bias"), vec![h]));
        v.push((p("intermediate.dense.weight"), vec![i, h]));
        v.push((p("intermediate.dense.bias"), vec![i]));
        v.push((p("output.dense.weight"), vec![h, i]));
        v.push((p("output.dense.bias"), vec![h]));
        v.push((p("output.LayerNorm.weight"), vec![h]));
        v.push((p("output.LayerNorm.bias"), vec![h]));
    }
    v
}

/// Tensors a BertModel checkpoint may carry that the encoder does not use:
/// buffers, the pooler head and pre-training heads.
fn ignorable(name: &str) -> bool {
    matches!(name, "embeddings.position_ids" | "embeddings.token_type_ids") || name.starts_with("pooler.") || name.starts_with("cls.")
}

/// Old checkpoints name LayerNorm parameters gamma/beta.
fn canonical(name: &str) -> String {
    let n = name.strip_prefix("bert.").unwrap_or(name);
    if let Some(s) = n.strip_suffix("LayerNorm.gamma") {
        return format!("{s}LayerNorm.weight");
    }
    if let Some(s) = n.strip_suffix("LayerNorm.beta") {
        return format!("{s}LayerNorm.bias");
    }
    n.to_string()
}

/// Loads the encoder weights of `cfg` from a safetensors file into `store`,
/// converted to `dtype`. Refuses the file if any tensor is missing, extra or
/// mis-shaped, naming the tensor and both shapes.
pub fn load_bert_weights(path: &Path, cfg: &BertConfig, dtype: DType, store: &WeightStore) -> Result<()> {
    if !dtype.is_float() {
        return Err(ModelError::Input(format!("weights must be stored as f32, f16 or bf16, not {dtype}")));
    }
    let file = SafetensorsFile::open(path)?;
    let mut by_name: BTreeMap<String, String> = BTreeMap::new();
    for stored in file.names() {
        let c = canonical(stored);
        if let Some(prev) = by_name.insert(c.clone(), stored.to_string()) {
            return Err(ModelError::tensor(path, stored, format!("is the same weight as '{prev}' (both map to '{c}')")));
        }
    }
    let specs = bert_weight_specs(cfg);
    let wanted: BTreeSet<&str> = specs.iter().map(|(n, _)| n.as_str()).collect();
    let extra: Vec<&str> = by_name.iter().filter(|(c, _)| !wanted.contains(c.as_str()) && !ignorable(c)).map(|(_, s)| s.as_str()).collect();
    if let Some(first) = extra.first() {
        return Err(ModelError::tensor(
            path,
            first,
            format!(
                "not part of a BertModel with {} layers, hidden {} ({} unexpected tensor(s): {})",
                cfg.num_hidden_layers,
                cfg.hidden_size,
                extra.len(),
                extra.iter().take(5).copied().collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    let missing: Vec<&str> = specs.iter().map(|(n, _)| n.as_str()).filter(|n| !by_name.contains_key(*n)).collect();
    if let Some(first) = missing.first() {
        let shape = specs.iter().find(|(n, _)| n == first).map(|(_, s)| s.clone()).unwrap_or_default();
        return Err(ModelError::tensor(
            path,
            first,
            format!("missing: config.json needs it with shape {shape:?} ({} missing in all)", missing.len()),
        ));
    }
    for (name, shape) in &specs {
        let stored = &by_name[name];
        let info = file.info(stored).ok_or_else(|| ModelError::tensor(path, stored, "vanished from the header"))?;
        if &info.shape != shape {
            return Err(ModelError::tensor(path, stored, format!("shape {:?} in the file, but config.json needs {shape:?}", info.shape)));
        }
        let t = file.tensor(stored)?;
        let t = if t.dtype() == dtype { t } else { t.to_dtype(dtype) };
        store.set(name, t)?;
    }
    Ok(())
}

/// A weight store holding seeded random weights for `cfg` in `dtype`:
/// linear weights uniform with BERT's init scale (std 0.02), LayerNorm gains
/// near 1 and biases near 0, so activations stay in a realistic range.
pub fn random_weights(cfg: &BertConfig, seed: u64, dtype: DType) -> Result<Arc<WeightStore>> {
    let store = Arc::new(WeightStore::new());
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Uniform on [-a, a] has std a/sqrt(3).
    let a = 0.02f32 * 3f32.sqrt();
    for (name, shape) in bert_weight_specs(cfg) {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = if name.ends_with("LayerNorm.weight") {
            (0..n).map(|_| 1.0 + rng.random_range(-0.1..0.1)).collect()
        } else if name.ends_with(".bias") {
            (0..n).map(|_| rng.random_range(-0.02..0.02)).collect()
        } else {
            (0..n).map(|_| rng.random_range(-a..a)).collect()
        };
        store.set(&name, Tensor::from_f32(shape, &values)?.to_dtype(dtype))?;
    }
    Ok(store)
}
