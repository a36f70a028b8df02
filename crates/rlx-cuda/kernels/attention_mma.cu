// Fused attention on tensor cores (f16 / bf16, head_dim a multiple of 16):
// flash-attention style, with mma.sync m16n8k16 and f32 accumulation.
//
// A block of W warps (4 or 8) owns 16 W query rows of one (batch, head), 16
// per warp; all of them share each K/V tile the block loads.
// K and V stream through shared memory in tiles of 64 keys, both stored
// row-major ([key][dim]); when the head dim is a multiple of 8 and every
// pointer and stride allows it, a tile moves as 16-byte cp.async copies
// (4 + 4 per thread for head dim 64), double-buffered for head dims up to 64
// so the next tile's copy overlaps this tile's math; else element by element. K's
// fragments come out of ldmatrix, V's transposed through ldmatrix.trans. The
// key mask becomes one f32 cap per key in shared memory (+inf seen, -inf
// masked), read for up to 512 keys at once. Each warp computes its
// 16x64 score tile S = Q·Kᵀ in registers, applies scale and masks, updates
// the online softmax (exp2 in one MUFU instruction), and accumulates
// O += P·V with P rounded to the storage type. The softmax side is what
// bounds this kernel at BERT's 128 tokens (ncu: issue-bound at 25 %
// occupancy), hence the few instructions per score. HDP is the head dim
// rounded up to 32/64/96/128; the padding is zero.
//
// Fragment layouts (PTX ISA, mma.m16n8k16): lane = 4*g + t.
//   A (16x16): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C (16x8):  c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
#include "attention.cuh"

#define TK 64

// O += P·V for one warp's 16 rows over NK keys: the probabilities s are
// already the A fragments of P (rounded to T); V's B fragments (k = keys
// 2t.., n = dim g) are ldmatrix.trans of row-major V (pitch KP): matrices
// (keys +0..7, dims 8n..), (keys +8..15, 8n..), then the same for dims
// 8(n+1).. .
template <typename T, int NK, int HDP, int KP>
__device__ __forceinline__ void attn_pv(const float (&s)[NK / 8][4], float (&o)[HDP / 8][4], const unsigned short* v, int lane) {
    const int mi = lane >> 3, mr = lane & 7;
#pragma unroll
    for (int ks = 0; ks < NK / 16; ++ks) {
        unsigned pa[4];
        pa[0] = Mma<T>::pack(s[2 * ks][0], s[2 * ks][1]);
        pa[1] = Mma<T>::pack(s[2 * ks][2], s[2 * ks][3]);
        pa[2] = Mma<T>::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
        pa[3] = Mma<T>::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
        const unsigned short* vrow = v + (ks * 16 + (mi & 1) * 8 + mr) * KP + (mi >> 1) * 8;
#pragma unroll
        for (int n = 0; n < HDP / 8; n += 2) {
            unsigned vf[4];
            ldsm_x4_trans(vf, vrow + n * 8);
            Mma<T>::run(o[n], pa, vf[0], vf[1]);
            Mma<T>::run(o[n + 1], pa, vf[2], vf[3]);
        }
    }
}

// One warp's online-softmax step over a tile of NK keys for its 16 rows,
// then O += P·V (the key-splitting kernel; the others use softmax_pv_lazy
// below). s: the tile's scaled, masked scores (log2 domain), becoming the
// probabilities; mx: this lane's row maxima over the tile; m, l: running
// maxima and sums; v: the tile's V rows in shared memory (pitch KP).
template <typename T, int NK, int HDP, int KP>
__device__ __forceinline__ void softmax_pv(float (&s)[NK / 8][4], float (&mx)[2], float (&m)[2], float (&l)[2], float (&o)[HDP / 8][4],
                                           const unsigned short* v, int lane) {
    float corr[2], mu[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
        mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 2));
        float mn = fmaxf(m[half], mx[half]);
        mu[half] = mn == -INFINITY ? 0.0f : mn;  // all masked so far: keep zeros, no NaN
        corr[half] = exp2f(m[half] - mu[half]);
        m[half] = mn;
    }
    float rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NK / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float pv = exp2f(s[n][e] - mu[e >> 1]);
            s[n][e] = pv;
            rs[e >> 1] += pv;
        }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        rs[half] += __shfl_xor_sync(0xffffffffu, rs[half], 1);
        rs[half] += __shfl_xor_sync(0xffffffffu, rs[half], 2);
        l[half] = l[half] * corr[half] + rs[half];
    }
#pragma unroll
    for (int n = 0; n < HDP / 8; ++n) {
        o[n][0] *= corr[0]; o[n][1] *= corr[0];
        o[n][2] *= corr[1]; o[n][3] *= corr[1];
    }
    attn_pv<T, NK, HDP, KP>(s, o, v, lane);
}

// Key flags of up to FLAGS_ALL keys are read at once into shared memory:
// the whole key range for sequences up to 512 keys (one memory round trip
// at the start instead of one per tile); longer ranges reload the next 512
// before the tile that needs them.
#define FLAGS_ALL 512

// What every tensor-core attention kernel reads for one (batch, head): its
// Q, K and V rows (query head h reads kv head h / (heads / kv_heads)), the
// valid key count and the end of the keys in the cache, and whether every
// row allows 16-byte copies (whole 8-element chunks, all aligned). A
// valid_len outside 0..=kv_len is the caller's error (the CPU backend
// refuses it): the `first` thread raises the flag, and every block clamps
// so no memory outside the cache is read.
struct AttnView {
    const unsigned short* qb; const unsigned short* kb; const unsigned short* vb;
    i64 valid; i64 kv_end; bool vec;
};

// QB: bytes of a query element (2, or 4 for f32 queries over a 16-bit cache).
template <int QB = 2>
__device__ __forceinline__ AttnView attn_view(const AttnP& p, i64 b, i64 h, bool first) {
    typedef unsigned short u16;
    AttnView a;
    a.valid = p.valid ? (i64)p.valid[p.valid_pb ? b : 0] : p.kv_len;
    // One length per row: any block may hold a bad one (the flag is idempotent).
    if ((a.valid < 0 || a.valid > p.kv_len) && (first || p.valid_pb)) atomicOr(p.err, ERR_VALID_LEN);
    a.kv_end = a.valid < p.kv_len ? a.valid : p.kv_len;
    if (a.kv_end < 0) a.kv_end = 0;
    // 32-bit division (once per thread; the 64-bit one is a long sequence).
    const i64 kvh = (int)h / ((int)p.heads / (int)p.kv_heads);
    a.qb = (const u16*)((const char*)p.q + (b * p.qbs + h * p.hd) * QB);
    a.kb = (const u16*)p.k + b * p.kbs + kvh * p.hd;
    a.vb = (const u16*)p.v + b * p.vbs + kvh * p.hd;
    a.vec = p.hd % 8 == 0 && ((p.qrs | p.krs | p.vrs) & 7) == 0 &&
            (((unsigned long long)a.qb | (unsigned long long)a.kb | (unsigned long long)a.vb) & 15) == 0;
    return a;
}

