/* sort.cuh: the sort kernel of sorted=1, gvr_topk_sort_kernel<ITEMS>: one CTA per row sorts the row's
 * kk selected indices (written by the radix or GVR kernel before it on the stream) by (value
 * descending, index ascending), a CUB block radix sort of ITEMS (key, index) items per thread.
 * Included by sort.cu only. */
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_radix_sort.cuh>

#include "common/cluster.cuh"
#include "topk/common.cuh"

namespace gvr::topk {

template <typename T, int ITEMS>
__global__ void __launch_bounds__(THREADS, 1)
    gvr_topk_sort_kernel(const T *__restrict__ scores, long long row_stride, int N, RowGeom rg, int k,
                         int *__restrict__ out, long long out_stride, OutMap om)
{
    pdl_enter();
    using Sort = cub::BlockRadixSort<unsigned long long, THREADS, ITEMS>;
    __shared__ typename Sort::TempStorage tmp;
    const int row = blockIdx.x;
    const int L = row_length(N, rg, row), kk = k < L ? k : L;
    const RowOut ro(out, out_stride, om, row);
    int *orow = ro.orow;
    const bool mapped = om.bt || om.pos;
    if (mapped) /* the selecting kernel padded out only */
        pad_tail(ro, kk, k);
    if (kk <= 1) {
        if (mapped && kk == 1 && threadIdx.x == 0)
            ro.put(0, orow[0]);
        return;
    }
    const T *xr = scores + (long long)row * row_stride + row_start(N, rg, row);
    unsigned long long item[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int pos = threadIdx.x * ITEMS + i;
        if (pos < kk) {
            const int idx = orow[pos];
            const uint32_t key = stored_key(Elem<T>::ld(xr + idx));
            item[i] = ((unsigned long long)(~key) << 32) | (unsigned)idx;
        } else {
            item[i] = ~0ull;
        }
    }
    Sort(tmp).Sort(item);
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        const int pos = threadIdx.x * ITEMS + i;
        if (pos < kk)
            ro.put(pos, (int)(item[i] & 0xFFFFFFFFu));
    }
}

} // namespace gvr::topk
