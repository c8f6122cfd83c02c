/* decode_d256.cu: the sparse decode-attention kernel's instances of head dim 256 (decode.cuh): q/k/v f16 or
 * bf16, HC in {1, 2, 4, 8} query heads per CTA, with and without per-entry partial states. */
#define GVR_DECODE_KERNELS
#include "attention/decode.cuh"

namespace gvr::attn {

#define GVR_DECODE_HC(E, PART)                                                                        \
    template struct DecodeInstance<E, 256, 1, PART>;                                                   \
    template struct DecodeInstance<E, 256, 2, PART>;                                                   \
    template struct DecodeInstance<E, 256, 4, PART>;                                                   \
    template struct DecodeInstance<E, 256, 8, PART>;
GVR_DECODE_HC(GVR_ELEM_F16, false)
GVR_DECODE_HC(GVR_ELEM_BF16, false)
GVR_DECODE_HC(GVR_ELEM_F16, true)
GVR_DECODE_HC(GVR_ELEM_BF16, true)
#undef GVR_DECODE_HC

} // namespace gvr::attn
