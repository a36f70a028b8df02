// Fused attention: softmax(q·kᵀ·scale + masks)·v in one pass with an online
// softmax, so scores never reach device memory.
//
// A block (4 warps) owns 4*RPW query rows of one (batch, head); each warp
// handles RPW of them. K and V stream through shared memory in tiles of 32
// keys: in the score step lane j scores key j of the tile, in the value step
// lane l accumulates output dims l, l+32, .. (HDP/32 of them). HDP is the head
// dim rounded up to 32/64/96/128 and fixed at compile time so every inner
// loop unrolls; the padding is zero in shared memory and adds exact zeros.
// RPW trades K/V reuse (4 rows per warp) against blocks (1 row per warp):
// the host picks 1 when the grid would not fill the GPU.
#include "attention.cuh"

#define TILE 32

// T: q's and out's type; TK: k's and v's (an f16 cache under f32 queries).
template <typename T, typename TK, int HDP, int RPW>
__device__ void attention_body(const AttnP& p) {
    constexpr int ROWS = 4 * RPW;
    constexpr int NC = HDP / 32;
    __shared__ float sq[ROWS][HDP];
    __shared__ float sk[TILE][HDP + 1];  // +1: lanes read different rows, same column
    __shared__ float sv[TILE][HDP];
    const T* q = (const T*)p.q; const TK* k = (const TK*)p.k; const TK* v = (const TK*)p.v;
    T* out = (T*)p.out;
    const i64 b = blockIdx.z, h = blockIdx.y, r0 = (i64)blockIdx.x * ROWS;
    const i64 kvh = h / (p.heads / p.kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hd = (int)p.hd;
    const float scale = (float)p.scale;

    i64 valid = p.valid ? (i64)p.valid[p.valid_pb ? b : 0] : p.kv_len;
    // Out of 0..=kv_len is the caller's error (the CPU backend refuses it):
    // raise the flag, and clamp so no memory outside the cache is read.
    if ((valid < 0 || valid > p.kv_len) && blockIdx.x == 0 && blockIdx.y == 0 && (p.valid_pb || blockIdx.z == 0) && threadIdx.x == 0)
        atomicOr(p.err, ERR_VALID_LEN);
    i64 kv_end = valid < p.kv_len ? valid : p.kv_len;
    if (kv_end < 0) kv_end = 0;

    const T* qb = q + b * p.qbs + h * p.hd;
    for (int e = threadIdx.x; e < ROWS * HDP; e += blockDim.x) {
        int r = e / HDP, d = e % HDP;
        sq[r][d] = (r0 + r < p.q_len && d < hd) ? ld(qb, (r0 + r) * p.qrs + d) : 0.0f;
    }

    float m[RPW], l[RPW], acc[RPW][NC];
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        m[i] = -INFINITY; l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[i][c] = 0.0f;
    }

    // Causal: the last key any row of this block may see.
    i64 last_row = r0 + ROWS - 1 < p.q_len - 1 ? r0 + ROWS - 1 : p.q_len - 1;
    i64 tile_end = kv_end;
    if (p.causal) {
        i64 lim = valid - p.q_len + last_row + 1;
        if (lim < tile_end) tile_end = lim;
    }
    const TK* kb = k + b * p.kbs + kvh * p.hd;
    const TK* vb = v + b * p.vbs + kvh * p.hd;

    for (i64 t0 = 0; t0 < tile_end; t0 += TILE) {
        __syncthreads();
        // Fixed trip count, unrolled: many loads in flight per thread.
#pragma unroll 16
        for (int it = 0; it < TILE * HDP / 128; ++it) {
            int e = threadIdx.x + it * 128;
            int j = e / HDP, d = e % HDP;
            i64 key = t0 + j;
            bool in = key < p.kv_len && d < hd;
            sk[j][d] = in ? ld(kb, key * p.krs + d) : 0.0f;
            sv[j][d] = in ? ld(vb, key * p.vrs + d) : 0.0f;
        }
        __syncthreads();
        const i64 key = t0 + lane;
        bool key_ok = key < kv_end;
        if (key_ok && p.mask) key_ok = ld_any(p.mask, b * p.kv_len + key, p.mask_dt) != 0.0;
        // A masked key's V row becomes zeros: a padded row may hold NaN or
        // inf, which its weight 0 would still pass on as 0 * NaN (the CPU
        // backend zeroes them too). Every warp computed the same flags.
        if (__syncthreads_or(!key_ok)) {
            if (warp == 0 && !key_ok) {
                for (int d = 0; d < HDP; ++d) sv[lane][d] = 0.0f;
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const int rl = warp * RPW + i;
            const i64 row = r0 + rl;
            if (row >= p.q_len) continue;  // uniform across the warp
            bool ok = key_ok;
            if (p.causal && key > valid - p.q_len + row) ok = false;
            float s = -INFINITY;
            if (ok) {
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma unroll
                for (int d = 0; d < HDP; d += 4) {
                    d0 += sq[rl][d] * sk[lane][d];
                    d1 += sq[rl][d + 1] * sk[lane][d + 1];
                    d2 += sq[rl][d + 2] * sk[lane][d + 2];
                    d3 += sq[rl][d + 3] * sk[lane][d + 3];
                }
                s = ((d0 + d1) + (d2 + d3)) * scale;
            }
            float mt = warp_max(s);
            float mn = fmaxf(m[i], mt);
            if (mn == -INFINITY) continue;  // nothing visible yet for this row
            float corr = expf(m[i] - mn);
            float pr = ok ? expf(s - mn) : 0.0f;
            l[i] = l[i] * corr + warp_sum(pr);
            m[i] = mn;
#pragma unroll
            for (int c = 0; c < NC; ++c) acc[i][c] *= corr;
#pragma unroll
            for (int j = 0; j < TILE; ++j) {
                float pj = __shfl_sync(0xffffffffu, pr, j);
#pragma unroll
                for (int c = 0; c < NC; ++c) acc[i][c] += pj * sv[j][lane + 32 * c];
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const i64 row = r0 + warp * RPW + i;
        if (row >= p.q_len) continue;
        // A row that sees no key at all (fully masked) yields zeros.
        float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        T* o = out + (b * p.q_len + row) * (p.heads * p.hd) + h * p.hd;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            int d = lane + 32 * c;
            if (d < hd) st(o, d, acc[i][c] * inv);
        }
    }
}

// attention_<HDP>_<RPW>_<dtype>, and _f32_kv<dtype> for f32 queries over f16/bf16 keys and values
#define RLX_ATTN(HDP, RPW)                                                                                                       \
    extern "C" __global__ void attention_##HDP##_##RPW##_f32(const AttnP p) { pdl_enter(); attention_body<float, float, HDP, RPW>(p); } \
    extern "C" __global__ void attention_##HDP##_##RPW##_f16(const AttnP p) { pdl_enter(); attention_body<__half, __half, HDP, RPW>(p); } \
    extern "C" __global__ void attention_##HDP##_##RPW##_bf16(const AttnP p) {                                                   \
        pdl_enter();                                                                                                             \
        attention_body<__nv_bfloat16, __nv_bfloat16, HDP, RPW>(p);                                                               \
    }                                                                                                                            \
    extern "C" __global__ void attention_##HDP##_##RPW##_f32_kvf16(const AttnP p) { pdl_enter(); attention_body<float, __half, HDP, RPW>(p); } \
    extern "C" __global__ void attention_##HDP##_##RPW##_f32_kvbf16(const AttnP p) {                                             \
        pdl_enter();                                                                                                             \
        attention_body<float, __nv_bfloat16, HDP, RPW>(p);                                                                       \
    }
// Parts (IN_PART): one per head dim.
#if IN_PART(0)
RLX_ATTN(32, 1)
RLX_ATTN(32, 4)
#endif
#if IN_PART(1)
RLX_ATTN(64, 1)
RLX_ATTN(64, 4)
#endif
#if IN_PART(2)
RLX_ATTN(96, 1)
RLX_ATTN(96, 4)
#endif
#if IN_PART(3)
RLX_ATTN(128, 1)
RLX_ATTN(128, 4)
#endif
