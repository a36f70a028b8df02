//! The CUDA executable: one activation arena, slots (pinned staging, error
//! flag, steps, recorded segments, completion event), pipelined submit/wait,
//! replay or eager.
//!
//! One stream per executable: calls run on the device in submission order,
//! which is what state (KV caches) needs; the host does not wait for the
//! device in `submit`. State may be shared with other executables of the
//! same device through a `StateSet` (`CudaBackend::prepare_shared`). Those
//! executables also share one activation arena and cuBLASLt workspace, and
//! their calls run in submission order on the device (src/arena.rs); a
//! `submit` may wait for the set's lock while another of them prepares.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use rlx_runtime::{check_inputs, ExecStats, Executable, PrepareOptions, Result, RuntimeError, StateSet, Tensor, Ticket, WeightStore};
use rlx_schedule::{Schedule, Space, Thunk};

use crate::arena::{LastCall, SharedArena, StreamSyncGuard};
use crate::blas::{Blas, MatMulPlan};
use crate::driver::{self, err, Device, DeviceBuffer, Event, GraphExec, PinnedBuffer, Stream};
use crate::ffn;
use crate::gemm;
use crate::hostops::{self, HostTask};
use crate::launch::{self, Bases, Op, Step};
use crate::modules::Kernels;
use crate::options::CudaOptions;
use crate::record::{record, Prefetcher, Segment, PREFETCH_MAX_ROWS};
use crate::weights::DeviceWeights;

struct Pending {
    id: u64,
    abandoned: Arc<AtomicBool>,
}

struct Slot {
    // The flag is only referenced through the steps' pointers; it is held
    // here so it lives exactly as long as those steps.
    _err: DeviceBuffer,
    pin_in: PinnedBuffer,
    pin_out: PinnedBuffer,
    steps: Vec<Step>,
    segments: Vec<Segment>,
    done: Event,
    /// RLX_PROFILE: one timing event after each step, plus a start event.
    prof: Vec<Event>,
    pending: Option<Pending>,
}

/// Unique ids of executables (for `SharedArena`'s record of the last call).
static NEXT_EXECUTABLE: AtomicU64 = AtomicU64::new(1);

pub struct CudaExecutable {
    dev: Arc<Device>,
    /// This executable's id in its state set's record of the last call.
    uid: u64,
    /// Shared with the other executables of its state set, if any.
    set: Option<Arc<SharedArena>>,
    schedule: Arc<Schedule>,
    store: Arc<WeightStore>,
    weights: Arc<DeviceWeights>,
    _weight_bufs: Vec<Arc<DeviceBuffer>>,
    /// Shared with the other executables of a state set, if any.
    states: Vec<Arc<DeviceBuffer>>,
    /// Where each state lies in its buffer (`PrepareOptions::state_block`).
    state_at: Vec<u64>,
    _consts: Vec<DeviceBuffer>,
    _plans: Vec<Option<Arc<MatMulPlan>>>,
    _blas: Arc<Blas>,
    /// Feed-forward blocks (FFN1, FFN2, norm) run by the fused kernel (src/ffn.rs).
    fused_ffns: usize,
    /// Per MatMul thunk: what runs it and how many cuBLASLt candidates were timed.
    matmul_choices: Vec<(String, usize)>,
    // Drop synchronises the stream before any of these buffers are freed.
    slots: Vec<Slot>,
    /// The activation arena, shared by the slots (see `prepare`); None
    /// when it is the state set's (`set`).
    _arena: Option<DeviceBuffer>,
    /// The split-key attention appends' scratch, shared by the slots.
    _split: Option<DeviceBuffer>,
    /// The L2 access policy window over the arena: (bytes, hit ratio).
    l2_window: Option<(usize, f32)>,
    stream: Stream,
    /// (offset, bytes) of each input in pin_in and each output in pin_out.
    in_layout: Vec<(usize, usize)>,
    out_layout: Vec<(usize, usize)>,
    /// Where the copied-back error flag sits in pin_out.
    flag_off: usize,
    replay: bool,
    trace: bool,
    profile: bool,
    next_id: u64,
    next_slot: usize,
    stats: ExecStats,
    /// Host time of the last submit's phases: check, stage, launch, record.
    phases: [Duration; 4],
}

fn layout(sizes: impl Iterator<Item = usize>) -> (Vec<(usize, usize)>, usize) {
    let mut off = 0;
    let mut v = Vec::new();
    for s in sizes {
        v.push((off, s));
        off += s.div_ceil(16) * 16;
    }
    (v, off)
}

