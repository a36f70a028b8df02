// A linear layer and the norm after it in one kernel, for at most a few
// hundred rows (sm_90: thread-block clusters):
//
//   y   = round(X·Wᵀ + bias + res1)        (the matmul's output, storage type)
//   out = norm(y + res2)                    (LayerNorm or RmsNorm over N)
//
// X is [M, K] (row pitch lda), W [N, K] as a Linear layer stores it, res1
// and res2 [M, N]; bias, res1, res2 and beta may be null. At batch 1 the
// library matmul, whose launch waits for the kernel before it, and the norm
// kernel after it cost two launches; here the weight slice loads while the
// previous kernel drains and the norm needs no second pass over memory.
//
// Work split: clusters of CS = N / OC blocks; cluster g owns rows
// [16g, 16g + 16), block r of it output columns [r·OC, (r+1)·OC) over the
// full K (no split-K across blocks, so no partial tiles cross the cluster):
//   1. the 8 warps each multiply X[rows, K/8 slice] by W[cols, slice]ᵀ;
//      the 8 f32 partials are summed in warp order through shared memory,
//      bias and res1 added, rounded to the storage type (where the unfused
//      graph rounds the matmul's output), res2 added;
//   2. each block reduces its OC columns of every row to (mean, M2) and,
//      after one cluster barrier, every block combines the CS pairs in rank
//      order (Chan's formula: M2 = Σ M2_z + OC·(mean_z − mean)²), so the
//      variance is as exact as a two-pass one; RmsNorm uses mean 0;
//   3. each block normalises and stores its columns.
// Deterministic (fixed orders everywhere): replay equals eager bit for bit.
// Shared memory (u16 = the storage type): W [OC][K+8], then X [16][K+8]
// (the f32 partials [8][16][OC+4] reuse it after step 1), y [16][OC] f32,
// res1 and res2 [16][OC], bias, gamma, beta [OC], the row statistics.
#include "common.cuh"

struct LinNormP {
    const void* x; const void* w; const void* bias; const void* res1; const void* res2;
    const void* gamma; const void* beta; void* out;
    i64 m; i64 lda; i64 rms; double eps;
};

__host__ __device__ constexpr int ln_max(int a, int b) { return a > b ? a : b; }

// Bytes of dynamic shared memory of linnorm_<K>_<OC> (src/linnorm.rs computes the same).
template <int K, int OC>
struct LinNormSmem {
    static constexpr int R = 16, KP = K + 8, PP = OC + 4;
    static constexpr int W = OC * KP * 2;
    static constexpr int U = ln_max(R * KP * 2, 8 * R * PP * 4);
    static constexpr int Y = R * OC * 4;
    static constexpr int RES = 2 * R * OC * 2;
    static constexpr int VEC = 3 * OC * 2;
    static constexpr int STAT = 2 * R * 8;
    static constexpr int TOTAL = W + U + Y + RES + VEC + STAT;
};

