/* gvr_tile_b2.cu: register-tile instances of the GVR kernel (gvr.cuh, STREAM false) for clusters of C > 1
 * CTAs per row, VEC in {5, 6, 8} of GVR_TILE_VECS; each instance holds its float32, float16 and bfloat16
 * kernels. The instances are spread over gvr_tile_[ab][123].cu so that the files compile in parallel in
 * about the same time. */
#include "topk/gvr.cuh"

namespace gvr::topk {

template struct GvrInstance<true, 5, false>;
template struct GvrInstance<true, 6, false>;
template struct GvrInstance<true, 8, false>;

} // namespace gvr::topk
