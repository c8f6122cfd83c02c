"""Phase timing of the topk kernels (debug build with -DGVR_PROFILE): clock64 stamps of row 0, CTA 0.
Tags: 0 start, 1 loaded, 3 guess done (cluster wait), per round 20 histogram, 21 exchange, 22 pick,
24 per-rank counts and bin edges, 23 round end, 90 candidates left and 91 chosen bin (values,
not cycles), 30 output scan (per chunk when streamed), 31 candidates arrived, 32 ranked."""
import ctypes
import os

import numpy as np
import torch

import gvr
from gvr import data

lib = ctypes.CDLL(gvr.build_info()["cuda_library"])
k = 2048
# PP_CASES="N B,N B": the cases (rows are contiguous: a length that is not a multiple of 4
# misaligns every row but row 0)
CASES = [tuple(int(v) for v in c.split()) for c in os.environ.get("PP_CASES", "4096 1,8192 1,131072 1,131072 64").split(",")]
for N, B in CASES:
    for ov in (0.45, 0.02):
        tr = list(data.decode_trace(N, 2, k=k, overlap=ov, seed=1))
        prev = torch.from_numpy(gvr.topk_decode(tr[0], k)).cuda()
        x = torch.from_numpy(np.tile(tr[1][:N], (B, 1))).cuda()
        pb = prev.expand(B, k).contiguous()
        for label, kw in (("gvr+prev", dict(prev_topk=pb, method="gvr")), ("gvr-noprev", dict(method="gvr")), ("radix", dict(method="radix"))):
            if ov == 0.02 and label != "gvr+prev":
                continue
            for _ in range(3):
                gvr.topk_decode(x, k, **kw)
            torch.cuda.synchronize()
            buf = (ctypes.c_longlong * 64)()
            lib.gvr_debug_clocks(buf)
            n = buf[63]
            t0 = buf[0] // 100
            st = " ".join(f"{buf[i] % 100}:{buf[i] // 100 - (t0 if buf[i] % 100 < 90 else 0)}" for i in range(n))
            print(f"N={N} B={B} ov={ov} {label:10s} tag:cycles {st}", flush=True)
