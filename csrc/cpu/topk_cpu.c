/* Exact decode-time Top-K on the CPU: GVR's guess-verify-refine adapted to one core per row.
 *
 * Order (ARCHITECTURE.md): value descending, -0 == +0, -inf valid, NaN below -inf, ties to the lower
 * index. Mapping every float to a sortable 32-bit key (gvr_key_f32, kernels/common/gvr_keys.h) makes
 * this the order of (key descending, index ascending).
 *
 * Per row of length L, kk = min(k, L), window W = max(kk, 64, 4 ceil(L / 1024)):
 *  1. Guess: a strided sample of 1024 keys; the first threshold is its quantile at rank about
 *     (kk + W/2) * m / L (measured on the decode traces, this lands in the window more often than
 *     any fixed rank of the predicted values). The values at the predicted indices (prev_topk
 *     entries in [0, L)) are gathered only if that guess misses: dense near the k-th value, they
 *     steer the refinement.
 *  2. Verify: exact counts c(t) = #{x >= t} by a vectorized pass; next thresholds by secant
 *     interpolation between the bracketing counts, or, while only one side is known, by the
 *     sample anchored at the measured count (the sample gives the shape of the distribution, the
 *     pass its scale); bisection in key space when the secant stalls. Stops when
 *     kk <= c(t) <= kk + W. Key-space bisection over 2^32 keys guarantees termination.
 *  3. Collect: a pass that is expected to land in the window collects while it counts, so in the
 *     common case the row is read exactly once: per 64 elements a 64-bit compare mask whose set bits
 *     become indices by branch-free tzcnt/blsr stores. The candidates' keys are then gathered.
 *  4. Refine: the kk-th largest key v among the c candidates by radix select on key - min over the
 *     candidates' own key range (the first 11-bit digit already separates them, one histogram over
 *     the c keys plus a vectorized pick of the one bucket that holds v, then a few keys); emit every
 *     candidate with key > v (AVX2: compare, movemask, vpermd compress from a 256-entry table), then
 *     the lowest-index candidates with key == v until kk are emitted. Exact for any threshold with
 *     c(t) >= kk, so ties, -inf and NaN need no special path for exactness (a row with fewer than kk
 *     non-NaN values takes threshold key 0: every element is a candidate).
 *  Ties (session 19): when a guess stalls on a key with too many elements at or above it, one count of
 *     the keys above it tells whether it is the kk-th key (a constant, masked, NaN-filled or few-valued
 *     row: two passes instead of ~30 bisection steps), and if so the selection skips step 4's key
 *     gathering: two collecting passes take the g elements above it and the first kk at or above it,
 *     whose first kk - g ties follow the g (emit_ties; the same output). A sample that holds fewer than
 *     kk non-NaN values per row length makes -inf the first guess.
 * The sample quantiles use the same radix select. Output order (unsorted): the candidates above v
 * in index order, then the ties in index order. Optional sort: stable LSD radix sort of the kk
 * (key, index) pairs by key descending.
 * The AVX2 paths (runtime check, use_avx2) and the scalar fallbacks give identical results.
 */
#include "topk_cpu.h"

#include "../../kernels/common/gvr_keys.h"
#include "elem.h"
#include "threads.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GVR_X86 1
#endif

static _Thread_local gvr_topk_cpu_stats tls_stats;

void topk_cpu_last_stats(gvr_topk_cpu_stats *s) { *s = tls_stats; }

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

/* Bit i of the result: x[i] >= t, for the 64 elements at x. The eight compare masks are narrowed
 * to bytes by saturating packs (which interleave the 128-bit lanes; vpermd restores the order) so
 * that two byte-movemasks give all 64 bits. */
__attribute__((target("avx2"))) static inline uint64_t mask64_ge_avx2(const float *x, __m256 tv)
{
    __m256i c[8];
    for (int j = 0; j < 8; j++)
        c[j] = _mm256_castps_si256(_mm256_cmp_ps(_mm256_loadu_ps(x + 8 * j), tv, _CMP_GE_OQ));
    /* bytes per 128-bit lane of q0: lane 0 = c0[0..3] c1[0..3] c2[0..3] c3[0..3], lane 1 = [4..7] */
    __m256i q0 = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    __m256i q1 = _mm256_packs_epi16(_mm256_packs_epi32(c[4], c[5]), _mm256_packs_epi32(c[6], c[7]));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    q0 = _mm256_permutevar8x32_epi32(q0, order);
    q1 = _mm256_permutevar8x32_epi32(q1, order);
    return (uint64_t)(uint32_t)_mm256_movemask_epi8(q0) | (uint64_t)(uint32_t)_mm256_movemask_epi8(q1) << 32;
}

/* Count and collect in one pass, without data-dependent branches in the common case: per block of
 * 64 elements a 64-bit mask, whose set bits become indices four at a time by unconditional stores
 * (tzcnt of an empty mask gives 64: a harmless entry past the count that the next store
 * overwrites); the output advances by the popcount. A block with more than four candidates loops
 * on. This needs idx[m..m+64) writable, so near cap the stores become checked ones. Candidates
 * beyond cap are counted, not stored. (The volatile store keeps GCC from packing the four stores
 * into one vector store, which costs more here.) */
