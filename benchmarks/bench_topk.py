#!/usr/bin/env python3
"""Benchmark of gvr.topk_decode: exact decode-time Top-K, warm-started by the previous step's Top-K.

    python benchmarks/bench_topk.py [--device cpu|cuda] [--quick] [--n N ...] [--batch B ...]
                                    [--out results.json] [--append-results benchmarks/RESULTS.md]

Workloads and cells only: timing, GB/s, the memory floor, the header and JSON come from the one
harness (gvr/_harness.py, through benchmarks/_harness.py); the acceptance bars from
benchmarks/bars.json.

CPU: gvr with prev_topk (prev = exact Top-K of the previous trace step), gvr without prediction,
np.argpartition(-x, k)[..., :k] and torch.topk (when torch imports); 1 thread and all threads at B > 1.
CUDA: gvr with prediction (auto), gvr without (auto), the GVR kernel forced with prediction
(method="gvr"), the radix path (method="radix") and torch.topk(sorted=False); warm L2 (CUDA graph
replay) and cold L2 (a buffer larger than L2 written before each call).

Bytes per call (GB/s and floor columns): scores read (B*N*4) + prev_topk (B*Kp*4, methods with a
prediction) + out (B*k*4), whatever the method. Floor = bytes / the device's measured copy bandwidth.
An exception in one cell is printed and recorded, and the run goes on.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _harness as H  # noqa: E402

K = 2048
WORKLOADS = {
    "trace45": {"overlap": 0.45, "desc": "decode trace (gvr.data), target step-to-step Top-K overlap 0.45"},
    "trace02": {"overlap": 0.02, "desc": "decode trace (gvr.data), target overlap 0.02 (clamped to chance level, ~k/N)"},
    # the hint-quality sweep (issue 15): not in the default grid, name them with --workloads
    "trace20": {"overlap": 0.20, "desc": "decode trace (gvr.data), target overlap 0.20", "sweep": True},
    "trace70": {"overlap": 0.70, "desc": "decode trace (gvr.data), target overlap 0.70", "sweep": True},
    "trace95": {"overlap": 0.95, "desc": "decode trace (gvr.data), target overlap 0.95", "sweep": True},
    "iid": {"overlap": None, "desc": "i.i.d. N(0,1) rows, a fresh draw per step (prev = Top-K of the previous draw)"},
}
GRID = {  # (sizes, batches), full and --quick
    "cpu": (([4096, 16384, 65536, 131072, 262144], [1, 8]), ([4096, 131072], [1, 8])),
    "cuda": (([4096, 8192, 16384, 32768, 65536, 131072, 262144], [1, 8, 64]), ([4096, 65536, 131072], [1, 64])),
}


def import_gvr():
    return H.import_gvr(ROOT)


def import_torch():
    try:
        import torch

        return torch
    except Exception:
        return None


def topk_bytes(b, n, k, kp=0):
    """Bytes one call moves at least: the scores, the prediction, the result."""
    return 4 * b * (n + kp + k)


def same_sets(a, b):
    a = np.sort(np.asarray(a).astype(np.int64), axis=-1)
    b = np.sort(np.asarray(b).astype(np.int64), axis=-1)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def reference_topk(row, k):
    """Exact Top-k of a NaN-free row, ties to the lowest indices; independent of gvr."""
    m = row.shape[0]
    if k >= m:
        return np.arange(m)
    v = np.partition(row, m - k)[m - k]
    above = np.flatnonzero(row > v)
    return np.concatenate([above, np.flatnonzero(row == v)[: k - above.size]])


class Workload:
    """``steps`` score arrays [pool, N + t] and their exact Top-K (``truth[t]``, int32 [pool, k]:
    gvr on the CPU without prediction, checked against NumPy), with measured step-to-step overlaps."""

    def __init__(self, gvr, name, n, steps, pool, k, seed):
        data = gvr.data
        self.name, self.n, self.steps, self.pool, self.k = name, n, steps, pool, k
        t0 = time.perf_counter()
        ov = WORKLOADS[name]["overlap"]
        if ov is None:
            self.arrays = [data.iid_scores(pool, n + t, dist="normal", seed=seed * 1009 + 17 + t) for t in range(steps)]
            self.source = "gvr.data.iid_scores(normal), one draw per step"
        else:
            # rho calibrated once on row 0 and shared by the pool rows (seconds per row at large N)
            rho = float(data.rho_for_overlap(ov, n, k=k, seed=seed))
            self.arrays = data.decode_trace_batch(pool, n, steps, k=k, seed=seed, rho=rho)
            self.source = f"gvr.data.decode_trace_batch(pool={pool}, seed={seed}, rho={rho:.4f} calibrated on row 0)"
        self.arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in self.arrays]
        self.gen_s = time.perf_counter() - t0
        self.truth = []
        for t, a in enumerate(self.arrays):
            res = np.asarray(gvr.topk_decode(a, k), dtype=np.int32)
            for p in range(pool):
                if not same_sets(res[p], reference_topk(a[p], k)):
                    raise AssertionError(f"{name} N={n} step {t} row {p}: gvr CPU Top-K != NumPy reference")
            self.truth.append(res)
        self.overlaps = np.array([[data.topk_overlap(self.truth[t - 1][p], self.truth[t][p]) for t in range(1, steps)]
                                  for p in range(pool)])

    def overlap(self, rows):
        return float(self.overlaps[sorted(set(rows))].mean())


def rolled_inputs(base, target, max_bytes=64 << 20):
    """More distinct inputs from (x, prev, expected) triples: x circularly shifted by s along N, prev
    remapped to (prev + s) mod N (the same problem relabelled: same values and overlap, a new branch
    pattern; expected None: not checked), up to ``target`` inputs within ``max_bytes``."""
    per = sum(x.nbytes for x, _, _ in base) or 1
    copies = max(1, min(math.ceil(target / len(base)), max_bytes // per))
    out = []
    for v in range(copies):
        for x, prev, exp in base:
            if v == 0:
                out.append((x, prev, exp))
                continue
            m = x.shape[-1]
            sh = (v * m) // copies + 7 * v
            out.append((np.ascontiguousarray(np.roll(x, sh, axis=-1)), ((prev.astype(np.int64) + sh) % m).astype(np.int32), None))
    return out


# --------------------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------------------
CPU_METHODS = ("gvr_prev", "gvr", "argpartition", "torch_topk")
CPU_HEADERS = ["workload", "N", "B", "thr", "ovl", "gvr+prev", "gvr", "argpart", "torch", "GB/s", "argp/gvr+prev",
               "argp/gvr", "gvr/gvr+prev", "rep:gvr+prev", "rep:gvr", "rep:argpart", "rep:argp/gvr+prev"]


def cpu_value(c, m, mode=None):
    t = c.get("methods", {}).get(m)
    if t is None:
        return None
    return (t if mode in (None, "fresh") else t.get(mode, {})).get("median_us")


def cpu_cell(gvr, torch, wl, b, threads, args, bandwidth):
    k, n = args.k, wl.n
    gvr.set_num_threads(1 if threads == 1 else 0)
    torch_threads = torch.get_num_threads() if torch is not None else None
    if torch is not None and threads == 1:
        torch.set_num_threads(1)
    try:
        base = []  # (x, prev, expected): B=1 every (pool row, step); B>1 rows b mod pool
        if b == 1:
            rows_used = list(range(wl.pool))
            for p in rows_used:
                for t in range(1, wl.steps):
                    base.append((np.ascontiguousarray(wl.arrays[t][p]), wl.truth[t - 1][p].copy(), wl.truth[t][p]))
        else:
            idx = np.arange(b) % wl.pool
            rows_used = sorted(set(idx.tolist()))
            for t in range(1, wl.steps):
                base.append((np.ascontiguousarray(wl.arrays[t][idx]), np.ascontiguousarray(wl.truth[t - 1][idx]),
                             wl.truth[t][idx]))
        inputs = rolled_inputs(base, args.distinct if b == 1 else max(4, args.distinct // 2))
        for x, prev, exp in inputs:
            if exp is not None:
                assert same_sets(gvr.topk_decode(x, k, prev_topk=prev), exp), f"gvr+prev != exact Top-K ({wl.name} N={n} B={b})"
                assert same_sets(gvr.topk_decode(x, k), exp), f"gvr != exact Top-K ({wl.name} N={n} B={b})"
        big = n >= 65536
        kw = dict(budget_s=args.budget * max(b, 1) ** 0.5, min_runs=30 if big or args.quick else 100,
                  max_runs=300 if big else 2000)
        touches = [lambda x=x: x.max() for x, _, _ in inputs]
        calls = {
            "gvr_prev": [lambda x=x, p=p: gvr.topk_decode(x, k, prev_topk=p) for x, p, _ in inputs],
            "gvr": [lambda x=x: gvr.topk_decode(x, k) for x, _, _ in inputs],
            "argpartition": [lambda x=x: np.argpartition(-x, k, axis=-1)[..., :k] for x, _, _ in inputs],
        }
        if torch is not None:
            calls["torch_topk"] = [lambda x=torch.from_numpy(x): torch.topk(x, k, dim=-1, sorted=False) for x, _, _ in inputs]
        N = inputs[0][0].shape[-1]
        nbytes = {m: topk_bytes(b, N, k, k if m == "gvr_prev" else 0) for m in calls}
        meth = {}
        for m, cs in calls.items():
            meth[m] = H.time_cpu_rotating(cs, touches, **kw)
            meth[m]["gbps"] = H.gbps(nbytes[m], meth[m]["median_us"])
        med = {m: v["median_us"] for m, v in meth.items()}
        rep = {m: v["repeat"]["median_us"] for m, v in meth.items()}
        r = H.ratio
        speedup = {
            "argpartition_over_gvr_prev": r(med.get("argpartition"), med.get("gvr_prev")),
            "argpartition_over_gvr": r(med.get("argpartition"), med.get("gvr")),
            "gvr_over_gvr_prev": r(med.get("gvr"), med.get("gvr_prev")),
            "torch_over_gvr_prev": r(med.get("torch_topk"), med.get("gvr_prev")),
            "argpartition_over_gvr_prev_repeat": r(rep.get("argpartition"), rep.get("gvr_prev")),
            "argpartition_over_gvr_repeat": r(rep.get("argpartition"), rep.get("gvr")),
        }
        return {"workload": wl.name, "n": n, "b": b, "k": k, "threads": threads, "threads_label": "1" if threads == 1 else "all",
                "gvr_threads": gvr.get_num_threads(), "overlap_measured": wl.overlap(rows_used),
                "inputs": len(inputs), "inputs_unshifted": len(base), "bytes": nbytes,
                "floor_us": {m: H.floor_us(v, bandwidth) for m, v in nbytes.items()},
                "methods": meth, "speedup": speedup, "correct": {"gvr_prev": True, "gvr": True}}
    finally:
        gvr.set_num_threads(0)
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)


def cpu_row(c):
    if c.get("error"):
        return [c["workload"], H.fmt_n(c["n"]), c["b"], c.get("threads_label", "?"), "-",
                "ERROR: " + c["error"].splitlines()[-1][:60]]
    v = lambda m, mode=None: H.fmt_us(cpu_value(c, m, mode))  # noqa: E731
    s = c["speedup"]
    return [c["workload"], H.fmt_n(c["n"]), c["b"], c["threads_label"], f"{c['overlap_measured']:.2f}",
            v("gvr_prev"), v("gvr"), v("argpartition"), v("torch_topk"),
            f"{c['methods']['gvr_prev']['gbps']:.1f}", H.fmt_x(s["argpartition_over_gvr_prev"]),
            H.fmt_x(s["argpartition_over_gvr"]), H.fmt_x(s["gvr_over_gvr_prev"]),
            v("gvr_prev", "repeat"), v("gvr", "repeat"), v("argpartition", "repeat"),
            H.fmt_x(s["argpartition_over_gvr_prev_repeat"])]


def run_cpu(gvr, args, meta, grid):
    torch = None if args.no_torch else import_torch()
    meta.update(H.header(torch, ROOT))
    gvr.set_num_threads(0)
    meta["gvr_default_threads"] = gvr.get_num_threads()
    bandwidth = H.cpu_copy_bandwidth()
    meta["copy_bandwidth_gbps"] = bandwidth / 1e9
    sizes, batches = grid
    pool = args.pool or (2 if args.quick else 8)
    meta["pool"] = pool
    meta["batch_rows"] = (f"B=1: every (pool row, step) input; B>1: row b = trace row b mod {pool}; more distinct "
                          f"inputs by circular shifts (>= {args.distinct} for B=1)")
    print(H.header_line(meta))
    print(f"# CPU, gvr default threads {meta['gvr_default_threads']}; k={args.k}, steps={args.steps}, pool={pool}; "
          f"host copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    print("# median us per call (time.perf_counter around each call); main columns: distinct inputs rotated, each row "
          "read just before its call; rep: = one input repeated back to back; GB/s = gvr+prev's bytes / time", flush=True)
    cells = []
    for wname in args.workloads:
        for n in sizes:
            cases = [(b, thr) for b in batches for thr in ([1] if b == 1 else [0, 1])]
            try:
                wl = Workload(gvr, wname, n, args.steps, pool, args.k, args.seed)
                print(f"  [{wname} N={n}: generated in {wl.gen_s:.1f}s; {wl.source}; mean overlap {wl.overlaps.mean():.3f}]", flush=True)
            except Exception as e:
                traceback.print_exc()
                cells += [{"workload": wname, "n": n, "b": b, "threads": thr, "threads_label": "1" if thr == 1 else "all",
                           "error": f"workload generation failed: {type(e).__name__}: {e}"} for b, thr in cases]
                continue
            for b, thr in cases:
                try:
                    c = cpu_cell(gvr, torch, wl, b, thr, args, bandwidth)
                except Exception as e:
                    traceback.print_exc()
                    c = {"workload": wname, "n": n, "b": b, "threads": thr, "threads_label": "1" if thr == 1 else "all",
                         "error": f"{type(e).__name__}: {e}"}
                cells.append(c)
                if len(cells) == 1:
                    print(H.format_table(CPU_HEADERS, []).split("\n")[0], flush=True)
                print(H.format_table(CPU_HEADERS, [cpu_row(c)]).splitlines()[-1], flush=True)
    rows = [cpu_row(c) for c in cells]
    print()
    print(H.format_table(CPU_HEADERS, rows))
    print("columns: ovl = measured step-to-step Top-K overlap; gvr+prev = gvr.topk_decode(x, k, prev_topk=<exact Top-K of "
          "step t-1>); gvr = no prediction; argpart = np.argpartition(-x, k, axis=-1)[..., :k]; torch = torch.topk(x, k, "
          "sorted=False); GB/s = (scores + prev + out bytes) / gvr+prev time; a/b = time(a)/time(b)")
    return cells, rows, CPU_HEADERS, cpu_value


# --------------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------------
CUDA_METHODS = ("gvr_prev", "gvr", "gvr_kernel_prev", "radix", "torch_topk")
CUDA_HEADERS = ["workload", "N", "B", "ovl", "w:gvr+prev", "w:gvr", "w:GVRk+prev", "w:radix", "w:torch", "w:GB/s",
                "floor", "w:radix/gvr+prev", "w:torch/gvr+prev", "c:gvr+prev", "c:gvr", "c:radix", "c:torch",
                "c:radix/gvr+prev", "c:torch/gvr+prev", "check"]


def cuda_value(c, m, mode="warm"):
    try:
        return c["methods"][m][mode]["median_us"]
    except (KeyError, TypeError):
        return None


def cuda_cell(gvr, torch, timer, wl, gx, b, args):
    """gx: per-step GPU tensors 'x' [pool, N+t] and 'truth' [pool, k]."""
    k, dev = args.k, timer.device
    idx_np = np.arange(b) % wl.pool
    idx = torch.as_tensor(idx_np, device=dev)
    pairs = [(gx["x"][t].index_select(0, idx).contiguous(), gx["truth"][t - 1].index_select(0, idx).contiguous(),
              wl.truth[t][idx_np]) for t in range(1, wl.steps)]
    outs = {m: [torch.empty(b, k, dtype=torch.int32, device=dev) for _ in pairs] for m in CUDA_METHODS[:4]}
    spec = {"gvr_prev": ("auto", True), "gvr": ("auto", False), "gvr_kernel_prev": ("gvr", True), "radix": ("radix", False)}

    def make(m, i):
        x, prev, _ = pairs[i]
        if m == "torch_topk":
            return lambda: torch.topk(x, k, dim=-1, sorted=False)
        method, with_prev = spec[m]
        p, o = (prev if with_prev else None), outs[m][i]
        return lambda: gvr.topk_decode(x, k, prev_topk=p, out=o, method=method)

    N = pairs[0][0].shape[-1]
    nbytes = {m: topk_bytes(b, N, k, k if m.endswith("_prev") else 0) for m in CUDA_METHODS}
    bw = timer.copy_bandwidth()
    res = {"workload": wl.name, "n": wl.n, "b": b, "k": k, "overlap_measured": wl.overlap(idx_np.tolist()),
           "pairs": len(pairs), "rows": f"row b = trace row b mod {wl.pool}", "bytes": nbytes,
           "floor_us": {m: H.floor_us(v, bw) for m, v in nbytes.items()}, "methods": {}, "errors": {}, "correct": {}}
    working = []
    for m in CUDA_METHODS:  # correctness, eager, every step pair
        try:
            ok = True
            for i, (_, _, exp) in enumerate(pairs):
                if m in outs:
                    outs[m][i].fill_(-7)
                make(m, i)()
                torch.cuda.synchronize()
                if m in outs:
                    ok &= same_sets(outs[m][i].cpu().numpy(), exp)
            if m in outs:
                res["correct"][m] = bool(ok)
                if not ok:
                    print(f"  !! {wl.name} N={wl.n} B={b}: {m} CUDA result != CPU gvr result", flush=True)
            working.append(m)
        except Exception as e:
            res["errors"][m] = f"{type(e).__name__}: {e}"
            print(f"  !! {wl.name} N={wl.n} B={b}: {m} failed: {res['errors'][m]}", flush=True)
            torch.cuda.synchronize()
    per_pair = max(1, math.ceil(args.reps / len(pairs)))
    per_pair_cold = max(1, math.ceil(args.cold_reps / len(pairs)))
    warm_mode = "graph"
    for m in working:
        warm = []
        for i in range(len(pairs)):
            fn = make(m, i)
            try:
                if warm_mode != "graph":
                    raise H.GraphCaptureError(warm_mode)
                if m in outs:
                    outs[m][i].fill_(-7)
                warm.append(timer.graph(fn, args.graph_calls, per_pair))
                if m in outs and not same_sets(outs[m][i].cpu().numpy(), pairs[i][2]):
                    res["correct"][m] = False
                    print(f"  !! {wl.name} N={wl.n} B={b}: {m} wrong result after CUDA graph replay", flush=True)
            except H.GraphCaptureError as e:
                if warm_mode == "graph":
                    warm_mode = f"eager (graph capture failed: {e})"
                    print(f"  !! {wl.name} N={wl.n} B={b}: {warm_mode}", flush=True)
                warm.append(timer.events(fn, per_pair))
        res["methods"][m] = {"warm": _merge(warm)}
    # cold: every method and step pair in turns, so that no method is the one timed while the clocks ramp up
    turns = [(m, i) for m in working for i in range(len(pairs))]
    cold = timer.events_interleaved([make(m, i) for m, i in turns], per_pair_cold, cold=True)
    for m in working:
        res["methods"][m]["cold"] = _merge([c for (mm, _), c in zip(turns, cold) if mm == m])
        for mode in ("warm", "cold"):
            res["methods"][m][mode]["gbps"] = H.gbps(nbytes[m], res["methods"][m][mode]["median_us"])
    res["warm_mode"] = warm_mode
    sp = {}
    for mode in ("warm", "cold"):
        t = {m: cuda_value(res, m, mode) for m in working}
        for base in ("radix", "torch_topk"):
            for m in ("gvr_prev", "gvr"):
                a, c = t.get(base), t.get(m)
                sp[f"{base.split('_')[0]}_over_{m}_{mode}"] = H.ratio(a, c)
    res["speedup"] = sp
    if not working:
        res["error"] = "; ".join(f"{m}: {e}" for m, e in res["errors"].items())
    return res


def _merge(stats):
    """Statistics of several inputs' timings -> one: medians of their medians (runs summed)."""
    stats = [s for s in stats if s.get("runs")]
    if not stats:
        return H.summarize([])
    out = {key: float(np.median([s[key] for s in stats])) for key in ("median_us", "p10_us", "p90_us")}
    out["min_us"] = float(min(s["min_us"] for s in stats))
    out["runs"] = int(sum(s["runs"] for s in stats))
    return out


