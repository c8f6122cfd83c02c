/* states.cu: the attention-state entry points of gvr_kernels.h ("sparse attention, attention states,
 * PRR repair"): gvr_merge_states, gvr_prr_missed, gvr_prr_finalize.
 *
 *  - merge: a group of G lanes of one warp per state (G = the power of two >= the state's chunks,
 *    at most 32), 8 elements per lane and chunk (16-byte loads; f32 two) when D % 8 == 0 and every
 *    pointer and stride allows it, else one element. Lane 0 of the group alone reads la/lb (and
 *    writes lo) and hands them to the group by shuffle; every element is read and then written by
 *    the same lane: in place (vo == va or vb) is safe. The case (empty / copy / NaN / weighted) is a
 *    select, so garbage behind an lse of -inf never reaches the output.
 *  - missed: one CTA per (b, h); predicted's entries >= 0 in an open-addressing hash set in shared
 *    memory (linear probing, load <= 1/2), whole when n_pred <= MISSED_MAX_SET, else rebuilt chunk
 *    by chunk per tile of selected; selected in tiles of 1024 entries, kept entries compacted in
 *    order with a CUB block scan. Reads of a tile come before the scan's barriers and its writes go
 *    to positions <= the tile's end, so out may even be selected itself.
 *  - finalize: one CTA per (b, s, tile of query-head x D-chunk items). The keep mask of a chunk of
 *    2048 predicted entries: a hash table of the chunk (key, smallest entry index) for first
 *    occurrence within the chunk, tables of the earlier chunks (only when n_pred > 2048), a set of
 *    selected (resident when n_sel <= 8192, else chunked); the kept entries compacted in order into
 *    shared memory, then merged by an online softmax in registers (float4 of D per thread, 4 entries
 *    in flight). When a tile's items are fewer than half the CTA, S = 256 / items splits take the
 *    kept entries k = split (mod S) and their states are merged in split order at the end.
 * Everything is a function of the inputs and the shapes only: deterministic. No allocation, no
 * synchronization: graph-safe. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <climits>
#include <cstring>
#include <type_traits>
#include <cstdint>

#include "common/cluster.cuh"
#include "common/device.cuh"
#include "common/launch.cuh"
#include "common/runtime.cuh"
#include "gvr_kernels.h"

#define GVR_API extern "C" __attribute__((visibility("default")))

namespace gvr::states {
namespace {

constexpr unsigned MAX_GRID = 0x7FFFFFFFu;

/* ---- element types ------------------------------------------------------------------------------ */

__device__ __forceinline__ float f_nan() { return __int_as_float(0x7FFFFFFF); }
__device__ __forceinline__ float f_ninf() { return __int_as_float((int)0xFF800000u); }

template <int DT>
struct Elem;

