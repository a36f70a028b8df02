// Shared helpers for every RLX kernel. Kernels take ONE parameter struct
// whose fields are all 8 bytes wide (pointers, long long, double) or arrays
// of them; each struct has a #[repr(C)] twin in src/params.rs, and checks
// appended to every file at compile time compare the two layouts.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;

// Parts of a kernel file: the runtime compiles some files as several NVRTC
// programs on parallel threads (src/nvrtc.rs `PARTS`), each with KERNEL_PART
// defined to its number; IN_PART(n) keeps part n's instantiations, and
// every one where KERNEL_PART is not defined (the whole file).
#ifdef KERNEL_PART
#define IN_PART(n) (KERNEL_PART == (n))
#else
#define IN_PART(n) 1
#endif

// NVRTC has no <math.h>; __int_as_float(0x7f800000) is +inf.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

// Element type codes; must match `dtype_code` in src/launch.rs.
#define DT_F32 0
#define DT_F16 1
#define DT_BF16 2
#define DT_I32 3
#define DT_I64 4

// Activation codes; must match `act_code` in src/launch.rs.
#define ACT_NONE 0
#define ACT_GELU 1
#define ACT_GELU_TANH 2
#define ACT_SILU 3
#define ACT_RELU 4
#define ACT_TANH 5

// Bits of the per-slot device error flag (see src/exec.rs).
#define ERR_GATHER_ID 1
#define ERR_STATE_OVERFLOW 2
#define ERR_VALID_LEN 4

#define MAX_RANK 8

