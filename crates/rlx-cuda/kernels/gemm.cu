// Skinny-M matmul on tensor cores (f16 / bf16 storage, f32 accumulation)
// with the whole MatMul epilogue fused: out = act(A·B + bias) + residual.
//
// Written for the few-row GEMMs of batch-1 transformer layers (M = 128,
// N and K in the hundreds or thousands), where a library's large tiles
// leave most SMs idle: a block owns all BM = 128 rows of an N-tile of BN
// columns and one K-chunk; split-K over gridDim.z fills the GPU. The host
// (src/gemm.rs) times this kernel against cuBLASLt at prepare and keeps
// whichever is faster for the shape.
//
// Split-K is deterministic: every split writes its f32 partial tile to a
// workspace, the last split to arrive (a per-tile counter) sums the
// partials in split order 0..S-1, applies the epilogue and resets the
// counter for the next call. Same inputs, same bits, whichever block ends
// last.
//
// 4 warps; warp w owns rows 32w..32w+31 of the tile (two m16 fragments) and
// all BN columns (BN/8 n8 fragments); mma.sync m16n8k16. Tiles of BK = 64
// along K move by cp.async, four stages deep (dynamic shared memory, up to
// 110 KB: at M = 128 the loop is latency-bound, so many bytes must be in
// flight). A tile: [BM][BK+8]; B tile:
// [BN][BK+8] when B is stored transposed ([N, K], `BT`), else [BK][BN+8];
// the 16-byte padding keeps fragment reads free of bank conflicts.
// Host checks: K a multiple of 64·S, N of BN, lda/ldb of 8, every pointer
// 16-byte aligned; rows past M read as zeros and are not written.
#include "common.cuh"

#define GEMM_BM 128
#define GEMM_BK 64
#define GEMM_STAGES 4

struct GemmP {
    const void* a; const void* b; const void* bias; const void* res; void* out;
    float* ws; unsigned* counters;
    i64 m; i64 n; i64 k; i64 lda; i64 ldb; i64 act; i64 kchunk;
};

