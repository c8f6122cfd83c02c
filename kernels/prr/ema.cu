/* ema.cu: the EMA predictor entry points of gvr_kernels.h ("PRR EMA predictor and calibration"):
 * gvr_prr_ema_predict, gvr_prr_ema_update, gvr_prr_ema_calibrate(_workspace_size).
 *
 * Every float32 expression uses __fmul_rn / __fadd_rn / __fsub_rn (never contracted into an FMA), in
 * the order of the header: the state and the predictions equal the C path (csrc/cpu/prr_ema_cpu.c)
 * bit for bit.
 *
 *  - predict: one CTA per (row, chunk of PRED_CHUNK blocks), a plain elementwise pass; row_len by
 *    chunk 0's thread 0.
 *  - update: one CTA per row (b, h): every thread reads known, a barrier, thread 0 writes the new
 *    count, then the row's blocks (no other CTA touches the row, so the read precedes the write).
 *  - calibrate, two launches:
 *    1. truth: one warp per step t >= 1: the row's keys in shared memory, the Top-kk threshold and
 *       tie cut by a warp radix select (the bits shared by the row's extreme keys skipped, then
 *       8-bit digits, a 256-bin shared histogram per warp, only the candidates that match the digits
 *       found so far counted, an early exit when a bin is taken whole), the entries of S_t in ascending
 *       index order (ballot compaction) into the workspace, m_t (warp min) and den_t (the canonical
 *       sum: lane l over e = l, l+32, ..., then the shuffle tree with offsets 1, 2, 4, 8, 16).
 *    2. grid: one CTA per grid point (512 threads, the state of E = N/512 blocks per thread in
 *       registers). Steps go in chunks of S (<= 16, as shared memory allows): phase A runs the
 *       recurrence for the chunk's S steps (prediction keys of each step into shared memory [S][N],
 *       then the update with that step's scores; the next step's scores loaded one step ahead), phase
 *       B gives each of the chunk's steps to one warp: the warp radix select of the prediction's
 *       Top-kk, the numerator over S_t's entries (canonical order, as den_t) and hit_t into shared
 *       memory; thread 0 adds the chunk's hits in step order. The selects of a chunk's steps run
 *       concurrently, the recurrence stays sequential.
 * Everything is a function of the inputs and the shapes only: deterministic, and the float64 sums
 * are taken in the order the CPU path takes them (the same bits). No allocation, no synchronization. */
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cluster.cuh"
#include "common/device.cuh"
#include "common/gvr_keys.h"
#include "common/launch.cuh"
#include "common/runtime.cuh"
#include "gvr_kernels.h"

#define GVR_API extern "C" __attribute__((visibility("default")))

