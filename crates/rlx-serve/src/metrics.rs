//! Counters behind `GET /metrics`, rendered in Prometheus' text format.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Request latency buckets, seconds.
const LATENCY_BOUNDS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Rows per coalesced embedding call / sequences per decode step.
const BATCH_BOUNDS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0];
/// Generated tokens per second are averaged over this window.
const RATE_WINDOW: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// `name_bucket{labels,le=…}` lines (cumulative), `_sum` and `_count`.
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", self.count);
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// Which queue a gauge describes.
#[derive(Debug, Clone, Copy)]
pub enum Queue {
    Embeddings,
    Generation,
}

#[derive(Debug)]
pub struct Metrics {
    /// (route, status) → requests.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// route → seconds to the response head.
    latency: Mutex<BTreeMap<String, Histogram>>,
    embed_batch_rows: Mutex<Histogram>,
    decode_batch: Mutex<Histogram>,
    /// Prompts per admission, and seconds each admission's prefill took.
    prefill_prompts: Mutex<Histogram>,
    prefill_seconds: Mutex<Histogram>,
    /// Seconds from a generation request's arrival to its first token.
    first_token: Mutex<Histogram>,
    embed_queue: AtomicU64,
    gen_queue: AtomicU64,
    embedded_tokens: AtomicU64,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    /// (when, tokens) of recent decode steps, for the tokens/s gauge.
    recent: Mutex<VecDeque<(Instant, u64)>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::default(),
            latency: Mutex::default(),
            embed_batch_rows: Mutex::new(Histogram::new(BATCH_BOUNDS)),
            decode_batch: Mutex::new(Histogram::new(BATCH_BOUNDS)),
            prefill_prompts: Mutex::new(Histogram::new(BATCH_BOUNDS)),
            prefill_seconds: Mutex::new(Histogram::new(LATENCY_BOUNDS)),
            first_token: Mutex::new(Histogram::new(LATENCY_BOUNDS)),
            embed_queue: AtomicU64::new(0),
            gen_queue: AtomicU64::new(0),
            embedded_tokens: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            recent: Mutex::default(),
        }
    }
}

