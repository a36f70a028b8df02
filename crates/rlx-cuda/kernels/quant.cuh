// Block-quantized weights as GGML stores them (rlx_ir::QFormat documents
// each block layout): format codes, block sizes, and the decoding of a
// lane's chunk of a block, shared by the generation kernels (decode.cu's
// matvecs and gathers, qmma.cu's tensor-core matmuls, qlib.cu's decoding).
#pragma once
#include "common.cuh"

// Format codes; must match `qformat_code` in src/decode.rs.
#define QF_Q4_0 0
#define QF_Q4_1 1
#define QF_Q5_0 2
#define QF_Q5_1 3
#define QF_Q8_0 4
#define QF_Q4K 5
#define QF_Q6K 6

typedef unsigned char u8;

// The tensor-core input type of the quantized matmuls (qmma.cu, and qlib.cu's 16-bit operands):
// f16, or bf16 for bf16 activations.
template <typename T> struct MmaIn { typedef __half type; };
template <> struct MmaIn<__nv_bfloat16> { typedef __nv_bfloat16 type; };

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
