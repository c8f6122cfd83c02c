/* PRR's EMA predictor (Holt's damped-trend smoothing per block) and its calibration on the CPU
 * (prr_ema_cpu.h; semantics in kernels/gvr_kernels.h, section "PRR EMA predictor and calibration").
 *
 * Bit-exactness: every float32 expression is written one operation per statement, in the order the
 * header gives. This file is compiled as ISO C11 (-std=c11), where GCC does not contract a*b + c into
 * an FMA (-ffp-contract=off is the ISO default; clang contracts only within one expression), so each
 * operation rounds as NumPy's float32 arithmetic and the CUDA path's __fmul_rn / __fadd_rn do.
 *
 * predict / update: one unit per row (b, h), a plain loop over the row's blocks; the fused update +
 * predict (pred or row_len given to update) predicts each row right after updating it, in its unit.
 * calibrate: the per-step ground truth (the Top-K of scores[t] in ascending index order, the row
 * minimum and the denominator) is computed once, in parallel over steps; then one unit per grid point
 * runs the predictor over the trajectory: per step, the prediction's Top-K threshold by a radix select
 * (8-bit digits over the candidates left), the tie cut by index, and the canonical float64 sums. */
#include "prr_ema_cpu.h"

#include "threads.h"

#include "../../kernels/common/gvr_keys.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the expressions -------------------------------------------------------------------------- */

static inline float ema_predict1(float L, float T, float phi)
{
    const float t = phi * T;
    return L + t;
}

/* update of a known block with score s (om = 1 - alpha, ob = 1 - beta, each rounded once) */
static inline void ema_update1(float *Lp, float *Tp, float s, float alpha, float om, float beta, float ob, float phi)
{
    if (!(s > -INFINITY)) /* -inf or NaN: not observed */
        return;
    const float L = *Lp;
    if (L == -INFINITY) { /* never observed: starts now */
        *Lp = s;
        *Tp = 0.0f;
        return;
    }
    const float t = phi * *Tp;
    const float f = L + t;
    const float a1 = alpha * s;
    const float a2 = om * f;
    const float Ln = a1 + a2;
    const float d = Ln - L;
    const float b1 = beta * d;
    const float b2 = ob * t;
    *Lp = Ln;
    *Tp = b1 + b2;
}

static inline void ema_new1(float *Lp, float *Tp, float s)
{
    *Lp = s > -INFINITY ? s : -INFINITY;
    *Tp = 0.0f;
}

static inline int32_t clamp_i32(int32_t v, int32_t lo, int32_t hi) { return v < lo ? lo : v > hi ? hi : v; }

/* the row's block count nb: nblocks[b] (block counts, block_size <= 1) or ceil(nblocks[b] / block_size)
 * (token counts; a negative count is 0), clamped to [0, N] */
static inline int32_t row_blocks(const gvr_ema_params *p, int64_t b)
{
    int32_t n = p->nblocks[b];
    if (p->block_size > 1)
        n = n > 0 ? (n - 1) / p->block_size + 1 : 0; /* ceil without overflow */
    return clamp_i32(n, 0, p->N);
}

/* ---- predict / update ------------------------------------------------------------------------- */

/* the prediction of row (b, h) with block count nb and kn = min(known, nb) blocks of state: pred[j]
 * for j < W (the header's order: forced keep ranges, the state, new blocks, no block), row_len */
static void predict_into(const gvr_ema_params *p, int64_t b, int64_t h, int32_t nb, int32_t kn)
{
    const float *L = p->level + b * p->level_stride_b + h * p->level_stride_h;
    const float *T = p->trend + b * p->trend_stride_b + h * p->trend_stride_h;
    const int32_t W = p->W;
    const int32_t a = kn < W ? kn : W, c = nb < W ? nb : W;
    if (p->pred && W > 0) {
        float *out = p->pred + b * p->pred_stride_b + h * p->pred_stride_h;
        for (int32_t j = 0; j < a; j++)
            out[j] = ema_predict1(L[j], T[j], p->phi);
        for (int32_t j = a; j < c; j++)
            out[j] = INFINITY;
        for (int32_t j = c; j < W; j++)
            out[j] = -INFINITY;
        /* the keep ranges: j < keep_first, nb - keep_last <= j (j < nb) */
        const int32_t kf = p->keep_first < c ? p->keep_first : c;
        for (int32_t j = 0; j < kf; j++)
            out[j] = INFINITY;
        const int32_t kl = p->keep_last < nb ? p->keep_last : nb;
        for (int32_t j = nb - kl; j < c; j++)
            out[j] = INFINITY;
    }
    if (p->row_len)
        p->row_len[b * p->row_len_stride_b + h * p->row_len_stride_h] = c;
}

