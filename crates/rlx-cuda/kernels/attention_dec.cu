// Attention for one query row per (batch, head): a decode step's
// (attention_dec), and the same fused with RoPE and the KV-cache append
// (attention_app). W warps a block: 16 when the grid is small (one
// sequence: few blocks, each with many warps over the keys), 4 when there
// are more blocks than fit the GPU at once with 16 (batched decode).
#include "attention.cuh"

// One query row (decode: q_len 1) per (batch, head): the W warps of
// a block split the visible keys in steps of KEYS (8, or 4 for head dims
// over 64; warp w takes keys w*KEYS.. , then W*KEYS further on),
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
template <typename T, typename TK, int HDP, int W>
__device__ void dec_core(const float (&qv)[HDP / 32], const TK* kb, const TK* vb, i64 krs, i64 vrs, i64 kv_end, const void* mask,
                         i64 mask_dt, i64 mask_row, i64 hd, i64 own, const float* own_k, const float* own_v, T* o) {
    constexpr int NC = HDP / 32, KEYS = HDP <= 64 ? 8 : 4;
    __shared__ float sm_m[W], sm_l[W];
    __shared__ float sm_o[W][HDP];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int dc[NC];  // this lane's dims, clamped into the row (qv is 0 past hd)
#pragma unroll
    for (int c = 0; c < NC; ++c) dc[c] = lane + 32 * c < hd ? lane + 32 * c : (int)hd - 1;
    float m = -INFINITY, l = 0.0f, acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    for (i64 k0 = (i64)warp * KEYS; k0 < kv_end; k0 += KEYS * W) {
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
    for (int w = 0; w < W; ++w) mt = fmaxf(mt, sm_m[w]);
    float lt = 0.0f;
    float f[W];
#pragma unroll
    for (int w = 0; w < W; ++w) {
        f[w] = sm_m[w] == -INFINITY ? 0.0f : expf(sm_m[w] - mt);
        lt += sm_l[w] * f[w];
    }
    // A row that sees no key at all (fully masked) yields zeros.
    const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < W; ++w) s += sm_o[w][d] * f[w];
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

template <typename T, typename TK, int HDP, int W>
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
    dec_core<T, TK, HDP, W>(qv, kb, vb, p.krs, p.vrs, kv_end, p.mask, p.mask_dt, b * p.kv_len, p.hd, -1, nullptr, nullptr, o);
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

template <typename T, typename TK, int HDP, int W>
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
    dec_core<T, TK, HDP, W>(qv, kc, vc, p.krs, p.vrs, kv_end, p.mask, p.mask_dt, b * p.kv_len, hd, wok ? wpos : -1, s_k, s_v, o);
}

// Before the wait on the previous kernel: an L2 prefetch of the cache rows
// each warp reads in its first two steps (keys up to the cache's length;
// the valid count is not known yet). No kernel before the attention in a
// step writes them: the row an append adds is read from shared memory.
template <typename TK, int HDP, int W>
__device__ __forceinline__ void dec_prefetch(const void* k, const void* v, i64 bs_k, i64 bs_v, i64 krs, i64 vrs, i64 heads, i64 kv_heads,
                                             i64 hd, i64 kv_len) {
    constexpr int KEYS = HDP <= 64 ? 8 : 4, STEPS = 2;
    const i64 b = blockIdx.y, kvh = blockIdx.x / (heads / kv_heads);
    const TK* kb = (const TK*)k + b * bs_k + kvh * hd;
    const TK* vb = (const TK*)v + b * bs_v + kvh * hd;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lines = (int)((hd * (i64)sizeof(TK) + 127) / 128);
    for (int t = lane; t < STEPS * KEYS * 2 * lines; t += 32) {
        const int j = t % (STEPS * KEYS), kv = (t / (STEPS * KEYS)) & 1, line = t / (STEPS * KEYS * 2);
        const i64 key = (i64)warp * KEYS + (j / KEYS) * (KEYS * W) + j % KEYS;
        if (key < kv_len) {
            const char* row = (const char*)(kv ? vb + key * vrs : kb + key * krs) + line * 128;
            asm volatile("prefetch.global.L2 [%0];" ::"l"(row));
        }
    }
}
template <typename TK, int HDP, int W>
__device__ __forceinline__ void dec_prefetch(const AttnP& p) {
    dec_prefetch<TK, HDP, W>(p.k, p.v, p.kbs, p.vbs, p.krs, p.vrs, p.heads, p.kv_heads, p.hd, p.kv_len);
}
template <typename TK, int HDP, int W>
__device__ __forceinline__ void dec_prefetch(const AttnAppP& p) {
    dec_prefetch<TK, HDP, W>(p.kc, p.vc, p.kbs, p.vbs, p.krs, p.vrs, p.heads, p.kv_heads, p.hd, p.kv_len);
}

// attention_dec<W>_<HDP>_<dtype> and attention_app<W>_<HDP>_<dtype> (W warps), and
// _f32_kv<dtype> for f32 queries over f16/bf16 keys and values.
#define RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, SFX, T, TK) \
    extern "C" __global__ void __launch_bounds__(W * 32) NAME##W##_##HDP##_##SFX(const P p) { \
        dec_prefetch<TK, HDP, W>(p);                                                                     \
        pdl_enter();                                                                                     \
        BODY<T, TK, HDP, W>(p);                                                                          \
    }
#define RLX_DEC_TYPES(NAME, BODY, P, W, HDP)                                        \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, f32, float, float)                        \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, f16, __half, __half)                      \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, bf16, __nv_bfloat16, __nv_bfloat16)       \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, f32_kvf16, float, __half)                 \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, f32_kvbf16, float, __nv_bfloat16)
#define RLX_DEC_ALL(W, HDP)                                                          \
    RLX_DEC_TYPES(attention_dec, attention_dec_body, AttnP, W, HDP)                  \
    RLX_DEC_TYPES(attention_app, attention_app_body, AttnAppP, W, HDP)
RLX_DEC_ALL(16, 32)
RLX_DEC_ALL(16, 64)
RLX_DEC_ALL(16, 96)
RLX_DEC_ALL(16, 128)
RLX_DEC_ALL(4, 32)
RLX_DEC_ALL(4, 64)
RLX_DEC_ALL(4, 96)
RLX_DEC_ALL(4, 128)