namespace gvr::ema {
namespace {

constexpr unsigned MAX_GRID = 0x7FFFFFFFu;

__device__ __forceinline__ float f_ninf() { return __int_as_float((int)0xFF800000u); }
__device__ __forceinline__ float f_pinf() { return __int_as_float(0x7F800000); }

__device__ __forceinline__ int32_t clamp_i32(int32_t v, int32_t lo, int32_t hi) { return v < lo ? lo : v > hi ? hi : v; }

/* ---- the expressions (gvr_kernels.h; the same order as csrc/cpu/prr_ema_cpu.c) -------------- */

__device__ __forceinline__ float ema_predict1(float L, float T, float phi) { return __fadd_rn(L, __fmul_rn(phi, T)); }

__device__ __forceinline__ void ema_update1(float &L, float &T, float s, float alpha, float om, float beta, float ob,
                                            float phi)
{
    if (!(s > f_ninf())) /* -inf or NaN: not observed */
        return;
    if (L == f_ninf()) {
        L = s;
        T = 0.0f;
        return;
    }
    const float t = __fmul_rn(phi, T);
    const float f = __fadd_rn(L, t);
    const float Ln = __fadd_rn(__fmul_rn(alpha, s), __fmul_rn(om, f));
    const float d = __fsub_rn(Ln, L);
    T = __fadd_rn(__fmul_rn(beta, d), __fmul_rn(ob, t));
    L = Ln;
}

__device__ __forceinline__ void ema_new1(float &L, float &T, float s)
{
    L = s > f_ninf() ? s : f_ninf();
    T = 0.0f;
}

/* ---- predict / update -------------------------------------------------------------------------- */

constexpr int ROW_THREADS = 256;
constexpr int PRED_CHUNK = ROW_THREADS * 8;

__global__ void __launch_bounds__(ROW_THREADS) predict_kernel(gvr_ema_params p, int chunks)
{
    pdl_enter();
    const int64_t units = (int64_t)p.B * p.H * chunks;
    for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
        const int64_t row = u / chunks;
        const int c = (int)(u - row * chunks);
        const int64_t b = row / p.H, h = row - b * p.H;
        const int32_t nb = clamp_i32(p.nblocks[b], 0, p.N);
        const int32_t kn = clamp_i32(p.known[b * p.known_stride_b + h * p.known_stride_h], 0, nb);
        const float *L = p.level + b * p.level_stride_b + h * p.level_stride_h;
        const float *T = p.trend + b * p.trend_stride_b + h * p.trend_stride_h;
        float *out = p.pred + b * p.pred_stride_b + h * p.pred_stride_h;
        const int32_t end = (int32_t)min((int64_t)p.W, (int64_t)(c + 1) * PRED_CHUNK);
        for (int32_t j = c * PRED_CHUNK + (int)threadIdx.x; j < end; j += ROW_THREADS)
            out[j] = j < kn ? ema_predict1(L[j], T[j], p.phi) : j < nb ? f_pinf() : f_ninf();
        if (c == 0 && threadIdx.x == 0)
            p.row_len[b * p.row_len_stride_b + h * p.row_len_stride_h] = nb < p.W ? nb : p.W;
    }
}

__global__ void __launch_bounds__(ROW_THREADS) update_kernel(gvr_ema_params p)
{
    pdl_enter();
    const int64_t rows = (int64_t)p.B * p.H;
    const float alpha = p.alpha, beta = p.beta, phi = p.phi;
    const float om = __fsub_rn(1.0f, alpha), ob = __fsub_rn(1.0f, beta);
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const int64_t b = row / p.H, h = row - b * p.H;
        int32_t nu = clamp_i32(p.nblocks[b], 0, p.N);
        nu = nu < p.Ns ? nu : p.Ns;
        int32_t *known = p.known + b * p.known_stride_b + h * p.known_stride_h;
        const int32_t kn = clamp_i32(*known, 0, nu);
        __syncthreads(); /* every thread has read known */
        if (threadIdx.x == 0)
            *known = nu;
        float *L = p.level + b * p.level_stride_b + h * p.level_stride_h;
        float *T = p.trend + b * p.trend_stride_b + h * p.trend_stride_h;
        const float *s = p.scores + b * p.scores_stride_b + h * p.scores_stride_h;
        for (int32_t j = (int)threadIdx.x; j < nu; j += ROW_THREADS) {
            float l = L[j], t = T[j];
            if (j < kn)
                ema_update1(l, t, s[j], alpha, om, beta, ob, phi);
            else
                ema_new1(l, t, s[j]);
            L[j] = l;
            T[j] = t;
        }
    }
}

/* ---- calibrate: the warp radix select --------------------------------------------------------- */

/* The Top-k (1 <= k <= n) of keys[0 .. n) (shared memory) is {j : keys[j] > theta or (keys[j] ==
 * theta and j <= jcut)}: the same set as select_cut of the CPU path gives (theta itself may differ:
 * see the early exit). hist: this warp's 256 shared ints. Called by the whole warp (uniform).
 * The bits the row's smallest and largest keys share are known (scores of one range share their
 * sign and exponent bits: counting them would put every key into one bin); digits of 8 bits below
 * them, each pass counting only the keys that match the digits found so far. Early exit: when the
 * chosen bin holds exactly the rank still wanted, every key with that prefix is in, and theta = the
 * prefix with zero low bits, jcut = n - 1, names the set. */
