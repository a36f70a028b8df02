//! MatMul thunks through cuBLASLt.
//!
//! cuBLASLt is column-major; our tensors are row-major. A row-major
//! `out[M, N] = A[M, K] · B[K, N]` is the column-major `outᵀ = Bᵀ · Aᵀ`, so we
//! hand cuBLASLt our B as its "A" and our A as its "B" and nothing moves.
//! Bias (and GELU-tanh) ride in the epilogue; a residual is C with beta = 1.
//! What cuBLASLt cannot fuse (erf-GELU, SiLU, ..., or an activation followed
//! by a residual) is left to our `epilogue` kernel (see `Epilogue`).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::sys as lt;
use rlx_ir::{Activation, DType};
use rlx_runtime::Result;
use rlx_schedule::MatMulThunk;

use crate::driver::{err, Device, DeviceBuffer, Stream};

/// Fixed cuBLASLt workspace, set before any capture (a graph must not allocate).
pub(crate) const WORKSPACE_BYTES: u64 = 32 << 20;

fn lt_check(s: lt::cublasStatus_t, what: &str) -> Result<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(err(format!("{what} failed: {s:?}")))
    }
}

pub fn cublaslt_present() -> bool {
    crate::libs::present(crate::libs::Lib::CublasLt)
}

pub fn cublaslt_version() -> Option<usize> {
    if !cublaslt_present() {
        return None;
    }
    // SAFETY: the library is present; the call takes no arguments.
    std::panic::catch_unwind(|| unsafe { lt::cublasLtGetVersion() }).ok()
}

/// One cuBLASLt handle and its workspace, per executable or per state set
/// (src/exec.rs `SharedArena`; a one-byte workspace where an executable of
/// its own runs no cuBLASLt matmul).
pub(crate) struct Blas {
    handle: lt::cublasLtHandle_t,
    workspace: DeviceBuffer,
}
// SAFETY: used from one thread at a time (the executable is behind &mut;
// a state set's executables enqueue work under the set's lock).
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    /// `matmuls`: whether the executable runs cuBLASLt matmuls, which need
    /// the full workspace.
    pub fn new(dev: &Device, matmuls: bool) -> Result<Blas> {
        let workspace = DeviceBuffer::alloc(dev, if matmuls { WORKSPACE_BYTES } else { 1 })?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        lt_check(unsafe { lt::cublasLtCreate(&mut handle) }, "cublasLtCreate")?;
        Ok(Blas { handle, workspace })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: handle came from cublasLtCreate.
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}

/// What runs after cuBLASLt: `out = act(out) + residual`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Epilogue {
    pub act: Option<Activation>,
    pub residual: bool,
}

/// Descriptors and the chosen algorithm for one MatMul thunk; shared by
/// every slot (only pointers differ between slots).
pub(crate) struct MatMulPlan {
    desc: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 4],
    /// cuBLASLt's first heuristic answer: the default, and the reference
    /// the timed candidates must beat (src/gemm.rs).
    pub algo: LtAlgo,
    /// Minimum alignment (bytes) of A, B, C, D as given to the heuristic.
    aligns: [u32; 4],
    /// f32 with TF32 tensor cores (part of a choice's cache key).
    pub tf32: bool,
    has_bias: bool,
    beta: f32,
    /// Our kernel still has to run after the GEMM.
    pub epilogue: Option<Epilogue>,
}
// SAFETY: immutable after creation except the bias pointer, which is set
// right before each enqueue by the single thread that owns the executable.
unsafe impl Send for MatMulPlan {}
unsafe impl Sync for MatMulPlan {}

impl Drop for MatMulPlan {
    fn drop(&mut self) {
        // SAFETY: all handles came from their create calls.
        unsafe {
            lt::cublasLtMatmulDescDestroy(self.desc);
            for l in self.layouts {
                lt::cublasLtMatrixLayoutDestroy(l);
            }
        }
    }
}

fn data_type(d: DType) -> Result<lt::cudaDataType> {
    match d {
        DType::F32 => Ok(lt::cudaDataType::CUDA_R_32F),
        DType::F16 => Ok(lt::cudaDataType::CUDA_R_16F),
        DType::BF16 => Ok(lt::cudaDataType::CUDA_R_16BF),
        other => Err(err(format!("matmul: dtype {other} is not supported (f32, f16, bf16)"))),
    }
}

/// Largest power of two (up to 256) dividing a byte offset: the alignment
/// cuBLASLt may assume for a pointer at that offset of a 256-aligned base.
fn align_of(offset: u64) -> u32 {
    if offset == 0 {
        256
    } else {
        (1u64 << offset.trailing_zeros().min(8)) as u32
    }
}

