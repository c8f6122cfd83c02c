/* Element types of the CPU code: exact conversions of IEEE half and bfloat16 to float, and the
 * order-preserving integer keys of stored floats (IEEE 754 totalOrder on the bits). Header-only,
 * shared by the CPU operators (attention_cpu.c, prr_select_cpu.c); float -> half / bfloat16 round to
 * nearest even. */
#ifndef GVR_CPU_ELEM_H
#define GVR_CPU_ELEM_H

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

/* IEEE half -> float, exact, branch-free: the 15 magnitude bits moved to float's exponent/mantissa
 * position and scaled by 2^112 give normals and subnormals alike; exponent 31 (inf, NaN: payload
 * kept) is patched. */
static inline float gvr_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7FFFu;
    const float scaled = gvr_bits_f32(em << 13) * 0x1p112f;
    const uint32_t mag = em >= 0x7C00u ? ((em << 13) | 0x7F800000u) : gvr_f32_bits(scaled);
    return gvr_bits_f32(mag | sign);
}

static inline float gvr_bf16_to_f32(uint16_t h) { return gvr_bits_f32((uint32_t)h << 16); }

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
static inline uint16_t gvr_key16(uint16_t b) { return (uint16_t)(b ^ ((b & 0x8000u) ? 0xFFFFu : 0x8000u)); }
static inline uint16_t gvr_unkey16(uint16_t k) { return (uint16_t)(k ^ ((k & 0x8000u) ? 0x8000u : 0xFFFFu)); }
static inline uint32_t gvr_key32(uint32_t b) { return b ^ ((b & 0x80000000u) ? 0xFFFFFFFFu : 0x80000000u); }
static inline uint32_t gvr_unkey32(uint32_t k) { return k ^ ((k & 0x80000000u) ? 0x80000000u : 0xFFFFFFFFu); }

#endif
