// Kernels of the generation step on CUDA cores: matvecs (and matmuls of
// one row) and embedding gathers over block-quantized weights read as
// stored (quant.cuh), and integer arithmetic on positions. Bad indices
// never fault: they write zeros and raise a bit of the slot's error flag,
// which the host checks after the call.
#include "quant.cuh"

// Error flag bit of the integer ops (beside those in common.cuh); src/exec.rs
// turns it into a message.
#define ERR_INT_DIV_ZERO 16

// One element of a row (the gather's path): the block's chunk that holds
// it, decoded, and the element picked out.
__device__ float dequant1(const u8* row, i64 fmt, i64 j) {
    float w[8];
    int e[8];
#define RLX_DQ1(F)                                                                       \
    {                                                                                    \
        const i64 blk = j / QFmt<F>::BE;                                                 \
        const int r = (int)(j % QFmt<F>::BE);                                            \
        int part;                                                                        \
        if (QFmt<F>::BE == 32) part = F == QF_Q8_0 ? r / 8 : (r & 15) / 4;               \
        else if (F == QF_Q4K) part = 8 * (r / 64) + (r % 32) / 4;                        \
        else part = 16 * (r / 128) + (r % 32) / 2;                                       \
        dequant8<F>(row + blk * QFmt<F>::BB, part, w, e);                                \
        break;                                                                           \
    }
    switch (fmt) {
        case QF_Q4_0: RLX_DQ1(QF_Q4_0)
        case QF_Q4_1: RLX_DQ1(QF_Q4_1)
        case QF_Q5_0: RLX_DQ1(QF_Q5_0)
        case QF_Q5_1: RLX_DQ1(QF_Q5_1)
        case QF_Q8_0: RLX_DQ1(QF_Q8_0)
        case QF_Q4K: RLX_DQ1(QF_Q4K)
        default: RLX_DQ1(QF_Q6K)
    }
#undef RLX_DQ1
    const int r = (int)(j % (fmt == QF_Q4K || fmt == QF_Q6K ? 256 : 32));
    float v = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) v = e[i] == r ? w[i] : v;
    return v;
}

