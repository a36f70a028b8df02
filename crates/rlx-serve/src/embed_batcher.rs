//! Dynamic batching for embeddings. One thread owns the model work; HTTP
//! handlers hand it token ids through a bounded queue and await their rows.
//! A job that finds the thread idle runs at once (with whatever else is
//! already queued). Jobs that arrive while it is busy queue up; when a call
//! ends with jobs waiting, the next call takes them together, up to
//! `max_batch_rows` rows, waiting at most `max_wait` for more to arrive.
//! A call runs one embedder call per sequence bucket (rows of similar
//! length share a forward); each job gets its own rows back, in order.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rlx_models::SentenceEmbedder;
use tokio::sync::oneshot;

use crate::error::ApiError;
use crate::metrics::{Metrics, Queue};

type Rows = Vec<Vec<f32>>;

struct Job {
    ids: Vec<Vec<u32>>,
    reply: oneshot::Sender<Result<Rows, ApiError>>,
    /// When the handler queued it: a job queued before the last call ended
    /// arrived while the model was busy.
    queued: Instant,
}

/// The handlers' side of the queue.
pub struct EmbedBatcher {
    tx: SyncSender<Job>,
    max_queue: usize,
    metrics: Arc<Metrics>,
}

pub struct BatchLimits {
    pub max_rows: usize,
    pub max_wait: Duration,
    pub max_queue: usize,
}

impl EmbedBatcher {
    /// Starts the model thread; it ends when every `EmbedBatcher` clone is
    /// dropped and the queue is empty.
    pub fn start(
        embedder: Arc<SentenceEmbedder>,
        limits: BatchLimits,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<(EmbedBatcher, JoinHandle<()>)> {
        let (tx, rx) = sync_channel(limits.max_queue);
        let m = metrics.clone();
        let (max_rows, max_wait) = (limits.max_rows, limits.max_wait);
        let handle = std::thread::Builder::new().name("rlx-embed".into()).spawn(move || run(rx, &embedder, max_rows, max_wait, &m))?;
        Ok((EmbedBatcher { tx, max_queue: limits.max_queue, metrics }, handle))
    }

    /// The vectors of `ids` (already checked against the model), in order.
    pub async fn embed(&self, ids: Vec<Vec<u32>>) -> Result<Rows, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.metrics.enqueued(Queue::Embeddings);
        match self.tx.try_send(Job { ids, reply, queued: Instant::now() }) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.metrics.dequeued(Queue::Embeddings);
                return Err(ApiError::overloaded("embeddings", self.max_queue));
            }
            Err(TrySendError::Disconnected(_)) => {
                self.metrics.dequeued(Queue::Embeddings);
                return Err(ApiError::unavailable("the embedding worker has stopped"));
            }
        }
        rx.await.unwrap_or_else(|_| Err(ApiError::internal("the embedding worker dropped the request")))
    }
}

/// The model thread: takes a call's worth of jobs, runs them, repeats.
fn run(rx: Receiver<Job>, embedder: &SentenceEmbedder, max_rows: usize, max_wait: Duration, metrics: &Metrics) {
    let mut carry: Option<Job> = None;
    // When the last call ended.
    let mut last_end: Option<Instant> = None;
    loop {
        let first = match carry.take() {
            Some(j) => j,
            None => match rx.try_recv() {
                Ok(j) => {
                    metrics.dequeued(Queue::Embeddings);
                    j
                }
                Err(TryRecvError::Empty) => match rx.recv() {
                    Ok(j) => {
                        metrics.dequeued(Queue::Embeddings);
                        j
                    }
                    Err(_) => return,
                },
                Err(TryRecvError::Disconnected) => return,
            },
        };
        // Busy: the job was queued while the last call ran (a job that came
        // after it, even if this thread has not looked yet, found the
        // model idle and runs at once).
        let busy = last_end.is_some_and(|e| first.queued <= e);
        let mut rows = first.ids.len();
        let mut jobs = vec![first];
        let deadline = Instant::now() + max_wait;
        while rows < max_rows {
            let next = if busy {
                let left = deadline.saturating_duration_since(Instant::now());
                rx.recv_timeout(left).ok()
            } else {
                rx.try_recv().ok()
            };
            let Some(j) = next else { break };
            metrics.dequeued(Queue::Embeddings);
            if rows + j.ids.len() > max_rows {
                carry = Some(j);
                break;
            }
            rows += j.ids.len();
            jobs.push(j);
        }
        run_call(embedder, jobs, metrics, &mut last_end);
    }
}

/// One coalesced call over every job's rows; each job gets its slice.
/// `ended` is set when the model work is done, before any reply goes out,
/// so a request a reply prompts is never taken for one that came while the
/// model was busy.
fn run_call(embedder: &SentenceEmbedder, jobs: Vec<Job>, metrics: &Metrics, ended: &mut Option<Instant>) {
    // A caller that has gone (timed out, disconnected) costs nothing.
    let jobs: Vec<Job> = jobs.into_iter().filter(|j| !j.reply.is_closed()).collect();
    if jobs.is_empty() {
        return;
    }
    let all: Vec<Vec<u32>> = jobs.iter().flat_map(|j| j.ids.iter().cloned()).collect();
    let (rows, tokens) = (all.len(), all.iter().map(Vec::len).sum());
    let result = match catch_unwind(AssertUnwindSafe(|| embed_by_bucket(embedder, all))) {
        Ok(r) => r,
        Err(_) => Err(ApiError::internal("the embedder panicked")),
    };
    *ended = Some(Instant::now());
    metrics.embed_batch(rows, tokens);
    match result {
        Ok(vectors) => {
            let mut vectors = vectors.into_iter();
            for j in jobs {
                let mine: Rows = vectors.by_ref().take(j.ids.len()).collect();
                let _ = j.reply.send(Ok(mine));
            }
        }
        Err(e) => {
            for j in jobs {
                let _ = j.reply.send(Err(e.clone()));
            }
        }
    }
}

/// The vectors of `rows`, in order, from one embedder call per sequence
/// bucket: rows of different buckets never share a forward, so a long text
/// does not pad a batch of short ones to its length.
fn embed_by_bucket(embedder: &SentenceEmbedder, rows: Vec<Vec<u32>>) -> Result<Rows, ApiError> {
    let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, r) in rows.iter().enumerate() {
        groups.entry(embedder.seq_bucket(r.len()).unwrap_or(usize::MAX)).or_default().push(i);
    }
    let mut rows: Vec<Option<Vec<u32>>> = rows.into_iter().map(Some).collect();
    let mut out: Vec<Vec<f32>> = vec![Vec::new(); rows.len()];
    for idx in groups.values() {
        let group: Vec<Vec<u32>> = idx.iter().filter_map(|&i| rows[i].take()).collect();
        let vectors = embedder.embed_ids(&group).map_err(|e| ApiError::from_model(&e))?;
        if vectors.len() != idx.len() {
            return Err(ApiError::internal(format!("the embedder returned {} vectors for {} texts", vectors.len(), idx.len())));
        }
        for (&i, v) in idx.iter().zip(vectors) {
            out[i] = v;
        }
    }
    Ok(out)
}
