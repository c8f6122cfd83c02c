/* decode.cuh: the sparse decode-attention kernel (gvr_sparse_attention, gvr_kernels.h): flash-decoding
 * over the selected entries of a paged KV cache, one CTA of NW warps per (row b, KV head, chunk of HC
 * query heads of the GQA group, split s of the entries).
 *
 * Lanes split D in 16-byte pieces (8 elements per lane): a token takes L = D / 8 lanes (a sub-warp),
 * a warp serves TPW = 32 / L tokens at once, each sub-warp keeps its own online-softmax state for the
 * HC heads (q pre-scaled by scale * log2(e) and O in registers, m / l per head, log2 domain).
 *  - normal mode: the split's tokens (its entries expanded to their G tokens) are resolved tile by tile
 *    (TILE = one token per thread: entry load, block-table load, masks) into compacted (K, V) offsets
 *    in shared memory, two tiles ahead of use (entry loads) and one tile ahead (page loads); the
 *    sub-warps take the tile's tokens interleaved, U per step, all 2U 16-byte loads issued first;
 *  - partials mode (part_out != NULL): a sub-warp takes whole entries (entry-major), writes each
 *    entry's own state and merges it into its running state (O kept in shared memory).
 * The end of the CTA merges the sub-warps (shuffles) and the warps (shared memory) in fixed order;
 * S == 1 writes out / lse (merged with the prior state when accumulating); a cluster launch (a.cl > 1:
 * the S splits are the cluster's ranks) pushes ranks > 0's states into rank 0's shared memory (st.async,
 * one mbarrier) and rank 0 merges them in rank order; otherwise S > 1 writes the split's
 * state to the workspace and the CTA that arrives last at the unit's counter merges the S split states
 * in split order (deterministic whichever CTA is last) and resets the counter to 0. */
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cluster.cuh"
#include "common/device.cuh"
#include "common/fp8.cuh"
#include "common/launch.cuh"
#include "common/profile.cuh"
#include "gvr_kernels.h"