#define GVR_FLATTEN_ONE(j)                                                                                   \
    do {                                                                                                   \
        ((volatile int32_t *)o)[j] = base + (int32_t)_tzcnt_u64(bits);                                     \
        bits = _blsr_u64(bits);                                                                            \
    } while (0)
__attribute__((target("avx2,bmi,popcnt"))) static int64_t collect_ge_avx2(const float *x, int64_t n, float t,
                                                                           int32_t *idx, int64_t cap)
{
    const __m256 tv = _mm256_set1_ps(t);
    int64_t m = 0, i = 0;
    for (; i + 64 <= n && m + 64 <= cap; i += 64) {
        uint64_t bits = mask64_ge_avx2(x + i, tv);
        int32_t *o = idx + m;
        const int32_t base = (int32_t)i;
        m += (int64_t)_mm_popcnt_u64(bits);
        do {
            GVR_FLATTEN_ONE(0);
            GVR_FLATTEN_ONE(1);
            GVR_FLATTEN_ONE(2);
            GVR_FLATTEN_ONE(3);
            o += 4;
        } while (bits);
    }
    for (; i + 64 <= n && m < cap; i += 64) {
        uint64_t bits = mask64_ge_avx2(x + i, tv);
        while (bits) {
            if (m < cap)
                idx[m] = (int32_t)i + (int32_t)_tzcnt_u64(bits);
            m++;
            bits = _blsr_u64(bits);
        }
    }
    if (i + 64 <= n) { /* full: count the rest */
        int64_t rest = (n - i) & ~(int64_t)63;
        m += count_ge_avx2(x + i, rest, t);
        i += rest;
    }
    return collect_ge_scalar_from(x, i, n, t, idx, m, cap);
}
#undef GVR_FLATTEN_ONE
#endif

static int use_avx2(void)
{
#ifdef GVR_X86
    static int cached = -1;
    if (cached < 0)
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("popcnt");
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

/* #{i : x[i] >= t}, storing the first cap such indices (ascending) in idx (room for cap + 64). */
static int64_t collect_ge(const float *x, int64_t n, float t, int32_t *idx, int64_t cap)
{
#ifdef GVR_X86
    if (use_avx2())
        return collect_ge_avx2(x, n, t, idx, cap);
#endif
    return collect_ge_scalar_from(x, 0, n, t, idx, 0, cap);
}

/* #{s in sample : s >= t} */
static int64_t sample_rank(const uint32_t *s, int64_t m, uint32_t t)
{
    int64_t r = 0;
    for (int64_t i = 0; i < m; i++)
        r += s[i] >= t;
    return r;
}

/* Copies the keys of src[0..n) in [lo, lo + width - 1] (width >= 1, lo + width - 1 without
 * overflow) to dst, in order; returns how many. */
static int64_t keep_range_scalar(const uint32_t *src, int64_t n, uint32_t lo, uint32_t width, uint32_t *dst)
{
    int64_t w = 0;
    for (int64_t i = 0; i < n; i++) {
        dst[w] = src[i];
        w += src[i] - lo < width;
    }
    return w;
}

#ifdef GVR_X86
/* The kept keys are few (one bucket of a histogram): eight compares and a movemask skip the rest. */
__attribute__((target("avx2"))) static int64_t keep_range_avx2(const uint32_t *src, int64_t n, uint32_t lo,
                                                               uint32_t width, uint32_t *dst)
{
    const __m256i sign = _mm256_set1_epi32((int32_t)0x80000000u), vlo = _mm256_set1_epi32((int32_t)lo),
                  vw = _mm256_set1_epi32((int32_t)(width ^ 0x80000000u));
    int64_t w = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i d = _mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(src + i)), vlo);
        __m256i in = _mm256_cmpgt_epi32(vw, _mm256_xor_si256(d, sign)); /* unsigned d < width */
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(in));
        while (m) {
            dst[w++] = src[i + __builtin_ctz(m)];
            m &= m - 1;
        }
    }
    return w + keep_range_scalar(src + i, n - i, lo, width, dst + w);
}
#endif

static int64_t keep_range(const uint32_t *src, int64_t n, uint32_t lo, uint32_t width, uint32_t *dst)
{
#ifdef GVR_X86
    if (use_avx2())
        return keep_range_avx2(src, n, lo, width, dst);
#endif
    return keep_range_scalar(src, n, lo, width, dst);
}

/* Number of significant bits of v (0 for 0). */
static inline int bit_length(uint64_t v)
{
#if defined(__GNUC__)
    return v ? 64 - __builtin_clzll(v) : 0;
#else
    int b = 0;
    for (; v; v >>= 1)
        b++;
    return b;
#endif
}

/* The need-th largest (1 <= need <= n) of keys[0..n), all of them in [lo, hi], and how many keys
 * are strictly larger. Radix select on key - lo: each round histograms the next bits below the top
 * bit of the remaining range hi - lo (up to 11, fewer for few keys), so the first round already
 * splits the candidates although they share their high bits; it finds the bucket holding the answer
 * by a scan from the nearer end and keeps only that bucket's keys (in tmp, room for n). A range of
 * one key ends it, and so do a handful of keys, by insertion sort. Two interleaved histograms keep
 * repeated buckets from serializing the increments. */
