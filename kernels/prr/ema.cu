/* ema.cu: the EMA predictor entry points of gvr_kernels.h ("PRR EMA predictor and calibration"):
 * gvr_prr_ema_predict, gvr_prr_ema_update, gvr_prr_ema_calibrate(_workspace_size).
 *
 * Every float32 expression uses __fmul_rn / __fadd_rn / __fsub_rn (never contracted into an FMA), in
 * the order of the header: the state and the predictions equal the C path (csrc/cpu/prr_ema_cpu.c)
 * bit for bit.
 *
 *  - predict: one CTA per (row, chunk of PRED_CHUNK blocks), a plain elementwise pass (the keep ranges
 *    forced +inf in it); row_len by chunk 0's thread 0.
 *  - update: one CTA per row (b, h): every thread reads known, a barrier, thread 0 writes the new
 *    count, then the row's blocks (no other CTA touches the row, so the read precedes the write).
 *    Fused with the prediction (pred / row_len given): each thread also writes pred for its blocks j <
 *    W from the state it just computed (still in registers), thread 0 row_len: one launch, the state
 *    read once and written once, the same bits as predict after update.
 *  - block counts: nblocks[b], or ceil(nblocks[b] / block_size) for token counts (block_size > 1).
 *  - calibrate, two launches:
 *    1. truth: one warp per step t >= 1: the row's keys in shared memory, the Top-kk threshold and
 *       tie cut by a warp radix select (the bits shared by the row's extreme keys skipped, then
 *       8-bit digits, a 256-bin shared histogram per warp, only the candidates that match the digits
 *       found so far counted, an early exit when a bin is taken whole), the entries of S_t in ascending
 *       index order (ballot compaction) into the workspace, m_t (warp min) and den_t (the canonical
 *       sum: lane l over e = l, l+32, ..., then the shuffle tree with offsets 1, 2, 4, 8, 16).
 *    2. grid: one CTA per grid point (512 threads, the state of E = N/512 blocks per thread in
 *       registers). Steps go in chunks of S (<= 16, as shared memory allows; keys rows padded to NP, a
 *       multiple of 128, with keys 0). Phase A runs the recurrence for the chunk's S steps, two per
 *       loop trip (the state and the next step's scores alternate between two register sets; 16-byte
 *       loads and stores of 4 adjacent blocks where N % 4 == 0 and the rows are 16-byte aligned): per
 *       group of up to 4 blocks the update's general case and the keys, branch-free; where a Tn is not
 *       finite (an unobserved score, L = -inf, inf/NaN states) the group is redone by the exact
 *       branches. Phase B gives each of the chunk's steps to one warp: window_select, a histogram of
 *       512 bins of 2^shift keys centred on the previous chunk's last threshold (one 16-byte shared
 *       load per 4 keys, one shared atomic per key), the bin of the kk-th largest key and, unless that
 *       bin is taken whole, a second pass over the keys for its entries (<= 32), ranked; where the
 *       threshold is outside the window or the bin overfull, the warp radix select. Then the numerator
 *       over S_t's entries (canonical order, as den_t) and hit_t into shared memory; thread 0 adds the
 *       chunk's hits in step order and adapts the bin width (speed only). The selects of a chunk's
 *       steps run concurrently, the recurrence stays sequential.
 * Everything is a function of the inputs and the shapes only: deterministic, and the float64 sums
 * are taken in the order the CPU path takes them (the same bits). No allocation, no synchronization. */
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cluster.cuh"
#include "common/device.cuh"
#include "common/gvr_keys.h"
#include "common/launch.cuh"
#include "common/runtime.cuh"
#include "common/warp.cuh"
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

/* the row's block count nb (gvr_kernels.h): nblocks[b], or ceil(nblocks[b] / block_size) for token counts
 * (block_size > 1; a negative count is 0), clamped to [0, N] */
__device__ __forceinline__ int32_t row_blocks(const gvr_ema_params &p, int64_t b)
{
    int32_t n = p.nblocks[b];
    if (p.block_size > 1)
        n = n > 0 ? (n - 1) / p.block_size + 1 : 0; /* ceil without overflow */
    return clamp_i32(n, 0, p.N);
}

