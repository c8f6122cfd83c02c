/* topk.cu: exact decode-time Top-K on the GPU (GVR and radix paths), one thread-block cluster per row.
 *
 * What it computes: for each row b of fp32 scores (length len_b), the min(k, len_b) first elements of
 * the order (value descending, -0 == +0, -inf valid, NaN below -inf, ties to the lower index), as
 * int32 indices, then -1 padding (gvr_kernels.h). The result is bit-identical to csrc/topk_cpu.c as a
 * set; the order within a row is deterministic (and sorted when asked).
 *
 * Layout: grid = B * C CTAs of 512 threads, clusters of C CTAs (C in {1, 2, 4, 8, 16}); cluster rank r
 * owns row positions [r*P, (r+1)*P), P = 512 * 4 * VEC, and thread t holds positions
 * r*P + (j*512 + t)*4 + {0..3} for j < VEC (coalesced, aligned float4 loads) as 32-bit sortable keys
 * in registers: the row is read from memory exactly once. Positions are aligned coordinates: position
 * q holds element q - s, s = the row's start in floats past a 16-byte boundary (0..3, row_shift), so a
 * row of any stride or offset is read with aligned float4 loads. Stored key = canonical order key + 1
 * (NaN -> 1, -inf -> 0x00800000, +inf -> 0xFF800001), 0 for positions outside the row.
 *
 * The algorithm is a sequence of rounds on an interval [a, z) of keys known to contain the k-th
 * largest key: c(a) >= kk > c(z), c(t) = #{key >= t}. A round splits [a, z) into bins, histograms the
 * elements inside [a, z) (few after the first round) in shared memory, sums the histograms over the
 * cluster through distributed shared memory (one cluster barrier), and keeps the bin that holds the
 * kk-th key. It ends when [a, z) is one key (or a boundary has count exactly kk).
 *  - GVR (paper 000, sections 4-5, adapted): its own kernel, gvr_xkernel below (guess from the
 *    previous step's Top-K or a strided sample, exchange rounds of 256 value bins around it, exact
 *    ranking of the few candidates left; see its comment). Rows that the registers of a resident
 *    grid cannot hold are streamed: each CTA re-reads its segment chunk by chunk in every pass, so
 *    N is limited only by int32 indices (2^30 here). AUTO dispatches there for N > 4096.
 *  - Radix (the production design): bins are 11/11/10-bit digits of the key; each round sums the
 *    histogram over the cluster by a reduce-scatter through distributed shared memory.
 * Ties at the k-th key: the same rounds search the index bound among elements equal to it (the kk-th
 * key's lowest indices win), on pseudo-keys len - idx.
 * Output: each CTA's selected count -> block scan + cluster prefix -> ordered, deterministic writes.
 * Sorting (sorted=1) is a second kernel: CUB block radix sort of (key desc, index asc) per row.
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "gvr_kernels.h"

namespace cg = cooperative_groups;

namespace {

constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr int RADIX_BINS = 2048;      /* widest digit */
/* Phase-1 statistics read PRED_STATS entries of the previous Top-K (evenly strided over the list:
 * an unbiased subset whatever its order) and a strided sample of SAMPLE row elements. Every CTA of a
 * cluster gathers the same ones (identical statistics, no exchange), so they are few: a cluster of
 * 16 gathering 4096 + 1024 each measured slower (benchmarks/RESULTS.md). Build-time tuning defines. */
#ifndef GVR_PRED_STATS
#define GVR_PRED_STATS 256
#endif
#ifndef GVR_SAMPLE
#define GVR_SAMPLE 256
#endif
constexpr int PRED_STATS = GVR_PRED_STATS;
constexpr int PRED_PER_THREAD = (PRED_STATS + THREADS - 1) / THREADS;
constexpr int SAMPLE = GVR_SAMPLE;
/* stored keys: -inf is 0x00800000, NaN 1, positions past the row 0 */
constexpr uint32_t KEY_POS_INF = 0xFF800001u;
constexpr uint32_t KEY_END = 0xFF800002u;     /* above every stored key */
constexpr uint32_t RAW_PAST_END = 0xFFFFFFFFu; /* raw bits loaded past a row's end: a NaN */

thread_local char g_last_error[512] = "no error";

#ifdef GVR_PROFILE
/* Debug builds only (-DGVR_PROFILE): clock64 stamps of row 0, rank 0, thread 0 at phase ends. The
 * stamp counter lives in shared memory (a global one costs an L2 round trip per stamp). */
__device__ long long g_prof[64];
__shared__ int s_nprof;
#define PROF_RESET()                                                                                  \
    do {                                                                                              \
        if (threadIdx.x == 0)                                                                         \
            s_nprof = 0;                                                                              \
    } while (0)
#define PROFV(tag, v)                                                                                 \
    do {                                                                                              \
        if (blockIdx.x == 0 && threadIdx.x == 0 && s_nprof < 62) {                                    \
            g_prof[s_nprof] = (long long)(v) * 100 + (tag);                                           \
            s_nprof++;                                                                                \
            g_prof[63] = s_nprof;                                                                     \
        }                                                                                             \
    } while (0)
#define PROF(tag) PROFV(tag, clock64())
#else
#define PROFV(tag, v) ((void)0)
#define PROF(tag) ((void)0)
#define PROF_RESET() ((void)0)
#endif

int set_error(const char *what, cudaError_t e)
{
    snprintf(g_last_error, sizeof g_last_error, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return (int)e;
}

__device__ __forceinline__ uint32_t stored_key(float f)
{
    uint32_t b = __float_as_uint(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u)
        return 1u;
    if (b == 0x80000000u)
        b = 0u;
    return ((b & 0x80000000u) ? ~b : (b | 0x80000000u)) + 1u;
}

/* a row's length: lengths[row] clamped to [0, N] (device-resident lengths are not checked on the
 * host; GVR_CHECK=1 validates them there), or N */
__device__ __forceinline__ int row_length(int N, const int *lengths, int row)
{
    if (!lengths)
        return N;
    const int L = lengths[row];
    return L < 0 ? 0 : (L > N ? N : L);
}

/* -1 in a row's output slots [kk, k) (one CTA of the row) */
__device__ __forceinline__ void pad_tail(int *orow, int kk, int k)
{
    for (int i = kk + (int)threadIdx.x; i < k; i += (int)blockDim.x)
        orow[i] = -1;
}

/* Programmatic dependent launch (sm_90+): the kernels are launched with programmatic stream
 * serialization, so that a launch overlaps the end of the kernel before it on the stream (in a CUDA
 * graph of decode steps: the previous layer's or step's kernel). Every kernel first waits for the
 * grids it depends on to complete and flush (griddepcontrol.wait: before any global access; a no-op
 * without the launch attribute), then lets its own dependents launch; they wait in turn for this
 * grid's completion before touching memory, so the early trigger changes scheduling only. */
__device__ __forceinline__ void pdl_enter()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* value of a stored key in [2, KEY_POS_INF] */
__device__ __forceinline__ float key_value(uint32_t sk)
{
    uint32_t k = sk - 1u;
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

struct Shared {
    int hist[2][RADIX_BINS];       /* per-round histograms, double-buffered across cluster rounds */
    int rsum[RADIX_BINS];          /* radix: this CTA's slice of the cluster-summed histogram */
    int pub[2][4];                 /* per-CTA values published to the cluster */
    int state_i[4];
    typename cub::BlockScan<int, THREADS>::TempStorage scan;
};

/* Interval state, identical in every thread of the cluster. */
struct Interval {
    uint32_t a, z; /* [a, z) holds the kk-th key */
    int ca, cz;    /* c(a) >= kk > c(z) */
    int done;      /* c(a) == kk exactly: select every key >= a */
};

template <int C>
__device__ __forceinline__ void cluster_barrier()
{
    if constexpr (C > 1)
        cg::this_cluster().sync();
    else
        __syncthreads();
}

template <int C>
__device__ __forceinline__ const int *remote(const int *p, int r)
{
    if constexpr (C > 1)
        return cg::this_cluster().map_shared_rank(const_cast<int *>(p), r);
    else
        return p;
}

/* Deterministic block sum of M <= 8 floats, one barrier: warp sums (fixed shuffle tree), then every
 * thread adds the warp sums in warp order itself (the same order everywhere: identical results).
 * Once per kernel: s.red is not reused after it. */
template <int M, class S>
__device__ void block_sum(float (&v)[M], S &s)
{
    static_assert(M <= 8 && sizeof(s.red[0]) == 8 * sizeof(float), "block_sum: scratch too small");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < M; i++)
        for (int o = 16; o > 0; o >>= 1)
            v[i] += __shfl_xor_sync(0xFFFFFFFFu, v[i], o);
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < M; i++)
            s.red[warp][i] = v[i];
    __syncthreads();
    float r[8];
#pragma unroll
    for (int i = 0; i < 8; i++)
        r[i] = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) {
        const float4 a = reinterpret_cast<const float4 *>(s.red[w])[0];
        const float4 b = reinterpret_cast<const float4 *>(s.red[w])[1];
        r[0] += a.x, r[1] += a.y, r[2] += a.z, r[3] += a.w, r[4] += b.x, r[5] += b.y, r[6] += b.z, r[7] += b.w;
    }
#pragma unroll
    for (int i = 0; i < M; i++)
        v[i] = r[i];
}

/* Floats between a row's start and the 16-byte boundary below it (0..3). Tiles are laid out in
 * these aligned coordinates, so that every float4 load is aligned whatever the row's address:
 * position q holds element q - row_shift (positions before the row or past its end hold no element).
 * A launch covers gvr_topk_row_positions(p) positions per row (gvr_kernels.h). */
__device__ __forceinline__ int row_shift(const float *row) { return (int)((reinterpret_cast<uintptr_t>(row) >> 2) & 3u); }

template <int C, int VEC>
struct RowTile {
    static constexpr int P = THREADS * 4 * VEC;
    uint32_t key[VEC * 4];
    int base; /* element held by this CTA's first position (negative by the row's shift in slice 0) */
    int L;

    __device__ __forceinline__ int index(int j, int l) const { return base + (j * THREADS + (int)threadIdx.x) * 4 + l; }

    /* Issue the row's loads (raw bits into key[], a NaN outside the row); convert() turns them
     * into stored keys (0 outside the row). */
    __device__ __forceinline__ void load_raw(const float *row, int len, int rank) { load_raw_at(row, len, rank * P); }