template <>
struct Elem<GVR_ELEM_F32> {
    using T = float;
    static __device__ __forceinline__ void load8(const T *p, float (&v)[8])
    {
        const float4 a = reinterpret_cast<const float4 *>(p)[0], b = reinterpret_cast<const float4 *>(p)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
    static __device__ __forceinline__ void store8(T *p, const float (&v)[8])
    {
        reinterpret_cast<float4 *>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4 *>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
    static __device__ __forceinline__ float load1(const T *p) { return *p; }
    static __device__ __forceinline__ void store1(T *p, float v) { *p = v; }
};

template <>
struct Elem<GVR_ELEM_F16> {
    using T = __half;
    static __device__ __forceinline__ void load8(const T *p, float (&v)[8])
    {
        const uint4 u = *reinterpret_cast<const uint4 *>(p);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            __half2 h;
            memcpy(&h, &w[i], 4);
            const float2 f = __half22float2(h);
            v[2 * i] = f.x, v[2 * i + 1] = f.y;
        }
    }
    static __device__ __forceinline__ void store8(T *p, const float (&v)[8])
    {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
            memcpy(&w[i], &h, 4);
        }
        *reinterpret_cast<uint4 *>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    static __device__ __forceinline__ float load1(const T *p) { return __half2float(*p); }
    static __device__ __forceinline__ void store1(T *p, float v) { *p = __float2half_rn(v); }
};

template <>
struct Elem<GVR_ELEM_BF16> {
    using T = __nv_bfloat16;
    static __device__ __forceinline__ void load8(const T *p, float (&v)[8])
    {
        const uint4 u = *reinterpret_cast<const uint4 *>(p);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            __nv_bfloat162 h;
            memcpy(&h, &w[i], 4);
            const float2 f = __bfloat1622float2(h);
            v[2 * i] = f.x, v[2 * i + 1] = f.y;
        }
    }
    static __device__ __forceinline__ void store8(T *p, const float (&v)[8])
    {
        uint32_t w[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
            memcpy(&w[i], &h, 4);
        }
        *reinterpret_cast<uint4 *>(p) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    static __device__ __forceinline__ float load1(const T *p) { return __bfloat162float(*p); }
    static __device__ __forceinline__ void store1(T *p, float v) { *p = __float2bfloat16_rn(v); }
};

inline int elem_size(int dt) { return dt == GVR_ELEM_F32 ? 4 : 2; }
inline bool valid_dtype(int dt) { return dt == GVR_ELEM_F32 || dt == GVR_ELEM_F16 || dt == GVR_ELEM_BF16; }

/* f(std::integral_constant<int, dt>{}) for a runtime GVR_ELEM_* */
template <class F>
auto visit_dtype(int dt, F &&f)
{
    switch (dt) {
    case GVR_ELEM_F32: return f(std::integral_constant<int, GVR_ELEM_F32>{});
    case GVR_ELEM_F16: return f(std::integral_constant<int, GVR_ELEM_F16>{});
    default: return f(std::integral_constant<int, GVR_ELEM_BF16>{});
    }
}

/* pointer p and strides (elements of esize bytes) allow 16-byte accesses at every state's start;
 * a stride over a dimension of extent 1 never applies */
inline bool aligned16(const void *p, int esize, int64_t s1, int64_t n1, int64_t s2, int64_t n2, int64_t s3 = 0,
                      int64_t n3 = 1)
{
    if (reinterpret_cast<uintptr_t>(p) % 16)
        return false;
    return (n1 <= 1 || (s1 * esize) % 16 == 0) && (n2 <= 1 || (s2 * esize) % 16 == 0) &&
           (n3 <= 1 || (s3 * esize) % 16 == 0);
}

/* ---- merge_states ------------------------------------------------------------------------------- */

constexpr int MERGE_THREADS = 128;

enum { M_WEIGHTED = 0, M_COPY_A = 1, M_COPY_B = 2, M_EMPTY = 3, M_NAN = 4 };

/* chunk c of both inputs: 8 elements (VEC 8) or 1 */
template <class EA, class EB, int VEC>
__device__ __forceinline__ void load_chunk(const typename EA::T *va, const typename EB::T *vb, int c, float (&a)[VEC],
                                           float (&b)[VEC])
{
    if constexpr (VEC == 8) {
        EA::load8(va + c * 8, a);
        EB::load8(vb + c * 8, b);
    } else {
        a[0] = EA::load1(va + c);
        b[0] = EB::load1(vb + c);
    }
}

/* VEC 8: 8-element chunks (D % 8 == 0, aligned), VEC 1: single elements. G lanes per state. */
template <int DA, int DB, int DO, int VEC>
__global__ void __launch_bounds__(MERGE_THREADS) merge_kernel(gvr_merge_params p, int G)
{
    pdl_enter();
    using EA = Elem<DA>;
    using EB = Elem<DB>;
    using EO = Elem<DO>;
    const int lane = (int)(threadIdx.x & 31);
    const int gl = lane & (G - 1); /* lane within the group */
    const unsigned gmask = G == 32 ? 0xFFFFFFFFu : ((1u << G) - 1u) << (lane & ~(G - 1));
    const int spb = MERGE_THREADS / G;
    const int64_t states = p.B * (int64_t)p.H;
    const int nch = p.D / VEC;
    for (int64_t st = (int64_t)blockIdx.x * spb + threadIdx.x / G; st < states; st += (int64_t)gridDim.x * spb) {
        const int64_t b = st / p.H;
        const int h = (int)(st - b * p.H);
        float la = 0.f, lb = 0.f;
        if (gl == 0) {
            la = p.la[b * p.la_stride_b + h * p.la_stride_h];
            lb = p.lb[b * p.lb_stride_b + h * p.lb_stride_h];
        }
        const typename EA::T *va = static_cast<const typename EA::T *>(p.va) + b * p.va_stride_b + h * p.va_stride_h;
        const typename EB::T *vb = static_cast<const typename EB::T *>(p.vb) + b * p.vb_stride_b + h * p.vb_stride_h;
        typename EO::T *vo = static_cast<typename EO::T *>(p.vo) + b * p.vo_stride_b + h * p.vo_stride_h;
        /* the first chunk's values load while la/lb do (one memory round trip, not two): read
         * whatever the case, selected below */
        int c = gl;
        float a[VEC], bb[VEC];
        if (c < nch)
            load_chunk<EA, EB, VEC>(va, vb, c, a, bb);
        la = __shfl_sync(gmask, la, 0, G);
        lb = __shfl_sync(gmask, lb, 0, G);
        const float INF = __int_as_float(0x7F800000);
        int mode;
        float wa = 0.f, wb = 0.f, sum = 1.f, lo = 0.f;
        if (!(la < INF) || !(lb < INF)) { /* NaN or +inf on either side */
            mode = M_NAN;
            lo = f_nan();
        } else if (la == -INF && lb == -INF) {
            mode = M_EMPTY;
            lo = -INF;
        } else if (lb == -INF) {
            mode = M_COPY_A;
            lo = la;
        } else if (la == -INF) {
            mode = M_COPY_B;
            lo = lb;
        } else {
            mode = M_WEIGHTED;
            const float m = fmaxf(la, lb);
            if (p.base2) {
                wa = exp2f(la - m), wb = exp2f(lb - m);
                sum = wa + wb;
                lo = m + log2f(sum);
            } else {
                wa = expf(la - m), wb = expf(lb - m);
                sum = wa + wb;
                lo = m + logf(sum);
            }
        }
        for (; c < nch; c += G) {
            float o[VEC];
            if (c != gl)
                load_chunk<EA, EB, VEC>(va, vb, c, a, bb);
#pragma unroll
            for (int i = 0; i < VEC; i++) {
                switch (mode) {
                case M_WEIGHTED: o[i] = (wa * a[i] + wb * bb[i]) / sum; break;
                case M_COPY_A: o[i] = a[i]; break;
                case M_COPY_B: o[i] = bb[i]; break;
                case M_EMPTY: o[i] = 0.f; break;
                default: o[i] = f_nan(); break;
                }
            }
            if constexpr (VEC == 8)
                EO::store8(vo + c * 8, o);
            else
                EO::store1(vo + c, o[0]);
        }
        if (gl == 0) /* the only reader of la/lb: in place is safe */
            p.lo[b * p.lo_stride_b + h * p.lo_stride_h] = lo;
    }
}

template <int DA, int DB, int DO>
cudaError_t merge_launch(const gvr_merge_params *p, bool vec, cudaStream_t stream)
{
    const int nch = vec ? p->D / 8 : p->D;
    int G = 1;
    while (G < nch && G < 32)
        G *= 2;
    const int spb = MERGE_THREADS / G;
    const int64_t states = p->B * (int64_t)p->H;
    const int64_t blocks64 = (states + spb - 1) / spb;
    const unsigned blocks = blocks64 > MAX_GRID ? MAX_GRID : (unsigned)blocks64;
    LaunchConfig lc(blocks, MERGE_THREADS, 0, 0, stream);
    if (vec)
        return cudaLaunchKernelEx(&lc.cfg, merge_kernel<DA, DB, DO, 8>, *p, G);
    return cudaLaunchKernelEx(&lc.cfg, merge_kernel<DA, DB, DO, 1>, *p, G);
}

/* ---- hash sets in shared memory ------------------------------------------------------------------ */

/* Open addressing of int32 keys >= 0 (-1 = free slot), linear probing, 2^bits slots, never more
 * than half full: probes always end. The set's content (not its layout) is all anyone reads, so
 * the order of concurrent inserts changes nothing. */
__device__ __forceinline__ uint32_t hash_slot(int x, int bits) { return ((uint32_t)x * 0x9E3779B1u) >> (32 - bits); }

__device__ __forceinline__ uint32_t set_insert(int *keys, int bits, int x)
{
    const uint32_t mask = (1u << bits) - 1u;
    uint32_t s = hash_slot(x, bits);
    for (;;) {
        const int old = atomicCAS(&keys[s], -1, x);
        if (old == -1 || old == x)
            return s;
        s = (s + 1) & mask;
    }
}

/* the slot holding x, or -1 */
__device__ __forceinline__ int set_find(const int *keys, int bits, int x)
{
    const uint32_t mask = (1u << bits) - 1u;
    uint32_t s = hash_slot(x, bits);
    for (;;) {
        const int k = keys[s];
        if (k == x)
            return (int)s;
        if (k == -1)
            return -1;
        s = (s + 1) & mask;
    }
}

__device__ __forceinline__ void smem_fill(int *a, int n, int v)
{
    for (int i = (int)threadIdx.x; i < n; i += (int)blockDim.x)
        a[i] = v;
}

/* the set of the entries >= 0 of row[lo, hi) (hi - lo <= half the slots); barriers around */
__device__ __forceinline__ void set_build(int *keys, int bits, const int32_t *row, int lo, int hi)
{
    __syncthreads();
    smem_fill(keys, 1 << bits, -1);
    __syncthreads();
    constexpr int BATCH = 8; /* loads in flight before the inserts */
    for (int e0 = lo + (int)threadIdx.x; e0 < hi; e0 += BATCH * (int)blockDim.x) {
        int x[BATCH];
#pragma unroll
        for (int i = 0; i < BATCH; i++) {
            const int e = e0 + i * (int)blockDim.x;
            x[i] = e < hi ? row[e] : -1;
        }
#pragma unroll
        for (int i = 0; i < BATCH; i++)
            if (x[i] >= 0)
                set_insert(keys, bits, x[i]);
    }
    __syncthreads();
}

/* the smallest power of two >= 2n, at least 64, as log2 */
inline int table_bits(int64_t n)
{
    int bits = 6;
    while ((int64_t{1} << bits) < 2 * n)
        bits++;
    return bits;
}

/* cudaFuncAttributeMaxDynamicSharedMemorySize = bytes for kernel fn on device dev, once per device
 * (a static per instantiation of the caller's template) */
template <class K>
cudaError_t allow_smem(DeviceCache<1> &done, int dev, K fn, int bytes)
{
    if (done.get(dev, 0))
        return cudaSuccess;
    const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess)
        done.put(dev, 0, 1);
    return e;
}

