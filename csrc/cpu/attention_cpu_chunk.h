/* One variant of the attention hot loops: attention_cpu.c includes this file once per instruction set
 * (generic C, and on x86-64 AVX2 + FMA + F16C), after defining
 *   SFX(name)         the name with the variant's suffix;  TARGET  the functions' attributes;
 *   VF, VL            a float vector (GCC vector extension type) and its lanes, 4 or 8; VI the
 *                     int32 vector of as many lanes (comparisons' masks);
 *   VLD(p), VST(p, v) unaligned load and store;  VSET1(x)  all lanes x;
 *   VFMA(a, b, c)     a * b + c lane-wise, SFMA(a, b, c) the same on floats: fused where the variant
 *                     has FMA, else a multiply and an add (the only arithmetic difference between them);
 *   ROW_F16(h, f, D)  optional: D halves at h -> floats at f (exact; else gvr_row_to_f32's loop);
 *   QG, QT            query heads and tokens of a dot-product tile (QG * QT * 16 / VL accumulators);
 *   SUM16X4(a0, a1, a2, a3, r)  optional: r[x] = sum16(ax), the four reduced together.
 * The file undefines them all at its end.
 *
 * The arithmetic, fixed whatever the tile a value is computed in and the heads computed with it:
 *   score q . k    16 lanes, lane i accumulates d = i (mod 16) in order of d; the lanes are summed
 *                  pairwise (i + 8, then i + 4, i + 2, i + 1);
 *   chunk max      exact;  weights  expv below (vectorizable; within 0.94 ulp with FMA, 1.22 without,
 *                  measured over every float from -110 to 0);
 *   weight sum     16 lanes over t = i (mod 16), summed like the scores;
 *   out            per (head, d): the chunk's sum of w * v in order of t, then acc * alpha + that sum. */

#define NV (16 / VL) /* vectors of a 16-lane accumulator */
#define DL (2 * VL)  /* output elements of a weighted-V tile per head */
#define TV 8         /* tokens per weighted-V tile: the accumulators stay in registers for TV tokens */
#define GT 4         /* query heads per weighted-V tile */
_Static_assert(QT <= QT_KROWS && TV <= TV_VROWS, "unit_scratch holds QT_KROWS K rows and TV_VROWS V rows");

/* a cache row as floats: in place (F32) or converted into buf */
static inline __attribute__((always_inline)) TARGET const float *SFX(row)(int32_t dtype, const void *x, int64_t off,
                                                                          float *restrict buf, int D)
{
    if (dtype == GVR_ELEM_F32)
        return (const float *)x + off;
    if (dtype == GVR_ELEM_E4M3) {
        gvr_row_to_f32(dtype, (const uint8_t *)x + off, buf, D);
        return buf;
    }
    const uint16_t *h = (const uint16_t *)x + off;
#ifdef ROW_F16
    if (dtype == GVR_ELEM_F16) {
        ROW_F16(h, buf, D);
        return buf;
    }
#endif
    gvr_row_to_f32(dtype, h, buf, D);
    return buf;
}

/* the sum of a 16-lane accumulator, pairwise: lanes i + 8, i + 4, i + 2, i + 1 */
static inline __attribute__((always_inline)) TARGET float SFX(sum16)(const VF *a)
{
#if VL == 4
    const VF n = (a[0] + a[2]) + (a[1] + a[3]);
    return (n[0] + n[2]) + (n[1] + n[3]);
#else
    const VF m = a[0] + a[1];
    const float n0 = m[0] + m[4], n1 = m[1] + m[5], n2 = m[2] + m[6], n3 = m[3] + m[7];
    return (n0 + n2) + (n1 + n3);
#endif
}

/* s[h * CHUNK + i] = q_h . kr[i] (q_h = q + h * D) for h < nh, i < nt: a tile of nh <= QG query heads by
 * nt <= QT tokens (constants after inlining), each K and q vector loaded once per tile */
