// Kernels that address memory through device-side indices: embedding
// gather, KV-state writes at a device-scalar position, rotary embedding.
// Bad indices never fault: they write zeros or nothing and raise a bit in
// the slot's error flag, which the host checks after the call.
#include "common.cuh"

__device__ __forceinline__ void copy_elem(void* dst, i64 di, const void* src, i64 si, i64 esize) {
    switch (esize) {
        case 2: ((unsigned short*)dst)[di] = ((const unsigned short*)src)[si]; break;
        case 4: ((unsigned int*)dst)[di] = ((const unsigned int*)src)[si]; break;
        default: ((unsigned long long*)dst)[di] = ((const unsigned long long*)src)[si]; break;
    }
}
__device__ __forceinline__ void zero_elem(void* dst, i64 di, i64 esize) {
    switch (esize) {
        case 2: ((unsigned short*)dst)[di] = 0; break;
        case 4: ((unsigned int*)dst)[di] = 0; break;
        default: ((unsigned long long*)dst)[di] = 0; break;
    }
}

struct GatherP { const void* table; const void* ids; void* out; int* err; i64 n; i64 dim; i64 vocab; i64 id64; i64 esize; };

extern "C" __global__ void gather(const GatherP p) {
    pdl_enter();
    i64 total = p.n * p.dim;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 row = i / p.dim, c = i % p.dim;
        i64 id = p.id64 ? ((const long long*)p.ids)[row] : (i64)((const int*)p.ids)[row];
        if (id < 0 || id >= p.vocab) {
            zero_elem(p.out, i, p.esize);
            if (c == 0) atomicOr(p.err, ERR_GATHER_ID);
        } else {
            copy_elem(p.out, i, p.table, id * p.dim + c, p.esize);
        }
    }
}

// The same gather in 16-byte chunks when a row is whole chunks and the
// table and output are 16-byte aligned (the host checks; ids as above).
extern "C" __global__ void gather_vec(const GatherP p) {
    pdl_enter();
    const i64 cpr = p.dim * p.esize / 16;  // chunks per row
    const i64 total = p.n * cpr;
    const uint4* table = (const uint4*)p.table;
    uint4* out = (uint4*)p.out;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 row = i / cpr, c = i % cpr;
        i64 id = p.id64 ? ((const long long*)p.ids)[row] : (i64)((const int*)p.ids)[row];
        if (id < 0 || id >= p.vocab) {
            out[i] = make_uint4(0, 0, 0, 0);
            if (c == 0) atomicOr(p.err, ERR_GATHER_ID);
        } else {
            out[i] = table[id * cpr + c];
        }
    }
}

// `per_batch`: pos holds one position per batch row. Any bad position
// makes the whole write a no-op (as the CPU, which checks every row first).
// A value whose dtype `from` differs from the state's `to` (both floats) is
// rounded to the state's dtype; otherwise elements of `esize` bytes move as
// they are.
struct WriteStateP { void* state; const void* value; const int* pos; int* err; i64 batch; i64 max_rows; i64 new_rows; i64 width; i64 esize; i64 per_batch; i64 from; i64 to; };

extern "C" __global__ void write_state(const WriteStateP p) {
    pdl_enter();
    for (i64 b = 0; b < (p.per_batch ? p.batch : 1); ++b) {
        const i64 pos = (i64)p.pos[b];
        if (pos < 0 || pos + p.new_rows > p.max_rows) {
            if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(p.err, ERR_STATE_OVERFLOW);
            return;
        }
    }
    i64 total = p.batch * p.new_rows * p.width;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        i64 c = i % p.width, s = (i / p.width) % p.new_rows, b = i / (p.width * p.new_rows);
        const i64 pos = (i64)p.pos[p.per_batch ? b : 0];
        const i64 di = (b * p.max_rows + pos + s) * p.width + c;
        if (p.from == p.to) {
            copy_elem(p.state, di, p.value, i, p.esize);
        } else {
            const float v = (float)ld_any(p.value, i, p.from);
            switch (p.to) {
                case DT_F16: ((__half*)p.state)[di] = __float2half_rn(v); break;
                case DT_BF16: ((__nv_bfloat16*)p.state)[di] = __float2bfloat16_rn(v); break;
                default: ((float*)p.state)[di] = v; break;
            }
        }
    }
}

// mode 0: rotate-half (pairs d, d + hd/2); 1: interleaved (pairs 2i, 2i+1).
// Pair i turns by position * theta^(-2i / head_dim) (divided by factors[i]
// when the frequency factors are given: llama3's RoPE scaling).
struct RopeP {
    const void* x; const int* pos; void* out; const float* factors;
    i64 batch; i64 seq; i64 heads; i64 hd; i64 xbs; i64 xrs; i64 mode; i64 per_batch; double theta;
};

template <typename T>
__device__ void rope_body(const RopeP& p) {
    const T* x = (const T*)p.x; T* out = (T*)p.out;
    i64 half = p.hd / 2;
    i64 total = p.batch * p.seq * p.heads * half;
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < total; t += (i64)gridDim.x * blockDim.x) {
        i64 i = t % half, h = (t / half) % p.heads, s = (t / (half * p.heads)) % p.seq, b = t / (half * p.heads * p.seq);
        i64 pos = p.per_batch ? p.pos[b * p.seq + s] : p.pos[s];
        double invd = pow(p.theta, -2.0 * (double)i / (double)p.hd);
        if (p.factors) invd /= (double)p.factors[i];
        float inv = (float)invd;
        float ang = (float)pos * inv, c = cosf(ang), sn = sinf(ang);
        i64 i0 = p.mode == 0 ? i : 2 * i, i1 = p.mode == 0 ? i + half : 2 * i + 1;
        const i64 xo = b * p.xbs + s * p.xrs + h * p.hd;
        const i64 oo = ((b * p.seq + s) * p.heads + h) * p.hd;
        float x0 = ld(x, xo + i0), x1 = ld(x, xo + i1);
        st(out, oo + i0, x0 * c - x1 * sn);
        st(out, oo + i1, x1 * c + x0 * sn);
    }
}
RLX_FLOAT_KERNELS(rope, RopeP)
