// Attention for one query row per (batch, head): a decode step's
// (attention_dec), and the same fused with RoPE and the KV-cache append
// (attention_app). W warps a block: 16 when the grid is small (one
// sequence: few blocks, each with many warps over the keys), 4 when there
// are more blocks than fit the GPU at once with 16 (batched decode). A
// small grid's append also splits a long cache's keys over several blocks
// a head (see attention_app_body).
#include "attention.cuh"

// One query row (decode: q_len 1) per (batch, head). A round gives each
// of the W warps 32 keys. Where the rows are whole (hd = HDP) and 16-byte
// aligned (`dec_core_quad`), four lanes share a key's K row, each scoring
// a quarter of its dims, so a warp load covers 8 rows; otherwise
// (`dec_core_rows`) each lane scores one key, reading its whole row. The
// loads of a round's K rows and of the V rows of the warp's first keys are
// issued before any use; the warp folds its 32 scores into its online
// softmax at once; then for each of the warp's keys (its probability
// broadcast from a lane that scored it) every lane adds the V values of
// its own NC = HDP/32 neighbouring dims. W·32 keys a round: one round up to
// 512 keys with 16 warps. The partial (max, sum, output) triples of the
// warps are merged through shared memory at the end (`dec_merge`). A
// masked key, or one past the valid end, scores -inf (its rows are read
// but weigh 0). With one query row the causal rule admits exactly the
// valid keys.
//
// `dec_core` runs that loop for the scaled query `sq` in shared memory (0
// past hd); key `own` (or none: -1) is read from `own_k` / `own_v` in
// shared memory instead of kb / vb (the row an append is writing).
// Rows are held as packed 32-bit words (two 16-bit elements a word), so a
// 16-bit row takes half the registers of its element count.
template <typename TK> __device__ __forceinline__ unsigned tk_bits(TK v);
template <> __device__ __forceinline__ unsigned tk_bits(float v) { return __float_as_uint(v); }
template <> __device__ __forceinline__ unsigned tk_bits(__half v) { return __half_as_ushort(v); }
template <> __device__ __forceinline__ unsigned tk_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
// Element i of words holding TK elements packed.
template <typename TK> __device__ __forceinline__ float word_get(const unsigned* w, int i);
template <> __device__ __forceinline__ float word_get<float>(const unsigned* w, int i) { return __uint_as_float(w[i]); }
template <> __device__ __forceinline__ float word_get<__half>(const unsigned* w, int i) {
    return __half2float(__ushort_as_half((unsigned short)(w[i >> 1] >> (16 * (i & 1)))));
}
template <> __device__ __forceinline__ float word_get<__nv_bfloat16>(const unsigned* w, int i) {
    return __uint_as_float(i & 1 ? w[i >> 1] & 0xffff0000u : w[i >> 1] << 16);
}

// N elements from p into packed words: one load of N·size bytes where that
// is 4, 8 or 16 bytes and `vec` says p is aligned to it, else N loads, the
// element offsets clamped below `lim` (the row's end).
template <typename TK, int N>
__device__ __forceinline__ void ld_words(const TK* p, bool vec, int off, int lim, unsigned* w) {
    constexpr int B = N * (int)sizeof(TK);
    if constexpr (B == 4 || B == 8 || B == 16) {
        if (vec) {
            if constexpr (B == 4) w[0] = *(const unsigned*)(p + off);
            if constexpr (B == 8) { const uint2 u = *(const uint2*)(p + off); w[0] = u.x; w[1] = u.y; }
            if constexpr (B == 16) { const uint4 u = *(const uint4*)(p + off); w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w; }
            return;
        }
    }
    constexpr int PW = 4 / (int)sizeof(TK);  // elements a word
#pragma unroll
    for (int i = 0; i < (B + 3) / 4; ++i) w[i] = 0u;
#pragma unroll
    for (int i = 0; i < N; ++i) w[i / PW] |= tk_bits(p[off + i < lim ? off + i : lim - 1]) << (32 / PW * (i % PW));
}

// The end of a decode attention: the W warps' partial (max, sum, output)
// triples merged through shared memory, the row stored; or, where `part`
// is set (a split of the keys, see attention_app_body), the block's own
// triple stored there instead: HDP unnormalised sums, then the max and the
// sum of weights.
template <typename T, int HDP, int W>
__device__ __forceinline__ void dec_merge(float m, float l, const float (&acc)[HDP / 32], i64 hd, T* o, float* part) {
    constexpr int NC = HDP / 32;
    __shared__ float sm_m[W], sm_l[W];
    __shared__ float sm_o[W][HDP];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d0 = lane * NC;
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) sm_o[warp][d0 + c] = acc[c];
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
    if (part) {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float s = 0.0f;
#pragma unroll
            for (int w = 0; w < W; ++w) s += sm_o[w][d] * f[w];
            __stcg(part + d, s);
        }
        if (threadIdx.x == 0) {
            __stcg(part + HDP, mt);
            __stcg(part + HDP + 1, lt);
        }
        return;
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

