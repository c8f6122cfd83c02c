/* profile.cuh: phase stamps for debug builds only (-DGVR_PROFILE, scripts/profile_phases.py):
 * clock64 stamps of CTA GVR_PROF_CTA (default 0), thread 0, and every CTA's start and end on the
 * global timer (ns; CTAs < PROF_SPANS, [64 + 2 cta], [64 + 2 cta + 1]; the grid size in [62]), read
 * back with gvr_debug_clocks() (PROF_WORDS long longs). Each translation unit has its own stamp
 * buffer (no relocatable device code): profile_read() reads this TU's. The stamp counter lives in
 * shared memory (a global one costs an L2 round trip per stamp). Without GVR_PROFILE the macros are
 * empty. */
#pragma once

#ifdef GVR_PROFILE
#include <cuda_runtime.h>

#ifndef GVR_PROF_CTA
#define GVR_PROF_CTA 0 /* the CTA whose phases PROF stamps (-DGVR_PROF_CTA=1: rank 1 of row 0's cluster) */
#endif
constexpr int PROF_SPANS = 1024;
constexpr int PROF_WORDS = 64 + 2 * PROF_SPANS;
static __device__ long long g_prof[PROF_WORDS];
static __shared__ int s_nprof;
#define PROF_RESET()                                                                                  \
    do {                                                                                              \
        if (threadIdx.x == 0)                                                                         \
            s_nprof = 0;                                                                              \
    } while (0)
#define PROFV(tag, v)                                                                                 \
    do {                                                                                              \
        if (blockIdx.x == GVR_PROF_CTA && threadIdx.x == 0 && s_nprof < 62) {                         \
            g_prof[s_nprof] = (long long)(v) * 100 + (tag);                                           \
            s_nprof++;                                                                                \
            g_prof[63] = s_nprof;                                                                     \
        }                                                                                             \
    } while (0)
#define PROF(tag) PROFV(tag, clock64())
/* this CTA's start (i = 0) or end (i = 1) on the global timer, by thread 0 */
#define PROF_SPAN(i)                                                                                  \
    do {                                                                                              \
        if (threadIdx.x == 0 && blockIdx.x < PROF_SPANS) {                                            \
            unsigned long long t_;                                                                    \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                    \
            g_prof[64 + 2 * blockIdx.x + (i)] = (long long)t_;                                        \
            if (blockIdx.x == 0 && (i) == 0)                                                          \
                g_prof[62] = gridDim.x;                                                               \
        }                                                                                             \
    } while (0)
/* this translation unit's stamps (PROF_WORDS long longs) */
static inline cudaError_t profile_read(long long *host)
{
    return cudaMemcpyFromSymbol(host, g_prof, sizeof(long long) * PROF_WORDS);
}
#else
#define PROFV(tag, v) ((void)0)
#define PROF(tag) ((void)0)
#define PROF_RESET() ((void)0)
#define PROF_SPAN(i) ((void)0)
#endif
