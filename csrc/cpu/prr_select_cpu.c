/* PRR's selection stage on the CPU (prr_select_cpu.h; semantics in kernels/gvr_kernels.h).
 *
 * prr_block_metadata_cpu: one unit per (row b, KV head h). For each block it touches, the unit walks
 * the block's tokens in order, skips those on pages out of range, and keeps per channel the smallest
 * and largest totalOrder key (csrc/cpu/elem.h) of the stored values: integer min/max, exact and
 * independent of the order, so the CUDA kernels' split of the tokens gives the same bits. The winners'
 * bits are written back unchanged (unkey), so the metadata holds stored values exactly.
 *
 * prr_block_scores_cpu: one unit per (row b, KV head h): the GQA group's query rows converted to float
 * once, then per block the meta rows (q's dtype or fp8 e4m3fn) converted and each head's sum formed in the
 * order gvr_kernels.h defines (chunks of 8 channels left to right, then the tree over chunks), which the CUDA
 * kernel follows too. Built with -std=c11 (no FP contraction) and without -ffast-math: gcc keeps that order.
 * With raw_scores a kept block's score is formed too (for raw_scores; scores takes +inf).
 */
#include "prr_select_cpu.h"

#include "elem.h"
#include "threads.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

/* ---- block metadata ------------------------------------------------------------------------------ */

typedef struct {
    const gvr_block_meta_params *p;
    int64_t cap; /* max_pages * P */
} meta_ctx;

/* fold the row's D values into the running key ranges */
static void fold16(const uint16_t *restrict x, uint16_t *restrict mn, uint16_t *restrict mx, int D)
{
    for (int d = 0; d < D; d++) {
        const uint16_t b = x[d];
        const uint16_t k = (uint16_t)(b ^ (uint16_t)(((int16_t)b >> 15) | (int16_t)0x8000));
        mn[d] = k < mn[d] ? k : mn[d];
        mx[d] = k > mx[d] ? k : mx[d];
    }
}

static void fold8(const uint8_t *restrict x, uint8_t *restrict mn, uint8_t *restrict mx, int D)
{
    for (int d = 0; d < D; d++) {
        const uint8_t k = gvr_key8(x[d]);
        mn[d] = k < mn[d] ? k : mn[d];
        mx[d] = k > mx[d] ? k : mx[d];
    }
}

static void fold32(const uint32_t *restrict x, uint32_t *restrict mn, uint32_t *restrict mx, int D)
{
    for (int d = 0; d < D; d++) {
        const uint32_t b = x[d];
        const uint32_t k = b ^ ((uint32_t)((int32_t)b >> 31) | 0x80000000u);
        mn[d] = k < mn[d] ? k : mn[d];
        mx[d] = k > mx[d] ? k : mx[d];
    }
}

