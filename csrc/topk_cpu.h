/* Exact decode-time Top-K on the CPU (the reference for the CUDA kernels and a fast NumPy path). */
#ifndef GVR_TOPK_CPU_H
#define GVR_TOPK_CPU_H

#include <stdint.h>

#include "../kernels/gvr_kernels.h"

/* Sortable 32-bit key of a float: larger key = later in the Top-K order's "larger" direction.
 * NaN -> 0 (below everything, -inf included), -0.0 and +0.0 share one key. */
static inline uint32_t gvr_float_key(float f)
{
    union { float f; uint32_t u; } c = {f};
    uint32_t b = c.u;
    if ((b & 0x7FFFFFFFu) > 0x7F800000u)
        return 0u;
    if (b == 0x80000000u)
        b = 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* Runs every row of p (host pointers). num_threads <= 1 runs rows serially.
 * Returns 0, or -1 when memory for candidates could not be allocated. */
int topk_decode_cpu(const gvr_topk_params *p, int num_threads);

/* Statistics of the last serial call (for benchmarks and tests of the search itself). */
typedef struct {
    int count_passes;   /* full-row counting passes */
    int64_t candidates; /* size of the candidate set that was collected */
} gvr_topk_cpu_stats;
void topk_cpu_last_stats(gvr_topk_cpu_stats *s);

#endif
