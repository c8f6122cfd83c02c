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

#define GVR_ABI_VERSION 4

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

/* ---- sparse attention, attention states, PRR repair --------------------------------------- */

/* Element types of attention tensors (q, caches, states). The CUDA path serves F16 and BF16 q/caches
 * (and F32 states); the CPU path serves all three everywhere. */
enum { GVR_ELEM_F32 = 0, GVR_ELEM_F16 = 1, GVR_ELEM_BF16 = 2 };

/* Limits of the CUDA path (the intake raises a ValueError naming them). */
#define GVR_ATTN_MAX_GQA 16 /* Hq / Hkv */
/* head dims: 64, 128, 256 (gvr_attention_cuda_head_dim_ok) */
static inline int gvr_attention_cuda_head_dim_ok(int D) { return D == 64 || D == 128 || D == 256; }

/* Decode attention of B rows of Hq query heads over a selected subset of a paged KV cache, giving an
 * attention state: out (the softmax-weighted sum of V) and lse (natural log of the sum of
 * exp(scale * q.k) over the attended positions).
 *
 * Cache: token slot t of page p of K is k + p*k_stride_page + t*k_stride_tok + h*k_stride_head
 * (elements; unit stride along D); V likewise. GQA: query head h reads KV head h / (Hq / Hkv).
 * Selection: indices[b*idx_stride_b + s*idx_stride_h + e], e < n, s = 0 (Hsel == 1: every KV head) or
 * the KV head (Hsel == Hkv). Each entry names
 *  - with block_table (non-NULL): logical block e of G = block_size tokens of row b: tokens
 *    t = e*G + i (i < G), those with t >= len_b skipped (len_b = lengths ? lengths[b] : max_pages*P,
 *    clamped to [0, max_pages*P]; gvr._C raises a ValueError for host lengths out of that range),
 *    token t at page block_table[b*bt_stride_b + t/P], slot t % P;
 *  - without: the physical token slot e of the flattened cache (page e / P, slot e % P), G = 1.
 * Entries < 0 are empty; entries or pages out of range (slot >= num_pages*P, page < 0 or >= num_pages)
 * name nothing and are skipped the same way, so no input reads outside the cache. Entries are
 * attended as listed: an entry listed twice counts twice (as a gather + dense attention does).
 * A row/head that attends nothing has the empty state (out 0, lse -inf).
 *
 * accumulate != 0 (PRR repair): out (float32) and lse hold a state on entry; the result is that
 * state merged with the attention over `indices` (an empty selection leaves it bit-identical).
 * part_out/part_lse (nullable, float32 [B, Hq, n, D] / [B, Hq, n]): also write the state of each entry
 * alone (empty entries: 0, -inf), for gvr_prr_finalize (exact mode).
 *
 * Deterministic: how the entries are split over CTAs depends on the shapes and the device's SM count
 * only; the split states are merged in a fixed order. */
typedef struct {
    int32_t dtype; /* q, k, v: GVR_ELEM_* */
    int32_t B, Hq, Hkv, D;
    const void *q;
    int64_t q_stride_b, q_stride_h;
    const void *k;
    int64_t k_stride_page, k_stride_tok, k_stride_head;
    const void *v;
    int64_t v_stride_page, v_stride_tok, v_stride_head;
    int64_t num_pages;
    int32_t P;
    const int32_t *indices;
    int64_t idx_stride_b, idx_stride_h;
    int32_t Hsel, n;
    const int32_t *block_table; /* NULL: entries are physical token slots */
    int64_t bt_stride_b;
    int32_t max_pages;
    const int32_t *lengths; /* [B], contiguous; NULL: max_pages * P (block-table mode only) */
    int32_t block_size;     /* G */
    float scale;
    void *out; /* [B, Hq, D], out_dtype (F32 when accumulate) */
    int32_t out_dtype;
    int64_t out_stride_b, out_stride_h;
    float *lse; /* [B, Hq] */
    int64_t lse_stride_b, lse_stride_h;
    int32_t accumulate;
    float *part_out; /* [B, Hq, n, D] or NULL */
    int64_t part_out_stride_b, part_out_stride_h, part_out_stride_e;
    float *part_lse; /* [B, Hq, n], given with part_out */
    int64_t part_lse_stride_b, part_lse_stride_h;
} gvr_attention_params;

