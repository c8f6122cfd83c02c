#!/usr/bin/env python3
"""Replay, in NumPy, what the streamed GVR Top-K kernel collects in its first pass: the sample's threshold
tc (kernels/topk/gvr.cuh, phase 1), the elements at or above it, and each warp's count. It tells which
path a test's rows take without a GPU:

- fewer than k at or above tc: a second pass collects [tlo, tc) (tlo from the sample's normal model, so
  that 1.5 k lie above it: kernels/topk/gvr.cuh, RECOLLECT), then as below ("second: ..."); fewer than k
  above tlo too ("below tlo") or an overflowed first pass ("below tc, overflow"): the search goes on from
  the row;
- a warp's segment overflowed: the rounds re-read the row;
- else the pairs are read in tiles of 128, 256 or 512 per warp (the smallest that holds the CTA's
  fullest warp), or several tiles of 512.

    python scripts/topk_pairs_replay.py --n 131072 --batch 64 --k 512 2048 4096 8192 16384
    python scripts/topk_pairs_replay.py --n 131072 --batch 64 --k 2048 --rows 256 --rows-from iid \
        --margin 0 2 --sample 256 512 --recollect 0 1.5   # a margin (-DGVR_TC_MARGIN), the second collection
    python scripts/topk_pairs_replay.py --n 65536 131072 262144 --batch 64 --k 2048 --rows 64 --rows-from trace45 --skew 0 0.4 0.5
                                       # tc's skewness term (-DGVR_SKEW_A; 0: the normal quantile alone)
    python scripts/topk_pairs_replay.py --n 131072 --batch 1 --k 2048 --rows-from trace45 --band 1.5 1.5 --band 0.4 1.4
                                       # register-held rows' first band instead (scripts/patches/topk_band_asym.diff)

`--rows-from iid` / `trace02|45|95`: benchmarks/bench_topk.py's workloads; `pool45`: the trace45 rows of
`bench_topk.py --pool COUNT` (both timed steps: 2 x --rows rows, of N + 1 and N + 2). Otherwise the rows are the first ones of tests/test_topk_gpu.py::test_streamed_pair_tiles (`--rows-from test`), or
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
SAMPLE = 512  # kernels/topk/gvr.cuh: the streamed rows' sample (GVR_SAMPLE_STREAM)
SAMPLE_REG = 256  # register-held rows' (GVR_SAMPLE)
RECOLLECT = 1.5  # kernels/topk/gvr.cuh: the second collection's target, in k (0: none)
SKEW_A, SKEW_CAP = 0.5, 2.0  # kernels/topk/gvr.cuh: tc's skewness term (GVR_SKEW_A; 0: the normal quantile alone)


def geometry(n, batch, sms):
    chunks = -(-n // P)
    c = max(1, min(sms // max(batch, 1), STREAM_MAX_C, chunks))
    nch = -(-chunks // c)
    cap = (COLLECT_CAP_LONG if nch >= COLLECT_LONG_NCH else COLLECT_CAP) // WARPS
    return c, nch, cap


def sample_stats(row, sample=SAMPLE):
    """mean, sd, size and skewness (third central moment / sd^3; 0 where sd is 0) of the kernel's strided
    sample (its finite values; sd about a pivot, as the kernel)"""
    n = row.size
    sm = min(n, sample)
    vals = row[(np.arange(sm, dtype=np.int64) * n) // sm].astype(np.float64)
    vals = vals[np.isfinite(vals)]
    pivot = float(row[0]) if np.isfinite(row[0]) else 0.0
    d = vals - pivot
    sd = math.sqrt(max((d * d).mean() - d.mean() ** 2, 0.0)) if vals.size else 0.0
    g = float(((d - d.mean()) ** 3).mean() / sd ** 3) if sd > 0 else 0.0
    return pivot + d.mean(), sd, vals.size, g


def threshold(row, k, factor=1.15, margin=0.0, sample=SAMPLE, skew=SKEW_A):
    """the kernel's tc: the normal quantile of the strided sample at the `factor` k-th value (1.15 in the
    kernel), lowered by `margin` standard errors of that estimate (0 in the kernel): sd * sqrt((1 + z^2 / 2)
    / m) for a normal quantile z estimated from m values; then raised by the first Cornish-Fisher term,
    sd (z^2 - 1) g / 6, g the sample's skewness times `skew` clamped to [0, 2] (kernel: GVR_SKEW_A, 0.5)"""
    mean, sd, m, g = sample_stats(row, sample)
    frac = min(max(factor * min(k, row.size) / row.size, 1e-7), 0.999999)
    z = NormalDist().inv_cdf(1.0 - frac)
    g = min(max(skew * g, 0.0), SKEW_CAP)
    return mean + sd * z - margin * sd * math.sqrt((1.0 + z * z / 2.0) / max(m, 1)) + sd * (z * z - 1.0) * g / 6.0


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