fn check_buf(
    what: &str,
    b: &rlx_schedule::BufRef,
    arena: u64,
    weights: &[Arc<DeviceBuffer>],
    states: &[u64],
    consts: &[DeviceBuffer],
) -> Result<()> {
    let cap = match b.space {
        Space::Arena => Some(arena),
        Space::Weight(i) => weights.get(i as usize).map(|w| w.bytes),
        Space::State(i) => states.get(i as usize).copied(),
        Space::Const(i) => consts.get(i as usize).map(|w| w.bytes),
    };
    match cap {
        // checked_add: a lying schedule must fail here, not wrap.
        Some(c) if b.offset.checked_add(b.bytes).is_some_and(|end| end <= c) => Ok(()),
        Some(c) => Err(err(format!("{what}: {} bytes at offset {} of {:?} overrun its {c} bytes", b.bytes, b.offset, b.space))),
        None => Err(err(format!("{what}: {:?} does not exist in this schedule", b.space))),
    }
}

impl CudaExecutable {
    pub(crate) fn new(
        dev: Arc<Device>,
        kernels: &Kernels,
        schedule: Arc<Schedule>,
        store: Arc<WeightStore>,
        shared: Option<&Arc<StateSet>>,
        opts: &PrepareOptions,
        cuda: &CudaOptions,
    ) -> Result<CudaExecutable> {
        let begun = Instant::now();
        dev.bind()?;
        let replay = opts.replay && cuda.replay;
        let (trace, profile) = (cuda.trace, cuda.profile);
        let nslots = opts.slots.max(1);
        // Memset nodes that cuBLASLt records become kernel nodes.
        let fill = Some(kernels.get("fill_pitched")?);
        // Programmatic dependent launch between consecutive kernels (Hopper
        // and later).
        let pdl = dev.cc.0 >= 9;
        // Recorded graphs prefetch the weight of each matmul of at most
        // PREFETCH_MAX_ROWS rows into L2 beside the forward (`record`).
        let l2_prefetch = dev.cc.0 >= 9;
        for t in &schedule.thunks {
            if let Some(why) = launch::unsupported(t) {
                return Err(RuntimeError::Unsupported { backend: "cuda".into(), thunk: t.kind().into(), detail: why });
            }
            hostops::check_sizes(t)?;
        }
        // An arena larger than the whole device is refused before any
        // buffer or matmul plan is made for it.
        let (free, total) = dev.mem_info()?;
        if schedule.arena_bytes > total {
            return Err(RuntimeError::OutOfMemory { requested: schedule.arena_bytes, free });
        }

        let t_weights = Instant::now();
        let weights = DeviceWeights::for_store(&dev, &store)?;
        let weight_bufs = weights.bind(&store, &schedule.weights)?;
        let weights_took = t_weights.elapsed();
        let mut states = Vec::new();
        let mut state_at = Vec::new();
        if opts.state_block > 0 && shared.is_none() {
            return Err(err(format!("state block {} needs states shared through a StateSet", opts.state_block)));
        }
        for s in &schedule.states {
            // Block b of a shared buffer: bytes b·size .. (b + 1)·size.
            let at = opts.state_block.checked_mul(s.buf.bytes).filter(|a| a.checked_add(s.buf.bytes).is_some());
            let at = at.ok_or_else(|| err(format!("state '{}': block {} overflows", s.name, opts.state_block)))?;
            let make = || -> Result<DeviceBuffer> {
                let b = DeviceBuffer::alloc(&dev, at + s.buf.bytes)?;
                b.zero()?;
                Ok(b)
            };
            states.push(match shared {
                // Keyed by device too: a set's buffers serve one device.
                Some(set) => set.get_or_create(&format!("cuda:{}", dev.ordinal), &s.name, at + s.buf.bytes, make)?,
                None => Arc::new(make()?),
            });
            state_at.push(at);
        }
        let state_caps: Vec<u64> = schedule.states.iter().map(|s| s.buf.bytes).collect();
        let mut consts = Vec::new();
        for c in &schedule.consts {
            let b = DeviceBuffer::alloc(&dev, c.data.len() as u64)?;
            b.upload(0, &c.data)?;
            consts.push(b);
        }
        let arena_bytes = schedule.arena_bytes;
        for (i, t) in schedule.thunks.iter().enumerate() {
            for op in rlx_schedule::operands::operands(t) {
                check_buf(
                    &format!("thunk {i} ({}) operand {}", t.kind(), op.what),
                    &op.buf,
                    arena_bytes,
                    &weight_bufs,
                    &state_caps,
                    &consts,
                )?;
            }
            // Stride lists, alignment, and dims × strides of every operand
            // inside its BufRef (the CPU backend runs the same checks).
            rlx_schedule::operands::check_operands(t).map_err(|e| err(format!("thunk {i} ({}): {e}", t.kind())))?;
        }
        for s in schedule.inputs.iter().chain(&schedule.outputs) {
            check_buf(&format!("tensor '{}'", s.name), &s.buf, arena_bytes, &weight_bufs, &state_caps, &consts)?;
        }

        // One activation arena for every slot: all calls run on the
        // executable's one stream, so a call's kernels start only after the
        // previous call's last kernel, its copy-out included, has finished;
        // only the staging buffers and the error flag, which the host reads
        // and writes, need a copy per slot. An arena per slot took `slots`
        // times the memory and was no faster, replayed or pipelined.
        // Executables of one state set share theirs too: their calls run in
        // submission order (`submit`), and an arena holds nothing from one
        // call to the next.
        let set = match shared {
            Some(set) => Some(set.backend_object(&format!("cuda:{}", dev.ordinal), || Ok(SharedArena::new(&dev, trace)))?),
            None => None,
        };
        // Until this prepare's own device work (matmul timing) is done, no
        // call of the set's other executables is submitted, and theirs are
        // finished: the arena is this one's alone meanwhile.
        let quiet = match &set {
            Some(sa) => {
                let last = sa.last();
                last.synchronize()?;
                Some(last)
            }
            None => None,
        };
        let shared_ptr = match &set {
            Some(sa) => sa.grow_to(&dev, arena_bytes)?,
            None => None,
        };
        let (arena, arena_ptr) = match shared_ptr {
            Some(ptr) => (None, ptr),
            None => {
                let b = DeviceBuffer::alloc(&dev, arena_bytes)?;
                let ptr = b.ptr;
                (Some(b), ptr)
            }
        };
        // Split-key attention appends' merge counters and partial sums
        // (launch::SplitScratch), zeroed on the executable's stream below.
        let split_layout = launch::SplitScratch::of(&schedule.thunks, kernels.sm_count);
        let split = match split_layout {
            Some(s) => Some(DeviceBuffer::alloc(&dev, s.counts_bytes + s.part_bytes)?),
            None => None,
        };
        // Fused feed-forward blocks the kernel runs (src/ffn.rs: the shape
        // rule, then the operands' alignment and the clusters that fit); the
        // others run as their parts.
        let bases_at = |err: u64| Bases {
            arena: arena_ptr,
            weights: weight_bufs.iter().map(|b| b.ptr).collect(),
            states: states.iter().zip(&state_at).map(|(b, at)| b.ptr + at).collect(),
            consts: consts.iter().map(|b| b.ptr).collect(),
            err,
            split: split.as_ref().map_or(0, |b| b.ptr),
            split_part: split.as_ref().zip(split_layout).map_or(0, |(b, s)| b.ptr + s.counts_bytes),
        };
        let mut fused = Vec::new();
        for (i, t) in schedule.thunks.iter().enumerate() {
            let Thunk::FeedForward(f) = t else { continue };
            let why = if !cuda.ffn_fusion {
                Some("RLX_FFN=0".to_string())
            } else if let Err(e) = ffn::eligible(f, dev.cc, dev.smem_optin) {
                Some(e)
            } else if ffn::build(kernels, f, &bases_at(0), false)?.is_none() {
                Some("operands not aligned, kernel unavailable or clusters do not fit".to_string())
            } else {
                None
            };
            if let (true, Some(why)) = (trace, &why) {
                eprintln!("rlx-cuda: feed_forward thunk {i} runs as its parts: {why}");
            }
            fused.push(why.is_none());
        }
        let mut fused = fused.into_iter();
        let schedule = if fused.len() > 0 { Arc::new(schedule.expand(|_| fused.next().unwrap_or(false))) } else { schedule };

        // cuBLASLt's 32 MiB workspace only where a thunk runs through it: a
        // quantized decoder's steps have none, and a server holds hundreds
        // of them (a decode step per width, prefill chunks per slot).
        // The executables of a state set share one handle and workspace
        // (their calls, and their prepares' matmul timing, never overlap).
        let through_lt = |t: &Thunk| matches!(t, Thunk::MatMul(_)) || crate::decode::runs_library(t);
        let lt_matmuls = schedule.thunks.iter().any(through_lt);
        let t_plans = Instant::now();
        let blas = match &set {
            Some(sa) if lt_matmuls => sa.blas(&dev)?,
            _ => Arc::new(Blas::new(&dev, lt_matmuls)?),
        };
        let plans: Vec<Option<Arc<MatMulPlan>>> = schedule
            .thunks
            .iter()
            .map(|t| match t {
                Thunk::MatMul(m) => MatMulPlan::new(&blas, m, opts.allow_tf32).map(|p| Some(Arc::new(p))),
                // Without a cuBLASLt algorithm for it, the matmul runs on qmma.
                Thunk::QMatMul { .. } => match crate::decode::library_plan(t, &blas) {
                    Ok(p) => Ok(p.map(Arc::new)),
                    Err(e) => {
                        if trace {
                            eprintln!("rlx-cuda: a quantized matmul runs on qmma, not through cuBLASLt: {e}");
                        }
                        Ok(None)
                    }
                },
                _ => Ok(None),
            })
            .collect::<Result<_>>()?;

        let (in_layout, in_bytes) = layout(schedule.inputs.iter().map(|s| s.buf.bytes as usize));
        let (out_layout, out_bytes) = layout(schedule.outputs.iter().map(|s| s.buf.bytes as usize));
        let stream = Stream::new(&dev)?;
        // The merge counters start at 0 (the calls that use them run on
        // this stream after this).
        if let Some(b) = &split {
            b.zero_range_on(&stream, 0, b.bytes)?;
        }
        // Whatever way this returns, the state set is let go of only after
        // this stream's work (matmul timing) has finished.
        let _settled = quiet.as_ref().map(|_| StreamSyncGuard(stream.0));
        let mut slots = Vec::with_capacity(nslots);
        let plans_took = t_plans.elapsed();
        let (mut recording, mut choosing) = (Duration::ZERO, Duration::ZERO);
        let mut matmul_choices = Vec::new();
        let mut fused_ffns = 0;
        // Opt-in (`CudaOptions::l2_persist`; replay, sm_80+): the arena's
        // accesses persist in L2: the device's largest set-aside and an
        // access policy window over the arena on every recorded kernel, so
        // activations a kernel writes are still in L2 when the next one
        // reads them. A larger arena than the set-aside persists that
        // fraction of its lines. It helps large batches a little; it is not
        // the default because the set-aside is context-wide, and while this
        // executable's lines hold it every other kernel of the process gets
        // a quarter of L2.
        let l2_persist = replay && dev.cc.0 >= 8 && cuda.l2_persist;
        let window = match (l2_persist, dev.l2_persist_max, dev.l2_window_max) {
            (true, set, most) if set > 0 && most > 0 && dev.set_l2_persist(set).is_ok() => {
                let bytes = (arena_bytes as usize).clamp(1, most);
                Some((arena_ptr, bytes, (set as f32 / bytes as f32).min(1.0)))
            }
            _ => None,
        };
        for _ in 0..nslots {
            let errbuf = DeviceBuffer::alloc(&dev, 4)?;
            let pin_in = PinnedBuffer::alloc(&dev, in_bytes)?;
            let pin_out = PinnedBuffer::alloc(&dev, out_bytes + 4)?;
            let bases = bases_at(errbuf.ptr);
            // The error flag is cleared and the staging copies run as kernels
            // (mapped pinned memory): in a recorded graph every memset or
            // memcpy node costs host time at each launch. As kernels, the
            // flag and every input go in one launch (copy_many).
            let (pin_in_dev, pin_out_dev) = (pin_in.device_ptr(), pin_out.device_ptr());
            let mut steps = Vec::new();
            if let Some(d) = pin_in_dev {
                let copies = schedule
                    .inputs
                    .iter()
                    .zip(&in_layout)
                    .map(|(s, (off, bytes))| Ok((bases.ptr(&s.buf)?, d + *off as u64, *bytes as u64)));
                steps.extend(kernels.copy_many(Some((errbuf.ptr, 0)), &copies.collect::<Result<Vec<_>>>()?, "io")?);
            } else {
                steps.push(kernels.fill32(errbuf.ptr, 0, 1, "io")?);
                for (s, (off, bytes)) in schedule.inputs.iter().zip(&in_layout) {
                    // SAFETY: off + bytes lies inside pin_in (layout above).
                    let src = unsafe { pin_in.as_ptr().add(*off) };
                    steps.push(Step::new(Op::HtoD { dst: bases.ptr(&s.buf)?, src, bytes: *bytes }, "io"));
                }
            }
            for (ti, t) in schedule.thunks.iter().enumerate() {
                if let Thunk::FeedForward(f) = t {
                    let fused = ffn::build(kernels, f, &bases, trace && slots.is_empty())?
                        .ok_or_else(|| err(format!("thunk {ti}: the fused feed-forward kernel declined a block it took at prepare")))?;
                    if slots.is_empty() {
                        fused_ffns += 1;
                    }
                    steps.extend(fused);
                    continue;
                }
                let host = HostTask::for_thunk(&dev, t)?;
                let mut lowered = launch::lower(t, &bases, kernels, &blas, plans[ti].as_ref(), host)?;
                if let (Thunk::MatMul(m), Some(plan)) = (t, &plans[ti]) {
                    let t_choose = Instant::now();
                    let (algo, n_lt) = gemm::choose(dev.ordinal, &stream, kernels, m, &blas, plan, &lowered, cuda)?;
                    choosing += t_choose.elapsed();
                    if slots.is_empty() {
                        matmul_choices.push((format!("cublasLt {}", algo.label()), n_lt));
                    }
                    let weight = if matches!(m.b.space, Space::Weight(_)) && m.batch * m.m <= PREFETCH_MAX_ROWS {
                        Some((bases.ptr(&m.b)?, m.b.bytes))
                    } else {
                        None
                    };
                    gemm::set_algo(&mut lowered, &algo);
                    if let Some(first) = lowered.first_mut() {
                        first.weight = weight;
                    }
                }
                steps.extend(lowered);
            }
            // The outputs, then the error flag in pin_out's last 4 bytes.
            let outs = schedule.outputs.iter().zip(&out_layout).map(|(s, (off, bytes))| Ok((bases.ptr(&s.buf)?, *off, *bytes)));
            let outs = outs.chain([Ok((errbuf.ptr, out_bytes, 4))]).collect::<Result<Vec<_>>>()?;
            match pin_out_dev {
                Some(d) => {
                    let copies: Vec<_> = outs.iter().map(|&(src, off, bytes)| (d + off as u64, src, bytes as u64)).collect();
                    steps.extend(kernels.copy_many(None, &copies, "io")?);
                }
                None => {
                    for (src, off, bytes) in outs {
                        // SAFETY: off + bytes lies inside pin_out (layout above).
                        steps.push(Step::new(Op::DtoH { dst: unsafe { pin_out.as_ptr().add(off) }, src, bytes }, "io"));
                    }
                }
            }
            if pdl {
                launch::mark_pdl(&mut steps);
            }
            let prefetch = if l2_prefetch && replay {
                Some(Prefetcher { side: Stream::new(&dev)?, fork: Event::new(false)?, join: Event::new(false)?, kernels })
            } else {
                None
            };
            let t_rec = Instant::now();
            let segments = if replay { record(&stream, &steps, fill, window, cuda.graph_dump, prefetch.as_ref())? } else { Vec::new() };
            recording += t_rec.elapsed();
            let prof = if profile { (0..=steps.len()).map(|_| Event::new(true)).collect::<Result<_>>()? } else { Vec::new() };
            slots.push(Slot { _err: errbuf, pin_in, pin_out, steps, segments, done: Event::new(false)?, prof, pending: None });
        }
        // Staging copies and the error flag ("io") are not part of the forward.
        let kernels_per_call = slots.first().map(|s| s.steps.iter().filter(|s| s.is_kernel() && s.kind != "io").count()).unwrap_or(0);
        // RLX_PROFILE times every step with events, which needs eager launches.
        let mode = match (replay, profile) {
            (true, false) => "replay",
            (true, true) => "replay recorded, eager launches (RLX_PROFILE)",
            (false, _) => "eager",
        };
        let stats = ExecStats { calls: 0, kernels_per_call, arena_bytes, slots: nslots, last_host_time: Duration::ZERO, mode: mode.into() };
        if quiet.is_some() {
            stream.synchronize()?;
        }
        drop(quiet);
        let exec = CudaExecutable {
            dev,
            uid: NEXT_EXECUTABLE.fetch_add(1, Ordering::Relaxed),
            set,
            schedule,
            store,
            weights,
            _weight_bufs: weight_bufs,
            states,
            state_at,
            _consts: consts,
            _plans: plans,
            _blas: blas,
            fused_ffns,
            matmul_choices,
            slots,
            _arena: arena,
            _split: split,
            l2_window: window.map(|(_, bytes, hit)| (bytes, hit)),
            stream,
            in_layout,
            out_layout,
            flag_off: out_bytes,
            replay,
            trace,
            profile,
            next_id: 1,
            next_slot: 0,
            stats,
            phases: [Duration::ZERO; 4],
        };
        if trace {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            eprintln!(
                "rlx-cuda: prepared in {:.1} ms: weights {:.1}, cuBLASLt handle and plans {:.1}, matmul choices {:.1}, recording {:.1}",
                ms(begun.elapsed()),
                ms(weights_took),
                ms(plans_took),
                ms(choosing),
                ms(recording)
            );
            eprintln!("{}", exec.segment_map());
        }
        Ok(exec)
    }

