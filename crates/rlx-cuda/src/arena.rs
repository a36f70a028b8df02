//! Memory and order shared by the executables of one state set on a
//! device (`StateSet::backend_object`): one activation arena at a fixed
//! address that grows in place (`GrowableBuffer`), the order of their
//! calls, and one cuBLASLt handle and workspace.
//!
//! A decoder's server records hundreds of steps (a decode step per width,
//! prefill chunks per slot, side-by-side prefills), each of which would
//! otherwise hold its own arena and workspace. Nothing in an arena lives
//! from one call to the next (inputs are copied in and outputs out within
//! a call; KV caches are states), so executables whose calls never overlap
//! can share one. Their calls are ordered on the device: each call waits
//! (cuStreamWaitEvent) for the call submitted before it to another
//! executable of the set; a prepare, and reading or zeroing state, wait for
//! that call on the host and hold the set meanwhile.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::{self, CUresult};
use rlx_runtime::{Result, RuntimeError};

use crate::blas::Blas;
use crate::driver::{check, Device, Stream};

/// Device memory at a fixed address that grows in place (CUDA's virtual
/// memory management): a virtual range as large as the device's memory is
/// reserved once, and physical memory is mapped into it as `grow_to` asks.
/// Recorded graphs that hold its address stay valid as it grows.
#[derive(Debug)]
pub(crate) struct GrowableBuffer {
    pub ptr: u64,
    /// Bytes mapped from `ptr` on.
    pub bytes: u64,
    reserved: usize,
    granularity: usize,
    ordinal: i32,
    /// The physical allocations mapped, in address order, with their sizes.
    chunks: Vec<(sys::CUmemGenericAllocationHandle, usize)>,
}

// SAFETY: handles and addresses are plain values usable from any thread
// with the context current; the owner serialises growth.
unsafe impl Send for GrowableBuffer {}

impl GrowableBuffer {
    fn prop(ordinal: i32) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct; zero is "none" for every field not set.
        let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        p.location.id = ordinal;
        p
    }

    /// Reserves the range, or None where the device has no virtual memory
    /// management.
    pub fn reserve(dev: &Device) -> Result<Option<GrowableBuffer>> {
        dev.bind()?;
        let mut cu = 0;
        check(unsafe { sys::cuDeviceGet(&mut cu, dev.ordinal as i32) }, "cuDeviceGet")?;
        let mut vmm = 0;
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
        // SAFETY: out-pointer to a local.
        check(unsafe { sys::cuDeviceGetAttribute(&mut vmm, attr, cu) }, "cuDeviceGetAttribute")?;
        if vmm == 0 {
            return Ok(None);
        }
        let prop = Self::prop(dev.ordinal as i32);
        let mut granularity = 0usize;
        let how = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED;
        // SAFETY: out-pointer to a local; prop lives across the call.
        check(unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, how) }, "cuMemGetAllocationGranularity")?;
        let granularity = granularity.max(1);
        let (_, total) = dev.mem_info()?;
        let reserved = (total as usize).div_ceil(granularity) * granularity;
        let mut ptr = 0;
        // SAFETY: out-pointer to a local.
        check(unsafe { sys::cuMemAddressReserve(&mut ptr, reserved, granularity, 0, 0) }, "cuMemAddressReserve")?;
        Ok(Some(GrowableBuffer { ptr, bytes: 0, reserved, granularity, ordinal: dev.ordinal as i32, chunks: Vec::new() }))
    }

    /// Maps memory so that at least `bytes` from `ptr` on are usable (a
    /// no-op when they already are). Out of memory, or past the device's
    /// size, is `OutOfMemory`.
    pub fn grow_to(&mut self, dev: &Device, bytes: u64) -> Result<()> {
        if bytes <= self.bytes {
            return Ok(());
        }
        let oom = |dev: &Device| RuntimeError::OutOfMemory { requested: bytes, free: dev.mem_info().map(|(f, _)| f).unwrap_or(0) };
        let want = (bytes as usize).div_ceil(self.granularity) * self.granularity;
        if want > self.reserved {
            return Err(oom(dev));
        }
        dev.bind()?;
        let size = want - self.bytes as usize;
        let prop = Self::prop(self.ordinal);
        let mut handle = 0;
        // SAFETY: out-pointer to a local; prop lives across the call.
        let r = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        if r == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            return Err(oom(dev));
        }
        check(r, &format!("cuMemCreate({size} bytes)"))?;
        let at = self.ptr + self.bytes;
        // SAFETY: [at, at + size) lies inside the reserved range and is unmapped.
        if let Err(e) = check(unsafe { sys::cuMemMap(at, size, 0, handle, 0) }, "cuMemMap") {
            unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        let mut access: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        access.location = prop.location;
        access.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: the range was just mapped; one descriptor.
        if let Err(e) = check(unsafe { sys::cuMemSetAccess(at, size, &access, 1) }, "cuMemSetAccess") {
            unsafe {
                sys::cuMemUnmap(at, size);
                sys::cuMemRelease(handle);
            }
            return Err(e);
        }
        self.chunks.push((handle, size));
        self.bytes = want as u64;
        Ok(())
    }
}

