// Times the two tensor-core quantized matmuls against each other on a
// prefill's shapes, and checks that they agree: qmma (kernels/qmma.cu,
// operands straight from global memory, 32 rows a block) and qgemm
// (kernels/qgemm.cu, shared-memory tiles of 128 rows × 64 columns). Shapes
// are SmolLM2-135M's projections (Q4_1, f32 activations) at 128 to 8,192
// rows; then every format and activation type on one shape for agreement
// only. Weights and activations are synthetic.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/rlx-cuda/kernels -o pm bench/prefill-matmul.cu && ./pm
//   PM_AGREE_ONLY=1 ./pm    # the agreement checks only
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "qmma.cu"
#include "qgemm.cu"
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

typedef void (*QK)(const QMatMulP);

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

// Runs both kernels on one problem; returns (qmma µs, qgemm µs, max |diff| / max |ref|).
template <typename T>
static void run(QK qmma, QK qgemm, int f, const Case& c, int rows, bool timed, const char* fname, const char* tname) {
    int wrows = c.glu ? 2 * c.n : c.n;
    unsigned char* w = make_weights(wrows, c.k, f);
    T* a = make_act<T>((size_t)rows * c.k, 1.0f);
    T* gamma = make_act<T>(c.k, 1.5f);
    T* res = make_act<T>((size_t)rows * c.n, 1.0f);
    T *o1, *o2;
    CK(cudaMalloc(&o1, (size_t)rows * c.n * sizeof(T)));
    CK(cudaMalloc(&o2, (size_t)rows * c.n * sizeof(T)));
    QMatMulP p = {};
    p.a = a; p.w = w; p.gamma = c.norm ? gamma : nullptr; p.res = c.res ? res : nullptr;
    p.rows = rows; p.n = c.n; p.k = c.k; p.lda = c.k; p.row_bytes = row_bytes(f, c.k); p.glu = c.glu; p.eps = 1e-5;
    dim3 g1((c.n + 15) / 16, std::min((rows + 31) / 32, 65535)), g2((c.n + 63) / 64, std::min((rows + 127) / 128, 65535));
    p.out = o1; launch(qmma, g1, 256, p);
    p.out = o2; launch(qgemm, g2, 256, p);
    CK(cudaDeviceSynchronize());
    size_t n = (size_t)rows * c.n;
    std::vector<T> h1(n), h2(n);
    CK(cudaMemcpy(h1.data(), o1, n * sizeof(T), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h2.data(), o2, n * sizeof(T), cudaMemcpyDeviceToHost));
    // Outputs past the type's range (f16 overflows on these random
    // weights) must overflow the same way in both.
    double md = 0, mr = 0;
    size_t overflow = 0;
    for (size_t i = 0; i < n; i++) {
        double x = back<T>(h1[i]), y = back<T>(h2[i]);
        if (!std::isfinite(x) || !std::isfinite(y)) {
            if (x == y) { overflow++; continue; }
            md = INFINITY; break;
        }
        md = std::max(md, std::fabs(x - y)); mr = std::max(mr, std::fabs(x));
    }
    if (overflow) printf("(%zu outputs overflow %s in both) ", overflow, sizeof(T) == 2 ? "16 bits" : "f32");
    double rel = md / std::max(mr, 1e-30);
    if (!timed) {
        printf("%-6s %-5s %-28s rows %5d: max |qmma - qgemm| / max |qmma| = %.2e %s\n", fname, tname, c.what, rows, rel, rel < 2e-2 ? "ok" : "MISMATCH");
    } else {
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        float us[2];
        for (int v = 0; v < 2; v++) {
            std::vector<float> ts;
            for (int r = 0; r < 30; r++) {
                CK(cudaEventRecord(e0));
                if (v == 0) { p.out = o1; launch(qmma, g1, 256, p); } else { p.out = o2; launch(qgemm, g2, 256, p); }
                CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
                float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms * 1000.0f);
            }
            std::sort(ts.begin(), ts.end()); us[v] = ts[ts.size() / 2];
        }
        double flop = 2.0 * rows * (double)wrows * c.k;
        printf("| %s | %d | %.1f | %.1f | %.2f× | %.0f / %.0f | %.1e |\n", c.what, rows, us[0], us[1], us[0] / us[1], flop / us[0] / 1e6, flop / us[1] / 1e6, rel);
    }
    cudaFree(w); cudaFree(a); cudaFree(gamma); cudaFree(res); cudaFree(o1); cudaFree(o2);
}

int main() {
    const Case shapes[] = {
        {"qkv 576→960, norm", 960, 576, 0, 1, 0},
        {"o 576→576, residual", 576, 576, 0, 0, 1},
        {"gate/up 576→2×1536, norm", 1536, 576, 1, 1, 0},
        {"down 1536→576, residual", 576, 1536, 0, 0, 1},
    };
    printf("Q4_1, f32 activations; median of 30 launches (µs); TFLOP/s\n\n");
    printf("| projection | rows | qmma µs | qgemm µs | speedup | TFLOP/s qmma / qgemm | max rel diff |\n|---|---:|---:|---:|---:|---:|---:|\n");
    for (int rows : {128, 512, 2048, 4096, 8192})
        for (const Case& c : shapes)
            if (!getenv("PM_AGREE_ONLY")) run<float>(qmma_q4_1_r32_f32, qgemm_q4_1_m128_f32, QF_Q4_1, c, rows, true, "q4_1", "f32");
    printf("\nAgreement, every format and activation type (k 1024, 300 and 37 rows, n 200 and 72):\n");
    const Case a1 = {"n 200, norm + gate", 200, 1024, 1, 1, 0}, a2 = {"n 72, residual", 72, 1024, 0, 0, 1};
#define AGREE(FN, F)                                                                                      \
    for (const Case* c : {&a1, &a2})                                                                      \
        for (int rows : {300, 37}) {                                                                      \
            run<float>(qmma_##FN##_r32_f32, qgemm_##FN##_m128_f32, F, *c, rows, false, #FN, "f32");      \
            run<__half>(qmma_##FN##_r32_f16, qgemm_##FN##_m128_f16, F, *c, rows, false, #FN, "f16");     \
            run<__nv_bfloat16>(qmma_##FN##_r32_bf16, qgemm_##FN##_m128_bf16, F, *c, rows, false, #FN, "bf16"); \
        }
    AGREE(q4_0, QF_Q4_0) AGREE(q4_1, QF_Q4_1) AGREE(q5_0, QF_Q5_0) AGREE(q5_1, QF_Q5_1) AGREE(q8_0, QF_Q8_0)
    AGREE(q4_k, QF_Q4K) AGREE(q6_k, QF_Q6K)
    return 0;
}