/// (rows, batch) after folding: a shared weight and a contiguous `a` make
/// the batch one tall GEMM.
pub(crate) fn folded(t: &MatMulThunk) -> (usize, usize) {
    if t.batch > 1 && t.b_batch_stride == 0 && t.a_batch_stride == t.m as u64 * t.lda {
        (t.batch * t.m, 1)
    } else {
        (t.m, t.batch)
    }
}

unsafe fn set_desc<T>(desc: lt::cublasLtMatmulDesc_t, attr: lt::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
    lt_check(
        lt::cublasLtMatmulDescSetAttribute(desc, attr, v as *const T as *const c_void, std::mem::size_of::<T>()),
        "cublasLtMatmulDescSetAttribute",
    )
}

unsafe fn layout(dt: lt::cudaDataType, rows: u64, cols: u64, ld: u64, batch: usize, stride: u64) -> Result<lt::cublasLtMatrixLayout_t> {
    let mut l = std::ptr::null_mut();
    lt_check(lt::cublasLtMatrixLayoutCreate(&mut l, dt, rows, cols, ld as i64), "cublasLtMatrixLayoutCreate")?;
    if batch > 1 {
        let count = batch as i32;
        let stride = stride as i64;
        let a = lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT;
        lt_check(lt::cublasLtMatrixLayoutSetAttribute(l, a, &count as *const i32 as *const c_void, 4), "cublasLtMatrixLayoutSetAttribute")?;
        let a = lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET;
        lt_check(
            lt::cublasLtMatrixLayoutSetAttribute(l, a, &stride as *const i64 as *const c_void, 8),
            "cublasLtMatrixLayoutSetAttribute",
        )?;
    }
    Ok(l)
}

