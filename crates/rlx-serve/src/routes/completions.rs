//! `POST /v1/chat/completions` and `POST /v1/completions`: a request is
//! read into a prompt and sampling settings, queued on the decode
//! scheduler, and answered whole or streamed as Server-Sent Events in
//! OpenAI's chunk format, ending with `data: [DONE]`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use rlx_models::{Message, SamplingParams};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::{Instant, Sleep};

use crate::decode_scheduler::{encode_prompt, Finish, GenEvent, GenRequest, Prompt};
use crate::error::ApiError;
use crate::request::{self, kind, token_ids, Fields};
use crate::state::{unix_now, AppState};

/// Which of the two APIs a request came through (they differ only in the
/// prompt and the shape of a choice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
}

/// Most stop strings in one request.
const MAX_STOPS: usize = 16;

fn messages(v: &Value) -> Result<Vec<Message>, ApiError> {
    let bad = |m: String| ApiError::invalid_param("messages", m);
    let Value::Array(items) = v else { return Err(bad(format!("'messages' must be a list, found {}", kind(v)))) };
    if items.is_empty() {
        return Err(bad("'messages' is an empty list".into()));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.get("role") {
                Some(Value::String(r)) => r.clone(),
                Some(other) => return Err(bad(format!("'messages[{i}].role' must be a string, found {}", kind(other)))),
                None => return Err(bad(format!("'messages[{i}]' has no 'role'"))),
            };
            let content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                // Content parts: only text parts can be read by a text model.
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            (t, _) => {
                                return Err(bad(format!(
                                "'messages[{i}].content[{j}]': only {{\"type\": \"text\", \"text\": …}} parts are supported, found type {}",
                                t.unwrap_or("(none)")
                            )))
                            }
                        }
                    }
                    text
                }
                Some(other) => {
                    return Err(bad(format!("'messages[{i}].content' must be a string or a list of parts, found {}", kind(other))))
                }
            };
            Ok(Message::new(role, content))
        })
        .collect()
}

/// `prompt` of `/v1/completions`: a string or token ids, or a list holding
/// one of them.
fn completion_prompt(v: &Value) -> Result<Prompt, ApiError> {
    let bad = |m: String| ApiError::invalid_param("prompt", m);
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) => {
            if let Some(ids) = token_ids(v, "prompt")? {
                return Ok(Prompt::Ids(ids));
            }
            match items.as_slice() {
                [one] if !one.is_array() || token_ids(one, "prompt[0]")?.is_some() => completion_prompt(one),
                [] => Err(bad("'prompt' is an empty list".into())),
                [_] => Err(bad(format!("'prompt[0]' must be a string or token ids, found {}", kind(&items[0])))),
                _ => Err(bad(format!("{} prompts in one request: this server takes one per request", items.len()))),
            }
        }
        other => Err(bad(format!("'prompt' must be a string or a list of token ids, found {}", kind(other)))),
    }
}

fn stops(f: &Fields) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::invalid_param("stop", m);
    let list = match f.get("stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(|| bad(format!("'stop' items must be strings, found {}", kind(s)))))
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(bad(format!("'stop' must be a string or a list of strings, found {}", kind(other)))),
    };
    if list.len() > MAX_STOPS {
        return Err(bad(format!("{} stop strings; at most {MAX_STOPS}", list.len())));
    }
    if list.iter().any(String::is_empty) {
        return Err(bad("a stop string is empty".into()));
    }
    Ok(list)
}

