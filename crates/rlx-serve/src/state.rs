//! What every handler shares: the options, the metrics, and the loaded
//! models with the queues in front of them.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rlx_models::SentenceEmbedder;

use crate::decode_scheduler::DecodeScheduler;
use crate::embed_batcher::EmbedBatcher;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::options::ServeOptions;

pub struct EmbeddingModel {
    pub id: String,
    /// Shared with the batcher's thread; handlers use it to tokenize.
    pub embedder: Arc<SentenceEmbedder>,
    pub batcher: EmbedBatcher,
}

pub struct GenerationModel {
    pub id: String,
    pub scheduler: DecodeScheduler,
}

pub struct AppState {
    pub options: ServeOptions,
    pub metrics: Arc<Metrics>,
    pub embedding: Option<EmbeddingModel>,
    pub generation: Option<GenerationModel>,
    /// Unix seconds when the server started (`created` of `/v1/models`).
    pub started: u64,
    next_id: AtomicU64,
}

/// A model's id: a directory's name, a file's stem.
pub fn model_id(path: &Path) -> String {
    let name = if path.is_dir() { path.file_name() } else { path.file_stem() };
    name.map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string())
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Checks a request's `model` against the one loaded (absent: that one).
fn pick<'a, T>(loaded: Option<&'a T>, id: impl Fn(&T) -> &str, asked: Option<&str>, what: &str, flag: &str) -> Result<&'a T, ApiError> {
    let Some(m) = loaded else {
        return Err(ApiError::unknown_model(format!("this server has no {what} model (start rlx serve with {flag})")));
    };
    match asked {
        Some(a) if a != id(m) => {
            Err(ApiError::unknown_model(format!("the model '{a}' does not exist: this server's {what} model is '{}'", id(m))))
        }
        _ => Ok(m),
    }
}

impl AppState {
    pub fn new(
        options: ServeOptions,
        metrics: Arc<Metrics>,
        embedding: Option<EmbeddingModel>,
        generation: Option<GenerationModel>,
    ) -> Self {
        AppState { options, metrics, embedding, generation, started: unix_now(), next_id: AtomicU64::new(1) }
    }

    pub fn embedding_model(&self, asked: Option<&str>) -> Result<&EmbeddingModel, ApiError> {
        pick(self.embedding.as_ref(), |m| m.id.as_str(), asked, "embedding", "--embedding-model")
    }

    pub fn generation_model(&self, asked: Option<&str>) -> Result<&GenerationModel, ApiError> {
        pick(self.generation.as_ref(), |m| m.id.as_str(), asked, "generation", "--generation-model")
    }

    /// A response id: unique within this process, and across restarts by
    /// the start time.
    pub fn response_id(&self, prefix: &str) -> String {
        format!("{prefix}-{:x}{:06x}", self.started, self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// A seed for a request that gave none (OpenAI: not reproducible).
    pub fn fresh_seed(&self) -> u64 {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
        splitmix64(nanos ^ self.next_id.fetch_add(1, Ordering::Relaxed).rotate_left(32))
    }

    pub fn model_ids(&self) -> Vec<String> {
        self.embedding.iter().map(|m| m.id.clone()).chain(self.generation.iter().map(|m| m.id.clone())).collect()
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
