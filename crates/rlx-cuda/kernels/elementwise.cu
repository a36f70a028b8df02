// Elementwise kernels: broadcasting binary ops, activations, the matmul
// epilogue our cuBLASLt path cannot fuse, casts, strided copies, SwiGLU.
// Grid-stride loops: any grid size covers any n.
#include "common.cuh"

struct BinaryP {
    const void* a; const void* b; void* out;
    i64 n; i64 rank; i64 op;
    i64 shape[MAX_RANK]; i64 sa[MAX_RANK]; i64 sb[MAX_RANK];
};

template <typename T>
__device__ void binary_body(const BinaryP& p) {
    const T* a = (const T*)p.a; const T* b = (const T*)p.b; T* out = (T*)p.out;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
        i64 rem = i, ai = 0, bi = 0;
        for (int d = (int)p.rank - 1; d >= 0; --d) {
            i64 c = rem % p.shape[d];
            rem /= p.shape[d];
            ai += c * p.sa[d];
            bi += c * p.sb[d];
        }
        float x = ld(a, ai), y = ld(b, bi), r;
        switch (p.op) {
            case 0: r = x + y; break;
            case 1: r = x - y; break;
            case 2: r = x * y; break;
            default: r = x / y; break;
        }
        st(out, i, r);
    }
}
RLX_FLOAT_KERNELS(binary, BinaryP)

// Element offsets in a and b of flat output index i (32-bit: the host
// takes this path only when every offset fits).
__device__ __forceinline__ void bcast_offsets(const BinaryP& p, unsigned i, unsigned& ai, unsigned& bi) {
    unsigned rem = i;
    ai = 0;
    bi = 0;
    for (int d = (int)p.rank - 1; d > 0; --d) {
        unsigned s = (unsigned)p.shape[d];
        unsigned c = rem % s;
        rem /= s;
        ai += c * (unsigned)p.sa[d];
        bi += c * (unsigned)p.sb[d];
    }
    ai += rem * (unsigned)p.sa[0];
    bi += rem * (unsigned)p.sb[0];
}

// The same op with 32-bit index math, for calls whose element count and
// every operand offset fit in 31 bits (the host checks; it also merges
// dims walked contiguously, so rank is usually 1 or 2 here). 64-bit
// division per dim was most of `binary`'s time. Same float ops, same bits.
template <typename T>
__device__ void binary32_body(const BinaryP& p) {
    const T* a = (const T*)p.a; const T* b = (const T*)p.b; T* out = (T*)p.out;
    const unsigned n = (unsigned)p.n;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        unsigned ai, bi;
        bcast_offsets(p, i, ai, bi);
        float x = ld(a, ai), y = ld(b, bi), r;
        switch (p.op) {
            case 0: r = x + y; break;
            case 1: r = x - y; break;
            case 2: r = x * y; break;
            default: r = x / y; break;
        }
        st(out, i, r);
    }
}
RLX_FLOAT_KERNELS(binary32, BinaryP)

// binary32 over 16-byte vectors: each thread takes E consecutive outputs.
// The host checks that the innermost dim is a multiple of E, walked with
// stride 1 by both operands, every other stride a multiple of E and every
// pointer 16-byte aligned, so the E elements sit together in a, b and out.
// Same float ops per element as `binary`, hence the same bits.
template <typename T>
__device__ void binary_vec_body(const BinaryP& p) {
    constexpr int E = Vec16<T>::E;
    const T* a = (const T*)p.a; const T* b = (const T*)p.b;
    const unsigned nv = (unsigned)(p.n / E);
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += gridDim.x * blockDim.x) {
        unsigned ai, bi;
        bcast_offsets(p, i * E, ai, bi);
        float x[E], y[E];
        Vec16<T>::load(*(const uint4*)(a + ai), x);
        Vec16<T>::load(*(const uint4*)(b + bi), y);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            switch (p.op) {
                case 0: x[e] = x[e] + y[e]; break;
                case 1: x[e] = x[e] - y[e]; break;
                case 2: x[e] = x[e] * y[e]; break;
                default: x[e] = x[e] / y[e]; break;
            }
        }
        ((uint4*)p.out)[i] = Vec16<T>::store(x);
    }
}
RLX_FLOAT_KERNELS(binary_vec, BinaryP)

