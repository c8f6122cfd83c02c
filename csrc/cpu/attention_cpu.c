/* Sparse decode attention, attention-state merging and PRR repair helpers on the CPU
 * (attention_cpu.h; semantics in kernels/gvr_kernels.h).
 *
 * sparse_attention_cpu: one unit of work per (row b, group of KV heads), computed whole by one
 * thread. A unit walks its selection once (once per KV head when Hsel == Hkv), turning entries into
 * the cache offsets of their tokens, CHUNK tokens at a time, and runs an online softmax for the query
 * heads of its KV heads together (attention_cpu_chunk.h):
 *   1. K rows (converted to float scratch rows for F16/BF16) are dotted with the query heads of their
 *      GQA group (q pre-scaled, in float) in register tiles of query heads by tokens: CHUNK scores per
 *      head, in L1;
 *   2. per head: chunk max, rescale of the running state when the max grows, exp, sum;
 *   3. V rows are added, weighted, into each head's fp32 chunk sum in register tiles of query heads by
 *      output elements, over a few tokens at a time.
 * A query head's arithmetic is the same whichever unit and tile compute it and with which other heads,
 * so the grouping (as many KV heads per unit as leaves a unit for each thread: a token's rows of those
 * heads are one contiguous span in the NHD layout, read with software prefetching, where one head's
 * rows lie 4 KB apart) changes speed only, and results never depend on the thread count.
 * The hot loops are compiled once per instruction set (generic C in GCC vectors; on x86-64 also AVX2 +
 * FMA), one picked per process, so a process gives the same bits every run and for every thread
 * count.
 * With partials the chunks stop at entry boundaries: each entry's own state is computed, written, and
 * folded into the running state.
 *
 * merge_states_cpu: per (b, h) row, read before write element by element, so the output may be
 * either input. prr_missed_cpu / prr_finalize_cpu: sorted copies of the rows (LSD radix sort) and a
 * merge walk. */
#include "attention_cpu.h"
#include "elem.h"

#include "threads.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(GVR_ATTN_NO_AVX2) /* -D: the baseline loops only */
#include <cpuid.h>
#include <immintrin.h>
#define GVR_ATTN_X86 1
#endif

#define CHUNK 64 /* tokens per online-softmax step (scores of a chunk stay in L1) */

/* ---- element types (conversions: elem.h) ------------------------------------------------------ */


