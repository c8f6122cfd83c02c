/* decode_d256.cu: the sparse decode-attention kernel's instances of head dim 256 (decode.cuh). */
#define GVR_DECODE_KERNELS
#include "attention/decode.cuh"

namespace gvr::attn {
GVR_DECODE_INSTANCES(256)
} // namespace gvr::attn