// Keys that any of query rows r0 .. r0 + rows - 1 may see: the valid
// keys, cut by the causal rule at the last of those rows.
__device__ __forceinline__ i64 attn_key_end(const AttnP& p, const AttnView& a, i64 r0, i64 rows) {
    const i64 last_row = r0 + rows - 1 < p.q_len - 1 ? r0 + rows - 1 : p.q_len - 1;
    i64 end = a.kv_end;
    if (p.causal) {
        const i64 lim = a.valid - p.q_len + last_row + 1;
        if (lim < end) end = lim;
    }
    return end;
}

// Row copies into shared memory (row pitch KP) as 16-byte cp.async: thread
// tid of NT copies chunk tid % CH of rows tid / CH, tid / CH + NT / CH, ...,
// so each copy costs one pointer step (a general index loop with a division
// and 64-bit products per copy was a quarter of the short-range kernel's
// instructions, issued before its first load landed).
// Rows at or past `valid` and chunks past `hd` are zero-filled; their source
// reads as `base`, which is never dereferenced (copy size 0). Head dim 96
// (NT not a multiple of CH) keeps the index loop.
template <int HDP, int KP, int NT>
__device__ __forceinline__ void attn_copy_rows(unsigned short* dst, const unsigned short* src, i64 stride, int nrows, i64 valid, int hd,
                                               const unsigned short* base, int tid) {
    constexpr int CH = HDP / 8;
    if constexpr (NT % CH == 0) {
        constexpr int RS = NT / CH;
        const int c = tid % CH;
        const bool cin = c * 8 < hd;
        int j = tid / CH;
        const unsigned short* s = src + j * stride + c * 8;
        unsigned short* d = dst + j * KP + c * 8;
        const i64 step = RS * stride;
#pragma unroll 4
        for (; j < nrows; j += RS, s += step, d += RS * KP) {
            const bool in = cin && j < valid;
            cp_async16(d, in ? s : base, in);
        }
    } else {
#pragma unroll 4
        for (int e = tid; e < nrows * CH; e += NT) {
            const int j = e / CH, c = e % CH;
            const bool in = j < valid && c * 8 < hd;
            cp_async16(dst + j * KP + c * 8, in ? src + j * stride + c * 8 : base, in);
        }
    }
}

