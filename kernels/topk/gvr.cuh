/* gvr.cuh: the GVR Top-K kernel, gvr_topk_gvr_kernel<T, CLUSTER, VEC, STREAM> (T the score type): one cluster of C CTAs
 * per row (C <= 16), the row either held in registers (STREAM false: RowTile<VEC>, read from memory
 * once) or streamed (STREAM true: each CTA owns a segment of nch chunks of P = 2048 VEC positions
 * and re-reads it per pass, so N is limited only by int32 indices). One template for both; the
 * register-tile instances are built in gvr_tile_[ab][123].cu, the streamed ones in
 * gvr_stream_[ab].cu; each instance holds a float32, a float16 and a bfloat16 kernel.
 *
 * Exchange design: a cluster barrier with release/acquire semantics costs ~0.65 us on an H100, a
 * relaxed one ~0.08 us (benchmarks/RESULTS.md), so the search never uses a release barrier: each
 * round every CTA pushes its small histogram (256 bins; 16-bit counts for register-held rows) into
 * every peer's shared memory with st.async, signalling the peer's mbarrier (complete-tx), and then
 * sums the C copies locally. All CTAs see identical data and make identical choices, so no CTA waits
 * for a decision.
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
 *    exchange; one block reduction). The prediction is used when its mean lies at least halfway
 *    from the sample's mean to the sample's normal-quantile estimate of the k-th value (a useful
 *    previous Top-K sits in the upper tail); otherwise the sample's estimate is the center. The
 *    first round spreads 254 bins evenly in value over center +- spread, one bin below, one above
 *    (the bin above the band is counted in registers: it can hold many elements).
 *  - Streamed rows: the verify pass reads the chunks from a shared-memory ring that asynchronous
 *    copies fill up to STAGE_SLOTS chunks ahead (the first during the guess; a constant slot count,
 *    and chunks inside the row copied and read without per-vector bounds checks: B=64 128K 22.9 ->
 *    20.8 us, benchmarks/RESULTS.md, session 24), later passes with the
 *    next chunk's loads in flight; 32-bit counts; no prediction
 *    (measured: no threshold from it beat the sample's, and where the previous Top-K mostly persists
 *    its statistics put the threshold above the k-th value). The first pass (verify) only compares
 *    each element with tc, the sample's estimate of the 1.15 k-th value, and
 *    collects the (value bits, index) pairs at or above it into per-warp shared-memory segments at
 *    offsets from a warp scan of per-thread bit masks (each warp turns its values into stored keys
 *    after the pass): no histogram and no shared atomics, so it runs at the speed of the loads. When at
 *    least kk lie at or above tc and no warp overflowed, the rounds and the output read the pairs,
 *    not the row (one pass over the row in all). Fewer than kk (the sample overshot): a second pass
 *    (collect_between) appends the elements of a band [tlo, tc) below, then the same from the pairs.
 *    Otherwise (an overflowed segment, or fewer than kk above tlo too) they re-read the row. Each CTA bins its
 *    pairs before the exchange that tells whether they hold the k-th, so that the first round's
 *    counts travel with it. The passes over the pairs use tiles sized to them (PAIR_VEC), and the
 *    collection drops its per-element branch where it collects a dense share (COLLECT_DENSE).
 *  - Register-held rows stay raw floats while the rounds and the output can compare values (value
 *    maps, key-aligned bounds); they become stored keys only when a round needs keys (shift maps,
 *    ties at the boundary). Their rounds on raw floats count in 32-bit words, one add per element
 *    and no branch (bin 0 included, never read), packed into the 16-bit pairs as they are sent.
 *  - Value rounds (at most 4): even value bins over a bracket, or a band 8x wider next to an open
 *    side when the k-th value fell outside the previous band.
 *  - Shift rounds: bins (ck - A) >> s on the composite key, 8 bits per round; they end the search
 *    in at most 8 rounds whatever the data (all-equal rows included).
 *  - Output: per chunk, each thread's elements above Z and candidates (two bit masks) take
 *    consecutive slots from a warp scan of the counts and a scan of the warp totals (deterministic;
 *    no warp collective per element).
 * Included by the gvr_*.cu files only. */
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>
#include <cuda_pipeline_primitives.h>

#include <type_traits>

#include "common/cluster.cuh"
#include "common/device.cuh"
#include "common/launch.cuh"
#include "common/warp.cuh"
#include "topk/common.cuh"

