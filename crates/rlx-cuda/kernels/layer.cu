// The layer program: one persistent kernel that runs a run of consecutive
// thunks (matmuls, attention, norms; at batch 1 the whole BERT encoder) as a
// list of instructions, with a grid-wide barrier between instructions
// instead of a kernel boundary. Compiled appended to attention_mma.cu (one
// module: it calls `attention_split_item`). Off by default (src/layer.rs):
// on the H200 it is slower than the kernel-per-thunk graph (bench/gpu-perf.md,
// session 6): its matmuls take 6-15 µs against cuBLASLt's 3-6 µs.
//
// Why it was built: at a few hundred rows every kernel of a layer is
// latency-bound, and inside a CUDA graph each boundary still costs ~1.3 µs
// of launch plus the ramp and tail of the next grid (../shared/PERF.md).
// Here the grid stays resident (one block per SM; the host sizes the grid
// from the occupancy so all blocks are co-resident) and each instruction
// splits its work into items that the blocks take in turn.
//
// Instructions (`LInstr`, 32 words; src/layer.rs builds them):
// - GEMM: out = act(A·Bᵀ + bias) + residual, A [M, K] (row stride lda), B a
//   weight [N, K]; tiles of 64 rows x 64 columns, K in chunks of 64 through
//   an 8-stage cp.async pipeline, split `splits` ways. A split tile's blocks
//   (all in one wave) meet on a per-tile counter and each sums a share of
//   the tile's rows over the f32 partials in split order (the same bits on
//   every call), then applies the epilogue.
// - NORM: LayerNorm / RmsNorm of x (+ residual), one warp per row held in
//   registers.
// - ATTENTION: the key-splitting attention (`attention_split_item`), one
//   item per 16 query rows of a (batch, head).
//
// Between instructions: __syncthreads, then thread 0 adds 1 to the barrier
// counter with release semantics and polls it with acquire loads until it
// reads (i + 1)·gridDim.x (~1.2 µs for 132 blocks, measured with empty
// instructions). The last block out resets the counter for the next launch.
// Data written by one instruction is read by later ones through L2
// (cp.async.cg, __ldcg, or plain loads after the acquire).
//
// An instruction may name weight bytes to prefetch into L2 (the weight of a
// later GEMM); on the H200 this measured no difference.
//
// Host checks (src/layer.rs): f16/bf16, K and N multiples of 64, lda and
// every pointer 16-byte aligned, norm rows a multiple of 8 and at most 2048
// wide, attention head dim a multiple of 16 up to 64.

#define LAYER_BM 64
#define LAYER_BN 64
#define LAYER_BK 64
#define LAYER_STAGES 8
#define LAYER_PITCH (LAYER_BK + 8)

#define LI_GEMM 1
#define LI_NORM 2
#define LI_ATTN 3

struct LGemm {
    const void* a; const void* b; const void* bias; const void* res; void* out; float* work; unsigned* cnt;
    i64 m; i64 n; i64 k; i64 lda; i64 act; i64 splits;
};
// LayerNorm (beta given) or RmsNorm of x (+ res) over rows of n columns.
struct LNorm {
    const void* x; const void* res; const void* gamma; const void* beta; void* out;
    i64 rows; i64 n; i64 rms; double eps;
};
struct LInstr {
    i64 kind; const char* pf; i64 pf_bytes; i64 pad;
    union { LGemm g; LNorm r; AttnP at; i64 words[28]; };
};
// times: RLX_LAYER_TRACE (null otherwise): n + 1 i64 slots for block 0's
// %globaltimer at the start of each instruction (after its barrier) and at
// the end, then 8 per instruction for a matmul's phases (`det` in
// layer_gemm) and block 0's own end; block 0 prints both after each launch.
struct LayerP { const LInstr* prog; i64 n; unsigned* bar; i64 hdp; i64* times; };

__device__ __forceinline__ i64 layer_clock() {
    i64 t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned layer_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void layer_barrier(unsigned* bar, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        // Release: this block's writes (ordered before by the barrier above)
        // are visible to whoever acquires the count.
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(bar) : "memory");
        while (layer_ld_acquire(bar) < target) {
        }
    }
    __syncthreads();
}