/* pred[b, h, j] of a row with block count nb, kn blocks of state (kn <= nb) and the keep ranges' bounds
 * kf = keep_first, kl = nb - keep_last; L, T: the block's state (read only where it is used) */
__device__ __forceinline__ float predicted(int32_t j, int32_t nb, int32_t kn, int32_t kf, int32_t kl, float L,
                                           float T, float phi)
{
    return j >= nb ? f_ninf() : (j < kf || j >= kl || j >= kn) ? f_pinf() : ema_predict1(L, T, phi);
}

__global__ void __launch_bounds__(ROW_THREADS) predict_kernel(gvr_ema_params p, int chunks)
{
    pdl_enter();
    const int64_t units = (int64_t)p.B * p.H * chunks;
    for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
        const int64_t row = u / chunks;
        const int c = (int)(u - row * chunks);
        const int64_t b = row / p.H, h = row - b * p.H;
        const int32_t nb = row_blocks(p, b);
        const int32_t kn = clamp_i32(p.known[b * p.known_stride_b + h * p.known_stride_h], 0, nb);
        const int32_t kl = nb - p.keep_last; /* >= -INT32_MAX: no overflow */
        const float *L = p.level + b * p.level_stride_b + h * p.level_stride_h;
        const float *T = p.trend + b * p.trend_stride_b + h * p.trend_stride_h;
        float *out = p.pred + b * p.pred_stride_b + h * p.pred_stride_h;
        const int32_t end = (int32_t)min((int64_t)p.W, (int64_t)(c + 1) * PRED_CHUNK);
        for (int32_t j = c * PRED_CHUNK + (int)threadIdx.x; j < end; j += ROW_THREADS) {
            const bool state = j < kn && j >= p.keep_first && j < kl;
            out[j] = predicted(j, nb, kn, p.keep_first, kl, state ? L[j] : 0.0f, state ? T[j] : 0.0f, p.phi);
        }
        if (c == 0 && threadIdx.x == 0)
            p.row_len[b * p.row_len_stride_b + h * p.row_len_stride_h] = nb < p.W ? nb : p.W;
    }
}

/* the update of row (b, h) and, fused (pred or row_len given), its prediction right after: each thread
 * predicts the blocks it updated from the new state in its registers (known = nu after the update, so
 * predict's kn is nu) */
