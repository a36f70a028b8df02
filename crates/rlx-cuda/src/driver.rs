//! Thin owned wrappers over the CUDA driver API (cudarc's `sys` layer):
//! device buffers, pinned host buffers, streams, events, recorded graphs,
//! modules. Every call's status becomes a `RuntimeError` naming the call.
//!
//! We use the raw layer rather than cudarc's safe types because replay needs
//! exact control over what is enqueued (no hidden event tracking inside a
//! capture) and over which addresses stay fixed.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use rlx_runtime::{Result, RuntimeError};

use crate::params::{FillP, Params};

pub(crate) fn err(detail: impl Into<String>) -> RuntimeError {
    RuntimeError::backend("cuda", detail)
}

pub(crate) fn describe(r: CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string or leaves it null.
    unsafe {
        if sys::cuGetErrorString(r, &mut p) == CUresult::CUDA_SUCCESS && !p.is_null() {
            return format!("{r:?}: {}", CStr::from_ptr(p).to_string_lossy());
        }
    }
    format!("{r:?}")
}

/// Errors after which the CUDA context cannot be used again: a kernel
/// faulted, and every later call in the process's (primary) context
/// returns the same error until the process exits.
fn is_sticky(r: CUresult) -> bool {
    use CUresult::*;
    matches!(
        r,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_ECC_UNCORRECTABLE
    )
}

/// The first sticky error this process saw, as its message.
static CONTEXT_LOST: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// `Some(message)` once a kernel has faulted in this process: the CUDA
/// context is lost, and executables, sessions and backends answer every
/// later call with this message instead of calling the driver.
pub(crate) fn context_lost() -> Option<RuntimeError> {
    CONTEXT_LOST.get().map(|m| err(m.clone()))
}

/// Fails with the context-lost message once a kernel has faulted.
pub(crate) fn check_context() -> Result<()> {
    context_lost().map_or(Ok(()), Err)
}

/// Turns a driver status into a Result; `what` names the call for the message.
pub(crate) fn check(r: CUresult, what: &str) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    if is_sticky(r) {
        let first = CONTEXT_LOST.get_or_init(|| {
            format!(
                "a GPU kernel failed ({what}: {}); the CUDA context of this process is lost and every later GPU call \
                 in it fails: restart the process to use the GPU again",
                describe(r)
            )
        });
        return Err(err(first.clone()));
    }
    Err(err(format!("{what} failed: {}", describe(r))))
}

/// One device's primary context, retained for the life of the process.
#[derive(Debug)]
pub(crate) struct Device {
    pub ordinal: usize,
    pub ctx: sys::CUcontext,
    pub name: String,
    pub cc: (i32, i32),
    pub sm_count: i32,
    /// Largest L2 set-aside for persisting accesses, and largest access
    /// policy window, in bytes.
    pub l2_persist_max: usize,
    pub l2_window_max: usize,
    /// Shared memory a block may opt into, in bytes (0 where not reported).
    pub smem_optin: usize,
}

