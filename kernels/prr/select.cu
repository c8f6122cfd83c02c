/* select.cu: PRR's selection stage (gvr_kernels.h, "PRR selection stage"): gvr_prr_block_metadata
 * (Quest block metadata, build and in-place update) and gvr_prr_block_scores.
 *
 *  - metadata: a CTA of 128 threads per (row b, KV head h, split); a split takes the ranges of R
 *    blocks (R*G ~ 256 tokens) r = split, split + S, ... of the row's blocks to write ([0, Nb) when
 *    building; [start/G, ceil(end/G)) when updating). Thread (c, tg) reads the 16-byte chunk c (8
 *    channels; 16 of an fp8 cache) of the tokens tg, tg + TG, ... of a block (4 loads in flight),
 *    keeping per packed pair (fp8: quadruple) of channels the smallest and largest totalOrder key
 *    (__vminu2 / __vmaxu2 on keys made by two xors -- fp8's byte keys spread over 16-bit lanes: exact,
 *    independent of the order). The TG partial ranges meet in shared memory (double
 *    buffered: one barrier per block, __syncthreads_or also telling whether the block had a token)
 *    and the threads of token group 0 write the block with 16-byte stores. The block containing
 *    start in an update is merged with its content (read, channel 0 included, before the barrier:
 *    the same CTA writes that block after it). S is a function of the shapes and the SM count only
 *    (enough CTAs to fill the device when building; fewer when updating, where most rows touch one
 *    block). Exact, so the split never shows in the result.
 *  - scores: a CTA of 256 threads per (row b, KV head h, tile of blocks): the GQA group's query rows
 *    converted to float into shared memory once per CTA; L = D/8 lanes per block (32 / L blocks per
 *    warp), each lane reading its 16-byte chunk (8 bytes of fp8 metadata, decoded exactly) of the
 *    block's min and max rows once and forming its
 *    8-channel partial for every query head left to right (__fmul_rn, __fadd_rn: no FMA), the
 *    chunks summed by an xor butterfly (offsets L/2 .. 1: lane c < o adds lane c + o, the tree of
 *    gvr_kernels.h; lanes above get the same bits, addition being commutative), the heads combined
 *    in order. The same arithmetic in the same order as csrc/cpu/prr_select_cpu.c: bit for bit. With
 *    raw_scores the same lane also stores the score before the keep ranges (one pass for both).
 * No allocation, no synchronization, no host reads: graph-safe; deterministic. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/cluster.cuh"
#include "common/device.cuh"
#include "common/fp8.cuh"
#include "common/launch.cuh"
#include "common/runtime.cuh"
#include "gvr_kernels.h"

#define GVR_API extern "C" __attribute__((visibility("default")))

namespace gvr::prr_select {
namespace {

constexpr unsigned MAX_GRID = 0x7FFFFFFFu;

__device__ __forceinline__ float f_inf() { return __int_as_float(0x7F800000); }
__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

/* ---- totalOrder keys of packed 16-bit pairs ----------------------------------------------------- */

/* per 16-bit half: sign set -> xor 0xFFFF, else xor 0x8000 (keys compare as unsigned ints) */
__device__ __forceinline__ uint32_t key2(uint32_t w)
{
    const uint32_t s = (w >> 15) & 0x00010001u;
    return w ^ ((s * 0x7FFFu) | 0x80008000u);
}

/* inverse: key's top bit set (a positive value) -> xor 0x8000, else xor 0xFFFF */
__device__ __forceinline__ uint32_t unkey2(uint32_t k)
{
    const uint32_t s = (~k >> 15) & 0x00010001u;
    return k ^ ((s * 0x7FFFu) | 0x80008000u);
}

__device__ __forceinline__ uint32_t key16(uint32_t h) { return (h ^ ((h & 0x8000u) ? 0xFFFFu : 0x8000u)) & 0xFFFFu; }

/* the same per byte (fp8 e4m3fn: sign-magnitude bytes) */
__device__ __forceinline__ uint32_t key4(uint32_t w)
{
    const uint32_t s = (w >> 7) & 0x01010101u;
    return w ^ ((s * 0x7Fu) | 0x80808080u);
}
__device__ __forceinline__ uint32_t unkey4(uint32_t k)
{
    const uint32_t s = (~k >> 7) & 0x01010101u;
    return k ^ ((s * 0x7Fu) | 0x80808080u);
}
__device__ __forceinline__ uint32_t key8(uint32_t b) { return (b ^ ((b & 0x80u) ? 0xFFu : 0x80u)) & 0xFFu; }

