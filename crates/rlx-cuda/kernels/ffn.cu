// A transformer's feed-forward block for at most 128 rows and the norm
// after it in one kernel (sm_90: thread-block clusters):
//
//   out = norm(erf-GELU(X·W1ᵀ + b1)·W2ᵀ + b2 + residuals)
//
// X is [M, H] (row pitch lda), W1 [I, H] and W2 [H, I] as a Linear layer
// stores them. At batch 1 a library runs FFN1, the GELU, FFN2 and the norm
// as separate launches whose weight fetches each wait for the kernel
// before; here the weights of the whole block load while the previous
// kernel drains, and the [M, I] intermediate never leaves the chip.
#include "common.cuh"

// `rows` rows of COLS elements (a multiple of 8) from src (row stride ld
// elements) into shared dst (pitch DP) by 16-byte cp.async, NT threads;
// rows from `valid` on are written as zeros (nothing is read for them).
template <int COLS, int DP, int NT>
__device__ __forceinline__ void ffn_copy_rows(unsigned short* dst, const unsigned short* src, i64 ld, int rows, int valid) {
    for (int e = threadIdx.x; e < rows * (COLS / 8); e += NT) {
        const int r = e / (COLS / 8), c = e % (COLS / 8) * 8;
        const bool in = r < valid;
        cp_async16(dst + r * DP + c, in ? src + (i64)r * ld + c : src, in);
    }
}

// One warp's tile of A·Bᵀ from shared memory (mma.sync m16n8k16): the
// [MF][NF] accumulator fragments, zeroed here, over KS steps of 16 along K;
// A's rows from r0 (pitch AP elements), B's rows (the output columns) from
// c0 (pitch BP), K contiguous in both. `run` false leaves the zeros.
template <typename T, int MF, int NF, int KS, int AP, int BP>
__device__ __forceinline__ void ffn_warp_tile(float (&acc)[MF][NF][4], const unsigned short* a, int r0, const unsigned short* b, int c0,
                                              bool run) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) acc[mf][nf][0] = acc[mf][nf][1] = acc[mf][nf][2] = acc[mf][nf][3] = 0.0f;
    if (!run) return;
    const int lane = threadIdx.x & 31, mi = lane >> 3, mr = lane & 7;
    const unsigned short* ca = a + (r0 + (mi & 1) * 8 + mr) * AP + (mi >> 1) * 8;
    const unsigned short* cb = b + (c0 + (mi >> 1) * 8 + mr) * BP + (mi & 1) * 8;
    mma_warp_steps<T, MF, NF, KS, AP, BP, true>(acc, ca, cb);
}

template <typename T>
__device__ __forceinline__ float4 ffn_ld4(const void* p, i64 i) {
    const T* q = (const T*)p + i;
    return make_float4(ld(q, 0), ld(q, 1), ld(q, 2), ld(q, 3));
}

