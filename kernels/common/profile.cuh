/* profile.cuh: phase stamps for debug builds only (-DGVR_PROFILE, scripts/profile_phases.py):
 * clock64 stamps of row 0, CTA 0, thread 0, read back with gvr_debug_clocks(). Each translation
 * unit has its own stamp buffer (no relocatable device code): profile_read() reads this TU's. The
 * stamp counter lives in shared memory (a global one costs an L2 round trip per stamp). Without
 * GVR_PROFILE the macros are empty. */
#pragma once

#ifdef GVR_PROFILE
#include <cuda_runtime.h>

static __device__ long long g_prof[64];
static __shared__ int s_nprof;
#define PROF_RESET()                                                                                  \
    do {                                                                                              \
        if (threadIdx.x == 0)                                                                         \
            s_nprof = 0;                                                                              \
    } while (0)
#define PROFV(tag, v)                                                                                 \
    do {                                                                                              \
        if (blockIdx.x == 0 && threadIdx.x == 0 && s_nprof < 62) {                                    \
            g_prof[s_nprof] = (long long)(v) * 100 + (tag);                                           \
            s_nprof++;                                                                                \
            g_prof[63] = s_nprof;                                                                     \
        }                                                                                             \
    } while (0)
#define PROF(tag) PROFV(tag, clock64())
/* this translation unit's stamps (64 long longs) */
static inline cudaError_t profile_read(long long *host) { return cudaMemcpyFromSymbol(host, g_prof, sizeof(long long) * 64); }
#else
#define PROFV(tag, v) ((void)0)
#define PROF(tag) ((void)0)
#define PROF_RESET() ((void)0)
#endif
