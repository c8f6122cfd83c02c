"""Time PRR's selection kernels (gvr.prr.block_metadata build and update, block_scores) on CUDA for a
bf16 and an fp8 (e4m3fn) K cache: B 8, Hq 32, Hkv 8, D 128, 64-token pages, 128K tokens per row, 64-token
metadata blocks; CUDA events around graphs of 20 calls, median of 10 replays, µs per call.
    python scripts/time_select.py [--json PATH]"""
import argparse
import json

import torch

import gvr

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--json", default=None)
a = ap.parse_args()
B, HQ, HKV, D, P, G, CTX = 8, 32, 8, 128, 64, 64, 131072
dev = "cuda"
pages = B * CTX // P
gen = torch.Generator(device=dev).manual_seed(0)
k16 = torch.randn(pages, P, HKV, D, generator=gen, device=dev, dtype=torch.bfloat16)
k8 = (k16.float() * 50).clamp_(-448, 448).to(torch.float8_e4m3fn)
bt = torch.randperm(pages, generator=gen, device=dev).int().view(B, CTX // P)
lengths = torch.full((B,), CTX - 100, dtype=torch.int32, device=dev)
new = lengths + 1
q = torch.randn(B, HQ, D, generator=gen, device=dev, dtype=torch.bfloat16)


def timed(fn, calls=20, reps=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / calls)
    return sorted(ts)[len(ts) // 2]


res = {}
for name, k in (("bf16", k16), ("fp8", k8)):
    try:
        meta = gvr.prr.block_metadata(k, bt, lengths, block_size=G)
    except Exception as e:  # a library without fp8 selection (an A/B baseline)
        print(f"{name}: {type(e).__name__}: {e}")
        continue
    out = torch.empty_like(meta)
    res[f"{name}_metadata_build"] = timed(lambda: gvr.prr.block_metadata(k, bt, lengths, block_size=G, out=out))
    res[f"{name}_metadata_update"] = timed(lambda: gvr.prr.update_block_metadata(meta, k, bt, lengths, new, block_size=G))
    sc = torch.empty(B, HKV, meta.shape[2], device=dev)
    res[f"{name}_scores"] = timed(lambda: gvr.prr.block_scores(q, meta, lengths, block_size=G, out=sc))
for kk, v in res.items():
    print(f"{kk:24s} {v:8.2f} us")
if a.json:
    json.dump(res, open(a.json, "w"), indent=1)
