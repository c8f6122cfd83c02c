/* SparDA on the CPU: compressed keys, the prefetch plan and gather, the KV store (semantics in
 * kernels/gvr_kernels.h). */
#ifndef GVR_SPARDA_CPU_H
#define GVR_SPARDA_CPU_H

#include "../../kernels/gvr_kernels.h"

/* 0, or -1 when out of memory */
int sparda_compressed_keys_cpu(const gvr_sparda_ckeys_params *p);

/* The prefetch policy on host arrays (indices, block_table, resident, slot_map, counts of p): writes
 * slot_map and counts, and the moves (pairs host page, staging page, in the order the policy hands
 * out slots) into moves (room for 2 * min(B*Hsel*n, B*max_pages, S) int32); *n_moves their count.
 * Host and staging pointers are not read. 0, or -1 when out of memory. */
int sparda_prefetch_plan_cpu(const gvr_prefetch_params *p, int32_t *moves, int32_t *n_moves);

/* The whole prefetch on host memory (plan, then one memcpy per moved page of K and of V). */
int sparda_prefetch_cpu(const gvr_prefetch_params *p);

/* The KV store on host memory (tokens in order: later tokens win). */
int sparda_kv_store_cpu(const gvr_kv_store_params *p);

#endif
