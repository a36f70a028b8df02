//! `/v1/chat/completions` and `/v1/completions` over real HTTP with the
//! SmolLM2 GGUF: greedy replies (whole and streamed, several at once in the
//! batched decode) equal the generator's own; a client that disconnects
//! mid-stream (or before a whole reply) frees its slot; a request past its
//! time limit gets 504; bad requests get OpenAI error objects.

mod common;

use std::time::{Duration, Instant};

use common::{metric, post, runtime, smollm2, sse_data, Client, Running};
use http_body_util::BodyExt;
use rlx_models::{Generator, Message, SamplingParams};
use rlx_serve::decode_scheduler::generator_options;
use rlx_serve::{ModelPaths, ServeOptions};
use serde_json::{json, Value};

const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";
const SEQUENCES: usize = 3;
const CTX: usize = 1024;

fn options() -> ServeOptions {
    ServeOptions { max_sequences: SEQUENCES, ctx_size: CTX, ..ServeOptions::default() }
}

fn generation_server(path: &std::path::Path) -> ModelPaths {
    ModelPaths { embedding: None, generation: Some(path.to_path_buf()) }
}

/// The generator's own greedy reply (text, tokens) to `prompt` ids, run
/// alone through its batch API.
fn reference(g: &mut Generator, prompt: &[u32], max_tokens: usize) -> (String, usize) {
    let params = SamplingParams { max_tokens, ..SamplingParams::greedy() };
    let first = g.add_sequence(prompt, &params).unwrap_or_else(|e| panic!("add_sequence: {e}"));
    let (slot, mut text, mut n, mut done) = (first.slot, first.piece.text, 1, first.finished.is_some());
    while !done {
        for e in g.step_batch().unwrap_or_else(|e| panic!("step_batch: {e}")) {
            assert_eq!(e.slot, slot);
            text.push_str(&e.piece.text);
            n += 1;
            done = e.finished.is_some();
        }
    }
    (text, n)
}

