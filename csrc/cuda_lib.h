/* Lazy loading of libgvr_cuda.so (gvr/_lib/), so that gvr._C imports and runs its CPU paths on
 * machines without CUDA. */
#ifndef GVR_CUDA_LIB_H
#define GVR_CUDA_LIB_H

#include <stddef.h>

#include "../kernels/gvr_kernels.h"

typedef struct {
    int (*abi_version)(void);
    const char *(*last_error)(void);
    int (*set_device)(int device, int *previous);
    size_t (*topk_workspace_size)(const gvr_topk_params *p);
    int (*topk_decode)(const gvr_topk_params *p, void *ws, size_t ws_bytes, void *stream);
    int (*synchronize)(void *stream);
    int (*copy_to_host)(void *dst, const void *src, size_t n, void *stream);
} gvr_cuda_api;

/* The loaded library, or NULL with a RuntimeError set that says why. Needs the GIL. */
const gvr_cuda_api *gvr_cuda(void);
/* Where the library is looked for (for messages and gvr.build_info()). */
const char *gvr_cuda_path(void);
/* Raise RuntimeError with the library's last message; returns NULL. */
void *gvr_cuda_raise(const char *what);

#endif
