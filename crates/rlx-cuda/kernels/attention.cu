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
#include "common.cuh"

#define TILE 32

struct AttnP {
    const void* q; const void* k; const void* v; const void* mask; const int* valid; void* out;
    i64 batch; i64 heads; i64 kv_heads; i64 hd; i64 q_len; i64 kv_len; i64 causal; i64 mask_dt;
    i64 qbs; i64 qrs; i64 kbs; i64 krs; i64 vbs; i64 vrs; double scale; int* err;
    i64 valid_pb;  // valid holds one length per batch row
};

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
RLX_ATTN(32, 1)
RLX_ATTN(32, 4)
RLX_ATTN(64, 1)
RLX_ATTN(64, 4)
RLX_ATTN(96, 1)
RLX_ATTN(96, 4)
RLX_ATTN(128, 1)
RLX_ATTN(128, 4)

// One query row (decode: q_len 1) per (batch, head): the DEC_WARPS warps of
// a block split the visible keys in steps of KEYS (8, or 4 for head dims
// over 64; warp w takes keys w*KEYS.. , then DEC_WARPS*KEYS further on),
// lanes over the head
// dims. A step issues every load of its keys' K and V rows before the
// first use (raw values, converted after), scores the keys, then folds
// them into the warp's online softmax at once; the partial (max, sum,
// output) triples of the warps are merged through shared memory at the
// end. A masked key, or one past the valid end, scores -inf (its rows are
// read but weigh 0). With one query row the causal rule admits exactly the
// valid keys.
//
// `dec_core` is that loop for scaled query values `qv` already in
// registers (0 past hd); key `own` (or none: -1) is read from `own_k` /
// `own_v` in shared memory instead of kb / vb (the row an append is
// writing).
#define DEC_WARPS 16
template <typename T, typename TK, int HDP>
__device__ void dec_core(const float (&qv)[HDP / 32], const TK* kb, const TK* vb, i64 krs, i64 vrs, i64 kv_end, const void* mask,
                         i64 mask_dt, i64 mask_row, i64 hd, i64 own, const float* own_k, const float* own_v, T* o) {
    constexpr int NC = HDP / 32, KEYS = HDP <= 64 ? 8 : 4;
    __shared__ float sm_m[DEC_WARPS], sm_l[DEC_WARPS];
    __shared__ float sm_o[DEC_WARPS][HDP];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int dc[NC];  // this lane's dims, clamped into the row (qv is 0 past hd)
#pragma unroll
    for (int c = 0; c < NC; ++c) dc[c] = lane + 32 * c < hd ? lane + 32 * c : (int)hd - 1;
    float m = -INFINITY, l = 0.0f, acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    for (i64 k0 = (i64)warp * KEYS; k0 < kv_end; k0 += KEYS * DEC_WARPS) {
        TK kraw[KEYS][NC], vraw[KEYS][NC];
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
            const i64 key = k0 + j < kv_end ? k0 + j : 0;  // in bounds; dropped below
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                kraw[j][c] = kb[key * krs + dc[c]];
                vraw[j][c] = vb[key * vrs + dc[c]];
            }
        }
        float sc[KEYS];
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
            const i64 key = k0 + j;
            float s = 0.0f;
#pragma unroll
            for (int c = 0; c < NC; ++c) s = fmaf(qv[c], key == own ? own_k[dc[c]] : to_f32(kraw[j][c]), s);
            s = warp_sum(s);
            bool ok = key < kv_end;
            if (ok && mask) ok = ld_any(mask, mask_row + key, mask_dt) != 0.0;
            sc[j] = ok ? s : -INFINITY;
        }
        float mn = m;
#pragma unroll
        for (int j = 0; j < KEYS; ++j) mn = fmaxf(mn, sc[j]);
        if (mn == -INFINITY) continue;  // no key of the step counts (uniform across the warp)
        const float corr = expf(m - mn);
        l *= corr;
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] *= corr;
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
            const float pr = expf(sc[j] - mn);
            const i64 key = k0 + j;
            l += pr;
#pragma unroll
            for (int c = 0; c < NC; ++c) acc[c] = fmaf(pr, key == own ? own_v[dc[c]] : to_f32(vraw[j][c]), acc[c]);
        }
        m = mn;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) sm_o[warp][lane + 32 * c] = acc[c];
    __syncthreads();
    float mt = -INFINITY;
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) mt = fmaxf(mt, sm_m[w]);
    float lt = 0.0f;
    float f[DEC_WARPS];