static void store_row(int32_t dtype, void *dst, const float *restrict src, int n)
{
    if (dtype == GVR_ELEM_F32) {
        memmove(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == GVR_ELEM_F16) {
        uint16_t *restrict d = (uint16_t *)dst;
        for (int i = 0; i < n; i++)
            d[i] = gvr_f32_to_f16(src[i]);
    } else {
        uint16_t *restrict d = (uint16_t *)dst;
        for (int i = 0; i < n; i++)
            d[i] = gvr_f32_to_bf16(src[i]);
    }
}

static void store_zero_row(int32_t dtype, void *dst, int n) { memset(dst, 0, (size_t)n * gvr_elem_bytes(dtype)); }

/* ---- the merge of two states -------------------------------------------------------------------- */

enum { MERGE_EMPTY, MERGE_A, MERGE_B, MERGE_BLEND, MERGE_NAN };

/* How (la, lb) merge (gvr_kernels.h): the empty state when both are -inf; one side exactly when the
 * other is -inf; NaN when either is NaN or +inf; else the blend with weights *wa, *wb (sum *ws) and
 * lse *lo. */
static int merge_plan(float la, float lb, int base2, float *wa, float *wb, float *lo)
{
    if (isnan(la) || isnan(lb) || la == INFINITY || lb == INFINITY) {
        *lo = NAN;
        return MERGE_NAN;
    }
    if (la == -INFINITY && lb == -INFINITY) {
        *lo = -INFINITY;
        return MERGE_EMPTY;
    }
    if (lb == -INFINITY) {
        *lo = la;
        return MERGE_A;
    }
    if (la == -INFINITY) {
        *lo = lb;
        return MERGE_B;
    }
    const float m = la > lb ? la : lb;
    if (base2) {
        *wa = exp2f(la - m);
        *wb = exp2f(lb - m);
        *lo = m + log2f(*wa + *wb);
    } else {
        *wa = expf(la - m);
        *wb = expf(lb - m);
        *lo = m + logf(*wa + *wb);
    }
    return MERGE_BLEND;
}

/* o[i] = merge of a[i], b[i] by plan (o may be a or b) */
static void merge_apply(int plan, float wa, float wb, const float *a, const float *b, float *o, int n)
{
    switch (plan) {
    case MERGE_EMPTY:
        for (int i = 0; i < n; i++)
            o[i] = 0.0f;
        break;
    case MERGE_A:
        if (o != a)
            memmove(o, a, (size_t)n * sizeof(float));
        break;
    case MERGE_B:
        if (o != b)
            memmove(o, b, (size_t)n * sizeof(float));
        break;
    case MERGE_NAN:
        for (int i = 0; i < n; i++)
            o[i] = NAN;
        break;
    default: {
        const float ws = wa + wb;
        for (int i = 0; i < n; i++)
            o[i] = (wa * a[i] + wb * b[i]) / ws;
    }
    }
}

/* ---- the hot loops ------------------------------------------------------------------------------ */

/* Scratch of one attention unit (floats unless named), for its Hu query heads computed together. */
typedef struct {
    float *q;             /* [Hu][D] scaled queries */
    float *acc;           /* [Hu][D] running sum of weighted V */
    float *eacc;          /* [Hu][D] the current entry's (partials) */
    float *krow;          /* [QT_KROWS][D] K rows converted to float (F16, BF16) */
    float *vrow;          /* [TV_VROWS][D] V rows converted */
    float *s;             /* [Hu][CHUNK] scores, then weights */
    float *m, *l;         /* [Hu] running max and sum */
    float *em, *el;       /* [Hu] the current entry's */
    float *cacc;          /* [Hu][D] a chunk's sum of weighted V (two-level sums: error grows with
                           * CHUNK + tokens / CHUNK, not with the tokens) */
    float *alpha;         /* [Hu] a chunk's rescale of the running state */
    int64_t *koff, *voff; /* [CHUNK] */
} unit_scratch;

typedef struct {
    const gvr_attention_params *p;
    int Gq;
    int64_t cache_slots; /* num_pages * P */
    int64_t max_tokens;  /* max_pages * P */
    int partials;
    int heads_per_unit;  /* KV heads of a unit (speed only: a head's result never depends on it) */
    int64_t units_per_row;
} attn_ctx;

/* the cache lines of the row at element offset off of x (K or V) */
static inline __attribute__((always_inline)) void prefetch_row(const void *x, int64_t off, size_t es, size_t bytes)
{
    const char *r = (const char *)x + (size_t)off * es;
    for (size_t i = 0; i < bytes; i += 64)
        __builtin_prefetch(r + i, 0, 3);
}

#ifndef PREFETCH_TOKENS
/* rows ahead: cache rows of one head are 4 KB apart in NHD layout, beyond the reach of the hardware
 * prefetchers. Measured (2-core EPYC VM, one thread, B=1, Hq 32, Hkv 8, D 128, float32, 8K tokens in
 * 64-token blocks of a 256 MiB cache): 6 -> 24 rows took a shared selection from 15.5 to 9.4 ms and
 * per-head selections from 25.4 to 22.7 ms; 12 rows 15.5 / 23.7 ms. */
#define PREFETCH_TOKENS 24
#endif

/* The hot loops (attention_cpu_chunk.h), compiled once per instruction set; attn_chunk runs the one
 * attn_isa picked for the process. Tiles: 2 query heads by 4 tokens for the scores (8 accumulators of
 * a vector), 4 query heads by 2 vectors of outputs for the weighted V. */

#define QT_KROWS 4 /* the most K rows a variant converts at a time (its QT) */
#define TV_VROWS 8 /* the most V rows (TV of attention_cpu_chunk.h) */

/* generic C: 4-lane GCC vectors (SSE on x86-64, NEON on aarch64), a multiply and an add */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

static inline __attribute__((always_inline)) v4f ld4(const float *x)
{
    v4f v;
    memcpy(&v, x, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void st4(float *x, v4f v) { memcpy(x, &v, sizeof v); }

#define SFX(name) name##_generic
#define TARGET
#define VF v4f
#define VI v4i
#define VL 4
#define VLD ld4
#define VST st4
#define VSET1(x) ((v4f){(x), (x), (x), (x)})
#define VFMA(a, b, c) ((a) * (b) + (c))
#define SFMA(a, b, c) ((a) * (b) + (c))
#define QG 2
#define QT 4
#include "attention_cpu_chunk.h"

#ifdef GVR_ATTN_X86
/* AVX2: 8-lane vectors, fused multiply-adds, F16C half rows (exact, like gvr_f16_to_f32) */
#define GVR_AVX2 __attribute__((target("avx2,fma,f16c")))
typedef int32_t v8i __attribute__((vector_size(32)));

GVR_AVX2 static inline __attribute__((always_inline)) void row_f16_avx2(const uint16_t *h, float *restrict f, int D)
{
    int d = 0;
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(f + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
    for (; d < D; d++)
        f[d] = gvr_f16_to_f32(h[d]);
}

/* sum16 (attention_cpu_chunk.h) of four 16-lane sums at once, the same tree: lanes i + 8 (two ymm),
 * i + 4 (the 128-bit halves), i + 2, i + 1 (shuffles within 128-bit lanes) */
GVR_AVX2 static inline __attribute__((always_inline)) void sum16x4_avx2(const __m256 *a0, const __m256 *a1,
                                                                        const __m256 *a2, const __m256 *a3, float *r)
{
    const __m256 m0 = _mm256_add_ps(a0[0], a0[1]), m1 = _mm256_add_ps(a1[0], a1[1]);
    const __m256 m2 = _mm256_add_ps(a2[0], a2[1]), m3 = _mm256_add_ps(a3[0], a3[1]);
    const __m256 n01 = _mm256_add_ps(_mm256_permute2f128_ps(m0, m1, 0x20), _mm256_permute2f128_ps(m0, m1, 0x31));
    const __m256 n23 = _mm256_add_ps(_mm256_permute2f128_ps(m2, m3, 0x20), _mm256_permute2f128_ps(m2, m3, 0x31));
    /* lanes i + 2: [x0 + x2, x1 + x3] of sums 0, 2 | of sums 1, 3 */
    const __m256 o = _mm256_add_ps(_mm256_shuffle_ps(n01, n23, 0x44), _mm256_shuffle_ps(n01, n23, 0xEE));
    /* lanes i + 1: [s0, s2, ., . | s1, s3, ., .] */
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(o, o, 0x88), _mm256_shuffle_ps(o, o, 0xDD));
    _mm_storeu_ps(r, _mm_unpacklo_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1)));
}

#define SFX(name) name##_avx2
#define TARGET GVR_AVX2
#define VF __m256
#define VI v8i
#define VL 8
#define VLD _mm256_loadu_ps
#define VST _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define SFMA __builtin_fmaf
#define ROW_F16 row_f16_avx2
#define QG 2
#define QT 4
#define SUM16X4 sum16x4_avx2
#include "attention_cpu_chunk.h"
#endif

enum { ISA_GENERIC, ISA_AVX2 };

/* The variant of this process, chosen once: the best the CPU runs (AVX2 needs AVX2, FMA and F16C; F16C
 * read by cpuid: not every compiler's __builtin_cpu_supports knows it), or the generic loops when the
 * environment has GVR_CPU_ISA=generic (to test them on any machine). */
static int attn_isa(void)
{
    static atomic_int cached = -1; /* every thread computes the same value */
    int v = atomic_load_explicit(&cached, memory_order_relaxed);
    if (v < 0) {
        v = ISA_GENERIC;
#ifdef GVR_ATTN_X86
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        const int f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c)
            v = ISA_AVX2;
#endif
        const char *force = getenv("GVR_CPU_ISA");
        if (force && strcmp(force, "generic") == 0)
            v = ISA_GENERIC;
        atomic_store_explicit(&cached, v, memory_order_relaxed);
    }
    return v;
}

