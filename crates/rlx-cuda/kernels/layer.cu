// The layer program: one persistent kernel that runs a run of consecutive
// thunks (matmuls, attention, norms; whole encoder layers at batch 1) as a
// list of instructions, with a grid-wide barrier between instructions
// instead of a kernel boundary. Compiled appended to attention_mma.cu (one
// module: it calls `attention_split_item`).
//
// Why: at a few hundred rows every kernel of a layer is latency-bound;
// inside a CUDA graph each boundary still costs ~1.3 µs of launch plus the
// ramp and tail of the next grid (../shared/PERF.md, bench/gpu-perf.md). Here
// the grid stays resident: one block per slot of `gridDim.x`, all
// co-resident (the host sizes the grid from the occupancy), and each
// instruction splits its work into items that the blocks take in turn.
//
// Instructions (`LInstr`, 32 words; src/layer.rs builds them):
// - GEMM: out = act(A·Bᵀ + bias) + residual, A [M, K] (row stride lda), B a
//   weight [N, K]; tiles of 64 rows x 64 columns, K in chunks of 64 split
//   `splits` ways. With splits = 1 the epilogue is applied in the tile;
//   otherwise each split writes an f32 partial tile to `work` and a ROWS
//   instruction sums them (in split order: the same bits on every call).
// - ROWS: one warp per row: v = act(Σ partials + bias) + residual (or
//   x + residual for a plain norm), rounded to the storage type and stored
//   to `y` when given; then optionally LayerNorm / RmsNorm of v into `out`
//   (the rounded v, as the unfused kernels would see it).
// - ATTENTION: the key-splitting attention (`attention_split_item`), one
//   item per 16 query rows of a (batch, head).
//
// Between instructions: __syncthreads, then thread 0 publishes the block's
// writes (fence) and adds 1 to the barrier counter and waits until it
// reads (i + 1)·gridDim.x (acquire). The last block to finish resets the
// counter to 0 for the next launch. Data written by one instruction is read
// by later ones only through L2 (cp.async.cg, or plain loads after the
// acquire).
//
// Each instruction may name weight bytes to prefetch into L2 (the weight of
// a later GEMM), which then streams from L2 instead of HBM.
//
// Host checks (src/layer.rs): f16/bf16, K and N multiples of 64, lda and
// every pointer 16-byte aligned, row widths a multiple of 8 and at most
// what the row buffer holds, attention head dim 32 or 64 (multiple of 16).

#define LAYER_BM 64
#define LAYER_BN 64
#define LAYER_BK 64
#define LAYER_STAGES 4
#define LAYER_PITCH (LAYER_BK + 8)

#define LI_GEMM 1
#define LI_ROWS 2
#define LI_ATTN 3

struct LGemm {
    const void* a; const void* b; const void* bias; const void* res; void* out; float* work;
    i64 m; i64 n; i64 k; i64 lda; i64 act; i64 splits;
};
struct LRows {
    const float* work; const void* x; const void* bias; const void* res; void* y;
    const void* gamma; const void* beta; void* out;
    i64 rows; i64 n; i64 splits; i64 act; i64 norm; i64 rms; double eps; const void* nres;
};
struct LInstr {
    i64 kind; const char* pf; i64 pf_bytes; i64 pad;
    union { LGemm g; LRows r; AttnP at; i64 words[28]; };
};
struct LayerP { const LInstr* prog; i64 n; unsigned* bar; i64 hdp; };

__device__ __forceinline__ unsigned layer_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void layer_barrier(unsigned* bar, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        while (layer_ld_acquire(bar) < target) {
        }
        __threadfence();
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

template <typename T>
__device__ void layer_gemm(const LGemm& p, unsigned char* smem) {
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
        // Fragment (i, j): rows m0 + 32 wm + 16 i + g (+8), columns n0 + 32 wn + 8 j + 2t (+1).
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
                const i64 row = m0 + wm * 32 + i * 16 + g + 8 * hi;
                if (row >= p.m) continue;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const i64 col = n0 + wn * 32 + j * 8 + 2 * t;
                    float x0 = acc[i][j][2 * hi], x1 = acc[i][j][2 * hi + 1];
                    if (splits > 1) {
                        *(float2*)(p.work + ((i64)split * p.m + row) * p.n + col) = make_float2(x0, x1);
                        continue;
                    }
                    if (p.bias) {
                        x0 += ld((const T*)p.bias, col);
                        x1 += ld((const T*)p.bias, col + 1);
                    }
                    if (p.act) {
                        x0 = act_t<T>(p.act, x0);
                        x1 = act_t<T>(p.act, x1);
                    }
                    if (p.res) {
                        x0 += ld((const T*)p.res, row * p.n + col);
                        x1 += ld((const T*)p.res, row * p.n + col + 1);
                    }
                    *(unsigned*)((T*)p.out + row * p.n + col) = pack2<T>(x0, x1);
                }
            }
        }
    }
}

