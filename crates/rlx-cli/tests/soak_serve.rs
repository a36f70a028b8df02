//! Serve soak: a bounded loopback load against the built `rlx serve` (CPU,
//! MiniLM embeddings, and SmolLM2 chat when its GGUF is present) from
//! several clients on keep-alive connections, with random disconnects in
//! the middle of a request body, before a response is read, and in the
//! middle of a streamed chat. Every completed response is checked:
//! embeddings against the embedder called directly in this process,
//! rerank orders against the cosines of those embeddings, chats by their
//! token counts and finish reason. The server's resident memory, open
//! descriptors and threads are sampled every `SOAK_SAMPLE_EVERY` requests.
//! Passes with 0 wrong responses, the /metrics queue depths back at 0, as
//! many chats at once as the server has sequences (no slot leaked), flat
//! memory and the descriptors back where they started.
//!
//! Ignored by default: run it with `scripts/soak-serve`. Settings:
//! `SOAK_REQUESTS` (default 100,000), `SOAK_CLIENTS` (6),
//! `SOAK_SAMPLE_EVERY` (10,000), `SOAK_WARMUP` (requests before the memory
//! baseline, a quarter of them), `SOAK_CHAT` (1: include chat when the GGUF
//! is present; 0: embeddings and rerank only).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const MAX_SEQUENCES: usize = 4;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.replace('_', "").parse().ok()).unwrap_or(default)
}

struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 11) % n as u64) as usize
    }
}

struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[String]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rlx"))
        .arg("serve")
        .args(["--port", "0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run rlx serve: {e}"));
    let err = child.stderr.take().unwrap_or_else(|| panic!("no stderr"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            if line.contains("panicked") {
                eprintln!("server: {line}");
            }
            let _ = tx.send(line);
        }
    });
    let addr = loop {
        let line = rx.recv_timeout(Duration::from_secs(180)).unwrap_or_else(|_| panic!("rlx serve did not start"));
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().unwrap_or_default().parse().unwrap_or_else(|e| panic!("address: {e}"));
        }
    };
    Server { child, addr }
}

/// A keep-alive HTTP/1.1 connection.
struct Conn {
    w: TcpStream,
    r: BufReader<TcpStream>,
}

impl Conn {
    fn open(addr: SocketAddr) -> std::io::Result<Conn> {
        let w = TcpStream::connect(addr)?;
        w.set_read_timeout(Some(Duration::from_secs(120)))?;
        w.set_nodelay(true)?;
        Ok(Conn { r: BufReader::new(w.try_clone()?), w })
    }

    fn send(&mut self, method: &str, path: &str, body: &str) -> std::io::Result<()> {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        self.w.write_all(head.as_bytes())?;
        self.w.write_all(body.as_bytes())
    }

    /// Status, body and whether the server keeps the connection open.
    fn response(&mut self) -> std::io::Result<(u16, String, bool)> {
        let mut line = String::new();
        self.r.read_line(&mut line)?;
        let status: u16 = line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
        let (mut len, mut chunked, mut keep) = (None, false, true);
        loop {
            let mut h = String::new();
            if self.r.read_line(&mut h)? == 0 {
                return Err(std::io::Error::other("connection closed in the headers"));
            }
            let h = h.trim_end().to_ascii_lowercase();
            if h.is_empty() {
                break;
            }
            if let Some(v) = h.strip_prefix("content-length:") {
                len = v.trim().parse::<usize>().ok();
            } else if h.starts_with("transfer-encoding:") && h.contains("chunked") {
                chunked = true;
            } else if h.starts_with("connection:") && h.contains("close") {
                keep = false;
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                let mut size = String::new();
                self.r.read_line(&mut size)?;
                let n = usize::from_str_radix(size.trim(), 16).map_err(std::io::Error::other)?;
                let mut chunk = vec![0u8; n + 2];
                self.r.read_exact(&mut chunk)?;
                if n == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..n]);
            }
        } else if let Some(n) = len {
            body.resize(n, 0);
            self.r.read_exact(&mut body)?;
        } else {
            self.r.read_to_end(&mut body)?;
            keep = false;
        }
        Ok((status, String::from_utf8_lossy(&body).into_owned(), keep))
    }
}

struct ProcSample {
    requests: usize,
    rss_kb: u64,
    fds: usize,
    threads: u64,
}

fn proc_sample(pid: u32, requests: usize) -> ProcSample {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |k: &str| {
        status.lines().find(|l| l.starts_with(k)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
    ProcSample { requests, rss_kb: field("VmRSS:"), fds, threads: field("Threads:") }
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().map(|a| a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN) as f32).collect()).unwrap_or_default()
}

