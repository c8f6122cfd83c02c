/* decode_d128.cu: the sparse decode-attention kernel's instances of head dim 128 (decode.cuh). */
#define GVR_DECODE_KERNELS
#include "attention/decode.cuh"

namespace gvr::attn {
GVR_DECODE_INSTANCES(128)
} // namespace gvr::attn