const char *attention_cpu_isa(void) { return attn_isa() == ISA_AVX2 ? "avx2" : "generic"; }

static void attn_chunk(const attn_ctx *c, const unit_scratch *u, int nh, int nc, const int64_t *koff, const int64_t *voff,
                       float *m, float *l, float *acc)
{
#ifdef GVR_ATTN_X86
    if (attn_isa() == ISA_AVX2) {
        attn_chunk_avx2(c, u, nh, nc, koff, voff, m, l, acc);
        return;
    }
#endif
    attn_chunk_generic(c, u, nh, nc, koff, voff, m, l, acc);
}

/* ---- sparse attention --------------------------------------------------------------------------- */

/* The tokens of entries [*e, e_end) from token *i of entry *e on, as cache offsets of KV head kvh,
 * at most cap of them; advances the cursor (*e, *i). Returns how many were written. */
static int next_tokens(const attn_ctx *c, const int32_t *sel, const int32_t *bt, int64_t len, int kvh, int32_t *e,
                       int64_t *i, int32_t e_end, int64_t *koff, int64_t *voff, int cap)
{
    const gvr_attention_params *p = c->p;
    const int64_t P = p->P;
    const int64_t kh = (int64_t)kvh * p->k_stride_head, vh = (int64_t)kvh * p->v_stride_head;
    int n = 0;
    while (n < cap && *e < e_end) {
        const int32_t x = sel[*e];
        if (x < 0) {
            ++*e;
            *i = 0;
            continue;
        }
        if (!bt) { /* a physical token slot */
            if ((int64_t)x < c->cache_slots) {
                const int64_t page = x / P, slot = x % P;
                koff[n] = page * p->k_stride_page + slot * p->k_stride_tok + kh;
                voff[n] = page * p->v_stride_page + slot * p->v_stride_tok + vh;
                n++;
            }
            ++*e;
            continue;
        }
        const int64_t t0 = (int64_t)x * p->block_size;
        const int64_t tend = t0 + p->block_size < len ? t0 + p->block_size : len;
        int64_t t = t0 + *i;
        for (; t < tend && n < cap; t++) {
            const int32_t page = bt[t / P];
            if (page < 0 || (int64_t)page >= p->num_pages)
                continue;
            const int64_t slot = t % P;
            koff[n] = (int64_t)page * p->k_stride_page + slot * p->k_stride_tok + kh;
            voff[n] = (int64_t)page * p->v_stride_page + slot * p->v_stride_tok + vh;
            n++;
        }
        if (t >= tend) {
            ++*e;
            *i = 0;
        } else {
            *i = t - t0;
        }
    }
    return n;
}

