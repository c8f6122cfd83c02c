/* runtime.cuh: the library's error reporting. Every entry point returns 0 or a nonzero status whose
 * message the calling thread reads with gvr_cuda_last_error() (gvr_kernels.h); the message lives in
 * thread-local storage in runtime.cu. */
#pragma once

#include <cuda_runtime.h>

namespace gvr {

/* Record "what: <CUDA error string> (<name>)" as the calling thread's last error; returns (int)e. */
int set_error(const char *what, cudaError_t e);

/* Record a printf-formatted message as the calling thread's last error; returns status. */
int set_message(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

} // namespace gvr