    /// Which thunks replay inside which recorded segment and which run on
    /// the host (printed once under RLX_TRACE=1).
    pub fn segment_map(&self) -> String {
        let mut s = format!("rlx-cuda: {} thunks, mode {}, {} slot(s)", self.schedule.thunks.len(), self.stats.mode, self.slots.len());
        match self.l2_window {
            Some((bytes, hit)) => s.push_str(&format!(", {bytes} arena bytes persist in L2 (hit ratio {hit:.2})\n")),
            None => s.push('\n'),
        }
        let Some(slot) = self.slots.first() else { return s };
        if !self.replay {
            s.push_str("  eager: every step launched per call\n");
            return s;
        }
        for (i, seg) in slot.segments.iter().enumerate() {
            let (kind, r, nodes, pdl, copies, conv, pre) = match seg {
                Segment::Replay { steps, graph, prefetches } => {
                    ("replay", steps.clone(), graph.nodes, graph.pdl_edges, graph.copy_nodes, graph.converted, *prefetches)
                }
                Segment::Host { steps } => ("host", steps.clone(), 0, 0, 0, 0, 0),
            };
            let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
            for st in &slot.steps[r.clone()] {
                *kinds.entry(st.kind).or_default() += 1;
            }
            let list: Vec<String> = kinds.iter().map(|(k, n)| format!("{k}x{n}")).collect();
            s.push_str(&format!(
                "  segment {i}: {kind} steps {}..{} ({nodes} graph nodes, {pdl} programmatic edges, {copies} memset/memcpy nodes, {conv} memsets made kernels, {pre} L2 weight prefetches): {}\n",
                r.start,
                r.end,
                list.join(" ")
            ));
        }
        s
    }