fn close_enough(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4)
}

#[derive(Default)]
struct Tally {
    ok: usize,
    wrong: usize,
    disconnects: usize,
    chats: usize,
    reranks: usize,
    reconnects: usize,
}

/// What one client does with the `n`-th request of the run.
#[allow(clippy::too_many_arguments)]
fn one_request(
    addr: SocketAddr,
    conn: &mut Option<Conn>,
    rng: &mut Lcg,
    texts: &[String],
    direct: &[Vec<f32>],
    chat: bool,
    tally: &mut Tally,
) {
    let kind = rng.below(1000);
    let wrong = |tally: &mut Tally, what: String| {
        tally.wrong += 1;
        if tally.wrong <= 5 {
            eprintln!("wrong: {what}");
        }
    };
    match kind {
        // A body cut off half way: the server must drop the request.
        0..=39 => {
            if let Ok(mut c) = Conn::open(addr) {
                let body = json!({"input": [texts[rng.below(texts.len())]]}).to_string();
                let head = format!("POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", body.len());
                let _ = c.w.write_all(head.as_bytes());
                let _ = c.w.write_all(&body.as_bytes()[..body.len() / 2]);
            }
            tally.disconnects += 1;
        }
        // A whole request of many texts, then gone before the answer.
        40..=79 => {
            if let Ok(mut c) = Conn::open(addr) {
                let idx: Vec<usize> = (0..8).map(|_| rng.below(texts.len())).collect();
                let body = json!({"input": idx.iter().map(|&i| texts[i].as_str()).collect::<Vec<_>>()}).to_string();
                let _ = c.send("POST", "/v1/embeddings", &body);
            }
            tally.disconnects += 1;
        }
        // A streamed chat left after its first event.
        80..=84 if chat => {
            if let Ok(mut c) = Conn::open(addr) {
                let body = json!({"messages": [{"role": "user", "content": texts[rng.below(texts.len())]}], "max_tokens": 16,
                                  "temperature": 0, "ignore_eos": true, "stream": true})
                .to_string();
                let _ = c.send("POST", "/v1/chat/completions", &body);
                let mut first = String::new();
                let _ = c.r.read_line(&mut first);
            }
            tally.disconnects += 1;
        }
        85..=89 if chat => {
            let body = json!({"messages": [{"role": "user", "content": texts[rng.below(texts.len())]}], "max_tokens": 4,
                              "temperature": 0, "ignore_eos": true})
            .to_string();
            match exchange(addr, conn, "/v1/chat/completions", &body, tally) {
                Some((200, v)) => {
                    let ok = v["choices"][0]["finish_reason"] == "length" && v["usage"]["completion_tokens"] == 4;
                    if ok {
                        tally.ok += 1;
                    } else {
                        wrong(tally, format!("chat: {v}"));
                    }
                }
                other => wrong(tally, format!("chat: {other:?}")),
            }
            tally.chats += 1;
        }
        90..=119 => {
            let q = rng.below(texts.len());
            let docs: Vec<usize> = (0..3).map(|_| rng.below(texts.len())).collect();
            let body = json!({"query": texts[q], "documents": docs.iter().map(|&i| texts[i].as_str()).collect::<Vec<_>>()}).to_string();
            match exchange(addr, conn, "/v1/rerank", &body, tally) {
                Some((200, v)) => {
                    let results = v["results"].as_array().cloned().unwrap_or_default();
                    let ok = results.len() == 3
                        && results.iter().all(|r| {
                            let i = r["index"].as_u64().unwrap_or(99) as usize;
                            let want = rlx_models::cosine(&direct[q], &direct[*docs.get(i).unwrap_or(&0)]);
                            i < 3 && (r["relevance_score"].as_f64().unwrap_or(f64::NAN) as f32 - want).abs() <= 1e-4
                        })
                        && results.windows(2).all(|w| w[0]["relevance_score"].as_f64() >= w[1]["relevance_score"].as_f64());
                    if ok {
                        tally.ok += 1;
                    } else {
                        wrong(tally, format!("rerank: {v}"));
                    }
                }
                other => wrong(tally, format!("rerank: {other:?}")),
            }
            tally.reranks += 1;
        }
        _ => {
            let idx: Vec<usize> = (0..1 + rng.below(4)).map(|_| rng.below(texts.len())).collect();
            let body = json!({"input": idx.iter().map(|&i| texts[i].as_str()).collect::<Vec<_>>()}).to_string();
            match exchange(addr, conn, "/v1/embeddings", &body, tally) {
                Some((200, v)) => {
                    let data = v["data"].as_array().cloned().unwrap_or_default();
                    let ok = data.len() == idx.len()
                        && data
                            .iter()
                            .zip(&idx)
                            .enumerate()
                            .all(|(j, (d, &i))| d["index"] == j && close_enough(&floats(&d["embedding"]), &direct[i]));
                    if ok {
                        tally.ok += 1;
                    } else {
                        wrong(tally, format!("embeddings of {idx:?}: {:.200}", v.to_string()));
                    }
                }
                other => wrong(tally, format!("embeddings: {other:?}")),
            }
        }
    }
}