impl Drop for GrowableBuffer {
    fn drop(&mut self) {
        // SAFETY: every chunk was mapped at its place in order; the range
        // was reserved here. Failures can only be reported, not fixed.
        unsafe {
            let mut at = self.ptr;
            for (handle, size) in &self.chunks {
                sys::cuMemUnmap(at, *size);
                sys::cuMemRelease(*handle);
                at += *size as u64;
            }
            sys::cuMemAddressFree(self.ptr, self.reserved);
        }
    }
}

/// What the executables bound to one state set share on a device: one
/// activation arena (None where the device has no virtual memory
/// management, or the driver refused the reserve: each then has its own),
/// the order of their calls, and one cuBLASLt handle and workspace.
pub(crate) struct SharedArena {
    mem: Option<Mutex<GrowableBuffer>>,
    last: Mutex<LastCall>,
    /// The cuBLASLt handle and workspace of those that run cuBLASLt matmuls.
    blas: Mutex<Option<Arc<Blas>>>,
}

/// The executable whose call was submitted last (its id), and the
/// completion event of that call (one of its slots' events: the executable
/// clears this before it drops them).
pub(crate) struct LastCall(pub Option<(u64, sys::CUevent)>);
// SAFETY: an event handle is usable from any thread with the context current.
unsafe impl Send for LastCall {}

impl LastCall {
    /// Waits on the host until the last call has finished (none: at once).
    pub fn synchronize(&self) -> Result<()> {
        match self.0 {
            // SAFETY: the event's executable clears `last` before it drops it.
            Some((_, ev)) => {
                check(unsafe { sys::cuEventSynchronize(ev) }, "waiting for the state set's previous call (cuEventSynchronize)")
            }
            None => Ok(()),
        }
    }
    /// Makes `stream`'s later work wait for the last call, unless that
    /// call was executable `uid`'s own (its stream orders it already).
    pub fn order_after(&self, uid: u64, stream: &Stream) -> Result<()> {
        match self.0 {
            Some((last, ev)) if last != uid => stream.wait_raw(ev),
            _ => Ok(()),
        }
    }
}

impl SharedArena {
    /// A reserve the driver refuses leaves each executable its own arena
    /// (said under `trace`).
    pub fn new(dev: &Device, trace: bool) -> SharedArena {
        let mem = match GrowableBuffer::reserve(dev) {
            Ok(m) => m,
            Err(e) => {
                if trace {
                    eprintln!("rlx-cuda: a state set's executables keep their own arenas: {e}");
                }
                None
            }
        };
        SharedArena { mem: mem.map(Mutex::new), last: Mutex::new(LastCall(None)), blas: Mutex::new(None) }
    }
    /// The arena's address, grown to `bytes`; None without a shared arena.
    pub fn grow_to(&self, dev: &Device, bytes: u64) -> Result<Option<u64>> {
        let Some(mem) = &self.mem else { return Ok(None) };
        let mut m = mem.lock().unwrap_or_else(|p| p.into_inner());
        m.grow_to(dev, bytes)?;
        Ok(Some(m.ptr))
    }
    /// The set's cuBLASLt handle with the full workspace, made on first use.
    pub fn blas(&self, dev: &Device) -> Result<Arc<Blas>> {
        let mut b = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(blas) = &*b {
            return Ok(blas.clone());
        }
        let blas = Arc::new(Blas::new(dev, true)?);
        *b = Some(blas.clone());
        Ok(blas)
    }
    /// The record of the last call; holding it holds the set's calls.
    pub fn last(&self) -> MutexGuard<'_, LastCall> {
        self.last.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Synchronises a stream when dropped: a prepare that fails after queueing
/// device work (matmul timing) lets it finish before it lets go of the
/// state set, on every way out.
pub(crate) struct StreamSyncGuard(pub sys::CUstream);

impl Drop for StreamSyncGuard {
    fn drop(&mut self) {
        // SAFETY: declared after the stream it names, so dropped before it.
        unsafe {
            sys::cuStreamSynchronize(self.0);
        }
    }
}