// f32 rounded to the storage type and back.
template <typename T> __device__ __forceinline__ float round_t(float v);
template <> __device__ __forceinline__ float round_t<__half>(float v) { return __half2float(__float2half_rn(v)); }
template <> __device__ __forceinline__ float round_t<__nv_bfloat16>(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// N = OC · CS; 8 warps.
template <typename T, int K, int OC, int CS>
__device__ __forceinline__ void linnorm_body(const LinNormP& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    typedef unsigned short u16;
    typedef LinNormSmem<K, OC> L;
    constexpr int R = L::R, KP = L::KP, PP = L::PP, NT = 256, N = OC * CS, KW = K / 8, NF = OC / 8;
    static_assert(K % 128 == 0 && OC % 16 == 0 && CS >= 2 && CS <= 16 && OC <= 96, "linnorm shapes");
    static_assert(L::TOTAL <= 227 * 1024, "shared memory of one block");
    extern __shared__ __align__(16) unsigned char ln_smem[];
    u16* const ws = (u16*)ln_smem;
    u16* const xs = (u16*)(ln_smem + L::W);
    float* const part = (float*)(ln_smem + L::W);  // after the multiply, over xs
    float* const ys = (float*)(ln_smem + L::W + L::U);
    u16* const r1s = (u16*)(ln_smem + L::W + L::U + L::Y);
    u16* const r2s = r1s + R * OC;
    u16* const vs = (u16*)(ln_smem + L::W + L::U + L::Y + L::RES);  // bias, gamma, beta
    float2* const loc = (float2*)(ln_smem + L::W + L::U + L::Y + L::RES + L::VEC);  // [R] (mean, M2) of this block's columns
    float2* const fin = loc + R;                                                     // [R] (mean, rstd) of the rows

    const int r = (int)cluster_rank();
    const int row0 = (int)(blockIdx.x / CS) * R;
    const int nrows = min(R, (int)p.m - row0);
    if (nrows <= 0) return;  // the whole cluster: no barrier is waited for
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const i64 c0 = (i64)r * OC;

    // The weights first (they do not depend on the kernel before).
    cp_async_rows<K, KP, NT>(ws, (const u16*)p.w + c0 * K, K, OC, OC);
    for (int e = tid; e < 3 * (OC / 8); e += NT) {
        const int v = e / (OC / 8), c = e % (OC / 8) * 8;
        const u16* src = (const u16*)(v == 0 ? p.bias : v == 1 ? p.gamma : p.beta);
        cp_async16(vs + v * OC + c, src ? src + c0 + c : (const u16*)p.w, src != nullptr);
    }
    cp_async_commit();
    pdl_enter();
    cp_async_rows<K, KP, NT>(xs, (const u16*)p.x + (i64)row0 * p.lda, p.lda, R, nrows);
    for (int e = tid; e < 2 * R * (OC / 8); e += NT) {
        const int which = e / (R * (OC / 8)), row = e / (OC / 8) % R, c = e % (OC / 8) * 8;
        const u16* src = (const u16*)(which == 0 ? p.res1 : p.res2);
        const bool in = src != nullptr && row < nrows;
        cp_async16(r1s + which * R * OC + row * OC + c, in ? src + (i64)(row0 + row) * N + c0 + c : (const u16*)p.w, in);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // 1. The warps' K slices, then their sum.
    {
        float acc[1][NF][4];
        mma_warp_tile<T, 1, NF, KW / 16, KP, KP>(acc, xs + warp * KW, 0, ws + warp * KW, 0, true);
        __syncthreads();  // every warp is done with xs: the partials go over it
        float* const mine = part + warp * R * PP;
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                *(float2*)(mine + (g + h * 8) * PP + nf * 8 + 2 * t) = make_float2(acc[0][nf][2 * h], acc[0][nf][2 * h + 1]);
    }
    __syncthreads();
    const T* const bias = (const T*)vs;
    const T* const r1 = (const T*)r1s;
    const T* const r2 = (const T*)r2s;
    for (int e = tid; e < nrows * OC; e += NT) {
        const int row = e / OC, c = e % OC;
        float s = part[row * PP + c];
#pragma unroll
        for (int w = 1; w < 8; ++w) s += part[w * R * PP + row * PP + c];
        s += ld(bias, c) + ld(r1, row * OC + c);
        ys[row * OC + c] = round_t<T>(s) + ld(r2, row * OC + c);
    }
    __syncthreads();

    // 2. (mean, M2) of this block's columns: warp w takes rows 2w and 2w + 1.
    constexpr int PER = (OC + 31) / 32;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = 2 * warp + h;
        if (row >= nrows) continue;
        float v[PER], s = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const int c = lane + 32 * j;
            v[j] = c < OC ? ys[row * OC + c] : 0.0f;
            s += v[j];
        }
        const float mean = p.rms ? 0.0f : warp_sum(s) * (1.0f / OC);
        float d2 = 0.0f;
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (lane + 32 * j < OC) d2 += (v[j] - mean) * (v[j] - mean);
        d2 = warp_sum(d2);
        if (lane == 0) loc[row] = make_float2(mean, d2);
    }
    cluster_sync();  // every block's statistics are visible to the cluster
    if (tid < nrows) {
        const unsigned a = (unsigned)__cvta_generic_to_shared(loc + tid);
        float mz[CS], m2 = 0.0f, mean = 0.0f;
#pragma unroll
        for (int z = 0; z < CS; ++z) {
            const unsigned at = cluster_map(a, (unsigned)z);
            mz[z] = ld_cluster_f32(at);
            m2 += ld_cluster_f32(at + 4);
        }
#pragma unroll
        for (int z = 0; z < CS; ++z) mean += mz[z];
        mean *= 1.0f / CS;
#pragma unroll
        for (int z = 0; z < CS; ++z) m2 += (float)OC * (mz[z] - mean) * (mz[z] - mean);
        fin[tid] = make_float2(mean, rsqrtf(m2 * (1.0f / N) + (float)p.eps));
    }
    cluster_arrive_relaxed();  // this block reads no other block's memory after this
    __syncthreads();

    // 3. Normalise and store this block's columns, two per thread.
    const T* const gamma = (const T*)vs + OC;
    const T* const beta = (const T*)vs + 2 * OC;
    for (int e = tid; e < nrows * (OC / 2); e += NT) {
        const int row = e / (OC / 2), c = e % (OC / 2) * 2;
        const float2 f = fin[row];
        float o[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            o[j] = (ys[row * OC + c + j] - f.x) * f.y * ld(gamma, c + j);
            if (p.beta) o[j] += ld(beta, c + j);
        }
        *(unsigned*)((T*)p.out + (i64)(row0 + row) * N + c0 + c) = pack2<T>(o[0], o[1]);
    }
    cluster_wait();  // no block leaves while another may still read its statistics
#endif
}

// linnorm_<K>_<N>_<OC>_<dtype>: N / OC blocks per cluster.
#define RLX_LINNORM(K, N, OC)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256) linnorm_##K##_##N##_##OC##_f16(const LinNormP p) {            \
        linnorm_body<__half, K, OC, N / OC>(p);                                                                     \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(256) linnorm_##K##_##N##_##OC##_bf16(const LinNormP p) {           \
        linnorm_body<__nv_bfloat16, K, OC, N / OC>(p);                                                              \
    }
// MiniLM (H 384, I 1536): the attention's output projection and FFN2.
RLX_LINNORM(384, 384, 32)
RLX_LINNORM(384, 384, 48)
RLX_LINNORM(1536, 384, 32)
RLX_LINNORM(1536, 384, 48)
// bert-base (H 768): the output projection.
RLX_LINNORM(768, 768, 48)
RLX_LINNORM(768, 768, 96)