// The decode attention loop for rows read in place (see above): the
// fallback for rows that are not whole and 16-byte aligned.
template <typename T, typename TK, int HDP, int W>
__device__ __forceinline__ void dec_core_rows(const float* sq, const TK* kb, const TK* vb, i64 krs, i64 vrs, i64 k_lo, i64 kv_end, const void* mask,
                                              i64 mask_dt, i64 mask_row, i64 hd, i64 own, const float* own_k, const float* own_v, T* o, float* part) {
    constexpr int NC = HDP / 32;
    // A key's K row is read in chunks of at most 128 bytes (32 registers),
    // 16 bytes a load; V rows for VG keys at a time (at most 32 registers).
    constexpr int KC0 = (int)(128 / sizeof(TK)) < HDP ? (int)(128 / sizeof(TK)) : HDP;
    constexpr int KC = HDP % KC0 == 0 ? KC0 : 32, KL = 16 / (int)sizeof(TK);
    constexpr int VB = NC * (int)sizeof(TK), VG = VB <= 4 ? 32 : VB <= 8 ? 16 : 8, VW = (VB + 3) / 4;
    static_assert(HDP % KC == 0 && KC % KL == 0, "K chunks of whole 16-byte loads");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Uniform over the block: whole rows of hd = HDP with 16-byte aligned
    // starts take vector loads; others (odd head dims, strided views) read
    // element by element, dims clamped into the row.
    const bool vec = hd == HDP && ((unsigned long long)kb | (unsigned long long)vb | (unsigned long long)(krs * sizeof(TK)) | (unsigned long long)(vrs * sizeof(TK))) % 16 == 0;
    const int d0 = lane * NC;  // this lane's output dims d0 .. d0 + NC
    float m = -INFINITY, l = 0.0f, acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    for (i64 base = k_lo + (i64)warp * 32; base < kv_end; base += 32 * W) {
        const i64 key = base + lane;
        const i64 kk = key < kv_end ? key : base;  // in bounds; dropped below
        const TK* krow = kb + kk * krs;
        // The first V group's rows, loaded with the first K chunk.
        unsigned vw[VG][VW];
        auto load_v = [&](int g) {
#pragma unroll
            for (int j = 0; j < VG; ++j) {
                const i64 vk = base + g * VG + j < kv_end ? base + g * VG + j : base;
                ld_words<TK, NC>(vb + vk * vrs, vec, d0, (int)hd, vw[j]);
            }
        };
        float s = 0.0f;
#pragma unroll
        for (int k0 = 0; k0 < HDP; k0 += KC) {
            unsigned kw[KC * sizeof(TK) / 4];
#pragma unroll
            for (int i = 0; i < KC; i += KL) ld_words<TK, KL>(krow, vec, k0 + i, (int)hd, kw + i * sizeof(TK) / 4);
            if (k0 == 0) load_v(0);
#pragma unroll
            for (int i = 0; i < KC; i += 4) {
                const float4 q4 = *(const float4*)(sq + k0 + i);
                s = fmaf(q4.x, word_get<TK>(kw, i), s);
                s = fmaf(q4.y, word_get<TK>(kw, i + 1), s);
                s = fmaf(q4.z, word_get<TK>(kw, i + 2), s);
                s = fmaf(q4.w, word_get<TK>(kw, i + 3), s);
            }
        }
        if (key == own) {
            s = 0.0f;
            for (int d = 0; d < hd; ++d) s = fmaf(sq[d], own_k[d], s);
        }
        bool ok = key < kv_end;
        if (ok && mask) ok = ld_any(mask, mask_row + key, mask_dt) != 0.0;
        s = ok ? s : -INFINITY;
        const float mr = warp_max(s);
        if (mr == -INFINITY) continue;  // no key of the round counts (uniform across the warp)
        const float mn = fmaxf(m, mr), corr = expf(m - mn);
        const float pr = ok ? expf(s - mn) : 0.0f;
        l = l * corr + warp_sum(pr);
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] *= corr;
        m = mn;
#pragma unroll
        for (int g = 0; g < 32 / VG; ++g) {
            if (base + g * VG >= kv_end) break;  // uniform
            if (g > 0) load_v(g);
#pragma unroll
            for (int j = 0; j < VG; ++j) {
                const float pj = __shfl_sync(0xffffffffu, pr, g * VG + j);
                if (base + g * VG + j == own) {
#pragma unroll
                    for (int c = 0; c < NC; ++c) acc[c] = fmaf(pj, d0 + c < hd ? own_v[d0 + c] : 0.0f, acc[c]);
                } else {
#pragma unroll
                    for (int c = 0; c < NC; ++c) acc[c] = fmaf(pj, word_get<TK>(vw[j], c), acc[c]);
                }
            }
        }
    }
    dec_merge<T, HDP, W>(m, l, acc, hd, o, part);
}