static int meta_unit(void *vctx, int64_t unit)
{
    const meta_ctx *c = (const meta_ctx *)vctx;
    const gvr_block_meta_params *p = c->p;
    const int D = p->D, G = p->block_size, P = p->P;
    const int64_t b = unit / p->Hkv;
    const int h = (int)(unit - b * p->Hkv);
    const size_t es = gvr_elem_bytes(p->dtype);
    const int int16 = es == 2, int8 = es == 1;
    int64_t s = 0, e = p->end ? clamp64(p->end[b], 0, c->cap) : c->cap, j0 = 0, j1 = p->Nb;
    if (p->start) {
        s = clamp64(p->start[b], 0, c->cap);
        if (e <= s)
            return 0;
        j0 = s / G;
        j1 = (e + G - 1) / G;
        if (j1 > p->Nb)
            j1 = p->Nb;
    }
    /* keys: uint16 or uint32 per channel, min then max */
    void *scratch = malloc((size_t)2 * (size_t)(D ? D : 1) * sizeof(uint32_t));
    if (!scratch)
        return -1;
    uint16_t *mn16 = (uint16_t *)scratch, *mx16 = mn16 + D;
    uint32_t *mn32 = (uint32_t *)scratch, *mx32 = mn32 + D;
    uint8_t *mn8 = (uint8_t *)scratch, *mx8 = mn8 + D;
    const int32_t *bt = p->block_table + b * p->bt_stride_b;
    char *mrow = (char *)p->meta + (size_t)(b * p->meta_stride_b + h * p->meta_stride_h) * es;
    for (int64_t j = j0; j < j1; j++) {
        const int64_t lo = j * G > s ? j * G : s, hi = j * G + G < e ? j * G + G : e;
        const int merge = j * G < s;
        int any = 0;
        if (int8) {
            for (int d = 0; d < D; d++)
                mn8[d] = 0xFFu, mx8[d] = 0;
        } else if (int16) {
            for (int d = 0; d < D; d++)
                mn16[d] = 0xFFFFu, mx16[d] = 0;
        } else {
            for (int d = 0; d < D; d++)
                mn32[d] = 0xFFFFFFFFu, mx32[d] = 0;
        }
        for (int64_t t = lo; t < hi; t++) {
            const int64_t page = bt[t / P];
            if (page < 0 || page >= p->num_pages)
                continue;
            const char *row = (const char *)p->k +
                              (size_t)(page * p->k_stride_page + (t % P) * p->k_stride_tok + h * p->k_stride_head) * es;
            any = 1;
            if (int8)
                fold8((const uint8_t *)row, mn8, mx8, D);
            else if (int16)
                fold16((const uint16_t *)row, mn16, mx16, D);
            else
                fold32((const uint32_t *)row, mn32, mx32, D);
        }
        char *m0 = mrow + (size_t)(j * p->meta_stride_j) * es, *m1 = m0 + (size_t)p->meta_stride_m * es;
        if (merge) {
            if (!any)
                continue; /* no new token: the block keeps its content */
            /* the existing content, unless the block is empty (channel 0: min above max) */
            if (int8) {
                const uint8_t *e0 = (const uint8_t *)m0, *e1 = (const uint8_t *)m1;
                if (gvr_key8(e0[0]) <= gvr_key8(e1[0]))
                    for (int d = 0; d < D; d++) {
                        const uint8_t a = gvr_key8(e0[d]), z = gvr_key8(e1[d]);
                        mn8[d] = a < mn8[d] ? a : mn8[d];
                        mx8[d] = z > mx8[d] ? z : mx8[d];
                    }
            } else if (int16) {
                const uint16_t *e0 = (const uint16_t *)m0, *e1 = (const uint16_t *)m1;
                if (gvr_key16(e0[0]) <= gvr_key16(e1[0]))
                    for (int d = 0; d < D; d++) {
                        const uint16_t a = gvr_key16(e0[d]), z = gvr_key16(e1[d]);
                        mn16[d] = a < mn16[d] ? a : mn16[d];
                        mx16[d] = z > mx16[d] ? z : mx16[d];
                    }
            } else {
                const uint32_t *e0 = (const uint32_t *)m0, *e1 = (const uint32_t *)m1;
                if (gvr_key32(e0[0]) <= gvr_key32(e1[0]))
                    for (int d = 0; d < D; d++) {
                        const uint32_t a = gvr_key32(e0[d]), z = gvr_key32(e1[d]);
                        mn32[d] = a < mn32[d] ? a : mn32[d];
                        mx32[d] = z > mx32[d] ? z : mx32[d];
                    }
            }
        }
        if (int8) { /* empty: +NaN, -NaN (e4m3fn has no infinities) */
            uint8_t *o0 = (uint8_t *)m0, *o1 = (uint8_t *)m1;
            for (int d = 0; d < D; d++) {
                o0[d] = any ? gvr_unkey8(mn8[d]) : 0x7Fu;
                o1[d] = any ? gvr_unkey8(mx8[d]) : 0xFFu;
            }
        } else if (int16) {
            uint16_t *o0 = (uint16_t *)m0, *o1 = (uint16_t *)m1;
            const uint16_t pinf = p->dtype == GVR_ELEM_F16 ? 0x7C00u : 0x7F80u;
            for (int d = 0; d < D; d++) {
                o0[d] = any ? gvr_unkey16(mn16[d]) : pinf;
                o1[d] = any ? gvr_unkey16(mx16[d]) : (uint16_t)(pinf | 0x8000u);
            }
        } else {
            uint32_t *o0 = (uint32_t *)m0, *o1 = (uint32_t *)m1;
            for (int d = 0; d < D; d++) {
                o0[d] = any ? gvr_unkey32(mn32[d]) : 0x7F800000u;
                o1[d] = any ? gvr_unkey32(mx32[d]) : 0xFF800000u;
            }
        }
    }
    free(scratch);
    return 0;
}

int prr_block_metadata_cpu(const gvr_block_meta_params *p)
{
    if (p->B <= 0 || p->Hkv <= 0 || p->Nb <= 0 || p->block_size <= 0 || p->P <= 0)
        return 0;
    meta_ctx c = {p, (int64_t)p->max_pages * p->P};
    const int64_t units = (int64_t)p->B * p->Hkv;
    const int64_t work = units * (p->start ? 64 : c.cap) * (p->D > 0 ? p->D : 1);
    return gvr_parallel_rows(units, work, meta_unit, &c);
}

/* ---- block scores -------------------------------------------------------------------------------- */

/* the bits of element 0 of a meta row as a totalOrder key */
static inline uint32_t key0(int32_t dtype, const void *row)
{
    if (dtype == GVR_ELEM_F32) {
        uint32_t b;
        memcpy(&b, row, 4);
        return gvr_key32(b);
    }
    if (dtype == GVR_ELEM_E4M3)
        return gvr_key8(*(const uint8_t *)row);
    uint16_t b;
    memcpy(&b, row, 2);
    return gvr_key16(b);
}

