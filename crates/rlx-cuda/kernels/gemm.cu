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
// Split-K runs inside a thread-block cluster (sm_90; launched with cluster
// dims (1, 1, S), S = gridDim.z <= 8): each block leaves its f32 partial
// tile in its own shared memory, and after a cluster barrier block z sums
// rows [z·BM/S, (z+1)·BM/S) of the tile over all S blocks' shared memory
// (DSMEM) in rank order 0..S-1, applies the epilogue and stores. No global
// workspace, no counters, no serial tail; the fixed order gives the same
// bits on every call.
//
// Weights (B, bias) are not written by earlier kernels (the host says so
// through `early`): their first tiles are requested before
// griddepcontrol.wait, so under programmatic dependent launch the weight
// fetch overlaps the previous kernel's tail. A and the residual are read
// only after the wait.
//
// (BM/WM)·(BN/WC) warps: warp w owns WM rows from WM·(w % (BM/WM)) of the
// tile (WM/16 m16 fragments) and WC columns from WC·(w / (BM/WM)) (WC/8 n8
// fragments); mma.sync m16n8k16. At 8-16 warps a scheduler has 2-4 warps
// to switch between: with one (4 warps) the block was latency-bound,
// issuing once every ~5 cycles.
//
// Tiles of BK = 64 along K move by 16-byte cp.async, `stages` deep
// (dynamic shared memory; the host makes it the whole K-chunk where that
// fits, so every copy of a block is in flight at once); each thread's
// source addresses are worked out once. One bulk copy (cp.async.bulk) per
// tile row instead was 3-5x slower: the copy engine takes small copies
// one at a time. A tile:
// [BM][BK+8]; B tile: [BN][BK+8] when B is stored transposed ([N, K],
// `BT`), else [BK][BN+8]; the 16-byte padding keeps fragment reads free of
// bank conflicts. Shared memory: bias slice [BN], residual share
// [ceil(BM/S)][BN] (when there is a residual), then the pipeline buffers,
// which the f32 partial tile [BM][BN+8] reuses.
// Host checks: K a multiple of 64·S, N of BN, lda/ldb of 8, every pointer
// 16-byte aligned; rows past M read as zeros and are not written.
#include "common.cuh"

#define GEMM_BM 128
#define GEMM_BK 64

struct GemmP {
    const void* a; const void* b; const void* bias; const void* res; void* out;
    i64 m; i64 n; i64 k; i64 lda; i64 ldb; i64 act; i64 kchunk; i64 stages; i64 early;
};

// cp.async.wait_group with a run-time count (0..6).
__device__ __forceinline__ void gemm_wait_dyn(int n) {
    switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    default: cp_async_wait<6>(); break;
    }
}