__device__ __forceinline__ void warp_select(const uint32_t *keys, int n, int k, int *hist, uint32_t &theta,
                                            int &jcut)
{
    const int lane = (int)(threadIdx.x & 31);
    uint32_t lo = 0xFFFFFFFFu, hi = 0u;
    for (int j = lane; j < n; j += 32) {
        const uint32_t key = keys[j];
        lo = key < lo ? key : lo;
        hi = key > hi ? key : hi;
    }
    lo = __reduce_min_sync(0xFFFFFFFFu, lo);
    hi = __reduce_max_sync(0xFFFFFFFFu, hi);
    if (lo == hi) { /* one value: the first k indices */
        theta = lo;
        jcut = k - 1;
        return;
    }
    const int top = 31 - __clz(lo ^ hi); /* the highest differing bit */
    uint32_t prefix = top == 31 ? 0u : hi & (0xFFFFFFFFu << (top + 1));
    int kk = k;
    for (int h = top; h >= 0; h -= 8) {
        const int shift = h >= 7 ? h - 7 : 0;
        const uint32_t above = h == 31 ? 0u : (0xFFFFFFFFu << (h + 1)); /* the bits found so far */
        const uint32_t dmask = (2u << (h - shift)) - 1u;                  /* the digit's bits */
#pragma unroll
        for (int i = 0; i < 8; i++)
            hist[lane * 8 + i] = 0;
        __syncwarp();
        for (int j = lane; j < n; j += 32) {
            const uint32_t key = keys[j];
            if ((key & above) == prefix)
                atomicAdd(&hist[(key >> shift) & dmask], 1);
        }
        __syncwarp();
        /* lane l owns bins 255 - 8l - i, i = 0..7 (descending) */
        int c[8], sum = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            c[i] = hist[255 - 8 * lane - i];
            sum += c[i];
        }
        int incl = sum;
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
            const int v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
            if (lane >= o)
                incl += v;
        }
        const unsigned ge = __ballot_sync(0xFFFFFFFFu, incl >= kk);
        const int owner = __ffs(ge) - 1; /* exists: the candidates are >= kk */
        int digit = 0, rem = kk - (incl - sum), exact = 0;
        if (lane == owner) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                if (digit == 0 && c[i] >= rem) {
                    digit = 256 + 255 - 8 * lane - i; /* +256: found */
                    exact = c[i] == rem;
                } else if (digit == 0) {
                    rem -= c[i];
                }
            }
        }
        digit = __shfl_sync(0xFFFFFFFFu, digit, owner) - 256;
        kk = __shfl_sync(0xFFFFFFFFu, rem, owner);
        exact = __shfl_sync(0xFFFFFFFFu, exact, owner);
        prefix |= (uint32_t)digit << shift;
        __syncwarp(); /* hist is cleared by the next pass */
        if (exact) { /* every candidate of the bin is in */
            theta = prefix;
            jcut = n - 1;
            return;
        }
    }
    /* kk ties at prefix (a key: every bit is known), the lowest indices first */
    int cut = n - 1;
    for (int base = 0; base < n; base += 32) {
        const int j = base + lane;
        const unsigned tie = __ballot_sync(0xFFFFFFFFu, j < n && keys[j] == prefix);
        const int cnt = __popc(tie);
        if (kk <= cnt) {
            unsigned b = tie;
            for (int i = 1; i < kk; i++)
                b &= b - 1;
            cut = base + __ffs(b) - 1;
            break;
        }
        kk -= cnt;
    }
    theta = prefix;
    jcut = cut;
}

__device__ __forceinline__ bool in_set(uint32_t key, int j, uint32_t theta, int jcut)
{
    return key > theta || (key == theta && j <= jcut);
}

__device__ __forceinline__ double weight(float s, float m)
{
    return isfinite(s) ? __dsub_rn((double)s, (double)m) : 0.0;
}

/* the pairwise tree over the warp's lanes (offsets 1, 2, 4, 8, 16): lane 0 gets the canonical sum */
__device__ __forceinline__ double tree32(double v)
{
#pragma unroll
    for (int o = 1; o < 32; o *= 2)
        v = __dadd_rn(v, __shfl_down_sync(0xFFFFFFFFu, v, o));
    return v;
}

/* workspace: truth int32 [T-1, kk] | mins float [T] | dens double [T], each 256-byte aligned */
struct Workspace {
    int32_t *truth;
    float *mins;
    double *dens;
};

inline size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

