//! CPU soak: a long run of pipelined calls of a small graph across every
//! shape bucket and pipeline slot, with weight updates between calls. Every
//! output is compared with a reference computed on the host in f64 for its
//! (input, weight version); resident memory, open file descriptors and
//! threads are sampled every 10,000 calls and must stay flat after warm-up.
//!
//! Ignored by default (it runs for minutes); run it with `scripts/soak-cpu`
//! (release build). `SOAK_CALLS` sets the number of calls (default
//! 1,000,000).

use std::collections::VecDeque;

use rlx::{Activation, DType, Device, Graph, PrepareOptions, Session, Tensor, Ticket};

const IN: usize = 16;
const OUT: usize = 8;
const BUCKETS: [usize; 3] = [1, 4, 16];
const SLOTS: usize = 3;
const INPUTS_PER_BUCKET: usize = 8;
const WEIGHT_VERSIONS: usize = 4;
/// Calls between weight updates.
const UPDATE_EVERY: usize = 5_000;
const SAMPLE_EVERY: usize = 10_000;

/// Deterministic values without a random crate: a 64-bit LCG.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 11
    }
    fn f32(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }
}

fn graph(batch: usize) -> Graph {
    let mut g = Graph::new();
    let build = |g: &mut Graph| -> rlx::Result<()> {
        let x = g.input("x", [batch, IN], DType::F32)?;
        let w = g.param("w", [OUT, IN], DType::F32)?;
        let b = g.param("b", [OUT], DType::F32)?;
        let y = g.linear(x, w, Some(b), true)?;
        let y = g.activation(Activation::Relu, y)?;
        g.output(y)?;
        Ok(())
    };
    build(&mut g).unwrap_or_else(|e| panic!("graph: {e}"));
    g
}

/// relu(x · wᵀ + b) in f64.
fn reference(x: &[f32], w: &[f32], b: &[f32], batch: usize) -> Vec<f32> {
    let mut y = vec![0f32; batch * OUT];
    for r in 0..batch {
        for o in 0..OUT {
            let mut s = b[o] as f64;
            for i in 0..IN {
                s += x[r * IN + i] as f64 * w[o * IN + i] as f64;
            }
            y[r * OUT + o] = s.max(0.0) as f32;
        }
    }
    y
}

struct Sample {
    calls: usize,
    rss_kb: u64,
    fds: usize,
    threads: u64,
}

fn sample(calls: usize) -> Sample {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        status.lines().find(|l| l.starts_with(k)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0)
    };
    let fds = std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    Sample { calls, rss_kb: field("VmRSS:"), fds, threads: field("Threads:") }
}