// A warp per output column (8 per block): each lane decodes 8 weights of a
// block at a time and multiplies them with RB activation rows, so a weight
// is decoded once per RB rows. Lanes of a warp read neighbouring chunks: 4
// lanes per 32-element block, 32 per 256-element block. The launches use
// RB 1, for one row that qmatvec cannot take (256-element formats, weights
// a kernel writes, rows past 2048 elements); two and more rows run on
// tensor cores (qmma.cu).
template <typename T, int F, int RB>
__device__ void qmatmul_body(const QMatMulP& p) {
    constexpr int CPB = QFmt<F>::BE / 8;  // chunks per block
    __shared__ float red[RB][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 col = (i64)blockIdx.x * nw + warp;
    const bool norm = p.gamma != nullptr, glu = p.glu != 0, active = col < p.n;
    // Without the norm's block-wide reduction an idle warp can leave now.
    if (!norm && !active) return;
    const u8* wrow = (const u8*)p.w + col * p.row_bytes;
    const u8* wup = wrow + p.n * p.row_bytes;
    const T* a = (const T*)p.a;
    const T* gamma = (const T*)p.gamma;
    const i64 chunks = p.k / 8;
    for (i64 r0 = (i64)blockIdx.y * RB; r0 < p.rows; r0 += (i64)gridDim.y * RB) {
        float inv[RB];
        if (norm) {
            // 1/sqrt(mean(x²) + eps) per row, the RmsNorm kernel's formula.
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                float s = 0.0f;
                if (r0 + j < p.rows) {
                    const T* x = a + (r0 + j) * p.lda;
                    for (i64 c = threadIdx.x; c < p.k; c += blockDim.x) {
                        const float v = ld(x, c);
                        s += v * v;
                    }
                }
                s = warp_sum(s);
                if (lane == 0) red[j][warp] = s;
            }
            __syncthreads();
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                float t = lane < nw ? red[j][lane] : 0.0f;
                inv[j] = rsqrtf(warp_sum(t) / (float)p.k + (float)p.eps);
            }
            __syncthreads();
        }
        if (!active) continue;
        float acc[RB], acc2[RB];
#pragma unroll
        for (int j = 0; j < RB; ++j) acc[j] = acc2[j] = 0.0f;
        for (i64 c = lane; c < chunks; c += 32) {
            const i64 blk = c / CPB;
            float w[8], w2[8], g[8];
            int e[8];
            dequant8<F>(wrow + blk * QFmt<F>::BB, (int)(c % CPB), w, e);
            if (glu) dequant8<F>(wup + blk * QFmt<F>::BB, (int)(c % CPB), w2, e);
            const i64 base = blk * QFmt<F>::BE;
#pragma unroll
            for (int i = 0; i < 8; ++i) g[i] = norm ? ld(gamma, base + e[i]) : 1.0f;
#pragma unroll
            for (int j = 0; j < RB; ++j) {
                if (RB > 1 && r0 + j >= p.rows) break;
                const T* x = a + (r0 + j) * p.lda + base;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float xv = ld(x, e[i]) * g[i];
                    acc[j] = fmaf(w[i], xv, acc[j]);
                    if (glu) acc2[j] = fmaf(w2[i], xv, acc2[j]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < RB; ++j) {
            float s = warp_sum(acc[j]);
            if (norm) s *= inv[j];
            if (glu) {
                float u = warp_sum(acc2[j]);
                if (norm) u *= inv[j];
                s = s / (1.0f + expf(-s)) * u;
            }
            if (lane == 0 && r0 + j < p.rows) {
                const i64 o = (r0 + j) * p.n + col;
                if (p.res) s += ld((const T*)p.res, o);
                st((T*)p.out, o, s);
            }
        }
    }
}

// Four consecutive elements as floats, in one load (16 bytes of f32, 8 of
// f16 / bf16); p is aligned to that size.
__device__ __forceinline__ void ld4(const float* p, float* o) {
    const float4 v = *(const float4*)p;
    o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
__device__ __forceinline__ void ld4(const __half* p, float* o) {
    const uint2 v = *(const uint2*)p;
    const float2 a = __half22float2(*(const __half2*)&v.x), b = __half22float2(*(const __half2*)&v.y);
    o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
}
__device__ __forceinline__ void ld4(const __nv_bfloat16* p, float* o) {
    const uint2 v = *(const uint2*)p;
    const float2 a = __bfloat1622float2(*(const __nv_bfloat162*)&v.x), b = __bfloat1622float2(*(const __nv_bfloat162*)&v.y);
    o[0] = a.x; o[1] = a.y; o[2] = b.x; o[3] = b.y;
}

// One activation row (a decode step at batch 1) against a 32-element
// format, a warp per output column as above, but each lane issues the
// loads of every weight chunk it will need (at most MC) before it waits on
// the previous kernel: weights never depend on it, so under programmatic
// dependent launch they arrive while that kernel finishes. After the wait
// only the activations (in L2) are read: a chunk's 8 elements are two runs
// of 4 (qdecode's element order), each one vector load, as are the norm's
// weights; the residual is loaded with them. The host launches it only
// where the activation row and the norm's weights are aligned to such a
// load (16 bytes). A warp covers its whole row, so a fused RmsNorm's sum
// of squares is a warp sum of the values it loaded (no block-wide pass).
template <typename T, int F, int MC>
__device__ void qmatvec_body(const QMatMulP& p) {
    static_assert(QFmt<F>::BE == 32, "qmatvec reads 32-element formats");
    constexpr int BB = QFmt<F>::BB;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 col = (i64)blockIdx.x * nw + warp;
    const bool norm = p.gamma != nullptr, glu = p.glu != 0, active = col < p.n;
    const int chunks = (int)(p.k / 8);
    const u8* wrow = (const u8*)p.w + col * p.row_bytes;
    const u8* wup = wrow + p.n * p.row_bytes;
    QRaw rw[MC], ru[MC];
#pragma unroll
    for (int m = 0; m < MC; ++m) {
        const int c = lane + 32 * m;
        if (active && c < chunks) {
            rw[m] = qraw<F>(wrow + (c >> 2) * BB, c & 3);
            if (glu) ru[m] = qraw<F>(wup + (c >> 2) * BB, c & 3);
        }
    }
    pdl_enter();
    if (!active) return;
    const T* x = (const T*)p.a;
    const T* gamma = (const T*)p.gamma;
    const float res = p.res && lane == 0 ? ld((const T*)p.res, col) : 0.0f;
    float acc = 0.0f, acc2 = 0.0f, ss = 0.0f;
#pragma unroll
    for (int m = 0; m < MC; ++m) {
        const int c = lane + 32 * m;
        if (c < chunks) {
            // The chunk's two runs of 4 elements (qdecode's e[0..3], e[4..7]).
            const int part = c & 3;
            const i64 base = (i64)(c >> 2) * 32;
            const int r0 = F == QF_Q8_0 ? 8 * part : 4 * part, r1 = F == QF_Q8_0 ? r0 + 4 : 16 + r0;
            float xv[8], g[8];
            ld4(x + base + r0, xv);
            ld4(x + base + r1, xv + 4);
            if (norm) {
                ld4(gamma + base + r0, g);
                ld4(gamma + base + r1, g + 4);
            }
            float w[8], w2[8];
            int e[8];
            qdecode<F>(rw[m], part, w, e);
            if (glu) qdecode<F>(ru[m], part, w2, e);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float v = xv[i];
                if (norm) {
                    ss = fmaf(v, v, ss);
                    v *= g[i];
                }
                acc = fmaf(w[i], v, acc);
                if (glu) acc2 = fmaf(w2[i], v, acc2);
            }
        }
    }
    float s = warp_sum(acc);
    // 1/sqrt(mean(x²) + eps), the RmsNorm kernel's formula.
    const float inv = norm ? rsqrtf(warp_sum(ss) / (float)p.k + (float)p.eps) : 1.0f;
    s *= inv;
    if (glu) {
        const float u = warp_sum(acc2) * inv;
        s = s / (1.0f + expf(-s)) * u;
    }
    if (lane == 0) {
        if (p.res) s += res;
        st((T*)p.out, col, s);
    }
}

// As qmatvec_body for many columns and no gate (the output head): each
// warp takes CPW neighbouring columns, the weight loads of all of them
// issued before the wait, and reads each activation chunk once for all of
// them; so a lane keeps CPW times as many loads in flight. Each column's
// sums run in qmatvec_body's order, so both give the same bits.
// `qmatvec_wide_sums` is everything after the weights are in registers.
template <typename T, int F, int MC, int CPW>
__device__ __forceinline__ void qmatvec_wide_sums(const QMatMulP& p, const QRaw (&rw)[CPW][MC], i64 col0, int lane) {
    const int chunks = (int)(p.k / 8);
    const bool norm = p.gamma != nullptr;
    const T* x = (const T*)p.a;
    const T* gamma = (const T*)p.gamma;
    const int run1 = F == QF_Q8_0 ? 4 : 16;
    float acc[CPW], ss = 0.0f;
#pragma unroll
    for (int j = 0; j < CPW; ++j) acc[j] = 0.0f;
#pragma unroll
    for (int m = 0; m < MC; ++m) {
        const int c = lane + 32 * m;
        if (c < chunks) {
            const int part = c & 3;
            const i64 r0 = (i64)(c >> 2) * 32 + (F == QF_Q8_0 ? 8 * part : 4 * part);
            float xv[8];
            ld4(x + r0, xv);
            ld4(x + r0 + run1, xv + 4);
            if (norm) {
                float g[8];
                ld4(gamma + r0, g);
                ld4(gamma + r0 + run1, g + 4);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    ss = fmaf(xv[i], xv[i], ss);
                    xv[i] *= g[i];
                }
            }
#pragma unroll
            for (int j = 0; j < CPW; ++j) {
                float w[8];
                int e[8];
                qdecode<F>(rw[j][m], part, w, e);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[j] = fmaf(w[i], xv[i], acc[j]);
            }
        }
    }
    const float inv = norm ? rsqrtf(warp_sum(ss) / (float)p.k + (float)p.eps) : 1.0f;
#pragma unroll
    for (int j = 0; j < CPW; ++j) {
        const float s = warp_sum(acc[j]) * inv;
        if (lane == 0 && col0 + j < p.n) {
            const float r = p.res ? ld((const T*)p.res, col0 + j) : 0.0f;
            st((T*)p.out, col0 + j, p.res ? s + r : s);
        }
    }
}