    /// Slot 0's recorded graphs: memset/memcpy nodes left in them, and
    /// memset nodes (cuBLASLt's) replaced by fill kernels.
    pub fn copy_node_counts(&self) -> (usize, usize) {
        let Some(slot) = self.slots.first() else { return (0, 0) };
        slot.segments.iter().fold((0, 0), |(c, v), s| match s {
            Segment::Replay { graph, .. } => (c + graph.copy_nodes, v + graph.converted),
            Segment::Host { .. } => (c, v),
        })
    }

    /// Programmatic (PDL) edges in slot 0's recorded graphs: kernels that
    /// start while the kernel before them drains.
    pub fn programmatic_edges(&self) -> usize {
        let Some(slot) = self.slots.first() else { return 0 };
        slot.segments
            .iter()
            .map(|s| match s {
                Segment::Replay { graph, .. } => graph.pdl_edges,
                Segment::Host { .. } => 0,
            })
            .sum()
    }

    /// The L2 access policy window over the arena, if the recorded graphs
    /// carry one: (bytes, hit ratio) (opt-in: `CudaOptions::l2_persist`;
    /// sm_80+, replay).
    pub fn l2_window(&self) -> Option<(usize, f32)> {
        self.l2_window
    }

    /// L2 weight prefetches recorded beside slot 0's forward: one per
    /// matmul of at most 128 rows that reads a weight (sm_90+, replay).
    pub fn weight_prefetches(&self) -> usize {
        let Some(slot) = self.slots.first() else { return 0 };
        slot.segments
            .iter()
            .map(|s| match s {
                Segment::Replay { prefetches, .. } => *prefetches,
                Segment::Host { .. } => 0,
            })
            .sum()
    }

