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

static inline size_t esize(int32_t dtype) { return dtype == GVR_ELEM_F32 ? 4 : 2; }

static inline float load_elem(const char *p, int32_t dtype)
{
    if (dtype == GVR_ELEM_F32) {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
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
    const size_t es = esize(p->dtype);
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
                            (size_t)(pg * p->k_stride_page + (t % p->P) * p->k_stride_tok + h * p->k_stride_head) * es;
            for (int d = 0; d < D; d++)
                acc[d] += load_elem(x + (size_t)d * es, p->dtype);
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
