/* SparDA's compressed keys on the CPU (sparda_cpu.h; semantics in kernels/gvr_kernels.h). One unit per
 * (row b, KV head h): for each window it writes, the tokens are converted to float and summed channel by
 * channel in token order (float32, no FP contraction: -std=c11), then divided by the kernel size and
 * rounded to the cache's dtype -- the order the CUDA kernel follows, so both give the same bits. */
#include "sparda_cpu.h"

#include "elem.h"
#include "threads.h"

#include <stdlib.h>
#include <string.h>

static inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }


static inline float load_elem(const char *p, int32_t dtype)
{
    if (dtype == GVR_ELEM_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    if (dtype == GVR_ELEM_E4M3)
        return gvr_e4m3_to_f32(*(const uint8_t *)p);
    uint16_t h;
    memcpy(&h, p, 2);
    return dtype == GVR_ELEM_F16 ? gvr_f16_to_f32(h) : gvr_bf16_to_f32(h);
}

static inline void store_elem(char *p, int32_t dtype, float f)
{
    if (dtype == GVR_ELEM_F32) {
        memcpy(p, &f, 4);
        return;
    }
    const uint16_t h = dtype == GVR_ELEM_F16 ? gvr_f32_to_f16(f) : gvr_f32_to_bf16(f);
    memcpy(p, &h, 2);
}

/* windows [j0, j1) of a row written by a call: see gvr_kernels.h */
static void window_range(const gvr_sparda_ckeys_params *p, int64_t b, int64_t *j0, int64_t *j1)
{
    const int64_t cap = (int64_t)p->max_pages * p->P, K = p->kernel, S = p->stride;
    const int64_t e = p->end ? clamp64(p->end[b], 0, cap) : cap;
    const int64_t complete = e >= K ? (e - K) / S + 1 : 0; /* windows j with j*S + K <= e */
    int64_t lo = 0;
    if (p->start) {
        const int64_t s = clamp64(p->start[b], 0, cap);
        lo = s >= K ? (s - K) / S + 1 : 0; /* first window not complete at s */
    }
    *j0 = lo;
    *j1 = complete < p->Nc ? complete : p->Nc;
}

static int ckeys_unit(void *vctx, int64_t unit)
{
    const gvr_sparda_ckeys_params *p = (const gvr_sparda_ckeys_params *)vctx;
    const int D = p->D;
    const int64_t b = unit / p->Hkv;
    const int h = (int)(unit - b * p->Hkv);
    const size_t es = gvr_elem_bytes(p->dtype), kes = gvr_elem_bytes(p->k_dtype); /* out's, k's */
    float *acc = (float *)malloc((size_t)(D ? D : 1) * sizeof(float));
    if (!acc)
        return -1;
    int64_t j0, j1;
    window_range(p, b, &j0, &j1);
    const int32_t *bt = p->block_table + b * p->bt_stride_b;
    char *orow = (char *)p->out + (size_t)(b * p->out_stride_b + h * p->out_stride_h) * es;
    if (!p->start) /* build: every window of the row not written below is zero */
        for (int64_t j = 0; j < p->Nc; j++)
            if (j < j0 || j >= j1)
                memset(orow + (size_t)(j * p->out_stride_j) * es, 0, (size_t)D * es);
    for (int64_t j = j0; j < j1; j++) {
        for (int d = 0; d < D; d++)
            acc[d] = 0.f;
        for (int64_t t = j * p->stride; t < j * p->stride + p->kernel; t++) {
            const int64_t pg = bt[t / p->P];
            if (pg < 0 || pg >= p->num_pages)
                continue;
            const char *x = (const char *)p->k +
                            (size_t)(pg * p->k_stride_page + (t % p->P) * p->k_stride_tok + h * p->k_stride_head) * kes;
            for (int d = 0; d < D; d++)
                acc[d] += load_elem(x + (size_t)d * kes, p->k_dtype);
        }
        char *o = orow + (size_t)(j * p->out_stride_j) * es;
        for (int d = 0; d < D; d++)
            store_elem(o + (size_t)d * es, p->dtype, acc[d] / (float)p->kernel);
    }
    free(acc);
    return 0;
}

int sparda_compressed_keys_cpu(const gvr_sparda_ckeys_params *p)
{
    if (p->B <= 0 || p->Hkv <= 0 || p->D <= 0 || p->Nc <= 0)
        return 0;
    const int64_t units = (int64_t)p->B * p->Hkv;
    const int64_t work = units * (int64_t)p->Nc * p->kernel * p->D;
    return gvr_parallel_rows(units, work, ckeys_unit, (void *)p);
}

/* ---- prefetch: the policy of gvr_kernels.h, step by step ---------------------------------------- */

static int32_t page_of(const gvr_prefetch_params *p, int64_t b, int32_t j)
{
    const int64_t pg = p->block_table ? p->block_table[b * p->bt_stride_b + j] : j;
    return pg >= 0 && pg < p->num_pages ? (int32_t)pg : -1;
}

int sparda_prefetch_plan_cpu(const gvr_prefetch_params *p, int32_t *moves, int32_t *n_moves)
{
    const int64_t B = p->B, M = p->max_pages, S = p->S;
    int64_t *owner = malloc((size_t)(S ? S : 1) * sizeof *owner);
    int32_t *order = malloc((size_t)(S ? S : 1) * sizeof *order);
    if (!owner || !order) {
        free(owner);
        free(order);
        return -1;
    }
    /* slot_map: -1 everywhere, -2 on the needed blocks */
    for (int64_t b = 0; b < B; b++) {
        int32_t *row = p->slot_map + b * p->map_stride_b;
        for (int64_t j = 0; j < M; j++)
            row[j] = -1;
        for (int64_t h = 0; h < p->Hsel; h++) {
            const int32_t *ix = p->indices + b * p->ix_stride_b + h * p->ix_stride_h;
            for (int64_t i = 0; i < p->n; i++) {
                const int32_t j = ix[i];
                if (j >= 0 && j < M && page_of(p, b, j) >= 0)
                    row[j] = -2;
            }
        }
    }
    /* owners: the first claim of each slot in row-major order */
    for (int64_t s = 0; s < S; s++)
        owner[s] = -1;
    if (p->resident)
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < M; j++) {
                const int32_t r = p->resident[b * p->res_stride_b + j];
                if (r >= 0 && r < S && owner[r] < 0 && page_of(p, b, (int32_t)j) >= 0)
                    owner[r] = b * M + j;
            }
    /* free slots: unowned ascending, then owned by a block that is not needed, ascending; kept slots
     * stay with their needed owner */
    int64_t nfree = 0, kept = 0;
    for (int64_t s = 0; s < S; s++)
        if (owner[s] < 0)
            order[nfree++] = (int32_t)s;
    for (int64_t s = 0; s < S; s++) {
        if (owner[s] < 0)
            continue;
        int32_t *m = p->slot_map + (owner[s] / M) * p->map_stride_b + owner[s] % M;
        if (*m == -2) {
            *m = (int32_t)s;
            kept++;
        } else
            order[nfree++] = (int32_t)s;
    }
    /* the needed blocks not kept take the free slots in row-major order */
    int64_t moved = 0;
    for (int64_t b = 0; b < B; b++) {
        int32_t *row = p->slot_map + b * p->map_stride_b;
        for (int64_t j = 0; j < M; j++)
            if (row[j] == -2) {
                const int32_t s = order[moved]; /* moved < nfree: S covers the needed blocks (intake) */
                row[j] = s;
                moves[2 * moved] = page_of(p, b, (int32_t)j);
                moves[2 * moved + 1] = s;
                moved++;
            }
    }
    /* retained: owners that are not needed keep the slots nobody took */
    for (int64_t f = moved; f < nfree; f++) {
        const int32_t s = order[f];
        if (owner[s] >= 0)
            p->slot_map[(owner[s] / M) * p->map_stride_b + owner[s] % M] = s;
    }
    if (p->counts) {
        p->counts[0] = moved;
        p->counts[1] = moved + kept;
    }
    *n_moves = (int32_t)moved;
    free(owner);
    free(order);
    return 0;
}