/* Keys of EB-byte elements, kept in 16-bit lanes (min/max by __vminu2 / __vmaxu2, one instruction each
 * on sm_90; there is no 8-bit SIMD min/max, and __vminu4 expands to a dozen bit operations): a thread's
 * 16-byte chunk is W words of keys -- EB 2: the 4 words as they are; EB 1 (fp8): each word's 4 byte keys
 * spread over 2 words (bytes 0, 1 and 2, 3 zero-extended to 16 bits). fold<false> / fold<true> fold a raw
 * word (index i of the chunk) in; narrow gives raw word i back from the keys; key0: a row's channel 0. */
template <int EB>
struct Keys {
    static constexpr int W = EB == 2 ? 4 : 8;
    /* m's lanes of word i: their minimum (MAX false) or maximum with raw's keys */
    template <bool MAX>
    static __device__ __forceinline__ void fold(uint32_t (&m)[W], int i, uint32_t raw)
    {
        auto f = [](uint32_t a, uint32_t b) { return MAX ? __vmaxu2(a, b) : __vminu2(a, b); };
        if constexpr (EB == 2) {
            m[i] = f(m[i], key2(raw));
        } else {
            const uint32_t k = key4(raw);
            m[2 * i] = f(m[2 * i], __byte_perm(k, 0u, 0x4140u));
            m[2 * i + 1] = f(m[2 * i + 1], __byte_perm(k, 0u, 0x4342u));
        }
    }
    static __device__ __forceinline__ uint32_t narrow(const uint32_t (&m)[W], int i)
    {
        if constexpr (EB == 2)
            return unkey2(m[i]);
        else
            return unkey4(__byte_perm(m[2 * i], m[2 * i + 1], 0x6420u));
    }
    static __device__ __forceinline__ uint32_t key0(const char *row)
    {
        return EB == 2 ? key16(*reinterpret_cast<const uint16_t *>(row)) : key8(*reinterpret_cast<const uint8_t *>(row));
    }
};

/* ---- metadata ------------------------------------------------------------------------------------ */

constexpr int META_THREADS = 128;
constexpr int META_UNROLL = 4;
constexpr int META_RANGE_TOKENS = 256; /* tokens per range of blocks (R = max(1, this / G)) */

