// Kernels of the generation step: matmuls and embedding gathers over GGML
// block-quantized weights read as stored (rlx_ir::QFormat documents each
// block layout), next-token sampling, and integer arithmetic on positions.
// Bad indices never fault: they write zeros and raise a bit of the slot's
// error flag, which the host checks after the call.
#include "common.cuh"

// Format codes; must match `qformat_code` in src/decode.rs.
#define QF_Q4_0 0
#define QF_Q4_1 1
#define QF_Q5_0 2
#define QF_Q5_1 3
#define QF_Q8_0 4
#define QF_Q4K 5
#define QF_Q6K 6

// Error flag bits of these kernels (beside those in common.cuh); src/exec.rs
// turns them into messages.
#define ERR_SAMPLE_POS 8
#define ERR_INT_DIV_ZERO 16

typedef unsigned char u8;

template <int F> struct QFmt;
template <> struct QFmt<QF_Q4_0> { static constexpr int BE = 32, BB = 18; };
template <> struct QFmt<QF_Q4_1> { static constexpr int BE = 32, BB = 20; };
template <> struct QFmt<QF_Q5_0> { static constexpr int BE = 32, BB = 22; };
template <> struct QFmt<QF_Q5_1> { static constexpr int BE = 32, BB = 24; };
template <> struct QFmt<QF_Q8_0> { static constexpr int BE = 32, BB = 34; };
template <> struct QFmt<QF_Q4K> { static constexpr int BE = 256, BB = 144; };
template <> struct QFmt<QF_Q6K> { static constexpr int BE = 256, BB = 210; };

// Every block size is even and rows start 2-byte aligned (the host checks
// the base), so 16-bit loads are the widest that are always aligned.
__device__ __forceinline__ unsigned ld16(const u8* p) { return *(const unsigned short*)p; }
__device__ __forceinline__ unsigned ld32(const u8* p) { return ld16(p) | (ld16(p + 2) << 16); }
__device__ __forceinline__ float ldh(const u8* p) { return __half2float(__ushort_as_half((unsigned short)ld16(p))); }

// Q4_K's 6-bit scale and min of sub-block j (0..8) from its 12 packed bytes.
__device__ __forceinline__ void k4_scale_min(const u8* s, int j, int& sc, int& mn) {
    if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// One lane's share of a block: chunk `part` (0 .. BE/8) is 8 weights and
// their element offsets in the block. 32-element formats: part p holds the
// nibble (or byte) pairs 4p..4p+3, i.e. elements 4p..4p+3 and 16+4p..16+4p+3
// (Q8_0: elements 8p..8p+7). Q4_K: part p = 8c + q holds bytes 4q..4q+3 of
// 32-byte group c, elements 64c+4q.. (low nibbles) and 64c+32+4q.. (high).
// Q6_K: part p = 16h + q holds columns l = 2q, 2q+1 of half h, elements
// 128h + l + {0, 32, 64, 96}.
// The bytes of a 32-element format's block that one chunk (`part`, 0..4)
// needs, in three registers: a = scale | min << 16, b = the chunk's four
// nibble bytes (Q8_0: its first four bytes), c = the high bits of a Q5
// block (Q8_0: the chunk's last four bytes). Loaded apart from their use so
// a kernel can issue every load of its row before it needs any.
struct QRaw {
    unsigned a, b, c;
};

template <int F>
__device__ __forceinline__ QRaw qraw(const u8* b, int part) {
    QRaw r;
    r.a = ld16(b);
    r.c = 0u;
    if (F == QF_Q4_1 || F == QF_Q5_1) r.a |= ld16(b + 2) << 16;
    if (F == QF_Q8_0) {
        r.b = ld32(b + 2 + 8 * part);
        r.c = ld32(b + 6 + 8 * part);
    } else {
        const int qs = F == QF_Q4_0 ? 2 : F == QF_Q4_1 ? 4 : F == QF_Q5_0 ? 6 : 8;
        r.b = ld32(b + qs + 4 * part);
        if (F == QF_Q5_0) r.c = ld32(b + 2);
        if (F == QF_Q5_1) r.c = ld32(b + 4);
    }
    return r;
}

__device__ __forceinline__ float h2f(unsigned bits) { return __half2float(__ushort_as_half((unsigned short)(bits & 0xFFFFu))); }

// The 8 weights of chunk `part` of a 32-element block from its QRaw, and
// their element offsets in the block (see dequant8).
template <int F>
__device__ __forceinline__ void qdecode(const QRaw r, int part, float* w, int* e) {
    const float d = h2f(r.a);
    if (F == QF_Q8_0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned word = i < 4 ? r.b : r.c;
            w[i] = d * (float)(signed char)((word >> (8 * (i & 3))) & 0xFF);
            e[i] = 8 * part + i;
        }
        return;
    }
    const float m = (F == QF_Q4_1 || F == QF_Q5_1) ? h2f(r.a >> 16) : 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int j0 = 4 * part + i, j1 = 16 + 4 * part + i;
        int q0 = (r.b >> (8 * i)) & 15, q1 = (r.b >> (8 * i + 4)) & 15;
        if (F == QF_Q5_0 || F == QF_Q5_1) {
            q0 |= ((r.c >> j0) & 1) << 4;
            q1 |= ((r.c >> j1) & 1) << 4;
        }
        if (F == QF_Q4_0) { w[i] = d * (float)(q0 - 8); w[4 + i] = d * (float)(q1 - 8); }
        else if (F == QF_Q5_0) { w[i] = d * (float)(q0 - 16); w[4 + i] = d * (float)(q1 - 16); }
        // Unfused (no FMA contraction): the CPU's rounding, so a gathered
        // row is bit-identical.
        else { w[i] = __fadd_rn(__fmul_rn(d, (float)q0), m); w[4 + i] = __fadd_rn(__fmul_rn(d, (float)q1), m); }
        e[i] = j0;
        e[4 + i] = j1;
    }
}