/// Sampling settings: OpenAI's (temperature 1 and top_p 1 by default; 0 is
/// greedy) and llama-server's extras (top_k, min_p, repeat_penalty; off by
/// default). Fields this server cannot honour are refused, not ignored.
fn sampling(f: &Fields, api: Api) -> Result<(SamplingParams, Option<u64>, Option<usize>), ApiError> {
    f.refuse("tools", "this server does not call tools")?;
    f.refuse("functions", "this server does not call functions")?;
    f.refuse("logprobs", "log-probabilities are not returned")?;
    f.refuse("top_logprobs", "log-probabilities are not returned")?;
    f.refuse("echo", "the prompt is not echoed")?;
    f.refuse("suffix", "insertion is not supported")?;
    if f.u64_in("n", 1, u64::MAX)?.is_some_and(|n| n != 1) || f.u64_in("best_of", 1, u64::MAX)?.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid_param("n", "one choice per request: 'n' and 'best_of' must be 1"));
    }
    for key in ["presence_penalty", "frequency_penalty"] {
        if f.f32_in(key, -2.0, 2.0)?.is_some_and(|x| x != 0.0) {
            return Err(ApiError::invalid_param(key, format!("'{key}' is not supported; 'repeat_penalty' is")));
        }
    }
    if f.get("logit_bias").is_some_and(|v| v.as_object().is_none_or(|m| !m.is_empty())) {
        return Err(ApiError::invalid_param("logit_bias", "'logit_bias' is not supported"));
    }
    if let Some(t) = f.get("response_format").and_then(|r| r.get("type")).and_then(Value::as_str) {
        if t != "text" {
            return Err(ApiError::invalid_param("response_format", format!("response_format '{t}' is not supported (only 'text')")));
        }
    }
    let max_key = if api == Api::Chat && f.get("max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" };
    let max_tokens = f.u64_in(max_key, 1, u32::MAX as u64)?.map(|n| n as usize);
    let seed = match f.get("seed") {
        None => None,
        Some(Value::Number(n)) => Some(
            n.as_u64()
                .or_else(|| n.as_i64().map(|x| x as u64))
                .ok_or_else(|| ApiError::invalid_param("seed", format!("'seed' must be a whole number, found {n}")))?,
        ),
        Some(other) => return Err(ApiError::invalid_param("seed", format!("'seed' must be a whole number, found {}", kind(other)))),
    };
    let params = SamplingParams {
        temperature: f.f32_in("temperature", 0.0, 2.0)?.unwrap_or(1.0),
        top_p: f.f32_in("top_p", 0.0, 1.0)?.unwrap_or(1.0),
        top_k: f.u64_in("top_k", 0, i32::MAX as u64)?.unwrap_or(0) as i32,
        min_p: f.f32_in("min_p", 0.0, 1.0)?.unwrap_or(0.0),
        repeat_penalty: f.f32_in("repeat_penalty", 0.01, 100.0)?.unwrap_or(1.0),
        repeat_last_n: 64,
        seed: seed.unwrap_or(0),
        max_tokens: 1,
        stop: stops(f)?,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
    };
    Ok((params, seed, max_tokens))
}

/// A `/v1/chat/completions` or `/v1/completions` body as read, before the
/// model is consulted.
#[derive(Debug)]
pub struct GenerationRequest {
    pub api: Api,
    pub prompt: Prompt,
    /// `params.seed` holds `seed` when one was given.
    pub params: SamplingParams,
    /// `None`: the request gave no seed (the handler draws a fresh one).
    pub seed: Option<u64>,
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
}

impl GenerationRequest {
    /// Every field but `model` (checked by the handler first): `messages`
    /// for the chat API, `prompt` for completions, then the sampling and
    /// streaming settings.
    pub fn read(f: &Fields, api: Api) -> Result<GenerationRequest, ApiError> {
        let prompt = match api {
            Api::Chat => Prompt::Chat(messages(f.required("messages")?)?),
            Api::Completion => completion_prompt(f.required("prompt")?)?,
        };
        let (params, seed, max_tokens) = sampling(f, api)?;
        let stream = f.bool("stream")?.unwrap_or(false);
        let include_usage = f.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
        Ok(GenerationRequest { api, prompt, params, seed, max_tokens, stream, include_usage })
    }
}

/// How one response's chunks and body are written.
struct Shape {
    api: Api,
    id: String,
    created: u64,
    model: String,
}