/* C: 16-byte chunks per row (D * EB / 16), EB: bytes per element (2: f16 / bf16, 1: fp8 e4m3fn) */
template <int C, int EB>
__global__ void __launch_bounds__(META_THREADS) meta_kernel(gvr_block_meta_params p, int S, int R, uint32_t pinf2)
{
    pdl_enter();
    using K = Keys<EB>;
    constexpr int TG = META_THREADS / C, CH = 16 / EB; /* channels per chunk */
    constexpr int W = K::W, WQ = W / 4;                /* key words per chunk, as uint4s */
    __shared__ uint4 red_mn[2][TG][C][WQ], red_mx[2][TG][C][WQ];
    const int tid = (int)threadIdx.x, c = tid % C, tg = tid / C;
    const int64_t cap = (int64_t)p.max_pages * p.P;
    const int G = p.block_size, P = p.P;
    const uint32_t ninf2 = pinf2 | (EB == 2 ? 0x80008000u : 0x80808080u);
    const int64_t items = (int64_t)p.B * p.Hkv * S;
    int buf = 0;
    for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
        const int64_t row = it / S;
        const int split = (int)(it - row * S);
        const int64_t b = row / p.Hkv;
        const int h = (int)(row - b * p.Hkv);
        /* tokens fit in int32 (max_pages * P does: the intake checks it) */
        int s = 0, e = p.end ? (int)clamp64(p.end[b], 0, cap) : (int)cap, j0 = 0, j1 = p.Nb;
        if (p.start) {
            s = (int)clamp64(p.start[b], 0, cap);
            if (e <= s)
                continue;
            j0 = s / G;
            j1 = (int)(((int64_t)e + G - 1) / G);
            j1 = j1 < p.Nb ? j1 : p.Nb;
        }
        const int32_t *bt = p.block_table + b * p.bt_stride_b;
        const char *kb = static_cast<const char *>(p.k) + EB * (h * p.k_stride_head + c * CH);
        char *mb = static_cast<char *>(p.meta) + EB * (b * p.meta_stride_b + h * p.meta_stride_h + c * CH);
        const int nr = (j1 - j0 + R - 1) / R;
        for (int r = split; r < nr; r += S) {
            const int jr1 = j0 + (r + 1) * R < j1 ? j0 + (r + 1) * R : j1;
            for (int j = j0 + r * R; j < jr1; j++) {
                const int64_t jg = (int64_t)j * G;
                const int lo = jg > s ? (int)jg : s, hi = jg + G < e ? (int)(jg + G) : e;
                const bool merge = jg < s;
                char *m0 = mb + EB * (j * p.meta_stride_j), *m1 = m0 + EB * p.meta_stride_m;
                uint32_t mn[W], mx[W];
#pragma unroll
                for (int i = 0; i < W; i++)
                    mn[i] = 0xFFFFFFFFu, mx[i] = 0u;
                int any = 0;
                for (int t0 = lo + tg; t0 < hi; t0 += TG * META_UNROLL) {
                    uint4 v[META_UNROLL];
                    bool ok[META_UNROLL];
#pragma unroll
                    for (int u = 0; u < META_UNROLL; u++) {
                        const int t = t0 + u * TG;
                        ok[u] = false;
                        if (t < hi) {
                            const int64_t page = __ldg(bt + t / P);
                            if (page >= 0 && page < p.num_pages) {
                                ok[u] = true;
                                v[u] = __ldg(reinterpret_cast<const uint4 *>(
                                    kb + EB * (page * p.k_stride_page + (int64_t)(t % P) * p.k_stride_tok)));
                            }
                        }
                    }
#pragma unroll
                    for (int u = 0; u < META_UNROLL; u++) {
                        if (ok[u]) {
                            any = 1;
                            const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                K::template fold<false>(mn, i, w[i]);
                                K::template fold<true>(mx, i, w[i]);
                            }
                        }
                    }
                }
                /* the existing content of a merged block, read before the barrier (channel 0 is
                 * written after it by the thread of chunk 0) */
                bool had = false;
                uint4 o0 = make_uint4(0, 0, 0, 0), o1 = o0;
                if (merge && tg == 0) {
                    had = K::key0(m0 - EB * c * CH) <= K::key0(m1 - EB * c * CH);
                    if (had) {
                        o0 = *reinterpret_cast<const uint4 *>(m0);
                        o1 = *reinterpret_cast<const uint4 *>(m1);
                    }
                }
#pragma unroll
                for (int q = 0; q < WQ; q++) {
                    red_mn[buf][tg][c][q] = make_uint4(mn[4 * q], mn[4 * q + 1], mn[4 * q + 2], mn[4 * q + 3]);
                    red_mx[buf][tg][c][q] = make_uint4(mx[4 * q], mx[4 * q + 1], mx[4 * q + 2], mx[4 * q + 3]);
                }
                any = __syncthreads_or(any);
                if (tg == 0) {
                    for (int g = 1; g < TG; g++) {
#pragma unroll
                        for (int q = 0; q < WQ; q++) {
                            const uint4 a = red_mn[buf][g][c][q], z = red_mx[buf][g][c][q];
                            mn[4 * q] = __vminu2(mn[4 * q], a.x), mn[4 * q + 1] = __vminu2(mn[4 * q + 1], a.y);
                            mn[4 * q + 2] = __vminu2(mn[4 * q + 2], a.z), mn[4 * q + 3] = __vminu2(mn[4 * q + 3], a.w);
                            mx[4 * q] = __vmaxu2(mx[4 * q], z.x), mx[4 * q + 1] = __vmaxu2(mx[4 * q + 1], z.y);
                            mx[4 * q + 2] = __vmaxu2(mx[4 * q + 2], z.z), mx[4 * q + 3] = __vmaxu2(mx[4 * q + 3], z.w);
                        }
                    }
                    if (!(merge && !any)) { /* a merged block without new tokens keeps its content */
                        if (had) {
                            const uint32_t a[4] = {o0.x, o0.y, o0.z, o0.w}, z[4] = {o1.x, o1.y, o1.z, o1.w};
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                K::template fold<false>(mn, i, a[i]);
                                K::template fold<true>(mx, i, z[i]);
                            }
                        }
                        uint4 w0, w1;
                        if (any) {
                            w0 = make_uint4(K::narrow(mn, 0), K::narrow(mn, 1), K::narrow(mn, 2), K::narrow(mn, 3));
                            w1 = make_uint4(K::narrow(mx, 0), K::narrow(mx, 1), K::narrow(mx, 2), K::narrow(mx, 3));
                        } else {
                            w0 = make_uint4(pinf2, pinf2, pinf2, pinf2);
                            w1 = make_uint4(ninf2, ninf2, ninf2, ninf2);
                        }
                        *reinterpret_cast<uint4 *>(m0) = w0;
                        *reinterpret_cast<uint4 *>(m1) = w1;
                    }
                }
                buf ^= 1;
            }
        }
    }
}