/* ---- prr_missed --------------------------------------------------------------------------------- */

constexpr int MISSED_THREADS = 256;
constexpr int MISSED_ITEMS = 4;                              /* selected entries per thread and tile */
constexpr int MISSED_TILE = MISSED_THREADS * MISSED_ITEMS;   /* 1024 */
constexpr int MISSED_MAX_SET = 16384;                        /* predicted entries per set: 128 KB */
constexpr int MISSED_MAX_BITS = 15;

__global__ void __launch_bounds__(MISSED_THREADS) missed_kernel(gvr_missed_params p, int bits)
{
    pdl_enter();
    using Scan = cub::BlockScan<int, MISSED_THREADS>;
    __shared__ typename Scan::TempStorage scan_tmp;
    extern __shared__ int set[];
    const int half = 1 << (bits - 1); /* predicted entries per set */
    const bool resident = p.n_pred <= half;
    const int64_t rows = (int64_t)p.B * p.H;
    long long n_valid = 0, n_missed = 0; /* this thread's valid entries; thread 0: the missed ones */
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const int64_t b = row / p.H;
        const int h = (int)(row - b * p.H);
        const int32_t *sel = p.selected + b * p.sel_stride_b + h * p.sel_stride_h;
        const int32_t *pred = p.predicted + b * p.pred_stride_b + (p.Hp == 1 ? 0 : h) * p.pred_stride_h;
        int32_t *out = p.out + b * p.out_stride_b + h * p.out_stride_h;
        if (resident)
            set_build(set, bits, pred, 0, p.n_pred);
        int count = 0;
        for (int t0 = 0; t0 < p.n_sel; t0 += MISSED_TILE) {
            int x[MISSED_ITEMS], f[MISSED_ITEMS], pos[MISSED_ITEMS];
#pragma unroll
            for (int i = 0; i < MISSED_ITEMS; i++) {
                const int e = t0 + (int)threadIdx.x * MISSED_ITEMS + i;
                x[i] = e < p.n_sel ? sel[e] : -1;
                f[i] = x[i] >= 0;
                n_valid += f[i];
            }
            if (resident) {
#pragma unroll
                for (int i = 0; i < MISSED_ITEMS; i++)
                    if (f[i] && set_find(set, bits, x[i]) >= 0)
                        f[i] = 0;
            } else {
                for (int c0 = 0; c0 < p.n_pred; c0 += half) {
                    set_build(set, bits, pred, c0, p.n_pred - c0 < half ? p.n_pred : c0 + half);
#pragma unroll
                    for (int i = 0; i < MISSED_ITEMS; i++)
                        if (f[i] && set_find(set, bits, x[i]) >= 0)
                            f[i] = 0;
                }
            }
            int total;
            Scan(scan_tmp).ExclusiveSum(f, pos, total); /* its barriers: the whole tile is read */
#pragma unroll
            for (int i = 0; i < MISSED_ITEMS; i++)
                if (f[i])
                    out[count + pos[i]] = x[i];
            count += total;
            __syncthreads(); /* scan_tmp and the set are reused */
        }
        if (threadIdx.x == 0)
            n_missed += count;
        for (int i = count + (int)threadIdx.x; i < p.n_sel; i += MISSED_THREADS)
            out[i] = -1;
        __syncthreads();
    }
    if (p.counts) { /* hits = valid - missed; per warp one atomic of each (two's complement adds) */
        long long hits = n_valid - n_missed, valid = n_valid;
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) {
            hits += __shfl_xor_sync(0xffffffffu, hits, off);
            valid += __shfl_xor_sync(0xffffffffu, valid, off);
        }
        if ((threadIdx.x & 31) == 0) {
            unsigned long long *c = (unsigned long long *)p.counts;
            atomicAdd(c + 0, (unsigned long long)hits);
            atomicAdd(c + 2, (unsigned long long)hits);
            atomicAdd(c + 1, (unsigned long long)valid);
            atomicAdd(c + 3, (unsigned long long)valid);
        }
    }
}