namespace gvr::attn {

constexpr int NW = 4;              /* warps per CTA */
constexpr int THREADS = NW * 32;   /* threads per CTA */
constexpr int TILE = THREADS;      /* tokens resolved per tile (one per thread) */
constexpr int MAX_SPLITS = 64;     /* splits of one unit's entries */
/* the most splits merged in one cluster (16: non-portable on sm_90); 0: never (every split merge goes
 * through the global workspace) */
#ifndef GVR_DECODE_MAX_CLUSTER
#define GVR_DECODE_MAX_CLUSTER 16
#endif
constexpr int MAX_CLUSTER = GVR_DECODE_MAX_CLUSTER;
/* dynamic shared memory of a cluster launch: rank 0's buffer for C split states, [C][HC][D] O then
 * [C][HC][2] (m, l) floats */
__host__ __device__ constexpr int cluster_state_bytes(int hc, int d) { return hc * d * 4 + hc * 8; }

/* Everything the kernel reads, resolved by the host (decode.cu). Strides in elements. The fields a CTA needs
 * first (its unit and split, q, the entry, length and block-table rows, the caches) come first: a launch's
 * parameters are new to the constant caches, and each 64-byte line of them read is a round trip. */
struct DecodeArgs {
    int Hkv, GQ, nch, S;
    int cl; /* > 1: the S splits of a unit are one cluster of S CTAs: ranks 1.. push their states into rank 0's
             * shared memory (st.async), rank 0 merges them (no workspace, no global round trip) */
    int q_vec; /* q and its strides allow 16-byte loads */
    int n;
    int G;
    int P;
    int max_pages;
    int accumulate;
    int g_shift, p_shift; /* log2 of G / of P when a power of two, else -1 */
    int i32; /* every token position, entry and s * n below 2^31: 32-bit index arithmetic */
    const void *q;
    long long q_sb, q_sh;
    const int32_t *idx;
    long long idx_sb, idx_sh; /* idx_sh already 0 when Hsel == 1 */
    const int32_t *bt; /* NULL: physical slots */
    long long bt_sb;
    const int32_t *lengths;
    const void *k;
    long long k_sp, k_st, k_sh;
    const void *v;
    long long v_sp, v_st, v_sh;
    long long num_pages;
    float qscale; /* scale * k_scale * log2(e) */
    float vscale; /* v_scale */
    void *out;
    int out_dtype;
    int out_vec; /* out (and its strides) allow 16-byte (f32) / 8-byte (f16, bf16) vector access */
    long long out_sb, out_sh;
    float *lse;
    long long lse_sb, lse_sh;
    float *part_out;
    long long po_sb, po_sh, po_se;
    int po_vec; /* part_out allows 16-byte vector stores */
    int part_cta; /* partials through the token path: S == n (one entry per CTA), each CTA's state written as its
                   * entry's partial (the PART instances' sub-warp-per-entry path serves the other plans) */
    float *part_lse;
    long long pl_sb, pl_sh;
    /* prr.repair's fused extras (gvr_attention_params): entries of idx found in the exclusion row skipped,
     * (hits, entries) counted, the final out also written converted into cast */
    const int32_t *xidx; /* NULL: nothing excluded */
    long long x_sb, x_sh; /* x_sh 0 when one exclusion row serves every KV head */
    int nx;
    int ncounts;
    unsigned long long *counts; /* NULL or int64 [ncounts], ncounts 2 or 4: += (hits, entries >= 0) */
    int count_all; /* the idx row is per KV head (Hsel == Hkv): every KV head's unit counts its own row */
    int cast_dtype, cast_vec;
    void *cast;
    long long cast_sb, cast_sh;
    float *ws_o;   /* [units][S][HC][D] */
    float *ws_ml;  /* [units][S][HC][2] */
    int *ws_cnt;   /* [units] */
};

/* CTAs per SM that the registers of an instance with HC heads allow (its __launch_bounds__): the
 * planner sizes the grid to one wave of them */
#ifndef GVR_DECODE_MINB
#define GVR_DECODE_MINB(HC) ((HC) >= 4 ? 2 : 3)
#endif
constexpr int resident_ctas(int hc) { return GVR_DECODE_MINB(hc); }

/* One kernel instance: q element type ELEM (GVR_ELEM_F16 / GVR_ELEM_BF16), K/V element type KVE (ELEM, or
 * GVR_ELEM_E4M3: 8-byte pieces of 8 fp8 values per lane, decoded exactly: e4m3x8_to_f32), head dim D, HC heads
 * per CTA, MODE: DECODE_PLAIN, DECODE_PART (per-entry partial states, one sub-warp per entry) or
 * DECODE_EXTRA (prr.repair's exclusion / counts / cast; compiled out of the other modes: they cost the
 * plain attention 0.25-0.45 us at B=1, H100). Explicitly instantiated in decode_d<D>.cu. */
enum { DECODE_PLAIN = 0, DECODE_PART = 1, DECODE_EXTRA = 2 };
template <int ELEM, int KVE, int D, int HC, int MODE>
struct DecodeInstance {
    /* cluster > 1: clusters of that many CTAs (a.cl), with their dynamic shared memory */
    static cudaError_t launch(const DecodeArgs &a, unsigned grid, int cluster, cudaStream_t stream);
    /* whether clusters of C CTAs can run on device dev (cached per device) */
    static bool cluster_ok(int dev, int C);
};

/* The instances of head dim D (decode_d<D>.cu: q and caches f16 / bf16; decode_d<D>_e4m3.cu: f16 / bf16 q
 * over fp8 caches; compiled in parallel), HC in {1, 2, 4, 8} query heads per CTA, each mode. */
#define GVR_DECODE_INSTANCES(D)                                                                       \
    GVR_DECODE_MODES_(D, GVR_ELEM_F16, GVR_ELEM_F16)                                                  \
    GVR_DECODE_MODES_(D, GVR_ELEM_BF16, GVR_ELEM_BF16)
#define GVR_DECODE_INSTANCES_E4M3(D)                                                                  \
    GVR_DECODE_MODES_(D, GVR_ELEM_F16, GVR_ELEM_E4M3)                                                 \
    GVR_DECODE_MODES_(D, GVR_ELEM_BF16, GVR_ELEM_E4M3)
#define GVR_DECODE_MODES_(D, E, KV)                                                                   \
    GVR_DECODE_HC_(D, E, KV, DECODE_PLAIN)                                                            \
    GVR_DECODE_HC_(D, E, KV, DECODE_PART)                                                             \
    GVR_DECODE_HC_(D, E, KV, DECODE_EXTRA)
#define GVR_DECODE_HC_(D, E, KV, MODE)                                                                \
    template struct DecodeInstance<E, KV, D, 1, MODE>;                                                \
    template struct DecodeInstance<E, KV, D, 2, MODE>;                                                \
    template struct DecodeInstance<E, KV, D, 4, MODE>;                                                \
    template struct DecodeInstance<E, KV, D, 8, MODE>;

/* the kernel's definition: only the instance files (decode_d*.cu) define GVR_DECODE_KERNELS, so that
 * decode.cu (the planner) does not instantiate the kernels again */
#if defined(__CUDACC__) && defined(GVR_DECODE_KERNELS)

namespace detail {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

#ifndef GVR_DECODE_U
#define GVR_DECODE_U(HC) ((HC) <= 4 ? 4 : 2)
#endif
constexpr int min_ctas(int hc) { return resident_ctas(hc); }

__device__ __forceinline__ uint4 ld_nc_v4(const void *p)
{
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

/* 2^x, one MUFU.EX2 (exp2f adds a denormal range fix-up we do not need): ex2(-inf) = +0, NaN stays NaN */
__device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float2 h2f(uint32_t u)
{
    float2 f;
    asm("{\n\t.reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;\n\t}"
        : "=f"(f.x), "=f"(f.y)
        : "r"(u));
    return f;
}

/* 8 elements of 16 bytes to floats */
template <int ELEM>
__device__ __forceinline__ void cvt8(const uint4 r, float f[8])
{
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (ELEM == GVR_ELEM_BF16) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        } else {
            const float2 t = h2f(w[i]);
            f[2 * i] = t.x;
            f[2 * i + 1] = t.y;
        }
    }
}

__device__ __forceinline__ uint2 ld_nc_v2(const void *p)
{
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

/* A lane's piece of a K/V row (8 elements) of element type KVE: its raw type, loads, conversion */
template <int KVE>
struct KVPiece {
    static constexpr int ESZ = 2; /* bytes per element */
    using Raw = uint4;
    static __device__ __forceinline__ Raw load(const void *p) { return ld_nc_v4(p); }
    static __device__ __forceinline__ Raw zero() { return make_uint4(0, 0, 0, 0); }
    static __device__ __forceinline__ void cvt(const Raw r, float f[8]) { cvt8<KVE>(r, f); }
};
template <>
struct KVPiece<GVR_ELEM_E4M3> {
    static constexpr int ESZ = 1;
    using Raw = uint2;
    static __device__ __forceinline__ Raw load(const void *p) { return ld_nc_v2(p); }
    static __device__ __forceinline__ Raw zero() { return make_uint2(0, 0); }
    /* exact (common/fp8.cuh; an integer-only decode -- the byte placed under float's exponent, times 2^120,
     * NaN codes patched -- measured slower on the H100: B=64, 2K tokens 224 us against 164) */
    static __device__ __forceinline__ void cvt(const Raw r, float (&f)[8]) { e4m3x8_to_f32(r, f); }
};

__device__ __forceinline__ uint16_t f2bf(float x)
{
    uint16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ uint16_t f2h(float x)
{
    uint16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

/* 4 floats to out[0..4) of element type dt; vec: 16-byte (f32) or 8-byte (f16/bf16) aligned */
__device__ __forceinline__ void store4(void *out, int dt, bool vec, float4 v)
{
    if (dt == GVR_ELEM_F32) {
        float *o = (float *)out;
        if (vec) {
            *(float4 *)o = v;
        } else {
            o[0] = v.x;
            o[1] = v.y;
            o[2] = v.z;
            o[3] = v.w;
        }
    } else {
        const bool bf = dt == GVR_ELEM_BF16;
        const uint16_t a = bf ? f2bf(v.x) : f2h(v.x), b = bf ? f2bf(v.y) : f2h(v.y);
        const uint16_t c = bf ? f2bf(v.z) : f2h(v.z), d = bf ? f2bf(v.w) : f2h(v.w);
        uint16_t *o = (uint16_t *)out;
        if (vec) {
            *(uint2 *)o = make_uint2((uint32_t)a | ((uint32_t)b << 16), (uint32_t)c | ((uint32_t)d << 16));
        } else {
            o[0] = a;
            o[1] = b;
            o[2] = c;
            o[3] = d;
        }
    }
}

__device__ __forceinline__ float4 load4f(const float *p, bool vec)
{
    if (vec)
        return *(const float4 *)p;
    return make_float4(p[0], p[1], p[2], p[3]);
}

/* x / d and x - (x / d) d for x >= 0, d > 0: 32-bit (a shift when d = 2^sh, sh >= 0) when narrow (x < 2^31
 * and the quotient times d too), else 64-bit (a long call) */
__device__ __forceinline__ long long divmod(long long x, int d, int sh, bool narrow, int &rem)
{
    if (narrow) {
        const unsigned x32 = (unsigned)x, q = sh >= 0 ? x32 >> sh : x32 / (unsigned)d;
        rem = (int)(x32 - q * (unsigned)d);
        return q;
    }
    const long long q = x / d;
    rem = (int)(x - q * d);
    return q;
}

__device__ __forceinline__ float4 fma4(float w, float4 x, float4 acc)
{
    return make_float4(fmaf(w, x.x, acc.x), fmaf(w, x.y, acc.y), fmaf(w, x.z, acc.z), fmaf(w, x.w, acc.w));
}

/* shared memory of one CTA: the token tiles (normal mode) / the sub-warps' running O (partials mode)
 * share storage with the warps' end states (used after a barrier) */
template <int D, int HC, bool PART>
struct Smem {
    static constexpr int L = D / 8, TPW = 32 / L, NSUB = NW * TPW;
    static constexpr int RED = NW * HC * D;                 /* floats: warps' O */
    static constexpr int ACC = PART ? NSUB * HC * D : 0;    /* floats: sub-warps' running O */
    static constexpr int TILEB = 3 * 2 * TILE * 8;          /* bytes: koff, voff, 3 buffers */
    static constexpr int FL = RED > ACC ? RED : ACC;
    static constexpr int BYTES = FL * 4 > TILEB ? FL * 4 : TILEB;
    union U {
        struct {
            long long koff[3][TILE];
            long long voff[3][TILE];
        } tile;
        float red[FL]; /* red[w][h][d] / acc[gsw][h][d] */
    };
    U u;
    int cnt[3][NW];
    uint64_t cl_mb; /* cluster launches, rank 0: the split states' arrival */
    float red_m[NW][HC], red_l[NW][HC];
    float wts[MAX_SPLITS][HC];
    float hM[HC], hL[HC], hPrior[HC];
    int last;
};

} // namespace detail

template <int ELEM, int KVE, int D, int HC, int MODE>
__global__ void __launch_bounds__(THREADS, detail::min_ctas(HC)) gvr_attention_decode_kernel(const DecodeArgs a)
{
    using namespace detail;
    constexpr bool PART = MODE == DECODE_PART, EXT = MODE == DECODE_EXTRA;
    constexpr int L = D / 8;      /* lanes per token */
    constexpr int TPW = 32 / L;   /* tokens per warp step */
    constexpr int NSUB = NW * TPW;
    /* tokens per sub-warp step (fp8 caches too: twice as many, to keep a 2-byte cache's bytes in flight,
     * measured no faster on the H100: B=64 2K 164.1 vs 164.3 us, B=1 8K 19.3 vs 18.8) */
    constexpr int U = GVR_DECODE_U(HC);
    constexpr int SPAN = NW * TPW;                       /* tokens of one unroll slot over the CTA */
    constexpr float NEG_INF = -__builtin_huge_valf();
    using SM = Smem<D, HC, PART>;
    using KV = KVPiece<KVE>;
    using KR = typename KV::Raw;
    constexpr int ESZ = KV::ESZ;
    __shared__ SM sm;

    pdl_enter();
    PROF_RESET();
    PROF_SPAN(0);
    PROF(0);

    const int tid = (int)threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int sw = lane / L, dl = lane % L, d0 = dl * 8;
    const int gsw = w * TPW + sw;

    unsigned bid = blockIdx.x; /* a unit's splits are consecutive CTAs: a cluster's ranks are its splits */
    const int s = (int)(bid % (unsigned)a.S);
    bid /= (unsigned)a.S;
    const int chunk = (int)(bid % (unsigned)a.nch);
    bid /= (unsigned)a.nch;
    const int kvh = (int)(bid % (unsigned)a.Hkv);
    const int b = (int)(bid / (unsigned)a.Hkv);
    const long long unit = ((long long)b * a.Hkv + kvh) * a.nch + chunk;
    const int h0 = chunk * HC;
    const int nh = min(HC, a.GQ - h0); /* valid heads of this chunk */
    const int hq0 = kvh * a.GQ + h0;   /* first query head */
    if (a.cl > 1) { /* rank 0 (s == 0) expects the other ranks' states; they push only after the barrier */
        if (s == 0 && tid == 0) {
            mbar_init(&sm.cl_mb, 1);
            mbar_expect_bytes(&sm.cl_mb, (uint32_t)((a.cl - 1) * cluster_state_bytes(HC, D)));
            fence_mbar_init();
        }
        cluster_arrive_relaxed();
    }

    /* The loads that depend on nothing are issued first and used late (q, lengths[b], the first tiles'
     * entries, below), so that a cold call pays one DRAM round trip for them, not one each. q's raw
     * halves now (element by element: q may have any 2-byte alignment; heads past nh: 0, never
     * written), scaled to floats once the first tile's page loads are out. */
    uint4 qr[HC];
    {
        const char *qb = (const char *)a.q;
#pragma unroll
        for (int h = 0; h < HC; h++) {
            const uint16_t *qe = (const uint16_t *)(qb + 2 * ((long long)b * a.q_sb + (long long)(hq0 + h) * a.q_sh + d0));
            qr[h] = make_uint4(0, 0, 0, 0);
            if (h < nh) {
                if (a.q_vec) {
                    qr[h] = __ldg((const uint4 *)qe);
                } else { /* any 2-byte alignment: element by element (waits here: the rare case) */
                    qr[h].x = (uint32_t)qe[0] | ((uint32_t)qe[1] << 16);
                    qr[h].y = (uint32_t)qe[2] | ((uint32_t)qe[3] << 16);
                    qr[h].z = (uint32_t)qe[4] | ((uint32_t)qe[5] << 16);
                    qr[h].w = (uint32_t)qe[6] | ((uint32_t)qe[7] << 16);
                }
            }
        }
    }
    /* the exclusion row (read through L1 by every thread that checks an entry: a warp's lanes mostly check
     * one entry, so the loads broadcast) */
    const int32_t *xrow = (EXT && a.xidx) ? a.xidx + (long long)b * a.x_sb + (long long)kvh * a.x_sh : nullptr;
    /* (hits, entries >= 0) of this thread's entries: counted once per idx row (the first chunk of KV head 0
     * when one row serves every KV head) */
    const bool counting = EXT && a.counts != nullptr && chunk == 0 && (a.count_all || kvh == 0);
    unsigned nhit = 0, nsel = 0;
    PROF(1);
    const bool blockmode = a.bt != nullptr;
    const int lraw = (blockmode && a.lengths) ? __ldg(a.lengths + b) : 0;
    /* a state to accumulate into: its rows to L2 now (read at the end, after the K/V round trips) */
    if (a.accumulate && s == 0) {
        constexpr int LINES = D * 4 / 128; /* 128-byte lines of one head's float32 row */
        if (tid < HC * LINES && tid / LINES < nh) {
            const char *row = (const char *)a.out + 4 * ((long long)b * a.out_sb + (long long)(hq0 + tid / LINES) * a.out_sh);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(row + 128 * (tid % LINES)));
        }
        if (tid < nh)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(a.lse + (long long)b * a.lse_sb + (long long)(hq0 + tid) * a.lse_sh));
    }
    float q[HC][8];
    auto load_q = [&]() {
#pragma unroll
        for (int h = 0; h < HC; h++) {
            cvt8<ELEM>(qr[h], q[h]);
#pragma unroll
            for (int i = 0; i < 8; i++)
                q[h][i] *= a.qscale;
        }
    };

    /* this split's entries [e0, e1) */
    int unused;
    const long long e0 = divmod((long long)s * a.n, a.S, -1, a.i32, unused);
    const long long e1 = divmod((long long)(s + 1) * a.n, a.S, -1, a.i32, unused);
    const int32_t *irow = a.idx + (long long)b * a.idx_sb + (long long)kvh * a.idx_sh;
    const char *kb = (const char *)a.k + ESZ * ((long long)kvh * a.k_sh + d0);
    const char *vb = (const char *)a.v + ESZ * ((long long)kvh * a.v_sh + d0);
    const int G = a.G, P = a.P;
    const int32_t *btrow = a.bt + (long long)b * a.bt_sb;
    long long len = 0; /* block mode: tokens of the row; slot mode: slots of the cache (set_len) */
    auto set_len = [&]() {
        if (blockmode) {
            const long long cap = (long long)a.max_pages * P;
            len = cap;
            if (a.lengths) {
                const long long l0 = lraw;
                len = l0 < 0 ? 0 : (l0 > cap ? cap : l0);
            }
        } else {
            len = a.num_pages * P;
        }
    };

    /* whether entry x occurs in the exclusion row (x < 0: no); per thread, no warp collectives */
    auto excluded = [&](int x) -> bool {
        bool hit = false;
        if (x >= 0)
            for (int j = 0; j < a.nx; j++)
                hit |= __ldg(xrow + j) == x;
        return hit;
    };

    /* entry x, token i of it -> (page, slot), valid0 (the page still to check); issues the page load */
    auto resolve_issue = [&](int x, int i, int &pg, int &slot) -> bool {
        if (xrow) {
            const bool ex = excluded(x);
            if (counting && i == 0 && x >= 0) {
                nsel++;
                nhit += ex;
            }
            if (ex)
                return false;
        } else if (counting && i == 0 && x >= 0) {
            nsel++;
        }
        if (x < 0)
            return false;
        if (blockmode) {
            const long long t = (long long)x * G + i;
            if (t >= len)
                return false;
            pg = __ldg(btrow + divmod(t, P, a.p_shift, a.i32, slot)); /* i32: t < len <= max_pages * P < 2^31 */
            return true;
        }
        if ((long long)x >= len)
            return false;
        pg = (int)divmod(x, P, a.p_shift, true, slot); /* 0 <= x < len < 2^31 */
        return true;
    };
    auto resolve_finish = [&](bool ok, int pg, int slot, long long &ko, long long &vo) -> bool {
        ok = ok && pg >= 0 && (long long)pg < a.num_pages;
        if (ok) {
            ko = ESZ * ((long long)pg * a.k_sp + (long long)slot * a.k_st);
            vo = ESZ * ((long long)pg * a.v_sp + (long long)slot * a.v_st);
        }
        return ok;
    };

    float o[HC][8], m[HC], l[HC];
#pragma unroll
    for (int h = 0; h < HC; h++) {
        m[h] = NEG_INF;
        l[h] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++)
            o[h][i] = 0.f;
    }