impl MatMulPlan {
    pub fn new(blas: &Blas, t: &MatMulThunk, allow_tf32: bool) -> Result<MatMulPlan> {
        let dt = data_type(t.dtype)?;
        let (rows, batch) = folded(t);
        let fuse_act = matches!(t.act, Some(Activation::GeluTanh)) && t.residual.is_none();
        let epilogue = match (t.act, t.residual.is_some()) {
            (None, _) => None,
            (Some(_), _) if fuse_act => None,
            (Some(a), res) => Some(Epilogue { act: Some(a), residual: res }),
        };
        // Residual goes through C unless our epilogue kernel must add it after the activation.
        let residual_in_c = t.residual.is_some() && epilogue.is_none();
        let tf32 = t.dtype == DType::F32 && allow_tf32;
        let compute =
            if tf32 { lt::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32 } else { lt::cublasComputeType_t::CUBLAS_COMPUTE_32F };
        let c_off = t.residual.filter(|_| residual_in_c).map(|r| r.offset).unwrap_or(t.out.offset);
        let aligns = [align_of(t.b.offset), align_of(t.a.offset), align_of(c_off), align_of(t.out.offset)];
        let mut plan = MatMulPlan::blank(compute, aligns, residual_in_c)?;
        (plan.tf32, plan.has_bias, plan.epilogue) = (tf32, t.bias.is_some(), epilogue);
        let desc = plan.desc;
        // SAFETY: the descriptors belong to `plan`, whose Drop destroys them (also on error).
        unsafe {
            let op_a: i32 = if t.b_trans { 1 } else { 0 };
            let op_b: i32 = 0;
            set_desc(desc, lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &op_a)?;
            set_desc(desc, lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &op_b)?;
            let epi = match (t.bias.is_some(), fuse_act) {
                (false, false) => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
                (true, false) => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
                (false, true) => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
                (true, true) => lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
            };
            set_desc(desc, lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epi as u32))?;
            if t.bias.is_some() {
                set_desc(desc, lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &(dt as i32))?;
            }
            let (n, k) = (t.n as u64, t.k as u64);
            let a_rows_cols = if t.b_trans { (k, n) } else { (n, k) };
            plan.layouts[0] = layout(dt, a_rows_cols.0, a_rows_cols.1, t.ldb, batch, t.b_batch_stride)?;
            plan.layouts[1] = layout(dt, k, rows as u64, t.lda, batch, t.a_batch_stride)?;
            plan.layouts[2] = layout(dt, n, rows as u64, n, batch, n * t.m as u64)?;
            plan.layouts[3] = layout(dt, n, rows as u64, n, batch, n * t.m as u64)?;
        }
        plan.with_first_algo(blas, || format!("matmul m={rows} n={} k={} {} batch {batch}", t.n, t.k, t.dtype))
    }

    /// The plan of a quantized matmul run through the library
    /// (src/decode.rs): `out[rows, n] = a'[rows, k] · w'[n, k]ᵀ` with a' and
    /// w' 16-bit (`input`: f16 or bf16) in scratch at arena offsets
    /// `a_off` and `w_off`, out (`output`: f32, f16 or bf16) at `d_off`,
    /// f32 accumulation; `residual_at`: C's offset when a residual is
    /// added through beta = 1 (C is out otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn decoded(
        blas: &Blas,
        rows: usize,
        n: usize,
        k: usize,
        input: DType,
        output: DType,
        offsets: (u64, u64, u64),
        residual_at: Option<u64>,
    ) -> Result<MatMulPlan> {
        let (a_off, w_off, d_off) = offsets;
        let (dt_in, dt_out) = (data_type(input)?, data_type(output)?);
        let aligns = [align_of(w_off), align_of(a_off), align_of(residual_at.unwrap_or(d_off)), align_of(d_off)];
        let mut plan = MatMulPlan::blank(lt::cublasComputeType_t::CUBLAS_COMPUTE_32F, aligns, residual_at.is_some())?;
        let desc = plan.desc;
        // SAFETY: the descriptors belong to `plan`, whose Drop destroys them (also on error).
        unsafe {
            set_desc(desc, lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
            set_desc(desc, lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?;
            let (rows, n, k) = (rows as u64, n as u64, k as u64);
            plan.layouts[0] = layout(dt_in, k, n, k, 1, 0)?;
            plan.layouts[1] = layout(dt_in, k, rows, k, 1, 0)?;
            plan.layouts[2] = layout(dt_out, n, rows, n, 1, 0)?;
            plan.layouts[3] = layout(dt_out, n, rows, n, 1, 0)?;
        }
        plan.with_first_algo(blas, || format!("quantized matmul through cuBLASLt, m={rows} n={n} k={k} {input} -> {output}"))
    }

    /// A plan with its descriptor made (f32 scale type), no layouts yet, no
    /// bias or epilogue; `beta_one`: C is added (a residual through beta).
    fn blank(compute: lt::cublasComputeType_t, aligns: [u32; 4], beta_one: bool) -> Result<MatMulPlan> {
        let mut desc = std::ptr::null_mut();
        // SAFETY: creates a descriptor; on success the plan owns it.
        lt_check(unsafe { lt::cublasLtMatmulDescCreate(&mut desc, compute, lt::cudaDataType::CUDA_R_32F) }, "cublasLtMatmulDescCreate")?;
        Ok(MatMulPlan {
            desc,
            layouts: [std::ptr::null_mut(); 4],
            // SAFETY: an all-zero algorithm is a valid placeholder until the heuristic's answer replaces it.
            algo: LtAlgo::describe(unsafe { std::mem::zeroed() }),
            aligns,
            tf32: false,
            has_bias: false,
            beta: if beta_one { 1.0 } else { 0.0 },
            epilogue: None,
        })
    }

    /// The plan with cuBLASLt's first heuristic answer as its algorithm.
    fn with_first_algo(mut self, blas: &Blas, what: impl Fn() -> String) -> Result<MatMulPlan> {
        let first = self.heuristics(blas, 1, SAFE_REDUCTIONS).map_err(|e| err(format!("{}: {e}", what())))?;
        let Some(first) = first.first() else {
            return Err(err(format!("cuBLASLt has no algorithm for {}", what())));
        };
        self.algo = *first;
        Ok(self)
    }

    /// Minimum alignment (bytes) of A, B, C, D assumed by the algorithms.
    pub fn aligns(&self) -> [u32; 4] {
        self.aligns
    }

    /// Up to `count` heuristic answers for this plan's exact layouts,
    /// epilogue and alignments, restricted to the reduction schemes in `mask`.
    fn heuristics(&self, blas: &Blas, count: usize, mask: u32) -> Result<Vec<LtAlgo>> {
        // SAFETY: the preference is created and destroyed here; the result
        // array has room for `count` entries.
        unsafe {
            let mut pref = std::ptr::null_mut();
            lt_check(lt::cublasLtMatmulPreferenceCreate(&mut pref), "cublasLtMatmulPreferenceCreate")?;
            let set_pref = |attr: lt::cublasLtMatmulPreferenceAttributes_t, v: u64, size: usize| {
                lt_check(
                    lt::cublasLtMatmulPreferenceSetAttribute(pref, attr, &v as *const u64 as *const c_void, size),
                    "cublasLtMatmulPreferenceSetAttribute",
                )
            };
            use lt::cublasLtMatmulPreferenceAttributes_t as P;
            let mut res = set_pref(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, WORKSPACE_BYTES, 8);
            res = res.and(set_pref(P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, mask as u64, 4));
            for (attr, a) in [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ]
            .into_iter()
            .zip(self.aligns)
            {
                res = res.and(set_pref(attr, a as u64, 4));
            }
            let mut heur: Vec<lt::cublasLtMatmulHeuristicResult_t> = vec![std::mem::zeroed(); count.max(1)];
            let mut found = 0;
            if res.is_ok() {
                res = lt_check(
                    lt::cublasLtMatmulAlgoGetHeuristic(
                        blas.handle,
                        self.desc,
                        self.layouts[0],
                        self.layouts[1],
                        self.layouts[2],
                        self.layouts[3],
                        pref,
                        heur.len() as i32,
                        heur.as_mut_ptr(),
                        &mut found,
                    ),
                    "cublasLtMatmulAlgoGetHeuristic",
                );
            }
            lt::cublasLtMatmulPreferenceDestroy(pref);
            res?;
            let ok = |h: &&lt::cublasLtMatmulHeuristicResult_t| {
                h.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS && h.workspaceSize as u64 <= WORKSPACE_BYTES
            };
            Ok(heur.iter().take(found.max(0) as usize).filter(ok).map(|h| LtAlgo::describe(h.algo)).collect())
        }
    }

    /// Whether cuBLASLt accepts `algo` for this plan (and within our workspace).
    pub(crate) fn accepts(&self, blas: &Blas, algo: &lt::cublasLtMatmulAlgo_t) -> bool {
        // SAFETY: handles are live; `result` is a local out-parameter.
        unsafe {
            let mut result: lt::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
            let s = lt::cublasLtMatmulAlgoCheck(
                blas.handle,
                self.desc,
                self.layouts[0],
                self.layouts[1],
                self.layouts[2],
                self.layouts[3],
                algo,
                &mut result,
            );
            s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS && result.workspaceSize as u64 <= WORKSPACE_BYTES
        }
    }

    /// The cuBLASLt algorithms worth timing for this plan: the default
    /// first, then the heuristic's next answers, then split-K variants of
    /// the first three (no split, or 2..4 parts summed in the compute type
    /// by a separate kernel), each accepted by `cublasLtMatmulAlgoCheck`.
    /// More parts, and the in-place (sequential, output-type) reduction,
    /// never timed faster than these on the H200.
    pub fn candidates(&self, blas: &Blas, count: usize) -> Vec<LtAlgo> {
        let mut out = vec![self.algo];
        let heur = self.heuristics(blas, count, SAFE_REDUCTIONS).unwrap_or_default();
        // One candidate per configuration: answers whose configurations
        // read the same (every attribute) count as one, the first kept.
        // (On an H100, cuBLASLt 13 gave a second answer with the default's
        // configuration for a small f32 matmul whose results changed from
        // call to call.)
        let push = |a: LtAlgo, out: &mut Vec<LtAlgo>| {
            if !out.iter().any(|o| o.algo == a.algo || o.same_config(&a)) {
                out.push(a);
            }
        };
        for h in &heur {
            push(*h, &mut out);
        }
        for base in heur.iter().take(3) {
            let mut variants = vec![base.with_split(1, 0)];
            for split in [2u32, 3, 4] {
                variants.push(base.with_split(split, 2));
            }
            for v in variants.into_iter().flatten() {
                if self.accepts(blas, &v.algo) {
                    push(v, &mut out);
                }
            }
        }
        out
    }
}

/// Reduction schemes that sum split-K parts in a separate, fixed-order pass
/// (bits do not change run to run): compute type (2) and output type (4).
pub(crate) const SAFE_REDUCTIONS: u32 = 0x6;

/// One cuBLASLt algorithm and its configuration (for traces).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LtAlgo {
    pub algo: lt::cublasLtMatmulAlgo_t,
    pub id: i32,
    pub tile: u32,
    pub split: u32,
    pub reduction: u32,
    /// The rest of its configuration (traces, and `same_config` when
    /// candidates are deduplicated): CTA swizzling, custom option, stages
    /// id, inner shape id, cluster shape id.
    pub rest: [u32; 5],
}

