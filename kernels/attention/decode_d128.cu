/* decode_d128.cu: the sparse decode-attention kernel's instances of head dim 128 (decode.cuh). */
#define GVR_DECODE_KERNELS
#include "attention/decode.cuh"

namespace gvr::attn {
GVR_DECODE_INSTANCES(128)
} // namespace gvr::attn

#ifdef GVR_PROFILE
/* debug builds only (scripts/profile_attention_phases.py): the phase stamps of the last head-dim-128
 * attention launch (this translation unit's stamp buffer) */
extern "C" __attribute__((visibility("default"))) int gvr_debug_attn_clocks(long long *host)
{
    return (int)profile_read(host);
}
#endif