namespace gvr::topk {

namespace cg = cooperative_groups;

constexpr int GVR_BINS = 256;                  /* bins per round */
constexpr int GVR_PACKED_WORDS = GVR_BINS / 2; /* 32-bit words per packed histogram (two 16-bit counts) */
constexpr int CAND_CAP = 256;                  /* candidates ranked by rank 0 */
constexpr int MAX_VALUE_ROUNDS = 4;
/* Phase-1 statistics read PRED_STATS entries of the previous Top-K (evenly strided over the list:
 * an unbiased subset whatever its order) and a strided sample of SAMPLE row elements. Every CTA of a
 * cluster gathers the same ones (identical statistics, no exchange), so they are few (more measured
 * slower, benchmarks/RESULTS.md). */
constexpr int PRED_STATS = 256;
constexpr int PRED_PER_THREAD = (PRED_STATS + THREADS - 1) / THREADS;
/* A/B switches: the sample's size (GVR_SAMPLE: register-held rows'; streamed rows': below), and the
 * streamed threshold tc lowered by GVR_TC_MARGIN standard errors of the sample's quantile estimate,
 * sd sqrt((1 + z^2 / 2) / m) (0: tc at the estimate). Measured, H100
 * (benchmarks/RESULTS.md, sessions 25-26): a margin trades the decode-trace rows' speed (more pairs) for
 * fewer i.i.d. rows below tc; SAMPLE 512 with a margin of 2 put none of 64 such rows there (B=64 64K 33.1
 * -> 13.8 us) but cost trace rows up to 1.4 us (B=8 256K 12.6 -> 13.9); a margin of 1 with the second
 * collection below: trace rows 0.1-0.5 us slower, i.i.d. ones no faster (a B=64 batch still holds a row
 * below tc). */
#ifndef GVR_SAMPLE
#define GVR_SAMPLE 256
#endif
/* streamed rows' sample: 512 (one load per thread). H200 (benchmarks/RESULTS.md, session 29), against 256
 * with the skewness term below: a serving batch of B distinct decode-trace rows at 45% (quick_gpu_bench.py
 * --rows traces) B=64 128K 30.2 -> 20.4 us, 256K 44.1 -> 30.0, B=8 256K 13.2 -> 12.9 -- with 256 about one
 * such row in 64 fell below tc (the estimate's noise) and the batch waited for its second collection; one
 * row tiled over the batch 0.05 us slower at B=64 128K, 0.2-0.5 at 256K; i.i.d. rows within 0.4. */
#ifndef GVR_SAMPLE_STREAM
#define GVR_SAMPLE_STREAM 512
#endif
#ifndef GVR_TC_MARGIN
#define GVR_TC_MARGIN 0.0f
#endif
/* the sample's size: register-held rows (their first band) / streamed rows (tc) */
template <bool STREAM>
constexpr int SAMPLE = STREAM ? GVR_SAMPLE_STREAM : GVR_SAMPLE;
/* streamed rows: tc from the sample's skewness too (first-order Cornish-Fisher, z + (z^2 - 1) g / 6, g the
 * sample's skewness times GVR_SKEW_A, clamped to [0, SKEW_CAP]; 0: the normal quantile alone). Decode-trace
 * rows are right-skewed (g ~ 1.0-1.7): the normal quantile put tc near z 2.1 where the k-th lies near 2.8-3.1,
 * and the pass collected ~3 k pairs for the 1.15 k it aims at (scripts/topk_pairs_replay.py --skew). H200
 * (benchmarks/RESULTS.md, session 28), trace rows at 45%, 0 -> 0.5: B=64 128K 20.43 -> 19.82 us, 256K 27.18
 * -> 25.48, B=8 256K 12.75 -> 12.50; i.i.d. N(0, 1) rows 0.2-0.5 us slower (their skewness is noise around
 * 0: clamped, it raises tc a little; more rows below it). 0.4 gave less at B=64 64K-128K. */
#ifndef GVR_SKEW_A
#define GVR_SKEW_A 0.5f
#endif
constexpr float SKEW_A = GVR_SKEW_A, SKEW_CAP = 2.f;
constexpr float TC_MARGIN = GVR_TC_MARGIN;
/* first-round band half-widths in standard deviations of the predicted scores / of the sample */
constexpr float PRED_SPREAD = 2.5f, SAMPLE_SPREAD = 1.5f;
/* register-held rows: count the first round on the raw floats and convert to keys after it (true),
 * or convert while the phase-1 gathers are in flight (false) */
constexpr bool RAW_FIRST = true;
/* streamed rows, the collected pairs: the tiles of the passes over them hold 4 * PV pairs per lane (128 PV
 * per warp). A warp holds ~1.15 k / (16 C) pairs or a few times that (74 at k = 2048, C = 2), so the
 * row's tile shape (PV = 4) spent most of its work on empty slots. Each CTA's binning of its own pairs
 * (no barrier) takes PV = 1 tiles; the rounds and the output (a barrier per tile) the smallest PV of 1,
 * 2, 4 that covers the CTA's fullest warp in one tile. H100 (benchmarks/RESULTS.md, session 25), with
 * COLLECT_DENSE below, against PV = 4 everywhere: B=64 64K 15.0 -> 13.9 us, 128K 20.8 -> 20.4, 256K
 * 33.1 -> 32.2; B=8 256K 14.2 -> 12.6 (PV = 1 or 2 everywhere: within 0.15 us of it, either 0.3-0.5
 * slower in one cell). PAIR_VEC (A/B builds): one PV for all, 0 the choice above. */
#ifndef GVR_PAIR_VEC
#define GVR_PAIR_VEC 0
#endif
constexpr int PAIR_VEC = GVR_PAIR_VEC;
/* streamed rows, the verify pass's collection: a loop without branches over each thread's elements
 * where the pass collects more than ~1.15 / COLLECT_DENSE of the row (kk * COLLECT_DENSE > L), a branch
 * per element that some lane of the warp collects elsewhere (sparser collections skip most elements).
 * H100 (session 25), k = 2048, against a branch everywhere: B=64 64K 14.2 -> 13.9 us, 128K 21.2 ->
 * 20.7; against no branch everywhere: B=8 256K 13.1 -> 12.6. Also measured and not kept (session 25,
 * scripts/patches/topk_collect_variants.diff): the warp scan from ballots of the counts' bits. */
#ifndef GVR_COLLECT_DENSE
#define GVR_COLLECT_DENSE 80
#endif
constexpr int COLLECT_DENSE = GVR_COLLECT_DENSE;
/* streamed rows, fewer than kk at or above tc (the sample's estimate overshot the k-th value: 19-31% of
 * i.i.d. N(0, 1) rows at k = 2048, scripts/topk_pairs_replay.py; a batch waits for its slowest row): a
 * second collection pass (collect_between) appends the elements of [tlo, tc) to the warps' segments, tlo
 * placed by the sample's normal model so that RECOLLECT * kk lie at or above it, from the exact count
 * above tc, and the search goes on from the pairs as after a first pass that held the kk-th. Without it
 * (RECOLLECT 0, A/B builds) the search went on below tc from the row: rounds over a band of 3 sd under
 * tc with most of the row in it. H100 (session 26), k = 2048, i.i.d. rows: B=64 64K 33.1 -> 21.1 us,
 * 128K 57.9 -> 30.7, 256K 102.8 -> 47.5, B=8 256K 30.6 -> 18.2; decode-trace rows (none below tc) B=64
 * 64K, 128K 0.15-0.2 us slower (code generation), others within 0.05. Two chunks in flight (an array of
 * tiles shifted by register moves, which wait for the loads): i.i.d. rows 0.1-1.0 us slower. */
#ifndef GVR_RECOLLECT
#define GVR_RECOLLECT 1.5f
#endif
constexpr float RECOLLECT = GVR_RECOLLECT;

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

/* A tile of collected (key, index) pairs (streamed kernel after its first pass): the same shape as a
 * RowTile; each warp reads its own segment (n pairs from `first` on), key 0 past the end */
template <int VEC>
struct PairTile {
    static constexpr int NE = 4 * VEC;         /* pairs per lane */
    static constexpr bool ARITH_INDEX = false; /* index(j, l) reads idx[] */
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

/* Histogram words: register-resident rows (<= 32K elements per CTA) pack two 16-bit counts per
 * word; streamed rows (any length per CTA) use 32-bit counts. */
template <bool STREAM>
struct BinCounts {
    static constexpr int W = STREAM ? GVR_BINS : GVR_PACKED_WORDS; /* 32-bit words per histogram */
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

/* largest cluster of an instance: streamed rows take at most GVR_STREAM_MAX_C CTAs (topk.cu), which
 * leaves their exchange buffers half the size and the shared memory to the staging ring */
template <bool STREAM>
constexpr int GVR_RANKS = STREAM ? GVR_STREAM_MAX_C : MAX_C;

/* Streamed rows, the verify pass: each thread copies its positions of the row's chunks into a ring
 * of shared-memory slots with asynchronous copies (cp.async, STAGE_SLOTS chunks in flight, the first
 * ones issued right behind the guess's sample loads) and reads them back itself, so that no register
 * holds a chunk in flight and no barrier orders the ring: two chunks stream in while the guess is
 * made (the registers held one; the guess took ~6K cycles of a 48K-cycle call at B=64 128K). H100
 * (benchmarks/RESULTS.md, session 21), B=64: 128K 25.4 -> 24.0 us, 256K 35.2 -> 33.9, 64K 17.5 ->
 * 16.7; B=8 256K 16.2 -> 15.8. Measured and not kept: 3 and 4 slots (128K 24.3, 24.5-24.7: more
 * chunks in flight per SM, slower), half-chunk stages (8 slots: 27.7 us, the pass's per-chunk work
 * doubled), bulk copies (cp.async.bulk, one per stage, an mbarrier per slot: 32.3 us, ~10-12 GB/s per
 * SM), copies issued before the sample's loads (29.5 us with half-chunk stages). */
constexpr int STAGE_SLOTS = 2;

/* register-held rows, the rounds on raw floats: 32-bit counts (one add of 1 per element, no 16-bit half to
 * select), packed in pairs as they are sent */
template <bool STREAM>
struct RawCounts {
    __align__(16) uint32_t hraw[GVR_BINS];
};
template <>
struct RawCounts<true> {}; /* streamed rows: none (their layout as without it) */

template <bool STREAM>
struct GvrShared : RawCounts<STREAM> {
    static constexpr int W = BinCounts<STREAM>::W;
    /* streamed: rows of W + 32 words, room for the verify pass's 4 words (overflow, pairs, largest
     * key, fullest warp: words 0-3, or W to W + 3 behind the counts when the pairs were binned before
     * the exchange) in rows padded to 128-byte multiples: rows of W + 4 words measured slower (H100,
     * B=64 256K 34.0 -> 37.2 us, 128K 24.0 -> 24.6; benchmarks/RESULTS.md, session 22) */
    static constexpr int WX = STREAM ? W + 32 : W;
    uint32_t hist[WX];                        /* this CTA's counts of the current round (+ the verify words) */
    uint32_t recv[2][GVR_RANKS<STREAM>][WX];  /* every rank's words, double-buffered by round parity */
    uint2 cand[CAND_CAP];                     /* rank 0: (key, index) of the candidates */
    int above[MAX_C];                         /* per rank: elements above Z */
    int inb[MAX_C];                           /* per rank: elements in [A, Z] */
    uint64_t mb[3];                           /* mbarriers: exchange (2 parities), candidates */
    __align__(16) float red[WARPS][8]; /* block_sum scratch */
    int pick[4];
    uint32_t edge[2]; /* the chosen bin's key range [edge[0], edge[1]) in a value round */
    int wtot[WARPS];  /* output pass: per-warp counts (above Z | candidates << 16) */
    typename cub::BlockScan<int, THREADS>::TempStorage scan;
};

__device__ __forceinline__ unsigned long long composite(uint32_t key, int idx)
{
    return ((unsigned long long)key << 32) | (unsigned long long)(0xFFFFFFFFu - (uint32_t)idx);
}

/* One round's bin map: value bins (layout_bin<GVR_BINS>) while A, Z are key-aligned, else (ck - A) >> sh. */
struct BinMap {
    bool value;
    Layout lay;
    unsigned long long A;
    int sh;
};

__device__ __forceinline__ bool value_layout_ok(float v0, float inv_w)
{
    return isfinite(v0) && isfinite(inv_w) && inv_w > 0.f && isfinite(v0 + (float)(GVR_BINS - 2) * __frcp_rn(inv_w));
}

__device__ __forceinline__ BinMap shift_map(unsigned long long A, unsigned long long Z)
{
    BinMap m;
    m.value = false;
    m.A = A;
    const unsigned long long width = Z - A;
    m.sh = width >= (unsigned long long)GVR_BINS ? 64 - __clzll((long long)width) - 8 : 0;
    return m;
}

__device__ __forceinline__ BinMap value_map(float v0, float inv_w)
{
    BinMap m;
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

__device__ __forceinline__ int popc_mask(unsigned m) { return __popc(m); }
__device__ __forceinline__ int popc_mask(unsigned long long m) { return __popcll(m); }
__device__ __forceinline__ int ffs_mask(unsigned m) { return __ffs((int)m); }
__device__ __forceinline__ int ffs_mask(unsigned long long m) { return __ffsll((long long)m); }

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

/* Streamed rows, the second collection (RECOLLECT): this thread's elements of [lo, hi) (NaN and the
 * NaN fill outside the row fail the compare) appended to its warp's segment after the warp's `wcount`
 * pairs, per element a warp ballot and the warp's pairs of it written at ballot offsets (element
 * order, then lane order: deterministic), the chunks of positions [seg, seg + my_nch P) read directly,
 * the next one's loads in flight. Out of line, so that the kernel's hot passes keep the registers and
 * the code they had without it (inlined, its ring pass put the first pass's B=64 64K, 128K rows
 * 0.3-0.5 us slower, H100, session 26). Returns the warp's count and this thread's largest key
 * collected (0: none).
 * The pass runs at ~2.2K cycles per chunk (a lone CTA, L2-resident rows: ~30 GB/s), bound by the warps'
 * instruction chains, not by the loads. H200 (benchmarks/RESULTS.md, session 30), i.i.d. rows, against
 * a warp scan of per-thread bit masks and a branch per element: B=64 128K 29.9 -> 29.6 us, 256K 42.7 ->
 * 41.0, B=8 256K 18.7 -> 18.5 (decode-trace rows, which rarely take it: equal). Measured slower: two
 * or four chunks in flight (B=64 256K 45.4 and 49.7 us), an array of tiles shifted by register moves
 * and a two-tile ping-pong (sessions 26, 28); no faster: loads that bypass L1 (ld.global.cg). */
template <typename T, int VEC>
__device__ __noinline__ uint2 collect_between(const T *__restrict__ xr, int L, int seg, int my_nch, float lo, float hi,
                                              uint2 *wseg, int seg_cap, int wcount)
{
    constexpr int P = RowTile<VEC>::P;
    const unsigned lt = (1u << (threadIdx.x & 31)) - 1u; /* the lanes below this one */
    uint32_t kmax = 0u;
    RowTile<VEC> nxt;
    if (my_nch > 0)
        nxt.load_raw_at(xr, L, seg);
#pragma unroll 1
    for (int c = 0; c < my_nch; c++) {
        const RowTile<VEC> cur = nxt;
        if (c + 1 < my_nch)
            nxt.load_raw_at(xr, L, seg + (c + 1) * P);
#pragma unroll
        for (int q = 0; q < RowTile<VEC>::NE; q++) {
            const float v = __uint_as_float(cur.key[q]);
            const bool take = v >= lo && !(v >= hi);
            const unsigned b = __ballot_sync(0xFFFFFFFFu, take);
            if (b) { /* uniform in the warp; an element no lane takes costs a compare, a vote and a branch */
                if (take) {
                    const int pos = wcount + __popc(b & lt);
                    const uint32_t key = stored_key(v);
                    if (pos < seg_cap)
                        wseg[pos] = make_uint2(key, (uint32_t)cur.index(q >> 2, q & 3));
                    kmax = key > kmax ? key : kmax;
                }
                wcount += __popc(b);
            }
        }
    }
    return make_uint2((uint32_t)wcount, kmax);
}

template <typename T, bool CLUSTER, int VEC, bool STREAM>
__global__ void __launch_bounds__(THREADS, 1)
    gvr_topk_gvr_kernel(const T *__restrict__ scores, long long row_stride, int N, RowGeom rg,
                        const int *__restrict__ prev, long long prev_stride, int pdiv, int Kp, int k,
                        int *__restrict__ out, long long out_stride, OutMap om, int C, int nch, int seg_cap,
                        int /* nslots: the ring's slots, STAGE_SLOTS (checked by the launcher) */)
{
    __shared__ GvrShared<STREAM> s;
    using Cnt = BinCounts<STREAM>;
    constexpr int HW = Cnt::W;
    const int row = blockIdx.x / C;
    const int t = (int)threadIdx.x, lane = t & 31, warp = t >> 5;
    int rank = 0;
    if constexpr (CLUSTER)
        rank = (int)cg::this_cluster().block_rank();
    /* before the wait for the grids this one depends on (it touches no global memory): with
     * programmatic dependent launch it overlaps their end. With the sample's positions by a shift
     * (below), H200 (benchmarks/RESULTS.md, session 32): B=1 128K 8.59 -> 8.47 us, 64K 7.40 -> 7.28,
     * B=8 256K 12.01 -> 11.78, B=64 128K 16.63 -> 16.38 */
    if constexpr (CLUSTER) {
        if (t == 0) {
#pragma unroll
            for (int i = 0; i < 3; i++)
                mbar_init(&s.mb[i], 1);
            fence_mbar_init();
        }
        /* the inits are visible to the peers after the matching wait (before the first push) */
        cluster_arrive_relaxed();
    }
    if (t < GvrShared<STREAM>::WX)
        s.hist[t] = 0;
    if constexpr (!STREAM)
        if (t < GVR_BINS)
            s.hraw[t] = 0;
    pdl_enter();
    PROF_SPAN(0);
    const int L = row_length(N, rg, row), kk = k < L ? k : L;
    const RowOut ro(out, out_stride, om, row);
    if (rank == 0)
        pad_tail(ro, kk, k);
    if (kk == 0) { /* uniform over the cluster */
        if constexpr (CLUSTER)
            cluster_wait();
        return;
    }
    const T *xr = scores + (long long)row * row_stride + row_start(N, rg, row);
    constexpr int P = RowTile<VEC>::P;
    const int S = nch * P; /* positions per CTA: [rank * S, rank * S + S), aligned coordinates */
    const int seg = rank * S, shift = row_shift(xr);
    /* chunks of this CTA that hold row elements (uniform in the CTA) */
    const int my_nch = L + shift > seg ? min(nch, (L + shift - seg + P - 1) / P) : 0;
    PROF_RESET();
    PROF(0);
    const bool search = kk < L && L > CAND_CAP;

    /* streamed: the collection buffer (seg_cap pairs per warp) and behind it the staging ring of
     * STAGE_SLOTS slots of P elements (a chunk), dynamic shared memory */
    extern __shared__ __align__(16) uint2 xbuf[];
    T *const ring = reinterpret_cast<T *>(xbuf + (size_t)seg_cap * WARPS);
    /* the ring's slots: a constant (the launcher checks that nslots has it), so that the slot index
     * is a mask and the copy wait an immediate, not a remainder and a switch per chunk */
    constexpr int NSL = STAGE_SLOTS;
    /* staged: the verify pass reads the chunks from the ring */
    const bool staged = STREAM && search && my_nch > 0;
    /* this thread's vectors of chunk c (those wholly inside the row) into its slot, one commit group
     * per chunk (empty past the last chunk, so that the group count stays the chunk count) */
    auto stage_copy = [&](int c) {
        if (c < my_nch) {
            T *const slot = ring + (size_t)(c % NSL) * P;
            const int base = seg + c * P - shift;
            if (base >= 0 && base + P <= L) { /* the chunk lies in the row (all but its ends) */
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    const int o = (j * THREADS + t) * 4;
                    __pipeline_memcpy_async(slot + o, xr + base + o, 4 * sizeof(T));
                }
            } else {
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    const int o = (j * THREADS + t) * 4, i = base + o;
                    if (i >= 0 && i + 3 < L) /* the vectors that load_staged reads from the slot */
                        __pipeline_memcpy_async(slot + o, xr + i, 4 * sizeof(T));
                }
            }
        }
        __pipeline_commit();
    };
    /* wait until at most n of this thread's copy groups are pending; the compiler barrier keeps the
     * slot's loads after it (the wait's asm in cuda_pipeline_helpers.h declares no memory clobber) */
    auto stage_wait = [](int n) {
        __pipeline_wait_prior(n);
        asm volatile("" ::: "memory");
    };