// dec_core over whole, 16-byte aligned rows with each K row read by four
// lanes: in a round of 32 keys, lane l scores keys base + 8p + l/4 (p < 4)
// over dims (l%4)·HDP/4 onward, and two shuffles sum the four partial dots.
// One warp load then covers pieces of 8 rows instead of 32 (a row a lane,
// as dec_core_rows reads them), so it touches a quarter of the cache lines.
// The V half is dec_core_rows'. `QuadRegs` holds a round's loads: K pieces
// of PC keys at once (at most 32 registers) and V rows of VG keys.
template <typename TK, int HDP>
struct QuadRegs {
    static constexpr int NC = HDP / 32, KD = HDP / 4, KL = 16 / (int)sizeof(TK), KW = KD * (int)sizeof(TK) / 4;
    static constexpr int PC = KW >= 32 ? 1 : 32 / KW < 4 ? 32 / KW : 4;
    static constexpr int VB = NC * (int)sizeof(TK), VG = VB <= 4 ? 32 : VB <= 8 ? 16 : 8, VW = (VB + 3) / 4;
    static_assert(KD % KL == 0 && 4 % PC == 0, "a lane's piece of a row is whole 16-byte loads");
    // A round's loads are one batch (all its K pieces and V rows), so they
    // can be issued before the wait on the previous kernel.
    static constexpr bool ONE = PC == 4 && VG == 32;
    unsigned kw[PC][KW];
    unsigned vw[VG][VW];
    // The K pieces of keys base + 8(p0 + pp) + quad, pp < PC; a key at or
    // past `lim` reads key base's row instead (in bounds, weighed 0 later).
    __device__ __forceinline__ void load_k(const TK* kb, i64 krs, i64 base, i64 lim, int p0) {
        const int lane = threadIdx.x & 31, quad = lane >> 2, ql = lane & 3;
#pragma unroll
        for (int pp = 0; pp < PC; ++pp) {
            const i64 key = base + 8 * (p0 + pp) + quad;
            const TK* kr = kb + (key < lim ? key : base) * krs + ql * KD;
#pragma unroll
            for (int i = 0; i < KD; i += KL) {
                const uint4 u = *(const uint4*)(kr + i);
                unsigned* w = kw[pp] + i / KL * 4;
                w[0] = u.x;
                w[1] = u.y;
                w[2] = u.z;
                w[3] = u.w;
            }
        }
    }
    // This lane's NC dims of the V rows of keys base + g·VG + j, j < VG.
    __device__ __forceinline__ void load_v(const TK* vb, i64 vrs, i64 base, i64 lim, int g) {
        const int d0 = (threadIdx.x & 31) * NC;
#pragma unroll
        for (int j = 0; j < VG; ++j) {
            const i64 vk = base + g * VG + j < lim ? base + g * VG + j : base;
            ld_words<TK, NC>(vb + vk * vrs, true, d0, HDP, vw[j]);
        }
    }
};

