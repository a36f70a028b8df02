//! The CPU executable: one persistent worker thread per executable runs
//! submissions in order (so state stays consistent), each in its pipeline
//! slot's arena. `submit` hands the worker a job and returns a ticket;
//! `wait` collects the result. `run` with nothing in flight skips the
//! hand-off and runs on the calling thread (the worker's state sits behind
//! a mutex that only one of them holds at a time).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rlx_runtime::{check_inputs, ExecStats, Executable, RuntimeError, StateSet, Tensor, Ticket, WeightStore};
use rlx_schedule::{Schedule, Space, TensorSlot, Thunk};

use crate::kernels;
use crate::kernels::matmul::WeightCopy;
use crate::memory::{AlignedBuf, Mem, Region};
use crate::validate::validate_thunk;
use crate::{exec_err, Result, Scratch};

/// Ticket ids are unique across executables, so a ticket from another
/// executable is recognised as foreign.
static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);

/// A weight as the kernels see it: the store's tensor, or an aligned copy
/// when the tensor's bytes are not aligned for its element type.
enum WeightMem {
    Shared(Arc<Tensor>),
    Copied(AlignedBuf),
}

impl WeightMem {
    fn new(t: Arc<Tensor>, name: &str) -> Result<WeightMem> {
        // Element sizes are powers of two.
        if t.bytes().as_ptr() as usize & (t.dtype().size() - 1) == 0 {
            return Ok(WeightMem::Shared(t));
        }
        AlignedBuf::from_bytes(t.bytes()).map(WeightMem::Copied).ok_or_else(|| exec_err(format!("out of memory copying weight '{name}'")))
    }
    fn region(&self) -> Region {
        match self {
            WeightMem::Shared(t) => Region::borrowed(t.bytes()),
            WeightMem::Copied(b) => b.region(),
        }
    }
}

enum Job {
    Run { id: u64, slot: usize, inputs: Vec<Tensor>, weights: Option<Vec<Arc<Tensor>>> },
    Reset(Sender<()>),
    ReadState(usize, Sender<Result<Tensor>>),
}

struct Done {
    id: u64,
    result: Result<Vec<Tensor>>,
    host_time: Duration,
}

/// Everything the worker thread owns.
struct Worker {
    schedule: Arc<Schedule>,
    arenas: Vec<AlignedBuf>,
    /// Shared with the other executables of a [`StateSet`] when bound to one.
    states: Vec<Arc<AlignedBuf>>,
    /// Where each state lies in its buffer (`PrepareOptions::state_block`).
    state_offsets: Vec<usize>,
    consts: Vec<AlignedBuf>,
    weights: Vec<WeightMem>,
    /// Per thunk: f32 copy of a half-precision matmul weight.
    b_cache: Vec<Option<WeightCopy>>,
    scratch: Scratch,
    pool: Option<Arc<rayon::ThreadPool>>,
    /// RLX_PROFILE: print host time per thunk kind after every call.
    profile: bool,
    /// Set when rebinding changed weights failed, so the next call tries
    /// again instead of running on the old binding because the store's
    /// version already looked seen.
    rebind_failed: Arc<AtomicBool>,
}

fn alloc(bytes: u64, what: &str) -> Result<AlignedBuf> {
    usize::try_from(bytes)
        .ok()
        .and_then(AlignedBuf::zeroed)
        .ok_or_else(|| exec_err(format!("{what}: out of memory: could not allocate {bytes} bytes")))
}

