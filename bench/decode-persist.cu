// An experiment: SmolLM2-135M's 30 decoder layers at batch 1 (Q4_1
// weights, f16 KV cache, ~70 keys) run by ONE persistent kernel, a block
// per SM, the stages separated by a grid-wide barrier, against the recorded
// chain of programmatic-dependent launches a decode step is today (qkv with
// the norm, the attention append, o with the residual, gate/up with the
// norm and SwiGLU, down with the residual).
//
// Both run the very same kernel bodies (decode.cu's qmatvec_body,
// attention_dec.cu's attention_app_body), so both must give the same bits:
// the harness checks that first. In the persistent kernel a body's
// `blockIdx` is the virtual block the real block runs, and the body's
// `pdl_enter()` (where a chained kernel waits for the one before) is the
// grid barrier: each block issues the weight loads of its next stage before
// it waits at the barrier, as a chained kernel does before its wait.
//
// It answers whether a persistent decode step (the decode-speed issue's
// "persistent kernel that executes the whole decode schedule") is worth
// building: µs per layer, per stage and per bare barrier, both ways.
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -I crates/rlx-cuda/kernels -o dpersist bench/decode-persist.cu && ./dpersist
// (scripts/check-harnesses compiles it without a GPU.) The chained kernels
// are this file's build of the bodies (the redirections cost the 16-warp
// append a few stack bytes); the persistent kernel with the append runs
// each body as a call (inlined together they spill), so the cleanest
// comparison is the one without the append.
#include <cmath>
#include <cstring>
#define KERNEL_PART 0
#include "common.cuh"

// 1 while the persistent kernel runs (set before each launch; the chained
// kernels read 0 and behave as built).
__constant__ int c_persist;
__device__ unsigned g_bar;                // arrivals; a launch starts at the count the one before left
static __shared__ unsigned s_bar_target;  // this block's next barrier count
static __shared__ uint3 s_vblk;           // the virtual block a persistent block runs
static __shared__ int s_wait;             // whether that block is the stage's first here (it waits at the barrier)

__device__ __forceinline__ uint3 rlx_block() {
    if (c_persist) return s_vblk;
    uint3 r;
    asm("mov.u32 %0, %%ctaid.x;" : "=r"(r.x));
    asm("mov.u32 %0, %%ctaid.y;" : "=r"(r.y));
    asm("mov.u32 %0, %%ctaid.z;" : "=r"(r.z));
    return r;
}

// Every block arrives once the block's threads are done (thread 0's
// release add orders the block's stores, seen through the block barrier,
// before its arrival), then waits until every block of the grid has
// arrived. The count only grows: a launch starts from the count the one
// before left (`base`), so no reset runs between launches.
__device__ __forceinline__ void grid_barrier() {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned target = s_bar_target + gridDim.x;
        s_bar_target = target;
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(&g_bar) : "memory");
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(&g_bar) : "memory");
        } while ((int)(v - target) < 0);
    }
    __syncthreads();
}

__device__ __forceinline__ void rlx_enter() {
    if (c_persist) {
        if (s_wait) grid_barrier();
    } else {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    }
}

#define pdl_enter rlx_enter
#define blockIdx rlx_block()
#include "decode.cu"
#undef KERNEL_PART
#define KERNEL_PART 2
#include "attention_dec.cu"
#undef blockIdx
#undef pdl_enter
#include "decode-bench.cuh"

#include "decode-layers.cuh"
constexpr int CTX = 256, KEYS = 70;

enum Kind : i64 { MV4 = 0, MV8 = 1, ATT = 2, NOP = 3 };
struct Stage {
    i64 kind, nvb;
    QMatMulP mv;
    AttnAppP at;
};


// The bodies. In the kernel with the append each is a call of its own
// (inlined together, the append's registers make the matvecs spill; a call
// saves the registers it uses, which ptxas reports as spills of the
// callee); without the append they are inlined.
template <typename P, int K> __device__ __forceinline__ void body(const P& p);
template <> __device__ __forceinline__ void body<QMatMulP, MV4>(const QMatMulP& p) { qmatvec_body<float, QF_Q4_1, 4>(p); }
template <> __device__ __forceinline__ void body<QMatMulP, MV8>(const QMatMulP& p) { qmatvec_body<float, QF_Q4_1, 8>(p); }
template <> __device__ __forceinline__ void body<AttnAppP, ATT>(const AttnAppP& p) {
    dec_prefetch<__half, HD, 8>(p);
    attention_app_body<float, __half, HD, 8>(p);
}
template <typename P, int K> __device__ __noinline__ void body_call(const P& p) { body<P, K>(p); }

// The append with 8 warps, as the persistent kernel's 256-thread blocks run it.
extern "C" __global__ void __launch_bounds__(256) att8(const AttnAppP p) { body<AttnAppP, ATT>(p); }
// The append as one 16-warp block a head (the CUDA backend's shape for one
// sequence when this harness was written; it now splits the keys).
extern "C" __global__ void __launch_bounds__(512) att16(const AttnAppP p) {
    dec_prefetch<__half, HD, 16>(p);
    attention_app_body<float, __half, HD, 16>(p);
}

