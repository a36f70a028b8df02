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

constexpr int L = 30, H = 576, NH = 9, NKV = 3, HD = 64, KVW = NKV * HD, QKV = H + 2 * KVW, FF = 1536, BB = 20, CTX = 4096;

extern "C" __global__ void mv4(const QMatMulP p) { qmatvec_body<float, QF_Q4_1, 4>(p); }
extern "C" __global__ void mv8(const QMatMulP p) { qmatvec_body<float, QF_Q4_1, 8>(p); }
template <int W> __global__ void __launch_bounds__(W * 32) app(const AttnAppP p) {
    dec_prefetch<__half, HD, W>(p);
    attention_app_body<float, __half, HD, W>(p);
}

static QMatMulP mvp(const float* a, float* o, const unsigned char* w, const float* gamma, const float* res, int n, int k, bool glu) {
    QMatMulP p = {};
    p.a = a; p.out = o; p.w = w; p.gamma = gamma; p.res = res;
    p.rows = 1; p.n = n; p.k = k; p.lda = k; p.row_bytes = (k / 32) * BB; p.glu = glu; p.eps = 1e-5;
    return p;
}

int main() {
    cudaStream_t st; CK(cudaStreamCreate(&st));
    float *x0, *x, *qkv, *att, *act, *gamma;
    CK(cudaMalloc(&x0, H * 4)); CK(cudaMalloc(&x, H * 4)); CK(cudaMalloc(&qkv, QKV * 4)); CK(cudaMalloc(&att, H * 4));
    CK(cudaMalloc(&act, FF * 4)); CK(cudaMalloc(&gamma, FF * 4));
    std::vector<float> hx(H), hg(FF);
    for (int i = 0; i < H; i++) hx[i] = (float)(((i * 7919) % 1000) / 1000.0 - 0.5);
    for (int i = 0; i < FF; i++) hg[i] = 0.5f + (i % 7) * 0.1f;
    CK(cudaMemcpy(x0, hx.data(), H * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(gamma, hg.data(), FF * 4, cudaMemcpyHostToDevice));
    int* ints; CK(cudaMalloc(&ints, 16));
    std::vector<__half> hc((size_t)CTX * KVW);
    for (size_t i = 0; i < hc.size(); i++) hc[i] = __float2half((float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f);
    std::vector<__half*> kc(L), vc(L);
    std::vector<unsigned char*> wq(L), wo(L), wgu(L), wd(L);
    for (int l = 0; l < L; l++) {
        CK(cudaMalloc(&kc[l], hc.size() * 2)); CK(cudaMalloc(&vc[l], hc.size() * 2));
        CK(cudaMemcpy(kc[l], hc.data(), hc.size() * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(vc[l], hc.data(), hc.size() * 2, cudaMemcpyHostToDevice));
        wq[l] = make_weights(QKV, H, BB, 0); wo[l] = make_weights(H, H, BB, 0);
        wgu[l] = make_weights(2 * FF, H, BB, 0); wd[l] = make_weights(H, FF, BB, 0);
    }
    auto attp = [&](int l) {
        AttnAppP a = {};
        a.q = qkv; a.kn = qkv + H; a.vn = qkv + H + KVW; a.kc = kc[l]; a.vc = vc[l];
        a.wpos = ints; a.rpos = ints; a.valid = ints + 1; a.err = ints + 2; a.out = att;
        a.batch = 1; a.heads = NH; a.kv_heads = NKV; a.hd = HD; a.kv_len = CTX;
        a.qbs = QKV; a.knbs = QKV; a.vnbs = QKV; a.kbs = (i64)CTX * KVW; a.krs = KVW; a.vbs = (i64)CTX * KVW; a.vrs = KVW;
        a.rope = 1; a.theta = 100000.0; a.scale = 1.0 / 8.0;
        return a;
    };
    // W 0: no append (the o-projection reads the qkv row).
    auto graph = [&](int w) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        CK(cudaMemcpyAsync(x, x0, H * 4, cudaMemcpyDeviceToDevice, st));
        bool first = true;
        auto kernel = [&](const void* fn, dim3 grid, int threads, void** args) {
            if (first) { CK(cudaLaunchKernel(fn, grid, dim3(threads), args, 0, st)); first = false; }
            else launch(st, fn, grid, threads, 0, args);
        };
        auto mv = [&](const void* fn, QMatMulP p) { void* args[] = {&p}; kernel(fn, dim3((unsigned)((p.n + 7) / 8)), 256, args); };
        for (int l = 0; l < L; l++) {
            mv((const void*)mv4, mvp(x, qkv, wq[l], gamma, nullptr, QKV, H, false));
            if (w) {
                AttnAppP a = attp(l);
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
        const int hints[4] = {keys - 1, keys, 0, 0};  // write/rope position, valid keys, error flag
        CK(cudaMemcpy(ints, hints, 16, cudaMemcpyHostToDevice));
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
        int herr[4]; CK(cudaMemcpy(herr, ints, 16, cudaMemcpyDeviceToHost));
        printf("keys %4d: max |4w - 8w| %.3g, |4w - 16w| %.3g of max |x| %.3g (error flag %d)\n", keys, d48, d416, mx, herr[2]);
        for (int round = 0; round < 2; round++) {
            const float t0 = time_graph(st, g0, 200), t4 = time_graph(st, g4, 200), t8 = time_graph(st, g8, 200), t16 = time_graph(st, g16, 200);
            printf("  round %d: layer %5.2f us; append (chain less the no-append chain) 4 warps %5.2f, 8 warps %5.2f, 16 warps %5.2f us a layer\n", round,
                   t16 / L, (t4 - t0) / L, (t8 - t0) / L, (t16 - t0) / L);
        }
    }
    return 0;
}
