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

#define GVR_ABI_VERSION 17

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
 * broadcasts one row). A hint: any content (out of range, -1, duplicates) gives the same result.
 * block_table (nullable; DSA page-table transform, fused): out holds physical slots instead of
 * positions, slot(p) = bt[p / page_size] * page_size + p % page_size with bt = block_table +
 * b*bt_stride (-1 stays -1; a page < 0 gives -1); every position < N must have its page in the row
 * (N <= max_pages * page_size, the intake checks). out_pos (nullable): the positions as well, row b
 * at out_pos[b*out_pos_stride + 0 .. k), -1 padded.
 * row_starts (nullable; ragged rows, vLLM / FlashInfer / SGLang): row b is scores[b*row_stride + st_b ..
 * + len_b) with st_b = clamp(row_starts[b], 0, N) and len_b clamped to [0, N - st_b] (N - st_b without
 * lengths); results are positions relative to st_b. next_n >= 1 rows per request (MTP / speculative
 * rows of one request are consecutive); per_request flags: GVR_TOPK_LENGTHS_PER_REQUEST -- lengths has
 * one entry per request and row b's length is lengths[b / next_n] - (next_n - 1 - b % next_n) (the
 * causal rule of vLLM's decode Top-K), GVR_TOPK_PREV_PER_REQUEST -- prev row b / next_n,
 * GVR_TOPK_BT_PER_REQUEST -- block_table row b / next_n. max_len > 0: every row is cut to its first
 * max_len elements (an upper bound of the lengths: launches are sized for it, not for N). */
enum { GVR_TOPK_LENGTHS_PER_REQUEST = 1, GVR_TOPK_PREV_PER_REQUEST = 2, GVR_TOPK_BT_PER_REQUEST = 4 };
/* score_dtype: the scores' element type, read directly (no conversion pass); a half-precision score
 * ranks as its exact float32 value, so the order above holds unchanged */
enum { GVR_TOPK_F32 = 0, GVR_TOPK_F16 = 1, GVR_TOPK_BF16 = 2 };
typedef struct {
    const void *scores; /* score_dtype elements */
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
    const int32_t *block_table;
    int64_t bt_stride;
    int32_t page_size;
    int32_t *out_pos;
    int64_t out_pos_stride;
    const int32_t *row_starts;
    int32_t next_n;      /* 0 or 1: one row per request */
    int32_t per_request; /* GVR_TOPK_*_PER_REQUEST flags */
    int32_t max_len;     /* > 0: every row is cut to max_len elements (and launches are sized for it) */
    int32_t score_dtype; /* GVR_TOPK_F32 / F16 / BF16 */
} gvr_topk_params;

/* The kernels read each row in aligned coordinates of 4-element vectors (16 bytes of float32, 8 of a
 * half type): position q holds element q - s, s = the row's start in elements past a vector boundary
 * (0..3). Positions a launch covers per row: N plus the
 * largest s of its rows (that of the first row when all rows share it). The radix path holds at most
 * GVR_RADIX_MAX_POSITIONS. Shared by the library and the intake (which raises the ValueError). */
static inline int64_t gvr_topk_row_positions(const gvr_topk_params *p)
{
    const int64_t s0 = (int64_t)(((uintptr_t)p->scores / (p->score_dtype == GVR_TOPK_F32 ? 4u : 2u)) & 3u);
    const int64_t n = p->max_len > 0 && p->max_len < p->N ? p->max_len : p->N;
    if (p->row_starts)
        return n + 3; /* rows start anywhere */
    return n + ((p->B <= 1 || p->row_stride % 4 == 0) ? s0 : 3);
}

/* Bytes of device workspace gvr_topk_decode needs for these parameters (0 today for every path:
 * multi-CTA rows reduce through distributed shared memory). */
size_t gvr_topk_decode_workspace_size(const gvr_topk_params *p);
int gvr_topk_decode(const gvr_topk_params *p, void *workspace, size_t workspace_bytes, void *stream);

/* ---- sparse attention, attention states, PRR repair --------------------------------------- */

/* Element types of attention tensors (q, caches, states). The CUDA path serves F16 and BF16 q/caches
 * (and F32 states); the CPU path serves all three everywhere. E4M3: OCP fp8 e4m3fn (sign, 4 exponent
 * bits of bias 7, 3 mantissa bits; exponent 0 subnormal, S.1111.111 NaN, no infinities, max 448), for
 * K/V caches only (kv_dtype), on both paths, decoded exactly. */