static int predict_row(void *ctx, int64_t row)
{
    const gvr_ema_params *p = (const gvr_ema_params *)ctx;
    const int64_t b = row / p->H, h = row - b * p->H;
    const int32_t nb = row_blocks(p, b);
    const int32_t kn = clamp_i32(p->known[b * p->known_stride_b + h * p->known_stride_h], 0, nb);
    predict_into(p, b, h, nb, kn);
    return 0;
}

int prr_ema_predict_cpu(const gvr_ema_params *p)
{
    if (p->B <= 0 || p->H <= 0)
        return 0;
    const int64_t rows = (int64_t)p->B * p->H;
    return gvr_parallel_rows(rows, rows * (p->W > 0 ? p->W : 1), predict_row, (void *)p);
}

/* the update of row (b, h); with pred or row_len (fused), then its prediction: known = nu after the
 * update, nu <= nb, so predict_row's kn is nu */
static int update_row(void *ctx, int64_t row)
{
    const gvr_ema_params *p = (const gvr_ema_params *)ctx;
    const int64_t b = row / p->H, h = row - b * p->H;
    float *L = p->level + b * p->level_stride_b + h * p->level_stride_h;
    float *T = p->trend + b * p->trend_stride_b + h * p->trend_stride_h;
    const float *s = p->scores + b * p->scores_stride_b + h * p->scores_stride_h;
    int32_t *known = p->known + b * p->known_stride_b + h * p->known_stride_h;
    const int32_t nb = row_blocks(p, b);
    const int32_t nu = nb < p->Ns ? nb : p->Ns;
    const int32_t kn = clamp_i32(*known, 0, nu);
    const float alpha = p->alpha, beta = p->beta, phi = p->phi;
    const float om = 1.0f - alpha, ob = 1.0f - beta;
    for (int32_t j = 0; j < kn; j++)
        ema_update1(&L[j], &T[j], s[j], alpha, om, beta, ob, phi);
    for (int32_t j = kn; j < nu; j++)
        ema_new1(&L[j], &T[j], s[j]);
    *known = nu;
    if (p->pred || p->row_len)
        predict_into(p, b, h, nb, nu);
    return 0;
}

int prr_ema_update_cpu(const gvr_ema_params *p)
{
    if (p->B <= 0 || p->H <= 0)
        return 0;
    const int64_t rows = (int64_t)p->B * p->H;
    const int64_t per_row = (p->N > 0 ? p->N : 1) + (p->pred && p->W > 0 ? p->W : 0);
    return gvr_parallel_rows(rows, rows * per_row, update_row, (void *)p);
}

/* ---- exact Top-K membership: threshold key and tie cut ---------------------------------------- */

/* The Top-k (1 <= k <= n) of keys[0 .. n) in gvr_topk_decode's order (larger key first, ties to the
 * lower index) is {j : keys[j] > *theta or (keys[j] == *theta and j <= *jcut)}. cand: n scratch keys.
 * A radix select over 8-bit digits, each pass over the candidates the previous ones left. */
static void select_cut(const uint32_t *keys, int32_t n, int32_t k, uint32_t *cand, uint32_t *theta, int32_t *jcut)
{
    uint32_t prefix = 0;
    int32_t kk = k; /* rank still to find among the candidates */
    const uint32_t *src = keys;
    int32_t m = n;
    for (int shift = 24; shift >= 0; shift -= 8) {
        int32_t hist[256];
        memset(hist, 0, sizeof hist);
        for (int32_t i = 0; i < m; i++)
            hist[(src[i] >> shift) & 255u]++;
        int d = 255;
        while (hist[d] < kk) {
            kk -= hist[d];
            d--;
        }
        prefix |= (uint32_t)d << shift;
        if (shift == 0)
            break;
        /* keep the candidates with that digit */
        int32_t w = 0;
        for (int32_t i = 0; i < m; i++)
            if (((src[i] >> shift) & 255u) == (uint32_t)d)
                cand[w++] = src[i];
        src = cand;
        m = w;
    }
    /* kk ties at prefix are taken, the lowest indices first */
    int32_t j = 0;
    for (; j < n; j++)
        if (keys[j] == prefix && --kk == 0)
            break;
    *theta = prefix;
    *jcut = j;
}

static inline int in_set(uint32_t key, int32_t j, uint32_t theta, int32_t jcut)
{
    return key > theta || (key == theta && j <= jcut);
}

/* the canonical float64 sum of x over entries e < n with take(e): 32 lane sums (e = l, l+32, ...,
 * ascending), then the pairwise tree over the lanes (the CUDA path's warp shuffle, offsets 1, 2, 4,
 * 8, 16) */
static inline double tree32(double *lane)
{
    for (int w = 1; w < 32; w *= 2)
        for (int l = 0; l < 32; l += 2 * w)
            lane[l] += lane[l + w];
    return lane[0];
}

/* ---- calibrate -------------------------------------------------------------------------------- */