impl Shape {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completion, _) => "text_completion",
        }
    }

    /// OpenAI's usage object; `prompt` is (prompt tokens, of them reused
    /// from the slot's cache).
    fn usage(prompt: (usize, usize), completion: usize) -> Value {
        json!({"prompt_tokens": prompt.0, "completion_tokens": completion, "total_tokens": prompt.0 + completion,
               "prompt_tokens_details": {"cached_tokens": prompt.1}})
    }

    fn whole(&self, text: String, finish: Finish, prompt: (usize, usize), completion: usize) -> Value {
        let choice = match self.api {
            Api::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish.as_str()})
            }
            Api::Completion => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str()}),
        };
        json!({"id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
               "choices": [choice], "usage": Self::usage(prompt, completion)})
    }

    /// A chunk with one choice: `delta` text (chat's first chunk also gives
    /// the role) and the finish reason once known.
    fn chunk(&self, text: Option<&str>, first: bool, finish: Option<Finish>) -> Value {
        let choice = match self.api {
            Api::Chat => {
                let mut delta = json!({});
                if first {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = text {
                    delta["content"] = json!(t);
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish.map(Finish::as_str)})
            }
            Api::Completion => {
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish.map(Finish::as_str)})
            }
        };
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model, "choices": [choice]})
    }

    fn usage_chunk(&self, prompt: (usize, usize), completion: usize) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
               "choices": [], "usage": Self::usage(prompt, completion)})
    }
}

