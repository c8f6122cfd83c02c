/* Exact decode-time Top-K on the CPU: GVR's guess-verify-refine adapted to one core per row.
 *
 * Order (ARCHITECTURE.md): value descending, -0 == +0, -inf valid, NaN below -inf, ties to the lower
 * index. Mapping every float to a sortable 32-bit key (gvr_float_key) makes this the order of
 * (key descending, index ascending).
 *
 * Per row of length L, kk = min(k, L):
 *  1. Guess: a sample of the row's values: the values at the predicted indices (prev_topk entries in
 *     [0, L)), or, without a usable prediction, a strided sample. The first threshold is the
 *     sample's median for a prediction (our reading of the paper's "pre-indexed statistics": the
 *     previous Top-K straddles the current k-th value) or the sample quantile at rank kk*m/L.
 *  2. Verify: exact counts c(t) = #{x >= t} by a vectorized pass; next thresholds by secant
 *     interpolation between the bracketing counts, or, while only one side is known, by the
 *     sample anchored at the measured count (the sample gives the shape of the distribution, the
 *     pass its scale); bisection in key space when the secant stalls. Stops when
 *     kk <= c(t) <= kk + W. Key-space bisection over 2^32 keys guarantees termination.
 *  3. Collect the c(t) candidates (x >= t) in index order, one pass.
 *  4. Refine: radix-select the kk-th largest key v among the candidates; emit every candidate with
 *     key > v, then the lowest-index candidates with key == v until kk are emitted. Exact for any
 *     threshold with c(t) >= kk, so ties, -inf and NaN need no special path (a row with fewer than
 *     kk non-NaN values takes threshold key 0: every element is a candidate).
 * Optional sort: stable LSD radix sort of the kk (key, index) pairs by key descending.
 */
#include "topk_cpu.h"

#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GVR_X86 1
#endif

#define KEY_NEG_INF 0x007FFFFFu
#define KEY_POS_INF 0xFF800000u

static _Thread_local gvr_topk_cpu_stats tls_stats;

void topk_cpu_last_stats(gvr_topk_cpu_stats *s) { *s = tls_stats; }

static inline float key_to_float(uint32_t k)
{
    union { uint32_t u; float f; } c;
    c.u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
    return c.f;
}

/* #{i : x[i] >= t}; t is never NaN (NaN elements compare false). */
static int64_t count_ge_scalar(const float *x, int64_t n, float t)
{
    int64_t total = 0;
    for (int64_t i = 0; i < n; i += 16384) {
        int64_t m = n - i < 16384 ? n - i : 16384;
        const float *p = x + i;
        int32_t c = 0;
        for (int64_t j = 0; j < m; j++)
            c += p[j] >= t;
        total += c;
    }
    return total;
}

/* #{i in [from, n) : x[i] >= t}; the first `cap - m0` such indices (ascending) go to idx[m0..cap).
 * Returns the total count, m0 included. */
static int64_t collect_ge_scalar_from(const float *x, int64_t from, int64_t n, float t, int32_t *idx, int64_t m0,
                                      int64_t cap)
{
    int64_t m = m0;
    for (int64_t i = from; i < n; i++) {
        if (x[i] >= t) {
            if (m < cap)
                idx[m] = (int32_t)i;
            m++;
        }
    }
    return m;
}

#ifdef GVR_X86
/* AVX2: compare masks are -1 per true lane, so subtracting them counts; four accumulators keep
 * four loads in flight. Blocks of 2^20 elements keep the int32 lanes from overflowing. */