inline size_t workspace_layout(const gvr_ema_calibrate_params *p, char *base, Workspace *w)
{
    const int64_t kk = p->k < p->N ? p->k : p->N;
    const size_t a = align256((size_t)(p->T > 1 ? p->T - 1 : 0) * (size_t)(kk > 0 ? kk : 0) * 4);
    const size_t b = align256((size_t)(p->T > 0 ? p->T : 0) * 4);
    const size_t c = align256((size_t)(p->T > 0 ? p->T : 0) * 8);
    if (w) {
        w->truth = reinterpret_cast<int32_t *>(base);
        w->mins = reinterpret_cast<float *>(base + a);
        w->dens = reinterpret_cast<double *>(base + a + b);
    }
    return a + b + c;
}

constexpr int TRUTH_WARPS = 4;

/* Programmatic dependent launch without the early trigger: the grid kernel that follows (one CTA of
 * 512 threads and up to 200 KB of shared memory per SM) would otherwise take the SMs this kernel's
 * CTAs still need while it waits; it launches when this grid completes. */
__device__ __forceinline__ void pdl_wait_only()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__global__ void __launch_bounds__(TRUTH_WARPS * 32) truth_kernel(gvr_ema_calibrate_params p, Workspace w, int kk)
{
    pdl_wait_only();
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31);
    const int N = p.N;
    uint32_t *keys = reinterpret_cast<uint32_t *>(smem) + (size_t)warp * N;
    int *hist = reinterpret_cast<int *>(reinterpret_cast<uint32_t *>(smem) + (size_t)TRUTH_WARPS * N) + warp * 256;
    for (int64_t t = 1 + (int64_t)blockIdx.x * TRUTH_WARPS + warp; t < p.T; t += (int64_t)gridDim.x * TRUTH_WARPS) {
        const float *s = p.scores + t * p.stride_t;
        float m = f_pinf();
        for (int j = lane; j < N; j += 32) {
            const float v = s[j];
            keys[j] = gvr_key_f32(v);
            if (isfinite(v))
                m = fminf(m, v);
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2)
            m = fminf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
        if (m == f_pinf())
            m = 0.0f;
        __syncwarp();
        uint32_t theta;
        int jcut;
        warp_select(keys, N, kk, hist, theta, jcut);
        int32_t *out = w.truth + (t - 1) * (int64_t)kk;
        int base = 0;
        for (int c0 = 0; c0 < N; c0 += 32) {
            const int j = c0 + lane;
            const bool in = j < N && in_set(keys[j], j, theta, jcut);
            const unsigned bal = __ballot_sync(0xFFFFFFFFu, in);
            if (in)
                out[base + __popc(bal & ((1u << lane) - 1u))] = j;
            base += __popc(bal);
        }
        __syncwarp();
        double acc = 0.0;
        for (int e = lane; e < kk; e += 32)
            acc = __dadd_rn(acc, weight(s[out[e]], m));
        acc = tree32(acc);
        if (lane == 0) {
            w.mins[t] = m;
            w.dens[t] = acc;
        }
        __syncwarp(); /* keys and hist are reused */
    }
}

constexpr int GRID_THREADS = 512;
constexpr int GRID_WARPS = GRID_THREADS / 32;
constexpr size_t SMEM_BUDGET = 200 * 1024;

inline int chunk_steps(int N)
{
    const size_t fixed = (size_t)GRID_WARPS * 256 * 4 + GRID_WARPS * 8;
    const int s = (int)((SMEM_BUDGET - fixed) / ((size_t)N * 4));
    return s < 1 ? 1 : s > GRID_WARPS ? GRID_WARPS : s;
}

inline size_t grid_smem(int N, int S) { return (size_t)S * N * 4 + (size_t)GRID_WARPS * 256 * 4 + GRID_WARPS * 8; }