__global__ void __launch_bounds__(ROW_THREADS) update_kernel(gvr_ema_params p)
{
    pdl_enter();
    const int64_t rows = (int64_t)p.B * p.H;
    const float alpha = p.alpha, beta = p.beta, phi = p.phi;
    const float om = __fsub_rn(1.0f, alpha), ob = __fsub_rn(1.0f, beta);
    const int32_t W = p.pred != nullptr ? p.W : 0; /* blocks of pred to write */
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const int64_t b = row / p.H, h = row - b * p.H;
        const int32_t nb = row_blocks(p, b);
        const int32_t nu = nb < p.Ns ? nb : p.Ns;
        int32_t *known = p.known + b * p.known_stride_b + h * p.known_stride_h;
        const int32_t kn = clamp_i32(*known, 0, nu);
        __syncthreads(); /* every thread has read known */
        if (threadIdx.x == 0) {
            *known = nu;
            if (p.row_len != nullptr)
                p.row_len[b * p.row_len_stride_b + h * p.row_len_stride_h] = nb < p.W ? nb : p.W;
        }
        float *L = p.level + b * p.level_stride_b + h * p.level_stride_h;
        float *T = p.trend + b * p.trend_stride_b + h * p.trend_stride_h;
        const float *s = p.scores + b * p.scores_stride_b + h * p.scores_stride_h;
        float *out = W > 0 ? p.pred + b * p.pred_stride_b + h * p.pred_stride_h : nullptr;
        const int32_t kl = nb - p.keep_last;
        const int32_t end = nu > W ? nu : W;
        for (int32_t j = (int)threadIdx.x; j < end; j += ROW_THREADS) {
            float l = 0.0f, t = 0.0f;
            if (j < nu) {
                l = L[j];
                t = T[j];
                if (j < kn)
                    ema_update1(l, t, s[j], alpha, om, beta, ob, phi);
                else
                    ema_new1(l, t, s[j]);
                L[j] = l;
                T[j] = t;
            }
            if (j < W)
                out[j] = predicted(j, nb, nu, p.keep_first, kl, l, t, phi);
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
        const int incl = warp_inclusive_sum(sum);
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

/* phase B's window select (see grid_kernel) */
constexpr int HBINS = 512;                /* window bins per warp; warp_select's 256 share them */
constexpr int HB_LANE = HBINS / 32;       /* bins per lane in the scan */
constexpr int EXT_CAP = 32;               /* pass 2: the target bin's entries, one per lane */
constexpr int SHIFT_MIN = 2, SHIFT_MAX = 23, SHIFT_START = 16; /* bin width 2^shift keys */
constexpr int OUT_EXACT = 0, OUT_BIN = 1, OUT_OVER = 2, OUT_MISS = 3;

/* the fixed part of grid_kernel's shared memory; keys [S][NP] follow it */
struct GridShared {
    double hits[GRID_WARPS];
    uint32_t theta[GRID_WARPS]; /* each step's threshold (the next chunk's guess) */
    int outcome[GRID_WARPS];    /* OUT_* of each step (the bin width's adaptation) */
    uint32_t guess;             /* the window's centre: the threshold of the previous chunk's last step */
    int shift;                  /* log2 of the bin width */
    int use;                    /* this chunk tries the window (a guess exists, no back-off) */
    int wait;                   /* back-off: chunks left without the window (tie-heavy rows fail it) */
    int backoff;                /* the next back-off's length */
    int pad0[3];
    int ext_cnt[GRID_WARPS];
    uint2 ext[GRID_WARPS][EXT_CAP]; /* (key, index) of the target bin's entries */
    int hist[GRID_WARPS][32 + HBINS]; /* 32 spare words (hist_add), then the bins */
};
static_assert(sizeof(GridShared) % 16 == 0, "keys follow GridShared 16-byte aligned");
static_assert(HBINS >= 256 && HBINS % 128 == 0, "warp_select uses the first 256 bins; the scan reads 16-byte groups");

/* N padded to whole 128-key groups (one 16-byte load per lane); the padding keys are 0 */
inline int padded_n(int N) { return (N + 127) & ~127; }

inline int chunk_steps(int NP)
{
    const int s = (int)((SMEM_BUDGET - sizeof(GridShared)) / ((size_t)NP * 4));
    return s < 1 ? 1 : s > GRID_WARPS ? GRID_WARPS : s;
}

inline size_t grid_smem(int NP, int S) { return sizeof(GridShared) + (size_t)S * NP * 4; }

__device__ __forceinline__ void prefetch_l1(const float *ptr)
{
    asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr));
}

/* key of a finite float: gvr_key_f32 without the NaN case (x + 0 turns -0 into +0) */
__device__ __forceinline__ uint32_t key_finite(float x)
{
    const uint32_t b = __float_as_uint(__fadd_rn(x, 0.0f));
    return b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
}

/* one key into the window histogram: bin (key >> sh) - base, the keys above the window folded into
 * the top bin ((key >> sh) - base fits an int for sh >= 2). Those below it go to one of the 32 spare
 * words before bin 0, -1 - lane at the most (never read): every lane adds, no branch per key (a
 * predicated atomic becomes one), and the lanes below the window take distinct banks. */
__device__ __forceinline__ void hist_add(int *hist, uint32_t key, uint32_t sh, uint32_t base, int spare)
{
    int q = (int)((key >> sh) - base);
    q = q < HBINS - 1 ? q : HBINS - 1;
    q = q > spare ? q : spare;
    atomicAdd(&hist[q], 1);
}

__device__ __forceinline__ void ext_push(uint2 *ext, int *cnt, uint32_t key, uint32_t lo, uint32_t width, int j)
{
    if (key - lo < width)
        ext[atomicAdd(cnt, 1)] = make_uint2(key, (uint32_t)j);
}