    /* one step of U tokens of this sub-warp (kr/vr: raw K/V, val: token present) */
    auto step = [&](const KR (&kr)[U], const KR (&vr)[U], const bool (&val)[U]) {
        float sc[U][HC];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float kf[8];
            KV::cvt(kr[u], kf);
#pragma unroll
            for (int h = 0; h < HC; h++) {
                float acc = q[h][0] * kf[0];
#pragma unroll
                for (int i = 1; i < 8; i++)
                    acc = fmaf(q[h][i], kf[i], acc);
                sc[u][h] = acc;
            }
        }
        /* the U x HC partial dots summed over the sub-warp's L lanes: a reduce-scatter (each level halves
         * the values a lane holds: 15 shuffles for 16 values instead of 4 x 16), then every lane gathers
         * all sums back (NV shuffles). Value v = u * HC + h; after the scatter lane dl holds the block
         * [gi * NVL, gi * NVL + NVL) with gi = dl / (L / KS). Fixed order: deterministic; a + b and
         * b + a agree, so lanes holding the same value hold the same bits. */
        {
            constexpr int NV = U * HC, KS = NV < L ? NV : L, NVL = NV / KS, REP = L / KS;
            float r[NV];
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int h = 0; h < HC; h++)
                    r[u * HC + h] = sc[u][h];
            constexpr int LEVELS = KS == 32 ? 5 : KS == 16 ? 4 : KS == 8 ? 3 : KS == 4 ? 2 : KS == 2 ? 1 : 0;
            static_assert((1 << LEVELS) == KS, "KS a power of two up to 32");
#pragma unroll
            for (int lv = 0; lv < LEVELS; lv++) {
                const int off = (L / 2) >> lv, half = NV >> (lv + 1);
                /* bitwise selects: a ?: on the two elements would become an indexed (local memory) access */
                const uint32_t up = (dl & off) ? 0xffffffffu : 0u;
#pragma unroll
                for (int j = 0; j < NV / 2; j++) { /* a constant bound, so that both loops unroll */
                    if (j >= half)
                        break;
                    const uint32_t lo = __float_as_uint(r[j]), hi = __float_as_uint(r[j + half]);
                    const float keep = __uint_as_float((lo & ~up) | (hi & up));
                    const float send = __uint_as_float((hi & ~up) | (lo & up));
                    r[j] = keep + __shfl_xor_sync(0xffffffffu, send, off);
                }
            }
#pragma unroll
            for (int off = REP / 2; off >= 1; off >>= 1)
#pragma unroll
                for (int j = 0; j < NVL; j++)
                    r[j] += __shfl_xor_sync(0xffffffffu, r[j], off);
            const int sub0 = lane - dl; /* the sub-warp's first lane */
#pragma unroll
            for (int v = 0; v < NV; v++)
                sc[v / HC][v % HC] = __shfl_sync(0xffffffffu, r[v % NVL], sub0 + (v / NVL) * REP);
        }
        float mu[HC];
