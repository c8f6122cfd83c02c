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

and the streamed verify pass's pieces alone (same grid, no exchange; chunks of 8192 positions, each
thread its own four 16-byte vectors of a chunk, as gvr's streamed kernel):

  ring          cp.async copies into a ring of 2 chunk slots in shared memory (per-thread waits, no
                barrier), read back, counted (gvr's staging)
  read+collect  `read`'s loads (two chunks per thread in flight) + gvr's collection: per chunk a bit
                mask of the values >= a threshold with ~1.15k above it, a warp scan, the (key, index)
                pairs at consecutive slots of the warp's shared-memory segment
  ring+collect  the ring + the same collection (gvr's verify pass without the guess and the exchange)
  ring+collect(4)  the same with 4 slots

and three variants of the collection on the ring (checked to collect the same pairs into the same slots):
a scan of the per-thread counts from 5 ballots of their bits instead of a chain of shuffles; the
element loop without branches (a predicated store); both.

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
# the streamed pass's pieces alone (no exchange; modes 5-8): how gvr's verify pass reads and collects
PASS_KINDS = ("ring", "read+collect", "ring+collect", "ring+collect(4)")
# collection variants on the ring (modes 9-11): candidates for a cheaper gvr pass, checked equal to mode 7's
COLLECT_KINDS = ("collect:ballot-scan", "collect:branch-free", "collect:ballot+branch-free")

SRC = r"""
#include <cuda_runtime.h>
#include <cuda_pipeline_primitives.h>
#include <math.h>
constexpr int T = 512, W = 256, MAXC = 16;
constexpr int P4 = T * 4;     /* float4 per chunk (8192 floats, gvr's streamed chunk) */
constexpr int SEG_CAP = 512;  /* pairs per warp segment */
constexpr int PASS_DYN = 4 * P4 * 16 + (T / 32) * SEG_CAP * 8; /* a ring of up to 4 chunk slots + the segments */

/* gvr's order-preserving key of a float (its stored_key: sign-magnitude flipped to unsigned order, + 1) */
__device__ __forceinline__ unsigned skey(float f)
{
    const unsigned u = __float_as_uint(f);
    return (u ^ ((unsigned)((int)u >> 31) | 0x80000000u)) + 1u;
}

/* gvr's verify-pass collection of one chunk's 16 values per thread (vectors j = 0..3 at float4 index
 * vbase + j * T + t): a bit mask of those >= thr, a warp scan of the counts, each thread's pairs at
 * consecutive slots of its warp's segment. CV 0: gvr's code (a shuffle scan; a branch per element
 * under `if (cm)`); bit 0: the scan from 5 ballots of the count's bits (no dependent shuffle chain);
 * bit 1: the element loop without branches (a predicated store, a select for the max) */
template <int CV>
__device__ __forceinline__ void collect16(const float4 (&v)[4], int vbase, float thr, uint2 *seg, int &wcount,
                                          unsigned &kmax)
{
    const int t = threadIdx.x, lane = t & 31;
    const float *f = reinterpret_cast<const float *>(v);
    unsigned cm = 0u;
#pragma unroll
    for (int q = 0; q < 16; q++)
        cm |= (f[q] >= thr ? 1u : 0u) << q;
    const int n = __popc(cm);
    int first, total; /* this thread's first slot after wcount, the warp's count */
    if constexpr (CV & 1) {
        const unsigned lt = (1u << lane) - 1u;
        first = 0;
        total = 0;
#pragma unroll
        for (int b = 0; b < 5; b++) { /* n <= 16 */
            const unsigned m = __ballot_sync(0xFFFFFFFFu, (n >> b) & 1);
            first += __popc(m & lt) << b;
            total += __popc(m) << b;
        }
    } else {
        int incl = n;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xFFFFFFFFu, incl, o);
            if (lane >= o)
                incl += y;
        }
        first = incl - n;
        total = __shfl_sync(0xFFFFFFFFu, incl, 31);
    }
    int pos = wcount + first;
    if constexpr (CV & 2) {
#pragma unroll
        for (int q = 0; q < 16; q++) {
            const bool take = (cm >> q) & 1u;
            const unsigned key = skey(f[q]);
            if (take && pos < SEG_CAP)
                seg[pos] = make_uint2(key, (unsigned)((vbase + (q >> 2) * T + t) * 4 + (q & 3)));
            kmax = take && key > kmax ? key : kmax;
            pos += take;
        }
    } else if (cm) {
#pragma unroll
        for (int q = 0; q < 16; q++)
            if ((cm >> q) & 1u) {
                const unsigned key = skey(f[q]);
                if (pos < SEG_CAP)
                    seg[pos] = make_uint2(key, (unsigned)((vbase + (q >> 2) * T + t) * 4 + (q & 3)));
                kmax = key > kmax ? key : kmax;
                pos++;
            }
    }
    wcount += total;
}

/* MODE 5 ring (gvr's staging: cp.async of each thread's own 16-byte vectors into a ring of NS chunk slots,
 * per-thread waits, no barrier) counting >= thr; 6 16-byte loads (8 per thread in flight, as `read`) +
 * collect16; 7 the ring (2 slots) + collect16 (gvr's verify pass without the guess and the exchange);
 * 8 the same with 4 slots; 9-11 the ring (2 slots) + collect16<MODE - 8>. Each warp adds a checksum of its
 * segment's pairs to its count: the collecting modes' acc agree when they collect the same pairs in the
 * same slots. */
template <int MODE>
__global__ void __launch_bounds__(T, 1) pass_kernel(const float *__restrict__ x, long long stride, int C, int S,
                                                    float thr, unsigned *acc)
{
    extern __shared__ __align__(16) float4 dyn[];
    constexpr int NS = MODE == 8 ? 4 : 2;
    const int row = blockIdx.x / C, rank = blockIdx.x % C, t = threadIdx.x, warp = t >> 5;
    const float4 *xr = reinterpret_cast<const float4 *>(x + row * stride + (long long)rank * S);
    float4 *ring = dyn;
    uint2 *seg = reinterpret_cast<uint2 *>(dyn + 4 * P4) + warp * SEG_CAP;
    const int nch = S / (4 * P4);
    unsigned cnt = 0u, kmax = 0u;
    int wcount = 0;
    auto copy = [&](int c) {
        if (c < nch)
#pragma unroll
            for (int j = 0; j < 4; j++)
                __pipeline_memcpy_async(ring + (c % NS) * P4 + j * T + t, xr + c * P4 + j * T + t, 16);
        __pipeline_commit();
    };
    if constexpr (MODE == 6) {
        for (int base = 0; base < nch * P4; base += 2 * P4) {
            float4 v[2][4];
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    v[h][j] = __ldg(xr + base + h * P4 + j * T + t);
#pragma unroll
            for (int h = 0; h < 2; h++)
                collect16<0>(v[h], base + h * P4, thr, seg, wcount, kmax);
        }
    } else {
        for (int c = 0; c < NS; c++)
            copy(c);
        for (int c = 0; c < nch; c++) {
            __pipeline_wait_prior(NS - 1);
            asm volatile("" ::: "memory");
            float4 v[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                v[j] = ring[(c % NS) * P4 + j * T + t];
            if constexpr (MODE == 5) {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    cnt += (v[j].x >= thr) + (v[j].y >= thr) + (v[j].z >= thr) + (v[j].w >= thr);
            } else {
                collect16<(MODE >= 9 ? MODE - 8 : 0)>(v, c * P4, thr, seg, wcount, kmax);
            }
            copy(c + NS);
        }
        __pipeline_wait_prior(0);
    }
    cnt += (unsigned)wcount + kmax;
    if constexpr (MODE != 5) {
        __syncwarp(); /* the warp's pairs, written by its lanes */
        for (int i = t & 31; i < (wcount < SEG_CAP ? wcount : SEG_CAP); i += 32)
            cnt += seg[i].x * 31u + seg[i].y;
    }
    cnt = __reduce_add_sync(0xFFFFFFFFu, cnt);
    if ((t & 31) == 0)
        atomicAdd(acc + blockIdx.x, cnt);
}

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

/* fn on B * C CTAs of T threads in clusters of C, with dyn bytes of dynamic shared memory */
template <typename... K, typename... A>
static int launch_cluster(void (*fn)(K...), int B, int C, int dyn, cudaStream_t s, A... args)
{
    if (dyn)
        cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
    if (C > 8)
        cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(B * C);
    cfg.blockDim = dim3(T);
    cfg.dynamicSmemBytes = dyn;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = C;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return (int)cudaLaunchKernelEx(&cfg, fn, args...);
}

template <int MODE>
static int launch(const float *x, long long stride, int B, int C, int S, float thr, unsigned *acc, int *out, int k,
                  cudaStream_t s)
{
    return launch_cluster(floor_kernel<MODE>, B, C, 0, s, x, stride, C, S, thr, acc, out, k);
}

template <int MODE>
static int launch_pass(const float *x, long long stride, int B, int C, int S, float thr, unsigned *acc, cudaStream_t s)
{
    return launch_cluster(pass_kernel<MODE>, B, C, PASS_DYN, s, x, stride, C, S, thr, acc);
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
    case 5: return launch_pass<5>(x, stride, B, C, S, thr, acc, s);
    case 6: return launch_pass<6>(x, stride, B, C, S, thr, acc, s);
    case 7: return launch_pass<7>(x, stride, B, C, S, thr, acc, s);
    case 8: return launch_pass<8>(x, stride, B, C, S, thr, acc, s);
    case 9: return launch_pass<9>(x, stride, B, C, S, thr, acc, s);
    case 10: return launch_pass<10>(x, stride, B, C, S, thr, acc, s);
    case 11: return launch_pass<11>(x, stride, B, C, S, thr, acc, s);
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
            # the collecting modes: ~1.15k at or above it, as gvr's verify pass's threshold
            kc = int(1.15 * a.k)
            thr_c = float(np.partition(tr[1][:n], n - kc)[n - kc])
            acc = torch.zeros(b * C, dtype=torch.int32, device="cuda")
            out = torch.empty((b, a.k), dtype=torch.int32, device="cuda")

            def floor(mode):
                def f():
                    rc = so.floor_launch(mode, x.data_ptr(), x.stride(0), b, C, S, thr if mode < 5 else thr_c,
                                         acc.data_ptr(), out.data_ptr(),
                                         a.k, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                    if rc:
                        raise RuntimeError(f"floor_launch({mode}) -> cudaError {rc}")
                return f

            r = {"n": n, "b": b, "c": C, "k": a.k, "mb": x.numel() * 4 / 2**20}
            for mode, name in enumerate(KINDS):
                r[name] = timer.graph(floor(mode), a.calls, a.replays)["median_us"]
            if S % (4 * THREADS * 4) == 0:  # whole chunks per CTA (the pass modes' loops)
                for mode, name in enumerate(PASS_KINDS + COLLECT_KINDS, 5):
                    r[name] = timer.graph(floor(mode), a.calls, a.replays)["median_us"]
                # the collection variants collect what gvr's code does (counts, maxima, pairs and slots)
                sums = {}
                for mode in (7, 9, 10, 11):
                    acc.zero_()
                    floor(mode)()
                    sums[mode] = acc.cpu().tolist()
                r["collect_variants_equal"] = all(sums[m] == sums[7] for m in (9, 10, 11))
            r["gvr"] = timer.graph(lambda: gvr.topk_decode(x, a.k, out=out, method="gvr"), a.calls, a.replays)["median_us"]
            rows.append(r)
            print(f"N={n} B={b} (clusters of {C}, {r['mb']:.1f} MB): " +
                  "  ".join(f"{name} {r[name]:.2f}" for name in KINDS + ("gvr",)) + " us", flush=True)
            if "ring" in r:
                print("  the pass's pieces alone: " + "  ".join(f"{name} {r[name]:.2f}" for name in PASS_KINDS) + " us",
                      flush=True)
                print("  the ring + collection variants: " + "  ".join(f"{name[8:]} {r[name]:.2f}" for name in COLLECT_KINDS)
                      + f" us (the same pairs as gvr's collection: {r['collect_variants_equal']})", flush=True)
    if a.json:
        H.write_json(a.json, {"meta": meta, "rows": rows})
        print(f"# wrote {a.json}")


if __name__ == "__main__":
    main()