template <int E>
__global__ void __launch_bounds__(GRID_THREADS, 1) grid_kernel(gvr_ema_calibrate_params p, Workspace w, int kk, int S)
{
    pdl_enter();
    extern __shared__ __align__(16) unsigned char smem[];
    const int N = p.N, tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31;
    double *hits = reinterpret_cast<double *>(smem);                                      /* [16] */
    int *hist = reinterpret_cast<int *>(smem + GRID_WARPS * 8) + warp * 256;              /* [16][256] */
    uint32_t *keys = reinterpret_cast<uint32_t *>(smem + GRID_WARPS * 8 + GRID_WARPS * 256 * 4); /* [S][N] */
    for (int64_t g = blockIdx.x; g < p.G; g += gridDim.x) {
        const float alpha = p.grid[3 * g], beta = p.grid[3 * g + 1], phi = p.grid[3 * g + 2];
        const float om = __fsub_rn(1.0f, alpha), ob = __fsub_rn(1.0f, beta);
        float L[E], Tr[E], nxt[E];
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = tid + e * GRID_THREADS;
            ema_new1(L[e], Tr[e], j < N ? p.scores[j] : 0.0f);
            nxt[e] = j < N && p.T > 1 ? p.scores[p.stride_t + j] : 0.0f;
        }
        double acc = 0.0;
        for (int64_t t0 = 1; t0 < p.T; t0 += S) {
            const int ns = (int)(p.T - t0 < S ? p.T - t0 : S);
            /* phase A: the recurrence over the chunk's steps */
            for (int i = 0; i < ns; i++) {
                const int64_t t = t0 + i;
                float cur[E];
#pragma unroll
                for (int e = 0; e < E; e++) {
                    const int j = tid + e * GRID_THREADS;
                    cur[e] = nxt[e];
                    nxt[e] = j < N && t + 1 < p.T ? p.scores[(t + 1) * p.stride_t + j] : 0.0f;
                }
#pragma unroll
                for (int e = 0; e < E; e++) {
                    const int j = tid + e * GRID_THREADS;
                    if (j < N) {
                        keys[(size_t)i * N + j] = gvr_key_f32(ema_predict1(L[e], Tr[e], phi));
                        ema_update1(L[e], Tr[e], cur[e], alpha, om, beta, ob, phi);
                    }
                }
            }
            __syncthreads();
            /* phase B: one warp per step */
            if (warp < ns) {
                const int64_t t = t0 + warp;
                const uint32_t *k = keys + (size_t)warp * N;
                uint32_t theta;
                int jcut;
                warp_select(k, N, kk, hist, theta, jcut);
                const int32_t *truth = w.truth + (t - 1) * (int64_t)kk;
                const float *s = p.scores + t * p.stride_t;
                const float m = w.mins[t];
                double num = 0.0;
                int cnt = 0;
                for (int e = lane; e < kk; e += 32) {
                    const int j = truth[e];
                    if (in_set(k[j], j, theta, jcut)) {
                        num = __dadd_rn(num, weight(s[j], m));
                        cnt++;
                    }
                }
                num = tree32(num);
#pragma unroll
                for (int o = 16; o > 0; o /= 2)
                    cnt += __shfl_xor_sync(0xFFFFFFFFu, cnt, o);
                if (lane == 0) {
                    const double den = w.dens[t];
                    hits[warp] = den > 0.0 ? __ddiv_rn(num, den) : __ddiv_rn((double)cnt, (double)kk);
                }
            }
            __syncthreads();
            if (tid == 0)
                for (int i = 0; i < ns; i++)
                    acc = __dadd_rn(acc, hits[i]);
            /* the next chunk writes keys (phase A) and hits (after its barrier): both after this */
            __syncthreads();
        }
        if (tid == 0)
            p.hit[g] = __ddiv_rn(acc, (double)(p.T - 1));
    }
}

template <class K>
cudaError_t allow_smem(DeviceCache<1> &done, int dev, K fn, int bytes)
{
    if (done.get(dev, 0) >= bytes)
        return cudaSuccess;
    const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess)
        done.put(dev, 0, bytes);
    return e;
}

template <int E>
cudaError_t launch_grid(const gvr_ema_calibrate_params *p, const Workspace &w, int kk, int dev, cudaStream_t stream)
{
    static DeviceCache<1> done;
    const int S = chunk_steps(p->N);
    const size_t smem = grid_smem(p->N, S);
    cudaError_t e = allow_smem(done, dev, grid_kernel<E>, (int)SMEM_BUDGET);
    if (e != cudaSuccess)
        return e;
    LaunchConfig lc(p->G > (int64_t)MAX_GRID ? MAX_GRID : (unsigned)p->G, GRID_THREADS, 0, smem, stream);
    return cudaLaunchKernelEx(&lc.cfg, grid_kernel<E>, *p, w, kk, S);
}

} // namespace
} // namespace gvr::ema

using namespace gvr::ema;