// One warp per row; the row's values stay in shared memory (`row_buf`,
// n floats per warp) between the passes.
template <typename T>
__device__ void layer_rows(const LRows& p, float* row_buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float* v = row_buf + warp * p.n;
    const int nv = (int)(p.n / 8);
    const float inv_n = 1.0f / (float)p.n;
    for (i64 row = (i64)blockIdx.x * nw + warp; row < p.rows; row += (i64)gridDim.x * nw) {
        float s = 0.0f;
        for (int c = lane; c < nv; c += 32) {
            float x[8];
            if (p.work) {
#pragma unroll
                for (int e = 0; e < 8; ++e) x[e] = 0.0f;
                for (int sp = 0; sp < (int)p.splits; ++sp) {
                    const float4* w = (const float4*)(p.work + ((i64)sp * p.rows + row) * p.n + c * 8);
                    const float4 a = w[0], b = w[1];
                    x[0] += a.x; x[1] += a.y; x[2] += a.z; x[3] += a.w;
                    x[4] += b.x; x[5] += b.y; x[6] += b.z; x[7] += b.w;
                }
                if (p.bias) {
                    float bb[8];
                    Vec16<T>::load(((const uint4*)p.bias)[c], bb);
#pragma unroll
                    for (int e = 0; e < 8; ++e) x[e] += bb[e];
                }
                if (p.act) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) x[e] = act_t<T>(p.act, x[e]);
                }
            } else {
                Vec16<T>::load(((const uint4*)p.x)[row * nv + c], x);
            }
            if (p.res) {
                float r[8];
                Vec16<T>::load(((const uint4*)p.res)[row * nv + c], r);
#pragma unroll
                for (int e = 0; e < 8; ++e) x[e] += r[e];
            }
            // Rounded to the storage type, as the tensor between the two ops is.
            const uint4 packed = Vec16<T>::store(x);
            if (p.y) ((uint4*)p.y)[row * nv + c] = packed;
            if (p.norm) {
                Vec16<T>::load(packed, x);
                if (p.nres) {
                    float r[8];
                    Vec16<T>::load(((const uint4*)p.nres)[row * nv + c], r);
#pragma unroll
                    for (int e = 0; e < 8; ++e) x[e] += r[e];
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    v[c * 8 + e] = x[e];
                    s += x[e];
                }
            }
        }
        if (!p.norm) continue;
        __syncwarp();  // every lane's v values are in shared memory
        const float mean = p.rms ? 0.0f : warp_sum(s) * inv_n;
        float s2 = 0.0f;
        for (int c = lane; c < nv * 8; c += 32) {
            const float d = v[c] - mean;
            s2 += d * d;
        }
        const float rstd = rsqrtf(warp_sum(s2) * inv_n + (float)p.eps);
        for (int c = lane; c < nv; c += 32) {
            float gm[8], bt[8], o[8];
            Vec16<T>::load(((const uint4*)p.gamma)[c], gm);
            if (p.beta) Vec16<T>::load(((const uint4*)p.beta)[c], bt);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                o[e] = (v[c * 8 + e] - mean) * rstd * gm[e];
                if (p.beta) o[e] += bt[e];
            }
            ((uint4*)p.out)[row * nv + c] = Vec16<T>::store(o);
        }
        __syncwarp();
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
    for (i64 i = 0; i < p.n; ++i) {
        const LInstr* ins = p.prog + i;
        layer_prefetch(ins->pf, ins->pf_bytes);
        switch (ins->kind) {
            case LI_GEMM: {
                const LGemm g = ins->g;
                layer_gemm<T>(g, layer_smem);
                break;
            }
            case LI_ROWS: {
                const LRows r = ins->r;
                layer_rows<T>(r, (float*)layer_smem);
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
        if (i + 1 < p.n) layer_barrier(p.bar, (unsigned)((i + 1) * gridDim.x));
    }
    // The last block out resets the counter (every block has left every wait).
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned total = (unsigned)(p.n * gridDim.x);
        if (atomicAdd(p.bar, 1u) == total - 1) atomicExch(p.bar, 0u);
    }
}

extern "C" __global__ void __launch_bounds__(128) layer_program_f16(const LayerP p) { layer_program<__half>(p); }
extern "C" __global__ void __launch_bounds__(128) layer_program_bf16(const LayerP p) { layer_program<__nv_bfloat16>(p); }