// SAFETY: a CUcontext handle may be used from any thread once made current there.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Device {
    pub fn open(ordinal: usize) -> Result<Arc<Device>> {
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            check(sys::cuInit(0), "cuInit")?;
            let mut count = 0;
            check(sys::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            if ordinal >= count.max(0) as usize {
                return Err(err(format!("no CUDA device {ordinal}: the driver sees {count} device(s)")));
            }
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, ordinal as i32), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let mut name = [0 as std::ffi::c_char; 256];
            check(sys::cuDeviceGetName(name.as_mut_ptr(), 255, dev), "cuDeviceGetName")?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let attr = |a: sys::CUdevice_attribute| -> Result<i32> {
                let mut v = 0;
                check(sys::cuDeviceGetAttribute(&mut v, a, dev), "cuDeviceGetAttribute")?;
                Ok(v)
            };
            let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
            let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
            let sm_count = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
            // Zero where the driver does not report them: no L2 window then.
            let l2_persist_max =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE).unwrap_or(0).max(0) as usize;
            let l2_window_max =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE).unwrap_or(0).max(0) as usize;
            let smem_optin =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).unwrap_or(0).max(0) as usize;
            Ok(Arc::new(Device { ordinal, ctx, name, cc: (major, minor), sm_count, l2_persist_max, l2_window_max, smem_optin }))
        }
    }

    /// Makes this device's context current on the calling thread (cheap).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: ctx is a retained primary context.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// Sets aside `bytes` of L2 for persisting accesses (context-wide).
    pub fn set_l2_persist(&self, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: a plain limit.
        check(unsafe { sys::cuCtxSetLimit(sys::CUlimit::CU_LIMIT_PERSISTING_L2_CACHE_SIZE, bytes) }, "cuCtxSetLimit(persisting L2)")
    }

    /// Turns every persisting line in L2 back to normal.
    pub fn reset_l2_persisting(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no arguments.
        check(unsafe { sys::cuCtxResetPersistingL2Cache() }, "cuCtxResetPersistingL2Cache")
    }

    pub fn mem_info(&self) -> Result<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals.
        check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
        Ok((free as u64, total as u64))
    }

    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: no arguments.
        check(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")
    }
}

/// Device memory, freed on drop.
#[derive(Debug)]
pub(crate) struct DeviceBuffer {
    pub ptr: u64,
    pub bytes: u64,
}

impl DeviceBuffer {
    /// Allocates at least one byte; out of memory becomes `OutOfMemory` with
    /// the free bytes the driver reports.
    pub fn alloc(dev: &Device, bytes: u64) -> Result<DeviceBuffer> {
        dev.bind()?;
        let mut ptr = 0;
        // SAFETY: out-pointer to a local.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1) as usize) };
        if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            let free = dev.mem_info().map(|(f, _)| f).unwrap_or(0);
            return Err(RuntimeError::OutOfMemory { requested: bytes, free });
        }
        check(r, &format!("cuMemAlloc({bytes} bytes)"))?;
        Ok(DeviceBuffer { ptr, bytes })
    }

    /// Synchronous upload (used at prepare time and for weight refresh).
    pub fn upload(&self, offset: u64, data: &[u8]) -> Result<()> {
        if offset + data.len() as u64 > self.bytes {
            return Err(err(format!("upload of {} bytes at {offset} overruns a {}-byte buffer", data.len(), self.bytes)));
        }
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: range checked above; data is a live host slice.
        check(unsafe { sys::cuMemcpyHtoD_v2(self.ptr + offset, data.as_ptr() as *const c_void, data.len()) }, "cuMemcpyHtoD")
    }

    pub fn download(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        if offset + out.len() as u64 > self.bytes {
            return Err(err(format!("download of {} bytes at {offset} overruns a {}-byte buffer", out.len(), self.bytes)));
        }
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: range checked above; out is a live host slice.
        check(unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, self.ptr + offset, out.len()) }, "cuMemcpyDtoH")
    }

    pub fn zero(&self) -> Result<()> {
        // SAFETY: whole allocation.
        check(unsafe { sys::cuMemsetD8_v2(self.ptr, 0, self.bytes as usize) }, "cuMemsetD8")
    }

    /// Zeroes bytes `offset..offset + len`, in order on `stream`.
    pub fn zero_range_on(&self, stream: &Stream, offset: u64, len: u64) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(err(format!("zeroing {len} bytes at {offset} overruns a {}-byte buffer", self.bytes)));
        }
        // SAFETY: range checked above; the stream outlives the call.
        check(unsafe { sys::cuMemsetD8Async(self.ptr + offset, 0, len as usize, stream.0) }, "cuMemsetD8Async")
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc; a failure here can only be reported, not fixed.
        unsafe {
            sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// Page-locked host memory: the staging area async copies (and captured
/// copies) need.
#[derive(Debug)]
pub(crate) struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    device: Option<u64>,
}

