// Next-token sampling on the device (src/decode.rs launches it).
#include "common.cuh"

// Error flag bit of the sampler (beside those in common.cuh); src/exec.rs
// turns it into a message.
#define ERR_SAMPLE_POS 8

// Sampling (Op::Sample), one block per sequence, with the CPU backend's
// rules (crates/rlx-cpu/src/kernels/sample.rs): repetition penalty over the
// recent history; greedy = the lowest index of the largest non-NaN logit;
// otherwise top-k, min-p and top-p keep prefixes of the candidates sorted by
// (logit desc, index asc), then the temperature and one draw of the
// counter-based uniform(seed, position) walking that same order (index
// order when nothing is cut, as the CPU does).
//
// Nothing is sorted: each prefix is a cut (key, index) — every candidate
// whose key (the logit's bits in total order) is above `key`, and at `key`
// the indices up to `index` — found by searching the key and then, among
// equal logits, the index, with block-wide counts or f64 weight sums per
// step, 16 thresholds per pass over the candidates. Once top-k leaves at
// most SAMPLE_CAP candidates they are copied to shared memory and every
// later pass reads only them.
//
// Sums run in a fixed order (fixed thread assignment and reduction tree),
// so a draw is deterministic; but not in the CPU's sequential order, and
// CUDA's f64 exp may differ from the host's in the last bit, so a draw that
// lands within ~1e-15 (relative) of the boundary between two tokens, or a
// top-p / min-p threshold met with that little to spare, can go the other
// way than on the CPU. Greedy picks are always the CPU's.

#define SAMPLE_THREADS 512
#define SAMPLE_CAP 2048
#define NT 16
// 16-byte loads of logits in flight a thread in the first pass.
#define SAMPLE_INFLIGHT 12

struct SampleP {
    const void* logits; const void* fparams; const void* iparams; const void* history; const void* pos; void* out; int* err;
    i64 batch; i64 vocab; i64 hist_len; i64 bitmap_words;
};

// Float bits in total order (f32::total_cmp for every non-NaN value);
// every non-NaN key is above 0.
__device__ __forceinline__ unsigned fkey(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// rlx_cpu's `uniform`: [0, 1) from (seed, position).
__device__ __forceinline__ double uniform01(unsigned long long seed, unsigned long long position) {
    const unsigned long long z = splitmix64(seed ^ splitmix64(position));
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

struct Cut { unsigned key; unsigned idx; };
__device__ __forceinline__ bool in_cut(const Cut& c, unsigned k, unsigned i) { return k > c.key || (k == c.key && i <= c.idx); }
__device__ __forceinline__ Cut cut_all() { return Cut{0u, 0xFFFFFFFFu}; }

// The logits row, the penalty applied on the fly (a bitmap in shared
// memory marks the penalised ids). `flat`: every candidate gets key 1, so
// the order is the index order.
struct RowSrc {
    const float* l; const unsigned* bits; float rp; bool pen; bool flat; int n;
    // False for a NaN logit (never a candidate).
    __device__ __forceinline__ bool get(int e, float& v, unsigned& i, unsigned& k) const {
        v = l[e];
        i = (unsigned)e;
        if (pen && ((bits[e >> 5] >> (e & 31)) & 1u)) v = v > 0.0f ? v / rp : v * rp;
        k = flat ? 1u : fkey(v);
        return v == v;
    }
};
// Candidates copied to shared memory.
struct SmemSrc {
    const float* v; const unsigned* idx; int n;
    __device__ __forceinline__ bool get(int e, float& x, unsigned& i, unsigned& k) const {
        x = v[e];
        i = idx[e];
        k = fkey(x);
        return true;
    }
};

struct SampleShared {
    long long ired[SAMPLE_THREADS / 32][NT];
    double dred[SAMPLE_THREADS / 32][NT];
    long long ires[NT];
    double dres[NT];
    float fred[SAMPLE_THREADS / 32];
    unsigned ured[SAMPLE_THREADS / 32];
};

// Block-wide sums of NT values per thread, in a fixed order; every thread
// gets them back in `acc`.
template <typename V>
__device__ void block_sums(V (&acc)[NT], V (*red)[NT], V* res) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        V v = acc[j];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) red[warp][j] = v;
    }
    __syncthreads();
    if (threadIdx.x < NT) {
        V s = 0;
        for (int w = 0; w < nw; ++w) s += red[w][threadIdx.x];
        res[threadIdx.x] = s;
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j] = res[j];
    __syncthreads();
}

