#!/usr/bin/env python3
"""What the Top-K cells of issue 15's goals cannot go below with gvr's geometry on this GPU: minimal
kernels with the grid, cluster and memory pattern of gvr.topk_decode's plan for the cell, each adding one
piece of what any exact cluster Top-K of that geometry must do, timed like scripts/quick_gpu_bench.py
(CUDA graphs of --calls back-to-back calls, warm L2, median of --replays replays, µs per call), side by
side with gvr on the same rows (the quick table's decode-trace row at 45% overlap, tiled over B).

Per cell (B rows of N float32 scores, k = 2048; clusters of C CTAs of 512 threads per row, each CTA
S = N / C positions: gvr's plans, B=1 128K: C = 16, B=64 128K: C = 2):

  empty     an empty kernel of that grid and cluster (the launch in a graph)
  read      each CTA reads its S positions (16-byte loads, 8 per thread in flight) and counts those
            above a threshold; one atomic per warp to global memory
  +count    the same, then one cluster exchange of the counts: each CTA pushes 4 words (one 16-byte
            store) into every peer's shared memory, a cluster barrier, each sums what it received
            (the exchange that tells every CTA how many lie above the threshold)
  +round    the same, then a second exchange of 256 words (a histogram: 64 16-byte stores per peer) and
            barrier (one refinement round; gvr's streamed rows send their bins with the counts)
  +out      the same, then the row's k indices written (each rank k / C of them)
  gvr       gvr.topk_decode(x, k, method="gvr") (the GVR kernel forced; what method="auto" picks here)

The kernels are compiled here with nvcc (-arch sm_90a by default, GVR_FLOOR_ARCH) into a temporary
shared library and launched through ctypes with cudaLaunchKernelEx's cluster attribute. Not a test, not a
benchmark of gvr; needs torch, nvcc and a CUDA device of compute capability 9.0 or later.

    python scripts/topk_floor.py [--cells 131072x1,131072x64] [--json PATH]"""
import argparse
import ctypes
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _harness as H  # noqa: E402

THREADS = 512
KINDS = ("empty", "read", "+count", "+round", "+out")

SRC = r"""
#include <cuda_runtime.h>
#include <math.h>
constexpr int T = 512, W = 256, MAXC = 16;

__device__ __forceinline__ unsigned peer_addr(const void *p, int r)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(p), o;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(o) : "r"(a), "r"(r));
    return o;
}
__device__ __forceinline__ void st_peer4(unsigned a, uint4 v)
{
    asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ void cl_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cl_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cl_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

/* MODE 0 empty, 1 read, 2 + count exchange, 3 + a 256-word exchange, 4 + output */
template <int MODE>
__global__ void __launch_bounds__(T) floor_kernel(const float *__restrict__ x, long long stride, int C, int S,
                                                  float thr, unsigned *acc, int *out, int k)
{
    if constexpr (MODE == 0)
        return;
    else {
        __shared__ __align__(16) unsigned cnt_recv[MAXC][4];
        __shared__ __align__(16) unsigned bin_recv[MAXC][W];
        __shared__ __align__(16) unsigned mine[W];
        const int row = blockIdx.x / C, rank = blockIdx.x % C, t = threadIdx.x;
        if (MODE >= 2) {
            if (t < W)
                mine[t] = 0u;
            __syncthreads(); /* the zeros before any warp's atomicAdd below */
            cl_arrive_relaxed(); /* the peers' shared memory is theirs from here (waited before the pushes) */
        }
        const float4 *xr = reinterpret_cast<const float4 *>(x + row * stride + (long long)rank * S);
        const int nv = S / 4;
        unsigned cnt = 0;
        for (int base = 0; base < nv; base += 8 * T) {
            float4 v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int i = base + j * T + t;
                v[j] = i < nv ? __ldg(xr + i) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
                cnt += (v[j].x > thr) + (v[j].y > thr) + (v[j].z > thr) + (v[j].w > thr);
        }
        cnt = __reduce_add_sync(0xFFFFFFFFu, cnt);
        if constexpr (MODE == 1) {
            if ((t & 31) == 0)
                atomicAdd(acc + blockIdx.x, cnt);
        } else {
            if ((t & 31) == 0)
                atomicAdd(&mine[(t >> 5) & 3], cnt);
            __syncthreads();
            cl_wait();
            if (t < C)
                st_peer4(peer_addr(&cnt_recv[rank][0], t), *reinterpret_cast<const uint4 *>(mine));
            cl_arrive();
            cl_wait();
            unsigned tot = 0u;
            if (t < 4)
                for (int r = 0; r < C; r++)
                    tot += cnt_recv[r][t];
            if constexpr (MODE >= 3) {
                /* a histogram from the totals (any content), pushed to every peer */
                if (t < W)
                    mine[t] = tot + t;
                __syncthreads();
                for (int i = t; i < C * (W / 4); i += T) {
                    const int r = i / (W / 4), w = i - r * (W / 4);
                    st_peer4(peer_addr(&bin_recv[rank][4 * w], r), reinterpret_cast<const uint4 *>(mine)[w]);
                }
                cl_arrive();
                cl_wait();
                tot = 0u;
                if (t < W)
                    for (int r = 0; r < C; r++)
                        tot += bin_recv[r][t];
            }
            if constexpr (MODE <= 3) {
                if (t < 16)
                    atomicAdd(acc + blockIdx.x, tot);
            } else {
                const int share = k / C;
                const int bias = __shfl_sync(0xFFFFFFFFu, (int)tot, 0) & 1; /* keeps the exchanges live */
                for (int i = t; i < share; i += T)
                    out[(long long)row * k + rank * share + i] = rank * S + i + bias;
            }
        }
    }
}

template <int MODE>
static int launch(const float *x, long long stride, int B, int C, int S, float thr, unsigned *acc, int *out, int k,
                  cudaStream_t s)
{
    if (C > 8)
        cudaFuncSetAttribute(floor_kernel<MODE>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(B * C);
    cfg.blockDim = dim3(T);
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = C;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return (int)cudaLaunchKernelEx(&cfg, floor_kernel<MODE>, x, stride, C, S, thr, acc, out, k);
}

extern "C" int floor_launch(int mode, const float *x, long long stride, int B, int C, int S, float thr,
                            unsigned *acc, int *out, int k, void *stream)
{
    cudaStream_t s = (cudaStream_t)stream;
    switch (mode) {
    case 0: return launch<0>(x, stride, B, C, S, thr, acc, out, k, s);
    case 1: return launch<1>(x, stride, B, C, S, thr, acc, out, k, s);
    case 2: return launch<2>(x, stride, B, C, S, thr, acc, out, k, s);
    case 3: return launch<3>(x, stride, B, C, S, thr, acc, out, k, s);
    default: return launch<4>(x, stride, B, C, S, thr, acc, out, k, s);
    }
}
"""


