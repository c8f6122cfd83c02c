/* fp8.cuh: fp8 (e4m3fn) values to floats, exactly (every e4m3fn value is a half; NaN stays NaN), through
 * the hardware conversion of a pair to half2 -- one decoder for the attention kernel's K/V pieces, the
 * Quest selection's fp8 metadata and SparDA's compressed keys. */
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace gvr {

/* the 8 fp8 values of r (byte i = value i) to f[0..8) */
__device__ __forceinline__ void e4m3x8_to_f32(const uint2 r, float (&f)[8])
{
    const uint32_t w[2] = {r.x, r.y};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i / 2] >> (16 * (i % 2))), __NV_E4M3);
        f[2 * i] = __half2float(__ushort_as_half(hr.x));
        f[2 * i + 1] = __half2float(__ushort_as_half(hr.y));
    }
}

/* one fp8 value (its byte) */
__device__ __forceinline__ float e4m3_to_f32(const uint8_t b)
{
    return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
}

} // namespace gvr