/// Content of a streamed reply, its finish reason and usage.
fn streamed(body: &str) -> (String, Option<String>, Value) {
    let events = sse_data(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let (mut text, mut finish, mut usage) = (String::new(), None, Value::Null);
    for (i, e) in events[..events.len() - 1].iter().enumerate() {
        let v: Value = serde_json::from_str(e).unwrap_or_else(|err| panic!("chunk {i} is not JSON ({err}): {e}"));
        assert!(v.get("error").is_none(), "{v}");
        if let Some(c) = v["choices"].get(0) {
            let piece = c["delta"]["content"].as_str().or_else(|| c["text"].as_str()).unwrap_or_default();
            text.push_str(piece);
            if i == 0 && v["object"] == "chat.completion.chunk" {
                assert_eq!(c["delta"]["role"], "assistant", "{v}");
            }
            if let Some(f) = c["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (text, finish, usage)
}

#[test]
fn greedy_chat_and_completions_equal_the_generator_also_when_batched() {
    let Some(gguf) = smollm2("greedy_chat_and_completions_equal_the_generator_also_when_batched") else { return };
    let chats = [
        vec![Message::new("user", "What is the capital of France?")],
        vec![Message::new("system", "Answer briefly."), Message::new("user", "Name three colours.")],
        vec![Message::new("user", "Write a haiku about the sea.")],
    ];
    let raw = "The three primary colours are";
    let max_tokens = 24;
    let mut g = Generator::load_with(&gguf, rlx::Device::Cpu, generator_options(SEQUENCES, CTX, None)).unwrap_or_else(|e| panic!("{e}"));
    let want: Vec<(String, usize, usize)> = chats
        .iter()
        .map(|m| {
            let ids = g.encode_chat(m).unwrap_or_else(|e| panic!("{e}"));
            let (t, n) = reference(&mut g, &ids, max_tokens);
            (t, n, ids.len())
        })
        .collect();
    let raw_ids = g.encode(raw).unwrap_or_else(|e| panic!("{e}"));
    let (raw_text, raw_n) = reference(&mut g, &raw_ids, max_tokens);
    drop(g);
    let as_json = |m: &[Message]| json!(m.iter().map(|x| json!({"role": x.role, "content": x.content})).collect::<Vec<_>>());

    runtime().block_on(async {
        let server = Running::start(generation_server(&gguf), options()).await;
        let addr = server.addr;
        // One at a time, whole.
        let r = post(addr, "/v1/chat/completions", &json!({"model": MODEL, "messages": as_json(&chats[0]), "max_tokens": max_tokens, "temperature": 0})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], want[0].0, "{v}");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["usage"]["completion_tokens"], want[0].1, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], want[0].2, "{v}");
        let finish = if want[0].1 == max_tokens { "length" } else { "stop" };
        assert_eq!(v["choices"][0]["finish_reason"], finish, "{v}");
        // A request may use the whole context, and no more.
        let prompt_tokens = want[0].2;
        let over = json!({"model": MODEL, "messages": as_json(&chats[0]), "max_tokens": CTX - prompt_tokens + 1});
        let r = post(addr, "/v1/chat/completions", &over).await;
        assert_eq!(r.status, 400, "{}", r.text());
        let at_most = format!("ask for at most {}", CTX - prompt_tokens);
        assert!(r.text().contains(&at_most) && r.text().contains("--ctx-size"), "{}", r.text());
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "{v}");
        // The same chat again: its slot still holds the prompt, so all of it
        // but the last token is reused, and the reply is the same.
        let r = post(addr, "/v1/chat/completions", &json!({"model": MODEL, "messages": as_json(&chats[0]), "max_tokens": max_tokens, "temperature": 0})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let again = r.json();
        assert_eq!(again["choices"][0]["message"]["content"], want[0].0, "{again}");
        assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], want[0].2 - 1, "{again}");

        // All at once: three streamed chats and a raw completion share the
        // batched decode (three slots: one request waits for a free one).
        let mut tasks = vec![];
        for (i, m) in chats.iter().enumerate() {
            let body = json!({"model": MODEL, "messages": as_json(m), "max_tokens": max_tokens, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
            tasks.push(tokio::spawn(async move { (i, post(addr, "/v1/chat/completions", &body).await) }));
        }
        let body = json!({"model": MODEL, "prompt": raw, "max_tokens": max_tokens, "temperature": 0});
        let raw_task = tokio::spawn(async move { post(addr, "/v1/completions", &body).await });
        for t in tasks {
            let (i, r) = t.await.unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(r.status, 200, "{}", r.text());
            assert!(r.headers.get("content-type").and_then(|v| v.to_str().ok()).is_some_and(|c| c.starts_with("text/event-stream")));
            let (text, finish, usage) = streamed(&r.text());
            assert_eq!(text, want[i].0, "chat {i}");
            assert!(finish.is_some(), "chat {i}: no finish_reason");
            assert_eq!(usage["completion_tokens"], want[i].1, "chat {i}");
            assert_eq!(usage["total_tokens"], want[i].1 + want[i].2, "chat {i}");
        }
        let r = raw_task.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], raw_text, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], raw_n, "{v}");

        let m = Client::connect(addr).await.get("/metrics").await.text();
        // Some decode step ran more than one sequence.
        let single = metric(&m, "rlx_decode_batch_sequences_bucket{le=\"1\"}");
        let steps = metric(&m, "rlx_decode_batch_sequences_count");
        assert!(steps > single, "every decode step ran one sequence:\n{m}");
        server.stop().await;
    });
}