// A lane's chunks of CPW neighbouring weight rows starting at `w0`.
template <int F, int MC, int CPW>
__device__ __forceinline__ void qmatvec_wide_raw(const QMatMulP& p, const u8* w0, i64 col0, int lane, QRaw (&rw)[CPW][MC]) {
    constexpr int BB = QFmt<F>::BB;
    const int chunks = (int)(p.k / 8);
#pragma unroll
    for (int j = 0; j < CPW; ++j) {
#pragma unroll
        for (int m = 0; m < MC; ++m) {
            const int c = lane + 32 * m;
            if (col0 + j < p.n && c < chunks) rw[j][m] = qraw<F>(w0 + j * p.row_bytes + (c >> 2) * BB, c & 3);
        }
    }
}

template <typename T, int F, int MC, int CPW>
__device__ void qmatvec_wide_body(const QMatMulP& p) {
    static_assert(QFmt<F>::BE == 32, "qmatvec reads 32-element formats");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 col0 = ((i64)blockIdx.x * nw + warp) * CPW;
    QRaw rw[CPW][MC];
    qmatvec_wide_raw<F, MC, CPW>(p, (const u8*)p.w + col0 * p.row_bytes, col0, lane, rw);
    pdl_enter();
    if (col0 >= p.n) return;
    qmatvec_wide_sums<T, F, MC, CPW>(p, rw, col0, lane);
}