__device__ __forceinline__ float ld(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float ld(const __half* p, i64 i) { return __half2float(p[i]); }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, i64 i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void st(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__half* p, i64 i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void st(__nv_bfloat16* p, i64 i, float v) { p[i] = __float2bfloat16_rn(v); }

// Any element type as double (exact for every i32 and for i64 below 2^53).
__device__ __forceinline__ double ld_any(const void* p, i64 i, i64 dt) {
    switch (dt) {
        case DT_F32: return (double)((const float*)p)[i];
        case DT_F16: return (double)__half2float(((const __half*)p)[i]);
        case DT_BF16: return (double)__bfloat162float(((const __nv_bfloat16*)p)[i]);
        case DT_I32: return (double)((const int*)p)[i];
        default: return (double)((const long long*)p)[i];
    }
}

__device__ __forceinline__ float act_apply(i64 act, float x) {
    switch (act) {
        case ACT_GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
        case ACT_GELU_TANH: {
            float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            return 0.5f * x * (1.0f + tanhf(u));
        }
        case ACT_SILU: return x / (1.0f + expf(-x));
        case ACT_RELU: return x > 0.0f ? x : 0.0f;
        case ACT_TANH: return tanhf(x);
        default: return x;
    }
}

// 2^x in one MUFU instruction (exp2f adds range fix-ups for denormal
// results; a result below 2^-126 flushes to zero).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// erf-GELU for the half types: x * Phi(x), with Phi(-a) = 2^q(a) for
// a = |x|, q a degree-10 polynomial in t = 2a / 13.6 - 1 fitted for RLX (least
// squares on Chebyshev nodes) to log2 Phi(-a) on [0, 13.6]; Phi(x) = 1 -
// Phi(-x) for x >= 0. Phi(-a)'s relative error is below 2.6e-5 evaluated in
// f32 (checked on 200k points against erfc in f64), far below f16 (4.9e-4)
// and bf16 (3.9e-3) rounding, so results round faithfully (tests/thunks.rs
// against f64). Past a = 13.6, Phi(-a) reads 0: |GELU| < 2.7e-41 there,
// below half a bf16 subnormal step. One exp2 and 11 FMAs, so the erf-GELU
// epilogue stays memory-bound at large row counts. f32 keeps erff
// (act_apply).
//
// f16 (the specialization below) needs far less: where |x| > 6 its GELU
// rounds to 0 or x.
// x * Phi(x) from p = Phi(-|x|): Phi(x) = 1 - p for x >= 0.
__device__ __forceinline__ float gelu_from_phi(float x, float p) { return x * (x >= 0.0f ? 1.0f - p : p); }

template <typename T>
__device__ __forceinline__ float gelu_fast(float x) {
    const float a = fminf(fabsf(x), 13.6f);
    const float t = fmaf(a, 0.1470588297f, -1.0f);
    float q = 1.865488663e-02f;
    q = fmaf(q, t, -5.460502207e-02f);
    q = fmaf(q, t, 6.087179482e-02f);
    q = fmaf(q, t, -5.704092607e-02f);
    q = fmaf(q, t, 9.980582446e-02f);
    q = fmaf(q, t, -1.699826121e-01f);
    q = fmaf(q, t, 2.508645356e-01f);
    q = fmaf(q, t, -3.817172945e-01f);
    q = fmaf(q, t, -3.271384048e+01f);
    q = fmaf(q, t, -6.809637451e+01f);
    q = fmaf(q, t, -3.747605515e+01f);
    // exp2f keeps subnormal results: bf16's subnormals reach 2^-133.
    const float e = exp2f(q);
    return gelu_from_phi(x, a < 13.6f ? e : 0.0f);
}

// f16: q of degree 6 in t = a / 3 - 1, fitted the same way to log2 Phi(-a)
// on [0, 6] (relative error of Phi(-a) below 4.8e-5); Phi(-a) reads 0 past
// 6, where |GELU| < 6e-9 rounds to 0 in f16, and 1 - Phi(-a) rounds x to
// itself. The exponential is ex2 (one MUFU instruction; results below
// 2^-126 flush to zero, far below f16's subnormals), computed for every
// element and selected, without a branch. Every finite f16 input rounds
// within 0.59 of an f16 step of the f64 GELU (tests/thunks.rs
// `gelu_f16_fit_rounds_faithfully_for_every_input` reads these literals and
// checks on the CPU; `gelu_half_types_round_faithfully` on the GPU).
template <>
__device__ __forceinline__ float gelu_fast<__half>(float x) {
    const float a = fminf(fabsf(x), 6.0f);
    const float t = fmaf(a, 0.3333333433f, -1.0f);
    float q = 1.676645316e-02f;
    q = fmaf(q, t, -4.799339548e-02f);
    q = fmaf(q, t, 9.175150841e-02f);
    q = fmaf(q, t, -2.003527284e-01f);
    q = fmaf(q, t, -6.033998489e+00f);
    q = fmaf(q, t, -1.421000957e+01f);
    q = fmaf(q, t, -9.532935143e+00f);
    const float e = ex2(q);  // for every element, then selected: no branch
    return gelu_from_phi(x, a < 6.0f ? e : 0.0f);
}

// act_apply with the cheaper erf-GELU for 2-byte float types.
template <typename T>
__device__ __forceinline__ float act_t(i64 act, float x) {
    if (sizeof(T) == 2 && act == ACT_GELU) return gelu_fast<T>(x);
    return act_apply(act, x);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum/max for blockDim.x a multiple of 32 (at most 1024). `scratch`
// holds 32 floats; every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// 16 bytes of T as floats and back (E elements); stores round to nearest
// exactly like `st`, so vector and scalar kernels give the same bits.
template <typename T> struct Vec16;
template <> struct Vec16<float> {
    static constexpr int E = 4;
    static __device__ __forceinline__ void load(uint4 u, float* f) {
        f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y); f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
    }
    static __device__ __forceinline__ uint4 store(const float* f) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    }
};
template <> struct Vec16<__half> {
    static constexpr int E = 8;
    static __device__ __forceinline__ void load(uint4 u, float* f) {
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
            float2 v = __half22float2(h);
            f[2 * i] = v.x; f[2 * i + 1] = v.y;
        }
    }
    static __device__ __forceinline__ uint4 store(const float* f) {
        unsigned w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            __half2 h = __halves2half2(__float2half_rn(f[2 * i]), __float2half_rn(f[2 * i + 1]));
            w[i] = *reinterpret_cast<unsigned*>(&h);
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};
template <> struct Vec16<__nv_bfloat16> {
    static constexpr int E = 8;
    static __device__ __forceinline__ void load(uint4 u, float* f) {
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162*>(&w[i]);
            float2 v = __bfloat1622float2(h);
            f[2 * i] = v.x; f[2 * i + 1] = v.y;
        }
    }
    static __device__ __forceinline__ uint4 store(const float* f) {
        unsigned w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            __nv_bfloat162 h = __halves2bfloat162(__float2bfloat16_rn(f[2 * i]), __float2bfloat16_rn(f[2 * i + 1]));
            w[i] = *reinterpret_cast<unsigned*>(&h);
        }
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};