/* KV heads [kv0, kv0 + nh) of row b over the selection sel that they share */
static void attn_heads(const attn_ctx *c, const unit_scratch *u, int64_t b, int kv0, int nh, const int32_t *sel)
{
    const gvr_attention_params *p = c->p;
    const int D = p->D, Gq = c->Gq, Hu = nh * Gq;
    const size_t qes = gvr_elem_bytes(p->dtype);
    const float qs = p->scale * p->k_scale; /* K' = k_scale * K folded into q (scale exactly when k_scale is 1) */
    for (int g = 0; g < Hu; g++) {
        const int64_t h = (int64_t)kv0 * Gq + g;
        const char *qrow = (const char *)p->q + (size_t)(b * p->q_stride_b + h * p->q_stride_h) * qes;
        float *qg = u->q + (size_t)g * D;
        gvr_row_to_f32(p->dtype, qrow, qg, D);
        for (int d = 0; d < D; d++)
            qg[d] *= qs;
        u->m[g] = -INFINITY;
        u->l[g] = 0.0f;
    }
    memset(u->acc, 0, (size_t)Hu * D * sizeof(float));

    const int32_t *bt = p->block_table ? p->block_table + b * p->bt_stride_b : NULL;
    int64_t len = c->max_tokens;
    if (bt && p->lengths) {
        len = p->lengths[b];
        len = len < 0 ? 0 : len > c->max_tokens ? c->max_tokens : len;
    }

    int64_t count = 0;
    if (!c->partials) {
        int32_t e = 0;
        int64_t i = 0;
        for (;;) {
            const int nc = next_tokens(c, sel, bt, len, kv0, &e, &i, p->n, u->koff, u->voff, CHUNK);
            if (nc == 0)
                break;
            attn_chunk(c, u, nh, nc, u->koff, u->voff, u->m, u->l, u->acc);
            count += nc;
        }
    } else {
        for (int32_t e0 = 0; e0 < p->n; e0++) {
            for (int g = 0; g < Hu; g++) {
                u->em[g] = -INFINITY;
                u->el[g] = 0.0f;
            }
            memset(u->eacc, 0, (size_t)Hu * D * sizeof(float));
            int32_t e = e0;
            int64_t i = 0, ecount = 0;
            for (;;) {
                const int nc = next_tokens(c, sel, bt, len, kv0, &e, &i, e0 + 1, u->koff, u->voff, CHUNK);
                if (nc == 0)
                    break;
                attn_chunk(c, u, nh, nc, u->koff, u->voff, u->em, u->el, u->eacc);
                ecount += nc;
            }
            for (int g = 0; g < Hu; g++) {
                const int64_t h = (int64_t)kv0 * Gq + g;
                float *po = p->part_out + b * p->part_out_stride_b + h * p->part_out_stride_h +
                            (int64_t)e0 * p->part_out_stride_e;
                float *pl = p->part_lse + b * p->part_lse_stride_b + h * p->part_lse_stride_h + e0;
                const float *ea = u->eacc + (size_t)g * D;
                if (ecount == 0) {
                    memset(po, 0, (size_t)D * sizeof(float));
                    *pl = -INFINITY;
                    continue;
                }
                const float el = u->el[g];
                for (int d = 0; d < D; d++)
                    po[d] = ea[d] / el * p->v_scale; /* V' = v_scale * V (exact when 1) */
                *pl = u->em[g] + logf(el);
                /* fold the entry's state into the running one */
                const float mo = u->m[g], me = u->em[g];
                const float mt = me > mo ? me : mo;
                float *ag = u->acc + (size_t)g * D;
                if (mo == -INFINITY) {
                    memcpy(ag, ea, (size_t)D * sizeof(float));
                    u->l[g] = el;
                    u->m[g] = me;
                } else {
                    const float wo = expf(mo - mt), we = expf(me - mt);
                    for (int d = 0; d < D; d++)
                        ag[d] = ag[d] * wo + ea[d] * we;
                    u->l[g] = u->l[g] * wo + el * we;
                    u->m[g] = mt;
                }
            }
            count += ecount;
        }
    }

    /* the states */
    const size_t oes = gvr_elem_bytes(p->out_dtype);
    for (int g = 0; g < Hu; g++) {
        const int64_t h = (int64_t)kv0 * Gq + g;
        char *orow = (char *)p->out + (size_t)(b * p->out_stride_b + h * p->out_stride_h) * oes;
        float *lse = p->lse + b * p->lse_stride_b + h * p->lse_stride_h;
        if (count == 0) {
            if (!p->accumulate) { /* accumulate: the prior state stays bit-identical */
                store_zero_row(p->out_dtype, orow, D);
                *lse = -INFINITY;
            }
            continue;
        }
        float *ag = u->acc + (size_t)g * D;
        const float lg = u->l[g];
        for (int d = 0; d < D; d++)
            ag[d] = ag[d] / lg * p->v_scale; /* V' = v_scale * V (exact when 1) */
        const float lnew = u->m[g] + logf(lg);
        if (p->accumulate) {
            float *prior = u->krow; /* free now */
            gvr_row_to_f32(p->out_dtype, orow, prior, D);
            float wa = 0.0f, wb = 0.0f, lo;
            const int plan = merge_plan(*lse, lnew, 0, &wa, &wb, &lo);
            merge_apply(plan, wa, wb, prior, ag, ag, D);
            store_row(p->out_dtype, orow, ag, D);
            *lse = lo;
        } else {
            store_row(p->out_dtype, orow, ag, D);
            *lse = lnew;
        }
    }
}