static inline __attribute__((always_inline)) TARGET void SFX(dots)(const float *restrict q, const float *const *kr,
                                                                   int nh, int nt, int D, float *restrict s)
{
    VF a[QG * QT][NV];
    const int D16 = D & ~15;
    /* one vector of the 16 lanes at a time: QG * QT accumulators in registers */
    for (int v = 0; v < NV; v++) {
        VF acc[QG * QT];
        for (int x = 0; x < nh * nt; x++)
            acc[x] = VSET1(0.0f);
        for (int d = v * VL; d < D16; d += 16) {
            VF kv[QT];
            for (int i = 0; i < nt; i++)
                kv[i] = VLD(kr[i] + d);
            for (int h = 0; h < nh; h++) {
                const VF qv = VLD(q + (size_t)h * D + d);
                for (int i = 0; i < nt; i++)
                    acc[h * nt + i] = VFMA(qv, kv[i], acc[h * nt + i]);
            }
        }
        for (int x = 0; x < nh * nt; x++)
            a[x][v] = acc[x];
    }
    const int d = D16;
    if (d < D) /* D not a multiple of 16: the last elements into their lanes */
        for (int h = 0; h < nh; h++)
            for (int i = 0; i < nt; i++) {
                float lane[16];
                for (int v = 0; v < NV; v++)
                    VST(lane + v * VL, a[h * nt + i][v]);
                for (int e = d; e < D; e++)
                    lane[e - d] = SFMA(q[(size_t)h * D + e], kr[i][e], lane[e - d]);
                for (int v = 0; v < NV; v++)
                    a[h * nt + i][v] = VLD(lane + v * VL);
            }
    int x = 0;
#ifdef SUM16X4
    for (; x + 4 <= nh * nt; x += 4) {
        float r[4];
        SUM16X4(a[x], a[x + 1], a[x + 2], a[x + 3], r);
        for (int y = 0; y < 4; y++)
            s[(x + y) / nt * CHUNK + (x + y) % nt] = r[y];
    }
#endif
    for (; x < nh * nt; x++)
        s[x / nt * CHUNK + x % nt] = SFX(sum16)(a[x]);
}

/* e^x lane-wise, within about 1 ulp: e^x = 2^k e^r with k = round(x / ln 2), r = x - k ln 2 (ln 2 in
 * two parts, k * 0x1.62e4p-1 exact), |r| <= ln2 / 2, e^r by its Taylor polynomial of degree 7
 * (truncation below 0.1 ulp), 2^k as two exact power-of-two factors (a subnormal result is rounded
 * once). -inf -> 0, NaN -> NaN, overflow -> inf. Vector operations and masks, not ?: on floats, which
 * GCC keeps as branches (it does not if-convert comparisons that may trap). */
static inline __attribute__((always_inline)) TARGET VF SFX(expv)(VF x)
{
    const VI lo = x >= VSET1(-104.0f); /* false for -inf below it and for NaN: e^-104 rounds to 0 */
    VF y = (VF)(((VI)x & lo) | ((VI)VSET1(-104.0f) & ~lo));
    const VI hi = y <= VSET1(89.0f); /* e^89 overflows */
    y = (VF)(((VI)y & hi) | ((VI)VSET1(89.0f) & ~hi));
    const VF kf = (y * VSET1(0x1.715476p+0f) + VSET1(0x1.8p23f)) - VSET1(0x1.8p23f); /* round(y / ln 2) */
    const VF r = (y - kf * VSET1(0x1.62e4p-1f)) - kf * VSET1(0x1.7f7d1cp-20f);
    VF p = VSET1(0x1.a01a02p-13f); /* 1/7! */
    p = VFMA(p, r, VSET1(0x1.6c16c2p-10f));
    p = VFMA(p, r, VSET1(0x1.111112p-7f));
    p = VFMA(p, r, VSET1(0x1.555556p-5f));
    p = VFMA(p, r, VSET1(0x1.555556p-3f));
    p = VFMA(p, r, VSET1(0.5f));
    p = VFMA(p, r, VSET1(1.0f));
    p = VFMA(p, r, VSET1(1.0f));
    const VI k = __builtin_convertvector(kf, VI), k1 = k / 2, k2 = k - k1; /* k in [-151, 129] */
    const VF e = p * (VF)((k1 + 127) << 23) * (VF)((k2 + 127) << 23);
    const VI num = x == x;
    return (VF)(((VI)e & num) | ((VI)x & ~num));
}

/* mask ? a : b lane-wise */
#define VSEL(mask, a, b) ((VF)(((VI)(a) & (mask)) | ((VI)(b) & ~(mask))))

/* max of s[0..n) in 16 lanes (lane i: t = i mod 16), then pairwise; NaN never wins (-inf if all are) */
static inline __attribute__((always_inline)) TARGET float SFX(max_row)(const float *restrict s, int n)
{
    VF mx[NV];
    for (int v = 0; v < NV; v++)
        mx[v] = VSET1(-INFINITY);
    int t = 0;
    for (; t + 16 <= n; t += 16)
        for (int v = 0; v < NV; v++) {
            const VF x = VLD(s + t + v * VL);
            mx[v] = VSEL(x > mx[v], x, mx[v]);
        }
    float lm[16];
    if (t < n) {
        for (int i = 0; i < 16; i++)
            lm[i] = i < n - t ? s[t + i] : -INFINITY;
        for (int v = 0; v < NV; v++) {
            const VF x = VLD(lm + v * VL);
            mx[v] = VSEL(x > mx[v], x, mx[v]);
        }
    }
    for (int v = 0; v < NV; v++)
        VST(lm + v * VL, mx[v]);
    for (int w = 8; w > 0; w >>= 1)
        for (int i = 0; i < w; i++)
            lm[i] = lm[i + w] > lm[i] ? lm[i + w] : lm[i];
    return lm[0];
}

