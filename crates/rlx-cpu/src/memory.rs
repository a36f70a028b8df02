//! The one place that turns byte offsets into pointers.
//!
//! An executable's memory is a handful of regions (the slot's arena, the
//! weights, the states, the consts), each a base pointer and a length. A
//! thunk names its operands as `BufRef`s; [`Mem::src`] / [`Mem::dst`] turn one
//! into a typed view after checking that the byte range lies inside its
//! region and is aligned for the element type, so a bad schedule is an error,
//! never an out-of-bounds access. `validate.rs` additionally checks at
//! prepare time that every index a kernel derives from the thunk's dims and
//! strides stays inside the `BufRef`; the views' own asserts are a last line
//! of defence that a validated schedule never trips.
//!
//! Aliasing: different `BufRef`s may cover the same bytes (an elementwise op
//! writing in place). Views therefore hold raw pointers and only create a
//! Rust reference for the duration of one row operation; kernels never hold a
//! reference into a destination while reading an overlapping source. Writes
//! from several rayon tasks go to disjoint rows.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use rlx_schedule::{BufRef, Space};

use crate::elem::Elem;

/// Alignment of every buffer this backend allocates (a cache line, and
/// enough for AVX-512 loads).
pub const BUF_ALIGN: usize = 64;

/// A zero-initialised, 64-byte aligned heap buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation like a Vec<u8> does.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `None` when the allocation fails or the size is absurd.
    pub fn zeroed(len: usize) -> Option<AlignedBuf> {
        if len == 0 {
            return Some(AlignedBuf { ptr: NonNull::dangling(), len: 0 });
        }
        let layout = Layout::from_size_align(len, BUF_ALIGN).ok()?;
        // SAFETY: layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        NonNull::new(p).map(|ptr| AlignedBuf { ptr, len })
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<AlignedBuf> {
        let mut b = AlignedBuf::zeroed(bytes.len())?;
        b.bytes_mut().copy_from_slice(bytes);
        Some(b)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes (or dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub fn region(&self) -> Region {
        Region { base: self.ptr.as_ptr(), len: self.len }
    }

    /// Bytes `offset..offset + len` as a region, if the buffer holds them.
    pub fn view(&self, offset: usize, len: usize) -> Option<Region> {
        let end = offset.checked_add(len)?;
        // SAFETY: offset + len <= self.len, so the pointer stays inside the allocation.
        (end <= self.len).then(|| Region { base: unsafe { self.ptr.as_ptr().add(offset) }, len })
    }

    /// Zeroes bytes `offset..offset + len` (clamped to the buffer) through
    /// a shared reference: state buffers are shared by the executables of a
    /// state set, which write them through regions the same way (see the
    /// aliasing note at the top).
    pub fn zero_range(&self, offset: usize, len: usize) {
        let end = offset.saturating_add(len).min(self.len);
        if end > offset {
            // SAFETY: offset < end <= len; the caller orders this against
            // every other access to the buffer (executables bound to one
            // state set run one call at a time, by contract).
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(offset), 0, end - offset) }
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            if let Ok(layout) = Layout::from_size_align(self.len, BUF_ALIGN) {
                // SAFETY: allocated in `zeroed` with this layout.
                unsafe { dealloc(self.ptr.as_ptr(), layout) }
            }
        }
    }
}

/// A base pointer and a length: one memory space as kernels see it.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    base: *mut u8,
    len: usize,
}

impl Region {
    /// A read-only region over bytes someone else owns (a weight tensor).
    /// The caller keeps the owner alive for as long as the region is used.
    pub fn borrowed(bytes: &[u8]) -> Region {
        Region { base: bytes.as_ptr() as *mut u8, len: bytes.len() }
    }
}

/// Every region one call runs against.
pub struct Mem {
    pub arena: Region,
    pub weights: Vec<Region>,
    pub states: Vec<Region>,
    pub consts: Vec<Region>,
}

// SAFETY: the regions point into buffers the executable owns (or Arcs it
// holds) for as long as a Mem is alive; access discipline is described at
// the top of this file.
unsafe impl Send for Mem {}
unsafe impl Sync for Mem {}

impl Mem {
    fn region(&self, s: Space) -> Option<Region> {
        match s {
            Space::Arena => Some(self.arena),
            Space::Weight(i) => self.weights.get(i as usize).copied(),
            Space::State(i) => self.states.get(i as usize).copied(),
            Space::Const(i) => self.consts.get(i as usize).copied(),
        }
    }

