use std::sync::Arc;

use rlx_compile::{CompileOptions, Compiled, Schedule, Thunk};
use rlx_ir::Graph;
use rlx_runtime::{Backend, ExecStats, Executable, PrepareOptions, StateSet, Tensor, Ticket, WeightStore};

use crate::{Device, Error, Options, Result};

/// A device plus the weights of one model. Every graph compiled from a
/// session shares its [`WeightStore`].
pub struct Session {
    device: Device,
    backend: Arc<dyn Backend>,
    weights: Arc<WeightStore>,
    options: Options,
}

fn backend_for(device: Device, options: &Options) -> Result<Arc<dyn Backend>> {
    match device {
        Device::Cpu => Ok(Arc::new(rlx_cpu::CpuBackend::with_options(options.cpu.clone()))),
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => {
            let b = rlx_cuda::CudaBackend::with_options(n, options.cuda.clone())
                .map_err(|e| Error::Device(device.to_string(), e.to_string()))?;
            Ok(Arc::new(b))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {
            Err(Error::Device(device.to_string(), "this build of rlx has no CUDA support (built without the `cuda` feature)".into()))
        }
    }
}

impl Session {
    /// A session with an empty weight store and the options of the
    /// environment ([`Options::from_env`]).
    pub fn new(device: Device) -> Result<Session> {
        Self::with_weights(device, Arc::new(WeightStore::new()))
    }

    /// A session over an existing store (e.g. the same weights on two
    /// devices), with the options of the environment.
    pub fn with_weights(device: Device, weights: Arc<WeightStore>) -> Result<Session> {
        Self::with_options(device, weights, Options::from_env()?)
    }

    /// A session with these options (the environment is not read).
    pub fn with_options(device: Device, weights: Arc<WeightStore>, options: Options) -> Result<Session> {
        Ok(Session { device, backend: backend_for(device, &options)?, weights, options })
    }

    /// Every setting of this session.
    pub fn options(&self) -> &Options {
        &self.options
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn weights(&self) -> &Arc<WeightStore> {
        &self.weights
    }

    /// Sets (or updates in place) one weight.
    pub fn set_weight(&self, name: &str, tensor: Tensor) -> Result<()> {
        Ok(self.weights.set(name, tensor)?)
    }

    pub fn compile_options(&self) -> &CompileOptions {
        &self.options.compile
    }

    pub fn set_compile_options(&mut self, opts: CompileOptions) {
        self.options.compile = opts;
    }

    pub fn prepare_options(&self) -> &PrepareOptions {
        &self.options.prepare
    }

    pub fn set_prepare_options(&mut self, opts: PrepareOptions) {
        self.options.prepare = opts;
    }

    /// The graph compiled with this session's options; again without the
    /// feed-forward fusion when the backend would run none of the fused
    /// blocks as one kernel (their parts then get the plan of separate ops,
    /// which needs less arena than the fused op's scratch).
    fn compile_for_backend(&self, graph: &Graph) -> Result<Compiled> {
        compile_for(self.backend.as_ref(), graph, &self.options.compile)
    }

    /// Compiles a graph for this session's device and binds the weights.
    pub fn compile(&self, graph: &Graph) -> Result<CompiledGraph> {
        let compiled = self.compile_for_backend(graph)?;
        let schedule = Arc::new(compiled.schedule.clone());
        let exec = self.backend.prepare(schedule, self.weights.clone(), &self.options.prepare)?;
        Ok(CompiledGraph { compiled, exec })
    }

    /// As [`compile`](Self::compile), with the graph's state tensors taken
    /// from `states` by name (created there on first use), so several
    /// executables share them — e.g. a decoder's KV cache, written by the
    /// prefill of every length bucket and by the decode step. On the CPU
    /// the caller orders calls of different executables that touch the
    /// set (waits for one's calls before submitting to another); on CUDA
    /// they run in submission order, and share one activation arena.
    pub fn compile_shared(&self, graph: &Graph, states: &Arc<StateSet>) -> Result<CompiledGraph> {
        self.compile_shared_at(graph, states, 0)
    }

    /// As [`compile_shared`](Self::compile_shared), with the executable's
    /// states at block `block` of the shared buffers
    /// (`PrepareOptions::state_block`): a graph built for one row of
    /// batch-outermost states, at block `r`, works on row `r` of a wider
    /// graph's states.
    pub fn compile_shared_at(&self, graph: &Graph, states: &Arc<StateSet>, block: u64) -> Result<CompiledGraph> {
        let compiled = self.compile_for_backend(graph)?;
        let schedule = Arc::new(compiled.schedule.clone());
        let opts = PrepareOptions { state_block: block, ..self.options.prepare.clone() };
        let exec = self.backend.prepare_shared(schedule, self.weights.clone(), states, &opts)?;
        Ok(CompiledGraph { compiled, exec })
    }
}

/// A graph compiled for one device: run it, or submit and wait.
pub struct CompiledGraph {
    compiled: Compiled,
    exec: Box<dyn Executable>,
}

impl CompiledGraph {
    /// Runs one call: inputs by name, outputs in the graph's output order.
    pub fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Vec<Tensor>> {
        Ok(self.exec.run(inputs)?)
    }

    /// Starts a call; collect it with [`wait`](Self::wait).
    pub fn submit(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Ticket> {
        Ok(self.exec.submit(inputs)?)
    }

    pub fn wait(&mut self, ticket: Ticket) -> Result<Vec<Tensor>> {
        Ok(self.exec.wait(ticket)?)
    }

    /// Zeroes all state tensors (e.g. a KV cache).
    pub fn reset_state(&mut self) -> Result<()> {
        Ok(self.exec.reset_state()?)
    }

    pub fn read_state(&mut self, name: &str) -> Result<Tensor> {
        Ok(self.exec.read_state(name)?)
    }

    pub fn stats(&self) -> ExecStats {
        self.exec.stats()
    }

    /// The graph as given.
    pub fn before(&self) -> &Graph {
        &self.compiled.before
    }

    /// The graph after passes.
    pub fn after(&self) -> &Graph {
        &self.compiled.after
    }

    pub fn schedule(&self) -> &Schedule {
        &self.compiled.schedule
    }

    pub fn executable(&mut self) -> &mut dyn Executable {
        self.exec.as_mut()
    }
}

/// `graph` compiled with `opts` (quantized matmul scratch where `backend`
/// asks for it); again without the feed-forward fusion when `backend` would
/// run none of the fused blocks as one kernel.
fn compile_for(backend: &dyn Backend, graph: &Graph, opts: &CompileOptions) -> Result<Compiled> {
    let opts = &CompileOptions { qmatmul_scratch_rows: backend.qmatmul_scratch_rows(), ..opts.clone() };
    let compiled = rlx_compile::compile(graph, opts)?;
    let mut fused = compiled.schedule.thunks.iter().filter(|t| matches!(t, Thunk::FeedForward(_))).peekable();
    if fused.peek().is_some() && !fused.any(|t| backend.runs_fused(t)) {
        let unfused = CompileOptions { fuse_feed_forward: false, ..opts.clone() };
        return Ok(rlx_compile::compile(graph, &unfused)?);
    }
    Ok(compiled)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::{DType, Op};

    /// The CPU backend, saying it runs fused thunks as one kernel (`fuses`)
    /// and asking for quantized matmul scratch from `scratch_rows` rows.
    struct Cpu {
        cpu: rlx_cpu::CpuBackend,
        fuses: bool,
        scratch_rows: Option<usize>,
    }

    impl Cpu {
        fn new(fuses: bool, scratch_rows: Option<usize>) -> Cpu {
            Cpu { cpu: rlx_cpu::CpuBackend::new(), fuses, scratch_rows }
        }
    }

    impl Backend for Cpu {
        fn name(&self) -> &str {
            "test-cpu"
        }
        fn supports(&self, thunk: &Thunk) -> bool {
            self.cpu.supports(thunk)
        }
        fn runs_fused(&self, thunk: &Thunk) -> bool {
            self.fuses && thunk.parts().is_some()
        }
        fn qmatmul_scratch_rows(&self) -> Option<usize> {
            self.scratch_rows
        }
        fn prepare(
            &self,
            schedule: Arc<Schedule>,
            weights: Arc<WeightStore>,
            opts: &PrepareOptions,
        ) -> rlx_runtime::Result<Box<dyn Executable>> {
            self.cpu.prepare(schedule, weights, opts)
        }
    }

    #[test]
    fn quantized_matmuls_get_scratch_where_the_backend_asks_for_it() {
        let f = rlx_ir::QFormat::Q8_0;
        let scratch_of = |rows: usize, backend: &dyn Backend| {
            let mut g = Graph::new();
            let x = g.input("x", [rows, 32], DType::F32).unwrap();
            let w = g.param("w", [8, f.row_bytes(32).unwrap()], DType::U8).unwrap();
            let y = g.qmatmul(x, w, f).unwrap();
            g.output(y).unwrap();
            let c = compile_for(backend, &g, &CompileOptions::default()).unwrap();
            let found: Vec<bool> = c
                .schedule
                .thunks
                .iter()
                .filter_map(|t| if let Thunk::QMatMul { scratch, .. } = t { Some(scratch.is_some()) } else { None })
                .collect();
            assert_eq!(found.len(), 1, "{}", c.schedule);
            found[0]
        };
        assert!(scratch_of(3, &Cpu::new(false, Some(3))));
        assert!(!scratch_of(2, &Cpu::new(false, Some(3))));
        assert!(!scratch_of(3, &rlx_cpu::CpuBackend::new()));
    }

    /// x [2, 5, 16] → FFN1 (32, + bias, GELU) → FFN2 (16, + bias) → LayerNorm(· + x).
    fn feed_forward_graph() -> Graph {
        let mut g = Graph::new();
        let x = g.input("x", [2, 5, 16], DType::F32).unwrap();
        let (w1, b1) = (g.param("w1", [32, 16], DType::F32).unwrap(), g.param("b1", [32], DType::F32).unwrap());
        let (w2, b2) = (g.param("w2", [16, 32], DType::F32).unwrap(), g.param("b2", [16], DType::F32).unwrap());
        let (gamma, beta) = (g.param("gamma", [16], DType::F32).unwrap(), g.param("beta", [16], DType::F32).unwrap());
        let h = g.linear(x, w1, Some(b1), true).unwrap();
        let h = g.gelu(h).unwrap();
        let y = g.linear(h, w2, Some(b2), true).unwrap();
        let r = g.add(y, x).unwrap();
        let out = g.layer_norm(r, gamma, beta, 1e-12).unwrap();
        g.output(out).unwrap();
        g
    }

    #[test]
    fn the_feed_forward_op_stays_only_where_the_backend_runs_it_as_one_kernel() {
        let g = feed_forward_graph();
        let opts = CompileOptions::default();
        let ops = |c: &Compiled| c.after.nodes.iter().filter(|n| matches!(n.op, Op::FeedForward(_))).count();
        let fusing = compile_for(&Cpu::new(true, None), &g, &opts).unwrap();
        let cpu = compile_for(&rlx_cpu::CpuBackend::new(), &g, &opts).unwrap();
        assert_eq!(ops(&fusing), 1, "{}", fusing.after);
        assert_eq!(ops(&cpu), 0, "{}", cpu.after);
        // The separate ops' plan shares the arena; the fused op's scratch does not.
        assert!(cpu.schedule.arena_bytes < fusing.schedule.arena_bytes, "{} vs {}", cpu.schedule.arena_bytes, fusing.schedule.arena_bytes);
        // With the fusion off in the options, nothing to decide.
        let off = CompileOptions { fuse_feed_forward: false, ..opts };
        assert_eq!(ops(&compile_for(&Cpu::new(true, None), &g, &off).unwrap()), 0);
    }
}