#pragma unroll
    for (int w = 0; w < DEC_WARPS; ++w) {
        f[w] = sm_m[w] == -INFINITY ? 0.0f : expf(sm_m[w] - mt);
        lt += sm_l[w] * f[w];
    }
    // A row that sees no key at all (fully masked) yields zeros.
    const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) s += sm_o[w][d] * f[w];
        st(o, d, s * inv);
    }
}

// The number of valid keys of batch row b (clamped to 0..=kv_len; a bad
// value raises the error flag once).
__device__ __forceinline__ i64 dec_valid(const int* valid, i64 valid_pb, i64 kv_len, i64 b, i64 h, int* err) {
    const i64 n = valid ? (i64)valid[valid_pb ? b : 0] : kv_len;
    if ((n < 0 || n > kv_len) && h == 0 && (valid_pb || b == 0) && threadIdx.x == 0) atomicOr(err, ERR_VALID_LEN);
    return n < 0 ? 0 : (n < kv_len ? n : kv_len);
}

template <typename T, typename TK, int HDP>
__device__ void attention_dec_body(const AttnP& p) {
    constexpr int NC = HDP / 32;
    const i64 b = blockIdx.y, h = blockIdx.x;
    const i64 kvh = h / (p.heads / p.kv_heads);
    const int lane = threadIdx.x & 31;
    const float scale = (float)p.scale;
    const i64 kv_end = dec_valid(p.valid, p.valid_pb, p.kv_len, b, h, p.err);
    const T* qb = (const T*)p.q + b * p.qbs + h * p.hd;
    float qv[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int d = lane + 32 * c;
        qv[c] = d < p.hd ? ld(qb, d) * scale : 0.0f;
    }
    const TK* kb = (const TK*)p.k + b * p.kbs + kvh * p.hd;
    const TK* vb = (const TK*)p.v + b * p.vbs + kvh * p.hd;
    T* o = (T*)p.out + b * (p.heads * p.hd) + h * p.hd;
    dec_core<T, TK, HDP>(qv, kb, vb, p.krs, p.vrs, kv_end, p.mask, p.mask_dt, b * p.kv_len, p.hd, -1, nullptr, nullptr, o);
}

// A decode step's attention with its KV-cache append (Op::AttentionAppend):
// the block of (batch b, head h) loads q's head and its kv head's new key
// and value rows, turns q and the key by RoPE (`rope` 1: rotate-half pairs
// (i, i + hd/2), 2: interleaved pairs (2i, 2i+1); angles as the rope
// kernel's), rounds them as the separate kernels' stores would (q and the
// key to T, key and value to the cache's TK), and the group's first head
// writes them into the caches at row `wpos`. Every block of the group
// reads that row from its own shared copy, so no block waits for another's
// write. A bad write position raises ERR_STATE_OVERFLOW and writes nothing.
struct AttnAppP {
    const void* q; const void* kn; const void* vn; void* kc; void* vc; const int* wpos; const int* rpos; const float* factors;
    const int* valid; const void* mask; void* out; int* err;
    i64 batch; i64 heads; i64 kv_heads; i64 hd; i64 kv_len; i64 mask_dt;
    i64 qbs; i64 knbs; i64 vnbs; i64 kbs; i64 krs; i64 vbs; i64 vrs;
    i64 wpos_pb; i64 rpos_pb; i64 valid_pb; i64 rope; double theta; double scale;
};

template <typename T> __device__ __forceinline__ float round_to(float v) { T t; st(&t, 0, v); return ld(&t, 0); }

