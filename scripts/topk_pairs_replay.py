#!/usr/bin/env python3
"""Replay, in NumPy, what the streamed GVR Top-K kernel collects in its first pass: the sample's threshold
tc (kernels/topk/gvr.cuh, phase 1), the elements at or above it, and each warp's count. It tells which
path a test's rows take without a GPU:

- fewer than k at or above tc: the search goes on below tc, from the row;
- a warp's segment overflowed: the rounds re-read the row;
- else the pairs are read in tiles of 128, 256 or 512 per warp (the smallest that holds the CTA's
  fullest warp), or several tiles of 512.

    python scripts/topk_pairs_replay.py --n 131072 --batch 64 --k 512 2048 4096 8192 16384

The rows are the first ones of tests/test_topk_gpu.py::test_streamed_pair_tiles (`--rows-from test`), or
rows drawn like scripts/sanitize_case.py's pair-tile case (`--rows-from sanitize`: the same distribution,
not the same rows, whose generator serves earlier cases first). The geometry is the launcher's
(kernels/topk/topk.cu, plan_gvr) on a GPU of --sms SMs, assuming the streamed kernel and rows that start on
a 16-byte boundary. The statistics are in float64 and the kernel's in float32 (fast reciprocals), so a
row whose count lies within a few elements of a tile's edge can land on the other side of it.
"""
import argparse
import math
from statistics import NormalDist

import numpy as np

THREADS, VEC = 512, 4
P = THREADS * 4 * VEC  # positions per chunk
WARPS = THREADS // 32
STREAM_MAX_C = 8
COLLECT_CAP, COLLECT_CAP_LONG, COLLECT_LONG_NCH = 8192, 16384, 10  # kernels/topk/launch.h
SAMPLE = 256


def geometry(n, batch, sms):
    chunks = -(-n // P)
    c = max(1, min(sms // max(batch, 1), STREAM_MAX_C, chunks))
    nch = -(-chunks // c)
    cap = (COLLECT_CAP_LONG if nch >= COLLECT_LONG_NCH else COLLECT_CAP) // WARPS
    return c, nch, cap


def threshold(row, k):
    """the kernel's tc: the normal quantile of the strided sample at the 1.15 k-th value"""
    n = row.size
    sm = min(n, SAMPLE)
    sample = row[(np.arange(sm, dtype=np.int64) * n) // sm].astype(np.float64)
    sample = sample[np.isfinite(sample)]
    pivot = float(row[0]) if np.isfinite(row[0]) else 0.0
    d = sample - pivot
    mean = pivot + d.mean()
    sd = math.sqrt(max((d * d).mean() - d.mean() ** 2, 0.0))
    frac = min(max(1.15 * min(k, n) / n, 1e-7), 0.999999)
    return mean + sd * NormalDist().inv_cdf(1.0 - frac)


def warp_counts(take, rank, nch):
    """pairs collected by each warp of CTA `rank`: per chunk, warp w holds 4 runs of 128 positions"""
    n = take.size
    counts = np.zeros(WARPS, np.int64)
    for c in range(nch):
        base = (rank * nch + c) * P
        for j in range(VEC):
            for w in range(WARPS):
                lo = base + (j * THREADS + w * 32) * 4
                if lo < n:
                    counts[w] += int(take[lo:min(lo + 128, n)].sum())
    return counts


def replay(row, k, c, nch, cap):
    tc = threshold(row, k)
    take = row >= np.float32(tc)
    total = int(take.sum())
    if total < min(k, row.size):
        return "below tc", total
    fullest = 0
    for rank in range(c):
        wc = warp_counts(take, rank, nch)
        if (wc > cap).any():
            return "overflow", total
        fullest = max(fullest, int(wc.max()))
    if fullest <= 128:
        return "tile 128", total
    if fullest <= 256:
        return "tile 256", total
    return ("tile 512" if fullest <= 512 else f"{-(-fullest // 512)} tiles of 512"), total


def rows(kind, batch, n, count):
    if kind == "test":
        from gvr import data
        x = data.iid_scores(batch, n, dist="normal", seed=21)[:count]
    else:
        x = np.random.default_rng(0).standard_normal((count, n)).astype(np.float32)
    x[:, ::4] = np.round(x[:, ::4] * 4) / 4
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--k", type=int, nargs="+", required=True)
    ap.add_argument("--rows", type=int, default=16, help="rows replayed (the first ones of the batch)")
    ap.add_argument("--rows-from", choices=("test", "sanitize"), default="test")
    ap.add_argument("--sms", type=int, default=132)
    a = ap.parse_args()
    c, nch, cap = geometry(a.n, a.batch, a.sms)
    print(f"N={a.n} B={a.batch}: clusters of {c} CTAs, {nch} chunks each, segments of {cap} pairs per warp")
    x = rows(a.rows_from, a.batch, a.n, a.rows)
    for k in a.k:
        paths = {}
        ratios = []
        for row in x:
            path, total = replay(row, k, c, nch, cap)
            paths[path] = paths.get(path, 0) + 1
            ratios.append(total / k)
        shown = ", ".join(f"{p}: {m}" for p, m in sorted(paths.items()))
        print(f"  k={k}: collected {min(ratios):.2f}-{max(ratios):.2f} k; rows per path: {shown}")


if __name__ == "__main__":
    main()
