"""What the A/B timing scripts (attn_ab.py, select_ab.py, prefetch_ab.py) share: their command line and the
timing of their cells -- per cell, warm L2 (a graph of 10 calls) and cold L2 (bench_attention's cold_graph),
µs per call, medians -- printed and written as {"cells": {name: {"warm", "cold_g"}}, "device"}, the JSON that
`gpu_check.sh attnab` compares across the installed library and the carried ones."""
import argparse
import json
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


def parser(doc):
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="NAME,NAME: these cells only")
    ap.add_argument("--reps", type=int, default=20)
    return ap


def write(path, torch, cells):
    if path:
        with open(path, "w") as f:
            json.dump({"cells": cells, "device": torch.cuda.get_device_name()}, f, indent=1)


def run_cells(torch, timer, cells, a):
    """cells: name -> a function that builds the cell and returns the call to time; a: parser()'s arguments"""
    import bench_attention as BA
    args = types.SimpleNamespace(graph_calls=10, reps=a.reps)
    only = set(a.only.split(",")) if a.only else None
    res = {}
    for name, make in cells.items():
        if only and name not in only:
            continue
        fn = make()
        fn()
        torch.cuda.synchronize()
        w = timer.graph(fn, args.graph_calls, args.reps)["median_us"]
        c = BA.cold_graph(timer, fn, args)["median_us"]
        res[name] = {"warm": w, "cold_g": c}
        print(f"{name:18s} warm {w:7.2f}  cold_g {c:7.2f}", flush=True)
    write(a.json, torch, res)
    return res