// Keys k_lo .. kv_end. `pre`: r already holds the warp's first round
// (keys from k_lo + warp·32) as loaded with limit `pre` (QuadRegs::ONE
// only; -1: nothing loaded). A warp uses it where that limit cuts its
// round where kv_end does (so it holds the rows this loop would load),
// else loads again.
template <typename T, typename TK, int HDP, int W>
__device__ __forceinline__ void dec_core_quad(QuadRegs<TK, HDP>& r, i64 pre, const float* sq, const TK* kb, const TK* vb, i64 krs, i64 vrs,
                                              i64 k_lo, i64 kv_end, const void* mask, i64 mask_dt, i64 mask_row, i64 own, const float* own_k,
                                              const float* own_v, T* o, float* part) {
    using R = QuadRegs<TK, HDP>;
    constexpr int NC = R::NC, KD = R::KD, PC = R::PC, VG = R::VG;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, quad = lane >> 2, ql = lane & 3;
    const int d0 = lane * NC;
    const float* qv = sq + ql * KD;
    float m = -INFINITY, l = 0.0f, acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    for (i64 base = k_lo + (i64)warp * 32; base < kv_end; base += 32 * W) {
        const i64 end = base + 32;
        const bool loaded = R::ONE && base < k_lo + 32 * W && base < pre && (pre < end ? pre : end) == (kv_end < end ? kv_end : end);
        float sc[4];
#pragma unroll
        for (int p0 = 0; p0 < 4; p0 += PC) {
            if (!loaded) {
                r.load_k(kb, krs, base, kv_end, p0);
                if (p0 == 0) r.load_v(vb, vrs, base, kv_end, 0);
            }
#pragma unroll
            for (int pp = 0; pp < PC; ++pp) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < KD; i += 4) {
                    const float4 q4 = *(const float4*)(qv + i);
                    s = fmaf(q4.x, word_get<TK>(r.kw[pp], i), s);
                    s = fmaf(q4.y, word_get<TK>(r.kw[pp], i + 1), s);
                    s = fmaf(q4.z, word_get<TK>(r.kw[pp], i + 2), s);
                    s = fmaf(q4.w, word_get<TK>(r.kw[pp], i + 3), s);
                }
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                sc[p0 + pp] = s;
            }
        }
        float mr = -INFINITY;
        bool ok[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const i64 key = base + 8 * p + quad;
            if (key == own) {
                float s = 0.0f;
                for (int d = 0; d < HDP; ++d) s = fmaf(sq[d], own_k[d], s);
                sc[p] = s;
            }
            ok[p] = key < kv_end;
            if (ok[p] && mask) ok[p] = ld_any(mask, mask_row + key, mask_dt) != 0.0;
            mr = fmaxf(mr, ok[p] ? sc[p] : -INFINITY);
        }
        mr = warp_max(mr);
        if (mr == -INFINITY) continue;  // no key of the round counts (uniform across the warp)
        const float mn = fmaxf(m, mr), corr = expf(m - mn);
        float ps = 0.0f;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            sc[p] = ok[p] ? expf(sc[p] - mn) : 0.0f;
            ps += sc[p];
        }
        // A quad's four lanes hold the same probabilities: one counts them.
        l = l * corr + warp_sum(ql == 0 ? ps : 0.0f);
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[c] *= corr;
        m = mn;
#pragma unroll
        for (int g = 0; g < 32 / VG; ++g) {
            if (base + g * VG >= kv_end) break;  // uniform
            if (g > 0) r.load_v(vb, vrs, base, kv_end, g);
#pragma unroll
            for (int j = 0; j < VG; ++j) {
                const int jj = g * VG + j;  // key base + jj: probability sc[jj / 8] of quad jj % 8
                const float pj = __shfl_sync(0xffffffffu, sc[jj >> 3], (jj & 7) * 4);
                if (base + jj == own) {
#pragma unroll
                    for (int c = 0; c < NC; ++c) acc[c] = fmaf(pj, own_v[d0 + c], acc[c]);
                } else {
#pragma unroll
                    for (int c = 0; c < NC; ++c) acc[c] = fmaf(pj, word_get<TK>(r.vw[j], c), acc[c]);
                }
            }
        }
    }
    dec_merge<T, HDP, W>(m, l, acc, HDP, o, part);
}

// Whether the cache rows can be read by dec_core_quad: whole rows of
// hd = HDP with 16-byte aligned starts.
template <typename TK, int HDP>
__device__ __forceinline__ bool dec_vec(const TK* kb, const TK* vb, i64 krs, i64 vrs, i64 hd) {
    return hd == HDP && ((unsigned long long)kb | (unsigned long long)vb | (unsigned long long)(krs * sizeof(TK)) | (unsigned long long)(vrs * sizeof(TK))) % 16 == 0;
}

template <typename T, typename TK, int HDP, int W>
__device__ __noinline__ void dec_core_quad_call(const float* sq, const TK* kb, const TK* vb, i64 krs, i64 vrs, i64 k_lo, i64 kv_end,
                                                const void* mask, i64 mask_dt, i64 mask_row, i64 own, const float* own_k, const float* own_v,
                                                T* o, float* part) {
    QuadRegs<TK, HDP> r;
    dec_core_quad<T, TK, HDP, W>(r, -1, sq, kb, vb, krs, vrs, k_lo, kv_end, mask, mask_dt, mask_row, own, own_k, own_v, o, part);
}