// Programmatic dependent launch (sm_90+; src/driver.rs launches with the
// PDL attribute when the previous step is a kernel). Such a kernel may start
// while the previous one drains, so EVERY kernel waits for its predecessor's
// results here, first thing, before any memory access; right after, it lets
// its own successor start launching (the successor waits the same way, so
// at most one grid runs ahead). Without the attribute the wait returns at once.

// 16 bytes global -> shared without passing through registers; `full`
// false writes 16 zero bytes (src-size 0: nothing is read).
// The first `n` (0..=16) bytes at gmem (both addresses 16-byte aligned);
// the rest of the 16 in shared memory are zeros and nothing past gmem + n
// is read.
__device__ __forceinline__ void cp_async_bytes(void* smem, const void* gmem, int n) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool full) { cp_async_bytes(smem, gmem, full ? 16 : 0); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Two floats rounded to nearest (as `st`) and packed into one word.
template <typename T> __device__ __forceinline__ unsigned pack2(float a, float b);
template <> __device__ __forceinline__ unsigned pack2<__half>(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<unsigned*>(&h);
}

// Tensor-core helpers (sm_80+ instructions; shared by attention_mma.cu
// and ffn.cu): mma.sync m16n8k16 with f32 accumulation, and
// ldmatrix of four 8x8 b16 matrices.
template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ unsigned pack(float a, float b) {
        __half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<unsigned*>(&h);
    }
    static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ unsigned pack(float a, float b) {
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<unsigned*>(&h);
    }
    static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// Four 8x8 b16 matrices from shared memory, transposed: lanes 8i..8i+7 give
// the row addresses of matrix i; register i receives matrix i's fragment.
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, const void* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// The same without transposition: register i holds matrix i's (row g,
// columns 2t..2t+1), i.e. K rows as the B fragments of Q·Kᵀ.
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// One warp's share of A·Bᵀ over KS steps of 16 along K, from shared
// memory: acc[MF][NF] (m16n8 fragments) += A (MF fragments of 16 rows,
// pitch AP) times B (NF fragments of 8 columns, pitch BP). `ca` and `cb`
// are this lane's ldmatrix addresses for fragment 0 at k = 0: A row
// (mi & 1)·8 + mr, column (mi >> 1)·8 (mi = lane / 8, mr = lane % 8); for B
// stored [n][k] (`BT`) row (mi >> 1)·8 + mr, column (mi & 1)·8, for B stored
// [k][n] row (mi & 1)·8 + mr, column (mi >> 1)·8 (read transposed).
template <typename T, int MF, int NF, int KS, int AP, int BP, bool BT>
__device__ __forceinline__ void mma_warp_steps(float (&acc)[MF][NF][4], const unsigned short* ca, const unsigned short* cb) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        unsigned af[MF][4];
        // Matrices: rows +0..7 / +8..15 of the fragment, k +0..7 / +8..15.
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) ldsm_x4(af[mf], ca + mf * 16 * AP + ks * 16);
#pragma unroll
        for (int nf = 0; nf < NF; nf += 2) {
            // BT: matrices (n +0..7, k +0..7), (n +0..7, k +8..15), then
            // n +8..15: b0, b1 of fragment nf, then of nf + 1.
            unsigned bf[4];
            if (BT) ldsm_x4(bf, cb + nf * 8 * BP + ks * 16);
            else ldsm_x4_trans(bf, cb + ks * 16 * BP + nf * 8);
#pragma unroll
            for (int mf = 0; mf < MF; ++mf) {
                Mma<T>::run(acc[mf][nf], af[mf], bf[0], bf[1]);
                Mma<T>::run(acc[mf][nf + 1], af[mf], bf[2], bf[3]);
            }
        }
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// This block's rank in its thread-block cluster.
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
// Every thread of every block of the cluster; orders shared-memory writes
// before it with reads after it, across the cluster's blocks.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// A shared::cta address of this block -> the same offset in block `rank` of the cluster.
__device__ __forceinline__ unsigned cluster_map(unsigned addr, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ float ld_cluster_f32(unsigned addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void st_cluster_u32(unsigned addr, unsigned v) {
    asm volatile("st.shared::cluster.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// A relaxed cluster barrier (no memory ordering) in two halves: arrive once
// this block's last read of another block's shared memory has returned,
// wait before leaving.
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }
__device__ __forceinline__ float4 ld_cluster_f4(unsigned addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
    return v;
}
#endif

__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Instantiates `extern "C"` entry points NAME_f32, NAME_f16, NAME_bf16 of a
// templated kernel body `NAME##_body<T>(P)`.
#define RLX_FLOAT_KERNELS(NAME, P)                                                                     \
    extern "C" __global__ void NAME##_f32(const P p) { pdl_enter(); NAME##_body<float>(p); }           \
    extern "C" __global__ void NAME##_f16(const P p) { pdl_enter(); NAME##_body<__half>(p); }          \
    extern "C" __global__ void NAME##_bf16(const P p) { pdl_enter(); NAME##_body<__nv_bfloat16>(p); }

// LayerNorm / RmsNorm of one row by one warp (norm_warp and embed_norm in
// rows.cu): NV 16-byte vectors per lane, `nvec` in
// the row; gamma and beta come in registers (`norm_warp_params`). Every load
// of the row is issued before the first use; out may alias x or res (the
// warp has read its whole row before the first store).
template <int NV>
__device__ __forceinline__ void norm_warp_params(const void* gamma, const void* beta, int nvec, int lane, uint4 (&rg)[NV], uint4 (&rb)[NV]) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = lane + k * 32;
        rg[k] = c < nvec ? ((const uint4*)gamma)[c] : make_uint4(0, 0, 0, 0);
        rb[k] = (beta && c < nvec) ? ((const uint4*)beta)[c] : make_uint4(0, 0, 0, 0);
    }
}

// The norm of one row held as f32 in registers (zeros past the row):
// both reductions and the stores.
template <typename T, int NV>
__device__ __forceinline__ void norm_warp_finish(float (&v)[NV][Vec16<T>::E], const uint4 (&rg)[NV], const uint4 (&rb)[NV], bool beta,
                                                 uint4* out, int nvec, float inv_n, bool rms, float eps, int lane) {
    constexpr int E = Vec16<T>::E;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
#pragma unroll
        for (int e = 0; e < E; ++e) s += v[k][e];
    }
    const float mean = rms ? 0.0f : warp_sum(s) * inv_n;
    float s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        if (lane + k * 32 < nvec) {
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const float d = v[k][e] - mean;
                s2 += d * d;
            }
        }
    }
    const float rstd = rsqrtf(warp_sum(s2) * inv_n + eps);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = lane + k * 32;
        if (c < nvec) {
            float g[E], bt[E], o[E];
            Vec16<T>::load(rg[k], g);
            Vec16<T>::load(rb[k], bt);
#pragma unroll
            for (int e = 0; e < E; ++e) {
                o[e] = (v[k][e] - mean) * rstd * g[e];
                if (beta) o[e] += bt[e];
            }
            out[c] = Vec16<T>::store(o);
        }
    }
}

template <typename T, int NV>
__device__ __forceinline__ void norm_warp_row(const uint4* x, const uint4* res, const uint4 (&rg)[NV], const uint4 (&rb)[NV], bool beta,
                                              uint4* out, int nvec, float inv_n, bool rms, float eps, int lane) {
    constexpr int E = Vec16<T>::E;
    uint4 raw[NV], rres[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = lane + k * 32;
        raw[k] = c < nvec ? x[c] : make_uint4(0, 0, 0, 0);
        rres[k] = (res && c < nvec) ? res[c] : make_uint4(0, 0, 0, 0);
    }
    float v[NV][E];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        float r[E];
        Vec16<T>::load(raw[k], v[k]);
        Vec16<T>::load(rres[k], r);
#pragma unroll
        for (int e = 0; e < E; ++e) v[k][e] += r[e];  // zero when there is no residual or past the row
    }
    norm_warp_finish<T, NV>(v, rg, rb, beta, out, nvec, inv_n, rms, eps, lane);
}
