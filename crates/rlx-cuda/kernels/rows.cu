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

// LayerNorm / RmsNorm for rows that fit in one warp's registers: one warp
// per row, 4 rows per 128-thread block, 16-byte loads and stores. The block
// kernel above spends most of its time in two block-wide reductions per
// row; here both reductions are warp shuffles and a 4096-row call fills the
// GPU with 1024 small blocks. The host picks it when cols is a multiple of
// the vector width, every pointer is 16-byte aligned, and the row takes at
// most NV vectors per lane (see `norm_warp_nv` in src/launch.rs).
template <typename T, int NV>
__device__ void norm_warp_body(const NormP& p) {
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nvec = (int)(p.cols / Vec16<T>::E);
    // gamma and beta are weights, which no kernel writes: they load before
    // the wait for the previous kernel (programmatic dependent launch), and
    // all at once rather than between the output stores, where each load
    // would wait behind the previous store (one memory round trip each).
    uint4 rg[NV], rb[NV];
    norm_warp_params<NV>(p.gamma, p.beta, nvec, lane, rg, rb);
    pdl_enter();
    if (row >= p.rows) return;
    norm_warp_row<T, NV>((const uint4*)p.x + row * nvec, p.res ? (const uint4*)p.res + row * nvec : nullptr, rg, rb, p.beta != nullptr,
                         (uint4*)p.out + row * nvec, nvec, 1.0f / (float)p.cols, p.rms != 0, (float)p.eps, lane);
}

// norm_warp_<NV>_<dtype> (the body calls pdl_enter itself, after its weight loads)
#define RLX_NORM_WARP(NV)                                                                                        \
    extern "C" __global__ void norm_warp_##NV##_f32(const NormP p) { norm_warp_body<float, NV>(p); }             \
    extern "C" __global__ void norm_warp_##NV##_f16(const NormP p) { norm_warp_body<__half, NV>(p); }            \
    extern "C" __global__ void norm_warp_##NV##_bf16(const NormP p) { norm_warp_body<__nv_bfloat16, NV>(p); }
RLX_NORM_WARP(1)
RLX_NORM_WARP(2)
RLX_NORM_WARP(3)
RLX_NORM_WARP(4)
RLX_NORM_WARP(6)
RLX_NORM_WARP(8)

// LayerNorm(table[ids[row]] + addend rows) for rows that fit one warp's
// registers (as norm_warp): the embedding gather and the position and
// token-type adds of BERT in one pass. Addend k is dense rows of cols;
// output row r adds its row r % rows_k (a null addend adds nothing). An id
// outside the vocabulary gathers zeros and raises the error flag, as the
// gather kernel does.
struct EmbedNormP {
    const void* table; const void* ids; const void* add0; const void* add1; const void* gamma; const void* beta; void* out; int* err;
    i64 rows; i64 cols; i64 vocab; i64 id64; i64 rows0; i64 rows1; double eps;
};

template <typename T, int NV>
__device__ void embed_norm_body(const EmbedNormP& p) {
    constexpr int E = Vec16<T>::E;
    const int lane = threadIdx.x & 31;
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int nvec = (int)(p.cols / E);
    uint4 rg[NV], rb[NV];
    norm_warp_params<NV>(p.gamma, p.beta, nvec, lane, rg, rb);
    pdl_enter();
    if (row >= p.rows) return;
    const i64 id = p.id64 ? ((const long long*)p.ids)[row] : (i64)((const int*)p.ids)[row];
    const bool ok = id >= 0 && id < p.vocab;
    if (!ok && lane == 0) atomicOr(p.err, ERR_GATHER_ID);
    const uint4* t = (const uint4*)p.table + (ok ? id : 0) * nvec;
    const uint4* a0 = p.add0 ? (const uint4*)p.add0 + (row % p.rows0) * nvec : nullptr;
    const uint4* a1 = p.add1 ? (const uint4*)p.add1 + (row % p.rows1) * nvec : nullptr;
    const uint4 z = make_uint4(0, 0, 0, 0);
    uint4 rt[NV], r0[NV], r1[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = lane + k * 32;
        const bool in = c < nvec;
        rt[k] = ok && in ? t[c] : z;
        r0[k] = a0 && in ? a0[c] : z;
        r1[k] = a1 && in ? a1[c] : z;
    }
    float v[NV][E];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        float x0[E], x1[E];
        Vec16<T>::load(rt[k], v[k]);
        Vec16<T>::load(r0[k], x0);
        Vec16<T>::load(r1[k], x1);
#pragma unroll
        for (int e = 0; e < E; ++e) v[k][e] += x0[e] + x1[e];
    }
    norm_warp_finish<T, NV>(v, rg, rb, true, (uint4*)p.out + row * nvec, nvec, 1.0f / (float)p.cols, false, (float)p.eps, lane);
}

