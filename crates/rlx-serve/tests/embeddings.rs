//! `/v1/embeddings` and `/v1/rerank` over real HTTP against a real server:
//! concurrent clients get what `SentenceEmbedder::embed` returns, in order;
//! bad requests get the documented status and an OpenAI error object and
//! the server goes on answering; a full queue answers 503.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use common::{f32s, max_abs_diff, metric, minilm, post, runtime, Client, Running};
use rlx_models::SentenceEmbedder;
use rlx_serve::{ModelPaths, ServeOptions};
use serde_json::{json, Value};

const MODEL: &str = "all-MiniLM-L6-v2";

/// Deterministic texts of 1 to 24 words (a few far over the model's 256
/// tokens, which the server truncates as `rlx embed` does).
fn texts(n: usize) -> Vec<String> {
    let words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "vectors",
        "serve",
        "batch",
        "query",
        "Ünïcode",
        "東京",
        "42",
    ];
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..n)
        .map(|i| {
            let len = if i % 97 == 5 { 400 } else { 1 + (next() % 24) as usize };
            (0..len).map(|_| words[(next() % words.len() as u64) as usize]).collect::<Vec<_>>().join(" ")
        })
        .collect()
}

fn embedding_server(dir: &std::path::Path) -> ModelPaths {
    ModelPaths { embedding: Some(dir.to_path_buf()), generation: None }
}