/* Phase B's select of one step: the same set as warp_select gives (keys[0 .. NP), whose padding
 * keys are 0 and rank below every real key), from a window of HBINS bins of 2^shift keys centred on
 * the guess. Pass 1 counts each key into its bin (those above the window into the top bin, those
 * below it nowhere); the scan from the top finds the bin b that holds the kk-th largest key and rem,
 * its rank within b. rem == count of b: the set is {key >= low end of b} (theta = that, jcut = NP -
 * 1). Else pass 2 gathers b's entries (<= EXT_CAP) and ranks them by (key desc, index asc): the entry
 * of rank rem names theta and jcut. The kk-th largest key above the window (b = the top bin) or below
 * it, or more than EXT_CAP entries in b: returns the outcome, the caller runs warp_select. */
__device__ __forceinline__ int window_select(const uint32_t *keys, int NP, int kk, int *hist, uint2 *ext, int *ext_cnt,
                                             uint32_t guess, int shift, uint32_t &theta, int &jcut)
{
    const int lane = (int)(threadIdx.x & 31);
    const uint32_t sh = (uint32_t)shift;
    const uint32_t base = (guess >> sh) - (uint32_t)(HBINS / 2);
    int4 *h4 = reinterpret_cast<int4 *>(hist);
#pragma unroll
    for (int i = 0; i < HB_LANE / 4; i++)
        h4[lane + 32 * i] = make_int4(0, 0, 0, 0);
    if (lane == 0)
        *ext_cnt = 0;
    __syncwarp();
    const uint4 *k4 = reinterpret_cast<const uint4 *>(keys);
    const int groups = NP >> 7;
    const int spare = -1 - lane;
#pragma unroll 4
    for (int it = 0; it < groups; it++) {
        const uint4 v = k4[lane + 32 * it];
        hist_add(hist, v.x, sh, base, spare);
        hist_add(hist, v.y, sh, base, spare);
        hist_add(hist, v.z, sh, base, spare);
        hist_add(hist, v.w, sh, base, spare);
    }
    __syncwarp();
    /* lane l's sum over its bins HBINS - HB_LANE (l + 1) .. HBINS - HB_LANE l - 1; the inclusive scan
     * from lane 0 (the top bins) finds the lane that holds the kk-th largest key */
    int sum = 0;
    {
        const int4 *mine = h4 + (HBINS - HB_LANE * (lane + 1)) / 4;
#pragma unroll
        for (int i = 0; i < HB_LANE / 4; i++) {
            const int4 v = mine[i];
            sum += (v.x + v.y) + (v.z + v.w);
        }
    }
    const int incl = warp_inclusive_sum(sum);
    const unsigned ge = __ballot_sync(0xFFFFFFFFu, incl >= kk);
    if (ge == 0u)
        return OUT_MISS; /* fewer than kk keys at or above the window's bottom */
    const int owner = __ffs(ge) - 1;
    const int rem0 = kk - __shfl_sync(0xFFFFFFFFu, incl - sum, owner); /* rank within the owner's bins */
    /* the owner's bins, descending, one per lane (lanes < HB_LANE): scan again */
    const int top = HBINS - HB_LANE * owner - 1;
    const int ci = lane < HB_LANE ? hist[top - lane] : 0;
    const int ii = warp_inclusive_sum<HB_LANE>(ci);
    const int at = __ffs(__ballot_sync(0xFFFFFFFFu, lane < HB_LANE && ii >= rem0)) - 1; /* exists */
    const int bin = top - at;
    const int cb = __shfl_sync(0xFFFFFFFFu, ci, at);
    const int rem = rem0 - (__shfl_sync(0xFFFFFFFFu, ii, at) - cb);
    if (bin == HBINS - 1)
        return OUT_MISS; /* in the top bin, which holds the keys above the window too */
    const uint32_t lo = (base + (uint32_t)bin) << sh; /* the bin's lowest key (the bin is not empty) */
    if (cb == rem) { /* the whole bin is in */
        theta = lo;
        jcut = NP - 1;
        return OUT_EXACT;
    }
    if (cb > EXT_CAP)
        return OUT_OVER;
    /* pass 2: the bin's cb entries (a branch per 4 keys, rarely taken) */
    const uint32_t width = 1u << sh;
#pragma unroll 4
    for (int it = 0; it < groups; it++) {
        const uint4 v = k4[lane + 32 * it];
        if (v.x - lo < width || v.y - lo < width || v.z - lo < width || v.w - lo < width) {
            const int j = 4 * (lane + 32 * it);
            ext_push(ext, ext_cnt, v.x, lo, width, j);
            ext_push(ext, ext_cnt, v.y, lo, width, j + 1);
            ext_push(ext, ext_cnt, v.z, lo, width, j + 2);
            ext_push(ext, ext_cnt, v.w, lo, width, j + 3);
        }
    }
    __syncwarp();
    /* the entry of rank rem - 1 among the cb (key desc, index asc) */
    uint2 mine = make_uint2(0u, 0u);
    int r = 0;
    if (lane < cb) {
        mine = ext[lane];
        for (int m = 0; m < cb; m++) {
            const uint2 o = ext[m];
            r += (o.x > mine.x || (o.x == mine.x && o.y < mine.y)) ? 1 : 0;
        }
    }
    const unsigned hit = __ballot_sync(0xFFFFFFFFu, lane < cb && r == rem - 1);
    const int src = __ffs(hit) - 1; /* exactly one */
    theta = __shfl_sync(0xFFFFFFFFu, mine.x, src);
    jcut = (int)__shfl_sync(0xFFFFFFFFu, mine.y, src);
    return OUT_BIN;
}