#define RLX_EMBED_NORM(NV)                                                                                            \
    extern "C" __global__ void embed_norm_##NV##_f32(const EmbedNormP p) { embed_norm_body<float, NV>(p); }          \
    extern "C" __global__ void embed_norm_##NV##_f16(const EmbedNormP p) { embed_norm_body<__half, NV>(p); }         \
    extern "C" __global__ void embed_norm_##NV##_bf16(const EmbedNormP p) { embed_norm_body<__nv_bfloat16, NV>(p); }
RLX_EMBED_NORM(1)
RLX_EMBED_NORM(2)
RLX_EMBED_NORM(3)
RLX_EMBED_NORM(4)
RLX_EMBED_NORM(6)
RLX_EMBED_NORM(8)

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

// The same reduction when the kept inner axis is wide (mean pooling over the
// sequence: [batch, seq, hidden] -> [batch, hidden]): a 256-thread block owns
// 32 adjacent columns, lane = column (coalesced reads), warp w sums rows
// w, w+8, ...; the 8 partial results meet in shared memory in a fixed order.
// Grid: outer * ceil(inner / 32) blocks.
template <typename T>
__device__ void reduce_cols_body(const AxisP& p) {
    __shared__ float part[8][33];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const i64 nb = (p.inner + 31) / 32;
    const i64 o = blockIdx.x / nb, col = (blockIdx.x % nb) * 32 + lane;
    if (o >= p.outer) return;
    const bool in = col < p.inner;
    const T* x = (const T*)p.x + o * p.len * p.inner + col;
    const bool mx = p.op == 2;
    float v = mx ? -INFINITY : 0.0f;
    if (in) {
#pragma unroll 4
        for (i64 j = w; j < p.len; j += 8) {
            float e = ld(x, j * p.inner);
            v = mx ? fmaxf(v, e) : v + e;
        }
    }
    part[w][lane] = v;
    __syncthreads();
    if (w == 0 && in) {
        float r = part[0][lane];
#pragma unroll
        for (int k = 1; k < 8; ++k) r = mx ? fmaxf(r, part[k][lane]) : r + part[k][lane];
        if (p.op == 1) r /= (float)p.len;
        st((T*)p.out, o * p.inner + col, r);
    }
}
RLX_FLOAT_KERNELS(reduce_cols, AxisP)

// out[b, d] = sum_s x[b, s, d] * mask[b, s] / max(sum_s mask[b, s], 1e-9)
// (Op::MaskedMean, mean pooling), accumulated in f32. As reduce_cols: 32
// columns per block, warp w takes rows w, w + 8, ...; masked rows (mask 0)
// are skipped, as on the CPU; the 8 partial sums meet in shared memory in a
// fixed order. Grid: batch * ceil(dim / 32) blocks of 256 threads.
// The mask and the output may be any float type (mask_dt, out_dt: DT_*):
// the precision pass leaves an f32 attention mask and an f32 pooled output
// as they are instead of casting them.
struct MaskedMeanP { const void* x; const void* mask; void* out; i64 batch; i64 seq; i64 dim; i64 mask_dt; i64 out_dt; };

template <typename T>
__device__ void masked_mean_body(const MaskedMeanP& p) {
    __shared__ float part[8][33];
    __shared__ float count;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const i64 nb = (p.dim + 31) / 32;
    if (nb == 0) return;  // dim 0: nothing to write (the host launches one block)
    const i64 b = blockIdx.x / nb, col = (blockIdx.x % nb) * 32 + lane;
    if (b >= p.batch) return;
    const bool in = col < p.dim;
    const T* x = (const T*)p.x + b * p.seq * p.dim + col;
    const i64 m0 = b * p.seq;
    float v = 0.0f;
#pragma unroll 4
    for (i64 j = w; j < p.seq; j += 8) {
        const float mj = (float)ld_any(p.mask, m0 + j, p.mask_dt);
        if (in && mj != 0.0f) v = fmaf(ld(x, j * p.dim), mj, v);
    }
    part[w][lane] = v;
    if (w == 0) {
        float c = 0.0f;
        for (i64 j = lane; j < p.seq; j += 32) c += (float)ld_any(p.mask, m0 + j, p.mask_dt);
        c = warp_sum(c);
        if (lane == 0) count = c;
    }
    __syncthreads();
    if (w == 0 && in) {
        float r = part[0][lane];
#pragma unroll
        for (int k = 1; k < 8; ++k) r += part[k][lane];
        r /= fmaxf(count, 1e-9f);
        const i64 o = b * p.dim + col;
        switch (p.out_dt) {
            case DT_F32: st((float*)p.out, o, r); break;
            case DT_F16: st((__half*)p.out, o, r); break;
            default: st((__nv_bfloat16*)p.out, o, r); break;
        }
    }
}
RLX_FLOAT_KERNELS(masked_mean, MaskedMeanP)

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