template <int C, int EB>
cudaError_t meta_launch(const gvr_block_meta_params *p, int sms, cudaStream_t stream)
{
    const int G = p->block_size;
    const int R = G >= META_RANGE_TOKENS ? 1 : META_RANGE_TOKENS / G;
    const int64_t rows = (int64_t)p->B * p->Hkv;
    const int64_t ranges = (p->Nb + R - 1) / R;
    /* CTAs to aim for: 16 per SM when building (every block is written), 2 per SM when updating
     * (most rows touch a block or two) */
    const int64_t want = (int64_t)sms * (p->start ? 2 : 16);
    int64_t S = (want + rows - 1) / rows;
    S = S < 1 ? 1 : S > ranges ? ranges : S;
    const int64_t ctas = rows * S;
    /* an empty block's min (+inf; fp8, without infinities: +NaN 0x7F), its max the same with the sign */
    const uint32_t pinf2 = p->dtype == GVR_ELEM_F16 ? 0x7C007C00u : p->dtype == GVR_ELEM_BF16 ? 0x7F807F80u : 0x7F7F7F7Fu;
    LaunchConfig lc(ctas > MAX_GRID ? MAX_GRID : (unsigned)ctas, META_THREADS, 0, 0, stream);
    return cudaLaunchKernelEx(&lc.cfg, meta_kernel<C, EB>, *p, (int)S, R, pinf2);
}

/* ---- scores -------------------------------------------------------------------------------------- */

constexpr int SC_THREADS = 256;
constexpr int SC_PASSES = 4; /* block slots of the CTA per tile */

template <int DT>
__device__ __forceinline__ void unpack8(const uint4 u, float (&f)[8])
{
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if constexpr (DT == GVR_ELEM_F16) {
            __half2 h;
            memcpy(&h, &w[i], 4);
            const float2 x = __half22float2(h);
            f[2 * i] = x.x, f[2 * i + 1] = x.y;
        } else {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        }
    }
}

template <int DT>
__device__ __forceinline__ float to_float(uint16_t h)
{
    if constexpr (DT == GVR_ELEM_F16)
        return __half2float(__ushort_as_half(h));
    else
        return __uint_as_float((uint32_t)h << 16);
}

/* a lane's 8 meta channels: 16 bytes (f16 / bf16) or 8 (fp8 e4m3fn), decoded exactly */
template <int MDT>
struct MetaPiece {
    static constexpr int EB = 2;
    using Raw = uint4;
    static __device__ __forceinline__ Raw load(const char *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }
    static __device__ __forceinline__ Raw zero() { return make_uint4(0, 0, 0, 0); }
    static __device__ __forceinline__ uint32_t key0(const Raw r) { return key16(r.x & 0xFFFFu); }
    static __device__ __forceinline__ void unpack(const Raw r, float (&f)[8]) { unpack8<MDT>(r, f); }
};
template <>
struct MetaPiece<GVR_ELEM_E4M3> {
    static constexpr int EB = 1;
    using Raw = uint2;
    static __device__ __forceinline__ Raw load(const char *p) { return __ldg(reinterpret_cast<const uint2 *>(p)); }
    static __device__ __forceinline__ Raw zero() { return make_uint2(0, 0); }
    static __device__ __forceinline__ uint32_t key0(const Raw r) { return key8(r.x & 0xFFu); }
    static __device__ __forceinline__ void unpack(const Raw r, float (&f)[8]) { e4m3x8_to_f32(r, f); }
};