unsafe fn algo_attr(algo: &lt::cublasLtMatmulAlgo_t, attr: lt::cublasLtMatmulAlgoConfigAttributes_t) -> u32 {
    let mut v: u32 = 0;
    let mut written = 0usize;
    let s = lt::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &mut v as *mut u32 as *mut c_void, 4, &mut written);
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        v
    } else {
        0
    }
}

/// A 16-bit configuration attribute (inner and cluster shape ids).
unsafe fn algo_attr16(algo: &lt::cublasLtMatmulAlgo_t, attr: lt::cublasLtMatmulAlgoConfigAttributes_t) -> u32 {
    let mut v: u16 = 0;
    let mut written = 0usize;
    let s = lt::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &mut v as *mut u16 as *mut c_void, 2, &mut written);
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        v as u32
    } else {
        0
    }
}

impl LtAlgo {
    pub(crate) fn describe(algo: lt::cublasLtMatmulAlgo_t) -> LtAlgo {
        use lt::cublasLtMatmulAlgoConfigAttributes_t as C;
        // SAFETY: reads of a plain-data algorithm descriptor.
        unsafe {
            LtAlgo {
                algo,
                id: algo_attr(&algo, C::CUBLASLT_ALGO_CONFIG_ID) as i32,
                tile: algo_attr(&algo, C::CUBLASLT_ALGO_CONFIG_TILE_ID),
                split: algo_attr(&algo, C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                reduction: algo_attr(&algo, C::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                rest: [
                    algo_attr(&algo, C::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                    algo_attr(&algo, C::CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                    algo_attr(&algo, C::CUBLASLT_ALGO_CONFIG_STAGES_ID),
                    algo_attr16(&algo, C::CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID),
                    algo_attr16(&algo, C::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                ],
            }
        }
    }

    /// This algorithm with K split `split` ways (1: no split) and reduction
    /// scheme `reduction`; None if cuBLASLt refuses the attributes.
    fn with_split(&self, split: u32, reduction: u32) -> Option<LtAlgo> {
        use lt::cublasLtMatmulAlgoConfigAttributes_t as C;
        let mut a = self.algo;
        // SAFETY: writes into a local copy of a plain-data descriptor.
        unsafe {
            for (attr, v) in [(C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, split), (C::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, reduction)] {
                let s = lt::cublasLtMatmulAlgoConfigSetAttribute(&mut a, attr, &v as *const u32 as *const c_void, 4);
                if s != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return None;
                }
            }
        }
        Some(LtAlgo::describe(a))
    }

    /// Whether every readable configuration attribute is the same.
    fn same_config(&self, o: &LtAlgo) -> bool {
        (self.id, self.tile, self.split, self.reduction, self.rest) == (o.id, o.tile, o.split, o.reduction, o.rest)
    }

    /// Short form for traces: algorithm id, tile id, split, reduction;
    /// then swizzling, custom option, stages, inner and cluster shape.
    pub fn label(&self) -> String {
        let [w, c, g, i, k] = self.rest;
        format!("a{}t{}s{}r{}-w{w}c{c}g{g}i{i}k{k}", self.id, self.tile, self.split, self.reduction)
    }
}

/// One MatMul enqueue with a slot's pointers.
pub(crate) struct MatMulCall {
    pub plan: Arc<MatMulPlan>,
    /// The algorithm this call runs: the plan's default until a timed
    /// choice replaces it (src/gemm.rs).
    pub algo: lt::cublasLtMatmulAlgo_t,
    pub blas: Arc<Blas>,
    pub a: u64,
    pub b: u64,
    /// C: the residual when fused through beta = 1, else `d`.
    pub c: u64,
    pub d: u64,
    pub bias: u64,
}

impl MatMulCall {
    pub fn enqueue(&self, s: &Stream) -> Result<()> {
        self.enqueue_algo(s, &self.algo)
    }

    /// As `enqueue`, with another algorithm (timing candidates at prepare).
    pub fn enqueue_algo(&self, s: &Stream, algo: &lt::cublasLtMatmulAlgo_t) -> Result<()> {
        let p = &self.plan;
        let (alpha, beta) = (1.0f32, p.beta);
        // SAFETY: pointers are device addresses inside live allocations of
        // the sizes the thunk declares (checked at prepare).
        unsafe {
            if p.has_bias {
                let bias = self.bias as *const c_void;
                set_desc(p.desc, lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
            }
            lt_check(
                lt::cublasLtMatmul(
                    self.blas.handle,
                    p.desc,
                    &alpha as *const f32 as *const c_void,
                    self.b as *const c_void,
                    p.layouts[0],
                    self.a as *const c_void,
                    p.layouts[1],
                    &beta as *const f32 as *const c_void,
                    self.c as *const c_void,
                    p.layouts[2],
                    self.d as *mut c_void,
                    p.layouts[3],
                    algo,
                    self.blas.workspace.ptr as *mut c_void,
                    self.blas.workspace.bytes as usize,
                    s.0 as lt::cudaStream_t,
                ),
                "cublasLtMatmul",
            )
        }
    }
}
