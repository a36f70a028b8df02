//! `rlx serve` as a user runs it: the built binary on an ephemeral loopback
//! port; SIGTERM with requests in flight lets them finish, refuses new
//! connections and exits 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A file under models/ when present. Absent: the test prints the skip
/// marker and returns, unless RLX_REQUIRE_MODELS=1 (CI), where it fails.
fn model(test: &str, rel: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models").join(rel);
    if p.exists() {
        return Some(p);
    }
    if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{test}: {} is missing and RLX_REQUIRE_MODELS=1: run scripts/fetch-models", p.display());
    }
    eprintln!("SKIPPED {test}: {} is missing (run scripts/fetch-models)", p.display());
    None
}

/// The server process; killed if the test fails before it exits.
struct Serve {
    child: Child,
    addr: SocketAddr,
    stderr: mpsc::Receiver<String>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(args: &[&str]) -> Serve {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rlx"))
        .arg("serve")
        .args(["--port", "0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run rlx serve: {e}"));
    let (tx, rx) = mpsc::channel();
    let err = child.stderr.take().unwrap_or_else(|| panic!("no stderr"));
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = vec![];
    let addr = loop {
        let line = rx.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| panic!("rlx serve did not start: {seen:?}"));
        if let Some(rest) = line.split("listening on http://").nth(1) {
            let a = rest.split_whitespace().next().unwrap_or_default();
            break a.parse().unwrap_or_else(|e| panic!("address {a}: {e}"));
        }
        seen.push(line);
    };
    Serve { child, addr, stderr: rx }
}

/// Sends one request (`Connection: close`) and returns the stream to read
/// the answer from.
fn send(addr: SocketAddr, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap_or_else(|e| panic!("{e}"));
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap_or_else(|e| panic!("send: {e}"));
    s
}

fn read_all(mut s: TcpStream) -> String {
    let mut out = vec![];
    s.read_to_end(&mut out).unwrap_or_else(|e| panic!("read: {e}"));
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn sigterm_lets_requests_in_flight_finish_and_exits_0() {
    let test = "sigterm_lets_requests_in_flight_finish_and_exits_0";
    let (Some(minilm), Some(gguf)) = (model(test, "all-MiniLM-L6-v2"), model(test, "SmolLM2-135M-Instruct.Q4_1.gguf")) else { return };
    let mut server = serve(&[
        "--embedding-model",
        minilm.to_str().unwrap_or_default(),
        "--generation-model",
        gguf.to_str().unwrap_or_default(),
        "--max-sequences",
        "2",
        "--ctx-size",
        "1024",
    ]);
    let addr = server.addr;

    // A streamed completion that has started (two events read)…
    let tokens = 100;
    let body = format!(
        r#"{{"prompt": "Once upon a time", "max_tokens": {tokens}, "ignore_eos": true, "temperature": 0, "stream": true, "stream_options": {{"include_usage": true}}}}"#
    );
    let mut stream = send(addr, "/v1/completions", &body);
    let mut head = vec![0u8; 4096];
    let mut got = String::new();
    while got.matches("data: ").count() < 2 {
        let n = stream.read(&mut head).unwrap_or_else(|e| panic!("read: {e}"));
        assert!(n > 0, "stream closed early: {got}");
        got.push_str(&String::from_utf8_lossy(&head[..n]));
    }
    // …and an embedding request of many texts, read by the server by now.
    let texts: Vec<String> = (0..600).map(|i| format!("text number {i} of a long request")).collect();
    let embed_body = serde_json::json!({"input": texts}).to_string();
    let embed = send(addr, "/v1/embeddings", &embed_body);
    std::thread::sleep(Duration::from_millis(500));

    let sent = Instant::now();
    let killed = Command::new("kill").args(["-TERM", &server.child.id().to_string()]).status().unwrap_or_else(|e| panic!("kill: {e}"));
    assert!(killed.success());
    // New connections are refused while the old ones finish.
    let refused = loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            break true;
        }
        if sent.elapsed() > Duration::from_secs(3) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(refused, "new connections were still accepted 3 s after SIGTERM");

    let rest = got + &read_all(stream);
    assert!(rest.starts_with("HTTP/1.1 200"), "{rest:.300}");
    assert!(rest.contains("data: [DONE]"), "the stream did not finish: …{}", &rest[rest.len().saturating_sub(300)..]);
    assert!(
        rest.contains(&format!("\"completion_tokens\":{tokens}")),
        "not all {tokens} tokens: …{}",
        &rest[rest.len().saturating_sub(300)..]
    );
    let e = read_all(embed);
    assert!(e.starts_with("HTTP/1.1 200"), "{e:.300}");
    assert_eq!(e.matches("\"object\":\"embedding\"").count(), texts.len());

    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap_or_else(|e| panic!("wait: {e}")) {
            break s;
        }
        assert!(Instant::now() < deadline, "rlx serve did not exit within 60 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let log: Vec<String> = server.stderr.try_iter().collect();
    assert_eq!(status.code(), Some(0), "{log:?}");
    assert!(log.iter().any(|l| l.contains("stopped")), "{log:?}");
    println!("exited 0 {:.2} s after SIGTERM, with both requests answered in full", sent.elapsed().as_secs_f64());
}

#[test]
fn serve_refuses_bad_flags_before_loading() {
    let o = Command::new(env!("CARGO_BIN_EXE_rlx"))
        .args(["serve", "--embedding-model", "/nonexistent/model-dir", "--port", "0"])
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("/nonexistent/model-dir") && e.contains("no such file"), "{e}");
    let o = Command::new(env!("CARGO_BIN_EXE_rlx")).args(["serve", "--device", "tpu"]).output().unwrap_or_else(|e| panic!("{e}"));
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("expected 'cpu', 'cuda' or 'cuda:N'"));
}

