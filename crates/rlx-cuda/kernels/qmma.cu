// Matmuls over block-quantized weights on tensor cores, for two and more
// activation rows (prompt prefill, batched decode): out = a · dequant(w)ᵀ
// with decode.cu's contract and fused forms (QMatMulP in quant.cuh), on
// mma.sync m16n8k16. The weights are the A operand (16 output columns a
// fragment), the activation rows the B operand (8 rows a fragment), both
// rounded to 16 bits (f16; bf16 when the activations are bf16), products
// summed in f32.
//
// Nothing is staged in shared memory. An mma's order along k is free as
// long as A and B agree, so lane (g, t) (lane = 4g + t) takes chunk t of
// each 32 weights (8 weights, dequant8's chunk of a block) for columns g
// and g + 8, and the same 8 activation elements for rows g of its
// fragments; the 8 fill its fragment slots k = 2t, 2t+1, 2t+8, 2t+9 of two
// k16 steps. A weight is decoded once per 8·NF rows. For 32-element
// formats a warp loads its next block's bytes before it works on the
// current one, so weights are always in flight.
//
// A block of QMMA_WARPS warps owns 16 columns and 8·NF rows; its warps
// split k (32-element groups dealt round-robin) and add their partial tiles
// through shared memory in a fixed order, so results do not depend on
// timing. Warp 0 applies the fused norm, gate and residual and stores.
#include "quant.cuh"

#define QMMA_WARPS 8

// Four consecutive activations from `p` (aligned to 4 elements when `vec`).
__device__ __forceinline__ void ld4(const float* p, bool vec, float* v) {
    if (vec) {
        const float4 q = *(const float4*)p;
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = p[i];
    }
}
template <typename H>
__device__ __forceinline__ void ld4(const H* p, bool vec, float* v) {
    if (vec) {
        const uint2 q = *(const uint2*)p;
        const H* h = (const H*)&q;
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = to_f32(h[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = to_f32(p[i]);
    }
}

// The A fragments of two k16 steps from 8 decoded weights of column g (lo)
// and of column g + 8 (hi): step s takes weights 4s..4s+3 into slots 2t,
// 2t+1 (a0 lo, a1 hi) and 2t+8, 2t+9 (a2 lo, a3 hi).
template <typename M>
__device__ __forceinline__ void a_frags(const float* lo, const float* hi, unsigned (&a)[2][4]) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        a[s][0] = Mma<M>::pack(lo[4 * s], lo[4 * s + 1]);
        a[s][1] = Mma<M>::pack(hi[4 * s], hi[4 * s + 1]);
        a[s][2] = Mma<M>::pack(lo[4 * s + 2], lo[4 * s + 3]);
        a[s][3] = Mma<M>::pack(hi[4 * s + 2], hi[4 * s + 3]);
    }
}