// SAFETY: plain memory; access is serialised by the owning executable.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    pub fn alloc(dev: &Device, len: usize) -> Result<PinnedBuffer> {
        dev.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(unsafe { sys::cuMemHostAlloc(&mut p, len.max(8), sys::CU_MEMHOSTALLOC_PORTABLE) }, &format!("cuMemHostAlloc({len} bytes)"))?;
        // SAFETY: p points to at least len.max(8) bytes.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, len.max(8)) };
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: p came from cuMemHostAlloc above; out-pointer to a local.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0) } == CUresult::CUDA_SUCCESS;
        Ok(PinnedBuffer { ptr: p as *mut u8, len, device: mapped.then_some(d) })
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// The buffer's address for kernels (mapped pinned memory), if the
    /// driver maps it (always with unified addressing).
    pub fn device_ptr(&self) -> Option<u64> {
        self.device
    }
    /// Bytes off..off + len, or `None` when that range is not all inside
    /// the buffer (never a silently shorter slice).
    pub fn slice(&self, off: usize, len: usize) -> Option<&[u8]> {
        let end = off.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // SAFETY: off..end lies inside the allocation (checked above).
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) })
    }
    /// Copies data to off; an error when it would not fit (nothing written).
    pub fn write(&mut self, off: usize, data: &[u8]) -> Result<()> {
        match off.checked_add(data.len()) {
            Some(end) if end <= self.len => {
                // SAFETY: off..end lies inside the allocation (checked above).
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
                Ok(())
            }
            _ => Err(RuntimeError::backend(
                "cuda",
                format!("staging write of {} bytes at offset {off} overruns the {}-byte pinned buffer", data.len(), self.len),
            )),
        }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemHostAlloc.
        unsafe {
            sys::cuMemFreeHost(self.ptr as *mut c_void);
        }
    }
}

#[derive(Debug)]
pub(crate) struct Stream(pub sys::CUstream);
// SAFETY: stream handles are usable from any thread with the context current.
unsafe impl Send for Stream {}

impl Stream {
    pub fn new(dev: &Device) -> Result<Stream> {
        dev.bind()?;
        let mut s = std::ptr::null_mut();
        // Non-blocking: never serialised behind the legacy default stream,
        // which synchronous uploads from other threads use.
        check(unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) }, "cuStreamCreate")?;
        Ok(Stream(s))
    }
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: live stream.
        check(unsafe { sys::cuStreamSynchronize(self.0) }, "cuStreamSynchronize")
    }
    /// Work enqueued after this waits for `e`'s last record (in a capture:
    /// this stream joins the capture, depending on what `e` recorded).
    pub fn wait(&self, e: &Event) -> Result<()> {
        // SAFETY: live stream and event.
        check(unsafe { sys::cuStreamWaitEvent(self.0, e.0, 0) }, "cuStreamWaitEvent")
    }
    /// `wait` on an event another owner keeps alive (the caller's duty).
    pub fn wait_raw(&self, e: sys::CUevent) -> Result<()> {
        // SAFETY: live stream; the caller guarantees the event is live.
        check(unsafe { sys::cuStreamWaitEvent(self.0, e, 0) }, "cuStreamWaitEvent")
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: live stream; pending work completes before release per the driver.
        unsafe {
            sys::cuStreamDestroy_v2(self.0);
        }
    }
}

#[derive(Debug)]
pub(crate) struct Event(pub sys::CUevent);
// SAFETY: as for Stream.
unsafe impl Send for Event {}

impl Event {
    pub fn new(timing: bool) -> Result<Event> {
        let mut e = std::ptr::null_mut();
        let flags = if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        // SAFETY: out-pointer to a local.
        check(unsafe { sys::cuEventCreate(&mut e, flags as u32) }, "cuEventCreate")?;
        Ok(Event(e))
    }
    pub fn record(&self, s: &Stream) -> Result<()> {
        // SAFETY: live event and stream.
        check(unsafe { sys::cuEventRecord(self.0, s.0) }, "cuEventRecord")
    }
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: live event.
        check(unsafe { sys::cuEventSynchronize(self.0) }, "cuEventSynchronize")
    }
    /// Milliseconds between two recorded timing events.
    pub fn elapsed_ms(start: &Event, end: &Event) -> Result<f32> {
        let mut ms = 0.0f32;
        // SAFETY: out-pointer to a local; both events live.
        check(unsafe { sys::cuEventElapsedTime_v2(&mut ms, start.0, end.0) }, "cuEventElapsedTime")?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: live event.
        unsafe {
            sys::cuEventDestroy_v2(self.0);
        }
    }
}

