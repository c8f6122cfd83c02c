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
 *  - GVR (paper 000, sections 4-5): the first round's 64 bin edges come from statistics of the scores
 *    at the previous step's Top-K (mean +- 2.5 std: "guess"), later edges from secant interpolation
 *    between the bracketing counts ("verify"), concentrated where the linear model puts the kk-th
 *    count, plus evenly spaced key-space edges so every round shrinks [a, z) at least 17-fold: exact
 *    termination is guaranteed, and no non-exact fallback exists. Without a usable prediction the
 *    statistics come from a strided sample of the row and the first edges sit around the sample's
 *    normal quantile for kk/len.
 *  - Radix (the production design): bins are 11/11/10-bit digits of the key.
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
constexpr int G = 64;                 /* GVR bin edges per round */
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

constexpr int MAX_C = 16;

struct Shared {
    uint32_t edges[G];             /* sorted bin edges of a GVR round */
    uint32_t edge_tmp[G];
    int hist[2][RADIX_BINS];       /* per-round histograms, double-buffered across cluster rounds */
    int rsum[RADIX_BINS];          /* radix: this CTA's slice of the cluster-summed histogram */
    int gath[MAX_C][G + 1];        /* GVR: every CTA's histogram, gathered */
    int pub[2][4];                 /* per-CTA values published to the cluster */
    float red[WARPS][4];           /* block reduction scratch */
    int state_i[4];
    uint32_t iv_u[2];              /* GVR: the interval after a round, from warp 0 */
    int iv_i[3];
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

/* Edge g of a GVR round for [a, z): g < GC concentrated where the secant puts the kk-th count
 * (around center +- spread in the first round), g >= GC evenly spaced keys; strictly inside (a, z). */
__device__ __forceinline__ uint32_t edge_value(const Interval &iv, int kk, bool first, float center, float spread,
                                               int g)
{
    constexpr int GC = 48, GK = G - GC;
    const uint64_t width = (uint64_t)iv.z - (uint64_t)iv.a; /* >= 2 here */
    uint32_t e;
    if (width - 1 <= (uint64_t)G) {
        const uint64_t v = (uint64_t)iv.a + 1 + (uint64_t)g; /* every interior key */
        e = (uint32_t)(v < iv.z ? v : iv.z - 1);
    } else if (g >= GC) {
        e = (uint32_t)((uint64_t)iv.a + width * (uint64_t)(g - GC + 1) / (uint64_t)(GK + 1));
    } else {
        float lo_v, hi_v;
        bool ok;
        if (first) {
            lo_v = center - spread;
            hi_v = center + spread;
            ok = isfinite(lo_v) && isfinite(hi_v) && hi_v > lo_v;
        } else {
            ok = iv.a >= 2u && iv.a <= KEY_POS_INF && iv.z <= KEY_POS_INF && iv.z > iv.a;
            const float va = ok ? key_value(iv.a) : 0.f, vz = ok ? key_value(iv.z) : 0.f;
            ok = ok && isfinite(va) && isfinite(vz) && vz > va;
            /* secant: where a linear count(value) between the bracket ends reaches kk */
            const float f = (float)(iv.ca - kk) / (float)max(iv.ca - iv.cz, 1);
            const float c_v = va + f * (vz - va), half = 0.25f * (vz - va);
            lo_v = fmaxf(va, c_v - half);
            hi_v = fminf(vz, c_v + half);
            ok = ok && hi_v > lo_v;
        }
        if (ok)
            e = stored_key(lo_v + (hi_v - lo_v) * ((float)g + 0.5f) / (float)GC);
        else
            e = (uint32_t)((uint64_t)iv.a + width * (uint64_t)(g + 1) / (uint64_t)(GC + 1));
    }
    if (e <= iv.a)
        e = iv.a + 1;
    if (e >= iv.z)
        e = iv.z - 1;
    return e;
}

/* Warp-wide: the G edges of a round, sorted ascending by a bitonic network in registers; lane holds
 * edges lane (e0) and lane + 32 (e1). */
__device__ __forceinline__ void warp_edges(const Interval &iv, int kk, bool first, float center, float spread,
                                           uint32_t &e0, uint32_t &e1)
{
    const int lane = threadIdx.x & 31;
    e0 = edge_value(iv, kk, first, center, spread, lane);
    e1 = edge_value(iv, kk, first, center, spread, lane + 32);
#pragma unroll
    for (int k = 2; k <= 64; k <<= 1)
#pragma unroll
        for (int d = k >> 1; d > 0; d >>= 1) {
            if (d == 32) {
                const uint32_t lo = min(e0, e1), hi = max(e0, e1);
                e0 = lo;
                e1 = hi;
            } else {
                const uint32_t p0 = __shfl_xor_sync(0xFFFFFFFFu, e0, d), p1 = __shfl_xor_sync(0xFFFFFFFFu, e1, d);
                const bool lower = (lane & d) == 0;
                const bool asc0 = (lane & k) == 0, asc1 = ((lane + 32) & k) == 0;
                e0 = (lower == asc0) ? min(e0, p0) : max(e0, p0);
                e1 = (lower == asc1) ? min(e1, p1) : max(e1, p1);
            }
        }
}

/* GVR rounds on [a, z) until it is one key or a boundary count equals kk. Bins are the G + 1 gaps of
 * the sorted edges; bin 0 (below the first edge, most elements) is not counted: its total follows
 * from c(a). Elements in bins >= 1 (few) are binned warp-cooperatively: one ballot over the edges
 * held in registers, no per-thread search. Warp 0 sums the cluster's histograms, picks the bin,
 * and prepares the next round's edges; one block barrier publishes them. */
template <int C, int VEC, class KeyF>
__device__ Interval gvr_search(Shared &s, int &par, Interval iv, int kk, bool first, float center, float spread,
                               KeyF keyf)
{
    const int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {
        uint32_t e0, e1;
        warp_edges(iv, kk, first, center, spread, e0, e1);
        s.edges[lane] = e0;
        s.edges[lane + 32] = e1;
    }
    __syncthreads();
    PROF(2);
    while (!iv.done && iv.z - iv.a > 1) {
        const uint32_t e0 = s.edges[lane], e1 = s.edges[lane + 32];
        const uint32_t lo = s.edges[0] > iv.a ? s.edges[0] : iv.a;
        int *h = s.hist[par];
        int c0 = 0, c1 = 0, c2 = 0;
#pragma unroll
        for (int j = 0; j < VEC; j++)
#pragma unroll
            for (int l = 0; l < 4; l++) {
                const uint32_t k = keyf(j, l);
                unsigned m = __ballot_sync(0xFFFFFFFFu, k >= lo && k < iv.z);
                while (m) {
                    const int src = __ffs(m) - 1;
                    m &= m - 1;
                    const uint32_t kb = __shfl_sync(0xFFFFFFFFu, k, src);
                    const int b = __popc(__ballot_sync(0xFFFFFFFFu, e0 <= kb)) +
                                  __popc(__ballot_sync(0xFFFFFFFFu, e1 <= kb)); /* in [1, G] */
                    c0 += b == lane;
                    c1 += b == lane + 32;
                    c2 += b == G && lane == 0;
                }
            }
        if (c0)
            atomicAdd(&h[lane], c0);
        if (c1)
            atomicAdd(&h[lane + 32], c1);
        if (c2)
            atomicAdd(&h[G], c2);
        PROF(20);
        cluster_barrier<C>();
        PROF(21);
        {
            int *hn = s.hist[par ^ 1]; /* last read by the cluster before the barrier above */
            for (int i = threadIdx.x; i < RADIX_BINS; i += THREADS)
                hn[i] = 0;
        }
        if constexpr (C > 1) {
            for (int i = threadIdx.x; i < C * (G + 1); i += THREADS)
                s.gath[i / (G + 1)][i % (G + 1)] = remote<C>(h, i / (G + 1))[i % (G + 1)];
            __syncthreads();
        }
        if (threadIdx.x < 32) {
            /* lane owns descending bins G - 3*lane - i, i < 3 (bins >= 1 only) */
            int cnt[3], sum = 0;
#pragma unroll
            for (int i = 0; i < 3; i++) {
                const int b = G - (3 * lane + i);
                int t = 0;
                if (b >= 1) {
                    if constexpr (C > 1) {
                        for (int r = 0; r < C; r++)
                            t += s.gath[r][b];
                    } else {
                        t = h[b];
                    }
                }
                cnt[i] = t;
                sum += t;
            }
            int scan = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xFFFFFFFFu, scan, o);
                if (lane >= o)
                    scan += y;
            }
            const int total = __shfl_sync(0xFFFFFFFFu, scan, 31);
            int incl = scan - sum, wb = -1, wS = 0, wS1 = 0;
#pragma unroll
            for (int i = 0; i < 3; i++) {
                incl += cnt[i];
                const int b = G - (3 * lane + i);
                const int Sb = iv.cz + incl, Sb1 = Sb - cnt[i];
                if (b >= 1 && Sb >= kk && Sb1 < kk) {
                    wb = b;
                    wS = Sb;
                    wS1 = Sb1;
                }
            }
            const unsigned win = __ballot_sync(0xFFFFFFFFu, wb >= 0);
            int chosen, Sb, Sb1;
            if (iv.cz + total < kk || !win) {
                chosen = 0;
                Sb = iv.ca;
                Sb1 = iv.cz + total;
            } else {
                const int src = __ffs(win) - 1;
                chosen = __shfl_sync(0xFFFFFFFFu, wb, src);
                Sb = __shfl_sync(0xFFFFFFFFu, wS, src);
                Sb1 = __shfl_sync(0xFFFFFFFFu, wS1, src);
            }
            /* bin b covers [edge[b-1], edge[b]) */
            const int ia = chosen - 1, iz = chosen;
            const uint32_t xa0 = __shfl_sync(0xFFFFFFFFu, e0, ia & 31), xa1 = __shfl_sync(0xFFFFFFFFu, e1, ia & 31);
            const uint32_t xz0 = __shfl_sync(0xFFFFFFFFu, e0, iz & 31), xz1 = __shfl_sync(0xFFFFFFFFu, e1, iz & 31);
            Interval nv;
            nv.a = chosen == 0 ? iv.a : (ia >= 32 ? xa1 : xa0);
            nv.z = chosen == G ? iv.z : (iz >= 32 ? xz1 : xz0);
            nv.ca = Sb;
            nv.cz = Sb1;
            nv.done = Sb == kk;
            if (!nv.done && nv.z - nv.a > 1) {
                uint32_t n0, n1;
                warp_edges(nv, kk, false, 0.f, 0.f, n0, n1);
                s.edges[lane] = n0;
                s.edges[lane + 32] = n1;
            }
            if (lane == 0) {
                s.iv_u[0] = nv.a;
                s.iv_u[1] = nv.z;
                s.iv_i[0] = nv.ca;
                s.iv_i[1] = nv.cz;
                s.iv_i[2] = nv.done;
            }
        }
        PROF(23);
        __syncthreads();
        PROF(24);
        iv.a = s.iv_u[0];
        iv.z = s.iv_u[1];
        iv.ca = s.iv_i[0];
        iv.cz = s.iv_i[1];
        iv.done = s.iv_i[2];
        par ^= 1;
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
            /* Phase 1 (guess): mean and spread of the scores at the predicted indices */
            float st[4] = {0.f, 0.f, 0.f, 0.f}; /* n, sum, sum of squares, - */
#pragma unroll
            for (int i = 0; i < PRED_PER_THREAD; i++)
                if (isfinite(pval[i])) {
                    st[0] += 1.f;
                    st[1] += pval[i];
                    st[2] += pval[i] * pval[i];
                }
            block_sum4(st, s);
            const bool predicted = st[0] >= 16.f;
            float center, spread;
            if (!predicted) {
                /* no usable prediction: a strided sample of the row */
                const int m = L < SAMPLE ? L : SAMPLE;
                st[0] = st[1] = st[2] = st[3] = 0.f;
                for (int j = threadIdx.x; j < m; j += THREADS) {
                    const float v = __ldg(xr + (int)(((long long)j * L) / m));
                    if (isfinite(v)) {
                        st[0] += 1.f;
                        st[1] += v;
                        st[2] += v * v;
                    }
                }
                block_sum4(st, s);
            }
            const float n = fmaxf(st[0], 1.f), mean = st[1] / n;
            const float sd = sqrtf(fmaxf(st[2] / n - mean * mean, 0.f));
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
            iv = gvr_search<C, VEC>(s, par, iv, kk, true, center, spread,
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
                ix = gvr_search<C, VEC>(s, par, ix, need, false, 0.f, 0.f, [&](int j, int l) {
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
    int before = 0;
    for (int r = 0; r < rank; r++)
        before += remote<C>(s.pub[par], r)[0];
    offset += before;
#pragma unroll
    for (int j = 0; j < VEC; j++)
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const uint32_t key = tile.key[4 * j + l];
            if (key > vsel || (key == veq && tile.index(j, l) <= imax))
                orow[offset++] = tile.index(j, l);
        }
    /* no CTA may leave while another still reads its shared memory */
    cluster_barrier<C>();
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

__attribute__((visibility("default"))) int gvr_cuda_set_device(int device)
{
    int cur = -1;
    cudaError_t e = cudaGetDevice(&cur);
    if (e == cudaSuccess && cur == device)
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
    const int method = p->method == GVR_TOPK_RADIX ? GVR_TOPK_RADIX : GVR_TOPK_GVR;
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