template <typename T, int F, int NF>
__device__ void qmma_body(const QMatMulP& p) {
    typedef typename MmaIn<T>::type M;
    constexpr int BE = QFmt<F>::BE, BB = QFmt<F>::BB, SUBS = BE / 32;
    // Every format but Q6_K puts a chunk's 8 elements in two runs of 4.
    constexpr bool RUNS = F != QF_Q6K;
    __shared__ float parts[QMMA_WARPS - 1][2][NF][4][32];
    __shared__ float sumsq[QMMA_WARPS][8 * NF];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    // No columns: nothing to read (the clamp below needs a column 0).
    if (p.n <= 0) return;
    const bool norm = p.gamma != nullptr, glu = p.glu != 0;
    const i64 col0 = (i64)blockIdx.x * 16;
    const i64 c_lo = col0 + g, c_hi = col0 + g + 8;
    const bool v_lo = c_lo < p.n, v_hi = c_hi < p.n;
    // Columns past n read column n - 1 (in bounds) and are zeroed.
    const u8* w_lo = (const u8*)p.w + (v_lo ? c_lo : p.n - 1) * p.row_bytes;
    const u8* w_hi = (const u8*)p.w + (v_hi ? c_hi : p.n - 1) * p.row_bytes;
    const i64 up = p.n * p.row_bytes;
    const T* x = (const T*)p.a;
    const T* gamma = (const T*)p.gamma;
    const int align = sizeof(T) == 4 ? 16 : 8;
    const bool vec = RUNS && ((unsigned long long)p.a % align) == 0 && (p.lda & 3) == 0;
    const i64 groups = p.k / 32;
    for (i64 row0 = (i64)blockIdx.y * 8 * NF; row0 < p.rows; row0 += (i64)gridDim.y * 8 * NF) {
        float acc[NF][4], acc2[NF][4], ss[NF];
#pragma unroll
        for (int f = 0; f < NF; ++f) {
            ss[f] = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[f][i] = acc2[f][i] = 0.0f;
        }
        // One group's mma steps: the A fragments (a; u for the up half) of
        // its weights, whose elements sit at base + e[i].
        auto rows_step = [&](i64 base, const int* e, const unsigned (&a)[2][4], const unsigned (&u)[2][4]) {
            float gm[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) gm[i] = norm ? ld(gamma, base + e[i]) : 1.0f;
#pragma unroll
            for (int f = 0; f < NF; ++f) {
                const i64 r = row0 + 8 * f + g;
                float xv[8];
                if (r < p.rows) {
                    const T* xr = x + r * p.lda + base;
                    if (RUNS) {
                        ld4(xr + e[0], vec, xv);
                        ld4(xr + e[4], vec, xv + 4);
                    } else {
#pragma unroll
                        for (int i = 0; i < 8; ++i) xv[i] = ld(xr, e[i]);
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 8; ++i) xv[i] = 0.0f;
                }
                if (norm) {
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        ss[f] = fmaf(xv[i], xv[i], ss[f]);
                        xv[i] *= gm[i];
                    }
                }
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const unsigned b0 = Mma<M>::pack(xv[4 * s], xv[4 * s + 1]), b1 = Mma<M>::pack(xv[4 * s + 2], xv[4 * s + 3]);
                    Mma<M>::run(acc[f], a[s], b0, b1);
                    if (glu) Mma<M>::run(acc2[f], u[s], b0, b1);
                }
            }
        };
        // Decoded weights of columns g (lo) and g + 8 (hi) into fragments,
        // zeros for columns past n.
        auto frags = [&](float* lo, float* hi, unsigned (&a)[2][4]) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                lo[i] = v_lo ? lo[i] : 0.0f;
                hi[i] = v_hi ? hi[i] : 0.0f;
            }
            a_frags<M>(lo, hi, a);
        };
        if constexpr (BE == 32) {
            // A 32-element group is one block: the next group's block bytes
            // are loaded before this group's math, so a warp always has a
            // group's weights in flight.
            QRaw cur[4], nxt[4];
            auto fetch = [&](i64 gi, QRaw (&r)[4]) {
                r[0] = qraw<F>(w_lo + gi * BB, t);
                r[1] = qraw<F>(w_hi + gi * BB, t);
                if (glu) {
                    r[2] = qraw<F>(w_lo + up + gi * BB, t);
                    r[3] = qraw<F>(w_hi + up + gi * BB, t);
                }
            };
            if (warp < groups) fetch(warp, cur);
            for (i64 gi = warp; gi < groups; gi += QMMA_WARPS) {
                if (gi + QMMA_WARPS < groups) fetch(gi + QMMA_WARPS, nxt);
                float lo[8], hi[8];
                int e[8];
                unsigned a[2][4], u[2][4];
                qdecode<F>(cur[0], t, lo, e);
                qdecode<F>(cur[1], t, hi, e);
                frags(lo, hi, a);
                if (glu) {
                    qdecode<F>(cur[2], t, lo, e);
                    qdecode<F>(cur[3], t, hi, e);
                    frags(lo, hi, u);
                }
                rows_step(gi * BE, e, a, u);
#pragma unroll
                for (int j = 0; j < 4; ++j) cur[j] = nxt[j];
            }
        } else {
            for (i64 gi = warp; gi < groups; gi += QMMA_WARPS) {
                const i64 blk = gi / SUBS;
                const int part = (int)(gi % SUBS) * 4 + t;
                float lo[8], hi[8];
                int e[8];
                unsigned a[2][4], u[2][4];
                dequant8<F>(w_lo + blk * BB, part, lo, e);
                dequant8<F>(w_hi + blk * BB, part, hi, e);
                frags(lo, hi, a);
                if (glu) {
                    dequant8<F>(w_lo + up + blk * BB, part, lo, e);
                    dequant8<F>(w_hi + up + blk * BB, part, hi, e);
                    frags(lo, hi, u);
                }
                rows_step(blk * BE, e, a, u);
            }
        }
        // Row sums of squares: lanes 4g..4g+3 hold row g's four chunks.