template <int F>
__device__ __forceinline__ void dequant8(const u8* b, int part, float* w, int* e) {
    if (QFmt<F>::BE == 32) {
        qdecode<F>(qraw<F>(b, part), part, w, e);
    } else if (F == QF_Q4K) {
        const int c = part >> 3, q = part & 7;
        const float d = ldh(b), dmin = ldh(b + 2);
        int s1, m1, s2, m2;
        k4_scale_min(b + 4, 2 * c, s1, m1);
        k4_scale_min(b + 4, 2 * c + 1, s2, m2);
        const float d1 = d * (float)s1, mm1 = dmin * (float)m1, d2 = d * (float)s2, mm2 = dmin * (float)m2;
        const unsigned q4 = ld32(b + 16 + 32 * c + 4 * q);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = __fsub_rn(__fmul_rn(d1, (float)((q4 >> (8 * i)) & 15)), mm1);
            w[4 + i] = __fsub_rn(__fmul_rn(d2, (float)((q4 >> (8 * i + 4)) & 15)), mm2);
            e[i] = 64 * c + 4 * q + i;
            e[4 + i] = 64 * c + 32 + 4 * q + i;
        }
    } else {  // Q6_K
        const int h = part >> 4, l = 2 * (part & 15);
        const float d = ldh(b + 208);
        const unsigned ql0 = ld16(b + 64 * h + l), ql1 = ld16(b + 64 * h + 32 + l), qh = ld16(b + 128 + 32 * h + l);
        const signed char* sc = (const signed char*)(b + 192 + 8 * h + l / 16);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const unsigned a = (ql0 >> (8 * t)) & 0xFF, c = (ql1 >> (8 * t)) & 0xFF, hb = (qh >> (8 * t)) & 0xFF;
            const int q1 = (int)((a & 15) | ((hb & 3) << 4)) - 32;
            const int q2 = (int)((c & 15) | (((hb >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((a >> 4) | (((hb >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((c >> 4) | (((hb >> 6) & 3) << 4)) - 32;
            w[4 * t + 0] = d * (float)sc[0] * (float)q1;
            w[4 * t + 1] = d * (float)sc[2] * (float)q2;
            w[4 * t + 2] = d * (float)sc[4] * (float)q3;
            w[4 * t + 3] = d * (float)sc[6] * (float)q4;
            e[4 * t + 0] = 128 * h + l + t;
            e[4 * t + 1] = 128 * h + l + t + 32;
            e[4 * t + 2] = 128 * h + l + t + 64;
            e[4 * t + 3] = 128 * h + l + t + 96;
        }
    }
}

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

// out[r, c] = a[r, :] · dequant(w[c, :]) for `rows` rows of `k` elements
// (row stride lda), f32 accumulation, out contiguous [rows, n] in a's type.
// The fused forms (Op::QMatMulFused): with `gamma`, each a row is replaced
// by RmsNorm(a row) · gamma (the norm's scale is applied to the finished
// dot product); with `glu`, w has 2n rows and out = silu(a·w[c]) ·
// (a·w[n + c]); with `res`, res[r, c] is added last (res may be out).
struct QMatMulP {
    const void* a; const void* w; void* out; const void* gamma; const void* res;
    i64 rows; i64 n; i64 k; i64 lda; i64 row_bytes; i64 glu; double eps;
};

// A warp per output column (8 per block): each lane decodes 8 weights of a
// block at a time and multiplies them with RB activation rows, so a weight
// is decoded once per RB rows (RB 1 for one row, 4 for more). Lanes of a
// warp read neighbouring chunks: 4 lanes per 32-element block, 32 per
// 256-element block.
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

// One activation row (a decode step at batch 1) against a 32-element
// format, a warp per output column as above, but each lane issues the
// loads of every weight chunk it will need (at most MC) before it waits on
// the previous kernel: weights never depend on it, so under programmatic
// dependent launch they arrive while that kernel finishes. After the wait
// only the activations (in L2) are read. A warp covers its whole row, so a
// fused RmsNorm's sum of squares is a warp sum of the values it loaded
// (no block-wide pass).
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
    float acc = 0.0f, acc2 = 0.0f, ss = 0.0f;
#pragma unroll
    for (int m = 0; m < MC; ++m) {
        const int c = lane + 32 * m;
        if (c < chunks) {
            float w[8], w2[8];
            int e[8];
            qdecode<F>(rw[m], c & 3, w, e);
            if (glu) qdecode<F>(ru[m], c & 3, w2, e);
            const i64 base = (i64)(c >> 2) * 32;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float xv = ld(x, base + e[i]);
                if (norm) {
                    ss = fmaf(xv, xv, ss);
                    xv *= ld(gamma, base + e[i]);
                }
                acc = fmaf(w[i], xv, acc);
                if (glu) acc2 = fmaf(w2[i], xv, acc2);
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
        if (p.res) s += ld((const T*)p.res, col);
        st((T*)p.out, col, s);
    }
}

// qmatvec_<format>_c<MC>_<dtype>: rows == 1, k ≤ 256·MC.
#define RLX_QMV(FN, F, MC)                                                                                                      \
    extern "C" __global__ void qmatvec_##FN##_c##MC##_f32(const QMatMulP p) { qmatvec_body<float, F, MC>(p); }                  \
    extern "C" __global__ void qmatvec_##FN##_c##MC##_f16(const QMatMulP p) { qmatvec_body<__half, F, MC>(p); }                 \
    extern "C" __global__ void qmatvec_##FN##_c##MC##_bf16(const QMatMulP p) { qmatvec_body<__nv_bfloat16, F, MC>(p); }
#define RLX_QMV_FMT(FN, F) RLX_QMV(FN, F, 2) RLX_QMV(FN, F, 4) RLX_QMV(FN, F, 8)
RLX_QMV_FMT(q4_0, QF_Q4_0)
RLX_QMV_FMT(q4_1, QF_Q4_1)
RLX_QMV_FMT(q5_0, QF_Q5_0)
RLX_QMV_FMT(q5_1, QF_Q5_1)
RLX_QMV_FMT(q8_0, QF_Q8_0)

// qmatmul_<format>_r<RB>_<dtype>
#define RLX_QMM(FN, F, RB)                                                                                                   \
    extern "C" __global__ void qmatmul_##FN##_r##RB##_f32(const QMatMulP p) { pdl_enter(); qmatmul_body<float, F, RB>(p); } \
    extern "C" __global__ void qmatmul_##FN##_r##RB##_f16(const QMatMulP p) { pdl_enter(); qmatmul_body<__half, F, RB>(p); } \
    extern "C" __global__ void qmatmul_##FN##_r##RB##_bf16(const QMatMulP p) { pdl_enter(); qmatmul_body<__nv_bfloat16, F, RB>(p); }
#define RLX_QMM_FMT(FN, F) RLX_QMM(FN, F, 1) RLX_QMM(FN, F, 4)
RLX_QMM_FMT(q4_0, QF_Q4_0)
RLX_QMM_FMT(q4_1, QF_Q4_1)
RLX_QMM_FMT(q5_0, QF_Q5_0)
RLX_QMM_FMT(q5_1, QF_Q5_1)
RLX_QMM_FMT(q8_0, QF_Q8_0)
RLX_QMM_FMT(q4_k, QF_Q4K)
RLX_QMM_FMT(q6_k, QF_Q6K)

// out[i, :] = dequant(table[ids[i], :]) as f32; an id outside 0..vocab
// gives a row of zeros and raises ERR_GATHER_ID.
struct QGatherP { const void* table; const void* ids; void* out; int* err; i64 n; i64 dim; i64 vocab; i64 id64; i64 row_bytes; i64 fmt; };

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

// Integer add/sub/mul/div with broadcasting strides (positions, valid
// lengths): wrapping two's-complement arithmetic as the CPU backend's i64
// path; division truncates toward zero, and a division by zero writes 0
// and raises ERR_INT_DIV_ZERO (the CPU backend refuses it).
struct IntBinaryP {
    const void* a; const void* b; void* out; int* err;
    i64 n; i64 rank; i64 op; i64 wide;
    i64 shape[MAX_RANK]; i64 sa[MAX_RANK]; i64 sb[MAX_RANK];
};

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

// ---------------------------------------------------------------------------
// Sampling (Op::Sample), one block per sequence, with the CPU backend's
// rules (crates/rlx-cpu/src/kernels/sample.rs): repetition penalty over the
// recent history; greedy = the lowest index of the largest non-NaN logit;
// otherwise top-k, min-p and top-p keep prefixes of the candidates sorted by
// (logit desc, index asc), then the temperature and one draw of the
// counter-based uniform(seed, position) walking that same order (index
// order when nothing is cut, as the CPU does).
//
// Nothing is sorted: each prefix is a cut (key, index) — every candidate
// whose key (the logit's bits in total order) is above `key`, and at `key`
// the indices up to `index` — found by searching the key and then, among
// equal logits, the index, with block-wide counts or f64 weight sums per
// step, 16 thresholds per pass over the candidates. Once top-k leaves at
// most SAMPLE_CAP candidates they are copied to shared memory and every
// later pass reads only them.
//
// Sums run in a fixed order (fixed thread assignment and reduction tree),
// so a draw is deterministic; but not in the CPU's sequential order, and
// CUDA's f64 exp may differ from the host's in the last bit, so a draw that
// lands within ~1e-15 (relative) of the boundary between two tokens, or a
// top-p / min-p threshold met with that little to spare, can go the other
// way than on the CPU. Greedy picks are always the CPU's.

#define SAMPLE_THREADS 512
#define SAMPLE_CAP 2048
#define NT 16

struct SampleP {
    const void* logits; const void* fparams; const void* iparams; const void* history; const void* pos; void* out; int* err;
    i64 batch; i64 vocab; i64 hist_len; i64 bitmap_words;
};

// Float bits in total order (f32::total_cmp for every non-NaN value);
// every non-NaN key is above 0.
__device__ __forceinline__ unsigned fkey(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// rlx_cpu's `uniform`: [0, 1) from (seed, position).
__device__ __forceinline__ double uniform01(unsigned long long seed, unsigned long long position) {
    const unsigned long long z = splitmix64(seed ^ splitmix64(position));
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

struct Cut { unsigned key; unsigned idx; };
__device__ __forceinline__ bool in_cut(const Cut& c, unsigned k, unsigned i) { return k > c.key || (k == c.key && i <= c.idx); }
__device__ __forceinline__ Cut cut_all() { return Cut{0u, 0xFFFFFFFFu}; }

// The logits row, the penalty applied on the fly (a bitmap in shared
// memory marks the penalised ids). `flat`: every candidate gets key 1, so
// the order is the index order.
struct RowSrc {
    const float* l; const unsigned* bits; float rp; bool pen; bool flat; int n;
    // False for a NaN logit (never a candidate).
    __device__ __forceinline__ bool get(int e, float& v, unsigned& i, unsigned& k) const {
        v = l[e];
        i = (unsigned)e;
        if (pen && ((bits[e >> 5] >> (e & 31)) & 1u)) v = v > 0.0f ? v / rp : v * rp;
        k = flat ? 1u : fkey(v);
        return v == v;
    }
};
// Candidates copied to shared memory.
struct SmemSrc {
    const float* v; const unsigned* idx; int n;
    __device__ __forceinline__ bool get(int e, float& x, unsigned& i, unsigned& k) const {
        x = v[e];
        i = idx[e];
        k = fkey(x);
        return true;
    }
};

struct SampleShared {
    long long ired[SAMPLE_THREADS / 32][NT];
    double dred[SAMPLE_THREADS / 32][NT];
    long long ires[NT];
    double dres[NT];
    float fred[SAMPLE_THREADS / 32];
    unsigned ured[SAMPLE_THREADS / 32];
};

// Block-wide sums of NT values per thread, in a fixed order; every thread
// gets them back in `acc`.
template <typename V>
__device__ void block_sums(V (&acc)[NT], V (*red)[NT], V* res) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        V v = acc[j];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) red[warp][j] = v;
    }
    __syncthreads();
    if (threadIdx.x < NT) {
        V s = 0;
        for (int w = 0; w < nw; ++w) s += red[w][threadIdx.x];
        res[threadIdx.x] = s;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j] = res[j];
    __syncthreads();
}

__device__ long long block_sum_ll(long long v, SampleShared& sh) {
    long long a[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) a[j] = j == 0 ? v : 0;
    block_sums<long long>(a, sh.ired, sh.ires);
    return a[0];
}
__device__ double block_sum_d(double v, SampleShared& sh) {
    double a[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) a[j] = j == 0 ? v : 0.0;
    block_sums<double>(a, sh.dred, sh.dres);
    return a[0];
}
__device__ unsigned block_min_u(unsigned v, SampleShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) sh.ured[warp] = v;
    __syncthreads();
    unsigned r = 0xFFFFFFFFu;
    for (int w = 0; w < nw; ++w) r = min(r, sh.ured[w]);
    __syncthreads();
    return r;
}
__device__ unsigned block_max_u(unsigned v, SampleShared& sh) { return ~block_min_u(~v, sh); }

// What a search adds up per candidate: 1 (`mass` false), or the CPU's
// weight exp(f64(l - mx) [/ t]) · scale (the difference in f32, the rest in
// f64).
struct Weight {
    bool mass; float mx; bool div_t; double t; double scale;
    __device__ __forceinline__ double of(float v) const {
        const double d = (double)(v - mx);
        return exp(div_t ? d / t : d) * scale;
    }
};

// The test a prefix's sum must pass: > thr (strict) or >= thr.
struct Cond {
    double thr; bool strict;
    __device__ __forceinline__ bool ok(double v) const { return strict ? v > thr : v >= thr; }
};

// Sums over the candidates of cut `in`, for NT thresholds t[j]: mode 0,
// those with key >= t[j]; mode 1, those with key > `at`, or key == `at` and
// index <= t[j].
template <class Src>
__device__ void sums_at(const Src& src, const Cut& in, const Weight& w, int mode, unsigned at, const unsigned (&t)[NT], double (&out)[NT],
                        SampleShared& sh) {
    if (w.mass) {
        double acc[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[j] = 0.0;
        for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
            float v;
            unsigned i, k;
            if (!src.get(e, v, i, k) || !in_cut(in, k, i) || (mode == 1 && k < at)) continue;
            const double x = w.of(v);
#pragma unroll
            for (int j = 0; j < NT; ++j) acc[j] += (mode == 0 ? k >= t[j] : (k > at || i <= t[j])) ? x : 0.0;
        }
        block_sums<double>(acc, sh.dred, sh.dres);
#pragma unroll
        for (int j = 0; j < NT; ++j) out[j] = acc[j];
    } else {
        long long acc[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[j] = 0;
        for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
            float v;
            unsigned i, k;
            if (!src.get(e, v, i, k) || !in_cut(in, k, i) || (mode == 1 && k < at)) continue;
#pragma unroll
            for (int j = 0; j < NT; ++j) acc[j] += (mode == 0 ? k >= t[j] : (k > at || i <= t[j])) ? 1 : 0;
        }
        block_sums<long long>(acc, sh.ired, sh.ires);
#pragma unroll
        for (int j = 0; j < NT; ++j) out[j] = (double)acc[j];
    }
}

// The shortest prefix of cut `in` whose sum passes `cond`, as a cut; false
// when all of `in` does not. `kmax`: the largest key in `in`; `ilast`: the
// largest index there may be.
template <class Src>
__device__ bool prefix_cut(const Src& src, const Cut& in, unsigned kmax, unsigned ilast, const Weight& w, const Cond& cond, Cut& res,
                           SampleShared& sh) {
    unsigned t[NT];
    double f[NT];
    // The key: the largest v such that the candidates at or above v pass
    // (their sum falls as v rises); lo always passes, hi + 1 never.
#pragma unroll
    for (int j = 0; j < NT; ++j) t[j] = 0;
    sums_at(src, in, w, 0, 0, t, f, sh);
    if (!cond.ok(f[0])) return false;
    unsigned lo = 0, hi = kmax;
    while (lo < hi) {
        const unsigned long long span = (unsigned long long)(hi - lo);
        // NT thresholds in (lo, hi], the last one hi.
#pragma unroll
        for (int j = 0; j < NT; ++j) t[j] = lo + (unsigned)((span * (j + 1) + NT - 1) / NT);
        sums_at(src, in, w, 0, 0, t, f, sh);
        int best = -1;
#pragma unroll
        for (int j = 0; j < NT; ++j) best = cond.ok(f[j]) ? j : best;
        if (best < 0) {
            hi = t[0] - 1;
        } else {
            lo = t[best];
            if (best + 1 < NT) hi = t[best + 1] - 1;
        }
    }
    const unsigned key = lo;
    // The index: the smallest c such that the keys above, and at `key` the
    // indices up to c, pass; c = the last index there when only one
    // candidate has the key.
    unsigned clo = 0, chi = (in.key == key && in.idx < ilast) ? in.idx : ilast;
    {
        long long n = 0;
        unsigned imax = 0;
        for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
            float v;
            unsigned i, k;
            if (!src.get(e, v, i, k) || k != key || !in_cut(in, k, i)) continue;
            ++n;
            imax = max(imax, i);
        }
        n = block_sum_ll(n, sh);
        imax = block_max_u(imax, sh);
        if (n == 1) clo = chi = imax;
    }
    while (clo < chi) {
        const unsigned long long span = (unsigned long long)(chi - clo);
        // NT thresholds in [clo, chi).
#pragma unroll
        for (int j = 0; j < NT; ++j) t[j] = clo + (unsigned)(span * j / NT);
        sums_at(src, in, w, 1, key, t, f, sh);
        int first = NT;
#pragma unroll
        for (int j = NT - 1; j >= 0; --j) first = cond.ok(f[j]) ? j : first;
        if (first == 0) {
            chi = t[0];
        } else if (first == NT) {
            clo = t[NT - 1] + 1;
        } else {
            clo = t[first - 1] + 1;
            chi = t[first];
        }
    }
    res = Cut{key, clo};
    return true;
}

// The first k candidates of cut `in` (k at most its size).
template <class Src>
__device__ Cut first_k(const Src& src, const Cut& in, unsigned kmax, unsigned ilast, long long k, SampleShared& sh) {
    const Weight count{false, 0.0f, false, 1.0, 1.0};
    Cut c = in;
    prefix_cut(src, in, kmax, ilast, count, Cond{(double)k, false}, c, sh);
    return c;
}

// The sum of weights over cut `in`.
template <class Src>
__device__ double mass_of(const Src& src, const Cut& in, const Weight& w, SampleShared& sh) {
    double s = 0.0;
    for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (src.get(e, v, i, k) && in_cut(in, k, i)) s += w.of(v);
    }
    return block_sum_d(s, sh);
}

// Candidates of cut `in` whose weight is at least thr.
template <class Src>
__device__ long long count_at_least(const Src& src, const Cut& in, const Weight& w, double thr, SampleShared& sh) {
    long long s = 0;
    for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (src.get(e, v, i, k) && in_cut(in, k, i) && w.of(v) >= thr) ++s;
    }
    return block_sum_ll(s, sh);
}

// The last candidate of cut `in`: the largest index at its smallest key.
template <class Src>
__device__ unsigned last_of(const Src& src, const Cut& in, SampleShared& sh) {
    unsigned kmin = 0xFFFFFFFFu;
    for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (src.get(e, v, i, k) && in_cut(in, k, i)) kmin = min(kmin, k);
    }
    kmin = block_min_u(kmin, sh);
    unsigned imax = 0;
    for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (src.get(e, v, i, k) && k == kmin && in_cut(in, k, i)) imax = max(imax, i);
    }
    return block_max_u(imax, sh);
}

