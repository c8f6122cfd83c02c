/* PRR's EMA predictor and its calibration on the CPU (the reference for the CUDA kernels and the
 * NumPy / torch-CPU path). Semantics: kernels/gvr_kernels.h, section "PRR EMA predictor and
 * calibration". */
#ifndef GVR_PRR_EMA_CPU_H
#define GVR_PRR_EMA_CPU_H

#include <stdint.h>

#include "../../kernels/gvr_kernels.h"

/* Each runs every row of p (host pointers), in parallel on the pool of cpu/threads.h when the work is
 * large enough; a row (or a grid point) is computed whole by one thread, so results do not depend on
 * the thread count. They call no Python API. Return 0, or -1 when scratch memory could not be
 * allocated (outputs are then unspecified). prr_ema_update_cpu with p->pred or p->row_len is the fused
 * update + predict (each row predicted right after its update, by the same thread). */
int prr_ema_predict_cpu(const gvr_ema_params *p);
int prr_ema_update_cpu(const gvr_ema_params *p);
int prr_ema_calibrate_cpu(const gvr_ema_calibrate_params *p);

#endif