/* s[t] = e^(s[t] - mx) for t < n; returns their sum: 16 lanes (lane i: t = i mod 16, in order), then
 * summed like a score (sum16) */
static inline __attribute__((always_inline)) TARGET float SFX(exp_sum_row)(float *restrict s, int n, float mx)
{
    const VF mv = VSET1(mx);
    VF sm[NV];
    for (int v = 0; v < NV; v++)
        sm[v] = VSET1(0.0f);
    int t = 0;
    for (; t + 16 <= n; t += 16)
        for (int v = 0; v < NV; v++) {
            const VF e = SFX(expv)(VLD(s + t + v * VL) - mv);
            VST(s + t + v * VL, e);
            sm[v] += e;
        }
    if (t < n) { /* the last n % 16 through a copy; its other lanes add 0 */
        float pad[16] = {0};
        memcpy(pad, s + t, (size_t)(n - t) * sizeof(float));
        for (int v = 0; v < NV; v++)
            VST(pad + v * VL, SFX(expv)(VLD(pad + v * VL) - mv));
        memcpy(s + t, pad, (size_t)(n - t) * sizeof(float));
        for (int i = n - t; i < 16; i++)
            pad[i] = 0.0f;
        for (int v = 0; v < NV; v++)
            sm[v] += VLD(pad + v * VL);
    }
    return SFX(sum16)(sm);
}

/* ca[h][d] += sum over i < nt of w[h * CHUNK + i] * vr[i][d], in order of i, for h < ng (ng <= GT, a
 * constant after inlining): DL elements of ng heads at a time, their sums in registers for nt tokens */
static inline __attribute__((always_inline)) TARGET void SFX(wv_tile)(float *restrict ca, const float *restrict w,
                                                                      const float *const *vr, int nt, int ng, int D)
{
    int d = 0;
    for (; d + DL <= D; d += DL) {
        VF a[GT][2];
        for (int h = 0; h < ng; h++) {
            a[h][0] = VLD(ca + (size_t)h * D + d);
            a[h][1] = VLD(ca + (size_t)h * D + d + VL);
        }
        for (int i = 0; i < nt; i++) {
            const VF v0 = VLD(vr[i] + d), v1 = VLD(vr[i] + d + VL);
            for (int h = 0; h < ng; h++) {
                const VF wv = VSET1(w[h * CHUNK + i]);
                a[h][0] = VFMA(wv, v0, a[h][0]);
                a[h][1] = VFMA(wv, v1, a[h][1]);
            }
        }
        for (int h = 0; h < ng; h++) {
            VST(ca + (size_t)h * D + d, a[h][0]);
            VST(ca + (size_t)h * D + d + VL, a[h][1]);
        }
    }
    for (; d < D; d++)
        for (int h = 0; h < ng; h++) {
            float s = ca[(size_t)h * D + d];
            for (int i = 0; i < nt; i++)
                s = SFMA(w[h * CHUNK + i], vr[i][d], s);
            ca[(size_t)h * D + d] = s;
        }
}

/* One online-softmax step over nc tokens for nh KV heads that share them (cache offsets koff/voff of
 * the first head's rows; head j adds j * the head stride) and their nh * Gq query heads: running state
 * m, l, acc. K rows, then V rows, are prefetched PREFETCH_TOKENS tokens ahead (the V rows of the
 * chunk's start during its last K rows). */
