"""Phase timing of the topk kernels (debug build with -DGVR_PROFILE): clock64 stamps of row 0, CTA 0.
Tags: 0 start, 1 loaded, 3 guess done (cluster wait), per round 20 histogram, 21 exchange, 22 pick,
23 round end, 90 candidates left (value, not cycles), 30 output scan, 31 candidates arrived, 32 ranked."""
import ctypes

import numpy as np
import torch

import gvr
from gvr import data

lib = ctypes.CDLL(gvr.build_info()["cuda_library"])
k = 2048
rng = np.random.default_rng(5)
for n in (4097, 8193):
    x0, x1 = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    prev = torch.from_numpy(gvr.topk_decode(x0, k)).cuda()
    x = torch.from_numpy(x1)[None].cuda()
    for label, kw in (("iid+prev", dict(prev_topk=prev[None])), ("iid-noprev", dict(method="gvr"))):
        for _ in range(3):
            gvr.topk_decode(x, k, **kw)
        torch.cuda.synchronize()
        buf = (ctypes.c_longlong * 64)()
        lib.gvr_debug_clocks(buf)
        m = buf[63]
        t0 = buf[0] // 100
        print(f"N={n} {label:10s} tag:cycles " + " ".join(f"{buf[i] % 100}:{buf[i] // 100 - (t0 if buf[i] % 100 < 90 else 0)}" for i in range(m)), flush=True)
for N in (4096, 16384, 131072):
    for ov in (0.45, 0.02):
        tr = list(data.decode_trace(N, 2, k=k, overlap=ov, seed=1))
        prev = torch.from_numpy(gvr.topk_decode(tr[0], k)).cuda()
        x = torch.from_numpy(np.ascontiguousarray(tr[1][:N]))[None].cuda()
        for label, kw in (("gvr+prev", dict(prev_topk=prev[None])), ("gvr-noprev", dict(method="gvr")), ("radix", dict(method="radix"))):
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
            print(f"N={N} ov={ov} {label:10s} tag:cycles {st}", flush=True)
