/* common.cuh: device helpers shared by the Top-K kernels (radix.cuh, gvr.cuh, sort.cuh).
 *
 * Keys: the kernels compare 32-bit "stored keys": gvr_key_f32(f) + 1 (common/gvr_keys.h: a larger key
 * ranks first, NaN lowest), so that 0 is free for positions outside a row. -inf is 0x00800000, NaN
 * 1, +inf 0xFF800001.
 * Rows: position q of a row holds element q - s, s = the row's start in floats past a 16-byte
 * boundary (0..3, row_shift), so that every float4 load is aligned whatever the row's address; a
 * launch covers gvr_topk_row_positions(p) positions per row (gvr_kernels.h). A RowTile holds a CTA's
 * P = 2048 VEC positions: thread t the positions (j*512 + t)*4 + {0..3}, j < VEC (coalesced float4
 * loads), in registers.
 * Bins: an interval [a, z) of keys known to hold the kk-th largest is split into bins by a monotone
 * map (Layout: evenly spaced values or keys); a bin's key range is found afterwards by a search on
 * the map (boundary, value_boundary). */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/gvr_keys.h"
#include "common/profile.cuh"
#include "topk/launch.h"

namespace gvr::topk {

constexpr int WARPS = THREADS / 32;

constexpr uint32_t KEY_POS_INF = GVR_KEY_POS_INF + 1u; /* stored key of +inf */
constexpr uint32_t KEY_END = KEY_POS_INF + 1u;         /* above every stored key */
constexpr uint32_t RAW_PAST_END = 0xFFFFFFFFu;         /* raw bits loaded past a row's end: a NaN */

/* the stored key of a score (the one definition of it) */
__device__ __forceinline__ uint32_t stored_key(float f) { return gvr_key_f32(f) + 1u; }

/* the value of a stored key in [2, KEY_POS_INF] */
__device__ __forceinline__ float key_value(uint32_t sk) { return gvr_key_to_f32(sk - 1u); }

/* The rows of a call (gvr_topk_params): lengths (per row, or per request of next_n rows), ragged
 * starts. Device-resident values are not checked on the host (GVR_CHECK=1 validates lengths there):
 * they are clamped. */
struct RowGeom {
    const int *lengths;
    const int *starts;
    int next_n;
    bool len_per_req;
    int max_len; /* > 0: rows cut to it */
};

inline RowGeom row_geom(const gvr_topk_params *p)
{
    return RowGeom{p->lengths, p->row_starts, p->next_n > 1 ? p->next_n : 1,
                   (p->per_request & GVR_TOPK_LENGTHS_PER_REQUEST) != 0, p->max_len > 0 ? p->max_len : 0};
}

/* where row `row` starts in its scores row: clamp(starts[row], 0, N), or 0 */
__device__ __forceinline__ int row_start(int N, const RowGeom &g, int row)
{
    if (!g.starts)
        return 0;
    const int s = g.starts[row];
    return s < 0 ? 0 : (s > N ? N : s);
}

/* a row's length: its lengths entry (per row, or the causal per-request rule) clamped to [0, N - start]
 * and to max_len, or N - start (cut to max_len) */
__device__ __forceinline__ int row_length(int N, const RowGeom &g, int row)
{
    int room = N - row_start(N, g, row);
    if (g.max_len > 0 && room > g.max_len)
        room = g.max_len;
    if (!g.lengths)
        return room;
    const int L = g.len_per_req ? g.lengths[row / g.next_n] - (g.next_n - 1 - row % g.next_n) : g.lengths[row];
    return L < 0 ? 0 : (L > room ? room : L);
}

/* Where a row's result goes (gvr_topk_params): out, and with a block table physical slots in out and,
 * optionally, the positions in pos. */
struct OutMap {
    const int *bt; /* NULL: out holds positions */
    long long bt_stride;
    int page;
    int *pos; /* NULL or the positions' output */
    long long pos_stride;
    int bt_div; /* rows per block-table row (next_n with GVR_TOPK_BT_PER_REQUEST, else 1) */
};
struct RowOut {
    int *orow, *prow;
    const int *btrow;
    int page;
    __device__ __forceinline__ RowOut(int *out, long long out_stride, const OutMap &m, int row)
        : orow(out + (long long)row * out_stride), prow(m.pos ? m.pos + (long long)row * m.pos_stride : nullptr),
          btrow(m.bt ? m.bt + (long long)(row / m.bt_div) * m.bt_stride : nullptr), page(m.page)
    {
    }
    /* result slot i holds position p (-1: none) */
    __device__ __forceinline__ void put(int i, int p) const
    {
        if (prow)
            prow[i] = p;
        if (btrow && p >= 0) {
            const int q = p / page, pg = btrow[q];
            p = pg < 0 ? -1 : (int)((long long)pg * page + (p - q * page)); /* slots fit int32 (documented) */
        }
        orow[i] = p;
    }
};

/* the map of the selecting kernel (GVR or radix): the full one, or none when a sort follows (the sort
 * kernel reads the positions back from out, then writes through the map) */
inline OutMap out_map(const gvr_topk_params *p)
{
    const int div = (p->per_request & GVR_TOPK_BT_PER_REQUEST) && p->next_n > 1 ? p->next_n : 1;
    return OutMap{p->block_table, (long long)p->bt_stride, p->page_size > 0 ? p->page_size : 1, p->out_pos,
                  (long long)p->out_pos_stride, div};
}
inline OutMap first_out_map(const gvr_topk_params *p)
{
    return p->sorted ? OutMap{nullptr, 0, 1, nullptr, 0, 1} : out_map(p);
}

/* rows per prev_topk row */
inline int prev_div(const gvr_topk_params *p)
{
    return (p->per_request & GVR_TOPK_PREV_PER_REQUEST) && p->next_n > 1 ? p->next_n : 1;
}

/* -1 in a row's output slots [kk, k) (one CTA of the row) */
__device__ __forceinline__ void pad_tail(const RowOut &o, int kk, int k)
{
    for (int i = kk + (int)threadIdx.x; i < k; i += (int)blockDim.x) {
        o.orow[i] = -1;
        if (o.prow)
            o.prow[i] = -1;
    }
}

/* The score types, read as their exact float32 values: ld (one element) and ld4 (4 aligned elements,
 * raw float32 bits out: one 16-byte load of float32, one 8-byte load of a half type). */
template <typename T> struct Elem;
/* ld4: four elements from global memory (read-only path); lds4: from shared memory (a staged row) */
template <> struct Elem<float> {
    __device__ static __forceinline__ float ld(const float *p) { return __ldg(p); }
    __device__ static __forceinline__ void ld4(const float *p, uint32_t *o) { bits4(__ldg(reinterpret_cast<const float4 *>(p)), o); }
    __device__ static __forceinline__ void lds4(const float *p, uint32_t *o) { bits4(*reinterpret_cast<const float4 *>(p), o); }
    __device__ static __forceinline__ void bits4(float4 v, uint32_t *o)
    {
        o[0] = __float_as_uint(v.x);
        o[1] = __float_as_uint(v.y);
        o[2] = __float_as_uint(v.z);
        o[3] = __float_as_uint(v.w);
    }
};
template <> struct Elem<__half> {
    __device__ static __forceinline__ float ld(const __half *p) { return __half2float(__ldg(p)); }
    __device__ static __forceinline__ void ld4(const __half *p, uint32_t *o) { bits4(__ldg(reinterpret_cast<const uint2 *>(p)), o); }
    __device__ static __forceinline__ void lds4(const __half *p, uint32_t *o) { bits4(*reinterpret_cast<const uint2 *>(p), o); }
    __device__ static __forceinline__ void bits4(uint2 v, uint32_t *o)
    {
        o[0] = __float_as_uint(__half2float(__ushort_as_half((unsigned short)(v.x & 0xFFFFu))));
        o[1] = __float_as_uint(__half2float(__ushort_as_half((unsigned short)(v.x >> 16))));
        o[2] = __float_as_uint(__half2float(__ushort_as_half((unsigned short)(v.y & 0xFFFFu))));
        o[3] = __float_as_uint(__half2float(__ushort_as_half((unsigned short)(v.y >> 16))));
    }
};
template <> struct Elem<__nv_bfloat16> { /* bfloat16 bits are float32's upper half */
    __device__ static __forceinline__ float ld(const __nv_bfloat16 *p)
    {
        return __uint_as_float((uint32_t)__ldg(reinterpret_cast<const unsigned short *>(p)) << 16);
    }
    __device__ static __forceinline__ void ld4(const __nv_bfloat16 *p, uint32_t *o)
    {
        bits4(__ldg(reinterpret_cast<const uint2 *>(p)), o);
    }
    __device__ static __forceinline__ void lds4(const __nv_bfloat16 *p, uint32_t *o) { bits4(*reinterpret_cast<const uint2 *>(p), o); }
    __device__ static __forceinline__ void bits4(uint2 v, uint32_t *o)
    {
        o[0] = v.x << 16;
        o[1] = v.x & 0xFFFF0000u;
        o[2] = v.y << 16;
        o[3] = v.y & 0xFFFF0000u;
    }
};

/* elements between a row's start and the 4-element vector boundary below it (0..3) */
/* f(ScoreType<T>{}) for the element type T named by gvr_topk_params::score_dtype: the launchers' one
 * switch over score types */
template <typename T> struct ScoreType {
    using type = T;
};
template <typename F> inline cudaError_t visit_score_type(int score_dtype, F &&f)
{
    switch (score_dtype) {
    case GVR_TOPK_F16:
        return f(ScoreType<__half>{});
    case GVR_TOPK_BF16:
        return f(ScoreType<__nv_bfloat16>{});
    default:
        return f(ScoreType<float>{});
    }
}

template <typename T> __device__ __forceinline__ int row_shift(const T *row)
{
    return (int)((reinterpret_cast<uintptr_t>(row) / sizeof(T)) & 3u);
}

template <int VEC>
struct RowTile {
    static constexpr int P = THREADS * 4 * VEC;
    static constexpr int NE = 4 * VEC;        /* elements per thread */
    static constexpr bool ARITH_INDEX = true; /* index(j, l) is arithmetic in j, l */
    uint32_t key[VEC * 4];
    int base; /* element held by this CTA's first position (negative by the row's shift in slice 0) */
    int L;

