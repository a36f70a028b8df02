//! `rlx.Generator`: text generation and chat over [`rlx_models::Generator`],
//! as one string or as a stream of text pieces ([`PyTextStream`]).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use pyo3::exceptions::{PyFileNotFoundError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};
use rlx_models::model_dir::default_generation_model;
use rlx_models::{Generator, GeneratorOptions, Message, SamplingParams};

use crate::{check_exists, lookup_env, model_error, panic_error, parse_device, run_detached};

/// Text pieces a stream computes ahead of its reader.
const STREAM_AHEAD: usize = 4;

/// A LLaMA-family model (a GGUF file or a Hugging Face directory) loaded for
/// one device. Calls take turns; a streamed generation holds the model until
/// it is read to the end or closed.
#[pyclass(name = "Generator", module = "rlx", frozen)]
pub struct PyGenerator {
    inner: Arc<Mutex<Generator>>,
    /// Set while a [`PyTextStream`]'s thread holds the model.
    streaming: Arc<AtomicBool>,
    model: PathBuf,
}

/// What to generate from.
enum Prompt {
    Text(String),
    Chat(Vec<Message>),
}

fn lock(g: &Mutex<Generator>) -> PyResult<MutexGuard<'_, Generator>> {
    g.lock().map_err(|_| PyRuntimeError::new_err("generator poisoned by a panic in another thread"))
}

/// `stop` as Python gives it: None, one string or a list of strings.
fn stop_strings(stop: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    match stop {
        None => Ok(vec![]),
        Some(s) if s.is_none() => Ok(vec![]),
        Some(s) if s.is_instance_of::<PyString>() => Ok(vec![s.extract()?]),
        Some(s) => s.extract().map_err(|_| PyValueError::new_err("stop: expected None, a str or a list of str")),
    }
}

/// `messages` as OpenAI's API gives them: a list of dicts with "role" and
/// "content" strings.
/// Sampling settings from the keyword arguments every generation method takes.
#[allow(clippy::too_many_arguments)]
fn sampling(
    max_tokens: usize,
    temperature: f32,
    top_k: i32,
    top_p: f32,
    min_p: f32,
    repeat_penalty: f32,
    seed: u64,
    stop: Option<&Bound<'_, PyAny>>,
    ignore_eos: bool,
) -> PyResult<SamplingParams> {
    Ok(SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty,
        seed,
        max_tokens,
        stop: stop_strings(stop)?,
        ignore_eos,
        ..SamplingParams::default()
    })
}

fn messages(list: &Bound<'_, PyAny>) -> PyResult<Vec<Message>> {
    let items: Vec<Bound<'_, PyAny>> = list.extract().map_err(|_| PyValueError::new_err("messages: expected a list of dicts"))?;
    if items.is_empty() {
        return Err(PyValueError::new_err("messages: expected at least one message, found an empty list"));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let d = item
            .cast::<PyDict>()
            .map_err(|_| PyValueError::new_err(format!("messages[{i}]: expected a dict with 'role' and 'content'")))?;
        let field = |key: &str| -> PyResult<String> {
            let v = d.get_item(key)?.ok_or_else(|| PyValueError::new_err(format!("messages[{i}]: no '{key}'")))?;
            v.extract().map_err(|_| PyValueError::new_err(format!("messages[{i}]['{key}']: expected a str")))
        };
        out.push(Message::new(field("role")?, field("content")?));
    }
    Ok(out)
}

#[pymethods]
impl PyGenerator {
    /// Loads a GGUF file or a Hugging Face directory. Without `model`, the
    /// default one `rlx generate` finds (models/SmolLM2-135M-Instruct.Q4_1.gguf
    /// in a checkout around the current directory or the package, else in
    /// the data directory). `ctx_size` is the cache in tokens, prompt and
    /// reply together, per sequence; `batch` is how many sequences
    /// `generate_batch` and `chat_batch` decode side by side.
    #[new]
    #[pyo3(signature = (model=None, device="cpu", ctx_size=4096, batch=1))]
    fn new(py: Python<'_>, model: Option<PathBuf>, device: &str, ctx_size: usize, batch: usize) -> PyResult<Self> {
        let device = parse_device(device)?;
        if ctx_size == 0 {
            return Err(PyValueError::new_err("ctx_size must be at least 1, found 0"));
        }
        if batch == 0 {
            return Err(PyValueError::new_err("batch must be at least 1, found 0"));
        }
        let model = match model {
            Some(m) => {
                check_exists(&m, "model")?;
                m
            }
            None => default_generation_model(&lookup_env(py)).map_err(PyFileNotFoundError::new_err)?,
        };
        let path = model.clone();
        let opts = GeneratorOptions { ctx_size, batch, ..GeneratorOptions::default() };
        let g = run_detached(py, move || Generator::load_with(&path, device, opts).map_err(model_error))?;
        Ok(PyGenerator { inner: Arc::new(Mutex::new(g)), streaming: Arc::new(AtomicBool::new(false)), model })
    }