__attribute__((target("avx2"))) static int64_t count_ge_avx2(const float *x, int64_t n, float t)
{
    const __m256 tv = _mm256_set1_ps(t);
    int64_t total = 0, i = 0;
    while (i + 32 <= n) {
        int64_t stop = i + ((int64_t)1 << 20);
        if (stop > n)
            stop = n;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 32 <= stop; i += 32) {
            a0 = _mm256_sub_epi32(a0, _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(x + i), tv, _CMP_GE_OQ)));
            a1 = _mm256_sub_epi32(a1, _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), tv, _CMP_GE_OQ)));
            a2 = _mm256_sub_epi32(a2, _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), tv, _CMP_GE_OQ)));
            a3 = _mm256_sub_epi32(a3, _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), tv, _CMP_GE_OQ)));
        }
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, s);
        for (int j = 0; j < 8; j++)
            total += lanes[j];
    }
    return total + count_ge_scalar(x + i, n - i, t);
}

/* Count and collect in one pass: most 32-blocks hold no candidate, and one OR of four compares
 * skips them. Indices beyond cap are counted, not stored. */
__attribute__((target("avx2,bmi"))) static int64_t collect_ge_avx2(const float *x, int64_t n, float t,
                                                                    int32_t *idx, int64_t cap)
{
    const __m256 tv = _mm256_set1_ps(t);
    int64_t m = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 c0 = _mm256_cmp_ps(_mm256_loadu_ps(x + i), tv, _CMP_GE_OQ);
        __m256 c1 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), tv, _CMP_GE_OQ);
        __m256 c2 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), tv, _CMP_GE_OQ);
        __m256 c3 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), tv, _CMP_GE_OQ);
        __m256 any = _mm256_or_ps(_mm256_or_ps(c0, c1), _mm256_or_ps(c2, c3));
        if (_mm256_testz_ps(any, any))
            continue;
        uint32_t bits = (uint32_t)_mm256_movemask_ps(c0) | (uint32_t)_mm256_movemask_ps(c1) << 8 |
                        (uint32_t)_mm256_movemask_ps(c2) << 16 | (uint32_t)_mm256_movemask_ps(c3) << 24;
        if (m + 32 <= cap) {
            while (bits) {
                idx[m++] = (int32_t)(i + __builtin_ctz(bits));
                bits &= bits - 1;
            }
        } else {
            while (bits) {
                if (m < cap)
                    idx[m] = (int32_t)(i + __builtin_ctz(bits));
                m++;
                bits &= bits - 1;
            }
        }
    }
    return collect_ge_scalar_from(x, i, n, t, idx, m, cap);
}
#endif

static int use_avx2(void)
{
#ifdef GVR_X86
    static int cached = -1;
    if (cached < 0)
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi");
    return cached;
#else
    return 0;
#endif
}

static int64_t count_ge(const float *x, int64_t n, float t)
{
#ifdef GVR_X86
    if (use_avx2())
        return count_ge_avx2(x, n, t);
#endif
    return count_ge_scalar(x, n, t);
}

/* #{i : x[i] >= t}, storing the first cap such indices (ascending) in idx. */
static int64_t collect_ge(const float *x, int64_t n, float t, int32_t *idx, int64_t cap)
{
#ifdef GVR_X86
    if (use_avx2())
        return collect_ge_avx2(x, n, t, idx, cap);
#endif
    return collect_ge_scalar_from(x, 0, n, t, idx, 0, cap);
}

/* The r-th largest (r >= 1) of v[0..m) by key; v is reordered. Iterative quickselect with a
 * median-of-three pivot, deterministic. */