static uint32_t kth_largest(const uint32_t *keys, int64_t n, int64_t need, uint32_t lo, uint32_t hi,
                            int64_t *greater, uint32_t *tmp)
{
    int32_t hist[2][2048];
    const uint32_t *src = keys;
    int64_t gt = 0;
    while (lo < hi) {
        if (n <= 16) {
            uint32_t a[16];
            for (int64_t i = 0; i < n; i++) {
                uint32_t e = src[i];
                int64_t j = i;
                while (j > 0 && a[j - 1] < e) {
                    a[j] = a[j - 1];
                    j--;
                }
                a[j] = e;
            }
            uint32_t v = a[need - 1];
            int64_t j = need - 1;
            while (j > 0 && a[j - 1] == v)
                j--;
            *greater = gt + j;
            return v;
        }
        const uint32_t span = hi - lo;
        const int top = bit_length(span);           /* bits of the range, >= 1 */
        const int want = bit_length((uint64_t)n); /* about log2(n) + 1 */
        const int width = want < 11 ? (want > 4 ? want : 4) : 11;
        const int shift = top > width ? top - width : 0;
        const int nb = (int)(span >> shift) + 1;
        memset(hist[0], 0, (size_t)nb * sizeof hist[0][0]);
        memset(hist[1], 0, (size_t)nb * sizeof hist[1][0]);
        int64_t i = 0;
        for (; i + 2 <= n; i += 2) {
            hist[0][(src[i] - lo) >> shift]++;
            hist[1][(src[i + 1] - lo) >> shift]++;
        }
        if (i < n)
            hist[0][(src[i] - lo) >> shift]++;
        int b;
        int64_t above, in_b;
        if (2 * need <= n) { /* near the top: scan down */
            int64_t acc = 0;
            for (b = nb - 1;; b--) {
                in_b = hist[0][b] + hist[1][b];
                if (acc + in_b >= need)
                    break;
                acc += in_b;
            }
            above = acc;
        } else { /* scan up to rank n - need + 1 from the bottom */
            const int64_t rb = n - need + 1;
            int64_t acc = 0;
            for (b = 0;; b++) {
                in_b = hist[0][b] + hist[1][b];
                if (acc + in_b >= rb)
                    break;
                acc += in_b;
            }
            above = n - acc - in_b;
        }
        gt += above;
        need -= above;
        const uint32_t nlo = lo + ((uint32_t)b << shift);
        const uint64_t nhi = (uint64_t)nlo + (((uint64_t)1 << shift) - 1);
        if (in_b < n) {
            n = keep_range(src, n, nlo, (uint32_t)1 << shift, tmp);
            src = tmp;
        }
        lo = nlo;
        hi = nhi < hi ? (uint32_t)nhi : hi;
    }
    *greater = gt;
    return lo;
}

/* The r-th largest (1 <= r <= m) of v[0..m) (tmp: room for m). */
static uint32_t sample_select(const uint32_t *v, int64_t m, int64_t r, uint32_t *tmp)
{
    uint32_t lo = 0xFFFFFFFFu, hi = 0;
    for (int64_t i = 0; i < m; i++) {
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
    }
    int64_t g;
    return kth_largest(v, m, r, lo, hi, &g, tmp);
}

/* keys[i] = gvr_key_f32(x[idx[i]]) for i < n; *kmin, *kmax: their range (n >= 1). */
static void keys_of_scalar(const float *x, const int32_t *idx, int64_t n, uint32_t *keys, uint32_t *kmin,
                           uint32_t *kmax)
{
    uint32_t lo = 0xFFFFFFFFu, hi = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t k = gvr_key_f32(x[idx[i]]);
        keys[i] = k;
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
    }
    *kmin = lo;
    *kmax = hi;
}

#ifdef GVR_X86
__attribute__((target("avx2"))) static void keys_of_avx2(const float *x, const int32_t *idx, int64_t n, uint32_t *keys,
                                                         uint32_t *kmin, uint32_t *kmax)
{
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000),
                  sign = _mm256_set1_epi32((int32_t)0x80000000u);
    __m256i vlo = _mm256_set1_epi32(-1), vhi = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i b = _mm256_castps_si256(_mm256_i32gather_ps(x, _mm256_loadu_si256((const __m256i *)(idx + i)), 4));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, abs_mask), inf);
        b = _mm256_andnot_si256(_mm256_cmpeq_epi32(b, sign), b); /* -0 -> +0 */
        /* negative: ~b; otherwise b | sign */
        __m256i k = _mm256_xor_si256(b, _mm256_or_si256(_mm256_srai_epi32(b, 31), sign));
        k = _mm256_andnot_si256(nan, k);
        _mm256_storeu_si256((__m256i *)(keys + i), k);
        vlo = _mm256_min_epu32(vlo, k);
        vhi = _mm256_max_epu32(vhi, k);
    }
    uint32_t l[8], h[8], lo, hi;
    _mm256_storeu_si256((__m256i *)l, vlo);
    _mm256_storeu_si256((__m256i *)h, vhi);
    keys_of_scalar(x, idx + i, n - i, keys + i, &lo, &hi);
    for (int j = 0; j < 8; j++) {
        lo = l[j] < lo ? l[j] : lo;
        hi = h[j] > hi ? h[j] : hi;
    }
    *kmin = lo;
    *kmax = hi;
}
#endif

