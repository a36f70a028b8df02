//! Every setting of the server and its default, in one place: `rlx serve`'s
//! flags take their defaults from [`ServeOptions::DEFAULT`], and README's
//! "Serving" table lists the same values.

use std::path::PathBuf;
use std::time::Duration;

use rlx::{DType, Device};

/// The model files to serve; at least one must be given.
#[derive(Debug, Clone, Default)]
pub struct ModelPaths {
    /// A sentence-transformers BERT directory, for `/v1/embeddings` and `/v1/rerank`.
    pub embedding: Option<PathBuf>,
    /// A GGUF file or Hugging Face LLaMA-family directory, for
    /// `/v1/chat/completions` and `/v1/completions`.
    pub generation: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where both models run.
    pub device: Device,
    /// Storage dtype of the embedding model (f32, f16, bf16).
    pub embedding_dtype: DType,
    /// Texts per forward pass of the embedding model (its largest batch bucket).
    pub embedding_batch_size: usize,
    /// Rows (texts) one coalesced embedding call takes at most.
    pub max_batch_rows: usize,
    /// How long a coalesced embedding call waits for more requests when the
    /// previous call left some queued.
    pub max_wait: Duration,
    /// Requests waiting per queue (embeddings, generation); more get 503.
    pub max_queue: usize,
    /// Sequences decoded side by side (the generator's batch).
    pub max_sequences: usize,
    /// Cache rows per sequence (prompt and reply), at most the model's context.
    pub ctx_size: usize,
    /// The KV cache's dtype; None: the device's default (f16 on a GPU, f32
    /// on the CPU).
    pub kv_dtype: Option<DType>,
    /// Bearer key every `/v1/` request must carry (none: no check).
    pub api_key: Option<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Most inputs (texts or documents) in one request.
    pub max_inputs: usize,
    /// Longest a request may take, queueing included.
    pub request_timeout: Duration,
}

impl ServeOptions {
    pub const DEFAULT: ServeOptions = ServeOptions {
        device: Device::Cpu,
        embedding_dtype: DType::F32,
        embedding_batch_size: 32,
        max_batch_rows: 128,
        max_wait: Duration::from_millis(2),
        max_queue: 512,
        max_sequences: 8,
        ctx_size: 2048,
        kv_dtype: None,
        api_key: None,
        max_body_bytes: 8 << 20,
        max_inputs: 2048,
        request_timeout: Duration::from_secs(60),
    };

    pub(crate) fn check(&self) -> Result<(), String> {
        let at_least_one = [
            ("embedding batch size", self.embedding_batch_size),
            ("max batch rows", self.max_batch_rows),
            ("max queue", self.max_queue),
            ("max sequences", self.max_sequences),
            ("max body bytes", self.max_body_bytes),
            ("max inputs", self.max_inputs),
        ];
        for (name, v) in at_least_one {
            if v == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if self.max_sequences > MAX_SEQUENCES {
            return Err(format!("max sequences {} is over the generator's limit of {MAX_SEQUENCES}", self.max_sequences));
        }
        if self.ctx_size < MIN_CTX_SIZE {
            return Err(format!("ctx size {} is too small: at least {MIN_CTX_SIZE}", self.ctx_size));
        }
        if self.request_timeout.is_zero() {
            return Err("the request timeout must be positive".into());
        }
        if self.api_key.as_deref() == Some("") {
            return Err("the API key is empty".into());
        }
        Ok(())
    }
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions::DEFAULT
    }
}

/// Most sequences the generator decodes side by side.
pub const MAX_SEQUENCES: usize = 4096;

/// Prompt-length buckets the generator compiles for prefill.
pub(crate) const PREFILL_BUCKETS: [usize; 5] = [16, 32, 64, 128, 256];

/// Smallest `ctx_size`: two chunks of the largest prefill bucket.
pub const MIN_CTX_SIZE: usize = 2 * PREFILL_BUCKETS[PREFILL_BUCKETS.len() - 1];
