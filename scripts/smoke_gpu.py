"""Fast GPU smoke test: a few shapes through every method, with and without prediction, compared with the
CPU path (exits 1 on a mismatch). Usage: python scripts/smoke_gpu.py"""
import argparse
import sys

import numpy as np
import torch

import gvr

argparse.ArgumentParser(description=__doc__).parse_args()  # no options: --help says what it does

rng = np.random.default_rng(0)
bad = 0
for n, b, k in ((100, 1, 7), (4096, 1, 2048), (4097, 3, 2048), (65537, 2, 2048), (131072, 1, 2048), (300000, 1, 2048),
                (131072, 4, 100), (3000, 300, 64), (200001, 40, 2048), (131072, 64, 2048), (600001, 1, 2048)):
    x = rng.standard_normal((b, n)).astype(np.float32)
    x[:, ::7] = np.round(x[:, ::7])  # ties
    ref = gvr.topk_decode(x, k)
    prev = gvr.topk_decode(x + 0.3 * rng.standard_normal(x.shape).astype(np.float32), k)
    xg = torch.from_numpy(x).cuda()
    for method in ("auto", "gvr", "radix") if n <= 16 * 32768 else ("auto", "gvr"):
        for p in (None, torch.from_numpy(prev).cuda()):
            got = gvr.topk_decode(xg, k, prev_topk=p, method=method).cpu().numpy()
            ok = all(set(got[i].tolist()) == set(ref[i].tolist()) for i in range(b))
            if not ok:
                bad += 1
                print(f"MISMATCH n={n} b={b} k={k} method={method} prev={p is not None}", flush=True)
torch.cuda.synchronize()
print("smoke:", "FAIL" if bad else "ok", flush=True)
sys.exit(1 if bad else 0)