static size_t round_up64(size_t x) { return (x + 63) & ~(size_t)63; }

/* unit: row b, KV heads [kv0, kv0 + heads_per_unit) */
static int attn_unit(void *vctx, int64_t unit)
{
    const attn_ctx *c = (const attn_ctx *)vctx;
    const gvr_attention_params *p = c->p;
    const int D = p->D;
    const int64_t b = unit / c->units_per_row;
    const int kv0 = (int)(unit % c->units_per_row) * c->heads_per_unit;
    const int nh = p->Hkv - kv0 < c->heads_per_unit ? p->Hkv - kv0 : c->heads_per_unit;
    const int shared = p->Hsel == 1; /* the heads walk one selection together */
    const int Hu = (shared ? nh : 1) * c->Gq;

    const size_t hd = round_up64((size_t)Hu * D * sizeof(float));
    const size_t krows = round_up64((size_t)QT_KROWS * D * sizeof(float));
    const size_t vrows = round_up64((size_t)TV_VROWS * D * sizeof(float));
    const size_t sc = round_up64((size_t)Hu * CHUNK * sizeof(float)), hv = round_up64((size_t)Hu * sizeof(float));
    const size_t offs = round_up64(CHUNK * sizeof(int64_t));
    const size_t bytes = 4 * hd + krows + vrows + sc + 5 * hv + 2 * offs + 64;
    char *mem = (char *)malloc(bytes);
    if (!mem)
        return -1;
    char *at = (char *)(((uintptr_t)mem + 63) & ~(uintptr_t)63);
    unit_scratch u;
    u.q = (float *)at, at += hd;
    u.acc = (float *)at, at += hd;
    u.eacc = (float *)at, at += hd;
    u.cacc = (float *)at, at += hd;
    u.alpha = (float *)at, at += hv;
    u.krow = (float *)at, at += krows;
    u.vrow = (float *)at, at += vrows;
    u.s = (float *)at, at += sc;
    u.m = (float *)at, at += hv;
    u.l = (float *)at, at += hv;
    u.em = (float *)at, at += hv;
    u.el = (float *)at, at += hv;
    u.koff = (int64_t *)at, at += offs;
    u.voff = (int64_t *)at;

    const int32_t *sel_row = p->indices + b * p->idx_stride_b;
    if (shared)
        attn_heads(c, &u, b, kv0, nh, sel_row);
    else
        for (int j = 0; j < nh; j++)
            attn_heads(c, &u, b, kv0 + j, 1, sel_row + (int64_t)(kv0 + j) * p->idx_stride_h);
    free(mem);
    return 0;
}