__device__ long long block_sum_ll(long long v, SampleShared& sh) {
    long long a[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) a[j] = j == 0 ? v : 0;
    block_sums<long long>(a, sh.ired, sh.ires);
    return a[0];
}
__device__ double block_sum_d(double v, SampleShared& sh) {
    double a[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) a[j] = j == 0 ? v : 0.0;
    block_sums<double>(a, sh.dred, sh.dres);
    return a[0];
}
__device__ unsigned block_min_u(unsigned v, SampleShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) sh.ured[warp] = v;
    __syncthreads();
    unsigned r = 0xFFFFFFFFu;
    for (int w = 0; w < nw; ++w) r = min(r, sh.ured[w]);
    __syncthreads();
    return r;
}
__device__ unsigned block_max_u(unsigned v, SampleShared& sh) { return ~block_min_u(~v, sh); }

// What a search adds up per candidate: 1 (`mass` false), or the CPU's
// weight exp(f64(l - mx) [/ t]) · scale (the difference in f32, the rest in
// f64).
struct Weight {
    bool mass; float mx; bool div_t; double t; double scale;
    __device__ __forceinline__ double of(float v) const {
        const double d = (double)(v - mx);
        return exp(div_t ? d / t : d) * scale;
    }
};

// The test a prefix's sum must pass: > thr (strict) or >= thr.
struct Cond {
    double thr; bool strict;
    __device__ __forceinline__ bool ok(double v) const { return strict ? v > thr : v >= thr; }
};

// Sums over the candidates of cut `in`, for NT thresholds t[j]: mode 0,
// those with key >= t[j]; mode 1, those with key > `at`, or key == `at` and
// index <= t[j].
template <class Src>
__device__ void sums_at(const Src& src, const Cut& in, const Weight& w, int mode, unsigned at, const unsigned (&t)[NT], double (&out)[NT],
                        SampleShared& sh) {
    if (w.mass) {
        double acc[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[j] = 0.0;
        for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
            float v;
            unsigned i, k;
            if (!src.get(e, v, i, k) || !in_cut(in, k, i) || (mode == 1 && k < at)) continue;
            const double x = w.of(v);
#pragma unroll
            for (int j = 0; j < NT; ++j) acc[j] += (mode == 0 ? k >= t[j] : (k > at || i <= t[j])) ? x : 0.0;
        }
        block_sums<double>(acc, sh.dred, sh.dres);
#pragma unroll
        for (int j = 0; j < NT; ++j) out[j] = acc[j];
    } else {
        long long acc[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[j] = 0;
        for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
            float v;
            unsigned i, k;
            if (!src.get(e, v, i, k) || !in_cut(in, k, i) || (mode == 1 && k < at)) continue;
#pragma unroll
            for (int j = 0; j < NT; ++j) acc[j] += (mode == 0 ? k >= t[j] : (k > at || i <= t[j])) ? 1 : 0;
        }
        block_sums<long long>(acc, sh.ired, sh.ires);
#pragma unroll
        for (int j = 0; j < NT; ++j) out[j] = (double)acc[j];
    }
}

