/* radix.cu: the radix Top-K kernel's 20 instances (radix.cuh): clusters of C in {1, 2, 4, 8, 16}
 * CTAs holding VEC in {2, 4, 8, 16} float4s per thread; topk.cu picks one per launch. */
#include "topk/radix.cuh"

namespace gvr::topk {

#define GVR_RADIX_VECS(C)                                                                             \
    template struct RadixInstance<C, 2>;                                                              \
    template struct RadixInstance<C, 4>;                                                              \
    template struct RadixInstance<C, 8>;                                                              \
    template struct RadixInstance<C, 16>;
GVR_RADIX_VECS(1)
GVR_RADIX_VECS(2)
GVR_RADIX_VECS(4)
GVR_RADIX_VECS(8)
GVR_RADIX_VECS(16)
#undef GVR_RADIX_VECS

} // namespace gvr::topk