/// A poisoned lock only means a panic elsewhere; counters stay usable.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Metrics {
    pub fn request(&self, route: &str, status: u16, elapsed: Duration) {
        *lock(&self.requests).entry((route.to_string(), status)).or_insert(0) += 1;
        lock(&self.latency).entry(route.to_string()).or_insert_with(|| Histogram::new(LATENCY_BOUNDS)).observe(elapsed.as_secs_f64());
    }

    fn gauge(&self, q: Queue) -> &AtomicU64 {
        match q {
            Queue::Embeddings => &self.embed_queue,
            Queue::Generation => &self.gen_queue,
        }
    }

    pub fn enqueued(&self, q: Queue) {
        self.gauge(q).fetch_add(1, Ordering::Relaxed);
    }

    pub fn dequeued(&self, q: Queue) {
        let _ = self.gauge(q).fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(1)));
    }

    pub fn queue_depth(&self, q: Queue) -> u64 {
        self.gauge(q).load(Ordering::Relaxed)
    }

    pub fn embed_batch(&self, rows: usize, tokens: usize) {
        lock(&self.embed_batch_rows).observe(rows as f64);
        self.embedded_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
    }

    pub fn prompt(&self, tokens: usize) {
        self.prompt_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// One admission: `prompts` prompts prefilled together in
    /// `took`.
    pub fn prefill(&self, prompts: usize, took: Duration) {
        lock(&self.prefill_prompts).observe(prompts as f64);
        lock(&self.prefill_seconds).observe(took.as_secs_f64());
    }

    /// A generation request's first token, `waited` after it arrived.
    pub fn first_token(&self, waited: Duration) {
        lock(&self.first_token).observe(waited.as_secs_f64());
    }

    /// One decode step (or a prefill's first token) that produced `tokens`.
    pub fn generated(&self, tokens: usize, step_rows: Option<usize>) {
        self.generated_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        if let Some(rows) = step_rows {
            lock(&self.decode_batch).observe(rows as f64);
        }
        let now = Instant::now();
        let mut r = lock(&self.recent);
        r.push_back((now, tokens as u64));
        while r.front().is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW) {
            r.pop_front();
        }
    }

    fn tokens_per_second(&self) -> f64 {
        let now = Instant::now();
        let r = lock(&self.recent);
        let n: u64 = r.iter().filter(|(t, _)| now.duration_since(*t) <= RATE_WINDOW).map(|(_, n)| n).sum();
        n as f64 / RATE_WINDOW.as_secs_f64()
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut o = String::new();
        o.push_str("# HELP rlx_requests_total HTTP requests by route and status.\n# TYPE rlx_requests_total counter\n");
        for ((route, status), n) in lock(&self.requests).iter() {
            let _ = writeln!(o, "rlx_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
        }
        o.push_str("# HELP rlx_request_duration_seconds Time from request to response head, by route.\n");
        o.push_str("# TYPE rlx_request_duration_seconds histogram\n");
        for (route, h) in lock(&self.latency).iter() {
            h.render(&mut o, "rlx_request_duration_seconds", &format!("route=\"{route}\""));
        }
        o.push_str("# HELP rlx_queue_depth Requests waiting for the model.\n# TYPE rlx_queue_depth gauge\n");
        let _ = writeln!(o, "rlx_queue_depth{{queue=\"embeddings\"}} {}", self.queue_depth(Queue::Embeddings));
        let _ = writeln!(o, "rlx_queue_depth{{queue=\"generation\"}} {}", self.queue_depth(Queue::Generation));
        for (name, help, h) in [
            ("rlx_embedding_batch_rows", "Texts per coalesced embedding call.", &self.embed_batch_rows),
            ("rlx_decode_batch_sequences", "Sequences per batched decode step.", &self.decode_batch),
            ("rlx_prefill_prompts", "Prompts taken into one admission (prefilled together).", &self.prefill_prompts),
            ("rlx_prefill_duration_seconds", "Time to prefill one admission's prompts.", &self.prefill_seconds),
            (
                "rlx_time_to_first_token_seconds",
                "Time from a generation request's arrival until the scheduler has its first token.",
                &self.first_token,
            ),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
            lock(h).render(&mut o, name, "");
        }
        let counters = [
            ("rlx_embedding_tokens_total", "Tokens embedded.", &self.embedded_tokens),
            ("rlx_prompt_tokens_total", "Prompt tokens prefilled for generation.", &self.prompt_tokens),
            ("rlx_generated_tokens_total", "Tokens generated.", &self.generated_tokens),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        }
        let _ = writeln!(
            o,
            "# HELP rlx_generated_tokens_per_second Generated tokens per second over the last {} s.\n# TYPE rlx_generated_tokens_per_second gauge\nrlx_generated_tokens_per_second {}",
            RATE_WINDOW.as_secs(),
            self.tokens_per_second()
        );
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&[1.0, 10.0]);
        for v in [0.5, 2.0, 3.0, 100.0] {
            h.observe(v);
        }
        let mut s = String::new();
        h.render(&mut s, "x", "r=\"a\"");
        assert!(s.contains("x_bucket{r=\"a\",le=\"1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{r=\"a\",le=\"10\"} 3\n"), "{s}");
        assert!(s.contains("x_bucket{r=\"a\",le=\"+Inf\"} 4\n"), "{s}");
        assert!(s.contains("x_sum{r=\"a\"} 105.5\n") && s.contains("x_count{r=\"a\"} 4\n"), "{s}");
    }

    #[test]
    fn requests_and_queues_show_in_the_text() {
        let m = Metrics::default();
        m.request("/v1/embeddings", 200, Duration::from_millis(3));
        m.request("/v1/embeddings", 200, Duration::from_millis(3));
        m.request("/v1/embeddings", 400, Duration::from_millis(1));
        m.enqueued(Queue::Generation);
        m.enqueued(Queue::Generation);
        m.dequeued(Queue::Generation);
        m.dequeued(Queue::Embeddings);
        m.generated(20, Some(4));
        m.prefill(3, Duration::from_millis(20));
        m.first_token(Duration::from_millis(30));
        let t = m.render();
        assert!(t.contains("rlx_prefill_prompts_bucket{le=\"4\"} 1\n") && t.contains("rlx_prefill_prompts_sum 3\n"), "{t}");
        assert!(t.contains("rlx_prefill_duration_seconds_bucket{le=\"0.025\"} 1\n"), "{t}");
        assert!(t.contains("rlx_time_to_first_token_seconds_bucket{le=\"0.025\"} 0\n"), "{t}");
        assert!(t.contains("rlx_time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n"), "{t}");
        assert!(t.contains("rlx_requests_total{route=\"/v1/embeddings\",status=\"200\"} 2\n"), "{t}");
        assert!(t.contains("rlx_requests_total{route=\"/v1/embeddings\",status=\"400\"} 1\n"), "{t}");
        assert!(t.contains("rlx_queue_depth{queue=\"generation\"} 1\n"), "{t}");
        assert!(t.contains("rlx_queue_depth{queue=\"embeddings\"} 0\n"), "{t}");
        assert!(t.contains("rlx_generated_tokens_total 20\n") && t.contains("rlx_generated_tokens_per_second 2\n"), "{t}");
    }
}