static void keys_of(const float *x, const int32_t *idx, int64_t n, uint32_t *keys, uint32_t *kmin, uint32_t *kmax)
{
#ifdef GVR_X86
    if (use_avx2()) {
        keys_of_avx2(x, idx, n, keys, kmin, kmax);
        return;
    }
#endif
    keys_of_scalar(x, idx, n, keys, kmin, kmax);
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

/* Emit the selection in the order of the candidates (ascending index): every candidate with key > v
 * (g of them) to out[0..g), then the first kk - g with key == v to out[g..kk). tmp: room for c + 8. */
static void emit_selected_scalar(const uint32_t *key, const int32_t *idx, int64_t c, uint32_t v, int64_t g,
                                 int64_t kk, int32_t *out, int32_t *tmp)
{
    (void)tmp;
    int64_t og = 0, oe = g;
    for (int64_t i = 0; i < c; i++) {
        out[og] = idx[i]; /* og <= g < kk: a slot that a later store or the ties overwrite */
        og += key[i] > v;
    }
    for (int64_t i = 0; i < c && oe < kk; i++)
        if (key[i] == v)
            out[oe++] = idx[i];
}

#ifdef GVR_X86
/* compress_lut[m]: the positions of the set bits of m, ascending, one per byte (then zeros): the
 * vpermd pattern that moves the selected lanes of a vector to its front. */
static const uint64_t compress_lut[256] = {
    0x0000000000000000u, 0x0000000000000000u, 0x0000000000000001u, 0x0000000000000100u,
    0x0000000000000002u, 0x0000000000000200u, 0x0000000000000201u, 0x0000000000020100u,
    0x0000000000000003u, 0x0000000000000300u, 0x0000000000000301u, 0x0000000000030100u,
    0x0000000000000302u, 0x0000000000030200u, 0x0000000000030201u, 0x0000000003020100u,
    0x0000000000000004u, 0x0000000000000400u, 0x0000000000000401u, 0x0000000000040100u,
    0x0000000000000402u, 0x0000000000040200u, 0x0000000000040201u, 0x0000000004020100u,
    0x0000000000000403u, 0x0000000000040300u, 0x0000000000040301u, 0x0000000004030100u,
    0x0000000000040302u, 0x0000000004030200u, 0x0000000004030201u, 0x0000000403020100u,
    0x0000000000000005u, 0x0000000000000500u, 0x0000000000000501u, 0x0000000000050100u,
    0x0000000000000502u, 0x0000000000050200u, 0x0000000000050201u, 0x0000000005020100u,
    0x0000000000000503u, 0x0000000000050300u, 0x0000000000050301u, 0x0000000005030100u,
    0x0000000000050302u, 0x0000000005030200u, 0x0000000005030201u, 0x0000000503020100u,
    0x0000000000000504u, 0x0000000000050400u, 0x0000000000050401u, 0x0000000005040100u,
    0x0000000000050402u, 0x0000000005040200u, 0x0000000005040201u, 0x0000000504020100u,
    0x0000000000050403u, 0x0000000005040300u, 0x0000000005040301u, 0x0000000504030100u,
    0x0000000005040302u, 0x0000000504030200u, 0x0000000504030201u, 0x0000050403020100u,
    0x0000000000000006u, 0x0000000000000600u, 0x0000000000000601u, 0x0000000000060100u,
    0x0000000000000602u, 0x0000000000060200u, 0x0000000000060201u, 0x0000000006020100u,
    0x0000000000000603u, 0x0000000000060300u, 0x0000000000060301u, 0x0000000006030100u,
    0x0000000000060302u, 0x0000000006030200u, 0x0000000006030201u, 0x0000000603020100u,
    0x0000000000000604u, 0x0000000000060400u, 0x0000000000060401u, 0x0000000006040100u,
    0x0000000000060402u, 0x0000000006040200u, 0x0000000006040201u, 0x0000000604020100u,
    0x0000000000060403u, 0x0000000006040300u, 0x0000000006040301u, 0x0000000604030100u,
    0x0000000006040302u, 0x0000000604030200u, 0x0000000604030201u, 0x0000060403020100u,
    0x0000000000000605u, 0x0000000000060500u, 0x0000000000060501u, 0x0000000006050100u,
    0x0000000000060502u, 0x0000000006050200u, 0x0000000006050201u, 0x0000000605020100u,
    0x0000000000060503u, 0x0000000006050300u, 0x0000000006050301u, 0x0000000605030100u,
    0x0000000006050302u, 0x0000000605030200u, 0x0000000605030201u, 0x0000060503020100u,
    0x0000000000060504u, 0x0000000006050400u, 0x0000000006050401u, 0x0000000605040100u,
    0x0000000006050402u, 0x0000000605040200u, 0x0000000605040201u, 0x0000060504020100u,
    0x0000000006050403u, 0x0000000605040300u, 0x0000000605040301u, 0x0000060504030100u,
    0x0000000605040302u, 0x0000060504030200u, 0x0000060504030201u, 0x0006050403020100u,
    0x0000000000000007u, 0x0000000000000700u, 0x0000000000000701u, 0x0000000000070100u,
    0x0000000000000702u, 0x0000000000070200u, 0x0000000000070201u, 0x0000000007020100u,
    0x0000000000000703u, 0x0000000000070300u, 0x0000000000070301u, 0x0000000007030100u,
    0x0000000000070302u, 0x0000000007030200u, 0x0000000007030201u, 0x0000000703020100u,
    0x0000000000000704u, 0x0000000000070400u, 0x0000000000070401u, 0x0000000007040100u,
    0x0000000000070402u, 0x0000000007040200u, 0x0000000007040201u, 0x0000000704020100u,
    0x0000000000070403u, 0x0000000007040300u, 0x0000000007040301u, 0x0000000704030100u,
    0x0000000007040302u, 0x0000000704030200u, 0x0000000704030201u, 0x0000070403020100u,
    0x0000000000000705u, 0x0000000000070500u, 0x0000000000070501u, 0x0000000007050100u,
    0x0000000000070502u, 0x0000000007050200u, 0x0000000007050201u, 0x0000000705020100u,
    0x0000000000070503u, 0x0000000007050300u, 0x0000000007050301u, 0x0000000705030100u,
    0x0000000007050302u, 0x0000000705030200u, 0x0000000705030201u, 0x0000070503020100u,
    0x0000000000070504u, 0x0000000007050400u, 0x0000000007050401u, 0x0000000705040100u,
    0x0000000007050402u, 0x0000000705040200u, 0x0000000705040201u, 0x0000070504020100u,
    0x0000000007050403u, 0x0000000705040300u, 0x0000000705040301u, 0x0000070504030100u,
    0x0000000705040302u, 0x0000070504030200u, 0x0000070504030201u, 0x0007050403020100u,
    0x0000000000000706u, 0x0000000000070600u, 0x0000000000070601u, 0x0000000007060100u,
    0x0000000000070602u, 0x0000000007060200u, 0x0000000007060201u, 0x0000000706020100u,
    0x0000000000070603u, 0x0000000007060300u, 0x0000000007060301u, 0x0000000706030100u,
    0x0000000007060302u, 0x0000000706030200u, 0x0000000706030201u, 0x0000070603020100u,
    0x0000000000070604u, 0x0000000007060400u, 0x0000000007060401u, 0x0000000706040100u,
    0x0000000007060402u, 0x0000000706040200u, 0x0000000706040201u, 0x0000070604020100u,
    0x0000000007060403u, 0x0000000706040300u, 0x0000000706040301u, 0x0000070604030100u,
    0x0000000706040302u, 0x0000070604030200u, 0x0000070604030201u, 0x0007060403020100u,
    0x0000000000070605u, 0x0000000007060500u, 0x0000000007060501u, 0x0000000706050100u,
    0x0000000007060502u, 0x0000000706050200u, 0x0000000706050201u, 0x0000070605020100u,
    0x0000000007060503u, 0x0000000706050300u, 0x0000000706050301u, 0x0000070605030100u,
    0x0000000706050302u, 0x0000070605030200u, 0x0000070605030201u, 0x0007060503020100u,
    0x0000000007060504u, 0x0000000706050400u, 0x0000000706050401u, 0x0000070605040100u,
    0x0000000706050402u, 0x0000070605040200u, 0x0000070605040201u, 0x0007060504020100u,
    0x0000000706050403u, 0x0000070605040300u, 0x0000070605040301u, 0x0007060504030100u,
    0x0000070605040302u, 0x0007060504030200u, 0x0007060504030201u, 0x0706050403020100u,
};

/* Eight candidates at a time: compare, movemask, compress the selected indices with vpermd from
 * compress_lut and store them whole at the output position (in tmp, which has the slack), advance by
 * the popcount. Ties are rare: a compare-equal movemask skips the groups without one. */
__attribute__((target("avx2,popcnt"))) static void emit_selected_avx2(const uint32_t *key, const int32_t *idx,
                                                                      int64_t c, uint32_t v, int64_t g, int64_t kk,
                                                                      int32_t *out, int32_t *tmp)
{
    const __m256i sign = _mm256_set1_epi32((int32_t)0x80000000u);
    const __m256i vv = _mm256_set1_epi32((int32_t)v), vs = _mm256_xor_si256(vv, sign);
    int64_t og = 0, i = 0;
    for (; i + 8 <= c; i += 8) {
        __m256i k = _mm256_loadu_si256((const __m256i *)(key + i));
        __m256i gt = _mm256_cmpgt_epi32(_mm256_xor_si256(k, sign), vs); /* unsigned k > v */
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(gt));
        __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)&compress_lut[m]));
        __m256i ix = _mm256_loadu_si256((const __m256i *)(idx + i));
        _mm256_storeu_si256((__m256i *)(tmp + og), _mm256_permutevar8x32_epi32(ix, perm));
        og += _mm_popcnt_u32(m);
    }
    for (; i < c; i++) {
        tmp[og] = idx[i];
        og += key[i] > v;
    }
    memcpy(out, tmp, (size_t)g * sizeof *out);
    int64_t oe = g;
    for (i = 0; i + 8 <= c && oe < kk; i += 8) {
        __m256i eq = _mm256_cmpeq_epi32(_mm256_loadu_si256((const __m256i *)(key + i)), vv);
        unsigned m = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(eq));
        while (m && oe < kk) {
            out[oe++] = idx[i + __builtin_ctz(m)];
            m &= m - 1;
        }
    }
    for (; i < c && oe < kk; i++)
        if (key[i] == v)
            out[oe++] = idx[i];
}
#endif

