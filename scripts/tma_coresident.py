#!/usr/bin/env python3
"""Whether the bulk-copy gather (method "tma") can share SMs with a concurrent matmul: per CTA count (2, 4, 8,
16), GB/s of 32 and 512 64-token blocks (Hkv 8, D 128, bf16; a graph of 3 calls) and the slowdown of an
8192^3 bf16 matmul while 40 gathers of 512 blocks run on a second stream (bench_sparda's "shapes"
measurement). For libraries whose gather CTA is small enough (shared memory ring, registers) to be resident
beside a matmul CTA. JSON cells: cN -> {"warm": matmul slowdown %, "cold_g": GB/s at 512 blocks}, cN_32 ->
{"warm": GB/s at 32 blocks, "cold_g": the same} (the names `gpu_check.sh attnab` compares).

    python scripts/tma_coresident.py [--json PATH]"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None)
    a = ap.parse_args()
    import torch
    import gvr
    import gvr.sparda  # noqa: F401
    import _harness as H
    timer = H.CudaTimer(torch, flush_bytes=0)
    P, Hkv, D, pages = 64, 8, 128, 2048
    bf, dev = torch.bfloat16, torch.device("cuda")
    cache = gvr.sparda.HostKVCache(1, pages, P, Hkv, D, bf, device="cuda")
    hk, hv = cache.k(0), cache.v(0)
    hk.copy_(torch.randn(hk.shape, device=dev, dtype=bf))
    hv.copy_(torch.randn(hv.shape, device=dev, dtype=bf))
    g = torch.Generator().manual_seed(3)
    A = torch.randn(8192, 8192, dtype=bf, device=dev)
    Bm = torch.randn(8192, 8192, dtype=bf, device=dev)
    C = torch.empty_like(A)
    side = torch.cuda.Stream()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(10)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(10)]

    def mm_time():
        torch.matmul(A, Bm, out=C)
        for i in range(10):
            st[i].record()
            torch.matmul(A, Bm, out=C)
            en[i].record()
        en[-1].synchronize()
        return H.median([s_.elapsed_time(e_) * 1e3 for s_, e_ in zip(st, en)])

    sels = {n: torch.randperm(pages, generator=g)[:n].int().view(1, 1, n).to(dev) for n in (32, 512)}
    dst = {n: (torch.empty((n, P, Hkv, D), dtype=bf, device=dev), torch.empty((n, P, Hkv, D), dtype=bf, device=dev))
           for n in (32, 512)}
    sm = torch.empty((1, pages), dtype=torch.int32, device=dev)
    alone = mm_time()
    res = {}
    for ctas in (2, 4, 8, 16):
        gb = {}
        for n in (32, 512):
            t = timer.graph(lambda: gvr.sparda.prefetch(hk, hv, sels[n], *dst[n], slot_map_out=sm, method="tma",
                                                        max_ctas=ctas), 3, 5)["median_us"]
            gb[n] = 2 * n * P * Hkv * D * 2 / t / 1e3
        ok = bool(torch.equal(dst[512][0][sm[0, sels[512][0, 0].long()].long()].cpu(), hk[sels[512][0, 0].long().cpu()]))
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(40):
                gvr.sparda.prefetch(hk, hv, sels[512], *dst[512], slot_map_out=sm, stream=side, method="tma",
                                    max_ctas=ctas)
        slow = 100 * (mm_time() / alone - 1.0)
        torch.cuda.synchronize()
        res[f"c{ctas}"] = {"warm": slow, "cold_g": gb[512]}
        res[f"c{ctas}_32"] = {"warm": gb[32], "cold_g": gb[32]}
        print(f"tma {ctas:2d} CTAs: 32 blocks {gb[32]:.1f} GB/s, 512 blocks {gb[512]:.1f} GB/s; matmul {alone:.0f} us "
              f"alone, +{slow:.1f}% under the gathers{'' if ok else ' MISMATCH'}", flush=True)
    if a.json:
        json.dump({"cells": res, "device": torch.cuda.get_device_name()}, open(a.json, "w"), indent=1)
    del hk, hv
    cache.close()


if __name__ == "__main__":
    sys.exit(main())