/* ---- prr_finalize ------------------------------------------------------------------------------- */

constexpr int FIN_THREADS = 256;
constexpr int FIN_ITEMS = 8;                                 /* predicted entries per thread and chunk */
constexpr int FIN_CHUNK = FIN_THREADS * FIN_ITEMS;           /* 2048 */
constexpr int FIN_SEL_MAX = 8192;                            /* selected entries per set */
constexpr int FIN_UNROLL = 4;                                /* partial states in flight per thread */

/* dynamic shared memory: pred keys, pred first index (2^pbits each), selected keys (2^sbits), kept list */
inline size_t fin_smem(int pbits, int sbits)
{
    return (size_t)(2 << pbits) * 4 + (size_t)(1 << sbits) * 4 + (size_t)FIN_CHUNK * 4;
}
constexpr int FIN_MAX_SMEM = (2 << 12) * 4 + (1 << 14) * 4 + FIN_CHUNK * 4; /* pbits 12, sbits 14: 104 KB */

template <int VEC>
struct Vf {
    float v[VEC];
};

/* online-softmax state of one item (a query head x VEC elements of D) */
template <int VEC>
struct OState {
    float m, s;
    float a[VEC];
};

/* merge state (m2, s2, a2) into st; -inf guard: an empty side contributes nothing */
template <int VEC>
__device__ __forceinline__ void ostate_merge(OState<VEC> &st, float m2, float s2, const float (&a2)[VEC])
{
    const float mn = fmaxf(st.m, m2);
    if (mn == f_ninf())
        return;
    const float c1 = expf(st.m - mn); /* 0 when st.m == -inf */
    if (m2 == f_ninf()) {
        st.s *= c1;
#pragma unroll
        for (int i = 0; i < VEC; i++)
            st.a[i] *= c1;
    } else {
        const float c2 = expf(m2 - mn);
        st.s = st.s * c1 + s2 * c2;
#pragma unroll
        for (int i = 0; i < VEC; i++)
            st.a[i] = st.a[i] * c1 + a2[i] * c2;
    }
    st.m = mn;
}