    /// Feed-forward blocks (FFN1 with erf-GELU, FFN2, the norm after them)
    /// that run as the fused kernel of kernels/ffn.cu (`CudaOptions::ffn_fusion`).
    pub fn fused_ffn_count(&self) -> usize {
        self.fused_ffns
    }

    /// Per MatMul thunk, in schedule order: the kernel that runs it
    /// ("cublasLt a<algo>t<tile>s<split>r<reduction>") and how many cuBLASLt
    /// candidates were considered for it at this prepare (0 when the choice
    /// was cached or nothing was timed).
    pub fn matmul_choices(&self) -> &[(String, usize)] {
        &self.matmul_choices
    }

    /// Host time of the last `submit`, by phase: input check, staging into
    /// pinned memory, launch (graph launches or eager enqueues), completion
    /// event record.
    pub fn last_submit_phases(&self) -> [Duration; 4] {
        self.phases
    }

    /// Waits for this executable's calls and, in a state set, for the
    /// set's last call; the guard holds the set's calls off until dropped,
    /// so the host can read or write the states meanwhile.
    fn quiesce(&self) -> Result<Option<MutexGuard<'_, LastCall>>> {
        driver::check_context()?;
        self.dev.bind()?;
        self.stream.synchronize()?;
        let last = self.set.as_ref().map(|sa| sa.last());
        if let Some(l) = &last {
            l.synchronize()?;
        }
        Ok(last)
    }

    /// The fault-injection hook (`CudaBackend::inject_trap_for_test`):
    /// every slot gets a recorded graph holding one trapping kernel,
    /// replayed before its other segments on every later call (in eager
    /// mode the kernel is launched first).
    pub(crate) fn inject_trap(&mut self, kernels: &Kernels) -> Result<()> {
        if self.profile {
            return Err(err("the trap hook does not run under RLX_PROFILE"));
        }
        self.dev.bind()?;
        self.stream.synchronize()?;
        for slot in &mut self.slots {
            let trap = kernels.trap()?;
            if self.replay {
                let graph = GraphExec::capture(&self.stream, None, None, false, || trap.enqueue(&self.stream))?;
                slot.segments.insert(0, Segment::Replay { steps: 0..0, graph, prefetches: 0 });
            } else {
                slot.steps.insert(0, trap);
            }
        }
        Ok(())
    }

    /// A slot that is free: never used, collected, or abandoned (waiting for
    /// the device to finish an abandoned call is bounded and safe).
    fn free_slot(&mut self) -> Result<usize> {
        let n = self.slots.len();
        for k in 0..n {
            let i = (self.next_slot + k) % n;
            if self.slots[i].pending.is_none() {
                return Ok(i);
            }
        }
        for k in 0..n {
            let i = (self.next_slot + k) % n;
            let abandoned = self.slots[i].pending.as_ref().map(|p| p.abandoned.load(Ordering::Acquire)).unwrap_or(false);
            if abandoned {
                self.slots[i].done.synchronize()?;
                self.slots[i].pending = None;
                return Ok(i);
            }
        }
        Err(RuntimeError::Busy { slots: n })
    }

    fn launch(&self, slot: &Slot) -> Result<()> {
        if self.profile {
            slot.prof[0].record(&self.stream)?;
            for (i, st) in slot.steps.iter().enumerate() {
                st.enqueue_with(&self.stream, false)?;
                slot.prof[i + 1].record(&self.stream)?;
            }
            return Ok(());
        }
        if self.replay {
            for seg in &slot.segments {
                match seg {
                    Segment::Replay { graph, .. } => graph.launch(&self.stream)?,
                    Segment::Host { steps } => {
                        for st in &slot.steps[steps.clone()] {
                            st.enqueue(&self.stream)?;
                        }
                    }
                }
            }
            return Ok(());
        }
        for st in &slot.steps {
            st.enqueue(&self.stream)?;
        }
        Ok(())
    }

    fn print_profile(&self, slot: &Slot) -> Result<()> {
        let mut per: BTreeMap<&str, (f64, usize)> = BTreeMap::new();
        for (i, st) in slot.steps.iter().enumerate() {
            let ms = Event::elapsed_ms(&slot.prof[i], &slot.prof[i + 1])? as f64;
            let e = per.entry(st.kind).or_default();
            e.0 += ms * 1000.0;
            e.1 += 1;
        }
        let total: f64 = per.values().map(|v| v.0).sum();
        let list: Vec<String> = per.iter().map(|(k, (us, n))| format!("{k} {us:.1}us/{n}")).collect();
        eprintln!("rlx-cuda profile (eager, CUDA events): total {total:.1}us: {}", list.join(", "));
        Ok(())
    }
}

