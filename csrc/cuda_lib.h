/* Lazy loading of libgvr_cuda.so (gvr/_lib/), so that gvr._C imports and runs its CPU paths on
 * machines without CUDA. The function table is generated from GVR_CUDA_SYMBOLS (gvr_kernels.h):
 * an entry point added there is loaded here without further code. */
#ifndef GVR_CUDA_LIB_H
#define GVR_CUDA_LIB_H

#include <stddef.h>

#include "../kernels/gvr_kernels.h"

typedef struct {
#define GVR_CUDA_FIELD(ret, field, symbol, params) ret(*field) params;
    GVR_CUDA_SYMBOLS(GVR_CUDA_FIELD)
#undef GVR_CUDA_FIELD
} gvr_cuda_api;

/* The loaded library, or NULL with a RuntimeError set that says why. Needs the GIL. */
const gvr_cuda_api *gvr_cuda(void);
/* Where the library is looked for (for messages and gvr.build_info()). */
const char *gvr_cuda_path(void);
/* Raise RuntimeError with the library's last message; returns NULL. */
void *gvr_cuda_raise(const char *what);

#endif
