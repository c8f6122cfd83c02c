/* ckeys.cu: SparDA's compressed keys (gvr_kernels.h, "SparDA compressed keys"):
 * gvr_sparda_compressed_keys, build and in-place update.
 *
 * A CTA of 128 threads per (row b, KV head h, chunk of WPC windows); warp w takes the chunk's windows
 * w, w + 4, ...; lane l the channels l, l + 32, ... . Per window and channel the tokens are summed in
 * token order in float32 (__fadd_rn: no contraction), divided by the kernel size (__fdiv_rn) and
 * rounded to the output's dtype (RN; an fp8 cache's values decoded exactly) -- the arithmetic of csrc/cpu/sparda_cpu.c in the same order, so
 * CUDA and CPU agree bit for bit. Device start/end are clamped to [0, max_pages * P]. No allocation,
 * no synchronization, no host reads: graph-safe; deterministic. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cluster.cuh"
#include "common/fp8.cuh"
#include "common/launch.cuh"
#include "common/runtime.cuh"
#include "gvr_kernels.h"

#define GVR_API extern "C" __attribute__((visibility("default")))

namespace gvr::sparda {
namespace {

constexpr int THREADS = 128;
constexpr int WPC = 16; /* windows per CTA */
constexpr unsigned MAX_GRID = 1u << 30;

template <int ELEM>
__device__ __forceinline__ float load(const char *p)
{
    if constexpr (ELEM == GVR_ELEM_F16)
        return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t *>(p)));
    else if constexpr (ELEM == GVR_ELEM_BF16)
        return __bfloat162float(__ushort_as_bfloat16(*reinterpret_cast<const uint16_t *>(p)));
    else /* fp8 e4m3fn: exact */
        return e4m3_to_f32(*reinterpret_cast<const uint8_t *>(p));
}

template <int ELEM>
__device__ __forceinline__ uint16_t store(float f)
{
    if constexpr (ELEM == GVR_ELEM_F16)
        return __half_as_ushort(__float2half_rn(f));
    else
        return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

__device__ __forceinline__ long long clampll(long long x, long long lo, long long hi) { return x < lo ? lo : x > hi ? hi : x; }

/* ELEM: out's element type (f16 / bf16), KE: k's (ELEM or fp8 e4m3fn) */
template <int ELEM, int KE>
__global__ void __launch_bounds__(THREADS) ckeys_kernel(const gvr_sparda_ckeys_params p, int chunks)
{
    constexpr int KES = KE == GVR_ELEM_E4M3 ? 1 : 2; /* bytes per k element */
    pdl_enter();
    const long long cta = blockIdx.x;
    const int c = (int)(cta % chunks);
    const long long bh = cta / chunks;
    const int h = (int)(bh % p.Hkv);
    const long long b = bh / p.Hkv;
    const int w = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31);
    const long long cap = (long long)p.max_pages * p.P, K = p.kernel, S = p.stride;
    const long long e = p.end ? clampll(p.end[b], 0, cap) : cap;
    const long long complete = e >= K ? (e - K) / S + 1 : 0;
    long long j0 = 0;
    if (p.start) {
        const long long s = clampll(p.start[b], 0, cap);
        j0 = s >= K ? (s - K) / S + 1 : 0;
    }
    const long long j1 = complete < p.Nc ? complete : p.Nc;
    const int32_t *bt = p.block_table + b * p.bt_stride_b;
    const char *kb = (const char *)p.k + KES * ((long long)h * p.k_stride_head);
    uint16_t *orow = (uint16_t *)p.out + b * p.out_stride_b + (long long)h * p.out_stride_h;
    for (int i = w; i < WPC; i += THREADS / 32) {
        const long long j = (long long)c * WPC + i;
        if (j >= p.Nc)
            break;
        uint16_t *o = orow + j * p.out_stride_j;
        if (j < j0 || j >= j1) {
            if (!p.start) /* build: zero */
                for (int d = lane; d < p.D; d += 32)
                    o[d] = 0;
            continue;
        }
        for (int d0 = 0; d0 < p.D; d0 += 32) {
            const int d = d0 + lane;
            float acc = 0.f;
            for (long long t = j * S; t < j * S + K; t++) {
                const long long pg = bt[t / p.P];
                if (pg < 0 || pg >= p.num_pages)
                    continue;
                if (d < p.D)
                    acc = __fadd_rn(acc, load<KE>(kb + KES * (pg * p.k_stride_page + (t % p.P) * p.k_stride_tok + d)));
            }
            if (d < p.D)
                o[d] = store<ELEM>(__fdiv_rn(acc, (float)p.kernel));
        }
    }
}

} // namespace
} // namespace gvr::sparda

GVR_API int gvr_sparda_compressed_keys(const gvr_sparda_ckeys_params *p, void *stream)
{
    using namespace gvr::sparda;
    if (p->B <= 0 || p->Hkv <= 0 || p->D <= 0 || p->Nc <= 0)
        return 0;
    if (p->P <= 0 || p->kernel <= 0 || p->stride <= 0 || (p->dtype != GVR_ELEM_F16 && p->dtype != GVR_ELEM_BF16) ||
        (p->k_dtype != p->dtype && p->k_dtype != GVR_ELEM_E4M3))
        return gvr::set_message(1, "gvr_sparda_compressed_keys: bad P, kernel, stride or dtype");
    const int chunks = (p->Nc + WPC - 1) / WPC;
    const long long grid = (long long)p->B * p->Hkv * chunks;
    if (grid > MAX_GRID)
        return gvr::set_message(1, "gvr_sparda_compressed_keys: too many windows for one launch (%lld CTAs)", grid);
    gvr::LaunchConfig lc((unsigned)grid, THREADS, 0, 0, (cudaStream_t)stream);
    const bool f8 = p->k_dtype == GVR_ELEM_E4M3;
    const cudaError_t e =
        p->dtype == GVR_ELEM_F16
            ? (f8 ? cudaLaunchKernelEx(&lc.cfg, ckeys_kernel<GVR_ELEM_F16, GVR_ELEM_E4M3>, *p, chunks)
                  : cudaLaunchKernelEx(&lc.cfg, ckeys_kernel<GVR_ELEM_F16, GVR_ELEM_F16>, *p, chunks))
            : (f8 ? cudaLaunchKernelEx(&lc.cfg, ckeys_kernel<GVR_ELEM_BF16, GVR_ELEM_E4M3>, *p, chunks)
                  : cudaLaunchKernelEx(&lc.cfg, ckeys_kernel<GVR_ELEM_BF16, GVR_ELEM_BF16>, *p, chunks));
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_sparda_compressed_keys: kernel launch", e);
}