static void emit_selected(const uint32_t *key, const int32_t *idx, int64_t c, uint32_t v, int64_t g, int64_t kk,
                          int32_t *out, int32_t *tmp)
{
#ifdef GVR_X86
    if (use_avx2()) {
        emit_selected_avx2(key, idx, c, v, g, kk, out, tmp);
        return;
    }
#endif
    emit_selected_scalar(key, idx, c, v, g, kk, out, tmp);
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
    uint32_t *sq, *sp, *scratch; /* scratch: room for max(1024, kp) */
    int64_t mq, mp, ms; /* ms: the strided sample's size, NaNs included (mq: without them) */
    const int32_t *prev; /* gathered into sp only when the first guess misses */
    int64_t kp;
} search_t;

static void gather_prediction(search_t *q)
{
    q->mp = 0;
    for (int64_t j = 0; j < q->kp; j++) {
        int32_t p = q->prev[j];
        if (p >= 0 && p < q->L) {
            uint32_t key = gvr_key_f32(q->x[p]);
            if (key)
                q->sp[q->mp++] = key;
        }
    }
    q->kp = 0;
}

static uint32_t find_threshold(search_t *q, int32_t *idx, int64_t *count_out, int *collected, int64_t *above_out)
{
    const int64_t L = q->L, kk = q->kk, W = q->W, target = kk + W / 2;
    uint32_t ge_key = 0, lt_key = GVR_KEY_POS_INF + 1; /* c(0) = L >= kk, c(+inf+1) = 0 < kk */
    int64_t ge_cnt = L, lt_cnt = 0;
    int ge_real = 0, lt_real = 0, same_side = 0, last_side = 0, passes = 0;
    uint32_t tie_checked = 0; /* the ge_key whose count above was taken (0: none) */
    *collected = 0;
    uint32_t t;
    if (q->mq > 0 && (double)q->mq * (double)L >= (double)kk * (double)q->ms) {
        int64_t r = (int64_t)((double)target * (double)q->mq / (double)L) + 1;
        t = sample_select(q->sq, q->mq, r < q->mq ? r : q->mq, q->scratch);
    } else {
        t = GVR_KEY_NEG_INF; /* the sample suggests fewer than kk non-NaN values: count them first */
    }
    for (int iter = 0; iter < 80; iter++) {
        if (lt_key - ge_key <= 1)
            break;
        if (t == ge_key && ge_real && ge_key >= GVR_KEY_NEG_INF && tie_checked != ge_key) {
            /* the guess stalls on a key that has too many elements at or above it: many may tie at it
             * (a constant or masked row, few distinct values). One count of the keys above it (x >=
             * the next key's float: exact in the key order) ends the search when it is below kk --
             * the bisection would take ~30 passes to find the next key */
            const int64_t above = ge_key == GVR_KEY_POS_INF ? 0 : count_ge(q->x, L, gvr_key_to_f32(ge_key + 1));
            passes++;
            tie_checked = ge_key;
            if (above < kk) {
                lt_key = ge_key + 1;
                lt_cnt = above;
                lt_real = 1;
                break;
            }
            ge_key = ge_key + 1; /* kk or more above: the next key is a valid lower end */
            ge_cnt = above;
            if (ge_cnt <= kk + W)
                break; /* and its count is in the window: the candidates are collected at it */
        }
        if (t <= ge_key || t >= lt_key)
            t = ge_key + (lt_key - ge_key) / 2;
        if (t < GVR_KEY_NEG_INF) {
            if (lt_key <= GVR_KEY_NEG_INF)
                break; /* fewer than kk non-NaN values: threshold 0 */
            t = GVR_KEY_NEG_INF;
        }
        /* collect while counting when the count is expected in the window (first guess, or a
         * bracket tight enough for the secant); count only otherwise */
        const int try_collect = passes == 0 || (ge_real && lt_real && ge_cnt <= 4 * q->cap);
        int64_t c = try_collect ? collect_ge(q->x, L, gvr_key_to_f32(t), idx, q->cap) : count_ge(q->x, L, gvr_key_to_f32(t));
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
        } else if (ge_real && lt_real && ge_key >= GVR_KEY_NEG_INF && lt_key <= GVR_KEY_POS_INF) {
            float fg = gvr_key_to_f32(ge_key), fl = gvr_key_to_f32(lt_key);
            double f = (double)fg + ((double)fl - (double)fg) * (double)(ge_cnt - target) / (double)(ge_cnt - lt_cnt);
            if (f == f && f > -3.4e38 && f < 3.4e38)
                nt = gvr_key_f32((float)f);
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
            nt = sample_select(smp, m, rr, q->scratch);
        }
        t = nt;
    }
    tls_stats.count_passes = passes;
    *count_out = ge_cnt;
    /* #{key > T} when the search ended on adjacent keys with a real count above (else -1) */
    *above_out = lt_real && (lt_key == ge_key + 1 || (ge_key == 0 && lt_key == GVR_KEY_NEG_INF)) ? lt_cnt : -1;
    return ge_key;
}

