#!/usr/bin/env python3
"""What the B=1 sparse-attention cells cannot go below on this GPU: minimal kernels with the same grids and the
same memory chain as gvr.sparse_attention's plans for them (Hq 32, Hkv 8, D 128, bf16, random 64-token
blocks per KV head of a shuffled paged 128K-token cache; CTAs of 128 threads), timed like scripts/attn_ab.py
(cold L2: a graph of 10 x [L2 flush, call] minus a graph of 10 flushes; warm: a graph of 10 calls; µs per
call, medians), side by side with gvr itself. Per cell (blocks per KV head nb, splits S: 8 x S CTAs):

  empty        an empty kernel of that grid (the launch in a graph)
  load1        per CTA: its first block's entry (one global load), one word written
  load2        the entry, then its page in the block table (two dependent loads)
  chain        per CTA: its blocks' entries (load 1) -> their pages in the block table (load 2) -> the
               blocks' 32 KiB each of K and V for the CTA's KV head (load 3, 16-byte loads), every load of
               a kind issued before any is used, folded, one word written per thread: no arithmetic
  chain+merge  the same, then (S > 1) a split merge through global memory as gvr's non-cluster plans do:
               each CTA writes a 2 KiB state, a fence and a per-head counter; the last of a head's S CTAs
               reads the S states and writes the head's output
  gvr          gvr.sparse_attention on the same selection (1K, 4K, 8K), or gvr.prr.repair of 1 / 8 blocks
               into a float32 state (its plans: 1K and the 8-block repair merge in a cluster)

Needs torch and CuPy (NVRTC) with a CUDA device. Not a test, not a benchmark of gvr.

    python scripts/latency_floor.py [--json PATH] [--cells 1K,4K,8K,rep1,rep8]"""
import argparse
import json
import math
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))

HQ, HKV, D, P, CTX = 32, 8, 128, 64, 131072
MAXB = 4  # blocks per CTA at most (8K: 128 blocks over 33 splits)
# cell: (blocks per KV head, splits: gvr's plan on the H100)
CELLS = {"1K": (16, 16), "4K": (64, 33), "8K": (128, 33), "rep1": (1, 1), "rep8": (8, 8)}

