/* Exact decode-time Top-K on the CPU (the reference for the CUDA kernels and a fast NumPy path). */
#ifndef GVR_TOPK_CPU_H
#define GVR_TOPK_CPU_H

#include <stdint.h>

#include "../../kernels/gvr_kernels.h"

/* Runs every row of p (host pointers), in parallel on the pool of cpu/threads.h when the work is
 * large enough (results do not depend on the thread count).
 * Returns 0, or -1 when memory for candidates could not be allocated. */
int topk_decode_cpu(const gvr_topk_params *p);

/* The page-table transform of a finished result (gvr_kernels.h, gvr_topk_params.block_table): out's
 * positions -> physical slots, the positions into out_pos when given. */
void topk_map_cpu(const gvr_topk_params *p);
/* the first row b (-1: none) whose block table maps a position of the row (below its length) to a slot
 * past INT32_MAX, with the page's index and entry */
int64_t topk_map_overflow_cpu(const gvr_topk_params *p, int64_t *page_index, int32_t *page);

/* Statistics of the calling thread's last row (for benchmarks and tests of the search itself). */
typedef struct {
    int count_passes;   /* full-row counting passes */
    int64_t candidates; /* size of the candidate set that was collected */
} gvr_topk_cpu_stats;
void topk_cpu_last_stats(gvr_topk_cpu_stats *s);

#endif
