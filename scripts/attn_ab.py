#!/usr/bin/env python3
"""A/B timing of the sparse decode-attention kernel: gvr only (no torch baseline), the cells of
bench_attention's B=1 table plus B=8 4K, B=64 2K and prr.repair of 1 and 8 blocks; warm L2 (a graph of
10 calls) and cold L2 without the events' fixed cost (bench_attention.cold_graph: a graph of 10 x [L2
flush, call] minus a graph of 10 x [flush]). µs per call, medians. `gpu_check.sh attnab` runs it for
the installed library and for each library carried as build/ab_NAME.so.xz, interleaved.

    python scripts/attn_ab.py [--json PATH] [--only NAME,NAME] [--hnd]

--hnd: the caches stored head-major ([pages, Hkv, P, D], vLLM's HND) and passed as the permuted view
[pages, P, Hkv, D] (no copy), so that a KV head's block is one contiguous 16 KiB run."""
import math
import sys

import _ab  # scripts/_ab.py: the command line and the timing loop of the A/B scripts

HQ, HKV, D, P = 32, 8, 128, 64


def main():
    ap = _ab.parser(__doc__)
    ap.add_argument("--hnd", action="store_true", help="head-major caches (a permuted view)")
    a = ap.parse_args()
    import torch
    import gvr
    import _harness as H
    dev = torch.device("cuda")
    timer = H.CudaTimer(torch)
    g = torch.Generator(device="cuda").manual_seed(0)
    scale = 1.0 / math.sqrt(D)

    def cache(rows, ctx):
        pages = rows * ctx // P
        if a.hnd:
            k = torch.randn(pages, HKV, P, D, generator=g, device=dev, dtype=torch.bfloat16).permute(0, 2, 1, 3)
            v = torch.randn(pages, HKV, P, D, generator=g, device=dev, dtype=torch.bfloat16).permute(0, 2, 1, 3)
        else:
            k = torch.randn(pages, P, HKV, D, generator=g, device=dev, dtype=torch.bfloat16)
            v = torch.randn(pages, P, HKV, D, generator=g, device=dev, dtype=torch.bfloat16)
        bt = torch.randperm(pages, generator=g, device=dev).int().view(rows, ctx // P)
        return k, v, bt

    k1, v1, bt1 = cache(1, 131072)
    k64, v64, bt64 = cache(64, 16384)

    def sel(B, ctx, G, n):
        return torch.rand(B, HKV, ctx // G, generator=g, device=dev).argsort(-1)[..., :n].int().contiguous()

    def attn(B, k, v, bt, idx, G):
        q = torch.randn(B, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)
        out = torch.empty(B, HQ, D, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(B, HQ, device=dev)
        if bt is None:
            return lambda: gvr.sparse_attention(q, k, v, idx, scale=scale, out=out, lse=lse)
        return lambda: gvr.sparse_attention(q, k, v, idx, block_table=bt, block_size=G, scale=scale, out=out, lse=lse)

    def repair(m):
        q = torch.randn(1, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)
        perm = sel(1, 131072, 64, 16 + m)
        base, miss = perm[..., :16].contiguous(), perm[..., 16:].contiguous()
        out = torch.empty(1, HQ, D, device=dev, dtype=torch.float32)
        lse = torch.empty(1, HQ, device=dev)
        gvr.sparse_attention(q, k1, v1, base, block_table=bt1, block_size=64, scale=scale, out=out, lse=lse)
        return lambda: gvr.prr.repair(out, lse, q, k1, v1, miss, block_table=bt1, block_size=64, scale=scale)

    slots = torch.randperm(131072, generator=g, device=dev)[:2048].int().view(1, 1, 2048).contiguous()
    cells = {
        "B1_1K": lambda: attn(1, k1, v1, bt1, sel(1, 131072, 64, 16), 64),
        "B1_4K": lambda: attn(1, k1, v1, bt1, sel(1, 131072, 64, 64), 64),
        "B1_8K": lambda: attn(1, k1, v1, bt1, sel(1, 131072, 64, 128), 64),
        "B1_8K16": lambda: attn(1, k1, v1, bt1, sel(1, 131072, 16, 512), 16),
        "B1_dsa2K": lambda: attn(1, k1, v1, None, slots, 1),
        "B8_4K": lambda: attn(8, k64, v64, bt64[:8], sel(8, 16384, 64, 64), 64),
        "B64_2K": lambda: attn(64, k64, v64, bt64, sel(64, 16384, 64, 32), 64),
        "rep1": lambda: repair(1),
        "rep8": lambda: repair(8),
    }
    _ab.run_cells(torch, timer, cells, a)

if __name__ == "__main__":
    sys.exit(main())
