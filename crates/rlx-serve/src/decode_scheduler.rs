//! Continuous batching for generation. One thread owns the [`Generator`]
//! (loaded on that thread) and loops: drop sequences whose client has gone,
//! admit the queued requests into free slots (`add_sequences` prefills them,
//! side by side when enough arrive together, and returns their first
//! tokens), run one batched decode step (`step_batch`),
//! send every sequence its token. A new request therefore joins the running
//! batch at the next token boundary, and a finished one leaves without
//! stopping the others.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use rlx::Device;
use rlx_models::{Generator, GeneratorOptions, Message, PromptEncoder, SamplingParams, StopReason};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::error::{ApiError, ServeError};
use crate::metrics::{Metrics, Queue};
use crate::options::PREFILL_BUCKETS;

/// What to continue.
#[derive(Debug)]
pub enum Prompt {
    /// Messages, through the model's chat template.
    Chat(Vec<Message>),
    /// Raw text (BOS added where the model asks for it).
    Text(String),
    /// Token ids as given.
    Ids(Vec<u32>),
}

pub struct GenRequest {
    /// The prompt's token ids ([`encode_prompt`]).
    pub ids: Vec<u32>,
    /// `max_tokens` is set from [`max_tokens`](Self::max_tokens) at admission.
    pub params: SamplingParams,
    /// `None`: up to the room the context leaves.
    pub max_tokens: Option<usize>,
    /// When the request arrived (for the time-to-first-token metric).
    pub arrived: Instant,
}

/// Why a sequence ended, as OpenAI's `finish_reason` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What a request hears back, in this order: `Started` (or `Failed`), one
/// `Token` per new token, `Finished` (or `Failed`).
#[derive(Debug)]
pub enum GenEvent {
    Started {
        prompt_tokens: usize,
        /// Prompt tokens whose keys and values were already in the slot's
        /// cache (a prefix shared with the slot's previous sequence).
        cached_tokens: usize,
    },
    /// The text that became final with this token (may be empty).
    Token(String),
    Finished {
        finish: Finish,
        completion_tokens: usize,
    },
    Failed(ApiError),
}

/// Facts about the loaded model that the handlers need.
#[derive(Debug, Clone)]
pub struct GenInfo {
    pub ctx_size: usize,
    /// The model's tokenizer and chat template: handlers tokenize prompts
    /// on their own threads, so a burst of requests is tokenized in
    /// parallel rather than one after another on the generation thread.
    pub encoder: PromptEncoder,
}

/// A request's prompt as token ids; an error a client can act on when the
/// model has no chat template or the prompt has no tokens.
pub fn encode_prompt(encoder: &PromptEncoder, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    let ids = match prompt {
        Prompt::Chat(m) => {
            if !encoder.has_chat_template() {
                return Err(ApiError::invalid("this model has no chat template: use /v1/completions with a raw prompt"));
            }
            encoder.encode_chat(m).map_err(|e| ApiError::from_model(&e))?
        }
        Prompt::Text(t) => encoder.encode(t).map_err(|e| ApiError::from_model(&e))?,
        Prompt::Ids(ids) => ids.clone(),
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("the prompt is empty (no tokens)"));
    }
    Ok(ids)
}

/// The handlers' side of the queue.
pub struct DecodeScheduler {
    tx: SyncSender<(GenRequest, UnboundedSender<GenEvent>)>,
    max_queue: usize,
    metrics: Arc<Metrics>,
    pub info: GenInfo,
}

