// Matmuls over block-quantized weights for many activation rows (a long
// prompt, or many prompts prefilled side by side): out = a · dequant(w)ᵀ
// with decode.cu's contract and fused forms (QMatMulP in quant.cuh), on
// mma.sync m16n8k16 from shared-memory tiles.
//
// qmma.cu reads both operands straight from global memory, which suits a
// few rows; over thousands of rows it re-reads every activation once per
// 16 columns and decodes every weight once per 32 rows. Here a block owns
// a tile of QG_BM rows × 64 columns (with the gate, 64 gate and the same 64
// up columns) and walks k one 32-element group at a time: its threads
// stage the group's activations (normed by gamma, rounded to 16 bits) and
// its decoded weights in shared memory, and the warps run their mma steps
// from there with ldmatrix. The next group's global loads are issued
// before the current group's mma steps, into registers, and stored into
// the other of two shared buffers after them: one barrier a group.
//
// A group is 32 elements of one quant block, as qmma.cu deals them: for
// 32-element formats the block itself; for K-quants the 32 elements that
// dequant8's parts 4s..4s+3 of sub-group s cover (four runs of 8, see
// `run_start`). Its shared-memory column is `kcol`. The mma steps' order
// along k is free as long as both operands agree.
//
// 8 warps: QG_BM / 32 along the rows, 8 / (QG_BM / 32) along the columns;
// a warp's tile is 32 rows × (64 / warps along the columns) columns.
#include "quant.cuh"

#define QG_THREADS 256
// Blocks an SM must fit (registers permitting): __launch_bounds__'s second
// argument.
#ifndef QG_MINB
#define QG_MINB 1
#endif
#define QG_BN 64
// A shared row: 32 elements and 8 of padding (80 bytes), so the 8 rows an
// ldmatrix phase reads fall in distinct banks and rows stay 16-byte aligned.
#define QG_LD 40

// The absolute k of run r (0..3, 8 elements each) of group gi.
template <int F>
__device__ __forceinline__ i64 run_start(i64 gi, int r) {
    if (QFmt<F>::BE == 32) return 32 * gi + 8 * r;
    const i64 blk = gi >> 3;
    const int s = (int)(gi & 7);
    if (F == QF_Q4K) return 256 * blk + 64 * (s >> 1) + 16 * (s & 1) + 32 * (r >> 1) + 8 * (r & 1);
    return 256 * blk + 128 * (s >> 2) + 8 * (s & 3) + 32 * r;  // Q6_K
}

// The shared-memory column of a weight at offset e of its quant block.
template <int F>
__device__ __forceinline__ int kcol(int e) {
    if (QFmt<F>::BE == 32) return e;
    if (F == QF_Q4K) return (e & 15) + 16 * ((e >> 5) & 1);
    return (e & 7) + 8 * ((e >> 5) & 3);  // Q6_K
}

