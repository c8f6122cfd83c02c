/* topk.cu: exact decode-time Top-K on the GPU (GVR and radix paths), one thread-block cluster per row.
 *
 * What it computes: for each row b of fp32 scores (length len_b), the min(k, len_b) first elements of
 * the order (value descending, -0 == +0, -inf valid, NaN below -inf, ties to the lower index), as
 * int32 indices, then -1 padding (gvr_kernels.h). The result is bit-identical to csrc/topk_cpu.c as a
 * set; the order within a row is deterministic (and sorted when asked).
 *
 * Layout: grid = B * C CTAs of 512 threads, clusters of C CTAs (C in {1, 2, 4, 8, 16}); cluster rank r
 * owns row elements [r*P, (r+1)*P), P = 512 * 4 * VEC, and thread t holds elements
 * r*P + (j*512 + t)*4 + {0..3} for j < VEC (coalesced float4 loads) as 32-bit sortable keys in
 * registers: the row is read from memory exactly once. Stored key = canonical order key + 1
 * (NaN -> 1, -inf -> 0x00800000, +inf -> 0xFF800001), 0 for positions past the row's end.
 *
 * The algorithm is a sequence of rounds on an interval [a, z) of keys known to contain the k-th
 * largest key: c(a) >= kk > c(z), c(t) = #{key >= t}. A round splits [a, z) into bins, histograms the
 * elements inside [a, z) (few after the first round) in shared memory, sums the histograms over the
 * cluster through distributed shared memory (one cluster barrier), and keeps the bin that holds the
 * kk-th key. It ends when [a, z) is one key (or a boundary has count exactly kk).
 *  - GVR (paper 000, sections 4-5, adapted): phase 1 ("guess") reduces the scores at the previous
 *    step's Top-K to a mean and spread (a strided sample of the row and its normal quantile for kk/len
 *    when there is no usable prediction); each round then bins [a, z) into 511 bins by a monotone
 *    arithmetic map (evenly in value around the guess first, then evenly over the bracket's values,
 *    evenly in key space for non-finite brackets and after 6 rounds), so a round resolves ~9 bits of
 *    the relevant value range: typically 2 rounds to the exact k-th key ("verify" + "refine" by
 *    counting; no candidate buffer, no non-exact fallback, termination guaranteed by the key-space
 *    rounds).
 *  - Radix (the production design): bins are 11/11/10-bit digits of the key. AUTO dispatches here
 *    (measured faster or equal on an H100, benchmarks/RESULTS.md).
 * Ties at the k-th key: the same rounds search the index bound among elements equal to it (the kk-th
 * key's lowest indices win), on pseudo-keys len - idx.
 * Output: each CTA's selected count -> block scan + cluster prefix -> ordered, deterministic writes.
 * Sorting (sorted=1) is a second kernel: CUB block radix sort of (key desc, index asc) per row.
 */
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdio>
#include <cstring>

#include "gvr_kernels.h"

namespace cg = cooperative_groups;