#pragma unroll
        for (int h = 0; h < HC; h++) {
            float mx = m[h];
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (!val[u])
                    sc[u][h] = NEG_INF;
                mx = fmaxf(mx, sc[u][h]);
            }
            mu[h] = mx == NEG_INF ? 0.f : mx;
            const float corr = ex2(m[h] - mu[h]);
            m[h] = mx;
            l[h] *= corr;
#pragma unroll
            for (int i = 0; i < 8; i++)
                o[h][i] *= corr;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            float vf[8];
            KV::cvt(vr[u], vf);
#pragma unroll
            for (int h = 0; h < HC; h++) {
                const float p = ex2(sc[u][h] - mu[h]);
                l[h] += p;
                const float pv = p * a.vscale; /* V' = v_scale * V (p exactly when v_scale is 1) */
#pragma unroll
                for (int i = 0; i < 8; i++)
                    o[h][i] = fmaf(pv, vf[i], o[h][i]);
            }
        }
    };

    if constexpr (!PART) {
        /* ---- normal mode: token tiles ---- */
        const long long ntok = (e1 - e0) * G;
        const long long ntiles = (ntok + TILE - 1) / TILE;
        /* stage A of tile t: this thread's entry value and token-in-entry */
        auto stage_a = [&](long long t, int &x, int &i) {
            const long long vv = t * TILE + tid;
            x = -1;
            i = 0;
            if (vv < ntok) {
                const long long e = G != 1 ? divmod(vv, G, a.g_shift, a.i32, i) : vv; /* i32: vv < n * G < 2^31 */
                x = __ldg(irow + e0 + e);
            }
        };
        auto publish = [&](int buf, bool ok, long long ko, long long vo) {
            const unsigned bal = __ballot_sync(0xffffffffu, ok);
            if (ok) {
                const int r = w * 32 + __popc(bal & ((1u << lane) - 1u));
                sm.u.tile.koff[buf][r] = ko;
                sm.u.tile.voff[buf][r] = vo;
            }
            if (lane == 0)
                sm.cnt[buf][w] = __popc(bal);
        };
        /* tile t's loads of K and V at token position `base` of the tile (buffer t % 3, its prefix
         * counts pre): positions past the tile's tokens load its last token again (a valid address,
         * no branch) and are masked (val false, V zeroed) */
        auto load_step = [&](int buf, const int (&pre)[NW + 1], int base, KR (&kr)[U], KR (&vr)[U], bool (&val)[U]) {
            const int total = pre[NW];
#pragma unroll
            for (int u = 0; u < U; u++) {
                int j = base + u * SPAN + gsw;
                val[u] = j < total;
                j = val[u] ? j : total - 1;
                int sl = j;
#pragma unroll
                for (int i = 1; i < NW; i++)
                    if (j >= pre[i])
                        sl = i * 32 + (j - pre[i]);
                kr[u] = KV::load(kb + sm.u.tile.koff[buf][sl]);
                vr[u] = KV::load(vb + sm.u.tile.voff[buf][sl]);
            }
        };
        auto prefix = [&](int buf, int (&pre)[NW + 1]) {
            pre[0] = 0;
#pragma unroll
            for (int i = 0; i < NW; i++)
                pre[i + 1] = pre[i] + sm.cnt[buf][i];
        };
        /* Pipeline over tiles (3 buffers): at iteration t the entry loads of tile t + 3 and the page
         * loads of tile t + 2 are issued, tile t + 1 is published (its page loads were issued at
         * iteration t - 1), and tile t is consumed; each step's K/V loads are issued one step ahead
         * (the first step of tile t + 1 during the last step of tile t). */
        int xa = -1, ia = 0, pg1 = 0, slot1 = 0;
        bool ok1 = false;
        if (ntiles > 0) {
            int x0 = -1, i0 = 0;
            stage_a(0, x0, i0);
            stage_a(1, xa, ia);
            set_len();
            PROF(10);
            int pg = 0, slot = 0;
            long long ko = 0, vo = 0;
            bool ok = resolve_issue(x0, i0, pg, slot);
            PROFV(11, clock64() + (ok ? 0 : 0 * pg));
            ok1 = resolve_issue(xa, ia, pg1, slot1);
            stage_a(2, xa, ia);
            ok = resolve_finish(ok, pg, slot, ko, vo);
            PROFV(12, clock64() + (ok ? 0 : 0 * ko));
            publish(0, ok, ko, vo);
        } else {
            set_len();
        }
        load_q();
        KR pk[U], pv[U];
        bool pval[U];
        bool have_pf = false; /* pk/pv hold the first step of the current tile */
#pragma unroll
        for (int u = 0; u < U; u++) {
            pk[u] = KV::zero();
            pv[u] = KV::zero();
            pval[u] = false;
        }
        for (long long t = 0; t < ntiles; t++) {
            const int cur = (int)(t % 3), nxt = (int)((t + 1) % 3);
            if (t + 1 < ntiles) {
                long long ko = 0, vo = 0;
                const bool ok = resolve_finish(ok1, pg1, slot1, ko, vo);
                publish(nxt, ok, ko, vo);
            }
            if (t + 2 < ntiles)
                ok1 = resolve_issue(xa, ia, pg1, slot1);
            if (t + 3 < ntiles)
                stage_a(t + 3, xa, ia);
            __syncthreads();
            if (t == 0)
                PROF(2);

            int pre[NW + 1], pren[NW + 1];
            prefix(cur, pre);
            if (t + 1 < ntiles)
                prefix(nxt, pren);
            else
#pragma unroll
                for (int i = 0; i <= NW; i++)
                    pren[i] = 0;
            const int total = pre[NW];
            if (!have_pf && total > 0)
                load_step(cur, pre, 0, pk, pv, pval);
            have_pf = false;
            for (int base = 0; base < total; base += SPAN * U) {
                KR kr[U], vr[U];
                bool val[U];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    kr[u] = pk[u];
                    vr[u] = pv[u];
                    val[u] = pval[u];
                }
                if (base + SPAN * U < total) {
                    load_step(cur, pre, base + SPAN * U, pk, pv, pval);
                } else if (pren[NW] > 0) {
                    load_step(nxt, pren, 0, pk, pv, pval);
                    have_pf = true;
                }
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (!val[u])
                        vr[u] = KV::zero(); /* p = 0 times V: keep V finite */
                step(kr, vr, val);
                PROF(3);
            }
        }
        if (EXT && a.counts) { /* this warp's counts: integer sums, any order gives the same */
            const unsigned hs = __reduce_add_sync(0xffffffffu, nhit), ss = __reduce_add_sync(0xffffffffu, nsel);
            if (lane == 0 && ss) {
                atomicAdd(a.counts, (unsigned long long)hs);
                atomicAdd(a.counts + 1, (unsigned long long)ss);
                if (a.ncounts == 4) {
                    atomicAdd(a.counts + 2, (unsigned long long)hs);
                    atomicAdd(a.counts + 3, (unsigned long long)ss);
                }
            }
        }
        PROF(4);
    } else {
        /* ---- partials mode: sub-warp gsw takes entries e0 + gsw, e0 + gsw + NSUB, ... ---- */
        set_len();
        load_q();
        float *acc = sm.u.red + gsw * HC * D + d0; /* acc[gsw][h][d] */
        float mr[HC], lr[HC];
#pragma unroll
        for (int h = 0; h < HC; h++) {
            mr[h] = NEG_INF;
            lr[h] = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i += 4)
                *(float4 *)(acc + h * D + i) = make_float4(0.f, 0.f, 0.f, 0.f);
        }
        const long long rounds = (e1 - e0 + NSUB - 1) / NSUB;
        for (long long r = 0; r < rounds; r++) {
            const long long e = e0 + r * NSUB + gsw;
            const bool ein = e < e1;
            const int x = ein ? __ldg(irow + e) : -1;
#pragma unroll
            for (int h = 0; h < HC; h++) {
                m[h] = NEG_INF;
                l[h] = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    o[h][i] = 0.f;
            }
            for (int i0 = 0; i0 < G; i0 += U) {
                int pg[U], slot[U];
                bool val[U];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    pg[u] = 0;
                    slot[u] = 0;
                    val[u] = i0 + u < G && resolve_issue(x, i0 + u, pg[u], slot[u]);
                }
                KR kr[U], vr[U];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    long long ko = 0, vo = 0;
                    val[u] = resolve_finish(val[u], pg[u], slot[u], ko, vo);
                    kr[u] = KV::zero();
                    vr[u] = KV::zero();
                    if (val[u]) {
                        kr[u] = KV::load(kb + ko);
                        vr[u] = KV::load(vb + vo);
                    }
                }
                step(kr, vr, val);
            }
            /* the entry's own state */
            if (ein) {
#pragma unroll
                for (int h = 0; h < HC; h++) {
                    if (h < nh) {
                        const bool empty = m[h] == NEG_INF;
                        const float inv = empty ? 0.f : 1.f / l[h];
                        const long long hq = hq0 + h;
                        float *po = a.part_out + (long long)b * a.po_sb + hq * a.po_sh + e * a.po_se + d0;
                        const float4 v0 = make_float4(o[h][0] * inv, o[h][1] * inv, o[h][2] * inv, o[h][3] * inv);
                        const float4 v1 = make_float4(o[h][4] * inv, o[h][5] * inv, o[h][6] * inv, o[h][7] * inv);
                        store4(po, GVR_ELEM_F32, a.po_vec, v0);
                        store4(po + 4, GVR_ELEM_F32, a.po_vec, v1);
                        if (dl == 0)
                            a.part_lse[(long long)b * a.pl_sb + hq * a.pl_sh + e] =
                                empty ? NEG_INF : (m[h] + log2f(l[h])) * LN2;
                    }
                }
            }
            /* merged into the sub-warp's running state, entry order */
