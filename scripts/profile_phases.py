#!/usr/bin/env python3
"""Phase timing of the Top-K kernels: clock64 stamps of row 0, CTA 0, thread 0, read from a debug
library built with -DGVR_PROFILE (kernels/common/profile.cuh). Debugging aid, not a benchmark.

    python scripts/profile_phases.py PROFILE_LIB [--cases "N B,N B"] [--reps R]

--reps R: R more calls per case after the first line's, and per stamp their median (one call's stamps move
by a few hundred cycles from call to call).

PROFILE_LIB replaces the installed gvr's libgvr_cuda.so for the run (restored afterwards). Build it
from a copy of the tree, where nvcc is (the GPU machine's build time is scarce), and carry it there:

    bash scripts/variant_lib.sh NAME --profile --from DIR   # DIR: a tree with a finished CUDA build
    # device: carry build/prof_NAME.so.xz; PP_CASES="131072 64" bash scripts/gpu_check.sh profile

Tags (the
kernels' PROF calls): 0 start, 1 loaded, 3 guess done (cluster wait), 25 verify pass done (streamed), 26 its pairs
binned (streamed, before the verify exchange; the first round then has no 20/21 stamps), 27 the second
collection pass done (streamed rows below tc), per round 20 histogram, 21 exchange, 22 pick, 24 per-rank counts and bin edges, 23 round end; 30 output
scan and 33 its writes done (per chunk when streamed), 31 candidates arrived, 32 ranked; 90 candidates
left and 91 chosen bin are values, not cycles. A second line per case: every CTA's start and end on
the global timer (launch skew, the spread of the ends)."""
import argparse
import ctypes
import os
import shutil
import sys

import numpy as np

SPANS = 1024  # kernels/common/profile.cuh PROF_SPANS


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib")
    ap.add_argument("--cases", default="32768 64,65536 64,131072 64,262144 64,32768 1,131072 1")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=1, help="more calls per case, and per stamp their median")
    ap.add_argument("--rows", choices=("trace", "iid"), default="trace",
                    help="trace: one decode-trace row (45%% and 2%% overlap) repeated B times, with and without the hint; "
                         "iid: B distinct N(0, 1) rows (quick_gpu_bench.py --rows iid's), without it, the first row "
                         "one that the replay (topk_pairs_replay.py) puts below the streamed threshold, so that the "
                         "stamps (CTA 0's) show the second collection (tag 27)")
    a = ap.parse_args()
    import importlib.util
    # the installed library's path, found without importing gvr (which would load it)
    spec = importlib.util.find_spec("gvr")
    installed = os.path.join(spec.submodule_search_locations[0], "_lib", "libgvr_cuda.so")
    backup = installed + ".release"
    shutil.copyfile(installed, backup)
    shutil.copyfile(a.lib, installed + ".tmp")
    os.replace(installed + ".tmp", installed)  # a new file: nothing has it mapped
    try:
        run(a)
    finally:
        os.replace(backup, installed)


def run(a):
    # gvr loads the library now: the profile build
    import torch
    import gvr
    from gvr import data
    lib = ctypes.CDLL(gvr.build_info()["cuda_library"])
    k = a.k
    for case in a.cases.split(","):
        N, B = (int(v) for v in case.split())
        if a.rows == "iid":
            stamp(lib, torch.from_numpy(iid_below_first(data, N, B, k)).cuda(), k, dict(method="gvr"),
                  f"N={N} B={B} iid {'gvr-noprev':10s}", a.reps)
            continue
        for ov in (0.45, 0.02):
            tr = data.decode_trace_batch(1, N, 2, k=k, overlap=ov, seed=1)
            prev = torch.from_numpy(gvr.topk_decode(tr[0][0], k)).cuda()
            x = torch.from_numpy(np.tile(tr[1][0][:N], (B, 1))).cuda()
            pb = prev.expand(B, k).contiguous()
            for label, kw in (("gvr+prev", dict(prev_topk=pb, method="gvr")), ("gvr-noprev", dict(method="gvr"))):
                stamp(lib, x, k, kw, f"N={N} B={B} ov={ov} {label:10s}", a.reps)


def stamp(lib, x, k, kw, title, reps=1):
    """three calls, then the last one's stamps (tag:cycles from the start) and CTA spans; reps > 1: that
    many more calls, each one's stamps read, and per stamp the median over them (a line "median of R")
    when every call took the same phases (the tags in the same order)"""
    import torch
    import gvr
    for _ in range(3):
        gvr.topk_decode(x, k, **kw)
    torch.cuda.synchronize()
    buf = (ctypes.c_longlong * (64 + 2 * SPANS))()
    lib.gvr_debug_clocks(buf)
    st = " ".join(f"{t}:{v}" for t, v in tagged(buf))
    print(f"{title} tag:cycles {st}", flush=True)
    print("    " + spans(buf), flush=True)
    if reps <= 1:
        return
    runs = []
    for _ in range(reps):
        gvr.topk_decode(x, k, **kw)
        torch.cuda.synchronize()
        lib.gvr_debug_clocks(buf)
        runs.append(tagged(buf))
    if any([t for t, _ in r] != [t for t, _ in runs[0]] for r in runs):
        print(f"    median of {reps}: the calls took different phases", flush=True)
        return
    med = np.median(np.array([[v for _, v in r] for r in runs], dtype=np.float64), axis=0)
    print(f"    median of {reps}: " + " ".join(f"{t}:{int(m)}" for (t, _), m in zip(runs[0], med)), flush=True)


def tagged(buf):
    """the stamps as (tag, cycles from the first stamp); tags 90 and up carry values, not cycles"""
    n, t0 = buf[63], buf[0] // 100
    return [(buf[i] % 100, buf[i] // 100 - (t0 if buf[i] % 100 < 90 else 0)) for i in range(n)]


def iid_below_first(data, n, b, k):
    """quick_gpu_bench.py's i.i.d. rows (seed 5), the first one that falls below the streamed kernel's sample
    threshold (NumPy replay of the kernel's tc) swapped to row 0"""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from topk_pairs_replay import threshold
    x = data.iid_scores(b, n, seed=5)
    below = [r for r in range(b) if int((x[r] >= np.float32(threshold(x[r], k))).sum()) < min(k, n)]
    if below:
        x[[0, below[0]]] = x[[below[0], 0]]
    print(f"N={n} B={b} iid: {len(below)} of {b} rows below tc (replayed); row 0 "
          f"{'is one' if below else 'is not'}", flush=True)
    return x


def spans(buf):
    """every CTA's start and end on the global timer (the library's PROF_SPAN stamps), as ns from the
    first start: starts and ends at the 0/50/100th percentiles, and CTA 0's"""
    g = min(int(buf[62]), SPANS)
    if g <= 0:
        return "spans: none (a library without PROF_SPAN)"
    sp = np.array(buf[64:64 + 2 * g], dtype=np.int64).reshape(g, 2)
    sp -= sp[:, 0].min()
    pc = lambda v: "/".join(str(int(x)) for x in np.percentile(v, [0, 50, 100]))  # noqa: E731
    return (f"spans over {g} CTAs (ns from the first start): start {pc(sp[:, 0])}, end {pc(sp[:, 1])}, "
            f"CTA 0 {sp[0, 0]}-{sp[0, 1]}, per-CTA duration {pc(sp[:, 1] - sp[:, 0])}")


if __name__ == "__main__":
    sys.exit(main())