// The same sums with the block's weight rows (contiguous: its columns are
// neighbours) first copied to shared memory by 16-byte asynchronous copies,
// issued before the wait on the previous kernel. Rows of a 34-byte block
// format (Q8_0: the output head of many GGUF files) are only 2-byte aligned,
// so reading them in place takes five 16-bit loads per chunk per column; the
// copy reads the same bytes in whole 16-byte pieces. The host launches it
// where the weight starts 16-byte aligned, with 32·CPW·row_bytes bytes of
// dynamic shared memory. The same bits as qmatvec_wide_body.
template <typename T, int F, int MC, int CPW>
__device__ void qmatvec_staged_body(const QMatMulP& p) {
    static_assert(QFmt<F>::BE == 32, "qmatvec reads 32-element formats");
    extern __shared__ __align__(16) u8 s_w[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 bcol0 = (i64)blockIdx.x * nw * CPW;
    const i64 bcols = p.n - bcol0 < (i64)nw * CPW ? p.n - bcol0 : (i64)nw * CPW;
    const i64 bytes = bcols * p.row_bytes;
    const u8* src = (const u8*)p.w + bcol0 * p.row_bytes;
    for (i64 o = (i64)threadIdx.x * 16; o < bytes; o += (i64)blockDim.x * 16) {
        cp_async_bytes(s_w + o, src + o, bytes - o < 16 ? (int)(bytes - o) : 16);
    }
    cp_async_commit();
    pdl_enter();
    cp_async_wait<0>();
    __syncthreads();
    const i64 col0 = bcol0 + (i64)warp * CPW;
    if (col0 >= p.n) return;
    QRaw rw[CPW][MC];
    qmatvec_wide_raw<F, MC, CPW>(p, s_w + (i64)warp * CPW * p.row_bytes, col0, lane, rw);
    qmatvec_wide_sums<T, F, MC, CPW>(p, rw, col0, lane);
}

// qmatvec_<format>_c<MC>_<dtype>: rows == 1, k ≤ 256·MC.
#define RLX_QMV(FN, F, MC)                                                                                                      \
    extern "C" __global__ void qmatvec_##FN##_c##MC##_f32(const QMatMulP p) { qmatvec_body<float, F, MC>(p); }                  \
    extern "C" __global__ void qmatvec_##FN##_c##MC##_f16(const QMatMulP p) { qmatvec_body<__half, F, MC>(p); }                 \
    extern "C" __global__ void qmatvec_##FN##_c##MC##_bf16(const QMatMulP p) { qmatvec_body<__nv_bfloat16, F, MC>(p); }
// qmatvec_w4_<format>_c<MC>_<dtype>: the same, four columns a warp (no gate).
#define RLX_QMVW(FN, F, MC)                                                                                                           \
    extern "C" __global__ void qmatvec_w4_##FN##_c##MC##_f32(const QMatMulP p) { qmatvec_wide_body<float, F, MC, 4>(p); }            \
    extern "C" __global__ void qmatvec_w4_##FN##_c##MC##_f16(const QMatMulP p) { qmatvec_wide_body<__half, F, MC, 4>(p); }           \
    extern "C" __global__ void qmatvec_w4_##FN##_c##MC##_bf16(const QMatMulP p) { qmatvec_wide_body<__nv_bfloat16, F, MC, 4>(p); }
// qmatvec_s4_<format>_c<MC>_<dtype>: the same, the weights staged in shared memory.
#define RLX_QMVS(FN, F, MC)                                                                                                            \
    extern "C" __global__ void qmatvec_s4_##FN##_c##MC##_f32(const QMatMulP p) { qmatvec_staged_body<float, F, MC, 4>(p); }            \
    extern "C" __global__ void qmatvec_s4_##FN##_c##MC##_f16(const QMatMulP p) { qmatvec_staged_body<__half, F, MC, 4>(p); }           \
    extern "C" __global__ void qmatvec_s4_##FN##_c##MC##_bf16(const QMatMulP p) { qmatvec_staged_body<__nv_bfloat16, F, MC, 4>(p); }
#define RLX_QMV_FMT(FN, F) RLX_QMV(FN, F, 2) RLX_QMV(FN, F, 4) RLX_QMV(FN, F, 8) RLX_QMVW(FN, F, 2) RLX_QMVW(FN, F, 4) RLX_QMVS(FN, F, 2) RLX_QMVS(FN, F, 4)
// Parts (IN_PART), here and below: Q4_0 and Q4_1 (with the gather and
// the integer ops); Q5_0 and Q5_1; Q8_0, Q4_K and Q6_K.
#if IN_PART(0)
RLX_QMV_FMT(q4_0, QF_Q4_0)
RLX_QMV_FMT(q4_1, QF_Q4_1)
#endif
#if IN_PART(1)
RLX_QMV_FMT(q5_0, QF_Q5_0)
RLX_QMV_FMT(q5_1, QF_Q5_1)
#endif
#if IN_PART(2)
RLX_QMV_FMT(q8_0, QF_Q8_0)
#endif

// qmatmul_<format>_r<RB>_<dtype>
#define RLX_QMM(FN, F, RB)                                                                                                   \
    extern "C" __global__ void qmatmul_##FN##_r##RB##_f32(const QMatMulP p) { pdl_enter(); qmatmul_body<float, F, RB>(p); } \
    extern "C" __global__ void qmatmul_##FN##_r##RB##_f16(const QMatMulP p) { pdl_enter(); qmatmul_body<__half, F, RB>(p); } \
    extern "C" __global__ void qmatmul_##FN##_r##RB##_bf16(const QMatMulP p) { pdl_enter(); qmatmul_body<__nv_bfloat16, F, RB>(p); }
#define RLX_QMM_FMT(FN, F) RLX_QMM(FN, F, 1)
#if IN_PART(0)
RLX_QMM_FMT(q4_0, QF_Q4_0)
RLX_QMM_FMT(q4_1, QF_Q4_1)
#endif
#if IN_PART(1)
RLX_QMM_FMT(q5_0, QF_Q5_0)
RLX_QMM_FMT(q5_1, QF_Q5_1)
#endif
#if IN_PART(2)
RLX_QMM_FMT(q8_0, QF_Q8_0)
RLX_QMM_FMT(q4_k, QF_Q4K)
RLX_QMM_FMT(q6_k, QF_Q6K)
#endif

// out[i, :] = dequant(table[ids[i], :]) as f32; an id outside 0..vocab
// gives a row of zeros and raises ERR_GATHER_ID.
struct QGatherP { const void* table; const void* ids; void* out; int* err; i64 n; i64 dim; i64 vocab; i64 id64; i64 row_bytes; i64 fmt; };

#if IN_PART(0)
extern "C" __global__ void qgather(const QGatherP p) {
    pdl_enter();
    float* out = (float*)p.out;
    const i64 total = p.n * p.dim;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / p.dim, c = i % p.dim;
        const i64 id = p.id64 ? ((const long long*)p.ids)[row] : (i64)((const int*)p.ids)[row];
        if (id < 0 || id >= p.vocab) {
            out[i] = 0.0f;
            if (c == 0) atomicOr(p.err, ERR_GATHER_ID);
        } else {
            out[i] = dequant1((const u8*)p.table + id * p.row_bytes, p.fmt, c);
        }
    }
}
#endif