// Zeros the rows j < nrows of V (pitch KP) for which masked(j) holds, the
// chunks split over NT threads as in attn_copy_rows.
template <int HDP, int KP, int NT, typename F>
__device__ __forceinline__ void attn_zero_rows(unsigned short* v, int nrows, int tid, F masked) {
    constexpr int CH = HDP / 8;
    if constexpr (NT % CH == 0) {
        const int c = tid % CH;
        for (int j = tid / CH; j < nrows; j += NT / CH) {
            if (masked(j)) *(uint4*)(v + j * KP + c * 8) = make_uint4(0u, 0u, 0u, 0u);
        }
    } else {
        for (int e = tid; e < nrows * CH; e += NT) {
            const int j = e / CH, c = e % CH;
            if (masked(j)) *(uint4*)(v + j * KP + c * 8) = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// The A fragments of rows wr and wr + 8 from qpair(row, d): dims d and
// d + 1 of a row, packed.
template <int HDP, typename F>
__device__ __forceinline__ void attn_q_frags(unsigned (&qa)[HDP / 16][4], i64 wr, int t, F qpair) {
#pragma unroll
    for (int ks = 0; ks < HDP / 16; ++ks) {
        qa[ks][0] = qpair(wr, ks * 16 + 2 * t);
        qa[ks][1] = qpair(wr + 8, ks * 16 + 2 * t);
        qa[ks][2] = qpair(wr, ks * 16 + 2 * t + 8);
        qa[ks][3] = qpair(wr + 8, ks * 16 + 2 * t + 8);
    }
}

// The A fragments of one warp's 16 query rows (wr and wr + 8 for the two
// halves of each fragment); zeros past q_len and the head dim.
template <int HDP>
__device__ __forceinline__ void attn_load_q(unsigned (&qa)[HDP / 16][4], const AttnP& p, const AttnView& a, i64 wr, int t) {
    const int hd = (int)p.hd;
    auto qpair = [&](i64 row, int d) -> unsigned {
        if (row >= p.q_len || d >= hd) return 0u;
        if (a.vec) return *(const unsigned*)(a.qb + row * p.qrs + d);  // d even, d + 1 < hd
        unsigned lo = a.qb[row * p.qrs + d];
        unsigned hi = d + 1 < hd ? a.qb[row * p.qrs + d + 1] : 0u;
        return lo | (hi << 16);
    };
    if (a.vec && hd == HDP && wr + 8 < p.q_len) {
        // Whole rows, 4-byte aligned pairs: plain loads without checks.
        const unsigned* lo = (const unsigned*)(a.qb + wr * p.qrs);
        const unsigned* hi = (const unsigned*)(a.qb + (wr + 8) * p.qrs);
#pragma unroll
        for (int ks = 0; ks < HDP / 16; ++ks) {
            qa[ks][0] = lo[ks * 8 + t];
            qa[ks][1] = hi[ks * 8 + t];
            qa[ks][2] = lo[ks * 8 + t + 4];
            qa[ks][3] = hi[ks * 8 + t + 4];
        }
        return;
    }
    attn_q_frags<HDP>(qa, wr, t, qpair);
}

// f32 queries (a decoder's activations over its f16 or bf16 KV cache): the
// same fragments, each pair rounded to T as it loads (the keys and values
// are already T; scores still accumulate in f32). qb: the row base as f32.
template <typename T, int HDP>
__device__ __forceinline__ void attn_load_q_f32(unsigned (&qa)[HDP / 16][4], const AttnP& p, const float* qb, i64 wr, int t) {
    const int hd = (int)p.hd;
    const bool pairs = hd % 2 == 0 && (p.qrs & 1) == 0 && ((unsigned long long)qb & 7) == 0;
    auto qpair = [&](i64 row, int d) -> unsigned {
        if (row >= p.q_len || d >= hd) return 0u;
        const float* r = qb + row * p.qrs + d;
        if (pairs) {
            const float2 x = *(const float2*)r;  // d even, d + 1 < hd
            return Mma<T>::pack(x.x, x.y);
        }
        return Mma<T>::pack(r[0], d + 1 < hd ? r[1] : 0.0f);
    };
    attn_q_frags<HDP>(qa, wr, t, qpair);
}

// Q's fragments for queries of type TQ (T, or f32) over keys of type T.
template <typename TQ> struct QIsF32 { static constexpr bool v = false; };
template <> struct QIsF32<float> { static constexpr bool v = true; };
template <typename TQ, typename T, int HDP>
__device__ __forceinline__ void attn_load_q_any(unsigned (&qa)[HDP / 16][4], const AttnP& p, const AttnView& a, i64 wr, int t) {
    if constexpr (QIsF32<TQ>::v) attn_load_q_f32<T, HDP>(qa, p, (const float*)a.qb, wr, t);
    else attn_load_q<HDP>(qa, p, a, wr, t);
}

// Two adjacent outputs (d, d + 1 < hd) of a row of type TQ as one store
// when `pairs` says the row allows it (same rounding as st).
template <typename TQ, typename T>
__device__ __forceinline__ void attn_store_pair(TQ* orow, int d, int hd, bool pairs, float x0, float x1) {
    if (pairs) {
        if constexpr (QIsF32<TQ>::v) *(float2*)(orow + d) = make_float2(x0, x1);
        else *(unsigned*)(orow + d) = Mma<T>::pack(x0, x1);
    } else {
        st(orow, d, x0);
        if (d + 1 < hd) st(orow, d + 1, x1);
    }
}
// Whether a row of TQ at orow takes pair stores (hd even, aligned to a pair).
template <typename TQ>
__device__ __forceinline__ bool attn_pairs(const TQ* orow, int hd) {
    return hd % 2 == 0 && ((unsigned long long)orow & (2 * sizeof(TQ) - 1)) == 0;
}

// A probability is at most 2^LAZY_SLACK before its row is rescaled: far
// inside f16's and bf16's range, and the same relative precision as 1.
#define LAZY_SLACK 8.0f

// Mask one warp's NK-key chunk of scores (raw in the short-range kernel,
// scaled in the streaming one): cap (+inf seen,
// -inf masked, a NaN of a masked key reads as masked), the causal rule when
// CAUSAL (key j of the chunk is in the future of row wr + 8 half when j > c
// + 8 half), and this lane's maxima of its row halves (not across the quad).
template <int NK, bool CAUSAL>
__device__ __forceinline__ void attn_cap_scores(float (&s)[NK / 8][4], float (&mx)[2], const float* cap, i64 c, int t) {
#pragma unroll
    for (int n = 0; n < NK / 8; ++n) {
        const float2 cp = *(const float2*)(cap + n * 8 + 2 * t);
        s[n][0] = fminf(s[n][0], cp.x);
        s[n][1] = fminf(s[n][1], cp.y);
        s[n][2] = fminf(s[n][2], cp.x);
        s[n][3] = fminf(s[n][3], cp.y);
    }
    if (CAUSAL) {
        const int lim = (int)(c < -9 ? -9 : c > NK ? NK : c) - 2 * t;
#pragma unroll
        for (int n = 0; n < NK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (n * 8 + (e & 1) > lim + 8 * (e >> 1)) s[n][e] = -INFINITY;
            }
        }
    }
    mx[0] = mx[1] = -INFINITY;
#pragma unroll
    for (int n = 0; n < NK / 8; ++n) {
        mx[0] = fmaxf(mx[0], fmaxf(s[n][0], s[n][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[n][2], s[n][3]));
    }
}

// One warp's lazy online-softmax step over NK keys, then O += P·V. s: the
// masked scores (attn_cap_scores), becoming the probabilities; mx: this
// lane's maxima of s; scale > 0 turns s into log2 units (1 where s is
// already scaled). m: the rows' running maxima (-inf until a key is seen),
// base: what the probabilities are taken against (m, or 0 while m is
// -inf), l: this lane's share of the row sums (attn_quad_sums adds them).
// The whole warp rescales when any of its lanes sees a score above its
// row's m + LAZY_SLACK; m and base are the same on the 4 lanes of a row.
template <typename T, int NK, int HDP, int KP>
__device__ __forceinline__ void softmax_pv_lazy(float (&s)[NK / 8][4], const float (&mx)[2], float scale, float (&m)[2], float (&base)[2],
                                                float (&l)[2], float (&o)[HDP / 8][4], const unsigned short* v, int lane) {
    const float ms[2] = {mx[0] * scale, mx[1] * scale};
    if (__any_sync(0xffffffffu, ms[0] > m[0] + LAZY_SLACK || ms[1] > m[1] + LAZY_SLACK)) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float q = fmaxf(ms[half], __shfl_xor_sync(0xffffffffu, ms[half], 1));
            q = fmaxf(q, __shfl_xor_sync(0xffffffffu, q, 2));
            const float mn = fmaxf(m[half], q);
            const float nb = mn == -INFINITY ? 0.0f : mn;  // still all masked: keep zeros, no NaN
            // Nothing is accumulated while m is -inf (every probability was 0).
            const float corr = m[half] == -INFINITY ? 0.0f : ex2(base[half] - nb);
            m[half] = mn;
            base[half] = nb;
            l[half] *= corr;
#pragma unroll
            for (int n = 0; n < HDP / 8; ++n) {
                o[n][2 * half] *= corr;
                o[n][2 * half + 1] *= corr;
            }
        }
    }
    const float nb[2] = {-base[0], -base[1]};
#pragma unroll
    for (int n = 0; n < NK / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float pv = ex2(fmaf(s[n][e], scale, nb[e >> 1]));
            s[n][e] = pv;
            l[e >> 1] += pv;
        }
    }
    attn_pv<T, NK, HDP, KP>(s, o, v, lane);
}

// O / l of one warp's rows into out [b, row, h * hd + d]; a row that sees
// no key at all (fully masked) yields zeros. Pairs go as one 4-byte store
// when the row allows it (same rounding as st).
// The row sums of softmax_pv_lazy's lanes: each row's 4 lanes add theirs.
__device__ __forceinline__ void attn_quad_sums(float (&l)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
        l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    }
}