/// The machine's physical memory in bytes (Linux: MemTotal), if known.
fn physical_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = info.lines().find(|l| l.starts_with("MemTotal:"))?.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// Refuses an executable whose arenas and states together exceed the
/// machine's physical memory: with overcommit such an allocation can
/// succeed and then kill the process when its pages are first touched.
fn check_fits(schedule: &Schedule, slots: usize) -> Result<()> {
    let arenas = schedule.arena_bytes.checked_mul(slots as u64);
    let wanted = schedule.states.iter().try_fold(arenas.unwrap_or(u64::MAX), |sum, s| sum.checked_add(s.buf.bytes)).unwrap_or(u64::MAX);
    match physical_memory() {
        Some(total) if wanted > total => Err(exec_err(format!(
            "out of memory: {slots} arena(s) of {} bytes and {} state buffer(s) need {wanted} bytes, more than this machine's {total} bytes",
            schedule.arena_bytes,
            schedule.states.len(),
        ))),
        _ => Ok(()),
    }
}

fn resolve_all(schedule: &Schedule, store: &WeightStore) -> Result<Vec<Arc<Tensor>>> {
    schedule.weights.iter().map(|w| store.resolve(w)).collect()
}

impl Worker {
    fn new(
        schedule: Arc<Schedule>,
        store: &WeightStore,
        shared_states: Option<&Arc<StateSet>>,
        state_block: u64,
        slots: usize,
        pool: Option<Arc<rayon::ThreadPool>>,
        profile: bool,
    ) -> Result<Worker> {
        check_fits(&schedule, slots)?;
        let arenas = (0..slots).map(|i| alloc(schedule.arena_bytes, &format!("arena of slot {i}"))).collect::<Result<Vec<_>>>()?;
        if state_block > 0 && shared_states.is_none() {
            return Err(exec_err(format!("state block {state_block} needs states shared through a StateSet")));
        }
        let mut state_offsets = Vec::with_capacity(schedule.states.len());
        let states = schedule
            .states
            .iter()
            .map(|s| {
                // Block b of a shared buffer: bytes b·size .. (b + 1)·size.
                let at = state_block.checked_mul(s.buf.bytes).filter(|&a| a.checked_add(s.buf.bytes).is_some());
                let at = at.ok_or_else(|| exec_err(format!("state '{}': block {state_block} overflows", s.name)))?;
                state_offsets.push(at as usize);
                let make = || alloc(at + s.buf.bytes, &format!("state '{}'", s.name));
                match shared_states {
                    Some(set) => set.get_or_create("cpu", &s.name, at + s.buf.bytes, make),
                    None => make().map(Arc::new),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let consts = schedule
            .consts
            .iter()
            .enumerate()
            .map(|(i, c)| AlignedBuf::from_bytes(&c.data).ok_or_else(|| exec_err(format!("out of memory for const {i}"))))
            .collect::<Result<Vec<_>>>()?;
        let mut w = Worker {
            schedule,
            arenas,
            states,
            state_offsets,
            consts,
            weights: Vec::new(),
            b_cache: Vec::new(),
            scratch: Scratch::default(),
            pool,
            profile,
            rebind_failed: Arc::new(AtomicBool::new(false)),
        };
        w.bind_weights(resolve_all(&w.schedule, store)?)?;
        w.validate_slots()?;
        Ok(w)
    }

    fn mem(&self, slot: usize) -> Mem {
        Mem {
            arena: self.arenas.get(slot).map(|a| a.region()).unwrap_or(Region::borrowed(&[])),
            weights: self.weights.iter().map(|w| w.region()).collect(),
            states: self
                .states
                .iter()
                .zip(&self.state_offsets)
                .zip(&self.schedule.states)
                .map(|((b, &at), s)| b.view(at, s.buf.bytes as usize).unwrap_or(Region::borrowed(&[])))
                .collect(),
            consts: self.consts.iter().map(|c| c.region()).collect(),
        }
    }

    /// Binds (new versions of) the weights, re-checks every thunk against
    /// them and rebuilds the f32 caches of half-precision matmul weights.
    fn bind_weights(&mut self, tensors: Vec<Arc<Tensor>>) -> Result<()> {
        let mut weights = Vec::with_capacity(tensors.len());
        for (t, slot) in tensors.into_iter().zip(&self.schedule.weights) {
            weights.push(WeightMem::new(t, &slot.name)?);
        }
        let old = std::mem::replace(&mut self.weights, weights);
        match self.weight_caches() {
            Ok(cache) => {
                self.b_cache = cache;
                Ok(())
            }
            Err(e) => {
                // Keep the previous binding whole rather than half-updated.
                self.weights = old;
                Err(e)
            }
        }
    }

    /// Validates every thunk and prepares each matmul's weight operand: the
    /// packed layout where the packed kernel runs, an f32 copy of a half
    /// weight elsewhere. Both are shared process-wide by every executable
    /// reading the same store tensor (see `widened.rs`).
    fn weight_caches(&self) -> Result<Vec<Option<WeightCopy>>> {
        use kernels::matmul;
        let mem = self.mem(0);
        let mut cache = Vec::with_capacity(self.schedule.thunks.len());
        for (i, t) in self.schedule.thunks.iter().enumerate() {
            validate_thunk(t, &mem).map_err(|e| exec_err(format!("thunk #{i} ({}): {e}", t.kind())))?;
            let Thunk::MatMul(mm) = t else {
                cache.push(None);
                continue;
            };
            let tensor = match mm.b.space {
                Space::Weight(w) => match self.weights.get(w as usize) {
                    Some(WeightMem::Shared(t)) => Some(t),
                    _ => None,
                },
                _ => None,
            };
            let share = |layout: [usize; 3], elems: usize, make: &dyn Fn() -> Result<Vec<f32>>| -> Result<Arc<Vec<f32>>> {
                match tensor {
                    Some(t) => crate::widened::shared(t, mm.dtype, mm.b.offset, elems, layout, make),
                    None => make().map(Arc::new),
                }
            };
            cache.push(if matmul::wants_packed(mm) {
                let elems = crate::kernels::matmul_small::packed_len(mm.n, mm.k);
                Some(WeightCopy::Packed(share([mm.n, mm.k, mm.ldb as usize], elems, &|| matmul::packed_weight(mm, &mem))?))
            } else if matmul::needs_weight_cache(mm) {
                let make = || matmul::weight_cache(mm, &mem)?.ok_or_else(|| exec_err("no f32 copy for this matmul weight"));
                Some(WeightCopy::Plain(share([0, 0, 0], matmul::weight_cache_len(mm), &make)?))
            } else {
                None
            });
        }
        Ok(cache)
    }

    /// Inputs, outputs and states must lie where the schedule says.
    fn validate_slots(&self) -> Result<()> {
        let mem = self.mem(0);
        let check = |kind: &str, s: &TensorSlot, writable: bool| -> Result<()> {
            let need = (s.shape.numel() * s.dtype.size()) as u64;
            if s.buf.bytes < need {
                return Err(exec_err(format!(
                    "{kind} '{}' ({} {}) needs {need} bytes, its buffer has {}",
                    s.name, s.shape, s.dtype, s.buf.bytes
                )));
            }
            let r = if writable { mem.dst::<u8>(&s.buf).map(|_| ()) } else { mem.check(&s.buf, 1) };
            r.map_err(|e| exec_err(format!("{kind} '{}': {e}", s.name)))
        };
        for s in &self.schedule.inputs {
            check("input", s, true)?;
        }
        for s in &self.schedule.outputs {
            check("output", s, false)?;
        }
        for (i, s) in self.schedule.states.iter().enumerate() {
            if s.buf.space != Space::State(i as u32) || s.buf.offset != 0 {
                return Err(exec_err(format!(
                    "state '{}' must be the whole of Space::State({i}), found {:?} at offset {}",
                    s.name, s.buf.space, s.buf.offset
                )));
            }
        }
        Ok(())
    }

    fn run(&mut self, slot: usize, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let mem = self.mem(slot);
        for (s, t) in self.schedule.inputs.iter().zip(inputs) {
            let d = mem.dst::<u8>(&s.buf).map_err(exec_err)?;
            // SAFETY: nothing runs in this slot while inputs are staged.
            unsafe { d.row_mut(0, t.bytes().len()) }.copy_from_slice(t.bytes());
        }
        let threads = self.pool.as_ref().map(|p| p.current_num_threads()).unwrap_or_else(rayon::current_num_threads);
        let (schedule, scratch, cache) = (&self.schedule, &mut self.scratch, &self.b_cache);
        let profile = self.profile;
        let body = || -> Result<()> {
            let mut per: std::collections::BTreeMap<&str, (Duration, usize)> = Default::default();
            let start = Instant::now();
            for (i, t) in schedule.thunks.iter().enumerate() {
                let b = cache.get(i).and_then(|c| c.as_ref());
                let t0 = profile.then(Instant::now);
                let r = kernels::run(t, &mem, scratch, b, threads);
                if let Some(t0) = t0 {
                    let e = per.entry(t.kind()).or_default();
                    e.0 += t0.elapsed();
                    e.1 += 1;
                }
                r.map_err(|e| match e {
                    RuntimeError::Backend { backend, detail } => {
                        RuntimeError::Backend { backend, detail: format!("thunk #{i} ({}): {detail}", t.kind()) }
                    }
                    other => other,
                })?;
            }
            if profile {
                let list: Vec<String> = per.iter().map(|(k, (d, n))| format!("{k} {:.1}us/{n}", d.as_secs_f64() * 1e6)).collect();
                eprintln!("rlx-cpu profile: total {:.1}us: {}", start.elapsed().as_secs_f64() * 1e6, list.join(", "));
            }
            Ok(())
        };
        // Run the whole call on a pool thread, so every parallel loop in it
        // forks locally instead of waking the pool once per thunk.
        match &self.pool {
            Some(p) => p.install(|| crate::pool::with_hot_workers(body))?,
            None => rayon::scope(|_| crate::pool::with_hot_workers(body))?,
        }
        self.schedule
            .outputs
            .iter()
            .map(|s| {
                let n = s.shape.numel() * s.dtype.size();
                let src = mem.src::<u8>(&s.buf).map_err(exec_err)?;
                Tensor::from_bytes(s.shape.clone(), s.dtype, src.row(0, n).to_vec())
            })
            .collect()
    }

    /// Rebinds the weights when given, then runs one call.
    fn call(&mut self, slot: usize, inputs: &[&Tensor], weights: Option<Vec<Arc<Tensor>>>) -> Result<Vec<Tensor>> {
        if let Some(w) = weights {
            if let Err(e) = self.bind_weights(w) {
                self.rebind_failed.store(true, Ordering::Release);
                return Err(e);
            }
        }
        self.run(slot, inputs)
    }

    fn serve(shared: Arc<Mutex<Worker>>, jobs: Receiver<Job>, done: Sender<Done>) {
        while let Ok(job) = jobs.recv() {
            let Ok(mut guard) = shared.lock() else { return };
            let this = &mut *guard;
            match job {
                Job::Run { id, slot, inputs, weights } => {
                    let t0 = Instant::now();
                    let refs: Vec<&Tensor> = inputs.iter().collect();
                    let result = this.call(slot, &refs, weights);
                    if done.send(Done { id, result, host_time: t0.elapsed() }).is_err() {
                        return;
                    }
                }
                Job::Reset(reply) => {
                    for ((b, &at), s) in this.states.iter().zip(&this.state_offsets).zip(&this.schedule.states) {
                        b.zero_range(at, s.buf.bytes as usize);
                    }
                    let _ = reply.send(());
                }
                Job::ReadState(i, reply) => {
                    let r = match (this.schedule.states.get(i), this.states.get(i), this.state_offsets.get(i)) {
                        (Some(s), Some(b), Some(&at)) => Tensor::from_bytes(
                            s.shape.clone(),
                            s.dtype,
                            b.bytes()[at.min(b.len())..(at + s.shape.numel() * s.dtype.size()).min(b.len())].to_vec(),
                        ),
                        _ => Err(exec_err(format!("no state #{i}"))),
                    };
                    let _ = reply.send(r);
                }
            }
        }
    }
}

enum SlotState {
    Free,
    /// A submitted call; the flag is set when its ticket was dropped.
    Pending {
        id: u64,
        abandoned: Arc<AtomicBool>,
    },
}

/// See the module docs.
pub struct CpuExecutable {
    schedule: Arc<Schedule>,
    store: Arc<WeightStore>,
    weight_version: u64,
    rebind_failed: Arc<AtomicBool>,
    slots: Vec<SlotState>,
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    ready: HashMap<u64, Result<Vec<Tensor>>>,
    /// Owned by the worker thread between jobs; `run` borrows it directly
    /// when nothing is in flight.
    shared: Arc<Mutex<Worker>>,
    worker: Option<JoinHandle<()>>,
    stats: ExecStats,
}

impl CpuExecutable {
    pub(crate) fn new(
        schedule: Arc<Schedule>,
        store: Arc<WeightStore>,
        states: Option<&Arc<StateSet>>,
        state_block: u64,
        slots: usize,
        pool: Option<Arc<rayon::ThreadPool>>,
        profile: bool,
    ) -> Result<CpuExecutable> {
        let weight_version = store.version();
        // Fused thunks run as their parts, each a thunk of its own with its
        // matmul's weight copy: the reference they are checked against.
        let parts = Arc::new(schedule.expand(|_| false));
        let kernels_per_call = parts.thunks.len();
        let worker = Worker::new(parts, &store, states, state_block, slots, pool, profile)?;
        let rebind_failed = worker.rebind_failed.clone();
        let shared = Arc::new(Mutex::new(worker));
        let (job_tx, job_rx) = channel();
        let (done_tx, done_rx) = channel();
        let for_thread = shared.clone();
        let handle = std::thread::Builder::new()
            .name("rlx-cpu-exec".into())
            .spawn(move || Worker::serve(for_thread, job_rx, done_tx))
            .map_err(|e| exec_err(format!("could not start the executable's worker thread: {e}")))?;
        let stats = ExecStats {
            calls: 0,
            kernels_per_call,
            arena_bytes: schedule.arena_bytes,
            slots,
            last_host_time: Duration::ZERO,
            mode: "cpu".into(),
        };
        Ok(CpuExecutable {
            schedule,
            store,
            weight_version,
            rebind_failed,
            slots: (0..slots).map(|_| SlotState::Free).collect(),
            jobs: Some(job_tx),
            done: done_rx,
            ready: HashMap::new(),
            shared,
            worker: Some(handle),
            stats,
        })
    }

    fn send(&self, job: Job) -> Result<()> {
        self.jobs.as_ref().and_then(|j| j.send(job).ok()).ok_or_else(|| exec_err("the executable's worker thread has stopped"))
    }

    /// The weights to rebind before the next call, if the store changed.
    fn changed_weights(&mut self) -> Result<Option<Vec<Arc<Tensor>>>> {
        let version = self.store.version();
        if version == self.weight_version && !self.rebind_failed.swap(false, Ordering::AcqRel) {
            return Ok(None);
        }
        let w = resolve_all(&self.schedule, &self.store)?;
        self.weight_version = version;
        Ok(Some(w))
    }

    /// Blocks for the next finished call.
    fn recv_one(&mut self) -> Result<()> {
        let d = self.done.recv().map_err(|_| exec_err("the executable's worker thread has stopped"))?;
        self.stats.last_host_time = d.host_time;
        self.ready.insert(d.id, d.result);
        Ok(())
    }

    /// A free slot, reclaiming those whose tickets were dropped (waiting for
    /// such a call to finish only when nothing else is free).
    fn free_slot(&mut self) -> Result<usize> {
        while let Ok(d) = self.done.try_recv() {
            self.stats.last_host_time = d.host_time;
            self.ready.insert(d.id, d.result);
        }
        loop {
            let mut abandoned_pending = None;
            for (i, s) in self.slots.iter_mut().enumerate() {
                match s {
                    SlotState::Free => return Ok(i),
                    SlotState::Pending { id, abandoned } if abandoned.load(Ordering::Acquire) => {
                        if self.ready.remove(id).is_some() {
                            *s = SlotState::Free;
                            return Ok(i);
                        }
                        abandoned_pending = Some(i);
                    }
                    SlotState::Pending { .. } => {}
                }
            }
            match abandoned_pending {
                Some(_) => self.recv_one()?,
                None => return Err(RuntimeError::Busy { slots: self.slots.len() }),
            }
        }
    }
}

impl Executable for CpuExecutable {
    fn submit(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Ticket> {
        let staged: Vec<Tensor> = check_inputs(&self.schedule, inputs)?.into_iter().cloned().collect();
        let slot = self.free_slot()?;
        // Weights changed since the last call: the worker rebinds them
        // before this call, after every earlier call has finished.
        let weights = self.changed_weights()?;
        let id = NEXT_TICKET.fetch_add(1, Ordering::Relaxed);
        self.send(Job::Run { id, slot, inputs: staged, weights })?;
        let flag = Arc::new(AtomicBool::new(false));
        self.slots[slot] = SlotState::Pending { id, abandoned: flag.clone() };
        self.stats.calls += 1;
        Ok(Ticket::new(id, slot, flag))
    }

    fn wait(&mut self, ticket: Ticket) -> Result<Vec<Tensor>> {
        let (id, slot) = ticket.collect();
        match self.slots.get(slot) {
            Some(SlotState::Pending { id: pid, .. }) if *pid == id => {}
            _ => return Err(RuntimeError::BadTicket(id)),
        }
        loop {
            if let Some(r) = self.ready.remove(&id) {
                self.slots[slot] = SlotState::Free;
                return r;
            }
            self.recv_one()?;
        }
    }

    /// With nothing in flight, runs on the calling thread: no hand-off to
    /// the worker and back. Otherwise queues behind the pending calls.
    fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Vec<Tensor>> {
        let idle = self.slots.iter().all(|s| matches!(s, SlotState::Free));
        if !idle {
            let t = self.submit(inputs)?;
            return self.wait(t);
        }
        let staged = check_inputs(&self.schedule, inputs)?;
        let weights = self.changed_weights()?;
        let t0 = Instant::now();
        let result = {
            let mut w = self.shared.lock().map_err(|_| exec_err("the executable's worker panicked earlier"))?;
            w.call(0, &staged, weights)
        };
        self.stats.calls += 1;
        self.stats.last_host_time = t0.elapsed();
        result
    }

    fn reset_state(&mut self) -> Result<()> {
        let (tx, rx) = channel();
        self.send(Job::Reset(tx))?;
        rx.recv().map_err(|_| exec_err("the executable's worker thread has stopped"))
    }

    fn read_state(&mut self, name: &str) -> Result<Tensor> {
        let i = self.schedule.states.iter().position(|s| s.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.schedule.states.iter().map(|s| s.name.as_str()).collect();
            exec_err(format!("no state named '{name}' (states: {})", known.join(", ")))
        })?;
        let (tx, rx) = channel();
        self.send(Job::ReadState(i, tx))?;
        rx.recv().map_err(|_| exec_err("the executable's worker thread has stopped"))?
    }

    fn stats(&self) -> ExecStats {
        self.stats.clone()
    }

    fn schedule(&self) -> &Arc<Schedule> {
        &self.schedule
    }
}

impl Drop for CpuExecutable {
    fn drop(&mut self) {
        // Closing the job channel ends the worker after its current job.
        self.jobs = None;
        if let Some(h) = self.worker.take() {
            let _ = h.join();
        }
    }
}