enum { GVR_ELEM_F32 = 0, GVR_ELEM_F16 = 1, GVR_ELEM_BF16 = 2, GVR_ELEM_E4M3 = 3 };

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
    int32_t dtype;    /* q: GVR_ELEM_* (F32 on the CPU path only) */
    int32_t kv_dtype; /* k, v: dtype, or GVR_ELEM_E4M3 */
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
    /* per-tensor cache scales (any kv_dtype; 1: none): the attention is over K' = k_scale * K and
     * V' = v_scale * V (scores scale * q.K', lse with them, out = softmax . V') */
    float k_scale, v_scale;
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
    /* prr.repair's fused extras (accumulate != 0, no part_out; NULL / 0: none):
     * exclude [B, Hx, nx] (Hx = 1 or Hsel): an entry x >= 0 of indices[b, s, :] that occurs anywhere in
     *   exclude[b, (Hx == 1 ? 0 : s), :] is skipped -- the repair equals one with indices replaced by
     *   gvr_prr_missed(indices, exclude) (PRR: indices = selected, exclude = predicted);
     * counts int64 [ncounts], ncounts 2 or 4: counts[0] += the entries x >= 0 of indices found in exclude,
     *   counts[1] += the entries x >= 0 of indices (per selection row (b, s), not per query head);
     *   ncounts 4: counts[2], counts[3] get the same additions;
     * cast_out [B, Hq, D] in cast_dtype (GVR_ELEM_*): the final out also written there, converted (round
     *   to nearest even), heads left unchanged by the repair included. */
    const int32_t *exclude;
    int64_t exc_stride_b, exc_stride_h;
    int32_t Hx, nx;
    int64_t *counts;
    int32_t ncounts;
    void *cast_out;
    int32_t cast_dtype;
    int64_t cast_stride_b, cast_stride_h;
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
 * from predicted[b, hp, :] (hp = 0 when Hp == 1, else h), then -1 padding up to n_sel.
 * counts (NULL: none): int64 [4]; counts[0] = the entries x >= 0 of selected found in predicted (hits),
 * counts[1] = the entries x >= 0 of selected, both of this call (overwritten); counts[2] += counts[0],
 * counts[3] += counts[1] (running totals). */
