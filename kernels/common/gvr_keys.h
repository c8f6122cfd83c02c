/* gvr_keys.h: sortable keys of scores, shared by the C CPU implementations (csrc/) and the CUDA
 * kernels (kernels/): one definition of the order every operator selects by.
 *
 * The order: value descending, -0.0 == +0.0, -inf a valid (smallest) value, NaN below -inf; ties are
 * broken by index elsewhere. A key is an unsigned integer whose numeric order is that order: a larger
 * key ranks first. NaN maps to 0 (below every other key), -0.0 to the key of +0.0.
 *   float32:  32-bit keys, -inf = GVR_KEY_NEG_INF, +inf = GVR_KEY_POS_INF;
 *   float16, bfloat16: 16-bit keys of the raw bits (same rules), widened to uint32.
 * Plain C11 and CUDA C++: every function is static inline (host and device under nvcc). */
#ifndef GVR_KEYS_H
#define GVR_KEYS_H

#include <stdint.h>

#if defined(__CUDACC__)
#define GVR_KEY_FN static __host__ __device__ __forceinline__
#else
#define GVR_KEY_FN static inline
#endif

#define GVR_KEY_NEG_INF 0x007FFFFFu /* key of -inf */
#define GVR_KEY_POS_INF 0xFF800000u /* key of +inf */

/* key of the float32 with these bits */
GVR_KEY_FN uint32_t gvr_key_f32_bits(uint32_t b)
{
    if ((b & 0x7FFFFFFFu) > 0x7F800000u)
        return 0u; /* NaN */
    if (b == 0x80000000u)
        b = 0u; /* -0.0 -> +0.0 */
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

GVR_KEY_FN uint32_t gvr_key_f32(float f)
{
    union {
        float f;
        uint32_t u;
    } c;
    c.f = f;
    return gvr_key_f32_bits(c.u);
}

/* the float32 of a key (any key but 0, the key of NaN) */
GVR_KEY_FN float gvr_key_to_f32(uint32_t k)
{
    union {
        uint32_t u;
        float f;
    } c;
    c.u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
    return c.f;
}

/* 16-bit floats: inf_bits = 0x7C00 (float16) or 0x7F80 (bfloat16) */
GVR_KEY_FN uint32_t gvr_key_16(uint32_t h, uint32_t inf_bits)
{
    h &= 0xFFFFu;
    if ((h & 0x7FFFu) > inf_bits)
        return 0u; /* NaN */
    if (h == 0x8000u)
        h = 0u;
    return (h & 0x8000u) ? (~h & 0xFFFFu) : (h | 0x8000u);
}

GVR_KEY_FN uint32_t gvr_key_f16_bits(uint16_t h) { return gvr_key_16(h, 0x7C00u); }
GVR_KEY_FN uint32_t gvr_key_bf16_bits(uint16_t h) { return gvr_key_16(h, 0x7F80u); }

#endif