    /* loads: prediction indices, the row, the scores at the predicted indices */
    int pidx[PRED_PER_THREAD];
    /* streamed rows leave the prediction out: their threshold comes from the sample (below), and
     * gathering the predicted scores only costs latency there */
    const int kp = prev && !STREAM ? Kp : 0;
    const int np = kp < PRED_STATS ? kp : PRED_STATS; /* entries read: prev[j * kp / np], j < np */
    const int *pr = prev ? prev + (long long)(row / pdiv) * prev_stride : nullptr;
    int p0 = -1; /* the first predicted index: its score is the statistics' pivot */
    if (search) {
#pragma unroll
        for (int i = 0; i < PRED_PER_THREAD; i++) {
            const int j = t + i * THREADS;
            pidx[i] = j < np ? __ldg(pr + (np == kp ? j : (int)(((long long)j * kp) / np))) : -1;
        }
        p0 = kp > 0 ? __ldg(pr) : -1;
    }
    /* the row (STREAM false: loaded once, held in registers); streamed: after the sample's loads
     * (below) */
    RowTile<VEC> tile;
    if constexpr (!STREAM)
        tile.load_raw(xr, L, rank);
    /* the strided sample (always: it also judges the prediction), independent of the gathers */
    constexpr int SPT = (SAMPLE<STREAM> + THREADS - 1) / THREADS;
    const int sm = L < SAMPLE<STREAM> ? L : SAMPLE<STREAM>;
    float sval[SPT];
    float pval[PRED_PER_THREAD];
    float pivot = 0.f;
    if (search) {
#pragma unroll
        for (int i = 0; i < SPT; i++) {
            const int j = t + i * THREADS;
            /* position j L / sm without a division: j when sm = L (a row shorter than the sample), else a shift */
            const int pj = L < SAMPLE<STREAM> ? j : (int)(((unsigned long long)j * (unsigned)L) / (unsigned)SAMPLE<STREAM>);
            sval[i] = j < sm ? Elem<T>::ld(xr + pj) : __int_as_float(0x7FC00000);
        }
#pragma unroll
        for (int i = 0; i < PRED_PER_THREAD; i++)
            pval[i] = (pidx[i] >= 0 && pidx[i] < L) ? Elem<T>::ld(xr + pidx[i]) : __int_as_float(0x7FC00000);
        pivot = Elem<T>::ld(xr + ((p0 >= 0 && p0 < L) ? p0 : 0));
    }
    /* streamed rows: the first stages' copies (without a search: the first chunk's loads), behind
     * the sample's loads */
    if constexpr (STREAM) {
        if (staged) {
            for (int c = 0; c < NSL; c++)
                stage_copy(c);
        } else if (my_nch > 0) {
            tile.load_raw_at(xr, L, seg);
        }
    }
    if constexpr (!STREAM && !RAW_FIRST)
        tile.convert(); /* while the gathers are in flight */
    if (t < MAX_C) {
        /* per-rank valid elements: everything is "in" before the first round */
        const long long lo = (long long)t * S - shift, hi = lo + S; /* rank t's elements [lo, hi) */
        const long long valid = (hi < L ? hi : L) - (lo > 0 ? lo : 0);
        s.inb[t] = valid < 0 ? 0 : (int)valid;
        s.above[t] = 0;
    }
    /* with a search, block_sum's barrier orders these writes before their readers: one barrier fewer
     * before the guess (with the quantile computed before the block sum: B=1 128K 8.69 -> 8.52 us, H200,
     * benchmarks/RESULTS.md, session 32) */
    if (!search)
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

