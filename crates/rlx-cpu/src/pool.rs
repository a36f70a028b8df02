//! The CPU backend's worker threads: one rayon pool shared by every
//! `CpuBackend::new()`, each worker pinned to a CPU of its own.
//!
//! Why pin: between calls the workers sleep, and a call that woke them after
//! an idle pause ran at one-core speed although both workers accumulated
//! equal CPU time. The likely cause (inferred, not traced) is the scheduler
//! placing both woken workers on one CPU. Pinning removed it, measured on
//! the 2-vCPU VM (MiniLM f32, 50 ms idle before each call,
//! medians of 20): 1×16 3.69 → 2.3 ms and 1×128 17.7 → 10.0 ms with pinned
//! workers; back to back (no idle) nothing changes. `RLX_CPU_PIN=0` turns it
//! off (e.g. when several processes share the CPUs and each should float).
//! Workers are spread over the CPUs the process may run on (its affinity
//! mask), so `taskset` and container limits are respected.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rayon::{ThreadPool, ThreadPoolBuilder};

/// Threads for the shared pool: `RAYON_NUM_THREADS` when set (the usual
/// convention), else one per CPU the process may run on.
fn default_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or_else(|| {
        let allowed = allowed_cpus().len();
        if allowed > 0 {
            allowed
        } else {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        }
    })
}

/// A pool of `n` workers named `rlx-cpu-<i>`, each pinned to a CPU with `pin`.
pub fn build(n: usize, pin: bool) -> Result<ThreadPool, String> {
    let cpus = if pin { allowed_cpus() } else { Vec::new() };
    ThreadPoolBuilder::new()
        .num_threads(n.max(1))
        .thread_name(|i| format!("rlx-cpu-{i}"))
        .start_handler(move |i| {
            if let Some(&cpu) = cpus.get(i % cpus.len().max(1)) {
                pin_current_thread(cpu);
            }
        })
        .build()
        .map_err(|e| format!("could not start {n} CPU worker threads: {e}"))
}

/// The pool every `CpuBackend::new()` shares, started on first use (with
/// that caller's `pin`: process-wide by nature).
pub fn shared(pin: bool) -> Result<Arc<ThreadPool>, String> {
    static POOL: OnceLock<Result<Arc<ThreadPool>, String>> = OnceLock::new();
    POOL.get_or_init(|| build(default_threads(), pin).map(Arc::new)).clone()
}

/// How long a kept-awake worker spins with nothing to run before it lets
/// itself sleep: a decode step's gaps between parallel kernels are tens of
/// microseconds.
const MAX_SPIN: Duration = Duration::from_micros(200);

/// Calls of `with_hot_workers` in flight in this process, with or
/// without spinners of their own.
static CALLS: AtomicUsize = AtomicUsize::new(0);

/// One call on `CALLS` for as long as it lives (a panicking call too).
struct Counted;

impl Counted {
    /// Counts a call in; true if it is the only one.
    fn enter() -> (Counted, bool) {
        (Counted, CALLS.fetch_add(1, Ordering::AcqRel) == 0)
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        CALLS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Sets the flag on drop (a call's end, a panic too: its spinners stop).
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Runs `f` on the current rayon pool with its other workers kept awake
/// until `f` returns: each spins, running any job the pool has (the
/// halves of `f`'s parallel loops) as soon as it appears. A worker left
/// idle falls asleep within microseconds, and waking it costs tens of
/// microseconds on a VM: more than a decode step's small matvecs take.
/// With every worker asleep between kernels, a step's parallel loops ran on
/// one thread.
///
/// Only a call alone in the process gets spinners, and they stop as soon
/// as another call starts: a spinner waits for its call to end, so two
/// calls' spinners, each stacked on a worker above a frame of the other
/// call, would wait on each other. A worker that finds nothing to run for
/// `MAX_SPIN` stops too (a long one-thread stretch, e.g. a big attention,
/// would only burn its CPU). Called off a pool thread, or with one worker,
/// it just runs `f`.
pub fn with_hot_workers<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let me = rayon::current_thread_index();
    if me.is_none() || rayon::current_num_threads() < 2 {
        return f();
    }
    let (_counted, alone) = Counted::enter();
    if !alone {
        return f();
    }
    let done = AtomicBool::new(false);
    rayon::scope(|s| {
        s.spawn_broadcast(|_, ctx| {
            if Some(ctx.index()) == me {
                return;
            }
            let mut idle_since = Instant::now();
            while !done.load(Ordering::Acquire) && CALLS.load(Ordering::Acquire) == 1 {
                if rayon::yield_now() == Some(rayon::Yield::Executed) {
                    idle_since = Instant::now();
                } else if idle_since.elapsed() > MAX_SPIN {
                    return;
                } else {
                    std::hint::spin_loop();
                }
            }
        });
        // The call is done before the scope waits for its spinners.
        let _done = SetOnDrop(&done);
        f()
    })
}

/// CPUs in this process's affinity mask, ascending (empty if unknown).
#[cfg(target_os = "linux")]
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its
    // size, and CPU_ISSET reads within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
    }
}

