/* prefetch.cu: SparDA's host KV cache on the device (gvr_kernels.h, "SparDA host KV cache"):
 * gvr_sparda_prefetch (the slot policy as one plan kernel, then a UVA gather kernel; or copies through
 * the copy engines from a host plan), gvr_sparda_kv_store (new tokens into a host cache through UVA),
 * and the pinned host memory entry points.
 *
 * Plan: one CTA of 1024 threads runs the policy's steps with __syncthreads between them (owners by
 * atomicMin of the row-major block number, then block-wide scans in slot / row-major order: the same
 * result as csrc/cpu/sparda_cpu.c, whatever the timing). Gather: at most max_ctas CTAs of cta_warps
 * warps (default 16 of 8); a warp moves one piece of a page at a time, lane_loads loads of 16 bytes per
 * lane in flight before their stores (default 16: 8 KiB a warp; reads from pinned host memory cross
 * PCIe: latency is hidden by bytes in flight). No allocation, no host synchronization: graph-safe. */
#include <cuda_runtime.h>

#include <cuda/ptx>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "common/cluster.cuh"
#include "common/launch.cuh"
#include "common/runtime.cuh"
#include "gvr_kernels.h"
#include "sparda/plan.cuh"

#define GVR_API extern "C" __attribute__((visibility("default")))