    __device__ __forceinline__ int index(int j, int l) const { return base + (j * THREADS + (int)threadIdx.x) * 4 + l; }

    /* Issue the loads of slice `rank` (raw bits into key[], a NaN outside the row); convert() turns
     * them into stored keys (0 outside the row). */
    template <typename T>
    __device__ __forceinline__ void load_raw(const T *row, int len, int rank) { load_raw_at(row, len, rank * P); }

    /* the same for the P positions from `first` on */
    template <typename T>
    __device__ __forceinline__ void load_raw_at(const T *row, int len, int first)
    {
        L = len;
        base = first - row_shift(row);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            const int i = index(j, 0); /* row + i is vector aligned */
            if (i >= 0 && i + 3 < len) {
                Elem<T>::ld4(row + i, &key[4 * j]);
            } else {
                load_ends(row, len, i, j);
            }
        }
    }

    /* vector j of a row's end: element by element, a NaN outside the row */
    template <typename T>
    __device__ __forceinline__ void load_ends(const T *row, int len, int i, int j)
    {
#pragma unroll
        for (int l = 0; l < 4; l++)
            key[4 * j + l] = ((unsigned)(i + l) < (unsigned)len) ? __float_as_uint(Elem<T>::ld(row + i + l)) : RAW_PAST_END;
    }

