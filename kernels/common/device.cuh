/* device.cuh: per-device host-side state, cached per device ordinal: the SM count, "function
 * attributes set" flags and occupancy results. Devices 0..CACHED_DEVICES-1 are cached; any other is
 * queried every time. Slots are atomics: concurrent callers at worst compute the same value twice. */
#pragma once

#include <cuda_runtime.h>

#include <atomic>

namespace gvr {

constexpr int CACHED_DEVICES = 64;

/* N ints per device, 0 = not known yet (every cached quantity is positive). Zero-initialized as a
 * static: declare instances static. */
template <int N>
struct DeviceCache {
    std::atomic<int> slot[CACHED_DEVICES][N];

    int get(int dev, int i) const
    {
        return dev >= 0 && dev < CACHED_DEVICES ? slot[dev][i].load(std::memory_order_relaxed) : 0;
    }
    void put(int dev, int i, int v)
    {
        if (dev >= 0 && dev < CACHED_DEVICES)
            slot[dev][i].store(v, std::memory_order_relaxed);
    }
};

/* The calling thread's current device. */
cudaError_t current_device(int *dev);

/* Number of SMs of device dev (cached). */
cudaError_t sm_count(int dev, int *n);

} // namespace gvr