    BinMap map = shift_map(A, Z);
    /* streamed: the verify pass collects the elements >= tc (a value below the guessed k-th); band:
     * the width of the value band searched below tc when fewer than kk lie above it, and (pre) of
     * the collected pairs' first bins above it */
    bool verify = false;
    /* streamed, verify: each CTA bins its collected pairs over [tc, tc + band) right after its pass and
     * the bins travel with the verify exchange, so that the first round needs no exchange of its own */
    bool pre = false;
    float tc = 0.f, band = 0.f;
    bool use_pred = false;
    if (search) {
        /* Phase 1 (guess): mean and spread of the predicted scores and of a strided sample, in one
         * block reduction of (n, sum d, sum d^2) each, d = v - pivot (a value of the same row, so that
         * E[d^2] - E[d]^2 does not cancel) */
        constexpr bool SKEW = STREAM && SKEW_A > 0.f;
        /* the normal quantile of the share 1.15 kk / L (the row's size only), computed before the block
         * sum, while the sample's loads are in flight */
        const float frac = fminf(fmaxf(__fdividef(1.15f * (float)kk, (float)L), 1e-7f), 0.999999f);
        const float zq = 1.41421356f * erfcinvf(2.f * frac);
        float st[SKEW ? 7 : 6] = {};
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
                if constexpr (SKEW)
                    st[6] += d * d * d;
            }
        block_sum(st, s);
        /* (the guess only steers the search: fast approximate division is fine here, and it is
         * the same in every CTA) */
        const float ins = __frcp_rn(fmaxf(st[3], 1.f)), mds = st[4] * ins, mean_s = pivot + mds;
        const float sd_s = sqrtf(fmaxf(st[5] * ins - mds * mds, 0.f));
        float center = mean_s + sd_s * zq; /* normal quantile of the sample */
        float spread = SAMPLE_SPREAD * sd_s;
        /* streamed: the verify pass collects from the sample's estimate (a threshold from the previous
         * Top-K's statistics measured no faster, and where it mostly persists, 70-95% overlap, its
         * mean lies above the k-th value and left fewer than kk above it: a second pass) */
        /* the estimate's standard error for a normal quantile from m values: sd sqrt((1 + z^2 / 2) / m) */
        tc = center - TC_MARGIN * sd_s * sqrtf((1.f + 0.5f * zq * zq) * ins);
        if constexpr (SKEW) {
            /* the sample's third central moment about its mean, from the moments about the pivot; g's
             * NaN (sd 0, overflow) falls to 0 in fmaxf, inf to SKEW_CAP */
            const float m2 = st[5] * ins, m3 = st[6] * ins - mds * (3.f * m2 - 2.f * mds * mds);
            const float g = fminf(fmaxf(SKEW_A * __fdividef(m3, sd_s * sd_s * sd_s), 0.f), SKEW_CAP);
            tc += sd_s * (zq * zq - 1.f) * g * (1.f / 6.f);
        }
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
        const float inv_w = (float)(GVR_BINS - 2) * __frcp_rn(2.f * spread);
        if (spread > 0.f && value_layout_ok(center - spread, inv_w)) {
            map = value_map(center - spread, inv_w);
            band = 2.f * spread;
            verify = STREAM && isfinite(tc) && value_layout_ok(tc - band, (float)(GVR_BINS - 2) * __frcp_rn(band));
            pre = verify && value_layout_ok(tc, (float)(GVR_BINS - 2) * __frcp_rn(band));
        }
    }
    if constexpr (CLUSTER)
        cluster_wait();
    PROF(3);

    /* One pass over this CTA's share of the row, f(tile) per chunk of P elements: the register-held
     * tile, or (STREAM) the row re-read chunk by chunk, the next chunk's loads in flight while the
     * current one is processed. */
    /* streamed: the pairs collected in the first pass (dynamic shared memory), their count in this
     * CTA, and whether every later pass reads them instead of the row (uniform over the cluster) */
    /* seg_cap: pairs per warp segment (streamed: the launch's collection capacity / WARPS) */
    uint2 *wseg = xbuf + warp * seg_cap;
    int wcount = 0; /* pairs this warp found (uniform in the warp; > seg_cap: overflowed) */
    bool from_buf = false;
    bool have_hist = false; /* the first round's counts came with the verify exchange (pre) */
    int buf_len = 0; /* streamed, from_buf: the most pairs any warp of this CTA holds */
    bool chunk0_loaded = STREAM && !search; /* streamed rows without a search: `tile` holds chunk 0's loads */
    /* register-held row: raw floats while every round and the output can work on values (value
     * maps, key-aligned bounds above NaN), stored keys from the first that cannot (to_keys) */
    bool tile_raw = !STREAM && RAW_FIRST;
    auto to_keys = [&]() {
        if constexpr (!STREAM)
            if (tile_raw) {
                tile.convert();
                tile_raw = false;
            }
    };
    /* streamed, from the row: f(chunk) for each chunk, raw floats (RAW) or stored keys */
    auto chunks = [&](auto raw_c, auto &&f) {
        RowTile<VEC> nxt = tile;
        if (!chunk0_loaded && my_nch > 0)
            nxt.load_raw_at(xr, L, seg);
        chunk0_loaded = false;
        for (int c = 0; c < my_nch; c++) {
            RowTile<VEC> cur = nxt;
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
            /* a trip count uniform over the CTA (f may scan): its fullest warp's pairs, in tiles of
             * 128 PV pairs per warp */
            auto pairs = [&](auto pv_c) {
                constexpr int PV = decltype(pv_c)::value;
                for (int q0 = 0; q0 < buf_len; q0 += 128 * PV) {
                    PairTile<PV> bt;
                    bt.load(wseg, wcount, q0);
                    f(bt);
                }
            };
            if constexpr (PAIR_VEC > 0)
                pairs(std::integral_constant<int, PAIR_VEC>{});
            else if (buf_len <= 128)
                pairs(std::integral_constant<int, 1>{});
            else if (buf_len <= 256)
                pairs(std::integral_constant<int, 2>{});
            else
                pairs(std::integral_constant<int, 4>{});
        } else {
            chunks(std::false_type{}, f);
        }
    };