/// A request on the client's keep-alive connection (opened again when the
/// server closed it): the status and parsed body, or None on an I/O error.
fn exchange(addr: SocketAddr, conn: &mut Option<Conn>, path: &str, body: &str, tally: &mut Tally) -> Option<(u16, Value)> {
    for _ in 0..2 {
        if conn.is_none() {
            *conn = Conn::open(addr).ok();
            tally.reconnects += 1;
        }
        let c = conn.as_mut()?;
        let res = c.send("POST", path, body).and_then(|()| c.response());
        match res {
            Ok((status, text, keep)) => {
                if !keep {
                    *conn = None;
                }
                return Some((status, serde_json::from_str(&text).unwrap_or(Value::Null)));
            }
            // A keep-alive connection the server closed while idle: once more.
            Err(_) => *conn = None,
        }
    }
    None
}

fn metric(addr: SocketAddr, line_prefix: &str) -> Option<f64> {
    let mut c = Conn::open(addr).ok()?;
    c.w.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").ok()?;
    let (_, text, _) = c.response().ok()?;
    text.lines().find(|l| l.starts_with(line_prefix)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[test]
#[ignore = "minutes long: run scripts/soak-serve"]
fn soak_serve_loopback_load_with_disconnects() {
    let requests = env_usize("SOAK_REQUESTS", 100_000);
    let clients = env_usize("SOAK_CLIENTS", 6).max(1);
    let sample_every = env_usize("SOAK_SAMPLE_EVERY", 10_000).max(1);
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models");
    let minilm = models.join("all-MiniLM-L6-v2");
    assert!(minilm.join("model.safetensors").is_file(), "{} is missing: run scripts/fetch-models", minilm.display());
    let gguf: Option<PathBuf> =
        Some(models.join("SmolLM2-135M-Instruct.Q4_1.gguf")).filter(|p| p.is_file() && env_usize("SOAK_CHAT", 1) == 1);
    let chat = gguf.is_some();

    // Texts of varied lengths, and their embeddings from the embedder itself.
    let words = ["river", "quantum", "bread", "violet", "engine", "harbor", "silent", "mountain", "paper", "orbit", "kettle", "north"];
    let mut rng = Lcg(0x50a4);
    let texts: Vec<String> = (0..48)
        .map(|i| {
            let n = 1 + rng.below(if i % 8 == 0 { 60 } else { 14 });
            (0..n).map(|_| words[rng.below(words.len())]).collect::<Vec<_>>().join(" ") + &format!(" #{i}")
        })
        .collect();
    let embedder = rlx_models::SentenceEmbedder::load(&minilm, rlx::Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let direct = embedder.embed(&refs).unwrap_or_else(|e| panic!("{e}"));
    drop(embedder);

    let mut args = vec!["--embedding-model".to_string(), minilm.display().to_string()];
    if let Some(g) = &gguf {
        args.extend(["--generation-model".into(), g.display().to_string(), "--max-sequences".into(), MAX_SEQUENCES.to_string()]);
        args.extend(["--ctx-size".into(), "1024".into()]);
    }
    let server = start(&args);
    let (addr, pid) = (server.addr, server.child.id());
    let started = Instant::now();

    let next = Arc::new(AtomicUsize::new(0));
    let samples = Arc::new(Mutex::new(vec![proc_sample(pid, 0)]));
    let texts = Arc::new(texts);
    let direct = Arc::new(direct);
    let workers: Vec<_> = (0..clients)
        .map(|w| {
            let (next, samples, texts, direct) = (next.clone(), samples.clone(), texts.clone(), direct.clone());
            std::thread::spawn(move || {
                let mut rng = Lcg(0x1000 + w as u64);
                let mut conn = None;
                let mut tally = Tally::default();
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= requests {
                        break;
                    }
                    one_request(addr, &mut conn, &mut rng, &texts, &direct, chat, &mut tally);
                    if (n + 1) % sample_every == 0 {
                        if let Ok(mut s) = samples.lock() {
                            s.push(proc_sample(pid, n + 1));
                            let last = s.last().map(|s| (s.rss_kb, s.fds, s.threads)).unwrap_or_default();
                            eprintln!(
                                "{:>7} requests  {:>6.1} s  server rss {} KB  fds {}  threads {}",
                                n + 1,
                                started.elapsed().as_secs_f64(),
                                last.0,
                                last.1,
                                last.2
                            );
                        }
                    }
                }
                tally
            })
        })
        .collect();
    let mut total = Tally::default();
    for w in workers {
        let t = w.join().unwrap_or_else(|_| panic!("a client thread panicked"));
        total.ok += t.ok;
        total.wrong += t.wrong;
        total.disconnects += t.disconnects;
        total.chats += t.chats;
        total.reranks += t.reranks;
        total.reconnects += t.reconnects;
    }
    let load_s = started.elapsed().as_secs_f64();

    // Queues drain: what disconnected clients left behind is dropped.
    let drain = Instant::now();
    let depth = |q: &str| metric(addr, &format!("rlx_queue_depth{{queue=\"{q}\"}}"));
    while (depth("embeddings") != Some(0.0) || depth("generation") != Some(0.0)) && drain.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (embed_q, gen_q) = (depth("embeddings"), depth("generation"));
    // No sequence slot leaked: as many chats at once as there are slots all finish.
    let slots_ok = if chat {
        let chats: Vec<_> = (0..MAX_SEQUENCES)
            .map(|i| {
                std::thread::spawn(move || {
                    let body = json!({"messages": [{"role": "user", "content": format!("Count to {i}.")}], "max_tokens": 8,
                                      "temperature": 0, "ignore_eos": true})
                    .to_string();
                    let mut conn = None;
                    let mut t = Tally::default();
                    matches!(exchange(addr, &mut conn, "/v1/chat/completions", &body, &mut t), Some((200, v)) if v["usage"]["completion_tokens"] == 8)
                })
            })
            .collect();
        chats.into_iter().all(|h| h.join().unwrap_or(false))
    } else {
        true
    };
    // Idle connections close and the blocking pool's threads retire (10 s).
    std::thread::sleep(Duration::from_secs(12));
    let end = proc_sample(pid, requests);
    let samples = samples.lock().map(|mut s| std::mem::take(&mut *s)).unwrap_or_default();
    let first = &samples[0];
    // Shape buckets (embedding batches, chat prefills) compile on first use,
    // and the rarer ones first come up well into the run: memory is judged
    // from a quarter of the way in by default.
    let warmup = env_usize("SOAK_WARMUP", requests / 4);
    let warm = samples.iter().find(|s| s.requests >= warmup).unwrap_or(first);
    let growth = end.rss_kb as f64 / warm.rss_kb.max(1) as f64 - 1.0;
    let peak_threads = samples.iter().map(|s| s.threads).max().unwrap_or(0);

    eprintln!("| figure | value |");
    eprintln!("|---|---|");
    eprintln!("| requests | {requests} ({clients} clients, chat {}) |", if chat { "on" } else { "off" });
    eprintln!("| completed and checked / wrong | {} / {} |", total.ok + total.wrong, total.wrong);
    eprintln!("| of which chats / reranks | {} / {} |", total.chats, total.reranks);
    eprintln!("| disconnects (mid-body, before the answer, mid-stream) | {} |", total.disconnects);
    eprintln!("| duration | {load_s:.1} s ({:.0} requests/s) |", requests as f64 / load_s);
    eprintln!("| queue depth after the load (embeddings, generation) | {embed_q:?}, {gen_q:?} |");
    eprintln!("| {MAX_SEQUENCES} chats at once after the load | {} |", if slots_ok { "all finished" } else { "FAILED" });
    eprintln!(
        "| server RSS at start / after warm-up ({} req) / end | {} / {} / {} KB ({:+.2}% after warm-up) |",
        warm.requests,
        first.rss_kb,
        warm.rss_kb,
        end.rss_kb,
        growth * 100.0
    );
    eprintln!("| server fds start → end | {} → {} |", first.fds, end.fds);
    eprintln!("| server threads start / peak / end | {} / {peak_threads} / {} |", first.threads, end.threads);

    assert_eq!(total.wrong, 0, "wrong responses");
    assert_eq!((embed_q, gen_q), (Some(0.0), Some(0.0)), "queues did not drain");
    assert!(slots_ok, "the server could not run {MAX_SEQUENCES} chats at once after the load: a sequence slot leaked");
    assert!(growth <= 0.01, "server memory grew {:.2}% after warm-up", growth * 100.0);
    assert!(end.fds <= first.fds, "server descriptors grew from {} to {}", first.fds, end.fds);
    assert!(end.threads <= peak_threads.max(first.threads), "server threads grew");
}
