// Skinny-M matmul on Hopper's own path (sm_90a): tiles arrive by the
// tensor copy engine (TMA, cp.async.bulk.tensor.2d with 128-byte swizzle,
// completing on an mbarrier) and are multiplied by wgmma from shared
// memory, f32 accumulators in registers. Same contract and epilogue as
// kernels/gemm.cu (out = act(A·B + bias) + residual, split-K across a
// thread-block cluster reduced through DSMEM in rank order), for B stored
// [N, K] (every BERT linear layer), f16 / bf16.
//
// Why: the mma.sync kernel spent ~780 warp instructions per 32 tensor-core
// instructions (16-byte cp.async issue, ldmatrix, address arithmetic); here
// one thread issues two copies per K tile and each warpgroup one wgmma per
// 16 of K. Measured (H200, M = 128, in graph): 1.2-1.6x faster than the
// mma.sync kernel, ahead of cuBLASLt at N = 384 (K 384 / 1536), 1.3-1.4x
// behind it at N = 2304 / 3072 (bench/gpu-perf.md, session 4, helper 2).
//
// Block: 9 warps. Warps 0-7 are two consumer warpgroups, rows 0-63 and
// 64-127 of the BM = 128 row tile (m64nBNk16, BN = 32/64/128); warp 8 is
// the producer (one lane issues every copy). Stages of BK = 64 (128 bytes
// of K, one swizzle row) hold an A tile [128][64] and a B tile [BN][64];
// `full[s]` completes when both have landed, `empty[s]` when all 8
// consumer warps have finished reading the stage. Weight tiles are issued
// before griddepcontrol.wait when the host says B is written only at
// prepare (`early`), A tiles after.
//
// A multicast (`MC` > 1, cluster (MC, 1, S)): the MC blocks of a cluster
// row have the same K range and different N-tiles, so they need the same A
// tiles; each copies BM/MC rows of every A tile into all MC blocks (one L2
// read instead of MC). Only launched when every K tile has its own stage:
// a stage is never refilled, so no block waits on another's consumers.
//
// Tensor maps (host: cuTensorMapEncodeTiled) are passed by value in the
// parameter struct (__grid_constant__). Rows past M are zero-filled by
// the copy engine and not stored. Host checks: K a multiple of 64·S, N of
// BN, lda/ldb of 8, pointers 16-byte aligned.
//
// Shared memory: 2·stages mbarriers in the first 256 bytes (stages <= 16), the bias slice
// [BN] and residual share [ceil(BM/S)][BN] (the consumers copy them while
// the tiles arrive), then (from the next 1024-byte boundary, as the
// 128-byte swizzle needs) the stages, which the f32 partial tile
// [BM][BN+8] reuses after the main loop.
#include "common.cuh"

typedef unsigned long long u64;

// A CUtensorMap (opaque, 128 bytes; CUDA 13 aligns it to 128).
struct __align__(128) WgTmap {
    u64 w[16];
};

struct __align__(128) GemmWgP {
    WgTmap ta;  // A: dims {K, M}, box {64, 128 / MC}
    WgTmap tb;  // B: dims {K, N}, box {64, BN}
    const void* bias; const void* res; void* out;
    i64 m; i64 n; i64 kchunk; i64 act; i64 stages; i64 early;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned wg_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void wg_bar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void wg_bar_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void wg_bar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void wg_bar_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\nWG_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WG_WAIT;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
// One 2-D box of the tensor map at (c0 along the contiguous dim, c1 rows).
__device__ __forceinline__ void wg_tma(unsigned dst, const WgTmap* map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"((u64)map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// As wg_tma, the box written to the same offset (and counted on the same
// mbarrier) in every block of the cluster that `mask` names.
__device__ __forceinline__ void wg_tma_mc(unsigned dst, const WgTmap* map, int c0, int c1, unsigned bar, unsigned short mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
                 "l"((u64)map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
                 : "memory");
}
// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row
// groups 1024 bytes apart (the leading offset is unused for this layout).
__device__ __forceinline__ u64 wg_desc(unsigned addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Keeps the compiler from touching an accumulator across the async ops.
__device__ __forceinline__ void wg_reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// This block's x position in its cluster.
__device__ __forceinline__ unsigned wg_cluster_x() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctaid.x;\n" : "=r"(r));
    return r;
}

template <typename T> struct WgIsBf16 { static constexpr bool value = false; };
template <> struct WgIsBf16<__nv_bfloat16> { static constexpr bool value = true; };

// wgmma m64nNk16, A and B from shared memory (descriptors), f32 += (acc != 0).
template <int N> struct WgMma;
template <> struct WgMma<32> {
    template <bool BF>
    static __device__ __forceinline__ void run(float* d, u64 da, u64 db, int acc) {
        if (BF)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                         : "l"(da), "l"(db), "r"(acc));
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                         : "l"(da), "l"(db), "r"(acc));
    }
};
template <> struct WgMma<64> {
    template <bool BF>
    static __device__ __forceinline__ void run(float* d, u64 da, u64 db, int acc) {
        if (BF)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                         : "l"(da), "l"(db), "r"(acc));
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                         : "l"(da), "l"(db), "r"(acc));
    }
};
template <> struct WgMma<128> {
    template <bool BF>
    static __device__ __forceinline__ void run(float* d, u64 da, u64 db, int acc) {
        if (BF)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                         : "l"(da), "l"(db), "r"(acc));
        else
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                         : "l"(da), "l"(db), "r"(acc));
    }
};