    /* the same for the P positions from `first` on (aligned coordinates) */
    __device__ __forceinline__ void load_raw_at(const float *row, int len, int first)
    {
        L = len;
        base = first - row_shift(row);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            const int i = index(j, 0); /* row + i is 16-byte aligned */
            if (i >= 0 && i + 3 < len) {
                const float4 v = __ldg(reinterpret_cast<const float4 *>(row + i));
                key[4 * j + 0] = __float_as_uint(v.x);
                key[4 * j + 1] = __float_as_uint(v.y);
                key[4 * j + 2] = __float_as_uint(v.z);
                key[4 * j + 3] = __float_as_uint(v.w);
            } else {
#pragma unroll
                for (int l = 0; l < 4; l++)
                    key[4 * j + l] = ((unsigned)(i + l) < (unsigned)len) ? __float_as_uint(__ldg(row + i + l)) : RAW_PAST_END;
            }
        }
    }

    __device__ __forceinline__ void convert()
    {
#pragma unroll
        for (int j = 0; j < VEC; j++)
#pragma unroll
            for (int l = 0; l < 4; l++)
                key[4 * j + l] = (unsigned)index(j, l) < (unsigned)L ? stored_key(__uint_as_float(key[4 * j + l])) : 0u;
    }
};

/* A tile of collected (key, index) pairs (streamed kernel after its first pass): the same shape as a
 * RowTile; each warp reads its own segment (n pairs from `first` on), key 0 past the end */
template <int VEC>
struct BufTile {
    uint32_t key[VEC * 4];
    int idx[VEC * 4];
    __device__ __forceinline__ int index(int j, int l) const { return idx[4 * j + l]; }
    __device__ __forceinline__ void load(const uint2 *seg, int n, int first)
    {
#pragma unroll
        for (int q = 0; q < 4 * VEC; q++) {
            const int i = first + q * 32 + (int)(threadIdx.x & 31);
            const uint2 e = i < n ? seg[i] : make_uint2(0u, 0u);
            key[q] = e.x;
            idx[q] = (int)e.y;
        }
    }
};

/* Choose the bin holding the kk-th largest: bins are in descending positions, S_b = c(z) +
 * #{elements in bins >= b}; the chosen bin is the largest b >= 1 with S_b >= kk, or bin 0 when the
 * bins >= 1 hold fewer than kk - c(z). The winner (unique) writes s.state_i. */
__device__ __forceinline__ void pick_bin(Shared &s, const Interval &iv, int kk, int b, int incl, int cnt)
{
    if (b >= 1) {
        const int Sb = iv.cz + incl, Sb1 = Sb - cnt;
        if (Sb >= kk && Sb1 < kk) {
            s.state_i[0] = b;
            s.state_i[1] = Sb;
            s.state_i[2] = Sb1;
        }
    }
}

/* One radix round: histogram the elements whose key lies in [a, z) into nb digit bins given by
 * bin(), sum over the cluster (reduce-scatter, then gather), and narrow [a, z) to the bin holding the
 * kk-th largest. keyf(j, l) gives an element's key, lo_of(b) the first key of bin b. s.hist[par]
 * must be zero on entry; the other buffer is zeroed here for the next round. */
template <int C, int VEC, class KeyF, class BinF, class LoF>
__device__ void round_step(Shared &s, int &par, Interval &iv, int kk, int nb, KeyF keyf, BinF bin, LoF lo_of)
{
    int *h = s.hist[par];
#pragma unroll
    for (int j = 0; j < VEC; j++)
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const uint32_t k = keyf(j, l);
            if (k >= iv.a && k < iv.z)
                atomicAdd(&h[bin(k)], 1);
        }
    PROF(20);
    cluster_barrier<C>();
    PROF(21);
    {
        int *hn = s.hist[par ^ 1]; /* last read by the cluster before the barrier above */
        for (int i = threadIdx.x; i < RADIX_BINS; i += THREADS)
            hn[i] = 0;
    }
    int total_ge1; /* elements in bins >= 1 */
    {
        /* radix: reduce-scatter (CTA r sums its slice of bins over the cluster), then gather */
        const int per = nb / C;
        if constexpr (C > 1) {
            const int rank = (int)cg::this_cluster().block_rank();
            for (int i = threadIdx.x; i < per; i += THREADS) {
                const int b = rank * per + i;
                int t = 0;
                for (int r = 0; r < C; r++)
                    t += remote<C>(h, r)[b];
                s.rsum[b] = t;
            }
            cluster_barrier<C>();
        }
        int cnt[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int b = nb - 1 - (4 * (int)threadIdx.x + i);
            int t = 0;
            if (b >= 0) {
                if constexpr (C > 1)
                    t = remote<C>(s.rsum, b / per)[b];
                else
                    t = h[b];
            }
            cnt[i] = b >= 1 ? t : 0;
        }
        int incl[4], total;
        cub::BlockScan<int, THREADS>(s.scan).InclusiveSum(cnt, incl, total);
#pragma unroll
        for (int i = 0; i < 4; i++)
            pick_bin(s, iv, kk, nb - 1 - (4 * (int)threadIdx.x + i), incl[i], cnt[i]);
        if (threadIdx.x == 0)
            s.state_i[3] = total;
    }
    PROF(23);
    __syncthreads();
    PROF(24);
    total_ge1 = s.state_i[3];
    int chosen, Sb, Sb1;
    if (iv.cz + total_ge1 < kk) {
        chosen = 0;
        Sb = iv.ca;
        Sb1 = iv.cz + total_ge1;
    } else {
        chosen = s.state_i[0];
        Sb = s.state_i[1];
        Sb1 = s.state_i[2];
    }
    const uint32_t na = chosen == 0 ? iv.a : lo_of(chosen);
    const uint32_t nz = chosen == nb - 1 ? iv.z : lo_of(chosen + 1);
    iv.a = na;
    iv.z = nz;
    iv.ca = Sb;
    iv.cz = Sb1;
    iv.done = Sb == kk;
    par ^= 1;
    /* state_i is rewritten only after the next round's cluster barrier */
}

/* GVR bins. A round maps every key in [a, z) to a bin by a monotone arithmetic function f (so the
 * band pass is a few arithmetic operations and one shared-memory atomic per element, no search), and
 * bin b's key range is [min{k: f(k) >= b}, min{k: f(k) >= b+1}), found afterwards for the chosen bin
 * only by a warp-parallel search on f. Bin 0 is not counted (its total follows from c(a)).
 *  VALUE: f(k) = clamp(floor((value(k) - v0) * inv_w) + 1, 0, NB - 1): evenly spaced values. The first
 *         round spans center +- spread from phase 1 (the guess) with NB - 2 bins, bin 0 below and bin
 *         NB - 1 above; later rounds span [value(a), value(z)) with NB - 1 bins.
 *  KEY:   f(k) = clamp(floor((k - a) * (NB - 1) / (z - a)) + 1, 0, NB - 1): evenly spaced keys, for
 *         non-finite brackets, the tie search's pseudo-keys, and after 6 rounds, so that every round
 *         shrinks [a, z) ~NB-fold and the search ends.
 * fl(fl(v - v0) * inv_w) is monotone in v (round to nearest), so f is monotone in the key. */
constexpr int NB = THREADS; /* bins per GVR round: one per thread in the scan */

struct Layout {
    bool key_mode;
    float v0, inv_w;
    uint32_t a;
    double kscale;
};

/* bin of a key in a value layout: 0 below v0 (and NaN, past-the-row), NBINS - 1 at or above the
 * band's top, else 1 + the bin of width 1 / inv_w */
template <int NBINS>
__device__ __forceinline__ int value_bin_f(float v0, float inv_w, float v)
{
    static_assert(NBINS <= (1 << 22), "value_bin_f: floor by rounding down needs u + 2^23 < 2^24");
    const float u = (v - v0) * inv_w; /* NaN stays NaN: bin 0 */
    /* 1 + floor(min(u, NBINS - 2)) for u >= 0 without a conversion instruction: 2^23 + x rounded
     * toward -inf is 2^23 + floor(x) for x in [0, 2^22] (spacing 1 there) */
    const int q = __float_as_int(__fadd_rd(fminf(u, (float)(NBINS - 2)), 8388608.f)) - (0x4B000000 - 1);
    return u >= 0.f ? q : 0;
}

/* the same for a stored key: equal to value_bin_f of the key's float (key_value(stored_key(v)) is
 * v, -0 read as +0, which gives the same bin) */
template <int NBINS>
__device__ __forceinline__ int value_bin(float v0, float inv_w, uint32_t key)
{
    if (key <= 1u)
        return 0; /* NaN (and past-the-row) */
    return value_bin_f<NBINS>(v0, inv_w, key_value(key));
}

template <int NBINS = NB>
__device__ __forceinline__ int layout_bin(const Layout &lay, uint32_t key)
{
    if (lay.key_mode) {
        const double u = (double)(key - lay.a) * lay.kscale;
        return u >= (double)(NBINS - 2) ? NBINS - 1 : (int)u + 1;
    }
    return value_bin<NBINS>(lay.v0, lay.inv_w, key);
}

__device__ Layout make_layout(const Interval &iv, bool first, bool value_ok, float center, float spread)
{
    Layout lay;
    lay.a = iv.a;
    lay.key_mode = true;
    lay.v0 = 0.f;
    lay.inv_w = 0.f;
    const uint64_t width = (uint64_t)iv.z - (uint64_t)iv.a; /* >= 2 */
    lay.kscale = (double)(NB - 1) / (double)width;
    if (first) {
        const float inv = (float)(NB - 2) / (2.f * spread);
        if (spread > 0.f && isfinite(center - spread) && isfinite(center + spread) && isfinite(inv) && inv > 0.f) {
            lay.key_mode = false;
            lay.v0 = center - spread;
            lay.inv_w = inv;
        }
    } else if (value_ok && width > (uint64_t)NB && iv.a >= 2u && iv.z <= KEY_POS_INF) {
        const float va = key_value(iv.a), vz = key_value(iv.z);
        const float inv = (float)(NB - 1) / (vz - va);
        if (isfinite(va) && isfinite(vz) && vz > va && isfinite(inv) && inv > 0.f) {
            lay.key_mode = false;
            lay.v0 = va;
            lay.inv_w = inv;
        }
    }
    return lay;
}

/* Warp-wide: min{k in [lo, hi) : f(k) >= b}, or hi if none. Each step probes 32 evenly spaced keys. */
template <int NBINS = NB>
__device__ __forceinline__ uint32_t warp_boundary(const Layout &lay, int b, uint32_t lo, uint32_t hi)
{
    const int lane = threadIdx.x & 31;
    while (hi > lo) {
        const uint64_t span = (uint64_t)hi - lo;
        const uint64_t step = (span + 31) / 32;
        const uint64_t p = (uint64_t)lo + (uint64_t)lane * step;
        const bool ok = p >= hi || layout_bin<NBINS>(lay, (uint32_t)p) >= b;
        const unsigned m = __ballot_sync(0xFFFFFFFFu, ok);
        if (step == 1) {
            /* probes cover [lo, lo + 32): the first passing probe is the answer */
            const int j = m ? __ffs(m) - 1 : 32;
            return (uint64_t)lo + j >= hi ? hi : lo + (uint32_t)j;
        }
        const int j = m ? __ffs(m) - 1 : 32; /* first probe with f >= b */
        const uint64_t pj = (uint64_t)lo + (uint64_t)j * step;
        const uint64_t nhi = (j == 32 || pj > hi) ? hi : pj;
        const uint64_t nlo = j == 0 ? lo : (uint64_t)lo + (uint64_t)(j - 1) * step + 1;
        lo = (uint32_t)nlo;
        hi = (uint32_t)nhi;
    }
    return hi;
}

