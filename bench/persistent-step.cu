// Micro-benchmark (tried, then removed): the cost of one dependent stage run
// as (a) CUDA graph kernels, (b) the same with programmatic dependent launch,
// (c) stages of one persistent kernel whose blocks wait on a counter.
// nvcc -O3 -arch=sm_90 bench/persistent-step.cu && ./a.out
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
constexpr int K = 576;
constexpr int PER = K / 32;
__device__ __forceinline__ void pdl() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
    return v;
}
__device__ __forceinline__ void stage_body(const float* in, float* out, const float* w, int N, int col, int lane, float* wr) {
    float acc = 0;
#pragma unroll
    for (int i = 0; i < PER; i++) acc += wr[i] * __ldcg(in + lane + 32 * i);
    acc = warp_sum(acc);
    if (lane == 0) out[col] = acc * (1.0f / 24.0f) + 0.5f;
}
template <bool PDL>
__global__ void stage_k(const float* in, float* out, const float* w, int N) {
    int lane = threadIdx.x & 31, col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    float wr[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) wr[i] = col < N ? w[(size_t)col * K + lane + 32 * i] : 0.f;
    if (PDL) pdl();
    if (col >= N) return;
    stage_body(in, out, w, N, col, lane, wr);
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void red_release(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Persistent: block b owns columns; stage s reads buf[s&1], writes buf[(s+1)&1].
__global__ void persist(float* buf, const float* w, int N, int stages, unsigned* counter, unsigned base) {
    int lane = threadIdx.x & 31, nw = blockDim.x / 32;
    for (int s = 0; s < stages; s++) {
        const float* in = buf + (s & 1) * N;
        float* out = buf + ((s + 1) & 1) * N;
        const float* ws = w + (size_t)s * N * K;
        for (int col0 = blockIdx.x * nw; col0 < N; col0 += gridDim.x * nw) {
            int col = col0 + threadIdx.x / 32;
            float wr[PER];
#pragma unroll
            for (int i = 0; i < PER; i++) wr[i] = col < N ? ws[(size_t)col * K + lane + 32 * i] : 0.f;
            if (col0 == blockIdx.x * nw && s > 0) {
                if (threadIdx.x == 0) {
                    unsigned target = base + (unsigned)s * gridDim.x;
                    while ((int)(ld_acquire(counter) - target) < 0) {}
                }
                __syncthreads();
            }
            if (col < N) stage_body(in, out, ws, N, col, lane, wr);
        }
        __syncthreads();
        if (threadIdx.x == 0) red_release(counter, 1);
    }
}

// Single-block argmax over V floats: plain strided loop vs float4 x 4 unrolled.
template <int MODE>
__global__ void argmax1(const float* x, int V, int* out) {
    float best = -INFINITY; int bi = 0;
    if (MODE == 0) {
        for (int i = threadIdx.x; i < V; i += blockDim.x) { float v = x[i]; if (v > best) { best = v; bi = i; } }
    } else {
        const float4* x4 = (const float4*)x; int V4 = V / 4;
        for (int i0 = threadIdx.x; i0 < V4; i0 += blockDim.x * 4) {
            float4 r[4];
#pragma unroll
            for (int u = 0; u < 4; u++) { int i = i0 + u * blockDim.x; r[u] = i < V4 ? x4[i] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY); }
#pragma unroll
            for (int u = 0; u < 4; u++) { int i = 4 * (i0 + u * blockDim.x);
                if (r[u].x > best) { best = r[u].x; bi = i; } if (r[u].y > best) { best = r[u].y; bi = i + 1; }
                if (r[u].z > best) { best = r[u].z; bi = i + 2; } if (r[u].w > best) { best = r[u].w; bi = i + 3; } }
        }
    }
    for (int o = 16; o; o >>= 1) { float ov = __shfl_xor_sync(~0u, best, o); int oi = __shfl_xor_sync(~0u, bi, o); if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; } }
    __shared__ float sv[32]; __shared__ int si[32];
    if ((threadIdx.x & 31) == 0) { sv[threadIdx.x >> 5] = best; si[threadIdx.x >> 5] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) { for (int w = 1; w < blockDim.x / 32; w++) if (sv[w] > best || (sv[w] == best && si[w] < bi)) { best = sv[w]; bi = si[w]; } *out = bi; }
}
int main() {

    int N = 576, S = 150, reps = 200;
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    float *buf, *w; unsigned* counter;
    CK(cudaMalloc(&buf, 2 * N * 4 * (S + 1)));
    CK(cudaMalloc(&w, (size_t)S * N * K * 4));
    CK(cudaMalloc(&counter, 4));
    CK(cudaMemset(counter, 0, 4));
    std::vector<float> h((size_t)S * N * K);
    for (size_t i = 0; i < h.size(); i++) h[i] = ((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    CK(cudaMemcpy(w, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(buf, 0, 2 * N * 4 * (S + 1)));
    cudaStream_t st; CK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    for (int mode = 0; mode < 2; mode++) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int s = 0; s < S; s++) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3((N + 7) / 8); cfg.blockDim = dim3(256); cfg.stream = st;
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
            cfg.attrs = at; cfg.numAttrs = mode;
            const float* in = buf + (s & 1) * N; float* out = buf + ((s + 1) & 1) * N; const float* ws = w + (size_t)s * N * K;
            if (mode) CK(cudaLaunchKernelEx(&cfg, stage_k<true>, in, out, ws, N));
            else CK(cudaLaunchKernelEx(&cfg, stage_k<false>, in, out, ws, N));
        }
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        for (int i = 0; i < 20; i++) CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < reps; i++) CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
        printf("graph %s: %.2f us per stage (%.1f us per graph of %d)\n", mode ? "PDL" : "plain", ms * 1000 / reps / S, ms * 1000 / reps, S);
    }
    float ref = 0; CK(cudaMemcpy(&ref, buf + 7, 4, cudaMemcpyDeviceToHost));
    for (int grid : {72, sms, 36, 18}) {
        for (int threads : {256, 512}) {
            unsigned base = 0;
            CK(cudaMemset(counter, 0, 4));
            for (int i = 0; i < 20; i++) { persist<<<grid, threads, 0, st>>>(buf, w, N, S, counter, base); base += S * grid; }
            CK(cudaEventRecord(e0, st));
            for (int i = 0; i < reps; i++) { persist<<<grid, threads, 0, st>>>(buf, w, N, S, counter, base); base += S * grid; }
            CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
            float v = 0; CK(cudaMemcpy(&v, buf + 7, 4, cudaMemcpyDeviceToHost));
            printf("persistent grid %d x %d: %.2f us per stage (%.1f per launch) value %g vs graph %g\n", grid, threads, ms * 1000 / reps / S, ms * 1000 / reps, v, ref);
        }
    }

    {
        int V = 49152; float* lg; int* oi; CK(cudaMalloc(&lg, V * 4)); CK(cudaMalloc(&oi, 4));
        std::vector<float> hl(V); for (int i = 0; i < V; i++) hl[i] = ((i * 7919) % 10007) / 10007.0f; CK(cudaMemcpy(lg, hl.data(), V * 4, cudaMemcpyHostToDevice));
        for (int mode = 0; mode < 2; mode++) {
            cudaGraph_t g; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int r = 0; r < 50; r++) { if (mode) argmax1<1><<<1, 512, 0, st>>>(lg, V, oi); else argmax1<0><<<1, 512, 0, st>>>(lg, V, oi); }
            CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
            for (int i = 0; i < 5; i++) CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(e0, st));
            for (int i = 0; i < 20; i++) CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); int h; CK(cudaMemcpy(&h, oi, 4, cudaMemcpyDeviceToHost));
            printf("argmax 1 block x 512, mode %d: %.2f us per kernel (argmax %d)\n", mode, ms * 1000 / 20 / 50, h);
        }
    }
    return 0;
}