/* Phase A's step for G blocks of one thread (state L, Tr in; Lo, To out; cur: this step's scores):
 * the keys of the prediction into kv, then the update. The fast path (no branch on the block's state)
 * is the update's general case; it holds when every Tn it gives is finite (Tn finite needs finite d,
 * Ln, L, f, t, s, T: s observed and L != -inf, so the update is that case, and the prediction f is
 * finite, so key_finite is its key). Else the exact path of ema_update1 / gvr_key_f32 for the group. */
template <int G>
__device__ __forceinline__ void phase_a_group(const float *L, const float *Tr, float *Lo, float *To, const float *cur,
                                              uint32_t *kv, float alpha, float om, float beta, float ob, float phi)
{
    float f[G];
#pragma unroll
    for (int v = 0; v < G; v++) {
        const float t = __fmul_rn(phi, Tr[v]);
        f[v] = __fadd_rn(L[v], t);
        kv[v] = key_finite(f[v]);
        Lo[v] = __fadd_rn(__fmul_rn(alpha, cur[v]), __fmul_rn(om, f[v]));
        const float d = __fsub_rn(Lo[v], L[v]);
        To[v] = __fadd_rn(__fmul_rn(beta, d), __fmul_rn(ob, t));
    }
    float chk = To[0];
#pragma unroll
    for (int v = 1; v < G; v++)
        chk = __fadd_rn(chk, To[v]);
    if (!(fabsf(chk) < f_pinf())) {
#pragma unroll
        for (int v = 0; v < G; v++) {
            kv[v] = gvr_key_f32(f[v]);
            float l = L[v], t = Tr[v];
            ema_update1(l, t, cur[v], alpha, om, beta, ob, phi);
            Lo[v] = l;
            To[v] = t;
        }
    }
}

/* One CTA per grid point. The state of E blocks per thread in registers: VEC (E % 4 == 0, N % 4 == 0,
 * the rows 16-byte aligned): thread tid owns the blocks 4 (tid + GRID_THREADS q) + v, v < 4, loaded
 * and stored 16 bytes at a time; else tid + GRID_THREADS e. Keys rows of NP (N padded to 128, the
 * padding keys 0). Per chunk of S steps: phase A (the recurrence, keys of each step into shared
 * memory), a barrier, phase B (warp w: step t0 + w: window_select around the previous chunk's last
 * threshold, warp_select where it misses; the numerator; hits), a barrier; thread 0 then adds the
 * chunk's hits in step order and adapts the bin width, while the other warps start the next phase A
 * (nothing of it reads what thread 0 writes before the next barrier). */