/* min{k in [lo, hi) : f(k) >= b} (hi if none), b >= 1: the layout inverted arithmetically, then
 * checked and stepped key by key (rounding puts the estimate within a few keys); a warp-parallel
 * search if that does not settle. Uniform across the warp. */
template <int NBINS = NB>
__device__ __forceinline__ uint32_t boundary(const Layout &lay, int b, uint32_t lo, uint32_t hi)
{
    uint64_t k;
    if (lay.key_mode) {
        k = (uint64_t)lay.a + (uint64_t)ceil((double)(b - 1) / lay.kscale);
    } else {
        const float v = lay.v0 + (float)(b - 1) / lay.inv_w;
        k = isfinite(v) ? stored_key(v) : (uint64_t)hi;
    }
    if (k < lo)
        k = lo;
    if (k > hi)
        k = hi;
    for (int step = 0; step < 16; step++) {
        const bool at = k >= hi || layout_bin<NBINS>(lay, (uint32_t)k) >= b;
        if (!at) {
            k++;
            continue;
        }
        if (k > lo && layout_bin<NBINS>(lay, (uint32_t)(k - 1)) >= b) {
            k--;
            continue;
        }
        return (uint32_t)k;
    }
    return warp_boundary<NBINS>(lay, b, lo, hi);
}

/* min{k in [lo, hi) : f(k) >= b} (hi if none), b >= 1, for a value layout, by one warp (each warp
 * computes it alone; the result is uniform). The 32 keys around the arithmetic estimate are probed
 * at once; if the boundary is not among them (near 0 a bin edge can lie 2^30 keys from the
 * estimate: fl(v - v0) ignores |v| << ulp(v0)), probes at distances 2^j bracket it and
 * warp_boundary finishes. About 2 ballots usually, at most ~9. */
template <int NBINS>
__device__ __forceinline__ uint32_t value_boundary(const Layout &lay, int b, uint32_t lo, uint32_t hi)
{
    const int lane = threadIdx.x & 31;
    const float v = lay.v0 + (float)(b - 1) / lay.inv_w;
    uint64_t e = isfinite(v) ? (uint64_t)stored_key(v) : (uint64_t)hi;
    e = e < lo ? lo : (e > hi ? hi : e);
    const uint64_t w0 = e >= (uint64_t)lo + 16u ? e - 16u : (uint64_t)lo;
    auto pass = [&](uint64_t p) { return p >= hi || layout_bin<NBINS>(lay, (uint32_t)p) >= b; };
    unsigned m = __ballot_sync(0xFFFFFFFFu, pass(w0 + (uint64_t)lane));
    if (m != 0u && !(m & 1u)) /* the edge is inside the window */
        {
        const uint64_t r = w0 + (uint64_t)(__ffs(m) - 1);
        return r < hi ? (uint32_t)r : hi;
    }
    if (m & 1u) {
        /* at or below w0: probes w0 - 2^j; the first failing one brackets the edge */
        if (w0 == lo)
            return lo;
        const uint64_t d = 1ull << lane;
        const uint64_t q = (lane < 31 && w0 >= (uint64_t)lo + d) ? w0 - d : (uint64_t)lo; /* lane 31: lo */
        m = __ballot_sync(0xFFFFFFFFu, !pass(q));
        if (!m)
            return lo;
        const int j = __ffs(m) - 1;
        const uint64_t qj = __shfl_sync(0xFFFFFFFFu, q, j), qp = j ? __shfl_sync(0xFFFFFFFFu, q, j - 1) : w0;
        return warp_boundary<NBINS>(lay, b, (uint32_t)(qj + 1), (uint32_t)qp);
    }
    /* above w0 + 31: probes w0 + 31 + 2^j; the first passing one brackets the edge */
    const uint64_t top = w0 + 31u;
    const uint64_t up = top + (1ull << lane);
    const uint64_t q = (lane < 31 && up < hi) ? up : (uint64_t)hi; /* lane 31: hi */
    m = __ballot_sync(0xFFFFFFFFu, pass(q)); /* pass(hi) holds: never empty */
    const int j = __ffs(m) - 1;
    const uint64_t qj = __shfl_sync(0xFFFFFFFFu, q, j), qp = j ? __shfl_sync(0xFFFFFFFFu, q, j - 1) : top;
    return warp_boundary<NBINS>(lay, b, (uint32_t)(qp + 1), (uint32_t)qj);
}

/* GVR rounds on [a, z) until it is one key or a boundary count equals kk (see the file comment). */
template <int C, int VEC, class KeyF>
__device__ Interval gvr_search(Shared &s, int &par, Interval iv, int kk, bool first, bool value_ok, float center,
                               float spread, KeyF keyf)
{
    Layout lay = make_layout(iv, first, value_ok, center, spread);
    PROF(2);
    for (int round = 1; !iv.done && iv.z - iv.a > 1; round++) {
        int *h = s.hist[par];
#pragma unroll
        for (int j = 0; j < VEC; j++)
#pragma unroll
            for (int l = 0; l < 4; l++) {
                const uint32_t k = keyf(j, l);
                if (k >= iv.a && k < iv.z) {
                    const int b = layout_bin(lay, k);
                    if (b)
                        atomicAdd(&h[b], 1);
                }
            }
        PROF(20);
        cluster_barrier<C>();
        PROF(21);
        {
            int *hn = s.hist[par ^ 1]; /* last read by the cluster before the barrier above */
            for (int i = threadIdx.x; i < RADIX_BINS; i += THREADS)
                hn[i] = 0;
        }
        const int b = NB - 1 - (int)threadIdx.x; /* descending */
        int cnt = 0;
        if (b >= 1) {
#pragma unroll
            for (int r = 0; r < C; r++)
                cnt += remote<C>(h, r)[b];
        }
        int incl, total;
        cub::BlockScan<int, THREADS>(s.scan).InclusiveSum(cnt, incl, total);
        {
            const int Sb = iv.cz + incl, Sb1 = Sb - cnt;
            if (b >= 1 && Sb >= kk && Sb1 < kk) {
                s.state_i[0] = b;
                s.state_i[1] = Sb;
                s.state_i[2] = Sb1;
            }
        }
        __syncthreads();
        int chosen, Sb, Sb1;
        if (iv.cz + total < kk) {
            chosen = 0;
            Sb = iv.ca;
            Sb1 = iv.cz + total;
        } else {
            chosen = s.state_i[0];
            Sb = s.state_i[1];
            Sb1 = s.state_i[2];
        }
        /* every warp finds the chosen bin's key range (same result everywhere) */
        const uint32_t na = chosen == 0 ? iv.a : boundary(lay, chosen, iv.a, iv.z);
        const uint32_t nz = chosen == NB - 1 ? iv.z : boundary(lay, chosen + 1, na, iv.z);
        iv.a = na;
        iv.z = nz;
        iv.ca = Sb;
        iv.cz = Sb1;
        iv.done = Sb == kk;
        par ^= 1;
        PROF(23);
        if (!iv.done && iv.z - iv.a > 1)
            lay = make_layout(iv, false, value_ok && round < 6, 0.f, 0.f);
    }
    return iv;
}

template <int C, int VEC>
__global__ void __launch_bounds__(THREADS, 1)
    gvr_topk_kernel(const float *__restrict__ scores, long long row_stride, int N, const int *__restrict__ lengths,
                    const int *__restrict__ prev, long long prev_stride, int Kp, int k, int method,
                    int *__restrict__ out, long long out_stride)
{
    pdl_enter();
    __shared__ Shared s;
    const int C_ = C;
    const int row = blockIdx.x / C_;
    int rank = 0;
    if constexpr (C > 1)
        rank = (int)cg::this_cluster().block_rank();
    const int L = row_length(N, lengths, row), kk = k < L ? k : L;
    int *orow = out + (long long)row * out_stride;
    if (rank == 0)
        pad_tail(orow, kk, k);
    if (kk == 0)
        return;
    const float *xr = scores + (long long)row * row_stride;

    PROF_RESET();
    PROF(0);
    RowTile<C, VEC> tile;
    tile.load_raw(xr, L, rank);
    tile.convert();
    for (int i = threadIdx.x; i < RADIX_BINS; i += THREADS)
        s.hist[0][i] = 0;
    __syncthreads();
    PROF(1);

    Interval iv{1u, KEY_END, L, 0, 0};
    int par = 0;
    uint32_t vsel = 0, veq = 0;
    int imax = INT_MIN; /* select: key > vsel, or key == veq and index <= imax (positions outside the row
                         * have key 0 == veq and negative indices: no index is <= INT_MIN) */

    if (kk == L) {
        vsel = 0;
    } else {
        /* radix digits: 11/11/10 bits of the key, from the top */
        int shift = 21, width = 11;
        for (int d = 0; d < 3 && !iv.done && iv.z - iv.a > 1; d++) {
            const uint32_t base = (width + shift >= 32) ? 0u : (iv.a & ~((1u << (shift + width)) - 1u));
            const int nb = 1 << width;
            const int sh = shift;
            const uint32_t mask = (uint32_t)nb - 1u;
            const Interval cur = iv;
            round_step<C, VEC>(
                s, par, iv, kk, nb, [&](int j, int l) { return tile.key[4 * j + l]; },
                [&](uint32_t key) { return (int)((key >> sh) & mask); },
                [&](int b) {
                    const uint64_t lo = (uint64_t)base + ((uint64_t)b << sh);
                    return (uint32_t)(lo < cur.a ? cur.a : (lo > cur.z ? cur.z : lo));
                });
            shift = d == 0 ? 10 : 0;
            width = d == 0 ? 11 : 10;
            PROF(1);
        }
        if (iv.done) {
            vsel = iv.a - 1; /* every key >= a */
        } else {
            /* [a, a+1): the kk-th key is a; c(a+1) = cz keys lie above it */
            const uint32_t v = iv.a;
            const int need = kk - iv.cz, equal = iv.ca - iv.cz;
            if (equal == need) {
                vsel = v - 1;
            } else {
                /* ties: the `need` lowest indices among keys equal to v, as the largest pseudo-keys
                 * L - index in [1, L] */
                Interval ix{1u, (uint32_t)L + 1u, equal, 0, 0};
                ix = gvr_search<C, VEC>(s, par, ix, need, false, false, 0.f, 0.f, [&](int j, int l) {
                    return tile.key[4 * j + l] == v ? (uint32_t)(L - tile.index(j, l)) : 0u;
                });
                vsel = v;
                veq = v;
                imax = L - (int)ix.a; /* pseudo >= a  <=>  index <= L - a */
            }
        }
    }

    PROF(1);
    /* Output: ordered by (CTA, thread, element); positions from a block scan and a cluster prefix. */
    int mine = 0;
#pragma unroll
    for (int j = 0; j < VEC; j++)
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const uint32_t key = tile.key[4 * j + l];
            mine += key > vsel || (key == veq && tile.index(j, l) <= imax);
        }
    int offset, cta_total;
    cub::BlockScan<int, THREADS>(s.scan).ExclusiveSum(mine, offset, cta_total);
    if (threadIdx.x == 0)
        s.pub[par][0] = cta_total;
    cluster_barrier<C>();
    if constexpr (C > 1) {
        /* each warp sums the totals of the lower ranks (lane r reads rank r) */
        const int lane = threadIdx.x & 31;
        const int v = lane < rank ? remote<C>(s.pub[par], lane)[0] : 0;
        offset += (int)__reduce_add_sync(0xFFFFFFFFu, (unsigned)v);
        /* no CTA may leave while another still reads its shared memory: arrive now, wait at exit */
        cg::this_cluster().barrier_arrive();
    }
