#!/usr/bin/env python3
"""gvr.topk_decode on the rows that are not decode traces: constant, masked (-inf), NaN-filled and
few-valued rows, heavy ties at the k-th value, and small k on long rows -- where a threshold search
can degrade (session 19 found the C path at 10-13x its trace-row time on such rows).

    python benchmarks/bench_topk_edges.py [--device cpu|cuda] [--n 131072 ...] [--k 1 8 64 2048 ...]
                                          [--batch 1 ...] [--json PATH] [--label NAME]

Per (row kind, N, k, B): gvr (CPU: one thread; CUDA: a CUDA graph of 10 calls, warm L2), NumPy's
argpartition (CPU) and torch.topk (CUDA; CPU with --torch-cpu), µs per call, and a check of gvr's
result against the C path's definition (every kind's exact order, computed here by a stable sort). The
search's passes over the row (gvr._C.cpu_stats) are printed for the CPU path.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _harness as H  # noqa: E402


def kinds(rng, n, k):
    """row kind -> float32 row of n"""
    m = min(n, max(1, k // 2))
    neg = np.full(n, -np.inf, np.float32)
    neg[rng.permutation(n)[:m]] = rng.standard_normal(m)
    nan = np.full(n, np.nan, np.float32)
    nan[rng.permutation(n)[:m]] = rng.standard_normal(m)
    tied = rng.standard_normal(n).astype(np.float32)
    tied[rng.permutation(n)[:4 * k]] = np.float32(np.sort(tied)[-k])  # 4k copies of the k-th value
    return {
        "iid": rng.standard_normal(n).astype(np.float32),
        "constant": np.full(n, 0.25, np.float32),
        "all -inf": np.full(n, -np.inf, np.float32),
        "masked (k/2 finite)": neg,
        "NaN (k/2 numbers)": nan,
        "4 values": rng.integers(0, 4, n).astype(np.float32),
        "ties at k-th": tied,
        "signed zeros": np.where(rng.random(n) < 0.5, 0.0, -0.0).astype(np.float32),
    }


def reference(x, k):
    """the library's order: value descending (-0 == +0), NaN last, ties to the lower index"""
    v = np.where(np.isnan(x), -np.inf, x.astype(np.float64))
    return np.lexsort((np.arange(x.shape[-1]), -v, np.isnan(x)))[:k]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--n", type=int, nargs="+", default=[131072])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 8, 64, 2048])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--json", default=None)
    ap.add_argument("--label", default="gvr", help="the name of this build in the table (A/B runs)")
    ap.add_argument("--budget", type=float, default=0.2, help="CPU: seconds per timed cell")
    ap.add_argument("--torch-cpu", action="store_true", help="CPU: torch.topk too")
    args = ap.parse_args()
    gvr = H.import_gvr(ROOT)
    torch = None
    if args.device == "cuda" or args.torch_cpu:
        import torch
    if args.device == "cpu":
        gvr.set_num_threads(1)
    timer = H.CudaTimer(torch, flush_bytes=0) if args.device == "cuda" else None
    meta = H.header(torch, ROOT, cuda=args.device == "cuda")
    print(H.header_line(meta))
    rows = []
    print(f"{'kind':20s} {'N':>7s} {'k':>5s} {'B':>3s} {args.label:>10s} {'other':>10s} {'ratio':>6s} passes check")
    for n in args.n:
        for k in args.k:
            if not 1 <= k <= n:  # (k = 0 and k > N have nothing to measure: empty or every element)
                print(f"skipped: k = {k} at N = {n} (1 <= k <= N measured)")
                continue
            rng = np.random.default_rng(n + k)
            for name, row in kinds(rng, n, k).items():
                want = reference(row, k)
                for B in args.batch:
                    x = np.ascontiguousarray(np.broadcast_to(row, (B, n)))
                    cell = {"kind": name, "N": n, "k": k, "B": B}
                    if args.device == "cpu":
                        got = gvr.topk_decode(x, k, sorted=True)
                        passes = gvr._C.cpu_stats()["count_passes"]
                        t = H.time_cpu(lambda: gvr.topk_decode(x, k), budget_s=args.budget)["median_us"]
                        o = H.time_cpu(lambda: np.argpartition(-x, k - 1, axis=1)[:, :k], budget_s=args.budget)["median_us"]
                        other = "argpartition"
                        if args.torch_cpu:
                            xt = torch.from_numpy(x)
                            cell["torch_us"] = H.time_cpu(lambda: torch.topk(xt, k, sorted=False), budget_s=args.budget)["median_us"]
                    else:
                        xd = torch.from_numpy(x).cuda()
                        got = gvr.topk_decode(xd, k, sorted=True).cpu().numpy()
                        passes = None
                        out = torch.empty((B, k), dtype=torch.int32, device="cuda")
                        t = timer.graph(lambda: gvr.topk_decode(xd, k, out=out), 10, 20)["median_us"]
                        o = timer.graph(lambda: torch.topk(xd, k, sorted=False), 10, 20)["median_us"]
                        other = "torch.topk"
                    ok = bool(all(np.array_equal(got[b], want) for b in range(B)))
                    cell.update({"gvr_us": t, f"{other}_us": o, "passes": passes, "ok": ok})
                    rows.append(cell)
                    print(f"{name:20s} {n:7d} {k:5d} {B:3d} {t:10.1f} {o:10.1f} {o / t:6.2f} "
                          f"{'' if passes is None else passes:>6} {'ok' if ok else 'MISMATCH'}", flush=True)
    if args.json:
        H.write_json(args.json, {"header": meta, "label": args.label, "device": args.device, "cells": rows})


if __name__ == "__main__":
    main()