impl DecodeScheduler {
    /// Loads the model on its own thread and starts the loop; returns once
    /// the model is ready (or failed to load).
    pub fn start(
        path: PathBuf,
        device: Device,
        options: GeneratorOptions,
        max_queue: usize,
        metrics: Arc<Metrics>,
    ) -> Result<(DecodeScheduler, JoinHandle<()>), ServeError> {
        let (tx, rx) = sync_channel(max_queue);
        let (ready_tx, ready_rx) = sync_channel(1);
        let m = metrics.clone();
        let slots = options.batch.max(1);
        let handle = std::thread::Builder::new().name("rlx-decode".into()).spawn(move || {
            let mut gen = match Generator::load_with(&path, device, options) {
                Ok(g) => g,
                Err(e) => {
                    let _ = ready_tx.send(Err(format!("generation model {}: {e}", path.display())));
                    return;
                }
            };
            // On a GPU each step executable is recorded as a device graph
            // (a few milliseconds each): record them all before taking
            // requests, so that the first prompts of many clients do not
            // queue behind compiles. On the CPU a compile costs about a
            // millisecond and stays lazy.
            if matches!(device, Device::Cuda(_)) {
                let t = Instant::now();
                match gen.prepare_steps() {
                    Ok(n) => eprintln!("rlx serve: recorded {n} generation step graphs in {:.1} s", t.elapsed().as_secs_f64()),
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("generation model {}: preparing its steps: {e}", path.display())));
                        return;
                    }
                }
            }
            let info = GenInfo { ctx_size: gen.ctx_size(), encoder: gen.prompt_encoder() };
            if ready_tx.send(Ok(info)).is_err() {
                return;
            }
            Loop { gen, rx, metrics: m, active: (0..slots).map(|_| None).collect() }.run();
        })?;
        let info = match ready_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => return Err(ServeError::Load(e)),
            Err(_) => return Err(ServeError::Load("the generation thread ended while loading the model".into())),
        };
        Ok((DecodeScheduler { tx, max_queue, metrics, info }, handle))
    }

    /// Queues a request; its events arrive on the returned receiver.
    /// Dropping the receiver ends the sequence at the next step.
    pub fn submit(&self, req: GenRequest) -> Result<UnboundedReceiver<GenEvent>, ApiError> {
        let (etx, erx) = unbounded_channel();
        self.metrics.enqueued(Queue::Generation);
        match self.tx.try_send((req, etx)) {
            Ok(()) => Ok(erx),
            Err(e) => {
                self.metrics.dequeued(Queue::Generation);
                Err(match e {
                    TrySendError::Full(_) => ApiError::overloaded("generation", self.max_queue),
                    TrySendError::Disconnected(_) => ApiError::unavailable("the generation worker has stopped"),
                })
            }
        }
    }
}

/// A running sequence's client.
struct Active {
    events: UnboundedSender<GenEvent>,
    completion_tokens: usize,
}

struct Loop {
    gen: Generator,
    rx: Receiver<(GenRequest, UnboundedSender<GenEvent>)>,
    metrics: Arc<Metrics>,
    /// By slot.
    active: Vec<Option<Active>>,
}

fn finish_of(r: &StopReason) -> Finish {
    match r {
        StopReason::Eos | StopReason::StopString(_) => Finish::Stop,
        StopReason::MaxTokens | StopReason::ContextFull => Finish::Length,
    }
}

impl Loop {
    fn running(&self) -> usize {
        self.active.iter().filter(|a| a.is_some()).count()
    }

    fn run(mut self) {
        let mut open = true;
        loop {
            self.drop_gone();
            // Admit into free slots, all the requests waiting at once (so
            // that a burst is prefilled side by side); block only when
            // nothing runs.
            let mut batch = Vec::new();
            while open && self.running() + batch.len() < self.active.len() {
                let next = if self.running() == 0 && batch.is_empty() {
                    self.rx.recv().ok()
                } else {
                    match self.rx.try_recv() {
                        Ok(r) => Some(r),
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => None,
                    }
                };
                let Some((req, events)) = next else {
                    open = false;
                    break;
                };
                self.metrics.dequeued(Queue::Generation);
                if !events.is_closed() {
                    batch.push((req, events));
                }
            }
            self.admit(batch);
            if self.running() == 0 {
                if open {
                    continue;
                }
                return;
            }
            self.step();
        }
    }

    /// Frees the slots of clients that went away (disconnected, timed out).
    fn drop_gone(&mut self) {
        for slot in 0..self.active.len() {
            if self.active[slot].as_ref().is_some_and(|a| a.events.is_closed()) {
                self.gen.remove_sequence(slot);
                self.active[slot] = None;
            }
        }
    }

    /// The request's token budget; `None` fills the room the context leaves.
    fn budget(&self, prompt_len: usize, asked: Option<usize>) -> Result<usize, ApiError> {
        let usable = self.gen.ctx_size();
        let room = usable.saturating_sub(prompt_len);
        if room == 0 {
            return Err(ApiError::invalid(format!("the prompt has {prompt_len} tokens; a request may use {usable} (--ctx-size)")));
        }
        match asked {
            None => Ok(room),
            Some(n) if n <= room => Ok(n),
            Some(n) => Err(ApiError::invalid_param(
                "max_tokens",
                format!(
                    "the prompt's {prompt_len} tokens and max_tokens {n} exceed the {usable} tokens a request may use \
                     (--ctx-size); ask for at most {room}"
                ),
            )),
        }
    }

