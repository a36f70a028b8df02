//! `rlx serve`: the OpenAI-compatible HTTP server of crate `rlx-serve`,
//! with its options as flags (defaults from `ServeOptions::DEFAULT`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use rlx::{DType, Device};
use rlx_serve::{ModelPaths, ServeOptions};

use crate::model_dir::{default_model_dir, Env};

const D: ServeOptions = ServeOptions::DEFAULT;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Sentence-embedding model directory, for /v1/embeddings and /v1/rerank.
    /// With neither model flag, both default models are served (the ones
    /// `rlx embed` and `rlx generate` use; a missing one is left out).
    #[arg(long, value_name = "DIR")]
    pub embedding_model: Option<PathBuf>,
    /// Generation model (GGUF file or Hugging Face directory), for
    /// /v1/chat/completions and /v1/completions.
    #[arg(long, value_name = "FILE|DIR")]
    pub generation_model: Option<PathBuf>,
    /// cpu, cuda or cuda:N (both models).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Address to listen on (the default only answers this machine).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Storage dtype of the embedding model: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub embedding_dtype: String,
    /// Texts per forward pass of the embedding model.
    #[arg(long, default_value_t = D.embedding_batch_size)]
    pub embedding_batch_size: usize,
    /// Texts one coalesced embedding call takes at most.
    #[arg(long, default_value_t = D.max_batch_rows)]
    pub max_batch_rows: usize,
    /// Milliseconds a coalesced embedding call waits for more requests
    /// when the previous call left some queued (an idle server runs a
    /// request at once).
    #[arg(long, default_value_t = D.max_wait.as_millis() as u64)]
    pub max_wait_ms: u64,
    /// Requests waiting per queue (embeddings, generation); more get 503
    /// with Retry-After.
    #[arg(long, default_value_t = D.max_queue)]
    pub max_queue: usize,
    /// Sequences decoded side by side (continuous batching).
    #[arg(long, default_value_t = D.max_sequences)]
    pub max_sequences: usize,
    /// Cache rows per sequence (prompt and reply together).
    #[arg(long, default_value_t = D.ctx_size)]
    pub ctx_size: usize,
    /// KV cache dtype: auto (f16 on a GPU, f32 on the CPU), f32, f16 or bf16.
    #[arg(long, default_value = "auto")]
    pub kv_dtype: String,
    /// Require `Authorization: Bearer KEY` on /v1/ routes.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Largest request body in bytes (larger: 413).
    #[arg(long, default_value_t = D.max_body_bytes)]
    pub max_body_bytes: usize,
    /// Most inputs (texts, documents) per request (more: 400).
    #[arg(long, default_value_t = D.max_inputs)]
    pub max_inputs: usize,
    /// Seconds a request may take, queueing included (longer: 504).
    #[arg(long, default_value_t = D.request_timeout.as_secs())]
    pub timeout_s: u64,
}

/// The models to serve: those named, else both defaults (at least one).
fn models(a: &ServeArgs) -> Result<ModelPaths, String> {
    if a.embedding_model.is_some() || a.generation_model.is_some() {
        for p in a.embedding_model.iter().chain(&a.generation_model) {
            if !p.exists() {
                return Err(format!("{}: no such file or directory", p.display()));
            }
        }
        return Ok(ModelPaths { embedding: a.embedding_model.clone(), generation: a.generation_model.clone() });
    }
    let embedding = default_model_dir(&Env::process());
    let generation = crate::generate::default_model();
    match (embedding, generation) {
        (Err(e), Err(g)) => Err(format!("no model to serve: {e}; and {g}")),
        (e, g) => {
            if let Err(m) = &e {
                eprintln!("note: serving no embedding model: {m}");
            }
            if let Err(m) = &g {
                eprintln!("note: serving no generation model: {m}");
            }
            Ok(ModelPaths { embedding: e.ok(), generation: g.ok() })
        }
    }
}

pub fn run(a: ServeArgs) -> Result<(), String> {
    let device: Device = a.device.parse().map_err(|e: rlx::Error| e.to_string())?;
    let embedding_dtype = match DType::parse(&a.embedding_dtype) {
        Some(d) if d.is_float() => d,
        _ => return Err(format!("--embedding-dtype '{}': expected f32, f16 or bf16", a.embedding_dtype)),
    };
    let models = models(&a)?;
    let options = ServeOptions {
        device,
        embedding_dtype,
        embedding_batch_size: a.embedding_batch_size,
        max_batch_rows: a.max_batch_rows,
        max_wait: Duration::from_millis(a.max_wait_ms),
        max_queue: a.max_queue,
        max_sequences: a.max_sequences,
        ctx_size: a.ctx_size,
        kv_dtype: crate::generate::parse_kv_dtype(&a.kv_dtype)?,
        api_key: a.api_key.clone(),
        max_body_bytes: a.max_body_bytes,
        max_inputs: a.max_inputs,
        request_timeout: Duration::from_secs(a.timeout_s),
    };
    let addr = format!("{}:{}", a.host, a.port);
    rlx_serve::run_until_signal(&models, options, &addr, |bound, ids| {
        eprintln!("rlx serve: listening on http://{bound} (models: {}; device {device})", ids.join(", "));
    })
    .map_err(|e| e.to_string())?;
    eprintln!("rlx serve: stopped");
    Ok(())
}