// Eight activations of row r from k0 (`vec`: one or two 16-byte loads).
template <typename T>
__device__ __forceinline__ void ld8(const T* x, bool vec, float* v) {
    if (vec) {
        if (sizeof(T) == 4) {
            const float4 a = ((const float4*)x)[0], b = ((const float4*)x)[1];
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else {
            const uint4 q = *(const uint4*)x;
            const T* h = (const T*)&q;
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = to_f32(h[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = to_f32(x[i]);
    }
}

template <typename T, int F, int BM>
__device__ void qgemm_body(const QMatMulP& p) {
    typedef typename MmaIn<T>::type M;
    constexpr int BE = QFmt<F>::BE, BB = QFmt<F>::BB, SUBS = BE / 32;
    constexpr int WM = BM / 32, WN = 8 / WM, WCOLS = QG_BN / WN, NF = WCOLS / 8;
    // Activations, gate weights, up weights; two buffers each.
    __shared__ __align__(16) M sa[2][BM][QG_LD];
    __shared__ __align__(16) M sw[2][2][QG_BN][QG_LD];
    __shared__ float inv[BM];
    if (p.n <= 0) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp % WM, wn = warp / WM;
    const bool norm = p.gamma != nullptr, glu = p.glu != 0;
    const T* x = (const T*)p.a;
    const T* gamma = (const T*)p.gamma;
    const i64 groups = p.k / 32;
    const i64 col0 = (i64)blockIdx.x * QG_BN;
    const i64 up = p.n * p.row_bytes;
    // Staging roles. Activations: BM rows × 4 runs of 8; a thread takes
    // BM·4/256 (row, run) pairs, the same every group. Weights: 64 columns
    // × 4 chunks (dequant8's parts), one per thread, and its up twin.
    constexpr int AP = BM * 4 / QG_THREADS;
    const int wc = tid >> 2, wpart = tid & 3;
    const bool wv = col0 + wc < p.n;
    const u8* wrow = (const u8*)p.w + (wv ? col0 + wc : p.n - 1) * p.row_bytes;
    // 16-byte loads of 8 activations (or gamma values) where aligned.
    const bool vec = ((unsigned long long)p.a % 16) == 0 && (p.lda * (i64)sizeof(T)) % 16 == 0;
    const bool gvec = ((unsigned long long)p.gamma % 16) == 0;
    for (i64 row0 = (i64)blockIdx.y * BM; row0 < p.rows; row0 += (i64)gridDim.y * BM) {
        float acc[2][NF][4], acc2[2][NF][4], ss[AP];
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int f = 0; f < NF; ++f)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[m][f][i] = acc2[m][f][i] = 0.0f;
#pragma unroll
        for (int j = 0; j < AP; ++j) ss[j] = 0.0f;

        // Global loads of group gi into registers: activations, and the
        // weight chunk's raw bytes (32-element formats; decoded at the
        // store) or its decoded values (K-quants).
        float xa[AP][8];
        QRaw rl, ru;
        float wl[8], wu[8];
        int we[8] = {};
        auto load = [&](i64 gi) {
#pragma unroll
            for (int j = 0; j < AP; ++j) {
                const int pr = tid + j * QG_THREADS, r = pr >> 2, run = pr & 3;
                const i64 row = row0 + r;
                if (row < p.rows) {
                    ld8(x + row * p.lda + run_start<F>(gi, run), vec, xa[j]);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) xa[j][i] = 0.0f;
                }
            }
            if constexpr (BE == 32) {
                rl = qraw<F>(wrow + gi * BB, wpart);
                if (glu) ru = qraw<F>(wrow + up + gi * BB, wpart);
            } else {
                const i64 blk = gi / SUBS;
                const int part = (int)(gi % SUBS) * 4 + wpart;
                dequant8<F>(wrow + blk * BB, part, wl, we);
                if (glu) dequant8<F>(wrow + up + blk * BB, part, wu, we);
            }
        };
        // Eight decoded weights into a shared row at their columns.
        auto put = [&](M* row, const float* w) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = wv ? w[i] : 0.0f;
            if (F != QF_Q6K) {
                // Two runs of 4 consecutive columns, each 4-aligned.
                *(uint2*)&row[kcol<F>(we[0])] = make_uint2(Mma<M>::pack(v[0], v[1]), Mma<M>::pack(v[2], v[3]));
                *(uint2*)&row[kcol<F>(we[4])] = make_uint2(Mma<M>::pack(v[4], v[5]), Mma<M>::pack(v[6], v[7]));
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) row[kcol<F>(we[i])] = (M)v[i];
            }
        };
        // The registers into shared buffer b (norm sums and gamma applied).
        auto store = [&](i64 gi, int b) {
#pragma unroll
            for (int j = 0; j < AP; ++j) {
                const int pr = tid + j * QG_THREADS, r = pr >> 2, run = pr & 3;
                float v[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) v[i] = xa[j][i];
                if (norm) {
                    float gm[8];
                    ld8(gamma + run_start<F>(gi, run), gvec, gm);
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        ss[j] = fmaf(v[i], v[i], ss[j]);
                        v[i] *= gm[i];
                    }
                }
                uint4 q;
                q.x = Mma<M>::pack(v[0], v[1]), q.y = Mma<M>::pack(v[2], v[3]);
                q.z = Mma<M>::pack(v[4], v[5]), q.w = Mma<M>::pack(v[6], v[7]);
                *(uint4*)&sa[b][r][8 * run] = q;
            }
            if constexpr (BE == 32) {
                qdecode<F>(rl, wpart, wl, we);
                if (glu) qdecode<F>(ru, wpart, wu, we);
            }
            put(&sw[b][0][wc][0], wl);
            if (glu) put(&sw[b][1][wc][0], wu);
        };

        if (groups > 0) {
            load(0);
            store(0, 0);
        }
        __syncthreads();
        for (i64 gi = 0; gi < groups; ++gi) {
            const int b = (int)(gi & 1);
            const bool more = gi + 1 < groups;
            if (more) load(gi + 1);
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                // A fragments of the warp's two 16-row tiles at k step s.
                unsigned af[2][4];
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const int r = wm * 32 + m * 16 + (lane & 15), c = 16 * s + 8 * (lane >> 4);
                    ldsm_x4(af[m], &sa[b][r][c]);
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (h == 1 && !glu) break;
                    // B fragments: ldmatrix x4 gives two 8-column tiles' (b0, b1).
#pragma unroll
                    for (int f2 = 0; f2 < NF; f2 += 2) {
                        unsigned bf[4];
                        const int cc = wn * WCOLS + f2 * 8 + (lane & 7) + 8 * (lane >> 4), kc = 16 * s + 8 * ((lane >> 3) & 1);
                        ldsm_x4(bf, &sw[b][h][cc][kc]);
#pragma unroll
                        for (int m = 0; m < 2; ++m) {
                            Mma<M>::run(h ? acc2[m][f2] : acc[m][f2], af[m], bf[0], bf[1]);
                            Mma<M>::run(h ? acc2[m][f2 + 1] : acc[m][f2 + 1], af[m], bf[2], bf[3]);
                        }
                    }
                }
            }
            if (more) store(gi + 1, b ^ 1);
            __syncthreads();
        }
        // Row norms: a row's four runs sit in four consecutive threads.
        if (norm) {
#pragma unroll
            for (int j = 0; j < AP; ++j) {
                float s = ss[j];
                s += __shfl_xor_sync(0xffffffffu, s, 1);
                s += __shfl_xor_sync(0xffffffffu, s, 2);
                const int pr = tid + j * QG_THREADS;
                // 1/sqrt(mean(x²) + eps), the RmsNorm kernel's formula.
                if ((pr & 3) == 0) inv[pr >> 2] = rsqrtf(s / (float)p.k + (float)p.eps);
            }
            __syncthreads();
        }
        // c0, c1: row g, columns 2t, 2t+1; c2, c3: row g + 8.
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int f = 0; f < NF; ++f)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = wm * 32 + m * 16 + g + 8 * (i >> 1);
                    const i64 row = row0 + r, col = col0 + wn * WCOLS + f * 8 + 2 * t + (i & 1);
                    float s = acc[m][f][i], v = acc2[m][f][i];
                    if (norm) {
                        s *= inv[r];
                        v *= inv[r];
                    }
                    if (glu) s = s / (1.0f + expf(-s)) * v;
                    if (col < p.n && row < p.rows) {
                        const i64 o = row * p.n + col;
                        if (p.res) s += ld((const T*)p.res, o);
                        st((T*)p.out, o, s);
                    }
                }
        // The next row tile's stores reuse the buffers.
        __syncthreads();
    }
}