/* The selection when T is exactly the kk-th largest key and g < kk keys lie above it: in index order
 * every element above T, then the lowest-index elements equal to T -- emit_selected's order, without
 * gathering keys of the candidates (a constant, masked or few-valued row has ~L of them). Two collecting
 * passes (float compares are the key order: x >= the float of key T + 1 is "above T"): the elements
 * above T, then the first kk at or above T, of which at most g are above, so at least kk - g ties.
 * buf: room for g + kk + 128 indices. 0, or -1 when the counts disagree (the caller then takes the
 * general path). */
static int emit_ties(const float *x, int64_t L, uint32_t T, int64_t g, int64_t kk, int32_t *out, int32_t *buf)
{
    /* T == 0 (fewer than kk non-NaN values): "above" is every non-NaN value (key >= that of -inf) and
     * the ties are NaNs, of which the first kk elements hold at least kk - g */
    const float above_f = T == 0 ? gvr_key_to_f32(GVR_KEY_NEG_INF) : gvr_key_to_f32(T + 1);
    const int64_t n_above = T == GVR_KEY_POS_INF ? 0 : collect_ge(x, L, above_f, buf, g);
    if (n_above != g)
        return -1;
    int32_t *ge = buf + g + 64;
    const float f = T ? gvr_key_to_f32(T) : 0.0f;
    if (T == 0) {
        for (int64_t i = 0; i < kk; i++)
            ge[i] = (int32_t)i;
    } else if (collect_ge(x, L, f, ge, kk) < kk) {
        return -1;
    }
    memcpy(out, buf, (size_t)g * sizeof *out);
    int64_t o = g;
    for (int64_t i = 0; i < kk && o < kk; i++) {
        const float v = x[ge[i]];
        if (T == 0 ? v != v : v == f)
            out[o++] = ge[i];
    }
    return o == kk ? 0 : -1;
}