#pragma unroll
    for (int j = 0; j < VEC; j++)
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const uint32_t key = tile.key[4 * j + l];
            if (key > vsel || (key == veq && tile.index(j, l) <= imax))
                orow[offset++] = tile.index(j, l);
        }
    if constexpr (C > 1)
        cg::this_cluster().barrier_wait();
    PROF(1);
}

/* ---------------------------------------------------------------------------------------------
 * The GVR kernel ("exchange" design). Measured on an H100 (scripts/micro_cluster.cu,
 * benchmarks/RESULTS.md): a cluster barrier with release/acquire semantics costs ~0.65 us, a relaxed
 * one ~0.08 us, and pushing a 2 KB histogram to every peer with st.async ~0.4 us (C = 2) to ~1.3 us
 * (C = 16). So this kernel never uses a release barrier inside the search: each round every CTA
 * pushes its small histogram (256 bins as 16-bit counts, 512 bytes) into every peer's shared memory
 * with st.async, signalling the peer's mbarrier (complete-tx), and then sums the C copies locally.
 * All CTAs see identical data and make identical choices, so no CTA waits for a decision.
 *
 * Order: the composite key ck = key << 32 | (2^32 - 1 - index) is unique per element and orders
 * elements exactly as the Top-K order (value descending, ties to the lower index). The search keeps
 * an interval [A, Z] of composite keys that holds the kk-th largest: `above` elements lie above Z
 * (all selected), `cnt_in` inside. A round bins the elements inside [A, Z] and keeps the bin holding
 * the kk-th largest. When cnt_in <= CAND_CAP the candidates are pushed to rank 0, which ranks them
 * exactly (ties included, since composite keys are unique) and writes the `need` best; every CTA
 * writes its elements above Z at offsets known from the exchanged per-rank counts.
 *  - Guess (GVR phase 1): mean and spread of the scores at up to 256 evenly strided entries of the
 *    previous step's Top-K and of a strided sample of 256 (each CTA gathers them itself: no
 *    exchange; one block reduction). The
 *    prediction is used when its mean lies at least halfway from the sample's mean to the sample's
 *    normal-quantile estimate of the k-th value (a useful previous Top-K sits in the upper tail);
 *    otherwise (no or a poor prediction) the sample's estimate is the center. The first round
 *    spreads 254 bins evenly in value over center +- spread, one bin below, one above (the bin
 *    above the band is counted in registers: it can hold many elements).
 *  - Streamed rows (STREAM): per-CTA segments of nch chunks of P elements, read with the next chunk's
 *    loads in flight; 32-bit counts. The first pass also collects the (key, index) pairs of bins
 *    >= coll_bin (a threshold below the guessed k-th value) into per-warp shared-memory segments at
 *    ballot offsets; when no warp overflowed (flags exchanged in the unused histogram bin 0) and
 *    the kk-th lies at or above coll_bin, later rounds and the output read the pairs, not the row
 *    (one pass over memory); otherwise they re-read the row chunk by chunk.
 *  - Register-held rows stay raw floats while the rounds and the output can compare values (value
 *    maps, key-aligned bounds); they become stored keys only when a round needs keys (shift maps,
 *    ties at the boundary).
 *  - Output: per chunk, each warp's elements above Z and candidates take consecutive slots from a
 *    warp sum, a scan of the warp totals and a ballot per element (coalesced and deterministic).
 *  - Value rounds (at most 4): even value bins over a bracket, or a band 8x wider next to an open
 *    side when the k-th value fell outside the previous band.
 *  - Shift rounds: bins (ck - A) >> s on the composite key, 8 bits per round; they end the search
 *    in at most 8 rounds whatever the data (all-equal rows included).
 * ------------------------------------------------------------------------------------------- */
constexpr int XB = 256;           /* bins per round */
constexpr int XW = XB / 2;        /* 32-bit words per histogram (two 16-bit counts) */
constexpr int CAND_CAP = 256; /* candidates ranked by rank 0 */
/* first-round band half-widths in standard deviations of the predicted scores / of the sample
 * (build-time tuning defines, measured in benchmarks/RESULTS.md) */
#ifndef GVR_PRED_SPREAD
#define GVR_PRED_SPREAD 2.5f
#endif
#ifndef GVR_SAMPLE_SPREAD
#define GVR_SAMPLE_SPREAD 1.5f
#endif
constexpr float PRED_SPREAD = GVR_PRED_SPREAD, SAMPLE_SPREAD = GVR_SAMPLE_SPREAD;
/* streamed kernel: (key, index) pairs one CTA collects in shared memory during the first pass */
constexpr int XCOLLECT_CAP = 8192;
constexpr int MAX_C = 16;
constexpr int MAX_VALUE_ROUNDS = 4;
/* register-held rows: count the first round on the raw floats and convert to keys after it (1), or
 * convert while the phase-1 gathers are in flight (0); a build-time tuning define */
#ifndef GVR_RAW_FIRST
#define GVR_RAW_FIRST 1
#endif

/* Histogram words: register-resident rows (<= 32K elements per CTA) pack two 16-bit counts per
 * word; streamed rows (any length per CTA) use 32-bit counts. */
template <bool STREAM>
struct XCounts {
    static constexpr int W = STREAM ? XB : XW; /* 32-bit words per histogram */
    static __device__ __forceinline__ int get(const uint32_t *h, int b)
    {
        if constexpr (STREAM)
            return (int)h[b];
        else
            return (int)((h[b >> 1] >> ((b & 1) * 16)) & 0xFFFFu);
    }
    static __device__ __forceinline__ void add(uint32_t *h, int b, uint32_t n = 1u)
    {
        if constexpr (STREAM)
            atomicAdd(&h[b], n);
        else
            atomicAdd(&h[b >> 1], n << ((b & 1) * 16));
    }
};

template <bool STREAM>
struct XShared {
    static constexpr int W = XCounts<STREAM>::W;
    uint32_t hist[W];                         /* this CTA's counts of the current round */
    uint32_t recv[2][MAX_C][W];               /* every rank's counts, double-buffered by round parity */
    uint2 cand[CAND_CAP];                     /* rank 0: (key, index) of the candidates */
    int above[MAX_C];                         /* per rank: elements above Z */
    int inb[MAX_C];                           /* per rank: elements in [A, Z] */
    unsigned long long mb[3];                 /* mbarriers: exchange (2 parities), candidates */
    __align__(16) float red[WARPS][8]; /* block_sum scratch */
    int pick[4];
    uint32_t edge[2]; /* the chosen bin's key range [edge[0], edge[1]) in a value round */
    int wtot[WARPS];  /* output pass: per-warp counts (above Z | candidates << 16) */
    typename cub::BlockScan<int, THREADS>::TempStorage scan;
};

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* the same shared-memory offset in CTA `rank` of the cluster */
__device__ __forceinline__ uint32_t peer_u32(uint32_t a, int rank)
{
    uint32_t o;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(rank));
    return o;
}

__device__ __forceinline__ void mb_expect_bytes(uint32_t mb, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.relaxed.cluster.shared::cta.b64 _, [%0], %1;" ::"r"(mb), "r"(bytes)
                 : "memory");
}

/* wait for the phase of parity `parity` of a local mbarrier; acquire at cluster scope makes the
 * peers' st.async data visible. The exchanged byte counts follow from counts every CTA computes
 * identically, so the wait always ends; should it not (a bug), trap after ~seconds instead of
 * hanging the stream: the launch then fails with an error the caller sees. */
__device__ __forceinline__ void mb_wait(uint32_t mb, uint32_t parity)
{
    uint32_t done = 0;
    unsigned long long spins = 0;
    do {
        if (++spins == (1ull << 28))
            __trap();
        asm volatile("{\n\t.reg .pred p;\n\t"
                     "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(mb), "r"(parity)
                     : "memory");
    } while (!done);
}

__device__ __forceinline__ void st_async_v4(uint32_t dst, uint4 v, uint32_t mb)
{
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(mb)
                 : "memory");
}

__device__ __forceinline__ void st_async_v2(uint32_t dst, uint2 v, uint32_t mb)
{
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(dst), "r"(v.x),
                 "r"(v.y), "r"(mb)
                 : "memory");
}

__device__ __forceinline__ unsigned long long composite(uint32_t key, int idx)
{
    return ((unsigned long long)key << 32) | (unsigned long long)(0xFFFFFFFFu - (uint32_t)idx);
}

/* One round's bin map: value bins (layout_bin<XB>) while A, Z are key-aligned, else (ck - A) >> sh. */
struct XMap {
    bool value;
    Layout lay;
    unsigned long long A;
    int sh;
};

__device__ __forceinline__ bool value_layout_ok(float v0, float inv_w)
{
    return isfinite(v0) && isfinite(inv_w) && inv_w > 0.f && isfinite(v0 + (float)(XB - 2) * __frcp_rn(inv_w));
}

__device__ __forceinline__ XMap shift_map(unsigned long long A, unsigned long long Z)
{
    XMap m;
    m.value = false;
    m.A = A;
    const unsigned long long width = Z - A;
    m.sh = width >= (unsigned long long)XB ? 64 - __clzll((long long)width) - 8 : 0;
    return m;
}

__device__ __forceinline__ XMap value_map(float v0, float inv_w)
{
    XMap m;
    m.value = true;
    m.lay.key_mode = false;
    m.lay.v0 = v0;
    m.lay.inv_w = inv_w;
    m.lay.a = 0;
    m.lay.kscale = 0.0;
    m.A = 0;
    m.sh = 0;
    return m;
}