int sparse_attention_cpu(const gvr_attention_params *p)
{
    if (p->B <= 0 || p->Hq <= 0 || p->Hkv <= 0 || p->D <= 0)
        return 0;
    (void)attn_isa(); /* read GVR_CPU_ISA on the calling thread, before any worker runs */
    attn_ctx c;
    c.p = p;
    c.Gq = p->Hq / p->Hkv;
    c.cache_slots = p->num_pages * (int64_t)p->P;
    c.max_tokens = (int64_t)p->max_pages * p->P;
    c.partials = p->part_out != NULL && p->part_lse != NULL;
    /* Units of several KV heads read a token's rows of all of them together (in the NHD layout one
     * contiguous span: fewer TLB misses and page crossings than one head's rows 4 KB apart). Enough
     * units for the threads, else whole rows. Heads of a per-head selection (Hsel == Hkv) walk
     * separately either way. */
    const int64_t nt = gvr_get_num_threads();
    int64_t splits = (nt + p->B - 1) / p->B;
    splits = splits < 1 ? 1 : splits > p->Hkv ? p->Hkv : splits;
    c.heads_per_unit = (int)((p->Hkv + splits - 1) / splits);
    c.units_per_row = (p->Hkv + c.heads_per_unit - 1) / c.heads_per_unit;
    const int64_t per_entry = p->block_table ? (p->block_size > 0 ? p->block_size : 1) : 1;
    const int64_t work = (int64_t)p->B * p->n * per_entry * p->Hq * p->D;
    return gvr_parallel_rows((int64_t)p->B * c.units_per_row, work, attn_unit, &c);
}

/* ---- merge_states ------------------------------------------------------------------------------ */

#define MERGE_ROWS_PER_UNIT 32
#define MERGE_SPAN 256 /* elements per step of a row: read both inputs, then write */

static int merge_unit(void *vctx, int64_t unit)
{
    const gvr_merge_params *p = (const gvr_merge_params *)vctx;
    const int64_t rows = p->B * p->H;
    const int64_t r0 = unit * MERGE_ROWS_PER_UNIT;
    const int64_t r1 = r0 + MERGE_ROWS_PER_UNIT < rows ? r0 + MERGE_ROWS_PER_UNIT : rows;
    const size_t sa = gvr_elem_bytes(p->dtype_a), sb = gvr_elem_bytes(p->dtype_b), so = gvr_elem_bytes(p->dtype_out);
    float a[MERGE_SPAN], bv[MERGE_SPAN];
    for (int64_t r = r0; r < r1; r++) {
        const int64_t b = r / p->H, h = r % p->H;
        const float la = p->la[b * p->la_stride_b + h * p->la_stride_h];
        const float lb = p->lb[b * p->lb_stride_b + h * p->lb_stride_h];
        float wa = 0.0f, wb = 0.0f, lo;
        const int plan = merge_plan(la, lb, p->base2, &wa, &wb, &lo);
        const char *va = (const char *)p->va + (size_t)(b * p->va_stride_b + h * p->va_stride_h) * sa;
        const char *vb = (const char *)p->vb + (size_t)(b * p->vb_stride_b + h * p->vb_stride_h) * sb;
        char *vo = (char *)p->vo + (size_t)(b * p->vo_stride_b + h * p->vo_stride_h) * so;
        for (int d0 = 0; d0 < p->D; d0 += MERGE_SPAN) {
            const int n = p->D - d0 < MERGE_SPAN ? p->D - d0 : MERGE_SPAN;
            if (plan == MERGE_A || plan == MERGE_BLEND)
                gvr_row_to_f32(p->dtype_a, va + (size_t)d0 * sa, a, n);
            if (plan == MERGE_B || plan == MERGE_BLEND)
                gvr_row_to_f32(p->dtype_b, vb + (size_t)d0 * sb, bv, n);
            merge_apply(plan, wa, wb, a, bv, a, n);
            store_row(p->dtype_out, vo + (size_t)d0 * so, a, n);
        }
        p->lo[b * p->lo_stride_b + h * p->lo_stride_h] = lo;
    }
    return 0;
}

int merge_states_cpu(const gvr_merge_params *p)
{
    if (p->B <= 0 || p->H <= 0)
        return 0;
    const int64_t rows = p->B * p->H;
    const int64_t units = (rows + MERGE_ROWS_PER_UNIT - 1) / MERGE_ROWS_PER_UNIT;
    return gvr_parallel_rows(units, rows * (p->D > 0 ? p->D : 1), merge_unit, (void *)p);
}

/* ---- PRR helpers: sorted sets ----------------------------------------------------------------- */

/* Stable LSD radix sort of n non-negative int32 keys with payloads (payloads may be NULL), by 8-bit
 * digits, skipping digits where every key agrees; tmp_k/tmp_v: room for n each. The result is in
 * keys/vals. */