/* the score of block j from its metadata pieces (min mnr, max mxr; L lanes), written by the block's lane 0 */
template <int DT, int MDT, int L>
__device__ __forceinline__ void score_block(const gvr_block_scores_params &p, const float *qs, int GQ,
                                            const typename MetaPiece<MDT>::Raw mnr, const typename MetaPiece<MDT>::Raw mxr,
                                            int64_t j, int64_t nb, int c, int lane, float *out, float *raw)
{
    using MP = MetaPiece<MDT>;
    constexpr int D = 8 * L;
    const bool valid = j < nb; /* nb <= Nb */
    int empty = c == 0 && MP::key0(mnr) > MP::key0(mxr);
    empty = __shfl_sync(0xFFFFFFFFu, empty, lane & ~(L - 1));
    float mn[8], mx[8];
    MP::unpack(mnr, mn);
    MP::unpack(mxr, mx);
    float r = 0.f;
    for (int g = 0; g < GQ; g++) {
        const float4 qa = reinterpret_cast<const float4 *>(qs + g * D + c * 8)[0];
        const float4 qb = reinterpret_cast<const float4 *>(qs + g * D + c * 8)[1];
        const float qv[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float a = __fmul_rn(qv[i], mx[i]), z = __fmul_rn(qv[i], mn[i]);
            const float t = (a > z || isnan(a)) ? a : z;
            acc = i == 0 ? t : __fadd_rn(acc, t);
        }
#pragma unroll
        for (int o = L / 2; o >= 1; o /= 2)
            acc = __fadd_rn(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, o));
        if (g == 0)
            r = acc;
        else if (p.group_reduce == GVR_GROUP_SUM)
            r = __fadd_rn(r, acc);
        else
            r = (acc > r || isnan(acc)) ? acc : r;
    }
    if (j < p.Nb && c == 0) {
        const float unforced = (!valid || empty) ? -f_inf() : r;
        const bool keep = valid && !empty && (j < p.keep_first || j >= nb - p.keep_last);
        out[j] = keep ? f_inf() : unforced;
        if (raw)
            raw[j] = unforced;
    }
}

/* L = D / 8 lanes per block; DT: q's element type, MDT: meta's (DT or fp8 e4m3fn); SAME: min and max are one
 * tensor (forecast_select's compressed keys, a stride-0 view): one load per piece, and the pieces of all
 * SC_PASSES_SAME passes loaded first, before the row length and q (a short-lived CTA with one piece per lane
 * in flight reads ~1.7 TB/s at B 8). Quest's metadata (two pieces a block): QA passes in flight, loaded after
 * q, within 48 registers (five CTAs an SM; more passes ahead cost occupancy: measured slower). */