namespace gvr::sparda {
namespace {

constexpr int DEFAULT_CTAS = 16;
constexpr int STORE_CHUNK_TOKENS = 8192; /* tokens per store launch: duplicates are resolved within one */

__global__ void __launch_bounds__(PLAN_THREADS) plan_kernel(const gvr_prefetch_params p, Workspace w)
{
    pdl_enter();
    plan_policy(p, w);
}

template <int PER_LANE>
__global__ void __launch_bounds__(GATHER_THREADS) gather_kernel(const GatherJob j, const int32_t *n_moves)
{
    pdl_enter();
    gather_grid<PER_LANE>(j, *n_moves);
}

/* The bulk-copy gather (GVR_PREFETCH_TMA): one thread per CTA walks its pieces (CTA-strided, TMA_PIECE
 * bytes at most, K then V of each move) through a ring of TMA_SLOTS pieces of shared memory: the load of a
 * piece (cp.async.bulk global -> shared, completing on the slot's mbarrier) runs TMA_SLOTS - 1 pieces
 * ahead of its store (cp.async.bulk shared -> global, one bulk group each); a slot is loaded again once
 * the store before it has read it (wait_group.read 1). The CTA takes one SM whatever it moves; the copy
 * engine of the SM does the work. */
constexpr int TMA_PIECE = 16384;
constexpr int TMA_SLOTS = 12; /* 192 KiB of shared memory */
constexpr int DEFAULT_TMA_CTAS = 2;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
__device__ __forceinline__ void tma_piece(const GatherJob &j, long long u, long long per_page, const char *&src,
                                          char *&dst, uint32_t &bytes)
{
    const long long m = u / (2 * per_page), r = u % (2 * per_page);
    const int kv = (int)(r / per_page);
    const long long off = (r % per_page) * TMA_PIECE;
    const int32_t from = j.moves[2 * m], to = j.moves[2 * m + 1];
    src = (kv ? j.host_v : j.host_k) + (long long)from * (kv ? j.hs_v : j.hs_k) + off;
    dst = (kv ? j.dst_v : j.dst_k) + (long long)to * (kv ? j.ds_v : j.ds_k) + off;
    bytes = (uint32_t)(j.page_bytes - off < TMA_PIECE ? j.page_bytes - off : TMA_PIECE);
}
#endif

__global__ void __launch_bounds__(32) tma_gather_kernel(const GatherJob j, const int32_t *n_moves)
{
#if __CUDA_ARCH__ >= 900
    namespace ptx = cuda::ptx;
    extern __shared__ __align__(128) char ring[];
    __shared__ __align__(8) uint64_t full[TMA_SLOTS];
    pdl_enter();
    if (threadIdx.x != 0)
        return;
    const long long per_page = (j.page_bytes + TMA_PIECE - 1) / TMA_PIECE;
    const long long total = 2LL * *n_moves * per_page;
    const long long mine = total > blockIdx.x ? (total - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    if (mine == 0)
        return;
    for (int s = 0; s < TMA_SLOTS; s++)
        ptx::mbarrier_init(&full[s], 1);
    ptx::fence_proxy_async(ptx::space_shared); /* the barriers, seen by the bulk copies */
    auto load = [&](long long i) {
        const char *src;
        char *dst;
        uint32_t bytes;
        tma_piece(j, blockIdx.x + i * gridDim.x, per_page, src, dst, bytes);
        const int s = (int)(i % TMA_SLOTS);
        ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &full[s], bytes);
        ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, ring + (size_t)s * TMA_PIECE, src, bytes, &full[s]);
    };
    const long long ahead = TMA_SLOTS - 1;
    for (long long i = 0; i < ahead && i < mine; i++)
        load(i);
    for (long long i = 0; i < mine; i++) {
        const int s = (int)(i % TMA_SLOTS);
        while (!ptx::mbarrier_try_wait_parity(&full[s], (uint32_t)((i / TMA_SLOTS) & 1)))
            ;
        const char *src;
        char *dst;
        uint32_t bytes;
        tma_piece(j, blockIdx.x + i * gridDim.x, per_page, src, dst, bytes);
        ptx::cp_async_bulk(ptx::space_global, ptx::space_shared, dst, ring + (size_t)s * TMA_PIECE, bytes);
        ptx::cp_async_bulk_commit_group();
        if (i + ahead < mine) { /* its slot is the one of piece i - 1: wait until that store has read it */
            ptx::cp_async_bulk_wait_group_read(ptx::n32_t<1>());
            load(i + ahead);
        }
    }
    ptx::cp_async_bulk_wait_group(ptx::n32_t<0>()); /* written before the kernel ends */
#else
    __trap();
#endif
}

/* one warp per token of a launch's chunk: skipped when a later token of the chunk names its slot (later
 * tokens win; chunks are launched in order), else its Hkv rows of K and V are written, lanes over the
 * row's 16-byte (or, when the row is not 16-byte aligned, element-size) pieces */
template <typename W>
__global__ void __launch_bounds__(256) store_kernel(const gvr_kv_store_params p, long long t0, long long t1)
{
    pdl_enter();
    const long long t = t0 + (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (t >= t1)
        return;
    const long long slot = p.slots[t], cap = p.num_pages * p.P;
    if (slot < 0 || slot >= cap)
        return;
    bool later = false;
    for (long long u = t + 1 + lane; u < t1 && !later; u += 32)
        later = p.slots[u] == slot;
    if (__any_sync(0xffffffffu, later))
        return;
    const long long pg = slot / p.P, off = slot % p.P;
    const int per_row = (int)((long long)p.D * p.elem_bytes / (long long)sizeof(W));
    for (int h = 0; h < p.Hkv; h++) {
        const W *ks = (const W *)((const char *)p.k + (t * p.k_stride_t + h * p.k_stride_h) * p.elem_bytes);
        const W *vs = (const W *)((const char *)p.v + (t * p.v_stride_t + h * p.v_stride_h) * p.elem_bytes);
        W *kd = (W *)((char *)p.dst_k + (pg * p.dk_stride_page + off * p.dk_stride_tok + h * p.dk_stride_head) *
                                          p.elem_bytes);
        W *vd = (W *)((char *)p.dst_v + (pg * p.dv_stride_page + off * p.dv_stride_tok + h * p.dv_stride_head) *
                                          p.elem_bytes);
        for (int c = lane; c < per_row; c += 32) {
            kd[c] = ks[c];
            vd[c] = vs[c];
        }
    }
}

int memcpy_method(const gvr_prefetch_params *p, cudaStream_t st)
{
    cudaError_t e;
    if (p->plan_slot_map &&
        (e = cudaMemcpyAsync(p->slot_map, p->plan_slot_map, (size_t)p->B * p->max_pages * 4, cudaMemcpyHostToDevice,
                             st)) != cudaSuccess)
        return set_error("gvr_sparda_prefetch: copying the slot map", e);
    if (p->plan_counts && p->counts &&
        (e = cudaMemcpyAsync(p->counts, p->plan_counts, 16, cudaMemcpyHostToDevice, st)) != cudaSuccess)
        return set_error("gvr_sparda_prefetch: copying the counts", e);
    if (p->n_moves == 0)
        return 0;
    /* runs of adjacent pages (host and staging both consecutive and pages back to back) */
    std::vector<void *> dsts;
    std::vector<const void *> srcs;
    std::vector<size_t> sizes;
    for (int kv = 0; kv < 2; kv++) {
        const char *hb = (const char *)(kv ? p->host_v : p->host_k);
        char *db = (char *)(kv ? p->dst_v : p->dst_k);
        const int64_t hs = kv ? p->host_stride_v : p->host_stride_k, ds = kv ? p->dst_stride_v : p->dst_stride_k;
        const bool joinable = hs == p->page_bytes && ds == p->page_bytes;
        for (int32_t m = 0; m < p->n_moves;) {
            int32_t e2 = m + 1;
            while (joinable && e2 < p->n_moves && p->moves[2 * e2] == p->moves[2 * (e2 - 1)] + 1 &&
                   p->moves[2 * e2 + 1] == p->moves[2 * (e2 - 1) + 1] + 1)
                e2++;
            srcs.push_back(hb + (int64_t)p->moves[2 * m] * hs);
            dsts.push_back(db + (int64_t)p->moves[2 * m + 1] * ds);
            sizes.push_back((size_t)p->page_bytes * (size_t)(e2 - m));
            m = e2;
        }
    }
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.srcLocHint.type = cudaMemLocationTypeHost;
    attr.dstLocHint.type = cudaMemLocationTypeDevice;
    cudaGetDevice(&attr.dstLocHint.id);
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t idx = 0;
    /* the batch API refuses the legacy default stream: one copy each there */
    e = st == nullptr || st == cudaStreamLegacy
            ? cudaErrorNotSupported
            : cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), sizes.size(), &attr, &idx, 1, st);
    if (e == cudaErrorNotSupported) {
        cudaGetLastError();
        for (size_t i = 0; i < sizes.size(); i++)
            if ((e = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyHostToDevice, st)) != cudaSuccess)
                break;
    }
    return e == cudaSuccess ? 0 : set_error("gvr_sparda_prefetch: cudaMemcpyBatchAsync", e);
}

} // namespace
} // namespace gvr::sparda

