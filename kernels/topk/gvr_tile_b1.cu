/* gvr_tile_b1.cu: register-tile instances of the GVR kernel (gvr.cuh, STREAM false) for clusters of C > 1
 * CTAs per row, VEC in {2, 3, 4} of GVR_TILE_VECS; each instance holds its float32, float16 and bfloat16
 * kernels. The instances are spread over gvr_tile_[ab][123].cu so that the files compile in parallel in
 * about the same time. */
#include "topk/gvr.cuh"

namespace gvr::topk {

template struct GvrInstance<true, 2, false>;
template struct GvrInstance<true, 3, false>;
template struct GvrInstance<true, 4, false>;

} // namespace gvr::topk