/// A recorded and instantiated CUDA graph: one replay segment of one slot.
#[derive(Debug)]
pub(crate) struct GraphExec {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    pub nodes: usize,
    /// Edges recorded as programmatic (programmatic dependent launch).
    pub pdl_edges: usize,
    /// Memset and memcpy nodes left in the graph.
    pub copy_nodes: usize,
    /// Memset nodes replaced by fill kernels.
    pub converted: usize,
}
// SAFETY: as for Stream.
unsafe impl Send for GraphExec {}

impl GraphExec {
    /// Records whatever `body` enqueues on `s` into a graph. Thread-local
    /// capture mode: other threads' allocations and syncs stay legal.
    /// With `fill` (the `fill_pitched` kernel), memset nodes (cuBLASLt
    /// records some) become kernel nodes: a memset node costs about a
    /// microsecond of host time at every graph launch, a kernel node less.
    ///
    /// With `window` (ptr, bytes, hit ratio), every kernel node gets that L2
    /// access policy window: accesses to it persist in L2's set-aside.
    /// `dump` prints every node on stderr (`CudaOptions::graph_dump`).
    pub fn capture(
        s: &Stream,
        fill: Option<Func>,
        window: Option<(u64, usize, f32)>,
        dump: bool,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<GraphExec> {
        // SAFETY: live stream; capture is always ended below, even if body fails.
        unsafe {
            check(
                sys::cuStreamBeginCapture_v2(s.0, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                "cuStreamBeginCapture",
            )?;
            let res = body();
            let mut graph = std::ptr::null_mut();
            let end = sys::cuStreamEndCapture(s.0, &mut graph);
            res?;
            check(end, "cuStreamEndCapture")?;
            let converted = match fill.map(|f| memsets_to_kernels(graph, f)).transpose() {
                Ok(n) => n.unwrap_or(0),
                Err(e) => {
                    sys::cuGraphDestroy(graph);
                    return Err(e);
                }
            };
            if let Some(Err(e)) = window.map(|w| set_window(graph, w)) {
                sys::cuGraphDestroy(graph);
                return Err(e);
            }
            let kinds = match node_types(graph) {
                Ok(k) => k,
                Err(e) => {
                    sys::cuGraphDestroy(graph);
                    return Err(e);
                }
            };
            let nodes = kinds.len();
            if dump {
                // A diagnostic: a failure to describe a node is only reported.
                if let Err(e) = dump_graph(graph) {
                    eprintln!("rlx-cuda: graph dump: {e}");
                }
            }
            let copy_nodes = kinds
                .iter()
                .filter(|t| matches!(t, sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET | sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY))
                .count();
            let pdl_edges = programmatic_edges(graph).unwrap_or(0);
            let mut exec = std::ptr::null_mut();
            let r = sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0);
            if r != CUresult::CUDA_SUCCESS {
                sys::cuGraphDestroy(graph);
                return Err(err(format!("cuGraphInstantiate failed: {}", describe(r))));
            }
            let g = GraphExec { graph, exec, nodes, pdl_edges, copy_nodes, converted };
            // Uploading now moves the one-time setup of the executable graph
            // out of the first replayed call.
            check(sys::cuGraphUpload(exec, s.0), "cuGraphUpload")?;
            Ok(g)
        }
    }
    pub fn launch(&self, s: &Stream) -> Result<()> {
        // SAFETY: live exec and stream.
        check(unsafe { sys::cuGraphLaunch(self.exec, s.0) }, "cuGraphLaunch")
    }
}

/// Node handles of a captured graph.
unsafe fn graph_nodes(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNode>> {
    let mut n = 0usize;
    check(sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n), "cuGraphGetNodes")?;
    let mut nodes = vec![std::ptr::null_mut(); n];
    check(sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n), "cuGraphGetNodes")?;
    nodes.truncate(n);
    Ok(nodes)
}