template <int VEC, int DO>
__global__ void __launch_bounds__(FIN_THREADS, 1) finalize_kernel(gvr_finalize_params p, int pbits, int sbits, int tiles)
{
    pdl_enter();
    using Scan = cub::BlockScan<int, FIN_THREADS>;
    using EO = Elem<DO>;
    __shared__ typename Scan::TempStorage scan_tmp;
    __shared__ float sp_m[FIN_THREADS], sp_s[FIN_THREADS], sp_a[VEC][FIN_THREADS];
    extern __shared__ int smem[];
    int *pkeys = smem;
    int *pfirst = smem + (1 << pbits);
    int *skeys = smem + (2 << pbits);
    int *kept = skeys + (1 << sbits);

    const int tid = (int)threadIdx.x;
    const int g = p.Hq / p.Hsel;
    const int L = VEC == 1 ? (p.D > 0 ? p.D : 1) : (p.D > 0 ? p.D / VEC : 1); /* chunks of D (1 when D == 0) */
    const int I = g * L;                                                       /* items per (b, s) */
    const bool sel_resident = p.n_sel <= (1 << (sbits - 1));
    const int64_t ctas = (int64_t)p.B * p.Hsel * tiles;
    for (int64_t cta = blockIdx.x; cta < ctas; cta += gridDim.x) {
        const int64_t row = cta / tiles;
        const int tile = (int)(cta - row * tiles);
        const int64_t b = row / p.Hsel;
        const int s = (int)(row - b * p.Hsel);
        const int32_t *pred = p.predicted + b * p.pred_stride_b + s * p.pred_stride_h;
        const int32_t *sel = p.selected + b * p.sel_stride_b + s * p.sel_stride_h;

        /* this thread's item and split */
        const int i0 = tile * FIN_THREADS;
        const int Ic = I - i0 < FIN_THREADS ? I - i0 : FIN_THREADS;
        const int S = Ic <= FIN_THREADS / 2 ? FIN_THREADS / Ic : 1;
        const int split = tid / Ic;
        const bool active = split < S;
        const int item = i0 + tid % Ic;
        const int hq = s * g + item / L; /* query head */
        const int c = item % L;
        const bool has_data = p.D > 0;
        const float *po = p.part_out + b * p.part_out_stride_b + (int64_t)hq * p.part_out_stride_h + c * VEC;
        const float *pl = p.part_lse + b * p.part_lse_stride_b + (int64_t)hq * p.part_lse_stride_h;
        OState<VEC> st;
        st.m = f_ninf();
        st.s = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; i++)
            st.a[i] = 0.f;

        if (sel_resident && p.n_pred > 0)
            set_build(skeys, sbits, sel, 0, p.n_sel);
        for (int c0 = 0; c0 < p.n_pred; c0 += FIN_CHUNK) {
            const int c1 = p.n_pred - c0 < FIN_CHUNK ? p.n_pred : c0 + FIN_CHUNK;
            int x[FIN_ITEMS], f[FIN_ITEMS], pos[FIN_ITEMS];
#pragma unroll
            for (int i = 0; i < FIN_ITEMS; i++) {
                const int e = c0 + tid * FIN_ITEMS + i;
                x[i] = e < c1 ? pred[e] : -1;
                f[i] = x[i] >= 0;
            }
            /* an occurrence in an earlier chunk */
            for (int j0 = 0; j0 < c0; j0 += FIN_CHUNK) {
                set_build(pkeys, pbits, pred, j0, j0 + FIN_CHUNK);
#pragma unroll
                for (int i = 0; i < FIN_ITEMS; i++)
                    if (f[i] && set_find(pkeys, pbits, x[i]) >= 0)
                        f[i] = 0;
            }
            /* an earlier occurrence within the chunk: the smallest index per key */
            __syncthreads();
            smem_fill(pkeys, 1 << pbits, -1);
            smem_fill(pfirst, 1 << pbits, INT_MAX);
            __syncthreads();
            int slot[FIN_ITEMS];
#pragma unroll
            for (int i = 0; i < FIN_ITEMS; i++) {
                slot[i] = 0;
                if (f[i]) {
                    slot[i] = (int)set_insert(pkeys, pbits, x[i]);
                    atomicMin(&pfirst[slot[i]], c0 + tid * FIN_ITEMS + i);
                }
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < FIN_ITEMS; i++)
                if (f[i] && pfirst[slot[i]] != c0 + tid * FIN_ITEMS + i)
                    f[i] = 0;
            /* occurs in selected */
            if (sel_resident) {
#pragma unroll
                for (int i = 0; i < FIN_ITEMS; i++)
                    if (f[i] && set_find(skeys, sbits, x[i]) < 0)
                        f[i] = 0;
            } else {
                int in[FIN_ITEMS] = {};
                const int half = 1 << (sbits - 1);
                for (int q0 = 0; q0 < p.n_sel; q0 += half) {
                    set_build(skeys, sbits, sel, q0, p.n_sel - q0 < half ? p.n_sel : q0 + half);
#pragma unroll
                    for (int i = 0; i < FIN_ITEMS; i++)
                        if (f[i] && !in[i] && set_find(skeys, sbits, x[i]) >= 0)
                            in[i] = 1;
                }
#pragma unroll
                for (int i = 0; i < FIN_ITEMS; i++)
                    f[i] &= in[i];
            }
            int nk;
            Scan(scan_tmp).ExclusiveSum(f, pos, nk);
#pragma unroll
            for (int i = 0; i < FIN_ITEMS; i++)
                if (f[i])
                    kept[pos[i]] = c0 + tid * FIN_ITEMS + i;
            __syncthreads();

            /* merge this split's kept entries k = split (mod S), in order, FIN_UNROLL at a time */
            if (active) {
                for (int k = split; k < nk; k += S * FIN_UNROLL) {
                    float l[FIN_UNROLL];
                    Vf<VEC> v[FIN_UNROLL];
#pragma unroll
                    for (int u = 0; u < FIN_UNROLL; u++) {
                        const int kk = k + u * S;
                        l[u] = f_ninf();
                        if (kk < nk) {
                            const int e = kept[kk];
                            l[u] = pl[e];
                            const float *q = po + (int64_t)e * p.part_out_stride_e;
                            if (!has_data) {
                                v[u].v[0] = 0.f;
                            } else if constexpr (VEC == 4) {
                                const float4 t = *reinterpret_cast<const float4 *>(q);
                                v[u].v[0] = t.x, v[u].v[1] = t.y, v[u].v[2] = t.z, v[u].v[3] = t.w;
                            } else {
                                v[u].v[0] = *q;
                            }
                        }
                    }
                    float mn = st.m;
#pragma unroll
                    for (int u = 0; u < FIN_UNROLL; u++)
                        mn = fmaxf(mn, l[u]); /* ignores NaN: it reaches s through its weight */
                    if (mn == f_ninf())
                        continue;
                    const float sc = expf(st.m - mn);
                    st.s *= sc;
#pragma unroll
                    for (int i = 0; i < VEC; i++)
                        st.a[i] *= sc;
#pragma unroll
                    for (int u = 0; u < FIN_UNROLL; u++) {
                        if (l[u] != f_ninf()) { /* select: an empty entry's values never reach the sum */
                            const float w = expf(l[u] - mn);
                            st.s += w;
#pragma unroll
                            for (int i = 0; i < VEC; i++)
                                st.a[i] = fmaf(w, v[u].v[i], st.a[i]);
                        }
                    }
                    st.m = mn;
                }
            }
            __syncthreads(); /* kept, scan_tmp, the tables are reused */
        }

        /* the splits' states, merged in split order */
        if (S > 1) {
            if (active) {
                sp_m[tid] = st.m;
                sp_s[tid] = st.s;
#pragma unroll
                for (int i = 0; i < VEC; i++)
                    sp_a[i][tid] = st.a[i];
            }
            __syncthreads();
            if (split == 0) {
                for (int k = 1; k < S; k++) {
                    const int t = k * Ic + tid;
                    float a2[VEC];
#pragma unroll
                    for (int i = 0; i < VEC; i++)
                        a2[i] = sp_a[i][t];
                    ostate_merge(st, sp_m[t], sp_s[t], a2);
                }
            }
            __syncthreads(); /* sp_* reused by the next CTA of the loop */
        }
        if (split == 0) {
            const bool empty = st.m == f_ninf();
            typename EO::T *o = static_cast<typename EO::T *>(p.out) + b * p.out_stride_b + (int64_t)hq * p.out_stride_h;
            if (has_data) {
#pragma unroll
                for (int i = 0; i < VEC; i++)
                    EO::store1(o + c * VEC + i, empty ? 0.f : st.a[i] / st.s);
            }
            if (c == 0)
                p.lse[b * p.lse_stride_b + (int64_t)hq * p.lse_stride_h] = empty ? f_ninf() : st.m + logf(st.s);
        }
    }
}