/* out[0..kk) by key descending, ties by index (sort_desc); 0, or -1 out of memory */
static int sort_selected(const float *x, int32_t *out, int64_t kk)
{
    if (kk <= 1)
        return 0;
    uint32_t *sk = malloc((size_t)kk * 2 * sizeof *sk);
    int32_t *si = malloc((size_t)kk * 2 * sizeof *si);
    if (!sk || !si) {
        free(sk);
        free(si);
        return -1;
    }
    for (int64_t i = 0; i < kk; i++) {
        si[i] = out[i];
        sk[i] = gvr_key_f32(x[out[i]]);
    }
    sort_desc(sk, si, kk, sk + kk, si + kk);
    memcpy(out, si, (size_t)kk * sizeof *out);
    free(sk);
    free(si);
    return 0;
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
    /* candidates up to kk + W: a wider window saves passes. And at least 4 sample strides (L / 1024
     * elements each): a window narrower than the sample can resolve makes a small k at a large L a
     * secant search of ~13 passes (k <= 64 at L 128K: 220-270 us against 39 for k = 1024) */
    const int64_t stride4 = 4 * ((L + 1023) / 1024);
    q.W = kk > 64 ? kk : 64;
    if (q.W < stride4)
        q.W = stride4;
    q.cap = kk + q.W;
    /* 1. samples: strided (first guess) and predicted (refinement); candidate buffers */
    int64_t kp = Kp < 8192 ? Kp : 8192;
    uint32_t *sample = malloc((size_t)(1024 + kp + (kp > 1024 ? kp : 1024)) * sizeof *sample);
    int32_t *cidx = malloc((size_t)(q.cap + 64) * sizeof *cidx);
    if (!sample || !cidx) {
        free(sample);
        free(cidx);
        return -1;
    }
    q.sq = sample;
    q.mq = 0;
    /* x[floor(j L / ms)], j < ms, stepping the quotient and remainder (no division per element);
     * NaN (key 0) is left out */
    const int64_t ms = L < 1024 ? L : 1024, step = L / ms, step_rem = L % ms;
    for (int64_t j = 0, pos = 0, rem = 0; j < ms; j++) {
        uint32_t key = gvr_key_f32(x[pos]);
        q.sq[q.mq] = key;
        q.mq += key != 0;
        pos += step;
        rem += step_rem;
        if (rem >= ms) {
            pos++;
            rem -= ms;
        }
    }
    q.ms = ms;
    q.sp = sample + 1024;
    q.scratch = sample + 1024 + kp;
    q.mp = 0;
    q.prev = prev;
    q.kp = kp;

    /* 2. the threshold, and 3. its candidates (indices ascending) */
    int64_t c = L, above = -1;
    int collected = 0;
    uint32_t T = kk == L ? 0 : find_threshold(&q, cidx, &c, &collected, &above);
    free(sample);
    if (T == 0)
        c = L;
    if (!collected && above >= 0 && above < kk && c > q.cap && kk < L) { /* many ties at T (T 0: NaNs) */
        if (above + kk + 128 > q.cap + 64) {
            free(cidx);
            if (!(cidx = malloc((size_t)(above + kk + 128) * sizeof *cidx)))
                return -1;
        }
        if (emit_ties(x, L, T, above, kk, out, cidx) == 0) {
            free(cidx);
            return sorted ? sort_selected(x, out, kk) : 0;
        }
    }
    if (!collected) {
        if (c > q.cap) {
            free(cidx);
            cidx = malloc((size_t)(c + 64) * sizeof *cidx);
            if (!cidx)
                return -1;
        }
        if (T == 0) {
            for (int64_t i = 0; i < L; i++)
                cidx[i] = (int32_t)i;
        } else {
            c = collect_ge(x, L, gvr_key_to_f32(T), cidx, c);
        }
    }
    uint32_t *ckey = malloc((size_t)(c + 64) * 2 * sizeof *ckey);
    if (!ckey) {
        free(cidx);
        return -1;
    }
    uint32_t *ckey_tmp = ckey + c + 64;
    uint32_t kmin, kmax;
    keys_of(x, cidx, c, ckey, &kmin, &kmax);
    tls_stats.candidates = c;

    /* 4. exact selection: v, the kk-th largest key, and g = #{key > v}; then every candidate above
     * v in index order, and the lowest-index candidates equal to v after them */
    int64_t g;
    uint32_t v = kth_largest(ckey, c, kk, kmin, kmax, &g, ckey_tmp);
    emit_selected(ckey, cidx, c, v, g, kk, out, (int32_t *)ckey_tmp);
    free(cidx);
    free(ckey);
    return sorted ? sort_selected(x, out, kk) : 0;
}

