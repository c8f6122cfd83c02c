/* prefetcher.cu: SparDA's persistent prefetcher (gvr_kernels.h, "The persistent prefetcher").
 *
 * State: a control block in pinned, mapped host memory (stop / abort written by the host; the error code
 * written by the device, read by the host without a CUDA call) and a queue in device memory: per slot a
 * request (the gather job and its move count) and its ready word (sequence + 1 once published), a
 * counter of CTAs done with the slot, the submit counter (tail) and the completion counter.
 *
 * submit (one CTA on the caller's stream): thread 0 takes seq = tail++, waits (bounded) until request
 * seq - depth completed (its slot is free), the CTA runs the slot policy in the slot's workspace, then
 * thread 0 publishes the job and ready[slot] = seq + 1 (release). The persistent kernel (ctas CTAs on
 * the prefetcher's stream): every CTA walks the sequence in order; thread 0 acquires ready[slot], the
 * CTA, once the request before it is complete (requests land in order), gathers its pieces of the job
 * (CTA-strided), then the last CTA to finish resets the slot's count
 * and releases completed = seq + 1. wait (one thread on the consumer's stream): acquires completed >=
 * ticket + 1 (bounded). Stop: the kernel leaves when the queue is empty and stop is set; abort: at once.
 * The persistent kernel starts at creation or later (gvr_prefetcher_start): submits and waits captured
 * into a CUDA graph before it starts replay while it runs. Its CTAs have cta_warps warps with lane_loads
 * loads in flight per lane (plan.cuh's gather). */
#include <cuda_runtime.h>

#include <cstdint>
#include <time.h>

#include "common/runtime.cuh"
#include "gvr_kernels.h"
#include "sparda/plan.cuh"

#define GVR_API extern "C" __attribute__((visibility("default")))

namespace gvr::sparda {
namespace {

struct Ctrl { /* mapped host memory */
    volatile int32_t stop, abort, error, running;
};

struct Request {
    GatherJob job;
    long long n;
};

struct Queue { /* device memory */
    Request *req;
    unsigned long long *ready;
    unsigned *done;
    unsigned long long *tail, *completed;
};

struct Handle {
    Ctrl *ctrl;     /* host view */
    Ctrl *ctrl_dev; /* device view */
    void *queue_mem;
    Queue q;
    cudaStream_t stream;
    gvr_prefetcher_config cfg;
    int device;
    void (*kernel)(Queue, Ctrl *, int); /* the persistent kernel's instance (lane_loads) */
    int threads;
    bool started;
};

__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long *p)
{
    unsigned long long v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release(unsigned long long *p, unsigned long long v)
{
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long now_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void __launch_bounds__(PLAN_THREADS) submit_kernel(const gvr_prefetch_params p, Queue q, Ctrl *ctrl,
                                                              char *slot_ws, size_t slot_ws_bytes, int depth,
                                                              long long timeout_ns, int64_t *ticket)
{
    __shared__ unsigned long long seq_s;
    __shared__ int ok_s;
    if (threadIdx.x == 0) {
        const unsigned long long seq = atomicAdd(q.tail, 1ull);
        int ok = 1;
        if (seq >= (unsigned long long)depth) {
            const unsigned long long t0 = now_ns();
            while (ld_acquire(q.completed) + depth <= seq) {
                if (ctrl->abort || now_ns() - t0 > (unsigned long long)timeout_ns) {
                    ctrl->error = 1;
                    ok = 0;
                    break;
                }
                __nanosleep(200);
            }
        }
        seq_s = seq;
        ok_s = ok;
        *ticket = (int64_t)seq;
    }
    __syncthreads();
    const unsigned long long seq = seq_s;
    const int slot = (int)(seq % (unsigned long long)depth);
    long long n = 0;
    const Workspace w = carve(&p, slot_ws + (size_t)slot * slot_ws_bytes);
    if (ok_s)
        n = plan_policy(p, w);
    __syncthreads();
    if (threadIdx.x == 0) {
        Request r;
        r.job = job_of(&p, w.moves);
        r.n = ok_s ? n : 0; /* a slot not freed in time: publish nothing to move, the error is set */
        q.req[slot] = r;
        __threadfence();
        st_release(&q.ready[slot], seq + 1);
    }
}

template <int PER_LANE>
__global__ void __launch_bounds__(GATHER_THREADS) persistent_kernel(Queue q, Ctrl *ctrl, int depth)
{
    __shared__ int go;
    __shared__ Request r;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        ctrl->running = 1;
    for (unsigned long long seq = 0;; seq++) {
        const int slot = (int)(seq % (unsigned long long)depth);
        if (threadIdx.x == 0) {
            int state = 0;
            for (unsigned spins = 0;; spins++) {
                /* published, and the request before it complete in every CTA: requests land in order (two
                 * requests may name one staging page) */
                if (ld_acquire(&q.ready[slot]) == seq + 1 && ld_acquire(q.completed) >= seq) {
                    state = 1;
                    break;
                }
                if ((spins & 63) == 0 && (ctrl->abort || ctrl->stop)) /* a read over PCIe: now and then */
                    break;
                __nanosleep(spins < 1024 ? 64 : 1000);
            }
            if (state)
                r = q.req[slot];
            go = state;
        }
        __syncthreads();
        if (!go)
            break;
        gather_grid<PER_LANE>(r.job, r.n);
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            if (atomicAdd(&q.done[slot], 1u) == gridDim.x - 1) {
                q.done[slot] = 0;
                __threadfence();
                st_release(q.completed, seq + 1);
            }
        }
        __syncthreads();
    }
    if (blockIdx.x == 0 && threadIdx.x == 0)
        ctrl->running = 0;
}

__global__ void wait_kernel(Queue q, Ctrl *ctrl, const int64_t *ticket, long long timeout_ns)
{
    const unsigned long long want = (unsigned long long)*ticket + 1, t0 = now_ns();
    while (ld_acquire(q.completed) < want) {
        if (ctrl->abort || now_ns() - t0 > (unsigned long long)timeout_ns) {
            ctrl->error = 2;
            return;
        }
        __nanosleep(100);
    }
}

} // namespace
} // namespace gvr::sparda

