// Times the two quantized matmuls for many rows against each other on a
// prefill's shapes, and checks that they agree: qmma (kernels/qmma.cu,
// operands straight from global memory, 32 rows a block) and the library
// form (kernels/qlib.cu: rows to 16 bits, weights decoded to 16 bits,
// cuBLASLt, SwiGLU; what src/decode.rs runs from LIB_MIN_ROWS rows).
// Shapes are SmolLM2-135M's projections (Q4_1, f32 activations) at 128 to
// 8,192 rows; then every format and activation type on one shape for
// agreement only. Weights and activations are synthetic.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/rlx-cuda/kernels -o pm bench/prefill-matmul.cu -lcublasLt && ./pm
//   PM_AGREE_ONLY=1 ./pm    # the agreement checks only
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "qmma.cu"
#include "qlib.cu"
#include <cublasLt.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

typedef void (*QK)(const QMatMulP);
#define LK(x) do { cublasStatus_t e = (x); if (e != CUBLAS_STATUS_SUCCESS) { printf("%s:%d cublasLt %d\n", __FILE__, __LINE__, (int)e); exit(1);} } while (0)

static cublasLtHandle_t g_lt;
static void* g_ws;
static const size_t G_WS = 32 << 20;

// The library form's kernels for one format and activation type.
struct Lib { void (*prep)(const QPrepP); void (*deq)(const QDequantP); void (*glu)(const QGluP); };

template <typename T> static cudaDataType_t cdt();
template <> cudaDataType_t cdt<float>() { return CUDA_R_32F; }
template <> cudaDataType_t cdt<__half>() { return CUDA_R_16F; }
template <> cudaDataType_t cdt<__nv_bfloat16>() { return CUDA_R_16BF; }

// out[rows, n] = a'[rows, k] · w'[n, k]ᵀ as src/blas.rs `MatMulPlan::decoded` sets it up.
struct LtMm {
    cublasLtMatmulDesc_t desc; cublasLtMatrixLayout_t l[4]; cublasLtMatmulAlgo_t algo; float beta;
    LtMm(int rows, int n, int k, cudaDataType_t in, cudaDataType_t out, bool residual) {
        LK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        int t = 1, nt = 0;
        LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, 4));
        LK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nt, 4));
        LK(cublasLtMatrixLayoutCreate(&l[0], in, k, n, k));
        LK(cublasLtMatrixLayoutCreate(&l[1], in, k, rows, k));
        LK(cublasLtMatrixLayoutCreate(&l[2], out, n, rows, n));
        LK(cublasLtMatrixLayoutCreate(&l[3], out, n, rows, n));
        cublasLtMatmulPreference_t pref; LK(cublasLtMatmulPreferenceCreate(&pref));
        size_t w = G_WS; LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, 8));
        cublasLtMatmulHeuristicResult_t h; int found = 0;
        LK(cublasLtMatmulAlgoGetHeuristic(g_lt, desc, l[0], l[1], l[2], l[3], pref, 1, &h, &found));
        if (!found) { printf("no cuBLASLt algorithm\n"); exit(1); }
        algo = h.algo; beta = residual ? 1.0f : 0.0f;
        cublasLtMatmulPreferenceDestroy(pref);
    }
    void run(const void* a, const void* w, const void* c, void* d) {
        float alpha = 1.0f;
        LK(cublasLtMatmul(g_lt, desc, &alpha, w, l[0], a, l[1], &beta, c, l[2], d, l[3], &algo, g_ws, G_WS, 0));
    }
};

static unsigned rng = 12345;
static unsigned next() { rng = rng * 1664525u + 1013904223u; return rng >> 8; }

// Random blocks with sane f16 scales (0.0625, min -0.0625).
static unsigned char* make_weights(size_t rows, int k, int f) {
    int be = (f == QF_Q4K || f == QF_Q6K) ? 256 : 32;
    int bb = f == QF_Q4_0 ? 18 : f == QF_Q4_1 ? 20 : f == QF_Q5_0 ? 22 : f == QF_Q5_1 ? 24 : f == QF_Q8_0 ? 34 : f == QF_Q4K ? 144 : 210;
    size_t blocks = rows * (k / be), bytes = blocks * bb;
    std::vector<unsigned char> h(bytes);
    for (size_t i = 0; i < bytes; i++) h[i] = next() & 0xFF;
    for (size_t b = 0; b < blocks; b++) {
        unsigned char* p = h.data() + b * bb;
        if (f == QF_Q6K) { p[208] = 0x00; p[209] = 0x20; continue; }
        p[0] = 0x00; p[1] = 0x2C;
        if (f == QF_Q4_1 || f == QF_Q5_1 || f == QF_Q4K) { p[2] = 0x00; p[3] = 0xAC; }
    }
    unsigned char* d; CK(cudaMalloc(&d, bytes)); CK(cudaMemcpy(d, h.data(), bytes, cudaMemcpyHostToDevice));
    return d;
}