int sparda_prefetch_cpu(const gvr_prefetch_params *p)
{
    int64_t cap = (int64_t)p->B * p->max_pages;
    if ((int64_t)p->S < cap)
        cap = p->S;
    int32_t *moves = malloc((size_t)(cap ? 2 * cap : 2) * sizeof *moves), n = 0;
    if (!moves || sparda_prefetch_plan_cpu(p, moves, &n)) {
        free(moves);
        return -1;
    }
    for (int32_t m = 0; m < n; m++) {
        const int64_t src = moves[2 * m], dst = moves[2 * m + 1];
        memcpy((char *)p->dst_k + dst * p->dst_stride_k, (const char *)p->host_k + src * p->host_stride_k,
               (size_t)p->page_bytes);
        memcpy((char *)p->dst_v + dst * p->dst_stride_v, (const char *)p->host_v + src * p->host_stride_v,
               (size_t)p->page_bytes);
    }
    free(moves);
    return 0;
}

int sparda_kv_store_cpu(const gvr_kv_store_params *p)
{
    const size_t row = (size_t)p->D * (size_t)p->elem_bytes;
    const int64_t cap = p->num_pages * p->P;
    for (int64_t t = 0; t < p->T; t++) {
        const int64_t slot = p->slots[t];
        if (slot < 0 || slot >= cap)
            continue;
        const int64_t pg = slot / p->P, off = slot % p->P;
        for (int64_t h = 0; h < p->Hkv; h++) {
            memcpy((char *)p->dst_k + (pg * p->dk_stride_page + off * p->dk_stride_tok + h * p->dk_stride_head) *
                                          p->elem_bytes,
                   (const char *)p->k + (t * p->k_stride_t + h * p->k_stride_h) * p->elem_bytes, row);
            memcpy((char *)p->dst_v + (pg * p->dv_stride_page + off * p->dv_stride_tok + h * p->dv_stride_head) *
                                          p->elem_bytes,
                   (const char *)p->v + (t * p->v_stride_t + h * p->v_stride_h) * p->elem_bytes, row);
        }
    }
    return 0;
}