using namespace gvr::sparda;

static void (*persistent_for(int loads))(Queue, Ctrl *, int)
{
    return loads == 4 ? persistent_kernel<4> : loads == 8 ? persistent_kernel<8> : persistent_kernel<16>;
}

static void release(Handle *h)
{
    if (h->stream)
        cudaStreamDestroy(h->stream);
    if (h->queue_mem)
        cudaFree(h->queue_mem);
    if (h->ctrl)
        cudaFreeHost(h->ctrl);
    delete h;
}

GVR_API int gvr_prefetcher_create(const gvr_prefetcher_config *c, void **handle)
{
    cudaError_t e;
    int dev = 0, sms = 0, per_sm = 0;
    const int warps = c->cta_warps > 0 ? c->cta_warps : DEFAULT_CTA_WARPS;
    const int loads = c->lane_loads > 0 ? c->lane_loads : DEFAULT_LANE_LOADS;
    void (*kernel)(Queue, Ctrl *, int) = persistent_for(loads);
    if ((e = cudaGetDevice(&dev)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess ||
        (e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * warps, 0)) != cudaSuccess)
        return gvr::set_error("gvr_prefetcher_create: device query", e);
    /* CUDA's lazy loading loads a kernel at its first launch, and loading may synchronize the context: a
     * first submit or wait launched while the persistent kernel spins would wait for it, and it for them.
     * Load them now (a function query loads its module). */
    cudaFuncAttributes fa;
    if ((e = cudaFuncGetAttributes(&fa, submit_kernel)) != cudaSuccess ||
        (e = cudaFuncGetAttributes(&fa, wait_kernel)) != cudaSuccess)
        return gvr::set_error("gvr_prefetcher_create: loading the submit and wait kernels", e);
    /* every CTA must be resident at once: each request waits for all of them */
    if (c->ctas > sms * per_sm)
        return gvr::set_message(1, "gvr_prefetcher_create: %d CTAs cannot all be resident on this device (at most %d)",
                                c->ctas, sms * per_sm);
    Handle *h = new Handle();
    h->cfg = *c;
    h->kernel = kernel;
    h->threads = 32 * warps;
    h->device = dev;
    const int depth = c->depth;
    const size_t bytes = align256((size_t)depth * sizeof(Request)) + align256((size_t)depth * 8) +
                         align256((size_t)depth * 4) + 256;
    if ((e = cudaHostAlloc((void **)&h->ctrl, sizeof(Ctrl), cudaHostAllocMapped | cudaHostAllocPortable)) != cudaSuccess) {
        h->ctrl = nullptr;
        release(h);
        return gvr::set_error("gvr_prefetcher_create: pinned control block", e);
    }
    h->ctrl->stop = h->ctrl->abort = h->ctrl->error = h->ctrl->running = 0;
    if ((e = cudaHostGetDevicePointer((void **)&h->ctrl_dev, h->ctrl, 0)) != cudaSuccess ||
        (e = cudaMalloc(&h->queue_mem, bytes)) != cudaSuccess) {
        h->queue_mem = nullptr;
        release(h);
        return gvr::set_error("gvr_prefetcher_create: queue", e);
    }
    char *m = (char *)h->queue_mem;
    h->q.req = (Request *)m;
    m += align256((size_t)depth * sizeof(Request));
    h->q.ready = (unsigned long long *)m;
    m += align256((size_t)depth * 8);
    h->q.done = (unsigned *)m;
    m += align256((size_t)depth * 4);
    h->q.tail = (unsigned long long *)m;
    h->q.completed = h->q.tail + 1;
    if ((e = cudaStreamCreateWithFlags(&h->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (e = cudaMemsetAsync(h->queue_mem, 0, bytes, h->stream)) != cudaSuccess ||
        (e = cudaStreamSynchronize(h->stream)) != cudaSuccess) {
        release(h);
        return gvr::set_error("gvr_prefetcher_create: stream", e);
    }
    if (c->start && gvr_prefetcher_start(h)) {
        release(h);
        return 1;
    }
    *handle = h;
    return 0;
}

GVR_API int gvr_prefetcher_start(void *handle)
{
    Handle *h = (Handle *)handle;
    if (h->started)
        return 0;
    h->kernel<<<h->cfg.ctas, h->threads, 0, h->stream>>>(h->q, h->ctrl_dev, h->cfg.depth);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return gvr::set_error("gvr_prefetcher_start: launching the persistent kernel", e);
    h->started = true;
    return 0;
}

GVR_API int gvr_prefetcher_submit(void *handle, const gvr_prefetch_params *p, int64_t *ticket, void *stream)
{
    Handle *h = (Handle *)handle;
    if (workspace_bytes(p) > h->cfg.slot_ws_bytes)
        return gvr::set_message(1, "gvr_prefetcher_submit: the call needs %zu bytes of slot workspace, the prefetcher "
                                   "has %zu", workspace_bytes(p), h->cfg.slot_ws_bytes);
    submit_kernel<<<1, PLAN_THREADS, 0, (cudaStream_t)stream>>>(*p, h->q, h->ctrl_dev, (char *)h->cfg.slot_workspace,
                                                                h->cfg.slot_ws_bytes, h->cfg.depth, h->cfg.timeout_ns,
                                                                ticket);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prefetcher_submit", e);
}

GVR_API int gvr_prefetcher_wait(void *handle, const int64_t *ticket, void *stream)
{
    Handle *h = (Handle *)handle;
    wait_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(h->q, h->ctrl_dev, ticket, h->cfg.timeout_ns);
    const cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : gvr::set_error("gvr_prefetcher_wait", e);
}

GVR_API int gvr_prefetcher_status(void *handle, int32_t *error, int64_t *completed, int32_t *running)
{
    Handle *h = (Handle *)handle;
    /* mapped host memory only: no CUDA call (a stream query would invalidate a capture in progress) */
    *error = h->ctrl->error;
    *running = h->ctrl->running;
    *completed = -1; /* the counter lives in device memory: not read from the host while the kernel runs */
    return 0;
}

static int64_t wall_ms()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static bool stopped_within(cudaStream_t s, int64_t ms)
{
    const int64_t t0 = wall_ms();
    timespec ts{0, 200000};
    for (;;) {
        if (cudaStreamQuery(s) != cudaErrorNotReady)
            return true;
        if (wall_ms() - t0 > ms)
            return false;
        nanosleep(&ts, nullptr);
    }
}

GVR_API int gvr_prefetcher_close(void *handle, int64_t timeout_ms)
{
    Handle *h = (Handle *)handle;
    h->ctrl->stop = 1;
    if (h->started && !stopped_within(h->stream, timeout_ms)) {
        h->ctrl->abort = 1;
        if (!stopped_within(h->stream, 1000))
            return gvr::set_message(3, "gvr_prefetcher_close: the persistent kernel did not stop (its memory stays "
                                       "allocated)");
    }
    cudaGetLastError();
    release(h);
    return 0;
}