    /* The same from this thread's staged copies of these P positions (`stage`: position `first`'s
     * element in shared memory), which hold the vectors wholly inside the row; the others are read
     * from the row (its ends) or are outside it (a NaN). */
    template <typename T>
    __device__ __forceinline__ void load_staged(const T *row, int len, int first, const T *stage)
    {
        L = len;
        base = first - row_shift(row);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            const int o = (j * THREADS + (int)threadIdx.x) * 4, i = base + o;
            if (i >= 0 && i + 3 < len) {
                Elem<T>::lds4(stage + o, &key[4 * j]);
            } else {
                load_ends(row, len, i, j);
            }
        }
    }

    /* load_staged of P positions that all lie in the row */
    template <typename T>
    __device__ __forceinline__ void load_staged_whole(const T *row, int len, int first, const T *stage)
    {
        L = len;
        base = first - row_shift(row);
#pragma unroll
        for (int j = 0; j < VEC; j++)
            Elem<T>::lds4(stage + (j * THREADS + (int)threadIdx.x) * 4, &key[4 * j]);
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

/* Interval state of a search, identical in every thread of the cluster. */
struct Interval {
    uint32_t a, z; /* [a, z) holds the kk-th key */
    int ca, cz;    /* c(a) >= kk > c(z), c(t) = #{key >= t} */
    int done;      /* c(a) == kk exactly: select every key >= a */
};

/* A bin map f on keys, monotone, so that a pass over the elements is a few arithmetic operations and
 * one shared-memory atomic per element (no search); bin b's key range [min{k: f(k) >= b},
 * min{k: f(k) >= b+1}) is found afterwards for the chosen bin only.
 *  VALUE: f(k) = clamp(floor((value(k) - v0) * inv_w) + 1, 0, NBINS - 1): evenly spaced values.
 *  KEY:   f(k) = clamp(floor((k - a) * kscale) + 1, 0, NBINS - 1): evenly spaced keys.
 * fl(fl(v - v0) * inv_w) is monotone in v (round to nearest), so f is monotone in the key. */
struct Layout {
    bool key_mode;
    float v0, inv_w;
    uint32_t a;
    double kscale;
};

/* bin of a value in a value layout: 0 below v0 (and NaN, past-the-row), NBINS - 1 at or above the
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

template <int NBINS>
__device__ __forceinline__ int layout_bin(const Layout &lay, uint32_t key)
{
    if (lay.key_mode) {
        const double u = (double)(key - lay.a) * lay.kscale;
        return u >= (double)(NBINS - 2) ? NBINS - 1 : (int)u + 1;
    }
    return value_bin<NBINS>(lay.v0, lay.inv_w, key);
}

/* Warp-wide: min{k in [lo, hi) : f(k) >= b}, or hi if none. Each step probes 32 evenly spaced keys. */
template <int NBINS>
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

/* min{k in [lo, hi) : f(k) >= b} (hi if none), b >= 1, for a key layout: the map inverted
 * arithmetically, then checked and stepped key by key (rounding puts the estimate within a few
 * keys); a warp-parallel search if that does not settle. Uniform across the warp. */
template <int NBINS>
__device__ __forceinline__ uint32_t key_boundary(const Layout &lay, int b, uint32_t lo, uint32_t hi)
{
    uint64_t k = (uint64_t)lay.a + (uint64_t)ceil((double)(b - 1) / lay.kscale);
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
    if (m != 0u && !(m & 1u)) { /* the edge is inside the window */
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

} // namespace gvr::topk