/* output class of an element: 0 below A, 1 candidate ([A, Z]), 2 above Z; AL: A and Z key-aligned
 * (32-bit key compares; key 0, past the row, is below any A) */
template <bool AL>
__device__ __forceinline__ int out_class(uint32_t key, int idx, uint32_t ka, uint32_t kz, unsigned long long A,
                                         unsigned long long Z)
{
    if constexpr (AL) {
        return key > kz ? 2 : key >= ka ? 1 : 0;
    } else {
        if (key == 0u)
            return 0;
        const unsigned long long ck = composite(key, idx);
        return ck > Z ? 2 : ck >= A ? 1 : 0;
    }
}

template <bool CLUSTER, int VEC, bool STREAM>
__global__ void __launch_bounds__(THREADS, 1)
    gvr_xkernel(const float *__restrict__ scores, long long row_stride, int N, const int *__restrict__ lengths,
                const int *__restrict__ prev, long long prev_stride, int Kp, int k, int *__restrict__ out,
                long long out_stride, int C, int nch)
{
    pdl_enter();
    __shared__ XShared<STREAM> s;
    using Cnt = XCounts<STREAM>;
    constexpr int HW = Cnt::W;
    const int row = blockIdx.x / C;
    const int t = (int)threadIdx.x, lane = t & 31, warp = t >> 5;
    int rank = 0;
    if constexpr (CLUSTER)
        rank = (int)cg::this_cluster().block_rank();
    const int L = row_length(N, lengths, row), kk = k < L ? k : L;
    int *orow = out + (long long)row * out_stride;
    if (rank == 0)
        pad_tail(orow, kk, k);
    if (kk == 0)
        return; /* uniform over the cluster */
    const float *xr = scores + (long long)row * row_stride;
    constexpr int P = RowTile<1, VEC>::P;
    const int S = nch * P; /* positions per CTA: [rank * S, rank * S + S), aligned coordinates */
    const int seg = rank * S, shift = row_shift(xr);
    /* chunks of this CTA that hold row elements (uniform in the CTA) */
    const int my_nch = L + shift > seg ? min(nch, (L + shift - seg + P - 1) / P) : 0;
    PROF_RESET();
    PROF(0);

    if constexpr (CLUSTER) {
        if (t == 0) {
#pragma unroll
            for (int i = 0; i < 3; i++)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&s.mb[i])) : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        /* the inits are visible to the peers after the matching wait (before the first push) */
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    }

    /* loads: prediction indices, the row, the scores at the predicted indices */
    const bool search = kk < L && L > CAND_CAP;
    int pidx[PRED_PER_THREAD];
    const int kp = prev ? Kp : 0;
    const int np = kp < PRED_STATS ? kp : PRED_STATS; /* entries read: prev[j * kp / np], j < np */
    const int *pr = prev ? prev + (long long)row * prev_stride : nullptr;
    int p0 = -1; /* the first predicted index: its score is the statistics' pivot */
    if (search) {
#pragma unroll
        for (int i = 0; i < PRED_PER_THREAD; i++) {
            const int j = t + i * THREADS;
            pidx[i] = j < np ? __ldg(pr + (np == kp ? j : (int)(((long long)j * kp) / np))) : -1;
        }
        p0 = kp > 0 ? __ldg(pr) : -1;
    }
    /* the row (STREAM false: loaded once, held in registers); streamed: the first chunk's loads,
     * in flight during the guess */
    RowTile<1, VEC> tile;
    if constexpr (!STREAM)
        tile.load_raw(xr, L, rank);
    else if (my_nch > 0)
        tile.load_raw_at(xr, L, seg);
    /* the strided sample (always: it also judges the prediction), independent of the gathers */
    constexpr int SPT = (SAMPLE + THREADS - 1) / THREADS;
    const int sm = L < SAMPLE ? L : SAMPLE;
    float sval[SPT];
    float pval[PRED_PER_THREAD];
    float pivot = 0.f;
    if (search) {
#pragma unroll
        for (int i = 0; i < SPT; i++) {
            const int j = t + i * THREADS;
            sval[i] = j < sm ? __ldg(xr + (int)(((long long)j * L) / sm)) : __int_as_float(0x7FC00000);
        }
#pragma unroll
        for (int i = 0; i < PRED_PER_THREAD; i++)
            pval[i] = (pidx[i] >= 0 && pidx[i] < L) ? __ldg(xr + pidx[i]) : __int_as_float(0x7FC00000);
        pivot = __ldg(xr + ((p0 >= 0 && p0 < L) ? p0 : 0));
    }
#if !GVR_RAW_FIRST
    if constexpr (!STREAM)
        tile.convert(); /* while the gathers are in flight */