def cuda_row(c):
    if c.get("error") and not c.get("methods"):
        return [c["workload"], H.fmt_n(c["n"]), c["b"], "-", "ERROR: " + c["error"].splitlines()[-1][:70]]
    v = lambda m, mode="warm": H.fmt_us(cuda_value(c, m, mode))  # noqa: E731
    s, corr = c["speedup"], c.get("correct", {})
    if c.get("errors"):
        check = "ERR:" + ",".join(c["errors"])
    elif corr and all(corr.values()):
        check = "ok"
    else:
        check = "MISMATCH:" + ",".join(m for m, ok in corr.items() if not ok)
    if c.get("warm_mode", "graph") != "graph":
        check += " (warm eager)"
    gb = c["methods"].get("gvr_prev", {}).get("warm", {}).get("gbps")
    return [c["workload"], H.fmt_n(c["n"]), c["b"], f"{c['overlap_measured']:.2f}",
            v("gvr_prev"), v("gvr"), v("gvr_kernel_prev"), v("radix"), v("torch_topk"),
            "-" if gb is None else f"{gb:.0f}", H.fmt_us(c["floor_us"]["gvr_prev"]),
            H.fmt_x(s.get("radix_over_gvr_prev_warm")), H.fmt_x(s.get("torch_over_gvr_prev_warm")),
            v("gvr_prev", "cold"), v("gvr", "cold"), v("radix", "cold"), v("torch_topk", "cold"),
            H.fmt_x(s.get("radix_over_gvr_prev_cold")), H.fmt_x(s.get("torch_over_gvr_prev_cold")), check]