template <bool WITH_ATT>
__device__ __forceinline__ void persist_body(const Stage* stages, int n, unsigned base) {
    if (threadIdx.x == 0) s_bar_target = base;
    __shared__ Stage st;  // the stage's parameters, read by the bodies from shared memory
    for (int s = 0; s < n; ++s) {
        __syncthreads();
        for (int i = threadIdx.x; i < (int)(sizeof(Stage) / 8); i += blockDim.x) ((i64*)&st)[i] = ((const i64*)(stages + s))[i];
        __syncthreads();
        if (blockIdx.x >= st.nvb || st.kind == NOP) {
            grid_barrier();
            continue;
        }
        // Virtual blocks v, v + grid, ...: the first waits at the barrier
        // after its weight loads; the others run after it.
        for (unsigned v = blockIdx.x; v < st.nvb; v += gridDim.x) {
            __syncthreads();
            if (threadIdx.x == 0) {
                s_vblk = make_uint3(v, 0, 0);
                s_wait = v == blockIdx.x;
            }
            __syncthreads();
            if constexpr (WITH_ATT) {
                if (st.kind == MV4) body_call<QMatMulP, MV4>(st.mv);
                else if (st.kind == MV8) body_call<QMatMulP, MV8>(st.mv);
                else body_call<AttnAppP, ATT>(st.at);
            } else {
                if (st.kind == MV4) body<QMatMulP, MV4>(st.mv);
                else body<QMatMulP, MV8>(st.mv);
            }
        }
    }
}
extern "C" __global__ void __launch_bounds__(256, 1) persist(const Stage* stages, int n, unsigned base) { persist_body<true>(stages, n, base); }
extern "C" __global__ void __launch_bounds__(256, 1) persist_mv(const Stage* stages, int n, unsigned base) { persist_body<false>(stages, n, base); }