GVR_API int gvr_prr_ema_predict(const gvr_ema_params *p, void *stream)
{
    if (p->B <= 0 || p->H <= 0 || (p->W <= 0 && p->row_len == nullptr))
        return 0;
    const int chunks = p->W > 0 ? (int)((p->W + PRED_CHUNK - 1) / PRED_CHUNK) : 1;
    const int64_t units = (int64_t)p->B * p->H * chunks;
    gvr::LaunchConfig lc(units > (int64_t)MAX_GRID ? MAX_GRID : (unsigned)units, ROW_THREADS, 0, 0,
                         (cudaStream_t)stream);
    const cudaError_t e = cudaLaunchKernelEx(&lc.cfg, predict_kernel, *p, chunks);
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prr_ema_predict: kernel launch", e);
}

GVR_API int gvr_prr_ema_update(const gvr_ema_params *p, void *stream)
{
    if (p->B <= 0 || p->H <= 0)
        return 0;
    const int64_t rows = (int64_t)p->B * p->H;
    gvr::LaunchConfig lc(rows > (int64_t)MAX_GRID ? MAX_GRID : (unsigned)rows, ROW_THREADS, 0, 0,
                         (cudaStream_t)stream);
    const cudaError_t e = cudaLaunchKernelEx(&lc.cfg, update_kernel, *p);
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prr_ema_update: kernel launch", e);
}

GVR_API size_t gvr_prr_ema_calibrate_workspace_size(const gvr_ema_calibrate_params *p)
{
    return workspace_layout(p, nullptr, nullptr);
}

GVR_API int gvr_prr_ema_calibrate(const gvr_ema_calibrate_params *p, void *workspace, size_t workspace_bytes,
                                  void *stream)
{
    if (p->G <= 0)
        return 0;
    if (p->T < 2 || p->N < 1 || p->k < 1 || p->N > GVR_EMA_CALIBRATE_MAX_BLOCKS)
        return gvr::set_message(1, "gvr_prr_ema_calibrate: needs T >= 2, 1 <= N <= %d, k >= 1 (got T %d, N %d, k %d)",
                                GVR_EMA_CALIBRATE_MAX_BLOCKS, p->T, p->N, p->k);
    const size_t need = workspace_layout(p, nullptr, nullptr);
    if (workspace_bytes < need || (workspace == nullptr && need > 0))
        return gvr::set_message(1, "gvr_prr_ema_calibrate: workspace of %zu bytes, needs %zu", workspace_bytes, need);
    int dev = 0;
    cudaError_t e = gvr::current_device(&dev);
    if (e != cudaSuccess)
        return gvr::set_error("gvr_prr_ema_calibrate: cudaGetDevice", e);
    Workspace w;
    workspace_layout(p, static_cast<char *>(workspace), &w);
    const int kk = p->k < p->N ? p->k : p->N;
    cudaStream_t s = (cudaStream_t)stream;
    {
        static gvr::DeviceCache<1> done;
        const size_t smem = (size_t)TRUTH_WARPS * (4 * (size_t)p->N + 1024);
        e = allow_smem(done, dev, truth_kernel, (int)(TRUTH_WARPS * (4 * GVR_EMA_CALIBRATE_MAX_BLOCKS + 1024)));
        if (e != cudaSuccess)
            return gvr::set_error("gvr_prr_ema_calibrate: cudaFuncSetAttribute", e);
        const int64_t ctas = (p->T - 1 + TRUTH_WARPS - 1) / TRUTH_WARPS;
        gvr::LaunchConfig lc(ctas > (int64_t)MAX_GRID ? MAX_GRID : (unsigned)ctas, TRUTH_WARPS * 32, 0, smem, s);
        e = cudaLaunchKernelEx(&lc.cfg, truth_kernel, *p, w, kk);
        if (e != cudaSuccess)
            return gvr::set_error("gvr_prr_ema_calibrate: truth kernel launch", e);
    }
    const int E = (p->N + GRID_THREADS - 1) / GRID_THREADS;
    e = E <= 1 ? launch_grid<1>(p, w, kk, dev, s)
        : E <= 2 ? launch_grid<2>(p, w, kk, dev, s)
        : E <= 4 ? launch_grid<4>(p, w, kk, dev, s)
        : E <= 8 ? launch_grid<8>(p, w, kk, dev, s)
                 : launch_grid<16>(p, w, kk, dev, s);
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prr_ema_calibrate: grid kernel launch", e);
}
