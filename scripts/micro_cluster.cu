// Micro-benchmark: launch floor and cluster-barrier cost on this GPU (graph of 200 launches).
#include <cooperative_groups.h>
#include <cstdio>
namespace cg = cooperative_groups;

template <int NSYNC>
__global__ void __launch_bounds__(512, 1) k_sync(int *out)
{
    __shared__ int s[512];
    s[threadIdx.x] = threadIdx.x;
    for (int i = 0; i < NSYNC; i++)
        cg::this_cluster().sync();
    if (threadIdx.x == 0 && s[5] == 1234567)
        out[0] = 1;
}
__device__ __forceinline__ void bar_aligned() { asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory"); }
__device__ __forceinline__ void bar_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory"); }
/* leader signalling: block barrier, thread 0 arrives remotely on every CTA's mbarrier, all wait locally */
__device__ __forceinline__ void bar_mbar(uint64_t *mb, int C, unsigned &phase)
{
    __syncthreads();
    if (threadIdx.x < C) {
        uint32_t local = (uint32_t)__cvta_generic_to_shared(mb), remote;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"((int)threadIdx.x));
        asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
    }
    uint32_t addr = (uint32_t)__cvta_generic_to_shared(mb);
    asm volatile("{\n\t.reg .pred p;\n\tW: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n\t@!p bra W;\n\t}" ::"r"(addr), "r"(phase) : "memory");
    phase ^= 1;
}
template <int NSYNC, int KIND>
__global__ void __launch_bounds__(512, 1) k_var(int *out, int C)
{
    __shared__ int s[512];
    __shared__ uint64_t mb;
    s[threadIdx.x] = threadIdx.x;
    unsigned phase = 0;
    if (KIND == 3) {
        if (threadIdx.x == 0) {
            uint32_t addr = (uint32_t)__cvta_generic_to_shared(&mb);
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(addr), "r"(C) : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        cg::this_cluster().sync();
    }
    for (int i = 0; i < NSYNC; i++) {
        if (KIND == 1) bar_aligned();
        else if (KIND == 2) bar_relaxed();
        else bar_mbar(&mb, C, phase);
    }
    if (KIND == 3) cg::this_cluster().sync();
    if (threadIdx.x == 0 && s[5] == 1234567)
        out[0] = 1;
}
__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint32_t map_rank(uint32_t a, int r)
{
    uint32_t o;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(r));
    return o;
}
__device__ __forceinline__ void mb_wait(uint32_t mb, unsigned parity)
{
    asm volatile("{\n\t.reg .pred p;\n\tW1: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n\t@!p bra W1;\n\t}" ::"r"(mb), "r"(parity) : "memory");
}
/* KIND 4: st.async push of 2 KB to every peer; KIND 5: cp.async.bulk 2 KB to every peer;
 * KIND 6: fence.acq_rel.cluster + relaxed barrier; KIND 7: plain DSMEM pull after a release barrier */
template <int NEX, int KIND>
__global__ void __launch_bounds__(512, 1) k_ex(int *out, int C)
{
    __shared__ __align__(16) int hist[512];
    __shared__ __align__(16) int recv[2][16][512];
    __shared__ __align__(8) uint64_t mb[2];
    const int rank = (int)cg::this_cluster().block_rank();
    hist[threadIdx.x] = threadIdx.x + rank;
    if (threadIdx.x == 0) {
        for (int i = 0; i < 2; i++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&mb[i])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cg::this_cluster().sync();
    unsigned ph[2] = {0, 0};
    int acc = 0;
    for (int e = 0; e < NEX; e++) {
        const int par = e & 1;
        hist[threadIdx.x] += 1;
        __syncthreads();
        if (KIND == 4) {
            if (threadIdx.x == 0)
                asm volatile("mbarrier.arrive.expect_tx.relaxed.cluster.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&mb[par])), "r"((C - 1) * 2048) : "memory");
            /* 128 float4 per peer: thread t sends chunk t&127 to peers (t>>7), (t>>7)+4, ... */
            const int chunk = threadIdx.x & 127;
            int4 v = reinterpret_cast<int4 *>(hist)[chunk];
            for (int r = threadIdx.x >> 7; r < C; r += 4) {
                if (r == rank) continue;
                uint32_t dst = map_rank(smem_addr(&recv[par][rank][chunk * 4]), r);
                uint32_t bar = map_rank(smem_addr(&mb[par]), r);
                asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(bar) : "memory");
            }
            mb_wait(smem_addr(&mb[par]), ph[par]);
            ph[par] ^= 1;
            int t = hist[threadIdx.x];
            for (int r = 0; r < C; r++)
                if (r != rank) t += recv[par][r][threadIdx.x];
            acc += t;
        } else if (KIND == 5) {
            if (threadIdx.x == 0)
                asm volatile("mbarrier.arrive.expect_tx.relaxed.cluster.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&mb[par])), "r"((C - 1) * 2048) : "memory");
            if (threadIdx.x < C && (int)threadIdx.x != rank) {
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                uint32_t dst = map_rank(smem_addr(&recv[par][rank][0]), threadIdx.x);
                uint32_t bar = map_rank(smem_addr(&mb[par]), threadIdx.x);
                asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], 2048, [%2];" ::"r"(dst), "r"(smem_addr(hist)), "r"(bar) : "memory");
            }
            mb_wait(smem_addr(&mb[par]), ph[par]);
            ph[par] ^= 1;
            int t = hist[threadIdx.x];
            for (int r = 0; r < C; r++)
                if (r != rank) t += recv[par][r][threadIdx.x];
            acc += t;
            __syncthreads(); /* hist is the bulk source: not rewritten before the copies read it (approx.) */
        } else if (KIND == 6) {
            asm volatile("fence.acq_rel.cluster;" ::: "memory");
            asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
        } else {
            cg::this_cluster().sync();
            int t = 0;
            for (int r = 0; r < C; r++)
                t += cg::this_cluster().map_shared_rank(hist, r)[threadIdx.x];
            acc += t;
        }
    }
    cg::this_cluster().sync();
    if (acc == 1234567)
        out[0] = acc;
}
template <int NEX, int KIND>
void run_ex(int C, int *d)
{
    auto fn = k_ex<NEX, KIND>;
    cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    float t = time_graph([&](cudaStream_t st) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(C);
        cfg.blockDim = dim3(512);
        cfg.stream = st;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = C;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        cudaLaunchKernelEx(&cfg, fn, d, C);
    });
    const char *names[] = {"", "", "", "", "st.async push 2KB", "bulk copy push 2KB", "fence+relaxed bar", "release bar + pull"};
    printf("cluster C=%2d  %-22s x%2d : %6.2f us/launch (%s)\n", C, names[KIND], NEX, t, cudaGetErrorString(cudaGetLastError()));
}
template <int NSYNC>
__global__ void __launch_bounds__(512, 1) k_bsync(int *out)
{
    __shared__ int s[512];
    s[threadIdx.x] = threadIdx.x;
    for (int i = 0; i < NSYNC; i++)
        __syncthreads();
    if (threadIdx.x == 0 && s[5] == 1234567)
        out[0] = 1;
}

template <class F>
float time_graph(F launch)
{
    cudaStream_t st;
    cudaStreamCreate(&st);
    launch(st);
    cudaStreamSynchronize(st);
    cudaGraph_t g;
    cudaGraphExec_t ge;
    cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
    for (int i = 0; i < 200; i++)
        launch(st);
    cudaStreamEndCapture(st, &g);
    cudaGraphInstantiate(&ge, g, 0);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    float best = 1e9;
    for (int r = 0; r < 7; r++) {
        cudaEventRecord(a, st);
        cudaGraphLaunch(ge, st);
        cudaEventRecord(b, st);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        if (ms < best) best = ms;
    }
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaStreamDestroy(st);
    return best * 1000.f / 200.f;
}

template <int NSYNC>
void run_c(int C, int *d)
{
    auto fn = k_sync<NSYNC>;
    cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    float t = time_graph([&](cudaStream_t st) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(C);
        cfg.blockDim = dim3(512);
        cfg.stream = st;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = C;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        cudaLaunchKernelEx(&cfg, fn, d);
    });
    printf("cluster C=%2d  cluster.sync x%2d : %6.2f us/launch (%s)\n", C, NSYNC, t, cudaGetErrorString(cudaGetLastError()));
}