#pragma unroll
            for (int h = 0; h < HC; h++) {
                const float M = fmaxf(mr[h], m[h]);
                const float Mu = M == NEG_INF ? 0.f : M;
                const float wa = ex2(mr[h] - Mu), wc = ex2(m[h] - Mu);
                lr[h] = wa * lr[h] + wc * l[h];
                mr[h] = M;
#pragma unroll
                for (int i = 0; i < 8; i += 4) {
                    float4 c = *(float4 *)(acc + h * D + i);
                    c.x = wa * c.x + wc * o[h][i];
                    c.y = wa * c.y + wc * o[h][i + 1];
                    c.z = wa * c.z + wc * o[h][i + 2];
                    c.w = wa * c.w + wc * o[h][i + 3];
                    *(float4 *)(acc + h * D + i) = c;
                }
            }
        }
#pragma unroll
        for (int h = 0; h < HC; h++) {
            m[h] = mr[h];
            l[h] = lr[h];
#pragma unroll
            for (int i = 0; i < 8; i += 4) {
                const float4 c = *(const float4 *)(acc + h * D + i);
                o[h][i] = c.x;
                o[h][i + 1] = c.y;
                o[h][i + 2] = c.z;
                o[h][i + 3] = c.w;
            }
        }
    }

    /* ---- sub-warps of the warp, fixed butterfly ---- */
