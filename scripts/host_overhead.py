#!/usr/bin/env python3
"""Host (CPU) time per eager call of gvr.topk_decode on torch tensors, next to its parts and to the
same op called through torch.ops.gvr (the dispatcher path torch.compile uses).

    python scripts/host_overhead.py [--device cuda|cpu] [--n 65536] [--batch 1] [--k 2048]

On CUDA, launches are asynchronous: the median time of a call is its host cost as long as the GPU
keeps up (the kernels take ~10 us). On the CPU the numbers include the (small, --n) computation;
gvr._C.topk_decode on NumPy arrays is the floor.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _harness as H  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--n", type=int, default=None, help="row length (default 65536 on CUDA, 256 on the CPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=None, help="top-k (default 2048 on CUDA, 16 on the CPU)")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timing per case")
    a = p.parse_args(argv)
    import numpy as np
    import torch

    import gvr

    cuda = a.device == "cuda"
    N = a.n or (65536 if cuda else 256)
    k = a.k or (2048 if cuda else 16)
    B = a.batch
    x = torch.randn(B, N, device=a.device)
    prev = torch.topk(x, k).indices.int()
    out = torch.empty(B, k, dtype=torch.int32, device=a.device)
    has_ops = hasattr(torch.ops, "gvr") and hasattr(torch.ops.gvr, "topk_decode")
    cases = {
        "gvr.topk_decode(x, k)": lambda: gvr.topk_decode(x, k),
        "gvr.topk_decode(x, k, out=out)": lambda: gvr.topk_decode(x, k, out=out),
        "gvr.topk_decode(x, k, prev_topk=prev)": lambda: gvr.topk_decode(x, k, prev_topk=prev),
        "gvr.topk_decode(x, k, prev_topk=prev, out=out)": lambda: gvr.topk_decode(x, k, prev_topk=prev, out=out),
    }
    if has_ops:
        cases["torch.ops.gvr.topk_decode(x, k, prev, ...)"] = \
            lambda: torch.ops.gvr.topk_decode(x, k, prev, None, False, "auto")
        cases["torch.ops.gvr.topk_decode_out(x, k, prev, out, ...)"] = \
            lambda: torch.ops.gvr.topk_decode_out(x, k, prev, None, out, False, "auto")
    cases["torch.topk(x, k, sorted=False)"] = lambda: torch.topk(x, k, sorted=False)
    if cuda:
        s = torch.cuda.current_stream().cuda_stream
        s_dl = s if s else 1  # DLPack: the legacy default stream is 1
        cases.update({
            "gvr.topk_decode(..., prev, out, stream=s)": lambda: gvr.topk_decode(x, k, prev_topk=prev, out=out, stream=s),
            "x.__dlpack__(stream=s)": lambda: x.__dlpack__(stream=s_dl),
            "x.__dlpack__(stream=-1)": lambda: x.__dlpack__(stream=-1),
            "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream(x.device).cuda_stream,
        })
        # the wrapper's parts: its Python (prepare) and gvr._C with the arrays prepare returns
        from gvr import _interop

        arrs = (x, prev, None, out, None, None, None)
        prep, st, ns = _interop.prepare("torch", x, arrs, None)
        cases.update({
            "gvr._interop.prepare(torch, x, (x, prev, out))": lambda: _interop.prepare("torch", x, arrs, None),
            "gvr._C.topk_decode(prepared x, prev, out)": lambda: gvr._C.topk_decode(
                prep[0], k, prep[1], None, prep[3], False, st, "auto", ns, None, None, None, None, None, None),
            "gvr._C.topk_decode(prepared x, out)": lambda: gvr._C.topk_decode(
                prep[0], k, None, None, prep[3], False, st, "auto", ns, None, None, None, None, None, None),
            "prev.__dlpack__(stream=-1)": lambda: prev.__dlpack__(stream=-1),
        })
    else:
        xn, pn, on = x.numpy(), prev.numpy(), out.numpy()
        cases["gvr._C.topk_decode(NumPy views, out) (floor)"] = \
            lambda: gvr._C.topk_decode(xn, k, pn, None, on, False, None, "auto", 0)
        cases["gvr.topk_decode(NumPy x, k, prev_topk=, out=)"] = lambda: gvr.topk_decode(xn, k, prev_topk=pn, out=on)
        cases["x.numpy()"] = lambda: x.numpy()
    cases["torch.empty(B, k, int32)"] = lambda: torch.empty((B, k), dtype=torch.int32, device=x.device)
    meta = H.header(torch, ROOT, cuda=cuda)
    print(H.header_line(meta))
    print(f"# {a.device}: B={B} N={N} k={k}; median host us per call (time.perf_counter around each call)")
    for name, fn in cases.items():
        t = H.time_cpu(fn, budget_s=a.budget, min_runs=200, warmup=50)
        print(f"{name:55s} {t['median_us']:8.2f} us  (p10 {t['p10_us']:.2f}, p90 {t['p90_us']:.2f})", flush=True)
    if cuda:
        torch.cuda.synchronize()
    del np


if __name__ == "__main__":
    main()