// This block's share of `bytes` at `p`, 128-byte lines into L2.
__device__ __forceinline__ void layer_prefetch(const char* p, i64 bytes) {
    if (!p || bytes <= 0) return;
    const i64 lines = (bytes + 127) / 128;
    for (i64 l = (i64)blockIdx.x * blockDim.x + threadIdx.x; l < lines; l += (i64)gridDim.x * blockDim.x)
        asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(p + l * 128));
}

// det (RLX_LAYER_TRACE, block 0 only): %globaltimer when the first item's
// first chunk landed, its main loop ended, its split tile met, its epilogue ended.
template <typename T>
__device__ void layer_gemm(const LGemm& p, unsigned char* smem, i64* det) {
    typedef unsigned short u16;
    constexpr int BM = LAYER_BM, BN = LAYER_BN, BK = LAYER_BK, S = LAYER_STAGES, P = LAYER_PITCH;
    u16* const sa = (u16*)smem;
    u16* const sb = sa + S * BM * P;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp & 1, wn = warp >> 1;  // warp tile: rows 32 wm.., columns 32 wn..
    const i64 tiles_m = (p.m + BM - 1) / BM, tiles_n = p.n / BN;
    const int chunks = (int)(p.k / BK);
    const int splits = (int)p.splits;
    const i64 items = tiles_m * tiles_n * splits;
    const u16* A = (const u16*)p.a;
    const u16* B = (const u16*)p.b;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {
        const int split = (int)(item % splits);
        const i64 tile = item / splits;
        const i64 m0 = tile / tiles_n * BM, n0 = tile % tiles_n * BN;
        const int c0 = split * chunks / splits, c1 = (split + 1) * chunks / splits;
        const int nc = c1 - c0;
        // Each thread copies 4 16-byte pieces of the A tile and 4 of the B tile:
        // rows tid/8 + 16 i, column (tid % 8)·8.
        const int cr = tid >> 3, cc = (tid & 7) * 8;
        auto load = [&](int c, int stage) {
            const i64 k0 = (i64)(c0 + c) * BK + cc;
            u16* da = sa + stage * BM * P;
            u16* db = sb + stage * BN * P;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = cr + 16 * i;
                const bool in = m0 + r < p.m;
                cp_async16(da + r * P + cc, in ? A + (m0 + r) * p.lda + k0 : A, in);
                cp_async16(db + r * P + cc, B + (n0 + r) * p.k + k0, true);
            }
        };
        __syncthreads();  // the previous item (or instruction) is done with the stages
#pragma unroll
        for (int s = 0; s < S - 1; ++s) {
            if (s < nc) load(s, s);
            cp_async_commit();
        }
        float acc[2][4][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
        for (int c = 0; c < nc; ++c) {
            cp_async_wait<S - 2>();
            __syncthreads();
            if (det && c == 0 && tid == 0 && item == blockIdx.x) det[0] = layer_clock();
            if (c + S - 1 < nc) load(c + S - 1, (c + S - 1) % S);
            cp_async_commit();
            const u16* ta = sa + (c % S) * BM * P;
            const u16* tb = sb + (c % S) * BN * P;
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) {
                unsigned af[2][4], bf[2][4];
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    ldsm_x4(af[i], ta + (wm * 32 + i * 16 + (lane & 15)) * P + ks * 16 + (lane >> 4) * 8);
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    ldsm_x4(bf[j], tb + (wn * 32 + j * 16 + (lane & 7) + ((lane >> 4) << 3)) * P + ks * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) Mma<T>::run(acc[i][j], af[i], bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);
            }
        }
        cp_async_wait<0>();
        if (det && tid == 0 && item == blockIdx.x) det[1] = layer_clock();
        // Fragment (i, j): rows 32 wm + 16 i + g (+8), columns 32 wn + 8 j + 2t (+1)
        // of the tile. Each block runs this code once per item (not once per
        // launch as a small kernel's blocks would): it is kept compact, one
        // short loop for both paths, because cold instruction fetches of an
        // unrolled epilogue cost more than its arithmetic (session 6 trace: a
        // 16x unrolled erf-GELU epilogue took 10.8 µs).
        // The tile (this split's partial, or the whole sum) goes to f32
        // [BM][BN + 4] in shared memory, over the pipeline stages.
        constexpr int TP = BN + 4;
        float* const tile_s = (float*)smem;
        __syncthreads();  // every warp is done reading the stages
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int lr = wm * 32 + i * 16 + g + 8 * hi, lc = wn * 32 + j * 8 + 2 * t;
                    *(float2*)(tile_s + lr * TP + lc) = make_float2(acc[i][j][2 * hi], acc[i][j][2 * hi + 1]);
                }
        __syncthreads();
        int r0 = 0, r1 = BM;
        const float* base = nullptr;
        i64 sstride = 0;
        if (splits > 1) {
            // Split-K (all splits of a tile run at once: the host keeps the
            // items within one wave). Each split's partial tile goes to `work`
            // ([split][tile][64][64] f32); the tile's blocks wait for each other
            // on the tile's counter, then block `split` sums rows
            // [split·64/S, (split+1)·64/S) over every split in split order (the
            // same bits on every call) and applies the epilogue. A second
            // count-up lets the last block out reset the counter.
            base = p.work + tile * (BM * BN);
            sstride = tiles_m * tiles_n * (BM * BN);
            float* const part = p.work + ((i64)split * tiles_m * tiles_n + tile) * (BM * BN);
#pragma unroll 1
            for (int e = tid; e < BM * BN / 4; e += blockDim.x) {
                const int lr = e / (BN / 4), lc = (e % (BN / 4)) * 4;
                __stcg((float4*)(part + lr * BN + lc), *(const float4*)(tile_s + lr * TP + lc));
            }
            __syncthreads();
            if (tid == 0) {
                asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(p.cnt + tile) : "memory");
                while (layer_ld_acquire(p.cnt + tile) < (unsigned)splits) {
                }
            }
            __syncthreads();
            if (det && tid == 0 && item == blockIdx.x) det[2] = layer_clock();
            r0 = split * BM / splits;
            r1 = (split + 1) * BM / splits;
        }
        // Thread -> 4 columns (a float4) of a row, rows r0.. in turn.
