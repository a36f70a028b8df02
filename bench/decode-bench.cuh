// Shared by bench/decode-kernels.cu and bench/decode-matvec-sweep.cu:
// error checks, synthetic quantized weights, programmatic-dependent
// launches and CUDA-graph timing. Include after the kernel files.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

typedef void (*QK)(const QMatMulP);
static unsigned char* make_weights(size_t rows, int k, int bb, int q8) {
    size_t blocks = rows * (k / 32), bytes = blocks * bb;
    std::vector<unsigned char> h(bytes);
    unsigned s = 12345;
    for (size_t i = 0; i < bytes; i++) { s = s * 1664525u + 1013904223u; h[i] = s >> 24; }
    for (size_t b = 0; b < blocks; b++) {
        unsigned char* p = h.data() + b * bb;
        p[0] = 0x00; p[1] = 0x2C;               // d = 0.0625
        if (!q8) { p[2] = 0x00; p[3] = 0xAC; }  // m = -0.0625
    }
    unsigned char* d; CK(cudaMalloc(&d, bytes)); CK(cudaMemcpy(d, h.data(), bytes, cudaMemcpyHostToDevice));
    return d;
}

static void launch(cudaStream_t st, const void* fn, dim3 grid, int threads, int smem, void** args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid; cfg.blockDim = dim3(threads); cfg.dynamicSmemBytes = smem; cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    CK(cudaLaunchKernelExC(&cfg, fn, args));
}

static float time_graph(cudaStream_t st, cudaGraphExec_t ge, int reps) {
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    for (int i = 0; i < 5; i++) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < reps; i++) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms * 1000.0f / reps;
}