// Everything after top-k, over the candidates of cut `a` (na of them,
// largest key kmax): min-p, top-p (`filter`), the temperature, the draw.
template <class Src>
__device__ unsigned sample_prefix(const Src& src, Cut a, long long na, unsigned kmax, unsigned ilast, float mx, float top_p, float min_p,
                                  float temp, double u01, SampleShared& sh) {
    Cut c = a;
    const Weight w{true, mx, false, 1.0, 1.0};
    if (min_p > 0.0f) {
        // The candidates whose weight is at least min_p lead the order.
        long long keep = count_at_least(src, a, w, (double)min_p, sh);
        keep = keep < 1 ? 1 : keep;
        if (keep < na) c = first_k(src, a, kmax, ilast, keep, sh);
    }
    if (top_p < 1.0f) {
        // Normalised by the sum over all of top-k, as the CPU.
        const double total = mass_of(src, a, w, sh);
        const Weight wn{true, mx, false, 1.0, 1.0 / total};
        Cut pc;
        if (prefix_cut(src, c, kmax, ilast, wn, Cond{(double)top_p, false}, pc, sh)) c = pc;
    }
    const Weight wt{true, mx, true, (double)temp, 1.0};
    const double total = mass_of(src, c, wt, sh);
    Cut pick;
    // The first candidate whose running sum passes u; when rounding leaves
    // u at or past the total, the last one (the CPU's fallback).
    if (prefix_cut(src, c, kmax, ilast, wt, Cond{u01 * total, true}, pick, sh)) return pick.idx;
    return last_of(src, c, sh);
}

