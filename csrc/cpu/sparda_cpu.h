/* SparDA on the CPU: compressed keys (semantics in kernels/gvr_kernels.h). */
#ifndef GVR_SPARDA_CPU_H
#define GVR_SPARDA_CPU_H

#include "../../kernels/gvr_kernels.h"

/* 0, or -1 when out of memory */
int sparda_compressed_keys_cpu(const gvr_sparda_ckeys_params *p);

#endif