template <typename T, int HDP, typename TQ = T>
__device__ __forceinline__ void attn_store_rows(const float (&o)[HDP / 8][4], const float (&l)[2], const AttnP& p, i64 b, i64 h, i64 wr,
                                                int t) {
    const int hd = (int)p.hd;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const i64 row = wr + 8 * half;
        if (row >= p.q_len) continue;
        const float inv = l[half] > 0.0f ? 1.0f / l[half] : 0.0f;
        TQ* orow = (TQ*)p.out + (b * p.q_len + row) * (p.heads * p.hd) + h * p.hd;
        const bool pairs = attn_pairs(orow, hd);
#pragma unroll
        for (int n = 0; n < HDP / 8; ++n) {
            const int d = n * 8 + 2 * t;
            if (d < hd) attn_store_pair<TQ, T>(orow, d, hd, pairs, o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
        }
    }
}

// TQ: the queries' and output's type (T, or f32 over a T cache: the
// queries round to T as they load, the output stays f32).
template <typename T, int HDP, int W, typename TQ = T>
__device__ void attention_mma_body(const AttnP& p) {
    constexpr int NT = 32 * W;  // threads of the block
    constexpr int R = 16 * W;   // query rows of the block, 16 per warp
    // Pitch padded by 16 bytes: ldmatrix row reads of K and V (8 rows of 16
    // bytes) hit 32 distinct banks.
    constexpr int KP = HDP + 8;
    constexpr int CH = HDP / 8;  // 16-byte chunks per padded row
    // Two tile buffers (the next tile loads while this one is used) where
    // they fit in 48 KB of static shared memory, else one.
    constexpr int STAGES = HDP <= 64 ? 2 : 1;
    static_assert(FLAGS_ALL % NT == 0 && FLAGS_ALL % TK == 0, "flag chunk");
    __shared__ __align__(16) unsigned short sk[STAGES * TK * KP];
    __shared__ __align__(16) unsigned short sv[STAGES * TK * KP];
    // Per key: +inf where it may be seen, -inf where masked; a score is
    // min(score, cap): one instruction, and a NaN score of a masked key
    // (garbage past the valid length) still reads as masked.
    __shared__ __align__(16) float scap[FLAGS_ALL];
    typedef unsigned short u16;
    const i64 b = blockIdx.z, h = blockIdx.y, r0 = (i64)blockIdx.x * R;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int hd = (int)p.hd;
    // Scores live in the log2 domain (scale * log2(e) folded in), so each
    // exponential is one exp2: softmax is unchanged by the base.
    const float scale = (float)p.scale * 1.4426950408889634f;

    const AttnView av = attn_view<(int)sizeof(TQ)>(p, b, h, blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0);
    const u16* kb = av.kb;
    const u16* vb = av.vb;
    const bool vec = av.vec;
    const i64 valid = av.valid;
    const i64 tile_end = attn_key_end(p, av, r0, R);
    const int ntiles = tile_end > 0 ? (int)((tile_end + TK - 1) / TK) : 0;

    // Tile loads: 16-byte cp.async copies (zero-filled past the keys or the
    // head dim) on the aligned path, plain loads and stores otherwise.
    auto load_tile = [&](int buf, i64 t0) {
        u16* dk = sk + buf * TK * KP;
        u16* dv = sv + buf * TK * KP;
        if (vec) {
            // Consecutive threads take consecutive chunks of one row:
            // coalesced global reads, conflict-free shared stores. (Unrolled
            // 4 deep: 8 copies of head dim 128 at once cost registers. The
            // loop has a fixed trip count here; attn_copy_rows measured
            // slower in this kernel at 8x512.)
#pragma unroll 4
            for (int it = 0; it < TK * CH / NT; ++it) {
                int e = threadIdx.x + it * NT;
                int j = e / CH, c = e % CH;
                i64 key = t0 + j;
                bool in = key < p.kv_len && c * 8 < hd;
                cp_async16(dk + j * KP + c * 8, in ? kb + key * p.krs + c * 8 : kb, in);
                cp_async16(dv + j * KP + c * 8, in ? vb + key * p.vrs + c * 8 : vb, in);
            }
        } else {
#pragma unroll 4
            for (int it = 0; it < TK * HDP / NT; ++it) {
                int e = threadIdx.x + it * NT;
                int j = e / HDP, d = e % HDP;
                i64 key = t0 + j;
                bool in = key < p.kv_len && d < hd;
                dk[j * KP + d] = in ? kb[key * p.krs + d] : (u16)0;
                dv[j * KP + d] = in ? vb[key * p.vrs + d] : (u16)0;
            }
        }
        cp_async_commit();
    };
    // Flags of keys k0 .. k0 + FLAGS_ALL - 1: every load is issued before
    // the first store, so they share one round trip. Keys at or past
    // tile_end are never used unmasked (past kv_end, or causal for every
    // row of this block): they read as masked without a load.
    auto load_flags = [&](i64 k0) {
        constexpr int PER = FLAGS_ALL / NT;
        double f[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const i64 key = k0 + threadIdx.x + i * NT;
            f[i] = key >= tile_end ? 0.0 : p.mask ? ld_any(p.mask, b * p.kv_len + key, p.mask_dt) : 1.0;
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) scap[threadIdx.x + i * NT] = f[i] != 0.0 ? INFINITY : -INFINITY;
    };

    // Both tile buffers are in flight before the Q fragments load, and the
    // Q loads before the flags' (whose stores wait for their data).
    if (ntiles > 0) load_tile(0, 0);
    if (STAGES == 2 && ntiles > 1) load_tile(1, TK);

    // This warp's rows: wr and wr + 8 for the two halves of each fragment.
    const i64 wr = r0 + warp * 16 + g;
    unsigned qa[HDP / 16][4];
    attn_load_q_any<TQ, T, HDP>(qa, p, av, wr, t);
    if (ntiles > 0) load_flags(0);

    float o[HDP / 8][4];
#pragma unroll
    for (int n = 0; n < HDP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, base[2] = {0.0f, 0.0f}, l[2] = {0.0f, 0.0f};
    // Causal: keys past fut are in the future of row wr.
    const i64 fut = valid - p.q_len + wr;

    for (int ti = 0; ti < ntiles; ++ti) {
        const i64 t0 = (i64)ti * TK;
        const int buf = STAGES == 2 ? (ti & 1) : 0;
        // Every warp finished reading the previous flag chunk before the
        // previous iteration's closing barrier.
        if (ti > 0 && t0 % FLAGS_ALL == 0) load_flags(t0);
        // Tiles ti and (when it exists) ti + 1 are in flight: wait for ti.
        if (STAGES == 2 && ti + 1 < ntiles) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();
        const u16* ck = sk + buf * TK * KP;
        const u16* cv = sv + buf * TK * KP;
        const float* cap = scap + (int)(t0 % FLAGS_ALL);
        const int mi = lane >> 3, mr = lane & 7;
        // A masked key's V row becomes zeros (a padded row may hold NaN or
        // inf, and its weight 0 would still pass it on as 0 * NaN), as the
        // CPU backend does. One barrier per tile; the pass only runs when
        // the tile has a masked key.
        {
            bool any = false;
            for (int j = threadIdx.x; j < TK; j += NT) any |= cap[j] == -INFINITY;
            if (__syncthreads_or(any)) {
                u16* zv = sv + buf * TK * KP;
                for (int e = threadIdx.x; e < TK * CH; e += NT) {
                    const int j = e / CH, c = e % CH;
                    if (cap[j] == -INFINITY) *(uint4*)(zv + j * KP + c * 8) = make_uint4(0u, 0u, 0u, 0u);
                }
                __syncthreads();
            }
        }

        // S = Q·Kᵀ; K's B fragments for two key blocks per ldmatrix.x4:
        // matrices (keys 8n.., dims +0..7), (8n.., +8..15), then keys 8(n+1).. .
        float s[TK / 8][4];
#pragma unroll
        for (int n = 0; n < TK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < HDP / 16; ++ks) {
#pragma unroll
            for (int n = 0; n < TK / 8; n += 2) {
                unsigned kf[4];
                ldsm_x4(kf, ck + ((n + (mi >> 1)) * 8 + mr) * KP + ks * 16 + (mi & 1) * 8);
                Mma<T>::run(s[n], qa[ks], kf[0], kf[1]);
                Mma<T>::run(s[n + 1], qa[ks], kf[2], kf[3]);
            }
        }

        // Scale (any sign: the maxima are taken after it), mask, then the
        // lazy online-softmax update (softmax_pv_lazy, scale already applied).
#pragma unroll
        for (int n = 0; n < TK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] *= scale;
        }
        float mx[2];
        if (p.causal) attn_cap_scores<TK, true>(s, mx, cap, fut - t0, t);
        else attn_cap_scores<TK, false>(s, mx, cap, fut - t0, t);
        softmax_pv_lazy<T, TK, HDP, KP>(s, mx, 1.0f, m, base, l, o, cv, lane);
        __syncthreads();  // every warp is done with this buffer (and these flags)
        // The freed buffer takes the tile STAGES ahead.
        if (ti + STAGES < ntiles) load_tile(buf, t0 + STAGES * TK);
    }
    attn_quad_sums(l);
    attn_store_rows<T, HDP, TQ>(o, l, p, b, h, wr, t);
}

