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

/* A histogram add from a converged warp: add(b, 1) for every lane with take, except when all 32
 * lanes take the same bin (runs of equal keys: constant rows, -inf / NaN masks, ties at the k-th
 * value), where one lane adds 32. Shared-memory atomics on one address serialize, so such runs made
 * the rounds several times slower (measured on an H100: constant 128K rows 5x iid ones). */
template <class AddF>
__device__ __forceinline__ void warp_bin_add(bool take, int b, AddF add)
{
    const int b0 = __shfl_sync(0xFFFFFFFFu, b, 0);
    if (__all_sync(0xFFFFFFFFu, take && b == b0)) {
        if ((threadIdx.x & 31) == 0)
            add(b0, 32u);
    } else if (take) {
        add(b, 1u);
    }
}

} // namespace gvr