template <typename T> static T conv(float v);
template <> float conv<float>(float v) { return v; }
template <> __half conv<__half>(float v) { return __float2half(v); }
template <> __nv_bfloat16 conv<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <typename T> static float back(T v);
template <> float back<float>(float v) { return v; }
template <> float back<__half>(__half v) { return __half2float(v); }
template <> float back<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
static T* make_act(size_t n, float scale) {
    std::vector<T> h(n);
    for (size_t i = 0; i < n; i++) h[i] = conv<T>(((int)(next() % 2001) - 1000) * scale / 1000.0f);
    T* d; CK(cudaMalloc(&d, n * sizeof(T))); CK(cudaMemcpy(d, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

static int row_bytes(int f, int k) {
    int be = (f == QF_Q4K || f == QF_Q6K) ? 256 : 32;
    int bb = f == QF_Q4_0 ? 18 : f == QF_Q4_1 ? 20 : f == QF_Q5_0 ? 22 : f == QF_Q5_1 ? 24 : f == QF_Q8_0 ? 34 : f == QF_Q4K ? 144 : 210;
    return k / be * bb;
}

static void launch(QK fn, dim3 grid, int threads, const QMatMulP& p) {
    void* args[] = {(void*)&p};
    CK(cudaLaunchKernel((const void*)fn, grid, dim3(threads), args, 0, 0));
}

struct Case { const char* what; int n, k, glu, norm, res; };

// Runs both on one problem: agreement, or times (median of 30 launches each).
template <typename T>
static void run(QK qmma, Lib lib, int f, const Case& c, int rows, bool timed, const char* fname, const char* tname) {
    typedef typename MmaIn<T>::type M;
    int wrows = c.glu ? 2 * c.n : c.n;
    unsigned char* w = make_weights(wrows, c.k, f);
    T* a = make_act<T>((size_t)rows * c.k, 1.0f);
    T* gamma = make_act<T>(c.k, 1.5f);
    T* res = make_act<T>((size_t)rows * c.n, 1.0f);
    T *o1, *o3;
    CK(cudaMalloc(&o1, (size_t)rows * c.n * sizeof(T)));
    CK(cudaMalloc(&o3, (size_t)rows * c.n * sizeof(T)));
    M *sa, *sw; float* sg;
    CK(cudaMalloc(&sa, (size_t)rows * c.k * sizeof(M)));
    CK(cudaMalloc(&sw, (size_t)wrows * c.k * sizeof(M)));
    CK(cudaMalloc(&sg, (size_t)rows * wrows * sizeof(float)));
    QMatMulP p = {};
    p.a = a; p.w = w; p.gamma = c.norm ? gamma : nullptr; p.res = c.res ? res : nullptr;
    p.rows = rows; p.n = c.n; p.k = c.k; p.lda = c.k; p.row_bytes = row_bytes(f, c.k); p.glu = c.glu; p.eps = 1e-5;
    dim3 g1((c.n + 15) / 16, std::min((rows + 31) / 32, 65535));
    p.out = o1; launch(qmma, g1, 256, p);
    // The library form, launched as src/decode.rs `library_steps` does.
    LtMm mm(rows, wrows, c.k, cdt<M>(), c.glu ? CUDA_R_32F : cdt<T>(), c.res && !c.glu);
    QPrepP pp = {a, p.gamma, sa, rows, c.k, c.k, 1e-5};
    QDequantP dp = {w, sw, wrows, c.k, row_bytes(f, c.k)};
    QGluP gp = {sg, o3, p.res, rows, c.n};
    auto library = [&]() {
        void* a1[] = {(void*)&pp}; CK(cudaLaunchKernel((const void*)lib.prep, dim3(std::min((rows + 7) / 8, 132 * 16)), dim3(256), a1, 0, 0));
        const size_t items = (size_t)wrows * c.k / 8;
        void* a2[] = {(void*)&dp}; CK(cudaLaunchKernel((const void*)lib.deq, dim3(std::min<size_t>((items + 255) / 256, 132 * 32)), dim3(256), a2, 0, 0));
        if (c.glu) {
            mm.run(sa, sw, sg, sg);
            const size_t on = (size_t)rows * c.n;
            void* a3[] = {(void*)&gp}; CK(cudaLaunchKernel((const void*)lib.glu, dim3(std::min<size_t>((on + 255) / 256, 132 * 32)), dim3(256), a3, 0, 0));
        } else {
            mm.run(sa, sw, c.res ? (const void*)res : (const void*)o3, o3);
        }
    };
    library();
    CK(cudaDeviceSynchronize());
    size_t n = (size_t)rows * c.n;
    std::vector<T> h1(n), h3(n);
    CK(cudaMemcpy(h1.data(), o1, n * sizeof(T), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h3.data(), o3, n * sizeof(T), cudaMemcpyDeviceToHost));
    // Outputs past the type's range (f16 overflows on these random
    // weights) must overflow the same way in both, but for values within
    // 1% of f16's largest (the two round in different orders, so a sum at
    // the edge may land on either side).
    auto agree = [&](const std::vector<T>& h2) {
        double md = 0, mr = 0;
        size_t overflow = 0;
        for (size_t i = 0; i < n; i++) {
            double x = back<T>(h1[i]), y = back<T>(h2[i]);
            if (!std::isfinite(x) || !std::isfinite(y)) {
                const double fin = std::isfinite(x) ? x : y, inf = std::isfinite(x) ? y : x;
                const bool edge = sizeof(T) == 2 && std::isfinite(fin) && std::fabs(fin) >= 0.99 * 65504.0 && (fin > 0) == (inf > 0);
                if (x == y || edge) { overflow++; continue; }
                md = INFINITY; break;
            }
            md = std::max(md, std::fabs(x - y)); mr = std::max(mr, std::fabs(x));
        }
        if (overflow) printf("(%zu outputs overflow %s in both) ", overflow, sizeof(T) == 2 ? "16 bits" : "f32");
        return md / std::max(mr, 1e-30);
    };
    double rel3 = agree(h3);
    if (!timed) {
        printf("%-6s %-5s %-28s rows %5d: max |library - qmma| / max |qmma| = %.2e %s\n", fname, tname, c.what, rows, rel3, rel3 < 2e-2 ? "ok" : "MISMATCH");
    } else {
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        float us[2];
        for (int v = 0; v < 2; v++) {
            std::vector<float> ts;
            for (int r = 0; r < 30; r++) {
                CK(cudaEventRecord(e0));
                if (v == 0) { p.out = o1; launch(qmma, g1, 256, p); }
                else library();
                CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
                float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000.0f);
            }
            std::sort(ts.begin(), ts.end()); us[v] = ts[ts.size() / 2];
        }
        double flop = 2.0 * rows * (double)wrows * c.k;
        printf("| %s | %d | %.1f | %.1f | %.2f× | %.0f / %.0f | %.1e |\n", c.what, rows, us[0], us[1], us[0] / us[1], flop / us[0] / 1e6, flop / us[1] / 1e6, rel3);
    }
    cudaFree(w); cudaFree(a); cudaFree(gamma); cudaFree(res); cudaFree(o1); cudaFree(o3); cudaFree(sa); cudaFree(sw); cudaFree(sg);
}

int main() {
    const Case shapes[] = {
        {"qkv 576→960, norm", 960, 576, 0, 1, 0},
        {"o 576→576, residual", 576, 576, 0, 0, 1},
        {"gate/up 576→2×1536, norm", 1536, 576, 1, 1, 0},
        {"down 1536→576, residual", 576, 1536, 0, 0, 1},
    };
    LK(cublasLtCreate(&g_lt));
    CK(cudaMalloc(&g_ws, G_WS));
    printf("Q4_1, f32 activations; median of 30 launches (µs); TFLOP/s\n\n");
    printf("| projection | rows | qmma µs | library µs | speedup | TFLOP/s qmma / library | max rel diff |\n|---|---:|---:|---:|---:|---:|---:|\n");
    const Lib q41 = {qprep_f32, qdequant_q4_1_f16, qglu_f32};
    for (int rows : {128, 256, 512, 1024, 2048, 4096, 8192})
        for (const Case& c : shapes)
            if (!getenv("PM_AGREE_ONLY")) run<float>(qmma_q4_1_r32_f32, q41, QF_Q4_1, c, rows, true, "q4_1", "f32");
    printf("\nAgreement, every format and activation type (k 1024, 300 and 37 rows, n 200 and 72):\n");
    const Case a1 = {"n 200, norm + gate", 200, 1024, 1, 1, 0}, a2 = {"n 72, residual", 72, 1024, 0, 0, 1};
#define AGREE(FN, F)                                                                                      \
    for (const Case* c : {&a1, &a2})                                                                      \
        for (int rows : {300, 37}) {                                                                      \
            run<float>(qmma_##FN##_r32_f32, {qprep_f32, qdequant_##FN##_f16, qglu_f32}, F, *c, rows, false, #FN, "f32"); \
            run<__half>(qmma_##FN##_r32_f16, {qprep_f16, qdequant_##FN##_f16, qglu_f16}, F, *c, rows, false, #FN, "f16"); \
            run<__nv_bfloat16>(qmma_##FN##_r32_bf16, {qprep_bf16, qdequant_##FN##_bf16, qglu_bf16}, F, *c, rows, false, #FN, "bf16"); \
        }
    AGREE(q4_0, QF_Q4_0) AGREE(q4_1, QF_Q4_1) AGREE(q5_0, QF_Q5_0) AGREE(q5_1, QF_Q5_1) AGREE(q8_0, QF_Q8_0)
    AGREE(q4_k, QF_Q4K) AGREE(q6_k, QF_Q6K)
    return 0;
}