// Row split (ffn_rows_<H>_<I>_<dtype>): for feed-forward blocks whose
// weights are small enough to be read once per group of rows. The grid is
// G clusters of 16 blocks (non-portable cluster size); cluster g owns rows
// [g·R, g·R + R) (R <= 32) and runs the whole block and the norm after it
// for them; block r of it owns intermediate columns [r·IS, (r+1)·IS), IS =
// I/16, and output columns [r·H/16, (r+1)·H/16) of the norm:
//   1. H_r = erf-GELU(X·W1[r]ᵀ + b1[r]) over the full K = H (no split),
//      rounded to the storage type;
//   2. the f32 partial Y_r = H_r·W2[:, r]ᵀ of all H output columns;
//   3. after a cluster barrier, block r sums its H/16 columns of the 16
//      partials in rank order (DSMEM), adds b2 and the residual(s), and the
//      row statistics of the norm (mean, then squared deviations) are summed
//      across the 16 blocks in rank order the same way; the block stores its
//      columns of the normalised rows.
// W1 and W2 slices are copied before griddepcontrol.wait, X after. No
// workspace and no separate norm kernel; deterministic (fixed orders).
// Shared memory: X [32][H+8] and W1 slice [IS][H+8] (the f32 partial
// [32][H+8] reuses them after step 1), W2 slice [H][IS+8], H_r [32][IS+8],
// b1 slice [IS], the row statistics [2][32] f32, per-thread sums [32][8],
// and the second K half of step 1 [4][16][IS/2+4] f32.
// Copies: W1 and b1 before griddepcontrol.wait, then X, then W2, which
// lands while step 1 runs.
// Step 1 splits K in two halves over 8 warps. The norm's statistics take
// one exchange: each block's (mean, M2) over its columns, combined in rank
// order (M2 = Σ M2_z + OC·Σ (mean_z − mean)²).
struct FfnRowsP {
    const void* x; const void* w1; const void* b1; const void* w2; const void* b2;
    const void* res1; const void* res2; const void* gamma; const void* beta; void* out;
    i64 m; i64 lda; i64 rows; i64 rms; double eps;
    // The tail kernel's output projection and first norm (null / 0 otherwise):
    // X = norm1(round(XA·WOᵀ + bo + res0a) + res0), written to out1 (= x).
    const void* xa; const void* wo; const void* bo; const void* res0a; const void* res0;
    const void* g1; const void* be1; void* out1; i64 lda_a; i64 rms1; double eps1;
};

template <int H, int IS>
struct FfnRowsSmem {
    static constexpr int XP = H + 8, HP = IS + 8, RT = 32;
    static constexpr int U = (RT + IS) * XP * 2;
    static constexpr int W2 = H * HP * 2;
    static constexpr int HS = RT * HP * 2;
    // Phase 1's second K half: 4 warps' f32 [16][IS/2 + 4] partials.
    static constexpr int KH = 4 * 16 * (IS / 2 + 4) * 4;
    static constexpr int TOTAL = U + W2 + HS + IS * 2 + 2 * RT * 4 + RT * 8 * 4 + KH;
    // The tail kernel adds the output projection's weight slice [32][H+8]
    // (its H/16 rows, zeros past them).
    static constexpr int WO = 32 * XP * 2;
};

// The norm statistics of a row split: every block's (mean, M2) of each row
// over its OC columns in stat[row] / stat[RT + row] (after a cluster
// barrier) -> the row's mean and 1/sqrt(var + eps) in part[row·8 + 6] and
// part[row·8 + 7], by threads 0..nrows-1, summed in rank order.
template <int RT, int OC, int H>
__device__ __forceinline__ void rows_combine_stats(float* stat, float* part, int nrows, float eps) {
    const int tid = threadIdx.x;
    if (tid >= nrows) return;
    const unsigned a = (unsigned)__cvta_generic_to_shared(stat + tid);
    float mz[16], m2 = 0.0f, mean = 0.0f;
#pragma unroll
    for (int z = 0; z < 16; ++z) {
        const unsigned at = cluster_map(a, (unsigned)z);
        mz[z] = ld_cluster_f32(at);
        m2 += ld_cluster_f32(at + RT * 4);
    }
#pragma unroll
    for (int z = 0; z < 16; ++z) mean += mz[z];
    mean *= 1.0f / 16;
#pragma unroll
    for (int z = 0; z < 16; ++z) m2 += (float)OC * (mz[z] - mean) * (mz[z] - mean);
    part[tid * 8 + 6] = mean;  // slots 6, 7: a row's units use 0..5
    part[tid * 8 + 7] = rsqrtf(m2 * (1.0f / H) + eps);
}

