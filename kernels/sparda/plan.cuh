/* plan.cuh: the pieces of SparDA's prefetch shared by the stream-ordered path (prefetch.cu) and the
 * persistent prefetcher (prefetcher.cu): the workspace layout, the slot policy run by one CTA
 * (gvr_kernels.h, "SparDA host KV cache": the same result as csrc/cpu/sparda_cpu.c) and the gather of a
 * move list from mapped host memory. */
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cstdint>

#include "gvr_kernels.h"

namespace gvr::sparda {

constexpr int PLAN_THREADS = 1024;
constexpr int GATHER_THREADS = 256;   /* the most threads of a gather CTA */
constexpr int DEFAULT_CTA_WARPS = 8;  /* the gather CTAs' default shape: 8 warps, 16 loads of 16 bytes in */
constexpr int DEFAULT_LANE_LOADS = 16; /* flight per lane (8 KiB per warp) */

__host__ __device__ inline size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

__host__ __device__ inline int64_t move_cap(const gvr_prefetch_params *p)
{
    int64_t cap = (int64_t)p->B * p->Hsel * p->n, all = (int64_t)p->B * p->max_pages;
    if (all < cap)
        cap = all;
    if ((int64_t)p->S < cap)
        cap = p->S;
    return cap;
}

struct Workspace {
    int32_t *claim, *order, *moves, *n_moves;
    uint32_t *need; /* one bit per block (b, j), row-major */
};

__host__ __device__ inline Workspace carve(const gvr_prefetch_params *p, void *ws)
{
    char *c = (char *)ws;
    Workspace w;
    w.claim = (int32_t *)c;
    c += align256((size_t)p->S * 4);
    w.order = (int32_t *)c;
    c += align256((size_t)p->S * 4);
    w.moves = (int32_t *)c;
    c += align256((size_t)move_cap(p) * 8);
    w.n_moves = (int32_t *)c;
    c += 256;
    w.need = (uint32_t *)c;
    return w;
}

inline size_t workspace_bytes(const gvr_prefetch_params *p)
{
    const size_t words = ((size_t)p->B * (size_t)p->max_pages + 31) / 32;
    return 2 * align256((size_t)p->S * 4) + align256((size_t)move_cap(p) * 8) + 256 + align256(words * 4);
}

__device__ __forceinline__ int32_t page_of(const gvr_prefetch_params &p, long long b, int32_t j)
{
    const long long pg = p.block_table ? (long long)p.block_table[b * p.bt_stride_b + j] : (long long)j;
    return pg >= 0 && pg < p.num_pages ? (int32_t)pg : -1;
}

/* row b and block j of the row-major block number lin = b * M + j: 32-bit division when both fit (a
 * 64-bit division is a ~70-instruction call; the plan's loops did four per thread) */
__device__ __forceinline__ void split_lin(long long lin, long long M, long long &b, long long &j)
{
    if (((unsigned long long)lin | (unsigned long long)M) <= 0xFFFFFFFFull) {
        const uint32_t l = (uint32_t)lin, m = (uint32_t)M, q = l / m;
        b = q;
        j = l - q * m;
    } else {
        b = lin / M;
        j = lin - b * M;
    }
}

__device__ __forceinline__ int32_t *map_at(const gvr_prefetch_params &p, long long lin)
{
    long long b, j;
    split_lin(lin, p.max_pages, b, j);
    return p.slot_map + b * p.map_stride_b + j;
}

constexpr int32_t KEPT = -2; /* claim[s] of a slot its needed owner keeps */

/* The policy with the needed blocks as a bitmap: the passes over blocks run over 32-bit words. After
 * step 4 claim[s] is INT_MAX (no owner), KEPT, or the owner's row-major number (an owner not needed). */
/* run by one CTA of PLAN_THREADS threads; returns the moves' count (in every thread) */
__device__ __forceinline__ int plan_policy(const gvr_prefetch_params &p, const Workspace &w)
{
    using Scan = cub::BlockScan<int, PLAN_THREADS>;
    using Reduce = cub::BlockReduce<int, PLAN_THREADS>;
    __shared__ union {
        typename Scan::TempStorage scan;
        typename Reduce::TempStorage reduce;
    } tmp;
    const int t = threadIdx.x;
    const long long M = p.max_pages, total = (long long)p.B * M, S = p.S, words = (total + 31) / 32;
    const long long entries = (long long)p.B * p.Hsel * p.n;
    /* 1. no owner, no slot, nothing needed */
    for (long long s = t; s < S; s += PLAN_THREADS)
        w.claim[s] = INT_MAX;
    for (long long i = t; i < words; i += PLAN_THREADS)
        w.need[i] = 0u;
    for (long long lin = t; lin < total; lin += PLAN_THREADS)
        *map_at(p, lin) = -1;
    __syncthreads();
    /* 2. needed blocks */
    const long long per_row = (long long)p.Hsel * p.n;
    for (long long e = t; e < entries; e += PLAN_THREADS) {
        long long b, r, h, i;
        split_lin(e, per_row, b, r);
        split_lin(r, p.n, h, i);
        const int32_t j = p.indices[b * p.ix_stride_b + h * p.ix_stride_h + i];
        if (j >= 0 && j < M && page_of(p, b, j) >= 0) {
            const long long lin = b * M + j;
            atomicOr(&w.need[lin >> 5], 1u << (lin & 31));
        }
    }
    /* 3. owners: the first claim in row-major order */
    if (p.resident)
        for (long long lin = t; lin < total; lin += PLAN_THREADS) {
            long long b, jj;
            split_lin(lin, M, b, jj);
            const int32_t j = (int32_t)jj, r = p.resident[b * p.res_stride_b + j];
            if (r >= 0 && r < S && page_of(p, b, j) >= 0)
                atomicMin(&w.claim[r], (int32_t)lin);
        }
    __syncthreads();
    /* 4. kept: a needed owner keeps its slot (its bit cleared: the bits left are the blocks to move) */
    int kept = 0;
    for (long long s = t; s < S; s += PLAN_THREADS) {
        const int32_t o = w.claim[s];
        if (o != INT_MAX && (w.need[o >> 5] >> (o & 31)) & 1u) {
            *map_at(p, o) = (int32_t)s;
            atomicAnd(&w.need[o >> 5], ~(1u << (o & 31)));
            w.claim[s] = KEPT;
            kept++;
        }
    }
    kept = Reduce(tmp.reduce).Sum(kept);
    __syncthreads();
    /* 5. free slots in order: unowned ascending, then owned by a block not needed ascending */
    int nfree = 0;
    for (int pass = 0; pass < 2; pass++)
        for (long long s0 = 0; s0 < S; s0 += PLAN_THREADS) {
            const long long s = s0 + t;
            int flag = 0;
            if (s < S) {
                const int32_t o = w.claim[s];
                flag = pass == 0 ? o == INT_MAX : (o != INT_MAX && o != KEPT);
            }
            int rank, sum;
            Scan(tmp.scan).ExclusiveSum(flag, rank, sum);
            if (flag)
                w.order[nfree + rank] = (int32_t)s;
            nfree += sum;
            __syncthreads();
        }
    /* 6. the needed blocks not kept take them in row-major order: a scan of the words' bit counts */
    int moved = 0;
    for (long long i0 = 0; i0 < words; i0 += PLAN_THREADS) {
        const long long i = i0 + t;
        uint32_t bits = i < words ? w.need[i] : 0u;
        int rank, sum;
        Scan(tmp.scan).ExclusiveSum(__popc(bits), rank, sum);
        for (int r = moved + rank; bits; bits &= bits - 1, r++) {
            const long long lin = i * 32 + __ffs(bits) - 1;
            const int32_t s = w.order[r]; /* r < nfree: S covers the needed blocks (the intake) */
            long long b, j;
            split_lin(lin, M, b, j);
            p.slot_map[b * p.map_stride_b + j] = s;
            w.moves[2 * r] = page_of(p, b, (int32_t)j);
            w.moves[2 * r + 1] = s;
        }
        moved += sum;
        __syncthreads();
    }
    /* 7. retained: owners not needed keep the slots nobody took */
    for (long long f = moved + t; f < nfree; f += PLAN_THREADS) {
        const int32_t o = w.claim[w.order[f]];
        if (o != INT_MAX && o != KEPT)
            *map_at(p, o) = w.order[f];
    }
    if (t == 0) {
        *w.n_moves = moved;
        if (p.counts) {
            p.counts[0] = moved;
            p.counts[1] = (long long)moved + kept;
        }
    }
    return moved;
}

__device__ __forceinline__ uint4 load_nc(const uint4 *a)
{
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
    return v;
}

/* one gather: moves (host page, staging page) pairs, K then V pages cut into pieces of 32 * PER_LANE
 * 16-byte chunks; a warp moves one piece at a time, PER_LANE loads in flight per lane before the stores */
struct GatherJob {
    const char *host_k, *host_v;
    long long hs_k, hs_v;
    char *dst_k, *dst_v;
    long long ds_k, ds_v;
    long long page_bytes;
    const int32_t *moves;
};

__host__ __device__ inline GatherJob job_of(const gvr_prefetch_params *p, const int32_t *moves)
{
    return GatherJob{(const char *)p->host_k, (const char *)p->host_v, p->host_stride_k, p->host_stride_v,
                     (char *)p->dst_k, (char *)p->dst_v, p->dst_stride_k, p->dst_stride_v, p->page_bytes, moves};
}

/* the pieces u = first, first + stride, ... of a job of n moves */
template <int PER_LANE>
__device__ __forceinline__ void gather_pieces(const GatherJob &j, long long n, long long first, long long stride)
{
    constexpr int PIECE_CHUNKS = PER_LANE * 32; /* 16-byte chunks of a warp's piece */
    const long long chunks = j.page_bytes / 16;
    const long long pieces_per_page = (chunks + PIECE_CHUNKS - 1) / PIECE_CHUNKS;
    const long long pieces = 2LL * n * pieces_per_page;
    const int lane = threadIdx.x & 31;
    for (long long u = first; u < pieces; u += stride) {
        const long long m = u / (2 * pieces_per_page), r = u % (2 * pieces_per_page);
        const int kv = (int)(r / pieces_per_page);
        const long long piece = r % pieces_per_page;
        const int32_t src = j.moves[2 * m], dst = j.moves[2 * m + 1];
        const uint4 *from = (const uint4 *)((kv ? j.host_v : j.host_k) + (long long)src * (kv ? j.hs_v : j.hs_k));
        uint4 *to = (uint4 *)((kv ? j.dst_v : j.dst_k) + (long long)dst * (kv ? j.ds_v : j.ds_k));
        const long long c0 = piece * PIECE_CHUNKS;
        uint4 v[PER_LANE];
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const long long c = c0 + i * 32 + lane;
            if (c < chunks)
                v[i] = load_nc(from + c);
        }
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const long long c = c0 + i * 32 + lane;
            if (c < chunks)
                to[c] = v[i];
        }
    }
}

/* the gather of a job by every warp of the grid (blockDim.x a multiple of 32) */
template <int PER_LANE> __device__ __forceinline__ void gather_grid(const GatherJob &j, long long n)
{
    const int warps = blockDim.x >> 5;
    gather_pieces<PER_LANE>(j, n, (long long)blockIdx.x * warps + (threadIdx.x >> 5), (long long)gridDim.x * warps);
}

} // namespace gvr::sparda