#endif
    if (t < HW)
        s.hist[t] = 0;
    if (t < MAX_C) {
        /* per-rank valid elements: everything is "in" before the first round */
        const long long lo = (long long)t * S - shift, hi = lo + S; /* rank t's elements [lo, hi) */
        const long long valid = (hi < L ? hi : L) - (lo > 0 ? lo : 0);
        s.inb[t] = valid < 0 ? 0 : (int)valid;
        s.above[t] = 0;
    }
    __syncthreads();
    PROF(1);

    /* interval state (uniform over the cluster) */
    unsigned long long A = 1ull << 32, Z = ((unsigned long long)KEY_POS_INF << 32) | 0xFFFFFFFFull;
    int above_total = 0, cnt_in = L;
    if (kk == L) {
        /* every element: all "above" a Z below every valid key */
        Z = (1ull << 32) - 1;
        above_total = L;
        cnt_in = 0;
        if (t < MAX_C)
            s.above[t] = s.inb[t];
    }

    XMap map = shift_map(A, Z);
    int coll_bin = XB; /* streamed: first-pass elements in bins >= coll_bin are collected (XB: none) */
    bool use_pred = false;
    if (search) {
        /* Phase 1 (guess): mean and spread of the predicted scores and of a strided sample, in one
         * block reduction of (n, sum d, sum d^2) each, d = v - pivot (a value of the same row, so that
         * E[d^2] - E[d]^2 does not cancel) */
        float st[6] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        pivot = isfinite(pivot) ? pivot : 0.f;
        if (kp >= 16) {
#pragma unroll
            for (int i = 0; i < PRED_PER_THREAD; i++)
                if (isfinite(pval[i])) {
                    const float d = pval[i] - pivot;
                    st[0] += 1.f;
                    st[1] += d;
                    st[2] += d * d;
                }
        }
#pragma unroll
        for (int i = 0; i < SPT; i++)
            if (isfinite(sval[i])) {
                const float d = sval[i] - pivot;
                st[3] += 1.f;
                st[4] += d;
                st[5] += d * d;
            }
        block_sum(st, s);
        /* (the guess only steers the search: fast approximate division is fine here, and it is
         * the same in every CTA) */
        const float ins = __frcp_rn(fmaxf(st[3], 1.f)), mds = st[4] * ins, mean_s = pivot + mds;
        const float sd_s = sqrtf(fmaxf(st[5] * ins - mds * mds, 0.f));
        const float frac = fminf(fmaxf(__fdividef(1.15f * (float)kk, (float)L), 1e-7f), 0.999999f);
        float center = mean_s + sd_s * 1.41421356f * erfcinvf(2.f * frac); /* normal quantile of the sample */
        float spread = SAMPLE_SPREAD * sd_s;
        if (st[0] >= 16.f) {
            const float inp = __frcp_rn(st[0]), mdp = st[1] * inp, mean_p = pivot + mdp;
            const float sd_p = sqrtf(fmaxf(st[2] * inp - mdp * mdp, 0.f));
            /* A useful prediction sits in the upper tail: its mean at least halfway from the sample's
             * mean to the sample's threshold estimate. Then the previous Top-K straddles the current
             * k-th value and its spread is the band; otherwise (a poor prediction, e.g. 2% overlap)
             * the sample's guess is kept. */
            if (mean_p >= 0.5f * (mean_s + center) && sd_p > 0.f) {
                center = mean_p;
                spread = PRED_SPREAD * sd_p;
                use_pred = true;
            }
        }
        const float inv_w = (float)(XB - 2) * __frcp_rn(2.f * spread);
        if (spread > 0.f && value_layout_ok(center - spread, inv_w)) {
            map = value_map(center - spread, inv_w);
            /* streamed: collect from the bin of center - sd/2 (prediction: the k-th value lies
             * within ~0.1 sd of its center) or of the center (the sample's estimate runs low) */
            coll_bin = 1 + (int)((float)(XB - 2) * (use_pred ? (PRED_SPREAD - 0.5f) / (2.f * PRED_SPREAD) : 0.5f));
        }
    }
    if constexpr (CLUSTER)
        asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    PROF(3);

    /* One pass over this CTA's share of the row, f(tile) per chunk of P elements: the register-held
     * tile, or (STREAM) the row re-read chunk by chunk, the next chunk's loads in flight while the
     * current one is processed. */
    /* streamed: the pairs collected in the first pass (dynamic shared memory), their count in this
     * CTA, and whether every later pass reads them instead of the row (uniform over the cluster) */
    extern __shared__ __align__(16) uint2 xbuf[];
    constexpr int WSEG = XCOLLECT_CAP / WARPS; /* each warp collects into its own segment */
    uint2 *wseg = xbuf + warp * WSEG;
    int wcount = 0; /* pairs this warp found (uniform in the warp; > WSEG: overflowed) */
    bool from_buf = false;
    bool chunk0_loaded = STREAM; /* streamed: `tile` holds chunk 0's loads until the first pass */
    /* register-held row: raw floats while every round and the output can work on values (value
     * maps, key-aligned bounds above NaN), stored keys from the first that cannot (to_keys) */
    bool tile_raw = !STREAM && GVR_RAW_FIRST;
    auto to_keys = [&]() {
        if constexpr (!STREAM)
            if (tile_raw) {
                tile.convert();
                tile_raw = false;
            }
    };
    /* streamed, from the row: f(chunk) for each chunk, raw floats (RAW) or stored keys */
    auto chunks = [&](auto raw_c, auto &&f) {
        RowTile<1, VEC> nxt = tile;
        if (!chunk0_loaded && my_nch > 0)
            nxt.load_raw_at(xr, L, seg);
        chunk0_loaded = false;
        for (int c = 0; c < my_nch; c++) {
            RowTile<1, VEC> cur = nxt;
            if (c + 1 < my_nch)
                nxt.load_raw_at(xr, L, seg + (c + 1) * P);
            if constexpr (!decltype(raw_c)::value)
                cur.convert();
            f(cur);
        }
    };
    auto sweep = [&](auto &&f) {
        if constexpr (!STREAM) {
            f(tile);
        } else if (from_buf) {
            for (int q0 = 0; q0 < WSEG; q0 += 128 * VEC) { /* uniform trip count (f may scan) */
                BufTile<VEC> bt;
                bt.load(wseg, wcount, q0);
                f(bt);
            }
        } else {
            chunks(std::false_type{}, f);
        }
    };

    /* rounds */
    int par = 0, value_rounds = 0;
    uint32_t phases = 0;
    while (cnt_in > CAND_CAP) {
        const uint32_t ka = (uint32_t)(A >> 32), kz = (uint32_t)(Z >> 32);
        int top = 0; /* this thread's elements in the top bin (above the band: counted in a register) */
        /* bin 0 (below the band: most elements) follows from the totals; the two maps get their own
         * loops so that the hot one carries no per-element branch on the map kind */
        const bool collecting = STREAM && par == 0 && value_rounds == 0 && !from_buf && map.value && coll_bin < XB;
        if (collecting) {
            /* first streamed pass: count, and collect the elements of bins >= coll_bin into this
             * warp's segment at ballot offsets (deterministic, no block barrier); a warp whose
             * segment overflows raises this CTA's flag in histogram bin 0 (unused: it follows from
             * the totals), so the exchange tells every CTA whether any rank overflowed */
            /* on the raw floats: the first round's interval holds every valid element, value_bin
             * of a stored key is value_bin_f of its float, and the NaN loaded past the row's end
             * falls in bin 0 with the row's NaNs; only collected elements become stored keys */
            const float v0 = map.lay.v0, iw = map.lay.inv_w;
            const unsigned lt = (1u << lane) - 1u;
            if constexpr (STREAM)
                chunks(std::true_type{}, [&](const RowTile<1, VEC> &tl) {
#pragma unroll
                    for (int j = 0; j < VEC; j++)
#pragma unroll
                        for (int l = 0; l < 4; l++) {
                            const float v = __uint_as_float(tl.key[4 * j + l]);
                            const int b = value_bin_f<XB>(v0, iw, v);
                            top += b == XB - 1;
                            if (b && b < XB - 1)
                                Cnt::add(s.hist, b);
                            const bool c = b >= coll_bin;
                            const unsigned m = __ballot_sync(0xFFFFFFFFu, c);
                            const int pos = wcount + __popc(m & lt);
                            if (c && pos < WSEG)
                                wseg[pos] = make_uint2(stored_key(v), (uint32_t)tl.index(j, l));
                            wcount += __popc(m);
                        }
                });
            if (lane == 0 && wcount > WSEG)
                atomicOr(&s.hist[0], 1u);
        } else if (!STREAM && tile_raw && map.value && kz >= 2u) {
            /* the register-held row on its raw floats: [A, Z] as values (key order is value order
             * with -0 == +0; the NaNs, and the NaN fill past the row's end, fail both compares, and
             * they would land in the uncounted bin 0 of any value map anyway) */
            const float v0 = map.lay.v0, iw = map.lay.inv_w;
            const float va = ka >= 2u ? key_value(ka) : -INFINITY, vz = key_value(kz);
#pragma unroll
            for (int i = 0; i < 4 * VEC; i++) {
                const float v = __uint_as_float(tile.key[i]);
                const int b = (v >= va && v <= vz) ? value_bin_f<XB>(v0, iw, v) : 0;
                top += b == XB - 1;
                if (b && b < XB - 1)
                    Cnt::add(s.hist, b);
            }
        } else if (map.value) {
            to_keys();
            const float v0 = map.lay.v0, iw = map.lay.inv_w; /* A, Z key-aligned: 32-bit keys only */
            sweep([&](const auto &tl) {
#pragma unroll
                for (int i = 0; i < 4 * VEC; i++) {
                    const uint32_t key = tl.key[i];
                    const int b = (key >= ka && key <= kz) ? value_bin<XB>(v0, iw, key) : 0;
                    top += b == XB - 1;
                    if (b && b < XB - 1)
                        Cnt::add(s.hist, b);
                }
            });
        } else {
            to_keys();
            sweep([&](const auto &tl) {
#pragma unroll
                for (int j = 0; j < VEC; j++)
#pragma unroll
                    for (int l = 0; l < 4; l++) {
                        const uint32_t key = tl.key[4 * j + l];
                        const unsigned long long ck = composite(key, tl.index(j, l));
                        const int b = (key != 0u && ck >= A && ck <= Z) ? (int)((ck - A) >> map.sh) : 0;
                        top += b == XB - 1;
                        if (b && b < XB - 1)
                            Cnt::add(s.hist, b);
                    }
            });
        }
        top = __reduce_add_sync(0xFFFFFFFFu, top);
        if (lane == 0 && top)
            Cnt::add(s.hist, XB - 1, top);
        __syncthreads();
        PROF(20);
        if (t < HW)
            s.recv[par][rank][t] = s.hist[t];
        if constexpr (CLUSTER) {
            const uint32_t mb = smem_u32(&s.mb[par]);
            if (t == 0)
                mb_expect_bytes(mb, (uint32_t)((C - 1) * HW * 4));
            constexpr int NC16 = HW / 4; /* 16-byte pieces per peer */
            for (int i = t; i < (C - 1) * NC16; i += THREADS) {
                const int chunk = i % NC16, peer = (rank + 1 + i / NC16) % C;
                const uint4 v = reinterpret_cast<const uint4 *>(s.hist)[chunk];
                st_async_v4(peer_u32(smem_u32(&s.recv[par][rank][chunk * 4]), peer), v, peer_u32(mb, peer));
            }
            mb_wait(mb, (phases >> par) & 1u);
            phases ^= 1u << par;
        }
        __syncthreads();
        PROF(21);
        if (t < HW)
            s.hist[t] = 0;
        /* cluster-summed counts, suffix sums from the top bin down, the bin holding the kk-th */
        const int b = XB - 1 - t;
        int cnt = 0;
        if (b >= 1) {
            /* a fixed trip count (C is a launch parameter): the loads issue back to back */
#pragma unroll
            for (int r = 0; r < (CLUSTER ? MAX_C : 1); r++)
                cnt += r < C ? Cnt::get(s.recv[par][r], b) : 0;
        }
        int incl, total; /* total: elements in bins >= 1 */
        cub::BlockScan<int, THREADS>(s.scan).InclusiveSum(cnt, incl, total);
        if (b >= 1) {
            const int Sb = above_total + incl;
            if (Sb >= kk && Sb - cnt < kk) {
                s.pick[0] = b;
                s.pick[1] = Sb;
                s.pick[2] = Sb - cnt;
            }
        }
        __syncthreads();
        const bool low = above_total + total < kk; /* the kk-th is in bin 0 */
        const int bs = low ? 0 : s.pick[0];
        const int Sb = low ? above_total + cnt_in : s.pick[1];
        const int Sb1 = low ? above_total + total : s.pick[2];
        PROF(22);
        /* the chosen bin's key range in a value map: its two edges searched at once by warps 0 and
         * 1 (each is a short chain of dependent probes), shared after the barrier below */
        if (map.value && warp < 2) {
            const uint32_t ka = (uint32_t)(A >> 32), kz1 = (uint32_t)(Z >> 32) + 1u;
            const int eb = bs + warp; /* warp 0: the bin's first key; warp 1: the next bin's */
            const uint32_t e = eb == 0 ? ka : eb == XB ? kz1 : value_boundary<XB>(map.lay, eb, ka, kz1);
            if (lane == 0)
                s.edge[warp] = e;
        }
        /* per rank: elements in bins above the chosen one (now above Z) and in it */
        if (warp < C) {
            int u = 0;
#pragma unroll
            for (int i = 0; i < XB / 32; i++) {
                const int bb = lane + 32 * i;
                u += bb > bs ? Cnt::get(s.recv[par][warp], bb) : 0;
            }
            u = __reduce_add_sync(0xFFFFFFFFu, u);
            if (lane == 0) {
                s.above[warp] += u;
                s.inb[warp] = bs ? Cnt::get(s.recv[par][warp], bs) : s.inb[warp] - u;
            }
        }
        if (collecting) {
            /* later passes read the pairs when no rank overflowed (the flags exchanged in bin 0)
             * and the kk-th lies at or above the collection bin */
            bool over = false;
            for (int r = 0; r < C; r++)
                over |= s.recv[par][r][0] != 0u;
            from_buf = !over && bs >= coll_bin;
        }
        __syncthreads(); /* s.edge */
        PROF(24);
        /* the chosen bin's composite range, and the next round's map */
        if (map.value) {
            const uint32_t kb = s.edge[0], ke = s.edge[1];
            PROFV(91, bs);
            A = (unsigned long long)kb << 32;
            Z = ((unsigned long long)ke << 32) - 1ull;
            const float band = (float)(XB - 2) / map.lay.inv_w;
            float v0 = 0.f, iw = 0.f;
            bool ok = false;
            if (++value_rounds < MAX_VALUE_ROUNDS && ke - kb > (uint32_t)XB) {
                if (bs == XB - 1 && kb >= 2u && kb < KEY_POS_INF) {
                    v0 = key_value(kb); /* above the band: a band 8x wider on top of it */
                    iw = map.lay.inv_w * 0.125f;
                    ok = true;
                } else if (bs == 0 && ke >= 3u && ke <= KEY_POS_INF) {
                    v0 = key_value(ke) - 8.f * band; /* below the band: 8x wider under it */
                    iw = map.lay.inv_w * 0.125f;
                    ok = true;
                } else if (bs > 0 && bs < XB - 1 && kb >= 2u && ke <= KEY_POS_INF) {
                    v0 = key_value(kb); /* inside: even bins over the bin's values */
                    iw = (float)(XB - 2) / (key_value(ke) - v0);
                    ok = true;
                }
            }
            map = ok && value_layout_ok(v0, iw) ? value_map(v0, iw) : shift_map(A, Z);
        } else {
            const unsigned long long lo = A + ((unsigned long long)bs << map.sh);
            const unsigned long long hi = lo + ((1ull << map.sh) - 1ull);
            A = lo;
            Z = (hi >= lo && hi < Z) ? hi : Z; /* hi < lo: wrapped past 2^64 */
            map = shift_map(A, Z);
        }
        above_total = Sb1;
        cnt_in = Sb - Sb1;
        par ^= 1;
        PROF(23);
        PROFV(90, cnt_in);
    }
    __syncthreads(); /* s.above / s.inb final */

    /* output: elements above Z at per-rank offsets; candidates ranked by rank 0 */
    /* key-aligned bounds (every path but shift rounds): 32-bit compares only */
    const bool aligned = (uint32_t)A == 0u && (uint32_t)Z == 0xFFFFFFFFu;
    const uint32_t ka = (uint32_t)(A >> 32), kz = (uint32_t)(Z >> 32);
    /* this CTA's first output slot and candidate slot: the lower ranks' counts (lane r reads rank r) */
    int pos_above = lane < rank ? s.above[lane] : 0, pos_cand = lane < rank ? s.inb[lane] : 0;
    pos_above = (int)__reduce_add_sync(0xFFFFFFFFu, (unsigned)pos_above);
    pos_cand = (int)__reduce_add_sync(0xFFFFFFFFu, (unsigned)pos_cand);
    const uint32_t cmb = smem_u32(&s.mb[2]);
    if (CLUSTER && cnt_in > 0 && rank == 0 && t == 0)
        mb_expect_bytes(cmb, (uint32_t)((cnt_in - s.inb[0]) * 8));
    /* One loop per bound kind, without a per-element branch on it: raw floats against value bounds
     * (KIND 0), keys against key-aligned bounds (1), composite keys (2). Per chunk, each warp's
     * elements above Z and candidates get consecutive slots in (warp, element, lane) order: a
     * warp sum and a scan of the warp totals give the warp's first slots, a ballot per element
     * the lanes' (coalesced writes; deterministic). */
    const unsigned lt = (1u << lane) - 1u;
    auto output_pass = [&](auto kind_c) {
        constexpr int KIND = decltype(kind_c)::value;
        const float va = KIND == 0 ? key_value(ka) : 0.f, vz = KIND == 0 ? key_value(kz) : 0.f;
        auto cls = [&](const auto &tl, int j, int l) {
            if constexpr (KIND == 0) {
                const float v = __uint_as_float(tl.key[4 * j + l]);
                return v > vz ? 2 : v >= va ? 1 : 0;
            } else {
                return out_class<KIND == 1>(tl.key[4 * j + l], tl.index(j, l), ka, kz, A, Z);
            }
        };
        sweep([&](const auto &tl) {
            int n_above = 0, n_cand = 0;
#pragma unroll
            for (int j = 0; j < VEC; j++)
#pragma unroll
                for (int l = 0; l < 4; l++) {
                    const int c = cls(tl, j, l);
                    n_above += c == 2;
                    n_cand += c == 1;
                }
            /* per chunk: at most P <= 32768 above and CAND_CAP candidates, packed in one word */
            const int wsum = (int)__reduce_add_sync(0xFFFFFFFFu, (unsigned)(n_above | (n_cand << 16)));
            if (lane == 0)
                s.wtot[warp] = wsum;
            __syncthreads();
            const int before = (int)__reduce_add_sync(0xFFFFFFFFu, lane < warp ? (unsigned)s.wtot[lane] : 0u);
            const int tot = (int)__reduce_add_sync(0xFFFFFFFFu, lane < WARPS ? (unsigned)s.wtot[lane] : 0u);
            PROF(30);
            if (wsum) { /* warp-uniform */
                int pa = pos_above + (before & 0xFFFF), pc = pos_cand + (before >> 16);
#pragma unroll
                for (int j = 0; j < VEC; j++)
#pragma unroll
                    for (int l = 0; l < 4; l++) {
                        const int c = cls(tl, j, l);
                        const unsigned ma = __ballot_sync(0xFFFFFFFFu, c == 2), mc = __ballot_sync(0xFFFFFFFFu, c == 1);
                        if (c == 2) {
                            orow[pa + __popc(ma & lt)] = tl.index(j, l);
                        } else if (c == 1) {
                            uint32_t key;
                            if constexpr (KIND == 0)
                                key = stored_key(__uint_as_float(tl.key[4 * j + l]));
                            else
                                key = tl.key[4 * j + l];
                            const uint2 v = make_uint2(key, (uint32_t)tl.index(j, l));
                            const int q = pc + __popc(mc & lt);
                            if (rank == 0)
                                s.cand[q] = v;
                            else
                                st_async_v2(peer_u32(smem_u32(&s.cand[q]), 0), v, peer_u32(cmb, 0));
                        }
                        pa += __popc(ma);
                        pc += __popc(mc);
                    }
            }
            pos_above += tot & 0xFFFF;
            pos_cand += tot >> 16;
            if constexpr (STREAM)
                __syncthreads(); /* s.wtot is rewritten for the next chunk */
        });
    };
    if (!aligned) {
        to_keys();
        output_pass(std::integral_constant<int, 2>{});
    } else if (!STREAM && tile_raw && ka >= 2u && kz >= 2u) {
        if constexpr (!STREAM)
            output_pass(std::integral_constant<int, 0>{});
    } else {
        to_keys();
        output_pass(std::integral_constant<int, 1>{});
    }
    if (rank == 0 && cnt_in > 0) {
        __syncthreads();
        if constexpr (CLUSTER)
            mb_wait(cmb, 0u);
        PROF(31);
        const int need = kk - above_total;
        /* exact rank of each candidate: a group of G lanes per candidate (G = 2..32, the most that
         * fit the block), each comparing it with every G-th other, then a shuffle sum */
        int lg = 1; /* log2 G */
        while (lg < 5 && (cnt_in << (lg + 1)) <= THREADS)
            lg++;
        const int c = t >> lg, h = t & ((1 << lg) - 1);
        const bool act = c < cnt_in;
        int better = 0;
        uint2 me = make_uint2(0u, 0u);
        if (act) {
            me = s.cand[c];
            const unsigned long long mc = composite(me.x, (int)me.y);
            for (int i = h; i < cnt_in; i += 1 << lg) {
                const uint2 o = s.cand[i];
                better += composite(o.x, (int)o.y) > mc;
            }
        }
        for (int o = 1; o < (1 << lg); o <<= 1)
            better += __shfl_xor_sync(0xFFFFFFFFu, better, o);
        if (act && h == 0 && better < need)
            orow[above_total + better] = (int)me.y;
        PROF(32);
    }
}