#pragma unroll 1
        for (int e = tid; e < (r1 - r0) * (BN / 4); e += blockDim.x) {
            const int lr = r0 + e / (BN / 4), lc = (e % (BN / 4)) * 4;
            const i64 row = m0 + lr, col = n0 + lc;
            if (row >= p.m) continue;
            float4 sum;
            if (base) {
                sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
                for (int sp = 0; sp < splits; ++sp) {
                    const float4 v = __ldcg((const float4*)(base + sp * sstride + lr * BN + lc));
                    sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
                }
            } else {
                sum = *(const float4*)(tile_s + lr * TP + lc);
            }
            const uint2 braw = p.bias ? *(const uint2*)((const T*)p.bias + col) : make_uint2(0u, 0u);
            const uint2 rraw = p.res ? *(const uint2*)((const T*)p.res + row * p.n + col) : make_uint2(0u, 0u);
            const T* bv = (const T*)&braw;
            const T* rv = (const T*)&rraw;
            float x[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll 1
            for (int c = 0; c < 4; ++c) {
                float v = x[c] + ld(bv, c);  // zero without a bias
                if (p.act) v = act_call<T>(p.act, v);
                x[c] = v + ld(rv, c);        // zero without a residual
            }
            *(uint2*)((T*)p.out + row * p.n + col) = make_uint2(pack2<T>(x[0], x[1]), pack2<T>(x[2], x[3]));
        }
        if (base && tid == 0) {
            unsigned old;
            asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(p.cnt + tile) : "memory");
            if (old == 2u * (unsigned)splits - 1) atomicExch(p.cnt + tile, 0u);
        }
        if (det && tid == 0 && item == blockIdx.x) det[3] = layer_clock();
    }
}

// LayerNorm / RmsNorm: one warp per row, the row in registers (NV vectors
// of 8 per lane, instantiated per width so that only the code a row needs is
// fetched), every load of a row issued before the first use.
template <typename T, int NV>
__device__ void layer_norm(const LNorm& p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int nv = (int)(p.n / 8);
    uint4 rg[NV], rb[NV];
    norm_warp_params<NV>(p.gamma, p.beta, nv, lane, rg, rb);
    for (i64 row = (i64)blockIdx.x * nw + warp; row < p.rows; row += (i64)gridDim.x * nw) {
        norm_warp_row<T, NV>((const uint4*)p.x + row * nv, p.res ? (const uint4*)p.res + row * nv : nullptr, rg, rb, p.beta != nullptr,
                             (uint4*)p.out + row * nv, nv, 1.0f / (float)p.n, p.rms != 0, (float)p.eps, lane);
    }
}

