#!/usr/bin/env python3
"""Why cold eager gvr+prev (method "auto", the same kernel as gvr) measured slower than gvr in the hint
sweep: host time per eager call for each variant, and cold eager timings in two orders (a diagnostic,
session 23; not a benchmark). B=1 and B=8, N=131072, k=2048, the quick table's rows.

    python scripts/cold_order.py"""
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _harness as H  # noqa: E402


def main():
    import torch

    import gvr
    from gvr import data

    timer = H.CudaTimer(torch)
    k, n = 2048, 131072
    tr = list(data.decode_trace(n, 2, k=k, overlap=0.45, seed=1))
    prev1 = torch.from_numpy(np.asarray(gvr.topk_decode(tr[0][:n], k))).cuda()
    for b in (1, 8):
        x = torch.from_numpy(np.tile(tr[1][:n], (b, 1))).cuda()
        pb = prev1.expand(b, k).contiguous()
        out = torch.empty((b, k), dtype=torch.int32, device="cuda")
        fns = {
            "auto+prev": lambda: gvr.topk_decode(x, k, prev_topk=pb, out=out),
            "auto": lambda: gvr.topk_decode(x, k, out=out),
            "gvr+prev": lambda: gvr.topk_decode(x, k, prev_topk=pb, out=out, method="gvr"),
            "gvr": lambda: gvr.topk_decode(x, k, out=out, method="gvr"),
        }
        for name, fn in fns.items():  # host time per call (no sync inside; the GPU runs behind)
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            print(f"B={b} host {name:10s} {(t1 - t0) / 300 * 1e6:6.1f} us per call", flush=True)
        names = list(fns)
        for order in (names, names[::-1]):
            res = timer.events_interleaved([fns[m] for m in order], 40, cold=True)
            print(f"B={b} cold interleaved, order {order}: " +
                  "  ".join(f"{m} {r['median_us']:.1f} (p10 {r['p10_us']:.1f}, p90 {r['p90_us']:.1f})" for m, r in zip(order, res)), flush=True)
        for order in (names, names[::-1]):
            line = []
            for m in order:
                r = timer.events(fns[m], 40, cold=True)
                line.append(f"{m} {r['median_us']:.1f} (p90 {r['p90_us']:.1f})")
            print(f"B={b} cold one after another, order {order}: " + "  ".join(line), flush=True)


if __name__ == "__main__":
    main()