template <int VEC, int DO>
cudaError_t finalize_launch(const gvr_finalize_params *p, int dev, cudaStream_t stream)
{
    const int pbits = table_bits(p->n_pred < FIN_CHUNK ? p->n_pred : FIN_CHUNK);
    const int sbits = table_bits(p->n_sel < FIN_SEL_MAX ? p->n_sel : FIN_SEL_MAX);
    const int g = p->Hq / p->Hsel;
    const int L = p->D > 0 ? p->D / VEC : 1;
    const int64_t I = (int64_t)g * L;
    const int tiles = (int)((I + FIN_THREADS - 1) / FIN_THREADS);
    const int64_t ctas = (int64_t)p->B * p->Hsel * tiles;
    const size_t smem = fin_smem(pbits, sbits);
    static DeviceCache<1> done;
    cudaError_t e = allow_smem(done, dev, finalize_kernel<VEC, DO>, FIN_MAX_SMEM);
    if (e != cudaSuccess)
        return e;
    LaunchConfig lc(ctas > MAX_GRID ? MAX_GRID : (unsigned)ctas, FIN_THREADS, 0, smem, stream);
    return cudaLaunchKernelEx(&lc.cfg, finalize_kernel<VEC, DO>, *p, pbits, sbits, tiles);
}

} // namespace
} // namespace gvr::states

