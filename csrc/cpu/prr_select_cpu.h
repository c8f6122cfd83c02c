/* PRR's selection stage on the CPU: Quest block metadata (build and in-place update) and block
 * scores (the references for kernels/prr/select.cu and the NumPy / torch-CPU path). Semantics:
 * kernels/gvr_kernels.h, section "PRR selection stage". k, q and meta in F32, F16 or BF16. */
#ifndef GVR_PRR_SELECT_CPU_H
#define GVR_PRR_SELECT_CPU_H

#include <stdint.h>

#include "../../kernels/gvr_kernels.h"

/* Each runs every (row b, KV head h) unit of p (host pointers), in parallel on the pool of
 * cpu/threads.h when the work is large enough; a unit is computed whole by one thread, so results
 * never depend on the thread count. No Python API (the caller may hold no GIL). Return 0, or -1 when
 * scratch memory could not be allocated (outputs are then unspecified). */
int prr_block_metadata_cpu(const gvr_block_meta_params *p);
int prr_block_scores_cpu(const gvr_block_scores_params *p);

#endif