static void radix_sort(int32_t *keys, int32_t *vals, int32_t *tmp_k, int32_t *tmp_v, int64_t n)
{
    if (n < 2)
        return;
    int32_t *src_k = keys, *src_v = vals, *dst_k = tmp_k, *dst_v = tmp_v;
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t cnt[256] = {0};
        for (int64_t i = 0; i < n; i++)
            cnt[((uint32_t)src_k[i] >> shift) & 255u]++;
        if (cnt[((uint32_t)src_k[0] >> shift) & 255u] == n)
            continue; /* one bucket: nothing to do */
        int64_t sum = 0;
        for (int j = 0; j < 256; j++) {
            const int64_t t = cnt[j];
            cnt[j] = sum;
            sum += t;
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t at = cnt[((uint32_t)src_k[i] >> shift) & 255u]++;
            dst_k[at] = src_k[i];
            if (vals)
                dst_v[at] = src_v[i];
        }
        int32_t *t = src_k;
        src_k = dst_k, dst_k = t;
        t = src_v, src_v = dst_v, dst_v = t;
    }
    if (src_k != keys) {
        memcpy(keys, src_k, (size_t)n * sizeof(int32_t));
        if (vals)
            memcpy(vals, src_v, (size_t)n * sizeof(int32_t));
    }
}

/* the non-negative entries of row[0..n) (stride 1), sorted, into out; returns their count */
static int64_t sorted_nonneg(const int32_t *row, int64_t n, int32_t *out, int32_t *tmp)
{
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (row[i] >= 0)
            out[m++] = row[i];
    radix_sort(out, NULL, tmp, NULL, m);
    return m;
}

static int contains(const int32_t *sorted, int64_t n, int32_t x)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && sorted[lo] == x;
}

/* ---- prr.missed ------------------------------------------------------------------------------- */

/* unit: row b with every head when Hp == 1 (one sorted predicted row serves them all), else (b, h) */
static int missed_unit(void *vctx, int64_t unit)
{
    const gvr_missed_params *p = (const gvr_missed_params *)vctx;
    const int shared = p->Hp == 1;
    const int64_t b = shared ? unit : unit / p->H;
    const int h0 = shared ? 0 : (int)(unit % p->H), h1 = shared ? p->H : h0 + 1;
    const int64_t np = p->n_pred > 0 ? p->n_pred : 0;
    int32_t *mem = (int32_t *)malloc((size_t)(2 * np + 1) * sizeof(int32_t));
    if (!mem)
        return -1;
    const int32_t *pred = p->predicted + b * p->pred_stride_b + (shared ? 0 : (int64_t)h0 * p->pred_stride_h);
    const int64_t m = sorted_nonneg(pred, np, mem, mem + np);
    for (int h = h0; h < h1; h++) {
        const int32_t *sel = p->selected + b * p->sel_stride_b + (int64_t)h * p->sel_stride_h;
        int32_t *out = p->out + b * p->out_stride_b + (int64_t)h * p->out_stride_h;
        int64_t j = 0, valid = 0;
        for (int64_t e = 0; e < p->n_sel; e++) {
            const int32_t x = sel[e]; /* read before out[j], j <= e, is written: out may be selected */
            valid += x >= 0;
            if (x >= 0 && !contains(mem, m, x))
                out[j++] = x;
        }
        if (p->counts) { /* integer sums: the same whatever the threads' order */
            __atomic_fetch_add(p->counts + 0, valid - j, __ATOMIC_RELAXED);
            __atomic_fetch_add(p->counts + 1, valid, __ATOMIC_RELAXED);
        }
        for (; j < p->n_sel; j++)
            out[j] = -1;
    }
    free(mem);
    return 0;
}

int prr_missed_cpu(const gvr_missed_params *p)
{
    if (p->counts)
        p->counts[0] = p->counts[1] = 0;
    if (p->B <= 0 || p->H <= 0 || p->n_sel <= 0)
        return 0;
    const int64_t units = p->Hp == 1 ? p->B : (int64_t)p->B * p->H;
    const int64_t work = (int64_t)p->B * p->H * ((int64_t)p->n_sel + (p->n_pred > 0 ? p->n_pred : 0)) * 8;
    const int rc = gvr_parallel_rows(units, work, missed_unit, (void *)p);
    if (rc == 0 && p->counts) {
        p->counts[2] += p->counts[0];
        p->counts[3] += p->counts[1];
    }
    return rc;
}

/* ---- prr.finalize ----------------------------------------------------------------------------- */

typedef struct {
    const gvr_finalize_params *p;
    int Gq; /* query heads per selection head */
} finalize_ctx;