template <typename T, typename TK, int HDP, int W>
__device__ __noinline__ void dec_core_rows_call(const float* sq, const TK* kb, const TK* vb, i64 krs, i64 vrs, i64 k_lo, i64 kv_end,
                                                const void* mask, i64 mask_dt, i64 mask_row, i64 hd, i64 own, const float* own_k,
                                                const float* own_v, T* o, float* part) {
    dec_core_rows<T, TK, HDP, W>(sq, kb, vb, krs, vrs, k_lo, kv_end, mask, mask_dt, mask_row, hd, own, own_k, own_v, o, part);
}

// Whether a head dim takes dec_core_quad: not 96, whose V rows (3 dims a
// lane) are element loads that, beside the four-lane K read, spill.
template <int HDP> __host__ __device__ constexpr bool quad_dims() { return HDP != 96; }

// Decode attention over the cache rows: dec_core_quad where whole rows of
// hd = HDP start 16-byte aligned, else dec_core_rows (element loads). Where
// both are built each is a function of its own, so neither's registers
// weigh on the other.
template <typename T, typename TK, int HDP, int W>
__device__ __forceinline__ void dec_core(const float* sq, const TK* kb, const TK* vb, i64 krs, i64 vrs, i64 k_lo, i64 kv_end, const void* mask,
                                         i64 mask_dt, i64 mask_row, i64 hd, i64 own, const float* own_k, const float* own_v, T* o, float* part) {
    if constexpr (quad_dims<HDP>()) {
        if (dec_vec<TK, HDP>(kb, vb, krs, vrs, hd))
            dec_core_quad_call<T, TK, HDP, W>(sq, kb, vb, krs, vrs, k_lo, kv_end, mask, mask_dt, mask_row, own, own_k, own_v, o, part);
        else
            dec_core_rows_call<T, TK, HDP, W>(sq, kb, vb, krs, vrs, k_lo, kv_end, mask, mask_dt, mask_row, hd, own, own_k, own_v, o, part);
    } else {
        dec_core_rows<T, TK, HDP, W>(sq, kb, vb, krs, vrs, k_lo, kv_end, mask, mask_dt, mask_row, hd, own, own_k, own_v, o, part);
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
    __shared__ __align__(16) float s_q[HDP];
    pdl_enter();
    const i64 b = blockIdx.y, h = blockIdx.x;
    const i64 kvh = h / (p.heads / p.kv_heads);
    const i64 kv_end = dec_valid(p.valid, p.valid_pb, p.kv_len, b, h, p.err);
    const T* qb = (const T*)p.q + b * p.qbs + h * p.hd;
    for (int d = threadIdx.x; d < HDP; d += blockDim.x) s_q[d] = d < p.hd ? ld(qb, d) * (float)p.scale : 0.0f;
    __syncthreads();
    const TK* kb = (const TK*)p.k + b * p.kbs + kvh * p.hd;
    const TK* vb = (const TK*)p.v + b * p.vbs + kvh * p.hd;
    T* o = (T*)p.out + b * (p.heads * p.hd) + h * p.hd;
    dec_core<T, TK, HDP, W>(s_q, kb, vb, p.krs, p.vrs, 0, kv_end, p.mask, p.mask_dt, b * p.kv_len, p.hd, -1, nullptr, nullptr, o, nullptr);
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
//
// Split keys: a grid of depth S (gridDim.z) splits each (batch, head)'s
// valid keys into runs of at least `chunk` keys (`key_run`), one a block;
// the blocks past the last run return. With one run the block stores the
// row itself. With more, each stores its (max, sum, output) triple in
// `part` ((batch·heads + head)·S + split, HDP + 2 floats each), and the
// last of the head's blocks to finish (counted in `cnt[batch·heads +
// head]`, which it sets back to 0) merges the triples in split order: the
// result does not depend on which block finishes when. S ≤ APP_MAX_SPLITS.
struct AttnAppP {
    const void* q; const void* kn; const void* vn; void* kc; void* vc; const int* wpos; const int* rpos; const float* factors;
    const int* valid; const void* mask; void* out; int* err;
    i64 batch; i64 heads; i64 kv_heads; i64 hd; i64 kv_len; i64 mask_dt;
    i64 qbs; i64 knbs; i64 vnbs; i64 kbs; i64 krs; i64 vbs; i64 vrs;
    i64 wpos_pb; i64 rpos_pb; i64 valid_pb; i64 rope; double theta; double scale;
    float* part; int* cnt; i64 chunk;
};

template <typename T> __device__ __forceinline__ float round_to(float v) { T t; st(&t, 0, v); return ld(&t, 0); }

// This block's run of keys lo .. hi out of n valid ones, and how many of
// the gridDim.z splits have a run (split 0 always does, empty where n is 0).
struct KeyRun {
    i64 lo, hi, ns;
};
__device__ __forceinline__ KeyRun key_run(i64 n, i64 chunk) {
    const i64 splits = gridDim.z;
    i64 per = (n + splits - 1) / splits;
    per = (per > chunk ? per : chunk) + 31;
    per -= per % 32;
    KeyRun r;
    r.ns = n > 0 ? (n + per - 1) / per : 1;
    r.lo = (i64)blockIdx.z * per;
    r.hi = n < r.lo + per ? n : r.lo + per;
    return r;
}

// The valid count as the block sees it before the wait on the previous
// kernel (a guess, checked after the wait), clamped to 0 .. kv_len.
__device__ __forceinline__ i64 valid_guess(const AttnAppP& p, i64 b) {
    const i64 n = p.valid ? (i64)p.valid[p.valid_pb ? b : 0] : p.kv_len;
    return n < 0 ? 0 : (n < p.kv_len ? n : p.kv_len);
}

// After a split's triple is stored (dec_merge into `part`): the head's last
// block to finish merges its `ns` triples (at `pb`, in split order) and
// stores the row. The triples are read in one pass over their floats (one
// wait on L2, not one for the maxima and another for the sums).
constexpr int APP_MAX_SPLITS = 16;
template <typename T, int HDP>
__device__ __forceinline__ void dec_split_merge(const float* pb, int* cnt, i64 ns, i64 hd, T* o) {
    __shared__ int s_last;
    __shared__ float s_tr[APP_MAX_SPLITS * (HDP + 2)];
    const int t = threadIdx.x;
    __threadfence();
    __syncthreads();
    if (t == 0) s_last = atomicAdd(cnt, 1) == (int)ns - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int i = t; i < ns * (HDP + 2); i += blockDim.x) s_tr[i] = __ldcg(pb + i);
    __syncthreads();
    float mt = -INFINITY;
    for (int s = 0; s < ns; ++s) mt = fmaxf(mt, s_tr[s * (HDP + 2) + HDP]);
    float lt = 0.0f;
    for (int s = 0; s < ns; ++s) {
        const float m = s_tr[s * (HDP + 2) + HDP];
        lt += s_tr[s * (HDP + 2) + HDP + 1] * (m == -INFINITY ? 0.0f : expf(m - mt));
    }
    // A row that sees no key at all (fully masked) yields zeros.
    const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
    for (int d = t; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < ns; ++s) {
            const float m = s_tr[s * (HDP + 2) + HDP];
            acc += s_tr[s * (HDP + 2) + d] * (m == -INFINITY ? 0.0f : expf(m - mt));
        }
        st(o, d, acc * inv);
    }
    if (t == 0) *cnt = 0;
}