    /// Prefills the requests into free slots (side by side where the
    /// generator finds that worth it) and sends each its first token. Their
    /// prompts arrive tokenized.
    fn admit(&mut self, batch: Vec<(GenRequest, UnboundedSender<GenEvent>)>) {
        let t0 = Instant::now();
        let (mut prompts, mut waiting) = (Vec::new(), Vec::new());
        for (req, events) in batch {
            let ids = req.ids;
            let prepared = self.budget(ids.len(), req.max_tokens).map(|max_tokens| (ids, SamplingParams { max_tokens, ..req.params }));
            match prepared {
                Ok(x) => {
                    prompts.push(x);
                    waiting.push((events, req.arrived));
                }
                Err(e) => {
                    let _ = events.send(GenEvent::Failed(e));
                }
            }
        }
        if prompts.is_empty() {
            return;
        }
        let firsts = match catch_unwind(AssertUnwindSafe(|| self.gen.add_sequences(&prompts))) {
            Ok(f) => f.into_iter().map(|r| r.map_err(|e| ApiError::from_model(&e))).collect(),
            Err(_) => prompts.iter().map(|_| Err(ApiError::internal("the generator panicked while prefilling"))).collect::<Vec<_>>(),
        };
        self.metrics.prefill(prompts.len(), t0.elapsed());
        for (((ids, _), (events, arrived)), first) in prompts.into_iter().zip(waiting).zip(firsts) {
            let first = match first {
                Ok(ev) => ev,
                Err(e) => {
                    let _ = events.send(GenEvent::Failed(e));
                    continue;
                }
            };
            self.metrics.prompt(ids.len() - first.cached_tokens.min(ids.len()));
            self.metrics.first_token(arrived.elapsed());
            self.metrics.generated(1, None);
            if self.active.len() <= first.slot {
                self.active.resize_with(first.slot + 1, || None);
            }
            let _ = events.send(GenEvent::Started { prompt_tokens: ids.len(), cached_tokens: first.cached_tokens });
            let _ = events.send(GenEvent::Token(first.piece.text));
            match first.finished {
                Some(r) => {
                    let _ = events.send(GenEvent::Finished { finish: finish_of(&r), completion_tokens: 1 });
                }
                None => self.active[first.slot] = Some(Active { events, completion_tokens: 1 }),
            }
        }
    }

    fn step(&mut self) {
        let rows = self.running();
        let events = match catch_unwind(AssertUnwindSafe(|| self.gen.step_batch())) {
            Ok(Ok(ev)) => ev,
            failed => {
                let e = match failed {
                    Ok(Err(e)) => ApiError::internal(format!("decode step: {e}")),
                    _ => ApiError::internal("the generator panicked in a decode step"),
                };
                for slot in 0..self.active.len() {
                    if let Some(a) = self.active[slot].take() {
                        self.gen.remove_sequence(slot);
                        let _ = a.events.send(GenEvent::Failed(e.clone()));
                    }
                }
                return;
            }
        };
        self.metrics.generated(events.len(), Some(rows));
        for ev in events {
            let Some(a) = self.active.get_mut(ev.slot).and_then(Option::as_mut) else { continue };
            a.completion_tokens += 1;
            let sent = a.events.send(GenEvent::Token(ev.piece.text)).is_ok();
            if let Some(r) = ev.finished {
                let _ = a.events.send(GenEvent::Finished { finish: finish_of(&r), completion_tokens: a.completion_tokens });
                self.active[ev.slot] = None;
            } else if !sent {
                self.gen.remove_sequence(ev.slot);
                self.active[ev.slot] = None;
            }
        }
    }
}

/// The generator options the server runs with.
pub fn generator_options(max_sequences: usize, ctx_size: usize, kv_dtype: Option<rlx::DType>) -> GeneratorOptions {
    GeneratorOptions { ctx_size, batch: max_sequences, prefill_buckets: PREFILL_BUCKETS.to_vec(), kv_dtype, ..GeneratorOptions::default() }
}
