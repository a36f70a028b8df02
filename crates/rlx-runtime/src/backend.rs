use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rlx_schedule::{Schedule, Thunk};

use crate::{Result, RuntimeError, StateSet, Tensor, WeightStore};

/// Options for turning a schedule into an executable.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    /// Pipeline slots for submit/wait (calls in flight at once); at least 1.
    /// On the CPU each slot has its own arena; on a GPU the slots share one,
    /// since the device runs the calls in submission order.
    pub slots: usize,
    /// GPU: record once and replay (default) or launch every thunk (eager).
    /// `RLX_REPLAY=0` turns replay off.
    pub replay: bool,
    /// GPU: allow TF32 tensor cores for f32 matmuls.
    pub allow_tf32: bool,
    /// With states shared through a [`StateSet`] (`prepare_shared`): the
    /// block of the shared buffers this executable's states occupy, in
    /// units of each state's own size. State `s` of `n` bytes lies at bytes
    /// `state_block·n .. (state_block + 1)·n` of the shared buffer, so an
    /// executable built for one row of a batch-outermost state, at block
    /// `r`, reads and writes row `r` of a wider executable's state. 0 (the
    /// default) is the buffers' start. Without a state set it must be 0.
    pub state_block: u64,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions { slots: 2, replay: true, allow_tf32: false, state_block: 0 }
    }
}

/// A device that can run schedules.
pub trait Backend: Send + Sync {
    fn name(&self) -> &str;
    /// Whether this backend can run the thunk (shape limits included).
    fn supports(&self, thunk: &Thunk) -> bool;
    /// For a fused thunk (one with `Thunk::parts`): whether the backend runs
    /// it as one kernel rather than as its parts. A session compiles a
    /// graph again without the fusion when none of its fused thunks would
    /// run as one kernel, since the separate ops' arena plan needs less
    /// memory than the fused op's scratch. The default: never.
    fn runs_fused(&self, thunk: &Thunk) -> bool {
        let _ = thunk;
        false
    }
    /// The rows from which this backend runs a quantized matmul as a
    /// library matmul over weights it decodes into arena scratch (the
    /// compiler then plans that scratch, `Thunk::QMatMul::scratch`). The
    /// default: never.
    fn qmatmul_scratch_rows(&self) -> Option<usize> {
        None
    }
    /// Checks support, binds the weights and allocates arenas and state.
    fn prepare(&self, schedule: Arc<Schedule>, weights: Arc<WeightStore>, opts: &PrepareOptions) -> Result<Box<dyn Executable>>;
    /// As [`prepare`](Backend::prepare), with the schedule's states taken
    /// from (or added to) a set shared with other executables (see
    /// [`StateSet`] on how their calls are ordered).
    fn prepare_shared(
        &self,
        schedule: Arc<Schedule>,
        weights: Arc<WeightStore>,
        states: &Arc<StateSet>,
        opts: &PrepareOptions,
    ) -> Result<Box<dyn Executable>> {
        let _ = (schedule, weights, states, opts);
        Err(RuntimeError::backend(self.name(), "state shared between executables is not supported by this backend yet"))
    }
}

/// Counters an executable keeps about itself.
#[derive(Debug, Clone, Default)]
pub struct ExecStats {
    pub calls: u64,
    /// Kernels (or thunks) launched per call.
    pub kernels_per_call: usize,
    pub arena_bytes: u64,
    pub slots: usize,
    pub last_host_time: Duration,
    /// Free-form description of the mode ("replay", "eager", "cpu").
    pub mode: String,
}

/// A handle on a submitted call. Pass it to [`Executable::wait`]; dropping it
/// abandons the result and frees its slot once the device is done.
#[derive(Debug)]
pub struct Ticket {
    pub id: u64,
    pub slot: usize,
    abandoned: Arc<AtomicBool>,
    collected: bool,
}

impl Ticket {
    /// Made by executables; `flag` is set when the ticket is dropped unused.
    pub fn new(id: u64, slot: usize, flag: Arc<AtomicBool>) -> Self {
        Ticket { id, slot, abandoned: flag, collected: false }
    }
    /// Marks the ticket as collected so dropping it is not an abandonment.
    pub fn collect(mut self) -> (u64, usize) {
        self.collected = true;
        (self.id, self.slot)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.collected {
            self.abandoned.store(true, Ordering::Release);
        }
    }
}

/// A compiled schedule bound to a device: its arenas, state and weights.
pub trait Executable: Send {
    /// Stages inputs and starts the call; returns at once where the backend
    /// can. `inputs` are (name, tensor) pairs matching the schedule's inputs.
    fn submit(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Ticket>;
    /// Blocks until the call behind `ticket` is done and returns its outputs
    /// in the schedule's output order.
    fn wait(&mut self, ticket: Ticket) -> Result<Vec<Tensor>>;
    /// submit + wait.
    fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Vec<Tensor>> {
        let t = self.submit(inputs)?;
        self.wait(t)
    }
    /// Zeroes every state tensor (e.g. to start a new sequence).
    fn reset_state(&mut self) -> Result<()>;
    /// Reads a state tensor back to the host.
    fn read_state(&mut self, name: &str) -> Result<Tensor>;
    fn stats(&self) -> ExecStats;
    fn schedule(&self) -> &Arc<Schedule>;
}

/// Matches (name, tensor) pairs to the schedule's inputs: every input given
/// once, no unknown names, shapes and dtypes exact. Returns the tensors in
/// schedule order.
pub fn check_inputs<'a>(schedule: &Schedule, inputs: &[(&str, &'a Tensor)]) -> Result<Vec<&'a Tensor>> {
    let mut by_name: HashMap<&str, &'a Tensor> = HashMap::new();
    for (name, t) in inputs {
        if by_name.insert(name, t).is_some() {
            return Err(RuntimeError::Input { name: name.to_string(), detail: "given more than once".into() });
        }
        if !schedule.inputs.iter().any(|s| s.name == *name) {
            let known: Vec<&str> = schedule.inputs.iter().map(|s| s.name.as_str()).collect();
            return Err(RuntimeError::Input {
                name: name.to_string(),
                detail: format!("not an input of this graph (inputs: {})", known.join(", ")),
            });
        }
    }
    let mut out = Vec::with_capacity(schedule.inputs.len());
    for slot in &schedule.inputs {
        let t = by_name.get(slot.name.as_str()).ok_or_else(|| RuntimeError::Input {
            name: slot.name.clone(),
            detail: format!("missing: expected a {} {} tensor", slot.shape, slot.dtype),
        })?;
        if t.shape() != &slot.shape {
            return Err(RuntimeError::Input {
                name: slot.name.clone(),
                detail: format!("expected shape {}, found {}", slot.shape, t.shape()),
            });
        }
        if t.dtype() != slot.dtype {
            return Err(RuntimeError::Input {
                name: slot.name.clone(),
                detail: format!("expected dtype {}, found {}", slot.dtype, t.dtype()),
            });
        }
        out.push(*t);
    }
    Ok(out)
}
