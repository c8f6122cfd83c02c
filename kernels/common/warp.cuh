/* warp.cuh: warp-level device helpers shared by the kernels. */
#pragma once

namespace gvr {

/* Inclusive sum of v over lanes 0..lane (shuffle-up scan with offsets 1, 2, .. < SPAN): lanes below
 * SPAN (a power of two <= 32) get the sum over lanes 0..lane; lanes at or above it get partial sums
 * that callers ignore. Called by the whole warp. */
template <int SPAN = 32>
__device__ __forceinline__ int warp_inclusive_sum(int v)
{
    const int lane = (int)(threadIdx.x & 31);
#pragma unroll
    for (int o = 1; o < SPAN; o <<= 1) {
        const int y = __shfl_up_sync(0xFFFFFFFFu, v, o);
        v += lane >= o ? y : 0;
    }
    return v;
}

} // namespace gvr
