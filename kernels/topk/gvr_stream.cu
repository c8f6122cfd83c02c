/* gvr_stream.cu: the streamed instances of the GVR kernel (gvr.cuh, STREAM true, VEC =
 * GVR_STREAM_VEC), single CTA and cluster: rows that the registers of a resident grid cannot hold. */
#include "topk/gvr.cuh"

namespace gvr::topk {

template struct GvrInstance<false, GVR_STREAM_VEC, true>;
template struct GvrInstance<true, GVR_STREAM_VEC, true>;

} // namespace gvr::topk