def run_cuda(gvr, args, meta, grid):
    torch = import_torch()
    if torch is None or not torch.cuda.is_available():
        raise SystemExit("--device cuda needs PyTorch with a CUDA device")
    if not gvr.cuda_available():
        raise SystemExit(f"gvr has no working CUDA library: {gvr.build_info()['cuda_error']}")
    meta.update(H.header(torch, ROOT, cuda=True))
    timer = H.CudaTimer(torch)
    bw = timer.copy_bandwidth()
    meta["copy_bandwidth_gbps"] = bw / 1e9
    meta["warm_timing"] = (f"CUDA graph of {args.graph_calls} back-to-back calls captured on a side stream, replayed; "
                           f"per-call = replay time / {args.graph_calls}; median over replays")
    meta["cold_timing"] = (f"eager, CUDA events around each call, {timer.flush_bytes >> 20} MB written before each call, "
                           "the cell's methods and step pairs timed in turns, each in a random order")
    sizes, batches = grid
    pool = args.pool or (2 if args.quick else 4)
    meta["pool"] = pool
    meta["batch_rows"] = (f"B>1 rows tiled from {pool} independent traces (row b = trace row b mod {pool}); timed on "
                          f"steps 1..{args.steps - 1}, prev = exact Top-K of the step before (gvr on the CPU)")
    print(H.header_line(meta))
    print(f"# k={args.k}, steps={args.steps}; {meta['batch_rows']}")
    print(f"# warm L2: {meta['warm_timing']}\n# cold L2: {meta['cold_timing']}")
    print(f"# device copy bandwidth {bw / 1e9:.0f} GB/s (read + write): floor = bytes / that")
    print("# columns: w: = warm L2, c: = cold L2, median us per call; a/b = time(a) / time(b)", flush=True)
    t_start = time.perf_counter()
    cells = []
    for wname in args.workloads:
        for n in sizes:
            try:
                wl = Workload(gvr, wname, n, args.steps, pool, args.k, args.seed)
                gx = {"x": [torch.from_numpy(a).to(timer.device) for a in wl.arrays],
                      "truth": [torch.from_numpy(t).to(timer.device) for t in wl.truth]}
                print(f"  [{wname} N={n}: generated in {wl.gen_s:.1f}s; {wl.source}; mean overlap "
                      f"{wl.overlaps.mean():.3f}; elapsed {time.perf_counter() - t_start:.0f}s]", flush=True)
            except Exception as e:
                traceback.print_exc()
                cells += [{"workload": wname, "n": n, "b": b, "error": f"workload generation failed: {type(e).__name__}: {e}"}
                          for b in batches]
                continue
            for b in batches:
                try:
                    c = cuda_cell(gvr, torch, timer, wl, gx, b, args)
                except Exception as e:
                    traceback.print_exc()
                    c = {"workload": wname, "n": n, "b": b, "error": f"{type(e).__name__}: {e}"}
                    torch.cuda.synchronize()
                cells.append(c)
                if len(cells) == 1:
                    print(H.format_table(CUDA_HEADERS, []).split("\n")[0], flush=True)
                print(H.format_table(CUDA_HEADERS, [cuda_row(c)]).splitlines()[-1], flush=True)
            del gx, wl
            torch.cuda.empty_cache()
    meta["elapsed_s"] = time.perf_counter() - t_start
    rows = [cuda_row(c) for c in cells]
    print()
    print(H.format_table(CUDA_HEADERS, rows))
    print("columns: ovl = measured Top-K overlap of consecutive steps; gvr+prev = method 'auto' with prev_topk = exact "
          "Top-K of the previous step; gvr = 'auto' without prediction; GVRk+prev = the GVR kernel forced (method 'gvr') "
          "with prev_topk; radix = method 'radix'; torch = torch.topk(x, k, dim=-1, sorted=False); w:GB/s = gvr+prev's "
          "bytes / warm time; floor = gvr+prev's bytes / copy bandwidth (us)")
    return cells, rows, CUDA_HEADERS, cuda_value


