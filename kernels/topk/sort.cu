/* sort.cu: sorted=1, the second kernel of a sorted Top-K: each row's selected indices sorted by
 * (value descending, index ascending), one CTA of 512 threads per row (sort.cuh), ITEMS in
 * {1, 2, 4, 8} items per thread: k <= 4096 (GVR_TOPK_SORTED_MAX_K). */
#include "common/launch.cuh"
#include "topk/launch.h"
#include "topk/sort.cuh"

namespace gvr::topk {

template <typename T, int ITEMS>
static cudaError_t sort_launch_t(const gvr_topk_params *p, cudaStream_t stream)
{
    LaunchConfig lc((unsigned)p->B, THREADS, 0, 0, stream);
    return cudaLaunchKernelEx(&lc.cfg, gvr_topk_sort_kernel<T, ITEMS>, static_cast<const T *>(p->scores),
                              (long long)p->row_stride, p->N, row_geom(p), p->k, p->out, (long long)p->out_stride,
                              out_map(p));
}

template <int ITEMS>
static cudaError_t sort_launch_items(const gvr_topk_params *p, cudaStream_t stream)
{
    return visit_score_type(p->score_dtype,
                            [&](auto st) { return sort_launch_t<typename decltype(st)::type, ITEMS>(p, stream); });
}

cudaError_t sort_launch(const gvr_topk_params *p, cudaStream_t stream)
{
    const int items = (p->k + THREADS - 1) / THREADS;
    if (items <= 1)
        return sort_launch_items<1>(p, stream);
    if (items <= 2)
        return sort_launch_items<2>(p, stream);
    if (items <= 4)
        return sort_launch_items<4>(p, stream);
    return sort_launch_items<8>(p, stream);
}

} // namespace gvr::topk