#pragma unroll
        for (int f = 0; f < NF; ++f) {
            ss[f] += __shfl_xor_sync(0xffffffffu, ss[f], 1);
            ss[f] += __shfl_xor_sync(0xffffffffu, ss[f], 2);
            if (t == 0) sumsq[warp][8 * f + g] = ss[f];
        }
        if (warp > 0) {
#pragma unroll
            for (int f = 0; f < NF; ++f)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    parts[warp - 1][0][f][i][lane] = acc[f][i];
                    if (glu) parts[warp - 1][1][f][i][lane] = acc2[f][i];
                }
        }
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int f = 0; f < NF; ++f) {
                float inv[2] = {1.0f, 1.0f};
                if (norm) {
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        float s = 0.0f;
#pragma unroll
                        for (int w = 0; w < QMMA_WARPS; ++w) s += sumsq[w][8 * f + 2 * t + j];
                        // 1/sqrt(mean(x²) + eps), the RmsNorm kernel's formula.
                        inv[j] = rsqrtf(s / (float)p.k + (float)p.eps);
                    }
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    float s = acc[f][i], v = acc2[f][i];
#pragma unroll
                    for (int w = 0; w < QMMA_WARPS - 1; ++w) {
                        s += parts[w][0][f][i][lane];
                        if (glu) v += parts[w][1][f][i][lane];
                    }
                    // c0, c1: column g, rows 2t, 2t+1; c2, c3: column g + 8.
                    const i64 col = i < 2 ? c_lo : c_hi, row = row0 + 8 * f + 2 * t + (i & 1);
                    s *= inv[i & 1];
                    if (glu) {
                        v *= inv[i & 1];
                        s = s / (1.0f + expf(-s)) * v;
                    }
                    if (col < p.n && row < p.rows) {
                        const i64 o = row * p.n + col;
                        if (p.res) s += ld((const T*)p.res, o);
                        st((T*)p.out, o, s);
                    }
                }
            }
        }
        __syncthreads();
    }
}

// qmma_<format>_r<8·NF>_<dtype>: QMMA_WARPS·32 threads, grid (n / 16, rows / (8·NF)).
#define RLX_QMMA(FN, F, NF, R)                                                                                                        \
    extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32) qmma_##FN##_r##R##_f32(const QMatMulP p) {                          \
        pdl_enter();                                                                                                                  \
        qmma_body<float, F, NF>(p);                                                                                                   \
    }                                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32) qmma_##FN##_r##R##_f16(const QMatMulP p) {                          \
        pdl_enter();                                                                                                                  \
        qmma_body<__half, F, NF>(p);                                                                                                  \
    }                                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(QMMA_WARPS * 32) qmma_##FN##_r##R##_bf16(const QMatMulP p) {                         \
        pdl_enter();                                                                                                                  \
        qmma_body<__nv_bfloat16, F, NF>(p);                                                                                           \
    }
#define RLX_QMMA_FMT(FN, F) RLX_QMMA(FN, F, 1, 8) RLX_QMMA(FN, F, 4, 32)
// Parts (IN_PART): Q4_0 and Q4_1; Q5_0 and Q5_1; Q8_0, Q4_K and Q6_K.
#if IN_PART(0)
RLX_QMMA_FMT(q4_0, QF_Q4_0)
RLX_QMMA_FMT(q4_1, QF_Q4_1)
#endif
#if IN_PART(1)
RLX_QMMA_FMT(q5_0, QF_Q5_0)
RLX_QMMA_FMT(q5_1, QF_Q5_1)
#endif
#if IN_PART(2)
RLX_QMMA_FMT(q8_0, QF_Q8_0)
RLX_QMMA_FMT(q4_k, QF_Q4K)
RLX_QMMA_FMT(q6_k, QF_Q6K)
#endif
