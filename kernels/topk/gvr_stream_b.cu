/* gvr_stream_b.cu: the streamed cluster instance of the GVR kernel (gvr.cuh, STREAM true, VEC =
 * GVR_STREAM_VEC), float32 / float16 / bfloat16 kernels (the single-CTA one: gvr_stream_a.cu). */
#include "topk/gvr.cuh"

namespace gvr::topk {

template struct GvrInstance<true, GVR_STREAM_VEC, true>;

} // namespace gvr::topk