static uint32_t select_rank(uint32_t *v, int64_t m, int64_t r)
{
    int64_t lo = 0, hi = m - 1, want = r - 1; /* position in descending order */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        uint32_t a = v[lo], b = v[mid], c = v[hi];
        uint32_t piv = (a > b) ? ((b > c) ? b : (a > c ? c : a)) : ((a > c) ? a : (b > c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (v[i] > piv)
                i++;
            while (v[j] < piv)
                j--;
            if (i <= j) {
                uint32_t t = v[i];
                v[i] = v[j];
                v[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return v[want];
    }
    return v[want];
}

/* #{s in sample : s >= t} */
static int64_t sample_rank(const uint32_t *s, int64_t m, uint32_t t)
{
    int64_t r = 0;
    for (int64_t i = 0; i < m; i++)
        r += s[i] >= t;
    return r;
}

/* The kk-th largest key among keys[0..c) (kk <= c), and how many keys are strictly larger.
 * Radix select with 11/11/10-bit digits; after each digit only the keys in the chosen bucket are
 * kept (in tmp, room for c), so later passes touch few keys. */
static uint32_t radix_kth(const uint32_t *keys, int64_t c, int64_t kk, int64_t *greater, uint32_t *tmp)
{
    static const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
    int32_t hist[2048];
    const uint32_t *src = keys;
    uint32_t prefix = 0;
    int64_t need = kk, gt = 0, n = c;
    for (int d = 0; d < 3; d++) {
        int nb = 1 << widths[d];
        uint32_t dm = (uint32_t)nb - 1;
        memset(hist, 0, (size_t)nb * sizeof hist[0]);
        for (int64_t i = 0; i < n; i++)
            hist[(src[i] >> shifts[d]) & dm]++;
        int b = nb - 1;
        int64_t acc = 0;
        for (; b > 0; b--) {
            if (acc + hist[b] >= need)
                break;
            acc += hist[b];
        }
        need -= acc;
        gt += acc;
        prefix |= (uint32_t)b << shifts[d];
        if (d < 2) {
            int64_t w = 0;
            for (int64_t i = 0; i < n; i++) {
                tmp[w] = src[i];
                w += ((src[i] >> shifts[d]) & dm) == (uint32_t)b;
            }
            n = w;
            src = tmp;
        }
    }
    *greater = gt;
    return prefix;
}

/* Stable sort of (key, idx) pairs by key descending (so equal keys stay in ascending index). */
static void sort_desc(uint32_t *key, int32_t *idx, int64_t n, uint32_t *key_tmp, int32_t *idx_tmp)
{
    uint32_t *ks = key, *kd = key_tmp;
    int32_t *is = idx, *id = idx_tmp;
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t cnt[257];
        memset(cnt, 0, sizeof cnt);
        for (int64_t i = 0; i < n; i++)
            cnt[((~ks[i]) >> shift & 255u) + 1]++;
        if (cnt[((~ks[0]) >> shift & 255u) + 1] == n)
            continue; /* every key shares this digit */
        for (int b = 0; b < 256; b++)
            cnt[b + 1] += cnt[b];
        for (int64_t i = 0; i < n; i++) {
            int64_t d = cnt[(~ks[i]) >> shift & 255u]++;
            kd[d] = ks[i];
            id[d] = is[i];
        }
        uint32_t *t = ks; ks = kd; kd = t;
        int32_t *u = is; is = id; id = u;
    }
    if (ks != key) {
        memcpy(key, ks, (size_t)n * sizeof *key);
        memcpy(idx, is, (size_t)n * sizeof *idx);
    }
}

/* One search for a threshold key T with kk <= c(T) = #{x >= T}: T == 0 means every element.
 * Passes collect as they count (idx, room for cap): when the final pass's count fits, its candidates
 * are already in idx (*collected = 1). sq: strided sample (first guess: measured on the decode
 * traces, the sample quantile lands in the window more often than any fixed rank of the predicted
 * values, whose best rank depends on the unknown overlap); sp: the values at the predicted indices,
 * gathered only if the first guess misses, for the refinement (dense near the k-th value). */
typedef struct {
    const float *x;
    int64_t L, kk, W, cap;
    uint32_t *sq, *sp;
    int64_t mq, mp;
    const int32_t *prev; /* gathered into sp only when the first guess misses */
    int64_t kp;
} search_t;

static void gather_prediction(search_t *q)
{
    q->mp = 0;
    for (int64_t j = 0; j < q->kp; j++) {
        int32_t p = q->prev[j];
        if (p >= 0 && p < q->L) {
            uint32_t key = gvr_float_key(q->x[p]);
            if (key)
                q->sp[q->mp++] = key;
        }
    }
    q->kp = 0;
}

static uint32_t find_threshold(search_t *q, int32_t *idx, int64_t *count_out, int *collected)
{
    const int64_t L = q->L, kk = q->kk, W = q->W, target = kk + W / 2;
    uint32_t ge_key = 0, lt_key = KEY_POS_INF + 1; /* c(0) = L >= kk, c(+inf+1) = 0 < kk */
    int64_t ge_cnt = L, lt_cnt = 0;
    int ge_real = 0, lt_real = 0, same_side = 0, last_side = 0, passes = 0;
    *collected = 0;
    uint32_t t;
    if (q->mq > 0) {
        int64_t r = (int64_t)((double)target * (double)q->mq / (double)L) + 1;
        t = select_rank(q->sq, q->mq, r < q->mq ? r : q->mq);
    } else {
        t = KEY_NEG_INF;
    }
    for (int iter = 0; iter < 80; iter++) {
        if (lt_key - ge_key <= 1)
            break;
        if (t <= ge_key || t >= lt_key)
            t = ge_key + (lt_key - ge_key) / 2;
        if (t < KEY_NEG_INF) {
            if (lt_key <= KEY_NEG_INF)
                break; /* fewer than kk non-NaN values: threshold 0 */
            t = KEY_NEG_INF;
        }
        /* collect while counting when the count is expected in the window (first guess, or a
         * bracket tight enough for the secant); count only otherwise */
        const int try_collect = passes == 0 || (ge_real && lt_real && ge_cnt <= 4 * q->cap);
        int64_t c = try_collect ? collect_ge(q->x, L, key_to_float(t), idx, q->cap) : count_ge(q->x, L, key_to_float(t));
        passes++;
        int side;
        if (c >= kk) {
            ge_key = t;
            ge_cnt = c;
            ge_real = 1;
            if (c <= kk + W) {
                *collected = try_collect && c <= q->cap;
                break;
            }
            side = 1;
        } else {
            lt_key = t;
            lt_cnt = c;
            lt_real = 1;
            side = -1;
        }
        same_side = side == last_side ? same_side + 1 : 0;
        last_side = side;
        if (q->kp)
            gather_prediction(q);
        uint32_t nt = 0;
        const uint32_t *smp = q->mp >= 16 ? q->sp : q->sq;
        const int64_t m = q->mp >= 16 ? q->mp : q->mq;
        if (same_side >= 2) {
            nt = 0; /* bisect */
        } else if (ge_real && lt_real && ge_key >= KEY_NEG_INF && lt_key <= KEY_POS_INF) {
            float fg = key_to_float(ge_key), fl = key_to_float(lt_key);
            double f = (double)fg + ((double)fl - (double)fg) * (double)(ge_cnt - target) / (double)(ge_cnt - lt_cnt);
            if (f == f && f > -3.4e38 && f < 3.4e38)
                nt = gvr_float_key((float)f);
        } else if (m > 0) {
            /* one side known: scale the sample's rank of t by the measured count */
            int64_t r = sample_rank(smp, m, t);
            double want = (double)r * (double)target / (double)(c > 0 ? c : 1);
            if (c == 0)
                want = (double)(r + 1) * 4.0;
            int64_t rr = (int64_t)want;
            if (rr < 1)
                rr = 1;
            if (rr > m)
                rr = m;
            nt = select_rank((uint32_t *)smp, m, rr);
        }
        t = nt;
    }
    tls_stats.count_passes = passes;
    *count_out = ge_cnt;
    return ge_key;
}

static int topk_row(const float *x, int64_t L, const int32_t *prev, int64_t Kp, int64_t k, int sorted,
                    int32_t *out)
{
    int64_t kk = k < L ? k : L;
    tls_stats.count_passes = 0;
    tls_stats.candidates = 0;
    for (int64_t i = kk; i < k; i++)
        out[i] = -1;
    if (kk == 0)
        return 0;

    search_t q;
    q.x = x;
    q.L = L;
    q.kk = kk;
    q.W = kk > 64 ? kk : 64; /* candidates up to 2 kk: a wider window saves passes */
    q.cap = kk + q.W;
    /* 1. samples: strided (first guess) and predicted (refinement) */
    int64_t kp = Kp < 8192 ? Kp : 8192;
    uint32_t *sample = malloc((size_t)(1024 + kp) * sizeof *sample);
    int32_t *cidx = malloc((size_t)(q.cap + 64) * sizeof *cidx);
    if (!sample || !cidx) {
        free(sample);
        free(cidx);
        return -1;
    }
    q.sq = sample;
    q.mq = 0;
    int64_t ms = L < 1024 ? L : 1024;
    for (int64_t j = 0; j < ms; j++) {
        uint32_t key = gvr_float_key(x[(j * L) / ms]);
        if (key)
            q.sq[q.mq++] = key;
    }
    q.sp = sample + 1024;
    q.mp = 0;
    q.prev = prev;
    q.kp = kp;

    /* 2. the threshold, and 3. its candidates */
    int64_t c = L;
    int collected = 0;
    uint32_t T = kk == L ? 0 : find_threshold(&q, cidx, &c, &collected);
    free(sample);
    if (T == 0)
        c = L;
    if (!collected) {
        if (c + 64 > q.cap + 64) {
            int32_t *bigger = realloc(cidx, (size_t)(c + 64) * sizeof *cidx);
            if (!bigger) {
                free(cidx);
                return -1;
            }
            cidx = bigger;
        }
        if (T == 0) {
            for (int64_t i = 0; i < L; i++)
                cidx[i] = (int32_t)i;
        } else {
            c = collect_ge(x, L, key_to_float(T), cidx, c);
        }
    }
    uint32_t *ckey = malloc((size_t)(c + 64) * 2 * sizeof *ckey);
    if (!ckey) {
        free(cidx);
        return -1;
    }
    uint32_t *ckey_tmp = ckey + c + 64;
    for (int64_t i = 0; i < c; i++)
        ckey[i] = gvr_float_key(x[cidx[i]]);
    tls_stats.candidates = c;

    /* 4. exact selection */
    int64_t g;
    uint32_t v = radix_kth(ckey, c, kk, &g, ckey_tmp);
    int64_t og = 0, oe = g;
    for (int64_t i = 0; i < c && (og < g || oe < kk); i++) {
        if (ckey[i] > v) {
            out[og++] = cidx[i];
        } else if (ckey[i] == v && oe < kk) {
            out[oe++] = cidx[i];
        }
    }
    if (sorted && kk > 1) {
        uint32_t *sk = malloc((size_t)kk * 2 * sizeof *sk);
        int32_t *si = malloc((size_t)kk * 2 * sizeof *si);
        if (!sk || !si) {
            free(sk);
            free(si);
            free(cidx);
            free(ckey);
            return -1;
        }
        for (int64_t i = 0; i < kk; i++) {
            si[i] = out[i];
            sk[i] = gvr_float_key(x[out[i]]);
        }
        sort_desc(sk, si, kk, sk + kk, si + kk);
        memcpy(out, si, (size_t)kk * sizeof *out);
        free(sk);
        free(si);
    }
    free(cidx);
    free(ckey);
    return 0;
}

int topk_decode_cpu(const gvr_topk_params *p, int num_threads)
{
    int failed = 0;
    int64_t B = p->B;
#ifdef _OPENMP
    if (num_threads > B)
        num_threads = (int)B;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1) reduction(| : failed)
#endif
    for (int64_t b = 0; b < B; b++) {
        int64_t L = p->lengths ? p->lengths[b] : p->N;
        const int32_t *prev = p->prev ? p->prev + b * p->prev_stride : NULL;
        int64_t Kp = p->prev ? p->Kp : 0;
        if (topk_row(p->scores + b * p->row_stride, L, prev, Kp, p->k, p->sorted, p->out + b * p->out_stride))
            failed |= 1;
    }
    (void)num_threads;
    return failed ? -1 : 0;
}