#pragma unroll
    for (int off = L; off < 32; off <<= 1) {
#pragma unroll
        for (int h = 0; h < HC; h++) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[h], off);
            const float lo = __shfl_xor_sync(0xffffffffu, l[h], off);
            const float M = fmaxf(m[h], mo);
            const float Mu = M == NEG_INF ? 0.f : M;
            const float wa = ex2(m[h] - Mu), wc = ex2(mo - Mu);
            l[h] = wa * l[h] + wc * lo;
            m[h] = M;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float oo = __shfl_xor_sync(0xffffffffu, o[h][i], off);
                o[h][i] = wa * o[h][i] + wc * oo;
            }
        }
    }
    /* ---- warps: through shared memory (red shares storage with the tiles / acc: wait for every warp) ---- */
    __syncthreads();
    float *red = sm.u.red;
    if (sw == 0) {
#pragma unroll
        for (int h = 0; h < HC; h++) {
            float *rp = red + (w * HC + h) * D + d0;
            *(float4 *)rp = make_float4(o[h][0], o[h][1], o[h][2], o[h][3]);
            *(float4 *)(rp + 4) = make_float4(o[h][4], o[h][5], o[h][6], o[h][7]);
            if (dl == 0) {
                sm.red_m[w][h] = m[h];
                sm.red_l[w][h] = l[h];
            }
        }
    }
    __syncthreads();
    if (tid < HC) {
        const int h = tid;
        float M = NEG_INF;
#pragma unroll
        for (int i = 0; i < NW; i++)
            M = fmaxf(M, sm.red_m[i][h]);
        const float Mu = M == NEG_INF ? 0.f : M;
        float Ls = 0.f;
#pragma unroll
        for (int i = 0; i < NW; i++) {
            const float wt = ex2(sm.red_m[i][h] - Mu);
            sm.wts[i][h] = wt;
            Ls += wt * sm.red_l[i][h];
        }
        sm.hM[h] = M;
        sm.hL[h] = Ls;
        sm.hPrior[h] = (a.accumulate && a.S == 1 && h < nh)
                           ? a.lse[(long long)b * a.lse_sb + (long long)(hq0 + h) * a.lse_sh]
                           : 0.f;
    }
    __syncthreads();
    PROF(5);

    constexpr int D4 = D / 4, ITEMS = HC * D4;

    /* this CTA's O of head h, elements [4 d4, 4 d4 + 4): the warps' rows of red combined with their weights */
    auto cta_o = [&](int h, int d4) {
        float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < NW; i++)
            O = fma4(sm.wts[i][h], *(const float4 *)(red + (i * HC + h) * D + d4 * 4), O);
        return O;
    };

    if constexpr (!PART) {
        if (a.part_cta) { /* this CTA's one entry (e0 = s): its state alone, normalized, is the entry's partial */
            for (int it = tid; it < ITEMS; it += THREADS) {
                const int h = it / D4, d4 = it - h * D4;
                if (h >= nh)
                    continue;
                const float4 O = cta_o(h, d4);
                const float M = sm.hM[h], Ls = sm.hL[h];
                const bool empty = M == NEG_INF;
                const float inv = empty ? 0.f : 1.f / Ls;
                const long long hq = hq0 + h;
                float *po = a.part_out + (long long)b * a.po_sb + hq * a.po_sh + e0 * a.po_se + d4 * 4;
                store4(po, GVR_ELEM_F32, a.po_vec, make_float4(O.x * inv, O.y * inv, O.z * inv, O.w * inv));
                if (d4 == 0)
                    a.part_lse[(long long)b * a.pl_sb + hq * a.pl_sh + e0] = empty ? NEG_INF : (M + log2f(Ls)) * LN2;
            }
        }
    }

    /* the final state of head h (log2 domain, O unnormalized) into out / lse */
    auto finalize = [&](int h, int d4, float4 O, float M, float Ls, float prior) {
        if (h >= nh)
            return;
        const long long hq = hq0 + h;
        float *lsep = a.lse + (long long)b * a.lse_sb + hq * a.lse_sh;
        const int es = a.out_dtype == GVR_ELEM_F32 ? 4 : 2;
        char *op = (char *)a.out + (long long)es * ((long long)b * a.out_sb + hq * a.out_sh + d4 * 4);
        const bool empty = M == NEG_INF;
        char *cp = (EXT && a.cast) ? (char *)a.cast + (long long)(a.cast_dtype == GVR_ELEM_F32 ? 4 : 2) *
                                                 ((long long)b * a.cast_sb + hq * a.cast_sh + d4 * 4)
                          : nullptr;
        if (!a.accumulate) {
            float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
            float lv = NEG_INF;
            if (!empty) {
                const float inv = 1.f / Ls;
                val = make_float4(O.x * inv, O.y * inv, O.z * inv, O.w * inv);
                lv = (M + log2f(Ls)) * LN2;
            }
            store4(op, a.out_dtype, a.out_vec, val);
            if (cp)
                store4(cp, a.cast_dtype, a.cast_vec, val);
            if (d4 == 0)
                *lsep = lv;
            return;
        }
        if (empty) { /* the prior state stays bit-identical */
            if (cp)
                store4(cp, a.cast_dtype, a.cast_vec, load4f((const float *)op, a.out_vec));
            return;
        }
        const float inv = 1.f / Ls;
        const float4 vnew = make_float4(O.x * inv, O.y * inv, O.z * inv, O.w * inv);
        const float lb = (M + log2f(Ls)) * LN2, la = prior;
        float4 val = vnew;
        float lv = lb;
        if (la != NEG_INF) {
            const float mm = la > lb ? la : lb;
            const float wa = expf(la - mm), wb = expf(lb - mm), ws = wa + wb;
            const float4 va = load4f((const float *)op, a.out_vec);
            val = make_float4((wa * va.x + wb * vnew.x) / ws, (wa * va.y + wb * vnew.y) / ws,
                              (wa * va.z + wb * vnew.z) / ws, (wa * va.w + wb * vnew.w) / ws);
            lv = mm + logf(ws);
        }
        store4(op, GVR_ELEM_F32, a.out_vec, val);
        if (cp)
            store4(cp, a.cast_dtype, a.cast_vec, val);
        if (d4 == 0)
            *lsep = lv;
    };

    if (a.S == 1) {
        for (int it = tid; it < ITEMS; it += THREADS) {
            const int h = it / D4, d4 = it - h * D4;
            const float4 O = cta_o(h, d4);
            finalize(h, d4, O, sm.hM[h], sm.hL[h], sm.hPrior[h]);
        }
        PROF(9);
        PROF_SPAN(1);
        return;
    }

    if (a.cl > 1) {
        /* ---- the unit's splits are this cluster's ranks: ranks > 0 push their state (O over the warps,
         * then m, l per head) into rank 0's slot [rank] and leave; rank 0 writes its own into slot 0, waits
         * for the bytes, and merges in rank order (deterministic) ---- */
        extern __shared__ __align__(16) float cl_buf[];
        const int C = a.cl;
        float *cl_o = cl_buf, *cl_ml = cl_buf + (long long)C * HC * D;
        cluster_wait(); /* rank 0's mbarrier is initialized */
        const uint32_t mb0 = peer_u32(smem_u32(&sm.cl_mb), 0);
        for (int it = tid; it < ITEMS; it += THREADS) {
            const int h = it / D4, d4 = it - h * D4;
            const float4 O = cta_o(h, d4);
            float *dst = cl_o + (s * HC + h) * D + d4 * 4;
            if (s == 0)
                *(float4 *)dst = O;
            else
                st_async_v4(peer_u32(smem_u32(dst), 0),
                            make_uint4(__float_as_uint(O.x), __float_as_uint(O.y), __float_as_uint(O.z), __float_as_uint(O.w)), mb0);
        }
        if (tid < HC) {
            float *dst = cl_ml + (s * HC + tid) * 2;
            if (s == 0) {
                dst[0] = sm.hM[tid];
                dst[1] = sm.hL[tid];
            } else {
                st_async_v2(peer_u32(smem_u32(dst), 0), make_uint2(__float_as_uint(sm.hM[tid]), __float_as_uint(sm.hL[tid])), mb0);
            }
        }
        PROF(6);
        if (s != 0) {
            PROF_SPAN(1);
            return;
        }
        mbar_wait(&sm.cl_mb, 0);
        __syncthreads(); /* slot 0 (this CTA's own writes) */
        for (int it = tid; it < ITEMS; it += THREADS) {
            const int h = it / D4, d4 = it - h * D4;
            float M = NEG_INF;
            for (int r = 0; r < C; r++)
                M = fmaxf(M, cl_ml[(r * HC + h) * 2]);
            const float Mu = M == NEG_INF ? 0.f : M;
            float Ls = 0.f;
            float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int r = 0; r < C; r++) {
                const float wt = ex2(cl_ml[(r * HC + h) * 2] - Mu);
                Ls = fmaf(wt, cl_ml[(r * HC + h) * 2 + 1], Ls);
                O = fma4(wt, *(const float4 *)(cl_o + (r * HC + h) * D + d4 * 4), O);
            }
            const float prior = (a.accumulate && h < nh) ? a.lse[(long long)b * a.lse_sb + (long long)(hq0 + h) * a.lse_sh] : 0.f;
            finalize(h, d4, O, M, Ls, prior);
        }
        PROF(8);
        PROF_SPAN(1);
        return;
    }

    /* ---- S > 1: this split's state to the workspace; the last CTA of the unit merges ---- */
    const long long us = unit * a.S;
    for (int it = tid; it < ITEMS; it += THREADS) {
        const int h = it / D4, d4 = it - h * D4;
        const float4 O = cta_o(h, d4);
        __stcg((float4 *)(a.ws_o + ((us + s) * HC + h) * D + d4 * 4), O);
    }
    if (tid < HC)
        __stcg((float2 *)(a.ws_ml + ((us + s) * HC + tid) * 2), make_float2(sm.hM[tid], sm.hL[tid]));
    /* the writes of every thread ordered before thread 0's count by the barrier and thread 0's fence
     * (fences are cumulative: cooperative groups' grid sync relies on the same) */
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        const int prev = atomicAdd(a.ws_cnt + unit, 1);
        sm.last = prev == a.S - 1;
    }
    __syncthreads();
    PROF(6);
    if (!sm.last) {
        PROF_SPAN(1);
        return;
    }
    __threadfence();
    if (tid == 0)
        a.ws_cnt[unit] = 0; /* every split has arrived: the workspace is zero again after this launch */
    /* this thread's first item's split states, the first MB of them, loaded now: their round trip
     * overlaps the weights' */
    constexpr int MB = 16;
    float4 pre[MB];
    if (tid < ITEMS) {
        const int h = tid / D4, d4 = tid - h * D4;
        const float *src = a.ws_o + (us * HC + h) * D + d4 * 4;
#pragma unroll
        for (int i = 0; i < MB; i++)
            pre[i] = i < a.S ? __ldcg((const float4 *)(src + (long long)i * HC * D)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    /* per head: the splits' maxima and weights, lane i holding splits i and i + 32 (S <= 64), reduced by
     * fixed butterflies (the same tree every time: deterministic) */
    static_assert(MAX_SPLITS <= 64, "two splits per lane");
    for (int h = w; h < HC; h += NW) {
        const float2 *ml = (const float2 *)a.ws_ml + us * HC + h;
        float mv[2], lv[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int si = lane + 32 * k;
            mv[k] = NEG_INF;
            lv[k] = 0.f;
            if (si < a.S) {
                const float2 st = __ldcg(ml + (long long)si * HC);
                mv[k] = st.x;
                lv[k] = st.y;
            }
        }
        float M = fmaxf(mv[0], mv[1]);
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1)
            M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        const float Mu = M == NEG_INF ? 0.f : M;
        float Ls = 0.f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int si = lane + 32 * k;
            const float wt = ex2(mv[k] - Mu);
            if (si < a.S)
                sm.wts[si][h] = wt;
            Ls = fmaf(wt, lv[k], Ls);
        }
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1)
            Ls += __shfl_xor_sync(0xffffffffu, Ls, off);
        if (lane == 0) {
            sm.hM[h] = M;
            sm.hL[h] = Ls;
            sm.hPrior[h] = (a.accumulate && h < nh) ? a.lse[(long long)b * a.lse_sb + (long long)(hq0 + h) * a.lse_sh] : 0.f;
        }
    }
    __syncthreads();
    PROF(7);
    for (int it = tid; it < ITEMS; it += THREADS) {
        const int h = it / D4, d4 = it - h * D4;
        const float *src = a.ws_o + (us * HC + h) * D + d4 * 4;
        float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
        int i0 = 0;
        if (it == tid) {
#pragma unroll
            for (int i = 0; i < MB; i++)
                if (i < a.S)
                    O = fma4(sm.wts[i][h], pre[i], O);
            i0 = MB;
        }
#pragma unroll 8
        for (int i = i0; i < a.S; i++)
            O = fma4(sm.wts[i][h], __ldcg((const float4 *)(src + (long long)i * HC * D)), O);
        finalize(h, d4, O, sm.hM[h], sm.hL[h], sm.hPrior[h]);
    }
    PROF(8);
    PROF_SPAN(1);
}

