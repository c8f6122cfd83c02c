/* gvr_tile_a.cu: the register-tile instances of the GVR kernel (gvr.cuh, STREAM false) for one CTA
 * per row, VEC in GVR_TILE_VECS (the cluster instances are in gvr_tile_b.cu: the two files compile
 * in parallel in about the same time). */
#include "topk/gvr.cuh"

namespace gvr::topk {

template struct GvrInstance<false, 2, false>;
template struct GvrInstance<false, 3, false>;
template struct GvrInstance<false, 4, false>;
template struct GvrInstance<false, 5, false>;
template struct GvrInstance<false, 6, false>;
template struct GvrInstance<false, 8, false>;
template struct GvrInstance<false, 9, false>;
template struct GvrInstance<false, 10, false>;
template struct GvrInstance<false, 12, false>;

} // namespace gvr::topk