/* unit: (b, selection head s) with its Gq query heads */
static int finalize_unit(void *vctx, int64_t unit)
{
    const finalize_ctx *c = (const finalize_ctx *)vctx;
    const gvr_finalize_params *p = c->p;
    const int64_t b = unit / p->Hsel;
    const int s = (int)(unit % p->Hsel);
    const int64_t np = p->n_pred > 0 ? p->n_pred : 0, ns = p->n_sel > 0 ? p->n_sel : 0;
    const int D = p->D;
    /* keys/vals/tmp for predicted (4 np), sorted selected + tmp (2 ns), kept entries (np), acc (D) */
    const size_t ints = (size_t)(5 * np + 2 * ns + 1);
    char *mem = (char *)malloc(ints * sizeof(int32_t) + (size_t)(D > 0 ? D : 1) * sizeof(float) + 64);
    if (!mem)
        return -1;
    int32_t *pk = (int32_t *)mem, *pv = pk + np, *tk = pv + np, *tv = tk + np, *kept = tv + np;
    int32_t *ss = kept + np, *st = ss + ns;
    float *acc = (float *)(((uintptr_t)(st + ns + 1) + 63) & ~(uintptr_t)63);

    const int32_t *pred = p->predicted + b * p->pred_stride_b + (int64_t)s * p->pred_stride_h;
    const int32_t *sel = p->selected + b * p->sel_stride_b + (int64_t)s * p->sel_stride_h;
    const int64_t nss = sorted_nonneg(sel, ns, ss, st);
    int64_t m = 0;
    for (int64_t e = 0; e < np; e++)
        if (pred[e] >= 0) {
            pk[m] = pred[e];
            pv[m] = (int32_t)e;
            m++;
        }
    radix_sort(pk, pv, tk, tv, m); /* stable: the first of a run of equal keys is the first occurrence */
    int64_t nk = 0, j = 0;
    for (int64_t r = 0; r < m; r++) {
        if (r > 0 && pk[r] == pk[r - 1])
            continue;
        while (j < nss && ss[j] < pk[r])
            j++;
        if (j < nss && ss[j] == pk[r])
            kept[nk++] = pv[r];
    }
    radix_sort(kept, NULL, tk, NULL, nk); /* entry order */

    const size_t oes = gvr_elem_bytes(p->out_dtype);
    for (int g = 0; g < c->Gq; g++) {
        const int64_t h = (int64_t)s * c->Gq + g;
        char *orow = (char *)p->out + (size_t)(b * p->out_stride_b + h * p->out_stride_h) * oes;
        float *lse = p->lse + b * p->lse_stride_b + h * p->lse_stride_h;
        const float *po = p->part_out + b * p->part_out_stride_b + h * p->part_out_stride_h;
        const float *pl = p->part_lse + b * p->part_lse_stride_b + h * p->part_lse_stride_h;
        float mx = -INFINITY, l = 0.0f;
        int any = 0;
        for (int64_t r = 0; r < nk; r++) {
            const int64_t e = kept[r];
            const float le = pl[e];
            const float *ve = po + e * p->part_out_stride_e;
            if (le == -INFINITY)
                continue; /* contributes nothing */
            if (!any) {
                memcpy(acc, ve, (size_t)D * sizeof(float));
                mx = le;
                l = 1.0f;
                any = 1;
                continue;
            }
            const float mt = le > mx ? le : mx; /* NaN: exp(NaN) below makes everything NaN */
            const float wo = expf(mx - mt), we = expf(le - mt);
            for (int d = 0; d < D; d++)
                acc[d] = acc[d] * wo + ve[d] * we;
            l = l * wo + we;
            mx = mt;
        }
        if (!any) {
            store_zero_row(p->out_dtype, orow, D);
            *lse = -INFINITY;
            continue;
        }
        if (isnan(mx) || mx == INFINITY) { /* NaN or +inf lse propagate as NaN */
            for (int d = 0; d < D; d++)
                acc[d] = NAN;
            *lse = NAN;
        } else {
            for (int d = 0; d < D; d++)
                acc[d] /= l;
            *lse = mx + logf(l);
        }
        store_row(p->out_dtype, orow, acc, D);
    }
    free(mem);
    return 0;
}

int prr_finalize_cpu(const gvr_finalize_params *p)
{
    if (p->B <= 0 || p->Hq <= 0 || p->Hsel <= 0)
        return 0;
    finalize_ctx c = {p, p->Hq / p->Hsel};
    const int64_t work = (int64_t)p->B * p->Hq * ((int64_t)(p->n_pred > 0 ? p->n_pred : 1)) * (p->D > 0 ? p->D : 1);
    return gvr_parallel_rows((int64_t)p->B * p->Hsel, work, finalize_unit, &c);
}