template <typename T, typename TK, int HDP>
__device__ void attention_app_body(const AttnAppP& p) {
    constexpr int NC = HDP / 32;
    __shared__ float s_q[HDP], s_k[HDP], s_v[HDP];
    const i64 b = blockIdx.y, h = blockIdx.x;
    const i64 group = p.heads / p.kv_heads, kvh = h / group;
    const int lane = threadIdx.x & 31;
    const int hd = (int)p.hd;
    const T* qb = (const T*)p.q + b * p.qbs + h * hd;
    const T* knb = (const T*)p.kn + b * p.knbs + kvh * hd;
    const T* vnb = (const T*)p.vn + b * p.vnbs + kvh * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        s_q[d] = ld(qb, d);
        s_k[d] = ld(knb, d);
        s_v[d] = ld(vnb, d);
    }
    __syncthreads();
    if (p.rope) {
        const int half = hd / 2, i = threadIdx.x;
        int i0 = 0, i1 = 0;
        float q0 = 0.0f, q1 = 0.0f, k0 = 0.0f, k1 = 0.0f;
        if (i < half) {
            const i64 pos = (i64)p.rpos[p.rpos_pb ? b : 0];
            double invd = pow(p.theta, -2.0 * (double)i / (double)hd);
            if (p.factors) invd /= (double)p.factors[i];
            const float inv = (float)invd;
            const float ang = (float)pos * inv, c = cosf(ang), sn = sinf(ang);
            i0 = p.rope == 1 ? i : 2 * i;
            i1 = p.rope == 1 ? i + half : 2 * i + 1;
            q0 = s_q[i0] * c - s_q[i1] * sn;
            q1 = s_q[i1] * c + s_q[i0] * sn;
            k0 = s_k[i0] * c - s_k[i1] * sn;
            k1 = s_k[i1] * c + s_k[i0] * sn;
        }
        __syncthreads();
        if (i < half) {
            s_q[i0] = round_to<T>(q0);
            s_q[i1] = round_to<T>(q1);
            s_k[i0] = round_to<T>(k0);
            s_k[i1] = round_to<T>(k1);
        }
        __syncthreads();
    }
    const i64 wpos = (i64)p.wpos[p.wpos_pb ? b : 0];
    const bool wok = wpos >= 0 && wpos < p.kv_len;
    if (!wok && h == 0 && (p.wpos_pb || b == 0) && threadIdx.x == 0) atomicOr(p.err, ERR_STATE_OVERFLOW);
    TK* kc = (TK*)p.kc + b * p.kbs + kvh * hd;
    TK* vc = (TK*)p.vc + b * p.vbs + kvh * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float kr = round_to<TK>(s_k[d]), vr = round_to<TK>(s_v[d]);
        s_k[d] = kr;
        s_v[d] = vr;
        if (wok && h % group == 0) {
            st(kc, wpos * p.krs + d, kr);
            st(vc, wpos * p.vrs + d, vr);
        }
    }
    __syncthreads();
    const float scale = (float)p.scale;
    float qv[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int d = lane + 32 * c;
        qv[c] = d < hd ? s_q[d] * scale : 0.0f;
    }
    const i64 kv_end = dec_valid(p.valid, p.valid_pb, p.kv_len, b, h, p.err);
    T* o = (T*)p.out + b * (p.heads * hd) + h * hd;
    dec_core<T, TK, HDP>(qv, kc, vc, p.krs, p.vrs, kv_end, p.mask, p.mask_dt, b * p.kv_len, hd, wok ? wpos : -1, s_k, s_v, o);
}

// attention_dec_<HDP>_<dtype>, and _f32_kv<dtype> for f32 queries over f16/bf16 keys and values
#define RLX_ATTN_DEC(HDP)                                                                                                      \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_dec_##HDP##_f32(const AttnP p) { pdl_enter(); attention_dec_body<float, float, HDP>(p); } \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_dec_##HDP##_f16(const AttnP p) { pdl_enter(); attention_dec_body<__half, __half, HDP>(p); } \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_dec_##HDP##_bf16(const AttnP p) {                                                     \
        pdl_enter();                                                                                                           \
        attention_dec_body<__nv_bfloat16, __nv_bfloat16, HDP>(p);                                                              \
    }                                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_dec_##HDP##_f32_kvf16(const AttnP p) { pdl_enter(); attention_dec_body<float, __half, HDP>(p); } \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_dec_##HDP##_f32_kvbf16(const AttnP p) {                                               \
        pdl_enter();                                                                                                           \
        attention_dec_body<float, __nv_bfloat16, HDP>(p);                                                                      \
    }
RLX_ATTN_DEC(32)
RLX_ATTN_DEC(64)
RLX_ATTN_DEC(96)
RLX_ATTN_DEC(128)

// attention_app_<HDP>_<dtype>, and _f32_kv<dtype> for f32 queries over an f16/bf16 cache
#define RLX_ATTN_APP(HDP)                                                                                                      \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_app_##HDP##_f32(const AttnAppP p) { pdl_enter(); attention_app_body<float, float, HDP>(p); } \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_app_##HDP##_f16(const AttnAppP p) { pdl_enter(); attention_app_body<__half, __half, HDP>(p); } \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_app_##HDP##_bf16(const AttnAppP p) {                                                  \
        pdl_enter();                                                                                                           \
        attention_app_body<__nv_bfloat16, __nv_bfloat16, HDP>(p);                                                              \
    }                                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_app_##HDP##_f32_kvf16(const AttnAppP p) {                                             \
        pdl_enter();                                                                                                           \
        attention_app_body<float, __half, HDP>(p);                                                                             \
    }                                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32) attention_app_##HDP##_f32_kvbf16(const AttnAppP p) {                                            \
        pdl_enter();                                                                                                           \
        attention_app_body<float, __nv_bfloat16, HDP>(p);                                                                      \
    }
RLX_ATTN_APP(32)
RLX_ATTN_APP(64)
RLX_ATTN_APP(96)
RLX_ATTN_APP(128)