def second_threshold(row, k, tc, total, recollect=RECOLLECT, sample=SAMPLE):
    """the kernel's tlo after a first pass that left total < k at or above tc: tc lowered by the normal model's
    step (the sample's sd) from the tail share total / n (at least half an element) to recollect * k / n"""
    n = row.size
    sd = sample_stats(row, sample)[1]
    clip = lambda f: min(max(f, 1e-7), 0.999999)
    z = lambda f: NormalDist().inv_cdf(1.0 - clip(f))
    return tc - sd * (z(max(total, 0.5) / n) - z(recollect * min(k, n) / n))


def replay(row, k, c, nch, cap, recollect=RECOLLECT, **thr):
    tc = threshold(row, k, **thr)
    take = row >= np.float32(tc)
    total = int(take.sum())
    prefix = ""
    if total < min(k, row.size):
        if not recollect:
            return "below tc", total
        if any((warp_counts(take, rank, nch) > cap).any() for rank in range(c)):
            return "below tc, overflow", total
        take = row >= np.float32(second_threshold(row, k, tc, total, recollect, thr.get("sample", SAMPLE)))
        total = int(take.sum())
        if total < min(k, row.size):
            return "below tlo", total
        prefix = "second: "
    fullest = 0
    for rank in range(c):
        wc = warp_counts(take, rank, nch)
        if (wc > cap).any():
            return prefix + "overflow", total
        fullest = max(fullest, int(wc.max()))
    tile = next((f"tile {w}" for w in (128, 256, 512) if fullest <= w), f"{-(-fullest // 512)} tiles of 512")
    return prefix + tile, total


def band_stats(x, k, bands):
    """register-held rows' first round (no hint): where the k-th value lies from the sample's center (the
    1.15 k estimate), in sample sd, and the share of each row inside center - lo sd .. center + hi sd"""
    offs, shares = [], {b: [] for b in bands}
    for row in x:
        sd = sample_stats(row, SAMPLE_REG)[1]
        center = threshold(row, k, sample=SAMPLE_REG, skew=0.0)  # register-held rows: no skewness term
        offs.append((float(np.sort(row)[-k]) - center) / sd)
        for lo, hi in bands:
            shares[(lo, hi)].append(float(np.mean((row >= center - lo * sd) & (row <= center + hi * sd))))
    print(f"  k={k}: the k-th value lies {min(offs):+.2f} / {np.median(offs):+.2f} / {max(offs):+.2f} sd from the "
          f"center (min / median / max); share of the row in the band: "
          + ", ".join(f"[-{lo}, +{hi}] sd {np.mean(v):.3f}" for (lo, hi), v in shares.items()))