    int par = 0, value_rounds = 0;
    uint32_t phases = 0;
    /* s.hist[0, nw) of every rank (or, from_raw, s.hraw's counts packed: word4) into s.recv[par][rank] of
     * every CTA (st.async pushes to the peers' shared memory, completing on their parity-par mbarrier), then
     * a block barrier; nw % 4 == 0 */
    /* register-held rows: this round's counts are s.hraw's (streamed rows: a constant false, no state) */
    [[maybe_unused]] std::conditional_t<STREAM, std::false_type, bool> from_raw{};
    /* the 16-byte piece c of this CTA's words: s.hist's, or s.hraw's 32-bit counts packed in pairs */
    auto word4 = [&](int c) -> uint4 {
        if constexpr (!STREAM) {
            if (from_raw) {
                const uint4 a = reinterpret_cast<const uint4 *>(s.hraw)[2 * c];
                const uint4 b = reinterpret_cast<const uint4 *>(s.hraw)[2 * c + 1];
                return make_uint4(a.x | a.y << 16, a.z | a.w << 16, b.x | b.y << 16, b.z | b.w << 16);
            }
        }
        return reinterpret_cast<const uint4 *>(s.hist)[c];
    };
    auto exchange = [&](int nw) {
        if constexpr (STREAM) {
            if (t < nw)
                s.recv[par][rank][t] = s.hist[t];
        } else if (t < nw / 4) {
            reinterpret_cast<uint4 *>(s.recv[par][rank])[t] = word4(t);
        }
        if constexpr (CLUSTER) {
            uint64_t *const mbp = &s.mb[par];
            const uint32_t mb = smem_u32(mbp);
            if (t == 0)
                mbar_expect_bytes(mbp, (uint32_t)((C - 1) * nw * 4));
            const int nc16 = nw / 4; /* 16-byte pieces per peer */
            for (int i = t; i < (C - 1) * nc16; i += THREADS) {
                const int chunk = i % nc16, peer = (rank + 1 + i / nc16) % C;
                uint4 v;
                if constexpr (STREAM)
                    v = reinterpret_cast<const uint4 *>(s.hist)[chunk];
                else
                    v = word4(chunk);
                st_async_v4(peer_u32(smem_u32(&s.recv[par][rank][chunk * 4]), peer), v, peer_u32(mb, peer));
            }
            mbar_wait(mbp, (phases >> par) & 1u);
            phases ^= 1u << par;
        }
        __syncthreads();
    };

