#!/usr/bin/env python3
"""What a B=1 sparse-attention call cannot go below on this GPU: minimal kernels with the same grid and the
same memory chain as gvr.sparse_attention's B=1, 1K-token cell (Hq 32, Hkv 8, D 128, bf16, 16 random 64-token
blocks per KV head of a shuffled paged 128K-token cache; 8 heads x 16 splits = 128 CTAs of 128 threads),
timed like scripts/attn_ab.py (cold L2: a graph of 10 x [L2 flush, call] minus a graph of 10 flushes;
warm: a graph of 10 calls; µs per call, medians), side by side with gvr itself:

  empty      an empty kernel of that grid (the launch in a graph)
  load1      per CTA: its block's entry (one global load), one word written
  load2      the entry, then its page in the block table (two dependent loads)
  chain      per CTA: its block's entry (load 1) -> its page in the block table (load 2) -> the block's
             32 KiB of K and V for its KV head (load 3, 16-byte loads), folded and one word written per thread
  chain+merge  the same, then a split merge through global memory as gvr's non-cluster plans do: each CTA
             writes a 2 KiB state, a fence and a per-head counter; the last of a head's 16 CTAs reads the 16
             states and writes the head's output
  gvr        gvr.sparse_attention on the same selection (its cluster merge)

Needs torch and CuPy (NVRTC) with a CUDA device. Not a test, not a benchmark of gvr.

    python scripts/latency_floor.py [--json PATH]"""
import argparse
import json
import math
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

HQ, HKV, D, P, CTX, NB = 32, 8, 128, 64, 131072, 16

SRC = r"""
extern "C" __global__ void f_empty(unsigned *out) {}

/* the entry only; the entry and its page */
extern "C" __global__ void f_load1(const int *idx, unsigned *out)
{
    const int h = blockIdx.x / NB, s = blockIdx.x % NB;
    const int e = __ldg(idx + h * NB + s);
    if (threadIdx.x == 0)
        out[blockIdx.x] = e;
}
extern "C" __global__ void f_load2(const int *idx, const int *bt, unsigned *out)
{
    const int h = blockIdx.x / NB, s = blockIdx.x % NB;
    const int pg = __ldg(bt + __ldg(idx + h * NB + s));
    if (threadIdx.x == 0)
        out[blockIdx.x] = pg;
}

/* one CTA per (KV head h, split s): entry -> page -> the block's K and V rows of head h */
__device__ __forceinline__ unsigned chain(const int *idx, const int *bt, const uint4 *k, const uint4 *v, int h, int s)
{
    const int e = __ldg(idx + h * NB + s);
    const int pg = __ldg(bt + e);
    unsigned acc = 0;
    const int t = threadIdx.x;
#pragma unroll
    for (int i = 0; i < 8; i++) { /* 64 tokens x 16 pieces of 16 bytes, for K and for V */
        const int q = t + 128 * i, tok = q >> 4, pc = q & 15;
        const long long off = (((long long)pg * P + tok) * HKV + h) * 16 + pc;
        const uint4 a = __ldg(k + off), b = __ldg(v + off);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    }
    return acc;
}

extern "C" __global__ void f_chain(const int *idx, const int *bt, const uint4 *k, const uint4 *v, unsigned *out)
{
    const int h = blockIdx.x / NB, s = blockIdx.x % NB;
    out[blockIdx.x * 128 + threadIdx.x] = chain(idx, bt, k, v, h, s);
}

extern "C" __global__ void f_chain_merge(const int *idx, const int *bt, const uint4 *k, const uint4 *v, unsigned *out,
                                         float *ws, int *cnt)
{
    const int h = blockIdx.x / NB, s = blockIdx.x % NB, t = threadIdx.x;
    const unsigned acc = chain(idx, bt, k, v, h, s);
    __shared__ int last;
    /* the split's state: 4 heads x 128 floats */
    float *st = ws + ((long long)blockIdx.x) * 512;
#pragma unroll
    for (int i = 0; i < 4; i++)
        __stcg(st + t + 128 * i, (float)(acc >> i));
    __syncthreads();
    if (t == 0) {
        __threadfence();
        last = atomicAdd(cnt + h, 1) == NB - 1;
    }
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    if (t == 0)
        cnt[h] = 0;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < NB; r++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            sum[i] += __ldcg(ws + ((long long)(h * NB + r)) * 512 + t + 128 * i);
#pragma unroll
    for (int i = 0; i < 4; i++)
        out[(h * 4 + i) * 128 + t] = __float_as_uint(sum[i]);
}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    import cupy as cp
    import torch

    import _harness as H
    import bench_attention as BA
    import gvr
    dev = torch.device("cuda")
    timer = H.CudaTimer(torch)
    args = types.SimpleNamespace(graph_calls=10, reps=a.reps)
    g = torch.Generator(device="cuda").manual_seed(0)
    pages = CTX // P
    k = torch.randn(pages, P, HKV, D, generator=g, device=dev, dtype=torch.bfloat16)
    v = torch.randn(pages, P, HKV, D, generator=g, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(pages, generator=g, device=dev).int().view(1, pages)
    idx = torch.rand(1, HKV, pages, generator=g, device=dev).argsort(-1)[..., :NB].int().contiguous()
    q = torch.randn(1, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, HQ, D, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(1, HQ, device=dev)
    words = torch.empty(HKV * NB * 128, device=dev, dtype=torch.int32)
    ws = torch.empty(HKV * NB * 512, device=dev)
    cnt = torch.zeros(HKV, device=dev, dtype=torch.int32)
    mod = cp.RawModule(code=SRC, options=("-std=c++17", f"-DNB={NB}", f"-DP={P}", f"-DHKV={HKV}"))
    kern = {name: mod.get_function(name) for name in ("f_empty", "f_load1", "f_load2", "f_chain", "f_chain_merge")}

    def ptr(t):
        return cp.uint64(t.data_ptr())

    def launcher(name, *params):
        f = kern[name]

        def call():
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                f((HKV * NB,), (128,), params)
        return call

    base = (ptr(idx), ptr(bt), ptr(k), ptr(v), ptr(words))
    cells = {
        "empty": launcher("f_empty", ptr(words)),
        "load1": launcher("f_load1", ptr(idx), ptr(words)),
        "load2": launcher("f_load2", ptr(idx), ptr(bt), ptr(words)),
        "chain": launcher("f_chain", *base),
        "chain+merge": launcher("f_chain_merge", *base, ptr(ws), ptr(cnt)),
        "gvr": lambda: gvr.sparse_attention(q, k, v, idx, block_table=bt, block_size=P, scale=1.0 / math.sqrt(D),
                                            out=out, lse=lse),
    }
    res = {}
    for name, fn in cells.items():
        fn()
        torch.cuda.synchronize()
        w = timer.graph(fn, args.graph_calls, args.reps)["median_us"]
        c = BA.cold_graph(timer, fn, args)["median_us"]
        res[name] = {"warm": w, "cold_g": c}
        print(f"{name:12s} warm {w:7.2f}  cold_g {c:7.2f}", flush=True)
    if a.json:
        json.dump({"cells": res, "device": torch.cuda.get_device_name()}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
