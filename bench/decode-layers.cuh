// Shared by bench/decode-persist.cu and bench/decode-append.cu: SmolLM2-135M's
// 30 decoder layers at batch 1 with synthetic Q4_1 weights and an f16 KV
// cache (activations, per-layer weights and caches on the device), the
// parameters of their matvecs and attention appends, and a launcher for a
// captured chain. Include after the kernel files and decode-bench.cuh.
#pragma once

constexpr int L = 30, H = 576, NH = 9, NKV = 3, HD = 64, KVW = NKV * HD, QKV = H + 2 * KVW, FF = 1536, BB = 20;

extern "C" __global__ void mv4(const QMatMulP p) { qmatvec_body<float, QF_Q4_1, 4>(p); }
extern "C" __global__ void mv8(const QMatMulP p) { qmatvec_body<float, QF_Q4_1, 8>(p); }

// A one-row Q4_1 matvec: out = a · wᵀ over k, n columns; `gamma` the fused
// RmsNorm (else null), `res` the residual (else null), `glu` gate/up rows.
static QMatMulP mvp(const float* a, float* o, const unsigned char* w, const float* gamma, const float* res, int n, int k, bool glu) {
    QMatMulP p = {};
    p.a = a; p.out = o; p.w = w; p.gamma = gamma; p.res = res;
    p.rows = 1; p.n = n; p.k = k; p.lda = k; p.row_bytes = (k / 32) * BB; p.glu = glu; p.eps = 1e-5;
    return p;
}

// x (the residual stream, reset from x0), the qkv, attention and SwiGLU
// rows, the norms' gamma, `ints` (write/rope position, valid keys, error
// flag), and per layer the caches (ctx rows of random values) and weights.
struct Layers {
    int ctx;
    float *x0, *x, *qkv, *att, *act, *gamma;
    int* ints;
    std::vector<__half*> kc, vc;
    std::vector<unsigned char*> wq, wo, wgu, wd;

    explicit Layers(int ctx) : ctx(ctx), kc(L), vc(L), wq(L), wo(L), wgu(L), wd(L) {
        CK(cudaMalloc(&x0, H * 4)); CK(cudaMalloc(&x, H * 4)); CK(cudaMalloc(&qkv, QKV * 4)); CK(cudaMalloc(&att, H * 4));
        CK(cudaMalloc(&act, FF * 4)); CK(cudaMalloc(&gamma, FF * 4));
        std::vector<float> hx(H), hg(FF);
        for (int i = 0; i < H; i++) hx[i] = (float)(((i * 7919) % 1000) / 1000.0 - 0.5);
        for (int i = 0; i < FF; i++) hg[i] = 0.5f + (i % 7) * 0.1f;
        CK(cudaMemcpy(x0, hx.data(), H * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(gamma, hg.data(), FF * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&ints, 16));
        std::vector<__half> hc((size_t)ctx * KVW);
        for (size_t i = 0; i < hc.size(); i++) hc[i] = __float2half((float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f);
        for (int l = 0; l < L; l++) {
            CK(cudaMalloc(&kc[l], hc.size() * 2)); CK(cudaMalloc(&vc[l], hc.size() * 2));
            CK(cudaMemcpy(kc[l], hc.data(), hc.size() * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(vc[l], hc.data(), hc.size() * 2, cudaMemcpyHostToDevice));
            wq[l] = make_weights(QKV, H, BB, 0); wo[l] = make_weights(H, H, BB, 0);
            wgu[l] = make_weights(2 * FF, H, BB, 0); wd[l] = make_weights(H, FF, BB, 0);
        }
    }

    // Sets the write/rope position to keys - 1, the valid count to keys,
    // and clears the error flag.
    void set_keys(int keys) {
        const int h[4] = {keys - 1, keys, 0, 0};
        CK(cudaMemcpy(ints, h, 16, cudaMemcpyHostToDevice));
    }
    int error_flag() const {
        int h[4];
        CK(cudaMemcpy(h, ints, 16, cudaMemcpyDeviceToHost));
        return h[2];
    }

    // Layer l's attention append (RoPE, the cache row, attention over it).
    AttnAppP attp(int l) const {
        AttnAppP a = {};
        a.q = qkv; a.kn = qkv + H; a.vn = qkv + H + KVW; a.kc = kc[l]; a.vc = vc[l];
        a.wpos = ints; a.rpos = ints; a.valid = ints + 1; a.err = ints + 2; a.out = att;
        a.batch = 1; a.heads = NH; a.kv_heads = NKV; a.hd = HD; a.kv_len = ctx;
        a.qbs = QKV; a.knbs = QKV; a.vnbs = QKV; a.kbs = (i64)ctx * KVW; a.krs = KVW; a.vbs = (i64)ctx * KVW; a.vrs = KVW;
        a.rope = 1; a.theta = 100000.0; a.scale = 1.0 / 8.0;
        return a;
    }
};

// Launches into a capture: the first kernel (after the copy that resets
// x) with an ordinary edge, as the backend records it; each later one as
// a programmatic-dependent launch.
struct ChainLauncher {
    cudaStream_t st;
    bool first = true;
    void operator()(const void* fn, dim3 grid, int threads, void** args) {
        if (first) {
            CK(cudaLaunchKernel(fn, grid, dim3(threads), args, 0, st));
            first = false;
        } else {
            launch(st, fn, grid, threads, 0, args);
        }
    }
};