namespace {

constexpr int THREADS = 512;
constexpr int WARPS = THREADS / 32;
constexpr int RADIX_BINS = 2048;      /* widest digit */
constexpr int MAX_PRED = 4096;        /* prediction entries read (a hint: a prefix is enough) */
constexpr int PRED_PER_THREAD = MAX_PRED / THREADS;
constexpr int SAMPLE = 1024;          /* strided sample without a prediction */
/* stored keys: -inf is 0x00800000, NaN 1, positions past the row 0 */
constexpr uint32_t KEY_POS_INF = 0xFF800001u;
constexpr uint32_t KEY_END = 0xFF800002u;     /* above every stored key */

thread_local char g_last_error[512] = "no error";

#ifdef GVR_PROFILE
/* Debug builds only (-DGVR_PROFILE): clock64 stamps of row 0, rank 0, thread 0 at phase ends. */
__device__ long long g_prof[64];
__device__ int g_nprof;
#define PROF_RESET()                                                                                  \
    do {                                                                                              \
        if (blockIdx.x == 0 && threadIdx.x == 0)                                                      \
            g_nprof = 0;                                                                              \
    } while (0)
#define PROF(tag)                                                                                     \
    do {                                                                                              \
        if (blockIdx.x == 0 && threadIdx.x == 0 && g_nprof < 62) {                                    \
            g_prof[g_nprof] = clock64() * 100 + (tag);                                                \
            g_nprof++;                                                                                \
            g_prof[63] = g_nprof;                                                                     \
        }                                                                                             \
    } while (0)
#else
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
    float red[WARPS][4];           /* block reduction scratch */
    int state_i[4];
    float stats[4];
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

/* Deterministic block sum of 4 floats (fixed shuffle tree, fixed warp order). */
__device__ void block_sum4(float v[4], Shared &s)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < 4; i++)
        for (int o = 16; o > 0; o >>= 1)
            v[i] += __shfl_xor_sync(0xFFFFFFFFu, v[i], o);
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < 4; i++)
            s.red[warp][i] = v[i];
    __syncthreads();
    if (threadIdx.x < 4) {
        float t = 0.f;
        for (int w = 0; w < WARPS; w++)
            t += s.red[w][threadIdx.x];
        s.stats[threadIdx.x] = t;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; i++)
        v[i] = s.stats[i];
    __syncthreads();
}

template <int C, int VEC>
struct RowTile {
    static constexpr int P = THREADS * 4 * VEC;
    uint32_t key[VEC * 4];
    int base; /* first index of this CTA's slice */
    int L;

    __device__ __forceinline__ int index(int j, int l) const { return base + (j * THREADS + (int)threadIdx.x) * 4 + l; }

