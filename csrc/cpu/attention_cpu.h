/* Sparse decode attention, attention-state merging and PRR repair helpers on the CPU (the reference
 * for the CUDA kernels and the NumPy / torch-CPU path). Semantics: kernels/gvr_kernels.h, section
 * "sparse attention, attention states, PRR repair". q, caches and states in F32, F16 or BF16;
 * fp32 accumulation. */
#ifndef GVR_ATTENTION_CPU_H
#define GVR_ATTENTION_CPU_H

#include <stdint.h>

#include "../../kernels/gvr_kernels.h"

/* Each runs every row of p (host pointers), in parallel on the pool of cpu/threads.h when the work is
 * large enough; each row is computed whole by one thread, so results do not depend on the thread
 * count. They call no Python API (the caller may hold no GIL). Return 0, or -1 when scratch memory
 * could not be allocated (outputs are then unspecified). */
int sparse_attention_cpu(const gvr_attention_params *p);
int merge_states_cpu(const gvr_merge_params *p);
int prr_missed_cpu(const gvr_missed_params *p);
int prr_finalize_cpu(const gvr_finalize_params *p);

/* The instruction set of sparse_attention_cpu's loops in this process: "avx2" or "generic" (the best
 * the CPU runs; GVR_CPU_ISA=generic in the environment forces the generic C loops). */
const char *attention_cpu_isa(void);

#endif
