/* Element types of the CPU code: exact conversions of IEEE half and bfloat16 to float, and the
 * order-preserving integer keys of stored floats (IEEE 754 totalOrder on the bits). Header-only,
 * shared by the CPU operators (attention_cpu.c, prr_select_cpu.c, sparda_cpu.c, topk_cpu.c); float -> half / bfloat16 round to
 * nearest even. */
#ifndef GVR_CPU_ELEM_H
#define GVR_CPU_ELEM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t gvr_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float gvr_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> float, exact, branch-free (loops over it vectorize): the 15 magnitude bits moved to
 * float's exponent/mantissa position with the exponent re-biased; exponent 31 (inf, NaN: payload
 * kept) to 255; subnormals renormalized by an exact subtraction of two normal floats, so that a
 * flush-denormals / denormals-are-zero mode (torch.set_flush_denormal) cannot change them. */
static inline float gvr_f16_to_f32(uint16_t h)
{
    const uint32_t m = (uint32_t)(h & 0x7FFFu) << 13, e = m & 0x0F800000u;
    const uint32_t special = 0u - (uint32_t)(e == 0x0F800000u), sub = 0u - (uint32_t)(e == 0u); /* masks */
    const uint32_t o = m + (112u << 23) + ((112u << 23) & special);
    const uint32_t s = gvr_f32_bits(gvr_bits_f32(o + (1u << 23)) - 0x1p-14f); /* e == 0: m * 2^-24 */
    return gvr_bits_f32((s & sub) | (o & ~sub) | (uint32_t)(h & 0x8000u) << 16);
}

static inline float gvr_bf16_to_f32(uint16_t h) { return gvr_bits_f32((uint32_t)h << 16); }

/* OCP fp8 e4m3fn -> float, exact, branch-free: sign, 4 exponent bits (bias 7), 3 mantissa bits;
 * exponent 0: subnormal m * 2^-9 (renormalized by an exact subtraction, as gvr_f16_to_f32 does);
 * S.1111.111: NaN (a quiet NaN with the sign kept); no infinities (S.1111.110 = 448). */
static inline float gvr_e4m3_to_f32(uint8_t x)
{
    const uint32_t m = (uint32_t)(x & 0x7Fu) << 20, e = m & 0x07800000u;
    const uint32_t nan = 0u - (uint32_t)((x & 0x7Fu) == 0x7Fu), sub = 0u - (uint32_t)(e == 0u); /* masks */
    const uint32_t o = m + (120u << 23);                                               /* rebias: 127 - 7 */
    const uint32_t s = gvr_f32_bits(gvr_bits_f32(o + (1u << 23)) - 0x1p-6f); /* e == 0: m * 2^-9 */
    const uint32_t r = (s & sub) | (o & ~sub);
    return gvr_bits_f32(((r & ~nan) | (0x7FC00000u & nan)) | (uint32_t)(x & 0x80u) << 24);
}

/* bytes per element of type dtype (0 float32, 1 IEEE half, 2 bfloat16, 3 fp8 e4m3fn: GVR_ELEM_*) */
static inline size_t gvr_elem_bytes(int32_t dtype) { return dtype == 0 ? 4 : dtype == 3 ? 1 : 2; }

/* n elements of type dtype (0 float32, 1 IEEE half, 2 bfloat16, 3 fp8 e4m3fn: GVR_ELEM_* and
 * GVR_TOPK_* of gvr_kernels.h) at src -> floats */
static inline void gvr_row_to_f32(int32_t dtype, const void *src, float *restrict dst, int64_t n)
{
    const uint16_t *restrict h = (const uint16_t *)src;
    if (dtype == 0) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == 1) {
        for (int64_t i = 0; i < n; i++)
            dst[i] = gvr_f16_to_f32(h[i]);
    } else if (dtype == 3) {
        const uint8_t *restrict x = (const uint8_t *)src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = gvr_e4m3_to_f32(x[i]);
    } else {
        for (int64_t i = 0; i < n; i++)
            dst[i] = gvr_bf16_to_f32(h[i]);
    }
}

/* float -> IEEE half, round to nearest even, in integers (no dependence on the FP environment).
 * Overflow gives inf; NaN stays a (quiet) NaN with the sign kept. */
static inline uint16_t gvr_f32_to_f16(float f)
{
    const uint32_t x = gvr_f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) /* NaN */
        return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x477FF000u) /* >= 65520: rounds to inf (inf included) */
        return (uint16_t)(sign | 0x7C00u);
    if (ax >= 0x38800000u) { /* >= 2^-14: normal */
        uint32_t r = ax - 0x38000000u; /* rebias the exponent: 127 - 15 */
        r += 0xFFFu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (ax <= 0x33000000u) /* <= 2^-25: rounds to zero (2^-25 is a tie, to even 0) */
        return sign;
    const uint32_t e = ax >> 23; /* 102 .. 112 */
    const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e; /* value * 2^24 = m >> shift */
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    q += rem > half || (rem == half && (q & 1u));
    return (uint16_t)(sign | q);
}

/* float -> bfloat16, round to nearest even; NaN stays a quiet NaN with the sign kept. */
static inline uint16_t gvr_f32_to_bf16(float f)
{
    const uint32_t x = gvr_f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* totalOrder keys: key(a) < key(b) exactly when a is below b in IEEE 754 totalOrder (-NaN < -inf <
 * ... < -0 < +0 < ... < +inf < +NaN); unkey inverts key. */
static inline uint8_t gvr_key8(uint8_t b) { return (uint8_t)(b ^ ((b & 0x80u) ? 0xFFu : 0x80u)); } /* fp8 */
static inline uint8_t gvr_unkey8(uint8_t k) { return (uint8_t)(k ^ ((k & 0x80u) ? 0x80u : 0xFFu)); }
static inline uint16_t gvr_key16(uint16_t b) { return (uint16_t)(b ^ ((b & 0x8000u) ? 0xFFFFu : 0x8000u)); }
static inline uint16_t gvr_unkey16(uint16_t k) { return (uint16_t)(k ^ ((k & 0x8000u) ? 0x8000u : 0xFFFFu)); }
static inline uint32_t gvr_key32(uint32_t b) { return b ^ ((b & 0x80000000u) ? 0xFFFFFFFFu : 0x80000000u); }
static inline uint32_t gvr_unkey32(uint32_t k) { return k ^ ((k & 0x80000000u) ? 0x80000000u : 0xFFFFFFFFu); }

#endif