    /* Streamed rows, GVR phase 2 (verify): one pass over the row that only compares each element
     * with tc and collects those at or above it into this warp's shared-memory segment at ballot
     * offsets (deterministic; no histogram, no shared atomics: the pass runs at the speed of the
     * loads). The exchange gives every CTA each rank's count, the largest collected key and the
     * overflow flags, and (pre) each rank's counts of its pairs in 256 bins over [tc, tc + band),
     * binned right after its own pass (a CTA whose pass ends first bins while it would wait). At least
     * kk at or above tc: the search continues on [tc, max] -- from the collected pairs when no warp
     * overflowed (no further pass over the row; with pre, the first round's counts are already here:
     * one cluster exchange fewer), else from the row. Fewer: they are all selected, and the search
     * continues below tc from the row. H100 (benchmarks/RESULTS.md, session 22), pre against binning
     * after the exchange over [tc, max]: B=64 128K 24.1 -> 23.4 us, 64K 16.7 -> 16.2, 256K 34.1 ->
     * 33.5; B=8 256K 15.9 -> 15.3. */
    if (staged && !verify) /* the staged copies are not read: complete before the kernel ends */
        stage_wait(0);
    if (verify) { /* uniform over the cluster; verify implies STREAM (register-held rows keep the band
                   * rounds: measured, a verify pass there costs one more cluster exchange than it saves) */
        uint32_t kmax = 0u;
        /* the pass stores raw float32 bits in the pairs and keeps the largest value taken (NaN: none yet;
         * fmaxf returns the other operand); both become stored keys after it */
        float vmax = __int_as_float(0x7FFFFFFF);
        /* Per chunk: this thread's elements at or above tc as a bit mask (NaN, and the NaN fill
         * outside the row, fail the compare), a warp scan of the counts, then each thread writes
         * its few pairs at consecutive slots (lane order, then element order: deterministic). The
         * compare and the mask take about 3 instructions per element: with a ballot and a branch per
         * element the pass was issue bound near the copy bandwidth (its speed moved with code
         * generation, +-10%, measured). The dense form executed ~28 per element in all (Nsight
         * Compute, B=64 128K, session 30), ~10 of them the stored key and kmax of every element,
         * taken or not; so the pass stores the raw bits and the largest value taken (a predicated
         * fmaxf), and each warp turns its own ~60-120 pairs into stored keys after it (static SASS of
         * the dense loop 655 -> 494 instructions). H200 (benchmarks/RESULTS.md, session 31), against
         * the stored key per element: 64 distinct decode-trace rows B=64 128K 20.3 -> 17.3 us, 64K
         * 14.2 -> 12.9, 256K 30.0 -> 27.7, B=8 256K 12.9 -> 12.4; i.i.d. rows B=64 128K 29.6 -> 26.4. */
        auto collect = [&](const auto &tl, auto dense_c) {
            constexpr int NE = std::decay_t<decltype(tl)>::NE;
            unsigned cm = 0u;
#pragma unroll
            for (int q = 0; q < NE; q++)
                cm |= (__uint_as_float(tl.key[q]) >= tc ? 1u : 0u) << q;
            const int n = __popc(cm);
            const int incl = warp_inclusive_sum(n);
            int pos = wcount + incl - n;
            if constexpr (decltype(dense_c)::value) {
                /* dense: every element, a predicated store and a select (no branch) */
#pragma unroll
                for (int q = 0; q < NE; q++) {
                    const bool take = (cm >> q) & 1u;
                    if (take && pos < seg_cap)
                        wseg[pos] = make_uint2(tl.key[q], (uint32_t)tl.index(q >> 2, q & 3));
                    if (take)
                        vmax = fmaxf(vmax, __uint_as_float(tl.key[q]));
                    pos += take;
                }
            } else if (cm) {
#pragma unroll
                for (int q = 0; q < NE; q++)
                    if ((cm >> q) & 1u) {
                        if (pos < seg_cap)
                            wseg[pos] = make_uint2(tl.key[q], (uint32_t)tl.index(q >> 2, q & 3));
                        vmax = fmaxf(vmax, __uint_as_float(tl.key[q]));
                        pos++;
                    }
            }
            wcount += __shfl_sync(0xFFFFFFFFu, incl, 31);
        };
        /* the chunks from the ring, in order; a slot is refilled with the chunk NSL ahead once its
         * values are used (the copies are this thread's own: no barrier) */
        auto pass = [&](auto dense_c) {
            if constexpr (STREAM) {
                for (int c = 0; c < my_nch; c++) {
                    stage_wait(NSL - 1); /* chunk c's group: at most the NSL - 1 later ones pending */
                    RowTile<VEC> cur;
                    if (seg + c * P - shift >= 0 && seg + (c + 1) * P - shift <= L) /* as stage_copy's */
                        cur.load_staged_whole(xr, L, seg + c * P, ring + (size_t)(c % NSL) * P);
                    else
                        cur.load_staged(xr, L, seg + c * P, ring + (size_t)(c % NSL) * P);
                    collect(cur, dense_c);
                    stage_copy(c + NSL);
                }
                stage_wait(0); /* (empty groups) */
            }
        };
        if ((long long)kk * COLLECT_DENSE > L)
            pass(std::true_type{});
        else
            pass(std::false_type{});
        /* this warp's pairs: raw bits -> stored keys (the taken values are >= tc: never NaN); kmax from
         * the largest value taken, those past a full segment included */
        {
            __syncwarp(); /* the warp's pairs, written by its lanes */
            const int n = wcount < seg_cap ? wcount : seg_cap;
            for (int i = lane; i < n; i += 32)
                wseg[i].x = stored_key(__uint_as_float(wseg[i].x));
            kmax = vmax == vmax ? stored_key(vmax) : 0u;
            __syncwarp();
        }
        PROF(25);
        /* pre: this CTA's pairs binned over [tc, tc + band) (pairs are at or above tc: bins >= 1; the top
         * bin counted in registers); of use when the cluster's pairs hold the kk-th and no warp
         * overflowed (decided after the exchange), else the counts are dropped */
        if (pre) {
            const float iwp = (float)(GVR_BINS - 2) * __frcp_rn(band);
            __syncwarp(); /* the warp's pairs, written by its lanes */
            const int n = wcount < seg_cap ? wcount : seg_cap;
            int top = 0;
            constexpr int PV = PAIR_VEC ? PAIR_VEC : 1;
            for (int q0 = 0; q0 < n; q0 += 128 * PV) { /* uniform in the warp */
                PairTile<PV> bt;
                bt.load(wseg, n, q0);
#pragma unroll
                for (int i = 0; i < PairTile<PV>::NE; i++) {
                    const int b = value_bin<GVR_BINS>(tc, iwp, bt.key[i]); /* key 0 past the end: bin 0 */
                    top += b == GVR_BINS - 1;
                    if (b && b < GVR_BINS - 1)
                        Cnt::add(s.hist, b);
                }
            }
            top = __reduce_add_sync(0xFFFFFFFFu, top);
            if (lane == 0 && top)
                Cnt::add(s.hist, GVR_BINS - 1, (uint32_t)top);
            PROF(26);
        }
        /* each warp's flags into s.hist[fo, fo + 4), then the exchange: every CTA sums the same counts */
        int fo = pre ? HW : 0; /* the flag words: behind the bins, or alone */
        int total = 0;
        bool over = false;
        uint32_t kmx = 0u;
        auto flags_exchange = [&]() {
            kmax = __reduce_max_sync(0xFFFFFFFFu, kmax);
            if (lane == 0) {
                if (wcount > seg_cap)
                    atomicOr(&s.hist[fo], 1u);
                if (wcount)
                    atomicAdd(&s.hist[fo + 1], (uint32_t)wcount);
                atomicMax(&s.hist[fo + 2], kmax);
                atomicMax(&s.hist[fo + 3], (uint32_t)wcount);
            }
            __syncthreads();
            PROF(20);
            exchange(fo + 4);
            PROF(21);
            total = 0;
            over = false;
            kmx = 0u;
            for (int r = 0; r < C; r++) {
                over |= s.recv[par][r][fo] != 0u;
                total += (int)s.recv[par][r][fo + 1];
                kmx = s.recv[par][r][fo + 2] > kmx ? s.recv[par][r][fo + 2] : kmx;
            }
        };
        flags_exchange();
        float tlo = tc; /* the second collection's threshold */
        if (STREAM && RECOLLECT > 0.f && total < kk && !over) {
            /* the second collection: tlo from the normal model's step from tc's exact tail share (total /
             * L, at least half an element) to RECOLLECT kk / L, in the sample's standard deviations
             * (streamed rows keep the sample's band: band = 2 SAMPLE_SPREAD sd); the same in every CTA.
             * Taken when it lies below tc and its band map (the search below tlo) is valid. */
            const float fl = __frcp_rn((float)L);
            const float f0 = fminf(fmaxf(fmaxf((float)total, 0.5f) * fl, 1e-7f), 0.999999f);
            const float f1 = fminf(fmaxf(RECOLLECT * (float)kk * fl, 1e-7f), 0.999999f);
            const float step = band * (0.5f / SAMPLE_SPREAD) * 1.41421356f * (erfcinvf(2.f * f0) - erfcinvf(2.f * f1));
            const float lo = tc - step;
            if (step > 0.f && isfinite(lo) && lo < tc &&
                value_layout_ok(lo - step, (float)(GVR_BINS - 2) * __frcp_rn(step))) {
                tlo = lo;
                if (t < fo + 4)
                    s.hist[t] = 0u;
                pre = false;
                fo = 0;
                par ^= 1;
                __syncthreads(); /* s.hist zeroed before the second pass's counts */
                const uint2 wk = collect_between<T, VEC>(xr, L, seg, my_nch, tlo, tc, wseg, seg_cap, wcount);
                wcount = (int)wk.x;
                kmax = wk.y > kmax ? wk.y : kmax;
                PROF(27);
                flags_exchange();
            }
        }
        /* tlo (<= tc): the lowest threshold collected from */
        const uint32_t kc = stored_key(tlo);
        if (t < C) {
            const int cr = (int)s.recv[par][t][fo + 1];
            if (total >= kk) {
                s.inb[t] = cr;
            } else {
                s.above[t] = cr;
                s.inb[t] -= cr;
            }
        }
        if (t < fo + 4)
            s.hist[t] = 0u;
        if (total >= kk) {
            A = (unsigned long long)kc << 32;
            Z = ((unsigned long long)kmx << 32) | 0xFFFFFFFFull;
            cnt_in = total;
            from_buf = STREAM && !over;
            buf_len = (int)s.recv[par][rank][fo + 3]; /* <= seg_cap when no warp overflowed */
            if (pre && from_buf) {
                map = value_map(tc, (float)(GVR_BINS - 2) * __frcp_rn(band)); /* the first round's counts are in s.recv[par] */
                have_hist = true;
            } else {
                const float vmx = key_value(kmx), iw = (float)(GVR_BINS - 2) / (vmx - tlo);
                map = kmx < KEY_POS_INF && vmx > tlo && value_layout_ok(tlo, iw) ? value_map(tlo, iw) : shift_map(A, Z);
            }
        } else {
            Z = ((unsigned long long)kc << 32) - 1ull;
            above_total = total;
            cnt_in = L - total;
            /* below tc: a band of 3 sd (checked with verify); below tlo: one of its step (checked above) */
            const float w = tlo < tc ? tc - tlo : band;
            map = value_map(tlo - w, (float)(GVR_BINS - 2) * __frcp_rn(w));
        }
        if (!have_hist)
            par ^= 1;
        __syncthreads(); /* s.hist, s.inb, s.above */
        PROF(23);
        PROFV(90, cnt_in);
    }