// Copies the candidates of cut `a` (at most SAMPLE_CAP are kept) to
// shared memory in a fixed order: thread-major, each thread's in index
// order, at offsets from a block-wide exclusive scan. Returns how many the
// cut holds.
__device__ long long copy_cut(const RowSrc& row, const Cut& a, float* cval, unsigned* cidx, SampleShared& sh) {
    long long mine = 0;
    for (int e = threadIdx.x; e < row.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (row.get(e, v, i, k) && in_cut(a, k, i)) ++mine;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    long long incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
        const long long y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) sh.ired[warp][0] = incl;
    __syncthreads();
    long long off = incl - mine, total = 0;
    for (int w = 0; w < nw; ++w) {
        if (w < warp) off += sh.ired[w][0];
        total += sh.ired[w][0];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < row.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (row.get(e, v, i, k) && in_cut(a, k, i) && off < SAMPLE_CAP) {
            cval[off] = v;
            cidx[off] = i;
            ++off;
        }
    }
    __syncthreads();
    return total;
}

// first_k over the whole row (k below the number of candidates), the same
// cut, found faster: one pass counts the candidates at or above NT
// thresholds below the largest logit (mx − 2^-4 .. mx − 2^11); when one of
// them holds between k and SAMPLE_CAP candidates, those (a superset of the
// first k) move to shared memory and the search runs there instead of
// reading the whole vocabulary once per step.
__device__ Cut first_k_of_row(const RowSrc& row, unsigned kmax, unsigned ilast, float mx, long long k, float* cval, unsigned* cidx,
                              SampleShared& sh) {
    if (k <= SAMPLE_CAP && isfinite(mx)) {
        unsigned t[NT];
        double f[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) t[j] = fkey(mx - ldexpf(1.0f, j - 4));
        sums_at(row, cut_all(), Weight{false, 0.0f, false, 1.0, 1.0}, 0, 0u, t, f, sh);
        int pick = -1;
#pragma unroll
        for (int j = NT - 1; j >= 0; --j) pick = (f[j] >= (double)k && f[j] <= (double)SAMPLE_CAP) ? j : pick;
        if (pick >= 0) {
            const long long n = copy_cut(row, Cut{t[pick], 0xFFFFFFFFu}, cval, cidx, sh);
            const SmemSrc cs{cval, cidx, (int)n};
            const Cut c = first_k(cs, cut_all(), kmax, ilast, k, sh);
            // Every thread has read the copy before the caller reuses it.
            __syncthreads();
            return c;
        }
    }
    return first_k(row, cut_all(), kmax, ilast, k, sh);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample(const SampleP p) {
    pdl_enter();
    extern __shared__ unsigned smem[];
    __shared__ SampleShared sh;
    unsigned* bits = smem;
    float* cval = (float*)(smem + p.bitmap_words);
    unsigned* cidx = (unsigned*)(cval + SAMPLE_CAP);
    const i64 b = blockIdx.x;
    const int V = (int)p.vocab;
    const unsigned ilast = (unsigned)(V - 1);
    const float* fp = (const float*)p.fparams + b * 4;
    const int* ip = (const int*)p.iparams + b * 4;
    const float temp = fp[0], top_p = fp[1], min_p = fp[2], rp = fp[3];
    const int top_k = ip[0], last_n = ip[1];
    const unsigned long long seed = (unsigned long long)(unsigned)ip[2] | ((unsigned long long)(unsigned)ip[3] << 32);
    const i64 at = ((const int*)p.pos)[b];
    int* out = (int*)p.out;
    if (at < 0 || at >= (p.hist_len > 1 ? p.hist_len : 1)) {
        if (threadIdx.x == 0) {
            out[b] = 0;
            atomicOr(p.err, ERR_SAMPLE_POS);
        }
        return;
    }

    // Repetition penalty: mark the ids at positions at-repeat_last_n+1 ..= at.
    const bool pen = rp != 1.0f && rp > 0.0f && p.hist_len > 0;
    if (pen) {
        for (i64 w = threadIdx.x; w < p.bitmap_words; w += blockDim.x) bits[w] = 0;
        __syncthreads();
        i64 first = at - (i64)(last_n > 0 ? last_n : 0) + 1;
        first = first > 0 ? first : 0;
        const int* hist = (const int*)p.history + b * p.hist_len;
        for (i64 j = first + threadIdx.x; j <= at; j += blockDim.x) {
            const int t = hist[j];
            if (t >= 0 && t < V) atomicOr(&bits[t >> 5], 1u << (t & 31));
        }
        __syncthreads();
    }
    const RowSrc row{(const float*)p.logits + b * p.vocab, bits, rp, pen, false, V};

    // The largest non-NaN logit (lowest index on ties) and the candidates.
    float best = -INFINITY;
    int bi = -1;
    long long nvalid = 0;
    for (int e = threadIdx.x; e < V; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (!row.get(e, v, i, k)) continue;
        ++nvalid;
        if (bi < 0 || v > best) {
            best = v;
            bi = e;
        }
    }
    {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) {
                best = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            sh.fred[warp] = best;
            sh.ured[warp] = (unsigned)bi;
        }
        __syncthreads();
        best = -INFINITY;
        bi = -1;
        for (int w = 0; w < nw; ++w) {
            const int oi = (int)sh.ured[w];
            const float ov = sh.fred[w];
            if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) {
                best = ov;
                bi = oi;
            }
        }
        __syncthreads();
    }
    nvalid = block_sum_ll(nvalid, sh);
    if (!(temp > 0.0f) || nvalid == 0) {
        // Greedy; a row of NaNs gives 0, as on the CPU.
        if (threadIdx.x == 0) out[b] = bi < 0 ? 0 : bi;
        return;
    }
    const float mx = best;
    const double u01 = uniform01(seed, (unsigned long long)at);
    unsigned tok;
    if (top_k <= 0 && !(top_p < 1.0f) && !(min_p > 0.0f)) {
        // Nothing cut: every candidate, drawn in index order.
        const RowSrc flat{row.l, bits, rp, pen, true, V};
        tok = sample_prefix(flat, cut_all(), nvalid, 1u, ilast, mx, 1.0f, 0.0f, temp, u01, sh);
    } else {
        const unsigned kmax = fkey(mx);
        Cut a = cut_all();
        long long na = nvalid;
        if (top_k > 0 && (long long)top_k < nvalid) {
            a = first_k_of_row(row, kmax, ilast, mx, top_k, cval, cidx, sh);
            na = top_k;
        }
        if (na <= SAMPLE_CAP) {
            copy_cut(row, a, cval, cidx, sh);
            const SmemSrc cs{cval, cidx, (int)na};
            tok = sample_prefix(cs, cut_all(), na, kmax, ilast, mx, top_p, min_p, temp, u01, sh);
        } else {
            tok = sample_prefix(row, a, na, kmax, ilast, mx, top_p, min_p, temp, u01, sh);
        }
    }
    if (threadIdx.x == 0) out[b] = (int)tok;
}
