/* decode_mma.cu: the tensor-core sparse decode-attention kernel's instances (decode_mma.cuh): q/k/v f16 or
 * bf16, head dims 64, 128, 256 (16 GQA rows per CTA, normal mode). decode.cu launches them only when
 * GVR_ATTN_MMA=1 (unverified on a GPU until then: the default stays decode.cuh's kernel). */
#define GVR_DECODE_KERNELS
#define GVR_DECODE_MMA_KERNELS
#include "attention/decode_mma.cuh"

namespace gvr::attn {

template struct DecodeMmaInstance<GVR_ELEM_F16, 64>;
template struct DecodeMmaInstance<GVR_ELEM_BF16, 64>;
template struct DecodeMmaInstance<GVR_ELEM_F16, 128>;
template struct DecodeMmaInstance<GVR_ELEM_BF16, 128>;

} // namespace gvr::attn