// Short key ranges (at most SHORT_KEYS keys: BERT's 128 tokens at batch 32).
// The block's W warps own 16 W query rows of one (batch, head); the whole K
// and V load once into shared memory (two cp.async groups, one round trip),
// and each warp then sweeps them in chunks of 32 keys (16 at head dim 64)
// with no block barrier between chunks. Small chunks keep few score
// registers, so the kernel fits in 80 registers without spills and 3 blocks
// of 8 warps share an SM (attention_mma_w8: 128 registers, 2 blocks): at 12
// heads x 32 sequences the 384 blocks are one wave.
//
// An eager online softmax is issue-bound here: a third of the instructions
// per 16-key chunk rescale O and reduce maxima and sums across the quad
// every chunk. So the softmax is lazy (softmax_pv_lazy): the base a row's probabilities are taken against moves
// only when a score passes it by more than LAZY_SLACK (log2 units), so after
// the first chunk a warp normally neither shuffles nor rescales; sums stay
// per lane until the end; the scale is folded into the exponent's FMA; the
// causal rule is compiled only into the causal variant.
// Same masks, causal rule, valid_len, GQA mapping and masked-V zeroing as
// attention_mma_body. The host picks it only for a positive scale.
#define SHORT_KEYS 128
template <typename T, int HDP, int W, bool CAUSAL>
__device__ void attention_short_body(const AttnP& p) {
    constexpr int NT = 32 * W;
    constexpr int R = 16 * W;
    constexpr int KP = HDP + 8;
    constexpr int CH = HDP / 8;
    // Keys per chunk: 16 at head dim 64 (32 spills under the 80-register cap).
    constexpr int TC = HDP <= 32 ? 32 : 16;
    __shared__ __align__(16) unsigned short sk[SHORT_KEYS * KP];
    __shared__ __align__(16) unsigned short sv[SHORT_KEYS * KP];
    __shared__ __align__(16) float scap[SHORT_KEYS];
    // Q rows, then the output rows (dynamic: R * KP elements, `short_q_smem`
    // in src/launch.rs).
    extern __shared__ __align__(16) unsigned short sq[];
    typedef unsigned short u16;
    const i64 b = blockIdx.z, h = blockIdx.y, r0 = (i64)blockIdx.x * R;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int hd = (int)p.hd;
    const float scale = (float)p.scale * 1.4426950408889634f;  // log2 domain, as above

    AttnView av = attn_view(p, b, h, blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0);
    // The host picks this kernel only for kv_len <= SHORT_KEYS; a bad call
    // reads no key past the buffers (all masked).
    if (av.kv_end > SHORT_KEYS) av.kv_end = 0;
    const u16* kb = av.kb;
    const u16* vb = av.vb;
    const bool vec = av.vec;
    const i64 key_end = CAUSAL ? attn_key_end(p, av, r0, R) : av.kv_end;
    const int nchunks = key_end > 0 ? (int)((key_end + TC - 1) / TC) : 0;
    const int nrows = nchunks * TC;  // K/V rows loaded (zero past kv_len)

    // All of K, then all of V (two copy groups, waited for together: a
    // per-group pipeline measured slower);
    // every load is issued before the wait. Keys at or past key_end read as
    // masked without a load.
    if (vec) {
        attn_copy_rows<HDP, KP, NT>(sk, kb, p.krs, nrows, p.kv_len, hd, kb, threadIdx.x);
        cp_async_commit();
        attn_copy_rows<HDP, KP, NT>(sv, vb, p.vrs, nrows, p.kv_len, hd, vb, threadIdx.x);
        cp_async_commit();
        // The block's Q rows (zeros past q_len), for ldmatrix: whole 16-byte
        // copies, where loading fragments from global memory read each
        // sector twice.
        attn_copy_rows<HDP, KP, NT>(sq, av.qb + r0 * p.qrs, p.qrs, R, p.q_len - r0, hd, av.qb, threadIdx.x);
        cp_async_commit();
    } else {
        for (int e = threadIdx.x; e < nrows * HDP; e += NT) {
            const int j = e / HDP, d = e % HDP;
            const bool in = j < p.kv_len && d < hd;
            sk[j * KP + d] = in ? kb[j * p.krs + d] : (u16)0;
            sv[j * KP + d] = in ? vb[j * p.vrs + d] : (u16)0;
        }
    }
    const i64 wr = r0 + warp * 16 + g;
    unsigned qa[HDP / 16][4];
    if (!vec) attn_load_q<HDP>(qa, p, av, wr, t);
    for (int j = threadIdx.x; j < SHORT_KEYS; j += NT) {
        const double f = j >= key_end ? 0.0 : p.mask ? ld_any(p.mask, b * p.kv_len + j, p.mask_dt) : 1.0;
        scap[j] = f != 0.0 ? INFINITY : -INFINITY;
    }
    cp_async_wait<0>();
    __syncthreads();
    // This warp's 16 Q rows as A fragments (matrices: rows +0..7 / +8..15 by
    // columns +0..7 / +8..15 of each 16-column step).
    u16* wq = sq + warp * 16 * KP;
    if (vec) {
#pragma unroll
        for (int ks = 0; ks < HDP / 16; ++ks) ldsm_x4(qa[ks], wq + (lane & 15) * KP + ks * 16 + (lane >> 4) * 8);
    }
    // A masked key's V row becomes zeros (a padded row may hold NaN or inf).
    {
        bool any = false;
        for (int j = threadIdx.x; j < nrows; j += NT) any |= scap[j] == -INFINITY;
        if (__syncthreads_or(any)) {
            attn_zero_rows<HDP, KP, NT>(sv, nrows, threadIdx.x, [&](int j) { return scap[j] == -INFINITY; });
            __syncthreads();
        }
    }

    float o[HDP / 8][4];
#pragma unroll
    for (int n = 0; n < HDP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, base[2] = {0.0f, 0.0f}, l[2] = {0.0f, 0.0f};
    // 32-bit: valid and q_len are at most kv_len <= SHORT_KEYS here.
    const int fut = CAUSAL ? (int)(av.valid - p.q_len + wr) : 0;
    const int mi = lane >> 3, mr = lane & 7;
    // Causal: chunks past what the warp's last row sees hold only future
    // keys for all 16 rows (warp-uniform, as mma.sync needs).
    int wchunks = nchunks;
    if (CAUSAL) {
        const i64 seen = av.valid - p.q_len + r0 + warp * 16 + 16;
        const i64 c = seen <= 0 ? 0 : (seen + TC - 1) / TC;
        if (c < wchunks) wchunks = (int)c;
    }
    for (int ci = 0; ci < wchunks; ++ci) {
        const int t0 = ci * TC;
        float s[TC / 8][4];
#pragma unroll
        for (int n = 0; n < TC / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < HDP / 16; ++ks) {
#pragma unroll
            for (int n = 0; n < TC / 8; n += 2) {
                unsigned kf[4];
                ldsm_x4(kf, sk + (t0 + (n + (mi >> 1)) * 8 + mr) * KP + ks * 16 + (mi & 1) * 8);
                Mma<T>::run(s[n], qa[ks], kf[0], kf[1]);
                Mma<T>::run(s[n + 1], qa[ks], kf[2], kf[3]);
            }
        }
        float mx[2];
        attn_cap_scores<TC, CAUSAL>(s, mx, scap + t0, fut - t0, t);
        softmax_pv_lazy<T, TC, HDP, KP>(s, mx, scale, m, base, l, o, sv + t0 * KP, lane);
    }
    attn_quad_sums(l);
    // Whole rows of 16-byte stores through the warp's Q rows (no longer
    // read) where the output allows it, else pairs per lane.
    T* ob = (T*)p.out + b * p.q_len * (p.heads * p.hd) + h * p.hd;
    if (vec && hd == HDP && (((unsigned long long)ob | (unsigned long long)(p.heads * p.hd * 2)) & 15) == 0) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float inv = l[half] > 0.0f ? 1.0f / l[half] : 0.0f;
#pragma unroll
            for (int n = 0; n < HDP / 8; ++n) {
                *(unsigned*)(wq + (g + 8 * half) * KP + n * 8 + 2 * t) = Mma<T>::pack(o[n][2 * half] * inv, o[n][2 * half + 1] * inv);
            }
        }
        __syncwarp();
        const i64 ors = p.heads * p.hd;
        if constexpr (32 % CH == 0) {
            // Lane: chunk lane % CH of rows lane / CH, + 32 / CH, ...
            const int c = lane % CH;
            const i64 rw = r0 + warp * 16;
            for (int r = lane / CH; r < 16; r += 32 / CH) {
                if (rw + r < p.q_len) *(uint4*)(ob + (rw + r) * ors + c * 8) = *(const uint4*)(wq + r * KP + c * 8);
            }
        } else {
            for (int e = lane; e < 16 * CH; e += 32) {
                const int r = e / CH, c = e % CH;
                const i64 row = r0 + warp * 16 + r;
                if (row < p.q_len) *(uint4*)(ob + row * ors + c * 8) = *(const uint4*)(wq + r * KP + c * 8);
            }
        }
    } else {
        attn_store_rows<T, HDP>(o, l, p, b, h, wr, t);
    }
}
template <typename T, int HDP, int W>
__device__ void attention_short_plain(const AttnP& p) { attention_short_body<T, HDP, W, false>(p); }
template <typename T, int HDP, int W>
__device__ void attention_short_causal(const AttnP& p) { attention_short_body<T, HDP, W, true>(p); }