#[test]
fn a_client_that_disconnects_mid_stream_or_mid_request_frees_its_slot() {
    let Some(gguf) = smollm2("a_client_that_disconnects_mid_stream_or_mid_request_frees_its_slot") else { return };
    runtime().block_on(async {
        // One slot: the second request can only run once the first is gone.
        let options =
            ServeOptions { max_sequences: 1, ctx_size: CTX, request_timeout: Duration::from_secs(120), ..ServeOptions::default() };
        let server = Running::start(generation_server(&gguf), options).await;
        let long = 700;
        let mut a = Client::connect(server.addr).await;
        let body = json!({"prompt": "Once upon a time", "max_tokens": long, "ignore_eos": true, "temperature": 0, "stream": true});
        let resp = a.send("POST", "/v1/completions", body.to_string().into_bytes()).await;
        assert_eq!(resp.status(), 200);
        let mut stream = resp.into_body();
        let mut seen = String::new();
        while sse_data(&seen).len() < 3 {
            let frame = stream.frame().await.unwrap_or_else(|| panic!("stream ended early: {seen}")).unwrap_or_else(|e| panic!("{e}"));
            if let Some(d) = frame.data_ref() {
                seen.push_str(&String::from_utf8_lossy(d));
            }
        }
        drop(stream);
        a.abort();
        // A whole (not streamed) request whose client gives up frees it too.
        let mut b = Client::connect(server.addr).await;
        let body = json!({"prompt": "Once upon a time", "max_tokens": long, "ignore_eos": true, "temperature": 0});
        let gave_up = tokio::time::timeout(Duration::from_millis(800), b.post("/v1/completions", &body)).await;
        assert!(gave_up.is_err(), "{long} tokens in 0.8 s?");
        b.abort();

        let start = Instant::now();
        let r =
            post(server.addr, "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": true})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 4);
        let m = Client::connect(server.addr).await.get("/metrics").await.text();
        let generated = metric(&m, "rlx_generated_tokens_total");
        println!(
            "second request answered {:.2} s after the first client left; {generated} tokens generated in all",
            start.elapsed().as_secs_f64()
        );
        assert!(generated < (long / 2) as f64, "{generated} tokens generated: the abandoned sequence kept its slot");
        server.stop().await;
    });
}

#[test]
fn a_request_past_its_time_limit_gets_504_and_frees_its_slot() {
    let Some(gguf) = smollm2("a_request_past_its_time_limit_gets_504_and_frees_its_slot") else { return };
    runtime().block_on(async {
        // 3 s: long enough for the last short request on a loaded 2-core machine
        // (it waits for the freed slot, then prefills), far too short for 700 tokens.
        let options = ServeOptions { max_sequences: 1, ctx_size: CTX, request_timeout: Duration::from_secs(3), ..ServeOptions::default() };
        let server = Running::start(generation_server(&gguf), options).await;
        let long = 700;
        let body = json!({"prompt": "Once upon a time", "max_tokens": long, "ignore_eos": true, "temperature": 0});
        post(server.addr, "/v1/completions", &body).await.assert_error(504, "timeout");
        // Streamed: the stream ends with an error event and [DONE].
        let r =
            post(server.addr, "/v1/completions", &json!({"prompt": "Once", "max_tokens": long, "ignore_eos": true, "stream": true})).await;
        assert_eq!(r.status, 200);
        let events = sse_data(&r.text());
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let err: Value = serde_json::from_str(&events[events.len() - 2]).unwrap_or_default();
        assert_eq!(err["error"]["code"], "timeout", "{events:?}");
        // The one slot is free again.
        let r =
            post(server.addr, "/v1/completions", &json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0, "ignore_eos": true})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let m = Client::connect(server.addr).await.get("/metrics").await.text();
        let generated = metric(&m, "rlx_generated_tokens_total");
        assert!(generated < long as f64, "{generated} tokens generated: a timed-out sequence kept running");
        assert_eq!(metric(&m, "rlx_requests_total{route=\"/v1/completions\",status=\"504\"}"), 1.0, "{m}");
        server.stop().await;
    });
}