/// The type of every node of a graph.
unsafe fn node_types(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNodeType>> {
    graph_nodes(graph)?
        .into_iter()
        .map(|node| {
            let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            check(sys::cuGraphNodeGetType(node, &mut ty), "cuGraphNodeGetType").map(|_| ty)
        })
        .collect()
}

/// Replaces every memset node of `graph` by a launch of `fill`
/// (`fill_pitched(dst, pitch, width, height, value, esize)`) with the same
/// incoming and outgoing edges (edge data kept); returns how many.
unsafe fn memsets_to_kernels(graph: sys::CUgraph, fill: Func) -> Result<usize> {
    let mut converted = 0;
    for (node, ty) in graph_nodes(graph)?.into_iter().zip(node_types(graph)?) {
        if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET {
            continue;
        }
        let mut mp: sys::CUDA_MEMSET_NODE_PARAMS = std::mem::zeroed();
        check(sys::cuGraphMemsetNodeGetParams(node, &mut mp), "cuGraphMemsetNodeGetParams")?;
        let edges = |out: bool| -> Result<(Vec<sys::CUgraphNode>, Vec<sys::CUgraphEdgeData>)> {
            let get = |nodes: *mut sys::CUgraphNode, data: *mut sys::CUgraphEdgeData, n: *mut usize| {
                if out {
                    sys::cuGraphNodeGetDependentNodes_v2(node, nodes, data, n)
                } else {
                    sys::cuGraphNodeGetDependencies_v2(node, nodes, data, n)
                }
            };
            let mut n = 0usize;
            check(get(std::ptr::null_mut(), std::ptr::null_mut(), &mut n), "cuGraphNodeGetDependencies")?;
            let mut nodes = vec![std::ptr::null_mut(); n];
            let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); n];
            check(get(nodes.as_mut_ptr(), data.as_mut_ptr(), &mut n), "cuGraphNodeGetDependencies")?;
            nodes.truncate(n);
            data.truncate(n);
            Ok((nodes, data))
        };
        let (ins, in_data) = edges(false)?;
        let (outs, out_data) = edges(true)?;
        let elems = (mp.width as u64) * (mp.height as u64);
        let args = Params::new(&FillP {
            dst: mp.dst,
            pitch: mp.pitch as i64,
            width: mp.width as i64,
            height: mp.height as i64,
            value: mp.value as i64,
            esize: mp.elementSize as i64,
        });
        fill.check(&args)?;
        let mut kparams = [args.as_ptr() as *mut c_void];
        let mut kp: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
        kp.func = fill.handle;
        kp.gridDimX = elems.div_ceil(256).clamp(1, 1024) as u32;
        kp.gridDimY = 1;
        kp.gridDimZ = 1;
        kp.blockDimX = 256;
        kp.blockDimY = 1;
        kp.blockDimZ = 1;
        kp.kernelParams = kparams.as_mut_ptr();
        let mut k = std::ptr::null_mut();
        check(sys::cuGraphAddKernelNode_v2(&mut k, graph, std::ptr::null(), 0, &kp), "cuGraphAddKernelNode")?;
        for (from, d) in ins.iter().zip(&in_data) {
            check(sys::cuGraphAddDependencies_v2(graph, from, &k, d, 1), "cuGraphAddDependencies")?;
        }
        for (to, d) in outs.iter().zip(&out_data) {
            check(sys::cuGraphAddDependencies_v2(graph, &k, to, d, 1), "cuGraphAddDependencies")?;
        }
        check(sys::cuGraphDestroyNode(node), "cuGraphDestroyNode")?;
        converted += 1;
    }
    Ok(converted)
}

