/* launch.h: the internal interface between the Top-K entry point (topk.cu: plans the geometry) and
 * the translation units that hold the kernels (radix.cu, gvr_tile_*.cu, gvr_stream.cu, sort.cu:
 * launch only). Host-side C++, hidden visibility (the build passes -fvisibility=hidden). Each
 * instance is explicitly instantiated in exactly one .cu file. */
#pragma once

#include <cuda_runtime.h>

#include "gvr_kernels.h"

namespace gvr::topk {

constexpr int THREADS = 512; /* every Top-K kernel: 512 threads per CTA */
constexpr int MAX_C = 16;    /* largest cluster */

/* float4s per thread of the register-tile GVR instances (gvr_tile_a.cu, gvr_tile_b.cu); a row of N
 * positions takes C = ceil(N / (2048 VEC)) CTAs */
constexpr int GVR_TILE_VECS[] = {2, 3, 4, 5, 6, 8, 9, 10, 12};
/* float4s per thread of the streamed GVR instances (gvr_stream.cu): chunks of 2048 * 4 positions */
constexpr int GVR_STREAM_VEC = 4;
constexpr int GVR_STREAM_MAX_C = 8;
/* streamed GVR: (key, index) pairs one CTA collects in shared memory during its first pass: 8192
 * (64 KB) for segments of up to GVR_COLLECT_LONG_NCH - 1 chunks, 16384 (128 KB) for longer ones. The
 * threshold leaves 1.2-6 k of a row above it (more for longer rows); with 8192, warp segments
 * overflowed on decode-trace rows of 256K at B=64 (the row read again: 2x slower, measured,
 * benchmarks/RESULTS.md); the shorter segments keep the 64 KB they had */
constexpr int GVR_COLLECT_CAP = 8192;
constexpr int GVR_COLLECT_CAP_LONG = 16384;
constexpr int GVR_COLLECT_LONG_NCH = 10;
/* AUTO takes the radix path up to this N (gvr_kernels.h) */
constexpr int AUTO_RADIX_MAX_N = THREADS * 4 * 2;
/* the radix kernel: clusters of 1..16 CTAs holding VEC in {2, 4, 8, 16} float4s per thread */
constexpr int RADIX_MAX_VEC = 16;
static_assert(MAX_C * THREADS * 4 * RADIX_MAX_VEC == GVR_RADIX_MAX_POSITIONS, "radix geometry vs the ABI's limit");
/* sort kernel: up to 8 items per thread */
static_assert(GVR_TOPK_SORTED_MAX_K <= THREADS * 8, "sort kernel vs the ABI's limit");

/* The GVR kernel of rows held in registers (STREAM false: VEC float4s per thread, one pass over
 * memory) or streamed in chunks (STREAM true, VEC = GVR_STREAM_VEC), by clusters of C CTAs
 * (CLUSTER: C > 1). */
template <bool CLUSTER, int VEC, bool STREAM>
struct GvrInstance {
    /* how many rows (clusters of C CTAs) run at once on device dev (cached per device); 1 when the
     * occupancy query fails (the conservative answer) */
    static int resident_rows(int dev, int C);
    /* dev: the current device */
    static cudaError_t launch(const gvr_topk_params *p, int dev, int C, int nch, cudaStream_t stream);
#ifdef GVR_PROFILE
    static cudaError_t profile_read(long long *host);
#endif
};

/* The radix kernel, clusters of C CTAs holding VEC float4s per thread. */
template <int C, int VEC>
struct RadixInstance {
    /* dev: the current device */
    static cudaError_t launch(const gvr_topk_params *p, int dev, cudaStream_t stream);
#ifdef GVR_PROFILE
    static cudaError_t profile_read(long long *host);
#endif
};

/* Sort each row's selected indices by (value descending, index ascending): p->k <= THREADS * 8. */
cudaError_t sort_launch(const gvr_topk_params *p, cudaStream_t stream);

} // namespace gvr::topk
