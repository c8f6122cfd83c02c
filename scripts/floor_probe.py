"""Small-N floor: the same call at N and N+1 (row length not a multiple of 4), CUDA graph of 20 calls."""
import numpy as np
import torch

import gvr
from gvr import data
from quick_gpu_bench_lib import timeit

k = 2048
for N in (4096, 16384, 65536, 131072):
    tr = list(data.decode_trace(N, 2, k=k, overlap=0.45, seed=1))
    for n in (N, N + 1):
        x = torch.from_numpy(np.ascontiguousarray(tr[1][:n])).cuda()[None]
        prev = torch.from_numpy(gvr.topk_decode(tr[0][:n], k)).cuda()[None]
        out = torch.empty((1, k), dtype=torch.int32, device="cuda")
        ts = {m: timeit(lambda: gvr.topk_decode(x, k, prev_topk=prev, out=out, method=m)) for m in ("gvr", "radix")}
        print(f"n={n:7d} " + "  ".join(f"{m} {t:6.2f}" for m, t in ts.items()) + " us", flush=True)