    /* rounds */
    while (cnt_in > CAND_CAP) {
        if (!have_hist) {
            if (!map.value && (A >> 32) == (Z >> 32)) {
                /* one key left (ties): its elements' composite keys lie in [key << 32 | 2^32 - L, key << 32 |
                 * 2^32 - 1] (indices below L), so the shift map spans L, not 2^32: a tied run of a 128K row
                 * takes two rounds instead of three (one up to 64K) */
                const unsigned long long lo = (A & 0xFFFFFFFF00000000ull) | (0x100000000ull - (unsigned long long)L);
                A = lo > A ? lo : A;
                map = shift_map(A, Z);
            }
            const uint32_t ka = (uint32_t)(A >> 32), kz = (uint32_t)(Z >> 32);
            int top = 0; /* this thread's elements in the top bin (above the band: counted in a register) */
            /* bin 0 (below the band: most elements) follows from the totals; the two maps get their own
             * loops so that the hot one carries no per-element branch on the map kind */
            if (!STREAM && tile_raw && map.value && kz >= 2u) {
                /* the register-held row on its raw floats: [A, Z] as values (key order is value order
                 * with -0 == +0; the NaNs, and the NaN fill past the row's end, fail both compares, and
                 * they would land in the uncounted bin 0 of any value map anyway) */
                const float v0 = map.lay.v0, iw = map.lay.inv_w;
                const float va = ka >= 2u ? key_value(ka) : -INFINITY, vz = key_value(kz);
                /* No branch and no register count per element: every element adds 1 to its bin's 32-bit
                 * count, bins 0 (below the band or outside [A, Z]: never read) and the top one included;
                 * the lanes of a warp that add to one word are one update (the adds of 1 compile to
                 * ATOMS.POPC.INC). The counts are packed in pairs as they are sent (word4). H200
                 * (benchmarks/RESULTS.md, session 33), against a branch around a packed 16-bit add per
                 * element and the top bin counted in a register: B=1 128K 8.50 -> 7.87 us, 256K 10.97 ->
                 * 9.67, 32K 7.10 -> 6.77; B=8 128K 11.00 -> 9.62; B=64 32K 11.66 -> 10.41. With a branch
                 * around 32-bit adds instead, B=1 32K-64K gained nothing; with the elements outside bins
                 * 1-254 sent to a per-lane sink word and the top bin in a register, half of it. */
                if constexpr (!STREAM) {
                    from_raw = true;
#pragma unroll
                    for (int i = 0; i < 4 * VEC; i++) {
                        const float v = __uint_as_float(tile.key[i]);
                        const int b = (v >= va && v <= vz) ? value_bin_f<GVR_BINS>(v0, iw, v) : 0;
                        atomicAdd(&s.hraw[b], 1u); /* bin 0's count is never read */
                    }
                }
            } else if (map.value) {
                to_keys();
                const float v0 = map.lay.v0, iw = map.lay.inv_w; /* A, Z key-aligned: 32-bit keys only */
                sweep([&](const auto &tl) {
#pragma unroll
                    for (int i = 0; i < std::decay_t<decltype(tl)>::NE; i++) {
                        const uint32_t key = tl.key[i];
                        const int b = (key >= ka && key <= kz) ? value_bin<GVR_BINS>(v0, iw, key) : 0;
                        top += b == GVR_BINS - 1;
                        if (b && b < GVR_BINS - 1)
                            Cnt::add(s.hist, b);
                    }
                });
            } else {
                to_keys();
                sweep([&](const auto &tl) {
#pragma unroll
                    for (int j = 0; j < std::decay_t<decltype(tl)>::NE / 4; j++)
#pragma unroll
                        for (int l = 0; l < 4; l++) {
                            const uint32_t key = tl.key[4 * j + l];
                            const unsigned long long ck = composite(key, tl.index(j, l));
                            const int b = (key != 0u && ck >= A && ck <= Z) ? (int)((ck - A) >> map.sh) : 0;
                            top += b == GVR_BINS - 1;
                            /* register-held rows: runs of equal keys (constant rows, -inf masks) put a
                             * whole warp in one bin, one atomic for the warp (constant 128K rows at B=1
                             * 42.0 -> 33.6 us, H100); streamed rows measured slower with it (138 -> 190
                             * us at B=64: their shift rounds are bound by the passes over the row) */
                            if constexpr (STREAM) {
                                if (b && b < GVR_BINS - 1)
                                    Cnt::add(s.hist, b);
                            } else {
                                warp_bin_add(b && b < GVR_BINS - 1, b, [&](int bb, uint32_t n) { Cnt::add(s.hist, bb, n); });
                            }
                        }
                });
            }
            top = __reduce_add_sync(0xFFFFFFFFu, top);
            /* (a raw round counts its top bin with the others: top is 0 there, and the from_raw branch below
             * is never taken; it is kept as measured) */
            if (lane == 0 && top) {
                if constexpr (!STREAM) {
                    if (from_raw)
                        atomicAdd(&s.hraw[GVR_BINS - 1], (uint32_t)top);
                    else
                        Cnt::add(s.hist, GVR_BINS - 1, top);
                } else {
                    Cnt::add(s.hist, GVR_BINS - 1, top);
                }
            }
            __syncthreads();
            PROF(20);
            exchange(HW);
            PROF(21);
        }
        have_hist = false;
        if (t < HW)
            s.hist[t] = 0;
        if constexpr (!STREAM) {
            if (from_raw && t < GVR_BINS)
                s.hraw[t] = 0;
            from_raw = false;
        }
        /* cluster-summed counts, suffix sums from the top bin down, the bin holding the kk-th */
        const int b = GVR_BINS - 1 - t;
        int cnt = 0;
        if (b >= 1) {
            /* a fixed trip count (C is a launch parameter): the loads issue back to back */
#pragma unroll
            for (int r = 0; r < (CLUSTER ? GVR_RANKS<STREAM> : 1); r++)
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
            const uint32_t e = eb == 0 ? ka : eb == GVR_BINS ? kz1 : value_boundary<GVR_BINS>(map.lay, eb, ka, kz1);
            if (lane == 0)
                s.edge[warp] = e;
        }
        /* per rank: elements in bins above the chosen one (now above Z) and in it */
        if (warp < C) {
            int u = 0;
#pragma unroll
            for (int i = 0; i < GVR_BINS / 32; i++) {
                const int bb = lane + 32 * i;
                u += bb > bs ? Cnt::get(s.recv[par][warp], bb) : 0;
            }
            u = __reduce_add_sync(0xFFFFFFFFu, u);
            if (lane == 0) {
                s.above[warp] += u;
                s.inb[warp] = bs ? Cnt::get(s.recv[par][warp], bs) : s.inb[warp] - u;
            }
        }
        __syncthreads(); /* s.edge */
        PROF(24);
        /* the chosen bin's composite range, and the next round's map */
        if (map.value) {
            const uint32_t kb = s.edge[0], ke = s.edge[1];
            PROFV(91, bs);
            A = (unsigned long long)kb << 32;
            Z = ((unsigned long long)ke << 32) - 1ull;
            const float band = (float)(GVR_BINS - 2) / map.lay.inv_w;
            float v0 = 0.f, iw = 0.f;
            bool ok = false;
            /* the next round's map; streamed rows compute none after the last round (H200, benchmarks/RESULTS.md,
             * session 32: B=64 64K-256K, B=8 256K 0.06-0.2 us faster); register-held rows compute it (skipped,
             * their VEC 8-9 instances measured up to 0.6 us slower, B=1 256K + 1, B=64 32K + 1: code generation) */
            if ((!STREAM || Sb - Sb1 > CAND_CAP) && ++value_rounds < MAX_VALUE_ROUNDS && ke - kb > (uint32_t)GVR_BINS) {
                if (bs == GVR_BINS - 1 && kb >= 2u && kb < KEY_POS_INF) {
                    v0 = key_value(kb); /* above the band: a band 8x wider on top of it */
                    iw = map.lay.inv_w * 0.125f;
                    ok = true;
                } else if (bs == 0 && ke >= 3u && ke <= KEY_POS_INF) {
                    v0 = key_value(ke) - 8.f * band; /* below the band: 8x wider under it */
                    iw = map.lay.inv_w * 0.125f;
                    ok = true;
                } else if (bs > 0 && bs < GVR_BINS - 1 && kb >= 2u && ke <= KEY_POS_INF) {
                    v0 = key_value(kb); /* inside: even bins over the bin's values */
                    iw = (float)(GVR_BINS - 2) / (key_value(ke) - v0);
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
        mbar_expect_bytes(&s.mb[2], (uint32_t)((cnt_in - s.inb[0]) * 8));
    /* One loop per bound kind, without a per-element branch on it: raw floats against value bounds
     * (KIND 0), keys against key-aligned bounds (1), composite keys (2). Per chunk, each thread's
     * elements above Z and candidates as two bit masks, one warp scan of their packed counts, a
     * scan of the warp totals: every thread's first slots. Then each thread writes its few elements
     * at consecutive slots ((warp, lane, element) order: deterministic). No warp collective per
     * element: with a ballot pair, a branch and a reconvergence per element the register-held
     * output loop took ~11K cycles at B=64 32K (32 elements per thread), measured. */
    auto output_pass = [&](auto kind_c) {
        constexpr int KIND = decltype(kind_c)::value;
        const float va = KIND == 0 ? key_value(ka) : 0.f, vz = KIND == 0 ? key_value(kz) : 0.f;
        sweep([&](const auto &tl) {
            /* bit q: element q above Z / a candidate (NE <= 48 elements per thread) */
            constexpr int NE = std::decay_t<decltype(tl)>::NE;
            using Mask = std::conditional_t<(NE > 32), unsigned long long, unsigned>;
            Mask ma = 0u, mc = 0u;
#pragma unroll
            for (int q = 0; q < NE; q++) {
                bool up, in;
                if constexpr (KIND == 0) {
                    const float v = __uint_as_float(tl.key[q]);
                    up = v > vz;
                    in = v >= va;
                } else {
                    const int c = out_class<KIND == 1>(tl.key[q], tl.index(q >> 2, q & 3), ka, kz, A, Z);
                    up = c == 2;
                    in = c >= 1;
                }
                ma |= (Mask)(up ? 1u : 0u) << q;
                mc |= (Mask)(in && !up ? 1u : 0u) << q;
            }
            /* per chunk: at most P <= 32768 above and CAND_CAP candidates, packed in one word */
            const int mine = popc_mask(ma) | (popc_mask(mc) << 16);
            const int incl = warp_inclusive_sum(mine);
            if (lane == 31)
                s.wtot[warp] = incl;
            __syncthreads();
            const int before = (int)__reduce_add_sync(0xFFFFFFFFu, lane < warp ? (unsigned)s.wtot[lane] : 0u) + incl - mine;
            const int tot = (int)__reduce_add_sync(0xFFFFFFFFu, lane < WARPS ? (unsigned)s.wtot[lane] : 0u);
            PROF(30);
            auto put_above = [&]() {
                if (ma) {
                    int pa = pos_above + (before & 0xFFFF);
                    if constexpr (std::decay_t<decltype(tl)>::ARITH_INDEX) {
                        /* row elements (not collected pairs): the index is arithmetic, a loop over the set bits */
                        for (Mask m = ma; m; m &= m - 1u) {
                            const int q = ffs_mask(m) - 1;
                            ro.put(pa++, tl.index(q >> 2, q & 3));
                        }
                    } else {
#pragma unroll
                        for (int q = 0; q < NE; q++)
                            if ((ma >> q) & 1u)
                                ro.put(pa++, tl.index(q >> 2, q & 3));
                    }
                }
            };
            auto put_cands = [&]() {
                if (mc) {
                    int pc = pos_cand + (before >> 16);
#pragma unroll
                    for (int q = 0; q < NE; q++)
                        if ((mc >> q) & 1u) {
                            uint32_t key;
                            if constexpr (KIND == 0)
                                key = stored_key(__uint_as_float(tl.key[q]));
                            else
                                key = tl.key[q];
                            const uint2 v = make_uint2(key, (uint32_t)tl.index(q >> 2, q & 3));
                            if (rank == 0)
                                s.cand[pc] = v;
                            else
                                st_async_v2(peer_u32(smem_u32(&s.cand[pc]), 0), v, peer_u32(cmb, 0));
                            pc++;
                        }
                }
            };
            /* streamed: the candidates first (rank 0 waits for them before its ranking; the selected
             * indices wait for no one), measured 0.3-0.6 us faster at B=64 128K-256K (session 23) */
            if constexpr (STREAM) {
                put_cands();
                put_above();
            } else {
                put_above();
                put_cands();
            }
            PROF(33);
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
            mbar_wait(&s.mb[2], 0u);
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
            ro.put(above_total + better, (int)me.y);
        PROF(32);
    }
    PROF_SPAN(1);
}


/* ---- launcher --------------------------------------------------------------------------------- */

/* streamed: the collection capacity of a launch whose CTAs hold nch chunks each (launch.h) */
inline int gvr_collect_cap(int nch)
{
    return nch >= GVR_COLLECT_LONG_NCH ? GVR_COLLECT_CAP_LONG : GVR_COLLECT_CAP;
}

/* Set the kernel's function attributes on device dev (once per device and score type); *dyn: the
 * dynamic shared memory it may take (streamed: all that its static shared memory leaves, for the
 * collection buffer and the staging ring; 0 for register-held rows). */
template <typename T, bool CLUSTER, int VEC, bool STREAM>
cudaError_t gvr_configure(int dev, int *dyn)
{
    static DeviceCache<1> configured; /* the dynamic bytes + 1 */
    const int c = configured.get(dev, 0);
    if (c) {
        *dyn = c - 1;
        return cudaSuccess;
    }
    auto fn = gvr_topk_gvr_kernel<T, CLUSTER, VEC, STREAM>;
    if (CLUSTER) {
        const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        if (e != cudaSuccess)
            return e;
    }
    int d = 0;
    if (STREAM) {
        cudaFuncAttributes fa;
        int optin = 0;
        cudaError_t e = cudaFuncGetAttributes(&fa, fn);
        if (e == cudaSuccess)
            e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (e != cudaSuccess)
            return e;
        d = optin - (int)fa.sharedSizeBytes;
        e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, d);
        if (e != cudaSuccess)
            return e;
    }
    configured.put(dev, 0, d + 1);
    *dyn = d;
    return cudaSuccess;
}

/* streamed: the staging slots (chunks of P elements) beside a collection buffer of `cap` pairs in
 * `dyn` bytes (0: none fits) */
template <typename T, int VEC>
inline int gvr_stage_slots(int dyn, int cap)
{
    const int slot = RowTile<VEC>::P * (int)sizeof(T), n = (dyn - cap * (int)sizeof(uint2)) / slot;
    return n < 1 ? 0 : (n > STAGE_SLOTS ? STAGE_SLOTS : n);
}
/* sm_90's and sm_100's 227 KB of shared memory per CTA hold the streamed kernel's static shared
 * memory, the larger collection buffer and STAGE_SLOTS float32 slots (one would serialize the pass) */
static_assert(sizeof(GvrShared<true>) + 1024 + GVR_COLLECT_CAP_LONG * sizeof(uint2) +
                      STAGE_SLOTS * sizeof(float) * RowTile<GVR_STREAM_VEC>::P <= 227 * 1024,
              "streamed top-k: the staging ring does not fit beside the collection buffer");

template <bool CLUSTER, int VEC, bool STREAM>
int GvrInstance<CLUSTER, VEC, STREAM>::resident_rows(int dev, int C)
{
    static DeviceCache<MAX_C + 1> cache;
    int n = cache.get(dev, C);
    if (n > 0)
        return n;
    auto fn = gvr_topk_gvr_kernel<float, CLUSTER, VEC, STREAM>; /* the plan's: float32 instance */
    int dyn = 0;
    if (gvr_configure<float, CLUSTER, VEC, STREAM>(dev, &dyn) == cudaSuccess) {
        if (CLUSTER) {
            LaunchConfig lc((unsigned)C, THREADS, C, (size_t)dyn, nullptr, false);
            if (cudaOccupancyMaxActiveClusters(&n, fn, &lc.cfg) != cudaSuccess)
                n = 0;
        } else {
            int per_sm = 0, sms = 0;
            if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, THREADS, (size_t)dyn) == cudaSuccess &&
                sm_count(dev, &sms) == cudaSuccess)
                n = per_sm * sms;
        }
    }
    cudaGetLastError(); /* a failed query is not the caller's error */
    if (n <= 0)
        return 1; /* unknown: one row per wave, the conservative answer */
    cache.put(dev, C, n);
    return n;
}

template <typename T, bool CLUSTER, int VEC, bool STREAM>
cudaError_t gvr_launch_t(const gvr_topk_params *p, int dev, int C, int nch, cudaStream_t stream)
{
    int dyn = 0;
    const cudaError_t e = gvr_configure<T, CLUSTER, VEC, STREAM>(dev, &dyn);
    if (e != cudaSuccess)
        return e;
    const int cap = STREAM ? gvr_collect_cap(nch) : 0;
    const int nslots = STREAM ? gvr_stage_slots<T, VEC>(dyn, cap) : 0;
    if (STREAM && (nslots != STAGE_SLOTS || C > GVR_STREAM_MAX_C))
        return cudaErrorInvalidConfiguration; /* a device with less shared memory than sm_90's; a
                                               * cluster larger than the exchange buffers */
    const size_t ring = (size_t)nslots * RowTile<VEC>::P * sizeof(T);
    LaunchConfig lc((unsigned)(C * p->B), THREADS, C, (size_t)cap * sizeof(uint2) + ring, stream);
    return cudaLaunchKernelEx(&lc.cfg, gvr_topk_gvr_kernel<T, CLUSTER, VEC, STREAM>, static_cast<const T *>(p->scores),
                              (long long)p->row_stride, p->N, row_geom(p), p->prev, (long long)p->prev_stride,
                              prev_div(p), p->prev ? p->Kp : 0, p->k, p->out, (long long)p->out_stride,
                              first_out_map(p), C, nch, cap / WARPS, nslots);
}

template <bool CLUSTER, int VEC, bool STREAM>
cudaError_t GvrInstance<CLUSTER, VEC, STREAM>::launch(const gvr_topk_params *p, int dev, int C, int nch, cudaStream_t stream)
{
    return visit_score_type(p->score_dtype, [&](auto st) {
        return gvr_launch_t<typename decltype(st)::type, CLUSTER, VEC, STREAM>(p, dev, C, nch, stream);
    });
}

#ifdef GVR_PROFILE
template <bool CLUSTER, int VEC, bool STREAM>
cudaError_t GvrInstance<CLUSTER, VEC, STREAM>::profile_read(long long *host)
{
    return ::profile_read(host);
}
#endif

} // namespace gvr::topk