template <typename T> struct GemmMma;
template <> struct GemmMma<__half> {
    static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct GemmMma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float* c, const unsigned* a, unsigned b0, unsigned b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

__device__ __forceinline__ void gemm_ldsm_x4(unsigned* r, const void* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}
__device__ __forceinline__ void gemm_ldsm_x4_trans(unsigned* r, const void* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}
__device__ __forceinline__ void gemm_cp16(void* smem, const void* gmem, bool full) {
    unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    int n = full ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void gemm_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void gemm_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Two floats rounded to nearest (as `st`) and packed into one word.
template <typename T> __device__ __forceinline__ unsigned gemm_pack(float a, float b);
template <> __device__ __forceinline__ unsigned gemm_pack<__half>(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned gemm_pack<__nv_bfloat16>(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<unsigned*>(&h);
}

// The activation as a real call: the epilogue loop stays small (see below).
template <typename T>
__device__ __noinline__ float gemm_act(i64 act, float v) {
    return act_t<T>(act, v);
}

template <typename T, int BN, bool BT>
__device__ void gemm_body(const GemmP& p) {
    constexpr int BM = GEMM_BM, BK = GEMM_BK, STAGES = GEMM_STAGES;
    constexpr int AP = BK + 8;
    constexpr int BP = BT ? BK + 8 : BN + 8;
    constexpr int B_ELEMS = BT ? BN * BP : BK * BP;
    constexpr int NF = BN / 8;
    extern __shared__ __align__(16) unsigned short gemm_smem[];
    // Stage s: A tile at s * (BM * AP), B tiles after all A tiles.
    unsigned short* const sa0 = gemm_smem;
    unsigned short* const sb0 = gemm_smem + STAGES * BM * AP;
    // The residual tile [BM][BN] and the bias slice [BN] follow the B tiles.
    unsigned short* const s_res = sb0 + STAGES * B_ELEMS;
    unsigned short* const s_bias = s_res + BM * BN;
    __shared__ unsigned s_last;
    typedef unsigned short u16;
    const u16* A = (const u16*)p.a;
    const u16* B = (const u16*)p.b;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const i64 n0 = (i64)blockIdx.x * BN, m0 = (i64)blockIdx.y * BM;
    const i64 k0 = (i64)blockIdx.z * p.kchunk;
    const int nk = (int)(p.kchunk / BK);

    auto load = [&](int stage, int kt) {
        const i64 kb = k0 + (i64)kt * BK;
        u16* da = sa0 + stage * (BM * AP);
        u16* db = sb0 + stage * B_ELEMS;
#pragma unroll
        for (int it = 0; it < BM * (BK / 8) / 128; ++it) {
            const int e = tid + it * 128;
            const int r = e / (BK / 8), c = e % (BK / 8);
            const i64 row = m0 + r;
            const bool in = row < p.m;
            gemm_cp16(da + r * AP + c * 8, in ? A + row * p.lda + kb + c * 8 : A, in);
        }
        if (BT) {
#pragma unroll
            for (int it = 0; it < (BN * (BK / 8) + 127) / 128; ++it) {
                const int e = tid + it * 128;
                if (e < BN * (BK / 8)) {
                    const int r = e / (BK / 8), c = e % (BK / 8);
                    gemm_cp16(db + r * BP + c * 8, B + (n0 + r) * p.ldb + kb + c * 8, true);
                }
            }
        } else {
#pragma unroll
            for (int it = 0; it < (BK * (BN / 8) + 127) / 128; ++it) {
                const int e = tid + it * 128;
                if (e < BK * (BN / 8)) {
                    const int r = e / (BN / 8), c = e % (BN / 8);
                    gemm_cp16(db + r * BP + c * 8, B + (kb + r) * p.ldb + n0 + c * 8, true);
                }
            }
        }
        gemm_commit();
    };

    // Residual and bias ride in the first copy group (zero-filled past M).
    if (p.res) {
#pragma unroll
        for (int it = 0; it < BM * (BN / 8) / 128; ++it) {
            const int e = tid + it * 128;
            const int r = e / (BN / 8), c = e % (BN / 8);
            const i64 row = m0 + r;
            const bool in = row < p.m;
            gemm_cp16(s_res + r * BN + c * 8, in ? (const u16*)p.res + row * p.n + n0 + c * 8 : (const u16*)p.res, in);
        }
    }
    if (p.bias && tid < BN / 8) gemm_cp16(s_bias + tid * 8, (const u16*)p.bias + n0 + tid * 8, true);

    float acc[2][NF][4];
#pragma unroll
    for (int mf = 0; mf < 2; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) acc[mf][nf][0] = acc[mf][nf][1] = acc[mf][nf][2] = acc[mf][nf][3] = 0.0f;

#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nk) load(s, s);
        else gemm_commit();  // keep one group per stage so the waits count right
    }
    const int mi = lane >> 3, mr = lane & 7;
    for (int kt = 0; kt < nk; ++kt) {
        gemm_wait<STAGES - 2>();
        __syncthreads();  // tile kt visible to all; stage (kt - 1) % STAGES free
        const int nxt = kt + STAGES - 1;
        if (nxt < nk) load(nxt % STAGES, nxt);
        else gemm_commit();
        const u16* ca = sa0 + (kt % STAGES) * (BM * AP);
        const u16* cb = sb0 + (kt % STAGES) * B_ELEMS;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            unsigned af[2][4];
#pragma unroll
            for (int mf = 0; mf < 2; ++mf) {
                // Matrices: rows +0..7 / +8..15 of the fragment, k +0..7 / +8..15.
                const u16* pa = ca + (warp * 32 + mf * 16 + (mi & 1) * 8 + mr) * AP + ks * 16 + (mi >> 1) * 8;
                gemm_ldsm_x4(af[mf], pa);
            }
            if (BT) {
                // Matrices (n +0..7, k +0..7), (n +0..7, k +8..15), then n +8..15:
                // b0, b1 of fragment nf, then of nf + 1.
                const u16* brow = cb + ((mi >> 1) * 8 + mr) * BP + ks * 16 + (mi & 1) * 8;
#pragma unroll
                for (int nf = 0; nf < NF; nf += 2) {
                    unsigned bf[4];
                    gemm_ldsm_x4(bf, brow + nf * 8 * BP);
                    GemmMma<T>::run(acc[0][nf], af[0], bf[0], bf[1]);
                    GemmMma<T>::run(acc[1][nf], af[1], bf[0], bf[1]);
                    GemmMma<T>::run(acc[0][nf + 1], af[0], bf[2], bf[3]);
                    GemmMma<T>::run(acc[1][nf + 1], af[1], bf[2], bf[3]);
                }
            } else {
                const u16* brow = cb + (ks * 16 + (mi & 1) * 8 + mr) * BP + (mi >> 1) * 8;
#pragma unroll
                for (int nf = 0; nf < NF; nf += 2) {
                    unsigned bf[4];
                    gemm_ldsm_x4_trans(bf, brow + nf * 8);
                    GemmMma<T>::run(acc[0][nf], af[0], bf[0], bf[1]);
                    GemmMma<T>::run(acc[1][nf], af[1], bf[0], bf[1]);
                    GemmMma<T>::run(acc[0][nf + 1], af[0], bf[2], bf[3]);
                    GemmMma<T>::run(acc[1][nf + 1], af[1], bf[2], bf[3]);
                }
            }
        }
    }
    gemm_wait<0>();
    __syncthreads();  // every warp is done with the pipeline buffers
    // Row / column of accumulator element (mf, nf, e) within the tile.
    auto tile_row = [&](int mf, int e) { return warp * 32 + mf * 16 + g + (e >> 1) * 8; };
    auto tile_col = [&](int nf, int e) { return nf * 8 + 2 * t + (e & 1); };
    // The f32 accumulators as a BM × BN tile at dst, rows `pitch` apart.
    auto store_acc = [&](float* dst, int pitch) {
#pragma unroll
        for (int mf = 0; mf < 2; ++mf)
#pragma unroll
            for (int nf = 0; nf < NF; ++nf)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    *(float2*)(dst + tile_row(mf, 2 * h) * pitch + tile_col(nf, 0)) = make_float2(acc[mf][nf][2 * h], acc[mf][nf][2 * h + 1]);
    };

    if (gridDim.z > 1) {
        const unsigned tile = blockIdx.y * gridDim.x + blockIdx.x;
        store_acc(p.ws + ((i64)tile * gridDim.z + blockIdx.z) * (BM * BN), BN);
        __threadfence();
        __syncthreads();
        if (tid == 0) s_last = atomicAdd(&p.counters[tile], 1u) == gridDim.z - 1;
        __syncthreads();
        if (!s_last) return;
        __threadfence();
        // Sum in split order 0..S-1 (the same bits whichever block is last);
        // one split at a time, all of this thread's loads of it in flight together.
        const float* base = p.ws + (i64)tile * gridDim.z * (BM * BN);
        for (unsigned z = 0; z < gridDim.z; ++z) {
            const float* part = base + (i64)z * (BM * BN);
#pragma unroll
            for (int mf = 0; mf < 2; ++mf)
#pragma unroll
                for (int nf = 0; nf < NF; ++nf)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float2 v = __ldcg((const float2*)(part + tile_row(mf, 2 * h) * BN + tile_col(nf, 0)));
                        acc[mf][nf][2 * h] = z == 0 ? v.x : acc[mf][nf][2 * h] + v.x;
                        acc[mf][nf][2 * h + 1] = z == 0 ? v.y : acc[mf][nf][2 * h + 1] + v.y;
                    }
        }
        if (tid == 0) p.counters[tile] = 0u;  // ready for the next call (the next kernel waits for this grid)
    }

    // Epilogue through shared memory: the f32 tile goes over the (now free)
    // A buffers, then one compact loop applies bias / activation / residual
    // (both prefetched into shared memory at the start) and stores pairs,
    // consecutive threads on consecutive columns. Kept out of the unrolled
    // fragment loops on purpose: inlined 64 times, the epilogue made the
    // kernel ~180 KB of code, and instruction fetch dominated its time.
    constexpr int SP = BN + 8;
    float* so = (float*)gemm_smem;
    store_acc(so, SP);
    __syncthreads();
    T* out = (T*)p.out;
    const T* rs = (const T*)s_res;
    const T* bs = (const T*)s_bias;
#pragma unroll 4
    for (int i = tid; i < BM * BN / 2; i += 128) {
        const int r = i / (BN / 2), c = 2 * (i % (BN / 2));
        const i64 row = m0 + r;
        if (row >= p.m) continue;
        float2 v = *(const float2*)(so + r * SP + c);
        if (p.bias) {
            v.x += ld(bs, c);
            v.y += ld(bs, c + 1);
        }
        if (p.act != ACT_NONE) {
            v.x = gemm_act<T>(p.act, v.x);
            v.y = gemm_act<T>(p.act, v.y);
        }
        if (p.res) {
            v.x += ld(rs, r * BN + c);
            v.y += ld(rs, r * BN + c + 1);
        }
        // n and the column are even: one 4-byte store per pair.
        *(unsigned*)(out + row * p.n + n0 + c) = gemm_pack<T>(v.x, v.y);
    }
}

// gemm_<BN>_<n|t>_<dtype>: `t` reads B as [N, K] (b_trans), `n` as [K, N].
#define RLX_GEMM(BN, BT, TAG)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) gemm_##BN##_##TAG##_f16(const GemmP p) {                        \
        pdl_enter();                                                                                                  \
        gemm_body<__half, BN, BT>(p);                                                                                 \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(128) gemm_##BN##_##TAG##_bf16(const GemmP p) {                       \
        pdl_enter();                                                                                                  \
        gemm_body<__nv_bfloat16, BN, BT>(p);                                                                          \
    }
RLX_GEMM(32, false, n)
RLX_GEMM(32, true, t)
RLX_GEMM(64, false, n)
RLX_GEMM(64, true, t)