impl Executable for CudaExecutable {
    fn submit(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Ticket> {
        // After a kernel fault the context is gone: say so, without calling the driver.
        driver::check_context()?;
        let t0 = Instant::now();
        // Inputs given in the schedule's order with the right shapes and
        // dtypes need no name table; anything else gets the full check and
        // its error messages.
        let in_order = inputs.len() == self.schedule.inputs.len()
            && inputs.iter().zip(&self.schedule.inputs).all(|((n, t), s)| *n == s.name && t.dtype() == s.dtype && t.shape() == &s.shape);
        let tensors: Vec<&Tensor> = if in_order { inputs.iter().map(|(_, t)| *t).collect() } else { check_inputs(&self.schedule, inputs)? };
        self.dev.bind()?;
        self.weights.refresh(&self.store)?;
        let si = self.free_slot()?;
        let t_stage = Instant::now();
        {
            let slot = &mut self.slots[si];
            for (t, (off, _)) in tensors.iter().zip(&self.in_layout) {
                slot.pin_in.write(*off, t.bytes())?;
            }
        }
        let t_launch = Instant::now();
        let mut t_record = t_launch;
        // Executables of a state set: this call waits on the device for the
        // call submitted before it to another of them.
        let set = self.set.clone();
        let mut last = set.as_ref().map(|sa| sa.last());
        let ordered = last.as_ref().map_or(Ok(()), |l| l.order_after(self.uid, &self.stream));
        let launched = ordered.and_then(|_| self.launch(&self.slots[si])).and_then(|_| {
            t_record = Instant::now();
            self.slots[si].done.record(&self.stream)
        });
        if let Err(e) = launched {
            // Part of the call may be queued: let it drain before the slot is reused.
            let _ = self.stream.synchronize();
            return Err(e);
        }
        if let Some(l) = last.as_mut() {
            l.0 = Some((self.uid, self.slots[si].done.0));
        }
        drop(last);
        let id = self.next_id;
        self.next_id += 1;
        let flag = Arc::new(AtomicBool::new(false));
        self.slots[si].pending = Some(Pending { id, abandoned: flag.clone() });
        self.next_slot = (si + 1) % self.slots.len();
        self.stats.calls += 1;
        let end = Instant::now();
        self.stats.last_host_time = end - t0;
        self.phases = [t_stage - t0, t_launch - t_stage, t_record - t_launch, end - t_record];
        if self.trace {
            eprintln!(
                "rlx-cuda call {id} slot {si} {}: check {:?}, stage {:?}, launch {:?}, record {:?}",
                self.stats.mode,
                t_stage - t0,
                t_launch - t_stage,
                t_record - t_launch,
                end - t_record
            );
        }
        Ok(Ticket::new(id, si, flag))
    }

    fn wait(&mut self, ticket: Ticket) -> Result<Vec<Tensor>> {
        let (id, si) = ticket.collect();
        let pending_id = self.slots.get(si).and_then(|s| s.pending.as_ref()).map(|p| p.id);
        if pending_id != Some(id) {
            return Err(RuntimeError::BadTicket(id));
        }
        let t0 = Instant::now();
        self.dev.bind()?;
        let slot = &mut self.slots[si];
        let synced = slot.done.synchronize();
        slot.pending = None;
        synced?;
        let t1 = Instant::now();
        let mut outs = Vec::with_capacity(self.out_layout.len());
        for (s, (off, bytes)) in self.schedule.outputs.iter().zip(&self.out_layout) {
            let b = slot.pin_out.slice(*off, *bytes).ok_or_else(|| err(format!("output '{}' lies outside the staging buffer", s.name)))?;
            outs.push(Tensor::from_bytes(s.shape.clone(), s.dtype, b.to_vec())?);
        }
        let flag = match slot.pin_out.slice(self.flag_off, 4) {
            Some([a, b, c, d]) => u32::from_le_bytes([*a, *b, *c, *d]),
            _ => return Err(err("error flag missing from the staging buffer")),
        };
        if self.trace {
            eprintln!("rlx-cuda call {id}: wait {:?}, copy-out {:?}", t1 - t0, t1.elapsed());
        }
        if self.profile {
            self.print_profile(&self.slots[si])?;
        }
        if flag != 0 {
            let mut why = Vec::new();
            if flag & 1 != 0 {
                why.push("a gather or embedding id was outside 0..vocab (its rows were gathered as zeros)");
            }
            if flag & 2 != 0 {
                why.push("a state write ran past the state's capacity (position + new rows > max rows; nothing was written)");
            }
            if flag & 4 != 0 {
                why.push("an attention valid_len was outside 0..=kv_len (it was clamped)");
            }
            if flag & 8 != 0 {
                why.push("a sample position was outside the token history (token 0 was written)");
            }
            if flag & 16 != 0 {
                why.push("an integer division by zero (0 was written)");
            }
            return Err(RuntimeError::backend("cuda", format!("call {id}: {}", why.join("; "))));
        }
        Ok(outs)
    }

    fn reset_state(&mut self) -> Result<()> {
        // The zeros go in on this executable's stream, after its calls and
        // with the set held, so no call of the set runs until they are in.
        let quiet = self.quiesce()?;
        for ((b, at), s) in self.states.iter().zip(&self.state_at).zip(&self.schedule.states) {
            b.zero_range_on(&self.stream, *at, s.buf.bytes)?;
        }
        self.stream.synchronize()?;
        drop(quiet);
        Ok(())
    }

    fn read_state(&mut self, name: &str) -> Result<Tensor> {
        let i = self.schedule.states.iter().position(|s| s.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.schedule.states.iter().map(|s| s.name.as_str()).collect();
            err(format!("no state named '{name}' (states: {})", known.join(", ")))
        })?;
        let _quiet = self.quiesce()?;
        let slot = &self.schedule.states[i];
        let mut data = vec![0u8; slot.buf.bytes as usize];
        self.states[i].download(self.state_at[i], &mut data)?;
        Tensor::from_bytes(slot.shape.clone(), slot.dtype, data)
    }

    fn stats(&self) -> ExecStats {
        self.stats.clone()
    }

    fn schedule(&self) -> &Arc<Schedule> {
        &self.schedule
    }
}

impl Drop for CudaExecutable {
    fn drop(&mut self) {
        // Nothing may be freed while the device still uses it.
        let _ = self.dev.bind();
        let _ = self.stream.synchronize();
        // A later call of the state set waits on none of this one's events.
        if let Some(sa) = &self.set {
            let mut last = sa.last();
            if last.0.is_some_and(|(uid, _)| uid == self.uid) {
                last.0 = None;
            }
        }
        // The arena's lines leave L2's set-aside to other work.
        if self.l2_window.is_some() {
            let _ = self.dev.reset_l2_persisting();
        }
    }
}