// Integer add/sub/mul/div with broadcasting strides (positions, valid
// lengths): wrapping two's-complement arithmetic as the CPU backend's i64
// path; division truncates toward zero, and a division by zero writes 0
// and raises ERR_INT_DIV_ZERO (the CPU backend refuses it).
struct IntBinaryP {
    const void* a; const void* b; void* out; int* err;
    i64 n; i64 rank; i64 op; i64 wide;
    i64 shape[MAX_RANK]; i64 sa[MAX_RANK]; i64 sb[MAX_RANK];
};

#if IN_PART(0)
extern "C" __global__ void binary_int(const IntBinaryP p) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
        i64 rem = i, ai = 0, bi = 0;
        for (int d = (int)p.rank - 1; d >= 0; --d) {
            const i64 c = rem % p.shape[d];
            rem /= p.shape[d];
            ai += c * p.sa[d];
            bi += c * p.sb[d];
        }
        const long long x = p.wide ? ((const long long*)p.a)[ai] : (long long)((const int*)p.a)[ai];
        const long long y = p.wide ? ((const long long*)p.b)[bi] : (long long)((const int*)p.b)[bi];
        const unsigned long long ux = (unsigned long long)x, uy = (unsigned long long)y;
        long long r;
        switch (p.op) {
            case 0: r = (long long)(ux + uy); break;
            case 1: r = (long long)(ux - uy); break;
            case 2: r = (long long)(ux * uy); break;
            default:
                if (y == 0) {
                    r = 0;
                    atomicOr(p.err, ERR_INT_DIV_ZERO);
                } else if (y == -1) {
                    r = (long long)(0ull - ux);  // MIN / -1 wraps to MIN
                } else {
                    r = x / y;
                }
                break;
        }
        if (p.wide) ((long long*)p.out)[i] = r;
        else ((int*)p.out)[i] = (int)(unsigned)(unsigned long long)r;
    }
}
#endif