template <typename T, typename TK, int HDP, int W>
__device__ void attention_app_body(const AttnAppP& p) {
    static_assert(W * 32 >= HDP, "a thread per dim");
    using R = QuadRegs<TK, HDP>;
    __shared__ __align__(16) float s_q[HDP];
    __shared__ float s_k[HDP], s_v[HDP];
    const i64 b = blockIdx.y, h = blockIdx.x;
    const i64 group = p.heads / p.kv_heads, kvh = h / group;
    const int t = threadIdx.x, hd = (int)p.hd, half = hd / 2;
    TK* kc = (TK*)p.kc + b * p.kbs + kvh * hd;
    TK* vc = (TK*)p.vc + b * p.vbs + kvh * hd;
    const bool quad = dec_vec<TK, HDP>(kc, vc, p.krs, p.vrs, hd);
    // Before the wait: work on values the kernels before may still be
    // writing, checked after the wait and redone where they changed. In a
    // decode step the positions and the valid count come from the step
    // before or from its first kernels, so the guesses hold.
    // - The warp's first round of cache rows (keys of the block's run as
    //   the guessed valid count places it). Rows before the write position
    //   were written by earlier steps; the row this step adds is read from
    //   shared memory.
    R r;
    KeyRun guess = {-1, -1, 0};
    if constexpr (R::ONE && quad_dims<HDP>()) {
        guess = key_run(valid_guess(p, b), p.chunk);
        const i64 base = guess.lo + (i64)(t >> 5) * 32;
        if (quad && base < guess.hi) {
            r.load_k(kc, p.krs, base, guess.hi, 0);
            r.load_v(vc, p.vrs, base, guess.hi, 0);
        }
    }
    // - This thread's rotation (angles as the rope kernel's; its frequency
    //   factor is read again after the wait too).
    double invb = 0.0, invd = 0.0;
    i64 pos = 0;
    float fac = 1.0f, c = 1.0f, sn = 0.0f;
    const bool rot = p.rope && t < half;
    const int i0 = p.rope == 2 ? 2 * t : t, i1 = p.rope == 2 ? 2 * t + 1 : t + half;
    if (rot) {
        invb = pow(p.theta, -2.0 * (double)t / (double)hd);
        if (p.factors) fac = p.factors[t];
        invd = p.factors ? invb / (double)fac : invb;
        pos = (i64)p.rpos[p.rpos_pb ? b : 0];
        const float ang = (float)pos * (float)invd;
        c = cosf(ang);
        sn = sinf(ang);
    }
    pdl_enter();
    // Every read that depends on the kernels before, issued together
    // before any store: positions, the valid count, this thread's elements
    // of q and the new key (a rotated pair, or element t) and value.
    const T* qb = (const T*)p.q + b * p.qbs + h * hd;
    const T* knb = (const T*)p.kn + b * p.knbs + kvh * hd;
    const T* vnb = (const T*)p.vn + b * p.vnbs + kvh * hd;
    const i64 wpos = (i64)p.wpos[p.wpos_pb ? b : 0];
    const i64 pos_now = rot ? (i64)p.rpos[p.rpos_pb ? b : 0] : 0;
    const float fac_now = rot && p.factors ? p.factors[t] : 1.0f;
    const i64 n_valid = p.valid ? (i64)p.valid[p.valid_pb ? b : 0] : p.kv_len;
    float qa = 0.0f, qz = 0.0f, ka = 0.0f, kz = 0.0f, va = 0.0f;
    if (rot) {
        qa = ld(qb, i0);
        qz = ld(qb, i1);
        ka = ld(knb, i0);
        kz = ld(knb, i1);
    } else if (!p.rope && t < hd) {
        qa = ld(qb, t);
        ka = ld(knb, t);
    }
    if (t < hd) va = ld(vnb, t);
    const i64 kv_end = n_valid < 0 ? 0 : (n_valid < p.kv_len ? n_valid : p.kv_len);
    if ((n_valid < 0 || n_valid > p.kv_len) && h == 0 && (p.valid_pb || b == 0) && t == 0) atomicOr(p.err, ERR_VALID_LEN);
    const bool wok = wpos >= 0 && wpos < p.kv_len;
    if (!wok && h == 0 && (p.wpos_pb || b == 0) && t == 0) atomicOr(p.err, ERR_STATE_OVERFLOW);
    const KeyRun run = key_run(kv_end, p.chunk);
    if ((i64)blockIdx.z >= run.ns) return;  // uniform over the block
    const bool writer = wok && h % group == 0 && blockIdx.z == 0;
    const float scale = (float)p.scale;
    // q and the new key (turned by RoPE) and value, rounded as the separate
    // kernels' stores would (q and the key to T, key and value to the
    // cache's TK); the group's first head writes the key and value into the
    // caches at row `wpos`.
    if (rot) {
        if (pos_now != pos || !(fac_now == fac)) {
            invd = p.factors ? invb / (double)fac_now : invb;
            const float ang = (float)pos_now * (float)invd;
            c = cosf(ang);
            sn = sinf(ang);
        }
        s_q[i0] = round_to<T>(qa * c - qz * sn) * scale;
        s_q[i1] = round_to<T>(qz * c + qa * sn) * scale;
        const float k0 = round_to<TK>(round_to<T>(ka * c - kz * sn)), k1 = round_to<TK>(round_to<T>(kz * c + ka * sn));
        s_k[i0] = k0;
        s_k[i1] = k1;
        if (writer) {
            st(kc, wpos * p.krs + i0, k0);
            st(kc, wpos * p.krs + i1, k1);
        }
    } else if (!p.rope && t < hd) {
        s_q[t] = qa * scale;
        const float k = round_to<TK>(ka);
        s_k[t] = k;
        if (writer) st(kc, wpos * p.krs + t, k);
    }
    if (t < hd) {
        const float v = round_to<TK>(va);
        s_v[t] = v;
        if (writer) st(vc, wpos * p.vrs + t, v);
    } else if (t < HDP) {
        s_q[t] = 0.0f;
    }
    __syncthreads();
    T* o = (T*)p.out + b * (p.heads * hd) + h * hd;
    const i64 own = wok ? wpos : -1;
    float* part = run.ns > 1 ? p.part + ((b * p.heads + h) * gridDim.z + blockIdx.z) * (HDP + 2) : nullptr;
    if (R::ONE && quad_dims<HDP>() && quad) {
        const i64 pre = run.lo == guess.lo ? guess.hi : -1;
        dec_core_quad<T, TK, HDP, W>(r, pre, s_q, kc, vc, p.krs, p.vrs, run.lo, run.hi, p.mask, p.mask_dt, b * p.kv_len, own, s_k, s_v, o, part);
    } else {
        dec_core<T, TK, HDP, W>(s_q, kc, vc, p.krs, p.vrs, run.lo, run.hi, p.mask, p.mask_dt, b * p.kv_len, hd, own, s_k, s_v, o, part);
    }
    if (part) dec_split_merge<T, HDP>(p.part + (b * p.heads + h) * gridDim.z * (HDP + 2), p.cnt + b * p.heads + h, run.ns, hd, o);
}

