/* radix_b.cu: radix Top-K kernel instances (radix.cuh) for clusters of C in {4} CTAs holding VEC in {2,
 * 4, 8, 16} float4s per thread, each with its float32, float16 and bfloat16 kernels; topk.cu picks one per
 * launch. The 20 instances are spread over radix_[abcd].cu to compile in parallel. */
#include "topk/radix.cuh"

namespace gvr::topk {

GVR_RADIX_INSTANCES(4)

} // namespace gvr::topk
