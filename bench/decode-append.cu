// How the batch-1 attention append should be shaped: SmolLM2-135M's decode
// layer chain [qkv, append, o, gate/up, down] x30 (Q4_1, f16 cache, as
// programmatic-dependent launches in a CUDA graph) with the append as one
// block a head of 16 warps (the shape before split keys) and as split-key
// grids of S blocks a head at most (14: a 16-warp block an SM on an
// H100's 132; 16, the kernel's most), each over a run of at least `chunk`
// keys, the last block of a head merging the runs. A graph is recorded
// once for every length, so a shape must hold across lengths: each is
// timed at several cache lengths.
// Checks first that every shape gives the 16-warp block's outputs (within
// f32 rounding: only the order in which partial sums merge differs) and
// that a second run gives the same bits (the merge counters reset).
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -I crates/rlx-cuda/kernels -o dapp bench/decode-append.cu && ./dapp
#include <cmath>
#include <cstring>
#define KERNEL_PART 0
#include "decode.cu"
#undef KERNEL_PART
#define KERNEL_PART 2
#include "attention_dec.cu"
#include "decode-bench.cuh"
#include "decode-layers.cuh"

constexpr int CTX = 4096, SPLITS = 16;
template <int W> __global__ void __launch_bounds__(W * 32) app(const AttnAppP p) {
    dec_prefetch<__half, HD, W>(p);
    attention_app_body<float, __half, HD, W>(p);
}

// An append shape: warps a block, blocks a head, keys a run at least.
struct Shape {
    int w, splits, chunk;
};

int main() {
    cudaStream_t st; CK(cudaStreamCreate(&st));
    Layers d(CTX);
    float *x0 = d.x0, *x = d.x, *qkv = d.qkv, *att = d.att, *act = d.act, *gamma = d.gamma;
    const auto &wq = d.wq, &wo = d.wo, &wgu = d.wgu, &wd = d.wd;
    float* part; int* cnt;
    CK(cudaMalloc(&part, (size_t)NH * SPLITS * (HD + 2) * 4)); CK(cudaMalloc(&cnt, NH * 4)); CK(cudaMemset(cnt, 0, NH * 4));
    const std::vector<Shape> shapes = {{16, 1, 0}, {16, 14, 512}, {16, 14, 256}, {8, SPLITS, 256}, {4, SPLITS, 128}, {4, 1, 0}};
    // w 0: no append (the o-projection reads the qkv row).
    auto graph = [&](Shape s) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        CK(cudaMemcpyAsync(x, x0, H * 4, cudaMemcpyDeviceToDevice, st));
        ChainLauncher kernel{st};
        auto mv = [&](const void* fn, QMatMulP p) { void* args[] = {&p}; kernel(fn, dim3((unsigned)((p.n + 7) / 8)), 256, args); };
        for (int l = 0; l < L; l++) {
            mv((const void*)mv4, mvp(x, qkv, wq[l], gamma, nullptr, QKV, H, false));
            if (s.w) {
                AttnAppP a = d.attp(l);
                a.part = part; a.cnt = cnt; a.chunk = s.chunk;
                void* args[] = {&a};
                const void* fn = s.w == 4 ? (const void*)app<4> : s.w == 8 ? (const void*)app<8> : (const void*)app<16>;
                kernel(fn, dim3(NH, 1, s.splits), s.w * 32, args);
            }
            mv((const void*)mv4, mvp(s.w ? att : qkv, x, wo[l], nullptr, x, H, H, false));
            mv((const void*)mv4, mvp(x, act, wgu[l], gamma, nullptr, FF, H, true));
            mv((const void*)mv8, mvp(act, x, wd[l], nullptr, x, H, FF, false));
        }
        CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
        return ge;
    };
    const cudaGraphExec_t g0 = graph({0, 1, 0});
    std::vector<cudaGraphExec_t> gs;
    for (Shape s : shapes) gs.push_back(graph(s));
    auto run = [&](cudaGraphExec_t ge, std::vector<float>& out) {
        out.resize(H);
        CK(cudaGraphLaunch(ge, st)); CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(out.data(), x, H * 4, cudaMemcpyDeviceToHost));
    };
    bool ok = true;
    for (int keys : {70, 128, 200, 300, 500, 1000, 2000, 4000}) {
        d.set_keys(keys);
        std::vector<float> ref, a, b;
        run(gs[0], ref);
        double mx = 0;
        for (int j = 0; j < H; j++) mx = fmax(mx, fabs((double)ref[j]));
        printf("keys %4d (max |x| %.3g):", keys, mx);
        for (size_t i = 1; i < gs.size(); i++) {
            run(gs[i], a);
            run(gs[i], b);
            double dm = 0;
            for (int j = 0; j < H; j++) dm = fmax(dm, fabs((double)a[j] - ref[j]));
            const bool same = memcmp(a.data(), b.data(), H * 4) == 0;
            printf(" [%dw S%d c%d: max diff %.3g%s]", shapes[i].w, shapes[i].splits, shapes[i].chunk, dm, same ? "" : ", SECOND RUN DIFFERS");
            ok = ok && same && dm <= 1e-4 * fmax(mx, 1.0);
        }
        printf(" error flag %d\n", d.error_flag());
        for (int round = 0; round < 2; round++) {
            const float t0 = time_graph(st, g0, 200);
            printf("  round %d: layer %5.2f us; append a layer (chain less the no-append chain):", round, time_graph(st, gs[0], 200) / L);
            for (size_t i = 0; i < gs.size(); i++) {
                const float t = time_graph(st, gs[i], 200);
                printf(" %dw/S%d/c%d %5.2f", shapes[i].w, shapes[i].splits, shapes[i].chunk, (t - t0) / L);
            }
            printf(" us\n");
        }
    }
    printf(ok ? "all shapes agree\n" : "SHAPES DISAGREE\n");
    return ok ? 0 : 1;
}