/* rows of the call per row of an argument given per request (gvr_topk_params.per_request) */
static int64_t per_req_div(const gvr_topk_params *p, int flag)
{
    return (p->per_request & flag) && p->next_n > 1 ? p->next_n : 1;
}

/* the CPU path takes per-row lengths (the intake expands per-request ones) and checked starts */
static int64_t row_len(const gvr_topk_params *p, int64_t b)
{
    const int64_t L = p->lengths ? p->lengths[b] : p->N - (p->row_starts ? p->row_starts[b] : 0);
    return p->max_len > 0 && L > p->max_len ? p->max_len : L;
}

/* Half rows: their exact float32 values (gvr_row_to_f32) in this thread's row buffer, kept between
 * calls (a malloc of a long row per row per call cost more than the conversion), then the float32
 * path. */
#define TLS_ROW_MAX (1 << 20) /* elements: at most 4 MB kept per thread */
static _Thread_local float *tls_row;
static _Thread_local int64_t tls_row_cap;

static int topk_row_of(void *ctx, int64_t b)
{
    const gvr_topk_params *p = ctx;
    const int32_t *prev = p->prev ? p->prev + b / per_req_div(p, GVR_TOPK_PREV_PER_REQUEST) * p->prev_stride : NULL;
    const int64_t Kp = p->prev ? p->Kp : 0, L = row_len(p, b);
    const int64_t first = b * p->row_stride + (p->row_starts ? p->row_starts[b] : 0);
    if (p->score_dtype == GVR_TOPK_F32)
        return topk_row((const float *)p->scores + first, L, prev, Kp, p->k, p->sorted, p->out + b * p->out_stride);
    float *row = tls_row;
    if (L > tls_row_cap) {
        row = malloc((size_t)(L > 0 ? L : 1) * sizeof *row);
        if (!row)
            return -1;
        if (L <= TLS_ROW_MAX) { /* kept for the next rows; longer ones are freed after use */
            free(tls_row);
            tls_row = row;
            tls_row_cap = L;
        }
    }
    gvr_row_to_f32(p->score_dtype, (const uint16_t *)p->scores + first, row, L);
    const int rc = topk_row(row, L, prev, Kp, p->k, p->sorted, p->out + b * p->out_stride);
    if (row != tls_row)
        free(row);
    return rc;
}

int topk_decode_cpu(const gvr_topk_params *p)
{
    int64_t work = 0; /* elements read, about: the sum of the row lengths */
    for (int64_t b = 0; b < p->B; b++)
        work += row_len(p, b);
    return gvr_parallel_rows(p->B, work, topk_row_of, (void *)p);
}

int64_t topk_map_overflow_cpu(const gvr_topk_params *p, int64_t *page_index, int32_t *page)
{
    const int64_t P = p->page_size > 0 ? p->page_size : 1;
    for (int64_t b = 0; p->block_table && b < p->B; b++) {
        const int32_t *bt = p->block_table + b / per_req_div(p, GVR_TOPK_BT_PER_REQUEST) * p->bt_stride;
        const int64_t L = row_len(p, b);
        for (int64_t q = 0; q * P < L; q++) {
            const int64_t last = (L - q * P < P ? L - q * P : P) - 1; /* the page's last position in the row */
            if ((int64_t)bt[q] * P + last > INT32_MAX) {
                *page_index = q;
                *page = bt[q];
                return b;
            }
        }
    }
    return -1;
}

void topk_map_cpu(const gvr_topk_params *p)
{
    const int64_t P = p->page_size > 0 ? p->page_size : 1;
    for (int64_t b = 0; b < p->B; b++) {
        int32_t *o = p->out + b * p->out_stride;
        int32_t *op = p->out_pos ? p->out_pos + b * p->out_pos_stride : NULL;
        const int32_t *bt = p->block_table ? p->block_table + b / per_req_div(p, GVR_TOPK_BT_PER_REQUEST) * p->bt_stride
                                           : NULL;
        for (int64_t j = 0; j < p->k; j++) {
            const int32_t x = o[j];
            if (op)
                op[j] = x;
            if (bt && x >= 0) {
                const int32_t pg = bt[x / P];
                o[j] = pg < 0 ? -1 : (int32_t)((int64_t)pg * P + x % P);
            }
        }
    }
}