typedef struct {
    int32_t B, H, n_sel, Hp, n_pred;
    const int32_t *selected;
    int64_t sel_stride_b, sel_stride_h;
    const int32_t *predicted;
    int64_t pred_stride_b, pred_stride_h;
    int32_t *out; /* [B, H, n_sel] */
    int64_t out_stride_b, out_stride_h;
    int64_t *counts; /* NULL or [4], see above */
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

/* ---- PRR selection stage: Quest block metadata and block scores (csrc/prr_select.c, kernels/prr/select.cu) */
/* Quest's block metadata (PRR's selection stage): per row b, KV head h and metadata block j of
 * G = block_size tokens (tokens [j*G, min((j+1)*G, len_b)) of row b; token t at page
 * block_table[b*bt_stride_b + t/P], slot t % P, as in gvr_attention_params; pages < 0 or >= num_pages
 * hold no token), the per-channel minimum and maximum of the keys:
 *   meta[b, h, j, 0, d] = min over the block's tokens of k[t, h, d], meta[b, h, j, 1, d] = their max,
 * in k's element type (exact: stored values, compared as IEEE 754 totalOrder on the bits: -0 < +0,
 * NaNs with the sign bit below -inf, others above +inf; E4M3 on its sign-magnitude bytes: -NaN < -448
 * < ... < -0 < +0 < ... < 448 < +NaN). A block without tokens: min +inf, max -inf (E4M3, which has no
 * infinities: min +NaN 0x7F, max -NaN 0xFF) ("empty"; a block is empty exactly when its channel-0 min
 * is above its max in that order).
 * Element at meta + b*meta_stride_b + h*meta_stride_h + j*meta_stride_j + m*meta_stride_m + d (m = 0:
 * min, 1: max). Nb blocks per row (meta's extent; the intake requires ceil(max_pages*P / G)).
 * Lengths (end) and start are clamped to [0, max_pages*P] (gvr._C raises for host values outside).
 *  - start == NULL (build): every block j < Nb is written, from its tokens < end_b (end NULL:
 *    max_pages*P).
 *  - start != NULL (update, in place): with s = start_b, e = end_b, nothing when e <= s; else the
 *    blocks j in [floor(s/G), ceil(e/G)) fold in their tokens in [s, e): a block with j*G >= s is
 *    rebuilt from them; the block containing s when s % G != 0 is merged (min/max) with its content
 *    (its content only when it has no such token; the new tokens only when it was empty). Blocks
 *    wholly before s, or at or after ceil(e/G), are untouched. A meta built for lengths = start then
 *    updated to end equals the meta built for lengths = end.
 * CUDA: F16, BF16 and E4M3, D in {64, 128, 256}, k and meta on 16-byte boundaries with strides in
 * multiples of 16 bytes. Exact, so the split of the work over CTAs never shows in the result. */
typedef struct {
    int32_t dtype; /* k and meta: GVR_ELEM_* */
    int32_t B, Hkv, D;
    const void *k;
    int64_t k_stride_page, k_stride_tok, k_stride_head;
    int64_t num_pages;
    int32_t P;
    const int32_t *block_table;
    int64_t bt_stride_b;
    int32_t max_pages;
    int32_t block_size; /* G: divides or is a multiple of P */
    int32_t Nb;
    const int32_t *start; /* [B] contiguous; NULL: build */
    const int32_t *end;   /* [B] contiguous; NULL: max_pages * P */
    void *meta;           /* [B, Hkv, Nb, 2, D] */
    int64_t meta_stride_b, meta_stride_h, meta_stride_j, meta_stride_m;
} gvr_block_meta_params;

int gvr_prr_block_metadata(const gvr_block_meta_params *p, void *stream);

/* How block_scores combines the query heads of a GQA group. */
enum { GVR_GROUP_MAX = 0, GVR_GROUP_SUM = 1 };

/* Limits of the CUDA path of gvr_prr_block_scores (the intake raises a ValueError naming them). */
#define GVR_PRR_SCORES_MAX_GQA 32 /* Hq / Hkv */

/* Quest's block scores: for row b, KV head h, block j (Nb blocks, G = block_size tokens each),
 * query heads g in [h*GQ, (h+1)*GQ), GQ = Hq / Hkv, with n_b = min(ceil(len_b / G), Nb) blocks
 * (len_b = lengths ? max(lengths[b], 0) : Nb*G). window W > 1 (SparDA's windows of W tokens every
 * G, gvr.sparda.forecast_select): n_b = len_b >= W ? min((len_b - W) / G + 1, Nb) : 0, the complete
 * windows within len_b tokens (len_b = lengths ? max(lengths[b], 0) : W - 1 + Nb*G); W = 1 is the
 * block count above. So lengths may hold token counts and no kernel computes the counts first:
 *   scores[b, h, j] = -inf                    when j >= n_b or the block is empty (see above),
 *                   = +inf                    else when j < keep_first or j >= n_b - keep_last,
 *                   = R_g s_g                 else, R = max (GVR_GROUP_MAX) or sum (GVR_GROUP_SUM),
 *   s_g = sum over d of t_d, t_d = max(q[g, d] * max_d, q[g, d] * min_d) (the upper bound of q.k
 *   over the block's keys), everything in fp32 (q and meta converted exactly; each product rounded;
 *   no FMA) in this order, which both the CPU and the CUDA code follow (deterministic, bit for bit):
 *     - t_d = a > b or a is NaN ? a : b with a = q*max_d, b = q*min_d (NaN propagates);
 *     - D is cut into L = ceil(D/8) chunks of 8 channels (the last may be shorter); chunk c's partial
 *       v_c = (((t_{8c} + t_{8c+1}) + t_{8c+2}) + ...) left to right;
 *     - the partials fold as a tree: for o = the largest power of two < L, then o/2, ..., 1:
 *       v_c = v_c + v_{c+o} for every c < o with c + o < L; s_g = v_0;
 *     - R over g in order: max keeps the first of equal values and takes NaN when met
 *       (m = s_g > m or s_g is NaN ? s_g : m); sum is ((s_0 + s_1) + s_2) + ... .
 * counts (nullable, [B, Hkv]): n_b for every h (the row lengths of topk_decode over the scores).
 * raw_scores (nullable, [B, Hkv, Nb], unit stride along Nb): the same scores from the same pass
 * before the keep ranges, i.e. what scores holds with keep_first = keep_last = 0 (-inf where scores
 * is -inf, R_g s_g where scores is +inf through a keep range), bit for bit (select_blocks' scores_out:
 * the scores PRR's EMA predictor folds in, without a second read of the metadata).
 * meta_dtype: q's dtype, or E4M3 (the metadata of an fp8 cache), decoded exactly; the arithmetic is the
 * same (a positive per-tensor k_scale would scale every score alike: it is not applied).
 * CUDA: F16 and BF16 q, D in {64, 128, 256}, GQ <= GVR_PRR_SCORES_MAX_GQA, meta on 16-byte boundaries
 * with strides in multiples of 8 elements (16 for E4M3). */
typedef struct {
    int32_t dtype;      /* q: GVR_ELEM_* */
    int32_t meta_dtype; /* meta: dtype or GVR_ELEM_E4M3 */
    int32_t B, Hq, Hkv, D, Nb;
    const void *q;
    int64_t q_stride_b, q_stride_h;
    const void *meta;
    int64_t meta_stride_b, meta_stride_h, meta_stride_j, meta_stride_m;
    const int32_t *lengths; /* [B] contiguous; NULL: Nb * G */
    int32_t block_size;
    int32_t window; /* W: 0 or 1 blocks of G tokens; > 1 windows of W tokens every G (see above) */
    int32_t group_reduce; /* GVR_GROUP_* */
    int32_t keep_first, keep_last;
    float *scores; /* [B, Hkv, Nb], unit stride along Nb */
    int64_t scores_stride_b, scores_stride_h;
    int32_t *counts; /* [B, Hkv] or NULL */
    int64_t counts_stride_b, counts_stride_h;
    float *raw_scores; /* [B, Hkv, Nb], unit stride along Nb, or NULL: the scores before the keep ranges */
    int64_t raw_stride_b, raw_stride_h;
} gvr_block_scores_params;

int gvr_prr_block_scores(const gvr_block_scores_params *p, void *stream);

/* @@prr-select@@ */

/* ---- PRR EMA predictor and calibration (csrc/prr_ema.c, kernels/prr/ema.cu) ------------------------ */
/* State of B rows (b, KV head h) x N blocks (unit stride along blocks), hyper-parameters
 * alpha, beta in (0, 1), phi in [0, 1]: level L[b, h, j], trend T[b, h, j] (float32), known[b, h]
 * (int32: blocks 0 .. known-1 have state). nblocks: int32 [B], contiguous; the row's block count is
 *   nb = clamp(nblocks[b], 0, N)                      block_size G <= 1 (nblocks holds block counts)
 *   nb = clamp(ceil(max(nblocks[b], 0) / G), 0, N)    G > 1 (nblocks holds token counts, e.g. lengths)
 * (gvr._C raises a ValueError for host values out of range -- for G > 1, a negative token count or a
 * derived block count above the limit --, device values are clamped).
 * Every expression is float32, rounded after each operation, in this order (no contraction into
 * FMA: the C path, the CUDA path (__fmul_rn/__fadd_rn) and NumPy float32 agree bit for bit):
 *   t = phi * T;  f = L + t                                   (the prediction)
 *   L' = alpha * s + (1 - alpha) * f                           ((1 - alpha) rounded once)
 *   T' = beta * (L' - L) + (1 - beta) * t                      ((1 - beta) rounded once)
 *
 * gvr_prr_ema_predict writes, for j < W (pred's width):
 *   pred[b, h, j] = +inf       j < nb, j < keep_first or j >= nb - keep_last (the blocks the selection
 *                                                         always keeps are always predicted)
 *                 = f          otherwise, j < min(known, nb) (-inf for a block never observed)
 *                 = +inf       otherwise, min(known, nb) <= j < nb (a new block: always predicted)
 *                 = -inf       j >= nb                         (no such block)
 * and row_len[b, h] = min(nb, W): Top-K of pred[b, h, :row_len] (gvr_topk_decode with lengths) is the
 * predicted selection. keep_first = keep_last = 0: no forced blocks.
 * gvr_prr_ema_update, with nu = min(nb, Ns) (scores' width Ns), s = scores[b, h, j]:
 *   j < min(known, nu), s observed, L > -inf:  the update above;
 *   j < min(known, nu), s observed, L == -inf: L' = s, T' = 0 (a block never observed starts now);
 *   j < min(known, nu), s not observed:        unchanged;
 *   min(known, nu) <= j < nu (new):            L' = s if observed else -inf, T' = 0;
 * then known[b, h] = nu. "Observed" means s > -inf: -inf (masked) and NaN leave no trace; +inf
 * follows IEEE arithmetic. Each row is read before it is written: one launch per call.
 * Fused update + predict: when pred != NULL or row_len != NULL, gvr_prr_ema_update also writes
 * pred[b, h, j] for j < W (pred may be NULL only when W == 0) and row_len[b, h] (when given) exactly
 * as gvr_prr_ema_predict called right after the update with the same parameters would (the same bits:
 * after the update known = nu <= nb, so blocks nu <= j < nb -- beyond the scores' width -- are new:
 * +inf), each row's update and prediction in the same launch (one CTA per row on CUDA). pred and
 * row_len must not overlap the state. */
typedef struct {
    int32_t B, H, N; /* rows, KV heads, blocks of state per row */
    float *level;
    int64_t level_stride_b, level_stride_h;
    float *trend;
    int64_t trend_stride_b, trend_stride_h;
    int32_t *known; /* [B, H] */
    int64_t known_stride_b, known_stride_h;
    const int32_t *nblocks; /* [B], contiguous: block counts, or token counts when block_size > 1 */
    int32_t block_size;     /* G: 0 or 1: nblocks are block counts; > 1: token counts, nb = ceil(n / G) */
    float alpha, beta, phi;
    /* update: scores [B, H, Ns] */
    const float *scores;
    int64_t scores_stride_b, scores_stride_h;
    int32_t Ns;
    /* predict (and the fused update + predict): pred [B, H, W], row_len [B, H] */
    float *pred;
    int64_t pred_stride_b, pred_stride_h;
    int32_t W;
    int32_t *row_len;
    int64_t row_len_stride_b, row_len_stride_h;
    int32_t keep_first, keep_last; /* >= 0: blocks j < keep_first and j >= nb - keep_last (j < nb) are +inf */
} gvr_ema_params;

int gvr_prr_ema_predict(const gvr_ema_params *p, void *stream);
int gvr_prr_ema_update(const gvr_ema_params *p, void *stream);

/* Calibration (paper section 4.2): for each of G grid points g (alpha, beta, phi = grid[3g .. 3g+2]),
 * run the predictor over the trajectory scores [T, N] (row t at scores + t*stride_t): state from row
 * 0 as new blocks (the update above with known = 0, nblocks = N), then for t = 1 .. T-1: P_t = Top-K
 * (kk = min(k, N), the order of gvr_topk_decode: ties to the lower index) of the prediction, S_t = Top-K
 * of scores[t], then the update with scores[t]. Weights x_tj = (double)s_tj - (double)m_t for finite
 * s_tj (m_t the minimum of row t's finite scores), 0 otherwise (x >= 0). With the entries of S_t in
 * ascending index order e = 0 .. kk-1, the sums num_t (over e with j_e in P_t) and den_t (all e) are
 * float64 and canonical: 32 partial sums p_l over e = l, l+32, ... (ascending), then the pairwise
 * tree ((p_0 + p_1) + (p_2 + p_3)) + ... over the 32. hit_t = num_t / den_t when den_t > 0, else
 * |P_t & S_t| / kk (a row whose top-k scores all equal its minimum). hit[g] = (sum over t ascending of
 * hit_t) / (T - 1), float64. T >= 2, 1 <= k, N >= 1. The CPU path and the CUDA path give the same bits. */
#define GVR_EMA_CALIBRATE_MAX_BLOCKS 8192 /* N on CUDA */
typedef struct {
    const float *scores;
    int64_t stride_t;
    int32_t T, N, k, G;
    const float *grid; /* [G, 3] contiguous: alpha, beta, phi */
    double *hit;       /* [G] */
} gvr_ema_calibrate_params;

size_t gvr_prr_ema_calibrate_workspace_size(const gvr_ema_calibrate_params *p);
int gvr_prr_ema_calibrate(const gvr_ema_calibrate_params *p, void *workspace, size_t workspace_bytes, void *stream);

/* @@prr-ema@@ */

/* ---- SparDA compressed keys (csrc/sparda.c, kernels/sparda/ckeys.cu) ------------------------------ */

/* Mean-pooled keys of a paged K cache (InfLLM-V2 / SparDA, paper 004 eq. 5): window j of row b is the
 * tokens [j*stride, j*stride + kernel) (token t on page block_table[b, t / P], slot t % P);
 *   out[b, h, j, :] = (sum over the window's tokens, in token order, of K[page, slot, h, :] in float32)
 *                     / kernel, rounded to out's dtype (the cache's; an fp8 cache's: float16, bfloat16
 *                     or float32, the fp8 values decoded exactly),
 * a token whose page is < 0 or >= num_pages counting as zeros. A window is complete when j*stride +
 * kernel <= len_b. Build (start == NULL): every complete window (len_b = end[b], or max_pages * P when end
 * is NULL) is written, every other window of the row zeroed. Update (start != NULL): the windows whose
 * last token + 1 lies in (start[b], end[b]] -- those the tokens [start, end) complete -- are written,
 * nothing else. start/end on the host are checked by the intake; on the device they are clamped to
 * [0, max_pages * P]. */
typedef struct {
    int32_t dtype;   /* GVR_ELEM_* of out (and of k unless k_dtype says E4M3) */
    int32_t k_dtype; /* k: dtype, or GVR_ELEM_E4M3 (then dtype F16, BF16 or F32) */
    int32_t B, Hkv, D;
    const void *k; /* [num_pages, P, Hkv, D], unit stride along D */
    int64_t k_stride_page, k_stride_tok, k_stride_head;
    int64_t num_pages;
    int32_t P;
    const int32_t *block_table;
    int64_t bt_stride_b;
    int32_t max_pages;
    int32_t kernel, stride;
    int32_t Nc;           /* windows per row in out */
    const int32_t *start; /* [B] contiguous; NULL: build */
    const int32_t *end;   /* [B] contiguous; NULL: max_pages * P */
    void *out;            /* [B, Hkv, Nc, D] */
    int64_t out_stride_b, out_stride_h, out_stride_j;
} gvr_sparda_ckeys_params;

int gvr_sparda_compressed_keys(const gvr_sparda_ckeys_params *p, void *stream);

/* ---- SparDA host KV cache: prefetch and store (csrc/sparda_host.c, kernels/sparda/prefetch.cu) ---- */

/* Prefetch of selected KV blocks from a paged cache in pinned, device-mapped host memory into a GPU
 * staging cache, moving only blocks that are not already staged.
 *
 * A block is one page of P tokens (all Hkv heads), the same block_size = P unit sparse_attention's
 * block-table mode takes. host_k/host_v: [num_pages, P, Hkv, D]; dst_k/dst_v: [S, P, Hkv, D], the same
 * element size; every page of all four is `page_bytes` contiguous bytes with one inner layout (NHD or
 * HND), so a block moves as one run of bytes; page p of host_k starts at host_k + p*host_stride_page
 * bytes (likewise the others).
 *
 * indices: int32 [B, Hsel, n] (row b, entry (h, i) at indices[b*ix_stride_b + h*ix_stride_h + i]) are
 * logical block numbers of row b; an entry outside [0, max_pages) is skipped (-1 padding). Host page of
 * block j of row b: block_table[b*bt_stride_b + j], or j itself when block_table is NULL (then
 * max_pages = num_pages); a page outside [0, num_pages) is not moved.
 * resident (nullable): int32 [B, max_pages] (row stride res_stride_b), the previous call's slot map:
 * resident[b, j] in [0, S) says staging page s holds block j of row b (the caller keeps it true).
 * slot_map: int32 [B, max_pages] (row stride map_stride_b, written entirely): the staging page of every
 * block, -1 where none -- the block table of the staging cache for
 * gvr_sparse_attention(..., block_table = slot_map, block_size = P).
 *
 * The policy, deterministic and a function of the inputs only:
 *  1. needed: the blocks (b, j) named by a kept entry whose host page is valid;
 *  2. owner of slot s: the first block (b, j) in row-major order with resident[b, j] == s and a valid
 *     host page (later claims of s are ignored);
 *  3. kept: a needed block that owns its resident slot keeps it (not moved);
 *  4. free slots, in this order: slots with no owner (ascending), then slots whose owner is not needed
 *     (ascending); the needed blocks that are not kept take them in row-major order and are moved
 *     (K and V);
 *  5. retained: a block that is not needed but owns a slot that was not handed out keeps it in slot_map
 *     (its data still there); every other block gets -1.
 * S >= the needed blocks' count is required (the intake checks S >= min(B*Hsel*n, B*max_pages)).
 * counts (nullable): int64 [2] = {blocks moved, blocks needed} of this call.
 *
 * sparda_prefetch_plan_cpu (csrc/cpu) computes slot_map, counts and the move list on the CPU (all pointers host
 * memory) -- the reference, and the plan of the copy-engine method. gvr_sparda_prefetch runs on the
 * device: indices, block_table, resident, slot_map, counts in device memory; host_k/host_v the DEVICE
 * pointers of mapped host memory; method GVR_PREFETCH_KERNEL (a plan kernel and a UVA gather kernel of
 * at most max_ctas CTAs; graph-safe, no host sync) or GVR_PREFETCH_MEMCPY (moves[] planned on the host,
 * one copy per run of adjacent blocks through the copy engines, cudaMemcpyBatchAsync; slot_map and
 * counts come from the host plan, plan_slot_map / plan_counts) or GVR_PREFETCH_TMA (the plan kernel, then
 * a gather of max_ctas CTAs (default 2) of one thread that moves 16 KiB pieces through a ring of shared
 * memory with bulk copies, cp.async.bulk: host -> shared -> device memory; sm_90 and later; graph-safe);
 * GVR_PREFETCH_AUTO with device selections: TMA where the library runs sm_90 code, else KERNEL. */
enum { GVR_PREFETCH_AUTO = 0, GVR_PREFETCH_KERNEL = 1, GVR_PREFETCH_MEMCPY = 2, GVR_PREFETCH_TMA = 3 };

typedef struct {
    const void *host_k, *host_v; /* device pointers of the mapped host caches */
    int64_t host_stride_k, host_stride_v; /* bytes between pages */
    int64_t num_pages;
    void *dst_k, *dst_v;
    int64_t dst_stride_k, dst_stride_v; /* bytes between staging pages */
    int32_t S;                          /* staging pages */
    int64_t page_bytes;                 /* P * Hkv * D * element size, a multiple of 16 on the device */
    int32_t B, Hsel, n;
    const int32_t *indices;
    int64_t ix_stride_b, ix_stride_h;
    const int32_t *block_table; /* nullable */
    int64_t bt_stride_b;
    int32_t max_pages;
    const int32_t *resident; /* nullable */
    int64_t res_stride_b;
    int32_t *slot_map;
    int64_t map_stride_b;
    int64_t *counts; /* nullable */
    int32_t method;
    int32_t max_ctas; /* the gather kernel's CTAs (0: the library's choice) */
    int32_t cta_warps;  /* warps per gather CTA, 1..8 (0: the library's choice) */
    int32_t lane_loads; /* 16-byte loads in flight per lane, 4, 8 or 16 (0: the library's choice) */
    /* GVR_PREFETCH_MEMCPY: the host plan's moves, pairs (host page, staging page), n_moves of them (host
     * memory); plan_slot_map / plan_counts (nullable): the host plan's slot map (contiguous [B, max_pages])
     * and counts, copied into slot_map (then contiguous) and counts on the stream */
    const int32_t *moves;
    int32_t n_moves;
    const int32_t *plan_slot_map;
    const int64_t *plan_counts;
} gvr_prefetch_params;

/* Device workspace bytes of gvr_sparda_prefetch (any content on entry; the call leaves it unspecified). */
size_t gvr_sparda_prefetch_workspace_size(const gvr_prefetch_params *p);
int gvr_sparda_prefetch(const gvr_prefetch_params *p, void *workspace, size_t workspace_bytes, void *stream);

/* Store of T new tokens into a paged cache (vLLM's reshape_and_cache, for host caches):
 *   dst_k[slot / P, slot % P, h, :] = k[t, h, :], likewise v, for slot = slots[t] >= 0 (slots < 0 skipped;
 *   the intake checks the host ones are < num_pages * P, device ones outside are skipped).
 * k, v: [T, Hkv, D] with unit stride along D; dst: [num_pages, P, Hkv, D] (device pointers of mapped host
 * memory on the device). Later tokens win when two name one slot. */
typedef struct {
    int32_t elem_bytes;
    int32_t T, Hkv, D;
    const void *k, *v;
    int64_t k_stride_t, k_stride_h, v_stride_t, v_stride_h; /* elements */
    const int64_t *slots;
    void *dst_k, *dst_v;
    int64_t dk_stride_page, dk_stride_tok, dk_stride_head; /* elements */
    int64_t dv_stride_page, dv_stride_tok, dv_stride_head;
    int64_t num_pages;
    int32_t P;
} gvr_kv_store_params;

int gvr_sparda_kv_store(const gvr_kv_store_params *p, void *stream);

/* The persistent prefetcher (SparDA's variant): `ctas` CTAs of a gather kernel started once on a stream
 * of its own, fed through a device-side queue of `depth` requests. gvr_prefetcher_submit runs the slot
 * policy of gvr_sparda_prefetch (method KERNEL) as one CTA on the caller's stream, in the workspace of
 * its queue slot, and publishes the request; *ticket (device int64) receives its sequence number.
 * gvr_prefetcher_wait makes a stream wait (a one-thread kernel) until the request *ticket names is
 * complete -- order it after the submit (same stream, or an event). A submit waits for a free slot and
 * a wait for its request at most timeout_ns: then it gives up and the prefetcher's error is set
 * (1: no free slot, 2: a request not completed); the data are then not there. While the prefetcher
 * runs, a device-wide synchronization (cudaDeviceSynchronize, torch.cuda.synchronize, cudaFree) waits
 * for it: close it first. close: stops the kernel once the queue is drained (abort after timeout_ms),
 * frees everything; nonzero when the kernel did not stop (its memory then stays allocated). */
typedef struct {
    int32_t ctas, depth;
    int64_t timeout_ns;
    void *slot_workspace; /* device memory: depth slots of slot_ws_bytes each (gvr_sparda_prefetch_workspace_size) */
    size_t slot_ws_bytes;
    int32_t cta_warps, lane_loads; /* the gather CTAs' shape, as in gvr_prefetch_params (0: the library's choice) */
    int32_t start;                 /* nonzero: start the persistent kernel now; else gvr_prefetcher_start */
} gvr_prefetcher_config;

/* create; start (the persistent kernel, once: submits and waits may be captured into a CUDA graph before
 * it starts, when a capture's device-wide synchronization cannot wait for it) */
int gvr_prefetcher_create(const gvr_prefetcher_config *c, void **handle);
int gvr_prefetcher_start(void *handle);
int gvr_prefetcher_submit(void *handle, const gvr_prefetch_params *p, int64_t *ticket, void *stream);
int gvr_prefetcher_wait(void *handle, const int64_t *ticket, void *stream);
/* host reads of the prefetcher's state: error code (0 none), requests completed, and whether it runs */
int gvr_prefetcher_status(void *handle, int32_t *error, int64_t *completed, int32_t *running);
int gvr_prefetcher_close(void *handle, int64_t timeout_ms);

/* Pinned, device-mapped, portable host memory (cudaHostAlloc) and its release; the device pointer of
 * [ptr, ptr + bytes) when it lies in one pinned, mapped allocation (an error naming what it is
 * otherwise). */
int gvr_cuda_host_alloc(size_t bytes, void **ptr);
int gvr_cuda_host_free(void *ptr);
int gvr_cuda_host_device_pointer(const void *ptr, size_t bytes, void **device_ptr);

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
    X(int, prr_finalize, gvr_prr_finalize, (const gvr_finalize_params *, void *))                    \
    X(int, prr_block_metadata, gvr_prr_block_metadata, (const gvr_block_meta_params *, void *))       \
    X(int, prr_block_scores, gvr_prr_block_scores, (const gvr_block_scores_params *, void *))         \
    /* @@prr-select-symbols@@ */                                                                     \
    X(int, prr_ema_predict, gvr_prr_ema_predict, (const gvr_ema_params *, void *))                    \
    X(int, prr_ema_update, gvr_prr_ema_update, (const gvr_ema_params *, void *))                      \
    X(size_t, prr_ema_calibrate_workspace_size, gvr_prr_ema_calibrate_workspace_size,                \
      (const gvr_ema_calibrate_params *))                                                            \
    X(int, prr_ema_calibrate, gvr_prr_ema_calibrate, (const gvr_ema_calibrate_params *, void *, size_t, void *)) \
    /* @@prr-ema-symbols@@ */                                                                        \
    X(int, sparda_compressed_keys, gvr_sparda_compressed_keys, (const gvr_sparda_ckeys_params *, void *)) \
    X(size_t, sparda_prefetch_workspace_size, gvr_sparda_prefetch_workspace_size, (const gvr_prefetch_params *)) \
    X(int, sparda_prefetch, gvr_sparda_prefetch, (const gvr_prefetch_params *, void *, size_t, void *)) \
    X(int, sparda_kv_store, gvr_sparda_kv_store, (const gvr_kv_store_params *, void *))                \
    X(int, prefetcher_create, gvr_prefetcher_create, (const gvr_prefetcher_config *, void **))          \
    X(int, prefetcher_start, gvr_prefetcher_start, (void *)) \
    X(int, prefetcher_submit, gvr_prefetcher_submit, (void *, const gvr_prefetch_params *, int64_t *, void *)) \
    X(int, prefetcher_wait, gvr_prefetcher_wait, (void *, const int64_t *, void *))                  \
    X(int, prefetcher_status, gvr_prefetcher_status, (void *, int32_t *, int64_t *, int32_t *))      \
    X(int, prefetcher_close, gvr_prefetcher_close, (void *, int64_t))                                 \
    X(int, host_alloc, gvr_cuda_host_alloc, (size_t, void **))                                        \
    X(int, host_free, gvr_cuda_host_free, (void *))                                                   \
    X(int, host_device_pointer, gvr_cuda_host_device_pointer, (const void *, size_t, void **))

#ifdef __cplusplus
}
#endif

#endif
