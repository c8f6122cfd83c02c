/* device.cu: the per-device queries of device.cuh. */
#include "common/device.cuh"

namespace gvr {

cudaError_t current_device(int *dev) { return cudaGetDevice(dev); }

cudaError_t sm_count(int dev, int *n)
{
    static DeviceCache<1> cache;
    int c = cache.get(dev, 0);
    if (c <= 0) {
        const cudaError_t e = cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, dev);
        if (e != cudaSuccess)
            return e;
        cache.put(dev, 0, c);
    }
    *n = c;
    return cudaSuccess;
}

} // namespace gvr