// Keys per warp tile of the key-splitting kernel: 4 warps' K+V fit in 48 KB.
template <int HDP> struct AttnSplit {
    static constexpr int TKS = HDP <= 64 ? 32 : 16;
    static constexpr int KP = HDP + 8;
    static constexpr int OP = HDP + 4;  // f32 pitch of the merge buffer
    static constexpr int KV_BYTES = 4 * 2 * TKS * KP * 2;
    static constexpr int MERGE_BYTES = 4 * 16 * OP * 4;
    // Shared memory the body needs in `smem` (16-byte aligned).
    static constexpr int BYTES = KV_BYTES > MERGE_BYTES ? KV_BYTES : MERGE_BYTES;
};

// Short sequences (the 64-row grid would leave SMs idle, e.g. batch 1 x 128
// tokens x 12 heads = 24 blocks on 132 SMs): a block of 4 warps owns only 16
// query rows of one (batch, head) and its warps split the keys instead.
// Warp w takes key tiles w, w+4, w+8, ... of TKS keys into its own shared
// buffers (cp.async on the aligned path) and keeps its own online softmax
// over them; at the end the four partial (max, sum, output) triples are
// merged through shared memory, which the K/V buffers no longer need.
// Same masks, causal rule, valid_len and GQA mapping as attention_mma_body.
//
// attention_split_item: one 16-row query block `rblk` of (batch b, head h), by the block's first
// 4 warps. `first`: the one thread that reports a bad valid_len. Every
// thread of the 4 warps returns from here; `smem` may be reused once they
// have.
template <typename T, int HDP, typename TQ = T>
__device__ void attention_split_item(const AttnP& p, i64 b, i64 h, i64 rblk, unsigned char* smem, bool first) {
    constexpr int TKS = AttnSplit<HDP>::TKS;
    constexpr int KP = AttnSplit<HDP>::KP;
    constexpr int OP = AttnSplit<HDP>::OP;
    __shared__ float sm_m[4][16], sm_l[4][16];
    __shared__ unsigned char sok[4][TKS];
    typedef unsigned short u16;
    const i64 r0 = rblk * 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int hd = (int)p.hd;
    const float scale = (float)p.scale * 1.4426950408889634f;  // log2 domain, as above

    const AttnView av = attn_view<(int)sizeof(TQ)>(p, b, h, first);
    const u16* kb = av.kb;
    const u16* vb = av.vb;
    const bool vec = av.vec;
    const i64 valid = av.valid, kv_end = av.kv_end;
    const i64 tile_end = attn_key_end(p, av, r0, 16);
    const int ntiles = tile_end > 0 ? (int)((tile_end + TKS - 1) / TKS) : 0;

    u16* sk = (u16*)smem + warp * 2 * TKS * KP;
    u16* sv = sk + TKS * KP;
    // This warp's first tile is in flight before the Q fragments load.
    auto load_tile = [&](i64 t0) {
        if (vec) {
            attn_copy_rows<HDP, KP, 32>(sk, kb + t0 * p.krs, p.krs, TKS, p.kv_len - t0, hd, kb, lane);
            attn_copy_rows<HDP, KP, 32>(sv, vb + t0 * p.vrs, p.vrs, TKS, p.kv_len - t0, hd, vb, lane);
        } else {
#pragma unroll 4
            for (int it = 0; it < TKS * HDP / 32; ++it) {
                int e = lane + it * 32;
                int j = e / HDP, d = e % HDP;
                i64 key = t0 + j;
                bool in = key < p.kv_len && d < hd;
                sk[j * KP + d] = in ? kb[key * p.krs + d] : (u16)0;
                sv[j * KP + d] = in ? vb[key * p.vrs + d] : (u16)0;
            }
        }
        cp_async_commit();
        if (lane < TKS) {
            const i64 key = t0 + lane;
            bool ok = key < kv_end;
            if (ok && p.mask) ok = ld_any(p.mask, b * p.kv_len + key, p.mask_dt) != 0.0;
            sok[warp][lane] = ok;
        }
    };
    if (warp < ntiles) load_tile((i64)warp * TKS);

    const i64 wr = r0 + g;
    unsigned qa[HDP / 16][4];
    attn_load_q_any<TQ, T, HDP>(qa, p, av, wr, t);

    float o[HDP / 8][4];
#pragma unroll
    for (int n = 0; n < HDP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int ti = warp; ti < ntiles; ti += 4) {
        const i64 t0 = (i64)ti * TKS;
        cp_async_wait<0>();
        __syncwarp();
        // Masked keys' V rows become zeros (see attention_mma_body).
        if (__any_sync(0xffffffffu, lane < TKS && !sok[warp][lane])) {
            attn_zero_rows<HDP, KP, 32>(sv, TKS, lane, [&](int j) { return !sok[warp][j]; });
            __syncwarp();
        }
        float s[TKS / 8][4];
#pragma unroll
        for (int n = 0; n < TKS / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < HDP / 16; ++ks) {
#pragma unroll
            for (int n = 0; n < TKS / 8; ++n) {
                const u16* kr = sk + (n * 8 + g) * KP + ks * 16 + 2 * t;
                Mma<T>::run(s[n], qa[ks], *(const unsigned*)kr, *(const unsigned*)(kr + 8));
            }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < TKS / 8; ++n) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int j = n * 8 + 2 * t + c;
                const bool ok = sok[warp][j] != 0;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    bool okr = ok && !(p.causal && t0 + j > valid - p.q_len + wr + 8 * half);
                    float x = okr ? s[n][2 * half + c] * scale : -INFINITY;
                    s[n][2 * half + c] = x;
                    mx[half] = fmaxf(mx[half], x);
                }
            }
        }
        softmax_pv<T, TKS, HDP, KP>(s, mx, m, l, o, sv, lane);
        __syncwarp();  // every lane is done with this warp's buffers
        if (ti + 4 < ntiles) load_tile(t0 + 4 * TKS);
    }

    // Merge: the K/V buffers become [warp][row][dim] partial outputs.
    __syncthreads();
    float* so = (float*)smem;