// qgemm_<format>_m<BM>_<dtype>: QG_THREADS threads, grid (n / 64, rows / BM).
#define RLX_QGEMM(FN, F, BM)                                                                                                          \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, QG_MINB) qgemm_##FN##_m##BM##_f32(const QMatMulP p) {                            \
        pdl_enter();                                                                                                                  \
        qgemm_body<float, F, BM>(p);                                                                                                  \
    }                                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, QG_MINB) qgemm_##FN##_m##BM##_f16(const QMatMulP p) {                            \
        pdl_enter();                                                                                                                  \
        qgemm_body<__half, F, BM>(p);                                                                                                 \
    }                                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, QG_MINB) qgemm_##FN##_m##BM##_bf16(const QMatMulP p) {                           \
        pdl_enter();                                                                                                                  \
        qgemm_body<__nv_bfloat16, F, BM>(p);                                                                                          \
    }
#ifndef RLX_QGEMM_NO_INSTANCES
RLX_QGEMM(q4_0, QF_Q4_0, 128)
RLX_QGEMM(q4_1, QF_Q4_1, 128)
RLX_QGEMM(q5_0, QF_Q5_0, 128)
RLX_QGEMM(q5_1, QF_Q5_1, 128)
RLX_QGEMM(q8_0, QF_Q8_0, 128)
RLX_QGEMM(q4_k, QF_Q4K, 128)
RLX_QGEMM(q6_k, QF_Q6K, 128)
#endif