template <typename T, int BN, int MC>
__device__ __forceinline__ void gemm_wg_body(const GemmWgP& p) {
    constexpr int BM = 128, BK = 64, NT = 288, SP = BN + 8;
    constexpr unsigned A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
    constexpr bool BF = WgIsBf16<T>::value;
    extern __shared__ __align__(16) unsigned char wg_raw[];
    const int stages = (int)p.stages;
    const unsigned raw = wg_smem(wg_raw);
    const unsigned full0 = raw, empty0 = raw + 8 * stages;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int S = (int)gridDim.z;
    const int share = (BM + S - 1) / S;  // most rows a block reduces
    unsigned short* const s_bias = (unsigned short*)(wg_raw + 256);
    unsigned short* const s_res = s_bias + BN;
    const unsigned tiles = (raw + 256 + 2 * BN + (p.res ? 2 * share * BN : 0) + 1023) & ~1023u;
    float* const part = (float*)(wg_raw + (tiles - raw));
    // Cluster (MC, 1, S): z splits K, x shares A; rank = cx + MC·z.
    const int cz = (int)blockIdx.z, cx = MC > 1 ? (int)wg_cluster_x() : 0;
    const int r0 = cz * BM / S, r1 = (cz + 1) * BM / S;
    const int n0 = (int)blockIdx.x * BN, m0 = (int)blockIdx.y * BM;
    const int kb = (int)(blockIdx.z * p.kchunk);
    const int nk = (int)(p.kchunk / BK);

    if (tid == 0) {
        for (int s = 0; s < stages; ++s) {
            wg_bar_init(full0 + 8 * s, 1);
            wg_bar_init(empty0 + 8 * s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // With multicast, the other blocks' barriers must exist before any copy.
    if (MC > 1) cluster_sync();
    else __syncthreads();

    float d[BN / 2];  // consumers' accumulators
    if (warp == 8) {
        if (lane == 0) {
            const int first = nk < stages ? nk : stages;
            auto weights = [&]() {
                for (int s = 0; s < first; ++s) {
                    wg_bar_expect(full0 + 8 * s, STAGE);
                    wg_tma(tiles + s * STAGE + A_BYTES, &p.tb, kb + s * BK, n0, full0 + 8 * s);
                }
            };
            if (p.early) weights();
            pdl_enter();
            if (!p.early) weights();
            // A: with MC > 1 each block of an x row copies BM/MC rows to all
            // MC (the host keeps every tile resident: no stage is refilled).
            const unsigned short mask = (unsigned short)(((1u << MC) - 1) << (MC * cz));
            for (int s = 0; s < first; ++s) {
                if (MC > 1)
                    wg_tma_mc(tiles + s * STAGE + cx * (BM / MC) * 128, &p.ta, kb + s * BK, m0 + cx * (BM / MC), full0 + 8 * s, mask);
                else
                    wg_tma(tiles + s * STAGE, &p.ta, kb + s * BK, m0, full0 + 8 * s);
            }
            if (MC > 1 && nk > stages) __trap();  // the host never launches this
            for (int kt = stages; MC == 1 && kt < nk; ++kt) {
                const int s = kt % stages;
                wg_bar_wait(empty0 + 8 * s, (unsigned)((kt / stages - 1) & 1));
                wg_bar_expect(full0 + 8 * s, STAGE);
                wg_tma(tiles + s * STAGE + A_BYTES, &p.tb, kb + kt * BK, n0, full0 + 8 * s);
                wg_tma(tiles + s * STAGE, &p.ta, kb + kt * BK, m0, full0 + 8 * s);
            }
        }
        __syncwarp();
    } else {
        // Bias slice and residual share into shared memory while the tiles
        // arrive (the epilogue then waits on nothing global).
        pdl_enter();
        if (p.bias && tid < BN / 8) cp_async16(s_bias + tid * 8, (const unsigned short*)p.bias + n0 + tid * 8, true);
        if (p.res) {
            for (int e = tid; e < (r1 - r0) * (BN / 8); e += 256) {
                const int r = e / (BN / 8), c = e % (BN / 8);
                const i64 row = m0 + r0 + r;
                const bool in = row < p.m;
                const unsigned short* src = (const unsigned short*)p.res + (in ? row * p.n + n0 + c * 8 : 0);
                cp_async16(s_res + r * BN + c * 8, src, in);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        const int wg = warp >> 2;
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) d[i] = 0.0f;
        for (int kt = 0; kt < nk; ++kt) {
            const int s = kt % stages;
            wg_bar_wait(full0 + 8 * s, (unsigned)((kt / stages) & 1));
            const unsigned a = tiles + s * STAGE + wg * (64 * 128), b = tiles + s * STAGE + A_BYTES;
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) wg_reg_fence(d[i]);
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) WgMma<BN>::template run<BF>(d, wg_desc(a + ks * 32), wg_desc(b + ks * 32), 1);
            wg_commit();
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) wg_reg_fence(d[i]);
            // The previous tile's wgmmas are done: its stage may be refilled.
            wg_wait<1>();
            if (kt > 0 && lane == 0) wg_bar_arrive(empty0 + 8 * ((kt - 1) % stages));
        }
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) wg_reg_fence(d[i]);
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    }
    __syncthreads();  // every stage consumed: the partial tile may overwrite them
    if (warp < 8) {
        // Accumulator layout (as mma.sync's per n8 block): d[4j + 2h + e] is
        // row 16·(warp % 4) + g + 8h, column 8j + 2t + e of the warpgroup's 64 rows.
        const int wg = warp >> 2, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = wg * 64 + (warp & 3) * 16 + g + 8 * h, col = 8 * j + 2 * t;
                *(float2*)(part + row * SP + col) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
            }
    }
    cluster_sync();  // every block's partial tile is complete

    // This block's share of rows, four columns per step: the S partials in
    // rank order, then bias, activation, residual (as kernels/gemm.cu).
    const unsigned part_addr = wg_smem(part);
    unsigned part_at[8];