fn data(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// The SSE body: scheduler events in, chunks out. Dropping it (the client
/// went away) drops the receiver, which frees the sequence's slot.
struct ChunkStream {
    events: UnboundedReceiver<GenEvent>,
    shape: Shape,
    deadline: Pin<Box<Sleep>>,
    limit: Duration,
    /// Prompt tokens, and of them those reused from the cache.
    prompt_tokens: (usize, usize),
    include_usage: bool,
    out: VecDeque<Event>,
    done: bool,
}

impl ChunkStream {
    fn end_with_error(&mut self, e: ApiError) {
        self.out.push_back(data(&e.body()));
        self.out.push_back(Event::default().data("[DONE]"));
        self.done = true;
    }

    fn on_event(&mut self, ev: Option<GenEvent>) {
        match ev {
            Some(GenEvent::Token(t)) if !t.is_empty() => self.out.push_back(data(&self.shape.chunk(Some(&t), false, None))),
            Some(GenEvent::Token(_) | GenEvent::Started { .. }) => {}
            Some(GenEvent::Finished { finish, completion_tokens }) => {
                self.out.push_back(data(&self.shape.chunk(None, false, Some(finish))));
                if self.include_usage {
                    self.out.push_back(data(&self.shape.usage_chunk(self.prompt_tokens, completion_tokens)));
                }
                self.out.push_back(Event::default().data("[DONE]"));
                self.done = true;
            }
            Some(GenEvent::Failed(e)) => self.end_with_error(e),
            None => self.end_with_error(ApiError::internal("the generation worker stopped")),
        }
    }
}

impl futures_core::Stream for ChunkStream {
    type Item = Result<Event, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(e) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(e)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            if this.deadline.as_mut().poll(cx).is_ready() {
                this.end_with_error(ApiError::timeout(this.limit));
                continue;
            }
            match this.events.poll_recv(cx) {
                Poll::Ready(ev) => this.on_event(ev),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// The next event, or 504 at the deadline.
async fn next(events: &mut UnboundedReceiver<GenEvent>, deadline: Instant, limit: Duration) -> Result<Option<GenEvent>, ApiError> {
    tokio::time::timeout_at(deadline, events.recv()).await.map_err(|_| ApiError::timeout(limit))
}

async fn respond(s: &AppState, req: GenerationRequest, model_id: String) -> Result<Response, ApiError> {
    let arrived = std::time::Instant::now();
    let limit = s.options.request_timeout;
    let deadline = Instant::now() + limit;
    let GenerationRequest { api, prompt, mut params, seed, max_tokens, stream, include_usage } = req;
    params.seed = seed.unwrap_or_else(|| s.fresh_seed());
    let shape = Shape { api, id: s.response_id(if api == Api::Chat { "chatcmpl" } else { "cmpl" }), created: unix_now(), model: model_id };
    let sched = &s.generation_model(None)?.scheduler;
    // Tokenized here, on a blocking thread of the runtime: requests that
    // arrive together are tokenized in parallel.
    let encoder = sched.info.encoder.clone();
    let ids = tokio::task::spawn_blocking(move || encode_prompt(&encoder, &prompt))
        .await
        .map_err(|_| ApiError::internal("tokenizing the prompt failed (its thread panicked)"))??;
    let mut events = sched.submit(GenRequest { ids, params, max_tokens, arrived })?;
    let prompt_tokens = match next(&mut events, deadline, limit).await? {
        Some(GenEvent::Started { prompt_tokens, cached_tokens }) => (prompt_tokens, cached_tokens),
        Some(GenEvent::Failed(e)) => return Err(e),
        _ => return Err(ApiError::internal("the generation worker answered out of order")),
    };
    if stream {
        let first = data(&shape.chunk(if api == Api::Chat { Some("") } else { None }, true, None));
        let mut out = VecDeque::new();
        if api == Api::Chat {
            out.push_back(first);
        }
        let body = ChunkStream {
            events,
            shape,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            limit,
            prompt_tokens,
            include_usage,
            out,
            done: false,
        };
        return Ok(Sse::new(body).into_response());
    }
    let mut text = String::new();
    loop {
        match next(&mut events, deadline, limit).await? {
            Some(GenEvent::Token(t)) => text.push_str(&t),
            Some(GenEvent::Started { .. }) => {}
            Some(GenEvent::Finished { finish, completion_tokens }) => {
                return Ok(axum::Json(shape.whole(text, finish, prompt_tokens, completion_tokens)).into_response())
            }
            Some(GenEvent::Failed(e)) => return Err(e),
            None => return Err(ApiError::internal("the generation worker stopped")),
        }
    }
}

pub async fn chat(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let f = request::parse(body, s.options.max_body_bytes)?;
    let id = s.generation_model(f.str("model")?)?.id.clone();
    respond(&s, GenerationRequest::read(&f, Api::Chat)?, id).await
}

pub async fn completions(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let f = request::parse(body, s.options.max_body_bytes)?;
    let id = s.generation_model(f.str("model")?)?.id.clone();
    respond(&s, GenerationRequest::read(&f, Api::Completion)?, id).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_take_strings_and_text_parts() {
        let v = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]);
        let m = messages(&v).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((m[1].role.as_str(), m[1].content.as_str()), ("user", "hi there"));
        let img = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]);
        assert!(messages(&img).is_err_and(|e| e.message.contains("image_url")));
        assert!(messages(&json!([{"content": "x"}])).is_err_and(|e| e.message.contains("no 'role'")));
        assert!(messages(&json!([])).is_err());
    }

    #[test]
    fn completion_prompts_are_one_text_or_one_id_list() {
        assert!(matches!(completion_prompt(&json!("a")), Ok(Prompt::Text(t)) if t == "a"));
        assert!(matches!(completion_prompt(&json!(["a"])), Ok(Prompt::Text(t)) if t == "a"));
        assert!(matches!(completion_prompt(&json!([1, 2])), Ok(Prompt::Ids(i)) if i == [1, 2]));
        assert!(matches!(completion_prompt(&json!([[1, 2]])), Ok(Prompt::Ids(i)) if i == [1, 2]));
        assert!(completion_prompt(&json!(["a", "b"])).is_err_and(|e| e.message.contains("one per request")));
        assert!(completion_prompt(&json!(5)).is_err());
    }
}
