#!/usr/bin/env python3
"""A/B timing of the selection kernels (block_scores + topk_decode): gvr.sparda.forecast_select at the cells of
bench_sparda's "select" section and Quest's gvr.prr.select_blocks (Hq 32, Hkv 8, D 128, 64-token blocks) at 128K
tokens, B 1 and 8, with block_scores alone beside each; warm L2 (a graph of 10 calls) and cold L2 (bench_attention's
cold_graph). µs per call, medians. `AB_SCRIPT=select_ab.py gpu_check.sh attnab` runs it for the installed library
and for each library carried as build/ab_NAME.so.xz, interleaved.

    python scripts/select_ab.py [--json PATH] [--only NAME,NAME]"""
import sys

import _ab  # scripts/_ab.py: the command line and the timing loop of the A/B scripts


def main():
    a = _ab.parser(__doc__).parse_args()
    import torch
    import gvr
    import gvr.sparda  # noqa: F401
    import _harness as H
    dev, bf = torch.device("cuda"), torch.bfloat16
    timer = H.CudaTimer(torch)
    g = torch.Generator(device="cuda").manual_seed(0)

    def forecast(B, Hkv, Nc, kw, st, k, scores_only=False):
        F = torch.randn(B, Hkv, 128, generator=g, device=dev).to(bf)
        kt = torch.randn(B, Hkv, Nc, 128, generator=g, device=dev).to(bf)
        lengths = torch.full((B,), (Nc - 1) * st + kw, dtype=torch.int32, device=dev)
        sel = torch.empty(B, Hkv, k, dtype=torch.int32, device=dev)
        if scores_only:
            meta = kt.unsqueeze(3).expand(B, Hkv, Nc, 2, 128)
            s = torch.empty(B, Hkv, Nc, dtype=torch.float32, device=dev)
            from gvr._prr_select import _run_scores  # forecast_select's scores pass (window counts inside)
            return lambda: _run_scores(F, meta, lengths, st, "max", 1, 2, s, None, None, None, kw)
        return lambda: gvr.sparda.forecast_select(F, kt, k, lengths=lengths, kernel=kw, stride=st, out=sel)

    def quest(B, scores_only=False):
        T, G, Hq, Hkv = 131072, 64, 32, 8
        pages = B * T // G
        kc = torch.randn(pages, G, Hkv, 128, generator=g, device=dev).to(bf)
        bt = torch.randperm(pages, generator=g, device=dev).int().view(B, T // G)
        lengths = torch.full((B,), T, dtype=torch.int32, device=dev)
        meta = gvr.prr.block_metadata(kc, bt, lengths, block_size=G)
        q = torch.randn(B, Hq, 128, generator=g, device=dev).to(bf)
        sel = torch.empty(B, Hkv, 64, dtype=torch.int32, device=dev)
        if scores_only:
            return lambda: gvr.prr.block_scores(q, meta, lengths, block_size=G)
        return lambda: gvr.prr.select_blocks(q, meta, 64, lengths, block_size=G, out=sel)

    cells = {
        "fs_B1_H1_2K": lambda: forecast(1, 1, 2048, 64, 64, 32),
        "fs_B1_H8_2K": lambda: forecast(1, 8, 2048, 64, 64, 32),
        "fs_B1_H8_8K": lambda: forecast(1, 8, 8191, 32, 16, 128),
        "fs_B8_H8_8K": lambda: forecast(8, 8, 8191, 32, 16, 128),
        "fsscores_B8_H8_8K": lambda: forecast(8, 8, 8191, 32, 16, 128, scores_only=True),
        "quest_B1": lambda: quest(1),
        "quest_B8": lambda: quest(8),
        "questscores_B8": lambda: quest(8, scores_only=True),
    }
    _ab.run_cells(torch, timer, cells, a)

if __name__ == "__main__":
    sys.exit(main())
