/* radix.cuh: the radix Top-K kernel, gvr_topk_radix_kernel<T, C, VEC> (T the score type): one cluster of C CTAs per row
 * (C in {1, 2, 4, 8, 16}), the row held in registers as stored keys (RowTile<VEC>, rank r holding
 * positions [r*P, (r+1)*P)) and read from memory once.
 *
 * Rounds on an interval [a, z) of keys known to hold the kk-th largest (c(a) >= kk > c(z), c(t) =
 * #{key >= t}): a round histograms the elements inside [a, z) into bins in shared memory, sums the
 * histograms over the cluster through distributed shared memory, and keeps the bin that holds the
 * kk-th key (pick_narrow). The bins are 11/11/10-bit digits of the key, summed by a reduce-scatter
 * over the cluster. Ties at the k-th key: the rounds search the index bound among the elements equal
 * to it (the lowest indices win), on pseudo-keys len - idx in evenly spaced key bins (tie_search).
 * Output: each CTA's selected count -> block scan + cluster prefix -> ordered, deterministic writes.
 * Included by radix_[abcd].cu only. */
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <climits>

#include "common/cluster.cuh"
#include "common/device.cuh"
#include "common/launch.cuh"
#include "topk/common.cuh"

namespace gvr::topk {

namespace cg = cooperative_groups;

constexpr int RADIX_BINS = 2048; /* widest digit */
constexpr int TIE_BINS = THREADS; /* bins per tie-search round: one per thread in the scan */

struct RadixShared {
    int hist[2][RADIX_BINS]; /* per-round histograms, double-buffered across cluster rounds */
    int rsum[RADIX_BINS];    /* this CTA's slice of the cluster-summed histogram */
    int pub[2][4];           /* per-CTA values published to the cluster */
    int state_i[4];
    typename cub::BlockScan<int, THREADS>::TempStorage scan;
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

/* Choose the bin holding the kk-th largest of nb bins and narrow iv to it. Thread t holds the
 * cluster-summed counts of bins nb - 1 - (ITEMS*t + i) (descending; 0 for bin 0 and b < 0), so
 * S_b = c(z) + #{elements in bins >= b} is a block inclusive scan; the chosen bin is the largest
 * b >= 1 with S_b >= kk, or bin 0 when bins >= 1 hold fewer than kk - c(z). edge(b, lo) gives the
 * first key of bin b (at least lo). s.state_i is rewritten only after the next round's cluster
 * barrier. */
template <int ITEMS, class EdgeF>
__device__ __forceinline__ void pick_narrow(RadixShared &s, Interval &iv, int kk, int nb, int (&cnt)[ITEMS], EdgeF edge)
{
    int incl[ITEMS], total; /* total: elements in bins >= 1 */
    cub::BlockScan<int, THREADS>(s.scan).InclusiveSum(cnt, incl, total);
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int b = nb - 1 - (ITEMS * (int)threadIdx.x + i);
        if (b >= 1) {
            const int Sb = iv.cz + incl[i], Sb1 = Sb - cnt[i];
            if (Sb >= kk && Sb1 < kk) { /* the winner is unique */
                s.state_i[0] = b;
                s.state_i[1] = Sb;
                s.state_i[2] = Sb1;
            }
        }
    }
    if (threadIdx.x == 0)
        s.state_i[3] = total; /* read back after the barrier: one register less across it */
    PROF(23);
    __syncthreads();
    PROF(24);
    total = s.state_i[3];
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
    const uint32_t na = chosen == 0 ? iv.a : edge(chosen, iv.a);
    const uint32_t nz = chosen == nb - 1 ? iv.z : edge(chosen + 1, na);
    iv.a = na;
    iv.z = nz;
    iv.ca = Sb;
    iv.cz = Sb1;
    iv.done = Sb == kk;
}

/* One digit round: histogram the keys keyf(j, l) in [a, z) into nb digit bins given by bin(), sum
 * over the cluster (reduce-scatter: CTA r sums its slice of the bins, then every CTA gathers the
 * slices), and narrow [a, z) to the bin holding the kk-th largest; lo_of(b) is the first key of bin
 * b. s.hist[par] must be zero on entry; the other buffer is zeroed here for the next round. (keyf as
 * a functor: the same loop on tile.key directly compiles to more registers.) */
template <int C, int VEC, class KeyF, class BinF, class LoF>
__device__ void digit_round(RadixShared &s, int &par, Interval &iv, int kk, int nb, KeyF keyf, BinF bin, LoF lo_of)
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
    pick_narrow(s, iv, kk, nb, cnt, [&](int b, uint32_t) { return lo_of(b); });
    par ^= 1;
}

/* the tie search's map: TIE_BINS - 1 evenly spaced key bins over [a, z) (width >= 2) */
__device__ __forceinline__ Layout key_layout(const Interval &iv)
{
    Layout lay;
    lay.a = iv.a;
    lay.key_mode = true;
    lay.v0 = 0.f;
    lay.inv_w = 0.f;
    const uint64_t width = (uint64_t)iv.z - (uint64_t)iv.a;
    lay.kscale = (double)(TIE_BINS - 1) / (double)width;
    return lay;
}