/* float4s per thread of the streamed GVR kernel (chunk = 2048 * XSTREAM_VEC elements); a build-time
 * tuning define, measured in benchmarks/RESULTS.md */
#ifndef GVR_XSTREAM_VEC
#define GVR_XSTREAM_VEC 4
#endif
constexpr int XSTREAM_VEC = GVR_XSTREAM_VEC;
constexpr int XSTREAM_MAX_C = 8;
constexpr int AUTO_RADIX_MAX_N = THREADS * 4 * 2; /* AUTO takes the radix path up to this N */

using XFn = void (*)(const float *, long long, int, const int *, const int *, long long, int, int, int *, long long,
                     int, int);

int sm_count()
{
    static int cached = 0;
    if (!cached) {
        int dev = 0, n = 0;
        if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
            cached = n;
        else
            cached = 132;
    }
    return cached;
}

/* programmatic dependent launch (pdl_enter): a build-time switch for measuring it */
#ifndef GVR_PDL
#define GVR_PDL 1
#endif

/* launch configuration of B rows as clusters of C CTAs (both kernels); attr: room for 2; pdl: launch
 * with programmatic stream serialization (not for occupancy queries) */
cudaLaunchConfig_t x_config(const gvr_topk_params *p, int C, cudaStream_t stream, cudaLaunchAttribute *attr,
                            size_t dyn_smem, bool pdl = true)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(C * p->B), 1, 1);
    cfg.blockDim = dim3(THREADS, 1, 1);
    cfg.dynamicSmemBytes = dyn_smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (GVR_PDL && pdl) {
        attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[1].val.programmaticStreamSerializationAllowed = 1;
        cfg.numAttrs = 2;
    }
    return cfg;
}

int current_device()
{
    int dev = 0;
    return cudaGetDevice(&dev) == cudaSuccess ? dev : 0;
}

template <bool CLUSTER, int VEC, bool STREAM>
struct XInstance {
    static XFn fn() { return gvr_xkernel<CLUSTER, VEC, STREAM>; }
    /* streamed: the collection buffer (dynamic shared memory) */
    static constexpr size_t DYN = STREAM ? (size_t)XCOLLECT_CAP * sizeof(uint2) : 0;

    static cudaError_t configure()
    {
        static bool configured[16]; /* per device: function attributes are set per device */
        const int dev = current_device();
        if (dev >= 16 || !configured[dev]) {
            if (CLUSTER) {
                cudaError_t e = cudaFuncSetAttribute(fn(), cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
                if (e != cudaSuccess)
                    return e;
            }
            if (DYN > 0) {
                cudaError_t e = cudaFuncSetAttribute(fn(), cudaFuncAttributeMaxDynamicSharedMemorySize, (int)DYN);
                if (e != cudaSuccess)
                    return e;
            }
            if (dev < 16)
                configured[dev] = true;
        }
        return cudaSuccess;
    }

    /* how many rows (clusters of C CTAs) run at once on the current device (cached per device) */
    static int resident_rows(int C)
    {
        static int cache[16][MAX_C + 1];
        const int dev = current_device();
        int *slot = dev < 16 ? &cache[dev][C] : nullptr;
        if (slot && *slot)
            return *slot;
        int n = 0;
        if (configure() == cudaSuccess) {
            if (CLUSTER) {
                gvr_topk_params q = {};
                q.B = 1;
                cudaLaunchAttribute attr[2];
                cudaLaunchConfig_t cfg = x_config(&q, C, nullptr, attr, DYN, false);
                if (cudaOccupancyMaxActiveClusters(&n, fn(), &cfg) != cudaSuccess)
                    n = 0;
            } else {
                int per_sm = 0, dev_sms = 0;
                if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn(), THREADS, DYN) == cudaSuccess &&
                    cudaDeviceGetAttribute(&dev_sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess)
                    n = per_sm * dev_sms;
            }
        }
        cudaGetLastError(); /* a failed query is not the caller's error */
        if (n <= 0)
            n = 1; /* unknown: treat as one row per wave, the conservative answer */
        else if (slot)
            *slot = n;
        return n;
    }

    static cudaError_t launch(const gvr_topk_params *p, int C, int nch, cudaStream_t stream)
    {
        cudaError_t e = configure();
        if (e != cudaSuccess)
            return e;
        cudaLaunchAttribute attr[2];
        const cudaLaunchConfig_t cfg = x_config(p, C, stream, attr, DYN);
        return cudaLaunchKernelEx(&cfg, fn(), p->scores, (long long)p->row_stride, p->N, p->lengths, p->prev,
                                  (long long)p->prev_stride, p->prev ? p->Kp : 0, p->k, p->out,
                                  (long long)p->out_stride, C, nch);
    }
};

/* float4s per thread the register-resident GVR kernel is built for; a row of N takes
 * C = ceil(N / (2048 VEC)) CTAs */
constexpr int XVECS[] = {2, 3, 4, 5, 6, 8, 9, 10, 12};