#pragma unroll
    for (int n = 0; n < HDP / 8; ++n) {
        float* r_lo = so + (warp * 16 + g) * OP + n * 8 + 2 * t;
        float* r_hi = r_lo + 8 * OP;
        r_lo[0] = o[n][0]; r_lo[1] = o[n][1];
        r_hi[0] = o[n][2]; r_hi[1] = o[n][3];
    }
    if (t == 0) {
        sm_m[warp][g] = m[0]; sm_m[warp][g + 8] = m[1];
        sm_l[warp][g] = l[0]; sm_l[warp][g + 8] = l[1];
    }
    __syncthreads();
    // Thread -> row threadIdx.x / 8 and dim pairs (threadIdx.x % 8) * 2 + 16 i.
    const int r = threadIdx.x >> 3, part = threadIdx.x & 7;
    const i64 row = r0 + r;
    // No early return: the barrier below is aligned (every thread of a warp
    // must reach the same one), and rows past q_len split warps.
    if (row < p.q_len) {
        float mm = -INFINITY;
#pragma unroll
        for (int w = 0; w < 4; ++w) mm = fmaxf(mm, sm_m[w][r]);
        float f[4], lsum = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            f[w] = mm == -INFINITY ? 0.0f : exp2f(sm_m[w][r] - mm);
            lsum += f[w] * sm_l[w][r];
        }
        // A row that sees no key at all (fully masked) yields zeros.
        const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
        TQ* orow = (TQ*)p.out + (b * p.q_len + row) * (p.heads * p.hd) + h * p.hd;
        const bool pairs = attn_pairs(orow, hd);