/// The test script for the `openai` client: prints one JSON object.
const OPENAI_SCRIPT: &str = r#"
import json, sys
from openai import OpenAI, NotFoundError, AuthenticationError
base, key, emb, gen = sys.argv[1:5]
c = OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
out = {}
out["emb_default"] = [d.embedding for d in c.embeddings.create(model=emb, input=["first text", "second text"]).data]
e = c.embeddings.create(model=emb, input="first text", encoding_format="float")
out["emb_float"], out["emb_tokens"] = e.data[0].embedding, e.usage.prompt_tokens
msgs = [{"role": "user", "content": "What is 2+2?"}]
r = c.chat.completions.create(model=gen, messages=msgs, max_tokens=12, temperature=0)
out["chat"], out["chat_tokens"] = r.choices[0].message.content, r.usage.completion_tokens
parts = []
for ch in c.chat.completions.create(model=gen, messages=msgs, max_tokens=12, temperature=0, stream=True):
    if ch.choices:
        parts.append(ch.choices[0].delta.content or "")
out["stream"] = "".join(parts)
try:
    c.embeddings.create(model="no-such-model", input="x")
    out["not_found"] = False
except NotFoundError:
    out["not_found"] = True
try:
    OpenAI(base_url=base, api_key="wrong-key", max_retries=0).models.list()
    out["auth"] = False
except AuthenticationError:
    out["auth"] = True
out["models"] = [m.id for m in c.models.list().data]
print(json.dumps(out))
"#;

/// A venv with the `openai` package under the target directory (made once).
/// Without python3 and venv the test skips; a failed install skips too,
/// unless RLX_REQUIRE_MODELS=1 (CI, which has the network), where it fails.
fn openai_venv(test: &str) -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let has_openai = || Command::new(&python).args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
    if has_openai() {
        return Some(python);
    }
    let made = Command::new("python3").args(["-m", "venv"]).arg(&venv).output();
    if !made.as_ref().is_ok_and(|o| o.status.success()) {
        eprintln!("SKIPPED {test}: python3 -m venv is not available ({made:?})");
        return None;
    }
    let pip = Command::new(&python).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "openai"]).output();
    if pip.as_ref().is_ok_and(|o| o.status.success()) && has_openai() {
        return Some(python);
    }
    let why = pip.map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).unwrap_or_else(|e| e.to_string());
    if std::env::var("RLX_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{test}: pip install openai failed: {why}");
    }
    eprintln!("SKIPPED {test}: pip install openai failed: {why}");
    None
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).map(|d| if d.is_nan() { f32::INFINITY } else { d }).fold(0.0, f32::max)
}

fn f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap_or_else(|| panic!("not an array: {v}")).iter().map(|x| x.as_f64().unwrap_or(f64::NAN) as f32).collect()
}

#[test]
fn the_openai_python_client_embeds_chats_and_streams() {
    let test = "the_openai_python_client_embeds_chats_and_streams";
    let (Some(minilm), Some(gguf)) = (model(test, "all-MiniLM-L6-v2"), model(test, "SmolLM2-135M-Instruct.Q4_1.gguf")) else { return };
    let Some(python) = openai_venv(test) else { return };
    let want = rlx_models::SentenceEmbedder::load(&minilm, rlx::Device::Cpu)
        .and_then(|e| e.embed(&["first text", "second text"]))
        .unwrap_or_else(|e| panic!("{e}"));
    let server = serve(&[
        "--embedding-model",
        minilm.to_str().unwrap_or_default(),
        "--generation-model",
        gguf.to_str().unwrap_or_default(),
        "--max-sequences",
        "2",
        "--ctx-size",
        "1024",
        "--api-key",
        "sk-rlx-test",
    ]);
    let base = format!("http://{}/v1", server.addr);
    let o = Command::new(&python)
        .args(["-c", OPENAI_SCRIPT, &base, "sk-rlx-test", "all-MiniLM-L6-v2", "SmolLM2-135M-Instruct.Q4_1"])
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}\n{stdout}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    // The client asks for base64 by default and decodes it itself.
    for (k, got) in v["emb_default"].as_array().cloned().unwrap_or_default().iter().enumerate() {
        assert!(max_abs_diff(&f32s(got), &want[k]) <= 1e-5, "text {k}");
    }
    assert!(max_abs_diff(&f32s(&v["emb_float"]), &want[0]) <= 1e-5);
    assert_eq!(v["emb_tokens"], 4, "{v}");
    let chat = v["chat"].as_str().unwrap_or_default();
    assert!(!chat.is_empty(), "{v}");
    assert_eq!(v["stream"], chat, "greedy: streamed and whole replies are the same");
    assert!(v["chat_tokens"].as_u64().is_some_and(|n| (1..=12).contains(&n)), "{v}");
    assert_eq!(v["not_found"], true, "{v}");
    assert_eq!(v["auth"], true, "{v}");
    assert_eq!(v["models"], serde_json::json!(["all-MiniLM-L6-v2", "SmolLM2-135M-Instruct.Q4_1"]));
}