SRC = r"""
extern "C" __global__ void f_empty(unsigned *out) {}

extern "C" __global__ void f_load1(const int *idx, unsigned *out, int nb, int S)
{
    const int h = blockIdx.x / S, s = blockIdx.x % S;
    const int e = __ldg(idx + h * nb + s * nb / S);
    if (threadIdx.x == 0)
        out[blockIdx.x] = e;
}
extern "C" __global__ void f_load2(const int *idx, const int *bt, unsigned *out, int nb, int S)
{
    const int h = blockIdx.x / S, s = blockIdx.x % S;
    const int pg = __ldg(bt + __ldg(idx + h * nb + s * nb / S));
    if (threadIdx.x == 0)
        out[blockIdx.x] = pg;
}

/* CTA (KV head h, split s): blocks [s nb / S, (s + 1) nb / S): entries -> pages -> K and V rows of head h */
__device__ __forceinline__ unsigned chain(const int *idx, const int *bt, const uint4 *k, const uint4 *v, int h, int s,
                                          int nb, int S)
{
    const int b0 = s * nb / S, b1 = (s + 1) * nb / S;
    int e[MAXB], pg[MAXB];
#pragma unroll
    for (int j = 0; j < MAXB; j++)
        e[j] = b0 + j < b1 ? __ldg(idx + h * nb + b0 + j) : -1;
#pragma unroll
    for (int j = 0; j < MAXB; j++)
        pg[j] = e[j] >= 0 ? __ldg(bt + e[j]) : -1;
    unsigned acc = 0;
    const int t = threadIdx.x;
#pragma unroll
    for (int j = 0; j < MAXB; j++) {
        if (pg[j] < 0)
            continue;
#pragma unroll
        for (int i = 0; i < 8; i++) { /* 64 tokens x 16 pieces of 16 bytes, for K and for V */
            const int q = t + 128 * i, tok = q >> 4, pc = q & 15;
            const long long off = (((long long)pg[j] * P + tok) * HKV + h) * 16 + pc;
            const uint4 a = __ldg(k + off), b = __ldg(v + off);
            acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
        }
    }
    return acc;
}

extern "C" __global__ void f_chain(const int *idx, const int *bt, const uint4 *k, const uint4 *v, unsigned *out,
                                   int nb, int S)
{
    const int h = blockIdx.x / S, s = blockIdx.x % S;
    out[blockIdx.x * 128 + threadIdx.x] = chain(idx, bt, k, v, h, s, nb, S);
}

extern "C" __global__ void f_chain_merge(const int *idx, const int *bt, const uint4 *k, const uint4 *v, unsigned *out,
                                         int nb, int S, float *ws, int *cnt)
{
    const int h = blockIdx.x / S, s = blockIdx.x % S, t = threadIdx.x;
    const unsigned acc = chain(idx, bt, k, v, h, s, nb, S);
    if (S == 1) {
        out[blockIdx.x * 128 + t] = acc;
        return;
    }
    __shared__ int last;
    float *st = ws + ((long long)blockIdx.x) * 512; /* the split's state: 4 heads x 128 floats */
#pragma unroll
    for (int i = 0; i < 4; i++)
        __stcg(st + t + 128 * i, (float)(acc >> i));
    __syncthreads();
    if (t == 0) {
        __threadfence();
        last = atomicAdd(cnt + h, 1) == S - 1;
    }
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    if (t == 0)
        cnt[h] = 0;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    for (int r = 0; r < S; r++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            sum[i] += __ldcg(ws + ((long long)(h * S + r)) * 512 + t + 128 * i);
#pragma unroll
    for (int i = 0; i < 4; i++)
        out[(h * 4 + i) * 128 + t] = __float_as_uint(sum[i]);
}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cells", default=",".join(CELLS))
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
    scale = 1.0 / math.sqrt(D)
    k = torch.randn(pages, P, HKV, D, generator=g, device=dev, dtype=torch.bfloat16)
    v = torch.randn(pages, P, HKV, D, generator=g, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(pages, generator=g, device=dev).int().view(1, pages)
    perm = torch.rand(1, HKV, pages, generator=g, device=dev).argsort(-1).int()
    q = torch.randn(1, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)
    out = torch.empty(1, HQ, D, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(1, HQ, device=dev)
    st_out = torch.empty(1, HQ, D, device=dev)
    st_lse = torch.empty(1, HQ, device=dev)
    words = torch.empty(HKV * 64 * 128, device=dev, dtype=torch.int32)
    ws = torch.empty(HKV * 64 * 512, device=dev)
    cnt = torch.zeros(HKV, device=dev, dtype=torch.int32)
    mod = cp.RawModule(code=SRC, options=("-std=c++17", f"-DP={P}", f"-DHKV={HKV}", f"-DMAXB={MAXB}"))
    kern = {name: mod.get_function(name) for name in ("f_empty", "f_load1", "f_load2", "f_chain", "f_chain_merge")}

    def ptr(t):
        return cp.uint64(t.data_ptr())

    def launcher(name, grid, *params):
        f = kern[name]

        def call():
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                f((grid,), (128,), params)
        return call

    res = {}
    for cell in a.cells.split(","):
        nb, S = CELLS[cell]
        grid = HKV * S
        if cell.startswith("rep"):  # repair of nb blocks into the state over 16 others
            base = perm[..., :16].contiguous()
            idx = perm[..., 16:16 + nb].contiguous()
            gvr.sparse_attention(q, k, v, base, block_table=bt, block_size=P, scale=scale, out=st_out, lse=st_lse)

            def gvr_call(idx=idx):
                gvr.prr.repair(st_out, st_lse, q, k, v, idx, block_table=bt, block_size=P, scale=scale)
        else:
            idx = perm[..., :nb].contiguous()

            def gvr_call(idx=idx):
                gvr.sparse_attention(q, k, v, idx, block_table=bt, block_size=P, scale=scale, out=out, lse=lse)
        i32 = (cp.int32(nb), cp.int32(S))
        base_p = (ptr(idx), ptr(bt), ptr(k), ptr(v), ptr(words))
        fns = {
            "empty": launcher("f_empty", grid, ptr(words)),
            "load1": launcher("f_load1", grid, ptr(idx), ptr(words), *i32),
            "load2": launcher("f_load2", grid, ptr(idx), ptr(bt), ptr(words), *i32),
            "chain": launcher("f_chain", grid, *base_p, *i32),
            "chain+merge": launcher("f_chain_merge", grid, *base_p, *i32, ptr(ws), ptr(cnt)),
            "gvr": gvr_call,
        }
        res[cell] = {"blocks": nb, "splits": S}
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            w = timer.graph(fn, args.graph_calls, args.reps)["median_us"]
            c = BA.cold_graph(timer, fn, args)["median_us"]
            res[cell][name] = {"warm": w, "cold_g": c}
        print(f"{cell:5s} ({nb} blocks/head, {grid} CTAs) " + "  ".join(
            f"{n} {res[cell][n]['cold_g']:.2f}/{res[cell][n]['warm']:.2f}" for n in fns), flush=True)
    print("(cold / warm µs per call)")
    if a.json:
        json.dump({"cells": res, "device": torch.cuda.get_device_name()}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