#[test]
fn a_full_generation_queue_answers_503_with_retry_after() {
    let Some(gguf) = smollm2("a_full_generation_queue_answers_503_with_retry_after") else { return };
    runtime().block_on(async {
        // One slot, one waiting request: with the slot busy, a second request
        // waits and a third is refused.
        let options = ServeOptions { max_sequences: 1, max_queue: 1, ctx_size: CTX, ..ServeOptions::default() };
        let server = Running::start(generation_server(&gguf), options).await;
        let mut a = Client::connect(server.addr).await;
        let body = json!({"prompt": "Once upon a time", "max_tokens": 700, "ignore_eos": true, "temperature": 0, "stream": true});
        let resp = a.send("POST", "/v1/completions", body.to_string().into_bytes()).await;
        assert_eq!(resp.status(), 200);
        let addr = server.addr;
        let waiting = tokio::spawn(async move {
            post(addr, "/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0, "ignore_eos": true})).await
        });
        // The second request is queued once the gauge says so.
        let deadline = Instant::now() + Duration::from_secs(10);
        while metric(&Client::connect(addr).await.get("/metrics").await.text(), "rlx_queue_depth{queue=\"generation\"}") < 1.0 {
            assert!(Instant::now() < deadline, "the second request never queued");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let r = post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})).await;
        r.assert_error(503, "queue_full");
        assert_eq!(r.headers.get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
        // The first client leaves; the waiting request gets the slot.
        drop(resp);
        a.abort();
        let r = waiting.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 2);
        server.stop().await;
    });
}

#[test]
fn bad_generation_requests_get_openai_errors() {
    let Some(gguf) = smollm2("bad_generation_requests_get_openai_errors") else { return };
    runtime().block_on(async {
        let server = Running::start(generation_server(&gguf), options()).await;
        let mut c = Client::connect(server.addr).await;
        let user = json!([{"role": "user", "content": "hi"}]);
        let cases = [
            (json!({"messages": "hi"}), 400, "invalid_value", "'messages' must be a list"),
            (json!({"messages": []}), 400, "invalid_value", "empty list"),
            (json!({"messages": [{"role": "user", "content": 5}]}), 400, "invalid_value", "content"),
            (json!({"messages": user, "model": "gpt-4o"}), 404, "model_not_found", "'gpt-4o' does not exist"),
            (json!({"messages": user, "n": 2}), 400, "invalid_value", "one choice"),
            (json!({"messages": user, "temperature": "hot"}), 400, "invalid_value", "'temperature' must be a number"),
            (json!({"messages": user, "temperature": 3}), 400, "invalid_value", "between 0 and 2"),
            (json!({"messages": user, "max_tokens": 0}), 400, "invalid_value", "max_tokens"),
            (json!({"messages": user, "max_tokens": CTX}), 400, "invalid_value", "ask for at most"),
            (json!({"messages": user, "stop": [1]}), 400, "invalid_value", "'stop' items must be strings"),
            (json!({"messages": user, "tools": [{"type": "function"}]}), 400, "invalid_value", "'tools' is not supported"),
        ];
        for (body, status, code, says) in cases {
            let msg = c.post("/v1/chat/completions", &body).await.assert_error(status, code);
            assert!(msg.contains(says), "{body}: {msg}");
        }
        let long_prompt = "word ".repeat(CTX);
        let msg = c.post("/v1/completions", &json!({"prompt": long_prompt, "max_tokens": 1})).await.assert_error(400, "invalid_value");
        assert!(msg.contains("tokens"), "{msg}");
        c.post("/v1/embeddings", &json!({"input": "a"})).await.assert_error(404, "model_not_found");
        // Still serving: a stop string ends the reply before it.
        let r = c.post("/v1/completions", &json!({"prompt": "1, 2, 3, 4,", "max_tokens": 16, "temperature": 0, "stop": [" 7"]})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let text = v["choices"][0]["text"].as_str().unwrap_or_default();
        assert!(!text.contains(" 7") && text.contains('6'), "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let models = c.get("/v1/models").await.json();
        assert_eq!(models["data"][0]["id"], MODEL, "{models}");
        server.stop().await;
    });
}