// Before the wait on the previous kernel: an L2 prefetch of the cache rows
// of each warp's first round of keys (keys up to the cache's length; the
// valid count is not known yet). No kernel before the attention in a step
// writes them: the row an append adds is read from shared memory.
template <typename TK, int HDP, int W>
__device__ __forceinline__ void dec_prefetch(const void* k, const void* v, i64 bs_k, i64 bs_v, i64 krs, i64 vrs, i64 heads, i64 kv_heads,
                                             i64 hd, i64 kv_len, i64 k_lo) {
    const i64 b = blockIdx.y, kvh = blockIdx.x / (heads / kv_heads);
    const TK* kb = (const TK*)k + b * bs_k + kvh * hd;
    const TK* vb = (const TK*)v + b * bs_v + kvh * hd;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int lines = (int)((hd * (i64)sizeof(TK) + 127) / 128);
    const i64 key = k_lo + (i64)warp * 32 + lane;
    if (key >= kv_len) return;
    for (int t = 0; t < 2 * lines; ++t) {
        const char* row = (const char*)(t & 1 ? vb + key * vrs : kb + key * krs) + (t >> 1) * 128;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row));
    }
}
template <typename TK, int HDP, int W>
__device__ __forceinline__ void dec_prefetch(const AttnP& p) {
    dec_prefetch<TK, HDP, W>(p.k, p.v, p.kbs, p.vbs, p.krs, p.vrs, p.heads, p.kv_heads, p.hd, p.kv_len, 0);
}
// A split's run starts where the guessed valid count places it.
template <typename TK, int HDP, int W>
__device__ __forceinline__ void dec_prefetch(const AttnAppP& p) {
    const i64 lo = gridDim.z > 1 ? key_run(valid_guess(p, blockIdx.y), p.chunk).lo : 0;
    dec_prefetch<TK, HDP, W>(p.kc, p.vc, p.kbs, p.vbs, p.krs, p.vrs, p.heads, p.kv_heads, p.hd, p.kv_len, lo);
}

