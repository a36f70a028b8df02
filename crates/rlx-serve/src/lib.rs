//! `rlx serve`: an OpenAI-compatible HTTP server (axum + tokio) for RLX's
//! sentence embedders and LLaMA-family generators.
//!
//! The model work runs on dedicated threads, never on the tokio workers:
//! [`embed_batcher`] coalesces concurrent embedding requests into shared
//! embedder calls (dynamic batching), and [`decode_scheduler`] runs the
//! generator's batched decode, letting requests join and leave between
//! steps (continuous batching). The handlers in [`routes`] read requests,
//! queue them and shape the answers.
//!
//! ```no_run
//! # async fn run() -> Result<(), rlx_serve::ServeError> {
//! use rlx_serve::{ModelPaths, ServeOptions, Server};
//! let models = ModelPaths { embedding: Some("models/all-MiniLM-L6-v2".into()), generation: None };
//! let server = Server::load(&models, ServeOptions::default())?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! server.serve(listener, rlx_serve::shutdown_signal()).await
//! # }
//! ```

pub mod decode_scheduler;
pub mod embed_batcher;
mod error;
pub mod metrics;
mod options;
pub mod request;
mod router;
pub mod routes;
mod state;

use std::future::Future;
use std::sync::Arc;
use std::thread::JoinHandle;

use rlx_models::{EmbedderOptions, SentenceEmbedder};

pub use error::{ApiError, ServeError};
pub use options::{ModelPaths, ServeOptions, MIN_CTX_SIZE};
pub use state::model_id;

use decode_scheduler::DecodeScheduler;
use embed_batcher::{BatchLimits, EmbedBatcher};
use metrics::Metrics;
use state::{AppState, EmbeddingModel, GenerationModel};

/// Loaded models and their worker threads, ready to serve.
pub struct Server {
    state: Arc<AppState>,
    workers: Vec<JoinHandle<()>>,
}

impl Server {
    /// Loads the models (each on the thread that will run it) and starts
    /// the queues.
    pub fn load(models: &ModelPaths, options: ServeOptions) -> Result<Server, ServeError> {
        options.check().map_err(ServeError::Options)?;
        if models.embedding.is_none() && models.generation.is_none() {
            return Err(ServeError::Options("no model to serve: give an embedding model, a generation model or both".into()));
        }
        let metrics = Arc::new(Metrics::default());
        let mut workers = vec![];
        let embedding = match &models.embedding {
            Some(dir) => {
                let eo =
                    EmbedderOptions { dtype: options.embedding_dtype, batch_size: options.embedding_batch_size, approximate_gelu: false };
                let embedder = SentenceEmbedder::load_with(dir, options.device, eo)
                    .map_err(|e| ServeError::Load(format!("embedding model {}: {e}", dir.display())))?;
                let embedder = Arc::new(embedder);
                let limits = BatchLimits { max_rows: options.max_batch_rows, max_wait: options.max_wait, max_queue: options.max_queue };
                let (batcher, handle) = EmbedBatcher::start(embedder.clone(), limits, metrics.clone())?;
                workers.push(handle);
                Some(EmbeddingModel { id: model_id(dir), embedder, batcher })
            }
            None => None,
        };
        let generation = match &models.generation {
            Some(path) => {
                let go = decode_scheduler::generator_options(options.max_sequences, options.ctx_size, options.kv_dtype);
                let (scheduler, handle) = DecodeScheduler::start(path.clone(), options.device, go, options.max_queue, metrics.clone())?;
                workers.push(handle);
                Some(GenerationModel { id: model_id(path), scheduler })
            }
            None => None,
        };
        Ok(Server { state: Arc::new(AppState::new(options, metrics, embedding, generation)), workers })
    }

    /// The ids `/v1/models` lists.
    pub fn model_ids(&self) -> Vec<String> {
        self.state.model_ids()
    }

    /// Serves on `listener` until `shutdown` completes, then stops taking
    /// connections, lets the requests in flight finish, and stops the
    /// worker threads.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let router = router::build(self.state.clone());
        axum::serve(listener, router).with_graceful_shutdown(shutdown).await?;
        // The queues close when the last handle on the state goes; the
        // threads then finish what they hold and end.
        drop(self.state);
        let workers = self.workers;
        tokio::task::spawn_blocking(move || {
            for w in workers {
                let _ = w.join();
            }
        })
        .await
        .map_err(|e| ServeError::Io(std::io::Error::other(e.to_string())))
    }
}

/// What `rlx serve` runs: loads the models, binds `addr` (`host:port`),
/// calls `ready` with the bound address and the model ids, and serves until
/// SIGTERM or SIGINT; returns once the requests in flight have finished.
pub fn run_until_signal(
    models: &ModelPaths,
    options: ServeOptions,
    addr: &str,
    ready: impl FnOnce(std::net::SocketAddr, &[String]),
) -> Result<(), ServeError> {
    let server = Server::load(models, options)?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("rlx-http").build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| ServeError::Io(std::io::Error::new(e.kind(), format!("binding {addr}: {e}"))))?;
        let shutdown = shutdown_signal();
        ready(listener.local_addr()?, &server.model_ids());
        server.serve(listener, shutdown).await
    })
}

/// Completes on SIGTERM or SIGINT (Ctrl-C). The handlers are installed
/// when this is called (inside a tokio runtime), so a signal that arrives
/// before the server polls the future is not lost.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).ok();
        let mut int = signal(SignalKind::interrupt()).ok();
        async move {
            let wait = |s: &mut Option<tokio::signal::unix::Signal>| {
                let s = s.take();
                async move {
                    match s {
                        Some(mut s) => {
                            s.recv().await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                }
            };
            tokio::select! {
                _ = wait(&mut term) => {}
                _ = wait(&mut int) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await
        }
    }
}