/* Run f.template operator()<Instance>() for the instance of (cluster, vec, stream). */
template <bool CLUSTER, class F>
auto x_visit_vec(int vec, bool stream, F &&f)
{
    if (stream)
        return f(XInstance<CLUSTER, XSTREAM_VEC, true>{});
    switch (vec) {
    case 2: return f(XInstance<CLUSTER, 2, false>{});
    case 3: return f(XInstance<CLUSTER, 3, false>{});
    case 4: return f(XInstance<CLUSTER, 4, false>{});
    case 5: return f(XInstance<CLUSTER, 5, false>{});
    case 6: return f(XInstance<CLUSTER, 6, false>{});
    case 8: return f(XInstance<CLUSTER, 8, false>{});
    case 9: return f(XInstance<CLUSTER, 9, false>{});
    case 10: return f(XInstance<CLUSTER, 10, false>{});
    default: return f(XInstance<CLUSTER, 12, false>{});
    }
}

template <class F>
auto x_visit(int C, int vec, bool stream, F &&f)
{
    return C > 1 ? x_visit_vec<true>(vec, stream, f) : x_visit_vec<false>(vec, stream, f);
}

struct XGeom {
    int C, vec, nch;
    bool stream;
};

int x_resident_rows(int C, int vec, bool stream)
{
    return x_visit(C, vec, stream, [C](auto inst) { return decltype(inst)::resident_rows(C); });
}

/* The GVR kernel's geometry: the row held in registers by the smallest VEC (<= max_vec) whose
 * cluster (at most 16 CTAs) holds it while all B rows run at once (one wave); else the row streamed
 * from memory in chunks by the largest cluster (at most 8) that keeps one wave, or one CTA per row. */
XGeom x_geometry(const gvr_topk_params *p, int max_vec)
{
    const long long npos = gvr_topk_row_positions(p);
    for (int v : XVECS) {
        if (v > max_vec)
            break;
        const long long c = (npos + THREADS * 4 * v - 1) / (THREADS * 4 * v);
        if (c <= MAX_C && p->B <= x_resident_rows((int)c, v, false))
            return XGeom{(int)c, v, 1, false};
    }
    constexpr long long PS = THREADS * 4 * XSTREAM_VEC;
    const long long chunks = (npos + PS - 1) / PS;
    int C = (int)(sm_count() / (p->B > 0 ? p->B : 1)); /* one CTA per SM */
    C = C < 1 ? 1 : (C > XSTREAM_MAX_C ? XSTREAM_MAX_C : C);
    if (C > chunks)
        C = (int)chunks;
    while (C > 1 && p->B > x_resident_rows(C, XSTREAM_VEC, true))
        C--;
    const int nch = (int)((chunks + C - 1) / C);
    return XGeom{C, XSTREAM_VEC, nch, true};
}

/* Sort each row's kk indices by (value descending, index ascending). */
template <int ITEMS>
__global__ void __launch_bounds__(THREADS, 1)
    gvr_topk_sort_kernel(const float *__restrict__ scores, long long row_stride, int N, const int *__restrict__ lengths,
                         int k, int *__restrict__ out, long long out_stride)
{
    pdl_enter();
    using Sort = cub::BlockRadixSort<unsigned long long, THREADS, ITEMS>;
    __shared__ typename Sort::TempStorage tmp;
    const int row = blockIdx.x;
    const int L = row_length(N, lengths, row), kk = k < L ? k : L;
    if (kk <= 1)
        return;
    const float *xr = scores + (long long)row * row_stride;
    int *orow = out + (long long)row * out_stride;
    unsigned long long item[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int pos = threadIdx.x * ITEMS + i;
        if (pos < kk) {
            const int idx = orow[pos];
            const uint32_t key = stored_key(__ldg(xr + idx));
            item[i] = ((unsigned long long)(~key) << 32) | (unsigned)idx;
        } else {
            item[i] = ~0ull;
        }
    }
    Sort(tmp).Sort(item);
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int pos = threadIdx.x * ITEMS + i;
        if (pos < kk)
            orow[pos] = (int)(item[i] & 0xFFFFFFFFu);
    }
}

using TopkFn = void (*)(const float *, long long, int, const int *, const int *, long long, int, int, int, int *,
                        long long);

template <int C, int VEC>
cudaError_t launch_one(const gvr_topk_params *p, int method, cudaStream_t stream)
{
    TopkFn fn = gvr_topk_kernel<C, VEC>;
    static bool configured = false;
    if (!configured) {
        if (C > 8) {
            cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
            if (e != cudaSuccess)
                return e;
        }
        configured = true;
    }
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t cfg = x_config(p, C, stream, attr, 0);
    return cudaLaunchKernelEx(&cfg, fn, p->scores, (long long)p->row_stride, p->N, p->lengths, p->prev,
                              (long long)p->prev_stride, p->prev ? p->Kp : 0, p->k, method, p->out,
                              (long long)p->out_stride);
}

template <int C>
cudaError_t launch_vec(const gvr_topk_params *p, int vec, int method, cudaStream_t stream)
{
    switch (vec) {
    case 2: return launch_one<C, 2>(p, method, stream);
    case 4: return launch_one<C, 4>(p, method, stream);
    case 8: return launch_one<C, 8>(p, method, stream);
    default: return launch_one<C, 16>(p, method, stream);
    }
}

} // namespace

extern "C" {

__attribute__((visibility("default"))) int gvr_cuda_abi_version(void) { return GVR_ABI_VERSION; }

#ifdef GVR_PROFILE
__attribute__((visibility("default"))) int gvr_debug_clocks(long long *host)
{
    return (int)cudaMemcpyFromSymbol(host, g_prof, sizeof(long long) * 64);
}
#endif

__attribute__((visibility("default"))) const char *gvr_cuda_last_error(void) { return g_last_error; }

__attribute__((visibility("default"))) int gvr_cuda_set_device(int device, int *previous)
{
    int cur = -1;
    cudaError_t e = cudaGetDevice(&cur);
    if (e != cudaSuccess)
        return set_error("cudaGetDevice", e);
    if (previous)
        *previous = cur;
    if (cur == device)
        return 0;
    e = cudaSetDevice(device);
    return e == cudaSuccess ? 0 : set_error("cudaSetDevice", e);
}

__attribute__((visibility("default"))) int gvr_cuda_synchronize(void *stream)
{
    cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
    return e == cudaSuccess ? 0 : set_error("cudaStreamSynchronize", e);
}

__attribute__((visibility("default"))) int gvr_cuda_copy_to_host(void *dst, const void *src, size_t n, void *stream)
{
    cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, (cudaStream_t)stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize((cudaStream_t)stream);
    return e == cudaSuccess ? 0 : set_error("copy to host", e);
}

__attribute__((visibility("default"))) size_t gvr_topk_decode_workspace_size(const gvr_topk_params *p)
{
    (void)p;
    return 0;
}

__attribute__((visibility("default"))) int gvr_topk_decode(const gvr_topk_params *p, void *workspace,
                                                            size_t workspace_bytes, void *stream_)
{
    (void)workspace;
    (void)workspace_bytes;
    cudaStream_t stream = (cudaStream_t)stream_;
    if (p->B == 0 || p->k == 0)
        return 0;
    if (p->sorted && p->k > THREADS * 8) {
        snprintf(g_last_error, sizeof g_last_error, "sorted output supports k <= %d", THREADS * 8);
        return 1;
    }
    /* AUTO: the GVR kernel, except for rows that one CTA's registers hold at two float4s per thread
     * (N <= 4096), where the radix path's single-CTA digit rounds measured faster on an H100
     * (benchmarks/RESULTS.md). Both are exact: the choice changes speed only. */
    const int method = p->method != GVR_TOPK_AUTO ? p->method : p->N <= AUTO_RADIX_MAX_N ? GVR_TOPK_RADIX : GVR_TOPK_GVR;
    cudaError_t e;
    if (method == GVR_TOPK_GVR) {
        const XGeom g = x_geometry(p, 12);
        e = x_visit(g.C, g.vec, g.stream, [&](auto inst) { return decltype(inst)::launch(p, g.C, g.nch, stream); });
    } else {
        const long long npos = gvr_topk_row_positions(p);
        static_assert(16 * RowTile<16, 16>::P == GVR_RADIX_MAX_POSITIONS, "radix geometry vs the ABI's limit");
        if (npos > GVR_RADIX_MAX_POSITIONS) {
            snprintf(g_last_error, sizeof g_last_error,
                     "N = %d exceeds the radix path's largest row (%d positions, N plus the rows' start offset "
                     "from a 16-byte boundary in floats); method 'gvr' or 'auto' serves any N",
                     p->N, GVR_RADIX_MAX_POSITIONS);
            return 1;
        }
        /* Radix geometry: the smallest per-thread share (float4s held in registers) whose cluster size
         * (at most 16) holds the row while the grid stays within about two CTAs per SM; otherwise the
         * fewest CTAs per row. */
        int C = 0, vec = 0;
        for (int v = 2; v <= 16 && !C; v *= 2) {
            int c = 1;
            while ((long long)c * THREADS * 4 * v < npos)
                c *= 2;
            if (c <= 16 && (long long)p->B * c <= 2LL * sm_count()) {
                C = c;
                vec = v;
            }
        }
        if (!C) {
            vec = 16;
            C = 1;
            while ((long long)C * THREADS * 4 * vec < npos)
                C *= 2;
        }
        switch (C) {
        case 1: e = launch_vec<1>(p, vec, method, stream); break;
        case 2: e = launch_vec<2>(p, vec, method, stream); break;
        case 4: e = launch_vec<4>(p, vec, method, stream); break;
        case 8: e = launch_vec<8>(p, vec, method, stream); break;
        default: e = launch_vec<16>(p, vec, method, stream); break;
        }
    }
    if (e != cudaSuccess)
        return set_error("gvr_topk_kernel launch", e);
    if (p->sorted) {
        const int items = (p->k + THREADS - 1) / THREADS;
        dim3 grid((unsigned)p->B);
        if (items <= 1)
            gvr_topk_sort_kernel<1><<<grid, THREADS, 0, stream>>>(p->scores, p->row_stride, p->N, p->lengths, p->k,
                                                                 p->out, p->out_stride);
        else if (items <= 2)
            gvr_topk_sort_kernel<2><<<grid, THREADS, 0, stream>>>(p->scores, p->row_stride, p->N, p->lengths, p->k,
                                                                 p->out, p->out_stride);
        else if (items <= 4)
            gvr_topk_sort_kernel<4><<<grid, THREADS, 0, stream>>>(p->scores, p->row_stride, p->N, p->lengths, p->k,
                                                                 p->out, p->out_stride);
        else
            gvr_topk_sort_kernel<8><<<grid, THREADS, 0, stream>>>(p->scores, p->row_stride, p->N, p->lengths, p->k,
                                                                 p->out, p->out_stride);
        e = cudaGetLastError();
        if (e != cudaSuccess)
            return set_error("gvr_topk_sort_kernel launch", e);
    }
    return 0;
}

} // extern "C"