struct ActP { const void* x; void* out; i64 n; i64 act; };

template <typename T>
__device__ void activation_body(const ActP& p) {
    const T* x = (const T*)p.x; T* out = (T*)p.out;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x)
        st(out, i, act_t<T>(p.act, ld(x, i)));
}
RLX_FLOAT_KERNELS(activation, ActP)

// out = act(out) + residual: what remains of a MatMul thunk after cuBLASLt
// computed a·b + bias (erf-GELU, SiLU, ... and any activation with a residual).
struct EpilogueP { void* out; const void* res; i64 n; i64 act; };

template <typename T>
__device__ void epilogue_body(const EpilogueP& p) {
    T* out = (T*)p.out; const T* res = (const T*)p.res;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
        float v = act_t<T>(p.act, ld(out, i));
        if (res) v += ld(res, i);
        st(out, i, v);
    }
}
RLX_FLOAT_KERNELS(epilogue, EpilogueP)

// The same epilogue over 16-byte vectors (n a multiple of the vector width,
// pointers 16-byte aligned; the host checks): one load and one store
// instruction per 8 halves instead of 8, so the pass runs at memory speed.
// Same per-element arithmetic as `epilogue`, hence the same bits.
template <typename T, typename F>
__device__ __forceinline__ void epilogue_vec_loop(const EpilogueP& p, F act) {
    constexpr int E = Vec16<T>::E;
    uint4* out = (uint4*)p.out; const uint4* res = (const uint4*)p.res;
    const i64 nv = p.n / E;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < nv; i += (i64)gridDim.x * blockDim.x) {
        float v[E], r[E];
        uint4 o = out[i];
        uint4 rr = res ? res[i] : make_uint4(0, 0, 0, 0);
        Vec16<T>::load(o, v);
        Vec16<T>::load(rr, r);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            v[e] = act(v[e]);
            if (res) v[e] += r[e];
        }
        out[i] = Vec16<T>::store(v);
    }
}

// The half types' erf-GELU (BERT's FFN) gets a loop of its own, without the
// per-element activation dispatch; both call the same functions as act_t.
template <typename T>
__device__ void epilogue_vec_body(const EpilogueP& p) {
    if (sizeof(T) == 2 && p.act == ACT_GELU) {
        epilogue_vec_loop<T>(p, [](float x) { return gelu_fast<T>(x); });
    } else {
        const i64 act = p.act;
        epilogue_vec_loop<T>(p, [act](float x) { return act_t<T>(act, x); });
    }
}
RLX_FLOAT_KERNELS(epilogue_vec, EpilogueP)

// Any dtype to any dtype; floats round to nearest, float -> int truncates.
struct CastP { const void* src; void* dst; i64 n; i64 from; i64 to; };

extern "C" __global__ void cast_any(const CastP p) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
        double v = ld_any(p.src, i, p.from);
        switch (p.to) {
            case DT_F32: ((float*)p.dst)[i] = (float)v; break;
            case DT_F16: ((__half*)p.dst)[i] = __float2half_rn((float)v); break;
            case DT_BF16: ((__nv_bfloat16*)p.dst)[i] = __float2bfloat16_rn((float)v); break;
            case DT_I32:
                if (p.from == DT_I64) ((int*)p.dst)[i] = (int)((const long long*)p.src)[i];
                else ((int*)p.dst)[i] = (int)v;
                break;
            default:
                if (p.from == DT_I64) ((long long*)p.dst)[i] = ((const long long*)p.src)[i];
                else ((long long*)p.dst)[i] = (long long)v;
                break;
        }
    }
}

// dst[idx] = src[idx] over `shape`, strides in elements; moves raw elements
// of `esize` bytes so one kernel serves every dtype.
struct CopyP {
    const void* src; void* dst; i64 n; i64 rank; i64 esize;
    i64 shape[MAX_RANK]; i64 ss[MAX_RANK]; i64 ds[MAX_RANK];
};

extern "C" __global__ void copy_strided(const CopyP p) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
        i64 rem = i, si = 0, di = 0;
        for (int d = (int)p.rank - 1; d >= 0; --d) {
            i64 c = rem % p.shape[d];
            rem /= p.shape[d];
            si += c * p.ss[d];
            di += c * p.ds[d];
        }
        switch (p.esize) {
            case 2: ((unsigned short*)p.dst)[di] = ((const unsigned short*)p.src)[si]; break;
            case 4: ((unsigned int*)p.dst)[di] = ((const unsigned int*)p.src)[si]; break;
            default: ((unsigned long long*)p.dst)[di] = ((const unsigned long long*)p.src)[si]; break;
        }
    }
}