/// `clients` concurrent connections × `requests` each of 1–4 texts from a
/// pool; every row must match the direct embedder within 1e-5, in order.
fn concurrent_clients(test: &str, clients: usize, requests: usize) {
    let Some(dir) = minilm(test) else { return };
    let pool = texts(120);
    let embedder = SentenceEmbedder::load(&dir, rlx::Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let refs: Vec<&str> = pool.iter().map(String::as_str).collect();
    let reference = Arc::new(embedder.embed(&refs).unwrap_or_else(|e| panic!("{e}")));
    let tokens: Arc<Vec<usize>> = Arc::new(embedder.tokenize(&refs).unwrap_or_else(|e| panic!("{e}")).iter().map(Vec::len).collect());
    drop(embedder);
    let pool = Arc::new(pool);
    runtime().block_on(async {
        let server = Running::start(embedding_server(&dir), ServeOptions::default()).await;
        let addr = server.addr;
        let start = Instant::now();
        let mut tasks = vec![];
        for c in 0..clients {
            let (pool, reference, tokens) = (pool.clone(), reference.clone(), tokens.clone());
            tasks.push(tokio::spawn(async move {
                let mut client = Client::connect(addr).await;
                let mut worst = 0f32;
                for r in 0..requests {
                    let n = 1 + (c * 7 + r * 3) % 4;
                    let idx: Vec<usize> = (0..n).map(|k| (c * 131 + r * 17 + k * 29) % pool.len()).collect();
                    let input = if n == 1 && r % 2 == 0 { json!(pool[idx[0]]) } else { json!(idx.iter().map(|&i| &pool[i]).collect::<Vec<_>>()) };
                    let reply = client.post("/v1/embeddings", &json!({"model": MODEL, "input": input})).await;
                    assert_eq!(reply.status, 200, "client {c} request {r}: {}", reply.text());
                    let v = reply.json();
                    let data = v["data"].as_array().cloned().unwrap_or_default();
                    assert_eq!(data.len(), n, "client {c} request {r}: {v}");
                    for (k, item) in data.iter().enumerate() {
                        assert_eq!(item["index"], k, "{v}");
                        assert_eq!(item["object"], "embedding");
                        worst = worst.max(max_abs_diff(&f32s(&item["embedding"]), &reference[idx[k]]));
                    }
                    let want: usize = idx.iter().map(|&i| tokens[i]).sum();
                    assert_eq!(v["usage"]["prompt_tokens"], want, "{v}");
                    assert_eq!(v["model"], MODEL);
                }
                worst
            }));
        }
        let mut worst = 0f32;
        for t in tasks {
            worst = worst.max(t.await.unwrap_or_else(|e| panic!("client task: {e}")));
        }
        let secs = start.elapsed().as_secs_f64();
        let m = Client::connect(addr).await.get("/metrics").await.text();
        let calls = metric(&m, "rlx_embedding_batch_rows_count");
        let total = (clients * requests) as f64;
        println!(
            "{clients} clients x {requests} requests: {secs:.2} s, {:.0} requests/s; {calls} embedder calls (mean {:.1} requests per call); max |diff| {worst:e}",
            total / secs,
            total / calls
        );
        assert!(worst <= 1e-5, "max abs difference {worst} > 1e-5");
        assert_eq!(metric(&m, "rlx_requests_total{route=\"/v1/embeddings\",status=\"200\"}"), total);
        // Concurrent requests were coalesced: fewer embedder calls than requests.
        assert!(calls < total, "{calls} embedder calls for {total} requests: nothing was coalesced");
        server.stop().await;
    });
}

#[test]
fn concurrent_clients_get_what_the_embedder_returns_in_order() {
    concurrent_clients("concurrent_clients_get_what_the_embedder_returns_in_order", 64, 6);
}

/// The full size; run with `cargo test -p rlx-serve -- --ignored`.
#[test]
#[ignore = "64 clients x 50 requests: a minute or more on a 2-core CPU"]
fn sixty_four_clients_by_fifty_requests() {
    concurrent_clients("sixty_four_clients_by_fifty_requests", 64, 50);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_goes_on() {
    let Some(dir) = minilm("bad_requests_get_openai_errors_and_the_server_goes_on") else { return };
    runtime().block_on(async {
        let options =
            ServeOptions { api_key: Some("sk-test-key".into()), max_body_bytes: 64 << 10, max_inputs: 8, ..ServeOptions::default() };
        let server = Running::start(embedding_server(&dir), options).await;
        let mut c = Client::connect(server.addr).await;
        c.key = Some("sk-test-key".into());
        let ok = json!({"model": MODEL, "input": "fine"});

        // No key, wrong key, a key one character longer.
        for key in [None, Some("sk-test-kez"), Some("sk-test-key2")] {
            let mut k = Client::connect(server.addr).await;
            k.key = key.map(str::to_string);
            let r = k.post("/v1/embeddings", &ok).await;
            r.assert_error(401, "invalid_api_key");
            assert!(r.headers.contains_key("www-authenticate"));
        }
        // /health and /metrics need no key.
        assert_eq!(Client::connect(server.addr).await.get("/health").await.status, 200);

        let cases: Vec<(&str, Vec<u8>, u16, &str, &str)> = vec![
            ("bad JSON", b"{\"input\": ".to_vec(), 400, "invalid_json", "not valid JSON"),
            ("not an object", b"[1, 2]".to_vec(), 400, "invalid_value", "JSON object"),
            ("input missing", json!({"model": MODEL}).to_string().into_bytes(), 400, "invalid_value", "'input' is required"),
            ("input a number", json!({"input": 5}).to_string().into_bytes(), 400, "invalid_value", "found a number"),
            ("mixed list", json!({"input": ["a", 1]}).to_string().into_bytes(), 400, "invalid_value", "'input[1]' must be a string"),
            ("empty list", json!({"input": []}).to_string().into_bytes(), 400, "invalid_value", "empty list"),
            ("empty string", json!({"input": ""}).to_string().into_bytes(), 400, "invalid_value", "empty string"),
            (
                "wrong format type",
                json!({"input": "a", "encoding_format": 3}).to_string().into_bytes(),
                400,
                "invalid_value",
                "must be a string",
            ),
            (
                "unknown format",
                json!({"input": "a", "encoding_format": "int8"}).to_string().into_bytes(),
                400,
                "invalid_value",
                "'float' or 'base64'",
            ),
            (
                "dimensions",
                json!({"input": "a", "dimensions": 128}).to_string().into_bytes(),
                400,
                "invalid_value",
                "'dimensions' is not supported",
            ),
            ("too many inputs", json!({"input": vec!["a"; 9]}).to_string().into_bytes(), 400, "invalid_value", "limit is 8"),
            (
                "over-long, truncate false",
                json!({"input": ["short", "word ".repeat(400)], "truncate": false}).to_string().into_bytes(),
                400,
                "invalid_value",
                "limit of 256 tokens",
            ),
            (
                "ids over-long, truncate false",
                json!({"input": [vec![101u32; 300]], "truncate": false}).to_string().into_bytes(),
                400,
                "invalid_value",
                "limit of 256",
            ),
            (
                "id outside the vocabulary",
                json!({"input": [[101, 999999, 102]]}).to_string().into_bytes(),
                400,
                "invalid_value",
                "outside the vocabulary",
            ),
            (
                "unknown model",
                json!({"input": "a", "model": "text-embedding-3-small"}).to_string().into_bytes(),
                404,
                "model_not_found",
                "does not exist",
            ),
            (
                "oversized body",
                json!({"input": "x".repeat(70 << 10)}).to_string().into_bytes(),
                413,
                "request_too_large",
                "limit of 65536 bytes",
            ),
        ];
        for (what, body, status, code, says) in cases {
            let r = c.call("POST", "/v1/embeddings", body).await;
            let msg = r.assert_error(status, code);
            assert!(msg.contains(says), "{what}: {msg}");
            // The server still answers, on the same connection where it kept it.
            let mut again = Client::connect(server.addr).await;
            again.key = c.key.clone();
            assert_eq!(again.post("/v1/embeddings", &ok).await.status, 200, "after {what}");
            if status == 413 {
                c = again;
            }
        }
        // Over-long input is truncated by default (as `rlx embed` does).
        let r = c.post("/v1/embeddings", &json!({"input": "word ".repeat(400)})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["usage"]["prompt_tokens"], 256);
        // Other routes answer with error objects too.
        c.call("GET", "/v1/nothing", vec![]).await.assert_error(404, "not_found");
        c.call("GET", "/v1/embeddings", vec![]).await.assert_error(405, "method_not_allowed");
        c.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]}))
            .await
            .assert_error(404, "model_not_found");
        let m = c.get("/metrics").await.text();
        assert!(metric(&m, "rlx_requests_total{route=\"/v1/embeddings\",status=\"400\"}") >= 13.0, "{m}");
        assert_eq!(metric(&m, "rlx_requests_total{route=\"/v1/embeddings\",status=\"401\"}"), 3.0, "{m}");
        server.stop().await;
    });
}

