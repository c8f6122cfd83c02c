#!/usr/bin/env python3
"""topk_decode's GVR kernel at one cell, for Nsight Compute (`gpu_check.sh topkncu`): B rows of N float32
scores (one standard normal draw), k = 2048, method "gvr", --calls calls. Profile with
`--cache-control none` for the warm-L2 setting of the quick table (the rows stay in L2 across replays)."""
import argparse

import torch

import gvr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=6)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((a.b, a.n), generator=g, device="cuda")
    out = torch.empty((a.b, a.k), dtype=torch.int32, device="cuda")
    for _ in range(a.calls):
        gvr.topk_decode(x, a.k, method="gvr", out=out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
