// Times the decode step's layer projections (SmolLM2-135M's shapes, Q4_1,
// f32 activations, batch 1) under each launch configuration the CUDA
// backend could pick for them: threads per block, one column a warp
// (qmatvec_*), four columns a warp read in place (qmatvec_w4_*) or staged
// in shared memory (qmatvec_s4_*). Each case is a CUDA graph of 30
// programmatic-dependent launches (as in bench/decode-kernels.cu), and the
// 120-launch layer chain is timed under whole configurations.
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/rlx-cuda/kernels -o sweep bench/decode-matvec-sweep.cu && ./sweep
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#include "decode.cu"
#include "decode-bench.cuh"

extern "C" __global__ void empty_pdl(const QMatMulP p) { pdl_enter(); }

struct Shape { const char* name; int n, k, glu, norm, res; };
// A way to launch one projection: kernel, columns a warp, threads, staged.
struct Cfg { const char* name; QK k; int cpw, threads, staged; };

static float *xa, *xb, *gamma_;
static std::vector<unsigned char*> W[4];
static const Shape S[4] = {
    {"qkv k576 n960 norm", 960, 576, 0, 1, 0},
    {"o k576 n576 res", 576, 576, 0, 0, 1},
    {"gateup k576 n1536 glu norm", 1536, 576, 1, 1, 0},
    {"down k1536 n576 res", 576, 1536, 0, 0, 1},
};

static void add(cudaStream_t st, int j, int l, const Cfg& c, int cnt, float* out_check) {
    const Shape& m = S[j];
    QMatMulP p = {};
    p.a = (cnt & 1) ? xb : xa; p.out = out_check ? out_check : ((cnt & 1) ? xa : xb); p.w = W[j][l];
    p.gamma = m.norm ? gamma_ : nullptr; p.res = m.res ? ((cnt & 1) ? xb : xa) : nullptr;
    p.rows = 1; p.n = m.n; p.k = m.k; p.lda = m.k; p.row_bytes = (m.k / 32) * 20; p.glu = m.glu; p.eps = 1e-5;
    void* args[] = {&p};
    const int cols = (c.threads / 32) * c.cpw;
    const int smem = c.staged ? cols * (int)p.row_bytes : 0;
    launch(st, (const void*)c.k, dim3((m.n + cols - 1) / cols), c.threads, smem, args);
}