template <int NSYNC, int KIND>
void run_v(int C, int *d)
{
    auto fn = k_var<NSYNC, KIND>;
    cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    float t = time_graph([&](cudaStream_t st) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(C);
        cfg.blockDim = dim3(512);
        cfg.stream = st;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = C;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        cudaLaunchKernelEx(&cfg, fn, d, C);
    });
    const char *names[] = {"", "arrive.aligned+wait", "arrive.relaxed+wait", "mbarrier leader"};
    printf("cluster C=%2d  %-22s x%2d : %6.2f us/launch (%s)\n", C, names[KIND], NSYNC, t, cudaGetErrorString(cudaGetLastError()));
}

int main()
{
    int *d;
    cudaMalloc(&d, 4);
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    printf("%s\n", p.name);
    printf("plain 1 CTA no sync: %6.2f us\n", time_graph([&](cudaStream_t st) { k_bsync<0><<<1, 512, 0, st>>>(d); }));
    printf("plain 1 CTA 16 syncthreads: %6.2f us\n", time_graph([&](cudaStream_t st) { k_bsync<16><<<1, 512, 0, st>>>(d); }));
    printf("plain 16 CTA no sync: %6.2f us\n", time_graph([&](cudaStream_t st) { k_bsync<0><<<16, 512, 0, st>>>(d); }));
    for (int C : {2, 4, 16}) {
        run_ex<0, 4>(C, d);
        run_ex<16, 4>(C, d);
        run_ex<16, 5>(C, d);
        run_ex<16, 6>(C, d);
        run_ex<16, 7>(C, d);
    }
    for (int C : {1, 2, 4, 8, 16}) {
        run_c<0>(C, d);
        run_c<1>(C, d);
        run_c<4>(C, d);
        run_c<16>(C, d);
        run_v<16, 1>(C, d);
        run_v<16, 2>(C, d);
        run_v<0, 3>(C, d);
        run_v<16, 3>(C, d);
    }
    return 0;
}