def rows(kind, batch, n, count, k):
    from gvr import data
    if kind.startswith("trace"):  # benchmarks/bench_topk.py's trace workloads (their first step)
        return data.decode_trace_batch(count, n, 1, k=k, overlap=int(kind[5:]) / 100, seed=0)[0]
    if kind == "pool45":  # bench_topk.py --pool's trace45 rows: rho calibrated on row 0, steps 1 and 2 (N + 1, N + 2)
        rho = float(data.rho_for_overlap(0.45, n, k=k, seed=0))
        tr = data.decode_trace_batch(count, n, 3, k=k, seed=0, rho=rho)
        return [np.asarray(r, dtype=np.float32) for t in (1, 2) for r in tr[t]]
    if kind == "iid":  # bench_topk's iid workload: fresh N(0, 1) rows
        return data.iid_scores(count, n, dist="normal", seed=17)
    if kind == "test":
        x = data.iid_scores(batch, n, dist="normal", seed=21)[:count]
    else:
        x = np.random.default_rng(0).standard_normal((count, n)).astype(np.float32)
    x[:, ::4] = np.round(x[:, ::4] * 4) / 4
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", required=True,
                    help="row lengths (each in turn: a threshold term must hold at every N it runs at -- the "
                         "k-th value's z grows with N, and so do the moment terms; session 29 learned it on the GPU)")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--k", type=int, nargs="+", required=True)
    ap.add_argument("--rows", type=int, default=16, help="rows replayed (the first ones of the batch)")
    ap.add_argument("--rows-from", choices=("test", "sanitize", "iid", "trace02", "trace45", "trace95", "pool45"), default="test",
                    help="iid / traceNN: benchmarks/bench_topk.py's workloads (k is the trace's calibration k)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--factor", type=float, nargs="+", default=[1.15], help="tc's target rank, in k (kernel: 1.15)")
    ap.add_argument("--margin", type=float, nargs="+", default=[0.0],
                    help="tc lowered by this many standard errors of the sample's quantile estimate (kernel: 0)")
    ap.add_argument("--sample", type=int, nargs="+", default=[SAMPLE], help="strided sample size (kernel: 512)")
    ap.add_argument("--skew", type=float, nargs="+", default=[SKEW_A],
                    help="tc's skewness factor (kernel: GVR_SKEW_A, 0.5; 0: the normal quantile alone)")
    ap.add_argument("--recollect", type=float, nargs="+", default=[RECOLLECT],
                    help="rows below tc: the second collection's target rank, in k (kernel: 1.5; 0: none)")
    ap.add_argument("--band", type=float, nargs=2, action="append", metavar=("LO", "HI"),
                    help="instead: register-held rows' first band [center - LO sd, center + HI sd] (repeatable)")
    a = ap.parse_args()
    for n in a.n:
        replay_n(a, n)


def replay_n(a, n):
    """the replay's table (or --band's) for rows of length n"""
    if a.band:
        print(f"N={n}: {a.rows} rows from {a.rows_from}; the sample's center and sd ({SAMPLE_REG} strided values)")
        for k in a.k:
            band_stats(rows(a.rows_from, a.batch, n, a.rows, k), k, [tuple(b) for b in a.band])
        return
    c, nch, cap = geometry(n, a.batch, a.sms)
    print(f"N={n} B={a.batch}: clusters of {c} CTAs, {nch} chunks each, segments of {cap} pairs per warp; "
          f"{a.rows} rows from {a.rows_from}")
    for k in a.k:
        x = rows(a.rows_from, a.batch, n, a.rows, k)
        for f in a.factor:
            for m in a.margin:
                for sm, rc, sk in ((sm, rc, sk) for sm in a.sample for rc in a.recollect for sk in a.skew):
                    paths = {}
                    ratios = []
                    for row in x:
                        path, total = replay(row, k, *geometry(row.size, a.batch, a.sms), rc, factor=f, margin=m,
                                             sample=sm, skew=sk)
                        paths[path] = paths.get(path, 0) + 1
                        ratios.append(total / k)
                    shown = ", ".join(f"{p}: {cnt}" for p, cnt in sorted(paths.items()))
                    q = np.percentile(ratios, [0, 50, 100])
                    print(f"  k={k} factor {f} margin {m} sample {sm} recollect {rc} skew {sk}: collected {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} k "
                          f"(min / median / max); rows per path: {shown}", flush=True)


if __name__ == "__main__":
    main()