template <int E, bool VEC>
__global__ void __launch_bounds__(GRID_THREADS, 1) grid_kernel(gvr_ema_calibrate_params p, Workspace w, int kk, int S,
                                                                int NP)
{
    pdl_enter();
    static_assert(!VEC || E % 4 == 0, "VEC: groups of 4 blocks");
    constexpr int G = E < 4 ? E : 4; /* blocks per group (the fast path's check) */
    constexpr int NG = E / G;
    extern __shared__ __align__(16) unsigned char smem[];
    GridShared &sh = *reinterpret_cast<GridShared *>(smem);
    uint32_t *keys = reinterpret_cast<uint32_t *>(smem + sizeof(GridShared)); /* [S][NP] */
    const int N = p.N, tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31;
    /* block index of the thread's block e, and whether the group of e is in the row */
    auto jof = [&](int e) { return VEC ? 4 * (tid + GRID_THREADS * (e / 4)) + (e % 4) : tid + GRID_THREADS * e; };
    /* the padding keys: written once (phase A writes below N only) */
    for (int i = 0; i < S; i++)
        for (int j = N + tid; j < NP; j += GRID_THREADS)
            keys[(size_t)i * NP + j] = 0u;
    for (int64_t g = blockIdx.x; g < p.G; g += gridDim.x) {
        const float alpha = p.grid[3 * g], beta = p.grid[3 * g + 1], phi = p.grid[3 * g + 2];
        const float om = __fsub_rn(1.0f, alpha), ob = __fsub_rn(1.0f, beta);
        if (tid == 0) {
            sh.use = 0;
            sh.wait = 0;
            sh.backoff = 0;
            sh.shift = SHIFT_START;
            sh.guess = 0u;
        }
        float L[E], Tr[E], nxt[E], L2[E], T2[E], nx2[E];
        bool in[NG];
#pragma unroll
        for (int q = 0; q < NG; q++)
            in[q] = jof(q * G) < N; /* VEC: N % 4 == 0, a group is in or out whole */
#pragma unroll
        for (int e = 0; e < E; e++) {
            const int j = jof(e);
            const bool ok = VEC ? in[e / G] : j < N;
            ema_new1(L[e], Tr[e], ok ? p.scores[j] : 0.0f);
            nxt[e] = ok ? p.scores[p.stride_t + j] : 0.0f; /* T >= 2 */
        }
        double acc = 0.0;
        for (int64_t t0 = 1; t0 < p.T; t0 += S) {
            const int ns = (int)(p.T - t0 < S ? p.T - t0 : S);
            /* phase B's loads (warp w: step t0 + w): the first two truth entries of the lane, m_t and
             * den_t, the entries' scores. EARLY: the first ones now, the scores at the end of phase A
             * (their latency hides behind it); E = 16 (registers short): in phase B */
            constexpr bool EARLY = E <= 8;
            const int64_t tb = t0 + (warp < ns ? warp : 0);
            const int32_t *truth = w.truth + (tb - 1) * (int64_t)kk;
            const float *srow_b = p.scores + tb * p.stride_t;
            int j0 = 0, j1 = 0;
            float m_b = 0.0f, s0 = 0.0f, s1 = 0.0f;
            double den_b = 0.0;
            auto loads_1 = [&]() {
                j0 = lane < kk ? truth[lane] : 0;
                j1 = lane + 32 < kk ? truth[lane + 32] : 0;
                m_b = w.mins[tb];
                den_b = w.dens[tb];
            };
            auto loads_2 = [&]() {
                s0 = lane < kk ? srow_b[j0] : 0.0f;
                s1 = lane + 32 < kk ? srow_b[j1] : 0.0f;
            };
            if (EARLY)
                loads_1();
            /* phase A: the recurrence over the chunk's steps, two at a time (the state and the
             * prefetched scores alternate between two register sets). sp: the thread's first block in
             * the next step's row, kp: in this step's keys row; its other blocks at constant offsets */
            const float *sp = p.scores + (t0 + 1) * p.stride_t + jof(0);
            uint32_t *kp = keys + jof(0);
            const int nmore = (int)(p.T - 1 - t0); /* steps i < nmore have a next row */
            auto step = [&](const float *Li, const float *Ti, float *Lo, float *To, const float *cur, float *nx,
                            int i) {
                const bool more = i < nmore;
                if (VEC) {
#pragma unroll
                    for (int q = 0; q < NG; q++) {
                        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        if (in[q] && more)
                            v = *reinterpret_cast<const float4 *>(sp + 4 * GRID_THREADS * q);
                        nx[4 * q] = v.x;
                        nx[4 * q + 1] = v.y;
                        nx[4 * q + 2] = v.z;
                        nx[4 * q + 3] = v.w;
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < E; e++)
                        nx[e] = jof(e) < N && more ? sp[GRID_THREADS * e] : 0.0f;
                }
                sp += p.stride_t;
                if (i + 1 < nmore) { /* the row after into L1: the next step's loads hit there */
                    if (VEC) {
#pragma unroll
                        for (int q = 0; q < NG; q++)
                            if (in[q])
                                prefetch_l1(sp + 4 * GRID_THREADS * q);
                    } else if (E <= 8) { /* (E = 16: the registers are short) */
#pragma unroll
                        for (int e = 0; e < E; e++)
                            if (jof(e) < N)
                                prefetch_l1(sp + GRID_THREADS * e);
                    }
                }
#pragma unroll
                for (int q = 0; q < NG; q++) {
                    uint32_t kv[G];
                    phase_a_group<G>(Li + q * G, Ti + q * G, Lo + q * G, To + q * G, cur + q * G, kv, alpha, om, beta,
                                     ob, phi);
                    if (VEC) {
                        if (in[q])
                            *reinterpret_cast<uint4 *>(kp + 4 * GRID_THREADS * q) =
                                make_uint4(kv[0], kv[1], kv[2], kv[3]);
                    } else {
#pragma unroll
                        for (int v = 0; v < G; v++)
                            if (jof(q * G + v) < N)
                                kp[GRID_THREADS * (q * G + v)] = kv[v];
                    }
                }
                kp += NP;
            };
            int i = 0;
            for (; i + 1 < ns; i += 2) {
                step(L, Tr, L2, T2, nxt, nx2, i);
                step(L2, T2, L, Tr, nx2, nxt, i + 1);
            }
            if (i < ns) {
                step(L, Tr, L2, T2, nxt, nx2, i);
#pragma unroll
                for (int e = 0; e < E; e++) {
                    L[e] = L2[e];
                    Tr[e] = T2[e];
                    nxt[e] = nx2[e];
                }
            }
            if (EARLY)
                loads_2();
            __syncthreads();
            /* phase B: one warp per step */
            if (warp < ns) {
                if (!EARLY)
                    loads_1();
                const uint32_t *k = keys + (size_t)warp * NP;
                const float *s = srow_b;
                const float m = m_b;
                const double den = den_b;
                uint32_t theta = 0u;
                int jcut = 0, out = OUT_MISS;
                if (sh.use)
                    out = window_select(k, NP, kk, sh.hist[warp] + 32, sh.ext[warp], &sh.ext_cnt[warp], sh.guess,
                                        sh.shift, theta, jcut);
                if (!EARLY)
                    loads_2();
                if (out >= OUT_OVER) {
                    __syncwarp(); /* the window's histogram is read: warp_select clears it */
                    warp_select(k, NP, kk, sh.hist[warp] + 32, theta, jcut);
                }
                double num = 0.0;
                int cnt = 0;
                if (lane < kk && in_set(k[j0], j0, theta, jcut)) {
                    num = __dadd_rn(num, weight(s0, m));
                    cnt++;
                }
                if (lane + 32 < kk && in_set(k[j1], j1, theta, jcut)) {
                    num = __dadd_rn(num, weight(s1, m));
                    cnt++;
                }
                for (int e = lane + 64; e < kk; e += 32) {
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
                    sh.hits[warp] = den > 0.0 ? __ddiv_rn(num, den) : __ddiv_rn((double)cnt, (double)kk);
                    sh.theta[warp] = theta;
                    sh.outcome[warp] = out;
                }
            }
            /* the next chunk's phase A writes keys after this; thread 0 reads hits, theta, outcome and
             * writes guess, shift, use, wait, backoff before the next barrier, phase B reads them after it */
            __syncthreads();
            if (tid == 0) {
                int miss = 0, over = 0, bin = 0;
                for (int i = 0; i < ns; i++) {
                    acc = __dadd_rn(acc, sh.hits[i]);
                    miss += sh.outcome[i] == OUT_MISS;
                    over += sh.outcome[i] == OUT_OVER;
                    bin += sh.outcome[i] == OUT_BIN;
                }
                /* adaptation (speed only, never the result): a miss widens the bins, pass 2s or
                 * overfull bins in more than 3/4 of the steps narrow them; a chunk where most steps
                 * failed backs off 0, 1, 3, 7, ... chunks before the next try (rows with more than
                 * EXT_CAP ties at the threshold) */
                if (sh.use) {
                    if (miss > 0)
                        sh.shift = sh.shift + 2 < SHIFT_MAX ? sh.shift + 2 : SHIFT_MAX;
                    else if (4 * (bin + over) > 3 * ns)
                        sh.shift = sh.shift - 1 > SHIFT_MIN ? sh.shift - 1 : SHIFT_MIN;
                    if (2 * (miss + over) > ns) {
                        sh.wait = sh.backoff;
                        sh.backoff = 2 * sh.backoff + 1 < 63 ? 2 * sh.backoff + 1 : 63;
                    } else {
                        sh.backoff = 0;
                    }
                } else if (sh.wait > 0) {
                    sh.wait--;
                }
                sh.guess = sh.theta[ns - 1];
                sh.use = sh.wait == 0;
            }
        }
        if (tid == 0)
            p.hit[g] = __ddiv_rn(acc, (double)(p.T - 1));
        __syncthreads(); /* the next grid point's thread 0 resets use, shift, ... (read by this one's last phase B) */
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

template <int E, bool VEC>
cudaError_t launch_grid(const gvr_ema_calibrate_params *p, const Workspace &w, int kk, int dev, cudaStream_t stream)
{
    static DeviceCache<1> done;
    const int NP = padded_n(p->N);
    const int S = chunk_steps(NP);
    const size_t smem = grid_smem(NP, S);
    cudaError_t e = allow_smem(done, dev, grid_kernel<E, VEC>, (int)SMEM_BUDGET);
    if (e != cudaSuccess)
        return e;
    LaunchConfig lc(p->G > (int64_t)MAX_GRID ? MAX_GRID : (unsigned)p->G, GRID_THREADS, 0, smem, stream);
    return cudaLaunchKernelEx(&lc.cfg, grid_kernel<E, VEC>, *p, w, kk, S, NP);
}

template <int E>
cudaError_t launch_grid_e(const gvr_ema_calibrate_params *p, const Workspace &w, int kk, int dev, cudaStream_t stream)
{
    if constexpr (E % 4 == 0) {
        const bool vec = p->N % 4 == 0 && (reinterpret_cast<uintptr_t>(p->scores) & 15u) == 0 && p->stride_t % 4 == 0;
        if (vec)
            return launch_grid<E, true>(p, w, kk, dev, stream);
    }
    return launch_grid<E, false>(p, w, kk, dev, stream);
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
    e = E <= 1 ? launch_grid_e<1>(p, w, kk, dev, s)
        : E <= 2 ? launch_grid_e<2>(p, w, kk, dev, s)
        : E <= 4 ? launch_grid_e<4>(p, w, kk, dev, s)
        : E <= 8 ? launch_grid_e<8>(p, w, kk, dev, s)
                 : launch_grid_e<16>(p, w, kk, dev, s);
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prr_ema_calibrate: grid kernel launch", e);
}