using namespace gvr::states;

GVR_API int gvr_merge_states(const gvr_merge_params *p, void *stream)
{
    if (p->B <= 0 || p->H <= 0)
        return 0;
    if (p->D < 0 || !valid_dtype(p->dtype_a) || !valid_dtype(p->dtype_b) || !valid_dtype(p->dtype_out))
        return gvr::set_message(1, "gvr_merge_states: bad D or dtype");
    const bool vec = p->D % 8 == 0 && p->D > 0 &&
                     aligned16(p->va, elem_size(p->dtype_a), p->va_stride_b, p->B, p->va_stride_h, p->H) &&
                     aligned16(p->vb, elem_size(p->dtype_b), p->vb_stride_b, p->B, p->vb_stride_h, p->H) &&
                     aligned16(p->vo, elem_size(p->dtype_out), p->vo_stride_b, p->B, p->vo_stride_h, p->H);
    const cudaError_t e = visit_dtype(p->dtype_a, [&](auto a) {
        return visit_dtype(p->dtype_b, [&](auto b) {
            return visit_dtype(p->dtype_out, [&](auto o) {
                return merge_launch<decltype(a)::value, decltype(b)::value, decltype(o)::value>(p, vec,
                                                                                                (cudaStream_t)stream);
            });
        });
    });
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_merge_states: kernel launch", e);
}