/// Gives every kernel node of `graph` the L2 access policy window
/// (ptr, bytes, hit ratio): persisting hits, streaming misses.
unsafe fn set_window(graph: sys::CUgraph, (ptr, bytes, hit): (u64, usize, f32)) -> Result<()> {
    for (node, ty) in graph_nodes(graph)?.into_iter().zip(node_types(graph)?) {
        if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            continue;
        }
        let mut v: sys::CUkernelNodeAttrValue = std::mem::zeroed();
        v.accessPolicyWindow = sys::CUaccessPolicyWindow {
            base_ptr: ptr as *mut c_void,
            num_bytes: bytes,
            hitRatio: hit,
            hitProp: sys::CUaccessProperty::CU_ACCESS_PROPERTY_PERSISTING,
            missProp: sys::CUaccessProperty::CU_ACCESS_PROPERTY_STREAMING,
        };
        check(
            sys::cuGraphKernelNodeSetAttribute(node, sys::CUkernelNodeAttrID::CU_LAUNCH_ATTRIBUTE_ACCESS_POLICY_WINDOW, &v),
            "cuGraphKernelNodeSetAttribute(access policy window)",
        )?;
    }
    Ok(())
}

/// Diagnostic (`RLX_GRAPH_DUMP=1`): one line per node of a recorded graph on
/// stderr: its type, or for a kernel its grid, block, dynamic shared memory,
/// parameter bytes, cluster shape and name.
unsafe fn dump_graph(graph: sys::CUgraph) -> Result<()> {
    for (i, (nd, ty)) in graph_nodes(graph)?.into_iter().zip(node_types(graph)?).enumerate() {
        if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            eprintln!("node {i}: {ty:?}");
            continue;
        }
        let mut p: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
        check(sys::cuGraphKernelNodeGetParams_v2(nd, &mut p), "cuGraphKernelNodeGetParams")?;
        let mut name: *const std::ffi::c_char = std::ptr::null();
        let nm = if sys::cuFuncGetName(&mut name, p.func) == CUresult::CUDA_SUCCESS && !name.is_null() {
            CStr::from_ptr(name).to_string_lossy().chars().take(90).collect()
        } else {
            "?".to_string()
        };
        let bytes = param_bytes(p.func).unwrap_or(0);
        let mut v: sys::CUkernelNodeAttrValue = std::mem::zeroed();
        sys::cuGraphKernelNodeGetAttribute(nd, sys::CUkernelNodeAttrID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, &mut v);
        let c = v.clusterDim;
        eprintln!(
            "node {i}: grid {}x{}x{} block {} smem {} params {bytes}B cluster {}x{}x{} {nm}",
            p.gridDimX,
            p.gridDimY,
            p.gridDimZ,
            p.blockDimX * p.blockDimY * p.blockDimZ,
            p.sharedMemBytes,
            c.x,
            c.y,
            c.z
        );
    }
    Ok(())
}

/// How many of a graph's edges are programmatic (a kernel launched as a
/// programmatic dependent of the kernel before it, recorded by capture).
unsafe fn programmatic_edges(graph: sys::CUgraph) -> Result<usize> {
    let mut n = 0usize;
    let null = std::ptr::null_mut();
    check(sys::cuGraphGetEdges_v2(graph, null, null, std::ptr::null_mut(), &mut n), "cuGraphGetEdges")?;
    let mut from = vec![std::ptr::null_mut(); n];
    let mut to = vec![std::ptr::null_mut(); n];
    // SAFETY (caller): edge data is plain bytes; zero is a valid value.
    let mut data: Vec<sys::CUgraphEdgeData> = vec![std::mem::zeroed(); n];
    check(sys::cuGraphGetEdges_v2(graph, from.as_mut_ptr(), to.as_mut_ptr(), data.as_mut_ptr(), &mut n), "cuGraphGetEdges")?;
    let programmatic = sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8;
    Ok(data.iter().take(n).filter(|d| d.type_ == programmatic).count())
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: both handles came from capture/instantiate above.
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}

