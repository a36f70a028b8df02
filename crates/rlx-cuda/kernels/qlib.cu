// Quantized matmuls over many rows as a library matmul (cuBLASLt, from
// src/decode.rs): the weights are decoded into 16-bit floats and the
// activations rounded to 16 bits in the thunk's arena scratch, the library
// multiplies them (f32 accumulation), and with a gate a last kernel applies
// SwiGLU. The same contract and fused forms as qmma.cu (QMatMulP in
// quant.cuh); the 16-bit type is MmaIn<T>'s (f16, bf16 for bf16 rows).
//
//   qprep_<dtype>:        a' = 16-bit (RmsNorm(a) · gamma), or of a
//   qdequant_<fmt>_<h>:   w' = 16-bit decoded w, [n', k] row-major
//   qglu_<dtype>:         out = silu(g[:, :n]) · g[:, n:] (+ residual)
#include "quant.cuh"

struct QPrepP {
    const void* a; const void* gamma; void* out;
    i64 rows; i64 k; i64 lda; double eps;
};

struct QDequantP {
    const void* w; void* out;
    i64 n; i64 k; i64 row_bytes;
};

struct QGluP {
    const float* g; void* out; const void* res;
    i64 rows; i64 n;
};

__device__ __forceinline__ void st16(__half* p, i64 i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void st16(__nv_bfloat16* p, i64 i, float v) { p[i] = __float2bfloat16_rn(v); }

// One warp a row: the sum of squares (with a norm), then the row written
// in 16 bits. The norm's formula is the RmsNorm kernel's: x · gamma /
// sqrt(mean(x²) + eps).
template <typename T>
__device__ void qprep_body(const QPrepP& p) {
    typedef typename MmaIn<T>::type M;
    const int lane = threadIdx.x & 31;
    const i64 wpb = blockDim.x / 32, warps = (i64)gridDim.x * wpb;
    const T* gamma = (const T*)p.gamma;
    for (i64 r = (i64)blockIdx.x * wpb + threadIdx.x / 32; r < p.rows; r += warps) {
        const T* x = (const T*)p.a + r * p.lda;
        M* o = (M*)p.out + r * p.k;
        float inv = 1.0f;
        if (gamma) {
            float s = 0.0f;
            for (i64 c = lane; c < p.k; c += 32) {
                const float v = to_f32(x[c]);
                s = fmaf(v, v, s);
            }
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
            inv = rsqrtf(s / (float)p.k + (float)p.eps);
        }
        for (i64 c = lane; c < p.k; c += 32) {
            float v = to_f32(x[c]);
            if (gamma) v = v * inv * to_f32(gamma[c]);
            st16(o, c, v);
        }
    }
}

// A thread a chunk of 8 weights (dequant8's parts), grid-stride.
template <typename M, int F>
__device__ void qdequant_body(const QDequantP& p) {
    constexpr int BE = QFmt<F>::BE, BB = QFmt<F>::BB, PARTS = BE / 8;
    const i64 per_row = p.k / BE, total = p.n * per_row * PARTS;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += (i64)gridDim.x * blockDim.x) {
        const int part = (int)(t % PARTS);
        const i64 blk = t / PARTS, col = blk / per_row, b = blk % per_row;
        float v[8];
        int e[8];
        dequant8<F>((const u8*)p.w + col * p.row_bytes + b * BB, part, v, e);
        M* o = (M*)p.out + col * p.k + b * BE;
#pragma unroll
        for (int i = 0; i < 8; ++i) st16(o, e[i], v[i]);
    }
}

// The gate's products in g[:, :n], the up projection's in g[:, n:]; the
// formula is qmma.cu's.
template <typename T>
__device__ void qglu_body(const QGluP& p) {
    const i64 total = p.rows * p.n;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / p.n, c = i % p.n;
        const float a = p.g[r * 2 * p.n + c], b = p.g[r * 2 * p.n + p.n + c];
        float s = a / (1.0f + expf(-a)) * b;
        if (p.res) s += to_f32(((const T*)p.res)[i]);
        st((T*)p.out, i, s);
    }
}

RLX_FLOAT_KERNELS(qprep, QPrepP)
RLX_FLOAT_KERNELS(qglu, QGluP)

#define RLX_QDEQUANT(FN, F)                                                                                            \
    extern "C" __global__ void qdequant_##FN##_f16(const QDequantP p) { pdl_enter(); qdequant_body<__half, F>(p); } \
    extern "C" __global__ void qdequant_##FN##_bf16(const QDequantP p) { pdl_enter(); qdequant_body<__nv_bfloat16, F>(p); }
RLX_QDEQUANT(q4_0, QF_Q4_0)
RLX_QDEQUANT(q4_1, QF_Q4_1)
RLX_QDEQUANT(q5_0, QF_Q5_0)
RLX_QDEQUANT(q5_1, QF_Q5_1)
RLX_QDEQUANT(q8_0, QF_Q8_0)
RLX_QDEQUANT(q4_k, QF_Q4K)
RLX_QDEQUANT(q6_k, QF_Q6K)
