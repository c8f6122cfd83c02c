/* cluster.cuh: device helpers for thread-block clusters (sm_90+): distributed shared memory
 * addresses, mbarriers, st.async pushes into a peer CTA's shared memory, the cluster barrier, and
 * programmatic dependent launch. CCCL's cuda::ptx where it has the exact instruction; inline asm
 * where it does not (each says why). */
#pragma once

#include <cuda/ptx>

#include <cstdint>

namespace gvr {

/* 32-bit shared-memory address of a generic pointer into this CTA's shared memory */
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* the same shared-memory offset in CTA `rank` of the cluster (a shared::cluster address) */
__device__ __forceinline__ uint32_t peer_u32(uint32_t a, int rank)
{
    /* asm: cuda::ptx has no mapa; cooperative_groups' map_shared_rank is the 64-bit generic form,
     * which costs extra instructions per push */
    uint32_t o;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(rank));
    return o;
}

/* a shared::cluster address as the pointer cuda::ptx takes (it converts back with cvta.to.shared;
 * the round trip compiles to nothing) */
template <class T>
__device__ __forceinline__ T *dsmem_ptr(uint32_t a)
{
    return reinterpret_cast<T *>(__cvta_shared_to_generic(a));
}

__device__ __forceinline__ void mbar_init(uint64_t *mb, uint32_t count) { cuda::ptx::mbarrier_init(mb, count); }

/* make the mbarrier inits visible to the cluster (with the cluster barrier that follows) */
__device__ __forceinline__ void fence_mbar_init() { cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster); }

/* arrive on a local mbarrier, expecting `bytes` more bytes of st.async data */
__device__ __forceinline__ void mbar_expect_bytes(uint64_t *mb, uint32_t bytes)
{
    (void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_relaxed, cuda::ptx::scope_cluster, cuda::ptx::space_shared,
                                               mb, bytes);
}

/* wait for the phase of parity `parity` of a local mbarrier; acquire at cluster scope makes the
 * peers' st.async data visible. The byte counts follow from counts every CTA computes identically,
 * so the wait always ends; should it not (a bug), trap after ~seconds instead of hanging the
 * stream: the launch then fails with an error the caller sees. */
__device__ __forceinline__ void mbar_wait(uint64_t *mb, uint32_t parity)
{
    unsigned long long spins = 0;
    bool done;
    do {
        if (++spins == (1ull << 28))
            __trap();
        done = cuda::ptx::mbarrier_try_wait_parity(cuda::ptx::sem_acquire, cuda::ptx::scope_cluster, mb, parity);
    } while (!done);
}

/* 16 / 8 bytes into a peer's shared memory (dst, mb: shared::cluster addresses from peer_u32),
 * signalling the peer's mbarrier with their byte count */
__device__ __forceinline__ void st_async_v4(uint32_t dst, uint4 v, uint32_t mb)
{
    const uint32_t a[4] = {v.x, v.y, v.z, v.w};
    cuda::ptx::st_async(dsmem_ptr<uint32_t>(dst), a, dsmem_ptr<uint64_t>(mb));
}

__device__ __forceinline__ void st_async_v2(uint32_t dst, uint2 v, uint32_t mb)
{
    const uint32_t a[2] = {v.x, v.y};
    cuda::ptx::st_async(dsmem_ptr<uint32_t>(dst), a, dsmem_ptr<uint64_t>(mb));
}

/* cluster barrier in two halves, relaxed arrive (no memory ordering: the mbarriers order the data).
 * asm: cuda::ptx has only the non-.aligned forms (and its relaxed arrive has no memory clobber);
 * every thread of the CTA executes these together, so .aligned holds. */
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }

/* Programmatic dependent launch (sm_90+): kernels are launched with programmatic stream
 * serialization (launch.cuh), so that a launch overlaps the end of the kernel before it on the
 * stream. Every kernel first waits for the grids it depends on to complete and flush (before any
 * global access; a no-op without the launch attribute), then lets its own dependents launch: they
 * wait in turn for this grid's completion before touching memory, so the early trigger changes
 * scheduling only. asm: cuda::ptx and cuda::device have no griddepcontrol. */
__device__ __forceinline__ void pdl_enter()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

} // namespace gvr
