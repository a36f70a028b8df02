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
    check_config_against_file(path, cfg, &file, &by_name)?;
    let specs = bert_weight_specs(cfg);
    let wanted: BTreeSet<&str> = specs.iter().map(|(n, _)| n.as_str()).collect();
    // With type_vocab_size 0 an empty token-type table may still be stored.
    let empty_type_table =
        |c: &str| c == TOKEN_TYPE_TABLE && cfg.type_vocab_size == 0 && file.info(&by_name[c]).is_some_and(|i| i.shape.first() == Some(&0));
    let extra: Vec<&str> = by_name
        .iter()
        .filter(|(c, _)| !wanted.contains(c.as_str()) && !ignorable(c) && !empty_type_table(c))
        .map(|(_, s)| s.as_str())
        .collect();
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
        check_finite(path, stored, &t)?;
        let t = if t.dtype() == dtype { t } else { t.to_dtype(dtype) };
        store.set(name, t)?;
    }
    Ok(())
}

const TOKEN_TYPE_TABLE: &str = "embeddings.token_type_embeddings.weight";

/// The config's sizes against what the file holds, before the list of
/// expected tensors is built: a config that lies (a billion layers, a zero
/// type vocabulary beside a stored table) gets a message about the config
/// rather than about one tensor among thousands.
fn check_config_against_file(path: &Path, cfg: &BertConfig, file: &SafetensorsFile, by_name: &BTreeMap<String, String>) -> Result<()> {
    let layers_in_file = by_name
        .keys()
        .filter_map(|c| c.strip_prefix("encoder.layer.")?.split('.').next()?.parse::<usize>().ok())
        .max()
        .map_or(0, |l| l + 1);
    // More layers in the file than in the config: the unexpected-tensor
    // report below names them.
    if cfg.num_hidden_layers > layers_in_file {
        return Err(ModelError::format(
            path,
            format!(
                "config.json says num_hidden_layers {}, but the file holds {layers_in_file} encoder layer(s) (encoder.layer.0 to .{}): the config and the weights belong to different models",
                cfg.num_hidden_layers,
                layers_in_file.saturating_sub(1)
            ),
        ));
    }
    if let Some(info) = by_name.get("embeddings.word_embeddings.weight").and_then(|s| file.info(s)) {
        if info.shape != [cfg.vocab_size, cfg.hidden_size] {
            return Err(ModelError::format(
                path,
                format!(
                    "embeddings.word_embeddings.weight has shape {:?}, but config.json's vocab_size {} and hidden_size {} need [{}, {}]",
                    info.shape, cfg.vocab_size, cfg.hidden_size, cfg.vocab_size, cfg.hidden_size
                ),
            ));
        }
    }
    if cfg.type_vocab_size == 0 {
        if let Some(info) = by_name.get(TOKEN_TYPE_TABLE).and_then(|s| file.info(s)) {
            if info.shape.first().is_some_and(|&n| n > 0) {
                return Err(ModelError::format(
                    path,
                    format!(
                        "config.json says type_vocab_size 0, but the file holds {TOKEN_TYPE_TABLE} with shape {:?}: set type_vocab_size to {} in config.json",
                        info.shape, info.shape[0]
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A NaN or infinite weight makes every output NaN; refuse it at load time
/// with its place rather than write `null` vectors later.
fn check_finite(path: &Path, name: &str, t: &Tensor) -> Result<()> {
    // Straight from the stored bits: no converted copy of a large table.
    let bytes = t.bytes();
    let not_finite: Box<dyn Iterator<Item = bool>> = match t.dtype() {
        DType::F32 => Box::new(bytes.chunks_exact(4).map(|c| !f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite())),
        // An all-ones exponent is an infinity or a NaN.
        DType::F16 => Box::new(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7c00 == 0x7c00)),
        DType::BF16 => Box::new(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80)),
        _ => return Ok(()),
    };
    let (mut bad, mut first, mut total) = (0usize, None, 0usize);
    for (i, b) in not_finite.enumerate() {
        total += 1;
        if b {
            bad += 1;
            first.get_or_insert(i);
        }
    }
    if let Some(first) = first {
        return Err(ModelError::tensor(
            path,
            name,
            format!("{bad} of {total} values are NaN or infinite (the first at flat index {first}): the file is corrupt"),
        ));
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
