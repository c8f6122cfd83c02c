/* gvr_kernels.h: the whole C ABI of libgvr_cuda.so, and the parameter blocks shared with the CPU
 * implementations in csrc/.
 *
 * Conventions (ARCHITECTURE.md): plain C types only; raw pointers (device pointers for the CUDA
 * entry points); strides in elements; a caller-owned workspace whose size comes from a query call;
 * the stream as void* (a cudaStream_t); every entry point returns 0 on success or a nonzero status
 * with a message from gvr_cuda_last_error(). Launchers validate nothing (gvr._C did, from the limits
 * below), never allocate, never synchronize.
 *
 * Adding an operator: its parameter struct and limits here, its entry points in GVR_CUDA_SYMBOLS
 * (csrc/cuda_lib.c loads every symbol of that list), its kernels in kernels/<op>/. */
#ifndef GVR_KERNELS_H
#define GVR_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GVR_ABI_VERSION 3

/* ---- runtime ------------------------------------------------------------------------------- */

int gvr_cuda_abi_version(void);
const char *gvr_cuda_last_error(void);
/* Make device the calling thread's current device (the device of the buffers of the next call);
 * *previous receives the device that was current, so the caller can restore it. */
int gvr_cuda_set_device(int device, int *previous);
/* Wait for the stream's work (the opt-in GVR_CHECK=1 validation and tests only). */
int gvr_cuda_synchronize(void *stream);
/* Copy n bytes from device to host, ordered on stream, and wait (GVR_CHECK=1 validation only). */
int gvr_cuda_copy_to_host(void *dst, const void *src, size_t n, void *stream);

/* ---- topk_decode --------------------------------------------------------------------------- */

/* Method selector: AUTO picks the fastest exact path measured (today: RADIX for N <= 4096, GVR
 * above). Every method gives the same result: the choice changes speed only. */
enum { GVR_TOPK_AUTO = 0, GVR_TOPK_GVR = 1, GVR_TOPK_RADIX = 2 };

/* Limits of the CUDA path (the intake raises a ValueError naming them). */
#define GVR_TOPK_MAX_N (1 << 30)         /* scores per row */
#define GVR_TOPK_SORTED_MAX_K 4096       /* sorted=1 */
#define GVR_RADIX_MAX_POSITIONS 524288   /* method RADIX: positions per row, see gvr_topk_row_positions */

/* Exact decode-time Top-K of B rows of fp32 scores.
 * Row b is scores[b*row_stride + 0 .. len_b), len_b = lengths ? clamp(lengths[b], 0, N) : N.
 * Result row b (out[b*out_stride + 0 .. k)): min(k, len_b) distinct indices of the first min(k, len_b)
 * elements of the total order (value descending, -0 == +0, -inf valid, NaN below -inf, ties to the
 * lower index; kernels/common/gvr_keys.h), then -1. With sorted != 0 they appear in that order;
 * otherwise in an order that is deterministic but unspecified.
 * prev (nullable): the previous step's Top-K, row b at prev[b*prev_stride + 0 .. Kp) (prev_stride 0
 * broadcasts one row). A hint: any content (out of range, -1, duplicates) gives the same result. */
typedef struct {
    const float *scores;
    int64_t row_stride;
    int32_t B;
    int32_t N;
    const int32_t *lengths;
    const int32_t *prev;
    int64_t prev_stride;
    int32_t Kp;
    int32_t k;
    int32_t sorted;
    int32_t method;
    int32_t *out;
    int64_t out_stride;
} gvr_topk_params;

/* The kernels read each row in 16-byte aligned coordinates: position q holds element q - s, s = the
 * row's start in floats past a 16-byte boundary (0..3). Positions a launch covers per row: N plus the
 * largest s of its rows (that of the first row when all rows share it). The radix path holds at most
 * GVR_RADIX_MAX_POSITIONS. Shared by the library and the intake (which raises the ValueError). */
static inline int64_t gvr_topk_row_positions(const gvr_topk_params *p)
{
    const int64_t s0 = (int64_t)(((uintptr_t)p->scores >> 2) & 3u);
    return (int64_t)p->N + ((p->B <= 1 || p->row_stride % 4 == 0) ? s0 : 3);
}

/* Bytes of device workspace gvr_topk_decode needs for these parameters (0 today for every path:
 * multi-CTA rows reduce through distributed shared memory). */
size_t gvr_topk_decode_workspace_size(const gvr_topk_params *p);
int gvr_topk_decode(const gvr_topk_params *p, void *workspace, size_t workspace_bytes, void *stream);

/* ---- the symbol list ------------------------------------------------------------------------ */

/* Every entry point, as X(return type, field name, symbol, parameter list): csrc/cuda_lib.c builds its
 * function table and dlsym loop from this list, so an operator's entry points are named once. */
#define GVR_CUDA_SYMBOLS(X)                                                                          \
    X(int, abi_version, gvr_cuda_abi_version, (void))                                                \
    X(const char *, last_error, gvr_cuda_last_error, (void))                                         \
    X(int, set_device, gvr_cuda_set_device, (int, int *))                                            \
    X(int, synchronize, gvr_cuda_synchronize, (void *))                                              \
    X(int, copy_to_host, gvr_cuda_copy_to_host, (void *, const void *, size_t, void *))              \
    X(size_t, topk_workspace_size, gvr_topk_decode_workspace_size, (const gvr_topk_params *))        \
    X(int, topk_decode, gvr_topk_decode, (const gvr_topk_params *, void *, size_t, void *))

#ifdef __cplusplus
}
#endif

#endif