    /// Continues raw text `prompt` (no chat template). Returns the new text,
    /// or with `stream=True` an iterator of text pieces. `temperature=0` is
    /// greedy; the same `seed` gives the same text. Generation stops at the
    /// end-of-sequence token, a `stop` string (not returned), `max_tokens`
    /// or the context.
    #[pyo3(signature = (prompt, max_tokens=256, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                        repeat_penalty=1.0, seed=0, stop=None, ignore_eos=false, stream=false))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: String,
        max_tokens: usize,
        temperature: f32,
        top_k: i32,
        top_p: f32,
        min_p: f32,
        repeat_penalty: f32,
        seed: u64,
        stop: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        stream: bool,
    ) -> PyResult<Py<PyAny>> {
        let params = sampling(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed, stop, ignore_eos)?;
        self.start(py, Prompt::Text(prompt), params, stream)
    }

    /// A reply to `messages` (a list of {"role", "content"} dicts), formatted
    /// with the model's chat template; the same settings as `generate`.
    /// When the conversation does not fit the context, its oldest turns
    /// after the system message are dropped.
    #[pyo3(signature = (messages, max_tokens=256, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                        repeat_penalty=1.0, seed=0, stop=None, ignore_eos=false, stream=false))]
    #[allow(clippy::too_many_arguments)]
    fn chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        max_tokens: usize,
        temperature: f32,
        top_k: i32,
        top_p: f32,
        min_p: f32,
        repeat_penalty: f32,
        seed: u64,
        stop: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        stream: bool,
    ) -> PyResult<Py<PyAny>> {
        let messages = self::messages(messages)?;
        let params = sampling(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed, stop, ignore_eos)?;
        self.start(py, Prompt::Chat(messages), params, stream)
    }

    /// Continues every prompt of `prompts` (raw text, as `generate`) with the
    /// same settings, `batch` sequences side by side (the constructor's
    /// `batch`): a finished sequence's slot takes the next prompt. Returns
    /// the new texts in the prompts' order; greedy texts equal `generate`'s.
    #[pyo3(signature = (prompts, max_tokens=256, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                        repeat_penalty=1.0, seed=0, stop=None, ignore_eos=false))]
    #[allow(clippy::too_many_arguments)]
    fn generate_batch(
        &self,
        py: Python<'_>,
        prompts: Vec<String>,
        max_tokens: usize,
        temperature: f32,
        top_k: i32,
        top_p: f32,
        min_p: f32,
        repeat_penalty: f32,
        seed: u64,
        stop: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
    ) -> PyResult<Vec<String>> {
        let params = sampling(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed, stop, ignore_eos)?;
        self.run_batch(py, prompts.into_iter().map(Prompt::Text).collect(), params)
    }

    /// A reply to every conversation of `conversations` (each a list of
    /// {"role", "content"} dicts, as `chat`), `batch` side by side. A
    /// conversation that does not fit the context is an error (no turns are
    /// dropped).
    #[pyo3(signature = (conversations, max_tokens=256, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                        repeat_penalty=1.0, seed=0, stop=None, ignore_eos=false))]
    #[allow(clippy::too_many_arguments)]
    fn chat_batch(
        &self,
        py: Python<'_>,
        conversations: Vec<Bound<'_, PyAny>>,
        max_tokens: usize,
        temperature: f32,
        top_k: i32,
        top_p: f32,
        min_p: f32,
        repeat_penalty: f32,
        seed: u64,
        stop: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
    ) -> PyResult<Vec<String>> {
        let params = sampling(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed, stop, ignore_eos)?;
        let prompts = conversations
            .iter()
            .enumerate()
            .map(|(i, c)| {
                self::messages(c).map(Prompt::Chat).map_err(|e| PyValueError::new_err(format!("conversations[{i}]: {}", e.value(py))))
            })
            .collect::<PyResult<Vec<_>>>()?;
        self.run_batch(py, prompts, params)
    }

    /// The prompt's token ids as the model's tokenizer gives them.
    fn tokenize(&self, py: Python<'_>, text: String) -> PyResult<Vec<u32>> {
        self.check_idle()?;
        let inner = self.inner.clone();
        run_detached(py, move || lock(&inner)?.encode(&text).map_err(model_error))
    }

    /// Cache rows: prompt and reply together fit in this many tokens.
    #[getter]
    fn ctx_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.check_idle()?;
        let inner = self.inner.clone();
        run_detached(py, move || Ok(lock(&inner)?.ctx_size()))
    }

    /// The GGUF file or model directory.
    #[getter]
    fn model(&self) -> String {
        self.model.display().to_string()
    }

    fn __repr__(&self) -> String {
        format!("Generator(model='{}')", self.model.display())
    }
}

