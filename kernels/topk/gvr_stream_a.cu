/* gvr_stream_a.cu: the streamed single-CTA instance of the GVR kernel (gvr.cuh, STREAM true, VEC =
 * GVR_STREAM_VEC), float32 / float16 / bfloat16 kernels: rows that the registers of a resident grid
 * cannot hold. The cluster instance is in gvr_stream_b.cu. */
#include "topk/gvr.cuh"

namespace gvr::topk {

template struct GvrInstance<false, GVR_STREAM_VEC, true>;

} // namespace gvr::topk