constexpr int SC_PASSES_SAME = 8;
constexpr int QA = 2; /* Quest: passes whose pieces are loaded together (2: -3% at B 8 within 48 registers; 4: slower) */
template <int DT, int MDT, int L, bool SAME>
__global__ void __launch_bounds__(SC_THREADS, SAME ? 4 : 5) scores_kernel(gvr_block_scores_params p, int tiles)
{
    using MP = MetaPiece<MDT>;
    constexpr int MEB = MP::EB;
    pdl_enter();
    extern __shared__ float4 qsm4[];
    float *qs = reinterpret_cast<float *>(qsm4);
    constexpr int PASSES = SAME ? SC_PASSES_SAME : SC_PASSES;
    constexpr int D = 8 * L, BPW = 32 / L, BPC = (SC_THREADS / 32) * BPW, TILE = BPC * PASSES;
    const int tid = (int)threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c = lane % L, slot = warp * BPW + lane / L;
    const int GQ = p.Hq / p.Hkv;
    const int64_t G = p.block_size, W = p.window > 1 ? p.window : 1;
    const int64_t items = (int64_t)p.B * p.Hkv * tiles;
    for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
        const int64_t row = it / tiles;
        const int tile = (int)(it - row * tiles);
        const int64_t b = row / p.Hkv;
        const int h = (int)(row - b * p.Hkv);
        typename MP::Raw w[SAME ? PASSES : 1];
        if constexpr (SAME) { /* blocks j < Nb: allocated; those past the row's count are masked later */
            const char *mrow = static_cast<const char *>(p.meta) + MEB * (b * p.meta_stride_b + h * p.meta_stride_h);
#pragma unroll
            for (int pass = 0; pass < PASSES; pass++) {
                const int64_t j = (int64_t)tile * TILE + pass * BPC + slot;
                w[pass] = j < p.Nb ? MP::load(mrow + MEB * (j * p.meta_stride_j + c * 8)) : MP::zero();
            }
        }
        const int64_t len = p.lengths ? (int64_t)max(p.lengths[b], 0) : W - 1 + (int64_t)p.Nb * G;
        const int64_t nb = len >= W ? min((len - W) / G + 1, (int64_t)p.Nb) : 0;
        if (p.counts && tile == 0 && tid == 0)
            p.counts[b * p.counts_stride_b + h * p.counts_stride_h] = (int32_t)nb;
        __syncthreads(); /* qs of the previous item read */
        const uint16_t *q = static_cast<const uint16_t *>(p.q) + b * p.q_stride_b + (int64_t)h * GQ * p.q_stride_h;
        for (int i = tid; i < GQ * D; i += SC_THREADS) {
            const int g = i / D, d = i - g * D;
            qs[i] = to_float<DT>(q[g * p.q_stride_h + d]);
        }
        __syncthreads();
        float *out = p.scores + b * p.scores_stride_b + h * p.scores_stride_h;
        float *raw = p.raw_scores ? p.raw_scores + b * p.raw_stride_b + h * p.raw_stride_h : nullptr;
        if constexpr (SAME) {
#pragma unroll
            for (int pass = 0; pass < PASSES; pass++)
                score_block<DT, MDT, L>(p, qs, GQ, w[pass], w[pass], (int64_t)tile * TILE + pass * BPC + slot, nb,
                                        c, lane, out, raw);
        } else {
            const char *mrow = static_cast<const char *>(p.meta) + MEB * (b * p.meta_stride_b + h * p.meta_stride_h);
#pragma unroll 1
            for (int p0 = 0; p0 < PASSES; p0 += QA) {
                typename MP::Raw wmn[QA], wmx[QA];
#pragma unroll
                for (int a = 0; a < QA; a++) {
                    const int64_t j = (int64_t)tile * TILE + (p0 + a) * BPC + slot;
                    wmn[a] = wmx[a] = MP::zero();
                    if (j < nb) {
                        const char *m0 = mrow + MEB * (j * p.meta_stride_j + c * 8);
                        wmn[a] = MP::load(m0);
                        wmx[a] = MP::load(m0 + MEB * p.meta_stride_m);
                    }
                }
#pragma unroll
                for (int a = 0; a < QA; a++)
                    score_block<DT, MDT, L>(p, qs, GQ, wmn[a], wmx[a], (int64_t)tile * TILE + (p0 + a) * BPC + slot, nb,
                                            c, lane, out, raw);
            }
        }
    }
}

template <int DT, int MDT, int L, bool SAME>
cudaError_t scores_launch_as(const gvr_block_scores_params *p, cudaStream_t stream)
{
    constexpr int BPC = (SC_THREADS / 32) * (32 / L), TILE = BPC * (SAME ? SC_PASSES_SAME : SC_PASSES);
    const int tiles = (p->Nb + TILE - 1) / TILE;
    const int64_t ctas = (int64_t)p->B * p->Hkv * tiles;
    const size_t smem = (size_t)(p->Hq / p->Hkv) * 8 * L * sizeof(float);
    LaunchConfig lc(ctas > MAX_GRID ? MAX_GRID : (unsigned)ctas, SC_THREADS, 0, smem, stream);
    return cudaLaunchKernelEx(&lc.cfg, scores_kernel<DT, MDT, L, SAME>, *p, tiles);
}

template <int DT, int MDT, int L>
cudaError_t scores_launch(const gvr_block_scores_params *p, cudaStream_t stream)
{
    return p->meta_stride_m == 0 ? scores_launch_as<DT, MDT, L, true>(p, stream)
                                 : scores_launch_as<DT, MDT, L, false>(p, stream);
}

} // namespace
} // namespace gvr::prr_select

