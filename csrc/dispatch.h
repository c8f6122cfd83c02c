/* Running an operator's computation once its intake is done: on the host (the GIL released) or on
 * the intake's CUDA device (the caller's current device restored afterwards), with errors as Python
 * exceptions. Shared by every csrc/<op>.c. */
#ifndef GVR_DISPATCH_H
#define GVR_DISPATCH_H

#include "buffer.h"
#include "cuda_lib.h"
#include "intake.h"

/* GVR_ELEM_* (gvr_kernels.h) of a float dtype */
int gvr_elem_of(gvr_dtype d);

/* fn(cu, params, ws, ws_bytes, stream) of the CUDA library; nonzero: failed (message in the library) */
typedef int (*gvr_cuda_call)(const gvr_cuda_api *cu, const void *params, void *ws, size_t ws_bytes, void *stream);

/* fn on in's CUDA device, the GIL released; 0, or -1 with a RuntimeError naming `what` */
int gvr_run_on_device(const gvr_intake *in, gvr_cuda_call fn, const void *params, void *ws, size_t ws_bytes,
                      intptr_t stream, const char *what);

/* fn(params) on the host, the GIL released; 0, or -1 with MemoryError (the CPU code's only failure) */
int gvr_run_on_host(int (*fn)(const void *), const void *params);

/* Host int32 [B] values of view v (any stride), each in [0, cap], copied contiguous into dst; else
 * a ValueError "'name' must lie in [0, what] = [0, cap], got name[b] = x" and -1. */
int gvr_read_host_counts(const gvr_view *v, const char *name, const char *what, int64_t B, int64_t cap,
                         int32_t *dst);

/* The host end/lengths and start counts of an append-style call (Quest block metadata, SparDA compressed
 * keys), each in [0, cap] (max_pages * P): copied into one malloc'd block *copy (the caller frees it;
 * NULL views are left out) and pointed to by *end_out / *start_out. end is named "end" when updating,
 * "lengths" when building. 0, or -1 with the exception set. */
int gvr_read_host_range(const gvr_view *end, const gvr_view *start, int update, int64_t B, int64_t cap,
                        int32_t **copy, const int32_t **end_out, const int32_t **start_out);


#endif