int main() {
    cudaStream_t st; CK(cudaStreamCreate(&st));
    CK(cudaMalloc(&xa, 1 << 20)); CK(cudaMalloc(&xb, 1 << 20)); CK(cudaMalloc(&gamma_, 1 << 16));
    std::vector<float> hx(1 << 18); for (size_t i = 0; i < hx.size(); i++) hx[i] = ((i * 7919) % 1000) / 1000.0f - 0.5f;
    CK(cudaMemcpy(gamma_, hx.data(), 1 << 16, cudaMemcpyHostToDevice));
    for (int l = 0; l < 30; l++) for (int j = 0; j < 4; j++) W[j].push_back(make_weights((size_t)S[j].n * (S[j].glu ? 2 : 1), S[j].k, 20, 0));
    // The configurations each shape may take (w4/s4: no gate, k <= 1024).
    std::vector<Cfg> c576 = {
        {"qmatvec  64 thr", qmatvec_q4_1_c4_f32, 1, 64, 0}, {"qmatvec 128 thr", qmatvec_q4_1_c4_f32, 1, 128, 0},
        {"qmatvec 256 thr", qmatvec_q4_1_c4_f32, 1, 256, 0}, {"qmatvec 512 thr", qmatvec_q4_1_c4_f32, 1, 512, 0},
        {"w4 128 thr", qmatvec_w4_q4_1_c4_f32, 4, 128, 0}, {"w4 256 thr", qmatvec_w4_q4_1_c4_f32, 4, 256, 0},
        {"s4 128 thr", qmatvec_s4_q4_1_c4_f32, 4, 128, 1}, {"s4 256 thr", qmatvec_s4_q4_1_c4_f32, 4, 256, 1},
        {"w4  64 thr", qmatvec_w4_q4_1_c4_f32, 4, 64, 0}, {"s4  64 thr", qmatvec_s4_q4_1_c4_f32, 4, 64, 1},
    };
    std::vector<Cfg> c1536 = {
        {"qmatvec  64 thr", qmatvec_q4_1_c8_f32, 1, 64, 0}, {"qmatvec 128 thr", qmatvec_q4_1_c8_f32, 1, 128, 0},
        {"qmatvec 256 thr", qmatvec_q4_1_c8_f32, 1, 256, 0}, {"qmatvec 512 thr", qmatvec_q4_1_c8_f32, 1, 512, 0},
    };
    for (int j = 0; j < 4; j++) {
        const std::vector<Cfg>& cs = S[j].k == 1536 ? c1536 : c576;
        for (const Cfg& c : cs) {
            if (S[j].glu && c.cpw != 1) continue;
            if (c.staged) CK(cudaFuncSetAttribute((const void*)c.k, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 * 1024));
            // Same output as the default configuration?
            float *o1, *o2; CK(cudaMalloc(&o1, 4 * 2048)); CK(cudaMalloc(&o2, 4 * 2048));
            CK(cudaMemcpy(xa, hx.data(), 1 << 20, cudaMemcpyHostToDevice));
            add(st, j, 0, c, 0, o1); add(st, j, 0, cs[2], 0, o2); CK(cudaStreamSynchronize(st));
            std::vector<float> h1(S[j].n), h2(S[j].n);
            CK(cudaMemcpy(h1.data(), o1, 4 * S[j].n, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(h2.data(), o2, 4 * S[j].n, cudaMemcpyDeviceToHost));
            int diff = 0; for (int i = 0; i < S[j].n; i++) diff += h1[i] != h2[i];
            cudaGraph_t g; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int l = 0; l < 30; l++) add(st, j, l, c, l, nullptr);
            CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
            float us = time_graph(st, ge, 200);
            printf("%-28s %-16s %5.2f us each (%d outputs differ from qmatvec 256)\n", S[j].name, c.name, us / 30, diff);
        }
    }
    // Whole 120-launch layer chains.
    struct Chain { const char* name; Cfg c[4]; };
    Chain chains[] = {
        {"landed (qmatvec 256 all)", {c576[2], c576[2], c576[2], c1536[2]}},
        {"qmatvec 128 all", {c576[1], c576[1], c576[1], c1536[1]}},
        {"qmatvec 64 all", {c576[0], c576[0], c576[0], c1536[0]}},
        {"w4 256 qkv+o", {c576[5], c576[5], c576[2], c1536[2]}},
        {"s4 256 qkv+o", {c576[7], c576[7], c576[2], c1536[2]}},
        {"w4 128 qkv+o, 128 rest", {c576[4], c576[4], c576[1], c1536[1]}},
        {"s4 128 qkv+o, 128 rest", {c576[6], c576[6], c576[1], c1536[1]}},
    };
    for (int rep = 0; rep < 2; rep++) for (const Chain& ch : chains) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        int cnt = 0;
        for (int l = 0; l < 30; l++) for (int j = 0; j < 4; j++) add(st, j, l, ch.c[j], cnt++, nullptr);
        CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
        float us = time_graph(st, ge, 200);
        printf("chain %-30s 120 launches: %6.1f us, %5.2f us each\n", ch.name, us, us / 120);
    }
    // The launch floor at the projections' grid sizes.
    for (int blocks : {9, 72, 120, 192}) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        QMatMulP p = {}; void* args[] = {&p};
        for (int l = 0; l < 30; l++) launch(st, (const void*)empty_pdl, dim3(blocks), 256, 0, args);
        CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
        float us = time_graph(st, ge, 200);
        printf("empty kernel %3d blocks of 256   %5.2f us each\n", blocks, us / 30);
    }
    return 0;
}