/* Rounds on [a, z) of the pseudo-keys keyf(j, l) until it is one key or a boundary count equals kk:
 * every round shrinks [a, z) ~TIE_BINS-fold, so the search ends. */
template <int C, int VEC, class KeyF>
__device__ Interval tie_search(RadixShared &s, int &par, Interval iv, int kk, KeyF keyf)
{
    Layout lay = key_layout(iv);
    PROF(2);
    while (!iv.done && iv.z - iv.a > 1) {
        int *h = s.hist[par];
#pragma unroll
        for (int j = 0; j < VEC; j++)
#pragma unroll
            for (int l = 0; l < 4; l++) {
                const uint32_t k = keyf(j, l);
                if (k >= iv.a && k < iv.z) {
                    const int b = layout_bin<TIE_BINS>(lay, k);
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
        const int b = TIE_BINS - 1 - (int)threadIdx.x; /* descending */
        int cnt[1] = {0};
        if (b >= 1) {
#pragma unroll
            for (int r = 0; r < C; r++)
                cnt[0] += remote<C>(h, r)[b];
        }
        /* every warp finds the chosen bin's key range (same result everywhere) */
        const uint32_t z = iv.z;
        pick_narrow(s, iv, kk, TIE_BINS, cnt, [&](int eb, uint32_t lo) { return key_boundary<TIE_BINS>(lay, eb, lo, z); });
        par ^= 1;
        if (!iv.done && iv.z - iv.a > 1)
            lay = key_layout(iv);
    }
    return iv;
}

template <typename T, int C, int VEC>
__global__ void __launch_bounds__(THREADS, 1)
    gvr_topk_radix_kernel(const T *__restrict__ scores, long long row_stride, int N, RowGeom rg, int k,
                          int *__restrict__ out, long long out_stride, OutMap om)
{
    pdl_enter();
    __shared__ RadixShared s;
    const int row = blockIdx.x / C;
    int rank = 0;
    if constexpr (C > 1)
        rank = (int)cg::this_cluster().block_rank();
    const int L = row_length(N, rg, row), kk = k < L ? k : L;
    const RowOut ro(out, out_stride, om, row);
    if (rank == 0)
        pad_tail(ro, kk, k);
    if (kk == 0)
        return;
    const T *xr = scores + (long long)row * row_stride + row_start(N, rg, row);

    PROF_RESET();
    PROF(0);
    RowTile<VEC> tile;
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

    if (kk < L) {
        /* radix digits: 11/11/10 bits of the key, from the top */
        int shift = 21, width = 11;
        for (int d = 0; d < 3 && !iv.done && iv.z - iv.a > 1; d++) {
            const uint32_t base = (width + shift >= 32) ? 0u : (iv.a & ~((1u << (shift + width)) - 1u));
            const int nb = 1 << width;
            const int sh = shift;
            const uint32_t mask = (uint32_t)nb - 1u;
            const Interval cur = iv;
            digit_round<C, VEC>(
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
                ix = tie_search<C, VEC>(s, par, ix, need, [&](int j, int l) {
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
                ro.put(offset++, tile.index(j, l));
        }
    if constexpr (C > 1)
        cg::this_cluster().barrier_wait();
    PROF(1);
}

/* ---- launcher --------------------------------------------------------------------------------- */

template <typename T, int C, int VEC>
cudaError_t radix_launch_t(const gvr_topk_params *p, int dev, cudaStream_t stream)
{
    auto fn = gvr_topk_radix_kernel<T, C, VEC>;
    if constexpr (C > 8) {
        static DeviceCache<1> configured; /* function attributes are set per device */
        if (!configured.get(dev, 0)) {
            const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
            if (e != cudaSuccess)
                return e;
            configured.put(dev, 0, 1);
        }
    }
    LaunchConfig lc((unsigned)(C * p->B), THREADS, C, 0, stream);
    return cudaLaunchKernelEx(&lc.cfg, fn, static_cast<const T *>(p->scores), (long long)p->row_stride, p->N,
                              row_geom(p), p->k, p->out, (long long)p->out_stride, first_out_map(p));
}

template <int C, int VEC>
cudaError_t RadixInstance<C, VEC>::launch(const gvr_topk_params *p, int dev, cudaStream_t stream)
{
    return visit_score_type(p->score_dtype,
                            [&](auto st) { return radix_launch_t<typename decltype(st)::type, C, VEC>(p, dev, stream); });
}

#ifdef GVR_PROFILE
template <int C, int VEC>
cudaError_t RadixInstance<C, VEC>::profile_read(long long *host)
{
    return ::profile_read(host);
}
#endif

/* the explicit instances of one cluster size (radix_[abcd].cu): VEC in {2, 4, 8, 16} */
#define GVR_RADIX_INSTANCES(C)                                                                        \
    template struct RadixInstance<C, 2>;                                                              \
    template struct RadixInstance<C, 4>;                                                              \
    template struct RadixInstance<C, 8>;                                                              \
    template struct RadixInstance<C, 16>;

} // namespace gvr::topk