/* Bytes of device workspace gvr_sparse_attention needs (split states and split counters). The
 * workspace must be zero-filled before its first use; every call leaves it fit for the next (the
 * counters, in one fixed region at its start, back at zero; the rest is scratch), so a buffer kept
 * per stream serves all calls of any shapes (never two concurrent calls). */
size_t gvr_sparse_attention_workspace_size(const gvr_attention_params *p);
int gvr_sparse_attention(const gvr_attention_params *p, void *workspace, size_t workspace_bytes, void *stream);

/* Merge of attention states: for i < B, h < H:
 *   m = max(la, lb); m == -inf: out 0, lse -inf; else wa = exp(la - m), wb = exp(lb - m),
 *   out = (wa*va + wb*vb) / (wa + wb), lse = m + log(wa + wb)
 * (exp2/log2 with base2 != 0: FlashInfer's states). A side with lse -inf contributes nothing (the
 * other side is returned as it is, NaN never made); lse +inf or NaN propagate as NaN. The output may
 * be either input exactly (same pointer and strides): in place. Values in the *_dtype element types;
 * lse float32. */
typedef struct {
    int64_t B;
    int32_t H, D;
    int32_t dtype_a, dtype_b, dtype_out; /* GVR_ELEM_* */
    const void *va;
    int64_t va_stride_b, va_stride_h;
    const float *la;
    int64_t la_stride_b, la_stride_h;
    const void *vb;
    int64_t vb_stride_b, vb_stride_h;
    const float *lb;
    int64_t lb_stride_b, lb_stride_h;
    void *vo;
    int64_t vo_stride_b, vo_stride_h;
    float *lo;
    int64_t lo_stride_b, lo_stride_h;
    int32_t base2;
} gvr_merge_params;

int gvr_merge_states(const gvr_merge_params *p, void *stream);

/* prr.missed: out[b, h, :] = the entries x >= 0 of selected[b, h, :] (in their order) that are absent
 * from predicted[b, hp, :] (hp = 0 when Hp == 1, else h), then -1 padding up to n_sel. */
typedef struct {
    int32_t B, H, n_sel, Hp, n_pred;
    const int32_t *selected;
    int64_t sel_stride_b, sel_stride_h;
    const int32_t *predicted;
    int64_t pred_stride_b, pred_stride_h;
    int32_t *out; /* [B, H, n_sel] */
    int64_t out_stride_b, out_stride_h;
} gvr_missed_params;

int gvr_prr_missed(const gvr_missed_params *p, void *stream);

/* prr.finalize (exact mode): for each row b and query head h, with s = h / (Hq / Hsel), the merge, in
 * entry order, of the partial states part[b, h, e] of the entries e whose value x = predicted[b, s, e]
 * is >= 0, is the first occurrence of x in predicted[b, s, :], and occurs in selected[b, s, :]; the
 * empty state when there is none. Writes out (out_dtype) and lse. */
typedef struct {
    int32_t B, Hq, Hsel, n_pred, n_sel, D;
    const float *part_out;
    int64_t part_out_stride_b, part_out_stride_h, part_out_stride_e;
    const float *part_lse;
    int64_t part_lse_stride_b, part_lse_stride_h;
    const int32_t *predicted;
    int64_t pred_stride_b, pred_stride_h;
    const int32_t *selected;
    int64_t sel_stride_b, sel_stride_h;
    void *out;
    int32_t out_dtype;
    int64_t out_stride_b, out_stride_h;
    float *lse;
    int64_t lse_stride_b, lse_stride_h;
} gvr_finalize_params;

int gvr_prr_finalize(const gvr_finalize_params *p, void *stream);

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
    X(int, topk_decode, gvr_topk_decode, (const gvr_topk_params *, void *, size_t, void *))          \
    X(size_t, attention_workspace_size, gvr_sparse_attention_workspace_size,                         \
      (const gvr_attention_params *))                                                                \
    X(int, sparse_attention, gvr_sparse_attention, (const gvr_attention_params *, void *, size_t, void *)) \
    X(int, merge_states, gvr_merge_states, (const gvr_merge_params *, void *))                       \
    X(int, prr_missed, gvr_prr_missed, (const gvr_missed_params *, void *))                          \
    X(int, prr_finalize, gvr_prr_finalize, (const gvr_finalize_params *, void *))

#ifdef __cplusplus
}
#endif

#endif
