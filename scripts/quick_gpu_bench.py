#!/usr/bin/env python3
"""Quick CUDA timing table of gvr.topk_decode (CUDA graphs of --calls back-to-back calls, warm L2):
gvr+prev / gvr / radix (/ torch.topk) per (N, overlap, B), for kernel iteration and before/after tables.

    python scripts/quick_gpu_bench.py [--n 4096 65536 ...] [--batch 1 8 64] [--extra 0 1] [--torch] [--json PATH]
        [--cols gvr ...] [--cache DIR]
    python scripts/quick_gpu_bench.py --compare OLD.json NEW.json [NEWER.json ...]    (no GPU needed)

Runs against any installed gvr with the Python API gvr.topk_decode(x, k, prev_topk=, out=, method=)
(older builds included: the timing harness is loaded by file path from this checkout, not from gvr).
Rows are decode-trace steps (gvr.data.decode_trace, seed 1) tiled over B; --extra e times rows of
N + e elements (contiguous, so a row stride that is not a multiple of 4 floats misaligns the rows;
several values: each in turn). --cache DIR keeps the generated rows and hints as .npy files there (an
A/B runs this script once per library: the traces' calibration is then paid once); --cols picks columns.
--rows iid times B distinct N(0, 1) rows instead (gvr.data.iid_scores, seed 5; the hint: the Top-K of
another draw; --overlap is not used): a batch is as slow as its slowest row, and tiled rows hide that.
--rows traces times B distinct decode-trace rows (gvr.data.decode_trace_batch, seed 1, rho calibrated
once on row 0 for each overlap, the largest B generated once and its first B rows timed; the hint: each
row's previous step), as a serving batch of B requests has them. --generate-only --cache DIR fills DIR
and times nothing (64 trace rows at 64K-256K take minutes; gpu_check.sh topkabq runs it first).
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _harness as H  # noqa: E402

COLS = ("gvr_prev", "gvr", "radix", "torch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072, 262144], help="row lengths N")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="batch sizes B")
    p.add_argument("--overlap", type=float, nargs="+", default=[0.45, 0.02], help="target step-to-step Top-K overlaps")
    p.add_argument("--extra", type=int, nargs="+", default=[0], help="time rows of N + EXTRA elements (each value)")
    p.add_argument("--cols", nargs="+", choices=COLS, default=["gvr_prev", "gvr", "radix"],
                   help="the columns timed (torch also with --torch)")
    p.add_argument("--cache", metavar="DIR", help="load the rows and hints from DIR, or generate and save them there")
    p.add_argument("--rows", choices=("tiled", "iid", "traces"), default="tiled",
                   help="tiled: one decode-trace row per (N, overlap) repeated B times; iid: B distinct N(0, 1) rows; "
                   "traces: B distinct decode-trace rows")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--method", default="gvr", help="method of the gvr+prev and gvr columns (default 'gvr': the GVR kernel forced)")
    p.add_argument("--torch", action="store_true", help="also time torch.topk(x, k, sorted=False)")
    p.add_argument("--calls", type=int, default=20, help="calls captured per CUDA graph")
    p.add_argument("--replays", type=int, default=5, help="timed replays (median)")
    p.add_argument("--json", metavar="PATH", help="write the table and the header as JSON")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="print the cells of earlier --json runs side by side")
    p.add_argument("--generate-only", action="store_true",
                   help="with --cache: generate the rows and hints into DIR and time nothing (no GPU needed), so that "
                   "later runs with the same arguments only load them")
    return p.parse_args(argv)


def compare(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    key = lambda r: (r["n"], r["overlap"], r["b"])  # noqa: E731
    tables = [{key(r): r for r in run["rows"]} for run in runs]
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    for i, (name, run) in enumerate(zip(names, runs)):
        m = run["meta"]
        print(f"# {chr(65 + i)} = {name}: {m.get('device_name')} {m.get('date')} gvr {m.get('gvr_file')} "
              f"sources {m.get('source_digest')}")
    cols = [c for c in COLS if any(r.get(c) is not None for r in runs[0]["rows"])]
    headers = ["N", "ov", "B"] + [f"{c} {chr(65 + i)}" for c in cols for i in range(len(runs))] + \
        [f"{c} {chr(66 + i)}/A" for c in cols for i in range(len(runs) - 1)]
    rows = []
    for kk in sorted(tables[0]):
        r = [kk[0], f"{kk[1]:.2f}", kk[2]]
        vals = {c: [t.get(kk, {}).get(c) for t in tables] for c in cols}
        r += [H.fmt_us(v) if v is None else f"{v:.2f}" for c in cols for v in vals[c]]
        r += [H.fmt_x(H.ratio(v, vals[c][0])) for c in cols for v in vals[c][1:]]
        rows.append(r)
    print(H.format_table(headers, rows, min_width=5))
    print("times: median us per call (CUDA graph replays); X/A = time in run X / time in run A")


def main(argv=None):
    a = parse_args(argv)
    if a.compare:
        return compare(a.compare)
    if a.generate_only and not a.cache:
        raise SystemExit("--generate-only needs --cache DIR")
    import gvr
    from gvr import data

    if a.generate_only:
        torch = timer = None
    else:
        import torch

        inside = os.path.abspath(gvr.__file__).startswith(ROOT + os.sep)
        meta = H.header(torch, ROOT if inside else None, cuda=True)
        meta["args"] = vars(a)
        print(H.header_line(meta))
        print(f"# gvr from {gvr.__file__}; k={a.k}; CUDA graphs of {a.calls} calls, median of {a.replays} replays, us per call; "
              f"gvr+prev and gvr: method={a.method!r}", flush=True)
        timer = H.CudaTimer(torch, flush_bytes=0)
    k, rows = a.k, []

    def cached(name, make):
        """make() (a NumPy array), or its copy saved in --cache DIR under name"""
        path = os.path.join(a.cache, name + ".npy") if a.cache else None
        if path and os.path.exists(path):
            return np.load(path)
        arr = np.asarray(make())
        if path:
            os.makedirs(a.cache, exist_ok=True)
            np.save(path + ".tmp.npy", arr)
            os.replace(path + ".tmp.npy", path)
        return arr

    def iid_rows(b, n):
        """--rows iid: B distinct N(0, 1) rows (seed 5) and their hint (the Top-K of another draw, seed 6)"""
        return (cached(f"iid_{b}_{n}_5", lambda: data.iid_scores(b, n, seed=5)),
                cached(f"iidhint_{b}_{n}_{k}", lambda: gvr.topk_decode(data.iid_scores(b, n, seed=6), k)))

    for n in [n0 + e for n0 in a.n for e in a.extra]:
        for ov in (a.overlap if a.rows != "iid" else [0.0]):
            if a.rows == "traces":
                bmax = max(a.batch)

                def traces(n=n, ov=ov, bmax=bmax):
                    rho = float(data.rho_for_overlap(ov, n, k=k, seed=1))
                    tr = data.decode_trace_batch(bmax, n, 2, k=k, seed=1, rho=rho)
                    return np.stack([tr[0][:, :n], tr[1][:, :n]])
                xb = cached(f"traces_{bmax}_{n}_{ov:.2f}_{k}", traces)
                hb = cached(f"traceshint_{bmax}_{n}_{ov:.2f}_{k}", lambda: gvr.topk_decode(xb[0], k))
            if a.rows == "tiled":
                def trace(n=n, ov=ov):
                    tr = list(data.decode_trace(n, 2, k=k, overlap=ov, seed=1))
                    return np.stack([tr[0][:n], tr[1][:n]])
                x01 = cached(f"trace_{n}_{ov:.2f}_{k}", trace)
                x1 = x01[1]
                hint = cached(f"hint_{n}_{ov:.2f}_{k}", lambda: gvr.topk_decode(x01[0], k))
            if a.generate_only:
                if a.rows == "iid":
                    for b in a.batch:
                        iid_rows(b, n)
                print(f"# N={n} overlap {ov:.2f}: rows in {a.cache}", flush=True)
                continue
            if a.rows == "tiled":
                prev = torch.from_numpy(hint).cuda()
            for b in a.batch:
                if a.rows == "tiled":
                    xg = torch.from_numpy(np.tile(x1, (b, 1))).cuda()
                    pb = prev.expand(b, k).contiguous()
                elif a.rows == "traces":
                    xg = torch.from_numpy(np.ascontiguousarray(xb[1][:b])).cuda()
                    pb = torch.from_numpy(np.ascontiguousarray(hb[:b])).cuda()
                else:
                    xg, pb = (torch.from_numpy(v).cuda() for v in iid_rows(b, n))
                out = torch.empty((b, k), dtype=torch.int32, device="cuda")
                fns = {
                    "gvr_prev": lambda: gvr.topk_decode(xg, k, prev_topk=pb, out=out, method=a.method),
                    "gvr": lambda: gvr.topk_decode(xg, k, out=out, method=a.method),
                    "radix": lambda: gvr.topk_decode(xg, k, out=out, method="radix"),
                }
                fns = {c: f for c, f in fns.items() if c in a.cols}
                if a.torch:
                    fns["torch"] = lambda: torch.topk(xg, k, dim=-1, sorted=False)
                r = {"n": n, "overlap": ov, "b": b, "rows": a.rows}
                for name, fn in fns.items():
                    r[name] = timer.graph(fn, a.calls, a.replays)["median_us"]
                rows.append(r)
                print(f"N={n:7d} ov={ov:.2f} B={b:3d}  " + "  ".join(
                    f"{c} {r[c]:7.2f}" for c in ("gvr_prev", "gvr", "radix", "torch") if c in r) + " us", flush=True)
    if a.json and not a.generate_only:
        H.write_json(a.json, {"meta": meta, "rows": rows})
        print(f"# wrote {a.json}")


if __name__ == "__main__":
    main()