    /// The range of `b` checked against its region and `align`.
    pub fn check(&self, b: &BufRef, align: usize) -> Result<(), String> {
        let r = self.region(b.space).ok_or_else(|| format!("{:?} does not exist in this schedule", b.space))?;
        let end =
            b.offset.checked_add(b.bytes).ok_or_else(|| format!("{:?} offset {} + {} bytes overflows", b.space, b.offset, b.bytes))?;
        if end > r.len as u64 {
            return Err(format!("{:?} bytes {}..{} lie outside the space ({} bytes)", b.space, b.offset, end, r.len));
        }
        // Alignments are element sizes: powers of two.
        if (r.base as usize + b.offset as usize) & (align.max(1) - 1) != 0 {
            return Err(format!("{:?} offset {} is not aligned to {} bytes", b.space, b.offset, align));
        }
        Ok(())
    }

    fn raw(&self, b: &BufRef, align: usize) -> Result<*mut u8, String> {
        self.check(b, align)?;
        let r = self.region(b.space).ok_or_else(|| format!("{:?} does not exist", b.space))?;
        // SAFETY: offset + bytes <= len was checked just above.
        Ok(unsafe { r.base.add(b.offset as usize) })
    }

    pub fn src<T: Copy>(&self, b: &BufRef) -> Result<Src<T>, String> {
        let p = self.raw(b, std::mem::align_of::<T>())?;
        Ok(Src { ptr: p as *const T, len: b.bytes as usize / std::mem::size_of::<T>() })
    }

    /// Weights and consts are shared and read-only; writes go to the arena
    /// or a state.
    pub fn dst<T: Copy>(&self, b: &BufRef) -> Result<Dst<T>, String> {
        if matches!(b.space, Space::Weight(_) | Space::Const(_)) {
            return Err(format!("{:?} is read-only and cannot be a destination", b.space));
        }
        let p = self.raw(b, std::mem::align_of::<T>())?;
        Ok(Dst { ptr: p as *mut T, len: b.bytes as usize / std::mem::size_of::<T>() })
    }
}

/// A typed read view of `len` elements.
#[derive(Clone, Copy)]
pub struct Src<T> {
    ptr: *const T,
    len: usize,
}

/// A typed write view of `len` elements.
#[derive(Clone, Copy)]
pub struct Dst<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: see the module docs: tasks share views and write disjoint rows.
unsafe impl<T> Send for Src<T> {}
unsafe impl<T> Sync for Src<T> {}
unsafe impl<T> Send for Dst<T> {}
unsafe impl<T> Sync for Dst<T> {}

#[inline(always)]
fn in_bounds(start: usize, n: usize, len: usize) {
    // Validated schedules never trip this (see validate.rs).
    assert!(start <= len && n <= len - start, "rlx-cpu: access {start}+{n} past a view of {len} elements");
}

impl<T: Copy> Src<T> {
    #[inline(always)]
    pub fn get(&self, i: usize) -> T {
        in_bounds(i, 1, self.len);
        // SAFETY: i < len, inside the region (checked in Mem::src).
        unsafe { self.ptr.add(i).read() }
    }
    /// A reference to `n` elements from `start`. The caller must not write
    /// these elements through an overlapping `Dst` while it is alive.
    #[inline(always)]
    pub fn row(&self, start: usize, n: usize) -> &[T] {
        in_bounds(start, n, self.len);
        // SAFETY: in bounds; aliasing discipline per module docs.
        unsafe { std::slice::from_raw_parts(self.ptr.add(start), n) }
    }
}

impl<T: Elem> Src<T> {
    /// Converts `out.len()` contiguous elements from `start` to f32.
    #[inline(always)]
    pub fn load(&self, start: usize, out: &mut [f32]) {
        T::load(self.row(start, out.len()), out);
    }
    /// Converts `out.len()` elements `start, start+stride, ..` to f32.
    #[inline]
    pub fn load_strided(&self, start: usize, stride: usize, out: &mut [f32]) {
        if stride == 1 {
            return self.load(start, out);
        }
        if let Some(last) = out.len().checked_sub(1) {
            in_bounds(start + last * stride, 1, self.len);
        }
        for (i, o) in out.iter_mut().enumerate() {
            // SAFETY: the last index was checked above; the others are smaller.
            *o = unsafe { self.ptr.add(start + i * stride).read() }.to_f32();
        }
    }
}

impl<T: Copy> Dst<T> {
    #[inline(always)]
    pub fn set(&self, i: usize, v: T) {
        in_bounds(i, 1, self.len);
        // SAFETY: i < len.
        unsafe { self.ptr.add(i).write(v) }
    }
    /// Exclusive access to `n` elements from `start` (bounds are checked).
    ///
    /// # Safety
    /// While the returned slice lives, no other reference to these
    /// elements may exist: the caller (one task) owns them, holds no
    /// overlapping `Src::row` or `row_mut` from any view of the same bytes,
    /// and parallel tasks take disjoint ranges.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn row_mut(&self, start: usize, n: usize) -> &mut [T] {
        in_bounds(start, n, self.len);
        // SAFETY: in bounds; exclusivity per the contract above.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), n) }
    }
    /// A raw pointer to element `start`, with `n` elements from there in
    /// bounds, for kernels that write a strided block of rows (other tasks
    /// own the columns between): no reference to the span is formed.
    #[inline(always)]
    pub fn ptr_at(&self, start: usize, n: usize) -> *mut T {
        in_bounds(start, n, self.len);
        // SAFETY: in bounds (checked above).
        unsafe { self.ptr.add(start) }
    }
    /// Copies elements in with memmove semantics (source may overlap).
    pub fn copy_from(&self, start: usize, src: &Src<T>, src_start: usize, n: usize) {
        in_bounds(start, n, self.len);
        in_bounds(src_start, n, src.len);
        // SAFETY: both ranges are in bounds; `copy` tolerates overlap.
        unsafe { std::ptr::copy(src.ptr.add(src_start), self.ptr.add(start), n) }
    }
}