#[cfg(not(target_os = "linux"))]
fn allowed_cpus() -> Vec<usize> {
    Vec::new()
}

/// Restricts the calling thread to `cpu`; a failure (e.g. the CPU went
/// offline) leaves it unpinned, which is only slower.
#[cfg(target_os = "linux")]
fn pin_current_thread(cpu: usize) {
    // SAFETY: as above; pid 0 is the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_current_thread(_cpu: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_spread_over_the_allowed_cpus() {
        let cpus = allowed_cpus();
        let n = 3;
        let pool = build(n, true).unwrap_or_else(|e| panic!("{e}"));
        let seen: Vec<Vec<usize>> = pool.broadcast(|_| allowed_cpus());
        assert_eq!(seen.len(), n);
        if cfg!(target_os = "linux") && !cpus.is_empty() {
            for (i, s) in seen.iter().enumerate() {
                assert_eq!(s, &vec![cpus[i % cpus.len()]], "worker {i}");
            }
        }
        // The building thread itself stays unpinned.
        assert_eq!(allowed_cpus(), cpus);
    }

    /// Calls that keep the workers awake, from many threads at once on one
    /// pool, nested inside a parallel loop, off any pool and after a call
    /// that panicked: all finish with the right sums. Each call runs long
    /// enough (a few ms) for calls to overlap. A call left waiting on
    /// another (or a spinner never told to stop) would hang: a watchdog
    /// fails the test after two minutes instead.
    #[test]
    fn hot_worker_calls_finish_concurrently_nested_and_after_a_panic() {
        use rayon::prelude::*;
        let finished = Arc::new(AtomicBool::new(false));
        let watch = Arc::clone(&finished);
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(120));
            if !watch.load(Ordering::Acquire) {
                eprintln!("hot-worker calls still running after 120 s: a call is waiting on another");
                std::process::abort();
            }
        });
        let pool = Arc::new(build(3, false).unwrap_or_else(|e| panic!("{e}")));
        let n = 400_000u64;
        let want: u64 = (0..n).map(|i| i % 7).sum();
        let sum = move || with_hot_workers(|| (0..n).into_par_iter().map(|i| i % 7).sum::<u64>());
        let callers: Vec<_> = (0..6)
            .map(|c| {
                let pool = Arc::clone(&pool);
                std::thread::spawn(move || {
                    for i in 0..20 {
                        assert_eq!(pool.install(sum), want);
                        if (c + i) % 3 == 0 {
                            let nested: Vec<u64> = pool.install(|| (0..4).into_par_iter().map(|_| sum()).collect());
                            assert_eq!(nested, vec![want; 4]);
                        }
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap_or_else(|_| panic!("a caller panicked"));
        }
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| with_hot_workers(|| -> u64 { panic!("inside the call") }))
        }));
        assert!(panicked.is_err());
        assert_eq!(pool.install(sum), want);
        assert_eq!(sum(), want);
        assert_eq!(with_hot_workers(|| 7), 7);
        finished.store(true, Ordering::Release);
    }
}
