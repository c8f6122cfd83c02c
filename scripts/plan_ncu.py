#!/usr/bin/env python3
"""The prefetch's plan kernel at the pipeline's shape, for Nsight Compute (`gpu_check.sh planncu`): B 1, 2048
logical blocks (128K tokens of 64), 64 staging pages, 32 selected blocks of which ~60% resident from the call
before; calls prefetch --calls times (method tma), each with a new selection."""
import argparse

import torch

import gvr
import gvr.sparda  # noqa: F401


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--pages", type=int, default=2048)
    a = ap.parse_args()
    P, Hkv, D, k, S = 64, 8, 128, 32, 64
    cache = gvr.sparda.HostKVCache(1, a.pages, P, Hkv, D, torch.bfloat16, device="cuda")
    dev = torch.device("cuda")
    dk = torch.empty((S, P, Hkv, D), dtype=torch.bfloat16, device=dev)
    dv = torch.empty_like(dk)
    bt = torch.arange(a.pages, dtype=torch.int32, device=dev).view(1, a.pages)
    g = torch.Generator().manual_seed(0)
    sel = torch.randperm(a.pages, generator=g)[:k].int()
    maps = [torch.full((1, a.pages), -1, dtype=torch.int32, device=dev) for _ in range(2)]
    for i in range(a.calls):
        keep = sel[torch.randperm(k, generator=g)[: int(0.6 * k)]]
        new = torch.randperm(a.pages, generator=g)[: k - keep.numel()].int()
        sel = torch.cat([keep, new])
        gvr.sparda.prefetch(cache.k(0), cache.v(0), sel.view(1, 1, k).to(dev), dk, dv, block_table=bt,
                            resident=maps[(i + 1) % 2], slot_map_out=maps[i % 2], method="tma")
    torch.cuda.synchronize()
    del dk, dv
    cache.close()


if __name__ == "__main__":
    main()
