"""Quick CUDA timing of topk_decode paths (CUDA graphs of 20 calls, warm L2), for kernel iteration.

Environment: QB_NS / QB_BS (comma lists) restrict N and B; QB_EXTRA=e times rows of N + e elements
(contiguous, so a row stride that is not a multiple of 4 floats misaligns the rows, as in the full
benchmark's N + t rows)."""
import os
import sys
import numpy as np
import torch
import gvr
from gvr import data
from quick_gpu_bench_lib import timeit

k = 2048
print(torch.cuda.get_device_name())
NS = [int(v) for v in os.environ.get("QB_NS", "4096,8192,16384,32768,65536,131072,262144").split(",")]
BS = [int(v) for v in os.environ.get("QB_BS", "1,8,64").split(",")]
EXTRA = int(os.environ.get("QB_EXTRA", "0"))
for N0 in NS:
    N = N0 + EXTRA
    for ov in (0.45, 0.02):
        tr = list(data.decode_trace(N, 2, k=k, overlap=ov, seed=1))
        x0, x1 = tr[0][:N], tr[1][:N]
        prev = torch.from_numpy(gvr.topk_decode(x0, k)).cuda()
        for B in BS:
            xg = torch.from_numpy(np.tile(x1, (B, 1))).cuda()
            pb = prev.expand(B, k).contiguous()
            out = torch.empty((B, k), dtype=torch.int32, device="cuda")
            t_pred = timeit(lambda: gvr.topk_decode(xg, k, prev_topk=pb, out=out, method="gvr"))
            t_nop = timeit(lambda: gvr.topk_decode(xg, k, out=out, method="gvr"))
            t_rad = timeit(lambda: gvr.topk_decode(xg, k, out=out, method="radix"))
            t_torch = timeit(lambda: torch.topk(xg, k, dim=-1, sorted=False)) if "--torch" in sys.argv else float("nan")
            print(f"N={N:7d} ov={ov:.2f} B={B:3d}  gvr+prev {t_pred:7.2f}  gvr-noprev {t_nop:7.2f}  radix {t_rad:7.2f}  torch {t_torch:7.2f} us", flush=True)
