// How many warps the batch-1 attention append should have: SmolLM2-135M's
// decode layer chain [qkv, append, o, gate/up, down] x30 (Q4_1, f16
// cache, as programmatic-dependent launches in a CUDA graph) with the
// append at 4, 8 and 16 warps a head, at several cache lengths. The
// backend records 16 warps for one sequence (`decode_warps`); a graph is
// recorded once for every length, so a choice must hold across lengths.
// Also checks that the three widths give the same outputs (they differ
// only in how the warps' partial sums merge: within f32 rounding).
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -I crates/rlx-cuda/kernels -o dapp bench/decode-append.cu && ./dapp
#include <cmath>
#define KERNEL_PART 0
#include "decode.cu"
#undef KERNEL_PART
#define KERNEL_PART 2
#include "attention_dec.cu"
#include "decode-bench.cuh"
#include "decode-layers.cuh"

constexpr int CTX = 4096;
template <int W> __global__ void __launch_bounds__(W * 32) app(const AttnAppP p) {
    dec_prefetch<__half, HD, W>(p);
    attention_app_body<float, __half, HD, W>(p);
}

int main() {
    cudaStream_t st; CK(cudaStreamCreate(&st));
    Layers d(CTX);
    float *x0 = d.x0, *x = d.x, *qkv = d.qkv, *att = d.att, *act = d.act, *gamma = d.gamma;
    const auto &wq = d.wq, &wo = d.wo, &wgu = d.wgu, &wd = d.wd;
    // W 0: no append (the o-projection reads the qkv row).
    auto graph = [&](int w) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        CK(cudaMemcpyAsync(x, x0, H * 4, cudaMemcpyDeviceToDevice, st));
        ChainLauncher kernel{st};
        auto mv = [&](const void* fn, QMatMulP p) { void* args[] = {&p}; kernel(fn, dim3((unsigned)((p.n + 7) / 8)), 256, args); };
        for (int l = 0; l < L; l++) {
            mv((const void*)mv4, mvp(x, qkv, wq[l], gamma, nullptr, QKV, H, false));
            if (w) {
                AttnAppP a = d.attp(l);
                void* args[] = {&a};
                const void* fn = w == 4 ? (const void*)app<4> : w == 8 ? (const void*)app<8> : (const void*)app<16>;
                kernel(fn, dim3(NH, 1), w * 32, args);
            }
            mv((const void*)mv4, mvp(w ? att : qkv, x, wo[l], nullptr, x, H, H, false));
            mv((const void*)mv4, mvp(x, act, wgu[l], gamma, nullptr, FF, H, true));
            mv((const void*)mv8, mvp(act, x, wd[l], nullptr, x, H, FF, false));
        }
        CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
        return ge;
    };
    cudaGraphExec_t g0 = graph(0), g4 = graph(4), g8 = graph(8), g16 = graph(16);
    for (int keys : {70, 300, 1000, 4000}) {
        d.set_keys(keys);
        std::vector<float> r[3];
        int i = 0;
        for (cudaGraphExec_t ge : {g4, g8, g16}) {
            r[i].resize(H);
            CK(cudaGraphLaunch(ge, st)); CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(r[i].data(), x, H * 4, cudaMemcpyDeviceToHost));
            i++;
        }
        double d48 = 0, d416 = 0, mx = 0;
        for (int j = 0; j < H; j++) {
            d48 = fmax(d48, fabs((double)r[0][j] - r[1][j])); d416 = fmax(d416, fabs((double)r[0][j] - r[2][j])); mx = fmax(mx, fabs((double)r[0][j]));
        }
        printf("keys %4d: max |4w - 8w| %.3g, |4w - 16w| %.3g of max |x| %.3g (error flag %d)\n", keys, d48, d416, mx, d.error_flag());
        for (int round = 0; round < 2; round++) {
            const float t0 = time_graph(st, g0, 200), t4 = time_graph(st, g4, 200), t8 = time_graph(st, g8, 200), t16 = time_graph(st, g16, 200);
            printf("  round %d: layer %5.2f us; append (chain less the no-append chain) 4 warps %5.2f, 8 warps %5.2f, 16 warps %5.2f us a layer\n", round,
                   t16 / L, (t4 - t0) / L, (t8 - t0) / L, (t16 - t0) / L);
        }
    }
    return 0;
}