/// A loaded CUBIN. Functions stay valid while the module lives; modules are
/// kept for the life of the process (see kernels.rs).
#[derive(Debug)]
pub(crate) struct Module(pub sys::CUmodule);
// SAFETY: module handles are context-wide.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    pub fn load(dev: &Device, cubin: &[u8]) -> Result<Module> {
        dev.bind()?;
        let mut m = std::ptr::null_mut();
        // SAFETY: cubin is a complete image produced by NVRTC.
        check(unsafe { sys::cuModuleLoadData(&mut m, cubin.as_ptr() as *const c_void) }, "cuModuleLoadData")?;
        Ok(Module(m))
    }
    /// Every kernel in the module with its name (names pasted together by
    /// macros in the .cu files included) and parameter size.
    pub fn functions(&self) -> Result<Vec<(String, Func)>> {
        let info = param_info_available();
        let mut n = 0u32;
        // SAFETY: live module; out-pointers sized from the count.
        unsafe {
            check(sys::cuModuleGetFunctionCount(&mut n, self.0), "cuModuleGetFunctionCount")?;
            let mut fs: Vec<sys::CUfunction> = vec![std::ptr::null_mut(); n as usize];
            check(sys::cuModuleEnumerateFunctions(fs.as_mut_ptr(), n, self.0), "cuModuleEnumerateFunctions")?;
            let mut out = Vec::with_capacity(fs.len());
            for f in fs {
                let mut name: *const std::ffi::c_char = std::ptr::null();
                check(sys::cuFuncGetName(&mut name, f), "cuFuncGetName")?;
                if !name.is_null() {
                    let params = if info { param_bytes(f) } else { None };
                    out.push((CStr::from_ptr(name).to_string_lossy().into_owned(), Func { handle: f, params }));
                }
            }
            Ok(out)
        }
    }
}

/// Whether the driver has `cuFuncGetParamInfo` (CUDA 12.4 and later);
/// cudarc would panic on a missing symbol.
fn param_info_available() -> bool {
    driver_version().is_ok_and(|v| v >= 12040)
}

