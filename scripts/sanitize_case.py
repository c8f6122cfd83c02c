"""A small case of every CUDA kernel path (radix, GVR in registers, GVR streamed, sorted output, row
offsets) for compute-sanitizer. Usage: compute-sanitizer --tool memcheck python scripts/sanitize_case.py"""
import argparse

import numpy as np
import torch

import gvr
from gvr import data

argparse.ArgumentParser(description=__doc__).parse_args()  # no options: --help says what it does

rng = np.random.default_rng(0)
cases = []
for N in (3000, 70001):  # 1-CTA rows, 16-CTA clusters
    x = rng.standard_normal((2, N)).astype(np.float32)
    x[1, ::3] = 0.25  # ties at the k-th value
    cases.append(x)
cases.append(np.stack([data.adversarial("nan_heavy", 5000, k=64), data.adversarial("all_equal", 5000, k=64)]))
cases.append(np.stack([data.adversarial("all_equal", 20001, k=64), data.adversarial("nan_heavy", 20001, k=64)]))
# streamed GVR kernel: one CTA per row (300 rows), and 3-CTA clusters re-reading 200K rows in chunks
cases.append(rng.standard_normal((300, 3000)).astype(np.float32))
cases.append(rng.standard_normal((40, 200001)).astype(np.float32))
for x in cases:
    xg = torch.from_numpy(x).cuda()
    want = gvr.topk_decode(x, 64)
    n = x.shape[1]
    # full rows, a third, short rows (candidates only), rows of exactly k and fewer (every element)
    all_lengths = ([n, n // 3], [200, 0], [64, 50])
    for method in ("gvr", "radix"):
        for prev in (None, torch.from_numpy(want).cuda()):
            got = gvr.topk_decode(xg, 64, prev_topk=prev, method=method).cpu().numpy()
            assert (np.sort(got, 1) == np.sort(want, 1)).all(), (x.shape, method)
            for ln in all_lengths:
                ln = np.resize(np.array(ln, dtype=np.int32), x.shape[0])  # one length per row
                lengths = torch.from_numpy(ln).cuda()
                got = gvr.topk_decode(xg, 64, prev_topk=prev, lengths=lengths, method=method, sorted=True).cpu().numpy()
                exp = gvr.topk_decode(x, 64, lengths=ln, sorted=True)
                assert (got == exp).all(), (x.shape, method, ln)
# rows starting 1..3 floats past a 16-byte boundary (aligned-coordinate loads: the first and last
# float4 of a row are partial), one CTA and a cluster per row, every method
for N in (3001, 40003):
    flat = rng.standard_normal(2 * (N + 1) + 3).astype(np.float32)
    fg = torch.from_numpy(flat).cuda()
    for s in (1, 2, 3):
        view = fg.as_strided((2, N), (N + 1, 1), s)
        x = view.cpu().numpy()
        want = gvr.topk_decode(x, 64)
        for method in ("auto", "gvr", "radix"):
            got = gvr.topk_decode(view, 64, method=method).cpu().numpy()
            assert (np.sort(got, 1) == np.sort(want, 1)).all(), (N, s, method)
torch.cuda.synchronize()
print("sanitize case ok")
