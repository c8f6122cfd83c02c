#!/usr/bin/env python3
"""A/B timing of gvr.sparda.prefetch at the pipelines' shape (B 1, 2048 logical blocks of 64 tokens, Hkv 8,
D 128, bf16, 32 selected blocks, 32 staging pages): graphs of 10 calls alternating two selections with the
slot maps fed back (resident=), so that each call moves the same blocks -- 0 (one selection), 10 or 32 (two
disjoint ones) -- by method (tma, kernel); warm and cold (bench_attention's cold_graph). µs per call,
medians. `AB_SCRIPT=prefetch_ab.py gpu_check.sh attnab` runs it for the installed library and each library
carried as build/ab_NAME.so.xz.

    python scripts/prefetch_ab.py [--json PATH] [--only NAME,NAME]"""
import sys

import _ab  # scripts/_ab.py: the command line and the timing loop of the A/B scripts


def main():
    a = _ab.parser(__doc__).parse_args()
    import torch
    import gvr
    import gvr.sparda  # noqa: F401
    import _harness as H
    dev = torch.device("cuda")
    timer = H.CudaTimer(torch)
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

    cells = {f"{m}_{method}": (lambda m=m, method=method: cell(m, method))
             for method in ("tma", "kernel") for m in (0, 10, 32)}
    _ab.run_cells(torch, timer, cells, a)
    del dk, dv
    cache.close()


if __name__ == "__main__":
    sys.exit(main())