    /* Issue the row's loads (raw bits into key[]); convert() turns them into stored keys. */
    __device__ __forceinline__ void load_raw(const float *row, int len, int rank)
    {
        L = len;
        base = rank * P;
        const bool vec_ok = (reinterpret_cast<uintptr_t>(row) & 15u) == 0;
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            const int i = index(j, 0);
            if (vec_ok && i + 3 < len) {
                const float4 v = __ldg(reinterpret_cast<const float4 *>(row + i));
                key[4 * j + 0] = __float_as_uint(v.x);
                key[4 * j + 1] = __float_as_uint(v.y);
                key[4 * j + 2] = __float_as_uint(v.z);
                key[4 * j + 3] = __float_as_uint(v.w);
            } else {
#pragma unroll
                for (int l = 0; l < 4; l++)
                    key[4 * j + l] = (i + l < len) ? __float_as_uint(__ldg(row + i + l)) : 0u;
            }
        }
    }

    __device__ __forceinline__ void convert()
    {
#pragma unroll
        for (int j = 0; j < VEC; j++)
#pragma unroll
            for (int l = 0; l < 4; l++)
                key[4 * j + l] = index(j, l) < L ? stored_key(__uint_as_float(key[4 * j + l])) : 0u;
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

__device__ __forceinline__ int layout_bin(const Layout &lay, uint32_t key)
{
    if (lay.key_mode) {
        const double u = (double)(key - lay.a) * lay.kscale;
        return u >= (double)(NB - 2) ? NB - 1 : (int)u + 1;
    }
    if (key <= 1u)
        return 0; /* NaN (and past-the-row) */
    const float u = (key_value(key) - lay.v0) * lay.inv_w;
    if (!(u >= 0.f))
        return 0;
    return u >= (float)(NB - 2) ? NB - 1 : (int)u + 1;
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
__device__ __forceinline__ uint32_t warp_boundary(const Layout &lay, int b, uint32_t lo, uint32_t hi)
{
    const int lane = threadIdx.x & 31;
    while (hi > lo) {
        const uint64_t span = (uint64_t)hi - lo;
        const uint64_t step = (span + 31) / 32;
        const uint64_t p = (uint64_t)lo + (uint64_t)lane * step;
        const bool ok = p >= hi || layout_bin(lay, (uint32_t)p) >= b;
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
        const bool at = k >= hi || layout_bin(lay, (uint32_t)k) >= b;
        if (!at) {
            k++;
            continue;
        }
        if (k > lo && layout_bin(lay, (uint32_t)(k - 1)) >= b) {
            k--;
            continue;
        }
        return (uint32_t)k;
    }
    return warp_boundary(lay, b, lo, hi);
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
    __shared__ Shared s;
    const int C_ = C;
    const int row = blockIdx.x / C_;
    int rank = 0;
    if constexpr (C > 1)
        rank = (int)cg::this_cluster().block_rank();
    int L = N;
    if (lengths) {
        L = lengths[row];
        L = L < 0 ? 0 : (L > N ? N : L);
    }
    const int kk = k < L ? k : L;
    int *orow = out + (long long)row * out_stride;
    if (rank == 0)
        for (int i = kk + threadIdx.x; i < k; i += THREADS)
            orow[i] = -1;
    if (kk == 0)
        return;
    const float *xr = scores + (long long)row * row_stride;

    PROF_RESET();
    PROF(0);
    const bool use_gvr = method != GVR_TOPK_RADIX && kk < L;
    /* Phase 1 loads first (prediction indices, then the scores there), the row's loads in between,
     * so their latencies overlap. */
    int pidx[PRED_PER_THREAD];
    const int kp = prev ? (Kp < MAX_PRED ? Kp : MAX_PRED) : 0;
    const int *pr = prev ? prev + (long long)row * prev_stride : nullptr;
    if (use_gvr) {
#pragma unroll
        for (int i = 0; i < PRED_PER_THREAD; i++) {
            const int j = threadIdx.x + i * THREADS;
            pidx[i] = j < kp ? __ldg(pr + j) : -1;
        }
    }
    RowTile<C, VEC> tile;
    tile.load_raw(xr, L, rank);
    float pval[PRED_PER_THREAD];
    if (use_gvr) {
#pragma unroll
        for (int i = 0; i < PRED_PER_THREAD; i++)
            pval[i] = (pidx[i] >= 0 && pidx[i] < L) ? __ldg(xr + pidx[i]) : __int_as_float(0x7FC00000);
    }
    tile.convert();
    for (int i = threadIdx.x; i < RADIX_BINS; i += THREADS)
        s.hist[0][i] = 0;
    __syncthreads();
    PROF(1);

    Interval iv{1u, KEY_END, L, 0, 0};
    int par = 0;
    uint32_t vsel = 0, veq = 0;
    int imax = -1; /* select: key > vsel, or key == veq and index <= imax */

    if (kk == L) {
        vsel = 0;
    } else {
        if (!use_gvr) {
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
        } else {
            /* Phase 1 (guess): mean and spread of the scores at the predicted indices, or, without
             * a usable prediction, of a strided sample of the row. Two passes: E[v^2] - mean^2
             * cancels in fp32 when the values sit far from zero. */
            float st[4] = {0.f, 0.f, 0.f, 0.f}; /* n, sum */
#pragma unroll
            for (int i = 0; i < PRED_PER_THREAD; i++)
                if (isfinite(pval[i])) {
                    st[0] += 1.f;
                    st[1] += pval[i];
                }
            block_sum4(st, s);
            const bool predicted = st[0] >= 16.f;
            constexpr int SPT = SAMPLE / THREADS;
            float sv[SPT];
            if (!predicted) {
                const int m = L < SAMPLE ? L : SAMPLE;
                st[0] = st[1] = 0.f;
#pragma unroll
                for (int i = 0; i < SPT; i++) {
                    const int j = threadIdx.x + i * THREADS;
                    sv[i] = j < m ? __ldg(xr + (int)(((long long)j * L) / m)) : __int_as_float(0x7FC00000);
                    if (isfinite(sv[i])) {
                        st[0] += 1.f;
                        st[1] += sv[i];
                    }
                }
                block_sum4(st, s);
            }
            const float n = fmaxf(st[0], 1.f), mean = st[1] / n;
            float q[4] = {0.f, 0.f, 0.f, 0.f};
            if (predicted) {
#pragma unroll
                for (int i = 0; i < PRED_PER_THREAD; i++)
                    if (isfinite(pval[i]))
                        q[0] += (pval[i] - mean) * (pval[i] - mean);
            } else {
#pragma unroll
                for (int i = 0; i < SPT; i++)
                    if (isfinite(sv[i]))
                        q[0] += (sv[i] - mean) * (sv[i] - mean);
            }
            block_sum4(q, s);
            const float sd = sqrtf(q[0] / n);
            float center, spread;
            if (predicted) {
                /* the previous Top-K straddles the current k-th value */
                center = mean;
                spread = 2.5f * sd;
            } else {
                /* normal quantile of the target fraction (kk plus a margin) */
                const float frac = fminf(fmaxf(1.15f * (float)kk / (float)L, 1e-7f), 0.999999f);
                const float z = 1.41421356f * erfcinvf(2.f * frac);
                center = mean + sd * z;
                spread = 1.5f * sd;
            }
            PROF(1);
            iv = gvr_search<C, VEC>(s, par, iv, kk, true, true, center, spread,
                                    [&](int j, int l) { return tile.key[4 * j + l]; });
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

/* Sort each row's kk indices by (value descending, index ascending). */
template <int ITEMS>
__global__ void __launch_bounds__(THREADS, 1)
    gvr_topk_sort_kernel(const float *__restrict__ scores, long long row_stride, int N, const int *__restrict__ lengths,
                         int k, int *__restrict__ out, long long out_stride)
{
    using Sort = cub::BlockRadixSort<unsigned long long, THREADS, ITEMS>;
    __shared__ typename Sort::TempStorage tmp;
    const int row = blockIdx.x;
    int L = N;
    if (lengths) {
        L = lengths[row];
        L = L < 0 ? 0 : (L > N ? N : L);
    }
    const int kk = k < L ? k : L;
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
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(C * p->B), 1, 1);
    cfg.blockDim = dim3(THREADS, 1, 1);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
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
    if (p->N > 16 * RowTile<16, 16>::P) {
        snprintf(g_last_error, sizeof g_last_error, "N = %d exceeds the largest supported row (%d)", p->N,
                 16 * RowTile<16, 16>::P);
        return 1;
    }
    if (p->sorted && p->k > THREADS * 8) {
        snprintf(g_last_error, sizeof g_last_error, "sorted output supports k <= %d", THREADS * 8);
        return 1;
    }
    /* Geometry: the smallest per-thread share (float4s held in registers) whose cluster size (at
     * most 16) holds the row while the grid stays within about two CTAs per SM; otherwise the
     * fewest CTAs per row. */
    int C = 0, vec = 0;
    for (int v = 2; v <= 16 && !C; v *= 2) {
        int c = 1;
        while (c * THREADS * 4 * v < p->N)
            c *= 2;
        if (c <= 16 && (long long)p->B * c <= 2LL * sm_count()) {
            C = c;
            vec = v;
        }
    }
    if (!C) {
        vec = 16;
        C = 1;
        while (C * THREADS * 4 * vec < p->N)
            C *= 2;
    }
    /* AUTO: the radix path. On an H100 (benchmarks/RESULTS.md, 2026-11-22) the GVR kernel matched it
     * only in single-row cells of 16K-32K and lost elsewhere (its guess plus two rounds cost as much as
     * the 2-3 radix digit rounds): a prediction never makes a call slower than without one. */
    const int method = p->method == GVR_TOPK_GVR ? GVR_TOPK_GVR : GVR_TOPK_RADIX;
    cudaError_t e;
    switch (C) {
    case 1: e = launch_vec<1>(p, vec, method, stream); break;
    case 2: e = launch_vec<2>(p, vec, method, stream); break;
    case 4: e = launch_vec<4>(p, vec, method, stream); break;
    case 8: e = launch_vec<8>(p, vec, method, stream); break;
    default: e = launch_vec<16>(p, vec, method, stream); break;
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