impl<T: Elem> Dst<T> {
    /// Converts `vals` to T and writes them contiguously from `start`.
    #[inline(always)]
    pub fn store(&self, start: usize, vals: &[f32]) {
        // SAFETY: the slice lives for this call only; `store`'s callers
        // write rows no other task touches (module docs).
        T::store(vals, unsafe { self.row_mut(start, vals.len()) });
    }
}

impl<T: Copy> Src<T> {
    /// A view of host scratch memory.
    ///
    /// # Safety
    /// The view carries no lifetime: `s` must outlive every use of it, and
    /// must not be written through another path while the view is read.
    pub unsafe fn from_slice(s: &[T]) -> Src<T> {
        Src { ptr: s.as_ptr(), len: s.len() }
    }
}

impl<T: Copy> Dst<T> {
    /// A view of host scratch memory.
    ///
    /// # Safety
    /// The view carries no lifetime: `s` must outlive every use of it, and
    /// nothing else may access it while the view writes.
    pub unsafe fn from_slice(s: &mut [T]) -> Dst<T> {
        Dst { ptr: s.as_mut_ptr(), len: s.len() }
    }
}

/// A strided f32 matrix operand of a gemm call: element (i, j) at
/// `offset + i * rs + j * cs`.
pub struct MatRef<'a> {
    pub src: &'a Src<f32>,
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

/// `dst[offset + i*ldd + j] (=|+=) a · b` for an m×k by k×n product, through
/// the `gemm` crate. Checks that every element touched lies inside its view.
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32(
    dst: &Dst<f32>,
    dst_offset: usize,
    ldd: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    mnk: (usize, usize, usize),
    par: gemm::Parallelism,
) {
    gemm_f32_scaled(dst, dst_offset, ldd, accumulate, a, b, mnk, 1.0, par)
}

/// As [`gemm_f32`] with the product scaled: `dst (=|+=) scale · a · b`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32_scaled(
    dst: &Dst<f32>,
    dst_offset: usize,
    ldd: usize,
    accumulate: bool,
    a: MatRef<'_>,
    b: MatRef<'_>,
    (m, n, k): (usize, usize, usize),
    scale: f32,
    par: gemm::Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    let span = |rows: usize, cols: usize, rs: usize, cs: usize| (rows - 1) * rs + (cols - 1) * cs + 1;
    in_bounds(dst_offset, span(m, n, ldd, 1), dst.len);
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                // SAFETY: one row at a time on this thread; the caller owns `dst`.
                unsafe { dst.row_mut(dst_offset + i * ldd, n) }.fill(0.0);
            }
        }
        return;
    }
    in_bounds(a.offset, span(m, k, a.rs, a.cs), a.src.len);
    in_bounds(b.offset, span(k, n, b.rs, b.cs), b.src.len);
    // SAFETY: every index gemm forms is (i * rs + j * cs) within the spans
    // checked above; validate.rs rejected outputs that overlap a or b.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.ptr.add(dst_offset),
            1,
            ldd as isize,
            accumulate,
            a.src.ptr.add(a.offset),
            a.cs as isize,
            a.rs as isize,
            b.src.ptr.add(b.offset),
            b.cs as isize,
            b.rs as isize,
            1.0f32,
            scale,
            false,
            false,
            false,
            par,
        )
    }
}

impl<T: 'static> Src<T> {
    /// The same view as f32 when T is f32 (for f32-only fast paths).
    pub fn as_f32(&self) -> Option<Src<f32>> {
        (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()).then_some(Src { ptr: self.ptr as *const f32, len: self.len })
    }
}

impl<T: 'static> Dst<T> {
    /// The same view as f32 when T is f32.
    pub fn as_f32(&self) -> Option<Dst<f32>> {
        (std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()).then_some(Dst { ptr: self.ptr as *mut f32, len: self.len })
    }
    /// Whether a source view starts at the same address (an in-place op).
    pub fn same_start<U>(&self, src: &Src<U>) -> bool {
        std::ptr::eq(self.ptr as *const u8, src.ptr as *const u8)
    }
}
