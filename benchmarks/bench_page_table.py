"""topk_decode's fused page-table transform (issue 15) against Top-K + the transform in torch ops.

DSA decode: per row, the indexer's scores over N token positions, the Top-k positions, then the
physical KV slots of those positions through the request's block table (pages of P tokens), -1 kept.
Methods (CUDA graphs of 10 back-to-back calls, warm L2, median us per call):
  fused    gvr.topk_decode(scores, k, block_table=, page_size=, out_positions=)  (slots and positions)
  unfused  gvr.topk_decode(scores, k) then torch: where(pos >= 0, bt.gather(pos // P) * P + pos % P, -1)
  topk     gvr.topk_decode(scores, k) alone (the floor of both)
Every fused result is checked against the unfused one.
Ragged rows (--ragged, or --only-ragged): B query rows as windows of one flat fp32 buffer (vLLM's prefill
form: row b = flat[starts[b] : starts[b] + lengths[b]]), k = 2048:
  row_starts  one gvr.topk_decode(flat, k, row_starts=, lengths=, max_length=) call
  per_row     B calls, one per row view (what a user writes without row_starts)
  padded      the rows copied into a [B, max_len] buffer (torch), then one call with lengths
Half-precision scores (--only-half): k = 2048, per call: float32 scores; bfloat16 / float16 scores read
directly; bfloat16 converted to float32 (torch .float() into a preallocated buffer) then the float32 call.
Usage: python benchmarks/bench_page_table.py [--json PATH] [--ragged | --only-ragged | --only-half]
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
    ap.add_argument("--ragged", action="store_true", help="also the ragged-rows section")
    ap.add_argument("--only-ragged", action="store_true", help="only the ragged-rows section")
    ap.add_argument("--only-half", action="store_true", help="only the half-precision scores section")
    args = ap.parse_args()
    gvr = H.import_gvr(ROOT)
    import torch
    timer = H.CudaTimer(torch, flush_bytes=0)
    meta = H.header(torch, ROOT, cuda=True)
    print(H.header_line(meta))
    k, P = args.k, args.page
    if args.only_half:
        r = half(gvr, torch, timer, k)
        if args.json:
            H.write_json(args.json, {"meta": meta, "half": r})
        return
    if args.only_ragged:
        r = ragged(gvr, torch, timer, k)
        if args.json:
            H.write_json(args.json, {"meta": meta, "ragged": r})
        return
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
    rg = ragged(gvr, torch, timer, k) if args.ragged else None
    if args.json:
        H.write_json(args.json, {"meta": meta, "cells": cells, "ragged": rg})


def half(gvr, torch, timer, k):
    """float32 vs bfloat16 / float16 read directly vs bfloat16 converted first"""
    headers = ["B", "N", "f32", "bf16", "f16", "bf16->f32 + f32", "convert/bf16", "check"]
    rows, cells = [], []
    for B in (1, 8, 64):
        for N in (32768, 131072):
            g = torch.Generator(device="cuda").manual_seed(B + N)
            x = torch.randn(B, N, generator=g, device="cuda")
            xb, xh = x.to(torch.bfloat16), x.to(torch.float16)
            conv = torch.empty_like(x)
            out = torch.empty(B, k, dtype=torch.int32, device="cuda")

            def converted():
                conv.copy_(xb)
                gvr.topk_decode(conv, k, out=out)

            t = {name: timer.graph(fn, 10, 20)["median_us"] for name, fn in (
                ("f32", lambda: gvr.topk_decode(x, k, out=out)), ("bf16", lambda: gvr.topk_decode(xb, k, out=out)),
                ("f16", lambda: gvr.topk_decode(xh, k, out=out)), ("bf16_converted", converted))}
            ok = bool(torch.equal(gvr.topk_decode(xb, k, sorted=True), gvr.topk_decode(xb.float(), k, sorted=True)) and
                      torch.equal(gvr.topk_decode(xh, k, sorted=True), gvr.topk_decode(xh.float(), k, sorted=True)))
            cells.append({"B": B, "N": N, "us": t, "ok": ok})
            rows.append([B, f"{N // 1024}K", H.fmt_us(t["f32"]), H.fmt_us(t["bf16"]), H.fmt_us(t["f16"]),
                         H.fmt_us(t["bf16_converted"]), f"{t['bf16_converted'] / t['bf16']:.2f}x", "ok" if ok else "MISMATCH"])
            print(H.format_table(headers, rows[-1:]) if len(rows) == 1 else H.format_table(headers, rows[-1:]).split("\n")[-1],
                  flush=True)
    print(f"\n## half-precision scores, k = {k} (median us per call, warm, CUDA graphs)")
    print(H.format_table(headers, rows))
    return cells


def ragged(gvr, torch, timer, k):
    """B rows of 4K-64K tokens as windows of one flat buffer: row_starts vs per-row calls vs padding"""
    headers = ["B", "tokens", "row_starts", "per_row", "padded", "per_row/row_starts", "padded/row_starts", "check"]
    rows, cells = [], []
    for B in (4, 16, 64):
        g = torch.Generator().manual_seed(B)
        lens = torch.randint(4096, 65536, (B,), generator=g, dtype=torch.int32)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.long().cumsum(0)[:-1]]).int()
        T, L = int(lens.sum()), int(lens.max())
        flat = torch.randn(T, generator=g).cuda()
        st_d, ln_d = starts.cuda(), lens.cuda()
        out = torch.empty(B, k, dtype=torch.int32, device="cuda")
        outs = [torch.empty(k, dtype=torch.int32, device="cuda") for _ in range(B)]
        views = [flat[int(s):int(s) + int(n)] for s, n in zip(starts, lens)]
        pad = torch.full((B, L), float("-inf"), device="cuda")

        def one():
            gvr.topk_decode(flat, k, row_starts=st_d, lengths=ln_d, out=out, max_length=L)

        def per_row():
            for v, o in zip(views, outs):
                gvr.topk_decode(v, k, out=o)

        def padded():
            for b, v in enumerate(views):
                pad[b, : v.shape[0]].copy_(v)
            gvr.topk_decode(pad, k, lengths=ln_d, out=out)

        t = {name: timer.graph(fn, 5, 10)["median_us"] for name, fn in (("row_starts", one), ("per_row", per_row),
                                                                         ("padded", padded))}
        one()
        a = gvr.topk_decode(flat, k, row_starts=st_d, lengths=ln_d, sorted=True)
        b_ = torch.stack([gvr.topk_decode(v, k, sorted=True) for v in views])
        ok = bool(torch.equal(a, b_))
        cells.append({"B": B, "tokens": T, "us": t, "ok": ok})
        rows.append([B, T, H.fmt_us(t["row_starts"]), H.fmt_us(t["per_row"]), H.fmt_us(t["padded"]),
                     f"{t['per_row'] / t['row_starts']:.2f}x", f"{t['padded'] / t['row_starts']:.2f}x",
                     "ok" if ok else "MISMATCH"])
        print(H.format_table(headers, rows[-1:]) if len(rows) == 1 else H.format_table(headers, rows[-1:]).split("\n")[-1],
              flush=True)
    print(f"\n## ragged rows over one flat buffer, k = {k} (median us per call, warm, CUDA graphs)")
    print(H.format_table(headers, rows))
    return cells


if __name__ == "__main__":
    main()