/// Bytes of a kernel's parameters (the end of the last one), or None when
/// the driver does not say. RLX kernels have one parameter, the struct.
unsafe fn param_bytes(f: sys::CUfunction) -> Option<usize> {
    let mut bytes = None;
    for k in 0..256 {
        let (mut off, mut sz) = (0usize, 0usize);
        if sys::cuFuncGetParamInfo(f, k, &mut off, &mut sz) != CUresult::CUDA_SUCCESS {
            break;
        }
        bytes = Some(off + sz);
    }
    bytes
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Func {
    handle: sys::CUfunction,
    /// Its parameter bytes as the driver reports them (None: not reported).
    params: Option<usize>,
}
// SAFETY: function handles are immutable once loaded.
unsafe impl Send for Func {}
unsafe impl Sync for Func {}

impl Func {
    /// An error unless `p` is as large as this kernel's parameters (where
    /// the driver reports them): a launch reads that many bytes from it.
    pub fn check(&self, p: &Params) -> Result<()> {
        match self.params {
            Some(n) if n != p.bytes() => Err(err(format!(
                "a kernel takes {n} bytes of parameters, but it is launched with {}, {} bytes: kernels/*.cu and src/params.rs disagree",
                p.name,
                p.bytes()
            ))),
            _ => Ok(()),
        }
    }

    /// Lets launches of this function ask for up to `bytes` of dynamic
    /// shared memory (above 48 KB needs this opt-in).
    pub fn set_max_dynamic_smem(&self, bytes: u32) -> Result<()> {
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: live function handle; a plain integer attribute.
        check(unsafe { sys::cuFuncSetAttribute(self.handle, attr, bytes as i32) }, "cuFuncSetAttribute(max dynamic shared memory)")
    }

    /// Lets launches of this function use clusters of more than 8 blocks
    /// (up to 16 on the H100 / H200).
    pub fn allow_non_portable_clusters(&self) -> Result<()> {
        let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED;
        // SAFETY: live function handle; a plain integer attribute.
        check(unsafe { sys::cuFuncSetAttribute(self.handle, attr, 1) }, "cuFuncSetAttribute(non-portable cluster size)")
    }

    /// How many clusters of `cluster` blocks (x) of `block` threads and
    /// `smem` dynamic shared bytes can be resident on the device at once.
    pub fn max_active_clusters(&self, grid: u32, block: u32, smem: u32, cluster: u32) -> Result<u32> {
        // SAFETY: an all-zero attribute is a valid value of the C union.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attr.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: cluster, y: 1, z: 1 };
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: std::ptr::null_mut(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: live function handle; cfg and attr are live locals; n is written by the call.
        check(unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, self.handle, &cfg) }, "cuOccupancyMaxActiveClusters")?;
        Ok(n.max(0) as u32)
    }

    /// Launches with its by-value parameter struct, a twin of the kernel's C
    /// struct (src/params.rs; `check` compares their sizes when the step is
    /// built). `pdl`: programmatic dependent launch (sm_90+), so the kernel may start
    /// while the previous kernel on the stream drains; every RLX kernel waits
    /// for its predecessor first (`pdl_enter` in kernels/common.cuh). Stream
    /// capture records it as a programmatic graph edge. `cluster` other than
    /// [1, 1, 1]: blocks run in thread-block clusters of those dimensions (sm_90+).
    #[allow(clippy::too_many_arguments)]
    pub fn launch(&self, s: &Stream, grid: [u32; 3], block: u32, smem: u32, cluster: [u32; 3], args: &Params, pdl: bool) -> Result<()> {
        let clustered = cluster != [1, 1, 1];
        // The kernel's one parameter is the struct: kernelParams[0] points at it.
        let mut params = [args.as_ptr() as *mut c_void];
        if !pdl && !clustered {
            // SAFETY: args outlives the call (the driver copies parameters at launch).
            let r = unsafe {
                sys::cuLaunchKernel(
                    self.handle,
                    grid[0],
                    grid[1],
                    grid[2],
                    block,
                    1,
                    1,
                    smem,
                    s.0,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            return check(r, "cuLaunchKernel");
        }
        // SAFETY: an all-zero attribute is a valid value of the C union; the
        // id and the one field it selects are set right after.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if pdl {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if clustered {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            let [x, y, z] = cluster;
            attrs[n].value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x, y, z };
            n += 1;
        }
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid[0],
            gridDimY: grid[1],
            gridDimZ: grid[2],
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: s.0,
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        // SAFETY: cfg and attrs are live locals; args as above.
        let r = unsafe { sys::cuLaunchKernelEx(&cfg, self.handle, params.as_mut_ptr(), std::ptr::null_mut()) };
        check(r, "cuLaunchKernelEx (programmatic dependent launch / cluster)")
    }
}

pub(crate) fn driver_version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: out-pointer to a local.
    check(unsafe { sys::cuDriverGetVersion(&mut v) }, "cuDriverGetVersion")?;
    Ok(v)
}

pub(crate) unsafe extern "C" fn host_trampoline(data: *mut c_void) {
    // SAFETY: data is a `*const HostTask` kept alive by its slot for the
    // executable's lifetime; the driver calls this once per enqueue.
    let task = &*(data as *const crate::hostops::HostTask);
    task.run();
}

/// Enqueues a host callback that runs `task` once prior stream work is done.
pub(crate) fn launch_host(s: &Stream, task: *const crate::hostops::HostTask) -> Result<()> {
    // SAFETY: see host_trampoline.
    check(unsafe { sys::cuLaunchHostFunc(s.0, Some(host_trampoline), task as *mut c_void) }, "cuLaunchHostFunc")
}

pub(crate) fn memcpy_htod_async(dst: u64, src: *const u8, bytes: usize, s: &Stream) -> Result<()> {
    // SAFETY: src is pinned memory owned by the slot; dst is inside an arena.
    check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, s.0) }, "cuMemcpyHtoDAsync")
}

pub(crate) fn memcpy_dtoh_async(dst: *mut u8, src: u64, bytes: usize, s: &Stream) -> Result<()> {
    // SAFETY: dst is pinned memory owned by the slot.
    check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, s.0) }, "cuMemcpyDtoHAsync")
}
