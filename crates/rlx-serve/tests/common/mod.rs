//! Shared by the HTTP tests: the model files (absent: skip, or fail under
//! RLX_REQUIRE_MODELS=1), a real server on an ephemeral loopback port, and
//! a small HTTP/1.1 client on hyper.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use rlx_serve::{ModelPaths, ServeError, ServeOptions, Server};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

fn model_file(test: &str, rel: &str, present: impl Fn(&PathBuf) -> bool) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models").join(rel);
    if present(&p) {
        return Some(p);
    }
    if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{test}: {} is missing and RLX_REQUIRE_MODELS=1: run scripts/fetch-models", p.display());
    }
    eprintln!("SKIPPED {test}: {} is missing (run scripts/fetch-models)", p.display());
    None
}

/// models/all-MiniLM-L6-v2 when present (see `model_file`).
pub fn minilm(test: &str) -> Option<PathBuf> {
    model_file(test, "all-MiniLM-L6-v2", |d| d.join("model.safetensors").is_file() && d.join("tokenizer.json").is_file())
}

/// models/SmolLM2-135M-Instruct.Q4_1.gguf when present.
pub fn smollm2(test: &str) -> Option<PathBuf> {
    model_file(test, "SmolLM2-135M-Instruct.Q4_1.gguf", |p| p.is_file())
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap_or_else(|e| panic!("runtime: {e}"))
}

/// A server on 127.0.0.1 with an ephemeral port.
pub struct Running {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: JoinHandle<Result<(), ServeError>>,
}

impl Running {
    pub async fn start(models: ModelPaths, options: ServeOptions) -> Running {
        let server = tokio::task::spawn_blocking(move || Server::load(&models, options))
            .await
            .unwrap_or_else(|e| panic!("load task: {e}"))
            .unwrap_or_else(|e| panic!("load: {e}"));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap_or_else(|e| panic!("bind: {e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let (tx, rx) = oneshot::channel::<()>();
        let done = tokio::spawn(server.serve(listener, async move {
            let _ = rx.await;
        }));
        Running { addr, stop: Some(tx), done }
    }

    /// Graceful shutdown; waits for the server (and its threads) to end.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match (&mut self.done).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("server ended with {e}"),
            Err(e) => panic!("server task: {e}"),
        }
    }
}

pub struct Reply {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("status {}: body is not JSON ({e}): {}", self.status, self.text()))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts an OpenAI error object with this status and code.
    pub fn assert_error(&self, status: u16, code: &str) -> String {
        let v = self.json();
        assert_eq!(self.status, status, "{v}");
        let e = &v["error"];
        assert_eq!(e["code"], code, "{v}");
        assert!(e["type"].as_str().is_some_and(|t| !t.is_empty()), "{v}");
        let msg = e["message"].as_str().unwrap_or_default().to_string();
        assert!(!msg.is_empty(), "{v}");
        msg
    }
}

/// One keep-alive HTTP/1.1 connection.
pub struct Client {
    sender: SendRequest<Full<Bytes>>,
    conn: JoinHandle<()>,
    pub key: Option<String>,
}

impl Client {
    pub async fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap_or_else(|e| panic!("handshake: {e}"));
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        Client { sender, conn, key: None }
    }

    /// Sends a request; returns the response with its body unread.
    pub async fn send(&mut self, method: &str, path: &str, body: Vec<u8>) -> hyper::Response<Incoming> {
        let mut b = Request::builder().method(method).uri(path).header("host", "127.0.0.1").header("content-type", "application/json");
        if let Some(k) = &self.key {
            b = b.header("authorization", format!("Bearer {k}"));
        }
        let req = b.body(Full::new(Bytes::from(body))).unwrap_or_else(|e| panic!("request: {e}"));
        self.sender.ready().await.unwrap_or_else(|e| panic!("connection not ready: {e}"));
        self.sender.send_request(req).await.unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    pub async fn call(&mut self, method: &str, path: &str, body: Vec<u8>) -> Reply {
        let resp = self.send(method, path, body).await;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await.unwrap_or_else(|e| panic!("{path}: reading the body: {e}")).to_bytes().to_vec();
        Reply { status, headers, body }
    }

    pub async fn post(&mut self, path: &str, json: &Value) -> Reply {
        self.call("POST", path, json.to_string().into_bytes()).await
    }

    pub async fn get(&mut self, path: &str) -> Reply {
        self.call("GET", path, vec![]).await
    }

    /// Closes the connection at once (as a client that goes away).
    pub fn abort(self) {
        self.conn.abort();
    }
}

/// A one-off request on its own connection.
pub async fn post(addr: SocketAddr, path: &str, json: &Value) -> Reply {
    Client::connect(addr).await.post(path, json).await
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|ev| ev.lines().find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:"))))
        .map(str::to_string)
        .collect()
}

pub fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().unwrap_or_else(|| panic!("not an array: {v}")).iter().map(|x| x.as_f64().unwrap_or(f64::NAN) as f32).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).map(|d| if d.is_nan() { f32::INFINITY } else { d }).fold(0.0, f32::max)
}

/// A value of a Prometheus line `name value` in `/metrics` text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in:\n{text}"))
}