/* cluster launches: clusters of more than 8 CTAs (non-portable) and rank 0's dynamic shared memory, set
 * once per device */
template <int ELEM, int KVE, int D, int HC, int MODE>
cudaError_t decode_configure(int dev)
{
    static DeviceCache<1> configured;
    if (configured.get(dev, 0))
        return cudaSuccess;
    auto fn = gvr_attention_decode_kernel<ELEM, KVE, D, HC, MODE>;
    cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (MAX_CLUSTER > 1 ? MAX_CLUSTER : 1) * cluster_state_bytes(HC, D));
    if (e == cudaSuccess)
        configured.put(dev, 0, 1);
    return e;
}

template <int ELEM, int KVE, int D, int HC, int MODE>
cudaError_t DecodeInstance<ELEM, KVE, D, HC, MODE>::launch(const DecodeArgs &a, unsigned grid, int cluster, cudaStream_t stream)
{
    size_t dyn = 0;
    if (cluster > 1) {
        int dev = 0;
        cudaError_t e = cudaGetDevice(&dev);
        if (e == cudaSuccess)
            e = decode_configure<ELEM, KVE, D, HC, MODE>(dev);
        if (e != cudaSuccess)
            return e;
        dyn = (size_t)cluster * cluster_state_bytes(HC, D);
    }
    LaunchConfig lc(grid, THREADS, cluster > 1 ? cluster : 0, dyn, stream);
    return cudaLaunchKernelEx(&lc.cfg, gvr_attention_decode_kernel<ELEM, KVE, D, HC, MODE>, a);
}

template <int ELEM, int KVE, int D, int HC, int MODE>
bool DecodeInstance<ELEM, KVE, D, HC, MODE>::cluster_ok(int dev, int C)
{
    static DeviceCache<(MAX_CLUSTER > 1 ? MAX_CLUSTER : 1) + 1> cache; /* 1: yes, 2: no */
    if (C < 2 || C > MAX_CLUSTER)
        return false;
    int v = cache.get(dev, C);
    if (v == 0) {
        int n = 0;
        if (decode_configure<ELEM, KVE, D, HC, MODE>(dev) == cudaSuccess) {
            LaunchConfig lc((unsigned)C, THREADS, C, (size_t)C * cluster_state_bytes(HC, D), nullptr, false);
            if (cudaOccupancyMaxActiveClusters(&n, gvr_attention_decode_kernel<ELEM, KVE, D, HC, MODE>, &lc.cfg) != cudaSuccess)
                n = 0;
        }
        cudaGetLastError(); /* a failed query is not the caller's error */
        v = n > 0 ? 1 : 2;
        cache.put(dev, C, v);
    }
    return v == 1;
}

#endif /* __CUDACC__ && GVR_DECODE_KERNELS */

} // namespace gvr::attn
