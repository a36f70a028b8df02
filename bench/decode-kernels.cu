// Times the generation step's CUDA kernels alone, the way a recorded decode
// step runs them: each case is a CUDA graph of programmatic-dependent
// launches, each launch reading the one before's output, on
// SmolLM2-135M's shapes (Q4_1 projections over 30 layers, the Q8_0 output
// head over 49,152 columns, greedy and top-k sampling, the fused attention
// append over an f16 cache). Weights and activations are synthetic (speed
// does not depend on values). It includes the kernel files themselves, so
// two kernel folders can be compared on one machine:
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/rlx-cuda/kernels -o dk bench/decode-kernels.cu && ./dk
//   nvcc ... -DRLX_NO_WIDE -I OLD/kernels -o dk-old bench/decode-kernels.cu   # kernels without qmatvec_w4_*
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>
#include "decode.cu"
#include "sample.cu"
#include "attention_dec.cu"
#include "decode-bench.cuh"

struct Mv { const char* name; QK k; int n, kk, bb, be, glu, norm, res; };

int main() {
    cudaStream_t st; CK(cudaStreamCreate(&st));
    float *xa, *xb, *gamma; int* err;
    CK(cudaMalloc(&xa, 1 << 20)); CK(cudaMalloc(&xb, 1 << 20)); CK(cudaMalloc(&gamma, 1 << 16)); CK(cudaMalloc(&err, 4));
    std::vector<float> hx(1 << 18); for (size_t i = 0; i < hx.size(); i++) hx[i] = ((i * 7919) % 1000) / 1000.0f - 0.5f;
    CK(cudaMemcpy(xa, hx.data(), 1 << 20, cudaMemcpyHostToDevice)); CK(cudaMemcpy(xb, hx.data(), 1 << 20, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(gamma, hx.data(), 1 << 16, cudaMemcpyHostToDevice));
    Mv layer[4] = {
        {"qkv k576 n960 norm", qmatvec_q4_1_c4_f32, 960, 576, 20, 32, 0, 1, 0},
        {"o k576 n576 res", qmatvec_q4_1_c4_f32, 576, 576, 20, 32, 0, 0, 1},
        {"gateup k576 n1536 glu norm", qmatvec_q4_1_c4_f32, 1536, 576, 20, 32, 1, 1, 0},
        {"down k1536 n576 res", qmatvec_q4_1_c8_f32, 576, 1536, 20, 32, 0, 0, 1},
    };
    const int L = 30;
    std::vector<unsigned char*> W;
    for (int l = 0; l < L; l++) for (int j = 0; j < 4; j++) W.push_back(make_weights((size_t)layer[j].n * (layer[j].glu ? 2 : 1), layer[j].kk, 20, 0));
    // Each kind alone, 30 launches chained; then the whole 120-launch chain.
    for (int j = -1; j < 4; j++) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        int cnt = 0;
        for (int l = 0; l < L; l++) for (int jj = 0; jj < 4; jj++) {
            if (j >= 0 && jj != j) continue;
            const Mv& m = layer[jj];
            QMatMulP p = {};
            p.a = (cnt & 1) ? xb : xa; p.out = (cnt & 1) ? xa : xb; p.w = W[l * 4 + jj];
            p.gamma = m.norm ? gamma : nullptr; p.res = m.res ? ((cnt & 1) ? xb : xa) : nullptr;
            p.rows = 1; p.n = m.n; p.k = m.kk; p.lda = m.kk; p.row_bytes = (m.kk / 32) * 20; p.glu = m.glu; p.eps = 1e-5;
            void* args[] = {&p};
            launch(st, (const void*)m.k, dim3((m.n + 7) / 8), 256, 0, args);
            cnt++;
        }
        CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
        float us = time_graph(st, ge, 200);
        printf("%-28s %3d launches: %7.1f us, %5.2f us each\n", j < 0 ? "layer chain" : layer[j].name, cnt, us, us / cnt);
    }
    // The output head: Q8_0, k 576, n 49152.
    {
        unsigned char* wh = make_weights(49152, 576, 34, 1);
        // Fresh activations: the chains above leave theirs overflowed, and
        // the sampler's work past its first pass depends on finite logits.
        float* xh; CK(cudaMalloc(&xh, 576 * 4)); CK(cudaMemcpy(xh, hx.data(), 576 * 4, cudaMemcpyHostToDevice));
        float* logits; CK(cudaMalloc(&logits, 49152 * 4));
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int r = 0; r < 10; r++) {
            QMatMulP p = {};
            p.a = xh; p.out = logits; p.w = wh; p.gamma = gamma; p.rows = 1; p.n = 49152; p.k = 576; p.lda = 576; p.row_bytes = 18 * 34; p.eps = 1e-5;
            void* args[] = {&p};
#ifndef RLX_NO_WIDE
            launch(st, (const void*)qmatvec_w4_q8_0_c4_f32, dim3(49152 / 32), 256, 0, args);
#else
            launch(st, (const void*)qmatvec_q8_0_c4_f32, dim3(49152 / 8), 256, 0, args);
#endif
        }
        CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
        float us = time_graph(st, ge, 100);
        printf("%-28s %3d launches: %7.1f us, %5.2f us each\n", "head q8_0 k576 n49152 norm", 10, us, us / 10);
        // Greedy sampling over those logits.
        float* fp; int* ip; int* pos; int* out;
        CK(cudaMalloc(&fp, 16)); CK(cudaMalloc(&ip, 16)); CK(cudaMalloc(&pos, 4)); CK(cudaMalloc(&out, 4));
        float hf[4] = {0.0f, 1.0f, 0.0f, 1.0f}; int hi[4] = {0, 64, 7, 0}; int hp = 3;
        CK(cudaMemcpy(fp, hf, 16, cudaMemcpyHostToDevice)); CK(cudaMemcpy(ip, hi, 16, cudaMemcpyHostToDevice)); CK(cudaMemcpy(pos, &hp, 4, cudaMemcpyHostToDevice));
        int* hist; CK(cudaMalloc(&hist, 4096 * 4)); CK(cudaMemset(hist, 0, 4096 * 4));
        int words = (49152 + 31) / 32, smem = 4 * words + 8 * 2048;
        CK(cudaFuncSetAttribute(sample, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        for (int mode = 0; mode < 2; mode++) {
            if (mode == 1) { float h2[4] = {0.8f, 0.95f, 0.05f, 1.1f}; int i2[4] = {40, 64, 7, 0}; CK(cudaMemcpy(fp, h2, 16, cudaMemcpyHostToDevice)); CK(cudaMemcpy(ip, i2, 16, cudaMemcpyHostToDevice)); }
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int r = 0; r < 20; r++) {
                SampleP p = {};
                p.logits = logits; p.fparams = fp; p.iparams = ip; p.history = hist; p.pos = pos; p.out = out; p.err = err;
                p.batch = 1; p.vocab = 49152; p.hist_len = 4096; p.bitmap_words = words;
                void* args[] = {&p};
                launch(st, (const void*)sample, dim3(1), 512, smem, args);
            }
            CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
            float us2 = time_graph(st, ge, 50);
            int tok; CK(cudaMemcpy(&tok, out, 4, cudaMemcpyDeviceToHost));
            printf("%-28s %3d launches: %7.1f us, %5.2f us each (token %d)\n", mode ? "sample top-k 40 p .95 rp 1.1" : "sample greedy", 20, us2, us2 / 20, tok);
        }
    }

    // A layer's fused attention append: f32 activations, f16 cache of 1024 rows, 201 valid keys;
    // the CUDA backend's shape for one sequence (src/launch.rs `append_shape`): 16 warps a block, the
    // keys split over min(SMs / heads, runs of 512 in the cache, 16) blocks a head.
    {
        const int H = 9, KVH = 3, HD = 64, KV = 1024;
        int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        const int splits = std::min(std::min(sms / H, (KV + 511) / 512), 16);
        float* part; int* cnt;
        CK(cudaMalloc(&part, (size_t)H * splits * (HD + 2) * 4)); CK(cudaMalloc(&cnt, H * 4)); CK(cudaMemset(cnt, 0, H * 4));
        float *q, *kn, *vn, *ao, *fac; __half *kc, *vc; int* ints;
        CK(cudaMalloc(&q, H * HD * 4)); CK(cudaMalloc(&kn, KVH * HD * 4)); CK(cudaMalloc(&vn, KVH * HD * 4)); CK(cudaMalloc(&ao, H * HD * 4));
        std::vector<__half*> kcs, vcs;
        for (int l = 0; l < 30; l++) { CK(cudaMalloc(&kc, KV * KVH * HD * 2)); CK(cudaMalloc(&vc, KV * KVH * HD * 2)); CK(cudaMemset(kc, 0x11, KV * KVH * HD * 2)); CK(cudaMemset(vc, 0x11, KV * KVH * HD * 2)); kcs.push_back(kc); vcs.push_back(vc); }
        CK(cudaMemcpy(q, hx.data(), H * HD * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(kn, hx.data(), KVH * HD * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(vn, hx.data(), KVH * HD * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&ints, 16)); int hi[4] = {200, 200, 201, 0}; CK(cudaMemcpy(ints, hi, 16, cudaMemcpyHostToDevice));
        for (int ctx : {201, 385, 601}) {
            hi[0] = hi[1] = ctx - 1; hi[2] = ctx; CK(cudaMemcpy(ints, hi, 16, cudaMemcpyHostToDevice));
            cudaGraph_t g; cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
            for (int l = 0; l < 30; l++) {
                AttnAppP p = {};
                p.q = (l & 1) ? ao : q; p.kn = kn; p.vn = vn; p.kc = kcs[l]; p.vc = vcs[l]; p.wpos = ints; p.rpos = ints + 1; p.factors = nullptr;
                p.valid = ints + 2; p.mask = nullptr; p.out = (l & 1) ? q : ao; p.err = err;
                p.batch = 1; p.heads = H; p.kv_heads = KVH; p.hd = HD; p.kv_len = KV; p.mask_dt = 0;
                p.qbs = H * HD; p.knbs = KVH * HD; p.vnbs = KVH * HD; p.kbs = (i64)KV * KVH * HD; p.krs = KVH * HD; p.vbs = (i64)KV * KVH * HD; p.vrs = KVH * HD;
                p.wpos_pb = 0; p.rpos_pb = 0; p.valid_pb = 0; p.rope = 1; p.theta = 100000.0; p.scale = 0.125;
                p.part = part; p.cnt = cnt; p.chunk = 512;
                void* args[] = {&p};
                launch(st, (const void*)attention_app16_64_f32_kvf16, dim3(H, 1, splits), 512, 0, args);
            }
            CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
            float us = time_graph(st, ge, 200);
            char name[64]; snprintf(name, 64, "attention append %d keys", ctx);
            printf("%-28s %3d launches: %7.1f us, %5.2f us each\n", name, 30, us, us / 30);
        }
    }
    return 0;
}