GVR_API int gvr_prr_missed(const gvr_missed_params *p, void *stream)
{
    if (p->counts) { /* this call's counts start at 0 (a memset node when captured) */
        const cudaError_t e = cudaMemsetAsync(p->counts, 0, 2 * sizeof(int64_t), (cudaStream_t)stream);
        if (e != cudaSuccess)
            return gvr::set_error("gvr_prr_missed: cudaMemsetAsync", e);
    }
    if (p->B <= 0 || p->H <= 0 || p->n_sel <= 0)
        return 0;
    if (p->n_pred < 0 || (p->Hp != 1 && p->Hp != p->H))
        return gvr::set_message(1, "gvr_prr_missed: bad n_pred or Hp");
    int dev = 0;
    cudaError_t e = gvr::current_device(&dev);
    if (e != cudaSuccess)
        return gvr::set_error("gvr_prr_missed: cudaGetDevice", e);
    const int bits = table_bits(p->n_pred < MISSED_MAX_SET ? p->n_pred : MISSED_MAX_SET);
    static gvr::DeviceCache<1> done;
    e = allow_smem(done, dev, missed_kernel, (1 << MISSED_MAX_BITS) * 4);
    if (e != cudaSuccess)
        return gvr::set_error("gvr_prr_missed: cudaFuncSetAttribute", e);
    const int64_t rows = (int64_t)p->B * p->H;
    gvr::LaunchConfig lc(rows > MAX_GRID ? MAX_GRID : (unsigned)rows, MISSED_THREADS, 0, (size_t)4 << bits,
                         (cudaStream_t)stream);
    e = cudaLaunchKernelEx(&lc.cfg, missed_kernel, *p, bits);
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prr_missed: kernel launch", e);
}

GVR_API int gvr_prr_finalize(const gvr_finalize_params *p, void *stream)
{
    if (p->B <= 0 || p->Hq <= 0)
        return 0;
    if (p->Hsel <= 0 || p->Hq % p->Hsel || p->n_pred < 0 || p->n_sel < 0 || p->D < 0 || !valid_dtype(p->out_dtype))
        return gvr::set_message(1, "gvr_prr_finalize: bad Hsel, n_pred, n_sel, D or out_dtype");
    int dev = 0;
    cudaError_t e = gvr::current_device(&dev);
    if (e != cudaSuccess)
        return gvr::set_error("gvr_prr_finalize: cudaGetDevice", e);
    const bool vec = p->D % 4 == 0 && p->D > 0 &&
                     aligned16(p->part_out, 4, p->part_out_stride_b, p->B, p->part_out_stride_h, p->Hq,
                               p->part_out_stride_e, p->n_pred);
    e = visit_dtype(p->out_dtype, [&](auto o) {
        return vec ? finalize_launch<4, decltype(o)::value>(p, dev, (cudaStream_t)stream)
                   : finalize_launch<1, decltype(o)::value>(p, dev, (cudaStream_t)stream);
    });
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prr_finalize: kernel launch", e);
}
