/* runtime.cu: the runtime entry points of the C ABI (gvr_kernels.h): version, last error, device
 * selection, synchronization and the device-to-host copy of the opt-in validation; and the
 * thread-local last-error message every entry point reports through (runtime.cuh). */
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>

#include "common/runtime.cuh"
#include "gvr_kernels.h"

#define GVR_API extern "C" __attribute__((visibility("default")))

namespace gvr {
namespace {
thread_local char g_last_error[512] = "no error";
}

int set_error(const char *what, cudaError_t e)
{
    snprintf(g_last_error, sizeof g_last_error, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return (int)e;
}

int set_message(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    return status;
}

} // namespace gvr

GVR_API int gvr_cuda_abi_version(void) { return GVR_ABI_VERSION; }

GVR_API const char *gvr_cuda_last_error(void) { return gvr::g_last_error; }

GVR_API int gvr_cuda_set_device(int device, int *previous)
{
    int cur = -1;
    cudaError_t e = cudaGetDevice(&cur);
    if (e != cudaSuccess)
        return gvr::set_error("cudaGetDevice", e);
    if (previous)
        *previous = cur;
    if (cur == device)
        return 0;
    e = cudaSetDevice(device);
    return e == cudaSuccess ? 0 : gvr::set_error("cudaSetDevice", e);
}

GVR_API int gvr_cuda_synchronize(void *stream)
{
    cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
    return e == cudaSuccess ? 0 : gvr::set_error("cudaStreamSynchronize", e);
}

GVR_API int gvr_cuda_copy_to_host(void *dst, const void *src, size_t n, void *stream)
{
    cudaError_t e = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, (cudaStream_t)stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize((cudaStream_t)stream);
    return e == cudaSuccess ? 0 : gvr::set_error("copy to host", e);
}
