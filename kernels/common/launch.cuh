/* launch.cuh: the one launch configuration every kernel of the library uses: a 1-D grid of CTAs of
 * `threads` threads, optionally in clusters of C CTAs, with programmatic dependent launch (pdl_enter
 * in cluster.cuh) unless GVR_PDL=0. */
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

/* programmatic dependent launch: a build-time switch for measuring it */
#ifndef GVR_PDL
#define GVR_PDL 1
#endif

namespace gvr {

/* A cudaLaunchConfig_t with its attributes (the struct points into itself: don't copy it after
 * use, build it where it is launched). */
struct LaunchConfig {
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[2];

    /* grid_ctas CTAs; cluster > 0: clusters of `cluster` CTAs (the attribute is set even for 1);
     * pdl: programmatic stream serialization (false for occupancy queries) */
    LaunchConfig(unsigned grid_ctas, int threads, int cluster, size_t dyn_smem, cudaStream_t stream, bool pdl = true)
        : cfg{}, attr{}
    {
        cfg.gridDim = dim3(grid_ctas, 1, 1);
        cfg.blockDim = dim3((unsigned)threads, 1, 1);
        cfg.dynamicSmemBytes = dyn_smem;
        cfg.stream = stream;
        cfg.attrs = attr;
        cfg.numAttrs = 0;
        if (cluster > 0) {
            cudaLaunchAttribute &a = attr[cfg.numAttrs++];
            a.id = cudaLaunchAttributeClusterDimension;
            a.val.clusterDim.x = (unsigned)cluster;
            a.val.clusterDim.y = 1;
            a.val.clusterDim.z = 1;
        }
        if (GVR_PDL && pdl) {
            cudaLaunchAttribute &a = attr[cfg.numAttrs++];
            a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
            a.val.programmaticStreamSerializationAllowed = 1;
        }
    }
    LaunchConfig(const LaunchConfig &) = delete;
    LaunchConfig &operator=(const LaunchConfig &) = delete;
};

} // namespace gvr
