/* decode_d64_e4m3.cu: the sparse decode-attention kernel's instances of head dim 64 over fp8 (e4m3fn)
 * caches, float16 / bfloat16 q (decode.cuh). */
#define GVR_DECODE_KERNELS
#include "attention/decode.cuh"

namespace gvr::attn {
GVR_DECODE_INSTANCES_E4M3(64)
} // namespace gvr::attn