using namespace gvr::sparda;

GVR_API size_t gvr_sparda_prefetch_workspace_size(const gvr_prefetch_params *p) { return workspace_bytes(p); }

GVR_API int gvr_sparda_prefetch(const gvr_prefetch_params *p, void *workspace, size_t workspace_bytes, void *stream)
{
    const cudaStream_t st = (cudaStream_t)stream;
    if (p->method == GVR_PREFETCH_MEMCPY)
        return memcpy_method(p, st);
    if (workspace_bytes < gvr_sparda_prefetch_workspace_size(p))
        return gvr::set_message(1, "gvr_sparda_prefetch: workspace of %zu bytes, %zu needed", workspace_bytes,
                                gvr_sparda_prefetch_workspace_size(p));
    const Workspace w = carve(p, workspace);
    cudaError_t e;
    int method = p->method;
    if (method == GVR_PREFETCH_AUTO || method == GVR_PREFETCH_TMA) {
        /* bulk copies where the kernel was compiled for sm_90 or later (auto: else the SM gather) */
        cudaFuncAttributes fa;
        const bool tma = cudaFuncGetAttributes(&fa, tma_gather_kernel) == cudaSuccess && fa.ptxVersion >= 90;
        cudaGetLastError();
        if (method == GVR_PREFETCH_TMA && !tma)
            return gvr::set_message(1, "gvr_sparda_prefetch: method 'tma' needs a GPU of compute capability 9.0 or "
                                       "later and gvr built for it (GVR_CUDA_ARCHS)");
        method = tma ? GVR_PREFETCH_TMA : GVR_PREFETCH_KERNEL;
    }
    {
        gvr::LaunchConfig lc(1, PLAN_THREADS, 0, 0, st);
        if ((e = cudaLaunchKernelEx(&lc.cfg, plan_kernel, *p, w)) != cudaSuccess)
            return gvr::set_error("gvr_sparda_prefetch: plan kernel", e);
    }
    if (method == GVR_PREFETCH_TMA) {
        /* per call: the attribute belongs to the current device's context */
        if ((e = cudaFuncSetAttribute(tma_gather_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      TMA_SLOTS * TMA_PIECE)) != cudaSuccess)
            return gvr::set_error("gvr_sparda_prefetch: the bulk-copy gather's shared memory", e);
        gvr::LaunchConfig lc((unsigned)(p->max_ctas > 0 ? p->max_ctas : DEFAULT_TMA_CTAS), 32, 0,
                             (size_t)TMA_SLOTS * TMA_PIECE, st);
        if ((e = cudaLaunchKernelEx(&lc.cfg, tma_gather_kernel, job_of(p, w.moves), (const int32_t *)w.n_moves)) != cudaSuccess)
            return gvr::set_error("gvr_sparda_prefetch: bulk-copy gather kernel", e);
        return 0;
    }
    const int ctas = p->max_ctas > 0 ? p->max_ctas : DEFAULT_CTAS;
    const int warps = p->cta_warps > 0 ? p->cta_warps : DEFAULT_CTA_WARPS;
    const int loads = p->lane_loads > 0 ? p->lane_loads : DEFAULT_LANE_LOADS;
    gvr::LaunchConfig lc((unsigned)ctas, (unsigned)(32 * warps), 0, 0, st);
    const GatherJob j = job_of(p, w.moves);
    const int32_t *nm = w.n_moves;
    e = loads == 4 ? cudaLaunchKernelEx(&lc.cfg, gather_kernel<4>, j, nm)
        : loads == 8 ? cudaLaunchKernelEx(&lc.cfg, gather_kernel<8>, j, nm)
                     : cudaLaunchKernelEx(&lc.cfg, gather_kernel<16>, j, nm);
    if (e != cudaSuccess)
        return gvr::set_error("gvr_sparda_prefetch: gather kernel", e);
    return 0;
}