// A memset as a kernel: height rows of width elements of esize bytes (1, 2
// or 4) set to the low bytes of value, rows pitch bytes apart. In a CUDA
// graph a memset node costs about a microsecond of host time at every
// launch, a kernel node next to nothing, so recorded graphs carry this
// instead (ours and cuBLASLt's memsets).
struct FillP { void* dst; i64 pitch; i64 width; i64 height; i64 value; i64 esize; };

extern "C" __global__ void fill_pitched(const FillP p) {
    pdl_enter();
    i64 n = p.width * p.height;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        char* row = (char*)p.dst + (i / p.width) * p.pitch;
        i64 c = i % p.width;
        switch (p.esize) {
            case 1: ((unsigned char*)row)[c] = (unsigned char)p.value; break;
            case 2: ((unsigned short*)row)[c] = (unsigned short)p.value; break;
            default: ((unsigned int*)row)[c] = (unsigned int)p.value; break;
        }
    }
}

// Prefetches [ptr, ptr + bytes) into L2, one `prefetch.global.L2` per
// 128-byte line, grid-strided: a hint that completes nothing, so the kernel
// ends as soon as its prefetches are issued. Recorded graphs run it beside
// the forward, on a second branch, for the weights of the next matmul
// (src/exec.rs `record`): it reads only weights, which no kernel writes, so
// it neither waits for nor holds up the forward's kernels. Bulk prefetches
// through the copy engine measured slower (possibly queued ahead of the
// SMs' tensor copies).
struct PrefetchP { const unsigned char* ptr; i64 bytes; };
extern "C" __global__ void prefetch_l2(const PrefetchP p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // the host records it on sm_90+ only
    const i64 nt = (i64)gridDim.x * blockDim.x;
    for (i64 off = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 128; off < p.bytes; off += nt * 128) {
        asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(p.ptr + off) : "memory");
    }
#endif
}

// Up to COPY_MANY byte copies between device-accessible addresses in one
// launch (blockIdx.y picks the copy), and optionally one u32 set first (the
// error flag). The staging copies of a call read and write mapped pinned host
// memory: as kernel nodes rather than memcpy nodes (for the same reason as
// fill_pitched), one launch for the inputs and one for the outputs, so the
// reads of host memory overlap and fewer nodes launch.
#define COPY_MANY 8
struct CopyManyP { i64 n; unsigned* fill; i64 fill_value; void* dst[COPY_MANY]; const void* src[COPY_MANY]; i64 bytes[COPY_MANY]; };

extern "C" __global__ void copy_many(const CopyManyP p) {
    pdl_enter();
    if (p.fill && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *p.fill = (unsigned)p.fill_value;
    if ((i64)blockIdx.y >= p.n) return;
    char* dst = (char*)p.dst[blockIdx.y];
    const char* src = (const char*)p.src[blockIdx.y];
    const i64 bytes = p.bytes[blockIdx.y];
    i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x;
    i64 head = 0;
    if ((((unsigned long long)dst | (unsigned long long)src) & 15) == 0) {
        i64 nv = bytes / 16;
        for (i64 i = t; i < nv; i += stride) ((uint4*)dst)[i] = ((const uint4*)src)[i];
        head = nv * 16;
    }
    for (i64 i = head + t; i < bytes; i += stride) dst[i] = src[i];
}

struct SwiGluP { const void* gate; const void* up; void* out; i64 rows; i64 cols; i64 gs; i64 us; };

template <typename T>
__device__ void swiglu_body(const SwiGluP& p) {
    const T* g = (const T*)p.gate; const T* u = (const T*)p.up; T* out = (T*)p.out;
    i64 n = p.rows * p.cols;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        i64 r = i / p.cols, c = i % p.cols;
        float x = ld(g, r * p.gs + c);
        st(out, i, x / (1.0f + expf(-x)) * ld(u, r * p.us + c));
    }
}
RLX_FLOAT_KERNELS(swiglu, SwiGluP)