using namespace gvr::prr_select;

GVR_API int gvr_prr_block_metadata(const gvr_block_meta_params *p, void *stream)
{
    if (p->B <= 0 || p->Hkv <= 0 || p->Nb <= 0)
        return 0;
    if ((p->dtype != GVR_ELEM_F16 && p->dtype != GVR_ELEM_BF16 && p->dtype != GVR_ELEM_E4M3) ||
        (p->D != 64 && p->D != 128 && p->D != 256) || p->block_size <= 0 || p->P <= 0)
        return gvr::set_message(1, "gvr_prr_block_metadata: bad dtype, D, block_size or P");
    int dev = 0, sms = 0;
    cudaError_t e = gvr::current_device(&dev);
    if (e == cudaSuccess)
        e = gvr::sm_count(dev, &sms);
    if (e != cudaSuccess)
        return gvr::set_error("gvr_prr_block_metadata: device query", e);
    const cudaStream_t s = (cudaStream_t)stream;
    if (p->dtype == GVR_ELEM_E4M3)
        e = p->D == 64 ? meta_launch<4, 1>(p, sms, s) : p->D == 128 ? meta_launch<8, 1>(p, sms, s) : meta_launch<16, 1>(p, sms, s);
    else
        e = p->D == 64 ? meta_launch<8, 2>(p, sms, s) : p->D == 128 ? meta_launch<16, 2>(p, sms, s) : meta_launch<32, 2>(p, sms, s);
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prr_block_metadata: kernel launch", e);
}

GVR_API int gvr_prr_block_scores(const gvr_block_scores_params *p, void *stream)
{
    if (p->B <= 0 || p->Hkv <= 0 || p->Nb <= 0)
        return 0;
    if ((p->dtype != GVR_ELEM_F16 && p->dtype != GVR_ELEM_BF16) || (p->meta_dtype != p->dtype && p->meta_dtype != GVR_ELEM_E4M3) ||
        (p->D != 64 && p->D != 128 && p->D != 256) || p->Hq <= 0 || p->Hq % p->Hkv ||
        p->Hq / p->Hkv > GVR_PRR_SCORES_MAX_GQA || p->block_size <= 0)
        return gvr::set_message(1, "gvr_prr_block_scores: bad dtype, meta dtype, D, Hq / Hkv or block_size");
    const cudaStream_t s = (cudaStream_t)stream;
    cudaError_t e;
    const bool f8 = p->meta_dtype == GVR_ELEM_E4M3;
    if (p->dtype == GVR_ELEM_F16)
        e = f8 ? (p->D == 64    ? scores_launch<GVR_ELEM_F16, GVR_ELEM_E4M3, 8>(p, s)
                  : p->D == 128 ? scores_launch<GVR_ELEM_F16, GVR_ELEM_E4M3, 16>(p, s)
                                : scores_launch<GVR_ELEM_F16, GVR_ELEM_E4M3, 32>(p, s))
               : (p->D == 64    ? scores_launch<GVR_ELEM_F16, GVR_ELEM_F16, 8>(p, s)
                  : p->D == 128 ? scores_launch<GVR_ELEM_F16, GVR_ELEM_F16, 16>(p, s)
                                : scores_launch<GVR_ELEM_F16, GVR_ELEM_F16, 32>(p, s));
    else
        e = f8 ? (p->D == 64    ? scores_launch<GVR_ELEM_BF16, GVR_ELEM_E4M3, 8>(p, s)
                  : p->D == 128 ? scores_launch<GVR_ELEM_BF16, GVR_ELEM_E4M3, 16>(p, s)
                                : scores_launch<GVR_ELEM_BF16, GVR_ELEM_E4M3, 32>(p, s))
               : (p->D == 64    ? scores_launch<GVR_ELEM_BF16, GVR_ELEM_BF16, 8>(p, s)
                  : p->D == 128 ? scores_launch<GVR_ELEM_BF16, GVR_ELEM_BF16, 16>(p, s)
                                : scores_launch<GVR_ELEM_BF16, GVR_ELEM_BF16, 32>(p, s));
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prr_block_scores: kernel launch", e);
}
