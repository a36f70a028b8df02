// Fused attention: softmax(q·kᵀ·scale + masks)·v in one pass with an online
// softmax, so scores never reach device memory.
//
// A block (4 warps) owns ROWS query rows of one (batch, head); each warp
// handles ROWS/4 of them. K and V stream through shared memory in tiles of 32
// keys: in the score step lane j scores key j of the tile, in the value step
// lane l accumulates output dims l, l+32, l+64, l+96 (head_dim <= 128).
#include "common.cuh"

#define ROWS 16
#define TILE 32
#define MAX_HD 128
#define RPW (ROWS / 4)

struct AttnP {
    const void* q; const void* k; const void* v; const void* mask; const int* valid; void* out;
    i64 batch; i64 heads; i64 kv_heads; i64 hd; i64 q_len; i64 kv_len; i64 causal; i64 mask_dt;
    i64 qbs; i64 qrs; i64 kbs; i64 krs; i64 vbs; i64 vrs; double scale;
};

template <typename T>
__device__ void attention_body(const AttnP& p) {
    __shared__ float sq[ROWS][MAX_HD];
    __shared__ float sk[TILE][MAX_HD + 1];  // +1: lanes read different rows, same column
    __shared__ float sv[TILE][MAX_HD];
    const T* q = (const T*)p.q; const T* k = (const T*)p.k; const T* v = (const T*)p.v;
    T* out = (T*)p.out;
    const i64 b = blockIdx.z, h = blockIdx.y, r0 = (i64)blockIdx.x * ROWS;
    const i64 kvh = h / (p.heads / p.kv_heads);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float scale = (float)p.scale;

    i64 valid = p.valid ? (i64)*p.valid : p.kv_len;
    i64 kv_end = valid < p.kv_len ? valid : p.kv_len;
    if (kv_end < 0) kv_end = 0;

    for (i64 e = threadIdx.x; e < ROWS * p.hd; e += blockDim.x) {
        i64 r = e / p.hd, d = e % p.hd;
        sq[r][d] = r0 + r < p.q_len ? ld(q, b * p.qbs + (r0 + r) * p.qrs + h * p.hd + d) : 0.0f;
    }

    float m[RPW], l[RPW], acc[RPW][4];
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        m[i] = -INFINITY; l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = 0.0f;
    }

    // Causal: the last key any row of this block may see.
    i64 last_row = r0 + ROWS - 1 < p.q_len - 1 ? r0 + ROWS - 1 : p.q_len - 1;
    i64 tile_end = kv_end;
    if (p.causal) {
        i64 lim = valid - p.q_len + last_row + 1;
        if (lim < tile_end) tile_end = lim;
    }

    for (i64 t0 = 0; t0 < tile_end; t0 += TILE) {
        __syncthreads();
        for (i64 e = threadIdx.x; e < TILE * p.hd; e += blockDim.x) {
            i64 j = e / p.hd, d = e % p.hd, key = t0 + j;
            bool in = key < p.kv_len;
            sk[j][d] = in ? ld(k, b * p.kbs + key * p.krs + kvh * p.hd + d) : 0.0f;
            sv[j][d] = in ? ld(v, b * p.vbs + key * p.vrs + kvh * p.hd + d) : 0.0f;
        }
        __syncthreads();
        const i64 key = t0 + lane;
        bool key_ok = key < kv_end;
        if (key_ok && p.mask) key_ok = ld_any(p.mask, b * p.kv_len + key, p.mask_dt) != 0.0;
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const int rl = warp * RPW + i;
            const i64 row = r0 + rl;
            if (row >= p.q_len) continue;  // uniform across the warp
            bool ok = key_ok;
            if (p.causal && key > valid - p.q_len + row) ok = false;
            float s = -INFINITY;
            if (ok) {
                float dot = 0.0f;
                for (i64 d = 0; d < p.hd; ++d) dot += sq[rl][d] * sk[lane][d];
                s = dot * scale;
            }
            float mt = warp_max(s);
            float mn = fmaxf(m[i], mt);
            if (mn == -INFINITY) continue;  // nothing visible yet for this row
            float corr = expf(m[i] - mn);
            float pr = ok ? expf(s - mn) : 0.0f;
            l[i] = l[i] * corr + warp_sum(pr);
            m[i] = mn;
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][c] *= corr;
            for (int j = 0; j < TILE; ++j) {
                float pj = __shfl_sync(0xffffffffu, pr, j);
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    int d = lane + 32 * c;
                    if (d < p.hd) acc[i][c] += pj * sv[j][d];
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const i64 row = r0 + warp * RPW + i;
        if (row >= p.q_len) continue;
        // A row that sees no key at all (fully masked) yields zeros.
        float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            int d = lane + 32 * c;
            if (d < p.hd) st(out, (b * p.q_len + row) * (p.heads * p.hd) + h * p.hd + d, acc[i][c] * inv);
        }
    }
}
RLX_FLOAT_KERNELS(attention, AttnP)
