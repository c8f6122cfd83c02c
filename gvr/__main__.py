"""python -m gvr: a decode-loop demo of gvr.topk_decode (``python -m gvr prr``: the PRR demo,
gvr/_prr_demo.py).

Generates a synthetic 64K-context decode trace (gvr.data.decode_trace), runs topk_decode step by
step with the previous step's result as the prediction (prev_topk), checks every step against an
exact NumPy reference written here (independent of gvr's C code), and times it next to the usual
baselines: np.argpartition on the CPU; torch.topk and gvr's radix path on CUDA.

Exit status: 0 when every step is exact, 1 otherwise, 2 for bad arguments, a missing device or a trace
that does not fit in memory.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import gvr
import gvr.data
from gvr import _harness as H

INT32_MAX = 2**31 - 1
MAX_THREADS = 1024  # the demo's cap on --threads (gvr itself caps at 2**20 and at the number of rows)


def reference_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Exact Top-k indices of a 1-D row: value descending, NaN below -inf, ties to the lower index.

    np.lexsort sorts by its last key first: NaN-ness, then -value (-0.0 == +0.0), then the index."""
    x = np.asarray(x, dtype=np.float32)
    order = np.lexsort((np.arange(x.size), -x, np.isnan(x)))
    return order[: min(k, x.size)]


def is_exact(got, x: np.ndarray, k: int) -> bool:
    """gvr's result as a set equals the reference's, with -1 padding past min(k, len(x))."""
    got = np.asarray(got).reshape(-1)
    m = min(k, x.size)
    if got.shape != (k,) or np.any(got[m:] != -1):
        return False
    return bool(np.array_equal(np.sort(got[:m].astype(np.int64)), np.sort(reference_topk(x, k))))


def median_us_cpu(fn, reps: int) -> float:
    return H.time_cpu(fn, budget_s=0, min_runs=reps, max_runs=reps, warmup=1)["median_us"]


def median_us_cuda(torch, fn, reps: int) -> float:
    """GPU µs per call: a CUDA graph of `reps` back-to-back calls, replayed 5 times (decode loops run
    in graphs; an eager call adds tens of µs of host time that this would otherwise measure); CUDA
    events around eager calls when capture fails."""
    try:
        return H.cuda_graph_us(torch, fn, calls=reps, replays=5)
    except H.GraphCaptureError:
        return H.CudaTimer(torch, flush_bytes=0).events(fn, reps)["median_us"]