#pragma unroll
    for (int z = 0; z < 8; ++z) part_at[z] = z < S ? cluster_map(part_addr, (unsigned)(cx + MC * z)) : 0u;
    const T* bs = (const T*)s_bias;
    const T* rs = (const T*)s_res;
    T* out = (T*)p.out;
    constexpr int C4 = BN / 4;
    const int count = (r1 - r0) * C4;
    // One step per thread and round: two in flight (all 2·S loads) took
    // the kernel past 100 registers, and blocks needing two per SM no
    // longer fitted.
    for (int i = tid; i < count; i += NT) {
        const int r = r0 + i / C4, c = 4 * (i % C4);
        const i64 row = m0 + r;
        // Rows past M are not read: an unused remote load could still be in
        // flight at the relaxed barrier below when its block exits.
        if (row >= p.m) continue;
        float4 pz[8];
#pragma unroll
        for (int z = 0; z < 8; ++z)
            if (z < S) pz[z] = ld_cluster_f4(part_at[z] + (unsigned)((r * SP + c) * 4));
        float v[4] = {pz[0].x, pz[0].y, pz[0].z, pz[0].w};
#pragma unroll
        for (int z = 1; z < 8; ++z)
            if (z < S) {
                v[0] += pz[z].x;
                v[1] += pz[z].y;
                v[2] += pz[z].z;
                v[3] += pz[z].w;
            }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (p.bias) v[j] += ld(bs, c + j);
            if (p.act != ACT_NONE) v[j] = act_call<T>(p.act, v[j]);
            if (p.res) v[j] += ld(rs, (r - r0) * BN + c + j);
        }
        *(uint2*)(out + row * p.n + n0 + c) = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
    }
    // No block leaves while others may still read its partial; every read
    // fed a store before its thread arrived.
    cluster_sync_relaxed();
}
#endif

// gemm_wg_<BN>[_mc<MC>]_<dtype>: BN columns per block, 9 warps, B as
// [N, K]; mc<MC>: A multicast across MC blocks along N.
#define RLX_GEMM_WG(BN, MC, TAG)                                                                                           \
    extern "C" __global__ void __launch_bounds__(288, 1) gemm_wg_##BN##TAG##_f16(const __grid_constant__ GemmWgP p) {      \
        gemm_wg_body<__half, BN, MC>(p);                                                                                   \
    }                                                                                                                      \
    extern "C" __global__ void __launch_bounds__(288, 1) gemm_wg_##BN##TAG##_bf16(const __grid_constant__ GemmWgP p) {     \
        gemm_wg_body<__nv_bfloat16, BN, MC>(p);                                                                            \
    }
RLX_GEMM_WG(32, 1, )
RLX_GEMM_WG(64, 1, )
RLX_GEMM_WG(128, 1, )
RLX_GEMM_WG(32, 2, _mc2)
RLX_GEMM_WG(32, 4, _mc4)
RLX_GEMM_WG(64, 2, _mc2)
RLX_GEMM_WG(64, 4, _mc4)
RLX_GEMM_WG(128, 2, _mc2)
