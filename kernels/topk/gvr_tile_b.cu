/* gvr_tile_b.cu: the register-tile instances of the GVR kernel (gvr.cuh, STREAM false) for clusters
 * of C > 1 CTAs per row, VEC in GVR_TILE_VECS (the single-CTA instances are in gvr_tile_a.cu). */
#include "topk/gvr.cuh"

namespace gvr::topk {

template struct GvrInstance<true, 2, false>;
template struct GvrInstance<true, 3, false>;
template struct GvrInstance<true, 4, false>;
template struct GvrInstance<true, 5, false>;
template struct GvrInstance<true, 6, false>;
template struct GvrInstance<true, 8, false>;
template struct GvrInstance<true, 9, false>;
template struct GvrInstance<true, 10, false>;
template struct GvrInstance<true, 12, false>;

} // namespace gvr::topk
