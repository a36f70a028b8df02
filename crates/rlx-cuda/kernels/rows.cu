// Row and axis kernels: LayerNorm / RmsNorm (optionally over x + residual),
// softmax, reductions and argmax over the middle axis of [outer, len, inner].
// One block per row; f32 accumulation whatever the storage type.
#include "common.cuh"

struct NormP {
    const void* x; const void* res; const void* gamma; const void* beta; void* out;
    i64 rows; i64 cols; i64 rms; double eps;
};

// Rows up to NORM_CACHE * blockDim.x elements are read once into registers
// (the common case: hidden sizes up to 2048 with 256 threads); longer rows
// are re-read from memory on each pass.
#define NORM_CACHE 8

template <typename T>
__device__ void norm_body(const NormP& p) {
    __shared__ float scratch[32];
    i64 row = blockIdx.x;
    if (row >= p.rows) return;
    const T* x = (const T*)p.x + row * p.cols;
    const T* res = p.res ? (const T*)p.res + row * p.cols : nullptr;
    T* out = (T*)p.out + row * p.cols;
    const T* gamma = (const T*)p.gamma; const T* beta = (const T*)p.beta;
    const int cols = (int)p.cols, nt = blockDim.x, t = threadIdx.x;
    const float inv_n = 1.0f / (float)cols;
    if (p.cols <= (i64)NORM_CACHE * nt) {
        float v[NORM_CACHE];
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_CACHE; ++k) {
            int c = t + k * nt;
            v[k] = c < cols ? ld(x, c) + (res ? ld(res, c) : 0.0f) : 0.0f;
            s += v[k];
        }
        float mean = p.rms ? 0.0f : block_sum(s, scratch) * inv_n;
        float s2 = 0.0f;
#pragma unroll
        for (int k = 0; k < NORM_CACHE; ++k) {
            int c = t + k * nt;
            float d = c < cols ? v[k] - mean : 0.0f;
            s2 += d * d;
        }
        float rstd = rsqrtf(block_sum(s2, scratch) * inv_n + (float)p.eps);
#pragma unroll
        for (int k = 0; k < NORM_CACHE; ++k) {
            int c = t + k * nt;
            if (c < cols) {
                float o = (v[k] - mean) * rstd * ld(gamma, c);
                if (beta) o += ld(beta, c);
                st(out, c, o);
            }
        }
        return;
    }
    float mean = 0.0f;
    if (!p.rms) {
        float s = 0.0f;
        for (int c = t; c < cols; c += nt) s += ld(x, c) + (res ? ld(res, c) : 0.0f);
        mean = block_sum(s, scratch) * inv_n;
    }
    float s2 = 0.0f;
    for (int c = t; c < cols; c += nt) {
        float v = ld(x, c) + (res ? ld(res, c) : 0.0f) - mean;
        s2 += v * v;
    }
    float rstd = rsqrtf(block_sum(s2, scratch) * inv_n + (float)p.eps);
    // out may alias x or res: every read of this row happened above, and the
    // loop below reads element c before writing it.
    for (int c = t; c < cols; c += nt) {
        float v = (ld(x, c) + (res ? ld(res, c) : 0.0f) - mean) * rstd * ld(gamma, c);
        if (beta) v += ld(beta, c);
        st(out, c, v);
    }
}
RLX_FLOAT_KERNELS(norm, NormP)

// op: 0 sum, 1 mean, 2 max (reduce); softmax and argmax ignore it.
struct AxisP { const void* x; void* out; i64 outer; i64 len; i64 inner; i64 op; };

template <typename T>
__device__ void softmax_body(const AxisP& p) {
    __shared__ float scratch[32];
    i64 r = blockIdx.x;
    if (r >= p.outer * p.inner) return;
    i64 o = r / p.inner, in = r % p.inner;
    const T* x = (const T*)p.x + o * p.len * p.inner + in;
    T* out = (T*)p.out + o * p.len * p.inner + in;
    float m = -INFINITY;
    for (i64 j = threadIdx.x; j < p.len; j += blockDim.x) m = fmaxf(m, ld(x, j * p.inner));
    m = block_max(m, scratch);
    float s = 0.0f;
    for (i64 j = threadIdx.x; j < p.len; j += blockDim.x) s += expf(ld(x, j * p.inner) - m);
    s = block_sum(s, scratch);
    float inv = 1.0f / s;
    for (i64 j = threadIdx.x; j < p.len; j += blockDim.x) st(out, j * p.inner, expf(ld(x, j * p.inner) - m) * inv);
}
RLX_FLOAT_KERNELS(softmax, AxisP)

template <typename T>
__device__ void reduce_body(const AxisP& p) {
    __shared__ float scratch[32];
    i64 r = blockIdx.x;
    if (r >= p.outer * p.inner) return;
    i64 o = r / p.inner, in = r % p.inner;
    const T* x = (const T*)p.x + o * p.len * p.inner + in;
    float v;
    if (p.op == 2) {
        v = -INFINITY;
        for (i64 j = threadIdx.x; j < p.len; j += blockDim.x) v = fmaxf(v, ld(x, j * p.inner));
        v = block_max(v, scratch);
    } else {
        v = 0.0f;
        for (i64 j = threadIdx.x; j < p.len; j += blockDim.x) v += ld(x, j * p.inner);
        v = block_sum(v, scratch);
        if (p.op == 1) v /= (float)p.len;
    }
    if (threadIdx.x == 0) st((T*)p.out, r, v);
}
RLX_FLOAT_KERNELS(reduce, AxisP)

// Index of the largest value; ties go to the lower index; NaN never wins.
template <typename T>
__device__ void argmax_body(const AxisP& p) {
    __shared__ float sv[32];
    __shared__ i64 si[32];
    i64 r = blockIdx.x;
    if (r >= p.outer * p.inner) return;
    i64 o = r / p.inner, in = r % p.inner;
    const T* x = (const T*)p.x + o * p.len * p.inner + in;
    float best = -INFINITY; i64 bi = p.len;
    for (i64 j = threadIdx.x; j < p.len; j += blockDim.x) {
        float v = ld(x, j * p.inner);
        if (v > best || (v == best && j < bi)) { best = v; bi = j; }
    }
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, off);
        i64 oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < nw; ++w)
            if (sv[w] > best || (sv[w] == best && si[w] < bi)) { best = sv[w]; bi = si[w]; }
        // Every value NaN (or -inf only): index 0, as a plain scan would give.
        if (bi >= p.len) bi = 0;
        ((int*)p.out)[r] = (int)bi;
    }
}
RLX_FLOAT_KERNELS(argmax, AxisP)
