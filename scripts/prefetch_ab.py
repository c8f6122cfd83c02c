#!/usr/bin/env python3
"""A/B timing of gvr.sparda.prefetch at the pipelines' shape (B 1, 2048 logical blocks of 64 tokens, Hkv 8,
D 128, bf16, 32 selected blocks, 32 staging pages): graphs of 10 calls alternating two selections with the
slot maps fed back (resident=), so that each call moves the same blocks -- 0 (one selection), 10 or 32 (two
disjoint ones) -- by method (tma, kernel); warm and cold (bench_attention's cold_graph). µs per call,
medians. `AB_SCRIPT=prefetch_ab.py gpu_check.sh attnab` runs it for the installed library and each library
carried as build/ab_NAME.so.xz.

    python scripts/prefetch_ab.py [--json PATH] [--only NAME,NAME]"""
import argparse
import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    import torch
    import gvr
    import gvr.sparda  # noqa: F401
    import bench_attention as BA
    import _harness as H
    dev = torch.device("cuda")
    timer = H.CudaTimer(torch)
    args = types.SimpleNamespace(graph_calls=10, reps=a.reps)
    pages, P, Hkv, D, k = 2048, 64, 8, 128, 32
    S = k  # exactly the selection's pages: a block not selected is evicted, so each call moves what it says
    # (with spare pages the slot policy retains both alternating selections and nothing moves)
    cache = gvr.sparda.HostKVCache(1, pages, P, Hkv, D, torch.bfloat16, device="cuda")
    dk = torch.empty((S, P, Hkv, D), dtype=torch.bfloat16, device=dev)
    dv = torch.empty_like(dk)
    bt = torch.arange(pages, dtype=torch.int32, device=dev).view(1, pages)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(pages, generator=g).int()

    def cell(moved, method):
        A = perm[:k]
        Bsel = torch.cat([A[: k - moved], perm[k: k + moved]]) if moved < k else perm[k: 2 * k]
        sels = [A.view(1, 1, k).to(dev), Bsel.view(1, 1, k).to(dev)]
        maps = [torch.full((1, pages), -1, dtype=torch.int32, device=dev) for _ in range(2)]
        state = [0]

        def call():
            i = state[0]
            state[0] += 1
            gvr.sparda.prefetch(cache.k(0), cache.v(0), sels[i % 2], dk, dv, block_table=bt,
                                resident=maps[(i + 1) % 2], slot_map_out=maps[i % 2], method=method)
        for _ in range(4):
            call()
        return call

    cells = {f"{m}_{method}": (m, method) for method in ("tma", "kernel") for m in (0, 10, 32)}
    only = set(a.only.split(",")) if a.only else None
    res = {}
    for name, (m, method) in cells.items():
        if only and name not in only:
            continue
        fn = cell(m, method)
        torch.cuda.synchronize()
        w = timer.graph(fn, args.graph_calls, args.reps)["median_us"]
        c = BA.cold_graph(timer, fn, args)["median_us"]
        res[name] = {"warm": w, "cold_g": c}
        print(f"{name:12s} warm {w:7.2f}  cold_g {c:7.2f}", flush=True)
    if a.json:
        json.dump({"cells": res, "device": torch.cuda.get_device_name()}, open(a.json, "w"), indent=1)
    del dk, dv
    cache.close()


if __name__ == "__main__":
    sys.exit(main())