impl PyGenerator {
    fn run_batch(&self, py: Python<'_>, prompts: Vec<Prompt>, params: SamplingParams) -> PyResult<Vec<String>> {
        self.check_idle()?;
        let inner = self.inner.clone();
        run_detached(py, move || {
            let mut g = lock(&inner)?;
            let ids = prompts
                .iter()
                .map(|p| match p {
                    Prompt::Text(t) => g.encode(t),
                    Prompt::Chat(m) => g.encode_chat(m),
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(model_error)?;
            let all = vec![params; ids.len()];
            let out = g.generate_many(&ids, &all).map_err(model_error)?;
            Ok(out.into_iter().map(|o| o.text).collect())
        })
    }

    /// A streamed generation holds the model until it ends; a call meanwhile
    /// would wait for a reader that may be this very thread.
    fn check_idle(&self) -> PyResult<()> {
        if self.streaming.load(Ordering::Acquire) {
            return Err(PyRuntimeError::new_err(
                "a streamed generation is still running on this Generator: read it to the end or close() it first",
            ));
        }
        Ok(())
    }

    fn start(&self, py: Python<'_>, prompt: Prompt, params: SamplingParams, stream: bool) -> PyResult<Py<PyAny>> {
        self.check_idle()?;
        let inner = self.inner.clone();
        if !stream {
            let text = run_detached(py, move || {
                let mut g = lock(&inner)?;
                let mut generation = match &prompt {
                    Prompt::Text(p) => g.generate(p, &params),
                    Prompt::Chat(m) => g.chat(m, &params),
                }
                .map_err(model_error)?;
                generation.collect_text().map_err(model_error)
            })?;
            return Ok(PyString::new(py, &text).into_any().unbind());
        }
        if self.streaming.swap(true, Ordering::AcqRel) {
            return self.check_idle().map(|_| py.None());
        }
        let streaming = self.streaming.clone();
        let (tx, rx) = sync_channel::<PyResult<String>>(STREAM_AHEAD);
        // The generation borrows the model mutably for its whole life, so it
        // runs on a thread of its own and hands pieces over a bounded
        // channel; a reader that goes away ends it at the next piece.
        let spawned = std::thread::Builder::new().name("rlx-generate".into()).spawn(move || {
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut g = match lock(&inner) {
                    Ok(g) => g,
                    Err(e) => return tx.send(Err(e)).unwrap_or(()),
                };
                let generation = match &prompt {
                    Prompt::Text(p) => g.generate(p, &params),
                    Prompt::Chat(m) => g.chat(m, &params),
                };
                let generation = match generation {
                    Ok(x) => x,
                    Err(e) => return tx.send(Err(model_error(e))).unwrap_or(()),
                };
                for piece in generation {
                    let sent = match piece {
                        Ok(p) if p.text.is_empty() => Ok(()),
                        Ok(p) => tx.send(Ok(p.text)),
                        Err(e) => {
                            let _ = tx.send(Err(model_error(e)));
                            return;
                        }
                    };
                    if sent.is_err() {
                        return;
                    }
                }
            }));
            if let Err(p) = run {
                let _ = tx.send(Err(panic_error(p)));
            }
            streaming.store(false, Ordering::Release);
        });
        let thread = match spawned {
            Ok(t) => t,
            Err(e) => {
                self.streaming.store(false, Ordering::Release);
                return Err(PyRuntimeError::new_err(format!("cannot start the generation thread: {e}")));
            }
        };
        Ok(Py::new(py, PyTextStream::new(rx, thread))?.into_any())
    }
}

/// The text pieces of a streamed generation, as they become final.
/// `close()` (or dropping it) stops the generation.
#[pyclass(name = "TextStream", module = "rlx", frozen)]
pub struct PyTextStream {
    /// None once the generation ended or was closed.
    rx: Mutex<Option<Receiver<PyResult<String>>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl PyTextStream {
    fn new(rx: Receiver<PyResult<String>>, thread: JoinHandle<()>) -> Self {
        PyTextStream { rx: Mutex::new(Some(rx)), thread: Mutex::new(Some(thread)) }
    }

    /// Drops the receiver, which ends the generation at its next piece,
    /// and waits for its thread: the model is free afterwards. The thread
    /// never needs the GIL, so waiting for it while holding it is safe.
    fn stop(&self) {
        if let Ok(mut rx) = self.rx.lock() {
            *rx = None;
        }
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for PyTextStream {
    fn drop(&mut self) {
        self.stop();
    }
}

#[pymethods]
impl PyTextStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<String>> {
        // The receiver is taken out while waiting, so a second thread
        // reading the same stream meanwhile sees it ended rather than
        // blocking with the lock held.
        let taken = self.rx.lock().map_err(|_| PyRuntimeError::new_err("stream poisoned by a panic"))?.take();
        let Some(rx) = taken else { return Ok(None) };
        let (rx, got) = py.detach(move || {
            let got = rx.recv();
            (rx, got)
        });
        match got {
            Ok(Ok(text)) => {
                if let Ok(mut slot) = self.rx.lock() {
                    *slot = Some(rx);
                }
                Ok(Some(text))
            }
            Ok(Err(e)) => {
                drop(rx);
                py.detach(|| self.stop());
                Err(e)
            }
            // The generation ended: every piece was handed out.
            Err(_) => {
                drop(rx);
                py.detach(|| self.stop());
                Ok(None)
            }
        }
    }

    /// Stops the generation and waits until the model is free again (its
    /// steps in flight have finished).
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.stop());
    }
}