/* s_g of one query row against one block's rows (gvr_kernels.h: chunk partials, then the tree) */
static float head_score(const float *restrict q, const float *restrict mn, const float *restrict mx, int D,
                        float *restrict v)
{
    const int L = (D + 7) / 8;
    for (int c = 0; c < L; c++) {
        const int d0 = 8 * c, d1 = d0 + 8 < D ? d0 + 8 : D;
        float acc = 0.0f;
        for (int d = d0; d < d1; d++) {
            const float a = q[d] * mx[d], b = q[d] * mn[d];
            const float t = (a > b || a != a) ? a : b;
            acc = d == d0 ? t : acc + t;
        }
        v[c] = acc;
    }
    int o = 1;
    while (o * 2 < L)
        o *= 2;
    for (; o >= 1 && L > 1; o /= 2)
        for (int c = 0; c < o; c++)
            if (c + o < L)
                v[c] = v[c] + v[c + o];
    return v[0];
}

typedef struct {
    const gvr_block_scores_params *p;
} scores_ctx;

static int scores_unit(void *vctx, int64_t unit)
{
    const gvr_block_scores_params *p = ((const scores_ctx *)vctx)->p;
    const int D = p->D, GQ = p->Hq / p->Hkv;
    const int64_t b = unit / p->Hkv;
    const int h = (int)(unit - b * p->Hkv);
    const size_t es = gvr_elem_bytes(p->dtype), mes = gvr_elem_bytes(p->meta_dtype);
    const int64_t G = p->block_size, W = p->window > 1 ? p->window : 1;
    const int64_t len = p->lengths ? (p->lengths[b] > 0 ? p->lengths[b] : 0) : W - 1 + (int64_t)p->Nb * G;
    const int64_t nb = len < W ? 0 : (len - W) / G + 1 < p->Nb ? (len - W) / G + 1 : p->Nb;
    if (p->counts)
        p->counts[b * p->counts_stride_b + h * p->counts_stride_h] = (int32_t)nb;
    float *out = p->scores + b * p->scores_stride_b + h * p->scores_stride_h;
    float *raw = p->raw_scores ? p->raw_scores + b * p->raw_stride_b + h * p->raw_stride_h : NULL;
    const int L = (D + 7) / 8;
    float *scratch = malloc(((size_t)GQ * D + 2 * (size_t)D + (size_t)L + 1) * sizeof(float));
    if (!scratch)
        return -1;
    float *qf = scratch, *mn = qf + (size_t)GQ * D, *mx = mn + D, *v = mx + D;
    for (int g = 0; g < GQ; g++)
        gvr_row_to_f32(p->dtype, (const char *)p->q + (size_t)(b * p->q_stride_b + (int64_t)(h * GQ + g) * p->q_stride_h) * es,
                 qf + (size_t)g * D, D);
    const char *mrow = (const char *)p->meta + (size_t)(b * p->meta_stride_b + h * p->meta_stride_h) * mes;
    for (int64_t j = 0; j < p->Nb; j++) {
        if (j >= nb) {
            out[j] = -INFINITY;
            if (raw)
                raw[j] = -INFINITY;
            continue;
        }
        const char *m0 = mrow + (size_t)(j * p->meta_stride_j) * mes, *m1 = m0 + (size_t)p->meta_stride_m * mes;
        if (key0(p->meta_dtype, m0) > key0(p->meta_dtype, m1)) { /* empty */
            out[j] = -INFINITY;
            if (raw)
                raw[j] = -INFINITY;
            continue;
        }
        const int keep = j < p->keep_first || j >= nb - p->keep_last;
        if (keep && !raw) {
            out[j] = INFINITY;
            continue;
        }
        gvr_row_to_f32(p->meta_dtype, m0, mn, D);
        gvr_row_to_f32(p->meta_dtype, m1, mx, D);
        float r = 0.0f;
        for (int g = 0; g < GQ; g++) {
            const float sg = head_score(qf + (size_t)g * D, mn, mx, D, v);
            if (g == 0)
                r = sg;
            else if (p->group_reduce == GVR_GROUP_SUM)
                r = r + sg;
            else
                r = (sg > r || sg != sg) ? sg : r;
        }
        out[j] = keep ? INFINITY : r;
        if (raw)
            raw[j] = r;
    }
    free(scratch);
    return 0;
}

int prr_block_scores_cpu(const gvr_block_scores_params *p)
{
    if (p->B <= 0 || p->Hkv <= 0 || p->Hq <= 0 || p->Nb <= 0)
        return 0;
    if (p->Hq % p->Hkv || p->block_size <= 0 || p->D <= 0)
        return 0; /* the intake rejects these */
    scores_ctx c = {p};
    const int64_t units = (int64_t)p->B * p->Hkv;
    const int64_t work = units * p->Nb * p->D * (p->Hq / p->Hkv);
    return gvr_parallel_rows(units, work, scores_unit, &c);
}