int main() {
    cudaStream_t st; CK(cudaStreamCreate(&st));
    int dev = 0, sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    for (const void* k : {(const void*)persist, (const void*)persist_mv}) {
        int per_sm = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, 256, 0));
        cudaFuncAttributes fa; CK(cudaFuncGetAttributes(&fa, k));
        printf("%s: %d registers, %zu bytes static shared, %zu bytes local, %d blocks an SM fit, %d SMs\n", k == (const void*)persist ? "persist" : "persist_mv",
               fa.numRegs, fa.sharedSizeBytes, fa.localSizeBytes, per_sm, sms);
        if (per_sm < 1) { printf("the persistent kernel does not fit an SM\n"); return 1; }
    }
    const int grid = sms;

    Layers d(CTX);
    d.set_keys(KEYS);
    float *x0 = d.x0, *x = d.x, *qkv = d.qkv, *att = d.att, *act = d.act, *gamma = d.gamma;
    const auto &wq = d.wq, &wo = d.wo, &wgu = d.wgu, &wd = d.wd;
    // The layer's stages; `attn` false leaves the attention out (the
    // o-projection then reads the qkv row's first 576 values).
    auto stages_of = [&](bool attn, bool bare) {
        std::vector<Stage> v;
        for (int l = 0; l < L; l++) {
            auto add = [&](i64 kind, i64 nvb, QMatMulP mv, AttnAppP at) { v.push_back(Stage{bare ? NOP : kind, nvb, mv, at}); };
            add(MV4, QKV / 8, mvp(x, qkv, wq[l], gamma, nullptr, QKV, H, false), {});
            if (attn) add(ATT, NH, {}, d.attp(l));
            add(MV4, H / 8, mvp(attn ? att : qkv, x, wo[l], nullptr, x, H, H, false), {});
            add(MV4, FF / 8, mvp(x, act, wgu[l], gamma, nullptr, FF, H, true), {});
            add(MV8, H / 8, mvp(act, x, wd[l], nullptr, x, H, FF, false), {});
        }
        return v;
    };
    Stage* dstages; CK(cudaMalloc(&dstages, sizeof(Stage) * L * 5));

    // The chain: the same stages as programmatic-dependent launches in a graph.
    // `w16`: the append as one 16-warp block a head, else with 8 warps as
    // the persistent kernel runs it.
    auto chain_graph = [&](bool attn, bool w16) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        CK(cudaMemcpyAsync(x, x0, H * 4, cudaMemcpyDeviceToDevice, st));
        ChainLauncher kernel{st};
        for (const Stage& s : stages_of(attn, false)) {
            if (s.kind == ATT) {
                void* args[] = {(void*)&s.at};
                kernel(w16 ? (const void*)att16 : (const void*)att8, dim3(NH, 1), w16 ? 512 : 256, args);
            } else {
                void* args[] = {(void*)&s.mv};
                kernel(s.kind == MV4 ? (const void*)mv4 : (const void*)mv8, dim3((unsigned)((s.mv.n + 7) / 8)), 256, args);
            }
        }
        CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
        return ge;
    };
    // c_persist is set between runs of one kind, the stream idle.
    auto mode = [&](int persistent) { CK(cudaStreamSynchronize(st)); CK(cudaMemcpyToSymbol(c_persist, &persistent, 4)); };
    unsigned bar_base = 0;  // g_bar's count when the next persistent launch starts (it is never reset)
    auto run_chain = [&](cudaGraphExec_t ge) { CK(cudaGraphLaunch(ge, st)); };
    // The persistent kernel over `v`, launched cooperatively (all blocks resident).
    auto run_persist = [&](const std::vector<Stage>& v, bool reset_x, bool with_att) {
        if (reset_x) CK(cudaMemcpyAsync(x, x0, H * 4, cudaMemcpyDeviceToDevice, st));
        const Stage* sp = dstages; int n = (int)v.size();
        unsigned base = bar_base;
        bar_base += (unsigned)n * (unsigned)grid;
        void* args[] = {(void*)&sp, (void*)&n, (void*)&base};
        CK(cudaLaunchCooperativeKernel(with_att ? (const void*)persist : (const void*)persist_mv, dim3(grid), dim3(256), args, 0, st));
    };
    auto upload = [&](const std::vector<Stage>& v) {
        CK(cudaMemcpy(dstages, v.data(), sizeof(Stage) * v.size(), cudaMemcpyHostToDevice));
    };

    // Same bits: one pass each from the same x and caches (each pass writes
    // the same new cache row, so the order does not matter).
    cudaGraphExec_t full = chain_graph(true, false), full16 = chain_graph(true, true), mvonly = chain_graph(false, false);
    const std::vector<Stage> sfull = stages_of(true, false), smv = stages_of(false, false), sbare = stages_of(true, true);
    auto same = [&](cudaGraphExec_t chain, const std::vector<Stage>& stages, bool with_att, const char* what) {
        std::vector<float> rc(H), rp(H);
        mode(0); run_chain(chain); CK(cudaStreamSynchronize(st)); CK(cudaMemcpy(rc.data(), x, H * 4, cudaMemcpyDeviceToHost));
        upload(stages);
        mode(1); run_persist(stages, true, with_att); CK(cudaStreamSynchronize(st)); CK(cudaMemcpy(rp.data(), x, H * 4, cudaMemcpyDeviceToHost));
        double mx = 0; int nan = 0;
        for (int i = 0; i < H; i++) { mx = fmax(mx, fabs((double)rc[i])); nan += std::isnan(rc[i]); }
        printf("%s: persistent %s the chain bit for bit (max |x| %.3g, %d NaN, error flag %d)\n", what, memcmp(rc.data(), rp.data(), H * 4) ? "DIFFERS from" : "equals", mx, nan, d.error_flag());
    };
    same(full, sfull, true, "30 layers");
    same(mvonly, smv, false, "30 layers without the append");

    // Timing: reps back to back, events around them.
    auto time_it = [&](auto&& one_run, int reps) {
        cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        for (int i = 0; i < 5; i++) one_run();
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < reps; i++) one_run();
        CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
        CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
        return ms * 1000.0f / reps;
    };
    for (int round = 0; round < 2; round++) {
        mode(0);
        const float c_full = time_it([&] { run_chain(full); }, 200);
        const float c_full16 = time_it([&] { run_chain(full16); }, 200);
        const float c_mv = time_it([&] { run_chain(mvonly); }, 200);
        mode(1); upload(sfull);
        const float p_full = time_it([&] { run_persist(sfull, true, true); }, 200);
        upload(smv);
        const float p_mv = time_it([&] { run_persist(smv, true, false); }, 200);
        upload(sbare);
        const float p_bare = time_it([&] { run_persist(sbare, false, false); }, 200);
        printf("round %d\n", round);
        printf("  chain      [qkv, append, o, gate/up, down] x30: %7.1f us, %5.2f a layer\n", c_full, c_full / L);
        printf("  chain, 16-warp append (the backend's today):   %7.1f us, %5.2f a layer\n", c_full16, c_full16 / L);
        printf("  persistent [qkv, append, o, gate/up, down] x30: %7.1f us, %5.2f a layer (%.2fx the 8-warp chain, %.2fx the backend's)\n", p_full, p_full / L,
               c_full / p_full, c_full16 / p_full);
        printf("  chain      [qkv, o, gate/up, down] x30:         %7.1f us, %5.2f a layer\n", c_mv, c_mv / L);
        printf("  persistent [qkv, o, gate/up, down] x30:         %7.1f us, %5.2f a layer (%.2fx)\n", p_mv, p_mv / L, c_mv / p_mv);
        printf("  persistent, barriers only (150):                %7.1f us, %5.2f a barrier\n", p_bare, p_bare / (L * 5));
    }
    return 0;
}