#pragma unroll
        for (int d = part * 2; d < HDP; d += 16) {
            if (d >= hd) break;
            float x0 = 0.0f, x1 = 0.0f;
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const float* src = so + (w * 16 + r) * OP + d;
                x0 += f[w] * src[0];
                x1 += f[w] * src[1];
            }
            attn_store_pair<TQ, T>(orow, d, hd, pairs, x0 * inv, x1 * inv);
        }
    }
    __syncthreads();  // the caller may reuse smem once every thread is past the merge reads
}

template <typename T, int HDP, typename TQ = T>
__device__ void attention_split_body(const AttnP& p) {
    __shared__ __align__(16) unsigned char smem[AttnSplit<HDP>::BYTES];
    const bool first = blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0;
    attention_split_item<T, HDP, TQ>(p, blockIdx.z, blockIdx.y, blockIdx.x, smem, first);
}

// attention_mma_<HDP>_<dtype> (4 warps, 64 query rows per block) and
// attention_mma_w8_<HDP>_<dtype> (8 warps, 128 rows: one K/V pass serves a
// whole 128-token head). Head dims 32 and 64 are capped at 128 registers
// (ptxas -v: no spill at 64, 16 bytes at 32) so 4 blocks of 4 warps (2 of 8)
// share an SM instead of 3; 96 and 128 keep the compiler's own allocation
// (a cap there spills, or costs blocks).
#define RLX_ATTN_BLOCKS(BODY, HDP, W, NAME, BOUNDS)                                                                 \
    extern "C" __global__ void BOUNDS NAME##_##HDP##_f16(const AttnP p) {                                          \
        pdl_enter();                                                                                                \
        BODY<__half, HDP, W>(p);                                                                                    \
    }                                                                                                               \
    extern "C" __global__ void BOUNDS NAME##_##HDP##_bf16(const AttnP p) {                                         \
        pdl_enter();                                                                                                \
        BODY<__nv_bfloat16, HDP, W>(p);                                                                             \
    }
// NAME_<HDP>_f32_kvf16 / _f32_kvbf16: f32 queries and output over an f16 or
// bf16 cache (a decoder's prompt over its KV cache).
#define RLX_ATTN_MMA(HDP, W, NAME, BOUNDS)                                                                          \
    RLX_ATTN_BLOCKS(attention_mma_body, HDP, W, NAME, BOUNDS)                                                       \
    extern "C" __global__ void BOUNDS NAME##_##HDP##_f32_kvf16(const AttnP p) {                                    \
        pdl_enter();                                                                                                \
        attention_mma_body<__half, HDP, W, float>(p);                                                              \
    }                                                                                                               \
    extern "C" __global__ void BOUNDS NAME##_##HDP##_f32_kvbf16(const AttnP p) {                                   \
        pdl_enter();                                                                                                \
        attention_mma_body<__nv_bfloat16, HDP, W, float>(p);                                                       \
    }
#define RLX_FOUR_PER_SM __launch_bounds__(128, 4)
#define RLX_TWO_PER_SM __launch_bounds__(256, 2)
#define RLX_NO_BOUNDS
// Parts (IN_PART), here and below: one per head dim (32, 64, 96, 128).
#if IN_PART(0)
RLX_ATTN_MMA(32, 4, attention_mma, RLX_FOUR_PER_SM)
RLX_ATTN_MMA(32, 8, attention_mma_w8, RLX_TWO_PER_SM)
#endif
#if IN_PART(1)
RLX_ATTN_MMA(64, 4, attention_mma, RLX_FOUR_PER_SM)
RLX_ATTN_MMA(64, 8, attention_mma_w8, RLX_TWO_PER_SM)
#endif
#if IN_PART(2)
RLX_ATTN_MMA(96, 4, attention_mma, RLX_NO_BOUNDS)
RLX_ATTN_MMA(96, 8, attention_mma_w8, RLX_NO_BOUNDS)
#endif
#if IN_PART(3)
RLX_ATTN_MMA(128, 4, attention_mma, RLX_NO_BOUNDS)
RLX_ATTN_MMA(128, 8, attention_mma_w8, RLX_NO_BOUNDS)
#endif

// attention_short_<HDP>_<dtype> (4 warps, 64 rows) and attention_short_w8_<HDP>_<dtype>
// (8 warps, 128 rows), for at most SHORT_KEYS keys: capped at 80 registers
// so 3 blocks of 8 warps (6 of 4) share an SM.
// attention_short_causal[_w8]_<HDP>_<dtype>: the same with the causal rule.
#define RLX_ATTN_SHORT(HDP, W, NAME, BOUNDS)                                  \
    RLX_ATTN_BLOCKS(attention_short_plain, HDP, W, NAME, BOUNDS)              \
    RLX_ATTN_BLOCKS(attention_short_causal, HDP, W, NAME##_causal, BOUNDS)
#if IN_PART(0)
RLX_ATTN_SHORT(32, 4, attention_short, __launch_bounds__(128, 6))
RLX_ATTN_SHORT(32, 8, attention_short_w8, __launch_bounds__(256, 3))
#endif
#if IN_PART(1)
RLX_ATTN_SHORT(64, 4, attention_short, __launch_bounds__(128, 6))
RLX_ATTN_SHORT(64, 8, attention_short_w8, __launch_bounds__(256, 3))
#endif

// attention_split_<HDP>_<dtype>, and _f32_kvf16 / _f32_kvbf16 as above
#define RLX_ATTN_SPLIT(HDP)                                                                                               \
    extern "C" __global__ void attention_split_##HDP##_f16(const AttnP p) { pdl_enter(); attention_split_body<__half, HDP>(p); }      \
    extern "C" __global__ void attention_split_##HDP##_bf16(const AttnP p) { pdl_enter(); attention_split_body<__nv_bfloat16, HDP>(p); } \
    extern "C" __global__ void attention_split_##HDP##_f32_kvf16(const AttnP p) {                                                 \
        pdl_enter();                                                                                                              \
        attention_split_body<__half, HDP, float>(p);                                                                              \
    }                                                                                                                             \
    extern "C" __global__ void attention_split_##HDP##_f32_kvbf16(const AttnP p) {                                                \
        pdl_enter();                                                                                                              \
        attention_split_body<__nv_bfloat16, HDP, float>(p);                                                                       \
    }
#if IN_PART(0)
RLX_ATTN_SPLIT(32)
#endif
#if IN_PART(1)
RLX_ATTN_SPLIT(64)
#endif
#if IN_PART(2)
RLX_ATTN_SPLIT(96)
#endif
#if IN_PART(3)
RLX_ATTN_SPLIT(128)
#endif