GVR_API int gvr_sparda_kv_store(const gvr_kv_store_params *p, void *stream)
{
    const cudaStream_t st = (cudaStream_t)stream;
    const long long row = (long long)p->D * p->elem_bytes;
    const bool wide = row % 16 == 0 && (uintptr_t)p->k % 16 == 0 && (uintptr_t)p->v % 16 == 0 &&
                      (uintptr_t)p->dst_k % 16 == 0 && (uintptr_t)p->dst_v % 16 == 0 &&
                      (p->k_stride_t * p->elem_bytes) % 16 == 0 && (p->k_stride_h * p->elem_bytes) % 16 == 0 &&
                      (p->v_stride_t * p->elem_bytes) % 16 == 0 && (p->v_stride_h * p->elem_bytes) % 16 == 0 &&
                      (p->dk_stride_page * p->elem_bytes) % 16 == 0 && (p->dk_stride_tok * p->elem_bytes) % 16 == 0 &&
                      (p->dk_stride_head * p->elem_bytes) % 16 == 0 && (p->dv_stride_page * p->elem_bytes) % 16 == 0 &&
                      (p->dv_stride_tok * p->elem_bytes) % 16 == 0 && (p->dv_stride_head * p->elem_bytes) % 16 == 0;
    for (long long t0 = 0; t0 < p->T; t0 += STORE_CHUNK_TOKENS) {
        const long long t1 = t0 + STORE_CHUNK_TOKENS < p->T ? t0 + STORE_CHUNK_TOKENS : p->T;
        gvr::LaunchConfig lc((unsigned)((t1 - t0 + 7) / 8), 256, 0, 0, st);
        cudaError_t e;
        if (wide)
            e = cudaLaunchKernelEx(&lc.cfg, store_kernel<uint4>, *p, t0, t1);
        else if (p->elem_bytes == 4)
            e = cudaLaunchKernelEx(&lc.cfg, store_kernel<uint32_t>, *p, t0, t1);
        else if (p->elem_bytes == 2)
            e = cudaLaunchKernelEx(&lc.cfg, store_kernel<uint16_t>, *p, t0, t1);
        else
            e = cudaLaunchKernelEx(&lc.cfg, store_kernel<uint8_t>, *p, t0, t1);
        if (e != cudaSuccess)
            return gvr::set_error("gvr_sparda_kv_store", e);
    }
    return 0;
}

GVR_API int gvr_cuda_host_alloc(size_t bytes, void **ptr)
{
    const cudaError_t e = cudaHostAlloc(ptr, bytes ? bytes : 1, cudaHostAllocPortable | cudaHostAllocMapped);
    return e == cudaSuccess ? 0 : gvr::set_error("cudaHostAlloc (pinned, mapped)", e);
}

GVR_API int gvr_cuda_host_free(void *ptr)
{
    const cudaError_t e = cudaFreeHost(ptr);
    return e == cudaSuccess ? 0 : gvr::set_error("cudaFreeHost", e);
}

GVR_API int gvr_cuda_host_device_pointer(const void *ptr, size_t bytes, void **device_ptr)
{
    cudaPointerAttributes a0, a1;
    cudaError_t e = cudaPointerGetAttributes(&a0, ptr);
    if (e != cudaSuccess)
        return gvr::set_error("cudaPointerGetAttributes", e);
    if (a0.type != cudaMemoryTypeHost || !a0.devicePointer)
        return gvr::set_message(2, "%s", a0.type == cudaMemoryTypeDevice ? "device memory"
                                         : a0.type == cudaMemoryTypeManaged ? "managed memory"
                                         : a0.type == cudaMemoryTypeHost ? "pinned host memory that is not mapped"
                                                                          : "pageable host memory (not pinned)");
    const char *last = (const char *)ptr + (bytes ? bytes - 1 : 0);
    if ((e = cudaPointerGetAttributes(&a1, last)) != cudaSuccess)
        return gvr::set_error("cudaPointerGetAttributes", e);
    if (a1.type != cudaMemoryTypeHost || (const char *)a1.devicePointer - (const char *)a0.devicePointer !=
                                             last - (const char *)ptr)
        return gvr::set_message(2, "%s", "host memory whose range is not one pinned, mapped allocation");
    *device_ptr = a0.devicePointer;
    return 0;
}