#[test]
#[ignore = "minutes long: run scripts/soak-cpu"]
fn soak_cpu_pipelined_calls_with_weight_updates() {
    let calls: usize = std::env::var("SOAK_CALLS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let mut rng = Lcg(0x5eed);
    let versions: Vec<(Vec<f32>, Vec<f32>)> =
        (0..WEIGHT_VERSIONS).map(|_| ((0..OUT * IN).map(|_| rng.f32()).collect(), (0..OUT).map(|_| rng.f32()).collect())).collect();
    let tensor = |shape: Vec<usize>, v: &[f32]| Tensor::from_f32(shape, v).unwrap_or_else(|e| panic!("{e}"));

    let mut session = Session::new(Device::Cpu).unwrap_or_else(|e| panic!("{e}"));
    session.set_prepare_options(PrepareOptions { slots: SLOTS, ..session.prepare_options().clone() });
    let set_version = |session: &Session, v: usize| {
        session.set_weight("w", tensor(vec![OUT, IN], &versions[v].0)).unwrap_or_else(|e| panic!("{e}"));
        session.set_weight("b", tensor(vec![OUT], &versions[v].1)).unwrap_or_else(|e| panic!("{e}"));
    };
    set_version(&session, 0);
    let mut exes: Vec<_> = BUCKETS.iter().map(|&b| session.compile(&graph(b)).unwrap_or_else(|e| panic!("{e}"))).collect();
    // Inputs per bucket, and every (bucket, input, version) reference.
    let inputs: Vec<Vec<Vec<f32>>> =
        BUCKETS.iter().map(|&b| (0..INPUTS_PER_BUCKET).map(|_| (0..b * IN).map(|_| rng.f32()).collect()).collect()).collect();
    let input_tensors: Vec<Vec<Tensor>> =
        inputs.iter().zip(BUCKETS).map(|(xs, b)| xs.iter().map(|x| tensor(vec![b, IN], x)).collect()).collect();
    let refs: Vec<Vec<Vec<Vec<f32>>>> = inputs
        .iter()
        .zip(BUCKETS)
        .map(|(xs, b)| xs.iter().map(|x| versions.iter().map(|(w, bias)| reference(x, w, bias, b)).collect()).collect())
        .collect();

    // In flight: (bucket, ticket, input index, weight version).
    let mut in_flight: VecDeque<(usize, Ticket, usize, usize)> = VecDeque::new();
    let mut version = 0;
    let (mut wrong, mut checked) = (0usize, 0usize);
    let mut samples = vec![sample(0)];
    let mut check = |exes: &mut Vec<rlx::CompiledGraph>, (k, ticket, i, v): (usize, Ticket, usize, usize)| {
        let out = exes[k].wait(ticket).unwrap_or_else(|e| panic!("wait: {e}"));
        let got = out[0].to_f32();
        let want = &refs[k][i][v];
        let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        if got.len() != want.len() || worst > 1e-5 {
            wrong += 1;
            if wrong <= 5 {
                eprintln!("wrong result: bucket {} input {i} version {v}: worst difference {worst}", BUCKETS[k]);
            }
        }
        checked += 1;
    };
    for call in 0..calls {
        if call > 0 && call % UPDATE_EVERY == 0 {
            // Weights change only between calls: collect what is in flight.
            while let Some(t) = in_flight.pop_front() {
                check(&mut exes, t);
            }
            version = (version + 1) % WEIGHT_VERSIONS;
            set_version(&session, version);
        }
        let k = (rng.next() % BUCKETS.len() as u64) as usize;
        let i = (rng.next() % INPUTS_PER_BUCKET as u64) as usize;
        // An executable takes at most SLOTS calls at once: wait for its oldest.
        if in_flight.iter().filter(|t| t.0 == k).count() == SLOTS {
            let at = in_flight.iter().position(|t| t.0 == k).unwrap_or(0);
            if let Some(t) = in_flight.remove(at) {
                check(&mut exes, t);
            }
        }
        let ticket = exes[k].submit(&[("x", &input_tensors[k][i])]).unwrap_or_else(|e| panic!("submit: {e}"));
        in_flight.push_back((k, ticket, i, version));
        if (call + 1) % SAMPLE_EVERY == 0 {
            samples.push(sample(call + 1));
        }
    }
    while let Some(t) = in_flight.pop_front() {
        check(&mut exes, t);
    }
    samples.push(sample(calls));

    for s in &samples {
        eprintln!("calls {:>9}  rss {:>8} KB  fds {:>3}  threads {:>3}", s.calls, s.rss_kb, s.fds, s.threads);
    }
    let warm = samples.iter().find(|s| s.calls >= calls / 10).unwrap_or(&samples[0]);
    let last = samples.last().unwrap_or(&samples[0]);
    let growth = last.rss_kb as f64 / warm.rss_kb.max(1) as f64 - 1.0;
    eprintln!(
        "soak: {calls} calls, {checked} checked, {wrong} wrong; rss {} KB after warm-up ({} calls) -> {} KB at the end ({:+.2}%); fds {} -> {}; threads {} -> {}",
        warm.rss_kb,
        warm.calls,
        last.rss_kb,
        growth * 100.0,
        warm.fds,
        last.fds,
        warm.threads,
        last.threads
    );
    assert_eq!(checked, calls);
    assert_eq!(wrong, 0, "wrong results");
    assert!(growth <= 0.01, "resident memory grew {:.2}% after warm-up", growth * 100.0);
    assert!(last.fds <= warm.fds && last.threads <= warm.threads, "descriptors or threads grew");
}
