/* decode_d64.cu: the sparse decode-attention kernel's instances of head dim 64 (decode.cuh). */
#define GVR_DECODE_KERNELS
#include "attention/decode.cuh"

namespace gvr::attn {
GVR_DECODE_INSTANCES(64)
} // namespace gvr::attn