// The shortest prefix of cut `in` whose sum passes `cond`, as a cut; false
// when all of `in` does not. `kmax`: the largest key in `in`; `ilast`: the
// largest index there may be.
template <class Src>
__device__ bool prefix_cut(const Src& src, const Cut& in, unsigned kmax, unsigned ilast, const Weight& w, const Cond& cond, Cut& res,
                           SampleShared& sh) {
    unsigned t[NT];
    double f[NT];
    // The key: the largest v such that the candidates at or above v pass
    // (their sum falls as v rises); lo always passes, hi + 1 never.
#pragma unroll
    for (int j = 0; j < NT; ++j) t[j] = 0;
    sums_at(src, in, w, 0, 0, t, f, sh);
    if (!cond.ok(f[0])) return false;
    unsigned lo = 0, hi = kmax;
    while (lo < hi) {
        const unsigned long long span = (unsigned long long)(hi - lo);
        // NT thresholds in (lo, hi], the last one hi.
#pragma unroll
        for (int j = 0; j < NT; ++j) t[j] = lo + (unsigned)((span * (j + 1) + NT - 1) / NT);
        sums_at(src, in, w, 0, 0, t, f, sh);
        int best = -1;
#pragma unroll
        for (int j = 0; j < NT; ++j) best = cond.ok(f[j]) ? j : best;
        if (best < 0) {
            hi = t[0] - 1;
        } else {
            lo = t[best];
            if (best + 1 < NT) hi = t[best + 1] - 1;
        }
    }
    const unsigned key = lo;
    // The index: the smallest c such that the keys above, and at `key` the
    // indices up to c, pass; c = the last index there when only one
    // candidate has the key.
    unsigned clo = 0, chi = (in.key == key && in.idx < ilast) ? in.idx : ilast;
    {
        long long n = 0;
        unsigned imax = 0;
        for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
            float v;
            unsigned i, k;
            if (!src.get(e, v, i, k) || k != key || !in_cut(in, k, i)) continue;
            ++n;
            imax = max(imax, i);
        }
        n = block_sum_ll(n, sh);
        imax = block_max_u(imax, sh);
        if (n == 1) clo = chi = imax;
    }
    while (clo < chi) {
        const unsigned long long span = (unsigned long long)(chi - clo);
        // NT thresholds in [clo, chi).
#pragma unroll
        for (int j = 0; j < NT; ++j) t[j] = clo + (unsigned)(span * j / NT);
        sums_at(src, in, w, 1, key, t, f, sh);
        int first = NT;
#pragma unroll
        for (int j = NT - 1; j >= 0; --j) first = cond.ok(f[j]) ? j : first;
        if (first == 0) {
            chi = t[0];
        } else if (first == NT) {
            clo = t[NT - 1] + 1;
        } else {
            clo = t[first - 1] + 1;
            chi = t[first];
        }
    }
    res = Cut{key, clo};
    return true;
}

// The first k candidates of cut `in` (k at most its size).
template <class Src>
__device__ Cut first_k(const Src& src, const Cut& in, unsigned kmax, unsigned ilast, long long k, SampleShared& sh) {
    const Weight count{false, 0.0f, false, 1.0, 1.0};
    Cut c = in;
    prefix_cut(src, in, kmax, ilast, count, Cond{(double)k, false}, c, sh);
    return c;
}

// The sum of weights over cut `in`.
template <class Src>
__device__ double mass_of(const Src& src, const Cut& in, const Weight& w, SampleShared& sh) {
    double s = 0.0;
    for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (src.get(e, v, i, k) && in_cut(in, k, i)) s += w.of(v);
    }
    return block_sum_d(s, sh);
}

// Candidates of cut `in` whose weight is at least thr.
template <class Src>
__device__ long long count_at_least(const Src& src, const Cut& in, const Weight& w, double thr, SampleShared& sh) {
    long long s = 0;
    for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (src.get(e, v, i, k) && in_cut(in, k, i) && w.of(v) >= thr) ++s;
    }
    return block_sum_ll(s, sh);
}

// The last candidate of cut `in`: the largest index at its smallest key.
template <class Src>
__device__ unsigned last_of(const Src& src, const Cut& in, SampleShared& sh) {
    unsigned kmin = 0xFFFFFFFFu;
    for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (src.get(e, v, i, k) && in_cut(in, k, i)) kmin = min(kmin, k);
    }
    kmin = block_min_u(kmin, sh);
    unsigned imax = 0;
    for (int e = threadIdx.x; e < src.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (src.get(e, v, i, k) && k == kmin && in_cut(in, k, i)) imax = max(imax, i);
    }
    return block_max_u(imax, sh);
}

// Everything after top-k, over the candidates of cut `a` (na of them,
// largest key kmax): min-p, top-p (`filter`), the temperature, the draw.
template <class Src>
__device__ unsigned sample_prefix(const Src& src, Cut a, long long na, unsigned kmax, unsigned ilast, float mx, float top_p, float min_p,
                                  float temp, double u01, SampleShared& sh) {
    Cut c = a;
    const Weight w{true, mx, false, 1.0, 1.0};
    if (min_p > 0.0f) {
        // The candidates whose weight is at least min_p lead the order.
        long long keep = count_at_least(src, a, w, (double)min_p, sh);
        keep = keep < 1 ? 1 : keep;
        if (keep < na) c = first_k(src, a, kmax, ilast, keep, sh);
    }
    if (top_p < 1.0f) {
        // Normalised by the sum over all of top-k, as the CPU.
        const double total = mass_of(src, a, w, sh);
        const Weight wn{true, mx, false, 1.0, 1.0 / total};
        Cut pc;
        if (prefix_cut(src, c, kmax, ilast, wn, Cond{(double)top_p, false}, pc, sh)) c = pc;
    }
    const Weight wt{true, mx, true, (double)temp, 1.0};
    const double total = mass_of(src, c, wt, sh);
    Cut pick;
    // The first candidate whose running sum passes u; when rounding leaves
    // u at or past the total, the last one (the CPU's fallback).
    if (prefix_cut(src, c, kmax, ilast, wt, Cond{u01 * total, true}, pick, sh)) return pick.idx;
    return last_of(src, c, sh);
}