template <typename T, int HDP>
__device__ void layer_attention(const AttnP& p, unsigned char* smem) {
    const i64 rblocks = (p.q_len + 15) / 16;
    const i64 items = p.batch * p.heads * rblocks;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {
        const i64 rb = item % rblocks, bh = item / rblocks;
        __syncthreads();
        attention_split_item<T, HDP>(p, bh / p.heads, bh % p.heads, rb, smem, item == 0 && threadIdx.x == 0);
    }
}

template <typename T>
__device__ void layer_program(const LayerP& p) {
    extern __shared__ __align__(16) unsigned char layer_smem[];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Wait for the previous kernel; dependents are not released early (they
    // could take the SMs that blocks of this grid still need).
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    const bool trace = p.times && blockIdx.x == 0 && threadIdx.x == 0;
    for (i64 i = 0; i < p.n; ++i) {
        const LInstr* ins = p.prog + i;
        if (trace) p.times[i] = layer_clock();
        layer_prefetch(ins->pf, ins->pf_bytes);
        switch (ins->kind) {
            case LI_GEMM: {
                const LGemm g = ins->g;
                layer_gemm<T>(g, layer_smem, trace ? p.times + (p.n + 1) + 8 * i : nullptr);
                break;
            }
            case LI_NORM: {
                const LNorm r = ins->r;
                const i64 nvl = (r.n / 8 + 31) / 32;
                if (nvl <= 1) layer_norm<T, 1>(r);
                else if (nvl == 2) layer_norm<T, 2>(r);
                else if (nvl == 3) layer_norm<T, 3>(r);
                else if (nvl == 4) layer_norm<T, 4>(r);
                else layer_norm<T, 8>(r);
                break;
            }
            case LI_ATTN: {
                const AttnP at = ins->at;
                if (p.hdp == 32) layer_attention<T, 32>(at, layer_smem);
                else layer_attention<T, 64>(at, layer_smem);
                break;
            }
            default: break;
        }
        if (trace) p.times[(p.n + 1) + 8 * i + 4] = layer_clock();
        if (i + 1 < p.n) layer_barrier(p.bar, (unsigned)((i + 1) * gridDim.x));
    }
    __syncthreads();
    if (trace) {
        p.times[p.n] = layer_clock();
        printf("layer-trace %d instructions, ns:", (int)p.n);
        for (i64 i = 0; i < p.n; ++i) printf(" %d:%d", (int)p.prog[i].kind, (int)(p.times[i + 1] - p.times[i]));
        printf("\n");
        // Matmuls, µs from the instruction's start (block 0's first item):
        // first chunk landed / main loop done / split tile met / epilogue done / block done.
        printf("layer-gemm us:");
        for (i64 i = 0; i < p.n; ++i) {
            if (p.prog[i].kind != LI_GEMM) continue;
            const i64* d = p.times + (p.n + 1) + 8 * i;
            const i64 t0 = p.times[i];
            printf(" [%d s%d: %.2f %.2f %.2f %.2f %.2f]", (int)i, (int)p.prog[i].g.splits, (d[0] - t0) * 1e-3, (d[1] - t0) * 1e-3,
                   d[2] ? (d[2] - t0) * 1e-3 : 0.0, (d[3] - t0) * 1e-3, (d[4] - t0) * 1e-3);
        }
        printf("\n");
    }
    // The last block out resets the counter (every block has left every wait).
    if (threadIdx.x == 0) {
        const unsigned total = (unsigned)(p.n * gridDim.x);
        if (atomicAdd(p.bar, 1u) == total - 1) atomicExch(p.bar, 0u);
    }
}

extern "C" __global__ void __launch_bounds__(128) layer_program_f16(const LayerP p) { layer_program<__half>(p); }
extern "C" __global__ void __launch_bounds__(128) layer_program_bf16(const LayerP p) { layer_program<__nv_bfloat16>(p); }
