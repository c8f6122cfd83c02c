"""A small case of every CUDA kernel path, for compute-sanitizer (memcheck, racecheck, synccheck)."""
import numpy as np
import torch

import gvr
from gvr import data

rng = np.random.default_rng(0)
cases = []
for N in (3000, 70001):  # 1-CTA rows, 16-CTA clusters
    x = rng.standard_normal((2, N)).astype(np.float32)
    x[1, ::3] = 0.25  # ties at the k-th value
    cases.append(x)
cases.append(np.stack([data.adversarial("nan_heavy", 5000, k=64), data.adversarial("all_equal", 5000, k=64)]))
for x in cases:
    xg = torch.from_numpy(x).cuda()
    want = gvr.topk_decode(x, 64)
    lengths = torch.tensor([x.shape[1], x.shape[1] // 3], dtype=torch.int32, device="cuda")
    for method in ("gvr", "radix"):
        for prev in (None, torch.from_numpy(want).cuda()):
            got = gvr.topk_decode(xg, 64, prev_topk=prev, method=method).cpu().numpy()
            assert (np.sort(got, 1) == np.sort(want, 1)).all(), (x.shape, method)
            gvr.topk_decode(xg, 64, prev_topk=prev, lengths=lengths, method=method, sorted=True)
torch.cuda.synchronize()
print("sanitize case ok")