def torch_cuda():
    """torch when it is importable and sees a CUDA device, else None."""
    try:
        import torch
    except Exception:
        return None
    try:
        return torch if torch.cuda.is_available() and torch.cuda.device_count() > 0 else None
    except Exception:
        return None


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m gvr",
        description="Decode-loop demo of gvr.topk_decode: exactness check and timing on a synthetic trace. "
                    "(python -m gvr prr --help: the PRR demo.)",
    )
    p.add_argument("--n", type=int, default=65536,
                   help="context length at the first step (default 65536; n + steps - 1 at most 2**31 - 1)")
    p.add_argument("--k", type=int, default=2048, help="top-k (default 2048; 0 gives empty results; at most 2**31 - 1)")
    p.add_argument("--steps", type=int, default=8, help="decode steps (default 8)")
    p.add_argument("--overlap", type=float, default=0.45,
                   help="target step-to-step Top-k overlap of the trace (default 0.45)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when torch sees a GPU and gvr's CUDA library loads, else cpu")
    p.add_argument("--threads", type=int, default=1, help=f"CPU threads for gvr (default 1, at most {MAX_THREADS})")
    p.add_argument("--seed", type=int, default=0, help="trace seed in [0, 2**64 - 1] (default 0)")
    a = p.parse_args(argv)
    # rows are indexed by int32, so lengths, k and thread counts are bounded before anything is allocated
    for name, lo, hi in (("n", 1, INT32_MAX), ("k", 0, INT32_MAX), ("steps", 1, INT32_MAX),
                         ("threads", 1, MAX_THREADS), ("seed", 0, 2**64 - 1)):
        if not lo <= getattr(a, name) <= hi:
            p.error(f"--{name} must lie in [{lo}, {hi}], got {getattr(a, name)}")
    if a.n + a.steps - 1 > INT32_MAX:
        p.error(f"--n + --steps - 1 (the last row's length) must be at most {INT32_MAX}")
    if not 0.0 <= a.overlap <= 1.0:
        p.error("--overlap must lie in [0, 1]")
    return a


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["prr"]:  # python -m gvr prr [options]: the PRR demo
        from . import _prr_demo

        return _prr_demo.main(args[1:])
    a = parse_args(args)
    info = gvr.build_info()
    torch = torch_cuda() if a.device in ("auto", "cuda") else None
    why = None
    if torch is None:
        why = "torch with a CUDA device is not available"
    elif not gvr.cuda_available():
        why = info["cuda_error"]
    else:
        try:  # the library loads; can it run on this GPU (its architecture built in)?
            gvr.topk_decode(torch.zeros(1, 8, device="cuda"), 1)
            torch.cuda.synchronize()
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
    if a.device == "cuda" and why is not None:
        print(f"python -m gvr: --device cuda: {why}", file=sys.stderr)
        return 2
    device = "cuda" if why is None else "cpu"
    gvr.set_num_threads(a.threads)

    print(f"gvr {gvr.__version__}: exact decode-time Top-K warm-started by the previous step's Top-K")
    if device == "cuda":
        print(f"device: cuda ({torch.cuda.get_device_name()}), torch {torch.__version__}")
    else:
        threads = f"{a.threads} thread{'s' if a.threads != 1 else ''} for gvr"
        print(f"device: cpu ({H.cpu_name()}, {os.cpu_count()} cores, {threads})")
        if torch is not None:
            print(f"  (CUDA not used: {why})")
    if info["cuda"]:
        print(f"CUDA library: built and loads ({info['cuda_library']})")
    else:
        print(f"CUDA library: not available: {info['cuda_error']}")

    t0 = time.perf_counter()
    trace_k = a.k if a.k > 0 else min(2048, a.n)  # the trace's overlap is defined for a k > 0
    try:
        rows = list(gvr.data.decode_trace(n=a.n, steps=a.steps, k=trace_k, overlap=a.overlap, seed=a.seed))
    except MemoryError as e:  # --n / --steps within range but more than this machine holds
        print(f"python -m gvr: --n {a.n} --steps {a.steps}: the trace does not fit in memory ({e})", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    print(f"trace: gvr.data.decode_trace(n={a.n}, steps={a.steps}, k={trace_k}, overlap={a.overlap}, "
          f"seed={a.seed}) in {dt:.1f} s")
    if a.steps > 1:
        reached = float(np.mean(gvr.data.trace_overlaps(rows, trace_k)))
        chance = min(1.0, trace_k / a.n)
        if abs(reached - a.overlap) > 0.05:
            if a.overlap < reached and a.overlap < chance:
                why = f"below chance level (~k/N = {chance:.3f}): independent steps already share that much"
            else:
                why = f"{'below' if a.overlap < reached else 'above'} what the trace generator reaches at this size"
            print(f"  note: requested overlap {a.overlap:.2f} cannot be reached: {why}; measured {reached:.2f}")
        else:
            print(f"  overlap: requested {a.overlap:.2f}, measured {reached:.2f}")
    if dt > 5 * (a.n * (a.steps + 16)) / (65536 * 24) + 2 and "OPENBLAS_NUM_THREADS" not in os.environ:
        # gvr.data's many small NumPy matmuls suffer when BLAS threads compete for busy cores
        print("  (slow: on a busy machine, OPENBLAS_NUM_THREADS=1 python -m gvr generates it faster)")

    if device == "cpu":
        reps = 10
        print(f"timing: µs, median of {reps} calls per step on the same row (warm cache: optimistic; "
              f"benchmarks/bench_topk.py rotates inputs)")
        print("  gvr+prev: prev_topk = the previous step's result, passed as a user would (method 'auto' leaves it "
              "out: measured, it never made a call faster); gvr: no prediction; "
              "argpart: np.argpartition(-x, k)[:k]; speedup = argpart / gvr+prev")
        print(f"{'step':>4} {'N':>8} {'gvr+prev':>10} {'gvr':>10} {'argpart':>10} {'speedup':>8} {'overlap':>8}  exact")
    else:
        reps = 20
        print(f"timing: µs per call, a CUDA graph of {reps} calls on the same row replayed (how decode loops run; "
              f"warm L2: optimistic; benchmarks/bench_topk.py has cold-L2 and eager numbers)")
        print("  gvr+prev: prev_topk = the previous step's result, passed as a user would (method 'auto' leaves it "
              "out: measured, it never made a call faster); gvr: no prediction; radix: method='radix'; "
              "torch: torch.topk(x, k, sorted=False)")
        print(f"{'step':>4} {'N':>8} {'gvr+prev':>10} {'gvr':>10} {'radix':>10} {'torch':>10} "
              f"{'vs torch':>8} {'vs radix':>8} {'overlap':>8}  exact")

    prev = None  # the previous step's result: this step's prediction
    speedups, all_exact = [], True
    for t, x in enumerate(rows):
        k = a.k
        if device == "cpu":
            cur = gvr.topk_decode(x, k, prev_topk=prev)
            t_gvr = median_us_cpu(lambda: gvr.topk_decode(x, k, prev_topk=prev), reps)
            t_nopred = median_us_cpu(lambda: gvr.topk_decode(x, k), reps)
            t_base = median_us_cpu(lambda: np.argpartition(-x, k)[:k] if 0 < k < x.size else np.arange(min(k, x.size)), reps)
            cur_host = cur
        else:
            xd = torch.from_numpy(x).cuda()
            kk = min(k, xd.numel())  # torch.topk needs k <= N
            cur = gvr.topk_decode(xd, k, prev_topk=prev)
            t_gvr = median_us_cuda(torch, lambda: gvr.topk_decode(xd, k, prev_topk=prev), reps)
            t_nopred = median_us_cuda(torch, lambda: gvr.topk_decode(xd, k), reps)
            t_radix = median_us_cuda(torch, lambda: gvr.topk_decode(xd, k, method="radix"), reps)
            t_base = median_us_cuda(torch, lambda: torch.topk(xd, kk, sorted=False), reps)
            cur_host = cur.cpu().numpy()
        exact = is_exact(cur_host, x, k)
        all_exact &= exact
        ovl = "-" if prev is None or k == 0 else f"{gvr.data.topk_overlap(prev_host, cur_host):.2f}"
        sp = t_base / t_gvr if t_gvr > 0 else float("nan")
        if prev is not None or a.steps == 1:
            speedups.append(sp)
        if device == "cpu":
            print(f"{t:>4} {x.size:>8} {t_gvr:>10.1f} {t_nopred:>10.1f} {t_base:>10.1f} {sp:>7.2f}x {ovl:>8}  "
                  f"exact: {'yes' if exact else 'no'}", flush=True)
        else:
            print(f"{t:>4} {x.size:>8} {t_gvr:>10.1f} {t_nopred:>10.1f} {t_radix:>10.1f} {t_base:>10.1f} {sp:>7.2f}x "
                  f"{t_radix / t_gvr:>7.2f}x {ovl:>8}  exact: {'yes' if exact else 'no'}", flush=True)
        prev, prev_host = cur, cur_host

    base = "argpartition" if device == "cpu" else "torch.topk"
    which = {1: "step 0 (no prediction)", 2: "step 1 (with prediction)"}.get(
        a.steps, f"steps 1..{a.steps - 1} (with prediction)")
    print(f"summary: median speedup over {base}, {which}: {statistics.median(speedups):.2f}x; "
          f"all exact: {'yes' if all_exact else 'no'}")
    return 0 if all_exact else 1


if __name__ == "__main__":
    sys.exit(main())