#[test]
fn base64_token_ids_and_rerank_agree_with_the_embedder() {
    let Some(dir) = minilm("base64_token_ids_and_rerank_agree_with_the_embedder") else { return };
    let embedder = SentenceEmbedder::load(&dir, rlx::Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let docs = ["A cat sits on the mat.", "Stock markets fell today.", "A kitten rests on a rug.", "The recipe needs two eggs."];
    let query = "Where is the cat?";
    let all: Vec<&str> = std::iter::once(query).chain(docs).collect();
    let want = embedder.embed(&all).unwrap_or_else(|e| panic!("{e}"));
    let ids = embedder.tokenize(&docs).unwrap_or_else(|e| panic!("{e}"));
    runtime().block_on(async {
        let server = Running::start(embedding_server(&dir), ServeOptions::default()).await;
        // base64: little-endian f32, the same numbers as the float form.
        let r = post(server.addr, "/v1/embeddings", &json!({"input": docs, "encoding_format": "base64"})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        for (k, item) in r.json()["data"].as_array().cloned().unwrap_or_default().iter().enumerate() {
            let bytes =
                base64::engine::general_purpose::STANDARD.decode(item["embedding"].as_str().unwrap_or_default()).unwrap_or_default();
            let v: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            assert!(max_abs_diff(&v, &want[k + 1]) <= 1e-5, "doc {k}");
        }
        // Token ids give the same vectors as the texts they came from.
        let r = post(server.addr, "/v1/embeddings", &json!({"input": ids})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let data = r.json()["data"].clone();
        for k in 0..docs.len() {
            assert!(max_abs_diff(&f32s(&data[k]["embedding"]), &want[k + 1]) <= 1e-5, "ids of doc {k}");
        }
        // Rerank: cosine of query and document, best first, top_n kept.
        let r = post(
            server.addr,
            "/v1/rerank",
            &json!({"model": MODEL, "query": query, "documents": docs, "top_n": 3, "return_documents": true}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let results = v["results"].as_array().cloned().unwrap_or_default();
        assert_eq!(results.len(), 3, "{v}");
        let mut scores: Vec<(usize, f32)> = (0..docs.len()).map(|i| (i, rlx_models::cosine(&want[0], &want[i + 1]))).collect();
        scores.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (r, (i, s)) in results.iter().zip(&scores) {
            assert_eq!(r["index"], *i, "{v}");
            assert!((r["relevance_score"].as_f64().unwrap_or(f64::NAN) as f32 - s).abs() <= 1e-5, "{v}");
            assert_eq!(r["document"]["text"], docs[*i]);
        }
        assert_eq!(results[0]["index"], 0, "the cat sentence ranks first: {v}");
        let e = post(server.addr, "/v1/rerank", &json!({"query": query, "documents": []})).await;
        e.assert_error(400, "invalid_value");
        let models = post(server.addr, "/v1/models", &Value::Null).await;
        models.assert_error(405, "method_not_allowed");
        server.stop().await;
    });
}

#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let Some(dir) = minilm("a_full_queue_answers_503_with_retry_after") else { return };
    runtime().block_on(async {
        // One call at a time of at most 8 rows, one request waiting: of 12
        // requests of 64 texts sent at once, most find the queue full.
        let options = ServeOptions { max_queue: 1, max_batch_rows: 8, ..ServeOptions::default() };
        let server = Running::start(embedding_server(&dir), options).await;
        let long = texts(64);
        let mut tasks = vec![];
        for _ in 0..12 {
            let (addr, body) = (server.addr, json!({"input": long}));
            tasks.push(tokio::spawn(async move { post(addr, "/v1/embeddings", &body).await }));
        }
        let (mut ok, mut full) = (0, 0);
        for t in tasks {
            let r = t.await.unwrap_or_else(|e| panic!("{e}"));
            match r.status {
                200 => ok += 1,
                503 => {
                    r.assert_error(503, "queue_full");
                    assert_eq!(r.headers.get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
                    full += 1;
                }
                s => panic!("status {s}: {}", r.text()),
            }
        }
        assert!(ok >= 1 && full >= 1, "{ok} answered, {full} refused");
        // The server answers again once the queue has drained.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = post(server.addr, "/v1/embeddings", &json!({"input": "again"})).await;
            if r.status == 200 {
                break;
            }
            assert!(Instant::now() < deadline, "still refused: {}", r.text());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        server.stop().await;
    });
}

#[test]
fn a_request_that_finds_the_model_idle_does_not_wait_for_company() {
    let Some(dir) = minilm("a_request_that_finds_the_model_idle_does_not_wait_for_company") else { return };
    runtime().block_on(async {
        // A wait for more requests that would show: 3 s.
        let options = ServeOptions { max_wait: Duration::from_secs(3), ..ServeOptions::default() };
        let server = Running::start(embedding_server(&dir), options).await;
        let mut c = Client::connect(server.addr).await;
        assert_eq!(c.post("/v1/embeddings", &json!({"input": "warm up"})).await.status, 200);
        for text in ["one lone request", "and another"] {
            let start = Instant::now();
            let r = c.post("/v1/embeddings", &json!({"input": text})).await;
            let took = start.elapsed();
            assert_eq!(r.status, 200, "{}", r.text());
            assert!(took < Duration::from_millis(1500), "a lone request took {took:?}: it waited for others");
        }
        server.stop().await;
    });
}