static TARGET void SFX(attn_chunk)(const attn_ctx *c, const unit_scratch *u, int nh, int nc, const int64_t *koff,
                                   const int64_t *voff, float *m, float *l, float *acc)
{
    const gvr_attention_params *p = c->p;
    const int D = p->D, Gq = c->Gq, Hu = nh * Gq;
    const int64_t ksh = p->k_stride_head, vsh = p->v_stride_head;
    const size_t es = gvr_elem_bytes(p->kv_dtype), rb = (size_t)D * es;
    float *restrict S = u->s;

    /* 1. scores S[g][t] = q_g . k_t, QT tokens against each query head of their KV head */
    for (int t = 0; t < PREFETCH_TOKENS && t < nc; t++)
        for (int j = 0; j < nh; j++)
            prefetch_row(p->k, koff[t] + j * ksh, es, rb);
    for (int t0 = 0; t0 < nc; t0 += QT) {
        const int nt = nc - t0 < QT ? nc - t0 : QT;
        for (int j = 0; j < nh; j++) {
            const float *kr[QT];
            for (int i = 0; i < nt; i++) {
                const int ahead = t0 + i + PREFETCH_TOKENS;
                if (ahead < nc)
                    prefetch_row(p->k, koff[ahead] + j * ksh, es, rb);
                else if (ahead - nc < nc)
                    prefetch_row(p->v, voff[ahead - nc] + j * vsh, es, rb);
                kr[i] = SFX(row)(p->kv_dtype, p->k, koff[t0 + i] + j * ksh, u->krow + (size_t)i * D, D);
            }
            float *sj = S + (size_t)j * Gq * CHUNK + t0;
            const float *qj = u->q + (size_t)j * Gq * D;
            int g = 0;
            if (nt == QT) {
                for (; g + QG <= Gq; g += QG)
                    SFX(dots)(qj + (size_t)g * D, kr, QG, QT, D, sj + g * CHUNK);
                for (; g < Gq; g++)
                    SFX(dots)(qj + (size_t)g * D, kr, 1, QT, D, sj + g * CHUNK);
            } else {
                for (; g < Gq; g++)
                    for (int i = 0; i < nt; i++)
                        SFX(dots)(qj + (size_t)g * D, kr + i, 1, 1, D, sj + g * CHUNK + i);
            }
        }
    }

    /* 2. per query head: the chunk's max, the weights, their sum, the running state's rescale */
    for (int g = 0; g < Hu; g++) {
        float *restrict sg = S + g * CHUNK;
        const float cm = SFX(max_row)(sg, nc), mo = m[g], mn = cm > mo ? cm : mo;
        const float sum = SFX(exp_sum_row)(sg, nc, mn);
        const float alpha = mo == -INFINITY ? 0.0f : mn == mo ? 1.0f : expf(mo - mn);
        u->alpha[g] = alpha;
        l[g] = l[g] * alpha + sum;
        m[g] = mn;
    }

    /* 3. cacc[g] = sum of w_t v_t over the chunk, TV tokens by GT query heads by DL elements at a time
     * with the sums in registers */
    float *restrict cacc = u->cacc;
    memset(cacc, 0, (size_t)Hu * D * sizeof(float));
    for (int t0 = 0; t0 < nc; t0 += TV) {
        const int nt = nc - t0 < TV ? nc - t0 : TV;
        for (int j = 0; j < nh; j++) {
            const float *vr[TV];
            for (int i = 0; i < nt; i++) {
                if (t0 + i + PREFETCH_TOKENS < nc)
                    prefetch_row(p->v, voff[t0 + i + PREFETCH_TOKENS] + j * vsh, es, rb);
                vr[i] = SFX(row)(p->kv_dtype, p->v, voff[t0 + i] + j * vsh, u->vrow + (size_t)i * D, D);
            }
            for (int g0 = j * Gq; g0 < (j + 1) * Gq; g0 += GT) {
                const int ng = (j + 1) * Gq - g0 < GT ? (j + 1) * Gq - g0 : GT;
                const float *w = S + g0 * CHUNK + t0;
                float *ca = cacc + (size_t)g0 * D;
                if (ng == GT) /* the tile's head count a constant: its sums stay in registers */
                    SFX(wv_tile)(ca, w, vr, nt, GT, D);
                else if (ng == 3)
                    SFX(wv_tile)(ca, w, vr, nt, 3, D);
                else if (ng == 2)
                    SFX(wv_tile)(ca, w, vr, nt, 2, D);
                else
                    SFX(wv_tile)(ca, w, vr, nt, 1, D);
            }
        }
    }

    /* 4. acc = acc * alpha + cacc (alpha == 0: acc is all 0, so acc = cacc exactly) */
    for (int g = 0; g < Hu; g++) {
        const VF av = VSET1(u->alpha[g]);
        float *restrict y = acc + (size_t)g * D;
        const float *restrict x = cacc + (size_t)g * D;
        int d = 0;
        for (; d + VL <= D; d += VL)
            VST(y + d, VFMA(VLD(y + d), av, VLD(x + d)));
        for (; d < D; d++)
            y[d] = SFMA(y[d], u->alpha[g], x[d]);
    }
}

#undef VSEL
#undef NV
#undef DL
#undef TV
#undef GT
/* the includer's parameters, so that the next variant defines its own */
#undef SFX
#undef TARGET
#undef VF
#undef VI
#undef VL
#undef VLD
#undef VST
#undef VSET1
#undef VFMA
#undef SFMA
#undef ROW_F16
#undef QG
#undef QT
#undef SUM16X4