def build(workdir):
    src, lib = os.path.join(workdir, "topk_floor.cu"), os.path.join(workdir, "topk_floor.so")
    with open(src, "w") as f:
        f.write(SRC)
    nvcc = os.environ.get("NVCC", "nvcc")
    arch = os.environ.get("GVR_FLOOR_ARCH", "90a")
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-arch=sm_{arch}", "-o", lib, src]
    subprocess.run(cmd, check=True)
    so = ctypes.CDLL(lib)
    so.floor_launch.restype = ctypes.c_int
    so.floor_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
                                ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_void_p]
    return so


# gvr's cluster size (CTAs per row) for the cells whose plans were profiled on the H100 (session 23's
# phase stamps: 16 CTAs for B=1 128K, 128 for B=64 128K); other cells need their plan from
# kernels/topk/topk.cu (plan_gvr) added here first
PLANS = {(131072, 1): 16, (131072, 64): 2}


def plan_c(n, b):
    if (n, b) not in PLANS:
        raise SystemExit(f"topk_floor.py: no recorded plan for N={n} B={b} (known: "
                         + ", ".join(f"{k[0]}x{k[1]}" for k in PLANS) + ")")
    return PLANS[(n, b)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default="131072x1,131072x64", help="NxB,NxB,...")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--replays", type=int, default=7)
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    import torch

    import gvr
    from gvr import data

    meta = H.header(torch, ROOT, cuda=True)
    print(H.header_line(meta))
    timer = H.CudaTimer(torch, flush_bytes=0)
    rows = []
    with tempfile.TemporaryDirectory() as wd:
        so = build(wd)
        for cell in a.cells.split(","):
            n, b = (int(v) for v in cell.split("x"))
            C = plan_c(n, b)
            S = n // C
            tr = list(data.decode_trace(n, 2, k=a.k, overlap=0.45, seed=1))
            x = torch.from_numpy(np.tile(tr[1][:n], (b, 1))).cuda()
            thr = float(np.partition(tr[1][:n], n - 4 * a.k)[n - 4 * a.k])  # ~4k above it, as gvr's pass
            acc = torch.zeros(b * C, dtype=torch.int32, device="cuda")
            out = torch.empty((b, a.k), dtype=torch.int32, device="cuda")

            def floor(mode):
                def f():
                    rc = so.floor_launch(mode, x.data_ptr(), x.stride(0), b, C, S, thr, acc.data_ptr(), out.data_ptr(),
                                         a.k, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                    if rc:
                        raise RuntimeError(f"floor_launch({mode}) -> cudaError {rc}")
                return f

            r = {"n": n, "b": b, "c": C, "k": a.k, "mb": x.numel() * 4 / 2**20}
            for mode, name in enumerate(KINDS):
                r[name] = timer.graph(floor(mode), a.calls, a.replays)["median_us"]
            r["gvr"] = timer.graph(lambda: gvr.topk_decode(x, a.k, out=out, method="gvr"), a.calls, a.replays)["median_us"]
            rows.append(r)
            print(f"N={n} B={b} (clusters of {C}, {r['mb']:.1f} MB): " +
                  "  ".join(f"{name} {r[name]:.2f}" for name in KINDS + ("gvr",)) + " us", flush=True)
    if a.json:
        H.write_json(a.json, {"meta": meta, "rows": rows})
        print(f"# wrote {a.json}")


if __name__ == "__main__":
    main()