// attention_dec<W>_<HDP>_<dtype> and attention_app<W>_<HDP>_<dtype> (W warps), and
// _f32_kv<dtype> for f32 queries over f16/bf16 keys and values.
#define RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, SFX, T, TK) \
    extern "C" __global__ void __launch_bounds__(W * 32) NAME##W##_##HDP##_##SFX(const P p) { \
        dec_prefetch<TK, HDP, W>(p);                                                                     \
        BODY<T, TK, HDP, W>(p);                                                                          \
    }
#define RLX_DEC_TYPES(NAME, BODY, P, W, HDP)                                        \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, f32, float, float)                        \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, f16, __half, __half)                      \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, bf16, __nv_bfloat16, __nv_bfloat16)       \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, f32_kvf16, float, __half)                 \
    RLX_DEC_KERNEL(NAME, BODY, P, W, HDP, f32_kvbf16, float, __nv_bfloat16)
// attention_dec and attention_app at 16 and 4 warps (src/launch.rs
// `decode_warps`, `append_shape`).
#define RLX_DEC_ALL(W, HDP)                                                          \
    RLX_DEC_TYPES(attention_dec, attention_dec_body, AttnP, W, HDP)                  \
    RLX_DEC_TYPES(attention_app, attention_app_body, AttnAppP, W, HDP)
// Parts (IN_PART): one per head dim and width.
#if IN_PART(0)
RLX_DEC_ALL(16, 32)
#endif
#if IN_PART(1)
RLX_DEC_ALL(4, 32)
#endif
#if IN_PART(2)
RLX_DEC_ALL(16, 64)
#endif
#if IN_PART(3)
RLX_DEC_ALL(4, 64)
#endif
#if IN_PART(4)
RLX_DEC_ALL(16, 96)
#endif
#if IN_PART(5)
RLX_DEC_ALL(4, 96)
#endif
#if IN_PART(6)
RLX_DEC_ALL(16, 128)
#endif
#if IN_PART(7)
RLX_DEC_ALL(4, 128)
#endif