typedef struct {
    const gvr_ema_calibrate_params *p;
    int32_t kk;
    int32_t *truth;  /* [T-1, kk]: S_t in ascending index order (row t-1) */
    float *mins;     /* [T]: m_t */
    double *dens;    /* [T]: den_t */
    int failed;
} calib_ctx;

static inline double weight(float s, float m) { return isfinite(s) ? (double)s - (double)m : 0.0; }

/* step t >= 1: S_t, m_t, den_t */
static int truth_row(void *vctx, int64_t r)
{
    calib_ctx *c = (calib_ctx *)vctx;
    const gvr_ema_calibrate_params *p = c->p;
    const int64_t t = r + 1;
    const int32_t N = p->N, kk = c->kk;
    const float *s = p->scores + t * p->stride_t;
    uint32_t *buf = (uint32_t *)calloc(2 * (size_t)N, sizeof(uint32_t));
    if (!buf)
        return -1;
    uint32_t *keys = buf, *cand = buf + N;
    float m = INFINITY;
    for (int32_t j = 0; j < N; j++) {
        keys[j] = gvr_key_f32(s[j]);
        if (isfinite(s[j]) && s[j] < m)
            m = s[j];
    }
    if (m == INFINITY)
        m = 0.0f; /* no finite score: every weight is 0 */
    uint32_t theta;
    int32_t jcut;
    select_cut(keys, N, kk, cand, &theta, &jcut);
    int32_t *out = c->truth + r * (int64_t)kk;
    int32_t e = 0;
    double lane[32] = {0};
    for (int32_t j = 0; j < N; j++)
        if (in_set(keys[j], j, theta, jcut)) {
            out[e] = j;
            lane[e & 31] += weight(s[j], m);
            e++;
        }
    c->mins[t] = m;
    c->dens[t] = tree32(lane);
    free(buf);
    return 0;
}

/* grid point g */
static int grid_row(void *vctx, int64_t g)
{
    calib_ctx *c = (calib_ctx *)vctx;
    const gvr_ema_calibrate_params *p = c->p;
    const int32_t N = p->N, kk = c->kk;
    const float alpha = p->grid[3 * g], beta = p->grid[3 * g + 1], phi = p->grid[3 * g + 2];
    const float om = 1.0f - alpha, ob = 1.0f - beta;
    char *mem = (char *)malloc((size_t)N * (2 * sizeof(float) + 2 * sizeof(uint32_t)));
    if (!mem)
        return -1;
    float *L = (float *)mem, *Tr = L + N;
    uint32_t *keys = (uint32_t *)(Tr + N), *cand = keys + N;
    for (int32_t j = 0; j < N; j++)
        ema_new1(&L[j], &Tr[j], p->scores[j]);
    double acc = 0.0;
    for (int64_t t = 1; t < p->T; t++) {
        const float *s = p->scores + t * p->stride_t;
        for (int32_t j = 0; j < N; j++)
            keys[j] = gvr_key_f32(ema_predict1(L[j], Tr[j], phi));
        uint32_t theta;
        int32_t jcut;
        select_cut(keys, N, kk, cand, &theta, &jcut);
        const int32_t *truth = c->truth + (t - 1) * (int64_t)kk;
        const float m = c->mins[t];
        double lane[32] = {0};
        int32_t hits = 0;
        for (int32_t e = 0; e < kk; e++) {
            const int32_t j = truth[e];
            if (in_set(keys[j], j, theta, jcut)) {
                lane[e & 31] += weight(s[j], m);
                hits++;
            }
        }
        const double num = tree32(lane), den = c->dens[t];
        acc += den > 0.0 ? num / den : (double)hits / (double)kk;
        for (int32_t j = 0; j < N; j++)
            ema_update1(&L[j], &Tr[j], s[j], alpha, om, beta, ob, phi);
    }
    p->hit[g] = acc / (double)(p->T - 1);
    free(mem);
    return 0;
}

int prr_ema_calibrate_cpu(const gvr_ema_calibrate_params *p)
{
    if (p->G <= 0)
        return 0;
    if (p->T < 2 || p->N < 1 || p->k < 1) { /* the intake rejects these; defined anyway */
        for (int32_t g = 0; g < p->G; g++)
            p->hit[g] = 0.0;
        return 0;
    }
    calib_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p;
    c.kk = p->k < p->N ? p->k : p->N;
    c.truth = (int32_t *)malloc((size_t)(p->T - 1) * (size_t)c.kk * sizeof(int32_t));
    c.mins = (float *)malloc((size_t)p->T * sizeof(float));
    c.dens = (double *)malloc((size_t)p->T * sizeof(double));
    int rc = -1;
    if (c.truth && c.mins && c.dens) {
        const int64_t work = (int64_t)p->T * p->N;
        rc = gvr_parallel_rows(p->T - 1, work, truth_row, &c);
        if (rc == 0)
            rc = gvr_parallel_rows(p->G, work * p->G, grid_row, &c);
    }
    free(c.truth);
    free(c.mins);
    free(c.dens);
    return rc;
}
