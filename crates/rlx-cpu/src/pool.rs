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

use std::sync::{Arc, OnceLock};

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
}