// f32 rounded to the storage type and back.
template <typename T> __device__ __forceinline__ float round_t(float v);
template <> __device__ __forceinline__ float round_t<__half>(float v) { return __half2float(__float2half_rn(v)); }
template <> __device__ __forceinline__ float round_t<__nv_bfloat16>(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

template <typename T, int H, int I, bool TAIL>
__device__ __forceinline__ void ffn_rows_body(const FfnRowsP& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    typedef unsigned short u16;
    constexpr int IS = I / 16, OC = H / 16;  // intermediate and output columns per block
    typedef FfnRowsSmem<H, IS> L;
    constexpr int RT = L::RT, XP = L::XP, HP = L::HP, NT = 256;
    constexpr int NF1 = IS / 2 / 8;  // phase 1: 2 x 2 x 2 warps of 16 rows x IS/2 columns x H/2 of K
    constexpr int NF2 = H / 4 / 8;   // phase 2: 2 x 4 warps of 16 rows x H/4 columns
    constexpr int U4 = OC / 4;       // float4 units per row of a block's output columns
    static_assert(H % 128 == 0 && IS % 32 == 0 && NF1 % 2 == 0 && NF2 % 2 == 0 && OC % 4 == 0 && RT * U4 <= NT && U4 <= 6,
                  "row-split shapes");
    static_assert(L::TOTAL + (TAIL ? L::WO : 0) <= 227 * 1024, "shared memory of one block");
    static_assert(!TAIL || (OC % 8 == 0 && OC <= 32 && H % 64 == 0 && 2 * RT * OC + 3 * OC <= RT * HP && RT * OC <= 4 * 16 * (IS / 2 + 4) &&
                            4 * RT * 36 * 4 <= L::W2),
                  "tail shapes");
    extern __shared__ __align__(16) unsigned char ffn_smem[];
    u16* const xs = (u16*)ffn_smem;
    u16* const w1s = xs + RT * XP;
    float* const yp = (float*)ffn_smem;  // after phase 1, over xs and w1s
    u16* const w2s = (u16*)(ffn_smem + L::U);
    u16* const hs = (u16*)(ffn_smem + L::U + L::W2);
    u16* const b1s = (u16*)(ffn_smem + L::U + L::W2 + L::HS);
    float* const stat = (float*)(ffn_smem + L::U + L::W2 + L::HS + IS * 2);  // [2][RT]
    float* const part = stat + 2 * RT;                                        // [RT][8]
    float* const khalf = part + RT * 8;                                       // [4][16][IS/2+4]
    u16* const wos = (u16*)(ffn_smem + L::TOTAL);                             // TAIL: [32][XP]

    const int r = (int)cluster_rank();
    const int row0 = (int)(blockIdx.x / 16) * (int)p.rows;
    const int nrows = min((int)p.rows, (int)p.m - row0);
    if (nrows <= 0) return;  // the whole cluster: no barrier is waited for
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const i64 i0 = (i64)r * IS;
    const u16* const W1 = (const u16*)p.w1;
    const u16* const W2 = (const u16*)p.w2;
    const u16* const X = (const u16*)p.x;

    // TAIL: the residuals of norm1 [2][RT][OC] and bo, g1, be1 [3][OC]
    // (this block's columns) in hs, which step 1 fills only later.
    u16* const t_res = hs;
    u16* const t_vec = hs + 2 * RT * OC;
    ffn_copy_rows<H, XP, NT>(w1s, W1 + i0 * H, H, IS, IS);
    if (TAIL) ffn_copy_rows<H, XP, NT>(wos, (const u16*)p.wo + (i64)r * OC * H, H, 32, OC);
    if (tid < IS / 8) cp_async16(b1s + tid * 8, p.b1 ? (const u16*)p.b1 + i0 + tid * 8 : W1, p.b1 != nullptr);
    if (TAIL && tid < 3 * (OC / 8)) {
        const int v = tid / (OC / 8), c = tid % (OC / 8) * 8;
        const u16* src = (const u16*)(v == 0 ? p.bo : v == 1 ? p.g1 : p.be1);
        cp_async16(t_vec + v * OC + c, src ? src + r * OC + c : W1, src != nullptr);
    }
    cp_async_commit();
    pdl_enter();
    if (TAIL) {
        ffn_copy_rows<H, XP, NT>(xs, (const u16*)p.xa + (i64)row0 * p.lda_a, p.lda_a, RT, nrows);
        for (int e = tid; e < 2 * RT * (OC / 8); e += NT) {
            const int which = e / (RT * (OC / 8)), row = e / (OC / 8) % RT, c = e % (OC / 8) * 8;
            const u16* src = (const u16*)(which == 0 ? p.res0a : p.res0);
            const bool in = src != nullptr && row < nrows;
            cp_async16(t_res + (which * RT + row) * OC + c, in ? src + (i64)(row0 + row) * H + r * OC + c : W1, in);
        }
    } else {
        ffn_copy_rows<H, XP, NT>(xs, X + (i64)row0 * p.lda, p.lda, RT, nrows);
    }
    cp_async_commit();
    if (!TAIL) ffn_copy_rows<IS, HP, NT>(w2s, W2 + i0, I, H, H);
    cp_async_commit();
    cp_async_wait<1>();  // W1, b1 and X (W2 may still be on its way)
    __syncthreads();

    if (TAIL) {
        // 0. The output projection: warp (wm, kq) multiplies 16 rows by this
        // block's OC columns (padded to 32) over K quarter kq; the quarters
        // are summed in order through the W2 slice's space (not yet loaded).
        constexpr int OP = 36;
        float* const op = (float*)w2s;  // [4][RT][OP]
        {
            const int wm = warp & 1, kq = warp >> 1;
            float acc[1][4][4];
            ffn_warp_tile<T, 1, 4, H / 64, XP, XP>(acc, xs + kq * (H / 4), wm * 16, wos + kq * (H / 4), 0, wm * 16 < nrows);
#pragma unroll
            for (int nf = 0; nf < 4; ++nf)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *(float2*)(op + (kq * RT + wm * 16 + g + h * 8) * OP + nf * 8 + 2 * t) =
                        make_float2(acc[0][nf][2 * h], acc[0][nf][2 * h + 1]);
        }
        __syncthreads();
        // + bo + res0a, rounded to the storage type (the unfused matmul's
        // output), + res0: norm1's input, kept in khalf [RT][OC].
        float* const pre = khalf;
        const T* const tv = (const T*)t_vec;
        const T* const tr = (const T*)t_res;
        for (int e = tid; e < nrows * OC; e += NT) {
            const int row = e / OC, c = e % OC;
            float s = op[row * OP + c];
#pragma unroll
            for (int q = 1; q < 4; ++q) s += op[(q * RT + row) * OP + c];
            s += ld(tv, c) + ld(tr, row * OC + c);
            pre[row * OC + c] = round_t<T>(s) + ld(tr, (RT + row) * OC + c);
        }
        __syncthreads();  // the partials are read: W2 may land over them
        ffn_copy_rows<IS, HP, NT>(w2s, W2 + i0, I, H, H);
        cp_async_commit();
        if (tid < nrows) {
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < OC; ++c) sum += pre[tid * OC + c];
            const float lm = p.rms1 ? 0.0f : sum * (1.0f / OC);
            float d2 = 0.0f;
#pragma unroll
            for (int c = 0; c < OC; ++c) d2 += (pre[tid * OC + c] - lm) * (pre[tid * OC + c] - lm);
            stat[tid] = lm;
            stat[RT + tid] = d2;
        }
        cluster_sync();  // every block's norm1 statistics are visible; every block is done with XA in xs
        rows_combine_stats<RT, OC, H>(stat, part, nrows, (float)p.eps1);
        __syncthreads();
        // Norm1's output: stored (it is the thunk's output) and written into
        // every block's xs, where step 1 reads whole rows of it.
        const unsigned xs_addr = (unsigned)__cvta_generic_to_shared(xs);
        for (int e = tid; e < nrows * (OC / 2); e += NT) {
            const int row = e / (OC / 2), c = e % (OC / 2) * 2, col = r * OC + c;
            const float mean = part[row * 8 + 6], rstd = part[row * 8 + 7];
            float o[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                o[j] = (pre[row * OC + c + j] - mean) * rstd * ld(tv, OC + c + j);
                if (p.be1) o[j] += ld(tv, 2 * OC + c + j);
            }
            const unsigned w = pack2<T>(o[0], o[1]);
            *(unsigned*)((T*)p.out1 + (i64)(row0 + row) * H + col) = w;
            const unsigned off = xs_addr + (unsigned)((row * XP + col) * 2);
#pragma unroll
            for (int z = 0; z < 16; ++z) st_cluster_u32(cluster_map(off, (unsigned)z), w);
        }
        cluster_sync();  // every block holds norm1's rows; its statistics are read
    }

    // 1. H_r: warp (wm, wn, kh) multiplies 16 rows by IS/2 columns over K
    // half kh; the kh = 1 warps hand their partial to the kh = 0 warps.
    {
        constexpr int KP = IS / 2 + 4;
        const int wm = warp & 1, wn = (warp >> 1) & 1, kh = warp >> 2;
        float* const kp = khalf + (warp & 3) * 16 * KP;
        float acc[1][NF1][4];
        const bool run = wm * 16 < nrows;
        ffn_warp_tile<T, 1, NF1, H / 32, XP, XP>(acc, xs + kh * (H / 2), wm * 16, w1s + kh * (H / 2), wn * (IS / 2), run);
        if (kh == 1) {
#pragma unroll
            for (int nf = 0; nf < NF1; ++nf)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *(float2*)(kp + (g + h * 8) * KP + nf * 8 + 2 * t) = make_float2(acc[0][nf][2 * h], acc[0][nf][2 * h + 1]);
        }
        __syncthreads();
        if (kh == 0 && wm * 16 < nrows) {
            const T* bs = (const T*)b1s;
#pragma unroll
            for (int nf = 0; nf < NF1; ++nf)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = wm * 16 + g + h * 8, col = wn * (IS / 2) + nf * 8 + 2 * t;
                    const float2 o = *(const float2*)(kp + (g + h * 8) * KP + nf * 8 + 2 * t);
                    const float a = act_t<T>(ACT_GELU, acc[0][nf][2 * h] + o.x + ld(bs, col));
                    const float b = act_t<T>(ACT_GELU, acc[0][nf][2 * h + 1] + o.y + ld(bs, col + 1));
                    *(unsigned*)(hs + row * HP + col) = pack2<T>(a, b);
                }
        }
    }
    cp_async_wait<0>();  // W2
    __syncthreads();     // H_r complete; xs and w1s free

    // 2. The f32 partial of all H output columns: 8 warps, 16 rows by H/4.
    {
        const int wm = warp & 1, wn = warp >> 1;
        float acc[1][NF2][4];
        ffn_warp_tile<T, 1, NF2, IS / 16, HP, HP>(acc, hs, wm * 16, w2s, wn * (H / 4), wm * 16 < nrows);
#pragma unroll
        for (int nf = 0; nf < NF2; ++nf)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = wm * 16 + g + h * 8, col = wn * (H / 4) + nf * 8 + 2 * t;
                *(float2*)(yp + row * XP + col) = make_float2(acc[0][nf][2 * h], acc[0][nf][2 * h + 1]);
            }
    }
    cluster_sync();  // every block's partial is complete

    // 3. This block's OC columns of the rows: the 16 partials in rank order,
    // b2, residuals; then the norm's statistics across the cluster.
    const bool mine = tid < nrows * U4;
    const int row = tid / U4, c4 = tid % U4, col = r * OC + 4 * c4;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (mine) {
        const unsigned off = (unsigned)__cvta_generic_to_shared(yp + row * XP + col);
        float4 q[16];
#pragma unroll
        for (int z = 0; z < 16; ++z) q[z] = ld_cluster_f4(cluster_map(off, (unsigned)z));
#pragma unroll
        for (int z = 0; z < 16; ++z) {
            v[0] += q[z].x;
            v[1] += q[z].y;
            v[2] += q[z].z;
            v[3] += q[z].w;
        }
        const i64 at = (i64)(row0 + row) * H + col;
        const void* adds[3] = {p.b2, p.res1, p.res2};
#pragma unroll
        for (int a = 0; a < 3; ++a) {
            if (!adds[a]) continue;
            const float4 w = ffn_ld4<T>(adds[a], a == 0 ? col : at);
            v[0] += w.x;
            v[1] += w.y;
            v[2] += w.z;
            v[3] += w.w;
        }
        part[row * 8 + c4] = v[0] + v[1] + v[2] + v[3];
    }
    // The block's (mean, M2) of each row over its OC columns (mean 0 for
    // RmsNorm), then one exchange across the cluster.
    __syncthreads();
    if (tid < nrows) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < U4; ++k) s += part[tid * 8 + k];
        stat[tid] = p.rms ? 0.0f : s * (1.0f / OC);
    }
    __syncthreads();
    const float lm = mine ? stat[row] : 0.0f;
    if (mine) part[row * 8 + c4] = (v[0] - lm) * (v[0] - lm) + (v[1] - lm) * (v[1] - lm) + (v[2] - lm) * (v[2] - lm) + (v[3] - lm) * (v[3] - lm);
    __syncthreads();
    if (tid < nrows) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < U4; ++k) s += part[tid * 8 + k];
        stat[RT + tid] = s;
    }
    cluster_sync();  // every block's statistics are visible to the cluster
    rows_combine_stats<RT, OC, H>(stat, part, nrows, (float)p.eps);
    // This block reads no other block's shared memory after this point.
    cluster_arrive_relaxed();
    __syncthreads();
    if (mine) {
        const float mean = part[row * 8 + 6], rstd = part[row * 8 + 7];
        const float4 gm = ffn_ld4<T>(p.gamma, col);
        const float4 bt = p.beta ? ffn_ld4<T>(p.beta, col) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float o0 = (v[0] - mean) * rstd * gm.x + bt.x, o1 = (v[1] - mean) * rstd * gm.y + bt.y;
        const float o2 = (v[2] - mean) * rstd * gm.z + bt.z, o3 = (v[3] - mean) * rstd * gm.w + bt.w;
        *(uint2*)((T*)p.out + (i64)(row0 + row) * H + col) = make_uint2(pack2<T>(o0, o1), pack2<T>(o2, o3));
    }
    // No block leaves while others may still read its partials or statistics.
    cluster_wait();
#endif
}

#define RLX_FFN_ROWS(H, I)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256) ffn_rows_##H##_##I##_f16(const FfnRowsP p) {          \
        ffn_rows_body<__half, H, I, false>(p);                                                             \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) ffn_rows_##H##_##I##_bf16(const FfnRowsP p) {         \
        ffn_rows_body<__nv_bfloat16, H, I, false>(p);                                                      \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) ffn_rows_tail_##H##_##I##_f16(const FfnRowsP p) {     \
        ffn_rows_body<__half, H, I, true>(p);                                                              \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(256) ffn_rows_tail_##H##_##I##_bf16(const FfnRowsP p) {    \
        ffn_rows_body<__nv_bfloat16, H, I, true>(p);                                                       \
    }
// The widths (H, I) are defined ahead of this text (src/nvrtc.rs
// `ffn_source`): one module per width pair a schedule runs. The extra
// level expands FFN_H and FFN_I before they are pasted into the names.
#define RLX_FFN_ROWS_AT(H, I) RLX_FFN_ROWS(H, I)
RLX_FFN_ROWS_AT(FFN_H, FFN_I)