# --------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--quick", action="store_true", help="reduced grid for smoke runs")
    p.add_argument("--out", default=None, help="JSON output (default benchmarks/results_<device>.json)")
    p.add_argument("--append-results", default=None, metavar="PATH", help="append a markdown section to PATH")
    p.add_argument("--bars", default=os.path.join(HERE, "bars.json"), help="acceptance bars (default benchmarks/bars.json)")
    p.add_argument("--k", type=int, default=K)
    p.add_argument("--n", "--sizes", dest="sizes", type=int, nargs="+", default=None, help="row lengths N (override the grid)")
    p.add_argument("--batch", "--batches", dest="batches", type=int, nargs="+", default=None, help="batch sizes B (override the grid)")
    p.add_argument("--workloads", nargs="+", default=[w for w in WORKLOADS if not WORKLOADS[w].get("sweep")],
                   choices=list(WORKLOADS), help="default: trace45 trace02 iid; the hint-quality sweep adds "
                   "trace20 trace70 trace95")
    p.add_argument("--steps", type=int, default=3, help="decode steps per trace (timed: steps 1..steps-1)")
    p.add_argument("--pool", type=int, default=None, help="independent trace rows per (workload, N) (default CPU 8, CUDA 4; --quick 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=float, default=None, help="CPU: seconds of timing per method and cell (default 0.15, --quick 0.06)")
    p.add_argument("--distinct", type=int, default=16, help="CPU: distinct B=1 inputs per cell (pool rows x steps, then shifts)")
    p.add_argument("--reps", type=int, default=60, help="CUDA warm: timed replays per cell")
    p.add_argument("--cold-reps", type=int, default=50, help="CUDA cold: timed calls per cell")
    p.add_argument("--graph-calls", type=int, default=10, help="CUDA warm: calls captured in one graph")
    p.add_argument("--no-torch", action="store_true", help="CPU: skip torch.topk even if torch imports")
    a = p.parse_args(argv)
    if a.budget is None:
        a.budget = 0.06 if a.quick else 0.15
    if a.steps < 2:
        p.error("--steps must be >= 2")
    if a.out is None:
        a.out = os.path.join(HERE, f"results_{a.device}.json")
    return a


def write_markdown(path, meta, headers, rows, lines):
    md = [f"\n## {meta['mode'].upper()}: {meta.get('device_name', '?')} ({meta['date']})\n",
          f"commit `{meta.get('commit')}` (sources sha256 `{meta.get('source_digest')}`), gvr {meta.get('gvr_version')}, "
          f"numpy {meta.get('numpy')}, torch {meta.get('torch')}, k={meta['args']['k']}, quick={meta['args']['quick']}. "
          f"{meta.get('batch_rows', '')}.", ""]
    if meta["mode"] == "cuda":
        md += [f"Warm L2: {meta.get('warm_timing')}. Cold L2: {meta.get('cold_timing')}. Times in µs (medians).", ""]
    else:
        md += ["Times in µs (medians of per-call time.perf_counter timings).", ""]
    md += [H.markdown_table(headers, rows), "", "```"] + lines + ["```", ""]
    with open(path, "a") as f:
        f.write("\n".join(md))


def main(argv=None):
    args = parse_args(argv)
    gvr = import_gvr()
    t0 = time.perf_counter()
    meta = {"mode": args.device, "args": vars(args), "workloads": {w: WORKLOADS[w]["desc"] for w in args.workloads}}
    try:
        meta["build_info"] = dict(gvr.build_info())
    except Exception as e:
        meta["build_info"] = f"{type(e).__name__}: {e}"
    full, quick = GRID[args.device]
    sizes, batches = quick if args.quick else full
    grid = (args.sizes or sizes, args.batches or batches)
    run = run_cpu if args.device == "cpu" else run_cuda
    cells, rows, headers, value = run(gvr, args, meta, grid)
    with open(args.bars) as f:
        bar_specs = json.load(f)["topk"][args.device]
    bars = H.evaluate_bars(bar_specs, cells, value)
    lines = [b["line"] for b in bars]
    print()
    print("\n".join(lines))
    meta["elapsed_s"] = time.perf_counter() - t0
    print(f"# total {meta['elapsed_s']:.0f} s")
    result = {"meta": meta, "cells": cells, "bars": bars, "bar_lines": lines}
    H.write_json(args.out, result)
    print(f"# wrote {args.out}")
    if args.append_results:
        write_markdown(args.append_results, meta, headers, rows, lines)
        print(f"# appended a section to {args.append_results}")
    return result


if __name__ == "__main__":
    main()