// Copies the candidates of cut `a` (at most SAMPLE_CAP are kept) to
// shared memory in a fixed order: thread-major, each thread's in index
// order, at offsets from a block-wide exclusive scan. Returns how many the
// cut holds.
__device__ long long copy_cut(const RowSrc& row, const Cut& a, float* cval, unsigned* cidx, SampleShared& sh) {
    long long mine = 0;
    for (int e = threadIdx.x; e < row.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (row.get(e, v, i, k) && in_cut(a, k, i)) ++mine;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    long long incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
        const long long y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) sh.ired[warp][0] = incl;
    __syncthreads();
    long long off = incl - mine, total = 0;
    for (int w = 0; w < nw; ++w) {
        if (w < warp) off += sh.ired[w][0];
        total += sh.ired[w][0];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < row.n; e += blockDim.x) {
        float v;
        unsigned i, k;
        if (row.get(e, v, i, k) && in_cut(a, k, i) && off < SAMPLE_CAP) {
            cval[off] = v;
            cidx[off] = i;
            ++off;
        }
    }
    __syncthreads();
    return total;
}

// first_k over the whole row (k below the number of candidates), the same
// cut, found faster: one pass counts the candidates at or above NT
// thresholds below the largest logit (mx − 2^-4 .. mx − 2^11); when one of
// them holds between k and SAMPLE_CAP candidates, those (a superset of the
// first k) move to shared memory and the search runs there instead of
// reading the whole vocabulary once per step.
__device__ Cut first_k_of_row(const RowSrc& row, unsigned kmax, unsigned ilast, float mx, long long k, float* cval, unsigned* cidx,
                              SampleShared& sh) {
    if (k <= SAMPLE_CAP && isfinite(mx)) {
        unsigned t[NT];
        double f[NT];
#pragma unroll
        for (int j = 0; j < NT; ++j) t[j] = fkey(mx - ldexpf(1.0f, j - 4));
        sums_at(row, cut_all(), Weight{false, 0.0f, false, 1.0, 1.0}, 0, 0u, t, f, sh);
        int pick = -1;
#pragma unroll
        for (int j = NT - 1; j >= 0; --j) pick = (f[j] >= (double)k && f[j] <= (double)SAMPLE_CAP) ? j : pick;
        if (pick >= 0) {
            const long long n = copy_cut(row, Cut{t[pick], 0xFFFFFFFFu}, cval, cidx, sh);
            const SmemSrc cs{cval, cidx, (int)n};
            const Cut c = first_k(cs, cut_all(), kmax, ilast, k, sh);
            // Every thread has read the copy before the caller reuses it.
            __syncthreads();
            return c;
        }
    }
    return first_k(row, cut_all(), kmax, ilast, k, sh);
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample(const SampleP p) {
    pdl_enter();
    extern __shared__ unsigned smem[];
    __shared__ SampleShared sh;
    unsigned* bits = smem;
    float* cval = (float*)(smem + p.bitmap_words);
    unsigned* cidx = (unsigned*)(cval + SAMPLE_CAP);
    const i64 b = blockIdx.x;
    const int V = (int)p.vocab;
    const unsigned ilast = (unsigned)(V - 1);
    const float* fp = (const float*)p.fparams + b * 4;
    const int* ip = (const int*)p.iparams + b * 4;
    const float temp = fp[0], top_p = fp[1], min_p = fp[2], rp = fp[3];
    const int top_k = ip[0], last_n = ip[1];
    const unsigned long long seed = (unsigned long long)(unsigned)ip[2] | ((unsigned long long)(unsigned)ip[3] << 32);
    const i64 at = ((const int*)p.pos)[b];
    int* out = (int*)p.out;
    if (at < 0 || at >= (p.hist_len > 1 ? p.hist_len : 1)) {
        if (threadIdx.x == 0) {
            out[b] = 0;
            atomicOr(p.err, ERR_SAMPLE_POS);
        }
        return;
    }

    // Repetition penalty: mark the ids at positions at-repeat_last_n+1 ..= at.
    const bool pen = rp != 1.0f && rp > 0.0f && p.hist_len > 0;
    if (pen) {
        for (i64 w = threadIdx.x; w < p.bitmap_words; w += blockDim.x) bits[w] = 0;
        __syncthreads();
        i64 first = at - (i64)(last_n > 0 ? last_n : 0) + 1;
        first = first > 0 ? first : 0;
        const int* hist = (const int*)p.history + b * p.hist_len;
        for (i64 j = first + threadIdx.x; j <= at; j += blockDim.x) {
            const int t = hist[j];
            if (t >= 0 && t < V) atomicOr(&bits[t >> 5], 1u << (t & 31));
        }
        __syncthreads();
    }
    const RowSrc row{(const float*)p.logits + b * p.vocab, bits, rp, pen, false, V};

    // The largest non-NaN logit (lowest index on ties) and the candidates.
    // A thread visits its elements in index order, so the first of equal
    // logits it sees is its lowest; the logits come in runs of 4 (one
    // 16-byte load where the row is aligned), SAMPLE_INFLIGHT runs in
    // flight a thread (the logits just written are read from L2, so the
    // pass is a few round trips: a 49,152-id vocabulary takes two).
    float best = -INFINITY;
    int bi = -1;
    long long nvalid = 0;
    const auto visit = [&](int e, float v) {
        if (pen && ((bits[e >> 5] >> (e & 31)) & 1u)) v = v > 0.0f ? v / rp : v * rp;
        if (v != v) return;
        ++nvalid;
        if (bi < 0 || v > best) {
            best = v;
            bi = e;
        }
    };
    const int runs = ((unsigned long long)row.l & 15) == 0 ? V / 4 : 0;
    const float4* l4 = (const float4*)row.l;
    for (int r0 = threadIdx.x; r0 < runs; r0 += SAMPLE_INFLIGHT * blockDim.x) {
        float4 q[SAMPLE_INFLIGHT];
#pragma unroll
        for (int u = 0; u < SAMPLE_INFLIGHT; ++u) {
            const int r = r0 + u * (int)blockDim.x;
            q[u] = r < runs ? l4[r] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < SAMPLE_INFLIGHT; ++u) {
            const int r = r0 + u * (int)blockDim.x;
            if (r < runs) {
                visit(4 * r, q[u].x);
                visit(4 * r + 1, q[u].y);
                visit(4 * r + 2, q[u].z);
                visit(4 * r + 3, q[u].w);
            }
        }
    }
    for (int e = 4 * runs + threadIdx.x; e < V; e += blockDim.x) visit(e, row.l[e]);
    {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) {
                best = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            sh.fred[warp] = best;
            sh.ured[warp] = (unsigned)bi;
        }
        __syncthreads();
        best = -INFINITY;
        bi = -1;
        for (int w = 0; w < nw; ++w) {
            const int oi = (int)sh.ured[w];
            const float ov = sh.fred[w];
            if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) {
                best = ov;
                bi = oi;
            }
        }
        __syncthreads();
    }
    nvalid = block_sum_ll(nvalid, sh);
    if (!(temp > 0.0f) || nvalid == 0) {
        // Greedy; a row of NaNs gives 0, as on the CPU.
        if (threadIdx.x == 0) out[b] = bi < 0 ? 0 : bi;
        return;
    }
    const float mx = best;
    const double u01 = uniform01(seed, (unsigned long long)at);
    unsigned tok;
    if (top_k <= 0 && !(top_p < 1.0f) && !(min_p > 0.0f)) {
        // Nothing cut: every candidate, drawn in index order.
        const RowSrc flat{row.l, bits, rp, pen, true, V};
        tok = sample_prefix(flat, cut_all(), nvalid, 1u, ilast, mx, 1.0f, 0.0f, temp, u01, sh);
    } else {
        const unsigned kmax = fkey(mx);
        Cut a = cut_all();
        long long na = nvalid;
        if (top_k > 0 && (long long)top_k < nvalid) {
            a = first_k_of_row(row, kmax, ilast, mx, top_k, cval, cidx, sh);
            na = top_k;
        }
        if (na <= SAMPLE_CAP) {
            copy_cut(row, a, cval, cidx, sh);
            const SmemSrc cs{cval, cidx, (int)na};
            tok = sample_prefix(cs, cut_all(), na, kmax, ilast, mx, top_p, min_p, temp, u01, sh);
        } else {
            tok = sample_prefix(row, a, na, kmax, ilast, mx, top_p, min_p, temp, u01, sh);
        }
    }
    if (threadIdx.x == 0) out[b] = (int)tok;
}
