"""Phase timing of the topk kernel (debug build with -DGVR_PROFILE): clock64 stamps of row 0, CTA 0."""
import ctypes

import numpy as np
import torch

import gvr
from gvr import data

lib = ctypes.CDLL(gvr.build_info()["cuda_library"])
k = 2048
for N in (4096, 131072):
    tr = list(data.decode_trace(N, 2, k=k, overlap=0.45, seed=1))
    prev = torch.from_numpy(gvr.topk_decode(tr[0], k)).cuda()
    for B in (1,):
        x = torch.from_numpy(np.tile(tr[1][:N], (B, 1))).cuda()
        for label, kw in (("gvr+prev", dict(prev_topk=prev.expand(B, k).contiguous())), ("radix", dict(method="radix"))):
            for _ in range(3):
                gvr.topk_decode(x, k, **kw)
            torch.cuda.synchronize()
            buf = (ctypes.c_longlong * 64)()
            lib.gvr_debug_clocks(buf)
            n = buf[63]
            t0 = buf[0] // 100
            st = " ".join(f"{buf[i] % 100}:{buf[i] // 100 - t0}" for i in range(n))
            print(f"N={N} B={B} {label:9s} tag:cycles {st}", flush=True)
