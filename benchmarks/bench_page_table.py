"""topk_decode's fused page-table transform (issue 15) against Top-K + the transform in torch ops.

DSA decode: per row, the indexer's scores over N token positions, the Top-k positions, then the
physical KV slots of those positions through the request's block table (pages of P tokens), -1 kept.
Methods (CUDA graphs of 10 back-to-back calls, warm L2, median us per call):
  fused    gvr.topk_decode(scores, k, block_table=, page_size=, out_positions=)  (slots and positions)
  unfused  gvr.topk_decode(scores, k) then torch: where(pos >= 0, bt.gather(pos // P) * P + pos % P, -1)
  topk     gvr.topk_decode(scores, k) alone (the floor of both)
Every fused result is checked against the unfused one. Usage: python benchmarks/bench_page_table.py [--json PATH]
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _harness as H  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--page", type=int, default=64)
    args = ap.parse_args()
    gvr = H.import_gvr(ROOT)
    import torch
    timer = H.CudaTimer(torch, flush_bytes=0)
    meta = H.header(torch, ROOT, cuda=True)
    print(H.header_line(meta))
    k, P = args.k, args.page
    headers = ["B", "N", "topk", "fused", "unfused", "unfused/fused", "fused - topk", "check"]
    rows, cells = [], []
    for B in (1, 8, 64):
        for N in (32768, 65536, 131072):
            g = torch.Generator(device="cuda").manual_seed(B * N)
            x = torch.randn(B, N, generator=g, device="cuda")
            bt = torch.stack([torch.randperm(2 * N // P, generator=g, device="cuda")[: N // P] for _ in range(B)]).int()
            out = torch.empty(B, k, dtype=torch.int32, device="cuda")
            pos = torch.empty(B, k, dtype=torch.int32, device="cuda")
            slots_u = torch.empty(B, k, dtype=torch.int32, device="cuda")

            def topk():
                gvr.topk_decode(x, k, out=pos)

            def fused():
                gvr.topk_decode(x, k, block_table=bt, page_size=P, out=out, out_positions=pos)

            def unfused():
                gvr.topk_decode(x, k, out=pos)
                p = pos.long().clamp_min(0)
                s = bt.long().gather(1, p // P) * P + p % P
                slots_u.copy_(torch.where(pos >= 0, s, -1))

            fused()
            unfused()
            torch.cuda.synchronize()
            ok = bool(torch.equal(out, slots_u))
            t = {name: timer.graph(fn, 10, 20)["median_us"] for name, fn in (("topk", topk), ("fused", fused),
                                                                           ("unfused", unfused))}
            cells.append({"b": B, "n": N, "k": k, "page": P, "us": t, "correct": ok})
            rows.append([str(B), H.fmt_n(N), H.fmt_us(t["topk"]), H.fmt_us(t["fused"]), H.fmt_us(t["unfused"]),
                         H.fmt_x(H.ratio(t["unfused"], t["fused"])), f"{t['fused'] - t['topk']:+.2f}",
                         "ok" if ok else "FAIL"])
            print(H.format_table(headers, rows[-1:]).split("\n")[-1] if len(rows) > 1 else H.format_table(headers, rows),
                  flush=True)
    print(f"\n## page-table transform, k = {k}, pages of {P} tokens (median us per call, warm, CUDA graphs)")
    print(H.format_table(headers, rows))
    if args.json:
        H.write_json(args.json, {"meta": meta, "cells": cells})


if __name__ == "__main__":
    main()