template <typename T, int BN, int WM, int WC, bool BT>
__device__ __forceinline__ void gemm_body(const GemmP& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int BM = GEMM_BM, BK = GEMM_BK;
    constexpr int MF = WM / 16;
    constexpr int WARPS_M = BM / WM;
    constexpr int NT = WARPS_M * (BN / WC) * 32;
    constexpr int AP = BK + 8;
    constexpr int BP = BT ? BK + 8 : BN + 8;
    constexpr int A_ELEMS = BM * AP;
    constexpr int B_ELEMS = BT ? BN * BP : BK * BP;
    constexpr int NF = WC / 8;
    constexpr int SP = BN + 8;  // pitch of the f32 partial tile
    typedef unsigned short u16;
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    const int S = (int)gridDim.z;
    const int rank = (int)cluster_rank();  // == blockIdx.z: clusters span z
    const int r0 = rank * BM / S, r1 = (rank + 1) * BM / S;
    const int stages = (int)p.stages;
    u16* const s_bias = (u16*)gemm_smem;
    u16* const s_res = s_bias + BN;
    u16* const sa0 = s_res + (p.res ? (BM + S - 1) / S * BN : 0);
    u16* const sb0 = sa0 + stages * A_ELEMS;
    float* const part = (float*)sa0;
    const u16* A = (const u16*)p.a;
    const u16* B = (const u16*)p.b;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    const i64 n0 = (i64)blockIdx.x * BN, m0 = (i64)blockIdx.y * BM;
    const i64 k0 = (i64)blockIdx.z * p.kchunk;
    const int nk = (int)(p.kchunk / BK);

    // Each thread copies the same 16-byte column chunk of rows `rows` apart
    // in every tile: its addresses are worked out once, here.
    constexpr int A_ROWS = NT / (BK / 8), A_IT = BM / A_ROWS;
    const int a_r = tid / (BK / 8), a_c = tid % (BK / 8) * 8;
    const u16* const a_src = A + (m0 + a_r) * p.lda + k0 + a_c;
    const i64 a_step = (i64)A_ROWS * p.lda;
    unsigned a_in = 0;  // bit it: row a_r + it·A_ROWS lies below M
#pragma unroll
    for (int it = 0; it < A_IT; ++it) a_in |= (unsigned)(m0 + a_r + it * A_ROWS < p.m) << it;
    constexpr int B_CPR = BT ? BK / 8 : BN / 8;  // 16-byte chunks per B row
    constexpr int B_ROWS = NT / B_CPR, B_IT = (BT ? BN : BK) / B_ROWS;
    static_assert(B_IT * B_ROWS == (BT ? BN : BK) && A_IT * A_ROWS == BM, "copy mapping");
    const int b_r = tid / B_CPR, b_c = tid % B_CPR * 8;
    const u16* const b_src = BT ? B + (n0 + b_r) * p.ldb + k0 + b_c : B + (k0 + b_r) * p.ldb + n0 + b_c;
    const i64 b_step = (i64)B_ROWS * p.ldb, b_tile = BT ? (i64)BK : (i64)BK * p.ldb;

    auto load_a = [&](int stage, int kt) {
        u16* da = sa0 + stage * A_ELEMS + a_r * AP + a_c;
        const u16* src = a_src + (i64)kt * BK;
#pragma unroll
        for (int it = 0; it < A_IT; ++it) {
            const bool in = (a_in >> it) & 1u;
            cp_async16(da + it * A_ROWS * AP, in ? src + it * a_step : A, in);
        }
    };
    auto load_b = [&](int stage, int kt) {
        u16* db = sb0 + stage * B_ELEMS + b_r * BP + b_c;
        const u16* src = b_src + kt * b_tile;
#pragma unroll
        for (int it = 0; it < B_IT; ++it) cp_async16(db + it * B_ROWS * BP, src + it * b_step, true);
    };
    // Copy groups: first the weights of the first stages - 1 tiles (and the
    // bias), then one group per A tile (the residual share rides in the
    // first), then one per later tile; so at iteration kt, stages - 2 groups
    // younger than tile kt's may stay pending.
    auto weights = [&]() {
        for (int s = 0; s < stages - 1 && s < nk; ++s) load_b(s, s);
        if (p.bias && tid < BN / 8) cp_async16(s_bias + tid * 8, (const u16*)p.bias + n0 + tid * 8, true);
        cp_async_commit();
    };
    if (p.early) weights();
    pdl_enter();
    if (!p.early) weights();
    if (p.res) {
        for (int e = tid; e < (r1 - r0) * (BN / 8); e += NT) {
            const int r = e / (BN / 8), c = e % (BN / 8);
            const i64 row = m0 + r0 + r;
            const bool in = row < p.m;
            cp_async16(s_res + r * BN + c * 8, in ? (const u16*)p.res + row * p.n + n0 + c * 8 : (const u16*)p.res, in);
        }
    }
    for (int s = 0; s < stages - 1; ++s) {
        if (s < nk) load_a(s, s);
        cp_async_commit();
    }

    float acc[MF][NF][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) acc[mf][nf][0] = acc[mf][nf][1] = acc[mf][nf][2] = acc[mf][nf][3] = 0.0f;

    const int mi = lane >> 3, mr = lane & 7;
    // Per-lane ldmatrix offsets within a stage (elements).
    const int a_frag = (wm * WM + (mi & 1) * 8 + mr) * AP + (mi >> 1) * 8;
    const int b_frag = BT ? (wn * WC + (mi >> 1) * 8 + mr) * BP + (mi & 1) * 8 : ((mi & 1) * 8 + mr) * BP + wn * WC + (mi >> 1) * 8;
    int cur = 0, nxt_stage = stages - 1;  // stages of tile kt and of tile kt + stages - 1
    for (int kt = 0; kt < nk; ++kt) {
        gemm_wait_dyn(stages - 2);
        __syncthreads();  // tile kt visible to all; stage (kt - 1) % stages free
        if (kt + stages - 1 < nk) {
            load_a(nxt_stage, kt + stages - 1);
            load_b(nxt_stage, kt + stages - 1);
        }
        cp_async_commit();
        const u16* ca = sa0 + cur * A_ELEMS + a_frag;
        const u16* cb = sb0 + cur * B_ELEMS + b_frag;
        mma_warp_steps<T, MF, NF, BK / 16, AP, BP, BT>(acc, ca, cb);
        cur = cur + 1 == stages ? 0 : cur + 1;
        nxt_stage = nxt_stage + 1 == stages ? 0 : nxt_stage + 1;
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the pipeline buffers

    // The partial tile over the pipeline buffers (float2 stores: the +8
    // pitch puts the 8 fragment rows of a warp in distinct banks).
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = wm * WM + mf * 16 + g + h * 8, col = wn * WC + nf * 8 + 2 * t;
                *(float2*)(part + row * SP + col) = make_float2(acc[mf][nf][2 * h], acc[mf][nf][2 * h + 1]);
            }
    cluster_sync();  // every block's partial tile is complete

    // This block's share of rows, four columns per step: the S partials in
    // rank order, then bias, activation, residual. The epilogue stays one
    // compact loop (inlined into unrolled fragment loops it made the code
    // ~180 KB and instruction fetch dominated).
    // The partial tile's address in each block of the cluster (the same offset).
    const unsigned part_addr = (unsigned)__cvta_generic_to_shared(part);
    unsigned part_at[8];
#pragma unroll
    for (int z = 0; z < 8; ++z) part_at[z] = z < S ? cluster_map(part_addr, (unsigned)z) : 0u;
    const T* bs = (const T*)s_bias;
    const T* rs = (const T*)s_res;
    T* out = (T*)p.out;
    constexpr int C4 = BN / 4;
    const int count = (r1 - r0) * C4;
    // Two steps per round, all 2·S loads of a round in flight together.
    for (int i0 = tid; i0 < count; i0 += 2 * NT) {
        float4 pz[2][8];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int i = i0 + u * NT;
            // Rows past M are not read: an unused remote load could still be
            // in flight at the relaxed barrier below when its block exits.
            if (i < count && m0 + r0 + i / C4 < p.m) {
                const int r = r0 + i / C4, c = 4 * (i % C4);
                const unsigned off = (unsigned)((r * SP + c) * 4);
#pragma unroll
                for (int z = 0; z < 8; ++z)
                    if (z < S) pz[u][z] = ld_cluster_f4(part_at[z] + off);
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int i = i0 + u * NT;
            const int r = r0 + i / C4, c = 4 * (i % C4);
            const i64 row = m0 + r;
            if (i >= count || row >= p.m) continue;
            float v[4] = {pz[u][0].x, pz[u][0].y, pz[u][0].z, pz[u][0].w};
#pragma unroll
            for (int z = 1; z < 8; ++z)
                if (z < S) {
                    v[0] += pz[u][z].x;
                    v[1] += pz[u][z].y;
                    v[2] += pz[u][z].z;
                    v[3] += pz[u][z].w;
                }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (p.bias) v[j] += ld(bs, c + j);
                if (p.act != ACT_NONE) v[j] = act_call<T>(p.act, v[j]);
                if (p.res) v[j] += ld(rs, (r - r0) * BN + c + j);
            }
            // n, n0 and c are multiples of 4: one 8-byte store.
            *(uint2*)(out + row * p.n + n0 + c) = make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
        }
    }
    // No block leaves while others may still read its partial. Their reads
    // are complete: each fed a store before its thread arrived (rows past M
    // are never read; a relaxed arrive does not wait for an unused load).
    cluster_sync_relaxed();
#endif
}

// gemm_<BN>_<W>w_<n|t>_<dtype>: BN columns per block, W warps, each WM
// rows by WC columns of the tile; `t` reads B as [N, K] (b_trans), `n` as [K, N].
#define RLX_GEMM(BN, W, WM, WC, BT, TAG)                                                                              \
    extern "C" __global__ void __launch_bounds__(W * 32) gemm_##BN##_##W##w_##TAG##_f16(const GemmP p) {              \
        gemm_body<__half, BN, WM, WC, BT>(p);                                                                         \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(W * 32) gemm_##BN##_##W##w_##TAG##_bf16(const GemmP p) {             \
        gemm_body<__nv_bfloat16, BN, WM, WC, BT>(p);                                                                  \
    }
RLX_GEMM(32, 8, 16, 32, false, n)
RLX_GEMM(32, 8, 16, 32, true, t)
RLX_GEMM(64, 8, 32, 32, false, n)
RLX_GEMM(64, 8, 32, 32, true, t)
RLX_GEMM(64, 16, 16, 32, false, n)
RLX_GEMM(64, 16, 16, 32, true, t)
RLX_GEMM(128, 16, 32, 32, false, n)
RLX_GEMM(128, 16, 32, 32, true, t)
